"""Model configuration: one flat frozen dataclass, read from a checkpoint's config.json or built from a preset.

Notable choices:
- The Qwen3.5-MoE text config is read flat or nested under `text_config`; rope settings are read from
  `rope_parameters` (transformers 5) or flat (`rope_theta`, `partial_rotary_factor`, older files).
- Required fields missing from the file are errors naming the field. The only defaults are the ones the reference
  implementation itself applies when a file leaves a field out (`norm_topk_prob` true, conv kernel 4, layer pattern
  from `full_attention_interval`), each written out below, never `getattr(..., default)`.
- A `diffusion` object makes the checkpoint a block-diffusion model; without one the model is autoregressive.
  Our own extra keys live under `clover`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_TYPES = ("linear_attention", "full_attention")
PROMPT_ATTENTION = ("block_causal", "causal")


class ConfigError(ValueError):
    """A checkpoint config that cannot describe a Clover model; the message names the field."""


@dataclass(frozen=True)
class DiffusionConfig:
    block_size: int  # tokens denoised together in one block
    mask_token_id: int  # id of the [MASK] token filling undecided positions
    logits_shift: bool = False  # True: position t is predicted from t-1's hidden state (AR-adapted models)
    prompt_attention: str = "block_causal"  # how prompt tokens attend during prefill: block_causal | causal

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"diffusion.block_size must be >= 1, got {self.block_size}")
        if self.prompt_attention not in PROMPT_ATTENTION:
            raise ConfigError(
                f"diffusion.prompt_attention must be one of {PROMPT_ATTENTION}, got {self.prompt_attention!r}"
            )


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
        """The config.json we write: the Qwen3.5-MoE text config keys plus `diffusion` and `clover`."""
        out: dict[str, Any] = {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
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
            out["diffusion"] = dataclasses.asdict(self.diffusion)
        return out

    @classmethod
    def from_json_dict(cls, raw: dict[str, Any], *, name: str = "custom") -> CloverConfig:
        return _parse_checked(raw, name=name)

    @classmethod
    def from_file(cls, path: str | Path) -> CloverConfig:
        path = Path(path)
        try:
            if path.stat().st_size > MAX_CONFIG_BYTES:  # checked before reading: a hostile file can be any size
                raise ConfigError(f"{path}: {path.stat().st_size:,} bytes, over the limit of {MAX_CONFIG_BYTES:,} "
                                  "for a config.json")
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json in the checkpoint directory") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        try:
            return _parse_checked(raw, name=str(path.parent))
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


MAX_CONFIG_BYTES = 16 * 2**20  # real config.json files are a few KB

_REQUIRED_INT = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
                 "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "num_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
_CLOVER_KEYS = {"window_tokens", "prefill_chunk_tokens"}
_DIFFUSION_KEYS = {"block_size", "mask_token_id", "logits_shift", "prompt_attention"}


def _parse_checked(raw: Any, *, name: str) -> CloverConfig:
    try:
        return _parse(raw, name=name)
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


def _parse(raw: dict[str, Any], *, name: str) -> CloverConfig:
    if not isinstance(raw, dict):
        raise ConfigError("config must be a JSON object")
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ConfigError("text_config must be an object")

    def need(key: str) -> Any:
        if key not in text:
            raise ConfigError(f"missing required field {key!r}")
        return text[key]

    def need_int(key: str) -> int:
        value = need(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"field {key!r} must be an integer, got {value!r}")
        return value

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
        interval = _typed(text.get("full_attention_interval", 4), int, "full_attention_interval", minimum=1)
        layer_types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                            for i in range(n_layers))

    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}  # rope_scaling: older configs' name
    if not isinstance(rope, dict):
        raise ConfigError(f"rope_parameters must be an object, got {rope!r}")
    if rope.get("rope_type", "default") not in ("default",):
        raise ConfigError(f"rope_parameters.rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
    rope_theta = rope.get("rope_theta", text.get("rope_theta"))
    if rope_theta is None:
        raise ConfigError("missing required field 'rope_theta' (in rope_parameters or at top level)")
    # Reference default when absent (Qwen3.5 configs set 0.25 in __post_init__).
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))

    head_dim = _typed(text.get("head_dim", 256), int, "head_dim", minimum=1)  # 256: the reference's default

    eos = text.get("eos_token_id", raw.get("eos_token_id"))
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
        for key in ("block_size", "mask_token_id"):
            if key not in d:
                raise ConfigError(f"missing required field 'diffusion.{key}'")
        mask = _typed(d["mask_token_id"], int, "diffusion.mask_token_id")
        if not 0 <= mask < ints["vocab_size"]:
            raise ConfigError(f"diffusion.mask_token_id {mask} is outside the vocabulary (size {ints['vocab_size']})")
        diffusion = DiffusionConfig(
            block_size=_typed(d["block_size"], int, "diffusion.block_size", minimum=1),
            mask_token_id=mask,
            logits_shift=_typed(d.get("logits_shift", False), bool, "diffusion.logits_shift"),
            prompt_attention=d.get("prompt_attention", "block_causal"),
        )

    clover = raw.get("clover", text.get("clover", {})) or {}
    unknown = set(clover) - _CLOVER_KEYS
    if unknown:
        raise ConfigError(f"unknown field(s) in clover: {sorted(unknown)}")

    return CloverConfig(
        **{k: v for k, v in ints.items() if k != "num_hidden_layers"},
        layer_types=layer_types,
        head_dim=int(head_dim),
        partial_rotary_factor=float(partial),
        rope_theta=float(rope_theta),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        eos_token_ids=eos_ids,
        pad_token_id=text.get("pad_token_id"),
        diffusion=diffusion,
        name=name,
        **{k: _typed(v, int, f"clover.{k}", minimum=1) for k, v in clover.items()},
    )


# ---- presets ------------------------------------------------------------------------------------------------
# Special token ids shared by presets and the byte-level tokenizer that `model init` writes:
# 0..255 bytes, 256 <|endoftext|>, 257 <|im_start|>, 258 <|im_end|>, 259 <|mask|>.
EOT_ID, IM_START_ID, IM_END_ID, MASK_ID = 256, 257, 258, 259


def _pattern(n_layers: int, interval: int = 4) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers))


def _preset(name: str, *, diffusion: bool, **shape: Any) -> CloverConfig:
    block = shape.pop("block_size", 32)
    base: dict[str, Any] = dict(
        partial_rotary_factor=0.25, rope_theta=10_000_000.0, linear_conv_kernel_dim=4, norm_topk_prob=True,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_ids=(EOT_ID, IM_END_ID), pad_token_id=EOT_ID,
    )
    base.update(shape)
    diff = DiffusionConfig(block_size=block, mask_token_id=MASK_ID) if diffusion else None
    return CloverConfig(diffusion=diff, name=name, **base)


def _tiny(name: str, diffusion: bool) -> CloverConfig:
    return _preset(
        name, diffusion=diffusion, vocab_size=512, hidden_size=64, layer_types=_pattern(4), num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, block_size=8, window_tokens=256, prefill_chunk_tokens=128,
    )


def _bench(name: str, diffusion: bool) -> CloverConfig:
    return _preset(
        name, diffusion=diffusion, vocab_size=8192, hidden_size=512, layer_types=_pattern(8), num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128,
        shared_expert_intermediate_size=256, block_size=32, window_tokens=32768, prefill_chunk_tokens=2048,
    )


def _clover_35b(name: str, diffusion: bool) -> CloverConfig:
    return _preset(
        name, diffusion=diffusion, vocab_size=248320, hidden_size=2048, layer_types=_pattern(40),
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512, block_size=32,
        eos_token_ids=(248044, 248046), pad_token_id=248044, window_tokens=131072, prefill_chunk_tokens=8192,
    ).replace(diffusion=DiffusionConfig(block_size=32, mask_token_id=248077) if diffusion else None)


PRESETS = {
    "tiny": lambda: _tiny("tiny", True),
    "tiny-ar": lambda: _tiny("tiny-ar", False),
    "bench": lambda: _bench("bench", True),
    "bench-ar": lambda: _bench("bench-ar", False),
    "clover-35b-a3b": lambda: _clover_35b("clover-35b-a3b", True),
    "qwen3.5-35b-a3b": lambda: _clover_35b("qwen3.5-35b-a3b", False),
}


def is_preset(name: str) -> bool:
    return str(name) in PRESETS


def from_preset(name: str) -> CloverConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}") from None

