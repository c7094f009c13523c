"""The whole model on the GPU's code path, on a CPU: fla's kernels (Triton interpreter) and flex_attention's block
masks (compiled for the CPU), chosen as a GPU process chooses them (CLOVER_KERNELS=fla, CLOVER_ATTENTION=flex),
against the torch kernels and dense masks forced in the same process. fp32 throughout (see tolerances.py).

Each distinct attention shape costs a flex compile on a CPU (about 8 s of CPU here), so the shapes are few and
chosen: the diffusion run's decode steps have the fixed shapes of the GPU's static step (one of them shared with
test_flex_mask.py), the autoregressive run's decode rows need no mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from clover_batch.model import DecodeOptions, Engine, Generation, Request, generate, kernels, load_model
from clover_batch.model.state import AttentionState, GDNState
from tolerances import KERNEL_RTOL, LOGITS_RTOL, assert_close


@contextlib.contextmanager
def torch_and_dense() -> Iterator[None]:
    with kernels.forced("torch"), kernels.forced_attention("dense"):
        yield


def test_the_process_runs_fla_interpreted_and_flex():
    described = kernels.describe()
    assert kernels.selected() == "fla" and kernels.interpreted(), described
    assert "under the Triton interpreter" in described and "attention flex" in described, described
    assert kernels.fla_for(torch.zeros(1)) is kernels.fla_kernels() and kernels.flex_for(torch.zeros(1))
    with torch_and_dense():
        assert kernels.describe() == "torch (forced); attention dense (forced)"
        assert kernels.fla_for(torch.zeros(1)) is None and not kernels.flex_for(torch.zeros(1))


def test_prefill_logits_and_state_equal_the_torch_path(launched):
    """A block-causal prefill of 136 tokens: fla's chunked kernel (two whole chunks and a partial one), the conv
    from an empty tail, and flex over two query blocks: logits and every layer's state."""
    model = load_model("tiny", seed=3)
    ids = torch.randint(0, 250, (1, 136), generator=torch.Generator().manual_seed(0))
    with torch_and_dense():
        want, want_state = model(ids)
    got, state = model(ids)
    assert_close(got, want, LOGITS_RTOL, "prefill logits")
    for i, (ours, ref) in enumerate(zip(state.layers, want_state.layers, strict=True)):
        if isinstance(ours, GDNState):
            assert_close(ours.recurrent, ref.recurrent, KERNEL_RTOL, f"layer {i} recurrent state")
            assert_close(ours.conv, ref.conv, KERNEL_RTOL, f"layer {i} conv tail")
        else:
            assert isinstance(ours, AttentionState) and isinstance(ref, AttentionState)
            assert_close(ours.values, ref.values, KERNEL_RTOL, f"layer {i} values")
    ran = set(launched)
    assert "chunk_gated_delta_rule_fwd_kernel_h_blockdim64" in ran and "causal_conv1d_fwd_kernel" in ran, ran


def _prompts(n: int, tokens: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 250, (tokens,), generator=gen).tolist() for _ in range(n)]


def test_diffusion_through_the_engine_as_on_a_gpu_equals_the_torch_path(launched):
    """Three prompts through the engine as a GPU runs it: merged commits and the static-shape decode step that CUDA
    graphs replay (here eager: 4 rows, one of them padding, over the whole ring), every prompt prefilled before
    decoding starts. Each prompt: 24 tokens prefilled, a block starting with the other 3, two denoising steps of
    4 tokens, its commit merged with the next block's first step. Greedy: the same tokens."""
    model = load_model("tiny", seed=4)
    prompts = _prompts(3, 27)
    options = DecodeOptions(max_new_tokens=8, tokens_per_step=4, prefill_chunk_tokens=24)

    def run() -> list[Generation]:
        engine = Engine(model, options, max_slots=4, merge_commits=True, cuda_graphs=True,
                        decode_steps_per_prefill=0)
        assert engine.static is not None and not engine.static.capture
        for i, prompt in enumerate(prompts):
            engine.add(Request(str(i), prompt))
        results: dict[str, Generation] = {}
        while engine.has_work:
            results.update(engine.step())
        return [results[str(i)] for i in range(len(prompts))]

    with torch_and_dense():
        want = run()
    launched.clear()
    got = run()
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert all(len(w.tokens) == 8 for w in want), "a prompt stopped early: the comparison is shorter"
    assert "fused_recurrent_gated_delta_rule_fwd_kernel" in launched, sorted(set(launched))


def test_autoregressive_generation_equals_the_torch_path(launched):
    """clover_batch.model.generate on the autoregressive preset: three prompts of 24 tokens (prefill through
    flex's causal block mask; decode rows of one length see every key, so they take SDPA without a mask), one
    token per step through fla's fused recurrent kernel. Greedy: the same tokens."""
    model = load_model("tiny-ar", seed=4)
    prompts = _prompts(3, 24)
    with torch_and_dense():
        want = generate(model, prompts, max_new_tokens=4)
    launched.clear()
    got = generate(model, prompts, max_new_tokens=4)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert all(len(w.tokens) == 4 for w in want), "a prompt stopped early: the comparison is shorter"
    assert "fused_recurrent_gated_delta_rule_fwd_kernel" in launched, sorted(set(launched))


def test_verified_generation_equals_autoregressive_on_the_gpu_path(launched):
    """decode.mode verified on Clover's layout through fla's kernels and flex (previews, the causal check over a
    block, a complete block's commit merged with the next block's first preview, CUDA's default): the torch path's
    autoregressive output."""
    model = load_model("tiny-clover", seed=4)
    prompts = _prompts(3, 21)
    with torch_and_dense():
        want = generate(model, prompts, max_new_tokens=10, mode="autoregressive", stop_token_ids=[])
    launched.clear()
    got = generate(model, prompts, max_new_tokens=10, mode="verified", tokens_per_step=3, stop_token_ids=[],
                   merge_commits=True)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert sum(g.verified_blocks - g.full_blocks for g in got) > 0, "no draft rejected: the test proves less"
    # blocks of 8 run fla's fused recurrent kernel; packed prefill its varlen conv
    assert {"fused_recurrent_gated_delta_rule_fwd_kernel", "causal_conv1d_fwd_kernel"} <= set(launched), \
        sorted(set(launched))
