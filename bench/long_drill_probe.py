"""Can the demo trunk learn to carry a short list across a log longer than its attention window? (issue 38)

Fine-tunes a demo checkpoint (default: the committed one) autoregressively on phase 1b's mix (bench/long_probe.py's
stream) with --drill-share of the pairs replaced by long drills: "Repeat the list." over 1-3 random names,
companies, amounts or dates followed by an operations log of 16-28 lines (jobs/demo_corpus.py's long documents'
log), answered by the list. Only the carried Gated DeltaNet state can answer one whose list lies more than the
attention window before the answer (about two in three). Every 150 steps it scores 48 held-out long drills
(greedy, exact list; those beyond the window and those within it apart), and it writes the result as a checkpoint
folder:

    python bench/long_drill_probe.py --out /tmp/drill --steps 600 --threads 1
    python bench/long_drill_probe.py --out /tmp/drill-slow --slow-heads 2 --threads 1   # with held slow heads
    python bench/diffusion_quality.py --model /tmp/drill --docs 24 --long-only --modes ar   # long documents

    python bench/long_drill_probe.py --model DIR --steps 0 --recipe-drills   # score only: the recipe's long drills

With --recipe-drills it scores the recipe's own long drills instead (demo_corpus.long_copy_drill, 28-40 log lines:
every list beyond the window) on held-out seeds. Beside the exact lists it counts what a drill only partly carried
across the log: the first word right, the number of items right, and the list's words present in the answer.
"""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

from clover_batch.jobs.demo_corpus import (
    HELD_OUT_SEEDS,
    _amount,
    _company,
    _date,
    _doc_date,
    _log,
    _person,
    fmt_eur,
    long_copy_drill,
)
from clover_batch.jobs.demo_model import (
    COPY_INSTRUCTION,
    DEMO_DIR,
    IM_END_ID,
    LONG_PHASE,
    PHASE_DATA,
    PairMaker,
    Recipe,
    job_instructions,
    phase_mix,
    training_pairs,
)
from clover_batch.model import generate
from clover_batch.model.train import Example, Phase, batches_by_prefix, train_phases
from gdn_memory import prefix_holding  # bench/ is on sys.path when this script runs
from long_probe import probe_options, trainable, write

HELD_OUT_DRILLS = range(7_000_000, 7_000_048)  # seeds of the scored drills (training draws 5,000,001 on)
# --recipe-drills: seeds of held-out documents far past any the benches draw (held_out(n) takes the first n)
HELD_OUT_RECIPE_DRILLS = HELD_OUT_SEEDS[50_000:50_048]


def long_drill(maker: PairMaker, seed: int) -> tuple[Example, str]:
    """(the drill's training example, its list)."""
    rng = random.Random(seed)
    items = []
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        items.append(_person(rng) if r < 0.3 else _company(rng) if r < 0.6 else
                     fmt_eur(_amount(rng, 10, 200_000)) if r < 0.8 else _doc_date(rng, _date(rng)))
    listed = ", ".join(items)
    text = listed + "\n\nOperations log\n" + "\n".join(_log(rng, rng.randint(16, 28)))
    answer = [*maker.builder.encode(listed, specials=False), IM_END_ID]
    return Example(maker.builder.build(COPY_INSTRUCTION, text), answer), listed


def recipe_drill(maker: PairMaker, seed: int) -> tuple[Example, str]:
    """(the recipe's long drill of `seed`, as training builds it, its list)."""
    return maker.long_drill(seed), long_copy_drill(seed)[0]


def words(text: str) -> set[str]:
    return set(text.replace(",", " ").split())


def partial(outputs: list[str], lists: list[str]) -> str:
    """What the answers carried of their lists short of the whole: first word, item count, words present."""
    first = sum(o.split()[:1] == want.split()[:1] for o, want in zip(outputs, lists, strict=True))
    count = sum(o.count(",") == want.count(",") for o, want in zip(outputs, lists, strict=True))
    present = sum(len(words(o) & words(want)) for o, want in zip(outputs, lists, strict=True))
    return (f"first word right {first}/{len(lists)}, item count right {count}/{len(lists)}, "
            f"the lists' words present {present}/{sum(len(words(want)) for want in lists)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="checkpoint folder to write (not with --steps 0)")
    ap.add_argument("--model", type=Path, default=DEMO_DIR, help="checkpoint to start from")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=Recipe.long_lr)
    ap.add_argument("--drill-share", type=float, default=0.5, help="share of pairs that are long drills")
    ap.add_argument("--prompt-weight", type=float, default=0.1,
                    help="per-token loss weight of prompt and document tokens (answers: the recipe's weight)")
    ap.add_argument("--slow-heads", type=int, default=0, help="TrainOptions.slow_heads (bench/long_probe.py)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recipe-drills", action="store_true",
                    help="score the recipe's long drills (demo_corpus.long_copy_drill) on held-out seeds")
    args = ap.parse_args()
    if args.steps and args.out is None:
        ap.error("--out is required unless --steps 0 (score only)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = trainable(args.model, args.threads)
    maker = PairMaker(str(args.model), job_instructions())
    held = ([recipe_drill(maker, seed) for seed in HELD_OUT_RECIPE_DRILLS] if args.recipe_drills else
            [long_drill(maker, seed) for seed in HELD_OUT_DRILLS])

    window = model.config.window_tokens
    beyond = [len(ex.prompt) - prefix_holding(maker, ex.prompt, listed) >= window for ex, listed in held]

    def score() -> str:
        model.eval()
        gens = generate(model, [ex.prompt for ex, _ in held], max_new_tokens=48, temperature=0.0,
                        mode="autoregressive")
        outputs = [maker.builder.decode(g.tokens).strip() for g in gens]
        lists = [listed for _, listed in held]
        exact = [o == want for o, want in zip(outputs, lists, strict=True)]
        far = sum(e for e, b in zip(exact, beyond, strict=True) if b)
        near = sum(e for e, b in zip(exact, beyond, strict=True) if not b)
        model.train()
        return (f"held-out long drills exact: {far}/{sum(beyond)} of the lists beyond the {window}-token window, "
                f"{near}/{len(held) - sum(beyond)} of those within it; {partial(outputs, lists)}")

    def batches(k: int):
        rng = random.Random(5)
        base = training_pairs(maker, phase_mix(recipe, LONG_PHASE), phase=PHASE_DATA[LONG_PHASE])

        def stream():
            seed = 5_000_000
            while True:
                seed += 1
                yield long_drill(maker, seed)[0] if rng.random() < args.drill_share else next(base)

        return batches_by_prefix(stream(), recipe.batch_size, 16, seed=0)

    def logged(phase: str, step: int, report, seconds: float) -> None:
        scored = f"  {score()}" if step % 150 == 0 else ""
        logging.info("step %d  loss %.4f  %.0f s%s", step, float(report.loss), seconds, scored)

    logging.info("before: %s", score())
    if not args.steps:
        return
    recipe, options = probe_options(args.steps, args.lr, args.prompt_weight, args.slow_heads)
    train_phases(model, [Phase(LONG_PHASE, options)], batches, on_log=logged)
    write(model, args.model, args.out)


if __name__ == "__main__":
    main()
