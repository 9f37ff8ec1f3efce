"""Repro / diagnosis of the ranking-truth finding of probe_tv_single.py alternate/b16_k8v4_bf16_slots2/step35
(b=0, KV head 0, rung 1, k*=4): replays the same decode and, at that step, prints per full block the float64
log-mass (max over the KV head's query heads, normalized) from the dequantized (INT8) keys and from the exact
keys, which blocks rung 1's widened selection (top 2 k_max by the INT estimate) promotes, and the output's
distance to the mixed attention of each candidate set.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_timevarying/repro_ranking.py [scenario config step b kv]
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import probe_tv_single as P  # noqa: E402
from common import mixed64  # noqa: E402
from tv_common import SCENARIOS, dequantized, f64, stored  # noqa: E402

from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402

scen, cname, STEP, BB, KV = (sys.argv[1:] + ["alternate", "b16_k8v4_bf16_slots2", "35", "0", "0"][len(sys.argv) - 1:])[:5]
STEP, BB, KV = int(STEP), int(BB), int(KV)
si, ci = list(SCENARIOS).index(scen), list(P.CONFIGS).index(cname)
Bk, kb, vb, dt, tok_dt, cache_kw, over = P.CONFIGS[cname]
steps = 40 if Bk == 16 else 30
rng = np.random.default_rng(1000 + 37 * si + ci)
data = SCENARIOS[scen](rng, 3 if scen == "ragged_stop" else (2 if scen == "switch_ab" else 3), P.H, P.G, P.d, Bk, steps)
K = stored(data["K"], dt).astype(np.float64)
V = stored(data["V"], dt).astype(np.float64)
Q, L0, act = data["Q"], data["L0"], data["active"]
B = K.shape[0]
H, G, d = P.H, P.G, P.d
base = CertPolicy(block_size=Bk, group_size=16, key_bits=kb, value_bits=vb, **cache_kw)
pol = base.replace(**over) if over else base
Pm = int(L0.max())
pre_k = np.zeros((B, Pm, H, d), np.float32)
pre_v = np.zeros_like(pre_k)
for b in range(B):
    pre_k[b, :L0[b]] = K[b, :L0[b]]
    pre_v[b, :L0[b]] = V[b, :L0[b]]
cap = ((Pm + steps) // Bk + 2) * Bk
cache = TieredKVCache.from_dense(jnp.asarray(pre_k, dt), jnp.asarray(pre_v, dt), policy=base, capacity=cap,
                                 lengths=jnp.asarray(L0, jnp.int32))
lens = L0.copy()
for s in range(STEP + 1):
    a = act[s]
    kt = np.where(a[:, None, None, None], np.stack([data["K"][b, min(lens[b], data["K"].shape[1] - 1)] for b in range(B)])[:, None], 500.0)
    vt = np.where(a[:, None, None, None], np.stack([data["V"][b, min(lens[b], data["V"].shape[1] - 1)] for b in range(B)])[:, None], -500.0)
    cache = P.write(cache, jnp.asarray(kt, tok_dt), jnp.asarray(vt, tok_dt), jnp.asarray(a))
    lens = lens + a.astype(int)
    qj = jnp.asarray(Q[s], dt)
    before = cache
    hot_before = np.asarray(cache.hot_ids).copy()
    o, cert, cache = P.attend(qj, cache, pol)
n = int(lens[BB]); nfull = int(np.asarray(before.flushed)[BB]) // Bk
print(f"step {STEP} b={BB} kv={KV}: n={n} nfull={nfull} hot_ids before {hot_before[BB, KV]} after {np.asarray(cache.hot_ids)[BB, KV]}")
print("rung", np.asarray(cert.rung)[BB], "k*", np.asarray(cert.k_star)[BB], "ranking_ok", np.asarray(cert.ranking_ok)[BB],
      "bound", np.asarray(cert.error_bound)[BB])
khat, vhat = dequantized(before)
q64 = f64(qj)
lm_int = np.full((G, nfull), -np.inf)
lm_ex = np.full((G, nfull), -np.inf)
for g in range(G):
    h = KV * G + g
    for which, arr in (("int", lm_int), ("ex", lm_ex)):
        k = K[BB, :n, KV].copy()
        if which == "int":
            for j in range(nfull):
                k[j * Bk:(j + 1) * Bk] = khat[BB, KV, j]
        s_ = k @ q64[BB, h] / math.sqrt(d)
        z = s_.max() + math.log(np.exp(s_ - s_.max()).sum())
        for j in range(nfull):
            sj = s_[j * Bk:(j + 1) * Bk]
            arr[g, j] = sj.max() + math.log(np.exp(sj - sj.max()).sum()) - z
    # residual mass
a_ = lm_int.max(0); e_ = lm_ex.max(0)
print("block:        ", list(range(nfull)))
print("INT lm (maxG):", np.round(a_, 3).tolist())
print("exact lm:     ", np.round(e_, 3).tolist())
top = np.argsort(-a_)[:2 * pol.k_max]
print("rung-1 widened set by the INT estimate (top 2 k_max):", sorted(top.tolist()))
o64 = f64(o)
for h in range(KV * G, KV * G + G):
    res = []
    for S in itertools.combinations(range(nfull), int(np.asarray(cert.k_star)[BB, h])):
        om = mixed64(q64[BB, h], K[BB, :, KV], V[BB, :, KV], khat[BB, KV], vhat[BB, KV], n, nfull, Bk, set(S))[0]
        res.append((float(np.linalg.norm(om - o64[BB, h])), S))
    res.sort()
    print(f"head {h}: output's distance to the mixed attention of k* sets (best 4):",
          [(f"{x:.3g}", S) for x, S in res[:4]], " e_num", float(np.asarray(cert.e_num)[BB, h]))
