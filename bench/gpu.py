"""One-shot GPU benchmark of the engine on the published shape, against the hardware's limits. Writes a JSON summary.

    python bench/gpu.py --out /tmp/gpu.json                              # H200: clover-35b-a3b, random bf16 weights
    python bench/gpu.py --device cpu --preset tiny --out /tmp/cpu.json   # the same code paths on CPU, < 1 minute

Needs only torch (+ triton and fla-core on a GPU) and this repository: `clover_batch.model` is imported from the
checkout when it is not installed, so the GPU machine needs neither ray nor pydantic. Weights are random, drawn on the
device (no checkpoint on disk). Every section is timed separately and guarded: a failure is recorded in the JSON and
the next section runs; sections are skipped once --budget-s is spent, so the script always finishes and writes.

Sections (JSON keys):
- env: torch, device, kernels in use (fla or torch), CUDA graphs, flex attention.
- prefill: tokens/s at 8K, 32K, 128K (B=1, 8K chunks), with FLOP/s against the bf16 peak (790 TFLOP/s).
- decode: tokens/s for autoregressive and diffusion (k=4, k=8, threshold 0.9) at 1, 8 and 32 slots, tokens per
  forward, step time, and the step's memory-bandwidth limit: bytes of weights the step touched (dense weights plus
  the experts its tokens were routed to, observed) / 4.3 TB/s. Diffusion gains show at many slots and large k;
  at 1 slot a 32-token block touches about as many experts as 32 autoregressive steps.
- shares: time in Gated DeltaNet / attention / MoE / other, in one prefill chunk and one (eager) decode step.
- memory: peak allocated bytes.
- kernels: the fla path vs the torch path on the same weights at 8K (logits RMS error ratio, bf16 tolerance 2e-2)
  and their prefill tokens/s.
- transformers: Qwen3_5MoeForCausalLM prefill tokens/s at 8K on the same shape, where the machine's transformers has
  it (run last: it replaces our model in memory).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
import types
from pathlib import Path

import torch

HBM_BYTES_PER_S = 4.3e12  # H200, achievable
BF16_FLOPS = 790e12  # H200 dense bf16


def import_model_package():
    """clover_batch.model from the installed package, or straight from this checkout (the GPU image has no ray or
    pydantic, so the project is not pip-installed there)."""
    try:
        import clover_batch.model as model_pkg

        return model_pkg
    except ImportError:
        root = Path(__file__).resolve().parents[1]
        pkg = types.ModuleType("clover_batch")
        pkg.__path__ = []
        sys.modules["clover_batch"] = pkg
        spec = importlib.util.spec_from_file_location("clover_batch.model", root / "model" / "__init__.py",
                                                      submodule_search_locations=[str(root / "model")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["clover_batch.model"] = module
        spec.loader.exec_module(module)
        return module


M = import_model_package()
from clover_batch.model import kernels  # noqa: E402
from clover_batch.model.weights import init_random_weights_on_device  # noqa: E402

SCALES = {  # preset -> prefill lengths, decode prompt and new tokens, decode window, transformers length
    "clover-35b-a3b": dict(prefill=[8192, 32768, 131072], prompt=512, new=256, window=8192, hf=8192, check=8192),
    "tiny": dict(prefill=[256, 1024, 4096], prompt=64, new=32, window=512, hf=256, check=256),
    "bench": dict(prefill=[1024, 4096], prompt=128, new=128, window=2048, hf=1024, check=1024),
}


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def section(results: dict, name: str, budget: Budget, need_s: float, fn) -> None:
    """Run one section; record its result, its error, or that the budget ran out."""
    if budget.left() < need_s:
        results[name] = {"skipped": f"time budget: {budget.left():.0f} s left, about {need_s:.0f} s needed"}
        print(f"[{name}] skipped (budget)", flush=True)
        return
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # a broken section must not lose the others' figures
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
    results[name]["seconds"] = round(time.perf_counter() - start, 1) if isinstance(results[name], dict) else None
    print(f"[{name}] {time.perf_counter() - start:.1f} s: {json.dumps(results[name])[:400]}", flush=True)


# ---- model --------------------------------------------------------------------------------------------------


def build(preset: str, device: torch.device, dtype: torch.dtype, window: int | None = None):
    config = M.from_preset(preset)
    if window:
        config = config.replace(window_tokens=window)
    model = M.build_model(config)
    init_random_weights_on_device(model, seed=0, dtype=dtype, device=device)
    return model.eval()


def weight_bytes(model) -> dict:
    """Bytes of the dense weights (everything but the routed experts) and of one expert of one layer."""
    dense = expert_total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            expert_total += p.numel() * p.element_size()
        else:
            dense += p.numel() * p.element_size()
    cfg = model.config
    return {"dense": dense, "per_expert": expert_total // (cfg.num_experts * cfg.num_hidden_layers)}


class RoutingObserver:
    """Counts, per MoE layer, the distinct experts the observed forwards routed tokens to."""

    def __init__(self, model):
        self.model, self.handles, self.experts = model, [], []

    def __enter__(self):
        for layer in self.model.layers:
            moe = layer.mlp
            self.experts.append(set())

            def hook(module, args, seen=self.experts[-1]):
                x = args[0].reshape(-1, args[0].shape[-1])
                routing = M.moe.route(x, module.gate.weight, module.top_k, module.normalize)
                seen.update(routing.experts.unique().tolist())

            self.handles.append(moe.register_forward_pre_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def touched(self) -> int:
        return sum(len(s) for s in self.experts)


def flops_per_token(config, context: int) -> float:
    """Forward FLOPs of one token: 2 x active parameters, plus attention over `context` keys."""
    _, active = config.parameter_counts()
    n_attn = sum(k == "full_attention" for k in config.layer_types)
    attention = n_attn * 4 * config.num_attention_heads * config.head_dim * context
    return 2 * active + attention


# ---- sections -----------------------------------------------------------------------------------------------


def env_section(device, model) -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "kernels": kernels.describe(), "cuda_graphs": M.graphs.graphs_wanted(model),
           "preset": model.config.name, "parameters": model.config.parameter_counts()[0],
           "active_parameters": model.config.parameter_counts()[1]}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["triton"] = getattr(importlib.import_module("triton"), "__version__", "?") \
            if importlib.util.find_spec("triton") else None
    return out


def prefill_section(model, device, lengths) -> dict:
    out = {}
    for n in lengths:
        options = M.DecodeOptions(max_new_tokens=1, stop_token_ids=(), window_tokens=max(n, 1024))
        engine = M.Engine(model, options, max_slots=1, cuda_graphs=False)
        prompt = torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        engine.add(M.Request("p", prompt))

        def run(engine=engine):
            while engine.prefilling or engine.waiting:
                engine.step()

        seconds = timed(run, device)
        tokens = engine.stats.prefill_tokens
        flops = sum(flops_per_token(model.config, min(i, n)) for i in range(0, tokens, 512)) * 512
        out[str(n)] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                       "tflops": flops / seconds / 1e12, "fraction_of_bf16_peak": flops / seconds / BF16_FLOPS}
    return out


def decode_cell(model, device, *, mode: str, slots: int, prompt: int, new: int, window: int,
                sizes: dict) -> dict:
    cfg = model.config
    if mode == "ar":
        options = M.DecodeOptions(max_new_tokens=new, stop_token_ids=(), window_tokens=window)
    elif mode.startswith("k"):
        options = M.DecodeOptions(max_new_tokens=new, stop_token_ids=(), window_tokens=window,
                                  tokens_per_step=int(mode[1:]))
    else:
        options = M.DecodeOptions(max_new_tokens=new, stop_token_ids=(), window_tokens=window, threshold=0.9)
    engine = M.Engine(model, options, max_slots=slots, decode_steps_per_prefill=0)
    gen = torch.Generator().manual_seed(slots)
    for i in range(slots):
        engine.add(M.Request(f"r{i}", torch.randint(0, 250, (prompt,), generator=gen).tolist()))
    while engine.prefilling or engine.waiting:
        engine.step()
    for _ in range(2):  # warm-up: CUDA graph capture, flex compile
        engine.step()
    with RoutingObserver(model) as observer:  # one eager step, to see which experts a step touches
        runner = engine.runner
        runner.static, static = None, runner.static
        engine.step()
        runner.static = static
    lives = list(engine.decoding)
    before = {lv.req.id: (len(lv.out), lv.forwards) for lv in lives}
    steps_before = engine.stats.decode_steps
    results: dict = {}

    def run():  # to the end: equal prompts and budgets keep the rows together, so the batch stays full
        while engine.has_work:
            results.update(engine.step())

    seconds = timed(run, device)
    steps = engine.stats.decode_steps - steps_before
    if steps == 0:
        raise ValueError(f"the sequences finished during the warm-up: raise the new tokens ({new})")
    produced = sum(len(results[lv.req.id].tokens) - before[lv.req.id][0] for lv in lives)
    rows_forwards = sum(results[lv.req.id].forward_passes - before[lv.req.id][1] for lv in lives)
    touched = sizes["dense"] + observer.touched() * sizes["per_expert"]
    step_s = seconds / steps
    return {"slots": len(lives), "steps": steps, "tokens_per_s": produced / seconds, "step_ms": step_s * 1e3,
            "tokens_per_forward": produced / rows_forwards,
            "experts_touched_per_layer": observer.touched() / cfg.num_hidden_layers,
            "weight_bytes_touched": touched, "bandwidth_limit_ms": touched / HBM_BYTES_PER_S * 1e3,
            "fraction_of_bandwidth_limit": touched / HBM_BYTES_PER_S / step_s}


def decode_section(model, device, scale, sizes, budget) -> dict:
    out = {}
    for mode in ("ar", "k4", "k8", "t0.9"):
        saved = model.config
        if mode == "ar":  # the same weights read as an autoregressive model
            model.config = saved.replace(diffusion=None)
        try:
            for slots in (1, 8, 32):
                if budget.left() < 20:
                    out[f"{mode}/{slots}"] = {"skipped": "time budget"}
                    continue
                try:
                    out[f"{mode}/{slots}"] = decode_cell(model, device, mode=mode, slots=slots, prompt=scale["prompt"],
                                                         new=scale["new"], window=scale["window"], sizes=sizes)
                except Exception as e:
                    out[f"{mode}/{slots}"] = {"error": f"{type(e).__name__}: {e}"}
                print(f"  decode {mode} x{slots}: {out[f'{mode}/{slots}']}", flush=True)
        finally:
            model.config = saved
    return out


MODULE_KINDS = {"GatedDeltaNet": "gdn", "GatedAttention": "attention", "SparseMoE": "moe"}


class ModuleTimer:
    """Time spent inside GDN, attention and MoE modules (CUDA events or wall clock), over the forwards it sees."""

    def __init__(self, model, device):
        self.model, self.device, self.handles = model, device, []
        self.spans: dict[str, list] = {k: [] for k in MODULE_KINDS.values()}

    def _now(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def __enter__(self):
        for module in self.model.modules():
            kind = MODULE_KINDS.get(type(module).__name__)
            if kind is None:
                continue

            def pre(mod, args, kind=kind):
                mod._clover_t0 = self._now()

            def post(mod, args, out, kind=kind):
                self.spans[kind].append((mod._clover_t0, self._now()))

            self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def seconds(self) -> dict:
        sync(self.device)
        if self.device.type == "cuda":
            return {k: sum(a.elapsed_time(b) for a, b in v) / 1e3 for k, v in self.spans.items()}
        return {k: sum(b - a for a, b in v) for k, v in self.spans.items()}


def shares_section(model, device, scale) -> dict:
    out = {}
    n = min(8192, scale["prefill"][0])
    prompt = torch.randint(0, 250, (n + 40,), generator=torch.Generator().manual_seed(3)).tolist()
    options = M.DecodeOptions(max_new_tokens=64, stop_token_ids=(), tokens_per_step=4,
                              window_tokens=max(n + 1024, 2048), prefill_chunk_tokens=n)
    engine = M.Engine(model, options, max_slots=8, cuda_graphs=False, decode_steps_per_prefill=0)
    for i in range(8):
        engine.add(M.Request(f"s{i}", prompt[i:i + n + 32]))
    engine.step()  # warm-up prefill chunk
    for name, run in (("prefill_chunk", lambda: engine.step()),
                      ("decode_step", lambda: [engine.step() for _ in range(1)])):
        if name == "decode_step":
            while engine.prefilling or engine.waiting:
                engine.step()
            engine.step()  # warm-up decode
        with ModuleTimer(model, device) as timer:
            total = timed(run, device)
        parts = timer.seconds()
        parts["other"] = max(0.0, total - sum(parts.values()))
        out[name] = {"ms": total * 1e3, **{k: round(v / total, 3) for k, v in parts.items()}}
    return out


def kernels_section(model, device, n) -> dict:
    if device.type != "cuda":
        return {"fla_vs_torch": "not run: fla's kernels need CUDA (this is the CPU dry run)"}
    ids = torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(5)).to(device)
    out = {}
    results = {}
    for name, choice in (("fla", kernels.fla_kernels()), ("torch", "torch")):
        with kernels.forced(choice):
            model(ids[:, :1024], keep_logits=1)  # warm-up
            logits = None

            def run(choice=choice):
                nonlocal logits
                logits, _ = model(ids, keep_logits=256)

            seconds = timed(run, device)
            results[name] = logits.float()
            out[f"{name}_tokens_per_s"] = n / seconds
    err = (results["fla"] - results["torch"]).pow(2).mean().sqrt() / results["torch"].pow(2).mean().sqrt()
    out.update(rms_error_ratio=float(err), tolerance=2e-2, within_tolerance=bool(err <= 2e-2),
               same_argmax=float((results["fla"].argmax(-1) == results["torch"].argmax(-1)).float().mean()))
    return out


def transformers_section(ours_config, device, dtype, n) -> dict:
    try:
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    except ImportError as e:
        return {"not_run": f"this transformers has no Qwen3.5-MoE ({e})"}
    raw = ours_config.to_json_dict()
    for key in ("clover", "diffusion", "architectures", "model_type"):
        raw.pop(key, None)
    config = Qwen3_5MoeTextConfig(**raw)
    with torch.device(device):  # built in bf16 on the device: 35B parameters in fp32 would not fit
        try:
            theirs = Qwen3_5MoeForCausalLM._from_config(config, dtype=dtype).eval()
        except TypeError:
            theirs = Qwen3_5MoeForCausalLM._from_config(config, torch_dtype=dtype).eval()
    ids = torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(6)).to(device)
    with torch.no_grad():
        theirs(ids[:, :256], use_cache=False)
        seconds = timed(lambda: theirs(ids, use_cache=False, logits_to_keep=1), device)
    return {"tokens": n, "tokens_per_s": n / seconds}


def our_sections(results: dict, preset: str, device: torch.device, dtype: torch.dtype, scale: dict,
                 budget: Budget) -> None:
    start = time.perf_counter()
    model = build(preset, device, dtype)
    results["build_seconds"] = time.perf_counter() - start
    sizes = weight_bytes(model)
    results["weights"] = sizes
    section(results, "env", budget, 0, lambda: env_section(device, model))
    section(results, "prefill", budget, 30, lambda: prefill_section(model, device, scale["prefill"]))
    section(results, "decode", budget, 60, lambda: decode_section(model, device, scale, sizes, budget))
    section(results, "shares", budget, 20, lambda: shares_section(model, device, scale))
    section(results, "kernels", budget, 30, lambda: kernels_section(model, device, scale["check"]))
    results["memory"] = {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device)
                         if device.type == "cuda" else None,
                         "note": None if device.type == "cuda" else "CPU: no allocator statistics"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="where to write the JSON summary")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="clover-35b-a3b")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting sections after this long")
    ap.add_argument("--quick", action="store_true", help="smallest sizes (a smoke test of every section)")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    scale = dict(SCALES.get(args.preset, SCALES["tiny"]))
    if args.quick:
        scale.update(prefill=[64, 128], prompt=16, new=32, hf=64, check=64)
    budget = Budget(args.budget_s)
    results: dict = {"preset": args.preset, "rooflines": {"hbm_bytes_per_s": HBM_BYTES_PER_S,
                                                           "bf16_flops": BF16_FLOPS}}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    our_sections(results, args.preset, device, dtype, scale, budget)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # our model is gone: room for transformers' one
    section(results, "transformers", budget, 40,
            lambda: transformers_section(M.from_preset(args.preset), device, dtype, scale["hf"]))
    results["total_seconds"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out} in {results['total_seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
