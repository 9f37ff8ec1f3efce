"""The cache end to end: one place decides it, prefill never reads tier 2 back, and a user's own jit loop
around `models.llama.forward` compiles once and keeps tier 2 in host memory."""

import ast
import dataclasses
import functools
import inspect
import os
import time
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from certattn_jax import bounds, cli, model_cache, runner, tiers
from certattn_jax.cache import TieredKVCache
from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.model_cache import CACHE_MODES, CacheSpec, TieredModelCache, cache_spec
from certattn_jax.policy import CertPolicy
from models import generate as gen
from models import llama
from models.config import LlamaConfig

# the shapes of tests/test_integration.py, so that compiled programs are shared within a worker
CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_one_place_decides_the_cache(params):
    assert cli.CACHE_MODES is CACHE_MODES is runner.CACHE_MODES
    choices = next(a for a in cli._parser()._subparsers._group_actions[0].choices["generate"]._actions
                   if a.dest == "cache").choices
    assert tuple(choices) == CACHE_MODES
    assert isinstance(llama.init_cache(params, CFG, 1, 32), DenseKVCache)
    for mode in ("naive", "certified"):
        c = llama.init_cache(params, CFG, 1, 40, mode, POLICY)
        assert isinstance(c, TieredModelCache) and c.mode == mode and c.capacity == 48
        assert c.layers[0].host_k.sharding.memory_kind == tiers.host_memory_kind()
    with pytest.raises(ValueError, match="unknown cache mode 'int8'.*dense"):
        cache_spec("int8", CFG, jnp.float32)
    # the CLI and the demo do not import each other (the shared helpers live in runner)
    assert not any("certattn_jax.cli" in n or n == "certattn_jax.cli" for n in _imports(ROOT / "certattn_jax/demo.py"))
    assert "certattn_jax.demo" not in " ".join(_imports(ROOT / "certattn_jax/runner.py"))


def test_the_stacked_conversion_holds_one_layers_temporaries_at_a_time():
    """Converting every layer in one program must not hold every layer's float32 temporaries (errors, Gram
    matrices: ~6x a layer's K/V) at once: XLA's memory analysis of the compiled conversion, 8 layers against
    2, same per-layer shape. (The batched form grew 4x; at 8B 128K it asked the H200 for tens of GB.) Where tier 2
    goes to another memory (a GPU's pinned host), every layer's originals are a device temporary before their one
    copy to the host (H200, 2026-12-04: +490 KB per layer here, against 512 KB of originals; none on the CPU):
    that is allowed, each layer's float32 temporaries (~6x its K/V) are not."""
    from certattn_jax.cache import _from_head_major_impl

    policy = CertPolicy(block_size=16, group_size=16)
    shape = (1, 2, 512, 64)

    def temp_bytes(layers):
        kv = jax.ShapeDtypeStruct((layers, *shape), jnp.float32)
        lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
        return _from_head_major_impl.lower(kv, kv, lengths, policy).compile().memory_analysis().temp_size_in_bytes

    two, eight = temp_bytes(2), temp_bytes(8)
    originals = 2 * int(np.prod(shape)) * 4  # one layer's K and V, float32
    assert eight - two <= 6 * originals + 0.5 * two, (two, eight, originals)


def test_prefill_never_reads_tier2_and_conversion_equals_appending(params, monkeypatch):
    """spec.staging -> chunked forward -> spec.from_staging holds exactly what appending to the tiered cache
    holds, and never reads tier 2 (every tier-2 read raises here)."""

    def forbidden(*a, **k):
        raise AssertionError("prefill read tier 2")

    for name in ("read_all", "read_head", "read_block"):
        monkeypatch.setattr(tiers, name, forbidden)
    spec = cache_spec("certified", CFG, jnp.float32, POLICY)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 40)), jnp.int32)
    valid = jnp.asarray([40, 23], jnp.int32)
    fwd = jax.jit(lambda p, t, c, v: llama.forward(p, CFG, t, c, valid_lengths=v))
    staging = spec.staging(2, 64)
    for s in (0, 24):  # two chunks of 24 and 16 tokens, the second row ending inside the first chunk
        chunk_valid = jnp.clip(valid - s, 0, tokens[:, s:s + 24].shape[1])
        _, staging = fwd(params, tokens[:, s:s + 24], staging, chunk_valid)
    k_dense = [np.asarray(x) for x in staging.k]
    v_dense = [np.asarray(x) for x in staging.v]
    cache = spec.from_staging(staging)
    monkeypatch.undo()
    assert np.asarray(cache.lengths).tolist() == [40, 23]
    for layer, c in enumerate(cache.layers):
        k_btHd = jnp.asarray(k_dense[layer].transpose(0, 2, 1, 3))
        v_btHd = jnp.asarray(v_dense[layer].transpose(0, 2, 1, 3))
        ref = TieredKVCache.init(batch=2, capacity=64, num_kv_heads=2, head_dim=32, dtype=jnp.float32,
                                 policy=POLICY).append(k_btHd, v_btHd, valid)
        # every field (a field added to the cache later is compared too), except the exact copies that may differ
        # past the valid tokens: residual and tier 2 (compared through the exact view below)
        fields = [n for n in c.__dataclass_fields__ if isinstance(getattr(c, n), jax.Array) and n != "layer"]
        assert "k_codes" in fields and "v_err" in fields and "flushed" in fields
        for name in fields:
            if name not in ("res_k", "res_v", "host_k", "host_v"):
                np.testing.assert_array_equal(np.asarray(getattr(c, name)), np.asarray(getattr(ref, name)),
                                              err_msg=name)
        for b, n in enumerate((40, 23)):  # tier 2 + residual: the originals of every valid token
            from certattn_jax.attention import exact_keys_values

            for mine, theirs in zip(exact_keys_values(c), exact_keys_values(ref), strict=True):
                np.testing.assert_array_equal(np.asarray(mine)[b, :, :n], np.asarray(theirs)[b, :, :n])
        assert c.host_k.sharding.memory_kind == tiers.host_memory_kind()


def test_staged_generation_equals_prefill_through_the_tiered_cache(params):
    """generate() with a CacheSpec (dense staging + one conversion) decodes exactly as with a plain factory
    (prefill through the tiered cache's own attend): the same tokens and the same certificates."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (70, 9, 33)]
    spec = cache_spec("certified", CFG, jnp.float32, POLICY)
    kw = dict(eos_token_ids=(), progress=False, prefill_chunk=32, record_steps=True)
    staged = gen.generate(params, CFG, prompts, 12, cache_factory=spec, **kw)
    direct = gen.generate(params, CFG, prompts, 12, cache_factory=lambda b, c: spec(b, c), **kw)
    assert staged.tokens == direct.tokens
    for name in ("rung", "k_star", "certified"):
        np.testing.assert_array_equal(getattr(staged.step_records, name), getattr(direct.step_records, name))
    np.testing.assert_allclose(staged.step_records.error_bound, direct.step_records.error_bound, rtol=1e-6)


def test_user_jit_loop_compiles_once_and_keeps_tier2_on_host():
    """The documented pattern (README "Your own decode loop"): cache in, cache out, donated. (One layer: the
    certified step's compile time grows with layers and one shows the pattern.)"""
    cfg = dataclasses.replace(CFG, num_layers=1)
    params = llama.init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    traces = []

    def step_fn(p, tok, cache):
        traces.append(1)
        logits, cache = llama.forward(p, cfg, tok, cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    step = jax.jit(step_fn, donate_argnums=(2,))
    # a tiered cache built from existing dense K/V given as uncommitted arrays (numpy -> jnp)
    rng = np.random.default_rng(1)
    kv = [(jnp.asarray(rng.normal(size=(1, 37, 2, 32)), jnp.float32),
           jnp.asarray(rng.normal(size=(1, 37, 2, 32)), jnp.float32)) for _ in range(cfg.num_layers)]
    layers = tuple(TieredKVCache.from_dense(k, v, POLICY, capacity=64) for k, v in kv)
    assert all(x.committed for x in jax.tree.leaves(layers))
    cache = TieredModelCache.from_layers(layers, num_q_heads=cfg.num_heads, policy=POLICY)

    def shardings(c):  # of every array, the policy's tolerances included (committed arrays, as a step returns them)
        return [getattr(x, "sharding", None) for x in jax.tree.leaves(c)]

    kinds = shardings(cache)
    assert all(isinstance(x, jax.Array) and x.committed for x in jax.tree.leaves(cache.policy))
    tok = jax.device_put(jnp.zeros((1,), jnp.int32), jax.devices()[0])  # committed, as the step returns it
    for _ in range(4):
        tok, cache = step(params, tok[:, None], cache)
    # one trace AND one executable: a Python-float tolerance skipped the retrace but compiled a second program
    assert len(traces) == 1 and step._cache_size() == 1
    assert shardings(cache) == kinds
    assert cache.layers[0].host_k.sharding.memory_kind == tiers.host_memory_kind()
    assert int(cache.lengths[0]) == 41
    # a second cache built the same way, an empty one from the cache factory, and new tolerances set with
    # `with_policy` run on the same executable
    cache2 = TieredModelCache.from_layers([TieredKVCache.from_dense(k, v, POLICY, capacity=64) for k, v in kv],
                                          num_q_heads=cfg.num_heads, policy=POLICY)
    step(params, tok[:, None], cache2)
    step(params, tok[:, None], cache_spec("certified", cfg, jnp.float32, POLICY)(1, 64))
    tok, cache = step(params, tok[:, None], cache.with_policy(POLICY.replace(eps=0.01, tau_cov=0.9)))
    assert float(cache.policy.eps) == pytest.approx(0.01) and float(cache.policy.tau_cov) == pytest.approx(0.9)
    assert len(traces) == 1 and step._cache_size() == 1
    with pytest.raises(ValueError, match="layout"):
        cache.with_policy(POLICY.replace(block_size=32))
    # the model cache copies its layers into its stacked store: one layer cache given twice is two layers
    one = TieredKVCache.from_dense(*kv[0], POLICY, capacity=64)
    twice = TieredModelCache.from_layers([one] * 2, num_q_heads=cfg.num_heads, policy=POLICY)
    np.testing.assert_array_equal(twice.store.k_codes[0], twice.store.k_codes[1])
    assert twice.store.host_k.sharding.memory_kind == tiers.host_memory_kind()
    with pytest.raises(ValueError, match="view of a model cache"):
        TieredModelCache.from_layers([twice.layer_view(0)], num_q_heads=cfg.num_heads, policy=POLICY)


def test_cache_spec_is_a_factory_and_checks_its_input():
    spec = cache_spec("naive", CFG, jnp.bfloat16, POLICY)
    assert isinstance(spec, CacheSpec) and spec.staging_capacity(40) == 48
    with pytest.raises(ValueError, match="multiple of the block size"):
        TieredKVCache.from_head_major(jnp.zeros((1, 2, 40, 32)), jnp.zeros((1, 2, 40, 32)), jnp.zeros((1,), jnp.int32),
                                      POLICY)
    with pytest.raises(ValueError, match="lengths must lie in"):
        TieredKVCache.from_head_major(jnp.zeros((1, 2, 48, 32)), jnp.zeros((1, 2, 48, 32)),
                                      jnp.asarray([49], jnp.int32), POLICY)
    with pytest.raises(ValueError, match="overflow"):
        TieredKVCache.from_dense(jnp.zeros((1, 40, 2, 32)), jnp.zeros((1, 40, 2, 32)), POLICY, capacity=16)


def test_bench_generate_counts_launches_of_the_decode_loop():
    """scripts/bench_generate.py's HLO reading: launches inside the while body, cond branches apart."""
    import sys

    sys.path.insert(0, str(ROOT))
    from scripts.bench_generate import count_launches

    hlo = """HloModule m

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

%branch_taken (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %x = f32[4]{0} exponential(%a)
  ROOT %y = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused
}

%branch_skip (b: f32[4]) -> f32[4] {
  ROOT %b = f32[4]{0} parameter(0)
}

%body (s: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[4]{0} get-tuple-element(%s), index=1
  %f = f32[4]{0} fusion(%v), kind=kLoop, calls=%fused
  %h = f32[4]{0:S(5)} copy(%f)
  %pred = pred[] constant(false)
  %c = f32[4]{0} conditional(%pred, %f, %f), true_computation=%branch_taken, false_computation=%branch_skip
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %c)
}

%cond (s: (s32[], f32[4])) -> pred[] {
  %s = (s32[], f32[4]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(%z, %x)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
}
"""
    assert count_launches(hlo) == {"launches": 3, "cond_branch_launches": 2, "host": 1}
    # a conditional that is handed a host buffer (the flush's tier-2 operand) moves nothing unless its branch runs
    passing = hlo.replace("conditional(%pred, %f, %f)", "conditional(%pred, %h, %f)").replace(
        "%c = f32[4]{0} conditional", "%c = f32[4]{0:S(5)} conditional")
    assert count_launches(passing) == {"launches": 3, "cond_branch_launches": 2, "host": 1}
    with pytest.raises(ValueError, match="no while loop"):
        count_launches(hlo.replace("while(%t), condition=%cond, body=%body", "copy(%t)"))
    # the host waits for the device once per conditional on the step's path (its predicate) and once for the
    # decode loop's own predicate; a conditional inside a branch only when that branch runs
    from scripts.hlo_walk import host_round_trips

    assert host_round_trips(hlo) == {"conditionals": 1, "unknown_trip_loops": 0, "in_branches": 0, "total": 2}
    nested = hlo.replace("%x = f32[4]{0} exponential(%a)", "%x = f32[4]{0} conditional(%pred2, %a, %a), "
                         "true_computation=%branch_skip, false_computation=%branch_skip")
    assert host_round_trips(nested)["in_branches"] == 1 and host_round_trips(nested)["total"] == 2
    looping = hlo.replace("%h = f32[4]{0:S(5)} copy(%f)", "%h = f32[4]{0:S(5)} copy(%f)\n  %inner = (s32[], f32[4]{0}) "
                          "while(%s), condition=%cond, body=%branch_skip")
    assert host_round_trips(looping)["unknown_trip_loops"] == 1 and host_round_trips(looping)["total"] == 3
    # the "nested" decode loop's common step is the first loop inside the step's body: here a body without any
    assert host_round_trips(looping, inner_step=True) == {"conditionals": 0, "unknown_trip_loops": 0,
                                                          "in_branches": 0, "total": 1}
    with pytest.raises(ValueError, match="no while loop inside"):
        host_round_trips(hlo, inner_step=True)
    known = looping.replace("body=%branch_skip", 'body=%branch_skip, backend_config={"known_trip_count":{"n":"30"}}')
    assert host_round_trips(known)["total"] == 2


@pytest.mark.xdist_group("layer-schedules")  # one worker: the second case reuses the first's compiled programs
@pytest.mark.parametrize("eps", [0.05, 1e-9], ids=["rung0", "escalating"])
def test_layer_schedules_decode_identically(params, eps, monkeypatch):
    """The two-pass decode step (rungs 0-1 unrolled -- or rung 0 alone, "straight" -- the whole ladder in a loop
    over layers only when a head
    needs more) and the looped one (both ways of reaching a layer's weights) give exactly what the whole ladder
    inlined in every layer gives: the same tokens, rungs, K* and bounds -- with the default tolerance (rungs
    0-1) and with one no head meets below rung 3 (the slow pass runs on every step)."""
    policy = dataclasses.replace(POLICY, eps=eps, abs_tol=0.0)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (70, 21)]
    kw = dict(eos_token_ids=(), progress=False, prefill_chunk=32, record_steps=True)

    def run(schedule):
        return gen.generate(params, CFG, prompts, 8, cache_factory=cache_spec("certified", CFG, jnp.float32,
                                                                              policy, schedule=schedule), **kw)

    # on the CPU: weights in place
    # ("straight", the unrolled rung-0-only fast pass, is "straight-looped"'s pass unrolled: CI time, not run here)
    runs = {s: run(s) for s in ("unrolled", "two-pass", "straight-looped", "adaptive", "looped")}
    monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 1 << 40)
    monkeypatch.setattr(gen, "_COMPILED", {})  # the compiled loops do not know the module constant
    runs["looped, weights stacked"] = run("looped")
    monkeypatch.setattr(gen, "_COMPILED", {})
    if eps == 0.05:  # adaptive runs both first passes here (rung-0 steps and rung-1 steps), all reading them stacked;
        # with a streak of 1 the rung-0 pass follows every rung-0 step
        monkeypatch.setattr(model_cache, "_ADAPTIVE_RUNG0_STREAK", 1)
        runs["adaptive, weights stacked"] = run("adaptive")
    else:  # (CI time: one extra run per case)
        monkeypatch.setattr(llama, "_LOOPED_WEIGHTS", "switch")
        runs["looped, weights switched"] = run("looped")
    ref = runs.pop("unrolled")
    rungs = np.asarray(ref.step_records.rung)  # [steps, L, B, Hq]
    if eps == 0.05:
        # the hot set starts empty (rung 0 never reads tier 2): a step climbs to rung 1 where it needs blocks
        # that are not resident, and rung 1 fills the hot set
        assert np.all(rungs <= 1) and np.any(rungs == 0)
    else:
        assert np.all(rungs >= 3)
    # the second pass (whole ladder) runs exactly on the steps the fast pass cannot answer: some head above rung 1
    # (rung 0 for the straight schedules); adaptive in between
    top = rungs.reshape(rungs.shape[0], -1).max(axis=1)  # per decode step
    above1, above0 = int(np.sum(top >= 2)), int(np.sum(top >= 1))
    assert int(ref.cache.slow_steps) == 0  # one pass, the whole ladder inlined: no second pass
    for name, run in runs.items():
        slow = int(run.cache.slow_steps)
        if name.startswith(("looped", "two-pass")):
            assert slow == above1, (name, slow, top)
        elif name.startswith("straight"):
            assert slow == above0, (name, slow, top)
        else:
            assert above1 <= slow <= above0, (name, slow, top)
    for name, run in runs.items():
        assert run.tokens == ref.tokens, name
        for field in ("rung", "k_star", "certified", "ranking_ok"):
            np.testing.assert_array_equal(getattr(run.step_records, field), getattr(ref.step_records, field),
                                          err_msg=f"{name}: {field}")
        # the bounds agree to float32 noise. On the H100 they moved by up to 2.9e-6 relative between schedules (same
        # tokens, rungs, K*): every schedule runs the same token-write kernel, so the likely source is each
        # program's own compilation of the float32 projections the bounds depend on -- not yet confirmed by the
        # run with XLA's writes (docs/performance.md, twenty-first session)
        rtol = 1e-6 if jax.default_backend() == "cpu" else 1e-4
        np.testing.assert_allclose(run.step_records.error_bound, ref.step_records.error_bound, rtol=rtol,
                                   err_msg=name)


def test_the_ladder_is_compiled_once_whatever_the_depth_or_schedule(params):
    """The rungs above 1 sit in one loop over layers, so their code does not grow with the depth, and rungs 0-1 too
    when looped. "adaptive" picks one of two first passes per step, and both share one second pass: the rungs
    above 1 are compiled once, as in "looped" (each branch used to carry its own copy of the whole ladder).
    ("two-pass" unrolls rungs 0-1 per layer by design; CI time: not compiled here.)"""
    counts = {}
    for schedule, layers in (("looped", 2), ("looped", 3), ("adaptive", 2)):
        cfg = dataclasses.replace(CFG, num_layers=layers)
        p = params if layers == CFG.num_layers else llama.init_params(cfg, jax.random.key(0), jnp.float32)
        cache = cache_spec("certified", cfg, jnp.float32, POLICY, schedule=schedule)(1, 64)
        p = llama.params_for_decoding(p, cache)
        hlo = jax.jit(lambda p, t, c, cfg=cfg: llama.forward(p, cfg, t, c)).lower(
            p, jnp.zeros((1, 1), jnp.int32), cache).compile().as_text()
        counts[schedule, layers] = {r: hlo.count(r) for r in ("rung1_widen", "rung3_exact_heads")}
        # rung 0: the jnp rung 0 (the CPU's), or the fused kernel (a GPU's "auto")
        counts[schedule, layers]["rung0_certified"] = hlo.count("rung0_certified") + hlo.count("rung0_fused")
    # (the instruction counts vary by a few with XLA's fusion choices around the loop)
    base = counts["looped", 2]
    for rung in ("rung0_certified", "rung1_widen", "rung3_exact_heads"):
        assert base[rung] > 0 and abs(counts["looped", 3][rung] - base[rung]) <= 0.05 * base[rung], counts
    rung3 = counts["adaptive", 2]["rung3_exact_heads"]
    assert abs(rung3 - base["rung3_exact_heads"]) <= 0.05 * base["rung3_exact_heads"], counts


def _weight_moves(params, hlo: str) -> list[str]:
    """Lines of compiled HLO that copy (or slice) a buffer of a weight matrix's shape."""
    import re

    shapes = {f"f32[{','.join(map(str, w.shape))}]" for layer in params["layers"] for w in layer.values()
              if w.ndim == 2}
    assert shapes
    return [line for line in hlo.splitlines()
            if re.match(r"\s*%?[\w.\-]+ = (f32\[[\d,]*\])\{[^}]*\} (copy|copy-start|dynamic-slice)\(", line)
            and re.match(r"\s*%?[\w.\-]+ = (f32\[[\d,]*\])", line).group(1) in shapes]


@pytest.mark.parametrize("in_place", [True, False])
def test_the_looped_schedule_places_weights_by_size(params, monkeypatch, in_place):
    """Large layers (8B: 436 MB each) run inside per-layer `lax.switch` branches holding their own weights:
    the compiled decode step has no copy (nor slice) of any weight-shaped buffer (a switch that returned the
    weights copied them: 8.9 ms of a 20.1 ms 8B step on the H200). Small layers on a GPU (SmolLM2: 7 MB) take
    the copy, which is cheaper there than a second conditional per layer (170 vs 142 tokens/s on the H200).
    The second pass (rare: some head needs a rung above 1) copies large layers' weights out of one switch too, so
    that its dense code is compiled once rather than once per layer: the fast pass alone must copy nothing."""
    from certattn_jax.model_cache import TieredModelCache

    monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 0 if in_place else 1 << 40)
    fused = llama.fuse_projections(params)
    cache = cache_spec("certified", CFG, jnp.float32, POLICY, schedule="looped")(1, 64)

    def moves(fast_pass_only: bool) -> list[str]:
        with monkeypatch.context() as m:
            if fast_pass_only:  # the second pass's predicate a constant: XLA drops its branch
                m.setattr(TieredModelCache, "needs_slow_path", lambda self: jnp.bool_(False))
            hlo = jax.jit(lambda p, t, c: llama.forward(p, CFG, t, c)).lower(
                fused, jnp.zeros((1, 1), jnp.int32), cache).compile().as_text()
        return _weight_moves(fused, hlo)

    fast_moves = moves(True)
    if in_place:
        assert not fast_moves, fast_moves[:3]
        assert moves(False)  # the second pass copies large layers' weights out of one switch
    else:
        assert fast_moves  # the copy path is what runs for small layers: the test would not notice a silent switch


SELF_CHECKS = ("tier1_disagreement", "rung0_disagreement", "_rung0_case", "warm_compiler")  # pallas_kernels.selftest


def test_the_kernels_read_each_layer_in_place_and_decode_like_jnp(params, monkeypatch):
    """Through the Pallas path (tier-1 kernel, fused rung 0; interpret mode here) a model's decode step hands the
    tier-1 kernel the stacked tier-1 arrays and the layer index (no per-layer slice of tier 1 feeds a launch),
    and decodes the same tokens with the same rungs and K* as the jnp path; naive through the kernel too."""
    from pallas_kernels import tier1_pass as kernel

    calls = []
    real = kernel.tier1_pass

    def spy(q, k_codes, *args, layer=None, **kw):
        # the kernels' self-checks (compiled on a GPU, once per configuration) run on small caches of their own
        if not any(f.filename.endswith(os.path.join("pallas_kernels", "selftest.py")) and f.function in SELF_CHECKS
                   for f in inspect.stack()):
            calls.append((k_codes.ndim, layer is not None))
        return real(q, k_codes, *args, layer=layer, **kw)

    monkeypatch.setattr(kernel, "tier1_pass", spy)
    monkeypatch.setattr(gen, "_COMPILED", {})
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (70, 37)]
    kw = dict(eos_token_ids=(), progress=False, prefill_chunk=32, record_steps=True)
    runs = {}
    for name, mode, pol in (("jnp", "certified", POLICY),
                            ("kernels", "certified", dataclasses.replace(POLICY, tier1="pallas", rung0="fused")),
                            ("naive", "naive", POLICY),
                            ("naive kernel", "naive", dataclasses.replace(POLICY, tier1="pallas"))):
        calls.clear()
        runs[name] = gen.generate(params, CFG, prompts, 5, cache_factory=cache_spec(mode, CFG, jnp.float32, pol),
                                  **kw)
        if pol.tier1 == "pallas":  # traced: every decode-step call reads the stacked [L, B, H, ...] arrays
            assert calls and all(ndim == 6 and stacked for ndim, stacked in calls), calls
    assert runs["kernels"].tokens == runs["jnp"].tokens
    for field in ("rung", "k_star", "certified"):
        np.testing.assert_array_equal(getattr(runs["kernels"].step_records, field),
                                      getattr(runs["jnp"].step_records, field), err_msg=field)
    assert runs["naive kernel"].tokens == runs["naive"].tokens


def test_naive_decoding_loops_over_layers_where_measured_faster(params, monkeypatch):
    """A naive cache's decode step runs its layers in a loop over layers on the CPU (`NAIVE_LOOPED_BACKENDS`: the INT
    attention compiled once; 10.6 -> 3.3 s of compile at SmolLM2 shapes) and gives the logits and cache of the
    unrolled layers (float32 reassociation at most); a prefill chunk stays unrolled."""
    spec = cache_spec("naive", CFG, jnp.float32, POLICY)
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 37)), jnp.int32)
    toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (12, 2, 1)), jnp.int32)

    def decode(looped):
        monkeypatch.setattr(model_cache, "NAIVE_LOOPED_BACKENDS",
                            frozenset({jax.default_backend()}) if looped else frozenset())
        step = jax.jit(llama.forward, static_argnums=1)
        _, cache = step(params, CFG, prompt, spec.staging(2, 64))
        cache = spec.from_staging(cache)
        loops = [e.primitive.name for e in jax.make_jaxpr(lambda c: llama.forward(params, CFG, toks[0], c))(
            cache).jaxpr.eqns if e.primitive.name in ("while", "scan")]
        logits = []
        for t in toks:  # 37 + 12 tokens: a block of 16 fills and flushes at the end of a step
            out, cache = step(params, CFG, t, cache)
            logits.append(out)
        return loops, np.stack(logits), cache

    loops, looped, c_loop = decode(True)
    no_loops, unrolled, c_unrolled = decode(False)
    assert loops and not no_loops
    assert np.all(np.asarray(c_loop.store.flushed) == 48)
    for field in ("lengths", "flushed", "hot_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(c_loop.store, field)),
                                      np.asarray(getattr(c_unrolled.store, field)), err_msg=field)
    if jax.default_backend() != "cpu":  # two programs' GEMMs may round differently (TF32 by default on a GPU)
        np.testing.assert_allclose(looped, unrolled, rtol=5e-3, atol=5e-3)
        return
    np.testing.assert_allclose(looped, unrolled, rtol=2e-5, atol=2e-5)
    for field in ("v_min", "v_max", "res_k", "k_codes"):
        np.testing.assert_array_equal(np.asarray(getattr(c_loop.store, field)),
                                      np.asarray(getattr(c_unrolled.store, field)), err_msg=field)


def test_the_straight_fast_pass_holds_no_conditional():
    """The "straight" schedule's fast pass (rung 0 only) is straight-line code: no cond, switch or loop in the
    traced attention (so that nothing stops the device to read a predicate), while the rungs-0-1 fast pass has
    the rung-1 conditional; a head failing rung 0 escalates instead."""
    from certattn_jax.attention import certified_attention_fast

    k = jax.random.normal(jax.random.key(1), (1, 40, 2, 32))
    cache = TieredKVCache.from_dense(k, k, POLICY)
    q = jax.random.normal(jax.random.key(2), (1, 4, 32))

    def control_flow(jaxpr):
        found = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("cond", "while", "switch"):
                found.append(eqn.primitive.name)
            if eqn.primitive.name != "pallas_call":
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    found += control_flow(sub)
        return found

    for top, want in ((0, []), (1, ["cond"])):
        jaxpr = jax.make_jaxpr(lambda q, c, top=top: certified_attention_fast(q, c, POLICY, top))(q, cache).jaxpr
        got = control_flow(jaxpr)
        assert (got == want) if not want else ("cond" in got), (top, got)
    strict = dataclasses.replace(POLICY, eps=0.0, abs_tol=0.0)  # no head passes rung 0
    *_, escalate = jax.jit(lambda q, c: certified_attention_fast(q, c, strict, 0))(q, cache)
    assert bool(np.all(np.asarray(escalate)))


def test_the_straight_fast_pass_answers_with_rung_0_whatever_the_certificate():
    """A fast pass of rung 0 alone returns rung 0's output for every head: with a tolerance no head meets (every
    sequence escalates, the output is discarded by the caller) the output is the same as with one every head
    meets, so the output never waits for the bound (on a GPU the bound's launches stay off the chain to the next
    layer); the certificates still tell the two apart."""
    from certattn_jax.attention import certified_attention, certified_attention_fast

    rng = np.random.default_rng(7)
    k = jnp.asarray(rng.normal(size=(2, 150, 2, 32)), jnp.float32)
    cache = TieredKVCache.from_dense(k, k[..., ::-1] * 2, POLICY)
    q = jnp.asarray(rng.normal(size=(2, 4, 32)) * 2, jnp.bfloat16)
    lax_policy = dataclasses.replace(POLICY, eps=1e9)
    strict = dataclasses.replace(POLICY, eps=0.0, abs_tol=0.0)
    out_ok, cert_ok, _, esc_ok = certified_attention_fast(q, cache, lax_policy, 0)
    out_strict, cert_strict, _, esc_strict = certified_attention_fast(q, cache, strict, 0)
    assert not np.any(np.asarray(esc_ok)) and np.all(np.asarray(esc_strict))
    assert np.all(np.asarray(cert_ok.rung) == 0) and np.all(np.asarray(cert_strict.rung) == 3)
    np.testing.assert_array_equal(np.asarray(out_strict, np.float32), np.asarray(out_ok, np.float32))
    # and where it is clear, that output is the full ladder's
    out_run, _ = certified_attention(q, cache, lax_policy)
    np.testing.assert_array_equal(np.asarray(out_ok, np.float32), np.asarray(out_run, np.float32))


@pytest.mark.parametrize("top_rung", [0, 1])
def test_a_fast_pass_marks_exactly_its_escalated_heads_rung_3(top_rung):
    """`TieredModelCache.needs_slow_path` reads escalation from the certificates: a sequence escalates out of the fast
    pass exactly when one of its heads has rung 3 there (tolerances from none passing to all passing, and a batch
    whose sequences differ)."""
    from certattn_jax.attention import certified_attention_fast

    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.normal(size=(2, 150, 2, 32)) * np.array([1.0, 8.0])[:, None, None, None], jnp.float32)
    cache = TieredKVCache.from_dense(k, k[..., ::-1], POLICY)
    q = jnp.asarray(rng.normal(size=(2, 4, 32)) * 3, jnp.float32)
    seen = set()
    for eps in (0.0, 1e-4, 1e-2, 0.05, 1e9):
        policy = dataclasses.replace(POLICY, eps=eps)
        _, cert, _, escalate = certified_attention_fast(q, cache, policy, top_rung)
        rung3 = np.any(np.asarray(cert.rung) == 3, axis=-1)
        np.testing.assert_array_equal(np.asarray(escalate), rung3, err_msg=f"eps {eps}")
        assert set(np.unique(np.asarray(cert.rung)).tolist()) <= {0, 1, 3}
        seen |= set(np.asarray(escalate).tolist())
    assert seen == {False, True}


def test_the_end_of_a_step_holds_one_conditional_and_still_flushes():
    """`TieredModelCache.with_lengths` (after the last layer of every step) puts the rare hot-set application and
    the flush under one outer conditional (one host round trip per step on a GPU, was two); inside its branch
    each runs only when needed. A step that fills the residual block still flushes it into tier 1 + tier 2."""
    spec = cache_spec("certified", CFG, jnp.float32, POLICY)
    Bk = POLICY.block_size
    k = jax.random.normal(jax.random.key(3), (1, Bk - 1, CFG.num_kv_heads, CFG.head_dim))
    staging = spec.staging(1, 4 * Bk)
    staging = DenseKVCache(k=tuple(c.at[:, :, :Bk - 1].set(jnp.moveaxis(k, 1, 2)) for c in staging.k),
                           v=tuple(c.at[:, :, :Bk - 1].set(jnp.moveaxis(k, 1, 2)) for c in staging.v),
                           lengths=jnp.array([Bk - 1], jnp.int32), attn_impl=staging.attn_impl)
    cache = spec.from_staging(staging)

    def top_level_conds(c):
        jaxpr = jax.make_jaxpr(lambda c: c.with_lengths(c.lengths + 1))(c).jaxpr
        outer = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
        inner = [s for e in outer for sub in jax.extend.core.jaxprs_in_params(e.params)
                 for s in sub.eqns if s.primitive.name == "cond"]
        return len(outer), len(inner)

    assert top_level_conds(cache) == (1, 2)
    # the token that fills the block: write it into every layer's residual, then end the step
    tok = jax.random.normal(jax.random.key(4), (1, 1, CFG.num_kv_heads, CFG.head_dim))
    for layer in range(CFG.num_layers):
        view = cache.layer_view(layer)
        cache = cache.with_layer(layer, view.write_token(tok, tok), view)
    done = jax.jit(lambda c: c.with_lengths(c.lengths + 1))(cache)
    assert int(done.store.flushed[0, 0]) == Bk and int(done.lengths[0]) == Bk
    host_k = np.asarray(tiers.to_device(done.store.host_k))
    want = np.concatenate([np.asarray(jnp.moveaxis(k, 1, 2)), np.asarray(jnp.moveaxis(tok, 1, 2))], axis=2)
    for layer in range(CFG.num_layers):  # host_k [L, B, H, nb, Bk, d]: block 0 of every layer holds the tokens
        np.testing.assert_array_equal(host_k[layer, 0, :, 0], want[0])
    assert int(cache.store.flushed[0, 0]) == 0  # the cache before the step ended is unchanged (functional)
    # the flush leaves the value statistics a step reads as its new running maxima give them
    st = done.store
    cols = bounds.value_statistics(st.v_min, st.v_max, st.v_err_max, st.v_scale_max, st.v_zero_max, st.block_size,
                                   st.value_bits)
    np.testing.assert_array_equal(np.asarray(st.value_stats), np.asarray(jnp.stack(cols, axis=-1)))
    assert float(jnp.max(st.v_err_max)) > 0  # (the flushed block's error reached them)


def test_the_straight_looped_fast_pass_is_a_loop_without_conditionals(params, monkeypatch):
    """The "straight-looped" schedule's first pass: one loop over layers (the attention compiled once) whose body
    holds no cond or switch -- the weights come from a stacked copy by index -- while the "looped" schedule's
    body has the rung-1 conditional and the weight switch. Only the step's own conditionals (the slow pass, the
    end-of-step refresh and flush) remain outside it."""
    def control_flow(jaxpr, inside_loop=False):
        found = []
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            loop = name in ("while", "scan")  # a fori_loop of static trip count traces to a scan
            if name == "cond" or loop:
                found.append(("loop" if loop else name, inside_loop))
            if name != "pallas_call":
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    found += control_flow(sub, inside_loop or loop)
        return found

    monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 1 << 40)  # small layers (a GPU's)

    def first_pass(schedule):
        cache = cache_spec("certified", CFG, jnp.float32, POLICY, schedule=schedule)(1, 64)
        fast = cache.decode_fast_path()
        x = jnp.zeros((1, 1, CFG.hidden_size), jnp.float32)
        cos, sin = llama.rope_cos_sin(CFG, jnp.zeros((1, 1), jnp.int32))
        layers = {"looped": llama._layers_looped, "straight-looped": llama._layers_looped_stacked}[schedule]
        jaxpr = jax.make_jaxpr(lambda p, c: layers(p, CFG, x, c, cos, sin, jnp.ones((1,), jnp.int32)))(params, fast)
        return control_flow(jaxpr.jaxpr)

    straight = first_pass("straight-looped")
    assert straight == [("loop", False)], straight
    looped = first_pass("looped")
    assert ("cond", True) in looped, looped


def test_layers_per_iteration_of_the_rung0_pass_change_nothing_but_the_loop(params, monkeypatch):
    """CERTATTN_LAYER_UNROLL=k (`llama.LAYER_UNROLL`): the rung-0 first pass's loop over layers runs k layers per
    iteration (fewer host-driven iterations on a GPU). 3 layers at 2 per iteration (a remainder) and at 5 (more
    than there are): the same hidden state and cache, leaf for leaf, as one layer per iteration, and still one
    loop with no conditional in it."""
    monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 1 << 40)  # small layers (a GPU's)
    cfg = dataclasses.replace(CFG, num_layers=3)
    p = llama.init_params(cfg, jax.random.key(3), jnp.float32)
    cache = cache_spec("certified", cfg, jnp.float32, POLICY, schedule="straight-looped")(1, 64)
    p = llama.params_for_decoding(p, cache)
    rng = np.random.default_rng(8)
    _, cache = jax.jit(lambda p, t, c: llama.forward(p, cfg, t, c))(
        p, jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 40)), jnp.int32), cache)
    x = jnp.asarray(rng.normal(size=(1, 1, cfg.hidden_size)), jnp.float32)
    cos, sin = llama.rope_cos_sin(cfg, jnp.full((1, 1), 40, jnp.int32))

    def first_pass(p, c):
        return llama._layers_looped_stacked(p, cfg, x, c.decode_fast_path(0), cos, sin, jnp.full((1,), 41, jnp.int32))

    results = {}
    for k in (1, 2, 5):
        monkeypatch.setattr(llama, "LAYER_UNROLL", k)
        # a fresh function per k: the setting is read while tracing, and jit's cache would keep the first trace
        results[k] = jax.jit(functools.partial(first_pass))(p, cache)
        loops = [e for e in jax.make_jaxpr(functools.partial(first_pass))(p, cache).jaxpr.eqns
                 if e.primitive.name in ("scan", "while")]
        assert len(loops) == 1 and loops[0].params.get("unroll") == min(k, 3), loops[0].params.get("unroll")
        assert not any(e.primitive.name == "cond" for e in loops[0].params["jaxpr"].jaxpr.eqns)
    for k in (2, 5):
        for a, b in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[k]), strict=True):
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6, atol=1e-7,
                                       err_msg=f"{k} layers per iteration")
    assert float(jnp.max(jnp.abs(results[1][0]))) > 0


_SLICE_PASS_THROUGH = {"squeeze", "reshape", "convert_element_type", "copy", "copy_p", "bitcast_convert_type",
                       "expand_dims", "broadcast_in_dim"}


def _kernel_inputs_sliced_from_stacks(jaxpr, layers: int) -> tuple[list, list]:
    """(kernels, sliced): the pallas_call names in a jaxpr (calls inlined), and (kernel, input shape) for every
    kernel input that is, up to reshapes and casts, a dynamic slice of an array with a leading axis of `layers`
    (a model's stacked cache): on a GPU XLA copies such a slice before the launch."""
    kernels, sliced = [], []

    def walk(jx, labels):
        labels = dict(labels)
        for e in jx.eqns:
            ins = [labels.get(v) if isinstance(v, jax.extend.core.Var) else None for v in e.invars]
            name = e.primitive.name
            if name == "pallas_call":
                kernel = str(e.params.get("name") or e.params.get("name_and_src_info") or "?").split()[0]
                kernels.append(kernel)
                sliced.extend((kernel, tuple(v.aval.shape)) for v, lab in zip(e.invars, ins, strict=True) if lab)
            elif name == "dynamic_slice" and e.invars[0].aval.ndim >= 2 and e.invars[0].aval.shape[0] == layers:
                labels[e.outvars[0]] = True
            elif name in _SLICE_PASS_THROUGH and ins and ins[0]:
                labels[e.outvars[0]] = True
            elif name in ("jit", "pjit", "closed_call"):
                inner = e.params.get("jaxpr") or e.params.get("call_jaxpr")
                inner = getattr(inner, "jaxpr", inner)
                outs = walk(inner, {iv: lab for iv, lab in zip(inner.invars, ins, strict=True) if lab})
                labels.update({o: True for o, lab in zip(e.outvars, outs, strict=True) if lab})
            else:
                for sub in jax.extend.core.jaxprs_in_params(e.params):
                    walk(sub, {})
        return [labels.get(v) if isinstance(v, jax.extend.core.Var) else None for v in jx.outvars]

    walk(jaxpr, {})
    return kernels, sliced


def _rows_read_and_written_back(jaxpr, layers: int) -> list:
    """Shapes of the stacked arrays ([layers, ...]) that a jaxpr (calls inlined, conditionals' branches skipped:
    the rare rungs) updates with a dynamic-update-slice computed from a dynamic slice of the same array: a row read,
    modified and written back. On a GPU XLA cannot fuse that slice into the in-place update, so it is a copy launch
    of its own per layer-step (an async dynamic-slice pair, which also keeps the loop over layers out of one CUDA
    graph)."""
    found = []

    def walk(jx, ids, taint):
        ids, taint = dict(ids), dict(taint)  # var -> id of the array it is; var -> ids of the rows it reads
        for v in jx.invars:
            ids.setdefault(v, v)
        for e in jx.eqns:
            vin = [v for v in e.invars if isinstance(v, jax.extend.core.Var)]
            name = e.primitive.name
            if name in ("jit", "pjit", "closed_call"):
                inner = e.params.get("jaxpr") or e.params.get("call_jaxpr")
                inner = getattr(inner, "jaxpr", inner)
                pairs = [(iv, ov) for iv, ov in zip(inner.invars, e.invars, strict=True)
                         if isinstance(ov, jax.extend.core.Var)]
                outs = walk(inner, {iv: ids.get(ov, ov) for iv, ov in pairs},
                            {iv: taint[ov] for iv, ov in pairs if ov in taint})
                taint.update({o: t for o, t in zip(e.outvars, outs, strict=True) if t})
                continue
            if name == "cond":
                continue
            if name in ("while", "scan"):
                for sub in jax.extend.core.jaxprs_in_params(e.params):
                    walk(sub, {}, {})
                continue
            t = frozenset().union(*(taint.get(v, frozenset()) for v in vin))
            if name == "dynamic_slice" and vin and vin[0].aval.ndim >= 2 and vin[0].aval.shape[0] == layers:
                t = t | {ids.get(vin[0], vin[0])}
            if name == "dynamic_update_slice" and e.invars[0].aval.shape[0] == layers:
                target = ids.get(e.invars[0], e.invars[0])
                if target in taint.get(e.invars[1], frozenset()):
                    found.append(tuple(e.invars[0].aval.shape))
            for o in e.outvars:
                if t:
                    taint[o] = t
        return [taint.get(v, frozenset()) if isinstance(v, jax.extend.core.Var) else frozenset() for v in jx.outvars]

    walk(jaxpr, {}, {})
    return found


def test_the_kernels_of_a_rung0_layer_step_read_the_stacked_cache_in_place(params, monkeypatch):
    """The rung-0 pass's loop body hands no kernel a slice of a stacked cache array (token write, tier-1 pass,
    certify): on a GPU each such slice is an extra copy launch per layer-step whose loop-dependent offset keeps
    XLA from taking the loop over layers into one CUDA graph (docs/performance.md, twenty-fourth session)."""
    from certattn_jax import cache as cache_module

    monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 1 << 40)
    monkeypatch.setattr(cache_module, "WRITE_KERNEL", True)
    cfg = dataclasses.replace(CFG, num_layers=3)
    p = llama.init_params(cfg, jax.random.key(3), jnp.float32)
    policy = dataclasses.replace(POLICY, tier1="pallas", rung0="fused")
    cache = cache_spec("certified", cfg, jnp.float32, policy, schedule="straight-looped")(1, 64)
    p = llama.params_for_decoding(p, cache)
    x = jnp.zeros((1, 1, cfg.hidden_size), jnp.float32)
    cos, sin = llama.rope_cos_sin(cfg, jnp.zeros((1, 1), jnp.int32))
    jaxpr = jax.make_jaxpr(lambda p, c: llama._layers_looped_stacked(p, cfg, x, c.decode_fast_path(0), cos, sin,
                                                                     jnp.ones((1,), jnp.int32)))(p, cache)
    kernels, sliced = _kernel_inputs_sliced_from_stacks(jaxpr.jaxpr, cfg.num_layers)
    assert sorted(set(kernels)) == ["certattn_certify_rung0", "certattn_tier1_pass", "certattn_write_token"], kernels
    assert sliced == [], sliced
    # nor, with CERTATTN_HOT_USED_STACKED=1, does it read a stacked array's row to write it back; by default the
    # LRU record of the hot slots is that one row (`TieredKVCache.with_hot_used_marked`)
    assert _rows_read_and_written_back(jaxpr.jaxpr, cfg.num_layers) == [cache.store.hot_used.shape]
    monkeypatch.setattr(cache_module, "HOT_USED_STACKED", True)
    jaxpr = jax.make_jaxpr(lambda p, c: llama._layers_looped_stacked(p, cfg, x, c.decode_fast_path(0), cos, sin,
                                                                     jnp.ones((1,), jnp.int32)))(p, cache)
    assert _rows_read_and_written_back(jaxpr.jaxpr, cfg.num_layers) == []


@pytest.mark.parametrize("weights", ["auto", "stacked", "switch", "kernel"])
def test_small_layers_reach_the_looped_body_without_a_conditional(params, monkeypatch, weights):
    """Small layers on a GPU (below COPY_WEIGHTS_BELOW_BYTES): `params_for_decoding` adds the stacked weights for a
    certified cache of any schedule, and the looped fast pass reads row i by index, so its body holds one
    conditional (rung 1) instead of two (the weight switch too, each a host round trip on the GPU);
    CERTATTN_LOOPED_WEIGHTS=switch keeps the switch; =kernel reads them stacked too, the GEMMs by the stacked-weight
    kernel; "auto" (the default) is "kernel" where the kernel compiles (a GPU) and "stacked" where it is
    interpreted (here). Not for naive caches (no loop over layers)."""
    monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 1 << 40)
    monkeypatch.setattr(llama, "_LOOPED_WEIGHTS", weights)
    if weights == "auto":
        monkeypatch.setattr(llama.pallas_backend, "interpret", lambda: False)
        assert llama.looped_weights(params) == "kernel"  # small layers, compiled kernel
        monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 0)
        assert llama.looped_weights(params) == "stacked"  # large layers keep their per-layer switch
        monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 1 << 40)
        monkeypatch.setattr(llama.pallas_backend, "interpret", lambda: True)
        assert llama.looped_weights(params) == "stacked"  # interpreted: the copied rows
        assert llama.looped_weights() == "auto"
    cache = cache_spec("certified", CFG, jnp.float32, POLICY, schedule="looped")(1, 64)
    p = llama.params_for_decoding(params, cache)
    assert (llama.STACKED_LAYERS in p) == (weights in ("auto", "stacked", "kernel"))
    naive = cache_spec("naive", CFG, jnp.float32, POLICY)(1, 64)
    assert llama.params_for_decoding(params, naive) is params
    x = jnp.zeros((1, 1, CFG.hidden_size), jnp.float32)
    cos, sin = llama.rope_cos_sin(CFG, jnp.zeros((1, 1), jnp.int32))
    jaxpr = jax.make_jaxpr(lambda p, c: llama._layers_looped(p, CFG, x, c, cos, sin, jnp.ones((1,), jnp.int32)))(
        p, cache.decode_fast_path())

    def conds_in_loop_body(jaxpr):  # conditionals directly in the loop's body (not those nested in rung 1's)
        (loop,) = [e for e in jaxpr.eqns if e.primitive.name in ("while", "scan")]
        (body,) = jax.extend.core.jaxprs_in_params(loop.params)
        return sum(e.primitive.name == "cond" for e in body.eqns)

    assert conds_in_loop_body(jaxpr.jaxpr) == (2 if weights == "switch" else 1)
    assert ("certattn_stacked_matmul" in str(jaxpr)) == (weights == "kernel")


@pytest.mark.parametrize("schedule", ["looped", "adaptive"])
def test_the_stacked_weight_kernel_decodes_like_the_copied_rows(params, monkeypatch, schedule):
    """CERTATTN_LOOPED_WEIGHTS=kernel: the looped and adaptive schedules' GEMMs read row i of the stacked weights in
    place (`pallas_kernels.stacked_matmul`, interpreted here) at any layer size -- large layers too get the stacked copy
    and lose their per-layer weight switch -- and decode like the rows copied out by index: the same tokens, rungs,
    K* and ranking checks, bounds within float32 reassociation (only the GEMMs' summation order differs)."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (70, 21)]  # tier-1 blocks, a ragged batch

    def run(weights):
        monkeypatch.setattr(llama, "_LOOPED_WEIGHTS", weights)
        monkeypatch.setattr(gen, "_COMPILED", {})  # the compiled loops do not know the module constant
        return gen.generate(params, CFG, prompts, 5, cache_factory=cache_spec("certified", CFG, jnp.float32, POLICY,
                                                                              schedule=schedule),
                            eos_token_ids=(), progress=False, prefill_chunk=32, record_steps=True)

    monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 0)  # every layer counts as large
    large = cache_spec("certified", CFG, jnp.float32, POLICY, schedule=schedule)(1, 64)
    monkeypatch.setattr(llama, "_LOOPED_WEIGHTS", "kernel")
    assert llama.STACKED_LAYERS in llama.params_for_decoding(params, large)
    kernel = run("kernel")
    monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 1 << 40)
    copied = run("stacked")
    assert kernel.tokens == copied.tokens
    for field in ("rung", "k_star", "certified", "ranking_ok"):
        np.testing.assert_array_equal(getattr(kernel.step_records, field), getattr(copied.step_records, field),
                                      err_msg=field)
    np.testing.assert_allclose(kernel.step_records.error_bound, copied.step_records.error_bound, rtol=1e-4)


def test_stacked_weights_are_built_once_outside_the_step(params, monkeypatch):
    """With `with_stacked_layers` (what `generate` does for "straight-looped"), the step reads the stacked copy and
    stacks nothing itself; without it, the step stacks the weights on every call (a copy of all of them), and
    both give the same hidden states. Large layers (8B-sized; any on the CPU) are never stacked: they run in place,
    in per-layer switch branches."""
    monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 0)  # large layers (the CPU's)
    large = llama.params_for_decoding(params, cache_spec("certified", CFG, jnp.float32, POLICY,
                                                         schedule="straight-looped")(1, 64))
    assert large is params  # every layer counts as large: nothing stacked
    monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 1 << 40)  # small layers (a GPU's)
    cache = cache_spec("certified", CFG, jnp.float32, POLICY, schedule="straight-looped")(1, 64)
    fast = cache.decode_fast_path()
    x = jax.random.normal(jax.random.key(3), (1, 1, CFG.hidden_size), jnp.float32)
    cos, sin = llama.rope_cos_sin(CFG, jnp.zeros((1, 1), jnp.int32))

    def step(p, c):
        return llama._layers_looped_stacked(p, CFG, x, c, cos, sin, jnp.ones((1,), jnp.int32))[0]

    def concatenates(jaxpr, in_loop=False):  # outside the loop over layers
        n = 0
        for e in jaxpr.eqns:
            n += e.primitive.name in ("concatenate", "stack") and not in_loop
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                n += concatenates(sub, in_loop or e.primitive.name in ("scan", "while"))
        return n

    def stacks(p):
        return concatenates(jax.make_jaxpr(step)(p, fast).jaxpr)

    stacked = llama.with_stacked_layers(params)
    assert llama.with_stacked_layers(stacked) is stacked
    assert llama.STACKED_LAYERS in llama.params_for_decoding(params, cache)  # what generate and the eval do
    looped = cache_spec("certified", CFG, jnp.float32, POLICY, schedule="looped")(1, 64)
    monkeypatch.setattr(llama, "_LOOPED_WEIGHTS", "switch")
    assert llama.params_for_decoding(params, looped) is params
    assert stacks(params) == len(params["layers"][0]) and stacks(stacked) == 0
    run = jax.jit(step)
    np.testing.assert_array_equal(np.asarray(run(stacked, fast)), np.asarray(run(params, fast)))


def test_the_default_schedule_is_resolved_per_backend_when_the_cache_is_built(monkeypatch):
    """"auto" (the default) becomes the backend's measured schedule in the built cache (so compiled loops and
    benchmarks see a concrete one); a concrete name stays; an unknown one is refused when the spec is made."""
    backend = jax.default_backend()
    monkeypatch.setitem(model_cache.SMALL_LAYER_BYTES, backend, 1 << 40)  # small layers (a GPU's SmolLM2)
    assert cache_spec("certified", CFG, jnp.float32, POLICY)(1, 64).schedule == \
        model_cache.AUTO_SCHEDULE.get(backend, "looped")
    monkeypatch.setitem(model_cache.AUTO_SCHEDULE, backend, "straight-looped")
    assert cache_spec("certified", CFG, jnp.float32, POLICY)(1, 64).schedule == "straight-looped"
    # large layers (the 8B shape on a GPU): "auto" is "looped" whatever the backend's choice for small ones; a
    # schedule asked for by name stays
    monkeypatch.setitem(model_cache.SMALL_LAYER_BYTES, backend, 1)
    assert cache_spec("certified", CFG, jnp.float32, POLICY)(1, 64).schedule == "looped"
    assert cache_spec("certified", CFG, jnp.float32, POLICY, schedule="adaptive")(1, 64).schedule == "adaptive"
    # the size it goes by is the layer's weights as the model holds them
    p = llama.init_params(CFG, jax.random.key(0), jnp.bfloat16)
    held = sum(w.size * w.dtype.itemsize for w in jax.tree.leaves(p["layers"][0]))
    assert model_cache.layer_weight_bytes(CFG, jnp.bfloat16) == held
    assert cache_spec("certified", CFG, jnp.float32, POLICY, schedule="two-pass")(1, 64).schedule == "two-pass"
    with pytest.raises(ValueError, match="unknown layer schedule 'fastest'"):
        cache_spec("certified", CFG, jnp.float32, POLICY, schedule="fastest")


def test_the_adaptive_schedule_picks_its_first_pass_from_the_last_certificates():
    """"adaptive" runs the rung-0 fast pass only after `adaptive_rung0_streak()` decode steps in a row where every
    head answered at rung 0, and the rungs-0-1 fast pass otherwise (on a fresh cache too); a step where some head
    of some layer needed rung 1 or more starts the count again, and each second pass is counted."""
    from certattn_jax.certificate import PACKED_FIELDS

    cache = cache_spec("certified", CFG, jnp.float32, POLICY, schedule="adaptive")(2, 64)
    assert not bool(cache.left_rung0_last_step()) and bool(cache.wants_rung1_pass())
    assert cache.decode_fast_path().fast_top_rung == 1 and cache.decode_fast_path(0).fast_top_rung == 0
    rung = PACKED_FIELDS.index("rung")
    for value, want in ((0.0, False), (1.0, True), (4.0, True)):
        c = cache.replace(cert_packed=cache.cert_packed.at[1, 1, 3, rung].set(value))
        assert bool(c.left_rung0_last_step()) == want, value
    n = model_cache.adaptive_rung0_streak()
    above = cache.cert_packed.at[0, 0, 0, rung].set(1.0)
    c = cache
    for step in range(n):
        assert bool(c.wants_rung1_pass()), step
        c = c.decode_fast_path().fast_path_done()
        assert int(c.rung0_streak) == step + 1
    assert not bool(c.wants_rung1_pass())
    c = c.replace(cert_packed=above).slow_path_done()  # a step that needed rung 1, answered by the second pass
    assert int(c.rung0_streak) == 0 and int(c.slow_steps) == 1 and bool(c.wants_rung1_pass())
    straight = cache_spec("certified", CFG, jnp.float32, POLICY, schedule="straight-looped")(1, 64)
    assert straight.decode_fast_path().fast_top_rung == 0
    done = straight.decode_fast_path().fast_path_done()
    assert jax.tree.structure(done) == jax.tree.structure(straight)  # the conditional's branches must agree


@pytest.mark.parametrize("raw, want", [("", 4), (" 7 ", 7), ("abc", None), ("0", None), ("-1", None)])
def test_a_numeric_setting_from_the_environment_is_checked_by_name(monkeypatch, raw, want):
    monkeypatch.setenv("CERTATTN_SOME_SETTING", raw)
    if want is None:
        with pytest.raises(ValueError, match="CERTATTN_SOME_SETTING.*positive integer"):
            model_cache.positive_int_from_env("CERTATTN_SOME_SETTING", 4)
    else:
        assert model_cache.positive_int_from_env("CERTATTN_SOME_SETTING", 4) == want


@pytest.mark.parametrize("raw, want", [("", 0), ("0", 0), (" 12 ", 12), ("1.5", None), ("abc", None), ("-3", None)])
def test_an_optional_size_from_the_environment_is_checked_by_name(monkeypatch, raw, want):
    """minimum=0 settings (CERTATTN_FETCH_WHOLE_BELOW, CERTATTN_FETCH_UNROLL: 0 = off): a float, a word or a
    negative number is named, not an int() traceback nor silently accepted."""
    monkeypatch.setenv("CERTATTN_SOME_SIZE", raw)
    if want is None:
        with pytest.raises(ValueError, match="CERTATTN_SOME_SIZE.*integer >= 0"):
            model_cache.positive_int_from_env("CERTATTN_SOME_SIZE", 0, minimum=0)
    else:
        assert model_cache.positive_int_from_env("CERTATTN_SOME_SIZE", 0, minimum=0) == want


@pytest.mark.parametrize("raw, want", [("1", True), ("on", True), ("yes", True), ("0", False), ("off", False),
                                       ("false", False), ("no", False), ("auto", None), ("", None),
                                       ("bogus", "error")])
def test_the_interpret_switch_reads_off_as_off(monkeypatch, raw, want):
    """CERTATTN_PALLAS_INTERPRET=off used to turn interpret mode ON (anything but 0/false/no did): it reads as every
    other switch now, and an unknown value is named."""
    from pallas_kernels import backend

    monkeypatch.setenv("CERTATTN_PALLAS_INTERPRET", raw)
    if want == "error":
        with pytest.raises(ValueError, match="CERTATTN_PALLAS_INTERPRET"):
            backend.interpret()
    else:
        assert backend.interpret() == (jax.default_backend() != "gpu" if want is None else want)


def test_a_block_larger_than_the_context_is_refused():
    """A block size past the model's context could never fill, and the capacity rounding alone asked for a cache
    of that many tokens per sequence (--block-size 1048576 was killed for memory)."""
    small = dataclasses.replace(CFG, max_position_embeddings=256)
    with pytest.raises(ValueError, match="block size 512 exceeds the model's context of 256 tokens.*at most 256"):
        cache_spec("certified", small, jnp.float32, POLICY.replace(block_size=512))
    cache_spec("dense", small, jnp.float32, POLICY.replace(block_size=512))  # dense has no blocks
    cache_spec("naive", small, jnp.float32, POLICY.replace(block_size=256))


def test_the_staging_cache_converts_a_layer_at_a_time_to_what_one_program_gives():
    """`CacheSpec.from_staging` converts eagerly one layer per call of one jitted program
    (`TieredKVCache.stacked_from_layers`), written in place into
    a preallocated stacked cache (no stacked copy of the staging cache, no layer loop for XLA to hoist a float32
    copy of every layer out of: 66.6 GiB at the 8B shape, 32K, batch 8 on the H200). It must give exactly what
    the one-program conversion gives: every leaf, tier 2 in pinned host memory, the same pytree (no recompile)."""
    ks = jax.random.split(jax.random.key(5), 6)
    L, B, H, S, d = 3, 2, 2, 64, 32
    dense = DenseKVCache(k=tuple(jax.random.normal(ks[i], (B, H, S, d), jnp.bfloat16) for i in range(L)),
                         v=tuple(jax.random.normal(ks[3 + i], (B, H, S, d), jnp.bfloat16) for i in range(L)),
                         lengths=jnp.array([40, 23], jnp.int32), attn_impl="einsum")
    kw = dict(num_q_heads=4, mode="certified", schedule="looped")
    by_layer = model_cache._convert(dense, POLICY, **kw)  # what from_staging runs
    one = jax.jit(lambda d: TieredModelCache.from_dense(d, policy=POLICY, **kw))(dense)  # traced: one program
    assert jax.tree.structure(by_layer) == jax.tree.structure(one)
    for x, y in zip(jax.tree.leaves(by_layer), jax.tree.leaves(one), strict=True):
        assert (x.dtype, x.shape, x.committed) == (y.dtype, y.shape, y.committed)  # same jit keys: no recompile
        np.testing.assert_array_equal(np.asarray(tiers.to_device(x)), np.asarray(tiers.to_device(y)))
    assert by_layer.store.host_k.sharding.memory_kind == one.store.host_k.sharding.memory_kind
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        model_cache._convert(dense, POLICY, num_q_heads=3, mode="certified", schedule="looped")
    with pytest.raises(ValueError, match="layer 1 holds"):
        TieredKVCache.stacked_from_layers(dense.k[:1] + (dense.k[1][:, :, :32],), dense.v[:2], dense.lengths, POLICY)
    assert not dense.k[0].is_deleted()  # the staging cache is read, not donated


@pytest.mark.parametrize("mode", ["certified", "naive"])
def test_the_token_write_kernel_leaves_what_xla_writes_leave(params, mode, monkeypatch):
    """A model cache's decode step with its token written by `pallas_kernels.write_token` (one launch per layer-step,
    in place; interpret mode here, forced on) against XLA's updates: the same logits, certificates and cache, bit
    for bit, over steps that fill and flush the residual block; the kernel really ran, once per layer-step."""
    from certattn_jax import cache as cache_module
    from pallas_kernels import write_token as kernel

    calls = []
    real = kernel.write_token
    monkeypatch.setattr(kernel, "write_token", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rng = np.random.default_rng(4)
    B, T = 2, 27
    kv = [(jnp.asarray(rng.normal(size=(B, T, 2, 32)), jnp.float32),
           jnp.asarray(rng.normal(size=(B, T, 2, 32)) + 1, jnp.float32)) for _ in range(CFG.num_layers)]
    lengths = jnp.asarray([T, T - 9], jnp.int32)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(B, 12)), jnp.int32)
    runs = {}
    for by_kernel in (False, True):
        monkeypatch.setattr(cache_module, "WRITE_KERNEL", by_kernel)
        calls.clear()
        layers = [TieredKVCache.from_dense(k, v, POLICY, capacity=64, lengths=lengths) for k, v in kv]
        cache = TieredModelCache.from_layers(layers, num_q_heads=CFG.num_heads, policy=POLICY, mode=mode)
        step = jax.jit(lambda p, tok, c: llama.forward(p, CFG, tok, c))
        logits = []
        for t in range(tokens.shape[1]):  # 12 steps: the longer row's residual fills and flushes
            out, cache = step(params, tokens[:, t:t + 1], cache)
            logits.append(np.asarray(out))
        assert bool(calls) == by_kernel
        runs[by_kernel] = (np.stack(logits), cache)
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    with_kernel, with_xla = (jax.tree.leaves_with_path(runs[b][1].replace(policy=None)) for b in (True, False))
    for (path, a), (_, b) in zip(with_kernel, with_xla, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    assert np.asarray(runs[True][1].store.flushed[0]).tolist() == [32, 16]  # the first row crossed a block boundary


@pytest.mark.parametrize("schedule,want", [("looped", 1), ("two-pass", CFG.num_layers + 1), ("straight-looped", 1),
                                           ("adaptive", 2)])
def test_a_common_decode_step_asks_one_conditional_after_its_first_pass(params, schedule, want):
    """A certified decode step's conditionals at its top level (each a host round trip on a GPU): the second pass
    and the end-of-step maintenance (pending hot-set blocks, a full residual) share one, whose taken branch asks
    each of them again; "adaptive" also picks its first pass, "two-pass" unrolls its first pass's rung-1
    conditionals, one per layer. (One more each before.)"""
    cache = cache_spec("certified", CFG, jnp.float32, POLICY, schedule=schedule)(1, 64)
    tok = jnp.zeros((1, 1), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda c: llama.forward(params, CFG, tok, c))(cache).jaxpr
    assert sum(e.primitive.name == "cond" for e in jaxpr.eqns) == want


@pytest.mark.parametrize("raw,want", [("1", True), ("on", True), ("0", False), ("off", False), ("auto", None),
                                      ("", None)])
def test_a_kernel_switch_from_the_environment_is_checked_by_name(monkeypatch, raw, want):
    from certattn_jax.env import switch_from_env

    monkeypatch.setenv("CERTATTN_SOME_KERNEL", raw)
    assert switch_from_env("CERTATTN_SOME_KERNEL") is want
    monkeypatch.setenv("CERTATTN_SOME_KERNEL", "maybe")
    with pytest.raises(ValueError, match="CERTATTN_SOME_KERNEL='maybe'"):
        switch_from_env("CERTATTN_SOME_KERNEL")


@pytest.mark.xdist_group("layer-schedules")
@pytest.mark.parametrize("schedule,stacked_lru", [("adaptive", False), ("straight-looped", False),
                                                  ("adaptive", True)])
def test_the_nested_decode_loop_decodes_like_the_plain_one(params, schedule, stacked_lru, monkeypatch, request):
    """`models.generate`'s "nested" loop (an inner loop of first passes that leaves rare steps -- an escalating
    head, a flush, pending hot-set blocks -- to the plain step, undoing their first pass) decodes exactly what the
    plain loop decodes: the same tokens, certificates and cache, over steps that escalate (the hot set starts
    empty) and cross block boundaries (flushes); also with the layer views recording their hot slots' use in the
    whole stack (CERTATTN_HOT_USED_STACKED: the undo must restore the stacked LRU record too)."""
    from certattn_jax import cache as cache_module

    if stacked_lru:  # read while tracing: traces kept from other tests must not answer
        monkeypatch.setattr(cache_module, "HOT_USED_STACKED", True)
        jax.clear_caches()
        request.addfinalizer(jax.clear_caches)  # nor must this test's traces answer later ones
    policy = dataclasses.replace(POLICY, eps=0.05, abs_tol=0.0)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (70, 21)]
    kw = dict(eos_token_ids=(), progress=False, prefill_chunk=32, record_steps=True, temperature=0.7, seed=3)
    if schedule == "adaptive":  # both first passes of "adaptive" within a few steps
        monkeypatch.setattr(model_cache, "_ADAPTIVE_RUNG0_STREAK", 2)

    def run(nested):
        monkeypatch.setenv("CERTATTN_DECODE_LOOP_NESTED", "1" if nested else "0")
        return gen.generate(params, CFG, prompts, 20, cache_factory=cache_spec(
            "certified", CFG, jnp.float32, policy, schedule=schedule), **kw)

    plain, nested = run(False), run(True)
    assert gen.decode_loop_kind(nested.cache) == "nested" and gen.decode_loop_kind(
        nested.cache.replace(schedule="looped")) == "plain"  # a rung-1 first pass may refresh the hot set
    rungs = np.asarray(plain.step_records.rung)
    assert np.any(rungs >= 1) and np.any(rungs.reshape(rungs.shape[0], -1).max(axis=1) == 0)  # rare and common
    assert nested.tokens == plain.tokens and nested.num_steps == plain.num_steps
    for field in ("rung", "k_star", "certified", "ranking_ok"):
        np.testing.assert_array_equal(getattr(nested.step_records, field), getattr(plain.step_records, field),
                                      err_msg=field)
    np.testing.assert_allclose(nested.step_records.error_bound, plain.step_records.error_bound, rtol=1e-6)
    for name in ("lengths", "rung0_streak", "slow_steps"):
        np.testing.assert_array_equal(getattr(nested.cache, name), getattr(plain.cache, name), err_msg=name)
    for name in ("lengths", "flushed", "res_k", "res_v", "k_codes", "v_codes", "hot_ids", "hot_used", "value_stats"):
        np.testing.assert_array_equal(np.asarray(getattr(nested.cache.store, name)),
                                      np.asarray(getattr(plain.cache.store, name)), err_msg=name)
    if schedule == "adaptive":  # an EOS that ends one sequence early (the other goes on): the same again
        kw["eos_token_ids"] = (plain.tokens[0][6],)
        plain, nested = run(False), run(True)
        assert nested.tokens == plain.tokens and nested.finished == plain.finished
        assert len(plain.tokens[0]) <= 6 and nested.num_steps == plain.num_steps


def test_the_nested_decode_loop_asks_no_conditional_on_a_common_step(params, monkeypatch):
    """The nested loop's inner loop (one common step per iteration) holds no conditional for the straight
    schedule with small layers (their weights read stacked, as on a GPU; the step's rare paths are asked by the
    inner loop's own predicate); the plain loop's step holds them."""
    from models import generate as g

    monkeypatch.setitem(llama.COPY_WEIGHTS_BELOW_BYTES, jax.default_backend(), 1 << 40)  # small layers here

    cache = gen.prefill(params, CFG, [[1, 2, 3]], 256, cache_factory=cache_spec(
        "certified", CFG, jnp.float32, POLICY, schedule="straight-looped"), progress=False)[0]
    args = (llama.params_for_decoding(params, cache), cache, jnp.zeros((1, CFG.vocab_size)), jnp.int32(4),
            jnp.asarray((-2,), jnp.int32), jax.random.key(0), jnp.float32(0), jnp.float32(1))

    def loop_bodies(loop):
        fn = functools.partial(g.decode_loop, config=CFG, greedy=True, record=False, loop=loop)
        return [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "while"]

    def conds(jaxpr):
        found = 0
        for eqn in jaxpr.eqns:
            found += eqn.primitive.name == "cond"
            if eqn.primitive.name != "pallas_call":
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    found += conds(sub)
        return found

    (plain,) = loop_bodies("plain")
    assert conds(plain.params["body_jaxpr"].jaxpr) >= 1
    (outer,) = loop_bodies("nested")
    first_passes, plain_steps = [e for e in outer.params["body_jaxpr"].jaxpr.eqns if e.primitive.name == "while"]
    assert conds(first_passes.params["body_jaxpr"].jaxpr) == 0
    assert conds(plain_steps.params["body_jaxpr"].jaxpr) >= 1  # the plain step, for the steps the first left


def test_decode_first_pass_refuses_what_it_cannot_undo(params):
    """`llama.decode_first_pass` serves one token per sequence with a certified cache whose first pass is rung 0
    alone; anything else is a clear error, not a step that could not be undone."""
    def cache(schedule, mode="certified"):
        return gen.prefill(params, CFG, [[1, 2, 3]], 256, cache_factory=cache_spec(
            mode, CFG, jnp.float32, POLICY, schedule=schedule), progress=False)[0]

    tok = jnp.asarray([[4]], jnp.int32)
    for c in (cache("looped"), cache("unrolled"), cache("adaptive", "naive")):
        with pytest.raises(ValueError, match="rung-0 first pass"):
            llama.decode_first_pass(params, CFG, tok, c)
    with pytest.raises(ValueError, match="one token per sequence"):
        llama.decode_first_pass(params, CFG, jnp.asarray([[4, 5]], jnp.int32), cache("straight-looped"))
    hidden, c, redo = llama.decode_first_pass(params, CFG, tok, cache("straight-looped"))  # eagerly, too
    assert hidden.shape == (1, 1, CFG.hidden_size) and redo.shape == () and int(c.lengths[0]) in (3, 4)


@pytest.mark.parametrize("schedule", ["looped", "adaptive"])
def test_a_looped_certified_step_runs_eagerly_like_jitted(params, schedule):
    """A decode step through a looped schedule called outside jit (a user trying the model eagerly) runs, and
    gives what the jitted step gives. (The capacity check read a value computed inside the traced loop body and
    failed with a ConcretizationTypeError.)"""
    c = gen.prefill(params, CFG, [[1, 2, 3]], 256, cache_factory=cache_spec(
        "certified", CFG, jnp.float32, POLICY, schedule=schedule), progress=False)[0]
    tok = jnp.asarray([[4]], jnp.int32)
    h, c_eager = llama.forward_hidden(params, CFG, tok, c)
    h_jit, c_jit = jax.jit(lambda p, t, c: llama.forward_hidden(p, CFG, t, c))(params, tok, c)
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_jit), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(c_eager.lengths), np.asarray(c_jit.lengths))
    with pytest.raises(ValueError, match="KV cache overflow"):
        llama.forward_hidden(params, CFG, jnp.ones((1, 254), jnp.int32), c)


def _fresh_bridge_state(monkeypatch) -> None:
    """Empty program tables for a bridge test, after every build an earlier test queued on the one background
    compile thread has finished: a late build stores into the module's tables as they are when it ends, so it
    would land in this test's."""
    gen._BACKGROUND.submit(lambda: None).result()
    for name in ("_COMPILED", "_BRIDGE_COMPILED", "_PENDING", "_DEFERRED"):
        monkeypatch.setattr(gen, name, {})


def _one_prompt_bridge_case(schedule: str) -> tuple[list, dict]:
    """A 70-token prompt and generate's keywords for a certified cache of `schedule` (eps 0.5: some steps
    escalate), for the bridge's failure tests."""
    policy = dataclasses.replace(POLICY, eps=0.5, abs_tol=0.0)
    prompts = [np.random.default_rng(8).integers(0, CFG.vocab_size, 70).tolist()]
    return prompts, dict(eos_token_ids=(), progress=False, prefill_chunk=32,
                         cache_factory=cache_spec("certified", CFG, jnp.float32, policy, schedule=schedule))


def _loops(jaxpr) -> int:
    """while / scan equations in a jaxpr, nested ones included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name in ("while", "scan")
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _loops(inner)
    return n


@pytest.mark.parametrize("schedule", ["adaptive", "looped"])
def test_the_unrolled_first_pass_holds_no_loop_over_layers(params, schedule, monkeypatch):
    """CERTATTN_FIRST_PASS_UNROLLED: the decode bridge's rung-0 first pass is straight-line code (on a GPU every
    iteration of a loop over layers is a host round trip); without it, one loop over the layers."""
    cache = cache_spec("certified", CFG, jnp.float32, POLICY, schedule=schedule)(1, 128)
    _, cache = llama.forward_hidden(params, CFG, jnp.ones((1, 40), jnp.int32), cache)
    tok = jnp.ones((1, 1), jnp.int32)

    def loops(unrolled):
        monkeypatch.setattr(llama, "_FIRST_PASS_UNROLLED", "1" if unrolled else "0")
        return _loops(jax.make_jaxpr(lambda p, t, c: llama.decode_first_pass(p, CFG, t, c, rung0=True))(
            params, tok, cache).jaxpr)

    assert loops(False) == 1
    assert loops(True) == 0


def test_auto_unrolls_the_first_pass_only_where_the_loop_would_switch_per_layer(params, monkeypatch):
    """CERTATTN_FIRST_PASS_UNROLLED=auto: "background" (the unrolled first pass built beside the looped one) for
    large layers on a GPU, whose looped pass reaches each layer's weights through a switch (a host round trip per
    layer); "0" for small layers (stacked weights read in the loop), with the stacked-weight kernel, on the CPU, and
    without params."""
    monkeypatch.setattr(llama, "_FIRST_PASS_UNROLLED", "auto")
    assert llama.first_pass_mode(params) == "0"  # the CPU
    assert llama.first_pass_mode() == "0"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(llama.pallas_backend, "interpret", lambda: False)
    small = llama._nbytes(params["layers"][0]) + 1
    for weights, below, mode in [("auto", {"gpu": small}, "0"), ("auto", {"gpu": 1}, "background"),
                                 ("stacked", {"gpu": 1}, "background"), ("kernel", {"gpu": 1}, "0")]:
        monkeypatch.setattr(llama, "_LOOPED_WEIGHTS", weights)
        monkeypatch.setattr(llama, "COPY_WEIGHTS_BELOW_BYTES", below)
        assert llama.first_pass_mode(params) == mode, (weights, below)
    monkeypatch.setattr(llama, "_FIRST_PASS_UNROLLED", "0")
    assert llama.first_pass_mode(params) == "0"  # an explicit choice stands


@pytest.mark.xdist_group("layer-schedules")
@pytest.mark.parametrize("schedule,eps,steady,background,unrolled", [
    ("looped", 0.05, False, True, "0"), ("adaptive", 0.05, False, True, "0"), ("two-pass", 0.05, False, True, "0"),
    ("looped", 0.5, False, True, "0"), ("adaptive", 0.5, False, True, "0"), ("looped", 0.5, True, True, "0"),
    ("adaptive", 0.05, True, True, "0"), ("looped", 0.5, True, False, "0"), ("straight-looped", 0.5, True, True, "0"),
    ("adaptive", 0.5, True, True, "1"), ("adaptive", 0.5, True, True, "background")])
def test_the_decode_bridge_decodes_like_the_plain_loop(params, schedule, eps, steady, background, unrolled,
                                                       monkeypatch):
    """`models.generate`'s decode bridge (rung-0 first passes while the whole loop compiles in the background,
    then the whole loop from the first step they cannot answer) decodes exactly what the one-program loop decodes:
    tokens, certificates and cache, over steps that escalate and flush; with the whole program not yet ready at
    the start (first passes, then the wait), and ready (a later call: the whole program alone). "looped" and
    "two-pass" answer rung 1 in their own fast pass: the bridge's rung-0 pass must leave those steps to it.
    eps 0.05: heads escalate from the first step (the hot set starts empty: the whole program from there); 0.5:
    the first passes answer the steps up to the first flush, the whole program the rest (rung 1 among them).
    steady (CERTATTN_DECODE_BRIDGE_STEADY): the first passes stay the loop, the whole program takes the runs of
    steps they leave. background off (CERTATTN_DECODE_BRIDGE_BACKGROUND=0): the whole program is built when first
    needed, in the decoding thread. unrolled (CERTATTN_FIRST_PASS_UNROLLED): "1" the first pass runs its layers
    unrolled whatever the schedule; "background" looped until the unrolled one has compiled beside the whole
    program (the host looks every UPGRADE_POLL_STEPS steps), then unrolled."""
    policy = dataclasses.replace(POLICY, eps=eps, abs_tol=0.0)
    monkeypatch.setattr(llama, "_FIRST_PASS_UNROLLED", unrolled)
    monkeypatch.setattr(gen, "UPGRADE_POLL_STEPS", 2)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (70, 21)]
    kw = dict(eos_token_ids=(), progress=False, prefill_chunk=32, record_steps=True, temperature=0.7, seed=3)
    if schedule == "adaptive":
        monkeypatch.setattr(model_cache, "_ADAPTIVE_RUNG0_STREAK", 2)
    spec = cache_spec("certified", CFG, jnp.float32, policy, schedule=schedule)
    monkeypatch.setattr(gen, "BRIDGE_STEADY", steady)
    monkeypatch.setattr(gen, "BRIDGE_BACKGROUND", background)
    _fresh_bridge_state(monkeypatch)

    monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", "0")
    plain = gen.generate(params, CFG, prompts, 20, cache_factory=spec, **kw)
    assert not gen.decode_bridge(plain.cache)
    monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", "1")
    assert gen.decode_bridge(plain.cache)
    called = []
    real_passes = gen.bridge_first_passes

    def counting_passes(*a, **k):
        called.append(True)
        return real_passes(*a, **k)

    monkeypatch.setattr(gen, "bridge_first_passes", counting_passes)
    whole_ready = gen.BridgedDecode.whole_program
    monkeypatch.setattr(gen.BridgedDecode, "whole_program", lambda self: None)  # not ready: the first passes run
    bridges = []
    real_call = gen.BridgedDecode.__call__
    monkeypatch.setattr(gen.BridgedDecode, "__call__", lambda self, *a: bridges.append(self) or real_call(self, *a))
    first = gen.generate(params, CFG, prompts, 20, cache_factory=spec, **kw)
    assert called, "the bridge's first-pass program was not built"
    if eps == 0.5:  # some steps answered by the first passes, the rest after
        assert 0 < bridges[-1].first_pass_steps < first.num_steps - 1
    whole_calls = []

    def counted_whole_program(self):
        full = whole_ready(self)
        return None if full is None else (lambda *a: whole_calls.append(True) or full(*a))

    monkeypatch.setattr(gen.BridgedDecode, "whole_program", counted_whole_program)
    if unrolled == "background":  # the unrolled passes built (in the background) before the later call
        gen.finish_background_compiles()
    later = gen.generate(params, CFG, prompts, 20, cache_factory=spec, **kw)  # whole program ready: alone

    rungs = np.asarray(plain.step_records.rung)
    assert np.any(rungs >= 1) and np.any(rungs.reshape(rungs.shape[0], -1).max(axis=1) == 0)  # rare and common
    def same(got, want):  # integers and flags bit for bit; floats to their rounding (separate programs may fuse
        got, want = np.asarray(got), np.asarray(want)  # a bound's sum differently: 1 ulp seen on the CPU)
        if np.issubdtype(want.dtype, np.floating) and unrolled != "0":
            # the unrolled pass's dense code is another program (GEMMs inline, not in per-layer branches): its
            # hidden states, hence K/V and bounds, differ from the loop's by float32 rounding (the bounds by ~2e-6
            # of their scale on the CPU); every integer (codes, rungs, K*, tokens) must still agree
            scale = float(np.max(np.abs(want), initial=0.0))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)
        elif np.issubdtype(want.dtype, np.floating):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
        else:
            np.testing.assert_array_equal(got, want)

    def assert_same(bridged, plain):  # tokens, flags, every record and every cache leaf (tier 2 included)
        assert bridged.tokens == plain.tokens and bridged.num_steps == plain.num_steps
        assert bridged.finished == plain.finished
        for got, want in zip(jax.tree.leaves(bridged.step_records), jax.tree.leaves(plain.step_records), strict=True):
            same(got, want)
        leaves, tree = jax.tree.flatten(bridged.cache)
        want_leaves, want_tree = jax.tree.flatten(plain.cache)
        assert tree == want_tree
        for got, want in zip(leaves, want_leaves, strict=True):
            same(got, want)
        assert bridged.cache.store.host_k.sharding.memory_kind == plain.cache.store.host_k.sharding.memory_kind

    for bridged in (first, later):
        assert_same(bridged, plain)
    assert later.compile_wait_seconds == 0.0
    if unrolled == "background":  # the later call found the unrolled passes ready and ran them
        assert bridges[-1].upgrade_sig in gen._COMPILED
        assert bridges[-1].unrolled_steps_from < 20
    if steady:  # the first passes answered the common steps after the rare ones too
        step_top = rungs.reshape(rungs.shape[0], -1).max(axis=1)
        assert bridges[-1].first_pass_steps > np.sum(step_top == 0) // 2
        # and the whole program took each run of escalating steps in one call, not one call per step
        assert np.any((step_top[1:] >= 1) & (step_top[:-1] >= 1))  # (a run of two or more here)
        assert 0 < len(whole_calls) < np.sum(step_top >= 1)
    if eps == 0.05 and steady:  # an EOS that ends one sequence early (the other goes on): the same again
        kw["eos_token_ids"] = (plain.tokens[0][6],)
        monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", "0")
        plain = gen.generate(params, CFG, prompts, 20, cache_factory=spec, **kw)
        monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", "1")
        bridged = gen.generate(params, CFG, prompts, 20, cache_factory=spec, **kw)
        assert len(plain.tokens[0]) <= 6 and plain.finished[0]
        assert_same(bridged, plain)


@pytest.mark.xdist_group("layer-schedules")
def test_auto_builds_the_unrolled_first_passes_where_the_loop_switches_weights(params, monkeypatch):
    """CERTATTN_FIRST_PASS_UNROLLED=auto in the decode bridge: where the looped first pass would switch per layer
    for its weights (`llama.loops_switch_weights`: large layers on a GPU), the unrolled first passes are built in
    the background; where it would not, they are not (the looped ones stay the loop)."""
    prompts, kw = _one_prompt_bridge_case("adaptive")
    monkeypatch.setattr(gen, "BRIDGE_STEADY", True)
    monkeypatch.setattr(llama, "_FIRST_PASS_UNROLLED", "auto")
    monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", "1")
    for switches in (False, True):
        _fresh_bridge_state(monkeypatch)
        monkeypatch.setattr(llama, "loops_switch_weights", lambda p, s=switches: s)
        gen.generate(params, CFG, prompts, 4, **kw)
        gen.finish_background_compiles()
        built = any(key[0] == "first_passes_unrolled" for key in gen._COMPILED)
        assert built == switches


@pytest.mark.xdist_group("layer-schedules")
def test_unrolled_first_passes_that_fail_to_build_leave_the_looped_ones(params, monkeypatch):
    """CERTATTN_FIRST_PASS_UNROLLED=background where the unrolled first passes never build: a warning, and the
    looped ones decode to the end (the host's looks at the step limit never turn into a wait: decoding finishes in
    bounded time) with the plain loop's tokens."""
    prompts, kw = _one_prompt_bridge_case("adaptive")
    _fresh_bridge_state(monkeypatch)
    monkeypatch.setattr(gen, "BRIDGE_STEADY", True)
    monkeypatch.setattr(gen, "UPGRADE_POLL_STEPS", 2)
    monkeypatch.setattr(llama, "_FIRST_PASS_UNROLLED", "background")
    monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", "0")
    plain = gen.generate(params, CFG, prompts, 20, **kw)
    monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", "1")
    real_build = gen._build

    def failing_build(fn, args, options, donate, seconds_prefix="", after_lowering=None):
        if seconds_prefix == "unrolled_":
            raise RuntimeError("injected compile failure")
        return real_build(fn, args, options, donate, seconds_prefix, after_lowering)

    monkeypatch.setattr(gen, "_build", failing_build)
    real_passes = gen.BridgedDecode._passes
    calls = []

    def counted_passes(self, step, max_new):  # a host loop that looks forever fails here instead of hanging
        calls.append(step)
        assert len(calls) < 100, "the bridge keeps looking for the unrolled first passes"
        return real_passes(self, step, max_new)

    monkeypatch.setattr(gen.BridgedDecode, "_passes", counted_passes)
    with pytest.warns(UserWarning, match="unrolled first passes did not build"):
        bridged = gen.generate(params, CFG, prompts, 20, **kw)
        gen.finish_background_compiles()
    assert bridged.tokens == plain.tokens
    assert not any(key[0] == "first_passes_unrolled" for key in gen._COMPILED)


def test_a_slow_unrolled_build_does_not_hold_up_decoding(params, monkeypatch):
    """CERTATTN_FIRST_PASS_UNROLLED=background while the unrolled first passes take long to build: decoding ends on
    the looped ones, looking for the unrolled ones every UPGRADE_POLL_STEPS steps, not at every call until they
    are ready (an independent review found the last step looping until then)."""
    prompts = [np.random.default_rng(8).integers(0, CFG.vocab_size, 21).tolist()]
    spec = cache_spec("certified", CFG, jnp.float32, dataclasses.replace(POLICY, eps=0.5, abs_tol=0.0),
                      schedule="adaptive")
    _fresh_bridge_state(monkeypatch)
    monkeypatch.setattr(model_cache, "_ADAPTIVE_RUNG0_STREAK", 2)
    monkeypatch.setattr(gen, "BRIDGE_STEADY", True)
    monkeypatch.setattr(gen, "UPGRADE_POLL_STEPS", 2)
    monkeypatch.setattr(llama, "_FIRST_PASS_UNROLLED", "background")
    monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", "1")
    real = gen.bridge_first_passes

    def slow_when_unrolled(*a, unrolled=None, **k):
        if unrolled:
            time.sleep(4.0)
        return real(*a, unrolled=unrolled, **k)

    monkeypatch.setattr(gen, "bridge_first_passes", slow_when_unrolled)
    polls = []
    real_passes = gen.BridgedDecode._passes
    monkeypatch.setattr(gen.BridgedDecode, "_passes",
                        lambda self, step, m: polls.append(step) or real_passes(self, step, m))
    out = gen.generate(params, CFG, prompts, 12, cache_factory=spec, eos_token_ids=(), progress=False,
                       prefill_chunk=32, temperature=0.7, seed=3)
    assert out.num_steps == 12
    assert len(polls) < 20, f"{len(polls)} first-pass calls, {polls.count(11)} of them at the last step"
    gen.finish_background_compiles()


def test_a_failed_whole_program_build_is_reported_with_the_cache_and_built_again(params, monkeypatch):
    """Where the decode bridge's whole program fails to build after its first passes decoded some steps, the
    error says so, chains the build's error and carries the cache as they left it (the argument cache was
    donated); the failed build is not kept: the next call builds it again and decodes like the plain loop. A
    cache whose policy prefetches hot-set blocks at rung 0 is not bridged (every first pass would be redone)."""
    prompts, kw = _one_prompt_bridge_case("looped")
    policy = kw["cache_factory"].policy
    _fresh_bridge_state(monkeypatch)
    monkeypatch.setattr(gen, "BRIDGE_STEADY", True)
    monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", "0")
    plain = gen.generate(params, CFG, prompts, 20, **kw)
    monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", "1")
    real_build = gen._build
    failures = []

    def failing_build(fn, args, options, donate, seconds_prefix="", after_lowering=None):
        if seconds_prefix == "full_" and not failures:
            failures.append(True)
            raise RuntimeError("injected compile failure")
        return real_build(fn, args, options, donate, seconds_prefix, after_lowering)

    monkeypatch.setattr(gen, "_build", failing_build)
    with pytest.raises(gen.DecodeBridgeError, match="failed to compile after") as info:
        gen.generate(params, CFG, prompts, 20, **kw)
    assert isinstance(info.value.__cause__, RuntimeError) and "injected" in str(info.value.__cause__)
    assert info.value.steps > 0 and int(info.value.cache.lengths[0]) == 70 + info.value.steps
    assert not gen._PENDING  # forgotten, not kept to fail the next call
    again = gen.generate(params, CFG, prompts, 20, **kw)
    assert again.tokens == plain.tokens and len(failures) == 1
    prefetch = cache_spec("certified", CFG, jnp.float32, dataclasses.replace(policy, hot_refresh="prefetch"),
                          schedule="looped")
    assert gen.decode_bridge(again.cache) and not gen.decode_bridge(prefetch(1, 128))


@pytest.mark.parametrize("mode", ["dense", "certified"])
def test_a_sequence_that_stops_early_stops_taking_tokens(params, mode, monkeypatch):
    """In a batch that decodes on after one sequence hit EOS, that sequence's cache row stays as it stopped: the
    returned cache holds its prompt and tokens (its length, residual and running value statistics as the batch-1
    run's), decoding can continue from it as from the batch-1 run's cache, and its step records after the stop are
    marked "no step" (rung -1), which `summarize` leaves out. (An audit found the row decoding on: 38 tokens held
    for 25 real ones, a continuation 5.6 logits off, and `summarize` pooling 240 head-steps for 136 live ones.)
    The certified case decodes through the bridge: rung-0 first passes, then the whole program after a flush."""
    from certattn_jax import summarize

    policy = dataclasses.replace(POLICY, eps=0.5, abs_tol=0.0)
    spec = cache_spec(mode, CFG, jnp.float32, policy) if mode != "dense" else "dense"
    if mode == "certified":
        _fresh_bridge_state(monkeypatch)
        monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", "1")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (23, 45)]
    kw = dict(progress=False, prefill_chunk=32, record_steps=True, cache_factory=spec, capacity=96)
    free = gen.generate(params, CFG, prompts, 16, eos_token_ids=(), **kw)
    at = next(i for i, t in enumerate(free.tokens[0])
              if i >= 2 and t not in free.tokens[1] and t not in free.tokens[0][:i])
    eos = free.tokens[0][at]
    out = gen.generate(params, CFG, prompts, 16, eos_token_ids=(eos,), **kw)
    alone = gen.generate(params, CFG, prompts[:1], 16, eos_token_ids=(eos,), **kw)
    assert out.tokens == [free.tokens[0][:at], free.tokens[1]] and alone.tokens == out.tokens[:1]
    assert out.finished == [True, False] and out.num_steps == 16
    lengths = np.asarray(out.cache.lengths)
    assert lengths.tolist() == [len(prompts[0]) + at, len(prompts[1]) + 15] == \
        [int(np.asarray(alone.cache.lengths)[0]), len(prompts[1]) + 15]
    if mode == "certified":  # the stopped row's running statistics: the batch-1 run's, not widened by later tokens
        for f in ("v_min", "v_max", "v_norm_max", "flushed", "nonfinite"):
            np.testing.assert_allclose(np.asarray(getattr(out.cache.store, f))[:, :1],
                                       np.asarray(getattr(alone.cache.store, f)), rtol=1e-5, atol=1e-6, err_msg=f)
        rung = np.asarray(out.step_records.rung)  # [steps - 1, L, B, Hq]
        assert np.all(rung[at:, :, 0] == -1) and np.all(rung[:at, :, 0] >= 0) and np.all(rung[:, :, 1] >= 0)
        assert np.all(np.isnan(np.asarray(out.step_records.error_bound)[at:, :, 0]))
        np.testing.assert_array_equal(rung[:at, :, :1], np.asarray(alone.step_records.rung))
        L, Hq = CFG.num_layers, CFG.num_heads
        s = summarize(out.step_records)
        assert s["heads"] == (at + 15) * L * Hq and s["stopped"] == (15 - at) * L * Hq
    # continuing: the stopped sequence takes its EOS next, as the batch-1 run's cache would
    fwd = jax.jit(llama.forward, static_argnums=1)
    logits, _ = fwd(params, CFG, jnp.asarray([[eos], [free.tokens[1][-1]]], jnp.int32), out.cache)
    want, _ = fwd(params, CFG, jnp.asarray([[eos]], jnp.int32), alone.cache)
    np.testing.assert_allclose(np.asarray(logits[0, -1]), np.asarray(want[0, -1]), rtol=1e-4, atol=1e-4)


def test_a_tiered_cache_refuses_to_rewind(params):
    """`with_lengths` only records growth: rewinding a certified cache (past a flushed block, an audit found, its
    logits came out 2-11 off with every head certified) raises outside jit and, inside jit, leaves the rewound
    sequence never certified again while the other is unaffected. Keeping the earlier cache value is the way back."""
    spec = cache_spec("certified", CFG, jnp.float32, POLICY)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (40, 37)]
    out = gen.generate(params, CFG, prompts, 4, eos_token_ids=(), progress=False, prefill_chunk=32,
                       cache_factory=spec, capacity=64)
    lengths = out.cache.lengths
    with pytest.raises(ValueError, match=r"cannot shrink.*sequence\(s\) \[1\]"):
        out.cache.with_lengths(lengths - jnp.asarray([0, 20]))
    same = out.cache.with_lengths(lengths)  # recording the lengths it has is no rewind
    assert not bool(jnp.any(same.store.nonfinite))
    step = jax.jit(lambda c, back: llama.forward(params, CFG, jnp.asarray([[1], [2]], jnp.int32),
                                                 c.with_lengths(c.lengths - back))[1].last_certificate)
    cert = step(out.cache, jnp.asarray([0, 20]))
    assert bool(jnp.all(cert.certified[:, 0])) and not bool(jnp.any(cert.certified[:, 1]))
    assert bool(jnp.all(jnp.isinf(cert.error_bound[:, 1])))
    # the marked sequence keeps its length: a length below `flushed` would put the next token's residual position
    # below the block (the write kernel, compiled, would then write outside the sequence's own rows)
    rewound = jax.jit(lambda c: c.with_lengths(c.lengths - jnp.asarray([0, 20])))(out.cache)
    np.testing.assert_array_equal(np.asarray(rewound.lengths), np.asarray(lengths))


def _alive(tree) -> bool:
    return not any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(tree))


def test_a_converted_cache_shares_no_array_with_what_it_came_from(params):
    """Decoding donates its cache: a converted cache must own its arrays. An audit found the policy's leaves shared
    with the policy passed in (`generate(..., policy=out.cache.policy)` deleted `out.cache.policy`) and the lengths
    shared with the staging cache (converting the same prefill again failed on a deleted array)."""
    prompt = [list(range(5, 28))]
    first = gen.generate(params, CFG, prompt, 4, cache_factory="certified", policy=POLICY, progress=False,
                         eos_token_ids=())
    again = gen.generate(params, CFG, prompt, 4, cache_factory="certified", policy=first.cache.policy,
                         progress=False, eos_token_ids=())
    assert again.tokens == first.tokens and _alive(first.cache)
    jax.jit(llama.forward, static_argnums=1, donate_argnums=3)(params, CFG, jnp.asarray([[1]], jnp.int32),
                                                              first.cache)  # first.cache (and its policy) donated
    with pytest.raises(ValueError, match="policy's arrays were donated"):
        gen.generate(params, CFG, prompt, 4, cache_factory="certified", policy=first.cache.policy, progress=False)
    fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)
    spec = cache_spec("certified", CFG, jnp.float32, POLICY)
    staging = spec.staging(2, 64)
    logits, staging = fwd(params, CFG, jnp.asarray([prompt[0][:20]] * 2, jnp.int32), staging)
    tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
    fwd(params, CFG, tok, spec.from_staging(staging))  # a donated step of the converted cache
    assert _alive(staging)
    naive = cache_spec("naive", CFG, jnp.float32, POLICY).from_staging(staging)  # the same prefill, another mode
    assert np.asarray(naive.lengths).tolist() == [20, 20]


@pytest.mark.parametrize("mode", ["dense", "certified", "naive"])
def test_a_cache_for_another_model_shape_is_refused(params, mode):
    """A cache built for fewer layers than the model was read at a clipped layer index (two layers sharing one
    cache: logits 2-5 off, no error); other shape mismatches failed with raw indexing or broadcasting errors. Now
    the model names the mismatch, eagerly and inside jit."""
    deeper = dataclasses.replace(CFG, num_layers=3)
    deep_params = llama.init_params(deeper, jax.random.key(1), jnp.float32, scale=0.3)
    cache = cache_spec(mode, CFG, jnp.float32, POLICY)(1, 32)
    tokens = jnp.asarray([[3, 4]], jnp.int32)
    with pytest.raises(ValueError, match=r"another model shape: layers 2 \(the model has 3\)"):
        llama.forward(deep_params, deeper, tokens, cache)
    with pytest.raises(ValueError, match="another model shape"):
        jax.jit(llama.forward, static_argnums=1)(deep_params, deeper, tokens, cache)
    wider = dataclasses.replace(CFG, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"KV heads 2 \(the model has 4\)"):
        llama.forward(llama.init_params(wider, jax.random.key(1), jnp.float32), wider, tokens, cache)


def test_tier2_out_of_host_memory_is_named_and_put_back(params):
    """A certified cache that went through pickle (or device_get / device_put, a generic checkpoint restore) comes
    back with tier 2 in device memory; decoding it failed deep in tracing ("memory_space of all inputs passed to
    dynamic_update_slice must be the same"). Now a clear error names it and `with_tier2_on_host` puts it back."""
    import pickle

    if tiers.host_memory_kind() is None:
        pytest.skip("this backend has no host memory space")
    out = gen.generate(params, CFG, [list(range(3, 30))], 3, cache_factory="certified", policy=POLICY,
                       progress=False, eos_token_ids=())
    tok = jnp.asarray([[out.tokens[0][-1]]], jnp.int32)
    want, _ = llama.forward(params, CFG, tok, out.cache)
    back = pickle.loads(pickle.dumps(out.cache))
    assert back.store.host_k.sharding.memory_kind != tiers.host_memory_kind()
    with pytest.raises(ValueError, match=r"tier 2 .* not in host memory.*with_tier2_on_host"):
        jax.jit(llama.forward, static_argnums=1)(params, CFG, tok, back)
    with pytest.raises(ValueError, match="with_tier2_on_host"):
        from certattn_jax import certified_attention
        certified_attention(jnp.ones((1, CFG.num_heads, CFG.head_dim)), back.layer_view(0), POLICY)
    home = back.with_tier2_on_host()
    assert home.store.host_k.sharding.memory_kind == tiers.host_memory_kind()
    got, _ = llama.forward(params, CFG, tok, home)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_factory_that_hands_back_a_consumed_cache_is_named(params):
    """generate consumes the cache its factory builds (prefill and decoding donate it): a factory returning one
    prebuilt cache worked once, then failed with XLA's "Buffer has been deleted or donated"; now it is named."""
    pre = cache_spec("dense", CFG, jnp.float32)(1, 64)
    kw = dict(cache_factory=lambda b, c: pre, progress=False, eos_token_ids=())
    gen.generate(params, CFG, [[5, 6, 7]], 3, **kw)
    with pytest.raises(ValueError, match="donated to an earlier call.*fresh one per call"):
        gen.generate(params, CFG, [[5, 6, 7]], 3, **kw)


def test_clear_compiled_drops_the_decode_programs(params, monkeypatch):
    """`models.generate.clear_compiled` (a long-lived process that goes through many models) empties the program
    tables and JAX's caches (counted here, not cleared: the rest of this worker's tests would compile again), and the
    next generate compiles again and decodes the same tokens."""
    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
    monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", "1")
    _fresh_bridge_state(monkeypatch)
    spec = cache_spec("certified", CFG, jnp.float32, POLICY)
    kw = dict(cache_factory=spec, progress=False, eos_token_ids=())
    first = gen.generate(params, CFG, [[5, 6, 7, 8]], 4, **kw)
    assert gen._COMPILED or gen._BRIDGE_COMPILED or gen._PENDING
    gen.clear_compiled()
    assert not (gen._COMPILED or gen._BRIDGE_COMPILED or gen._PENDING or gen._DEFERRED) and cleared
    again = gen.generate(params, CFG, [[5, 6, 7, 8]], 4, **kw)
    assert again.tokens == first.tokens and again.compile_seconds > 0


def test_one_layer_weight_in_another_dtype(params):
    """Mixed dtypes across layers: the dense path's unrolled layers take them; a loop over layers (the tiered
    caches' decode step) is refused by name (an audit met "switch branches must have equal output types")."""
    odd = {**params, "layers": [dict(layer) for layer in params["layers"]]}
    odd["layers"][1]["wk"] = odd["layers"][1]["wk"].astype(jnp.bfloat16)
    kw = dict(progress=False, eos_token_ids=())
    gen.generate(odd, CFG, [[5, 6, 7]], 3, **kw)  # dense: fine
    with pytest.raises(ValueError, match=r"'layers\.1\.wk' has dtype bfloat16 but 'layers\.0\.wk' has float32"):
        gen.generate(odd, CFG, [[5, 6, 7]], 3, cache_factory=cache_spec("certified", CFG, jnp.float32, POLICY), **kw)
