"""Retrying failed rows (`run --retry-failed`), and Ray's own retry of a write task whose worker died after its
commit. Runs that need an injected fault are the real CLI in a subprocess, joined to the session's Ray by address
(the fault settings reach the workers through the job's runtime_env)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from clover_batch.connectors.fs import Location, list_document_table
from clover_batch.connectors.sink import OutputLock, read_output, write_part
from clover_batch.jobs.runner import DEFAULT_RETRY_STATUSES, pipeline_options, plan_run, run
from clover_batch.jobs.spec import parse_job
from clover_batch.pipeline.rows import OUTPUT_SCHEMA
from conftest import job_raw, requires_engine, write_job


def _cli(job, address, *args, env=None, timeout=240):
    cmd = [sys.executable, "-m", "clover_batch.jobs.cli", "run", str(job), "--address", address, *args]
    return subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)


def _duckdb_rows(location: Location) -> list[tuple]:
    """(source file name, status) of every row, read by duckdb itself through the output's filesystem."""
    fs, root = location.filesystem()
    con = duckdb.connect()
    con.register_filesystem(fs)
    scheme = location.uri.split("://")[0] + "://" if "://" in location.uri else ""
    return con.sql(f"select regexp_extract(source_uri, '[^/]+$'), status from read_parquet('{scheme}{root}/*.parquet') "
                   "order by 1").fetchall()


@requires_engine
def test_nightly_sequence_on_s3_ends_with_one_ok_row_per_document(ray_session, s3_server, s3_bucket, tmp_path):
    """run; a new document and a transient read failure; run again; --retry-failed; run again."""
    bucket, client = s3_bucket
    for i in range(3):
        client.put_object(Bucket=bucket, Key=f"in/memo-{i}.txt", Body=f"Memo {i}: the meeting moved.".encode())
    raw = job_raw(f"s3://{bucket}/in/", f"s3://{bucket}/out/", input={"storage_options": s3_server},
                  output={"storage_options": s3_server, "rows_per_file": 2})
    raw["decode"]["max_new_tokens"] = 4
    job = write_job(tmp_path / "job.yaml", raw)
    out = Location(f"s3://{bucket}/out/", s3_server)

    first = run(parse_job(raw)).report
    assert first.by_status == {"ok": 3}

    client.put_object(Bucket=bucket, Key="in/memo-new.txt", Body=b"A new memo: budgets are due.")
    client.put_object(Bucket=bucket, Key="in/memo-flaky.txt", Body=b"Another memo: the office moves.")
    second = _cli(job, ray_session, env={"CLOVER_BATCH_FAULT_DOC": "read_denied:memo-flaky"})
    assert second.returncode == 3, second.stdout + second.stderr  # completed, with an infrastructure failure
    assert "2 processed, 3 already done" in second.stdout and "--retry-failed" in second.stderr
    rows = dict(_duckdb_rows(out))
    assert rows["memo-flaky.txt"] == "read_error" and rows["memo-new.txt"] == "ok" and len(rows) == 5
    flaky = [r for r in read_output(out).to_pylist() if r["source_uri"].endswith("memo-flaky.txt")]
    assert "injected fault: access denied" in flaky[0]["error"]

    retried = _cli(job, ray_session, "--retry-failed")  # the outage is over
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert "1 processed, 1 retried, 4 already done" in retried.stdout

    last = run(parse_job(raw)).report
    assert (last.processed, last.skipped_done, last.output_rows) == (0, 5, 5)
    assert _duckdb_rows(out) == [(f"memo-{i}.txt", "ok") for i in range(3)] + [
        ("memo-flaky.txt", "ok"), ("memo-new.txt", "ok")]
    con = duckdb.connect()
    con.register_filesystem(out.filesystem()[0])
    assert con.sql(f"select count(*), count(distinct doc_id) from read_parquet('s3://{bucket}/out/*.parquet')"
                   ).fetchall() == [(5, 5)]


def test_plan_retries_infrastructure_failures_only_unless_named(tmp_path):
    """Which documents a run takes up, from the rows already in the output (no Ray needed to plan)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    statuses = {"a.txt": "read_error", "b.txt": "empty", "c.txt": "ok", "d.txt": "crashed", "e.txt": "internal_error"}
    for name in [*statuses, "new.txt"]:
        (docs / name).write_text("x" if name != "b.txt" else "")
    out = Location(str(tmp_path / "out"))
    listed = {r["source_uri"].rsplit("/", 1)[-1]: r["doc_id"]
              for r in list_document_table(Location(str(docs)), ["*"], []).to_pylist()}
    with OutputLock(out, "r1"):
        for name, status in statuses.items():
            write_part(out, pa.Table.from_pylist([{"doc_id": listed[name], "status": status}], OUTPUT_SCHEMA), "r1")
    opts = pipeline_options(parse_job(job_raw(str(docs), out.uri)), "r2")

    def planned(retry):
        with OutputLock(out, "r2"):
            plan = plan_run(opts, ["*"], [], retry_statuses=retry)
        names = {u.rsplit("/", 1)[-1]: r for u, r in zip(plan.pending.column("source_uri").to_pylist(),
                                                          plan.pending.column("replaces").to_pylist(), strict=True)}
        return names, plan

    names, plan = planned(())
    assert names == {"new.txt": False} and plan.skipped_done == 5 and plan.retried == 0
    names, plan = planned(DEFAULT_RETRY_STATUSES)
    assert names == {"new.txt": False, "a.txt": True, "d.txt": True, "e.txt": True}
    assert plan.retried == pc.sum(plan.pending.column("replaces")).as_py() == 3
    assert set(plan.old_parts) == {listed["a.txt"], listed["d.txt"], listed["e.txt"]}
    names, _ = planned(("empty",))
    assert names == {"new.txt": False, "b.txt": True}


def test_retry_status_must_name_a_status(tmp_path):
    from clover_batch.jobs.cli import app
    from typer.testing import CliRunner

    job = write_job(tmp_path / "job.yaml", job_raw(str(tmp_path), str(tmp_path / "out")))
    result = CliRunner().invoke(app, ["run", str(job), "--retry-status", "read_eror"])
    assert result.exit_code == 2  # usage
    assert "--retry-status read_eror: not a row status (known: ok, read_error," in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["run", str(job), "--retry-status", "ok"])
    assert result.exit_code == 2 and "rows that succeeded are not run again" in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["run", str(job), "--fail-on-status", "encryptd"])
    assert result.exit_code == 2 and "--fail-on-status encryptd: not a row status" in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()


@requires_engine
def test_write_worker_killed_after_its_commit_is_retried_without_doubling(ray_session, tmp_path):
    """Ray retries a write task whose worker died after the part was visible: the retry writes the same part."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"memo-{i}.txt").write_text(f"Memo {i}: the meeting moved to room {i}.")
    out = tmp_path / "out"
    raw = job_raw(str(docs), str(out), output={"rows_per_file": 1}, resources={"batch_size": 1})
    raw["decode"]["max_new_tokens"] = 4
    job = write_job(tmp_path / "job.yaml", raw)
    cmd = [sys.executable, "-m", "clover_batch.jobs.cli", "run", str(job), "--address", ray_session]
    proc = subprocess.Popen(cmd, env={**os.environ, "CLOVER_BATCH_FAULT": "committed:2:exit"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=240)
    counter = os.path.join(tempfile.gettempdir(), f"clover-batch-fault-{proc.pid}-committed")
    try:
        assert proc.returncode == 0, output  # the driver lived; Ray retried the task
        assert os.path.getsize(counter) >= 5  # 4 parts committed, and the killed task's commits done again
    finally:
        if os.path.exists(counter):
            os.remove(counter)
    table = read_output(Location(str(out)))
    assert table.num_rows == 4 and len(set(table.column("doc_id").to_pylist())) == 4
    assert set(table.column("status").to_pylist()) == {"ok"}
    assert duckdb.sql(f"select count(*), count(distinct doc_id) from '{out}/*.parquet'").fetchall() == [(4, 4)]

