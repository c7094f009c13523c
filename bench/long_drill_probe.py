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
    python bench/long_drill_probe.py --model DIR --steps 0 --recipe-drills --addressing 2   # and where heads look

    # from a trunk with held slow heads: the recipe's long drills in training, and the held heads' writes over
    # every log held down by a training-only penalty on their beta
    python bench/long_drill_probe.py --model DIR --out /tmp/quiet --slow-heads 2 --train-drills recipe \
        --recipe-drills --prompt-weight 1 --drill-share 0.3 --log-beta-penalty 1 --threads 1

With --recipe-drills it scores the recipe's own long drills instead (demo_corpus.long_copy_drill, 28-40 log lines:
every list beyond the window) on held-out seeds. Beside the exact lists it counts what a drill only partly carried
across the log: the first word right, the number of items right, and the list's words present in the answer.

--log-beta-penalty W adds W times the held slow heads' mean write strength (the delta rule's beta) over the
operations logs of a batch (long documents' and drills') to the loss, in training only: every write over the log
erases part of what the facts wrote (bench/gdn_memory.py), so this tests whether the log's writes are what keeps
the facts from the answer. The log shows those heads' mean beta over the logs and over what comes before them.

--addressing N prints, with every score, where the last N value heads of every GDN layer look among a drill's
list when the right answer is copied (`addressing`): whether the list position holding the next word is the one
their read draws on most, beside chance.
"""

from __future__ import annotations

import argparse
import logging
import random
from dataclasses import replace
from pathlib import Path

import torch
from clover_batch.jobs.demo_corpus import (
    HELD_OUT_SEEDS,
    _amount,
    _company,
    _date,
    _doc_date,
    _log,
    _person,
    copy_drill,
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
from clover_batch.model.train import _gdn_layers as gdn_layers
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


class LogWrites:
    """Forward hooks on the GDN layers catching the held slow heads' beta in training forwards (grad enabled), and
    the penalty on them over each example's operations log."""

    def __init__(self, model, maker: PairMaker, heads: int) -> None:
        self.maker, self.caught = maker, []
        self.stats = {"log": [0.0, 0], "before": [0.0, 0]}  # sum and count of beta since the last report
        marker = "QQQQ"
        ids = maker.builder.build(COPY_INSTRUCTION, marker)
        self.suffix = len(ids) - prefix_holding(maker, ids, marker)  # template tokens after the document
        for gdn in gdn_layers(model):
            gdn.register_forward_hook(lambda mod, inp, out: self.caught.append(mod._project(inp[0]).beta[..., -heads:])
                                      if torch.is_grad_enabled() else None)

    def log_span(self, prompt: list[int]) -> tuple[int, int] | None:
        """[start, end) of the prompt's operations log and what follows it in the document; None without a log."""
        if "Operations log" not in self.maker.builder.decode(prompt):
            return None
        return prefix_holding(self.maker, prompt, "Operations log") - 2, len(prompt) - self.suffix

    def penalty(self, batch: list[Example]) -> torch.Tensor:
        caught, self.caught = self.caught, []
        on_log, before = [], []
        for i, ex in enumerate(batch):
            span = self.log_span(ex.prompt)
            if span is None:
                continue
            for beta in caught:  # [B, T, heads]
                on_log.append(beta[i, span[0]:span[1]].reshape(-1))
                before.append(beta[i, :span[0]].detach().reshape(-1))
        if not on_log:
            return torch.zeros(())
        logged, ahead = torch.cat(on_log), torch.cat(before)
        for key, values in (("log", logged.detach()), ("before", ahead)):
            self.stats[key][0] += float(values.sum())
            self.stats[key][1] += values.numel()
        return logged.mean()

    def report(self) -> str:
        if not self.stats["log"][1]:
            return "held heads' beta: no operations log in these steps"
        means = {k: s / max(1, n) for k, (s, n) in self.stats.items()}
        self.stats = {"log": [0.0, 0], "before": [0.0, 0]}
        return f"held heads' beta: log {means['log']:.3f}, before it {means['before']:.3f}"


def words(text: str) -> set[str]:
    return set(text.replace(",", " ").split())


def partial(outputs: list[str], lists: list[str]) -> str:
    """What the answers carried of their lists short of the whole: first word, item count, words present."""
    first = sum(o.split()[:1] == want.split()[:1] for o, want in zip(outputs, lists, strict=True))
    count = sum(o.count(",") == want.count(",") for o, want in zip(outputs, lists, strict=True))
    present = sum(len(words(o) & words(want)) for o, want in zip(outputs, lists, strict=True))
    return (f"first word right {first}/{len(lists)}, item count right {count}/{len(lists)}, "
            f"the lists' words present {present}/{sum(len(words(want)) for want in lists)}")


def list_start(ex: Example) -> int | None:
    """Where a drill's list begins in its prompt: the first position whose tokens are the answer's (its stop token
    left out); None where the list is tokenised otherwise in the document than in the answer."""
    answer, prompt = list(ex.answer[:-1]), list(ex.prompt)
    return next((s for s in range(len(prompt) - len(answer) + 1) if prompt[s:s + len(answer)] == answer), None)


def addressing(model, maker: PairMaker, held: list[tuple[Example, str]],
               heads: int) -> dict[tuple[int, bool], list[tuple[int, int, int]]]:
    """Where the last `heads` value heads of every GDN layer look for each answer token among the list's writes.

    Teacher-forced on each drill with its right answer: the position predicting answer token j reads the state
    with its query q; to first order (the delta rule's corrections between the list's own writes left out) the
    list position s contributes beta_s * (k_s . q) * (the decay from s to the query) of its value. Copying the list
    by association means the largest contribution comes from the list position that holds token j (its key made
    by the short conv from the tokens before it). Returns, per (GDN layer, first answer token or not), one (rank of
    that position, the list's length, offset of the first-ranked position from it) per answer token and head,
    in drill, head, answer-token order;
    `addressing_lines` sums them up. Drills whose list is tokenised otherwise in the document than in the answer
    are left out."""
    from clover_batch.model import ops

    layers = [(i, layer.linear_attn) for i, layer in enumerate(model.layers) if layer.kind == "linear_attention"]
    caught: dict[int, tuple[torch.Tensor, ...]] = {}

    def catch(i: int):
        def hook(mod, inp, out) -> None:
            p = mod._project(inp[0])
            tail = torch.zeros(p.qkv.shape[0], mod.conv1d.weight.shape[-1] - 1, p.qkv.shape[2], dtype=p.qkv.dtype)
            mixed, _ = ops.short_conv(p.qkv, mod.conv1d.weight[:, 0], tail)
            q, k, _ = mod._heads(mixed)
            caught[i] = (q[0], k[0], p.beta[0].float(), p.g[0])
        return hook

    hooks = [gdn.register_forward_hook(catch(i)) for i, gdn in layers]
    ranks: dict[tuple[int, bool], list[tuple[int, int, int]]] = {}  # (layer, first) -> (rank, list length, offset)
    try:
        for ex, _ in held:
            answer, prompt = list(ex.answer[:-1]), list(ex.prompt)
            start = list_start(ex)
            if start is None:
                continue
            with torch.no_grad():
                model(torch.tensor([prompt + list(ex.answer)]), keep_logits=0)
            where = torch.arange(start, start + len(answer))
            for i, gdn in layers:
                q, k, beta, g = caught[i]
                for h in range(gdn.Hv - heads, gdn.Hv):
                    kh, decay = h // (gdn.Hv // gdn.Hk), g[:, h].cumsum(0)
                    for j in range(len(answer)):
                        t = len(prompt) + j - 1  # the position whose output predicts answer token j
                        w = beta[where, h] * (k[where, kh] @ q[t, kh]) * torch.exp(decay[t] - decay[where])
                        ranks.setdefault((i, j == 0), []).append(
                            (int((w > w[j]).sum()), len(answer), int(w.argmax()) - j))
    finally:
        for hook in hooks:
            hook.remove()
    return ranks


def addressing_lines(ranks: dict[tuple[int, bool], list[tuple[int, int, int]]]) -> list[str]:
    """One line per layer and part (the first answer token; the rest): how often the position holding the answer
    token ranks first and in the top 3, its mean rank, each beside chance (a uniform draw among the list's
    positions), and the commonest offsets of the position that does rank first."""
    from collections import Counter

    lines = []
    for (i, first), rows in sorted(ranks.items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        r = torch.tensor([row[0] for row in rows], dtype=torch.float)
        n = torch.tensor([row[1] for row in rows], dtype=torch.float)
        common = ", ".join(f"{o:+d} ({c})" for o, c in Counter(row[2] for row in rows).most_common(3))
        lines.append(f"layer {i}, {'first token' if first else 'the rest'} ({len(rows)}): right position first "
                     f"{(r == 0).float().mean():.2f} (chance {(1 / n).mean():.2f}), top 3 {(r < 3).float().mean():.2f} "
                     f"(chance {(3 / n).clamp(max=1).mean():.2f}), mean rank {r.mean():.1f} (chance "
                     f"{((n - 1) / 2).mean():.1f}); first-ranked offsets {common}")
    return lines


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
    ap.add_argument("--train-drills", choices=("short", "recipe", "copy", "copy-long"), default="short",
                    help="train on this bench's drills (16-28 log lines, within the window or not), the recipe's "
                         "long drills (every list beyond the window) mixed into phase 1b's stream as the recipe does, "
                         "the recipe's short copy drills (6-14 items, no log), or those and its long drills half and "
                         "half")
    ap.add_argument("--train-window", type=int, default=0, metavar="N",
                    help="attention window of the training forwards (0: the checkpoint's): with a few tokens, "
                         "attention cannot copy a drill's list and only the GDN state can; scoring and the written "
                         "checkpoint keep the checkpoint's window")
    ap.add_argument("--score-every", type=int, default=150, help="steps between scores of the held-out drills")
    ap.add_argument("--addressing", type=int, default=0, metavar="N",
                    help="with every score, print where the last N value heads of every GDN layer address the list's "
                         "writes when the answer is copied (see `addressing`)")
    ap.add_argument("--log-beta-penalty", type=float, default=0.0,
                    help="weight of the held slow heads' mean beta over the operations logs in the loss (needs "
                         "--slow-heads)")
    args = ap.parse_args()
    if args.steps and args.out is None:
        ap.error("--out is required unless --steps 0 (score only)")
    if args.log_beta_penalty and not args.slow_heads:
        ap.error("--log-beta-penalty holds down the held slow heads' writes: give --slow-heads")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = trainable(args.model, args.threads)
    maker = PairMaker(str(args.model), job_instructions())
    held = ([recipe_drill(maker, seed) for seed in HELD_OUT_RECIPE_DRILLS] if args.recipe_drills else
            [long_drill(maker, seed) for seed in HELD_OUT_DRILLS])

    window = model.config.window_tokens
    beyond = [len(ex.prompt) - prefix_holding(maker, ex.prompt, listed) >= window for ex, listed in held]

    def score() -> str:
        trained_window = model.config.window_tokens
        model.config = model.config.replace(window_tokens=window)
        model.eval()
        gens = generate(model, [ex.prompt for ex, _ in held], max_new_tokens=48, temperature=0.0,
                        mode="autoregressive")
        outputs = [maker.builder.decode(g.tokens).strip() for g in gens]
        lists = [listed for _, listed in held]
        exact = [o == want for o, want in zip(outputs, lists, strict=True)]
        far = sum(e for e, b in zip(exact, beyond, strict=True) if b)
        near = sum(e for e, b in zip(exact, beyond, strict=True) if not b)
        if args.addressing:
            for line in addressing_lines(addressing(model, maker, held, args.addressing)):
                logging.info("addressing: %s", line)
        model.config = model.config.replace(window_tokens=trained_window)
        model.train()
        return (f"held-out long drills exact: {far}/{sum(beyond)} of the lists beyond the {window}-token window, "
                f"{near}/{len(held) - sum(beyond)} of those within it; {partial(outputs, lists)}")

    def batches(k: int):
        if args.train_drills == "recipe":  # the recipe's own stream, its long drills at --drill-share
            mixed = replace(phase_mix(recipe, LONG_PHASE), long_drill_share=args.drill_share)
            return batches_by_prefix(training_pairs(maker, mixed, phase=PHASE_DATA[LONG_PHASE]), recipe.batch_size,
                                     16, seed=0)
        rng = random.Random(5)
        base = training_pairs(maker, phase_mix(recipe, LONG_PHASE), phase=PHASE_DATA[LONG_PHASE])

        def drill(seed: int) -> Example:
            if args.train_drills == "copy-long":  # half the recipe's short copy drills, half its long drills
                return maker.long_drill(seed) if seed % 2 else maker.drill(copy_drill(seed))
            return maker.drill(copy_drill(seed)) if args.train_drills == "copy" else long_drill(maker, seed)[0]

        def stream():
            seed = 5_000_000
            while True:
                seed += 1
                yield drill(seed) if rng.random() < args.drill_share else next(base)

        return batches_by_prefix(stream(), recipe.batch_size, 16, seed=0)

    writes = LogWrites(model, maker, args.slow_heads) if args.slow_heads else None

    def aux(batch: list[Example]) -> torch.Tensor:
        assert writes is not None
        penalty = writes.penalty(batch)
        return args.log_beta_penalty * penalty

    def logged(phase: str, step: int, report, seconds: float) -> None:
        scored = f"  {score()}" if step % args.score_every == 0 else ""
        betas = f"  {writes.report()}" if writes is not None else ""
        logging.info("step %d  loss %.4f  %.0f s%s%s", step, float(report.loss), seconds, betas, scored)

    logging.info("before: %s", score())
    if not args.steps:
        return
    recipe, options = probe_options(args.steps, args.lr, args.prompt_weight, args.slow_heads)
    if args.train_window:
        model.config = model.config.replace(window_tokens=args.train_window)
    train_phases(model, [Phase(LONG_PHASE, options)], batches, on_log=logged,
                 aux_loss=aux if writes is not None else None)
    model.config = model.config.replace(window_tokens=window)
    write(model, args.model, args.out)


if __name__ == "__main__":
    main()
