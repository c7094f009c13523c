"""flex_attention's block mask, built from the engine's slot positions (ops.AttentionMask.block_mask), through
flex_attention compiled for the CPU, against SDPA with the dense mask built from the same positions.

The shapes are those of the GPU's static decode step in test_model_interpret.py's diffusion run (4 rows, a merged
commit of 2 blocks, the whole ring of the tiny preset's 256-token window): on a CPU flex compiles once per shape
(ops._flex), and this test and that run share the compile.
"""

from __future__ import annotations

import pytest
import torch
from clover_batch.model import from_preset, kernels, ops
from clover_batch.model.slots import SlotRows, SlotState
from tolerances import MASK_RTOL, assert_close

CHUNK, T = 24, 16  # the engine's prefill chunk (ring = window + chunk) and a merged commit: two blocks of 8
LENGTHS = [0, 5, 150, 400]  # committed tokens per slot: empty, short (most of the ring empty), inside the window,
# and one that wrapped its ring and sees only the window's last positions


def _slot_mask(attention: str) -> ops.AttentionMask:
    """The mask of one static decode forward of T tokens over slots holding LENGTHS, from the slots' ring."""
    config = from_preset("tiny")
    slots = SlotState(config, len(LENGTHS), window=config.window_tokens, max_forward_tokens=CHUNK)
    R = slots.capacity
    for slot, length in enumerate(LENGTHS):  # what committing forwards wrote: position p at ring entry p % R
        positions = torch.arange(length)
        slots.key_pos[slot, positions % R] = positions
        slots.positions[slot] = length
    rows = SlotRows.static(slots, 0, len(LENGTHS), T, torch.ones(len(LENGTHS), dtype=torch.bool))
    q_pos = rows.positions[:, None] + torch.arange(T)  # [B, T]
    rows.write_key_positions(q_pos)
    block = config.diffusion.block_size
    visible_until = q_pos.clone() if attention == "causal" else (q_pos // block + 1) * block - 1
    return ops.AttentionMask(slots.key_pos[:, :rows.read], q_pos, visible_until, slots.window)


@pytest.mark.parametrize("attention", ["block_causal", "causal"])
@torch.inference_mode()  # as the engine runs it (and so the compile is shared)
def test_block_mask_from_slot_positions_equals_the_dense_mask(attention):
    mask = _slot_mask(attention)
    B, S = mask.key_pos.shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, 4, T, 16, generator=gen)  # the tiny preset's attention: 4 query heads over 2 KV heads
    k = torch.randn(B, 2, S, 16, generator=gen)
    v = torch.randn(B, 2, S, 16, generator=gen)
    assert kernels.flex_for(q), "CLOVER_ATTENTION=flex takes flex_attention on CPU tensors"
    got = ops.attention(q, k, v, mask)  # compiled flex_attention with mask.block_mask()
    with kernels.forced_attention("dense"):
        want = ops.attention(q, k, v, mask)
    assert_close(got, want, MASK_RTOL, f"{attention}: flex vs dense")
    assert_close(got, ops.attention_reference(q, k, v, mask.dense()), MASK_RTOL, f"{attention}: flex vs eager")

    kept = mask.block_mask().kv_num_blocks[:, 0, 0]  # [B]: key blocks flex reads for the one query block
    kv_indices = mask.block_mask().kv_indices[:, 0, 0]
    n_blocks = -(-S // ops.FLEX_BLOCK)
    assert int(kept.min()) < n_blocks, "no key block was skipped"
    seen_BK = torch.nn.functional.pad(mask.dense().any(1), (0, n_blocks * ops.FLEX_BLOCK - S)).view(B, n_blocks, -1)
    for b in range(B):  # skipping is exact: every key block holding a visible key is read
        needed = set(seen_BK[b].any(-1).nonzero().flatten().tolist())
        assert needed <= set(kv_indices[b, :int(kept[b])].tolist()), (b, needed)
