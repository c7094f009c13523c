"""The Ray Data chain, as one linear sequence of map_batches calls:

    listed documents -> read -> parse -> tokenize -> infer (replica actors) -> postprocess -> write parts -> stats

A table's text column replaces read and parse by one stage that takes the text as it is; an Iceberg output replaces
the write stage by one that hands the rows back to the driver, which commits them (pipeline/table_stages.py).

The infer stage is a task per Ray batch in flight, each handing its batch to one of the run's replica actors
(pipeline/replicas.py); a replica is async: several Ray batches are in flight at it and feed one continuous-batching
engine.

The driver lists the documents (connectors/) and hands the pending ones in; what comes out is one small stats row
per document, for progress and the run report. Results themselves are committed to Parquet by the write stage in
the workers, so nothing large flows back to the driver, and the driver and workers need not share a disk.

What each kind of task asks of Ray is said in one place, `task_cpus`: the run's resource plan (jobs/resources.py)
reads it to check that at least one of each can run beside the replicas, and may fit the prep share to the cluster
(`PipelineOptions.prep_num_cpus`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import ray
from clover_batch.connectors.fs import Location
from clover_batch.connectors.iceberg import IcebergTarget
from clover_batch.connectors.tables import TableInput
from clover_batch.pipeline.progress import NO_PROGRESS, ProgressNote
from clover_batch.pipeline.replicas import InferCall, batches_in_flight
from clover_batch.pipeline.rows import work_table
from clover_batch.pipeline.stages import (
    ModelRef,
    ParseStage,
    PostprocessStage,
    ReadStage,
    TaskRef,
    TokenizeStage,
    WriteStage,
)
from clover_batch.pipeline.table_stages import ResultStage, TextStage

if TYPE_CHECKING:
    from clover_batch.model import DecodeOptions
    from ray.actor import ActorHandle

PREP_NUM_CPUS = 0.5  # CPU share of one read/parse/tokenize (and postprocess/write) task, before the plan fits it
RANK_NUM_CPUS = 1.0  # CPU share of one expert-parallel worker rank, before the plan fits it


@dataclass(frozen=True)
class PipelineOptions:
    """Everything the chain needs, in plain values (the job schema stays in jobs/)."""

    input: Location
    output: Location
    model: ModelRef
    task: TaskRef
    decode: DecodeOptions
    job_name: str
    run_id: str
    replicas: int = 1
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    batch_size: int = 4  # documents per Ray batch into the infer actors
    max_slots: int = 16  # documents one replica's engine decodes at once
    kv_page_tokens: int = 256  # positions per page of attention keys and values
    max_attempts: int = 2  # process deaths with a document inside before it gets a `crashed` row
    rows_per_file: int = 64
    max_file_bytes: int = 256 * 2**20
    max_input_tokens: int = 1_048_576
    fallback_encoding: str | None = None
    parse_timeout_s: float = 300.0  # per page range; past it the parser child is killed (then plain text is tried)
    max_pages: int | None = None  # PDFs (EPUB, XPS) with more pages get `too_many_pages`
    pdf_text: str = "markdown"  # markdown | plain: how PDF, EPUB and XPS pages become text
    ocr: str = "auto"  # auto | always | never: OCR of PDF pages without a usable text layer
    pages_per_task: int = 25  # longer PDFs (EPUB, XPS) are parsed as page ranges of this many pages
    prep_batch_size: int = 4  # documents per read/parse/tokenize task call
    prep_num_cpus: float = PREP_NUM_CPUS  # CPU share of one read/parse/tokenize task (the resource plan's)
    prep_concurrency: int | None = None  # most cheap-stage tasks at once; None: 2 per replica
    rank_num_cpus: float = RANK_NUM_CPUS  # CPU share of one expert-parallel worker rank (the resource plan's)
    iceberg: IcebergTarget | None = None  # output.format iceberg: the driver commits the rows there
    commit_interval_s: float = 10.0  # Iceberg: least seconds between two snapshots (pipeline/table_stages.py)
    table: TableInput | None = None  # input.table: documents from a table instead of a folder listing


def task_cpus(opts: PipelineOptions) -> dict[str, float]:
    """The CPU share of one task of each Ray Data stage of the chain, by the name the resource plan gives it. The
    plan needs one task of each to be able to run beside the replicas (a stage none of whose tasks can start stops
    the run); tasks of the same share may share that room, one after another."""
    return {
        "read/parse/tokenize": opts.prep_num_cpus,
        "infer": 0.0,  # a task waiting on a replica holds no CPU (pipeline/replicas.py)
        "postprocess/write": opts.prep_num_cpus,
    }


def source_dataset(docs: pa.Table, opts: PipelineOptions) -> ray.data.Dataset:
    """The pending documents as a Ray dataset of small blocks. `docs`: connectors.fs.DOCUMENT_SCHEMA columns, plus
    `replaces` for retried ones.

    Made before the replicas start: `ray.data.from_arrow` runs one metadata task per block, of 1 CPU each (Ray
    Data's default, not ours to set), which would wait forever on a machine whose replicas left less than a CPU
    free (2 replicas of 0.75 CPU on 2 CPUs: the run plans room for its own tasks, not for these)."""
    table = work_table(docs)
    # Small input blocks, so reading and parsing stream into the actors instead of waiting on one big block.
    step = max(opts.prep_batch_size, -(-table.num_rows // 256))
    return ray.data.from_arrow([table.slice(i, step) for i in range(0, table.num_rows, step)])


def build_pipeline(source: ray.data.Dataset, opts: PipelineOptions, replicas: list[ActorHandle],
                   progress: ProgressNote = NO_PROGRESS) -> ray.data.Dataset:
    """The lazy dataset of per-document stats rows; iterating it runs the job. `source`: the pending documents
    (source_dataset); `replicas`: the infer actors (pipeline.replicas.start_replicas), alive while the dataset runs;
    `progress`: the stages' notes to the run's stall watchdog (pipeline/progress.py)."""
    ds = source
    blocks = range(source.num_blocks())
    fmt = {"batch_format": "pyarrow", "zero_copy_batch": False}
    # Parsing is far cheaper than decoding, so a few task workers keep the actors fed; more would only spawn
    # processes that compete with the actors for CPU while they start. (No pool larger than the blocks there are.)
    prep_tasks = ray.data.TaskPoolStrategy(size=min(len(blocks), opts.prep_concurrency or 2 * opts.replicas))
    cpus = task_cpus(opts)
    prep = {"batch_size": opts.prep_batch_size, "num_cpus": cpus["read/parse/tokenize"], "compute": prep_tasks, **fmt}
    post = {**prep, "num_cpus": cpus["postprocess/write"]}
    # A task per block at the replicas (its Ray batches all in flight at once), enough to fill their slots; a task
    # waiting on a replica holds no CPU.
    infer_tasks = ray.data.TaskPoolStrategy(size=min(len(blocks), opts.replicas * batches_in_flight(opts)))
    # a table's text column (connectors/tables.py): nothing to read or parse
    texts = opts.table is not None and opts.table.uri_column is None
    ds = ds.map_batches(TextStage(), **prep) if texts else read_and_parse(ds, opts, prep, progress)
    ds = (
        ds.map_batches(TokenizeStage(opts.model, opts.task, opts.max_input_tokens, progress), **prep)
        .map_batches(InferCall(replicas, opts.batch_size), batch_size=None, num_cpus=cpus["infer"],
                     compute=infer_tasks, **fmt)
        .map_batches(PostprocessStage(opts.model, opts.task, opts.job_name, opts.run_id, progress), **post)
    )
    if opts.iceberg is not None:  # the driver commits the rows (connectors/iceberg.py)
        return ds.map_batches(ResultStage(), **{**post, "batch_size": opts.rows_per_file})
    return ds.map_batches(WriteStage(opts.output, opts.run_id, progress), **{**post, "batch_size": opts.rows_per_file})


def read_and_parse(ds: ray.data.Dataset, opts: PipelineOptions, prep: dict[str, Any],
                   progress: ProgressNote = NO_PROGRESS) -> ray.data.Dataset:
    """The file stages: each document's bytes, then its text."""
    return (
        ds.map_batches(ReadStage(opts.input.storage_options, opts.max_file_bytes, progress), **prep)
        .map_batches(ParseStage(opts.fallback_encoding, opts.parse_timeout_s, opts.max_pages, pdf_text=opts.pdf_text,
                                ocr=opts.ocr, max_unpacked_bytes=opts.max_file_bytes, progress=progress,
                                pages_per_task=opts.pages_per_task, range_cpus=opts.prep_num_cpus), **prep)
    )
