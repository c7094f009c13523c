"""What the resource plan and the stall watchdog cost: time to a refusal, and a normal run with the watchdog on vs off.

1. Refusal: `clover-batch run jobs/examples/summarize-local.yaml` asking for one replica more than the machine has
   CPUs, with expert_parallel 2, on the run's own local Ray (no address): the wall time from starting the command
   to its exit 2, --refusals times (a fresh process each: imports and the model check included, as a user sees it).
2. Watchdog: the example job (5 documents, the demo checkpoint) run in this process on one local Ray of the
   machine's CPUs (at most --cpus), into a fresh output each time, with run.stall_timeout_s 900 (on: the progress
   board, the stages' notes, the replicas polled every 5 s) and 0 (off), alternating on/off --rounds times after
   one warm-up run of each, so a busy machine slows both alike. Prints each run's wall time (the run report's) and
   the median ratio on/off.

    python bench/scheduling.py --refusals 3 --rounds 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def time_refusals(n: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    cpus = os.cpu_count() or 1
    times = []
    for _ in range(n):
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "clover_batch.jobs.cli", "run", "jobs/examples/summarize-local.yaml",
                 "--set", f"resources.replicas={cpus + 1}", "--set", "model.expert_parallel=2",
                 "--set", f"output.uri={out}/out"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
            times.append(time.perf_counter() - start)
        if done.returncode != 2:
            raise SystemExit(f"expected exit 2, got {done.returncode}: {done.stderr}")
    return times


def time_watchdog(rounds: int, cpus: int) -> tuple[list[float], list[float]]:
    import ray
    from clover_batch.jobs.runner import run
    from clover_batch.jobs.spec import load_job

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.chdir(REPO)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    on, off = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(rounds + 1):  # the first round warms up (worker processes, page cache)
                for stall, times in ((900, on), (0, off)):
                    spec = load_job("jobs/examples/summarize-local.yaml",
                                    [f"run.stall_timeout_s={stall}", f"output.uri={tmp}/out-{i}-{stall}"])
                    report = run(spec).report
                    assert report.processed == 5, report.by_status
                    if i:
                        times.append(report.wall_seconds)
                    print(f"round {i}{' (warm-up)' if not i else ''}: watchdog {'on ' if stall else 'off'} "
                          f"{report.wall_seconds:.1f} s", flush=True)
    finally:
        ray.shutdown()
    return on, off


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refusals", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cpus", type=int, default=2, help="the local Ray's CPUs (at most the machine's)")
    args = ap.parse_args()

    refusals = time_refusals(args.refusals)
    print(f"refusal (exit 2), command start to exit: {', '.join(f'{t:.1f}' for t in refusals)} s; "
          f"median {statistics.median(refusals):.1f} s")
    on, off = time_watchdog(args.rounds, min(args.cpus, os.cpu_count() or 1))
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    print(f"example job wall time, watchdog on: median {statistics.median(on):.1f} s; off: median "
          f"{statistics.median(off):.1f} s; on/off per round: {', '.join(f'{r:.3f}' for r in ratios)}; median "
          f"ratio {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
