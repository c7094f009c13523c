"""The engine's decode forward with static shapes, replayed as CUDA graphs.

A decode step launches hundreds of small kernels (every layer's projections, norms, conv, GDN, attention, MoE
routing and grouped GEMMs) for a few tokens per sequence; on a GPU their launch overhead rivals the work. A CUDA
graph records the whole forward once per shape and replays it as one launch.

Notable choices:
- Shapes are made fixed: rows are padded to a bucket (1, 2, 4, 8, ... up to the slot count) with the slots after
  the decoding ones. A padding row commits nothing, and its new keys land in its ring's scratch area (a free slot
  is reset when admitted; a prefilling slot overwrites them with its next chunk; later positions are masked), so
  padding changes no sequence. Which rows commit is a device mask, and attention reads the whole ring through
  flex's block mask built on the device (slots.SlotRows.static): nothing in the captured region reads back to
  the host.
- One graph per (bucket, tokens per row, tokens committed, attention, logits kept, preview), captured on first use
  after a warm-up run with no row committing (which compiles flex_attention and leaves every sequence as it was),
  all sharing one memory pool.
- `capture=False` runs the very same static-shape function eagerly: on a CPU that is what tests compare with the
  engine's ordinary step.
- CUDA graphs need bf16 weights (the fp32 grouped expert GEMM on CUDA takes a per-expert loop that reads the
  expert offsets back to the host) and all experts on the device (the expert-parallel exchange agrees on row
  counts through the host).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .clover import CloverModel
from .moe import LocalDispatcher
from .slots import SlotRows, SlotState

log = logging.getLogger(__name__)

GRAPHS_ENV = "CLOVER_CUDA_GRAPHS"


def graphs_wanted(model: CloverModel) -> bool:
    """The default: CUDA graphs on a CUDA device with bf16 weights, unless CLOVER_CUDA_GRAPHS=0 or the experts are
    spread over ranks (the expert-parallel exchange agrees on row counts through the host every round)."""
    if os.environ.get(GRAPHS_ENV, "1").strip() == "0":
        return False
    local = all(isinstance(layer.mlp.dispatcher, LocalDispatcher) for layer in model.layers)
    return model.device.type == "cuda" and model.dtype == torch.bfloat16 and local


def bucket(n: int, most: int) -> int:
    """The padded row count for n rows: the next power of two, at most `most`."""
    return min(most, 1 << max(0, n - 1).bit_length())


@dataclass
class _Step:
    ids: torch.Tensor  # [rows, T] static input
    commit: torch.Tensor  # [rows] bool static input
    run: Callable[[], torch.Tensor | None]
    out: torch.Tensor | None = None  # the captured output (CUDA graphs) or the last output (eager)


class StaticDecode:
    """Decode forwards over slots [0, bucket) with static shapes; CUDA graphs when `capture`."""

    def __init__(self, model: CloverModel, slots: SlotState, *, capture: bool, pad_token: int) -> None:
        self.model, self.slots, self.capture, self.pad_token = model, slots, capture, pad_token
        self.steps: dict[tuple, _Step] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def forward(self, ids: torch.Tensor, commit: list[int] | None, *, commit_tokens: int, attention: str,
                keep_logits: int | None, preview: bool = False) -> torch.Tensor:
        """Like `model.forward_slots` over slots [0, n) (n = ids rows); commit: the committing rows (None: all)."""
        n, T = ids.shape
        key = (bucket(n, self.slots.num_slots), T, commit_tokens, attention, keep_logits, preview)
        step = self.steps.get(key) or self._build(*key)
        step.ids[:n].copy_(ids)
        step.ids[n:].fill_(self.pad_token)
        step.commit.zero_()
        if commit is None:
            step.commit[:n] = True
        elif commit:
            step.commit[torch.tensor(commit, device=step.commit.device)] = True
        out = step.run()
        assert out is not None
        return out[:n]

    def _build(self, rows: int, T: int, commit_tokens: int, attention: str, keep_logits: int | None,
               preview: bool) -> _Step:
        dev = self.slots.positions.device
        ids = torch.full((rows, T), self.pad_token, dtype=torch.long, device=dev)
        commit = torch.zeros(rows, dtype=torch.bool, device=dev)

        def forward() -> torch.Tensor | None:
            view = SlotRows.static(self.slots, 0, rows, T, commit, commit_tokens)
            return self.model.forward_slots(ids, view, attention=attention, keep_logits=keep_logits, preview=preview)

        step = _Step(ids, commit, forward)
        if self.capture:
            step = self._capture(step)
            log.info("captured a CUDA graph of the decode step: %d rows x %d tokens (%s)", rows, T, attention)
        self.steps[(rows, T, commit_tokens, attention, keep_logits, preview)] = step
        return step

    def _capture(self, step: _Step) -> _Step:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # warm-up with nothing committing: compiles, allocates, changes no sequence
                step.run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            out = step.run()

        def replay() -> torch.Tensor | None:
            graph.replay()
            return out

        return _Step(step.ids, step.commit, replay, out)
