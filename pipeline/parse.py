"""Parsing documents into text, with every failure a named status instead of an exception.

Formats (by extension): PDF (`.pdf`), Word (`.docx`), HTML (`.html`, `.htm`, `.xhtml`), EPUB (`.epub`), XPS
(`.xps`, `.oxps`), plain text (`.txt`, `.text`) and Markdown (`.md`, `.markdown`).

- PDF, EPUB and XPS are read by MuPDF (pymupdf). Their text is Markdown by default (`pdf_text="markdown"`:
  pymupdf4llm's layout analysis gives headings, lists, reading order across columns, and tables as Markdown tables)
  or MuPDF's plain text (`pdf_text="plain"`, a hundred times and more cheaper per page; see bench/parse_formats.py).
- PDF pages without a usable text layer are recognised by OCR (`ocr="auto"`; `always`, `never`;
  pipeline/ocr.py). `Parsed.text_source` says how the text was obtained: `text` (from the file's own text),
  `ocr` (only recognised text) or `mixed` (both); None when no text came out.
- DOCX and HTML are converted to Markdown by pipeline/formats.py (python-docx; trafilatura's main-text extraction).
- Everything but plain text and Markdown runs in a child process under a time limit (pipeline/parse_process.py).
- A PDF, EPUB or XPS is parsed as one or more page ranges (`parse_range`; the pipeline makes a long document's ranges
  Ray tasks, pipeline/page_ranges.py), joined by `join_ranges` into what one parse of all its pages gives;
  `Parsed.page_sources` counts its pages by how their text was obtained (PAGE_SOURCES).

Statuses (the `status` column; `ok` when text came out):
    empty               zero-byte file
    unsupported_format  an extension we do not parse (see above)
    too_large           a DOCX, EPUB or XPS (zip archives) whose parts unpack to more than `max_unpacked_bytes`
                        (`input.max_file_bytes`): a zip bomb. (Files over that size are refused before reading.)
    corrupt_pdf         pymupdf cannot open the PDF, or it has no pages
    corrupt_file        a DOCX, EPUB or XPS that cannot be opened or read: not a zip archive, parts missing,
                        malformed XML
    truncated_pdf       no `%%EOF` marker near the end: the file was cut off (pymupdf would silently "repair" it
                        and return a partial text, which we refuse to summarize as if it were whole)
    encrypted           the PDF (or EPUB, XPS) needs a password
    too_many_pages      more pages than `input.max_pages` (checked before any text is extracted or recognised)
    parse_timeout       parsing ran past `input.parse_timeout_s` (pipeline/parse_process.py stops the parser); for
                        a PDF, EPUB or XPS: one page range (or the short document) did, in Markdown and again as
                        plain text (pipeline/page_ranges.py)
    parse_crashed       the parser process died on the document or page range (a MuPDF crash, or killed for
                        memory); for a PDF, EPUB or XPS range: in Markdown and again as plain text
    no_text             no text came out: PDF pages with no text layer and none recognised (or `ocr="never"`), a
                        DOCX or HTML page with no text, a text file that is only whitespace
    binary              a .txt/.md/.html whose bytes are not text (NUL bytes or mostly control characters)
    decode_error        text that is not valid UTF-8. We do not guess an encoding by default: a wrong guess gives
                        mojibake that the model would summarize confidently. `input.fallback_encoding` (e.g.
                        "cp1252") opts in to decoding with a named legacy encoding instead. (An HTML page is decoded
                        as its BOM or `<meta charset>` says, when it says.)

Text is cleaned of lone surrogates (U+FFFD instead), so every `ok` text is valid UTF-8 for Arrow and the tokenizer.
`parse_document` parses in this process; the pipeline goes through pipeline/page_ranges.py and parse_process.py.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import posixpath
import re
from dataclasses import dataclass

import pymupdf
from clover_batch.pipeline.ocr import OCR_MODES, Recogniser, recognise_document

log = logging.getLogger(__name__)

TEXT_EXTENSIONS = {".txt": "text", ".text": "text", ".md": "markdown", ".markdown": "markdown"}
PDF_EXTENSIONS = {".pdf": "pdf"}
OTHER_EXTENSIONS = {".docx": "docx", ".html": "html", ".htm": "html", ".xhtml": "html", ".epub": "epub",
                    ".xps": "xps", ".oxps": "xps"}
FORMATS = ("pdf", "docx", "html", "epub", "xps", "text", "markdown")
ISOLATED_FORMATS = ("pdf", "docx", "html", "epub", "xps")  # parsed in the child process (pipeline/parse_process.py)
PDF_TEXT_MODES = ("markdown", "plain")
PAGED_FORMATS = ("pdf", "epub", "xps")  # parsed as page ranges when long (pipeline/page_ranges.py)
# How a page's text was obtained: Markdown layout, MuPDF's plain text (pdf_text=plain), OCR (recognised text, in
# either mode), or plain text because its range's Markdown run timed out, crashed or failed (a fallback)
PAGE_SOURCES = ("markdown", "plain", "ocr", "plain_fallback")
# Not a document status: `parse_document(..., pages_per_task=n)` answers this, with `pages`, for a document of
# more than n pages, which the caller then parses as page ranges (pipeline/page_ranges.py)
SPLIT = "split_into_ranges"
_SUPPORTED = "pdf, docx, html/htm, epub, xps, txt, md"
_recogniser = Recogniser()  # this process's OCR engine, loaded on the first page that needs it


@dataclass(frozen=True)
class Parsed:
    """What parsing one document gave: text, or a status naming why not."""

    format: str  # one of FORMATS, or the file extension when unsupported
    status: str  # "ok" or a named error kind (see module docstring)
    error: str | None = None  # human-readable message when status != "ok"
    text: str | None = None
    pages: int | None = None  # PDF, EPUB and XPS pages; None for the others
    text_source: str | None = None  # text | ocr | mixed when text came out, else None
    # PDF, EPUB and XPS: pages per method (PAGE_SOURCES) when text came out; None for the others
    page_sources: dict[str, int] | None = None


def document_format(uri: str) -> str:
    """One of FORMATS, or the bare extension (or 'none') for anything else."""
    ext = posixpath.splitext(uri.lower())[1]
    return (PDF_EXTENSIONS.get(ext) or OTHER_EXTENSIONS.get(ext) or TEXT_EXTENSIONS.get(ext)
            or (ext.lstrip(".") or "none"))


def parse_document(uri: str, data: bytes, *, fallback_encoding: str | None = None, max_pages: int | None = None,
                   pdf_text: str = "markdown", ocr: str = "auto", max_unpacked_bytes: int | None = None,
                   pages_per_task: int | None = None) -> Parsed:
    """Parse in this process, with no time limit: the reference that `IsolatedParser` runs in its child.

    pdf_text: "markdown" or "plain" (PDF, EPUB, XPS); ocr: "auto", "always" or "never" (PDF pages);
    max_unpacked_bytes: most bytes a DOCX, EPUB or XPS may unpack to (None: no limit); pages_per_task: a PDF, EPUB
    or XPS with more pages is not parsed here but answered with status SPLIT and its page count (None: parse all).
    """
    if pdf_text not in PDF_TEXT_MODES:
        raise ValueError(f"pdf_text must be one of {PDF_TEXT_MODES}, not {pdf_text!r}")
    if ocr not in OCR_MODES:
        raise ValueError(f"ocr must be one of {OCR_MODES}, not {ocr!r}")
    fmt = document_format(uri)
    if fmt not in FORMATS:
        return Parsed(fmt, "unsupported_format", f"unsupported file type '.{fmt}' (supported: {_SUPPORTED})")
    if not data:
        return Parsed(fmt, "empty", "the file is empty (0 bytes)")
    if fmt == "pdf":
        return _parse_paged("pdf", data, max_pages, pdf_text=pdf_text, ocr=ocr, pages_per_task=pages_per_task,
                            name=uri)
    if fmt in ("text", "markdown"):
        return _parse_text(fmt, data, fallback_encoding)
    from clover_batch.pipeline import formats  # python-docx and trafilatura: only where these formats are parsed

    if fmt == "html":
        return formats.parse_html(data, fallback_encoding)
    refused = formats.check_zip(fmt, data, max_unpacked_bytes)
    if refused is not None:
        return refused
    if fmt == "docx":
        return formats.parse_docx(data)
    return _parse_paged(fmt, data, max_pages, pdf_text=pdf_text, ocr="never", pages_per_task=pages_per_task,
                        name=uri)


def looks_binary(data: bytes) -> bool:
    head = data[:8192]
    if b"\x00" in head:
        return True
    control = sum(1 for b in head if b < 32 and b not in (9, 10, 12, 13, 27))
    return control > 0.05 * len(head)


def decode_text(fmt: str, data: bytes, fallback_encoding: str | None) -> str | Parsed:
    """UTF-8 text (a BOM is dropped), else the fallback encoding if one is set; a failure is a Parsed to return."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        if fallback_encoding is None:
            return Parsed(
                fmt,
                "decode_error",
                f"not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                "set input.fallback_encoding to decode it with a legacy encoding",
            )
        try:
            return data.decode(fallback_encoding)
        except (UnicodeDecodeError, LookupError) as e2:
            return Parsed(fmt, "decode_error", f"neither UTF-8 nor {fallback_encoding}: {e2}")


def _parse_text(fmt: str, data: bytes, fallback_encoding: str | None) -> Parsed:
    if looks_binary(data):
        return Parsed(fmt, "binary", "the file holds binary data (NUL or control bytes), not text")
    text = decode_text(fmt, data, fallback_encoding)
    if isinstance(text, Parsed):
        return text
    if not text.strip():
        return Parsed(fmt, "no_text", "the file holds only whitespace")
    return Parsed(fmt, "ok", text=clean(text), text_source="text")


def clean(text: str) -> str:
    """Lone surrogates (from a PDF's broken ToUnicode map, or a UTF-16 fallback) become U+FFFD: Arrow, JSON and
    the tokenizer all need valid UTF-8, and one bad character must not fail the batch."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


_LINE_END_SPACE = re.compile(r"[ \t]+(?=\n)")


def tidy_lines(text: str) -> str:
    """`text` without the spaces and tabs that end its lines, and stripped. pymupdf4llm ends nearly every line of
    its Markdown with a space, and MuPDF's plain text some: they carry nothing, cost tokens, and make a PDF's text
    read to a model unlike the same text typed (the demo model, trained on typed text, wrote an invoice's buyer as
    "Silverline Textiles SRL" from the PDF's parse and "Silverline Energy AG", right, from the same parse without
    them). Applied to a paged document's joined text (`join_ranges`), so the ranges' join still equals the whole
    document's."""
    return _LINE_END_SPACE.sub("", text).strip()


def markdown_reference(doc: pymupdf.Document) -> str:
    """The whole document through pymupdf4llm in one call (what parsing did before page ranges): the reference
    that `parse_range`'s Markdown, joined over ranges (pipeline/page_ranges.py), is tested and benchmarked against."""
    import pymupdf4llm

    # OCR is ours (pipeline/ocr.py, already done on the pages); images are not written anywhere
    return pymupdf4llm.to_markdown(doc, use_ocr=False, embed_images=False, write_images=False, show_progress=False)


@dataclass(frozen=True)
class RangeText:
    """What pages `first` to `stop - 1` of a PDF, EPUB or XPS gave, before the ranges are joined (`join_ranges`).

    Markdown header levels are the document's: pymupdf4llm ranks the font sizes of all its headers (the six largest
    become `#` to `######`). So a range's text comes as pieces, each header between two pieces written with one
    `#` and its font size kept, and the join adds the `#`s the whole document's sizes give.
    """

    first: int
    stop: int
    mode: str  # markdown | plain | plain_fallback: how the range's text layer became text
    pieces: list[str]  # the range's text (cleaned); between two pieces a header, its level still to be set
    header_sizes: list[int]  # font size of the header before pieces[i + 1]
    plain_chars: int  # characters of its pages' plain text: 0 when these pages hold no text
    ocr_pages: int = 0  # pages with text recognised by OCR
    ocr_read: int = 0  # pages OCR ran on
    layer: bool = False  # some of its text is the file's own text layer (not OCR)


def _open_paged(fmt: str, data: bytes, max_pages: int | None) -> tuple[pymupdf.Document, int] | Parsed:
    """The opened document and its page count, or the status saying why not (the checks before any text)."""
    pymupdf.TOOLS.mupdf_display_errors(False)  # errors become statuses; do not spray MuPDF messages on stderr
    name, corrupt = fmt.upper(), ("corrupt_pdf" if fmt == "pdf" else "corrupt_file")
    if fmt == "pdf" and b"%%EOF" not in data[-2048:]:
        return Parsed("pdf", "truncated_pdf", f"the PDF is cut off: no %%EOF marker at its end ({len(data)} bytes)")
    try:
        doc = pymupdf.open(stream=data, filetype=fmt)
    except Exception as e:  # pymupdf raises its own FileDataError and friends
        return Parsed(fmt, corrupt, f"cannot open the {name}: {e}")
    try:
        if doc.needs_pass:
            raise _Refused(Parsed(fmt, "encrypted", f"the {name} is encrypted and needs a password"))
        try:
            count = doc.page_count  # a damaged page tree raises here ("Invalid number of pages")
        except Exception as e:
            raise _Refused(Parsed(fmt, corrupt, f"cannot count the {name}'s pages: {e}")) from None
        if count == 0 and fmt == "pdf":
            raise _Refused(Parsed("pdf", "corrupt_pdf", "the PDF has no pages"))
        if max_pages is not None and count > max_pages:
            raise _Refused(Parsed(fmt, "too_many_pages", f"the {name} has {count} pages, over "
                                  f"input.max_pages={max_pages}", pages=count))
    except _Refused as refused:
        doc.close()
        return refused.parsed
    return doc, count


class _Refused(Exception):
    def __init__(self, parsed: Parsed):
        self.parsed = parsed


def parse_range(fmt: str, data: bytes, first: int, stop: int, *, pdf_text: str = "markdown", ocr: str = "auto",
                name: str = "") -> RangeText | Parsed:
    """Pages `first` to `stop - 1` of a PDF, EPUB or XPS (what a page range's parse child runs); a Parsed when the
    document cannot be opened or its pages read. `name` (the document's URI) is for fault injection only."""
    opened = _open_paged(fmt, data, None)
    if isinstance(opened, Parsed):
        return opened
    doc, count = opened
    with doc:
        if not 0 <= first < stop <= count:
            raise ValueError(f"page range {first + 1}-{stop} is not within the document's {count} pages")
        return _range_text(doc, fmt, first, stop, pdf_text=pdf_text, ocr=ocr, name=name)


def _range_text(doc: pymupdf.Document, fmt: str, first: int, stop: int, *, pdf_text: str, ocr: str,
                name: str = "", whole: bool = False) -> RangeText | Parsed:
    """The range's text; `whole`: the range is the whole document (no other range's text is joined to it)."""
    from clover_batch.connectors.faults import document_fault

    where = f"{name}#pages={first + 1}-{stop}"
    document_fault("parse_hang", where)
    pages = range(first, stop)
    try:
        recognised = recognise_document(doc, ocr if fmt == "pdf" else "never", _recogniser, pages)
        texts = [doc[n].get_text() for n in pages]
    except Exception as e:
        status = "corrupt_pdf" if fmt == "pdf" else "corrupt_file"
        return Parsed(fmt, status, f"cannot read the {fmt.upper()}'s pages {first + 1}-{stop}: {e}", pages=None)
    plain = clean("\n\n".join(p.strip() for p in texts if p.strip()))
    ocr_pages = sum(r is not None and r.ocr_chars > 0 for r in recognised)
    layer = any(r.layer_chars if r is not None else text.strip() for r, text in zip(recognised, texts, strict=True))
    common = {"first": first, "stop": stop, "plain_chars": len(plain), "ocr_pages": ocr_pages,
              "ocr_read": sum(r is not None for r in recognised), "layer": bool(layer)}
    as_plain = [plain + "\n\n"] if plain else [""]  # ranges' plain texts are joined by a blank line
    if pdf_text == "plain" or (whole and not plain):  # (a whole document with no text gets no_text: no layout)
        return RangeText(mode=pdf_text, pieces=as_plain, header_sizes=[], **common)
    document_fault("markdown_hang", where)
    document_fault("markdown_crash", where)
    try:
        pieces, sizes = markdown_pieces(doc, list(pages))
    except Exception as e:
        # Layout analysis is Python over MuPDF's output: where it fails on a damaged document that MuPDF itself
        # reads, the plain text is given instead, so a document's status does not depend on `pdf_text`
        log.warning("Markdown layout failed on pages %d-%d (%s: %s); their plain text is used", first + 1, stop,
                    type(e).__name__, e)
        return RangeText(mode="plain_fallback", pieces=as_plain, header_sizes=[], **common)
    if plain and not "".join(pieces).strip():
        log.warning("Markdown layout found no text on pages %d-%d where MuPDF finds %d characters; plain text is "
                    "used", first + 1, stop, len(plain))
        return RangeText(mode="plain_fallback", pieces=as_plain, header_sizes=[], **common)
    return RangeText(mode="markdown", pieces=pieces, header_sizes=sizes, **common)


_HEADERS = ("title", "section-header")


def markdown_pieces(doc: pymupdf.Document, pages: list[int]) -> tuple[list[str], list[int]]:
    """pymupdf4llm's Markdown of `pages` (its `to_markdown` options as `markdown_reference` gives them), as pieces
    split where the document's header levels go, and each such header's font size (see RangeText).

    The pages are analysed once; their Markdown is written twice, every header at level 1 and at level 2. The two
    texts differ by one `#` per header, so each difference is where a header's `#`s end."""
    from pymupdf4llm.helpers.document_layout import parse_document as layout_document

    # _layout_to_markdown's arguments (pymupdf4llm/__init__.py) for use_ocr=False, no images
    parsed = layout_document(doc, pages=pages, image_dpi=150, image_format="png", image_path="", ocr_dpi=150,
                             write_images=False, embed_images=False, show_progress=False, force_text=True,
                             use_ocr=False, force_ocr=False, ocr_language="eng", ocr_function=None)
    # Writing Markdown changes the analysis (a list item's spans are edited in place), so each text is written
    # from its own copy of it.
    texts, headers = [], []
    for level, analysis in ((1, copy.deepcopy(parsed)), (2, parsed)):
        headers = [box for page in analysis.pages for box in page.boxes
                   if box.boxclass in _HEADERS and getattr(box, "textlines", None) is not None]
        for box in headers:
            box.header_level = level
        texts.append(analysis.to_markdown(header=True, footer=True, write_images=False, embed_images=False,
                                          show_progress=False, page_separators=False, page_chunks=False))
    one, two = texts
    cuts, i, j = [], 0, 0
    while i < len(one):
        if one[i] == two[j]:
            i, j = i + 1, j + 1
        elif two[j] == "#":
            cuts.append(i)
            j += 1
        else:
            raise ValueError("the level-1 and level-2 Markdown differ other than by a header's '#'")
    if len(cuts) != len(headers) or j != len(two):
        raise ValueError(f"found {len(cuts)} header positions for {len(headers)} headers")
    bounds = [0, *cuts, len(one)]
    return [clean(one[a:b]) for a, b in itertools.pairwise(bounds)], [box.max_fontsize for box in headers]


def header_levels(sizes: set[int]) -> dict[int, int]:
    """Markdown level of a header by its font size, over a whole document: pymupdf4llm's `update_header_tags`."""
    top = sorted(sizes, reverse=True)[:6]
    return {s: top.index(s) + 1 if s >= top[-1] else 6 for s in sizes}


def join_ranges(fmt: str, count: int, ranges: list[RangeText], *, ocr: str = "auto") -> Parsed:
    """The document's Parsed from its ranges' texts, in page order: what one parse of all its pages gives."""
    if not any(r.plain_chars for r in ranges):
        if fmt != "pdf":
            return Parsed(fmt, "no_text", f"no text in {count} pages", pages=count)
        read = sum(r.ocr_read for r in ranges)
        why = ("OCR is off (input.ocr=never)" if ocr == "never" else
               f"and OCR found no text on the {read} it read" if read else "and no picture of text to recognise")
        return Parsed("pdf", "no_text", f"no text in {count} pages, {why}", pages=count)
    levels = header_levels({s for r in ranges for s in r.header_sizes})
    parts = []
    for r in ranges:
        parts.append(r.pieces[0])
        for size, piece in zip(r.header_sizes, r.pieces[1:], strict=True):
            parts.append("#" * (levels[size] - 1))  # its first `#` is in the piece before
            parts.append(piece)
    sources = dict.fromkeys(PAGE_SOURCES, 0)
    for r in ranges:
        sources["ocr"] += r.ocr_pages
        sources[r.mode] += r.stop - r.first - r.ocr_pages
    has_ocr, layer = any(r.ocr_pages for r in ranges), any(r.layer for r in ranges)
    source = "text" if fmt != "pdf" else "mixed" if has_ocr and layer else "ocr" if has_ocr else "text"
    return Parsed(fmt, "ok", text=tidy_lines("".join(parts)), pages=count, text_source=source,
                  page_sources=sources)


def _parse_paged(fmt: str, data: bytes, max_pages: int | None, *, pdf_text: str, ocr: str,
                 pages_per_task: int | None, name: str = "") -> Parsed:
    opened = _open_paged(fmt, data, max_pages)
    if isinstance(opened, Parsed):
        return opened
    doc, count = opened
    with doc:
        if pages_per_task is not None and count > pages_per_task:
            return Parsed(fmt, SPLIT, pages=count)
        got = _range_text(doc, fmt, 0, count, pdf_text=pdf_text, ocr=ocr, whole=True, name=name) if count else None
    if isinstance(got, Parsed):
        return dataclasses.replace(got, pages=count)
    return join_ranges(fmt, count, [got] if got else [], ocr=ocr)


def parse_pdf(data: bytes, max_pages: int | None = None, *, pdf_text: str = "markdown", ocr: str = "auto",
              pages_per_task: int | None = None) -> Parsed:
    """A PDF's text, or the status saying why not (this is what the child process of parse_process.py runs)."""
    return _parse_paged("pdf", data, max_pages, pdf_text=pdf_text, ocr=ocr, pages_per_task=pages_per_task)


def parse_ebook(fmt: str, data: bytes, max_pages: int | None = None, *, pdf_text: str = "markdown",
                pages_per_task: int | None = None) -> Parsed:
    """EPUB or XPS through MuPDF, as a PDF without OCR (pages are as MuPDF lays them out)."""
    return _parse_paged(fmt, data, max_pages, pdf_text=pdf_text, ocr="never", pages_per_task=pages_per_task)
