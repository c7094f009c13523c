"""What a scheduler and an operator see of a run: exit codes of real runs of the CLI (0 and 3 with `--json`, 1 for a
model the replicas cannot load, 2 for a bad job, 130 and 143 for SIGINT and SIGTERM), `show --json`, and the run's
Prometheus metrics scraped from the session Ray's metrics endpoint.

Where stdout or signals matter the CLI runs in a subprocess, joined to the session's Ray by address (a
CLOVER_BATCH_FAULT=committed:1:stall hangs a write worker after the first committed part, so a run is still in
progress when the test signals it); elsewhere in this process (typer's CliRunner, stdout and stderr apart).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter

from clover_batch.connectors.faults import counter_path
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import committed_parts, read_output
from clover_batch.jobs.cli import app
from clover_batch.jobs.runner import run
from clover_batch.jobs.spec import parse_job
from conftest import assert_clean_ray_output, job_raw, requires_engine, write_job
from typer.testing import CliRunner

pytestmark = requires_engine


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_batch.jobs.cli", *args], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def _memos(folder, names: list[str]) -> None:
    folder.mkdir(exist_ok=True)
    for i, name in enumerate(names):
        (folder / name).write_text(f"Memo {i}: the meeting moved to room {i}.")


def test_json_report_holds_the_parquet_counts_and_fail_on_status_exits_3(ray_session, tmp_path):
    docs = tmp_path / "docs"
    _memos(docs, ["memo-0.txt", "memo-1.txt", "memo-2.txt"])
    (docs / "empty.txt").write_bytes(b"")
    out = tmp_path / "out"
    raw = job_raw(str(docs), str(out))
    raw["decode"]["max_new_tokens"] = 4
    job = write_job(tmp_path / "job.yaml", raw)

    done = _cli("run", str(job), "--address", ray_session, "--json")
    assert done.returncode == 0, done.stderr  # an empty document is data, not a failure
    report = json.loads(done.stdout)  # stdout is the one JSON document; progress went to stderr
    assert "4/4" in done.stderr and "empty=1 ok=3" in done.stderr
    assert_clean_ray_output(done.stderr)
    rows = read_output(Location(str(out))).to_pylist()
    assert report["by_status"] == report["documents_by_status"] == dict(Counter(r["status"] for r in rows))
    assert report["by_status"] == {"empty": 1, "ok": 3}
    assert (report["processed"], report["output_rows"], report["failures"], report["exit_code"]) == (4, 4, {}, 0)
    assert report["output_tokens"] == sum(r["output_tokens"] or 0 for r in rows) > 0
    assert report["input_tokens"] == sum(r["input_tokens"] or 0 for r in rows) > 0

    shown = CliRunner().invoke(app, ["show", str(out), "--json"])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.stdout)
    assert (summary["rows"], summary["parts"], summary["by_status"]) == (4, len(committed_parts(Location(str(out)))),
                                                                        {"empty": 1, "ok": 3})

    # nothing new to run (no Ray needed), but `empty` named a failure: the output's rows say exit 3
    failed = CliRunner().invoke(app, ["run", str(job), "--json", "--fail-on-status", "empty"])
    assert failed.exit_code == 3, failed.output
    again = json.loads(failed.stdout)
    assert (again["processed"], again["skipped_done"], again["by_status"]) == (0, 4, {})
    assert (again["documents_by_status"], again["failures"], again["exit_code"]) == ({"empty": 1, "ok": 3},
                                                                                     {"empty": 1}, 3)
    assert "1 documents have failed rows (empty=1)" in failed.stderr
    assert "empty: named in fail_on_status; `--retry-status empty` runs those documents again" in failed.stderr
    # the job file can say so too
    raw["run"] = {"fail_on_status": ["empty"]}
    assert run(parse_job(raw)).report.failures == {"empty": 1}


def test_a_bad_job_exits_2_with_nothing_on_stdout(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: j\ninput: {uri: in}\noutput: {uri: out}\ntask: {kind: summarize}\n"
                   "run: {fail_on_status: [encryptd]}\n")
    result = CliRunner().invoke(app, ["run", str(job), "--json"])
    assert result.exit_code == 2 and result.stdout == ""
    assert "run.fail_on_status: Value error, encryptd: not a row status" in result.stderr


def test_a_model_the_replicas_cannot_load_exits_1(ray_session, s3_server, s3_bucket, tmp_path):
    """The checkpoint's small files pass the driver's checks (a URI checkpoint's weights are checked where they
    load); its weights are cut short, so every replica fails to load them: the run fails, naming the file."""
    from clover_batch.jobs.model_cli import write_checkpoint

    bucket, client = s3_bucket
    ckpt = write_checkpoint("tiny", tmp_path / "ckpt")
    for f in sorted(ckpt.iterdir()):
        body = f.read_bytes()
        client.put_object(Bucket=bucket, Key=f"ckpt/{f.name}", Body=body[:-1000] if f.suffix == ".safetensors"
                          else body)
    docs = tmp_path / "docs"
    _memos(docs, ["memo-0.txt"])
    out = tmp_path / "out"
    raw = job_raw(str(docs), str(out), model={"source": f"s3://{bucket}/ckpt/", "storage_options": s3_server,
                                              "cache_dir": str(tmp_path / "cache")})
    result = CliRunner().invoke(app, ["run", str(write_job(tmp_path / "job.yaml", raw))])  # the session's Ray
    assert result.exit_code == 1, result.output
    failed = [line for line in result.stderr.splitlines() if line.startswith("run failed:")]
    assert len(failed) == 1 and "CheckpointError: " in failed[0] and "model.safetensors" in failed[0], result.stderr
    assert read_output(Location(str(out))) is None and not (out / "_lock.json").exists()


def test_sigint_and_sigterm_exit_130_and_143_after_releasing_the_lock(ray_session, tmp_path):
    docs, out = tmp_path / "docs", tmp_path / "out"
    raw = job_raw(str(docs), str(out), output={"rows_per_file": 1}, resources={"batch_size": 1})
    raw["decode"]["max_new_tokens"] = 4
    job = write_job(tmp_path / "job.yaml", raw)
    cmd = [sys.executable, "-m", "clover_batch.jobs.cli", "run", str(job), "--address", ray_session]
    env = {**os.environ, "CLOVER_BATCH_FAULT": "committed:1:stall"}  # a write worker hangs after its first part
    for round_, (sig, code) in enumerate([(signal.SIGINT, 130), (signal.SIGTERM, 143)]):
        _memos(docs, [f"memo-{round_}-{i}.txt" for i in range(3)])  # new documents: this run has work to do
        before = len(committed_parts(Location(str(out))))
        # SIGINT at its default in the child: a shell's background job (nohup, `&`) starts with SIGINT ignored,
        # which the CLI would inherit and respect, as any program does
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        counter = counter_path("committed", proc.pid)  # while it runs: the name holds the driver's start time
        try:
            deadline = time.monotonic() + 180
            while len(committed_parts(Location(str(out)))) == before:
                assert proc.poll() is None and time.monotonic() < deadline, "the run committed nothing"
                time.sleep(0.1)
            proc.send_signal(sig)
            _, stderr = proc.communicate(timeout=120)
        finally:
            proc.kill()
            if os.path.exists(counter):
                os.remove(counter)
        assert proc.returncode == code, stderr
        assert f"run interrupted ({sig.name})" in stderr and "Traceback" not in stderr
        assert not (out / "_lock.json").exists() and os.listdir(out / "_heartbeats") == []
        assert not (out / "_reports").exists()  # an interrupted run reports nothing
    kept = read_output(Location(str(out))).num_rows
    report = run(parse_job(raw)).report  # the next run takes up the rest at once: the lock is free
    assert (report.skipped_done, report.processed, report.exit_code) == (kept, 6 - kept, 0)
    table = read_output(Location(str(out)))
    assert table.num_rows == 6 and len(set(table.column("doc_id").to_pylist())) == 6


def _scrape(url: str, job: str) -> dict[tuple[str, tuple], float]:
    """(sample name, its labels other than Ray's own) -> value, summed over processes, for one job's samples."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("job") == job and s.name.startswith("ray_clover_batch_"):
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k in ("status", "replica", "le")))
                values[s.name, labels] = values.get((s.name, labels), 0.0) + s.value
    return values


def test_metrics_reach_the_ray_metrics_endpoint(ray_session, metrics_url, tmp_path):
    docs = tmp_path / "docs"
    _memos(docs, [f"memo-{i}.txt" for i in range(4)])
    (docs / "empty.txt").write_bytes(b"")
    name = f"metrics-{uuid.uuid4().hex[:8]}"  # the session's Ray keeps every test's metrics: ours by this tag
    raw = job_raw(str(docs), str(tmp_path / "out"), name=name, resources={"batch_size": 2, "max_slots": 4})
    report = run(parse_job(raw)).report
    assert report.by_status == {"empty": 1, "ok": 4}
    ok = [r for r in read_output(Location(str(tmp_path / "out"))).to_pylist() if r["status"] == "ok"]
    replica = (("replica", "0"),)
    expected = {
        ("ray_clover_batch_documents_total", (("status", "ok"),)): 4.0,
        ("ray_clover_batch_documents_total", (("status", "empty"),)): 1.0,
        ("ray_clover_batch_prompt_tokens_total", replica): float(sum(r["input_tokens"] for r in ok)),
        ("ray_clover_batch_generated_tokens_total", replica): float(sum(r["output_tokens"] for r in ok)),
        ("ray_clover_batch_slots", replica): 4.0,  # max_slots: the tiny model's slots all fit
        ("ray_clover_batch_slots_in_use", replica): 0.0,  # the run is over: nothing in the engine, nothing queued
        ("ray_clover_batch_infer_queue_depth", replica): 0.0,
    }
    deadline = time.monotonic() + 60  # actors report to the node's metrics agent every second (conftest)
    while True:
        got = _scrape(metrics_url, name)
        if all(got.get(k) == v for k, v in expected.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {k: got.get(k) for k in expected} == expected
    # every decode step counted its rows: each answer's denoising steps at least, at most its forward passes
    rows = got[("ray_clover_batch_decode_rows_total", replica)]
    assert sum(r["denoising_steps"] for r in ok) <= rows <= sum(r["forward_passes"] for r in ok)
    steps = got[("ray_clover_batch_decode_steps_total", replica)]
    assert max(r["denoising_steps"] for r in ok) <= steps <= rows
    assert got[("ray_clover_batch_decode_rows_per_step_count", replica)] == steps
    assert got[("ray_clover_batch_decode_rows_per_step_bucket", (("le", "4.0"), *replica))] == steps  # max_slots 4
    assert got[("ray_clover_batch_prefill_seconds_total", replica)] > 0
    assert got[("ray_clover_batch_decode_seconds_total", replica)] > 0

