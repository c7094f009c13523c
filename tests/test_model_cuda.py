"""The same model on a CUDA device: logits, bf16 and generation against the CPU. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from clover_batch.model import generate, load_model, ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _ids(B: int, T: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab - 8, (B, T), generator=torch.Generator().manual_seed(seed))


def test_fp32_logits_and_state_match_cpu():
    cpu, gpu = load_model("tiny"), load_model("tiny", device="cuda")
    ids = _ids(2, 37, cpu.config.vocab_size)
    want, want_state = cpu(ids)
    got, got_state = gpu(ids.cuda())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    more = _ids(2, 9, cpu.config.vocab_size, seed=1)  # the carried state continues the same way
    torch.testing.assert_close(gpu(more.cuda(), got_state)[0].cpu(), cpu(more, want_state)[0], rtol=1e-4, atol=1e-4)


def test_bf16_stays_near_fp32():
    exact, _ = load_model("tiny")(_ids(1, 64, 512))
    got, _ = load_model("tiny", device="cuda", dtype=torch.bfloat16)(_ids(1, 64, 512).cuda())
    err = (got.float().cpu() - exact).abs().mean() / exact.abs().mean()
    assert err < 0.05, f"relative mean error {err:.3f}"


def test_bf16_grouped_mm_equals_reference():
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 17, 1, 8, 0, 0, 4]
    x = torch.randn(sum(counts), 64, generator=gen).cuda().bfloat16()
    w = torch.randn(len(counts), 32, 64, generator=gen).cuda().bfloat16()
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    torch.testing.assert_close(ops.grouped_mm(x, w, offs).float(), ops.grouped_mm_reference(x, w, offs).float(),
                               rtol=2e-2, atol=2e-2)


def test_greedy_generation_matches_cpu():
    prompts = [_ids(1, 21, 512, seed=2)[0].tolist(), _ids(1, 6, 512, seed=3)[0].tolist()]
    want = generate(load_model("tiny"), prompts, max_new_tokens=16, tokens_per_step=2)
    got = generate(load_model("tiny", device="cuda"), prompts, max_new_tokens=16, tokens_per_step=2)
    assert [g.tokens for g in got] == [w.tokens for w in want]


def _fla():
    from clover_batch.model import kernels

    try:
        return kernels.fla_kernels()
    except RuntimeError as e:
        pytest.skip(str(e))


def _rms_ratio(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt())


@pytest.mark.parametrize("T", [1, 32, 64, 65, 300], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_gated_delta_rule_equals_ours(T, dtype):
    """fla's chunk and fused recurrent kernels against our torch kernel: output and final state, fla's tolerance
    style (RMS error ratio), the initial state left untouched."""
    fla = _fla()
    gen = torch.Generator().manual_seed(T)
    B, Hk, Hv, K, V = 2, 4, 8, 128, 128
    q = ops.l2norm(torch.randn(B, T, Hk, K, generator=gen)).cuda()
    k = ops.l2norm(torch.randn(B, T, Hk, K, generator=gen)).cuda()
    v = torch.randn(B, T, Hv, V, generator=gen).cuda().to(dtype)
    g = (-torch.rand(B, T, Hv, generator=gen) * 0.3).cuda()
    beta = torch.rand(B, T, Hv, generator=gen).cuda().to(dtype)
    state = torch.randn(B, Hv, K, V, generator=gen).cuda()
    before = state.clone()
    o, S = fla.gated_delta_rule(q, k, v, g, beta, state)
    groups = Hv // Hk
    o_ref, S_ref = ops.gdn_chunked(q.repeat_interleave(groups, 2), k.repeat_interleave(groups, 2), v.float(), g,
                                   beta.float(), state)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert _rms_ratio(o.float(), o_ref) < tol and _rms_ratio(S, S_ref) < tol
    assert S.dtype == torch.float32 and torch.equal(state, before)


@pytest.mark.parametrize("T", [1, 8, 200], ids=lambda t: f"T{t}")
def test_fla_causal_conv_equals_ours(T):
    fla = _fla()
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(2, T, 96, generator=gen).cuda().bfloat16()
    w = torch.randn(96, 4, generator=gen).cuda().bfloat16()
    tail = torch.randn(2, 3, 96, generator=gen).cuda().bfloat16()
    y, new_tail = fla.causal_conv(x, w, tail)
    y_ref, tail_ref = ops.causal_conv(x, w, tail)
    assert _rms_ratio(y.float(), y_ref.float()) < 2e-2
    torch.testing.assert_close(new_tail, tail_ref)


def test_model_on_the_fla_path_equals_the_torch_path():
    from clover_batch.model import kernels

    _fla()
    model = load_model("tiny", device="cuda", dtype=torch.bfloat16)
    ids = _ids(2, 150, 512).cuda()
    with kernels.forced("torch"):
        want, want_state = model(ids)
    got, got_state = model(ids)  # CLOVER_KERNELS=auto on CUDA with fla-core installed: the fla path
    assert _rms_ratio(got.float(), want.float()) < 3e-2
    for ours, ref in zip(got_state.layers, want_state.layers, strict=True):
        if hasattr(ours, "recurrent"):
            assert _rms_ratio(ours.recurrent, ref.recurrent) < 5e-2


@pytest.mark.parametrize("merge", [False, True], ids=["separate-commits", "merged-commits"])
def test_engine_on_cuda_with_graphs_equals_eager(merge):
    """The decode step replayed as CUDA graphs gives the tokens of the same engine run eagerly, and of the CPU."""
    from clover_batch.model import DecodeOptions, Engine, Request

    model = load_model("tiny", device="cuda", dtype=torch.bfloat16)
    options = DecodeOptions(max_new_tokens=24, tokens_per_step=2, window_tokens=64, prefill_chunk_tokens=32)
    prompts = {f"p{i}": _ids(1, n, 512, seed=i)[0].tolist() for i, n in enumerate([150, 21, 6, 40, 9])}
    outputs = []
    for graphs in (False, True):
        engine = Engine(model, options, max_slots=4, cuda_graphs=graphs, merge_commits=merge)
        assert (engine.static is not None) == graphs and (not graphs or engine.static.capture)
        for key, p in prompts.items():
            engine.add(Request(key, p))
        results = {}
        while engine.has_work:
            results.update(engine.step())
        outputs.append({k: g.tokens for k, g in results.items()})
    assert outputs[0] == outputs[1]


def test_training_loss_and_gradients_match_cpu():
    """The block-diffusion loss and its gradients on CUDA equal the CPU's (training takes the dense attention path:
    flex_attention's block mask carries no query blocks for backward)."""
    import copy

    from clover_batch.jobs.demo_model import DemoShape, demo_config
    from clover_batch.model import build_model
    from clover_batch.model.train import Example, diffusion_loss, init_for_training

    cpu = build_model(demo_config(DemoShape(window_tokens=32)))
    init_for_training(cpu, seed=0, embedding_std=0.5)
    gpu = copy.deepcopy(cpu).to("cuda")
    rng = torch.Generator().manual_seed(3)
    batch = [Example(torch.randint(8, 2000, (n,), generator=rng).tolist(),
                     [*torch.randint(8, 2000, (m,), generator=rng).tolist(), 2]) for n, m in ((70, 20), (45, 9))]
    losses = []
    for model in (cpu, gpu):
        model.zero_grad()
        report = diffusion_loss(model, batch, torch.Generator().manual_seed(5), copies=2)
        report.loss.backward()
        losses.append(report.loss.detach().cpu())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-4)
    for (name, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters(), strict=True):
        if a.grad is not None:
            torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-3, atol=1e-5, msg=name)
