"""Diagnose the exact rungs' accuracy on the GPU (bf16 caches): where does the error / NaN come from?"""
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "tests")
from certattn_jax import kv_cache  # noqa: E402
from certattn_jax.kv_cache import masked_attention_f32, probs_times_values, truncate_to_bf16  # noqa: E402

print(jax.devices(), jax.__version__)
rng = np.random.default_rng(8)
for name, koff, voff, qs, qdt in (("vals1e3", 0.0, 1000.0, 0.3, jnp.float32), ("keyoff", 100.0, 0.0, 3.0, jnp.bfloat16)):
    B, T, H, G, d = 1, 200, 2, 2, 32
    k = rng.standard_normal((B, H, T, d)) + koff
    v = voff + rng.standard_normal((B, H, T, d))
    q = rng.standard_normal((B, 1, H * G, d)) * qs
    kb, vb, qj = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), jnp.asarray(q, qdt)
    k64, v64 = np.asarray(kb, np.float64), np.asarray(vb, np.float64)
    q64 = np.asarray(qj, np.float64)
    # float64 reference
    ref = np.empty((B, H * G, d))
    for h in range(H * G):
        sc = k64[0, h // G] @ q64[0, 0, h] / math.sqrt(d)
        w = np.exp(sc - sc.max())
        ref[0, h] = w @ v64[0, h // G] / w.sum()
    f = jax.jit(lambda q, k, v: masked_attention_f32(q, k, v, jnp.full((1, 1), T - 1), jnp.full((1,), T)))
    out = np.asarray(f(qj, kb, vb), np.float64)[:, 0]
    print(name, "masked_attention_f32 err", np.max(np.abs(out - ref)), "nan", np.isnan(out).any())
    out_f32v = np.asarray(f(qj, kb.astype(jnp.float32), vb.astype(jnp.float32)), np.float64)[:, 0]
    print(name, "with f32 k,v err", np.max(np.abs(out_f32v - ref)))
    # pieces
    probs = rng.random((B, H, G, 1, T)).astype(np.float32)
    probs /= probs.sum(-1, keepdims=True)
    g = jax.jit(probs_times_values)
    o = np.asarray(g(jnp.asarray(probs), vb), np.float64)
    r = np.einsum("bkgts,bksd->btkgd", probs.astype(np.float64), v64)
    print(name, "probs_times_values err", np.max(np.abs(o - r)))
    tr = jax.jit(lambda p: (truncate_to_bf16(p), p - truncate_to_bf16(p)))
    hi, r1 = tr(jnp.asarray(probs))
    print(name, "trunc ok", np.max(np.abs(np.asarray(hi, np.float64) + np.asarray(r1, np.float64) - probs)))
    e = jax.jit(lambda p, v: jnp.einsum("bkgts,bksd->btkgd", p, v, preferred_element_type=jnp.float32))
    o2 = np.asarray(e(jnp.asarray(probs).astype(jnp.bfloat16), vb), np.float64)
    print(name, "plain bf16 probs err", np.max(np.abs(o2 - r)))
    print(jax.jit(probs_times_values).lower(jnp.asarray(probs), vb).compile().as_text()[:3000])
