"""The run's stall watchdog: a driver thread that ends a run nothing moves in, with a diagnosis.

    Watchdog(replicas, board, stall_timeout_s, run_thread)  (a context manager around the run's execution)
      every poll_s (5 s by default): the replicas' health (EngineLoop.health), the progress board
      (pipeline/progress.py), the rows the run thread saw
      no progress for stall_timeout_s -> diagnose() -> RunStalled raised in the run's thread

Progress is any of: a committed row reaching the driver; an engine step of any replica; a document read or parsed,
a batch tokenized, postprocessed or written (the board); a loading replica's heartbeat, or a replica recovering its
expert ranks. A replica answering the watchdog is not progress by itself: a replica that holds documents and does
not step is the stall this looks for, and one that holds none while nothing else moves is waiting for a stage that
is stuck (the issue-32 hang: no CPU left for the parse tasks).

Notable choices:
- The driver's run thread waits inside Ray Data's output iterator, which gives no timeout; the watchdog raises
  RunStalled there asynchronously (as `_ClusterDriver.stop` does for an interrupted ray:// client): the iterator
  polls in Python every few milliseconds, so the run unwinds at once, its replicas killed, its lock released.
- Every call it makes is bounded: the replicas' health within HEALTH_TIMEOUT_S (a replica that does not answer in
  time is reported so), the board's within the same, and the Ray state calls within STATE_TIMEOUT_S each.
- The diagnosis names the stalled stage by the first rule that applies: a replica that holds documents and has not
  stepped; tasks or actors waiting for resources; a replica that does not answer; else the stage after the one
  that last made progress (the documents are stuck between them).
- Pending tasks and actors come from `ray.util.state`, which needs the cluster's dashboard; a Ray without one (the
  run's own local Ray starts none) answers from the GCS instead: the resource demands waiting to be scheduled
  (what the autoscaler sees), by shape and count.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0  # a replica's or the board's answer to the watchdog
STATE_TIMEOUT_S = 5.0  # each ray.util.state call of a diagnosis
MAX_LISTED = 20  # pending tasks and actors named in a diagnosis (the rest are counted)
# the order documents go through the stages, for "the stage after the one that last made progress"
ORDER = ("replica-load", "read", "parse-range", "parse", "tokenize", "infer", "postprocess", "write", "rows")


class RunStalled(RuntimeError):
    """The run made no progress for run.stall_timeout_s (exit 1). `diagnosis`: what the watchdog saw."""

    def __init__(self, diagnosis: Diagnosis):
        self.diagnosis = diagnosis
        super().__init__(diagnosis.cause)

    def __reduce__(self):
        return type(self), (self.diagnosis,)


class StallInterrupt(BaseException):
    """Raised asynchronously in the run's thread; execute() turns it into RunStalled. A BaseException, so no
    `except Exception` on the way swallows it."""


@dataclass
class Diagnosis:
    """What the watchdog saw when it called the run stalled; in the run report as `stall`."""

    cause: str  # one line: the stalled stage and for how long nothing moved
    stalled_stage: str
    seconds_without_progress: float
    last_progress: str  # which signal moved last, and how long before the stall
    replicas: list[dict[str, Any]] = field(default_factory=list)  # each replica's engine state, or why unknown
    stages: dict[str, dict[str, float]] = field(default_factory=dict)  # the board: stage -> count, seconds ago
    pending: list[str] = field(default_factory=list)  # tasks / actors / resource demands waiting to be scheduled
    pending_source: str = ""  # ray.util.state, or the GCS's resource demands (and why)

    def lines(self) -> list[str]:
        out = [self.cause, f"last progress: {self.last_progress}"]
        for r in self.replicas:
            out.append("replica " + ", ".join(f"{k}={v}" for k, v in r.items()))
        if self.stages:
            out.append("stages: " + ", ".join(f"{k} {v['count']:g} ({v['seconds_ago']:.0f} s ago)"
                                              for k, v in self.stages.items()))
        out.append(f"waiting to be scheduled ({self.pending_source}): " + ("; ".join(self.pending) or "nothing"))
        return out


class Watchdog:
    """Watches a run's progress from a daemon thread; raises RunStalled in `run_thread` after `stall_timeout_s`
    without progress. Use as a context manager around the run's execution; `rows(n)` for committed rows."""

    def __init__(self, replicas: list[ActorHandle], board: ActorHandle | None, stall_timeout_s: float,
                 run_thread: int | None = None, poll_s: float | None = None):
        self.replicas, self.board, self.timeout = replicas, board, stall_timeout_s
        self.run_thread = run_thread if run_thread is not None else threading.get_ident()
        self.poll_s = poll_s or min(5.0, max(0.5, stall_timeout_s / 10))
        self.diagnosis: Diagnosis | None = None
        self._rows = 0
        self._seen: dict[str, float] = {}  # signal -> its last value
        self._last_signal, self._last_at = "the run started", time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="clover-watchdog", daemon=True)
        self._health: list[Any] = []  # the replicas' last answers (EngineHealth, or the error)
        self._stages: dict[str, Any] = {}

    def rows(self, n: int) -> None:
        self._rows += n

    def __enter__(self) -> Watchdog:
        if self.timeout > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread.ident != threading.get_ident():
            self._thread.join(timeout=HEALTH_TIMEOUT_S + STATE_TIMEOUT_S * 3)

    # ---- the watchdog thread -------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._look()
            except Exception as e:  # the watchdog must never be what fails a run
                log.warning("stall watchdog: %s: %s", type(e).__name__, e)
                continue
            quiet = time.monotonic() - self._last_at
            if quiet >= self.timeout and not self._stop.is_set():
                self.diagnosis = self._diagnose(quiet)
                log.error("run stalled:\n  %s", "\n  ".join(self.diagnosis.lines()))
                if not self._stop.is_set():
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.run_thread),
                                                               ctypes.py_object(StallInterrupt))
                return

    def _moved(self, signal: str, value: float) -> None:
        if value > self._seen.get(signal, 0):
            self._seen[signal] = value
            self._last_signal, self._last_at = signal, time.monotonic()

    def _look(self) -> None:
        import ray

        self._moved("rows", self._rows)
        health_refs = [r.health.remote() for r in self.replicas]
        board_ref = self.board.read.remote() if self.board is not None else None
        refs = [*health_refs, *([board_ref] if board_ref is not None else [])]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=HEALTH_TIMEOUT_S)
        ready_set = set(ready)
        health: list[Any] = []
        for i, ref in enumerate(health_refs):
            if ref not in ready_set:
                health.append(f"no answer within {HEALTH_TIMEOUT_S:g} s (loading its model, restarting, or its "
                              f"process is stuck)")
                continue
            try:
                h = ray.get(ref)
            except Exception as e:  # a replica that died: Ray restarts it (its documents run again)
                health.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            health.append(h)
            self._moved(f"replica {i} engine step", h.steps)
            if h.state == "recovering":  # restarting its expert ranks: a heartbeat that counts
                self._moved(f"replica {i} recovering", time.monotonic())
        self._health = health
        if board_ref is not None and board_ref in ready_set:
            self._stages = ray.get(board_ref)
            for stage, p in self._stages.items():
                self._moved(stage, p.count)

    def _stalled_stage(self, pending: list[str]) -> str:
        for i, h in enumerate(self._health):
            if not isinstance(h, str) and h.holding and h.state != "waiting for work":
                return (f"infer: replica {i} holds {h.holding} documents and has not stepped for "
                        f"{h.state_seconds:.0f} s (engine {h.state})")
        if pending:
            return f"waiting for resources: {pending[0]}" + (f" (and {len(pending) - 1} more)" if len(pending) > 1
                                                             else "")
        silent = [i for i, h in enumerate(self._health) if isinstance(h, str)]
        if silent:
            return f"infer: replica {silent[0]} does not answer: {self._health[silent[0]]}"
        last = next((s for s in reversed(ORDER) if s in self._last_signal), None)
        if last is None or "engine step" in self._last_signal:
            last = "infer"
        after = ORDER[min(len(ORDER) - 1, ORDER.index(last) + 1)] if last != "rows" else "read"
        return f"{after}: documents went through {last} and did not come out of {after}"

    def _diagnose(self, quiet: float) -> Diagnosis:
        pending, source = pending_work()
        stalled = self._stalled_stage(pending)
        cause = (f"run stalled: nothing moved for {quiet:.0f} s (run.stall_timeout_s={self.timeout:g}); stalled "
                 f"stage: {stalled}")
        replicas = []
        for i, h in enumerate(self._health):
            if isinstance(h, str):
                replicas.append({"index": i, "state": "unknown", "why": h})
            else:
                replicas.append({"index": i, "state": h.state, "state_seconds": round(h.state_seconds, 1),
                                 "steps": h.steps, "holding": h.holding})
        stages = {k: {"count": float(v.count), "seconds_ago": round(v.seconds_ago, 1)}
                  for k, v in self._stages.items()}
        return Diagnosis(cause=cause, stalled_stage=stalled, seconds_without_progress=round(quiet, 1),
                         last_progress=f"{self._last_signal}, {quiet:.0f} s before", replicas=replicas,
                         stages=stages, pending=pending, pending_source=source)


def pending_work() -> tuple[list[str], str]:
    """Tasks and actors waiting to be scheduled, with the resources they wait for; and where that came from."""
    try:
        import ray
        from ray.util.state import list_actors, list_tasks

        address = ray.get_runtime_context().gcs_address  # never another Ray on this machine
        tasks = list_tasks(address=address, filters=[("state", "=", "PENDING_NODE_ASSIGNMENT")],
                           timeout=STATE_TIMEOUT_S, limit=MAX_LISTED, raise_on_missing_output=False, detail=True)
        actors = list_actors(address=address, filters=[("state", "=", "PENDING_CREATION")],
                             timeout=STATE_TIMEOUT_S, limit=MAX_LISTED, raise_on_missing_output=False, detail=True)
        out = [f"task {t.name} needs {_resources(t.required_resources)}" for t in tasks
               if t.type != "ACTOR_CREATION_TASK"]
        out += [f"actor {a.class_name} needs {_resources(a.required_resources)}" for a in actors]
        return out, "ray.util.state"
    except Exception as e:  # no dashboard on this cluster (the run's own local Ray has none): ask the GCS
        why = f"ray.util.state unavailable: {type(e).__name__}"
    try:
        import ray
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(ray.get_runtime_context().gcs_address, timeout=STATE_TIMEOUT_S)
        out = []
        for demand in status.resource_demands.ray_task_actor_demand:
            for by_count in demand.bundles_by_count:
                out.append(f"{by_count.count} tasks or actors need {_resources(by_count.bundle)} each")
        for demand in status.resource_demands.placement_group_demand:
            out.append(f"placement group {getattr(demand, 'pg_id', '')} ({getattr(demand, 'strategy', '')}) "
                       f"needs {[_resources(b.bundle) for b in demand.bundles_by_count]}")
        return out, f"the GCS's resource demands; {why}"
    except Exception as e:
        return [], f"{why}; the GCS's resource demands unavailable: {type(e).__name__}: {e}"


def _resources(resources: dict[str, float] | None) -> str:
    shown = {k: v for k, v in (resources or {}).items() if not k.startswith("node:")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"
