"""Edge cases of `TieredKVCache.stacked_from_layers`'s direct path (one group holds every layer, batched form:
`_convert_all_layers`) against the group path (CONVERT_GROUP_BYTES = 1, i.e. `with_rows_converted` a layer at a
time, and CONVERT_GROUP_FORM = "loop"): what each raises or returns for traced inputs, deleted arrays, NumPy
inputs, lengths out of range / of the wrong shape or dtype, and whether the result's arrays are committed, in
which memory, and whether they share a buffer with an input (a later donation would delete the caller's array).

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_37th/edges.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax import cache as cm
from certattn_jax import tiers
from certattn_jax.cache import TieredKVCache
from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.model_cache import TieredModelCache
from certattn_jax.policy import CertPolicy

POL = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
L, B, H, S, d = 3, 2, 2, 48, 32
REAL = cm.CONVERT_GROUP_BYTES


def kv(dtype=jnp.float32, seed=0, committed=True):
    rng = np.random.default_rng(seed)
    mk = (lambda x: jax.device_put(jnp.asarray(x, dtype), jax.devices()[0])) if committed else \
        (lambda x: jnp.asarray(x, dtype))
    return (tuple(mk(rng.normal(size=(B, H, S, d))) for _ in range(L)),
            tuple(mk(rng.normal(size=(B, H, S, d))) for _ in range(L)))


PATHS = {"direct": dict(form="batched", budget=REAL), "layer": dict(form="batched", budget=1),
         "loop": dict(form="loop", budget=REAL)}


def call(path, fn):
    cm.CONVERT_GROUP_FORM, cm.CONVERT_GROUP_BYTES = PATHS[path]["form"], PATHS[path]["budget"]
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0][:150]}", None
    finally:
        cm.CONVERT_GROUP_FORM, cm.CONVERT_GROUP_BYTES = "batched", REAL


def each(tag, make):
    print(f"-- {tag}")
    outs = {}
    for p in PATHS:
        outs[p] = call(p, make)
        print(f"   {p:7s}: {outs[p][0]}")
    return outs


ks, vs = kv()
lens = jnp.array([40, 7], jnp.int32)

# traced inputs: inside jit
each("inside jit, everything traced", lambda: jax.jit(
    lambda a, b, n: TieredKVCache.stacked_from_layers(a, b, n, POL))(ks, vs, lens))
each("inside jit, only lengths traced", lambda: jax.jit(
    lambda n: TieredKVCache.stacked_from_layers(ks, vs, n, POL))(lens))
each("inside jit, only layer 2 traced", lambda: jax.jit(
    lambda k2: TieredKVCache.stacked_from_layers(ks[:2] + (k2,), vs, lens, POL))(ks[2]))
# the model cache's traced path
dense = DenseKVCache(k=ks, v=vs, lengths=lens)
try:
    eager = TieredModelCache.from_dense(dense, num_q_heads=4, policy=POL)
    traced = jax.jit(lambda dn: TieredModelCache.from_dense(dn, num_q_heads=4, policy=POL))(dense)
    same = all(np.array_equal(tiers.to_numpy(a), tiers.to_numpy(b), equal_nan=True)
               for a, b in zip(jax.tree.leaves(eager.store), jax.tree.leaves(traced.store)))
    print(f"-- TieredModelCache.from_dense eager (direct) vs inside jit (stacked_from_head_major): "
          f"{'identical store' if same else 'DIFFER'}; treedef equal: "
          f"{jax.tree.structure(eager.store) == jax.tree.structure(traced.store)}")
except Exception as e:  # noqa: BLE001
    print("-- from_dense:", type(e).__name__, e)

# deleted arrays
for what in ("k0", "v2", "lengths"):
    def mk(what=what):
        a, b = kv(seed=3)
        n = jnp.array([40, 7], jnp.int32)
        {"k0": a[0], "v2": b[2], "lengths": n}[what].delete()
        return TieredKVCache.stacked_from_layers(a, b, n, POL)
    each(f"deleted {what}", mk)

# NumPy inputs (the docstring of _check_kv accepts them)
each("NumPy k/v", lambda: TieredKVCache.stacked_from_layers(tuple(np.asarray(k) for k in ks),
                                                            tuple(np.asarray(v) for v in vs), lens, POL))
each("NumPy lengths", lambda: TieredKVCache.stacked_from_layers(ks, vs, np.array([40, 7]), POL))
each("list lengths", lambda: TieredKVCache.stacked_from_layers(ks, vs, [40, 7], POL))
each("lists of layers (not tuples)", lambda: TieredKVCache.stacked_from_layers(list(ks), list(vs), lens, POL))

# lengths out of range / wrong
for bad in ([49, 7], [-1, 7], [40], [40, 7, 1], [40.0, 7.0], [True, 7]):
    each(f"lengths {bad}", lambda bad=bad: TieredKVCache.stacked_from_layers(ks, vs, jnp.asarray(bad), POL))
each("capacity not a block multiple", lambda: TieredKVCache.stacked_from_layers(
    tuple(k[:, :, :40] for k in ks), tuple(v[:, :, :40] for v in vs), jnp.array([40, 7]), POL))

# NaN / Inf: the flags and values, direct vs a layer at a time
a, b = kv(seed=5)
a = (a[0].at[1, 0, 3, 2].set(jnp.nan),) + a[1:]
b = b[:2] + (b[2].at[0, 1, 45, 0].set(jnp.inf),)  # past length 40 of row 0: not a valid token
b = (b[0].at[1, 1, 2, 0].set(-jnp.inf),) + b[1:]
outs = each("NaN in k0 row 1, -Inf in v0 row 1, +Inf past row 0's length in v2",
            lambda: TieredKVCache.stacked_from_layers(a, b, lens, POL))
nf = {p: np.asarray(o[1].nonfinite) for p, o in outs.items()}
print("   nonfinite [L, B, H] direct:", nf["direct"].astype(int).tolist())
print("   nonfinite equal across paths:", all(np.array_equal(nf["direct"], x) for x in nf.values()))
leaves_equal = all(np.array_equal(tiers.to_numpy(x), tiers.to_numpy(y), equal_nan=True)
                   for p in ("layer", "loop")
                   for x, y in zip(jax.tree.leaves(outs["direct"][1]), jax.tree.leaves(outs[p][1])))
print("   every leaf equal across paths:", leaves_equal)

# committed, memory kinds, shared buffers
for committed in (True, False):
    a, b = kv(seed=7, committed=committed)
    n = jnp.array([40, 7], jnp.int32) if not committed else jax.device_put(jnp.array([40, 7], jnp.int32),
                                                                            jax.devices()[0])
    res = {p: call(p, lambda: TieredKVCache.stacked_from_layers(a, b, n, POL))[1] for p in PATHS}
    for p, c in res.items():
        lv = jax.tree.leaves(c)
        uncommitted = sum(not x.committed for x in lv)
        kinds = {x.sharding.memory_kind for x in (c.host_k, c.host_v)}
        ptrs = {x.unsafe_buffer_pointer() for x in (*a, *b, n)}
        shared = [jax.tree_util.keystr(kp) for kp, x in jax.tree_util.tree_flatten_with_path(c)[0]
                  if x.sharding.memory_kind != "pinned_host" and x.unsafe_buffer_pointer() in ptrs]
        print(f"-- inputs committed={committed} {p:7s}: {uncommitted}/{len(lv)} leaves uncommitted; tier 2 in "
              f"{kinds}; leaves sharing an input's buffer: {shared}")
