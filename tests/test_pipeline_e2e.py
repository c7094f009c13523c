"""End to end on the session's local Ray with the tiny preset: folder -> Parquet, one row per document."""

from __future__ import annotations

import json
import os
import shutil

import duckdb
import pyarrow.parquet as pq
import pytest
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import OutputConflict, committed_parts, read_output
from clover_batch.jobs.cli import app
from clover_batch.jobs.resources import PlanRefused
from clover_batch.jobs.runner import run
from clover_batch.jobs.spec import parse_job
from clover_batch.model import generate, load_model
from clover_batch.pipeline.parse import parse_document
from clover_batch.pipeline.rows import OUTPUT_SCHEMA
from clover_batch.pipeline.tokenizer import PromptBuilder
from conftest import job_raw, requires_engine, write_bad_docs, write_good_docs, write_job
from typer.testing import CliRunner

DESIGN_COLUMNS = {
    "doc_id", "source_uri", "format", "pages", "status", "error", "output_text", "output_json", "input_tokens",
    "output_tokens", "windows", "forward_passes", "denoising_steps", "timings", "model", "job_name", "run_id",
}  # fmt: skip

pytestmark = requires_engine


@pytest.fixture
def mixed_folder(tmp_path):
    docs = tmp_path / "docs"
    good = write_good_docs(docs)
    bad = write_bad_docs(docs)
    return docs, good, bad


def test_folder_to_parquet_one_row_per_document_good_and_bad(ray_session, mixed_folder, tmp_path):
    docs, good, bad = mixed_folder
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", job_raw(str(docs), str(out)))
    result = CliRunner().invoke(app, ["run", str(job)])
    assert result.exit_code == 0, result.output
    assert "documents/s" in result.output and "ok" in result.output

    # pyarrow, pandas and duckdb all read it, with exactly one row per document
    table = pq.read_table(str(out))
    assert DESIGN_COLUMNS <= set(table.column_names)
    assert table.schema.equals(OUTPUT_SCHEMA)
    frame = table.to_pandas()
    assert len(frame) == len(good) + len(bad) == 13
    assert frame["doc_id"].is_unique
    assert duckdb.sql(f"select count(distinct source_uri) from '{out}/*.parquet'").fetchall()[0][0] == 13

    rows = {os.path.basename(r["source_uri"]): r for r in table.to_pylist()}
    assert {name: rows[name]["status"] for name in bad} == bad
    for name, fmt in good.items():
        row = rows[name]
        assert (row["status"], row["format"], row["error"]) == ("ok", fmt, None), row
        assert 0 < row["output_tokens"] <= 8
        assert row["input_tokens"] > 20
        assert row["forward_passes"] >= 1 and row["denoising_steps"] >= 1
        assert row["timings"]["infer"] > 0 and row["timings"]["parse"] > 0
        assert (row["model"], row["job_name"], row["task"]) == ("tiny", "test-job", "summarize")
    assert rows["report.pdf"]["pages"] == 3 and rows["notes.txt"]["pages"] is None
    assert rows["notes.txt"]["windows"] == -(-rows["notes.txt"]["input_tokens"] // 256) >= 2
    for name in bad:
        assert rows[name]["error"] and rows[name]["output_text"] is None
    assert "input.max_input_tokens=2000" in rows["huge.txt"]["error"]
    assert len({r["run_id"] for r in rows.values()}) == 1

    # the run report sits next to the output
    (report_file,) = (out / "_reports").iterdir()
    report = json.loads(report_file.read_text())
    assert report["processed"] == report["output_rows"] == 13
    assert report["by_status"]["ok"] == 4
    assert report["output_tokens"] == sum(r["output_tokens"] or 0 for r in rows.values())

    shown = CliRunner().invoke(app, ["show", str(out)])
    assert shown.exit_code == 0, shown.output
    assert "13 rows" in shown.output and "truncated_pdf" in shown.output


def test_rerun_skips_done_and_new_documents_are_processed(ray_session, tmp_path):
    docs = tmp_path / "docs"
    write_good_docs(docs)
    out = tmp_path / "out"
    spec = parse_job(job_raw(str(docs), str(out), resources={"batch_size": 1}))
    first = run(spec)
    assert first.report.processed == 4
    parts_before = {p: open(p, "rb").read() for p in committed_parts(Location(str(out)))}

    again = run(spec)
    assert (again.report.processed, again.report.skipped_done) == (0, 4)
    assert {p: open(p, "rb").read() for p in committed_parts(Location(str(out)))} == parts_before

    (docs / "new-a.txt").write_text("A new memo about budgets.")
    shutil.copy(docs / "lease.pdf", docs / "new-b.pdf")
    third = run(spec)
    assert (third.report.processed, third.report.skipped_done) == (2, 4)
    table = read_output(Location(str(out)))
    assert table.num_rows == 6 and len(set(table.column("doc_id").to_pylist())) == 6
    new_rows = [r for r in table.to_pylist() if r["run_id"] == third.run_id]
    assert sorted(os.path.basename(r["source_uri"]) for r in new_rows) == ["new-a.txt", "new-b.pdf"]
    # the same bytes under a new name are a new document, with the same (deterministic) answer
    by_name = {os.path.basename(r["source_uri"]): r for r in table.to_pylist()}
    assert by_name["new-b.pdf"]["doc_id"] != by_name["lease.pdf"]["doc_id"]
    assert by_name["new-b.pdf"]["output_text"] == by_name["lease.pdf"]["output_text"]

    # the same output with another instruction would mix answers: refused before any work, output unchanged
    changed = parse_job(job_raw(str(docs), str(out), resources={"batch_size": 1},
                                task={"kind": "summarize", "instruction": "Summarize in French."}))
    with pytest.raises(OutputConflict, match=r"task\.instruction: 'Summarize\.' -> 'Summarize in French\.'"):
        run(changed)
    assert read_output(Location(str(out))).num_rows == 6

    # the pipeline's prompt, decode options and detokenizing match calling the engine by hand
    builder = PromptBuilder("tiny")
    ids = builder.build("Summarize.", parse_document("faq.md", (docs / "faq.md").read_bytes()).text)
    (gen,) = generate(load_model("tiny"), [ids], max_new_tokens=8, threshold=0.9, temperature=0.0)
    assert by_name["faq.md"]["input_tokens"] == len(ids)
    assert by_name["faq.md"]["output_tokens"] == len(gen.tokens)
    assert by_name["faq.md"]["output_text"] == builder.decode(gen.tokens)


def test_extract_task_checks_answers(ray_session, tmp_path):
    docs = tmp_path / "docs"
    write_good_docs(docs)
    fields = {"title": {"type": "string"}, "amount": {"type": "number", "required": False}}
    spec = parse_job(
        job_raw(str(docs), str(tmp_path / "out"), task={"kind": "extract", "instruction": "Extract.", "fields": fields},
                input={"include": ["*.pdf"]})
    )  # fmt: skip
    report = run(spec).report
    rows = read_output(Location(str(tmp_path / "out"))).to_pylist()
    assert len(rows) == 2
    # random tiny weights never write a valid JSON object: every answer is refused, with the reason
    assert report.by_status == {"invalid_output": 2}
    for row in rows:
        assert row["output_json"] is None and row["output_text"] is not None
        assert row["error"].startswith("extraction answer refused:")
        assert row["task"] == "extract"


def test_replica_bigger_than_the_cluster_is_a_clear_error(ray_session, tmp_path):
    """The session's Ray was joined (it might grow): run.startup_timeout_s 0 refuses at once instead of waiting."""
    docs = tmp_path / "docs"
    write_good_docs(docs)
    spec = parse_job(job_raw(str(docs), str(tmp_path / "out"), resources={"gpus_per_replica": 1},
                             run={"startup_timeout_s": 0}))
    with pytest.raises(PlanRefused, match=r"resources: the job needs 1 GPU \(resources.replicas 1 x "
                                          r"\(resources.gpus_per_replica 1\)\) and the cluster has 0 GPU"):
        run(spec)
    assert read_output(Location(str(tmp_path / "out"))) is None


def test_ray_batches_feed_one_engine_per_replica(ray_session, tmp_path):
    """Ten documents in Ray batches of two (five batches) on one replica: the engine decodes documents of several
    batches together (more at once than batch_size), and every answer equals the engine run on that document
    alone."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(10):
        (docs / f"memo-{i}.txt").write_text(f"Memo {i}: " + " ".join(["budget", "review", "notice"][j % 3]
                                                                      for j in range(5 + 9 * i)))
    decode = {"max_new_tokens": 16, "tokens_per_step": 1}
    spec = parse_job(job_raw(str(docs), str(tmp_path / "out"), decode=decode,
                             resources={"batch_size": 2, "max_slots": 8}))
    report = run(spec).report
    assert report.by_status == {"ok": 10}
    assert report.max_decode_batch > 2
    assert report.kernels == ["torch; attention dense; CUDA graphs off; torch.float32 on cpu (auto: the weights "
                              "have no stored dtype (a preset), so fp32)"]
    model, builder = load_model("tiny"), PromptBuilder("tiny")
    for row in read_output(Location(str(tmp_path / "out"))).to_pylist():
        ids = builder.build("Summarize.", (docs / os.path.basename(row["source_uri"])).read_text())
        (alone,) = generate(model, [ids], **decode)
        assert row["output_text"] == builder.decode(alone.tokens), row["source_uri"]
        assert row["denoising_steps"] == alone.denoising_steps
