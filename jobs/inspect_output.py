"""What an output folder holds: rows by status and a few sample rows (for `clover-batch show`), from its Parquet parts
or its Iceberg table."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from clover_batch.connectors.fs import Location
from clover_batch.connectors.iceberg import read_description, read_table_rows, table_stats
from clover_batch.connectors.sink import committed_parts, read_output

SAMPLE_COLUMNS = ["doc_id", "source_uri", "format", "status", "error", "input_tokens", "output_tokens", "output_text",
                  "page_sources", "uncertain_fields", "uncertain_words"]
# the sample columns an output written by an older version has: before rows said where they were unsure, and
# before they had page_sources
OLDER_COLUMNS = [SAMPLE_COLUMNS[:-2], SAMPLE_COLUMNS[:-3]]


@dataclass(frozen=True)
class OutputSummary:
    uri: str
    parts: int  # committed Parquet part files, or the Iceberg table's data files
    rows: int
    by_status: dict[str, int]
    samples: list[dict[str, Any]]  # up to `samples` rows per status, SAMPLE_COLUMNS only
    format: str = "parquet"  # parquet | iceberg


def summarize_output(location: Location, samples: int = 2, catalog: dict[str, Any] | None = None) -> OutputSummary:
    """An output folder's rows: its Parquet parts, or the Iceberg table its runs write (named in `_iceberg.json`;
    `catalog` adds the catalog properties left out of it, such as credentials)."""
    target = read_description(location, catalog)
    if target is not None:
        uri = f"{location.uri} (Iceberg table {target.table})"
        loaded = target.load()
        fields = {f.name for f in loaded.schema().fields} if loaded is not None else set()
        table = read_table_rows(target, next((c for c in (SAMPLE_COLUMNS, *OLDER_COLUMNS) if set(c) <= fields),
                                             SAMPLE_COLUMNS))
        files = table_stats(target)["data_files"] if table is not None else 0
    else:
        uri = location.uri
        for columns in (SAMPLE_COLUMNS, *OLDER_COLUMNS):
            try:
                table = read_output(location, columns=columns)
                break
            except KeyError:  # an output folder written by an older version: its first part lacks a column
                continue
        files = len(committed_parts(location)) if table is not None else 0
    if table is None:
        return OutputSummary(uri, 0, 0, {}, [], "parquet" if target is None else "iceberg")
    rows = sorted(table.to_pylist(), key=lambda r: (r["status"] != "ok", r["status"], r["source_uri"]))
    by_status = Counter(r["status"] for r in rows)
    picked, seen = [], Counter()
    for row in rows:
        if seen[row["status"]] < samples:
            seen[row["status"]] += 1
            picked.append(row)
    return OutputSummary(uri, files, len(rows), dict(sorted(by_status.items())), picked,
                         "parquet" if target is None else "iceberg")
