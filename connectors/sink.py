"""The Parquet sink: result parts committed atomically, so a killed run never leaves a half-written file visible.

Layout of an output folder:
    part-<run_id>-<uuid>.parquet     committed parts; each row is one finished document
    _tmp/<name>.parquet.tmp          parts being written (local filesystems only), cleaned up by the next run
    _reports/<run_id>.json           one run report per run
    _job.json                        what the rows were made with (model, task, decode); see `check_manifest`
    _lock.json                       the run writing now (run id, host, pid, heartbeat); see `OutputLock`

Commit protocol, chosen so it needs no rename on object stores:
- Local filesystems: write `_tmp/<name>.parquet.tmp`, fsync, then rename into place (rename is atomic on POSIX).
- Object stores (s3, gs, az, memory): serialize the part in memory and upload it with one put; an object becomes
  visible only once its upload completes, so a reader never sees a partial object.
- A document is done iff its doc_id is in a committed part. Re-runs skip done documents, and a run writes each
  document into exactly one part, so a run killed at any point and re-run yields exactly one row per document.
- A part's name is derived from the run id and its rows' doc ids, so when Ray retries a write task whose worker
  died after the commit, the retry overwrites the same part with the same rows instead of adding a duplicate.
Readers (pyarrow datasets, pandas, duckdb on `*.parquet`) ignore `_tmp/` and `_reports/` (leading underscore, and
no `.parquet` suffix on temporary files).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import posixpath
import socket
import threading
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from clover_batch.connectors.faults import fault_point
from clover_batch.connectors.fs import Location

log = logging.getLogger(__name__)

TMP_DIR = "_tmp"
REPORTS_DIR = "_reports"
MANIFEST = "_job.json"
LOCK = "_lock.json"


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def committed_parts(location: Location) -> list[str]:
    """Paths (inside the filesystem) of committed part files, sorted."""
    fs, root = location.filesystem()
    root = root.rstrip("/")
    fs.invalidate_cache()  # object-store listings are cached per filesystem instance; parts may be new
    if not fs.exists(root):
        return []
    return sorted(p for p in fs.ls(root, detail=False) if posixpath.basename(p).endswith(".parquet"))


def read_output(location: Location, columns: list[str] | None = None) -> pa.Table | None:
    """All committed rows of an output folder, or None when it has none."""
    fs, _ = location.filesystem()
    parts = committed_parts(location)
    if not parts:
        return None
    return pa.concat_tables(
        [pq.read_table(p, filesystem=fs, columns=columns) for p in parts], promote_options="default"
    )


def done_doc_ids(location: Location) -> set[str]:
    """Ids of documents that already have a committed row."""
    table = read_output(location, columns=["doc_id"])
    return set() if table is None else set(table.column("doc_id").to_pylist())


def clean_temporaries(location: Location) -> int:
    """Remove parts left half-written by a killed run; returns how many."""
    fs, root = location.filesystem()
    tmp = posixpath.join(root.rstrip("/"), TMP_DIR)
    fs.invalidate_cache()
    if not fs.exists(tmp):
        return 0
    stale = fs.ls(tmp, detail=False)
    for path in stale:
        fs.rm(path)
    if stale:
        log.info("removed %d temporary parts left by an interrupted run", len(stale))
    return len(stale)


def write_part(location: Location, table: pa.Table, run_id: str) -> str:
    """Commit `table` as one new part file; returns its URI."""
    fs, root = location.filesystem()
    root = root.rstrip("/")
    doc_ids = "\n".join(sorted(table.column("doc_id").to_pylist()))
    name = f"part-{run_id}-{hashlib.sha256(doc_ids.encode()).hexdigest()[:16]}.parquet"
    final = posixpath.join(root, name)
    if _is_local(fs):
        tmp_dir = posixpath.join(root, TMP_DIR)
        os.makedirs(tmp_dir, exist_ok=True)
        tmp = posixpath.join(tmp_dir, f"{name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        fault_point("writing")
        _check_lock_owner(location, run_id)
        os.replace(tmp, final)
    else:
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        fault_point("writing")
        _check_lock_owner(location, run_id)
        fs.pipe_file(final, buffer.getvalue())
    return location.join(name)


def _check_lock_owner(location: Location, run_id: str) -> None:
    """Fencing: a run whose lock was taken over (or whose driver was killed and replaced) must not commit."""
    held = read_lock(location)
    if held is not None and held.get("run_id") != run_id:
        raise OutputBusy(f"run {run_id} no longer holds the lock on {location.uri} (run {held.get('run_id')} "
                         f"does); not committing")


def write_report(location: Location, run_id: str, report: dict[str, Any]) -> str:
    """Write the JSON run report under `_reports/`; returns its URI."""
    fs, root = location.filesystem()
    path = posixpath.join(root.rstrip("/"), REPORTS_DIR, f"{run_id}.json")
    if _is_local(fs):
        os.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.pipe_file(path, json.dumps(report, indent=2, sort_keys=True).encode())
    return location.join(REPORTS_DIR, f"{run_id}.json")


class OutputConflict(ValueError):
    """The output folder holds rows made by a different job configuration."""


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): value}


def check_manifest(location: Location, settings: dict[str, Any]) -> bool:
    """Guard an output folder against mixing rows made with different settings (model, task, decode).

    The first run writes `settings` to `_job.json` (again while no row is committed, so a first run that failed
    before writing anything does not pin its settings); later runs must bring the same settings, else
    `OutputConflict` names each setting that differs. Without this guard a scheduled re-run with, say, a new
    instruction would skip every done document and leave old and new answers side by side. Returns True when
    this call wrote the manifest.
    """
    fs, root = location.filesystem()
    path = posixpath.join(root.rstrip("/"), MANIFEST)
    canonical = json.loads(json.dumps(settings, sort_keys=True, default=str))
    if fs.exists(path) and committed_parts(location):  # a manifest with no rows yet (a failed first run) is redone
        try:
            stored = json.loads(fs.cat_file(path))
        except (ValueError, OSError) as e:
            raise OutputConflict(f"{location.join(MANIFEST)} is unreadable ({e}); remove it only if every row in "
                                 f"the output was made by this job") from None
        old, new = _flatten(stored), _flatten(canonical)
        # a setting absent on one side and null on the other is the same (a newer version adding an option)
        changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
                   if old.get(k) != new.get(k)]
        if changed:
            raise OutputConflict(
                f"output {location.uri} holds rows made with other settings ({'; '.join(changed)}). Write to a new "
                f"output.uri, or delete {MANIFEST} there to accept rows made with both settings."
            )
        return False
    if _is_local(fs):
        os.makedirs(root, exist_ok=True)
    fs.pipe_file(path, json.dumps(canonical, indent=2, sort_keys=True).encode())
    return True


class OutputBusy(RuntimeError):
    """Another live run is writing to the same output folder."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class OutputLock:
    """One run at a time per output folder, on any filesystem fsspec writes to.

    Two overlapping runs (a cron job slower than its interval) would both see the same documents as pending and
    commit each twice, and one would delete the other's half-written parts. `_lock.json` holds the owner (run id,
    host, pid) and a heartbeat refreshed every `heartbeat_s`.
    - Taking a free lock is a create-if-absent (O_EXCL locally, If-None-Match on S3), so two runs cannot both
      create it. A stale lock (heartbeat older than `stale_s`, or written on this host by a process that no longer
      exists) is overwritten, then read back after `settle_s`: of two runs taking over at once, the last writer
      keeps it and the other stops before touching anything.
    - Writes of the lock are atomic (temp file + rename locally, one PUT on object stores), so a reader never sees
      a torn lock. A lock that cannot be parsed is judged by its file's age.
    - The heartbeat reads before it writes: once another run has taken the lock over, this one stops refreshing it
      (`lost`), and `write_part` refuses to commit for a run that does not hold the lock (fencing), so workers of a
      run that lost its lock, or outlived their killed driver, cannot add rows.
    """

    def __init__(self, location: Location, run_id: str, *, heartbeat_s: float = 10.0, stale_s: float = 120.0,
                 settle_s: float = 0.2) -> None:
        self.location, self.run_id = location, run_id
        self.heartbeat_s, self.stale_s, self.settle_s = heartbeat_s, stale_s, settle_s
        self.fs, root = location.filesystem()
        self.root = root.rstrip("/")
        self.path = posixpath.join(self.root, LOCK)
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid(),
                           "heartbeat": time.time()}).encode()

    def _overwrite(self) -> None:
        if _is_local(self.fs):
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(self._body())
            os.replace(tmp, self.path)
        else:
            self.fs.pipe_file(self.path, self._body())

    def _create(self) -> bool:
        """Create the lock if there is none; False when another run created it first."""
        try:
            self.fs.pipe_file(self.path, self._body(), mode="create")
            return True
        except FileExistsError:
            return False

    def _stale(self, lock: dict[str, Any]) -> str | None:
        """Why `lock` may be taken over, or None when its owner looks alive."""
        age = time.time() - float(lock.get("heartbeat", 0))
        if age > self.stale_s:
            return f"no heartbeat for {age:.0f} s"
        if lock.get("host") == socket.gethostname() and not _pid_alive(int(lock.get("pid", 0))):
            return f"process {lock.get('pid')} on this host has exited"
        return None

    def acquire(self) -> None:
        if _is_local(self.fs):
            os.makedirs(self.root, exist_ok=True)
        held = read_lock(self.location)
        if not (held is None and self._create()):  # someone holds it, or created it between our read and create
            held = held if held is not None else read_lock(self.location) or {}
            if held.get("run_id") != self.run_id:
                why = self._stale(held)
                if why is None:
                    raise OutputBusy(
                        f"output {self.location.uri} is being written by run {held.get('run_id')} (host "
                        f"{held.get('host')}, pid {held.get('pid')}, heartbeat "
                        f"{time.time() - float(held.get('heartbeat', 0)):.0f} s ago); wait for it to finish. A lock "
                        f"without a heartbeat for {self.stale_s:.0f} s is taken over."
                    )
                log.warning("taking over the lock of run %s on %s: %s", held.get("run_id"), self.location.uri, why)
                self._overwrite()
                time.sleep(self.settle_s)
                now = read_lock(self.location) or {}
                if now.get("run_id") != self.run_id:
                    raise OutputBusy(f"output {self.location.uri} was just locked by run {now.get('run_id')}")
        self._thread = threading.Thread(target=self._beat, name="output-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                held = read_lock(self.location)
                if held is None or held.get("run_id") != self.run_id:
                    self.lost = True
                    log.error("run %s lost the lock on %s to %s", self.run_id, self.location.uri,
                              (held or {}).get("run_id"))
                    return
                self._overwrite()
            except Exception as e:  # a missed heartbeat is not fatal; a long outage lets another run take over
                log.warning("output lock heartbeat failed: %s", e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        held = read_lock(self.location)
        if held is not None and held.get("run_id") == self.run_id:
            self.fs.rm(self.path)

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_lock(location: Location) -> dict[str, Any] | None:
    """The output's lock: None when there is none; an unparsable one reads as its file's age."""
    fs, root = location.filesystem()
    path = posixpath.join(root.rstrip("/"), LOCK)
    fs.invalidate_cache()
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError:
        try:
            modified = fs.modified(path).timestamp()
        except Exception:
            modified = time.time()
        return {"run_id": None, "heartbeat": modified}
