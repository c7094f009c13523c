"""The explicit state: carrying it across pieces, commit=False, the attention window, and bf16 against fp32."""

from __future__ import annotations

import pytest
import torch
from clover_batch.model import AttentionState, CloverState, ConfigError, GDNState, load_model
from test_model_ops import assert_close

T = 150  # two full 64-token GDN chunks and a partial one
SPLITS = {
    # id: piece lengths (sum T); every split cuts a 64-token GDN chunk somewhere
    "2-pieces": [70, 80],
    "3-pieces-first-len1": [1, 100, 49],
    "3-pieces-last-len1": [63, 86, 1],
    "7-pieces-len1s": [1, 30, 40, 1, 13, 64, 1],
}


@pytest.fixture(scope="module")
def ar_model():
    return load_model("tiny-ar", seed=5)


@pytest.fixture(scope="module")
def diffusion_model():
    return load_model("tiny", seed=5)


def _ids(B: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (B, n), generator=torch.Generator().manual_seed(seed))


def _run_pieces(model, ids: torch.Tensor, lengths: list[int], **kw) -> tuple[torch.Tensor, CloverState]:
    state, outs, start = None, [], 0
    for n in lengths:
        logits, state = model(ids[:, start:start + n], state, **kw)
        outs.append(logits)
        start += n
    assert start == ids.shape[1]
    return torch.cat(outs, dim=1), state


def assert_states_close(ours: CloverState, ref: CloverState, rtol: float = 1e-4) -> None:
    assert torch.equal(ours.positions, ref.positions)
    for i, (a, b) in enumerate(zip(ours.layers, ref.layers, strict=True)):
        assert type(a) is type(b)
        if isinstance(a, GDNState):
            assert_close(a.recurrent, b.recurrent, rtol, f"layer {i} recurrent")
            assert_close(a.conv, b.conv, rtol, f"layer {i} conv tail")
        else:
            assert torch.equal(a.key_pos, b.key_pos), f"layer {i} key positions"
            assert_close(a.keys, b.keys, rtol, f"layer {i} keys")
            assert_close(a.values, b.values, rtol, f"layer {i} values")


@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
def test_pieces_equal_whole_causal(ar_model, split):
    ids = _ids(2, T)
    whole, whole_state = ar_model(ids)
    pieces, piece_state = _run_pieces(ar_model, ids, SPLITS[split])
    assert_close(pieces, whole, 1e-4, "logits")
    assert_states_close(piece_state, whole_state)
    assert whole_state.positions.tolist() == [T, T]


def test_pieces_equal_whole_diffusion_model_with_causal_attention(diffusion_model):
    ids = _ids(1, T, seed=1)
    whole, whole_state = diffusion_model(ids, attention="causal")
    pieces, piece_state = _run_pieces(diffusion_model, ids, SPLITS["7-pieces-len1s"], attention="causal")
    assert_close(pieces, whole, 1e-4, "logits")
    assert_states_close(piece_state, whole_state)


@pytest.mark.parametrize("lengths", [[8, 136, 8], [64, 16, 8, 8, 56], [72, 80]], ids=lambda v: "-".join(map(str, v)))
def test_block_aligned_pieces_equal_whole_block_causal(diffusion_model, lengths):
    """Block-causal prefill (bidirectional inside 8-token blocks) splits exactly at block boundaries."""
    assert diffusion_model.default_attention() == "block_causal"
    assert diffusion_model.config.diffusion.block_size == 8
    ids = _ids(2, sum(lengths), seed=2)
    whole, whole_state = diffusion_model(ids)
    pieces, piece_state = _run_pieces(diffusion_model, ids, lengths)
    assert_close(pieces, whole, 1e-4, "logits")
    assert_states_close(piece_state, whole_state)


def test_block_causal_sees_later_tokens_of_its_block(diffusion_model):
    """Changing the last token of a block changes the block's earlier logits, but not the previous block's."""
    ids = _ids(1, 16, seed=3)
    other = ids.clone()
    other[0, 15] = (other[0, 15] + 1) % 256
    a, _ = diffusion_model(ids)
    b, _ = diffusion_model(other)
    assert_close(a[:, :8], b[:, :8], 1e-5, "previous block")  # not bitwise: expert groups change sizes
    assert float((a[:, 8:15] - b[:, 8:15]).abs().max()) > 1e-4


def _clone_state(state: CloverState) -> CloverState:
    layers = [GDNState(s.recurrent.clone(), s.conv.clone()) if isinstance(s, GDNState)
              else AttentionState(s.keys.clone(), s.values.clone(), s.key_pos.clone()) for s in state.layers]
    return CloverState(layers, state.positions.clone())


def test_commit_false_leaves_state_untouched(diffusion_model):
    ids = _ids(2, 40, seed=4)
    _, state = diffusion_model(ids[:, :32])
    before = _clone_state(state)
    block = ids[:, 32:]
    logits, returned = diffusion_model(block, state, commit=False)
    assert returned is state
    assert_states_close(state, before, rtol=0.0)  # bit-identical
    # the same step again gives the same logits, and committing it gives what the uncommitted step showed
    again, _ = diffusion_model(block, state, commit=False)
    assert torch.equal(logits, again)
    committed, new_state = diffusion_model(block, state)
    assert torch.equal(logits, committed)
    assert new_state is not state
    assert new_state.positions.tolist() == [40, 40]
    assert_states_close(state, before, rtol=0.0)


@pytest.mark.parametrize("window", [1, 16, 33])
def test_window_drops_old_keys(ar_model, window):
    ids = _ids(1, 120, seed=6)
    full, _ = ar_model(ids)
    windowed, _ = ar_model(ids, window_tokens=window)
    # queries whose whole past fits in the window see exactly what they saw before; later ones differ
    assert_close(windowed[:, :window], full[:, :window], 1e-5, "inside the window")
    assert float((windowed[:, window:] - full[:, window:]).abs().max()) > 1e-3
    # carrying the state under the window gives the same logits, and the cache never outgrows the window
    state, outs = None, []
    for start in range(0, 120, 10):
        logits, state = ar_model(ids[:, start:start + 10], state, window_tokens=window)
        outs.append(logits)
        for layer in state.layers:
            if isinstance(layer, AttentionState):
                assert layer.key_pos.shape[1] == min(window - 1, start + 10)
                assert layer.key_pos[0].tolist() == list(range(start + 10 - layer.key_pos.shape[1], start + 10))
    assert_close(torch.cat(outs, dim=1), windowed, 1e-4, "windowed, in pieces")


def test_config_window_bounds_the_cache():
    model = load_model("tiny-ar", seed=5, overrides={"window_tokens": 24})
    state = None
    for start in range(0, 200, 50):
        _, state = model(_ids(1, 50, seed=start), state)
    caches = [s for s in state.layers if isinstance(s, AttentionState)]
    assert caches and all(c.keys.shape[2] == 23 for c in caches)
    assert state.positions.tolist() == [200]


# bf16 weights and activations vs the same (bf16-rounded) weights run in fp32. Stated tolerance: mean |error| within
# 2% of mean |logit|, max |error| within 8% of max |logit| (the max is set by the odd token whose top-k experts flip
# under bf16 rounding), and the same argmax for at least 95% of positions.
BF16_MEAN_RTOL, BF16_MAX_RTOL, BF16_ARGMAX_AGREE = 2e-2, 8e-2, 0.95


def test_bf16_close_to_fp32():
    bf16 = load_model("tiny", seed=9, dtype=torch.bfloat16)
    fp32 = load_model("tiny", seed=9, dtype=torch.float32)
    fp32.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()}, assign=True)
    ids = _ids(2, 100, seed=9)
    lo16, state16 = bf16(ids)
    lo32, state32 = fp32(ids)
    assert lo16.dtype == torch.bfloat16
    assert not torch.isnan(lo16).any()
    err = (lo16.float() - lo32).abs()
    assert float(err.mean()) <= BF16_MEAN_RTOL * float(lo32.abs().mean())
    assert_close(lo16.float(), lo32, BF16_MAX_RTOL, "logits")
    assert (lo16.float().argmax(-1) == lo32.argmax(-1)).float().mean() >= BF16_ARGMAX_AGREE
    for a, b in zip(state16.layers, state32.layers, strict=True):
        if isinstance(a, GDNState):
            assert a.recurrent.dtype == torch.float32  # the recurrence stays fp32 in a bf16 model
            assert_close(a.recurrent, b.recurrent, BF16_MAX_RTOL, "GDN state")
        else:
            assert a.keys.dtype == torch.bfloat16


def test_bad_forward_arguments_are_clear_errors():
    model = load_model("tiny")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="window_tokens must be >= 1, got 0"):
        model(ids, window_tokens=0)
    with pytest.raises(ValueError, match="keep_logits must be None or >= 0, got -3"):
        model(ids, keep_logits=-3)
    _, state = model(ids)
    with pytest.raises(ValueError, match=r"state was made for torch.float32 on cpu; this model computes in "
                                         r"torch.bfloat16"):
        load_model("tiny", dtype=torch.bfloat16)(ids, state)
    with pytest.raises(ConfigError, match=r"unknown config override\(s\) \['window'\]"):
        load_model("tiny", overrides={"window": 5})
