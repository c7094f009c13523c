"""Attempt records vs engine throughput, side by side in one run: does writing them stall the engine?

The infer stage writes each document's attempt record as it enters the engine and removes it as it comes out
(connectors/attempts.py); on an object store each is a round trip. EngineLoop does both on a records thread of
its own, in order, merging what queued up, while the engine keeps stepping (pipeline/serving.py). This bench runs
the same requests through an EngineLoop several ways and prints tokens/s against the first (no records):
- records on a local folder, the way the stage does them (records thread);
- records on a store that waits `--latency-ms` per request before a local write (a remote bucket's round trip
  without its CPU), on the records thread, and on the engine thread itself (the design before: `enter` inside
  `engine.add`, `finish` right after the step that finished the documents), where the engine waits for each;
- the same two on a real S3-protocol server (moto, in a process of its own). Here a round trip is mostly CPU: the
  S3 client's in this process (signing, parsing: ~5 ms a request) and moto's, on the same two cores, so the
  records thread cannot hide it the way it hides a real bucket's latency.
Each side runs `--repeats` times, interleaved with the others; the best time counts. On `tiny` (steps of a few
ms) the sides near 1.00 move by up to 15% between runs: when documents enter shifts the engine's schedule.

    python bench/attempts.py --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlowStore:
    """An AttemptStore whose every request waits `latency` seconds first: the GET of past attempts (when not
    given), the PUT of `enter`, the DELETE of `finish`."""

    def __init__(self, store, latency: float) -> None:
        self.store, self.latency = store, latency

    def unfinished(self, doc_ids):
        time.sleep(self.latency)
        return self.store.unfinished(doc_ids)

    def enter(self, doc_ids, past=None):
        if past is None:
            past = self.unfinished(doc_ids)
        time.sleep(self.latency)
        self.store.enter(doc_ids, past=past)

    def finish(self, doc_ids):
        time.sleep(self.latency)
        self.store.finish(doc_ids)


def round_seconds(store, rounds: int) -> float:
    """Median seconds of one admission round's records: one document out (finish), one in (enter)."""
    times, inside = [], []
    for r in range(rounds + 1):
        entering = {f"round-{r}": False}
        start = time.perf_counter()
        store.finish(inside)
        store.enter(entering, past={d: [] for d in entering})
        if r:
            times.append(time.perf_counter() - start)
        inside = list(entering)
    store.finish(inside)
    return statistics.median(times)


def run_loop(model, options, prompts: dict[str, list[int]], slots: int, store, on_engine_thread: bool):
    """Seconds to run every prompt through an EngineLoop, and the generated tokens per prompt. Past attempts are
    passed to `enter` as the infer stage does (it read them when the batch came in)."""
    from clover_batch.model import Engine
    from clover_batch.pipeline.serving import EngineLoop

    engine = Engine(model, options, max_slots=slots)
    hooks = {}
    if store is not None and on_engine_thread:  # records in the engine thread's own path: it waits for them
        add, step = engine.add, engine.step

        def add_recorded(request):
            store.enter({request.id: False}, past={request.id: []})
            add(request)

        def step_recorded():
            finished = step()
            if finished:
                store.finish([request_id for request_id, _ in finished])
            return finished

        engine.add, engine.step = add_recorded, step_recorded
    elif store is not None:
        hooks = {"on_admit": lambda entering: store.enter(entering, past={d: [] for d in entering}),
                 "on_leave": store.finish}
    loop = EngineLoop(engine, **hooks)

    async def main():
        return await asyncio.gather(*(loop.submit(p, name=n) for n, p in prompts.items()))

    start = time.perf_counter()
    gens = asyncio.run(main())
    return time.perf_counter() - start, {n: g.tokens for n, g in zip(prompts, gens, strict=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset or checkpoint folder")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny runs fastest on one)")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="per request, of the slow store")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=30, help="admission rounds timed per store")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each side, interleaved; the best counts")
    args = ap.parse_args()

    import random

    import boto3
    from clover_batch.connectors.attempts import AttemptStore
    from clover_batch.connectors.fs import Location
    from clover_batch.model import DecodeOptions, kernels, load_model

    kernels.model_threads(args.threads)
    model = load_model(args.model)
    options = DecodeOptions(max_new_tokens=args.max_new_tokens, tokens_per_step=2, stop_token_ids=())
    rng = random.Random(0)
    prompts = {f"doc-{i}": [rng.randrange(1, 200) for _ in range(rng.randint(16, 160))]
               for i in range(args.requests)}

    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        s3 = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing",
              "region_name": "us-east-1"}
        client = boto3.client("s3", endpoint_url=s3["endpoint_url"], aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        bucket = "attempts-" + uuid.uuid4().hex[:12]
        for _ in range(100):  # the server takes a moment to listen
            try:
                client.create_bucket(Bucket=bucket)
                break
            except Exception:
                time.sleep(0.1)
        else:
            raise SystemExit(f"moto did not start on port {port}")
        with tempfile.TemporaryDirectory() as tmp:
            def store(kind: str):
                if kind == "s3":
                    return AttemptStore(Location(f"s3://{bucket}/{uuid.uuid4().hex}", s3), "bench")
                local = AttemptStore(Location(f"{tmp}/{uuid.uuid4().hex}"), "bench")
                return local if kind == "local" else SlowStore(local, args.latency_ms / 1e3)

            per_round = {kind: round_seconds(store(kind), args.rounds) for kind in ("local", "slow", "s3")}
            run_loop(model, options, dict(list(prompts.items())[:4]), args.slots, None, False)  # warm-up
            slow = f"{args.latency_ms:g} ms/request"
            sides = [("no records", None, False), ("local, records thread", "local", False),
                     (f"{slow}, records thread", "slow", False), (f"{slow}, engine thread", "slow", True),
                     ("s3 (moto), records thread", "s3", False), ("s3 (moto), engine thread", "s3", True)]
            best: dict[str, float] = {}
            outputs = []
            for _ in range(args.repeats):
                for label, kind, inline in sides:
                    seconds, tokens = run_loop(model, options, prompts, args.slots, store(kind) if kind else None,
                                               inline)
                    best[label] = min(best.get(label, seconds), seconds)
                    outputs.append(tokens)
    finally:
        server.terminate()
        server.wait()

    results = [(label, best[label], outputs[0]) for label, _, _ in sides]
    base_s, base_tokens = results[0][1], results[0][2]
    assert all(tokens == base_tokens for tokens in outputs), "records changed what was generated"
    total = sum(len(t) for t in base_tokens.values())
    print(f"attempt records vs engine: {args.requests} requests on {args.model!r}, {args.slots} slots, "
          f"{args.max_new_tokens} new tokens each, {args.threads} threads; outputs identical on every side")
    print(f"one admission round's records (finish 1 + enter 1), median of {args.rounds}: local "
          f"{per_round['local'] * 1e3:.2f} ms, {slow} {per_round['slow'] * 1e3:.1f} ms, "
          f"s3 (moto) {per_round['s3'] * 1e3:.1f} ms")
    print(f"{'side':<32}{'seconds':>9}{'tokens/s':>10}{'vs none':>9}")
    for label, seconds, _ in results:
        print(f"{label:<32}{seconds:>9.2f}{total / seconds:>10.1f}{base_s / seconds:>9.2f}")


if __name__ == "__main__":
    main()
