"""Decode throughput: autoregressive vs block diffusion (fixed tokens per step), and ours vs transformers' generate.

    python bench/decode.py                       # bench preset, batch 1 and 8, k = 2, 4, 8
    python bench/decode.py --threads 2 --new-tokens 128 --prompt-tokens 256

One run, same weights everywhere: `bench` (diffusion, block 32) and `bench-ar` (the same shape and seed without the
diffusion config) are loaded with seed 0; `bench-ar` is saved with `save_checkpoint` and loaded back by
transformers' `Qwen3_5MoeForCausalLM`. Stop tokens are switched off so every sequence generates exactly
--new-tokens tokens (random weights would otherwise stop at arbitrary points).

Decode time is measured the same way for every engine: wall time of a run generating --new-tokens minus the wall
time of the same call generating one token (that difference is pure decoding: same prefill, same setup), over
(--new-tokens - 1) tokens per sequence. Each cell is the best of --reps runs.

Before timing, greedy autoregressive output of ours and of transformers is checked to be token-identical.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import torch
from clover_batch.model import generate, kernels, load_model, save_checkpoint

log = logging.getLogger("bench.decode")


def best_of(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_seconds(run, new_tokens: int, reps: int) -> float:
    """Seconds spent decoding new_tokens - 1 tokens: run(new_tokens) - run(1), each best of reps."""
    run(1)  # warm-up
    return best_of(lambda: run(new_tokens), reps) - best_of(lambda: run(1), reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="bench", help="diffusion preset; its autoregressive twin is PRESET-ar")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8], help="diffusion tokens_per_step")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-reference", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        kernels.model_threads(args.threads)
    log.info("torch %s, %d threads, load average %s", torch.__version__, torch.get_num_threads(),
             " ".join(f"{x:.1f}" for x in os.getloadavg()))

    diffusion = load_model(args.preset, seed=0)
    ar = load_model(f"{args.preset}-ar", seed=0)
    cfg = diffusion.config
    assert cfg.diffusion is not None and ar.config.diffusion is None
    gen = torch.Generator().manual_seed(0)
    prompts = {B: torch.randint(0, 256, (B, args.prompt_tokens), generator=gen).tolist() for B in args.batches}
    N = args.new_tokens

    def ours(model, B: int, **options):
        def run(n: int):
            return generate(model, prompts[B], max_new_tokens=n, stop_token_ids=[], **options)
        return run

    theirs = None
    if not args.skip_reference:
        from transformers import Qwen3_5MoeForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(ar, tmp)
            theirs = Qwen3_5MoeForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        prompt = prompts[args.batches[0]][:1]
        with torch.no_grad():
            ids = torch.tensor(prompt)
            ref = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt[0]):].tolist()
        got = generate(ar, prompt, max_new_tokens=32, stop_token_ids=[])[0].tokens
        if got != ref:
            raise SystemExit("greedy autoregressive output differs from transformers' generate; not timing")
        log.info("greedy autoregressive tokens identical to transformers' generate (32 tokens)")

    def hf(B: int):
        ids = torch.tensor(prompts[B])

        def run(n: int):
            with torch.no_grad():  # explicit mask: without one, generate takes prompt ids equal to pad for padding
                return theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
        return run

    rows = []  # (batch, engine, seconds, tokens per forward)
    for B in args.batches:
        cells = [("ours autoregressive", ours(ar, B), 1.0)]
        for k in args.ks:
            cells.append((f"ours diffusion k={k}", ours(diffusion, B, tokens_per_step=k), None))
        if theirs is not None:
            cells.append(("transformers generate", hf(B), 1.0))
        for name, run, per_forward in cells:
            seconds = decode_seconds(run, N, args.reps)
            if per_forward is None:
                g = run(N)[0]
                per_forward = len(g.tokens) / g.denoising_steps
            rows.append((B, name, seconds, per_forward))
            log.info("batch %d %-22s %.2f s", B, name, seconds)

    lines = ["", f"decode, {args.preset} preset ({cfg.parameter_counts()[0] / 1e6:.1f}M params, "
             f"{cfg.parameter_counts()[1] / 1e6:.1f}M active), block {cfg.diffusion.block_size}, prompt "
             f"{args.prompt_tokens} tokens, {N} new tokens per sequence, fp32, {torch.get_num_threads()} threads",
             f"{'batch':>5} {'engine':24} {'tokens/s':>9} {'tok/step':>8} {'vs our AR':>9} {'vs HF':>7}"]
    for B in args.batches:
        cell = {name: s for b, name, s, _ in rows if b == B}
        for b, name, seconds, per_forward in rows:
            if b != B:
                continue
            rate = B * (N - 1) / seconds
            vs_ar = cell["ours autoregressive"] / seconds
            vs_hf = f"{cell['transformers generate'] / seconds:6.2f}x" if "transformers generate" in cell else "-"
            lines.append(f"{B:5d} {name:24} {rate:9.1f} {per_forward:8.2f} {vs_ar:8.2f}x {vs_hf:>7}")
    print("\n".join(lines))  # the report is this script's output


if __name__ == "__main__":
    main()
