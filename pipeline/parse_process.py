"""Parsing in a child process, so a hostile document can stall or crash only that child, never the Ray worker.

MuPDF, libxml2 (python-docx, trafilatura) and onnxruntime (OCR) are C code fed untrusted bytes. A document that
sends one into a loop would hold a parse worker forever (a Python thread cannot be interrupted inside C); one that
crashes it, or makes it allocate until the kernel kills the process, would take the worker down with every other
document of its batch. So PDF, DOCX, HTML, EPUB and XPS documents are parsed in a child:

- One child per worker process, started on the first such document and reused for every later one: starting a
  Python with pymupdf for each document would cost more than parsing an ordinary PDF (bench/parse_isolation.py
  measures both). The OCR engine is loaded in the child on the first page that needs it, and stays loaded.
- Each document has `timeout_s` from sending its bytes to the reply, OCR of its pages included. Past it the child
  is killed (SIGKILL) and the document gets `parse_timeout`; a child that dies mid-document gives `parse_crashed`.
  The next document starts a fresh child.
- Requests and replies are length-prefixed JSON over two pipes, never pickle: a child compromised through MuPDF
  must not be able to run code in the worker by what it sends back. The child's stdout is not the channel, so C
  code printing there cannot corrupt it.
- The child dies with its parent (PR_SET_PDEATHSIG on Linux, and EOF on its request pipe), and runs in its own
  session, so Ctrl-C on the driver does not print its traceback.
- Besides whole documents, a child parses page ranges of a long PDF, EPUB or XPS (`parse_range`, driven by
  pipeline/page_ranges.py), each under its own time limit.
- The child runs the layout model (pymupdf4llm's ONNX sessions) on `LAYOUT_THREADS_ENV` threads, one by default,
  with onnxruntime's memory arena (`configure_layout`): a child serves one worker, and parallelism comes from
  workers and page ranges. onnxruntime's default (a thread per core in every child, spinning between ops) had
  each child use two cores here, competing with the other workers' for the same cores; pymupdf.layout's choice
  of no arena made every page's 57 MB of image features fresh memory, 1.3x slower. The text is the same
  (tests/test_page_ranges.py); bench/parse_formats.py --long-only measures the paths side by side.

Text and Markdown files are not sent to the child: decoding them is our own linear-time code (pipeline/parse.py),
and there is nothing in it to hang.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict

from clover_batch.pipeline.parse import (
    ISOLATED_FORMATS,
    Parsed,
    RangeText,
    document_format,
    parse_document,
    parse_range,
)

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # a busy node can take a while to start Python and import pymupdf
_PIPE_BYTES = 1 << 20  # ask Linux for 1 MiB pipes: fewer wake-ups for a large PDF
_CHILD_CODE = ("import sys; from clover_batch.pipeline.parse_process import serve; "
               "serve(int(sys.argv[1]), int(sys.argv[2]))")
LAYOUT_THREADS_ENV = "CLOVER_LAYOUT_THREADS"  # onnxruntime threads of the layout model in a parse child (0: its own)
LAYOUT_THREADS = 1


class _Timeout(Exception):
    pass


class _ChildGone(Exception):
    pass


# ---- framing: 8-byte big-endian length, then the payload ----

def _header(n: int) -> bytes:
    return n.to_bytes(8, "big")


def _read_blocking(fd: int, n: int) -> bytes | None:
    """n bytes from a blocking fd, or None on EOF before the first byte (the child's side)."""
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, _PIPE_BYTES))
        if not chunk:
            if got == 0:
                return None
            raise EOFError("request cut short")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_blocking(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def serve(request_fd: int, reply_fd: int) -> None:
    """The child's loop: read a request (JSON header, then the document's bytes), parse the document (or the page
    range the header names), reply with the Parsed (or RangeText) as JSON."""
    _die_with_parent()
    import docx  # noqa: F401  (imported before the first document: its time limit is for parsing)
    import pymupdf4llm  # noqa: F401  (loads the layout model)
    import trafilatura  # noqa: F401

    configure_layout(int(os.environ.get(LAYOUT_THREADS_ENV, LAYOUT_THREADS)))
    _write_blocking(reply_fd, _header(0))  # ready: pymupdf(4llm), python-docx and trafilatura are imported
    while True:
        size = _read_blocking(request_fd, 8)
        if size is None:
            return  # the parent closed the pipe: it is done or gone
        header = json.loads(_read_blocking(request_fd, int.from_bytes(size, "big")))
        data = _read_blocking(request_fd, header["size"]) if header["size"] else b""
        uri = header.pop("uri")
        fmt = document_format(uri)
        try:
            if header.get("op") == "range":
                parsed = parse_range(fmt, data, header["first"], header["stop"], name=uri, **header["options"])
            else:
                parsed = parse_document(uri, data, **header["options"])
        except Exception as e:  # parse_document turns the parsers' errors into statuses; anything else is reported
            parsed = Parsed(fmt, "corrupt_pdf" if fmt == "pdf" else "corrupt_file",
                            f"the {fmt.upper()} parser failed: {type(e).__name__}: {e}")
        reply = json.dumps({"kind": type(parsed).__name__, **asdict(parsed)}, ensure_ascii=False).encode("utf-8")
        _write_blocking(reply_fd, _header(len(reply)) + reply)


def configure_layout(threads: int) -> list[str]:
    """Run pymupdf.layout's ONNX sessions (pymupdf4llm's layout model) on `threads` intra-op threads (0 keeps
    onnxruntime's default) and with onnxruntime's memory arena; returns the model files of the sessions remade.

    `import pymupdf` loads the layout model, and with it makes its sessions, so options set afterwards reach only
    sessions made later: the sessions already made are found on the model and made again with these options,
    and onnxruntime's SessionOptions is replaced by one with these threads for the sessions made later (RapidOCR
    sets its threads itself). The arena keeps the largest page's buffers (about 100 MB more resident memory in a
    child than without) instead of allocating and faulting in 57 MB of image features for every page."""
    import onnxruntime

    base = getattr(onnxruntime.SessionOptions, "_clover_base", onnxruntime.SessionOptions)

    class SessionOptions(base):  # type: ignore[misc, valid-type]
        _clover_base = base

        def __init__(self) -> None:
            super().__init__()
            if threads > 0:
                self.intra_op_num_threads = threads
                self.inter_op_num_threads = 1

    onnxruntime.SessionOptions = SessionOptions
    import pymupdf

    remade = []
    for owner, name, session in _layout_sessions(getattr(pymupdf, "_get_layout", None)):
        options = SessionOptions()
        options.enable_cpu_mem_arena = True
        try:
            path = session._model_path  # onnxruntime keeps the file a session was made from
            setattr(owner, name, onnxruntime.InferenceSession(path, sess_options=options,
                                                              providers=session.get_providers()))
        except Exception as e:  # an onnxruntime without that attribute: the session stays as it was, and works
            log.warning("pymupdf's layout session %s was not remade (%s: %s)", name, type(e).__name__, e)
            continue
        remade.append(os.path.basename(path))
    if not remade:
        log.warning("pymupdf's layout model was not found: its ONNX sessions keep onnxruntime's default threads")
    return remade


def _layout_sessions(root: object, depth: int = 0, seen: set[int] | None = None):
    """(owner, attribute, session) for each onnxruntime session reachable from pymupdf.layout's analyzer function
    (its closure holds the model) through pymupdf.layout's own objects."""
    import onnxruntime

    seen = set() if seen is None else seen
    if root is None or id(root) in seen or depth > 5:
        return
    seen.add(id(root))
    children = [c.cell_contents for c in getattr(root, "__closure__", None) or ()] if callable(root) else []
    for name, value in list(getattr(root, "__dict__", {}).items()):
        if isinstance(value, onnxruntime.InferenceSession):
            yield root, name, value
        else:
            children.append(value)
    for child in children:
        if type(child).__module__.startswith("pymupdf.layout"):
            yield from _layout_sessions(child, depth + 1, seen)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass  # no libc by that name: the request pipe's EOF still ends the loop
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(0)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "it closed its pipe"
    if code < 0:
        name = signal.Signals(-code).name
        hint = ": out of memory?" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"


class IsolatedParser:
    """A persistent child process that parses documents, one at a time, each within a time limit."""

    def __init__(self, startup_timeout_s: float = STARTUP_TIMEOUT_S, env: dict[str, str] | None = None):
        self.startup_timeout_s = startup_timeout_s
        self.env = env  # the child's environment (None: this process's)
        self._proc: subprocess.Popen | None = None
        self._request_fd = self._reply_fd = -1
        self._lock = threading.Lock()
        self.starts = 0  # children started so far (1 + restarts after timeouts and crashes)

    # ---- child lifecycle ----

    def _start(self) -> None:
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        for fd in (request_w, reply_r):
            try:
                import fcntl

                fcntl.fcntl(fd, 1031, _PIPE_BYTES)  # F_SETPIPE_SZ
            except (ImportError, OSError):
                pass
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE, str(request_r), str(reply_w)],
                pass_fds=(request_r, reply_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True, env=self.env,
            )
        finally:
            os.close(request_r)
            os.close(reply_w)
        self._request_fd, self._reply_fd = request_w, reply_r
        os.set_blocking(request_w, False)
        self.starts += 1
        try:
            self._receive(time.monotonic() + self.startup_timeout_s)
        except (_Timeout, _ChildGone) as e:
            code = self._stop()
            raise RuntimeError(f"the parser process did not start ({type(e).__name__.strip('_')}, "
                               f"{_describe_exit(code)})") from None
        log.debug("parser process %d started", self._proc.pid)

    def _stop(self) -> int | None:
        """Kill the child (if alive), reap it, close the pipes; returns its exit status."""
        code = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            code = self._proc.wait()
            self._proc = None
        for fd in (self._request_fd, self._reply_fd):
            if fd >= 0:
                os.close(fd)
        self._request_fd = self._reply_fd = -1
        return code

    def close(self) -> None:
        with self._lock:
            self._stop()

    # ---- one request ----

    def _send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout
            _, writable, _ = select.select([], [self._request_fd], [], remaining)
            if writable:
                try:
                    view = view[os.write(self._request_fd, view[:_PIPE_BYTES]):]
                except BrokenPipeError:
                    raise _ChildGone from None

    def _read(self, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout
            readable, _, _ = select.select([self._reply_fd], [], [], remaining)
            if readable:
                chunk = os.read(self._reply_fd, min(n - got, _PIPE_BYTES))
                if not chunk:
                    raise _ChildGone
                chunks.append(chunk)
                got += len(chunk)
        return b"".join(chunks)

    def _receive(self, deadline: float) -> bytes:
        return self._read(int.from_bytes(self._read(8, deadline), "big"), deadline)

    def _request(self, header: dict, data: bytes, timeout_s: float, what: str) -> dict | tuple[str, str]:
        """The child's reply to one request, or (status, message) when it does not answer within `timeout_s`."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:  # died between documents (killed from outside): not this one's fault
                    self._stop()
                self._start()
            head = json.dumps({**header, "size": len(data)}).encode()
            deadline = time.monotonic() + timeout_s
            try:
                self._send(_header(len(head)) + head + data, deadline)
                return json.loads(self._receive(deadline))
            except _Timeout:
                self._stop()
                return "parse_timeout", (f"parsing {what}took longer than input.parse_timeout_s={timeout_s:g} s; "
                                         "the parser was stopped")
            except _ChildGone:
                code = self._stop()
                return "parse_crashed", f"the parser process died on {what or 'this document '}({_describe_exit(code)})"

    def parse(self, uri: str, data: bytes, *, timeout_s: float, fallback_encoding: str | None = None,
              max_pages: int | None = None, pdf_text: str = "markdown", ocr: str = "auto",
              max_unpacked_bytes: int | None = None, pages_per_task: int | None = None) -> Parsed:
        """`parse_document` in the child (the options are its own); `parse_timeout` / `parse_crashed` when the
        child does not answer within `timeout_s`."""
        options = {"fallback_encoding": fallback_encoding, "max_pages": max_pages, "pdf_text": pdf_text, "ocr": ocr,
                   "max_unpacked_bytes": max_unpacked_bytes, "pages_per_task": pages_per_task}
        reply = self._request({"op": "parse", "uri": uri, "options": options}, data, timeout_s, "")
        if isinstance(reply, tuple):
            return Parsed(document_format(uri), *reply)
        reply.pop("kind")
        return Parsed(**reply)

    def parse_range(self, uri: str, data: bytes, first: int, stop: int, *, timeout_s: float,
                    pdf_text: str = "markdown", ocr: str = "auto") -> RangeText | Parsed:
        """`parse_range` of pages `first` to `stop - 1` in the child; a Parsed for a failure (`parse_timeout` /
        `parse_crashed` when the child does not answer within `timeout_s`)."""
        header = {"op": "range", "uri": uri, "first": first, "stop": stop,
                  "options": {"pdf_text": pdf_text, "ocr": ocr}}
        reply = self._request(header, data, timeout_s, f"pages {first + 1}-{stop} ")
        if isinstance(reply, tuple):
            return Parsed(document_format(uri), *reply)
        kind = reply.pop("kind")
        return RangeText(**reply) if kind == "RangeText" else Parsed(**reply)

    def parse_pdf(self, data: bytes, *, timeout_s: float, max_pages: int | None = None, pdf_text: str = "markdown",
                  ocr: str = "auto") -> Parsed:
        """One PDF's bytes (`parse` of a document named `document.pdf`)."""
        return self.parse("document.pdf", data, timeout_s=timeout_s, max_pages=max_pages, pdf_text=pdf_text, ocr=ocr)


_shared: IsolatedParser | None = None
_shared_lock = threading.Lock()


def shared_parser() -> IsolatedParser:
    """This process's parser child (one per Ray worker process, kept across tasks)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = IsolatedParser()
            atexit.register(_shared.close)
        return _shared


def parse_isolated(uri: str, data: bytes, *, timeout_s: float, fallback_encoding: str | None = None,
                   max_pages: int | None = None, pdf_text: str = "markdown", ocr: str = "auto",
                   max_unpacked_bytes: int | None = None, pages_per_task: int | None = None) -> Parsed:
    """`parse_document` with PDF, DOCX, HTML, EPUB and XPS documents parsed in this process's child under
    `timeout_s`; text and Markdown in-process. (With `pages_per_task`, a longer PDF, EPUB or XPS is answered with
    status SPLIT: pipeline/page_ranges.py parses it.)"""
    if document_format(uri) in ISOLATED_FORMATS and data:
        return shared_parser().parse(uri, data, timeout_s=timeout_s, fallback_encoding=fallback_encoding,
                                     max_pages=max_pages, pdf_text=pdf_text, ocr=ocr,
                                     max_unpacked_bytes=max_unpacked_bytes, pages_per_task=pages_per_task)
    return parse_document(uri, data, fallback_encoding=fallback_encoding, max_pages=max_pages, pdf_text=pdf_text,
                          ocr=ocr, max_unpacked_bytes=max_unpacked_bytes)
