"""clover-batch: batch inference of the Clover block-diffusion MoE model over document collections, on Ray Data.

From Python (docs/tables.md, "From Python"):

    import clover_batch, ray

    ds = ray.data.read_parquet("texts.parquet")              # an `id` and a `text` column
    results = clover_batch.process(ds, "jobs/examples/summarize-local.yaml")
    results.write_parquet("summaries/")                      # the replicas start when this executes

    report = clover_batch.run("job.yaml", output__uri="out/nightly")   # what `clover-batch run` does
    assert report.outcome == 0

Importing this package is cheap: Ray and torch load when `process` or `run` is called.
"""

from __future__ import annotations

from clover_batch.pyapi import process, run

__all__ = ["process", "run"]
