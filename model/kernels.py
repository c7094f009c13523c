"""Which kernels run the Gated DeltaNet layers (flash-linear-attention's Triton kernels or our torch kernels), and
which path masked attention takes (flex_attention's block mask or SDPA with a dense mask).

    CLOVER_KERNELS=auto (default): fla on CUDA tensors when fla-core is installed, else torch
    CLOVER_KERNELS=torch: our torch kernels everywhere (the reference, and the CPU path)
    CLOVER_KERNELS=fla: fla on CUDA tensors; an error if fla-core cannot be imported, or if there is no CUDA device
        and Triton's interpreter is off. With TRITON_INTERPRET=1 fla's kernels also run on CPU tensors, executed
        by Triton's interpreter (numpy, fp32 only, very slow): a test mode, which tests_interpret/ runs against our
        kernels. Two behaviours of the interpreter stop fla's kernels (and a third slows them): that harness
        patches them for its tests only (tests_interpret/conftest.py says which and why).

    CLOVER_ATTENTION=auto (default): flex_attention on CUDA tensors, dense SDPA elsewhere
    CLOVER_ATTENTION=dense: SDPA with a dense boolean mask everywhere (the CPU path)
    CLOVER_ATTENTION=flex: flex_attention with the block mask everywhere; on CPU tensors torch.compile builds it for
        the CPU, once per shape (5-15 s each), so the GPU's mask path can be tested here

Notable choices:
- Each choice is made once per process, logged once, and reported by `describe()` (model inspect, run report).
- With `auto` on a machine without CUDA, fla is never imported: triton stays out of CPU processes (with fla and
  triton importable on a CPU machine, transformers' Qwen3.5 reference crashes).
- Every call into fla lives in `FlaKernels`, with fla's conventions written out once: layout [B, T, H, K]; value
  heads grouped natively (q and k keep the key heads; value head j reads key head j // (Hv / Hk), as our
  repeat_interleave does); g is the log-space decay in fp32; beta is after the sigmoid; every argument by keyword
  (the fused recurrent kernel's 5th positional parameter is `gk`, not beta); the recurrent state is fp32;
  `initial_state` is read, never written (a denoising step must leave the committed state untouched); fla's conv
  state is the last Kc inputs [N, C, Kc] while ours is the last Kc-1 [N, Kc-1, C], converted at the call.
- The functions are injected, so tests can run these exact calls against stand-ins on CPU.
- CPU model threads flush denormal floats to zero (`model_threads`): the chunked GDN kernel's decay terms
  (exp of a chunk's cumulative log decay, and the products with it) underflow into the denormal range, where
  arithmetic on this CPU runs ~10x slower; a 20-row diffusion decode step takes 1.27x as long with them
  (`bench/engine.py --parts reads`). A value under 1.2e-38 becoming 0 changes no output that fp32 rounding of
  normal values does not already.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

KERNELS_ENV = "CLOVER_KERNELS"
CHOICES = ("auto", "torch", "fla")
ATTENTION_ENV = "CLOVER_ATTENTION"
ATTENTION_CHOICES = ("auto", "dense", "flex")
INTERPRET_ENV = "TRITON_INTERPRET"  # Triton's own switch: kernels run in its numpy interpreter, on any device
FUSED_RECURRENT_MAX_TOKENS = 64  # up to this many tokens (denoising steps, AR decode) the fused recurrent kernel


@dataclass(frozen=True)
class FlaKernels:
    """Our calls into flash-linear-attention (fla-core), in one place."""

    chunk_gated_delta_rule: Callable[..., Any]
    fused_recurrent_gated_delta_rule: Callable[..., Any]
    causal_conv1d: Callable[..., Any]
    version: str = "stand-in"

    @classmethod
    def load(cls) -> FlaKernels:
        try:
            import fla
            from fla.modules.causal_conv1d import causal_conv1d
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        except ImportError as e:
            raise RuntimeError(f"{KERNELS_ENV} asks for fla, but flash-linear-attention cannot be imported ({e}); "
                               f"install it with: pip install 'clover-batch[gpu]'") from e
        return cls(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, causal_conv1d,
                   version=f"fla-core {getattr(fla, '__version__', '?')}")

    def gated_delta_rule(self, q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor,
                         g_BTH: torch.Tensor, beta_BTH: torch.Tensor, state_BHKV: torch.Tensor,
                         lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: L2-normalised, key heads; v: value heads; returns (o [B, T, Hv, V], final state fp32, new).
        lengths: sequences packed along one row (fla's cu_seqlens), each from its own state [N, Hv, K, V]."""
        longest = q_BTHK.shape[1] if lengths is None else max(lengths)
        kernel = (self.fused_recurrent_gated_delta_rule if longest <= FUSED_RECURRENT_MAX_TOKENS
                  else self.chunk_gated_delta_rule)
        dtype = v_BTHV.dtype  # fla's kernels take q, k, v in one dtype and accumulate in fp32
        extra = {} if lengths is None else {"cu_seqlens": _cu_seqlens(lengths, q_BTHK.device)}
        o, final = kernel(q=q_BTHK.to(dtype).contiguous(), k=k_BTHK.to(dtype).contiguous(), v=v_BTHV.contiguous(),
                          g=g_BTH.float().contiguous(), beta=beta_BTH.to(dtype).contiguous(),
                          scale=q_BTHK.shape[-1] ** -0.5, initial_state=state_BHKV.float().contiguous(),
                          output_final_state=True, **extra)
        return o, final

    def causal_conv(self, x_BTC: torch.Tensor, w_CK: torch.Tensor, tail_BKC: torch.Tensor,
                    lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Depthwise causal conv + SiLU carrying our tail [B, Kc-1, C]; returns (y [B, T, C], new tail).
        lengths: sequences packed along one row (fla's cu_seqlens), each after its own tail [N, Kc-1, C]."""
        # fla keeps the last Kc inputs, oldest first; the oldest is outside the kernel's reach, so zero is exact
        initial = F.pad(tail_BKC.transpose(1, 2), (1, 0)).to(x_BTC.dtype).contiguous()  # [B, C, Kc]
        extra = {} if lengths is None else {"cu_seqlens": _cu_seqlens(lengths, x_BTC.device)}
        y, final = self.causal_conv1d(x=x_BTC.contiguous(), weight=w_CK.contiguous(), initial_state=initial,
                                      output_final_state=True, activation="silu", **extra)
        return y, final[:, :, 1:].transpose(1, 2)


def _cu_seqlens(lengths: list[int], device: torch.device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def model_threads(n: int) -> None:
    """torch's CPU threads for the model work of the calling thread: `n` of them, flushing denormal floats to zero
    (FTZ/DAZ). Call it on that thread before its first torch op: the thread's OpenMP workers are created at its
    first parallel op and take its floating-point mode then, never after (set later, only the calling thread's own
    share of each op is flushed)."""
    torch.set_flush_denormal(True)
    torch.set_num_threads(max(1, n))


_forced: FlaKernels | str | None = None  # "torch", or fla kernels (stand-ins in tests) for every device
_forced_attention: str | None = None  # "dense" or "flex" for every device


@functools.cache
def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET, read as Triton reads it: 1, true, on)."""
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "on")


@functools.cache
def selected() -> str:
    """'fla' or 'torch', decided once per process (see the module docstring)."""
    choice = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    if choice == "auto":
        choice = "fla" if torch.cuda.is_available() and importlib.util.find_spec("fla") is not None else "torch"
    if choice == "fla":
        if not torch.cuda.is_available() and not interpreted():
            raise ValueError(f"{KERNELS_ENV}=fla: fla's Triton kernels need a CUDA device, and there is none; on a "
                             f"CPU they run only under Triton's interpreter ({INTERPRET_ENV}=1, a slow test mode). "
                             f"Use {KERNELS_ENV}=torch or auto here")
        fla_kernels()  # fail now, with the install hint, rather than inside the first forward
    log.info("Gated DeltaNet kernels: %s", describe_choice(choice))
    return choice


@functools.cache
def selected_attention() -> str:
    """'auto', 'dense' or 'flex', decided once per process (see the module docstring)."""
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"{ATTENTION_ENV}={choice!r}: use one of {', '.join(ATTENTION_CHOICES)}")
    log.info("attention masks: %s", describe_attention_choice(choice))
    return choice


@functools.cache
def fla_kernels() -> FlaKernels:
    return FlaKernels.load()


def describe_choice(choice: str) -> str:
    if choice == "fla":
        if interpreted():
            return (f"fla ({fla_kernels().version}) under the Triton interpreter ({INTERPRET_ENV}=1: test mode, "
                    f"fp32, slow) on every device")
        triton = importlib.util.find_spec("triton")
        return f"fla ({fla_kernels().version}, Triton {'present' if triton else 'missing'}) on CUDA, torch elsewhere"
    return "torch"


def describe_attention_choice(choice: str) -> str:
    if choice == "auto":
        return "flex on CUDA, dense elsewhere" if torch.cuda.is_available() else "dense"
    return "flex (compiled for the CPU on CPU tensors)" if choice == "flex" else "dense"


def describe() -> str:
    """The kernels and attention path this process uses, for reports."""
    if _forced == "torch":
        gdn = "torch (forced)"
    elif isinstance(_forced, FlaKernels):
        gdn = f"fla ({_forced.version}, forced)"
    else:
        gdn = describe_choice(selected())
    attention = (f"{_forced_attention} (forced)" if _forced_attention is not None
                 else describe_attention_choice(selected_attention()))
    return f"{gdn}; attention {attention}"


def fla_for(t: torch.Tensor) -> FlaKernels | None:
    """The fla kernels to use for a tensor on this device, or None for the torch kernels."""
    if _forced == "torch":
        return None
    if isinstance(_forced, FlaKernels):
        return _forced
    if selected() == "fla" and (t.device.type == "cuda" or interpreted()):
        return fla_kernels()
    return None


def flex_for(t: torch.Tensor) -> bool:
    """Whether masked attention over tensors on this device takes flex_attention's block mask (else dense SDPA)."""
    choice = _forced_attention if _forced_attention is not None else selected_attention()
    return t.device.type == "cuda" if choice == "auto" else choice == "flex"


@contextlib.contextmanager
def forced(kernels: FlaKernels | str) -> Iterator[None]:
    """Run the fla path through `kernels` (stand-ins in tests) whatever the device, or "torch": our kernels
    everywhere (to compare the two paths in one process)."""
    global _forced
    previous, _forced = _forced, kernels
    try:
        yield
    finally:
        _forced = previous


@contextlib.contextmanager
def forced_attention(path: str) -> Iterator[None]:
    """Take attention path `path` ("dense" or "flex") whatever the device and CLOVER_ATTENTION (to compare the two
    paths in one process)."""
    global _forced_attention
    if path not in ("dense", "flex"):
        raise ValueError(f"attention path must be 'dense' or 'flex', got {path!r}")
    previous, _forced_attention = _forced_attention, path
    try:
        yield
    finally:
        _forced_attention = previous
