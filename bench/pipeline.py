"""Throughput of the whole Ray pipeline vs the same engine called in a plain loop, side by side in one run.

Both sides get the same documents, prompts, decode options, batch size and torch thread count. The loop is the
engine's best case: prompts are parsed and tokenized beforehand and only generate() + detokenizing is timed. The
pipeline is timed end to end by the runner (listing, actor start and model load, read, parse, tokenize, infer,
postprocess, Parquet commit), after Ray itself has started.

    python bench/pipeline.py --model tiny --docs 16 --words 40 --max-new-tokens 32
    python bench/pipeline.py --model tiny --docs 128 --words 50 --max-new-tokens 4 --cpu-by-process

--cpu-by-process: while each pipeline run goes, every process on the machine is sampled (psutil, every 0.2 s) and
its CPU seconds over the run are summed by kind: the replica actor, Ray Data's task workers, parse children, Ray's
own daemons (raylet, GCS, agents), the driver, anything else. On a machine with as many cores as the replica has
torch threads, whatever is not the replica's is time its engine waits for a core.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def make_documents(folder: Path, n: int, words: int) -> None:
    vocab = ["contract", "term", "party", "notice", "rent", "clause", "renewal", "payment", "owner", "date"]
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        body = " ".join(vocab[(j * 7 + i) % len(vocab)] for j in range(words + 13 * i))
        (folder / f"doc-{i:03d}.txt").write_text(f"Document {i}.\n{body}\n")


def _kind(cmdline: list[str], pid: int) -> str:
    text = " ".join(cmdline)
    if pid == os.getpid():
        return "driver (streaming executor, listing, commit)"
    if "ray::" in text:
        title = text.split("ray::", 1)[1].split()[0]
        if title.startswith("InferStage"):
            return "replica actor"
        if title.startswith("IDLE"):
            return "Ray workers, idle"
        if title.startswith(("MapBatches", "Map(", "ReadFiles", "Read", "Write")) or "Stage" in title:
            return f"Ray Data task: {title}"
        return f"Ray actor: {title}"
    if "_CHILD_CODE" in text or "parse_process" in text or ("-c" in cmdline and "clover_batch" in text):
        return "parse children"
    if any(d in text for d in ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "ray/_private",
                               "monitor.py")):
        return "Ray daemons"
    return "other"


class CpuByProcess:
    """CPU seconds of every process on the machine between start() and stop(), summed by `_kind`. Each interval's
    CPU time of a process goes to what the process was doing at the interval's end (a Ray worker runs one task kind
    after another; one seen idle, or exiting, keeps the kind it last worked as); a process that exits loses at most
    one interval."""

    def __init__(self, interval: float = 0.2) -> None:
        import psutil

        self.psutil, self.interval = psutil, interval
        self.last: dict[int, tuple[str, float]] = {}
        self.by_kind: dict[str, float] = defaultdict(float)
        self.done = threading.Event()

    def _sample(self, count: bool = True) -> None:
        for proc in self.psutil.process_iter(["pid", "cmdline", "cpu_times"]):
            info = proc.info
            if info["cpu_times"] is None:
                continue
            cpu = info["cpu_times"].user + info["cpu_times"].system
            kind = _kind(info["cmdline"] or [], info["pid"])
            prev = self.last.get(info["pid"])
            if prev is not None and (kind == "Ray workers, idle" or not info["cmdline"]):
                kind = prev[0]
            if count:
                # a process born during the run counts from 0: its whole life is in the run
                self.by_kind[kind] += cpu - (prev[1] if prev is not None else 0.0)
            self.last[info["pid"]] = (kind, cpu)

    def start(self) -> None:
        self._sample(count=False)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.done.wait(self.interval):
            self._sample()

    def stop(self) -> dict[str, float]:
        self.done.set()
        self.thread.join()
        self._sample()
        return dict(sorted(self.by_kind.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset or checkpoint folder")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--words", type=int, default=40, help="words in the first document (about 7 tokens each)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4, help="documents per Ray batch, and per loop generate() call")
    ap.add_argument("--max-slots", type=int, default=16, help="documents the replica's engine decodes at once")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the loop and of the one replica")
    ap.add_argument("--repeats", type=int, default=2, help="pipeline runs (the loop runs once more)")
    ap.add_argument("--cpu-by-process", action="store_true", help="CPU seconds of every process by kind, per run")
    args = ap.parse_args()

    import ray
    import torch
    from clover_batch.connectors.fs import Location, list_documents, read_bytes
    from clover_batch.jobs.runner import run
    from clover_batch.jobs.spec import parse_job
    from clover_batch.model import generate, kernels, load_model
    from clover_batch.pipeline.parse import parse_document
    from clover_batch.pipeline.tokenizer import PromptBuilder

    work = Path(tempfile.mkdtemp(prefix="clover-bench-"))
    make_documents(work / "docs", args.docs, args.words)
    instruction = "Summarize the document."
    decode = {"max_new_tokens": args.max_new_tokens, "threshold": 0.9, "temperature": 0.0}

    # Plain loop: same prompts, same engine, same batches.
    kernels.model_threads(args.threads)
    builder = PromptBuilder(args.model)
    refs = list_documents(Location(str(work / "docs")), ["*"], [])
    prompts = [
        builder.build(instruction, parse_document(r.source_uri, read_bytes(r.source_uri, {})).text) for r in refs
    ]
    model = load_model(args.model)
    generate(model, [prompts[0][:64]], max_new_tokens=4)  # warm-up, as the pipeline's actor warms on its first batch

    def plain_loop() -> tuple[float, int]:
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(prompts), args.batch_size):
            for gen in generate(model, prompts[i : i + args.batch_size], **decode):
                builder.decode(gen.tokens)
                tokens += len(gen.tokens)
        return time.perf_counter() - start, tokens

    # Ray pipeline: one replica with the same threads; spare logical CPUs for the cheap stages.
    ray.init(address="local", num_cpus=args.threads + 1, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")

    def pipeline(i: int) -> dict:
        spec = parse_job(
            {
                "name": "bench",
                "input": {"uri": str(work / "docs")},
                "output": {"uri": str(work / f"out-{i}"), "rows_per_file": 64},
                "model": {"source": args.model},
                "task": {"kind": "summarize", "instruction": instruction},
                "decode": decode,
                "resources": {"replicas": 1, "cpus_per_replica": args.threads, "batch_size": args.batch_size,
                              "max_slots": args.max_slots},
            }
        )
        sampler = CpuByProcess() if args.cpu_by_process else None
        if sampler:
            sampler.start()
        report = run(spec).report
        if sampler:
            cpu_runs.append((report.wall_seconds, sampler.stop()))
        assert report.by_status == {"ok": args.docs}, report.by_status
        return report

    # Alternate loop and pipeline and keep the best of each: other load on a shared machine only ever slows a
    # run down, so the minimum is the estimate least disturbed by it.
    loop_runs, pipe_reports = [], []
    cpu_runs: list[tuple[float, dict[str, float]]] = []
    for i in range(args.repeats):
        loop_runs.append(plain_loop())
        pipe_reports.append(pipeline(i))
    loop_runs.append(plain_loop())
    ray.shutdown()
    loop_s, loop_tokens = min(loop_runs)
    report = min(pipe_reports, key=lambda r: r.wall_seconds)
    pipe_s = report.wall_seconds

    n_in = sum(len(p) for p in prompts)
    print(
        f"model={args.model} docs={args.docs} prompt_tokens={n_in} max_new_tokens={args.max_new_tokens} "
        f"batch={args.batch_size} max_slots={args.max_slots} threads={args.threads} torch={torch.__version__} "
        f"cpus={os.cpu_count()}"
    )
    print(f"{'':10s} {'seconds':>8s} {'docs/s':>8s} {'out tok/s':>10s} {'out tokens':>10s}")
    loop_list = ", ".join(format(t, ".2f") for t, _ in loop_runs)
    pipe_list = ", ".join(format(r.wall_seconds, ".2f") for r in pipe_reports)
    print(f"loop runs: {loop_list} s; pipeline runs: {pipe_list} s (best of each below)")
    print(f"{'loop':10s} {loop_s:8.2f} {args.docs / loop_s:8.3f} {loop_tokens / loop_s:10.1f} {loop_tokens:10d}")
    print(
        f"{'pipeline':10s} {pipe_s:8.2f} {args.docs / pipe_s:8.3f} {report.output_tokens / pipe_s:10.1f} "
        f"{report.output_tokens:10d}"
    )
    print(f"pipeline / loop (documents/s): {loop_s / pipe_s:.2f}x")
    print(f"pipeline stage seconds: { {k: round(v, 2) for k, v in report.stage_seconds.items()} }")
    for i, (wall, by_kind) in enumerate(cpu_runs):
        total = sum(by_kind.values())
        print(f"pipeline run {i}: {wall:.2f} s wall, {total:.1f} CPU-seconds on the machine "
              f"({total / max(wall, 1e-9):.2f} cores busy of {os.cpu_count()}):")
        for kind, cpu in by_kind.items():
            print(f"  {kind:46s} {cpu:7.1f} s  {100 * cpu / max(total, 1e-9):5.1f}%")


if __name__ == "__main__":
    main()
