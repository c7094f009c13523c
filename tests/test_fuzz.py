"""Fuzzing every untrusted document input: mutated and hostile PDFs, hostile text, broken and hostile DOCX, HTML,
EPUB and XPS (tests/hostile_docs.py, seeded).

Each file must end as exactly one row with a named status; no parse may hang or take a worker down; the run must
complete. The status counts are printed (run with -s to see them). The child-vs-reference and pipeline runs read
PDFs as plain text (Markdown layout costs about half a second a page, minutes over this corpus); one slow test runs
the PDF corpus through the default (Markdown) and checks that every PDF keeps the status plain text gives it.
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
from hostile_docs import fuzz_docx, fuzz_ebooks, fuzz_html, fuzz_pdfs, fuzz_texts

# Every status a document can end with in these runs; anything else (internal_error above all) is a bug.
DOCUMENT_STATUSES = {
    "ok", "empty", "corrupt_pdf", "corrupt_file", "truncated_pdf", "encrypted", "too_many_pages", "parse_timeout",
    "parse_crashed", "no_text", "binary", "decode_error", "too_long", "too_large",
}  # fmt: skip
TIMEOUT_S = 3.0
MAX_PAGES = 500
MAX_BYTES = 32 * 2**20  # input.max_file_bytes: the zip bombs of hostile_docs unpack to 96 MiB
OPTIONS = {"max_pages": MAX_PAGES, "pdf_text": "plain", "max_unpacked_bytes": MAX_BYTES}
ISOLATED = (".pdf", ".docx", ".html", ".htm", ".xhtml", ".epub", ".xps")


@pytest.fixture(scope="module")
def corpus() -> dict[str, bytes]:
    files = {**fuzz_pdfs(seed=0), **fuzz_texts(seed=0), **fuzz_docx(seed=0), **fuzz_html(seed=0), **fuzz_ebooks()}
    assert sum(name.endswith(".pdf") for name in files) >= 200
    assert sum(name.endswith((".docx", ".html", ".htm", ".xhtml", ".epub", ".xps")) for name in files) >= 50
    return files


def test_fuzz_parse_each_file_gets_one_named_status_and_matches_in_process(corpus):
    parser = IsolatedParser()
    start = time.perf_counter()
    try:
        got = {name: parser.parse(name, data, timeout_s=TIMEOUT_S, **OPTIONS) if name.endswith(ISOLATED)
               else parse_document(name, data, **OPTIONS) for name, data in corpus.items()}
    finally:
        parser.close()
    seconds = time.perf_counter() - start
    counts = Counter(p.status for p in got.values())
    print(f"\nfuzz parse: {len(got)} files in {seconds:.1f} s, {parser.starts} parser starts: {dict(counts)}")
    assert set(counts) <= DOCUMENT_STATUSES
    for name, parsed in got.items():
        assert (parsed.status == "ok") == (parsed.text is not None) == (parsed.error is None), name
        assert (parsed.status == "ok") == (parsed.text_source is not None), name
        if parsed.text is not None:
            parsed.text.encode("utf-8")  # valid UTF-8: no lone surrogates reach Arrow or the tokenizer
    # the hostile ones end as they must: hours of work is stopped, the forged and looping trees are refused
    assert got["hostile.xobject-bomb-9.pdf"].status == "parse_timeout"
    assert got["hostile.xobject-bomb-3.pdf"].status == "ok"
    assert got["hostile.many-pages-600.pdf"].status == "too_many_pages"
    assert "600 pages, over input.max_pages=500" in got["hostile.many-pages-600.pdf"].error
    assert got["hostile.page-tree-loop.pdf"].status == "corrupt_pdf"
    assert {got[n].status for n in corpus if ".count-" in n and "999999999" in n} == {"corrupt_pdf"}
    assert {got[n].status for n in corpus
            if n.endswith(".pdf") and ".truncated" in n and not n.endswith("-eof.pdf")} == {"truncated_pdf"}
    # DOCX: broken archives and parts are corrupt_file, bombs are refused before anything is unpacked
    assert got["docx.original.docx"].status == "ok" and "| Flour | 12 EUR |" in got["docx.original.docx"].text
    for name in ("not-a-zip", "truncated1", "bitflip8-1", "missing-word-document.xml", "xml-cut", "xml-garbage",
                 "xml-deep-nesting", "xml-billion-laughs", "zip-bomb-lying-sizes"):
        assert got[f"docx.{name}.docx"].status == "corrupt_file", name
    assert got["docx.zip-bomb.docx"].status == "too_large"
    assert "unpack to 101490452 bytes, over input.max_file_bytes=33554432" in got["docx.zip-bomb.docx"].error
    assert "Bad CRC-32" in got["docx.zip-bomb-lying-sizes.docx"].error  # unpacking stopped at the declared size
    assert got["docx.xml-empty-body.docx"].status == "no_text"
    # HTML: the article survives hostile markup around it; pages with no text, or not text, say so
    assert got["html.original.html"].text == ("# Harbour report\n\nThe ferry runs every hour until the storm season "
                                              "ends in March.")
    for name in ("huge-attribute", "cp1252-declared", "shift-jis-declared", "utf16-with-bom", "entity-flood",
                 "invalid-utf8-declared", "unknown-charset", "utf16-declared-but-ascii"):
        assert got[f"html.{name}.html"].status == "ok", name
    assert got["html.many-attributes.html"].status == "parse_timeout"  # lxml is quadratic in attributes
    assert got["html.invalid-utf8-undeclared.html"].status == "decode_error"
    assert {got[f"html.{n}.html"].status for n in ("nul-bytes", "random-bytes")} == {"binary"}
    assert {got[f"html.{n}.html"].status for n in ("script-only", "empty-body", "deep-nesting")} == {"no_text"}
    assert "SCRIPT" not in (got["html.entity-flood.html"].text or "") and "var x" not in got["html.original.html"].text
    # EPUB and XPS
    assert got["ebook.original.epub"].status == "ok"
    assert got["ebook.zip-bomb.epub"].status == "too_large"
    assert {got[n].status for n in ("ebook.not-a-zip.epub", "ebook.no-container.epub", "ebook.not-a-zip.xps",
                                    "ebook.empty-zip.xps")} == {"corrupt_file"}
    assert parser.starts == 1 + counts["parse_timeout"] + counts["parse_crashed"]  # restarted only after those
    # the child is the same parser as the in-process reference: identical results wherever the child finished
    for name, parsed in got.items():
        if name.endswith(ISOLATED) and parsed.status not in ("parse_timeout", "parse_crashed"):
            assert parse_document(name, corpus[name], **OPTIONS) == parsed, name


@pytest.mark.slow
def test_fuzz_pdfs_keep_their_statuses_under_markdown_and_ocr():
    """The default (Markdown layout, OCR auto) on the fuzzed PDFs: each status is the one plain text without OCR
    gives (the statuses before this option existed), and no layout analysis crashes or hangs on a damaged PDF.
    Every hostile file and e-book, and a fixed third of the randomly damaged PDFs: layout analysis costs ~1 s per
    file, and the other two thirds are damaged the same ways (the whole corpus is parsed as plain text in
    test_fuzz_parse_each_file_gets_one_named_status_and_matches_in_process)."""
    files = {**fuzz_pdfs(seed=0), **fuzz_ebooks()}
    pdfs = {n: d for i, (n, d) in enumerate(sorted(files.items()))
            if n.endswith((".pdf", ".epub", ".xps")) and (n.startswith("hostile.") or not n.endswith(".pdf")
                                                          or i % 3 == 0)}
    parser = IsolatedParser()
    start = time.perf_counter()
    try:
        before = {n: parser.parse(n, d, timeout_s=TIMEOUT_S, max_pages=MAX_PAGES, pdf_text="plain", ocr="never")
                  for n, d in pdfs.items()}
        # a longer limit: a four-page PDF takes a few seconds of layout analysis on a busy machine
        now = {n: parser.parse(n, d, timeout_s=20.0, max_pages=MAX_PAGES) for n, d in pdfs.items()}
    finally:
        parser.close()
    counts = Counter(p.status for p in now.values())
    print(f"\nfuzz markdown: {len(pdfs)} files in {time.perf_counter() - start:.1f} s: {dict(counts)}")
    assert {n: p.status for n, p in now.items()} == {n: p.status for n, p in before.items()}
    assert counts["parse_timeout"] == 1 and counts["ok"] >= 30  # the xobject bomb only
    assert all(p.text_source == "text" for p in now.values() if p.status == "ok")


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


# the files the pipeline test names; with them every hostile file and a fixed third of the rest go through the
# pipeline (every file's parse status is checked by test_fuzz_parse_each_file_gets_one_named_status_and_matches_in_
# process; the pipeline test is about one row per file through Ray, whatever its status)
NAMED = ("single-line-1mb.txt", "nul-after-8k.txt", "docx.zip-bomb.docx", "docx.missing-word-document.xml.docx",
         "html.many-attributes.html", "html.original.html")


@requires_engine
def test_fuzz_pipeline_every_file_one_row_and_the_run_completes(ray_session, corpus, tmp_path):
    corpus = {n: d for i, (n, d) in enumerate(sorted(corpus.items()))
              if n.startswith("hostile.") or n in NAMED or i % 3 == 0}
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, data in corpus.items():
        (docs / name).write_bytes(data)
    out = tmp_path / "out"
    spec = parse_job(job_raw(
        str(docs), str(out),
        input={"max_input_tokens": 2048, "max_pages": MAX_PAGES, "parse_timeout_s": TIMEOUT_S, "pdf_text": "plain",
               "max_file_bytes": MAX_BYTES},
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
    assert by_name["docx.zip-bomb.docx"]["status"] == "too_large"
    assert by_name["docx.missing-word-document.xml.docx"]["status"] == "corrupt_file"
    assert by_name["html.many-attributes.html"]["status"] == "parse_timeout"
    assert (by_name["html.original.html"]["status"], by_name["html.original.html"]["text_source"]) == ("ok", "text")
