"""Bad inputs to with_staged_sequences / TieredKVCache.with_rows_converted (tiny model of
tests/test_staging_groups.py): what is refused, what is accepted, and what is left of the caller's cache.

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_staged/inputs.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax import tiers
from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.kv_cache import was_donated
from certattn_jax.model_cache import cache_spec
from certattn_jax.policy import CertPolicy
from models.config import LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
CAP = 96
spec = cache_spec("certified", CFG, jnp.float32, POLICY)
rng = np.random.default_rng(0)


def dense(n=2, lens=(20, 40), shapes=None, dtypes=None, vshapes=None, nv=None):
    L = CFG.num_layers
    shapes = shapes or [(n, 2, CAP, 32)] * L
    vshapes = vshapes or shapes
    dtypes = dtypes or [jnp.float32] * L
    k = tuple(jnp.asarray(rng.normal(size=s), dt) for s, dt in zip(shapes, dtypes))
    v = tuple(jnp.asarray(rng.normal(size=s), dt) for s, dt in zip(vshapes, dtypes))
    if nv is not None:
        v = v[:nv]
    return DenseKVCache(k=k, v=v, lengths=jnp.asarray(lens) if not isinstance(lens, jax.Array) else lens)


def full():
    """A 4-row cache with every row holding data (lengths 50) and a marker in host_k."""
    st = dense(4, (50, 50, 50, 50))
    return spec(4, CAP).with_staged_sequences(0, st)


def attempt(name, fn):
    c = full()
    before_hk = np.asarray(c.store.host_k).copy()
    try:
        out = fn(c)
        msg = "ACCEPTED"
        if out is not None and hasattr(out, "lengths"):
            msg += f" lengths={np.asarray(out.lengths).tolist()}"
            hk = np.asarray(out.store.host_k)
            msg += f" host_k rows changed={[bool(np.any(hk[:, b] != before_hk[:, b])) for b in range(4)]}"
    except Exception as e:  # noqa: BLE001
        msg = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
    print(f"{name:55s} {msg} | caller's cache donated afterwards: {was_donated(c)}", flush=True)


L0 = (2, 2, CAP, 32)
attempt("ok: start 1, n 2", lambda c: c.with_staged_sequences(1, dense()))
attempt("start np.int64(2)", lambda c: c.with_staged_sequences(np.int64(2), dense()))
attempt("start True", lambda c: c.with_staged_sequences(True, dense()))
attempt("start 3 (n 2, B 4)", lambda c: c.with_staged_sequences(3, dense()))
attempt("start -1", lambda c: c.with_staged_sequences(-1, dense()))
attempt("n 5 > B 4", lambda c: c.with_staged_sequences(0, dense(5, (1,) * 5)))
attempt("lengths > capacity (97)", lambda c: c.with_staged_sequences(0, dense(lens=(97, 3))))
attempt("lengths negative", lambda c: c.with_staged_sequences(0, dense(lens=(-1, 3))))
attempt("lengths float", lambda c: c.with_staged_sequences(0, dense(lens=jnp.asarray([3.0, 4.0]))))
attempt("lengths shape [3] for n 2", lambda c: c.with_staged_sequences(0, dense(lens=(3, 4, 5))))
attempt("lengths int64 numpy", lambda c: c.with_staged_sequences(0, dense(lens=np.asarray([3, 4], np.int64))))
attempt("staging 1 KV head (cache 2)", lambda c: c.with_staged_sequences(0, dense(shapes=[(2, 1, CAP, 32)] * 2)))
attempt("staging 3 layers (cache 2)", lambda c: c.with_staged_sequences(0, DenseKVCache(
    k=dense().k + dense().k[:1], v=dense().v + dense().v[:1], lengths=jnp.asarray([3, 4]))))
attempt("staging bf16", lambda c: c.with_staged_sequences(0, dense(dtypes=[jnp.bfloat16] * 2)))
# layer 1 unlike layer 0 (only layer 0 is checked by with_staged_sequences; from_staging checks every layer)
attempt("layer 1 capacity 80 (layer 0: 96)", lambda c: c.with_staged_sequences(0, dense(shapes=[L0, (2, 2, 80, 32)])))
attempt("layer 1 with 1 KV head", lambda c: c.with_staged_sequences(0, dense(shapes=[L0, (2, 1, CAP, 32)])))
attempt("layer 1 head_dim 16", lambda c: c.with_staged_sequences(0, dense(shapes=[L0, (2, 2, CAP, 16)])))
attempt("layer 1 batch 1", lambda c: c.with_staged_sequences(0, dense(shapes=[L0, (1, 2, CAP, 32)])))
attempt("layer 1 bf16", lambda c: c.with_staged_sequences(0, dense(dtypes=[jnp.float32, jnp.bfloat16])))
attempt("v layer 1 capacity 80", lambda c: c.with_staged_sequences(0, dense(vshapes=[L0, (2, 2, 80, 32)])))
attempt("v with 1 layer (k 2)", lambda c: c.with_staged_sequences(0, dense(nv=1)))
for name, bad in [("layer 1 capacity 80", [L0, (2, 2, 80, 32)]), ("layer 1 with 1 KV head", [L0, (2, 1, CAP, 32)])]:
    try:
        spec.from_staging(dense(shapes=bad))
        print(f"{'  from_staging, ' + name:55s} ACCEPTED")
    except Exception as e:  # noqa: BLE001
        print(f"{'  from_staging, ' + name:55s} refused: {type(e).__name__}: {str(e).splitlines()[0][:120]}")

# staging arrays in host memory
def host_staging(c):
    d = dense()
    hs = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    d = d.replace(k=tuple(jax.device_put(x, hs) for x in d.k), v=tuple(jax.device_put(x, hs) for x in d.v))
    return c.with_staged_sequences(0, d)
attempt("staging K/V in pinned_host memory", host_staging)
# tier 2 of the cache on the device
attempt("cache's tier 2 on the device", lambda c: c.replace(store=c.store.replace(
    host_k=tiers.to_device(c.store.host_k), host_v=tiers.to_device(c.store.host_v))).with_staged_sequences(0, dense()))
# donated staging
def donated_staging(c):
    d = dense()
    jax.jit(lambda x: x, donate_argnums=0)(d.k[1])
    return c.with_staged_sequences(0, d)
attempt("a donated staging cache", donated_staging)
# traced: inside jit (the tiered cache traced, the staging a closure constant)
attempt("inside jit, cache traced", lambda c: jax.jit(lambda cc: cc.with_staged_sequences(1, dense()))(c))
attempt("inside jit, staging traced", lambda c: jax.jit(lambda d: c.with_staged_sequences(1, d))(dense()))

# TieredKVCache.with_rows_converted is public: its own checks
print("-- TieredKVCache.with_rows_converted (public, stacked store)")
def rows(start, n=2, layers=2, S=CAP):
    def f(c):
        d = dense(n, (50,) * n, shapes=[(n, 2, S, 32)] * layers)
        st = c.store.with_rows_converted(start, d.k, d.v, d.lengths)
        return c.replace(store=st)
    return f
attempt("with_rows_converted start 3 (n 2, B 4)", rows(3))
attempt("with_rows_converted start -2", rows(-2))
attempt("with_rows_converted start 7", rows(7))
attempt("with_rows_converted 1 layer of 2", rows(0, layers=1))
attempt("with_rows_converted 3 layers of 2", rows(0, layers=3))
attempt("with_rows_converted capacity 64 (cache 96)", rows(0, S=64))
