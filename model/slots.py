"""Slot state: the engine's per-sequence state in preallocated tensors, written in place.

Shapes: S slots, Hv GDN value heads, Dk/Dv GDN head dims, C conv channels, Kc conv kernel, Hkv attention KV heads,
R ring entries per slot, D head dim, B rows of one forward (a contiguous range of slots), T new tokens.

Notable choices:
- Attention keys and values live in a ring of R = window + (most tokens one forward writes) entries per slot: the
  key at absolute position p sits at entry p % R and `key_pos` records p (-1: empty). A forward writes its T new
  keys first and then attends over the ring: every entry it overwrites is older than any of its queries' windows
  (R >= window + T), so keys are never shifted, trimmed or concatenated. Masks come from key_pos, exactly as in the
  functional state (state.py), so the two paths compute the same thing.
- Until a sequence passes R tokens its keys sit at entries [0, length): a forward attends only over the prefix
  [0, longest row + T) of its rows, so short documents do not pay for the window.
- A forward covers one contiguous range of slots (the engine keeps decoding sequences in slots [0, n)), so every
  read is a view, never a gather. Each row of a forward either commits (its GDN recurrent and conv state are
  written in place; its new keys become committed when `positions` advances) or only reads (a denoising step).
  A reading row's new keys land in its ring at positions >= its committed length: a scratch area that no
  committed query sees and that the next step of that row overwrites. A reading row's committed entries and GDN
  state are never written.
- A forward may commit only its first `commit_tokens` tokens (a finished block) and read the rest (the next block's
  first denoising step): GDN layers then run the two parts as two kernel calls and keep the state between them.
- Per-slot bytes follow from the config (`slot_bytes`), so the engine admits only as many sequences as its memory
  budget holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import CloverConfig
from .preview import PreviewPlan


@dataclass(frozen=True)
class SlotBytes:
    """Bytes one slot needs, by part."""

    gdn: int  # recurrent states (fp32) of every GDN layer
    conv: int  # conv tails of every GDN layer
    kv: int  # attention keys + values over the ring, every attention layer
    positions: int  # key positions of the ring, the committed length
    block: int  # decode working set per sequence: its block's logits (fp32) and bookkeeping

    @property
    def total(self) -> int:
        return self.gdn + self.conv + self.kv + self.positions + self.block


def ring_capacity(window: int, max_forward_tokens: int) -> int:
    """Ring entries per slot: the window plus the most tokens one forward writes (see the module docstring)."""
    return window + max_forward_tokens


def slot_bytes(config: CloverConfig, dtype: torch.dtype, *, window: int, max_forward_tokens: int) -> SlotBytes:
    """What one slot costs: GDN state + conv tail + window keys/values + the decode block."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n_gdn = sum(kind == "linear_attention" for kind in config.layer_types)
    n_attn = config.num_hidden_layers - n_gdn
    conv_channels = 2 * config.linear_key_dim + config.linear_value_dim
    R = ring_capacity(window, max_forward_tokens)
    block = config.diffusion.block_size if config.diffusion is not None else 1
    shift = 1 if config.diffusion is None or config.diffusion.logits_shift else 0  # a row of saved logits
    return SlotBytes(
        gdn=n_gdn * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4,
        conv=n_gdn * (config.linear_conv_kernel_dim - 1) * conv_channels * itemsize,
        kv=n_attn * 2 * config.num_key_value_heads * R * config.head_dim * itemsize,
        positions=R * 8 + 8,
        # a step's logits over two blocks (a merged commit) in the model dtype, one block's as fp32 probabilities,
        # plus the saved logits
        block=(block * (2 * itemsize + 8) + shift * 4) * config.vocab_size + block * 16,
    )


class SlotState:
    """Preallocated state of `num_slots` sequences; see the module docstring."""

    def __init__(self, config: CloverConfig, num_slots: int, *, window: int, max_forward_tokens: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.config, self.num_slots, self.window = config, num_slots, window
        self.capacity = ring_capacity(window, max_forward_tokens)
        S, R = num_slots, self.capacity
        conv_channels = 2 * config.linear_key_dim + config.linear_value_dim
        self.recurrent: list[torch.Tensor | None] = []  # [S, Hv, Dk, Dv] fp32 per GDN layer
        self.conv: list[torch.Tensor | None] = []  # [S, Kc-1, C]
        self.keys: list[torch.Tensor | None] = []  # [S, Hkv, R, D] per attention layer
        self.values: list[torch.Tensor | None] = []
        for kind in config.layer_types:
            gdn = kind == "linear_attention"
            self.recurrent.append(torch.zeros(S, config.linear_num_value_heads, config.linear_key_head_dim,
                                              config.linear_value_head_dim, dtype=torch.float32, device=device)
                                  if gdn else None)
            self.conv.append(torch.zeros(S, config.linear_conv_kernel_dim - 1, conv_channels, dtype=dtype,
                                         device=device) if gdn else None)
            # zeros, not empty: masked entries are still multiplied by a zero weight, and 0 * NaN garbage is NaN
            kv_shape = (S, config.num_key_value_heads, R, config.head_dim)
            self.keys.append(None if gdn else torch.zeros(kv_shape, dtype=dtype, device=device))
            self.values.append(None if gdn else torch.zeros(kv_shape, dtype=dtype, device=device))
        self.key_pos = torch.full((S, R), -1, dtype=torch.long, device=device)  # shared by the attention layers
        self.positions = torch.zeros(S, dtype=torch.long, device=device)  # committed tokens per slot

    def buffers(self) -> list[torch.Tensor]:
        """Every state tensor (to check that they are only ever written in place)."""
        layers = [t for ts in (self.recurrent, self.conv, self.keys, self.values) for t in ts if t is not None]
        return [*layers, self.key_pos, self.positions]

    def reset(self, slot: int) -> None:
        """An empty sequence in `slot`: zero GDN state, no keys, position 0."""
        for rec, conv in zip(self.recurrent, self.conv, strict=True):
            if rec is not None and conv is not None:
                rec[slot].zero_()
                conv[slot].zero_()
        self.key_pos[slot].fill_(-1)
        self.positions[slot] = 0

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the sequence of `length` committed tokens in slot `src` to slot `dst` (src is then free)."""
        used = min(length, self.capacity)  # ring entries holding committed keys
        for ts in (self.recurrent, self.conv):
            for t in ts:
                if t is not None:
                    t[dst].copy_(t[src])
        for ts in (self.keys, self.values):
            for t in ts:
                if t is not None:
                    t[dst, :, :used].copy_(t[src, :, :used])
        key_pos = self.key_pos[dst]
        key_pos.copy_(self.key_pos[src])
        key_pos.masked_fill_(key_pos >= length, -1)  # a denoising step's scratch keys were not copied
        self.positions[dst] = self.positions[src]

    def rows(self, start: int, lengths: list[int], tokens: int, commit: list[int] | None,
             commit_tokens: int | None = None) -> SlotRows:
        """The view of slots [start, start + len(lengths)) for one forward of `tokens` new tokens per row.

        lengths: each row's committed tokens (kept by the caller on the host, so no read-back is needed).
        commit: the rows (0-based within the range) whose state this forward advances; None: all of them.
        commit_tokens: how many of the new tokens the committing rows commit (default: all); the rest are read
        only (a finished block committed together with the next block's first denoising step).
        """
        return SlotRows(self, start, lengths, tokens, commit, commit_tokens)


class SlotRows:
    """Slots [start, start + B) during one forward: per-layer views that the model's layers read and write."""

    def __init__(self, state: SlotState, start: int, lengths: list[int], tokens: int,
                 commit: list[int] | None, commit_tokens: int | None = None) -> None:
        B = len(lengths)
        if B < 1 or start < 0 or start + B > state.num_slots:
            raise ValueError(f"rows [{start}, {start + B}) are outside the {state.num_slots} slots")
        if tokens > state.capacity - state.window:
            raise ValueError(f"a forward of {tokens} tokens does not fit the ring ({state.capacity} entries for "
                             f"window {state.window})")
        self.state, self.start, self.end, self.tokens = state, start, start + B, tokens
        self.lengths = list(lengths)
        self.commit_tokens = tokens if commit_tokens is None else commit_tokens
        if not 0 < self.commit_tokens <= tokens:
            raise ValueError(f"commit_tokens must be in [1, {tokens}], got {commit_tokens}")
        self.window = state.window
        self.all_commit = commit is None or len(commit) == B
        # absolute slot indices of committing rows, and their rows in this forward (None: every row commits)
        local = None if self.all_commit else sorted(commit or [])
        self.commit_local = None if local is None else torch.tensor(local, dtype=torch.long,
                                                                    device=state.positions.device)
        self.any_commit = self.all_commit or bool(local)
        self.read = min(state.capacity, max(lengths) + tokens)  # ring prefix holding every key these rows see
        self.commit_mask: torch.Tensor | None = None  # static rows: which rows commit, on the device

    @classmethod
    def static(cls, state: SlotState, start: int, rows: int, tokens: int, commit_mask: torch.Tensor,
               commit_tokens: int | None = None) -> SlotRows:
        """Rows whose shapes do not depend on their contents (a CUDA graph replays them): the whole ring is read
        (flex's block mask skips what nobody sees), and which rows commit is a device mask [rows], so the writes
        are masked copies instead of index lists. Nothing here reads back to the host."""
        self = cls(state, start, [0] * rows, tokens, None, commit_tokens)
        self.lengths = None  # unknown on the host: nothing may be decided from them
        self.read = state.capacity
        self.all_commit = False
        self.commit_mask = commit_mask
        return self

    @property
    def positions(self) -> torch.Tensor:
        return self.state.positions[self.start:self.end]  # [B] view

    def all_visible(self, attention: str, block_size: int, plan: PreviewPlan | None = None) -> bool:
        """Whether every query of this forward sees every key it reads, known from the host lengths alone: rows of
        one length L, nothing wrapped or outside the window (L + T <= ring and window), and the new tokens either
        one token (causal), one whole aligned block (block-causal sees its block), or one previewed block that no
        row commits (Clover's preview sees its whole block). Attention then needs no mask.
        """
        if self.lengths is None:
            return False
        L, T = self.lengths[0], self.tokens
        if any(n != L for n in self.lengths) or L + T > min(self.state.capacity, self.window):
            return False
        if plan is not None:
            return not plan.any_commit and plan.split == T
        return T == 1 or (attention == "block_causal" and T == block_size and L % block_size == 0)

    def preview_plan(self, coreset_size: int | None) -> PreviewPlan:
        """Clover's preview over this forward: committing rows commit their first `commit_tokens` tokens causally,
        every other token previews (preview.py)."""
        dev = self.state.positions.device
        B = self.end - self.start
        if self.commit_mask is not None:  # static rows: which rows commit is only known on the device
            return PreviewPlan(self.commit_tokens, self.tokens, self.commit_mask, any_commit=True, all_commit=False,
                               coreset_size=coreset_size)
        if not self.any_commit:
            return PreviewPlan(self.tokens, self.tokens, None, any_commit=False, all_commit=False,
                               coreset_size=coreset_size)
        if self.all_commit:
            commits = torch.ones(B, dtype=torch.bool, device=dev)
        else:
            assert self.commit_local is not None
            commits = torch.zeros(B, dtype=torch.bool, device=dev).index_fill_(0, self.commit_local, True)
        return PreviewPlan(self.commit_tokens, self.tokens, commits, any_commit=True, all_commit=self.all_commit,
                           coreset_size=coreset_size)

    def write_key_positions(self, q_pos_BT: torch.Tensor) -> None:
        """Record the new tokens' positions in the ring (shared by every attention layer)."""
        self.state.key_pos[self.start:self.end].scatter_(1, q_pos_BT % self.state.capacity, q_pos_BT)

    def layer(self, index: int) -> GDNSlots | AttentionSlots:
        if self.state.recurrent[index] is not None:
            return GDNSlots(self, index)
        return AttentionSlots(self, index)

    def commit(self) -> None:
        """Advance the committing rows' positions: their new keys become committed."""
        pos = self.positions
        if self.commit_mask is not None:
            pos.add_(self.commit_mask.long() * self.commit_tokens)
        elif self.all_commit:
            pos.add_(self.commit_tokens)
        elif self.any_commit:
            pos.index_add_(0, self.commit_local, torch.full_like(self.commit_local, self.commit_tokens))

    def write_rows(self, buffer: torch.Tensor, new: torch.Tensor) -> None:
        """Write `new` [B, ...] into buffer[start:end] for the committing rows only."""
        view = buffer[self.start:self.end]
        if self.commit_mask is not None:
            keep = self.commit_mask.view(-1, *[1] * (new.dim() - 1))
            view.copy_(torch.where(keep, new.to(view.dtype), view))
        elif self.all_commit:
            view.copy_(new)
        elif self.any_commit:
            view.index_copy_(0, self.commit_local, new.index_select(0, self.commit_local).to(view.dtype))


class GDNSlots:
    """One GDN layer's slice of the slots: initial state as views, the final state written for committing rows."""

    def __init__(self, rows: SlotRows, index: int) -> None:
        self.rows, self.index = rows, index
        # the state after this many new tokens is what committing rows keep (the rest are read only)
        self.commit_tokens = rows.commit_tokens

    @property
    def recurrent(self) -> torch.Tensor:
        return self.rows.state.recurrent[self.index][self.rows.start:self.rows.end]  # type: ignore[index]

    @property
    def conv(self) -> torch.Tensor:
        return self.rows.state.conv[self.index][self.rows.start:self.rows.end]  # type: ignore[index]

    def advanced(self, recurrent: torch.Tensor, conv: torch.Tensor) -> GDNSlots:
        self.rows.write_rows(self.rows.state.recurrent[self.index], recurrent)  # type: ignore[arg-type]
        self.rows.write_rows(self.rows.state.conv[self.index], conv)  # type: ignore[arg-type]
        return self


class AttentionSlots:
    """One attention layer's slice of the slots: new keys go into the ring, attention reads a prefix of it."""

    def __init__(self, rows: SlotRows, index: int) -> None:
        self.rows, self.index = rows, index

    def extended(self, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor,
                 q_pos_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionSlots]:
        """Write the new keys/values at their ring entries; return (keys, values, key_pos) views to attend over."""
        rows, state = self.rows, self.rows.state
        keys = state.keys[self.index][rows.start:rows.end]  # type: ignore[index]
        values = state.values[self.index][rows.start:rows.end]  # type: ignore[index]
        B, H, T, D = k_BHTD.shape
        entry = (q_pos_BT % state.capacity)[:, None, :, None].expand(B, H, T, D)
        keys.scatter_(2, entry, k_BHTD.to(keys.dtype))
        values.scatter_(2, entry, v_BHTD.to(values.dtype))
        n = rows.read
        return keys[:, :, :n], values[:, :, :n], state.key_pos[rows.start:rows.end, :n], self
