"""Block-diffusion training (model/train.py): the training forward of a block is the inference denoising step,
gradients reach the clean pass through the state, and a seconds-long CPU run lowers the loss on a copy task."""

from __future__ import annotations

import math

import pytest
import torch
from clover_batch.model import load_model
from clover_batch.model.train import (
    Example,
    TrainOptions,
    batches_by_prefix,
    block_logits,
    diffusion_loss,
    init_for_training,
    layout,
    noise_blocks,
    train,
)
from test_model_ops import assert_close

PAD, EOS = 256, 258


@pytest.fixture(scope="module")
def tiny_small_window():
    """tiny (block 8) with a 24-token attention window, so prompts here reach past it."""
    model = load_model("tiny", seed=3)
    model.config = model.config.replace(window_tokens=24)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


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
            assert float(a.std()) == pytest.approx(0.02, rel=0.05)
            assert torch.allclose(b, a * 25, rtol=1e-5), name  # the same draw, scaled
        else:
            assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="embedding_std"):
        init_for_training(base, seed=4, embedding_std=0.0)
