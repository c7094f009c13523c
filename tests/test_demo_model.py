"""The synthetic corpus, the example jobs it is tied to, and the committed `demo` checkpoint.

CI never trains the demo model; these tests check the committed one: it loads, its tokenizer works with the
pipeline's PromptBuilder, and it answers held-out documents.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
from clover_batch.jobs.demo_corpus import (
    EXAMPLE_SEEDS,
    EXTRACT_FIELDS,
    FRESH_SEEDS,
    HELD_OUT_SEEDS,
    KINDS,
    TRAIN_SEEDS,
    copy_drill,
    held_out,
    held_out_long,
    make_document,
)
from clover_batch.jobs.demo_model import (
    COPY_INSTRUCTION,
    DEMO_DIR,
    EXTRACT_JOB,
    IM_END_ID,
    MASK_ID,
    SPECIALS,
    SUMMARIZE_JOB,
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
    # the long ones among the first held-out documents, in order (bench/diffusion_quality.py --long-only)
    first = held_out(40)
    long = [d.seed for d in first if d.extra["long"]]
    assert 0 < len(long) < 40
    assert [d.seed for d in held_out_long(len(long))] == long
    assert all(d.extra["long"] for d in held_out_long(len(long) + 3))


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


def test_example_pdf_writer_keeps_every_paragraph_of_a_long_document(tmp_path):
    """The writer behind the example PDFs and bench/demo_jobs.py's fresh ones: a long document asked for on one page
    spreads over as many as it needs (pymupdf's text box writes nothing when its text overflows, which had left a
    blank PDF that parsed as no_text)."""
    import importlib.util

    import pymupdf

    spec = importlib.util.spec_from_file_location("make_example_docs", DEMO_DIR.parent / "make_example_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = make_document(FRESH_SEEDS[89], wrap=False)  # a long minutes document, 2,441 characters
    module.write_pdf(tmp_path / "long.pdf", doc.text, 1)
    with pymupdf.open(tmp_path / "long.pdf") as pdf:
        text = " ".join(page.get_text() for page in pdf)
        assert pdf.page_count > 1
    assert " ".join(text.split()) == " ".join(doc.text.split())


# ---- the committed checkpoint ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_DIR)


def test_checkpoint_files_config_and_tokenizer_agree(demo):
    cfg = demo.config
    size = (DEMO_DIR / "model.safetensors").stat().st_size
    assert size <= 10_000_000, size
    report = json.loads((DEMO_DIR / "training.json").read_text())
    # the recipe fits one session on 2 cores (Recipe; 'polish' took 158 minutes, over issue 27's 150), counted
    # over the runs that made it (an --init run adds the time of the checkpoint it started from)
    assert report["seconds"]["total"] < 165 * 60
    if "init" in report:
        assert report["seconds"]["total"] > report["init"]["seconds"]["total"]
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
    assert demo.lm_head is None and demo.config.tie_word_embeddings  # one matrix embeds and unembeds
    # a tied checkpoint (the recipe's shape, a short window) saved and loaded back as one matrix
    tied = build_model(demo_config(DemoShape(window_tokens=32)))
    init_random_weights(tied, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    assert tied.lm_head is None
    save_checkpoint(tied, tmp_path)
    back = load_model(tmp_path, dtype=torch.float32)
    assert back.config.tie_word_embeddings and back.lm_head is None
    assert torch.equal(back.embed_tokens.weight, tied.embed_tokens.weight)
    ids = [1, *range(10, 50), 2]
    ours = generate(tied, [ids], max_new_tokens=8, temperature=0.0, tokens_per_step=2)[0].tokens
    assert generate(back, [ids], max_new_tokens=8, temperature=0.0, tokens_per_step=2)[0].tokens == ours


def _job_options(job: Path, **extra):
    from clover_batch.jobs.spec import load_job

    return dataclasses.replace(load_job(str(job)).decode.options(), **extra)


def test_checkpoint_answers_held_out_documents(demo, one_thread):
    """Greedy decoding on 8 held-out documents under the example jobs' own decode settings (a regression guard of
    the committed checkpoint): extraction fields and the summaries' facts are copied out of the documents, at more
    than one token per decode forward. The bounds sit below what the committed checkpoint measures on these 8
    documents (90% of fields, parties 6 of 8 lists exactly, 36 of 48 summary facts, 1.55 tokens per forward; the
    one before it, without phase 1b: 87.5%, 6, 33, 1.58) and the fields, parties and facts bounds above what the
    untied checkpoint got (75% of fields, parties 2 of 8, 28 of 48 facts, 1.61 tokens per forward; docs/models.md,
    the demo model)."""
    maker = PairMaker(str(DEMO_DIR), job_instructions())
    docs = held_out(8)
    ext = generate(demo, [maker.prompt(d, "extract") for d in docs], _job_options(EXTRACT_JOB))
    summ = generate(demo, [maker.prompt(d, "summarize") for d in docs], _job_options(SUMMARIZE_JOB))
    matches = [field_matches(maker.builder.decode(g.tokens), d) for d, g in zip(docs, ext, strict=True)]
    fields = sum(sum(m.values()) for m in matches) / (len(docs) * len(EXTRACT_FIELDS))
    facts = [(f in maker.builder.decode(g.tokens), f) for d, g in zip(docs, summ, strict=True)
             for _, f in d.summary_facts]
    assert fields >= 0.8, matches
    assert sum(m["parties"] for m in matches) >= 4, matches
    assert sum(hit for hit, _ in facts) / len(facts) >= 0.6, facts
    per_forward = sum(len(g.tokens) for g in ext + summ) / sum(g.decode_forwards for g in ext + summ)
    assert per_forward >= 1.4


def test_verified_decoding_of_the_demo_is_its_trunk_exactly(demo, one_thread):
    """The committed checkpoint has Clover's layout and a trained preview: `verified` gives autoregressive's tokens
    on held-out documents, with drafts both kept (more than the block's first token per block) and rejected."""
    maker = PairMaker(str(DEMO_DIR), job_instructions())
    docs = held_out(6, start=8)
    prompts = [maker.prompt(d, task) for d in docs for task in ("extract", "summarize")]
    ar = generate(demo, prompts, _job_options(EXTRACT_JOB, mode="autoregressive", tokens_per_step=None))
    ver = generate(demo, prompts, _job_options(EXTRACT_JOB, mode="verified"))
    assert [g.tokens for g in ver] == [g.tokens for g in ar]
    blocks = sum(g.verified_blocks for g in ver)
    assert sum(g.accepted_tokens for g in ver) / blocks > 1.5
    assert sum(g.full_blocks for g in ver) < blocks
    assert sum(g.decode_forwards for g in ver) < sum(g.decode_forwards for g in ar)


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
    recipe = Recipe(ar_steps=2, long_steps=2, bd_steps=2, batch_size=2, save_every=1, threads=1, tokenizer_docs=40,
                    ar_warmup=1, long_warmup=1, bd_warmup=1)
    whole = train_demo(tmp_path / "whole", recipe, shape)
    assert [p["name"] for p in whole["phases"]] == ["autoregressive", "long documents", "block diffusion"]
    assert whole["command"] == ("no train-demo command: the recipe is the 'default' preset with other batch_size, "
                                "ar_warmup, long_warmup, bd_warmup, tokenizer_docs")

    class Killed(Exception):
        pass

    def kill(phase: str, step: int, model, maker) -> None:
        if phase == "long documents" and step == 2:  # after phases 1 and 1b, before phase 2
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
    for text in ("--ar-steps", "--long-steps", "--bd-steps", "--polish-steps", "--init", "--resume", "--threads",
                 f"recipe: {Recipe.ar_steps}",
                 f"recipe: {Recipe.long_steps}", f"recipe: {Recipe.bd_steps}"):
        assert text in shown.output, text
    both = runner.invoke(app, ["model", "train-demo", "--resume", str(tmp_path), "--ar-steps", "3"])
    assert both.exit_code == 2 and "--ar-steps" in both.output
    both = runner.invoke(app, ["model", "train-demo", "--resume", str(tmp_path), "--init", str(tmp_path)])
    assert both.exit_code == 2 and "--init starts a new run" in both.output
    no_init = runner.invoke(app, ["model", "train-demo", "--out", str(tmp_path / "p"), "--recipe", "polish",
                                  "--init", str(tmp_path / "none")])
    assert no_init.exit_code == 2 and "no training.json" in no_init.output
    nothing = runner.invoke(app, ["model", "train-demo", "--resume", str(tmp_path)])
    assert nothing.exit_code == 2 and "no unfinished training run" in nothing.output
    assert "--recipe" in shown.output and "look-up" in shown.output
    unknown = runner.invoke(app, ["model", "train-demo", "--out", str(tmp_path / "new"), "--recipe", "fast"])
    assert unknown.exit_code == 2 and "'fast' is not a preset" in unknown.output and not (tmp_path / "new").exists()
    extend = runner.invoke(app, ["model", "train-demo", "--resume", str(tmp_path), "--recipe", "look-up"])
    assert extend.exit_code == 2 and "no unfinished training run" in extend.output
    (tmp_path / "config.json").write_text("{}")
    taken = runner.invoke(app, ["model", "train-demo", "--out", str(tmp_path)])
    assert taken.exit_code == 2 and "--overwrite" in taken.output
    assert (tmp_path / "config.json").read_text() == "{}"


def test_long_documents_phase_draws_its_own_mostly_long_documents():
    """Phase 1b (Recipe.long_steps) sits between the two phases with its own learning rate, draws long documents at
    `long_mix` and drills at `long_copy_share`, from its own part of the training seeds, so the other phases draw
    what they drew without it; at 0 steps it is left out. The committed checkpoint's recipe has it (600 steps)."""
    from clover_batch.jobs import demo_corpus
    from clover_batch.jobs.demo_model import (
        AR_PHASE,
        BD_PHASE,
        LONG_PHASE,
        PHASE_DATA,
        RECIPES,
        Recipe,
        phase_mix,
        phases,
        train_command,
        training_pairs,
    )

    assert [p.name for p in phases(Recipe(long_steps=0))] == [AR_PHASE, BD_PHASE]
    assert Recipe.long_steps == 600
    plan = phases(Recipe())
    assert [p.name for p in plan] == [AR_PHASE, LONG_PHASE, BD_PHASE]
    assert plan[1].options.steps == 600 and plan[1].options.lr == Recipe.long_lr and plan[1].options.bd_weight == 0
    mix = phase_mix(Recipe(), LONG_PHASE)
    assert (mix.long_share, mix.copy_share) == (Recipe.long_mix, Recipe.long_copy_share)
    assert phase_mix(Recipe(), AR_PHASE) == Recipe() == phase_mix(Recipe(), BD_PHASE)
    assert train_command(Path("d"), Recipe(threads=1)) == "clover-batch model train-demo --out d"
    assert train_command(Path("d"), Recipe(long_steps=0)) == "clover-batch model train-demo --out d --long-steps 0"
    look_up = dataclasses.replace(RECIPES["look-up"], bd_steps=500, save_every=10)
    assert train_command(Path("d"), look_up) == "clover-batch model train-demo --out d --recipe look-up --bd-steps 500"
    assert train_command(Path("d"), Recipe(copy_share=0.5)) == ("no train-demo command: the recipe is the 'default' "
                                                               "preset with other copy_share")

    drawn: list[tuple[int, bool]] = []

    class Maker:  # records what the stream draws instead of tokenizing it
        def example(self, doc, task):
            drawn.append((doc.seed, doc.extra["long"]))

        def drill(self, drill, window=None):
            drawn.append((-1, False))

    def draw(recipe, phase, n=400):
        drawn.clear()
        stream = training_pairs(Maker(), recipe, phase=phase)
        for _ in range(n):
            next(stream)
        return list(drawn)

    long_phase = draw(mix, PHASE_DATA[LONG_PHASE])
    docs = [d for d in long_phase if d[0] != -1]
    assert 0.6 < sum(is_long for _, is_long in docs) / len(docs) < 0.8  # long_mix 0.7
    assert 0.05 < (len(long_phase) - len(docs)) / len(long_phase) < 0.15  # drills at 0.1
    seeds = {phase: {s for s, _ in draw(Recipe(), PHASE_DATA[phase]) if s != -1} for phase in (AR_PHASE, BD_PHASE)}
    seeds[LONG_PHASE] = {s for s, _ in docs}
    assert not (seeds[LONG_PHASE] & seeds[AR_PHASE]) and not (seeds[LONG_PHASE] & seeds[BD_PHASE])
    assert all(s in demo_corpus.TRAIN_SEEDS for s in seeds[LONG_PHASE])


def test_long_drills_lie_beyond_the_window_and_slow_heads_reach_every_phase(demo):
    """Recipe.long_drill_share: that share of every phase's pairs is the long drill, whose list lies more than the
    demo's attention window before the answer and is the answer; at 0 (the committed recipe) the stream draws
    no long drill. Recipe.slow_heads reaches every phase's TrainOptions."""
    from clover_batch.jobs.demo_corpus import long_copy_drill
    from clover_batch.jobs.demo_model import AR_PHASE, PHASE_DATA, Recipe, phases, training_pairs

    maker = PairMaker(DEMO_DIR, job_instructions())
    window = demo.config.window_tokens
    for seed in range(40):
        listed, text = long_copy_drill(seed)
        assert text.startswith(listed + "\n\nOperations log\n")
        ex = maker.long_drill(seed)
        assert maker.builder.decode(ex.answer[:-1]) == listed and ex.answer[-1] == IM_END_ID
        ids = ex.prompt
        first_after = next(n for n in range(len(ids)) if listed in maker.builder.decode(ids[:n]))
        assert len(ids) - first_after >= window, (seed, len(ids), first_after)  # only the GDN state reaches it
    assert long_copy_drill(7) == long_copy_drill(7) != long_copy_drill(8)

    def kinds(recipe, n=300):
        stream = training_pairs(maker, recipe, phase=PHASE_DATA[AR_PHASE])
        return [tuple(next(stream).prompt) for _ in range(n)]

    with_drills = kinds(Recipe(long_drill_share=0.3), 200)
    drills = sum("Operations log" in maker.builder.decode(list(p)) and COPY_INSTRUCTION in maker.builder.decode(
        list(p)) for p in with_drills)
    assert 0.2 < drills / len(with_drills) < 0.4, drills
    base = Recipe()
    assert base.long_drill_share == 0 and base.slow_heads == 0
    assert not any(COPY_INSTRUCTION in maker.builder.decode(list(p)) and "Operations log" in maker.builder.decode(
        list(p)) for p in kinds(base, 100))
    assert all(p.options.slow_heads == 2 and p.options.slow_dt == 1e-3
               for p in phases(Recipe(slow_heads=2, slow_dt=1e-3)))
    assert all(p.options.slow_heads == 0 for p in phases(base))


def test_look_up_recipe_mixes_narrow_window_copy_drills_into_phase_1b_mix():
    """The `look-up` preset: phase 1c between phase 1b and phase 2, drawing phase 1b's mix of mostly long documents,
    15% long drills, and of the other pairs half short copy drills, which alone carry an 8-token attention window;
    slow heads held in every phase. The default recipe has no such phase and no drill with a window of its own."""
    from clover_batch.jobs.demo_model import (
        AR_PHASE,
        BD_PHASE,
        LONG_PHASE,
        LOOKUP_PHASE,
        PHASE_DATA,
        RECIPES,
        Recipe,
        phase_mix,
        phases,
        training_pairs,
    )

    assert RECIPES["default"] == Recipe() and [p.name for p in phases(Recipe())] == [AR_PHASE, LONG_PHASE, BD_PHASE]
    recipe = RECIPES["look-up"]
    plan = {p.name: p.options for p in phases(recipe)}
    assert list(plan) == [AR_PHASE, LONG_PHASE, LOOKUP_PHASE, BD_PHASE]
    assert plan[LOOKUP_PHASE].steps == recipe.lookup_steps > 0 and plan[LOOKUP_PHASE].lr == recipe.lookup_lr
    assert plan[LOOKUP_PHASE].bd_weight == 0 and plan[LOOKUP_PHASE].window_tokens == 0
    assert all(o.slow_heads == 2 for o in plan.values())

    class Maker:  # names what the stream draws, and a drill's window, instead of tokenizing it
        def example(self, doc, task):
            return "long document" if doc.extra["long"] else "short document"

        def drill(self, items, window=None):
            return f"short drill at {window}"

        def long_drill(self, seed):
            return "long drill"

    def kinds(recipe: Recipe, name: str, n: int = 400) -> dict[str, int]:
        stream = training_pairs(Maker(), phase_mix(recipe, name), phase=PHASE_DATA[name])
        counts: dict[str, int] = {}
        for _ in range(n):
            kind = next(stream)
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    mixed = kinds(recipe, LOOKUP_PHASE)
    assert set(mixed) == {"long drill", "short drill at 8", "long document", "short document"}, mixed
    assert 35 < mixed["long drill"] < 85 and 140 < mixed["short drill at 8"] < 200, mixed
    assert mixed["long document"] > 1.5 * mixed["short document"], mixed
    for name in (AR_PHASE, LONG_PHASE, BD_PHASE):  # every other phase's drills train at the phase's window
        assert "short drill at 8" not in kinds(recipe, name, 200) and "short drill at None" in kinds(recipe, name, 200)


def test_a_run_stopped_at_a_phase_end_goes_on_under_a_recipe_that_adds_phases(tmp_path, one_thread):
    """train_demo(resume=True, extend=R): a run of a recipe without the look-up phases, stopped after phase 1b, goes
    on under R (the same recipe with them) and writes exactly the checkpoint of a run of R from the start, with R
    as its recipe and command; a recipe that changes what a finished phase read, or a run stopped inside a phase,
    is refused with the reason."""
    import torch
    from clover_batch.jobs.demo_model import RESUME, Recipe, later_recipe, train_command, train_demo
    from safetensors.torch import load_file

    shape = DemoShape(vocab_size=384, hidden_size=32, attention_heads=2, kv_heads=1, head_dim=16, gdn_value_heads=2,
                      gdn_key_heads=1, gdn_head_dim=16, experts=2, expert_width=16, shared_expert_width=16,
                      window_tokens=64)
    base = Recipe(ar_steps=2, long_steps=2, bd_steps=2, batch_size=2, save_every=1, threads=1, tokenizer_docs=40,
                  ar_warmup=1, long_warmup=1, bd_warmup=1, slow_heads=1, long_drill_share=0.2)
    wider = dataclasses.replace(base, lookup_steps=3, lookup_warmup=1, bd_steps=3)
    whole = train_demo(tmp_path / "whole", wider, shape)
    assert [p["name"] for p in whole["phases"]] == ["autoregressive", "long documents", "look-up", "block diffusion"]

    class Killed(Exception):
        pass

    def kill_at(when: tuple[str, int]):
        def on_log(phase: str, step: int, model, maker) -> None:
            if (phase, step) == when:
                raise Killed
        return on_log

    with pytest.raises(Killed):
        train_demo(tmp_path / "cut", base, shape, on_log=kill_at(("long documents", 2)))
    with pytest.raises(ValueError, match="copy_share"):
        train_demo(tmp_path / "cut", resume=True, extend=dataclasses.replace(wider, copy_share=0.5))
    with pytest.raises(ValueError, match="long_steps"):
        train_demo(tmp_path / "cut", resume=True, extend=dataclasses.replace(wider, long_steps=3))
    extended = train_demo(tmp_path / "cut", resume=True, extend=dataclasses.replace(wider, threads=2))
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [p["loss"] for p in extended["phases"]] == [p["loss"] for p in whole["phases"]]
    assert extended["recipe"] == {**whole["recipe"], "threads": 2} and extended["extended"][0]["from"]["bd_steps"] == 2
    assert extended["command"] == whole["command"] == train_command(tmp_path, wider)
    assert whole["command"].startswith("no train-demo command") and "lookup_warmup" in whole["command"]
    assert not (tmp_path / "cut" / RESUME).exists()

    # what a finished phase read is not free: the look-up phase's learning rate once it has run
    later_recipe(wider, dataclasses.replace(wider, lookup_lr=1e-2), ["autoregressive", "long documents"])
    with pytest.raises(ValueError, match="lookup_lr"):
        later_recipe(wider, dataclasses.replace(wider, lookup_lr=1e-2), ["autoregressive", "long documents", "look-up"])

    with pytest.raises(Killed):  # a phase logs every 25 steps: killed at the log inside a 26-step phase 1b
        train_demo(tmp_path / "inside", dataclasses.replace(base, long_steps=26), shape,
                   on_log=kill_at(("long documents", 25)))
    with pytest.raises(ValueError, match="inside its phase 'long documents' \\(step 25 of 26\\)"):
        train_demo(tmp_path / "inside", resume=True, extend=dataclasses.replace(wider, long_steps=26))


def test_a_checkpoint_goes_on_with_the_recipes_later_phases_from_init(tmp_path, one_thread):
    """train_demo(init=DIR): a checkpoint made by train-demo goes on with the later phases of a recipe whose first
    phases are its own (here phase 3, polish): its tokenizer, its weights, then only the new phase, ending with the
    weights of the same recipe run from the start; training.json
    keeps the checkpoint it started from (command, recipe, loss curves, the weights' digest). An interrupted such run
    resumes to the same weights. A recipe that changes a phase the checkpoint trained, or adds nothing after them, or
    --init with --resume, is refused with the reason."""
    import hashlib

    import torch
    from clover_batch.jobs.demo_model import POLISH_PHASE, RESUME, Recipe, train_demo
    from safetensors.torch import load_file

    shape = DemoShape(vocab_size=384, hidden_size=32, attention_heads=2, kv_heads=1, head_dim=16, gdn_value_heads=2,
                      gdn_key_heads=1, gdn_head_dim=16, experts=2, expert_width=16, shared_expert_width=16,
                      window_tokens=64)
    base = Recipe(ar_steps=2, long_steps=0, bd_steps=2, batch_size=2, save_every=1, threads=1, tokenizer_docs=40,
                  ar_warmup=1, bd_warmup=1)
    polished = dataclasses.replace(base, polish_steps=2, polish_warmup=1)
    first = train_demo(tmp_path / "base", base, shape)
    report = train_demo(tmp_path / "pol", polished, shape, init=tmp_path / "base")
    assert [p["name"] for p in report["phases"]] == [POLISH_PHASE] and len(report["phases"][0]["loss"]) == 1
    started = report["init"]
    assert started["phases_done"] == 2 and started["dir"] == str(tmp_path / "base")
    assert started["recipe"] == first["recipe"] and started["phases"] == first["phases"]
    assert started["model_sha256"] == hashlib.sha256((tmp_path / "base" / "model.safetensors").read_bytes()).hexdigest()
    assert report["recipe"]["polish_steps"] == 2 and report["command"].startswith("no train-demo command")
    assert report["seconds"]["training"] == round(first["seconds"]["training"]
                                                  + report["seconds_this_run"]["training"], 1)
    assert (tmp_path / "pol" / "tokenizer.json").read_bytes() == (tmp_path / "base" / "tokenizer.json").read_bytes()
    a, b = load_file(tmp_path / "base" / "model.safetensors"), load_file(tmp_path / "pol" / "model.safetensors")
    assert a.keys() == b.keys() and not all(torch.equal(a[k], b[k]) for k in a)
    # the same recipe from the start ends with the same weights (phase 3 starts from bf16-rounded weights in both)
    scratch = train_demo(tmp_path / "scratch", polished, shape)
    c = load_file(tmp_path / "scratch" / "model.safetensors")
    assert all(torch.equal(b[k], c[k]) for k in b)
    assert scratch["phases"][:2] == [{**p, **{k: q[k] for k in ("seconds", "cpu_seconds", "load_average")}}
                                     for p, q in zip(first["phases"], scratch["phases"], strict=False)]
    assert scratch["phases"][2]["loss"] == report["phases"][0]["loss"]

    class Killed(Exception):
        pass

    def kill(phase: str, step: int, model, maker) -> None:
        if phase == POLISH_PHASE:
            raise Killed

    longer = dataclasses.replace(polished, polish_steps=26)  # logs at step 25: killed there, saved at every step
    with pytest.raises(Killed):
        train_demo(tmp_path / "cut", longer, shape, init=tmp_path / "base", on_log=kill)
    with pytest.raises(ValueError, match="--init applies to a new run"):
        train_demo(tmp_path / "cut", resume=True, init=tmp_path / "base")
    resumed = train_demo(tmp_path / "cut", resume=True)
    whole = train_demo(tmp_path / "whole", longer, shape, init=tmp_path / "base")
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a) and resumed["phases"] == [
        {**p, "seconds": resumed["phases"][0]["seconds"], "cpu_seconds": resumed["phases"][0]["cpu_seconds"],
         "load_average": resumed["phases"][0]["load_average"]} for p in whole["phases"]]
    assert resumed["init"]["model_sha256"] == started["model_sha256"] and not (tmp_path / "cut" / RESUME).exists()

    with pytest.raises(ValueError, match="bd_lr"):  # a phase the checkpoint trained, changed
        train_demo(tmp_path / "x", dataclasses.replace(polished, bd_lr=1e-2), shape, init=tmp_path / "base")
    with pytest.raises(ValueError, match="with more after them"):  # nothing to train after its phases
        train_demo(tmp_path / "y", base, shape, init=tmp_path / "base")
    with pytest.raises(ValueError, match="started from another"):  # one checkpoint back only: its provenance
        train_demo(tmp_path / "z", dataclasses.replace(polished, polish_steps=3), shape, init=tmp_path / "pol")
    with pytest.raises(FileNotFoundError, match=r"no training\.json"):
        train_demo(tmp_path / "w", polished, shape, init=tmp_path / "nothing")


def test_polish_phase_draws_its_own_documents():
    """Phase 3 (polish, the 'polish' preset; off in the default) is a block-diffusion phase with the whole
    autoregressive loss after phase 2, and draws documents far from every other phase's (with seed 0 a phase's
    i-th document is TRAIN_SEEDS[start + i]; a phase draws fewer than 100,000)."""
    from clover_batch.jobs.demo_model import (
        AR_PHASE,
        BD_PHASE,
        LONG_PHASE,
        PHASE_DATA,
        POLISH_PHASE,
        RECIPES,
        Recipe,
        phases,
        training_pairs,
    )

    plan = phases(RECIPES["polish"])
    assert [p.name for p in plan] == [AR_PHASE, LONG_PHASE, BD_PHASE, POLISH_PHASE]
    polish = plan[-1].options
    assert (polish.steps, polish.lr, polish.ar_weight, polish.bd_weight) == (1500, Recipe.polish_lr, 1.0, 1.0)
    assert [p.name for p in phases(Recipe())] == [AR_PHASE, LONG_PHASE, BD_PHASE]

    drawn: list[int] = []

    class Maker:  # records the documents the stream draws instead of tokenizing them
        def example(self, doc, task):
            drawn.append(doc.seed)

        def drill(self, drill, window=None):
            pass

    firsts = {}
    for name, phase in PHASE_DATA.items():
        drawn.clear()
        stream = training_pairs(Maker(), Recipe(), phase=phase)
        for _ in range(50):
            next(stream)
        firsts[name] = min(drawn)
    starts = sorted(firsts.values())
    assert all(b - a >= 1_000_000 for a, b in itertools.pairwise(starts)), firsts


def test_tokenizer_gives_a_name_the_same_ids_in_the_document_and_in_the_answer():
    """Recipe.capital_space "attach" (the recipe's): a multi-word party is the same ids after `From: ` in a
    document, after ` from ` in a summary and after `["` in an extraction, and no word of it is preceded by a bare
    space token; "prefix" (GPT-2) changes the first word's id after `["`, "isolate" puts a bare space before every
    later word. A trained tokenizer decodes every text back exactly. (A tokenizer this small may still split a word
into pieces; the recipe's 2,048 keeps the demo's names whole.)"""
    from clover_batch.jobs.demo_model import train_tokenizer

    instructions = job_instructions()
    made = {mode: train_tokenizer(512, 60, instructions, capital_space=mode)
            for mode in ("attach", "isolate", "prefix")}
    name = "Kestrel Energy SRL"
    contexts = (f"From: {name}, 12 Harbour Street", f"Invoice INV-1349 from {name} to Atlas Labs AG",
                json.dumps({"parties": [name, "Atlas Labs AG"]}))

    def name_ids(tok, text: str) -> list[int]:
        enc = tok.encode(text)
        start, end = text.index(name), text.index(name) + len(name)
        return [i for i, (a, b) in zip(enc.ids, enc.offsets, strict=True) if a < end and b > start]

    for mode, tok in made.items():
        for text in (*contexts, "Attendees: Ana Lopez, Bo Chen and Vera Novak.\n\nThe meeting\n  X"):
            assert tok.decode(tok.encode(text).ids) == text, (mode, text)
    attach = made["attach"]
    ids = [name_ids(attach, text) for text in contexts]
    assert ids[0] == ids[1] == ids[2], ids
    for text in contexts:  # before BPE merges: each word one piece, no bare space between them
        pieces = [piece for piece, _ in attach.pre_tokenizer.pre_tokenize_str(text)]
        assert ["KestrelĠ", "EnergyĠ", "SRL"] == pieces[pieces.index("KestrelĠ"):][:3], pieces
    assert len({tuple(name_ids(made["prefix"], t)) for t in contexts}) > 1  # the first word differs after `["`
    isolated = name_ids(made["isolate"], contexts[0])
    assert made["isolate"].token_to_id("Ġ") in isolated  # a bare space before "Energy" and "SRL"
    with pytest.raises(ValueError, match="capital_space"):
        train_tokenizer(512, 10, instructions, capital_space="none")
