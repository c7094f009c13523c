"""The Parquet sink: result parts committed atomically and fenced by the output lock, so a killed run never leaves a
half-written file visible and no document ever gets two rows.

Layout of an output folder:
    part-<run_id>-<hash>.parquet     committed parts; each row is one finished document (readers glob these)
    _staged/<run_id>/<name>          whole parts waiting for their lock check; the next run publishes or drops them
    _replace/<run_id>/<name>         new rows of retried documents, waiting to be swapped into the parts holding the
                                     old rows (`swap_in`); the next run removes what a killed run left
    _tmp/                            local filesystems: bytes being written; the next run removes them
    _reports/<run_id>.json           one run report per run
    _job.json                        what the rows were made with (model, task, decode); see `check_manifest`
    _lock.json                       the run that holds the output; written only when a run takes it (`OutputLock`)
    _heartbeats/<run_id>.json        the holder's heartbeat
    _attempts/<doc_id>.json          documents inside a model replica when its process died (connectors/attempts.py)
Readers (pyarrow datasets, pandas, duckdb on `*.parquet`) see only the committed parts: everything else starts with
an underscore or lives in a folder that does.

Commit protocol (`write_part`), the same on every store, needing only atomic single-object writes and a listing
that shows what was written before it (POSIX filesystems, S3, GCS, Azure, memory://):
1. stage: the whole part goes to `_staged/<run_id>/<name>` (locally a temporary file, fsynced, renamed there; on
   object stores one PUT, visible only once complete).
2. check: `_lock.json` names this run (a missing lock fails too).
3. publish: rename (local) or server-side copy (object stores) to `<name>`, then drop the staged copy.
A run that takes the lock then, before it reads which documents are done, publishes every staged part none of
whose documents has a committed row and drops the others (`recover_staged`).

What the fencing guarantees (and why it needs no conditional write): a part that passed its check at time t was
staged before t, while the lock still named its run; a run that takes the lock over writes `_lock.json` after t and
lists `_staged/` after that, so it finds the part and publishes it (or finds it published). If the old run then
completes its publish, it writes the same bytes under the same name. A part staged after the takeover fails its
check and is never published by its run; the next run drops it if any of its documents has a row by then, and
publishes it otherwise (its rows are complete and made with the same settings, see `check_manifest`). So a run that
lost its lock can still make a part visible only if its successor already adopted that exact part, and no document
ever has two committed rows. The part's name comes from the run id and its rows' doc ids, so a write task that Ray
retries after its worker died writes the same name again instead of a second copy.

Retried documents (`run --retry-failed`) keep one row each: their new rows are written under `_replace/`, then the
driver, alone and under the lock, rewrites each part that holds an old row with the new row in its place, in one
atomic write per part (`swap_in`). A kill at any point leaves each document with its old row or its new one.
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from clover_batch.connectors.faults import fault_point
from clover_batch.connectors.fs import Location

log = logging.getLogger(__name__)

TMP_DIR = "_tmp"
STAGED_DIR = "_staged"
REPLACE_DIR = "_replace"
REPORTS_DIR = "_reports"
HEARTBEATS_DIR = "_heartbeats"
MANIFEST = "_job.json"
LOCK = "_lock.json"

# the committed rows' doc_id, status, part file and version (what content the row was made from: a table input's
# changed text has the same doc_id and another version, jobs/runner.py plan_run)
INDEX_SCHEMA = pa.schema([("doc_id", pa.string()), ("status", pa.string()), ("part", pa.string()),
                          ("version", pa.string())])


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _root(location: Location):
    fs, root = location.filesystem()
    return fs, root.rstrip("/")


def committed_parts(location: Location) -> list[str]:
    """Paths (inside the filesystem) of committed part files, sorted."""
    fs, root = _root(location)
    fs.invalidate_cache()  # object-store listings are cached per filesystem instance; parts may be new
    if not fs.exists(root):
        return []
    return sorted(p for p in fs.ls(root, detail=False) if posixpath.basename(p).endswith(".parquet"))


def _arrow_fs(fs) -> pafs.FileSystem:
    """pyarrow's own local filesystem where possible (faster), else fsspec behind pyarrow's adapter."""
    return pafs.LocalFileSystem() if _is_local(fs) else pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def _dataset(fs, parts: list[str], columns: list[str]) -> ds.Dataset:
    # From the listed paths, with the columns' types from one footer: no per-file metadata request before the
    # (multi-threaded) read, which matters with thousands of parts on an object store.
    schema = pq.read_schema(parts[0], filesystem=_arrow_fs(fs))
    return ds.FileSystemDataset.from_paths(parts, schema=pa.schema([schema.field(c) for c in columns]),
                                           format=ds.ParquetFileFormat(), filesystem=_arrow_fs(fs))


def read_output(location: Location, columns: list[str] | None = None) -> pa.Table | None:
    """All committed rows of an output folder, or None when it has none."""
    fs, _ = location.filesystem()
    parts = committed_parts(location)
    if not parts:
        return None
    if columns is not None:
        return _dataset(fs, parts, columns).to_table()
    return pa.concat_tables([pq.read_table(p, filesystem=fs) for p in parts], promote_options="default")


def read_index(location: Location) -> pa.Table:
    """doc_id, status, part path and version of every committed row (INDEX_SCHEMA), read in parallel, as Arrow
    columns."""
    fs, _ = location.filesystem()
    parts = committed_parts(location)
    if not parts:
        return INDEX_SCHEMA.empty_table()
    table = _dataset(fs, parts, ["doc_id", "status", "version"]).to_table(
        columns=["doc_id", "status", "__filename", "version"])
    return table.rename_columns(INDEX_SCHEMA.names).cast(INDEX_SCHEMA)


def done_doc_ids(location: Location) -> set[str]:
    """Ids of documents that already have a committed row."""
    return set(read_index(location).column("doc_id").to_pylist())


def clean_temporaries(location: Location) -> int:
    """Remove what a killed run left that must not be published: half-written bytes (`_tmp/`) and retried rows
    that were never swapped in (`_replace/`; those documents keep their old rows). Returns how many files."""
    fs, root = _root(location)
    fs.invalidate_cache()
    removed = 0
    for folder in (TMP_DIR, REPLACE_DIR):
        path = posixpath.join(root, folder)
        if not fs.exists(path):
            continue
        stale = fs.find(path)
        for p in stale:
            fs.rm(p)
        removed += len(stale)
        if _is_local(fs):
            _remove_empty_dirs(path)
    if removed:
        log.info("removed %d temporary files left by an interrupted run", removed)
    return removed


def _remove_empty_dirs(path: str) -> None:
    for folder, _, _ in sorted(os.walk(path), key=lambda w: -len(w[0])):
        if folder != path:
            try:
                os.rmdir(folder)
            except OSError:
                pass


def part_name(table: pa.Table, run_id: str) -> str:
    """A part's name: the run id and a hash of its doc ids, so a retried write task writes the same name again."""
    doc_ids = "\n".join(sorted(table.column("doc_id").to_pylist()))
    return f"part-{run_id}-{hashlib.sha256(doc_ids.encode()).hexdigest()[:16]}.parquet"


def _parquet_bytes(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def _write_whole(fs, root: str, path: str, data: bytes) -> None:
    """Write `path` so that it appears complete or not at all."""
    if _is_local(fs):
        tmp_dir = posixpath.join(root, TMP_DIR)
        os.makedirs(tmp_dir, exist_ok=True)
        os.makedirs(posixpath.dirname(path), exist_ok=True)
        tmp = posixpath.join(tmp_dir, f"{posixpath.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        fault_point("writing")
        os.replace(tmp, path)
    else:
        fault_point("writing")
        fs.pipe_file(path, data)


def _publish(fs, staged: str, final: str) -> None:
    if _is_local(fs):
        os.replace(staged, final)
    else:
        fs.copy(staged, final)
        fs.rm(staged)


def write_part(location: Location, table: pa.Table, run_id: str) -> str:
    """Commit `table` as one part: stage, check the lock, publish (see the module docstring). Returns its URI.

    Raises OutputBusy when this run no longer holds the output's lock: its rows are not committed by it (the run
    that took the lock over publishes them only if none of their documents has a row by then).
    """
    fs, root = _root(location)
    name = part_name(table, run_id)
    staged = posixpath.join(root, STAGED_DIR, run_id, name)
    final = posixpath.join(root, name)
    _write_whole(fs, root, staged, _parquet_bytes(table))
    fault_point("committing")
    check_lock_owner(location, run_id)
    fault_point("checked")
    try:
        _publish(fs, staged, final)
    except FileNotFoundError:
        # The run that took the lock over published (or dropped) this staged part between our check and publish.
        fs.invalidate_cache()
        if not fs.exists(final):
            raise OutputBusy(f"run {run_id} lost the lock on {location.uri} while committing {name}; the run "
                             f"that holds it now handles that part") from None
    fault_point("committed")
    return location.join(name)


@dataclass
class Recovery:
    """What `recover_staged` did with the parts a killed or fenced-out run left staged."""

    published: list[str] = field(default_factory=list)  # part names made visible
    dropped: list[str] = field(default_factory=list)  # staged paths removed: some document already had a row
    index: pa.Table = field(default_factory=INDEX_SCHEMA.empty_table)  # index rows of the published parts


def recover_staged(location: Location, committed: pa.Array, run_id: str, previous_owner: str | None = None
                   ) -> Recovery:
    """Publish every staged part none of whose documents is in `committed` or in a part published before it; drop
    the others. Call it right after taking the lock, before reading which documents are done (module docstring).

    Order matters when two staged parts share a document (a part the previous owner staged and checked, and a part
    an older run staged after losing the lock): the previous owner's part may still be on its way to being published
    by its own worker, so its parts go first (`previous_owner`, the run whose lock was taken over), then the other
    runs' newest first.
    """
    fs, root = _root(location)
    staged_root = posixpath.join(root, STAGED_DIR)
    fs.invalidate_cache()
    recovery = Recovery()
    if not fs.exists(staged_root):
        return recovery
    def run_of(path: str) -> str:
        return posixpath.basename(posixpath.dirname(path))

    newest_first = sorted(fs.find(staged_root), key=run_of, reverse=True)  # run ids start with their start time
    seen: set[str] = set()
    tables = []
    for path in sorted(newest_first, key=lambda p: run_of(p) != previous_owner):  # stable: keeps newest first
        try:
            table = pq.read_table(path, filesystem=fs, columns=["doc_id", "status", "version"])
        except Exception as e:  # staging writes whole files, so this is damage from outside: not ours to publish
            log.warning("dropping unreadable staged part %s: %s", path, e)
            _remove(fs, path)
            recovery.dropped.append(path)
            continue
        ids = table.column("doc_id")
        if pc.any(pc.is_in(ids, value_set=committed)).as_py() or seen & set(ids.to_pylist()):
            _remove(fs, path)
            recovery.dropped.append(path)
            continue
        check_lock_owner(location, run_id)
        name = posixpath.basename(path)
        try:
            _publish(fs, path, posixpath.join(root, name))
        except FileNotFoundError:  # its own (late) worker published it meanwhile: same name, same bytes
            pass
        seen.update(ids.to_pylist())
        recovery.published.append(name)
        tables.append(table.append_column("part", pa.array([posixpath.join(root, name)] * len(table), pa.string())))
    if tables:
        recovery.index = pa.concat_tables(tables).select(INDEX_SCHEMA.names).cast(INDEX_SCHEMA)
    if _is_local(fs):
        _remove_empty_dirs(staged_root)
    if recovery.published or recovery.dropped:
        log.warning("output %s: published %d parts left staged by an earlier run, dropped %d", location.uri,
                    len(recovery.published), len(recovery.dropped))
    return recovery


def _remove(fs, path: str) -> None:
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass


def stage_replacement(location: Location, table: pa.Table, run_id: str) -> str:
    """Write the new rows of retried documents under `_replace/<run_id>/`, invisible to readers, for `swap_in`."""
    fs, root = _root(location)
    path = posixpath.join(root, REPLACE_DIR, run_id, part_name(table, run_id))
    _write_whole(fs, root, path, _parquet_bytes(table))
    return path


def swap_in(location: Location, staged: str, old_parts: Mapping[str, str], run_id: str) -> list[str]:
    """Replace the old rows of the retried documents in `staged` (a path from `stage_replacement`) by their new
    rows. `old_parts` maps doc_id -> the committed part holding its old row. Each such part is rewritten once,
    atomically (local rename, one PUT on object stores), so every document has its old row or its new one at any
    moment, never both or neither. Documents without an old row (none expected) are committed as a new part.
    Only the driver calls this, one call at a time, so no two writers rewrite one part at once. Returns the
    part paths written."""
    fs, root = _root(location)
    new = pq.read_table(staged, filesystem=fs)
    groups: dict[str | None, list[int]] = {}
    for i, doc_id in enumerate(new.column("doc_id").to_pylist()):
        groups.setdefault(old_parts.get(doc_id), []).append(i)
    written = []
    for part, rows in groups.items():
        if part is None:
            continue
        replaced = new.take(rows)
        old = pq.read_table(part, filesystem=fs)
        keep = old.filter(pc.invert(pc.is_in(old.column("doc_id"), value_set=replaced.column("doc_id"))))
        if old.schema.names == new.schema.names:
            merged = pa.concat_tables([keep, replaced.cast(old.schema)])
        else:  # a part written before rows had today's columns (page_sources, the decoding statistics, ...)
            merged = pa.concat_tables([_with_schema(keep, new.schema), replaced])
        fault_point("swapping")
        check_lock_owner(location, run_id)
        _write_whole(fs, root, part, _parquet_bytes(merged))
        fault_point("swapped")
        written.append(part)
    if None in groups:
        uri = write_part(location, new.take(groups[None]), run_id)
        written.append(posixpath.join(root, uri.rsplit("/", 1)[-1]))
    fs.rm(staged)
    return written


def _with_schema(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table`'s rows in `schema`: its columns cast, nulls for the columns it lacks (an older part's rows, kept
    beside new rows when a retry rewrites the part, which then takes today's schema)."""
    n = table.num_rows
    return pa.table([table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(n, f.type)
                     for f in schema], schema=schema)


def write_report(location: Location, run_id: str, report: dict[str, Any]) -> str:
    """Write the JSON run report under `_reports/`; returns its URI."""
    fs, root = _root(location)
    path = posixpath.join(root, REPORTS_DIR, f"{run_id}.json")
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


def check_manifest(location: Location, settings: dict[str, Any], has_rows: bool | None = None) -> bool:
    """Guard an output folder against mixing rows made with different settings (model, task, decode).

    The first run writes `settings` to `_job.json` (again while no row is committed, so a first run that failed
    before writing anything does not pin its settings); later runs must bring the same settings, else
    `OutputConflict` names each setting that differs. Without this guard a scheduled re-run with, say, a new
    instruction would skip every done document and leave old and new answers side by side. Returns True when
    this call wrote the manifest. `has_rows`: whether the output holds rows, where they are not Parquet parts in
    `location` (an Iceberg table); None: look for committed parts.
    """
    fs, root = _root(location)
    path = posixpath.join(root, MANIFEST)
    canonical = json.loads(json.dumps(settings, sort_keys=True, default=str))
    rows = bool(committed_parts(location)) if has_rows is None else has_rows
    if fs.exists(path) and rows:  # a manifest with no rows yet (a failed first run) is redone
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
    """Another live run is writing to the same output folder, or this run lost the lock to one."""


def check_lock_owner(location: Location, run_id: str) -> None:
    """The fencing check: `_lock.json` must name `run_id`. A missing lock fails too: the run that held it finished
    and removed it, so a late worker of an older run must not commit."""
    held = read_lock(location)
    if held is None or held.get("run_id") != run_id:
        raise OutputBusy(f"run {run_id} no longer holds the lock on {location.uri} (run "
                         f"{(held or {}).get('run_id')} does); not committing")


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
    commit each twice, and one would delete the other's half-written parts. `_lock.json` names the owner (run id,
    host, pid, when taken). It is written only when a run takes the lock: the owner's heartbeat goes to its own
    `_heartbeats/<run_id>.json`, so an owner that stalled and resumes can never write its name back over a run
    that took the lock over (the fencing argument in the module docstring relies on that).
    - Taking a free lock is a create-if-absent (O_EXCL locally, If-None-Match on S3), so two runs cannot both
      create it. A stale lock (no heartbeat for `stale_s`, or written on this host by a process that no longer
      exists) is overwritten, then read back after `settle_s`: of two runs taking over at once, the one whose
      write lands last keeps it and the other stops before touching anything. Should both pass the read-back, the
      first loses at its next lock check (every commit checks), and nothing it committed is doubled, since the
      second lists staged parts only after its own write.
    - Writes of the lock are atomic (temp file + rename locally, one PUT on object stores), so a reader never sees
      a torn lock. A lock that cannot be parsed is judged by its file's age.
    - The heartbeat thread reads the lock each beat and stops (`lost`) once another run owns it.
    """

    def __init__(self, location: Location, run_id: str, *, heartbeat_s: float = 10.0, stale_s: float = 120.0,
                 settle_s: float = 0.2) -> None:
        self.location, self.run_id = location, run_id
        self.heartbeat_s, self.stale_s, self.settle_s = heartbeat_s, stale_s, settle_s
        self.fs, self.root = _root(location)
        self.path = posixpath.join(self.root, LOCK)
        self.lost = False
        self.took_over_from: str | None = None  # the run whose stale lock this one took over, if any
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

    def _heartbeat_path(self, run_id: str) -> str:
        return posixpath.join(self.root, HEARTBEATS_DIR, f"{run_id}.json")

    def _beat_once(self) -> None:
        path = self._heartbeat_path(self.run_id)
        if _is_local(self.fs):
            os.makedirs(posixpath.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(json.dumps({"heartbeat": time.time()}).encode())
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, json.dumps({"heartbeat": time.time()}).encode())

    def _last_sign_of_life(self, lock: dict[str, Any]) -> float:
        last = float(lock.get("heartbeat", 0))
        if lock.get("run_id"):
            try:
                last = max(last, float(json.loads(self.fs.cat_file(self._heartbeat_path(lock["run_id"])))["heartbeat"]))
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                pass
        return last

    def _stale(self, lock: dict[str, Any]) -> str | None:
        """Why `lock` may be taken over, or None when its owner looks alive."""
        age = time.time() - self._last_sign_of_life(lock)
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
                        f"{time.time() - self._last_sign_of_life(held):.0f} s ago); wait for it to finish. A lock "
                        f"without a heartbeat for {self.stale_s:.0f} s is taken over."
                    )
                log.warning("taking over the lock of run %s on %s: %s", held.get("run_id"), self.location.uri, why)
                self._overwrite()
                time.sleep(self.settle_s)
                now = read_lock(self.location) or {}
                if now.get("run_id") != self.run_id:
                    raise OutputBusy(f"output {self.location.uri} was just locked by run {now.get('run_id')}")
                self.took_over_from = held.get("run_id")
                if self.took_over_from:
                    _remove(self.fs, self._heartbeat_path(self.took_over_from))
        self._beat_once()
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
                self._beat_once()
            except Exception as e:  # a missed heartbeat is not fatal; a long outage lets another run take over
                log.warning("output lock heartbeat failed: %s", e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        held = read_lock(self.location)
        if held is not None and held.get("run_id") == self.run_id:
            self.fs.rm(self.path)
        _remove(self.fs, self._heartbeat_path(self.run_id))

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_lock(location: Location) -> dict[str, Any] | None:
    """The output's lock: None when there is none; an unparsable one reads as its file's age."""
    fs, root = _root(location)
    path = posixpath.join(root, LOCK)
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
