"""The GPU benchmark scripts run end to end at tiny shapes on the CPU (so they do not rot between GPU sessions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_attention_smoke(tmp_path):
    out = tmp_path / "bench_attention.json"
    cmd = [sys.executable, str(ROOT / "scripts/bench_attention.py"), "--smoke", "--tier1", "jnp", "--out", str(out),
           "--impls", "jax_xla_bf16", "naive", "certified", "certified_rung1"]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                   timeout=600)
    result = json.loads(out.read_text())
    impls = {(r["impl"], r["data"]) for r in result["rows"]}
    assert impls == {("jax_xla_bf16", "gaussian"), ("naive", "gaussian"), ("certified", "gaussian"),
                     ("certified", "peaked"), ("certified_rung1", "gaussian")}, impls
    assert not result["errors"]
    forced = next(r for r in result["rows"] if r["impl"] == "certified_rung1")
    assert forced["rungs"][0] == 0 and sum(forced["rungs"]) > 0  # min_rung=1: no head answered at rung 0
    for key in ("device", "jax", "measured_bandwidth_Bps"):
        assert key in result
