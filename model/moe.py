"""Mixture of experts as a pipeline of small parts.

    route -> dispatch -> experts -> combine -> + shared expert

- route: router logits -> softmax (fp32) -> top-k -> renormalise (norm_topk_prob) -> weights in the model dtype;
  in a Clover preview, top-k among the block's expert coreset (preview.coreset_allowed).
- dispatch: the N*k (token, expert) pairs sorted by expert, with int32 end offsets per expert.
- experts: two grouped GEMMs over the stacked expert weights (gate_up [E, 2I, D], down [E, D, I]), SiLU-gated.
- combine: each pair's output scaled by its routing weight and summed back into its token.
- shared expert: a dense SiLU MLP scaled by sigmoid(shared_expert_gate(x)).

Which ranks run which experts is the dispatcher's business: `LocalDispatcher` runs them all here; an
expert-parallel dispatcher is swapped in from outside (`model/expert_parallel.py`) without touching this module.
Shapes: N tokens, D hidden, E experts (local), I expert width, P = N*k routed pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .config import CloverConfig
from .preview import PreviewPlan, coreset_allowed


@dataclass
class Routing:
    weights: torch.Tensor  # [N, k] in the activation dtype
    experts: torch.Tensor  # [N, k] int64 global expert ids


def router_probs(x_ND: torch.Tensor, router_ED: torch.Tensor) -> torch.Tensor:
    """[N, E] fp32 router probabilities."""
    return F.softmax(ops.linear(x_ND, router_ED), dim=-1, dtype=torch.float32)


def route(x_ND: torch.Tensor, router_ED: torch.Tensor, top_k: int, normalize: bool,
          allowed_NE: torch.Tensor | None = None, probs_NE: torch.Tensor | None = None) -> Routing:
    """Top-k routing; `allowed_NE` restricts each token to some experts (at least top_k of them)."""
    probs = router_probs(x_ND, router_ED) if probs_NE is None else probs_NE
    scores = probs if allowed_NE is None else probs.masked_fill(~allowed_NE, -1.0)
    top_w, top_e = torch.topk(scores, top_k, dim=-1)
    if normalize:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    return Routing(top_w.to(x_ND.dtype), top_e)


@dataclass
class Dispatch:
    order: torch.Tensor  # [P] pair index (token * k + slot) in expert order
    offsets: torch.Tensor  # [E] int32 end offset of each expert's rows


def dispatch(expert_ids: torch.Tensor, num_experts: int, first_expert: int = 0, *, all_local: bool = False) -> Dispatch:
    """Sort routed pairs by (local) expert; pairs whose expert is outside [first, first+E) are not in `order`.

    all_local: every id is known to be in range (all experts on this device), so nothing is filtered and no host
    sync is needed (counting the kept pairs would be one per MoE layer, every decode step).
    """
    flat = expert_ids.reshape(-1) - first_expert
    if all_local:
        order = torch.argsort(flat, stable=True)
    else:
        keep = (flat >= 0) & (flat < num_experts)
        order = torch.argsort(torch.where(keep, flat, num_experts), stable=True)[: int(keep.sum())]
    # end offsets by binary search over the sorted ids: bincount would read its maximum back to the host on CUDA
    ends = torch.searchsorted(flat[order], torch.arange(num_experts, device=flat.device), right=True)
    return Dispatch(order, ends.to(torch.int32))


def expert_mlp(x_PD: torch.Tensor, gate_up_EFD: torch.Tensor, down_EDI: torch.Tensor,
               offsets_E: torch.Tensor) -> torch.Tensor:
    """Rows grouped by expert through their expert's SiLU-gated MLP: [P, D] -> [P, D]."""
    padded = ops.PaddedGroups.plan(offsets_E, x_PD.device)
    if padded is not None:  # CPU: one padded bmm per GEMM (see ops.PaddedGroups)
        gate, up = padded.mm(padded.pad(x_PD), gate_up_EFD).chunk(2, dim=-1)
        return padded.unpad(padded.mm(F.silu(gate) * up, down_EDI))
    h = ops.grouped_mm(x_PD, gate_up_EFD, offsets_E)  # [P, 2I]
    gate, up = h.chunk(2, dim=-1)
    return ops.grouped_mm(F.silu(gate) * up, down_EDI, offsets_E)


def combine(y_PD: torch.Tensor, d: Dispatch, routing: Routing, n_tokens: int) -> torch.Tensor:
    """Scale each pair's output by its weight and add it into its token: [P, D] -> [N, D]."""
    k = routing.weights.shape[1]
    w = routing.weights.reshape(-1)[d.order].unsqueeze(-1)
    out = y_PD.new_zeros(n_tokens, y_PD.shape[-1])
    return out.index_add_(0, d.order // k, y_PD * w)


def experts_reference(x_ND: torch.Tensor, routing: Routing, gate_up_EFD: torch.Tensor,
                      down_EDI: torch.Tensor) -> torch.Tensor:
    """Per-expert Python loop over all experts: the test reference for dispatch -> experts -> combine."""
    out = torch.zeros_like(x_ND)
    for e in range(gate_up_EFD.shape[0]):
        tok, slot = torch.where(routing.experts == e)
        if tok.numel() == 0:
            continue
        gate, up = (x_ND[tok] @ gate_up_EFD[e].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ down_EDI[e].T
        out.index_add_(0, tok, y * routing.weights[tok, slot, None])
    return out


class ExpertDispatcher(Protocol):
    """Runs the routed experts for a batch of tokens: (x [N, D], routing, layer's experts) -> [N, D]."""

    def __call__(self, x_ND: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor: ...


class LocalDispatcher:
    """All experts live on this device."""

    def __call__(self, x_ND: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        d = dispatch(routing.experts, experts.num_local, experts.first_expert, all_local=experts.holds_all)
        x_PD = x_ND[d.order // routing.experts.shape[1]]
        y_PD = expert_mlp(x_PD, experts.gate_up_proj, experts.down_proj, d.offsets)
        return combine(y_PD, d, routing, x_ND.shape[0])


class Experts(nn.Module):
    """Stacked weights of the experts [first_expert, first_expert + num_local) of one layer."""

    def __init__(self, config: CloverConfig, first_expert: int = 0, num_local: int | None = None) -> None:
        super().__init__()
        self.first_expert = first_expert
        self.num_local = config.num_experts if num_local is None else num_local
        self.holds_all = first_expert == 0 and self.num_local == config.num_experts  # every expert of the layer
        D, Iw = config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * Iw, D))  # [E, 2I, D]: gate rows, then up
        self.down_proj = nn.Parameter(torch.empty(self.num_local, D, Iw))  # [E, D, I]


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(ops.linear(x, self.gate_proj.weight)) * ops.linear(x, self.up_proj.weight)
        return ops.linear(h, self.down_proj.weight)


class SparseMoE(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = Experts(config)
        self.shared_expert = SharedExpert(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.dispatcher: ExpertDispatcher = LocalDispatcher()

    def forward(self, x_BTD: torch.Tensor, plan: PreviewPlan | None = None) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        if plan is not None and plan.coreset_size is not None:  # a Clover preview restricted to block coresets
            probs = router_probs(x_ND, self.gate.weight)
            allowed = coreset_allowed(probs.view(*x_BTD.shape[:2], -1), plan).reshape(probs.shape)
            routing = route(x_ND, self.gate.weight, self.top_k, self.normalize, allowed, probs)
        else:
            routing = route(x_ND, self.gate.weight, self.top_k, self.normalize)
        routed = self.dispatcher(x_ND, routing, self.experts)
        shared = self.shared_expert(x_ND) * torch.sigmoid(ops.linear(x_ND, self.shared_expert_gate.weight))
        return (routed + shared).reshape(x_BTD.shape)
