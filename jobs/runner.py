"""Running a job: wire the job spec to connectors/ and pipeline/, run it on Ray, write the run report.

`run(spec)` is idempotent: documents with a committed row in the output are skipped, parts half-written by a
killed run are removed first, and each document of this run is committed in exactly one part (connectors/sink.py).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import ray
from clover_batch.connectors.faults import fault_config
from clover_batch.connectors.fs import Location, list_documents
from clover_batch.connectors.sink import (
    OutputLock,
    check_manifest,
    clean_temporaries,
    done_doc_ids,
    read_output,
    write_report,
)
from clover_batch.jobs.preflight import check_model
from clover_batch.jobs.spec import JobSpec
from clover_batch.pipeline.builder import PipelineOptions, build_pipeline
from clover_batch.pipeline.postprocess import FieldRule
from clover_batch.pipeline.rows import STAGES
from clover_batch.pipeline.stages import ModelRef, TaskRef

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """What the run has done so far, passed to the progress callback after each committed part."""

    total: int  # documents to process in this run
    done: int = 0
    by_status: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class RunResult:
    run_id: str
    report: dict[str, Any]  # the JSON run report
    report_uri: str


def new_run_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def init_ray(address: str | None) -> bool:
    """Connect to `address` / RAY_ADDRESS, or start a local Ray; returns True if this call started it."""
    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": fault_config()} if fault_config() else None
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False, runtime_env=runtime_env, logging_level=logging.WARNING)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False, log_to_driver=False, runtime_env=runtime_env, logging_level=logging.WARNING)
    return True


def _absolute(uri: str) -> str:
    """Local paths are resolved here, on the driver: Ray workers on other nodes or in other folders see the same."""
    return uri if "://" in uri else os.path.abspath(uri)


def pipeline_options(spec: JobSpec, run_id: str) -> PipelineOptions:
    task = spec.task
    fields = tuple(
        FieldRule(name, f.type, f.description, f.required) for name, f in getattr(task, "fields", {}).items()
    )
    return PipelineOptions(
        input=Location(_absolute(spec.input.uri), spec.input.storage_options),
        output=Location(_absolute(spec.output.uri), spec.output.storage_options),
        model=ModelRef(_absolute(spec.model.source) if os.path.isdir(spec.model.source) else spec.model.source,
                       spec.model.dtype, spec.model.storage_options, spec.model.cache_dir,
                       spec.model.expert_parallel),
        task=TaskRef(task.kind, task.instruction, fields),
        decode=spec.decode.options(),
        job_name=spec.name,
        run_id=run_id,
        replicas=spec.resources.replicas,
        cpus_per_replica=spec.resources.cpus_per_replica,
        gpus_per_replica=spec.resources.gpus_per_replica,
        batch_size=spec.resources.batch_size,
        max_slots=spec.resources.max_slots,
        rows_per_file=spec.output.rows_per_file,
        max_file_bytes=spec.input.max_file_bytes,
        max_input_tokens=spec.input.max_input_tokens,
        fallback_encoding=spec.input.fallback_encoding,
        parse_timeout_s=spec.input.parse_timeout_s,
        max_pages=spec.input.max_pages,
    )


def output_settings(spec: JobSpec) -> dict[str, Any]:
    """What a row's content depends on: rows made with other settings must not share an output folder."""
    return {
        "model": {"source": spec.model.source, "dtype": spec.model.dtype},
        "task": spec.task.model_dump(mode="json"),
        "decode": spec.decode.model_dump(mode="json"),
    }


def run(
    spec: JobSpec,
    *,
    address: str | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    run_id: str | None = None,
) -> RunResult:
    """Process every listed document that has no committed row yet; returns the run report."""
    check_model(spec)  # config, checkpoint headers, chat template: before the lock, Ray or any worker
    run_id = run_id or new_run_id()
    opts = pipeline_options(spec, run_id)
    check_output_outside_input(opts.input, opts.output)
    with OutputLock(opts.output, run_id):  # taken before Ray starts: a busy or conflicting output fails in a second
        check_manifest(opts.output, output_settings(spec))
        return _run_locked(spec, opts, run_id, address, on_progress)


def check_output_outside_input(input: Location, output: Location) -> None:
    """An output folder inside the input folder would be listed as input: every run would add rows for the last
    run's Parquet parts, without end."""
    in_fs, in_root = input.filesystem()
    out_fs, out_root = output.filesystem()
    if in_fs.protocol != out_fs.protocol:
        return
    a, b = in_root.rstrip("/") + "/", out_root.rstrip("/") + "/"
    if b.startswith(a):
        raise ValueError(f"output.uri {output.uri} is inside input.uri {input.uri}: its files would be listed as "
                         f"documents; choose an output outside the input folder")


def check_cluster_fits(spec: JobSpec) -> None:
    """A replica that needs more GPUs or CPUs than the whole cluster has would wait forever for its actor."""
    have = ray.cluster_resources()
    need = {"GPU": spec.resources.gpus_per_replica * spec.model.expert_parallel,
            "CPU": spec.resources.cpus_per_replica}
    short = [f"{need[r]:g} {r} per replica, the cluster has {have.get(r, 0):g}"
             for r in need if need[r] > have.get(r, 0)]
    if short:
        raise ValueError(f"resources: {'; '.join(short)}")


def _run_locked(spec: JobSpec, opts: PipelineOptions, run_id: str, address: str | None,
                on_progress: Callable[[Progress], None] | None) -> RunResult:
    started_ray = init_ray(address)
    try:
        check_cluster_fits(spec)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # the CLI draws its own progress; Ray's bars would fight it
        ctx.print_on_execution_start = False
        start = time.perf_counter()
        removed = clean_temporaries(opts.output)
        listed = list_documents(opts.input, spec.input.include, spec.input.exclude)
        done = done_doc_ids(opts.output)
        pending = [d for d in listed if d.doc_id not in done]
        log.info(
            "run %s: %d listed, %d already done, %d to process",
            run_id,
            len(listed),
            len(listed) - len(pending),
            len(pending),
        )
        progress = Progress(total=len(pending))
        if on_progress:
            on_progress(progress)
        totals: dict[str, float] = dict.fromkeys((*STAGES, "write"), 0.0)
        tokens_in = tokens_out = decode_batch = 0
        kernel_names: set[str] = set()
        if pending:
            for batch in build_pipeline(pending, opts).iter_batches(batch_size=None, batch_format="pyarrow"):
                for row in batch.to_pylist():
                    progress.done += 1
                    progress.by_status[row["status"]] += 1
                    tokens_in += row["input_tokens"] or 0
                    tokens_out += row["output_tokens"] or 0
                    decode_batch = max(decode_batch, row["decode_batch"] or 0)
                    if row["kernels"]:
                        kernel_names.add(row["kernels"])
                    for stage, seconds in (row["timings"] or {}).items():
                        totals[stage] += seconds or 0.0
                    totals["write"] += row["write_seconds"] or 0.0
                if on_progress:
                    on_progress(progress)
        wall = time.perf_counter() - start
        output = read_output(opts.output, columns=["status"])
        report = {
            "run_id": run_id,
            "job_name": spec.name,
            "model": spec.model.source,
            "task": spec.task.kind,
            "input_uri": spec.input.uri,
            "output_uri": spec.output.uri,
            "finished_at": datetime.now(UTC).isoformat(),
            "listed": len(listed),
            "skipped_done": len(listed) - len(pending),
            "processed": progress.done,
            "removed_temporaries": removed,
            "by_status": dict(sorted(progress.by_status.items())),
            "output_rows": 0 if output is None else output.num_rows,
            "input_tokens": tokens_in,
            "output_tokens": tokens_out,
            "wall_seconds": wall,
            "documents_per_second": progress.done / wall if wall > 0 else 0.0,
            "output_tokens_per_second": tokens_out / wall if wall > 0 else 0.0,
            "max_decode_batch": decode_batch,  # most documents one replica decoded together
            "kernels": sorted(kernel_names),  # what the replicas ran: fla or torch kernels, CUDA graphs, dtype
            "stage_seconds": totals,
            "job": spec.model_dump(
                mode="json",
                exclude={"input": {"storage_options"}, "output": {"storage_options"}, "model": {"storage_options"}},
            ),
        }
        report_uri = write_report(opts.output, run_id, report)
        log.info("run %s finished: %s", run_id, report["by_status"])
        return RunResult(run_id, report, report_uri)
    finally:
        if started_ray:
            ray.shutdown()
