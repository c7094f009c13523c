"""The scheduler: who runs. It owns the request queues, admission, the page budget's decisions and preemption, and
where each sequence's slot is; it plans each step and never touches a tensor but through the runner.

    waiting (deque, arrival order)  ->  prefilling (slots after the decoding ones)  ->  decoding (slots [0, n))
    schedule() -> Plan("prefill", chunks) | Plan("decode") | Plan("idle")

Notable choices:
- Admission: a waiting request takes a free slot when the pool has the pages its first prefill chunk and first
  decode step need, plus a reserve (`RESERVE_FRACTION` of the pool, at least one page) for the sequences already
  running, unless nothing is running (vLLM's watermark).
- Pages are taken before every forward for what it will write (`grow`); when the pool runs dry, the newest
  sequence (the last admitted) is preempted: its slot and pages are given back and it is queued again at its
  original place, to be recomputed from its prompt later (as vLLM's recompute preemption; its output is the one
  it gets alone, since its generation restarts whole).
- Decoding sequences occupy slots [0, n), so a decode step reads and writes views: when one finishes, the last one
  is moved into its slot (its GDN state is copied, its pages change hands). Prefilling sequences sit in the slots
  after them, contiguous, and join the decoding range when their prompt is in.
- Prefill is packed (vLLM's varlen prefill): a prefill step takes chunks of every prefilling request, first come
  first served, each at most `chunk` tokens, up to `prefill_budget` tokens in all.
- Policy: with sequences decoding, a prefill step follows every `decode_steps_per_prefill` decode steps, so long
  prompts prefill in chunks while the others keep decoding; with none decoding, prefill runs back to back.
  0 means prefill whenever there is prefill work (fill the slots first). bench/engine.py measures the choices.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .pages import PoolExhausted, pages_for
from .runner import Runner
from .sequences import EngineStats, Request, Sequence

log = logging.getLogger(__name__)

RESERVE_FRACTION = 0.01  # of the pool kept free at admission for the running sequences' growth (vLLM's watermark)


@dataclass
class Plan:
    kind: str  # "prefill": run `chunks` as one packed forward; "decode": a decode step over `decoding`; "idle"
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, prompt tokens), in slot order


class Scheduler:
    """Request queues, slots, pages and preemption; see the module docstring."""

    def __init__(self, runner: Runner | None, *, num_slots: int, num_pages: int, chunk: int, prefill_budget: int,
                 decode_steps_per_prefill: int, lookahead: int, window: int, page_size: int, stats: EngineStats,
                 new_sequence: Callable[[Request, int], Sequence]) -> None:
        self.runner, self.num_slots, self.num_pages, self.stats = runner, num_slots, num_pages, stats
        self.chunk, self.prefill_budget, self.decode_steps_per_prefill = chunk, prefill_budget, decode_steps_per_prefill
        self.lookahead, self.window, self.page_size = lookahead, window, page_size
        self.new_sequence = new_sequence
        self.reserve = max(1, math.ceil(num_pages * RESERVE_FRACTION))
        self.waiting: deque[Sequence] = deque()
        self.slots = Placement(runner, stats)
        self.live: dict[str, Sequence] = {}
        self.order = 0
        self.decodes_since_prefill = 0

    @property
    def decoding(self) -> list[Sequence]:
        return self.slots.decoding

    @property
    def prefilling(self) -> list[Sequence]:
        return self.slots.prefilling

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    @property
    def active(self) -> int:
        """Sequences holding a slot (prefilling or decoding)."""
        return len(self.decoding) + len(self.prefilling)

    # ---- requests ---------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.id in self.live:
            raise ValueError(f"request {request.id!r} is already in flight")
        self.order += 1
        seq = self.new_sequence(request, self.order)
        self.live[request.id] = seq
        self.waiting.append(seq)

    def cancel(self, request_id: str) -> bool:
        seq = self.live.pop(request_id, None)
        if seq is None:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
            self.slots.free(seq)
        else:
            self.slots.release([seq])
        return True

    def restart(self) -> None:
        """Every request in flight back to the queue from its start, in arrival order; every slot freed."""
        seqs = sorted(self.live.values(), key=lambda s: s.order)
        for seq in [*self.decoding, *self.prefilling]:
            self.slots.free(seq)
        self.slots.prefilling, self.slots.decoding = [], []
        self.waiting = deque(self.new_sequence(s.req, s.order) for s in seqs)
        self.live = {s.req.id: s for s in self.waiting}
        self.decodes_since_prefill = 0

    def release(self, seqs: list[Sequence]) -> None:
        """Free the decoding slots of finished `seqs` (Placement.release)."""
        self.slots.release(seqs)

    def finish(self, seq: Sequence) -> None:
        """A finished sequence leaves the books (its slot was released by the step that finished it)."""
        self.live.pop(seq.req.id, None)

    # ---- the plan ---------------------------------------------------------------------------------------------
    def schedule(self) -> Plan:
        """The next step: a packed prefill forward (pages taken, slots arranged) or a decode step."""
        if self._wants_prefill():
            self.decodes_since_prefill = 0
            return Plan("prefill", self._prefill_chunks())
        if self.decoding:
            self.decodes_since_prefill += 1
            return Plan("decode")
        return Plan("idle")

    def _wants_prefill(self) -> bool:
        if not self.prefilling and not (self.waiting and self.active < self.num_slots):
            return False  # no prefill work: nothing started, and nothing that could start
        return not self.decoding or self.decodes_since_prefill >= self.decode_steps_per_prefill

    def _prefill_chunks(self) -> list[tuple[Sequence, int]]:
        """Chunks of the prefilling requests (admitting more while the budget lasts), their pages taken, their
        slots one contiguous range in this order."""
        plan: list[tuple[Sequence, int]] = []
        used = 0
        while used < self.prefill_budget:
            seq = next((s for s in self.prefilling if s not in [p for p, _ in plan]), None)
            if seq is None:
                seq = self._admit()
                if seq is None:
                    break
                self.prefilling.append(seq)
            n = min(self.chunk, seq.prefill_target - seq.length, self.prefill_budget - used)
            plan.append((seq, n))
            used += n
        plan = [(s, n) for s, n in plan if n > 0]
        if plan:
            wants = [(s, s.length + n + (self.lookahead if s.length + n == s.prefill_target else 0)) for s, n in plan]
            gone = self.grow(wants)
            plan = [(s, n) for s, n in plan if s not in gone]
            self.slots.compact([s for s, _ in plan])
        return sorted(plan, key=lambda p: p[0].slot)

    def prefilled(self, chunks: list[tuple[Sequence, int]], seconds: float) -> list[Sequence]:
        """After the prefill forward: lengths advance, pages the window passed go back, and the sequences whose
        prompt is in join the decoding range. Returns those."""
        total = sum(n for _, n in chunks)
        for seq, n in chunks:
            seq.length += n
            seq.forwards += 1
            self.slide(seq)
            seq.prefill_s += seconds * n / total  # each sequence's share of the packed forward, by its tokens
        if chunks:
            self.stats.forwards += 1
            self.stats.prefill_tokens += total
        started = [s for s in self.prefilling if s.length == s.prefill_target]
        for seq in started:
            dst = len(self.decoding)
            if seq.slot != dst:
                self.slots.swap(seq.slot, dst)
            self.prefilling.remove(seq)
            self.decoding.append(seq)
        return started

    # ---- slots ------------------------------------------------------------------------------------------------
    def _admission_pages(self, seq: Sequence) -> int:
        """Pages a request needs to start: its first prefill chunk and its first decode step."""
        return pages_for(0, min(self.chunk, seq.prefill_target) + self.lookahead, self.page_size)

    def _admit(self) -> Sequence | None:
        """The next waiting request into the first free slot after the running ones, if a slot and its pages are
        free (keeping the reserve for the running sequences' growth, unless none is running)."""
        assert self.runner is not None
        if not self.waiting or self.active >= self.num_slots:
            return None
        seq = self.waiting[0]
        reserve = self.reserve if self.active else 0
        if self.runner.slots.pool.free_pages < self._admission_pages(seq) + reserve:
            return None
        self.waiting.popleft()
        taken = {s.slot for s in (*self.decoding, *self.prefilling)}
        seq.slot = next(s for s in range(len(self.decoding), self.num_slots) if s not in taken)
        self.runner.reset(seq.slot)
        self.stats.most_active = max(self.stats.most_active, self.active + 1)
        return seq

    # ---- pages ------------------------------------------------------------------------------------------------
    def grow(self, wants: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Take pages so each (sequence, end position) holds positions < end; when the pool runs dry, preempt the
        newest running sequence and try again. Returns the sequences preempted (not in `wants` any more)."""
        assert self.runner is not None
        preempted: list[Sequence] = []
        pending = list(wants)
        while pending:
            seq, end = pending[0]
            if seq.slot < 0:  # preempted meanwhile
                pending.pop(0)
                continue
            try:
                self.runner.slots.grow(seq.slot, end)
                pending.pop(0)
            except PoolExhausted:
                victim = max((*self.decoding, *self.prefilling), key=lambda s: s.order)
                self._preempt(victim)
                preempted.append(victim)
        self.stats.peak_pages = max(self.stats.peak_pages, self.runner.slots.pool.used_pages)
        return preempted

    def _preempt(self, victim: Sequence) -> None:
        """Send a running sequence back to the queue, at its place by arrival: it restarts from its prompt."""
        if victim in self.prefilling:
            self.prefilling.remove(victim)
            self.slots.free(victim)
        else:
            self.slots.release([victim])
        again = self.new_sequence(victim.req, victim.order)
        self.live[victim.req.id] = again
        victim.slot = -1
        at = next((i for i, s in enumerate(self.waiting) if s.order > again.order), len(self.waiting))
        self.waiting.insert(at, again)
        self.stats.preemptions += 1
        log.debug("preempted request %s (pool of %d pages dry)", victim.req.id, self.num_pages)

    def slide(self, seq: Sequence) -> None:
        """Give back the pages no later query of `seq` can see (its window has passed them)."""
        assert self.runner is not None
        self.runner.slots.slide(seq.slot, seq.length - self.window + 1)


class Placement:
    """Which sequence holds which slot: decoding ones in [0, n), prefilling ones after them; moves keep it so."""

    def __init__(self, runner: Runner | None, stats: EngineStats) -> None:
        self.runner, self.stats = runner, stats
        self.prefilling: list[Sequence] = []  # in slots after the decoding ones, contiguous, in admission order
        self.decoding: list[Sequence] = []  # decoding[i] holds slot i

    def owner(self, slot: int) -> Sequence | None:
        return next((s for s in (*self.decoding, *self.prefilling) if s.slot == slot), None)

    def swap(self, a: int, b: int) -> None:
        """Exchange the sequences of slots a and b (either may be free)."""
        assert self.runner is not None
        first, second = self.owner(a), self.owner(b)
        if second is None:
            self.move(a, b)
        elif first is None:
            self.move(b, a)
        else:
            self.runner.swap(a, b)
            self.stats.moves += 2
        for seq, slot in ((first, b), (second, a)):
            if seq is not None:
                seq.slot = slot

    def move(self, src: int, dst: int) -> None:
        assert self.runner is not None
        self.runner.move(src, dst)
        self.stats.moves += 1

    def free(self, seq: Sequence) -> None:
        assert self.runner is not None
        if seq.slot >= 0:
            self.runner.slots.release(seq.slot)
        seq.slot = -1

    def release(self, seqs: list[Sequence]) -> None:
        """Free the decoding slots of `seqs` (and their pages), moving the last decoding sequences into the gaps."""
        assert self.runner is not None
        for seq in sorted(seqs, key=lambda s: s.slot, reverse=True):
            last = len(self.decoding) - 1
            self.runner.slots.release(seq.slot)
            if seq.slot != last:
                moved = self.decoding[last]
                self.move(last, seq.slot)
                moved.slot = seq.slot
                self.decoding[seq.slot] = moved
            self.decoding.pop()
            seq.slot = -1

    def compact(self, first: list[Sequence]) -> None:
        """Prefilling sequences into slots [n, n + k): `first` (this forward's, which a packed forward reads as
        one contiguous range) in that order, then the others in admission order."""
        base = len(self.decoding)
        rest = sorted((s for s in self.prefilling if s not in first), key=lambda s: s.order)
        for i, seq in enumerate([*first, *rest]):
            if seq.slot != base + i:
                self.swap(seq.slot, base + i)
        self.prefilling.sort(key=lambda s: s.slot)
