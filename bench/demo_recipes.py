"""Short demo-model training runs per recipe variant, side by side: does a change make the model copy sooner?

    python bench/demo_recipes.py                                            # the committed recipe, 600 steps
    python bench/demo_recipes.py base embedding_std=0.1,tie_embeddings=1 lr=0.01 block_size=8 --steps 600

A full `clover-batch model train-demo` run takes most of an hour on 2 cores; this bench answers the cheaper
question first. Every variant trains the demo model (jobs/demo_model.py: same tokenizer, corpus, seed and data
order) for --steps steps on short documents only (`short_share` 1: the recipe's first phase, where the facts sit
in a few hundred tokens), then is probed greedily, one token per step (k = 1):

- copy drill: token accuracy repeating 24 held-out "Repeat the list." drills (names, companies, amounts, dates).
  Separators and the stop token are free: models that copy nothing (every one tried so far) score 12-16%.
- fields: exact match per extraction field on 32 held-out short documents, checked as the pipeline checks them.
  document_type needs no copying; date, parties, amount_eur and deadline do (a null amount or deadline is a hit
  for a model that writes null, not a copy).

A variant is `base` or comma-separated `name=value` over the fields of Recipe and DemoShape (jobs/demo_model.py);
values are parsed as the field's type. Runs train in a temporary folder and keep nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
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


def probe(out: Path) -> dict:
    model = load_model(str(out), dtype=torch.float32)
    maker = PairMaker(out, job_instructions())
    drills = [maker.drill(copy_drill(DRILL_SEEDS[i])) for i in range(DRILLS)]
    gens = generate(model, [d.prompt for d in drills], max_new_tokens=96, temperature=0.0, tokens_per_step=1)
    right = sum(a == b for d, g in zip(drills, gens, strict=True)
                for a, b in zip([*g.tokens, IM_END_ID], d.answer, strict=False))
    drill_acc = right / sum(len(d.answer) for d in drills)
    docs = [make_document(HELD_OUT_SEEDS[i], long=False, filler=False) for i in range(DOCS)]
    gens = generate(model, [maker.prompt(d, "extract") for d in docs], max_new_tokens=96, temperature=0.0,
                    tokens_per_step=1)
    hits = dict.fromkeys(EXTRACT_FIELDS, 0)
    for d, g in zip(docs, gens, strict=True):
        for name, ok in field_matches(maker.builder.decode(g.tokens), d).items():
            hits[name] += ok
    return {"drill": drill_acc, "fields": {n: h / DOCS for n, h in hits.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="*", default=["base"])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    try:  # every variant checked before any training
        variants = {v: parse_variant(v) for v in args.variants}
    except ValueError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.WARNING)
    load = os.getloadavg()[0]
    results = {}
    for text, (recipe_over, shape_over) in variants.items():
        recipe = dataclasses.replace(Recipe(), **{"steps": args.steps, "short_share": 1.0, "threads": args.threads,
                                                  **recipe_over})
        shape = dataclasses.replace(DemoShape(), **shape_over)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            report = train_demo(Path(tmp), recipe, shape)
            seconds = time.perf_counter() - t0
            tail = report["loss_curve"]["loss"][-4:]
            results[text] = {**probe(Path(tmp)), "loss": sum(tail) / len(tail),
                             "seconds": seconds}
    print(f"demo recipes: {args.steps} steps on short documents, {args.threads} threads, load average before "
          f"{load:.1f}; probe greedy k = 1 on {DRILLS} drills and {DOCS} held-out short documents")
    names = list(EXTRACT_FIELDS)
    width = max(len(v) for v in results) + 1
    print(f"{'variant':<{width}} {'loss':>6} {'drill':>6} {'fields':>6} "
          + " ".join(f"{n[:9]:>9}" for n in names) + f" {'train s':>8}")
    for text, r in results.items():
        fields = r["fields"]
        print(f"{text:<{width}} {r['loss']:6.3f} {r['drill']:6.1%} {sum(fields.values()) / len(names):6.1%} "
              + " ".join(f"{fields[n]:9.0%}" for n in names) + f" {r['seconds']:8.0f}")
    print("loss: mean of the last 4 logged training losses; drill: copy-drill token accuracy (12-16% without copying); "
          "fields: extraction field exact match")


if __name__ == "__main__":
    main()
