"""Probe D: the certified generate's certificates and final cache across layer schedules (looped, two-pass,
straight, straight-looped, adaptive, unrolled) on the tiny "gqa" LlamaConfig: every schedule must record, per
step, the certificates of the computation that answered it -- same tokens, rungs, K*, certified flags, bounds
to float noise, and the same final cache (lengths, flushed, tier 1, tier 2, hot set) as the reference "unrolled".

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07/probe_schedules.py [--eps E] [--scale S]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import PATH, Tally, f64  # noqa: E402

from certattn_jax.model_cache import SCHEDULES, cache_spec  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402
from models import generate as gen  # noqa: E402
from models import llama  # noqa: E402
from models.config import LlamaConfig  # noqa: E402

CFG = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=8, max_position_embeddings=512)
ap = argparse.ArgumentParser()
ap.add_argument("--eps", type=float, default=1e-3)
ap.add_argument("--scale", type=float, default=0.5)
ap.add_argument("--new", type=int, default=30)
args = ap.parse_args()


def main():
    t = Tally(f"schedules eps={args.eps} scale={args.scale}")
    pol = CertPolicy(block_size=8, group_size=8, k_max=2, v_max=2, eps=args.eps)
    params = llama.init_params(CFG, jax.random.key(5), jnp.float32, scale=args.scale)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 97, 21).tolist(), rng.integers(0, 97, 1).tolist()]
    runs = {}
    t0 = time.time()
    for s in ("unrolled",) + tuple(x for x in SCHEDULES if x != "unrolled"):
        spec = cache_spec("certified", CFG, jnp.float32, pol, schedule=s)
        runs[s] = gen.generate(params, CFG, prompts, args.new, cache_factory=spec, record_steps=True,
                               eos_token_ids=[], progress=False)
        r = jax.tree.map(np.asarray, runs[s].step_records)
        print(s, f"{time.time() - t0:.0f}s", "rungs", np.bincount(r.rung.ravel(), minlength=5).tolist(),
              "slow_steps", int(runs[s].cache.slow_steps), flush=True)
    ref = runs["unrolled"]
    rr = jax.tree.map(np.asarray, ref.step_records)
    for s, o in runs.items():
        t.cases += 1
        if o.tokens != ref.tokens:
            t.bad(f"{s}: tokens differ from unrolled: {o.tokens} vs {ref.tokens}")
            continue
        r = jax.tree.map(np.asarray, o.step_records)
        t.head_steps += r.rung.size
        for f in ("rung", "k_star", "certified", "ranking_ok"):
            a, b = getattr(r, f), getattr(rr, f)
            if not np.array_equal(a, b):
                idx = np.argwhere(a != b)[:3].tolist()
                t.bad(f"{s}: record field {f} differs from unrolled at [step, layer, b, h] {idx}: "
                      f"{[a[tuple(i)] for i in idx]} vs {[b[tuple(i)] for i in idx]}")
        for f in ("error_bound", "e_key", "e_val", "e_num", "tolerance"):
            a, b = getattr(r, f).astype(np.float64), getattr(rr, f).astype(np.float64)
            rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-30)
            rel = np.where(np.isinf(a) & np.isinf(b), 0, rel)
            if np.nanmax(rel) > 1e-5:
                t.bad(f"{s}: record field {f} differs from unrolled by {np.nanmax(rel):.3g} relative")
        c, cr = o.cache, ref.cache
        if not np.array_equal(np.asarray(c.lengths), np.asarray(cr.lengths)):
            t.bad(f"{s}: cache lengths differ")
        for f in ("flushed", "k_codes", "v_codes", "k_scale", "v_scale", "hot_ids", "res_k", "res_v"):
            if not np.array_equal(np.asarray(getattr(c.store, f)), np.asarray(getattr(cr.store, f))):
                t.bad(f"{s}: cache field {f} differs from unrolled")
        if not np.array_equal(f64(c.store.host_k), f64(cr.store.host_k)):
            t.bad(f"{s}: tier 2 differs from unrolled")
    print("=== SUMMARY", PATH)
    print(t.summary(), f"{time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
