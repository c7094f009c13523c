"""Input tables (Parquet, JSON Lines, CSV, Iceberg) and the Iceberg output, on the session's Ray with the tiny preset:
tables written by pyarrow and pyiceberg, a real SQLite-backed catalog in a tmp folder, rows read back with pyiceberg.
Runs that need an injected fault are the real CLI in a subprocess, joined to the session's Ray by address."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from clover_batch.connectors.fs import Location
from clover_batch.connectors.iceberg import IcebergTarget, commit_rows, read_table_rows, table_stats
from clover_batch.connectors.sink import read_output
from clover_batch.jobs.cli import app
from clover_batch.jobs.runner import UsageError, run
from clover_batch.jobs.spec import JobSpecError, parse_job
from clover_batch.pipeline.rows import OUTPUT_SCHEMA
from conftest import job_raw, requires_engine, write_job
from pyiceberg.catalog import load_catalog
from typer.testing import CliRunner

TEXTS = ["Invoice 7: three chairs, 120 EUR, due in May.", "Lease: flat 4, rent 900 EUR a month.",
         "Minutes: the launch moved to Friday.", "Incident: the build server lost power.",
         "Order 12: forty pens and two desks."]


def _catalog(out):
    return load_catalog("default", type="sql", uri=f"sqlite:///{out}/catalog.db", warehouse=f"file://{out}/warehouse")


def _iceberg_rows(out, table="docs.results") -> dict[str, dict]:
    """The table's rows by doc_id, read with pyiceberg (its own catalog object), checking one row per doc_id."""
    rows = _catalog(out).load_table(table).scan().to_arrow().to_pylist()
    assert len({r["doc_id"] for r in rows}) == len(rows), "a doc_id has two rows"
    return {r["doc_id"]: r for r in rows}


def _table_job(table: dict, out, **sections) -> dict:
    raw = job_raw("unused", str(out), **sections)
    raw["input"] = {"table": table, "max_input_tokens": 2000}
    return raw


def _iceberg_job(table: dict, out, **sections) -> dict:
    raw = _table_job(table, out, **sections)
    raw["output"] = {"uri": str(out), "format": "iceberg", "table": "docs.results", "rows_per_file": 2,
                     "commit_interval_s": 0}
    return raw


@requires_engine
def test_parquet_table_upserted_into_default_iceberg(ray_session, tmp_path):
    """N texts -> N ok rows; unchanged re-run runs nothing; one changed text -> that row alone is new."""
    src = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"id": [f"doc-{i}" for i in range(5)], "text": TEXTS}), src)
    out = tmp_path / "out"
    raw = _iceberg_job({"format": "parquet", "uri": str(src)}, out)

    first = run(parse_job(raw)).report
    assert (first.processed, first.by_status, first.output_rows) == (5, {"ok": 5}, 5)
    assert first.input_uri == str(src)
    rows = _iceberg_rows(out)
    assert sorted(rows) == [f"doc-{i}" for i in range(5)]
    assert {r["status"] for r in rows.values()} == {"ok"}
    assert all(r["output_text"] and r["run_id"] == first.run_id for r in rows.values())
    assert rows["doc-1"]["source_uri"] == f"{src}#doc-1" and rows["doc-1"]["version"].startswith("sha256:")
    table = _catalog(out).load_table("docs.results")
    assert len(table.snapshots()) == 3  # 5 rows in batches of rows_per_file=2: one snapshot per batch
    assert {s.summary["clover-batch.run-id"] for s in table.snapshots()} == {first.run_id}
    assert (out / "_reports" / f"{first.run_id}.json").exists() and (out / "_job.json").exists()

    again = run(parse_job(raw)).report  # unchanged: nothing runs, nothing is committed
    assert (again.processed, again.skipped_done, again.output_rows) == (0, 5, 5)
    assert _iceberg_rows(out) == rows
    assert len(_catalog(out).load_table("docs.results").snapshots()) == 3

    changed = list(TEXTS)
    changed[2] = "Minutes: the launch moved to Monday, and the budget was cut by half."
    pq.write_table(pa.table({"id": [f"doc-{i}" for i in range(5)], "text": changed}), src)
    third = run(parse_job(raw)).report
    assert (third.processed, third.changed, third.skipped_done, third.output_rows) == (1, 1, 4, 5)
    after = _iceberg_rows(out)
    assert sorted(after) == sorted(rows)
    assert after["doc-2"]["run_id"] == third.run_id and after["doc-2"]["version"] != rows["doc-2"]["version"]
    assert after["doc-2"]["input_tokens"] > rows["doc-2"]["input_tokens"]
    assert {d: r for d, r in after.items() if d != "doc-2"} == {d: r for d, r in rows.items() if d != "doc-2"}
    assert len(_catalog(out).load_table("docs.results").snapshots()) == 4  # the replacement: one snapshot

    shown = CliRunner().invoke(app, ["show", str(out), "--json"])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.output)
    assert (summary["rows"], summary["by_status"]) == (5, {"ok": 5})
    assert summary["uri"] == f"{out} (Iceberg table docs.results)"


def _write_table(fmt: str, tmp_path, table: pa.Table) -> dict:
    """`table` as an input table of format `fmt`; returns the job's input.table section."""
    if fmt == "json":
        path = tmp_path / "texts.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in table.to_pylist()))
        return {"format": "json", "uri": str(path)}
    if fmt == "csv":
        folder = tmp_path / "csv"  # a folder of files, read as one table
        folder.mkdir()
        pcsv.write_csv(table.slice(0, 2), folder / "a.csv")
        pcsv.write_csv(table.slice(2), folder / "b.csv")
        return {"format": "csv", "uri": str(folder)}
    warehouse = tmp_path / "lake"
    warehouse.mkdir()
    catalog = {"type": "sql", "uri": f"sqlite:///{warehouse}/catalog.db", "warehouse": f"file://{warehouse}"}
    lake = load_catalog("default", **catalog)
    lake.create_namespace("corpus")
    lake.create_table("corpus.texts", schema=table.schema).append(table)
    return {"format": "iceberg", "identifier": "corpus.texts", "catalog": catalog}


@requires_engine
@pytest.mark.parametrize("fmt", ["json", "csv", "iceberg"])
def test_table_formats_into_parquet_parts(ray_session, tmp_path, fmt):
    """Integer ids and an empty text; a changed text is replaced in its Parquet part, one row per id."""
    texts = [*TEXTS[:3], ""]
    source = _write_table(fmt, tmp_path, pa.table({"key": pa.array([10, 11, 12, 13], pa.int64()), "body": texts}))
    out = tmp_path / "out"
    raw = _table_job({**source, "id_column": "key", "text_column": "body"}, out)
    import clover_batch

    first = clover_batch.run(raw)
    assert first.outcome == 0 and first.by_status == {"ok": 3, "empty": 1}
    rows = {r["doc_id"]: r for r in read_output(Location(str(out))).to_pylist()}
    assert sorted(rows) == ["10", "11", "12", "13"]
    assert rows["13"]["status"] == "empty" and rows["13"]["error"]
    assert rows["10"]["format"] == "text" and rows["10"]["input_tokens"] > 10

    if fmt == "json":  # the same id with another text: run again, its row replaced in its part
        changed = pa.table({"key": pa.array([10, 11, 12, 13], pa.int64()), "body": [*TEXTS[:2], TEXTS[4], ""]})
        _write_table("json", tmp_path, changed)
        second = clover_batch.run(raw)
        assert (second.processed, second.changed, second.output_rows) == (1, 1, 4)
        after = {r["doc_id"]: r for r in read_output(Location(str(out))).to_pylist()}
        assert sorted(after) == sorted(rows) and after["12"]["run_id"] == second.run_id
        assert {d: r["run_id"] for d, r in after.items() if d != "12"} == {d: first.run_id for d in ("10", "11", "13")}


@pytest.mark.parametrize(("table", "message"), [
    (pa.table({"id": ["a", "b"], "body": ["x", "y"]}), r"input.table.text_column 'text': no such column in .* "
                                                        r"\(its columns: id, body\)"),
    (pa.table({"name": ["a", "b"], "text": ["x", "y"]}), r"input.table.id_column 'id': no such column"),
    (pa.table({"id": ["a", None], "text": ["x", "y"]}), r"input.table.id_column 'id': 1 rows .* have a null id"),
    (pa.table({"id": ["a", "b", "a"], "text": ["x", "y", "z"]}), r"input.table.id_column 'id': 1 ids appear more "
                                                                 r"than once .* \(e.g. 'a'\)"),
    (pa.table({"id": ["a", "b"], "text": [1, 2]}), r"input.table.text_column 'text': must hold strings, the column "
                                                   r"is int64"),
], ids=["missing-text-column", "missing-id-column", "null-id", "duplicate-id", "non-string-text"])
def test_unusable_table_is_refused_naming_the_column(tmp_path, table, message):
    src = tmp_path / "texts.parquet"
    pq.write_table(table, src)
    raw = _iceberg_job({"format": "parquet", "uri": str(src)}, tmp_path / "out")
    with pytest.raises(UsageError, match=message):
        run(parse_job(raw))
    job = write_job(tmp_path / "job.yaml", raw)
    result = CliRunner().invoke(app, ["run", str(job)])
    assert result.exit_code == 2, result.output
    assert "input.table." in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out" / "catalog.db").exists() or not _catalog(tmp_path / "out").load_table(
        "docs.results").snapshots()  # nothing committed


def test_catalog_credentials_are_masked_and_kept_out_of_reports(tmp_path):
    from clover_batch.jobs.cli import masked

    catalog = {"type": "rest", "uri": "https://catalog.example", "credential": "id:secret", "token": "t0k"}
    raw = job_raw("unused", str(tmp_path / "out"))
    raw["input"] = {"table": {"format": "iceberg", "identifier": "a.b", "catalog": catalog}}
    raw["output"] = {"uri": str(tmp_path / "out"), "format": "iceberg", "table": "docs.results", "catalog": catalog}
    shown = masked(parse_job(raw).model_dump(mode="json"))
    for section in (shown["input"]["table"]["catalog"], shown["output"]["catalog"]):
        assert section == {"type": "rest", "uri": "https://catalog.example", "credential": "***", "token": "***"}
    target = IcebergTarget(Location(str(tmp_path / "out")), "docs.results", catalog)
    assert target.describe() == {"table": "docs.results",
                                 "catalog": {"type": "rest", "uri": "https://catalog.example"}}


def test_job_fields_of_tables_are_checked():
    base = job_raw("unused", "out")
    with pytest.raises(JobSpecError, match=r"give input\.uri .* or input\.table .*, not both"):
        parse_job({**base, "input": {"uri": "docs", "table": {"format": "parquet", "uri": "t.parquet"}}})
    with pytest.raises(JobSpecError, match="format iceberg takes `identifier`"):
        parse_job({**base, "input": {"table": {"format": "iceberg", "uri": "t"}}})
    with pytest.raises(JobSpecError, match="give text_column or uri_column, not both"):
        parse_job({**base, "input": {"table": {"format": "csv", "uri": "t.csv", "text_column": "a",
                                               "uri_column": "b"}}})
    with pytest.raises(JobSpecError, match=r"format iceberg needs `table` as namespace\.name"):
        parse_job({**base, "output": {"uri": "out", "format": "iceberg", "table": "results"}})
    with pytest.raises(JobSpecError, match="`table` and `catalog` are for format iceberg"):
        parse_job({**base, "output": {"uri": "out", "table": "docs.results"}})


def _cli(job, address, *args, env=None, timeout=240):
    cmd = [sys.executable, "-m", "clover_batch.jobs.cli", "run", str(job), "--address", address, *args]
    return subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)


@requires_engine
def test_retry_failed_replaces_iceberg_rows_in_place(ray_session, tmp_path):
    """A URI column: files read and parsed like listed files; a read failure, then --retry-failed."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"memo-{i}.txt").write_text(f"Memo {i}: the meeting moved to room {i}.")
    src = tmp_path / "files.parquet"
    pq.write_table(pa.table({"id": [f"m{i}" for i in range(4)], "path": [str(docs / f"memo-{i}.txt")
                                                                        for i in range(4)]}), src)
    out = tmp_path / "out"
    raw = _iceberg_job({"format": "parquet", "uri": str(src), "uri_column": "path"}, out)
    raw["decode"]["max_new_tokens"] = 4
    job = write_job(tmp_path / "job.yaml", raw)

    first = _cli(job, ray_session, env={"CLOVER_BATCH_FAULT_DOC": "read_denied:memo-2"})
    assert first.returncode == 3, first.stdout + first.stderr
    rows = _iceberg_rows(out)
    assert {d: r["status"] for d, r in rows.items()} == {"m0": "ok", "m1": "ok", "m2": "read_error", "m3": "ok"}
    assert rows["m0"]["format"] == "text" and rows["m0"]["source_uri"] == str(docs / "memo-0.txt")

    retried = _cli(job, ray_session, "--retry-failed")
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert "1 processed, 1 retried, 3 already done" in retried.stdout
    after = _iceberg_rows(out)
    assert {d: r["status"] for d, r in after.items()} == dict.fromkeys(["m0", "m1", "m2", "m3"], "ok")
    assert after["m2"]["run_id"] != rows["m2"]["run_id"] and after["m2"]["error"] is None
    assert {d: after[d] for d in ("m0", "m1", "m3")} == {d: rows[d] for d in ("m0", "m1", "m3")}


@requires_engine
@pytest.mark.parametrize("fault", ["iceberg_writing:2", "iceberg_committed:2"])
def test_kill_during_iceberg_write_then_rerun(ray_session, tmp_path, fault):
    """SIGKILL of the driver with a snapshot's data files written but not committed, or right after a commit: the
    table stays at its last snapshot, and a re-run completes it with one row per document."""
    src = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"id": [f"doc-{i}" for i in range(6)], "text": [*TEXTS, "Memo: room 6 is free."]}), src)
    out = tmp_path / "out"
    raw = _iceberg_job({"format": "parquet", "uri": str(src)}, out)
    raw["decode"]["max_new_tokens"] = 4
    job = write_job(tmp_path / "job.yaml", raw)

    killed = _cli(job, ray_session, env={"CLOVER_BATCH_FAULT": fault})
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    table = _catalog(out).load_table("docs.results")
    committed = 2 if fault.startswith("iceberg_writing") else 4  # batches of 2: one or two snapshots landed
    assert len(table.snapshots()) == committed // 2
    assert len(_iceberg_rows(out)) == committed
    if fault.startswith("iceberg_writing"):  # the uncommitted snapshot's data files exist, referenced by none
        files = {os.path.basename(t.file.file_path) for t in table.scan().plan_files()}
        on_disk = {p.name for p in (out / "warehouse").rglob("*.parquet")}
        assert len(on_disk - files) >= 1
    assert not (out / "_reports").exists()

    report = run(parse_job(raw)).report
    assert (report.skipped_done, report.processed, report.output_rows) == (committed, 6 - committed, 6)
    rows = _iceberg_rows(out)
    assert len(rows) == 6 and {r["status"] for r in rows.values()} == {"ok"}


def test_commit_rows_upserts_one_snapshot_and_redoes_a_conflicting_commit(tmp_path):
    """The sink alone, with prepared rows: a replacing commit is one snapshot; a commit from a stale table handle
    (another writer committed meanwhile) is redone on the refreshed table, still one row per doc_id."""
    target = IcebergTarget(Location(str(tmp_path / "out")), "docs.results")

    def rows(ids, text, run_id):
        n = len(ids)
        data = {name: pa.nulls(n, field.type) for name, field in zip(OUTPUT_SCHEMA.names, OUTPUT_SCHEMA, strict=True)}
        data.update(doc_id=pa.array(ids, pa.string()), status=pa.array(["ok"] * n, pa.string()),
                    output_text=pa.array([f"{text} {i}" for i in ids], pa.large_string()),
                    run_id=pa.array([run_id] * n, pa.string()))
        return pa.table(data, schema=OUTPUT_SCHEMA)

    table = target.load(OUTPUT_SCHEMA)
    table = commit_rows(target, table, rows(["a", "b", "c"], "first", "r1"), [], "r1")
    table = commit_rows(target, table, rows(["d"], "first", "r1"), [], "r1")
    stale = target.load()
    table = commit_rows(target, table, rows(["b"], "second", "r2"), ["b"], "r2")
    assert table_stats(target) == {"snapshots": 3, "data_files": 3, "rows": 4}
    # `stale` still sees the second snapshot: its commit conflicts, and is redone looking for older rows of `c`
    commit_rows(target, stale, rows(["c"], "third", "r3"), [], "r3")
    assert read_table_rows(target).num_rows == 4  # c's older row went with the redo
    got = {r["doc_id"]: (r["output_text"], r["run_id"]) for r in read_table_rows(target).to_pylist()}
    assert got == {"a": ("first a", "r1"), "b": ("second b", "r2"), "c": ("third c", "r3"), "d": ("first d", "r1")}
    assert table_stats(target)["snapshots"] == 4


def _result_rows(ids, text, run_id, replaces=False):
    from clover_batch.pipeline.table_stages import RESULT_SCHEMA

    n = len(ids)
    data = {name: pa.nulls(n, f.type) for name, f in zip(RESULT_SCHEMA.names, RESULT_SCHEMA, strict=True)}
    data.update(doc_id=pa.array(ids, pa.string()), status=pa.array(["ok"] * n, pa.string()),
                output_text=pa.array([f"{text} {i}" for i in ids], pa.large_string()),
                run_id=pa.array([run_id] * n, pa.string()), replaces=pa.array([replaces] * n, pa.bool_()))
    return pa.table(data, schema=RESULT_SCHEMA)


def test_committer_buffers_to_its_interval_and_compaction_keeps_the_rows(tmp_path):
    """Rows wait for the commit interval (one snapshot for several blocks), the end flushes them; with no interval,
    a snapshot per rows_per_file rows. compact_table leaves one snapshot, few files, the same rows, and removes the
    data files nothing references (an expired snapshot's, a killed run's)."""
    from clover_batch.connectors.iceberg import compact_table
    from clover_batch.pipeline.table_stages import IcebergCommitter

    target = IcebergTarget(Location(str(tmp_path / "out")), "docs.results")
    slow = IcebergCommitter(target, "r1", min_rows=2, interval_s=3600, check=lambda: None)
    assert slow.add(_result_rows(["a", "b"], "first", "r1")).num_rows == 0  # the interval has not passed
    assert slow.add(_result_rows(["c"], "first", "r1")).num_rows == 0
    assert table_stats(target)["snapshots"] == 0
    assert slow.flush().column("doc_id").to_pylist() == ["a", "b", "c"]
    assert table_stats(target) == {"snapshots": 1, "data_files": 1, "rows": 3}

    every = IcebergCommitter(target, "r2", min_rows=2, interval_s=0, check=lambda: None)
    stats = every.add(_result_rows(["b", "d", "e"], "second", "r2", replaces=True))
    assert stats.column("doc_id").to_pylist() == ["b", "d"]  # one snapshot of 2 rows; `e` waits for more
    assert every.flush().column("doc_id").to_pylist() == ["e"]
    assert every.replaced == 3 and table_stats(target)["snapshots"] == 3
    before = {r["doc_id"]: r["output_text"] for r in read_table_rows(target).to_pylist()}
    assert before == {"a": "first a", "b": "second b", "c": "first c", "d": "second d", "e": "second e"}

    data = tmp_path / "out" / "warehouse" / "docs" / "results" / "data"
    (data / "orphan-of-a-killed-run.parquet").write_bytes(b"PAR1")
    assert compact_table(target) == {"snapshots": 1, "data_files": 1, "rows": 5}
    assert {r["doc_id"]: r["output_text"] for r in read_table_rows(target).to_pylist()} == before
    assert len(list(data.rglob("*.parquet"))) == 1


@requires_engine
def test_parquet_table_on_s3(ray_session, s3_server, s3_bucket, tmp_path):
    """A table on an object store, read through fsspec with input.storage_options."""
    import io

    bucket, client = s3_bucket
    buffer = io.BytesIO()
    pq.write_table(pa.table({"id": ["x", "y"], "text": TEXTS[:2]}), buffer)
    client.put_object(Bucket=bucket, Key="tables/texts.parquet", Body=buffer.getvalue())
    raw = _table_job({"format": "parquet", "uri": f"s3://{bucket}/tables/texts.parquet"}, tmp_path / "out")
    raw["input"]["storage_options"] = s3_server
    raw["decode"]["max_new_tokens"] = 4
    report = run(parse_job(raw)).report
    assert report.by_status == {"ok": 2} and report.input_uri == f"s3://{bucket}/tables/texts.parquet"
    rows = read_output(Location(str(tmp_path / "out"))).to_pylist()
    assert sorted(r["source_uri"] for r in rows) == [f"s3://{bucket}/tables/texts.parquet#{i}" for i in "xy"]
