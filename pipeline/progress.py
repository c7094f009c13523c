"""Where the run's workers say they moved on, for the driver's stall watchdog (jobs/watchdog.py).

    stage task (read, parse, tokenize, postprocess, write) --note.remote(stage, n)--> ProgressBoard actor
    replica loading its model --note.remote("replica-load")--> the same board, every HEARTBEAT_S
    driver's watchdog --read.remote()--> {stage: StageProgress(count, seconds since its last note)}

Notable choices:
- One small actor of the run (no CPU), told fire-and-forget: a note costs the stage a message, never a wait, and a
  board that is gone (the run is ending) costs nothing either: `ProgressNote` swallows the error.
- Stages and replicas know the board by its name (`clover-progress-<run id>`), not by its handle: a replica's
  constructor arguments must stay small plain values that Ray inlines (pipeline/replicas.py), and a handle among
  them sends them through the object store. Each process looks the name up once.
- Notes come per document from the stages that may spend long on one (reading from object stores, parsing: up to
  input.parse_timeout_s each), per batch from the others: a batch of four slow PDFs must not look like a stall.
- Ages are measured on the board's own clock (the driver's may be on another node), and the watchdog compares
  counts, never times across machines.
- A replica that is still loading its model cannot answer calls (its constructor runs), so it sends its own
  heartbeat here until its engine is built; once built, the watchdog asks the replica itself (EngineLoop.health).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # how often a loading replica says it is still loading
REPLICA_LOAD = "replica-load"  # the board's name for loading replicas' heartbeats


@dataclass(frozen=True)
class StageProgress:
    count: int  # notes (documents or batches) so far
    seconds_ago: float  # since the last one, on the board's clock


class ProgressBoard:
    """A Ray actor (pipeline/progress.py): counts per stage and when each last moved."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.last: dict[str, float] = {}

    def note(self, stage: str, n: int = 1) -> None:
        self.counts[stage] = self.counts.get(stage, 0) + n
        self.last[stage] = time.monotonic()

    def read(self) -> dict[str, StageProgress]:
        now = time.monotonic()
        return {stage: StageProgress(n, now - self.last[stage]) for stage, n in self.counts.items()}


def board_name(run_id: str) -> str:
    return f"clover-progress-{run_id}"


def start_board(run_id: str) -> ActorHandle:
    import ray

    return ray.remote(ProgressBoard).options(name=board_name(run_id), num_cpus=0, max_restarts=0).remote()


_boards: dict[str, ActorHandle | None] = {}  # this process's lookups: board name -> handle (None: not found)


@dataclass(frozen=True)
class ProgressNote:
    """What a stage holds: tells the board, never waits and never fails the stage. `board` None: does nothing."""

    board: str | None = None  # the board's actor name (board_name)

    def _handle(self) -> ActorHandle | None:
        if self.board not in _boards:
            import ray

            try:
                _boards[self.board] = ray.get_actor(self.board)
            except Exception as e:  # gone already (the run is ending): notes go nowhere
                log.debug("progress board %s not found: %s", self.board, e)
                _boards[self.board] = None
        return _boards[self.board]

    def __call__(self, stage: str, n: int = 1) -> None:
        if self.board is None or n <= 0:
            return
        try:
            handle = self._handle()
            if handle is not None:
                handle.note.remote(stage, n)
        except Exception as e:  # the board is gone (the run is ending): progress notes are not the work
            log.debug("progress note %s lost: %s", stage, e)

    def beating(self, stage: str) -> Heartbeat:
        """A context manager sending a note every HEARTBEAT_S while its block runs (a replica loading its model)."""
        return Heartbeat(self, stage)


class Heartbeat:
    def __init__(self, note: ProgressNote, stage: str) -> None:
        self.note, self.stage = note, stage
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="clover-heartbeat", daemon=True)

    def _beat(self) -> None:
        while True:
            self.note(self.stage)
            if self._done.wait(HEARTBEAT_S):
                return

    def __enter__(self) -> Heartbeat:
        if self.note.board is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()


NO_PROGRESS = ProgressNote()  # stages built outside a run (tests, `clover-batch parse`): notes go nowhere
