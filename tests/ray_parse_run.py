"""Run the pipeline's read and parse stages over files on a Ray of its own with 2 CPUs (this machine's count), as
Ray Data tasks of the pipeline's CPU share; print each row (without its text: a hash, length and the table rows)
as one JSON line. Used by tests/test_page_ranges.py in a subprocess, so its Ray is never the session's.

    python tests/ray_parse_run.py OPTIONS_JSON FILE...
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def main() -> None:
    import pyarrow as pa
    import ray
    from clover_batch.pipeline.rows import work_table
    from clover_batch.pipeline.stages import ParseStage, ReadStage

    options = json.loads(sys.argv[1])
    files = sys.argv[2:]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    docs = pa.table({"doc_id": [str(i) for i in range(len(files))], "source_uri": files,
                     "size": [os.path.getsize(f) for f in files], "version": ["1"] * len(files)})
    prep = {"batch_size": 1, "num_cpus": 0.5, "batch_format": "pyarrow", "zero_copy_batch": False}
    ds = (ray.data.from_arrow(work_table(docs))
          .map_batches(ReadStage({}, 2**30), **prep)
          .map_batches(ParseStage(None, range_cpus=0.5, **options), **prep))
    for row in ds.take_all():
        text = row.pop("text") or ""
        out = {k: row[k] for k in ("source_uri", "status", "error", "pages", "text_source", "page_sources",
                                   "timings")}
        out["text_sha"] = hashlib.sha256(text.encode()).hexdigest()
        out["text_chars"] = len(text)
        out["table_rows"] = [line for line in text.splitlines() if line.startswith("|")]
        print(json.dumps(out), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
