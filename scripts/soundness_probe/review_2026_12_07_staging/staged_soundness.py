"""Soundness of a certified cache assembled by prefill(staging_batch=1) (review 2026-12-07). Reuses
audit_2026_12_07/probe_model.py's checks (its CFG: 2 layers, 6 q / 2 KV heads, head_dim 8; block 8).

 A. staged prefill vs whole-batch prefill: every store field per row (tolerance: the batch's matmuls may round
    differently), lengths, flushed; the staged cache's invariants (check_cache_invariants).
 B. generate(staging_batch=1, record_steps=True): record checks (as probe_model part 1), tokens vs whole-batch
    generate, the final cache's invariants, and layer 0's originals vs a dense cache fed the same tokens.
 C. a manual decode ("unrolled" schedule, attend wrapped to capture each layer's query) from the staged cache:
    every head-step's output vs float64 attention over the stored originals (probe_model.check_layer_step).

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_staging/staged_soundness.py [--eps E] [--scale S]
"""
import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "audit_2026_12_07"))
ap = argparse.ArgumentParser(); ap.add_argument("--eps", type=float, default=0.05)
ap.add_argument("--scale", type=float, default=0.25); ap.add_argument("--new", type=int, default=24)
ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()
sys.argv = [sys.argv[0], "--eps", str(a.eps), "--scale", str(a.scale), "--seed", str(a.seed)]
import jax
import jax.numpy as jnp
import numpy as np
import probe_model as pm  # noqa: E402  (argparse at import: fed the same flags)
from common import Tally, f64

from certattn_jax import model_cache
from certattn_jax.cache import DEVICE_FIELDS
from certattn_jax.model_cache import cache_spec
from models import generate as gen
from models import llama

CFG, POL = pm.CFG, pm.POL
t = Tally(f"staged eps={a.eps} scale={a.scale}")
params = llama.init_params(CFG, jax.random.key(a.seed), jnp.float32, scale=a.scale)
rng = np.random.default_rng(a.seed)
prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (37, 1, 16, 8, 23)]
B = len(prompts)
t0 = time.time()

# ---- A
import os

SKIP_AB = bool(os.environ.get("ONLY_C"))
for mode in (() if SKIP_AB else ("certified", "naive")):
    spec = cache_spec(mode, CFG, jnp.float32, POL)
    cap = 64
    staged, lg_s = gen.prefill(params, CFG, prompts, cap, cache_factory=spec, policy=POL, staging_batch=1)
    whole, lg_w = gen.prefill(params, CFG, prompts, cap, cache_factory=spec, policy=POL)
    worst = {}
    for f in DEVICE_FIELDS + ("host_k", "host_v"):
        x, y = f64(getattr(staged.store, f)), f64(getattr(whole.store, f))
        if x.shape != y.shape:
            t.bad(f"A {mode} {f}: shapes {x.shape} vs {y.shape}"); continue
        fin = np.isfinite(x) & np.isfinite(y)
        if not np.array_equal(np.isfinite(x), np.isfinite(y)) or not np.array_equal(x[~fin], y[~fin]):
            t.bad(f"A {mode} {f}: non-finite entries differ")
        d = np.abs(x[fin] - y[fin]) / (1 + np.abs(y[fin])) if fin.any() else np.zeros(1)
        worst[f] = float(d.max())
    int_fields = ("k_codes", "v_codes", "hot_ids", "hot_used", "hot_pending", "lengths", "flushed", "nonfinite")
    print(f"A {mode}: staged vs whole, max rel diff per field: " +
          ", ".join(f"{k}={v:.2g}" for k, v in worst.items() if v > 0) or "all equal", flush=True)
    for f in ("lengths", "flushed", "hot_ids", "hot_used", "hot_pending", "nonfinite"):
        if worst[f] != 0:
            t.bad(f"A {mode} {f} differs between staged and whole prefill")
    if not np.array_equal(np.asarray(staged.lengths), np.asarray(whole.lengths)):
        t.bad(f"A {mode}: model lengths differ")
    if not np.array_equal(np.asarray(staged.cert_packed), np.asarray(whole.cert_packed)):
        t.bad(f"A {mode}: cert_packed differs")
    print(f"A {mode}: logits max abs diff {float(jnp.max(jnp.abs(lg_s - lg_w))):.3g}", flush=True)
    pm.check_cache_invariants(t, f"A {mode} staged", staged, np.asarray([len(p) for p in prompts]))
print(t.summary(), f"{time.time() - t0:.0f}s", flush=True)

# ---- B
if not SKIP_AB:
    kw = dict(eos_token_ids=[], progress=False)
    cert = gen.generate(params, CFG, prompts, a.new, cache_factory="certified", policy=POL, record_steps=True,
                        staging_batch=1, **kw)
    ref = gen.generate(params, CFG, prompts, a.new, cache_factory="certified", policy=POL, record_steps=True, **kw)
    recs = jax.tree.map(np.asarray, cert.step_records)
    print("B rung histogram", np.bincount(recs.rung.ravel(), minlength=5).tolist(), "certified fraction",
          float(recs.certified.mean()), flush=True)
    if np.any(recs.certified != ((recs.error_bound <= recs.tolerance) & np.isfinite(recs.error_bound))):
        t.bad("B: certified != (bound <= tolerance)")
    if np.any(~recs.ranking_ok):
        t.bad("B: ranking_ok False")
    if cert.tokens != ref.tokens:
        t.note("B: staged tokens differ from whole-batch tokens")
    print("B tokens equal whole-batch generate:", cert.tokens == ref.tokens, flush=True)
    rr = jax.tree.map(np.asarray, ref.step_records)
    print("B max |bound staged - bound whole|:", float(np.max(np.abs(recs.error_bound - rr.error_bound))),
          "tolerance diff", float(np.max(np.abs(recs.tolerance - rr.tolerance))), flush=True)
    n_steps = cert.num_steps
    lens_expected = np.asarray([len(p) + n_steps - 1 for p in prompts])
    pm.check_cache_invariants(t, "B final cache", cert.cache, lens_expected)
    rows = [list(p) + cert.tokens[b][:-1] for b, p in enumerate(prompts)]
    dk, dv = pm.dense_kv_of(params, rows, cert.cache.capacity)
    ek, ev = cert.cache.layer_view(0).exact_kv()
    ek, ev = f64(ek), f64(ev)
    w = max(max(np.abs(ek[b, :, :n] - dk[0][b, :, :n]).max(), np.abs(ev[b, :, :n] - dv[0][b, :, :n]).max())
            for b, n in enumerate(lens_expected))
    print(f"B layer 0 originals vs dense fed the same tokens: max abs diff {w:.3g}", flush=True)
    if w > 1e-5:
        t.bad(f"B: layer 0 originals differ by {w}")
    print(t.summary(), f"{time.time() - t0:.0f}s", flush=True)

# ---- C: manual decode from a staged cache (unrolled schedule), every head-step against float64
spec = cache_spec("certified", CFG, jnp.float32, POL, schedule="unrolled")
cap = 8 * (-(-(max(map(len, prompts)) + a.new) // 8))
import os

cache, logits = gen.prefill(params, CFG, prompts, cap, cache_factory=spec, policy=POL,
                             staging_batch=None if os.environ.get("NO_STAGE") else 1)
tok = np.argmax(np.asarray(logits), -1)
captured = []
orig = model_cache.TieredModelCache.attend
jit_attend = jax.jit(orig, static_argnums=(1,))

def attend(self, layer, q, k, v, new_lengths):
    out, new = jit_attend(self, layer, q, k, v, new_lengths)
    if q.shape[1] == 1:
        captured.append((layer, q, out, new))
    return out, new

model_cache.TieredModelCache.attend = attend
try:
    for step in range(a.new - 1):
        captured.clear()
        lg, cache = llama.forward(params, CFG, jnp.asarray(tok[:, None], jnp.int32), cache)
        tok = np.argmax(np.asarray(lg)[:, -1], -1)
        for layer, q, out, new in captured:
            pm.check_layer_step(t, f"C step {step} layer {layer}", layer, q[:, 0], out[:, 0], new)
finally:
    model_cache.TieredModelCache.attend = orig
pm.check_cache_invariants(t, "C final cache", cache, np.asarray(cache.lengths))
print("=== SUMMARY", t.summary(), f"{time.time() - t0:.0f}s")
