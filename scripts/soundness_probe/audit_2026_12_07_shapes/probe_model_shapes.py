"""A 2-layer TieredModelCache driven by models.llama.forward (random small LlamaConfig weights) at head_dim / GQA /
KV-head / block / group shapes earlier audits did not cover; schedules "looped" (traced layer index, two passes),
"adaptive" and "straight".

Each decode step is one jitted llama.forward over the certified cache (random teacher-forced tokens). The cache's
`attend` is wrapped (this script only) with a jax.debug.callback that records every call's layer (traced inside the
loops over layers), query, written key/value and output; the last call per layer is the step's answer (a second pass
overwrites the first pass's), and it is checked with check_any.check_step_any against the step's final
certificate (`last_certificate`): error <= bound against float64 numpy over that layer's stored originals (tier 2
plus residual, read back from the cache after the step), and the certificate-field checks. The "before" cache of
a layer is the step's starting layer view with the captured token written. The cache invariants of every layer
are checked after every flush and at the end.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_shapes/probe_model_shapes.py [--cfgs a,b] [--steps N]
    kernel path: CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused CERTATTN_FETCH_KERNEL=1 CERTATTN_WRITE_KERNEL=1 <same>
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from shape_common import PATH, ShapeTally, cache_invariants, check_step_any, f64_arr, ratio_and_nan  # noqa: E402

from certattn_jax import model_cache  # noqa: E402
from certattn_jax.model_cache import cache_spec  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402
from models import llama  # noqa: E402
from models.config import LlamaConfig  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--cfgs", default="")
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--scale", type=float, default=1.0)
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()

BF, F16 = jnp.bfloat16, jnp.float16
# name: (d, G, H, Bk, group, key_bits, value_bits, dtype, B, k_max, hot_slots, eps, schedule, hot_refresh)
CONFIGS = {
    "d80_G3_H1_b16_g16_k8v4_bf16_B3_looped": (80, 3, 1, 16, 16, 8, 4, BF, 3, 2, 0, 0.05, "looped", "deferred"),
    "d128_G4_H3_b32_g32_k4v2_f16_B3_adaptive": (128, 4, 3, 32, 32, 4, 2, F16, 3, 2, 0, 0.01, "adaptive",
                                                "immediate"),
    "d96_G1_H3_b16_g96_k8v4_bf16_B3_hot3_straight": (96, 1, 3, 16, 96, 8, 4, BF, 3, 2, 3, 0.02, "straight",
                                                     "prefetch"),
    "d64_G8_H1_b128_g8_k8v4_f16_B1_looped": (64, 8, 1, 128, 8, 8, 4, F16, 1, 1, 0, 0.05, "looped", "deferred"),
    "d80_G4_H8_b16_g40_k4v2_bf16_B3_adaptive_tight": (80, 4, 8, 16, 40, 4, 2, BF, 3, 2, 4, 2e-3, "adaptive",
                                                      "deferred"),
}

CAPTURED: list = []


def _cap(layer, q, k, v, out):
    CAPTURED.append((int(layer), np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(out)))


_orig_attend = model_cache.TieredModelCache.attend


def _attend(self, layer, q, k, v, new_lengths):
    out, new = _orig_attend(self, layer, q, k, v, new_lengths)
    if q.shape[1] == 1:
        jax.debug.callback(_cap, jnp.asarray(layer, jnp.int32), q[:, 0], k, v, out[:, 0])
    return out, new


model_cache.TieredModelCache.attend = _attend


def run_cfg(t, cname, cfg, steps, seed):
    d, G, H, Bk, grp, kb, vb, dt, B, kmax, hot, eps, sched, refresh = cfg
    L = 2
    conf = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=L, num_heads=H * G,
                       num_kv_heads=H, head_dim=d, max_position_embeddings=1024)
    params = llama.init_params(conf, jax.random.key(seed), dt, scale=args.scale)
    pol = CertPolicy(block_size=Bk, group_size=grp, key_bits=kb, value_bits=vb, k_max=kmax, v_max=2, hot_slots=hot,
                     eps=eps, hot_refresh=refresh)
    spec = cache_spec("certified", conf, dt, pol, schedule=sched)
    rng = np.random.default_rng(seed)
    L0 = np.array([Bk - 5, 2 * Bk, 3 * Bk + Bk - 4][:B]) if B > 1 else np.array([3 * Bk - 4])
    P = int(L0.max())
    cap = ((P + steps) // Bk + 2) * Bk
    toks = rng.integers(0, conf.vocab_size, (B, P + steps))
    padded = np.where(np.arange(P)[None, :] < L0[:, None], toks[:, :P], 0).astype(np.int32)
    staging = spec.staging(B, cap)
    fwd = jax.jit(llama.forward, static_argnums=1)
    _, staging = fwd(params, conf, jnp.asarray(padded), staging, valid_lengths=jnp.asarray(L0, jnp.int32))
    cache = spec.from_staging(staging)
    params = llama.params_for_decoding(params, cache)
    print(f"  {cname}: schedule {cache.schedule}", flush=True)
    lens = L0.copy()
    t.cases += 1
    worst = 0.0
    slow_seen = 0
    for s in range(steps):
        tok = toks[np.arange(B), lens][:, None].astype(np.int32)
        starts = [cache.layer_view(li) for li in range(L)]
        flushed_before = np.asarray(cache.store.flushed[0]).copy()
        slow_before = int(cache.slow_steps)
        CAPTURED.clear()
        logits, cache = fwd(params, conf, jnp.asarray(tok), cache)
        jax.block_until_ready(logits)
        jax.effects_barrier()
        slow_seen += int(cache.slow_steps) - slow_before
        lens = lens + 1
        if not np.array_equal(np.asarray(cache.lengths), lens):
            t.bad(f"{cname}/step{s}: model lengths {np.asarray(cache.lengths)} != {lens}")
        last = {}
        for rec in CAPTURED:
            last[rec[0]] = rec
        if sorted(last) != list(range(L)):
            t.bad(f"{cname}/step{s}: captured layers {sorted(last)} (calls {len(CAPTURED)})")
            continue
        certs = cache.last_certificate
        for li in range(L):
            _, q, k, v, out = last[li]
            after = cache.layer_view(li)
            ek, ev = after.exact_kv()
            K64 = f64_arr(ek).transpose(0, 2, 1, 3)  # [B, T, H, d]: the stored originals after the step
            V64 = f64_arr(ev).transpose(0, 2, 1, 3)
            before = starts[li].write_token(jnp.asarray(k), jnp.asarray(v))
            cert = jax.tree.map(lambda x, li=li: x[li], certs)
            qj, oj = jnp.asarray(q), jnp.asarray(out)
            tag = f"{cname}/step{s}/L{li}"
            t.out_ulp = float(np.nanmax(np.abs(np.asarray(out, np.float32)), initial=0.0)) * float(jnp.finfo(dt).eps)
            check_step_any(t, tag, qj, before, after, oj, cert, cache.policy, K64, V64, lens, 0)
            worst = max(worst, ratio_and_nan(t, tag, oj, cert, K64, V64, lens, qj))
            if not np.array_equal(np.asarray(cache.store.flushed[0]), flushed_before):
                cache_invariants(t, tag + "/after-flush", after, K64, V64, lens)
        if not np.all(np.isfinite(np.asarray(logits))):
            t.note(f"{cname}/step{s}: non-finite logits")
    for li in range(L):
        after = cache.layer_view(li)
        ek, ev = after.exact_kv()
        cache_invariants(t, f"{cname}/end/L{li}", after, f64_arr(ek).transpose(0, 2, 1, 3),
                         f64_arr(ev).transpose(0, 2, 1, 3), lens)
    return worst, slow_seen


def main():
    t0 = time.time()
    pick = [c for c in args.cfgs.split(",") if c]
    lines = []
    total = dict(hs=0, viol=0, worst=0.0)
    for ci, (cname, cfg) in enumerate(CONFIGS.items()):
        if pick and cname not in pick:
            continue
        t = ShapeTally(f"model/{cname}")
        try:
            w, slow = run_cfg(t, cname, cfg, args.steps, args.seed + 17 * ci)
        except Exception as e:
            msg = f"{type(e).__name__}: {str(e)[:400]}"
            print(f"  REFUSED/ERROR {cname}: {msg}", flush=True)
            t.note(f"exception {msg}")
            w, slow = 0.0, -1
        line = t.summary() + f" max_err/bound={w:.4g} slow_steps={slow} worst={getattr(t, 'worst', None)}"
        print(line, f"({time.time() - t0:.0f}s)", flush=True)
        lines.append(line)
        total["hs"] += t.head_steps
        total["viol"] += len(t.viol)
        total["worst"] = max(total["worst"], w)
    print("=== SUMMARY", PATH)
    print("\n".join(lines))
    print(f"TOTAL [{PATH}] head_steps={total['hs']} violations={total['viol']} max_err/bound={total['worst']:.4g} "
          f"{time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
