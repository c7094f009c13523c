"""The continuous-batching engine: requests joining and leaving a running batch give exactly what each gets alone;
slots are reused clean, bounded by the memory budget, and written in place."""

from __future__ import annotations

import asyncio

import pytest
import torch
from clover_batch.model import DecodeOptions, Engine, EngineCapacityError, Request, generate, load_model
from clover_batch.model.generate import generate_nocache, prompt_seed
from clover_batch.pipeline.serving import EngineLoop
from conftest import failing_on_token
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# lengths: a long prompt (many 16-token prefill chunks, far past the 24-token window), block-unaligned ones, one
# shorter than a block (no prefill at all) and one exactly a block
PROMPTS = {"long": _prompt(150, 1), "a": _prompt(25, 2), "b": _prompt(3, 3), "c": _prompt(40, 4), "d": _prompt(9, 5),
           "e": _prompt(8, 6)}
SMALL_WINDOW = dict(window_tokens=24, prefill_chunk_tokens=16)
MODES = {
    "threshold": ("tiny", DecodeOptions(max_new_tokens=21, threshold=0.0025, **SMALL_WINDOW)),
    "fixed-k3": ("tiny", DecodeOptions(max_new_tokens=21, tokens_per_step=3, **SMALL_WINDOW)),
    "autoregressive": ("tiny-ar", DecodeOptions(max_new_tokens=13, **SMALL_WINDOW)),
    "sampling": ("tiny", DecodeOptions(max_new_tokens=11, threshold=0.5, temperature=0.9, top_p=0.95, seed=7,
                                       **SMALL_WINDOW)),
    # Clover's layout: causal prefill and commits, the preview operator for denoising steps, shifted logits
    "clover-k3": ("tiny-clover", DecodeOptions(max_new_tokens=21, tokens_per_step=3, **SMALL_WINDOW)),
    "clover-penalties": ("tiny-clover", DecodeOptions(max_new_tokens=21, threshold=0.0025, repetition_penalty=1.3,
                                                      frequency_penalty=0.4, presence_penalty=0.2, **SMALL_WINDOW)),
    "clover-autoregressive": ("tiny-clover", DecodeOptions(max_new_tokens=13, mode="autoregressive", **SMALL_WINDOW)),
}


@pytest.fixture(scope="module")
def models():
    return {"tiny": load_model("tiny"), "tiny-ar": load_model("tiny-ar"), "tiny-clover": load_model("tiny-clover")}


def _alone(model, options, prompt):
    return generate(model, [prompt], options)[0]


def _request(name: str, options: DecodeOptions) -> Request:
    # the seed generate() gives a lone prompt, so sampled outputs are comparable too
    return Request(name, PROMPTS[name], seed=prompt_seed(options.seed or 0, 0))


def _run(engine: Engine, schedule: dict[int, list[str]], options: DecodeOptions, checks=None) -> dict:
    """Step the engine, adding the scheduled requests before step k; returns id -> Generation."""
    results, k = {}, 0
    while engine.has_work or any(step >= k for step in schedule):
        for name in schedule.get(k, []):
            if checks and name in checks:
                checks[name](engine)
            engine.add(_request(name, options))
        results.update(engine.step())
        k += 1
    return results


@pytest.mark.parametrize("mode", MODES, ids=MODES)
def test_staggered_arrivals_equal_each_prompt_alone(models, mode):
    name, options = MODES[mode]
    model = models[name]
    expected = {k: _alone(model, options, p) for k, p in PROMPTS.items()}
    seen = {}

    def long_is_prefilling(engine):  # "c" arrives while the long prompt is still prefilling, others decoding
        seen["prefilling"] = any(lv.req.id == "long" for lv in engine.prefilling)
        seen["decoding"] = len(engine.decoding)

    def mid_block(engine):  # "long" arrives while a decoding sequence is inside a block
        seen["mid"] = any(lv.steps > 0 and not lv.commit_next for lv in engine.decoding)

    engine = Engine(model, options, max_slots=4)
    results = _run(engine, {0: ["a", "b"], 4: ["long"], 7: ["c"], 12: ["d", "e"]}, options,
                   checks={"c": long_is_prefilling, "long": mid_block})
    assert seen == {"prefilling": True, "decoding": 2, "mid": True}
    for key, gen in results.items():
        assert gen.tokens == expected[key].tokens, key
        assert gen.denoising_steps == expected[key].denoising_steps, key
        assert gen.stopped == expected[key].stopped
    assert set(results) == set(PROMPTS)


@pytest.mark.parametrize("mode", ["fixed-k3", "clover-k3", "clover-penalties", "clover-autoregressive"])
def test_engine_equals_the_nocache_reference_with_a_small_window(models, mode):
    """Token for token, and for models whose causal logits score the next token, the mean log-probability under
    the trunk (the engine's, from its commit forwards or decode logits; the reference's, one causal forward)."""
    name, options = MODES[mode]
    engine = Engine(models[name], options, max_slots=3)
    results = _run(engine, {0: ["long", "a", "c"], 3: ["d"]}, options)
    for key, gen in results.items():
        ref = generate_nocache(models[name], PROMPTS[key], options)
        assert gen.tokens == ref.tokens, key
        if name == "tiny-clover":
            assert gen.mean_logprob == pytest.approx(ref.mean_logprob, abs=2e-5), key
            # each token's own, one per generated token: the engine's from its commits or decode logits
            assert len(gen.token_logprobs) == len(gen.tokens), key
            assert gen.token_logprobs == pytest.approx(ref.token_logprobs, abs=1e-4), key
        else:
            assert gen.mean_logprob is None and ref.mean_logprob is None
            assert gen.token_logprobs is None and ref.token_logprobs is None


def test_more_requests_than_slots_reuse_slots_cleanly(models):
    _, options = MODES["threshold"]
    model = models["tiny"]
    engine = Engine(model, options, max_slots=2)
    names = ["long", "a", "b", "c", "d", "e"]
    results = _run(engine, {0: names}, options)
    assert engine.stats.most_active == 2
    for key in names:
        assert results[key].tokens == _alone(model, options, PROMPTS[key]).tokens, key
    # a slot that held the long prompt (its ring wrapped around) carries nothing into the next occupant
    again = _run(engine, {0: ["d"]}, options)["d"]
    fresh = _run(Engine(model, options, max_slots=2), {0: ["d"]}, options)["d"]
    assert again.tokens == fresh.tokens and again.denoising_steps == fresh.denoising_steps


def test_cancel_frees_the_slot_and_leaves_the_others_alone(models):
    _, options = MODES["fixed-k3"]
    model = models["tiny"]
    engine = Engine(model, options, max_slots=2)
    engine.add(_request("a", options))
    engine.add(_request("c", options))
    engine.add(_request("d", options))  # waits: two slots
    results = {}
    for _ in range(4):
        results.update(engine.step())
    assert engine.active == 2 and [lv.req.id for lv in engine.waiting] == ["d"]
    assert engine.cancel("a") and not engine.cancel("a")
    assert engine.active == 1
    while engine.has_work:
        results.update(engine.step())
    assert set(results) == {"c", "d"}
    for key in ("c", "d"):
        assert results[key].tokens == _alone(model, options, PROMPTS[key]).tokens
    with pytest.raises(ValueError, match="already in flight"):
        engine.add(_request("b", options))
        engine.add(_request("b", options))


def test_restart_reruns_everything_in_flight_from_the_start(models):
    _, options = MODES["threshold"]
    model = models["tiny"]
    engine = Engine(model, options, max_slots=3)
    for key in ("long", "a", "c"):
        engine.add(_request(key, options))
    for _ in range(6):
        assert not engine.step()
    engine.restart()  # what the expert-parallel loop does after a worker died mid-step
    assert engine.active == 0 and len(engine.waiting) == 3
    results = _run(engine, {}, options)
    for key in ("long", "a", "c"):
        assert results[key].tokens == _alone(model, options, PROMPTS[key]).tokens


def test_memory_budget_bounds_the_active_slots(models):
    """The budget pays for slots (fixed state) and pages (keys and values): what the engine holds never exceeds it,
    and a budget without room for one sequence's slot and window is refused at the first request."""
    _, options = MODES["threshold"]
    model = models["tiny"]
    probe = Engine(model, options, max_slots=1, page_size=8)
    b, window_pages = probe.slot_bytes, probe.window_pages
    budget = 3 * b.fixed + window_pages * b.page + b.fixed // 2
    engine = Engine(model, options, memory_budget_bytes=budget, page_size=8)
    assert engine.num_slots == 3
    assert engine.num_slots * b.fixed + engine.num_pages * b.page <= budget
    for key in PROMPTS:
        engine.add(_request(key, options))
    while engine.has_work:
        engine.step()
        assert engine.active <= 3 and engine.slots.pool.used_pages <= engine.num_pages
    assert engine.stats.most_active == 3
    assert Engine(model, options, memory_budget_bytes=10 * budget, max_slots=2).num_slots == 2

    small = Engine(model, options, memory_budget_bytes=b.fixed + window_pages * b.page - 1, page_size=8)
    with pytest.raises(EngineCapacityError, match=r"one sequence needs .* MiB of slot state .* pages .* memory "
                                                  r"budget"):
        small.add(_request("a", options))


def test_bad_requests_are_refused_at_add(models):
    engine = Engine(models["tiny"], DecodeOptions(max_new_tokens=4), max_slots=1)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add(Request("x", []))
    with pytest.raises(ValueError, match=r"outside the vocabulary \(size 512\): \[512\]"):
        engine.add(Request("y", [1, 512]))
    assert not engine.has_work


class _StorageProbe(TorchDispatchMode):
    """Records every aten op that reads or writes the storages it watches."""

    def __init__(self, storages: dict[int, str]):
        super().__init__()
        self.storages, self.ops = storages, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages:
                self.ops.add((func.__name__, self.storages[a.untyped_storage().data_ptr()]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["fixed-k3", "autoregressive"])
def test_decode_steps_never_copy_the_caches(models, mode):
    """Slot and pool buffers keep their storage across steps, and a decode step touches the keys and values only by
    writing its new keys in place and gathering each row's live keys (whole pages per group of rows, or entry by
    entry: no cat or clone of the pool); the positions it records are written in place too."""
    name, options = MODES[mode]
    engine = Engine(models[name], options, max_slots=4, page_size=8)
    for key in ("long", "a", "c"):
        engine.add(_request(key, options))
    while len(engine.decoding) < 3:
        engine.step()
    slots = engine.slots
    ptrs = [t.data_ptr() for t in slots.buffers()]
    watched = {t.untyped_storage().data_ptr(): kind for kind, ts in (("kv", slots.keys), ("kv", slots.values))
               for t in ts if t is not None}
    watched[slots.pool_pos.untyped_storage().data_ptr()] = "pool_pos"
    probe = _StorageProbe(watched)
    with probe:
        for _ in range(3):
            assert engine.decoding and not engine.prefilling
            engine.step()
    assert [t.data_ptr() for t in slots.buffers()] == ptrs
    kv_ops = {op for op, kind in probe.ops if kind == "kv"}
    assert kv_ops <= {"index_copy_.default", "index_select.default", "view.default", "slice.Tensor",
                      "zero_.default"}, kv_ops
    assert ("index_select.default", "kv") in probe.ops  # read page by page
    assert ("index_copy_.default", "kv") in probe.ops  # the new keys were written in place
    assert {op for op, kind in probe.ops if kind == "pool_pos"} <= {"index_copy_.default", "slice.Tensor",
                                                                   "fill_.Scalar"}


def test_engine_loop_serves_concurrent_batches_and_isolates_a_failing_request(models):
    """Coroutines of several batches share one engine thread; a request whose step fails is found by rerunning
    the requests one at a time, and only it gets the error."""
    model = models["tiny"]
    poison = 77
    flaky = failing_on_token("tiny", poison)
    options = DecodeOptions(max_new_tokens=10, tokens_per_step=2)
    loop = EngineLoop(Engine(flaky, options, max_slots=3))
    prompts = [PROMPTS["a"], PROMPTS["c"], [poison] * 20, PROMPTS["d"], PROMPTS["b"]]

    async def batch(ps):
        return await asyncio.gather(*(loop.submit(p) for p in ps), return_exceptions=True)

    async def main():
        return await asyncio.gather(batch(prompts[:2]), batch(prompts[2:4]), batch(prompts[4:]))

    results = [g for b in asyncio.run(main()) for g in b]
    assert isinstance(results[2], RuntimeError) and "kernel failure" in str(results[2])
    for i in (0, 1, 3, 4):
        assert results[i].tokens == generate(model, [prompts[i]], options)[0].tokens


def test_engine_loop_builds_its_engine_on_its_own_thread_and_raises_a_build_error(models):
    """Given a builder, the loop loads the model on the engine thread (all of a replica's torch work on one
    thread); a builder that fails makes the constructor fail with its error, and no thread is left serving."""
    import threading

    threads = []
    options = DecodeOptions(max_new_tokens=6, tokens_per_step=2)

    def build():
        threads.append(threading.current_thread())
        return Engine(load_model("tiny"), options, max_slots=2)

    loop = EngineLoop(build)
    assert threads == [loop._thread] and threads[0] is not threading.current_thread()
    got = asyncio.run(loop.submit(PROMPTS["a"]))
    assert got.tokens == generate(models["tiny"], [PROMPTS["a"]], options)[0].tokens

    def broken():
        raise FileNotFoundError("no config.json in /nowhere")

    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        EngineLoop(broken)


def test_engine_loop_health_counts_steps_and_answers_while_the_engine_thread_is_stuck(models):
    """health() is what the stall watchdog asks a replica: the steps finished, the documents held, and the engine
    thread's state, read without waiting for that thread, even while it is stuck inside a step."""
    import threading
    import time

    from clover_batch.connectors.faults import hook

    options = DecodeOptions(max_new_tokens=6, tokens_per_step=2)
    loop = EngineLoop(Engine(models["tiny"], options, max_slots=2))
    time.sleep(0.2)
    idle = loop.health()
    assert (idle.state, idle.steps, idle.holding) == ("waiting for work", 0, 0)
    got = asyncio.run(loop.submit(PROMPTS["a"]))
    done = loop.health()
    assert done.steps == got.forward_passes > 0 and done.holding == 0

    stuck, release = threading.Event(), threading.Event()

    def hang() -> None:  # the engine thread, before its next step
        stuck.set()
        release.wait(30)

    async def while_stuck():
        task = asyncio.ensure_future(loop.submit(PROMPTS["c"]))
        while not stuck.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        seen = loop.health()  # answered at once, the engine thread still inside hang()
        release.set()
        return seen, await task

    with hook("engine_step", hang):
        seen, _ = asyncio.run(while_stuck())
    assert (seen.state, seen.steps, seen.holding) == ("stepping", done.steps, 1) and seen.state_seconds >= 0.3


@pytest.mark.parametrize("mode", ["threshold", "fixed-k3", "sampling", "logits-shift", "clover-k3",
                                  "clover-penalties"])
def test_merged_commits_equal_separate_commits(models, mode):
    """A finished block committed in the same forward as the next block's first denoising step gives exactly the
    tokens of the separate commit, one forward fewer per committed block (but the last: a shifted model commits
    its last block once more, only to score it, which has no next block to merge with)."""
    if mode == "logits-shift":
        model = load_model("tiny")
        d = model.config.diffusion
        model.config = model.config.replace(diffusion=type(d)(d.block_size, d.mask_token_id, logits_shift=True))
        options = MODES["fixed-k3"][1]
    else:
        name, options = MODES[mode]
        model = models[name]
    schedule = {0: ["a", "long"], 3: ["c", "b"], 8: ["d"]}
    separate = _run(Engine(model, options, max_slots=4, merge_commits=False), schedule, options)
    merged_engine = Engine(model, options, max_slots=4, merge_commits=True)
    merged = _run(merged_engine, schedule, options)
    assert merged_engine.merge_commits and not Engine(model, options, max_slots=1).merge_commits  # CPU default: off
    commits_seen = 0
    bs = model.config.diffusion.block_size
    scoring = int(model.config.diffusion.logits_shift)  # the last block's scoring commit, in both
    for key, gen in separate.items():
        assert merged[key].tokens == gen.tokens, key
        assert merged[key].denoising_steps == gen.denoising_steps, key
        tail = len(PROMPTS[key]) % bs
        blocks = -(-(tail + len(gen.tokens) + (gen.stopped == "eos")) // bs)
        commits = gen.forward_passes - merged[key].forward_passes  # merged: one forward fewer per commit but the last
        assert commits == blocks - 1, key
        prefill = gen.forward_passes - gen.denoising_steps - commits - scoring
        assert prefill >= _prefill_forwards(key, options), key  # chunks of 16 at most (packed: maybe smaller)
        assert (gen.mean_logprob is None) is not bool(scoring)
        if scoring:
            assert merged[key].mean_logprob == pytest.approx(gen.mean_logprob, abs=1e-5)
        commits_seen += commits
    assert commits_seen > 0


def _prefill_forwards(key: str, options: DecodeOptions) -> int:
    """Prefill chunks of a prompt: up to its last whole 8-token block, in 16-token chunks (a packed prefill step
    shares its token budget, so a prompt may take more, smaller pieces)."""
    whole = len(PROMPTS[key]) // 8 * 8
    return -(-whole // options.prefill_chunk_tokens)


@pytest.mark.parametrize("mode,merge", [("fixed-k3", False), ("threshold", True), ("autoregressive", False),
                                        ("clover-k3", False), ("clover-penalties", True)],
                         ids=["diffusion", "diffusion-merged", "autoregressive", "clover", "clover-merged"])
def test_static_shape_decode_step_equals_the_ordinary_step(models, mode, merge):
    """The decode step a CUDA graph captures (rows padded to a power of two with the slots after them, commits as a
    device mask, the whole ring read through masks), run eagerly here: the same tokens as the ordinary step, also
    while a prompt prefills in a padding slot."""
    name, options = MODES[mode]
    model = models[name]
    schedule = {0: ["a", "c", "b"], 4: ["long"], 9: ["d"]}
    # a, c and b prefill in one packed forward and decode together (3 rows: bucket 4)
    kw = dict(max_slots=6, merge_commits=merge, prefill_tokens_per_step=80)
    ordinary = _run(Engine(model, options, cuda_graphs=False, **kw), schedule, options)
    engine = Engine(model, options, cuda_graphs=True, **kw)
    static = _run(engine, schedule, options)
    assert engine.static is not None and not engine.static.capture
    assert {key[0] for key in engine.static.steps} >= {2, 4}  # padded buckets were used
    for key, gen in ordinary.items():
        assert static[key].tokens == gen.tokens, key
        assert static[key].denoising_steps == gen.denoising_steps, key
