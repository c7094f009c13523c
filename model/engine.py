"""The generation engine: continuous batching over preallocated slot state and paged keys, token ids only.

    engine.add(Request) at any time  ->  engine.step() ... each returns the requests that finished in it
    a step = one packed prefill forward: chunks of the prefilling requests, up to a token budget
           | one decode step over every decoding slot: a denoising step (diffusion), one token (autoregressive)
             or one verified round (verified: preview forwards draft a block's unverified positions, one
             causal forward checks them; a block is committed in the next step's first forward once complete)

Notable choices:
- Memory (slots.py, pages.py): each slot holds a sequence's fixed-size state (GDN recurrent and conv state, the
  decode block, saved logits), and attention keys and values live in pages of `page_size` positions from one
  pool, taken as a sequence grows and given back as its window slides past them or when it leaves. The budget
  (`memory_budget_bytes`) pays for at most `max_slots` slots and then for pages, as many as there are, up to a
  full window for every slot; the pool always holds at least one sequence's full window.
- Admission: a waiting request takes a free slot when the pool has the pages its first prefill chunk and first
  block need, plus a reserve (`RESERVE_FRACTION` of the pool, at least one page) for the sequences already
  running, unless nothing is running. Pages are taken before every forward for what it will write; when the pool
  runs dry, the newest sequence (the last admitted) is preempted: its slot and pages are given back and it is
  queued again at its original place, to be recomputed from its prompt later (as vLLM's recompute preemption; its
  output is the one it gets alone, since its generation restarts whole).
- Decoding sequences occupy slots [0, n), so a decode step reads and writes views: when one finishes, the last one
  is moved into its slot (its GDN state is copied, its pages change hands). Prefilling sequences sit in the slots
  after them, contiguous, and join the decoding range when their prompt is in.
- Prefill is packed (vLLM's varlen prefill): a prefill step takes chunks of every prefilling request, first come
  first served, each at most `prefill_chunk_tokens`, up to `prefill_tokens_per_step` tokens in all, and runs them
  as one forward along one token axis with their sequence boundaries: no padding runs through a GDN recurrence,
  and attention is masked per sequence.
- Policy: with sequences decoding, a prefill step follows every `decode_steps_per_prefill` decode steps, so long
  prompts prefill in chunks while the others keep decoding; with none decoding, prefill runs back to back.
  0 means prefill whenever there is prefill work (fill the slots first). bench/engine.py measures the choices.
- A diffusion block that finished in one step is committed by the next step's forward, the one in which the other
  rows take their denoising steps (per-row commit, slots.py): no separate commit forward, and every forward runs
  over all decoding rows. With `merge_commits` (default on CUDA) that forward carries two blocks per row, and a
  committing row also takes its next block's first denoising step in it: at k=8 a 32-token block then costs a row
  4 forwards instead of 5. A sequence's last block is committed only to score it (shifted models, mean_logprob).
- One host sync per decode step: after the forward, tokens, confidences and the block updates are computed on the
  device for all rows, and one read-back brings the blocks (or tokens) and the done flags to the host. Everything
  the host sends (token ids, committing rows, block limits, new page-table entries) is copied before the forward
  is queued, since a host to device copy queued behind the forward would wait for it. Not counted: the fp32
  grouped expert GEMM on CUDA (the reference loop reads expert offsets back; bf16 uses the grouped kernel) and
  flex_attention's first call of a shape (compilation).
- Verified decoding (`mode: verified`) gives the autoregressive output token for token. A block's first token is
  the trunk's greedy choice from the saved logits of the last committed position. A step is a round per row: the
  preview drafts the block's unverified positions (threshold or k per step, as diffusion does; rows in lockstep
  until every draft is full), then one causal forward over every row's block, writing no state, gives the trunk's
  choice after each position, penalised with the counts of the response before it. The drafted run the trunk
  agrees with is verified, and the trunk's own token after it too; the positions after that are drafted again in
  the next round, the verified ones staying as known positions. A block is committed once all of it is verified,
  in the next step's first forward: beside the others' previews (a commit row drafts nothing in it, and its check
  adds the trunk's token after its new block's first), or with `merge_commits` together with its next block's
  first preview, as diffusion's merged commit. The keys a check writes past the committed length are overwritten
  before any query sees them. Why not commit after every check: docs/architecture.md section 3, measured.
- Sampling (temperature > 0) draws from each request's own generator, seeded from its `seed` (or from the
  options' seed and its id), so a request gets the same output whatever else is in flight.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .clover import CloverModel
from .graphs import StaticDecode, graphs_wanted
from .options import DecodeOptions
from .pages import PoolExhausted, pages_for
from .sampling import apply_penalties, pick_tokens, select_block_positions
from .slots import SlotBytes, SlotState, slot_bytes, table_columns

log = logging.getLogger(__name__)

DEFAULT_MAX_SLOTS = 64  # when max_slots is not given: as many as fit, up to this
CUDA_BUDGET_FRACTION = 0.8  # of the device memory free when the engine starts (the rest: activations, fragmentation)
CPU_BUDGET_FRACTION = 0.5  # of the RAM available when the engine starts
PAGE_SIZE = 256  # positions per page of keys and values (a multiple of flex_attention's 128-token blocks)
FLEX_KEY_BLOCK = 128  # a page of more positions must hold whole key blocks of flex attention (ops.FLEX_BLOCK)
RESERVE_FRACTION = 0.01  # of the pool kept free at admission for the running sequences' growth (vLLM's watermark)


@dataclass(frozen=True)
class Request:
    id: str  # unique among the requests in flight
    prompt_ids: list[int]
    seed: int | None = None  # sampling stream; None: derived from the options' seed and the id
    max_new_tokens: int | None = None  # this request's budget; None: the options'


@dataclass
class Generation:
    tokens: list[int]  # generated ids, cut before the first stop token
    forward_passes: int  # forward calls this sequence took part in (prefill chunks, steps, commits)
    denoising_steps: int  # decode steps (autoregressive: one per token)
    prompt_tokens: int
    prefill_seconds: float  # this sequence's prefill forwards
    decode_seconds: float  # its share of every decode step it took part in (step time / rows in the step)
    windows: int  # ceil(prompt_tokens / window_tokens): attention windows the prompt spans
    stopped: str  # "eos" (a stop token was generated) or "length" (max_new_tokens reached)
    decode_batch: int = 1  # the most sequences in any decode step this one took part in
    decode_forwards: int = 0  # forward calls of its decode steps (forward_passes without its prefill chunks)
    # verified mode: checks of a draft by the trunk (one per round), the tokens they verified (the drafted run the
    # trunk agreed with, the trunk's own token after it, and a block's first token), and checks that rejected no
    # drafted token
    verified_blocks: int = 0
    accepted_tokens: int = 0
    full_blocks: int = 0
    # mean log-probability of `tokens` under the model's causal trunk (None: a diffusion model whose causal
    # logits do not score the next token, or no tokens): measured, not a sampling score; a wrong preview operator
    # writes tokens the exact trunk finds improbable
    mean_logprob: float | None = None


@dataclass
class EngineStats:
    prefill_steps: int = 0
    decode_steps: int = 0
    forwards: int = 0  # forward passes (each prefill piece, each decode step; verified: each of a step's forwards)
    prefill_tokens: int = 0
    decode_rows: int = 0  # sum over decode steps of the rows in the step
    most_active: int = 0  # most sequences holding a slot at once
    moves: int = 0  # slot copies (compaction)
    preemptions: int = 0  # sequences sent back to the queue when the pool ran dry
    peak_pages: int = 0  # most pages held at once
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    verified_blocks: int = 0  # verified mode: drafts checked (one per row per step)
    accepted_tokens: int = 0  # tokens those checks verified
    full_blocks: int = 0  # checks that rejected no drafted token
    decode_tokens: int = 0  # tokens generated by decode steps


class EngineCapacityError(ValueError):
    """The engine cannot hold even one sequence in its memory budget."""


@dataclass(eq=False)  # identity: the engine finds a request's record in its queues by the object itself
class _Live:
    """Bookkeeping of one request from add() to its result."""

    req: Request
    order: int  # admission order (first come, first served; also the order after a restart)
    generator: torch.Generator | None
    prefill_target: int  # prompt tokens prefill commits (diffusion: up to the last whole block)
    max_new: int  # most tokens to generate
    slot: int = -1
    length: int = 0  # committed tokens (== the slot's position)
    out: list[int] = field(default_factory=list)
    tail: int = 0  # diffusion: prompt tokens at the start of the current block
    commit_next: bool = False  # diffusion, verified: the current block is finished; the next forward commits it
    known: int = 0  # verified: the block's leading positions the trunk has verified
    room: int = 0  # verified: positions of the current block that may be filled (its limit)
    next_token: int = -1  # autoregressive: the token just sampled, fed in the step's forward
    forwards: int = 0
    decode_forwards: int = 0
    steps: int = 0
    blocks: int = 0  # verified: checks, tokens they verified, checks that rejected no drafted token
    accepted: int = 0
    full_blocks: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stopped: str = ""
    decode_batch: int = 0
    logprob: float = 0.0  # summed log-probabilities of the generated tokens scored so far
    scored: int = 0  # generated tokens scored so far
    score_to: int = 0  # diffusion: the block's generated tokens lie in [tail, score_to) (scored at its commit)
    finishing: bool = False  # diffusion, shifted: done; its last block is committed once more to be scored


def default_memory_budget(device: torch.device) -> int:
    """A fraction of the device memory free now (CUDA) or of the RAM available now (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_BUDGET_FRACTION)
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * CPU_BUDGET_FRACTION)


def _seed_for(base: int, request_id: str) -> int:
    digest = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    return (base * 7919 + digest) % 2**63


class Engine:
    """Continuous batching of requests over one model; see the module docstring."""

    def __init__(self, model: CloverModel, options: DecodeOptions, *, max_slots: int | None = None,
                 memory_budget_bytes: int | None = None, decode_steps_per_prefill: int = 1,
                 prefill_tokens_per_step: int | None = None, merge_commits: bool | None = None,
                 cuda_graphs: bool | None = None, page_size: int = PAGE_SIZE) -> None:
        """merge_commits: commit a finished block in the same forward as the next block's first denoising step
        (None: on CUDA, where a forward of twice the tokens costs about the same at small batches; off on CPU,
        where it costs twice the compute). cuda_graphs: replay decode forwards as CUDA graphs (graphs.py; None:
        on CUDA with bf16 weights unless CLOVER_CUDA_GRAPHS=0; True on a CPU runs the same static-shape step
        eagerly). page_size: positions per page of keys and values."""
        cfg = model.config
        options.check(cfg)
        if max_slots is not None and max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if decode_steps_per_prefill < 0:
            raise ValueError(f"decode_steps_per_prefill must be >= 0, got {decode_steps_per_prefill}")
        if page_size < 1 or (page_size > FLEX_KEY_BLOCK and page_size % FLEX_KEY_BLOCK):
            raise ValueError(f"page_size must be in [1, {FLEX_KEY_BLOCK}] or a multiple of {FLEX_KEY_BLOCK} "
                             f"(flex attention's key blocks), got {page_size}")
        self.model, self.options, self.config = model, options, cfg
        self.window, self.chunk = options.window(cfg), options.chunk(cfg)
        self.stops = frozenset(options.stops(cfg))
        self.diffusion = options.diffusion(cfg)  # block diffusion, or one token per step (options.mode)
        self.verified = options.mode == "verified"  # causal like autoregressive, a verified block per step
        self.block_size = (cfg.diffusion.block_size if (self.diffusion or self.verified) and cfg.diffusion is not None
                           else 1)
        # the last position's logits score the next token (autoregressive, or a shifted diffusion model such as
        # Clover): they are kept per slot, and each generated token's log-probability under the causal trunk is
        # measured (Generation.mean_logprob)
        self.shifted = not self.diffusion or bool(cfg.diffusion is not None and cfg.diffusion.logits_shift)
        self.prefill_budget = prefill_tokens_per_step or self.chunk
        if self.prefill_budget < 1:
            raise ValueError(f"prefill_tokens_per_step must be >= 1, got {self.prefill_budget}")
        self.decode_steps_per_prefill = decode_steps_per_prefill
        self.merge_commits = (model.device.type == "cuda") if merge_commits is None else merge_commits
        # verified previews of a trunk-layout model are causal, so that a commit in the same forward is causal too
        # (a Clover-layout model's preview plan commits causally beside its previews)
        self._preview_attention = "causal" if cfg.diffusion is not None and not cfg.diffusion.clover else \
            "block_causal"
        self.page_size = page_size
        # the most tokens one forward writes per row: a prefill chunk, or a merged commit's two blocks
        self.max_forward = max(self.chunk, 2 * self.block_size)
        # a decode step's writes past the committed length (verified: a commit and the check after it)
        self.lookahead = 2 * self.block_size if self.merge_commits or self.verified else self.block_size
        self.slot_bytes: SlotBytes = slot_bytes(cfg, model.dtype, window=self.window,
                                                max_forward_tokens=self.max_forward + self.lookahead,
                                                page_size=page_size)
        self.memory_budget = (default_memory_budget(model.device) if memory_budget_bytes is None
                              else memory_budget_bytes)
        self.num_slots, self.num_pages = self._size(max_slots or DEFAULT_MAX_SLOTS)
        self.reserve = max(1, math.ceil(self.num_pages * RESERVE_FRACTION))
        self.slots: SlotState | None = None
        dev = model.device
        self.static: StaticDecode | None = None
        if self.num_slots >= 1:
            self._allocate()
            if graphs_wanted(model) if cuda_graphs is None else cuda_graphs:
                assert self.slots is not None
                pad = cfg.diffusion.mask_token_id if self.diffusion and cfg.diffusion is not None else 0
                self.static = StaticDecode(model, self.slots, capture=model.device.type == "cuda", pad_token=pad)
        self._positions = torch.arange(self.block_size, device=dev)
        self._seed_base = options.seed if options.seed is not None else secrets.randbits(62)
        self.waiting: deque[_Live] = deque()
        self.prefilling: list[_Live] = []  # in slots after the decoding ones, contiguous, in admission order
        self.decoding: list[_Live] = []  # decoding[i] holds slot i
        self.live: dict[str, _Live] = {}
        self._order = 0
        self._decodes_since_prefill = 0
        self.stats = EngineStats()

    def _size(self, max_slots: int) -> tuple[int, int]:
        """(slots, pages) the budget pays for: slots first, then pages up to a full window for every slot; the
        pool must hold one sequence's full window. (0, 0) when even one slot does not fit."""
        b = self.slot_bytes
        window_pages = self.window_pages
        budget = self.memory_budget
        slots = min(max_slots, (budget - window_pages * b.page) // b.fixed) if budget >= window_pages * b.page else 0
        if slots < 1:
            return 0, 0
        pages = min((budget - slots * b.fixed) // b.page, slots * window_pages)
        return int(slots), int(pages)

    @property
    def window_pages(self) -> int:
        """Pages one sequence holds at most: its window, one forward and a decode step's lookahead (slots.py)."""
        return table_columns(self.window, self.max_forward + self.lookahead, self.page_size)

    @torch.inference_mode()
    def _allocate(self) -> None:
        cfg, dev, S = self.config, self.model.device, self.num_slots
        self.slots = SlotState(cfg, S, window=self.window, max_forward_tokens=self.max_forward,
                               num_pages=self.num_pages, page_size=self.page_size, lookahead_tokens=self.lookahead,
                               device=dev, dtype=self.model.dtype)
        # next-token logits (autoregressive) or the last committed position's logits (logits_shift) per slot
        self.logits = torch.zeros(S, cfg.vocab_size, dtype=torch.float32, device=dev)
        self.block = torch.zeros(S, self.block_size, dtype=torch.long, device=dev)  # diffusion blocks
        self.limit = torch.zeros(S, dtype=torch.long, device=dev)  # block positions [0, limit) may be filled
        # response token counts per slot, for the penalties (only when some penalty is on: V floats a slot)
        self.counts = (torch.zeros(S, cfg.vocab_size, dtype=torch.float32, device=dev) if self.options.penalized
                       else None)

    # ---- public API -------------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    @property
    def active(self) -> int:
        """Sequences holding a slot (prefilling or decoding)."""
        return len(self.decoding) + len(self.prefilling)

    def add(self, request: Request) -> None:
        """Queue a request; it is admitted as soon as a slot and its pages are free. Callable at any time, also
        between steps."""
        if self.slots is None:
            b = self.slot_bytes
            raise EngineCapacityError(
                f"request {request.id!r}: one sequence needs {b.fixed / 2**20:.1f} MiB of slot state (GDN state "
                f"{b.gdn / 2**20:.1f}, conv {b.conv / 2**20:.1f}, block {b.block / 2**20:.1f}) and "
                f"{self.window_pages} pages of {b.page / 2**20:.2f} MiB for the keys and values of a "
                f"{self.window}-token window, more than the engine's memory budget of "
                f"{self.memory_budget / 2**20:.1f} MiB; lower window_tokens or give the engine more memory")
        if request.id in self.live:
            raise ValueError(f"request {request.id!r} is already in flight")
        prompt = [int(t) for t in request.prompt_ids]
        if not prompt:
            raise ValueError(f"request {request.id!r}: the prompt is empty")
        V = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise ValueError(f"request {request.id!r}: token ids outside the vocabulary (size {V}): {bad[:5]}")
        if request.max_new_tokens is not None and request.max_new_tokens < 1:
            raise ValueError(f"request {request.id!r}: max_new_tokens must be >= 1, got {request.max_new_tokens}")
        request = Request(request.id, prompt, request.seed, request.max_new_tokens)
        self._order += 1
        live = self._fresh(request, self._order)
        self.live[request.id] = live
        self.waiting.append(live)

    @torch.inference_mode()
    def cancel(self, request_id: str) -> bool:
        """Drop a request wherever it is; its slot and pages are freed at once. False if it is not in flight."""
        live = self.live.pop(request_id, None)
        if live is None:
            return False
        if live in self.waiting:
            self.waiting.remove(live)
        elif live in self.prefilling:
            self.prefilling.remove(live)
            self._free_slot(live)
        else:
            self._release([live])
        return True

    def in_flight(self) -> list[str]:
        return list(self.live)

    @torch.inference_mode()
    def restart(self) -> None:
        """Drop all slot state and queue every request in flight again from its start, in arrival order (the
        expert-parallel replica calls this after its workers were restarted: a broken step leaves no partial
        state behind)."""
        lives = sorted(self.live.values(), key=lambda lv: lv.order)
        for live in [*self.decoding, *self.prefilling]:
            self._free_slot(live)
        self.prefilling, self.decoding = [], []
        self.waiting = deque(self._fresh(lv.req, lv.order) for lv in lives)
        self.live = {lv.req.id: lv for lv in self.waiting}
        self._decodes_since_prefill = 0

    @torch.inference_mode()
    def step(self) -> list[tuple[str, Generation]]:
        """Run one prefill forward or one decode step; returns the requests that finished in it."""
        if self._wants_prefill():
            self._prefill_step()
            self._decodes_since_prefill = 0
            return []
        if self.decoding:
            self._decodes_since_prefill += 1
            return self._decode_step()
        return []

    # ---- bookkeeping ------------------------------------------------------------------------------------------
    def _fresh(self, request: Request, order: int) -> _Live:
        generator = None
        if self.options.temperature > 0:
            seed = request.seed if request.seed is not None else _seed_for(self._seed_base, request.id)
            generator = torch.Generator(device=self.model.device).manual_seed(seed % 2**63)
        n = len(request.prompt_ids)
        target = (n // self.block_size) * self.block_size if self.diffusion else n
        return _Live(request, order, generator, prefill_target=target,
                     max_new=request.max_new_tokens or self.options.max_new_tokens)

    def _wants_prefill(self) -> bool:
        if not self.prefilling and not (self.waiting and self.active < self.num_slots):
            return False  # no prefill work: nothing started, and nothing that could start
        return not self.decoding or self._decodes_since_prefill >= self.decode_steps_per_prefill

    def _admission_pages(self, live: _Live) -> int:
        """Pages a request needs to start: its first prefill chunk and its first decode step."""
        return pages_for(0, min(self.chunk, live.prefill_target) + self.lookahead, self.page_size)

    def _admit(self) -> _Live | None:
        """The next waiting request into the first free slot after the running ones, if a slot and its pages are
        free (keeping the reserve for the running sequences' growth, unless none is running)."""
        assert self.slots is not None
        if not self.waiting or self.active >= self.num_slots:
            return None
        live = self.waiting[0]
        reserve = self.reserve if self.active else 0
        if self.slots.pool.free_pages < self._admission_pages(live) + reserve:
            return None
        self.waiting.popleft()
        taken = {lv.slot for lv in (*self.decoding, *self.prefilling)}
        live.slot = next(s for s in range(len(self.decoding), self.num_slots) if s not in taken)
        self.slots.reset(live.slot)
        self.logits[live.slot].zero_()
        if self.counts is not None:
            self.counts[live.slot].zero_()
        self.stats.most_active = max(self.stats.most_active, self.active + 1)
        return live

    def _start_decoding(self, live: _Live) -> None:
        """A prefilled request joins the decoding range (its slot becomes slot n)."""
        dst = len(self.decoding)
        if live.slot != dst:
            self._swap(live.slot, dst)
        self.prefilling.remove(live)
        self.decoding.append(live)
        if self.diffusion:
            assert self.config.diffusion is not None
            prompt, bs = live.req.prompt_ids, self.block_size
            live.tail = len(prompt) - live.prefill_target
            mask = self.config.diffusion.mask_token_id
            self.block[dst] = torch.tensor(prompt[live.prefill_target:] + [mask] * (bs - live.tail))
            self.limit[dst] = min(bs, live.tail + live.max_new)
        elif self.verified:  # a block of masks; its first token comes from the prompt's last logits
            assert self.config.diffusion is not None
            self.block[dst] = self.config.diffusion.mask_token_id
            live.known, live.room = 0, min(self.block_size, live.max_new)
            self.limit[dst] = live.room

    def _owner(self, slot: int) -> _Live | None:
        return next((lv for lv in (*self.decoding, *self.prefilling) if lv.slot == slot), None)

    def _swap(self, a: int, b: int) -> None:
        """Exchange the sequences of slots a and b (either may be free)."""
        assert self.slots is not None
        first, second = self._owner(a), self._owner(b)
        if second is None:
            self._move(a, b)
        elif first is None:
            self._move(b, a)
        else:
            self.slots.swap(a, b)
            for t in (self.logits, self.block, self.limit, self.counts):
                if t is not None:
                    t[[a, b]] = t[[b, a]]
            self.stats.moves += 2
        for live, slot in ((first, b), (second, a)):
            if live is not None:
                live.slot = slot

    def _move(self, src: int, dst: int) -> None:
        assert self.slots is not None
        self.slots.move(src, dst)
        for t in (self.logits, self.block, self.limit, self.counts):
            if t is not None:
                t[dst] = t[src]
        self.stats.moves += 1

    def _free_slot(self, live: _Live) -> None:
        assert self.slots is not None
        if live.slot >= 0:
            self.slots.release(live.slot)
        live.slot = -1

    def _release(self, lives: list[_Live]) -> None:
        """Free the decoding slots of `lives` (and their pages), moving the last decoding sequences into the gaps."""
        assert self.slots is not None
        for live in sorted(lives, key=lambda lv: lv.slot, reverse=True):
            last = len(self.decoding) - 1
            self.slots.release(live.slot)
            if live.slot != last:
                moved = self.decoding[last]
                self._move(last, live.slot)
                moved.slot = live.slot
                self.decoding[live.slot] = moved
            self.decoding.pop()
            live.slot = -1

    def _result(self, live: _Live) -> tuple[str, Generation]:
        self.live.pop(live.req.id, None)
        n = len(live.req.prompt_ids)
        return live.req.id, Generation(
            tokens=live.out, forward_passes=live.forwards, denoising_steps=live.steps, prompt_tokens=n,
            prefill_seconds=live.prefill_s, decode_seconds=live.decode_s, windows=math.ceil(n / self.window),
            stopped=live.stopped, decode_batch=live.decode_batch, decode_forwards=live.decode_forwards,
            verified_blocks=live.blocks, accepted_tokens=live.accepted, full_blocks=live.full_blocks,
            mean_logprob=live.logprob / live.scored if self.shifted and live.scored else None)

    # ---- pages ------------------------------------------------------------------------------------------------
    def _grow(self, wants: list[tuple[_Live, int]]) -> list[_Live]:
        """Take pages so each (live, end position) holds positions < end; when the pool runs dry, preempt the
        newest running sequence and try again. Returns the sequences preempted (not in `wants` any more)."""
        assert self.slots is not None
        preempted: list[_Live] = []
        pending = list(wants)
        while pending:
            live, end = pending[0]
            if live.slot < 0:  # preempted meanwhile
                pending.pop(0)
                continue
            try:
                self.slots.grow(live.slot, end)
                pending.pop(0)
            except PoolExhausted:
                victim = max((*self.decoding, *self.prefilling), key=lambda lv: lv.order)
                self._preempt(victim)
                preempted.append(victim)
        self.stats.peak_pages = max(self.stats.peak_pages, self.slots.pool.used_pages)
        return preempted

    def _preempt(self, victim: _Live) -> None:
        """Send a running sequence back to the queue, at its place by arrival: it restarts from its prompt."""
        if victim in self.prefilling:
            self.prefilling.remove(victim)
            self._free_slot(victim)
        else:
            self._release([victim])
        again = self._fresh(victim.req, victim.order)
        self.live[victim.req.id] = again
        victim.slot = -1
        at = next((i for i, lv in enumerate(self.waiting) if lv.order > again.order), len(self.waiting))
        self.waiting.insert(at, again)
        self.stats.preemptions += 1
        log.debug("preempted request %s (pool of %d pages dry)", victim.req.id, self.num_pages)

    def _slide(self, live: _Live) -> None:
        """Give back the pages no later query of `live` can see (its window has passed them)."""
        assert self.slots is not None
        self.slots.slide(live.slot, live.length - self.window + 1)

    # ---- prefill ----------------------------------------------------------------------------------------------
    def _prefill_step(self) -> None:
        """One packed forward over chunks of the prefilling requests (admitting more while the budget lasts)."""
        assert self.slots is not None
        start = time.perf_counter()
        plan: list[tuple[_Live, int]] = []  # (live, tokens this step)
        used = 0
        while used < self.prefill_budget:
            live = next((lv for lv in self.prefilling if lv not in [p for p, _ in plan]), None)
            if live is None:
                live = self._admit()
                if live is None:
                    break
                self.prefilling.append(live)
            n = min(self.chunk, live.prefill_target - live.length, self.prefill_budget - used)
            plan.append((live, n))
            used += n
        plan = [(lv, n) for lv, n in plan if n > 0]
        if plan:
            wants = [(lv, lv.length + n + (self.lookahead if lv.length + n == lv.prefill_target else 0))
                     for lv, n in plan]
            gone = self._grow(wants)
            plan = [(lv, n) for lv, n in plan if lv not in gone]
            self._compact_prefilling([lv for lv, _ in plan])
        if plan:
            self._prefill_forward(plan)
        for live in list(self.prefilling):
            if live.length == live.prefill_target:
                self._start_decoding(live)
        self.stats.prefill_steps += 1
        self.stats.prefill_seconds += time.perf_counter() - start

    def _compact_prefilling(self, first: list[_Live]) -> None:
        """Prefilling sequences into slots [n, n + k): `first` (this forward's, which a packed forward reads as
        one contiguous range) in that order, then the others in admission order."""
        base = len(self.decoding)
        rest = sorted((lv for lv in self.prefilling if lv not in first), key=lambda lv: lv.order)
        for i, live in enumerate([*first, *rest]):
            if live.slot != base + i:
                self._swap(live.slot, base + i)
        self.prefilling.sort(key=lambda lv: lv.slot)

    def _prefill_forward(self, plan: list[tuple[_Live, int]]) -> None:
        assert self.slots is not None
        t0 = time.perf_counter()
        by_slot = sorted(plan, key=lambda p: p[0].slot)
        first = by_slot[0][0].slot
        assert [lv.slot for lv, _ in by_slot] == list(range(first, first + len(by_slot)))
        ids = torch.tensor([[t for lv, n in by_slot for t in lv.req.prompt_ids[lv.length:lv.length + n]]],
                           dtype=torch.long, device=self.model.device)
        # the last position's logits of each sequence whose prompt is in (the first generated token's)
        ends = [lv.length + n == lv.prefill_target and self.shifted for lv, n in by_slot]
        at, pos = [], 0
        for (_, n), end in zip(by_slot, ends, strict=True):
            pos += n
            if end:
                at.append(pos - 1)
        attention = self.model.default_attention() if self.diffusion else "causal"
        rows = self.slots.packed(first, [lv.length for lv, _ in by_slot], [n for _, n in by_slot])
        logits = self.model.forward_slots(ids, rows, attention=attention, keep_logits=0, logits_at=at)
        k = 0
        for (live, n), end in zip(by_slot, ends, strict=True):
            if end:
                assert logits is not None
                self.logits[live.slot] = logits[0, k].float()
                k += 1
            live.length += n
            live.forwards += 1
            self._slide(live)
        seconds = time.perf_counter() - t0
        total = sum(n for _, n in by_slot)
        for live, n in by_slot:  # each sequence's share of the packed forward, by its tokens
            live.prefill_s += seconds * n / total
        self.stats.forwards += 1
        self.stats.prefill_tokens += total

    # ---- decode -----------------------------------------------------------------------------------------------
    def _decode_step(self) -> list[tuple[str, Generation]]:
        start = time.perf_counter()
        if self.verified:
            finished = self._verified_step()
        elif not self.diffusion:
            finished = self._autoregressive_step()
        else:
            finished = self._diffusion_step()
        dt = time.perf_counter() - start
        self.stats.decode_steps += 1
        self.stats.decode_seconds += dt
        return finished

    def _emit(self, live: _Live, tokens: list[int]) -> bool:
        """Append generated tokens up to the first stop token; True when the sequence is finished by it."""
        cut = next((j for j, t in enumerate(tokens) if t in self.stops), None)
        live.out.extend(tokens if cut is None else tokens[:cut])
        self.stats.decode_tokens += len(tokens) if cut is None else cut
        if cut is not None:
            live.stopped = "eos"
        elif len(live.out) >= live.max_new:
            live.stopped = "length"
        return bool(live.stopped)

    def _forward_decode(self, ids: torch.Tensor, commit: list[int] | None, *, commit_tokens: int, attention: str,
                        keep_logits: int | None, preview: bool = False) -> torch.Tensor:
        """A decode forward over slots [0, n): replayed as a static-shape step (CUDA graph) or run directly."""
        if self.static is not None:
            return self.static.forward(ids, commit, commit_tokens=commit_tokens, attention=attention,
                                       keep_logits=keep_logits, preview=preview)
        assert self.slots is not None
        rows = self.slots.rows(0, [lv.length for lv in self.decoding], ids.shape[1], commit, commit_tokens)
        logits = self.model.forward_slots(ids, rows, attention=attention, keep_logits=keep_logits, preview=preview)
        assert logits is not None
        return logits

    def _take_time(self, lives: list[_Live], start: float) -> None:
        share = (time.perf_counter() - start) / max(1, len(lives))
        for live in lives:
            live.decode_s += share
            live.decode_batch = max(live.decode_batch, len(lives))

    def _autoregressive_step(self) -> list[tuple[str, Generation]]:
        """Sample each row's next token from its saved logits; forward the rows that go on (commit)."""
        assert self.slots is not None
        start, rows_in_step = time.perf_counter(), list(self.decoding)
        n, opt = len(self.decoding), self.options
        generators = [lv.generator for lv in self.decoding]
        raw = self.logits[:n]
        step_logits = raw[:, None] if self.counts is None else apply_penalties(raw[:, None], self.counts[:n], opt)
        tok, _ = pick_tokens(step_logits, opt.temperature, opt.top_p, generators)
        logprob = torch.log_softmax(raw, dim=-1).gather(1, tok)  # [n, 1] under the trunk: no penalty, no temperature
        if self.counts is not None:
            self.counts[:n].scatter_add_(1, tok, torch.ones_like(logprob))
        # the step's one host sync; float64 holds every token id exactly
        tokens, logprobs = torch.cat([tok, logprob], dim=1).double().T.tolist()
        done = []
        for live, t, lp in zip(self.decoding, tokens, logprobs, strict=True):
            t = int(t)
            live.steps += 1
            live.next_token = t
            if t not in self.stops:
                live.logprob += lp
                live.scored += 1
            if self._emit(live, [t]):
                done.append(live)
        self._release(done)
        self._grow([(lv, lv.length + 1) for lv in self.decoding])  # may preempt the newest
        if self.decoding:
            ids = torch.tensor([[lv.next_token] for lv in self.decoding], dtype=torch.long, device=self.model.device)
            logits = self._forward_decode(ids, None, commit_tokens=1, attention="causal", keep_logits=1)
            self.logits[:len(self.decoding)] = logits[:, -1].float()
            for live in self.decoding:
                live.length += 1
                live.forwards += 1
                live.decode_forwards += 1
                self._slide(live)
            self.stats.forwards += 1
        self.stats.decode_rows += n
        self._take_time(rows_in_step, start)
        return [self._result(lv) for lv in done]

    def _diffusion_step(self) -> list[tuple[str, Generation]]:
        """One forward over all decoding rows: rows whose block finished last step commit it, the others take a
        denoising step; the chosen tokens are filled in on the device, then read back once.

        A committing row's generated tokens are scored by the commit forward itself (shifted models: position t's
        token under the logits of t - 1); a finished row of such a model commits its last block once more for
        that, and leaves after it."""
        assert self.slots is not None and self.config.diffusion is not None
        d, opt = self.config.diffusion, self.options
        start, bs = time.perf_counter(), self.block_size
        merge = self.merge_commits and any(lv.commit_next for lv in self.decoding)
        # pages for what this forward writes: the block (two, merged) after each row's committed tokens
        self._grow([(lv, lv.length + (2 if merge else 1) * bs) for lv in self.decoding])  # may preempt the newest
        if not self.decoding:
            return []
        lives = list(self.decoding)
        n = len(lives)
        commit = [i for i, lv in enumerate(lives) if lv.commit_next]
        merge = self.merge_commits and bool(commit)
        # merged: every row forwards two blocks; committing rows [finished block | fresh masks], the others
        # [current block | masks as padding after it, which no query of the block sees]
        denoise = list(range(n)) if merge else [i for i, lv in enumerate(lives) if not lv.commit_next]
        block, limit = self.block[:n], self.limit[:n]
        dev = block.device
        if commit:  # host -> device copies before the forward is queued: after it, a copy would wait for it (a sync)
            commit_idx = torch.tensor(commit, dtype=torch.long, device=dev)
            # how much of each fresh block may be filled is known on the host
            room = torch.tensor([min(bs, lives[i].max_new - len(lives[i].out)) for i in commit], dtype=torch.long,
                                device=dev)
            if self.shifted:  # the committed blocks' generated positions [tail, score_to)
                scored = torch.tensor([[lives[i].tail, lives[i].score_to] for i in commit], dtype=torch.long,
                                      device=dev)
        ids = torch.cat([block, torch.full_like(block, d.mask_token_id)], dim=1) if merge else block
        logits = self._forward_decode(ids, commit, commit_tokens=bs, attention="block_causal", keep_logits=None,
                                      preview=True)
        self.stats.forwards += 1
        row_logprob = torch.zeros(n, dtype=torch.float64, device=dev)  # this step's scores of committed blocks
        if commit:
            if d.logits_shift:
                committed = block.index_select(0, commit_idx)  # [c, bs] the blocks as committed
                # position t is scored by t - 1: the first by the saved logits of the last committed position
                predict = torch.cat([self.logits.index_select(0, commit_idx)[:, None],
                                     logits.index_select(0, commit_idx)[:, :bs - 1].float()], dim=1)
                lp = torch.log_softmax(predict, dim=-1).gather(2, committed[..., None])[..., 0]  # [c, bs]
                inside = (self._positions >= scored[:, :1]) & (self._positions < scored[:, 1:])
                row_logprob.index_copy_(0, commit_idx, (lp * inside).sum(1).double())
                # the next block's first position is predicted from this block's last
                self.logits.index_copy_(0, commit_idx, logits.index_select(0, commit_idx)[:, bs - 1].float())
            block.index_fill_(0, commit_idx, d.mask_token_id)  # a fresh block of masks
            limit.index_copy_(0, commit_idx, room)
        if merge:  # each row's block logits: the second half for committing rows, the first for the others
            first = torch.zeros(n, dtype=torch.long, device=dev).index_fill_(0, commit_idx, bs)
            where = (first[:, None] + self._positions)[..., None].expand(n, bs, logits.shape[-1])
            logits = logits.gather(1, where)
        if denoise:
            step_logits = logits.float()
            if d.logits_shift:  # position t is predicted from t-1: the block's first from the last committed one
                step_logits = torch.cat([self.logits[:n, None], step_logits[:, :-1]], dim=1)
            if self.counts is not None:
                step_logits = apply_penalties(step_logits, self.counts[:n], opt)
            step_logits[..., d.mask_token_id] = -math.inf  # never "predict" a mask
            tok, conf = pick_tokens(step_logits, opt.temperature, opt.top_p, [lv.generator for lv in lives], denoise)
            needed = (block == d.mask_token_id) & (self._positions < limit[:, None])
            if commit and not merge:
                needed[commit_idx] = False
            chosen = select_block_positions(conf, needed, opt.threshold, opt.tokens_per_step)
            block.copy_(torch.where(chosen, tok, block))
            if self.counts is not None:  # the response so far includes the block's filled positions
                self.counts[:n].scatter_add_(1, torch.where(chosen, tok, 0), chosen.float())
            still = (block == d.mask_token_id) & (self._positions < limit[:, None])
            # the one host sync; float64 holds every token id exactly
            readback = torch.cat([block.double(), still.any(-1, keepdim=True).double(), row_logprob[:, None]],
                                 dim=1).tolist()
        else:
            readback = [[0.0] * (bs + 1) + [lp] for lp in row_logprob.tolist()]  # scores only (one sync)
        done: list[_Live] = []
        for i, live in enumerate(lives):
            live.forwards += 1
            live.decode_forwards += 1
            if live.commit_next:
                live.commit_next = False
                live.length += bs
                self._slide(live)
                if self.shifted:
                    live.logprob += readback[i][bs + 1]
                    live.scored += live.score_to - live.tail
                live.tail = 0
                if live.finishing:
                    done.append(live)
                    continue
                if not merge:
                    continue
            live.steps += 1
            if readback[i][bs]:  # masks left to fill
                continue
            lim = min(bs, live.tail + live.max_new - len(live.out))
            before = len(live.out)
            finished = self._emit(live, [int(t) for t in readback[i][live.tail:lim]])
            live.score_to = live.tail + len(live.out) - before
            if finished and not self.shifted:
                done.append(live)
            else:  # commit it next step (a finished row of a shifted model: only to score it, then it leaves)
                live.commit_next = True
                live.finishing = finished
        self._release(done)
        self.stats.decode_rows += n
        self._take_time(lives, start)
        return [self._result(lv) for lv in done]

    def _verified_step(self) -> list[tuple[str, Generation]]:
        """One verified round per decoding row (module docstring): rows whose block is complete commit it in the
        step's first forward (merged: with their next block's first preview), the others' previews draft the
        block's unverified positions, and one causal forward that writes no state checks every row's draft."""
        assert self.slots is not None and self.config.diffusion is not None
        opt = self.options
        start, bs, mask = time.perf_counter(), self.block_size, self.config.diffusion.mask_token_id
        merge = self.merge_commits and any(lv.commit_next for lv in self.decoding)
        # pages for what the step writes: a committing row its block and the check after it (or the merged pair)
        self._grow([(lv, lv.length + (2 if merge or lv.commit_next else 1) * bs) for lv in self.decoding])
        if not self.decoding:  # every row preempted
            return []
        lives = list(self.decoding)
        n = len(lives)
        commit = [i for i, lv in enumerate(lives) if lv.commit_next]
        merge = self.merge_commits and bool(commit)
        dev, pos = self.logits.device, self._positions
        block, limit, raw = self.block[:n], self.limit[:n], self.logits[:n]
        counts = None if self.counts is None else self.counts[:n]
        # host -> device copies before any forward is queued
        known = torch.tensor([0 if lv.commit_next else lv.known for lv in lives], dtype=torch.long, device=dev)
        fresh = [i for i, lv in enumerate(lives) if lv.known == 0 and not lv.commit_next]
        if fresh:
            fresh_idx = torch.tensor(fresh, dtype=torch.long, device=dev)
        if commit:
            commit_idx = torch.tensor(commit, dtype=torch.long, device=dev)
            room = torch.tensor([min(bs, lives[i].max_new - len(lives[i].out)) for i in commit], dtype=torch.long,
                                device=dev)
        drafting = torch.ones(n, dtype=torch.bool, device=dev)  # rows that draft this step
        if commit and not merge:
            drafting.index_fill_(0, commit_idx, False)  # their forward commits; the check gives them a token
        if fresh:  # a block after prefill: its first token is the trunk's choice from the saved logits
            self._first_tokens(fresh_idx)
        previews = torch.zeros(n, dtype=torch.long, device=dev)  # preview forwards that drafted for each row
        forwards, first = 0, True
        while True:
            if first:
                wants_preview = any(lv.known + (lv.known == 0) < lv.room and not lv.commit_next for lv in lives)
                if not (commit or wants_preview):
                    break
                ids = torch.cat([block, torch.full_like(block, mask)], dim=1) if merge else block
                logits = self._forward_decode(ids, commit, commit_tokens=bs, attention=self._preview_attention,
                                              keep_logits=None, preview=True)
                if commit:  # the committed block's last position's logits choose the next block's first token
                    raw.index_copy_(0, commit_idx, logits.index_select(0, commit_idx)[:, bs - 1].float())
                    if counts is not None:  # the response now holds the committed block
                        counts.index_copy_(0, commit_idx, counts.index_select(0, commit_idx).scatter_add(
                            1, block.index_select(0, commit_idx), torch.ones(len(commit), bs, device=dev)))
                    block.index_fill_(0, commit_idx, mask)
                    limit.index_copy_(0, commit_idx, room)
                    self._first_tokens(commit_idx)
                    for i in commit:  # the later forwards of the step run after the committed block
                        live = lives[i]
                        live.commit_next = False
                        live.length += bs
                        self._slide(live)
                        live.known, live.room = 0, min(bs, live.max_new - len(live.out))
                if merge:  # each row's block logits: the second half for committing rows, the first for the others
                    half = torch.zeros(n, dtype=torch.long, device=dev).index_fill_(0, commit_idx, bs)
                    where = (half[:, None] + pos)[..., None].expand(n, bs, logits.shape[-1])
                    logits = logits.gather(1, where)
                first = False
            else:
                logits = None
            settled = known.clamp(min=1)  # positions known before this step's drafts (the first always is)
            needed = (block == mask) & (pos >= settled[:, None]) & (pos < limit[:, None]) & drafting[:, None]
            if logits is None:
                if not bool(needed.any()):  # a host sync per further preview (a diffusion step has one too)
                    break
                logits = self._forward_decode(block, [], commit_tokens=bs, attention=self._preview_attention,
                                              keep_logits=None, preview=True)
            forwards += 1
            previews += needed.any(-1)
            # position t is predicted from t - 1: the block's first from the last committed position
            step_logits = torch.cat([raw[:, None], logits[:, :-1].float()], dim=1)
            if counts is not None:  # the response so far and the block's decided tokens
                decided = (pos < settled[:, None]) | ((block != mask) & (pos < limit[:, None]))
                draft_counts = counts.scatter_add(1, block, decided.to(counts.dtype))
                step_logits = apply_penalties(step_logits, draft_counts, opt)
            step_logits[..., mask] = -math.inf  # never "predict" a mask
            tok, conf = pick_tokens(step_logits, 0.0, 1.0)
            chosen = select_block_positions(conf, needed, opt.threshold, opt.tokens_per_step)
            block.copy_(torch.where(chosen, tok, block))
        # the check: one causal forward over every row's block, writing no state; position t's logits choose t + 1
        check = self._forward_decode(block, [], commit_tokens=bs, attention="causal", keep_logits=None).float()
        forwards += 1
        if counts is not None:  # position t's counts: the response before the block and the block's tokens <= t
            seen = torch.zeros(n, bs, counts.shape[1], dtype=counts.dtype, device=dev)
            seen.scatter_(2, block[..., None], 1.0)
            trunk_logits = apply_penalties(check, counts[:, None] + seen.cumsum(1), opt)
        else:
            trunk_logits = check
        trunk, _ = pick_tokens(trunk_logits, 0.0, 1.0)  # [n, bs] the trunk's greedy token after each position
        settled = known.clamp(min=1)
        # position t >= 1 holds: known before the step, or drafted and the trunk's choice after t - 1 (beyond the
        # limit counts as holding, so the run is cut by the limit)
        holds = ((pos[1:] < settled[:, None]) | ((block[:, 1:] != mask) & (trunk[:, :-1] == block[:, 1:]))
                 | (pos[1:] >= limit[:, None]))
        agreed = (1 + holds.long().cumprod(1).sum(1)).minimum(limit)  # [n] leading positions now verified
        ended = agreed == limit
        at = agreed.clamp(max=bs - 1)[:, None]
        rejected = ~ended & (block.gather(1, at)[:, 0] != mask)  # a drafted token the trunk chose otherwise
        # the trunk's own token after the agreed prefix; positions after it are drafted again next step
        block.scatter_(1, at, torch.where(ended[:, None], block.gather(1, at), trunk.gather(1, (agreed - 1)[:, None])))
        verified = agreed + (~ended).long()
        block.copy_(torch.where(pos >= verified[:, None], mask, block))
        # scores under the trunk (no penalty): the first position by the saved logits, the others by the check's
        predict = torch.cat([raw[:, None], check[:, :-1]], dim=1)
        lp = torch.log_softmax(predict, dim=-1).gather(2, block[..., None])[..., 0]  # [n, bs]
        # the step's read-back; float64 holds every token id exactly
        readback = torch.cat([block.double(), lp.double(), verified[:, None].double(),
                              (~rejected)[:, None].double(), previews[:, None].double()], dim=1).tolist()
        self.stats.forwards += forwards
        done: list[_Live] = []
        for live, row in zip(lives, readback, strict=True):
            v = int(row[2 * bs])
            tokens = [int(t) for t in row[live.known:v]]
            live.forwards += forwards
            live.decode_forwards += forwards
            live.steps += int(row[2 * bs + 2])
            live.blocks += 1
            live.accepted += v - live.known
            live.full_blocks += bool(row[2 * bs + 1])
            self.stats.verified_blocks += 1
            self.stats.accepted_tokens += v - live.known
            self.stats.full_blocks += bool(row[2 * bs + 1])
            before = len(live.out)
            finished = self._emit(live, tokens)
            kept_out = len(live.out) - before
            live.logprob += sum(row[bs + live.known:bs + live.known + kept_out])
            live.scored += kept_out
            live.known = v
            if finished:
                done.append(live)
            elif v == live.room:  # complete: committed by the next step's first forward
                live.commit_next = True
        self._release(done)
        self.stats.decode_rows += n
        self._take_time(lives, start)
        return [self._result(lv) for lv in done]

    def _first_tokens(self, idx: torch.Tensor) -> None:
        """Rows `idx` start a block: its first token is the trunk's greedy choice from the saved logits of the last
        committed position (penalised by the response so far), chosen on the device."""
        raw = self.logits.index_select(0, idx)[:, None]
        if self.counts is not None:
            raw = apply_penalties(raw, self.counts.index_select(0, idx), self.options)
        tok, _ = pick_tokens(raw, 0.0, 1.0)
        self.block[:, :1].index_copy_(0, idx, tok)
