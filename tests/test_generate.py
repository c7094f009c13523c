"""The generation engine against plain references: transformers' greedy generate, and a no-cache recompute."""

from __future__ import annotations

import math

import pytest
import torch
from clover_batch.model import generate, load_model
from clover_batch.model.generate import generate_nocache, select_positions, token_distribution
from reference import make_reference

PROMPTS = [list(range(5, 30)), [40, 41, 42], list(range(100, 164)), list(range(300, 309))]  # 25, 3, 64 (8 blocks), 9


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def tiny_ar():
    return load_model("tiny-ar")


@pytest.fixture(scope="module")
def tiny_shift():
    model = load_model("tiny")
    d = model.config.diffusion
    model.config = model.config.replace(
        diffusion=type(d)(block_size=d.block_size, mask_token_id=d.mask_token_id, logits_shift=True)
    )
    return model


def test_greedy_autoregressive_equals_transformers_generate(tmp_path):
    ref = make_reference(tmp_path, seed=3)
    ours = load_model(tmp_path)
    prompt = [7, 99, 12, 250, 31, 4, 18]
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    expected = out[0, len(prompt) :].tolist()
    got = generate(ours, [prompt], max_new_tokens=16)[0]
    assert got.tokens == expected
    assert got.stopped == "length"
    # one prefill pass, then one forward per token except the last (nothing reads its logits)
    assert got.forward_passes == 1 + 15 and got.denoising_steps == 16


CASES = {
    "greedy-top1": dict(),
    "threshold": dict(threshold=0.0025),
    "fixed-k3": dict(tokens_per_step=3),
    "fixed-k8": dict(tokens_per_step=8),
    "small-window": dict(window_tokens=16, prefill_chunk_tokens=16, threshold=0.003),
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_diffusion_cached_equals_nocache_recompute(tiny, options):
    gens = generate(tiny, PROMPTS, max_new_tokens=21, **options)
    for prompt, g in zip(PROMPTS, gens, strict=True):
        ref = generate_nocache(tiny, prompt, max_new_tokens=21, **options)
        assert g.tokens == ref.tokens
        assert g.denoising_steps == ref.denoising_steps
        assert len(g.tokens) == 21 and g.stopped == "length"


def test_logits_shift_cached_equals_nocache(tiny_shift):
    for prompt in PROMPTS:
        g = generate(tiny_shift, [prompt], max_new_tokens=13, tokens_per_step=2)[0]
        ref = generate_nocache(tiny_shift, prompt, max_new_tokens=13, tokens_per_step=2)
        assert g.tokens == ref.tokens and g.denoising_steps == ref.denoising_steps


def test_logits_shift_changes_the_output(tiny, tiny_shift):
    plain = generate(tiny, PROMPTS[:1], max_new_tokens=16, tokens_per_step=2)[0].tokens
    shifted = generate(tiny_shift, PROMPTS[:1], max_new_tokens=16, tokens_per_step=2)[0].tokens
    assert plain != shifted


@pytest.mark.parametrize("name", ["tiny", "tiny_ar"])
def test_autoregressive_and_diffusion_match_nocache_with_window(name, request):
    model = request.getfixturevalue(name)
    long_prompt = [(i * 37) % 250 + 3 for i in range(90)]  # far longer than the window of 24
    g = generate(model, [long_prompt], max_new_tokens=12, window_tokens=24, prefill_chunk_tokens=16)[0]
    ref = generate_nocache(model, long_prompt, max_new_tokens=12, window_tokens=24, prefill_chunk_tokens=16)
    assert g.tokens == ref.tokens
    assert g.windows == math.ceil(90 / 24)
    full = generate(model, [long_prompt], max_new_tokens=12)[0]  # the default window sees all 90 tokens
    assert full.tokens != g.tokens


@pytest.mark.parametrize("name", ["tiny", "tiny_ar"])
def test_batch_equals_each_prompt_alone(name, request):
    model = request.getfixturevalue(name)
    options = dict(max_new_tokens=19, threshold=0.0025) if name == "tiny" else dict(max_new_tokens=19)
    batch = generate(model, PROMPTS, **options)
    for prompt, g in zip(PROMPTS, batch, strict=True):
        alone = generate(model, [prompt], **options)[0]
        assert g.tokens == alone.tokens
        assert g.denoising_steps == alone.denoising_steps


@pytest.mark.parametrize("name", ["tiny", "tiny_ar"])
def test_sampling_is_reproducible_with_a_seed(name, request):
    model = request.getfixturevalue(name)
    a = generate(model, PROMPTS, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=11)
    b = generate(model, PROMPTS, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=11)
    c = generate(model, PROMPTS, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=12)
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.tokens for g in a] != [g.tokens for g in c]
    greedy = generate(model, PROMPTS, max_new_tokens=16)
    assert [g.tokens for g in a] != [g.tokens for g in greedy]


def test_sampling_without_a_seed_or_with_a_huge_one(tiny):
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    a = generate(tiny, PROMPTS[:2], max_new_tokens=8, temperature=0.8)  # seed None: fresh draws each call
    assert torch.rand(1) == before  # the caller's global RNG is not reseeded
    assert all(len(g.tokens) == 8 or g.stopped == "eos" for g in a)
    big = [generate(tiny, PROMPTS[:2], max_new_tokens=8, temperature=0.8, seed=2**62 + 7) for _ in range(2)]
    assert [g.tokens for g in big[0]] == [g.tokens for g in big[1]]


def test_select_positions_threshold_fallback_and_fixed_k():
    conf = torch.tensor([0.95, 0.2, 0.91, 0.99, 0.5])
    cand = torch.tensor([True, True, True, False, True])  # position 3 is already filled
    assert select_positions(conf, cand, 0.9, None).tolist() == [True, False, True, False, False]
    assert select_positions(conf, cand, 0.96, None).tolist() == [True, False, False, False, False]  # top-1 fallback
    assert select_positions(conf, cand, 0.9, 3).tolist() == [True, False, True, False, True]
    assert select_positions(conf, cand, 0.9, 9).tolist() == cand.tolist()  # k beyond the candidates: all of them


def test_token_distribution_temperature_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    torch.testing.assert_close(token_distribution(logits, 0.0, 0.5), torch.tensor([[0.5, 0.3, 0.2]]))  # greedy
    torch.testing.assert_close(token_distribution(logits, 1.0, 0.6), torch.tensor([[0.625, 0.375, 0.0]]))
    torch.testing.assert_close(token_distribution(logits, 1.0, 0.5), torch.tensor([[1.0, 0.0, 0.0]]))
    hot = token_distribution(logits, 2.0, 1.0)  # temperature 2: p ~ sqrt(p)
    torch.testing.assert_close(hot, torch.tensor([[0.5, 0.3, 0.2]]).sqrt() / torch.tensor([0.5, 0.3, 0.2]).sqrt().sum())


def test_fixed_k_step_counts(tiny):
    # prompt of 25 tokens: block of 8 starts at 24 with 1 prompt token and 7 masks; 21 tokens = 7 + 8 + 6
    g = generate(tiny, [PROMPTS[0]], max_new_tokens=21, tokens_per_step=2)[0]
    assert g.denoising_steps == math.ceil(7 / 2) + math.ceil(8 / 2) + math.ceil(6 / 2)
    # prefill of 24 tokens (one chunk) + steps + a commit after each of the first two blocks
    assert g.forward_passes == 1 + g.denoising_steps + 2


def test_stops_after_block_with_stop_token(tiny, tiny_ar):
    for model in (tiny, tiny_ar):
        free = generate(model, [PROMPTS[2]], max_new_tokens=24, tokens_per_step=1 if model is tiny else None)[0]
        stop = free.tokens[5]
        first = free.tokens.index(stop)
        g = generate(
            model, [PROMPTS[2]], max_new_tokens=24, stop_token_ids=[stop], tokens_per_step=1 if model is tiny else None
        )[0]
        assert g.stopped == "eos"
        assert g.tokens == free.tokens[:first]


def test_prefill_state_is_bounded_by_the_window(tiny_ar):
    model = tiny_ar
    state = None
    ids = torch.randint(0, 250, (1, 200), generator=torch.Generator().manual_seed(0))
    for start in range(0, 200, 16):
        _, state = model(ids[:, start : start + 16], state, window_tokens=24)
        attn = [s for s in state.layers if hasattr(s, "key_pos")]
        # what the next query can see: the last 23 positions (the window counts the query itself)
        end = min(start + 16, 200)
        assert [s.key_pos[0].tolist() for s in attn] == [list(range(max(0, end - 23), end))] * len(attn)
    assert int(state.positions[0]) == 200


BAD = {
    "threshold-zero": (dict(threshold=0.0), "threshold"),
    "threshold-above-one": (dict(threshold=1.5), "threshold"),
    "max-new-tokens-zero": (dict(max_new_tokens=0), "max_new_tokens"),
    "block-not-dividing-chunk": (dict(prefill_chunk_tokens=12), "does not divide prefill_chunk_tokens"),
    "k-above-block": (dict(tokens_per_step=9), "tokens_per_step"),
    "top-p-zero": (dict(top_p=0.0), "top_p"),
    "negative-temperature": (dict(temperature=-1.0), "temperature"),
    "stop-id-outside-vocab": (dict(stop_token_ids=[9999]), "outside the vocabulary"),
}


@pytest.mark.parametrize(("options", "match"), BAD.values(), ids=BAD.keys())
def test_bad_options_are_clear_errors(tiny, options, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny, [[1, 2, 3]], **options)


def test_bad_prompts_are_clear_errors(tiny):
    with pytest.raises(ValueError, match=r"prompt 1 has token ids outside the vocabulary.*\[512\]"):
        generate(tiny, [[1, 2], [3, 512]])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate(tiny, [[]])
    with pytest.raises(ValueError, match="prompts is empty"):
        generate(tiny, [])


@pytest.mark.parametrize("k", [None, 1, 3, 8], ids=["threshold", "k1", "k3", "k8"])
def test_batched_selection_equals_the_per_sequence_reference(k):
    """select_block_positions over a batch == select_positions row by row, ties included (stable by position)."""
    from clover_batch.model.sampling import select_block_positions

    gen = torch.Generator().manual_seed(0)
    conf = torch.rand(64, 8, generator=gen)
    conf[::3, 2:5] = 0.5  # ties
    conf[1] = 0.01  # nothing passes the threshold: top-1 fallback
    needed = torch.rand(64, 8, generator=gen) < 0.6
    needed[5] = False  # a row with nothing to fill
    batched = select_block_positions(conf, needed, 0.6, k)
    for r in range(64):
        assert batched[r].tolist() == select_positions(conf[r], needed[r], 0.6, k).tolist(), r


def test_batched_pick_equals_per_sequence_sampling():
    from clover_batch.model.sampling import pick_tokens, sample_tokens

    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(1))
    tok, conf = pick_tokens(logits, 0.0, 1.0)
    for r in range(3):
        ref_tok, ref_conf = sample_tokens(token_distribution(logits[r], 0.0, 1.0), 0.0, None)
        assert tok[r].tolist() == ref_tok.tolist() and torch.equal(conf[r], ref_conf)
    gens = [torch.Generator().manual_seed(s) for s in (5, 6, 7)]
    tok, conf = pick_tokens(logits, 0.8, 0.9, gens, rows=[0, 2])
    for r, seed in ((0, 5), (2, 7)):
        ref_tok, _ = sample_tokens(token_distribution(logits[r], 0.8, 0.9), 0.8, torch.Generator().manual_seed(seed))
        assert tok[r].tolist() == ref_tok.tolist()
    assert tok[1].tolist() == [0] * 5 and torch.equal(gens[1].get_state(), torch.Generator().manual_seed(6).get_state())


def test_per_request_token_budget(tiny):
    from clover_batch.model import DecodeOptions, Engine, Request

    engine = Engine(tiny, DecodeOptions(max_new_tokens=20, tokens_per_step=2), max_slots=2)
    engine.add(Request("short", PROMPTS[0], max_new_tokens=5))
    engine.add(Request("default", PROMPTS[1]))
    results = {}
    while engine.has_work:
        results.update(engine.step())
    assert results["short"].tokens == generate(tiny, [PROMPTS[0]], max_new_tokens=5, tokens_per_step=2)[0].tokens
    assert len(results["default"].tokens) == 20
