"""Fault injection for the interruption tests: kill the whole run with SIGKILL at a named point.

`CLOVER_BATCH_FAULT="<point>[:<n>]"` (read by the driver, passed to workers as part of the job context via
`CLOVER_BATCH_FAULT_PID`) kills the driver process at the n-th time `<point>` is reached by any process of the run
on this machine (counted in a file under the temp folder). Points: `listing`, `inference` (after a generate()
call), `writing` (between the temporary part file and its commit). Unset, this does nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile

log = logging.getLogger(__name__)

FAULT_ENV = "CLOVER_BATCH_FAULT"
FAULT_PID_ENV = "CLOVER_BATCH_FAULT_PID"


def fault_config() -> dict[str, str]:
    """The fault settings of this process, to forward to Ray workers (empty when none is set)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return {}
    return {FAULT_ENV: spec, FAULT_PID_ENV: os.environ.get(FAULT_PID_ENV, str(os.getpid()))}


def fault_point(name: str) -> None:
    """SIGKILL the driver (and this process) if the configured fault names this point and its count is reached."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    point, _, count = spec.partition(":")
    if point != name:
        return
    pid = int(os.environ.get(FAULT_PID_ENV, os.getpid()))
    counter = os.path.join(tempfile.gettempdir(), f"clover-batch-fault-{pid}-{name}")
    fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, b"x")  # appends are atomic, so processes count together
        reached = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if reached < int(count or 1):
        return
    log.warning("fault injection: killing process %d at %s", pid, name)
    os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
