"""Does block-diffusion training learn to copy, per input-embedding init scale and block size, side by side in one run.

    python bench/train_copy.py                                   # std 0.02 and 0.5, 300 steps each, 2 threads
    python bench/train_copy.py --stds 0.02 0.1 0.5 1.0 --steps 400
    python bench/train_copy.py --stds 0.5 --blocks 8 16          # the demo's block (16) against half of it

The task is the core of extraction: repeat a list of 4-40 tokens (drawn from 56 ids) that appears in the prompt.
Its length varies, so no fixed offset finds the source: the model must match the tokens it has written against the
prompt and copy what followed them (an induction head). Nothing in the list can be guessed from the rest, so a
model that does not copy stays near ln(56) = 4.0 per masked token.

The model is the demo checkpoint's shape (jobs/demo_model.DemoShape: 2,048-token vocabulary, hidden 128, four
layers alternating Gated DeltaNet and attention) with a smaller MoE (4 experts of 64) and 8-token blocks so a run
takes minutes on 2 cores (--blocks 16 is the demo's own block); everything but the embedding's init scale and the
block size is the same in every run (seed, data, noise).
Held-out accuracy: greedy, one token per step (k = 1), 64 new lists, per token and per whole list.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import time
from dataclasses import replace

import torch
from clover_batch.jobs.demo_model import DemoShape, demo_config
from clover_batch.model import build_model, generate
from clover_batch.model.train import Example, TrainOptions, init_for_training, train

LOW, HIGH = 8, 64  # list tokens
START, SEP, END = 1, 5, 6  # <|im_start|>, then arbitrary ids marking the list's start and end
IM_END = 2


def lists(seed: int, max_len: int):
    rng = random.Random(seed)
    while True:
        items = [rng.randrange(LOW, HIGH) for _ in range(rng.randint(4, max_len))]
        yield Example([START, SEP, *items, END], [*items, IM_END])


def run(std: float, block: int, args: argparse.Namespace) -> dict:
    shape = replace(DemoShape(), experts=4, expert_width=64, shared_expert_width=64, block_size=block,
                    window_tokens=128)
    torch.manual_seed(args.seed)
    model = build_model(demo_config(shape))
    init_for_training(model, args.seed, embedding_std=std)
    stream = lists(args.seed, args.max_len)
    batches = iter(lambda: [next(stream) for _ in range(args.batch)], None)
    losses: dict[int, float] = {}
    t0 = time.perf_counter()
    train(model, batches, TrainOptions(steps=args.steps, lr=args.lr, warmup=20, log_every=args.steps // 3,
                                       seed=args.seed),
          on_log=lambda step, loss, _s: losses.__setitem__(step, loss))
    seconds = time.perf_counter() - t0
    model.eval()
    held = list(itertools.islice(lists(args.seed + 10_000, args.max_len), 64))
    gens = generate(model, [ex.prompt for ex in held], max_new_tokens=args.max_len + 8, temperature=0.0,
                    tokens_per_step=1)
    right = sum(a == b for ex, g in zip(held, gens, strict=True) for a, b in zip(ex.answer, g.tokens, strict=False))
    total = sum(len(ex.answer) for ex in held)
    exact = sum(list(g.tokens[:len(ex.answer)]) == ex.answer or list(g.tokens) == ex.answer[:-1]
                for ex, g in zip(held, gens, strict=True))
    return {"losses": losses, "token_acc": right / total, "exact": exact / len(held), "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stds", type=float, nargs="+", default=[0.02, 0.5])
    p.add_argument("--blocks", type=int, nargs="+", default=[8], help="diffusion block sizes")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-len", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    results = {(std, block): run(std, block, args) for std in args.stds for block in args.blocks}
    steps = sorted(next(iter(results.values()))["losses"])
    print(f"copy a 4-{args.max_len}-token list: {args.steps} steps of {args.batch}, lr {args.lr}, "
          f"{args.threads} threads, load average before {load:.1f}")
    print(f"{'embed std':>9} {'block':>5} " + " ".join(f"{'loss@' + str(s):>9}" for s in steps)
          + f" {'token acc':>9} {'exact':>6} {'train s':>8}")
    for (std, block), r in results.items():
        print(f"{std:9.3g} {block:5d} " + " ".join(f"{r['losses'][s]:9.3f}" for s in steps)
              + f" {r['token_acc']:9.1%} {r['exact']:6.1%} {r['seconds']:8.0f}")
    print("loss: the training batch's 1/t-weighted masked cross-entropy (ln 56 = 4.0 is a model that does not copy)")


if __name__ == "__main__":
    main()
