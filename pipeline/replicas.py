"""The model replicas of a run: Ray actors the run starts itself, called from a Ray Data task stage.

    Ray Data task (InferCall: picks the least busy replica)  --infer.remote(batch)-->  replica actor (InferStage)

Notable choices:
- Not `map_batches(InferStage, compute=ActorPoolStrategy(...))`: a Ray Data pool actor gets its UDF and Ray Data's
  context as objects in the object store, and is restarted without limit; Ray logs at error level, for every such
  actor, that a restart fails once those objects are gone (ray-project/ray#53727). A restart is what the
  poison-document handling relies on (a process killed by a document comes back and runs it alone). A replica here
  is created from small values only (ModelRef, DecodeOptions, the output's Location, the run id, the name of the
  run's progress board: a few hundred bytes, inlined in its creation task), so Ray can always restart it.
- `max_restarts=-1, max_task_retries=-1`: a replica whose process died comes back, and the `infer` calls it had
  in flight run again there (as Ray Data's pool did); a constructor that raises (a model that cannot load) is not
  restarted, every call then fails, and the run fails with the constructor's error.
- The calls come from a Ray Data task stage of `replicas * in_flight` tasks, one block each (a block's Ray batches
  all go out at once: Ray Data would hand a task's batches to a plain function one after the other). A task
  waiting on its replicas holds no CPU (`num_cpus=0`), and `in_flight` batches per replica keep its engine's slots
  full, with one batch queued.
- A task asks every replica how many documents it holds and hands each batch to the least busy (ties at random):
  a round trip per replica and block, small next to a batch's inference.
- The replicas belong to the driver: `start_replicas` kills them when the run's dataset is done, and removes the
  placement groups of their expert ranks (which outlive them); Ray kills them if the driver dies.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pyarrow as pa
import ray
from clover_batch.pipeline.progress import NO_PROGRESS, ProgressNote
from clover_batch.pipeline.stages import InferStage

if TYPE_CHECKING:
    from clover_batch.pipeline.builder import PipelineOptions
    from ray.actor import ActorHandle


PROBE_TIMEOUT_S = 5.0  # after a failed run, how long a replica may take to say whether it is alive


def batches_in_flight(opts: PipelineOptions) -> int:
    """Ray batches per replica: enough to fill its engine's slots, plus one queued behind them, so a freed slot is
    refilled at the next step instead of when a whole batch has finished."""
    return -(-opts.max_slots // opts.batch_size) + 1


@contextlib.contextmanager
def start_replicas(opts: PipelineOptions, progress: ProgressNote = NO_PROGRESS) -> Iterator[list[ActorHandle]]:
    """Start the run's replicas (their models load in the background); kill them on the way out. `progress`: where
    a loading replica's heartbeat goes (pipeline/progress.py)."""
    actor = ray.remote(InferStage).options(
        num_cpus=opts.cpus_per_replica,
        num_gpus=opts.gpus_per_replica,
        max_restarts=-1,
        max_task_retries=-1,
        max_concurrency=batches_in_flight(opts) + 8,  # the batches in flight, and `load` calls beside them
    )
    replicas = [
        actor.remote(model=opts.model, decode=opts.decode, num_threads=max(1, int(opts.cpus_per_replica)),
                     max_slots=opts.max_slots, page_size=opts.kv_page_tokens, output=opts.output, run_id=opts.run_id,
                     max_attempts=opts.max_attempts, job_name=opts.job_name, replica_index=i,
                     rank_num_cpus=opts.rank_num_cpus, parts=opts.task.parts, progress=progress)
        for i in range(opts.replicas)
    ]
    try:
        yield replicas
    except Exception:
        # Ray Data reports a replica that could not start as its own UserCodeException: raise the replica's error
        # (its constructor's, e.g. a model that cannot load) when that is what happened.
        for replica in replicas:
            try:
                ray.get(replica.load.remote(), timeout=PROBE_TIMEOUT_S)
            except ray.exceptions.RayActorError as died:
                raise died from None
            except ray.exceptions.GetTimeoutError:  # restarting, or still loading: not what failed the run
                pass
        raise
    finally:
        for replica in replicas:
            ray.kill(replica, no_restart=True)
        if opts.model.expert_parallel > 1:  # their ranks' groups outlive them (pipeline/expert_parallel.py)
            from clover_batch.pipeline.expert_parallel import group_prefix, remove_placement_groups

            remove_placement_groups(group_prefix(opts.run_id))


class InferCall:
    """The Ray Data stage in front of the replicas: splits a block into Ray batches of `batch_size` documents, hands
    each to the least busy replica (all at once) and returns their rows."""

    def __init__(self, replicas: list[ActorHandle], batch_size: int):
        self.replicas, self.batch_size = replicas, batch_size

    def __call__(self, block: pa.Table) -> pa.Table:
        loads = ray.get([r.load.remote() for r in self.replicas]) if len(self.replicas) > 1 else [0]
        calls = []
        for start in range(0, block.num_rows, self.batch_size):
            batch = block.slice(start, self.batch_size)
            least = min(loads)
            i = random.choice([i for i, n in enumerate(loads) if n == least])
            loads[i] += batch.num_rows
            calls.append(self.replicas[i].infer.remote(batch))
        return pa.concat_tables(ray.get(calls)) if calls else block
