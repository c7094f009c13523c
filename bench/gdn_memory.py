"""How far each Gated DeltaNet head of a demo checkpoint carries its state: decays and write strengths over the
long held-out documents (issue 38's diagnosis of why long documents' facts do not reach the answer).

    python bench/gdn_memory.py                       # the committed demo checkpoint, 12 long held-out documents
    python bench/gdn_memory.py --model DIR --docs 24

A long document (jobs/demo_corpus.py) puts its facts first and then an operations log; its answer lies more than
the attention window after the facts, so only the GDN state can carry them. For every GDN layer and value head
this prints, averaged over the documents' extraction prompts:
- `log10 kept`: the share of the state written at the facts' end that survives the decays to the answer,
  exp(sum of the log-decays g over the tokens between), as a power of ten (-6.5 is e^-15: nothing is carried);
- `beta facts` / `beta log`: the mean write strength (the delta rule's beta) over the facts and over the log; a
  head that keeps facts must also write little over the log, or the log's writes replace them.
"""

from __future__ import annotations

import argparse
import math

import torch
from clover_batch.jobs.demo_corpus import held_out_long
from clover_batch.jobs.demo_model import DEMO_DIR, PairMaker, job_instructions
from clover_batch.model import load_model


def prefix_holding(maker: PairMaker, ids: list[int], text: str) -> int:
    """The length of the shortest prefix of `ids` whose decoded text holds `text` (binary search on decoding)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if text in maker.builder.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEMO_DIR))
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32)
    maker = PairMaker(args.model, job_instructions())
    layers = [(i, layer.linear_attn) for i, layer in enumerate(model.layers) if layer.kind == "linear_attention"]
    caught: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, gdn in layers:
        gdn.register_forward_hook(lambda mod, inp, out, i=i: caught.__setitem__(
            i, (mod._project(inp[0]).g[0].detach(), mod._project(inp[0]).beta[0].detach())))
    sums: dict[int, list[torch.Tensor]] = {i: [] for i, _ in layers}
    spans = []
    for doc in held_out_long(args.docs):
        ids = maker.prompt(doc, "extract")
        end = prefix_holding(maker, ids, "Operations log") - 1  # where the log begins
        with torch.no_grad():
            model(torch.tensor([ids]), keep_logits=0)
        spans.append(len(ids) - end)
        for i, _ in layers:
            g, beta = caught[i]
            sums[i].append(torch.stack([g[end:].sum(0), beta[:end].mean(0), beta[end:].mean(0)]))
    print(f"{args.model}: {args.docs} long held-out documents, {min(spans)}-{max(spans)} tokens from the facts' end "
          f"to the answer (window {model.config.window_tokens})")
    print(f"{'layer':>5} {'head':>4} {'log10 kept':>10} {'beta facts':>10} {'beta log':>8}")
    for i, gdn in layers:
        mean = torch.stack(sums[i]).mean(0)  # [3, Hv]
        for h in range(gdn.Hv):
            kept = mean[0, h].item() / math.log(10)
            print(f"{i:>5} {h:>4} {kept:>10.1f} {mean[1, h].item():>10.2f} {mean[2, h].item():>8.2f}")


if __name__ == "__main__":
    main()
