"""The compute dtype a model runs in: `model.dtype: auto` (the default), float32 or bfloat16.

    choose_dtype("auto", checkpoint_dtype, device)  ->  DtypeChoice(dtype, reason)

`auto` takes the checkpoint's dtype where the device computes it fast, else fp32:
- bf16 checkpoint on CUDA with bf16 support: bf16;
- bf16 checkpoint on a CPU with bf16 matrix units (AMX tiles, or AVX-512 BF16), as torch and the CPU report them
  (torch.cpu's own capability checks, else /proc/cpuinfo's flags): bf16. Measured on such a CPU (2 threads), a
  bf16 GEMM is 1.8x fp32 at 16 rows x 2048 x 2048 and 3.3x at 512 rows;
- a CPU without them: fp32 (bf16 matmuls there ran 50-600x slower than fp32 on the AVX2 machines measured);
- an fp32 checkpoint, or random weights of a preset (no stored dtype): fp32.

Whatever the weights' dtype, what must stay exact stays fp32 (ops.py, layers.py, docs/architecture.md section 4
lists it): the Gated DeltaNet recurrent state and its decay cumsums, attention's softmax, the router's
probabilities, and the logits that confidence and `mean_logprob` read.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CHOICES = ("auto", *DTYPES)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # why, in words, for the run report and `model inspect`

    @property
    def name(self) -> str:
        return "bfloat16" if self.dtype == torch.bfloat16 else "float32"


@functools.cache
def cpu_bf16_units() -> str | None:
    """The CPU's bf16 matrix units, in words ("AMX tiles", "AVX-512 BF16"), or None when it has none."""
    found = []
    probes = (("AMX tiles", "_is_amx_tile_supported", "amx_bf16"), ("AVX-512 BF16", "_is_avx512_bf16_supported",
                                                                     "avx512_bf16"))
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        pass
    for name, torch_check, flag in probes:
        check = getattr(torch.cpu, torch_check, None)
        try:
            has = bool(check()) if check is not None else flag in flags
        except RuntimeError:
            has = flag in flags
        if has:
            found.append(name)
    return " and ".join(found) or None


def checkpoint_dtype(source: str | Path) -> str | None:
    """The dtype a checkpoint folder's config.json stores its weights in ("bfloat16", "float32", ...), or None
    (a preset, or a config that does not say)."""
    path = Path(source) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    value = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return str(value).removeprefix("torch.") if value else None


def choose_dtype(requested: str, stored: str | None, device: torch.device | str) -> DtypeChoice:
    """The dtype to compute in: `requested` ("auto", "float32" or "bfloat16"), the checkpoint's stored dtype
    (None: not known), the device the model runs on."""
    if requested not in CHOICES:
        raise ValueError(f"model.dtype must be one of {', '.join(CHOICES)}, not {requested!r}")
    if requested != "auto":
        return DtypeChoice(DTYPES[requested], f"model.dtype: {requested} (set in the job)")
    device = torch.device(device)
    if stored != "bfloat16":
        what = f"the checkpoint stores {stored}" if stored else "the weights have no stored dtype (a preset)"
        return DtypeChoice(torch.float32, f"auto: {what}, so fp32")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "auto: bf16 checkpoint on a CUDA device with bf16")
        return DtypeChoice(torch.float32, "auto: bf16 checkpoint, but this CUDA device has no fast bf16: fp32")
    units = cpu_bf16_units()
    if units:
        return DtypeChoice(torch.bfloat16, f"auto: bf16 checkpoint on a CPU with bf16 matrix units ({units})")
    return DtypeChoice(torch.float32, "auto: bf16 checkpoint, but this CPU has no bf16 matrix units (AMX or "
                                      "AVX-512 BF16), where bf16 matmuls run far slower: fp32")


def bf16_twin(source: str, seed: int = 0) -> tuple:
    """(fp32 model, bf16 model) holding the same values: the fp32 model's weights rounded to bf16 first. What tests
    and benches compare bf16 against, so that a difference is the computation's, not the weights'."""
    from . import load_model

    f32 = load_model(source, seed=seed)
    with torch.no_grad():
        for p in f32.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    b16 = load_model(source, seed=seed, dtype=torch.bfloat16)
    b16.load_state_dict({k: v.to(torch.bfloat16) for k, v in f32.state_dict().items()})
    return f32, b16
