"""Shared setup of the 2026-12-07 sampling / generate-semantics audit (reviewer scripts; they import the library and
never modify it). Run from the repository root:
    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_sampling/<x>.py
"""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("CERTATTN_SELFTEST_CACHE", "off")

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from certattn_jax import CertPolicy  # noqa: E402,F401
from models import generate as gen  # noqa: E402,F401
from models import llama  # noqa: E402,F401
from models.config import LlamaConfig  # noqa: E402

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)


def params_for(cfg: LlamaConfig = CFG, dtype=jnp.float32, seed: int = 0, scale: float = 0.3):
    return llama.init_params(cfg, jax.random.key(seed), dtype, scale=scale)


def prompts(lens=(23,), vocab: int = 96, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def attempt(label, fn):
    try:
        r = fn()
        text = "" if r is None else repr(r)
        print(f"[{label}] OK {text[:300]}{' ...' if len(text) > 300 else ''}", flush=True)
        return r
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        print(f"[{label}] RAISED {type(e).__module__}.{type(e).__name__}: {msg}", flush=True)
        if os.environ.get("AUDIT_TB"):
            traceback.print_exc()
        return e
