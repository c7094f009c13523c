"""CLI commands that need no model: show on empty and filled outputs, run on an invalid job."""

from __future__ import annotations

import pyarrow as pa
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import OutputLock, write_part
from clover_batch.jobs.cli import app
from clover_batch.pipeline.rows import OUTPUT_SCHEMA
from typer.testing import CliRunner


def test_show_empty_output_exits_1(tmp_path):
    result = CliRunner().invoke(app, ["show", str(tmp_path / "nothing")])
    assert result.exit_code == 1
    assert "no committed rows" in result.output


def test_show_counts_by_status_and_samples(tmp_path):
    rows = [
        {"doc_id": "1", "source_uri": "a.pdf", "status": "ok", "output_text": "A short summary.", "output_tokens": 4},
        {"doc_id": "2", "source_uri": "b.pdf", "status": "ok", "output_text": "Another.", "output_tokens": 2},
        {"doc_id": "3", "source_uri": "c.pdf", "status": "encrypted", "error": "the PDF is encrypted"},
    ]
    out = tmp_path / "a-folder-name-long-enough-that-the-first-line-is-wider-than-a-terminal[x]"
    with OutputLock(Location(str(out)), "r1"):
        write_part(Location(str(out)), pa.Table.from_pylist(rows, OUTPUT_SCHEMA), "r1")
    result = CliRunner().invoke(app, ["show", str(out), "--samples", "1"])
    assert result.exit_code == 0, result.output
    assert f"{out}: 3 rows in 1 parts" in result.output  # on one line, however long the path, brackets and all
    assert "A short summary." in result.output and "Another." not in result.output  # one sample per status
    assert "the PDF is encrypted" in result.output


def test_run_invalid_job_exits_nonzero_naming_field(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: j\ninput: {uri: in, include: '*.pdf'}\noutput: {uri: out}\ntask: {kind: summarize}\n")
    result = CliRunner().invoke(app, ["run", str(job)])
    assert result.exit_code == 2
    assert "input.include: Input should be a valid list" in result.output


def test_run_unknown_set_field_exits_nonzero(tmp_path):
    result = CliRunner().invoke(app, ["run", "jobs/examples/summarize-local.yaml", "--set", "resources.gpus=1"])
    assert result.exit_code == 2
    assert "resources.gpus: Extra inputs are not permitted" in result.output


def test_validate_masks_credentials(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: j\n"
        "input: {uri: 's3://b/in', storage_options: {key: AKIA-XYZ-123, secret: s3cr3t-XYZ,"
        " endpoint_url: 'http://127.0.0.1:9000', client_kwargs: {region_name: eu, aws_session_token: tok-XYZ}}}\n"
        "output: {uri: 's3://b/out'}\ntask: {kind: summarize}\ndecode: {max_new_tokens: 7}\n"
    )
    result = CliRunner().invoke(app, ["validate", str(job)])
    assert result.exit_code == 0, result.output
    for secret in ("AKIA-XYZ-123", "s3cr3t-XYZ", "tok-XYZ"):
        assert secret not in result.output
    assert "http://127.0.0.1:9000" in result.output and '"max_new_tokens": 7' in result.output


def test_run_refuses_an_output_inside_the_input(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: j\ninput: {{uri: '{tmp_path}/docs'}}\noutput: {{uri: '{tmp_path}/docs/out'}}\n"
                   "task: {kind: summarize}\n")
    result = CliRunner().invoke(app, ["run", str(job)])
    assert result.exit_code == 2  # a bad job: running it again would not help
    assert "is inside input.uri" in " ".join(result.output.split())
    assert not (tmp_path / "docs" / "out").exists()  # refused before anything was written


def test_run_with_an_unknown_model_fails_before_ray_naming_it(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"name: j\ninput: {{uri: '{tmp_path}/in'}}\noutput: {{uri: '{tmp_path}/out'}}\n"
                   "model: {source: no-such-model}\ntask: {kind: summarize}\n")
    result = CliRunner().invoke(app, ["run", str(job)])
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "run failed: ConfigError: model source 'no-such-model' is neither a preset nor a checkpoint" in text
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_show_prints_how_each_documents_pages_were_parsed(tmp_path):
    rows = [{"doc_id": "1", "source_uri": "book.pdf", "status": "ok", "output_text": "A book.", "pages": 2000,
             "page_sources": {"markdown": 1950, "plain": 0, "ocr": 25, "plain_fallback": 25}}]
    with OutputLock(Location(str(tmp_path)), "r1"):
        write_part(Location(str(tmp_path)), pa.Table.from_pylist(rows, OUTPUT_SCHEMA), "r1")
    result = CliRunner().invoke(app, ["show", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "1950 markdown, 25 ocr, 25" in result.output and "plain_fallback" in result.output


def test_show_prints_what_each_row_was_unsure_of_and_reads_older_outputs(tmp_path):
    """The sample rows' uncertain fields or words; an output written before rows had them (or page_sources) is
    shown all the same."""
    rows = [{"doc_id": "1", "source_uri": "a.txt", "status": "ok", "output_text": '{"date": "2026-08-23"}',
             "uncertain_fields": ["date", "parties"]},
            {"doc_id": "2", "source_uri": "b.txt", "status": "ok", "output_text": "A fire at the Utrecht depot.",
             "uncertain_words": ["fire", "Utrecht"]}]
    with OutputLock(Location(str(tmp_path / "new")), "r1"):
        write_part(Location(str(tmp_path / "new")), pa.Table.from_pylist(rows, OUTPUT_SCHEMA), "r1")
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["show", str(tmp_path / "new")])
    assert result.exit_code == 0, result.output
    assert "date, parties" in result.output and "fire, Utrecht" in result.output and "unsure of" in result.output
    for dropped in (["uncertain_fields", "uncertain_words"], ["uncertain_fields", "uncertain_words", "page_sources"]):
        old = pa.Table.from_pylist(rows[1:], OUTPUT_SCHEMA).drop_columns(dropped)
        folder = Location(str(tmp_path / f"old{len(dropped)}"))
        with OutputLock(folder, "r1"):
            write_part(folder, old, "r1")
        result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["show", folder.uri])
        assert result.exit_code == 0, result.output
        assert "A fire at the Utrecht depot." in result.output and "Utrecht," not in result.output
