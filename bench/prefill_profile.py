"""Where a prefill forward's time goes, fp32 against bf16 (issue 34): ATen self time by kind of op, and the bound
that the fp32 GEMM share puts on what bf16 GEMMs alone can gain.

    python bench/prefill_profile.py --threads 2                   # bench preset, 16 prompts x 512 tokens
    python bench/prefill_profile.py --batch 1 --tokens 2048

One process: the preset in fp32, then in bf16 (the checkpoint's random weights in each dtype), each warmed up,
timed (best of 3 forwards, causal, logits of the last position) and then run once under torch.profiler. Kinds:
gemm (mm, addmm, bmm, baddbmm: projections, experts and the chunked GDN kernel's products), solve (the GDN
chunk's triangular solve), attention (SDPA), other (elementwise, copies and conversions, indexing, norms).
Amdahl's bound: with the GEMMs 3.3x faster (this CPU's bf16 GEMM at prefill sizes, issue 34) and nothing else
changing, fp32 time / ((1 - g) + g / 3.3) for a GEMM share g; and with the GEMMs free, 1 / (1 - g).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

KINDS = {"gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
         "solve": ("aten::linalg_solve_triangular",),
         "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math")}


def measure(preset: str, dtype: torch.dtype, ids: torch.Tensor) -> tuple[float, dict[str, float], list]:
    from clover_batch.model import load_model

    model = load_model(preset, seed=0, dtype=dtype)
    with torch.inference_mode():
        model(ids, attention="causal", keep_logits=1)
        walls = []
        for _ in range(3):
            t = time.perf_counter()
            model(ids, attention="causal", keep_logits=1)
            walls.append(time.perf_counter() - t)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(ids, attention="causal", keep_logits=1)
    by: dict[str, float] = defaultdict(float)
    events = prof.key_averages()
    for e in events:
        by[next((k for k, names in KINDS.items() if e.key in names), "other")] += e.self_cpu_time_total / 1e6
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    return min(walls), by, [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ids = torch.randint(3, 256, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    walls, shares = {}, {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        wall, by, top = measure(args.preset, dtype, ids)
        total = sum(by.values())
        walls[name], shares[name] = wall, by["gemm"] / total
        print(f"{name}: {args.preset} preset, {args.batch} x {args.tokens} tokens, {args.threads} threads: forward "
              f"{wall:.2f} s (best of 3); ATen self time {total:.2f} s: "
              + ", ".join(f"{k} {v:.2f} s ({v / total:.0%})" for k, v in sorted(by.items(), key=lambda kv: -kv[1])))
        print("  heaviest: " + ", ".join(f"{key.removeprefix('aten::')} {s:.2f} s/{n}" for key, s, n in top))
    g = shares["fp32"]
    print(f"bf16 / fp32 forward: {walls['fp32'] / walls['bf16']:.2f}x; fp32 GEMM share {g:.0%}: bound with GEMMs "
          f"3.3x faster {1 / ((1 - g) + g / 3.3):.2f}x, with GEMMs free {1 / (1 - g):.2f}x")


if __name__ == "__main__":
    main()
