"""Per-forward time of one replica at expert_parallel N=1 and N=2 (CPU, gloo), with the share in the MoE exchange.

    python bench/expert_parallel.py [--preset bench] [--repeats 5]

Every rank gets one CPU thread (a rank stands for one device). For each shape (a prefill chunk, and a decode step
of a batch of diffusion blocks) it prints the median forward time, the time in the MoE dispatchers (dispatch ->
experts -> combine), and at N=2 the part of that spent inside the all-to-all exchanges (header, tokens out, results
back; the way back includes waiting for the other rank's experts). Logits are checked against N=1 as it goes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from clover_batch.model import load_model
from clover_batch.model.expert_parallel import local_replica
from clover_batch.model.moe import SparseMoE

NVLINK_NOTE = """\
On NVLink-connected GPUs (NCCL): the exchange moves k*N*D activations each way per MoE layer at ~150-450 GB/s
per direction with ~10-20 us latency per collective, against gloo's TCP loopback here (~1-3 GB/s, ~100 us+ per
call, plus Python and a CPU copy per chunk). For a 128-token decode step of the 35B shape (D=2048, top-8) a layer
moves ~4 MB: ~10-30 us on NVLink, so the per-round cost is dominated by the three collective launches (header
counts + two all-to-alls) and the host sync for the counts; the next steps there are a fixed-capacity all-to-all
without the count round-trip (or NVSHMEM/DeepEP-style kernels), CUDA graphs over the decode step, and overlapping
the shared expert with the exchange. Expert compute also stops being the CPU's bottleneck, so the exchange share
rises at small batches and falls at large prefill chunks."""


class Timer:
    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def instrument(model) -> Timer:
    t = Timer()
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        moe.dispatcher = t.wrap(moe.dispatcher)
    return t


def measure(model, ids: torch.Tensor, repeats: int, timers: list[Timer]) -> tuple[float, list[float], torch.Tensor]:
    logits, _ = model(ids)  # warm-up
    times, shares = [], [[] for _ in timers]
    for _ in range(repeats):
        for t in timers:
            t.seconds = 0.0
        start = time.perf_counter()
        logits, _ = model(ids)
        times.append(time.perf_counter() - start)
        for s, t in zip(shares, timers, strict=True):
            s.append(t.seconds)
    return statistics.median(times), [statistics.median(s) for s in shares], logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    single = load_model(args.preset)
    V = single.config.vocab_size
    shapes = {"prefill 1x1024": torch.randint(0, V - 8, (1, 1024), generator=gen),
              "decode 8x32": torch.randint(0, V - 8, (8, 32), generator=gen)}
    moe_1 = instrument(single)
    rows = []
    results_1 = {}
    for name, ids in shapes.items():
        total, (moe,), logits = measure(single, ids, args.repeats, [moe_1])
        results_1[name] = logits
        rows.append((name, 1, total, moe, None))
    replica = local_replica(args.preset, 2, num_threads=1, timeout_s=120)
    try:
        moe_2 = instrument(replica.model)
        exch = Timer()
        replica.group.exchange = exch.wrap(replica.group.exchange)
        for name, ids in shapes.items():
            total, (moe, ex), logits = measure(replica.model, ids, args.repeats, [moe_2, exch])
            err = ((logits - results_1[name]).abs().max() / results_1[name].abs().max()).item()
            if err > 1e-5:
                raise SystemExit(f"{name}: N=2 logits differ from N=1 by {err:.2e}")
            rows.append((name, 2, total, moe, ex))
    finally:
        replica.close()

    print(f"preset {args.preset}: {single.config.num_experts} experts, top-{single.config.num_experts_per_tok}, "
          f"{len(single.layers)} MoE layers, 1 CPU thread per rank, median of {args.repeats}")
    print(f"{'shape':<16}{'N':>3}{'forward ms':>12}{'MoE ms':>10}{'MoE %':>8}{'exchange ms':>13}{'exchange %':>12}")
    for name, n, total, moe, ex in rows:
        ex_ms = "-" if ex is None else f"{ex * 1e3:.1f}"
        ex_pct = "-" if ex is None else f"{100 * ex / total:.0f}%"
        moe_pct = f"{100 * moe / total:.0f}%"
        print(f"{name:<16}{n:>3}{total * 1e3:>12.1f}{moe * 1e3:>10.1f}{moe_pct:>8}{ex_ms:>13}{ex_pct:>12}")
    for name in shapes:
        t1 = next(r[2] for r in rows if r[0] == name and r[1] == 1)
        t2 = next(r[2] for r in rows if r[0] == name and r[1] == 2)
        print(f"{name}: N=2 / N=1 forward time = {t2 / t1:.2f}")
    print()
    print(NVLINK_NOTE)


if __name__ == "__main__":
    main()
