"""The GPU path on a CPU: fla's Triton kernels under Triton's interpreter, flex_attention compiled for the CPU.

These tests run in an environment of their own (torch, triton, fla-core, einops, numpy, packaging, this project
without its test extra; .ci/run builds it), never in the main one: with fla and triton importable on a CPU machine
transformers' Qwen3.5 reference crashes ("0 active drivers"). The main suite's testpaths do not include this folder.

    TRITON_INTERPRET=1 CLOVER_KERNELS=fla CLOVER_ATTENTION=flex python -m pytest -q tests_interpret

The three variables are set here when unset (TRITON_INTERPRET must be set before triton is imported: `@triton.jit`
reads it when fla's modules are imported); any other value stops the run, since the tests compare that process-wide
choice against the torch kernels and dense masks forced in the same process.

Two behaviours of triton 3.9's interpreter stop fla-core 0.6.0's kernels and a third makes them twice as slow as
they need to be; all three are patched here, for these tests only, never in the model package:
- The autotuner times every config on the active driver, and the interpreter has none ("0 active drivers"):
  `Autotuner.prune_configs` keeps one config, so nothing is timed: the one with the largest tiles (product of its
  integer meta-parameters), since the interpreter runs programs one after another in Python and its time grows
  with their count (fla's conv: 8x fewer programs than with the first config). It ignores num_warps and
  num_stages; block sizes only change how the same sums are tiled and masked.
- A `range` loop's induction variable is a tensor in compiled Triton but a Python int in the interpreter, so fla's
  chunked kernel stops at `i_t.to(tl.int64)` (fla/ops/common/chunk_delta_h.py): the interpreter's AST rewriter
  (which already passes every assignment through `interpreter_semantic.to_tensor`) is extended to rebind the target
  of `for x in range(...)` / `tl.range(...)` the same way at the top of the loop body.
- Every call of a nested `@triton.jit` function (fla's `exp`, ...) patches triton.language again (and never
  restores it), although the launch around it has patched it already: half the time of fla's fused recurrent
  kernel. The call skips the patching when every language module its globals use is patched by the launch in
  progress (results are bit-identical); a launch still patches, and restores, as before.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import os
from collections.abc import Iterator

import pytest

REQUIRED_ENV = {"TRITON_INTERPRET": "1", "CLOVER_KERNELS": "fla", "CLOVER_ATTENTION": "flex"}
for _name, _value in REQUIRED_ENV.items():
    os.environ.setdefault(_name, _value)
# flex's C++ kernels without a precompiled header: building one for a fresh virtualenv (CI makes one every run) costs
# more CPU (~60 s here) than the five flex compiles of these tests save by it (~3 s each)
os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")

MISSING = [name for name in ("triton", "fla", "einops", "numpy") if importlib.util.find_spec(name) is None]


def pytest_configure(config: pytest.Config) -> None:
    wrong = {k: os.environ[k] for k, v in REQUIRED_ENV.items() if os.environ[k].strip().lower() != v}
    if wrong:
        raise pytest.UsageError(f"tests_interpret compares {REQUIRED_ENV} against the torch path; got {wrong}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if MISSING:
        skip = pytest.mark.skip(reason=f"needs the interpreter environment (.ci/run builds it): {MISSING} missing")
        for item in items:
            item.add_marker(skip)


def _largest_tiles_only():
    from triton.runtime import autotuner

    prune = autotuner.Autotuner.prune_configs

    def largest_tiles(self, kwargs):
        configs = prune(self, kwargs)
        return [max(configs, key=lambda c: math.prod(v for v in c.kwargs.values() if isinstance(v, int)))]

    return autotuner.Autotuner, "prune_configs", largest_tiles


def _loop_targets_as_tensors():
    from triton.runtime import interpreter

    class LoopTargetsAsTensors(interpreter.ASTTransformer):
        """`for i in range(n): body` -> `for i in range(n): i = interpreter_semantic.to_tensor(i, False); body`."""

        def visit_For(self, node: ast.For) -> ast.For:
            node = self.generic_visit(node)
            func = node.iter.func if isinstance(node.iter, ast.Call) else None
            is_range = (isinstance(func, ast.Name) and func.id == "range") or \
                (isinstance(func, ast.Attribute) and func.attr == "range")
            if is_range and isinstance(node.target, ast.Name):
                to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                          ctx=ast.Load())
                rebind = ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                                    value=ast.Call(func=to_tensor, args=[ast.Name(id=node.target.id, ctx=ast.Load()),
                                                                         ast.Constant(value=False)], keywords=[]))
                node.body.insert(0, ast.copy_location(rebind, node))
            return node

    return interpreter.FunctionRewriter, "ast_transformer", LoopTargetsAsTensors()


def _language_patched_once_per_launch():
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang
    languages = (interpreter.tl, interpreter.tl.core)
    active: set[int] = set()  # the language modules the launch in progress has patched

    class LaunchScope:
        def __init__(self, scope, patched: set[int]) -> None:
            self.scope, self.patched = scope, patched

        def restore(self) -> None:
            self.scope.restore()
            active.difference_update(self.patched)

    class NothingToRestore:
        def restore(self) -> None:
            pass

    def patch_lang_once(fn):
        used = {id(m) for m in fn.__globals__.values() if inspect.ismodule(m) and m in languages}
        if used and used <= active:
            return NothingToRestore()  # a device function called inside a launch that patched its language
        active.update(used)
        return LaunchScope(patch_lang(fn), used)

    return interpreter, "_patch_lang", patch_lang_once


@pytest.fixture(scope="session", autouse=True)
def interpreter_patches() -> Iterator[None]:
    """The patches of the module docstring, for the whole session."""
    if MISSING:
        yield
        return
    from triton.runtime import interpreter

    with pytest.MonkeyPatch.context() as mp:
        for target, name, value in (_largest_tiles_only(), _loop_targets_as_tensors(),
                                    _language_patched_once_per_launch()):
            mp.setattr(target, name, value)
        interpreter.InterpretedFunction.rewritten_fn.clear()  # rewritten again, through the patched rewriter
        yield
    interpreter.InterpretedFunction.rewritten_fn.clear()


@pytest.fixture
def launched() -> Iterator[list[str]]:
    """Names of the Triton kernels the interpreter runs during the test, in launch order."""
    from triton.runtime import interpreter

    names: list[str] = []
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.InterpretedFunction, "run", recording)
        yield names
