"""Training through the model's own layers and explicit state: an autoregressive (next-token) loss and a
block-diffusion loss (SDAR / BD3-LM style), alone or mixed, in phases, resumable.

One training sequence is `prompt + answer`, the answer ending with a stop token.

Autoregressive loss (`ar_loss`; models whose causal logits score the next token: Clover's layout, or an
autoregressive model): one causal forward over the whole sequence, cross-entropy of every next token, weighted per
token (`TokenWeights`: prompt tokens, the instruction and document included, and answer tokens apart), summed and
divided by the summed weights. This is the trunk that prefill, commits and `mode="autoregressive"` run.

Block-diffusion loss (`diffusion_loss`): the answer is padded with `pad_id` to the end of its last block, blocks
aligned on absolute multiples of block_size exactly as generation lays them out (the prompt's tail opens the first
answer block).

    clean pass:  prompt up to its last whole block (one forward, commit=True)
                 -> each answer block (forward of [rows, block_size], commit=True), keeping the committed state
                 *before* every answer block, and the logits the pass computes
    noised pass: every answer block (x `noise_copies`), its answer positions masked at rate t ~ U(eps, 1) per
                 block (prompt positions never), run from its saved state as one batch, exactly as a denoising
                 step of generation runs it
    loss:        cross-entropy on masked positions, weighted 1/t, summed and divided by the answer positions of
                 the noised blocks

  The two layouts differ as inference does (generate.py, engine.py):
  - `trunk` (logits_shift false, block-causal prompt attention): the clean pass is block-causal, the noised pass
    a block-causal forward, and a masked position is predicted from its own hidden state;
  - Clover's (`preview_operator: clover`, logits_shift true): the clean pass is the causal trunk, the noised
    pass is a preview (bidirectional attention in the block, the GDN preview operator, preview.py), and position
    j of a block is predicted by the preview's logits at j - 1, position 0 by the clean pass's logits at the last
    committed position; the mask token is never a prediction (its logit is -inf, as the decoder sets it).
  With `ar_weight` > 0 the clean pass's logits also give the autoregressive loss of the same sequences (one pass,
  both losses).

Gradients reach the clean pass through the saved states (attention keys/values and GDN recurrent/conv state),
so the model learns to write into the state what later blocks read from it, across windows as at inference.

Shapes: B sequences, T tokens, N noised blocks, L block size, V vocabulary.

Notable choices:
- Prompts are grouped by their block-aligned prefix length, one prefix forward per group: equal lengths batch
  without padding (padding would run through the GDN recurrence and change the state). `batches_by_prefix`
  forms such batches from a stream of examples. The autoregressive forward pads at the end instead (a causal pass
  never reads what follows a position), and pads weigh nothing.
- Every noised block has at least one masked position (a block drawn with none would carry no signal).
- `init_for_training` sets the GDN decays as Mamba-2 / flash-linear-attention initialise them (step sizes
  log-uniform in [0.001, 0.1]); the checkpoint-shaped init (`dt_bias` = 1) forgets within a few tokens, which a
  model that must carry a document's facts across windows cannot start from.
- `TrainOptions.slow_heads` gives the last n value heads of every GDN layer a fixed slow decay for a phase
  (`set_slow_heads` at its start, `hold_slow_heads` after every backward). Trained freely, every head of the demo
  but one learned to forget within tens of tokens; the recipe does not use it (docs/models.md: held slow heads
  keep the state; in probes, and in a run holding them from the first step, they carried a list's first word and
  length across a log longer than the window, but no more of a long document's facts).
- `TrainOptions.window_tokens` trains an autoregressive phase at another attention window than the model's (the
  checkpoint keeps its own). With a few tokens attention cannot copy what lies further back and only the GDN state
  can: the demo's GDN heads learned to look up a list's next word only so (docs/models.md).
- `train_phases` runs phases (each its own AdamW and schedule, from the previous phase's weights) and saves what a
  resumed run needs (weights, optimizer, noise generator, step) every `save_every` steps: a resumed run replays its
  data stream to the saved step, so it sees the data in the same order and ends with the same weights.

Why one file of about 670 lines: the two objectives (autoregressive, block diffusion with Clover's preview), the
initialisation they need and the resumable phase loop are one training recipe, used only by `model train-demo`
and its tests.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path

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
    # the attention window of this example's autoregressive forward (None: the phase's): a drill at a few tokens,
    # which only the GDN state can copy, beside documents at the model's window in one batch
    window_tokens: int | None = None


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


@dataclass(frozen=True)
class TokenWeights:
    """Per-token weights of the autoregressive loss, by where the predicted token lies."""

    prompt: float = 1.0  # a prompt token (chat scaffold, instruction, document)
    answer: float = 3.0  # an answer token (the stop token included)

    def __post_init__(self) -> None:
        if self.prompt < 0 or self.answer < 0 or self.prompt + self.answer == 0:
            raise ValueError(f"token weights must be >= 0 and not both 0, got {self}")


def next_token_targets(examples: list[Example], weights: TokenWeights, length: int,
                       pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, length], targets [B, length], weight [B, length]) of `examples` padded at the end to `length`:
    position t predicts ids[t + 1] with that token's weight; the last token of a sequence and pads weigh 0."""
    ids, targets, weight = [], [], []
    for ex in examples:
        seq = list(ex.prompt) + list(ex.answer)
        if len(seq) > length:
            raise ValueError(f"an example of {len(seq)} tokens does not fit in {length}")
        pad = length - len(seq)
        ids.append(seq + [pad_id] * pad)
        targets.append(seq[1:] + [pad_id] * (pad + 1))
        w = [weights.prompt if t < len(ex.prompt) else weights.answer for t in range(1, len(seq))]
        weight.append(w + [0.0] * (pad + 1))
    return torch.tensor(ids), torch.tensor(targets), torch.tensor(weight)


def weighted_next_token_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor,
                             weight_BT: torch.Tensor) -> torch.Tensor:
    """sum(weight * cross-entropy) / sum(weight), in fp32."""
    weight_BT = weight_BT.to(logits_BTV.device)
    keep = weight_BT > 0
    ce = F.cross_entropy(logits_BTV[keep].float(), targets_BT.to(logits_BTV.device)[keep], reduction="none")
    return (ce * weight_BT[keep]).sum() / weight_BT[keep].sum()


def _check_scores_next_token(model: CloverModel) -> None:
    d = model.config.diffusion
    if d is not None and not d.logits_shift:
        raise ValueError("the autoregressive loss trains models whose causal logits score the next token "
                         "(logits_shift true, or no diffusion); this model predicts a position from itself")


def _pad_id(model: CloverModel) -> int:
    return model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_ids[0]


@dataclass
class LossReport:
    loss: torch.Tensor  # scalar, differentiable: ar_weight * ar + bd_weight * bd
    ar: float | None = None  # the autoregressive part (None: not computed)
    bd: float | None = None  # the block-diffusion part (None: not computed)
    masked_tokens: int = 0
    answer_tokens: int = 0  # answer positions of the noised blocks (padding included)
    blocks: int = 0  # noised blocks


def ar_loss(model: CloverModel, examples: list[Example], weights: TokenWeights = TokenWeights(), *,
            window_tokens: int | None = None) -> LossReport:
    """The autoregressive loss of a batch: one causal forward over each whole sequence (padded at the end), one
    forward per attention window where examples carry their own (Example.window_tokens), the weighted sum over
    all of them divided by their summed weights.

    window_tokens: the attention window of the examples that carry none (None: the model's)."""
    _check_scores_next_token(model)
    groups: dict[int | None, list[Example]] = {}
    for ex in examples:
        groups.setdefault(ex.window_tokens or window_tokens, []).append(ex)
    sums: list[tuple[torch.Tensor, torch.Tensor]] = []  # (sum of weight * cross-entropy, sum of weights) a group
    for window, group in groups.items():
        length = max(len(ex.prompt) + len(ex.answer) for ex in group)
        ids, targets, weight = next_token_targets(group, weights, length, _pad_id(model))
        logits, _ = model.forward_train(ids.to(model.device), None, attention="causal", window_tokens=window)
        assert logits is not None
        weight = weight.to(logits.device)
        keep = weight > 0
        ce = F.cross_entropy(logits[keep].float(), targets.to(logits.device)[keep], reduction="none")
        sums.append(((ce * weight[keep]).sum(), weight[keep].sum()))
    loss = sum(part for part, _ in sums) / sum(w for _, w in sums)
    assert isinstance(loss, torch.Tensor)
    return LossReport(loss, ar=float(loss.detach()))


@dataclass
class CleanPass:
    """What the clean pass of a batch leaves for the noised pass and the autoregressive loss."""

    states: list[list[CloverState]]  # [i][j] the committed state before answer block j of example i (batch of 1)
    before: list[list[torch.Tensor | None]]  # [i][j] logits [V] at the position before block j (None at 0)
    logits: list[torch.Tensor] | None  # [i] logits [len(tokens), V] of every position (when asked for)


def clean_pass(model: CloverModel, layouts: list[Layout], block_size: int, *, attention: str,
               all_logits: bool = False) -> CleanPass:
    """Run every example's clean tokens, keeping the committed state before each answer block.

    The prompt prefix runs once per group of equal prefix length; answer blocks then run for all examples
    together, one [rows, block_size] forward per block index, each row at its own position. Logits: of the last
    position of each forward (what predicts the next block's first position), or of every position with
    `all_logits` (then the last block runs too, for its logits).
    """
    B = len(layouts)
    current: list[CloverState | None] = [None] * B
    pieces: list[list[torch.Tensor]] = [[] for _ in range(B)]
    last: list[torch.Tensor | None] = [None] * B
    keep = None if all_logits else 1
    groups: dict[int, list[int]] = {}
    for i, lay in enumerate(layouts):
        groups.setdefault(lay.prefix, []).append(i)
    for prefix, rows in groups.items():
        if prefix == 0:
            for i in rows:
                current[i] = model.empty_state(1)
            continue
        ids = torch.tensor([layouts[i].tokens[:prefix] for i in rows], device=model.device)
        logits, state = model.forward_train(ids, None, commit=True, attention=attention, keep_logits=keep)
        assert logits is not None
        for r, i in enumerate(rows):
            current[i] = state.select([r])
            last[i] = logits[r, -1]
            if all_logits:
                pieces[i].append(logits[r])
    states: list[list[CloverState]] = [[] for _ in range(B)]
    before: list[list[torch.Tensor | None]] = [[] for _ in range(B)]
    for j in range(max(lay.blocks for lay in layouts)):
        rows = [i for i in range(B) if layouts[i].blocks > j]
        for i in rows:
            states[i].append(current[i])  # type: ignore[arg-type]
            before[i].append(last[i])
        # the last block's state and last logits are never read; its logits are, by the autoregressive loss
        going_on = rows if all_logits else [i for i in rows if layouts[i].blocks > j + 1]
        if not going_on:
            continue
        ids = torch.tensor([layouts[i].tokens[layouts[i].prefix + j * block_size:
                                              layouts[i].prefix + (j + 1) * block_size] for i in going_on],
                           device=model.device)
        logits, state = model.forward_train(ids, CloverState.concat([current[i] for i in going_on]),  # type: ignore
                                            commit=True, attention=attention, keep_logits=keep)
        assert logits is not None
        for r, i in enumerate(going_on):
            current[i] = state.select([r])
            last[i] = logits[r, -1]
            if all_logits:
                pieces[i].append(logits[r])
    return CleanPass(states, before, [torch.cat(p) for p in pieces] if all_logits else None)


def _clean_attention(model: CloverModel) -> str:
    d = model.config.diffusion
    assert d is not None
    if d.clover:
        return "causal"
    if d.logits_shift or d.prompt_attention != "block_causal":
        raise ValueError("the block-diffusion loss trains Clover's layout (preview_operator clover) or the trunk "
                         "layout with block-causal prompts and unshifted logits")
    return "block_causal"


def noised_logits(model: CloverModel, clean: CleanPass, noised: NoisedBlocks) -> torch.Tensor:
    """Logits [N, L, V] that predict each position of every noised block, as the decoder reads them.

    trunk: the block-causal forward of the block from its state, position j read at j. Clover's layout: a preview
    of the block from its state; position j read from the preview's logits at j - 1, position 0 from the clean
    logits of the last committed position (zeros at position 0 of a sequence, which is never masked)."""
    d = model.config.diffusion
    assert d is not None
    state = CloverState.concat([clean.states[i][j] for i, j in zip(noised.example, noised.block, strict=True)])
    tokens = noised.tokens.to(model.device)
    if not d.clover:
        logits, _ = model.forward_train(tokens, state, commit=False, attention="block_causal")
        return logits  # type: ignore[return-value]
    preview, _ = model.forward_train(tokens, state, preview=True)
    assert preview is not None
    firsts = [clean.before[i][j] for i, j in zip(noised.example, noised.block, strict=True)]
    first = torch.stack([f if f is not None else preview.new_zeros(preview.shape[-1]) for f in firsts])
    return torch.cat([first[:, None].to(preview.dtype), preview[:, :-1]], dim=1)


def block_logits(model: CloverModel, layouts: list[Layout], noised: NoisedBlocks) -> torch.Tensor:
    """Logits [N, L, V] of every noised block, each run from its committed state as a denoising step runs
    (`noised_logits` after a `clean_pass`)."""
    bs = noised.tokens.shape[1]
    clean = clean_pass(model, layouts, bs, attention=_clean_attention(model))
    return noised_logits(model, clean, noised)


def diffusion_loss(model: CloverModel, examples: list[Example], generator: torch.Generator, *, eps: float = 0.1,
                   copies: int = 1, ar_weight: float = 0.0, bd_weight: float = 1.0,
                   weights: TokenWeights = TokenWeights()) -> LossReport:
    """bd_weight times the block-diffusion loss of a batch (see the module docstring), plus `ar_weight` times the
    autoregressive loss of the same sequences from the clean pass's logits (Clover's layout)."""
    d = model.config.diffusion
    if d is None:
        raise ValueError("diffusion_loss needs a diffusion model (a config with a diffusion block)")
    attention = _clean_attention(model)
    if ar_weight:
        _check_scores_next_token(model)
    if any(ex.window_tokens for ex in examples):
        raise ValueError("an example with its own attention window (Example.window_tokens) trains autoregressively "
                         "only; the block-diffusion loss runs at the model's window, as decoding does")
    pad = _pad_id(model)
    layouts = [layout(ex, d.block_size, pad) for ex in examples]
    noised = noise_blocks(layouts, d.block_size, d.mask_token_id, generator, eps=eps, copies=copies)
    clean = clean_pass(model, layouts, d.block_size, attention=attention, all_logits=bool(ar_weight))
    logits = noised_logits(model, clean, noised)
    if d.clover:  # the decoder never predicts a mask (engine.py, generate.py): neither does the loss
        logits = logits.index_fill(-1, torch.tensor([d.mask_token_id], device=logits.device), -math.inf)
    masked = noised.masked.to(logits.device)
    ce = F.cross_entropy(logits[masked].float(), noised.targets.to(logits.device)[masked], reduction="none")
    weight = (1.0 / noised.rate.to(logits.device))[:, None].expand_as(masked)[masked]
    answer_tokens = int(noised.answer.sum())
    bd = (ce * weight).sum() / answer_tokens
    loss, ar = bd_weight * bd, None
    if ar_weight:
        assert clean.logits is not None
        length = max(len(lay.tokens) for lay in layouts)
        _, targets, weight_BT = next_token_targets(examples, weights, length, pad)
        full = torch.stack([F.pad(lg, (0, 0, 0, length - lg.shape[0])) for lg in clean.logits])
        ar_part = weighted_next_token_loss(full, targets, weight_BT)
        loss, ar = loss + ar_weight * ar_part, float(ar_part.detach())
    return LossReport(loss, ar=ar, bd=float(bd.detach()), masked_tokens=int(masked.sum()),
                      answer_tokens=answer_tokens, blocks=len(noised.example))


# ---- initialisation and the training loop ----------------------------------------------------------------------


def init_for_training(model: CloverModel, seed: int, *, device: str | torch.device = "cpu",
                      embedding_std: float = INIT_STD) -> None:
    """Seeded fp32 random weights on `device` (`init_random_weights`; the model may be on the meta device), then
    GDN step sizes and decays as Mamba-2 / fla set them, and (Clover's layout) the preview conv's right taps at 0;
    every parameter requires grad.

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
            if gdn.clover:  # the preview conv starts as the trunk's causal conv; training learns what to read ahead
                gdn.conv_right_weight.zero_()
    for p in model.parameters():
        p.requires_grad_(True)


def _gdn_layers(model: CloverModel) -> list:
    return [layer.linear_attn for layer in model.layers if layer.kind == "linear_attention"]


def set_slow_heads(model: CloverModel, n: int, dt: float) -> None:
    """Give the last n value heads of every GDN layer a decay of exp(-dt) a token whatever the input: A = 1
    (A_log 0), dt_bias = softplus^-1(dt) and their rows of in_proj_a zero, so g = -softplus(dt_bias) = -dt.

    Heads that a long document's facts can cross its log in (at dt 5e-4, 600 tokens keep 74% of the state):
    trained freely from the Mamba-2 init, all but one head of the demo learned to forget within tens of tokens
    (the committed checkpoint's other 7 keep 10^-5 to 10^-119 of the state from a long document's facts to its
    answer: bench/gdn_memory.py), and reset heads left trainable learned to forget again within 600 steps.
    `hold_slow_heads` keeps them."""
    for gdn in _gdn_layers(model):
        if not 0 < n <= gdn.Hv:
            raise ValueError(f"slow_heads must be in 1..{gdn.Hv} (the GDN layers' value heads), got {n}")
        heads = slice(gdn.Hv - n, gdn.Hv)
        with torch.no_grad():
            gdn.A_log[heads] = 0.0
            gdn.dt_bias[heads] = math.log(math.expm1(dt))
            gdn.in_proj_a.weight[heads] = 0.0


def hold_slow_heads(model: CloverModel, n: int) -> None:
    """Zero the gradient of the last n value heads' decay parameters (A_log, dt_bias, in_proj_a rows) of every GDN
    layer: AdamW then leaves them exactly as they are (their moments stay zero, and decoupled weight decay keeps
    zero rows zero)."""
    for gdn in _gdn_layers(model):
        for param in (gdn.A_log, gdn.dt_bias, gdn.in_proj_a.weight):
            if param.grad is not None:
                param.grad[gdn.Hv - n:] = 0.0


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
    ar_weight: float = 0.0  # weight of the autoregressive loss
    bd_weight: float = 1.0  # weight of the block-diffusion loss (0: autoregressive only, one forward per batch)
    weights: TokenWeights = TokenWeights()  # per-token weights of the autoregressive loss
    # the last `slow_heads` value heads of every GDN layer get a fixed slow decay (set_slow_heads: exp(-slow_dt) a
    # token, whatever the input) at the phase's start, and their decay parameters no gradient during it
    slow_heads: int = 0
    slow_dt: float = 5e-4
    # the attention window of the phase's forwards (0: the model's). A few tokens keep attention from copying what
    # lies further back, so only the GDN state can carry it: how the demo's look-up is learned (docs/models.md).
    # Autoregressive phases only; the checkpoint keeps the model's window.
    window_tokens: int = 0
    # the phase starts from its weights rounded to bf16, as a checkpoint of the phases before it holds them (saved
    # bf16): a run from the start and one from that checkpoint (`train-demo --init`) train it from the same weights
    bf16_start: bool = False

    def __post_init__(self) -> None:
        if self.slow_heads < 0 or not 0 < self.slow_dt < 1:
            raise ValueError(f"slow_heads must be >= 0 and slow_dt in (0, 1), got {self.slow_heads}, {self.slow_dt}")
        if self.window_tokens < 0:
            raise ValueError(f"window_tokens must be >= 0 (0: the model's window), got {self.window_tokens}")
        if self.window_tokens and self.bd_weight:
            raise ValueError("window_tokens sets the window of an autoregressive phase (bd_weight 0); a "
                             "block-diffusion phase trains at the model's window, as its checkpoint decodes")
        if self.ar_weight < 0 or self.bd_weight < 0 or self.ar_weight + self.bd_weight == 0:
            raise ValueError(f"ar_weight and bd_weight must be >= 0 and not both 0, got {self.ar_weight}, "
                             f"{self.bd_weight}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_loss(model: CloverModel, batch: list[Example], generator: torch.Generator,
               options: TrainOptions) -> LossReport:
    """ar_weight * autoregressive loss + bd_weight * block-diffusion loss of a batch (one clean pass for both)."""
    if not options.bd_weight:
        report = ar_loss(model, batch, options.weights, window_tokens=options.window_tokens or None)
        report.loss = options.ar_weight * report.loss
        return report
    return diffusion_loss(model, batch, generator, eps=options.eps, copies=options.noise_copies,
                          ar_weight=options.ar_weight, bd_weight=options.bd_weight, weights=options.weights)


@dataclass
class TrainLog:
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # mean loss over the steps since the previous entry
    ar: list[float] = field(default_factory=list)  # its autoregressive part (when computed)
    bd: list[float] = field(default_factory=list)  # its block-diffusion part (when computed)
    seconds: float = 0.0  # wall time, summed over the sessions of a resumed run
    cpu_seconds: float = 0.0  # this process's CPU time (all threads), summed likewise
    tokens: int = 0  # prompt + answer tokens of all examples seen
    load: list[float] = field(default_factory=list)  # the machine's 1-minute load average at each entry


@dataclass(frozen=True)
class Phase:
    name: str
    options: TrainOptions


@dataclass(frozen=True)
class Saving:
    """Where a run saves what resuming it needs, and how often."""

    path: Path  # one file, replaced atomically
    every: int  # optimizer steps between saves (and at the end of every phase)


def _no_decay(name: str) -> bool:
    return name.endswith(("norm.weight", "A_log", "dt_bias")) or "conv1d" in name


def _optimizer(model: CloverModel, options: TrainOptions) -> tuple[torch.optim.AdamW, list[torch.nn.Parameter]]:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in params if not _no_decay(n)], "weight_decay": options.weight_decay},
        {"params": [p for n, p in params if _no_decay(n)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=options.lr, betas=(0.9, 0.98), eps=1e-8), [p for _, p in params]


def _recipe(phases: list[Phase]) -> list[dict]:
    return [{"name": p.name, "options": asdict(p.options)} for p in phases]


def _as_now(saved: list[dict]) -> list[dict]:
    """Saved phases with the TrainOptions fields added since the save at their defaults (each new field's default
    trains as before it existed), so a run saved by an older version resumes."""
    defaults = {f.name: asdict(f.default) if is_dataclass(f.default) else f.default  # type: ignore[arg-type]
                for f in fields(TrainOptions) if f.default is not MISSING}
    return [{**p, "options": {**{k: v for k, v in defaults.items() if k not in p["options"]}, **p["options"]}}
            for p in saved]


def _load_saved(saving: Saving | None, phases: list[Phase]) -> dict | None:
    if saving is None or not saving.path.exists():
        return None
    # tensors and plain data only: a state file never unpickles objects (or runs code)
    saved = torch.load(saving.path, map_location="cpu", weights_only=True)
    # the phases that shaped the saved weights (those before the saved one, and it) must be the same; phases not
    # started yet may differ (a longer or shorter last phase, decided at a phase boundary)
    shaped = saved["phase"] + 1
    if len(phases) < shaped or _as_now(saved["phases"][:shaped]) != _recipe(phases)[:shaped]:
        raise ValueError(f"{saving.path} was saved by a run with other phases or options: "
                         f"{saved['phases'][:shaped]}")
    return saved


def train_phases(model: CloverModel, phases: list[Phase], batches: Callable[[int], Iterable[list[Example]]], *,
                 saving: Saving | None = None,
                 on_log: Callable[[str, int, LossReport, float], None] | None = None,
                 aux_loss: Callable[[list[Example]], torch.Tensor] | None = None) -> list[TrainLog]:
    """Run the phases in order, each with its own AdamW and learning-rate schedule from the weights the previous one
    left; returns one loss curve per phase.

    batches(i): phase i's data stream, the same sequence of batches every time it is asked for. With `saving`, the
    weights, optimizer moments, noise generator and position are saved every `saving.every` steps, and a run
    that finds the file continues from it: the phases before its phase are skipped, its stream is replayed to
    the saved step, and the run ends with the weights an uninterrupted one ends with.
    on_log(phase name, step, mean report of the steps since the last call, seconds so far) every `log_every` steps
    of a phase and at its end (the report's loss, ar and bd hold those means).
    aux_loss(batch), if given, is called after each batch's forward passes and added to its loss before the
    backward (a probe's extra term, computed from what its own forward hooks caught); the logged loss includes it.
    """
    saved = _load_saved(saving, phases)
    logs: list[TrainLog] = [TrainLog(**lg) for lg in saved["logs"]] if saved else []
    first_phase, first_step = (saved["phase"], saved["step"]) if saved else (0, 0)
    if saved:
        model.load_state_dict(saved["model"])
        log.info("resuming %s at phase %s, step %d", saving.path if saving else "", phases[first_phase].name,
                 first_step)
    model.train()
    for k in range(first_phase, len(phases)):
        name, options = phases[k].name, phases[k].options
        opt, params = _optimizer(model, options)
        gen = torch.Generator().manual_seed(options.seed)
        start_step = 0
        if k == len(logs):
            logs.append(TrainLog())
        if saved and k == first_phase:
            start_step = first_step
            opt.load_state_dict(saved["optimizer"])
            gen.set_state(saved["noise"])
        result = logs[k]
        if start_step == options.steps:  # saved at the end of this phase: nothing to replay
            continue
        if options.slow_heads and start_step == 0:  # a resumed phase has them in its saved weights
            set_slow_heads(model, options.slow_heads, options.slow_dt)
        if options.bf16_start and start_step == 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16))
        it = iter(batches(k))
        for _ in range(start_step):  # replay the stream to where the saved run was
            next(it)
        window: list[LossReport] = [LossReport(torch.tensor(loss), ar=ar, bd=bd)
                                    for loss, ar, bd in saved["window"]] if saved and k == first_phase else []
        wall, cpu = time.perf_counter() - result.seconds, time.process_time() - result.cpu_seconds
        for step in range(start_step, options.steps):
            for g in opt.param_groups:
                g["lr"] = options.lr_at(step)
            batch = next(it)
            with torch.enable_grad():
                report = batch_loss(model, batch, gen, options)
                if aux_loss is not None:
                    report.loss = report.loss + aux_loss(batch)
                opt.zero_grad(set_to_none=True)
                report.loss.backward()
            if options.slow_heads:
                hold_slow_heads(model, options.slow_heads)
            torch.nn.utils.clip_grad_norm_(params, options.grad_clip)
            opt.step()
            report.loss = report.loss.detach()
            window.append(report)
            result.tokens += sum(len(ex.prompt) + len(ex.answer) for ex in batch)
            result.seconds, result.cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu
            done = step + 1 == options.steps
            logged = (step + 1) % options.log_every == 0 or done
            if logged:
                mean = _mean(window)
                result.steps.append(step + 1)
                result.losses.append(float(mean.loss))
                result.load.append(os.getloadavg()[0])
                if mean.ar is not None:
                    result.ar.append(mean.ar)
                if mean.bd is not None:
                    result.bd.append(mean.bd)
                window = []
            if saving is not None and ((step + 1) % saving.every == 0 or done):
                _save(saving.path, model, opt, gen, phases, k, step + 1, logs, window)
            if logged and on_log is not None:
                on_log(name, step + 1, mean, result.seconds)
    model.eval()
    return logs


def _mean(reports: list[LossReport]) -> LossReport:
    def avg(values: list[float | None]) -> float | None:
        return None if values[0] is None else sum(v for v in values if v is not None) / len(values)

    return LossReport(torch.stack([r.loss for r in reports]).mean(), ar=avg([r.ar for r in reports]),
                      bd=avg([r.bd for r in reports]))


def _save(path: Path, model: CloverModel, opt: torch.optim.Optimizer, gen: torch.Generator, phases: list[Phase],
          phase: int, step: int, logs: list[TrainLog], window: list[LossReport]) -> None:
    """Everything a resumed run needs, written to a temporary file and renamed over `path` (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"phases": _recipe(phases), "phase": phase, "step": step, "model": model.state_dict(),
                "optimizer": opt.state_dict(), "noise": gen.get_state(), "logs": [asdict(lg) for lg in logs],
                "window": [(float(r.loss), r.ar, r.bd) for r in window]}, tmp)
    os.replace(tmp, path)


def train(model: CloverModel, batches: Iterable[list[Example]], options: TrainOptions,
          on_log: Callable[[int, float, float], None] | None = None) -> TrainLog:
    """Run `options.steps` AdamW steps of `batch_loss` over `batches` (one phase, nothing saved); returns the loss
    curve. on_log(step, mean loss since the last call, seconds so far) every `log_every` steps and at the end."""

    def logged(_name: str, step: int, report: LossReport, seconds: float) -> None:
        if on_log is not None:
            on_log(step, float(report.loss), seconds)

    return train_phases(model, [Phase("train", options)], lambda _k: batches, on_log=logged)[0]


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
