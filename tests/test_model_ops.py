"""Every fast kernel against its plain reference, on awkward shapes, comparing outputs and final states.

Tolerances are relative to the reference's magnitude and every comparison first checks for NaN.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from clover_batch.model import moe, ops
from clover_batch.model.moe import LocalDispatcher, Routing, dispatch, experts_reference, route
from clover_batch.model.precision import cpu_bf16_units


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float, what: str = "") -> None:
    """max |ours - ref| <= rtol * max |ref| (and no NaN in either)."""
    assert ours.shape == ref.shape, what
    assert not torch.isnan(ours).any(), f"{what}: NaN in ours"
    assert not torch.isnan(ref).any(), f"{what}: NaN in reference"
    if ref.numel() == 0:
        return
    err = float((ours.double() - ref.double()).abs().max())
    scale = float(ref.double().abs().max())
    assert err <= rtol * scale, f"{what}: max error {err:.3e} > {rtol} * {scale:.3e}"


def gdn_inputs(B: int, T: int, H: int, K: int, V: int, seed: int, state_scale: float):
    gen = torch.Generator().manual_seed(seed)
    q = ops.l2norm(torch.randn(B, T, H, K, generator=gen))
    k = ops.l2norm(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    # decays as the model makes them: g = -exp(A_log) * softplus(a + dt_bias), a mix of fast and slow heads
    g = -torch.rand(H, generator=gen).mul(4).exp() * F.softplus(torch.randn(B, T, H, generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, K, V, generator=gen) * state_scale
    return q, k, v, g, beta, state


GDN_CASES = {
    # id: (B, T, H, K, V, initial state scale)
    "T1": (2, 1, 3, 16, 16, 1.0),
    "T63-odd-dims": (1, 63, 3, 7, 5, 0.5),
    "T64-one-chunk": (2, 64, 2, 16, 8, 0.0),
    "T65-zero-state": (2, 65, 4, 8, 12, 0.0),
    "T131-odd-heads": (2, 131, 5, 9, 11, 1.0),
    "T200-head-dim-64": (1, 200, 2, 64, 64, 0.3),
}


@pytest.mark.parametrize("case", list(GDN_CASES), ids=list(GDN_CASES))
def test_gdn_chunked_equals_recurrence(case):
    B, T, H, K, V, s = GDN_CASES[case]
    q, k, v, g, beta, state = gdn_inputs(B, T, H, K, V, seed=T, state_scale=s)
    state_before = state.clone()
    o_ref, S_ref = ops.gdn_recurrent(q, k, v, g, beta, state)
    o, S = ops.gdn_chunked(q, k, v, g, beta, state)
    assert_close(o, o_ref, 1e-4, "output")
    assert_close(S, S_ref, 1e-4, "final state")
    assert torch.equal(state, state_before)  # the initial state is never written in place
    assert o.dtype == S.dtype == torch.float32


@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (16, 8, 64, 64), (1, 5, 7, 9)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gdn_step_equals_recurrence(shape, dtype):
    """The one-token step (autoregressive decode: batched matmuls) against the reference recurrence, from a
    non-zero state, with bf16 activations as a bf16 model feeds them; the given state is left as it was."""
    B, H, K, V = shape
    q, k, v, g, beta, state = gdn_inputs(B, 1, H, K, V, seed=B * H + K, state_scale=1.0)
    q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))
    state_before = state.clone()
    o_ref, S_ref = ops.gdn_recurrent(q, k, v, g, beta, state)
    o, S = ops.gdn_step(q, k, v, g, beta, state)
    assert o.shape == o_ref.shape and S.shape == S_ref.shape and o.dtype == S.dtype == torch.float32
    assert_close(o, o_ref, 1e-5, "output")
    assert_close(S, S_ref, 1e-5, "final state")
    assert torch.equal(state, state_before)
    o2, S2 = ops.gated_delta_rule(q, k, v, g, beta, state)  # the dispatch takes it for T = 1
    assert torch.equal(o2, o) and torch.equal(S2, S)


@pytest.mark.parametrize("chunk", [16, 32, 64, 128])
def test_gdn_chunk_size_does_not_change_result(chunk):
    q, k, v, g, beta, state = gdn_inputs(2, 150, 3, 16, 16, seed=1, state_scale=1.0)
    o_ref, S_ref = ops.gdn_recurrent(q, k, v, g, beta, state)
    o, S = ops.gdn_chunked(q, k, v, g, beta, state, chunk=chunk)
    assert_close(o, o_ref, 1e-4, "output")
    assert_close(S, S_ref, 1e-4, "final state")


@pytest.mark.parametrize("T", [2, 9, 16, 17, 33, 64, 65])
def test_gdn_dispatch_on_short_inputs_equals_recurrence(T):
    """`ops.gated_delta_rule` picks a smaller chunk for short inputs (a diffusion block): same as the recurrence."""
    q, k, v, g, beta, state = gdn_inputs(2, T, 3, 16, 8, seed=T, state_scale=1.0)
    o_ref, S_ref = ops.gdn_recurrent(q, k, v, g, beta, state)
    o, S = ops.gated_delta_rule(q, k, v, g, beta, state)
    assert_close(o, o_ref, 1e-4, "output")
    assert_close(S, S_ref, 1e-4, "final state")


@pytest.mark.parametrize("T", [16, 70])
def test_gdn_chunked_gradients_equal_recurrence_gradients(T):
    """Training differentiates the chunked kernel: its gradients (inputs and initial state) equal the
    recurrence's, and its output equals the inference (no-grad) path's."""
    inputs = gdn_inputs(2, T, 3, 8, 8, seed=T + 1, state_scale=1.0)
    grads = []
    for kernel in (ops.gdn_recurrent, ops.gdn_chunked):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        o, S = kernel(*leaves)
        ((o * torch.linspace(-1, 1, o.shape[-1])).sum() + S.square().sum()).backward()
        grads.append([t.grad for t in leaves])
    for name, ours, ref in zip("q k v g beta state".split(), grads[1], grads[0], strict=True):
        assert_close(ours, ref, 1e-4, f"d{name}")
    with torch.no_grad():
        o_nograd, _ = ops.gdn_chunked(*inputs)
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    assert_close(ops.gdn_chunked(*leaves)[0].detach(), o_nograd, 1e-6, "grad path vs no-grad path")


U_BF16 = 2.0 ** -8  # bf16's unit roundoff
# With bf16 inputs the chunked kernels' GEMMs take bf16 operands and add into fp32 (fla's mixed precision): an output
# passes through five roundings in sequence (the inverse of the chunk's triangular system, [U | Wk], the state as
# an operand, v' = U - Wk S, and the chunk's products Q S and QK v'), each of relative error at most U, so at most
# about 5U from the fp32 computation on the same inputs (measured: 1-1.6U).
GDN_BF16_BOUND = 5 * U_BF16


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("case", ["decaying", "no decay, 2048 tokens"])
def test_gdn_bf16_inputs_keep_fp32_state_and_stay_within_their_bound_of_fp32(case):
    """bf16 values (q, k in fp32, as the layer gives them): outputs and state come back fp32 and within
    GDN_BF16_BOUND of the fp32 reference on the same (bf16-rounded) inputs, packed or not; with no decay over 32
    chunks the error does not grow with length."""
    T = 2048 if case.startswith("no decay") else 150
    q, k, v, g, beta, state = gdn_inputs(2, T, 2, 32, 32, seed=5, state_scale=1.0)
    if case.startswith("no decay"):
        g = torch.zeros_like(g)
    q16, k16, v16, b16 = (t.bfloat16() for t in (q, k, v, beta))
    o_ref, S_ref = ops.gdn_recurrent(q16, k16, v16, g, b16, state)  # the reference computes in fp32
    # the layer passes q, k in fp32 (L2-normalised there) and v in the activations' dtype
    o, S = ops.gdn_chunked(q16.float(), k16.float(), v16, g, b16, state)
    assert o.dtype == S.dtype == torch.float32
    assert _rel(o, o_ref) < GDN_BF16_BOUND and _rel(S, S_ref) < GDN_BF16_BOUND, (_rel(o, o_ref) / U_BF16,
                                                                               _rel(S, S_ref) / U_BF16)
    assert _rel(o[:, -64:], o_ref[:, -64:]) < GDN_BF16_BOUND  # the last chunk, after all the others
    # both sequences packed along one token axis, each from its own state
    packed = (t.flatten(0, 1) for t in (q16.float(), k16.float(), v16, g, b16))
    o_p, S_p = ops.gdn_chunked_varlen(*packed, state, [T, T])
    assert o_p.dtype == S_p.dtype == torch.float32
    assert _rel(o_p, o_ref.flatten(0, 1)) < GDN_BF16_BOUND and _rel(S_p, S_ref) < GDN_BF16_BOUND
    # and fp32 inputs still take the fp32 path: the reference's values to fp32 rounding
    o32, S32 = ops.gdn_chunked(q16.float(), k16.float(), v16.float(), g, b16.float(), state)
    assert_close(o32, o_ref, 1e-4, "fp32 output")
    assert_close(S32, S_ref, 1e-4, "fp32 final state")
    # bf16 GEMMs only where the CPU has bf16 units (elsewhere they run 50-600x slower than fp32: fp32 there), and
    # there the bf16 values did take them: their result is not the fp32 path's
    assert ops._gemm_dtype(v16) == (torch.bfloat16 if cpu_bf16_units() else torch.float32)
    assert torch.equal(o, o32) == (cpu_bf16_units() is None)


def test_gdn_long_sequence_decay_stays_finite():
    """Strong decays over many chunks: exp of the cumulative log decay must not overflow to inf/NaN."""
    q, k, v, g, beta, state = gdn_inputs(1, 1000, 2, 8, 8, seed=9, state_scale=1.0)
    g = g * 20  # decays around exp(-20) per token
    o_ref, S_ref = ops.gdn_recurrent(q, k, v, g, beta, state)
    o, S = ops.gdn_chunked(q, k, v, g, beta, state)
    assert_close(o, o_ref, 1e-4, "output")
    assert_close(S, S_ref, 1e-4, "final state")


# ---- grouped matmul and MoE dispatch --------------------------------------------------------------------------


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 7, 0], [1, 1, 1, 1], [0, 0, 0, 0]],
                         ids=["mixed", "one-expert", "one-each", "empty"])
@pytest.mark.parametrize("K,N_out", [(24, 10), (14, 20), (13, 7)], ids=["aligned", "K14", "K13-O7"])
def test_grouped_mm_equals_reference(counts, K, N_out):
    gen = torch.Generator().manual_seed(sum(counts))
    x = torch.randn(sum(counts), K, generator=gen)
    w = torch.randn(len(counts), N_out, K, generator=gen)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    assert_close(ops.grouped_mm(x, w, offs), ops.grouped_mm_reference(x, w, offs), 1e-5)
    # and each row by hand
    start = 0
    for e, n in enumerate(counts):
        for r in range(start, start + n):
            torch.testing.assert_close(ops.grouped_mm(x, w, offs)[r], w[e] @ x[r], rtol=1e-5, atol=1e-5)
        start += n


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [1, 1, 1, 1], [2, 3, 1, 2, 2, 3, 1, 2], [0, 4, 1, 2, 2, 0, 1, 2]],
                         ids=["mixed", "one-each", "dense", "dense-with-empty"])
def test_padded_groups_mlp_equals_grouped_mm(counts):
    """The CPU padded-bmm layout equals the grouped GEMM path and the per-expert reference."""
    gen = torch.Generator().manual_seed(len(counts) + sum(counts))
    E, D, W = len(counts), 24, 10
    x = torch.randn(sum(counts), D, generator=gen)
    gate_up, down = torch.randn(E, 2 * W, D, generator=gen), torch.randn(E, D, W, generator=gen)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    layout = ops.PaddedGroups.plan(offs, x.device)
    assert layout is not None
    gate, up = ops.grouped_mm(x, gate_up, offs).chunk(2, dim=-1)
    expected = ops.grouped_mm(F.silu(gate) * up, down, offs)
    assert_close(moe.expert_mlp(x, gate_up, down, offs), expected, 1e-5)
    assert_close(layout.unpad(layout.mm(layout.pad(x), gate_up)), ops.grouped_mm_reference(x, gate_up, offs), 1e-5)


@pytest.mark.parametrize("counts", [[40, 1, 1, 1, 1, 1, 1, 1], [0, 2, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0]],
                         ids=["skewed", "sparse", "empty"])
def test_padded_groups_declines_where_the_grouped_gemm_wins(counts):
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    assert ops.PaddedGroups.plan(offs, torch.device("cpu")) is None
    assert ops.PaddedGroups.plan(torch.tensor([2, 4], dtype=torch.int32), torch.device("meta")) is None


def test_dispatch_sorts_pairs_by_expert():
    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])
    d = dispatch(experts, num_experts=4)
    assert d.order.tolist() == [1, 4, 0, 2, 5, 3]  # pairs (token*k + slot) of experts 0, 0, 2, 2, 2, 3
    assert d.offsets.tolist() == [2, 2, 5, 6]
    everything = dispatch(experts, num_experts=4, all_local=True)  # no range filter
    assert torch.equal(everything.order, d.order) and torch.equal(everything.offsets, d.offsets)
    local = dispatch(experts, num_experts=2, first_expert=2)  # a rank holding experts 2 and 3
    assert local.order.tolist() == [0, 2, 5, 3]
    assert local.offsets.tolist() == [3, 4]


class _Experts:
    def __init__(self, gate_up, down, holds_all=True):
        self.gate_up_proj, self.down_proj = gate_up, down
        self.first_expert, self.num_local, self.holds_all = 0, gate_up.shape[0], holds_all


@pytest.mark.parametrize("N,E,k", [(1, 4, 1), (37, 8, 2), (100, 5, 3), (64, 32, 4)], ids=lambda v: str(v))
def test_moe_dispatch_equals_expert_loop(N, E, k):
    gen = torch.Generator().manual_seed(N + E)
    D, Iw = 20, 14
    x = torch.randn(N, D, generator=gen)
    router = torch.randn(E, D, generator=gen)
    gate_up, down = torch.randn(E, 2 * Iw, D, generator=gen) * 0.2, torch.randn(E, D, Iw, generator=gen) * 0.2
    routing = route(x, router, k, normalize=True)
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(N))
    ours = LocalDispatcher()(x, routing, _Experts(gate_up, down))
    assert_close(ours, experts_reference(x, routing, gate_up, down), 1e-5)
    filtered = LocalDispatcher()(x, routing, _Experts(gate_up, down, holds_all=False))  # the range-checking path
    assert torch.equal(filtered, ours)


def test_moe_dispatch_bf16_close_to_fp32():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 32, generator=gen)
    gate_up, down = torch.randn(6, 40, 32, generator=gen) * 0.2, torch.randn(6, 32, 20, generator=gen) * 0.2
    routing = Routing(torch.rand(50, 2, generator=gen), torch.randint(0, 6, (50, 2), generator=gen))
    ref = experts_reference(x, routing, gate_up, down)
    r16 = Routing(routing.weights.bfloat16(), routing.experts)
    ours = LocalDispatcher()(x.bfloat16(), r16, _Experts(gate_up.bfloat16(), down.bfloat16()))
    assert ours.dtype == torch.bfloat16
    assert_close(ours.float(), ref, 2e-2)


# ---- attention, norms, conv -------------------------------------------------------------------------------------


@pytest.mark.parametrize("H,Hkv,T,S", [(4, 2, 5, 9), (3, 1, 1, 40), (2, 2, 33, 33)], ids=lambda v: str(v))
def test_attention_equals_reference(H, Hkv, T, S):
    gen = torch.Generator().manual_seed(T * S)
    q = torch.randn(2, H, T, 12, generator=gen)
    k, v = torch.randn(2, Hkv, S, 12, generator=gen), torch.randn(2, Hkv, S, 12, generator=gen)
    mask = torch.rand(2, T, S, generator=gen) > 0.4
    mask[..., -1] = True  # every query sees at least one key
    assert_close(ops.attention_dense(q, k, v, mask), ops.attention_reference(q, k, v, mask), 1e-5)


def _mask(kind: str, T: int, cached: int, B: int = 2) -> torch.Tensor:
    """[B, T, cached + T] masks as the model builds them, for queries at positions cached..cached+T-1."""
    q_pos = torch.arange(cached, cached + T)[:, None]
    k_pos = torch.arange(cached + T)[None, :]
    if kind == "causal":
        mask = k_pos <= q_pos
    elif kind == "block-causal-8":
        mask = k_pos <= (q_pos // 8 + 1) * 8 - 1
    else:  # "window-20"
        mask = (k_pos <= q_pos) & (k_pos > q_pos - 20)
    mask = mask.expand(B, T, cached + T).clone()
    mask[1, :, :min(3, cached)] = False  # the second sequence is shorter: empty leading cache slots
    return mask


@pytest.mark.parametrize("kind", ["causal", "block-causal-8", "window-20"])
@pytest.mark.parametrize("T,cached,q_tile", [(100, 0, 16), (77, 30, 32), (40, 5, 64)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiled_attention_equals_reference(kind, T, cached, q_tile, dtype):
    gen = torch.Generator().manual_seed(T)
    S = cached + T
    q = torch.randn(2, 4, T, 16, generator=gen).to(dtype)
    k, v = torch.randn(2, 2, S, 16, generator=gen).to(dtype), torch.randn(2, 2, S, 16, generator=gen).to(dtype)
    mask = _mask(kind, T, cached)
    ours = ops.attention_dense(q, k, v, mask, q_tile=q_tile)
    assert ours.dtype == dtype
    assert_close(ours.float(), ops.attention_reference(q, k, v, mask).float(), 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("T,C,K", [(1, 6, 4), (30, 7, 4), (65, 16, 2), (9, 5, 5)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_causal_conv_equals_reference(T, C, K, dtype):
    gen = torch.Generator().manual_seed(T * C)
    x = torch.randn(2, T, C, generator=gen).to(dtype)
    w = torch.randn(C, K, generator=gen).to(dtype)
    tail = torch.randn(2, K - 1, C, generator=gen).to(dtype)
    y, new_tail = ops.causal_conv(x, w, tail)
    y_ref, tail_ref = ops.causal_conv_reference(x, w, tail)
    assert y.dtype == dtype
    assert_close(y.float(), y_ref.float(), 1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(new_tail, tail_ref)


def test_causal_conv_with_tail_equals_whole_sequence():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 30, 7, generator=gen)
    w = torch.randn(7, 4, generator=gen)
    whole, tail_whole = ops.causal_conv(x, w, torch.zeros(2, 3, 7))
    a, tail = ops.causal_conv(x[:, :11], w, torch.zeros(2, 3, 7))
    b, tail = ops.causal_conv(x[:, 11:12], w, tail)
    c, tail = ops.causal_conv(x[:, 12:], w, tail)
    torch.testing.assert_close(torch.cat([a, b, c], dim=1), whole)
    assert torch.equal(tail, tail_whole)
    assert torch.equal(tail, x[:, -3:])
    # position 5, channel 2 by hand: silu(sum_j w[2, j] * x[5 - 3 + j, 2])
    by_hand = F.silu((w[2] * x[0, 2:6, 2]).sum())
    torch.testing.assert_close(whole[0, 5, 2], by_hand)


def test_rms_norm_is_zero_centred():
    x = torch.tensor([[3.0, 4.0]])
    rms = (12.5 + 1e-6) ** 0.5
    torch.testing.assert_close(ops.rms_norm(x, torch.zeros(2), 1e-6), x / rms)
    torch.testing.assert_close(ops.rms_norm(x, torch.tensor([1.0, -1.0]), 1e-6), torch.tensor([[6.0, 0.0]]) / rms)


MASK_CASES = {
    # name: (key positions per row [B, S] with -1 empty, query start per row, T, attention, window)
    "causal-prefix": ([list(range(40)), list(range(25)) + [-1] * 15], [32, 17], 8, "causal", 1000),
    "block-causal": ([list(range(48)), list(range(48))], [40, 40], 8, "block_causal", 1000),
    "window": ([list(range(64)), list(range(64))], [56, 50], 8, "causal", 20),
    "ring-wrapped": ([list(range(40, 64)) + list(range(24, 40)), list(range(40))], [56, 32], 8, "causal", 24),
}


def _attention_mask(case: str) -> ops.AttentionMask:
    key_pos, starts, T, attention, window = MASK_CASES[case]
    q_pos = torch.tensor(starts)[:, None] + torch.arange(T)
    visible = q_pos if attention == "causal" else (q_pos // 8 + 1) * 8 - 1
    return ops.AttentionMask(torch.tensor(key_pos), q_pos, visible, window)


@pytest.mark.parametrize("case", MASK_CASES)
def test_flex_block_mask_attention_equals_the_dense_reference(case):
    """The CUDA path (flex_attention with the block mask built from positions) against the dense reference; on
    CPU flex runs unfused, which checks the mask it is given."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = _attention_mask(case)
    B, T = mask.q_pos.shape
    S = mask.key_pos.shape[1]
    gen = torch.Generator().manual_seed(S)
    q = torch.randn(B, 4, T, 16, generator=gen)
    k, v = torch.randn(B, 2, S, 16, generator=gen), torch.randn(B, 2, S, 16, generator=gen)
    ref = ops.attention_reference(q, k, v, mask.dense())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex without torch.compile warns that it is unfused
        flex = flex_attention(q, k, v, block_mask=mask.block_mask(), enable_gqa=True)
    assert_close(flex, ref, 1e-5)
    assert_close(ops.attention(q, k, v, mask), ref, 1e-5)  # the CPU dispatch: dense
    assert mask.block_mask() is mask.block_mask()  # built once, shared by the layers
    # small blocks: several query and key blocks, some skipped entirely
    small = _attention_mask(case).block_mask(block=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_close(flex_attention(q, k, v, block_mask=small, enable_gqa=True), ref, 1e-5)
    if case != "block-causal":  # there every query sees every key
        kept = small.kv_num_blocks.sum().item()
        assert kept < B * -(-T // 4) * -(-S // 4), "no key block was skipped"


def test_mask_free_attention_is_claimed_only_when_every_key_is_visible():
    """SlotRows.all_visible decides on the host that a forward needs no mask; wherever it says so, the dense mask
    built from the positions each row really reads (its gathered live keys) is all True."""
    from clover_batch.model import load_config
    from clover_batch.model.slots import SlotState

    cfg = load_config("tiny")
    claimed = 0
    for lengths, T, attention, window in [([16, 16], 8, "block_causal", 64), ([16, 16], 1, "causal", 64),
                                          ([16, 24], 8, "block_causal", 64), ([16, 16], 8, "causal", 64),
                                          ([60, 60], 8, "block_causal", 64), ([12, 12], 8, "block_causal", 64),
                                          ([0], 16, "block_causal", 64)]:
        state = SlotState(cfg, 2, window=window, max_forward_tokens=16, num_pages=24, page_size=8)
        for slot, n in enumerate(lengths):
            state.grow(slot, n + T)
            state.positions[slot] = n
        rows = state.rows(0, lengths, T, None)
        q_pos = rows.query_positions()
        _, _, key_pos = rows.index()
        visible = q_pos if attention == "causal" else (q_pos // 8 + 1) * 8 - 1
        mask = ops.AttentionMask(key_pos, q_pos, visible, window)
        if rows.all_visible(attention, 8):
            claimed += 1
            assert bool(mask.dense().all()), (lengths, T, attention)
    assert claimed == 2  # the aligned denoising block and the single decode token of equal rows
