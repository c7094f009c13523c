"""Checkpoints in Clover's published layout, and Clover's preview operator against its plain references.

The trunk of a Clover-layout checkpoint here is written by transformers' Qwen3_5MoeForCausalLM (the reference of the
causal path); the four block-diffusion GDN families are added beside it, with the names, prefix and extra tensors
(mtp.*, model.visual.*) a published snapshot may have.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clover_batch.model import (
    CheckpointError,
    ConfigError,
    DecodeOptions,
    generate,
    load_config,
    load_model,
    vendor_decode_defaults,
)
from clover_batch.model.generate import generate_nocache
from clover_batch.model.moe import route
from clover_batch.model.preview import (
    PreviewPlan,
    coreset_allowed,
    history_mixer,
    history_mixer_reference,
    preview_conv,
    preview_conv_reference,
)
from clover_batch.model.sampling import apply_penalties, penalize, select_block_positions, select_positions
from reference import make_reference
from safetensors import safe_open
from safetensors.torch import save_file

BLOCK, MASK = 8, 299  # the reference shape's vocabulary is 300


def write_clover_checkpoint(out: Path, *, seed: int = 5, nested: bool = False, right_as_conv: bool = False,
                            generation: dict | None = None, in_config: dict | None = None):
    """A Clover-layout snapshot: transformers' trunk under `model.language_model.`, per-expert experts, Clover's
    block-diffusion tensors on every GDN layer, mtp.* and model.visual.* extras; returns the reference model."""
    ref_dir = out / "_reference"
    ref = make_reference(ref_dir, seed=seed)
    with safe_open(str(ref_dir / "model.safetensors"), framework="pt") as f:
        tensors = {k.replace("model.", "model.language_model.", 1): f.get_tensor(k) for k in f.keys()}
    config = json.loads((ref_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    C = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"] + \
        config["linear_num_value_heads"] * config["linear_value_head_dim"]
    Hv, R = config["linear_num_value_heads"], config["linear_conv_kernel_dim"] - 1
    for i, kind in enumerate(config["layer_types"]):
        if kind != "linear_attention":
            continue
        prefix = f"model.language_model.layers.{i}.linear_attn."
        right = torch.randn(C, R, generator=gen) * 0.3
        tensors[prefix + "conv_right_weight"] = right[:, None, :].contiguous() if right_as_conv else right
        tensors[prefix + "bd_softmax_logit_scale"] = 2.0 + torch.rand(Hv, generator=gen) * 4
        tensors[prefix + "bd_softmax_history_bias"] = torch.randn(Hv, generator=gen)
        tensors[prefix + "bd_softmax_history_c"] = 0.5 + torch.rand(Hv, generator=gen)
    tensors["mtp.layers.0.mlp.gate.weight"] = torch.ones(3, 3)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(4, 4)
    save_file(tensors, str(out / "model.safetensors"))
    config.update(model_type="clover_moe", architectures=["CloverMoeModelLM"], **(in_config or {}))
    if nested:
        config = {"architectures": config["architectures"], "model_type": "clover_moe", "text_config": config}
    (out / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (out / "generation_config.json").write_text(json.dumps(generation))
    return ref


@pytest.fixture(scope="module")
def clover_dir(tmp_path_factory):
    """(folder, reference model): block size and mask id in generation_config.json, as dLLM snapshots name them."""
    out = tmp_path_factory.mktemp("clover")
    ref = write_clover_checkpoint(out, generation={"block_length": BLOCK, "mask_id": MASK, "threshold": 0.7,
                                                   "repetition_penalty": 1.05, "eos_token_id": [1, 2]})
    return out, ref


# ---- loading ------------------------------------------------------------------------------------------------------


def test_a_clover_snapshot_loads_with_its_block_settings_and_where_each_came_from(clover_dir):
    path, _ = clover_dir
    model = load_model(path)
    d = model.config.diffusion
    assert (d.block_size, d.mask_token_id, d.preview_operator, d.prompt_attention, d.logits_shift) == \
        (BLOCK, MASK, "clover", "causal", True)
    src = model.config.sources
    assert src["diffusion.block_size"] == "generation_config.json:block_length"
    assert src["diffusion.mask_token_id"] == "generation_config.json:mask_id"
    assert src["hidden_size"] == "config.json:hidden_size"
    assert src["diffusion.logits_shift"].startswith("default for clover_moe")
    gdn = model.layers[0].linear_attn
    assert gdn.conv_right_weight.shape == (gdn.in_proj_qkv.weight.shape[0], 3)
    assert gdn.bd_softmax_history_c.shape == (gdn.Hv,)


def test_nested_text_config_and_right_taps_stored_like_conv1d(tmp_path):
    """text_config nesting, block settings in config.json under the other names, conv_right_weight as [C, 1, R]."""
    write_clover_checkpoint(tmp_path, nested=True, right_as_conv=True,
                            in_config={"block_size": BLOCK, "mask_token_id": MASK})
    model = load_model(tmp_path)
    assert model.config.diffusion.block_size == BLOCK
    assert model.config.sources["diffusion.block_size"] == "config.json:text_config.block_size"
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        stored = f.get_tensor("model.language_model.layers.0.linear_attn.conv_right_weight")
    assert stored.shape[1] == 1
    assert torch.equal(model.layers[0].linear_attn.conv_right_weight, stored[:, 0, :])


def test_missing_block_settings_name_the_keys_looked_for_and_the_job_fields(tmp_path):
    write_clover_checkpoint(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_model(tmp_path)
    message = str(info.value)
    for name in ("block_size / block_length", "mask_token_id / mask_id", "model.block_size", "model.mask_token_id"):
        assert name in message
    assert "config.json" in message and "generation_config.json" not in message  # the folder has none
    model = load_model(tmp_path, overrides={"block_size": BLOCK, "mask_token_id": MASK})  # the job's model section
    assert model.config.sources["diffusion.block_size"] == "job: model.block_size"


def test_a_block_diffusion_tensor_of_another_shape_is_named(tmp_path):
    write_clover_checkpoint(tmp_path, in_config={"block_size": BLOCK, "mask_token_id": MASK})
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.language_model.layers.0.linear_attn.bd_softmax_history_bias"] = torch.zeros(())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"bd_softmax_history_bias: shape \[\], expected \[4\]; the preview "
                                              r"operator reads these per value head"):
        load_model(tmp_path)


def test_the_checkpoint_decode_controls_are_read_with_their_keys(clover_dir):
    path, _ = clover_dir
    assert vendor_decode_defaults(path) == {
        "threshold": (0.7, "generation_config.json:threshold"),
        "repetition_penalty": (1.05, "generation_config.json:repetition_penalty"),
        "stop_token_ids": ([1, 2], "generation_config.json:eos_token_id"),
    }


# ---- the causal trunk ---------------------------------------------------------------------------------------------


def test_autoregressive_mode_runs_the_trunk_exactly_as_transformers(clover_dir):
    """Greedy tokens equal transformers' Qwen3_5MoeForCausalLM on the trunk weights, and mean_logprob is the mean
    of the trunk's own log-probabilities of those tokens."""
    path, ref = clover_dir
    ours = load_model(path)
    prompt = [7, 99, 12, 250, 31, 4, 18, 60, 61, 3, 77]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        logits = ref(input_ids=out).logits[0, len(prompt) - 1:-1].float()
    each = torch.log_softmax(logits, -1).gather(1, torch.tensor(expected)[:, None])[:, 0]
    got = generate(ours, [prompt], max_new_tokens=14, mode="autoregressive", stop_token_ids=[])[0]
    assert got.tokens == expected
    assert got.mean_logprob == pytest.approx(float(each.mean()), abs=1e-4)
    assert got.token_logprobs == pytest.approx(each.tolist(), abs=1e-4)


def test_prefill_and_commits_are_the_causal_trunk(clover_dir):
    """A committed block advances the state exactly as a causal forward over it (the preview is not committed)."""
    path, _ = clover_dir
    model = load_model(path)
    ids = torch.randint(0, 290, (2, 3 * BLOCK), generator=torch.Generator().manual_seed(1))
    whole, _ = model(ids, attention="causal")
    _, state = model(ids[:, :BLOCK])
    preview_logits, same = model(ids[:, BLOCK:2 * BLOCK], state, preview=True)
    assert same is state
    rest, _ = model(ids[:, BLOCK:], state)
    assert torch.allclose(rest, whole[:, BLOCK:], atol=1e-4)
    assert not torch.allclose(preview_logits, whole[:, BLOCK:2 * BLOCK], atol=1e-2)  # a preview is not causal


# ---- diffusion decoding -------------------------------------------------------------------------------------------


def test_diffusion_decoding_runs_and_the_block_diffusion_tensors_change_it(clover_dir):
    path, _ = clover_dir
    model = load_model(path)
    prompts = [list(range(5, 30)), [40, 41, 42], list(range(100, 140))]
    options = DecodeOptions(max_new_tokens=24, tokens_per_step=2, stop_token_ids=[])
    gens = generate(model, prompts, options)
    for prompt, g in zip(prompts, gens, strict=True):
        assert len(g.tokens) == 24 and g.mean_logprob is not None
        assert g.tokens == generate_nocache(model, prompt, options).tokens
    altered = load_model(path)
    for layer in altered.layers:
        if layer.kind == "linear_attention":
            with torch.no_grad():
                layer.linear_attn.conv_right_weight.mul_(-2.0)
                layer.linear_attn.bd_softmax_history_bias.add_(3.0)
    changed = generate(altered, prompts, options)
    assert any(a.tokens != b.tokens for a, b in zip(gens, changed, strict=True))


def test_a_preview_reads_the_clean_state_and_leaves_it_unchanged(clover_dir):
    path, _ = clover_dir
    model = load_model(path)
    ids = torch.randint(0, 290, (1, 2 * BLOCK + 3), generator=torch.Generator().manual_seed(2))
    _, state = model(ids[:, :2 * BLOCK])
    before = [t.clone() for layer in state.layers for t in vars(layer).values()]
    model(torch.full((1, BLOCK), MASK), state, preview=True)
    after = [t for layer in state.layers for t in vars(layer).values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    with pytest.raises(ValueError, match="never commits"):
        model(ids[:, :BLOCK], state, preview=True, commit=True)


# ---- the preview pieces against their references ------------------------------------------------------------------


@pytest.mark.parametrize("T,C", [(1, 6), (5, 7), (8, 16)], ids=["T1", "T5-odd-channels", "T8"])
def test_preview_conv_equals_the_records_formula(T, C):
    gen = torch.Generator().manual_seed(T * 10 + C)
    x, tail = torch.randn(2, T, C, generator=gen), torch.randn(2, 3, C, generator=gen)
    w, right = torch.randn(C, 4, generator=gen), torch.randn(C, 3, generator=gen)
    out = preview_conv(x, w, right, tail)
    ref = preview_conv_reference(x, w, right, tail)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the right taps read only later rows of the block: the last row sees the causal taps alone
    no_right = preview_conv(x, w, torch.zeros_like(right), tail)
    torch.testing.assert_close(out[:, -1], no_right[:, -1])


@pytest.mark.parametrize("groups", [1, 2], ids=["equal-heads", "grouped"])
def test_history_mixer_equals_its_reference(groups):
    gen = torch.Generator().manual_seed(groups)
    B, T, Hk, K, V = 2, 5, 2, 6, 3
    H = Hk * groups
    q = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, generator=gen), dim=-1).repeat_interleave(groups, 2)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, generator=gen), dim=-1).repeat_interleave(groups, 2)
    v, S = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    s, b, c = torch.rand(H, generator=gen) * 5, torch.randn(H, generator=gen), torch.rand(H, generator=gen) + 0.5
    out = history_mixer(q, k, v, S, s, b, c)
    torch.testing.assert_close(out, history_mixer_reference(q, k, v, S, s, b, c), rtol=1e-5, atol=1e-5)
    # a history slot that takes all the mass reads the clean state; none, a plain softmax over the block
    all_history = history_mixer(q, k, v, S, s, torch.full((H,), 60.0), c)
    torch.testing.assert_close(all_history, torch.einsum("bthk,bhkv->bthv", q, S) * K ** -0.5 * c[:, None])
    no_history = history_mixer(q, k, v, S, s, torch.full((H,), -60.0), c)
    attn = torch.softmax(torch.einsum("bthk,bshk->bhts", q, k) * s[:, None, None], -1)
    torch.testing.assert_close(no_history, torch.einsum("bhts,bshv->bthv", attn, v))


def test_coreset_routing_keeps_each_block_within_its_coreset():
    gen = torch.Generator().manual_seed(3)
    B, T, E, D, k, core = 3, 16, 8, 12, 2, 3
    x, router = torch.randn(B * T, D, generator=gen), torch.randn(E, D, generator=gen)
    probs = torch.softmax(x @ router.T, -1)
    commits = torch.tensor([True, False, False])
    plan = PreviewPlan(split=8, tokens=T, commits=commits, any_commit=True, all_commit=False, coreset_size=core)
    allowed = coreset_allowed(probs.view(B, T, E), plan)
    routing = route(x, router, k, True, allowed.view(B * T, E), probs)
    experts = routing.experts.view(B, T, k)
    for b in range(B):
        for start, end in plan.segments:
            chosen = set(experts[b, start:end].flatten().tolist())
            pooled = probs.view(B, T, E)[b, start:end].mean(0)
            coreset = set(pooled.topk(core).indices.tolist())
            if b == 0 and start == 0:  # a committed block routes freely: the trunk's own top-k
                assert torch.equal(experts[b, start:end], probs.view(B, T, E)[b, start:end].topk(k).indices)
            else:
                assert chosen <= coreset
    assert torch.allclose(routing.weights.float().sum(-1), torch.ones(B * T))
    full = PreviewPlan(split=T, tokens=T, commits=None, any_commit=False, all_commit=False, coreset_size=E)
    unrestricted = route(x, router, k, True, coreset_allowed(probs.view(B, T, E), full).view(B * T, E), probs)
    assert torch.equal(unrestricted.experts, route(x, router, k, True).experts)


def test_coreset_routing_changes_a_clover_models_denoising_only(clover_dir):
    path, _ = clover_dir
    plain = load_model(path)
    core = load_model(path, overrides={"coreset_size": 2})
    ids = torch.randint(0, 290, (1, 2 * BLOCK), generator=torch.Generator().manual_seed(4))
    a, state_a = plain(ids[:, :BLOCK])
    b, state_b = core(ids[:, :BLOCK])
    assert torch.equal(a, b)  # prefill: the trunk
    pa, _ = plain(ids[:, BLOCK:], state_a, preview=True)
    pb, _ = core(ids[:, BLOCK:], state_b, preview=True)
    assert not torch.allclose(pa, pb)


# ---- decode controls ----------------------------------------------------------------------------------------------


def test_threshold_selection_is_low_confidence():
    """LowConfidence (SGLang's reference semantics): positions whose confidence exceeds the threshold; when none
    does, the single most confident masked one (first of equals)."""
    conf = torch.tensor([0.5, 0.9, 0.95, 0.3, 0.9])
    needed = torch.tensor([True, True, True, True, False])
    expected = torch.tensor([False, False, True, False, False])  # 0.9 == threshold does not pass; 4 is not masked
    assert torch.equal(select_positions(conf, needed, 0.9, None), expected)
    assert torch.equal(select_block_positions(conf[None], needed[None], 0.9, None)[0], expected)
    low = torch.tensor([0.2, 0.4, 0.4, 0.1, 0.9])  # nothing passes: the first of the two most confident
    fallback = torch.tensor([False, True, False, False, False])
    assert torch.equal(select_positions(low, needed, 0.9, None), fallback)
    assert torch.equal(select_block_positions(low[None], needed[None], 0.9, None)[0], fallback)


def test_penalties_batched_equal_the_token_list_reference():
    gen = torch.Generator().manual_seed(5)
    options = DecodeOptions(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.4)
    logits = torch.randn(3, 4, 20, generator=gen)
    responses = [[1, 1, 5, 19], [], [7, 7, 7, 2, 0]]
    counts = torch.zeros(3, 20)
    for i, r in enumerate(responses):
        for t in r:
            counts[i, t] += 1
    batched = apply_penalties(logits, counts, options)
    for i, r in enumerate(responses):
        torch.testing.assert_close(batched[i], penalize(logits[i], r, options))
    assert torch.equal(batched[1], logits[1])  # no response yet: nothing changes


def test_penalties_count_the_response_not_the_prompt():
    """A prompt full of the token the model picks first does not penalise it: only the response counts."""
    model = load_model("tiny-ar", seed=4)
    first = generate(model, [[33] * 12], max_new_tokens=1)[0].tokens[0]
    prompt = [first] * 12 + [33, first]
    plain = generate(model, [prompt], max_new_tokens=6)[0].tokens
    heavy = generate(model, [prompt], max_new_tokens=6, presence_penalty=30.0)[0].tokens
    assert heavy[0] == plain[0]
    assert len(set(heavy)) == len(heavy)  # then every repeat is penalised away
    assert heavy == generate_nocache(model, prompt, max_new_tokens=6, presence_penalty=30.0).tokens


def test_decode_modes_are_checked_against_the_model():
    with pytest.raises(ValueError, match="logits_shift false"):
        DecodeOptions(mode="autoregressive").check(load_config("tiny"))
    with pytest.raises(ValueError, match="this model is autoregressive"):
        DecodeOptions(mode="diffusion").check(load_config("tiny-ar"))
    with pytest.raises(ValueError, match="mode must be one of auto, diffusion, autoregressive"):
        DecodeOptions(mode="greedy")
    DecodeOptions(mode="autoregressive").check(load_config("tiny-clover"))
