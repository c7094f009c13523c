"""CloverModel: token ids and an explicit state in, logits and the next state out.

Notable choices:
- `forward(ids, state, commit=False)` returns the state it was given, untouched (layers never write in place), so
  a denoising step can be re-run against the same committed state as often as needed.
- `attention` picks how the new tokens see each other in full-attention layers: "causal", or "block_causal"
  (bidirectional inside blocks of `block_size` aligned on absolute positions, causal across blocks). GDN layers
  are causal, except in a preview of Clover's operator.
- `preview=True` runs a denoising step over the new tokens (one block) against the state, never committing it:
  for a checkpoint with the `trunk` operator that is the model's own block-causal forward; for Clover's layout
  (`preview_operator: clover`) the public record's preview operator (preview.py). Prefill and commits of a Clover
  model are the causal trunk.
- `keep_logits` computes the lm_head only for the last n positions (0: none): prefill of a 128K window would
  otherwise materialise T x V logits nobody reads.
- `forward_slots` is the engine's path over preallocated slots written in place (slots.py); the layers are the same,
  only the state objects differ, and tests hold the two paths equal.
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .config import CloverConfig
from .layers import AttentionContext, DecoderLayer, RMSNorm
from .preview import PreviewPlan
from .slots import SlotRows
from .state import AttentionState, CloverState


class CloverModel(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.config = config
        # _weight: skip nn.Embedding's normal_ init, which on the meta device imports torch's decompositions
        # (~2 s, once per process); every weight is assigned from the checkpoint or the seeded init anyway.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, kind) for kind in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                          bias=False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def empty_state(self, batch: int) -> CloverState:
        return CloverState.empty(self.config, batch, device=self.device, dtype=self.dtype)

    def default_attention(self) -> str:
        d = self.config.diffusion
        return "block_causal" if d is not None and d.prompt_attention == "block_causal" else "causal"

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, state: CloverState | None = None, *, commit: bool | None = None,
                attention: str | None = None, keep_logits: int | None = None, window_tokens: int | None = None,
                preview: bool = False) -> tuple[torch.Tensor | None, CloverState]:
        """Run `input_ids` [B, T] after `state`; returns (logits [B, T', V] or None, state).

        commit: return the state after the tokens (default), or the state passed in (False). attention: "causal" |
        "block_causal" (default: the config's prompt attention). keep_logits: logits for the last n positions only
        (None: all, 0: none). window_tokens: overrides the config's attention window. preview: a denoising step
        over the tokens as one block (see the module docstring); never commits.
        """
        return self.forward_train(input_ids, state, commit=commit, attention=attention, keep_logits=keep_logits,
                                  window_tokens=window_tokens, preview=preview)

    def forward_train(self, input_ids: torch.Tensor, state: CloverState | None = None, *, commit: bool | None = None,
                      attention: str | None = None, keep_logits: int | None = None,
                      window_tokens: int | None = None,
                      preview: bool = False) -> tuple[torch.Tensor | None, CloverState]:
        """`forward` with autograd: the same computation, recording gradients when the caller enables them."""
        cfg = self.config
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, tokens] with tokens >= 1, got shape {tuple(input_ids.shape)}")
        if bool(((input_ids < 0) | (input_ids >= cfg.vocab_size)).any()):
            bad = input_ids[(input_ids < 0) | (input_ids >= cfg.vocab_size)][:5].tolist()
            raise ValueError(f"token ids {bad} are outside the vocabulary (size {cfg.vocab_size})")
        B, T = input_ids.shape
        plan = None
        if preview:
            if cfg.diffusion is None:
                raise ValueError("preview=True is a denoising step: this model is autoregressive")
            if commit:
                raise ValueError("a preview pass never commits (commit=True with preview=True)")
            commit = False
            if cfg.diffusion.clover:
                plan = PreviewPlan(split=T, tokens=T, commits=None, any_commit=False, all_commit=False,
                                   coreset_size=cfg.diffusion.coreset_size)
            else:
                attention = "block_causal"
        commit = True if commit is None else commit
        input_ids = input_ids.to(self.device)
        if state is None:
            state = self.empty_state(B)
        if state.batch_size != B:
            raise ValueError(f"state holds {state.batch_size} sequences but input_ids has {B}")
        attn = next((s for s in state.layers if isinstance(s, AttentionState)), None)
        if attn is not None and (attn.keys.dtype != self.dtype or attn.keys.device != self.device):
            raise ValueError(f"state was made for {attn.keys.dtype} on {attn.keys.device}; this model computes in "
                             f"{self.dtype} on {self.device}")
        if keep_logits is not None and keep_logits < 0:
            raise ValueError(f"keep_logits must be None or >= 0, got {keep_logits}")
        ctx = self._context(state.positions[:, None] + torch.arange(T, device=state.positions.device),
                            attention or self.default_attention(),
                            cfg.window_tokens if window_tokens is None else window_tokens, plan)

        h = self.embed_tokens(input_ids)
        new_layers = []
        for layer, layer_state in zip(self.layers, state.layers, strict=True):
            h, layer_state = layer(h, layer_state, ctx)
            new_layers.append(layer_state)

        logits = self._logits(h, keep_logits)
        if not commit:
            return logits, state
        positions = state.positions + T
        first_visible = positions - ctx.window + 1  # the next query's window start
        trimmed = [s.trimmed(first_visible) if isinstance(s, AttentionState) else s for s in new_layers]
        return logits, CloverState(trimmed, positions)

    @torch.inference_mode()
    def forward_slots(self, input_ids: torch.Tensor, rows: SlotRows, *, attention: str,
                      keep_logits: int | None, preview: bool = False,
                      logits_at: list[int] | None = None) -> torch.Tensor | None:
        """The engine's forward: `input_ids` [B, T] after the sequences in slots rows.start.. (slots.py), whose
        state is read in place and advanced in place for the committing rows. Returns logits as `forward` does.

        preview: a denoising step (the rows that do not commit, and the tokens after the committed ones, are
        previews): for a Clover-layout model the preview operator, else the `attention` given (block-causal).
        logits_at: logits at these token indices only, [B, len, V] (a packed prefill: each sequence's last token).
        Token ids are not checked here: the engine checks prompts when they are added, and every other id it
        feeds comes from the model itself (a check would cost a host sync per step).
        """
        d = self.config.diffusion
        at = torch.tensor(logits_at, device=input_ids.device) if logits_at else None  # before any kernel is queued
        plan = rows.preview_plan(d.coreset_size) if preview and d is not None and d.clover else None
        ctx = self._context(rows.query_positions(), attention, rows.window, plan)
        ctx.packing = rows.packing
        block = d.block_size if d is not None else 1
        ctx.all_visible = rows.all_visible(attention, block, plan) and not rows.paged
        rows.write_key_positions(ctx.q_pos)
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            h, _ = layer(h, rows.layer(i), ctx)
        if at is not None:
            logits = self._logits(h[:, at], None)
        else:
            logits = self._logits(h, keep_logits)
        rows.commit()
        return logits

    def _logits(self, h: torch.Tensor, keep_logits: int | None) -> torch.Tensor | None:
        if keep_logits == 0:
            return None
        h = h if keep_logits is None else h[:, -keep_logits:]
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return ops.linear(self.norm(h), head)

    def _context(self, q_pos: torch.Tensor, attention: str, window: int,
                 plan: PreviewPlan | None = None) -> AttentionContext:
        """What every layer of a forward shares; q_pos [B, T]: the absolute position of each new token."""
        cfg = self.config
        if plan is not None:  # previewed tokens see their whole block; committed ones are causal (the trunk)
            block_end = q_pos[:, :1] + plan.segment_end(q_pos.device)
            visible_until = torch.where(plan.preview_tokens(q_pos.device), block_end, q_pos)
        elif attention == "causal":
            visible_until = q_pos
        elif attention == "block_causal":
            if cfg.diffusion is None:
                raise ValueError("block_causal attention needs a diffusion config (block_size)")
            bs = cfg.diffusion.block_size
            visible_until = (q_pos // bs + 1) * bs - 1
        else:
            raise ValueError(f"attention must be 'causal' or 'block_causal', got {attention!r}")
        if window < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window}")
        cos, sin = ops.rope_cos_sin(q_pos, cfg.rope_dim, cfg.rope_theta, self.dtype)
        return AttentionContext(q_pos, cos, sin, visible_until, window, preview=plan)
