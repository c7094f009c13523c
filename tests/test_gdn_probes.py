"""bench/long_drill_probe.py's addressing diagnostic finds a look-up where one is built into a GDN layer, at the
offset where it is built, and its log-write penalty catches every operations log and nothing else."""

from __future__ import annotations

import pytest
import torch
from clover_batch.jobs.demo_model import DEMO_DIR, IM_END_ID, PairMaker, job_instructions
from clover_batch.model import load_model
from clover_batch.model.train import ar_loss, set_slow_heads

BENCH = DEMO_DIR.parents[2] / "bench"


@pytest.fixture(scope="module")
def probe():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        import long_drill_probe
    return long_drill_probe


def _lookup_model(key_tap: int):
    """The demo checkpoint with layer 0's second key head (value heads 2 and 3) rebuilt as an associative look-up:
    query and key are the same random projection of a token, the query's conv tap on the current token and the
    key's on token `key_tap` back; beta 0.5 and a slow fixed decay for those heads."""
    model = load_model(DEMO_DIR, dtype=torch.float32)
    set_slow_heads(model, 2, 5e-4)
    gdn = model.layers[0].linear_attn
    R = torch.randn(gdn.Dk, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    q_rows = slice(gdn.Dk, 2 * gdn.Dk)  # key head 1's query channels
    k_rows = slice(gdn.key_dim + gdn.Dk, gdn.key_dim + 2 * gdn.Dk)  # and its key channels
    K = gdn.conv1d.weight.shape[-1]
    with torch.no_grad():
        gdn.in_proj_qkv.weight[q_rows] = R
        gdn.in_proj_qkv.weight[k_rows] = R
        gdn.conv1d.weight[q_rows] = 0.0
        gdn.conv1d.weight[q_rows, 0, K - 1] = 1.0  # the current token
        gdn.conv1d.weight[k_rows] = 0.0
        gdn.conv1d.weight[k_rows, 0, K - 1 - key_tap] = 1.0
        gdn.in_proj_b.weight[gdn.Hv - 2:] = 0.0  # beta = sigmoid(0) = 0.5
    return model.eval()


def _previous_unique(probe, held) -> list[bool]:
    """Per (drill, held head, answer token after the first), in `addressing`'s order: whether the token before it is
    the only one of its kind before a position of the list (a key made from it then matches no other position)."""
    flags = []
    for ex, _ in held:
        answer, start = ex.answer[:-1], probe.list_start(ex)
        assert start is not None
        before = list(ex.prompt[start - 1:start + len(answer) - 1])
        flags += [before.count(before[j]) == 1 for j in range(1, len(answer))] * 2
    return flags


def test_addressing_finds_a_built_in_look_up_at_its_offset(probe, one_thread):
    maker = PairMaker(str(DEMO_DIR), job_instructions())
    held = [probe.recipe_drill(maker, seed) for seed in probe.HELD_OUT_RECIPE_DRILLS[:12]]
    unique = _previous_unique(probe, held)
    # the key written at a list position made from the token before it: the query of the token just copied finds
    # the position holding the next one, first among the list's positions wherever that token is unique there
    # (an amount's repeated digits tie, and the later of two equal keys wins by its shorter decay)
    built = probe.addressing(_lookup_model(key_tap=1), maker, held, 2)[(0, False)]
    assert len(built) == len(unique) and sum(unique) >= 50
    assert all(rank == 0 for (rank, _, _), alone in zip(built, unique, strict=True) if alone)
    right = sum(rank == 0 for rank, _, _ in built) / len(built)
    chance = sum(1 / n for _, n, _ in built) / len(built)
    assert right > 4 * chance, (right, chance)
    # the key made from its own token: the query finds the position holding the token just copied, one back
    shifted = probe.addressing(_lookup_model(key_tap=0), maker, held, 2)[(0, False)]
    assert not any(rank == 0 for (rank, _, _), alone in zip(shifted, unique, strict=True) if alone)
    assert all(offset == -1 for (_, _, offset), alone in zip(shifted, unique, strict=True) if alone)
    lines = probe.addressing_lines({(0, False): built})
    assert len(lines) == 1 and lines[0].startswith(f"layer 0, the rest ({len(built)}): right position first "
                                                   f"{right:.2f} (chance {chance:.2f})"), lines


def test_the_log_write_penalty_covers_each_operations_log_and_no_other_token(probe, one_thread):
    from clover_batch.jobs.demo_corpus import make_document

    model = load_model(DEMO_DIR, dtype=torch.float32).train()
    for p in model.parameters():
        p.requires_grad_(True)
    maker = PairMaker(str(DEMO_DIR), job_instructions())
    writes = probe.LogWrites(model, maker, 2)
    long_doc = make_document(11, long=True)
    batch = [maker.example(long_doc, "extract"), maker.example(make_document(12, long=False), "summarize"),
             probe.recipe_drill(maker, 5)[0]]
    spans = [writes.log_span(ex.prompt) for ex in batch]
    assert spans[1] is None  # a short document has no log
    for ex, span in zip(batch, spans, strict=True):
        if span is None:
            continue
        start, end = span
        assert maker.builder.decode(ex.prompt[start:end]).startswith("Operations log\nDay 1, ")
        assert "Operations log" not in maker.builder.decode(ex.prompt[:start])
        assert ex.prompt[end] == IM_END_ID and IM_END_ID not in ex.prompt[start:end]  # the user message's end
    assert maker.builder.decode(batch[0].prompt[spans[0][0]:spans[0][1]]).strip() == \
        long_doc.text[long_doc.text.index("Operations log"):].strip()
    with torch.enable_grad():
        ar_loss(model, batch)  # the hooks catch the held heads' beta in a training forward
        penalty = writes.penalty(batch)
        penalty.backward()
    # the mean over both GDN layers' held heads at every log position of the two examples with one
    caught = []
    for gdn in (layer.linear_attn for layer in model.layers if layer.kind == "linear_attention"):
        x = None

        def grab(mod, inp, out):
            nonlocal x
            x = inp[0]

        hook = gdn.register_forward_hook(grab)
        with torch.no_grad():
            for i in (0, 2):
                ar_loss(model, [batch[i]])
                beta = gdn._project(x).beta[0, spans[i][0]:spans[i][1], gdn.Hv - 2:]
                caught.append(beta.reshape(-1))
        hook.remove()
    assert float(penalty.detach()) == pytest.approx(float(torch.cat(caught).mean()), rel=1e-4)
    grads = [layer.linear_attn.in_proj_b.weight.grad for layer in model.layers if layer.kind == "linear_attention"]
    assert all(bool(grad[-2:].abs().sum() > 0) for grad in grads)
    # the last GDN layer's other heads write nothing the penalty reads (layer 0's do: they feed layer 2's input)
    assert torch.equal(grads[-1][:-2], torch.zeros_like(grads[-1][:-2]))
