"""The Python API: `process(ds, job)` for Ray Data users composing their own read and write, and `run(job)` for
what `clover-batch run` does. Both take a job as a file path, a dict or a parsed JobSpec.

Notable choices:
- `process` returns a lazy Dataset: the user's rows go through the same stages as a run's (pipeline/stages.py,
  pipeline/table_stages.py), and the model replicas are Ray Data actors (ReplicaStage) that start when the dataset
  executes and stop when it is done. There is no output folder, so no lock, no skipping of done documents and no
  attempt records: the user's own write decides what is kept (Ray Data's write_iceberg with SaveMode.UPSERT on
  doc_id keeps one row per document).
- `run` returns the run report; its `outcome` is the exit code the CLI would give (0, or 3 for failed rows). What
  the CLI exits 2 for raises JobSpecError or UsageError (or OutputConflict), and what it exits 1 for raises the
  run's own error: a Python caller gets the exception, not a code.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import ray.data
    from clover_batch.jobs.runner import RunReport
    from clover_batch.jobs.spec import JobSpec

# `process` reads no input and writes no output: a job given for it needs neither section
_UNUSED_SECTIONS = {"input": {"uri": "(process: the dataset)"}, "output": {"uri": "(process: the caller's write)"}}


def _raw_job(job: str | os.PathLike | Mapping[str, Any] | JobSpec) -> tuple[dict[str, Any], str]:
    from clover_batch.jobs.spec import JobSpec, JobSpecError

    if isinstance(job, JobSpec):
        return job.model_dump(mode="json", exclude_unset=True), "job"
    if isinstance(job, Mapping):
        return copy.deepcopy(dict(job)), "job"
    path = os.fspath(job)
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except OSError as e:
        raise JobSpecError(path, [f"(file): {e.strerror}"]) from None
    except yaml.YAMLError as e:
        raise JobSpecError(path, [f"(yaml): {e}"]) from None
    return raw, path


def load_spec(job: str | os.PathLike | Mapping[str, Any] | JobSpec, overrides: Mapping[str, Any] | None = None,
              *, for_process: bool = False) -> JobSpec:
    """The job, validated, with `overrides` applied: `section__field=value` sets `section.field` (a `__` for
    each dot), a dict value for a whole section is merged into it."""
    from clover_batch.jobs.spec import parse_job

    raw, source = _raw_job(job)
    for key, value in (overrides or {}).items():
        *parents, leaf = key.split("__")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
            node[leaf] = {**node[leaf], **value}
        else:
            node[leaf] = value
    if for_process:
        for section, placeholder in _UNUSED_SECTIONS.items():
            raw.setdefault(section, placeholder)
    return parse_job(raw, source)


def process(ds: ray.data.Dataset, job: str | os.PathLike | Mapping[str, Any] | JobSpec, *,
            id_column: str | None = None, text_column: str | None = None, uri_column: str | None = None
            ) -> ray.data.Dataset:
    """Run the job's model and task over the rows of `ds`, lazily: one output row per input row.

    `ds` has an id column and a text column (run as it is) or a URI column (each file read and parsed with the
    job's input options). The columns default to the job's input.table settings, else `id` and `text`. The job's
    input and output sections are not used and may be left out of a dict. Returns a Dataset with the output's
    schema (pipeline/rows.py OUTPUT_SCHEMA: doc_id is the id as a string, status, output_text, ...), for the
    caller's own write; the model replicas (resources.replicas) start when it executes.

    Example::

        import ray, clover_batch
        ds = ray.data.from_items([{"id": 1, "text": "Invoice 7: 3 chairs, 120 EUR."}])
        rows = clover_batch.process(ds, "jobs/examples/summarize-local.yaml").take_all()
        rows[0]["doc_id"], rows[0]["status"], rows[0]["output_text"]
    """
    import ray
    from clover_batch.jobs.preflight import check_model
    from clover_batch.jobs.runner import new_run_id, pipeline_options
    from clover_batch.pipeline.builder import read_and_parse
    from clover_batch.pipeline.replicas import batches_in_flight
    from clover_batch.pipeline.stages import PostprocessStage, TokenizeStage
    from clover_batch.pipeline.table_stages import DocumentRows, OutputRows, ReplicaStage, TextStage

    spec = load_spec(job, for_process=True)
    table = spec.input.table
    id_column = id_column or (table.id_column if table else "id")
    if uri_column is None and text_column is None and table is not None:
        uri_column, text_column = table.uri_column, table.text_column
    column = uri_column or text_column or "text"
    checked = check_model(spec)  # config, checkpoint, chat template: here, not in every actor
    spec = spec.model_copy(update={"decode": checked.decode})
    opts = pipeline_options(spec, new_run_id())
    fmt = {"batch_format": "pyarrow", "zero_copy_batch": False}
    prep = {"batch_size": opts.prep_batch_size, "num_cpus": opts.prep_num_cpus, **fmt}
    rows = ds.map_batches(DocumentRows(id_column, column, is_uri=uri_column is not None), **prep)
    rows = read_and_parse(rows, opts, prep) if uri_column else rows.map_batches(TextStage(), **prep)
    replica = {"num_cpus": opts.cpus_per_replica, **({"num_gpus": opts.gpus_per_replica}
                                                     if opts.gpus_per_replica else {})}
    return (
        rows.map_batches(TokenizeStage(opts.model, opts.task, opts.max_input_tokens), **prep)
        .map_batches(ReplicaStage, fn_constructor_kwargs={
            "model": opts.model, "decode": opts.decode, "num_threads": max(1, int(opts.cpus_per_replica)),
            "max_slots": opts.max_slots, "page_size": opts.kv_page_tokens, "job_name": opts.job_name,
            "parts": opts.task.parts},
            compute=ray.data.ActorPoolStrategy(size=opts.replicas,
                                               max_tasks_in_flight_per_actor=batches_in_flight(opts)),
            batch_size=opts.batch_size, **replica, **fmt)
        .map_batches(PostprocessStage(opts.model, opts.task, opts.job_name, opts.run_id), **prep)
        .map_batches(OutputRows(), **prep)
    )


def run(job: str | os.PathLike | Mapping[str, Any] | JobSpec, *, address: str | None = None,
        retry_failed: bool = False, retry_statuses: Sequence[str] = (), fail_on_status: Sequence[str] = (),
        **overrides: Any) -> RunReport:
    """What `clover-batch run JOB` does: every new (or changed, or with --retry-failed failed) document gets one row
    in the output; returns the run report, also written to `<output.uri>/_reports/`.

    `overrides` set job fields, `section__field=value` for `--set section.field=value`. `report.outcome` is the
    CLI's exit code: 0, or 3 when some documents' rows are failures. A bad job raises JobSpecError or UsageError
    (the CLI's exit 2), a failed run its error (exit 1).

    Example::

        import clover_batch
        report = clover_batch.run("jobs/examples/summarize-local.yaml", output__uri="out/nightly",
                                  resources__replicas=2)
        print(report.outcome, report.processed, report.documents_by_status)
    """
    from clover_batch.jobs.runner import DEFAULT_RETRY_STATUSES
    from clover_batch.jobs.runner import run as run_job

    spec = load_spec(job, overrides)
    retry = tuple(retry_statuses) or (DEFAULT_RETRY_STATUSES if retry_failed else ())
    return run_job(spec, address=address, retry_statuses=retry, fail_on_status=fail_on_status).report
