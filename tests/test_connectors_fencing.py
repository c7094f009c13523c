"""The output lock and its fencing, on a local folder, memory:// and the S3 server: one run at a time, takeovers of
dead or stalled runs, and takeovers raced against a commit between its lock check and its publish (threads paused
at the sink's fault points), which must never leave a document with two rows. Also the retry swap (swap_in)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from clover_batch.connectors import faults
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import (
    LOCK,
    STAGED_DIR,
    OutputBusy,
    OutputLock,
    clean_temporaries,
    read_index,
    read_lock,
    read_output,
    recover_staged,
    stage_replacement,
    swap_in,
    write_part,
)
from clover_batch.pipeline.rows import OUTPUT_SCHEMA

STORES = ["local", "memory", "s3"]


@pytest.fixture
def location(request, tmp_path):
    store = request.param
    if store == "local":
        return Location(str(tmp_path / "out"))
    if store == "memory":
        return Location(f"memory://fence-{uuid.uuid4().hex[:8]}/out")
    s3 = request.getfixturevalue("s3_server")
    import boto3

    bucket = "fence-" + uuid.uuid4().hex[:12]
    boto3.client("s3", endpoint_url=s3["endpoint_url"], aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    return Location(f"s3://{bucket}/out", s3)


def _rows(ids, status="ok", run="r"):
    return pa.Table.from_pylist([{"doc_id": i, "status": status, "source_uri": f"f/{i}", "run_id": run} for i in ids],
                                OUTPUT_SCHEMA)


def _ids(location) -> list[str]:
    table = read_output(location)
    return [] if table is None else sorted(table.column("doc_id").to_pylist())


def _lock(location, run_id, **kwargs) -> OutputLock:
    return OutputLock(location, run_id, settle_s=0.01, **kwargs)


def _take_over(location, run_id) -> tuple[OutputLock, pa.Array]:
    """What a new run does first: take the (stale) lock, publish what is staged, read the done set."""
    lock = _lock(location, run_id, stale_s=-1)  # every lock counts as stale: the old owner "stalled"
    lock.acquire()
    index = read_index(location)
    recovery = recover_staged(location, index.column("doc_id"), run_id, lock.took_over_from)
    return lock, pa.concat_tables([index, recovery.index]).column("doc_id")


class Paused:
    """Run fn in a thread that stops at fault point `point` until released."""

    def __init__(self, point: str, fn):
        self.point, self.fn = point, fn
        self.reached, self.go = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.result = None

    def __enter__(self):
        def wait() -> None:
            if threading.current_thread() is self.thread:
                self.reached.set()
                assert self.go.wait(30)

        def body() -> None:
            try:
                self.result = self.fn()
            except BaseException as e:
                self.error = e

        self._hook = faults.hook(self.point, wait)
        self._hook.__enter__()
        self.thread = threading.Thread(target=body)
        self.thread.start()
        assert self.reached.wait(30), f"never reached {self.point}"
        return self

    def release(self):
        self.go.set()
        self.thread.join(30)
        self._hook.__exit__(None, None, None)

    def __exit__(self, *exc):
        if not self.go.is_set():  # a failed assertion before release: do not leave the thread waiting
            self.release()


@pytest.mark.parametrize("location", STORES, indirect=True)
def test_takeover_between_check_and_publish_never_doubles_a_row(location):
    """The race the fencing exists for: run-a's lock check passes, run-a stalls, run-b takes the lock over and
    reads its done set, then run-a's publish lands. run-b adopted the staged part, so the late publish writes the
    same part again and every document keeps one row."""
    a = _lock(location, "run-a", heartbeat_s=3600)
    a.acquire()
    with Paused("checked", lambda: write_part(location, _rows(["d1", "d2"], run="run-a"), "run-a")) as stalled:
        b, done = _take_over(location, "run-b")
        assert b.took_over_from == "run-a"
        assert sorted(done.to_pylist()) == ["d1", "d2"]  # run-b will not process them again
        stalled.release()
    assert stalled.error is None  # the late publish found its part already published: nothing to undo
    write_part(location, _rows(["d3"], run="run-b"), "run-b")
    assert _ids(location) == ["d1", "d2", "d3"]
    with pytest.raises(OutputBusy, match="run run-a no longer holds the lock"):
        write_part(location, _rows(["d4"], run="run-a"), "run-a")
    assert _ids(location) == ["d1", "d2", "d3"]
    a.release()  # releasing a lost lock leaves the new owner's in place
    assert read_lock(location)["run_id"] == "run-b"
    b.release()
    assert read_lock(location) is None


@pytest.mark.parametrize("location", STORES, indirect=True)
def test_takeover_between_stage_and_check_fences_the_old_run(location):
    """run-a staged its part, then stalled before its check: run-b publishes the staged part (its rows are whole and
    made with the same settings), and run-a's check fails, so run-a commits nothing itself."""
    a = _lock(location, "run-a", heartbeat_s=3600)
    a.acquire()
    with Paused("committing", lambda: write_part(location, _rows(["d1"], run="run-a"), "run-a")) as stalled:
        b, done = _take_over(location, "run-b")
        assert done.to_pylist() == ["d1"]
        stalled.release()
    assert isinstance(stalled.error, OutputBusy)
    assert _ids(location) == ["d1"]
    b.release()


@pytest.mark.parametrize("location", STORES, indirect=True)
def test_orphans_staged_after_a_takeover_are_dropped_or_adopted_never_doubled(location):
    """run-a loses its lock to run-b, then stages d1 and d9 (its check fails: orphans). run-b processes d1 itself and
    is killed while its own part with d5 is checked but not yet published (paused). run-c takes over from run-b: it
    publishes run-b's part first (it may still land), drops run-a's orphan that shares d1 with a committed row, and
    adopts run-a's orphan with d9, which no run committed."""
    a = _lock(location, "run-a", heartbeat_s=3600)
    a.acquire()
    b, _ = _take_over(location, "run-b")
    for ids in (["d1"], ["d9"], ["d5"]):
        with pytest.raises(OutputBusy):
            write_part(location, _rows(ids, run="run-a"), "run-a")  # staged, then fenced: orphans
    write_part(location, _rows(["d1"], run="run-b"), "run-b")
    with Paused("checked", lambda: write_part(location, _rows(["d5"], run="run-b"), "run-b")) as stalled:
        c, done = _take_over(location, "run-c")
        assert c.took_over_from == "run-b"
        assert sorted(done.to_pylist()) == ["d1", "d5", "d9"]
        stalled.release()
    assert stalled.error is None
    rows = {r["doc_id"]: r["run_id"] for r in read_output(location).to_pylist()}
    assert len(read_output(location)) == 3 and rows == {"d1": "run-b", "d5": "run-b", "d9": "run-a"}
    fs, root = location.filesystem()
    fs.invalidate_cache()
    assert not fs.exists(f"{root.rstrip('/')}/{STAGED_DIR}") or fs.find(f"{root.rstrip('/')}/{STAGED_DIR}") == []
    for lock in (a, b, c):
        lock.release()


def test_run_killed_after_staging_is_published_by_the_next(tmp_path):
    """SIGKILL between staging and the check (a whole part, not yet visible): the next run publishes it once."""
    out = tmp_path / "out"
    script = (
        "from clover_batch.connectors.fs import Location\n"
        "from clover_batch.connectors.sink import OutputLock, write_part\n"
        "from test_connectors_fencing import _rows\n"
        f"loc = Location({str(out)!r})\n"
        "OutputLock(loc, 'run-k', settle_s=0.01).acquire()\n"
        "write_part(loc, _rows(['k1', 'k2'], run='run-k'), 'run-k')\n"
    )
    env = {**os.environ, "CLOVER_BATCH_FAULT": "committing", "PYTHONPATH": os.path.dirname(__file__)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    location = Location(str(out))
    assert read_output(location) is None  # staged only: invisible
    assert duckdb.sql(f"select count(*) from glob('{out}/*.parquet')").fetchall()[0][0] == 0
    with _lock(location, "run-next") as lock:  # the killed process's lock is taken over at once (dead pid)
        assert lock.took_over_from == "run-k"
        recovery = recover_staged(location, read_index(location).column("doc_id"), "run-next", lock.took_over_from)
        assert len(recovery.published) == 1 and recovery.dropped == []
    assert _ids(location) == ["k1", "k2"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("location", ["local", "memory"], indirect=True)
def test_output_lock_one_run_at_a_time(location):
    fs, root = location.filesystem()
    path = f"{root.rstrip('/')}/{LOCK}"
    with _lock(location, "run-a", heartbeat_s=0.05):
        first = json.loads(fs.cat_file(path))
        assert (first["run_id"], first["pid"], first["host"]) == ("run-a", os.getpid(), socket.gethostname())
        with pytest.raises(OutputBusy, match=r"being written by run run-a .*pid \d+"):
            _lock(location, "run-b").acquire()
        beat = f"{root.rstrip('/')}/_heartbeats/run-a.json"
        t0 = json.loads(fs.cat_file(beat))["heartbeat"]
        time.sleep(0.3)
        assert json.loads(fs.cat_file(beat))["heartbeat"] > t0  # the heartbeat thread runs ...
        assert json.loads(fs.cat_file(path)) == first  # ... and never rewrites the lock itself
    assert not fs.exists(path) and not fs.exists(beat)  # released

    # a lock left by a killed process on this host is taken over at once
    fs.pipe_file(path, json.dumps({"run_id": "killed", "host": socket.gethostname(), "pid": _dead_pid(),
                                   "heartbeat": time.time()}).encode())
    with _lock(location, "run-c") as c:
        assert json.loads(fs.cat_file(path))["run_id"] == "run-c" and c.took_over_from == "killed"

    # another host's lock: live while its heartbeat (file or lock) is fresh, taken over once older than stale_s
    other = {"run_id": "remote", "host": "elsewhere", "pid": 1, "heartbeat": time.time() - 500}
    fs.pipe_file(path, json.dumps(other).encode())
    fs.pipe_file(f"{root.rstrip('/')}/_heartbeats/remote.json", json.dumps({"heartbeat": time.time()}).encode())
    with pytest.raises(OutputBusy, match="remote"):
        _lock(location, "run-d", stale_s=60).acquire()
    fs.pipe_file(f"{root.rstrip('/')}/_heartbeats/remote.json", json.dumps({"heartbeat": time.time() - 61}).encode())
    with _lock(location, "run-d", stale_s=60):
        assert json.loads(fs.cat_file(path))["run_id"] == "run-d"

    # an unparsable lock is judged by its file's age: fresh means busy
    fs.pipe_file(path, b"{torn")
    with pytest.raises(OutputBusy, match="being written by run None"):
        _lock(location, "run-e").acquire()
    with _lock(location, "run-e", stale_s=-1):
        assert read_lock(location)["run_id"] == "run-e"


@pytest.mark.parametrize("location", ["local", "memory"], indirect=True)
def test_a_stalled_owner_notices_the_takeover_and_cannot_commit(location):
    a = _lock(location, "run-a", heartbeat_s=0.05)
    a.acquire()
    b, _ = _take_over(location, "run-b")
    time.sleep(0.3)
    assert a.lost and read_lock(location)["run_id"] == "run-b"
    a.release()
    b.release()
    with pytest.raises(OutputBusy, match=r"run run-b no longer holds the lock .*\(run None does\)"):
        write_part(location, _rows(["late"]), "run-b")  # a missing lock fences too
    assert _ids(location) == []


@pytest.mark.parametrize("location", STORES, indirect=True)
def test_swap_in_replaces_each_old_row_in_place(location):
    """Retried documents: their new rows take the old rows' places, part by part; other rows are untouched."""
    with _lock(location, "r1"):
        write_part(location, _rows(["a", "b"], status="read_error", run="r1"), "r1")
        write_part(location, _rows(["c"], status="inference_error", run="r1"), "r1")
        write_part(location, _rows(["d"], run="r1"), "r1")
    index = read_index(location)
    old_parts = dict(zip(index.column("doc_id").to_pylist(), index.column("part").to_pylist(), strict=True))
    parts_before = set(index.column("part").to_pylist())
    with _lock(location, "r2"):
        staged = stage_replacement(location, _rows(["a", "c"], run="r2"), "r2")
        assert _ids(location) == ["a", "b", "c", "d"]  # staged rows are invisible
        written = swap_in(location, staged, old_parts, "r2")
    assert sorted(written) == sorted({old_parts["a"], old_parts["c"]})
    rows = {r["doc_id"]: (r["status"], r["run_id"]) for r in read_output(location).to_pylist()}
    assert len(read_output(location)) == 4
    assert rows == {"a": ("ok", "r2"), "b": ("read_error", "r1"), "c": ("ok", "r2"), "d": ("ok", "r1")}
    assert set(read_index(location).column("part").to_pylist()) == parts_before  # rewritten in place
    fs, _ = location.filesystem()
    assert not fs.exists(staged)


def test_swap_in_upgrades_a_part_written_before_todays_columns(tmp_path):
    """A retry after an upgrade: the old part lacks columns rows have now (page_sources, decode_forwards); its kept
    rows get nulls there, the new row keeps its values, and the part takes today's schema."""
    out = Location(str(tmp_path / "out"))
    newer = ("page_sources", "decode_forwards")
    assert all(name in OUTPUT_SCHEMA.names for name in newer)
    old_schema = pa.schema([f for f in OUTPUT_SCHEMA if f.name not in newer])
    with _lock(out, "r1"):
        write_part(out, _rows(["a", "b"], status="read_error", run="r1").select(old_schema.names), "r1")
    index = read_index(out)
    old_parts = dict(zip(index.column("doc_id").to_pylist(), index.column("part").to_pylist(), strict=True))
    new_row = _rows(["a"], run="r2").to_pylist()[0]
    new_row.update(decode_forwards=7, page_sources={"markdown": 2, "plain": 0, "ocr": 0, "plain_fallback": 0})
    with _lock(out, "r2"):
        swap_in(out, stage_replacement(out, pa.Table.from_pylist([new_row], OUTPUT_SCHEMA), "r2"), old_parts, "r2")
    table = read_output(out)
    assert table.schema.names == OUTPUT_SCHEMA.names
    rows = {r["doc_id"]: r for r in table.to_pylist()}
    assert (rows["a"]["status"], rows["a"]["run_id"], rows["a"]["decode_forwards"]) == ("ok", "r2", 7)
    assert rows["a"]["page_sources"]["markdown"] == 2
    assert (rows["b"]["status"], rows["b"]["decode_forwards"], rows["b"]["page_sources"]) == ("read_error", None, None)


def test_swap_killed_midway_leaves_each_document_one_row(tmp_path):
    """SIGKILL after the first of two parts is rewritten: one document has its new row, the other its old one."""
    out = Location(str(tmp_path / "out"))
    with _lock(out, "r1"):
        write_part(out, _rows(["a"], status="read_error", run="r1"), "r1")
        write_part(out, _rows(["b"], status="read_error", run="r1"), "r1")
    index = read_index(out)
    old_parts = dict(zip(index.column("doc_id").to_pylist(), index.column("part").to_pylist(), strict=True))
    script = (
        "from clover_batch.connectors.fs import Location\n"
        "from clover_batch.connectors.sink import OutputLock, stage_replacement, swap_in\n"
        "from test_connectors_fencing import _rows\n"
        f"loc = Location({out.uri!r})\n"
        "OutputLock(loc, 'r2', settle_s=0.01).acquire()\n"
        f"swap_in(loc, stage_replacement(loc, _rows(['a', 'b'], run='r2'), 'r2'), {old_parts!r}, 'r2')\n"
    )
    env = {**os.environ, "CLOVER_BATCH_FAULT": "swapped:1", "PYTHONPATH": os.path.dirname(__file__)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    rows = read_output(out).to_pylist()
    assert sorted(r["doc_id"] for r in rows) == ["a", "b"]
    assert sorted(r["run_id"] for r in rows) == ["r1", "r2"]  # one swapped, one not: each has exactly one row
    assert duckdb.sql(f"select count(*), count(distinct doc_id) from '{out.uri}/*.parquet'").fetchall() == [(2, 2)]
    for part in index.column("part").to_pylist():
        pq.read_table(part)
    # the next run removes the staged rows that were never swapped in; the output is untouched
    assert clean_temporaries(out) >= 1
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file() and "_replace" in p.parts]
    assert sorted(r["run_id"] for r in read_output(out).to_pylist()) == ["r1", "r2"]
