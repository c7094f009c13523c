"""What an output folder holds: rows by status and a few sample rows (for `clover-batch show`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import committed_parts, read_output

SAMPLE_COLUMNS = ["doc_id", "source_uri", "format", "status", "error", "input_tokens", "output_tokens", "output_text",
                  "page_sources"]


@dataclass(frozen=True)
class OutputSummary:
    uri: str
    parts: int  # committed Parquet part files
    rows: int
    by_status: dict[str, int]
    samples: list[dict[str, Any]]  # up to `samples` rows per status, SAMPLE_COLUMNS only


def summarize_output(location: Location, samples: int = 2) -> OutputSummary:
    try:
        table = read_output(location, columns=SAMPLE_COLUMNS)
    except KeyError:  # an output folder written before rows had page_sources
        table = read_output(location, columns=SAMPLE_COLUMNS[:-1])
    if table is None:
        return OutputSummary(location.uri, 0, 0, {}, [])
    rows = sorted(table.to_pylist(), key=lambda r: (r["status"] != "ok", r["status"], r["source_uri"]))
    by_status = Counter(r["status"] for r in rows)
    picked, seen = [], Counter()
    for row in rows:
        if seen[row["status"]] < samples:
            seen[row["status"]] += 1
            picked.append(row)
    return OutputSummary(
        location.uri, len(committed_parts(location)), len(rows), dict(sorted(by_status.items())), picked
    )
