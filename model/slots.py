"""Slot state: the engine's per-sequence state in preallocated tensors, written in place; keys and values in pages.

Shapes: S slots, Hv GDN value heads, Dk/Dv GDN head dims, C conv channels, Kc conv kernel, Hkv attention KV heads,
D head dim, P pages of `page_size` (ps) positions, N = (P + 1) * ps pool entries, M page-table columns, B rows of one
forward (a contiguous range of slots), T new tokens per row, K keys a row reads.

Notable choices:
- GDN recurrent and conv state are fixed-size: one row per slot, written in place. Attention keys and values live in
  one pool of pages per attention layer ([N, Hkv, D], token-major), handed out by the page manager
  (pages.PageManager, which SlotState holds): a slot holds only the pages its sequence needs now, so a 2K-token
  document costs 2K positions of keys whatever the window. A slot's device page table [S, M] maps logical page lp
  to its physical page at column lp % M (M pages cover the window plus the longest forward); the host tables of
  pages.py are the truth and the device table mirrors them.
- The scheduler grows a slot's pages before a forward writes past them (`grow`: may raise PoolExhausted, taking
  nothing), slides them after a commit (`slide`: pages the window has passed go back) and releases them when the
  sequence leaves. A page is zeroed when it is taken, so untouched pool memory is never written: it costs address
  space, not RAM.
- A forward writes its new keys first (every layer at the same pool entries, `write_index`), then each row reads
  its live keys, the positions [max(0, L - window + 1), L + T) of a row of L committed tokens, as whole pages
  (`page_reads`): rows are grouped by how many pages that span, and each group copies its rows' pages into one
  buffer for one attention call, so a short row is not padded to the longest. The entry-by-entry gather
  ([B, K], every row left-padded with a zeroed null page to the longest; `index`) is the reference beside it, and
  the path of static rows. No row reads another's pages; key positions come with the keys (-1 = an entry outside
  the row's span), and masks are built from positions exactly as in the functional state (state.py), so the paths
  compute the same thing. `pool_pos` records the position of every pool entry, for a block mask over the pool
  itself (flex on CUDA).
- A forward covers one contiguous range of slots (the engine keeps decoding sequences in slots [0, n)). Each row
  either commits (its GDN state is written; its new keys become committed when `positions` advances) or only reads
  (a denoising step): a reading row's new keys land at positions >= its committed length, in pages it holds, which
  no committed query sees and which its next step overwrites. A forward may commit only its first `commit_tokens`
  tokens (a finished block) and read the rest (the next block's first denoising step).
- A packed forward (`packed`) runs several sequences' prefill chunks of different lengths as one token axis:
  `Packing` gives the layers each token's row and the sequence boundaries (cu_seqlens), GDN layers run their
  kernels per sequence over the packed tokens, attention unpacks queries per row.
- Per-slot bytes and per-page bytes follow from the config (`slot_bytes`), so the engine sizes the pool from its
  memory budget and admits sequences by the pages they need.

Why one file of about 520 lines, and SlotRows over 200: SlotState (the state at rest) and SlotRows (one forward's
view of it: which rows commit, where new keys go, which keys each row reads by whole pages or entry by entry, and
the static variant CUDA graphs replay) are two sides of one layout; apart, each would import the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .config import CloverConfig
from .pages import PageManager, pages_for
from .preview import PreviewPlan
from .state import KeyRead, PagedKeys


@dataclass(frozen=True)
class SlotBytes:
    """Bytes of one slot (fixed, whatever its sequence's length) and of one page of keys and values."""

    gdn: int  # recurrent states (fp32) of every GDN layer
    conv: int  # conv tails of every GDN layer
    block: int  # decode working set per sequence: its block's logits (fp32), counts, bookkeeping
    table: int  # its page-table row and committed length
    page: int  # one page: keys + values of page_size positions in every attention layer, and their positions
    page_size: int

    @property
    def fixed(self) -> int:
        return self.gdn + self.conv + self.block + self.table

    def sequence(self, tokens: int, window: int, max_forward_tokens: int) -> int:
        """What a sequence of `tokens` committed tokens holds: its slot and the pages of its live keys (at most
        the window and one forward, over page boundaries)."""
        live = min(tokens, window - 1) + max_forward_tokens
        return self.fixed + (pages_for(0, live, self.page_size) + 1) * self.page


def table_columns(window: int, max_forward_tokens: int, page_size: int) -> int:
    """Page-table columns M: the most logical pages a sequence holds at once: the window's keys before its next
    query and one forward's worth after it (`max_forward_tokens`, lookahead included), over page boundaries."""
    return pages_for(0, window - 1 + max_forward_tokens, page_size) + 1


def slot_bytes(config: CloverConfig, dtype: torch.dtype, *, window: int, max_forward_tokens: int,
               page_size: int) -> SlotBytes:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n_gdn = sum(kind == "linear_attention" for kind in config.layer_types)
    n_attn = config.num_hidden_layers - n_gdn
    conv_channels = 2 * config.linear_key_dim + config.linear_value_dim
    block = config.diffusion.block_size if config.diffusion is not None else 1
    return SlotBytes(
        gdn=n_gdn * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4,
        conv=n_gdn * (config.linear_conv_kernel_dim - 1) * conv_channels * itemsize,
        # a step's logits over two blocks (a merged commit) in the model dtype, one block's as fp32 probabilities,
        # the saved logits and the penalty counts (fp32)
        block=(block * (2 * itemsize + 8) + 8) * config.vocab_size + block * 16,
        table=table_columns(window, max_forward_tokens, page_size) * 8 + 8,
        page=page_size * (n_attn * 2 * config.num_key_value_heads * config.head_dim * itemsize + 8),
        page_size=page_size,
    )


@dataclass
class PageRead:
    """One group of a forward's rows that read their keys page by page (SlotRows.page_reads)."""

    rows: torch.Tensor | None  # [b] the rows (sequences of a packed forward); None: every row, in order
    pages: torch.Tensor  # [b * P] physical pages, row by row in position order (the null page past a row's end)
    count: int  # b
    width: int  # P pages per row
    key_pos: torch.Tensor  # [b, K] the position of each read entry, -1 = not the row's (K = P * ps, or exact)
    span: slice  # the entries of the P * ps read that are kept

    @property
    def exact(self) -> bool:
        """Every kept entry is a live key of its row (the group's rows share one span within their pages)."""
        return self.span != slice(None)


@dataclass
class Packing:
    """How a packed forward's T tokens (one row of input) belong to its n sequences."""

    rows: int  # n sequences (slots start.. start + n)
    lengths: list[int]  # tokens of each sequence in this forward
    cu_seqlens: torch.Tensor  # [n + 1] int64 boundaries along the token axis
    row_of_token: torch.Tensor  # [T] which sequence each token belongs to
    unpack: torch.Tensor  # [n, Tmax] the packed index of each sequence's t-th token (its last one for padding)
    repack: torch.Tensor  # [T] index into the unpacked [n * Tmax] of each packed token

    @property
    def longest(self) -> int:
        return max(self.lengths)


class SlotState:
    """Preallocated state of `num_slots` sequences over a pool of `num_pages` pages; see the module docstring."""

    def __init__(self, config: CloverConfig, num_slots: int, *, window: int, max_forward_tokens: int,
                 num_pages: int, page_size: int, lookahead_tokens: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        """max_forward_tokens: the most new tokens one forward writes per row; lookahead_tokens: pages a row may
        hold past a forward's end (the engine takes a decode step's pages with a prefill's last chunk)."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.config, self.num_slots, self.window = config, num_slots, window
        self.max_forward_tokens, self.page_size = max_forward_tokens, page_size
        self.columns = table_columns(window, max_forward_tokens + lookahead_tokens, page_size)
        S, N = num_slots, (num_pages + 1) * page_size
        conv_channels = 2 * config.linear_key_dim + config.linear_value_dim
        self.recurrent: list[torch.Tensor | None] = []  # [S, Hv, Dk, Dv] fp32 per GDN layer
        self.conv: list[torch.Tensor | None] = []  # [S, Kc-1, C]
        self.keys: list[torch.Tensor | None] = []  # [N, Hkv, D] per attention layer
        self.values: list[torch.Tensor | None] = []
        for kind in config.layer_types:
            gdn = kind == "linear_attention"
            self.recurrent.append(torch.zeros(S, config.linear_num_value_heads, config.linear_key_head_dim,
                                              config.linear_value_head_dim, dtype=torch.float32, device=device)
                                  if gdn else None)
            self.conv.append(torch.zeros(S, config.linear_conv_kernel_dim - 1, conv_channels, dtype=dtype,
                                         device=device) if gdn else None)
            kv_shape = (N, config.num_key_value_heads, config.head_dim)
            # empty: a page is zeroed when it is taken, so pool memory nobody uses is never touched
            self.keys.append(None if gdn else torch.empty(kv_shape, dtype=dtype, device=device))
            self.values.append(None if gdn else torch.empty(kv_shape, dtype=dtype, device=device))
        kv = [t for t in (*self.keys, *self.values) if t is not None]
        self.pages = PageManager(S, num_pages, page_size, self.columns, kv, device)
        self.pool, self.null = self.pages.pool, self.pages.null
        self.pool_pos, self.table = self.pages.pool_pos, self.pages.table  # the page manager's device tables
        for t in kv:
            t[self.null:].zero_()
        self.positions = torch.zeros(S, dtype=torch.long, device=device)  # committed tokens per slot
        # dense attention reads whole pages per group of rows (SlotRows.page_reads); False: entry by entry, the
        # reference (tests compare the two)
        self.read_pages = True

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def buffers(self) -> list[torch.Tensor]:
        """Every state tensor (to check that they are only ever written in place)."""
        layers = [t for ts in (self.recurrent, self.conv, self.keys, self.values) for t in ts if t is not None]
        return [*layers, self.pool_pos, self.table, self.positions]

    # ---- pages (the page manager's) -------------------------------------------------------------------------
    def grow(self, slot: int, end_position: int) -> int:
        return self.pages.grow(slot, end_position)

    def slide(self, slot: int, first_position: int) -> int:
        return self.pages.slide(slot, first_position)

    def release(self, slot: int) -> None:
        self.pages.release(slot)

    def pages_needed(self, slot: int, end_position: int) -> int:
        return self.pages.needed(slot, end_position)

    # ---- slots --------------------------------------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        """An empty sequence in `slot`: zero GDN state, no pages, position 0."""
        for rec, conv in zip(self.recurrent, self.conv, strict=True):
            if rec is not None and conv is not None:
                rec[slot].zero_()
                conv[slot].zero_()
        self.release(slot)
        self.positions[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """The sequence in slot `src` moves to the free slot `dst`: its GDN state is copied, its pages change hands
        (keys and values stay where they are)."""
        for ts in (self.recurrent, self.conv):
            for t in ts:
                if t is not None:
                    t[dst].copy_(t[src])
        self.pages.move(src, dst)
        self.positions[dst] = self.positions[src]

    def swap(self, a: int, b: int) -> None:
        """The sequences of slots a and b exchange places (GDN state copied, pages change hands)."""
        for ts in (self.recurrent, self.conv):
            for t in ts:
                if t is not None:
                    t[[a, b]] = t[[b, a]]
        self.positions[[a, b]] = self.positions[[b, a]]
        self.pages.swap(a, b)

    def rows(self, start: int, lengths: list[int], tokens: int, commit: list[int] | None,
             commit_tokens: int | None = None) -> SlotRows:
        """The view of slots [start, start + len(lengths)) for one forward of `tokens` new tokens per row.

        lengths: each row's committed tokens (kept by the caller on the host, so no read-back is needed).
        commit: the rows (0-based within the range) whose state this forward advances; None: all of them.
        commit_tokens: how many of the new tokens the committing rows commit (default: all); the rest are read
        only (a finished block committed together with the next block's first denoising step).
        """
        return SlotRows(self, start, lengths, tokens, commit, commit_tokens)

    def packed(self, start: int, lengths: list[int], tokens: list[int]) -> SlotRows:
        """A packed forward: slots [start, start + n) each commit their own number of new tokens (prefill chunks
        of different lengths), all on one token axis."""
        return SlotRows.packed(self, start, lengths, tokens)


class SlotRows:
    """Slots [start, start + B) during one forward: per-layer views that the model's layers read and write."""

    def __init__(self, state: SlotState, start: int, lengths: list[int], tokens: int,
                 commit: list[int] | None, commit_tokens: int | None = None) -> None:
        B = len(lengths)
        if B < 1 or start < 0 or start + B > state.num_slots:
            raise ValueError(f"rows [{start}, {start + B}) are outside the {state.num_slots} slots")
        if tokens > state.max_forward_tokens:
            raise ValueError(f"a forward of {tokens} tokens is longer than the slots allow "
                             f"({state.max_forward_tokens})")
        self.state, self.start, self.end, self.tokens = state, start, start + B, tokens
        self.lengths: list[int] | None = list(lengths)
        self.commit_tokens = tokens if commit_tokens is None else commit_tokens
        if not 0 < self.commit_tokens <= tokens:
            raise ValueError(f"commit_tokens must be in [1, {tokens}], got {commit_tokens}")
        self.window = state.window
        self.all_commit = commit is None or len(commit) == B
        # absolute slot indices of committing rows, and their rows in this forward (None: every row commits)
        local = None if self.all_commit else sorted(commit or [])
        self.commit_local = None if local is None else torch.tensor(local, dtype=torch.long, device=state.device)
        self.any_commit = self.all_commit or bool(local)
        self.commit_mask: torch.Tensor | None = None  # static rows: which rows commit, on the device
        self.packing: Packing | None = None
        # flex (CUDA by default): attention reads the pool itself through a block mask from the page tables;
        # otherwise each row's live keys are gathered (the dense reference, CPU)
        self.paged = kernels.flex_for(state.positions)
        # keys each row reads: its last min(L, window - 1) committed keys and the new ones, the longest row's count
        self.reads = max(min(n, self.window - 1) for n in lengths) + tokens
        self._index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._write: torch.Tensor | None = None
        self._pages: list[PageRead] | None = None

    @classmethod
    def static(cls, state: SlotState, start: int, rows: int, tokens: int, commit_mask: torch.Tensor,
               commit_tokens: int | None = None) -> SlotRows:
        """Rows whose shapes do not depend on their contents (a CUDA graph replays them): each row reads a whole
        window of keys (padding masked), and which rows commit is a device mask [rows], so the writes are masked
        copies instead of index lists. Nothing here reads back to the host."""
        self = cls(state, start, [0] * rows, tokens, None, commit_tokens)
        self.lengths = None  # unknown on the host: nothing may be decided from them
        self.reads = state.window - 1 + tokens
        self.all_commit = False
        self.commit_mask = commit_mask
        return self

    @classmethod
    def packed(cls, state: SlotState, start: int, lengths: list[int], tokens: list[int]) -> SlotRows:
        n = len(lengths)
        if len(tokens) != n or min(tokens) < 1:
            raise ValueError("a packed forward needs one positive token count per row")
        self = cls(state, start, lengths, max(tokens), None)
        dev = state.device
        self._new = torch.tensor(tokens, dtype=torch.long, device=dev)
        counts = torch.tensor(tokens, dtype=torch.long)
        cu = torch.zeros(n + 1, dtype=torch.long)
        cu[1:] = counts.cumsum(0)
        T, Tmax = int(cu[-1]), max(tokens)
        row_of_token = torch.repeat_interleave(torch.arange(n), counts)
        t_in_row = torch.arange(T) - cu[row_of_token]
        unpack = (cu[:-1, None] + torch.arange(Tmax)[None, :]).minimum(cu[1:, None] - 1)
        repack = row_of_token * Tmax + t_in_row
        self.packing = Packing(n, list(tokens), cu.to(dev), row_of_token.to(dev), unpack.to(dev), repack.to(dev))
        self.reads = max(min(L, self.window - 1) + t for L, t in zip(lengths, tokens, strict=True))
        self._t_in_row = t_in_row.to(dev)
        return self

    @property
    def positions(self) -> torch.Tensor:
        return self.state.positions[self.start:self.end]  # [B] view

    def query_positions(self) -> torch.Tensor:
        """Absolute positions of the new tokens: [B, T] (packed: [1, T])."""
        if self.packing is not None:
            return (self.positions[self.packing.row_of_token] + self._t_in_row)[None]
        return self.positions[:, None] + torch.arange(self.tokens, device=self.state.device)

    def all_visible(self, attention: str, block_size: int, plan: PreviewPlan | None = None) -> bool:
        """Whether every query of this forward sees every key it reads, known from the host lengths alone: rows of
        one length L inside the window (L + T <= window), and the new tokens either one token (causal), one whole
        aligned block (block-causal sees its block), or one previewed block that no row commits (Clover's preview
        sees its whole block). Attention then needs no mask.
        """
        if self.lengths is None or self.packing is not None:
            return False
        L, T = self.lengths[0], self.tokens
        if any(n != L for n in self.lengths) or L + T > self.window:
            return False
        if plan is not None:
            return not plan.any_commit and plan.split == T
        return T == 1 or (attention == "block_causal" and T == block_size and L % block_size == 0)

    def preview_plan(self, coreset_size: int | None) -> PreviewPlan:
        """Clover's preview over this forward: committing rows commit their first `commit_tokens` tokens causally,
        every other token previews (preview.py)."""
        dev = self.state.device
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

    def _entries(self, q_pos: torch.Tensor) -> torch.Tensor:
        """Pool entries of absolute positions q_pos of this forward's rows (same shape as q_pos)."""
        st, ps = self.state, self.state.page_size
        table = st.table[self.start:self.end]
        rows = (self.packing.row_of_token[None] if self.packing is not None
                else torch.arange(q_pos.shape[0], device=st.device)[:, None].expand_as(q_pos))
        page = table[rows, torch.div(q_pos, ps, rounding_mode="floor") % st.columns]
        # a page nobody mapped (a padding row of a static step writing past its pages) is the null page's
        page = torch.where(page >= 0, page, st.pool.num_pages)
        return page * ps + q_pos % ps

    def write_index(self) -> torch.Tensor:
        """[B, T] or [1, T]: the new tokens' pool entries (built once per forward, shared by every layer)."""
        if self._write is None:
            self._write = self._entries(self.query_positions())
        return self._write

    def index(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(write [B, T] or [1, T]: the new tokens' pool entries; read [B, K]: the entries each row reads, padding
        on the null page; key_pos [B, K]: their positions, -1 = padding; read and key_pos None on the paged path).
        Built once per forward on the device, shared by every attention layer. The entry-by-entry gather: the
        reference for `page_reads`, and the path of static rows (whose lengths the host does not know)."""
        if self._index is None:
            st, K = self.state, self.reads
            write = self.write_index()
            if self.paged:
                self._index = (write, None, None)
                return self._index
            # each row reads positions (last - K, last]: its last new token and the keys before it
            last = self.positions + (self._new if self.packing is not None else self.tokens) - 1  # [B]
            pos = last[:, None] - (K - 1) + torch.arange(K, device=st.device)  # [B, K]
            first = (self.positions - self.window + 1).clamp(min=0)  # the earliest query's window start
            live = pos >= first[:, None]
            rows = torch.arange(pos.shape[0], device=st.device)[:, None].expand_as(pos)
            page = st.table[self.start:self.end][rows, torch.div(pos.clamp(min=0), st.page_size,
                                                                 rounding_mode="floor") % st.columns]
            read = torch.where(live & (page >= 0), page * st.page_size + pos.clamp(min=0) % st.page_size, st.null)
            self._index = (write, read, torch.where(live, pos, -1))
        return self._index

    @property
    def reads_pages(self) -> bool:
        """Whether attention layers read whole pages per group of rows (`page_reads`), else entry by entry."""
        return not self.paged and self.lengths is not None and self.state.read_pages

    def page_reads(self) -> list[PageRead]:
        """What each group of rows reads, page by page: rows are grouped by how many pages their live keys span
        (1, 2, 3-4, 5-8, ...: a group pads its rows to at most twice what each needs), and each group reads its
        rows' pages [b, P] whole (the null page past a row's last one). A row of L committed tokens and T new ones
        reads positions [max(0, L - window + 1), L + T); the other entries of its pages get key_pos -1. When every
        row of a group starts at the same offset in its first page and reads as many keys, the group reads exactly
        those entries (no padding: the layers may then skip the mask). Built once per forward, on the host from
        the rows' lengths, shared by every attention layer."""
        if self._pages is None:
            assert self.lengths is not None
            st, ps, dev = self.state, self.state.page_size, self.state.device
            B = self.end - self.start
            tokens = self.packing.lengths if self.packing is not None else [self.tokens] * B
            spans = [(max(0, L - self.window + 1), L + t - 1) for L, t in zip(self.lengths, tokens, strict=True)]
            buckets: dict[int, list[int]] = {}
            for i, (first, last) in enumerate(spans):
                buckets.setdefault((last // ps - first // ps).bit_length(), []).append(i)
            table = st.table[self.start:self.end]
            groups = []
            for members in buckets.values():
                firsts, lasts = [spans[i][0] for i in members], [spans[i][1] for i in members]
                P = max(b // ps - a // ps + 1 for a, b in zip(firsts, lasts, strict=True))
                info = torch.tensor([[a // ps for a in firsts], firsts, lasts], dtype=torch.long).to(dev)
                rows = None if len(members) == B else torch.tensor(members, dtype=torch.long, device=dev)
                logical = info[0][:, None] + torch.arange(P, device=dev)  # [b, P]
                page = (table if rows is None else table[rows]).gather(1, logical % st.columns)
                page = torch.where((logical <= (info[2] // ps)[:, None]) & (page >= 0), page, st.pool.num_pages)
                pos = (logical[:, :, None] * ps + torch.arange(ps, device=dev)).flatten(1)  # [b, P * ps]
                key_pos = torch.where((pos >= info[1][:, None]) & (pos <= info[2][:, None]), pos, -1)
                offsets, counts = {a % ps for a in firsts}, {b - a + 1 for a, b in zip(firsts, lasts, strict=True)}
                span = slice(None)
                if len(offsets) == 1 and len(counts) == 1:  # every row's keys at the same place: read just those
                    (offset,), (count,) = offsets, counts
                    span = slice(offset, offset + count)
                groups.append(PageRead(rows, page.reshape(-1), len(members), P, key_pos[:, span], span))
            self._pages = groups
        return self._pages

    def write_key_positions(self, q_pos_BT: torch.Tensor) -> None:
        """Record the new tokens' positions in the pool (shared by every attention layer)."""
        write = self.write_index()
        self.state.pool_pos.index_copy_(0, write.reshape(-1), q_pos_BT.reshape(-1))

    def layer(self, index: int) -> GDNSlots | AttentionSlots:
        if self.state.recurrent[index] is not None:
            return GDNSlots(self, index)
        return AttentionSlots(self, index)

    def commit(self) -> None:
        """Advance the committing rows' positions: their new keys become committed."""
        pos = self.positions
        if self.packing is not None:
            pos.add_(self._new)
        elif self.commit_mask is not None:
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
        self.commit_tokens = rows.commit_tokens if rows.packing is None else None

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
    """One attention layer's slice of the slots: new keys go into the pool, each row gathers the keys it reads."""

    def __init__(self, rows: SlotRows, index: int) -> None:
        self.rows, self.index = rows, index

    def extended(self, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, q_pos_BT: torch.Tensor
                 ) -> tuple[list[KeyRead], AttentionSlots]:
        """Write the new keys/values at their pool entries; return what the rows read (packed forwards: a row is a
        sequence): per group of rows, their pages' keys and values [b, Hkv, K, D] with key positions [b, K]
        (`page_reads`); or every row's gathered entries (the reference, `index`); or on the paged path the pool
        itself ([N, Hkv, D]) and the tables that say whose entries are whose (PagedKeys)."""
        keys = self.rows.state.keys[self.index]
        values = self.rows.state.values[self.index]
        assert keys is not None and values is not None
        flat = self.rows.write_index().reshape(-1)
        keys.index_copy_(0, flat, k_BHTD.transpose(1, 2).reshape(flat.shape[0], *keys.shape[1:]).to(keys.dtype))
        values.index_copy_(0, flat, v_BHTD.transpose(1, 2).reshape(flat.shape[0], *values.shape[1:])
                           .to(values.dtype))
        st = self.rows.state
        if self.rows.reads_pages:  # whole pages per group of rows (page-sized contiguous copies)
            page_shape = (st.page_size, *keys.shape[1:])

            def pages(pool: torch.Tensor, g: PageRead) -> torch.Tensor:
                got = pool.view(-1, *page_shape).index_select(0, g.pages)  # [b * P, ps, Hkv, D]
                return got.view(g.count, g.width * st.page_size, *page_shape[1:])[:, g.span].transpose(1, 2)

            return [KeyRead(g.rows, pages(keys, g), pages(values, g), g.key_pos, g.exact)
                    for g in self.rows.page_reads()], self
        _, read, key_pos = self.rows.index()
        if read is None:
            return [KeyRead(None, keys, values, PagedKeys(st.table[self.rows.start:self.rows.end], st.pool_pos,
                                                           st.page_size))], self
        assert key_pos is not None
        return [KeyRead(None, keys[read].transpose(1, 2), values[read].transpose(1, 2), key_pos)], self
