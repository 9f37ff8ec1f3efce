"""Why the certified fast pass's tier-1 launch costs ~2x the plain tier-1 pass (issue 8).

At the 8B layer's 32K the plain split-layout `int_kv` pass ran in ~54 us (planar values, 2026-12-02 fifth session)
but inside the certified fast pass the same launch took ~104 us (2026-12-03 trace,
`results/profile_cert_step_h200_why_fast32k_2026-12-03b.json`). The fast pass adds, to the same kernel, each block's
Delta (`q_abs`), the block axis padded (`out_blocks`), the hot set left out of the splits (`hot_ids`, 8 scalar
compares per block), the exact slot programs (`slots`) and the stacked tier-1 arrays read in place (`layer`).
This probe times the launch with those features added one at a time, then the full launch over blocks per split,
warps, stages and signed keys, all in one process on the same random arrays (device-timed, medians of `reps`).
Each variant's outputs are checked against the full default launch first (same m / l / Delta; accumulators within
float32 reassociation where the split size differs).

    python scripts/probe_tier1_features.py --out results/probe_tier1_features_h200.json [--contexts 32768,131072]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _device_timing as timing  # noqa: E402
from bench_kernels import BK, GS, HKV, jax_loop, tier1_bytes, tier1_inputs  # noqa: E402

from pallas_kernels import certify_rung0 as ck  # noqa: E402
from pallas_kernels import tier1_pass as t1  # noqa: E402

K_MAX = 8
LAYERS = 2
RESULT: dict = {"rows": [], "checks": [], "errors": []}


def log(*a) -> None:
    print(*a, flush=True)


def save(path: str | None) -> None:
    timing.write_json(path, RESULT)


def inputs(B: int, T: int):
    """One layer's tier-1 arrays (planar values), a stacked copy of LAYERS layers, a hot set and a residual."""
    q, kc0, ks, kz, vc0, vs, vz, nv = tier1_inputs(jax.random.key(T + B), B, T)
    kc, vc = t1.kernel_layout(kc0, vc0, 8, 4, False, True)
    kc_signed, _ = t1.kernel_layout(kc0, vc0, 8, 4, True, True)
    nb = kc.shape[2]
    d = q.shape[-1]
    key = jax.random.split(jax.random.key(11 + T), 4)
    hot_ids = jax.vmap(lambda k: jax.random.permutation(k, nb)[:K_MAX])(
        jax.random.split(key[0], B * HKV)).reshape(B, HKV, K_MAX).astype(jnp.int32)
    hot_k = jax.random.normal(key[1], (B, HKV, K_MAX, BK, d), jnp.bfloat16)
    hot_v = jax.random.normal(key[2], (B, HKV, K_MAX, BK, d), jnp.bfloat16)
    res = jax.random.normal(key[3], (2, B, HKV, BK, d), jnp.bfloat16)
    slots = t1.Slots(hot_k=hot_k, hot_v=hot_v, hot_ids=hot_ids, res_k=res[0], res_v=res[1],
                     r_count=jnp.full((B,), BK // 2, jnp.int32), n_slots=ck.padded_slots(K_MAX))
    arrays = (kc, ks, kz, vc, vs, vz)
    stack = lambda x: jnp.stack([x] * LAYERS)  # noqa: E731
    stacked = tuple(stack(x) for x in arrays)
    stacked_slots = slots._replace(hot_k=stack(hot_k), hot_v=stack(hot_v), hot_ids=stack(hot_ids),
                                   res_k=stack(res[0]), res_v=stack(res[1]))
    signed = (kc_signed,) + arrays[1:]
    return dict(q=q, arrays=arrays, stacked=stacked, n_valid=nv, slots=slots,
                arrays_signed=signed, stacked_signed=tuple(stack(x) for x in signed),
                stacked_slots=stacked_slots, nb=nb, bytes=tier1_bytes((q,) + arrays))


def call(x: dict, features: set[str], bps: int | None = None, warps: int | None = None, stages: int = 2,
         signed: bool = False):
    """A step q -> tier-1 partials with the named features ("delta", "hot", "slots", "layer")."""
    nb = x["nb"]
    chain = bps or t1.default_blocks_per_split(x["q"].shape[0], HKV, nb)
    kw = dict(group_size=GS, variant="int_kv", score_scale=1.0, value_planar=True, blocks_per_split=chain,
              num_warps=warps, num_stages=stages, key_signed=signed)
    layer = "layer" in features
    arrays = x[("stacked" if layer else "arrays") + ("_signed" if signed else "")]
    if "delta" in features:
        kw.update(out_blocks=ck.padded_blocks(nb), padded_heads=True)
    if "hot" in features:
        slots = x["stacked_slots"] if layer else x["slots"]
        kw.update(hot_ids=slots.hot_ids, out_splits=1 << (-(-nb // chain) - 1).bit_length())
        if "slots" in features:
            kw.update(slots=slots)
    if layer:
        kw.update(layer=jnp.int32(LAYERS - 1))

    def step(q, *arrs):  # |q| from the step's own query, as the certified path computes it
        q_abs = {"q_abs": jnp.abs(q)} if "delta" in features else {}
        return t1.tier1_pass(q, *arrs, x["n_valid"], **kw, **q_abs)

    return step, arrays


FEATURE_LADDER = [("plain", set()), ("delta", {"delta"}), ("delta_hot", {"delta", "hot"}),
                  ("delta_hot_slots", {"delta", "hot", "slots"}), ("full", {"delta", "hot", "slots", "layer"}),
                  ("plain_layer", {"layer"})]


def check(x: dict) -> None:
    """Every full-feature tuning variant against the default full launch (same inputs)."""
    step0, arrays0 = call(x, FEATURE_LADDER[4][1])
    want = jax.jit(step0)(x["q"], *arrays0)
    for name, kw in TUNINGS[1:]:
        step, arrays = call(x, FEATURE_LADDER[4][1], **kw)
        got = jax.jit(step)(x["q"], *arrays)
        row = dict(variant=name)
        for field in ("m", "l", "delta", "slot_m", "slot_acc", "hot_acc"):
            g, w = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
            fin = np.isfinite(w)
            scale = max(float(np.max(np.abs(w[fin]), initial=0)), 1e-30)
            row[field] = float(np.max(np.abs(g[fin] - w[fin]), initial=0)) / scale
        RESULT["checks"].append(row)
        log("check", row)


TUNINGS = [("default", {}), ("warps4", dict(warps=4)), ("stages3", dict(stages=3)), ("bps1", dict(bps=1)),
           ("bps2", dict(bps=2)), ("bps4", dict(bps=4)), ("bps4_stages3", dict(bps=4, stages=3)),
           ("bps8", dict(bps=8)), ("bps16", dict(bps=16)), ("bps8_warps4", dict(bps=8, warps=4)),
           ("signed", dict(signed=True)), ("signed_stages3", dict(signed=True, stages=3))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n1", type=int, default=10)
    ap.add_argument("--n2", type=int, default=40)
    ap.add_argument("--variants", default=None, help="comma-separated names to time (features:NAME, full:NAME); "
                    "default all")
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args()
    RESULT.update(timing.run_info(), command=" ".join(sys.argv))
    bw = timing.measure_bandwidth((2 << 30) if jax.default_backend() == "gpu" else (16 << 20))
    RESULT["measured_bandwidth_Bps"] = bw
    t0 = time.perf_counter()
    for T in (int(c) for c in a.contexts.split(",")):
        x = inputs(a.batch, T)
        if T == int(a.contexts.split(",")[0]) and not a.no_check:
            timing.attempt(RESULT, "check", T, a.batch, lambda x=x: check(x))
            save(a.out)
        runs = [(f"features:{n}", f, {}) for n, f in FEATURE_LADDER]
        runs += [(f"full:{n}", FEATURE_LADDER[4][1], kw) for n, kw in TUNINGS[1:]]
        wanted = a.variants.split(",") if a.variants else None
        for name, features, kw in (r for r in runs if wanted is None or r[0] in wanted):
            def run(name=name, features=features, kw=kw, x=x, T=T):
                step, arrays = call(x, features, **kw)
                us = timing.per_call_us(jax_loop(step, x["q"], arrays), a.n1, a.n2, a.reps)[0]
                row = dict(variant=name, context=T, batch=a.batch, median_us=round(us, 2), bytes=x["bytes"],
                           floor_us=round(x["bytes"] / bw * 1e6, 2))
                RESULT["rows"].append(row)
                log(row)
            timing.attempt(RESULT, name, T, a.batch, run)
            save(a.out)
    RESULT["wall_s"] = round(time.perf_counter() - t0, 1)
    save(a.out)


if __name__ == "__main__":
    main()
