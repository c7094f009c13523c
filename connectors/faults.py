"""Fault injection for the interruption, retry and poison-document tests. Unset, none of this does anything.

`CLOVER_BATCH_FAULT="<point>[:<n>][:<action>]"` acts the n-th time (default 1) `<point>` is reached by any process
of the run on this machine (counted in a file under the temp folder, keyed by the driver's pid, which is passed to
workers as `CLOVER_BATCH_FAULT_PID`). Actions:
- `kill` (default): SIGKILL the driver and this process, at the n-th time and every later one: the whole run dies.
- `exit`: SIGKILL only this process, exactly the n-th time: a Ray worker dies while the driver lives (Ray retries).
- `stall`: this process hangs there, exactly the n-th time (a stuck worker): the run stays in progress until it is
  interrupted (the interruption tests signal the driver then).
Points: `listing`, `inference` (after a generate() call), `writing` (the part's bytes exist only as a temporary),
`committing` (the part is staged, its lock check not done yet), `checked` (the check passed, the part is not
published yet), `committed` (the part is visible), `swapping`
(a retried document's new rows are staged, the old part not yet rewritten), `swapped` (one old part rewritten),
`engine_step` (a replica's engine thread, before each engine step: `engine_step:<n>:stall` is a replica that stops
stepping with documents inside, for the stall watchdog's tests).

`CLOVER_BATCH_FAULT_DOC="<action>:<text>[,<action>:<text>...]"` faults one document, by a piece of its URI:
- `read_denied:<text>`: reading it raises PermissionError (an infrastructure failure that retries do not fix).
- `crash_infer:<text>`: the infer actor's process is SIGKILLed when the document enters it (a native crash, or
  the OOM killer).
- `parse_hang:<text>`, `markdown_hang:<text>`, `markdown_crash:<text>`: a parse child hangs on a page range
  (in any mode; in Markdown mode only), or SIGKILLs itself in Markdown mode. `<text>` is matched in
  `<uri>#pages=<first>-<last>` (1-based, inclusive), so `book.pdf#pages=51-100` faults that range only.

In-process tests can also pause a thread at a point with `hook(point, fn)`, to race two runs deterministically.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

FAULT_ENV = "CLOVER_BATCH_FAULT"
FAULT_PID_ENV = "CLOVER_BATCH_FAULT_PID"
FAULT_DOC_ENV = "CLOVER_BATCH_FAULT_DOC"
STALL_S = 600.0  # how long a `stall` fault hangs: longer than any test waits

_hooks: dict[str, Callable[[], None]] = {}


def fault_config() -> dict[str, str]:
    """The fault settings of this process, to forward to Ray workers (empty when none is set)."""
    config = {k: os.environ[k] for k in (FAULT_ENV, FAULT_DOC_ENV) if os.environ.get(k)}
    if config:
        config[FAULT_PID_ENV] = os.environ.get(FAULT_PID_ENV, str(os.getpid()))
    return config


@contextlib.contextmanager
def hook(point: str, fn: Callable[[], None]) -> Iterator[None]:
    """Call `fn` (in the thread that reaches it) each time this process reaches `point`; for race tests."""
    _hooks[point] = fn
    try:
        yield
    finally:
        _hooks.pop(point, None)


def _started(pid: int) -> str:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat); "" where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


def counter_path(name: str, pid: int | None = None) -> str:
    """The file counting how often the run of driver `pid` (default: this run's) reached `name`. Keyed by the
    driver's pid and start time: pids are reused (pid_max is often 32768), and a counter left by an earlier run
    with the same pid would make this one fault early."""
    if pid is None:
        pid = int(os.environ.get(FAULT_PID_ENV, os.getpid()))
    return os.path.join(tempfile.gettempdir(), f"clover-batch-fault-{pid}-{_started(pid)}-{name}")


def _count(name: str) -> int:
    counter = counter_path(name)
    fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, b"x")  # appends are atomic, so processes count together
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def fault_point(name: str) -> None:
    """Run the in-process hook for `name`, then act if the configured fault names this point and its count."""
    fn = _hooks.get(name)
    if fn is not None:
        fn()
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    point, _, rest = spec.partition(":")
    if point != name:
        return
    count, _, action = rest.partition(":")
    reached, wanted = _count(name), int(count or 1)
    if action == "stall":
        if reached == wanted:
            log.warning("fault injection: process %d stalls at %s", os.getpid(), name)
            time.sleep(STALL_S)
        return
    if action == "exit":
        if reached == wanted:
            log.warning("fault injection: process %d exits at %s", os.getpid(), name)
            os.kill(os.getpid(), signal.SIGKILL)
        return
    if reached < wanted:
        return
    pid = int(os.environ.get(FAULT_PID_ENV, os.getpid()))
    log.warning("fault injection: killing process %d at %s", pid, name)
    os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _document_faults() -> list[tuple[str, str]]:
    spec = os.environ.get(FAULT_DOC_ENV, "")
    return [tuple(item.split(":", 1)) for item in spec.split(",") if ":" in item]  # type: ignore[misc]


def document_fault(action: str, uri: str) -> None:
    """Fail this document the way the configured fault says, if one names `action` and a piece of `uri`."""
    for name, text in _document_faults():
        if name != action or text not in uri:
            continue
        if action == "read_denied":
            raise PermissionError(f"injected fault: access denied to {uri}")
        if action in ("crash_infer", "markdown_crash"):
            log.warning("fault injection: process %d crashes on %s", os.getpid(), uri)
            os.kill(os.getpid(), signal.SIGKILL)
        if action in ("parse_hang", "markdown_hang"):
            log.warning("fault injection: process %d hangs on %s", os.getpid(), uri)
            time.sleep(STALL_S)
