"""Token selection: pure functions from logits to chosen tokens and positions.

The per-sequence functions (`token_distribution`, `sample_tokens`, `select_positions`) are the plain reference
that `generate_nocache` uses; `pick_tokens` and `select_block_positions` do the same for every row of a decode step
at once, on the device, so a step needs no host round trip per sequence. Tests hold the two equal.

Ties in confidence are broken towards the earlier position, in both, so fixed-k selection is deterministic.
The threshold rule is LowConfidence's, the decoder Clover's authors ship (the public record, section 4; SGLang's
`LowConfidence` is the reference semantics): fill every position whose confidence *exceeds* the threshold, and the
single most confident one when none does.
Penalties (`apply_penalties` on counts, `penalize` on a token list, its reference) count response tokens only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .options import DecodeOptions


def token_distribution(logits_TV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Probabilities [T, V] after temperature and nucleus filtering (greedy: the plain softmax)."""
    logits = logits_TV.float()
    if temperature > 0:
        logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0 and top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_tokens(probs_TV: torch.Tensor, temperature: float,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [T], its probability [T]): argmax when greedy, else a draw from `generator`."""
    if temperature == 0:
        conf, tok = probs_TV.max(dim=-1)
        return tok, conf
    tok = torch.multinomial(probs_TV, 1, generator=generator).squeeze(-1)
    return tok, probs_TV.gather(-1, tok[:, None]).squeeze(-1)


def select_positions(confidence_T: torch.Tensor, candidates_T: torch.Tensor, threshold: float,
                     tokens_per_step: int | None) -> torch.Tensor:
    """Boolean [T]: which candidate positions to fill this step (fixed k, or threshold with a top-1 fallback)."""
    conf = confidence_T.masked_fill(~candidates_T, -1.0)
    n = int(candidates_T.sum())
    if tokens_per_step is not None:
        k = min(tokens_per_step, n)
    else:
        k = max(1, int(((conf > threshold) & candidates_T).sum()))
    chosen = torch.zeros_like(candidates_T)
    chosen[torch.sort(conf, descending=True, stable=True).indices[:k]] = True
    return chosen & candidates_T


def pick_tokens(logits_NTV: torch.Tensor, temperature: float, top_p: float,
                generators: list[torch.Generator | None] | None = None,
                rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N, T], confidence [N, T]) for every row: `sample_tokens(token_distribution(...))` per row.

    Greedy is one batched argmax. Sampling draws row by row from each row's own generator, and only for `rows`
    (default: all), so a sequence's draws do not depend on what else is in the batch.
    """
    if temperature == 0:
        conf, tok = torch.softmax(logits_NTV.float(), dim=-1).max(dim=-1)
        return tok, conf
    N, T, _ = logits_NTV.shape
    tok = torch.zeros(N, T, dtype=torch.long, device=logits_NTV.device)
    conf = torch.zeros(N, T, dtype=torch.float32, device=logits_NTV.device)
    for r in range(N) if rows is None else rows:
        probs = token_distribution(logits_NTV[r], temperature, top_p)
        tok[r], conf[r] = sample_tokens(probs, temperature, None if generators is None else generators[r])
    return tok, conf


def select_block_positions(confidence_NT: torch.Tensor, needed_NT: torch.Tensor, threshold: float,
                           tokens_per_step: int | None) -> torch.Tensor:
    """`select_positions` for every row at once: boolean [N, T] of the needed positions to fill."""
    conf = confidence_NT.masked_fill(~needed_NT, -1.0)  # probabilities are >= 0: needed positions rank first
    if tokens_per_step is not None:
        order = torch.sort(conf, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(conf.shape[-1], device=conf.device)
                                                .expand_as(order))
        return needed_NT & (rank < tokens_per_step)
    chosen = needed_NT & (conf > threshold)
    # top-1 fallback where nothing passes: argmax gives the first of equal maxima, as the stable sort does
    fallback = needed_NT.any(-1) & ~chosen.any(-1)
    best = torch.zeros_like(chosen).scatter_(-1, conf.argmax(-1, keepdim=True), fallback[:, None])
    return chosen | best


def apply_penalties(logits_NTV: torch.Tensor, counts_NV: torch.Tensor, options: DecodeOptions) -> torch.Tensor:
    """Logits after the response-only penalties, for every row at once (counts: each row's response tokens, [N, V];
    or [N, T, V], each position's own: a verified block's position t counts the block's tokens before it too).

    In vLLM's order: repetition first (CTRL / transformers: where count > 0, a positive logit divided by r, a
    negative one multiplied by r), then frequency (minus f * count) and presence (minus p where count > 0).
    A new tensor (fp32)."""
    counts = counts_NV[:, None, :] if counts_NV.dim() == 2 else counts_NV  # [N, 1 or T, V]
    seen = counts > 0
    out = logits_NTV.float()
    if options.repetition_penalty != 1:
        r = options.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    return out - options.frequency_penalty * counts - options.presence_penalty * seen.float()


def penalize(logits_TV: torch.Tensor, response: list[int], options: DecodeOptions) -> torch.Tensor:
    """`apply_penalties` for one sequence from its response token list, token by token: the reference."""
    out = logits_TV.float().clone()
    counts: dict[int, int] = {}
    for t in response:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        if options.repetition_penalty != 1:
            col = out[:, t]
            out[:, t] = torch.where(col > 0, col / options.repetition_penalty, col * options.repetition_penalty)
        out[:, t] -= options.frequency_penalty * c + options.presence_penalty
    return out
