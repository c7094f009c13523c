"""Tolerances of the interpreter tests, and the one comparison they use.

Everything here runs in fp32 (Triton's interpreter computes bf16 on raw bit patterns, see test_fla_kernels.py), and
the interpreter does a `tl.dot` as an exact fp32 numpy matmul (on a GPU fp32 dots default to TF32). So fla and our
kernels differ only by summation order and by the chunked algebra (UT transform, chunk-wise decay) against the
token recurrence: measured max errors are ~1e-7 relative on kernel outputs and states, ~3e-7 on the tiny model's
logits. The bounds leave two orders of magnitude of room for other seeds and BLAS builds, and stay far below what a
wrong convention (a head grouping, a decay in the wrong log base, a shifted conv tail) produces: errors of order 1.
"""

from __future__ import annotations

import torch

KERNEL_RTOL = 1e-5  # fla kernel vs our torch kernel: outputs and final states
LOGITS_RTOL = 2e-3  # the model's logits, fla + flex vs torch + dense (the bound; measured ~3e-7)
MASK_RTOL = 1e-5  # compiled flex_attention with the block mask vs SDPA with the dense mask


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float, what: str) -> float:
    """max |ours - ref| <= rtol * max |ref|, shapes equal and no NaN or inf in either; returns the ratio."""
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    assert bool(torch.isfinite(ours).all()), f"{what}: NaN or inf in ours"
    assert bool(torch.isfinite(ref).all()), f"{what}: NaN or inf in the reference"
    err = float((ours.double() - ref.double()).abs().max())
    scale = float(ref.double().abs().max())
    assert scale > 0, f"{what}: the reference is all zeros"
    assert err <= rtol * scale, f"{what}: max error {err:.3e} > {rtol} * {scale:.3e}"
    return err / scale
