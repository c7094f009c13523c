"""Block-diffusion training through the model's own layers and explicit state (SDAR / BD3-LM style).

One training sequence is `prompt + answer`, the answer ending with a stop token and padded with `pad_id` to the
end of its last block, blocks aligned on absolute multiples of block_size exactly as generation lays them out
(the prompt's tail opens the first answer block).

    clean pass:  prompt up to its last whole block (one forward, block-causal, commit=True)
                 -> each answer block but the last (forward of [rows, block_size], commit=True),
                 keeping the committed state *before* every answer block
    noised pass: every answer block (x `noise_copies`), its answer positions masked at rate t ~ U(eps, 1) per
                 block (prompt positions never), run from its saved state as one batch: forward(commit=False,
                 attention="block_causal"), which is exactly a denoising step of generation
    loss:        cross-entropy on masked positions, weighted 1/t, summed and divided by the answer positions of
                 the noised blocks; a masked position is predicted from its own hidden state (no logit shift)

Gradients reach the clean pass through the saved states (attention keys/values and GDN recurrent/conv state),
so the model learns to write into the state what later blocks read from it, across windows as at inference.

Shapes: B sequences, N noised blocks, L block size, V vocabulary.

Notable choices:
- Prompts are grouped by their block-aligned prefix length, one prefix forward per group: equal lengths batch
  without padding (padding would run through the GDN recurrence and change the state). `batches_by_prefix`
  forms such batches from a stream of examples.
- Every noised block has at least one masked position (a block drawn with none would carry no signal).
- `init_for_training` sets the GDN decays as Mamba-2 / flash-linear-attention initialise them (step sizes
  log-uniform in [0.001, 0.1]); the checkpoint-shaped init (`dt_bias` = 1) forgets within a few tokens, which a
  model that must carry a document's facts across windows cannot start from.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .clover import CloverModel
from .state import CloverState
from .weights import INIT_STD, init_random_weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    """One training pair, token ids only."""

    prompt: list[int]
    answer: list[int]  # the target continuation, ending with a stop token


@dataclass(frozen=True)
class Layout:
    """Where an example's answer blocks lie in its padded token sequence."""

    tokens: list[int]  # prompt + answer + padding to the end of the last block
    prefix: int  # prompt tokens before the first answer block (a multiple of block_size)
    answer_start: int  # first answer position (= len(prompt))
    blocks: int  # answer blocks


def layout(example: Example, block_size: int, pad_id: int) -> Layout:
    if not example.prompt or not example.answer:
        raise ValueError("a training example needs a non-empty prompt and answer")
    prefix = (len(example.prompt) // block_size) * block_size
    tokens = list(example.prompt) + list(example.answer)
    end = math.ceil(len(tokens) / block_size) * block_size
    tokens += [pad_id] * (end - len(tokens))
    return Layout(tokens, prefix, len(example.prompt), (end - prefix) // block_size)


@dataclass
class NoisedBlocks:
    """The noised copies of every answer block of a batch, one row each."""

    example: list[int]  # [N] index of the example in the batch
    block: list[int]  # [N] answer block index (0 = the block holding the prompt's tail)
    tokens: torch.Tensor  # [N, L] the block with masked positions replaced by the mask id
    targets: torch.Tensor  # [N, L] the clean block
    masked: torch.Tensor  # [N, L] bool
    answer: torch.Tensor  # [N, L] bool: positions after the prompt (the only ones ever masked)
    rate: torch.Tensor  # [N] the mask rate t drawn for the block


def noise_blocks(layouts: list[Layout], block_size: int, mask_id: int, generator: torch.Generator, *,
                 eps: float = 0.1, copies: int = 1) -> NoisedBlocks:
    """Draw t ~ U(eps, 1) per block and copy, mask each answer position with probability t (at least one)."""
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    rows_ex, rows_blk, clean, answer = [], [], [], []
    for i, lay in enumerate(layouts):
        for j in range(lay.blocks):
            start = lay.prefix + j * block_size
            blk = lay.tokens[start:start + block_size]
            ans = [start + p >= lay.answer_start for p in range(block_size)]
            for _ in range(copies):
                rows_ex.append(i)
                rows_blk.append(j)
                clean.append(blk)
                answer.append(ans)
    targets = torch.tensor(clean, dtype=torch.long)
    answer_NL = torch.tensor(answer, dtype=torch.bool)
    N = targets.shape[0]
    rate = eps + (1.0 - eps) * torch.rand(N, generator=generator)
    masked = (torch.rand(N, block_size, generator=generator) < rate[:, None]) & answer_NL
    # a block drawn with nothing masked gets its one masked position at random among its answer positions
    empty = ~masked.any(1)
    if bool(empty.any()):
        scores = torch.rand(N, block_size, generator=generator).masked_fill(~answer_NL, -1.0)
        pick = scores.argmax(1)
        masked[empty, pick[empty]] = True
    tokens = targets.masked_fill(masked, mask_id)
    return NoisedBlocks(rows_ex, rows_blk, tokens, targets, masked, answer_NL, rate)


def clean_states(model: CloverModel, layouts: list[Layout], block_size: int) -> list[list[CloverState]]:
    """The committed state before each answer block of each example: states[i][j] (batch of one).

    The prompt prefix runs once per group of equal prefix length; answer blocks then run for all examples
    together, one [rows, block_size] forward per block index, each row at its own position.
    """
    B = len(layouts)
    current: list[CloverState | None] = [None] * B
    groups: dict[int, list[int]] = {}
    for i, lay in enumerate(layouts):
        groups.setdefault(lay.prefix, []).append(i)
    for prefix, rows in groups.items():
        if prefix == 0:
            for i in rows:
                current[i] = model.empty_state(1)
            continue
        ids = torch.tensor([layouts[i].tokens[:prefix] for i in rows], device=model.device)
        _, state = model.forward_train(ids, None, commit=True, attention="block_causal", keep_logits=0)
        for r, i in enumerate(rows):
            current[i] = state.select([r])
    states: list[list[CloverState]] = [[] for _ in range(B)]
    for j in range(max(lay.blocks for lay in layouts)):
        rows = [i for i in range(B) if layouts[i].blocks > j]
        for i in rows:
            states[i].append(current[i])  # type: ignore[arg-type]
        going_on = [i for i in rows if layouts[i].blocks > j + 1]  # the last block's state is never read
        if not going_on:
            continue
        ids = torch.tensor([layouts[i].tokens[layouts[i].prefix + j * block_size:
                                              layouts[i].prefix + (j + 1) * block_size] for i in going_on],
                           device=model.device)
        _, state = model.forward_train(ids, CloverState.concat([current[i] for i in going_on]),  # type: ignore
                                       commit=True, attention="block_causal", keep_logits=0)
        for r, i in enumerate(going_on):
            current[i] = state.select([r])
    return states


def block_logits(model: CloverModel, layouts: list[Layout], noised: NoisedBlocks) -> torch.Tensor:
    """Logits [N, L, V] of every noised block, each run from its committed state as a denoising step runs."""
    bs = noised.tokens.shape[1]
    states = clean_states(model, layouts, bs)
    state = CloverState.concat([states[i][j] for i, j in zip(noised.example, noised.block, strict=True)])
    logits, _ = model.forward_train(noised.tokens.to(model.device), state, commit=False, attention="block_causal")
    return logits  # type: ignore[return-value]


@dataclass
class LossReport:
    loss: torch.Tensor  # scalar, differentiable
    masked_tokens: int
    answer_tokens: int
    blocks: int


def diffusion_loss(model: CloverModel, examples: list[Example], generator: torch.Generator, *, eps: float = 0.1,
                   copies: int = 1) -> LossReport:
    """The block-diffusion loss of a batch (see the module docstring)."""
    d = model.config.diffusion
    if d is None:
        raise ValueError("diffusion_loss needs a diffusion model (a config with a diffusion block)")
    if d.logits_shift:
        raise ValueError("diffusion_loss trains models that predict a position from itself (logits_shift false)")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_ids[0]
    layouts = [layout(ex, d.block_size, pad) for ex in examples]
    noised = noise_blocks(layouts, d.block_size, d.mask_token_id, generator, eps=eps, copies=copies)
    logits = block_logits(model, layouts, noised)
    masked = noised.masked.to(logits.device)
    ce = F.cross_entropy(logits[masked].float(), noised.targets.to(logits.device)[masked], reduction="none")
    weight = (1.0 / noised.rate.to(logits.device))[:, None].expand_as(masked)[masked]
    answer_tokens = int(noised.answer.sum())
    return LossReport((ce * weight).sum() / answer_tokens, int(masked.sum()), answer_tokens, len(noised.example))


# ---- initialisation and the training loop ----------------------------------------------------------------------


def init_for_training(model: CloverModel, seed: int, *, device: str | torch.device = "cpu",
                      embedding_std: float = INIT_STD) -> None:
    """Seeded fp32 random weights on `device` (`init_random_weights`; the model may be on the meta device), then
    GDN step sizes and decays as Mamba-2 / fla set them; every parameter requires grad.

    embedding_std: the input embedding's init scale (the other matrices keep INIT_STD, 0.02). A small model with a
    2,048-token vocabulary learned to copy a variable-length list in 300 steps from 0.5, and not at all (loss
    flat at 3.6) from 0.02, with everything else equal.
    """
    if embedding_std <= 0:
        raise ValueError(f"embedding_std must be positive, got {embedding_std}")
    init_random_weights(model, seed=seed, dtype=torch.float32, device=torch.device(device))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(embedding_std / INIT_STD)  # init_random_weights draws normal(0, INIT_STD)
        for layer in model.layers:
            if layer.kind != "linear_attention":
                continue
            gdn = layer.linear_attn
            H = gdn.A_log.shape[0]
            gdn.A_log.copy_(torch.empty(H).uniform_(1.0, 16.0, generator=gen).log())
            dt = torch.exp(torch.rand(H, generator=gen) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
            dt = dt.clamp(min=1e-4)
            gdn.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
    for p in model.parameters():
        p.requires_grad_(True)


@dataclass(frozen=True)
class TrainOptions:
    steps: int  # optimizer steps
    lr: float = 3e-3  # peak learning rate (AdamW)
    warmup: int = 50  # linear warmup steps
    min_lr_ratio: float = 0.1  # cosine decay down to lr * this
    weight_decay: float = 0.01  # on matrices only (not norms, biases, decays)
    grad_clip: float = 1.0  # global grad-norm clip
    eps: float = 0.1  # smallest mask rate
    noise_copies: int = 2  # noised copies of every answer block per clean pass
    seed: int = 0  # noise draws
    log_every: int = 25

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class TrainLog:
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # mean loss over the steps since the previous entry
    seconds: float = 0.0
    tokens: int = 0  # prompt + answer tokens of all examples seen


def _no_decay(name: str) -> bool:
    return name.endswith(("norm.weight", "A_log", "dt_bias")) or "conv1d" in name


def train(model: CloverModel, batches: Iterable[list[Example]], options: TrainOptions,
          on_log: Callable[[int, float, float], None] | None = None) -> TrainLog:
    """Run `options.steps` AdamW steps of `diffusion_loss` over `batches`; returns the loss curve.

    on_log(step, mean loss since the last call, seconds so far) is called every `log_every` steps and at the end.
    """
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in params if not _no_decay(n)], "weight_decay": options.weight_decay},
        {"params": [p for n, p in params if _no_decay(n)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=options.lr, betas=(0.9, 0.98), eps=1e-8)
    gen = torch.Generator().manual_seed(options.seed)
    result, window, start = TrainLog(), [], time.perf_counter()
    it = iter(batches)
    for step in range(options.steps):
        for g in opt.param_groups:
            g["lr"] = options.lr_at(step)
        batch = next(it)
        with torch.enable_grad():
            report = diffusion_loss(model, batch, gen, eps=options.eps, copies=options.noise_copies)
            opt.zero_grad(set_to_none=True)
            report.loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], options.grad_clip)
        opt.step()
        window.append(float(report.loss.detach()))
        result.tokens += sum(len(ex.prompt) + len(ex.answer) for ex in batch)
        if (step + 1) % options.log_every == 0 or step + 1 == options.steps:
            elapsed = time.perf_counter() - start
            result.steps.append(step + 1)
            result.losses.append(sum(window) / len(window))
            if on_log is not None:
                on_log(step + 1, result.losses[-1], elapsed)
            window = []
    result.seconds = time.perf_counter() - start
    model.eval()
    return result


def batches_by_prefix(examples: Iterator[Example], batch_size: int, block_size: int, *, pool: int = 512,
                      seed: int = 0) -> Iterator[list[Example]]:
    """Batches of `batch_size` examples sharing a block-aligned prompt prefix length where the stream allows.

    Keeps a pool of examples; each batch takes the longest-waiting example and the others of its prefix length,
    topped up with the nearest lengths (each group still costs one prefix forward, so near-equal is cheap too).
    """
    rng = random.Random(seed)
    waiting: list[Example] = []
    for ex in examples:
        waiting.append(ex)
        if len(waiting) < pool:
            continue
        yield _take_batch(waiting, batch_size, block_size, rng)
    while waiting:
        yield _take_batch(waiting, batch_size, block_size, rng)


def _take_batch(waiting: list[Example], batch_size: int, block_size: int, rng: random.Random) -> list[Example]:
    key = len(waiting[0].prompt) // block_size
    # the longest-waiting example first, then the nearest prefix lengths (ties in random order)
    order = sorted(range(len(waiting)), key=lambda i: (i > 0, abs(len(waiting[i].prompt) // block_size - key),
                                                        rng.random()))
    chosen = sorted(order[:batch_size])
    batch = [waiting[i] for i in chosen]
    for i in reversed(chosen):
        del waiting[i]
    return batch
