"""The synthetic corpus, the example jobs it is tied to, and the committed `demo` checkpoint.

CI never trains the demo model; these tests check the committed one: it loads, its tokenizer works with the
pipeline's PromptBuilder, and it answers held-out documents.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from clover_batch.jobs.demo_corpus import (
    EXAMPLE_SEEDS,
    EXTRACT_FIELDS,
    HELD_OUT_SEEDS,
    KINDS,
    TRAIN_SEEDS,
    copy_drill,
    held_out,
    make_document,
)
from clover_batch.jobs.demo_model import (
    COPY_INSTRUCTION,
    DEMO_DIR,
    IM_END_ID,
    MASK_ID,
    SPECIALS,
    DemoShape,
    PairMaker,
    demo_config,
    field_matches,
    job_instructions,
    token_similarity,
)
from clover_batch.model import generate, load_model
from clover_batch.pipeline.postprocess import FieldRule, check_extraction
from clover_batch.pipeline.tokenizer import PromptBuilder

RULES = [FieldRule(n, f["type"], f["description"], f.get("required", True)) for n, f in EXTRACT_FIELDS.items()]


def test_documents_are_reproducible_and_seed_ranges_disjoint():
    assert make_document(123).text == make_document(123).text
    assert make_document(123).text != make_document(124).text
    ranges = sorted([TRAIN_SEEDS, HELD_OUT_SEEDS, EXAMPLE_SEEDS], key=lambda r: r.start)
    assert all(a.stop <= b.start for a, b in itertools.pairwise(ranges))
    assert [d.seed for d in held_out(3)] == list(HELD_OUT_SEEDS[:3])


def test_targets_follow_the_fields_and_pass_the_pipeline_checks():
    docs = [make_document(s) for s in range(300)]
    assert {d.kind for d in docs} == set(KINDS)
    assert any(d.extra["long"] for d in docs) and any(d.extra["wrap"] for d in docs)
    for d in docs:
        checked = check_extraction(d.extraction, RULES)
        assert checked.error is None, (d.seed, checked.error)
        assert json.loads(checked.output_json) == d.fields
        assert list(json.loads(d.extraction)) == list(EXTRACT_FIELDS)
        assert all(field_matches(d.extraction, d).values())
        assert d.fields["document_type"] == d.kind
        # the facts a target uses are in the text: every party and the amount as written
        for party in d.fields["parties"]:
            assert party in d.text.replace("\n", " "), (d.seed, party)
        if d.fields["amount_eur"] is not None:
            assert f"{d.fields['amount_eur']:,}" in d.text, d.seed
        assert d.summary.endswith(".")


def test_copy_drill_is_seeded_and_answered_by_itself():
    assert copy_drill(5) == copy_drill(5) and copy_drill(5) != copy_drill(6)
    items = copy_drill(11).split(", ")
    assert 6 <= len(items) <= 14
    maker = PairMaker(str(DEMO_DIR), job_instructions())
    ex = maker.drill(copy_drill(11))
    assert ex.answer[-1] == IM_END_ID and maker.builder.decode(ex.answer[:-1]) == copy_drill(11)
    assert maker.builder.decode(ex.prompt).count(COPY_INSTRUCTION) == 1
    assert COPY_INSTRUCTION not in (job_instructions().summarize, job_instructions().extract)


def test_scoring():
    d = make_document(7)
    wrong = json.loads(d.extraction)
    wrong["date"] = "1999-01-01"
    got = field_matches(json.dumps(wrong), d)
    assert not got["date"] and sum(got.values()) == len(EXTRACT_FIELDS) - 1
    assert not any(field_matches("no json here", d).values())
    assert token_similarity([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert token_similarity([1, 2, 9, 4], [1, 2, 3, 4]) == 0.75
    assert token_similarity([1, 2], [1, 2, 3, 4]) == 0.5
    assert token_similarity([], [1]) == 0.0


def test_example_jobs_use_the_corpus_fields_and_the_demo_checkpoint():
    from clover_batch.jobs.spec import load_job

    instructions = job_instructions()  # raises if extract-local.yaml's fields differ from EXTRACT_FIELDS
    assert instructions.summarize == "Summarize the document in one sentence."
    for job in ("summarize-local", "extract-local"):
        spec = load_job(f"jobs/examples/{job}.yaml")
        assert Path(spec.model.source).resolve() == DEMO_DIR.resolve()


def test_example_documents_are_the_generated_ones():
    expected = json.loads((DEMO_DIR.parent / "expected.json").read_text())
    files = sorted(p.name for p in (DEMO_DIR.parent / "docs").iterdir())
    assert sorted(expected) == files
    assert sum(name.endswith(".pdf") for name in files) >= 2
    for name, entry in expected.items():
        doc = make_document(entry["seed"], kind=entry["extraction"]["document_type"], long=name.endswith("-long.txt"),
                            wrap=False)
        assert entry["summary"] == doc.summary and entry["extraction"] == json.loads(doc.extraction)


# ---- the committed checkpoint ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_DIR)


def test_checkpoint_files_config_and_tokenizer_agree(demo):
    cfg = demo.config
    size = (DEMO_DIR / "model.safetensors").stat().st_size
    assert size <= 10_000_000, size
    report = json.loads((DEMO_DIR / "training.json").read_text())
    assert report["seconds"]["total"] < 3600
    builder = PromptBuilder(str(DEMO_DIR))
    tok = builder.tokenizer
    assert [tok.token_to_id(t) for t in SPECIALS] == [0, 1, 2, 3]
    assert cfg.diffusion.mask_token_id == MASK_ID == tok.token_to_id("<|mask|>")
    assert IM_END_ID in cfg.eos_token_ids and tok.get_vocab_size(with_added_tokens=True) <= cfg.vocab_size
    assert cfg.window_tokens <= 512 and cfg.diffusion.block_size == 16
    # the chat template's special tokens are single ids; special-token text inside a document stays text
    ids = builder.build("Summarize.", "a <|im_end|> b")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids.count(IM_END_ID) == 1
    assert builder.decode(builder.encode("Total due: 4,200 EUR", specials=False)) == "Total due: 4,200 EUR"


def test_demo_shape_is_the_committed_checkpoints_and_ties_through_a_checkpoint(demo, tmp_path):
    import dataclasses

    import torch
    from clover_batch.model import build_model, save_checkpoint
    from clover_batch.model.weights import init_random_weights

    ours = demo_config(DemoShape())
    assert ours.diffusion.clover and ours.diffusion.logits_shift  # the recipe trains Clover's layout
    made_by = json.loads((DEMO_DIR / "training.json").read_text())
    if "phases" not in made_by:
        # a checkpoint of the one-phase block-diffusion recipe (before the autoregressive phase) has the trunk's
        # layout; its shape is still the recipe's
        ours = dataclasses.replace(ours, diffusion=demo.config.diffusion)
    assert dataclasses.replace(ours, name=demo.config.name) == demo.config
    assert demo.lm_head is not None and not demo.config.tie_word_embeddings
    # the tied variant bench/demo_recipes.py trains: one matrix, saved and loaded back as one
    tied = build_model(demo_config(DemoShape(tie_embeddings=True, window_tokens=32)))
    init_random_weights(tied, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    assert tied.lm_head is None
    save_checkpoint(tied, tmp_path)
    back = load_model(tmp_path, dtype=torch.float32)
    assert back.config.tie_word_embeddings and back.lm_head is None
    assert torch.equal(back.embed_tokens.weight, tied.embed_tokens.weight)
    ids = [1, *range(10, 50), 2]
    ours = generate(tied, [ids], max_new_tokens=8, temperature=0.0, tokens_per_step=2)[0].tokens
    assert generate(back, [ids], max_new_tokens=8, temperature=0.0, tokens_per_step=2)[0].tokens == ours


def test_checkpoint_answers_held_out_documents(demo, one_thread):
    """Greedy threshold-0.9 decoding on 8 held-out documents (a regression guard of the committed checkpoint).

    What the demo model does (bench/diffusion_quality.py has the figures): it reads the kind of document off the
    text, answers in the pipeline's JSON form and writes summaries in the target's form, but it invents most
    values (names, dates) instead of copying them. The bounds sit below what the committed checkpoint measures
    (document type 8/8, summary similarity 0.565, 1.76 tokens per step) and far above random weights (~0).
    """
    maker = PairMaker(str(DEMO_DIR), job_instructions())
    docs = held_out(8)
    ext = generate(demo, [maker.prompt(d, "extract") for d in docs], max_new_tokens=96, threshold=0.9)
    summ = generate(demo, [maker.prompt(d, "summarize") for d in docs], max_new_tokens=96, threshold=0.9)
    matches = [field_matches(maker.builder.decode(g.tokens), d) for d, g in zip(docs, ext, strict=True)]
    assert sum(m["document_type"] for m in matches) >= 7, matches
    sims = [token_similarity(g.tokens, maker.builder.encode(d.summary, specials=False))
            for d, g in zip(docs, summ, strict=True)]
    assert sum(sims) / len(sims) >= 0.5, sims
    tokens = sum(len(g.tokens) for g in ext + summ)
    assert tokens / sum(g.denoising_steps for g in ext + summ) > 1.5  # threshold decoding fills >1 per step


def test_train_demo_resumes_an_interrupted_run_to_the_same_weights(tmp_path, one_thread):
    """A seconds-long train-demo (a small shape, both phases) killed after phase 1 and continued with
    `resume=True` writes exactly the checkpoint of an uninterrupted run, from its saved recipe; the resume state is
    removed once the checkpoint is written, and an existing checkpoint is never overwritten by accident."""
    import torch
    from clover_batch.jobs.demo_model import RESUME, Recipe, train_demo
    from safetensors.torch import load_file

    shape = DemoShape(vocab_size=384, hidden_size=32, attention_heads=2, kv_heads=1, head_dim=16, gdn_value_heads=2,
                      gdn_key_heads=1, gdn_head_dim=16, experts=2, expert_width=16, shared_expert_width=16,
                      window_tokens=64)
    recipe = Recipe(ar_steps=2, bd_steps=2, batch_size=2, save_every=1, threads=1, tokenizer_docs=40,
                    ar_warmup=1, bd_warmup=1)
    whole = train_demo(tmp_path / "whole", recipe, shape)

    class Killed(Exception):
        pass

    def kill(phase: str, step: int, model, maker) -> None:
        if phase == "autoregressive" and step == 2:
            raise Killed

    with pytest.raises(Killed):
        train_demo(tmp_path / "cut", recipe, shape, on_log=kill)
    assert (tmp_path / "cut" / RESUME / "state.pt").exists() and not (tmp_path / "cut" / "model.safetensors").exists()
    with pytest.raises(FileExistsError, match="--resume"):
        train_demo(tmp_path / "cut", recipe, shape)
    resumed = train_demo(tmp_path / "cut", resume=True)  # the recipe and shape come from the saved run
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [p["loss"] for p in resumed["phases"]] == [p["loss"] for p in whole["phases"]]
    assert len(resumed["sessions"]) == 2 and not (tmp_path / "cut" / RESUME).exists()
    assert resumed["recipe"] == whole["recipe"]


def test_train_demo_command_options_and_refusals(tmp_path):
    """`clover-batch model train-demo`: --help shows both phases' steps (with the recipe's) and --resume; a resumed
    run takes no step counts (it keeps its recipe), a folder without an unfinished run cannot be resumed, and a
    folder holding a checkpoint is not overwritten without --overwrite. Nothing trains here."""
    from clover_batch.jobs.cli import app
    from clover_batch.jobs.demo_model import Recipe
    from typer.testing import CliRunner

    runner = CliRunner()
    shown = runner.invoke(app, ["model", "train-demo", "--help"], terminal_width=200)
    assert shown.exit_code == 0
    for text in ("--ar-steps", "--bd-steps", "--resume", "--threads", f"recipe: {Recipe.ar_steps}",
                 f"recipe: {Recipe.bd_steps}"):
        assert text in shown.output, text
    both = runner.invoke(app, ["model", "train-demo", "--resume", str(tmp_path), "--ar-steps", "3"])
    assert both.exit_code == 2 and "--ar-steps" in both.output
    nothing = runner.invoke(app, ["model", "train-demo", "--resume", str(tmp_path)])
    assert nothing.exit_code == 2 and "no unfinished training run" in nothing.output
    (tmp_path / "config.json").write_text("{}")
    taken = runner.invoke(app, ["model", "train-demo", "--out", str(tmp_path)])
    assert taken.exit_code == 2 and "--overwrite" in taken.output
    assert (tmp_path / "config.json").read_text() == "{}"
