"""fla-core's Triton kernels, run by Triton's interpreter on CPU tensors, against our torch kernels.

Each test makes the model's own call (kernels.FlaKernels: fla's conventions, grouped value heads, the state carried
in and out) on the tiny preset's GDN shapes and compares output and final state with ops.py's kernels, and checks
from the interpreter's launches that fla's Triton kernel really ran (not a fallback).
"""

from __future__ import annotations

import pytest
import torch
from clover_batch.model import kernels, ops
from tolerances import KERNEL_RTOL, assert_close

B, Hk, Hv, Dk, Dv, Kc = 2, 2, 4, 16, 16, 4  # the tiny preset's GDN layer: two value heads per key head
BF16_RTOL = 2e-2  # bf16 q, k, v, beta into the kernel (fp32 state and accumulation) against the fp32 reference

BF16_INTERPRETER = (
    "Triton's interpreter cannot compute in bf16: it stores bf16 as uint16 (numpy has no bf16) and its tl.dot and "
    "elementwise ops work on those bit patterns, so fla's chunked kernel (bf16 tl.dot and products in its kkt, "
    "solve_tril and W/U stages) returns values around 1e9 or NaN; the fused recurrent kernel casts its loads to fp32 "
    "first and is right. Triton documents bf16 as unsupported in the interpreter (triton-lang/triton#11584, #4972)")


def _gdn_inputs(T: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = ops.l2norm(torch.randn(B, T, Hk, Dk, generator=gen))
    k = ops.l2norm(torch.randn(B, T, Hk, Dk, generator=gen))
    v = torch.randn(B, T, Hv, Dv, generator=gen).to(dtype)
    g = -torch.rand(B, T, Hv, generator=gen) * 0.5  # log-space decay, fp32
    beta = torch.rand(B, T, Hv, generator=gen).to(dtype)
    state = torch.randn(B, Hv, Dk, Dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize(("T", "dtype"), [
    (8, torch.float32),
    (70, torch.float32),
    (8, torch.bfloat16),
    pytest.param(70, torch.bfloat16, marks=pytest.mark.xfail(strict=True, raises=AssertionError,
                                                             reason=BF16_INTERPRETER)),
], ids=["fused-T8-fp32", "chunk-T70-fp32", "fused-T8-bf16", "chunk-T70-bf16"])
def test_gated_delta_rule_equals_ours(T, dtype, launched):
    """T <= 64 takes fla's fused recurrent kernel (denoising steps, decode), longer inputs the chunked one (prefill;
    70 tokens: a whole chunk and a partial one); both from a random initial state, which must stay untouched."""
    fla = kernels.fla_kernels()
    q, k, v, g, beta, state = _gdn_inputs(T, dtype, seed=T)
    before = state.clone()
    o, final = fla.gated_delta_rule(q, k, v, g, beta, state)
    o_ref, final_ref = ops.gdn_recurrent(q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2),
                                         v.float(), g, beta.float(), state)
    rtol = KERNEL_RTOL if dtype == torch.float32 else BF16_RTOL
    assert_close(o.float(), o_ref, rtol, "output")
    assert_close(final, final_ref, rtol, "final state")
    assert final.dtype == torch.float32 and torch.equal(state, before), "the initial state was written"
    kernel = "fused_recurrent_gated_delta_rule_fwd_kernel" if T <= kernels.FUSED_RECURRENT_MAX_TOKENS \
        else "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
    assert kernel in launched, f"fla's {kernel} did not run: {launched}"


@pytest.mark.parametrize("T", [3, 70], ids=lambda t: f"T{t}")
def test_causal_conv_carries_the_tail_as_ours(T, launched):
    """fla's causal conv (+ SiLU) from our carried tail (the last Kc-1 inputs; fla keeps Kc): fewer new tokens than
    the tail (a new tail partly made of the old one), and more than one of fla's time blocks."""
    fla = kernels.fla_kernels()
    gen = torch.Generator().manual_seed(T)
    C = 2 * Hk * Dk + Hv * Dv
    x = torch.randn(B, T, C, generator=gen)
    w = torch.randn(C, Kc, generator=gen)
    tail = torch.randn(B, Kc - 1, C, generator=gen)
    y, new_tail = fla.causal_conv(x, w, tail)
    y_ref, tail_ref = ops.causal_conv(x, w, tail)
    assert_close(y, y_ref, KERNEL_RTOL, "output")
    assert torch.equal(new_tail, tail_ref), "the new tail is a copy of the last Kc-1 inputs"
    assert any("causal_conv1d" in name for name in launched), f"fla's conv kernel did not run: {launched}"
