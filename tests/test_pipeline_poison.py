"""Poison documents: one that kills the infer actor's process gets a `crashed` row after input.max_attempts deaths,
and the documents that shared the engine with it are run again alone and come out `ok`, not charged with it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest
from clover_batch.connectors.attempts import AttemptStore, forget_committed
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import read_output
from clover_batch.jobs.runner import DEFAULT_RETRY_STATUSES, run
from clover_batch.jobs.spec import parse_job
from conftest import job_raw, requires_engine, write_job


@pytest.mark.parametrize("store", ["local", "memory", "s3"])
def test_attempt_records_per_document(store, tmp_path, request):
    import pyarrow as pa

    if store == "local":
        out = Location(str(tmp_path / "out"))
    elif store == "memory":
        out = Location(f"memory://attempts-{uuid.uuid4().hex[:8]}/out")
    else:
        import boto3

        s3 = request.getfixturevalue("s3_server")
        bucket = "attempts-" + uuid.uuid4().hex[:12]
        boto3.client("s3", endpoint_url=s3["endpoint_url"], aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=bucket)
        out = Location(f"s3://{bucket}/out", s3)
    a = AttemptStore(out, "run-1")
    assert a.unfinished(["d1", "d2"]) == {}
    a.enter({"d1": False, "d2": False})  # a batch enters the engine ...
    a.finish(["d2"])  # ... d2 comes back, then the process dies with d1 inside
    b = AttemptStore(out, "run-1")  # the restarted actor
    past = b.unfinished(["d1", "d2", "d3"])
    assert list(past) == ["d1"] and [x.alone for x in past["d1"]] == [False]
    b.enter({"d1": True})  # the suspect runs alone, and the process dies again
    again = b.unfinished(["d1"])["d1"]
    assert [x.alone for x in again] == [False, True] and {x.run_id for x in again} == {"run-1"}
    assert forget_committed(out, pa.array(["d1"], pa.string())) == 1  # its crashed row committed
    assert b.unfinished(["d1"]) == {}


def test_engine_loop_runs_a_suspect_alone():
    """A suspect waits for an empty engine and runs with no other document; the others wait, then run together."""
    from clover_batch.model import DecodeOptions, Engine, generate, load_model
    from clover_batch.pipeline.serving import EngineLoop

    model = load_model("tiny")
    options = DecodeOptions(max_new_tokens=8, tokens_per_step=2)
    admitted: list[tuple[dict[str, bool], list[str]]] = []
    engine = Engine(model, options, max_slots=4)
    loop = EngineLoop(engine, on_admit=lambda entering: admitted.append((dict(entering), engine.in_flight())))
    prompts = {name: [7 + i] * (5 + 3 * i) for i, name in enumerate("abcdes")}

    async def main():
        first = [asyncio.ensure_future(loop.submit(prompts[n], name=n)) for n in "abc"]
        await asyncio.sleep(0.05)
        suspect = asyncio.ensure_future(loop.submit(prompts["s"], name="s", alone=True))
        later = [asyncio.ensure_future(loop.submit(prompts[n], name=n)) for n in "de"]
        return await asyncio.gather(*first, suspect, *later)

    results = dict(zip([*"abc", "s", *"de"], asyncio.run(main()), strict=True))
    solo = [i for i, (entering, _) in enumerate(admitted) if entering == {"s": True}]
    assert len(solo) == 1
    assert admitted[solo[0]][1] == []  # nothing was in the engine when the suspect entered
    assert admitted[solo[0] + 1][1] == []  # and nothing entered until it had finished
    assert results["s"].decode_batch == 1
    for n in "abcdes":
        assert results[n].tokens == generate(model, [prompts[n]], options)[0].tokens


def test_attempt_records_name_exactly_the_documents_in_the_engine(tmp_path):
    """Records go on the engine thread as documents come out, before their results are delivered and before the
    next document enters: at every admission the records on disk are exactly the documents inside. (A record
    removed later, from the awaiting coroutine, let a suspect that had finished alone be charged with the death of
    the next suspect: the flake of test_a_document_that_kills_the_actor..., a memo ending `crashed`.)"""
    from clover_batch.model import DecodeOptions, Engine, load_model
    from clover_batch.pipeline.serving import EngineLoop

    store = AttemptStore(Location(str(tmp_path / "out")), "run-1")
    names = [*"abcd", "s1", "s2", "s3"]
    engine = Engine(load_model("tiny"), DecodeOptions(max_new_tokens=6, tokens_per_step=2), max_slots=3)
    returned: set[str] = set()
    seen: list[tuple[set[str], set[str], dict[str, bool]]] = []
    leaves: list[list[str]] = []

    def on_admit(entering: dict[str, bool]) -> None:
        inside = {i.split("#")[0] for i in engine.in_flight()}
        seen.append((set(store.unfinished(names)), inside, dict(entering)))
        store.enter(entering)

    def on_leave(left: list[str]) -> None:
        assert not returned & set(left)  # nobody has its result before its record is gone
        leaves.append(list(left))
        store.finish(left)

    loop = EngineLoop(engine, on_admit=on_admit, on_leave=on_leave)

    async def one(name: str, prompt: list[int], alone: bool):
        gen = await loop.submit(prompt, name=name, alone=alone)
        returned.add(name)
        return gen

    async def main():
        jobs = [one(n, [5 + i] * (4 + 5 * i), alone=n.startswith("s")) for i, n in enumerate(names)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    assert all(r.tokens for r in results)
    assert sum(1 for _, _, entering in seen if list(entering.values()) == [True]) == 3  # each suspect alone
    for recorded, inside, _ in seen:
        assert recorded == inside  # whatever finished is off the record; whatever is inside is on it
    assert sorted(n for left in leaves for n in left) == sorted(names)
    assert store.unfinished(names) == {}


@requires_engine
def test_a_document_that_kills_the_actor_gets_a_crashed_row_and_the_run_completes(ray_session, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"memo-{i}.txt").write_text(f"Memo {i}: the meeting moved to room {i}.")
    (docs / "poison.txt").write_text("This memo crashes the model's process (an injected fault).")
    out = tmp_path / "out"
    # one Ray batch: the four memos are in the engine (or entering it) with the poison when the process first dies
    raw = job_raw(str(docs), str(out), resources={"batch_size": 5, "max_slots": 8}, output={"rows_per_file": 2})
    raw["decode"]["max_new_tokens"] = 4
    job = write_job(tmp_path / "job.yaml", raw)
    cmd = [sys.executable, "-m", "clover_batch.jobs.cli", "run", str(job), "--address", ray_session]
    env = {**os.environ, "CLOVER_BATCH_FAULT_DOC": "crash_infer:poison"}
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr

    rows = {os.path.basename(r["source_uri"]): r for r in read_output(Location(str(out))).to_pylist()}
    assert len(rows) == 5 and len({r["doc_id"] for r in rows.values()}) == 5
    assert {n: r["status"] for n, r in rows.items()} == {**{f"memo-{i}.txt": "ok" for i in range(4)},
                                                         "poison.txt": "crashed"}
    error = rows["poison.txt"]["error"]
    assert "process died 2 times with this document in its engine" in error and "input.max_attempts=2" in error
    # first death with the others inside (they are run again alone, and come out ok), the second with it alone
    assert error.count(" pid ") == 2 and error.count("(alone)") == 1
    # only the poison document is still on record; the others came back from the engine
    assert sorted(os.listdir(out / "_attempts")) == [f"{rows['poison.txt']['doc_id']}.json"]

    # every later run completes: a crashed row is final ...
    again = run(parse_job(raw)).report
    assert (again.processed, again.skipped_done) == (0, 5)
    assert os.listdir(out / "_attempts") == []  # records of committed documents are dropped
    # ... unless retried, here with the fault gone (say the node had too little memory that night)
    retried = run(parse_job(raw), retry_statuses=DEFAULT_RETRY_STATUSES).report
    assert (retried.retried, retried.processed, retried.output_rows, retried.by_status) == (1, 1, 5, {"ok": 1})
    assert {r["status"] for r in read_output(Location(str(out))).to_pylist()} == {"ok"}
