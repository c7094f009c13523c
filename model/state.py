"""The explicit per-sequence state a forward pass takes and returns. Nothing is cached on modules.

This is the functional state of `CloverModel.forward` (tests, training, the plain reference): every forward makes
new tensors. The engine keeps its sequences in preallocated slots written in place instead (slots.py); both offer
the layers the same two methods, `advanced` (GDN) and `extended` (attention).

Shapes: B batch, Hv GDN value heads, Dk/Dv GDN key/value dims, C conv channels, Kc conv kernel, Hkv attention KV
heads, S cached keys, D head dim.

Notable choices:
- Attention caches store, per slot, the absolute position of the key (`key_pos`, -1 = empty slot). Masks are built
  from positions, so sequences of different lengths share one rectangular cache (right-aligned, empty slots on the
  left) and a sliding window is a comparison, not a copy.
- After a committed forward, leading slots that no later query can see (older than the window, or empty in every
  row) are dropped, so a sequence's cache never holds more than window + the last forward's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .config import CloverConfig


@dataclass
class PagedKeys:
    """What attention over the page pool itself needs (ops.PagedMask): each row's page table and every entry's
    position. Returned by slots.AttentionSlots.extended instead of gathered keys on the flex path."""

    table: torch.Tensor  # [B, M] the forward's rows' page tables
    pool_pos: torch.Tensor  # [N]
    page_size: int



class GDNLayerState(Protocol):
    """What a GDN layer reads and returns: its initial state, and the state after its tokens."""

    @property
    def recurrent(self) -> torch.Tensor: ...  # [B, Hv, Dk, Dv] fp32

    @property
    def conv(self) -> torch.Tensor: ...  # [B, Kc-1, C]

    @property
    def commit_tokens(self) -> int | None: ...  # keep the state after this many new tokens (None: after all)

    def advanced(self, recurrent: torch.Tensor, conv: torch.Tensor) -> GDNLayerState: ...


@dataclass
class KeyRead:
    """Keys some rows of a forward attend over: `keys`/`values` [b, Hkv, S, D] with their positions `key_pos`
    [b, S] (-1 = padding), or the engine's page pool itself with its tables (PagedKeys, flex)."""

    rows: torch.Tensor | None  # the forward's rows (a packed forward's sequences) that read these; None: all, in order
    keys: torch.Tensor
    values: torch.Tensor
    key_pos: torch.Tensor | PagedKeys  # [b, S], or the pool's tables (flex over pages)
    exact: bool = True  # no padding beyond what every row's positions imply: a host-known all-visible holds here


class AttentionLayerState(Protocol):
    """What an attention layer reads and returns: the keys to attend over, including the new ones (one KeyRead for
    every row, or several for groups of rows that read different numbers of keys)."""

    def extended(self, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, q_pos_BT: torch.Tensor
                 ) -> tuple[list[KeyRead], AttentionLayerState]: ...


@dataclass
class GDNState:
    recurrent: torch.Tensor  # [B, Hv, Dk, Dv] fp32
    conv: torch.Tensor  # [B, Kc-1, C] the last Kc-1 conv inputs
    commit_tokens = None  # the functional state always advances over every new token

    def select(self, idx: torch.Tensor) -> GDNState:
        return GDNState(self.recurrent[idx], self.conv[idx])

    def advanced(self, recurrent: torch.Tensor, conv: torch.Tensor) -> GDNState:
        """The state after a forward: a new object (this one is never written)."""
        return GDNState(recurrent, conv)


@dataclass
class AttentionState:
    keys: torch.Tensor  # [B, Hkv, S, D] after norm and RoPE
    values: torch.Tensor  # [B, Hkv, S, D]
    key_pos: torch.Tensor  # [B, S] int64 absolute position of each slot's key; -1 = empty

    def select(self, idx: torch.Tensor) -> AttentionState:
        return AttentionState(self.keys[idx], self.values[idx], self.key_pos[idx]).trimmed(None)

    def extended(self, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor,
                 q_pos_BT: torch.Tensor) -> tuple[list[KeyRead], AttentionState]:
        """The keys to attend over (the cache followed by the new tokens, every row) and the state holding them
        (a new object: this one is never written)."""
        keys = torch.cat([self.keys, k_BHTD], dim=2)  # [B, Hkv, S, D]
        values = torch.cat([self.values, v_BHTD], dim=2)
        key_pos = torch.cat([self.key_pos, q_pos_BT], dim=1)  # [B, S]
        return [KeyRead(None, keys, values, key_pos)], AttentionState(keys, values, key_pos)

    def trimmed(self, first_visible: torch.Tensor | None) -> AttentionState:
        """Drop leading slots that are empty, or older than `first_visible` [B], in every row."""
        live = self.key_pos >= 0
        if first_visible is not None:
            live &= self.key_pos >= first_visible[:, None]
        any_live = live.any(0)
        if bool(any_live.all()):
            return self
        start = int(any_live.int().argmax()) if bool(any_live.any()) else self.key_pos.shape[1]
        return AttentionState(self.keys[:, :, start:], self.values[:, :, start:], self.key_pos[:, start:])


@dataclass
class CloverState:
    layers: list[GDNState | AttentionState]  # one entry per layer, by layer type
    positions: torch.Tensor  # [B] int64: tokens consumed so far (the next token's absolute position)

    @property
    def batch_size(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def empty(cls, config: CloverConfig, batch: int, *, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> CloverState:
        layers: list[GDNState | AttentionState] = []
        conv_channels = 2 * config.linear_key_dim + config.linear_value_dim
        for kind in config.layer_types:
            if kind == "linear_attention":
                layers.append(GDNState(
                    recurrent=torch.zeros(batch, config.linear_num_value_heads, config.linear_key_head_dim,
                                          config.linear_value_head_dim, dtype=torch.float32, device=device),
                    conv=torch.zeros(batch, config.linear_conv_kernel_dim - 1, conv_channels, dtype=dtype,
                                     device=device),
                ))
            else:
                kv = torch.zeros(batch, config.num_key_value_heads, 0, config.head_dim, dtype=dtype, device=device)
                layers.append(AttentionState(kv, kv.clone(), torch.zeros(batch, 0, dtype=torch.long, device=device)))
        return cls(layers, torch.zeros(batch, dtype=torch.long, device=device))

    def select(self, idx: torch.Tensor | list[int]) -> CloverState:
        """The sub-batch of rows `idx` (in that order)."""
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.positions.device)
        return CloverState([layer.select(idx) for layer in self.layers], self.positions[idx])

    @classmethod
    def concat(cls, states: list[CloverState]) -> CloverState:
        """Stack states of different sequences into one batch; attention caches are left-padded to one length."""
        layers: list[GDNState | AttentionState] = []
        for per_seq in zip(*(s.layers for s in states), strict=True):
            first = per_seq[0]
            if isinstance(first, GDNState):
                layers.append(GDNState(torch.cat([s.recurrent for s in per_seq]),  # type: ignore[union-attr]
                                       torch.cat([s.conv for s in per_seq])))  # type: ignore[union-attr]
                continue
            S = max(s.key_pos.shape[1] for s in per_seq)  # type: ignore[union-attr]

            def pad(t: torch.Tensor, dim: int, value: float, S: int = S) -> torch.Tensor:
                shape = list(t.shape)
                shape[dim] = S - t.shape[dim]
                return torch.cat([t.new_full(shape, value), t], dim=dim)

            layers.append(AttentionState(
                torch.cat([pad(s.keys, 2, 0.0) for s in per_seq]),  # type: ignore[union-attr]
                torch.cat([pad(s.values, 2, 0.0) for s in per_seq]),  # type: ignore[union-attr]
                torch.cat([pad(s.key_pos, 1, -1) for s in per_seq]),  # type: ignore[union-attr]
            ))
        return cls(layers, torch.cat([s.positions for s in states]))

    def nbytes(self) -> int:
        total = self.positions.numel() * 8
        for layer in self.layers:
            for t in vars(layer).values():
                total += t.numel() * t.element_size()
        return total
