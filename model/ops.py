"""Numerical kernels, each fast path beside its plain reference. Kernel choice happens here, once.

Shapes: B batch, T tokens, H heads, K key dim, V value dim, C channels, E experts, N routed token-expert pairs.

Notable choices:
- The GDN recurrence keeps its state, decay cumsums and outputs in fp32: exp(g) accumulated over a 128K window
  underflows to garbage in bf16. With bf16 inputs, the chunked form's GEMMs take bf16 operands (the state rounded
  for the product, the triangular system solved in fp32 and its inverse rounded), adding into fp32, as fla's
  Triton kernels do on a GPU; fp32 inputs run it all in fp32 (the reference).
- `gdn_chunked` is the chunked (UT-transform) form of the gated delta rule; `gdn_recurrent` is the token-by-token
  recurrence it must equal (also the decode path for T == 1, where it is cheaper).
- Matmuls with bf16 operands on a CPU without native bf16 units run 50-600x slower than fp32 (measured on the
  AVX2 dev machines), so there `linear` and `grouped_mm` compute in fp32 and round the result to bf16: the same
  values a bf16 GEMM with fp32 accumulation gives, up to summation order.

Why one file of about 680 lines: every fast op sits beside the torch reference it must equal (GDN chunked and
recurrent, its one-token step, attention's masks, grouped GEMMs), so a reader checks an optimisation against its
reference on the same screen; the ops share only torch, and each is a plain function.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import kernels
from .precision import cpu_bf16_units

# ---- matmul policy ------------------------------------------------------------------------------------------


def _cpu_has_native_bf16() -> bool:
    return cpu_bf16_units() is not None


def _upcast(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and not _cpu_has_native_bf16()


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T (no bias)."""
    if _upcast(x):
        return F.linear(x.float(), w.float()).to(x.dtype)
    return F.linear(x, w)


def grouped_mm(x_NK: torch.Tensor, w_EOK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert (offs: int32 end offsets) times each group's w.T: [N, K] x [E, O, K] -> [N, O]."""
    if x_NK.device.type == "cuda" and x_NK.dtype != torch.bfloat16:
        return grouped_mm_reference(x_NK, w_EOK, offs_E)  # CUDA grouped GEMM is bf16-only
    out_dtype = x_NK.dtype
    if _upcast(x_NK):
        x_NK, w_EOK = x_NK.float(), w_EOK.float()
    w_EKO = w_EOK.transpose(1, 2)
    if _GROUPED_MM is None or not (_strides_16b(x_NK) and _strides_16b(w_EKO)):
        # torch's grouped GEMM rejects operands whose strides are not multiples of 16 bytes (e.g. an expert width
        # of 14 in fp32); such small odd shapes take the loop, as does a torch without the grouped GEMM.
        return grouped_mm_reference(x_NK, w_EOK, offs_E).to(out_dtype)
    return _GROUPED_MM(x_NK, w_EKO, offs=offs_E).to(out_dtype)


# public from torch 2.10 (the GPU image may have an older torch, with only the private operator)
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class PaddedGroups:
    """Row groups laid out as a padded batch [E, M, K], so a CPU grouped GEMM is one `bmm`.

    On CPU torch's grouped GEMM runs one small GEMM per expert; when most experts have a few rows each (a
    diffusion block, a decode batch) one padded `bmm` is up to ~1.7x faster (measured, E=32, 4 rows per expert).
    When at most half of the experts have rows (one decoding token) the grouped GEMM is faster: it skips empty
    experts, where the padded batch would multiply them all (gathering just the active experts' weights first was
    measured 6x slower: the copy costs more than the GEMMs). Built once per MoE layer call and shared by its two
    GEMMs; `grouped_mm` stays the path for CUDA, sparse and skewed groups.
    """

    def __init__(self, counts: list[int]) -> None:
        E, P = len(counts), sum(counts)
        self.groups, self.rows = E, max(counts)
        counts_E = torch.tensor(counts)
        group_of_row = torch.repeat_interleave(torch.arange(E), counts_E)
        starts = torch.cumsum(counts_E, 0) - counts_E
        self.flat = group_of_row * self.rows + torch.arange(P) - starts[group_of_row]

    @staticmethod
    def plan(offs_E: torch.Tensor, device: torch.device) -> PaddedGroups | None:
        """A layout when it pays: CPU, at most 64 rows per expert (at prefill sizes, hundreds of rows per expert,
        the grouped GEMM is ~6% faster), more than half of the experts with rows, and padding at most tripling the
        rows (a padded bmm with 3x the rows still beats the grouped GEMM at few rows per expert); else None."""
        if device.type != "cpu" or offs_E.numel() == 0:
            return None
        ends = offs_E.tolist()  # decided in Python: this runs per MoE layer per step, tensors only if it pays
        counts = [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        E, P = len(counts), ends[-1]
        M = max(counts, default=0)
        if P == 0 or M > 64 or 2 * sum(c > 0 for c in counts) <= E or E * M > 3 * P + E:
            return None
        return PaddedGroups(counts)

    def pad(self, x_PK: torch.Tensor) -> torch.Tensor:
        out = x_PK.new_zeros(self.groups * self.rows, x_PK.shape[-1])
        out[self.flat] = x_PK
        return out.view(self.groups, self.rows, -1)

    def unpad(self, y_EMO: torch.Tensor) -> torch.Tensor:
        return y_EMO.reshape(self.groups * self.rows, -1)[self.flat]

    def mm(self, x_EMK: torch.Tensor, w_EOK: torch.Tensor) -> torch.Tensor:
        """Each group's rows times its expert's w.T: [E, M, K] x [E, O, K] -> [E, M, O]."""
        if _upcast(x_EMK):
            return torch.bmm(x_EMK.float(), w_EOK.float().transpose(1, 2)).to(x_EMK.dtype)
        return torch.bmm(x_EMK, w_EOK.transpose(1, 2))


def _strides_16b(t: torch.Tensor) -> bool:
    return all(s == 1 or (s * t.element_size()) % 16 == 0 for s in t.stride())


def grouped_mm_reference(x_NK: torch.Tensor, w_EOK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Plain per-expert loop: the reference for `grouped_mm`."""
    out = x_NK.new_empty(x_NK.shape[0], w_EOK.shape[1])
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            out[start:end] = x_NK[start:end] @ w_EOK[e].T
        start = end
    return out


# ---- norms --------------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm, x_hat * (1 + w), computed in fp32 and cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: plain RMSNorm (weight not zero-centred) in fp32, then * silu(gate)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ---- depthwise causal conv ----------------------------------------------------------------------------------


def causal_conv(x_BTC: torch.Tensor, w_CK: torch.Tensor, tail_BKC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU over [tail, x]; returns (y [B, T, C], new tail [B, K-1, C]).

    K shifted multiply-adds in the channels-last layout the projections produce: 2-3x faster on CPU than conv1d,
    which needs [B, C, T] and copies both ways. fp32 accumulation, as conv1d's bf16 kernels do.
    """
    T, K = x_BTC.shape[1], w_CK.shape[1]
    xx = torch.cat([tail_BKC.to(x_BTC.dtype), x_BTC], dim=1)  # [B, K-1+T, C]
    acc = xx if xx.dtype == torch.float32 else xx.float()
    w = w_CK.float()
    y = acc[:, 0:T] * w[:, 0]
    for j in range(1, K):
        y.addcmul_(acc[:, j:j + T], w[:, j])
    new_tail = xx[:, xx.shape[1] - (K - 1):]
    return F.silu(y).to(x_BTC.dtype), new_tail


def causal_conv_reference(x_BTC: torch.Tensor, w_CK: torch.Tensor,
                          tail_BKC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """conv1d over [B, C, T]: the reference for `causal_conv`."""
    K = w_CK.shape[1]
    xx = torch.cat([tail_BKC.to(x_BTC.dtype), x_BTC], dim=1)  # [B, K-1+T, C]
    y = F.conv1d(xx.transpose(1, 2), w_CK.unsqueeze(1).to(x_BTC.dtype), groups=w_CK.shape[0])  # [B, C, T]
    new_tail = xx[:, xx.shape[1] - (K - 1):]
    return F.silu(y).transpose(1, 2), new_tail


# ---- gated delta rule ---------------------------------------------------------------------------------------


def gdn_recurrent(
    q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, g_BTH: torch.Tensor, beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (the reference). q, k already L2-normalised and repeated to H value heads.

    S_t = a_t S_{t-1} + k_t [beta_t (v_t - (a_t S_{t-1})^T k_t)]^T,  o_t = S_t^T q_t / sqrt(K), a_t = exp(g_t).
    Returns (o [B, T, H, V] fp32, final state [B, H, K, V] fp32).
    """
    scale = q_BTHK.shape[-1] ** -0.5
    q, k, v = (t.float().transpose(1, 2) for t in (q_BTHK, k_BTHK, v_BTHV))  # [B, H, T, *]
    g, beta = g_BTH.float().transpose(1, 2), beta_BTH.float().transpose(1, 2)  # [B, H, T]
    S = state_BHKV.float().clone()
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        S = S * g[:, :, t, None, None].exp()
        kv_mem = (S * k[:, :, t, :, None]).sum(-2)  # [B, H, V]
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (S * (q[:, :, t, :, None] * scale)).sum(-2)
    return out.transpose(1, 2), S


def gdn_step(
    q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, g_BTH: torch.Tensor, beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gdn_recurrent` for one token (T = 1: an autoregressive decode step), as batched matmuls over (B*H): the
    decayed state is the only new [B, H, K, V] tensor, updated in place by the rank-one delta, and it is read
    three times (S^T k, the update, S^T q) instead of the reference's elementwise products and sums."""
    B, _, H, Kd = q_BTHK.shape
    Vd = v_BTHV.shape[-1]
    scale = Kd ** -0.5
    q, k = (t.float().reshape(B * H, 1, Kd) for t in (q_BTHK, k_BTHK))  # [BH, 1, K]
    v = v_BTHV.float().reshape(B * H, 1, Vd)
    a = g_BTH.float().exp().reshape(B * H, 1, 1)
    S = state_BHKV.float().reshape(B * H, Kd, Vd) * a  # a new tensor: the state given is never written
    delta = (v - torch.bmm(k, S)).mul_(beta_BTH.float().reshape(B * H, 1, 1))  # [BH, 1, V]
    S.baddbmm_(k.transpose(1, 2), delta)  # S += k delta^T
    o = torch.bmm(q, S).mul_(scale)  # [BH, 1, V]
    return o.reshape(B, H, 1, Vd).transpose(1, 2), S.reshape(B, H, Kd, Vd)


def _gemm_dtype(v: torch.Tensor) -> torch.dtype:
    """The dtype of the chunked GDN's GEMM operands for values v: bf16 for bf16 values (fla's kernels take q, k, v
    in v's dtype) where bf16 matmuls are fast, fp32 otherwise (the reference; also bf16 on a CPU without bf16 units)."""
    return torch.bfloat16 if v.dtype == torch.bfloat16 and not _upcast(v) else torch.float32


def _chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, ...]:
    """Everything of the chunked gated delta rule that depends on one chunk alone, for a batch of chunks
    q, k [X, H, L, K], v [X, H, L, V] (fp32, or bf16: see gdn_chunked), g, beta [X, H, L] (fp32, zero-padded past a
    sequence's end: g = 0 and beta = 0 leave the state as it is). Returns (U, QK, WQ, k_dec_t, a_chunk) as
    gdn_chunked's docstring names them, in q's dtype (a_chunk fp32)."""
    low = q.dtype  # the GEMM operands' dtype; fp32: every line below is the plain fp32 computation
    L, Vd = q.shape[-2], v.shape[-1]
    q = q * scale
    beta = beta[..., None]
    c = g.cumsum(-1)  # [X, H, L]
    lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    diff = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill_(~lower, -math.inf)  # upper part -> exp() = 0
    M = diff.exp_()  # [X, H, L, L]
    kb = k * beta  # fp32
    A = (kb.to(low) @ k.transpose(-1, -2)).float().mul_(M).tril_(-1)
    A.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    exp_c = c.exp().unsqueeze(-1)  # [X, H, L, 1]
    # [U | Wk] = A^-1 [beta V | beta K exp(c)]
    rhs = torch.cat([v * beta, kb * exp_c], dim=-1)
    if low == torch.float32:  # one triangular solve for both right-hand sides
        UW = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    else:  # fla's way: A^-1 solved in fp32 and rounded, then one bf16 GEMM (1.5x the fp32 solve at prefill sizes)
        eye = torch.eye(L, dtype=torch.float32, device=q.device).expand_as(A)
        UW = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True).to(low) @ rhs.to(low)
    QK = (q @ k.transpose(-1, -2)).float().mul_(M).to(low)  # lower incl. diagonal
    # Wk and Q exp(c) both multiply the chunk's incoming state: stacked, one matmul per chunk serves both
    WQ = torch.cat([UW[..., Vd:], (q * exp_c).to(low)], dim=-2)  # [X, H, 2L, K]
    c_last = c[..., -1:]  # [X, H, 1]
    k_dec_t = (k * (c_last - c).exp().unsqueeze(-1)).to(low).transpose(-1, -2)  # [X, H, K, L]
    a_chunk = c_last.exp().unsqueeze(-1)  # [X, H, 1, 1]
    return UW[..., :Vd], QK, WQ, k_dec_t, a_chunk


def gdn_chunked(
    q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, g_BTH: torch.Tensor, beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor, chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule: same result as `gdn_recurrent`, with matmuls over chunks of `chunk` tokens.

    Inside a chunk (c = cumulative log decay, M_ij = exp(c_i - c_j) for i >= j):
      W = (I + tril(diag(beta) K K^T * M, -1))^-1,  U = W (beta V),  Wk = W (beta K exp(c))
      V' = U - Wk S,  O = (Q exp(c)) S + (tril(Q K^T * M)) V',  S <- exp(c_C) S + (K exp(c_C - c))^T V'
    Outputs and state are fp32. bf16 values (on a device with fast bf16 matmuls) make every product above a bf16
    GEMM adding into fp32, as fla's kernels do; c, M, the solve for W and the state stay fp32 (module docstring).
    """
    B, T, H, Kd = k_BTHK.shape
    Vd = v_BTHV.shape[-1]
    pad = (-T) % chunk
    low = _gemm_dtype(v_BTHV)  # the activations' dtype, as kernels.py gives fla's kernels (q, k come fp32)
    q, k, v = (F.pad(t.to(low), (0, 0, 0, 0, 0, pad)).transpose(1, 2) for t in (q_BTHK, k_BTHK, v_BTHV))
    g, beta = (F.pad(t.float(), (0, 0, 0, pad)).transpose(1, 2) for t in (g_BTH, beta_BTH))  # [B, H, Tp]
    n = (T + pad) // chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [B, H, n*L, *] -> [n*B, H, L, *]: a batch of chunks, n-major
        shape = t.shape[3:]
        t = t.reshape(B, H, n, chunk, *shape)
        return t.permute(2, 0, 1, 3, *range(4, 4 + len(shape))).reshape(n * B, H, chunk, *shape)

    terms = _chunk_terms(chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta), Kd ** -0.5)
    U, QK, WQ, k_dec_t, a_chunk = (t.view(n, B, *t.shape[1:]) for t in terms)  # [n, B, H, ...]: chunk i is [i]

    S = state_BHKV.float().clone()
    # Training (autograd recording) cannot write into a preallocated output (`out=` has no backward): there each
    # chunk's output is its own tensor, stacked at the end; inference keeps the copy-free `out=` form.
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta, S))
    out = None if recording else torch.empty(n, B, H, chunk, Vd, dtype=torch.float32, device=q.device)
    outs = []
    for i in range(n):
        o, S = _chunk_step(U[i], QK[i], WQ[i], k_dec_t[i], a_chunk[i], S, None if out is None else out[i])
        outs.append(o)
    if out is None:
        out = torch.stack(outs, dim=0)
    out = out.permute(1, 2, 0, 3, 4).reshape(B, H, n * chunk, Vd)[:, :, :T]
    return out.transpose(1, 2), S


def _chunk_step(U: torch.Tensor, QK: torch.Tensor, WQ: torch.Tensor, k_dec_t: torch.Tensor, a_chunk: torch.Tensor,
                S: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of a batch of sequences from their fp32 states S [B, H, K, V]: (fp32 output [B, H, L, V], next
    fp32 state). With bf16 terms, every GEMM takes bf16 operands (the state rounded for the product, as fla's
    kernel does) and its result is added to fp32: the state itself and its decay stay fp32."""
    B, H, L, Vd = U.shape
    Kd = S.shape[-2]
    if WQ.dtype == torch.float32:
        WQ_S = WQ @ S  # [B, H, 2L, V]
        v_new = U - WQ_S[..., :L, :]
        o_args = (WQ_S[..., L:, :].reshape(-1, L, Vd), QK.reshape(-1, L, L), v_new.reshape(-1, L, Vd))
        if out is None:
            o = torch.baddbmm(*o_args).view(B, H, L, Vd)
        else:
            o = torch.baddbmm(*o_args, out=out.view(-1, L, Vd)).view(B, H, L, Vd)
        S = torch.baddbmm((S * a_chunk).reshape(-1, Kd, Vd), k_dec_t.reshape(-1, Kd, L),
                          v_new.reshape(-1, L, Vd)).view(B, H, Kd, Vd)
        return o, S
    low = WQ.dtype
    WQ_S = WQ @ S.to(low)  # [B, H, 2L, V]
    v_new = (U.float() - WQ_S[..., :L, :].float()).to(low)
    o = torch.add((QK @ v_new).float(), WQ_S[..., L:, :], out=out)
    S = (S * a_chunk).add_((k_dec_t @ v_new).float())
    return o, S


def gdn_chunked_varlen(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                       beta_TH: torch.Tensor, state_NHKV: torch.Tensor, lengths: list[int],
                       chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`gdn_chunked` over N sequences packed along the token axis (lengths[i] tokens each, in order), each from its
    own state: (o [T, H, V], final states [N, H, K, V]). No padding runs through any recurrence: each sequence's
    last chunk is padded with g = 0, beta = 0 (which leave its state as it is), every chunk's own terms are computed
    in one batch over all sequences' chunks, and the scan over chunks steps all sequences that have one at once."""
    T, H, Kd = k_THK.shape
    Vd = v_THV.shape[-1]
    dev = q_THK.device
    counts = [-(-n // chunk) for n in lengths]
    starts, pos = [], 0
    for n in lengths:
        starts.append(pos)
        pos += n
    # token index of every chunk position; padding points at an appended zero token
    tok = torch.cat([torch.arange(chunk, device=dev)[None, :] + torch.arange(c, device=dev)[:, None] * chunk + s0
                     for s0, c in zip(starts, counts, strict=True)])  # [X, L]
    limit = torch.cat([torch.full((c,), s0 + n, device=dev) for s0, c, n in zip(starts, counts, lengths, strict=True)])
    tok = torch.where(tok < limit[:, None], tok, T)

    def chunks(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [T, H, *] -> [X, H, L, *], zero past the end
        t = torch.cat([t.to(dtype), t.new_zeros(1, *t.shape[1:], dtype=dtype)])
        return t[tok].transpose(1, 2)

    low = _gemm_dtype(v_THV)
    U, QK, WQ, k_dec_t, a_chunk = _chunk_terms(chunks(q_THK, low), chunks(k_THK, low), chunks(v_THV, low),
                                               chunks(g_TH, torch.float32), chunks(beta_TH, torch.float32), Kd ** -0.5)
    first = torch.tensor([sum(counts[:i]) for i in range(len(counts))], device=dev)  # each sequence's first chunk
    S = state_NHKV.float().clone()
    out = torch.empty(U.shape[0], H, chunk, Vd, dtype=torch.float32, device=dev)
    for i in range(max(counts)):
        seqs = [s for s, c in enumerate(counts) if c > i]
        rows = torch.tensor(seqs, device=dev)
        ids = first[rows] + i
        o, S_new = _chunk_step(U[ids], QK[ids], WQ[ids], k_dec_t[ids], a_chunk[ids], S[rows], None)
        out[ids] = o
        S[rows] = S_new
    o_flat = out.transpose(1, 2).reshape(-1, H, Vd)  # [X * L, H, V] in chunk order
    valid = (tok < T).reshape(-1)
    o_tok = torch.empty(T, H, Vd, dtype=torch.float32, device=dev)
    o_tok[tok.reshape(-1)[valid]] = o_flat[valid]
    return o_tok, S


def gated_delta_rule(q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, g_BTH: torch.Tensor,
                     beta_BTH: torch.Tensor, state_BHKV: torch.Tensor,
                     lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over key heads q, k (L2-normalised) and value heads v, from `state` (never written).

    lengths: the input is one row of sequences packed along the token axis, lengths[i] tokens each, each from its
    own state [N, H, K, V] (prefill of several prompts in one forward); the final states are per sequence.
    fla's Triton kernels on CUDA when selected (kernels.py); else ours: the recurrence for one token, chunked
    otherwise, with each key head repeated over its Hv / Hk value heads.
    """
    fla = kernels.fla_for(q_BTHK)
    if fla is not None:
        return fla.gated_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV, lengths=lengths)
    groups = v_BTHV.shape[2] // q_BTHK.shape[2]
    if groups > 1:
        q_BTHK, k_BTHK = q_BTHK.repeat_interleave(groups, dim=2), k_BTHK.repeat_interleave(groups, dim=2)
    T = q_BTHK.shape[1]
    if lengths is not None:
        if len(lengths) == 1:  # one sequence: the plain kernels
            return gated_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV)
        o, state = gdn_chunked_varlen(q_BTHK[0], k_BTHK[0], v_BTHV[0], g_BTH[0], beta_BTH[0], state_BHKV, lengths,
                                      chunk=_chunk_for(max(lengths)))
        return o[None], state
    if T == 1:
        return gdn_step(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV)
    return gdn_chunked(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV, chunk=_chunk_for(T))


def _chunk_for(T: int) -> int:
    # short inputs (a diffusion block) take a chunk of the next power of two >= T, at least 16: a 16-token block
    # padded to a 64-token chunk did 4x the work in every chunk matmul (measured 2x slower training steps)
    return min(64, max(16, 1 << (T - 1).bit_length()))


def short_conv(x_BTC: torch.Tensor, w_CK: torch.Tensor, tail_BKC: torch.Tensor,
               lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU carrying the tail: fla's Triton kernel on CUDA when selected, else ours.
    lengths: sequences packed along the token axis of one row, each with its own tail [N, Kc-1, C]."""
    fla = kernels.fla_for(x_BTC)
    if fla is not None:
        return fla.causal_conv(x_BTC, w_CK, tail_BKC, lengths=lengths)
    if lengths is not None:
        if len(lengths) == 1:
            return causal_conv(x_BTC, w_CK, tail_BKC)
        y, tails = causal_conv_varlen(x_BTC[0], w_CK, tail_BKC, lengths)
        return y[None], tails
    return causal_conv(x_BTC, w_CK, tail_BKC)


def causal_conv_varlen(x_TC: torch.Tensor, w_CK: torch.Tensor, tails_NKC: torch.Tensor,
                       lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv` over sequences packed along the token axis, each after its own tail: one depthwise conv over
    [tail_0 | x_0 | tail_1 | x_1 | ...], whose windows never cross from one sequence into the next; as K shifted
    multiply-adds in the channels-last layout, as `causal_conv` (conv1d's [C, T] layout cost two transposing
    copies of the whole chunk, ~12% of a 2,048-token prefill step of the bench preset)."""
    K = w_CK.shape[1]
    n, dev = len(lengths), x_TC.device
    seq = torch.repeat_interleave(torch.arange(n, device=dev), torch.tensor(lengths, device=dev))
    tok = torch.arange(x_TC.shape[0], device=dev) + (seq + 1) * (K - 1)  # each token's place in the extended axis
    ext_start = torch.tensor([sum(lengths[:i]) + i * (K - 1) for i in range(n)], device=dev)
    tail_at = (ext_start[:, None] + torch.arange(K - 1, device=dev)).reshape(-1)
    ext = x_TC.new_empty(x_TC.shape[0] + n * (K - 1), x_TC.shape[1])
    ext[tail_at] = tails_NKC.to(x_TC.dtype).reshape(-1, x_TC.shape[1])
    ext[tok] = x_TC
    E = ext.shape[0] - (K - 1)  # outputs over the extended axis; a sequence's tokens are at tok - (K - 1)
    acc = ext if ext.dtype == torch.float32 else ext.float()
    w = w_CK.float()
    y = acc[0:E] * w[:, 0]
    for j in range(1, K):
        y.addcmul_(acc[j:j + E], w[:, j])
    ends = ext_start + torch.tensor(lengths, device=dev) + (K - 1)  # one past each sequence's last input
    new_tails = ext[(ends[:, None] - (K - 1) + torch.arange(K - 1, device=dev)).reshape(-1)]
    return F.silu(y[tok - (K - 1)]).to(x_TC.dtype), new_tails.view(n, K - 1, -1)


# ---- attention ----------------------------------------------------------------------------------------------


ATTENTION_Q_TILE = 512  # queries per SDPA call when a long mask has key ranges nobody in the tile sees
FLEX_BLOCK = 128  # flex_attention's query and key block size


@dataclass
class AttentionMask:
    """Which keys each query sees, from positions: key_pos >= 0 (-1: an empty entry), key_pos <= visible_until
    (causal: the query itself; block-causal: the end of its block) and key_pos > q_pos - window.

    all_visible: the caller knows on the host that every key is visible to every query (equal-length rows inside
    the window, a denoising block or one decode token): attention then needs no mask at all.
    The dense mask and flex's block mask are each built at most once per forward, on first use, and
    shared by every attention layer (their keys sit at the same positions).
    """

    key_pos: torch.Tensor  # [B, S]
    q_pos: torch.Tensor  # [B, T]
    visible_until: torch.Tensor  # [B, T]
    window: int
    all_visible: bool = False
    _dense: torch.Tensor | None = None
    _block: Any = None

    def dense(self) -> torch.Tensor:
        """Boolean [B, T, S], True = may attend."""
        if self._dense is None:
            kp = self.key_pos[:, None, :]
            self._dense = ((kp >= 0) & (kp <= self.visible_until[:, :, None])
                           & (kp > self.q_pos[:, :, None] - self.window))
        return self._dense

    def mask_mod(self) -> Callable:
        key_pos, q_pos, visible_until, window = self.key_pos, self.q_pos, self.visible_until, self.window

        def mask_mod(b, h, q_idx, kv_idx):
            kp = key_pos[b, kv_idx]
            return (kp >= 0) & (kp <= visible_until[b, q_idx]) & (kp > q_pos[b, q_idx] - window)

        return mask_mod

    def block_mask(self, block: int = FLEX_BLOCK) -> Any:
        """flex_attention's BlockMask, built from positions with fixed-shape tensor ops (no host sync, no dense
        T x S mask): a key block is kept for a query block when one of its keys falls in the interval the block's
        queries can see, [min(q_pos) - window + 1, max(visible_until)]; `mask_mod` then masks inside kept blocks,
        and key blocks nobody sees are skipped (the window's far past, empty ring entries, other rows' lengths)."""
        if self._block is None:
            from torch.nn.attention.flex_attention import BlockMask

            (B, T), S = self.q_pos.shape, self.key_pos.shape[1]
            nq, nk = -(-T // block), -(-S // block)
            pad_q = nq * block - T  # padded queries repeat the last one: they widen no interval
            lo = F.pad(self.q_pos - self.window + 1, (0, pad_q), mode="replicate").view(B, nq, block).amin(-1)
            hi = F.pad(self.visible_until, (0, pad_q), mode="replicate").view(B, nq, block).amax(-1)
            kp = F.pad(self.key_pos, (0, nk * block - S), value=-1).view(B, 1, nk, block)
            seen = ((kp >= lo[:, :, None, None]) & (kp <= hi[:, :, None, None]) & (kp >= 0)).any(-1)  # [B, nq, nk]
            counts = seen.sum(-1, dtype=torch.int32)
            order = torch.argsort((~seen).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # kept blocks first
            self._block = BlockMask.from_kv_blocks(counts[:, None], order[:, None], BLOCK_SIZE=block,
                                                   mask_mod=self.mask_mod(), seq_lengths=(T, S),
                                                   compute_q_blocks=False)
        return self._block


@dataclass
class PagedMask:
    """Which pool entries each query sees, for attention over the page pool itself (no gather; flex on CUDA):
    entry kv holds position pool_pos[kv] of the sequence whose page it is. A query of row b sees it when it is row
    b's own (row b's table maps that position's logical page to this physical page), written (pos >= 0), not after
    visible_until and inside the window. The block mask visits only the row's pages that cover the positions its
    queries can see, from the page table alone, with fixed-shape tensor ops (no host sync: CUDA graphs replay it)."""

    table: torch.Tensor  # [B, M] physical page of each row's page-table column (-1: none)
    pool_pos: torch.Tensor  # [N] position held by each pool entry (-1: none)
    page_size: int
    q_pos: torch.Tensor  # [B, T]
    visible_until: torch.Tensor  # [B, T]
    window: int
    _block: Any = None

    def mask_mod(self) -> Callable:
        table, pool_pos, ps, q_pos, visible_until, window = (self.table, self.pool_pos, self.page_size, self.q_pos,
                                                             self.visible_until, self.window)
        M = table.shape[1]

        def mask_mod(b, h, q_idx, kv_idx):
            pos = pool_pos[kv_idx]
            own = table[b, (pos.clamp(min=0) // ps) % M] == kv_idx // ps
            return (pos >= 0) & own & (pos <= visible_until[b, q_idx]) & (pos > q_pos[b, q_idx] - window)

        return mask_mod

    def dense(self) -> torch.Tensor:
        """Boolean [B, T, N]: the mask over the whole pool (the reference for tests)."""
        N = self.pool_pos.shape[0]
        kv = torch.arange(N, device=self.pool_pos.device)
        pos = self.pool_pos[None, None, :]
        own = self.table[:, (self.pool_pos.clamp(min=0) // self.page_size) % self.table.shape[1]] \
            == (kv // self.page_size)[None, :]  # [B, N]
        return ((pos >= 0) & own[:, None, :] & (pos <= self.visible_until[:, :, None])
                & (pos > self.q_pos[:, :, None] - self.window))

    def block_mask(self, q_block: int = FLEX_BLOCK) -> Any:
        if self._block is None:
            from torch.nn.attention.flex_attention import BlockMask

            (B, T), M, ps = self.q_pos.shape, self.table.shape[1], self.page_size
            kv_block = min(FLEX_BLOCK, ps)
            if ps % kv_block:
                raise ValueError(f"page_size {ps} must be a multiple of {kv_block} for flex attention over pages")
            per_page = ps // kv_block
            nq = -(-T // q_block)
            pad_q = nq * q_block - T  # padded queries repeat the last one: they widen no interval
            lo = F.pad(self.q_pos - self.window + 1, (0, pad_q), mode="replicate").view(B, nq, q_block).amin(-1)
            hi = F.pad(self.visible_until, (0, pad_q), mode="replicate").view(B, nq, q_block).amax(-1)
            lo_page = lo.clamp(min=0) // ps  # [B, nq]
            cols = torch.arange(M, device=lo.device)
            logical = lo_page[..., None] + (cols - lo_page[..., None]) % M  # the logical page in each column
            physical = self.table[:, None, :].expand(B, nq, M)
            keep = (logical <= (hi // ps)[..., None]) & (physical >= 0)  # [B, nq, M]
            blocks = (physical[..., None] * per_page + torch.arange(per_page, device=lo.device)).flatten(-2)
            keep = keep[..., None].expand(B, nq, M, per_page).flatten(-2)
            order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)
            indices = torch.where(keep, blocks, 0).gather(-1, order).to(torch.int32)
            # as many index columns as the pool has key blocks: flex's CPU kernel sizes its KV loop by them (only
            # the first `counts` are read)
            width = -(-self.pool_pos.shape[0] // kv_block)
            indices = F.pad(indices, (0, max(0, width - indices.shape[-1])))
            counts = keep.sum(-1, dtype=torch.int32)
            # no block is declared full (every visited block runs the mask); the empty full-block tensors are
            # passed all the same: torch 2.13's CPU flex kernel for a one-query decode refers to them
            self._block = BlockMask.from_kv_blocks(counts[:, None], indices[:, None],
                                                   torch.zeros_like(counts[:, None]),
                                                   torch.zeros_like(indices[:, None]),
                                                   BLOCK_SIZE=(q_block, kv_block), mask_mod=self.mask_mod(),
                                                   seq_lengths=(T, self.pool_pos.shape[0]),
                                                   compute_q_blocks=False)
        return self._block


def attention_paged(q_BHTD: torch.Tensor, keys_NHD: torch.Tensor, values_NHD: torch.Tensor,
                    mask: PagedMask) -> torch.Tensor:
    """Softmax attention of each row's queries over the page pool (flex_attention, compiled: only the row's pages
    are visited). Returns [B, H, T, D]."""
    k = keys_NHD.permute(1, 0, 2)[None]  # [1, Hkv, N, D]: one pool, shared by every row (flex broadcasts it)
    v = values_NHD.permute(1, 0, 2)[None]
    return _flex(q_BHTD.is_cuda)(q_BHTD, k, v, block_mask=mask.block_mask(),
                                 enable_gqa=q_BHTD.shape[1] != k.shape[1])


def attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
              mask: AttentionMask | PagedMask) -> torch.Tensor:
    """Softmax attention with grouped KV heads. Returns [B, H, T, D].

    - over the engine's page pool (a PagedMask; k, v: the pool [N, Hkv, D]): flex_attention (`attention_paged`);

    - every key visible (known on the host): one SDPA call without a mask;
    - the flex path (kernels.py: CUDA by default, CLOVER_ATTENTION=flex|dense forces it): flex_attention with the
      block mask (compiled), so skipped key blocks cost nothing and no dense mask is built;
    - otherwise (CPU, the reference; and training, whose backward the block mask does not carry: it is built
      without query blocks): SDPA with the dense boolean mask, in query tiles (`attention_dense`).
    """
    if isinstance(mask, PagedMask):
        return attention_paged(q_BHTD, k_BHSD, v_BHSD, mask)
    if mask.all_visible:
        return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD,
                                              enable_gqa=q_BHTD.shape[1] != k_BHSD.shape[1])
    if kernels.flex_for(q_BHTD) and not (torch.is_grad_enabled() and q_BHTD.requires_grad):
        return _flex(q_BHTD.is_cuda)(q_BHTD, k_BHSD, v_BHSD, block_mask=mask.block_mask(),
                                     enable_gqa=q_BHTD.shape[1] != k_BHSD.shape[1])
    return attention_dense(q_BHTD, k_BHSD, v_BHSD, mask.dense())


@functools.cache
def _flex(cuda: bool) -> Callable:
    """flex_attention compiled: with dynamic shapes on CUDA (one kernel for every length); on a CPU
    (CLOVER_ATTENTION=flex, to test the GPU's mask path) with static shapes, one compile per shape: with symbolic
    lengths torch 2.13's C++ flex template emits code that g++ rejects for our mask_mod (key_pos[b, kv] against
    q_pos[b, q]: undeclared `cur_kvSplitSize<n>`, invalid `cast<int32_t,1>`)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=cuda)


def attention_dense(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, mask_BTS: torch.Tensor, *,
                    q_tile: int = ATTENTION_Q_TILE) -> torch.Tensor:
    """Softmax attention with grouped KV heads and a dense boolean mask (True = may attend). Returns [B, H, T, D].

    SDPA computes every (query, key) score a mask allows or not. For long inputs the queries are cut into tiles of
    `q_tile`, and each tile runs against only the key range [first, last] any of its queries may see: causal and
    block-causal prefill skip about half the scores, a sliding window all but the window. Dropped keys are masked
    for the whole tile, so the result is the same softmax.
    """
    T = q_BHTD.shape[2]
    if T <= q_tile:
        return _sdpa(q_BHTD, k_BHSD, v_BHSD, mask_BTS)
    visible_TS = mask_BTS.any(0)
    out = torch.empty_like(q_BHTD)
    for start in range(0, T, q_tile):
        end = min(start + q_tile, T)
        cols = visible_TS[start:end].any(0).nonzero()
        lo, hi = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, mask_BTS.shape[2])
        out[:, :, start:end] = _sdpa(q_BHTD[:, :, start:end], k_BHSD[:, :, lo:hi], v_BHSD[:, :, lo:hi],
                                     mask_BTS[:, start:end, lo:hi])
    return out


def _sdpa(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, mask_BTS: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=mask_BTS.unsqueeze(1),
                                          enable_gqa=q_BHTD.shape[1] != k_BHSD.shape[1])


def attention_reference(q_BHTD, k_BHSD, v_BHSD, mask_BTS) -> torch.Tensor:
    """Eager softmax attention in fp32: the reference for `attention`."""
    groups = q_BHTD.shape[1] // k_BHSD.shape[1]
    k = k_BHSD.repeat_interleave(groups, dim=1).float()
    v = v_BHSD.repeat_interleave(groups, dim=1).float()
    scores = (q_BHTD.float() @ k.transpose(-1, -2)) * q_BHTD.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask_BTS.unsqueeze(1), -math.inf)
    return (scores.softmax(-1) @ v).to(q_BHTD.dtype)


# ---- rotary embedding ---------------------------------------------------------------------------------------


def rope_cos_sin(positions_BT: torch.Tensor, rope_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin [B, T, R] for frequencies theta^(-i / rope_dim), i = 0, 2, ...; R = 2 * ceil(rope_dim / 2)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions_BT.device)
                                / rope_dim))
    freqs = positions_BT.float().unsqueeze(-1) * inv_freq  # [B, T, R/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_BHTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of each head (rotate-half convention); the rest pass through."""
    R = cos_BTR.shape[-1]
    rot, rest = x_BHTD[..., :R], x_BHTD[..., R:]
    x1, x2 = rot[..., : R // 2], rot[..., R // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos_BTR.unsqueeze(1), sin_BTR.unsqueeze(1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)
