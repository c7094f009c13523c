"""Training (model/train.py): the block-diffusion forward of a block is the inference denoising step (both
layouts: the trunk's, and Clover's preview with shifted logits), gradients reach the clean pass through the state,
the autoregressive loss and its gradients equal a plain computation, seconds-long CPU runs learn a copy task, and a
resumed run ends where an uninterrupted one does."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from clover_batch.model import generate, load_model
from clover_batch.model.train import (
    Example,
    Phase,
    Saving,
    TokenWeights,
    TrainOptions,
    ar_loss,
    batch_loss,
    batches_by_prefix,
    block_logits,
    diffusion_loss,
    init_for_training,
    layout,
    next_token_targets,
    noise_blocks,
    set_slow_heads,
    train,
    train_phases,
)
from test_model_ops import assert_close

PAD, EOS = 256, 258


def _small_window(preset: str, seed: int):
    model = load_model(preset, seed=seed)
    model.config = model.config.replace(window_tokens=24)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


@pytest.fixture(scope="module")
def tiny_small_window():
    """tiny (block 8) with a 24-token attention window, so prompts here reach past it."""
    return _small_window("tiny", 3)


def _examples(seed: int = 0) -> list[Example]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(21, 12), (5, 30), (16, 3), (40, 20), (3, 1), (64, 17)]  # (prompt, answer) lengths
    return [Example(torch.randint(0, 256, (p,), generator=gen).tolist(),
                    [*torch.randint(0, 256, (a,), generator=gen).tolist(), EOS]) for p, a in shapes]


def test_layout_aligns_blocks_on_absolute_positions():
    lay = layout(Example(list(range(21)), list(range(12))), block_size=8, pad_id=PAD)
    assert lay.prefix == 16 and lay.answer_start == 21
    assert len(lay.tokens) == 40 and lay.tokens[33:] == [PAD] * 7  # 21 + 12 = 33, padded to 5 blocks
    assert lay.blocks == 3  # [16, 24) holds the prompt tail, then [24, 32), [32, 40)
    with pytest.raises(ValueError, match="non-empty"):
        layout(Example([], [1]), 8, PAD)


def test_noise_never_masks_the_prompt_and_masks_every_block():
    lays = [layout(ex, 8, PAD) for ex in _examples()]
    gen = torch.Generator().manual_seed(0)
    nb = noise_blocks(lays, 8, 259, gen, eps=0.2, copies=3)
    assert len(nb.example) == 3 * sum(lay.blocks for lay in lays)
    assert not bool((nb.masked & ~nb.answer).any())  # prompt positions are never masked
    assert bool(nb.masked.any(1).all())  # every block has a masked position
    assert bool(((nb.rate >= 0.2) & (nb.rate < 1.0)).all())
    assert torch.equal(nb.tokens[nb.masked], torch.full((int(nb.masked.sum()),), 259))
    assert torch.equal(nb.tokens[~nb.masked], nb.targets[~nb.masked])
    again = noise_blocks(lays, 8, 259, torch.Generator().manual_seed(0), eps=0.2, copies=3)
    assert torch.equal(again.tokens, nb.tokens)  # seeded
    # the mask rate follows t: over many draws, masked share of answer positions ~ mean(t) = 0.6
    many = noise_blocks(lays * 40, 8, 259, torch.Generator().manual_seed(1), eps=0.2, copies=2)
    share = float(many.masked.sum() / many.answer.sum())
    assert 0.55 < share < 0.68


def test_training_forward_of_a_block_equals_the_denoising_step(tiny_small_window):
    """Each noised block's training logits == (a) the inference path: prefill and committed blocks in
    inference mode, then forward(commit=False) as a denoising step runs; (b) a full recompute of the sequence with
    the noised block in place, no state carried. Prompts of 40 and 64 tokens reach past the 24-token window."""
    model = tiny_small_window
    bs = model.config.diffusion.block_size
    examples = _examples()
    lays = [layout(ex, bs, PAD) for ex in examples]
    noised = noise_blocks(lays, bs, model.config.diffusion.mask_token_id, torch.Generator().manual_seed(4), copies=2)
    with torch.enable_grad():
        logits = block_logits(model, lays, noised)
    assert logits.requires_grad and logits.shape == (len(noised.example), bs, model.config.vocab_size)
    for row, (i, j) in enumerate(zip(noised.example, noised.block, strict=True)):
        lay = lays[i]
        start = lay.prefix + j * bs
        state = None
        if start:  # inference: prefill (block-causal) of the committed prefix, in one piece and block by block
            _, state = model(torch.tensor([lay.tokens[:lay.prefix]]), None) if lay.prefix else (None, None)
            for b in range(j):
                blk = lay.tokens[lay.prefix + b * bs: lay.prefix + (b + 1) * bs]
                _, state = model(torch.tensor([blk]), state, commit=True, attention="block_causal")
        step, _ = model(noised.tokens[row:row + 1], state, commit=False, attention="block_causal")
        assert_close(logits[row].detach(), step[0], 1e-4, f"example {i} block {j}: vs denoising step")
        full, _ = model(torch.tensor([lay.tokens[:start] + noised.tokens[row].tolist()]), None,
                        attention="block_causal")
        assert_close(logits[row].detach(), full[0, -bs:], 1e-4, f"example {i} block {j}: vs full recompute")


def test_gradients_reach_the_prompt_through_the_state(tiny_small_window):
    """Tokens that occur only in the prompt get embedding gradients: the loss reads them through the saved
    attention keys/values and GDN state of the clean pass, never as inputs of a noised block."""
    model = tiny_small_window
    prompt_only = [300, 301, 302, 303]
    ex = Example(prompt_only * 10, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, EOS])  # prompt: 5 whole blocks
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        report = diffusion_loss(model, [ex], torch.Generator().manual_seed(0), copies=2)
        report.loss.backward()
    grad = model.embed_tokens.weight.grad
    assert report.blocks == 2 * 2 and report.answer_tokens == 2 * 16  # 2 blocks (11 answer + 5 padding) x 2 copies
    assert float(grad[prompt_only].abs().sum()) > 0
    assert float(grad[400:].abs().sum()) == 0  # tokens that occur nowhere get none
    model.zero_grad(set_to_none=True)


def test_batches_by_prefix_yields_every_example_once_grouping_equal_prefixes():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 60, (100,), generator=gen).tolist()
    examples = [Example([7] * n + [i % 200], [1, EOS]) for i, n in enumerate(lengths)]  # unique last prompt id
    batches = list(batches_by_prefix(iter(examples), batch_size=8, block_size=8, pool=40))
    seen = sorted(ex.prompt[-1] + 1000 * len(ex.prompt) for b in batches for ex in b)
    assert seen == sorted(ex.prompt[-1] + 1000 * len(ex.prompt) for ex in examples)
    ours = [len({len(ex.prompt) // 8 for ex in b}) for b in batches]
    naive = [len({len(ex.prompt) // 8 for ex in examples[i:i + 8]}) for i in range(0, 100, 8)]
    # each distinct prefix length in a batch costs one prefix forward: far fewer than in arrival order
    assert sum(ours) / len(ours) < 0.5 * sum(naive) / len(naive), (ours, naive)


def test_short_training_run_lowers_the_loss_on_a_copy_task(one_thread):
    """A seconds-long CPU run on a copy task (the answer repeats the prompt's one varying token, 1 of 32, three
    times) takes the held-out loss (fixed batch, fixed noise) from ~ln(vocab) to well below the best loss a model
    ignoring the prompt can reach (3 ln 32 spread over the answer positions): it learned to read the prompt."""
    torch.manual_seed(0)
    model = load_model("tiny", seed=0)
    init_for_training(model, seed=0)

    def copy_examples(seed: int):
        gen = torch.Generator().manual_seed(seed)
        while True:
            x = int(torch.randint(10, 42, (1,), generator=gen))
            yield Example([257, 300, x, 257], [x, x, x, EOS])

    held = [next(ex) for ex in [copy_examples(99)] for _ in range(32)]

    def held_loss():
        with torch.no_grad():
            return diffusion_loss(model, held, torch.Generator().manual_seed(7), copies=4)

    start = held_loss()
    # answer positions per copy of an example: 3 copies of x, EOS and padding; only x is uncertain
    prompt_blind = 3 * math.log(32) / (start.answer_tokens / (32 * 4))
    stream = copy_examples(1)
    batches = iter(lambda: [next(stream) for _ in range(16)], None)
    curve = train(model, batches, TrainOptions(steps=60, lr=1e-2, warmup=5, log_every=20))
    after = float(held_loss().loss)
    assert float(start.loss) > 6.0  # ~ln(512) at initialisation
    assert curve.losses[-1] < curve.losses[0]
    assert after < 0.7 * prompt_blind, (float(start.loss), prompt_blind, after, curve.losses)


def test_init_for_training_scales_only_the_input_embedding():
    base, wide = load_model("tiny", seed=0), load_model("tiny", seed=0)
    init_for_training(base, seed=4)
    init_for_training(wide, seed=4, embedding_std=0.5)
    for (name, a), (_, b) in zip(base.named_parameters(), wide.named_parameters(), strict=True):
        if name == "embed_tokens.weight":
            assert float(a.detach().std()) == pytest.approx(0.02, rel=0.05)
            assert torch.allclose(b, a * 25, rtol=1e-5), name  # the same draw, scaled
        else:
            assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="embedding_std"):
        init_for_training(base, seed=4, embedding_std=0.0)


# ---- the autoregressive loss and Clover's layout ---------------------------------------------------------------


@pytest.fixture(scope="module")
def clover_small_window():
    """tiny-clover (Clover's layout: causal trunk, preview operator, shifted logits; block 8) with a 24-token window."""
    return _small_window("tiny-clover", 5)


def _plain_ar_loss(model, examples, weights: TokenWeights) -> torch.Tensor:
    """The autoregressive loss written out independently: each sequence alone (no padding), log-softmax and gather
    by hand, weights summed over the batch."""
    total, norm = torch.zeros(()), 0.0
    for ex in examples:
        seq = ex.prompt + ex.answer
        logits, _ = model.forward_train(torch.tensor([seq]), None, attention="causal")
        logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
        for t in range(1, len(seq)):
            w = weights.prompt if t < len(ex.prompt) else weights.answer
            total = total - w * logp[t - 1, seq[t]]
            norm += w
    return total / norm


def test_ar_loss_and_gradients_equal_a_plain_computation(clover_small_window):
    """ar_loss (one padded causal forward, weighted) == the loss written out per sequence, in value and in every
    parameter's gradient; a finite difference along the gradient agrees; the preview-only tensors get no gradient
    (the autoregressive loss runs the trunk only). Sequences reach past the 24-token window."""
    model = clover_small_window
    examples, weights = _examples(1), TokenWeights(prompt=0.5, answer=3.0)
    with torch.enable_grad():
        model.zero_grad(set_to_none=True)
        report = ar_loss(model, examples, weights)
        report.loss.backward()
        ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        plain = _plain_ar_loss(model, examples, weights)
        plain.backward()
        theirs = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    assert float(report.loss.detach()) == pytest.approx(float(plain.detach()), rel=1e-5)
    assert report.ar == pytest.approx(float(report.loss.detach()))
    assert set(ours) == set(theirs)
    assert not any(k in n for n in ours for k in ("conv_right_weight", "bd_softmax"))
    assert "embed_tokens.weight" in ours and "lm_head.weight" in ours
    for name, g in ours.items():
        assert_close(g, theirs[name], 1e-3, name)
    # d loss along the unit gradient direction == |grad|, by central differences
    params = [p for n, p in model.named_parameters() if n in ours]
    direction = [ours[n] for n, p in model.named_parameters() if n in ours]
    norm = math.sqrt(sum(float((d * d).sum()) for d in direction))
    h = 2e-3
    with torch.no_grad():
        values = []
        for sign in (1, -1):
            for p, d in zip(params, direction, strict=True):
                p.add_(sign * h * d / norm)
            values.append(float(ar_loss(model, examples, weights).loss))
            for p, d in zip(params, direction, strict=True):
                p.sub_(sign * h * d / norm)
    assert (values[0] - values[1]) / (2 * h) == pytest.approx(norm, rel=0.02)


def test_a_phase_window_is_the_attention_window_of_its_forwards(clover_small_window):
    """TrainOptions.window_tokens: an autoregressive phase at a 4-token window computes the loss of forwards at that
    window (the plain per-sequence loss with forward_train(window_tokens=4)), not the model's 24; the model's
    config is untouched; Example.window_tokens sets one example's window beside others'; a block-diffusion phase or
    loss with a window of its own, or a negative window, is refused."""
    model = clover_small_window
    examples, weights = _examples(2), TokenWeights(prompt=1.0, answer=3.0)
    narrow = TrainOptions(steps=1, ar_weight=1.0, bd_weight=0.0, weights=weights, window_tokens=4)
    with torch.no_grad():
        ours = float(batch_loss(model, examples, torch.Generator(), narrow).loss)
        full = float(batch_loss(model, examples, torch.Generator(),
                                TrainOptions(steps=1, ar_weight=1.0, bd_weight=0.0, weights=weights)).loss)
        total, norm = 0.0, 0.0
        for ex in examples:
            seq = ex.prompt + ex.answer
            logits, _ = model.forward_train(torch.tensor([seq]), None, attention="causal", window_tokens=4)
            logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
            for t in range(1, len(seq)):
                w = weights.prompt if t < len(ex.prompt) else weights.answer
                total -= w * float(logp[t - 1, seq[t]])
                norm += w
    assert full == pytest.approx(float(ar_loss(model, examples, weights).loss), rel=1e-6)
    # random weights score every token alike, so the windows differ by little (sequences of up to 81 tokens), but
    # by far more than the batched loss differs from the plain one at its own window
    assert abs(ours - total / norm) < abs(ours - full) / 20
    assert model.config.window_tokens == 24
    # examples that carry their own window (Example.window_tokens) beside ones that do not, in one batch: each at
    # its own, the phase's window for the rest, one weighted mean over all
    mixed = [dataclasses.replace(ex, window_tokens=4) if i % 2 else ex for i, ex in enumerate(examples)]
    with torch.no_grad():
        ours = float(ar_loss(model, mixed, weights, window_tokens=9).loss)
        total, norm = 0.0, 0.0
        for ex in mixed:
            seq = ex.prompt + ex.answer
            logits, _ = model.forward_train(torch.tensor([seq]), None, attention="causal",
                                            window_tokens=ex.window_tokens or 9)
            logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
            for t in range(1, len(seq)):
                w = weights.prompt if t < len(ex.prompt) else weights.answer
                total -= w * float(logp[t - 1, seq[t]])
                norm += w
        at_9 = float(ar_loss(model, examples, weights, window_tokens=9).loss)
    assert abs(ours - total / norm) < abs(ours - at_9) / 20
    with pytest.raises(ValueError, match="trains autoregressively only"):
        diffusion_loss(model, mixed, torch.Generator(), ar_weight=0.5)
    with pytest.raises(ValueError, match="block-diffusion phase"):
        TrainOptions(steps=1, window_tokens=4)
    with pytest.raises(ValueError, match="window_tokens must be >= 0"):
        TrainOptions(steps=1, ar_weight=1.0, bd_weight=0.0, window_tokens=-1)


def test_ar_loss_weights_tokens_and_refuses_an_unshifted_model(tiny_small_window, clover_small_window):
    ids, targets, weight = next_token_targets([Example([5, 6, 7], [8, EOS])], TokenWeights(1.0, 3.0), 7, PAD)
    assert ids.tolist() == [[5, 6, 7, 8, EOS, PAD, PAD]]
    assert targets.tolist() == [[6, 7, 8, EOS, PAD, PAD, PAD]]
    assert weight.tolist() == [[1.0, 1.0, 3.0, 3.0, 0.0, 0.0, 0.0]]  # 6, 7: prompt; 8, EOS: answer; then nothing
    with pytest.raises(ValueError, match="next token"):
        ar_loss(tiny_small_window, _examples())  # the trunk layout predicts a position from itself
    with pytest.raises(ValueError, match="not both 0"):
        TokenWeights(0.0, 0.0)


def test_clover_diffusion_logits_are_what_inference_reads(clover_small_window):
    """Clover's layout: each noised block's training logits, shifted as the decoder reads them, == the
    generate_nocache computation of the same step: one causal forward over everything committed before the block
    (its last logits predict the block's position 0), then a preview of the noised block from that state (its
    logits at j - 1 predict position j). The clean pass gets there by prefix + block-by-block commits instead."""
    model = clover_small_window
    d = model.config.diffusion
    bs = d.block_size
    examples = _examples(2)
    lays = [layout(ex, bs, PAD) for ex in examples]
    noised = noise_blocks(lays, bs, d.mask_token_id, torch.Generator().manual_seed(6), copies=2)
    with torch.enable_grad():
        logits = block_logits(model, lays, noised)
    assert logits.requires_grad and logits.shape == (len(noised.example), bs, model.config.vocab_size)
    for row, (i, j) in enumerate(zip(noised.example, noised.block, strict=True)):
        lay = lays[i]
        start = lay.prefix + j * bs
        committed = lay.tokens[:start]
        state, last = None, torch.zeros(model.config.vocab_size)
        if committed:
            clean, state = model(torch.tensor([committed]), None, attention="causal")
            last = clean[0, -1]
        preview, _ = model(noised.tokens[row:row + 1], state, preview=True)
        expected = torch.cat([last[None], preview[0, :-1]])
        assert_close(logits[row].detach(), expected, 1e-4, f"example {i} block {j}")


def test_clover_diffusion_loss_with_ar_share(clover_small_window):
    """diffusion_loss with ar_weight: the clean pass's logits give the autoregressive loss of the same sequences
    (== ar_loss), the total is bd_weight * bd + ar_weight * ar, and the preview tensors get gradients."""
    model = clover_small_window
    examples, weights = _examples(3), TokenWeights(1.0, 3.0)
    with torch.enable_grad():
        model.zero_grad(set_to_none=True)
        report = diffusion_loss(model, examples, torch.Generator().manual_seed(0), copies=2, ar_weight=0.3,
                                bd_weight=2.0, weights=weights)
        report.loss.backward()
    alone = diffusion_loss(model, examples, torch.Generator().manual_seed(0), copies=2)
    assert report.ar == pytest.approx(float(ar_loss(model, examples, weights).loss), rel=1e-4)
    assert report.bd == pytest.approx(alone.bd, rel=1e-5)
    assert float(report.loss) == pytest.approx(2.0 * report.bd + 0.3 * report.ar, rel=1e-5)
    for n, p in model.named_parameters():
        if "conv_right_weight" in n or "bd_softmax" in n:
            assert p.grad is not None and float(p.grad.abs().sum()) > 0, n
    model.zero_grad(set_to_none=True)


def _copy_examples(seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        x = int(torch.randint(10, 42, (1,), generator=gen))
        yield Example([257, 300, x, 257], [x, x, x, EOS])


def test_short_autoregressive_run_learns_the_copy_task(one_thread):
    """A seconds-long autoregressive run (Clover's layout, answer tokens weighted 3x) learns to copy the prompt's
    varying token: greedy autoregressive decoding of held-out prompts repeats it, which a model that ignores the
    prompt does for 1 in 32."""
    torch.manual_seed(0)
    model = load_model("tiny-clover", seed=0)
    init_for_training(model, seed=0, embedding_std=0.5)
    stream = _copy_examples(1)
    batches = iter(lambda: [next(stream) for _ in range(16)], None)
    curve = train(model, batches, TrainOptions(steps=60, lr=1e-2, warmup=5, log_every=20, ar_weight=1.0,
                                               bd_weight=0.0))
    held = list(itertools.islice(_copy_examples(99), 32))
    gens = generate(model, [ex.prompt for ex in held], max_new_tokens=3, temperature=0.0, mode="autoregressive")
    right = sum(g.tokens == ex.answer[:3] for ex, g in zip(held, gens, strict=True))
    assert curve.losses[-1] < 0.5 * curve.losses[0], curve.losses
    assert right >= 28, (right, curve.losses)
    # a trained trunk beside an untrained preview (drafts rejected): verified decoding is the trunk's output
    verified = generate(model, [ex.prompt for ex in held], max_new_tokens=3, mode="verified", tokens_per_step=2)
    assert [g.tokens for g in verified] == [g.tokens for g in gens]
    assert sum(g.verified_blocks - g.full_blocks for g in verified) > 0


def _stop_at(when: tuple[str, int]):
    def on_log(name, step, report, seconds):
        if (name, step) == when:
            raise KeyboardInterrupt

    return on_log


def test_phase_two_adapts_the_autoregressive_model_to_block_diffusion(tmp_path, one_thread):
    """The recipe's two phases on the copy task (Clover's layout): after phase 1 (autoregressive) the trunk copies
    but block-diffusion decoding does not (the preview was never trained); phase 2 (block diffusion from the
    phase-1 weights, half the autoregressive loss kept) teaches the preview to copy, at threshold 0.9 and with the
    whole answer in one forward, and the trunk still copies."""
    torch.manual_seed(0)
    model = load_model("tiny-clover", seed=0)
    init_for_training(model, seed=0, embedding_std=0.5)
    held = list(itertools.islice(_copy_examples(99), 32))

    def copied(**decode) -> int:
        gens = generate(model, [ex.prompt for ex in held], max_new_tokens=4, temperature=0.0, **decode)
        return sum(g.tokens[:3] == ex.answer[:3] for ex, g in zip(held, gens, strict=True))

    def batches(k: int):
        stream = _copy_examples(1 + k)
        return iter(lambda: [next(stream) for _ in range(16)], None)

    ar = Phase("ar", TrainOptions(steps=60, lr=1e-2, warmup=5, log_every=20, ar_weight=1.0, bd_weight=0.0))
    bd = Phase("bd", TrainOptions(steps=40, lr=5e-3, warmup=3, log_every=5, ar_weight=0.5, seed=1))
    saving = Saving(tmp_path / "state.pt", every=1000)  # saves at the end of each phase only
    with pytest.raises(KeyboardInterrupt):  # stopped as phase 2 starts: phase 1 is saved
        train_phases(model, [ar, bd], batches, saving=saving, on_log=_stop_at(("bd", 5)))
    model.load_state_dict(torch.load(saving.path, weights_only=True)["model"])
    after_ar = {"ar": copied(mode="autoregressive"), "t0.9": copied(threshold=0.9)}
    assert after_ar["ar"] >= 28 and after_ar["t0.9"] <= 4, after_ar  # measured 32 and 0

    logs = train_phases(model, [ar, bd], batches, saving=saving)  # phase 2 from the saved phase-1 weights
    after = {"ar": copied(mode="autoregressive"), "t0.9": copied(threshold=0.9), "k4": copied(tokens_per_step=4)}
    assert logs[1].bd[-1] < 0.3 * logs[1].bd[0], logs[1].bd
    # measured 32, 32 and 29 of 32; a model that ignores the prompt copies 1 in 32
    assert after["ar"] >= 28 and after["t0.9"] >= 28 and after["k4"] >= 24, after


def _phases_run(saving, interrupt=None, bd_steps: int = 4) -> tuple[dict, list]:
    torch.manual_seed(0)
    model = load_model("tiny-clover", seed=0)
    init_for_training(model, seed=0, embedding_std=0.5)
    plan = [Phase("ar", TrainOptions(steps=5, lr=1e-2, warmup=2, log_every=1, ar_weight=1.0, bd_weight=0.0)),
            Phase("bd", TrainOptions(steps=bd_steps, lr=5e-3, warmup=1, log_every=1, ar_weight=0.5, seed=3))]

    def batches(k: int):
        stream = _copy_examples(10 + k)
        return iter(lambda: [next(stream) for _ in range(4)], None)

    logs = train_phases(model, plan, batches, saving=saving, on_log=_stop_at(interrupt) if interrupt else None)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}, logs


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, one_thread):
    """Two phases (autoregressive, then block diffusion with an AR share), saved every 2 steps: runs killed in
    phase 1 (step 3: resumes from 2) and in phase 2 (step 3: resumes from 2), each resumed by a fresh process's
    worth of objects, end with exactly the weights and loss curves of a run never interrupted."""
    whole, whole_logs = _phases_run(None)
    for interrupt in (("ar", 3), ("bd", 3)):
        saving = Saving(tmp_path / f"{interrupt[0]}" / "state.pt", every=2)
        with pytest.raises(KeyboardInterrupt):
            _phases_run(saving, interrupt)
        assert saving.path.exists()
        resumed, logs = _phases_run(saving)
        for name, value in whole.items():
            assert torch.equal(value, resumed[name]), (interrupt, name)
        assert [lg.losses for lg in logs] == [lg.losses for lg in whole_logs]
        assert [lg.steps for lg in logs] == [[1, 2, 3, 4, 5], [1, 2, 3, 4]]
    other = Saving(tmp_path / "ar" / "state.pt", every=2)
    with pytest.raises(ValueError, match="other phases"):
        torch.manual_seed(0)
        model = load_model("tiny-clover", seed=0)
        train_phases(model, [Phase("ar", TrainOptions(steps=7, ar_weight=1.0, bd_weight=0.0))],
                     lambda k: iter(()), saving=other)


def test_a_phase_not_started_may_change_on_resume(tmp_path, one_thread):
    """Stopped at the start of phase 2 (the last save is phase 1's end), the run resumes with a longer phase 2 and
    ends as a run that had that phase 2 from the start; a resume that changes phase 1 is refused."""
    saving = Saving(tmp_path / "state.pt", every=100)  # saves at phase ends only
    with pytest.raises(KeyboardInterrupt):
        _phases_run(saving, ("bd", 1))
    resumed, logs = _phases_run(saving, bd_steps=6)
    whole, whole_logs = _phases_run(None, bd_steps=6)
    for name, value in whole.items():
        assert torch.equal(value, resumed[name]), name
    assert [lg.steps for lg in logs] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]]
    assert [lg.losses for lg in logs] == [lg.losses for lg in whole_logs]
    with pytest.raises(ValueError, match="other phases"):
        torch.manual_seed(0)
        model = load_model("tiny-clover", seed=0)
        train_phases(model, [Phase("ar", TrainOptions(steps=7, ar_weight=1.0, bd_weight=0.0)),
                             Phase("bd", TrainOptions(steps=6))], lambda k: iter(()), saving=saving)


def test_a_run_saved_before_an_option_existed_resumes(tmp_path, one_thread):
    """A state file whose phases lack an option added to TrainOptions since (window_tokens: a run saved by an older
    version) resumes as if it had the option at its default, and ends as an uninterrupted run; one whose saved
    option is not the default is refused."""
    saving = Saving(tmp_path / "state.pt", every=100)
    with pytest.raises(KeyboardInterrupt):
        _phases_run(saving, ("bd", 1))
    state = torch.load(saving.path, weights_only=True)
    for phase in state["phases"]:
        del phase["options"]["window_tokens"]
    torch.save(state, saving.path)
    resumed, logs = _phases_run(saving)
    whole, whole_logs = _phases_run(None)
    assert all(torch.equal(value, resumed[name]) for name, value in whole.items())
    assert [lg.losses for lg in logs] == [lg.losses for lg in whole_logs]
    state["phases"][0]["options"]["window_tokens"] = 8
    torch.save(state, saving.path)
    with pytest.raises(ValueError, match="other phases"):
        _phases_run(saving)


def test_slow_heads_are_set_at_a_phase_start_and_held_through_its_steps(tmp_path, one_thread):
    """TrainOptions.slow_heads: the last n value heads of every GDN layer decay by exactly exp(-slow_dt) a token
    whatever the input, from the phase's first step to its last (their decay parameters get no gradient), while
    the other heads' decays train; a run resumed in the middle ends with the uninterrupted run's weights."""
    dt = 5e-4

    def run(saving=None, interrupt=None):
        torch.manual_seed(0)
        model = load_model("tiny-clover", seed=0)
        init_for_training(model, seed=0, embedding_std=0.5)
        plan = [Phase("ar", TrainOptions(steps=3, lr=1e-2, warmup=1, log_every=1, ar_weight=1.0, bd_weight=0.0)),
                Phase("long", TrainOptions(steps=4, lr=1e-2, warmup=1, log_every=1, ar_weight=1.0, bd_weight=0.0,
                                           slow_heads=1, slow_dt=dt))]

        def batches(k: int):
            stream = _copy_examples(20 + k)
            return iter(lambda: [next(stream) for _ in range(4)], None)

        train_phases(model, plan, batches, saving=saving, on_log=_stop_at(interrupt) if interrupt else None)
        return model

    init = load_model("tiny-clover", seed=0)
    init_for_training(init, seed=0, embedding_std=0.5)
    model = run()
    gdns = [(layer.linear_attn, start.linear_attn) for layer, start in zip(model.layers, init.layers, strict=True)
            if layer.kind == "linear_attention"]
    assert gdns
    for gdn, start in gdns:
        H = gdn.Hv
        assert torch.equal(gdn.A_log[H - 1:], torch.zeros(1))
        assert gdn.dt_bias[H - 1].item() == pytest.approx(math.log(math.expm1(dt)))
        assert torch.equal(gdn.in_proj_a.weight[H - 1:], torch.zeros_like(gdn.in_proj_a.weight[H - 1:]))
        assert not torch.equal(gdn.in_proj_a.weight[:H - 1], start.in_proj_a.weight[:H - 1])  # the others train
        x = torch.randn(2, 9, model.config.hidden_size)
        with torch.no_grad():
            g = gdn._project(x).g  # log-decay per token [B, T, Hv]
        assert torch.allclose(g[..., H - 1], torch.full_like(g[..., H - 1], -dt), rtol=1e-5)
        assert (g[..., :H - 1] < -dt).any()  # the free heads decay faster somewhere
    saving = Saving(tmp_path / "state.pt", every=1)
    with pytest.raises(KeyboardInterrupt):
        run(saving, ("long", 2))
    resumed = run(saving)
    for name, value in model.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    with pytest.raises(ValueError, match=r"slow_heads must be in 1\.\.4"):
        set_slow_heads(model, 5, dt)
    with pytest.raises(ValueError, match="slow_dt"):
        TrainOptions(steps=1, slow_heads=1, slow_dt=0.0)


def test_an_aux_loss_is_added_to_every_step_and_trains_what_it_depends_on(one_thread):
    """train_phases(aux_loss=): a constant term shifts every logged loss by exactly itself and leaves the weights
    those of a run without it; a term on the GDN layers' write-strength weights (bench/long_drill_probe.py's
    penalty on beta acts on them) pushes every one of them down against the run without it."""

    def run(aux=None):
        torch.manual_seed(0)
        model = load_model("tiny-clover", seed=0)
        init_for_training(model, seed=0, embedding_std=0.5)
        plan = [Phase("ar", TrainOptions(steps=3, lr=1e-2, warmup=1, log_every=1, ar_weight=1.0, bd_weight=0.0,
                                         weight_decay=0.0))]
        stream = _copy_examples(30)
        logs = train_phases(model, plan, lambda k: iter(lambda: [next(stream) for _ in range(4)], None),
                            aux_loss=None if aux is None else lambda batch: aux(model, batch))
        return model, logs[0].losses

    plain, losses = run()
    shifted, shifted_losses = run(lambda model, batch: torch.tensor(0.25 * len(batch)))
    assert shifted_losses == pytest.approx([x + 1.0 for x in losses], abs=1e-6)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, shifted.state_dict()[name]), name

    def beta_sum(model, batch):
        return sum(layer.linear_attn.in_proj_b.weight.sum() for layer in model.layers
                   if layer.kind == "linear_attention")

    pushed, _ = run(beta_sum)
    for layer, ref in zip(pushed.layers, plain.layers, strict=True):
        if layer.kind == "linear_attention":  # descending on sum(w) lowers every weight against the plain run
            assert bool((layer.linear_attn.in_proj_b.weight < ref.linear_attn.in_proj_b.weight).all())
