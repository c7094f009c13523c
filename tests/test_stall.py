"""The stall watchdog (jobs/watchdog.py) on a real run: a replica whose engine stops stepping with documents inside
(fault injection: CLOVER_BATCH_FAULT=engine_step:<n>:stall hangs the engine thread before its n-th step) ends the
run with exit 1 within run.stall_timeout_s plus a minute, a diagnosis naming the stalled stage on stderr and in the
run report, the output's lock released; the rows committed before stay, and a re-run completes the rest.

The stalled run is the CLI in a subprocess joined to the session's Ray (of the machine's CPUs), so the fault
setting reaches its replica and nothing else; the other runs are in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from clover_batch.connectors.faults import counter_path
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import read_output
from clover_batch.jobs.runner import run
from clover_batch.jobs.spec import JobSpecError, parse_job
from conftest import job_raw, requires_engine, write_job

pytestmark = requires_engine

STALL_S = 30  # run.stall_timeout_s of the stalled run: past a replica's start on this busy 2-core machine


def _memos(folder, names):
    folder.mkdir(exist_ok=True)
    for i, name in enumerate(names):
        (folder / name).write_text(f"Memo {i}: the meeting moved to room {i}; bring the {name} notes.")


def test_a_replica_that_stops_stepping_ends_the_run_with_a_diagnosis(ray_session, tmp_path):
    docs, out = tmp_path / "docs", tmp_path / "out"
    _memos(docs, [f"first-{i}.txt" for i in range(3)])
    raw = job_raw(str(docs), str(out), input={"parse_timeout_s": 5}, resources={"batch_size": 1, "max_slots": 2})
    first = run(parse_job(raw)).report  # committed before the stall: these rows must stay as they are
    assert first.by_status == {"ok": 3} and first.stall is None
    committed = {r["doc_id"]: r["run_id"] for r in read_output(Location(str(out))).to_pylist()}

    _memos(docs, [f"second-{i}.txt" for i in range(4)])
    job = write_job(tmp_path / "job.yaml", {**raw, "run": {"stall_timeout_s": STALL_S}})
    cmd = [sys.executable, "-m", "clover_batch.jobs.cli", "run", str(job), "--address", ray_session]
    env = {**os.environ, "CLOVER_BATCH_FAULT": "engine_step:3:stall"}  # the engine hangs before its 3rd step
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    counter = counter_path("engine_step", proc.pid)
    try:
        _, stderr = proc.communicate(timeout=STALL_S + 60 + 60)
    finally:
        proc.kill()
        if os.path.exists(counter):
            os.remove(counter)
    took = time.monotonic() - start
    assert proc.returncode == 1, stderr
    assert took < STALL_S + 60, took  # Ray joined, the model loaded, the stall noticed, the run unwound
    text = " ".join(stderr.split())
    assert "run stalled: nothing moved for" in text and f"(run.stall_timeout_s={STALL_S})" in text
    assert "stalled stage: infer: replica 0 holds" in text and "has not stepped for" in text, stderr
    assert "(engine stepping)" in text, stderr
    last = stderr.strip().splitlines()[-1]  # one line naming the cause, last
    assert last.startswith("run stalled: ") and "stalled stage: infer: replica 0" in last, last
    assert "Traceback" not in stderr

    assert not (out / "_lock.json").exists()  # released
    reports = [json.loads(p.read_text()) for p in (out / "_reports").iterdir()]
    stalled = [r for r in reports if r["stall"] is not None]
    assert len(stalled) == 1 and stalled[0]["exit_code"] == 1
    stall = stalled[0]["stall"]
    assert stall["stalled_stage"].startswith("infer: replica 0 holds")
    assert stall["seconds_without_progress"] >= STALL_S
    replica = stall["replicas"][0]
    assert replica["state"] == "stepping" and replica["holding"] >= 1 and replica["steps"] == 2
    assert stall["stages"]["parse"]["count"] >= 1  # the board saw the documents parsed
    assert stall["pending_source"]  # where the pending list came from (the session's Ray has no dashboard)
    assert stalled[0]["resources"]["fits"]

    after = {r["doc_id"]: r["run_id"] for r in read_output(Location(str(out))).to_pylist()}
    assert {d: after[d] for d in committed} == committed  # committed rows stay, from their own run

    again = run(parse_job(raw)).report  # no fault: takes up the rest
    assert again.exit_code == 0 and again.skipped_done + again.processed == 7
    rows = read_output(Location(str(out))).to_pylist()
    assert len(rows) == len({r["doc_id"] for r in rows}) == 7 and {r["status"] for r in rows} == {"ok"}


def test_the_stall_timeout_must_exceed_the_parse_timeout():
    raw = job_raw("in", "out", input={"parse_timeout_s": 300}, run={"stall_timeout_s": 120})
    with pytest.raises(JobSpecError, match=r"run.stall_timeout_s \(120\) must be more than input.parse_timeout_s "
                                           r"\(300\)"):
        parse_job(raw)
    assert parse_job({**raw, "run": {"stall_timeout_s": 0}}).run.stall_timeout_s == 0  # off
    assert parse_job(job_raw("in", "out")).run.stall_timeout_s == 900


def test_the_stall_error_crosses_to_a_ray_client():
    """A ray:// run's driver actor raises it; the client unpickles it, diagnosis, totals and report URI intact."""
    import pickle

    from clover_batch.jobs.runner import Progress, RunTotals, Stalled
    from clover_batch.jobs.watchdog import Diagnosis

    error = Stalled(Diagnosis("run stalled: nothing moved", "infer: replica 0 holds 2 documents", 31.0, "parse"),
                    RunTotals(Progress(total=7, done=3)), "out/_reports/r.json")
    back = pickle.loads(pickle.dumps(error))
    assert (str(back), back.diagnosis, back.totals.progress.done, back.report_uri) == (
        "run stalled: nothing moved", error.diagnosis, 3, "out/_reports/r.json")
