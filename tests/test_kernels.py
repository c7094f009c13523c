"""Our calls into flash-linear-attention, checked on CPU: stand-ins with fla's signatures record every argument and
compute through our torch reference, so the model run through the fla path must equal the torch path; and, where
fla-core is installed, its own naive reference agrees with our kernels on fla's conventions."""

from __future__ import annotations

import importlib.util
import inspect
import itertools
from pathlib import Path

import pytest
import torch
from clover_batch.model import kernels, load_model, ops
from clover_batch.model.kernels import FlaKernels
from test_model_ops import assert_close


class StandIns:
    """fla-shaped functions that record their calls and compute with our reference kernels."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def _record(self, name, args, kwargs):
        assert args == (), f"{name} called with positional arguments"
        self.calls.append((name, {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}))
        self.calls[-1][1]["_originals"] = kwargs  # the very tensors passed, to check they are not written

    def _gdr(self, name, args, kwargs):
        self._record(name, args, kwargs)
        q, k, v = kwargs["q"], kwargs["k"], kwargs["v"]
        groups = v.shape[2] // q.shape[2]  # fla: value head j reads key head j // groups
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        cu = kwargs.get("cu_seqlens")
        if cu is None:
            o, S = ops.gdn_recurrent(q, k, v, kwargs["g"], kwargs["beta"], kwargs["initial_state"])
            return o.to(v.dtype), S
        # fla's varlen form: B = 1, sequences cu[i]:cu[i+1] along the tokens, initial_state [N, H, K, V]
        assert q.shape[0] == 1 and kwargs["initial_state"].shape[0] == len(cu) - 1
        outs, states = [], []
        for i in range(len(cu) - 1):
            part = slice(int(cu[i]), int(cu[i + 1]))
            o, S = ops.gdn_recurrent(q[:, part], k[:, part], v[:, part], kwargs["g"][:, part],
                                     kwargs["beta"][:, part], kwargs["initial_state"][i:i + 1])
            outs.append(o)
            states.append(S)
        return torch.cat(outs, dim=1).to(v.dtype), torch.cat(states)

    def chunk_gated_delta_rule(self, *args, **kwargs):
        return self._gdr("chunk", args, kwargs)

    def fused_recurrent_gated_delta_rule(self, *args, **kwargs):
        return self._gdr("fused", args, kwargs)

    def causal_conv1d(self, *args, **kwargs):
        self._record("conv", args, kwargs)
        x, w, init = kwargs["x"], kwargs["weight"], kwargs["initial_state"]  # [B, T, C], [C, K], [B, C, K]
        K = w.shape[1]
        cu = kwargs.get("cu_seqlens")
        pieces = [(x, init)] if cu is None else [(x[:, int(cu[i]):int(cu[i + 1])], init[i:i + 1])
                                                 for i in range(len(cu) - 1)]
        ys, finals = [], []
        for xi, initi in pieces:
            y, _ = ops.causal_conv_reference(xi, w, initi[:, :, 1:].transpose(1, 2))
            ys.append(y)
            finals.append(torch.cat([initi.transpose(1, 2), xi], dim=1)[:, -K:].transpose(1, 2))  # the last K inputs
        return torch.cat(ys, dim=1), torch.cat(finals)

    def kernels(self) -> FlaKernels:
        return FlaKernels(self.chunk_gated_delta_rule, self.fused_recurrent_gated_delta_rule, self.causal_conv1d)


def _rms_close(ours: torch.Tensor, ref: torch.Tensor, ratio: float, what: str) -> None:
    err = (ours.double() - ref.double()).pow(2).mean().sqrt()
    assert float(err) <= ratio * float(ref.double().pow(2).mean().sqrt()), f"{what}: RMS error ratio {float(err):.3e}"


def _check_gdr_call(name, kw, config, *, state_kept: bool = True):
    """state_kept: the caller's initial state must be unchanged afterwards (the functional state; the engine
    writes its slots in place after the kernel, by design)."""
    Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
    Dk, Dv = config.linear_key_head_dim, config.linear_value_head_dim
    B, T = kw["q"].shape[:2]
    assert set(kw) - {"_originals", "cu_seqlens"} == {"q", "k", "v", "g", "beta", "scale", "initial_state",
                                                      "output_final_state"}
    sequences, longest = B, T
    if "cu_seqlens" in kw:  # packed prefill: one row of sequences along the tokens, one state each
        cu = kw["cu_seqlens"].tolist()
        assert B == 1 and cu[0] == 0 and cu[-1] == T and cu == sorted(cu)
        sequences, longest = len(cu) - 1, max(b - a for a, b in itertools.pairwise(cu))
    assert kw["q"].shape == kw["k"].shape == (B, T, Hk, Dk), "q, k keep the key heads (grouped in the kernel)"
    assert kw["v"].shape == (B, T, Hv, Dv)
    assert kw["g"].shape == kw["beta"].shape == (B, T, Hv)
    assert kw["g"].dtype == torch.float32 and bool((kw["g"] <= 0).all()), "g: log-space decay in fp32"
    assert bool(((kw["beta"] > 0) & (kw["beta"] < 1)).all()), "beta: after the sigmoid"
    assert kw["initial_state"].shape == (sequences, Hv, Dk, Dv) and kw["initial_state"].dtype == torch.float32
    assert kw["scale"] == Dk ** -0.5 and kw["output_final_state"] is True
    assert kw["q"].dtype == kw["k"].dtype == kw["v"].dtype
    for key in ("q", "k", "v", "g", "beta", "initial_state"):
        assert kw["_originals"][key].is_contiguous(), key
    if state_kept:
        assert torch.equal(kw["_originals"]["initial_state"], kw["initial_state"]), "initial_state was written"
    assert float(kw["q"].float().norm(dim=-1).max()) <= 1 + 1e-2, "q is L2-normalised (not the raw projection)"
    assert name == ("fused" if longest <= kernels.FUSED_RECURRENT_MAX_TOKENS else "chunk")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_model_through_the_fla_calls_equals_the_torch_path(dtype):
    model = load_model("tiny", dtype=dtype, seed=3)
    cfg = model.config
    ids = torch.randint(0, 250, (2, 150), generator=torch.Generator().manual_seed(0))
    block = torch.randint(0, 250, (2, 8), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_state = model(ids)
    ref_step, _ = model(block, ref_state, commit=False)

    stand_ins = StandIns()
    with kernels.forced(stand_ins.kernels()):
        logits, state = model(ids)  # prefill: chunk kernel
        step, same = model(block, state, commit=False)  # a denoising step: fused recurrent kernel
    # fp32: the same maths; bf16: the fla path feeds q and k to the kernel in bf16 (fla's style: RMS error ratio)
    close = (lambda a, b, what: assert_close(a.float(), b.float(), 1e-4, what)) if dtype == torch.float32 else \
        (lambda a, b, what: _rms_close(a, b, 5e-2, what))
    close(logits, ref_logits, "prefill logits")
    close(step, ref_step, "denoising step logits")
    assert same is state
    for ours, ref in zip(state.layers, ref_state.layers, strict=True):
        if hasattr(ours, "recurrent"):
            close(ours.recurrent, ref.recurrent, "recurrent state")
            close(ours.conv, ref.conv, "conv tail")

    names = [name for name, _ in stand_ins.calls]
    n_gdn = sum(kind == "linear_attention" for kind in cfg.layer_types)
    assert names.count("chunk") == n_gdn and names.count("fused") == n_gdn and names.count("conv") == 2 * n_gdn
    for name, kw in stand_ins.calls:
        if name == "conv":
            assert set(kw) - {"_originals"} == {"x", "weight", "initial_state", "output_final_state", "activation"}
            B, _, C = kw["x"].shape
            assert kw["weight"].shape == (C, cfg.linear_conv_kernel_dim) and kw["activation"] == "silu"
            assert kw["initial_state"].shape == (B, C, cfg.linear_conv_kernel_dim)
            assert kw["x"].dtype == kw["initial_state"].dtype == dtype
            assert torch.equal(kw["_originals"]["initial_state"], kw["initial_state"])
        else:
            _check_gdr_call(name, kw, cfg)


def test_engine_through_the_fla_calls_equals_the_torch_path():
    from clover_batch.model import generate

    model = load_model("tiny", seed=4)
    prompts = [list(range(5, 90)), [7, 8, 9], list(range(100, 141))]
    expected = [g.tokens for g in generate(model, prompts, max_new_tokens=12, tokens_per_step=2)]
    stand_ins = StandIns()
    with kernels.forced(stand_ins.kernels()):
        got = [g.tokens for g in generate(model, prompts, max_new_tokens=12, tokens_per_step=2)]
    assert got == expected
    packed = [kw for name, kw in stand_ins.calls if "cu_seqlens" in kw and len(kw["cu_seqlens"]) > 2]
    assert packed, "the prompts were prefilled together, as one packed forward (fla's cu_seqlens)"
    for name, kw in stand_ins.calls:
        if name != "conv":
            _check_gdr_call(name, kw, model.config, state_kept=False)


def test_the_fused_recurrent_kernel_takes_beta_by_keyword_only():
    """Why every argument is a keyword: fla's fused recurrent kernel's 5th positional parameter is `gk`."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("fla-core is not installed")
    source = Path(spec.submodule_search_locations[0]) / "ops" / "gated_delta_rule" / "fused_recurrent.py"
    text = source.read_text()
    signature = text[text.index("def fused_recurrent_gated_delta_rule("):]
    params = [p.split(":")[0].strip() for p in signature[signature.index("(") + 1:signature.index(")")].split(",")]
    assert params[:5] == ["q", "k", "v", "g", "gk"]


def _fla_naive():
    """fla's own pure-torch reference, loaded from its file: importing the fla package would import triton."""
    spec = importlib.util.find_spec("fla")
    if spec is None or importlib.util.find_spec("einops") is None:
        pytest.skip("fla-core (and einops) are not installed")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "gated_delta_rule" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_gdr_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("T", [1, 37, 130], ids=lambda t: f"T{t}")
def test_our_gated_delta_rule_equals_flas_naive_reference(T):
    naive = _fla_naive()
    gen = torch.Generator().manual_seed(T)
    B, Hk, Hv, K, V = 2, 2, 4, 16, 12
    q = ops.l2norm(torch.randn(B, T, Hk, K, generator=gen))
    k = ops.l2norm(torch.randn(B, T, Hk, K, generator=gen))
    v = torch.randn(B, T, Hv, V, generator=gen)
    g = -torch.rand(B, T, Hv, generator=gen) * 0.5  # log-space decay
    beta = torch.rand(B, T, Hv, generator=gen)
    state = torch.randn(B, Hv, K, V, generator=gen)
    o, S = ops.gated_delta_rule(q, k, v, g, beta, state)
    # fla's naive reference wants equal heads: repeat the key heads as its kernels group them (j // (Hv / Hk))
    o_ref, S_ref = naive.naive_recurrent_gated_delta_rule(
        q=q.repeat_interleave(2, dim=2), k=k.repeat_interleave(2, dim=2), v=v, beta=beta, g=g, scale=K ** -0.5,
        initial_state=state.clone(), output_final_state=True)
    assert_close(o, o_ref, 1e-4, "outputs")
    assert_close(S, S_ref, 1e-4, "final state")
    assert "beta" in inspect.signature(naive.naive_recurrent_gated_delta_rule).parameters


def test_kernel_choice_is_validated_and_auto_stays_off_fla_on_cpu(monkeypatch):
    kernels.selected.cache_clear()
    try:
        monkeypatch.setenv(kernels.KERNELS_ENV, "cuda-please")
        with pytest.raises(ValueError, match="CLOVER_KERNELS='cuda-please': use one of auto, torch, fla"):
            kernels.selected()
        kernels.selected.cache_clear()
        monkeypatch.setenv(kernels.KERNELS_ENV, "auto")
        if not torch.cuda.is_available():
            assert kernels.selected() == "torch" and kernels.describe().startswith("torch; attention ")
            assert kernels.fla_for(torch.zeros(1)) is None
    finally:
        kernels.selected.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine fla runs on the device")
def test_fla_on_a_cpu_is_refused_without_the_triton_interpreter(monkeypatch):
    """CLOVER_KERNELS=fla with no CUDA device: a clear error, at selection and at the first forward, naming the one
    way fla's kernels run on a CPU (TRITON_INTERPRET=1, tests_interpret/); never a silent fall back to torch."""
    monkeypatch.setenv(kernels.KERNELS_ENV, "fla")
    monkeypatch.delenv(kernels.INTERPRET_ENV, raising=False)
    kernels.selected.cache_clear()
    kernels.interpreted.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"CLOVER_KERNELS=fla: .*need a CUDA device.*TRITON_INTERPRET=1"):
            kernels.selected()
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            load_model("tiny")(torch.tensor([[1, 2, 3]]))
        for value, on in (("1", True), ("true", True), ("ON", True), ("0", False), ("", False)):
            monkeypatch.setenv(kernels.INTERPRET_ENV, value)
            kernels.interpreted.cache_clear()
            assert kernels.interpreted() is on, value
    finally:
        kernels.selected.cache_clear()
        kernels.interpreted.cache_clear()


def test_attention_choice_is_validated_and_picks_the_mask_path(monkeypatch):
    """CLOVER_ATTENTION: auto keeps flex on CUDA and dense elsewhere; flex and dense apply to every device; chosen
    once per process and reported; `forced_attention` overrides it (to compare both paths in one process)."""
    cpu = torch.zeros(1)
    kernels.selected_attention.cache_clear()
    try:
        monkeypatch.setenv(kernels.ATTENTION_ENV, "sparse")
        with pytest.raises(ValueError, match="CLOVER_ATTENTION='sparse': use one of auto, dense, flex"):
            kernels.selected_attention()
        for choice, flex_on_cpu, described in (("auto", False, "dense" if not torch.cuda.is_available() else
                                                "flex on CUDA, dense elsewhere"),
                                               ("flex", True, "flex (compiled for the CPU on CPU tensors)"),
                                               ("dense", False, "dense")):
            kernels.selected_attention.cache_clear()
            monkeypatch.setenv(kernels.ATTENTION_ENV, choice)
            assert kernels.flex_for(cpu) is flex_on_cpu, choice
            assert kernels.describe().endswith(f"; attention {described}"), kernels.describe()
            monkeypatch.setenv(kernels.ATTENTION_ENV, "auto")  # read once: a later change is not seen
            assert kernels.flex_for(cpu) is flex_on_cpu, choice
        with kernels.forced_attention("flex"):
            assert kernels.flex_for(cpu) and kernels.describe().endswith("; attention flex (forced)")
        assert not kernels.flex_for(cpu)
        with pytest.raises(ValueError, match="'dense' or 'flex'"), kernels.forced_attention("auto"):
            pass
    finally:
        kernels.selected_attention.cache_clear()


def test_model_threads_flush_denormals_in_every_worker_of_the_thread():
    """Set first thing on a fresh thread, the flush reaches the OpenMP workers it creates: a product in the denormal
    range, split over both threads, is zero everywhere (outside such a thread it is not)."""
    import threading

    tiny = torch.full((1 << 18,), 1e-39)  # denormal: below float32's smallest normal, 1.18e-38
    got = {}

    def work() -> None:
        kernels.model_threads(2)
        got["in"] = int(torch.count_nonzero(tiny * 0.5))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert got["in"] == 0
    assert int(torch.count_nonzero(tiny * 0.5)) == tiny.numel()  # this thread keeps denormals
