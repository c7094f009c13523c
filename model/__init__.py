"""clover_batch.model: the Clover model and its generation engine. Token ids in, token ids and logits out.

Knows nothing of Ray, files beyond checkpoints, or text.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from . import kernels
from .clover import CloverModel
from .config import (
    DIFFUSION_OVERRIDES,
    CloverConfig,
    ConfigError,
    DiffusionConfig,
    from_preset,
    is_preset,
    vendor_decode_defaults,
)
from .engine import Engine, EngineCapacityError, EngineStats, Generation, Request
from .generate import generate
from .moe import Experts
from .options import DecodeOptions
from .state import AttentionState, CloverState, GDNState
from .weights import (
    CheckpointError,
    check_memory,
    init_random_weights,
    load_checkpoint_weights,
    read_config,
    save_checkpoint,
)

__all__ = [
    "AttentionState",
    "CheckpointError",
    "CloverConfig",
    "CloverModel",
    "CloverState",
    "ConfigError",
    "DecodeOptions",
    "DiffusionConfig",
    "Engine",
    "EngineCapacityError",
    "EngineStats",
    "GDNState",
    "Generation",
    "Request",
    "build_model",
    "from_preset",
    "generate",
    "is_preset",
    "kernels",
    "load_config",
    "load_model",
    "save_checkpoint",
    "vendor_decode_defaults",
]

# Random initialisation of presets is for small models; the published shape is for `inspect` and checkpoints.
MAX_RANDOM_INIT_PARAMS = 2_000_000_000


def load_config(source: str | Path, overrides: dict | None = None) -> CloverConfig:
    """The config of a preset name or of a checkpoint directory.

    overrides: config fields to replace (e.g. {"window_tokens": 32768}) and diffusion settings a checkpoint may lack
    or get wrong (DIFFUSION_OVERRIDES: block_size, mask_token_id, logits_shift, coreset_size; None values ignored).
    """
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    diffusion = {k: overrides.pop(k) for k in DIFFUSION_OVERRIDES if k in overrides}
    if isinstance(source, str) and is_preset(source):
        config = from_preset(source)
        if diffusion:
            if config.diffusion is None:
                raise ConfigError(f"model overrides {sorted(diffusion)} apply to diffusion models; preset {source!r} "
                                  f"is autoregressive")
            config = config.replace(diffusion=dataclasses.replace(config.diffusion, **diffusion))
    else:
        path = Path(source)
        if not path.is_dir():
            raise ConfigError(f"model source {str(source)!r} is neither a preset nor a checkpoint directory")
        config = read_config(path, diffusion)
    if overrides:
        allowed = {f.name for f in dataclasses.fields(CloverConfig) if f.init} - {"sources", "diffusion"}
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise ConfigError(f"unknown config override(s) {unknown}; overridable fields: "
                              f"{sorted(allowed | set(DIFFUSION_OVERRIDES))}")
        config = config.replace(**overrides)
    return config


def build_model(config: CloverConfig, *, expert_range: tuple[int, int] | None = None) -> CloverModel:
    """The model on the meta device; with `expert_range` = (first, end) each layer holds only those experts."""
    with torch.device("meta"):
        model = CloverModel(config)
        if expert_range is not None:
            first, end = expert_range
            if not 0 <= first < end <= config.num_experts:
                raise ValueError(f"expert_range {expert_range} is not within [0, {config.num_experts}]")
            for layer in model.layers:
                layer.mlp.experts = Experts(config, first_expert=first, num_local=end - first)
    return model


def load_model(source: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0, expert_range: tuple[int, int] | None = None,
               overrides: dict | None = None) -> CloverModel:
    """A ready model from a preset name (seeded random weights) or a checkpoint directory (safetensors).

    expert_range: hold only experts [first, end) (expert parallelism). overrides: as `load_config`'s.
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    device = torch.device(device)
    config = load_config(source, overrides)
    preset = isinstance(source, str) and is_preset(source)
    if preset and config.parameter_counts()[0] > MAX_RANDOM_INIT_PARAMS:
        raise ConfigError(f"preset {source!r} has {config.parameter_counts()[0] / 1e9:.1f}B parameters: random "
                          f"weights are only made for small presets; point the model at a checkpoint directory "
                          f"instead")
    check_memory(config, dtype=dtype, device=device, source=str(source), expert_range=expert_range)
    model = build_model(config, expert_range=expert_range)
    if preset:
        init_random_weights(model, seed=seed, dtype=dtype, device=device)
    else:
        load_checkpoint_weights(model, Path(source), dtype=dtype, device=device)
    return model.eval()
