"""Stages for documents that arrive as text and results that leave as rows (input tables, Iceberg output, the Python
API), beside the file stages of pipeline/stages.py.

    text rows:     TextStage -> tokenize -> infer -> postprocess -> ...
    Iceberg:       ... -> postprocess -> ResultStage (rows back to the driver: IcebergCommitter commits them)
    process(ds):   the user's rows -> DocumentRows -> [read -> parse | TextStage] -> tokenize -> ReplicaStage
                   -> postprocess -> OutputRows (the output schema, for the user's own write)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from clover_batch.connectors.iceberg import IcebergTarget, commit_rows
from clover_batch.connectors.tables import text_version
from clover_batch.pipeline.rows import OUTPUT_SCHEMA, STATS_SCHEMA, WORK_SCHEMA, fail, to_rows, to_table, work_table
from clover_batch.pipeline.stages import InferStage

if TYPE_CHECKING:
    from clover_batch.model import DecodeOptions
    from clover_batch.pipeline.stages import ModelRef

# what the driver reads from a ResultStage batch: the output row, and what the run report counts besides it
RESULT_SCHEMA = pa.schema([*OUTPUT_SCHEMA, WORK_SCHEMA.field("decode_batch"), WORK_SCHEMA.field("kernels"),
                           WORK_SCHEMA.field("replaces")])


class TextStage:
    """A document given as text (needs: text): nothing to read or parse. A null or empty text gets `empty`."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = to_rows(batch)
        for row in rows:
            row.update(status="ok", format="text")
            if not (row["text"] or "").strip():
                fail(row, "empty", "the text column holds no text for this document")
        return to_table(rows)


class ResultStage:
    """The end of the chain when the driver commits (Iceberg output): each row's output columns and counters."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        return batch.select(RESULT_SCHEMA.names).cast(RESULT_SCHEMA)


class DocumentRows:
    """A user's rows (an id and a text or URI column) -> working rows, as the driver makes them from a table."""

    def __init__(self, id_column: str, column: str, is_uri: bool):
        self.id_column, self.column, self.is_uri = id_column, column, is_uri

    def __call__(self, batch: pa.Table) -> pa.Table:
        for name in (self.id_column, self.column):
            if name not in batch.column_names:
                raise KeyError(f"column {name!r} is not in the dataset (its columns: {', '.join(batch.column_names)})")
        ids = batch.column(self.id_column)
        if ids.null_count:
            raise ValueError(f"column {self.id_column!r}: {ids.null_count} rows have a null id")
        ids = ids.cast(pa.string())
        values = batch.column(self.column).cast(pa.large_string())
        if self.is_uri:
            docs = pa.table({"doc_id": ids, "source_uri": values.cast(pa.string()),
                             "size": pa.array([0] * batch.num_rows, pa.int64()),
                             "version": pa.nulls(batch.num_rows, pa.string())})
        else:
            docs = pa.table({"doc_id": ids, "source_uri": ids, "size": pc.fill_null(pc.binary_length(values), 0),
                             "version": pa.array(text_version(values.combine_chunks()), pa.string()),
                             "text": values})
        return work_table(docs)


class ReplicaStage(InferStage):
    """A model replica as a Ray Data actor (`process`): the pool starts when the dataset executes. Async, so the
    several batches Ray Data keeps in flight at it feed one continuous-batching engine, as the run's replicas do.
    No attempt records (they live in a run's output folder): a document that kills the process fails the dataset
    after Ray Data's retries instead of getting a `crashed` row."""

    def __init__(self, model: ModelRef, decode: DecodeOptions, num_threads: int, max_slots: int, page_size: int,
                 job_name: str, parts: tuple[int, int] = (0, 0)):
        super().__init__(model, decode, num_threads, max_slots, page_size, job_name=job_name, parts=parts)

    async def __call__(self, batch: pa.Table) -> pa.Table:
        return await self.infer(batch)


class OutputRows:
    """The end of `process`: the output schema, what a run writes for each document."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        return batch.select(OUTPUT_SCHEMA.names).cast(OUTPUT_SCHEMA)


class IcebergCommitter:
    """On the driver: result rows from the ResultStage in, one Iceberg snapshot per commit out, stats rows (as the
    write stage makes them) for the rows committed.

    Rows are buffered and committed once at least `min_rows` (output.rows_per_file) are waiting and
    `interval_s` (output.commit_interval_s) have passed since the last commit, and at the end (`flush`). Each commit
    costs pyiceberg more as the table's snapshot list grows (bench/sinks.py), so a snapshot per few seconds of
    results, not per Ray batch; a kill loses at most the rows of one interval (they run again). With
    `interval_s=0`: one snapshot per `min_rows` rows."""

    def __init__(self, target: IcebergTarget, run_id: str, min_rows: int, interval_s: float,
                 check: Callable[[], None]):
        self.target, self.run_id, self.check = target, run_id, check
        self.min_rows, self.interval_s = min_rows, interval_s
        self.table = target.load(OUTPUT_SCHEMA)
        self.pending: list[pa.Table] = []
        self.waiting = 0
        self.last = time.monotonic()
        self.replaced = 0  # rows committed in place of older rows of their documents

    def add(self, block: pa.Table) -> pa.Table:
        """Buffer `block`; returns the stats rows of whatever this call committed (often none)."""
        self.pending.append(block)
        self.waiting += block.num_rows
        if self.waiting < self.min_rows or time.monotonic() - self.last < self.interval_s:
            return STATS_SCHEMA.empty_table()
        return self.flush(whole=self.interval_s > 0)

    def flush(self, whole: bool = True) -> pa.Table:
        """Commit what waits: as one snapshot (`whole`), or in snapshots of `min_rows` rows (a remainder below that
        stays buffered until the next call, or the last one, which is whole)."""
        if not self.waiting:
            return STATS_SCHEMA.empty_table()
        rows = pa.concat_tables(self.pending)
        size = rows.num_rows if whole else self.min_rows
        stats = []
        done = 0
        while rows.num_rows - done >= size or (whole and done < rows.num_rows):
            batch = rows.slice(done, size)
            stats.append(self._commit(batch))
            done += batch.num_rows
        self.pending = [rows.slice(done)] if done < rows.num_rows else []
        self.waiting = rows.num_rows - done
        self.last = time.monotonic()
        return pa.concat_tables(stats) if stats else STATS_SCHEMA.empty_table()

    def _commit(self, batch: pa.Table) -> pa.Table:
        start = time.perf_counter()
        replaced = batch.filter(pc.fill_null(batch.column("replaces"), False)).column("doc_id").to_pylist()
        self.table = commit_rows(self.target, self.table, batch.select(OUTPUT_SCHEMA.names), replaced, self.run_id,
                                 check=self.check)
        self.replaced += len(replaced)
        seconds = (time.perf_counter() - start) / max(1, batch.num_rows)
        stats = [{**row, "part_uri": None, "replacement": None, "write_seconds": seconds}
                 for row in batch.select([n for n in STATS_SCHEMA.names if n in batch.column_names]).to_pylist()]
        return to_table(stats, STATS_SCHEMA)
