"""Prometheus metrics of a run, through `ray.util.metrics`: each process records, the node's Ray metrics agent
exports, so they reach Prometheus on any Ray cluster with metrics enabled (`ray start --metrics-export-port`).

Ray prefixes every name with `ray_` and exports a counter `<name>` as `ray_<name>_total`. Every metric is tagged
with the job's name (`job`); the replica metrics also with the replica's index in the run (`replica`, stable across
restarts of its process). Ray adds its own labels (node address, worker id, session).

    name                                   type       tags           what
    clover_batch_documents                 counter    job, status    documents finished: a row committed (driver)
    clover_batch_prompt_tokens             counter    job, replica   prompt tokens of documents that came out of
                                                                     an engine with an answer
    clover_batch_generated_tokens          counter    job, replica   tokens those answers hold
    clover_batch_prefill_seconds           counter    job, replica   engine time in prefill steps
    clover_batch_decode_seconds            counter    job, replica   engine time in decode steps
    clover_batch_decode_steps              counter    job, replica   decode steps (one forward over the slots each)
    clover_batch_decode_rows               counter    job, replica   sequences in them, summed: rows per step is
                                                                     rate(decode_rows) / rate(decode_steps)
    clover_batch_decode_rows_per_step      histogram  job, replica   sequences in each decode step (Ray exports its
                                                                     _sum from bucket midpoints: an estimate)
    clover_batch_slots_in_use              gauge      job, replica   sequences holding an engine slot now
    clover_batch_slots                     gauge      job, replica   the engine's slots (what fits its memory)
    clover_batch_infer_queue_depth         gauge      job, replica   documents handed to the replica and waiting
                                                                     for a slot

Documents are counted on the driver, once per committed row (a write task that Ray retries must not count twice);
tokens and engine time where the work is done, so work lost with a crashed process still shows as work done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray.util.metrics import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from clover_batch.model import Engine, Generation

# sequences per decode step: powers of two up to a large engine's slot count
ROWS_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


class RunMetrics:
    """The driver's metrics: documents by status."""

    def __init__(self, job_name: str) -> None:
        self.job = job_name
        self.documents = Counter("clover_batch_documents", description="Documents finished (a row committed), by "
                                 "row status.", tag_keys=("job", "status"))

    def finished(self, status: str) -> None:
        self.documents.inc(1, tags={"job": self.job, "status": status})


class ReplicaMetrics:
    """One replica's metrics: tokens, engine time, decode batch size, slots and queue. `stepped` runs on the
    engine thread after each step and records what the engine's counters moved by since the last call."""

    def __init__(self, job_name: str, replica: int) -> None:
        self.tags = {"job": job_name, "replica": str(replica)}
        keys = ("job", "replica")
        self.prompt_tokens = Counter("clover_batch_prompt_tokens", description="Prompt tokens of documents that came "
                                     "out of an engine with an answer.", tag_keys=keys)
        self.generated_tokens = Counter("clover_batch_generated_tokens", description="Tokens generated in answers.",
                                        tag_keys=keys)
        self.prefill_seconds = Counter("clover_batch_prefill_seconds", description="Engine time in prefill steps.",
                                       tag_keys=keys)
        self.decode_seconds = Counter("clover_batch_decode_seconds", description="Engine time in decode steps.",
                                      tag_keys=keys)
        self.decode_steps = Counter("clover_batch_decode_steps", description="Decode steps.", tag_keys=keys)
        self.decode_rows = Counter("clover_batch_decode_rows", description="Sequences in decode steps, summed over "
                                   "the steps.", tag_keys=keys)
        self.rows_per_step = Histogram("clover_batch_decode_rows_per_step", description="Sequences decoded together "
                                       "in one decode step.", boundaries=ROWS_BOUNDARIES, tag_keys=keys)
        self.slots_in_use = Gauge("clover_batch_slots_in_use", description="Sequences holding an engine slot.",
                                  tag_keys=keys)
        self.slots = Gauge("clover_batch_slots", description="Engine slots of the replica.", tag_keys=keys)
        self.queue_depth = Gauge("clover_batch_infer_queue_depth", description="Documents handed to the replica, "
                                 "waiting for an engine slot.", tag_keys=keys)
        self._seen = (0, 0, 0.0, 0.0)  # decode_steps, decode_rows, prefill_seconds, decode_seconds

    def generated(self, gen: Generation) -> None:
        self.prompt_tokens.inc(gen.prompt_tokens, tags=self.tags)
        self.generated_tokens.inc(len(gen.tokens), tags=self.tags)

    def stepped(self, engine: Engine, in_replica: int) -> None:
        """After an engine step (or when the engine goes idle): `in_replica` documents are in this replica, in the
        engine or waiting for it."""
        s = engine.stats
        steps, rows, prefill, decode = self._seen
        if s.decode_steps > steps:
            # one step per call, except after a failed step's one-at-a-time reruns: then their average
            per_step = (s.decode_rows - rows) / (s.decode_steps - steps)
            for _ in range(s.decode_steps - steps):
                self.rows_per_step.observe(per_step, tags=self.tags)
            self.decode_steps.inc(s.decode_steps - steps, tags=self.tags)
            self.decode_rows.inc(s.decode_rows - rows, tags=self.tags)
        if s.prefill_seconds > prefill:
            self.prefill_seconds.inc(s.prefill_seconds - prefill, tags=self.tags)
        if s.decode_seconds > decode:
            self.decode_seconds.inc(s.decode_seconds - decode, tags=self.tags)
        self._seen = (s.decode_steps, s.decode_rows, s.prefill_seconds, s.decode_seconds)
        self.slots_in_use.set(engine.active, tags=self.tags)
        self.slots.set(engine.num_slots, tags=self.tags)
        self.queue_depth.set(max(0, in_replica - engine.active), tags=self.tags)
