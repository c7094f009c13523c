"""Postprocessing of answers: extraction answers are parsed as JSON and checked against the job's fields."""

from __future__ import annotations

import json
import re
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


def _first_json_object(text: str) -> Any:
    text = re.sub(r"```(?:json)?", "", text)
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
            return value
        except (json.JSONDecodeError, RecursionError):  # RecursionError: a degenerate answer nesting "[[[[..."
            continue
    raise ValueError("the answer contains no JSON object")


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
