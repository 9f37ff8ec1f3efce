"""Time-varying attention over a single-layer TieredKVCache, token by token (flush -> write_token(active) ->
certified_attention_step, jitted, cache donated), so that the state carried across steps (hot set filled by
flushes and rung 1, residual, flushed blocks' annotations, running value statistics) meets attention that moves.
Every head-step: probe_cert.check_step (float64 numpy reference over the stored originals), hot-set consistency,
NaN in certified outputs; the cache's invariants after every flush and at the end.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_timevarying/probe_tv_single.py [scenario ...]
    kernel path: CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused CERTATTN_FETCH_KERNEL=1 CERTATTN_WRITE_KERNEL=1 <same>
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from check_any import check_step_any as check_step  # noqa: E402
from tv_common import PATH, SCENARIOS, TvTally, cache_invariants, hot_set_consistent, ratio_and_nan, stored  # noqa: E402

from certattn_jax import step as step_mod  # noqa: E402
from certattn_jax.attention import certified_attention_step  # noqa: E402
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402


@functools.partial(jax.jit, donate_argnums=0)
def write(cache, k, v, active):
    return cache.flush().write_token(k, v, active)


attend = jax.jit(certified_attention_step)

# name: (block_size, key_bits, value_bits, dtype, token dtype written, cache policy kwargs, attend overrides)
CONFIGS = {
    "b16_k8v4_bf16_slots2": (16, 8, 4, jnp.bfloat16, jnp.bfloat16, dict(k_max=2, v_max=2), {}),
    "b16_k4v2_f16_hot4_tight": (16, 4, 2, jnp.float16, jnp.float32, dict(k_max=2, v_max=2, hot_slots=4),
                                dict(eps=3e-3)),
    "b64_k8v4_f16_kmax4to2": (64, 8, 4, jnp.float16, jnp.float16, dict(k_max=4, v_max=2), dict(k_max=2)),
    "b64_k4v2_bf16_slots2": (64, 4, 2, jnp.bfloat16, jnp.float32, dict(k_max=2, v_max=2), {}),
    "b16_k8v4_f16_kmax1_hot3_tighter": (16, 8, 4, jnp.float16, jnp.float16, dict(k_max=1, v_max=1, hot_slots=3),
                                        dict(eps=2e-4)),
    "b16_k4v2_bf16_exact": (16, 4, 2, jnp.bfloat16, jnp.bfloat16, dict(k_max=2, v_max=2),
                            dict(eps=0.0, abs_tol=0.0, layer_fallback_fraction=2.0)),
}
H, G, d = 2, 2, 16


def run_case(t, scen, cname, seed, steps):
    Bk, kb, vb, dt, tok_dt, cache_kw, over = CONFIGS[cname]
    rng = np.random.default_rng(seed)
    data = SCENARIOS[scen](rng, 3 if scen == "ragged_stop" else (2 if scen == "switch_ab" else 3), H, G, d, Bk,
                          steps)
    K = stored(data["K"], dt).astype(np.float64)
    V = stored(data["V"], dt).astype(np.float64)
    Q, L0, act = data["Q"], data["L0"], data["active"]
    B = K.shape[0]
    base = CertPolicy(block_size=Bk, group_size=16, key_bits=kb, value_bits=vb, **cache_kw)
    pol = base.replace(**over) if over else base
    P = int(L0.max())
    pre_k = np.zeros((B, P, H, d), np.float32)
    pre_v = np.zeros_like(pre_k)
    for b in range(B):
        pre_k[b, :L0[b]] = K[b, :L0[b]]
        pre_v[b, :L0[b]] = V[b, :L0[b]]
    cap = ((P + steps) // Bk + 2) * Bk
    cache = TieredKVCache.from_dense(jnp.asarray(pre_k, dt), jnp.asarray(pre_v, dt), policy=base, capacity=cap,
                                     lengths=jnp.asarray(L0, jnp.int32))
    lens = L0.copy()
    t.cases += 1
    worst = 0.0
    for s in range(steps):
        a = act[s]
        kt = np.zeros((B, 1, H, d), np.float32)
        vt = np.zeros_like(kt)
        for b in range(B):
            kt[b, 0] = data["K"][b, lens[b]] if a[b] else 500.0  # an inactive row's token must leave no trace
            vt[b, 0] = data["V"][b, lens[b]] if a[b] else -500.0
        flushed_before = np.asarray(cache.flushed).copy()
        cache = write(cache, jnp.asarray(kt, tok_dt), jnp.asarray(vt, tok_dt), jnp.asarray(a))
        lens = lens + a.astype(int)
        tag = f"{scen}/{cname}/step{s}"
        if not np.array_equal(np.asarray(cache.flushed), flushed_before):
            cache_invariants(t, tag + "/after-flush+write", cache, K, V, lens, maintained=False)
        qj = jnp.asarray(Q[s], dt)
        o, cert, new = attend(qj, cache, pol)
        # 1 ulp of the 16-bit output at its largest magnitude (for the rung-3 vs dense comparison only)
        t.out_ulp = float(np.max(np.abs(np.asarray(o, np.float32)))) * float(jnp.finfo(dt).eps)
        check_step(t, tag, qj, cache, new, o, cert, pol, K, V, lens, 0)
        hot_set_consistent(t, tag, new, K, V)
        worst = max(worst, ratio_and_nan(t, tag, o, cert, K, V, lens, qj))
        cache = new
    cache_invariants(t, f"{scen}/{cname}/end", cache, K, V, lens, maintained=False)
    return worst


def main():
    t0 = time.time()
    only = sys.argv[1:]
    lines = []
    total = dict(hs=0, viol=0, worst=0.0)
    for si, scen in enumerate(SCENARIOS):
        if only and scen not in only:
            continue
        t = TvTally(f"single/{scen}")
        t.pinned = [0, 0]
        t.ambiguous = [0, 0]
        worst = 0.0
        for ci, cname in enumerate(CONFIGS):
            steps = 40 if CONFIGS[cname][0] == 16 else 30
            w = run_case(t, scen, cname, 1000 + 37 * si + ci, steps)
            worst = max(worst, w)
            print(f"  {scen}/{cname}: head_steps so far {t.head_steps}, rungs {t.rungs}, viol {len(t.viol)}, "
                  f"max err/bound {w:.3g} ({time.time() - t0:.0f}s)", flush=True)
        line = t.summary() + f" max_err/bound={worst:.4g} ambiguous_sets={t.ambiguous}"
        print(line, flush=True)
        lines.append(line)
        total["hs"] += t.head_steps
        total["viol"] += len(t.viol)
        total["worst"] = max(total["worst"], worst)
    print("=== SUMMARY", PATH, "fused rung 0 used where eligible:",
          step_mod.uses_fused_rung0 is not None)
    print("\n".join(lines))
    print(f"TOTAL [{PATH}] head_steps={total['hs']} violations={total['viol']} max_err/bound={total['worst']:.4g} "
          f"{time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
