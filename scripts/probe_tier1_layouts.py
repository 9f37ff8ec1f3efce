"""Where the `int_kv` tier-1 kernel's time goes, and whether the codes' layout is the cause (issue 8).

The kernel is ~5x its bytes floor on the H200 (docs/kernels.md). Two layout changes remove per-element work
before its two integer dots: signed int8 key codes (code - 128: the loaded tile feeds the key dot as it is,
no widening, offset and narrowing) and planar value bytes (`quant.pack_planar`: each nibble plane of a byte
chunk is one value group's channels, so unpacking is a shift and a mask, no interleave). This probe times, in one
process on the same random tier-1 arrays (LLaMA-3.1-8B layer: 8 KV heads, G = 4, d = 128, Bk = 64, group 32):

  * the kernel in each layout (standard, signed keys, planar values, both) and a few num_stages / warps (a
    "stacked_values" layout, every value group of a block summed by one int8 dot per plane, was timed 1.6-1.9x
    slower on 2026-12-02, `results/probe_tier1_stacked_h200.json`, and removed);
  * ablations of the standard kernel (its value half or its key half replaced by a constant, by patching the
    kernel's helpers at trace time: what the other half costs alone);
  * a stream kernel (codes read and summed: the loop-and-memory floor) and the dense baselines of the same run
    (torch SDPA from a CUDA graph, cuDNN), with the bytes floor from the measured bandwidth.

Before timing, each layout's outputs are compared with the standard layout's (bit for bit where only the order the
bytes are unpacked in differs) and with the jnp reference.

    python scripts/probe_tier1_layouts.py --out results/probe_tier1_layouts_h200.json [--shapes 1x32768,1x131072]
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
from bench_kernels import ablation, jax_loop, quantized_from_dense, tier1_bytes, tier1_inputs  # noqa: E402

from pallas_kernels import tier1_pass as t1  # noqa: E402

HQ, HKV, D, GS = 32, 8, 128, 32
RESULT: dict = {"rows": [], "checks": [], "errors": []}
LAYOUTS = {"standard": (False, False), "signed_keys": (True, False), "planar_values": (False, True),
           "signed_planar": (True, True)}


def log(*a) -> None:
    print(*a, flush=True)


def save(path: str | None) -> None:
    timing.write_json(path, RESULT)


def in_layout(args, layout: str):
    key_signed, value_planar = LAYOUTS[layout]
    q, kc, ks, kz, vc, vs, vz, nv = args
    kc, vc = t1.kernel_layout(kc, vc, 8, 4, key_signed, value_planar)
    return (q, kc, ks, kz, vc, vs, vz, nv), dict(key_signed=key_signed, value_planar=value_planar)


def check_layouts() -> None:
    """Each layout's outputs against the standard layout's (bit for bit) and the jnp reference."""
    for i, (B, nb, n_valid) in enumerate([(2, 40, [40, 17]), (1, 24, [23])]):
        args = quantized_from_dense(jax.random.key(200 + i), B, HKV, HQ // HKV, nb, D, 8, n_valid)
        kw = dict(group_size=GS, blocks_per_split=4, variant="int_kv")
        base = t1.tier1_pass(*args, **kw)
        want = t1.tier1_pass_reference(*args, group_size=GS, blocks_per_split=4)
        for layout in LAYOUTS:
            a, lk = in_layout(args, layout)
            got = t1.tier1_pass(*a, **kw, **lk)
            row = dict(case=i, layout=layout)
            for name in ("m", "l", "acc", "acc_m"):
                g, b, w = (np.asarray(getattr(x, name)) for x in (got, base, want))
                fin = np.isfinite(w)
                fb = np.isfinite(b)
                row[name] = {"bitwise_equal_standard": bool(np.array_equal(g, b, equal_nan=True)),
                             "max_abs_diff_standard": float(np.max(np.abs(g[fb] - b[fb]), initial=0)),
                             "max_err_over_max_abs_vs_reference":
                                 float(np.max(np.abs(g[fin] - w[fin]), initial=0)
                                       / max(float(np.max(np.abs(w[fin]), initial=0)), 1e-30))}
            RESULT["checks"].append(row)
            log("check", row)


def patched(mode: str):
    """Context: the kernel's key half ("values_only") or value half ("keys_only") replaced by cheap constants."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        saved = (t1._int_scores, t1._int_value_sum, t1._value_weights, t1._int_value_part)
        if mode in ("values_only_planar", "no_split_planar", "no_value_dot_planar"):
            t1._int_scores = lambda q, ks, kz, codes, bits, scale, signed=False: (
                jnp.zeros((codes.shape[0], q.shape[0]), jnp.float32) + jnp.sum(q * ks[None, :], axis=1)[None, :])
        if mode == "no_split_planar":  # the weights' int8 split replaced by a plain cast
            t1._value_weights = lambda p, t_j, y_j, bits: (
                jnp.tile((p * t_j[:, None] * 64).astype(jnp.int8), (1, 4)),
                jnp.ones((p.shape[1],), jnp.float32), jnp.sum(p * y_j[:, None], axis=0))
        if mode == "no_value_dot_planar":  # the value dot replaced by a sum of the codes
            t1._int_value_part = lambda weights, codes: (
                jnp.zeros((weights[1].shape[0], codes.shape[1]), jnp.float32)
                + jnp.sum(codes.astype(jnp.float32), axis=0)[None, :] * weights[2][:, None]
                + jnp.sum(weights[0].astype(jnp.float32)))
        if mode == "keys_only":
            t1._int_value_sum = lambda p, t_j, y_j, codes, bits: jnp.zeros((p.shape[1], codes.shape[1] * 8 // bits),
                                                                          jnp.float32) + jnp.sum(p, axis=0)[:, None]
        elif mode == "values_only":
            t1._int_scores = lambda q, ks, kz, codes, bits, scale, signed=False: (
                jnp.zeros((codes.shape[0], q.shape[0]), jnp.float32) + jnp.sum(q * ks[None, :], axis=1)[None, :])
        jax.clear_caches()
        try:
            yield
        finally:
            t1._int_scores, t1._int_value_sum, t1._value_weights, t1._int_value_part = saved
            jax.clear_caches()

    return cm()


def bench_shape(B: int, T: int, n1: int, n2: int, reps: int, bw: float, configs: list[tuple], ablate: bool,
                baselines: bool, ablations: tuple[str, ...] = ("keys_only", "values_only")) -> None:
    args = tier1_inputs(jax.random.key(T + B), B, T)
    nbytes = tier1_bytes(args)

    def add(impl, us, nb, **extra):
        row = dict(impl=impl, context=T, batch=B, median_us=round(us, 2), bytes=nb, floor_us=round(nb / bw * 1e6, 2),
                   **extra)
        RESULT["rows"].append(row)
        log(row)

    for layout, stages, warps, bps in configs:
        a, lk = in_layout(args, layout)

        def run(a=a, lk=lk, layout=layout, stages=stages, warps=warps, bps=bps):
            step = lambda q, *r: t1.tier1_pass(q, *r, group_size=GS, variant="int_kv", num_stages=stages,  # noqa: E731
                                               num_warps=warps, blocks_per_split=bps, **lk)
            add("int_kv", timing.per_call_us(jax_loop(step, a[0], a[1:]), n1, n2, reps)[0], nbytes, layout=layout,
                num_stages=stages, num_warps=warps,
                blocks_per_split=bps or t1.default_blocks_per_split(B, HKV, T // 64))
        timing.attempt(RESULT, f"int_kv_{layout}_{stages}_{warps}_{bps}", T, B, run)
    if ablate:
        for mode in ablations:
            planar = mode.endswith("_planar")
            a, lk = in_layout(args, "planar_values" if planar else "standard")

            def run_abl(mode=mode, a=a, lk=lk, planar=planar):
                with patched(mode):
                    step = lambda q, *r: t1.tier1_pass(q, *r, group_size=GS, variant="int_kv",  # noqa: E731
                                                       num_stages=3 if planar else 2, **lk)
                    add(f"int_kv_{mode}", timing.per_call_us(jax_loop(step, a[0], a[1:]), n1, n2, reps)[0],
                        nbytes, layout="planar_values" if planar else "standard", num_stages=3 if planar else 2)
            timing.attempt(RESULT, f"ablation_{mode}", T, B, run_abl)
        bps = t1.default_blocks_per_split(B, HKV, T // 64)
        timing.attempt(RESULT, "stream", T, B, lambda: add(
            "stream_codes", timing.per_call_us(jax_loop(lambda q, *r: ablation("stream", (q, *r), bps), args[0],
                                                        args[1:]), n1, n2, reps)[0], nbytes))
    args = None
    if not baselines:
        return
    ks = jax.random.split(jax.random.key(7 + T + B), 3)
    q = jax.random.normal(ks[0], (B, HQ, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, HKV, D), jnp.bfloat16)
    dense_bytes = 2 * k.size * 2
    timing.attempt(RESULT, "jax_cudnn_bf16", T, B, lambda: add(
        "jax_cudnn_bf16", timing.per_call_us(jax_loop(timing.cudnn_attention, q, (k, v)), n1, n2, reps)[0],
        dense_bytes))
    q = k = v = None
    timing.attempt(RESULT, "torch_sdpa_bf16", T, B, lambda: add(
        "torch_sdpa_bf16", timing.torch_sdpa_us(B, T, HKV, HQ, D, n2), dense_bytes))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="1x32768,1x131072,8x32768")
    ap.add_argument("--ablate", default="1x32768,1x131072", help="shapes (BxT) that also run the ablations")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stages", default="2,3", help="num_stages to time for every layout")
    ap.add_argument("--warps", default="2,4", help="num_warps to time for the two-change layout")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="layouts to time")
    ap.add_argument("--bps", default="0", help="blocks per split to time (0: the default heuristic)")
    ap.add_argument("--ablations", default="keys_only,values_only",
                    help="keys_only, values_only (standard layout); values_only_planar, no_split_planar, "
                         "no_value_dot_planar (planar values, num_stages 3)")
    ap.add_argument("--no-checks", action="store_true")
    a = ap.parse_args()
    RESULT.update(timing.run_info(), command=" ".join(sys.argv))
    t0 = time.perf_counter()
    if not a.no_checks:
        check_layouts()
    save(a.out)
    bw = timing.measure_bandwidth(2 << 30)
    RESULT["measured_bandwidth_Bps"] = bw
    stages = [int(x) for x in a.stages.split(",")]
    warps = [int(x) for x in a.warps.split(",")]
    bps_list = [int(x) or None for x in a.bps.split(",")]
    configs = [(layout, s, 2, b) for layout in a.layouts.split(",") for s in stages for b in bps_list]
    configs += [("signed_planar", stages[0], w, None) for w in warps if w != 2 and "signed_planar" in a.layouts]
    for shape in a.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        bench_shape(B, T, 4, 20, a.reps, bw, configs, shape in a.ablate.split(","), not a.no_baselines,
                    tuple(a.ablations.split(",")))
        save(a.out)
    RESULT["wall_s"] = round(time.perf_counter() - t0, 1)
    save(a.out)
    log("done in", RESULT["wall_s"])


if __name__ == "__main__":
    main()
