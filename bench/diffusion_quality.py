"""Quality and speed of block-diffusion decoding on the trained `demo` checkpoint, per decoding mode.

    python bench/diffusion_quality.py                          # 100 held-out documents, all modes, 2 threads
    python bench/diffusion_quality.py --docs 40 --modes t0.9 k1 --threads 1

On held-out synthetic documents (jobs/demo_corpus.py, seeds never used in training), both example tasks are run
with the example jobs' own prompts, for thresholds 0.95, 0.9, 0.7, 0.5 and fixed k = 1, 2, 4, 8 tokens per step:

- extraction: field exact match (the answer checked as the pipeline checks it, each field compared with the
  document's value; a refused answer matches no field) and whole-answer exact match;
- summary: exact match and token-level similarity with the target (1 - token edit distance / longer length);
- tokens per step (denoising steps) and per decode forward (Generation.decode_forwards: steps + block commits; the
  engine commits a finished block in the next step's forward, one forward per row either way; verified: preview,
  check and commit forwards), decode tokens/s: tokens generated / wall time of the engine's decode steps (prefill
  excluded; the same batches of --batch documents for every mode), and wall seconds per document (prefill and
  decode, both tasks);
- logp: the outputs' mean log-probability per token under the model's causal trunk (Generation.mean_logprob,
  token-weighted), for models whose causal logits score the next token (logits_shift: Clover's layout).

Baselines: k = 1 on the same model and engine (one token filled per denoising step, left to right by confidence),
and, for a model whose causal trunk scores the next token, `ar`: its trunk decoding one token per forward
(`DecodeOptions.mode="autoregressive"`), the exact model that diffusion decoding approximates; a model that
predicts each position from itself (logits_shift false) has no such trunk, and `ar` is skipped for it.

`verified` (`mode="verified"`, drafts at threshold 0.9; `ver-t0.7` at 0.7, `ver-kN` N positions per preview step,
`ver-k16` the whole block in one preview) must give `ar`'s outputs token for token: the report says how many of its
outputs equal `ar`'s, its tokens verified per check (a round: previews and one check) and its share of checks
that rejected no drafted token.

Long documents: held-out documents whose facts all lie more than `window_tokens` before the answer (the attention
window cannot see them; only the carried Gated DeltaNet state can) are scored separately.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass, field

import torch
from clover_batch.jobs.demo_corpus import Document, held_out, held_out_long
from clover_batch.jobs.demo_model import (
    DEMO_DIR,
    EXTRACT_FIELDS,
    PairMaker,
    field_matches,
    job_instructions,
    token_similarity,
)
from clover_batch.model import generate, kernels, load_model

log = logging.getLogger("bench.diffusion_quality")

MODES = {"ar": {"mode": "autoregressive"},
         "t0.95": {"threshold": 0.95}, "t0.9": {"threshold": 0.9}, "t0.7": {"threshold": 0.7},
         "t0.5": {"threshold": 0.5}, "k1": {"tokens_per_step": 1}, "k2": {"tokens_per_step": 2},
         "k4": {"tokens_per_step": 4}, "k8": {"tokens_per_step": 8},
         "verified": {"mode": "verified", "threshold": 0.9}, "ver-t0.7": {"mode": "verified", "threshold": 0.7},
         "ver-k4": {"mode": "verified", "tokens_per_step": 4}, "ver-k8": {"mode": "verified", "tokens_per_step": 8},
         "ver-k16": {"mode": "verified", "tokens_per_step": 16}}
# modes whose output is the causal trunk's greedy output
EXACT = ("ar", "verified", "ver-t0.7", "ver-k4", "ver-k8", "ver-k16")


@dataclass
class Tally:
    fields_ok: int = 0
    fields: int = 0
    answers_ok: int = 0
    answers: int = 0
    similarity: float = 0.0
    tokens: int = 0
    steps: int = 0
    decode_forwards: int = 0
    decode_seconds: float = 0.0
    long_fields_ok: int = 0
    long_fields: int = 0
    per_field: dict[str, int] = field(default_factory=dict)
    logprob: float = 0.0  # summed over the tokens of generations that have a mean_logprob
    scored: int = 0
    wall_seconds: float = 0.0  # generate() calls, prefill and decode
    outputs: list[list[int]] = field(default_factory=list)
    blocks: int = 0  # verified: checks, tokens they verified, checks that rejected no drafted token
    accepted: int = 0
    full_blocks: int = 0


def logp(*tallies: Tally) -> str:
    scored = sum(t.scored for t in tallies)
    return f"{sum(t.logprob for t in tallies) / scored:.3f}" if scored else "-"


def beyond_window(maker: PairMaker, doc: Document, task: str, window: int) -> bool:
    """Whether all of the document's facts lie more than `window` tokens before the answer's first position."""
    prompt = maker.prompt(doc, task)
    after_facts = maker.builder.encode(doc.text[doc.facts_end:], specials=False)
    return len(after_facts) > window and len(prompt) > window


def run_mode(model, maker: PairMaker, docs: list[Document], task: str, options: dict, batch: int,
             max_new_tokens: int, merge_commits: bool = False) -> Tally:
    cfg = model.config
    tally = Tally(per_field=dict.fromkeys(EXTRACT_FIELDS, 0))
    for start in range(0, len(docs), batch):
        part = docs[start:start + batch]
        prompts = [maker.prompt(d, task) for d in part]
        t0 = time.perf_counter()
        gens = generate(model, prompts, max_new_tokens=max_new_tokens, temperature=0.0,
                        merge_commits=merge_commits, **options)
        tally.wall_seconds += time.perf_counter() - t0
        # each sequence's decode_seconds is its share of the decode steps it took part in: their sum is the
        # batch's decode wall time (prefill steps excluded)
        tally.decode_seconds += sum(g.decode_seconds for g in gens)
        for doc, g in zip(part, gens, strict=True):
            tally.outputs.append(g.tokens)
            tally.blocks += g.verified_blocks
            tally.accepted += g.accepted_tokens
            tally.full_blocks += g.full_blocks
            if g.mean_logprob is not None:
                tally.logprob += g.mean_logprob * len(g.tokens)
                tally.scored += len(g.tokens)
            tally.tokens += len(g.tokens)
            tally.steps += g.denoising_steps
            tally.decode_forwards += g.decode_forwards
            text = maker.builder.decode(g.tokens)
            tally.answers += 1
            if task == "extract":
                matches = field_matches(text, doc)
                tally.fields += len(matches)
                tally.fields_ok += sum(matches.values())
                tally.answers_ok += all(matches.values())
                for name, ok in matches.items():
                    tally.per_field[name] += ok
                if beyond_window(maker, doc, task, cfg.window_tokens):
                    tally.long_fields += len(matches)
                    tally.long_fields_ok += sum(matches.values())
            else:
                target = maker.builder.encode(doc.summary, specials=False)
                tally.similarity += token_similarity(g.tokens, target)
                tally.answers_ok += text == doc.summary
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEMO_DIR), help="checkpoint folder (default: the demo checkpoint)")
    parser.add_argument("--docs", type=int, default=100, help="held-out documents per task")
    parser.add_argument("--batch", type=int, default=4, help="documents decoded together (the example jobs' 4)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="compute dtype (the example jobs' model.dtype auto is bfloat16 on a CPU with bf16 units)")
    parser.add_argument("--long-only", action="store_true",
                        help="the first --docs held-out documents that are long (facts, then more than a window of "
                             "log), in held-out order: the documents only the carried GDN state can answer")
    parser.add_argument("--merge-commits", action="store_true",
                        help="commit a finished block in the forward of the next block's first step, as the engine "
                             "does on CUDA (on a CPU that forward costs about twice as much)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kernels.model_threads(args.threads)
    load_before = os.getloadavg()

    model = load_model(args.model, dtype=getattr(torch, args.dtype))
    maker = PairMaker(args.model, job_instructions())
    docs = held_out_long(args.docs) if args.long_only else held_out(args.docs)
    window = model.config.window_tokens
    n_long = sum(beyond_window(maker, d, "extract", window) for d in docs)
    log.info("%d held-out documents (%d with every fact more than the %d-token window before the answer), "
             "batch %d, %d threads, load average %s", len(docs), n_long, window, args.batch, args.threads,
             " ".join(f"{x:.1f}" for x in load_before))
    generate(model, [maker.prompt(docs[0], "summarize")], max_new_tokens=16)  # warm-up

    rows = []
    shifted = model.config.diffusion.logits_shift
    for name in args.modes:
        if name in EXACT and not shifted:
            log.info("%s skipped: this model predicts each position from itself (logits_shift false): no trunk",
                     name)
            continue
        start = time.perf_counter()
        ext = run_mode(model, maker, docs, "extract", MODES[name], args.batch, args.max_new_tokens,
                       args.merge_commits)
        summ = run_mode(model, maker, docs, "summarize", MODES[name], args.batch, args.max_new_tokens,
                        args.merge_commits)
        rows.append((name, ext, summ))
        log.info("%-6s done in %.0f s", name, time.perf_counter() - start)

    base = next((r for r in rows if r[0] == "k1"), None)
    base_rate = None
    if base is not None:
        base_rate = (base[1].tokens + base[2].tokens) / (base[1].decode_seconds + base[2].decode_seconds)
    lines = ["", f"diffusion quality, {args.model}: {len(docs)} held-out documents per task, block "
             f"{model.config.diffusion.block_size}, window {window}, batch {args.batch}, {args.dtype}, "
             f"{args.threads} threads, "
             f"{'commits merged into the next step, ' if args.merge_commits else ''}"
             f"load average before {load_before[0]:.1f}",
             f"{'mode':8} {'fields':>7} {'JSON ok':>7} {'long':>7} {'summ ==':>7} {'summ sim':>8} "
             f"{'tok/step':>8} {'tok/fwd':>7} {'tok/s':>7} {'vs k=1':>7} {'logp':>7} {'s/doc':>6}"]
    for name, ext, summ in rows:
        tokens = ext.tokens + summ.tokens
        rate = tokens / (ext.decode_seconds + summ.decode_seconds)
        long = f"{100 * ext.long_fields_ok / ext.long_fields:6.1f}%" if ext.long_fields else "-"
        lines.append(
            f"{name:8} {100 * ext.fields_ok / ext.fields:6.1f}% {100 * ext.answers_ok / ext.answers:6.1f}% "
            f"{long:>7} {100 * summ.answers_ok / summ.answers:6.1f}% {summ.similarity / summ.answers:8.3f} "
            f"{tokens / (ext.steps + summ.steps):8.2f} {tokens / (ext.decode_forwards + summ.decode_forwards):7.2f} "
            f"{rate:7.1f} {f'{rate / base_rate:6.2f}x' if base_rate else '-':>7} {logp(ext, summ):>7} "
            f"{(ext.wall_seconds + summ.wall_seconds) / ext.answers:6.2f}")
    lines.append("fields: extraction field exact match; JSON ok: every field right; long: field exact match on the "
                 f"{n_long} documents whose facts are all beyond the window; summ ==: summary exact match; summ sim: "
                 "token similarity; tok/fwd: tokens per decode forward (steps + commits); tok/s: decode tokens/s; "
                 "logp: mean log-probability per output token under the causal trunk; s/doc: wall seconds per "
                 "document, both tasks")
    ar = next((r for r in rows if r[0] == "ar"), None)
    for name, ext, summ in rows:
        blocks = ext.blocks + summ.blocks
        if not blocks:
            continue
        same = ""
        if ar is not None:
            pairs = zip(ar[1].outputs + ar[2].outputs, ext.outputs + summ.outputs, strict=True)
            same = f", outputs equal to ar's: {sum(a == b for a, b in pairs)}/{len(ext.outputs) + len(summ.outputs)}"
        lines.append(f"{name}: {blocks} checks, {(ext.accepted + summ.accepted) / blocks:.2f} tokens verified per "
                     f"check, {100 * (ext.full_blocks + summ.full_blocks) / blocks:.1f}% rejected no draft{same}")
    for name, ext, _ in rows:
        lines.append(f"per field, {name}: " + ", ".join(f"{f} {100 * ext.per_field[f] / ext.answers:.0f}%"
                                                        for f in EXTRACT_FIELDS))
    print("\n".join(lines))  # the report is this script's output


if __name__ == "__main__":
    main()
