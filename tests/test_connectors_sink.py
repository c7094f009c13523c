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
    OutputLock,
    clean_temporaries,
    committed_parts,
    done_doc_ids,
    read_output,
    write_part,
    write_report,
)
from clover_batch.pipeline.rows import OUTPUT_SCHEMA


def _rows(ids, status="ok"):
    return pa.Table.from_pylist([{"doc_id": i, "status": status, "source_uri": f"f/{i}"} for i in ids], OUTPUT_SCHEMA)


def _lock(location, run_id, **kwargs):
    """The lock a run holds while it writes (write_part commits only for the lock's holder)."""
    return OutputLock(location, run_id, settle_s=0.01, **kwargs)


def test_parts_commit_and_doc_ids(tmp_path):
    out = Location(str(tmp_path / "out"))
    assert done_doc_ids(out) == set()
    with _lock(out, "r1"):
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
    with _lock(out, "r9"):
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
    with _lock(out, "r"):
        for i in range(n_parts):
            write_part(out, _rows([f"d{i}a", f"d{i}b"]), "r")
    write_report(out, "r", {"x": 1})
    assert pq.read_table(str(tmp_path)).num_rows == 2 * n_parts
    assert len(pq.read_table(str(tmp_path)).to_pandas()) == 2 * n_parts
    assert duckdb.sql(f"select count(distinct doc_id) from '{tmp_path}/*.parquet'").fetchall()[0][0] == 2 * n_parts


def test_retried_write_of_same_rows_replaces_its_part(tmp_path):
    """Ray retries a write task whose worker died after committing: the retry must not add a second copy."""
    out = Location(str(tmp_path))
    with _lock(out, "r1"):
        first = write_part(out, _rows(["b", "a"]), "r1")
        again = write_part(out, _rows(["a", "b"]), "r1")
    assert first == again
    assert len(committed_parts(out)) == 1 and read_output(out).num_rows == 2
    with _lock(out, "r2"):
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
    with _lock(location, "r1"):
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


