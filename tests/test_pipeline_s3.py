"""Input and output on S3: a real S3-protocol server (moto) on 127.0.0.1, credentials via storage_options."""

from __future__ import annotations

import io
import json

import pyarrow.parquet as pq
from clover_batch.jobs.runner import run
from clover_batch.jobs.spec import parse_job
from conftest import job_raw, requires_engine, write_bad_docs, write_good_docs

pytestmark = requires_engine


def test_s3_in_and_out(ray_session, s3_server, s3_bucket, tmp_path):
    bucket, client = s3_bucket
    local = tmp_path / "docs"
    good = write_good_docs(local)
    bad = {k: v for k, v in write_bad_docs(local).items() if k in ("truncated.pdf", "latin1.txt")}
    for name in [*good, *bad]:
        client.put_object(Bucket=bucket, Key=f"incoming/{name}", Body=(local / name).read_bytes())
    raw = job_raw(
        f"s3://{bucket}/incoming/",
        f"s3://{bucket}/results/",
        input={"storage_options": s3_server},
        output={"storage_options": s3_server},
    )
    report = run(parse_job(raw)).report
    assert report.processed == 6 and report.by_status == {"ok": 4, "truncated_pdf": 1, "decode_error": 1}

    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="results/")["Contents"])
    parts = [k for k in keys if k.endswith(".parquet")]
    assert keys == sorted([*parts, "results/_job.json", f"results/_reports/{report.run_id}.json"])
    rows = []
    for key in parts:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        rows += pq.read_table(io.BytesIO(body)).to_pylist()
    assert len(rows) == 6 and len({r["doc_id"] for r in rows}) == 6
    by_uri = {r["source_uri"]: r for r in rows}
    assert by_uri[f"s3://{bucket}/incoming/lease.pdf"]["status"] == "ok"
    assert by_uri[f"s3://{bucket}/incoming/lease.pdf"]["output_tokens"] > 0
    assert by_uri[f"s3://{bucket}/incoming/latin1.txt"]["status"] == "decode_error"
    etag = client.head_object(Bucket=bucket, Key="incoming/faq.md")["ETag"].strip('"')
    from clover_batch.connectors.fs import document_id

    assert by_uri[f"s3://{bucket}/incoming/faq.md"]["doc_id"] == document_id(f"s3://{bucket}/incoming/faq.md", etag)
    stored = json.loads(
        client.get_object(Bucket=bucket, Key=f"results/_reports/{report.run_id}.json")["Body"].read()
    )
    assert stored["output_rows"] == 6
    assert "storage_options" not in json.dumps(stored["job"])  # credentials stay out of the report

    again = run(parse_job(raw)).report
    assert (again.processed, again.skipped_done, again.output_rows) == (0, 6, 6)
