"""EngineLoop: one continuous-batching Engine kept busy by a thread of its own, fed from async Ray Data batches.

    async batch coroutine --submit(prompt)--> inbox --> engine thread: add, step, step, ... --> future resolved

Notable choices:
- The engine is touched only by its thread, so it needs no lock: coroutines hand requests over through a queue and
  await futures that the thread resolves on their event loop (`call_soon_threadsafe`). The thread drains the
  inbox between steps, so documents of a new Ray batch join the running batch at the next step.
- A step that fails with an ExpertParallelError means a worker rank died: `recover` restarts the workers and the
  engine requeues everything in flight from the start (no partial state survives a broken step). When `recover`
  gives up, every pending request fails with that error, so the stage fails the run: a broken replica must not
  write error rows for good documents.
- A step that fails with any other error cannot say which document caused it: the requests in flight are then run
  again one at a time, so only the document that fails alone gets the error (the others still get results).
- An EngineCapacityError (not even one slot fits) is a replica-level problem too: every request gets it.
- A request submitted with `alone=True` (a document that was inside a process that died: a suspect) waits until
  the engine is empty and then runs with no other request until it finishes; requests arriving meanwhile wait. So
  if it kills the process again, the death is its own, and no other document is charged with it.
- `on_admit` is called with the requests about to enter the engine (name -> alone), and they enter once it
  returned; `on_leave` with the names of those that came out (a result or an error), and their results are
  delivered once it returned. The infer stage writes and removes each document's attempt record there
  (connectors/attempts.py), which on an object store is a round trip or two: so both run on one records thread,
  in the order the engine thread hands them over, while the engine keeps stepping the documents already inside.
  That order is the contract: what came out is handed over before anything else goes in, so when a suspect
  enters alone, every earlier record is gone and a death is charged to it only. What queued up while the thread
  was busy is done together, removals first (one on_leave, then one on_admit), so the thread keeps up with an
  engine that lets documents in and out faster than one round trip each. (Removing records from the
  awaiting coroutines instead raced the next admission: a suspect that had finished alone could still have its
  record when the next suspect killed the process, and was charged with that death.) A record is written before
  its document enters and removed after it came out, so a death between charges a document that was not inside
  with a death among others: that only makes it run alone next time, and never ends it `crashed`.
- `on_step` (the replica's metrics) is called on the engine thread after every step and before it waits for work,
  with the engine and how many requests are queued in front of it (taken in, not yet holding a slot).
- `health()` says what the engine thread is doing (`state`, since when) and how many steps it finished, from plain
  attributes the thread sets: any other thread (the actor's event loop, answering the run's stall watchdog) reads
  them without a lock and without waiting for the engine thread, so a replica whose engine is stuck still answers.
  A test switches on a stuck engine with the fault point `engine_step` (connectors/faults.py), reached before
  every step.
- Given a builder instead of an Engine, the thread builds it (loads the model) itself, and the constructor waits
  for it: all of a replica's torch work then happens on one thread. On CPU this is worth 3-4x: torch's OpenMP
  pool belongs to the thread that starts a parallel region, and once the actor's main thread had one (loading the
  model there), every step on the engine thread ran beside the main thread's idle pool (bench/pipeline.py, tiny
  model, 64 documents: 74 s with the model loaded on the main thread, 20 s for the same engine on one thread).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from clover_batch.connectors.faults import fault_point
from clover_batch.model import Engine, EngineCapacityError, Generation, Request
from clover_batch.model.expert_parallel import ExpertParallelError

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request: Request
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    name: str = "request"
    alone: bool = False  # run with no other request in the engine
    entered: bool = False  # on_admit was called for it: on_leave is called when it comes out


@dataclass
class _Admitted:
    """Back from the records thread: on_admit returned for these requests (or failed with `error`)."""

    items: list[_Pending]
    error: BaseException | None = None


class _Records:
    """The records thread: calls on_leave and on_admit in the order the engine thread hands them over, merging
    whatever queued up meanwhile: removing records earlier than asked is safe (those documents are out), and
    every admission still waits for the removals handed over before it."""

    def __init__(self, on_admit: Callable[[dict[str, bool]], None] | None,
                 on_leave: Callable[[list[str]], None] | None, inbox: queue.SimpleQueue) -> None:
        self.on_admit, self.on_leave, self.inbox = on_admit, on_leave, inbox
        # requests inside per name: a document answered from its parts too (task.parts) enters as several requests
        # of one name; its record is written when the first enters and goes when the last comes out
        self._inside: collections.Counter[str] = collections.Counter()
        self._jobs: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="clover-records", daemon=True).start()

    def leave(self, out: list[tuple[_Pending, Any, BaseException | None]]) -> None:
        """Remove the records of what came out, then resolve its futures."""
        self._jobs.put(("leave", out))

    def admit(self, items: list[_Pending], alone: bool) -> None:
        """Write the records of these requests, then hand them back to the engine thread (`_Admitted`)."""
        self._jobs.put(("admit", items, alone))

    def admit_now(self, entering: dict[str, bool]) -> None:
        """on_admit after everything handed over before, waiting for it (its error is raised here)."""
        done: Future = Future()
        self._jobs.put(("now", entering, done))
        done.result()

    def _run(self) -> None:
        while True:
            jobs = [self._jobs.get()]
            while True:
                try:
                    jobs.append(self._jobs.get(block=False))
                except queue.Empty:
                    break
            while jobs:  # a waiting admit_now is a barrier: what came before it is done before it
                cut = next((i for i, job in enumerate(jobs) if job[0] == "now"), len(jobs))
                self._merged(jobs[:cut])
                if cut < len(jobs):
                    _, entering, done = jobs[cut]
                    try:
                        if self.on_admit is not None:
                            self.on_admit(entering)
                    except Exception as e:
                        done.set_exception(e)
                    else:
                        done.set_result(None)
                jobs = jobs[cut + 1:]

    def _merged(self, jobs: list[tuple]) -> None:
        out = [entry for job in jobs if job[0] == "leave" for entry in job[1]]
        left = []
        for item, _, _ in out:
            if item.entered:
                self._inside[item.name] -= 1
                if self._inside[item.name] <= 0:
                    del self._inside[item.name]
                    left.append(item.name)
        if left and self.on_leave is not None:
            try:
                self.on_leave(left)
            except Exception as e:  # a record left behind only makes its document run alone if it comes back
                log.warning("on_leave failed for %d requests: %s: %s", len(left), type(e).__name__, e)
        for item, result, error in out:
            _resolve_soon(item, result, error)
        admits = [job for job in jobs if job[0] == "admit"]
        if not admits:
            return
        error = None
        entering = {}
        for _, items, alone in admits:
            for item in items:
                if not self._inside[item.name]:
                    entering[item.name] = alone
                self._inside[item.name] += 1
        try:
            if self.on_admit is not None and entering:
                self.on_admit(entering)
        except Exception as e:
            error = e
        finally:
            for _, items, _ in admits:
                self.inbox.put(_Admitted(items, error))  # wakes the engine thread


@dataclass(frozen=True)
class EngineHealth:
    """What an engine loop is doing, as its stall watchdog sees it (EngineLoop.health)."""

    state: str  # loading | waiting for work | stepping | recovering | failed
    state_seconds: float  # how long it has been in that state
    steps: int  # engine steps finished (prefill chunks and decode steps, one-at-a-time reruns included)
    holding: int  # documents submitted to the loop whose result is not back yet


class EngineLoop:
    """Runs `engine` in a daemon thread; `await submit(prompt_ids)` returns the prompt's Generation."""

    def __init__(self, engine: Engine | Callable[[], Engine], *, recover: Callable[[], None] | None = None,
                 max_recoveries: int = 2, on_admit: Callable[[dict[str, bool]], None] | None = None,
                 on_leave: Callable[[list[str]], None] | None = None,
                 on_step: Callable[[Engine, int], None] | None = None) -> None:
        """engine: the Engine, or a function building it, called on the engine thread (its error is raised here);
        recover: restarts a broken expert-parallel replica (raises ExpertParallelError when it cannot);
        max_recoveries: how many times in a row, with no successful step between, before giving up;
        on_admit: called with {name: alone} of requests about to enter the engine (an error fails them);
        on_leave: called with the names of admitted requests that came out (an error is logged: the results
        still go out). Both run on one records thread, in order; see the module's docstring.
        on_step: called on the engine thread after each step and before it waits for work, with the engine and
        the number of requests queued in front of it, not yet holding a slot (an error is logged)."""
        self.recover, self.max_recoveries = recover, max_recoveries
        self.on_admit, self.on_leave, self.on_step = on_admit, on_leave, on_step
        self.in_loop = 0  # submitted, result not back yet: how busy this loop is (read and changed on the event loop)
        self._admitting = 0  # admissions handed to the records thread and not back yet
        self._entering = 0  # requests in those admissions
        self._out: list[tuple[_Pending, Any, BaseException | None]] = []  # came out, not yet handed over
        self._failures_in_a_row = 0
        self._inbox: queue.SimpleQueue[_Pending | _Admitted] = queue.SimpleQueue()
        self._records = _Records(on_admit, on_leave, self._inbox) if on_admit or on_leave else None
        self._waiting: list[_Pending] = []  # taken from the inbox, not yet in the engine
        self._alone: collections.deque[_Pending] = collections.deque()  # to run one at a time, on an empty engine
        self._solo: str | None = None  # the request running alone now (or entering alone)
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._fatal: BaseException | None = None
        self.steps = 0  # engine steps finished; written by the engine thread only
        self._state, self._state_since = "loading", time.monotonic()  # ditto: see health()
        self.engine: Engine
        failed: list[BaseException] = []
        ready = threading.Event()

        def run() -> None:
            try:
                self.engine = engine if isinstance(engine, Engine) else engine()
            except BaseException as e:  # the replica cannot load: the actor's constructor fails with it
                failed.append(e)
                return
            finally:
                ready.set()
            self._run()

        self._thread = threading.Thread(target=run, name="clover-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    def health(self) -> EngineHealth:
        """The engine thread's state, read from any thread without waiting for it (a stuck step included)."""
        state, since = self._state, self._state_since  # one tuple read each: consistent enough for a watchdog
        return EngineHealth(state="failed" if self._fatal is not None else state,
                            state_seconds=time.monotonic() - since, steps=self.steps, holding=self.in_loop)

    def _now(self, state: str) -> None:
        if state != self._state:
            self._state, self._state_since = state, time.monotonic()

    async def submit(self, prompt_ids: list[int], *, name: str = "request", alone: bool = False) -> Generation:
        """The prompt's Generation; with `alone`, run when no other request is in the engine, and none joins it."""
        if self._fatal is not None:
            raise self._fatal
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.in_loop += 1
        try:
            self._inbox.put(_Pending(Request(f"{name}#{next(self._ids)}", list(prompt_ids)), future, loop, name,
                                     alone))
            return await future
        finally:
            self.in_loop -= 1

    # ---- the engine thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._take(block=False)
            progressed = self._admit()
            if self.engine.has_work:
                self._step()
                progressed = True
            self._deliver()
            self._observe()
            if not progressed:  # nothing changed since the inbox was drained: wait for it
                self._now("waiting for work")
                self._take(block=True)  # a new request, or an admission back from the records thread

    def _observe(self) -> None:
        if self.on_step is None:
            return
        queued = len(self._waiting) + len(self._alone) + self._entering
        queued += len(self.engine.in_flight()) - self.engine.active  # in the engine, waiting for a slot
        try:
            self.on_step(self.engine, queued)
        except Exception as e:  # metrics must never stop the engine
            log.warning("on_step failed: %s: %s", type(e).__name__, e)

    def _step(self) -> None:
        self._now("stepping")
        try:
            fault_point("engine_step")  # tests: `engine_step:<n>:stall` hangs this thread with documents inside
            finished = self.engine.step()
            self.steps += 1
        except ExpertParallelError as e:
            self._replica_failed(e)
            return
        except Exception as e:  # one document's failure must not take the others with it
            log.warning("engine step failed (%s: %s); running the %d requests in flight one at a time",
                        type(e).__name__, e, len(self.engine.in_flight()))
            self._isolate()
            return
        self._failures_in_a_row = 0
        self._resolve(finished)

    def _take(self, *, block: bool) -> None:
        """Collect submitted requests, and move those whose admission came back into the engine."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if isinstance(item, _Admitted):
                self._admitting -= 1
                self._entering -= len(item.items)
                for pending in item.items:
                    if item.error is not None:  # e.g. the attempt records cannot be written: they do not run
                        self._finish(pending, error=item.error)
                    else:
                        self._add(pending)
                if item.error is not None:
                    log.warning("cannot admit %d requests: %s: %s", len(item.items), type(item.error).__name__,
                                item.error)
            else:
                (self._alone if item.alone else self._waiting).append(item)

    def _admit(self) -> bool:
        """Hand collected requests to the engine (through on_admit); whether any were. One that must run alone
        waits for the engine to empty, then runs with no other request until it finishes; the others wait."""
        if self._solo is not None:
            if self._admitting or self._solo in self._pending:
                return False  # entering, or inside
            self._solo = None
        if self._alone:
            if self.engine.has_work or self._admitting:
                return False  # the requests in flight (or entering) finish first
            item = self._alone.popleft()
            self._solo = item.request.id
            self._enter([item], alone=True)
            return True
        if self._waiting:
            items, self._waiting = self._waiting, []
            self._enter(items, alone=False)
            return True
        return False

    def _enter(self, items: list[_Pending], *, alone: bool) -> None:
        """Call on_admit on the records thread, after every on_leave handed over before; the requests enter the
        engine when it is back (`_take`). Without on_admit they enter now."""
        if self._fatal is not None:
            for item in items:
                self._finish(item, error=self._fatal)
            return
        self._deliver()  # what came out goes off the record before anything else goes on it
        for item in items:
            item.entered = True  # its record may be (partly) written even if on_admit fails
        if self.on_admit is None or self._records is None:
            for item in items:
                self._add(item)
            return
        self._admitting += 1
        self._entering += len(items)
        self._records.admit(items, alone)

    def _add(self, item: _Pending) -> None:
        if self._fatal is not None:
            self._finish(item, error=self._fatal)
            return
        try:
            self.engine.add(item.request)
        except EngineCapacityError as e:
            self._fail_all(e)
            self._finish(item, error=e)
        except ValueError as e:  # a prompt the engine refuses (empty, ids outside the vocabulary)
            self._finish(item, error=e)
        else:
            self._pending[item.request.id] = item

    def _resolve(self, finished: list[tuple[str, Generation]]) -> None:
        for request_id, gen in finished:
            item = self._pending.pop(request_id, None)
            if item is not None:
                self._finish(item, result=gen)

    def _replica_failed(self, error: ExpertParallelError) -> None:
        self._now("recovering")
        self._failures_in_a_row += 1
        if self.recover is not None and self._failures_in_a_row <= self.max_recoveries:
            log.warning("expert-parallel replica failed (%s); restarting it and rerunning %d requests", error,
                        len(self.engine.in_flight()))
            try:
                self.recover()
            except ExpertParallelError as e:
                error = e
            else:
                self.engine.restart()
                return
        elif self.recover is not None:
            error = ExpertParallelError(f"{error}; gave up after {self.max_recoveries} restarts in a row")
        self._fail_all(error)

    def _isolate(self) -> None:
        """Rerun every request in flight alone; a request that fails alone gets its error."""
        suspects = [self._pending[i] for i in self.engine.in_flight() if i in self._pending]
        for item in suspects:
            self.engine.cancel(item.request.id)
        self.engine.restart()  # clears whatever state the failed step left behind
        for i, item in enumerate(suspects):
            try:
                self._deliver()  # the previous suspect goes off the record before this one goes on it
                if self.on_admit is not None and self._records is not None:  # alone from here: a death is its own
                    self._records.admit_now({item.name: True})
                self.engine.add(item.request)
                result: dict[str, Generation] = {}
                while self.engine.has_work:
                    result.update(self.engine.step())
                    self.steps += 1
            except ExpertParallelError as e:
                for rest in suspects[i + 1:]:  # back in the engine: they run together once the replica is back
                    self.engine.add(rest.request)
                self._replica_failed(e)
                return
            except Exception as e:  # this document fails alone: its error is its own
                log.warning("request %s failed alone: %s: %s", item.request.id, type(e).__name__, e)
                self.engine.cancel(item.request.id)
                self.engine.restart()
                self._pending.pop(item.request.id, None)
                self._finish(item, error=e)
                continue
            self._resolve(list(result.items()))

    def _fail_all(self, error: BaseException) -> None:
        self._fatal = error
        for request_id in self.engine.in_flight():
            self.engine.cancel(request_id)
        for item in list(self._pending.values()):
            self._finish(item, error=error)
        self._pending.clear()

    def _finish(self, item: _Pending, *, result: Any = None, error: BaseException | None = None) -> None:
        """The request came out (or never went in): delivered by the next `_deliver`, in this same iteration."""
        self._out.append((item, result, error))

    def _deliver(self) -> None:
        """Hand what came out of the engine to the records thread: on_leave, then its futures resolve."""
        if not self._out:
            return
        out, self._out = self._out, []
        if self._records is not None:
            self._records.leave(out)
            return
        for item, result, error in out:
            _resolve_soon(item, result, error)


def _resolve_soon(item: _Pending, result: Any, error: BaseException | None) -> None:
    """Resolve the request's future on its event loop (from any thread)."""
    try:
        item.loop.call_soon_threadsafe(_settle, item.future, result, error)
    except RuntimeError:  # its event loop is closed: nobody is waiting for it any more
        log.debug("request %s finished after its event loop closed", item.request.id)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
