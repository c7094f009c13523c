"""Clover's preview (denoising) operator, piece by piece, each beside its plain reference.

A preview pass runs the block being denoised against the committed state and writes nothing; commits and prompt
prefill are the ordinary causal trunk (layers.py). What is known of the operator, with sources, is in the public
record (`clover-public-record.md`, section 3); each piece below says whether it follows a published formula or
the record's reading of a description (`PIECES`, shown by `model inspect` and the run report).

Shapes: B rows, T block tokens, C conv channels, Kc conv kernel, R = Kc - 1 right taps, H value heads (key heads
repeated), K key dim, V value dim, N tokens, E experts.

Notable choices:
- A forward may mix committing rows (causal over their first `split` tokens) and previewing rows (`PreviewPlan`):
  the engine commits a finished block in the same forward in which the other rows take denoising steps. GDN layers
  then compute both operators over the first segment and keep each row's own (the GDN mixers are a small share of
  a step; per-row gathers of the recurrent state would cost more and break CUDA graphs' fixed shapes).
- A preview segment is one block: every token of it sees every other (attention, history softmax, right taps),
  and nothing past its end (the right taps read zeros there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# What each piece of the preview follows: (piece, status, source). "exact" = a published formula or a confirmed
# statement implemented as written; "reading" = the public record's reading of a description, unverified until
# `clover-batch model parity` runs against the authors' code.
PIECES: tuple[tuple[str, str, str], ...] = (
    ("prefill and commits: the causal Qwen3.6-MoE trunk", "exact",
     "record 3.1 (cortiq release notes S4/S5; llama.cpp runs Clover as this trunk, S9/S11)"),
    ("attention: bidirectional inside the block, full view of the committed prefix", "exact", "record 3.2 (S4)"),
    ("GDN preview conv: causal taps over the clean conv tail + right taps over the next block rows", "exact",
     "record 3.3a (cortiq's bdp_conv kernel, S6); zeros past the block end: reading"),
    ("GDN history-slot mixer: softmax over the block plus a history slot read from the clean state", "reading",
     "record 3.3b: s_h<q,k> over the block, b_h for the history slot, c_h * readout of S_clean"),
    ("MoE: top-k within the block's expert coreset (when coreset_size is set)", "reading",
     "record 3.4: coreset = top coreset_size experts of the block's mean router probabilities"),
    ("logit shift: a masked position is read from the previous position's logits", "reading",
     "record 3.5: unresolved publicly; default for clover_moe, `model.logits_shift` overrides"),
)


@dataclass
class PreviewPlan:
    """Which tokens of one forward take the preview operator.

    Tokens [0, split) of the rows in `commits` are committed by the causal trunk; every other token previews. The
    tokens after `split` form a second preview segment (the next block of a row that committed the first one).
    """

    split: int  # tokens of the first segment
    tokens: int  # T, tokens of the forward
    commits: torch.Tensor | None  # [B] bool: rows committing their first segment (None: no row commits)
    any_commit: bool  # known on the host (True when unknown: a CUDA-graph step computes both operators)
    all_commit: bool  # every row commits its first segment (known on the host; False when unknown)
    coreset_size: int | None = None  # experts per block coreset (None: routing unrestricted)

    @property
    def segments(self) -> list[tuple[int, int]]:
        return [(0, self.split)] + ([(self.split, self.tokens)] if self.split < self.tokens else [])

    def preview_tokens(self, device: torch.device) -> torch.Tensor:
        """[B or 1, T] bool: the tokens that preview."""
        t = torch.arange(self.tokens, device=device)
        if self.commits is None:
            return torch.ones(1, self.tokens, dtype=torch.bool, device=device)
        return (t[None, :] >= self.split) | ~self.commits[:, None]

    def segment_end(self, device: torch.device) -> torch.Tensor:
        """[T] index of the last token of each token's segment."""
        t = torch.arange(self.tokens, device=device)
        return torch.where(t < self.split, self.split - 1, self.tokens - 1)


# ---- GDN preview conv -------------------------------------------------------------------------------------------


def preview_conv(x_BTC: torch.Tensor, w_CK: torch.Tensor, right_CR: torch.Tensor,
                 tail_BKC: torch.Tensor) -> torch.Tensor:
    """The preview short conv + SiLU over one block (the tail is read, never advanced).

    out[t] = SiLU(sum_{j<Kc} in[t + j] * w[j] + sum_{d=1..R} x[t + d] * right[d - 1]),  in = [tail | x],
    x[t + d] = 0 past the block end. Two depthwise conv1d calls: the causal one over [tail | x], the right one over
    x shifted left by one and padded with R zeros.
    """
    R = right_CR.shape[1]
    xx = torch.cat([tail_BKC.to(x_BTC.dtype), x_BTC], dim=1).transpose(1, 2)  # [B, C, Kc-1+T]
    left = F.conv1d(xx, w_CK.unsqueeze(1).to(x_BTC.dtype), groups=w_CK.shape[0])  # [B, C, T]
    ahead = F.pad(x_BTC.transpose(1, 2)[:, :, 1:], (0, R + 1))  # x[t+1 ..], zeros past the end  [B, C, T+R]
    right = F.conv1d(ahead, right_CR.unsqueeze(1).to(x_BTC.dtype), groups=right_CR.shape[0])[:, :, :x_BTC.shape[1]]
    return F.silu(left + right).transpose(1, 2)


def preview_conv_reference(x_BTC: torch.Tensor, w_CK: torch.Tensor, right_CR: torch.Tensor,
                           tail_BKC: torch.Tensor) -> torch.Tensor:
    """The record's formula (cortiq's `bdp_conv`) token by token, in fp32: the reference for `preview_conv`."""
    B, T, C = x_BTC.shape
    Kc, R = w_CK.shape[1], right_CR.shape[1]
    inp = torch.cat([tail_BKC.float(), x_BTC.float()], dim=1)  # [B, Kc-1+T, C]
    out = torch.zeros(B, T, C)
    for t in range(T):
        acc = torch.zeros(B, C)
        for j in range(Kc):
            acc += inp[:, t + j] * w_CK[:, j].float()
        for d in range(1, R + 1):
            if t + d < T:
                acc += x_BTC[:, t + d].float() * right_CR[:, d - 1].float()
        out[:, t] = F.silu(acc)
    return out.to(x_BTC.dtype)


# ---- GDN history-slot mixer -------------------------------------------------------------------------------------


def history_mixer(q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, state_BHKV: torch.Tensor,
                  logit_scale_H: torch.Tensor, history_bias_H: torch.Tensor,
                  history_c_H: torch.Tensor) -> torch.Tensor:
    """The block softmax with a history slot, per value head h (q, k L2-normalised, repeated to the value heads):

        l[t, j]    = s_h * <q_t, k_j>            for every j in the block (bidirectional)
        l[t, hist] = b_h
        p          = softmax over {hist} + block
        o_t        = p[t, hist] * c_h * (S_clean^T q_t / sqrt(K)) + sum_j p[t, j] v_j

    s, b, c = bd_softmax_logit_scale, bd_softmax_history_bias, bd_softmax_history_c. Status: the public record's
    reading (section 3.3b), not a published formula. Choices inside it: s_h used raw; the history read is the GDN
    layer's own readout of its state (with the 1/sqrt(K) the recurrence's output uses), without in-block decay;
    v not weighted by beta; every block row is a key, masks included. All in fp32. Returns [B, T, H, V] fp32.
    """
    q, k, v = (t.float().transpose(1, 2) for t in (q_BTHK, k_BTHK, v_BTHV))  # [B, H, T, *]
    H = q.shape[1]
    scores = (q @ k.transpose(-1, -2)) * logit_scale_H.float().view(1, H, 1, 1)  # [B, H, T, T]
    hist = history_bias_H.float().view(1, H, 1, 1).expand(*scores.shape[:3], 1)
    p = torch.cat([hist, scores], dim=-1).softmax(-1)  # [B, H, T, 1 + T]
    read = (q @ state_BHKV.float()) * (q.shape[-1] ** -0.5)  # [B, H, T, V]
    out = p[..., :1] * history_c_H.float().view(1, H, 1, 1) * read + p[..., 1:] @ v
    return out.transpose(1, 2)


def history_mixer_reference(q_BTHK, k_BTHK, v_BTHV, state_BHKV, logit_scale_H, history_bias_H,
                            history_c_H) -> torch.Tensor:
    """`history_mixer` one head and one row at a time, with explicit exponentials: its reference."""
    B, T, H, K = q_BTHK.shape
    out = torch.zeros(B, T, H, v_BTHV.shape[-1])
    for b in range(B):
        for h in range(H):
            S = state_BHKV[b, h].float()
            for t in range(T):
                q = q_BTHK[b, t, h].float()
                logits = [float(history_bias_H[h])] + [float(logit_scale_H[h]) * float(q @ k_BTHK[b, j, h].float())
                                                       for j in range(T)]
                top = max(logits)
                w = [math.exp(x - top) for x in logits]
                total = sum(w)
                acc = (w[0] / total) * float(history_c_H[h]) * (q @ S) / math.sqrt(K)
                for j in range(T):
                    acc = acc + (w[1 + j] / total) * v_BTHV[b, j, h].float()
                out[b, t, h] = acc
    return out


# ---- expert coreset ---------------------------------------------------------------------------------------------


def coreset_allowed(probs_BTE: torch.Tensor, plan: PreviewPlan) -> torch.Tensor:
    """[B, T, E] bool: the experts each token may route to. A preview token may use its segment's coreset (the
    `coreset_size` experts of highest mean router probability over the segment's tokens); a committed token any.

    Status: the record's reading of "the block's expert coreset" (section 3.4): a two-phase rule, pooled block
    scores, then each row's own top-k within the set.
    """
    assert plan.coreset_size is not None
    B, T, E = probs_BTE.shape
    allowed = torch.zeros(B, T, E, dtype=torch.bool, device=probs_BTE.device)
    for start, end in plan.segments:
        pooled = probs_BTE[:, start:end].mean(1)  # [B, E]
        core = torch.zeros(B, E, dtype=torch.bool, device=probs_BTE.device)
        core.scatter_(1, pooled.topk(plan.coreset_size, dim=-1).indices, True)
        allowed[:, start:end] = core[:, None, :]
    if plan.commits is not None:  # committed tokens route freely (the causal trunk)
        allowed[:, :plan.split] |= plan.commits[:, None, None]
    return allowed
