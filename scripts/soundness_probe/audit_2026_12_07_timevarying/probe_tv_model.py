"""Time-varying attention through a 2-layer TieredModelCache, driven the way models.llama drives it, but with
designed per-layer queries/keys/values instead of a model's (so attention can be made to move):

  adaptive  llama.forward_hidden's "adaptive" step: lax.cond(wants_rung1_pass) between a rung-0-1 and a rung-0 first
            pass over the layers (lax.fori_loop, traced layer index), then (one cond) the second pass -- the whole
            ladder from the step's starting cache -- if needs_slow_path, and with_lengths (maintenance: deferred
            hot-set blocks, flushes) on rare steps, with_lengths(maintain=False) on common ones;
  bridge    models.generate's nested loop / decode bridge: a rung-0 first pass (decode_first_pass's logic:
            _step_is_rare -> undo_step), and where redo, the adaptive step again from the undone cache;
  straight  the "straight" schedule's step: a rung-0 fast pass, second pass if needed.

hot_refresh "deferred" | "immediate" | "prefetch". Every layer-head-step: probe_cert.check_step against a float64
numpy reference over that layer's stored originals (the view before the step with the token written), the hot
set == originals, NaN in certified outputs, and per step: rung0_streak / slow_steps against a recount from the
certificates, hot_pending clear, lengths; cache invariants of every layer after each flush and at the end.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_timevarying/probe_tv_model.py [scenario ...]
    kernel path: CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused CERTATTN_FETCH_KERNEL=1 CERTATTN_WRITE_KERNEL=1 <same>
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from check_any import check_step_any as check_step  # noqa: E402
from tv_common import PATH, SCENARIOS, TvTally, cache_invariants, hot_set_consistent, ratio_and_nan, stored  # noqa: E402

from certattn_jax import model_cache  # noqa: E402
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.model_cache import TieredModelCache  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402

L, H, G, d = 2, 2, 2, 16
# name: (block, key bits, value bits, dtype, token dtype, cache policy kwargs, model policy overrides, driver)
CONFIGS = {
    "b16_k8v4_bf16_adaptive_deferred": (16, 8, 4, jnp.bfloat16, jnp.bfloat16, dict(k_max=2, v_max=2),
                                        dict(hot_refresh="deferred"), "adaptive"),
    "b16_k4v2_f16_hot4_tight_adaptive_immediate": (16, 4, 2, jnp.float16, jnp.float16,
                                                   dict(k_max=2, v_max=2, hot_slots=4),
                                                   dict(eps=3e-3, hot_refresh="immediate"), "adaptive"),
    "b64_k8v4_f16_kmax4to2_bridge_deferred": (64, 8, 4, jnp.float16, jnp.float16, dict(k_max=4, v_max=2),
                                              dict(k_max=2, hot_refresh="deferred"), "bridge"),
    "b16_k8v4_bf16_kmax1_hot3_tighter_bridge_prefetch": (16, 8, 4, jnp.bfloat16, jnp.float32,
                                                         dict(k_max=1, v_max=1, hot_slots=3),
                                                         dict(eps=2e-4, hot_refresh="prefetch"), "bridge"),
    "b64_k4v2_bf16_straight_deferred": (64, 4, 2, jnp.bfloat16, jnp.bfloat16, dict(k_max=2, v_max=2),
                                        dict(hot_refresh="deferred"), "straight"),
    "b16_k4v2_f16_tight_adaptive_prefetch": (16, 4, 2, jnp.float16, jnp.float16, dict(k_max=2, v_max=2),
                                             dict(eps=1e-3, hot_refresh="prefetch"), "adaptive"),
}


def layers_pass(model, Q, Kt, Vt, new_lengths):
    """Every layer's attend in a fori_loop (traced layer index), outs [L, B, Hq, d]."""
    B = Q.shape[1]
    outs0 = jnp.zeros((L, B, H * G, d), Q.dtype)

    def body(layer, carry):
        m, outs = carry
        out, m = m.attend(layer, Q[layer][:, None], Kt[layer], Vt[layer], new_lengths)
        return m, jax.lax.dynamic_update_index_in_dim(outs, out[:, 0].astype(outs.dtype), layer, 0)

    m, outs = jax.lax.fori_loop(0, L, body, (model, outs0))
    return outs, m


def plain_step(cache, Q, Kt, Vt, new_lengths, schedule):
    """llama.forward_hidden's two-pass step (the adaptive or straight schedule) over a model cache."""
    def second_pass_if_needed(o_fast, c_fast):
        def rare():
            def slow():
                o, c = layers_pass(cache, Q, Kt, Vt, new_lengths)  # the whole ladder, from the step's start
                return o, c.slow_path_done()
            o, c = jax.lax.cond(c_fast.needs_slow_path(), slow, lambda: (o_fast, c_fast.fast_path_done()))
            return o, c.with_lengths(new_lengths)

        def common():
            return o_fast, c_fast.fast_path_done().with_lengths(new_lengths, maintain=False)
        rare_ = c_fast.needs_slow_path() | c_fast.maintenance_due(new_lengths)
        return jax.lax.cond(rare_, rare, common)

    def first(top):
        def run():
            o, c = layers_pass(cache.decode_fast_path(top), Q, Kt, Vt, new_lengths)
            return o, c.fast_pass_result()
        return run

    if schedule == "adaptive":
        return second_pass_if_needed(*jax.lax.cond(cache.wants_rung1_pass(), first(1), first(0)))
    return second_pass_if_needed(*first(0)())


@functools.partial(jax.jit, static_argnames="driver")
def model_step(cache, Q, Kt, Vt, active, driver):
    new_lengths = cache.lengths + active.astype(jnp.int32)
    if driver in ("adaptive", "straight"):
        o, c = plain_step(cache, Q, Kt, Vt, new_lengths, driver)
        return o, c, jnp.bool_(False)
    # bridge: decode_first_pass(rung0=True)'s logic, then the plain adaptive step where redo
    o_fast, c_fast = layers_pass(cache.decode_fast_path(0), Q, Kt, Vt, new_lengths)
    redo = c_fast.needs_slow_path() | c_fast.maintenance_due(new_lengths)
    done = c_fast.fast_path_done().with_lengths(new_lengths, maintain=False).undo_step(redo, cache)
    o, c = jax.lax.cond(redo, lambda: plain_step(done, Q, Kt, Vt, new_lengths, "adaptive"), lambda: (o_fast, done))
    return o, c, redo


def run_case(t: TvTally, scen, cname, seed, steps):
    Bk, kb, vb, dt, tok_dt, cache_kw, over, driver = CONFIGS[cname]
    Bsz = 3 if scen != "switch_ab" else 2
    datas = [SCENARIOS[scen](np.random.default_rng(seed + 7 * l), Bsz, H, G, d, Bk, steps) for l in range(L)]
    Ks = [stored(x["K"], dt).astype(np.float64) for x in datas]
    Vs = [stored(x["V"], dt).astype(np.float64) for x in datas]
    L0, act = datas[0]["L0"], datas[0]["active"]
    B = Ks[0].shape[0]
    base = CertPolicy(block_size=Bk, group_size=16, key_bits=kb, value_bits=vb, **cache_kw)
    pol = base.replace(**over)
    P = int(L0.max())
    cap = ((P + steps) // Bk + 2) * Bk
    singles = []
    for l in range(L):
        pk = np.zeros((B, P, H, d), np.float32)
        pv = np.zeros_like(pk)
        for b in range(B):
            pk[b, :L0[b]] = Ks[l][b, :L0[b]]
            pv[b, :L0[b]] = Vs[l][b, :L0[b]]
        singles.append(TieredKVCache.from_dense(jnp.asarray(pk, dt), jnp.asarray(pv, dt), policy=base, capacity=cap,
                                                lengths=jnp.asarray(L0, jnp.int32)))
    sched = "adaptive" if driver in ("adaptive", "bridge") else "straight"
    model = TieredModelCache.from_layers(singles, num_q_heads=H * G, policy=pol, schedule=sched)
    lens = L0.copy()
    t.cases += 1
    worst = 0.0
    streak, slow = 0, 0
    redos = 0
    for s in range(steps):
        a = act[s]
        kt = np.full((L, B, 1, H, d), 500.0, np.float32)  # an inactive row's token must leave no trace
        vt = np.full_like(kt, -500.0)
        for l in range(L):
            for b in range(B):
                if a[b]:
                    kt[l, b, 0] = datas[l]["K"][b, lens[b]]
                    vt[l, b, 0] = datas[l]["V"][b, lens[b]]
        Qs = jnp.asarray(np.stack([datas[l]["Q"][s] for l in range(L)]), dt)
        ktj, vtj = jnp.asarray(kt, tok_dt), jnp.asarray(vt, tok_dt)
        befores = [model.layer_view(l).write_token(ktj[l], vtj[l], jnp.asarray(a)) for l in range(L)]
        flushed_before = np.asarray(model.store.flushed[0]).copy()
        streak_before, slow_before = int(model.rung0_streak), int(model.slow_steps)
        wants1 = bool(model.wants_rung1_pass())
        o, model, redo = model_step(model, Qs, ktj, vtj, jnp.asarray(a), driver)
        redos += int(redo)
        lens = lens + a.astype(int)
        certs = model.last_certificate
        tag = f"{scen}/{cname}/step{s}"
        any_above0 = False
        any_slow = False
        for l in range(L):
            cert = jax.tree.map(lambda x: x[l], certs)
            after = model.layer_view(l)
            t.out_ulp = float(np.max(np.abs(np.asarray(o[l], np.float32)))) * float(jnp.finfo(dt).eps)
            check_step(t, f"{tag}/L{l}", Qs[l], befores[l], after, o[l], cert, pol, Ks[l], Vs[l], lens, 0)
            hot_set_consistent(t, f"{tag}/L{l}", after, Ks[l], Vs[l])
            worst = max(worst, ratio_and_nan(t, f"{tag}/L{l}", o[l], cert, Ks[l], Vs[l], lens, Qs[l]))
            r = np.asarray(cert.rung)
            any_above0 |= bool(np.any(r > 0))
            # the fast pass answers rungs 0..top; a head above that means the second pass ran
            any_slow |= bool(np.any(r >= 2)) or (not wants1 and bool(np.any(r >= 1)))
        # counters: recount from this step's certificates
        exp_streak = 0 if any_above0 else streak_before + 1
        if int(model.rung0_streak) != exp_streak:
            t.bad(f"{tag}: rung0_streak {int(model.rung0_streak)} != recount {exp_streak}")
        ds = int(model.slow_steps) - slow_before
        if driver == "straight":
            exp_slow = any_above0
        elif driver == "bridge" and not bool(redo):
            exp_slow = False
        else:
            exp_slow = any_slow
        if ds != int(exp_slow):
            t.bad(f"{tag}: slow_steps moved by {ds}, expected {int(exp_slow)} (wants_rung1 {wants1}, redo {bool(redo)})")
        if not np.array_equal(np.asarray(model.lengths), lens):
            t.bad(f"{tag}: model lengths {np.asarray(model.lengths)} != {lens}")
        if np.any(np.asarray(model.store.hot_pending) >= 0):
            t.bad(f"{tag}: hot_pending not clear after the step")
        if not np.array_equal(np.asarray(model.store.flushed[0]), flushed_before):
            for l in range(L):
                cache_invariants(t, f"{tag}/L{l}/after-flush", model.layer_view(l), Ks[l], Vs[l], lens)
    for l in range(L):
        cache_invariants(t, f"{scen}/{cname}/end/L{l}", model.layer_view(l), Ks[l], Vs[l], lens)
    return worst, redos, int(model.slow_steps)


def main():
    t0 = time.time()
    only = sys.argv[1:]
    lines = []
    total = dict(hs=0, viol=0, worst=0.0)
    print("default schedule on this backend:", model_cache.resolve_schedule("auto"), flush=True)
    for si, scen in enumerate(SCENARIOS):
        if only and scen not in only:
            continue
        t = TvTally(f"model/{scen}")
        t.pinned = [0, 0]
        t.ambiguous = [0, 0]
        worst = 0.0
        pick = [c for c in os.environ.get("TV_MODEL_CONFIGS", "").split(",") if c]  # (a subset, for time)
        for ci, cname in enumerate(CONFIGS):
            if pick and cname not in pick:
                continue
            steps = 40 if CONFIGS[cname][0] == 16 else 30
            w, redos, slow = run_case(t, scen, cname, 5000 + 37 * si + ci, steps)
            worst = max(worst, w)
            print(f"  {scen}/{cname}: head_steps so far {t.head_steps}, rungs {t.rungs}, viol {len(t.viol)}, "
                  f"redos {redos}, slow_steps {slow}, max err/bound {w:.3g} ({time.time() - t0:.0f}s)", flush=True)
        line = t.summary() + f" max_err/bound={worst:.4g} ambiguous_sets={t.ambiguous}"
        print(line, flush=True)
        lines.append(line)
        total["hs"] += t.head_steps
        total["viol"] += len(t.viol)
        total["worst"] = max(total["worst"], worst)
    print("=== SUMMARY", PATH)
    print("\n".join(lines))
    print(f"TOTAL [{PATH}] head_steps={total['hs']} violations={total['viol']} max_err/bound={total['worst']:.4g} "
          f"{time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
