"""`clover-batch model parity CODE_DIR --trust-remote-code`: our implementation against the checkpoint authors' code.

CODE_DIR is a Hugging Face snapshot folder of the checkpoint: its `modeling_*.py` / `configuration_*.py` and its
`config.json`, whose `auto_map` names the classes. That code runs only with --trust-remote-code, and then only in a
child process (`python -m clover_batch.jobs.parity child WORKDIR`), never in a job.

    1. here:  a tiny config of Clover's architecture (the tiny-clover preset's shape, 5 layers), in Clover's
              layout, with the snapshot's auto_map and model_type, and the snapshot's .py files beside it
    2. child: the authors' classes build that model, every parameter drawn from a seeded generator by name,
              save it (save_pretrained, safetensors) and run the passes on fixed inputs
    3. here:  our loader reads what they saved (their tensor names and layout), runs the same passes, compares

Passes (fp32 on CPU): prefill (causal forward over a prompt: logits and each layer's output), preview (one
denoising pass over a half-masked block after the prompt), commit (causal forward over prompt + block), decode
(greedy block decoding, one token per step, 2 blocks). Prefill and commit use the standard `forward`; the
authors' entry points for a preview and for block decoding are not public, so they are called through an adapter
file (--adapter; default CODE_DIR/clover_parity_adapter.py) that defines:

    preview_logits(model, prompt_ids: list[int], block_ids: list[int]) -> Tensor [len(block_ids), V]
    generate_blocks(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]   # greedy, 1 token per step

A pass without an entry point is reported "not compared". Exit status: 0 every pass compared and within
tolerance; 1 a mismatch (or our loader refuses what their code saved); 4 no mismatch, but some passes could not
be compared; 2 usage errors.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ADAPTER = "clover_parity_adapter.py"
PASSES = ("prefill", "preview", "commit", "decode")
CHILD_TIMEOUT_S = 600


@dataclass(frozen=True)
class PassResult:
    name: str
    compared: bool
    ok: bool
    detail: str  # max differences by part, or why it was not compared


@dataclass(frozen=True)
class ParityReport:
    passes: list[PassResult]

    @property
    def exit_code(self) -> int:
        if any(p.compared and not p.ok for p in self.passes):
            return 1
        return 0 if all(p.compared for p in self.passes) else 4


class ParityError(Exception):
    """The harness could not run (a usage problem or the authors' code failing): exit 2 with the message."""


# ---- shared by both sides -----------------------------------------------------------------------------------------


def draw(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The value every parameter gets, by name (the same on both sides whatever their init does): finite,
    non-degenerate, and in the range each kind of tensor has in a trained model."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return torch.empty(shape).uniform_(0.0, math.log(16.0), generator=gen)
    if leaf == "bd_softmax_logit_scale":
        return torch.empty(shape).uniform_(2.0, 6.0, generator=gen)
    if leaf in ("bd_softmax_history_c", "dt_bias"):
        return torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
    if len(shape) <= 1:  # norms, history bias: around their reference points
        return torch.empty(shape).normal_(0.0, 0.3, generator=gen)
    return torch.empty(shape).normal_(0.0, 0.08, generator=gen)


def inputs(vocab: int, block: int, mask: int, seed: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, min(vocab, 250), (2 * block,), generator=gen).tolist()
    filled = torch.randint(0, min(vocab, 250), (block,), generator=gen).tolist()
    half = [t if i % 2 == 0 else mask for i, t in enumerate(filled)]
    return {"prompt": prompt, "block": half, "filled": filled}


# ---- the child: the authors' code ----------------------------------------------------------------------------------


def child(workdir: Path) -> None:
    """Runs in its own process with the authors' code importable from workdir/ckpt."""
    import importlib.util

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    request = json.loads((workdir / "request.json").read_text())
    ckpt = workdir / "ckpt"
    torch.manual_seed(request["seed"])
    config = AutoConfig.from_pretrained(ckpt, trust_remote_code=True)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(draw(name, p.shape, request["seed"]))
    model.eval()
    model.save_pretrained(ckpt, safe_serialization=True)
    data = request["inputs"]
    out: dict[str, torch.Tensor] = {}
    status: dict[str, str] = {}

    def causal(name: str, ids: list[int]) -> None:
        with torch.no_grad():
            result = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        out[f"{name}.logits"] = result.logits[0].float().contiguous()
        hidden = result.hidden_states or ()
        for i, h in enumerate(hidden):
            out[f"{name}.hidden.{i}"] = h[0].float().contiguous()
        status[name] = "ok"

    causal("prefill", data["prompt"])
    causal("commit", data["prompt"] + data["filled"])
    adapter = None
    if request["adapter"] and Path(request["adapter"]).exists():
        spec = importlib.util.spec_from_file_location("clover_parity_adapter", request["adapter"])
        assert spec is not None and spec.loader is not None
        adapter = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(adapter)
    if adapter is not None and hasattr(adapter, "preview_logits"):
        with torch.no_grad():
            out["preview.logits"] = adapter.preview_logits(model, data["prompt"], data["block"]).float().contiguous()
        status["preview"] = "ok"
    else:
        status["preview"] = f"no preview_logits in an adapter ({request['adapter'] or 'none given'})"
    if adapter is not None and hasattr(adapter, "generate_blocks"):
        tokens = adapter.generate_blocks(model, data["prompt"], request["decode_tokens"])
        out["decode.tokens"] = torch.tensor(list(tokens), dtype=torch.long)
        status["decode"] = "ok"
    else:
        status["decode"] = f"no generate_blocks in an adapter ({request['adapter'] or 'none given'})"
    save_file(out, str(workdir / "theirs.safetensors"))
    (workdir / "status.json").write_text(json.dumps(status))


# ---- here: our side and the comparison ------------------------------------------------------------------------------


def _tiny_config(code_dir: Path) -> dict[str, Any]:
    from clover_batch.model import from_preset

    snapshot = code_dir / "config.json"
    if not snapshot.exists():
        raise ParityError(f"{snapshot}: missing; the harness takes the snapshot's auto_map and model_type from it")
    try:
        theirs = json.loads(snapshot.read_text())
    except json.JSONDecodeError as e:
        raise ParityError(f"{snapshot}: not valid JSON ({e})") from None
    auto_map = theirs.get("auto_map")
    if not isinstance(auto_map, dict) or "AutoModelForCausalLM" not in auto_map:
        raise ParityError(f"{snapshot}: no auto_map naming an AutoModelForCausalLM class")
    # the tiny preset's shape with both layer kinds before the last layer (whose output may come back after the
    # final norm in the reference's hidden states, so it is compared through the logits)
    config = from_preset("tiny-clover").replace(layer_types=("linear_attention", "full_attention", "linear_attention",
                                                             "full_attention", "linear_attention")).to_json_dict()
    config.update(auto_map=auto_map, model_type=theirs.get("model_type", config["model_type"]),
                  architectures=theirs.get("architectures", config["architectures"]))
    d = config["diffusion"]
    config.update(block_length=d["block_size"], mask_id=d["mask_token_id"])  # the other names loaders look for
    return config


def _ours(ckpt: Path, data: dict[str, list[int]], decode_tokens: int) -> dict[str, torch.Tensor]:
    from clover_batch.model import generate, load_model

    model = load_model(ckpt)
    out: dict[str, torch.Tensor] = {}

    def causal(name: str, ids: list[int]) -> None:
        outputs: list[torch.Tensor] = []
        hooks = [layer.register_forward_hook(lambda _m, _i, o: outputs.append(o[0][0].float()))
                 for layer in model.layers]
        try:
            logits, _ = model(torch.tensor([ids]), attention="causal")
        finally:
            for h in hooks:
                h.remove()
        out[f"{name}.logits"] = logits[0].float()
        for i, h in enumerate(outputs):
            out[f"{name}.layer.{i}"] = h

    causal("prefill", data["prompt"])
    causal("commit", data["prompt"] + data["filled"])
    _, state = model(torch.tensor([data["prompt"]]))
    preview, _ = model(torch.tensor([data["block"]]), state, preview=True)
    out["preview.logits"] = preview[0].float()
    gen = generate(model, [data["prompt"]], max_new_tokens=decode_tokens, tokens_per_step=1, stop_token_ids=[])[0]
    out["decode.tokens"] = torch.tensor(gen.tokens, dtype=torch.long)
    out["layer_kinds"] = torch.tensor([layer.kind == "linear_attention" for layer in model.layers])
    return out


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max absolute difference relative to the reference's scale (at least 1)."""
    if a.shape != b.shape:
        return math.inf
    if torch.isnan(a).any() or torch.isnan(b).any():
        return math.inf
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def compare(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], status: dict[str, str],
            tolerance: float) -> ParityReport:
    kinds = ["GDN" if g else "attention" for g in ours["layer_kinds"].tolist()]
    results = []
    for name in PASSES:
        if status.get(name) != "ok":
            results.append(PassResult(name, False, False, status.get(name, "not run")))
            continue
        if name == "decode":
            a, b = ours["decode.tokens"].tolist(), theirs["decode.tokens"].tolist()
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                         None if len(a) == len(b) else min(len(a), len(b)))
            detail = f"{len(a)} tokens equal" if first is None else f"tokens differ from position {first}"
            results.append(PassResult(name, True, first is None, detail))
            continue
        parts = {"logits": _error(ours[f"{name}.logits"], theirs[f"{name}.logits"])}
        hidden = sorted((k for k in theirs if k.startswith(f"{name}.hidden.")), key=lambda k: int(k.rsplit(".", 1)[1]))
        if hidden:
            if len(hidden) == len(kinds) + 1:  # embeddings, then each layer (the last may be after the final norm)
                for i in range(len(kinds) - 1):
                    err = _error(ours[f"{name}.layer.{i}"], theirs[hidden[i + 1]])
                    parts[kinds[i]] = max(parts.get(kinds[i], 0.0), err)
            else:
                parts["layers"] = math.nan  # an unknown hidden-state convention: not compared per layer
        ok = all(v <= tolerance for v in parts.values() if not math.isnan(v))
        detail = ", ".join(f"{k} {v:.2e}" if not math.isnan(v) else f"{k} not compared ({len(hidden)} hidden "
                           f"states for {len(kinds)} layers)" for k, v in parts.items())
        results.append(PassResult(name, True, ok, detail))
    return ParityReport(results)


def run_parity(code_dir: Path, *, trust_remote_code: bool, adapter: Path | None = None, seed: int = 0,
               tolerance: float = 1e-4, keep: Path | None = None) -> ParityReport:
    """Build, run and compare (see the module docstring); raises ParityError for usage problems."""
    from clover_batch.model import CheckpointError, ConfigError

    if not trust_remote_code:
        raise ParityError(f"model parity runs the Python code in {code_dir}: pass --trust-remote-code if you trust "
                          f"its source (it runs in a child process, never in a job)")
    code_dir = Path(code_dir)
    if not code_dir.is_dir():
        raise ParityError(f"{code_dir}: not a folder")
    code = sorted(code_dir.glob("*.py"))
    if not any(p.name.startswith("modeling_") for p in code):
        raise ParityError(f"{code_dir}: no modeling_*.py (a Hugging Face snapshot of the checkpoint has one)")
    adapter = adapter or (code_dir / ADAPTER if (code_dir / ADAPTER).exists() else None)
    workdir = Path(tempfile.mkdtemp(prefix="clover-parity-")) if keep is None else keep
    try:
        ckpt = workdir / "ckpt"
        ckpt.mkdir(parents=True, exist_ok=True)
        config = _tiny_config(code_dir)
        (ckpt / "config.json").write_text(json.dumps(config, indent=2))
        for p in code:
            shutil.copy(p, ckpt / p.name)
        d = config["diffusion"]
        data = inputs(config["vocab_size"], d["block_size"], d["mask_token_id"], seed)
        decode_tokens = 2 * d["block_size"]
        (workdir / "request.json").write_text(json.dumps({
            "seed": seed, "inputs": data, "adapter": str(adapter.resolve()) if adapter else None,
            "decode_tokens": decode_tokens}))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(workdir / "modules")}
        proc = subprocess.run([sys.executable, "-m", "clover_batch.jobs.parity", "child", str(workdir)], env=env,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise ParityError(f"the authors' code failed in the child process (exit {proc.returncode}):\n{tail}")
        from safetensors.torch import load_file

        theirs = load_file(str(workdir / "theirs.safetensors"))
        status = json.loads((workdir / "status.json").read_text())
        try:
            ours = _ours(ckpt, data, decode_tokens)
        except (CheckpointError, ConfigError) as e:  # their saved layout is not one our loader reads: a finding
            return ParityReport([PassResult("load", True, False, f"our loader refuses what their code saved: {e}")])
        return compare(ours, theirs, status, tolerance)
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":  # the child: python -m clover_batch.jobs.parity child WORKDIR
    if len(sys.argv) != 3 or sys.argv[1] != "child":
        sys.exit("usage: python -m clover_batch.jobs.parity child WORKDIR")
    child(Path(sys.argv[2]))
