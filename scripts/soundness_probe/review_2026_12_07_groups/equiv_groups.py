"""Grouped conversion (`with_rows_converted` in groups of layers, `_convert_layers_into` + lax.map) against
(1) the pre-change program `_convert_layer_into` of f55e263 (copied here verbatim), a layer at a time, and
(2) an independent per-layer reference: `_from_head_major` (single layer, not stacked) of each layer on its own.
Every field of the stacked store, bit for bit: the rows [start, start + n) against the reference, every other row
against the garbage the store held before (random values in every field, tier 2 included). Layer counts 1, 3, 5, 7;
groups of 1, 2, 3, 4, L; lengths 0, a block multiple, capacity, ragged; start 0 and > 0 in a bigger batch; policies
K8V4, K4V2, key_bits 4, hot_slots 8; float32, bfloat16, float16. Each layer scaled / shifted differently and one
layer holding an Inf (nonfinite flag), so a layer mixed up shows.

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_groups/equiv_groups.py
"""
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax import cache as cm
from certattn_jax import tiers
from certattn_jax.cache import DEVICE_FIELDS, TieredKVCache
from certattn_jax.policy import CertPolicy

FIELDS = DEVICE_FIELDS + ("host_k", "host_v")
H, S, d = 2, 96, 32
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("policy",))
def old_convert_layer_into(store, k, v, lengths, layer, policy, start):  # f55e263's program, verbatim
    c = cm._convert_on_device(k, v, lengths, policy)

    def put(stacked, rows):
        return jax.lax.dynamic_update_slice(stacked, rows[None], (layer, start) + (0,) * (rows.ndim - 1))

    host = {f: put(getattr(store, f), tiers.to_host(getattr(c, f))) for f in ("host_k", "host_v")}
    return store.replace(**{f: put(getattr(store, f), getattr(c, f)) for f in DEVICE_FIELDS}, **host)


def garbage_store(B, L, dtype, policy, seed):
    """A stacked store whose every field holds random values (tier 2 in pinned_host)."""
    rng = np.random.default_rng(seed)
    s = TieredKVCache.init(batch=B, capacity=S, num_kv_heads=H, head_dim=d, dtype=dtype, policy=policy, layers=L)
    new = {}
    for f in FIELDS:
        x = getattr(s, f)
        dt = np.dtype(x.dtype)
        if dt == np.bool_:
            a = rng.random(x.shape) < 0.5
        elif np.issubdtype(dt, np.integer):
            a = rng.integers(-1, 50, x.shape).astype(dt)
        else:
            a = np.asarray(rng.normal(size=x.shape) * 7, np.float32)
        a = jnp.asarray(a, x.dtype)
        new[f] = jax.device_put(a, x.sharding)
    return s.replace(**new)


def snapshot(s):
    return {f: tiers.to_numpy(getattr(s, f)) for f in FIELDS}


def layers_kv(L, n, dtype, seed):
    rng = np.random.default_rng(seed)
    ks = [np.asarray(rng.normal(size=(n, H, S, d)) * (1 + i), np.float32) for i in range(L)]
    vs = [np.asarray(rng.normal(size=(n, H, S, d)) * (1 + 0.5 * i) - i, np.float32) for i in range(L)]
    if L >= 3 and n >= 2:
        vs[2][1, 1, 3, 5] = np.inf  # layer 2, sequence 1, head 1: non-finite (valid token)
    return tuple(jnp.asarray(k, dtype) for k in ks), tuple(jnp.asarray(v, dtype) for v in vs)


def reference_rows(ks, vs, lengths, policy):
    """per field, [L, n, ...] from converting each layer on its own (not stacked)."""
    per = [cm._from_head_major(k, v, lengths, policy) for k, v in zip(ks, vs)]
    return {f: np.stack([tiers.to_numpy(getattr(c, f)) for c in per]) for f in FIELDS}


def eq(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


def check(tag, got, ref, before, start, n):
    bad = []
    for f in FIELDS:
        g, r, b0 = got[f], ref[f], before[f]
        if not eq(g[:, start:start + n], r):
            bad.append(f"{f}[rows]")
        out = [i for i in range(g.shape[1]) if not start <= i < start + n]
        if out and not eq(g[:, out], b0[:, out]):
            bad.append(f"{f}[outside]")
    print(f"  {tag}: {'OK' if not bad else 'DIFFER ' + ', '.join(bad)}", flush=True)
    return not bad


def run(name, L, dtype, policy, lens, B, start, groups, seed=0):
    n = len(lens)
    ks, vs = layers_kv(L, n, dtype, seed)
    lengths = jnp.asarray(lens, jnp.int32)
    layout = policy  # the store's own layout (k_max/slots) is what with_rows_converted uses
    ref = reference_rows(ks, vs, lengths, TieredKVCache.init(batch=1, capacity=S, num_kv_heads=H, head_dim=d,
                                                             dtype=dtype, policy=policy).layout_policy())
    print(f"== {name}: L={L} {jnp.dtype(dtype).name} bits K{policy.key_bits}V{policy.value_bits} "
          f"slots={policy.slots} lens={list(lens)} B={B} start={start}", flush=True)
    ok = True
    # the old program, a layer at a time
    s = garbage_store(B, L, dtype, policy, seed + 1)
    before = snapshot(s)
    lay = s.layout_policy()
    for i in range(L):
        s = old_convert_layer_into(s, ks[i], vs[i], lengths, jnp.int32(i), lay, jnp.int32(start))
    ok &= check("old f55e263 program, a layer at a time", snapshot(s), ref, before, start, n)
    layer_bytes = ks[0].nbytes + vs[0].nbytes
    for g in groups:
        cm.CONVERT_GROUP_BYTES = g * layer_bytes
        s = garbage_store(B, L, dtype, policy, seed + 1)
        calls = []
        real = cm._convert_layers_into
        cm._convert_layers_into = lambda st, a, *r, **k: (calls.append(len(a)), real(st, a, *r, **k))[1]
        try:
            s = s.with_rows_converted(start, ks, vs, lengths)
        finally:
            cm._convert_layers_into = real
        hk = s.host_k.sharding.memory_kind
        ok &= check(f"grouped {g} (programs {calls}) tier2 {hk}", snapshot(s), ref, before, start, n)
        ok &= hk == tiers.host_memory_kind() and s.host_v.sharding.memory_kind == hk
    return ok


K8V4 = POLICY
K4V2 = POLICY.replace(key_bits=4, value_bits=2)
K4V4 = POLICY.replace(key_bits=4)
HOT8 = POLICY.replace(k_max=2, hot_slots=8)
LENS = (0, 16, 96, 37)  # empty, a block multiple, capacity, ragged
CASES = [
    ("f32 K8V4 L5", 5, jnp.float32, K8V4, LENS, 7, 3, (1, 2, 3, 5)),
    ("bf16 K8V4 L7", 7, jnp.bfloat16, K8V4, LENS, 6, 0, (2, 3, 4, 7)),
    ("f16 K8V4 L3", 3, jnp.float16, K8V4, LENS, 5, 1, (2, 3)),
    ("f32 K4V2 L5", 5, jnp.float32, K4V2, LENS, 4, 0, (2, 5)),
    ("bf16 K4V2 L3", 3, jnp.bfloat16, K4V2, (96, 0, 5), 5, 2, (2, 3)),
    ("f16 K4V4 L5", 5, jnp.float16, K4V4, (15, 17, 80), 4, 1, (3, 5)),
    ("bf16 hot8 L3", 3, jnp.bfloat16, HOT8, LENS, 4, 0, (2, 3)),
    ("f32 L1", 1, jnp.float32, K8V4, (33,), 3, 2, (1, 4)),
    ("f32 all zero lengths L3", 3, jnp.float32, K8V4, (0, 0), 3, 1, (2, 3)),
]
sel = sys.argv[1:]
res = {c[0]: run(*c) for c in CASES if not sel or c[0] in sel}
print("SUMMARY", res, "ALL OK" if all(res.values()) else "MISMATCH")
