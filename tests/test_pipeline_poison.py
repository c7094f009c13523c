"""Poison documents: one that kills the infer actor's process gets a `crashed` row after input.max_attempts deaths,
and the documents that shared the engine with it are run again alone and come out `ok`, not charged with it. The
actor comes back after each death (Ray restarts it from its small constructor arguments), and the run exits 3."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid

import pytest
from clover_batch.connectors.attempts import AttemptStore, forget_committed
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import read_output
from clover_batch.jobs.runner import DEFAULT_RETRY_STATUSES, run
from clover_batch.jobs.spec import parse_job
from conftest import assert_clean_ray_output, failing_on_token, job_raw, requires_engine, write_job


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
    b.enter({"d1": True}, past=past)  # the suspect runs alone (its past as read), and the process dies again
    again = b.unfinished(["d1"])["d1"]
    assert [x.alone for x in again] == [False, True] and {x.run_id for x in again} == {"run-1"}
    assert forget_committed(out, pa.array(["d1"], pa.string())) == 1  # its crashed row committed
    assert b.unfinished(["d1"]) == {}


def _watch_adds(engine, on_add):
    """Call on_add(name, names inside) on the engine thread as each request goes into `engine`."""
    add = engine.add

    def watched(request):
        on_add(request.id.split("#")[0], sorted(i.split("#")[0] for i in engine.in_flight()))
        add(request)

    engine.add = watched


def test_engine_loop_runs_a_suspect_alone():
    """A suspect waits for an empty engine and runs with no other document; the others wait, then run together."""
    from clover_batch.model import DecodeOptions, Engine, generate, load_model
    from clover_batch.pipeline.serving import EngineLoop

    model = load_model("tiny")
    options = DecodeOptions(max_new_tokens=8, tokens_per_step=2)
    engine = Engine(model, options, max_slots=4)
    admitted: list[dict[str, bool]] = []
    adds: list[tuple[str, list[str]]] = []
    _watch_adds(engine, lambda name, inside: adds.append((name, inside)))
    loop = EngineLoop(engine, on_admit=lambda entering: admitted.append(dict(entering)))
    prompts = {name: [7 + i] * (5 + 3 * i) for i, name in enumerate("abcdes")}

    async def main():
        first = [asyncio.ensure_future(loop.submit(prompts[n], name=n)) for n in "abc"]
        await asyncio.sleep(0.05)
        suspect = asyncio.ensure_future(loop.submit(prompts["s"], name="s", alone=True))
        later = [asyncio.ensure_future(loop.submit(prompts[n], name=n)) for n in "de"]
        return await asyncio.gather(*first, suspect, *later)

    results = dict(zip([*"abc", "s", *"de"], asyncio.run(main()), strict=True))
    assert admitted.count({"s": True}) == 1 and sorted(n for a in admitted for n in a) == sorted("abcdes")
    solo = [i for i, (name, _) in enumerate(adds) if name == "s"]
    assert len(solo) == 1
    assert adds[solo[0]][1] == []  # nothing was in the engine when the suspect entered
    assert adds[solo[0] + 1][1] == []  # and nothing entered until it had finished
    assert results["s"].decode_batch == 1
    for n in "abcdes":
        assert results[n].tokens == generate(model, [prompts[n]], options)[0].tokens


def test_attempt_records_charge_a_death_alone_to_that_document_only(tmp_path):
    """The records thread writes a document's record before it enters and removes it after it came out, in the
    order the engine hands them over: when a suspect enters alone, its record is the only one on disk, and no
    result is delivered before its record is gone. (Records removed later, from the awaiting coroutines, let a
    suspect that had finished alone be charged with the death of the next suspect: the flake of
    test_a_document_that_kills_the_actor..., a memo ending `crashed`.)"""
    from clover_batch.model import DecodeOptions, Engine, load_model
    from clover_batch.pipeline.serving import EngineLoop

    store = AttemptStore(Location(str(tmp_path / "out")), "run-1")
    names = [*"abcd", "s1", "s2", "s3", *"ef"]
    engine = Engine(load_model("tiny"), DecodeOptions(max_new_tokens=6, tokens_per_step=2), max_slots=3)
    returned: set[str] = set()
    seen: list[tuple[str, list[str], set[str]]] = []
    leaves: list[str] = []
    _watch_adds(engine, lambda name, inside: seen.append((name, inside, set(store.unfinished(names)))))

    def on_leave(left: list[str]) -> None:
        assert not returned & set(left)  # nobody has its result before its record is gone
        leaves.extend(left)
        store.finish(left)

    loop = EngineLoop(engine, on_admit=store.enter, on_leave=on_leave)

    async def one(name: str, prompt: list[int]):
        gen = await loop.submit(prompt, name=name, alone=name.startswith("s"))
        returned.add(name)
        return gen

    async def main():
        return await asyncio.gather(*(one(n, [5 + i] * (4 + 5 * i)) for i, n in enumerate(names)))

    assert all(r.tokens for r in asyncio.run(main()))
    assert sorted(name for name, _, _ in seen) == sorted(names)  # each entered once
    for name, inside, recorded in seen:
        assert {name, *inside} <= recorded  # on record before it goes in, and while inside
        if name.startswith("s"):
            assert inside == [] and recorded == {name}  # alone, and every earlier record is gone
    assert sorted(leaves) == sorted(names) and store.unfinished(names) == {}


def test_a_failing_step_reruns_each_document_alone_on_the_record(tmp_path):
    """A step that raises (not a death) reruns the documents in flight one at a time: each rerun is recorded as
    alone, after the records of those that came out before it are gone; the failing one gets its error, the others
    their results, and no record stays."""
    from clover_batch.model import DecodeOptions, Engine, generate, load_model
    from clover_batch.pipeline.serving import EngineLoop

    model, poison = load_model("tiny"), 77
    flaky = failing_on_token("tiny", poison)
    options = DecodeOptions(max_new_tokens=24, tokens_per_step=2)
    engine = Engine(flaky, options, max_slots=4)
    store = AttemptStore(Location(str(tmp_path / "out")), "run-1")
    prompts = {"a": [5] * 9, "b": [6] * 14, "p": [poison] * 11, "c": [8] * 6}
    admitted: list[dict[str, bool]] = []
    seen: list[tuple[str, list[str], dict]] = []
    _watch_adds(engine, lambda name, inside: seen.append((name, inside, store.unfinished(prompts))))

    def on_admit(entering: dict[str, bool]) -> None:
        admitted.append(dict(entering))
        store.enter(entering)

    loop = EngineLoop(engine, on_admit=on_admit, on_leave=store.finish)

    async def main():
        return await asyncio.gather(*(loop.submit(p, name=n) for n, p in prompts.items()), return_exceptions=True)

    results = dict(zip(prompts, asyncio.run(main()), strict=True))
    assert isinstance(results["p"], RuntimeError) and "kernel failure" in str(results["p"])
    for n in "abc":
        assert results[n].tokens == generate(model, [prompts[n]], options)[0].tokens
    reruns = [e for e in admitted if list(e.values()) == [True]]
    assert {"p": True} in reruns  # the documents in flight when the step failed ran again alone (which others
    # were still inside then depends on timing: they all fit in the engine, so most often all of them)
    checked = set()
    for name, inside, recorded in seen:
        assert {name, *inside} <= set(recorded)
        if inside == [] and {name: True} in reruns and recorded[name][-1].alone:  # a rerun going in alone
            done = {n for e in reruns[:reruns.index({name: True})] for n in e}
            assert not done & set(recorded)  # the reruns before it are off the record
            checked.add(name)
    assert checked == {n for e in reruns for n in e}  # each rerun was seen going in alone, on the record
    assert store.unfinished(prompts) == {}


def test_the_engine_keeps_stepping_while_records_are_written():
    """on_admit runs on the records thread (a round trip to an object store), not on the engine thread: documents
    already inside keep decoding meanwhile, and the new one enters once its record is written."""
    import threading

    from clover_batch.model import DecodeOptions, Engine, generate, load_model
    from clover_batch.pipeline.serving import EngineLoop

    model = load_model("tiny")
    options = DecodeOptions(max_new_tokens=64, tokens_per_step=2, stop_token_ids=())
    engine = Engine(model, options, max_slots=4)
    a_inside, steps, counted = threading.Event(), [0], threading.Event()
    _watch_adds(engine, lambda name, inside: a_inside.set() if name == "a" else None)
    step = engine.step

    def counting_step():
        steps[0] += 1
        if steps[0] >= 3:
            counted.set()
        return step()

    engine.step = counting_step

    def on_admit(entering: dict[str, bool]) -> None:
        if "b" in entering:  # a slow write: returns once the engine has stepped 3 times more
            steps[0] = 0
            counted.clear()
            assert counted.wait(timeout=60), "the engine did not step while a record was being written"

    loop = EngineLoop(engine, on_admit=on_admit)
    prompts = {"a": [9] * 12, "b": [11] * 7}

    async def main():
        a = asyncio.ensure_future(loop.submit(prompts["a"], name="a"))
        await asyncio.to_thread(a_inside.wait, 60)
        b = await loop.submit(prompts["b"], name="b")
        return await a, b

    a, b = asyncio.run(main())
    assert a.tokens == generate(model, [prompts["a"]], options)[0].tokens
    assert b.tokens == generate(model, [prompts["b"]], options)[0].tokens


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
    assert first.returncode == 3, first.stdout + first.stderr  # completed, with a failed row
    assert "1 documents have failed rows (crashed=1)" in first.stderr and "--retry-failed" in first.stderr
    # the actor was killed twice mid-run and came back each time, with no word from Ray about lost arguments
    assert_clean_ray_output(first.stderr)

    rows = {os.path.basename(r["source_uri"]): r for r in read_output(Location(str(out))).to_pylist()}
    assert len(rows) == 5 and len({r["doc_id"] for r in rows.values()}) == 5
    assert {n: r["status"] for n, r in rows.items()} == {**{f"memo-{i}.txt": "ok" for i in range(4)},
                                                         "poison.txt": "crashed"}
    error = rows["poison.txt"]["error"]
    assert "process died 2 times with this document in its engine" in error and "input.max_attempts=2" in error
    # first death with the others inside (they are run again alone, and come out ok), the second with it alone
    assert error.count(" pid ") == 2 and error.count("(alone)") == 1
    assert len(set(re.findall(r" pid (\d+)", error))) == 2  # two processes: the actor was restarted
    # only the poison document is still on record; the others came back from the engine
    assert sorted(os.listdir(out / "_attempts")) == [f"{rows['poison.txt']['doc_id']}.json"]

    # every later run completes: a crashed row is final ...
    again = run(parse_job(raw)).report
    assert (again.processed, again.skipped_done) == (0, 5)
    # ... and the run still says so: the output's rows are judged, not only this run's
    assert (again.documents_by_status, again.failures, again.exit_code) == ({"crashed": 1, "ok": 4}, {"crashed": 1}, 3)
    assert os.listdir(out / "_attempts") == []  # records of committed documents are dropped
    # ... unless retried, here with the fault gone (say the node had too little memory that night)
    retried = run(parse_job(raw), retry_statuses=DEFAULT_RETRY_STATUSES).report
    assert (retried.retried, retried.processed, retried.output_rows, retried.by_status) == (1, 1, 5, {"ok": 1})
    assert (retried.documents_by_status, retried.failures, retried.exit_code) == ({"ok": 5}, {}, 0)
    assert {r["status"] for r in read_output(Location(str(out))).to_pylist()} == {"ok"}
