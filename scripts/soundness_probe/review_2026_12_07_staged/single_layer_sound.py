"""Single-layer model caches (slot_mismatch.py's method): the old rows are decoded with queries peaked on one
block at a time (hot sets filled, certificates written), then with_staged_sequences writes a new sequence (from a
hand-made DenseKVCache) into one row, and both rows are decoded with queries peaked on the old sequence's hot
blocks and on the new sequence's blocks. Every head-step's output is checked against float64 attention over the
K/V that were really given (not the cache's own tier 2). Run from the repository root:

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_staged/single_layer_sound.py
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax.cache import TieredKVCache
from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.model_cache import TieredModelCache
from certattn_jax.policy import CertPolicy

H, G, d, Bk, CAP, T0 = 1, 2, 16, 16, 128, 64
EPS = float(os.environ.get("EPS", "1e-3"))
STEPS = int(os.environ.get("STEPS", "8"))


def f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def attn64(q, K, V, n):  # q [Hq, d], K, V [T, H, d]
    out = np.empty((q.shape[0], d))
    for h in range(q.shape[0]):
        s = K[:n, h // G] @ q[h] / np.sqrt(d)
        p = np.exp(s - s.max()); p /= p.sum()
        out[h] = p @ V[:n, h // G]
    return out


@jax.jit
def step(cache, q, k, v):
    nl = cache.lengths + 1
    o, c = cache.attend(0, q[:, None], k, v, nl)
    return o[:, 0], c.with_lengths(nl)


def run(name, pol_cache, pol_model, new_len, start, dtype, mode="certified", vscale=10.0, qs=6.0, seed=0):
    rng = np.random.default_rng(seed)
    Kold = rng.normal(size=(2, T0, H, d)).astype(np.float32)
    Vold = rng.normal(size=(2, T0, H, d)).astype(np.float32)
    layer = TieredKVCache.from_dense(jnp.asarray(Kold, dtype), jnp.asarray(Vold, dtype), policy=pol_cache, capacity=CAP)
    m = TieredModelCache.from_layers([layer], num_q_heads=H * G, policy=pol_cache, schedule="unrolled", mode=mode)
    Ks = [list(f64(jnp.asarray(Kold[b, :, 0], dtype))) for b in range(2)]
    Vs = [list(f64(jnp.asarray(Vold[b, :, 0], dtype))) for b in range(2)]
    for s in range(6):
        q = np.zeros((2, H * G, d), np.float32)
        q[:, :] = 6.0 * Kold[:, 16 * (s % 4) + 3, 0][:, None]
        kt = rng.normal(size=(2, 1, H, d)).astype(np.float32); vt = rng.normal(size=(2, 1, H, d)).astype(np.float32)
        _, m = step(m, jnp.asarray(q, dtype), jnp.asarray(kt, dtype), jnp.asarray(vt, dtype))
        for b in range(2):
            Ks[b].append(f64(jnp.asarray(kt[b, 0, 0], dtype))); Vs[b].append(f64(jnp.asarray(vt[b, 0, 0], dtype)))
    old_ids = np.asarray(m.store.hot_ids)[0, start, 0].tolist()
    if pol_model is not pol_cache:
        m = m.with_policy(pol_model)
    # the new sequence: a dense staging cache [1, H, CAP, d], junk past new_len (must be ignored)
    Knew = rng.normal(size=(1, H, CAP, d)).astype(np.float32)
    Vnew = (vscale * rng.normal(size=(1, H, CAP, d))).astype(np.float32)
    staging = DenseKVCache(k=(jnp.asarray(Knew, dtype),), v=(jnp.asarray(Vnew, dtype),),
                           lengths=jnp.asarray([new_len], jnp.int32))
    m = m.with_staged_sequences(start, staging)
    Ks[start] = list(f64(jnp.asarray(Knew[0, 0, :new_len], dtype)))
    Vs[start] = list(f64(jnp.asarray(Vnew[0, 0, :new_len], dtype)))
    new_ids = np.asarray(m.store.hot_ids)[0, start, 0].tolist()
    assert all(i == -1 for i in new_ids), new_ids
    assert np.all(np.asarray(m.cert_packed)[:, start] == np.asarray(m.cert_packed)[:, start][..., :1, :])
    assert m.store.host_k.sharding.memory_kind == "pinned_host"
    lies = checked = 0
    worst = 0.0
    targets = [i for i in old_ids if i >= 0] + list(range(max(1, new_len // Bk)))
    for s in range(STEPS):
        if len(Ks[start]) + 1 > CAP or len(Ks[1 - start]) + 1 > CAP:
            break
        q = rng.normal(size=(2, H * G, d)).astype(np.float32)
        j = targets[s % len(targets)]
        if len(Ks[start]) > 16 * j + 3:
            q[start, 0] = qs * np.asarray(Ks[start][16 * j + 3], np.float32)
        q[1 - start, 0] = qs * np.asarray(Ks[1 - start][16 * (s % 4) + 3], np.float32)
        kt = rng.normal(size=(2, 1, H, d)).astype(np.float32); vt = rng.normal(size=(2, 1, H, d)).astype(np.float32)
        qd = jnp.asarray(q, dtype)
        o, m = step(m, qd, jnp.asarray(kt, dtype), jnp.asarray(vt, dtype))
        cert = jax.tree.map(np.asarray, m.last_certificate)
        for b in range(2):
            Ks[b].append(f64(jnp.asarray(kt[b, 0, 0], dtype))); Vs[b].append(f64(jnp.asarray(vt[b, 0, 0], dtype)))
            n = len(Ks[b])
            ref = attn64(f64(qd[b]), np.asarray(Ks[b])[:, None], np.asarray(Vs[b])[:, None], n)
            for h in range(H * G):
                err = float(np.linalg.norm(f64(o[b, h]) - ref[h]))
                bound = float(cert.error_bound[0, b, h])
                checked += 1
                if mode == "certified" or bool(cert.certified[0, b, h]):  # naive: no certificate (bound 0)
                    if not err <= bound:
                        lies += 1
                        print(f"  LIE {name} step {s} b={b} h={h} rung={int(cert.rung[0, b, h])} err {err:.4g} "
                              f"bound {bound:.4g}")
                    if np.isfinite(bound) and bound > 0:
                        worst = max(worst, err / bound)
    print(f"{name}: old hot {old_ids} -> {new_ids}; head-steps {checked}, lies {lies}, max err/bound {worst:.3g}",
          flush=True)
    return checked, lies


P4 = CertPolicy(block_size=Bk, group_size=16, k_max=4, v_max=2, eps=EPS)
cases = []
for new_len in (0, 5, 16, 64, CAP - STEPS):
    cases.append((f"P4 f32 len{new_len} start0", P4, P4, new_len, 0, jnp.float32))
cases += [
    ("narrowed k_max2 len40 start0", P4, P4.replace(k_max=2), 40, 0, jnp.float32),
    ("narrowed k_max1 len64 start1", P4, P4.replace(k_max=1), 64, 1, jnp.float32),
    ("hot_slots8 k_max2 len50 start1", P4.replace(k_max=2, hot_slots=8), None, 50, 1, jnp.float32),
    ("K4V2 len40 start0", P4.replace(key_bits=4, value_bits=2), None, 40, 0, jnp.float32),
    ("bf16 len40 start1", P4, None, 40, 1, jnp.bfloat16),
    ("f16 len33 start0", P4, None, 33, 0, jnp.float16),
]
tot = lies = 0
for name, pc, pm_, n, st, dt in cases:
    c, l = run(name, pc, pm_ or pc, n, st, dt)
    tot += c; lies += l
c, l = run("naive len40", P4, P4, 40, 0, jnp.float32, mode="naive"); tot += c; lies += l
print(f"TOTAL head-steps {tot}, lies {lies}")
