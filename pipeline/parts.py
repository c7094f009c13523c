"""Answering a long document from its parts too (`task.parts`), and keeping the answer the model was surest of.

A document whose prompt is longer than the model's attention window reaches the answer through two roads: what
attention sees (the last window) and what the recurrent state carried from before it. Where the state does not
carry a fact (the demo model's mostly do not), the answer guesses it. With `task.parts`, such a document is also
asked the same question part by part: each part is the prompt's own tokens (the instruction, `tokens` tokens of the
document, the template's end), so every part lies inside one window and attention sees all of it. The parts cover
the document up to the tokens the whole document's answer sees with attention (its last window, less the answer's
own length); they overlap by `overlap` tokens, so a fact shorter than the overlap lies whole in some part.

Each answer is scored by the model itself (the trunk's log-probability of each output token), and the row keeps:
- extraction: per field, the value of the answer whose tokens for that field were likeliest (`field_confidence`,
  its least likely token), ties to the whole document, then to the earlier part;
- summary: the answer with the highest mean log-probability, ties likewise.

The whole-document answer is always one of the candidates, so a document whose facts the state does carry loses
nothing but time. What it costs: the document's tokens before its last window prefilled once more per part they
lie in (twice with half overlap), plus one decode per part; documents attention sees whole are not split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


def part_spans(doc_tokens: int, after_tokens: int, window: int, answer_tokens: int, tokens: int,
               overlap: int) -> list[tuple[int, int]]:
    """The document-token ranges [start, end) of the parts of a document of `doc_tokens` tokens followed by
    `after_tokens` prompt tokens, in order; none when `tokens` is 0 or attention sees the whole document from every
    answer token. Attention sees the last `window` positions, so every token of an answer of up to `answer_tokens`
    sees the document's last `window - after_tokens - answer_tokens` tokens: the parts cover the tokens before
    those (the whole document's answer reads these), each `tokens` long, each sharing `overlap` with the one
    before."""
    seen = max(0, window - after_tokens - answer_tokens)
    unseen = doc_tokens - seen
    if tokens <= 0 or unseen <= 0 or doc_tokens <= tokens:
        return []
    spans, start = [], 0
    while True:
        end = min(start + tokens, doc_tokens)
        spans.append((end - tokens, end))
        if end >= unseen:
            return spans
        start += tokens - overlap


def part_prompt(prompt: list[int], doc_start: int, doc_end: int, span: tuple[int, int]) -> list[int]:
    """The prompt of one part: the prompt's tokens before the document, the part's, and those after it."""
    return [*prompt[:doc_start], *prompt[doc_start + span[0]:doc_start + span[1]], *prompt[doc_end:]]


@dataclass(frozen=True)
class Answer:
    """One answer to a document: from the whole (span None) or from a part (its document-token range)."""

    span: tuple[int, int] | None
    mean_logprob: float | None  # over its output tokens under the trunk; None where they are not scored
    fields: dict | None = None  # extraction: the checked JSON object; None where the answer was refused
    confidence: dict[str, float] | None = None  # extraction: field -> its least likely token's probability


def _rank(answers: list[Answer], key) -> Answer | None:
    """The answer with the highest key (None keys never win), ties to the earlier one (the whole comes first)."""
    best, best_key = None, None
    for a in answers:
        k = key(a)
        if k is not None and (best_key is None or k > best_key):
            best, best_key = a, k
    return best


def merge_extractions(answers: list[Answer], names: list[str]) -> tuple[dict, dict[str, float], dict] | None:
    """Per field the value of the answer surest of it: (the JSON object, each field's confidence, and the parts
    the values came from: field -> [start, end) for those not from the whole). None when no answer was valid.
    A field no valid answer scored takes the first valid answer's value (the whole's, when it is valid)."""
    valid = [a for a in answers if a.fields is not None]
    if not valid:
        return None
    merged, confidence, sources = {}, {}, {}
    for name in names:
        best = _rank(valid, lambda a, n=name: (a.confidence or {}).get(n)) or valid[0]
        merged[name] = best.fields.get(name)  # type: ignore[union-attr]
        if best.confidence and name in best.confidence:
            confidence[name] = best.confidence[name]
        if best.span is not None:
            sources[name] = list(best.span)
    return merged, confidence, sources


def pick_summary(answers: list[Answer]) -> int:
    """The index of the answer with the highest mean log-probability (the first, the whole's, where none is
    scored)."""
    best = _rank(answers, lambda a: a.mean_logprob)
    return next(i for i, a in enumerate(answers) if a is best) if best is not None else 0


def dumps_sources(sources: dict) -> str | None:
    return json.dumps(sources, sort_keys=True) if sources else None
