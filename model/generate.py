"""`generate`: a batch of prompts through the engine; `generate_nocache`: the plain reference it must equal.

    generate(model, prompts, options)  =  Engine(model, options): add every prompt, step until done

Notable choices:
- `generate` is a thin loop over `Engine` (engine.py): the same continuous-batching code the pipeline runs, so
  every test of `generate` is a test of the engine. Prompt i samples from seed (options.seed, i), so a batch
  gives each prompt the output it gets alone.
- `generate_nocache` recomputes the whole sequence from an empty functional state at every step, with the
  per-sequence selection functions (sampling.py): none of the engine's slots, batching, chunking, per-row
  commits or device-side selection. Every block starts on a multiple of block_size, so with block-causal prompt
  attention a denoising step of the engine sees exactly what a full recompute does.
- Its verified branch checks each drafted token one at a time against a causal forward over everything before it
  (`_verified_nocache`): the plain statement of the acceptance rule that the engine applies to a block at once.
"""

from __future__ import annotations

import math
import secrets

import torch

from .clover import CloverModel
from .engine import Engine, Generation, Request
from .options import DecodeOptions
from .sampling import penalize, sample_tokens, select_positions, token_distribution

__all__ = ["DecodeOptions", "Generation", "generate", "generate_nocache", "select_positions", "token_distribution"]


def _options(options: DecodeOptions | None, overrides: dict) -> DecodeOptions:
    if options is not None and overrides:
        raise TypeError(f"give either a DecodeOptions or keyword options, not both ({sorted(overrides)})")
    return options if options is not None else DecodeOptions(**overrides)


def prompt_seed(seed: int, index: int) -> int:
    """Prompt `index`'s sampling seed within a call (any int seed works)."""
    return (seed * 7919 + index) % 2**63


def check_prompts(model: CloverModel, prompts: list[list[int]]) -> None:
    if not prompts:
        raise ValueError("prompts is empty")
    V = model.config.vocab_size
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= int(t) < V]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary (size {V}): {bad[:5]}")


def generate(model: CloverModel, prompts: list[list[int]], options: DecodeOptions | None = None, *,
             max_slots: int | None = None, merge_commits: bool | None = None, **overrides) -> list[Generation]:
    """Generate for a batch of token-id prompts (any lengths); diffusion or autoregressive by the model's config.

    Options: a DecodeOptions, or its fields as keywords (`max_new_tokens=64, threshold=0.9`). max_slots: most
    prompts decoded at once (default: all of them, as memory allows). merge_commits: the Engine's (None: on CUDA).
    """
    options = _options(options, overrides)
    options.check(model.config)
    check_prompts(model, prompts)
    engine = Engine(model, options, max_slots=max_slots or len(prompts), merge_commits=merge_commits)
    base = options.seed if options.seed is not None else secrets.randbits(62)  # not torch.seed(): reseeds globally
    for i, p in enumerate(prompts):
        engine.add(Request(str(i), list(p), seed=prompt_seed(base, i)))
    results: dict[str, Generation] = {}
    while engine.has_work:
        results.update(engine.step())
    return [results[str(i)] for i in range(len(prompts))]


def generate_nocache(model: CloverModel, prompt: list[int], options: DecodeOptions | None = None, *,
                     merge_commits: bool = False, **overrides) -> Generation:
    """Plain reference for one prompt: every step recomputes the whole sequence from an empty state.

    Same decisions as the engine (the per-sequence selection and penalty functions), none of its state carrying,
    batching or chunking. A diffusion step of a `trunk` model is one block-causal forward over committed + block
    (block-causal prompt attention needed: one mask then covers both); of a Clover-layout model, a causal forward
    over the committed tokens and a preview of the block from its state. `mean_logprob` comes from one causal
    forward over prompt + output at the end. merge_commits: verified mode's rounds as the engine runs them with
    merged commits (a block's first preview in the forward that commits the block before it).
    """
    opt = _options(options, overrides)
    opt.check(model.config)
    check_prompts(model, [prompt])
    cfg = model.config
    stops, window = set(opt.stops(cfg)), opt.window(cfg)
    generator = torch.Generator().manual_seed(prompt_seed(opt.seed or 0, 0)) if opt.temperature > 0 else None
    out: list[int] = []
    forwards = steps = 0
    stopped = ""
    blocks: list[tuple[int, bool]] = []

    def full_logits(ids: list[int], attention: str) -> torch.Tensor:
        nonlocal forwards
        forwards += 1
        logits, _ = model(torch.tensor([ids], device=model.device), None, attention=attention, window_tokens=window)
        return logits[0].float()

    def pick(logits_TV: torch.Tensor, response: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if opt.penalized:
            logits_TV = penalize(logits_TV, response, opt)
        probs = token_distribution(logits_TV.cpu(), opt.temperature, opt.top_p)
        return sample_tokens(probs, opt.temperature, generator)

    with torch.inference_mode():
        if opt.mode == "verified":
            out, stopped, forwards, steps, blocks = _verified_nocache(model, prompt, opt, pick, merge_commits)
        elif not opt.diffusion(cfg):
            while not stopped:
                tok, _ = pick(full_logits(list(prompt) + out, "causal")[-1:], out)
                steps += 1
                if int(tok[0]) in stops:
                    stopped = "eos"
                else:
                    out.append(int(tok[0]))
                    stopped = "length" if len(out) >= opt.max_new_tokens else ""
        else:
            d = cfg.diffusion
            assert d is not None
            if not d.clover and d.prompt_attention != "block_causal":
                raise ValueError("generate_nocache supports block_causal prompt attention only")
            bs, mask = d.block_size, d.mask_token_id
            n_full = (len(prompt) // bs) * bs
            committed = list(prompt[:n_full])
            tail = len(prompt) - n_full
            block = list(prompt[n_full:]) + [mask] * (bs - tail)
            while not stopped:
                if d.clover:  # the causal trunk over what is committed, then a preview of the block from its state
                    state, last = None, None
                    if committed:
                        clean, state = model(torch.tensor([committed], device=model.device), None,
                                             attention="causal", window_tokens=window)
                        last = clean[0, -1].float()
                    logits, _ = model(torch.tensor([block], device=model.device), state, preview=True,
                                      window_tokens=window)
                    forwards += 1 + bool(committed)
                    step = logits[0].float()
                else:
                    logits = full_logits(committed + block, "block_causal")
                    last = logits[len(committed) - 1] if committed else None
                    step = logits[len(committed):].clone()
                steps += 1
                if d.logits_shift:  # position t is predicted from t-1: the first from the last committed one
                    first = last if last is not None else torch.zeros_like(step[0])
                    step = torch.cat([first[None], step[:-1]], dim=0)
                decided = [t for t in block[tail:] if t != mask]  # the response so far includes this block's
                if opt.penalized:
                    step = penalize(step, out + decided, opt)
                step[:, mask] = -math.inf
                probs = token_distribution(step.cpu(), opt.temperature, opt.top_p)
                tok, conf = sample_tokens(probs, opt.temperature, generator)
                limit = min(bs, tail + opt.max_new_tokens - len(out))
                needed = torch.tensor([t == mask for t in block]) & (torch.arange(bs) < limit)
                for i in select_positions(conf, needed, opt.threshold, opt.tokens_per_step).nonzero().flatten():
                    block[int(i)] = int(tok[int(i)])
                if any(t == mask for t in block[:limit]):
                    continue
                new = block[tail:limit]
                cut = next((i for i, t in enumerate(new) if t in stops), None)
                if cut is not None:
                    out.extend(new[:cut])
                    stopped = "eos"
                else:
                    out.extend(new)
                    stopped = "length" if len(out) >= opt.max_new_tokens else ""
                committed += block
                block, tail = [mask] * bs, 0
        token_logprobs = trunk_logprobs(model, prompt, out, window) if _scores(opt, cfg) and out else None
    mean_logprob = sum(token_logprobs) / len(token_logprobs) if token_logprobs else None
    accepted = sum(a for a, _ in blocks) if opt.mode == "verified" else 0
    return Generation(tokens=out, forward_passes=forwards, denoising_steps=steps, prompt_tokens=len(prompt),
                      prefill_seconds=0.0, decode_seconds=0.0, windows=math.ceil(len(prompt) / window),
                      stopped=stopped, mean_logprob=mean_logprob, token_logprobs=token_logprobs,
                      verified_blocks=len(blocks) if blocks else 0,
                      accepted_tokens=accepted, full_blocks=sum(full for _, full in blocks) if blocks else 0)


def _verified_nocache(model: CloverModel, prompt: list[int], opt: DecodeOptions, pick, merged: bool) -> tuple:
    """Verified decoding from full recomputes: (tokens, stopped, forwards, preview steps, [(kept, full)] per check).

    A block starts after everything committed; its first token is the trunk's greedy choice there. A round: the
    preview fills the block's unverified positions (from the causal state of what is committed, the block's
    verified tokens as known positions, as a diffusion step does), then, position by position, a drafted token is
    verified while it is the trunk's choice after everything before it (one causal forward each, penalised by the
    response before it); the trunk's own token follows the verified run, and the positions after it are drafted
    again next round. A block is committed once every position is verified. The round that starts a block after a
    commit is the engine's: without merged commits the commit forward drafts nothing, so the check only adds the
    trunk's token after the first; with them the first preview runs with the first position still masked."""
    cfg = model.config
    d = cfg.diffusion
    assert d is not None
    stops, window, bs, mask = set(opt.stops(cfg)), opt.window(cfg), d.block_size, d.mask_token_id
    attention = None if d.clover else "causal"  # a trunk layout drafts with causal previews in verified mode
    committed: list[int] = []  # generated tokens of complete blocks
    out: list[int] = []
    checks: list[tuple[int, bool]] = []
    forwards = steps = 0
    stopped = ""
    after_commit = False

    def causal(ids: list[int]) -> tuple[torch.Tensor, object]:
        nonlocal forwards
        forwards += 1
        logits, state = model(torch.tensor([ids], device=model.device), None, attention="causal",
                              window_tokens=window)
        return logits[0].float(), state

    def preview(ids: list[int], state) -> torch.Tensor:
        nonlocal forwards
        forwards += 1
        ids_t = torch.tensor([ids], device=model.device)
        if d.clover:
            logits, _ = model(ids_t, state, preview=True, window_tokens=window)
        else:
            logits, _ = model(ids_t, state, commit=False, attention=attention, window_tokens=window)
        return logits[0].float()

    while not stopped:
        clean, state = causal(list(prompt) + committed)
        raw = clean[-1:]
        limit = min(bs, opt.max_new_tokens - len(committed))
        block = [mask] * bs
        block[0] = int(pick(raw, committed)[0][0])
        known = 0
        drafts = not (after_commit and not merged)  # without merging, the commit forward drafts nothing
        hide_first = after_commit and merged  # the merged forward previews the block before its first token
        while True:
            settled = max(known, 1)
            while drafts:
                needed = torch.tensor([t == mask and settled <= i < limit for i, t in enumerate(block)])
                if not bool(needed.any()):
                    break
                logits = preview([mask, *block[1:]] if hide_first else block, state)
                hide_first = False
                steps += 1
                step = torch.cat([raw, logits[:-1]], dim=0)  # position t predicted from t - 1
                if opt.penalized:
                    decided = [t for i, t in enumerate(block) if i < settled or (t != mask and i < limit)]
                    step = penalize(step, committed + decided, opt)
                step[:, mask] = -math.inf
                tok, conf = sample_tokens(token_distribution(step.cpu(), 0.0, 1.0), 0.0, None)
                for i in select_positions(conf, needed, opt.threshold, opt.tokens_per_step).nonzero().flatten():
                    block[int(i)] = int(tok[int(i)])
            drafts = True
            k = settled
            trunk = None
            while k < limit:
                trunk = int(pick(causal(list(prompt) + committed + block[:k])[0][-1:], committed + block[:k])[0][0])
                if block[k] == mask or trunk != block[k]:
                    break
                k += 1
            k = min(k, limit)
            rejected = k < limit and block[k] != mask  # a drafted token the trunk chose otherwise
            if k < limit:  # the trunk's own token after the verified run
                block[k] = trunk
                k += 1
                block[k:] = [mask] * (bs - k)
            checks.append((k - known, not rejected))
            new = block[known:k]
            cut = next((i for i, t in enumerate(new) if t in stops), None)
            out.extend(new if cut is None else new[:cut])
            known = k
            stopped = "eos" if cut is not None else "length" if len(out) >= opt.max_new_tokens else ""
            if stopped or known == limit:
                break
        committed += block
        after_commit = True
    return out, stopped, forwards, steps, checks


def _scores(options: DecodeOptions, config) -> bool:
    """Whether generations of this model and mode get a mean_logprob (the causal logits score the next token)."""
    return not options.diffusion(config) or bool(config.diffusion.logits_shift)


def trunk_logprobs(model: CloverModel, prompt: list[int], tokens: list[int], window: int | None = None) -> list[float]:
    """Each of `tokens`' log-probability after `prompt` under the model's causal trunk, in one forward."""
    ids = torch.tensor([list(prompt) + list(tokens)], device=model.device)
    with torch.inference_mode():
        logits, _ = model(ids, None, attention="causal", window_tokens=window)
    lp = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), dim=-1)
    return lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].double().tolist()
