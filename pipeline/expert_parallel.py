"""Expert-parallel replicas on Ray: the pipeline's infer actor is rank 0, ranks 1..N-1 are worker actors.

    load_replica(source, expert_parallel=N, ...) -> ExpertParallelReplica  (.model, .generate(prompts, **opts))

Notable choices:
- The N-1 worker actors live in one placement group (STRICT_PACK: one node, so NCCL can use NVLink), whose
  bundles are pinned to rank 0's node through Ray's `node:<ip>` resource; the group is created once per replica and
  reused when workers are restarted.
- The group is named `<name_prefix><pid>` (the pipeline's prefix names the run and the replica): a group
  outlives the replica process that made it (Ray ties it to the job, i.e. the driver), so the driver removes its
  run's groups by name when the run ends (`remove_placement_groups`), however its replicas ended (killed, stuck,
  restarted). Without this a driver that runs jobs one after another (tests, a service) kept each run's rank CPUs
  reserved, and the next expert-parallel run waited for them forever.
- Workers are plain actors with max_restarts=0: the replica (clover_batch.model.expert_parallel) notices a dead or
  hung rank within the collective timeout, kills the remaining workers, starts fresh ones in the same bundles and
  reruns the generate() call, so a document's row is written once, by the write stage, after a successful call.
- model/ stays free of Ray: this module only implements the model's `Launcher` protocol.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from clover_batch.model.expert_parallel import ExpertParallelReplica, WorkerSpec, run_worker
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)


class RankWorker:
    """One worker rank; `serve` returns when rank 0 stops the group, or raises when the group breaks."""

    def pid(self) -> int:
        import os

        return os.getpid()

    def serve(self, spec: WorkerSpec, rank: int) -> int:
        return run_worker(spec, rank)


class RayLauncher:
    """Starts ranks 1..N-1 as actors in one placement group on rank 0's node."""

    def __init__(self, world: int, *, num_cpus: float = 1.0, num_gpus: float = 0.0, ready_timeout_s: float = 300.0,
                 name_prefix: str = ""):
        import os

        node = ray.util.get_node_ip_address()
        bundle: dict[str, float] = {"CPU": num_cpus, f"node:{node}": 0.001}
        if num_gpus:
            bundle["GPU"] = num_gpus
        name = f"{name_prefix}{os.getpid()}" if name_prefix else ""
        self.pg = placement_group([dict(bundle) for _ in range(world - 1)], strategy="STRICT_PACK", name=name)
        ray.get(self.pg.ready(), timeout=ready_timeout_s)
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.actors: list[Any] = []
        self.refs: list[Any] = []

    def start(self, spec: WorkerSpec) -> None:
        cls = ray.remote(RankWorker)
        self.actors = [
            cls.options(
                num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0, max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(spec.world - 1)
        ]
        self.refs = [a.serve.remote(spec, rank) for rank, a in enumerate(self.actors, start=1)]

    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors])

    def failure(self) -> str | None:
        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        problems = []
        for ref in done:
            rank = self.refs.index(ref) + 1
            try:
                ray.get(ref)
                problems.append(f"rank {rank} stopped serving")
            except Exception as e:  # an actor death or the worker's own ExpertParallelError
                problems.append(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return "; ".join(problems) or None

    def stop(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors, self.refs = [], []

    def close(self) -> None:
        self.stop()
        remove_placement_group(self.pg)


def load_replica(source: str, *, expert_parallel: int, dtype: str = "float32", device: str = "cpu",
                 num_threads: int = 1, num_cpus_per_rank: float = 1.0, num_gpus_per_rank: float = 0.0,
                 timeout_s: float = 60.0, max_restarts: int = 2,
                 overrides: dict | None = None, group_prefix: str = "") -> ExpertParallelReplica:
    """Rank 0 (this process, a Ray actor) of a replica spread over `expert_parallel` ranks; overrides: the job's
    model settings (load_config); group_prefix: names the ranks' placement group (remove_placement_groups)."""
    launcher = RayLauncher(expert_parallel, num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank,
                           name_prefix=group_prefix)
    host = ray.util.get_node_ip_address()
    try:
        return ExpertParallelReplica(source, expert_parallel, launcher, dtype=dtype, device=device,
                                     timeout_s=timeout_s, num_threads=num_threads, max_restarts=max_restarts,
                                     host=host, overrides=overrides)
    except Exception:
        launcher.close()
        raise


def group_prefix(run_id: str) -> str:
    """The name prefix of a run's rank placement groups."""
    return f"clover-ranks-{run_id}-"


def remove_placement_groups(prefix: str) -> int:
    """Remove the placement groups whose name starts with `prefix` (a run's, on its way out); how many."""
    from ray.util.placement_group import get_placement_group, placement_group_table

    removed = 0
    for info in placement_group_table().values():
        name = info.get("name") or ""
        if name.startswith(prefix) and info.get("state") != "REMOVED":
            try:
                remove_placement_group(get_placement_group(name))
                removed += 1
            except Exception as e:  # removed meanwhile by its replica (launcher.close)
                log.debug("placement group %s: %s", name, e)
    return removed
