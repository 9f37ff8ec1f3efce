"""The fused rung-0 kernel (`pallas_kernels.certify_rung0`, interpret mode on CPU) against its reference, the
jnp path's rung 0 (`step.build_context` -> `ladder.select_and_promote` -> `step.evaluate_stage`), on fresh
random caches whose hot sets hold a random mix of blocks; and its own outputs against float64 attention.

Both sides read the same tier-1 partials (the policy's tier-1 pass), so the selection, the promoted slots,
K* and the ranking check must agree exactly, and the output and the bound terms to float32 rounding (the
kernel sums in another order). Interpret mode fills outputs with NaN first: a missing write shows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certattn_jax import ladder, step
from certattn_jax.cache import TieredKVCache
from certattn_jax.policy import CertPolicy
from pallas_kernels import backend
from tests.float64_reference import attention_f64

CASES = [
    # B, T (per sequence), H, G, d, Bk, K, dtype, peaked
    dict(B=2, T=(700, 455), H=2, G=3, d=64, Bk=64, K=8, dtype=jnp.bfloat16, peaked=True),  # G, nb padded
    dict(B=1, T=(512,), H=2, G=4, d=32, Bk=32, K=4, dtype=jnp.float32, peaked=False),  # no residual tokens
    dict(B=3, T=(40, 300, 129), H=1, G=2, d=32, Bk=64, K=4, dtype=jnp.bfloat16, peaked=True),  # T < one block
    # more hot slots than k_max (rung 1's widened set kept resident): k_max 3 pads the candidate loop's vector
    dict(B=1, T=(900,), H=2, G=2, d=32, Bk=32, K=8, dtype=jnp.float32, peaked=True, k_max=3, hot_needles=True),
    dict(B=2, T=(520, 333), H=1, G=4, d=64, Bk=32, K=4, dtype=jnp.bfloat16, peaked=True, k_max=1, hot_needles=True),
    # many blocks (65 and 46, ragged; several chunks of the kernel's passes when the chunk width is small)
    dict(B=2, T=(2100, 1500), H=1, G=4, d=32, Bk=32, K=8, dtype=jnp.float32, peaked=True, hot_needles=True),
    # every key the same: every block's estimated mass ties, across chunks too (ties go to the lower block id)
    dict(B=1, T=(1200,), H=2, G=2, d=32, Bk=32, K=4, dtype=jnp.float32, peaked=False, flat=True),
]


def _cache(seed, B, T, H, G, d, Bk, K, dtype, peaked, k_max=None, hot_needles=False, flat=False):
    """A cache of fresh random keys/values (needle tokens aligned with the query when peaked), its hot set of K
    slots holding exact copies of random blocks (some slots empty; with hot_needles the needles' blocks first, in
    random slots, so that a small k_max still promotes some), and a query; k_max (default K) <= K."""
    rng = np.random.default_rng(seed)
    Tmax = max(T)
    policy = CertPolicy(tier1="pallas", block_size=Bk, group_size=min(32, d), k_max=k_max or K, hot_slots=K)
    k = (rng.normal(size=(B, Tmax, H, d)) * rng.uniform(0.5, 3.0, size=d)).astype(np.float32)
    v = (rng.normal(size=(B, Tmax, H, d)) + 1.0).astype(np.float32)
    if flat:
        k[:] = k[:1, :1]
    q = (rng.normal(size=(B, H * G, d)) * 1.5).astype(np.float32)
    needles = [rng.choice(T[b], size=min(4, T[b]), replace=False) if peaked else [] for b in range(B)]
    for b in range(B):
        for t in needles[b]:
            k[b, t] = q[b].reshape(H, G, d).mean(1) * 2.5
    kj, vj = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    cache = TieredKVCache.from_dense(kj, vj, policy, lengths=jnp.asarray(T, jnp.int32))
    nb = cache.num_blocks
    ids = np.full((B, H, K), -1, np.int32)
    for b in range(B):
        full = T[b] // Bk
        first = [n for n in dict.fromkeys(int(t) // Bk for t in needles[b]) if n < full] if hot_needles else []
        for h in range(H):
            pick = (first + [n for n in rng.permutation(full) if n not in first])[:max(K - 1, 1)]
            slots = rng.permutation(K)[:len(pick)] if hot_needles else np.arange(len(pick))
            ids[b, h, slots] = pick
    pad = nb * Bk - Tmax
    blocks = lambda x: jnp.pad(x, ((0, 0), (0, max(pad, 0)), (0, 0), (0, 0)))[:, :nb * Bk].reshape(  # noqa: E731
        B, nb, Bk, H, d).transpose(0, 3, 1, 2, 4)
    idj = jnp.asarray(ids)
    take = lambda x: jnp.take_along_axis(blocks(x), jnp.maximum(idj, 0)[..., None, None], axis=2)  # noqa: E731
    cache = cache.replace(hot_ids=idj, hot_k=take(kj).astype(cache.hot_k.dtype),
                          hot_v=take(vj).astype(cache.hot_v.dtype))
    return jnp.asarray(q, dtype), cache, policy, k, v


_BREADTH = pytest.mark.breadth  # more cases; every one runs compiled on the GPU (gpu_session.sh t1_tests)


@pytest.mark.parametrize("case,seed,layout,chunk", [
    (0, 0, "split", None), pytest.param(1, 0, "split", None, marks=_BREADTH),
    pytest.param(2, 0, "split", None, marks=_BREADTH), (3, 0, "split", None),
    pytest.param(4, 0, "split", None, marks=_BREADTH), pytest.param(0, 2, "block", None, marks=_BREADTH),
    (2, 3, "block", None), (0, 4, "jnp-tier1", None), (5, 6, "split", 16), (6, 8, "split", 16),
    # several blocks per split, as the product runs at long context (8B: 4 at 32K, 16 at 128K); these small
    # caches get 1 by default. 3 and 4 leave a ragged last split (65, 46, 10 and 7 blocks)
    (5, 9, "split/bps4", 16), (0, 10, "split/bps3", None), pytest.param(3, 11, "split/bps4", None, marks=_BREADTH),
    (4, 12, "split/bps16", None)])
def test_fused_rung0_matches_the_jnp_rung0(case, seed, layout, chunk, monkeypatch):
    """layout: "split" (the default: split accumulators with the hot blocks left out; "split/bpsN": N blocks per
    split), "block" (per-block value sums), "jnp-tier1" (the tier-1 partials from XLA, the certify kernel on its
    own: the inputs padded for it). chunk: the kernel's pass width in blocks (None: the default, one chunk for
    these sizes; 16: several)."""
    from pallas_kernels import certify_rung0, tier1_pass

    if chunk:
        monkeypatch.setattr(certify_rung0, "DEFAULT_CHUNK", chunk)
    layout, _, bps = layout.partition("/bps")
    if bps:
        monkeypatch.setattr(tier1_pass, "FAST_PASS_BPS", bps)
    q, cache, policy, k, v = _cache(seed, **CASES[case])
    if layout == "jnp-tier1":
        policy = dataclasses.replace(policy, tier1="jnp")
    ctx = step.build_context(q, cache, policy)
    sel = ladder.select_and_promote(ctx, cache, policy)
    ref = step.evaluate_stage(ctx, [sel.hot], q.dtype, policy)
    fused = jax.jit(functools.partial(step.rung0_fused, split=layout == "split"))(q, cache, policy)
    got = fused.stage
    if bps:  # the forced split size reached the launch (and E_num's chain term)
        items = step.fused_items(step.query_terms(q, cache), cache, policy, True)
        nb = cache.num_blocks
        assert items.chain == min(int(bps), nb) and items.apx.acc.shape[3] >= -(-nb // items.chain) > 1
    assert int(jnp.sum(sel.hot.active)) > 0 or case in (2, 6)  # the test promotes something
    np.testing.assert_array_equal(fused.active, sel.hot.active)
    np.testing.assert_array_equal(got.k_star, ref.k_star)
    np.testing.assert_array_equal(got.ranking_ok, ref.ranking_ok)
    out_g, out_r = np.asarray(got.out, np.float32), np.asarray(ref.out, np.float32)
    assert np.all(np.isfinite(out_g))
    ulp = 2.0 ** -7 if q.dtype == jnp.bfloat16 else 1e-5  # the cast may round the other way
    np.testing.assert_allclose(out_g, out_r, rtol=ulp, atol=1e-6)
    # compiled, E_num also counts the kernel's output division (Triton: div.full.f32), which the jnp path lacks
    extra = np.asarray(step.kernel_division_term(ctx.value_stats, cache.head_dim))[..., None]
    compiled = not backend.interpret()
    for name in ("e_key", "e_val") + (("e_num", "bound") if layout != "split" else ()):
        g = np.asarray(getattr(got, name)) - (extra if name in ("e_num", "bound") else 0)
        r = np.asarray(getattr(ref, name))
        if compiled and name in ("e_val", "bound"):
            # compiled, the kernel's block value errors carry the Triton division and sqrt margins
            # (bounds.block_value_errors): never smaller, a little larger where 1/l - 1/B cancels (H100: 1.7e-4
            # on case 6's flat blocks)
            assert np.all(g >= r * (1 - 2e-5)) and np.all(g <= r * (1 + 1e-3) + 1e-30), (name, g, r)
        else:
            np.testing.assert_allclose(g, r, rtol=2e-5, err_msg=name)
    if layout == "split":  # more roundings in the split merge: E_num can only grow, and not by much
        e_g, e_r = np.asarray(got.e_num), np.asarray(ref.e_num)
        assert np.all(e_g >= e_r * (1 - 2e-5)) and np.all(e_g <= 4 * e_r)
        b_g, b_r = np.asarray(got.bound), np.asarray(ref.bound)
        assert np.all(b_g >= b_r * (1 - 2e-5)) and np.all(b_g - b_r <= 3 * e_r + 1e-30)
    # the same XLA formula in two programs: a GPU may sum the value range's squares in another order (H200,
    # 2026-12-03: one ulp apart in case 4), so equal to float32 reassociation, not bit for bit
    np.testing.assert_allclose(fused.tolerance, ctx.tolerance, rtol=2.0 ** -20)
    np.testing.assert_array_equal(fused.bad, ctx.bad)
    # and the bound holds against float64 attention over what the cache stores (originals)
    T = np.asarray(cache.lengths)
    want = attention_f64(np.asarray(q, np.float32), np.asarray(jnp.asarray(k, q.dtype), np.float32),
                         np.asarray(jnp.asarray(v, q.dtype), np.float32), list(T))
    H, G = cache.num_kv_heads, q.shape[1] // cache.num_kv_heads
    err = np.linalg.norm(out_g.reshape(want.shape).astype(np.float64) - want, axis=-1)
    assert np.all(err <= np.asarray(got.bound).reshape(err.shape)), (err, got.bound)
    assert H * G == q.shape[1]


@pytest.mark.parametrize("case,seed,chunk,nan_head", [
    (0, 20, None, False), (3, 21, None, False), (4, 22, None, False), (5, 23, None, False), (6, 24, None, False),
    (6, 27, None, True), (0, 25, None, True), (5, 26, 16, False)])
def test_counted_selection_equals_the_loop(case, seed, chunk, nan_head, monkeypatch):
    """CERTATTN_RUNG0_SELECT=count (the candidates ranked by counting where one chunk holds every block column)
    gives the loop's picks, K*, promoted slots, output and bound terms bit for bit: k_max 3 of 8 slots, k_max 1,
    65 blocks (128 columns), every block tied (flat keys), a query head of NaNs (its masses never rank), and
    several chunks (where counting does not apply and the loop runs)."""
    from pallas_kernels import certify_rung0

    if chunk:
        monkeypatch.setattr(certify_rung0, "DEFAULT_CHUNK", chunk)
    q, cache, policy, _, _ = _cache(seed, **CASES[case])
    if nan_head:
        q = q.at[0, 1].set(jnp.nan)
    nbp = certify_rung0.padded_blocks(cache.num_blocks)
    assert certify_rung0.counts_picks(nbp, certify_rung0.tuning(nbp)[0], "count") == (chunk is None)
    results = {}
    for select in ("loop", "count"):
        monkeypatch.setattr(certify_rung0, "DEFAULT_SELECT", select)
        # a fresh function per choice: jit's cache would otherwise keep the first trace
        results[select] = jax.jit(functools.partial(step.rung0_fused))(q, cache, policy)
    loop, count = results["loop"], results["count"]
    assert int(jnp.max(loop.stage.k_star)) > 0 or nan_head or case == 6
    for name in ("stage", "active", "tolerance", "bad"):
        a, b = jax.tree.leaves(getattr(loop, name)), jax.tree.leaves(getattr(count, name))
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            # as float32 (exact for bf16): numpy's NaN-aware equality does not know bfloat16, so a NaN head's
            # NaN output (the same NaNs in both, H100 2026-12-06d) would count as a mismatch
            x, y = np.asarray(x), np.asarray(y)
            if jnp.issubdtype(x.dtype, jnp.floating):
                x, y = x.astype(np.float32), y.astype(np.float32)
            np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("case,seed,select", [(0, 30, "count"), (4, 31, "count"), (6, 32, "loop"), (5, 33, "count")])
def test_the_single_chunk_form_equals_the_general_one(case, seed, select, monkeypatch):
    """Where one chunk holds every block column the kernel loads the block statistics once, runs its passes
    straight-line and takes the hot slots' columns from the loaded tiles (`certify_rung0.SINGLE_CHUNK`): the same
    outputs, bounds and selection as the general form (loops over chunks, a load per pass and per slot), bit for
    bit, with the counted and the looped selection, a flat case (every block tied) among them. (Bit for bit under
    the suite's XLA flags, tests/conftest.py: with XLA:CPU's optimizations on, the straight-line passes may be
    fused into another rounding, 1 ulp seen; the same float operations either way. Compiled by Triton the two forms
    are two programs whose float operations the compiler may contract (a*b + c into one fused multiply-add, one
    rounding instead of two): on an H100 one stage value of 12 differed by 1 ulp, thirty-sixth session. There the
    floats must agree within 2^-21 relative (4 to 8 ulp), integers and selections exactly. Each form is covered
    by the rounding analysis on its own (docs/bounds.md section 10: a contraction only removes a rounding).)"""
    from pallas_kernels import certify_rung0

    monkeypatch.setattr(certify_rung0, "DEFAULT_SELECT", select)
    q, cache, policy, _, _ = _cache(seed, **CASES[case])
    results = {}
    for single in (False, True):
        monkeypatch.setattr(certify_rung0, "SINGLE_CHUNK", single)
        results[single] = jax.jit(functools.partial(step.rung0_fused))(q, cache, policy)
    assert int(jnp.max(results[True].stage.k_star)) > 0 or case == 6
    for name in ("stage", "active", "tolerance", "bad"):
        a, b = jax.tree.leaves(getattr(results[False], name)), jax.tree.leaves(getattr(results[True], name))
        for x, y in zip(a, b, strict=True):
            x, y = np.asarray(x), np.asarray(y)
            if jnp.issubdtype(x.dtype, jnp.floating):
                x, y = x.astype(np.float32), y.astype(np.float32)
                if jax.default_backend() != "cpu":  # compiled: the forms' contractions may differ (docstring)
                    np.testing.assert_allclose(x, y, rtol=2.0**-21, atol=0, err_msg=name)
                    continue
            np.testing.assert_array_equal(x, y, err_msg=name)


def test_counted_selection_choice_is_checked():
    from pallas_kernels import certify_rung0

    assert not certify_rung0.counts_picks(256, 256, "count")  # beyond the pairwise pass's columns
    assert not certify_rung0.counts_picks(64, 32, "count")  # two chunks
    assert certify_rung0.counts_picks(64, 256, "count") and not certify_rung0.counts_picks(64, 256, "loop")
    import os
    import subprocess
    import sys
    from pathlib import Path

    bad = subprocess.run([sys.executable, "-c", "import pallas_kernels.certify_rung0"], capture_output=True,
                         text=True, env={**os.environ, "CERTATTN_RUNG0_SELECT": "fast", "JAX_PLATFORMS": "cpu"},
                         cwd=Path(__file__).resolve().parents[1])
    assert bad.returncode != 0 and "CERTATTN_RUNG0_SELECT='fast'" in bad.stderr


@pytest.mark.parametrize("case,seed,chunk", [(0, 0, None), (5, 6, 16)])
def test_the_compiled_kernels_block_value_error_margins(case, seed, chunk, monkeypatch):
    """The certify kernel evaluates the blocks' value errors itself (`bounds.block_value_errors` on each chunk of
    its bound pass); compiled, with the margins of Triton's division and sqrt. Run here with those margins
    (`triton_margins=True`, interpreted): E_val never below the unmargined kernel's and within ~2^-18 of it (the
    margins are tiny), everything else unchanged, and the bound still holds against float64 attention."""
    from pallas_kernels import certify_rung0

    if not backend.interpret():
        pytest.skip("a compiled kernel always carries the margins (no unmargined run to compare with)")
    if chunk:
        monkeypatch.setattr(certify_rung0, "DEFAULT_CHUNK", chunk)
    q, cache, policy, k, v = _cache(seed, **CASES[case])
    plain = jax.jit(step.rung0_fused)(q, cache, policy).stage
    monkeypatch.setattr(certify_rung0, "certify_rung0",
                        functools.partial(certify_rung0.certify_rung0, triton_margins=True))
    got = jax.jit(functools.partial(step.rung0_fused))(q, cache, policy).stage  # a new function: traced again
    e_g, e_p = np.asarray(got.e_val, np.float64), np.asarray(plain.e_val, np.float64)
    assert np.all(e_g >= e_p) and np.all(e_g <= e_p * (1 + 2.0 ** -18)), (e_g, e_p)
    assert np.any(e_g > e_p)  # the margins reached the kernel
    for name in ("out", "e_key", "k_star", "ranking_ok"):
        np.testing.assert_array_equal(getattr(got, name), getattr(plain, name), err_msg=name)
    T = np.asarray(cache.lengths)
    want = attention_f64(np.asarray(q, np.float32), np.asarray(jnp.asarray(k, q.dtype), np.float32),
                         np.asarray(jnp.asarray(v, q.dtype), np.float32), list(T))
    err = np.linalg.norm(np.asarray(got.out, np.float64).reshape(want.shape) - want, axis=-1)
    assert np.all(err <= np.asarray(got.bound).reshape(err.shape))


def test_fused_rung0_tolerances_do_not_recompile():
    """tau_cov and rank_margin are traced policy leaves: a new value reuses the compiled kernel."""
    q, cache, policy, _, _ = _cache(3, **CASES[1])
    f = jax.jit(step.rung0_fused)
    a = f(q, cache, policy)
    compiled = f._cache_size()  # the jit cache is shared with the other tests' calls of the same function
    b = f(q, cache, dataclasses.replace(policy, tau_cov=0.5, rank_margin=2.0))
    assert f._cache_size() == compiled
    assert int(jnp.sum(b.active)) <= int(jnp.sum(a.active))  # a lower coverage target promotes no more


@pytest.mark.parametrize("case,select", [(0, "loop"), (1, "loop"), (3, "loop"), (4, "loop"), (0, "count"),
                                         (5, "count")])
def test_fused_rung0_lowers_to_triton(case, select, monkeypatch):
    """Cross-lower the compiled kernel for CUDA on this CPU machine (the Pallas -> Triton-IR lowering, no GPU):
    catches unsupported primitives and mistyped operations before a GPU run (both candidate selections; 65
    blocks: the counted selection's pairwise pass over 128 columns)."""
    from pallas_kernels import certify_rung0

    monkeypatch.setenv("CERTATTN_PALLAS_INTERPRET", "0")
    monkeypatch.setattr(certify_rung0, "DEFAULT_SELECT", select)
    q, cache, policy, _, _ = _cache(5, **CASES[case])
    allow = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    f = jax.jit(functools.partial(step.rung0_fused))  # a fresh function: no trace kept from another selection
    text = jax.export.export(f, platforms=["cuda"], disabled_checks=allow)(q, cache, policy).mlir_module()
    assert "certattn_certify_rung0" in text or "xla.gpu.triton" in text


def test_compiled_kernels_fall_back_for_shapes_they_cannot_take(monkeypatch):
    """A compiled (Triton) kernel needs power-of-two sizes: for others the step uses the jnp computation of that
    part (and the jnp path's Delta), in interpret mode any size the kernel can walk runs through the kernels."""
    from pallas_kernels import tier1_pass

    def cache_with(d, k_max):
        pol = CertPolicy(tier1="pallas", rung0="fused", block_size=16, group_size=16, k_max=k_max)
        kv = jnp.zeros((1, 40, 1, d), jnp.float32)
        return TieredKVCache.from_dense(kv, kv, pol)

    monkeypatch.setenv("CERTATTN_PALLAS_INTERPRET", "0")
    assert step.tier1_kernel_runs(cache_with(64, 4), "pallas") and step.fused_supported(cache_with(64, 4))
    assert not step.tier1_kernel_runs(cache_with(48, 4), "pallas")
    assert not step.fused_supported(cache_with(64, 3)) and not step.fused_supported(cache_with(48, 4))
    assert not step.tier1_kernel_runs(cache_with(64, 4), "jnp")
    monkeypatch.setenv("CERTATTN_PALLAS_INTERPRET", "1")
    assert step.tier1_kernel_runs(cache_with(96, 4), "pallas") and step.fused_supported(cache_with(48, 3))
    # except where the kernel cannot walk the value packing (planar 4-bit: 24 bytes per row of 48 channels do not
    # split into groups of 16), which no interpret mode changes
    assert not step.tier1_kernel_runs(cache_with(48, 4), "pallas") or not tier1_pass.cache_values_planar()


def _float_divisions_in_kernels(jaxpr) -> list[str]:
    """The float divisions inside the Pallas kernels of a jaxpr (walking every sub-jaxpr): each one's operands."""
    found = []

    def walk(jx, in_kernel):
        for eqn in jx.eqns:
            if in_kernel and eqn.primitive.name == "div" and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
                found.append(" / ".join(str(v.aval) for v in eqn.invars))
            inner = in_kernel or eqn.primitive.name == "pallas_call"
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub, inner)

    walk(jaxpr.jaxpr, False)
    return found


def test_the_kernels_divide_only_where_the_bound_counts_triton_s_approximate_division():
    """Triton compiles a float32 `/` to PTX div.full.f32 (<= 2 ulp, not IEEE): the tier-1 pass divides nowhere
    (its Delta multiplies by a rounded-up 1/sqrt(d): `bounds._inv_sqrt_up`), and the certify kernel only in its
    output (E_num adds `bounds.approx_division_error` when compiled), in the TV bound's x / (1 - y) (its
    margin widened by `bounds.APPROX_DIV_ERROR`) and in the blocks' value errors' 1 / l (compiled:
    `bounds.block_value_errors(div_error=APPROX_DIV_ERROR)`). A new division in a kernel fails here until it is
    counted."""
    q, cache, policy, _, _ = _cache(0, **CASES[0])
    jaxpr = jax.make_jaxpr(lambda q, c: step.rung0_fused(q, c, policy).stage)(q, cache)
    found = _float_divisions_in_kernels(jaxpr)
    assert len(found) == 3, found  # out = num / denom, TV's weighted sum, and 1 / l of the block value errors
    # the Delta constants: never below 1 / sqrt(d)
    from certattn_jax import bounds

    for d in (32, 64, 96, 128, 256):
        assert bounds._inv_sqrt_up(d) >= 1 / np.sqrt(np.float64(d)) and np.float32(bounds._inv_sqrt_up(d)) == \
            bounds._inv_sqrt_up(d)
    # the E_num term: zero where the kernel is interpreted (XLA's correctly rounded division), else positive
    from pallas_kernels import backend

    v_abs = jnp.ones((1, 2, 64))
    stats = jnp.zeros((1, 2, bounds.N_VALUE_STATS)).at[..., bounds.STAT_ABS_NORM].set(bounds.l2(v_abs))
    assert float(jnp.max(step.kernel_division_term(stats, 64))) == (0.0 if backend.interpret() else
                                                                    float(bounds.approx_division_error(v_abs)[0, 0]))


def _model_layer_view(layer: int = 1):
    """A 3-layer model cache after a 70-token prompt (kernel path, interpreted), its stacked hot ids made to differ
    between layers (layers other than `layer` point at other blocks), and layer `layer`'s view of it."""
    from certattn_jax.model_cache import cache_spec
    from models import llama
    from models.config import LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=32, max_position_embeddings=512)
    policy = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2, tier1="pallas", rung0="fused")
    params = llama.init_params(cfg, jax.random.key(1), jnp.float32)
    model = cache_spec("certified", cfg, jnp.float32, policy)(1, 128)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (1, 70)), jnp.int32)
    _, model = jax.jit(lambda p, t, c: llama.forward(p, cfg, t, c))(params, tokens, model)
    # a prefill leaves the hot set empty: hold blocks 0-3 (the 4 full ones; slot contents do not matter here, both
    # sides read the same), the other layers other blocks
    ids = jnp.broadcast_to(jnp.asarray([2, 0, 3, 1], jnp.int32), model.store.hot_ids.shape)
    other = jnp.broadcast_to(jnp.asarray([1, -1, 0, 2], jnp.int32), ids.shape)
    ids = jnp.where((jnp.arange(3) == layer)[:, None, None, None], ids, other)
    model = model.replace(store=model.store.replace(hot_ids=ids))
    q = jnp.asarray(np.random.default_rng(5).normal(size=(1, cfg.num_heads, cfg.head_dim)), jnp.float32)
    return q, model.layer_view(layer), policy


def test_the_certify_kernel_reads_a_models_hot_ids_in_place():
    """In a model's layer view the certify kernel reads the stacked hot ids [L, B, H, K] at the view's layer (as
    the tier-1 pass does), instead of a per-layer slice (a copy per layer-step, and a loop-dependent slice that
    keeps XLA from taking the loop over layers into one CUDA graph): the same outputs, bit for bit, as the layer's
    own arrays; with the other layers' hot ids pointing elsewhere, a read of the wrong layer would show."""
    q, view, policy = _model_layer_view()
    assert view.stack is not None and view.layer is not None
    own = view.replace(stack=None, layer=None)
    it = step.fused_items(step.query_terms(q, view), view, policy, True)
    assert it.hot_layer is not None and it.hot_ids.ndim == 4  # the stacked path was taken
    got = jax.jit(functools.partial(step.rung0_fused))(q, view, policy)
    want = jax.jit(functools.partial(step.rung0_fused))(q, own, policy)
    assert int(jnp.sum(want.active)) > 0  # some hot slot promoted
    for name in ("stage", "active", "tolerance", "bad"):
        for x, y in zip(jax.tree.leaves(getattr(got, name)), jax.tree.leaves(getattr(want, name)), strict=True):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=name)


def test_the_stacked_hot_ids_kernel_lowers_to_triton(monkeypatch):
    """The in-place read of the stacked hot ids (a leading layer axis of 3: not a power of two) lowers to Triton."""
    q, view, policy = _model_layer_view()  # built first: with the token-write kernel forced on it runs eagerly
    monkeypatch.setenv("CERTATTN_PALLAS_INTERPRET", "0")
    allow = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    f = jax.jit(functools.partial(step.rung0_fused))
    text = jax.export.export(f, platforms=["cuda"], disabled_checks=allow)(q, view, policy).mlir_module()
    assert "certattn_certify_rung0" in text or "xla.gpu.triton" in text


def test_certify_rung0_checks_the_hot_ids_shape():
    from pallas_kernels import certify_rung0 as ck

    q, cache, policy, _, _ = _cache(3, **CASES[1])
    it = step.fused_items(step.query_terms(q, cache), cache, policy, True)
    vt = step.value_terms(cache, policy, step.block_validity(cache))
    args = (it.apx.m, it.apx.l, it.apx.acc, it.apx_delta, vt.eta, vt.eta_mean, vt.eta_op,
            cache.flushed // cache.block_size)
    rest = (it.slots.m, it.slots.l, it.slots.acc, it.slot_delta, cache.lengths - cache.flushed, vt.key_scale)
    kw = dict(block_size=cache.block_size, k_max=policy.k_max, tau_cov=policy.tau_cov, rank_margin=policy.rank_margin,
              heads=None if it.padded_rows is None else q.shape[1] // cache.num_kv_heads,
              num_blocks=cache.num_blocks, **it.split_args)
    with pytest.raises(ValueError, match="hot_ids"):  # a stacked array without its layer
        ck.certify_rung0(*args, cache.hot_ids[None], *rest, **kw)
    with pytest.raises(ValueError, match="hot_ids"):  # one layer's array given a layer
        ck.certify_rung0(*args, cache.hot_ids, *rest, layer=0, **kw)
