"""Probe E: the `tolerance` field against the range of what the cache stores, when tokens are written in a dtype
wider than the cache's (float32 tokens into a bfloat16 / float16 cache through append / write_token).

The recorded range is widened by the cast's rounding (docs/bounds.md section 3, "Annotate what is stored"), which keeps
E_key an upper bound; but `tolerance` = eps * ||r||_2 + abs_tol is computed from the same widened range, so it can
exceed eps * (the stored values' range), and `certified` can then hold for a bound above eps * the true range.
The inputs here are exactly representable in the cache dtype (the cast changes nothing), so the stored range is the
input range.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07/probe_tolerance.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import PATH, Tally, attn64, f64  # noqa: E402

from certattn_jax.attention import certified_attention  # noqa: E402
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402


def main():
    t = Tally("tolerance")
    eps = float(sys.argv[1]) if len(sys.argv) > 1 else 0.05
    pol = CertPolicy(block_size=16, group_size=16, k_max=2, v_max=2, eps=eps)
    B, T, H, G, d = 1, 40, 2, 2, 16
    for dt in (jnp.bfloat16, jnp.float16):
        for offset, step in ((1000.0, 4.0), (100.0, 0.5), (0.0, 1.0)):
            rng = np.random.default_rng(0)
            k = rng.standard_normal((B, T, H, d)).astype(np.float32)
            v = (offset + step * rng.integers(0, 2, (B, T, H, d))).astype(np.float32)
            k = np.asarray(jnp.asarray(k).astype(dt).astype(jnp.float32))  # representable: the cast is exact
            assert np.array_equal(np.asarray(jnp.asarray(v).astype(dt).astype(jnp.float32)), v)
            q = jnp.asarray(rng.standard_normal((B, H * G, d)) * 2, jnp.float32)
            same = TieredKVCache.init(batch=B, capacity=64, num_kv_heads=H, head_dim=d, dtype=dt, policy=pol)
            same = same.append(jnp.asarray(k, dt), jnp.asarray(v, dt))  # tokens in the cache dtype
            wide = TieredKVCache.init(batch=B, capacity=64, num_kv_heads=H, head_dim=d, dtype=dt, policy=pol)
            wide = wide.append(jnp.asarray(k), jnp.asarray(v))  # the same values as float32 tokens
            for (name, c), qdt in [(x, y) for x in (("same dtype", same), ("float32 tokens", wide))
                                   for y in (dt, jnp.float32)]:
                name = f"{name}, query {jnp.dtype(qdt).name}"
                o, cert = certified_attention(q.astype(qdt), c, pol)
                tol, bound = np.asarray(cert.tolerance), np.asarray(cert.error_bound)
                ref = attn64(f64(q.astype(qdt))[0], k[0], v[0], T)
                err = np.linalg.norm(f64(o)[0] - ref, axis=-1)
                rng_true = np.array([np.linalg.norm(v[0, :, h // G].max(0) - v[0, :, h // G].min(0))
                                     for h in range(H * G)])
                ratio = tol[0] / (pol.eps * rng_true)
                overclaim = np.asarray(cert.certified)[0] & (bound[0] > pol.eps * rng_true)
                t.head_steps += H * G
                line = (f"{jnp.dtype(dt).name} values {offset}+{step}*{{0,1}}, {name}: "
                        f"tolerance / (eps * stored range) {ratio.min():.3f}..{ratio.max():.3f}; "
                        f"certified {np.asarray(cert.certified)[0].tolist()}; bound {bound[0].max():.4g}, "
                        f"eps*range {(pol.eps * rng_true).min():.4g}, error {err.max():.3g}")
                print(line, flush=True)
                if np.any(overclaim):
                    t.note(f"certified with bound > eps * stored range: {line}")
    print("=== SUMMARY", PATH)
    print(t.summary())


if __name__ == "__main__":
    main()
