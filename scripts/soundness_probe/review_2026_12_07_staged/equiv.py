"""with_staged_sequences(start, staging) against with_sequences(start, spec.from_staging(staging)) on a cache whose
rows were prefilled and decoded before (hot sets, certificates, rung-0 streak written): every leaf of the result
bit for bit, the rows outside untouched, tier 2 in host memory; the same rows written a second time; then two
decode steps on both results (logits and every leaf again). tests/test_staging_groups.py's tiny model.

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_staged/equiv.py [case ...]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax.cache import DEVICE_FIELDS
from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.model_cache import cache_spec
from certattn_jax.policy import CertPolicy
from models import generate as gen
from models import llama
from models.config import LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
CAP = 96
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)


def prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


def decoded(params, spec, narrow):
    cache, _ = gen.prefill(params, CFG, prompts(9, (60, 50, 90, 10)), CAP, cache_factory=spec, prefill_chunk=16,
                           staging_batch=None)
    rng = np.random.default_rng(5)
    for _ in range(3):
        tok = jnp.asarray(rng.integers(0, CFG.vocab_size, (4, 1)), jnp.int32)
        _, cache = fwd(params, CFG, tok, cache)
    if narrow:
        cache = cache.with_policy(cache.policy.replace(k_max=narrow))
    return cache


def leaves(c):
    return [np.asarray(x) for x in jax.tree.leaves(c)]


def named(c):
    s = c.store
    out = {f: np.asarray(getattr(s, f)) for f in DEVICE_FIELDS + ("host_k", "host_v")}
    out.update(cert_packed=np.asarray(c.cert_packed), lengths=np.asarray(c.lengths)[None],
               rung0_streak=np.asarray(c.rung0_streak), slow_steps=np.asarray(c.slow_steps))
    return out


def compare(tag, a, b):
    bad = []
    la, lb = jax.tree.structure(a), jax.tree.structure(b)
    if la != lb:
        bad.append(f"treedef differs: {la} vs {lb}")
    for (pa, xa), xb in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=False):
        xa, xb = np.asarray(xa), np.asarray(xb)
        if xa.shape != xb.shape or xa.dtype != xb.dtype or not np.array_equal(xa, xb, equal_nan=True):
            bad.append(jax.tree_util.keystr(pa))
    print(f"  {tag}: {'IDENTICAL' if not bad else 'DIFFER ' + ', '.join(bad)}", flush=True)
    return not bad


def manual_staging(dtype, lens, seed):
    rng = np.random.default_rng(seed)
    n = len(lens)
    shape = (n, CFG.num_kv_heads, CAP, CFG.head_dim)
    mk = lambda: tuple(jnp.asarray(rng.normal(size=shape), dtype) for _ in range(CFG.num_layers))  # junk past lens
    return DenseKVCache(k=mk(), v=mk(), lengths=jnp.asarray(lens, jnp.int32))


def staged(params, spec, ps):
    cache, _ = gen.prefill(params, CFG, ps, CAP, cache_factory=lambda b, c: spec.staging(b, c), prefill_chunk=16)
    return cache


def case(name, mode="certified", dtype=jnp.float32, policy=POLICY, narrow=None, start=1, manual=False):
    print(f"== {name}", flush=True)
    params = llama.init_params(CFG, jax.random.key(0), dtype, scale=0.3)
    spec = cache_spec(mode, CFG, dtype, policy)
    ok = True
    snapshot = named(decoded(params, spec, narrow))
    print("  old hot_ids used:", int((snapshot["hot_ids"] >= 0).sum()), "old cert rows nonempty:",
          bool(np.any(snapshot["cert_packed"] != snapshot["cert_packed"][:, :, :1])),
          "rung0_streak", int(snapshot["rung0_streak"]), flush=True)
    if manual:
        st1, st2 = manual_staging(dtype, (0, 96), 1), manual_staging(dtype, (16, 94), 2)  # decode reaches 96
    else:
        st1, st2 = staged(params, spec, prompts(11, (1, 16, 17))), staged(params, spec, prompts(12, (33, 2, 80)))
    n = st1.batch
    a = decoded(params, spec, narrow).with_staged_sequences(start, st1)
    b = decoded(params, spec, narrow).with_sequences(start, spec.from_staging(st1))
    ok &= compare("first write vs with_sequences(from_staging)", a, b)
    na = named(a)
    outside = [r for r in range(4) if not start <= r < start + n]
    diff = [k for k, v in na.items() if k not in ("rung0_streak", "slow_steps")
            and not np.array_equal(np.take(v, outside, axis=1), np.take(snapshot[k], outside, axis=1))]
    print(f"  rows {outside} untouched: {not diff} {diff}", flush=True)
    print("  lengths", na["lengths"].tolist(), "tier2", a.store.host_k.sharding.memory_kind,
          a.store.host_v.sharding.memory_kind, "streak kept", int(na["rung0_streak"]) == int(snapshot["rung0_streak"]))
    ok &= not diff and a.store.host_k.sharding.memory_kind == "pinned_host"
    a = a.with_staged_sequences(start, st2)
    b = b.with_sequences(start, spec.from_staging(st2))
    ok &= compare("second write, same rows", a, b)
    rng = np.random.default_rng(7)
    for s in range(2):
        tok = jnp.asarray(rng.integers(0, CFG.vocab_size, (4, 1)), jnp.int32)
        la, a = fwd(params, CFG, tok, a)
        lb, b = fwd(params, CFG, tok, b)
        ok &= compare(f"decode step {s} logits", la, lb)
    ok &= compare("after decode, every leaf", a, b)
    if mode == "certified":
        c = jax.tree.map(np.asarray, a.last_certificate)
        print("  last step: certified or escalated everywhere:", bool(np.all(c.certified | (c.rung >= 1))),
              "rungs", np.bincount(c.rung.ravel(), minlength=5).tolist())
    print(f"  -> {'OK' if ok else 'MISMATCH'}", flush=True)
    return ok


CASES = {
    "cert": dict(),
    "naive": dict(mode="naive"),
    "hot8": dict(policy=POLICY.replace(hot_slots=8)),
    "k4v2": dict(policy=POLICY.replace(key_bits=4, value_bits=2), start=0),
    "bf16": dict(dtype=jnp.bfloat16),
    "f16": dict(dtype=jnp.float16, start=0),
    "narrow": dict(narrow=2),
    "manual": dict(manual=True, start=2),
}
names = sys.argv[1:] or list(CASES)
res = {k: case(k, **CASES[k]) for k in names}
print("SUMMARY", res)
