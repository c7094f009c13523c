"""Writing result rows: Parquet parts (connectors/sink.py) against the Iceberg table (connectors/iceberg.py), the
model excluded, and what 10 re-runs leave in the Iceberg table.

    python bench/sinks.py                        # 10,000 rows, batches of 64 (output.rows_per_file's default)
    python bench/sinks.py --rows 10000 --rows-per-commit 64 256 --rounds 2

Rows: N prepared output rows (pipeline/rows.py OUTPUT_SCHEMA: a 400-character output_text, counters, timings), the
same for both sinks. Each sink commits them in batches of --rows-per-commit under the output's lock, the way a run
does: Parquet, one part per batch (stage, lock check, publish: `write_part`); Iceberg, one snapshot per batch from
the driver (lock check, data file, catalog commit on the embedded SQLite catalog: `commit_rows`). The two sides
alternate in one process (P I P I ...), each on a fresh output folder; printed: rows/s of each and the ratio.

Then 10 re-runs on one Iceberg table: each replaces the rows of 5% of the documents (changed texts, --retry-failed)
and adds 5% new ones, in batches as above; printed after each: snapshots, data files, rows, bytes under the
warehouse; then the same after `compact_table` (one rewrite of the live rows, older snapshots expired).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time


def prepared_rows(n: int, start: int = 0, run_id: str = "bench-run"):
    import pyarrow as pa
    from clover_batch.pipeline.rows import OUTPUT_SCHEMA, STAGES

    ids = [f"doc-{i:08d}" for i in range(start, start + n)]
    text = ("The lease runs for three years from 1 May at 900 EUR a month, payable in advance; either party may "
            "end it with three months' notice. ") * 3
    timings = [dict.fromkeys(STAGES, 0.01)] * n
    data = {
        "doc_id": ids, "source_uri": [f"s3://bucket/texts.parquet#{d}" for d in ids],
        "version": [f"sha256:{i:032x}" for i in range(start, start + n)], "size": [2000] * n, "format": ["text"] * n,
        "pages": [None] * n, "text_source": [None] * n, "status": ["ok"] * n, "error": [None] * n,
        "output_text": [text[:400]] * n, "output_json": [None] * n, "input_tokens": [600] * n,
        "output_tokens": [90] * n, "mean_logprob": [-0.4] * n, "windows": [3] * n, "forward_passes": [40] * n,
        "denoising_steps": [40] * n, "stopped": ["eos"] * n, "timings": timings, "model": ["bench"] * n,
        "task": ["summarize"] * n, "job_name": ["bench"] * n, "run_id": [run_id] * n,
    }
    return pa.table({name: data.get(name) for name in OUTPUT_SCHEMA.names}, schema=OUTPUT_SCHEMA)


def write_parquet(folder: str, rows, per_commit: int) -> float:
    from clover_batch.connectors.fs import Location
    from clover_batch.connectors.sink import OutputLock, write_part

    location = Location(folder)
    start = time.perf_counter()
    with OutputLock(location, "bench-run"):
        for i in range(0, rows.num_rows, per_commit):
            write_part(location, rows.slice(i, per_commit), "bench-run")
    return time.perf_counter() - start


def write_iceberg(folder: str, rows, per_commit: int, replaced=(), table=None, run_id: str = "bench-run"):
    from clover_batch.connectors.fs import Location
    from clover_batch.connectors.iceberg import IcebergTarget, commit_rows
    from clover_batch.connectors.sink import OutputLock, check_lock_owner
    from clover_batch.pipeline.rows import OUTPUT_SCHEMA

    location = Location(folder)
    target = IcebergTarget(location, "bench.results")
    replaced = set(replaced)
    start = time.perf_counter()
    with OutputLock(location, run_id):
        table = target.load(OUTPUT_SCHEMA)  # a run opens (or creates) the table once, before its batches
        for i in range(0, rows.num_rows, per_commit):
            batch = rows.slice(i, per_commit)
            ids = [d for d in batch.column("doc_id").to_pylist() if d in replaced]
            table = commit_rows(target, table, batch, ids, run_id, check=lambda: check_lock_owner(location, run_id))
    return time.perf_counter() - start, target


def warehouse_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(folder, "warehouse"))
               for f in fs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--rows-per-commit", type=int, nargs="+", default=[64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reruns", type=int, default=10)
    args = parser.parse_args()
    from clover_batch.connectors.iceberg import compact_table, table_stats

    rows = prepared_rows(args.rows)
    tmp = tempfile.mkdtemp(prefix="bench-sinks-")
    try:
        for per_commit in args.rows_per_commit:
            times: dict[str, list[float]] = {"parquet": [], "iceberg": []}
            for r in range(args.rounds):
                for side in ("parquet", "iceberg"):
                    folder = os.path.join(tmp, f"{side}-{per_commit}-{r}")
                    seconds = (write_parquet(folder, rows, per_commit) if side == "parquet"
                               else write_iceberg(folder, rows, per_commit)[0])
                    times[side].append(seconds)
                    print(f"  {side:8s} round {r}: {args.rows / seconds:9.0f} rows/s ({seconds:.2f} s)", flush=True)
            best = {s: min(t) for s, t in times.items()}
            print(f"{args.rows} rows, {per_commit} rows per commit: parquet {args.rows / best['parquet']:.0f} rows/s, "
                  f"iceberg {args.rows / best['iceberg']:.0f} rows/s (best of {args.rounds}); "
                  f"iceberg/parquet time ratio {best['iceberg'] / best['parquet']:.2f}", flush=True)

        per_commit = args.rows_per_commit[0]
        folder = os.path.join(tmp, "reruns")
        _, target = write_iceberg(folder, rows, per_commit)
        stats = table_stats(target)
        print(f"\nfirst run: {stats}, {warehouse_bytes(folder) / 2**20:.1f} MiB under warehouse/")
        step, next_id = args.rows // 20, args.rows
        for k in range(1, args.reruns + 1):
            changed = prepared_rows(step, start=(k * step * 3) % args.rows, run_id=f"rerun-{k}")
            new = prepared_rows(step, start=next_id, run_id=f"rerun-{k}")
            next_id += step
            import pyarrow as pa

            seconds, _ = write_iceberg(folder, pa.concat_tables([changed, new]), per_commit,
                                       replaced=changed.column("doc_id").to_pylist(), run_id=f"rerun-{k}")
            stats = table_stats(target)
            print(f"re-run {k:2d} ({step} replaced, {step} new, {2 * step / seconds:.0f} rows/s): {stats}, "
                  f"{warehouse_bytes(folder) / 2**20:.1f} MiB", flush=True)
        start = time.perf_counter()
        compact_table(target)
        print(f"compact_table: {table_stats(target)}, {warehouse_bytes(folder) / 2**20:.1f} MiB under warehouse/ "
              f"(the expired snapshots' manifests stay under metadata/), {time.perf_counter() - start:.2f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
