"""Fault injection for the interruption tests: kill the whole run with SIGKILL at a named point.

`CLOVER_BATCH_FAULT="<point>[:<n>]"` (read by the driver, passed to workers as part of the job context via
`CLOVER_BATCH_FAULT_PID`) kills the driver process at the n-th time `<point>` is reached in one process. Points:
`listing`, `inference`, `writing` (between the temporary part file and its commit). Unset, this does nothing.
"""

from __future__ import annotations

import logging
import os
import signal
from collections import Counter

log = logging.getLogger(__name__)

FAULT_ENV = "CLOVER_BATCH_FAULT"
FAULT_PID_ENV = "CLOVER_BATCH_FAULT_PID"

_reached: Counter[str] = Counter()


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
    _reached[name] += 1
    if _reached[name] < int(count or 1):
        return
    pid = int(os.environ.get(FAULT_PID_ENV, os.getpid()))
    log.warning("fault injection: killing process %d at %s", pid, name)
    os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
