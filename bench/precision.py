"""bf16 against fp32 on this machine's CPU, side by side in one run (issue 34): speed, the decode step against its
memory floor, and whether the demo's answers stay the same.

    python bench/precision.py --threads 2                      # every part
    python bench/precision.py --parts speed --reps 3

Parts:
- speed: the engine on the bench preset (random weights, rounded to bf16 so both sides hold the same values) in
  fp32 and in bf16, taking turns rep by rep, best of --reps: prefill of 16 prompts of 512 tokens (tokens/s of the
  prefill steps), and autoregressive decode at 16 sequences (tokens/s of the decode steps, 64 new tokens after 256
  prompt tokens); then transformers' Qwen3.5-MoE on the same weights in bf16, prefill (one forward over the
  batch) and `generate` at 16 (decode time = run(n) - run(1)).
- floor: a decode step at 16 sequences cannot beat (bytes of weights it reads) / (read bandwidth). Bandwidth is
  measured here (sum over a 1 GiB tensor, best of 5); the bytes are every weight the step reads, with the experts
  its 16 rows route to counted from the router's choices on the step's real inputs. The ratio step / floor, fp32
  and bf16.
- demo: the trained demo checkpoint (jobs/examples/demo) on held-out documents, both example tasks, greedy
  autoregressive decoding in fp32 and in bf16: how many of the first 32 tokens agree position by position, and
  the extraction fields exact under each.
- gdn: the chunked GDN kernel's GEMMs with bf16 operands (as fla's kernels on a GPU; ops.py) against the same
  kernel with fp32 operands (before issue 34's change), inside the bf16 engine's prefill of 16 prompts of 512
  tokens, the two taking turns for 2 x --reps rounds in one process: prefill seconds, best of each. (The fp32
  side is selected by replacing `ops._gemm_dtype` for the run.)
- job: the demo summarize job end to end (jobs/examples/summarize-local.yaml, local Ray, --docs fresh documents of
  bench/demo_jobs.py) with model.dtype auto and float32, taking turns for --reps rounds: wall time, output tokens
  per second of the run and of its infer stage, and what auto chose (the run report's kernels line).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from clover_batch.model import DecodeOptions, Engine, Request, generate, kernels, load_model, save_checkpoint
from clover_batch.model.precision import bf16_twin

log = logging.getLogger("bench.precision")


def _engine_run(model, prompts: list[list[int]], new: int) -> Engine:
    engine = Engine(model, DecodeOptions(mode="autoregressive", max_new_tokens=new, stop_token_ids=()),
                    max_slots=len(prompts))
    for i, p in enumerate(prompts):
        engine.add(Request(str(i), p))
    while engine.has_work:
        engine.step()
    return engine


def part_speed(args) -> list[str]:
    f32, b16 = bf16_twin(f"{args.preset}-ar")
    gen = torch.Generator().manual_seed(1)
    long_prompts = torch.randint(3, 256, (16, 512), generator=gen).tolist()
    short_prompts = torch.randint(3, 256, (16, 256), generator=gen).tolist()
    new = 64
    best: dict[str, dict[str, float]] = {"fp32": {}, "bf16": {}}
    for _ in range(args.reps):
        for name, model in (("fp32", f32), ("bf16", b16)):  # the sides take turns
            e = _engine_run(model, long_prompts, 1)
            pre = e.stats.prefill_tokens / e.stats.prefill_seconds
            e1 = _engine_run(model, short_prompts, 1)
            eN = _engine_run(model, short_prompts, new)
            dec = 16 * (new - 1) / max(1e-9, eN.stats.decode_seconds - e1.stats.decode_seconds)
            for key, value in (("prefill", pre), ("decode", dec)):
                best[name][key] = max(best[name].get(key, 0.0), value)
    lines = [f"ours, {args.preset} preset (autoregressive twin), same bf16-rounded weights, best of {args.reps}:",
             f"  prefill (16 x 512 tokens): fp32 {best['fp32']['prefill']:.0f} tok/s, bf16 "
             f"{best['bf16']['prefill']:.0f} tok/s: bf16 {best['bf16']['prefill'] / best['fp32']['prefill']:.2f}x",
             f"  decode at 16 (256-token prompts, {new} new): fp32 {best['fp32']['decode']:.1f} tok/s, bf16 "
             f"{best['bf16']['decode']:.1f} tok/s: bf16 {best['bf16']['decode'] / best['fp32']['decode']:.2f}x"]
    lines += _transformers_bf16(b16, long_prompts, short_prompts, new, best["bf16"], args.reps)
    return lines


def _transformers_bf16(ours, long_prompts, short_prompts, new, ours_best, reps) -> list[str]:
    from transformers import Qwen3_5MoeForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(ours, tmp)
        theirs = Qwen3_5MoeForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).eval()
    long_ids, short_ids = torch.tensor(long_prompts), torch.tensor(short_prompts)

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            theirs.generate(short_ids, attention_mask=torch.ones_like(short_ids), max_new_tokens=n,
                            min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - t0

    pre_s, dec = float("inf"), 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        with torch.no_grad():
            theirs(input_ids=long_ids, logits_to_keep=1)
        pre_s = min(pre_s, time.perf_counter() - t0)
        dec = max(dec, 16 * (new - 1) / max(1e-9, gen(new) - gen(1)))
    pre = long_ids.numel() / pre_s
    return [f"transformers Qwen3_5MoeForCausalLM, bf16, same weights: prefill {pre:.0f} tok/s (ours "
            f"{ours_best['prefill'] / pre:.2f}x), generate at 16 {dec:.1f} tok/s "
            f"(ours {ours_best['decode'] / dec:.2f}x)"]


def _bandwidth() -> float:
    x = torch.ones(2**28, dtype=torch.float32)  # 1 GiB
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def _weight_bytes(model) -> tuple[int, int]:
    """(bytes of every weight outside the routed experts, bytes of one routed expert in one layer)."""
    dense = expert = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            expert += p.numel() * p.element_size()
        else:
            dense += p.numel() * p.element_size()
    layers = len(model.config.layer_types)
    return dense, expert // (layers * model.config.num_experts)


def part_floor(args) -> list[str]:
    from clover_batch.model import moe

    f32, b16 = bf16_twin(f"{args.preset}-ar")
    bw = _bandwidth()
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, 256, (16, 256), generator=gen).tolist()
    lines = [f"decode step at 16 sequences against its floor (read bandwidth measured: {bw / 1e9:.1f} GB/s):"]
    original = moe.route
    for name, model in (("fp32", f32), ("bf16", b16)):
        touched: list[int] = []  # distinct experts of each routing call with 16 rows (one layer of a decode step)

        def spy(x_ND, *rest, _touched=touched, **kw):
            routing = original(x_ND, *rest, **kw)
            if x_ND.shape[0] == 16:
                _touched.append(int(routing.experts.unique().numel()))
            return routing

        moe.route = spy
        try:
            _engine_run(model, prompts, 9)
        finally:
            moe.route = original
        layers = len(model.config.layer_types)
        per_layer = sum(touched) / len(touched)
        dense, one_expert = _weight_bytes(model)
        floor = (dense + per_layer * layers * one_expert) / bw
        e1 = _engine_run(model, prompts, 1)
        step = min((_engine_run(model, prompts, 33).stats.decode_seconds - e1.stats.decode_seconds) / 32
                   for _ in range(args.reps))
        lines.append(f"  {name}: step {step * 1e3:.2f} ms, floor {floor * 1e3:.2f} ms ({per_layer:.1f} of "
                     f"{model.config.num_experts} experts a layer read), step / floor {step / floor:.2f}x")
    return lines


def part_demo(args) -> list[str]:
    from clover_batch.jobs.demo_corpus import held_out
    from clover_batch.jobs.demo_model import DEMO_DIR, PairMaker, field_matches, job_instructions

    model_dir = Path(args.model) if args.model else DEMO_DIR
    maker = PairMaker(model_dir, job_instructions())
    docs = held_out(args.docs)
    prompts = [maker.prompt(d, t) for d in docs for t in ("extract", "summarize")]
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = load_model(model_dir, dtype=dtype)
        gens = []
        for i in range(0, len(prompts), 8):
            gens += generate(model, prompts[i:i + 8], mode="autoregressive", max_new_tokens=96)
        out[name] = [g.tokens for g in gens]
    agree = total = same = 0
    for a, b in zip(out["fp32"], out["bf16"], strict=True):
        n = max(min(32, len(a)), min(32, len(b)))
        agree += sum(1 for i in range(n) if i < len(a) and i < len(b) and a[i] == b[i])
        total += n
        same += a == b
    fields = {}
    for name in out:
        hits = cells = 0
        for d, toks in zip(docs, out[name][0::2], strict=True):
            m = field_matches(maker.builder.decode(toks), d)
            hits += sum(m.values())
            cells += len(m)
        fields[name] = hits / cells
    return [f"demo checkpoint {model_dir}, {args.docs} held-out documents x 2 tasks, greedy autoregressive:",
            f"  first 32 tokens agreeing position by position, bf16 vs fp32: {agree}/{total} ({agree / total:.1%}); "
            f"whole outputs identical {same}/{len(prompts)}",
            f"  extraction fields exact: fp32 {fields['fp32']:.1%}, bf16 {fields['bf16']:.1%}"]


def part_job(args) -> list[str]:
    import os
    import sys

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from clover_batch.jobs.demo_model import SUMMARIZE_JOB
    from clover_batch.jobs.runner import run
    from clover_batch.jobs.spec import load_job
    from demo_jobs import fresh_documents

    runs: dict[str, list] = {"auto": [], "float32": []}
    with tempfile.TemporaryDirectory(prefix="precision-job-") as tmp:
        fresh_documents(Path(tmp) / "docs", args.docs)
        for rep in range(args.reps):
            for dtype in runs:  # the sides take turns
                spec = load_job(str(SUMMARIZE_JOB), [f"input.uri={tmp}/docs", f"output.uri={tmp}/{dtype}-{rep}",
                                                     f"model.dtype={dtype}"])
                report = run(spec).report
                infer = report.stage_seconds.get("infer", 0.0)
                runs[dtype].append((report.wall_seconds, report.output_tokens, infer, report.kernels,
                                    dict(report.by_status)))
    lines = [f"the demo summarize job end to end, {args.docs} fresh documents, {args.reps} rounds taking turns:"]
    best = {}
    for dtype, rs in runs.items():
        wall, tokens, infer, kernels_line, statuses = min(rs)
        best[dtype] = wall
        lines.append(f"  {dtype:8s} wall {', '.join(f'{r[0]:.1f}' for r in rs)} s (best {wall:.1f}); {tokens} output "
                     f"tokens, {tokens / wall:.1f} tok/s of the run, {tokens / max(infer, 1e-9):.1f} per infer-stage "
                     f"second (summed over documents); rows {statuses}; {'; '.join(kernels_line)}")
    lines.append(f"  auto / float32 wall time: {best['auto'] / best['float32']:.2f}")
    return lines


def part_gdn(args) -> list[str]:
    from clover_batch.model import ops

    _, b16 = bf16_twin(f"{args.preset}-ar")
    prompts = torch.randint(3, 256, (16, 512), generator=torch.Generator().manual_seed(1)).tolist()
    sides = {"bf16 GEMMs": ops._gemm_dtype, "fp32 GEMMs": lambda v: torch.float32}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    try:
        _engine_run(b16, prompts, 1)  # warm-up
        for _ in range(2 * args.reps):
            for name, choose in sides.items():
                ops._gemm_dtype = choose
                seconds[name].append(_engine_run(b16, prompts, 1).stats.prefill_seconds)
    finally:
        ops._gemm_dtype = sides["bf16 GEMMs"]
    best = {name: min(v) for name, v in seconds.items()}
    return [f"chunked GDN kernel in the bf16 engine's prefill (16 x 512 tokens, {args.preset}-ar preset), best of "
            f"{2 * args.reps}:"] + [f"  {name}: {best[name]:.2f} s ({', '.join(f'{x:.2f}' for x in v)})"
                                    for name, v in seconds.items()] + [
        f"  fp32 / bf16 GEMMs: {best['fp32 GEMMs'] / best['bf16 GEMMs']:.2f}x"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["speed", "floor", "demo"],
                    choices=["speed", "floor", "demo", "gdn", "job"])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", help="checkpoint folder for the demo part (default: the demo checkpoint)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    kernels.model_threads(args.threads)
    print(json.dumps({"threads": args.threads, "kernels": kernels.describe()}))
    parts = {"speed": part_speed, "floor": part_floor, "demo": part_demo, "gdn": part_gdn, "job": part_job}
    for part in args.parts:
        for line in parts[part](args):
            print(line, flush=True)


if __name__ == "__main__":
    main()
