"""A run killed with SIGKILL at several points, then re-run: exactly one row per document, nothing unreadable.

The killed run is the real CLI in a subprocess, joined to the session's Ray by address; CLOVER_BATCH_FAULT makes
the driver (listing) or a Ray worker (inference, writing) SIGKILL the driver at that point.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import duckdb
import pyarrow.parquet as pq
import pytest
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import committed_parts, read_output
from clover_batch.jobs.runner import run
from clover_batch.jobs.spec import parse_job
from conftest import job_raw, requires_engine, write_job

pytestmark = requires_engine


@pytest.mark.parametrize("fault", ["listing", "inference:2", "writing:2"])
def test_kill_then_rerun_gives_one_row_per_document(ray_session, tmp_path, fault):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"memo-{i}.txt").write_text(f"Memo {i}: the meeting moved to room {i}.")
    out = tmp_path / "out"
    raw = job_raw(str(docs), str(out), output={"rows_per_file": 1}, resources={"batch_size": 1})
    raw["decode"]["max_new_tokens"] = 4
    job = write_job(tmp_path / "job.yaml", raw)

    env = {**os.environ, "CLOVER_BATCH_FAULT": fault}
    cmd = [sys.executable, "-m", "clover_batch.jobs.cli", "run", str(job), "--address", ray_session]
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr

    # whatever the killed run left is readable, has no duplicates, and no report claims the run finished
    location = Location(str(out))
    survivors = read_output(location)
    committed = 0 if survivors is None else survivors.num_rows
    if survivors is not None:
        assert len(set(survivors.column("doc_id").to_pylist())) == committed
    for part in committed_parts(location):
        pq.read_table(part)
    assert not (out / "_reports").exists()
    if fault == "listing":
        assert committed == 0
    if fault.startswith("writing"):
        assert len(os.listdir(out / "_tmp")) >= 1  # the half-written part, invisible to readers

    report = run(parse_job(raw)).report
    assert report.skipped_done == committed
    assert report.processed == 6 - committed
    table = pq.read_table(str(out))
    assert table.num_rows == 6
    assert len(set(table.column("doc_id").to_pylist())) == 6
    assert set(table.column("status").to_pylist()) == {"ok"}
    assert duckdb.sql(f"select count(*), count(distinct doc_id) from '{out}/*.parquet'").fetchall() == [(6, 6)]
    assert os.listdir(out / "_tmp") == []


def test_overlapping_run_is_refused_and_nothing_is_doubled(ray_session, tmp_path):
    """A scheduled run that starts while the previous one is still writing stops at once (OutputBusy)."""
    import time

    from clover_batch.connectors.sink import LOCK, OutputBusy

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"memo-{i}.txt").write_text(f"Memo {i}: " + "the budget moved " * 20)
    out = tmp_path / "out"
    raw = job_raw(str(docs), str(out), output={"rows_per_file": 1}, resources={"batch_size": 1})
    job = write_job(tmp_path / "job.yaml", raw)
    cmd = [sys.executable, "-m", "clover_batch.jobs.cli", "run", str(job), "--address", ray_session]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / LOCK).exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.05)
        with pytest.raises(OutputBusy, match=rf"being written by run \S+ \(host .*pid {first.pid}"):
            run(parse_job(raw))
    finally:
        output, _ = first.communicate(timeout=240)
    assert first.returncode == 0, output
    table = read_output(Location(str(out)))
    assert table.num_rows == 4 and len(set(table.column("doc_id").to_pylist())) == 4
    assert not (out / LOCK).exists()
    again = run(parse_job(raw)).report  # the next scheduled run finds everything done
    assert (again.processed, again.skipped_done) == (0, 4)


def test_kill_while_writing_to_s3_then_rerun(ray_session, s3_server, s3_bucket, tmp_path):
    """The object-store commit path (one PUT per part, lock by If-None-Match) under a SIGKILL mid-run."""
    bucket, client = s3_bucket
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(5):
        (docs / f"memo-{i}.txt").write_text(f"Memo {i}: the meeting moved to room {i}.")
    out = f"s3://{bucket}/results/"
    raw = job_raw(str(docs), out, output={"rows_per_file": 1, "storage_options": s3_server},
                  resources={"batch_size": 1})
    raw["decode"]["max_new_tokens"] = 4
    job = write_job(tmp_path / "job.yaml", raw)
    env = {**os.environ, "CLOVER_BATCH_FAULT": "writing:3"}
    cmd = [sys.executable, "-m", "clover_batch.jobs.cli", "run", str(job), "--address", ray_session]
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr

    location = Location(out, s3_server)
    survivors = read_output(location)
    committed = 0 if survivors is None else survivors.num_rows
    # the kill lands as the third part is written: the first is committed; the second is committed too, or (write
    # tasks run side by side) between its write and its commit, and then not visible either; nothing half-visible
    assert committed in (1, 2)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="results/")["Contents"]]
    assert "results/_lock.json" in keys and not any(k.startswith("results/_reports/") for k in keys)

    # the killed driver's lock is taken over at once (its pid is gone on this host); one row per document. The
    # dead driver's write task of the second part runs in a worker that Ray stops only some time after the driver
    # is gone, so that part may still commit before the rerun lists the output: the rerun skips what is committed
    # when it starts, and processes exactly the rest
    report = run(parse_job(raw)).report
    assert committed <= report.skipped_done <= 2
    assert report.processed == 5 - report.skipped_done
    table = read_output(location)
    assert table.num_rows == 5 and len(set(table.column("doc_id").to_pylist())) == 5
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="results/")["Contents"]]
    assert "results/_lock.json" not in keys
