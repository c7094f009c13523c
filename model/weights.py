"""Checkpoints: safetensors only, memory-mapped, one declarative key-mapping table.

Notable choices:
- The model is built on the meta device and tensors are attached with `load_state_dict(assign=True)`: no second
  copy of the weights, and an expert-parallel rank reads only its own experts (slices of a packed tensor or the
  per-expert tensors in its range), never the whole layer.
- Every problem (missing, unexpected, wrongly shaped tensors) is collected first and raised as one
  `CheckpointError` naming them all.
- Presets are initialised from a seeded generator on the CPU in fp32, so `tiny` is the same model everywhere.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .clover import CloverModel
from .config import CloverConfig
from .moe import Experts


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit the config; the message names every offending tensor."""


# Checkpoint key (after the prefix) -> our parameter name and, for per-expert tensors, where it lands in the stack.
IGNORED = (re.compile(r"^mtp\."), re.compile(r"^(model\.)?visual\."))
PREFIXES = ("model.language_model.", "model.")
PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# per-expert part -> (stacked parameter, which half of the gate_up rows or None)
PER_EXPERT_TARGET = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}


@dataclass(frozen=True)
class Source:
    file: Path
    key: str
    expert: int | None = None  # per-expert tensors: the global expert index
    half: int | None = None  # gate (0) or up (1) rows of gate_up_proj


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
        files = sorted({path / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (only safetensors checkpoints are read)")
    return files


def _our_name(key: str) -> str | None:
    if any(p.match(key) for p in IGNORED):
        return None
    for prefix in PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key  # lm_head.weight and unprefixed keys


def index_checkpoint(path: Path) -> dict[str, list[Source]]:
    """Our parameter name -> the checkpoint tensors that make it up."""
    sources: dict[str, list[Source]] = {}
    for file in _checkpoint_files(path):
        with _open_shard(file) as f:
            for key in f.keys():
                name = _our_name(key)
                if name is None:
                    continue
                m = PER_EXPERT.match(name)
                if m:
                    target, half = PER_EXPERT_TARGET[m.group(3)]
                    sources.setdefault(f"{m.group(1)}.{target}", []).append(
                        Source(file, key, expert=int(m.group(2)), half=half))
                else:
                    sources.setdefault(name, []).append(Source(file, key))
    return sources


def _open_shard(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises its own error type for a bad header; OSError for I/O
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


class _Reader:
    """Keeps each shard open once while tensors are pulled from it."""

    def __init__(self) -> None:
        self._open: dict[Path, object] = {}

    def handle(self, file: Path):
        if file not in self._open:
            self._open[file] = _open_shard(file)
        return self._open[file]


def _assemble(name: str, srcs: list[Source], expected: torch.Size, experts: Experts | None, reader: _Reader,
              problems: list[str], num_experts: int) -> torch.Tensor | None:
    """Read one parameter; for expert stacks only the experts this model holds."""
    if experts is not None:
        extra = sorted(s.key for s in srcs if s.expert is not None and s.expert >= num_experts)
        if extra:
            problems.append(f"unexpected {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}: expert index "
                            f"beyond the config's num_experts={num_experts}")
            return None
    if experts is None or srcs[0].expert is None:  # a plain tensor, or experts stored packed
        if len(srcs) > 1:
            kinds = {s.expert is None for s in srcs}
            what = "given both packed and per expert" if len(kinds) > 1 else "given more than once"
            problems.append(f"{name}: {what} ({', '.join(f'{s.file.name}:{s.key}' for s in srcs[:4])})")
            return None
        f = reader.handle(srcs[0].file)
        sl = f.get_slice(srcs[0].key)
        shape = list(sl.get_shape())
        if experts is not None:  # packed [E_total, ...]: take our contiguous range
            full = [experts.num_local if i == 0 else s for i, s in enumerate(expected)]
            if len(shape) != len(full) or shape[1:] != full[1:] or shape[0] != num_experts:
                tail = ", ".join(map(str, full[1:]))
                problems.append(f"{srcs[0].key}: shape {shape}, expected [{num_experts}, {tail}]")
                return None
            return sl[experts.first_expert: experts.first_expert + experts.num_local]
        if shape != list(expected):
            problems.append(f"{srcs[0].key}: shape {shape}, expected {list(expected)}")
            return None
        return f.get_tensor(srcs[0].key)
    lo, n = experts.first_expert, experts.num_local
    parts: dict[tuple[int, int | None], Source] = {(s.expert, s.half): s for s in srcs if s.expert is not None}
    rows = []
    for e in range(lo, lo + n):
        halves = [0, 1] if name.endswith("gate_up_proj") else [None]
        pieces = []
        for half in halves:
            src = parts.get((e, half))
            if src is None:
                part = {0: "gate_proj", 1: "up_proj", None: "down_proj"}[half]
                problems.append(f"missing {name.rsplit('.', 1)[0]}.{e}.{part}.weight")
                continue
            t = reader.handle(src.file).get_tensor(src.key)
            want = [expected[1] // len(halves), expected[2]]
            if list(t.shape) != want:
                problems.append(f"{src.key}: shape {list(t.shape)}, expected {want}")
                continue
            pieces.append(t)
        if len(pieces) == len(halves):
            rows.append(torch.cat(pieces, dim=0))
    return torch.stack(rows) if len(rows) == n else None


def _expert_modules(model: CloverModel) -> dict[str, Experts]:
    return {f"{name}.": m for name, m in model.named_modules() if isinstance(m, Experts)}


def load_checkpoint_weights(model: CloverModel, path: Path, *, dtype: torch.dtype, device: torch.device) -> None:
    """Attach the checkpoint's tensors to a model built on the meta device (raises CheckpointError)."""
    sources = index_checkpoint(path)
    experts_by_prefix = _expert_modules(model)
    expected = {name: p.shape for name, p in model.named_parameters()}
    problems: list[str] = []
    state: dict[str, torch.Tensor] = {}
    reader = _Reader()
    for name, shape in expected.items():
        srcs = sources.get(name)
        if not srcs:
            problems.append(f"missing {name}")
            continue
        owner = next((m for prefix, m in experts_by_prefix.items() if name.startswith(prefix)), None)
        tensor = _assemble(name, srcs, shape, owner, reader, problems, model.config.num_experts)
        if tensor is not None:
            state[name] = tensor.to(device=device, dtype=dtype)
    unexpected = sorted(set(sources) - set(expected))
    if model.lm_head is None and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # tied checkpoints may still carry a copy
    problems += [f"unexpected {name} (no such parameter in this config)" for name in unexpected]
    if problems:
        shown = "\n  ".join(problems[:40]) + (f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else "")
        raise CheckpointError(f"checkpoint {path} does not match its config:\n  {shown}")
    model.load_state_dict(state, strict=True, assign=True)


def init_random_weights(model: CloverModel, *, seed: int, dtype: torch.dtype, device: torch.device) -> None:
    """Seeded initialisation like the reference's: normal(0, 0.02) matrices, zero-centred norms at 0, A in [1, 16].

    Each tensor (and each expert of a stack) draws from its own generator seeded by (seed, name, expert), so a
    rank holding experts [a, b) gets exactly the slices of the full model's stacks.
    """
    experts_by_prefix = _expert_modules(model)

    def draw(name: str, shape: torch.Size) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("linear_attn.norm.weight") or leaf == "dt_bias":
            return torch.ones(shape)
        if name.endswith("norm.weight"):
            return torch.zeros(shape)
        if leaf == "A_log":
            return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        return torch.empty(shape).normal_(0.0, 0.02, generator=gen)

    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        owner = next((m for prefix, m in experts_by_prefix.items() if name.startswith(prefix)), None)
        if owner is None:
            t = draw(name, p.shape)
        else:
            t = torch.stack([draw(f"{name}.{e}", p.shape[1:])
                             for e in range(owner.first_expert, owner.first_expert + owner.num_local)])
        state[name] = t.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)


def checkpoint_tensors(model: CloverModel, *, per_expert: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Our parameters under the names Qwen3.5-MoE checkpoints use (experts packed or per expert)."""
    for name, p in model.named_parameters():
        t = p.detach().contiguous()
        key = name if name == "lm_head.weight" else f"model.{name}"
        m = re.match(r"^(.*\.experts)\.(gate_up_proj|down_proj)$", key)
        if per_expert and m:
            first = next(mod for n, mod in model.named_modules() if f"model.{n}" == m.group(1)).first_expert
            for i in range(t.shape[0]):
                if m.group(2) == "gate_up_proj":
                    gate, up = t[i].chunk(2, dim=0)
                    yield f"{m.group(1)}.{first + i}.gate_proj.weight", gate.contiguous()
                    yield f"{m.group(1)}.{first + i}.up_proj.weight", up.contiguous()
                else:
                    yield f"{m.group(1)}.{first + i}.down_proj.weight", t[i].contiguous()
        else:
            yield key, t


def save_checkpoint(model: CloverModel, out_dir: str | Path, *, per_expert: bool = False) -> Path:
    """Write config.json and model.safetensors; `load_model(out_dir)` reads them back bit-exactly."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_json_dict()
    config["dtype"] = str(model.dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(dict(checkpoint_tensors(model, per_expert=per_expert)), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def read_config(path: Path) -> CloverConfig:
    return CloverConfig.from_file(path / "config.json")
