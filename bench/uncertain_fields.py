"""How well a field's confidence tells a right extracted field from a wrong one, and where to put the threshold.

    python bench/uncertain_fields.py                    # 64 held-out documents, the demo checkpoint, 2 threads
    python bench/uncertain_fields.py --docs 128 --model DIR

On held-out documents (jobs/demo_corpus.py; a quarter to a third of them long, their facts beyond the attention
window), the extract example job's prompt is decoded by the trunk (greedy, autoregressive: what `verified`, the
example jobs' mode, writes token for token) and each field of the answer gets the pipeline's own
`field_confidence` (pipeline/postprocess.py: the probability of the value's least likely token). Per field, and
over all: how many are right and wrong, the area under the ROC curve of the confidence (1.0: every right field is
more confident than every wrong one; 0.5: chance), and for thresholds from 0.9 down to 0.05 how many wrong fields
fall below it (`uncertain_fields` would list them) and how many right ones do too.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from clover_batch.jobs.demo_corpus import held_out
from clover_batch.jobs.demo_model import DEMO_DIR, EXTRACT_FIELDS, PairMaker, field_matches, job_instructions
from clover_batch.model import generate, load_model
from clover_batch.pipeline.postprocess import field_confidence

THRESHOLDS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)


def auroc(right: list[float], wrong: list[float]) -> float | None:
    """P(a right field's confidence > a wrong one's), ties counting half."""
    if not right or not wrong:
        return None
    return sum((r > w) + 0.5 * (r == w) for r in right for w in wrong) / (len(right) * len(wrong))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--model", default=str(DEMO_DIR))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32)
    maker = PairMaker(Path(args.model), job_instructions())
    docs = held_out(args.docs)
    scored: list[tuple[str, bool, float, bool]] = []  # field, right, confidence, long document
    start = time.perf_counter()
    for i in range(0, len(docs), args.batch):
        part = docs[i:i + args.batch]
        gens = generate(model, [maker.prompt(d, "extract") for d in part], max_new_tokens=96, temperature=0.0,
                        mode="autoregressive")
        for doc, g in zip(part, gens, strict=True):
            text = maker.builder.decode(g.tokens)
            right = field_matches(text, doc)
            confidence = field_confidence(text, text, list(g.tokens), g.token_logprobs, maker.builder.decode,
                                          list(EXTRACT_FIELDS)) or {}
            scored += [(k, right[k], c, bool(doc.extra["long"])) for k, c in confidence.items()]
    long_docs = sum(bool(d.extra["long"]) for d in docs)
    print(f"{args.model}: {len(docs)} held-out documents ({long_docs} long), {len(scored)} fields with a "
          f"confidence, {time.perf_counter() - start:.0f} s")
    print(f"{'field':15} {'right':>6} {'wrong':>6} {'AUROC':>6}")
    for name in [*EXTRACT_FIELDS, "all"]:
        rows = [s for s in scored if name in ("all", s[0])]
        ok = [c for _, r, c, _ in rows if r]
        bad = [c for _, r, c, _ in rows if not r]
        area = auroc(ok, bad)
        print(f"{name:15} {len(ok):6} {len(bad):6} {'' if area is None else f'{area:.3f}':>6}")
    wrong = sum(not r for _, r, _, _ in scored)
    right = len(scored) - wrong
    print(f"\n{'below':>6} {'wrong fields below':>20} {'right fields below':>20} {'fields not below: exact':>24}")
    for t in THRESHOLDS:
        w = sum(not r and c < t for _, r, c, _ in scored)
        r = sum(r and c < t for _, r, c, _ in scored)
        kept = len(scored) - w - r
        print(f"{t:6.2f} {f'{w} of {wrong}':>20} {f'{r} of {right}':>20} "
              f"{f'{100 * (right - r) / max(1, kept):.1f}% of {kept}':>24}")


if __name__ == "__main__":
    main()
