"""PDFs parsed in a child process: per-document time limit, page limit, crashes contained, nothing left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest
from clover_batch.jobs.spec import parse_job
from clover_batch.pipeline.parse import parse_document
from clover_batch.pipeline.parse_process import IsolatedParser, parse_isolated
from clover_batch.pipeline.rows import WORK_SCHEMA
from clover_batch.pipeline.stages import ParseStage
from conftest import job_raw, make_pdf, write_bad_docs, write_good_docs
from hostile_docs import many_pages, xobject_bomb


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by a dead parent's init) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_child_gives_the_in_process_results_for_good_and_bad_documents(tmp_path):
    expected = {**write_good_docs(tmp_path), **write_bad_docs(tmp_path)}
    parser = IsolatedParser()
    try:
        for name in expected:
            data = (tmp_path / name).read_bytes()
            if name.endswith(".pdf"):
                assert parser.parse_pdf(data, timeout_s=60) == parse_document(name, data), name
            assert parse_isolated(name, data, timeout_s=60) == parse_document(name, data), name
        assert parser.starts == 1  # one child for every document
    finally:
        parser.close()


def test_a_pdf_that_never_finishes_is_stopped_and_the_next_one_parses(tmp_path):
    bomb = xobject_bomb(9)  # 2 KB that would keep MuPDF busy for hours
    good = make_pdf(tmp_path / "good.pdf", ["after the bomb"]).read_bytes()
    parser = IsolatedParser()
    try:
        parser.parse_pdf(good, timeout_s=60)
        first_child = parser._proc.pid
        start = time.perf_counter()
        parsed = parser.parse_pdf(bomb, timeout_s=1.0)
        assert time.perf_counter() - start < 10
        assert parsed.status == "parse_timeout"
        assert parsed.error == "parsing took longer than input.parse_timeout_s=1 s; the parser was stopped"
        assert not _alive(first_child)  # killed, not left running in the background
        again = parser.parse_pdf(good, timeout_s=60)
        assert (again.status, again.text, parser.starts) == ("ok", "after the bomb", 2)
    finally:
        parser.close()


@pytest.mark.parametrize(("sig", "name"), [(signal.SIGKILL, "SIGKILL: out of memory?"), (signal.SIGSEGV, "SIGSEGV")])
def test_a_child_that_dies_on_a_document_gives_parse_crashed(tmp_path, sig, name):
    """The kernel's OOM killer (SIGKILL) or a MuPDF crash (SIGSEGV) while a document is being parsed."""
    good = make_pdf(tmp_path / "good.pdf", ["fine"]).read_bytes()
    parser = IsolatedParser()
    try:
        parser.parse_pdf(good, timeout_s=60)
        child = parser._proc.pid
        killer = threading.Timer(0.5, os.kill, (child, sig))
        killer.start()
        parsed = parser.parse_pdf(xobject_bomb(9), timeout_s=60)
        killer.join()
        assert parsed.status == "parse_crashed"
        assert parsed.error == f"the parser process died on this document (killed by {name})"
        assert parser.parse_pdf(good, timeout_s=60).status == "ok"
    finally:
        parser.close()


def test_a_child_killed_between_documents_is_replaced_silently(tmp_path):
    good = make_pdf(tmp_path / "good.pdf", ["fine"]).read_bytes()
    parser = IsolatedParser()
    try:
        parser.parse_pdf(good, timeout_s=60)
        os.kill(parser._proc.pid, signal.SIGKILL)
        parser._proc.wait()
        assert parser.parse_pdf(good, timeout_s=60).status == "ok"  # not blamed on this document
        assert parser.starts == 2
    finally:
        parser.close()


def test_the_child_dies_with_its_worker(tmp_path):
    """A worker killed while its child is deep in a hostile PDF leaves no process behind."""
    bomb = tmp_path / "bomb.pdf"
    bomb.write_bytes(xobject_bomb(9))
    script = (
        "import sys, threading\n"
        "from clover_batch.pipeline.parse_process import IsolatedParser\n"
        "p = IsolatedParser()\n"
        "threading.Thread(target=p.parse_pdf, args=(open(sys.argv[1], 'rb').read(),), kwargs={'timeout_s': 600},"
        " daemon=True).start()\n"
        "import time\n"
        "while p._proc is None: time.sleep(0.01)\n"
        "print(p._proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", script, str(bomb)], stdout=subprocess.PIPE, text=True)
    child = int(worker.stdout.readline())
    time.sleep(1.0)  # the child is now inside MuPDF
    assert _alive(child)
    worker.kill()
    worker.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_page_limit_is_checked_before_extracting_text():
    data = many_pages(30)
    parsed = parse_isolated("big.pdf", data, timeout_s=60, max_pages=20)
    assert (parsed.status, parsed.pages, parsed.text) == ("too_many_pages", 30, None)
    assert parsed.error == "the PDF has 30 pages, over input.max_pages=20"
    assert parse_isolated("big.pdf", data, timeout_s=60, max_pages=30).status == "ok"


def test_parse_stage_rows_carry_the_new_statuses(tmp_path):
    rows = []
    for name, data in {"bomb.pdf": xobject_bomb(9), "big.pdf": many_pages(12),
                       "ok.pdf": make_pdf(tmp_path / "ok.pdf", ["text"]).read_bytes()}.items():
        rows.append({"source_uri": f"/docs/{name}", "size": len(data), "status": "ok", "data": data})
    table = pa.Table.from_pylist(rows, schema=WORK_SCHEMA)
    # plain text: a fresh child's first Markdown page loads the layout models, which can take a second on a busy host
    stage = ParseStage(None, timeout_s=1.0, max_pages=10, pdf_text="plain")
    out = {r["source_uri"]: r for r in stage(table).to_pylist()}
    assert out["/docs/bomb.pdf"]["status"] == "parse_timeout"
    assert (out["/docs/big.pdf"]["status"], out["/docs/big.pdf"]["pages"]) == ("too_many_pages", 12)
    assert (out["/docs/ok.pdf"]["status"], out["/docs/ok.pdf"]["text"], out["/docs/ok.pdf"]["text_source"]) == \
        ("ok", "text", "text")
    assert all(r["data"] is None for r in out.values())


def test_job_fields_for_the_limits(tmp_path):
    spec = parse_job(job_raw("in", "out"))
    assert (spec.input.parse_timeout_s, spec.input.max_pages) == (300, 10_000)
    from clover_batch.jobs.spec import JobSpecError

    with pytest.raises(JobSpecError, match=r"input\.parse_timeout_s: Input should be greater than 0"):
        parse_job(job_raw("in", "out", input={"parse_timeout_s": 0}))
    with pytest.raises(JobSpecError, match=r"input\.max_pages: Input should be greater than 0"):
        parse_job(job_raw("in", "out", input={"max_pages": -1}))
