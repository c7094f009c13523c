"""The continuous-batching engine, side by side in one run (bench preset, fp32, stop tokens off).

    python bench/engine.py --threads 2                 # everything below
    python bench/engine.py --parts mixed --requests 24 # a quicker look

Parts:
- mixed: N requests, prompt lengths log-uniform in [64, 4096], max_new_tokens uniform in [16, 256]: total tokens/s
  and requests/s of (a) static batches of 4 through the same engine (add 4, run to empty, repeat) and (b)
  continuous batching with 16 slots and with 64 (the engine's default: as many as memory allows, here every
  request at once), for each scheduling policy (decode steps per prefill step: 0 = prefill whenever possible,
  1 = alternate, 4). `prefill s`: the engine's time in prefill steps, which batching does not shorten much (the
  same prompt tokens in packed forwards either way). `identical` counts the requests whose output equals the
  static run's token for token: this random-weight model has near-ties (top two logits ~1e-4 apart), which a
  change of summation order (another batch, another padding of the keys read) can flip.
- ar16: autoregressive decode at 16 active sequences, ours vs transformers' generate at batch 16 on the same weights
  (greedy outputs checked identical first). Decode time = run(n tokens) - run(1 token), as bench/decode.py.
- prefill: 48 prompts of 64-2048 tokens (log-uniform), ours (the engine at the checkpoint's own window, 65,536,
  every prompt admitted at once, packed prefill) vs transformers' forward over length-sorted, left-padded batches
  of 8 (`logits_to_keep=1`), on one checkpoint written by `save_checkpoint` and read back by both; first tokens
  compared. Then, in a fresh process, peak RSS of our prefill against weights + the pages and slots it needs.
- capacity: documents of 2K, 16K and 128K tokens admitted in 60 GB at Clover-35B-A3B's shape (computed from the
  engine's own accounting, not run), with every slot reserving a whole window (before paged KV) and with pages.
- mixing: what vLLM's chunked prefill would gain here: one packed forward of a prefill chunk (C tokens of a
  prompt 1,024 tokens in) together with 16 decode rows (1 token each, 256 committed), against the two forwards
  the engine runs now (the chunk alone, then the 16 rows' decode step); on the slots directly, positions reset
  after each forward so every repeat does the same work.
- layout: what storing GEMM weights column-major on a CPU ([in, out] contiguous, the parameter a transposed view)
  would buy: a copy of the model so stored against it as loaded (row-major), decode at 16 sequences and the
  48-prompt prefill, the two sides taking turns rep by rep; then single GEMMs at decode and prefill sizes, which
  run with their weights in cache and so overstate what a decode step (weights streamed from memory) gains.
- reads: a decode step over 32 rows of the mixed corpus's lengths, attention reading whole pages per group of rows
  (rows of 1, 2, 3-4, 5-8, ... pages together) against entry by entry, every row padded to the longest (the
  reference); and a diffusion step over 20 such rows with denormal floats flushed to zero and kept, each side in
  fresh processes that set the mode before their first torch op.
- steps: decode step time with 1K vs 16K committed tokens per slot (8 slots, window 32K, diffusion k=4), and the
  share of the step spent copying state: every aten op that copies from or into the slot buffers (clone, copy_,
  index_copy_, scatter_, cat, index_select, ...) is timed inside the step, against the step's plain wall time.
- verified: decode of `mode: verified` (drafts at threshold 0.9, or k=4 with --verified-k) against autoregressive
  decoding at 1, 16 and 64 rows (--verified-rows), on `--verified-model` (default the bench-clover preset; a
  trained checkpoint such as the demo's shows what acceptance buys), prompts of 64 tokens, stop tokens off, the two
  modes taking turns rep by rep: decode tokens/s of each and their ratio (CPU), decode forwards per token of each
  and the forwards verified saves (what carries over to a GPU, where a decode forward costs reading the weights
  whatever its tokens), tokens verified per check (a round: the previews and one check), the share of checks that
  rejected no drafted token, and whether the outputs are identical (they must be).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import statistics
import tempfile
import time

import torch
from clover_batch.model import DecodeOptions, Engine, Request, generate, kernels, load_model, save_checkpoint
from clover_batch.model.moe import Experts
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

log = logging.getLogger("bench.engine")


def mixed_corpus(n: int, seed: int, lo: int = 64, hi: int = 4096) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        length = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        prompt = [rng.randrange(256) for _ in range(length)]
        reqs.append(Request(f"r{i}", prompt, max_new_tokens=rng.randint(16, 256)))
    return reqs


def drain(engine: Engine) -> dict:
    out = {}
    while engine.has_work:
        out.update(engine.step())
    return out


def run_static(model, options: DecodeOptions, reqs: list[Request], batch: int) -> tuple[float, dict, Engine]:
    engine = Engine(model, options, max_slots=batch)
    start, out = time.perf_counter(), {}
    for i in range(0, len(reqs), batch):
        for r in reqs[i:i + batch]:
            engine.add(r)
        out.update(drain(engine))
    return time.perf_counter() - start, out, engine


def run_continuous(model, options: DecodeOptions, reqs: list[Request], slots: int,
                   per_prefill: int) -> tuple[float, dict, Engine]:
    engine = Engine(model, options, max_slots=slots, decode_steps_per_prefill=per_prefill)
    start = time.perf_counter()
    for r in reqs:
        engine.add(r)
    out = drain(engine)
    return time.perf_counter() - start, out, engine


def part_mixed(args) -> list[str]:
    reqs = mixed_corpus(args.requests, seed=0)
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    lines = [f"mixed corpus: {len(reqs)} requests, {prompt_tokens} prompt tokens, "
             f"{sum(r.max_new_tokens for r in reqs)} new tokens; {args.preset} preset"]
    for label, preset, options in (("autoregressive", f"{args.preset}-ar", DecodeOptions(stop_token_ids=())),
                                   ("diffusion k=4", args.preset, DecodeOptions(tokens_per_step=4,
                                                                                stop_token_ids=()))):
        if label.split()[0] not in args.mixed_modes:
            continue
        model = load_model(preset, seed=0)
        runs = [("static batches of 4", *run_static(model, options, reqs, 4))]
        for slots in args.slots:
            for per_prefill in args.policies:
                runs.append((f"continuous {slots} slots, {per_prefill} decode/prefill",
                             *run_continuous(model, options, reqs, slots, per_prefill)))
        base_seconds, base_out, _ = runs[0][1:]
        lines.append(f"  {label}:")
        lines.append(f"  {'schedule':40} {'seconds':>8} {'prefill s':>9} {'tokens/s':>9} {'req/s':>7} "
                     f"{'vs static':>9} {'decode rows/step':>16} {'identical':>9}")
        for name, seconds, out, engine in runs:
            tokens = prompt_tokens + sum(len(g.tokens) for g in out.values())
            same = sum(out[k].tokens == base_out[k].tokens for k in base_out)
            rows = engine.stats.decode_rows / max(1, engine.stats.decode_steps)
            lines.append(f"  {name:40} {seconds:8.1f} {engine.stats.prefill_seconds:9.1f} {tokens / seconds:9.1f} "
                         f"{len(out) / seconds:7.3f} "
                         f"{base_seconds / seconds:8.2f}x {rows:16.1f} {f'{same}/{len(base_out)}':>9}")
            log.info("%s %s: %.1f s", label, name, seconds)
    return lines


def part_ar16(args) -> list[str]:
    from transformers import Qwen3_5MoeForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    ours = load_model(f"{args.preset}-ar", seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(ours, tmp)
        theirs = Qwen3_5MoeForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (16, 256), generator=gen).tolist()
    ids = torch.tensor(prompts)

    def run_ours(n: int):
        return generate(ours, prompts, max_new_tokens=n, stop_token_ids=[])

    def run_theirs(n: int):
        with torch.no_grad():
            return theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)

    check = run_theirs(16)[:, 256:].tolist()
    if [g.tokens for g in run_ours(16)] != check:
        raise SystemExit("greedy autoregressive output differs from transformers' generate at batch 16")
    N = args.new_tokens

    times = _decode_seconds({"ours": run_ours, "theirs": run_theirs}, N, args.reps)
    ours_s, theirs_s = times["ours"], times["theirs"]
    rate = lambda s: 16 * (N - 1) / s  # noqa: E731
    return [f"autoregressive decode at 16 sequences (prompt 256, {N} new tokens; greedy outputs identical):",
            f"  ours {rate(ours_s):.1f} tokens/s, transformers generate {rate(theirs_s):.1f} tokens/s: "
            f"{theirs_s / ours_s:.2f}x"]


def _prefill_prompts(n: int = 48, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [int(math.exp(rng.uniform(math.log(64), math.log(2048)))) for _ in range(n)]
    return [[rng.randrange(3, 256) for _ in range(t)] for t in lengths]


def _prefill_rss(path: str, threads: int, queue) -> None:
    """In a fresh process: RSS once the checkpoint is loaded, then peak RSS over our prefill of the 48 prompts."""
    kernels.model_threads(threads)
    model = load_model(path)
    for p in model.parameters():  # read every weight once: a memory-mapped checkpoint is resident only once read
        p.sum()
    prompts = _prefill_prompts()
    with open("/proc/self/status") as f:
        loaded = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    engine = Engine(model, DecodeOptions(max_new_tokens=1, stop_token_ids=()), max_slots=len(prompts))
    for i, p in enumerate(prompts):
        engine.add(Request(str(i), p))
    while engine.has_work:
        engine.step()
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec (a spawned child would report its parent's
    # peak); VmHWM belongs to the process's own address space
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    sb = engine.slot_bytes
    need = len(prompts) * sb.fixed + sum(-(-(len(p) + 1) // sb.page_size) for p in prompts) * sb.page
    queue.put((loaded, peak, need, engine.stats.peak_pages))


def part_prefill(args) -> list[str]:
    import multiprocessing

    from transformers import Qwen3_5MoeForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    prompts = _prefill_prompts()
    tokens = sum(len(p) for p in prompts)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(load_model(f"{args.preset}-ar", seed=0), tmp)
        ours = load_model(tmp)
        theirs = Qwen3_5MoeForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        window = DecodeOptions().window(ours.config)

        def run_ours() -> list[int]:
            return [g.tokens[0] for g in generate(ours, prompts, max_new_tokens=1, stop_token_ids=[])]

        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))

        def run_theirs() -> list[int]:
            first = [0] * len(prompts)
            with torch.no_grad():
                for b in range(0, len(order), 8):
                    group = order[b:b + 8]
                    width = max(len(prompts[i]) for i in group)
                    ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in group])
                    mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in group])
                    logits = theirs(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
                    for i, t in zip(group, logits[:, -1].argmax(-1).tolist(), strict=True):
                        first[i] = t
            return first

        got, want = run_ours(), run_theirs()  # warm-up, and the first tokens compared
        same = sum(a == b for a, b in zip(got, want, strict=True))
        ours_s = min(_timed(run_ours) for _ in range(args.reps))
        theirs_s = min(_timed(run_theirs) for _ in range(args.reps))
        lines += [f"prefill of 48 prompts of 64-2048 tokens ({tokens} tokens; our window {window}, the "
                  f"checkpoint's; first tokens equal for {same}/48):",
                  f"  ours {tokens / ours_s:.0f} tokens/s, transformers (length-sorted padded batches of 8) "
                  f"{tokens / theirs_s:.0f} tokens/s: {theirs_s / ours_s:.2f}x"]
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=_prefill_rss, args=(tmp, args.threads, queue))
        child.start()
        loaded, peak, need, peak_pages = queue.get()
        child.join()
    lines += [f"  peak RSS of our prefill (fresh process): {peak / 2**20:.0f} MiB; with the checkpoint loaded and read "
              f"{loaded / 2**20:.0f} MiB, + the prompts' pages and 48 slots {need / 2**20:.0f} MiB = "
              f"{(loaded + need) / 2**20:.0f} MiB: {peak / (loaded + need):.2f}x (peak pages taken: {peak_pages})"]
    return lines


def part_capacity(args) -> list[str]:
    from clover_batch.model.config import from_preset
    from clover_batch.model.engine import RESERVE_FRACTION
    from clover_batch.model.slots import slot_bytes

    cfg = from_preset("clover-35b-a3b")
    options = DecodeOptions()
    window, chunk = options.window(cfg), options.chunk(cfg)
    block = cfg.diffusion.block_size if cfg.diffusion is not None else 1
    forward = max(chunk, 2 * block) + block
    budget = 60 * 10**9
    sb = slot_bytes(cfg, torch.bfloat16, window=window, max_forward_tokens=forward, page_size=256)
    per_token = sb.page / sb.page_size
    whole_window = sb.fixed + (window + forward) * per_token  # before: every slot held a window of keys
    lines = [f"sequences admitted in 60 GB at clover-35b-a3b's shape (bf16, window {window}; computed): a slot's "
             f"fixed state {sb.fixed / 2**20:.1f} MiB, a page of 256 positions {sb.page / 2**20:.2f} MiB",
             f"  {'document':>10} {'whole windows':>14} {'pages':>8}"]
    for doc in (2048, 16384, 131072):
        # a decoding sequence holds its document's pages and its block's; a prefill chunk's pages are transient
        paged = int(budget * (1 - RESERVE_FRACTION) // sb.sequence(doc, window, 2 * block))
        lines.append(f"  {doc:>10} {int(budget // whole_window):>14} {paged:>8}")
    return lines


def part_mixing(args) -> list[str]:
    from clover_batch.model.slots import SlotState

    model = load_model(f"{args.preset}-ar", seed=0)
    cfg, dev = model.config, model.device
    rows, done, prompt_at = 16, 256, 1024
    chunks = [c for c in (64, 256, 1024) if c <= DecodeOptions().chunk(cfg)]
    state = SlotState(cfg, rows + 1, window=32768, max_forward_tokens=max(chunks), num_pages=64, page_size=256,
                      device=dev, dtype=model.dtype)
    gen = torch.Generator().manual_seed(5)
    ids = lambda *shape: torch.randint(3, 256, shape, generator=gen).to(dev)  # noqa: E731
    for slot in range(rows):
        state.grow(slot, done + 1)
    state.grow(rows, prompt_at + max(chunks))
    with torch.no_grad():  # the sequences' committed tokens, for real
        model.forward_slots(ids(1, rows * done + prompt_at), state.packed(0, [0] * (rows + 1), [done] * rows +
                            [prompt_at]), attention="causal", keep_logits=0)
    saved = state.positions.clone()
    lengths = [done] * rows

    def forward(fn) -> float:
        with torch.no_grad():
            start = time.perf_counter()
            fn()
            seconds = time.perf_counter() - start
        state.positions.copy_(saved)
        return seconds

    lines = [f"prefill chunk + 16 decode rows in one packed forward vs two forwards (ms, best of {args.reps + 2}):",
             f"  {'chunk':>6} {'chunk alone':>12} {'decode alone':>13} {'both, apart':>12} {'packed together':>16}"
             f" {'apart / together':>17}"]
    def row(c: int) -> str:
        x_chunk, x_dec, x_mix = ids(1, c), ids(rows, 1), ids(1, rows + c)

        def alone():
            model.forward_slots(x_chunk, state.packed(rows, [prompt_at], [c]), attention="causal", keep_logits=0,
                                logits_at=[c - 1])

        def decode():
            model.forward_slots(x_dec, state.rows(0, lengths, 1, None), attention="causal", keep_logits=1)

        def mixed():
            model.forward_slots(x_mix, state.packed(0, [*lengths, prompt_at], [*[1] * rows, c]), attention="causal",
                                keep_logits=0, logits_at=[*range(rows), rows + c - 1])

        for fn in (alone, decode, mixed):
            forward(fn)  # warm-up
        t_chunk, t_dec, t_mix = ([min(forward(fn) for _ in range(args.reps + 2)) for fn in (alone, decode, mixed)])
        return (f"  {c:>6} {t_chunk * 1e3:12.1f} {t_dec * 1e3:13.1f} {(t_chunk + t_dec) * 1e3:12.1f} "
                f"{t_mix * 1e3:16.1f} {(t_chunk + t_dec) / t_mix:16.2f}x")

    lines += [row(c) for c in chunks]
    return lines


def part_layout(args) -> list[str]:
    import copy

    row = load_model(f"{args.preset}-ar", seed=0)
    col = copy.deepcopy(row)
    with torch.no_grad():
        for module in col.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.data = module.weight.data.t().contiguous().t()
            elif isinstance(module, Experts):
                for p in (module.gate_up_proj, module.down_proj):
                    p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (16, 256), generator=gen).tolist()
    N = args.new_tokens

    def decoder(model):
        return lambda n: generate(model, prompts, max_new_tokens=n, stop_token_ids=[])

    pre = _prefill_prompts()

    def prefiller(model):
        return lambda: generate(model, pre, max_new_tokens=1, stop_token_ids=[])

    if [g.tokens for g in generate(row, prompts, max_new_tokens=16, stop_token_ids=[])] != \
            [g.tokens for g in generate(col, prompts, max_new_tokens=16, stop_token_ids=[])]:
        raise SystemExit("greedy output differs between the two layouts")
    d = _decode_seconds({"row": decoder(row), "col": decoder(col)}, N, args.reps)
    pf = _alternating({"row": prefiller(row), "col": prefiller(col)}, args.reps)
    d_row, d_col, p_row, p_col = d["row"], d["col"], pf["row"], pf["col"]

    def stepping(model) -> Engine:  # 16 sequences decoding (prompts of 256), past their prefill
        engine = Engine(model, DecodeOptions(max_new_tokens=10_000, stop_token_ids=()), max_slots=16)
        for i, prompt in enumerate(prompts):
            engine.add(Request(str(i), prompt))
        while engine.waiting or engine.prefilling:
            engine.step()
        return engine

    engines = {"row": stepping(row), "col": stepping(col)}
    steps: dict[str, list[float]] = {"row": [], "col": []}
    for _ in range(3 * args.reps):
        for name, engine in engines.items():
            steps[name].append(statistics.median(_timed(engine.step) for _ in range(10)))
    s_row, s_col = min(steps["row"]), min(steps["col"])
    tokens = sum(len(p) for p in pre)
    lines = ["GEMM weights column-major vs row-major (as loaded), same values (greedy outputs identical):",
             f"  decode at 16 sequences: {16 * (N - 1) / d_col:.1f} vs {16 * (N - 1) / d_row:.1f} tokens/s: "
             f"{d_row / d_col:.2f}x",
             f"  prefill of 48 prompts ({tokens} tokens): {tokens / p_col:.0f} vs {tokens / p_row:.0f} tokens/s: "
             f"{p_row / p_col:.2f}x",
             f"  one decode step of 16 rows (best median of 10 steps, {3 * args.reps} turns): {s_col * 1e3:.1f} vs "
             f"{s_row * 1e3:.1f} ms: {s_row / s_col:.2f}x",
             "  single GEMMs x @ W.T (x [M, in], W [out, in]); us per call, row-major / column-major:"]
    D, cfg = col.config.hidden_size, col.config
    shapes = [("GDN in_proj_qkv", cfg.linear_num_key_heads * cfg.linear_key_head_dim * 2
               + cfg.linear_num_value_heads * cfg.linear_value_head_dim, D), ("lm_head", cfg.vocab_size, D),
              ("shared expert down", D, cfg.shared_expert_intermediate_size)]

    def per_call(x: torch.Tensor, w: torch.Tensor, reps: int) -> float:
        return min(_timed(lambda: [torch.nn.functional.linear(x, w) for _ in range(reps)]) for _ in range(3)) / reps

    for M in (1, 4, 16, 64, 2048):
        cells = []
        for name, n_out, n_in in shapes:
            x, w = torch.randn(M, n_in), torch.randn(n_out, n_in)
            reps = max(3, 2000 // M)
            t_row, t_col = per_call(x, w, reps), per_call(x, w.t().contiguous().t(), reps)
            cells.append(f"{name} {n_out}x{n_in}: {t_row * 1e6:.0f}/{t_col * 1e6:.0f} ({t_row / t_col:.2f}x)")
        lines.append(f"    M={M}: " + "; ".join(cells))
    return lines


def _alternating(runs: dict, reps: int) -> dict:
    """Best seconds of each named callable, the callables taking turns rep by rep: on a shared machine a slow spell
    then lands on both sides instead of on whichever ran during it."""
    best = dict.fromkeys(runs, math.inf)
    for _ in range(reps):
        for name, fn in runs.items():
            best[name] = min(best[name], _timed(fn))
    return best


def _decode_seconds(runs: dict, N: int, reps: int) -> dict:
    """Decode time of each `run(n)` as run(N) - run(1) (the prefill cancels), sides alternating."""
    for run in runs.values():
        run(1)  # warm-up
    best = _alternating({(name, n): (lambda run=run, n=n: run(n)) for name, run in runs.items() for n in (N, 1)},
                        reps)
    return {name: best[(name, N)] - best[(name, 1)] for name in runs}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


COPY_OPS = {"clone", "copy_", "index_copy_", "index_copy", "scatter_", "scatter", "cat", "index_select", "index",
            "gather", "index_put_", "_to_copy", "contiguous", "repeat_interleave", "expand_copy"}


class CopyTimer(TorchDispatchMode):
    """Times every copying aten op that reads or writes one of the watched storages."""

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages, self.seconds, self.calls = storages, 0.0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        watched = name in COPY_OPS and any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages
            for a in tree_flatten((args, kwargs or {}))[0])
        if not watched:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - start
        self.calls[name] = self.calls.get(name, 0) + 1
        return out


def part_steps(args) -> list[str]:
    model = load_model(args.preset, seed=0)
    lines = ["diffusion decode step (k=4, block 32), 8 slots, window 32768:",
             f"  {'committed/slot':>14} {'step ms':>8} {'copy ms':>8} {'copy share':>10}  copying ops"]
    for committed in args.step_lengths:
        options = DecodeOptions(tokens_per_step=4, stop_token_ids=(), window_tokens=32768, max_new_tokens=256)
        engine = Engine(model, options, max_slots=8, decode_steps_per_prefill=0)
        gen = torch.Generator().manual_seed(committed)
        for i in range(8):
            engine.add(Request(f"s{i}", torch.randint(0, 256, (committed,), generator=gen).tolist()))
        while engine.prefilling or engine.waiting:
            engine.step()
        engine.step()  # first decode step (warm-up)
        times = [_timed(engine.step) for _ in range(args.steps)]
        step_s = sorted(times)[len(times) // 2]
        storages = {t.untyped_storage().data_ptr() for t in engine.slots.buffers()}
        r = engine.runner
        storages |= {t.untyped_storage().data_ptr() for t in (r.logits, r.block, r.limit)}
        timer = CopyTimer(storages)
        with timer:
            for _ in range(args.steps):
                engine.step()
        copy_s = timer.seconds / args.steps
        ops = ", ".join(f"{k} x{v // args.steps}" for k, v in sorted(timer.calls.items()))
        lines.append(f"  {committed:14d} {step_s * 1e3:8.1f} {copy_s * 1e3:8.2f} {copy_s / step_s:9.1%}  {ops}")
        log.info("steps at %d: %.1f ms", committed, step_s * 1e3)
    return lines


def _mixed_engine(preset: str, n: int, options: DecodeOptions) -> Engine:
    """n requests of the mixed corpus (prompts of 64-4,096 tokens), all decoding, past their prefill."""
    engine = Engine(load_model(preset, seed=0), options, max_slots=n, decode_steps_per_prefill=0)
    for r in mixed_corpus(n, seed=0):
        engine.add(Request(r.id, r.prompt_ids, max_new_tokens=100_000))
    while engine.waiting or engine.prefilling:
        engine.step()
    engine.step()  # warm-up
    return engine


def _diffusion_steps(preset: str, flush: bool, threads: int, steps: int, queue) -> None:
    """In a fresh process whose torch threads flush denormals or keep them (set before any torch op: a thread's
    OpenMP workers copy the mode when they are created): the best median of `steps` diffusion decode steps over 20
    rows of the mixed corpus, three times."""
    torch.set_flush_denormal(flush)
    torch.set_num_threads(threads)
    engine = _mixed_engine(preset, 20, DecodeOptions(tokens_per_step=4, stop_token_ids=(), max_new_tokens=100_000))
    queue.put(min(statistics.median(_timed(engine.step) for _ in range(steps)) for _ in range(3)))


def part_reads(args) -> list[str]:
    """Decode steps over rows of mixed lengths: attention reading whole pages per group of rows against reading
    entry by entry (every row padded to the longest), the two taking turns on one engine, each turn the median of
    `--steps` steps; and diffusion steps with and without denormals flushed, in fresh processes taking turns (one
    process cannot switch: its torch threads keep the mode they started with, and a second set of torch threads
    in it would compete with the first for the cores)."""
    import multiprocessing

    ar = _mixed_engine(f"{args.preset}-ar", 32, DecodeOptions(stop_token_ids=(), max_new_tokens=100_000))
    assert ar.slots is not None
    lengths = sorted(lv.length for lv in ar.decoding)
    best = {True: math.inf, False: math.inf}
    for _ in range(3 * args.reps):
        for pages in (True, False):
            ar.slots.read_pages = pages
            best[pages] = min(best[pages], statistics.median(_timed(ar.step) for _ in range(args.steps)))
    lines = [f"autoregressive decode step over 32 rows of {lengths[0]}-{lengths[-1]} committed tokens:",
             f"  whole pages per group of rows {best[True] * 1e3:.1f} ms, entry by entry {best[False] * 1e3:.1f} ms: "
             f"{best[False] / best[True]:.2f}x"]
    del ar
    ctx = multiprocessing.get_context("spawn")
    best = {True: math.inf, False: math.inf}
    for _ in range(args.reps):
        for flush in (True, False):
            queue = ctx.Queue()
            child = ctx.Process(target=_diffusion_steps, args=(args.preset, flush, args.threads, args.steps, queue))
            child.start()
            best[flush] = min(best[flush], queue.get())
            child.join()
    lines += ["diffusion decode step (k=4, block 32) over 20 rows of the same corpus, fresh processes:",
              f"  denormals flushed {best[True] * 1e3:.1f} ms, kept {best[False] * 1e3:.1f} ms: "
              f"{best[False] / best[True]:.2f}x"]
    return lines


def part_verified(args) -> list[str]:
    model = load_model(args.verified_model, seed=0)
    draft = {"tokens_per_step": args.verified_k} if args.verified_k else {"threshold": 0.9}
    modes = {"autoregressive": DecodeOptions(mode="autoregressive", stop_token_ids=(),
                                             max_new_tokens=args.new_tokens),
             "verified": DecodeOptions(mode="verified", stop_token_ids=(), max_new_tokens=args.new_tokens, **draft)}
    gen = torch.Generator().manual_seed(5)
    lines = [f"verified vs autoregressive decode, {args.verified_model} ({model.config.diffusion.block_size}-token "
             f"blocks, drafts {draft}), prompts of 64 tokens, {args.new_tokens} new tokens, best of {args.reps}:",
             f"  {'rows':>4} {'AR tok/s':>9} {'ver tok/s':>9} {'CPU ratio':>9} {'AR fwd/tok':>10} "
             f"{'ver fwd/tok':>11} {'fwd saved':>9} {'tok/check':>10} {'full':>6} {'identical':>9}"]
    for rows in args.verified_rows:
        prompts = torch.randint(3, 256, (rows, 64), generator=gen).tolist()
        best: dict[str, tuple[float, Engine, dict]] = {}
        for _ in range(args.reps):
            for name, options in modes.items():  # the modes take turns
                engine = Engine(model, options, max_slots=rows)
                for i, p in enumerate(prompts):
                    engine.add(Request(str(i), p))
                out = drain(engine)
                if name not in best or engine.stats.decode_seconds < best[name][0]:
                    best[name] = (engine.stats.decode_seconds, engine, out)
        (ar_s, _, ar_out), (ve_s, ve_e, ve_out) = best["autoregressive"], best["verified"]
        tokens = sum(len(g.tokens) for g in ar_out.values())
        same = sum(ar_out[k].tokens == ve_out[k].tokens for k in ar_out)
        ar_f = sum(g.decode_forwards for g in ar_out.values()) / tokens
        ve_f = sum(g.decode_forwards for g in ve_out.values()) / tokens
        blocks = ve_e.stats.verified_blocks
        lines.append(f"  {rows:4d} {tokens / ar_s:9.1f} {tokens / ve_s:9.1f} {ar_s / ve_s:8.2f}x {ar_f:10.2f} "
                     f"{ve_f:11.2f} {1 - ve_f / ar_f:8.0%} {ve_e.stats.accepted_tokens / blocks:10.2f} "
                     f"{ve_e.stats.full_blocks / blocks:6.0%} {f'{same}/{rows}':>9}")
        log.info("verified: %s", lines[-1].strip())  # each row count's line as soon as it is measured
    lines.append("  fwd/tok: decode forwards per generated token of one row (verified: previews and checks, a "
                 "complete block's commit riding in the next round's first forward; autoregressive: 1); fwd saved: "
                 "1 - verified's / autoregressive's; a step of many rows runs their forwards together, so engine "
                 "forwards are fewer than the rows' sum")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench", help="diffusion preset; PRESET-ar is its autoregressive twin")
    ap.add_argument("--parts", nargs="+",
                    default=["mixed", "ar16", "prefill", "capacity", "mixing", "steps", "layout", "reads"])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--mixed-modes", nargs="+", default=["autoregressive", "diffusion"])
    ap.add_argument("--slots", type=int, nargs="+", default=[16, 64],
                    help="mixed: the continuous engine's max_slots (64: the engine's default, as many as fit)")
    ap.add_argument("--policies", type=int, nargs="+", default=[0, 1, 4], help="decode steps per prefill step")
    ap.add_argument("--new-tokens", type=int, default=64, help="ar16: tokens per sequence")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--step-lengths", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verified-model", default="bench-clover", help="verified: a Clover-layout preset or checkpoint")
    ap.add_argument("--verified-rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--verified-k", type=int, default=None, help="verified: draft k tokens per step (default: "
                                                                 "threshold 0.9)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kernels.model_threads(args.threads)
    log.info("torch %s, %d threads, load average %s", torch.__version__, torch.get_num_threads(),
             " ".join(f"{x:.1f}" for x in os.getloadavg()))
    lines = []
    for part in args.parts:
        parts = {"mixed": part_mixed, "ar16": part_ar16, "prefill": part_prefill, "capacity": part_capacity,
                 "mixing": part_mixing,
                 "steps": part_steps, "layout": part_layout, "reads": part_reads, "verified": part_verified}
        lines += [*parts[part](args), ""]
    print("\n".join(lines))  # the report is this script's output


if __name__ == "__main__":
    main()
