"""Pages of attention keys and values: the allocator, each sequence's page table, and the page manager that mirrors
them on the device.

A page holds the keys and values of `page_size` consecutive positions of one sequence (every attention layer has
its own tensors; they share the page numbers). A sequence's logical page `lp` holds positions
[lp * page_size, (lp + 1) * page_size); its table maps the logical pages it still needs to physical pages. The
engine asks for pages before a forward writes past what its sequence holds (`grow`), gives back the pages a sliding
window has passed (`slide`) and all of them when the sequence leaves (`release`). `PagePool` is the host-side
bookkeeping and touches no tensor; `PageManager` owns a pool and its device side: the page table [S, M] that
attention reads (logical page lp of a slot at column lp % M), the position held by every pool entry, and the
zeroing of a page when it is taken (attention multiplies masked entries by zero weights, and 0 * NaN garbage is
NaN). slots.SlotState holds one.

Invariants (tests/test_pages.py):
- a physical page is either free or held by exactly one sequence, never both, never two;
- a sequence's live logical pages are contiguous: [first, first + len(pages));
- `free_pages + sum(held by every sequence) == num_pages` at all times;
- an allocation that cannot be met in full takes nothing (PoolExhausted), so a failed step leaves every table as it
  was and the engine can preempt and retry.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


class PoolExhausted(Exception):
    """Fewer free pages than an allocation needs; nothing was taken."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"{needed} pages needed, {free} free")
        self.needed, self.free = needed, free


def pages_for(first_position: int, end_position: int, page_size: int) -> int:
    """Logical pages covering positions [first_position, end_position)."""
    if end_position <= first_position:
        return 0
    return (end_position - 1) // page_size - first_position // page_size + 1


@dataclass
class PageTable:
    """One sequence's live pages: logical pages [first, first + len(pages)) -> physical page ids."""

    first: int = 0  # logical index of the first live page
    pages: deque[int] = field(default_factory=deque)

    @property
    def end(self) -> int:
        """Logical index one past the last live page."""
        return self.first + len(self.pages)

    def physical(self, logical: int) -> int:
        if not self.first <= logical < self.end:
            raise KeyError(f"logical page {logical} is not live (live: [{self.first}, {self.end}))")
        return self.pages[logical - self.first]


class PagePool:
    """`num_pages` physical pages of `page_size` positions, handed out to sequences (keys: any hashable id)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a pool needs num_pages >= 1 and page_size >= 1, got {num_pages} and {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: recently freed pages are reused first
        self.tables: dict[object, PageTable] = {}
        self.peak_used = 0

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def table(self, seq: object) -> PageTable:
        return self.tables.setdefault(seq, PageTable())

    def needed(self, seq: object, end_position: int) -> int:
        """Pages `seq` must still take for positions up to `end_position` (exclusive)."""
        t = self.tables.get(seq)
        end = (end_position + self.page_size - 1) // self.page_size
        return max(0, end - (t.end if t is not None else 0))

    def grow(self, seq: object, end_position: int) -> list[tuple[int, int]]:
        """Take pages so `seq` holds every position < end_position from its first live page on; returns the new
        (logical, physical) pairs. Raises PoolExhausted (taking nothing) when too few pages are free."""
        n = self.needed(seq, end_position)
        if n > len(self._free):
            raise PoolExhausted(n, len(self._free))
        t = self.table(seq)
        added = []
        for _ in range(n):
            page = self._free.pop()
            added.append((t.end, page))
            t.pages.append(page)
        self.peak_used = max(self.peak_used, self.used_pages)
        return added

    def slide(self, seq: object, first_position: int) -> list[tuple[int, int]]:
        """Give back the pages wholly before `first_position` (a window's start); returns the (logical, physical)
        pairs given back."""
        t = self.tables.get(seq)
        if t is None:
            return []
        gone = []
        while t.pages and (t.first + 1) * self.page_size <= first_position:
            page = t.pages.popleft()
            gone.append((t.first, page))
            self._free.append(page)
            t.first += 1
        if not t.pages:  # an empty table starts where the next page will be
            t.first = max(t.first, first_position // self.page_size)
        return gone

    def release(self, seq: object) -> list[tuple[int, int]]:
        """Give back every page of `seq` and forget it."""
        t = self.tables.pop(seq, None)
        if t is None:
            return []
        gone = [(t.first + i, page) for i, page in enumerate(t.pages)]
        self._free.extend(page for _, page in reversed(gone))
        return gone

    def rename(self, old: object, new: object) -> None:
        """The sequence `old` is now known as `new` (a slot moved); `new` must hold nothing."""
        if new in self.tables:
            raise ValueError(f"{new!r} already holds pages")
        if old in self.tables:
            self.tables[new] = self.tables.pop(old)

    def swap(self, a: object, b: object) -> None:
        """Sequences `a` and `b` exchange their pages (two slots exchanged places)."""
        ta, tb = self.tables.pop(a, None), self.tables.pop(b, None)
        if ta is not None:
            self.tables[b] = ta
        if tb is not None:
            self.tables[a] = tb

    def check(self) -> None:
        """Assert the invariants of the module docstring (tests)."""
        held = [p for t in self.tables.values() for p in t.pages]
        assert len(held) == len(set(held)), "a page is held twice"
        assert not set(held) & set(self._free), "a held page is also free"
        assert len(held) + len(self._free) == self.num_pages, "pages lost or made up"
        assert len(set(self._free)) == len(self._free), "a page is free twice"


class PageManager:
    """A pool of pages for `num_slots` sequences and its device mirror: page tables, entry positions, zeroing."""

    def __init__(self, num_slots: int, num_pages: int, page_size: int, columns: int, kv: list[torch.Tensor],
                 device: torch.device | str) -> None:
        """columns: page-table columns M per slot; kv: every attention layer's key and value pools, [N, ...] with
        N = (num_pages + 1) * page_size (the last page is the null page, never handed out)."""
        self.pool = PagePool(num_pages, page_size)
        self.page_size, self.columns, self.kv = page_size, columns, kv
        self.null = num_pages * page_size  # the first entry of the zeroed null page (padding of gathers)
        N = (num_pages + 1) * page_size
        self.pool_pos = torch.full((N,), -1, dtype=torch.long, device=device)  # position held by each entry
        self.table = torch.full((num_slots, columns), -1, dtype=torch.long, device=device)  # physical page per column

    def grow(self, slot: int, end_position: int) -> int:
        """Make `slot` hold pages for every position < end_position (from its window's start); returns the pages
        taken. Raises PoolExhausted, taking nothing, when the pool cannot."""
        added = self.pool.grow(slot, end_position)
        held = self.pool.tables[slot]
        if len(held.pages) > self.columns:  # the engine keeps a row's live span within window + forward
            raise AssertionError(f"slot {slot} holds {len(held.pages)} pages, more than its table's "
                                 f"{self.columns} columns")
        if added:
            ps, dev = self.page_size, self.table.device
            cols = torch.tensor([lp % self.columns for lp, _ in added], dtype=torch.long)
            pages = torch.tensor([page for _, page in added], dtype=torch.long)
            self.table[slot].index_copy_(0, cols.to(dev), pages.to(dev))
            for page in pages.tolist():
                for t in self.kv:
                    t[page * ps:(page + 1) * ps].zero_()
                self.pool_pos[page * ps:(page + 1) * ps].fill_(-1)
        return len(added)

    def slide(self, slot: int, first_position: int) -> int:
        """Give back the pages of `slot` wholly before `first_position`; returns how many."""
        gone = self.pool.slide(slot, first_position)
        self._unmap(slot, gone)
        return len(gone)

    def release(self, slot: int) -> None:
        """Give back every page of `slot`."""
        self._unmap(slot, self.pool.release(slot))

    def _unmap(self, slot: int, gone: list[tuple[int, int]]) -> None:
        if gone:
            cols = torch.tensor([lp % self.columns for lp, _ in gone], dtype=torch.long, device=self.table.device)
            self.table[slot].index_fill_(0, cols, -1)

    def needed(self, slot: int, end_position: int) -> int:
        return self.pool.needed(slot, end_position)

    def move(self, src: int, dst: int) -> None:
        """The pages of slot `src` become the free slot `dst`'s (keys and values stay where they are)."""
        self.release(dst)
        self.pool.rename(src, dst)
        self.table[dst].copy_(self.table[src])
        self.table[src].fill_(-1)

    def swap(self, a: int, b: int) -> None:
        self.table[[a, b]] = self.table[[b, a]]
        self.pool.swap(a, b)
