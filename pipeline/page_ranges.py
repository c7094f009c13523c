"""Long PDFs, EPUBs and XPS documents parsed as page ranges, in parallel across the cluster, then joined in order.

Markdown layout analysis costs a few pages a second on one core, so one worker parsing a 1,000-page manual alone
leaves the rest of the cluster (and the GPUs after it) waiting, and one time limit over the whole document fails
books for being long. So (`parse_document`):

- A document of more than `pages_per_task` pages (input.pages_per_task) is parsed as ranges of that many pages:
  the worker's own parse child opens it (the checks before any text: encryption, input.max_pages, ...) and
  answers with its page count (parse.SPLIT), then each range is a Ray task, on whichever node has a free CPU, that
  parses it in that worker's isolated parse child (pipeline/parse_process.py), like a whole document.
- A range task asks for `range_task_cpus(...)`: the parse stage's own CPU share. The parse task waiting on its
  ranges (in `ray.wait`) gives its CPU back to Ray, so a range always fits where the parse task ran: a small
  cluster does not deadlock on nested tasks.
- `input.parse_timeout_s` bounds one range. A range that runs out of time or crashes in Markdown mode is parsed
  again as plain text (its pages count as `plain_fallback`); failing twice gives the document `parse_timeout` /
  `parse_crashed`, with a message naming the page range. A document is never failed for its length: its limits
  are input.max_pages and input.max_input_tokens.
- Ranges are joined in page order (parse.join_ranges), Markdown header levels set from the whole document's
  header sizes, so the text equals one parse of all the pages (tests/test_page_ranges.py).
- At most `max_in_flight` ranges of a document are submitted at once, and results that arrive before an earlier
  range's are the only ones held apart from the joined text: a 10,000-page document holds a few ranges' text
  beyond its joined text.
- Without Ray (`clover-batch parse`, tests), the ranges run one after another in this process's parse child, with
  the same limits and fallback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from clover_batch.pipeline.parse import PAGED_FORMATS, SPLIT, Parsed, RangeText, document_format, join_ranges
from clover_batch.pipeline.parse_process import STARTUP_TIMEOUT_S, parse_isolated, shared_parser

log = logging.getLogger(__name__)

# Default input.pages_per_task. A range costs a fraction of a second beyond its pages (sending the bytes, opening
# the document again: bench/parse_formats.py --long-only), against 0.3 s or more per Markdown page, so 25 pages
# keep that under a few percent. Smaller ranges spread a 100-page document over 4 CPUs, and leave a fully scanned
# range (OCR: ~5 s a page on one core, 125 s) well inside input.parse_timeout_s (300 s); 50 would take 250 s.
PAGES_PER_TASK = 25
MAX_IN_FLIGHT = 16  # most ranges of one document submitted at once (more CPUs than this: other documents use them)
WAIT_S = 5.0  # one ray.wait; between waits the stall bound is checked


def range_task_cpus(parse_cpus: float) -> float:
    """CPUs one range task asks Ray for: the parse stage's own share (see the module docstring). A resource
    planner counts a long document's parse as up to `max_in_flight` of these."""
    return parse_cpus


def stall_limit_s(timeout_s: float) -> float:
    """Longest wait for the next range with none finishing before the document gets `parse_timeout`: a range
    takes at most two tries of `timeout_s` and two child starts, and may queue behind as many other ranges."""
    return 2 * (2 * timeout_s + 2 * STARTUP_TIMEOUT_S)


def page_ranges(count: int, per_task: int) -> list[tuple[int, int]]:
    """[first, stop) page ranges of `per_task` pages (the last one shorter) covering `count` pages."""
    return [(first, min(count, first + per_task)) for first in range(0, count, per_task)]


def parse_range_with_fallback(uri: str, data: bytes, first: int, stop: int, *, timeout_s: float, pdf_text: str,
                              ocr: str) -> RangeText | Parsed:
    """One range in this process's parse child: as `pdf_text` says, then as plain text if Markdown ran out of time
    or crashed; a failure is a Parsed whose message names the range."""
    parser = shared_parser()
    got = parser.parse_range(uri, data, first, stop, timeout_s=timeout_s, pdf_text=pdf_text, ocr=ocr)
    if isinstance(got, Parsed) and got.status in ("parse_timeout", "parse_crashed") and pdf_text == "markdown":
        log.warning("%s: %s; parsing them again as plain text", uri, got.error)
        again = parser.parse_range(uri, data, first, stop, timeout_s=timeout_s, pdf_text="plain", ocr=ocr)
        if isinstance(again, RangeText):
            return replace(again, mode="plain_fallback")
        return replace(again, error=f"{got.error}; as plain text: {again.error}")
    return got


def _range_task(uri: str, data: bytes, first: int, stop: int, timeout_s: float, pdf_text: str,
                ocr: str) -> RangeText | Parsed:
    return parse_range_with_fallback(uri, data, first, stop, timeout_s=timeout_s, pdf_text=pdf_text, ocr=ocr)


_remote_range: Any = None


def _remote():
    global _remote_range
    if _remote_range is None:
        import ray

        _remote_range = ray.remote(_range_task)
    return _remote_range


def parse_ranges(uri: str, data: bytes, count: int, *, timeout_s: float, pdf_text: str = "markdown",
                 ocr: str = "auto", pages_per_task: int = PAGES_PER_TASK, range_cpus: float = 0.5,
                 use_ray: bool | None = None, max_in_flight: int = MAX_IN_FLIGHT,
                 progress: Callable[[str], None] | None = None) -> Parsed:
    """A `count`-page PDF, EPUB or XPS parsed as ranges of `pages_per_task` pages and joined in order: Ray tasks
    when Ray is running (`use_ray` None) or asked for, else one after another here."""
    fmt = document_format(uri)
    ranges = page_ranges(count, pages_per_task)
    if use_ray is None:
        import ray

        use_ray = ray.is_initialized()
    if use_ray:
        got = _gather_ray(uri, data, ranges, timeout_s=timeout_s, pdf_text=pdf_text, ocr=ocr,
                          cpus=range_task_cpus(range_cpus), max_in_flight=max_in_flight, progress=progress)
    else:
        got = []
        for first, stop in ranges:
            one = parse_range_with_fallback(uri, data, first, stop, timeout_s=timeout_s, pdf_text=pdf_text, ocr=ocr)
            got.append(one)
            if isinstance(one, Parsed):
                break
    failed = next((r for r in got if isinstance(r, Parsed)), None)
    if failed is not None:
        return replace(failed, format=fmt, pages=count, text=None)
    return join_ranges(fmt, count, got, ocr=ocr)  # type: ignore[arg-type]


def _gather_ray(uri: str, data: bytes, ranges: list[tuple[int, int]], *, timeout_s: float, pdf_text: str, ocr: str,
                cpus: float, max_in_flight: int,
                progress: Callable[[str], None] | None = None) -> list[RangeText | Parsed]:
    """The ranges' results in page order (stopping at the first failure), at most `max_in_flight` submitted at
    once; every wait bounded. `progress("parse-range")` after each finished range: the run's stall watchdog sees a
    book's parse move on long before its row does."""
    import ray

    task = _remote().options(num_cpus=cpus, max_retries=1)
    data_ref = ray.put(data)
    pending: dict[Any, int] = {}  # ref -> range index
    ready: dict[int, RangeText | Parsed] = {}
    done: list[RangeText | Parsed] = []
    submitted, limit = 0, stall_limit_s(timeout_s)
    last_progress = time.monotonic()
    try:
        while len(done) < len(ranges):
            while submitted < len(ranges) and submitted < len(done) + max_in_flight:
                first, stop = ranges[submitted]
                pending[task.remote(uri, data_ref, first, stop, timeout_s, pdf_text, ocr)] = submitted
                submitted += 1
            finished, _ = ray.wait(list(pending), num_returns=1, timeout=WAIT_S)
            for ref in finished:
                index = pending.pop(ref)
                first, stop = ranges[index]
                try:
                    ready[index] = ray.get(ref, timeout=WAIT_S)
                except Exception as e:  # the range task's worker died (Ray retried it once) or the task failed
                    ready[index] = Parsed(document_format(uri), "parse_crashed",
                                          f"parsing pages {first + 1}-{stop} failed in its Ray task: "
                                          f"{type(e).__name__}: {e}")
                last_progress = time.monotonic()
                if progress is not None:
                    progress("parse-range")
            while len(done) in ready:
                result = ready.pop(len(done))
                done.append(result)
                if isinstance(result, Parsed):
                    return done
            if not finished and time.monotonic() - last_progress > limit:
                first, stop = ranges[len(done)]
                done.append(Parsed(document_format(uri), "parse_timeout",
                                   f"no page range finished in {limit:g} s (waiting for pages {first + 1}-{stop}, "
                                   f"input.parse_timeout_s={timeout_s:g} s each); the document was given up"))
                return done
        return done
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)


def parse_document(uri: str, data: bytes, *, timeout_s: float, fallback_encoding: str | None = None,
                   max_pages: int | None = None, pdf_text: str = "markdown", ocr: str = "auto",
                   max_unpacked_bytes: int | None = None, pages_per_task: int | None = PAGES_PER_TASK,
                   range_cpus: float = 0.5, use_ray: bool | None = None,
                   progress: Callable[[str], None] | None = None) -> Parsed:
    """A document as the pipeline parses it: in this process's parse child (parse_process.parse_isolated), a PDF,
    EPUB or XPS of more than `pages_per_task` pages as ranges (see the module docstring). A range of a short
    document is the whole document, with the same fallback to plain text."""
    fmt = document_format(uri)
    paged = fmt in PAGED_FORMATS and pages_per_task is not None
    parsed = parse_isolated(uri, data, timeout_s=timeout_s, fallback_encoding=fallback_encoding, max_pages=max_pages,
                            pdf_text=pdf_text, ocr=ocr, max_unpacked_bytes=max_unpacked_bytes,
                            pages_per_task=pages_per_task if paged else None)
    if parsed.status == SPLIT:
        return parse_ranges(uri, data, parsed.pages or 0, timeout_s=timeout_s, pdf_text=pdf_text, ocr=ocr,
                            pages_per_task=pages_per_task or PAGES_PER_TASK, range_cpus=range_cpus, use_ray=use_ray,
                            progress=progress)
    if fmt in PAGED_FORMATS and parsed.status in ("parse_timeout", "parse_crashed") and pdf_text == "markdown":
        log.warning("%s: %s; parsing it again as plain text", uri, parsed.error)
        again = parse_isolated(uri, data, timeout_s=timeout_s, max_pages=max_pages, pdf_text="plain", ocr=ocr,
                               max_unpacked_bytes=max_unpacked_bytes)
        if again.status == "ok" and again.page_sources is not None:
            sources = {k: (v if k == "ocr" else 0) for k, v in again.page_sources.items()}
            sources["plain_fallback"] = again.page_sources["plain"]
            return replace(again, page_sources=sources)
        return replace(again, error=f"{parsed.error}; as plain text: {again.error}")
    return parsed
