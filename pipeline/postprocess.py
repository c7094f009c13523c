"""Postprocessing of answers: extraction answers are parsed as JSON and checked against the job's fields, and each
field's value gets the model's confidence in it (the probability of its least likely token under the trunk)."""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TYPE_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "list[string]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}


@dataclass(frozen=True)
class FieldRule:
    """One field an extraction answer must give."""

    name: str
    type: str  # a key of _TYPE_CHECKS
    description: str = ""
    required: bool = True


@dataclass(frozen=True)
class Extraction:
    """A checked extraction: normalized JSON text, or why the answer was refused."""

    output_json: str | None
    error: str | None


def extraction_instruction(instruction: str, fields: list[FieldRule]) -> str:
    lines = [instruction, "Answer with one JSON object and nothing else, with these keys:"]
    for f in fields:
        optional = "" if f.required else ", may be null"
        lines.append(f'- "{f.name}" ({f.type}{optional}): {f.description}'.rstrip(": "))
    return "\n".join(lines)


_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def strip_thinking(text: str) -> str:
    """The answer without the model's reasoning: `<think>...</think>` blocks removed; text before a lone
    `</think>` (a template that opened the block in the prompt) and after a lone `<think>` (reasoning cut off by
    max_new_tokens: no answer) dropped."""
    text = _THINK.sub("", text)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    return text.strip()


_FENCE = re.compile(r"```(?:json)?")


def _first_json_object(text: str) -> Any:
    return _find_json_object(_FENCE.sub("", text))[0]


def _find_json_object(text: str) -> tuple[Any, int, int]:
    """The first `{` of `text` that starts a whole JSON object: (value, start, end)."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            value, end = decoder.raw_decode(text, match.start())
            return value, match.start(), end
        except (json.JSONDecodeError, RecursionError):  # RecursionError: a degenerate answer nesting "[[[[..."
            continue
    raise ValueError("the answer contains no JSON object")


def field_spans(answer: str) -> dict[str, tuple[int, int]]:
    """Character spans [start, end) in `answer` of the top-level values of the JSON object check_extraction reads
    (the first whole one, code fences aside); {} when there is none. A key given twice: its last value, as JSON."""
    keep = list(range(len(answer)))  # cleaned position -> position in the answer
    for m in reversed(list(_FENCE.finditer(answer))):
        del keep[m.start():m.end()]
    text = "".join(answer[i] for i in keep)
    try:
        _, start, end = _find_json_object(text)
    except ValueError:
        return {}

    def skip(pos: int) -> int:  # past JSON whitespace
        while text[pos] in " \t\n\r":
            pos += 1
        return pos

    decoder, spans, pos = json.JSONDecoder(), {}, skip(start + 1)
    while text[pos] != "}":  # the object decoded whole, so its members are well formed: "key" : value [,]
        key, pos = decoder.raw_decode(text, pos)
        pos = skip(skip(pos) + 1)  # past the colon
        _, value_end = decoder.raw_decode(text, pos)
        spans[key] = (keep[pos], keep[value_end - 1] + 1)
        pos = skip(value_end)
        if text[pos] == ",":
            pos = skip(pos + 1)
    assert pos == end - 1
    return spans


def token_ends(decode: Callable[[list[int]], str], tokens: list[int]) -> list[int]:
    """Where each token's text ends in decode(tokens): the length of the decoded prefix through it (never less
    than the token before's: a token that ends inside a character has the character's end once it is whole)."""
    ends, last = [], 0
    for j in range(len(tokens)):
        last = max(last, len(decode(tokens[:j + 1])))
        ends.append(last)
    return ends


def _least(ends: list[int], logprobs: list[float], start: int, end: int) -> float | None:
    """The lowest log-probability among the tokens whose text overlaps characters [start, end)."""
    least = None
    # token j covers [ends[j-1], ends[j]); one that adds no character counts with the character it completes. The
    # ends are sorted: start at the first token ending after `start`, stop at the first starting at `end` or later
    for j in range(bisect.bisect_right(ends, start), len(ends)):
        lo = ends[j - 1] if j else 0
        if ends[j] == lo:
            lo -= 1
        if lo >= end:
            break
        if least is None or logprobs[j] < least:
            least = logprobs[j]
    return least


def field_confidence(text: str, answer: str, tokens: list[int], logprobs: list[float],
                     decode: Callable[[list[int]], str], names: list[str]) -> dict[str, float] | None:
    """Each of `names` the answer gives: the probability under the model of the least likely token of its value
    (the tokens whose text overlaps the value's characters), rounded to 4 places.

    text: decode(tokens), the whole output; answer: what check_extraction read (text with the reasoning
    stripped), which must lie whole in `text`. None when it does not (reasoning inside the answer) or when the
    logprobs are not one per token."""
    at = text.rfind(answer)
    if len(logprobs) != len(tokens) or at < 0:
        return None
    ends = token_ends(decode, tokens)
    out = {}
    for name, (start, end) in field_spans(answer).items():
        least = _least(ends, logprobs, at + start, at + end) if name in names else None
        if least is not None:
            out[name] = round(math.exp(least), 4)
    return out


_WORD = re.compile(r"\S+")
_EDGE = "\"'.,;:!?()[]{}"


def uncertain_words(text: str, answer: str, tokens: list[int], logprobs: list[float],
                    decode: Callable[[list[int]], str], below: float) -> list[str] | None:
    """The words of `answer` (runs of non-space, their edge punctuation stripped) whose least likely token had a
    probability under the model below `below`, in order. text, answer: as field_confidence; None where it gives
    None."""
    at = text.rfind(answer)
    if len(logprobs) != len(tokens) or at < 0:
        return None
    ends = token_ends(decode, tokens)
    out = []
    for m in _WORD.finditer(answer):
        least = _least(ends, logprobs, at + m.start(), at + m.end())
        word = m.group().strip(_EDGE)
        if word and least is not None and math.exp(least) < below:
            out.append(word)
    return out


def check_extraction(answer: str, fields: list[FieldRule]) -> Extraction:
    """Parse the first JSON object in `answer` and check each field's presence and type."""
    try:
        value = _first_json_object(answer)
    except ValueError as e:
        return Extraction(None, str(e))
    problems, clean = [], {}
    for f in fields:
        item = value.get(f.name)
        if item is None:
            if f.required:
                problems.append(f"missing field '{f.name}'")
            clean[f.name] = None
        elif not _TYPE_CHECKS[f.type](item):
            problems.append(f"field '{f.name}' should be {f.type}, got {type(item).__name__}")
        else:
            clean[f.name] = item
    if problems:
        return Extraction(None, "; ".join(problems))
    return Extraction(json.dumps(clean, ensure_ascii=False, sort_keys=True), None)
