"""flex_attention over the engine's page pool: the block mask built from page tables (ops.PagedMask.block_mask),
through flex_attention compiled for the CPU, against SDPA over the same pool with the dense mask.

The shapes are those of the GPU's static decode step (4 rows, a merged commit of 2 blocks of the tiny preset, each
row free to read a whole 256-token window): on a CPU flex compiles once per shape (ops._flex).
"""

from __future__ import annotations

import pytest
import torch
from clover_batch.model import from_preset, kernels, ops
from clover_batch.model.slots import SlotRows, SlotState
from tolerances import MASK_RTOL, assert_close

CHUNK, T, PAGE = 24, 16, 128  # the engine's prefill chunk, a merged commit (two blocks of 8), a flex block per page
LENGTHS = [0, 5, 150, 400]  # committed tokens per slot: empty, short, inside the window, and one whose window
# has slid past its first pages (which went back to the pool)


@torch.inference_mode()
def _paged(attention: str) -> tuple[SlotState, ops.PagedMask]:
    """A static decode forward of T tokens over slots holding LENGTHS: pages, positions and the mask over them."""
    config = from_preset("tiny")
    window = config.window_tokens
    slots = SlotState(config, len(LENGTHS), window=window, max_forward_tokens=CHUNK, num_pages=16, page_size=PAGE)
    for slot, length in enumerate(LENGTHS):  # what committing forwards left: pages for the window, then T more
        slots.grow(slot, length + T)
        slots.slide(slot, length - window + 1)
        live = torch.arange(max(0, length - window + 1), length)
        table = slots.pool.tables[slot]
        entries = torch.tensor([table.physical(int(p) // PAGE) * PAGE + int(p) % PAGE for p in live], dtype=torch.long)
        if len(live):
            slots.pool_pos[entries] = live
        slots.positions[slot] = length
    for t in (*slots.keys, *slots.values):
        if t is not None:
            t.normal_()  # keys and values everywhere, pages nobody holds included: none of them may be read
    rows = SlotRows.static(slots, 0, len(LENGTHS), T, torch.ones(len(LENGTHS), dtype=torch.bool))
    assert rows.paged, "CLOVER_ATTENTION=flex reads the pool through page tables"
    q_pos = rows.query_positions()
    rows.write_key_positions(q_pos)
    block = config.diffusion.block_size
    visible_until = q_pos.clone() if attention == "causal" else (q_pos // block + 1) * block - 1
    return slots, ops.PagedMask(slots.table, slots.pool_pos, PAGE, q_pos, visible_until, window)


@pytest.mark.parametrize("attention", ["block_causal", "causal"])
@torch.inference_mode()  # as the engine runs it (and so the compile is shared)
def test_block_mask_from_page_tables_equals_the_dense_mask(attention):
    slots, mask = _paged(attention)
    layer = next(i for i, t in enumerate(slots.keys) if t is not None)
    keys, values = slots.keys[layer], slots.values[layer]  # [N, Hkv, D]
    B = len(LENGTHS)
    q = torch.randn(B, 4, T, 16, generator=torch.Generator().manual_seed(0))  # the tiny preset: 4 query heads
    assert kernels.flex_for(q)
    got = ops.attention(q, keys, values, mask)  # compiled flex_attention over the pool
    k = keys.permute(1, 0, 2)[None].expand(B, -1, -1, -1)
    v = values.permute(1, 0, 2)[None].expand(B, -1, -1, -1)
    dense = mask.dense()  # [B, T, N]
    assert_close(got, ops.attention_reference(q, k, v, dense), MASK_RTOL, f"{attention}: flex over pages vs eager")

    kept = mask.block_mask().kv_num_blocks[:, 0, 0]  # [B]: key blocks flex reads for the one query block
    kv_indices = mask.block_mask().kv_indices[:, 0, 0]
    for b, slot_pages in enumerate(slots.pool.tables[s].pages for s in range(B)):
        visited = set(kv_indices[b, :int(kept[b])].tolist())
        needed = set((dense[b].any(0).nonzero().flatten() // PAGE).tolist())
        assert needed <= visited <= set(slot_pages), (b, needed, visited)  # exact: its own pages, every one needed
