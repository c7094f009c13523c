"""Expert-parallel replicas in the Ray pipeline: expert_parallel: 2 writes what 1 writes, and a worker rank killed
during the run is replaced without losing or doubling a document's row."""

from __future__ import annotations

import os
import signal
import threading
import time

from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import read_output
from clover_batch.jobs.runner import run
from clover_batch.jobs.spec import parse_job
from conftest import job_raw, requires_engine, write_good_docs

# forward_passes is left out: packed prefill splits prompts by a token budget shared with the other documents
# prefilling at that moment, so a row's count of forwards depends on what arrived with it (outputs do not)
KEYS = ("status", "output_text", "output_tokens", "input_tokens")


def _rows(out) -> dict[str, tuple]:
    table = read_output(Location(str(out)))
    rows = table.to_pylist()
    ids = [r["doc_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a document has two rows"
    return {os.path.basename(r["source_uri"]): tuple(r[k] for k in KEYS) for r in rows}


def _job(docs, out, n: int):
    # two documents decode at once: the documents go through the replica in waves, so rows are committed while
    # others are still decoding (with all of them in one engine batch they would all finish together)
    return parse_job(job_raw(str(docs), str(out), model={"source": "tiny", "expert_parallel": n},
                             decode={"max_new_tokens": 24}, resources={"batch_size": 1, "max_slots": 2},
                             output={"rows_per_file": 1}))


@requires_engine
def test_expert_parallel_2_writes_same_outputs_as_1(ray_session, tmp_path):
    docs = tmp_path / "docs"
    names = write_good_docs(docs)
    run(_job(docs, tmp_path / "one", 1))
    run(_job(docs, tmp_path / "two", 2))
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert set(one) == set(names) and one == two
    assert all(v[0] == "ok" and v[2] > 0 for v in one.values())


def _worker_pids() -> list[int]:
    """Ray names an actor's process after its class (`ray::RankWorker...`); the state API needs the dashboard."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::RankWorker"):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _kill_first_worker(out, stop: threading.Event, killed: list[int]) -> None:
    """Once a first document is committed (the replica is up and decoding), SIGKILL a worker rank; records
    (pid, rows committed at that moment)."""
    while not stop.is_set():
        pids = _worker_pids()
        table = read_output(Location(str(out))) if pids else None
        if table is not None:
            os.kill(pids[0], signal.SIGKILL)
            killed.append((pids[0], table.num_rows))
            return
        time.sleep(0.05)


@requires_engine
def test_worker_killed_mid_run_every_document_once(ray_session, tmp_path):
    docs = tmp_path / "docs"
    names = write_good_docs(docs)
    for i in range(4):  # more documents than are done when the kill lands: the kill is mid-run
        (docs / f"extra-{i}.txt").write_text(f"Extra document {i}: " + "renewal notice " * (10 + 5 * i))
        names[f"extra-{i}.txt"] = "text"
    run(_job(docs, tmp_path / "ref", 1))
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_first_worker, args=(tmp_path / "out", stop, killed), daemon=True)
    killer.start()
    try:
        report = run(_job(docs, tmp_path / "out", 2)).report
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker rank was seen to kill"
    _, rows_at_kill = killed[0]
    assert rows_at_kill < len(names), "the kill landed after every document was done"
    got = _rows(tmp_path / "out")
    assert set(got) == set(names) and report.processed == len(names)
    assert got == _rows(tmp_path / "ref")  # every document decoded as on one device, after the restart
