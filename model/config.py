"""Model configuration: one flat frozen dataclass, read from a checkpoint's config.json or built from a preset.

Notable choices:
- The Qwen3.5-MoE text config is read flat or nested under `text_config`; rope settings are read from
  `rope_parameters` (transformers 5) or flat (`rope_theta`, `partial_rotary_factor`, older files).
- Required fields missing from the file are errors naming the field. The only defaults are the ones the reference
  implementation itself applies when a file leaves a field out (`norm_topk_prob` true, conv kernel 4, layer pattern
  from `full_attention_interval`), each written out below, never `getattr(..., default)`.
- A `diffusion` object makes the checkpoint a block-diffusion model; without one the model is autoregressive.
  Our own extra keys live under `clover`.
- A published Clover checkpoint (`model_type: clover_moe`, architecture `CloverMoeModelLM`) has no `diffusion`
  object: its block size and mask id are read from config.json or generation_config.json under the names public
  dLLM checkpoints use (`DIFFUSION_KEYS`), or given by the job (`overrides`); it denoises with the preview
  operator of the public record (`preview_operator: clover`) and prefills and commits causally.
- Every value remembers where it came from (`CloverConfig.sources`: "config.json:text_config.hidden_size", a
  job override, or the reference's default), for `model inspect`.

Why one file of about 650 lines: the config's fields, the presets, and the reading of Hugging Face and Clover
config files (every name a checkpoint may use, with the source each value came from) are one schema; apart, every
new field would be written in three files.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_TYPES = ("linear_attention", "full_attention")
PROMPT_ATTENTION = ("block_causal", "causal")
# How a denoising step computes the block (model/preview.py):
#   trunk: the model's own layers over the block (block-causal attention, causal GDN), state not written
#   clover: the public record's preview operator (bidirectional attention in the block, GDN right conv taps and
#           the history-slot softmax mixer, optional expert coreset); needs the block-diffusion GDN tensors
PREVIEW_OPERATORS = ("trunk", "clover")
CLOVER_MODEL_TYPES = ("clover_moe",)
CLOVER_ARCHITECTURES = ("CloverMoeModelLM",)
# Where a Clover checkpoint's diffusion settings are looked for, in this order, in config.json (top level, then
# text_config, then a `block_diffusion` object) and then generation_config.json (top level, `block_diffusion`):
# the names public dLLM checkpoints use (LLaDA/Dream/SDAR: block_length, mask_token_id, mask_id, block_size).
DIFFUSION_KEYS = {
    "block_size": ("block_size", "block_length"),
    "mask_token_id": ("mask_token_id", "mask_id"),
    "logits_shift": ("logits_shift",),
    "coreset_size": ("coreset_size", "block_coreset_size", "expert_coreset_size"),
}


class ConfigError(ValueError):
    """A checkpoint config that cannot describe a Clover model; the message names the field."""


@dataclass(frozen=True)
class DiffusionConfig:
    block_size: int  # tokens denoised together in one block
    mask_token_id: int  # id of the [MASK] token filling undecided positions
    logits_shift: bool = False  # True: position t is predicted from t-1's hidden state (AR-adapted models)
    prompt_attention: str = "block_causal"  # how prompt tokens attend during prefill: block_causal | causal
    preview_operator: str = "trunk"  # how a denoising step computes the block: trunk | clover (see above)
    coreset_size: int | None = None  # clover: experts in each block's coreset (None: routing unrestricted)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"diffusion.block_size must be >= 1, got {self.block_size}")
        if self.prompt_attention not in PROMPT_ATTENTION:
            raise ConfigError(
                f"diffusion.prompt_attention must be one of {PROMPT_ATTENTION}, got {self.prompt_attention!r}"
            )
        if self.preview_operator not in PREVIEW_OPERATORS:
            raise ConfigError(f"diffusion.preview_operator must be one of {PREVIEW_OPERATORS}, got "
                              f"{self.preview_operator!r}")
        if self.preview_operator == "clover" and self.prompt_attention != "causal":
            raise ConfigError("diffusion.preview_operator 'clover' prefills and commits with the causal trunk: "
                              "prompt_attention must be 'causal'")
        if self.coreset_size is not None and self.preview_operator != "clover":
            raise ConfigError("diffusion.coreset_size applies to the clover preview operator only")

    @property
    def clover(self) -> bool:
        """The public record's preview operator (and its block-diffusion GDN tensors)."""
        return self.preview_operator == "clover"


@dataclass(frozen=True)
class CloverConfig:
    vocab_size: int  # rows of the embedding and of lm_head
    hidden_size: int  # D, the residual width
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (GDN) or "full_attention"
    # gated full attention
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (grouped: query heads share them)
    head_dim: int  # per attention head
    partial_rotary_factor: float  # share of head_dim that RoPE rotates
    rope_theta: float  # RoPE base
    # Gated DeltaNet
    linear_num_key_heads: int  # GDN query/key heads
    linear_num_value_heads: int  # GDN value heads (a multiple of the key heads)
    linear_key_head_dim: int  # Dk
    linear_value_head_dim: int  # Dv
    linear_conv_kernel_dim: int  # depthwise causal conv width over q, k, v
    # mixture of experts
    num_experts: int  # E routed experts per layer
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # I, per routed expert
    shared_expert_intermediate_size: int  # width of the always-on shared expert
    norm_topk_prob: bool  # renormalise the top-k router probabilities to sum to 1
    # misc
    rms_norm_eps: float
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    eos_token_ids: tuple[int, ...]  # generation stops after any of these
    pad_token_id: int | None
    diffusion: DiffusionConfig | None = None  # None: autoregressive model
    window_tokens: int = 131072  # how far back a full-attention layer sees (keys older are dropped)
    prefill_chunk_tokens: int = 8192  # tokens per forward pass during prefill (bounds activation memory)
    name: str = "custom"  # preset name or checkpoint directory, for reports
    # where each value came from ("config.json:text_config.hidden_size", "job: model.block_size", "default")
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    # derived
    num_hidden_layers: int = field(init=False)
    rope_dim: int = field(init=False)  # int(head_dim * partial_rotary_factor), the RoPE frequency denominator
    rotary_dim: int = field(init=False)  # dims actually rotated per head
    linear_key_dim: int = field(init=False)  # Hk * Dk
    linear_value_dim: int = field(init=False)  # Hv * Dv

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "layer_types", tuple(self.layer_types))
        set_(self, "eos_token_ids", tuple(self.eos_token_ids))
        set_(self, "num_hidden_layers", len(self.layer_types))
        # As the reference: frequencies theta^(-i / r) for i in arange(0, r, 2), r = int(head_dim * factor), each
        # rotating a pair of dims (so an odd r rotates r + 1 dims).
        set_(self, "rope_dim", int(self.head_dim * self.partial_rotary_factor))
        set_(self, "rotary_dim", 2 * ((self.rope_dim + 1) // 2))
        set_(self, "linear_key_dim", self.linear_num_key_heads * self.linear_key_head_dim)
        set_(self, "linear_value_dim", self.linear_num_value_heads * self.linear_value_head_dim)
        self._check()

    def _check(self) -> None:
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ConfigError(f"layer_types[{i}] is {kind!r}; known layer types are {LAYER_TYPES}")
        positive = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "window_tokens", "prefill_chunk_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_hidden_layers < 1:
            raise ConfigError("layer_types is empty: the model needs at least one layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                              f"({self.num_experts})")
        if not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(f"head_dim * partial_rotary_factor gives {self.rotary_dim} rotary dims; must be in "
                              f"[1, head_dim={self.head_dim}]")
        for tid in (*self.eos_token_ids, self.pad_token_id):
            if tid is not None and not 0 <= tid < self.vocab_size:
                raise ConfigError(f"special token id {tid} is outside the vocabulary (size {self.vocab_size})")
        if self.diffusion is not None and not 0 <= self.diffusion.mask_token_id < self.vocab_size:
            raise ConfigError(f"diffusion.mask_token_id {self.diffusion.mask_token_id} is outside the vocabulary")
        core = self.diffusion.coreset_size if self.diffusion is not None else None
        if core is not None and not self.num_experts_per_tok <= core <= self.num_experts:
            raise ConfigError(f"diffusion.coreset_size must be in [num_experts_per_tok={self.num_experts_per_tok}, "
                              f"num_experts={self.num_experts}], got {core}")

    @property
    def is_diffusion(self) -> bool:
        return self.diffusion is not None

    def replace(self, **changes: Any) -> CloverConfig:
        return dataclasses.replace(self, **changes)

    # ---- parameter counts -------------------------------------------------------------------------------------
    def parameter_counts(self) -> tuple[int, int]:
        """(total, active per token) parameter counts, embedding and lm_head included."""
        D, E, Ik = self.hidden_size, self.num_experts, self.moe_intermediate_size
        attn = D * self.num_attention_heads * self.head_dim * 2 + 2 * D * self.num_key_value_heads * self.head_dim
        attn += self.num_attention_heads * self.head_dim * D + 2 * self.head_dim
        conv_dim = 2 * self.linear_key_dim + self.linear_value_dim
        gdn = D * conv_dim + D * self.linear_value_dim + 2 * D * self.linear_num_value_heads
        gdn += conv_dim * self.linear_conv_kernel_dim + 2 * self.linear_num_value_heads + self.linear_value_head_dim
        gdn += self.linear_value_dim * D
        if self.diffusion is not None and self.diffusion.clover:  # right conv taps + three per-head vectors
            gdn += conv_dim * (self.linear_conv_kernel_dim - 1) + 3 * self.linear_num_value_heads
        expert = 3 * D * Ik
        shared = 3 * D * self.shared_expert_intermediate_size + D
        router = E * D
        total = active = 0
        for kind in self.layer_types:
            mixer = gdn if kind == "linear_attention" else attn
            total += mixer + router + E * expert + shared + 2 * D
            active += mixer + router + self.num_experts_per_tok * expert + shared + 2 * D
        embed = self.vocab_size * D
        head = 0 if self.tie_word_embeddings else self.vocab_size * D
        return total + embed + head + D, active + embed + head + D

    # ---- serialisation ----------------------------------------------------------------------------------------
    def to_json_dict(self) -> dict[str, Any]:
        """The config.json we write: the Qwen3.5-MoE text config keys plus `diffusion` and `clover`; a model with
        the clover preview operator is written in Clover's layout (model_type clover_moe, block size and mask id
        also flat, under the names Clover's loaders look for)."""
        clover = self.diffusion is not None and self.diffusion.clover
        out: dict[str, Any] = {
            "architectures": [CLOVER_ARCHITECTURES[0] if clover else "Qwen3_5MoeForCausalLM"],
            "model_type": CLOVER_MODEL_TYPES[0] if clover else "qwen3_5_moe_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "hidden_act": "silu",
            "clover": {"window_tokens": self.window_tokens, "prefill_chunk_tokens": self.prefill_chunk_tokens},
        }
        if self.diffusion is not None:
            out["diffusion"] = {k: v for k, v in dataclasses.asdict(self.diffusion).items()
                                if not (k == "coreset_size" and v is None)}
            if clover:
                out["block_size"] = self.diffusion.block_size
                out["mask_token_id"] = self.diffusion.mask_token_id
        return out

    @classmethod
    def from_json_dict(cls, raw: dict[str, Any], *, name: str = "custom",
                       generation: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None
                       ) -> CloverConfig:
        """Parse a config.json object (with the checkpoint's generation_config.json object, and job overrides of
        the diffusion settings, when given)."""
        return _parse_checked(raw, name=name, generation=generation, overrides=overrides)

    @classmethod
    def from_file(cls, path: str | Path, *, overrides: dict[str, Any] | None = None) -> CloverConfig:
        """config.json at `path`, with generation_config.json beside it when there is one."""
        path = Path(path)
        raw = _read_json(path, required=True)
        generation = _read_json(path.parent / GENERATION_CONFIG, required=False)
        try:
            return _parse_checked(raw, name=str(path.parent), generation=generation, overrides=overrides)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


MAX_CONFIG_BYTES = 16 * 2**20  # real config.json files are a few KB
GENERATION_CONFIG = "generation_config.json"


def _read_json(path: Path, *, required: bool) -> Any:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:  # checked before reading: a hostile file can be any size
            raise ConfigError(f"{path}: {path.stat().st_size:,} bytes, over the limit of {MAX_CONFIG_BYTES:,} "
                              f"for a {path.name}")
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: no {path.name} in the checkpoint directory") from None
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not required and not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a JSON object")
    return raw


_REQUIRED_INT = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
                 "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "num_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
_CLOVER_KEYS = {"window_tokens", "prefill_chunk_tokens"}
_DIFFUSION_KEYS = {"block_size", "mask_token_id", "logits_shift", "prompt_attention", "preview_operator",
                   "coreset_size"}
# job overrides of the diffusion settings (ModelSpec in jobs/spec.py): the field names of DiffusionConfig
DIFFUSION_OVERRIDES = ("block_size", "mask_token_id", "logits_shift", "coreset_size")


def _parse_checked(raw: Any, *, name: str, generation: dict[str, Any] | None = None,
                   overrides: dict[str, Any] | None = None) -> CloverConfig:
    try:
        return _parse(raw, name=name, generation=generation, overrides=overrides or {})
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a field of the wrong JSON type somewhere
        raise ConfigError(f"malformed config ({type(exc).__name__}: {exc})") from None


def _typed(value: Any, kind: type, label: str, minimum: int | None = None) -> Any:
    """`value` as `kind` (int, bool or float), or a ConfigError naming the field."""
    ok = (isinstance(value, bool) if kind is bool
          else isinstance(value, int | float) and not isinstance(value, bool) if kind is float
          else isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise ConfigError(f"field {label!r} must be {'a number' if kind is float else f'a {kind.__name__}'}, "
                          f"got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"field {label!r} must be >= {minimum}, got {value!r}")
    return kind(value)


def is_clover_config(raw: dict[str, Any]) -> bool:
    """A config.json of the published Clover checkpoint's kind (model_type or architecture)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    types = {raw.get("model_type"), text.get("model_type")}
    archs = raw.get("architectures") or []
    return bool(types & set(CLOVER_MODEL_TYPES)) or any(a in CLOVER_ARCHITECTURES for a in archs)


def _diffusion_places(raw: dict[str, Any], text: dict[str, Any],
                      generation: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """(label, object) where a Clover checkpoint's diffusion settings are looked for, in order."""
    places: list[tuple[str, dict[str, Any]]] = [("config.json:", raw)]
    if text is not raw:
        places.append(("config.json:text_config.", text))
    for label, obj in (("config.json:block_diffusion.", raw.get("block_diffusion")),
                       ("generation_config.json:", generation),
                       ("generation_config.json:block_diffusion.",
                        (generation or {}).get("block_diffusion") if isinstance(generation, dict) else None)):
        if isinstance(obj, dict):
            places.append((label, obj))
    return places


def _clover_diffusion(raw: dict[str, Any], text: dict[str, Any], generation: dict[str, Any] | None,
                      overrides: dict[str, Any], sources: dict[str, str], vocab: int) -> DiffusionConfig:
    """The diffusion settings of a checkpoint in Clover's layout: checkpoint files, then job overrides."""
    places = _diffusion_places(raw, text, generation)
    found: dict[str, Any] = {}
    for field_name, keys in DIFFUSION_KEYS.items():
        if field_name in overrides and overrides[field_name] is not None:
            found[field_name] = overrides[field_name]
            sources[f"diffusion.{field_name}"] = f"job: model.{field_name}"
            continue
        for label, obj in places:
            key = next((k for k in keys if k in obj and obj[k] is not None), None)
            if key is not None:
                found[field_name] = obj[key]
                sources[f"diffusion.{field_name}"] = f"{label}{key}"
                break
    missing = [f for f in ("block_size", "mask_token_id") if f not in found]
    if missing:
        looked = "; ".join(f"{f}: {' / '.join(DIFFUSION_KEYS[f])}" for f in missing)
        where = ", ".join(label.rstrip(":.") for label, _ in places)
        raise ConfigError(f"a Clover checkpoint (model_type clover_moe) needs its block size and mask token id; "
                          f"not found ({looked}) in {where}. Give them in the job: "
                          + ", ".join(f"model.{f}" for f in missing))
    if "logits_shift" not in found:
        # Clover is adapted from the autoregressive Qwen3.6 trunk, whose causal logits score the next token
        # (llama.cpp's AR perplexity of Clover is normal): a masked position is read from the previous one.
        found["logits_shift"] = True
        sources["diffusion.logits_shift"] = "default for clover_moe (next-token trunk; check: model parity)"
    mask = _typed(found["mask_token_id"], int, "mask_token_id")
    if not 0 <= mask < vocab:
        raise ConfigError(f"mask_token_id {mask} is outside the vocabulary (size {vocab})")
    core = found.get("coreset_size")
    return DiffusionConfig(
        block_size=_typed(found["block_size"], int, "block_size", minimum=1), mask_token_id=mask,
        logits_shift=_typed(found["logits_shift"], bool, "logits_shift"), prompt_attention="causal",
        preview_operator="clover", coreset_size=None if core is None else _typed(core, int, "coreset_size", 1))


def _parse(raw: dict[str, Any], *, name: str, generation: dict[str, Any] | None = None,
           overrides: dict[str, Any] | None = None) -> CloverConfig:
    overrides = overrides or {}
    unknown = set(overrides) - set(DIFFUSION_OVERRIDES)
    if unknown:
        raise ConfigError(f"unknown diffusion override(s) {sorted(unknown)}; known: {list(DIFFUSION_OVERRIDES)}")
    if not isinstance(raw, dict):
        raise ConfigError("config must be a JSON object")
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ConfigError("text_config must be an object")
    where = "config.json:" + ("text_config." if text is not raw else "")
    sources: dict[str, str] = {}

    def need(key: str) -> Any:
        if key not in text:
            raise ConfigError(f"missing required field {key!r}")
        sources[key] = where + key
        return text[key]

    def need_int(key: str) -> int:
        value = need(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"field {key!r} must be an integer, got {value!r}")
        return value

    def optional(key: str, default: Any, obj: dict[str, Any] | None = None, label: str | None = None) -> Any:
        """text[key] (or obj[key]), else the reference implementation's own default, recording which."""
        obj = text if obj is None else obj
        if key in obj:
            sources[key] = (label or where) + key
            return obj[key]
        sources[key] = f"default {default!r} (the reference implementation's)"
        return default

    ints = {key: need_int(key) for key in _REQUIRED_INT}
    hidden_act = text.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
    if text.get("attention_bias", False):
        raise ConfigError("attention_bias=true is not supported")

    if "layer_types" in text:
        layer_types = tuple(need("layer_types"))
        if "num_hidden_layers" in text and text["num_hidden_layers"] != len(layer_types):
            raise ConfigError(f"num_hidden_layers ({text['num_hidden_layers']}) != len(layer_types) "
                              f"({len(layer_types)})")
    else:
        n_layers = need_int("num_hidden_layers")
        # The reference's own rule when layer_types is absent: every `interval`-th layer is full attention.
        interval = _typed(optional("full_attention_interval", 4), int, "full_attention_interval", minimum=1)
        layer_types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                            for i in range(n_layers))
        sources["layer_types"] = f"{where}num_hidden_layers + full_attention_interval"

    rope_key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"  # older configs' name
    rope = text.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"rope_parameters must be an object, got {rope!r}")
    if rope.get("rope_type", "default") not in ("default",):
        raise ConfigError(f"rope_parameters.rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
    if "rope_theta" in rope:
        rope_theta, sources["rope_theta"] = rope["rope_theta"], f"{where}{rope_key}.rope_theta"
    elif "rope_theta" in text:
        rope_theta, sources["rope_theta"] = text["rope_theta"], f"{where}rope_theta"
    else:
        raise ConfigError("missing required field 'rope_theta' (in rope_parameters or at top level)")
    # Reference default when absent (Qwen3.5 configs set 0.25 in __post_init__).
    if "partial_rotary_factor" in rope:
        partial = optional("partial_rotary_factor", 0.25, rope, f"{where}{rope_key}.")
    else:
        partial = optional("partial_rotary_factor", 0.25)

    head_dim = _typed(optional("head_dim", 256), int, "head_dim", minimum=1)  # 256: the reference's default

    if "eos_token_id" in text:
        eos, sources["eos_token_ids"] = text["eos_token_id"], f"{where}eos_token_id"
    elif "eos_token_id" in raw:
        eos, sources["eos_token_ids"] = raw["eos_token_id"], "config.json:eos_token_id"
    else:
        eos, sources["eos_token_ids"] = None, "absent (no end-of-sequence ids)"
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    for tid in eos_ids:
        if not 0 <= _typed(tid, int, "eos_token_id") < ints["vocab_size"]:
            raise ConfigError(f"eos_token_id {tid} is outside the vocabulary (size {ints['vocab_size']})")

    diffusion = None
    if "diffusion" in raw or "diffusion" in text:
        d = raw.get("diffusion", text.get("diffusion"))
        if not isinstance(d, dict):
            raise ConfigError("diffusion must be an object")
        unknown = set(d) - _DIFFUSION_KEYS
        if unknown:
            raise ConfigError(f"unknown field(s) in diffusion: {sorted(unknown)}")
        d = {**d, **{k: v for k, v in overrides.items() if v is not None}}
        for key in ("block_size", "mask_token_id"):
            if key not in d:
                raise ConfigError(f"missing required field 'diffusion.{key}'")
        mask = _typed(d["mask_token_id"], int, "diffusion.mask_token_id")
        if not 0 <= mask < ints["vocab_size"]:
            raise ConfigError(f"diffusion.mask_token_id {mask} is outside the vocabulary (size {ints['vocab_size']})")
        core = d.get("coreset_size")
        diffusion = DiffusionConfig(
            block_size=_typed(d["block_size"], int, "diffusion.block_size", minimum=1),
            mask_token_id=mask,
            logits_shift=_typed(d.get("logits_shift", False), bool, "diffusion.logits_shift"),
            prompt_attention=d.get("prompt_attention", "block_causal"),
            preview_operator=d.get("preview_operator", "trunk"),
            coreset_size=None if core is None else _typed(core, int, "diffusion.coreset_size", minimum=1),
        )
        for key in _DIFFUSION_KEYS:
            sources[f"diffusion.{key}"] = (f"job: model.{key}" if overrides.get(key) is not None
                                           else f"config.json:diffusion.{key}" if key in d else "default")
    elif is_clover_config(raw):
        diffusion = _clover_diffusion(raw, text, generation, overrides, sources, ints["vocab_size"])
    elif any(v is not None for v in overrides.values()):
        raise ConfigError(f"model overrides {sorted(k for k, v in overrides.items() if v is not None)} apply to "
                          "diffusion checkpoints; this config is an autoregressive model (no `diffusion` object, "
                          "model_type not clover_moe)")

    clover = raw.get("clover", text.get("clover", {})) or {}
    unknown = set(clover) - _CLOVER_KEYS
    if unknown:
        raise ConfigError(f"unknown field(s) in clover: {sorted(unknown)}")
    for key in clover:
        sources[key] = f"config.json:clover.{key}"

    config = CloverConfig(
        **{k: v for k, v in ints.items() if k != "num_hidden_layers"},
        layer_types=layer_types,
        head_dim=int(head_dim),
        partial_rotary_factor=float(partial),
        rope_theta=float(rope_theta),
        linear_conv_kernel_dim=int(optional("linear_conv_kernel_dim", 4)),
        norm_topk_prob=bool(optional("norm_topk_prob", True)),
        rms_norm_eps=float(optional("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        eos_token_ids=eos_ids,
        pad_token_id=optional("pad_token_id", None),
        diffusion=diffusion,
        name=name,
        **{k: _typed(v, int, f"clover.{k}", minimum=1) for k, v in clover.items()},
    )
    sources["tie_word_embeddings"] = (f"{where}tie_word_embeddings" if "tie_word_embeddings" in text
                                      else "config.json:tie_word_embeddings" if "tie_word_embeddings" in raw
                                      else "default False (the reference implementation's)")
    for key in _CLOVER_KEYS - set(clover):
        sources[key] = "default (clover-batch)"
    object.__setattr__(config, "sources", sources)
    return config


# ---- the vendor's decode controls ------------------------------------------------------------------------------
# DecodeOptions field -> keys looked for, in generation_config.json (top level, then `block_diffusion`) and then
# config.json (`block_diffusion`, top level). Sampling settings (temperature, top_p) are deliberately not taken:
# Clover's LowConfidence decoder picks greedily (the public record, S4), and a batch job is reproducible by default.
VENDOR_DECODE_KEYS = {
    "threshold": ("threshold", "confidence_threshold", "denoising_threshold"),
    "presence_penalty": ("presence_penalty",),
    "frequency_penalty": ("frequency_penalty",),
    "repetition_penalty": ("repetition_penalty",),
    "stop_token_ids": ("stop_token_ids", "eos_token_id"),
}


def vendor_decode_defaults(path: str | Path) -> dict[str, tuple[Any, str]]:
    """The decode controls a checkpoint folder ships (generation_config.json, config.json): DecodeOptions field ->
    (value, "file:key"). Values are returned as found; DecodeOptions checks them (the caller names the source)."""
    path = Path(path)
    generation = _read_json(path / GENERATION_CONFIG, required=False)
    config = _read_json(path / "config.json", required=False)
    places: list[tuple[str, dict[str, Any]]] = []
    for label, obj in (("generation_config.json:", generation), ("config.json:", config)):
        if not isinstance(obj, dict):
            continue
        block = obj.get("block_diffusion")
        ordered = [(label, obj), (f"{label}block_diffusion.", block)] if label.startswith("generation") else \
            [(f"{label}block_diffusion.", block)]  # config.json's top level holds the model's eos, not stop ids
        places += [(lab, o) for lab, o in ordered if isinstance(o, dict)]
    found: dict[str, tuple[Any, str]] = {}
    for option, keys in VENDOR_DECODE_KEYS.items():
        for label, obj in places:
            key = next((k for k in keys if obj.get(k) is not None), None)
            if key is not None:
                value = obj[key]
                if option == "stop_token_ids" and not isinstance(value, list):
                    value = [value]
                found[option] = (value, f"{label}{key}")
                break
    return found


# ---- presets ------------------------------------------------------------------------------------------------
# Special token ids shared by presets and the byte-level tokenizer that `model init` writes:
# 0..255 bytes, 256 <|endoftext|>, 257 <|im_start|>, 258 <|im_end|>, 259 <|mask|>.
EOT_ID, IM_START_ID, IM_END_ID, MASK_ID = 256, 257, 258, 259


def _pattern(n_layers: int, interval: int = 4) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers))


def _preset(name: str, *, diffusion: bool | str, **shape: Any) -> CloverConfig:
    """diffusion: False (autoregressive), True (our block-diffusion layout) or "clover" (Clover's layout)."""
    block = shape.pop("block_size", 32)
    base: dict[str, Any] = dict(
        partial_rotary_factor=0.25, rope_theta=10_000_000.0, linear_conv_kernel_dim=4, norm_topk_prob=True,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_ids=(EOT_ID, IM_END_ID), pad_token_id=EOT_ID,
    )
    base.update(shape)
    mask = base.pop("mask_token_id", MASK_ID)
    diff = (None if not diffusion
            else clover_diffusion(block, mask) if diffusion == "clover" else DiffusionConfig(block, mask))
    return CloverConfig(diffusion=diff, name=name, **base)


def clover_diffusion(block_size: int, mask_token_id: int, coreset_size: int | None = None) -> DiffusionConfig:
    """Clover's layout: causal prefill and commits, the preview operator, next-token (shifted) logits."""
    return DiffusionConfig(block_size=block_size, mask_token_id=mask_token_id, logits_shift=True,
                           prompt_attention="causal", preview_operator="clover", coreset_size=coreset_size)


def _tiny(name: str, diffusion: bool | str) -> CloverConfig:
    return _preset(
        name, diffusion=diffusion, vocab_size=512, hidden_size=64, layer_types=_pattern(4), num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, block_size=8, window_tokens=256, prefill_chunk_tokens=128,
    )


def _bench(name: str, diffusion: bool | str) -> CloverConfig:
    return _preset(
        name, diffusion=diffusion, vocab_size=8192, hidden_size=512, layer_types=_pattern(8), num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128,
        shared_expert_intermediate_size=256, block_size=32, window_tokens=32768, prefill_chunk_tokens=2048,
    )


def _clover_35b(name: str, diffusion: bool | str) -> CloverConfig:
    # the published shape (the public record, section 1.2); the mask id is a placeholder: Clover's own is read
    # from its checkpoint files
    return _preset(
        name, diffusion=diffusion, vocab_size=248320, hidden_size=2048, layer_types=_pattern(40),
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512, block_size=32,
        eos_token_ids=(248044, 248046), pad_token_id=248044, window_tokens=131072, prefill_chunk_tokens=8192,
        mask_token_id=248077,
    )


PRESETS = {
    "tiny": lambda: _tiny("tiny", True),
    "tiny-ar": lambda: _tiny("tiny-ar", False),
    "tiny-clover": lambda: _tiny("tiny-clover", "clover"),
    "bench": lambda: _bench("bench", True),
    "bench-ar": lambda: _bench("bench-ar", False),
    "bench-clover": lambda: _bench("bench-clover", "clover"),
    "clover-35b-a3b": lambda: _clover_35b("clover-35b-a3b", "clover"),
    "qwen3.5-35b-a3b": lambda: _clover_35b("qwen3.5-35b-a3b", False),
}


def is_preset(name: str) -> bool:
    return str(name) in PRESETS


def from_preset(name: str) -> CloverConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}") from None

