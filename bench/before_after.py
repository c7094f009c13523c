"""A bench script run on two versions of the code, taking turns, in one run: did a change make anything slower?

    python bench/before_after.py a56bc85 -- bench/engine.py --parts ar16 prefill mixed --threads 2
    python bench/before_after.py HEAD~1 --rounds 3 -- bench/engine.py --parts mixed --requests 24

The "before" side is the given git revision, checked out into a temporary worktree (its own bench script and its
own package, imported from there); the "after" side is this working tree. Each round runs before, then after, each
in a fresh process, so both see the same machine state on average; every round's ratios are printed.

It prints the after side's output, and after every line holding numbers the ratio after / before of each number in
it (the numbers of the two outputs are matched by position, line by line; a line whose numbers differ in count is
shown for both sides). Whether a ratio above 1 is better depends on the column (tok/s: yes; seconds: no), so the
columns are named by the bench script's own header lines, printed as they are.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def run(tree: Path, argv: list[str], timeout_s: float) -> list[str]:
    """The bench script's stdout lines, run from `tree` with `tree`'s package first on the path; a run past
    `timeout_s` is stopped and named."""
    env = dict(os.environ, PYTHONPATH=str(tree.parent / "_pkg") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        out = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True, check=False,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{tree}: {' '.join(argv)} ran past --timeout-s {timeout_s:.0f} s; stopped") from None
    if out.returncode:
        raise SystemExit(f"{tree}: {' '.join(argv)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout.splitlines()


def link_package(tree: Path) -> None:
    """`clover_batch` importable from tree's sources, laid out as pyproject's package-dir says (the package is
    api/, its subpackages model/, pipeline/, jobs/, connectors/): a folder of links beside the tree."""
    pkg = tree.parent / "_pkg" / "clover_batch"
    pkg.mkdir(parents=True, exist_ok=True)
    for f in (tree / "api").iterdir():
        if f.suffix == ".py":
            (pkg / f.name).symlink_to(f)
    for sub in ("model", "pipeline", "jobs", "connectors"):
        (pkg / sub).symlink_to(tree / sub, target_is_directory=True)


def numbers(line: str) -> list[float]:
    return [float(x) for x in NUMBER.findall(line)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("revision", help="the before side: a git revision of this repository")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=3600, help="most seconds one run of the bench may take")
    if "--" not in sys.argv:
        ap.error("give the bench script and its arguments after --")
    cut = sys.argv.index("--")
    args, argv = ap.parse_args(sys.argv[1:cut]), sys.argv[cut + 1:]
    with tempfile.TemporaryDirectory() as tmp:
        before_tree, after_tree = Path(tmp) / "before" / "repo", Path(tmp) / "after" / "repo"
        before_tree.parent.mkdir()
        after_tree.parent.mkdir()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(before_tree),
                        args.revision], check=True, timeout=300)
        after_tree.symlink_to(ROOT, target_is_directory=True)
        try:
            for tree in (before_tree, after_tree):
                link_package(tree)
            best: dict[str, list[list[str]]] = {"before": [], "after": []}
            for r in range(args.rounds):
                for side, tree in (("before", before_tree), ("after", after_tree)):
                    print(f"round {r + 1}: {side}", file=sys.stderr, flush=True)
                    best[side].append(run(tree, argv, args.timeout_s))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before_tree)], check=False,
                           timeout=300)
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.revision], capture_output=True,
                         text=True, check=False, timeout=60).stdout.strip()
    print(f"before: {args.revision} ({rev}); after: this working tree; {args.rounds} rounds, taking turns; "
          f"ratios after / before of each number, round by round")
    for lines in zip(*best["after"], *best["before"], strict=False):
        after_lines, before_lines = lines[:args.rounds], lines[args.rounds:]
        print(after_lines[0])
        a_nums = [numbers(x) for x in after_lines]
        b_nums = [numbers(x) for x in before_lines]
        if not a_nums[0] or any(len(x) != len(a_nums[0]) for x in a_nums + b_nums):
            if a_nums[0]:
                for i, x in enumerate(before_lines):
                    print(f"    before, round {i + 1}: {x.strip()}")
            continue
        for i, (a, b) in enumerate(zip(a_nums, b_nums, strict=True)):
            ratios = " ".join(f"{x / y:.2f}" if y else "-" for x, y in zip(a, b, strict=True))
            print(f"    after/before, round {i + 1}: {ratios}")


if __name__ == "__main__":
    main()
