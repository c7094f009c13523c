"""Checkpoints written by transformers' Qwen3_5MoeForCausalLM: the reference implementation of our backbone."""

from __future__ import annotations

from pathlib import Path

import torch

REF_SHAPES = {
    # name: overrides of the small base shape below
    "grouped_v_heads": {},
    "odd_sizes": dict(hidden_size=40, num_attention_heads=2, num_key_value_heads=1, head_dim=12,
                      linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=10,
                      linear_value_head_dim=6, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=20,
                      shared_expert_intermediate_size=18, vocab_size=203, num_hidden_layers=5),
    "equal_heads_tied": dict(linear_num_key_heads=4, linear_num_value_heads=4, tie_word_embeddings=True,
                             num_hidden_layers=2, layer_types=["full_attention", "linear_attention"]),
}


def reference_config(**overrides):
    from transformers import Qwen3_5MoeTextConfig

    base = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, rms_norm_eps=1e-6)
    base.update(overrides)
    return Qwen3_5MoeTextConfig(**base)


def make_reference(out: Path, *, seed: int = 0, **overrides):
    """Save a randomly initialised reference model with every parameter perturbed (norms and gates included)."""
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(reference_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif "A_log" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out)
    return model
