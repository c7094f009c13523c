"""The runner: the engine's tensors and forwards. It holds the slot state (GDN state, conv tails, the pages of keys
and values: slots.py) and each slot's decode buffers, and runs the forwards a step asks for.

    runner.prefill(chunks)                  one packed forward over several sequences' prompt chunks
    runner.decode(ids, lengths, commit, ...)  one forward over the decoding slots [0, n): replayed as a static-shape
                                            step (CUDA graph, graphs.py) or run directly
    runner.reset / move / swap / release    a slot's state and buffers, as the scheduler moves sequences

Notable choices:
- Each slot's decode buffers live beside its state, so moving a sequence moves them too: the last committed
  position's logits (next-token logits, fp32), the diffusion or verified block and how much of it may be filled,
  and the response's token counts when a penalty is on (V floats a slot, allocated only then).
- Everything the host sends a forward (token ids, committing rows, new page-table entries) is copied before the
  forward is queued, since a host to device copy queued behind the forward would wait for it.
- The budget (`plan_memory`) pays for at most `max_slots` slots first, then for pages, as many as there are, up
  to a full window for every slot; the pool always holds at least one sequence's full window.
"""

from __future__ import annotations

import os
import time

import torch

from .clover import CloverModel
from .graphs import StaticDecode
from .sequences import Sequence
from .slots import SlotBytes, SlotState, table_columns

CUDA_BUDGET_FRACTION = 0.8  # of the device memory free when the engine starts (the rest: activations, fragmentation)
CPU_BUDGET_FRACTION = 0.5  # of the RAM available when the engine starts


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


def plan_memory(b: SlotBytes, budget: int, max_slots: int, window: int, max_forward_tokens: int,
                page_size: int) -> tuple[int, int]:
    """(slots, pages) the budget pays for: slots first, then pages up to a full window for every slot; the pool
    must hold one sequence's full window. (0, 0) when even one slot does not fit."""
    window_pages = table_columns(window, max_forward_tokens, page_size)
    slots = min(max_slots, (budget - window_pages * b.page) // b.fixed) if budget >= window_pages * b.page else 0
    if slots < 1:
        return 0, 0
    pages = min((budget - slots * b.fixed) // b.page, slots * window_pages)
    return int(slots), int(pages)


class Runner:
    """Slot state, decode buffers and forwards over slots; see the module docstring."""

    @torch.inference_mode()
    def __init__(self, model: CloverModel, *, num_slots: int, num_pages: int, window: int, max_forward: int,
                 lookahead: int, page_size: int, block_size: int, penalized: bool, static: bool,
                 pad_token: int) -> None:
        cfg, dev, S = model.config, model.device, num_slots
        self.model = model
        self.slots = SlotState(cfg, S, window=window, max_forward_tokens=max_forward, num_pages=num_pages,
                               page_size=page_size, lookahead_tokens=lookahead, device=dev, dtype=model.dtype)
        # next-token logits (autoregressive) or the last committed position's logits (logits_shift) per slot
        self.logits = torch.zeros(S, cfg.vocab_size, dtype=torch.float32, device=dev)
        self.block = torch.zeros(S, block_size, dtype=torch.long, device=dev)  # diffusion and verified blocks
        self.limit = torch.zeros(S, dtype=torch.long, device=dev)  # block positions [0, limit) may be filled
        # response token counts per slot, for the penalties (only when some penalty is on: V floats a slot)
        self.counts = torch.zeros(S, cfg.vocab_size, dtype=torch.float32, device=dev) if penalized else None
        self.positions = torch.arange(block_size, device=dev)
        self.static = (StaticDecode(model, self.slots, capture=dev.type == "cuda", pad_token=pad_token) if static
                       else None)

    def _buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.logits, self.block, self.limit, self.counts) if t is not None]

    def reset(self, slot: int) -> None:
        """A slot for a new sequence: empty state, no logits, no counts."""
        self.slots.reset(slot)
        self.logits[slot].zero_()
        if self.counts is not None:
            self.counts[slot].zero_()

    def move(self, src: int, dst: int) -> None:
        self.slots.move(src, dst)
        for t in self._buffers():
            t[dst] = t[src]

    def swap(self, a: int, b: int) -> None:
        self.slots.swap(a, b)
        for t in self._buffers():
            t[[a, b]] = t[[b, a]]

    def prefill(self, chunks: list[tuple[Sequence, int]], *, attention: str, shifted: bool) -> float:
        """One packed forward over `chunks` ((sequence, tokens), in slot order, the slots contiguous): each
        sequence's next prompt tokens after its committed ones. A sequence whose prompt is in gets its last
        position's logits saved (shifted or autoregressive models: they score the first generated token).
        Returns the forward's seconds."""
        t0 = time.perf_counter()
        first = chunks[0][0].slot
        assert [s.slot for s, _ in chunks] == list(range(first, first + len(chunks)))
        ids = torch.tensor([[t for s, n in chunks for t in s.req.prompt_ids[s.length:s.length + n]]],
                           dtype=torch.long, device=self.model.device)
        ends = [s.length + n == s.prefill_target and shifted for s, n in chunks]
        at, pos = [], 0
        for (_, n), end in zip(chunks, ends, strict=True):
            pos += n
            if end:
                at.append(pos - 1)
        rows = self.slots.packed(first, [s.length for s, _ in chunks], [n for _, n in chunks])
        logits = self.model.forward_slots(ids, rows, attention=attention, keep_logits=0, logits_at=at)
        k = 0
        for (seq, _), end in zip(chunks, ends, strict=True):
            if end:
                assert logits is not None
                self.logits[seq.slot] = logits[0, k].float()
                k += 1
        return time.perf_counter() - t0

    def decode(self, ids: torch.Tensor, lengths: list[int], commit: list[int] | None, *, commit_tokens: int,
               attention: str, keep_logits: int | None, preview: bool = False) -> torch.Tensor:
        """A decode forward over slots [0, n) (n = len(lengths), their committed lengths); commit: the rows that
        commit their first `commit_tokens` tokens (None: every row)."""
        if self.static is not None:
            return self.static.forward(ids, commit, commit_tokens=commit_tokens, attention=attention,
                                       keep_logits=keep_logits, preview=preview)
        rows = self.slots.rows(0, lengths, ids.shape[1], commit, commit_tokens)
        logits = self.model.forward_slots(ids, rows, attention=attention, keep_logits=keep_logits, preview=preview)
        assert logits is not None
        return logits
