"""with_sequences checks the *policy's* layout, not the store's hot-slot count: a cache whose policy was narrowed
(with_policy(k_max smaller): allowed) takes a part with fewer slots; dynamic_update_slice then writes only the
part's slots and leaves the row's other slots (hot_ids / hot_k / hot_v of the sequence that lived there) in place.
Those stale slots claim to hold exact originals of the new sequence's blocks."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax.cache import TieredKVCache
from certattn_jax.model_cache import TieredModelCache
from certattn_jax.policy import CertPolicy

H, G, d, Bk = 1, 1, 16, 16
import os

EPS = float(os.environ.get("EPS", "1e-3")); QS = float(os.environ.get("QS", "6"))
P4 = CertPolicy(block_size=Bk, group_size=16, k_max=4, v_max=2, eps=EPS)
P2 = P4.replace(k_max=2)
rng = np.random.default_rng(0)
T0, CAP = 64, 128

def model(K, V, pol_cache, pol_model):
    layer = TieredKVCache.from_dense(jnp.asarray(K), jnp.asarray(V), policy=pol_cache, capacity=CAP)
    return TieredModelCache.from_layers([layer], num_q_heads=H * G, policy=pol_model, schedule="unrolled")

@jax.jit
def step(cache, q, k, v):
    nl = cache.lengths + 1
    o, c = cache.attend(0, q[:, None], k, v, nl)
    return o[:, 0], c.with_lengths(nl)

def f64(x): return np.asarray(x, np.float64)

def attn64(q, K, V, n):
    s = K[:n] @ q / np.sqrt(d); p = np.exp(s - s.max()); p /= p.sum(); return p @ V[:n]

# the old sequences (2 rows), decoded a few steps with queries that make blocks hot
Kold = rng.normal(size=(2, T0, H, d)).astype(np.float32)
Vold = rng.normal(size=(2, T0, H, d)).astype(np.float32)
m = model(Kold, Vold, P4, P4)
for s in range(6):
    q = np.zeros((2, H * G, d), np.float32)
    q[:, 0] = 6.0 * Kold[:, 16 * (s % 4) + 3, 0]  # peak on one block at a time
    kt = rng.normal(size=(2, 1, H, d)).astype(np.float32); vt = rng.normal(size=(2, 1, H, d)).astype(np.float32)
    _, m = step(m, jnp.asarray(q), jnp.asarray(kt), jnp.asarray(vt))
print("old hot_ids row 0:", np.asarray(m.store.hot_ids)[0, 0, 0].tolist())

narrow = m.with_policy(P2)  # allowed: k_max 2 <= 4 slots
Knew = rng.normal(size=(1, T0, H, d)).astype(np.float32)
Vnew = (10.0 * rng.normal(size=(1, T0, H, d))).astype(np.float32)
part = model(Knew, Vnew, P2, P2)  # a fresh sequence built under the narrowed policy: 2 slots
print("slots: cache", narrow.store.k_max, "part", part.store.k_max)
full = narrow.with_sequences(0, part)
ids = np.asarray(full.store.hot_ids)[0, 0, 0].tolist()
print("row 0 hot_ids after with_sequences:", ids, "(slots >= 2 are the old sequence's)")
# are the stale slots the new sequence's originals? (they claim to be)
hk = f64(full.store.hot_k)[0, 0, 0]
for sl, j in enumerate(ids):
    if j >= 0:
        same = np.array_equal(hk[sl], f64(Knew[0, j * Bk:(j + 1) * Bk, 0]))
        print(f"  slot {sl} block {j}: equals the new sequence's keys of that block: {same}")

# decode the new row with queries peaked on each stale block; check the certificate against float64
Kall, Vall = [Knew[0, :, 0]], [Vnew[0, :, 0]]
lies = 0
for s in range(8):
    j = [x for x in ids[2:] if x >= 0][s % max(1, len([x for x in ids[2:] if x >= 0]))] if any(x >= 0 for x in ids[2:]) else 0
    q = np.zeros((2, H * G, d), np.float32)
    q[0, 0] = QS * Knew[0, 16 * j + 3, 0]
    q[1, 0] = rng.normal(size=d)
    kt = rng.normal(size=(2, 1, H, d)).astype(np.float32); vt = rng.normal(size=(2, 1, H, d)).astype(np.float32)
    o, full = step(full, jnp.asarray(q), jnp.asarray(kt), jnp.asarray(vt))
    Kall.append(kt[0, 0]); Vall.append(vt[0, 0])
    K64 = f64(np.concatenate(Kall)); V64 = f64(np.concatenate(Vall))
    n = T0 + s + 1
    ref = attn64(f64(q[0, 0]), K64, V64, n)
    err = float(np.linalg.norm(f64(o[0, 0]) - ref))
    c = jax.tree.map(lambda x: np.asarray(x)[0, 0, 0], full.last_certificate)
    flag = bool(c.certified) and err > float(c.error_bound)
    lies += flag
    print(f"step {s}: block {j} rung {int(c.rung)} certified {bool(c.certified)} err {err:.4g} bound "
          f"{float(c.error_bound):.4g} {'<-- CERTIFICATE LIES' if flag else ''}")
print("lies:", lies)
