"""Extraction answers: JSON found, parsed and checked against the fields."""

from __future__ import annotations

import json
import math

import pytest
from clover_batch.pipeline.postprocess import (
    FieldRule,
    check_extraction,
    extraction_instruction,
    field_confidence,
    field_spans,
    strip_thinking,
    token_ends,
    uncertain_words,
)

FIELDS = [
    FieldRule("title", "string", "the title"),
    FieldRule("amount", "number"),
    FieldRule("count", "integer", required=False),
    FieldRule("signed", "boolean"),
    FieldRule("parties", "list[string]", required=False),
]


def test_instruction_lists_fields():
    text = extraction_instruction("Extract.", FIELDS)
    assert '- "title" (string): the title' in text
    assert '- "count" (integer, may be null)' in text


def test_good_answer_in_code_fence_with_chatter():
    answer = 'Sure!\n```json\n{"title": "Lease", "amount": 4200.5, "signed": true, "parties": ["A", "B"], "x": 1}\n```'
    got = check_extraction(answer, FIELDS)
    assert got.error is None
    assert json.loads(got.output_json) == {
        "title": "Lease",
        "amount": 4200.5,
        "count": None,
        "signed": True,
        "parties": ["A", "B"],
    }


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        ("no json here", "no JSON object"),
        ("{broken", "no JSON object"),
        ('{"title": "t", "amount": 1}', "missing field 'signed'"),
        ('{"title": 3, "amount": 1, "signed": false}', "field 'title' should be string, got int"),
        ('{"title": "t", "amount": true, "signed": false}', "field 'amount' should be number, got bool"),
        ('{"title": "t", "amount": 1, "signed": false, "count": 1.5}', "field 'count' should be integer"),
        ('{"title": "t", "amount": 1, "signed": false, "parties": [1]}', "field 'parties' should be list[string]"),
    ],
)
def test_bad_answers_are_refused(answer, error):
    got = check_extraction(answer, FIELDS)
    assert got.output_json is None
    assert error in got.error


def test_degenerate_deeply_nested_answer_is_refused_not_raised():
    checked = check_extraction('{"title": ' + "[" * 5000, FIELDS)
    assert checked.output_json is None and checked.error == "the answer contains no JSON object"


def test_an_unexpected_failure_marks_only_that_document():
    from clover_batch.pipeline.rows import guarded

    rows = [{"source_uri": "a.txt", "status": "ok", "error": None, "text": "x"},
            {"source_uri": "b.txt", "status": "ok", "error": None, "text": "y"}]
    for row in rows:
        with guarded(row, "tokenize"):
            if row["source_uri"] == "a.txt":
                raise TypeError("boom")
            row["input_tokens"] = 1
    assert rows[0]["status"] == "internal_error" and rows[0]["error"] == "tokenize: TypeError: boom"
    assert rows[0]["text"] is None  # payload dropped like any failed row
    assert rows[1]["status"] == "ok" and rows[1]["input_tokens"] == 1


@pytest.mark.parametrize("answer,expected", [
    ("<think>\nthe total is 5\n</think>\n\n{\"total\": 5}", '{"total": 5}'),
    ("<think>\n\n</think>\n\nA lease.", "A lease."),
    ("reasoning the template opened\n</think>\nA lease.", "A lease."),  # <think> was in the prompt
    ("A lease. <think>and then it started to think again", "A lease."),  # cut by max_new_tokens
    ("<think>never finished", ""),
    ("No thinking at all.", "No thinking at all."),
], ids=["block", "empty-block", "opened-in-prompt", "reopened", "unfinished", "none"])
def test_strip_thinking(answer, expected):
    assert strip_thinking(answer) == expected


def test_extraction_reads_the_answer_after_the_thinking():
    fields = [FieldRule("total", "integer")]
    answer = strip_thinking('<think>\nmaybe {"total": 9}?\n</think>\n{"total": 5}')
    assert check_extraction(answer, fields).output_json == '{"total": 5}'


# ---- field confidence ---------------------------------------------------------------------------------------------


def _spans_text(answer: str) -> dict[str, str]:
    return {k: answer[s:e] for k, (s, e) in field_spans(answer).items()}


def test_field_spans_are_the_values_check_extraction_reads():
    answer = 'Sure!\n```json\n{"title": "Lease, \\"B\\"", "amount" : 4200.5,"signed":true, "parties": ["A", "B"]}\n```'
    assert _spans_text(answer) == {"title": '"Lease, \\"B\\""', "amount": "4200.5", "signed": "true",
                                   "parties": '["A", "B"]'}
    # the first whole object, as check_extraction: a broken one before it is skipped; a key given twice: the last
    assert _spans_text('{"title": oops} then {"title": "x", "n": {"a": [1, 2]}, "title": null}') == \
        {"title": "null", "n": '{"a": [1, 2]}'}
    # a code fence inside a value: the span is the value's place in the answer itself
    answer = '{"title": "a```b", "amount": 1}'
    assert json.loads(check_extraction(answer, FIELDS[:2]).output_json)["title"] == "ab"
    assert _spans_text(answer) == {"title": '"a```b"', "amount": "1"}
    assert _spans_text(' {\n "a" :\t[1, 2] ,\n "b": {"c": "}"} }') == {"a": "[1, 2]", "b": '{"c": "}"}'}
    assert field_spans("no object here") == field_spans("{ }") == {}


@pytest.fixture(scope="module")
def demo_builder():
    from clover_batch.jobs.demo_model import DEMO_DIR
    from clover_batch.pipeline.tokenizer import PromptBuilder

    return PromptBuilder(str(DEMO_DIR))


def test_field_confidence_is_the_least_likely_token_of_each_value(demo_builder):
    """With the demo checkpoint's tokenizer: each field gets exp of the lowest log-probability among the tokens
    whose text overlaps its value, whatever the reasoning before the answer; a field the answer lacks gets none."""
    answer = '{"document_type": "invoice", "parties": ["Stonebridge Textiles SRL", "Silverline Energy AG"], ' \
             '"amount_eur": 90940}'
    text = "<think>the buyer is Silverline</think>\n" + answer
    ids = demo_builder.encode(text, specials=False)
    assert demo_builder.decode(ids) == text
    ends = token_ends(demo_builder.decode, ids)
    assert ends[-1] == len(text) and ends == sorted(ends)
    want = {}
    for name, (s, e) in field_spans(answer).items():
        at = len(text) - len(answer)
        want[name] = [j for j in range(len(ids)) if (ends[j - 1] if j else 0) < at + e and ends[j] > at + s]
    assert "".join(demo_builder.decode([ids[j]]) for j in want["amount_eur"]).strip() == "90940"
    names = ["document_type", "date", "parties", "amount_eur"]
    # every token at -0.01, but one token of each field lower, each its own value
    for low, field in ((-3.0, "parties"), (-0.5, "amount_eur"), (-2.0, "document_type")):
        logprobs = [-0.01] * len(ids)
        logprobs[want[field][len(want[field]) // 2]] = low
        got = field_confidence(text, strip_thinking(text), ids, logprobs, demo_builder.decode, names)
        assert set(got) == {"document_type", "parties", "amount_eur"}  # no "date" in the answer
        for name in got:
            assert got[name] == pytest.approx(math.exp(low if name == field else -0.01), abs=1e-4), (field, name)
    # a token of the reasoning or of a key counts for no field
    logprobs = [-0.01] * len(ids)
    logprobs[0] = logprobs[1] = -5.0  # "<think>"
    key = next(j for j in range(len(ids)) if j not in {i for v in want.values() for i in v}
                 and ends[j] > len(text) - len(answer) + 1)
    logprobs[key] = -5.0
    got = field_confidence(text, strip_thinking(text), ids, logprobs, demo_builder.decode, names)
    assert min(got.values()) == pytest.approx(math.exp(-0.01), abs=1e-4)
    # logprobs that are not one per token, or an answer not found whole in the output: no confidence
    assert field_confidence(text, strip_thinking(text), ids, logprobs[:-1], demo_builder.decode, names) is None
    assert field_confidence(text, '{"amount_eur": 1}', ids, logprobs, demo_builder.decode, names) is None


def test_uncertain_words_are_the_words_with_an_unlikely_token(demo_builder):
    summary = "Invoice INV-1349 from Stonebridge Textiles SRL to Silverline Textiles SRL for 90,940 EUR is due."
    text = "<think>the buyer</think>\n" + summary
    ids = demo_builder.encode(text, specials=False)
    assert demo_builder.decode(ids) == text
    ends = token_ends(demo_builder.decode, ids)
    at = len(text) - len(summary)
    second = summary.index("Textiles", summary.index("Silverline"))  # the buyer's second word, the invented one
    logprobs = [-0.01] * len(ids)
    hit = next(j for j in range(len(ids)) if ends[j] > at + second + 2)  # a token inside that word
    logprobs[hit] = math.log(0.3)
    logprobs[0] = math.log(0.01)  # the reasoning is not the answer
    logprobs[-1] = math.log(0.2)  # the final "due." token: the word without its period
    got = uncertain_words(text, strip_thinking(text), ids, logprobs, demo_builder.decode, 0.5)
    assert got == ["Textiles", "due"]
    assert uncertain_words(text, strip_thinking(text), ids, logprobs, demo_builder.decode, 0.25) == ["due"]
    assert uncertain_words(text, strip_thinking(text), ids, logprobs, demo_builder.decode, 0.0) == []
    assert uncertain_words(text, strip_thinking(text), ids, logprobs[1:], demo_builder.decode, 0.5) is None
