"""Short demo-model training runs per recipe variant, side by side: does a change make the model copy sooner?

    python bench/demo_recipes.py                                             # the recipe, 600 autoregressive steps
    python bench/demo_recipes.py base capital_space=isolate --ar-steps 800 --parallel 2 --threads 1
    python bench/demo_recipes.py base bd_ar_weight=0 --ar-steps 800 --bd-steps 200

A full `clover-batch model train-demo` run takes up to two and a half hours on 2 cores; this bench answers the
cheaper question first. Every variant trains the demo model (jobs/demo_model.py: same tokenizer recipe, corpus,
seed and data order) for --ar-steps autoregressive steps on short documents only (`short_share` 1: the facts
sit in a few hundred tokens), then --bd-steps block-diffusion steps (the recipe's phase 2, on its usual mix), and is
probed greedily:

- ar: the causal trunk decoding one token per step (`mode="autoregressive"`), what phase 1 trains;
- t0.9: block-diffusion decoding at threshold 0.9 (the example jobs' decoding), when the variant has a phase 2.

Each probe scores the copy drill (token accuracy repeating 24 held-out "Repeat the list." drills of names,
companies, amounts and dates; separators and the stop token are free: a model that copies nothing scores 12-16%)
and the extraction fields (exact match per field on 32 held-out short documents, checked as the pipeline checks
them). document_type needs no copying; date, parties, amount_eur and deadline do (a null amount or deadline is a
hit for a model that writes null, not a copy).

A variant is `base` or comma-separated `name=value` over the fields of Recipe and DemoShape (jobs/demo_model.py);
values are parsed as the field's type. Runs train in a temporary folder and keep nothing. --probe-every N also
probes during training (rows `variant @ar200`: after 200 autoregressive steps). --parallel N trains N
variants at once, each in its own process with --threads threads (on a busy 2-core machine, two one-thread runs
finish sooner than two two-thread runs one after the other).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import logging
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import torch
from clover_batch.jobs.demo_corpus import EXTRACT_FIELDS, HELD_OUT_SEEDS, copy_drill, make_document
from clover_batch.jobs.demo_model import (
    IM_END_ID,
    DemoShape,
    PairMaker,
    Recipe,
    field_matches,
    job_instructions,
    train_demo,
)
from clover_batch.model import generate, load_model

DRILLS, DOCS = 24, 32
DRILL_SEEDS = HELD_OUT_SEEDS[50_000:]  # apart from the documents held_out() and the tests draw
PROBES = {"ar": {"mode": "autoregressive"}, "t0.9": {"threshold": 0.9}}
SHORT = {"autoregressive": "ar", "block diffusion": "bd"}  # phase names in the table


def parse_variant(text: str) -> tuple[dict, dict]:
    """'base' or 'a=1,b=x' -> (Recipe overrides, DemoShape overrides); an unknown name is a ValueError."""
    recipe_fields = {f.name for f in dataclasses.fields(Recipe)}
    shape_fields = {f.name for f in dataclasses.fields(DemoShape)}
    recipe: dict = {}
    shape: dict = {}
    if text == "base":
        return recipe, shape
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in recipe_fields | shape_fields:
            raise ValueError(f"variant {text!r}: {part!r} is not name=value over a Recipe or DemoShape field "
                             f"({', '.join(sorted(recipe_fields | shape_fields))})")
        default = getattr(Recipe() if name in recipe_fields else DemoShape(), name)
        try:
            parsed = bool(int(value)) if isinstance(default, bool) else type(default)(value)
        except ValueError:
            hint = "0 or 1" if isinstance(default, bool) else f"e.g. {default!r}"
            raise ValueError(f"variant {text!r}: {name} takes a {type(default).__name__} ({hint}), "
                             f"got {value!r}") from None
        (recipe if name in recipe_fields else shape)[name] = parsed
    return recipe, shape


def probe(model, maker: PairMaker, options: dict) -> dict:
    drills = [maker.drill(copy_drill(DRILL_SEEDS[i])) for i in range(DRILLS)]
    gens = generate(model, [d.prompt for d in drills], max_new_tokens=96, temperature=0.0, **options)
    right = sum(a == b for d, g in zip(drills, gens, strict=True)
                for a, b in zip([*g.tokens, IM_END_ID], d.answer, strict=False))
    drill_acc = right / sum(len(d.answer) for d in drills)
    docs = [make_document(HELD_OUT_SEEDS[i], long=False, filler=False) for i in range(DOCS)]
    gens = generate(model, [maker.prompt(d, "extract") for d in docs], max_new_tokens=96, temperature=0.0,
                    **options)
    hits = dict.fromkeys(EXTRACT_FIELDS, 0)
    for d, g in zip(docs, gens, strict=True):
        for name, ok in field_matches(maker.builder.decode(g.tokens), d).items():
            hits[name] += ok
    steps = sum(g.denoising_steps for g in gens)
    return {"drill": drill_acc, "fields": {n: h / DOCS for n, h in hits.items()},
            "tok/step": sum(len(g.tokens) for g in gens) / max(1, steps)}


def run_variant(text: str, recipe: Recipe, shape: DemoShape, probe_every: int) -> dict:
    """Train one variant in a temporary folder and probe it (in a worker process with --parallel)."""
    logging.basicConfig(level=logging.WARNING)
    curve: list[tuple[str, int, str, dict]] = []

    def on_log(phase: str, step: int, model, maker: PairMaker) -> None:
        if probe_every and step % probe_every == 0:
            for name in ("ar", "t0.9") if phase == "block diffusion" else ("ar",):
                curve.append((phase, step, name, probe(model, maker, PROBES[name])))
                print(_row(f"{text} @{SHORT[phase]}{step}", name, {}, curve[-1][3], None), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        t0, c0 = time.perf_counter(), time.process_time()
        report = train_demo(Path(tmp), recipe, shape, on_log=on_log)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        model, maker = load_model(tmp, dtype=torch.float32), PairMaker(Path(tmp), job_instructions())
        probes = {name: probe(model, maker, options) for name, options in PROBES.items()
                  if name == "ar" or recipe.bd_steps}
    losses = {}
    for phase in report["phases"]:
        for part in ("ar", "bd"):
            if phase[part]:
                tail = phase[part][-4:]
                losses[part] = sum(tail) / len(tail)  # the last phase that has the part
    load = [x for phase in report["phases"] for x in phase["load_average"]]
    return {"probes": probes, "losses": losses, "seconds": seconds, "cpu": cpu, "load": sum(load) / len(load),
            "curve": curve}


def _row(label: str, probe_name: str, losses: dict, pr: dict, r: dict | None, width: int = 0) -> str:
    names = list(EXTRACT_FIELDS)
    fields = pr["fields"]
    loss = " ".join(f"{losses[k]:7.3f}" if k in losses else f"{'-':>7}" for k in ("ar", "bd"))
    tail = f" {r['seconds']:8.0f} {r['cpu']:7.0f} {r['load']:5.1f}" if r else ""
    return (f"{label:<{width}} {probe_name:5} {loss} {pr['drill']:6.1%} {sum(fields.values()) / len(names):6.1%} "
            + " ".join(f"{fields[n]:9.0%}" for n in names) + f" {pr['tok/step']:8.2f}" + tail)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="*", default=["base"])
    p.add_argument("--ar-steps", type=int, default=600, help="autoregressive steps (a variant may set ar_steps)")
    p.add_argument("--bd-steps", type=int, default=0, help="block-diffusion steps (a variant may set bd_steps)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parallel", type=int, default=1, help="variants trained at once, one process each")
    p.add_argument("--probe-every", type=int, default=0,
                   help="also probe during training every N steps of each phase (a multiple of 25; 0: at the end)")
    args = p.parse_args()
    try:  # every variant checked before any training
        variants = {v: parse_variant(v) for v in args.variants}
    except ValueError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.WARNING)
    load = os.getloadavg()[0]
    jobs = {}
    for text, (recipe_over, shape_over) in variants.items():
        recipe = dataclasses.replace(Recipe(), **{"ar_steps": args.ar_steps, "bd_steps": args.bd_steps,
                                                  "short_share": 1.0, "threads": args.threads, **recipe_over})
        jobs[text] = (recipe, dataclasses.replace(DemoShape(), **shape_over))
    if args.parallel > 1:
        with concurrent.futures.ProcessPoolExecutor(args.parallel,
                                                    mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {text: pool.submit(run_variant, text, *job, args.probe_every) for text, job in jobs.items()}
            results = {text: f.result() for text, f in futures.items()}
    else:
        results = {text: run_variant(text, *job, args.probe_every) for text, job in jobs.items()}

    names = list(EXTRACT_FIELDS)
    width = max(len(v) for v in results) + 8
    print(f"demo recipes: {args.ar_steps} autoregressive steps on short documents, then {args.bd_steps} "
          f"block-diffusion steps (unless a variant sets its own), {args.threads} threads, {args.parallel} at once, "
          f"load average before {load:.1f}; probes greedy on {DRILLS} drills and {DOCS} held-out short documents")
    print(f"{'variant':<{width}} {'probe':5} {'ar loss':>7} {'bd loss':>7} {'drill':>6} {'fields':>6} "
          + " ".join(f"{n[:9]:>9}" for n in names) + f" {'tok/step':>8} {'train s':>8} {'cpu s':>7} {'load':>5}")
    for text, r in results.items():
        for phase, step, name, pr in r["curve"]:
            print(_row(f"{text} @{SHORT[phase]}{step}", name, {}, pr, None, width))
        for name, pr in r["probes"].items():
            print(_row(text, name, r["losses"], pr, r, width))
    print("losses: mean of the last 4 logged values of each part (ar: weighted next-token cross-entropy; bd: the "
          "1/t-weighted masked cross-entropy); drill: copy-drill token accuracy (12-16% without copying); fields: "
          "extraction field exact match; tok/step: tokens per decoding step of the extractions; cpu s: the "
          "training process's CPU time; load: mean 1-minute load average while training")


if __name__ == "__main__":
    main()
