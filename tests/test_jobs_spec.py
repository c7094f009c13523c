"""The job schema: defaults, overrides, and errors that name the field."""

from __future__ import annotations

import pytest
from clover_batch.jobs.cli import app
from clover_batch.jobs.spec import JobSpec, JobSpecError, apply_overrides, load_job, parse_job
from typer.testing import CliRunner

MINIMAL = {"name": "j", "input": {"uri": "in/"}, "output": {"uri": "out/"}, "task": {"kind": "summarize"}}


def _problems(raw) -> list[str]:
    with pytest.raises(JobSpecError) as e:
        parse_job(raw)
    return e.value.problems


def test_every_field_has_a_description():
    def walk(model, prefix):
        for name, info in model.model_fields.items():
            assert info.description, f"{prefix}{name} has no description"
            ann = info.annotation
            for sub in getattr(ann, "__args__", (ann,)):
                if isinstance(sub, type) and hasattr(sub, "model_fields"):
                    walk(sub, f"{prefix}{name}.")

    walk(JobSpec, "")


def test_minimal_job_gets_documented_defaults():
    spec = parse_job(MINIMAL)
    assert spec.model.source == "tiny"
    assert spec.model.dtype == "auto"  # the checkpoint's dtype where the device is fast (model/precision.py)
    assert spec.resources.replicas == 1
    assert spec.input.include == ["*"]
    assert spec.task.instruction == "Summarize the document."


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"input": {"uri": "in/", "colour": "red"}}, "input.colour", "Extra inputs"),
        ({"resources": {"replicas": "two"}}, "resources.replicas", "valid integer"),
        ({"resources": {"replicas": 0}}, "resources.replicas", "greater than or equal to 1"),
        ({"output": None}, "output", "valid dictionary"),
        ({"model": {"dtype": "float16"}}, "model.dtype", "'float32' or 'bfloat16'"),
        ({"task": {"kind": "translate"}}, "task", "does not match any of the expected tags"),
        ({"task": {"kind": "extract", "fields": {}}}, "task.fields", "at least 1 item"),
        ({"task": {"kind": "extract", "fields": {"a b": {"type": "string"}}}}, "task", "must be an identifier"),
        ({"decode": {"threshold": 1.5}}, "decode.threshold", "less than or equal to 1"),
    ],
    ids=[
        "unknown-field",
        "wrong-type",
        "out-of-range",
        "null-output",
        "fp16-refused",
        "bad-task-kind",
        "extract-no-fields",
        "bad-field-name",
        "bad-threshold",
    ],
)
def test_errors_name_the_field(change, field, words):
    problems = _problems({**MINIMAL, **change})
    assert any(p.startswith(f"{field}:") and words in p for p in problems), problems


def test_missing_output_is_named():
    raw = {k: v for k, v in MINIMAL.items() if k != "output"}
    assert _problems(raw) == ["output: Field required"]


def test_overrides_parse_yaml_scalars_and_create_paths():
    raw = apply_overrides({**MINIMAL}, ["resources.replicas=3", "decode.temperature=0.5", "input.include=[a, b]"])
    spec = parse_job(raw)
    assert spec.resources.replicas == 3
    assert spec.decode.temperature == 0.5
    assert spec.input.include == ["a", "b"]


def test_bad_override_syntax():
    with pytest.raises(JobSpecError, match=r"expected key\.path=value"):
        apply_overrides({}, ["replicas"])


def test_example_jobs_are_valid():
    for name in ("summarize-local", "extract-local"):
        spec = load_job(f"jobs/examples/{name}.yaml")
        assert spec.model.source == "jobs/examples/demo"
    fields = load_job("jobs/examples/extract-local.yaml").task.fields
    assert fields["parties"].type == "list[string]" and not fields["deadline"].required


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("name: j\ninput: {uri: in}\noutput: {uri: out}\ntask: {kind: summarize}\nretries: 3\n", "retries"),
        (
            "name: j\ninput: {uri: in}\noutput: {uri: out}\ntask: {kind: summarize}\ndecode: {max_new_tokens: lots}\n",
            "decode.max_new_tokens",
        ),
        ("name: j\ninput: {uri: in}\ntask: {kind: summarize}\n", "output"),
    ],
    ids=["unknown-field", "wrong-type", "missing-output"],
)
def test_cli_validate_invalid_job_exits_nonzero_naming_field(tmp_path, body, field):
    job = tmp_path / "job.yaml"
    job.write_text(body)
    result = CliRunner().invoke(app, ["validate", str(job)])
    assert result.exit_code == 2
    assert f"{field}:" in result.output


def test_cli_validate_good_job_with_set(tmp_path):
    result = CliRunner().invoke(
        app, ["validate", "jobs/examples/summarize-local.yaml", "--set", "resources.replicas=2"]
    )
    assert result.exit_code == 0, result.output
    assert '"replicas": 2' in result.output


def test_decode_section_is_the_engines_decode_options():
    """The job's decode section is built from DecodeOptions itself: same fields, defaults and bounds, and it gives
    the typed object the engine takes."""
    import dataclasses

    from clover_batch.jobs.spec import DecodeSpec
    from clover_batch.model import DecodeOptions

    fields = {f.name: f.default for f in dataclasses.fields(DecodeOptions)}
    assert {name: info.default for name, info in DecodeSpec.model_fields.items()} == fields
    spec = parse_job({**MINIMAL, "decode": {"tokens_per_step": 4, "stop_token_ids": [5, 6], "temperature": 1}})
    options = spec.decode.options()
    assert options == DecodeOptions(tokens_per_step=4, stop_token_ids=(5, 6), temperature=1.0)
    assert _problems({**MINIMAL, "decode": {"top_p": 0}}) == ["decode.top_p: Input should be greater than 0"]
    assert _problems({**MINIMAL, "decode": {"tokens_per_stp": 4}}) == ["decode.tokens_per_stp: Extra inputs are not "
                                                                       "permitted"]


@pytest.mark.parametrize(("options", "message"), [
    (dict(threshold=1.5), "threshold must be <= 1, got 1.5"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer, got True"),
    (dict(temperature="hot"), "temperature must be a number, got 'hot'"),
    (dict(stop_token_ids=[1, "x"]), "stop_token_ids must be a list of integers"),
    (dict(window_tokens=0), "window_tokens must be >= 1, got 0"),
], ids=["threshold", "max-new-tokens", "bool-for-int", "str-for-float", "stop-ids", "window"])
def test_decode_options_fail_where_they_are_written(options, message):
    from clover_batch.model import DecodeOptions

    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        DecodeOptions(**options)


def test_decode_options_that_do_not_fit_the_model_fail_before_any_work(tmp_path):
    from clover_batch.jobs.runner import run

    spec = parse_job({**MINIMAL, "input": {"uri": str(tmp_path)}, "output": {"uri": str(tmp_path / "out")},
                      "decode": {"tokens_per_step": 9}})
    message = r"decode: tokens_per_step must be in \[1, block_size=8\], got 9 \(model tiny\)"
    with pytest.raises(ValueError, match=message):
        run(spec)
    assert not (tmp_path / "out").exists()
