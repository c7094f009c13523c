"""The resource plan (jobs/resources.py): what a job asks of Ray, fitted to the cluster, refused or waited for.

The plan's arithmetic runs on cluster shapes written here (a shape is the plan's input, as `ray.nodes()` gives it);
the runs use a real Ray of the machine's CPUs at most (the session's, conftest.SESSION_CPUS) or, for the refusal
through the CLI, the run's own local Ray, sized by Ray from the machine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import read_output
from clover_batch.jobs.resources import (
    ClusterShape,
    ClusterTooSmall,
    Node,
    PlanRefused,
    ensure_plan,
    plan_resources,
)
from clover_batch.jobs.runner import pipeline_options, run
from clover_batch.jobs.spec import load_job, parse_job
from conftest import SESSION_CPUS, job_raw, requires_engine

REPO = Path(__file__).resolve().parent.parent


def _opts(replicas: int = 1, expert_parallel: int = 1, cpus: float = 1.0, gpus: float = 0.0):
    raw = job_raw("in", "out", resources={"replicas": replicas, "cpus_per_replica": cpus, "gpus_per_replica": gpus},
                  model={"expert_parallel": expert_parallel})
    return pipeline_options(parse_job(raw), "run-id")


def _machine(cpus: float, gpus: float = 0.0, nodes: int = 1, can_grow: bool = False) -> ClusterShape:
    return ClusterShape(tuple(Node(cpus, gpus) for _ in range(nodes)), can_grow)


def test_a_plan_that_fits_keeps_the_default_shares():
    plan = plan_resources(_opts(replicas=1), _machine(2))
    assert plan.fits and plan.fitted == [] and plan.short == []
    assert plan.task_cpus == {"read/parse/tokenize": 0.5, "infer": 0.0, "postprocess/write": 0.5}
    assert (plan.need_cpus, plan.cluster_cpus) == (1.5, 2.0)
    plan = plan_resources(_opts(replicas=2), _machine(4))
    assert plan.fits and plan.fitted == [] and plan.need_cpus == 2.5


def test_expert_ranks_are_fitted_first_then_the_prep_tasks():
    # issue 32's hang: a replica of 1 CPU and a rank of 1 CPU leave nothing for the parse tasks on 2 CPUs
    plan = plan_resources(_opts(expert_parallel=2), _machine(2))
    assert plan.fits and (plan.rank_cpus, plan.prep_cpus) == (0.5, 0.5)
    assert plan.fitted == ["expert rank CPU share 1 -> 0.5"] and plan.need_cpus == 2.0
    assert "fitted: expert rank CPU share 1 -> 0.5" in plan.describe()
    # two replicas of 1 CPU on 2 CPUs: one rank each at the smallest share still leaves no room; replicas of 0.8 do
    plan = plan_resources(_opts(replicas=2, expert_parallel=2, cpus=0.8), _machine(2))
    assert plan.fits and (plan.rank_cpus, plan.prep_cpus) == (0.1, 0.1)
    assert plan.fitted == ["expert rank CPU share 1 -> 0.1",
                           "read/parse/tokenize and postprocess/write task CPU share 0.5 -> 0.1"]
    assert plan.need_cpus == pytest.approx(1.9)


def test_a_plan_that_cannot_fit_names_the_numbers_and_the_fields_to_change():
    plan = plan_resources(_opts(replicas=2, expert_parallel=2), _machine(2))
    assert not plan.fits
    text = plan.refusal()
    assert "the job needs 2.3 CPU (resources.replicas 2 x (resources.cpus_per_replica 1 + 1 x 0.1 per expert rank)" \
           " + 0.1 for one read/parse/tokenize task) and the cluster has 2 CPU" in text, text
    assert "Change resources.replicas to 1 or resources.cpus_per_replica to 0.85" in text, text
    # the suggested values do fit
    assert plan_resources(_opts(replicas=1, expert_parallel=2), _machine(2)).fits
    assert plan_resources(_opts(replicas=2, expert_parallel=2, cpus=0.85), _machine(2)).fits
    assert not plan_resources(_opts(replicas=2, expert_parallel=2, cpus=0.9), _machine(2)).fits


def test_gpus_are_never_fitted_and_name_expert_parallel():
    plan = plan_resources(_opts(expert_parallel=2, gpus=1), _machine(8, gpus=1))
    assert not plan.fits and plan.rank_gpus == 1.0
    assert "2 GPU (resources.replicas 1 x (resources.gpus_per_replica 1 + 1 x 1 per expert rank)) and the cluster " \
           "has 1 GPU" in plan.refusal()
    assert plan.change == ["resources.gpus_per_replica to 0 (CPU replicas)", "model.expert_parallel to 1"]
    assert plan_resources(_opts(expert_parallel=2, gpus=1), _machine(8, gpus=2)).fits


def test_a_replica_and_its_ranks_must_share_a_node():
    # four nodes of 1 CPU: 4 CPU in all, but no node holds a replica of 1 CPU with a rank beside it
    plan = plan_resources(_opts(expert_parallel=2), _machine(1, nodes=4))
    assert not plan.fits and plan.cluster_cpus == 4
    assert "on one node for each replica with its expert ranks, and the nodes hold only 0 of the 1 replicas" \
           in plan.refusal()
    # 0.9 + a rank of 0.1 fill a node; the prep task runs on another
    assert plan.change == ["resources.cpus_per_replica to 0.9", "model.expert_parallel to 1"]
    # two nodes of 2 CPU: a replica with its rank on each, the prep task beside one of them
    plan = plan_resources(_opts(replicas=2, expert_parallel=2), _machine(2, nodes=2))
    assert plan.fits and plan.rank_cpus == 0.5 and plan.need_cpus == 3.5


def test_a_cluster_that_may_grow_is_waited_for_then_fails(monkeypatch):
    monkeypatch.setattr("clover_batch.jobs.resources.POLL_S", 0.05)
    looks = []

    def growing(can_grow: bool) -> ClusterShape:  # the third look finds a second node
        looks.append(1)
        return _machine(2, nodes=1 if len(looks) < 3 else 2, can_grow=can_grow)

    plan = ensure_plan(_opts(replicas=2, expert_parallel=2), can_grow=True, startup_timeout_s=30, shape=growing)
    assert plan.fits and len(looks) == 3 and plan.cluster_cpus == 4
    start = time.monotonic()
    with pytest.raises(ClusterTooSmall, match=r"the job needs 2\.3 CPU .*waited 0\.3 s for the cluster to grow"):
        ensure_plan(_opts(replicas=2, expert_parallel=2), can_grow=True, startup_timeout_s=0.3,
                    shape=lambda g: _machine(2, can_grow=g))
    assert time.monotonic() - start < 5
    with pytest.raises(PlanRefused, match=r"run\.startup_timeout_s is 0"):
        ensure_plan(_opts(replicas=2, expert_parallel=2), can_grow=True, startup_timeout_s=0,
                    shape=lambda g: _machine(2, can_grow=g))
    with pytest.raises(PlanRefused, match="on a local Ray of 1 node: 2 CPU"):
        ensure_plan(_opts(replicas=2, expert_parallel=2), can_grow=False, startup_timeout_s=600,
                    shape=lambda g: _machine(2, can_grow=g))


@requires_engine
def test_the_cli_refuses_a_plan_that_cannot_fit_its_own_local_ray_with_exit_2(tmp_path):
    """No address: the run would start a local Ray of the machine's CPUs (2 here), which cannot grow. Refused
    before Ray starts, naming the numbers; nothing is written but the (released) lock's folder."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cpus = os.cpu_count() or 1
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "clover_batch.jobs.cli", "run", "jobs/examples/summarize-local.yaml",
         "--set", f"resources.replicas={cpus}", "--set", "model.expert_parallel=2",
         "--set", f"output.uri={tmp_path / 'out'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    assert took < 30, took
    text = " ".join(done.stderr.split())
    assert f"the job needs {cpus * 1.1 + 0.1:g} CPU (resources.replicas {cpus} x (resources.cpus_per_replica 1 + " \
           f"1 x 0.1 per expert rank) + 0.1 for one read/parse/tokenize task) and the cluster has {cpus} CPU" in text
    assert "Change resources.replicas to" in text and "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "_lock.json").exists() and read_output(Location(str(tmp_path / "out"))) is None


EXAMPLE_DOCS = 5  # jobs/examples/docs


@requires_engine
@pytest.mark.parametrize(("job", "replicas", "expert_parallel", "cpus_per_replica"), [
    ("summarize-local", 1, 1, 1), ("summarize-local", 2, 1, 0.75), ("summarize-local", 1, 2, 1),
    ("extract-local", 1, 2, 1)], ids=lambda v: str(v))
def test_the_example_jobs_complete_on_the_machines_cpus(ray_session, tmp_path, monkeypatch, job, replicas,
                                                       expert_parallel, cpus_per_replica):
    """The session Ray has the machine's CPUs (2 at most): each combination completes, one row per document. Two
    replicas of 1 CPU each leave no CPU for parsing on 2 CPUs: they are refused (below); of 0.75 CPU they run."""
    import ray

    assert ray.cluster_resources()["CPU"] == SESSION_CPUS <= 2
    monkeypatch.chdir(REPO)
    spec = load_job(f"jobs/examples/{job}.yaml", [f"resources.replicas={replicas}",
                                                  f"resources.cpus_per_replica={cpus_per_replica}",
                                                  f"model.expert_parallel={expert_parallel}",
                                                  f"output.uri={tmp_path / 'out'}"])
    report = run(spec).report
    rows = read_output(Location(str(tmp_path / "out"))).to_pylist()
    assert report.processed == report.listed == len(rows) == len({r["doc_id"] for r in rows}) == EXAMPLE_DOCS
    assert report.resources["fits"] and report.resources["replicas"] == replicas
    assert report.resources["need_cpus"] <= SESSION_CPUS
    if expert_parallel == 2 and SESSION_CPUS == 2:
        assert report.resources["fitted"] == ["expert rank CPU share 1 -> 0.5"]
    assert report.stall is None
    if job == "extract-local":  # each field's confidence: its value's least likely token's probability (the trunk's)
        for r in rows:
            confidence = json.loads(r["field_confidence"])
            assert r["status"] == "ok" and set(confidence) == set(spec.task.fields), r
            assert r["uncertain_fields"] == [n for n in spec.task.fields if confidence[n] < spec.task.uncertain_below]
            assert all(math.exp(r["min_logprob"]) - 1e-4 <= p <= 1 for p in confidence.values()), r
            assert r["min_logprob"] <= r["mean_logprob"] < 0 and r["uncertain_words"] is None
    else:  # a summary's words whose least likely token is below task.uncertain_below
        for r in rows:
            assert r["status"] == "ok" and r["field_confidence"] is None and r["uncertain_words"] is not None, r
            assert all(w in r["output_text"] for w in r["uncertain_words"]), r
            assert not r["uncertain_words"] or math.exp(r["min_logprob"]) < spec.task.uncertain_below, r
    unsure = sum(bool(r["uncertain_fields"] or r["uncertain_words"]) for r in rows)
    assert report.uncertain == {"rows": len(rows), "unsure": unsure}
    # task.parts: the one example document attention does not see whole is answered from its parts too
    split = [r for r in rows if r["parts"]]
    assert [r["source_uri"].rsplit("/", 1)[-1] for r in split] == ["incident-report-long.txt"]
    for r in rows:
        taken = json.loads(r["answer_parts"] or "{}")
        assert set(taken) <= {*getattr(spec.task, "fields", {}), "summary"}, r
        assert all(0 <= start < end <= r["input_tokens"] for start, end in taken.values()), r
        assert not taken or r["parts"], r
    assert report.parts == {"rows": 1, "from_parts": sum(bool(r["answer_parts"]) for r in split)}


@requires_engine
@pytest.mark.parametrize(("replicas", "expert_parallel", "needs", "change"), [
    (2, 1, "2.1 CPU (resources.replicas 2 x (resources.cpus_per_replica 1) + 0.1 for one read/parse/tokenize task)",
     "Change resources.replicas to 1 or resources.cpus_per_replica to 0.95"),
    (2, 2, "2.3 CPU (resources.replicas 2 x (resources.cpus_per_replica 1 + 1 x 0.1 per expert rank) + 0.1 for one "
           "read/parse/tokenize task)", "Change resources.replicas to 1 or resources.cpus_per_replica to 0.85")])
def test_replicas_that_leave_no_cpu_for_parsing_are_refused(ray_session, tmp_path, monkeypatch, replicas,
                                                            expert_parallel, needs, change):
    """On the session's Ray (joined: it might grow), run.startup_timeout_s 0 refuses at once."""
    assert SESSION_CPUS == 2, "the numbers below are a 2-CPU machine's"
    monkeypatch.chdir(REPO)
    spec = load_job("jobs/examples/summarize-local.yaml", [f"resources.replicas={replicas}",
                                                           f"model.expert_parallel={expert_parallel}",
                                                           "run.startup_timeout_s=0", f"output.uri={tmp_path}/out"])
    start = time.monotonic()
    with pytest.raises(PlanRefused) as refused:
        run(spec)
    assert time.monotonic() - start < 30
    assert f"the job needs {needs} and the cluster has 2 CPU" in str(refused.value)
    assert change in str(refused.value) and "startup_timeout_s is 0" in str(refused.value)
    assert not (tmp_path / "out" / "_lock.json").exists()
