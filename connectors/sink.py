"""The Parquet sink: result parts committed atomically, so a killed run never leaves a half-written file visible.

Layout of an output folder:
    part-<run_id>-<uuid>.parquet     committed parts; each row is one finished document
    _tmp/<name>.parquet.tmp          parts being written (local filesystems only), cleaned up by the next run
    _reports/<run_id>.json           one run report per run
    _job.json                        what the rows were made with (model, task, decode); see `check_manifest`

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
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from clover_batch.connectors.faults import fault_point
from clover_batch.connectors.fs import Location

log = logging.getLogger(__name__)

TMP_DIR = "_tmp"
REPORTS_DIR = "_reports"
MANIFEST = "_job.json"


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
        os.replace(tmp, final)
    else:
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        fault_point("writing")
        fs.pipe_file(final, buffer.getvalue())
    return location.join(name)


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

    The first run writes `settings` to `_job.json`; later runs must bring the same settings, else
    `OutputConflict` names each setting that differs. Without this guard a scheduled re-run with, say, a new
    instruction would skip every done document and leave old and new answers side by side. Returns True when
    this call wrote the manifest.
    """
    fs, root = location.filesystem()
    path = posixpath.join(root.rstrip("/"), MANIFEST)
    canonical = json.loads(json.dumps(settings, sort_keys=True, default=str))
    if fs.exists(path):
        try:
            stored = json.loads(fs.cat_file(path))
        except (ValueError, OSError) as e:
            raise OutputConflict(f"{location.join(MANIFEST)} is unreadable ({e}); remove it only if every row in "
                                 f"the output was made by this job") from None
        if stored != canonical:
            old, new = _flatten(stored), _flatten(canonical)
            changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
                       if old.get(k) != new.get(k)]
            raise OutputConflict(
                f"output {location.uri} holds rows made with other settings ({'; '.join(changed)}). Write to a new "
                f"output.uri, or delete {MANIFEST} there to accept rows made with both settings."
            )
        return False
    if _is_local(fs):
        os.makedirs(root, exist_ok=True)
    fs.pipe_file(path, json.dumps(canonical, indent=2, sort_keys=True).encode())
    return True
