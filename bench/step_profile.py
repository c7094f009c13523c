"""Where a 16-row autoregressive decode step's time goes (bench-ar preset, fp32 or `--dtype bfloat16`): the
model's work (time inside ATen ops) against everything else (Python per layer and per row, bookkeeping), with op
calls, allocations and host syncs per step, from torch.profiler.

    python bench/step_profile.py --threads 2
    python bench/step_profile.py --threads 2 --before /path/to/pkg   # also an older checkout, side by side

--before PATH runs the same measurement in a child process with PATH first on sys.path (PATH holds a
`clover_batch` folder or link to another checkout, e.g. the commit before paged KV), alternating with this one,
so both are measured in one run on the same machine state.

"item/nonzero calls" counts ATen's scalar reads; on a CPU they are not device syncs (they are the CPU grouped
GEMM reading its offsets, and the MoE padding plan's group counts, both CPU-only paths).

A step here is what `Engine.step()` does once every sequence is decoding: sample each row's token from the saved
logits, the one host readback, one forward of 16 rows x 1 token through every layer, the slot bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero")


def measure(threads: int, rows: int, prompt: int, steps: int, dtype: str = "float32") -> dict:
    from clover_batch.model import DecodeOptions, Engine, Request, load_model

    torch.set_num_threads(threads)
    model = load_model("bench-ar", seed=0, dtype=getattr(torch, dtype))
    options = DecodeOptions(max_new_tokens=10_000, stop_token_ids=())
    engine = Engine(model, options, max_slots=rows)
    gen = torch.Generator().manual_seed(0)
    for i in range(rows):
        engine.add(Request(str(i), torch.randint(3, 256, (prompt,), generator=gen).tolist()))
    while engine.waiting or getattr(engine, "prefilling", None):
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    wall = sorted(walls)[len(walls) // 2]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled = (time.perf_counter() - start) / steps  # the profiler slows ops down: split this wall time
    events = prof.events()
    ops = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in ops if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    aten_s = sum(e.cpu_time_total for e in top) / 1e6 / steps
    self_by_op: dict[str, float] = {}
    for e in ops:
        self_by_op[e.name] = self_by_op.get(e.name, 0.0) + e.self_cpu_time_total / 1e6 / steps
    allocs = sum(1 for e in events if e.name == "[memory]" and e.cpu_memory_usage > 0)
    return {
        "wall_ms": wall * 1e3,
        "profiled_ms": profiled * 1e3,
        "aten_ms": aten_s * 1e3,
        "top_ops": len(top) / steps,
        "all_ops": len(ops) / steps,
        "allocations": allocs / steps,
        "syncs": sum(1 for e in ops if e.name in SYNC_OPS) / steps,
        "heaviest": sorted(self_by_op.items(), key=lambda kv: -kv[1])[:10],
    }


def report(name: str, m: dict) -> list[str]:
    other = m["profiled_ms"] - m["aten_ms"]
    lines = [f"{name}: step {m['wall_ms']:.2f} ms; profiled {m['profiled_ms']:.2f} ms = ATen ops "
             f"{m['aten_ms']:.2f} ms + outside ops {other:.2f} ms ({other / m['profiled_ms']:.0%}); per step "
             f"{m['top_ops']:.0f} top-level op calls ({m['all_ops']:.0f} with nested), {m['allocations']:.0f} "
             f"allocations, {m['syncs']:.0f} item/nonzero calls"]
    lines.append("  heaviest ops (self ms/step): " + ", ".join(f"{k[6:]} {v * 1e3:.2f}" for k, v in m["heaviest"]))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the weights' dtype (bfloat16: the engine's mixed precision, state in fp32)")
    ap.add_argument("--before", default=None, help="a folder holding another checkout as `clover_batch`")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two sides (the best wall counts)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the child's output
    args = ap.parse_args()
    if args.json:
        print(json.dumps(measure(args.threads, args.rows, args.prompt, args.steps, args.dtype)))
        return
    sides: dict[str, list[dict]] = {"now": []}
    if args.before:
        sides["before"] = []
    for _ in range(args.rounds):
        for name in sides:
            env = dict(os.environ)
            if name == "before":
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.before, env.get("PYTHONPATH")]))
            cmd = [sys.executable, __file__, "--json", "--threads", str(args.threads), "--rows", str(args.rows),
                   "--prompt", str(args.prompt), "--steps", str(args.steps), "--dtype", args.dtype]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            sides[name].append(json.loads(out.strip().splitlines()[-1]))
    print(f"16-row autoregressive decode step, bench-ar preset, {args.dtype}, {args.threads} threads, prompts of "
          f"{args.prompt} tokens; median of {args.steps} steps, best of {args.rounds} processes per side")
    best = {name: min(runs, key=lambda m: m["wall_ms"]) for name, runs in sides.items()}
    for name in ("before", "now"):
        if name in best:
            print("\n".join(report(name, best[name])))
    if "before" in best:
        print(f"step time before / now: {best['before']['wall_ms'] / best['now']['wall_ms']:.2f}x")


if __name__ == "__main__":
    main()
