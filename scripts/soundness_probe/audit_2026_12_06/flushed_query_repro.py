# ruff: noqa: E402  (the sys.path setup above the imports: run as a script from anywhere)
"""Thirtieth-session soundness audit probe (docs/performance.md, thirtieth session); see README.md here."""

import os as _os
import sys as _sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_ROOT = _os.path.abspath(_os.path.join(_HERE, "..", "..", ".."))
for _p in (_ROOT, _os.path.join(_ROOT, "tests"), _os.path.join(_ROOT, "scripts", "soundness_probe"), _HERE):
    if _p not in _sys.path:
        _sys.path.insert(0, _p)
# Certificate lie: a query element whose scaled value q/sqrt(d) (or itself) is subnormal is flushed to 0 on XLA:CPU,
# and with keys ~1e38 the lost score is O(10) nats; no Delta / floor term counts TINY * |k_c|.
import math

import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax.attention import certified_attention
from certattn_jax.cache import TieredKVCache
from certattn_jax.policy import CertPolicy


def ref64(q, k, v):  # exact attention in float64 over what the cache stores; q [Hq,d], k, v [T,d] (one KV head)
    s = k @ q.T / math.sqrt(q.shape[-1])
    w = np.exp(s - s.max(0))
    return (w.T @ v) / w.sum(0)[:, None]


rng = np.random.default_rng(1)
T, d = 40, 32  # 2 full blocks of 16 + 8 residual tokens
k = np.empty((1, T, 1, d))
v = np.empty((1, T, 1, d))
k[0, :16, 0] = 3e38 * (1 + 1e-3 * rng.standard_normal((16, d)))  # block 0: keys ~3e38 (bf16/f32 finite)
k[0, 16:32, 0] = 1e36 * (1 + 1e-3 * rng.standard_normal((16, d)))  # block 1: keys ~1e36
k[0, 32:, 0] = rng.standard_normal((8, d))  # residual: ordinary keys
v[0, :16], v[0, 16:32], v[0, 32:] = 1.0, -1.0, 0.0
v += 0.01 * rng.standard_normal(v.shape)
for dtype, qval in ((jnp.float32, 6.0e-38), (jnp.bfloat16, 6.0e-38), (jnp.float32, 1.1e-38)):
    for eps in (0.05, 0.0):
        pol = CertPolicy(block_size=16, group_size=16, k_max=1, eps=eps, abs_tol=0.0)
        q = jnp.full((1, 1, d), qval, jnp.float32)  # 6e-38 is normal, q/sqrt(32)=1.06e-38 is not; 1.1e-38 is subnormal
        kc, vc = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
        cache = TieredKVCache.from_dense(kc, vc, policy=pol)
        out, cert = jax.jit(certified_attention, static_argnums=2)(q, cache, pol)
        o = ref64(
            np.asarray(q[0], np.float64),
            np.asarray(kc[0, :, 0].astype(jnp.float32), np.float64),
            np.asarray(vc[0, :, 0].astype(jnp.float32), np.float64),
        )
        err = np.linalg.norm(np.asarray(out[0], np.float64) - o, axis=-1)[0]
        c = jax.tree.map(lambda x: np.asarray(x)[0, 0], cert)
        print(
            f"{jnp.dtype(dtype).name:8s} q={qval:.1e} eps={eps}: err={err:.4g} bound={float(c.error_bound):.4g} "
            f"rung={int(c.rung)} certified={bool(c.certified)} (e_key={float(c.e_key):.3g} e_val={float(c.e_val):.3g} "
            f"e_num={float(c.e_num):.3g}) {'LIE' if not err <= c.error_bound else 'ok'}"
        )
