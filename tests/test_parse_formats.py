"""Documents as people have them: scans (OCR), ruled tables as Markdown, DOCX, HTML, EPUB, and `clover-batch parse`.

Every document here is real: PDFs drawn by pymupdf (a scan is a page rendered to a picture and put alone into a new
PDF), DOCX files written by python-docx, EPUB zipped by hand as the format asks.
"""

from __future__ import annotations

import os
import re

import pymupdf
import pytest
from clover_batch.jobs.cli import app
from clover_batch.jobs.spec import JobSpecError, parse_job
from clover_batch.pipeline.parse import parse_document
from clover_batch.pipeline.parse_process import IsolatedParser
from conftest import job_raw, requires_engine, write_job
from hostile_docs import make_docx, make_epub
from typer.testing import CliRunner

SCAN_TEXT = (
    "Invoice 2024-17 issued by Northwind Traders to Contoso Limited. The total amount due is 1,250.00 EUR, payable "
    "within thirty days of the invoice date. Late payments accrue interest at two percent per month. Please quote "
    "the invoice number on every payment and send any questions to the accounts department in Rotterdam. The goods "
    "were delivered on 3 May 2024 by road freight and signed for by the warehouse manager."
)
TABLE = [["Item", "Quantity", "Unit price", "Total"], ["Laptops", "26", "2,270 EUR", "59,020 EUR"],
         ["Forklift batteries", "24", "1,330 EUR", "31,920 EUR"], ["Desks", "3", "410 EUR", "1,230 EUR"]]
HTML = """<!doctype html><html><head><meta charset="utf-8"><title>Harbour news</title>
<style>body { color: STYLE-MARKER; }</style><script>var tracker = "SCRIPT-MARKER"; send(tracker);</script></head>
<body><nav><ul><li><a href="/">Home</a></li><li><a href="/ships">Ships NAV-MARKER</a></li></ul></nav>
<article><h1>Ferry timetable changes</h1><p>From 1 June the ferry to Texel leaves every forty minutes.</p>
<h2>Fares</h2><p>Fares stay the same until the end of the summer season.</p>
<ul><li>Adults: 12 EUR</li><li>Children: 6 EUR</li></ul></article>
<footer>Contact the harbour office FOOTER-MARKER</footer><script>track("SECOND-SCRIPT")</script></body></html>"""


def scanned_pdf(text: str = SCAN_TEXT, dpi: int = 200) -> bytes:
    """A real PDF page of text, rendered to a picture, put alone into a new PDF: no text layer at all."""
    src = pymupdf.open()
    page = src.new_page()
    page.insert_textbox(pymupdf.Rect(72, 72, 540, 500), text, fontsize=12)
    pix = page.get_pixmap(dpi=dpi)
    scan = pymupdf.open()
    scan.new_page(width=page.rect.width, height=page.rect.height).insert_image(page.rect, pixmap=pix)
    assert scan[0].get_text() == ""
    return scan.tobytes()


def table_pdf() -> bytes:
    """A page with a heading, a sentence, a table ruled with lines, and a closing sentence."""
    doc = pymupdf.open()
    page = doc.new_page()
    page.insert_text((72, 72), "Purchase order 4471", fontsize=16)
    page.insert_text((72, 100), "The items below were ordered on 3 May 2024.", fontsize=11)
    widths, top, height = [150, 80, 100, 110], 120, 24
    for r, row in enumerate(TABLE):
        x = 72
        for width, cell in zip(widths, row, strict=True):
            rect = pymupdf.Rect(x, top + r * height, x + width, top + (r + 1) * height)
            page.draw_rect(rect, color=(0, 0, 0), width=0.8)
            page.insert_text((rect.x0 + 4, rect.y1 - 8), cell, fontsize=10)
            x += width
    page.insert_text((72, top + len(TABLE) * height + 30), "Delivery is due within two weeks.", fontsize=11)
    return doc.tobytes()


def docx_file() -> bytes:
    return make_docx([("Title", "Supply agreement"), ("", "The supplier delivers flour every Monday morning."),
                      ("Heading 1", "Prices"), ("List Bullet", "Prices are fixed for one year."),
                      ("List Bullet", "Pallets are returned within a week.")],
                     [["Product", "Price"], ["Flour", "12 EUR"], ["Yeast | dry", "3 EUR"]])


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def word_recall(expected: str, got: str) -> float:
    have = set(_words(got))
    words = _words(expected)
    return sum(w in have for w in words) / len(words)


@pytest.fixture
def files(tmp_path):
    paths = {"scan.pdf": scanned_pdf(), "order.pdf": table_pdf(), "news.html": HTML.encode(),
             "agreement.docx": docx_file()}
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, data in paths.items():
        (docs / name).write_bytes(data)
    return docs


# ---- OCR ----

def test_a_scanned_page_gives_its_words_through_parse(files):
    result = CliRunner().invoke(app, ["parse", str(files / "scan.pdf")])
    assert result.exit_code == 0, result.stderr
    recall = word_recall(SCAN_TEXT, result.stdout)
    assert recall >= 0.85, (recall, result.stdout)
    assert "ok (pdf, 1 page; text from ocr; pdf_text=markdown, ocr=auto;" in result.stderr
    assert result.stdout.strip() and "ok (pdf" not in result.stdout  # the text alone on stdout


def test_ocr_modes_and_text_source(tmp_path):
    scan = scanned_pdf()
    assert parse_document("scan.pdf", scan, ocr="never").status == "no_text"
    assert "OCR is off (input.ocr=never)" in parse_document("scan.pdf", scan, ocr="never").error
    plain = parse_document("scan.pdf", scan, pdf_text="plain")
    assert (plain.status, plain.text_source) == ("ok", "ocr") and word_recall(SCAN_TEXT, plain.text) >= 0.85
    # a text page is left alone by auto, and read from its picture by always
    text_page = parse_document("order.pdf", table_pdf(), pdf_text="plain")
    assert text_page.text_source == "text"
    always = parse_document("order.pdf", table_pdf(), pdf_text="plain", ocr="always")
    assert always.text_source == "ocr" and word_recall(text_page.text, always.text) >= 0.85
    # a text page and a scanned page in one PDF: mixed, both pages' words, in page order
    doc = pymupdf.open(stream=table_pdf())
    doc.insert_pdf(pymupdf.open(stream=scan))
    mixed = parse_document("mixed.pdf", doc.tobytes(), pdf_text="plain")
    assert (mixed.status, mixed.pages, mixed.text_source) == ("ok", 2, "mixed")
    assert mixed.text.index("Purchase order 4471") < mixed.text.index("Northwind")
    # blank pages: nothing to recognise
    blank = pymupdf.open()
    blank.new_page()
    assert parse_document("blank.pdf", blank.tobytes()).error == ("no text in 1 pages, and no picture of text to "
                                                                  "recognise")


def test_scanned_pages_count_toward_the_parse_timeout():
    doc = pymupdf.open()
    for _ in range(6):
        doc.insert_pdf(pymupdf.open(stream=scanned_pdf()))
    parser = IsolatedParser()
    try:
        parsed = parser.parse("scans.pdf", doc.tobytes(), timeout_s=1.5)
        assert parsed.status == "parse_timeout"
        assert parser.parse("scans.pdf", doc.tobytes(), timeout_s=1.5, ocr="never").status == "no_text"
    finally:
        parser.close()


# ---- tables, HTML, DOCX, EPUB ----

def test_a_ruled_table_comes_out_as_markdown_rows_with_cells_in_order():
    parsed = parse_document("order.pdf", table_pdf())
    assert (parsed.status, parsed.text_source) == ("ok", "text")
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in parsed.text.splitlines()
            if line.startswith("|") and not set(line) <= set("|-: ")]
    assert rows == TABLE
    assert parsed.text.index("Purchase order 4471") < parsed.text.index("| Laptops".replace(" ", "")) < \
        parsed.text.index("Delivery is due")
    assert parsed.text.startswith("# Purchase order 4471")  # the largest font is a heading
    plain = parse_document("order.pdf", table_pdf(), pdf_text="plain")
    assert "|" not in plain.text and "Laptops\n26\n2,270 EUR" in plain.text  # what plain text makes of it


def test_an_html_page_gives_its_article_without_scripts_styles_or_navigation():
    parsed = parse_document("news.html", HTML.encode())
    assert (parsed.status, parsed.format, parsed.text_source) == ("ok", "html", "text")
    assert parsed.text.startswith("# Ferry timetable changes")
    for line in ("From 1 June the ferry to Texel leaves every forty minutes.", "## Fares", "- Adults: 12 EUR",
                 "- Children: 6 EUR"):
        assert line in parsed.text
    for marker in ("SCRIPT-MARKER", "SECOND-SCRIPT", "STYLE-MARKER", "NAV-MARKER", "FOOTER-MARKER", "tracker"):
        assert marker not in parsed.text


def test_html_encodings_follow_the_page_or_the_text_rules():
    page = "<html><head><meta charset='{}'></head><body><p>Caf\xe9 cr\xe8me for 4 \u20ac.</p></body></html>"
    assert parse_document("a.html", page.format("windows-1252").encode("cp1252")).text == "Café crème for 4 €."
    undeclared = page.format("").replace("<meta charset=''>", "").encode("cp1252")
    assert parse_document("b.html", undeclared).status == "decode_error"
    assert parse_document("b.html", undeclared, fallback_encoding="cp1252").text == "Café crème for 4 €."
    assert parse_document("c.html", page.format("utf-8").encode("utf-16")).text == "Café crème for 4 €."
    assert parse_document("d.html", b"<html><body><script>x()</script></body></html>").status == "no_text"


def test_a_docx_gives_its_paragraphs_headings_lists_and_table_cells():
    parsed = parse_document("agreement.docx", docx_file())
    assert (parsed.status, parsed.format, parsed.pages, parsed.text_source) == ("ok", "docx", None, "text")
    assert parsed.text == (
        "# Supply agreement\n\nThe supplier delivers flour every Monday morning.\n\n# Prices\n\n"
        "- Prices are fixed for one year.\n\n- Pallets are returned within a week.\n\n"
        "| Product | Price |\n|---|---|\n| Flour | 12 EUR |\n| Yeast \\| dry | 3 EUR |\n\nEnd of the document."
    )


def test_an_epub_gives_its_chapters_in_order():
    data = make_epub([("Chapter one", "The storm reached the harbour at dawn."),
                      ("Chapter two", "By noon the boats were back.")])
    for pdf_text in ("markdown", "plain"):
        parsed = parse_document("book.epub", data, pdf_text=pdf_text)
        assert (parsed.status, parsed.format, parsed.pages, parsed.text_source) == ("ok", "epub", 2, "text")
        text = parsed.text.replace("*", "")
        assert text.index("Chapter one") < text.index("storm reached the harbour") < text.index("Chapter two")
    assert parse_document("book.epub", data, max_pages=1).status == "too_many_pages"
    assert parse_document("doc.xps", b"PK\x03\x04" + bytes(100)).status == "corrupt_file"


# ---- the parse command ----

def test_parse_prints_exactly_the_pipelines_text_and_exits_by_status(files, tmp_path):
    runner = CliRunner()
    for name in ("order.pdf", "news.html", "agreement.docx"):
        result = runner.invoke(app, ["parse", str(files / name), "--pdf-text", "plain"])
        assert result.exit_code == 0, result.stderr
        expected = parse_document(name, (files / name).read_bytes(), pdf_text="plain")
        assert result.stdout == expected.text  # nothing added, nothing else on stdout
        assert f"ok ({expected.format}" in result.stderr
    # a job's input settings are the defaults; an option overrides them
    job = write_job(tmp_path / "job.yaml", job_raw(str(files), str(tmp_path / "out"), input={"ocr": "never"}))
    result = runner.invoke(app, ["parse", str(files / "scan.pdf"), "--job", str(job)])
    assert (result.exit_code, result.stdout) == (1, "")
    assert "scan.pdf: no_text: no text in 1 pages, OCR is off (input.ocr=never)" in result.stderr
    assert runner.invoke(app, ["parse", str(files / "scan.pdf"), "--job", str(job), "--ocr", "auto"]).exit_code == 0
    # failures: a document's status (1), a file that is not there (1), usage errors (2)
    (files / "broken.docx").write_bytes(b"PK\x03\x04 not a zip")
    result = runner.invoke(app, ["parse", str(files / "broken.docx")])
    assert (result.exit_code, result.stdout) == (1, "")
    assert "broken.docx: corrupt_file: the DOCX is not a readable zip archive" in result.stderr
    result = runner.invoke(app, ["parse", str(files / "missing.pdf")])
    assert result.exit_code == 1 and "read_error: cannot read: FileNotFoundError" in result.stderr
    assert runner.invoke(app, ["parse", str(files / "order.pdf"), "--ocr", "sometimes"]).exit_code == 2
    assert runner.invoke(app, ["parse", str(files / "order.pdf"), "-o", "novalue"]).exit_code == 2


def test_job_fields_for_pdf_text_and_ocr():
    spec = parse_job(job_raw("in", "out"))
    assert (spec.input.pdf_text, spec.input.ocr) == ("markdown", "auto")
    with pytest.raises(JobSpecError, match=r"input\.ocr: Input should be 'auto', 'always' or 'never'"):
        parse_job(job_raw("in", "out", input={"ocr": "sometimes"}))
    with pytest.raises(JobSpecError, match=r"input\.pdf_text: Input should be 'markdown' or 'plain'"):
        parse_job(job_raw("in", "out", input={"pdf_text": "html"}))


def test_example_jobs_include_the_new_formats():
    from clover_batch.jobs.spec import load_job

    for job in ("summarize-local", "extract-local"):
        include = load_job(f"jobs/examples/{job}.yaml").input.include
        assert {"*.pdf", "*.docx", "*.html", "*.htm", "*.epub", "*.xps"} <= set(include), include


# ---- a job over one of each ----

@requires_engine
def test_a_job_over_a_scan_a_table_an_html_page_and_a_docx_writes_four_ok_rows(ray_session, files, tmp_path):
    from clover_batch.connectors.fs import Location
    from clover_batch.connectors.sink import read_output
    from clover_batch.jobs.runner import run

    out = tmp_path / "out"
    report = run(parse_job(job_raw(str(files), str(out), decode={"max_new_tokens": 2}))).report
    rows = {os.path.basename(r["source_uri"]): r for r in read_output(Location(str(out))).to_pylist()}
    assert report.by_status == {"ok": 4}
    got = {name: (r["status"], r["format"], r["text_source"], r["pages"]) for name, r in rows.items()}
    assert got == {"scan.pdf": ("ok", "pdf", "ocr", 1), "order.pdf": ("ok", "pdf", "text", 1),
                   "news.html": ("ok", "html", "text", None), "agreement.docx": ("ok", "docx", "text", None)}
    assert all(r["input_tokens"] > 30 and r["output_tokens"] >= 1 for r in rows.values())
