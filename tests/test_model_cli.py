"""`clover-batch model init` and `model inspect` through typer's CliRunner."""

from __future__ import annotations

import json

import pytest
import torch
from clover_batch.jobs.cli import app
from clover_batch.model import load_model
from safetensors import safe_open
from tokenizers import Tokenizer
from typer.testing import CliRunner

runner = CliRunner()


def invoke(*args: str):
    # a wide terminal: `model inspect`'s table (value and where it came from) would wrap its cells at 80 columns
    return runner.invoke(app, list(args), env={"COLUMNS": "250"})


@pytest.mark.parametrize("dtype,per_expert", [("float32", False), ("bfloat16", True)],
                         ids=["fp32-packed", "bf16-per-expert"])
def test_init_writes_a_checkpoint_that_loads_bit_exactly(tmp_path, dtype, per_expert):
    out = tmp_path / "ckpt"
    args = ["model", "init", "--preset", "tiny", "--out", str(out), "--seed", "4", "--dtype", dtype]
    result = invoke(*args, *(["--per-expert"] if per_expert else []))
    assert result.exit_code == 0, result.output
    assert f"wrote tiny ({dtype}, seed 4)" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]

    torch_dtype = getattr(torch, dtype)
    preset = load_model("tiny", seed=4, dtype=torch_dtype)
    loaded = load_model(out, dtype=torch_dtype)
    assert loaded.config == preset.config.replace(name=str(out))
    for (name, p), (name2, q) in zip(preset.named_parameters(), loaded.named_parameters(), strict=True):
        assert name == name2
        assert q.dtype == torch_dtype
        assert torch.equal(p, q), name
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert f.get_tensor(keys[0]).dtype == torch_dtype
    assert any(".experts.3.down_proj.weight" in k for k in keys) is per_expert

    config = json.loads((out / "config.json").read_text())
    assert config["diffusion"]["mask_token_id"] == 259
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.token_to_id("<|mask|>") == config["diffusion"]["mask_token_id"]
    assert tok.token_to_id("<|endoftext|>") == config["pad_token_id"]
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")] == config["eos_token_id"]
    assert tok.token_to_id("<|im_start|>") == 257
    assert tok.encode("Hi!").ids == [72, 105, 33]  # bytes


def test_init_seed_changes_weights(tmp_path):
    for seed in (1, 2):
        assert invoke("model", "init", "--preset", "tiny-ar", "--out", str(tmp_path / str(seed)),
                      "--seed", str(seed)).exit_code == 0
    a, b = load_model(tmp_path / "1"), load_model(tmp_path / "2")
    assert not torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)
    assert a.config.diffusion is None


def test_init_refuses_to_overwrite(tmp_path):
    assert invoke("model", "init", "--preset", "tiny", "--out", str(tmp_path)).exit_code == 0
    result = invoke("model", "init", "--preset", "tiny", "--out", str(tmp_path), "--seed", "1")
    assert result.exit_code == 2
    assert "already holds a checkpoint" in result.output and "--overwrite" in result.output
    assert "Traceback" not in result.output
    assert torch.equal(load_model(tmp_path).embed_tokens.weight, load_model("tiny", seed=0).embed_tokens.weight)
    result = invoke("model", "init", "--preset", "tiny", "--out", str(tmp_path), "--seed", "1", "--overwrite")
    assert result.exit_code == 0
    assert torch.equal(load_model(tmp_path).embed_tokens.weight, load_model("tiny", seed=1).embed_tokens.weight)


@pytest.mark.parametrize("args,message", [
    (["--preset", "huge"], "unknown preset 'huge'; presets are"),
    (["--preset", "clover-35b-a3b"], "random weights are only made for small presets"),
    (["--preset", "tiny", "--dtype", "float16"], "'float16' is not one of"),
], ids=["unknown-preset", "too-big", "bad-dtype"])
def test_init_errors_are_clean(tmp_path, args, message):
    result = invoke("model", "init", "--out", str(tmp_path / "x"), *args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert not (tmp_path / "x" / "model.safetensors").exists()


def test_inspect_published_preset():
    result = invoke("model", "inspect", "clover-35b-a3b")
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "diffusion (block size 32, mask token 248077" in out
    # the Qwen3.6-35B-A3B trunk plus Clover's block-diffusion GDN tensors: 30 x (8192 x 3 + 3 x 32) = 740,160
    assert "34.66B (34,661,350,848)" in out  # total
    assert "3.46B (3,455,729,088)" in out  # active per token: 8 of 256 experts
    assert "40: 30 Gated DeltaNet, 10 full attention" in out
    assert "256 routed, top 8, width 512" in out
    assert "verified (the trunk's autoregressive output token for token, greedy only" in out


def test_inspect_says_which_decode_modes_a_model_allows():
    out = " ".join(invoke("model", "inspect", "tiny").output.split())
    assert "diffusion only: the causal logits do not score the next token (logits_shift false)" in out
    out = " ".join(invoke("model", "inspect", "tiny-ar").output.split())
    assert "autoregressive only (one token per forward)" in out


def test_inspect_checkpoint_dir_matches_its_weights(tmp_path):
    assert invoke("model", "init", "--preset", "tiny-ar", "--out", str(tmp_path)).exit_code == 0
    result = invoke("model", "inspect", str(tmp_path))
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "autoregressive" in out and "diffusion" not in out
    total = sum(p.numel() for p in load_model(tmp_path).parameters())
    assert f"({total:,})" in out
    # active: everything but the 6 routed experts per layer not picked (8 experts, top 2, 3 * 64 * 32 each)
    assert f"({total - 4 * 6 * 3 * 64 * 32:,})" in out


@pytest.mark.parametrize("source,message", [
    ("no-such-thing", "is neither a preset nor a checkpoint directory"),
    ("{tmp}", "no config.json in the checkpoint directory"),
], ids=["unknown", "empty-dir"])
def test_inspect_errors_are_clean(tmp_path, source, message):
    result = invoke("model", "inspect", source.format(tmp=tmp_path))
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_generate_prints_the_engines_text_and_counts(tmp_path):
    from clover_batch.model import generate
    from clover_batch.pipeline.tokenizer import PromptBuilder

    out = tmp_path / "ckpt"
    assert invoke("model", "init", "--preset", "tiny", "--out", str(out), "--seed", "2").exit_code == 0
    result = invoke("generate", "--model", str(out), "--prompt", "Say <|im_end|> hello", "--max-new-tokens", "24",
                    "--tokens-per-step", "2")
    assert result.exit_code == 0, result.output

    builder = PromptBuilder(str(out))
    ids = builder.chat("Say <|im_end|> hello")
    # the user's text stays text: its "<|im_end|>" is bytes, the template's turn markers are special ids
    assert ids.count(258) == 1 and ids.count(257) == 2
    expected = generate(load_model(out), [ids], max_new_tokens=24, tokens_per_step=2)[0]
    assert result.stdout.startswith(builder.decode(expected.tokens))
    assert (f"prompt {len(ids)} tokens (1 window(s)), generated {len(expected.tokens)} tokens "
            f"(stopped: {expected.stopped}) in {expected.denoising_steps} denoising steps, "
            f"{expected.forward_passes} forward passes") in result.output


@pytest.mark.parametrize("args,message", [
    (["--model", "tiny", "--prompt", "hi", "--threshold", "1.5"], "threshold must be <= 1, got 1.5"),
    (["--model", "tiny", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--model", "tiny-ar", "--prompt", "hi", "--tokens-per-step", "4"], "this model is autoregressive"),
    (["--model", "no-such-dir", "--prompt", "hi"], "no-such-dir"),
    (["--model", "tiny", "--prompt", ""], "--prompt is empty"),
])
def test_generate_bad_options_are_one_line_errors(args, message):
    result = invoke("generate", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
