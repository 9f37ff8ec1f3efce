"""End-to-end generation benchmark: dense vs naive vs certified caches through `models.generate.generate`.

    python scripts/bench_generate.py --out results/bench_generate.json              # GPU: the full grid
    python scripts/bench_generate.py --tiny --out /tmp/bench_generate_tiny.json     # CPU check, tiny shapes

The full grid takes longer than one 10-minute device call: run it in parts (--models / --prompts / --caches,
each with its own --out) and join them with --merge a.json b.json ... --out results/bench_generate.json.

Grid (random bf16 weights; speed does not depend on their values; batch 1, greedy, no EOS):
  smollm2      (SmolLM2-135M shapes)        prompts 1K, 4K
  llama3.1-8b  (LLaMA-3.1-8B shapes)        prompts 8K, 32K
  caches dense / naive / certified (default CertPolicy).

Every row runs in its own subprocess (a fresh process: the cold numbers include all compiling, the peak is that
row's own, and no compiled program is shared between cache modes). In it, `generate` runs twice with the same
shapes: the first call is cold, the second warm (everything compiled). Row fields:
  prefill_s              time to the first token's logits, warm, best of 3: chunked prefill (+ the one
                         conversion of the dense staging cache into the tiered cache for naive / certified)
  prefill_cold_s         the same, first call (includes compiling the prefill chunk and the conversion)
  compile_s              compiling the decode loop (first call)
  lower_s, xla_compile_s of it: tracing and lowering, and XLA's compile (the rest: waiting for self-checks)
  selftest_s             of the cold run, seconds it was held up by one-time kernel self-checks (their verdicts then
                         kept on disk); the checks start in the background at the prefill, so only what they
                         still lacked when the decode compile asked for them counts here
  value_packing          the tiered caches' value-code packing (`certattn_jax.quant.VALUE_PACKING`)
  layers_per_conversion_program   tiered: layers the prefill's conversion converts per compiled program
                         (`certattn_jax.cache.layers_per_program`, CERTATTN_CONVERT_GROUP_BYTES)
  tier1_bps_rule         certified: how the fast pass splits the blocks (`tier1_pass.FAST_PASS_BPS`)
  layer_unroll           certified: layers per iteration of the rung-0 pass's loop (`llama.LAYER_UNROLL`)
  rung0_select           certified: the certify kernel's candidate selection (`certify_rung0.DEFAULT_SELECT`)
  selftest_checks        the kernel self-checks the row's process ran: what, configuration, start (start_s), seconds,
                         background
  cold_run_start_s, decode_build_start_s   on start_s's clock (seconds after the self-checks' import): when the
                         cold run's prefill and its decode build began (a check that starts after the build waited
                         for something: the timeline of a cold compile)
  fusion_autotuner       "decode_and_checks": the decode loop's and the kernel self-checks' XLA fusion autotuner
                         (`certattn_jax.xla_options`, CERTATTN_FUSION_AUTOTUNER; None: XLA's own setting), and
                         "checks_autotune_off": the self-checks compiled without autotuning (CERTATTN_CHECKS_AUTOTUNE)
  decode_control_flow_graphs   the decode loop compiled with conditionals and while loops inside its command
                         buffers (`xla_options.decode_control_flow_graphs`; XLA_FLAGS may also ask: xla_flags)
  hot_used_stacked       certified: layer views record their hot slots' use in the whole stack
                         (`cache.HOT_USED_STACKED`, CERTATTN_HOT_USED_STACKED)
  decode_tokens_per_s    new tokens per second of the warm decode loop
  launches_per_step      kernel launches in one decode step: instructions of the compiled decode loop's while
                         body that launch a kernel (fusions, custom calls such as cuBLAS GEMMs, and unfused ops;
                         not parameters, constants, tuples, bitcasts), recursing into nested while bodies and
                         calls once each, NOT into lax.cond branches (rungs 1-4, the block flush: not taken on a
                         step where no head escalates and no block fills); `cond_branch_launches` counts those
  host_transfers_per_step  instructions in the same set touching host memory (S(5) in the HLO): tier-2 traffic
                         on an ordinary step (certified must have 0)
  host_round_trips_per_step  times the host waits for the device in one step (`hlo_walk.host_round_trips`): on a
                         GPU every lax.cond evaluated on the step's path (taken or not: XLA reads its predicate
                         on the host) and while loops of unknown trip count, plus the decode loop's own predicate
                         (dense pays that one too); `host_round_trips_in_branches` those inside cond branches
                         (they happen only when the branch runs). Meaningful on a GPU only (CPU interpret-mode
                         kernels are loops and conditionals themselves). With the "nested" decode loop
                         (`decode_loop`, CERTATTN_DECODE_LOOP_NESTED=1) a common step is the inner loop's
                         iteration: launches and round trips are counted there
  peak_device_bytes      the device's peak_bytes_in_use over the whole row (None where the backend has no
                         memory stats, e.g. CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hlo_walk import host_round_trips, launching_instructions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GRID = {"smollm2": (1024, 4096), "llama3.1-8b": (8192, 32768)}
CPU_GRID = {"smollm2": (256, 1024)}  # --cpu-smollm2: the SmolLM2 shapes at prompts a 2-core CPU can prefill
TINY_GRID = {"tiny": (100, 300)}
CACHES = ("dense", "naive", "certified")
# certified with a given layer schedule (TieredModelCache.schedule; "certified" is the default, "auto": rows
# record the schedule it resolved to)
# (the names of certattn_jax.model_cache.SCHEDULES, kept here so that argument parsing does not import jax;
# tests/test_bench_scripts.py checks that they agree)
VARIANTS = ("certified_looped", "certified_two-pass", "certified_straight", "certified_straight-looped",
            "certified_adaptive", "certified_unrolled")


def _layers_per_conversion(cache) -> int:
    """Layers per conversion program for a staging cache of this tiered cache's shape (batch, capacity, dtype)."""
    import jax.numpy as jnp

    from certattn_jax.cache import layers_per_program

    st = cache.store
    layer_bytes = 2 * st.batch * st.num_kv_heads * st.capacity * st.head_dim * jnp.dtype(st.dtype).itemsize
    return layers_per_program(layer_bytes, cache.num_layers)


def _bps_rule() -> str:
    from pallas_kernels import tier1_pass

    return tier1_pass.FAST_PASS_BPS


def _rung0_select() -> str:
    from pallas_kernels import certify_rung0

    return certify_rung0.DEFAULT_SELECT


def _selftest_runs() -> list[dict]:
    from pallas_kernels import selftest

    return selftest.check_runs()


def _fusion_autotuner() -> dict[str, bool | None]:
    from certattn_jax import xla_options

    return {"decode_and_checks": xla_options.fusion_autotuner_on(),
            "checks_autotune_off": xla_options.checks_autotune_off()}


def _control_flow_graphs() -> bool:
    from certattn_jax import xla_options

    return xla_options.decode_control_flow_graphs()


def _hot_used_stacked() -> bool:
    from certattn_jax import cache

    return cache.HOT_USED_STACKED


def _prefill_times(gen, params, cfg, ids, total: int, factory, policy, prefill_chunk: int, repeats: int,
                   ) -> list[float]:
    """Seconds of `repeats` prefills of ids (to the first token's logits, the cache ready on the device), one
    after the other: one warm measurement is noisy at tens of milliseconds."""
    cap = gen.round_up(total, gen.CAPACITY_BUCKET)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        c, _ = gen.prefill(params, cfg, [ids], cap, cache_factory=factory, policy=policy,
                           prefill_chunk=prefill_chunk)
        times.append(time.perf_counter() - t0)
        del c
    return times


def count_launches(hlo: str, inner_step: bool = False) -> dict[str, int]:
    """Kernel launches per iteration of the outermost while loop of a compiled module (see module docstring);
    inner_step: of the first while loop inside it (the "nested" decode loop's common step)."""
    counts = {"launches": 0, "cond_branch_launches": 0, "host": 0}
    for instr, op, mult, where in launching_instructions(hlo, inner_step=inner_step):
        if where == "step":
            counts["launches"] += mult
            # a conditional whose operands include the tier-2 buffers only passes them to its branches (the
            # flush); what moves host bytes is an instruction inside a branch, counted only if the branch runs
            counts["host"] += mult if "S(5)" in instr and op != "conditional" else 0
        else:
            counts["cond_branch_launches"] += mult
    return counts


def _model_config(name: str):
    from models.config import LlamaConfig
    from scripts.bench_decode import MODELS

    if name == "tiny":
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=32, max_position_embeddings=4096)
    return MODELS[name]


def run_row(model: str, cache: str, prompt: int, new_tokens: int, prefill_chunk: int,
            prefill_only: bool = False, k_max: int | None = None, tier1: str | None = None,
            rung0: str | None = None, dump_hlo: str | None = None, hot_slots: int | None = None,
            eps: float | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from certattn_jax import quant
    from certattn_jax.model_cache import adaptive_rung0_streak, cache_spec
    from certattn_jax.policy import CertPolicy, tier1_impl
    from certattn_jax.step import uses_fused_rung0
    from models import generate as gen
    from models import llama
    from pallas_kernels import selftest

    cfg = _model_config(model)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    policy = CertPolicy(block_size=16, group_size=16) if model == "tiny" else CertPolicy()
    if k_max is not None:
        policy = dataclasses.replace(policy, k_max=k_max)
    if hot_slots is not None:
        policy = dataclasses.replace(policy, hot_slots=hot_slots)
    if tier1 is not None:
        policy = dataclasses.replace(policy, tier1=tier1)
    if rung0 is not None:
        policy = dataclasses.replace(policy, rung0=rung0)
    if eps is not None:
        policy = dataclasses.replace(policy, eps=eps)
    params = llama.fuse_projections(llama.init_params(cfg, jax.random.key(0), dtype))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt).tolist()
    mode, _, schedule = cache.partition("_")
    factory = cache_spec(mode, cfg, dtype, policy, schedule=schedule) if schedule else cache
    kw = dict(eos_token_ids=(), progress=False, prefill_chunk=prefill_chunk, cache_factory=factory, policy=policy)
    if prefill_only:  # time to first token alone (no decode loop is compiled)
        times = _prefill_times(gen, params, cfg, ids, prompt + new_tokens, factory, policy, prefill_chunk, 3)
        return {"model": model, "cache": cache, "prompt": prompt, "batch": 1, "prefill_cold_s": round(times[0], 4),
                "prefill_s": round(min(times[1:]), 4), "backend": jax.default_backend(), "dtype": str(jnp.dtype(dtype)),
                "prefill_chunk": prefill_chunk}
    record = mode == "certified"  # the rung histogram says whether the slow pass ran (a tiny per-step write)
    checking = selftest.seconds_checking()
    cold_at = time.perf_counter()
    gen.LAST_BUILD_SECONDS.clear()  # (a build this process made before would otherwise be reported)
    cold = gen.generate(params, cfg, [ids], new_tokens, record_steps=record, **kw)
    checking = selftest.seconds_checking() - checking  # one-time kernel self-checks inside the cold run's compiles
    gen.finish_background_compiles()  # the decode bridge's whole program: the warm run times the steady state
    build_s = dict(gen.LAST_BUILD_SECONDS)
    bridged = gen.decode_bridge(cold.cache)
    del cold.cache
    warm = gen.generate(params, cfg, [ids], new_tokens, record_steps=record, **kw)
    (decode,) = [c for key, c in gen._COMPILED.items() if key[0] != "first_passes_unrolled"]
    prefill_s = min([warm.prefill_seconds] + _prefill_times(gen, params, cfg, ids, prompt + new_tokens, factory,
                                                              policy, prefill_chunk, repeats=2))
    loop = gen.decode_loop_kind(warm.cache)  # "nested": a common step is the inner loop's iteration
    # the first passes the warm run ran: the unrolled ones where they were built beside the looped ones
    passes = ([c for key, c in gen._COMPILED.items() if key[0] == "first_passes_unrolled"]
              or [c for key, c in gen._BRIDGE_COMPILED.items() if key[0] == "first_passes"])
    bridge_trips = host_round_trips(passes[0].as_text())["total"] if passes else None
    launches = count_launches(decode.as_text(), inner_step=loop == "nested")
    trips = host_round_trips(decode.as_text(), inner_step=loop == "nested")
    if dump_hlo:
        Path(dump_hlo).mkdir(parents=True, exist_ok=True)
        Path(dump_hlo, f"{model}_{cache}_{prompt}_{policy.tier1}_{policy.rung0}.hlo").write_text(decode.as_text())
    stats = jax.devices()[0].memory_stats() or {}
    rungs = None
    if warm.step_records is not None and hasattr(warm.step_records, "rung"):
        r = np.asarray(warm.step_records.rung)
        rungs = [int(np.sum(r == i)) for i in range(5)]
    return {"model": model, "cache": cache, "rung_histogram": rungs, "prompt": prompt, "new_tokens": new_tokens,
            "batch": 1,
            "prefill_s": round(prefill_s, 4), "prefill_cold_s": round(cold.prefill_seconds, 4),
            "compile_s": round(cold.compile_seconds, 3),
            # of the cold decode compile: tracing + lowering (Pallas -> Triton IR) and XLA's compile (Triton's
            # compile of the kernels, GEMM autotuning); the rest is waiting for self-checks or a second build
            "lower_s": round(build_s.get("lower_s", float("nan")), 3),
            "xla_compile_s": round(build_s.get("xla_compile_s", float("nan")), 3),
            # seconds the cold run (prefill and decode compiles) was held up by one-time kernel self-checks
            # (verdicts not yet on disk: pallas_kernels/selftest.py), running one or waiting for one that the
            # prefill started in the background; 0 when every verdict was kept or had come in by then
            "selftest_s": round(checking, 3),
            # the decode bridge (models.generate.decode_bridge): compile_s is then its first-pass program's (what
            # decoding waited for); full_compile_s the whole loop's, from the same start, compiled beside it and
            # the first steps; compile_wait_s what the cold run's decoding then waited for it
            "decode_bridge": bridged,
            "full_compile_s": round(build_s["full_ready_at"] - build_s["started_at"], 3)
            if bridged and "full_ready_at" in build_s else None,
            "full_xla_compile_s": round(build_s["full_xla_compile_s"], 3) if bridged and
            "full_xla_compile_s" in build_s else None,
            "compile_wait_s": round(cold.compile_wait_seconds, 3),
            # host round trips per iteration of the bridge's first-pass loop (a common step where it is the loop:
            # CERTATTN_DECODE_BRIDGE_STEADY)
            "bridge_round_trips_per_step": bridge_trips,
            "decode_bridge_steady": gen.BRIDGE_STEADY,
            "first_pass_unrolled": llama.first_pass_mode(params),  # "0" looped, "1" unrolled, "background"
            "unrolled_compile_s": round(build_s["unrolled_ready_at"] - build_s["started_at"], 3)
            if bridged and "unrolled_ready_at" in build_s else None,
            "unrolled_build_s": round(build_s["unrolled_lower_s"] + build_s["unrolled_xla_compile_s"], 3)
            if bridged and "unrolled_xla_compile_s" in build_s else None,
            # each check the row's process ran (what, configuration, seconds, in the background or not)
            "selftest_checks": _selftest_runs(),
            # the same clock as selftest_checks' start_s: when the cold run (its prefill) and its decode build began
            "cold_run_start_s": round(cold_at - selftest._IMPORTED_AT, 3),
            "decode_build_start_s": round(build_s.get("started_at", float("nan")) - selftest._IMPORTED_AT, 3),
            "decode_tokens_per_s": round(warm.tokens_per_s, 2), "decode_steps": warm.num_steps,
            "decode_loop": loop, "launches_per_step": launches["launches"],
            "cond_branch_launches": launches["cond_branch_launches"],
            "host_transfers_per_step": launches["host"], "host_round_trips_per_step": trips["total"],
            "host_round_trips_in_branches": trips["in_branches"], "peak_device_bytes": stats.get("peak_bytes_in_use"),
            "backend": jax.default_backend(), "dtype": str(jnp.dtype(dtype)), "prefill_chunk": prefill_chunk,
            "k_max": policy.k_max, "hot_slots": policy.slots, "tier1": policy.tier1, "rung0": policy.rung0,
            # what "auto" resolved to here (rung 0 at this cache's key blocks per layer)
            "tier1_impl": tier1_impl(policy.tier1),
            # the rung 0 the certified step compiled (its self-check included); naive has no rung 0
            "rung0_impl": ("fused" if uses_fused_rung0(warm.cache.layer_view(0), policy) else "jnp")
            if mode == "certified" else None,
            "hot_refresh": policy.hot_refresh, "eps": float(policy.eps),
            "looped_weights": llama.looped_weights(params),  # "auto" resolved for this model here
            # the concrete one ("auto" resolved); naive has none (one pass)
            "schedule": getattr(warm.cache, "schedule", None) if mode == "certified" else None,
            "adaptive_streak": adaptive_rung0_streak(),
            # decode steps the whole ladder answered (the second pass), of the warm run's decode_steps
            "second_pass_steps": int(warm.cache.slow_steps) if getattr(warm.cache, "slow_steps", None) is not None
            else None,
            "fetch_kernel": warm.cache.store.reads_tier2_by_kernel() if hasattr(warm.cache, "store") else None,
            "value_packing": quant.VALUE_PACKING if mode != "dense" else None,
            # layers per conversion program of the staging cache (cache.conversion_group_layers; the prefill's
            # conversion, part of prefill_s)
            "layers_per_conversion_program": _layers_per_conversion(warm.cache) if mode != "dense" else None,
            # the fast pass's split rule (pallas_kernels.tier1_pass.FAST_PASS_BPS, CERTATTN_TIER1_BPS)
            "tier1_bps_rule": _bps_rule() if mode == "certified" else None,
            # the certify kernel's candidate selection (certify_rung0.DEFAULT_SELECT, CERTATTN_RUNG0_SELECT)
            "rung0_select": _rung0_select() if mode == "certified" else None,
            # layers per iteration of the rung-0 first pass's loop (llama.LAYER_UNROLL, CERTATTN_LAYER_UNROLL)
            "layer_unroll": llama.LAYER_UNROLL if mode == "certified" else None,
            # layer views record their hot slots' use in the whole stack (cache.HOT_USED_STACKED)
            "hot_used_stacked": _hot_used_stacked() if mode == "certified" else None,
            "device": jax.devices()[0].device_kind,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            # the decode loop's command-buffer scheduling ("xla": XLA's own setting, XLA_FLAGS included)
            "command_buffer_scheduling": gen.command_buffer_scheduling(),
            # the decode loop's and the self-checks' XLA fusion autotuner (certattn_jax.xla_options; None: XLA's)
            "fusion_autotuner": _fusion_autotuner(),
            # control flow inside the decode loop's command buffers (CERTATTN_DECODE_CONTROL_FLOW_GRAPHS)
            "decode_control_flow_graphs": _control_flow_graphs()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, CPU friendly")
    ap.add_argument("--cpu-smollm2", action="store_true", help="SmolLM2 shapes at 256/1024-token prompts")
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES + VARIANTS)
    ap.add_argument("--prompts", type=int, nargs="+", default=None, help="only these prompt lengths of the grid")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (8 with --tiny)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default 1024 (32 with --tiny)")
    ap.add_argument("--out", default=str(ROOT / "results/bench_generate.json"))
    ap.add_argument("--row", nargs=3, metavar=("MODEL", "CACHE", "PROMPT"), help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per row")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="only merge the rows of these result files (runs split over several calls) into --out")
    ap.add_argument("--prefill-only", action="store_true",
                    help="time to first token only (3 prefills: cold, then the best of two warm); no decode")
    ap.add_argument("--k-max", type=int, default=None, help="the policy's k_max (default CertPolicy's)")
    ap.add_argument("--hot-slots", type=int, default=None, help="the policy's hot_slots (default: k_max)")
    ap.add_argument("--tier1", choices=("auto", "jnp", "pallas"), default=None, help="tier-1 implementation")
    ap.add_argument("--rung0", choices=("auto", "jnp", "fused"), default=None, help="rung-0 implementation")
    ap.add_argument("--eps", type=float, default=None,
                    help="the policy's eps (default CertPolicy's); e.g. 0.01 sends random-weight SmolLM2 1K heads "
                         "to rung 1 on every step, as real text does")
    ap.add_argument("--dump-hlo", default=None, help="write each row's compiled decode loop to DIR")
    args = ap.parse_args(argv)
    new_tokens = args.new_tokens or (8 if args.tiny else 64)
    chunk = args.prefill_chunk or (32 if args.tiny else 1024)
    if args.row:
        model, cache, prompt = args.row
        row = run_row(model, cache, int(prompt), new_tokens, chunk, args.prefill_only, args.k_max, args.tier1,
                      args.rung0, args.dump_hlo, args.hot_slots, args.eps)
        print("ROW " + json.dumps(row), flush=True)
        return 0
    if args.merge:
        merged = [row for f in args.merge for row in json.loads(Path(f).read_text())["rows"]]
        Path(args.out).write_text(json.dumps({"rows": merged}, indent=1) + "\n")
        return 0
    grid = TINY_GRID if args.tiny else CPU_GRID if args.cpu_smollm2 else GRID
    models = args.models or list(grid)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for model in models:
        for prompt in [p for p in grid[model] if args.prompts is None or p in args.prompts]:
            for cache in args.caches:
                cmd = [sys.executable, str(Path(__file__).resolve()), "--row", model, cache, str(prompt),
                       "--new-tokens", str(new_tokens), "--prefill-chunk", str(chunk)]
                cmd += ["--prefill-only"] if args.prefill_only else []
                cmd += ["--k-max", str(args.k_max)] if args.k_max is not None else []
                cmd += ["--hot-slots", str(args.hot_slots)] if args.hot_slots is not None else []
                cmd += ["--tier1", args.tier1] if args.tier1 is not None else []
                cmd += ["--rung0", args.rung0] if args.rung0 is not None else []
                cmd += ["--dump-hlo", args.dump_hlo] if args.dump_hlo else []
                cmd += ["--eps", str(args.eps)] if args.eps is not None else []
                t0 = time.perf_counter()
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
                    line = next((x for x in p.stdout.splitlines() if x.startswith("ROW ")), None)
                    row = json.loads(line[4:]) if line else {"model": model, "cache": cache, "prompt": prompt,
                                                              "error": p.stderr[-2000:]}
                except subprocess.TimeoutExpired:
                    row = {"model": model, "cache": cache, "prompt": prompt, "error": f"timeout {args.timeout} s"}
                row["row_wall_s"] = round(time.perf_counter() - t0, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
                out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")  # incremental: a killed run keeps rows
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
