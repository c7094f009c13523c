"""DecodeOptions: the one typed set of decoding options, from the job file and the CLI down to the engine.

Notable choices:
- Each field carries its help text and bounds in its metadata. `__post_init__` enforces them, so a bad value fails
  where the options are written ("threshold must be <= 1, got 1.5"), and jobs/spec.py builds the job schema's
  `decode` section from the same fields (no second copy of names, defaults, bounds or help).
- What depends on the model (the vocabulary, the block size, the decode mode) is checked by `check(config)`, once
  the model is known.
- Penalties (presence, frequency, repetition) count the response only, never the prompt, as Clover's vendor
  decoder does (the public record, S4); they change the logits before tokens and confidences are taken, in every
  mode (sampling.apply_penalties).
- `verified` asks of the model what `autoregressive` does (causal logits that score the next token) plus a preview
  to draft with, and is greedy only: its contract is the autoregressive output token for token, and a sampled
  draft accepted by a sampled check would be another distribution's draw, not that output.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from .config import CloverConfig

MODES = ("auto", "diffusion", "autoregressive", "verified")


def option(default: Any, help: str, **bounds: float) -> Any:
    """A dataclass field with help text and bounds (ge, gt, le) in its metadata."""
    return field(default=default, metadata={"help": help, **bounds})


@dataclass(frozen=True)
class DecodeOptions:
    max_new_tokens: int = option(256, "Most tokens generated per document.", ge=1)
    threshold: float = option(0.9, "Diffusion and verified drafts: fill every masked position at least this "
                                   "confident in a denoising step (and at least the most confident one).", gt=0, le=1)
    tokens_per_step: int | None = option(None, "Diffusion and verified drafts: fill exactly this many positions "
                                               "per step instead of using the threshold (reproducible speed).", ge=1)
    temperature: float = option(0.0, "Sampling temperature; 0 is greedy.", ge=0)
    top_p: float = option(1.0, "Nucleus sampling mass.", gt=0, le=1)
    seed: int | None = option(None, "Random seed for sampling (temperature > 0); unset: fresh draws each run.")
    stop_token_ids: tuple[int, ...] | None = option(None, "Token ids that end generation; unset: the model's "
                                                          "end-of-sequence ids.")
    window_tokens: int | None = option(None, "Override the model's attention window (tokens a full-attention "
                                             "layer looks back).", ge=1)
    prefill_chunk_tokens: int | None = option(None, "Override the tokens per prefill forward pass.", ge=1)
    mode: typing.Literal["auto", "diffusion", "autoregressive", "verified"] = option(
        "auto", "auto: block diffusion for a diffusion checkpoint, else autoregressive; diffusion; "
                "autoregressive (a diffusion checkpoint whose causal logits score the next token, such as Clover, "
                "then runs its causal trunk one token at a time); or verified (such a checkpoint's preview drafts "
                "a block, by threshold or tokens_per_step, one causal pass of the trunk verifies the drafted run "
                "it agrees with plus its own next token, and the rest is drafted again: the autoregressive output "
                "exactly, several tokens per forward where the preview agrees with the trunk; greedy only).")
    presence_penalty: float = option(0.0, "Subtracted from the logit of every token already in the response (not "
                                          "the prompt).")
    frequency_penalty: float = option(0.0, "Subtracted from a token's logit once per time it is already in the "
                                           "response.")
    repetition_penalty: float = option(1.0, "Tokens already in the response: positive logits divided by it, "
                                            "negative ones multiplied (1: off).", gt=0)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and _allows_none(hints[f.name]):
                continue
            value = _coerce(f.name, value, hints[f.name])
            object.__setattr__(self, f.name, value)
            for bound, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                                    ("le", lambda v, b: v <= b, "<=")):
                if bound in f.metadata and not ok(value, f.metadata[bound]):
                    raise ValueError(f"{f.name} must be {word} {f.metadata[bound]:g}, got {value!r}")

    def replace(self, **changes: Any) -> DecodeOptions:
        return dataclasses.replace(self, **changes)

    def diffusion(self, config: CloverConfig) -> bool:
        """Whether these options decode `config`'s model by block diffusion (else one token per step)."""
        if self.mode == "auto":
            return config.diffusion is not None
        return self.mode == "diffusion"

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check(self, config: CloverConfig) -> None:
        """The checks that need the model: stop ids in its vocabulary, the mode, block size against k and chunk."""
        for tid in self.stop_token_ids or ():
            if not 0 <= tid < config.vocab_size:
                raise ValueError(f"stop_token_ids: {tid} is outside the vocabulary (size {config.vocab_size})")
        if self.mode == "diffusion" and config.diffusion is None:
            raise ValueError("mode 'diffusion' needs a block-diffusion model; this model is autoregressive")
        if self.mode == "autoregressive" and config.diffusion is not None and not config.diffusion.logits_shift:
            raise ValueError("mode 'autoregressive' needs a model whose causal logits score the next token; this "
                             "diffusion model predicts each position from itself (logits_shift false)")
        if self.mode == "verified":
            if config.diffusion is None:
                raise ValueError("mode 'verified' drafts blocks with a block-diffusion preview; this model is "
                                 "autoregressive (use mode 'autoregressive')")
            if not config.diffusion.logits_shift:
                raise ValueError("mode 'verified' checks drafts against the causal trunk's next-token choices; this "
                                 "diffusion model predicts each position from itself (model logits_shift false), so "
                                 "its trunk has no next-token choice to check against")
            if self.temperature > 0:
                raise ValueError(f"mode 'verified' is greedy (its output is the autoregressive greedy output); "
                                 f"temperature must be 0, got {self.temperature:g}")
            bs = config.diffusion.block_size
            if self.tokens_per_step is not None and self.tokens_per_step > bs:
                raise ValueError(f"tokens_per_step must be in [1, block_size={bs}], got {self.tokens_per_step}")
        elif self.diffusion(config):
            assert config.diffusion is not None
            bs = config.diffusion.block_size
            if self.tokens_per_step is not None and self.tokens_per_step > bs:
                raise ValueError(f"tokens_per_step must be in [1, block_size={bs}], got {self.tokens_per_step}")
            if self.chunk(config) % bs:
                raise ValueError(f"prefill_chunk_tokens {self.chunk(config)} must be a multiple of the block size "
                                 f"{bs} (block_size {bs} does not divide prefill_chunk_tokens)")
        elif self.tokens_per_step not in (None, 1):
            why = "this model is autoregressive" if config.diffusion is None else "mode is autoregressive"
            raise ValueError(f"tokens_per_step applies to diffusion decoding; {why}")

    def chunk(self, config: CloverConfig) -> int:
        return self.prefill_chunk_tokens or config.prefill_chunk_tokens

    def window(self, config: CloverConfig) -> int:
        return self.window_tokens or config.window_tokens

    def stops(self, config: CloverConfig) -> tuple[int, ...]:
        return config.eos_token_ids if self.stop_token_ids is None else self.stop_token_ids

    def windows(self, config: CloverConfig, prompt_tokens: int) -> int:
        """Attention windows a prompt of this length spans."""
        return math.ceil(prompt_tokens / self.window(config))


def _allows_none(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """`value` as the field's type (ints accepted for floats, lists for tuples), or a ValueError naming the field."""
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    kind = kinds[0]
    if typing.get_origin(kind) is typing.Literal:
        if value not in typing.get_args(kind):
            raise ValueError(f"{name} must be one of {', '.join(map(str, typing.get_args(kind)))}, got {value!r}")
        return value
    if typing.get_origin(kind) is tuple:
        if not isinstance(value, list | tuple) or not all(_is_int(v) for v in value):
            raise ValueError(f"{name} must be a list of integers, got {value!r}")
        return tuple(int(v) for v in value)
    if kind is float and (_is_int(value) or isinstance(value, float)):
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"{name} must be a number, got nan")
        return float(value)
    if kind is int and _is_int(value):
        return int(value)
    raise ValueError(f"{name} must be {'a number' if kind is float else 'an integer'}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
