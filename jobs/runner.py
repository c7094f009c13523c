"""Running a job: wire the job spec to connectors/ and pipeline/, run it on Ray, write the run report.

`run(spec)` is idempotent: documents with a committed row in the output are skipped, and each document of this
run is committed in exactly one part under the output lock (connectors/sink.py). Its steps, each a function here:

    connect_ray (local, a cluster's host:port, or ray:// where the run itself executes on the cluster)
    -> plan_run (clean up, publish parts left staged, list the folder or read the input table, subtract the done
       set; retried documents, and a table's documents whose text changed, flagged)
    -> ensure_plan (jobs/resources.py: the resource plan, checked against the cluster before any replica starts:
       fitted, refused (exit 2), or waited for on a cluster that may grow (exit 1 past run.startup_timeout_s))
    -> execute (the run's replica actors and the Ray Data pipeline; progress; metrics; retried rows swapped in as
       their parts come back; for an Iceberg output, the rows that come back committed here, a snapshot at a time;
       the stall watchdog, jobs/watchdog.py, ends it with a diagnosis if nothing moves for run.stall_timeout_s)
    -> RunReport (typed; written as JSON next to the output), with the outcome a scheduler acts on (`ExitCode`)

The outcome is judged on the output as this run leaves it, for the documents listed now: a row of an earlier run
that failed (`crashed`, ...) keeps a plain re-run at exit 3 until `--retry-failed` fixes it, so a scheduler never
loses a failure by running again, and a re-run with nothing new gives the same answer as the run before it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray
from clover_batch.connectors.attempts import forget_committed
from clover_batch.connectors.faults import fault_config
from clover_batch.connectors.fs import Location, list_document_table
from clover_batch.connectors.iceberg import IcebergTarget, read_table_index, write_description
from clover_batch.connectors.sink import (
    OutputLock,
    check_lock_owner,
    check_manifest,
    clean_temporaries,
    read_index,
    recover_staged,
    swap_in,
    write_report,
)
from clover_batch.connectors.tables import TableInput, TableInputError, read_document_table
from clover_batch.jobs.preflight import check_model
from clover_batch.jobs.resources import ClusterShape, ResourcePlan, ensure_plan
from clover_batch.jobs.spec import JobSpec
from clover_batch.jobs.watchdog import Diagnosis, RunStalled, StallInterrupt, Watchdog
from clover_batch.pipeline.builder import PipelineOptions, build_pipeline, source_dataset
from clover_batch.pipeline.metrics import RunMetrics
from clover_batch.pipeline.postprocess import FieldRule
from clover_batch.pipeline.progress import ProgressNote, board_name, start_board
from clover_batch.pipeline.replicas import start_replicas
from clover_batch.pipeline.rows import INFRASTRUCTURE_STATUSES, OUTPUT_SCHEMA, STAGES, STATUSES
from clover_batch.pipeline.stages import ModelRef, TaskRef
from clover_batch.pipeline.table_stages import IcebergCommitter

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # an explicit cluster address must answer within this, else the run fails naming it
STOP_TIMEOUT_S = 60.0  # an interrupted ray:// client waits this long for the run on the cluster to stop
DEFAULT_RETRY_STATUSES = INFRASTRUCTURE_STATUSES  # what `run --retry-failed` runs again unless told otherwise


class ExitCode(enum.IntEnum):
    """What `clover-batch run` exits with; docs/operations.md (exit codes) says what a scheduler does with each."""

    OK = 0  # every listed document has a row, and none has a failing status
    RUN_FAILED = 1  # the run itself failed (model, storage, cluster, another run holding the output), stalled
    # (no progress for run.stall_timeout_s), or its cluster did not grow to fit it within run.startup_timeout_s
    BAD_JOB = 2  # the job file or the command line cannot be used (UsageError, OutputConflict, a bad field), or
    # its resource plan can never fit the cluster (jobs.resources.PlanRefused)
    FAILED_ROWS = 3  # completed, but some listed documents' rows are failures: rerun with --retry-failed
    INTERRUPTED = 128 + signal.SIGINT  # 130: SIGINT (Ctrl-C); the lock was released, finished rows are kept
    TERMINATED = 128 + signal.SIGTERM  # 143: SIGTERM (a scheduler stopping the task); the same


class UsageError(ValueError):
    """The job or the command line asks for something that cannot be done (exit 2); nothing was written."""


@dataclass
class Progress:
    """What the run has done so far, passed to the progress callback after each committed part."""

    total: int  # documents to process in this run
    done: int = 0
    by_status: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class RunReport:
    """The run report: printed by the CLI, written as JSON to `_reports/<run_id>.json` in the output."""

    run_id: str
    job_name: str
    model: str
    task: str
    input_uri: str
    output_uri: str
    ray_address: str  # the cluster joined, "local" for a Ray started by the run, "" when nothing needed Ray
    finished_at: str  # ISO 8601, UTC
    listed: int  # documents under input.uri passing the globs
    skipped_done: int  # listed documents that already had a row (and were not retried)
    retried: int  # listed documents whose failed row was run again (run --retry-failed)
    processed: int  # documents this run wrote a row for
    by_status: dict[str, int]  # this run's rows by status
    documents_by_status: dict[str, int]  # the rows of every listed document after this run (earlier runs' too)
    fail_on_status: list[str]  # document statuses counted as failures (run.fail_on_status, --fail-on-status)
    failures: dict[str, int]  # of documents_by_status, the failing ones: infrastructure or fail_on_status
    exit_code: int  # ExitCode: 0, or 3 when there are failures
    output_rows: int  # rows in the output after this run
    removed_temporaries: int  # files a killed run left half-written, removed
    published_staged: int  # parts a killed run staged, published by this run
    dropped_staged: int  # staged parts whose documents already had rows, removed
    input_tokens: int
    output_tokens: int
    wall_seconds: float
    documents_per_second: float
    output_tokens_per_second: float
    max_decode_batch: int  # most documents one replica decoded together
    kernels: list[str]  # what the replicas ran: fla or torch kernels, CUDA graphs, dtype and device
    stage_seconds: dict[str, float]  # seconds per stage, summed over documents
    job: dict[str, Any]  # the job as run (decode: with the checkpoint's defaults); storage options, catalogs left out
    # the resource plan (jobs.resources.ResourcePlan.to_json: numbers, what was fitted); {} when Ray was not needed
    resources: dict[str, Any] = field(default_factory=dict)
    # a stalled run's diagnosis (jobs.watchdog.Diagnosis: the stalled stage, replicas' engine states, pending
    # tasks and actors); None when the run did not stall
    stall: dict[str, Any] | None = None
    # the ok rows' mean_logprob (the trunk's confidence in the outputs): count, mean, min, p10, p50, p90, max
    mean_logprob: dict[str, float | None] = field(default_factory=dict)
    # ok rows that say where they are unsure (uncertain_fields or uncertain_words not null), and of those the ones
    # that list something
    uncertain: dict[str, int] = field(default_factory=dict)
    # task.parts: ok rows whose document was also answered from its parts, and of those the ones whose answer (a
    # summary, or some field) came from a part
    parts: dict[str, int] = field(default_factory=dict)
    decode_from_checkpoint: dict[str, str] = field(default_factory=dict)  # decode field -> checkpoint file:key
    # how denoising steps were computed: piece -> "exact: source" or "reading: source" (model/preview.py)
    preview_operator: dict[str, str] = field(default_factory=dict)
    # decode forwards of the ok rows and their output tokens per forward (preview, check and commit forwards all
    # counted); decode.mode verified: blocks checked, tokens kept per block, share of blocks fully accepted
    decoding: dict[str, float | None] = field(default_factory=dict)
    changed: int = 0  # input.table: listed documents whose text (or file) changed since their row; run again

    @property
    def outcome(self) -> ExitCode:
        """What `clover-batch run` exits with for this report: OK or FAILED_ROWS."""
        return ExitCode(self.exit_code)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunResult:
    run_id: str
    report: RunReport
    report_uri: str


def new_run_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


@dataclass(frozen=True)
class RayConnection:
    address: str  # the address joined, or "local"
    client: bool  # Ray Client (ray://): Ray Data cannot execute from here, so the run executes on the cluster
    can_grow: bool = True  # a cluster the run joined may grow; a Ray the run started cannot (jobs/resources.py)


def ray_address(address: str | None) -> str | None:
    """The cluster to join: `address`, else RAY_ADDRESS, else None (a Ray of the run's own). Never the cluster named
    in /tmp/ray/ray_current_cluster, which outlives a cluster killed without `ray stop` (unless "auto" is asked)."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    return None if address == "local" else address


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast, naming `address`, when nothing speaking Ray's protocol answers there. `ray.init` itself retries a
    dead GCS address for minutes, and Ray Client for 30 s, without saying which address it is waiting for."""
    target = address.removeprefix("ray://")
    if target == "auto":  # asked for explicitly: the cluster of the last `ray start` on this machine
        from ray._private.services import canonicalize_bootstrap_address

        try:
            target = canonicalize_bootstrap_address("auto") or ""
        except ConnectionError as e:
            raise ConnectionError(f"Ray address 'auto': {e}") from None
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"Ray address {address!r}: expected host:port (a cluster's GCS), ray://host:port (Ray "
                         f"Client) or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)).close()
    except OSError as e:
        raise ConnectionError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return  # the plain-text probe below would fail a TLS handshake
    import grpc

    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise ConnectionError(f"cannot reach the Ray cluster at {address}: the port is open but did not answer "
                              f"Ray's protocol (gRPC) within {timeout_s:.0f} s") from None
    finally:
        channel.close()


@contextlib.contextmanager
def connect_ray(address: str | None) -> Iterator[RayConnection]:
    """Join the cluster at `address` / RAY_ADDRESS, or start a local Ray; disconnect (or stop it) at the end.
    Already connected (a test session, the driver actor of a ray:// run): use that Ray as it is."""
    if ray.is_initialized():
        client = ray.util.client.ray.is_connected()
        yield RayConnection(address or ("ray-client" if client else ray.get_runtime_context().gcs_address), client)
        return
    runtime_env = {"env_vars": fault_config()} if fault_config() else None
    address = ray_address(address)
    options = {"log_to_driver": False, "runtime_env": runtime_env, "logging_level": logging.WARNING}
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # "local": a new Ray of our own, whatever a stale /tmp/ray/ray_current_cluster says
        with _keeping_sigterm_handler():
            ray.init(address="local", include_dashboard=False, **options)
        connection = RayConnection("local", False, can_grow=False)
    else:
        check_reachable(address)
        client = address.startswith("ray://")
        for attempt in (1, 2):
            try:
                with _keeping_sigterm_handler():
                    ray.init(address=address, **options)
                break
            except ConnectionAbortedError as e:
                # Ray Client's proxy on the head starts one server process per session; that start occasionally
                # fails on a busy head ("Starting Ray client server failed"), and a second session usually starts.
                if not client or attempt == 2:
                    raise
                log.warning("Ray Client session at %s failed to start (%s); trying once more", address,
                            str(e).splitlines()[0])
        connection = RayConnection(address, client)
    try:
        yield connection
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """ray.init replaces the process's SIGTERM handler with sys.exit(15); a handler the caller installed (the CLI's:
    release the lock, exit 143) is put back."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and callable(previous):
            signal.signal(signal.SIGTERM, previous)


def configure_ray_data() -> None:
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the CLI draws its own progress; Ray's bars would fight it
    ctx.print_on_execution_start = False


def _absolute(uri: str) -> str:
    """Local paths are resolved here, on the driver: Ray workers on other nodes or in other folders see the same."""
    return uri if "://" in uri else os.path.abspath(uri)


def pipeline_options(spec: JobSpec, run_id: str) -> PipelineOptions:
    task = spec.task
    fields = tuple(
        FieldRule(name, f.type, f.description, f.required) for name, f in getattr(task, "fields", {}).items()
    )
    output = Location(_absolute(spec.output.uri), spec.output.storage_options)
    return PipelineOptions(
        input=Location(_absolute(spec.input.source_uri()), spec.input.storage_options),
        output=output,
        model=ModelRef(_absolute(spec.model.source) if os.path.isdir(spec.model.source) else spec.model.source,
                       spec.model.dtype, spec.model.storage_options, spec.model.cache_dir,
                       spec.model.expert_parallel, spec.model.overrides(), spec.model.enable_thinking),
        task=TaskRef(task.kind, task.instruction, fields, task.uncertain_below,
                     (task.parts.tokens, task.parts.overlap) if task.parts else (0, 0)),
        decode=spec.decode.options(),
        job_name=spec.name,
        run_id=run_id,
        replicas=spec.resources.replicas,
        cpus_per_replica=spec.resources.cpus_per_replica,
        gpus_per_replica=spec.resources.gpus_per_replica,
        batch_size=spec.resources.batch_size,
        max_slots=spec.resources.max_slots,
        kv_page_tokens=spec.resources.kv_page_tokens,
        max_attempts=spec.input.max_attempts,
        rows_per_file=spec.output.rows_per_file,
        commit_interval_s=spec.output.commit_interval_s,
        max_file_bytes=spec.input.max_file_bytes,
        max_input_tokens=spec.input.max_input_tokens,
        fallback_encoding=spec.input.fallback_encoding,
        parse_timeout_s=spec.input.parse_timeout_s,
        max_pages=spec.input.max_pages,
        pdf_text=spec.input.pdf_text,
        ocr=spec.input.ocr,
        pages_per_task=spec.input.pages_per_task,
        iceberg=IcebergTarget(output, spec.output.table, spec.output.catalog) if spec.output.format == "iceberg"
        else None,
        table=table_input(spec),
    )


def table_input(spec: JobSpec) -> TableInput | None:
    t = spec.input.table
    if t is None:
        return None
    return TableInput(t.format, _absolute(t.uri) if t.uri else None, t.identifier, t.catalog, t.id_column,
                      t.text_column, t.uri_column, spec.input.storage_options)


def list_inputs(opts: PipelineOptions, include: list[str], exclude: list[str]) -> pa.Table:
    """The documents to consider: the input folder's listing, or the input table's rows (UsageError for a table
    that cannot be run, naming the column)."""
    if opts.table is None:
        return list_document_table(opts.input, include, exclude)
    try:
        return read_document_table(opts.table)
    except TableInputError as e:
        raise UsageError(str(e)) from None


def committed_index(opts: PipelineOptions) -> pa.Table:
    """doc_id, status, part and version of the output's rows: its Parquet parts, or its Iceberg table."""
    return read_index(opts.output) if opts.iceberg is None else read_table_index(opts.iceberg)


def output_settings(spec: JobSpec) -> dict[str, Any]:
    """What a row's content depends on: rows made with other settings must not share an output folder."""
    return {
        "model": {"source": spec.model.source, "dtype": spec.model.dtype, **spec.model.overrides(),
                  **({"enable_thinking": True} if spec.model.enable_thinking else {})},
        "task": spec.task.model_dump(mode="json"),
        "decode": spec.decode.model_dump(mode="json"),
    }


def check_output_outside_input(input: Location, output: Location) -> None:
    """An output folder inside the input folder would be listed as input: every run would add rows for the last
    run's Parquet parts, without end."""
    in_fs, in_root = input.filesystem()
    out_fs, out_root = output.filesystem()
    if in_fs.protocol != out_fs.protocol:
        return
    a, b = in_root.rstrip("/") + "/", out_root.rstrip("/") + "/"
    if b.startswith(a):
        raise UsageError(f"output.uri {output.uri} is inside input.uri {input.uri}: its files would be listed as "
                         f"documents; choose an output outside the input folder")


def check_retry_statuses(statuses: Sequence[str]) -> tuple[str, ...]:
    """Statuses to run again, checked: a typo would otherwise retry nothing, silently."""
    unknown = [s for s in statuses if s not in STATUSES]
    if unknown:
        raise UsageError(f"--retry-status {', '.join(unknown)}: not a row status (known: {', '.join(STATUSES)})")
    if "ok" in statuses:
        raise UsageError("--retry-status ok: rows that succeeded are not run again (the output keeps one row per "
                         "document); use a new output.uri to redo them")
    return tuple(dict.fromkeys(statuses))


def check_fail_statuses(statuses: Sequence[str]) -> tuple[str, ...]:
    """Statuses that fail the run (exit 3), checked like --retry-status: a typo would otherwise fail nothing."""
    unknown = [s for s in statuses if s not in STATUSES]
    if unknown:
        raise UsageError(f"--fail-on-status {', '.join(unknown)}: not a row status (known: {', '.join(STATUSES)})")
    if "ok" in statuses:
        raise UsageError("--fail-on-status ok: a run whose documents succeed is not a failure")
    return tuple(dict.fromkeys(statuses))


def failing(documents_by_status: dict[str, int], fail_on_status: Sequence[str]) -> dict[str, int]:
    """The failing rows among the documents' rows: infrastructure failures, and the statuses the job names."""
    return {s: n for s, n in documents_by_status.items() if s in INFRASTRUCTURE_STATUSES or s in fail_on_status}


@dataclass(frozen=True)
class RunPlan:
    """What a run will do, decided under the lock before any document is processed."""

    listed: int  # documents under input.uri passing the globs
    pending: pa.Table  # documents to process: connectors.fs.DOCUMENT_SCHEMA columns plus `replaces`
    skipped_by_status: dict[str, int]  # the rows of the listed documents that are not run again, by status
    retried: int  # pending documents whose failed row is replaced
    committed_rows: int  # rows in the output before this run
    old_parts: dict[str, str]  # doc_id -> the part holding its failed row, for the retried documents
    removed_temporaries: int
    published_staged: int
    dropped_staged: int
    changed: int = 0  # pending documents whose row was made from another version (input.table: a changed text)

    @property
    def skipped_done(self) -> int:
        return self.listed - self.pending.num_rows


def plan_run(opts: PipelineOptions, include: list[str], exclude: list[str], *,
             retry_statuses: Sequence[str] = (), previous_owner: str | None = None) -> RunPlan:
    """Clean up after killed runs, publish what they left staged, list the input and subtract the done set.

    Listing, done set and pending set are Arrow columns end to end (a million documents plan in seconds, in a few
    hundred MB). A document is done when it has a committed row, unless that row's status is in `retry_statuses`:
    then it runs again and its new row will replace the old one (`replaces`).
    """
    removed = clean_temporaries(opts.output)
    index = committed_index(opts)
    recovery = recover_staged(opts.output, index.column("doc_id"), opts.run_id, previous_owner)
    index = pa.concat_tables([index, recovery.index])
    forget_committed(opts.output, index.column("doc_id"))  # attempts of documents with a row no longer matter
    listed = list_inputs(opts, include, exclude)
    done = pc.is_in(listed.column("doc_id"), value_set=index.column("doc_id"))
    old_parts: dict[str, str] = {}
    replaces = pa.nulls(listed.num_rows, pa.bool_()).fill_null(False)
    if retry_statuses:
        failed = index.filter(pc.is_in(index.column("status"), value_set=pa.array(list(retry_statuses))))
        replaces = pc.is_in(listed.column("doc_id"), value_set=failed.column("doc_id"))
        retried_ids = set(listed.filter(replaces).column("doc_id").to_pylist())
        old_parts = {d: p for d, p in zip(failed.column("doc_id").to_pylist(), failed.column("part").to_pylist(),
                                          strict=True) if d in retried_ids}
    retried = len(old_parts)
    changed = changed_versions(listed, index, opts.table is not None)
    if pc.any(changed).as_py():  # a table's document whose text changed: run again, its new row replaces the old
        changed = pc.and_(changed, pc.invert(replaces))
        replaces = pc.or_(replaces, changed)
        changed_ids = set(listed.filter(changed).column("doc_id").to_pylist())
        old_parts.update((d, p) for d, p in zip(index.column("doc_id").to_pylist(), index.column("part").to_pylist(),
                                                strict=True) if d in changed_ids)
    keep = pc.or_(pc.invert(done), replaces)
    pending = listed.append_column("replaces", replaces).filter(keep)
    skipped = listed.filter(pc.invert(keep)).column("doc_id")
    kept_rows = index.filter(pc.is_in(index.column("doc_id"), value_set=skipped)).column("status")
    skipped_by_status = {c["values"]: c["counts"] for c in pc.value_counts(kept_rows).to_pylist()}
    plan = RunPlan(listed=listed.num_rows, pending=pending, skipped_by_status=skipped_by_status,
                   retried=retried, committed_rows=index.num_rows,
                   old_parts=old_parts, removed_temporaries=removed, published_staged=len(recovery.published),
                   dropped_staged=len(recovery.dropped), changed=pc.sum(changed.cast(pa.int64())).as_py() or 0)
    return plan


def _log_listing(plan: RunPlan, run_id: str) -> None:
    log.info("run %s: %d listed, %d already done, %d to process (%d retried)", run_id, plan.listed,
             plan.skipped_done, plan.pending.num_rows, plan.retried)


def changed_versions(listed: pa.Table, index: pa.Table, table_input: bool) -> pa.ChunkedArray:
    """Which listed documents have a row made from another version of them. Only a table's documents can: a listed
    file's doc_id hashes its version, so an edited file is a new document."""
    if not index.num_rows or not table_input:
        return pa.chunked_array([pa.nulls(listed.num_rows, pa.bool_()).fill_null(False)])
    key = pc.binary_join_element_wise(listed.column("doc_id"), pc.fill_null(listed.column("version"), ""), "\n")
    known = pc.binary_join_element_wise(index.column("doc_id"), pc.fill_null(index.column("version"), ""), "\n")
    has_row = pc.is_in(listed.column("doc_id"), value_set=index.column("doc_id"))
    return pc.and_(has_row, pc.invert(pc.is_in(key, value_set=known)))


@dataclass
class RunTotals:
    """What `execute` counted from the stats rows of the committed parts."""

    progress: Progress
    replaced: int = 0  # rows swapped in for retried documents
    max_decode_batch: int = 0  # most documents one replica decoded together
    kernels: set[str] = field(default_factory=set)
    input_tokens: int = 0
    output_tokens: int = 0
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*STAGES, "write"), 0.0))
    mean_logprobs: list[float] = field(default_factory=list)  # of the ok rows that have one
    uncertain: dict[str, int] = field(default_factory=lambda: {"rows": 0, "unsure": 0})
    parts: dict[str, int] = field(default_factory=lambda: {"rows": 0, "from_parts": 0})
    # ok rows' decode forwards and their output tokens; verified blocks, tokens they kept, blocks fully accepted
    decoding: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("decode_forwards", "decoded_tokens", "verified_blocks", "accepted_tokens", "full_blocks"), 0))


class Stalled(RunStalled):
    """RunStalled, with what the run had done when it stalled (for its report)."""

    def __init__(self, diagnosis: Diagnosis, totals: RunTotals, report_uri: str = ""):
        super().__init__(diagnosis)
        self.totals = totals
        self.report_uri = report_uri

    def __reduce__(self):  # raised in a ray:// run's driver actor, unpickled in the client
        return type(self), (self.diagnosis, self.totals, self.report_uri)


def execute(plan: RunPlan, opts: PipelineOptions, on_progress: Callable[[Progress], None] | None = None, *,
            stall_timeout_s: float = 0.0) -> RunTotals:
    """Run the pipeline over the pending documents. Retried documents' rows come back staged; each is swapped into
    the part holding the old row here, on the driver, one at a time (connectors.sink.swap_in). With
    `stall_timeout_s`, a watchdog (jobs/watchdog.py) raises RunStalled (Stalled) when nothing moves that long."""
    totals = RunTotals(Progress(total=plan.pending.num_rows))
    if on_progress:
        on_progress(totals.progress)
    if not plan.pending.num_rows:
        return totals
    swapped: set[str] = set()
    metrics = RunMetrics(opts.job_name)
    board = start_board(opts.run_id) if stall_timeout_s > 0 else None
    note = ProgressNote(board_name(opts.run_id) if board is not None else None)
    dog = Watchdog([], board, stall_timeout_s)  # watching from here: the source's tasks may wait for CPUs too
    committer = None
    if opts.iceberg is not None:  # result rows come back: this driver commits them, a snapshot at a time
        committer = IcebergCommitter(opts.iceberg, opts.run_id, opts.rows_per_file, opts.commit_interval_s,
                                     lambda: check_lock_owner(opts.output, opts.run_id))
    try:
        with dog:
            source = source_dataset(plan.pending, opts)  # before the replicas take their CPUs (its docstring)
            with start_replicas(opts, note) as replicas:
                dog.replicas = replicas
                for batch in build_pipeline(source, opts, replicas, note).iter_batches(batch_size=None,
                                                                                       batch_format="pyarrow"):
                    if committer is not None:
                        batch = committer.add(batch)
                    _count(batch, totals, metrics, plan, opts, swapped)
                    dog.rows(batch.num_rows)
                    if on_progress:
                        on_progress(totals.progress)
                if committer is not None:
                    flushed = committer.flush()
                    _count(flushed, totals, metrics, plan, opts, swapped)
                    dog.rows(flushed.num_rows)
                    totals.replaced += committer.replaced
                    if on_progress:
                        on_progress(totals.progress)
    except StallInterrupt:
        assert dog.diagnosis is not None
        raise Stalled(dog.diagnosis, totals) from None
    finally:
        if board is not None:
            ray.kill(board)
    return totals


def _count(batch: pa.Table, totals: RunTotals, metrics: RunMetrics, plan: RunPlan, opts: PipelineOptions,
           swapped: set[str]) -> None:
    """Add a batch of stats rows to the totals; swap retried documents' new rows in."""
    for row in batch.to_pylist():
        totals.progress.done += 1
        totals.progress.by_status[row["status"]] += 1
        metrics.finished(row["status"])
        totals.input_tokens += row["input_tokens"] or 0
        totals.output_tokens += row["output_tokens"] or 0
        if row["status"] == "ok" and row["mean_logprob"] is not None:
            totals.mean_logprobs.append(row["mean_logprob"])
        doubts = row["uncertain_fields"] if row["uncertain_fields"] is not None else row["uncertain_words"]
        if row["status"] == "ok" and doubts is not None:
            totals.uncertain["rows"] += 1
            totals.uncertain["unsure"] += bool(doubts)
        if row["status"] == "ok" and row["parts"]:
            totals.parts["rows"] += 1
            totals.parts["from_parts"] += bool(row["answer_parts"])
        if row["status"] == "ok" and row["decode_forwards"]:
            totals.decoding["decode_forwards"] += row["decode_forwards"]
            totals.decoding["decoded_tokens"] += row["output_tokens"] or 0
            for key in ("verified_blocks", "accepted_tokens", "full_blocks"):
                totals.decoding[key] += row[key] or 0
        totals.max_decode_batch = max(totals.max_decode_batch, row["decode_batch"] or 0)
        if row["kernels"]:
            totals.kernels.add(row["kernels"])
        for stage, seconds in (row["timings"] or {}).items():
            totals.stage_seconds[stage] += seconds or 0.0
        totals.stage_seconds["write"] += row["write_seconds"] or 0.0
        staged = row["replacement"]
        if staged:
            totals.replaced += 1
            if staged not in swapped:  # one staged file's rows may come back in more than one batch
                swap_in(opts.output, staged, plan.old_parts, opts.run_id)
                swapped.add(staged)


def run(
    spec: JobSpec,
    *,
    address: str | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    run_id: str | None = None,
    retry_statuses: Sequence[str] = (),
    fail_on_status: Sequence[str] = (),
) -> RunResult:
    """Process every listed document that has no committed row yet (and, with `retry_statuses`, those whose row
    has one of these statuses, replacing that row); returns the run report. `fail_on_status`: document statuses
    that count as failures in the report's outcome, besides the job's own `run.fail_on_status`.

    With a ray:// address (Ray Client), Ray Data cannot execute from this process: the run executes in a driver
    actor on the cluster's head node, and this process relays its progress and returns its result.
    """
    retry_statuses = check_retry_statuses(retry_statuses)
    fail_on_status = check_fail_statuses([*spec.run.fail_on_status, *fail_on_status])
    checked = check_model(spec)  # config, checkpoint headers, chat template: before the lock, Ray or any worker
    # the checkpoint's decode controls fill what the job leaves unset: the replicas, the output's manifest and the
    # report all see the decode settings actually run
    spec = spec.model_copy(update={"decode": checked.decode})
    run_id = run_id or new_run_id()
    spec = _with_absolute_paths(spec)
    target = ray_address(address)
    if target is not None and not ray.is_initialized():
        check_reachable(target)  # a wrong address fails every run, not only those with documents to process
    client = ray.util.client.ray.is_connected() if ray.is_initialized() else (target or "").startswith("ray://")
    model_info = ModelInfo(checked.decode_sources, preview_provenance(checked.config))
    if client:
        with connect_ray(target):
            return _run_on_cluster(spec, run_id, retry_statuses, fail_on_status, on_progress, model_info)
    return _run_here(spec, run_id, target, retry_statuses, fail_on_status, on_progress, model_info)


@dataclass(frozen=True)
class ModelInfo:
    """What the driver's model check found, for the run report."""

    decode_sources: dict[str, str] = field(default_factory=dict)
    preview: dict[str, str] = field(default_factory=dict)


def preview_provenance(config: Any) -> dict[str, str]:
    """How this model's denoising steps are computed, piece by piece, and what each follows."""
    from clover_batch.model.preview import PIECES

    d = config.diffusion
    if d is None:
        return {}
    if not d.clover:
        return {"denoising step": "the model's own block-causal forward over the block (preview_operator trunk)"}
    return {piece: f"{status}: {source}" for piece, status, source in PIECES
            if "coreset" not in piece or d.coreset_size is not None}


def _with_absolute_paths(spec: JobSpec) -> JobSpec:
    """The spec with local paths made absolute here, so a driver elsewhere (ray://) or workers in other folders
    read the same ones."""
    model = spec.model
    if os.path.isdir(model.source):
        model = model.model_copy(update={"source": os.path.abspath(model.source)})
    table = spec.input.table
    if table is not None and table.uri:
        table = table.model_copy(update={"uri": _absolute(table.uri)})
    return spec.model_copy(update={
        "input": spec.input.model_copy(update={"uri": spec.input.uri and _absolute(spec.input.uri), "table": table}),
        "output": spec.output.model_copy(update={"uri": _absolute(spec.output.uri)}),
        "model": model,
    })


def _run_here(spec: JobSpec, run_id: str, address: str | None, retry_statuses: tuple[str, ...],
              fail_on_status: tuple[str, ...], on_progress: Callable[[Progress], None] | None,
              model_info: ModelInfo | None = None) -> RunResult:
    start = time.perf_counter()
    opts = pipeline_options(spec, run_id)
    if opts.table is None:
        check_output_outside_input(opts.input, opts.output)
    with OutputLock(opts.output, run_id) as lock:  # before Ray starts: a busy or conflicting output fails in a second
        check_output_table(opts)
        check_manifest(opts.output, output_settings(spec),
                       has_rows=None if opts.iceberg is None else bool(read_table_index(opts.iceberg).num_rows))
        plan = plan_run(opts, spec.input.include, spec.input.exclude, retry_statuses=retry_statuses,
                        previous_owner=lock.took_over_from)
        connected = ""
        resources: ResourcePlan | None = None
        if plan.pending.num_rows and ray_address(address) is None and not ray.is_initialized():
            # a local Ray of our own: its size is known before it starts, a plan that cannot fit is refused now
            ensure_plan(opts, can_grow=False, startup_timeout_s=0, shape=lambda _: ClusterShape.this_machine())
        if plan.pending.num_rows:
            # Ray is stopped (or left) before the lock is released: no worker of this run commits after it.
            with connect_ray(address) as connection:
                connected = connection.address
                configure_ray_data()
                # before any replica starts: refused (exit 2), waited for, or fitted to the cluster
                resources = ensure_plan(opts, can_grow=connection.can_grow,
                                        startup_timeout_s=spec.run.startup_timeout_s)
                log.info("run %s: resource plan: %s", run_id, resources.describe())
                _log_listing(plan, run_id)
                opts = dataclasses.replace(opts, prep_num_cpus=resources.prep_cpus,
                                           rank_num_cpus=resources.rank_cpus or opts.rank_num_cpus)
                try:
                    totals = execute(plan, opts, on_progress, stall_timeout_s=spec.run.stall_timeout_s)
                except Stalled as e:  # the diagnosis goes into the report; the lock is released on the way out
                    report = _report(spec, run_id, plan, e.totals, connected, time.perf_counter() - start,
                                     fail_on_status, model_info or ModelInfo(), resources, e.diagnosis)
                    e.report_uri = write_report(opts.output, run_id, report.to_json())
                    raise
        else:
            _log_listing(plan, run_id)
            totals = execute(plan, opts, on_progress)
        report = _report(spec, run_id, plan, totals, connected, time.perf_counter() - start, fail_on_status,
                         model_info or ModelInfo(), resources)
        report_uri = write_report(opts.output, run_id, report.to_json())
    log.info("run %s finished: %s", run_id, report.by_status)
    return RunResult(run_id, report, report_uri)


def check_output_table(opts: PipelineOptions) -> None:
    """Iceberg output: the catalog answers and the table exists (created now when absent), before any work; the
    output folder records which table its runs write (`show`)."""
    if opts.iceberg is None:
        return
    try:
        opts.iceberg.load(OUTPUT_SCHEMA)
    except ValueError as e:  # IcebergOutputError, and pyiceberg's own for bad catalog properties
        raise UsageError(f"output.table {opts.iceberg.table}: {e}") from None
    write_description(opts.iceberg)


def distribution(values: list[float]) -> dict[str, float | None]:
    """count, mean, min, p10, p50, p90, max of `values` (nearest-rank percentiles); None entries when empty."""
    if not values:
        return {"count": 0, "mean": None, "min": None, "p10": None, "p50": None, "p90": None, "max": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    return {"count": len(ordered), "mean": sum(ordered) / len(ordered), "min": ordered[0], "p10": rank(0.1),
            "p50": rank(0.5), "p90": rank(0.9), "max": ordered[-1]}


def _report(spec: JobSpec, run_id: str, plan: RunPlan, totals: RunTotals, ray_address: str, wall: float,
            fail_on_status: tuple[str, ...], model_info: ModelInfo, resources: ResourcePlan | None = None,
            stall: Diagnosis | None = None) -> RunReport:
    done = totals.progress.done
    documents = Counter(plan.skipped_by_status) + totals.progress.by_status
    failures = failing(dict(documents), fail_on_status)
    return RunReport(
        run_id=run_id,
        job_name=spec.name,
        model=spec.model.source,
        task=spec.task.kind,
        input_uri=spec.input.source_uri(),
        output_uri=spec.output.uri,
        ray_address=ray_address,
        finished_at=datetime.now(UTC).isoformat(),
        listed=plan.listed,
        skipped_done=plan.skipped_done,
        retried=plan.retried,
        processed=done,
        by_status=dict(sorted(totals.progress.by_status.items())),
        documents_by_status=dict(sorted(documents.items())),
        fail_on_status=list(fail_on_status),
        failures=dict(sorted(failures.items())),
        exit_code=int(ExitCode.RUN_FAILED if stall else ExitCode.FAILED_ROWS if failures else ExitCode.OK),
        output_rows=plan.committed_rows + done - totals.replaced,
        removed_temporaries=plan.removed_temporaries,
        published_staged=plan.published_staged,
        dropped_staged=plan.dropped_staged,
        input_tokens=totals.input_tokens,
        output_tokens=totals.output_tokens,
        wall_seconds=wall,
        documents_per_second=done / wall if wall > 0 else 0.0,
        output_tokens_per_second=totals.output_tokens / wall if wall > 0 else 0.0,
        max_decode_batch=totals.max_decode_batch,
        kernels=sorted(totals.kernels),
        stage_seconds=totals.stage_seconds,
        job=spec.model_dump(
            mode="json",
            # credentials: fsspec options and Iceberg catalog properties stay out of the report
            exclude={"input": {"storage_options": True, "table": {"catalog"}}, "output": {"storage_options", "catalog"},
                     "model": {"storage_options"}},
        ),
        mean_logprob=distribution(totals.mean_logprobs),
        uncertain=dict(totals.uncertain),
        parts=dict(totals.parts),
        decode_from_checkpoint=model_info.decode_sources,
        preview_operator=model_info.preview,
        resources=resources.to_json() if resources else {},
        stall=dataclasses.asdict(stall) if stall else None,
        changed=plan.changed,
        decoding=decoding_summary(totals.decoding),
    )


def decoding_summary(sums: dict[str, int]) -> dict[str, float | None]:
    """The run report's `decoding`: forwards and tokens per forward, and the verified blocks' acceptance."""
    forwards, blocks = sums["decode_forwards"], sums["verified_blocks"]
    return {
        "decode_forwards": forwards,
        "output_tokens_per_forward": sums["decoded_tokens"] / forwards if forwards else None,
        "verified_blocks": blocks,
        "accepted_tokens_per_block": sums["accepted_tokens"] / blocks if blocks else None,
        "full_block_share": sums["full_blocks"] / blocks if blocks else None,
    }


class RunStopped(Exception):
    """The run was asked to stop: its ray:// client was interrupted."""


@ray.remote(num_cpus=0, max_concurrency=3)
class _ClusterDriver:
    """The run's driver on the cluster, for ray:// clients: `run` executes the job (one thread), `get_progress`
    answers the client's polls and `stop` its interruption (the others)."""

    def __init__(self) -> None:
        self.progress: Progress | None = None
        self.run_thread: int | None = None

    def run(self, spec: JobSpec, run_id: str, retry_statuses: tuple[str, ...], fail_on_status: tuple[str, ...],
            model_info: ModelInfo) -> RunResult:
        def keep(p: Progress) -> None:
            self.progress = Progress(p.total, p.done, Counter(p.by_status))

        self.run_thread = threading.get_ident()
        try:
            return _run_here(spec, run_id, None, retry_statuses, fail_on_status, keep, model_info)
        finally:
            self.run_thread = None

    def get_progress(self) -> Progress | None:
        return self.progress

    def stop(self) -> None:
        """Raise RunStopped in the run's thread, as Ctrl-C raises KeyboardInterrupt in a CLI's: the run unwinds (its
        replicas stopped, its lock released) at once, wherever it waits (Ray Data's consumer polls every 10 ms)."""
        if self.run_thread is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.run_thread), ctypes.py_object(RunStopped))


def _run_on_cluster(spec: JobSpec, run_id: str, retry_statuses: tuple[str, ...], fail_on_status: tuple[str, ...],
                    on_progress: Callable[[Progress], None] | None, model_info: ModelInfo) -> RunResult:
    # On the head node, as `ray job submit` runs its entrypoint: the node that is always there.
    driver = _ClusterDriver.options(resources={"node:__internal_head__": 0.001}).remote()
    result_ref = driver.run.remote(spec, run_id, retry_statuses, fail_on_status, model_info)
    try:
        while True:
            ready, _ = ray.wait([result_ref], timeout=0.5)
            progress = ray.get(driver.get_progress.remote())
            if progress is not None and on_progress:
                on_progress(progress)
            if ready:
                return ray.get(result_ref)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(e.cause, Exception) else None
        if cause is not None:  # the job's own error (OutputBusy, a bad field), not Ray's wrapper around it
            raise cause from None
        raise
    except BaseException as e:
        if not isinstance(e, Exception):  # SIGINT, SIGTERM here: the run there stops too, releasing its lock
            with contextlib.suppress(Exception):
                ray.get(driver.stop.remote(), timeout=CONNECT_TIMEOUT_S)
                ray.wait([result_ref], timeout=STOP_TIMEOUT_S)
        raise
    finally:
        ray.kill(driver)
