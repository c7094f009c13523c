"""A folder of one long PDF and many short documents through the summarize job: the pipeline's stage seconds with
page ranges (the default) and without them (one parse task per document), side by side in one run (issue 33).

    python bench/mixed_folder.py                      # a 1,000-page PDF and 20 short documents (about 8 minutes)
    python bench/mixed_folder.py --pages 200 --short 10

The folder: a text-heavy PDF of --pages pages (bench/parse_formats.py's `text_pdf`: a manual's headings and dense
paragraphs) and --short fresh documents of the demo corpus (bench/demo_jobs.py's, one in three a one-page PDF).
Each setting runs jobs/examples/summarize-local.yaml on the demo model over the same folder into its own output,
unchanged but for `input.pages_per_task` ("without page ranges" sets it past the PDF's pages, so one worker parses
the whole PDF in one task, as before issue 33; its parse_timeout_s is raised so the comparison is of time, not of
a timeout). Printed per setting: the job's wall time, every row's status, the long PDF's parse seconds, and the
stage seconds summed over the rows (a row's `timings`: read, parse, tokenize, infer, postprocess; stages of
different rows overlap in time, so the sum is work, the wall time is what a user waits).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from clover_batch.jobs.demo_model import DEMO_DIR, SUMMARIZE_JOB
from demo_jobs import fresh_documents, run_job
from parse_formats import text_pdf

STAGES = ("read", "parse", "tokenize", "infer", "postprocess")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=1000, help="pages of the long PDF")
    ap.add_argument("--short", type=int, default=20, help="short documents beside it")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    settings = {"page ranges (default)": [],
                "without page ranges": [f"input.pages_per_task={args.pages + 1}", "input.parse_timeout_s=3600",
                                        "run.stall_timeout_s=7200"]}
    print(f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; a {args.pages}-page "
          f"PDF and {args.short} short documents, summarize job on the demo model")
    with tempfile.TemporaryDirectory(prefix="mixed-folder-") as tmp:
        folder = Path(tmp) / "docs"
        fresh_documents(folder, args.short)
        (folder / "long-manual.pdf").write_bytes(text_pdf(args.pages))
        results = {}
        for n, (label, overrides) in enumerate(settings.items()):
            start = time.perf_counter()
            rows = run_job(SUMMARIZE_JOB, folder, Path(tmp) / f"out-{n}", str(DEMO_DIR), overrides)
            results[label] = (time.perf_counter() - start, rows)
    print(f"\n{'setting':24s}{'wall s':>8s}{'long PDF parse s':>18s}" + "".join(f"{s:>12s}" for s in STAGES)
          + "  statuses")
    for label, (wall, rows) in results.items():
        sums = Counter()
        for row in rows.values():
            sums.update({k: v for k, v in (row["timings"] or {}).items() if v is not None})
        long_parse = (rows["long-manual.pdf"]["timings"] or {}).get("parse") or 0.0
        statuses = dict(Counter(r["status"] for r in rows.values()))
        print(f"{label:24s}{wall:8.1f}{long_parse:18.1f}" + "".join(f"{sums[s]:12.1f}" for s in STAGES)
              + f"  {statuses}")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
