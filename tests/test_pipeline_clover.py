"""A job on a checkpoint in Clover's layout: block settings from the job, decode controls from the checkpoint's
generation_config.json, the preview operator in the replicas, and `mean_logprob` on every ok row."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
from clover_batch.jobs.model_cli import write_checkpoint
from clover_batch.jobs.runner import run
from clover_batch.jobs.spec import parse_job
from clover_batch.model import DecodeOptions, generate, load_model
from clover_batch.pipeline.tokenizer import PromptBuilder
from conftest import job_raw, requires_engine, write_good_docs

pytestmark = requires_engine


@pytest.fixture(scope="module")
def clover_checkpoint(tmp_path_factory):
    """tiny-clover written as a published snapshot would be: model_type clover_moe with no block settings in its
    files (the job gives them), and the vendor's decode controls in generation_config.json."""
    out = write_checkpoint("tiny-clover", tmp_path_factory.mktemp("clover") / "ckpt", seed=3)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "clover_moe"
    for key in ("diffusion", "block_size", "mask_token_id"):
        config.pop(key)
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps({"threshold": 0.5, "repetition_penalty": 1.2}))
    return out


def test_a_clover_job_writes_mean_logprob_on_every_ok_row(ray_session, clover_checkpoint, tmp_path):
    docs = tmp_path / "docs"
    good = write_good_docs(docs)
    raw = job_raw(str(docs), str(tmp_path / "out"),
                  model={"source": str(clover_checkpoint), "block_size": 8, "mask_token_id": 259},
                  decode={"max_new_tokens": 12})
    result = run(parse_job(raw))
    report = result.report
    # the checkpoint's decode controls became the defaults of what the job left unset
    assert report.decode_from_checkpoint == {"threshold": "generation_config.json:threshold",
                                             "repetition_penalty": "generation_config.json:repetition_penalty"}
    assert report.job["decode"]["threshold"] == 0.5 and report.job["decode"]["max_new_tokens"] == 12
    assert report.preview_operator["GDN history-slot mixer: softmax over the block plus a history slot read from "
                                   "the clean state"].startswith("reading:")

    rows = pq.read_table(str(tmp_path / "out")).to_pylist()
    assert len(rows) == len(good) and all(r["status"] == "ok" for r in rows)
    assert all(r["mean_logprob"] is not None and r["mean_logprob"] < 0 for r in rows)
    assert report.mean_logprob["count"] == len(rows)
    assert report.mean_logprob["min"] == pytest.approx(min(r["mean_logprob"] for r in rows))

    # a row is what the engine gives that document with these settings
    model = load_model(str(clover_checkpoint), overrides={"block_size": 8, "mask_token_id": 259})
    builder = PromptBuilder(str(clover_checkpoint))
    row = next(r for r in rows if os.path.basename(r["source_uri"]) == "notes.txt")
    text = (docs / "notes.txt").read_text()
    options = DecodeOptions(max_new_tokens=12, threshold=0.5, repetition_penalty=1.2)
    expected = generate(model, [builder.build("Summarize.", text)], options)[0]
    assert row["output_tokens"] == len(expected.tokens)
    assert row["output_text"] == builder.decode(expected.tokens).strip()
    assert row["mean_logprob"] == pytest.approx(expected.mean_logprob, abs=1e-4)


def test_a_verified_job_writes_the_autoregressive_output_and_its_acceptance(ray_session, clover_checkpoint, tmp_path):
    """decode.mode verified: every ok row's output is the autoregressive one, with the checkpoint's repetition
    penalty; rows carry their decode forwards and acceptance, and the run report sums them."""
    docs = tmp_path / "docs"
    good = write_good_docs(docs)
    raw = job_raw(str(docs), str(tmp_path / "out"),
                  model={"source": str(clover_checkpoint), "block_size": 8, "mask_token_id": 259},
                  decode={"max_new_tokens": 12, "mode": "verified"})
    report = run(parse_job(raw)).report
    rows = pq.read_table(str(tmp_path / "out")).to_pylist()
    assert len(rows) == len(good) and all(r["status"] == "ok" for r in rows)

    model = load_model(str(clover_checkpoint), overrides={"block_size": 8, "mask_token_id": 259})
    builder = PromptBuilder(str(clover_checkpoint))
    row = next(r for r in rows if os.path.basename(r["source_uri"]) == "notes.txt")
    ar = DecodeOptions(max_new_tokens=12, repetition_penalty=1.2, mode="autoregressive")
    expected = generate(model, [builder.build("Summarize.", (docs / "notes.txt").read_text())], ar)[0]
    assert row["output_text"] == builder.decode(expected.tokens).strip()
    for r in rows:
        assert r["tokens_per_forward"] == pytest.approx(r["output_tokens"] / r["decode_forwards"])
        assert 1 <= r["accepted_per_block"] <= 8 and 0 <= r["full_block_share"] <= 1
    blocks = report.decoding["verified_blocks"]
    assert blocks >= len(rows)
    assert report.decoding["decode_forwards"] == sum(r["decode_forwards"] for r in rows)
    assert report.decoding["output_tokens_per_forward"] == pytest.approx(
        sum(r["output_tokens"] for r in rows) / report.decoding["decode_forwards"])
