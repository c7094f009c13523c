"""Shared fixtures: one local Ray per session, one moto S3 server per session, and real documents made with pymupdf.

Ray starts once (about 4 s) with the CPUs the machine has, at most 2 (SESSION_CPUS): tests see the shape users
see, so a job that cannot run beside its replicas hangs or is refused here too (issue 32: a session Ray of 4
logical CPUs on 2 cores hid such a hang). Subprocess tests join this Ray by its address.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pymupdf
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def make_pdf(path: Path, pages: list[str], **save_kwargs) -> Path:
    doc = pymupdf.open()
    for text in pages:
        page = doc.new_page()
        if text:
            page.insert_textbox(pymupdf.Rect(50, 50, 550, 800), text, fontsize=10)
    doc.save(path, **save_kwargs)
    return path


def words(n: int, seed: int = 0) -> str:
    """n words of deterministic English-like filler (about 6 bytes, so about 6 byte-tokens, each)."""
    vocab = ["contract", "term", "party", "notice", "rent", "clause", "renewal", "payment", "owner", "date"]
    return " ".join(vocab[(i * 7 + seed) % len(vocab)] for i in range(n))


def write_good_docs(folder: Path) -> dict[str, str]:
    """Four good documents (2 PDFs, text, markdown); one text spans several 256-token windows. name -> format."""
    folder.mkdir(parents=True, exist_ok=True)
    make_pdf(folder / "lease.pdf", ["Lease between A and B. Rent 100 EUR per month."])
    make_pdf(folder / "report.pdf", ["Page one: sales grew.", "Page two: costs fell.", "Page three: outlook good."])
    (folder / "notes.txt").write_text("Meeting notes: ship on Friday.\n" + words(45), encoding="utf-8")
    (folder / "faq.md").write_text("# FAQ\n\nIt summarizes documents.\n", encoding="utf-8")
    return {"lease.pdf": "pdf", "report.pdf": "pdf", "notes.txt": "text", "faq.md": "markdown"}


def write_bad_docs(folder: Path) -> dict[str, str]:
    """One document per failure kind; name -> expected status (with input.max_input_tokens=2000)."""
    folder.mkdir(parents=True, exist_ok=True)
    good = make_pdf(folder / "_source.pdf", ["Some text that will be damaged."]).read_bytes()
    (folder / "_source.pdf").unlink()
    (folder / "corrupt.pdf").write_bytes(b"%PDF-1.7\n" + bytes(range(256)) * 4 + b"\n%%EOF\n")
    (folder / "truncated.pdf").write_bytes(good[: len(good) // 2])
    make_pdf(folder / "encrypted.pdf", ["secret"], encryption=pymupdf.PDF_ENCRYPT_AES_256, user_pw="u", owner_pw="o")
    (folder / "empty.txt").write_bytes(b"")
    (folder / "binary.txt").write_bytes(bytes(range(256)) * 8)
    (folder / "latin1.txt").write_bytes("Caf\xe9 cr\xe8me, na\xefve r\xe9sum\xe9.".encode("latin-1"))
    (folder / "slides.pptx").write_bytes(b"PK\x03\x04 not really a pptx")
    make_pdf(folder / "scan.pdf", ["", ""])
    (folder / "huge.txt").write_text(words(600), encoding="utf-8")
    return {
        "corrupt.pdf": "corrupt_pdf",
        "truncated.pdf": "truncated_pdf",
        "encrypted.pdf": "encrypted",
        "empty.txt": "empty",
        "binary.txt": "binary",
        "latin1.txt": "decode_error",
        "slides.pptx": "unsupported_format",
        "scan.pdf": "no_text",
        "huge.txt": "too_long",
    }


@pytest.fixture
def one_thread():
    """torch on one thread for the test: small ops run several times faster than on two on a shared machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


METRICS_PORT: list[int] = []  # the session Ray's Prometheus endpoint, once started
SESSION_CPUS = min(2, os.cpu_count() or 1)  # the session Ray's CPUs: what the machine has, never more


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    METRICS_PORT.append(_free_port())
    # address="local": a new Ray of our own, never a cluster some other process left in /tmp/ray. Its metrics are
    # exported on 127.0.0.1:METRICS_PORT, each process reporting every second (Ray's default: 10 s).
    ray.init(address="local", num_cpus=SESSION_CPUS, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _metrics_export_port=METRICS_PORT[-1],
             _system_config={"metrics_report_interval_ms": 1000})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def metrics_url(ray_session) -> str:
    """The session Ray's Prometheus endpoint."""
    return f"http://127.0.0.1:{METRICS_PORT[-1]}/metrics"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-protocol server (moto) on 127.0.0.1; yields storage_options for fsspec/s3fs."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "testing",
        "secret": "testing",
        "region_name": "us-east-1",
    }
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    import boto3

    name = "bucket-" + request.node.name.replace("_", "-").lower()[:40]
    client = boto3.client(
        "s3",
        endpoint_url=s3_server["endpoint_url"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=name)
    return name, client


def failing_on_token(preset: str, token: int):
    """The preset's model, except that any forward over `token` raises, as a crash in a kernel would."""
    from clover_batch.model import load_model

    model = load_model(preset)

    class Flaky(type(model)):
        def forward_slots(self, input_ids, rows, **kw):
            if bool((input_ids == token).any()):
                raise RuntimeError("kernel failure")
            return super().forward_slots(input_ids, rows, **kw)

    model.__class__ = Flaky
    return model


def job_raw(input_uri: str, output_uri: str, **sections) -> dict:
    """A small job on the tiny preset; keyword arguments replace or extend whole sections."""
    raw = {
        "name": "test-job",
        "input": {"uri": input_uri, "max_input_tokens": 2000},
        "output": {"uri": output_uri, "rows_per_file": 4},
        "model": {"source": "tiny"},
        "task": {"kind": "summarize", "instruction": "Summarize."},
        "decode": {"max_new_tokens": 8},
        "resources": {"replicas": 1, "batch_size": 3},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return raw


def write_job(path: Path, raw: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(raw))
    return path


def assert_clean_ray_output(stderr: str) -> None:
    """What a run printed holds no deprecation warning and no error-level Ray log (such as an actor whose restart
    would fail because its constructor arguments live in the object store)."""
    assert "Deprecat" not in stderr, stderr
    assert "constructor arguments in the object store" not in stderr, stderr
    # Ray's C++ logs ("[2026-01-01 10:00:00,000 E 123 123] core_worker.cc: ..."), Python's ("ERROR name: ...")
    errors = [line for line in stderr.splitlines()
              if re.match(r"^\[[\d\- :,]+ E \d+ \d+\]", line) or re.search(r"(^|\s)ERROR\s", line)]
    assert not errors, errors


def _engine_available() -> bool:
    try:
        from clover_batch.model import generate, load_model  # noqa: F401
    except ImportError:
        return False
    return True


requires_engine = pytest.mark.skipif(not _engine_available(), reason="clover_batch.model engine not on this branch")
