"""Verified block decoding (`mode: verified`): the autoregressive output token for token, several tokens per
forward where the preview agrees with the trunk.

A block's first token is the trunk's greedy choice from the saved logits of the last committed position. A step
is a round per row: the preview drafts the block's unverified positions (threshold or k per step, as diffusion
does; rows in lockstep until every draft is full), then one causal forward over every row's block, writing no
state, gives the trunk's choice after each position, penalised with the counts of the response before it. The
drafted run the trunk agrees with is verified, and the trunk's own token after it too; the positions after that
are drafted again in the next round, the verified ones staying as known positions. A block is committed once all
of it is verified, in the next step's first forward: beside the others' previews (a commit row drafts nothing in
it, and its check adds the trunk's token after its new block's first), or with `merge_commits` together with its
next block's first preview, as diffusion's merged commit. The keys a check writes past the committed length are
overwritten before any query sees them. Why not commit after every check: docs/architecture.md section 3,
measured. The plain reference is generate.py's `_verified_nocache`.
"""

from __future__ import annotations

import math
import time

import torch

from .decoding import Decoding
from .sampling import apply_penalties, pick_tokens, select_block_positions
from .sequences import Sequence


class Verified(Decoding):
    """Rounds of previews and a causal check per row; complete blocks committed by the next round's forward."""

    def start(self, seq: Sequence) -> None:
        """A block of masks; its first token comes from the prompt's last logits."""
        assert self.config.diffusion is not None
        self.block[seq.slot] = self.config.diffusion.mask_token_id
        seq.known, seq.room = 0, min(self.block_size, seq.max_new)
        self.limit[seq.slot] = seq.room

    def step(self) -> list[Sequence]:
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
        settled = known.clamp(min=1)  # the block's positions known before this step's drafts (the first always is)
        forwards = 0

        def needed() -> torch.Tensor:
            return (block == mask) & (pos >= settled[:, None]) & (pos < limit[:, None]) & drafting[:, None]

        def draft(logits: torch.Tensor, fill: torch.Tensor) -> None:
            """Fill the `fill` positions the preview's logits choose (threshold or k, as a diffusion step)."""
            previews.add_(fill.any(-1))
            # position t is predicted from t - 1: the block's first from the last committed position
            step_logits = torch.cat([raw[:, None], logits[:, :-1].float()], dim=1)
            if counts is not None:  # the response so far and the block's decided tokens
                decided = (pos < settled[:, None]) | ((block != mask) & (pos < limit[:, None]))
                step_logits = apply_penalties(step_logits, counts.scatter_add(1, block, decided.to(counts.dtype)),
                                              opt)
            step_logits[..., mask] = -math.inf  # never "predict" a mask
            tok, conf = pick_tokens(step_logits, 0.0, 1.0)
            chosen = select_block_positions(conf, fill, opt.threshold, opt.tokens_per_step)
            block.copy_(torch.where(chosen, tok, block))

        if commit or any(lv.known + (lv.known == 0) < lv.room for lv in lives if not lv.commit_next):
            # the step's first forward: complete blocks commit (merged: beside their next block's first preview)
            ids = torch.cat([block, torch.full_like(block, mask)], dim=1) if merge else block
            logits = self._forward_decode(ids, commit, commit_tokens=bs, attention=self._preview_attention,
                                          keep_logits=None, preview=True)
            forwards += 1
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
            draft(logits, needed())
            while bool((fill := needed()).any()):  # a host sync per further preview (a diffusion step has one too)
                draft(self._forward_decode(block, [], commit_tokens=bs, attention=self._preview_attention,
                                           keep_logits=None, preview=True), fill)
                forwards += 1
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
        done: list[Sequence] = []
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
            live.logprobs.extend(row[bs + live.known:bs + live.known + kept_out])
            live.scored += kept_out
            live.known = v
            if finished:
                done.append(live)
            elif v == live.room:  # complete: committed by the next step's first forward
                live.commit_next = True
        self._release(done)
        self.stats.decode_rows += n
        self._take_time(lives, start)
        return done

    def _first_tokens(self, idx: torch.Tensor) -> None:
        """Rows `idx` start a block: its first token is the trunk's greedy choice from the saved logits of the last
        committed position (penalised by the response so far), chosen on the device."""
        raw = self.logits.index_select(0, idx)[:, None]
        if self.counts is not None:
            raw = apply_penalties(raw, self.counts.index_select(0, idx), self.options)
        tok, _ = pick_tokens(raw, 0.0, 1.0)
        self.block[:, :1].index_copy_(0, idx, tok)
