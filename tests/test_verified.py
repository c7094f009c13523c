"""Verified block decoding (`mode: verified`): its output is the autoregressive output token for token, in the
engine with staggered arrivals, preemption and packed prefill, past the attention window, with penalties and stops;
its acceptance statistics equal the plain reference's; and it is refused where it has no meaning.

Random models' previews disagree with their trunks, so drafts are rejected in every test here: a commit that kept a
rejected token would put a token the trunk did not choose into the state and the output, and the equality fail.
"""

from __future__ import annotations

import pytest
import torch
from clover_batch.model import DecodeOptions, Engine, Request, generate, load_model
from clover_batch.model.generate import generate_nocache


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# a prompt far past the 24-token window (many 16-token prefill chunks), block-unaligned ones, one shorter than a block
PROMPTS = {"long": _prompt(150, 1), "a": _prompt(25, 2), "b": _prompt(3, 3), "c": _prompt(40, 4), "d": _prompt(9, 5)}
SMALL = dict(window_tokens=24, prefill_chunk_tokens=16, max_new_tokens=21, stop_token_ids=[])
PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
# (model, drafting options): Clover's layout; our trunk layout with next-token logits (block-causal previews)
CASES = {
    "clover-threshold": ("tiny-clover", dict(threshold=0.0025)),
    "clover-k3": ("tiny-clover", dict(tokens_per_step=3)),
    "clover-penalties": ("tiny-clover", dict(threshold=0.5, **PENALTIES)),
    "trunk-shifted-k2": ("tiny-shifted", dict(tokens_per_step=2)),
}


@pytest.fixture(scope="module")
def models():
    return {"tiny-clover": load_model("tiny-clover", seed=2),
            "tiny-shifted": load_model("tiny", seed=2, overrides={"logits_shift": True})}


def _options(case: str, mode: str, **extra) -> DecodeOptions:
    drafting = CASES[case][1]
    if mode == "autoregressive":
        drafting = {k: v for k, v in drafting.items() if k not in ("threshold", "tokens_per_step")}
    return DecodeOptions(mode=mode, **{**SMALL, **drafting, **extra})


def _run(engine: Engine, schedule: dict[int, list[str]]) -> dict:
    results, k = {}, 0
    while engine.has_work or any(step >= k for step in schedule):
        for name in schedule.get(k, []):
            engine.add(Request(name, PROMPTS[name]))
        results.update(engine.step())
        k += 1
    return results


def _rejections(gens) -> int:
    """Checks whose draft the trunk did not accept to the block's limit (each rejected a drafted token or had
    none to check)."""
    return sum(g.verified_blocks - g.full_blocks for g in gens)


@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_verified_equals_autoregressive_with_staggered_arrivals(models, case):
    model = models[CASES[case][0]]
    ar = {k: g for k, g in zip(PROMPTS, generate(model, list(PROMPTS.values()), _options(case, "autoregressive")),
                               strict=True)}
    engine = Engine(model, _options(case, "verified"), max_slots=3)
    got = _run(engine, {0: ["a", "b"], 2: ["long"], 3: ["c"], 5: ["d"]})
    assert set(got) == set(PROMPTS)
    for key, gen in got.items():
        assert gen.tokens == ar[key].tokens, key
        assert gen.stopped == ar[key].stopped == "length", key
        assert gen.mean_logprob == pytest.approx(ar[key].mean_logprob, abs=2e-5), key
        assert gen.token_logprobs == pytest.approx(ar[key].token_logprobs, abs=1e-4), key
        assert gen.verified_blocks >= 1 and gen.verified_blocks <= gen.accepted_tokens <= len(gen.tokens)
    assert _rejections(got.values()) > 0
    # statistics: a block per row per step; the engine's forwards are its steps' previews, checks and commits
    assert engine.stats.verified_blocks == sum(g.verified_blocks for g in got.values())
    assert engine.stats.accepted_tokens == sum(g.accepted_tokens for g in got.values())


@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_the_engine_equals_the_plain_verified_reference(models, case):
    """Tokens, blocks, tokens accepted and blocks fully accepted equal `generate_nocache`'s, which checks each
    drafted token against a causal forward over everything before it."""
    model = models[CASES[case][0]]
    options = _options(case, "verified")
    gens = generate(model, [PROMPTS["long"], PROMPTS["a"], PROMPTS["b"]], options)
    for gen, key in zip(gens, ["long", "a", "b"], strict=True):
        ref = generate_nocache(model, PROMPTS[key], options)
        assert gen.tokens == ref.tokens, key
        assert (gen.verified_blocks, gen.accepted_tokens, gen.full_blocks) == \
            (ref.verified_blocks, ref.accepted_tokens, ref.full_blocks), key
        assert gen.denoising_steps == ref.denoising_steps, key


@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_merged_commits_equal_their_plain_reference_and_autoregressive(models, case):
    """A complete block committed in the forward of the next block's first preview (CUDA's default, forced here on
    the CPU): tokens equal autoregressive decoding's, and rounds, tokens accepted and drafts fully accepted equal
    the plain reference's with merged rounds (whose first preview of a block runs before its first token)."""
    model = models[CASES[case][0]]
    options = _options(case, "verified")
    keys = ["long", "a", "b"]
    gens = generate(model, [PROMPTS[k] for k in keys], options, merge_commits=True)
    ar = generate(model, [PROMPTS[k] for k in keys], _options(case, "autoregressive"))
    for gen, want, key in zip(gens, ar, keys, strict=True):
        assert gen.tokens == want.tokens, key
        ref = generate_nocache(model, PROMPTS[key], options, merge_commits=True)
        assert gen.tokens == ref.tokens, key
        assert (gen.verified_blocks, gen.accepted_tokens, gen.full_blocks, gen.denoising_steps) == \
            (ref.verified_blocks, ref.accepted_tokens, ref.full_blocks, ref.denoising_steps), key
    # merging changes the rounds, not the tokens: the unmerged reference drafts differently after each commit
    plain = generate_nocache(model, PROMPTS["long"], options)
    assert plain.tokens == gens[0].tokens
    assert plain.denoising_steps != gens[0].denoising_steps


def test_stops_cut_where_autoregressive_stops(models):
    """Stop ids taken from the autoregressive output itself: each prompt stops at the same token, inside a block
    whose later drafted tokens are dropped."""
    model = models["tiny-clover"]
    free = generate(model, list(PROMPTS.values()), _options("clover-threshold", "autoregressive"))
    stops = sorted({g.tokens[7] for g in free} | {g.tokens[12] for g in free})
    ar = generate(model, list(PROMPTS.values()), _options("clover-threshold", "autoregressive", stop_token_ids=stops))
    ve = generate(model, list(PROMPTS.values()), _options("clover-threshold", "verified", stop_token_ids=stops))
    assert [g.tokens for g in ve] == [g.tokens for g in ar]
    assert [g.stopped for g in ve] == [g.stopped for g in ar]
    assert all(g.stopped == "eos" for g in ar) and all(len(g.tokens) <= 12 for g in ar)


@pytest.mark.parametrize("max_new", [1, 7, 8, 9])
def test_max_new_tokens_cuts_where_autoregressive_does(models, max_new):
    model = models["tiny-clover"]
    prompts = [PROMPTS["a"], PROMPTS["b"]]
    ar = generate(model, prompts, _options("clover-k3", "autoregressive", max_new_tokens=max_new))
    ve = generate(model, prompts, _options("clover-k3", "verified", max_new_tokens=max_new))
    assert [g.tokens for g in ve] == [g.tokens for g in ar]
    assert all(len(g.tokens) == max_new for g in ve)


def test_a_pool_too_small_for_everyone_preempts_and_verified_stays_autoregressive(models):
    """4-token pages, a pool of one window's pages for 4 slots: sequences are preempted mid-generation and
    recomputed from their prompts; every output equals autoregressive decoding's; no page is left held."""
    model = models["tiny-clover"]
    options = _options("clover-threshold", "verified")
    probe = Engine(model, options, max_slots=4, page_size=4)
    budget = 4 * probe.slot_bytes.fixed + probe.window_pages * probe.slot_bytes.page
    engine = Engine(model, options, max_slots=4, page_size=4, memory_budget_bytes=budget)
    got = _run(engine, {0: list(PROMPTS)})
    assert engine.stats.preemptions > 0
    ar = generate(model, list(PROMPTS.values()), _options("clover-threshold", "autoregressive"))
    assert [got[k].tokens for k in PROMPTS] == [g.tokens for g in ar]
    engine.slots.pool.check()
    assert engine.slots.pool.used_pages == 0


def test_packed_prefill_and_static_steps_keep_verified_autoregressive(models):
    """Every prompt prefilled in packed forwards before decoding starts, and the preview and check forwards as the
    static-shape step that CUDA graphs replay (eager on a CPU)."""
    model = models["tiny-clover"]
    options = _options("clover-penalties", "verified")
    ar = generate(model, list(PROMPTS.values()), _options("clover-penalties", "autoregressive"))
    for merge in (False, True):
        engine = Engine(model, options, max_slots=6, page_size=4, prefill_tokens_per_step=64,
                        decode_steps_per_prefill=0, cuda_graphs=True, merge_commits=merge)
        assert engine.static is not None
        got = _run(engine, {0: list(PROMPTS)})
        assert engine.stats.prefill_steps < sum(-(-len(p) // 16) for p in PROMPTS.values())
        assert [got[k].tokens for k in PROMPTS] == [g.tokens for g in ar], merge


def test_verified_is_refused_where_it_has_no_meaning():
    with pytest.raises(ValueError, match="logits_shift false"):
        generate(load_model("tiny"), [[1, 2, 3]], mode="verified")
    with pytest.raises(ValueError, match="this model is autoregressive"):
        generate(load_model("tiny-ar"), [[1, 2, 3]], mode="verified")
    with pytest.raises(ValueError, match="temperature must be 0"):
        DecodeOptions(mode="verified", temperature=0.7).check(load_model("tiny-clover").config)
    with pytest.raises(ValueError, match="tokens_per_step must be in"):
        DecodeOptions(mode="verified", tokens_per_step=9).check(load_model("tiny-clover").config)
