"""The generation engine: continuous batching over preallocated slot state and paged keys, token ids only.

    engine.add(Request) at any time  ->  engine.step() ... each returns the requests that finished in it

    step():  plan = scheduler.schedule()          who runs: a packed prefill of prompt chunks, or a decode step
             prefill: runner.prefill(chunks)      the forward; then scheduler.prefilled: who starts decoding
             decode:  policy.step()               forwards and the decoding policy's tokens and commits
             results of the sequences that finished

The rooms, each beside its docstring:
- scheduler.py: the request queues, admission, the page budget's decisions, preemption, where each sequence's slot
  is; it plans a step.
- runner.py: the slot state (GDN state, conv tails, pages of keys and values: slots.py, pages.py) and each slot's
  decode buffers; it runs packed prefill forwards and decode forwards (CUDA graphs: graphs.py).
- decoding.py (autoregressive, block diffusion) and verified.py (verified block decoding): the decoding policies,
  which turn logits into tokens and commits.
- sequences.py: what they share (Request, Generation, EngineStats, a sequence's bookkeeping).

This file builds them from the options and a memory budget, checks requests, and runs the loop.
"""

from __future__ import annotations

import secrets
import time

import torch

from .clover import CloverModel
from .decoding import Autoregressive, Decoding, Diffusion
from .graphs import graphs_wanted
from .options import DecodeOptions
from .runner import Runner, default_memory_budget, plan_memory
from .scheduler import RESERVE_FRACTION, Scheduler
from .sequences import EngineCapacityError, EngineStats, Generation, Request, Sequence, seed_for
from .slots import SlotBytes, slot_bytes, table_columns
from .verified import Verified

__all__ = ["RESERVE_FRACTION", "Engine", "EngineCapacityError", "EngineStats", "Generation", "Request"]

DEFAULT_MAX_SLOTS = 64  # when max_slots is not given: as many as fit, up to this
PAGE_SIZE = 256  # positions per page of keys and values (a multiple of flex_attention's 128-token blocks)
FLEX_KEY_BLOCK = 128  # a page of more positions must hold whole key blocks of flex attention (ops.FLEX_BLOCK)


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
        self.diffusion = options.diffusion(cfg)  # block diffusion, or one token per step (options.mode)
        self.verified = options.mode == "verified"  # causal like autoregressive, a verified round per step
        bs = cfg.diffusion.block_size if (self.diffusion or self.verified) and cfg.diffusion is not None else 1
        self.block_size = bs
        # the last position's logits score the next token (autoregressive, or a shifted diffusion model such as
        # Clover): they are kept per slot, and each generated token's log-probability under the causal trunk is
        # measured (Generation.mean_logprob)
        self.shifted = not self.diffusion or bool(cfg.diffusion is not None and cfg.diffusion.logits_shift)
        prefill_budget = prefill_tokens_per_step or self.chunk
        if prefill_budget < 1:
            raise ValueError(f"prefill_tokens_per_step must be >= 1, got {prefill_budget}")
        self.merge_commits = (model.device.type == "cuda") if merge_commits is None else merge_commits
        self.page_size = page_size
        # the most tokens one forward writes per row: a prefill chunk, or a merged commit's two blocks
        self.max_forward = max(self.chunk, 2 * bs)
        # a decode step's writes past the committed length (verified: a commit and the check after it)
        self.lookahead = 2 * bs if self.merge_commits or self.verified else bs
        self.slot_bytes: SlotBytes = slot_bytes(cfg, model.dtype, window=self.window,
                                                max_forward_tokens=self.max_forward + self.lookahead,
                                                page_size=page_size)
        self.memory_budget = (default_memory_budget(model.device) if memory_budget_bytes is None
                              else memory_budget_bytes)
        self.num_slots, self.num_pages = plan_memory(self.slot_bytes, self.memory_budget,
                                                     max_slots or DEFAULT_MAX_SLOTS, self.window,
                                                     self.max_forward + self.lookahead, page_size)
        self.runner: Runner | None = None
        if self.num_slots >= 1:
            pad = cfg.diffusion.mask_token_id if self.diffusion and cfg.diffusion is not None else 0
            self.runner = Runner(model, num_slots=self.num_slots, num_pages=self.num_pages, window=self.window,
                                 max_forward=self.max_forward, lookahead=self.lookahead, page_size=page_size,
                                 block_size=bs, penalized=options.penalized,
                                 static=graphs_wanted(model) if cuda_graphs is None else cuda_graphs, pad_token=pad)
        self._seed_base = options.seed if options.seed is not None else secrets.randbits(62)
        self.stats = EngineStats()
        self.scheduler = Scheduler(self.runner, num_slots=self.num_slots, num_pages=self.num_pages, chunk=self.chunk,
                                   prefill_budget=prefill_budget, decode_steps_per_prefill=decode_steps_per_prefill,
                                   lookahead=self.lookahead, window=self.window, page_size=page_size,
                                   stats=self.stats, new_sequence=self._sequence)
        self.policy: Decoding | None = None
        if self.runner is not None:
            kind = Verified if self.verified else Diffusion if self.diffusion else Autoregressive
            self.policy = kind(self.runner, self.scheduler, options, cfg, block_size=bs,
                               stops=frozenset(options.stops(cfg)), shifted=self.shifted,
                               merge_commits=self.merge_commits, stats=self.stats)

    # ---- public API -------------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def active(self) -> int:
        """Sequences holding a slot (prefilling or decoding)."""
        return self.scheduler.active

    def add(self, request: Request) -> None:
        """Queue a request; it is admitted as soon as a slot and its pages are free. Callable at any time, also
        between steps."""
        if self.runner is None:
            b = self.slot_bytes
            raise EngineCapacityError(
                f"request {request.id!r}: one sequence needs {b.fixed / 2**20:.1f} MiB of slot state (GDN state "
                f"{b.gdn / 2**20:.1f}, conv {b.conv / 2**20:.1f}, block {b.block / 2**20:.1f}) and "
                f"{self.window_pages} pages of {b.page / 2**20:.2f} MiB for the keys and values of a "
                f"{self.window}-token window, more than the engine's memory budget of "
                f"{self.memory_budget / 2**20:.1f} MiB; lower window_tokens or give the engine more memory")
        if request.id in self.scheduler.live:
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
        self.scheduler.add(Request(request.id, prompt, request.seed, request.max_new_tokens))

    @torch.inference_mode()
    def cancel(self, request_id: str) -> bool:
        """Drop a request wherever it is; its slot and pages are freed at once. False if it is not in flight."""
        return self.scheduler.cancel(request_id)

    def in_flight(self) -> list[str]:
        return list(self.scheduler.live)

    @torch.inference_mode()
    def restart(self) -> None:
        """Drop all slot state and queue every request in flight again from its start, in arrival order (the
        expert-parallel replica calls this after its workers were restarted: a broken step leaves no partial
        state behind)."""
        self.scheduler.restart()

    @torch.inference_mode()
    def step(self) -> list[tuple[str, Generation]]:
        """Run one prefill forward or one decode step; returns the requests that finished in it."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.kind == "prefill":
            assert self.runner is not None and self.policy is not None
            seconds = 0.0
            if plan.chunks:
                seconds = self.runner.prefill(plan.chunks, shifted=self.shifted,
                                              attention=self.model.default_attention() if self.diffusion
                                              else "causal")
            for seq in self.scheduler.prefilled(plan.chunks, seconds):
                self.policy.start(seq)
            self.stats.prefill_steps += 1
            self.stats.prefill_seconds += time.perf_counter() - start
            return []
        if plan.kind == "decode":
            assert self.policy is not None
            finished = self.policy.step()
            self.stats.decode_steps += 1
            self.stats.decode_seconds += time.perf_counter() - start
            return [self._result(seq) for seq in finished]
        return []

    # ---- what the rooms hold, for tests and benches -----------------------------------------------------------
    @property
    def slots(self):
        return None if self.runner is None else self.runner.slots

    @property
    def static(self):
        return None if self.runner is None else self.runner.static

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def prefilling(self) -> list[Sequence]:
        return self.scheduler.prefilling

    @property
    def decoding(self) -> list[Sequence]:
        return self.scheduler.decoding

    @property
    def reserve(self) -> int:
        return self.scheduler.reserve

    @property
    def window_pages(self) -> int:
        """Pages one sequence holds at most: its window, one forward and a decode step's lookahead (slots.py)."""
        return table_columns(self.window, self.max_forward + self.lookahead, self.page_size)

    # ---- bookkeeping ------------------------------------------------------------------------------------------
    def _sequence(self, request: Request, order: int) -> Sequence:
        """A request's fresh bookkeeping (also after a preemption or a restart: it starts over)."""
        generator = None
        if self.options.temperature > 0:
            seed = request.seed if request.seed is not None else seed_for(self._seed_base, request.id)
            generator = torch.Generator(device=self.model.device).manual_seed(seed % 2**63)
        n = len(request.prompt_ids)
        target = (n // self.block_size) * self.block_size if self.diffusion else n
        return Sequence(request, order, generator, prefill_target=target,
                        max_new=request.max_new_tokens or self.options.max_new_tokens)

    def _result(self, seq: Sequence) -> tuple[str, Generation]:
        self.scheduler.finish(seq)
        return seq.req.id, seq.generation(self.window, self.shifted)

