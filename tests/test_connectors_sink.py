"""The Parquet sink: committed parts only, temporaries invisible to readers and cleaned up, reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import (
    clean_temporaries,
    committed_parts,
    done_doc_ids,
    read_output,
    write_part,
    write_report,
)
from clover_batch.pipeline.rows import OUTPUT_SCHEMA


def _rows(ids):
    return pa.Table.from_pylist([{"doc_id": i, "status": "ok", "source_uri": f"f/{i}"} for i in ids], OUTPUT_SCHEMA)


def test_parts_commit_and_doc_ids(tmp_path):
    out = Location(str(tmp_path / "out"))
    assert done_doc_ids(out) == set()
    write_part(out, _rows(["a", "b"]), "r1")
    write_part(out, _rows(["c"]), "r1")
    assert len(committed_parts(out)) == 2
    assert done_doc_ids(out) == {"a", "b", "c"}
    assert read_output(out).schema.equals(OUTPUT_SCHEMA)
    assert not os.listdir(tmp_path / "out" / "_tmp")


def test_killed_writer_leaves_no_visible_part(tmp_path):
    """SIGKILL between the temporary file and its commit: readers see nothing, the next run cleans up."""
    out = tmp_path / "out"
    script = (
        "import pyarrow as pa\n"
        "from clover_batch.connectors.fs import Location\n"
        "from clover_batch.connectors.sink import write_part\n"
        "from clover_batch.pipeline.rows import OUTPUT_SCHEMA\n"
        f"write_part(Location({str(out)!r}), pa.Table.from_pylist([{{'doc_id': 'z'}}], OUTPUT_SCHEMA), 'r')\n"
    )
    env = {**os.environ, "CLOVER_BATCH_FAULT": "writing"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert len(os.listdir(out / "_tmp")) == 1  # the half-done part exists ...
    assert committed_parts(Location(str(out))) == []  # ... but is not a part
    assert pq.ParquetDataset(str(out)).files == []  # pyarrow ignores _tmp
    assert duckdb.sql(f"select count(*) from glob('{out}/*.parquet')").fetchall()[0][0] == 0
    assert clean_temporaries(Location(str(out))) == 1
    assert os.listdir(out / "_tmp") == []


def test_s3_parts_and_report(s3_server, s3_bucket):
    import s3fs

    bucket, _ = s3_bucket
    out = Location(f"s3://{bucket}/results", s3_server)
    uri = write_part(out, _rows(["x", "y"]), "r9")
    assert uri.startswith(f"s3://{bucket}/results/part-r9-") and uri.endswith(".parquet")
    assert done_doc_ids(out) == {"x", "y"}
    report_uri = write_report(out, "r9", {"processed": 2})
    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": s3_server["endpoint_url"]})
    assert json.loads(fs.cat(report_uri)) == {"processed": 2}
    assert clean_temporaries(out) == 0


@pytest.mark.parametrize("n_parts", [1, 3])
def test_output_reads_with_pyarrow_pandas_duckdb(tmp_path, n_parts):
    out = Location(str(tmp_path))
    for i in range(n_parts):
        write_part(out, _rows([f"d{i}a", f"d{i}b"]), "r")
    write_report(out, "r", {"x": 1})
    assert pq.read_table(str(tmp_path)).num_rows == 2 * n_parts
    assert len(pq.read_table(str(tmp_path)).to_pandas()) == 2 * n_parts
    assert duckdb.sql(f"select count(distinct doc_id) from '{tmp_path}/*.parquet'").fetchall()[0][0] == 2 * n_parts


def test_retried_write_of_same_rows_replaces_its_part(tmp_path):
    """Ray retries a write task whose worker died after committing: the retry must not add a second copy."""
    out = Location(str(tmp_path))
    first = write_part(out, _rows(["b", "a"]), "r1")
    again = write_part(out, _rows(["a", "b"]), "r1")
    assert first == again
    assert len(committed_parts(out)) == 1 and read_output(out).num_rows == 2
    assert write_part(out, _rows(["a", "b"]), "r2") != first  # another run is another part


@pytest.mark.parametrize("uri", ["local", "memory://manifest-test/out"])
def test_manifest_guards_output_against_other_settings(tmp_path, uri):
    from clover_batch.connectors.sink import MANIFEST, OutputConflict, check_manifest

    location = Location(str(tmp_path / "out") if uri == "local" else uri)
    settings = {"model": {"source": "tiny", "dtype": "float32"}, "task": {"kind": "summarize",
                "instruction": "Summarize."}, "decode": {"max_new_tokens": 8}}
    changed = {**settings, "task": {"kind": "summarize", "instruction": "Summarize in French."},
               "decode": {"max_new_tokens": 8, "seed": 1}}
    assert check_manifest(location, changed) is True  # first run writes it
    assert check_manifest(location, settings) is True  # no row committed yet: a failed first run pins nothing
    fs, root = location.filesystem()
    assert json.loads(fs.cat_file(f"{root.rstrip('/')}/{MANIFEST}")) == settings
    write_part(location, _rows(["d1"]), "r1")
    assert check_manifest(location, json.loads(json.dumps(settings))) is False  # same settings: fine

    with pytest.raises(OutputConflict) as e:
        check_manifest(location, changed)
    message = str(e.value)
    assert "task.instruction: 'Summarize.' -> 'Summarize in French.'" in message
    assert "decode.seed: None -> 1" in message and "max_new_tokens" not in message
    assert json.loads(fs.cat_file(f"{root.rstrip('/')}/{MANIFEST}")) == settings  # not overwritten

    fs.pipe_file(f"{root.rstrip('/')}/{MANIFEST}", b"{not json")
    with pytest.raises(OutputConflict, match="unreadable"):
        check_manifest(location, settings)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("uri", ["local", "memory://lock-test/out"])
def test_output_lock_one_run_at_a_time(tmp_path, uri):
    import socket
    import time

    from clover_batch.connectors.sink import LOCK, OutputBusy, OutputLock

    location = Location(str(tmp_path / "out") if uri == "local" else uri)
    fs, root = location.filesystem()
    path = f"{root.rstrip('/')}/{LOCK}"

    with OutputLock(location, "run-a", heartbeat_s=0.05, settle_s=0.01):
        first = json.loads(fs.cat_file(path))
        assert (first["run_id"], first["pid"], first["host"]) == ("run-a", os.getpid(), socket.gethostname())
        with pytest.raises(OutputBusy, match=r"being written by run run-a .*pid \d+"):
            OutputLock(location, "run-b", settle_s=0.01).acquire()
        time.sleep(0.3)
        assert json.loads(fs.cat_file(path))["heartbeat"] > first["heartbeat"]  # the heartbeat thread runs
    assert not fs.exists(path)  # released

    # a lock left by a killed process on this host is taken over at once
    fs.pipe_file(path, json.dumps({"run_id": "killed", "host": socket.gethostname(), "pid": _dead_pid(),
                                   "heartbeat": time.time()}).encode())
    with OutputLock(location, "run-c", settle_s=0.01):
        assert json.loads(fs.cat_file(path))["run_id"] == "run-c"

    # another host's lock: live while its heartbeat is fresh, taken over once it is older than stale_s
    other = {"run_id": "remote", "host": "elsewhere", "pid": 1, "heartbeat": time.time()}
    fs.pipe_file(path, json.dumps(other).encode())
    with pytest.raises(OutputBusy, match="remote"):
        OutputLock(location, "run-d", stale_s=60, settle_s=0.01).acquire()
    fs.pipe_file(path, json.dumps({**other, "heartbeat": time.time() - 61}).encode())
    with OutputLock(location, "run-d", stale_s=60, settle_s=0.01):
        assert json.loads(fs.cat_file(path))["run_id"] == "run-d"


@pytest.mark.parametrize("uri", ["local", "memory://lock-fence/out"])
def test_output_lock_fences_a_run_that_lost_it(tmp_path, uri):
    import time

    from clover_batch.connectors.sink import LOCK, OutputBusy, OutputLock, read_lock

    location = Location(str(tmp_path / "out") if uri == "local" else uri)
    fs, root = location.filesystem()
    path = f"{root.rstrip('/')}/{LOCK}"
    a = OutputLock(location, "run-a", heartbeat_s=0.05, settle_s=0.01)
    a.acquire()
    assert not OutputLock(location, "run-x", settle_s=0.01)._create()  # create-if-absent: the lock exists
    write_part(location, _rows(["d1"]), "run-a")  # the holder commits

    # run-a stalls past stale_s; run-b takes over; run-a's heartbeat must not take it back
    fs.pipe_file(path, json.dumps({**read_lock(location), "heartbeat": time.time() - 500}).encode())
    b = OutputLock(location, "run-b", stale_s=120, settle_s=0.01)
    b.acquire()
    time.sleep(0.3)
    assert a.lost and read_lock(location)["run_id"] == "run-b"
    with pytest.raises(OutputBusy, match=r"run run-a no longer holds the lock .*run run-b does"):
        write_part(location, _rows(["d2"]), "run-a")
    assert [r["doc_id"] for r in read_output(location).to_pylist()] == ["d1"]
    a.release()  # releasing a lost lock leaves the new owner's in place
    assert read_lock(location)["run_id"] == "run-b"
    b.release()

    # an unparsable lock is judged by its file's age: fresh means busy
    fs.pipe_file(path, b"{torn")
    with pytest.raises(OutputBusy, match="being written by run None"):
        OutputLock(location, "run-c", settle_s=0.01).acquire()
    with OutputLock(location, "run-c", stale_s=-1, settle_s=0.01):
        assert read_lock(location)["run_id"] == "run-c"
