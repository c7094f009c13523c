"""Checkpoint loading: bit-exact round trips, and bad checkpoints failing with errors that name the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clover_batch.model import CheckpointError, ConfigError, load_model, save_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-ar", seed=3)


@pytest.fixture(scope="module")
def good_dir(tiny, tmp_path_factory) -> Path:
    return save_checkpoint(tiny, tmp_path_factory.mktemp("good"))


def _copy_with(src: Path, dst: Path, edit) -> Path:
    """dst gets src's config.json and its tensors after `edit(dict)`."""
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def _edit_config(src: Path, dst: Path, edit) -> Path:
    _copy_with(src, dst, lambda t: None)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("per_expert", [False, True], ids=["packed", "per_expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_is_bit_exact(per_expert, dtype, tmp_path):
    model = load_model("tiny", seed=11, dtype=dtype)
    save_checkpoint(model, tmp_path, per_expert=per_expert)
    back = load_model(tmp_path, dtype=dtype)
    assert back.config == model.config.replace(name=str(tmp_path))
    ours, theirs = dict(model.named_parameters()), dict(back.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert theirs[name].dtype == dtype
        assert torch.equal(p, theirs[name]), name
    ids = torch.arange(40).reshape(2, 20)
    assert torch.equal(model(ids)[0], back(ids)[0])


def test_missing_tensor(good_dir, tmp_path):
    _copy_with(good_dir, tmp_path, lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing layers\.1\.linear_attn\.A_log"):
        load_model(tmp_path)


def test_missing_expert_of_per_expert_layout(tiny, tmp_path):
    save_checkpoint(tiny, tmp_path, per_expert=True)
    _copy_with(tmp_path, tmp_path, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(tmp_path)


def test_wrong_shape(good_dir, tmp_path):
    def edit(t):
        t["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(31, 64)

    _copy_with(good_dir, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.k_proj\.weight: shape \[31, 64\], "
                                              r"expected \[32, 64\]"):
        load_model(tmp_path)


def test_wrong_shape_of_packed_experts(good_dir, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.experts.down_proj"] = torch.zeros(8, 64, 31)

    _copy_with(good_dir, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"experts\.down_proj: shape \[8, 64, 31\]"):
        load_model(tmp_path)


def test_unexpected_tensor(good_dir, tmp_path):
    def edit(t):
        t["model.layers.0.linear_attn.surprise.weight"] = torch.zeros(2)

    _copy_with(good_dir, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"unexpected layers\.0\.linear_attn\.surprise\.weight"):
        load_model(tmp_path)


def test_all_problems_reported_together(good_dir, tmp_path):
    def edit(t):
        t.pop("model.norm.weight")
        t["model.embed_tokens.weight"] = torch.zeros(3, 3)

    _copy_with(good_dir, tmp_path, edit)
    with pytest.raises(CheckpointError) as info:
        load_model(tmp_path)
    assert "missing norm.weight" in str(info.value)
    assert "model.embed_tokens.weight: shape [3, 3], expected [512, 64]" in str(info.value)


def test_unknown_layer_type(good_dir, tmp_path):
    def edit(c):
        c["layer_types"][2] = "sliding_attention"

    _edit_config(good_dir, tmp_path, edit)
    with pytest.raises(ConfigError, match=r"layer_types\[2\] is 'sliding_attention'"):
        load_model(tmp_path)


@pytest.mark.parametrize("field", ["hidden_size", "num_experts", "linear_value_head_dim"])
def test_missing_config_field(good_dir, tmp_path, field):
    _edit_config(good_dir, tmp_path, lambda c: c.pop(field))
    with pytest.raises(ConfigError, match=rf"config\.json: missing required field '{field}'"):
        load_model(tmp_path)


def test_no_config_json(good_dir, tmp_path):
    _copy_with(good_dir, tmp_path, lambda t: None)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_model(tmp_path)


def test_not_a_safetensors_checkpoint(good_dir, tmp_path):
    (tmp_path / "config.json").write_text((good_dir / "config.json").read_text())
    torch.save({"model.norm.weight": torch.zeros(64)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files \(only safetensors checkpoints are read\)"):
        load_model(tmp_path)


def test_index_naming_a_missing_shard(good_dir, tmp_path):
    _copy_with(good_dir, tmp_path, lambda t: None)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"shard files that do not exist: .*model-00002-of-00002"):
        load_model(tmp_path)


def test_unknown_source():
    with pytest.raises(ConfigError, match=r"'no-such-model' is neither a preset nor a checkpoint directory"):
        load_model("no-such-model")


def test_more_experts_than_the_config_is_an_error(tiny, tmp_path):
    packed = tmp_path / "packed"
    packed.mkdir()
    key = "model.layers.0.mlp.experts.gate_up_proj"
    _copy_with(save_checkpoint(tiny, tmp_path / "src"), packed, lambda t: t.update({key: torch.cat([t[key], t[key]])}))
    with pytest.raises(CheckpointError, match=rf"{key}: shape \[16, 64, 64\], expected \[8, 64, 64\]"):
        load_model(packed)

    per = save_checkpoint(tiny, tmp_path / "per", per_expert=True)
    extra = "model.layers.2.mlp.experts.11.down_proj.weight"
    _copy_with(per, per, lambda t: t.update({extra: t["model.layers.2.mlp.experts.3.down_proj.weight"].clone()}))
    with pytest.raises(CheckpointError, match=rf"unexpected {extra}: expert index beyond .*num_experts=8"):
        load_model(per)


def test_unreadable_shard_and_bad_index_and_duplicates(good_dir, tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((good_dir / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        load_model(corrupt)

    bad_index = _copy_with(good_dir, tmp_path, lambda t: None)
    (bad_index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": []}))
    with pytest.raises(CheckpointError, match="weight_map must map tensor names to shard file names"):
        load_model(bad_index)

    twice = tmp_path / "twice"
    twice.mkdir()
    _copy_with(good_dir, twice, lambda t: None)
    save_file({"model.norm.weight": torch.zeros(64)}, str(twice / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"norm.weight: given more than once \(extra.safetensors"):
        load_model(twice)


def _tiny_json() -> dict:
    from clover_batch.model import load_config

    return load_config("tiny").to_json_dict()


BAD_CONFIGS = {
    "block-size-string": (lambda c: c["diffusion"].update(block_size="8"), r"'diffusion.block_size' must be a int"),
    "block-size-float": (lambda c: c["diffusion"].update(block_size=8.0), r"'diffusion.block_size' must be a int"),
    "logits-shift-string": (lambda c: c["diffusion"].update(logits_shift="false"),
                            r"'diffusion.logits_shift' must be a bool"),
    "mask-outside-vocab": (lambda c: c["diffusion"].update(mask_token_id=512), r"mask_token_id 512 is outside"),
    "bad-prompt-attention": (lambda c: c["diffusion"].update(prompt_attention="full"), "prompt_attention must be"),
    "interval-zero": (lambda c: (c.pop("layer_types"), c.update(full_attention_interval=0)),
                      r"'full_attention_interval' must be >= 1"),
    "rope-not-object": (lambda c: c.update(rope_parameters=[1]), "rope_parameters must be an object"),
    "rope-theta-string": (lambda c: c["rope_parameters"].update(rope_theta="x"), "malformed config"),
    "eos-string": (lambda c: c.update(eos_token_id=["a"]), r"'eos_token_id' must be a int"),
    "eos-outside-vocab": (lambda c: c.update(eos_token_id=[600]), "eos_token_id 600 is outside"),
    "window-string": (lambda c: c["clover"].update(window_tokens="big"), r"'clover.window_tokens' must be a int"),
    "layers-mismatch": (lambda c: c.update(num_hidden_layers=5), r"num_hidden_layers \(5\) != len\(layer_types\)"),
    "unknown-clover-key": (lambda c: c["clover"].update(windw=3), "unknown field"),
}


@pytest.mark.parametrize(("edit", "match"), BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_malformed_config_fields_are_config_errors(edit, match):
    from clover_batch.model import CloverConfig

    raw = _tiny_json()
    edit(raw)
    with pytest.raises(ConfigError, match=match):
        CloverConfig.from_json_dict(raw)


def test_config_defaults_follow_the_reference():
    from clover_batch.model import CloverConfig

    raw = _tiny_json()
    del raw["head_dim"]
    raw["rope_theta"] = raw["rope_parameters"].pop("rope_theta")  # flat rope_theta, as older configs write it
    raw.pop("layer_types")
    raw["full_attention_interval"] = 2
    cfg = CloverConfig.from_json_dict(raw)
    assert cfg.head_dim == 256 and cfg.rope_theta == 1e7
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
