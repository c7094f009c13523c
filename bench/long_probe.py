"""Does a demo trunk learn long documents from more of them? (issue 38's probe of phase 1b)

Fine-tunes a demo checkpoint (default: the committed one) with the autoregressive loss alone on phase 1b's mix
(jobs/demo_model.py: `Recipe.long_mix` long documents, `Recipe.long_copy_share` drills, phase 1b's own training
seeds) for --steps steps at --lr, and writes the result as a checkpoint folder, to be scored like any other:

    python bench/long_probe.py --out /tmp/ft300 --steps 300 --lr 1e-3
    python bench/diffusion_quality.py --model /tmp/ft300 --docs 32 --modes ar --threads 2   # its `long` column
    python bench/demo_jobs.py --model /tmp/ft300 --docs 40                                 # the example jobs

The preview is not trained here, so `verified` decoding of the result drafts less well than the checkpoint's own
(fewer tokens per forward); the trunk's answers are what the probe measures.
"""

from __future__ import annotations

import argparse
import logging
import shutil
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
from clover_batch.model.train import Phase, batches_by_prefix, train_phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    ap.add_argument("--model", type=Path, default=DEMO_DIR, help="checkpoint to start from")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=Recipe.long_lr)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    model = load_model(args.model, dtype=torch.float32).train()
    for p in model.parameters():
        p.requires_grad_(True)
    recipe = Recipe(long_steps=args.steps, long_lr=args.lr)
    options = next(p.options for p in phases(recipe) if p.name == LONG_PHASE)  # args.steps at args.lr
    maker = PairMaker(str(args.model), job_instructions())
    block = model.config.diffusion.block_size if model.config.diffusion is not None else 16

    def batches(k: int):
        stream = training_pairs(maker, phase_mix(recipe, LONG_PHASE), phase=PHASE_DATA[LONG_PHASE])
        return batches_by_prefix(stream, recipe.batch_size, block, seed=recipe.seed)

    def logged(phase: str, step: int, report, seconds: float) -> None:
        logging.info("%s step %d  loss %.4f  %.0f s", phase, step, float(report.loss), seconds)

    train_phases(model, [Phase(LONG_PHASE, options)], batches, on_log=logged)
    args.out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model.to(torch.bfloat16), args.out)
    shutil.copy(args.model / "tokenizer.json", args.out / "tokenizer.json")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
