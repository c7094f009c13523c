"""Long prompts: prefill tokens/s and peak resident memory from 8K to 512K tokens with a 32K attention window.

    python bench/long_context.py                          # tiny preset, 8K 32K 128K 512K, window 32K
    python bench/long_context.py --preset bench --lengths 8192 32768 --threads 2

Each length runs in a fresh child process (so its peak RSS, `ru_maxrss`, is its own), through the real engine:
`generate(model, [prompt], max_new_tokens=1, window_tokens=W, prefill_chunk_tokens=C)`, timing the prefill the
engine reports. The child also reports its RSS just before the prefill (model loaded, prompt built), so the table
shows what the prefill itself added.

What to expect: GDN layers cost the same per token at any length, and full attention sees min(position, window)
keys. Up to the window the attention share grows with length; past it, cost per token is flat. The table prints,
beside each measured ratio to the shortest length, the ratio predicted by counting FLOPs (dense work plus
attention over the visible keys), so engine overhead shows as the gap between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
from forward import forward_flops  # bench/ is on sys.path when this script runs


def child(args) -> None:
    from clover_batch.model import generate, load_model

    torch.set_num_threads(args.threads)
    model = load_model(args.preset, seed=0)
    T = args.child
    prompt = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(T)).tolist()
    generate(model, [prompt[:args.chunk]], max_new_tokens=1, stop_token_ids=[], window_tokens=args.window,
             prefill_chunk_tokens=args.chunk)  # warm-up: first calls pay one-off costs
    rss_before = _rss_now()
    start = time.perf_counter()
    g = generate(model, [prompt], max_new_tokens=1, stop_token_ids=[], window_tokens=args.window,
                 prefill_chunk_tokens=args.chunk)[0]
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"tokens": T, "prefill_s": g.prefill_seconds, "wall_s": wall, "rss_before": rss_before,
                      "peak_rss": peak, "windows": g.windows, "forwards": g.forward_passes}))


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def windowed_flops(cfg, T: int, window: int) -> float:
    """forward_flops with attention over min(position + 1, window) keys instead of the causal T(T+1)/2."""
    n_attn = sum(kind == "full_attention" for kind in cfg.layer_types)
    per_key = n_attn * 2 * 2.0 * cfg.num_attention_heads * cfg.head_dim
    w = min(T, window)
    keys = w * (w + 1) / 2 + (T - w) * window
    return forward_flops(cfg, T) - per_key * T * (T + 1) / 2 + per_key * keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072, 524288])
    parser.add_argument("--window", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill_chunk_tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args)
        return

    from clover_batch.model import load_config

    cfg = load_config(args.preset)
    results = []
    for T in args.lengths:
        cmd = [sys.executable, __file__, "--child", str(T), "--preset", args.preset, "--window", str(args.window),
               "--chunk", str(args.chunk), "--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        r = results[-1]
        print(f"  {T} tokens: {T / r['prefill_s']:.0f} tok/s, peak RSS {r['peak_rss'] / 2**20:.0f} MiB",
              file=sys.stderr)

    base = results[0]
    base_tps = base["tokens"] / base["prefill_s"]
    base_flops = windowed_flops(cfg, base["tokens"], args.window) / base["tokens"]
    by_len = {r["tokens"]: r for r in results}
    lines = ["", f"prefill, {args.preset} preset, window {args.window}, chunk {args.chunk}, {args.threads} threads, "
             f"batch 1, fp32; each length in its own process",
             f"{'tokens':>8} {'windows':>7} {'tok/s':>8} {'vs first':>8} {'FLOP-predicted':>14} "
             f"{'RSS before MiB':>14} {'peak RSS MiB':>12} {'prefill added MiB':>17}"]
    for r in results:
        T = r["tokens"]
        tps = T / r["prefill_s"]
        predicted = base_flops / (windowed_flops(cfg, T, args.window) / T)
        lines.append(f"{T:8d} {r['windows']:7d} {tps:8.0f} {tps / base_tps:7.2f}x {predicted:13.2f}x "
                     f"{r['rss_before'] / 2**20:14.0f} {r['peak_rss'] / 2**20:12.0f} "
                     f"{(r['peak_rss'] - r['rss_before']) / 2**20:17.0f}")
    if 131072 in by_len and 524288 in by_len:
        a, b = by_len[131072], by_len[524288]
        lines.append(f"peak RSS 512K / 128K: {b['peak_rss'] / a['peak_rss']:.3f}; tok/s 512K / 128K: "
                     f"{(524288 / b['prefill_s']) / (131072 / a['prefill_s']):.2f}")
    print("\n".join(lines))  # the report is this script's output


if __name__ == "__main__":
    main()
