"""Prefill throughput of our forward vs transformers' Qwen3_5MoeForCausalLM on the same weights, side by side.

    python bench/forward.py                     # bench preset, 2K and 8K tokens, fp32 and bf16
    python bench/forward.py --tokens 2048 --reps 3 --threads 2

One run: the `bench` preset is saved with `save_checkpoint` and loaded back by transformers' `from_pretrained`; the
logits of both are checked to agree before anything is timed. Both run the same work: causal attention (the
reference is autoregressive), one sequence, logits for the last position only (`keep_logits=1` /
`logits_to_keep=1`, what prefill needs). Reported per (dtype, tokens): median seconds over --reps, tokens/s, the
ratio ours/theirs, and achieved GFLOP/s: FLOPs of the active parameters (2 per weight per token, routed experts at
top-k), causal attention (QK^T and PV) and the chunked GDN kernel, against plain fp32 and bf16 matmuls measured in
the same run.

The reference in bf16 on a CPU without bf16 matmul units runs its GEMMs at the plain bf16 matmul rate (often about
1 GFLOP/s on AVX2), so it gets one timed rep and only up to --ref-bf16-max-tokens; skipped cells say so.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

import torch
from clover_batch.model import CloverConfig, load_model, save_checkpoint

log = logging.getLogger("bench.forward")


def forward_flops(cfg: CloverConfig, T: int, keep_logits: int = 1, chunk: int = 64) -> float:
    """FLOPs of one causal prefill of T tokens (matmul-like work only; norms and activations are not counted)."""
    active = cfg.parameter_counts()[1]
    embed = cfg.vocab_size * cfg.hidden_size
    lm_head = 0 if cfg.tie_word_embeddings else embed
    per_token = active - embed - lm_head  # the embedding is a lookup; lm_head only runs for kept positions
    flops = 2.0 * per_token * T + 2.0 * keep_logits * cfg.hidden_size * cfg.vocab_size
    n_attn = sum(kind == "full_attention" for kind in cfg.layer_types)
    flops += n_attn * 2 * 2.0 * cfg.num_attention_heads * cfg.head_dim * T * (T + 1) / 2  # QK^T and PV, causal
    C, K, V, H = chunk, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    n_chunks = -(-T // C)
    # per chunk and head: KK^T, QK^T (2C^2K each), two triangular solves (C^2V + C^2K), intra-chunk QK V' (2C^2V),
    # and three [C,K]x[K,V]-sized products with the state (6CKV)
    per_chunk = 5 * C * C * K + 3 * C * C * V + 6 * C * K * V
    flops += (cfg.num_hidden_layers - n_attn) * H * n_chunks * per_chunk
    return flops


def matmul_gflops(dtype: torch.dtype, n: int = 2048, k: int = 512, budget_s: float = 2.0) -> float:
    """Plain [n, k] x [k, n] matmul rate in this process (same threads, same moment)."""
    a, b = torch.randn(n, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    reps, start = 0, time.perf_counter()
    while True:
        a @ b
        reps += 1
        elapsed = time.perf_counter() - start
        if elapsed > budget_s or reps >= 20:
            return 2.0 * n * k * n * reps / elapsed / 1e9


def time_it(fn, reps: int) -> float:
    """Median seconds of `reps` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_dtype(args, dtype: torch.dtype, tmp: str, reference_cls) -> tuple[CloverConfig, list[tuple]]:
    """Rows (tokens, our seconds, reference seconds or None, FLOPs, note) for one dtype."""
    ours = load_model(args.preset, dtype=dtype, seed=0)
    cfg = ours.config
    save_checkpoint(ours, tmp)
    theirs = None
    if not args.skip_reference:
        theirs = reference_cls.from_pretrained(tmp, dtype=dtype).eval()
        check = torch.randint(0, cfg.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref_logits = theirs(input_ids=check, use_cache=False).logits
        our_logits, _ = ours(check, attention="causal")
        if dtype == torch.float32:
            err = float((our_logits - ref_logits).abs().max())
            log.info("%s: logits agree with the reference: max |diff| %.2e (tolerance 1e-4)", dtype, err)
            if not err <= 1e-4:
                raise SystemExit(f"{dtype}: our logits differ from the reference by {err:.3e}; not timing")
        else:
            # Two bf16 implementations round differently; each is judged against fp32 on the same (bf16) weights.
            exact, _ = load_model(tmp, dtype=torch.float32)(check, attention="causal")
            ours_err = float((our_logits.float() - exact).abs().mean())
            ref_err = float((ref_logits.float() - exact).abs().mean())
            log.info("%s: mean |logit error| vs fp32 on the same weights: ours %.3e, reference %.3e (mean |logit| "
                     "%.3f)", dtype, ours_err, ref_err, float(exact.abs().mean()))
            if not ours_err <= 1.25 * ref_err:
                raise SystemExit(f"{dtype}: our logits are further from fp32 than the reference's; not timing")

    def ours_call(ids: torch.Tensor) -> None:
        ours(ids, attention="causal", keep_logits=1)

    def ref_call(ids: torch.Tensor) -> None:
        with torch.no_grad():
            theirs(input_ids=ids, use_cache=False, logits_to_keep=1)

    rows = []
    for T in args.tokens:
        ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
        t_ours = time_it(lambda ids=ids: ours_call(ids), args.reps)
        t_ref, note = None, ""
        if theirs is not None:
            if dtype == torch.bfloat16 and T > args.ref_bf16_max_tokens:
                note = f"reference skipped (bf16 > {args.ref_bf16_max_tokens} tokens)"
            elif dtype == torch.bfloat16:
                start = time.perf_counter()
                ref_call(ids)
                t_ref, note = time.perf_counter() - start, "reference: 1 rep, no warm-up"
            else:
                t_ref = time_it(lambda ids=ids: ref_call(ids), args.reps)
        rows.append((T, t_ours, t_ref, forward_flops(cfg, T), note))
        log.info("%s T=%d: ours %.2f s%s", dtype, T, t_ours, "" if t_ref is None else f", reference {t_ref:.2f} s")
    return cfg, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=2, help="timed reps per cell (median), after one warm-up")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--ref-bf16-max-tokens",
        type=int,
        default=2048,
        help="longest sequence the bf16 reference is timed at (one rep, no warm-up)",
    )
    parser.add_argument("--skip-reference", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import Qwen3_5MoeForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    log.info(
        "torch %s, %d threads, load average %s",
        torch.__version__,
        torch.get_num_threads(),
        " ".join(f"{x:.1f}" for x in os.getloadavg()),
    )
    # bf16 on a small square: at ~0.1-1 GFLOP/s a 2048-row product alone would take most of a minute
    mm = {"float32": matmul_gflops(torch.float32), "bfloat16": matmul_gflops(torch.bfloat16, n=256, k=512)}
    log.info("plain matmul: fp32 2048x512x2048 %.1f GFLOP/s, bf16 256x512x256 %.1f GFLOP/s", mm["float32"],
             mm["bfloat16"])

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dt_name in args.dtypes:
            cfg, dt_rows = bench_dtype(args, getattr(torch, dt_name), tmp, Qwen3_5MoeForCausalLM)
            rows += [(dt_name, *row) for row in dt_rows]

    header = (
        f"{'dtype':9} {'tokens':>6} {'ours tok/s':>11} {'ref tok/s':>10} {'ratio':>6} {'ours GFLOP/s':>13} "
        f"{'% fp32 mm':>9} {'% bf16 mm':>9}  note"
    )
    lines = [
        "",
        f"prefill, {args.preset} preset ({cfg.parameter_counts()[0] / 1e6:.1f}M params, "
        f"{cfg.parameter_counts()[1] / 1e6:.1f}M active), causal, batch 1, median of {args.reps}",
        header,
    ]
    for dt_name, T, t_ours, t_ref, flops, note in rows:
        ref_tps = "-" if t_ref is None else f"{T / t_ref:10.0f}"
        ratio = "-" if t_ref is None else f"{t_ref / t_ours:5.2f}x"
        gflops = flops / t_ours / 1e9
        lines.append(
            f"{dt_name:9} {T:6d} {T / t_ours:11.0f} {ref_tps:>10} {ratio:>6} {gflops:13.1f} "
            f"{100 * gflops / mm['float32']:8.0f}% {100 * gflops / mm['bfloat16']:8.0f}%  {note}"
        )
    lines.append(f"plain matmul in this run: fp32 {mm['float32']:.1f} GFLOP/s, bf16 {mm['bfloat16']:.1f} GFLOP/s")
    print("\n".join(lines))  # the report is this script's output


if __name__ == "__main__":
    main()
