"""Long PDFs parsed as page ranges (pipeline/page_ranges.py): the joined text is the whole document's, a range that
hangs or crashes falls back to plain text alone, every document keeps one row; on a Ray of 2 CPUs (this machine's).

The references are pymupdf4llm's own whole-document call (parse.markdown_reference, in this process, with
onnxruntime's default threads) and MuPDF's plain text; the ranges run in parse children (one layout thread each).
Markdown layout costs ~0.3 s a page on an idle core, so documents here are a dozen to a hundred pages; the
2,000-page book of issue 33 runs with CLOVER_LONG_DOCS=1 (minutes; see docs/documents.md, "What parsing costs").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pymupdf
import pytest
from clover_batch.pipeline.page_ranges import PAGES_PER_TASK, page_ranges, parse_document, parse_ranges
from clover_batch.pipeline.parse import clean, markdown_reference, parse_range, tidy_lines
from clover_batch.pipeline.parse_process import LAYOUT_THREADS_ENV, IsolatedParser, shared_parser
from long_docs import book_pdf

HERE = Path(__file__).resolve().parent
REAL_PDFS = [Path("/usr/share/doc/shared-mime-info/shared-mime-info-spec.pdf"),
             Path("/usr/share/doc/libtasn1-doc/libtasn1.pdf")]
FAULT_DOC_ENV = "CLOVER_BATCH_FAULT_DOC"


def reference(data: bytes) -> str:
    with pymupdf.open(stream=data, filetype="pdf") as doc:
        return tidy_lines(clean(markdown_reference(doc)))


def plain_pages(data: bytes, first: int, stop: int) -> str:
    with pymupdf.open(stream=data, filetype="pdf") as doc:
        return tidy_lines("\n\n".join(t.strip() for t in (doc[n].get_text() for n in range(first, stop)) if t.strip()))


@pytest.fixture(scope="module")
def book12() -> bytes:
    return book_pdf(12, table_every=5)


def test_a_pdfs_lines_lose_the_spaces_that_end_them():
    """pymupdf4llm ends the example invoice's lines with a space; the parsed text has none at a line's end, and is
    otherwise its Markdown (parse.tidy_lines)."""
    path = HERE.parent / "jobs" / "examples" / "docs" / "invoice.pdf"
    with pymupdf.open(path) as doc:
        raw = clean(markdown_reference(doc))
    got = parse_document(str(path), path.read_bytes(), timeout_s=120, use_ray=False)
    assert raw.count(" \n") >= 5 and "Total due: 90,940 EUR \n" in raw
    assert got.status == "ok" and " \n" not in got.text and "Total due: 90,940 EUR\n" in got.text
    assert got.text == raw.replace(" \n", "\n").strip()


def test_page_ranges_cover_the_document_in_order():
    assert page_ranges(101, 50) == [(0, 50), (50, 100), (100, 101)]
    assert page_ranges(50, 50) == [(0, 50)]
    assert page_ranges(3, 1) == [(0, 1), (1, 2), (2, 3)]


def test_ranges_join_to_the_whole_document_markdown(book12):
    """Ranges of 1 and 5 pages joined equal pymupdf4llm's one call over the whole book: page breaks inside tables
    and paragraphs, and header levels ranked over the whole book (a 1-page range without a chapter title has only
    section headings, which it alone would make level 1)."""
    want = reference(book12)
    assert "# Chapter 1: Terms" in want and "\n## Section 2.1 Rent and notice" in want
    assert "|Quarter|Units|Price|Total|" in want and "|Q4 2004|" in want  # the table and its rows on the next page
    for per_task in (1, 5):
        got = parse_ranges("book.pdf", book12, 12, timeout_s=300, pages_per_task=per_task, use_ray=False)
        assert (got.status, got.pages, got.text_source) == ("ok", 12, "text"), got.error
        assert got.page_sources == {"markdown": 12, "plain": 0, "ocr": 0, "plain_fallback": 0}
        assert got.text == want, per_task
    # the same document parsed whole in a parse child (one range), as a short document is
    whole = parse_document("book.pdf", book12, timeout_s=300)
    assert (whole.status, whole.text) == ("ok", want)


def test_plain_text_ranges_join_to_the_whole_document_plain_text(book12):
    got = parse_ranges("book.pdf", book12, 12, timeout_s=300, pages_per_task=5, pdf_text="plain", use_ray=False)
    assert got.text == plain_pages(book12, 0, 12)
    assert got.page_sources == {"markdown": 0, "plain": 12, "ocr": 0, "plain_fallback": 0}


@pytest.mark.parametrize("path", REAL_PDFS[:1], ids=lambda p: p.name)
def test_a_real_pdf_joins_exactly(path):
    """A real manual (a package's documentation PDF on this machine: bold headings of several sizes, lists, code),
    in ranges of 4 pages, against pymupdf4llm's whole-document call."""
    if not path.exists():
        pytest.skip(f"{path} is not on this machine")
    data = path.read_bytes()
    count = pymupdf.open(stream=data, filetype="pdf").page_count
    got = parse_ranges(str(path), data, count, timeout_s=300, pages_per_task=4, use_ray=False)
    assert got.status == "ok", got.error
    assert got.text == reference(data)


def test_one_layout_thread_gives_the_same_text_as_onnxruntimes_default(book12):
    """The parse child's layout model on one thread (the default) and on onnxruntime's own thread count."""
    parsers = [IsolatedParser(env={**os.environ, LAYOUT_THREADS_ENV: n}) for n in ("1", "0")]
    try:
        texts = [p.parse("book.pdf", book12, timeout_s=300).text for p in parsers]
    finally:
        for p in parsers:
            p.close()
    assert texts[0] == texts[1] == reference(book12)


def test_configure_layout_remakes_pymupdfs_layout_sessions_on_one_thread_with_the_arena():
    """`import pymupdf` makes the layout model's sessions with onnxruntime's defaults before a parse child can set
    anything: configure_layout finds them and makes them again (in a fresh Python, as a child starts)."""
    code = ("import json, pymupdf; from clover_batch.pipeline.parse_process import configure_layout, _layout_sessions;"
            "remade = configure_layout(1); options = [s.get_session_options() for _, _, s in "
            "_layout_sessions(pymupdf._get_layout)]; print(json.dumps([remade, [(o.intra_op_num_threads, "
            "o.inter_op_num_threads, o.enable_cpu_mem_arena) for o in options]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    remade, options = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"feature_imf1.onnx", "layout_rf2.4.1+imf1.onnx"} <= set(remade)
    assert options and all(o == [1, 1, True] for o in options)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")
def test_a_parse_child_parsing_markdown_uses_one_core(book12):
    """A worker's parse child keeps to one core (before configure_layout its layout sessions' spinning threads took
    1.9 of this machine's 2): its CPU time parsing a 12-page book is at most its wall time, plus a clock tick."""
    import time

    parser = IsolatedParser()
    try:
        parser.parse("warm.pdf", book_pdf(1), timeout_s=300)
        before, start = _cpu_seconds(parser._proc.pid), time.monotonic()
        got = parser.parse("book.pdf", book12, timeout_s=300)
        cpu, wall = _cpu_seconds(parser._proc.pid) - before, time.monotonic() - start
    finally:
        parser.close()
    assert got.status == "ok" and got.page_sources["markdown"] == 12
    assert cpu <= 1.1 * wall + 0.05, f"the parse child used {cpu:.2f} CPU-seconds in {wall:.2f} s"


@pytest.fixture
def faults(monkeypatch):
    """Set CLOVER_BATCH_FAULT_DOC for this process's parse child (restarted so it sees it, and after the test)."""
    def set_fault(spec: str) -> None:
        monkeypatch.setenv(FAULT_DOC_ENV, spec)
        shared_parser().close()

    yield set_fault
    monkeypatch.delenv(FAULT_DOC_ENV, raising=False)
    shared_parser().close()


@pytest.mark.parametrize("fault", ["markdown_hang", "markdown_crash"])
def test_a_range_that_hangs_or_crashes_in_markdown_falls_back_to_plain_text_alone(book12, faults, fault):
    faults(f"{fault}:book.pdf#pages=6-10")
    got = parse_ranges("book.pdf", book12, 12, timeout_s=8, pages_per_task=5, use_ray=False)
    assert (got.status, got.pages) == ("ok", 12), got.error
    assert got.page_sources == {"markdown": 7, "plain": 0, "ocr": 0, "plain_fallback": 5}
    # its pages' plain text between the other pages' Markdown (pymupdf4llm's, of those pages alone: the last two
    # have no chapter title, so their sections rank first there and second in the book)
    import pymupdf4llm

    with pymupdf.open(stream=book12, filetype="pdf") as doc:
        head, tail = (pymupdf4llm.to_markdown(doc, pages=pages, use_ocr=False, show_progress=False)
                      for pages in (list(range(5)), [10, 11]))
    tail = tail.replace("# Section", "## Section")
    assert got.text == tidy_lines(head + plain_pages(book12, 5, 10) + "\n\n" + tail)


def test_a_range_that_fails_twice_fails_the_document_naming_the_range(book12, faults):
    faults("parse_hang:book.pdf#pages=6-10")
    got = parse_ranges("book.pdf", book12, 12, timeout_s=8, pages_per_task=5, use_ray=False)
    assert (got.status, got.pages, got.text) == ("parse_timeout", 12, None)
    assert got.error == ("parsing pages 6-10 took longer than input.parse_timeout_s=8 s; the parser was stopped; "
                         "as plain text: parsing pages 6-10 took longer than input.parse_timeout_s=8 s; the parser "
                         "was stopped")


def test_a_short_document_that_hangs_in_markdown_falls_back_to_plain_text(faults, tmp_path):
    data = book_pdf(3)
    faults("markdown_hang:short.pdf#pages=1-3")
    got = parse_document("short.pdf", data, timeout_s=10)
    assert (got.status, got.text) == ("ok", plain_pages(data, 0, 3))
    assert got.page_sources == {"markdown": 0, "plain": 0, "ocr": 0, "plain_fallback": 3}


def _ray_parse(files: list[Path], options: dict, env: dict | None = None, timeout: float = 900) -> dict[str, dict]:
    proc = subprocess.run([sys.executable, str(HERE / "ray_parse_run.py"), json.dumps(options), *map(str, files)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {Path(r["source_uri"]).name: r for r in rows}


def test_on_ray_with_2_cpus_a_long_pdf_is_parsed_in_ranges_and_joined_with_one_row_per_document(tmp_path):
    """The read and parse stages as Ray Data tasks on a Ray of 2 CPUs, default settings: a 101-page book (five
    ranges of input.pages_per_task=25) beside a short PDF. Each document is one row; the book's text is
    pymupdf4llm's whole-book text."""
    import hashlib

    assert PAGES_PER_TASK == 25
    book = book_pdf(101, table_every=20)
    (tmp_path / "book.pdf").write_bytes(book)
    (tmp_path / "short.pdf").write_bytes(book_pdf(2, seed=1))
    rows = _ray_parse([tmp_path / "book.pdf", tmp_path / "short.pdf"], {})
    assert sorted(rows) == ["book.pdf", "short.pdf"]
    got = rows["book.pdf"]
    assert (got["status"], got["pages"], got["page_sources"]) == \
        ("ok", 101, {"markdown": 101, "plain": 0, "ocr": 0, "plain_fallback": 0}), got
    want = reference(book)
    assert got["text_sha"] == hashlib.sha256(want.encode()).hexdigest()
    # five tables cut by a page break, as pymupdf4llm writes them (page by page): header, rule and 3 rows, then
    # the next page's 2 rows as a table of their own (its first row taken as the header, then a rule)
    assert len(got["table_rows"]) == 5 * (5 + 3)
    assert rows["short.pdf"]["status"] == "ok"


def test_on_ray_a_range_that_hangs_in_markdown_is_plain_text_in_the_documents_one_row(tmp_path):
    book = book_pdf(6, seed=2)
    (tmp_path / "hung.pdf").write_bytes(book)
    rows = _ray_parse([tmp_path / "hung.pdf"], {"timeout_s": 10, "pages_per_task": 2},
                      env={FAULT_DOC_ENV: "markdown_hang:hung.pdf#pages=3-4"})
    hung = rows["hung.pdf"]
    assert (hung["status"], hung["page_sources"]) == ("ok", {"markdown": 4, "plain": 0, "ocr": 0,
                                                             "plain_fallback": 2}), hung


@pytest.mark.skipif(not os.environ.get("CLOVER_LONG_DOCS"), reason="minutes of layout analysis: CLOVER_LONG_DOCS=1")
def test_a_2000_page_book_parses_under_the_default_settings(tmp_path):
    """Issue 33's must-show: 2,000 pages of headings, paragraphs and a table every 50 pages, the default job
    settings (Markdown, OCR auto, parse_timeout_s=300, pages_per_task=25) on a Ray of 2 CPUs: `ok`, its text the
    page-by-page parse joined in order, its tables Markdown rows."""
    import hashlib
    from concurrent.futures import ProcessPoolExecutor

    from clover_batch.pipeline.parse import join_ranges
    from clover_batch.pipeline.parse_process import configure_layout

    book = book_pdf(2000)
    (tmp_path / "book.pdf").write_bytes(book)
    got = _ray_parse([tmp_path / "book.pdf"], {}, timeout=3600)["book.pdf"]
    assert (got["status"], got["pages"], got["page_sources"]["markdown"]) == ("ok", 2000, 2000), got["error"]
    assert len(got["table_rows"]) == 39 * (5 + 3)  # see the 101-page test
    assert all(row.startswith("|") and row.endswith("|") for row in got["table_rows"])
    with ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1), initializer=configure_layout,
                             initargs=(1,)) as pool:
        pages = list(pool.map(_one_page, [book] * 2000, range(2000), chunksize=50))
    want = join_ranges("pdf", 2000, pages).text
    assert got["text_sha"] == hashlib.sha256(want.encode()).hexdigest()


def _one_page(data: bytes, n: int):
    return parse_range("pdf", data, n, n + 1, ocr="auto")


def test_parse_command_prints_the_page_sources(tmp_path, faults):
    """`clover-batch parse FILE` says on stderr how many pages came from each method; here a crash in Markdown
    (fault injection) makes the short document's pages plain text as a fallback."""
    from clover_batch.jobs.cli import app
    from typer.testing import CliRunner

    path = tmp_path / "cli.pdf"
    path.write_bytes(book_pdf(3))
    faults("markdown_crash:cli.pdf#pages=1-3")
    result = CliRunner().invoke(app, ["parse", str(path)])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == plain_pages(path.read_bytes(), 0, 3)
    assert result.stderr.rstrip().endswith("; pages: 3 plain_fallback)")


def test_an_epub_in_ranges_equals_the_whole_epub():
    """EPUB pages are MuPDF's layout of the book: the same pages in every range's child, the same join."""
    from hostile_docs import make_epub

    data = make_epub([(f"Chapter {i}", " ".join([f"Words of chapter number {i}."] * 200)) for i in range(4)])
    count = pymupdf.open(stream=data, filetype="epub").page_count
    assert count > 4
    whole = parse_document("book.epub", data, timeout_s=300, pages_per_task=None)
    got = parse_ranges("book.epub", data, count, timeout_s=300, pages_per_task=2, use_ray=False)
    assert (whole.status, got.status, got.format) == ("ok", "ok", "epub")
    assert got.text == whole.text and got.text.startswith("# **Chapter 0**")
    assert got.page_sources == {"markdown": count, "plain": 0, "ocr": 0, "plain_fallback": 0}
