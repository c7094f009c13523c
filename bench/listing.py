"""Planning a run at scale: list N input objects, read the done set from an output holding N/2 rows, subtract.

    python bench/listing.py                       # 10K, 100K and 1M objects on memory://
    python bench/listing.py --sizes 10000 --store local

Each size runs in a fresh process. The input holds N small objects; the output holds N/2 committed rows (of those
same documents) in parts of --rows-per-part rows, written directly as Parquet (setup, not timed). Then the run's
own planning step (jobs.runner.plan_run: clean-up, done set, staged-part recovery, listing, pending set) runs
under the output lock, with a thread sampling the process's resident memory every 10 ms. Printed per size: the
listing and done-set read timed alone, the whole plan, the RSS before planning (the memory:// store itself lives
in this process) and the peak while planning. Goal: growth no worse than linear; 1M planned in under 60 s and
2 GiB.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest resident set size seen while the block runs (sampled every 10 ms)."""

    def __enter__(self):
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def one_size(n: int, store: str, rows_per_part: int) -> dict:
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq
    from clover_batch.connectors.fs import Location, list_document_table
    from clover_batch.connectors.sink import OutputLock, part_name, read_index
    from clover_batch.jobs.runner import pipeline_options, plan_run
    from clover_batch.jobs.spec import parse_job
    from clover_batch.pipeline.rows import OUTPUT_SCHEMA

    start = time.perf_counter()
    if store == "memory":
        fs = fsspec.filesystem("memory")
        in_uri, out_uri = "memory://bench-in", "memory://bench-out"
        for i in range(n):
            fs.pipe_file(f"/bench-in/d{i // 1000:04d}/doc-{i:07d}.txt", b"x")
    else:
        work = tempfile.mkdtemp(prefix="clover-listing-")
        fs = fsspec.filesystem("file")
        in_uri, out_uri = os.path.join(work, "in"), os.path.join(work, "out")
        for i in range(n):
            folder = os.path.join(in_uri, f"d{i // 1000:04d}")
            if i % 1000 == 0:
                os.makedirs(folder)
            with open(os.path.join(folder, f"doc-{i:07d}.txt"), "wb") as f:
                f.write(b"x")
        os.makedirs(out_uri)
    listed = list_document_table(Location(in_uri), ["*"], [])
    done = listed.slice(0, n // 2)
    out_fs, out_root = Location(out_uri).filesystem()
    for i in range(0, done.num_rows, rows_per_part):
        rows = done.slice(i, rows_per_part)
        table = pa.table({"doc_id": rows.column("doc_id"), "source_uri": rows.column("source_uri"),
                          "version": rows.column("version"), "size": rows.column("size"),
                          "status": pa.array(["ok"] * rows.num_rows)}).select(["doc_id", "source_uri", "version",
                                                                                 "size", "status"])
        full = pa.table([table.column(f.name) if f.name in table.column_names else pa.nulls(rows.num_rows, f.type)
                         for f in OUTPUT_SCHEMA], schema=OUTPUT_SCHEMA)
        with out_fs.open(f"{out_root.rstrip('/')}/{part_name(full, 'bench')}", "wb") as f:
            pq.write_table(full, f)
    del listed, done
    setup = time.perf_counter() - start
    gc.collect()
    # The memory:// store (a million Python objects) lives in this process only because it is a benchmark: keep
    # the garbage collector from rescanning it at every collection the planner triggers, as it would not exist in
    # a driver listing a real store.
    gc.freeze()

    t = time.perf_counter()
    n_listed = list_document_table(Location(in_uri), ["*"], []).num_rows
    t_list = time.perf_counter() - t
    gc.collect()
    t = time.perf_counter()
    n_index = read_index(Location(out_uri)).num_rows
    t_index = time.perf_counter() - t
    gc.collect()

    spec = parse_job({"name": "bench", "input": {"uri": in_uri}, "output": {"uri": out_uri},
                      "task": {"kind": "summarize"}})
    opts = pipeline_options(spec, "bench-plan")
    before = rss_bytes()
    with OutputLock(opts.output, "bench-plan"):
        t = time.perf_counter()
        with PeakRSS() as peak:
            plan = plan_run(opts, ["*"], [])
        t_plan = time.perf_counter() - t
    assert (plan.listed, plan.pending.num_rows) == (n, n - n // 2), (plan.listed, plan.pending.num_rows)
    assert (n_listed, n_index) == (n, n // 2)
    if store == "local":
        shutil.rmtree(work)
    return {"n": n, "setup_s": setup, "list_s": t_list, "index_s": t_index, "plan_s": t_plan,
            "pending": plan.pending.num_rows, "rss_before_mib": before / 2**20, "peak_mib": peak.peak / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--store", choices=["memory", "local"], default="memory")
    ap.add_argument("--rows-per-part", type=int, default=64, help="output.rows_per_file of the done rows")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(one_size(args.child, args.store, args.rows_per_part)))
        return
    print(f"store {args.store}, done rows = N/2 in parts of {args.rows_per_part} rows; one process per size")
    print(f"{'N':>9} {'list s':>8} {'done-set s':>10} {'plan s':>8} {'plan s/1K':>9} {'RSS before MiB':>14} "
          f"{'peak MiB':>9} {'peak-before':>11}")
    for n in args.sizes:
        out = subprocess.run([sys.executable, __file__, "--child", str(n), "--store", args.store,
                              "--rows-per-part", str(args.rows_per_part)], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(out.stderr)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['n']:>9} {r['list_s']:>8.2f} {r['index_s']:>10.2f} {r['plan_s']:>8.2f} "
              f"{1000 * r['plan_s'] / r['n']:>9.3f} {r['rss_before_mib']:>14.0f} {r['peak_mib']:>9.0f} "
              f"{r['peak_mib'] - r['rss_before_mib']:>11.0f}")


if __name__ == "__main__":
    main()
