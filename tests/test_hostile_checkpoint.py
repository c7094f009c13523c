"""A checkpoint is untrusted data: its chat template, config.json and tensors are checked on the driver before any
work, and a config asking for more than the device has fails before allocating."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from clover_batch.jobs.cli import _ray_message, app
from clover_batch.jobs.model_cli import write_checkpoint
from clover_batch.jobs.preflight import check_model
from clover_batch.jobs.spec import parse_job
from clover_batch.model import CheckpointError, ConfigError, check_memory, from_preset, load_model
from clover_batch.model.weights import weight_bytes
from clover_batch.pipeline.chat_template import ChatTemplateError
from conftest import job_raw, write_good_docs, write_job
from test_chat_template import _escape_templates
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    if config_changes:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_changes)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("form", ["self-globals", "subclasses-via-attr", "cycler-globals"])
def test_escaping_template_stops_validate_run_and_generate_before_any_work(tiny_checkpoint, tmp_path, form):
    marker = tmp_path / "pwned"
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt")
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": _escape_templates(marker)[form]}))
    docs, out = tmp_path / "docs", tmp_path / "out"
    write_good_docs(docs)
    job = write_job(tmp_path / "job.yaml", job_raw(str(docs), str(out), model={"source": str(ckpt)}))
    expected = f"{ckpt}/tokenizer_config.json: chat_template refused: it tries to reach Python internals"

    runner = CliRunner()
    validated = runner.invoke(app, ["validate", str(job)])
    assert validated.exit_code == 2 and expected in " ".join(validated.output.split()), validated.output
    assert "valid" not in validated.output.splitlines()[-1]
    ran = runner.invoke(app, ["run", str(job)])
    assert ran.exit_code == 1 and "run failed: ChatTemplateError: " + expected in " ".join(ran.output.split())
    assert not out.exists()  # stopped before the output lock, Ray or any worker
    generated = runner.invoke(app, ["generate", "--model", str(ckpt), "--prompt", "hello"])
    assert generated.exit_code == 2 and expected in " ".join(generated.output.split())
    assert not marker.exists()


def test_escaping_template_in_an_s3_checkpoint_is_named_by_its_uri(tiny_checkpoint, s3_server, s3_bucket, tmp_path):
    bucket, client = s3_bucket
    for f in tiny_checkpoint.iterdir():
        client.upload_file(str(f), bucket, f"ckpt/{f.name}")
    template = _escape_templates(tmp_path / "pwned")["self-globals"]
    client.put_object(Bucket=bucket, Key="ckpt/tokenizer_config.json", Body=json.dumps({"chat_template": template}))
    spec = parse_job(job_raw(str(tmp_path), str(tmp_path / "out"),
                             model={"source": f"s3://{bucket}/ckpt", "storage_options": s3_server}))
    with pytest.raises(ChatTemplateError, match=rf"^s3://{bucket}/ckpt/tokenizer_config\.json: chat_template refused"):
        check_model(spec)
    assert not (tmp_path / "pwned").exists()


def test_config_not_matching_its_tensors_fails_on_the_driver_naming_each(tiny_checkpoint, tmp_path):
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt", hidden_size=2 * config["hidden_size"])
    spec = parse_job(job_raw(str(tmp_path), str(tmp_path / "out"), model={"source": str(ckpt)}))
    with pytest.raises(CheckpointError) as err:
        check_model(spec)
    message = str(err.value)
    assert message.startswith(f"checkpoint {ckpt} does not match its config:")
    assert f"model.embed_tokens.weight: shape [{config['vocab_size']}, {config['hidden_size']}], expected " \
           f"[{config['vocab_size']}, {2 * config['hidden_size']}]" in message
    assert message.count("shape [") >= 10  # every mismatched tensor, from the headers, not just the first
    with pytest.raises(CheckpointError, match="does not match its config"):
        load_model(ckpt)


def test_config_asking_for_more_memory_than_the_device_fails_before_allocating(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt", num_experts=100_000, moe_intermediate_size=65_536)
    with pytest.raises(ConfigError, match=rf"^model {ckpt}: its config asks for [\d,.]+ GiB of weights in float32 "
                                          r"\([\d,.]+B parameters\), more than cpu has free \([\d,.]+ GiB\); nothing "
                                          r"was loaded"):
        load_model(ckpt)
    result = CliRunner().invoke(app, ["generate", "--model", str(ckpt), "--prompt", "hi"])
    assert result.exit_code == 2 and "more than cpu has free" in result.output


def test_check_memory_against_a_given_budget():
    config = from_preset("tiny")
    need = weight_bytes(config, torch.float32)
    assert need == config.parameter_counts()[0] * 4
    assert weight_bytes(config, torch.bfloat16) == need // 2
    check_memory(config, dtype=torch.float32, device=torch.device("cpu"), source="tiny", available=need)
    with pytest.raises(ConfigError, match=r"more than cpu has free"):
        check_memory(config, dtype=torch.float32, device=torch.device("cpu"), source="tiny", available=need - 1)
    half = (0, config.num_experts // 2)  # an expert-parallel rank holds only its experts
    check_memory(config, dtype=torch.float32, device=torch.device("cpu"), source="tiny", expert_range=half,
                 available=weight_bytes(config, torch.float32, half))
    loaded = load_model("tiny", expert_range=half)
    assert sum(p.numel() for p in loaded.parameters()) * 4 == weight_bytes(config, torch.float32, half)


def test_tokenizer_larger_than_the_vocabulary_is_refused(tiny_checkpoint, tmp_path):
    from tokenizers import Tokenizer

    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt")
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tok.add_tokens([f"<extra_{i}>" for i in range(600)])
    tok.save(str(ckpt / "tokenizer.json"))
    spec = parse_job(job_raw(str(tmp_path), str(tmp_path / "out"), model={"source": str(ckpt)}))
    with pytest.raises(ValueError, match=rf"^{ckpt}/tokenizer\.json: 860 tokens, more than the model's vocab_size="):
        check_model(spec)


def test_oversized_config_json_is_refused_unread(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt")
    with open(ckpt / "config.json", "a") as f:
        f.truncate(20 * 2**20)  # a sparse 20 MiB file: refused by its size
    with pytest.raises(ConfigError, match=r"config\.json: 20,971,520 bytes, over the limit"):
        load_model(ckpt)


def test_a_replica_that_cannot_load_is_reported_by_its_cause(ray_session):
    """Ray reports a failed actor constructor as ActorDiedError with the traceback as text; the CLI shows the
    cause (the ConfigError naming the problem), not Ray's first line."""
    import ray

    @ray.remote(num_cpus=0)
    class Replica:
        def __init__(self):
            raise ConfigError("model /ckpt: its config asks for 11.0 GiB of weights, more than cpu has free")

        def ping(self):
            return 1

    with pytest.raises(ray.exceptions.RayActorError) as err:
        ray.get(Replica.remote().ping.remote())
    assert _ray_message(err.value) == ("ConfigError: model /ckpt: its config asks for 11.0 GiB of weights, more than "
                                       f"cpu has free (in a Ray worker: {type(err.value).__name__})")


def test_valid_checkpoint_passes_validate(tiny_checkpoint, tmp_path):
    job = write_job(tmp_path / "job.yaml", job_raw(str(tmp_path), str(tmp_path / "out"),
                                                   model={"source": str(tiny_checkpoint)}))
    result = CliRunner().invoke(app, ["validate", str(job)])
    assert result.exit_code == 0 and result.output.strip().endswith("valid"), result.output
