"""Parsing documents into text, with every failure a named status instead of an exception.

Statuses (the `status` column; `ok` when text came out):
    empty               zero-byte file
    unsupported_format  extension we do not parse (only .pdf, .txt, .text, .md, .markdown)
    corrupt_pdf         pymupdf cannot open it, or it has no pages
    truncated_pdf       no `%%EOF` marker near the end: the file was cut off (pymupdf would silently "repair" it
                        and return a partial text, which we refuse to summarize as if it were whole)
    encrypted           the PDF needs a password
    too_many_pages      the PDF has more pages than `input.max_pages` (checked before any text is extracted)
    parse_timeout       parsing ran past `input.parse_timeout_s` (pipeline/parse_process.py stops the parser)
    parse_crashed       the parser process died on the document (a MuPDF crash, or killed for memory)
    no_text             the PDF has pages but no extractable text (a scan; we do no OCR), or a text file that is
                        only whitespace
    binary              a .txt/.md whose bytes are not text (NUL bytes or mostly control characters)
    decode_error        text that is not valid UTF-8. We do not guess an encoding by default: a wrong guess gives
                        mojibake that the model would summarize confidently. `input.fallback_encoding` (e.g.
                        "cp1252") opts in to decoding with a named legacy encoding instead.

Text is cleaned of lone surrogates (U+FFFD instead), so every `ok` text is valid UTF-8 for Arrow and the tokenizer.
`parse_document` parses in this process; the pipeline goes through pipeline/parse_process.py, which runs the PDF
part of it in a child process under a time limit.
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass

import pymupdf

log = logging.getLogger(__name__)

TEXT_EXTENSIONS = {".txt": "text", ".text": "text", ".md": "markdown", ".markdown": "markdown"}
PDF_EXTENSIONS = {".pdf": "pdf"}


@dataclass(frozen=True)
class Parsed:
    """What parsing one document gave: text, or a status naming why not."""

    format: str  # "pdf", "text", "markdown", or the file extension when unsupported
    status: str  # "ok" or a named error kind (see module docstring)
    error: str | None = None  # human-readable message when status != "ok"
    text: str | None = None
    pages: int | None = None  # PDF pages; None for text files


def document_format(uri: str) -> str:
    """'pdf', 'text', 'markdown', or the bare extension (or 'none') for anything else."""
    ext = posixpath.splitext(uri.lower())[1]
    return PDF_EXTENSIONS.get(ext) or TEXT_EXTENSIONS.get(ext) or (ext.lstrip(".") or "none")


def parse_document(uri: str, data: bytes, *, fallback_encoding: str | None = None,
                   max_pages: int | None = None) -> Parsed:
    """Parse in this process, with no time limit: the reference that `IsolatedParser` runs in its child."""
    fmt = document_format(uri)
    if fmt not in ("pdf", "text", "markdown"):
        return Parsed(fmt, "unsupported_format", f"unsupported file type '.{fmt}' (supported: pdf, txt, md)")
    if not data:
        return Parsed(fmt, "empty", "the file is empty (0 bytes)")
    if fmt == "pdf":
        return parse_pdf(data, max_pages)
    return _parse_text(fmt, data, fallback_encoding)


def _looks_binary(data: bytes) -> bool:
    head = data[:8192]
    if b"\x00" in head:
        return True
    control = sum(1 for b in head if b < 32 and b not in (9, 10, 12, 13, 27))
    return control > 0.05 * len(head)


def _parse_text(fmt: str, data: bytes, fallback_encoding: str | None) -> Parsed:
    if _looks_binary(data):
        return Parsed(fmt, "binary", "the file holds binary data (NUL or control bytes), not text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        if fallback_encoding is None:
            return Parsed(
                fmt,
                "decode_error",
                f"not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                "set input.fallback_encoding to decode it with a legacy encoding",
            )
        try:
            text = data.decode(fallback_encoding)
        except (UnicodeDecodeError, LookupError) as e2:
            return Parsed(fmt, "decode_error", f"neither UTF-8 nor {fallback_encoding}: {e2}")
    if not text.strip():
        return Parsed(fmt, "no_text", "the file holds only whitespace")
    return Parsed(fmt, "ok", text=_clean(text))


def _clean(text: str) -> str:
    """Lone surrogates (from a PDF's broken ToUnicode map, or a UTF-16 fallback) become U+FFFD: Arrow, JSON and
    the tokenizer all need valid UTF-8, and one bad character must not fail the batch."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def parse_pdf(data: bytes, max_pages: int | None = None) -> Parsed:
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
            pages = [page.get_text() for page in doc]
        except Exception as e:
            return Parsed("pdf", "corrupt_pdf", f"cannot read the PDF's pages: {e}", pages=count)
    text = _clean("\n\n".join(p.strip() for p in pages if p.strip()))
    if not text:
        return Parsed(
            "pdf", "no_text", f"no extractable text in {len(pages)} pages (scanned? no OCR)", pages=len(pages)
        )
    return Parsed("pdf", "ok", text=text, pages=len(pages))
