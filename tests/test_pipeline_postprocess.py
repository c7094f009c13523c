"""Extraction answers: JSON found, parsed and checked against the fields."""

from __future__ import annotations

import json

import pytest
from clover_batch.pipeline.postprocess import FieldRule, check_extraction, extraction_instruction, strip_thinking

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
