"""Probe A: truthfulness of every certificate field of certified_attention_step / ladder.run, single layer.

For each case (shape family x data family x policy variant), several attention calls on one cache (the hot set
evolving through rung 1), and each head checked:
  bound      ||out - attn_f64(tier-2 originals)|| <= error_bound (every head; inf allowed)
  sum        error_bound >= e_key + e_val + e_num, all fields finite or +inf, never NaN, >= 0
  certified  == (bound <= tolerance & finite);  tolerance == eps * ||range of stored values|| + abs_tol
  rung 3/4   out == dense_attention(q, cache) (rung 4 bit for bit), e_val == 0, k_star == #full blocks
  rung 0-2   the output equals (to float noise) the f64 mixed attention of some set S of |S| == k_star exact
             blocks (rung 0: S within the hot set before the call); e_key >= ||sum (p - p~) v||,
             e_val >= ||sum p~ (v - v~)|| (the doc's split, p~ over the attended keys' exact reals)
  ranking    ranking_ok True at rungs 0-2 implies: no tail block's true (f64) KV-head log-mass exceeds the
             weakest promoted block's by more than rank_margin (+0.05 nats slack for the normalizers)

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07/probe_cert.py [--quick]
"""

from __future__ import annotations

import functools
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import PATH, Tally, attn64, dequantized, f64, hot_set_consistent, mixed64, split_errors, subsets  # noqa: E402,E501

from certattn_jax import ladder, step  # noqa: E402
from certattn_jax.attention import certified_attention_step, dense_attention  # noqa: E402
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402

QUICK = "--quick" in sys.argv


@functools.partial(jax.jit, static_argnames=("min_rung",))
def run_ladder(q, cache, policy, min_rung=0):
    if min_rung == 0:
        return certified_attention_step(q, cache, policy)
    return ladder.run(q, cache, policy, min_rung=min_rung)


dense_jit = jax.jit(dense_attention)


def draw(rng, fam, B, T, H, G, d, Bk):
    k = rng.standard_normal((B, T, H, d))
    v = rng.standard_normal((B, T, H, d))
    q = rng.standard_normal((B, H * G, d))
    if fam == "peaked":  # one token aligned with every query of its KV head, large
        for b in range(B):
            for h in range(H):
                i = rng.integers(T)
                dirn = q[b, h * G:(h + 1) * G].mean(0)
                k[b, i, h] = dirn / np.linalg.norm(dirn) * math.sqrt(d) * 4
    elif fam == "ties":  # every full block holds the same keys and values: tied block masses
        nbf = T // Bk
        if nbf >= 1:
            kb, vb = k[:, :Bk].copy(), v[:, :Bk].copy()
            for j in range(nbf):
                k[:, j * Bk:(j + 1) * Bk] = kb
                v[:, j * Bk:(j + 1) * Bk] = vb
        q *= 2
    elif fam == "one_block":  # all mass in one block: its keys aligned with the query
        nbf = max(T // Bk, 1)
        for b in range(B):
            j = rng.integers(nbf)
            lo, hi = j * Bk, min((j + 1) * Bk, T)
            for h in range(H):
                dirn = q[b, h * G:(h + 1) * G].mean(0)
                k[b, lo:hi, h] = dirn / np.linalg.norm(dirn) * 3 + 0.3 * k[b, lo:hi, h]
        q *= 3
    elif fam == "diffuse":
        q *= 0.1
    elif fam == "offset":  # values with a large common offset
        v = 50.0 + 0.5 * v
    return k.astype(np.float32), v.astype(np.float32), q.astype(np.float32)


SHAPES = {
    # name: (B, H, G, d, T, capacity, lengths or None, policy layout)
    "T<block": (2, 2, 2, 16, 11, 32, None, dict(block_size=16, group_size=16, k_max=2, v_max=2)),
    "T%block": (1, 2, 2, 16, 75, 96, None, dict(block_size=16, group_size=16, k_max=2, v_max=2)),
    "T=capacity": (1, 2, 2, 16, 64, 64, None, dict(block_size=16, group_size=16, k_max=2, v_max=2)),
    "ragged": (3, 2, 2, 16, 70, 80, [70, 1, 33], dict(block_size=16, group_size=16, k_max=2, v_max=2)),
    "ragged0": (3, 2, 2, 16, 40, 48, [40, 0, 17], dict(block_size=16, group_size=16, k_max=2, v_max=2)),
    "gqa1": (1, 3, 1, 16, 90, 96, None, dict(block_size=16, group_size=8, k_max=4, v_max=2)),
    "gqa8": (2, 1, 8, 16, 100, 112, [100, 48], dict(block_size=16, group_size=16, k_max=2, v_max=2)),
    "kv4v2": (1, 2, 2, 16, 80, 96, None, dict(block_size=16, group_size=16, key_bits=4, value_bits=2, k_max=2,
                                              v_max=2)),
}
FAMILIES = ("gauss", "peaked", "ties", "one_block", "diffuse", "offset")
VARIANTS = {  # name: (tolerance overrides, min_rung)
    "default": (dict(), 0),
    "tight": (dict(eps=2e-3), 0),
    "rung1": (dict(), 1),
    "rung2": (dict(v_tol=0.0), 2),
    "rung3": (dict(eps=0.0, abs_tol=0.0, layer_fallback_fraction=2.0), 0),
    "rung4": (dict(eps=0.0, abs_tol=0.0, layer_fallback_fraction=1e-6), 0),
}


def check_step(t: Tally, tag, q, cache_before, cache_after, out, cert, policy, K64, V64, lens, min_rung):
    c = jax.tree.map(np.asarray, cert)
    B, Hq, d = q.shape
    H = cache_before.num_kv_heads
    G = Hq // H
    Bk = cache_before.block_size
    q64 = f64(q)
    o64 = f64(out)
    khat, vhat = dequantized(cache_before)
    hot_before = np.asarray(cache_before.hot_ids)
    flushed = np.asarray(cache_before.flushed)
    dense_out = f64(dense_jit(q, cache_before))
    for b in range(B):
        n = int(lens[b])
        nfull = int(flushed[b]) // Bk
        ref = attn64(q64[b], K64[b], V64[b], n)
        for h in range(Hq):
            kv = h // G
            t.head_steps += 1
            bound, ek, ev, en, tol = (float(c.error_bound[b, h]), float(c.e_key[b, h]), float(c.e_val[b, h]),
                                      float(c.e_num[b, h]), float(c.tolerance[b, h]))
            rung, ks, rok, cert_ok = int(c.rung[b, h]), int(c.k_star[b, h]), bool(c.ranking_ok[b, h]), \
                bool(c.certified[b, h])
            t.rungs[rung] += 1
            where = f"{tag} b={b} h={h} n={n} nfull={nfull} rung={rung} k*={ks}"
            vals = [bound, ek, ev, en, tol]
            if any(math.isnan(x) for x in vals) or any(x < 0 for x in vals):
                t.bad(f"{where}: NaN/negative field {vals}")
            if n == 0:
                t.note(f"{where}: empty row: out={o64[b, h][:3]} bound={bound} certified={cert_ok} rok={rok}")
                continue
            err = float(np.linalg.norm(o64[b, h] - ref[h]))
            if not err <= bound:
                t.bad(f"{where}: error {err:.6g} > bound {bound:.6g} (e_key {ek:.3g} e_val {ev:.3g} e_num {en:.3g})")
            if math.isfinite(bound) and bound < (ek + ev + en) * (1 - 1e-6):
                t.bad(f"{where}: bound {bound} < e_key+e_val+e_num {ek + ev + en}")
            if cert_ok != (bound <= tol and math.isfinite(bound)):
                t.bad(f"{where}: certified={cert_ok} but bound {bound} tol {tol}")
            # tolerance against the stored values' range
            vv = V64[b, :n, kv]
            rng_true = float(np.linalg.norm(vv.max(0) - vv.min(0)))
            want = policy.eps * rng_true + policy.abs_tol
            if tol < want * (1 - 1e-6) - 1e-30:
                t.bad(f"{where}: tolerance {tol} below eps*range+abs_tol {want}")
            if tol > want * 1.01 + 1e-6:
                t.note(f"{where}: tolerance {tol} above eps*range+abs_tol {want} by {tol / max(want, 1e-30):.4f}x")
            if not rok:
                t.bad(f"{where}: ranking_ok False on the rung used")
            if rung < min_rung:
                t.bad(f"{where}: rung {rung} below min_rung {min_rung}")
            if rung >= 3:
                if ev != 0.0:
                    t.bad(f"{where}: e_val {ev} at an exact rung")
                if ks != nfull:
                    t.bad(f"{where}: k_star {ks} at an exact rung, {nfull} full blocks")
                diff = float(np.max(np.abs(o64[b, h] - dense_out[b, h])))
                if rung == 4 and diff != 0.0:
                    t.bad(f"{where}: rung-4 output differs from dense_attention by {diff}")
                if rung == 3 and diff > 1e-6 * (1 + np.max(np.abs(dense_out[b, h]))):
                    t.bad(f"{where}: rung-3 output differs from dense_attention by {diff}")
                continue
            # rungs 0-2: which set of exact blocks produced the output?
            scale = 1.0 + float(np.max(np.abs(vv)))
            thr = 2e-5 * scale + 2 * en
            pool = None if rung > 0 else set(hot_before[b, kv].tolist())
            best = (math.inf, None)
            for S in subsets(nfull, ks, pool):
                o_m = mixed64(q64[b, h], K64[b, :, kv], V64[b, :, kv], khat[b, kv], vhat[b, kv], n, nfull, Bk, S)[0]
                dist = float(np.linalg.norm(o_m - o64[b, h]))
                if dist < best[0]:
                    best = (dist, S)
            if best[1] is None or best[0] > thr:
                # does another size explain it?
                other = []
                for size in range(0, nfull + 1):
                    if size == ks:
                        continue
                    for S in subsets(nfull, size):
                        o_m = mixed64(q64[b, h], K64[b, :, kv], V64[b, :, kv], khat[b, kv], vhat[b, kv], n, nfull,
                                      Bk, S)[0]
                        dist = float(np.linalg.norm(o_m - o64[b, h]))
                        if dist <= thr:
                            other.append((size, sorted(S), dist))
                in_hot = ' in the hot set ' + str(sorted(pool)) if pool is not None else ''
                t.bad(f"{where}: no set of k*={ks} exact blocks{in_hot} "
                      f"reproduces the output (best dist {best[0]:.3g}, thr {thr:.3g}); "
                      f"other sizes matching: {other[:4]}")
                continue
            S = best[1]
            if nfull <= 6:  # is k* pinned down (no set of another size reproduces the output)?
                pinned = True
                for size in range(0, nfull + 1):
                    if size == ks or not pinned:
                        continue
                    for S2 in subsets(nfull, size):
                        o_m = mixed64(q64[b, h], K64[b, :, kv], V64[b, :, kv], khat[b, kv], vhat[b, kv], n, nfull,
                                      Bk, S2)[0]
                        if float(np.linalg.norm(o_m - o64[b, h])) <= thr:
                            pinned = False
                            break
                t.pinned[0] += pinned
                t.pinned[1] += 1
            key_term, value_term, _ = split_errors(q64[b, h], K64[b, :, kv], V64[b, :, kv], khat[b, kv],
                                                   vhat[b, kv], n, nfull, Bk, S)
            if key_term > ek * (1 + 1e-4) + 1e-30:
                t.bad(f"{where}: key term {key_term:.6g} > e_key {ek:.6g} (S={sorted(S)})")
            if value_term > ev * (1 + 1e-4) + 1e-30:
                t.bad(f"{where}: value term {value_term:.6g} > e_val {ev:.6g} (S={sorted(S)})")
            # ranking truth (per KV head: max over its G query heads of the true normalized log-mass)
            if S and nfull > len(S):
                lm = np.full((G, nfull), -np.inf)
                for g in range(G):
                    hh = kv * G + g
                    s = K64[b, :n, kv] @ q64[b, hh] / math.sqrt(d)
                    z = s.max() + math.log(np.exp(s - s.max()).sum())
                    for j in range(nfull):
                        sj = s[j * Bk:(j + 1) * Bk]
                        lm[g, j] = sj.max() + math.log(np.exp(sj - sj.max()).sum()) - z
                e = lm.max(0)
                weakest = min(e[j] for j in S)
                tail = max(e[j] for j in range(nfull) if j not in S)
                if tail > weakest + policy.rank_margin + 0.05:
                    t.bad(f"{where}: ranking_ok but tail block log-mass {tail:.4f} > weakest promoted {weakest:.4f} "
                          f"+ margin {policy.rank_margin} (S={sorted(S)})")


def main():
    t0 = time.time()
    tallies = {}
    shapes = list(SHAPES)
    fams = FAMILIES
    variants = list(VARIANTS)
    if QUICK:
        shapes, fams = ["T%block", "ragged", "gqa8"], ("gauss", "peaked", "ties")
    Tally.pinned = None
    for si, sname in enumerate(shapes):
        B, H, G, d, T, cap, lens, layout = SHAPES[sname]
        lens = np.asarray(lens if lens is not None else [T] * B)
        t = tallies.setdefault(sname, Tally(sname))
        t.pinned = [0, 0]
        for fi, fam in enumerate(fams):
            rng = np.random.default_rng(1000 * si + fi)
            k, v, q = draw(rng, fam, B, T, H, G, d, layout["block_size"])
            base = CertPolicy(**layout)
            cache0 = TieredKVCache.from_dense(jnp.asarray(k), jnp.asarray(v), policy=base, capacity=cap,
                                              lengths=jnp.asarray(lens, jnp.int32))
            if fi == 0:
                print(sname, "fused rung 0:", step.uses_fused_rung0(cache0, base), "tier-1 kernel:",
                      step.tier1_kernel_runs(cache0, base.tier1), flush=True)
            K64, V64 = k.astype(np.float64), v.astype(np.float64)
            for vname in variants:
                over, min_rung = VARIANTS[vname]
                pol = base.replace(**over)
                cache = cache0
                t.cases += 1
                for s_i in range(3):  # the same query direction three times: rung 1 fills the hot set, rung 0 uses it
                    qs = q + 0.05 * s_i * rng.standard_normal(q.shape).astype(np.float32)
                    qj = jnp.asarray(qs)
                    out, cert, new = run_ladder(qj, cache, pol, min_rung=min_rung)
                    check_step(t, f"{sname}/{fam}/{vname}/call{s_i}", qj, cache, new, out, cert, pol, K64, V64,
                               lens, min_rung)
                    hot_set_consistent(t, f"{sname}/{fam}/{vname}/call{s_i}", new, K64, V64)
                    cache = new
        print(t.summary(), "k* pinned (of checked rung-0..2 heads):", t.pinned, f"{time.time() - t0:.0f}s", flush=True)
    print("=== SUMMARY", PATH)
    for t in tallies.values():
        print(t.summary(), "k* pinned:", t.pinned)
    return 0


if __name__ == "__main__":
    sys.exit(main())
