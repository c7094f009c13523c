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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import ray
from clover_batch.connectors.fs import Location
from clover_batch.connectors.iceberg import IcebergTarget
from clover_batch.connectors.tables import TableInput
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
    parse_timeout_s: float = 300.0  # per document; past it the parser child is killed (`parse_timeout`)
    max_pages: int | None = None  # PDFs (EPUB, XPS) with more pages get `too_many_pages`
    pdf_text: str = "markdown"  # markdown | plain: how PDF, EPUB and XPS pages become text
    ocr: str = "auto"  # auto | always | never: OCR of PDF pages without a usable text layer
    prep_batch_size: int = 4  # documents per read/parse/tokenize task call
    prep_num_cpus: float = 0.5  # CPU share of one read/parse/tokenize task
    prep_concurrency: int | None = None  # most cheap-stage tasks at once; None: 2 per replica
    iceberg: IcebergTarget | None = None  # output.format iceberg: the driver commits the rows there
    commit_interval_s: float = 10.0  # Iceberg: least seconds between two snapshots (pipeline/table_stages.py)
    table: TableInput | None = None  # input.table: documents from a table instead of a folder listing


def build_pipeline(docs: pa.Table, opts: PipelineOptions, replicas: list[ActorHandle]) -> ray.data.Dataset:
    """The lazy dataset of per-document stats rows; iterating it runs the job. `docs`: the pending documents
    (connectors.fs.DOCUMENT_SCHEMA columns, plus `replaces` for retried ones); `replicas`: the infer actors
    (pipeline.replicas.start_replicas), alive while the dataset runs."""
    table = work_table(docs)
    # Small input blocks, so reading and parsing stream into the actors instead of waiting on one big block.
    step = max(opts.prep_batch_size, -(-table.num_rows // 256))
    blocks = [table.slice(i, step) for i in range(0, table.num_rows, step)]
    ds = ray.data.from_arrow(blocks)
    fmt = {"batch_format": "pyarrow", "zero_copy_batch": False}
    # Parsing is far cheaper than decoding, so a few task workers keep the actors fed; more would only spawn
    # processes that compete with the actors for CPU while they start. (No pool larger than the blocks there are.)
    prep_tasks = ray.data.TaskPoolStrategy(size=min(len(blocks), opts.prep_concurrency or 2 * opts.replicas))
    prep = {"batch_size": opts.prep_batch_size, "num_cpus": opts.prep_num_cpus, "compute": prep_tasks, **fmt}
    # A task per block at the replicas (its Ray batches all in flight at once), enough to fill their slots; a task
    # waiting on a replica holds no CPU.
    infer_tasks = ray.data.TaskPoolStrategy(size=min(len(blocks), opts.replicas * batches_in_flight(opts)))
    texts = "text" in docs.column_names  # a table's text column (connectors/tables.py): nothing to read or parse
    ds = ds.map_batches(TextStage(), **prep) if texts else read_and_parse(ds, opts, prep)
    ds = (
        ds.map_batches(TokenizeStage(opts.model, opts.task, opts.max_input_tokens), **prep)
        .map_batches(InferCall(replicas, opts.batch_size), batch_size=None, num_cpus=0, compute=infer_tasks, **fmt)
        .map_batches(PostprocessStage(opts.model, opts.task, opts.job_name, opts.run_id), **prep)
    )
    if opts.iceberg is not None:  # the driver commits the rows (connectors/iceberg.py)
        return ds.map_batches(ResultStage(), **{**prep, "batch_size": opts.rows_per_file})
    return ds.map_batches(WriteStage(opts.output, opts.run_id), **{**prep, "batch_size": opts.rows_per_file})


def read_and_parse(ds: ray.data.Dataset, opts: PipelineOptions, prep: dict[str, Any]) -> ray.data.Dataset:
    """The file stages: each document's bytes, then its text."""
    return (
        ds.map_batches(ReadStage(opts.input.storage_options, opts.max_file_bytes), **prep)
        .map_batches(ParseStage(opts.fallback_encoding, opts.parse_timeout_s, opts.max_pages, pdf_text=opts.pdf_text,
                                ocr=opts.ocr, max_unpacked_bytes=opts.max_file_bytes), **prep)
    )
