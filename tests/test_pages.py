"""Paged keys and values: the page allocator's invariants, and the engine over pages smaller than a window, with a
pool too small for everyone (preemption), packed prefill and reads of live keys only."""

from __future__ import annotations

import math
import random

import pytest
import torch
from clover_batch.model import DecodeOptions, Engine, Request, load_model
from clover_batch.model.generate import generate_nocache, prompt_seed
from clover_batch.model.ops import (
    causal_conv,
    causal_conv_reference,
    causal_conv_varlen,
    gdn_chunked_varlen,
    gdn_recurrent,
)
from clover_batch.model.pages import PagePool, PoolExhausted, pages_for

# ---- the allocator ------------------------------------------------------------------------------------------------


def test_grow_slide_release_and_exhaust():
    pool = PagePool(6, page_size=4)
    assert pool.grow("a", 9) == [(0, 0), (1, 1), (2, 2)]  # positions 0..8: logical pages 0, 1, 2
    assert pool.grow("a", 12) == []  # already held
    assert pool.needed("b", 13) == 4
    with pytest.raises(PoolExhausted):
        pool.grow("b", 13)  # 4 pages needed, 3 free: nothing is taken
    assert pool.free_pages == 3 and not pool.table("b").pages
    assert pool.slide("a", 8) == [(0, 0), (1, 1)]  # pages wholly before position 8 go back
    assert pool.table("a").first == 2 and pool.table("a").physical(2) == 2
    pool.grow("b", 13)
    pool.check()
    assert sorted(p for _, p in pool.release("b")) == [0, 1, 3, 4]
    pool.swap("a", "c")
    assert pool.table("c").physical(2) == 2 and "a" not in pool.tables
    pool.rename("c", "d")
    assert pool.used_pages == 1 and pool.peak_used == 5
    pool.check()


def test_random_operations_keep_the_invariants():
    rng = random.Random(0)
    pool = PagePool(40, page_size=3)
    ends = {s: 0 for s in range(6)}
    for _ in range(2000):
        s = rng.randrange(6)
        op = rng.random()
        if op < 0.6:
            end = ends[s] + rng.randrange(1, 10)
            try:
                pool.grow(s, end)
                ends[s] = end
            except PoolExhausted as e:
                assert e.needed > pool.free_pages
        elif op < 0.9:
            pool.slide(s, max(0, ends[s] - rng.randrange(0, 20)))
        else:
            pool.release(s)
            ends[s] = 0
        pool.check()
        t = pool.tables.get(s)
        if t is not None and t.pages:
            assert t.end * pool.page_size >= ends[s]  # every position asked for is held


def test_pages_for():
    assert pages_for(0, 0, 4) == 0
    assert pages_for(0, 1, 4) == 1
    assert pages_for(3, 5, 4) == 2
    assert pages_for(4, 8, 4) == 1


# ---- the engine over pages ---------------------------------------------------------------------------------------

# block-unaligned prompts, one past the window (several chunks), one shorter than a block
PROMPTS = [list(range(10, 30)), list(range(40, 45)), list(range(100, 170)), [7, 8], list(range(300, 327))]
SMALL = dict(window_tokens=24, prefill_chunk_tokens=16, max_new_tokens=20)
MODES = {
    "autoregressive": ("tiny-ar", DecodeOptions(**SMALL)),
    "diffusion-k3": ("tiny", DecodeOptions(tokens_per_step=3, **SMALL)),
    "clover-threshold": ("tiny-clover", DecodeOptions(threshold=0.3, **SMALL)),
    "sampling": ("tiny", DecodeOptions(temperature=0.8, seed=3, threshold=0.5, **SMALL)),
}


@pytest.fixture(scope="module")
def models():
    return {name: load_model(name, seed=1) for name in ("tiny", "tiny-ar", "tiny-clover")}


def _run(engine: Engine, options: DecodeOptions, prompts: list[list[int]]) -> dict:
    for i, p in enumerate(prompts):
        engine.add(Request(str(i), p, seed=prompt_seed(options.seed or 0, 0)))
    results = {}
    while engine.has_work:
        results.update(engine.step())
    return results


@pytest.mark.parametrize("mode,merge", [("autoregressive", False), ("diffusion-k3", True),
                                        ("clover-threshold", False), ("sampling", True)],
                         ids=["autoregressive", "diffusion-merged", "clover", "sampling-merged"])
def test_a_pool_too_small_for_everyone_preempts_and_outputs_stay_exact(models, mode, merge):
    """4-token pages under a 24-token window, a pool of one window's pages for 4 slots: sequences are preempted and
    recomputed, and every output equals the no-cache reference; no page is left held."""
    name, options = MODES[mode]
    model = models[name]
    probe = Engine(model, options, max_slots=4, page_size=4, merge_commits=merge)
    budget = 4 * probe.slot_bytes.fixed + probe.window_pages * probe.slot_bytes.page
    engine = Engine(model, options, max_slots=4, page_size=4, merge_commits=merge, memory_budget_bytes=budget)
    assert engine.num_slots == 4 and engine.num_pages == probe.window_pages
    results = _run(engine, options, PROMPTS)
    assert engine.stats.preemptions > 0
    for i, prompt in enumerate(PROMPTS):
        ref = generate_nocache(model, prompt, options)
        assert results[str(i)].tokens == ref.tokens, i
    engine.slots.pool.check()
    assert engine.slots.pool.used_pages == 0 and engine.stats.peak_pages <= engine.num_pages


@pytest.mark.parametrize("mode", ["autoregressive", "clover-threshold"])
def test_packed_prefill_of_several_prompts_equals_each_alone(models, mode):
    name, options = MODES[mode]
    model = models[name]
    engine = Engine(model, options, max_slots=6, page_size=4, prefill_tokens_per_step=64,
                    decode_steps_per_prefill=0)
    results = _run(engine, options, PROMPTS)
    assert engine.stats.prefill_steps < sum(-(-len(p) // 16) for p in PROMPTS)  # several prompts per forward
    for i, prompt in enumerate(PROMPTS):
        alone = _run(Engine(model, options, max_slots=1, page_size=4), options, [prompt])["0"]
        assert results[str(i)].tokens == alone.tokens, i
        assert results[str(i)].mean_logprob == pytest.approx(alone.mean_logprob, abs=1e-5)


def test_short_prompts_under_a_long_window_hold_their_pages_not_windows():
    """48 short prompts under a 65,536-token window, in a budget far smaller than 48 windows of keys: all are
    admitted at once, and the pages held at most are what their prompts and outputs need."""
    model = load_model("tiny-ar")
    options = DecodeOptions(window_tokens=65536, prefill_chunk_tokens=512, max_new_tokens=8)
    probe = Engine(model, options, max_slots=48, page_size=16, memory_budget_bytes=2**40)
    window_bytes = probe.window_pages * probe.slot_bytes.page
    budget = 48 * probe.slot_bytes.fixed + 2 * window_bytes  # two windows of keys for 48 sequences
    engine = Engine(model, options, max_slots=48, page_size=16, memory_budget_bytes=budget,
                    prefill_tokens_per_step=4096, decode_steps_per_prefill=0)
    prompts = [[(7 * i + j) % 250 for j in range(20 + 3 * i)] for i in range(48)]
    results = _run(engine, options, prompts)
    assert engine.num_slots == 48 and engine.stats.most_active == 48 and engine.stats.preemptions == 0
    needed = sum(pages_for(0, len(p) + 8, 16) for p in prompts)
    assert engine.stats.peak_pages <= needed + 48  # + a page of lookahead each at most
    assert 48 * probe.window_pages > 20 * engine.num_pages  # the old reservation: 48 whole windows
    for i in (0, 47):
        assert results[str(i)].tokens == generate_nocache(model, prompts[i], options).tokens


def test_each_row_reads_exactly_its_live_keys(models):
    """The gather of one forward: every row reads the positions [max(0, L - window + 1), L + T), padded in front."""
    engine = Engine(models["tiny-ar"], DecodeOptions(**SMALL), max_slots=3, page_size=4)
    slots = engine.slots
    lengths = [0, 10, 40]
    with torch.inference_mode():  # the engine's tensors are inference tensors
        for s, n in enumerate(lengths):
            slots.grow(s, n + 2)
            slots.slide(s, n - 24 + 1)
            slots.positions[s] = n
        _, read, key_pos = slots.rows(0, lengths, 2, None).index()
    assert read.shape == key_pos.shape == (3, 23 + 2)  # the longest row: window - 1 committed keys + 2 new
    for r, n in enumerate(lengths):
        live = [p for p in key_pos[r].tolist() if p >= 0]
        assert live == list(range(max(0, n - 23), n + 2))
        assert (read[r][key_pos[r] < 0] == slots.null).all()


def test_page_reads_group_rows_and_read_exactly_their_live_keys(models):
    """Whole pages per group of rows: every row is in one group, with rows spanning 1, 2, 3-4, 5-8 pages apart; the
    positions it keeps are exactly its live keys; a group of rows that start at one page offset and read as many
    keys reads no padding at all."""
    engine = Engine(models["tiny-ar"], DecodeOptions(**SMALL), max_slots=5, page_size=4)
    slots = engine.slots
    lengths = [0, 10, 40, 11, 41]  # 10 and 11 span 3 pages with the 2 new tokens; 40 and 41 the window's 7
    with torch.inference_mode():
        for s, n in enumerate(lengths):
            slots.grow(s, n + 2)
            slots.slide(s, n - 24 + 1)
            slots.positions[s] = n
        groups = slots.rows(0, lengths, 2, None).page_reads()
    rows = sorted(r for g in groups for r in (range(5) if g.rows is None else g.rows.tolist()))
    assert rows == list(range(5))
    spans = {}
    for g in groups:
        members = list(range(5)) if g.rows is None else g.rows.tolist()
        assert g.pages.shape == (g.count * g.width,) and g.count == len(members)
        for i, r in enumerate(members):
            n = lengths[r]
            assert [p for p in g.key_pos[i].tolist() if p >= 0] == list(range(max(0, n - 23), n + 2))
            spans[r] = g.width
        assert g.exact == (g.key_pos >= 0).all().item()
    assert spans == {0: 1, 1: 4, 3: 4, 2: 7, 4: 7}  # 3 pages pad to 4 (the 3-4 group); 7 pages (5-8) pad to 7
    assert len(groups) == 3


@pytest.mark.parametrize("mode", ["autoregressive", "diffusion-k3", "clover-threshold"])
def test_page_reads_equal_entry_reads_in_the_engine(models, mode):
    """The engine reading whole pages per group of rows gives what it gives reading entry by entry (the reference),
    over packed prefill, preemption-free decode of prompts of 2-70 tokens under a 24-token window."""
    name, options = MODES[mode]

    def run(read_pages: bool) -> dict:
        engine = Engine(models[name], options, max_slots=5, page_size=4, prefill_tokens_per_step=64)
        engine.slots.read_pages = read_pages
        return _run(engine, options, PROMPTS)

    pages, entries = run(True), run(False)
    for key, got in pages.items():
        assert got.tokens == entries[key].tokens, key
        assert got.mean_logprob == pytest.approx(entries[key].mean_logprob, abs=1e-5)


# ---- packed kernels ----------------------------------------------------------------------------------------------


def test_varlen_kernels_equal_each_sequence_alone():
    gen = torch.Generator().manual_seed(0)
    H, K, V, C = 4, 8, 6, 10
    lengths = [5, 70, 1, 33]
    T = sum(lengths)
    q = torch.nn.functional.normalize(torch.randn(T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, K, generator=gen), dim=-1)
    v, g, beta = torch.randn(T, H, V, generator=gen), -torch.rand(T, H, generator=gen), torch.rand(T, H, generator=gen)
    S0 = torch.randn(4, H, K, V, generator=gen)
    o, S = gdn_chunked_varlen(q, k, v, g, beta, S0, lengths, chunk=16)
    x, w = torch.randn(T, C, generator=gen), torch.randn(C, 4, generator=gen)
    tails = torch.randn(4, 3, C, generator=gen)
    y, new_tails = causal_conv_varlen(x, w, tails, lengths)
    start = 0
    for i, n in enumerate(lengths):
        part = slice(start, start + n)
        ref_o, ref_S = gdn_recurrent(q[None, part], k[None, part], v[None, part], g[None, part], beta[None, part],
                                     S0[i:i + 1])
        torch.testing.assert_close(o[part], ref_o[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(S[i], ref_S[0], rtol=1e-5, atol=1e-5)
        ref_y, ref_tail = causal_conv(x[None, part], w, tails[i:i + 1])
        torch.testing.assert_close(y[part], ref_y[0])
        torch.testing.assert_close(y[part], causal_conv_reference(x[None, part], w, tails[i:i + 1])[0][0])  # conv1d
        torch.testing.assert_close(new_tails[i], ref_tail[0])
        start += n


def test_attention_over_the_page_pool_equals_attention_over_the_gathered_keys(models):
    """The flex path reads the pool itself through a block mask built from the page tables (ops.PagedMask); the
    dense path gathers each row's live keys. On real engine state (prompts of several lengths, some past the
    window, mid-decode), both give the same attention, the block mask visits only each row's own pages, and its
    mask_mod admits exactly what the gathered positions say."""
    import warnings

    from clover_batch.model import ops
    from torch.nn.attention.flex_attention import flex_attention

    model = models["tiny-ar"]
    options = DecodeOptions(window_tokens=24, prefill_chunk_tokens=16, max_new_tokens=40)
    engine = Engine(model, options, max_slots=3, page_size=4)
    with torch.inference_mode():  # uncompiled flex multiplies every pool entry (masked ones by 0): no garbage
        for t in (*engine.slots.keys, *engine.slots.values):
            if t is not None:
                t.zero_()
    for i, prompt in enumerate([list(range(10, 60)), list(range(40, 45)), list(range(100, 130))]):
        engine.add(Request(str(i), prompt))
    while len(engine.decoding) < 3:
        engine.step()
    for _ in range(5):
        engine.step()
    slots, T = engine.slots, 2
    lengths = [lv.length for lv in engine.decoding]
    gen = torch.Generator().manual_seed(0)
    cfg = model.config
    k = torch.randn(3, cfg.num_key_value_heads, T, cfg.head_dim, generator=gen)
    v = torch.randn(3, cfg.num_key_value_heads, T, cfg.head_dim, generator=gen)
    q = torch.randn(3, cfg.num_attention_heads, T, cfg.head_dim, generator=gen)
    layer = next(i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention")
    with torch.inference_mode():
        for lv in engine.decoding:
            slots.grow(lv.slot, lv.length + T)
        slots.read_pages = False  # entry by entry: the reference
        dense_rows = slots.rows(0, lengths, T, None)
        dense_rows.paged = False
        q_pos = dense_rows.query_positions()
        [read], _ = dense_rows.layer(layer).extended(k, v, q_pos)
        keys, values, key_pos = read.keys, read.values, read.key_pos
        expected = ops.attention_dense(q, keys, values, ops.AttentionMask(key_pos, q_pos, q_pos, 24).dense())
        slots.read_pages = True  # whole pages, rows grouped by the pages they span
        page_rows = slots.rows(0, lengths, T, None)
        page_rows.paged = False
        reads, _ = page_rows.layer(layer).extended(k, v, q_pos)
        by_pages = torch.full_like(q, math.nan)
        for r in reads:
            rows = torch.arange(3) if r.rows is None else r.rows
            by_pages[rows] = ops.attention_dense(q[rows], r.keys, r.values,
                                                 ops.AttentionMask(r.key_pos, q_pos[rows], q_pos[rows], 24).dense())
            for i, row in enumerate(rows.tolist()):  # each row reads exactly the positions the reference reads
                assert sorted(p for p in r.key_pos[i].tolist() if p >= 0) == \
                    [p for p in key_pos[row].tolist() if p >= 0]
        assert len(reads) > 1  # rows of 1 and of several pages read in separate groups
        paged_rows = slots.rows(0, lengths, T, None)
        paged_rows.paged = True
        paged_rows.write_key_positions(q_pos)
        [pr], _ = paged_rows.layer(layer).extended(k, v, q_pos)
        pool_k, pool_v, paged = pr.keys, pr.values, pr.key_pos
        mask = ops.PagedMask(paged.table, paged.pool_pos, paged.page_size, q_pos, q_pos, 24)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex_attention uncompiled (the exact, slow form) on a CPU
            got = flex_attention(q, pool_k.permute(1, 0, 2)[None], pool_v.permute(1, 0, 2)[None],
                                 block_mask=mask.block_mask(), enable_gqa=True)
        dense = mask.dense()  # [B, T, N]: which pool entries each query may see
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_pages, expected, rtol=1e-5, atol=1e-5)
    for r, lv in enumerate(engine.decoding):
        seen = sorted(int(slots.pool_pos[e]) for e in dense[r, -1].nonzero().flatten())
        last = int(q_pos[r, -1])
        assert seen == [p for p in key_pos[r].tolist() if p >= 0 and last - 24 < p <= last]  # its window exactly
        held = set(slots.pool.tables[lv.slot].pages)
        visited = mask.block_mask().kv_indices[r, 0, 0, :int(mask.block_mask().kv_num_blocks[r, 0, 0])].tolist()
        assert visited and set(visited) <= held  # only the row's own pages (a 4-token page is one key block)
