"""How well `task.parts` picks: long documents answered whole and from their parts, the pick against the best pick.

    python bench/parts_pick.py                               # 24 long held-out documents, parts of 128, no overlap
    python bench/parts_pick.py --tokens 128 256 --overlap 0 64 --docs 24

On long held-out documents (jobs/demo_corpus.py: every fact more than the demo's 384-token window before the
answer), each example job's prompt and its parts' prompts (pipeline/parts.py `part_spans` and `part_prompt`, as the
replica makes them) are decoded by the trunk (greedy, autoregressive: what `verified`, the example jobs' mode,
writes token for token; fp32). For each part size and overlap it prints the parts per document and:
- extraction: fields exact from the whole document alone; with the pipeline's pick (per field, the answer whose
  value's least likely token is likeliest: `merge_extractions` over `field_confidence`); and the best any pick of
  the same answers could do (a field right in some answer);
- summaries: the target's facts present in the whole document's summary; in the one picked (the highest mean
  log-probability: `pick_summary`); and in the best of the same summaries.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from clover_batch.jobs.demo_corpus import held_out_long
from clover_batch.jobs.demo_model import DEMO_DIR, EXTRACT_FIELDS, PairMaker, field_matches, job_instructions
from clover_batch.model import generate, load_model
from clover_batch.pipeline.parts import Answer, merge_extractions, part_prompt, part_spans, pick_summary
from clover_batch.pipeline.postprocess import field_confidence


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=24, help="long held-out documents")
    p.add_argument("--tokens", type=int, nargs="+", default=[128], help="document tokens per part")
    p.add_argument("--overlap", type=int, nargs="+", default=[0], help="tokens a part shares with the one before")
    p.add_argument("--model", default=str(DEMO_DIR))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32)
    maker = PairMaker(Path(args.model), job_instructions())
    builder, window, names = maker.builder, model.config.window_tokens, list(EXTRACT_FIELDS)
    docs = held_out_long(args.docs)
    print(f"{args.model}: {len(docs)} long held-out documents, window {window}, answers of up to "
          f"{args.max_new_tokens} tokens, the trunk (fp32, greedy)")
    print(f"{'tokens':>6} {'overlap':>7} {'parts':>6} | {'fields: whole':>13} {'picked':>7} {'best':>6} | "
          f"{'facts: whole':>12} {'picked':>7} {'best':>6} | {'s':>4}")
    for tokens in args.tokens:
        for overlap in args.overlap:
            if overlap >= tokens:
                continue
            start_time = time.perf_counter()
            parts = 0
            fields = [0, 0, 0]  # whole, picked, best
            facts = [0, 0, 0]
            n_facts = 0
            for doc in docs:
                for task in ("extract", "summarize"):
                    instruction = maker.instructions.extract if task == "extract" else maker.instructions.summarize
                    prompt = builder.build(instruction, doc.text)
                    start, end = builder.document_span(instruction, len(prompt))
                    spans = part_spans(end - start, len(prompt) - end, window, args.max_new_tokens, tokens, overlap)
                    parts += len(spans)
                    prompts = [prompt, *(part_prompt(prompt, start, end, s) for s in spans)]
                    gens = generate(model, prompts, max_new_tokens=args.max_new_tokens, temperature=0.0,
                                    mode="autoregressive")
                    texts = [builder.decode(g.tokens) for g in gens]
                    means = [sum(g.token_logprobs) / len(g.token_logprobs) if g.token_logprobs else None for g in gens]
                    if task == "extract":
                        right = [field_matches(t, doc) for t in texts]
                        answers = []
                        for span, text, g, mean in zip([None, *spans], texts, gens, means, strict=True):
                            conf = field_confidence(text, text, list(g.tokens), g.token_logprobs, builder.decode, names)
                            answers.append(Answer(span, mean, _fields(text), conf))
                        merged = merge_extractions(answers, names)
                        fields[0] += sum(right[0].values())
                        if merged is not None:
                            fields[1] += sum(merged[0][n] == doc.fields[n] for n in names)
                        fields[2] += sum(any(r[n] for r in right) for n in names)
                    else:
                        present = [sum(f in t for _, f in doc.summary_facts) for t in texts]
                        at = pick_summary([Answer(s, m) for s, m in zip([None, *spans], means, strict=True)])
                        facts[0] += present[0]
                        facts[1] += present[at]
                        facts[2] += max(present)
                        n_facts += len(doc.summary_facts)
            m = len(docs) * len(names)
            print(f"{tokens:6} {overlap:7} {parts / (2 * len(docs)):6.1f} | {100 * fields[0] / m:12.1f}% "
                  f"{100 * fields[1] / m:6.1f}% {100 * fields[2] / m:5.1f}% | {100 * facts[0] / n_facts:11.1f}% "
                  f"{100 * facts[1] / n_facts:6.1f}% {100 * facts[2] / n_facts:5.1f}% | "
                  f"{time.perf_counter() - start_time:4.0f}", flush=True)


def _fields(text: str) -> dict | None:
    """The answer checked as the pipeline checks it (field_matches' rules): its JSON object, or None."""
    from clover_batch.pipeline.postprocess import FieldRule, check_extraction

    rules = [FieldRule(n, f["type"], f["description"], f.get("required", True)) for n, f in EXTRACT_FIELDS.items()]
    checked = check_extraction(text, rules)
    return json.loads(checked.output_json) if checked.output_json is not None else None


if __name__ == "__main__":
    main()
