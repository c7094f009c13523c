"""Fuzzing every untrusted document input: mutated and hostile PDFs, hostile text (tests/hostile_docs.py, seeded).

Each file must end as exactly one row with a named status; no parse may hang or take a worker down; the run must
complete. The status counts are printed (run with -s to see them).
"""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import read_output
from clover_batch.jobs.runner import run
from clover_batch.jobs.spec import parse_job
from clover_batch.pipeline.parse import parse_document
from clover_batch.pipeline.parse_process import IsolatedParser
from conftest import job_raw, requires_engine
from hostile_docs import fuzz_pdfs, fuzz_texts

# Every status a document can end with in these runs; anything else (internal_error above all) is a bug.
DOCUMENT_STATUSES = {
    "ok", "empty", "corrupt_pdf", "truncated_pdf", "encrypted", "too_many_pages", "parse_timeout", "parse_crashed",
    "no_text", "binary", "decode_error", "too_long",
}  # fmt: skip
TIMEOUT_S = 3.0
MAX_PAGES = 500


@pytest.fixture(scope="module")
def corpus() -> dict[str, bytes]:
    files = {**fuzz_pdfs(seed=0), **fuzz_texts(seed=0)}
    assert sum(name.endswith(".pdf") for name in files) >= 200
    return files


def test_fuzz_parse_each_file_gets_one_named_status_and_matches_in_process(corpus):
    parser = IsolatedParser()
    start = time.perf_counter()
    try:
        got = {name: parser.parse_pdf(data, timeout_s=TIMEOUT_S, max_pages=MAX_PAGES) if name.endswith(".pdf")
               else parse_document(name, data, max_pages=MAX_PAGES) for name, data in corpus.items()}
    finally:
        parser.close()
    seconds = time.perf_counter() - start
    counts = Counter(p.status for p in got.values())
    print(f"\nfuzz parse: {len(got)} files in {seconds:.1f} s, {parser.starts} parser starts: {dict(counts)}")
    assert set(counts) <= DOCUMENT_STATUSES
    for name, parsed in got.items():
        assert (parsed.status == "ok") == (parsed.text is not None) == (parsed.error is None), name
        if parsed.text is not None:
            parsed.text.encode("utf-8")  # valid UTF-8: no lone surrogates reach Arrow or the tokenizer
    # the hostile ones end as they must: hours of work is stopped, the forged and looping trees are refused
    assert got["hostile.xobject-bomb-9.pdf"].status == "parse_timeout"
    assert got["hostile.xobject-bomb-3.pdf"].status == "ok"
    assert got["hostile.many-pages-600.pdf"].status == "too_many_pages"
    assert "600 pages, over input.max_pages=500" in got["hostile.many-pages-600.pdf"].error
    assert got["hostile.page-tree-loop.pdf"].status == "corrupt_pdf"
    assert {got[n].status for n in corpus if ".count-" in n and "999999999" in n} == {"corrupt_pdf"}
    assert {got[n].status for n in corpus if ".truncated" in n and not n.endswith("-eof.pdf")} == {"truncated_pdf"}
    assert parser.starts == 1 + counts["parse_timeout"] + counts["parse_crashed"]  # restarted only after those
    # the child is the same parser as the in-process reference: identical results wherever the child finished
    for name, parsed in got.items():
        if name.endswith(".pdf") and parsed.status not in ("parse_timeout", "parse_crashed"):
            assert parse_document(name, corpus[name], max_pages=MAX_PAGES) == parsed, name


@pytest.mark.parametrize("fallback", [None, "cp1252", "utf-16", "shift_jis", "unicode_escape"])
def test_fuzz_texts_with_each_fallback_encoding(fallback):
    """Legacy decodings of random bytes give anything, lone surrogates included: still one named status, and every
    ok text is valid UTF-8 (Arrow and the tokenizer need it)."""
    files = {**fuzz_texts(seed=1), "escaped-surrogate.txt": b"\xff caf\\xe9 \\ud800 end"}
    for name, data in files.items():
        parsed = parse_document(name, data, fallback_encoding=fallback)
        assert parsed.status in DOCUMENT_STATUSES, (name, parsed)
        if parsed.status == "ok":
            parsed.text.encode("utf-8")
        else:
            assert parsed.error and parsed.text is None, name
    if fallback == "unicode_escape":  # decodes to a lone surrogate, which becomes U+FFFD
        assert parse_document("x.txt", files["escaped-surrogate.txt"], fallback_encoding=fallback).text == \
            "\xff caf\xe9 \ufffd\ufffd\ufffd end"


@requires_engine
def test_fuzz_pipeline_every_file_one_row_and_the_run_completes(ray_session, corpus, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, data in corpus.items():
        (docs / name).write_bytes(data)
    out = tmp_path / "out"
    spec = parse_job(job_raw(
        str(docs), str(out),
        input={"max_input_tokens": 2048, "max_pages": MAX_PAGES, "parse_timeout_s": TIMEOUT_S},
        output={"rows_per_file": 64}, decode={"max_new_tokens": 2}, resources={"batch_size": 8},
    ))  # fmt: skip
    start = time.perf_counter()
    report = run(spec).report
    seconds = time.perf_counter() - start
    print(f"\nfuzz pipeline: {len(corpus)} files in {seconds:.1f} s: {report.by_status}")

    rows = read_output(Location(str(out))).to_pylist()
    names = [os.path.basename(r["source_uri"]) for r in rows]
    assert sorted(names) == sorted(corpus)  # every file exactly once
    assert report.processed == report.output_rows == len(corpus)
    assert set(report.by_status) <= DOCUMENT_STATUSES, report.by_status
    by_name = {os.path.basename(r["source_uri"]): r for r in rows}
    for name, row in by_name.items():
        if row["status"] == "ok":
            assert row["output_tokens"] >= 1 and row["error"] is None, name
        else:
            assert row["error"] and row["output_text"] is None, name
    assert by_name["hostile.xobject-bomb-9.pdf"]["status"] == "parse_timeout"
    assert by_name["hostile.many-pages-600.pdf"]["status"] == "too_many_pages"
    assert by_name["single-line-1mb.txt"]["status"] == "too_long"
    assert by_name["nul-after-8k.txt"]["status"] == "too_long"
