"""Checkpoints: safetensors only, memory-mapped, one declarative key-mapping table.

Notable choices:
- The model is built on the meta device and tensors are attached with `load_state_dict(assign=True)`: no second
  copy of the weights, and an expert-parallel rank reads only its own experts (slices of a packed tensor or the
  per-expert tensors in its range), never the whole layer.
- Every problem (missing, unexpected, wrongly shaped tensors) is collected first and raised as one
  `CheckpointError` naming them all.
- Presets are initialised from a seeded generator on the CPU in fp32, so `tiny` is the same model everywhere.

Why one file of about 440 lines: the one key-mapping table, the loader that reads through it (sharded, memory-
mapped, per rank), and the writer that must produce what it reads, side by side.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .clover import CloverModel
from .config import CloverConfig, ConfigError
from .moe import Experts


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit the config; the message names every offending tensor."""


# Checkpoint key (after the prefix) -> our parameter name and, for per-expert tensors, where it lands in the stack.
IGNORED = (re.compile(r"^mtp\."), re.compile(r"^(model\.)?visual\."))
PREFIXES = ("model.language_model.", "model.")
PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# per-expert part -> (stacked parameter, which half of the gate_up rows or None)
PER_EXPERT_TARGET = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}
# Clover's block-diffusion GDN tensors (bare parameters of linear_attn): their shapes are not public. Each has the
# layout our operator reads, plus the other storage it may plausibly have that holds the same values.
BLOCK_DIFFUSION = re.compile(r"\.linear_attn\.(conv_right_weight|bd_softmax_logit_scale|bd_softmax_history_bias|"
                             r"bd_softmax_history_c)$")
# conv_right_weight [C, R] (cortiq binds it so); stored like conv1d.weight it would be [C, 1, R]
ALSO_ACCEPTED = {"conv_right_weight": lambda shape: [shape[0], 1, *shape[1:]]}


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


@dataclass(frozen=True)
class Inventory:
    """What a checkpoint folder holds, from the safetensors headers (for `model inspect`)."""

    files: int
    tensors: int
    prefixes: tuple[str, ...]  # name prefixes found ("model.language_model.", "model.")
    skipped: dict[str, int]  # ignored families ("mtp.*", "model.visual.*") -> tensors skipped
    experts: str  # "packed", "per expert" or "none"
    block_diffusion: dict[str, int]  # Clover's block-diffusion GDN families -> layers holding them


def checkpoint_inventory(path: Path) -> Inventory:
    files = _checkpoint_files(path)
    skipped: dict[str, int] = {}
    prefixes: set[str] = set()
    families: dict[str, int] = {}
    tensors, packed, per_expert = 0, False, False
    for file in files:
        with _open_shard(file) as f:
            for key in f.keys():
                tensors += 1
                rule = next((p for p in IGNORED if p.match(key)), None)
                if rule is not None:
                    label = "mtp.*" if "mtp" in rule.pattern else "model.visual.*"
                    skipped[label] = skipped.get(label, 0) + 1
                    continue
                prefix = next((p for p in PREFIXES if key.startswith(p)), None)
                if prefix:
                    prefixes.add(prefix)
                name = _our_name(key) or key
                packed |= name.endswith((".experts.gate_up_proj", ".experts.down_proj"))
                per_expert |= bool(PER_EXPERT.match(name))
                family = BLOCK_DIFFUSION.search(name)
                if family:
                    families[family.group(1)] = families.get(family.group(1), 0) + 1
    experts = "packed and per expert" if packed and per_expert else "packed" if packed else \
        "per expert" if per_expert else "none"
    return Inventory(len(files), tensors, tuple(sorted(prefixes)), skipped, experts, families)


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


def _plan(name: str, srcs: list[Source], expected: torch.Size, experts: Experts | None, reader: _Reader,
          problems: list[str], num_experts: int) -> Callable[[], torch.Tensor] | None:
    """Check one parameter's checkpoint tensors from the safetensors headers alone (no tensor data is read) and
    return how to read it; for expert stacks only the experts this model holds. None when it does not fit."""
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
        src = srcs[0]
        shape = list(reader.handle(src.file).get_slice(src.key).get_shape())
        if experts is not None:  # packed [E_total, ...]: take our contiguous range
            full = [experts.num_local if i == 0 else s for i, s in enumerate(expected)]
            if len(shape) != len(full) or shape[1:] != full[1:] or shape[0] != num_experts:
                tail = ", ".join(map(str, full[1:]))
                problems.append(f"{src.key}: shape {shape}, expected [{num_experts}, {tail}]")
                return None
            lo, n = experts.first_expert, experts.num_local
            return lambda: reader.handle(src.file).get_slice(src.key)[lo: lo + n]
        if shape != list(expected):
            family = BLOCK_DIFFUSION.search(name)
            also = ALSO_ACCEPTED.get(family.group(1)) if family else None
            if also is not None and shape == also(list(expected)):
                return lambda: reader.handle(src.file).get_tensor(src.key).reshape(expected)
            hint = ("; the preview operator reads these per value head as the public record's reading has them: "
                    "a different shape means its formula must come from the authors' code (clover-batch model "
                    "parity)") if family else ""
            problems.append(f"{src.key}: shape {shape}, expected {list(expected)}{hint}")
            return None
        return lambda: reader.handle(src.file).get_tensor(src.key)
    lo, n = experts.first_expert, experts.num_local
    parts: dict[tuple[int, int | None], Source] = {(s.expert, s.half): s for s in srcs if s.expert is not None}
    halves = [0, 1] if name.endswith("gate_up_proj") else [None]
    want = [expected[1] // len(halves), expected[2]]
    ok = True
    for e in range(lo, lo + n):
        for half in halves:
            src = parts.get((e, half))
            if src is None:
                part = {0: "gate_proj", 1: "up_proj", None: "down_proj"}[half]
                problems.append(f"missing {name.rsplit('.', 1)[0]}.{e}.{part}.weight")
                ok = False
                continue
            shape = list(reader.handle(src.file).get_slice(src.key).get_shape())
            if shape != want:
                problems.append(f"{src.key}: shape {shape}, expected {want}")
                ok = False
    if not ok:
        return None

    def read() -> torch.Tensor:
        rows = [torch.cat([reader.handle(parts[(e, h)].file).get_tensor(parts[(e, h)].key) for h in halves], dim=0)
                for e in range(lo, lo + n)]
        return torch.stack(rows)

    return read


def _expert_modules(model: CloverModel) -> dict[str, Experts]:
    return {f"{name}.": m for name, m in model.named_modules() if isinstance(m, Experts)}


def _plan_checkpoint(model: CloverModel, path: Path) -> tuple[dict[str, Callable[[], torch.Tensor]], _Reader]:
    """How to read each parameter of `model` from the checkpoint, after checking every shape from the safetensors
    headers (raises CheckpointError naming every problem; no tensor data is read)."""
    sources = index_checkpoint(path)
    experts_by_prefix = _expert_modules(model)
    expected = {name: p.shape for name, p in model.named_parameters()}
    problems: list[str] = []
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    reader = _Reader()
    for name, shape in expected.items():
        srcs = sources.get(name)
        if not srcs:
            problems.append(f"missing {name}")
            continue
        owner = next((m for prefix, m in experts_by_prefix.items() if name.startswith(prefix)), None)
        read = _plan(name, srcs, shape, owner, reader, problems, model.config.num_experts)
        if read is not None:
            readers[name] = read
    unexpected = sorted(set(sources) - set(expected))
    if model.lm_head is None and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # tied checkpoints may still carry a copy
    problems += [f"unexpected {name} (no such parameter in this config)" for name in unexpected]
    if problems:
        shown = "\n  ".join(problems[:40]) + (f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else "")
        raise CheckpointError(f"checkpoint {path} does not match its config:\n  {shown}")
    return readers, reader


def check_checkpoint(model: CloverModel, path: Path) -> None:
    """Raise CheckpointError unless the checkpoint's tensors fit `model` (built on the meta device): the driver's
    check before a run, from the headers only."""
    _plan_checkpoint(model, path)


def load_checkpoint_weights(model: CloverModel, path: Path, *, dtype: torch.dtype, device: torch.device) -> None:
    """Attach the checkpoint's tensors to a model built on the meta device (raises CheckpointError).

    Every shape is checked from the headers first: a config that does not match its checkpoint fails before a
    single tensor is read, copied or converted."""
    readers, _ = _plan_checkpoint(model, path)  # each reader holds the open shard it reads from
    state = {name: read().to(device=device, dtype=dtype) for name, read in readers.items()}
    model.load_state_dict(state, strict=True, assign=True)


INIT_STD = 0.02  # the matrices' init scale (the reference's initializer_range)
# Our starting values of the history-slot mixer's vectors (real checkpoints bring their own): unit q, k give
# logits in [-4, 4]; the history slot starts with e^2 times one block row's weight; its read at full scale.
BD_SOFTMAX_INIT = {"bd_softmax_logit_scale": 4.0, "bd_softmax_history_bias": 2.0, "bd_softmax_history_c": 1.0}


def init_random_weights(model: CloverModel, *, seed: int, dtype: torch.dtype, device: torch.device) -> None:
    """Seeded initialisation like the reference's: normal(0, 0.02) matrices, zero-centred norms at 0, A in [1, 16].

    Each tensor (and each expert of a stack) draws from its own generator seeded by (seed, name, expert), so a
    rank holding experts [a, b) gets exactly the slices of the full model's stacks.
    """
    experts_by_prefix = _expert_modules(model)

    def draw(name: str, shape: torch.Size) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        leaf = name.rsplit(".", 1)[-1]
        if leaf in BD_SOFTMAX_INIT:
            return torch.full(shape, BD_SOFTMAX_INIT[leaf])
        if name.endswith("linear_attn.norm.weight") or leaf == "dt_bias":
            return torch.ones(shape)
        if name.endswith("norm.weight"):
            return torch.zeros(shape)
        if leaf == "A_log":
            return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        return torch.empty(shape).normal_(0.0, INIT_STD, generator=gen)

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


def init_random_weights_on_device(model: CloverModel, *, seed: int, dtype: torch.dtype,
                                  device: torch.device) -> None:
    """The same kinds of values as `init_random_weights`, drawn on the device from one generator: for benchmark
    shapes too large to draw on the host (35B parameters); not reproducible across expert splits."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        t = torch.empty(p.shape, device=device, dtype=torch.float32 if leaf == "A_log" else dtype)
        if leaf in BD_SOFTMAX_INIT:
            t.fill_(BD_SOFTMAX_INIT[leaf])
        elif name.endswith("linear_attn.norm.weight") or leaf == "dt_bias":
            t.fill_(1.0)
        elif name.endswith("norm.weight"):
            t.zero_()
        elif leaf == "A_log":
            t = t.uniform_(1.0, 16.0, generator=gen).log_().to(dtype)
        else:
            t.normal_(0.0, INIT_STD, generator=gen)
        state[name] = t
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


def weight_bytes(config: CloverConfig, dtype: torch.dtype, expert_range: tuple[int, int] | None = None) -> int:
    """Bytes the weights of one model (or of one expert-parallel rank's expert range) take in `dtype`."""
    total, _ = config.parameter_counts()
    if expert_range is not None:
        absent = config.num_experts - (expert_range[1] - expert_range[0])
        total -= absent * 3 * config.hidden_size * config.moe_intermediate_size * config.num_hidden_layers
    return total * torch.empty((), dtype=dtype).element_size()


def _cgroup_free_bytes() -> int | None:
    """What this process's cgroup (a container's memory limit) still allows, when it sets one (v2, then v1)."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max", or v1's "no limit" (a huge number)
            return max(0, int(limit) - usage)
    return None


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new weights on `device`: the GPU's free memory; on CPU, MemAvailable (capped by a container
    limit). None when it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    if device.type != "cpu":
        return None
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cgroup = _cgroup_free_bytes()
    if cgroup is not None:
        free = cgroup if free is None else min(free, cgroup)
    return free


def check_memory(config: CloverConfig, *, dtype: torch.dtype, device: torch.device, source: str,
                 expert_range: tuple[int, int] | None = None, available: int | None = None) -> None:
    """Refuse a model whose weights alone do not fit in what `device` has free, before allocating anything.

    A config.json can ask for any size; without this a too-large (or hostile) one is found out by the kernel's
    out-of-memory killer halfway through loading. `available` overrides the measured free memory.
    """
    need = weight_bytes(config, dtype, expert_range)
    have = available_memory(device) if available is None else available
    if have is not None and need > have:
        total, _ = config.parameter_counts()
        part = "" if expert_range is None else f" (experts {expert_range[0]}..{expert_range[1] - 1} of this rank)"
        raise ConfigError(
            f"model {source}: its config asks for {need / 2**30:,.1f} GiB of weights in "
            f"{str(dtype).removeprefix('torch.')} ({total / 1e9:,.2f}B parameters{part}), more than {device} has free "
            f"({have / 2**30:,.1f} GiB); nothing was loaded. Check config.json, or use bfloat16, expert_parallel or "
            f"a larger device")


def read_config(path: Path, overrides: dict | None = None) -> CloverConfig:
    """config.json (and generation_config.json) of a checkpoint folder; overrides: diffusion settings."""
    return CloverConfig.from_file(path / "config.json", overrides=overrides)
