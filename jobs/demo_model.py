"""The `demo` checkpoint: a small model of Clover's layout trained here, on CPU, on the synthetic documents of
`jobs/demo_corpus.py`, for the two example jobs (jobs/examples/summarize-local.yaml and extract-local.yaml).

`clover-batch model train-demo --out jobs/examples/demo` is the one command that makes it (seeded):

    BPE tokenizer trained on corpus text (digits split one per token, a space before a capitalised word its own
    token; the chat special tokens and a mask token)
    -> training pairs: the example jobs' own prompts (PromptBuilder: chat template + instruction + document)
       and the document's target summary / extraction JSON, ending with <|im_end|>; plus a copy drill
       (`copy_share` of the pairs: "Repeat the list." and a list of random names, amounts and dates)
    -> phase 1, autoregressive: next-token loss on whole sequences (prompt, document and answer; answer tokens
       weighted `answer_weight`), the causal trunk that prefill and commits run; short documents first
    -> phase 2, block diffusion from the phase-1 weights: Clover's preview operator trained on noised answer blocks
       from causally committed states, with `bd_ar_weight` of the autoregressive loss kept (clover_batch.model.train)
    -> config.json, model.safetensors, tokenizer.json and training.json (recipe, loss curves, time, load)

The model has Clover's layout (`preview_operator: clover`: causal prefill and commits, the preview operator with
the block-diffusion GDN tensors, next-token logits), so the example jobs run the code path a real Clover checkpoint
runs. It is meaningful only on documents like the synthetic ones and with those two instructions; real work needs
real Clover weights. Its attention window (`window_tokens`) is deliberately small, so a long document's early facts
reach the answer only through the carried Gated DeltaNet state.

Why the tokenizer attaches a space before a capital to the word before it (`Recipe.capital_space`): a party is
copied out of the document (`From: Kestrel Energy SRL,`) into a JSON list (`["Kestrel Energy SRL"`), and a copy
is learned as a lookup: find the current token earlier in the context and emit the one that followed it there.
GPT-2's byte-level BPE writes `ĠKestrel` in the text and `Kestrel` after `["`, two unrelated ids, so the lookup
fails from the first word on; a space isolated as its own token makes the words equal but leaves the bare space,
which is everywhere, as the token before every later word. With the space attached (`KestrelĠ EnergyĠ SRL`) a
name is the same ids in both places and each word's id names the next, as digits do for dates and amounts, the
fields the trunk already copied while parties stayed at 0% under both earlier tokenizers (issue 38).

A run saves what resuming needs under OUT/resume every `save_every` steps; `train-demo --resume OUT` continues an
interrupted run from its last save with the same data order, and the folder is removed when the run completes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from clover_batch.jobs.demo_corpus import (
    EXTRACT_FIELDS,
    TRAIN_SEEDS,
    Document,
    copy_drill,
    long_copy_drill,
    make_document,
)

if TYPE_CHECKING:
    from clover_batch.model import CloverModel

log = logging.getLogger(__name__)

EXAMPLES = Path(__file__).parent / "examples"
DEMO_DIR = EXAMPLES / "demo"
SUMMARIZE_JOB = EXAMPLES / "summarize-local.yaml"
EXTRACT_JOB = EXAMPLES / "extract-local.yaml"

# ids 0..3 of the demo tokenizer; the BPE vocabulary follows
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID, MASK_ID = 0, 1, 2, 3
# the instruction of the training-only copy drill (never a job's)
COPY_INSTRUCTION = "Repeat the list."


@dataclass(frozen=True)
class DemoShape:
    """The demo model's shape (a CloverConfig without the derived fields)."""

    vocab_size: int = 2048
    hidden_size: int = 128
    # Gated DeltaNet and full attention alternating: with two attention layers in six (every third), copying a
    # value out of the document (a name, a date) had not formed after 2,200 steps, and a 24-token copy task
    # stayed at its plateau after 150; four layers alternating learn that copy in 150 steps and cost 2/3 of a step
    layers: int = 4
    full_attention_interval: int = 2
    attention_heads: int = 4
    kv_heads: int = 2
    # attention heads of 64: with 32, two 32-wide KV heads were too narrow a path to copy a rare token's identity (a
    # name's words): in 2,000-step first-phase probes 64 copied 53/86 numbers and 14/65 companies exactly, 32 copied
    # 6 and 1; the full run with 64 took parties from 2% to 18% exact (docs/models.md)
    head_dim: int = 64
    gdn_key_heads: int = 2
    gdn_value_heads: int = 4
    gdn_head_dim: int = 32
    experts: int = 8
    experts_per_token: int = 2
    expert_width: int = 128
    shared_expert_width: int = 256
    block_size: int = 16
    window_tokens: int = 384
    prefill_chunk_tokens: int = 512
    # lm_head shares the input embedding matrix: a token's identity read from the document and written to the answer
    # is one vector, which is what copying a person's surname needed: in 2,000-step probes tied copied 8/69 people
    # and 19/54 short documents' parties exactly, untied 0 and 5; the full run took parties from 18% to 58% through
    # the example jobs (docs/models.md)
    tie_embeddings: bool = True


@dataclass(frozen=True)
class Recipe:
    """Everything the training run depends on; written to training.json beside the weights."""

    seed: int = 0
    batch_size: int = 16  # training pairs per step
    # the input embedding's init scale: from 0.02 (the other matrices' scale) copying a value out of the prompt
    # did not form in 3,000 steps; from 0.5 a copy task is learned in a few hundred (model.train)
    embedding_std: float = 0.5
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    min_lr_ratio: float = 0.05
    # Step counts: the whole run within one 180-minute session on 2 cores (issue 27 asked 150; the `polish`
    # preset's phase 3 takes it to 158). The committed checkpoint's runs, alone on an idle 2-core machine at 2
    # threads: phase 1 took 53 minutes (0.7 s/step), phase 1b 16 (1.6 s/step), phase 2 33 (1.9-2.1 s/step; its
    # clean pass runs answer blocks one at a time, then the noised copies), phase 3 56 (2.2 s/step), 158 in all.
    # phase 1: autoregressive, next-token loss on whole sequences
    ar_steps: int = 4500
    ar_lr: float = 3e-3
    ar_warmup: int = 60
    answer_weight: float = 3.0  # per-token weight of answer tokens (prompt and document tokens: 1)
    short_share: float = 0.6  # first share of phase 1: short documents only (no filler, never long)
    # phase 1b: autoregressive again, from phase 1's weights, on a mix of mostly long documents (facts more than a
    # window before the question, which only the GDN state carries). Issue 38's full run with it against the same
    # recipe without: the trunk's fields on 32 held-out documents 73.8% against 70.0% (long documents 27.5% against
    # 20.0%); through the example jobs on 120 fresh documents fields 66.5% against 65.2%, summary facts 63.9% against
    # 62.6%, long documents' fields 17.9% against 12.1%; 16 minutes (0 turns it off)
    long_steps: int = 600
    long_lr: float = 1e-3
    long_warmup: int = 20
    long_mix: float = 0.7  # share of long documents in phase 1b
    long_copy_share: float = 0.1  # share of copy drills in phase 1b
    # phase 2: block diffusion from the phase-1 weights
    bd_steps: int = 1000
    bd_lr: float = 1e-3
    bd_warmup: int = 30
    bd_ar_weight: float = 0.5  # weight of the autoregressive loss kept beside the block-diffusion loss
    eps: float = 0.1  # smallest mask rate
    noise_copies: int = 2
    # phase 3, polish: block diffusion again from phase 2's weights, on its own documents, at a lower rate and with
    # the whole autoregressive loss (the trunk's copying is what the example jobs' answers are); the preview trains
    # beside it, so it keeps drafting for the trunk it verifies against. It starts from phase 2's weights rounded to
    # bf16, as phase 2's checkpoint holds them, so `--init` from that checkpoint and a run from the start end
    # alike. 0 steps leaves it out
    polish_steps: int = 0
    polish_lr: float = 3e-4
    polish_warmup: int = 20
    polish_ar_weight: float = 1.0
    # data
    extract_share: float = 0.5  # share of training pairs that are extractions (the rest summaries)
    long_share: float = 0.2  # share of long documents (facts, then more than a window of log and notes)
    copy_share: float = 0.3  # share of training pairs that are the copy drill (demo_corpus.copy_drill)
    # share of training pairs, in every phase, that are the long drill (demo_corpus.long_copy_drill: a short list
    # more than a window before "Repeat the list."); 0 draws none and leaves the stream as before
    long_drill_share: float = 0.0
    # the last `slow_heads` value heads of every GDN layer decay by exp(-slow_dt) a token whatever the input, held
    # so in every phase (model.train.TrainOptions.slow_heads); trained freely every head but one learned to forget
    # within tens of tokens (docs/models.md); held from the first step with long drills at 0.15, they carried a
    # drill's first word and item count across the log but no more long-document fields; 0 leaves every head free
    slow_heads: int = 0
    slow_dt: float = 5e-4
    # the attention window of the short copy drills' training forwards (0: the model's; model.train.Example)
    copy_window: int = 0
    # phase 1c, the GDN look-up (docs/models.md, "A look-up forms where attention cannot copy"), between phase 1b and
    # phase 2; 0 steps leaves it out (the committed recipe has none). Trained on documents, or on drills at the
    # model's window, the GDN heads stored a list but never addressed it (the next word's position ranked first at
    # chance); with an attention window of a few tokens only the GDN state can copy, and a look-up formed, but drills
    # alone for 2,500 steps took the extractions with them. So the phase mixes: phase 1b's mix, long drills at
    # `lookup_drill_share`, and of the other pairs `lookup_copy_share` short copy drills at a `lookup_window`-token
    # window (documents and long drills at the model's)
    lookup_steps: int = 0
    lookup_lr: float = 3e-3
    lookup_warmup: int = 20
    lookup_window: int = 8
    lookup_copy_share: float = 0.5
    lookup_drill_share: float = 0.15
    tokenizer_docs: int = 4000  # documents the BPE is trained on
    # where the tokenizer puts a space before a capitalised word (train_tokenizer): "attach" to the word before it,
    # "isolate" as a token of its own, "prefix" to the capitalised word (GPT-2's byte-level BPE)
    capital_space: str = "attach"
    threads: int = 2
    save_every: int = 50  # steps between saves of the resume state


def demo_config(shape: DemoShape):
    from clover_batch.model import CloverConfig
    from clover_batch.model.config import clover_diffusion

    layer_types = tuple("full_attention" if (i + 1) % shape.full_attention_interval == 0 else "linear_attention"
                        for i in range(shape.layers))
    return CloverConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, layer_types=layer_types,
        num_attention_heads=shape.attention_heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        partial_rotary_factor=0.5, rope_theta=10_000.0,
        linear_num_key_heads=shape.gdn_key_heads, linear_num_value_heads=shape.gdn_value_heads,
        linear_key_head_dim=shape.gdn_head_dim, linear_value_head_dim=shape.gdn_head_dim, linear_conv_kernel_dim=4,
        num_experts=shape.experts, num_experts_per_tok=shape.experts_per_token,
        moe_intermediate_size=shape.expert_width, shared_expert_intermediate_size=shape.shared_expert_width,
        norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=shape.tie_embeddings,
        eos_token_ids=(ENDOFTEXT_ID, IM_END_ID), pad_token_id=ENDOFTEXT_ID,
        diffusion=clover_diffusion(shape.block_size, MASK_ID),
        window_tokens=shape.window_tokens, prefill_chunk_tokens=shape.prefill_chunk_tokens, name="demo",
    )


# ---- the example jobs' prompts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instructions:
    summarize: str  # what the summarize job puts before the document
    extract: str  # the extract job's instruction with its field list


def job_instructions() -> Instructions:
    """The prompt instructions of the two example jobs, built as the pipeline builds them."""
    from clover_batch.jobs.spec import load_job
    from clover_batch.pipeline.postprocess import FieldRule
    from clover_batch.pipeline.stages import TaskRef

    summarize = load_job(str(SUMMARIZE_JOB)).task
    extract = load_job(str(EXTRACT_JOB)).task
    if summarize.kind != "summarize" or extract.kind != "extract":
        raise ValueError(f"{SUMMARIZE_JOB} must be a summarize job and {EXTRACT_JOB} an extract job")
    fields = {name: {"type": f.type, "description": f.description, **({} if f.required else {"required": False})}
              for name, f in extract.fields.items()}
    if fields != EXTRACT_FIELDS:
        raise ValueError(f"{EXTRACT_JOB} fields differ from the corpus's EXTRACT_FIELDS: the demo model is trained "
                         f"on the corpus's")
    rules = tuple(FieldRule(n, f.type, f.description, f.required) for n, f in extract.fields.items())
    return Instructions(summarize.instruction, TaskRef("extract", extract.instruction, rules).prompt_instruction())


# ---- tokenizer --------------------------------------------------------------------------------------------------


# GPT-2's pre-tokenizer pattern (without its English contractions), except that a space before a capital letter is
# never a word's prefix: a letter word followed by a space and a capital keeps that space at its end, and elsewhere
# (after punctuation or a digit) the space is a token of its own.
_ATTACH_PATTERN = (r"(?: (?!\p{Lu}))?\p{L}+ (?=\p{Lu})|(?: (?!\p{Lu}))?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
                   r"|\s+(?!\S)|\s+")
CAPITAL_SPACES = ("attach", "isolate", "prefix")


def train_tokenizer(vocab_size: int, docs: int, instructions: Instructions, *, capital_space: str = "attach"):
    """A byte-level BPE on corpus text; digits are single tokens (numbers are copied digit by digit).

    `capital_space` decides the tokens of a multi-word name such as "Kestrel Energy SRL", which extraction copies
    out of a document (`From: Kestrel Energy SRL,`) into a JSON list (`["Kestrel Energy SRL", ...`):
    - "prefix" (GPT-2): `ĠKestrel ĠEnergy ĠSRL` in the document but `Kestrel ĠEnergy ĠSRL` after `["`: the first
      word is another id, and so the copy's lookup (find the current token in the document, emit the one after it)
      finds nothing for the second word either;
    - "isolate": `Ġ Kestrel Ġ Energy Ġ SRL` in both places, but the token before every later word is the bare
      space, which occurs everywhere: the lookup needs two tokens of context;
    - "attach" (the recipe): `KestrelĠ EnergyĠ SRL` in both places; every word is the same id wherever the name
      stands, and each word's id names the next, so a name is copied by the plain one-token lookup that copies
      digits.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if capital_space not in CAPITAL_SPACES:
        raise ValueError(f"capital_space must be one of {CAPITAL_SPACES}, not {capital_space!r}")
    tok = Tokenizer(models.BPE())
    pieces = [pre_tokenizers.Digits(individual_digits=True)]
    if capital_space == "attach":
        pieces += [pre_tokenizers.Split(Regex(_ATTACH_PATTERN), behavior="isolated"),
                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    elif capital_space == "isolate":
        pieces += [pre_tokenizers.Split(Regex(r" (?=[A-Z])"), behavior="isolated"),
                   pre_tokenizers.ByteLevel(add_prefix_space=False)]
    else:
        pieces.append(pre_tokenizers.ByteLevel(add_prefix_space=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pieces)
    tok.decoder = decoders.ByteLevel()
    corpus = [make_document(TRAIN_SEEDS[i]) for i in range(docs)]
    texts = [t for d in corpus for t in (d.text, d.summary, d.extraction)]
    texts += [instructions.summarize, instructions.extract, COPY_INSTRUCTION] * 20
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    for i, t in enumerate(SPECIALS):
        if tok.token_to_id(t) != i:
            raise AssertionError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    return tok


# ---- training pairs -------------------------------------------------------------------------------------------


class PairMaker:
    """Document -> (prompt ids, answer ids) through the checkpoint's own PromptBuilder."""

    def __init__(self, checkpoint: Path, instructions: Instructions) -> None:
        from clover_batch.pipeline.tokenizer import PromptBuilder

        self.builder = PromptBuilder(str(checkpoint))
        self.instructions = instructions

    def prompt(self, doc: Document, task: str) -> list[int]:
        instruction = self.instructions.extract if task == "extract" else self.instructions.summarize
        return self.builder.build(instruction, doc.text)

    def target(self, doc: Document, task: str) -> str:
        return doc.extraction if task == "extract" else doc.summary

    def drill(self, items: str, window: int | None = None):
        """The copy drill: the list after COPY_INSTRUCTION, answered by the list itself; trained at an attention
        window of `window` tokens (None: the phase's)."""
        from clover_batch.model.train import Example

        answer = [*self.builder.encode(items, specials=False), IM_END_ID]
        return Example(self.builder.build(COPY_INSTRUCTION, items), answer, window_tokens=window)

    def long_drill(self, seed: int):
        """The long drill (demo_corpus.long_copy_drill): the list and its log after COPY_INSTRUCTION, answered by
        the list."""
        from clover_batch.model.train import Example

        listed, text = long_copy_drill(seed)
        return Example(self.builder.build(COPY_INSTRUCTION, text),
                       [*self.builder.encode(listed, specials=False), IM_END_ID])

    def example(self, doc: Document, task: str):
        from clover_batch.model.train import Example

        answer = [*self.builder.encode(self.target(doc, task), specials=False), IM_END_ID]
        return Example(self.prompt(doc, task), answer)


def training_pairs(maker: PairMaker, recipe: Recipe, *, short: int = 0, phase: int = 0) -> Iterator:
    """An endless seeded stream of training examples over the TRAIN_SEEDS documents; the first `short` ones are
    short documents (no filler, never long). Each phase draws its own documents (its own part of TRAIN_SEEDS)."""
    rng = random.Random(recipe.seed * 1_000 + phase)
    # phases 0 and 1 start half the seeds apart, 2 and 3 a quarter further; 4 (polish) an eighth of the way in
    i = start = (phase * len(TRAIN_SEEDS) // 2 + (phase // 2) * (len(TRAIN_SEEDS) // 4) if phase < 4
                 else (2 * phase - 7) * len(TRAIN_SEEDS) // 8)
    while True:
        first = i < short + start
        doc = make_document(TRAIN_SEEDS[(recipe.seed * 1_000_003 + i) % len(TRAIN_SEEDS)],
                            long=False if first else rng.random() < recipe.long_share, filler=not first)
        i += 1
        # drawn only when the recipe has long drills, so a recipe without them keeps its stream
        if recipe.long_drill_share and rng.random() < recipe.long_drill_share:
            yield maker.long_drill(doc.seed)
        elif rng.random() < recipe.copy_share:
            yield maker.drill(copy_drill(doc.seed), recipe.copy_window or None)
        else:
            yield maker.example(doc, "extract" if rng.random() < recipe.extract_share else "summarize")


AR_PHASE, LONG_PHASE, BD_PHASE = "autoregressive", "long documents", "block diffusion"
LOOKUP_PHASE, POLISH_PHASE = "look-up", "polish"
# each phase's `training_pairs(phase=)`: its own documents
PHASE_DATA = {AR_PHASE: 0, BD_PHASE: 1, LONG_PHASE: 2, LOOKUP_PHASE: 3, POLISH_PHASE: 4}
# the Recipe fields only these phases read; every other field shapes the first phase already (tokenizer, init, data)
PHASE_FIELDS = {
    LONG_PHASE: ("long_steps", "long_lr", "long_warmup"),
    LOOKUP_PHASE: ("lookup_steps", "lookup_lr", "lookup_warmup", "lookup_window", "lookup_copy_share",
                   "lookup_drill_share"),
    BD_PHASE: ("bd_steps", "bd_lr", "bd_warmup", "bd_ar_weight", "eps", "noise_copies"),
    POLISH_PHASE: ("polish_steps", "polish_lr", "polish_warmup", "polish_ar_weight"),
}
UNSHAPING_FIELDS = ("threads", "save_every")  # change the time and the saves, never the weights


def phase_mix(recipe: Recipe, name: str) -> Recipe:
    """The recipe as phase `name` draws its training pairs: phase 1b has its own mix of long documents and drills,
    phase 1c phase 1b's with its own shares of long drills and of short copy drills at its narrow window."""
    if name == LONG_PHASE:
        return replace(recipe, long_share=recipe.long_mix, copy_share=recipe.long_copy_share)
    if name == LOOKUP_PHASE:
        return replace(phase_mix(recipe, LONG_PHASE), copy_share=recipe.lookup_copy_share,
                       long_drill_share=recipe.lookup_drill_share, copy_window=recipe.lookup_window)
    return recipe


def phases(recipe: Recipe):
    """The recipe's training phases (model.train.Phase), those with steps, in order: autoregressive, long documents,
    look-up, block diffusion, polish."""
    from clover_batch.model.train import Phase, TokenWeights, TrainOptions

    common = {"min_lr_ratio": recipe.min_lr_ratio, "weight_decay": recipe.weight_decay,
              "grad_clip": recipe.grad_clip, "seed": recipe.seed, "weights": TokenWeights(1.0, recipe.answer_weight),
              "slow_heads": recipe.slow_heads, "slow_dt": recipe.slow_dt}
    out = []
    if recipe.ar_steps:
        out.append(Phase(AR_PHASE, TrainOptions(steps=recipe.ar_steps, lr=recipe.ar_lr,
                                                warmup=recipe.ar_warmup, ar_weight=1.0, bd_weight=0.0, **common)))
    if recipe.long_steps:
        out.append(Phase(LONG_PHASE, TrainOptions(steps=recipe.long_steps, lr=recipe.long_lr,
                                                  warmup=recipe.long_warmup, ar_weight=1.0, bd_weight=0.0, **common)))
    if recipe.lookup_steps:
        out.append(Phase(LOOKUP_PHASE, TrainOptions(steps=recipe.lookup_steps, lr=recipe.lookup_lr,
                                                    warmup=recipe.lookup_warmup, ar_weight=1.0, bd_weight=0.0,
                                                    **common)))
    if recipe.bd_steps:
        out.append(Phase(BD_PHASE, TrainOptions(steps=recipe.bd_steps, lr=recipe.bd_lr, warmup=recipe.bd_warmup,
                                                eps=recipe.eps, noise_copies=recipe.noise_copies,
                                                ar_weight=recipe.bd_ar_weight, bd_weight=1.0, **common)))
    if recipe.polish_steps:
        out.append(Phase(POLISH_PHASE, TrainOptions(steps=recipe.polish_steps, lr=recipe.polish_lr,
                                                    warmup=recipe.polish_warmup, eps=recipe.eps,
                                                    noise_copies=recipe.noise_copies,
                                                    ar_weight=recipe.polish_ar_weight, bd_weight=1.0,
                                                    bf16_start=True, **common)))
    if not out:
        raise ValueError("the recipe has no training steps (ar_steps, long_steps and bd_steps are all 0)")
    return out


# ---- the command ----------------------------------------------------------------------------------------------

# Recipe fields the command sets, and its option for each
COMMAND_OPTIONS = {"seed": "--seed", "ar_steps": "--ar-steps", "long_steps": "--long-steps", "bd_steps": "--bd-steps",
                   "polish_steps": "--polish-steps"}
# the recipes `train-demo --recipe NAME` starts from: the default (phases 1, 1b and 2), the GDN look-up's (phase 1c,
# held slow heads, long drills from the first step; docs/models.md), and the default with phase 3 (polish)
RECIPES = {
    "default": Recipe(),
    "look-up": Recipe(slow_heads=2, long_drill_share=0.15, lookup_steps=2400),
    "polish": Recipe(polish_steps=1500),
}


def train_command(out: Path, recipe: Recipe) -> str:
    """The `clover-batch model train-demo` command line that makes this recipe's checkpoint in `out` (threads
    change the time, not the weights, and are left out), or, for a recipe built in Python that no preset and
    options make, a sentence saying so and naming the fields that differ from the nearest preset."""
    ignored = {name: getattr(Recipe(), name) for name in (*COMMAND_OPTIONS, *UNSHAPING_FIELDS)}
    differ = {preset: [f.name for f in fields(Recipe) if f.name not in ignored
                       and getattr(recipe, f.name) != getattr(base, f.name)] for preset, base in RECIPES.items()}
    # the preset that differs in fewest fields, then needs fewest step options
    preset = min(differ, key=lambda name: (len(differ[name]), sum(getattr(recipe, f) != getattr(RECIPES[name], f)
                                                                   for f in COMMAND_OPTIONS)))
    if differ[preset]:
        return f"no train-demo command: the recipe is the {preset!r} preset with other {', '.join(differ[preset])}"
    chosen = "" if preset == "default" else f" --recipe {preset}"
    options = "".join(f" {flag} {getattr(recipe, name)}" for name, flag in COMMAND_OPTIONS.items()
                      if getattr(recipe, name) != getattr(RECIPES[preset], name))
    return f"clover-batch model train-demo --out {out}{chosen}{options}"


def later_recipe(saved: Recipe, recipe: Recipe, started: list[str]) -> None:
    """Check that `recipe` may continue a run of `saved` whose phases `started` are done (a run stopped at a phase's
    end): it differs only in fields that no started phase reads, so the finished phases are those `recipe` would
    have trained, and the run ends with the weights a run of `recipe` from the start ends with. Raises ValueError
    naming the fields otherwise."""
    free = set(UNSHAPING_FIELDS).union(*(f for name, f in PHASE_FIELDS.items() if name not in started))
    differ = [f.name for f in fields(Recipe) if getattr(saved, f.name) != getattr(recipe, f.name)]
    shaping = [name for name in differ if name not in free]
    if shaping:
        raise ValueError(f"the run's finished phases ({', '.join(started)}) were trained with other "
                         f"{', '.join(shaping)}: it can only go on under its own recipe")


RESUME = "resume"  # OUT/resume: the recipe, the shape and the saved training state of an unfinished run
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "training.json")


def _extend(state_dir: Path, saved: Recipe, recipe: Recipe) -> None:
    """Refuse to continue the run saved in `state_dir` under `recipe` unless it stopped at a phase's end and
    `recipe` differs from its own only in phases it has not started (later_recipe)."""
    import torch

    state = torch.load(state_dir / "state.pt", map_location="cpu", weights_only=True)
    plan = phases(saved)
    done = state["phase"] + 1
    if state["step"] != plan[state["phase"]].options.steps:
        raise ValueError(f"the run in {state_dir.parent} stopped inside its phase {plan[state['phase']].name!r} (step "
                         f"{state['step']} of {plan[state['phase']].options.steps}): only a run stopped at a phase's "
                         f"end can go on under another recipe")
    later_recipe(saved, recipe, [p.name for p in plan[:done]])


def _init_from(init: Path, recipe: Recipe, shape: DemoShape) -> dict:
    """What starting `recipe` from the checkpoint in `init` (made by train-demo) takes: its training report's
    recipe, phases and time, checked to be the first phases of `recipe` (the same fields, so `recipe` differs from
    its own only in phases it has not trained) with the same shape. Raises ValueError naming the difference."""
    path = init / "training.json"
    if not path.exists():
        raise FileNotFoundError(f"--init {init}: no training.json there (a checkpoint made by train-demo)")
    done = json.loads(path.read_text())
    if "init" in done:
        raise ValueError(f"--init {init}: that checkpoint was itself started from another; start from the one it "
                         f"started from ({done['init']['dir']})")
    base = Recipe(**done["recipe"])
    if DemoShape(**done["shape"]) != shape:
        raise ValueError(f"--init {init}: its shape differs from this run's ({done['shape']})")
    base_plan = [p.name for p in phases(base)]
    plan = [p.name for p in phases(recipe)]
    if plan[:len(base_plan)] != base_plan or len(plan) == len(base_plan):
        raise ValueError(f"--init {init}: its phases ({', '.join(base_plan)}) must be the first of this recipe's "
                         f"({', '.join(plan)}), with more after them")
    later_recipe(base, recipe, base_plan)
    digest = hashlib.sha256((init / "model.safetensors").read_bytes()).hexdigest()
    return {"dir": str(init), "model_sha256": digest, "command": done["command"], "recipe": done["recipe"],
            "phases_done": len(base_plan),
            "phases": done["phases"], "seconds": done["seconds"], "sessions": done["sessions"]}


def train_demo(out: Path, recipe: Recipe = Recipe(), shape: DemoShape = DemoShape(), *,
               overwrite: bool = False, resume: bool = False, threads: int | None = None,
               extend: Recipe | None = None, init: Path | None = None,
               on_log: Callable[[str, int, CloverModel, PairMaker], None] | None = None) -> dict:
    """Train the demo checkpoint into `out`; returns the training report (also written as training.json).

    resume: continue the unfinished run whose state is in OUT/resume (its recipe and shape; the ones given are
    not used), from its last save, with the same data order. extend (with resume): continue it under this recipe
    instead, which may add or change only phases the run has not started, from a save at a phase's end (the
    recipe is then the run's, in OUT/resume/run.json and training.json). init: start from the checkpoint train-demo
    made there, whose phases are the first of `recipe` (`_init_from`): its tokenizer and weights (as saved, bf16),
    then `recipe`'s later phases (phase 3 starts from bf16-rounded weights in a run from the start too, so that
    run ends with the same weights). threads: CPU threads (default: the recipe's; a
    resumed session may use another count). on_log(phase, step, model, pair maker): called at every logged step
    (bench/demo_recipes.py probes the model there); it must leave the model as it found it.
    """
    import torch
    from clover_batch.model import build_model, save_checkpoint
    from clover_batch.model.train import Saving, batches_by_prefix, init_for_training, train_phases

    state_dir = out / RESUME
    if resume:
        if not (state_dir / "run.json").exists():
            raise FileNotFoundError(f"{out} holds no unfinished training run ({state_dir / 'run.json'} is missing)")
        run = json.loads((state_dir / "run.json").read_text())
        saved, shape = Recipe(**run["recipe"]), DemoShape(**run["shape"])
        if extend is not None:
            _extend(state_dir, saved, extend)
            run["recipe"] = asdict(extend)
            run.setdefault("extended", []).append({"at": time.strftime("%Y-%m-%d %H:%M:%S"), "from": asdict(saved)})
            (state_dir / "run.json").write_text(json.dumps(run, indent=2) + "\n")
        recipe = Recipe(**run["recipe"])
    elif any((out / f).exists() for f in (*CHECKPOINT_FILES, RESUME)) and not overwrite:
        raise FileExistsError(f"{out} already holds a checkpoint or an unfinished run; pass --overwrite to replace "
                              f"it, or --resume {out} to continue the run")
    threads = recipe.threads if threads is None else threads
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    t0 = time.perf_counter()

    instructions = job_instructions()
    if not resume:
        started = _init_from(init, recipe, shape) if init is not None else None
        shutil.rmtree(state_dir, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        if started is not None:
            shutil.copyfile(init / "tokenizer.json", out / "tokenizer.json")
        else:
            tokenizer = train_tokenizer(shape.vocab_size, recipe.tokenizer_docs, instructions,
                                        capital_space=recipe.capital_space)
            if tokenizer.get_vocab_size(with_added_tokens=True) > shape.vocab_size:
                raise AssertionError("tokenizer larger than the model's vocabulary")
            tokenizer.save(str(out / "tokenizer.json"))
        state_dir.mkdir()
        (state_dir / "run.json").write_text(json.dumps({"recipe": asdict(recipe), "shape": asdict(shape),
                                                        "tokenizer_seconds": round(time.perf_counter() - t0, 1),
                                                        "sessions": [],
                                                        **({"init": started} if started else {})}, indent=2) + "\n")
    elif init is not None:
        raise ValueError("--resume goes on from the run's own start; --init applies to a new run")
    run = json.loads((state_dir / "run.json").read_text())
    run["sessions"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": threads,
                            "load_average_before": [round(x, 2) for x in load_before]})
    (state_dir / "run.json").write_text(json.dumps(run, indent=2) + "\n")

    config = demo_config(shape)
    model = build_model(config)
    init_for_training(model, recipe.seed, embedding_std=recipe.embedding_std)
    started = run.get("init")
    skip = started["phases_done"] if started else 0  # phases the init checkpoint trained
    if started:  # (a resumed run's saved state, when there is one, replaces these weights)
        from clover_batch.model import load_model

        model.load_state_dict(load_model(started["dir"], dtype=torch.float32).state_dict())
    maker = PairMaker(out, instructions)
    plan = phases(recipe)
    short = int(recipe.short_share * recipe.ar_steps) * recipe.batch_size

    def batches(k: int):
        k += skip  # the plan's index (train_phases counts the phases it runs)
        name = plan[k].name
        stream = training_pairs(maker, phase_mix(recipe, name), short=short if name == AR_PHASE else 0,
                                phase=PHASE_DATA[name])
        # the batch order's seed follows the phase's place in the plan (as runs before phase 1b had it), its
        # documents the phase's name
        return batches_by_prefix(stream, recipe.batch_size, shape.block_size, seed=recipe.seed + k)

    def logged(phase: str, step: int, report, seconds: float) -> None:
        parts = "".join(f"  {n} {v:.4f}" for n, v in (("ar", report.ar), ("bd", report.bd)) if v is not None)
        log.info("%s step %d  loss %.4f%s  %.0f s  load %.2f", phase, step, float(report.loss), parts, seconds,
                 os.getloadavg()[0])
        if on_log is not None:
            on_log(phase, step, model, maker)

    logs = train_phases(model, plan[skip:], batches, saving=Saving(state_dir / "state.pt", recipe.save_every),
                        on_log=logged)
    # bf16 on disk halves the file (trained in fp32; jobs load it back as float32 or bfloat16 as they ask)
    save_checkpoint(model.to(torch.bfloat16), out)
    total, active = config.parameter_counts()
    run["sessions"][-1]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    report = {
        # with --init too: phase 3's bf16 start makes a run from the start end with the same weights
        "command": train_command(out, recipe),
        "recipe": asdict(recipe),
        "shape": asdict(shape),
        "parameters": {"total": total, "active_per_token": active},
        "instructions": asdict(instructions),
        "phases": [{"name": p.name, "steps": lg.steps, "loss": [round(x, 4) for x in lg.losses],
                    "ar": [round(x, 4) for x in lg.ar], "bd": [round(x, 4) for x in lg.bd],
                    "load_average": [round(x, 2) for x in lg.load], "tokens_seen": lg.tokens,
                    "seconds": round(lg.seconds, 1), "cpu_seconds": round(lg.cpu_seconds, 1)}
                   for p, lg in zip(plan[skip:], logs, strict=True)],
        "seconds": {"tokenizer": run["tokenizer_seconds"], "training": round(sum(lg.seconds for lg in logs), 1),
                    "training_cpu": round(sum(lg.cpu_seconds for lg in logs), 1)},
        "sessions": run["sessions"],
        **({"extended": run["extended"]} if "extended" in run else {}),
        # the checkpoint the run started from: its command, recipe, phases (loss curves), time and sessions
        **({"init": started} if started else {}),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__},
    }
    report["seconds"]["total"] = round(report["seconds"]["tokenizer"] + report["seconds"]["training"], 1)
    if started:  # what making the checkpoint took: the one it started from, then this run
        report["seconds_this_run"] = report["seconds"]
        report["seconds"] = {k: round(v + started["seconds"][k], 1) for k, v in report["seconds"].items()}
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    shutil.rmtree(state_dir)
    return report


# ---- scoring (the bench and the tests) --------------------------------------------------------------------------


def field_matches(answer: str, doc: Document) -> dict[str, bool]:
    """Per EXTRACT_FIELDS field: does the answer, checked as the pipeline checks it, give the document's value?

    An answer the pipeline refuses (no JSON object, a missing required field, a wrong type) matches no field.
    """
    from clover_batch.pipeline.postprocess import FieldRule, check_extraction

    rules = [FieldRule(n, f["type"], f["description"], f.get("required", True)) for n, f in EXTRACT_FIELDS.items()]
    checked = check_extraction(answer, rules)
    if checked.output_json is None:
        return dict.fromkeys(EXTRACT_FIELDS, False)
    got = json.loads(checked.output_json)
    return {name: got[name] == doc.fields[name] for name in EXTRACT_FIELDS}


def token_similarity(ours: list[int], target: list[int]) -> float:
    """1 - (token edit distance / length of the longer sequence): 1.0 is the exact target."""
    if not ours and not target:
        return 1.0
    prev = list(range(len(target) + 1))
    for i, a in enumerate(ours, 1):
        cur = [i] + [0] * len(target)
        for j, b in enumerate(target, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a != b))
        prev = cur
    return 1.0 - prev[-1] / max(len(ours), len(target))
