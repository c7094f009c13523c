"""Expert parallelism on CPU (gloo): N ranks give the logits and greedy tokens of one device, each rank holds only
its experts, and a rank that dies or hangs fails the call within the timeout and the replica recovers.

Rank 0 is this test process; ranks 1..N-1 are local processes forked from a forkserver that has already imported
torch and the model (a plain spawn costs ~5 s of imports per rank on the 2-core runner).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from contextlib import contextmanager

import pytest
import torch
from clover_batch.model import generate, load_model
from clover_batch.model.expert_parallel import (
    ExpertParallelDispatcher,
    ExpertParallelError,
    check_expert_parallel,
    expert_numel,
    expert_range,
    local_replica,
)
from clover_batch.model.moe import SparseMoE

from tests.reference import make_reference

TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _forkserver():
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "clover_batch.model"])


@contextmanager
def replica(source, world, **kwargs):
    kwargs.setdefault("timeout_s", 20.0)
    r = local_replica(str(source), world, start_method="forkserver", **kwargs)
    try:
        yield r
    finally:
        r.close()


def _ids(seed: int, B: int, T: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab - 8, (B, T), generator=torch.Generator().manual_seed(seed))


def _logits_in_pieces(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of a prefill in two pieces carrying the state, plus an uncommitted pass after it."""
    a, b = ids[:, :13], ids[:, 13:]
    la, state = model(a)
    lb, state = model(b, state)
    lc, _ = model(ids[:, -5:], state, commit=False)
    return [la, lb, lc]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert not torch.isnan(g).any()
        err = ((g - w).abs().max() / w.abs().max()).item()
        assert err <= TOL, f"relative error {err:.2e}"


def _check_replica(r, single, source_world: int) -> None:
    """Logits equal, and each rank holds exactly 1/N of the experts (counted in each rank's process)."""
    vocab = single.config.vocab_size
    ids = _ids(0, 3, 29, vocab)
    _assert_close(_logits_in_pieces(r.model, ids), _logits_in_pieces(single, ids))
    per_rank = r.expert_numel_per_rank()
    total = expert_numel(single)
    assert per_rank == [total // source_world] * source_world
    moes = [m for m in r.model.modules() if isinstance(m, SparseMoE)]
    assert len(moes) == single.config.num_hidden_layers
    assert all(isinstance(m.dispatcher, ExpertParallelDispatcher) for m in moes)


@pytest.mark.parametrize("world", [2, 4], ids=["N2", "N4"])
def test_tiny_logits_and_diffusion_tokens_match_one_device(world):
    single = load_model("tiny")
    prompts = [_ids(1, 1, 21, 512)[0].tolist(), _ids(2, 1, 8, 512)[0].tolist()]
    want = generate(single, prompts, max_new_tokens=20, temperature=0.0, threshold=0.9)
    with replica("tiny", world) as r:
        _check_replica(r, single, world)
        got = generate(r.model, prompts, max_new_tokens=20, temperature=0.0, threshold=0.9)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert [g.forward_passes for g in got] == [w.forward_passes for w in want]
    assert all(len(w.tokens) > 0 for w in want)


def test_tiny_ar_greedy_tokens_match_one_device():
    single = load_model("tiny-ar")
    prompts = [_ids(3, 1, 17, 512)[0].tolist(), _ids(4, 1, 5, 512)[0].tolist()]
    want = generate(single, prompts, max_new_tokens=12, temperature=0.0)
    with replica("tiny-ar", 2) as r:
        got = r.generate(prompts, max_new_tokens=12, temperature=0.0)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert sum(len(w.tokens) for w in want) > 5


def test_verified_over_two_ranks_equals_autoregressive_on_one_device():
    """decode.mode verified with the experts split over two ranks: the autoregressive output of one device, with
    drafts rejected (the random preview disagrees with the trunk)."""
    single = load_model("tiny-clover")
    prompts = [_ids(5, 1, 19, 512)[0].tolist(), _ids(6, 1, 6, 512)[0].tolist()]
    want = generate(single, prompts, max_new_tokens=14, mode="autoregressive", stop_token_ids=[])
    with replica("tiny-clover", 2) as r:
        got = r.generate(prompts, max_new_tokens=14, mode="verified", tokens_per_step=2, stop_token_ids=[])
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert all(len(w.tokens) == 14 for w in want)
    assert sum(g.verified_blocks - g.full_blocks for g in got) > 0


@pytest.fixture(scope="module")
def reference_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref-ep")
    make_reference(path, seed=3)
    return path


@pytest.mark.parametrize("world", [2, 4], ids=["N2", "N4"])
def test_reference_checkpoint_logits_match_one_device(reference_checkpoint, world):
    single = load_model(reference_checkpoint)
    with replica(reference_checkpoint, world) as r:
        _check_replica(r, single, world)


def test_send_recv_exchange_matches_all_to_all():
    single = load_model("tiny")
    with replica("tiny", 2, exchange="send_recv") as r:
        assert r.group.exchange_name == "send_recv"
        _check_replica(r, single, 2)


def test_expert_parallel_must_divide_num_experts():
    cfg = load_model("tiny").config
    check_expert_parallel(cfg, 4)
    with pytest.raises(ValueError, match=r"expert_parallel=3 does not divide num_experts=8 .*\[1, 2, 4, 8\]"):
        check_expert_parallel(cfg, 3)
    with pytest.raises(ValueError, match="does not divide"):
        local_replica("tiny", 3)
    assert [expert_range(r, 4, 8) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def _fail_worker_at_round(r, n: int, sig: int) -> list[int]:
    """Send `sig` to rank 1 when the driver starts its n-th expert round (mid-generate); returns [rounds seen]."""
    seen = [0]
    pid = r.launcher.procs[0].pid
    for moe in (m for m in r.model.modules() if isinstance(m, SparseMoE)):
        inner = moe.dispatcher

        def wrapped(x, routing, experts, inner=inner):
            seen[0] += 1
            if seen[0] == n:
                os.kill(pid, sig)
            return inner(x, routing, experts)

        moe.dispatcher = wrapped
    return seen


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_failed_worker_mid_generate_restarts_and_gives_same_tokens(sig):
    single = load_model("tiny")
    prompts = [_ids(5, 1, 19, 512)[0].tolist(), _ids(6, 1, 30, 512)[0].tolist()]
    want = generate(single, prompts, max_new_tokens=16, temperature=0.0)
    with replica("tiny", 2, timeout_s=4.0) as r:
        seen = _fail_worker_at_round(r, 10, sig)
        got = r.generate(prompts, max_new_tokens=16, temperature=0.0)
        assert seen[0] >= 10 and r.restarts == 1
        assert [g.tokens for g in got] == [w.tokens for w in want]
        got_again = r.generate(prompts, max_new_tokens=16, temperature=0.0)  # the restarted group keeps working
        assert [g.tokens for g in got_again] == [w.tokens for w in want]


def test_failure_is_a_clear_error_when_restarts_run_out():
    with replica("tiny", 2, timeout_s=4.0, max_restarts=0) as r:
        _fail_worker_at_round(r, 3, signal.SIGKILL)
        with pytest.raises(ExpertParallelError, match=r"rank 0 of 2: layer \d expert exchange failed.*exited with -9"):
            r.generate([[1, 2, 3, 4, 5]], max_new_tokens=8)
