"""Generation engine: block-diffusion and autoregressive decoding over a batch of prompts, token ids only.

    prefill (each prompt alone, in prefill_chunk_tokens pieces, up to its last whole block)
      -> batched decode: denoise_step (commit=False) ... -> commit_block (commit=True) -> next block
      -> stop after a block with a stop token, or at max_new_tokens

Notable choices:
- Prefill runs per prompt (B=1): prompts differ in length and prefill is compute-bound anyway. States are then
  stacked; attention caches of different lengths share one tensor through per-slot key positions (state.py).
- Every block starts on a multiple of block_size, so with block-causal prompt attention a denoising step sees the
  committed cache plus its whole block, exactly as a full recompute of the sequence would (`generate_nocache`).
- A finished block is committed by one commit=True pass over the sub-batch that finished; the last block of a
  sequence is never committed (nothing reads it). Only the masked positions still needed (max_new_tokens) are
  denoised.
- Sampling is per sequence with its own generator seeded by (seed, index), so a batch gives each prompt the same
  output it gets alone.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field

import torch

from .clover import CloverModel
from .state import CloverState


@dataclass
class Generation:
    tokens: list[int]  # generated ids, cut before the first stop token
    forward_passes: int  # forward calls this sequence took part in (prefill chunks, steps, commits)
    denoising_steps: int  # decode steps (autoregressive: one per token)
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    windows: int  # ceil(prompt_tokens / window_tokens): attention windows the prompt spans
    stopped: str  # "eos" (a stop token was generated) or "length" (max_new_tokens reached)


@dataclass(frozen=True)
class DecodeOptions:
    max_new_tokens: int = 256
    threshold: float = 0.9  # diffusion: fill every masked position at least this confident (and >= 1 per step)
    tokens_per_step: int | None = None  # diffusion: fill exactly k per step instead (reproducible speed)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None  # None: the config's eos ids
    window_tokens: int | None = None  # None: the config's
    prefill_chunk_tokens: int | None = None  # None: the config's

    def check(self, model: CloverModel) -> None:
        cfg = model.config
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("window_tokens", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for tid in self.stop_token_ids or ():
            if not 0 <= tid < cfg.vocab_size:
                raise ValueError(f"stop token id {tid} is outside the vocabulary (size {cfg.vocab_size})")
        if cfg.diffusion is not None:
            bs = cfg.diffusion.block_size
            if self.tokens_per_step is not None and not 1 <= self.tokens_per_step <= bs:
                raise ValueError(f"tokens_per_step must be in [1, block_size={bs}], got {self.tokens_per_step}")
            if self.chunk(model) % bs:
                raise ValueError(f"block_size {bs} does not divide prefill_chunk_tokens {self.chunk(model)}")
        elif self.tokens_per_step not in (None, 1):
            raise ValueError("tokens_per_step applies to diffusion models; this model is autoregressive")

    def chunk(self, model: CloverModel) -> int:
        return self.prefill_chunk_tokens or model.config.prefill_chunk_tokens

    def window(self, model: CloverModel) -> int:
        return self.window_tokens or model.config.window_tokens

    def stops(self, model: CloverModel) -> tuple[int, ...]:
        return model.config.eos_token_ids if self.stop_token_ids is None else tuple(self.stop_token_ids)


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


# ---- token selection (pure functions) ---------------------------------------------------------------------


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
        k = max(1, int(((conf >= threshold) & candidates_T).sum()))
    chosen = torch.zeros_like(candidates_T)
    chosen[conf.topk(k).indices] = True
    return chosen & candidates_T


@dataclass
class _Seq:
    """Bookkeeping of one sequence while decoding."""

    index: int
    prompt: list[int]
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    block: list[int] = field(default_factory=list)  # diffusion: the current block (prompt tail + masks)
    tail: int = 0  # diffusion: prompt tokens at the start of `block`
    last_logits: torch.Tensor | None = None  # logits of the last committed position [V]
    forwards: int = 0
    steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stopped: str = ""


class Engine:
    """Owns the model and the decode loop; `generate` is the public entry."""

    def __init__(self, model: CloverModel, options: DecodeOptions) -> None:
        self.model = model
        self.opt = options
        self.cfg = model.config
        self.stops = set(options.stops(model))
        self.window = options.window(model)

    # -- forward helpers --------------------------------------------------------------------------------------
    def _forward(self, ids: list[list[int]], state: CloverState | None, *, commit: bool, attention: str | None,
                 keep_logits: int | None):
        x = torch.tensor(ids, dtype=torch.long, device=self.model.device)
        return self.model(x, state, commit=commit, attention=attention, keep_logits=keep_logits,
                          window_tokens=self.window)

    def prefill(self, seq: _Seq, tokens: list[int], keep_last: bool) -> CloverState:
        """Run `tokens` through the model in chunks; keeps the last position's logits if asked."""
        t0 = time.perf_counter()
        state = self.model.empty_state(1)
        chunk = self.opt.chunk(self.model)
        for start in range(0, len(tokens), chunk):
            piece = tokens[start:start + chunk]
            last = start + chunk >= len(tokens)
            logits, state = self._forward([piece], state, commit=True, attention=None,
                                          keep_logits=1 if (last and keep_last) else 0)
            seq.forwards += 1
            if logits is not None:
                seq.last_logits = logits[0, -1].float()
        seq.prefill_s += time.perf_counter() - t0
        return state

    def _pick(self, seq: _Seq, logits_TV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = token_distribution(logits_TV, self.opt.temperature, self.opt.top_p)
        return sample_tokens(probs, self.opt.temperature, seq.generator)

    # -- autoregressive -----------------------------------------------------------------------------------------
    def run_autoregressive(self, seqs: list[_Seq]) -> None:
        states = [self.prefill(s, s.prompt, keep_last=True) for s in seqs]
        active, state = list(seqs), CloverState.concat(states)
        while active:
            t0, stepping = time.perf_counter(), list(active)
            nxt = []
            for s in active:
                tok, _ = self._pick(s, s.last_logits[None])
                s.steps += 1
                t = int(tok[0])
                if t in self.stops:
                    s.stopped = "eos"
                else:
                    s.out.append(t)
                    if len(s.out) >= self.opt.max_new_tokens:
                        s.stopped = "length"
                nxt.append(t)
            keep = [i for i, s in enumerate(active) if not s.stopped]
            if keep:
                if len(keep) < len(active):
                    state = state.select(keep)
                logits, state = self._forward([[nxt[i]] for i in keep], state, commit=True, attention="causal",
                                              keep_logits=1)
                active = [active[i] for i in keep]
                for row, s in enumerate(active):
                    s.last_logits = logits[row, -1].float()
                    s.forwards += 1
            else:
                active = []
            dt = time.perf_counter() - t0
            for s in stepping:
                s.decode_s += dt

    # -- diffusion ----------------------------------------------------------------------------------------------
    def run_diffusion(self, seqs: list[_Seq]) -> None:
        d = self.cfg.diffusion
        assert d is not None
        bs, mask = d.block_size, d.mask_token_id
        states = []
        for s in seqs:
            n_full = (len(s.prompt) // bs) * bs
            s.tail = len(s.prompt) - n_full
            s.block = s.prompt[n_full:] + [mask] * (bs - s.tail)
            if n_full:
                states.append(self.prefill(s, s.prompt[:n_full], keep_last=d.logits_shift))
            else:
                states.append(self.model.empty_state(1))
        active, state = list(seqs), CloverState.concat(states)
        while active:
            t0, stepping = time.perf_counter(), list(active)
            logits, _ = self._forward([s.block for s in active], state, commit=False, attention="block_causal",
                                      keep_logits=None)
            finished = []
            for row, s in enumerate(active):
                s.forwards += 1
                s.steps += 1
                if self.denoise_step(s, logits[row]):
                    finished.append(row)
            if finished:
                state, active = self.commit_blocks(state, active, finished)
            dt = time.perf_counter() - t0
            for s in stepping:
                s.decode_s += dt

    def _needed(self, s: _Seq) -> torch.Tensor:
        """Block positions that must be filled: masks, up to what max_new_tokens still allows."""
        mask = self.cfg.diffusion.mask_token_id  # type: ignore[union-attr]
        room = self.opt.max_new_tokens - len(s.out)
        needed = torch.zeros(len(s.block), dtype=torch.bool)
        needed[s.tail: s.tail + room] = True
        return needed & torch.tensor([t == mask for t in s.block])

    def denoise_step(self, s: _Seq, logits_TV: torch.Tensor) -> bool:
        """Fill some masked positions of s.block from this step's logits; True when the block is done."""
        d = self.cfg.diffusion
        assert d is not None
        logits = logits_TV.float().clone()
        if d.logits_shift:  # position t is predicted from t-1: the block's first from the last committed token
            first = s.last_logits if s.last_logits is not None else torch.zeros_like(logits[0])
            logits = torch.cat([first[None], logits[:-1]], dim=0)
        logits[:, d.mask_token_id] = -math.inf  # never "predict" a mask
        tok, conf = self._pick(s, logits)
        chosen = select_positions(conf, self._needed(s), self.opt.threshold, self.opt.tokens_per_step)
        for i in chosen.nonzero().flatten().tolist():
            s.block[i] = int(tok[i])
        return not bool(self._needed(s).any())

    def commit_blocks(self, state: CloverState, active: list[_Seq], rows: list[int]):
        """Record finished blocks; commit (one pass) those whose sequences go on. Returns (state, active)."""
        d = self.cfg.diffusion
        assert d is not None
        going_on = []
        for row in rows:
            s = active[row]
            new = s.block[s.tail:]
            cut = next((i for i, t in enumerate(new) if t in self.stops), None)
            if cut is not None:
                s.out.extend(new[:cut])
                s.stopped = "eos"
            else:
                s.out.extend(new[: self.opt.max_new_tokens - len(s.out)])
                if len(s.out) >= self.opt.max_new_tokens:
                    s.stopped = "length"
            if not s.stopped:
                going_on.append(row)
        rest = [i for i in range(len(active)) if i not in rows]
        parts, order = [], []
        if rest:
            parts.append(state.select(rest) if len(rest) < len(active) else state)
            order += [active[i] for i in rest]
        if going_on:
            sub = state.select(going_on)
            logits, sub = self._forward([active[i].block for i in going_on], sub, commit=True,
                                        attention="block_causal", keep_logits=1 if d.logits_shift else 0)
            for j, row in enumerate(going_on):
                s = active[row]
                s.forwards += 1
                if logits is not None:
                    s.last_logits = logits[j, -1].float()
                s.block, s.tail = [d.mask_token_id] * d.block_size, 0
            parts.append(sub)
            order += [active[i] for i in going_on]
        if not order:
            return state, []
        return (CloverState.concat(parts) if len(parts) > 1 else parts[0]), order


def _generator(seed: int, index: int) -> torch.Generator:
    """Sequence `index`'s own generator: a batch gives each prompt the draws it gets alone. Any int seed works."""
    return torch.Generator().manual_seed((seed * 7919 + index) % 2**63)


def generate(model: CloverModel, prompts: list[list[int]], *, max_new_tokens: int = 256, threshold: float = 0.9,
             tokens_per_step: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = None, stop_token_ids: list[int] | tuple[int, ...] | None = None,
             window_tokens: int | None = None, prefill_chunk_tokens: int | None = None) -> list[Generation]:
    """Generate for a batch of token-id prompts (any lengths). Diffusion or autoregressive by the model's config."""
    options = DecodeOptions(max_new_tokens=max_new_tokens, threshold=threshold, tokens_per_step=tokens_per_step,
                            temperature=temperature, top_p=top_p, seed=seed,
                            stop_token_ids=None if stop_token_ids is None else tuple(stop_token_ids),
                            window_tokens=window_tokens, prefill_chunk_tokens=prefill_chunk_tokens)
    options.check(model)
    check_prompts(model, prompts)
    engine = Engine(model, options)
    base = seed if seed is not None else secrets.randbits(62)  # not torch.seed(): that reseeds the global RNG
    seqs = [_Seq(index=i, prompt=[int(t) for t in p], generator=_generator(base, i) if temperature > 0 else None)
            for i, p in enumerate(prompts)]
    with torch.inference_mode():
        if model.config.is_diffusion:
            engine.run_diffusion(seqs)
        else:
            engine.run_autoregressive(seqs)
    window = options.window(model)
    return [Generation(tokens=s.out, forward_passes=s.forwards, denoising_steps=s.steps, prompt_tokens=len(s.prompt),
                       prefill_seconds=s.prefill_s, decode_seconds=s.decode_s,
                       windows=math.ceil(len(s.prompt) / window), stopped=s.stopped) for s in seqs]


def generate_nocache(model: CloverModel, prompt: list[int], **options) -> Generation:
    """Plain reference for one prompt: every step recomputes the whole sequence from an empty state.

    Same decisions as the engine (same selection functions), none of its state carrying, batching or chunking.
    Diffusion models need block-causal prompt attention here (one mask then covers prompt and blocks).
    """
    opt = DecodeOptions(**options)
    opt.check(model)
    check_prompts(model, [prompt])
    cfg, stops, window = model.config, set(opt.stops(model)), opt.window(model)
    gen = _generator(opt.seed or 0, 0) if opt.temperature > 0 else None
    seq = _Seq(index=0, prompt=list(prompt), generator=gen)
    engine = Engine(model, opt)

    def full_logits(ids: list[int], attention: str) -> torch.Tensor:
        seq.forwards += 1
        logits, _ = model(torch.tensor([ids], device=model.device), None, attention=attention, window_tokens=window)
        return logits[0].float()

    with torch.inference_mode():
        if cfg.diffusion is None:
            while not seq.stopped:
                tok, _ = engine._pick(seq, full_logits(seq.prompt + seq.out, "causal")[-1:])
                seq.steps += 1
                if int(tok[0]) in stops:
                    seq.stopped = "eos"
                else:
                    seq.out.append(int(tok[0]))
                    seq.stopped = "length" if len(seq.out) >= opt.max_new_tokens else ""
        else:
            if cfg.diffusion.prompt_attention != "block_causal":
                raise ValueError("generate_nocache supports block_causal prompt attention only")
            bs, mask = cfg.diffusion.block_size, cfg.diffusion.mask_token_id
            n_full = (len(prompt) // bs) * bs
            committed = list(prompt[:n_full])
            seq.tail = len(prompt) - n_full
            seq.block = list(prompt[n_full:]) + [mask] * (bs - seq.tail)
            while not seq.stopped:
                logits = full_logits(committed + seq.block, "block_causal")
                seq.last_logits = logits[len(committed) - 1] if committed else None
                seq.steps += 1
                if not engine.denoise_step(seq, logits[len(committed):]):
                    continue
                new = seq.block[seq.tail:]
                cut = next((i for i, t in enumerate(new) if t in stops), None)
                if cut is not None:
                    seq.out.extend(new[:cut])
                    seq.stopped = "eos"
                    break
                seq.out.extend(new[: opt.max_new_tokens - len(seq.out)])
                if len(seq.out) >= opt.max_new_tokens:
                    seq.stopped = "length"
                    break
                committed += seq.block
                seq.block, seq.tail = [mask] * bs, 0
    return Generation(tokens=seq.out, forward_passes=seq.forwards, denoising_steps=seq.steps,
                      prompt_tokens=len(prompt), prefill_seconds=0.0, decode_seconds=0.0,
                      windows=math.ceil(len(prompt) / window), stopped=seq.stopped)
