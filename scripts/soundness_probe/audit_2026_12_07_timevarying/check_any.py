"""probe_cert.check_step (audit_2026_12_07), copied, with one change in the rung 0-2 part: the e_key / e_val split and
the ranking truth are required of at least one set of k* exact blocks that reproduces the output, instead of the
single closest set (with 16-bit outputs the cast error puts several sets within the threshold, and the closest one
need not be the promoted one: repro_ranking.py). The k*-pinned statistic is dropped; `t.ambiguous` counts
[heads explained by more than one set, heads checked]."""

from __future__ import annotations

import math

import jax
import numpy as np
from tv_common import attn64, dense_jit, dequantized, f64, mixed64, split_errors, subsets  # noqa: F401


def check_step_any(t, tag, q, cache_before, cache_after, out, cert, policy, K64, V64, lens, min_rung):
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
            matches = []  # every set of k* exact blocks (within the hot set at rung 0) that reproduces the output
            best = (math.inf, None)
            for S in subsets(nfull, ks, pool):
                o_m = mixed64(q64[b, h], K64[b, :, kv], V64[b, :, kv], khat[b, kv], vhat[b, kv], n, nfull, Bk, S)[0]
                dist = float(np.linalg.norm(o_m - o64[b, h]))
                if dist < best[0]:
                    best = (dist, S)
                if dist <= thr:
                    matches.append(S)
            if not matches:
                in_hot = ' in the hot set ' + str(sorted(pool)) if pool is not None else ''
                t.bad(f"{where}: no set of k*={ks} exact blocks{in_hot} "
                      f"reproduces the output (best dist {best[0]:.3g}, thr {thr:.3g})")
                continue
            t.ambiguous[0] += len(matches) > 1
            t.ambiguous[1] += 1
            # the claims (split, ranking truth) must hold for at least one set that explains the output: with a
            # 16-bit output (its cast error in e_num, hence in thr) several sets often explain it
            fails = []
            for S in matches:
                why = []
                key_term, value_term, _ = split_errors(q64[b, h], K64[b, :, kv], V64[b, :, kv], khat[b, kv],
                                                       vhat[b, kv], n, nfull, Bk, S)
                if key_term > ek * (1 + 1e-4) + 1e-30:
                    why.append(f"key term {key_term:.6g} > e_key {ek:.6g}")
                if value_term > ev * (1 + 1e-4) + 1e-30:
                    why.append(f"value term {value_term:.6g} > e_val {ev:.6g}")
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
                        why.append(f"ranking_ok but tail block log-mass {tail:.4f} > weakest promoted {weakest:.4f} "
                                   f"+ margin {policy.rank_margin}")
                if not why:
                    break
                fails.append((sorted(S), why))
            else:
                t.bad(f"{where}: every one of the {len(matches)} sets explaining the output fails: {fails[:3]}")
