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
