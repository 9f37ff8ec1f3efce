"""Bit-identity of the conversion paths after cc48619/ea16a2e (batched groups, the direct one-program path).

For every configuration, the stacked cache from `TieredKVCache.stacked_from_layers` is built
  ref1   a layer at a time (CONVERT_GROUP_BYTES = 1: `with_rows_converted` -> `_convert_layers_into`, len(ks) == 1)
  ref0   independently: `_from_head_major` (single layer, not stacked) of each layer, stacked here in NumPy
  direct the new default (batched, budget >= every layer: `_convert_all_layers`, nothing preallocated)
  bG     batched groups of G layers (G < L, incl. G not dividing L: the last group overlaps)
  lG     the old lax.map form, groups of G (and L: one group of every layer)
  head   `stacked_from_head_major` (the traced path of TieredModelCache.from_dense), eagerly and inside jit
and compared leaf by leaf: tree structure (static fields included), shape, dtype, memory kind, values bit for bit
(NaN == NaN). `committed` is reported, not failed. `with_rows_converted(start > 0)` into a garbage-filled larger
batch is checked for the batched and loop forms: rows [start, start+n) equal ref1's, every other row untouched.

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_37th/equiv_direct.py [case names...]
"""
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
ALL = FIELDS + ("lengths", "flushed")
H, S, d = 2, 96, 32
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
REAL_BYTES = cm.CONVERT_GROUP_BYTES


def layers_kv(L, n, dtype, seed, special=True):
    rng = np.random.default_rng(seed)
    ks = [np.asarray(rng.normal(size=(n, H, S, d)) * (1 + i), np.float32) for i in range(L)]
    vs = [np.asarray(rng.normal(size=(n, H, S, d)) * (1 + 0.5 * i) - i, np.float32) for i in range(L)]
    if special and L >= 3 and n >= 2:
        vs[2][1, 1, 3, 5] = np.inf  # a non-finite value (valid token)
        ks[L - 1][0, 0, 7, 1] = np.nan
    # put them on the device committed (as a prefill's staging cache is)
    dev = jax.devices()[0]
    return (tuple(jax.device_put(jnp.asarray(k, dtype), dev) for k in ks),
            tuple(jax.device_put(jnp.asarray(v, dtype), dev) for v in vs))


def leaves(c):
    return jax.tree_util.tree_flatten_with_path(c)


def describe(c):
    out = {}
    for path, x in leaves(c)[0]:
        out[jax.tree_util.keystr(path)] = (tiers.to_numpy(x), str(x.dtype), x.shape,
                                           getattr(x.sharding, "memory_kind", None), x.committed)
    return out


def compare(tag, got, want, report):
    bad = []
    if jax.tree.structure(got) != jax.tree.structure(want):
        bad.append(f"treedef {jax.tree.structure(got)} != {jax.tree.structure(want)}")
    g, w = describe(got), describe(want)
    for name in w:
        if name not in g:
            bad.append(f"{name} missing")
            continue
        a, b = g[name], w[name]
        if a[1:4] != b[1:4]:
            bad.append(f"{name} meta {a[1:4]} != {b[1:4]}")
        elif not np.array_equal(a[0], b[0], equal_nan=True):
            bad.append(f"{name} values")
    commit = {n for n in w if n in g and g[n][4] != w[n][4]}
    note = f" (committed differs: {sorted(commit)[:3]}... {len(commit)} leaves)" if commit else ""
    print(f"  {tag}: {'OK' if not bad else 'DIFFER ' + '; '.join(bad[:6])}{note}", flush=True)
    report.append((tag, not bad, bool(commit)))
    return not bad


def build(ks, vs, lengths, policy, budget_layers, form):
    cm.CONVERT_GROUP_FORM = form
    cm.CONVERT_GROUP_BYTES = 1 if budget_layers == 1 else budget_layers * (ks[0].nbytes + vs[0].nbytes)
    calls, real = [], cm._convert_layers_into
    cm._convert_layers_into = lambda st, a, *r, **k: (calls.append(len(a)), real(st, a, *r, **k))[1]
    try:
        return TieredKVCache.stacked_from_layers(ks, vs, lengths, policy), calls
    finally:
        cm._convert_layers_into = real
        cm.CONVERT_GROUP_BYTES = REAL_BYTES
        cm.CONVERT_GROUP_FORM = "batched"


def garbage_store(B, L, dtype, policy, seed):
    rng = np.random.default_rng(seed)
    s = TieredKVCache.init(batch=B, capacity=S, num_kv_heads=H, head_dim=d, dtype=dtype, policy=policy, layers=L)
    new = {}
    for f in ALL:
        x = getattr(s, f)
        dt = np.dtype(x.dtype)
        if dt == np.bool_:
            a = rng.random(x.shape) < 0.5
        elif np.issubdtype(dt, np.integer):
            a = rng.integers(-1, 50, x.shape).astype(dt)
        else:
            a = np.asarray(rng.normal(size=x.shape) * 7, np.float32)
        new[f] = jax.device_put(jnp.asarray(a, x.dtype), x.sharding)
    return s.replace(**new)


def rows_check(tag, got, ref, before, start, n, report):
    bad = []
    for f in ALL:
        g, r, b0 = tiers.to_numpy(getattr(got, f)), tiers.to_numpy(getattr(ref, f)), before[f]
        if f in ("lengths", "flushed"):  # [B] (not per layer) in the stacked form? check the shapes
            pass
        gr = g[..., start:start + n, *([slice(None)] * 0)] if g.ndim == 1 else g[:, start:start + n]
        rr = r if r.ndim >= 1 else r
        if not (gr.shape == rr.shape and gr.dtype == rr.dtype and np.array_equal(gr, rr, equal_nan=True)):
            bad.append(f"{f}[rows]")
        out = [i for i in range(g.shape[0 if g.ndim == 1 else 1]) if not start <= i < start + n]
        go = g[out] if g.ndim == 1 else g[:, out]
        bo = b0[out] if b0.ndim == 1 else b0[:, out]
        if out and not np.array_equal(go, bo, equal_nan=True):
            bad.append(f"{f}[outside]")
    hk = got.host_k.sharding.memory_kind, got.host_v.sharding.memory_kind
    if hk != (tiers.host_memory_kind(),) * 2:
        bad.append(f"tier 2 in {hk}")
    print(f"  {tag}: {'OK' if not bad else 'DIFFER ' + ', '.join(bad)}", flush=True)
    report.append((tag, not bad, False))


def independent(ks, vs, lengths, layout):
    per = [cm._from_head_major(k, v, lengths, layout) for k, v in zip(ks, vs)]
    return {f: np.stack([tiers.to_numpy(getattr(c, f)) for c in per]) for f in ALL}


def run(name, L, dtype, policy, lens, groups, B=None, start=None, special=True, seed=0):
    n = len(lens)
    ks, vs = layers_kv(L, n, dtype, seed, special)
    lengths = jax.device_put(jnp.asarray(lens, jnp.int32), jax.devices()[0])
    print(f"== {name}: L={L} {jnp.dtype(dtype).name} K{policy.key_bits}V{policy.value_bits} slots={policy.slots} "
          f"lens={list(lens)} groups={groups}", flush=True)
    report = []
    # a layer at a time (form "loop": with one layer the batched form would take the direct path, group == L)
    ref1, calls = build(ks, vs, lengths, policy, 1, "loop")
    assert calls == [1] * L, calls
    # the independent reference (lengths and flushed are [B] per layer in the per-layer caches: stack them)
    ind = independent(ks, vs, lengths, cm.conversion_layout(policy))
    bad = [f for f in ALL if not np.array_equal(
        tiers.to_numpy(getattr(ref1, f)), ind[f] if f not in ("lengths", "flushed") else ind[f],
        equal_nan=True)]
    print(f"  ref1 (a layer at a time) vs independent _from_head_major per layer: {'OK' if not bad else bad}")
    report.append(("ref1~independent", not bad, False))
    direct, calls = build(ks, vs, lengths, policy, L, "batched")
    assert calls == [], calls  # the direct path: no _convert_layers_into
    compare("direct (_convert_all_layers)", direct, ref1, report)
    for g in groups:
        if g >= L:
            continue
        got, calls = build(ks, vs, lengths, policy, g, "batched")
        compare(f"batched groups of {g} {calls}", got, ref1, report)
    for g in sorted(set(groups) | {L}):
        if g > L:
            continue
        got, calls = build(ks, vs, lengths, policy, g, "loop")
        compare(f"loop groups of {g} {calls}", got, ref1, report)
    head = TieredKVCache.stacked_from_head_major(jnp.stack(ks), jnp.stack(vs), lengths, policy)
    compare("stacked_from_head_major (eager)", head, ref1, report)
    jitted = jax.jit(lambda k, v, ln: TieredKVCache.stacked_from_head_major(k, v, ln, policy))(
        jnp.stack(ks), jnp.stack(vs), lengths)
    compare("stacked_from_head_major (in jit)", jitted, ref1, report)
    if B is not None:
        layout = cm.conversion_layout(policy)
        for form in ("batched", "loop"):
            for g in sorted(set(groups) | {1, L}):
                if g > L:
                    continue
                s = garbage_store(B, L, dtype, layout, seed + 1)
                before = {f: tiers.to_numpy(getattr(s, f)) for f in ALL}
                cm.CONVERT_GROUP_FORM = form
                cm.CONVERT_GROUP_BYTES = 1 if g == 1 else g * (ks[0].nbytes + vs[0].nbytes)
                try:
                    s = s.with_rows_converted(start, ks, vs, lengths)
                finally:
                    cm.CONVERT_GROUP_BYTES = REAL_BYTES
                    cm.CONVERT_GROUP_FORM = "batched"
                rows_check(f"with_rows_converted({start}) into B={B}, {form} groups of {g}", s, ref1, before,
                           start, n, report)
    return report


K8V4 = POLICY
K4V2 = POLICY.replace(key_bits=4, value_bits=2)
K4V4 = POLICY.replace(key_bits=4)
HOT8 = POLICY.replace(k_max=2, hot_slots=8)
LENS = (0, 16, 96, 37)  # empty, a block multiple, capacity, ragged
CASES = [
    ("f32 K8V4 L5", 5, jnp.float32, K8V4, LENS, (2, 3, 4), 7, 3),
    ("bf16 K8V4 L7", 7, jnp.bfloat16, K8V4, LENS, (2, 3, 4, 5), 6, 1),
    ("f16 K8V4 L3", 3, jnp.float16, K8V4, LENS, (2,), 5, 1),
    ("f32 K4V2 L5", 5, jnp.float32, K4V2, LENS, (2, 3), 4, 0),
    ("bf16 K4V2 L3", 3, jnp.bfloat16, K4V2, (96, 0, 5), (2,), 5, 2),
    ("f16 K4V4 L5", 5, jnp.float16, K4V4, (15, 17, 80), (2, 3), 4, 1),
    ("bf16 K4V4 hot8 L4", 4, jnp.bfloat16, K4V4.replace(k_max=2, hot_slots=8), LENS, (3,), 6, 2),
    ("bf16 hot8 L3", 3, jnp.bfloat16, HOT8, LENS, (2,), 4, 0),
    ("f32 L1", 1, jnp.float32, K8V4, (33,), (1,), 3, 2),
    ("f32 B1 full L4", 4, jnp.float32, K8V4, (96,), (3,), None, None),
    ("bf16 all zero L3", 3, jnp.bfloat16, K8V4, (0, 0), (2,), 3, 1),
    ("bf16 no specials L6", 6, jnp.bfloat16, K4V2, (50, 96, 3), (4,), None, None, False),
]
if __name__ == "__main__":
    sel = sys.argv[1:]
    allrep = {}
    for c in CASES:
        if not sel or c[0] in sel:
            allrep[c[0]] = run(*c)
    total = sum(len(r) for r in allrep.values())
    failed = [(k, t) for k, r in allrep.items() for t, ok, _ in r if not ok]
    commit = [(k, t) for k, r in allrep.items() for t, _, cd in r if cd]
    print(f"SUMMARY: {len(allrep)} configurations, {total} comparisons, {len(failed)} differ: {failed}")
    print(f"committed differs in {len(commit)}: {commit[:5]}")
