"""Attempt records: which documents were inside a model replica's process when it died, kept in the output folder.

A document that kills the infer actor's process (out of memory, a native crash) would otherwise be retried by
Ray's actor restarts forever, failing the run on every re-run. So each document's attempts are written down
before it runs and removed when its result (or its error) comes back; a record that stays means the process
died with the document inside.

    <output>/_attempts/<doc_id>.json     [{"run_id", "host", "pid", "time", "alone"}, ...]

One object per document: a document is in one actor at a time (Ray retries a batch only after its actor died),
so no two writers ever touch the same object, and no object is shared between actors. `alone` says the document
was the only one in the engine, so the death is its own; a death with others inside may have been any of theirs.
Records of documents that have a committed row are ignored (the planner never asks for them) and deleted at the
next run's start (`forget_committed`).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.compute as pc
from clover_batch.connectors.fs import Location

log = logging.getLogger(__name__)

ATTEMPTS_DIR = "_attempts"


@dataclass(frozen=True)
class Attempt:
    """One time a document entered a replica's engine and did not come back."""

    run_id: str
    host: str
    pid: int
    time: float  # unix seconds when it entered
    alone: bool  # no other document was in the engine with it

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.time))
        return f"{when} UTC on {self.host} pid {self.pid}{' (alone)' if self.alone else ''}"


class AttemptStore:
    """Read, add and remove attempt records of documents, for one run writing to `output`."""

    def __init__(self, output: Location, run_id: str) -> None:
        self.run_id = run_id
        self.fs, root = output.filesystem()
        self.root = posixpath.join(root.rstrip("/"), ATTEMPTS_DIR)
        self._local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def _path(self, doc_id: str) -> str:
        return posixpath.join(self.root, f"{doc_id}.json")

    def unfinished(self, doc_ids: Iterable[str]) -> dict[str, list[Attempt]]:
        """The attempts each document did not come back from; documents without any are left out."""
        paths = {self._path(d): d for d in doc_ids}
        if not paths:
            return {}
        found = self.fs.cat(list(paths), on_error="omit")  # one concurrent request per document on object stores
        out = {}
        for path, data in found.items():
            try:
                out[paths[self.fs._strip_protocol(path)]] = [Attempt(**a) for a in json.loads(data)]
            except (ValueError, TypeError, KeyError) as e:  # torn by hand: the attempts are unknown, not zero
                log.warning("unreadable attempt record %s (%s); counting it as one attempt", path, e)
                out[paths[self.fs._strip_protocol(path)]] = [Attempt(self.run_id, "?", 0, 0.0, False)]
        return out

    def enter(self, doc_ids: dict[str, bool], past: dict[str, list[Attempt]] | None = None) -> None:
        """Record that these documents (doc_id -> alone) are entering a replica's engine now. `past`: their
        attempts on record, when the caller has just read them with `unfinished` (saves a read per document)."""
        if not doc_ids:
            return
        if past is None:
            past = self.unfinished(doc_ids)
        now, host, pid = time.time(), socket.gethostname(), os.getpid()
        bodies = {self._path(d): json.dumps([asdict(a) for a in [*past.get(d, []), Attempt(self.run_id, host, pid,
                                                                                            now, alone)]]).encode()
                  for d, alone in doc_ids.items()}
        if self._local:
            os.makedirs(self.root, exist_ok=True)
            for path, body in bodies.items():  # whole or not at all: a record torn by a crash would be misread
                tmp = f"{path}.{pid}.tmp"
                with open(tmp, "wb") as f:
                    f.write(body)
                os.replace(tmp, path)
        else:
            self.fs.pipe(bodies)  # one PUT per document, concurrent on object stores

    def finish(self, doc_ids: Iterable[str]) -> None:
        """The documents came back from the engine (a result or an error): their records go."""
        paths = [self._path(d) for d in doc_ids]
        if paths:
            try:
                self.fs.rm(paths)
            except FileNotFoundError:
                for path in paths:  # some had no record (local rm stops at the first missing one)
                    if self.fs.exists(path):
                        self.fs.rm(path)


def forget_committed(output: Location, committed: pa.Array) -> int:
    """Delete the records of documents that now have a committed row (a crashed row, or a result that came back
    before a record could be removed); returns how many."""
    fs, root = output.filesystem()
    folder = posixpath.join(root.rstrip("/"), ATTEMPTS_DIR)
    fs.invalidate_cache()
    if not fs.exists(folder):
        return 0
    paths = [p for p in fs.ls(folder, detail=False) if p.endswith(".json")]
    ids = pa.array([posixpath.basename(p)[: -len(".json")] for p in paths], pa.string())
    done = [p for p, hit in zip(paths, pc.is_in(ids, value_set=committed).to_pylist(), strict=True) if hit]
    if done:
        fs.rm(done)
    return len(done)
