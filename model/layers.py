"""Token mixers and the decoder layer: Gated DeltaNet, gated full attention, zero-centred RMSNorm.

Shapes: B batch, T new tokens, S cached + new keys, D hidden, H heads, Hk/Hv GDN key/value heads,
Dk/Dv GDN head dims, C conv channels (2*Hk*Dk + Hv*Dv).

Every layer takes its slice of the state and returns the updated slice; modules hold weights only. The slice is
either the functional state (state.py: new tensors each forward) or a view of the engine's slots (slots.py: written
in place); both offer the same two methods, so the layers' maths exists once.
Module and parameter names follow the Qwen3.5-MoE checkpoints, so the key mapping (weights.py) stays a table;
a Clover checkpoint's four block-diffusion GDN families are bare parameters of GatedDeltaNet under their own names.
A forward with a `PreviewPlan` (Clover's denoising step, preview.py) sends the GDN layers and the MoE the plan, and
the attention layers a mask that is bidirectional inside the previewed block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import ops, preview
from .config import CloverConfig
from .moe import SparseMoE
from .preview import PreviewPlan
from .slots import Packing
from .state import AttentionLayerState, GDNLayerState, PagedKeys


class RMSNorm(nn.Module):
    """Zero-centred: the weight is stored as w and applied as (1 + w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ops.gated_rms_norm(x, gate, self.weight, self.eps)


@dataclass
class Projected:
    """A GDN layer's input projections of some tokens: what both its causal and its preview operator read."""

    qkv: torch.Tensor  # [B, T, C] before the short conv
    z: torch.Tensor  # [B, T, Hv, Dv] output gate
    beta: torch.Tensor  # [B, T, Hv]
    g: torch.Tensor  # [B, T, Hv] fp32 log decay

    def slice(self, start: int, end: int) -> Projected:
        return Projected(self.qkv[:, start:end], self.z[:, start:end], self.beta[:, start:end], self.g[:, start:end])


class GatedDeltaNet(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        D = config.hidden_size
        self.Hk, self.Hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.Dk, self.Dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(D, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(D, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(D, self.Hv, bias=False)
        self.in_proj_a = nn.Linear(D, self.Hv, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(conv_dim, 1, config.linear_conv_kernel_dim))  # [C, 1, Kc]
        self.A_log = nn.Parameter(torch.empty(self.Hv))
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.norm = GatedRMSNorm(self.Dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)
        # Clover's block-diffusion GDN tensors (the preview operator, preview.py): bare parameters, as the
        # checkpoint names them; the three bd_softmax vectors per value head (the record's reading of their shape)
        self.clover = config.diffusion is not None and config.diffusion.clover
        if self.clover:
            self.conv_right_weight = nn.Parameter(torch.empty(conv_dim, config.linear_conv_kernel_dim - 1))  # [C, R]
            self.bd_softmax_logit_scale = nn.Parameter(torch.empty(self.Hv))
            self.bd_softmax_history_bias = nn.Parameter(torch.empty(self.Hv))
            self.bd_softmax_history_c = nn.Parameter(torch.empty(self.Hv))

    def forward(self, x_BTD: torch.Tensor, state: GDNLayerState, plan: PreviewPlan | None = None,
                lengths: list[int] | None = None) -> tuple[torch.Tensor, GDNLayerState]:
        """The layer over x from `state`. Without a plan every token is causal (the committing rows keep the state
        after `state.commit_tokens` of them). With a preview plan (Clover's operator, preview.py): the committing
        rows' first segment is causal, every other token previews from the clean state after what precedes it.
        lengths: x is one row of sequences packed along the token axis (a packed prefill), one state each."""
        T = x_BTD.shape[1]
        p = self._project(x_BTD)
        if lengths is not None:
            o, (recurrent, conv) = self._causal(p, state.recurrent, state.conv, lengths)
            return self._out(o, p.z, x_BTD.dtype), state.advanced(recurrent, conv)
        if plan is None:
            split = state.commit_tokens
            if split is not None and split < T:  # keep the state after the first `split` tokens: two kernel calls
                o1, (recurrent, conv) = self._causal(p.slice(0, split), state.recurrent, state.conv)
                o2, _ = self._causal(p.slice(split, T), recurrent, conv)
                o = torch.cat([o1, o2], dim=1)
            else:
                o, (recurrent, conv) = self._causal(p, state.recurrent, state.conv)
            return self._out(o, p.z, x_BTD.dtype), state.advanced(recurrent, conv)
        first = p.slice(0, plan.split)
        if plan.any_commit:
            causal, (recurrent, conv) = self._causal(first, state.recurrent, state.conv)
        if not plan.all_commit:
            previewed = self._preview(first, state.recurrent, state.conv)
        if plan.all_commit:
            o = causal
        elif not plan.any_commit:
            o = previewed
        else:
            assert plan.commits is not None
            o = torch.where(plan.commits[:, None, None, None], causal, previewed)
        if plan.split < T:  # the next block of the committing rows, from the state after their commit
            o = torch.cat([o, self._preview(p.slice(plan.split, T), recurrent, conv)], dim=1)
        out = self._out(o, p.z, x_BTD.dtype)
        return out, (state.advanced(recurrent, conv) if plan.any_commit else state)

    def _project(self, x_BTD: torch.Tensor) -> Projected:
        B, T, _ = x_BTD.shape
        # fp32: exp(A_log) and softplus overflow or lose the decay's precision in bf16.
        g = -self.A_log.float().exp() * F.softplus(ops.linear(x_BTD, self.in_proj_a.weight).float()
                                                   + self.dt_bias.float())
        return Projected(qkv=ops.linear(x_BTD, self.in_proj_qkv.weight),
                         z=ops.linear(x_BTD, self.in_proj_z.weight).reshape(B, T, self.Hv, self.Dv),
                         beta=torch.sigmoid(ops.linear(x_BTD, self.in_proj_b.weight)), g=g)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [B, T, Hk, Dk] (L2-normalised in fp32) and v [B, T, Hv, Dv] from the conv output."""
        B, T, _ = mixed.shape
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = ops.l2norm(q.reshape(B, T, self.Hk, self.Dk).float())
        k = ops.l2norm(k.reshape(B, T, self.Hk, self.Dk).float())
        return q, k, v.reshape(B, T, self.Hv, self.Dv)

    def _causal(self, p: Projected, recurrent: torch.Tensor, conv: torch.Tensor,
                lengths: list[int] | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The causal trunk: (o [B, T, Hv, Dv] fp32, (recurrent, conv tail) after these tokens)."""
        mixed, conv_tail = ops.short_conv(p.qkv, self.conv1d.weight[:, 0], conv, lengths)  # [B, T, C]
        q, k, v = self._heads(mixed)  # each key head serves Hv/Hk consecutive value heads (inside the kernel)
        o, recurrent = ops.gated_delta_rule(q, k, v, p.g, p.beta, recurrent, lengths)  # [B, T, Hv, Dv]
        return o, (recurrent, conv_tail)

    def _preview(self, p: Projected, recurrent: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
        """Clover's preview of one block against the clean (recurrent, conv tail), which it never writes."""
        mixed = preview.preview_conv(p.qkv, self.conv1d.weight[:, 0], self.conv_right_weight, conv)
        q, k, v = self._heads(mixed)
        groups = self.Hv // self.Hk
        if groups > 1:
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        return preview.history_mixer(q, k, v, recurrent, self.bd_softmax_logit_scale, self.bd_softmax_history_bias,
                                     self.bd_softmax_history_c)

    def _out(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        B, T = o.shape[:2]
        o = self.norm(o.to(dtype), z).reshape(B, T, self.value_dim)
        return ops.linear(o, self.out_proj.weight)


@dataclass
class AttentionContext:
    """What every attention layer of one forward pass shares, computed once."""

    q_pos: torch.Tensor  # [B, T] absolute positions of the new tokens
    cos: torch.Tensor  # [B, T, R]
    sin: torch.Tensor  # [B, T, R]
    visible_until: torch.Tensor  # [B, T] last key position each query may see (causal: itself; block: block end)
    window: int  # a query at p sees keys at positions >= p - window + 1
    all_visible: bool = False  # known on the host: every key is visible to every query (no mask needed)
    preview: PreviewPlan | None = None  # Clover's preview operator for some tokens (preview.py); None: the trunk
    packing: Packing | None = None  # several sequences packed along the token axis of one row (slots.py)
    _masks: dict = field(default_factory=dict)

    def mask(self, keys_at: torch.Tensor | PagedKeys, rows: torch.Tensor | None = None, *,
             exact: bool = True) -> ops.AttentionMask | ops.PagedMask:
        """The mask over these keys (their positions [b, S], or the page pool's tables) for the queries of `rows`
        (None: every row); layers whose keys sit at the same positions share one (built once). A packed forward's
        queries are laid out per sequence here ([n, Tmax]), as attention runs them. exact: the keys carry no
        padding beyond what the rows' positions imply, so a host-known `all_visible` holds for them."""
        key: tuple = ((keys_at.data_ptr(), tuple(keys_at.shape), tuple(keys_at.stride()))
                      if isinstance(keys_at, torch.Tensor) else ("paged", id(keys_at.pool_pos)))
        if key not in self._masks:
            q_pos, visible = self.q_pos, self.visible_until
            if self.packing is not None:
                q_pos, visible = q_pos[0][self.packing.unpack], visible[0][self.packing.unpack]
            if rows is not None:
                q_pos, visible = q_pos[rows], visible[rows]
            if isinstance(keys_at, PagedKeys):
                self._masks[key] = ops.PagedMask(keys_at.table, keys_at.pool_pos, keys_at.page_size, q_pos, visible,
                                                 self.window)
            else:
                self._masks[key] = ops.AttentionMask(keys_at, q_pos, visible, self.window,
                                                     self.all_visible and exact)
        return self._masks[key]


class GatedAttention(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        D, self.H, self.Hkv, self.Dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, \
            config.head_dim
        self.q_proj = nn.Linear(D, self.H * self.Dh * 2, bias=False)  # per head: query, then output gate
        self.k_proj = nn.Linear(D, self.Hkv * self.Dh, bias=False)
        self.v_proj = nn.Linear(D, self.Hkv * self.Dh, bias=False)
        self.o_proj = nn.Linear(self.H * self.Dh, D, bias=False)
        self.q_norm = RMSNorm(self.Dh, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.Dh, config.rms_norm_eps)

    def forward(self, x_BTD: torch.Tensor, state: AttentionLayerState,
                ctx: AttentionContext) -> tuple[torch.Tensor, AttentionLayerState]:
        B, T, _ = x_BTD.shape
        q, gate = ops.linear(x_BTD, self.q_proj.weight).view(B, T, self.H, 2 * self.Dh).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, Dh]
        k = self.k_norm(ops.linear(x_BTD, self.k_proj.weight).view(B, T, self.Hkv, self.Dh)).transpose(1, 2)
        v = ops.linear(x_BTD, self.v_proj.weight).view(B, T, self.Hkv, self.Dh).transpose(1, 2)
        q, k = ops.apply_rope(q, ctx.cos, ctx.sin), ops.apply_rope(k, ctx.cos, ctx.sin)

        reads, state = state.extended(k, v, ctx.q_pos)
        p = ctx.packing
        # a packed forward's queries per sequence [n, H, Tmax, Dh], each against its own keys, then packed back
        rows_q = q if p is None else q[0].transpose(0, 1)[p.unpack].permute(0, 2, 1, 3)
        if len(reads) == 1 and reads[0].rows is None:
            r = reads[0]
            out = ops.attention(rows_q, r.keys, r.values, ctx.mask(r.key_pos, exact=r.exact))
        else:  # groups of rows that read different numbers of keys (slots.SlotRows.page_reads)
            out = torch.empty_like(rows_q)
            for r in reads:
                out[r.rows] = ops.attention(rows_q[r.rows], r.keys, r.values,
                                            ctx.mask(r.key_pos, r.rows, exact=r.exact))
        out = out.transpose(1, 2)  # [B, T, H, Dh] (packed: [n, Tmax, H, Dh])
        if p is not None:
            out = out.reshape(-1, self.H, self.Dh)[p.repack][None]  # [1, T, H, Dh]
        out = out.reshape(B, T, self.H * self.Dh) * torch.sigmoid(gate.reshape(B, T, -1))
        return ops.linear(out, self.o_proj.weight), state


class DecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoE(config)

    def forward(self, h: torch.Tensor, state: GDNLayerState | AttentionLayerState,
                ctx: AttentionContext) -> tuple[torch.Tensor, GDNLayerState | AttentionLayerState]:
        x = self.input_layernorm(h)
        if self.kind == "linear_attention":
            lengths = ctx.packing.lengths if ctx.packing is not None else None
            mixed, state = self.linear_attn(x, state, ctx.preview, lengths)  # type: ignore[arg-type]
        else:
            mixed, state = self.self_attn(x, state, ctx)  # type: ignore[arg-type]
        h = h + mixed
        return h + self.mlp(self.post_attention_layernorm(h), ctx.preview), state
