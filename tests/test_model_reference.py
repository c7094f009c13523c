"""Our forward against transformers' Qwen3_5MoeForCausalLM on checkpoints it saved, in every checkpoint layout.

Each REF_SHAPE checkpoint is built once per module (transformers' own save writes experts per expert); the packed
layout is our re-save through `save_checkpoint`. Sequence lengths are deliberately not multiples of the 64-token
GDN chunk.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clover_batch.model import load_model, save_checkpoint
from reference import REF_SHAPES, make_reference
from safetensors import safe_open
from safetensors.torch import save_file

ATOL = 1e-4
SEQ_LENS = (1, 37, 130)  # 130: two full 64-token GDN chunks and a partial one


@pytest.fixture(scope="module", params=sorted(REF_SHAPES), ids=lambda name: name)
def ref(request, tmp_path_factory):
    """(checkpoint dir written by transformers, the reference model, ids [2, 130], its logits)."""
    name = request.param
    out = tmp_path_factory.mktemp(f"ref-{name}")
    model = make_reference(out, seed=7, **REF_SHAPES[name])
    ids = torch.randint(0, model.config.vocab_size, (2, max(SEQ_LENS)), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = {T: model(input_ids=ids[:, :T]).logits for T in SEQ_LENS}
    return out, model, ids, logits


def _max_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape
    assert not torch.isnan(ours).any()
    return float((ours.float() - theirs.float()).abs().max())


def _assert_matches_reference(model_dir: Path, ref) -> None:
    _, _, ids, logits = ref
    ours = load_model(model_dir)
    assert ours.config.diffusion is None  # a reference checkpoint is autoregressive: causal attention
    for T in SEQ_LENS:
        out, _ = ours(ids[:, :T])
        err = _max_err(out, logits[T])
        assert err < ATOL, f"T={T}: max |ours - reference| = {err:.2e}"


def test_reference_own_save_per_expert(ref):
    path = ref[0]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert any(".mlp.experts.0.gate_proj.weight" in k for k in f.keys())  # really the per-expert layout
    _assert_matches_reference(path, ref)


@pytest.mark.parametrize("per_expert", [False, True], ids=["packed", "per_expert"])
def test_resaved_layouts(ref, per_expert, tmp_path):
    save_checkpoint(load_model(ref[0]), tmp_path, per_expert=per_expert)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        packed = any(k.endswith(".mlp.experts.gate_up_proj") for k in f.keys())
    assert packed is not per_expert
    _assert_matches_reference(tmp_path, ref)


def test_sharded_index(ref, tmp_path):
    ref[1].save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _assert_matches_reference(tmp_path, ref)


def test_language_model_prefix_and_ignored_tensors(ref, tmp_path):
    """A multimodal-style checkpoint: `model.language_model.` names plus mtp.* and model.visual.* to ignore."""
    src = ref[0]
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k.replace("model.", "model.language_model.", 1): f.get_tensor(k) for k in f.keys()}
    tensors["mtp.layers.0.mlp.gate.weight"] = torch.ones(3, 3)
    tensors["mtp.fc.weight"] = torch.ones(2)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                                      "text_config": config}))
    _assert_matches_reference(tmp_path, ref)
