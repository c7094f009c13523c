"""Does a demo trunk learn long documents from more of them? (issue 38's probe of phase 1b)

Fine-tunes a demo checkpoint (default: the committed one) with the autoregressive loss alone on phase 1b's mix
(jobs/demo_model.py: `Recipe.long_mix` long documents, `Recipe.long_copy_share` drills, phase 1b's own training
seeds) for --steps steps at --lr, and writes the result as a checkpoint folder, to be scored like any other:

    python bench/long_probe.py --out /tmp/ft300 --steps 300 --lr 1e-3
    python bench/diffusion_quality.py --model /tmp/ft300 --docs 32 --modes ar --threads 2   # its `long` column
    python bench/demo_jobs.py --model /tmp/ft300 --docs 40                                 # the example jobs

--slow-heads N first gives the last N value heads of every GDN layer a fixed slow decay and holds it
(`TrainOptions.slow_heads`; with --unheld training may change it again), and --prompt-weight sets the document
tokens' loss weight; docs/models.md has what these did to long documents (`--long-only` in diffusion_quality.py).

The preview is not trained here, so `verified` decoding of the result drafts less well than the checkpoint's own
(fewer tokens per forward); the trunk's answers are what the probe measures.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from clover_batch.jobs.demo_model import (
    DEMO_DIR,
    LONG_PHASE,
    PHASE_DATA,
    PairMaker,
    Recipe,
    job_instructions,
    phase_mix,
    phases,
    training_pairs,
)
from clover_batch.model import load_model, save_checkpoint
from clover_batch.model.train import Phase, batches_by_prefix, set_slow_heads, train_phases


def trainable(source: Path, threads: int):
    """The checkpoint at `source` in fp32, every parameter trainable, on `threads` threads (seeded)."""
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model = load_model(source, dtype=torch.float32).train()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def probe_options(steps: int, lr: float, prompt_weight: float, slow_heads: int = 0, slow_dt: float = 5e-4):
    """(recipe, phase 1b's TrainOptions at these steps and lr, prompt tokens weighted `prompt_weight`, slow heads
    held)."""
    recipe = Recipe(long_steps=steps, long_lr=lr)
    options = next(p.options for p in phases(recipe) if p.name == LONG_PHASE)
    return recipe, replace(options, weights=replace(options.weights, prompt=prompt_weight), slow_heads=slow_heads,
                           slow_dt=slow_dt)


def write(model, source: Path, out: Path) -> None:
    """The probed model as a bf16 checkpoint folder with the source's tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model.to(torch.bfloat16), out)
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    ap.add_argument("--model", type=Path, default=DEMO_DIR, help="checkpoint to start from")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=Recipe.long_lr)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slow-heads", type=int, default=0,
                    help="give the last N value heads of every GDN layer a fixed slow decay before training and "
                         "hold it (model.train.set_slow_heads, TrainOptions.slow_heads): heads that can carry facts "
                         "across the log, which the checkpoint's learned decays forget within tens of tokens")
    ap.add_argument("--slow-dt", type=float, default=5e-4, help="the slow heads' step size (decay exp(-dt) a token)")
    ap.add_argument("--unheld", action="store_true",
                    help="set the slow heads but let training change their decay (it learns to forget again)")
    ap.add_argument("--prompt-weight", type=float, default=1.0,
                    help="per-token loss weight of prompt and document tokens (answers: the recipe's weight)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = trainable(args.model, args.threads)
    recipe, options = probe_options(args.steps, args.lr, args.prompt_weight,
                                    0 if args.unheld else args.slow_heads, args.slow_dt)
    if args.slow_heads and args.unheld:
        set_slow_heads(model, args.slow_heads, args.slow_dt)
    maker = PairMaker(str(args.model), job_instructions())
    block = model.config.diffusion.block_size if model.config.diffusion is not None else 16

    def batches(k: int):
        stream = training_pairs(maker, phase_mix(recipe, LONG_PHASE), phase=PHASE_DATA[LONG_PHASE])
        return batches_by_prefix(stream, recipe.batch_size, block, seed=recipe.seed)

    def logged(phase: str, step: int, report, seconds: float) -> None:
        logging.info("%s step %d  loss %.4f  %.0f s", phase, step, float(report.loss), seconds)

    train_phases(model, [Phase(LONG_PHASE, options)], batches, on_log=logged)
    write(model, args.model, args.out)


if __name__ == "__main__":
    main()
