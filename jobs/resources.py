"""The run's resource plan: what the job asks of Ray, checked against the cluster before any replica starts.

    plan_resources(opts, cluster) -> ResourcePlan   (fits, or says by how much it does not and which field to change)
    ensure_plan(opts, cluster_can_grow, startup_timeout_s) -> ResourcePlan, or PlanRefused (exit 2) /
        ClusterTooSmall (exit 1, after waiting)

What a run holds while it runs (each a Ray reservation, held until the run ends):
- `replicas` replica actors, each `resources.cpus_per_replica` CPUs and `resources.gpus_per_replica` GPUs;
- per replica, `model.expert_parallel - 1` worker ranks, each `rank_num_cpus` CPUs (and a whole GPU on GPU
  replicas), on the replica's node (pipeline/expert_parallel.py: a STRICT_PACK placement group pinned there);
- Ray Data tasks: one at least of each stage in `pipeline.builder.task_cpus` (read/parse/tokenize and
  postprocess/write take `prep_num_cpus` each; the infer tasks take none). Without room for one of them the
  run never moves: the replicas wait for documents that are never parsed (issue 32: expert_parallel 2 on 2 CPUs).

Notable choices:
- The shares that are not job fields, a rank's CPUs and a prep task's, are the run's own: when the default ones do
  not fit, the plan shrinks them (ranks first, down the FIT_LADDER, then the prep tasks) on any cluster, and says
  so in the plan (`fitted`). A rank computes only in lockstep with its replica's step, so its CPU share matters
  least; a prep task's share only limits how many run at once. Job fields (replicas, cpus_per_replica,
  gpus_per_replica, expert_parallel) are never changed: a plan that does not fit with the smallest shares names
  them instead, with the largest value of each that would fit. GPU shares are never fitted (a rank needs its GPU).
- Node by node: a replica and its ranks must fit on one node. Replica groups are placed first fit over the nodes
  (identical groups: first fit places as many as any placement), then one prep task on what is left. Ray's own
  scheduler may still place replicas less tightly; the stall watchdog (jobs/watchdog.py) catches what this misses.
- Which clusters can grow: a Ray the run started itself cannot (its size is the machine's), so a plan that does
  not fit is refused at once, exit 2. A cluster the run joined may (an autoscaler, KubeRay, someone adding a
  node): the run waits up to `run.startup_timeout_s`, saying what it waits for, and fails with exit 1 if the
  cluster did not grow enough; `run.startup_timeout_s: 0` refuses at once, for a cluster of fixed size. We do not
  ask the autoscaler whether it could add a fitting node: its configuration is not visible on every kind of cluster
  (KubeRay's is in Kubernetes), and waiting a bounded time is right for all of them.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clover_batch.pipeline.builder import PipelineOptions

log = logging.getLogger(__name__)

FIT_LADDER = (1.0, 0.5, 0.25, 0.1)  # CPU shares a rank or a prep task may be fitted to, largest first
POLL_S = 5.0  # while waiting for the cluster to grow: how often it is looked at again
SAY_EVERY_S = 60.0  # ... and how often the wait is logged


class PlanRefused(ValueError):
    """The job's resources can never fit this cluster (exit 2): the message names each number and the fields."""


class ClusterTooSmall(RuntimeError):
    """The cluster did not grow to fit the job within run.startup_timeout_s (exit 1)."""


@dataclass(frozen=True)
class Node:
    cpus: float
    gpus: float


@dataclass(frozen=True)
class ClusterShape:
    """What the cluster has, total and node by node (alive nodes only)."""

    nodes: tuple[Node, ...]
    can_grow: bool  # a joined cluster: it may grow (see the module docstring)

    @property
    def cpus(self) -> float:
        return sum(n.cpus for n in self.nodes)

    @property
    def gpus(self) -> float:
        return sum(n.gpus for n in self.nodes)

    @classmethod
    def of_ray(cls, can_grow: bool) -> ClusterShape:
        import ray

        nodes = tuple(Node(n["Resources"].get("CPU", 0.0), n["Resources"].get("GPU", 0.0))
                      for n in ray.nodes() if n.get("Alive"))
        return cls(nodes, can_grow)

    @classmethod
    def this_machine(cls) -> ClusterShape:
        """The local Ray the run is about to start, as Ray will size it (cgroup-aware CPUs, detected GPUs): a plan
        that can never fit it is refused before Ray takes seconds to start."""
        from ray._private.accelerators import get_accelerator_manager_for_resource
        from ray._private.utils import get_num_cpus

        try:
            gpus = float(get_accelerator_manager_for_resource("GPU").get_current_node_num_accelerators() or 0)
        except Exception:  # no driver, no library: Ray would find none either
            gpus = 0.0
        return cls((Node(float(get_num_cpus()), gpus),), can_grow=False)

    def describe(self) -> str:
        biggest = max(self.nodes, key=lambda n: (n.cpus, n.gpus), default=Node(0, 0))
        kind = "a cluster that may grow" if self.can_grow else "a local Ray"
        gpus = f", {self.gpus:g} GPU" if self.gpus else ""
        return (f"{kind} of {len(self.nodes)} node{'s' * (len(self.nodes) != 1)}: {self.cpus:g} CPU{gpus} "
                f"(largest node {biggest.cpus:g} CPU{f', {biggest.gpus:g} GPU' if biggest.gpus else ''})")


@dataclass(frozen=True)
class ResourcePlan:
    """What the run will ask of Ray, and whether the cluster can give it; in the run report as `resources`."""

    replicas: int
    expert_parallel: int
    replica_cpus: float  # per replica actor (resources.cpus_per_replica)
    replica_gpus: float  # per replica actor (resources.gpus_per_replica)
    rank_cpus: float  # per expert-parallel worker rank (fitted)
    rank_gpus: float  # per worker rank: a whole GPU on GPU replicas
    task_cpus: dict[str, float]  # per Ray Data task, by stage (pipeline.builder.task_cpus; prep share fitted)
    need_cpus: float  # replicas, their ranks, and one task of each stage that needs CPUs
    need_gpus: float
    cluster: str  # ClusterShape.describe()
    cluster_cpus: float
    cluster_gpus: float
    fits: bool
    fitted: list[str] = field(default_factory=list)  # the shares changed from their defaults, and why
    short: list[str] = field(default_factory=list)  # when it does not fit: what is missing, each with its numbers
    change: list[str] = field(default_factory=list)  # when it does not fit: the job fields to change, with values

    @property
    def group_cpus(self) -> float:
        """One replica with its ranks, on one node."""
        return self.replica_cpus + (self.expert_parallel - 1) * self.rank_cpus

    @property
    def group_gpus(self) -> float:
        return self.replica_gpus + (self.expert_parallel - 1) * self.rank_gpus

    @property
    def prep_cpus(self) -> float:
        return max(self.task_cpus.values(), default=0.0)

    def describe(self) -> str:
        """One line: the plan's numbers."""
        ranks = (f" + {self.expert_parallel - 1} expert rank{'s' * (self.expert_parallel > 2)} x "
                 f"{self.rank_cpus:g} CPU" if self.expert_parallel > 1 else "")
        gpus = f"; {self.need_gpus:g} GPU" if self.need_gpus else ""
        tasks = ", ".join(f"{k} {v:g}" for k, v in self.task_cpus.items())
        fitted = f"; fitted: {'; '.join(self.fitted)}" if self.fitted else ""
        return (f"{self.replicas} replica{'s' * (self.replicas > 1)} x ({self.replica_cpus:g} CPU{ranks}) + one "
                f"task at a time ({tasks} CPU each) = {self.need_cpus:g} CPU{gpus}, on {self.cluster}{fitted}")

    def refusal(self) -> str:
        smallest = (f" (expert ranks and read/parse/tokenize tasks already at their smallest CPU share, "
                    f"{FIT_LADDER[-1]:g})" if self.fitted or self.prep_cpus <= FIT_LADDER[-1] else "")
        return (f"resources: the job needs {'; and '.join(self.short)}, on {self.cluster}. "
                f"Change {' or '.join(self.change)}{smallest}")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.describe()}


def _places(groups: int, group: Node, prep: float, nodes: tuple[Node, ...]) -> tuple[int, bool]:
    """First fit of `groups` replica groups over `nodes`: how many were placed, and whether one prep task still
    fits on some node beside them."""
    left = [Node(n.cpus, n.gpus) for n in nodes]
    placed = 0
    for i, n in enumerate(left):
        room = [n.cpus / group.cpus if group.cpus else math.inf, n.gpus / group.gpus if group.gpus else math.inf]
        k = min(groups - placed, int(min(room) + 1e-9))
        placed += k
        left[i] = Node(n.cpus - k * group.cpus, n.gpus - k * group.gpus)
    return placed, any(n.cpus + 1e-9 >= prep for n in left)


def _evaluate(opts: PipelineOptions, cluster: ClusterShape, rank_cpus: float, prep_cpus: float) -> ResourcePlan:
    from clover_batch.pipeline.builder import task_cpus

    ep, r = opts.model.expert_parallel, opts.replicas
    tasks = task_cpus(replace(opts, prep_num_cpus=prep_cpus))
    rank_gpus = 1.0 if opts.gpus_per_replica > 0 else 0.0  # as pipeline.stages.InferStage asks
    plan = ResourcePlan(
        replicas=r, expert_parallel=ep, replica_cpus=opts.cpus_per_replica, replica_gpus=opts.gpus_per_replica,
        rank_cpus=rank_cpus if ep > 1 else 0.0, rank_gpus=rank_gpus if ep > 1 else 0.0, task_cpus=tasks,
        need_cpus=0.0, need_gpus=0.0, cluster=cluster.describe(), cluster_cpus=cluster.cpus,
        cluster_gpus=cluster.gpus, fits=False)
    prep = plan.prep_cpus
    need_cpus, need_gpus = r * plan.group_cpus + prep, r * plan.group_gpus
    placed, prep_fits = _places(r, Node(plan.group_cpus, plan.group_gpus), prep, cluster.nodes)
    short = []
    rank_text = f" + {ep - 1} x {plan.rank_cpus:g} per expert rank" if ep > 1 else ""
    if need_cpus > cluster.cpus + 1e-9:
        short.append(f"{need_cpus:g} CPU (resources.replicas {r} x (resources.cpus_per_replica "
                     f"{opts.cpus_per_replica:g}{rank_text}) + {prep:g} for one read/parse/tokenize task) and the "
                     f"cluster has {cluster.cpus:g} CPU")
    if need_gpus > cluster.gpus + 1e-9:
        rank_gpu_text = f" + {ep - 1} x {plan.rank_gpus:g} per expert rank" if ep > 1 else ""
        short.append(f"{need_gpus:g} GPU (resources.replicas {r} x (resources.gpus_per_replica "
                     f"{opts.gpus_per_replica:g}{rank_gpu_text})) and the cluster has {cluster.gpus:g} GPU")
    if not short and placed < r:
        short.append(f"{plan.group_cpus:g} CPU{f' and {plan.group_gpus:g} GPU' if plan.group_gpus else ''} on one "
                     f"node for each replica with its expert ranks, and the nodes hold only {placed} of the "
                     f"{r} replicas")
    if not short and not prep_fits:
        short.append(f"{prep:g} CPU for one read/parse/tokenize task beside the replicas, and no node has it left")
    return replace(plan, need_cpus=need_cpus, need_gpus=need_gpus, fits=not short, short=short)


def plan_resources(opts: PipelineOptions, cluster: ClusterShape) -> ResourcePlan:
    """The plan with the default shares if it fits, else with the largest fitted shares that fit (ranks shrunk
    first, then the prep tasks), else the smallest shares' plan with what to change."""
    rank0, prep0 = opts.rank_num_cpus, opts.prep_num_cpus
    ranks = [rank0, *(s for s in FIT_LADDER if s < rank0)] if opts.model.expert_parallel > 1 else [rank0]
    preps = [prep0, *(s for s in FIT_LADDER if s < prep0)]
    plan = None
    for prep in preps:
        for rank in ranks:
            plan = _evaluate(opts, cluster, rank, prep)
            if plan.fits:
                fitted = []
                if rank != rank0:
                    fitted.append(f"expert rank CPU share {rank0:g} -> {rank:g}")
                if prep != prep0:
                    fitted.append(f"read/parse/tokenize and postprocess/write task CPU share {prep0:g} -> {prep:g}")
                return replace(plan, fitted=fitted)
    assert plan is not None
    return replace(plan, change=_changes(opts, cluster, ranks[-1], preps[-1]))


def _changes(opts: PipelineOptions, cluster: ClusterShape, rank: float, prep: float) -> list[str]:
    """The job fields that would make the plan fit (with the smallest shares), each with the value that would."""
    def fits(**change: Any) -> bool:
        model = replace(opts.model, expert_parallel=change.pop("expert_parallel", opts.model.expert_parallel))
        return _evaluate(replace(opts, model=model, **change), cluster, rank, prep).fits

    out = []
    most = max((n for n in range(1, opts.replicas) if fits(replicas=n)), default=0)
    if most:
        out.append(f"resources.replicas to {most}")
    cpus = [c / 20 for c in range(int(opts.cpus_per_replica * 20) - 1, 0, -1)]  # steps of 0.05 CPU
    best = next((c for c in cpus if fits(cpus_per_replica=c)), None)
    if best is not None:
        out.append(f"resources.cpus_per_replica to {best:g}")
    if opts.gpus_per_replica:
        if fits(gpus_per_replica=0.0):
            out.append("resources.gpus_per_replica to 0 (CPU replicas)")
    if opts.model.expert_parallel > 1:
        ep = max((n for n in range(1, opts.model.expert_parallel) if fits(expert_parallel=n)), default=0)
        if ep:
            out.append(f"model.expert_parallel to {ep}")
    return out or ["the cluster (more or larger nodes): no smaller value of resources.replicas, "
                   "resources.cpus_per_replica, resources.gpus_per_replica or model.expert_parallel fits"]


def ensure_plan(opts: PipelineOptions, *, can_grow: bool, startup_timeout_s: float,
                shape: Any = ClusterShape.of_ray) -> ResourcePlan:
    """The plan that fits the cluster now; or, on a cluster that may grow, once it does (waiting up to
    `startup_timeout_s`, ClusterTooSmall past it); PlanRefused at once where it cannot grow (or must not be
    waited for). `shape(can_grow)`: the cluster as it is now."""
    plan = plan_resources(opts, shape(can_grow))
    if plan.fits:
        return plan
    if not can_grow or startup_timeout_s <= 0:
        why = "" if not can_grow else " (run.startup_timeout_s is 0: the cluster is not waited for)"
        raise PlanRefused(plan.refusal() + why)
    deadline = time.monotonic() + startup_timeout_s
    said = -math.inf
    while True:
        now = time.monotonic()
        if now >= deadline:
            raise ClusterTooSmall(f"{plan.refusal()} (waited {startup_timeout_s:g} s for the cluster to grow: "
                                  f"run.startup_timeout_s)")
        if now - said >= SAY_EVERY_S:
            log.warning("waiting up to %.0f s more for the cluster to grow: the job needs %s", deadline - now,
                        "; ".join(plan.short))
            said = now
        time.sleep(min(POLL_S, max(0.0, deadline - now)))
        plan = plan_resources(opts, shape(can_grow))
        if plan.fits:
            log.warning("the cluster grew: %s", plan.describe())
            return plan
