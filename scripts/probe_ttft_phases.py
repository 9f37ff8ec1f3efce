"""Where a certified prefill's time goes beyond the dense one (time to first token, issue 7).

    python scripts/probe_ttft_phases.py --model smollm2 --prompt 1024 --out results/probe_ttft_phases.json

Random bf16 weights of the model's shape, one prompt, the capacity `generate` would use for 64 new tokens.
Median of --repeats warm runs (each phase compiled first), wall-clock with the results blocked on:
  dense_prefill        `models.generate.prefill` into the dense cache (the TTFT baseline)
  certified_prefill    the same into the certified cache (staging prefill + one conversion)
  staging_prefill      the staging part alone (a dense cache of the tiered capacity)
  conversion           `CacheSpec.from_staging` alone (tier 1 quantized, tier 2 to pinned host)
  conversion_on_device the same with tier 2 left on the device (what the host copy and its allocation cost)
  host_copy            the staging keys and values copied to pinned host memory alone (`jax.device_put`)
  *_layer_at_a_time_s  (--quick) certified_prefill and conversion with one conversion program per layer
                       (`cache.CONVERT_GROUP_BYTES` = 1), against the default layer groups
  *_{batched,loop}_s   (--quick) the same with the group's program in the form that is not the default
                       (`cache.CONVERT_GROUP_FORM`: the group's layers under vmap, or a lax.map over them)
--quick: dense_prefill, certified_prefill and conversion, each with the default layer groups, the other group
form and a layer at a time.
--host-profile: also where the host's time goes in one dense and one certified prefill (cProfile over --repeats warm
runs: the top functions by own time and by cumulative time, and the time until `prefill` returns against the time
until its results are ready -- a prefill whose call returns late is held up by host work or host syncs, not by the
device).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _median_seconds(fn, repeats: int, name: str = "") -> float:
    import jax

    jax.block_until_ready(fn())  # compile / warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    if name:  # as it goes: a run stopped at its time limit still tells what it measured
        print(f"{name}: {statistics.median(times) * 1e3:.3f} ms", flush=True)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "results/probe_ttft_phases.json"))
    ap.add_argument("--quick", action="store_true", help="the layer-group A/B only (see above)")
    ap.add_argument("--host-profile", action="store_true", help="where the host's time goes (see above)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from certattn_jax import model_cache, tiers
    from certattn_jax.policy import CertPolicy
    from models import generate as gen
    from models import llama
    from scripts.bench_generate import _model_config

    cfg = _model_config(args.model)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    policy = CertPolicy(block_size=16, group_size=16) if args.model == "tiny" else CertPolicy()
    params = llama.fuse_projections(llama.init_params(cfg, jax.random.key(0), dtype))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt).tolist()
    cap = gen.round_up(args.prompt + args.new_tokens, gen.CAPACITY_BUCKET)
    dense = model_cache.cache_spec("dense", cfg, dtype, policy)
    cert = model_cache.cache_spec("certified", cfg, dtype, policy)
    staging_spec = model_cache.cache_spec("dense", cfg, dtype, policy)
    staging_cap = cert.staging_capacity(cap)

    def prefill(spec, capacity):
        return lambda: gen.prefill(params, cfg, [ids], capacity, cache_factory=spec, policy=policy)

    row = {"model": args.model, "prompt": args.prompt, "capacity": cap, "backend": jax.default_backend(),
           "device": jax.devices()[0].device_kind, "jax": jax.__version__, "repeats": args.repeats,
           "host_memory_kind": tiers.host_memory_kind()}
    row["dense_prefill_s"] = _median_seconds(prefill(dense, cap), args.repeats, "dense_prefill")
    row["certified_prefill_s"] = _median_seconds(prefill(cert, cap), args.repeats, "certified_prefill")
    if args.host_profile:
        for name, spec in (("dense", dense), ("certified", cert)):
            row[f"host_profile_{name}"] = _host_profile(prefill(spec, cap), args.repeats)
    if args.quick:
        from certattn_jax import cache as cache_mod

        staged, _ = gen.prefill(params, cfg, [ids], staging_cap, cache_factory=staging_spec, policy=policy)
        row["conversion_s"] = _median_seconds(lambda: cert.from_staging(staged), args.repeats, "conversion")
        default_budget = cache_mod.CONVERT_GROUP_BYTES
        row["conversion_group_bytes"] = default_budget
        row["layers_per_conversion_program"] = cache_mod.layers_per_program(
            staged.k[0].nbytes + staged.v[0].nbytes, cfg.num_layers)
        row["conversion_group_form"] = default_form = cache_mod.CONVERT_GROUP_FORM
        default_into = cache_mod.CONVERT_GROUPS_INTO
        try:
            for form in cache_mod.CONVERT_GROUP_FORMS:  # the other form of the group's program
                if form == default_form or row["layers_per_conversion_program"] == 1:
                    continue
                cache_mod.CONVERT_GROUP_FORM, cache_mod.CONVERT_GROUPS_INTO = form, True  # groups, not a layer each
                row[f"conversion_{form}_s"] = _median_seconds(lambda: cert.from_staging(staged), args.repeats,
                                                              f"conversion_{form}")
                row[f"certified_prefill_{form}_s"] = _median_seconds(prefill(cert, cap), args.repeats,
                                                                     f"certified_prefill_{form}")
            cache_mod.CONVERT_GROUP_FORM, cache_mod.CONVERT_GROUPS_INTO = default_form, default_into
            cache_mod.CONVERT_GROUP_BYTES = 1
            row["conversion_layer_at_a_time_s"] = _median_seconds(lambda: cert.from_staging(staged), args.repeats,
                                                                  "conversion_layer_at_a_time")
            row["certified_prefill_layer_at_a_time_s"] = _median_seconds(
                prefill(cert, cap), args.repeats, "certified_prefill_layer_at_a_time")
        finally:
            cache_mod.CONVERT_GROUP_BYTES = default_budget
            cache_mod.CONVERT_GROUP_FORM, cache_mod.CONVERT_GROUPS_INTO = default_form, default_into
        return _finish(row, args.out)
    row["staging_prefill_s"] = _median_seconds(prefill(staging_spec, staging_cap), args.repeats, "staging_prefill")
    staged, _ = gen.prefill(params, cfg, [ids], staging_cap, cache_factory=staging_spec, policy=policy)
    row["conversion_s"] = _median_seconds(lambda: cert.from_staging(staged), args.repeats, "conversion")
    kinds = tiers.host_memory_kind()
    if kinds is not None:
        host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kinds)
        kv = (jnp.stack(staged.k), jnp.stack(staged.v))
        row["tier2_bytes"] = int(sum(x.size * x.dtype.itemsize for x in kv))
        row["host_copy_s"] = _median_seconds(lambda: jax.device_put(kv, host), args.repeats, "host_copy")
        real = tiers.host_memory_kind
        tiers.host_memory_kind = lambda: None  # tier 2 stays on the device (traced anew below)
        try:
            on_device = jax.jit(lambda d: model_cache.TieredModelCache.from_dense(
                d, num_q_heads=cfg.num_heads, policy=policy, mode="certified", schedule=cert.schedule))
            row["conversion_on_device_s"] = _median_seconds(lambda: on_device(staged), args.repeats,
                                                            "conversion_on_device")
        finally:
            tiers.host_memory_kind = real
    return _finish(row, args.out)


def _host_profile(fn, repeats: int, top: int = 30) -> dict:
    """Where the host's time goes in `repeats` warm calls of fn: the median time until fn returns and until its
    results are ready, and the top functions by own and by cumulative time (cProfile; times in ms per call)."""
    import cProfile
    import pstats

    import jax

    jax.block_until_ready(fn())
    returned, ready = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        returned.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
        ready.append(time.perf_counter() - t0)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeats):
        jax.block_until_ready(fn())
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}

    def rows(key: int) -> list[str]:
        best = sorted(stats.items(), key=lambda kv: -kv[1][key])[:top]
        return [f"{v[2] / repeats * 1e3:9.3f} own {v[3] / repeats * 1e3:9.3f} cum {v[1] / repeats:7.1f} calls  "
                f"{Path(f).name}:{line}({name})" for (f, line, name), v in best]

    result = {"returned_ms": statistics.median(returned) * 1e3, "ready_ms": statistics.median(ready) * 1e3,
              "calls_per_run": sum(v[1] for v in stats.values()) / repeats,
              "by_own_time": rows(2), "by_cumulative_time": rows(3)}
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("by_")}), flush=True)
    return result


def _finish(row: dict, out: str) -> int:
    for k in list(row):
        if k.endswith("_s"):
            row[k] = round(row[k], 5)
    row["certified_over_dense"] = round(row["certified_prefill_s"] / row["dense_prefill_s"], 3)
    if "certified_prefill_layer_at_a_time_s" in row:
        row["layer_at_a_time_over_dense"] = round(row["certified_prefill_layer_at_a_time_s"] / row["dense_prefill_s"],
                                                  3)
    print(json.dumps(row), flush=True)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
