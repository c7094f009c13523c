"""The Python API: `clover_batch.process(ds, job)` under the session's Ray gives the CLI's answers for the same texts;
`clover_batch.run(job, **overrides)` is the CLI's run with its outcome on the report."""

from __future__ import annotations

import os
from pathlib import Path

import clover_batch
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import read_output
from clover_batch.jobs.cli import app
from clover_batch.jobs.runner import ExitCode, UsageError
from clover_batch.jobs.spec import JobSpecError
from clover_batch.pipeline.rows import OUTPUT_SCHEMA
from conftest import job_raw, requires_engine, write_job
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "jobs/examples/summarize-local.yaml"

pytestmark = requires_engine


def _items() -> list[dict]:
    docs = ROOT / "jobs" / "examples" / "docs"
    return [{"id": 1, "text": (docs / "meeting-minutes.txt").read_text()},
            {"id": 2, "text": (docs / "purchase-order.md").read_text()},
            {"id": 3, "text": "Invoice 88 from Acme to Bolt: 12 chairs at 40 EUR, total 480 EUR, due 1 June."}]


def test_process_gives_the_cli_answers_for_the_same_texts(ray_session, tmp_path, monkeypatch):
    import ray

    monkeypatch.chdir(ROOT)  # the example job's paths are relative to the repository root
    items = _items()
    ds = clover_batch.process(ray.data.from_items(items), EXAMPLE)
    assert isinstance(ds, ray.data.Dataset)
    rows = ds.take_all()
    assert sorted(r["doc_id"] for r in rows) == ["1", "2", "3"]
    assert set(rows[0]) == set(OUTPUT_SCHEMA.names)
    by_id = {r["doc_id"]: r for r in rows}
    assert all(r["status"] == "ok" and r["output_text"] for r in rows), rows
    assert {r["job_name"] for r in rows} == {"summarize-local"}

    # the CLI, on a Parquet table of the same texts
    pq.write_table(pa.table({"id": [i["id"] for i in items], "text": [i["text"] for i in items]}),
                   tmp_path / "texts.parquet")
    raw = yaml.safe_load((ROOT / EXAMPLE).read_text())
    raw["input"] = {"table": {"format": "parquet", "uri": str(tmp_path / "texts.parquet")}}
    raw["output"]["uri"] = str(tmp_path / "out")
    job = write_job(tmp_path / "job.yaml", raw)
    result = CliRunner().invoke(app, ["run", str(job)])
    assert result.exit_code == 0, result.output
    cli = {r["doc_id"]: r for r in read_output(Location(str(tmp_path / "out"))).to_pylist()}
    assert {d: r["output_text"] for d, r in cli.items()} == {d: r["output_text"] for d, r in by_id.items()}
    assert {d: r["input_tokens"] for d, r in cli.items()} == {d: r["input_tokens"] for d, r in by_id.items()}


def test_process_with_a_uri_column_and_a_dict_job(ray_session, tmp_path):
    import ray

    (tmp_path / "a.txt").write_text("Memo: the office moves to the third floor on Monday.")
    raw = {"name": "api", "model": {"source": "tiny"}, "task": {"kind": "summarize", "instruction": "Summarize."},
           "decode": {"max_new_tokens": 4}}
    ds = ray.data.from_items([{"key": "a", "path": str(tmp_path / "a.txt")},
                              {"key": "b", "path": str(tmp_path / "missing.txt")}])
    rows = {r["doc_id"]: r for r in clover_batch.process(ds, raw, id_column="key", uri_column="path").take_all()}
    assert rows["a"]["status"] == "ok" and rows["a"]["format"] == "text" and rows["a"]["output_tokens"] > 0
    assert rows["b"]["status"] == "read_error" and "missing.txt" in rows["b"]["error"]


def test_run_returns_the_report_with_the_cli_outcome(ray_session, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "memo.txt").write_text("Memo: the budget review moved to Thursday.")
    (docs / "empty.txt").write_text("")
    job = write_job(tmp_path / "job.yaml", job_raw(str(docs), "unused", decode={"max_new_tokens": 4}))
    report = clover_batch.run(job, output__uri=str(tmp_path / "out"), run={"fail_on_status": ["empty"]})
    assert report.outcome == ExitCode.FAILED_ROWS and report.by_status == {"ok": 1, "empty": 1}
    assert os.path.exists(tmp_path / "out" / "_reports" / f"{report.run_id}.json")
    again = clover_batch.run(job, output__uri=str(tmp_path / "out"))
    assert (again.outcome, again.processed, again.skipped_done) == (ExitCode.OK, 0, 2)
    with pytest.raises(JobSpecError, match=r"resources\.replicas"):
        clover_batch.run(job, resources__replicas=0)
    with pytest.raises(UsageError, match="--retry-status ok"):
        clover_batch.run(job, output__uri=str(tmp_path / "out"), retry_statuses=["ok"])


def test_table_example_job_reads_its_table():
    from clover_batch.connectors.tables import read_document_table
    from clover_batch.jobs.runner import pipeline_options
    from clover_batch.jobs.spec import load_job

    spec = load_job(str(ROOT / "jobs" / "examples" / "table-to-iceberg.yaml"))
    assert (spec.output.format, spec.output.table, spec.output.catalog) == ("iceberg", "docs.summaries", {})
    docs = read_document_table(pipeline_options(spec.model_copy(update={"input": spec.input.model_copy(update={
        "table": spec.input.table.model_copy(update={"uri": str(ROOT / spec.input.table.uri)})})}), "r").table)
    assert docs.column("doc_id").to_pylist() == ["incident-report-long", "meeting-minutes", "purchase-order"]
    assert docs.column("text").to_pylist()[1] == (ROOT / "jobs" / "examples" / "docs" / "meeting-minutes.txt"
                                                  ).read_text()
