"""Model commands of the CLI: `model init`, `model inspect`, `generate`.

`model init` is the one place a preset becomes a checkpoint directory: the model package writes config.json and
the weights (`save_checkpoint`), the pipeline package supplies the byte-level tokenizer, and this module puts them
side by side. Every expected failure (unknown preset, bad checkpoint, existing output) is one red line and exit
code 2, never a traceback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from clover_batch.jobs.demo_model import RECIPES, Recipe
from clover_batch.model.options import DecodeOptions
from rich.console import Console
from rich.table import Table

model_app = typer.Typer(help="Create and inspect checkpoints.", no_args_is_help=True)

console = Console()
err_console = Console(stderr=True)

CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")


class DType(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class CommandError(Exception):
    """A user-facing failure: shown as one line, exit code 2."""


@contextmanager
def _clean_errors() -> Iterator[None]:
    """Known failures print their message and exit 2; anything else is a bug and keeps its traceback."""
    from clover_batch.model import CheckpointError, ConfigError

    try:
        yield
    except (CommandError, ConfigError, CheckpointError, FileNotFoundError, ValueError) as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def write_checkpoint(preset: str, out: Path, *, seed: int = 0, dtype: str = "float32", per_expert: bool = False,
                     overwrite: bool = False) -> Path:
    """A complete checkpoint directory for `preset`: config.json, model.safetensors, tokenizer.json."""
    import torch
    from clover_batch.model import ConfigError, is_preset, load_model, save_checkpoint
    from clover_batch.pipeline.tokenizer import build_byte_tokenizer

    if not is_preset(preset):
        from clover_batch.model.config import PRESETS

        raise ConfigError(f"unknown preset {preset!r}; presets are {', '.join(sorted(PRESETS))}")
    existing = [name for name in CHECKPOINT_FILES if (out / name).exists()]
    if out.exists() and not out.is_dir():
        raise CommandError(f"{out} exists and is not a directory")
    if existing and not overwrite:
        raise CommandError(f"{out} already holds a checkpoint ({', '.join(existing)}); pass --overwrite to replace it")
    model = load_model(preset, seed=seed, dtype=getattr(torch, dtype))
    tokenizer = build_byte_tokenizer()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > model.config.vocab_size:
        raise ConfigError(f"preset {preset!r} has a vocabulary of {model.config.vocab_size}, smaller than the byte "
                          f"tokenizer's {vocab} tokens")
    save_checkpoint(model, out, per_expert=per_expert)
    tokenizer.save(str(out / "tokenizer.json"))
    return out


@model_app.command("init")
def init(
    preset: Annotated[str, typer.Option(help="Preset to instantiate with random weights, e.g. tiny or bench.")],
    out: Annotated[Path, typer.Option(help="Checkpoint directory to write (created if missing).")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    dtype: Annotated[DType, typer.Option(help="Dtype of the stored weights.")] = DType.float32,
    per_expert: Annotated[
        bool, typer.Option("--per-expert", help="Store experts one tensor each (default: packed 3-D stacks).")
    ] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a checkpoint already in --out.")] = False,
) -> None:
    """Write a checkpoint directory (config.json, model.safetensors, tokenizer.json) for a preset."""
    with _clean_errors():
        path = write_checkpoint(preset, out, seed=seed, dtype=dtype.value, per_expert=per_expert,
                                overwrite=overwrite)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    console.print(f"wrote {preset} ({dtype.value}, seed {seed}) to {path}: "
                  f"{', '.join(CHECKPOINT_FILES)} ({size / 1e6:.1f} MB)", highlight=False, soft_wrap=True)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit} ({n:,})"
    return f"{n:,}"


def architecture_table(source: str) -> Table:
    """What `model inspect` prints: the config of a preset or checkpoint directory, its parameter counts, where each
    value came from (file and key), what the checkpoint holds and skips, and how its denoising steps are computed
    (published formula or the public record's reading, piece by piece)."""
    from clover_batch.model import is_preset, kernels, load_config
    from clover_batch.model.preview import PIECES

    cfg = load_config(source)
    preset = is_preset(source)
    src = cfg.sources

    def origin(*keys: str) -> str:
        if preset:
            return "preset"
        return "; ".join(dict.fromkeys(src.get(k, "?") for k in keys))

    total, active = cfg.parameter_counts()
    n_gdn = sum(kind == "linear_attention" for kind in cfg.layer_types)
    table = Table(title=f"{source}")
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_column("from", style="dim")
    if cfg.diffusion is not None:
        d = cfg.diffusion
        kind = (f"diffusion (block size {d.block_size}, mask token {d.mask_token_id}, prompt attention "
                f"{d.prompt_attention}, logits shift {str(d.logits_shift).lower()}, preview operator "
                f"{d.preview_operator}{f', coreset {d.coreset_size}' if d.coreset_size else ''})")
        kind_from = origin("diffusion.block_size", "diffusion.mask_token_id", "diffusion.logits_shift",
                           "diffusion.coreset_size")
    else:
        kind, kind_from = "autoregressive", "preset" if preset else "config.json (no block settings)"
    rows = [
        ("model", kind, kind_from),
        ("parameters", _count(total), "computed"),
        ("active per token", _count(active), "computed"),
        ("layers", f"{cfg.num_hidden_layers}: {n_gdn} Gated DeltaNet, {cfg.num_hidden_layers - n_gdn} full attention",
         origin("layer_types")),
        ("hidden size", str(cfg.hidden_size), origin("hidden_size")),
        ("attention", f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} kv heads of {cfg.head_dim}, "
                      f"RoPE on {cfg.rotary_dim} dims (theta {cfg.rope_theta:g}), window {cfg.window_tokens}",
         origin("num_attention_heads", "num_key_value_heads", "head_dim", "partial_rotary_factor", "rope_theta",
                "window_tokens")),
        ("Gated DeltaNet", f"{cfg.linear_num_key_heads} key / {cfg.linear_num_value_heads} value heads, "
                           f"dims {cfg.linear_key_head_dim} / {cfg.linear_value_head_dim}, "
                           f"conv kernel {cfg.linear_conv_kernel_dim}",
         origin("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")),
        ("experts", f"{cfg.num_experts} routed, top {cfg.num_experts_per_tok}, width {cfg.moe_intermediate_size}; "
                    f"shared expert width {cfg.shared_expert_intermediate_size}",
         origin("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "norm_topk_prob")),
        ("vocabulary", f"{cfg.vocab_size}, eos {list(cfg.eos_token_ids)}, "
                       f"{'tied' if cfg.tie_word_embeddings else 'separate'} lm_head",
         origin("vocab_size", "eos_token_ids", "tie_word_embeddings")),
    ]
    if not preset:
        from clover_batch.model import vendor_decode_defaults
        from clover_batch.model.weights import checkpoint_inventory

        inv = checkpoint_inventory(Path(source))
        skipped = ", ".join(f"{name} ({n} tensors)" for name, n in inv.skipped.items()) or "nothing"
        rows.append(("weights", f"{inv.tensors} tensors in {inv.files} file(s); names under "
                                f"{', '.join(inv.prefixes) or 'no prefix'}; experts {inv.experts}; skipped: {skipped}",
                     "safetensors headers"))
        if inv.block_diffusion:
            rows.append(("block-diffusion GDN tensors",
                         ", ".join(f"{k} ({n} layers)" for k, n in inv.block_diffusion.items()),
                         "safetensors headers"))
        for name, (value, where) in vendor_decode_defaults(Path(source)).items():
            rows.append((f"decode default: {name}", repr(value), where))
    if cfg.diffusion is not None:
        if cfg.diffusion.clover:
            for piece, status, where in PIECES:
                if "coreset" in piece and cfg.diffusion.coreset_size is None:
                    piece += ": off (coreset_size unset)"
                rows.append((f"preview: {status}", piece, where))
        else:
            rows.append(("preview", "the model's own forward over the block (block-causal attention, causal GDN)",
                         "preview_operator trunk"))
    rows.append(("decode modes", decode_modes(cfg), "block settings, logits_shift"))
    from clover_batch.model.precision import checkpoint_dtype, choose_dtype

    choice = choose_dtype("auto", None if preset else checkpoint_dtype(source), "cpu")
    rows.append(("dtype (auto, this CPU)", f"{choice.name}: {choice.reason}", "config.json, the CPU"))
    rows.append(("kernels", kernels.describe(),
                 f"{kernels.KERNELS_ENV}=torch|fla|auto, {kernels.ATTENTION_ENV}=dense|flex|auto choose"))
    for field, value, where in rows:
        table.add_row(field, value, where)
    return table


def decode_modes(cfg) -> str:
    """`model inspect`'s line on the decode modes this model allows: what each guarantees and costs."""
    d = cfg.diffusion
    if d is None:
        return "autoregressive only (one token per forward)"
    if not d.logits_shift:
        return ("diffusion only: the causal logits do not score the next token (logits_shift false), so neither "
                "autoregressive nor verified applies")
    return ("diffusion (threshold or k tokens per step: fastest, output differs from the trunk's where the preview "
            "does); autoregressive (the causal trunk, exact, one token per forward); verified (the trunk's "
            "autoregressive output token for token, greedy only; per round the preview's forwards and one check, "
            "so it saves forwards only where the preview agrees with the trunk for several tokens: pick it for "
            "extraction, where every value must be the trunk's)")


@model_app.command("inspect")
def inspect(
    source: Annotated[str, typer.Argument(help="Checkpoint directory or preset name.")],
) -> None:
    """Print a model's architecture, parameter counts (total and active per token) and whether it is a diffusion
    model."""
    with _clean_errors():
        table = architecture_table(source)
    console.print(table)


@model_app.command("parity")
def parity(
    code_dir: Annotated[Path, typer.Argument(help="A Hugging Face snapshot folder of the checkpoint: its "
                                                  "modeling_*.py, configuration_*.py and config.json.")],
    trust_remote_code: Annotated[bool, typer.Option(
        "--trust-remote-code", help="Run the Python code of CODE_DIR (in a child process).")] = False,
    adapter: Annotated[Path | None, typer.Option(
        help="File defining preview_logits(model, prompt_ids, block_ids) and generate_blocks(model, prompt_ids, "
             "max_new_tokens) for the authors' model (default: CODE_DIR/clover_parity_adapter.py).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random weights and inputs.")] = 0,
    tolerance: Annotated[float, typer.Option(help="Largest difference accepted, relative to the reference's "
                                                  "scale.")] = 1e-4,
) -> None:
    """Compare our implementation with the checkpoint authors' code on a tiny model of Clover's architecture:
    prefill logits and layer outputs, one preview pass, the commit pass and greedy block decoding. Exit 0: all
    equal; 1: a mismatch; 4: no mismatch, but some passes could not be compared (no adapter entry point)."""
    from clover_batch.jobs.parity import ParityError, run_parity

    try:
        report = run_parity(code_dir, trust_remote_code=trust_remote_code, adapter=adapter, seed=seed,
                            tolerance=tolerance)
    except ParityError as e:
        err_console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    table = Table(title=f"parity with {code_dir} (tolerance {tolerance:g})")
    for column in ("pass", "result", "max difference / detail"):
        table.add_column(column)
    for p in report.passes:
        result = "match" if p.compared and p.ok else "MISMATCH" if p.compared else "not compared"
        table.add_row(p.name, result, p.detail)
    console.print(table)
    raise typer.Exit(report.exit_code)


@model_app.command("train-demo")
def train_demo_command(
    out: Annotated[Path, typer.Option(help="Checkpoint directory to write.")] = Path("jobs/examples/demo"),
    seed: Annotated[int, typer.Option(help="Seed of the tokenizer corpus, initialisation, data order and noise.")] = 0,
    ar_steps: Annotated[int | None, typer.Option(
        help=f"Phase 1 steps: autoregressive, next-token loss on whole sequences (recipe: {Recipe.ar_steps}).")] = None,
    long_steps: Annotated[int | None, typer.Option(
        help=f"Phase 1b steps: autoregressive again, on mostly long documents (facts beyond the attention window); "
             f"0 leaves the phase out (recipe: {Recipe.long_steps}).")] = None,
    bd_steps: Annotated[int | None, typer.Option(
        help=f"Phase 2 steps: block diffusion from the phase-1 weights, with {Recipe.bd_ar_weight} of the "
             f"autoregressive loss kept (recipe: {Recipe.bd_steps}).")] = None,
    polish_steps: Annotated[int | None, typer.Option(
        help=f"Phase 3 steps: block diffusion again, at {Recipe.polish_lr} with the whole autoregressive loss; 0 "
             f"leaves it out (recipe 'polish': {RECIPES['polish'].polish_steps}, others 0).")] = None,
    recipe_name: Annotated[str | None, typer.Option("--recipe", help=(
        "Preset recipe the step options change: 'default' (phases 1, 1b, 2), 'polish' (the default and phase 3, "
        "the committed checkpoint's) or 'look-up' (phases 1c-1e teach the GDN heads to look a fact up, "
        "docs/models.md). With --resume: go on under it from a save at a phase's end, where it differs only in "
        "phases the run has not started."))] = None,
    init: Annotated[Path | None, typer.Option(
        help="Start from the checkpoint train-demo made in this directory, whose phases are the first of the "
             "recipe's, and train only the recipe's later phases.")] = None,
    threads: Annotated[int, typer.Option(help="CPU threads for training (on a busy machine 1 is faster).")] = 2,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a checkpoint already in --out.")] = False,
    resume: Annotated[Path | None, typer.Option(
        help="Continue the unfinished run in this directory (its --out) from its last save, with its recipe and "
             "the same data order; --threads may differ.")] = None,
) -> None:
    """Train the small `demo` checkpoint on synthetic documents (CPU, at most 150 minutes on 2 cores; resumable);
    see jobs/demo_model.py."""
    import dataclasses
    import logging

    from clover_batch.jobs.demo_model import train_demo

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with _clean_errors():
        if recipe_name is not None and recipe_name not in RECIPES:
            raise CommandError(f"--recipe {recipe_name!r} is not a preset: choose one of {', '.join(RECIPES)}")
        recipe = dataclasses.replace(RECIPES[recipe_name or "default"], seed=seed, threads=threads)
        if ar_steps is not None:
            recipe = dataclasses.replace(recipe, ar_steps=ar_steps)
        if long_steps is not None:
            recipe = dataclasses.replace(recipe, long_steps=long_steps)
        if bd_steps is not None:
            recipe = dataclasses.replace(recipe, bd_steps=bd_steps)
        if polish_steps is not None:
            recipe = dataclasses.replace(recipe, polish_steps=polish_steps)
        steps = (ar_steps, long_steps, bd_steps, polish_steps)
        if resume is not None and recipe_name is None and any(x is not None for x in steps):
            raise CommandError("--resume continues a run with its own recipe: --ar-steps, --long-steps, "
                               "--bd-steps and --polish-steps apply only with --recipe (to go on under another "
                               "recipe)")
        if resume is not None and init is not None:
            raise CommandError("--init starts a new run; --resume goes on with a run from where it started")
        try:
            if resume is not None:
                out = resume
            report = train_demo(out, recipe, overwrite=overwrite, resume=resume is not None, threads=threads,
                                extend=recipe if resume is not None and recipe_name is not None else None,
                                init=init)
        except (FileExistsError, FileNotFoundError, ValueError) as e:
            raise CommandError(str(e)) from None
    size = (out / "model.safetensors").stat().st_size
    console.print(f"wrote {out}: {report['parameters']['total'] / 1e6:.2f}M parameters, model.safetensors "
                  f"{size / 1e6:.1f} MB, final loss {report['phases'][-1]['loss'][-1]}, "
                  f"{report['seconds']['total'] / 60:.1f} min", highlight=False, soft_wrap=True)


def generate_text(source: str, prompt: str, options: DecodeOptions, *, raw: bool = False, dtype: str = "float32",
                  enable_thinking: bool = False):
    """Load `source`, generate for one text prompt; returns (text, Generation). The answer's think block, if any,
    is removed from the text, as the pipeline does."""
    import torch
    from clover_batch.model import generate, load_model
    from clover_batch.pipeline.postprocess import strip_thinking
    from clover_batch.pipeline.tokenizer import PromptBuilder

    if not prompt:
        raise CommandError("--prompt is empty")
    builder = PromptBuilder(source, enable_thinking=enable_thinking)
    ids = builder.encode(prompt, specials=True) if raw else builder.chat(prompt)
    model = load_model(source, dtype=getattr(torch, dtype))
    result = generate(model, [ids], options)[0]
    return strip_thinking(builder.decode(result.tokens)), result


def _help(name: str) -> str:
    """A decode option's help text, from DecodeOptions itself."""
    return next(f.metadata["help"] for f in dataclasses.fields(DecodeOptions) if f.name == name)


class Mode(StrEnum):
    auto = "auto"
    diffusion = "diffusion"
    autoregressive = "autoregressive"
    verified = "verified"


def generate_command(
    model: Annotated[str, typer.Option(help="Checkpoint directory or preset name.")],
    prompt: Annotated[str, typer.Option(help="Text of the user message.")],
    raw: Annotated[bool, typer.Option("--raw", help="Encode the prompt as is, without the chat template.")] = False,
    max_new_tokens: Annotated[int, typer.Option(help=_help("max_new_tokens"))] = DecodeOptions.max_new_tokens,
    threshold: Annotated[float | None, typer.Option(
        help=_help("threshold") + " Default: the checkpoint's, else 0.9.")] = None,
    tokens_per_step: Annotated[int | None, typer.Option(help=_help("tokens_per_step"))] = None,
    temperature: Annotated[float, typer.Option(help=_help("temperature"))] = DecodeOptions.temperature,
    top_p: Annotated[float, typer.Option(help=_help("top_p"))] = DecodeOptions.top_p,
    seed: Annotated[int | None, typer.Option(help=_help("seed"))] = None,
    stop_token_id: Annotated[list[int] | None, typer.Option(help=_help("stop_token_ids") + " Repeatable.")] = None,
    window_tokens: Annotated[int | None, typer.Option(help=_help("window_tokens"))] = None,
    prefill_chunk_tokens: Annotated[int | None, typer.Option(help=_help("prefill_chunk_tokens"))] = None,
    mode: Annotated[Mode, typer.Option(help=_help("mode"))] = Mode.auto,
    presence_penalty: Annotated[float | None, typer.Option(help=_help("presence_penalty") + " Default: the "
                                                           "checkpoint's, else 0.")] = None,
    frequency_penalty: Annotated[float | None, typer.Option(help=_help("frequency_penalty") + " Default: the "
                                                            "checkpoint's, else 0.")] = None,
    repetition_penalty: Annotated[float | None, typer.Option(help=_help("repetition_penalty") + " Default: the "
                                                             "checkpoint's, else 1.")] = None,
    enable_thinking: Annotated[bool, typer.Option(
        "--enable-thinking", help="Render the chat template with enable_thinking (the think block is removed from "
                                  "the text).")] = False,
    dtype: Annotated[DType, typer.Option(help="Compute dtype.")] = DType.float32,
) -> None:
    """Generate for one prompt and print the text with the counts: the quick way to try a checkpoint. Decode
    controls not given here come from the checkpoint (generation_config.json), as in a job."""
    with _clean_errors():
        given = dict(threshold=threshold, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                     repetition_penalty=repetition_penalty,
                     stop_token_ids=tuple(stop_token_id) if stop_token_id else None)
        if Path(model).is_dir():
            from clover_batch.model import vendor_decode_defaults

            for name, (value, where) in vendor_decode_defaults(Path(model)).items():
                if given.get(name) is None:
                    given[name] = value
                    err_console.print(f"{name} = {value!r} from {where}", highlight=False, style="dim")
        options = DecodeOptions(max_new_tokens=max_new_tokens, tokens_per_step=tokens_per_step,
                                temperature=temperature, top_p=top_p, seed=seed, window_tokens=window_tokens,
                                prefill_chunk_tokens=prefill_chunk_tokens, mode=mode.value,
                                **{k: v for k, v in given.items() if v is not None})
        text, g = generate_text(model, prompt, options, raw=raw, dtype=dtype.value, enable_thinking=enable_thinking)
    console.print(text, highlight=False, markup=False, soft_wrap=True)
    seconds = g.prefill_seconds + g.decode_seconds
    per_forward = len(g.tokens) / max(1, g.denoising_steps)
    confidence = "" if g.mean_logprob is None else f", mean log-probability {g.mean_logprob:.3f} under the trunk"
    err_console.print(
        f"prompt {g.prompt_tokens} tokens ({g.windows} window(s)), generated {len(g.tokens)} tokens "
        f"(stopped: {g.stopped}) in {g.denoising_steps} denoising steps, {g.forward_passes} forward passes "
        f"({per_forward:.2f} tokens/step){confidence}; prefill {g.prefill_seconds:.2f} s, decode "
        f"{g.decode_seconds:.2f} s, {len(g.tokens) / max(g.decode_seconds, 1e-9):.1f} tokens/s decode, "
        f"{seconds:.2f} s total",
        highlight=False, soft_wrap=True)


def register_model_commands(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")
    app.command("generate")(generate_command)
