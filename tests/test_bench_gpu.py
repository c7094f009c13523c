"""bench/gpu.py, the one-shot GPU benchmark, kept working on CPU: every section runs and lands in the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_dry_run_on_cpu_writes_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--device", "cpu", "--preset", "tiny",
                           "--quick", "--budget-s", "3000", "--out", str(out)], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    for key in ("env", "prefill", "decode", "shares", "kernels", "memory", "transformers", "rooflines"):
        assert key in summary, key
        assert "error" not in summary[key] and "skipped" not in summary[key], (key, summary[key])
    assert set(summary["prefill"]) >= {"64", "128"}
    cells = {f"{mode}/{slots}" for mode in ("ar", "k4", "k8", "t0.9") for slots in (1, 8, 32)}
    assert cells <= set(summary["decode"])
    for cell in cells:
        figures = summary["decode"][cell]
        assert figures["tokens_per_s"] > 0 and figures["weight_bytes_touched"] > 0, (cell, figures)
        assert 0 < figures["fraction_of_bandwidth_limit"]
    assert summary["decode"]["k4/8"]["tokens_per_forward"] > summary["decode"]["ar/8"]["tokens_per_forward"]
    for part in ("prefill_chunk", "decode_step"):
        shares = summary["shares"][part]
        assert abs(sum(shares[k] for k in ("gdn", "attention", "moe", "other")) - 1) < 0.01
    assert summary["transformers"]["tokens_per_s"] > 0
