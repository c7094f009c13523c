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
    parse_timeout       parsing ran past `input.parse_timeout_s` (pipeline/parse_process.py stops the parser)
    parse_crashed       the parser process died on the document (a MuPDF crash, or killed for memory)
    no_text             no text came out: PDF pages with no text layer and none recognised (or `ocr="never"`), a
                        DOCX or HTML page with no text, a text file that is only whitespace
    binary              a .txt/.md/.html whose bytes are not text (NUL bytes or mostly control characters)
    decode_error        text that is not valid UTF-8. We do not guess an encoding by default: a wrong guess gives
                        mojibake that the model would summarize confidently. `input.fallback_encoding` (e.g.
                        "cp1252") opts in to decoding with a named legacy encoding instead. (An HTML page is decoded
                        as its BOM or `<meta charset>` says, when it says.)

Text is cleaned of lone surrogates (U+FFFD instead), so every `ok` text is valid UTF-8 for Arrow and the tokenizer.
`parse_document` parses in this process; the pipeline goes through pipeline/parse_process.py.
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass

import pymupdf
from clover_batch.pipeline.ocr import OCR_MODES, Recogniser, recognise_document, text_source

log = logging.getLogger(__name__)

TEXT_EXTENSIONS = {".txt": "text", ".text": "text", ".md": "markdown", ".markdown": "markdown"}
PDF_EXTENSIONS = {".pdf": "pdf"}
OTHER_EXTENSIONS = {".docx": "docx", ".html": "html", ".htm": "html", ".xhtml": "html", ".epub": "epub",
                    ".xps": "xps", ".oxps": "xps"}
FORMATS = ("pdf", "docx", "html", "epub", "xps", "text", "markdown")
ISOLATED_FORMATS = ("pdf", "docx", "html", "epub", "xps")  # parsed in the child process (pipeline/parse_process.py)
PDF_TEXT_MODES = ("markdown", "plain")
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


def document_format(uri: str) -> str:
    """One of FORMATS, or the bare extension (or 'none') for anything else."""
    ext = posixpath.splitext(uri.lower())[1]
    return (PDF_EXTENSIONS.get(ext) or OTHER_EXTENSIONS.get(ext) or TEXT_EXTENSIONS.get(ext)
            or (ext.lstrip(".") or "none"))


def parse_document(uri: str, data: bytes, *, fallback_encoding: str | None = None, max_pages: int | None = None,
                   pdf_text: str = "markdown", ocr: str = "auto", max_unpacked_bytes: int | None = None) -> Parsed:
    """Parse in this process, with no time limit: the reference that `IsolatedParser` runs in its child.

    pdf_text: "markdown" or "plain" (PDF, EPUB, XPS); ocr: "auto", "always" or "never" (PDF pages);
    max_unpacked_bytes: most bytes a DOCX, EPUB or XPS may unpack to (None: no limit).
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
        return parse_pdf(data, max_pages, pdf_text=pdf_text, ocr=ocr)
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
    return parse_ebook(fmt, data, max_pages, pdf_text=pdf_text)


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


def _markdown(doc: pymupdf.Document) -> str:
    import pymupdf4llm

    # OCR is ours (pipeline/ocr.py, already done on the pages); images are not written anywhere
    return pymupdf4llm.to_markdown(doc, use_ocr=False, embed_images=False, write_images=False, show_progress=False)


def parse_pdf(data: bytes, max_pages: int | None = None, *, pdf_text: str = "markdown", ocr: str = "auto") -> Parsed:
    """A PDF's text, or the status saying why not (this is what the child process of parse_process.py runs)."""
    pymupdf.TOOLS.mupdf_display_errors(False)  # errors become statuses; do not spray MuPDF messages on stderr
    if b"%%EOF" not in data[-2048:]:
        return Parsed("pdf", "truncated_pdf", f"the PDF is cut off: no %%EOF marker at its end ({len(data)} bytes)")
    try:
        doc = pymupdf.open(stream=data, filetype="pdf")
    except Exception as e:  # pymupdf raises its own FileDataError and friends
        return Parsed("pdf", "corrupt_pdf", f"cannot open the PDF: {e}")
    with doc:
        if doc.needs_pass:
            return Parsed("pdf", "encrypted", "the PDF is encrypted and needs a password")
        try:
            count = doc.page_count  # a damaged page tree raises here ("Invalid number of pages")
        except Exception as e:
            return Parsed("pdf", "corrupt_pdf", f"cannot count the PDF's pages: {e}")
        if count == 0:
            return Parsed("pdf", "corrupt_pdf", "the PDF has no pages")
        if max_pages is not None and count > max_pages:
            return Parsed("pdf", "too_many_pages", f"the PDF has {count} pages, over input.max_pages={max_pages}",
                          pages=count)
        try:
            recognised = recognise_document(doc, ocr, _recogniser)
            pages = [page.get_text() for page in doc]
        except Exception as e:
            return Parsed("pdf", "corrupt_pdf", f"cannot read the PDF's pages: {e}", pages=count)
        plain = clean("\n\n".join(p.strip() for p in pages if p.strip()))
        if not plain:
            read = sum(r is not None for r in recognised)
            why = ("OCR is off (input.ocr=never)" if ocr == "never" else
                   f"and OCR found no text on the {read} it read" if read else "and no picture of text to recognise")
            return Parsed("pdf", "no_text", f"no text in {count} pages, {why}", pages=count)
        text = plain if pdf_text == "plain" else _markdown_or_plain(doc, plain)
    return Parsed("pdf", "ok", text=text, pages=count, text_source=text_source(recognised, pages))


def _markdown_or_plain(doc: pymupdf.Document, plain: str) -> str:
    """Markdown of a document whose plain text is `plain`. Layout analysis is Python over MuPDF's output: where it
    fails on a damaged document that MuPDF itself reads (an exception, or no text from pages that have some), the
    plain text is given instead, so a document's status does not depend on `pdf_text`."""
    try:
        text = clean(_markdown(doc).strip())
    except Exception as e:
        log.warning("Markdown layout failed (%s: %s); the document's plain text is used", type(e).__name__, e)
        return plain
    if not text:
        log.warning("Markdown layout found no text where MuPDF finds %d characters; plain text is used", len(plain))
        return plain
    return text


def parse_ebook(fmt: str, data: bytes, max_pages: int | None = None, *, pdf_text: str = "markdown") -> Parsed:
    """EPUB or XPS through MuPDF, as a PDF without OCR (pages are as MuPDF lays them out)."""
    pymupdf.TOOLS.mupdf_display_errors(False)
    name = fmt.upper()
    try:
        doc = pymupdf.open(stream=data, filetype=fmt)
    except Exception as e:
        return Parsed(fmt, "corrupt_file", f"cannot open the {name}: {e}")
    with doc:
        if doc.needs_pass:
            return Parsed(fmt, "encrypted", f"the {name} is encrypted and needs a password")
        try:
            count = doc.page_count
        except Exception as e:
            return Parsed(fmt, "corrupt_file", f"cannot count the {name}'s pages: {e}")
        if max_pages is not None and count > max_pages:
            return Parsed(fmt, "too_many_pages", f"the {name} has {count} pages, over input.max_pages={max_pages}",
                          pages=count)
        try:
            pages = [page.get_text() for page in doc]
        except Exception as e:
            return Parsed(fmt, "corrupt_file", f"cannot read the {name}'s pages: {e}", pages=count)
        plain = clean("\n\n".join(p.strip() for p in pages if p.strip()))
        if not plain:
            return Parsed(fmt, "no_text", f"no text in {count} pages", pages=count)
        text = plain if pdf_text == "plain" else _markdown_or_plain(doc, plain)
    return Parsed(fmt, "ok", text=text, pages=count, text_source="text")
