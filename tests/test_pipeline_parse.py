"""Parsing: good documents give their text; each bad kind gives its named status and a clear message."""

from __future__ import annotations

import pytest
from clover_batch.pipeline.parse import parse_document
from conftest import make_pdf, write_bad_docs, write_good_docs


def test_good_documents(tmp_path):
    write_good_docs(tmp_path)
    lease = parse_document("lease.pdf", (tmp_path / "lease.pdf").read_bytes())
    assert (lease.status, lease.format, lease.pages) == ("ok", "pdf", 1)
    assert "Rent 100 EUR" in lease.text
    report = parse_document("report.pdf", (tmp_path / "report.pdf").read_bytes())
    assert report.pages == 3
    assert report.text.index("sales grew") < report.text.index("costs fell") < report.text.index("outlook good")
    faq = parse_document("faq.md", (tmp_path / "faq.md").read_bytes())
    assert (faq.status, faq.format, faq.text) == ("ok", "markdown", "# FAQ\n\nIt summarizes documents.\n")


def test_bad_documents_each_get_a_named_status(tmp_path):
    expected = write_bad_docs(tmp_path)
    expected.pop("huge.txt")  # too_long is decided after tokenizing
    got = {name: parse_document(name, (tmp_path / name).read_bytes()) for name in expected}
    assert {name: p.status for name, p in got.items()} == expected
    for p in got.values():
        assert p.error and p.text is None
    assert "password" in got["encrypted.pdf"].error
    assert "%%EOF" in got["truncated.pdf"].error
    assert "byte 0xe9 at offset 3" in got["latin1.txt"].error
    assert ".pptx" in got["slides.pptx"].error
    assert "2 pages" in got["scan.pdf"].error


def test_fallback_encoding_opt_in(tmp_path):
    data = "Caf\xe9 cr\xe8me".encode("cp1252")
    parsed = parse_document("x.txt", data, fallback_encoding="cp1252")
    assert (parsed.status, parsed.text) == ("ok", "Café crème")


def test_utf8_bom_is_dropped():
    assert parse_document("x.txt", b"\xef\xbb\xbfhello").text == "hello"


@pytest.mark.parametrize("body", [b"   \n\t\n", b"\n"])
def test_whitespace_only_text_is_no_text(body):
    assert parse_document("x.txt", body).status == "no_text"


def test_pdf_with_empty_user_password_opens(tmp_path):
    path = make_pdf(tmp_path / "owner-only.pdf", ["readable"], encryption=4, owner_pw="owner")
    parsed = parse_document("owner-only.pdf", path.read_bytes())
    assert (parsed.status, parsed.text) == ("ok", "readable")


def test_read_stage_statuses_and_retries_transient_errors():
    import fsspec
    import pyarrow as pa
    from clover_batch.pipeline.rows import WORK_SCHEMA
    from clover_batch.pipeline.stages import ReadStage
    from fsspec.implementations.memory import MemoryFileSystem

    class FlakyFS(MemoryFileSystem):
        """A store whose first two reads of each file fail like a throttled S3 request."""

        protocol = "flaky"
        failures: dict[str, int] = {}  # noqa: RUF012

        @classmethod
        def _strip_protocol(cls, path):
            return MemoryFileSystem._strip_protocol("memory://" + str(path).removeprefix("flaky://"))

        def _open(self, path, mode="rb", **kwargs):
            if "r" in mode and self.failures.get(path, 0) < 2:
                self.failures[path] = self.failures.get(path, 0) + 1
                raise ConnectionError("503 Slow Down")
            return super()._open(path, mode, **kwargs)

    fsspec.register_implementation("flaky", FlakyFS, clobber=True)
    fs = FlakyFS()
    fs.pipe_file("/docs/a.txt", b"hello")
    fs.pipe_file("/docs/big.txt", b"x" * 100)
    rows = [{"doc_id": n, "source_uri": f"flaky://docs/{n}", "size": size, "status": "ok"}
            for n, size in (("a.txt", 5), ("big.txt", 100), ("gone.txt", 1))]
    stage = ReadStage({}, max_file_bytes=50)
    stage.RETRY_DELAYS_S = (0.01, 0.01, 0.01)
    out = {r["doc_id"]: r for r in stage(pa.Table.from_pylist(rows, WORK_SCHEMA)).to_pylist()}
    assert out["a.txt"]["status"] == "ok" and out["a.txt"]["data"] == b"hello"  # two 503s, then read
    assert out["big.txt"]["status"] == "too_large" and "max_file_bytes=50" in out["big.txt"]["error"]
    assert out["gone.txt"]["status"] == "read_error" and "FileNotFoundError" in out["gone.txt"]["error"]
    assert FlakyFS.failures == {"/docs/a.txt": 2, "/docs/gone.txt": 2}  # not-found ends the retries at once
