"""The GPU benchmark scripts run end to end at tiny shapes on the CPU (so they do not rot between GPU sessions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_attention_smoke(tmp_path):
    out = tmp_path / "bench_attention.json"
    cmd = [sys.executable, str(ROOT / "scripts/bench_attention.py"), "--smoke", "--tier1", "jnp", "--out", str(out),
           "--impls", "jax_xla_bf16", "naive", "certified", "certified_rung1"]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                   timeout=600)
    result = json.loads(out.read_text())
    impls = {(r["impl"], r["data"]) for r in result["rows"]}
    assert impls == {("jax_xla_bf16", "gaussian"), ("naive", "gaussian"), ("certified", "gaussian"),
                     ("certified", "peaked"), ("certified_rung1", "gaussian")}, impls
    assert not result["errors"]
    forced = next(r for r in result["rows"] if r["impl"] == "certified_rung1")
    assert forced["rungs"][0] == 0 and sum(forced["rungs"]) > 0  # min_rung=1: no head answered at rung 0
    for key in ("device", "jax", "measured_bandwidth_Bps"):
        assert key in result


def test_bench_decode_smoke_compiles_each_loop_once(tmp_path):
    out = tmp_path / "bench_decode.json"
    cmd = [sys.executable, str(ROOT / "scripts/bench_decode.py"), "--smoke", "--caches", "dense,certified",
           "--impls", "einsum", "--soak-steps", "8", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                   timeout=900)
    result = json.loads(out.read_text())
    assert not result["errors"]
    assert {(r["cache"], r["batch"]) for r in result["rows"]} == {("dense", 1), ("dense", 2), ("certified", 1),
                                                                  ("certified", 2)}
    for r in result["rows"]:
        assert r["soak"]["compiled_programs"] == 1, r  # no recompilation after the first call
        assert r["soak"]["steps"] >= 8
        if r["cache"] == "certified":
            assert sum(r["rung_histogram"]) > 0 and r["tier2_host_bytes"] > 0


def test_bench_decode_prefill_kv_is_the_models_own_cache():
    """--kv prefill fills the cache with the model's own prefill (keys and values the model makes, so certified
    rows time the fast pass): the dense cache holds exactly what `models.generate.prefill` makes of the same
    tokens, the certified one the same token count, and an unknown kind is a named error."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import pytest

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_decode

    from certattn_jax.model_cache import TieredModelCache
    from certattn_jax.policy import CertPolicy
    from models import llama
    from models.generate import prefill

    config = bench_decode.MODELS["tiny"]
    params = llama.init_params(config, jax.random.key(0), jnp.float32)
    policy = CertPolicy(tier1="jnp", block_size=16, group_size=16)
    dense = bench_decode.build_cache(config, 2, 128, "dense", "einsum", 40, policy, "prefill", params)
    assert np.array_equal(np.asarray(dense.lengths), [88, 88])
    rng = np.random.default_rng(2 * 7 + 128)  # the benchmark's seed for (batch 2, context 128)
    prompts = [rng.integers(0, config.vocab_size, 88).tolist() for _ in range(2)]
    want, _ = prefill(params, config, prompts, 128, prefill_chunk=bench_decode.PREFILL_CHUNK)
    for got_k, want_k in zip(dense.k, want.k, strict=True):
        np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
    tiered = bench_decode.build_cache(config, 2, 128, "certified", "einsum", 40, policy, "prefill", params)
    assert isinstance(tiered, TieredModelCache) and np.array_equal(np.asarray(tiered.lengths), [88, 88])
    with pytest.raises(ValueError, match="kv must be one of"):
        bench_decode.build_cache(config, 2, 128, "dense", "einsum", 40, policy, "uniform", params)


def test_bench_decode_stages_a_tiered_batch_a_sequence_at_a_time(monkeypatch):
    """--staging-batch 1: the tiered cache is built one sequence at a time (each sequence's dense K/V made and
    converted alone, then written into its row), so the device never holds the whole batch's dense K/V; each row
    holds what that sequence's own build gives."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_decode

    from certattn_jax.cache import DEVICE_FIELDS
    from certattn_jax.dense_cache import DenseKVCache
    from certattn_jax.policy import CertPolicy

    config = bench_decode.MODELS["tiny"]
    policy = CertPolicy(tier1="jnp", block_size=16, group_size=16)
    built = []
    real = DenseKVCache.__init__

    def spy(self, *args, **kw):
        real(self, *args, **kw)
        built.append(int(self.lengths.shape[0]))

    monkeypatch.setattr(DenseKVCache, "__init__", spy)
    staged = bench_decode.build_cache(config, 3, 128, "certified", "einsum", 40, policy, staging_batch=1)
    assert built == [1, 1, 1] and staged.store.batch == 3
    for b in range(3):
        own = bench_decode.build_cache(config, 1, 128, "certified", "einsum", 40, policy, seed_offset=b)
        for f in DEVICE_FIELDS + ("host_k", "host_v"):
            np.testing.assert_array_equal(np.asarray(getattr(staged.store, f))[:, b:b + 1],
                                          np.asarray(getattr(own.store, f)), err_msg=f)
    assert jnp.array_equal(staged.lengths, jnp.full((3,), 88)) and jax.typeof(staged.lengths).shape == (3,)


def test_bench_decode_skips_a_cache_that_cannot_fit():
    """A row whose cache alone exceeds the device's free memory is refused before it is built (a failing GPU
    allocation retries for minutes); the estimate is the cache's bytes: dense K/V, or tier 1 plus one staging
    group's dense K/V."""
    import jax.numpy as jnp
    import pytest

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_decode

    from certattn_jax.model_cache import cache_spec
    from certattn_jax.policy import CertPolicy

    config = bench_decode.MODELS["tiny"]
    policy = CertPolicy(tier1="jnp", block_size=16, group_size=16)
    per = cache_spec("certified", config, jnp.bfloat16, policy).bytes_per_sequence(128)
    assert bench_decode.cache_build_bytes(config, 4, 128, "dense", policy) == 4 * per["staging"]
    assert bench_decode.cache_build_bytes(config, 4, 128, "certified", policy) == 4 * (per["device"] + per["staging"])
    staged = bench_decode.cache_build_bytes(config, 4, 128, "certified", policy, staging_batch=1)
    assert staged == 4 * per["device"] + per["staging"]

    class Device:
        def __init__(self, limit, used):
            self.stats = {"bytes_limit": limit, "bytes_in_use": used}

        def memory_stats(self):
            return self.stats

    bench_decode.check_fits(config, 4, 128, "certified", policy, 1, Device(staged + 10, 10))  # just fits
    with pytest.raises(bench_decode.DoesNotFit, match="needs at least"):
        bench_decode.check_fits(config, 4, 128, "certified", policy, 1, Device(staged + 10, 11))
    with pytest.raises(bench_decode.DoesNotFit, match="dense cache"):
        bench_decode.check_fits(config, 4, 128, "dense", policy, None, Device(4 * per["staging"] - 1, 0))

    class NoStats:
        def memory_stats(self):
            return None

    bench_decode.check_fits(config, 10**6, 128, "dense", policy, None, NoStats())  # the CPU: not checked


def test_probe_conditionals_smoke(tmp_path):
    out = tmp_path / "probe_conditionals.json"
    cmd = [sys.executable, str(ROOT / "scripts/probe_conditionals.py"), "--smoke", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                   timeout=300)
    result = json.loads(out.read_text())
    assert [r["form"] for r in result["forms"]] == ["plain", "cond_false", "cond_true", "switch", "where"]
    assert all("extra_us_vs_plain" in r for r in result["forms"]) and "xla_flags" in result


def test_probe_host_write_smoke(tmp_path):
    """The tier-2 write probe runs (interpreted here) and both writes land where asked (its `correct` compares
    with numpy, so a kernel writing the wrong block fails it)."""
    out = tmp_path / "probe_host_write.json"
    cmd = [sys.executable, str(ROOT / "scripts/probe_host_write.py"), "--smoke", "--in-cond", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                   timeout=300)
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == ["xla_dus", "kernel_alias"] and result["in_cond"]
    assert all(r.get("correct") is True and "us_per_write" in r for r in result["rows"]), result["rows"]


def test_probe_large_offsets_smoke(tmp_path):
    out = tmp_path / "probe_large_offsets.json"
    cmd = [sys.executable, str(ROOT / "scripts/probe_large_offsets.py"), "--smoke", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                   timeout=300)
    (case,) = json.loads(out.read_text())["cases"]
    assert case["rows_ok"] == [True] * 3 and case["offsets_fit"]


def test_probe_eval_compile_smoke(tmp_path):
    out = tmp_path / "probe_eval_compile.json"
    cmd = [sys.executable, str(ROOT / "scripts/probe_eval_compile.py"), "--model", "tiny", "--capacity", "64",
           "--steps", "2", "--schedules", "looped", "--out", str(out)]  # (one schedule: CI time)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                   timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [r["schedule"] for r in rows] == ["looped"]
    assert all(r["compile_s"] > 0 and r["launches_per_step"] > 0 for r in rows)


def test_big_writes_lists_copies_and_skips_in_place_updates():
    sys.path.insert(0, str(ROOT / "scripts"))
    from big_writes import big_writes

    hlo = """HloModule m

%body (p: (s32[], f32[4,1024])) -> (s32[], f32[4,1024]) {
  %p = (s32[], f32[4,1024]) parameter(0)
  %copy.1 = f32[4,1024]{1,0} copy(f32[4,1024]{1,0} %x), metadata={op_name="jit(f)/copy"}
  %fusion.2 = f32[4,1024]{1,0} fusion(f32[4,1024]{1,0} %x), kind=kLoop, calls=%c, metadata={op_name="jit(f)/scatter"}
  %custom-call.3 = f32[4,1024]{1,0} custom-call(f32[4,1024]{1,0} %x), custom_call_target="k"
}

%cond (p: (s32[], f32[4,1024])) -> pred[] {
  %p = (s32[], f32[4,1024]) parameter(0)
}

ENTRY %main (a: f32[4,1024]) -> f32[4,1024] {
  %w = (s32[], f32[4,1024]) while((s32[], f32[4,1024]) %t), condition=%cond, body=%body
}
"""
    rows = big_writes(hlo, 1000)
    assert [(r["op"], r["bytes"], r["in_place_update"]) for r in rows] == [("copy", 16384, False),
                                                                            ("fusion", 16384, True)]
    from launches_by_scope import launches_by_scope

    by_scope = launches_by_scope(hlo)  # the custom call is a launch too; grouped by op name
    assert by_scope == {"step": {"scatter": 1, "copy:copy": 1, "custom-call": 1}, "branch": {}}


def test_bench_generate_names_every_layer_schedule():
    """bench_generate.py lists the certified variants without importing jax; they must be the schedules."""
    import importlib.util

    from certattn_jax.model_cache import SCHEDULES

    spec = importlib.util.spec_from_file_location("bench_generate_names", ROOT / "scripts" / "bench_generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.VARIANTS == tuple(f"certified_{s}" for s in SCHEDULES)


def test_trace_decode_sums_idle_gaps_by_what_precedes_them_and_maps_kernels_to_scopes():
    sys.path.insert(0, str(ROOT / "scripts"))
    from trace_decode import hlo_scopes, idle_after, summarize

    events = [{"name": "loop_add_fusion_1", "ts": 0, "dur": 10}, {"name": "MemcpyD2H", "ts": 12, "dur": 2},
              {"name": "k2", "ts": 50, "dur": 5}, {"name": "k3", "ts": 52, "dur": 10},
              {"name": "k4", "ts": 70, "dur": 1}]
    assert idle_after(events) == {"kernel": 10.0, "MemcpyD2H": 36.0}
    hlo = ('  %loop_add_fusion.1 = f32[4]{0} fusion(%p), kind=kLoop, calls=%c, '
           'metadata={op_name="jit(_decode_loop)/while/body/rung0_fused/add"}\n')
    scopes = hlo_scopes(hlo)
    assert scopes["loop_add_fusion_1"] == "rung0_fused/add"
    row = summarize(events, scopes, steps=1, wall_s=71e-6)
    assert row["busy_ms_per_step"] == round(25 / 1e3, 4) and row["kernels_per_step"] == 5
    assert row["us_per_step_by_scope"]["rung0_fused"] == 10.0
    assert row["events_per_step_by_kind"] == {"MemcpyD2H": 1, "kernel": 4}
    gaps = {(r["after"], r["scope"]): r for r in row["idle_after_scope_per_step"]}
    assert gaps[("MemcpyD2H", "MemcpyD2H")]["idle_us"] == 36.0  # the copy has no scope: its name stands in
    assert gaps[("kernel", "rung0_fused/add")] == {"after": "kernel", "scope": "rung0_fused/add", "idle_us": 2.0,
                                                   "gaps": 1, "median_gap_us": 2.0}


def test_trace_decode_sums_host_events_in_the_loop_window():
    sys.path.insert(0, str(ROOT / "scripts"))
    from trace_decode import host_events

    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "kernel", "ts": 10, "dur": 5},
        {"ph": "X", "pid": 2, "name": "KernelThunk 12", "ts": 11, "dur": 2},
        {"ph": "X", "pid": 2, "name": "KernelThunk 13", "ts": 14, "dur": 4},
        {"ph": "X", "pid": 2, "name": "Update", "ts": 15, "dur": 1},
        {"ph": "X", "pid": 2, "name": "before the loop", "ts": 1, "dur": 1}]}
    rows = host_events(trace, 10, 20, steps=2)
    assert rows == [{"name": "KernelThunk #", "per_step": 1.0, "us_per_step": 3.0},
                    {"name": "Update", "per_step": 0.5, "us_per_step": 0.5}]


def test_trace_decode_keeps_only_kernels_after_the_decode_program_starts():
    """The prefill's program reuses fusion names; only kernels from the decode program's first execution on count."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from trace_decode import decode_window

    trace = {"traceEvents": [
        {"ph": "X", "pid": 2, "name": "CommonPjRtLoadedExecutable::Execute (jit__prefill_chunk)", "ts": 5, "dur": 50},
        {"ph": "X", "pid": 2, "name": "CommonPjRtLoadedExecutable::Execute (jit__decode_loop)", "ts": 100, "dur": 9},
        {"ph": "X", "pid": 2, "name": "CommonPjRtLoadedExecutable::Execute (jit__decode_loop)", "ts": 300, "dur": 9}]}
    start, end = decode_window(trace)
    assert start == 100 and end > 1e9  # the loop's kernels may run after the host's call returned
    assert decode_window({"traceEvents": []}) is None


def test_batch_limits_count_tier_2_against_the_host():
    """scripts/batch_limits.py: tier 2 is host bytes (exactly the dense cache's K/V), tier 1 device bytes below
    dense; with a host smaller than the device the certified cache's batch is bound by the host."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from batch_limits import limits, per_sequence_bytes
    from bench_generate import _model_config

    cfg = _model_config("tiny")
    dense_dev, dense_host = per_sequence_bytes("dense", cfg, 1024)
    cert_dev, cert_host = per_sequence_bytes("certified", cfg, 1024)
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * 1024 * cfg.head_dim * 2  # K and V, bf16
    assert dense_host == 0 and cert_host == kv_bytes and kv_bytes <= dense_dev < kv_bytes + 64
    assert 0 < cert_dev < dense_dev
    rows = {r["cache"]: r for r in limits("tiny", [1024], device_gib=1.0, host_gib=0.5, device_margin_gib=0.0,
                                         host_margin_gib=0.0)}
    assert rows["certified"]["binding"] == "host"
    assert rows["certified"]["max_batch"] == rows["certified"]["max_batch_by_host"] < rows["dense"]["max_batch"]


def test_bench_ttft_interleaves_the_caches_and_reports_ratios_against_dense():
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_ttft import measure

    row = measure("tiny", 40, ["dense", "certified"], rounds=2, new_tokens=4, prefill_chunk=32)
    dense, cert = row["caches"]["dense"], row["caches"]["certified"]
    assert dense["ratio_median"] == 1.0 and cert["min_s"] <= cert["median_s"] <= cert["max_s"]
    assert cert["ratio_p10_p90"][0] <= cert["ratio_median"] <= cert["ratio_p10_p90"][1]


def test_probe_compile_parts_smoke(tmp_path):
    """The compile-time probe compiles the decode loop whole and with a part left out (its patch undone after)."""
    out = tmp_path / "probe_compile_parts.json"
    cmd = [sys.executable, str(ROOT / "scripts/probe_compile_parts.py"), "--model", "tiny", "--capacity", "64",
           "--modes", "certified", "--rung0", "jnp", "--parts", "flush", "--out", str(out)]  # (one part: CI time)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                   timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["rung0"], r["without"]) for r in rows] == [("certified", "jnp", None),
                                                                     ("certified", "jnp", "flush")]
    assert all(r["compile_s"] > 0 and r["lower_s"] > 0 for r in rows)
    whole, no_flush = (r["stablehlo_chars"] for r in rows)
    assert no_flush < whole  # the flush's code is gone
