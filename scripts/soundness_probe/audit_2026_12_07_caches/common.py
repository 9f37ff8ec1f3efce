"""Shared helpers of the 2026-12-07 cached-state audit (reviewer scripts; they import the library and never
modify it). Run every script from the repository root:

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_caches/<script>.py

A *case* is a named generate() call on a tiny random model. `run_cases.py NAME...` runs cases in one process, in
order, and prints one JSON line per case (tokens and a digest of the step records); `compare.py` runs a list of cases
in one process and each case alone in a fresh process, and reports every difference.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from certattn_jax import CertPolicy  # noqa: E402
from certattn_jax.model_cache import cache_spec  # noqa: E402
from models import generate as gen  # noqa: E402
from models import llama  # noqa: E402
from models.config import LlamaConfig, RopeScaling  # noqa: E402

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
PYTHON = str(ROOT / ".venv" / "bin" / "python")


def params_for(cfg: LlamaConfig, dtype=jnp.float32, seed: int = 0):
    return llama.init_params(cfg, jax.random.key(seed), dtype, scale=0.3)


def prompts(batch: int = 1, vocab: int = 96, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in (45, 23, 31, 12)[:batch]]


def digest(x) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()[:12]


def summary(out: gen.GenerationOutput) -> dict:
    """What a case returns: the tokens, and each step-record leaf's digest (bit for bit) and sum."""
    rec = {}
    if out.step_records is not None:
        for path, leaf in jax.tree_util.tree_flatten_with_path(out.step_records)[0]:
            a = np.asarray(leaf)
            total = int(a.sum()) if a.dtype == bool else float(np.nansum(np.where(np.isinf(a), 0, a), dtype=np.float64))
            rec[jax.tree_util.keystr(path)] = [digest(a), total]
    return {"tokens": out.tokens, "finished": out.finished, "steps": out.num_steps, "records": rec}


def _base(cfg=CFG, dtype=jnp.float32, mode="dense", policy=POLICY, schedule="auto", batch=1, **kw):
    params = kw.pop("params", None) or params_for(cfg, dtype)
    factory = mode if schedule == "auto" else cache_spec(mode, cfg, dtype, policy, schedule=schedule)
    args = dict(max_new_tokens=12, eos_token_ids=(), progress=False, prefill_chunk=32,
                cache_factory=factory, policy=policy, record_steps=mode != "dense")
    args.update(kw)
    return lambda: gen.generate(params, cfg, prompts(batch, cfg.vocab_size), **args)


def _fused(mode):
    params = llama.fuse_projections(params_for(CFG))
    return _base(mode=mode, params=params)


CASES = {
    # dense: config fields that are not shapes
    "dense": lambda: _base(),
    "dense_theta": lambda: _base(cfg=dataclasses.replace(CFG, rope_theta=500.0)),
    "dense_eps": lambda: _base(cfg=dataclasses.replace(CFG, rms_norm_eps=0.5)),
    "dense_scaling": lambda: _base(cfg=dataclasses.replace(CFG, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16))),
    "dense_cfg_eos": lambda: _base(cfg=dataclasses.replace(CFG, eos_token_ids=(3,)), eos_token_ids=None),
    "dense_cfg_eos2": lambda: _base(cfg=dataclasses.replace(CFG, eos_token_ids=(5,)), eos_token_ids=None),
    "dense_tied": lambda: _base(cfg=dataclasses.replace(CFG, tie_word_embeddings=True)),
    "dense_bf16": lambda: _base(dtype=jnp.bfloat16),
    "dense_f16": lambda: _base(dtype=jnp.float16),
    "dense_sample": lambda: _base(temperature=0.9, seed=3),
    "dense_sample_topp": lambda: _base(temperature=0.9, top_p=0.5, seed=3),
    "dense_batch2": lambda: _base(batch=2),
    "dense_cap512": lambda: _base(capacity=512),
    "dense_fused": lambda: _fused("dense"),
    "dense_vocab97": lambda: _base(cfg=dataclasses.replace(CFG, vocab_size=97)),
    # naive / certified
    "naive": lambda: _base(mode="naive"),
    "cert": lambda: _base(mode="certified"),
    "cert_norec": lambda: _base(mode="certified", record_steps=False),
    "cert_eps_tiny": lambda: _base(mode="certified", policy=POLICY.replace(eps=1e-9)),
    "cert_eps_int": lambda: _base(mode="certified", policy=POLICY.replace(eps=0, abs_tol=1)),
    "cert_tau": lambda: _base(mode="certified", policy=POLICY.replace(tau_cov=0.5, eps=1e-3)),
    "cert_nofallback": lambda: _base(mode="certified", policy=POLICY.replace(eps=1e-9, layer_fallback_fraction=2.0)),
    "cert_block32": lambda: _base(mode="certified", policy=POLICY.replace(block_size=32)),
    "cert_group8": lambda: _base(mode="certified", policy=POLICY.replace(group_size=8)),
    "cert_kmax2": lambda: _base(mode="certified", policy=POLICY.replace(k_max=2)),
    "cert_kmax2_slots4": lambda: _base(mode="certified", policy=POLICY.replace(k_max=2, hot_slots=4)),
    "cert_vmax0": lambda: _base(mode="certified", policy=POLICY.replace(v_max=0, eps=1e-4)),
    "cert_bits": lambda: _base(mode="certified", policy=POLICY.replace(key_bits=4, value_bits=2)),
    "cert_immediate": lambda: _base(mode="certified", policy=POLICY.replace(hot_refresh="immediate", eps=1e-3)),
    "cert_adaptive": lambda: _base(mode="certified", schedule="adaptive"),
    "cert_straight_looped": lambda: _base(mode="certified", schedule="straight-looped",
                                          policy=POLICY.replace(eps=1e-3)),
    "cert_two_pass": lambda: _base(mode="certified", schedule="two-pass"),
    "cert_bf16": lambda: _base(mode="certified", dtype=jnp.bfloat16),
    "cert_sample": lambda: _base(mode="certified", temperature=0.9, seed=3),
    "cert_batch2": lambda: _base(mode="certified", batch=2),
    "cert_fused": lambda: _fused("certified"),
    "cert_theta": lambda: _base(mode="certified", cfg=dataclasses.replace(CFG, rope_theta=500.0)),
    "naive_bf16": lambda: _base(mode="naive", dtype=jnp.bfloat16),
}


def run(name: str) -> dict:
    return summary(CASES[name]()())
