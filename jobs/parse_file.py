"""`clover-batch parse`: one document read and parsed exactly as a run's read and parse stages would.

The bytes come through connectors (local path or URI, `max_file_bytes` checked as the read stage does) and the
text through the same child process and options as the pipeline's parse stage (pipeline/parse_process.py, a long
document's page ranges one after another: pipeline/page_ranges.py), so what this prints is the text the prompt
template is given for that document.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from clover_batch.connectors.fs import read_bytes
from clover_batch.pipeline.page_ranges import PAGES_PER_TASK, parse_document
from clover_batch.pipeline.parse import Parsed, document_format


@dataclass(frozen=True)
class ParseSettings:
    """The input settings of a job that decide a document's text (jobs/spec.py InputSpec, same defaults)."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    max_file_bytes: int = 256 * 2**20
    fallback_encoding: str | None = None
    parse_timeout_s: float = 300.0
    max_pages: int | None = 10_000
    pdf_text: str = "markdown"
    ocr: str = "auto"
    pages_per_task: int = PAGES_PER_TASK


@dataclass(frozen=True)
class FileParse:
    """One document's parse: what the pipeline would have put in its row, and how long it took."""

    uri: str
    parsed: Parsed
    seconds: float  # reading and parsing


def parse_file(uri: str, settings: ParseSettings) -> FileParse:
    """Read and parse one document; a read failure is a Parsed with the read stage's status (`too_large` or
    `read_error`), never an exception."""
    start = time.perf_counter()
    fmt = document_format(uri)
    try:
        data = read_bytes(uri, settings.storage_options, settings.max_file_bytes)
    except Exception as e:  # a missing file, a denied or unreachable store, or one over max_file_bytes
        too_large = isinstance(e, ValueError) and "max_file_bytes" in str(e)
        parsed = (Parsed(fmt, "too_large", f"{e} (input.max_file_bytes)") if too_large
                  else Parsed(fmt, "read_error", f"cannot read: {type(e).__name__}: {e}"))
    else:
        # page ranges one after another in this process's parse child (no Ray here), each under the time limit
        parsed = parse_document(uri, data, timeout_s=settings.parse_timeout_s,
                                fallback_encoding=settings.fallback_encoding, max_pages=settings.max_pages,
                                pdf_text=settings.pdf_text, ocr=settings.ocr,
                                max_unpacked_bytes=settings.max_file_bytes, pages_per_task=settings.pages_per_task,
                                use_ray=False)
    return FileParse(uri, parsed, time.perf_counter() - start)
