"""The decoding policies: how a decode step turns logits into tokens and commits, for each `DecodeOptions.mode`.

    Autoregressive  one token per row per step, sampled from the saved next-token logits; one forward commits it
    Diffusion       a denoising step per row over its block (LowConfidence threshold or k per step; Clover's preview
                    operator or the block-causal forward), a finished block committed by the next step's forward
    Verified        (verified.py) the autoregressive output, rounds of previews and a causal check per block

A policy runs over the decoding slots [0, n) that the scheduler arranged; it asks the scheduler for pages (which
may preempt) and gives back the rows that finished, and it never decides who runs.

Notable choices:
- One host sync per decode step: after the forward, tokens, confidences and the block updates are computed on the
  device for all rows, and one read-back brings the blocks (or tokens) and the done flags to the host. Not
  counted: the fp32 grouped expert GEMM on CUDA (the reference loop reads expert offsets back; bf16 uses the
  grouped kernel) and flex_attention's first call of a shape (compilation).
- A diffusion block that finished in one step is committed by the next step's forward, the one in which the other
  rows take their denoising steps (per-row commit, slots.py): no separate commit forward, and every forward runs
  over all decoding rows. With `merge_commits` (default on CUDA) that forward carries two blocks per row, and a
  committing row also takes its next block's first denoising step in it: at k=8 a 32-token block then costs a row
  4 forwards instead of 5. A sequence's last block is committed only to score it (shifted models, mean_logprob).
- Sampling (temperature > 0) draws from each request's own generator, so a request gets the same output whatever
  else is in flight.
"""

from __future__ import annotations

import math
import time

import torch

from .config import CloverConfig
from .options import DecodeOptions
from .runner import Runner
from .sampling import apply_penalties, pick_tokens, select_block_positions
from .scheduler import Scheduler
from .sequences import EngineStats, Sequence


class Decoding:
    """What every policy shares: the rows, the buffers, emitting tokens, forwards over the decoding slots."""

    def __init__(self, runner: Runner, scheduler: Scheduler, options: DecodeOptions, config: CloverConfig, *,
                 block_size: int, stops: frozenset[int], shifted: bool, merge_commits: bool,
                 stats: EngineStats) -> None:
        self.runner, self.scheduler, self.options, self.config = runner, scheduler, options, config
        self.block_size, self.stops, self.shifted, self.merge_commits = block_size, stops, shifted, merge_commits
        self.stats = stats
        self.slots, self.model = runner.slots, runner.model
        self.logits, self.block, self.limit, self.counts = runner.logits, runner.block, runner.limit, runner.counts
        self._positions = runner.positions
        # verified previews of a trunk-layout model are causal, so that a commit in the same forward is causal too
        # (a Clover-layout model's preview plan commits causally beside its previews)
        d = config.diffusion
        self._preview_attention = "causal" if d is not None and not d.clover else "block_causal"

    @property
    def decoding(self) -> list[Sequence]:
        return self.scheduler.decoding

    def start(self, seq: Sequence) -> None:
        """A sequence whose prompt is in starts decoding in its slot (len(decoding) - 1)."""

    def step(self) -> list[Sequence]:
        """One decode step over every decoding row; returns the rows that finished (their slots released)."""
        raise NotImplementedError

    def _grow(self, wants: list[tuple[Sequence, int]]) -> list[Sequence]:
        return self.scheduler.grow(wants)

    def _release(self, seqs: list[Sequence]) -> None:
        self.scheduler.release(seqs)

    def _slide(self, seq: Sequence) -> None:
        self.scheduler.slide(seq)

    def _forward_decode(self, ids: torch.Tensor, commit: list[int] | None, *, commit_tokens: int, attention: str,
                        keep_logits: int | None, preview: bool = False) -> torch.Tensor:
        """A decode forward over slots [0, n): replayed as a static-shape step (CUDA graph) or run directly."""
        return self.runner.decode(ids, [s.length for s in self.decoding], commit, commit_tokens=commit_tokens,
                                  attention=attention, keep_logits=keep_logits, preview=preview)

    def _emit(self, live: Sequence, tokens: list[int]) -> bool:
        """Append generated tokens up to the first stop token; True when the sequence is finished by it."""
        cut = next((j for j, t in enumerate(tokens) if t in self.stops), None)
        live.out.extend(tokens if cut is None else tokens[:cut])
        self.stats.decode_tokens += len(tokens) if cut is None else cut
        if cut is not None:
            live.stopped = "eos"
        elif len(live.out) >= live.max_new:
            live.stopped = "length"
        return bool(live.stopped)

    def _take_time(self, lives: list[Sequence], start: float) -> None:
        share = (time.perf_counter() - start) / max(1, len(lives))
        for live in lives:
            live.decode_s += share
            live.decode_batch = max(live.decode_batch, len(lives))


class Autoregressive(Decoding):
    """One token per row per step (also a shifted diffusion checkpoint's causal trunk: `mode: autoregressive`)."""

    def step(self) -> list[Sequence]:
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
                live.logprobs.append(lp)
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
        return done


class Diffusion(Decoding):
    """Block diffusion: a denoising step per row per forward; finished blocks committed by the next forward."""

    def start(self, seq: Sequence) -> None:
        """The prompt's tail after its last whole block starts the first block; the rest of it is masks."""
        assert self.config.diffusion is not None
        prompt, bs, dst = seq.req.prompt_ids, self.block_size, seq.slot
        seq.tail = len(prompt) - seq.prefill_target
        mask = self.config.diffusion.mask_token_id
        self.block[dst] = torch.tensor(prompt[seq.prefill_target:] + [mask] * (bs - seq.tail))
        self.limit[dst] = min(bs, seq.tail + seq.max_new)

    def step(self) -> list[Sequence]:
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
        position_logprob = torch.zeros(n, bs, dtype=torch.float64, device=dev)  # and of each of their positions
        if commit:
            if d.logits_shift:
                committed = block.index_select(0, commit_idx)  # [c, bs] the blocks as committed
                # position t is scored by t - 1: the first by the saved logits of the last committed position
                predict = torch.cat([self.logits.index_select(0, commit_idx)[:, None],
                                     logits.index_select(0, commit_idx)[:, :bs - 1].float()], dim=1)
                lp = torch.log_softmax(predict, dim=-1).gather(2, committed[..., None])[..., 0]  # [c, bs]
                inside = (self._positions >= scored[:, :1]) & (self._positions < scored[:, 1:])
                row_logprob.index_copy_(0, commit_idx, (lp * inside).sum(1).double())
                position_logprob.index_copy_(0, commit_idx, (lp * inside).double())
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
            readback = torch.cat([block.double(), still.any(-1, keepdim=True).double(), row_logprob[:, None],
                                  position_logprob], dim=1).tolist()
        else:
            readback = [[0.0] * (bs + 1) + row  # scores only (one sync)
                        for row in torch.cat([row_logprob[:, None], position_logprob], dim=1).tolist()]
        done: list[Sequence] = []
        for i, live in enumerate(lives):
            live.forwards += 1
            live.decode_forwards += 1
            if live.commit_next:
                live.commit_next = False
                live.length += bs
                self._slide(live)
                if self.shifted:
                    live.logprob += readback[i][bs + 1]
                    live.logprobs.extend(readback[i][bs + 2 + live.tail:bs + 2 + live.score_to])
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
        return done

