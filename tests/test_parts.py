"""task.parts: a document longer than the attention window answered whole and from its parts, the surest kept
(pipeline/parts.py, the infer and postprocess stages, the engine loop's records)."""

from __future__ import annotations

import asyncio
import itertools
import json

import pyarrow as pa
import pytest
from clover_batch.jobs.demo_corpus import held_out, held_out_long
from clover_batch.jobs.demo_model import DEMO_DIR, EXTRACT_FIELDS, job_instructions
from clover_batch.jobs.spec import JobSpecError, load_job
from clover_batch.pipeline.parts import Answer, merge_extractions, part_prompt, part_spans, pick_summary
from clover_batch.pipeline.postprocess import FieldRule, check_extraction, field_confidence
from clover_batch.pipeline.rows import WORK_SCHEMA
from clover_batch.pipeline.tokenizer import PromptBuilder


@pytest.mark.parametrize(("doc", "tokens", "overlap"), [(600, 128, 64), (129, 128, 0), (1000, 100, 30),
                                                        (257, 128, 127), (2000, 128, 0)])
def test_parts_cover_what_the_last_window_does_not(doc, tokens, overlap):
    """384-token window, 8 template tokens after the document, answers of up to 96: every answer token sees the
    document's last 280 tokens; the parts cover every token before those, in order, each `tokens` long."""
    spans = part_spans(doc, 8, 384, 96, tokens, overlap)
    unseen = doc - 280
    if unseen <= 0 or doc <= tokens:
        assert spans == []
        return
    assert spans[0][0] == 0 and all(e - s == tokens and e <= doc for s, e in spans)
    for (s0, e0), (s1, _) in itertools.pairwise(spans):
        assert s0 < s1 <= e0 - overlap  # in order, each sharing at least `overlap` tokens with the one before
    covered = set().union(*(range(s, e) for s, e in spans))
    assert set(range(unseen)) <= covered
    assert spans[-2][1] < unseen if len(spans) > 1 else True  # no part beyond the one that reaches the seen tokens


def test_only_a_document_the_last_window_does_not_see_whole_is_split():
    assert part_spans(280, 8, 384, 96, 128, 64) == []  # attention sees all of it from every answer token
    assert part_spans(281, 8, 384, 96, 128, 64) == [(0, 128)]
    assert part_spans(600, 8, 384, 96, 0, 0) == []  # task.parts off
    assert part_spans(600, 8, 384, 600, 128, 0) == [(0, 128), (128, 256), (256, 384), (384, 512), (472, 600)]
    assert part_spans(100, 8, 32, 96, 128, 0) == []  # the document is shorter than a part: the whole is that part


def test_a_part_prompt_is_the_prompt_with_only_that_part_of_the_document():
    builder = PromptBuilder(str(DEMO_DIR))
    instruction = job_instructions().extract
    doc = held_out_long(1)[0]
    prompt = builder.build(instruction, doc.text)
    start, end = builder.document_span(instruction, len(prompt))
    doc_ids = builder.encode(doc.text, specials=False)
    assert prompt[start:end] == doc_ids
    empty = builder.build(instruction, "")
    spans = part_spans(len(doc_ids), len(prompt) - end, 384, 96, 128, 64)
    assert spans
    for span in spans:
        ids = part_prompt(prompt, start, end, span)
        assert ids == [*empty[:start], *doc_ids[span[0]:span[1]], *empty[start:]]


def test_merge_keeps_per_field_the_answer_surest_of_it():
    whole = Answer(None, -0.5, {"a": 1, "b": "x", "c": None}, {"a": 0.2, "b": 0.9, "c": 0.5})
    first = Answer((0, 128), -0.2, {"a": 2, "b": "y", "c": 3}, {"a": 0.95, "b": 0.9, "c": 0.4})
    refused = Answer((64, 192), -0.1)  # not valid JSON: none of its fields count, whatever its score
    second = Answer((128, 256), -0.9, {"a": 3, "b": "z", "c": 4}, {"a": 0.3, "b": 0.1, "c": 0.8})
    values, confidence, sources = merge_extractions([whole, first, refused, second], ["a", "b", "c"])
    assert values == {"a": 2, "b": "x", "c": 4}  # b: a tie goes to the whole
    assert confidence == {"a": 0.95, "b": 0.9, "c": 0.8}
    assert sources == {"a": [0, 128], "c": [128, 256]}
    assert merge_extractions([Answer(None, -1.0), refused], ["a"]) is None
    # a field no answer scored (logprobs not given) keeps the first valid answer's value
    unscored = [Answer(None, None, {"a": 1}, None), Answer((0, 128), None, {"a": 2}, None)]
    assert merge_extractions(unscored, ["a"]) == ({"a": 1}, {}, {})
    assert pick_summary([whole, first, refused, second]) == 2  # the highest mean log-probability
    assert pick_summary([Answer(None, None), Answer((0, 128), None)]) == 0  # none scored: the whole


def test_parts_are_checked_in_the_job(tmp_path):
    base = ["input.uri=/tmp/in", f"output.uri={tmp_path}"]
    spec = load_job("jobs/examples/summarize-local.yaml", base)
    assert (spec.task.parts.tokens, spec.task.parts.overlap) == (128, 0)
    assert load_job("jobs/examples/summarize-local.yaml", [*base, "task.parts=null"]).task.parts is None
    with pytest.raises(JobSpecError, match=r"task\.parts.*overlap=128 must be less than tokens=128"):
        load_job("jobs/examples/summarize-local.yaml", [*base, "task.parts.overlap=128"])
    with pytest.raises(JobSpecError, match=r"task\.parts\.tokens"):
        load_job("jobs/examples/extract-local.yaml", [*base, "task.parts.tokens=8"])


def _rows(prompts: list[list[int]], spans: list[tuple[int, int]]) -> pa.Table:
    rows = [{f.name: None for f in WORK_SCHEMA} | {"doc_id": f"d{i}", "source_uri": f"mem://d{i}", "status": "ok",
                                                    "prompt_ids": p, "doc_span": list(s), "input_tokens": len(p)}
            for i, (p, s) in enumerate(zip(prompts, spans, strict=True))]
    return pa.Table.from_pylist(rows, schema=WORK_SCHEMA)


@pytest.mark.parametrize("kind", ["extract", "summarize"])
def test_a_long_document_gets_the_surest_of_the_plain_references_answers(kind):
    """The infer and postprocess stages (the engine in verified mode, fp32, in this process) against the plain
    reference (generate_nocache, autoregressive) on the whole prompt and on each part's: the row is their merge."""
    from clover_batch.model import DecodeOptions, load_model
    from clover_batch.model.generate import generate_nocache
    from clover_batch.pipeline.stages import InferStage, ModelRef, PostprocessStage, TaskRef

    instructions = job_instructions()
    rules = tuple(FieldRule(n, f["type"], f["description"], f.get("required", True)) for n, f in EXTRACT_FIELDS.items())
    task = (TaskRef("extract", "Extract these fields from the document.", rules, 0.5, (128, 64)) if kind == "extract"
            else TaskRef("summarize", instructions.summarize, (), 0.5, (128, 64)))
    instruction = task.prompt_instruction()
    assert instruction == (instructions.extract if kind == "extract" else instructions.summarize)
    builder = PromptBuilder(str(DEMO_DIR))
    docs = [held_out_long(2)[1], next(d for d in held_out(8) if not d.extra["long"])]
    prompts = [builder.build(instruction, d.text) for d in docs]
    spans = [builder.document_span(instruction, len(p)) for p in prompts]
    model_ref = ModelRef(str(DEMO_DIR), "float32")
    decode = DecodeOptions(mode="verified", tokens_per_step=16, max_new_tokens=96, temperature=0.0)
    stage = InferStage(model_ref, decode, num_threads=1, max_slots=4, parts=(128, 64))
    inferred = asyncio.run(stage.infer(_rows(prompts, spans)))
    rows = PostprocessStage(model_ref, task, "job", "run")(inferred).to_pylist()

    model = load_model(str(DEMO_DIR))  # float32
    reference = DecodeOptions(mode="autoregressive", max_new_tokens=96, temperature=0.0)
    names = list(EXTRACT_FIELDS)
    for prompt, (start, end), row in zip(prompts, spans, rows, strict=True):
        assert row["status"] == "ok", row
        parts = part_spans(end - start, len(prompt) - end, 384, 96, 128, 64)
        assert row["parts"] == (len(parts) or None)
        answers = []  # (span, text, the generation)
        for span in [None, *parts]:
            gen = generate_nocache(model, part_prompt(prompt, start, end, span) if span else prompt, reference)
            answers.append((span, builder.decode(gen.tokens), gen))
        assert row["output_tokens"] == sum(len(g.tokens) for _, _, g in answers)
        if not parts:
            assert row["answer_parts"] is None
            assert row["output_text"] == answers[0][1]
            continue
        if kind == "summarize":
            means = [sum(g.token_logprobs) / len(g.token_logprobs) for _, _, g in answers]
            best = max(range(len(answers)), key=lambda i: (means[i], -i))
            assert row["output_text"] == answers[best][1]
            assert row["answer_parts"] == (json.dumps({"summary": list(answers[best][0])}) if best else None)
            assert row["mean_logprob"] == pytest.approx(means[best], abs=1e-4)
            continue
        expected, sources = {}, {}
        scored = []
        for span, text, gen in answers:
            checked = check_extraction(text, list(rules))
            if checked.output_json is not None:
                scored.append((span, json.loads(checked.output_json),
                               field_confidence(text, text, gen.tokens, gen.token_logprobs, builder.decode, names)))
        for name in names:
            best = max(range(len(scored)), key=lambda i: (scored[i][2][name], -i))
            expected[name] = scored[best][1][name]
            if scored[best][0] is not None:
                sources[name] = list(scored[best][0])
        assert json.loads(row["output_json"]) == expected
        assert json.loads(row["answer_parts"] or "{}") == sources
        confidence = json.loads(row["field_confidence"])
        assert set(confidence) == set(names)
        assert row["uncertain_fields"] == [n for n in names if confidence[n] < 0.5]
        # the parts changed the answer here; output_text is the model's text where one answer gave every field
        assert sources
        taken = {tuple(span) for span in sources.values()} | ({None} if len(sources) < len(names) else set())
        if len(taken) == 1:
            assert row["output_text"] == next(t for span, t, _ in answers if span == next(iter(taken)))
        else:
            assert row["output_text"] == row["output_json"]


def test_a_document_in_parts_is_on_record_from_its_first_request_in_to_its_last_out():
    """The engine loop's attempt records (a poison document's): a document entering as several requests (the whole
    and its parts, one name) is recorded once, and its record goes only when the last of them comes out."""
    from clover_batch.model import DecodeOptions, Engine, load_model
    from clover_batch.pipeline.serving import EngineLoop

    engine = Engine(load_model("tiny"), DecodeOptions(max_new_tokens=6, tokens_per_step=2), max_slots=1)
    events: list[tuple[str, str]] = []
    loop = EngineLoop(engine, on_admit=lambda entering: events.extend(("in", n) for n in entering),
                      on_leave=lambda names: events.extend(("out", n) for n in names))

    async def main():
        async def one(prompt, name):
            gen = await loop.submit(prompt, name=name)
            events.append(("result", name))
            return gen

        return await asyncio.gather(*(one([5 + i] * (4 + i), "doc") for i in range(3)), one([9] * 3, "other"))

    asyncio.run(main())
    assert [e for e in events if e[1] == "doc" and e[0] != "result"] == [("in", "doc"), ("out", "doc")]
    results = [i for i, e in enumerate(events) if e == ("result", "doc")]
    assert len(results) == 3 and events.index(("out", "doc")) > results[1]  # two came out before it went
    assert events.count(("in", "other")) == events.count(("out", "other")) == 1


def test_parts_are_refused_where_the_answers_are_not_scored(tmp_path):
    """The tiny preset decodes by block diffusion without logits_shift: its outputs get no log-probabilities, so
    nothing could pick among the parts' answers. Refused before the run, naming the fix."""
    from clover_batch.jobs.preflight import check_model

    base = ["input.uri=/tmp/in", f"output.uri={tmp_path}", "model.source=tiny", "model.dtype=float32"]
    spec = load_job("jobs/examples/summarize-local.yaml", [*base, "decode.mode=diffusion", "decode.tokens_per_step=2"])
    with pytest.raises(ValueError, match=r"task\.parts picks the answer .* decode\.mode diffusion on model tiny"):
        check_model(spec)
    check_model(load_job("jobs/examples/summarize-local.yaml", [*base, "decode.mode=diffusion",
                                                                  "decode.tokens_per_step=2", "task.parts=null"]))
    # a shifted diffusion model's causal logits score its outputs: accepted
    shifted = [*base[:2], "model.source=bench-clover", "decode.mode=diffusion", "decode.tokens_per_step=2"]
    check_model(load_job("jobs/examples/summarize-local.yaml", shifted))
