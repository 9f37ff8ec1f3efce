"""Soundness under incremental builds and extreme magnitudes (issue: certificates that lie).

Families (each a bare `error <= bound` check against a float64 reference over exactly what tier 2 and the
residual hold, i.e. the inputs *after* their cast to the cache dtype):
  * incremental builds: float32 inputs written into bf16 / f16 caches token by token across flushes, and in
    chunks, with value offsets that the cast moves (1002 +- 0.1 in bf16) and values that overflow f16;
  * extreme magnitudes: scores up to ~1e10, values from 1e-25 to 1e30, absolute tolerances that certify;
  * non-finite and overflowing queries: a bound is a number or +inf, never NaN;
  * garbage beyond `lengths` in the residual block never influences the result;
  * the exact rungs are never less exact than rung 0 (float32 probabilities with a bf16 cache).
Plus unit checks of the bound's building blocks (liveness from masks, scaled norms).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float64_reference import attention_f64
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certattn_jax import bounds, quant
from certattn_jax.attention import certified_attention
from certattn_jax.cache import TieredKVCache
from certattn_jax.policy import CertPolicy

attn = jax.jit(certified_attention, static_argnums=2)


def stored(x, dtype) -> np.ndarray:
    """What a cache of `dtype` holds for input x, as float64: x rounded to `dtype` once, as `jnp.asarray(x, dtype)`
    (which builds the direct caches below) and a cache's own cast of float32 inputs (the incremental ones) do.
    Not via float32 first: for float64 x that rounds twice and can land one ulp of `dtype` away from what the
    cache holds (1.3e8 for bf16 values ~3e10: a hypothesis example, seed 30, once read as a violation)."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)).astype(np.float64)


reference = attention_f64


def check(q, k64, v64, lengths, cache, policy, *, allow_unproven=None, what=""):
    """Every head: bound is a number or +inf (never NaN), error <= bound; a non-finite output only with an
    infinite bound. allow_unproven [B, Hq]: heads that must report +inf (NaN/Inf data or query)."""
    out, cert = attn(q, cache, policy)
    c = jax.tree.map(np.asarray, cert)
    bound = c.error_bound.astype(np.float64)
    assert not np.any(np.isnan(bound)), f"NaN bound {what}: {bound}"
    assert np.all(bound >= 0), bound
    np.testing.assert_array_equal(c.certified, (c.error_bound <= c.tolerance) & np.isfinite(c.error_bound))
    ref = reference(q, k64, v64, lengths)
    out64 = np.asarray(out).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.linalg.norm(out64 - ref, axis=-1)
    skip = np.zeros(bound.shape, bool) if allow_unproven is None else np.asarray(allow_unproven)
    assert np.all(np.isposinf(bound[skip])) and not np.any(c.certified[skip]), (what, bound, c.certified)
    nonfinite_out = ~np.all(np.isfinite(out64), axis=-1)
    assert np.all(np.isposinf(bound[nonfinite_out])), f"non-finite output with a finite bound {what}"
    ok = skip | nonfinite_out | (err <= bound)
    if not ok.all():
        bad = [(b, h, err[b, h], bound[b, h], int(c.rung[b, h]), float(c.e_key[b, h]), float(c.e_val[b, h]),
                float(c.e_num[b, h])) for b, h in zip(*np.nonzero(~ok), strict=True)]
        raise AssertionError(f"UNSOUND {what} policy={policy}: (b, h, err, bound, rung, e_key, e_val, e_num) {bad}")
    return err, c, np.asarray(out)


# ------------------------------------------------------------------------------- incremental builds
INC_POLICY = CertPolicy(block_size=16, group_size=16, key_bits=8, value_bits=4, k_max=2, eps=0.05)
INC_POLICY_K4 = CertPolicy(block_size=16, group_size=16, key_bits=4, value_bits=2, k_max=2, eps=1.0)
CAP = 96


@functools.partial(jax.jit, donate_argnums=0)
def _write_one(cache, k, v):
    return cache.flush().write_token(k, v)


@jax.jit
def _append(cache, k, v):
    return cache.append(k, v)


def _build_incremental(k, v, dtype, policy, mode):
    B, T, H, d = k.shape
    cache = TieredKVCache.init(batch=B, capacity=CAP, num_kv_heads=H, head_dim=d, dtype=dtype, policy=policy)
    if mode == "tokens":
        for t in range(T):
            cache = _write_one(cache, k[:, t:t + 1], v[:, t:t + 1])
    else:
        for t in range(0, T, 23):
            cache = _append(cache, k[:, t:t + 23], v[:, t:t + 23])
    return cache


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("policy", [INC_POLICY, INC_POLICY_K4], ids=["K8V4", "K4V2"])
@pytest.mark.parametrize("mode", ["tokens", "chunks"])
def test_incremental_float32_inputs_into_low_precision_caches(dtype, policy, mode):
    """f32 values 1002 +- 0.1: the bf16 cache stores a range of ~4 (the audit's case: a range recorded before
    the cast was 0.2); T = 70 crosses 4 flushes and leaves a partial residual (token mode: a full one too)."""
    rng = np.random.default_rng(hash((str(dtype), policy.key_bits, mode)) % 2 ** 32)
    B, T, H, G, d = 2, 70, 2, 2, 32
    k = rng.standard_normal((B, T, H, d)).astype(np.float32) * 2
    v = (1002.0 + 0.1 * rng.standard_normal((B, T, H, d))).astype(np.float32)
    v[:, :, 1] = rng.standard_normal((B, T, d)) * 3  # a plain KV head beside it
    q = (rng.standard_normal((B, H * G, d)) * 2).astype(np.float32)
    for n in (64, 70):  # 64: the residual is exactly full (token mode) / empty (chunk mode)
        cache = _build_incremental(jnp.asarray(k[:, :n]), jnp.asarray(v[:, :n]), dtype, policy, mode)
        lengths = np.full(B, n)
        err, c, _ = check(jnp.asarray(q), stored(k[:, :n], dtype), stored(v[:, :n], dtype), lengths, cache, policy,
                          what=f"incremental {mode} n={n}")
        vs = stored(v[:, :n], dtype)  # the recorded range contains every stored value, tightly
        assert np.all(np.asarray(cache.v_min) <= vs.min(axis=1)) and np.all(np.asarray(cache.v_max) >= vs.max(axis=1))
        slack = np.abs(vs).max(axis=1) * float(jnp.finfo(dtype).eps) * 2 + 1e-30
        assert np.all(np.asarray(cache.v_min) >= vs.min(axis=1) - slack)
        # so does the running value norm (the key term's centre-0 form): every stored token's, tightly
        norms = np.linalg.norm(vs.astype(np.float64), axis=-1).max(axis=1)
        got = np.asarray(cache.v_norm_max, np.float64)
        assert np.all(got >= norms) and np.all(got <= norms * (1 + 4 * float(jnp.finfo(dtype).eps)) + 1e-30)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("values", ["offset_representable", "offset_rounded", "plain", "subnormal_zone"])
@pytest.mark.parametrize("mode", ["tokens", "chunks"])
def test_the_tolerance_is_measured_against_the_stored_range(dtype, values, mode):
    """`certified` means error_bound <= eps ||r||_2 + abs_tol with r the range of the values the cache *stores*.
    An audit (2026-12-07) found float32 tokens written into a bf16 cache certified against 2.96 eps ||r||: the
    recorded range was widened by half an ulp per side (values 1000 and 1004, range 4, ulp 4), and the tolerance
    was computed from it. Now the extremes are rounded as the cast rounds them: the recorded range is the stored
    one (tightly, outside the subnormal zone), and the tolerance never exceeds eps ||r_stored|| + abs_tol."""
    rng = np.random.default_rng(hash((str(dtype), values, mode)) % 2 ** 32)
    B, T, H, G, d = 2, 45, 2, 2, 16
    k = rng.standard_normal((B, T, H, d)).astype(np.float32)
    v = {"offset_representable": 1000.0 + 4.0 * rng.integers(0, 2, (B, T, H, d)),
         "offset_rounded": 1002.0 + 3.0 * rng.standard_normal((B, T, H, d)),
         "plain": rng.standard_normal((B, T, H, d)),
         "subnormal_zone": 1e-39 * rng.standard_normal((B, T, H, d))}[values].astype(np.float32)
    v[1, :, 1] = rng.standard_normal((T, d)) * 5  # a plain head beside it
    q = (rng.standard_normal((B, H * G, d)) * 2).astype(np.float32)
    policy = CertPolicy(block_size=16, group_size=16, k_max=2, eps=0.05, abs_tol=0.0)
    cache = _build_incremental(jnp.asarray(k), jnp.asarray(v), dtype, policy, mode)
    vs = stored(v, dtype)  # what the cache holds
    lo, hi = np.asarray(cache.v_min, np.float64), np.asarray(cache.v_max, np.float64)
    assert np.all(lo <= vs.min(axis=1)) and np.all(hi >= vs.max(axis=1))  # still covers every stored value
    slack = 3 * bounds.TINY
    assert np.all(lo >= vs.min(axis=1) - slack) and np.all(hi <= vs.max(axis=1) + slack)  # and no more
    _, c, _ = check(jnp.asarray(q), stored(k, dtype), vs, np.full(B, T), cache, policy, what=f"{values} {mode}")
    r_stored = np.linalg.norm(vs.max(axis=1) - vs.min(axis=1), axis=-1)  # [B, H]
    allowed = policy.eps * np.repeat(r_stored, G, axis=1)
    assert np.all(c.tolerance.astype(np.float64) <= allowed), (c.tolerance, allowed)
    assert np.all(c.tolerance >= allowed * (1 - 1e-3) - 1e-30)  # lower only by the norm's rounding margins
    assert not np.any(c.certified & (c.error_bound > allowed))


def test_rounding_to_bf16_and_f16_matches_the_cast_bit_for_bit():
    """`quant.round_nearest_to` (integer operations, no float rounding for a compiler to elide) is the cast:
    random bit patterns (every exponent, NaN, Inf, subnormals) and the edges (f16's largest finite value, the
    halfway points to Inf and to its smallest subnormal)."""
    import ml_dtypes

    rng = np.random.default_rng(11)
    x = rng.integers(0, 2 ** 32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.asarray([0.0, -0.0, 65504, 65519.99, 65520, -65520, 6.1035156e-05, 5.9604645e-08, 2.9802322e-08,
                        2.99e-08, 1e-45, 1e-39, -1e-39, np.inf, -np.inf, 3.4e38, 1000.1, 1002.1, 1003.0, 1005.0],
                       np.float32)
    x = np.concatenate([x, edges])
    for dtype, np_dtype in ((jnp.bfloat16, ml_dtypes.bfloat16), (jnp.float16, np.float16)):
        got = np.asarray(jax.jit(lambda a, dt=dtype: quant.round_nearest_to(a, dt))(x))
        with np.errstate(over="ignore", invalid="ignore"):
            want = x.astype(np_dtype).astype(np.float32)
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (dtype, x[~same][:5], got[~same][:5], want[~same][:5])


def test_f16_overflow_from_float32_inputs_sets_nonfinite():
    """f32 inputs above 65504 become Inf in an f16 cache: the head must be flagged and never certified."""
    B, T, H, G, d = 1, 40, 2, 2, 32
    rng = np.random.default_rng(3)
    k = rng.standard_normal((B, T, H, d)).astype(np.float32)
    v = rng.standard_normal((B, T, H, d)).astype(np.float32)
    v[0, 5, 0, 3] = 7.0e4  # Inf in float16
    k[0, 37, 1, 0] = -9.0e4  # -Inf in float16, in the residual
    q = rng.standard_normal((B, H * G, d)).astype(np.float32)
    for mode in ("tokens", "chunks"):
        cache = _build_incremental(jnp.asarray(k), jnp.asarray(v), jnp.float16, INC_POLICY, mode)
        assert np.asarray(cache.nonfinite).tolist() == [[True, True]]
        unproven = np.ones((B, H * G), bool)
        check(jnp.asarray(q), stored(k, jnp.float16), stored(v, jnp.float16), [T], cache, INC_POLICY,
              allow_unproven=unproven, what=f"f16 overflow {mode}")


# ------------------------------------------------------------------------------- extreme magnitudes
EXT_CFGS = {
    "f32-K8V4": (jnp.float32, CertPolicy(block_size=16, group_size=16, k_max=3, eps=0.05)),
    "bf16-K4V2": (jnp.bfloat16, CertPolicy(block_size=32, group_size=16, key_bits=4, value_bits=2, k_max=2,
                                           eps=0.5, layer_fallback_fraction=1.0)),
}
EXT_B, EXT_H, EXT_G, EXT_D, EXT_T = 2, 2, 2, 32, 160


@functools.partial(jax.jit, static_argnames=("policy",))
def _build(k, v, lengths, policy):
    return TieredKVCache.from_dense(k, v, policy=policy, lengths=lengths)


def _extreme_case(seed, q_mag, k_mag, v_mag, v_off, needle_score):
    rng = np.random.default_rng(seed)
    B, H, G, d, T = EXT_B, EXT_H, EXT_G, EXT_D, EXT_T
    k = rng.standard_normal((B, T, H, d)) * k_mag
    v = rng.standard_normal((B, T, H, d)) * v_mag + v_off
    q = rng.standard_normal((B, H * G, d)) * q_mag
    if needle_score:  # one key per (row, KV head) whose score with the group's first head is ~needle_score
        for b in range(B):
            for h in range(H):
                i = rng.integers(T)
                qh = q[b, h * G]
                k[b, i, h] = qh / (qh @ qh) * needle_score * math.sqrt(d)
    return q, k, v


@pytest.mark.parametrize("name", list(EXT_CFGS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
@given(seed=st.integers(0, 2 ** 31 - 1), q_exp=st.floats(-3, 4), k_exp=st.floats(-3, 3),
       v_exp=st.floats(-25, 30), v_off_rel=st.sampled_from([0.0, 0.0, 3.0, 1e3]),
       needle=st.sampled_from([0.0, 0.0, 1e3, 3e5, 1e10]), abs_tol=st.sampled_from([0.0, 1e-3, 10.0]),
       data=st.data())
def test_extreme_magnitudes_are_bounded(name, seed, q_exp, k_exp, v_exp, v_off_rel, needle, abs_tol, data):
    dtype, policy = EXT_CFGS[name]
    policy = dataclasses.replace(policy, abs_tol=abs_tol)
    v_mag = 10.0 ** v_exp
    q, k, v = _extreme_case(seed, 10.0 ** q_exp, 10.0 ** k_exp, v_mag, v_off_rel * v_mag, needle)
    lengths = np.asarray(data.draw(st.lists(st.integers(1, EXT_T), min_size=EXT_B, max_size=EXT_B)))
    kj, vj = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    cache = _build(kj, vj, jnp.asarray(lengths, jnp.int32), policy)
    check(jnp.asarray(q, jnp.float32), stored(k, dtype), stored(v, dtype), lengths, cache, policy,
          what=f"{name} q=1e{q_exp:.1f} k=1e{k_exp:.1f} v=1e{v_exp:.1f} needle={needle}")


def test_the_reference_holds_exactly_what_the_cache_holds():
    """The hypothesis example that once read as a violation (bf16 values ~3e10, a sequence of 19 tokens, all in
    the residual): the reference had rounded float64 values to bf16 via float32, one bf16 ulp (1.3e8) away
    from the cache's values; over what the cache holds the certificate is sound."""
    dtype, policy = EXT_CFGS["bf16-K4V2"]
    v_mag = 10.0 ** 9.993603807782655
    q, k, v = _extreme_case(30, 1.0, 0.1, v_mag, 3.0 * v_mag, 0.0)
    vj = jnp.asarray(v, dtype)
    np.testing.assert_array_equal(stored(v, dtype), np.asarray(vj.astype(jnp.float32), np.float64))
    lengths = np.asarray([1, 19])
    cache = _build(jnp.asarray(k, dtype), vj, jnp.asarray(lengths, jnp.int32), policy)
    check(jnp.asarray(q, jnp.float32), stored(k, dtype), stored(v, dtype), lengths, cache, policy, what="seed 30")


@pytest.mark.parametrize("v_mag, abs_tol", [(1e-20, 0.0), (1e-20, 1e-3), (1e-25, 0.0), (1e30, 0.0)])
def test_tiny_and_huge_values(v_mag, abs_tol):
    """Values ~1e-20: the norm of the value range underflowed (bound 0.0 at rung 4; 3.5e-38 at rung 0 with
    abs_tol = 1e-3, against true errors ~1e-27). Values ~1e30: the squares overflow."""
    dtype, policy = EXT_CFGS["f32-K8V4"]
    policy = dataclasses.replace(policy, abs_tol=abs_tol)
    q, k, v = _extreme_case(11, 1.0, 1.0, v_mag, 0.0, 0.0)
    for pol in (policy, dataclasses.replace(policy, eps=0.0, layer_fallback_fraction=0.1)):  # rung 0/1, rung 4
        cache = _build(jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.full((EXT_B,), EXT_T, jnp.int32), pol)
        err, c, _ = check(jnp.asarray(q, jnp.float32), stored(k, dtype), stored(v, dtype), [EXT_T] * EXT_B,
                          cache, pol, what=f"values ~{v_mag}")
        assert np.all(np.isfinite(c.error_bound)) and np.all(c.error_bound > 0)


def test_needle_score_1e10_is_never_dropped():
    """A needle whose score is ~1e10 (finite): its block must never be treated as empty. Either it is
    promoted (exact) or the bound says nothing (+inf -> exact rungs)."""
    dtype, policy = EXT_CFGS["f32-K8V4"]
    q, k, v = _extreme_case(5, 1.0, 1.0, 1.0, 0.0, 1e10)
    v = v.copy()
    cache = _build(jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.full((EXT_B,), EXT_T, jnp.int32), policy)
    check(jnp.asarray(q, jnp.float32), stored(k, dtype), stored(v, dtype), [EXT_T] * EXT_B, cache, policy,
          what="needle 1e10")


def test_bf16_max_key_from_float32_input():
    """An f32 key of 3.39e38 is stored as bf16's largest finite value (the audit: true error 903 against a
    certified bound of 8.8)."""
    dtype, policy = EXT_CFGS["f32-K8V4"]
    rng = np.random.default_rng(4)
    B, T, H, d = 1, 60, 2, 32
    k = rng.standard_normal((B, T, H, d)).astype(np.float32)
    v = rng.standard_normal((B, T, H, d)).astype(np.float32)
    k[0, 21, 0, :] = 3.39e38 * np.sign(rng.standard_normal(d))
    q = rng.standard_normal((B, 2 * H, d)).astype(np.float32) * 1e-30  # scores stay finite: ~1e8
    cache = TieredKVCache.init(batch=B, capacity=CAP, num_kv_heads=H, head_dim=d, dtype=jnp.bfloat16, policy=policy)
    cache = _append(cache, jnp.asarray(k), jnp.asarray(v))
    check(jnp.asarray(q), stored(k, jnp.bfloat16), stored(v, jnp.bfloat16), [T], cache, policy, what="bf16 max key")


def _flushed_query_case(huge_where: str, seed: int = 1):
    """One sequence, one KV head, d = 32, T = 40 (two blocks of 16, 8 residual tokens); keys ~3e38 and ~1e36
    in the blocks (huge_where = "blocks") or in the residual ("residual"), ordinary elsewhere; values +1 / -1 / 0
    by part, so losing a part's scores moves the output by O(1)."""
    rng = np.random.default_rng(seed)
    T, d = 40, 32
    k = rng.standard_normal((1, T, 1, d))
    huge = (slice(0, 16), slice(16, 32)) if huge_where == "blocks" else (slice(32, 36), slice(36, 40))
    k[0, huge[0], 0] = 3e38 * (1 + 1e-3 * rng.standard_normal((4 if huge_where == "residual" else 16, d)))
    k[0, huge[1], 0] = 1e36 * (1 + 1e-3 * rng.standard_normal((4 if huge_where == "residual" else 16, d)))
    v = np.zeros((1, T, 1, d))
    v[0, huge[0]], v[0, huge[1]] = 1.0, -1.0
    v += 0.01 * rng.standard_normal(v.shape)
    return k, v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q_val", [6e-38, 1.1e-38, "mixed"])  # q / sqrt(32) subnormal; q subnormal; half
@pytest.mark.parametrize("huge_where", ["blocks", "residual"])
@pytest.mark.parametrize("eps", [0.05, 0.0])  # rung 0 asked; the exact rungs
def test_query_elements_flushed_to_zero_with_huge_keys_are_bounded(dtype, q_val, huge_where, eps):
    """The thirtieth session's audit: a query element whose scaled value q_c / sqrt(d) (or itself) is subnormal is
    flushed to 0 (XLA:CPU; a GPU may), losing q_c k_ic / sqrt(d) < TINY |k_ic| from every score: with keys
    ~1e36-3e38 several nats, which no |q_c|-weighted term of Delta covered (error 5.66 against a certified bound
    of 0.0063 at rung 0; rung 4's bound missed it too). bounds.query_flush_delta now counts it."""
    policy = CertPolicy(block_size=16, group_size=16, k_max=1, eps=eps, abs_tol=0.0)
    k, v = _flushed_query_case(huge_where)
    q = np.full((1, 1, 32), 6e-38 if q_val == "mixed" else q_val, np.float32)
    q[0, 0, ::2] *= 0.5  # two magnitudes, both flushed
    if q_val == "mixed":  # half the channels ordinary (scores ~1e34: finite), half flushed
        q[0, 0, 1::4] = 1e-3
    cache = _build(jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray([40], jnp.int32), policy)
    check(jnp.asarray(q), stored(k, dtype), stored(v, dtype), [40], cache, policy,
          what=f"flushed query {q_val} keys huge in the {huge_where}")


def test_the_query_flush_term_bounds_tiny_times_the_key_sum_without_overflow():
    """query_flush_delta >= 2 TINY sum_c |k_c| (the lost scores with the factor for |k| <= 2 M), finite for
    keys at float32's largest value, and negligible (< 1e-30) for ordinary keys."""
    d = 128
    for k_abs in (np.full(d, 3.4e38, np.float32), np.geomspace(1e-38, 1e38, d).astype(np.float32),
                  np.full(d, 10.0, np.float32), np.full(d, 1e-30, np.float32)):
        got = float(bounds.query_flush_delta(jnp.asarray(k_abs)))
        need = 2 * bounds.TINY * float(np.sum(k_abs.astype(np.float64)))
        assert math.isfinite(got) and got >= need, (k_abs[:3], got, need)
    assert float(bounds.query_flush_delta(jnp.full((d,), 10.0))) < 1e-30


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 3e38])
def test_nonfinite_and_overflowing_queries_get_a_number_or_inf(bad):
    dtype, policy = EXT_CFGS["f32-K8V4"]
    q, k, v = _extreme_case(6, 1.0, 1.0, 1.0, 0.0, 0.0)
    q = q.astype(np.float32)
    q[0, 1, 4] = bad  # one query head
    cache = _build(jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.full((EXT_B,), EXT_T, jnp.int32), policy)
    unproven = np.zeros((EXT_B, EXT_H * EXT_G), bool)
    if not np.isfinite(bad):
        unproven[0, 1] = True
    err, c, out = check(jnp.asarray(q), stored(k, dtype), stored(v, dtype), [EXT_T] * EXT_B, cache, policy,
                        allow_unproven=unproven, what=f"query {bad}")
    others = np.ones_like(unproven)
    others[0, 1] = False
    assert np.all(c.rung[others] <= 2)  # the other heads are not dragged to the exact rungs


def test_garbage_beyond_lengths_in_the_residual_does_not_escalate():
    """NaN/Inf beyond `lengths` inside the residual block made rung 0 produce NaN (0 * inf) and the layer drop
    to rung 4: padding must never influence the result."""
    dtype, policy = EXT_CFGS["f32-K8V4"]
    q, k, v = _extreme_case(7, 2.0, 1.0, 1.0, 0.0, 0.0)
    lengths = np.array([EXT_T - 5, 100 + 3])  # residual partially filled in both rows
    k, v = k.copy(), v.copy()
    for b, n in enumerate(lengths):
        k[b, n:] = np.nan
        v[b, n:] = np.inf
    cache = _build(jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(lengths, jnp.int32), policy)
    assert not np.asarray(cache.nonfinite).any()
    err, c, out = check(jnp.asarray(q, jnp.float32), stored(k, dtype), stored(v, dtype), lengths, cache, policy,
                        what="garbage in the residual")
    assert np.all(c.rung == 0), c.rung
    assert np.all(np.isfinite(out))


def test_exact_rungs_are_not_less_exact_than_rung_0_in_bf16():
    """bf16 cache, values 1000 + N(0, 1): rungs 3/4 used to round the probabilities to bf16 (error ~8 against
    rung 0's ~1e-2). Now they accumulate at float32 precision."""
    policy = CertPolicy(block_size=16, group_size=16, k_max=3, eps=0.05)
    rng = np.random.default_rng(8)
    B, T, H, G, d = 1, 200, 2, 2, 32
    k = rng.standard_normal((B, T, H, d))
    v = 1000.0 + rng.standard_normal((B, T, H, d))
    q = rng.standard_normal((B, H * G, d)).astype(np.float32) * 0.3  # diffuse attention
    kj, vj = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    cache = _build(kj, vj, jnp.full((B,), T, jnp.int32), policy)
    k64, v64 = stored(k, jnp.bfloat16), stored(v, jnp.bfloat16)
    errs = {}
    for name, pol in (("rung0", dataclasses.replace(policy, eps=10.0)),
                      ("rung3", dataclasses.replace(policy, eps=0.0, layer_fallback_fraction=2.0)),
                      ("rung4", dataclasses.replace(policy, eps=0.0, layer_fallback_fraction=0.1))):
        err, c, _ = check(jnp.asarray(q), k64, v64, [T], cache, pol, what=name)
        errs[name] = err
    # float32-level accuracy (an n-term float32 sum of values ~1e3: ~1e-4 typical, 1e-2 worst case) and far
    # better than rung 0; bf16 probabilities gave 0.5-1.0 here
    for name in ("rung3", "rung4"):
        assert np.all(errs[name] <= 5e-3) and np.all(errs[name] <= errs["rung0"] / 5), errs


# ------------------------------------------------------------------------------- building blocks
def test_tv_bound_counts_valid_items_whose_mass_evaluated_to_zero():
    """Liveness comes from the validity masks: a valid item whose computed mass is 0 (log-mass -inf) with a
    huge Delta must make the bound infinite, not vanish."""
    lm = jnp.array([[0.0, -jnp.inf]])
    deltas = jnp.array([[1e-6, 1e3]])
    valid = jnp.array([[True, True]])
    ok = jnp.array([[True, False]])
    broken = bounds.item_broken(valid, lm, deltas, ok)
    assert bool(broken[0])
    assert float(bounds.tv_bound(lm, deltas, valid, broken)[0]) == np.inf
    # an invalid (empty) item does not count
    valid2 = jnp.array([[True, False]])
    broken2 = bounds.item_broken(valid2, lm, deltas, ok)
    assert not bool(broken2[0])
    assert float(bounds.tv_bound(lm, deltas, valid2, broken2)[0]) < 1e-5
    # a non-finite Delta on a valid item proves nothing
    broken3 = bounds.item_broken(valid, jnp.array([[0.0, -1.0]]), jnp.array([[0.1, jnp.inf]]), jnp.array([[True] * 2]))
    assert bool(broken3[0])


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1.0, 1e20, 1e30])
def test_norms_neither_underflow_nor_overflow(scale):
    x = np.random.default_rng(9).standard_normal((4, 64)) * scale
    exact = np.linalg.norm(x.astype(np.float64), axis=-1)
    got = np.asarray(bounds.l2(jnp.asarray(x, jnp.float32)), np.float64)
    assert np.all(got >= exact) and np.all(got <= exact * 1.0001 + 1e-37), (got, exact)
    v = jnp.asarray(x, jnp.float32)
    err = np.asarray(quant.token_error_norms(v, jnp.zeros_like(v)), np.float64)
    assert np.all(err >= np.linalg.norm(np.asarray(v, np.float64), axis=-1))
    assert float(bounds.l2(jnp.array([1.0, jnp.nan]))) == np.inf


@pytest.mark.parametrize("n", [1, 3, 64, 128, 2048, 2049])
def test_one_pass_norms_bound_every_magnitude(n):
    """`quant.norm_upper` picks one of three scalings by the largest entry (one pass on a GPU): the bound holds
    against float64 and stays tight on each side of the regimes' edges (2^-40, 2^58), for spreads of magnitudes
    within a vector (entries whose squares underflow, subnormal entries), near float32's largest value, for one
    entry and for more than 2^11 (the two-pass form); zeros give 0, non-finite entries +inf."""
    rng = np.random.default_rng(n)
    edges = [2.0 ** e for e in (-149, -140, -127, -126, -100, -63, -41, -40, -39, 0, 10, 57, 58, 59, 64, 100, 126)]
    rows = []
    for top in edges:
        for spread in (0.0, 10.0, 60.0, 200.0):  # log2 of the ratio between the largest and the smallest entry
            e = -rng.uniform(0.0, spread, size=n)
            e[0] = 0.0
            row = top * np.exp2(e) * rng.choice([-1.0, 1.0], size=n)
            rows.append(row)
    rows.append(np.full(n, np.finfo(np.float32).max / 2 ** 6))
    x = np.asarray(np.stack(rows), np.float32)  # the float32 values are the inputs (rounded, flushed or not)
    exact = np.linalg.norm(x.astype(np.float64), axis=-1)
    got = np.asarray(quant.norm_upper(jnp.asarray(x)), np.float64)
    assert np.all(got >= exact), (got - exact).min()
    ok = exact < np.finfo(np.float32).max / 2  # beyond float32's range the bound is +inf
    tiny = float(np.finfo(np.float32).tiny)
    assert np.all(got[ok] <= exact[ok] * (1 + (n + 8) * 2.4e-7) + tiny * (2 * np.sqrt(n) + n + 3)), \
        np.max(got[ok] / np.maximum(exact[ok], 1e-45))
    assert float(quant.norm_upper(jnp.zeros((n,)))) == 0.0
    bad = np.ones(n, np.float32)
    bad[-1] = np.inf
    assert float(quant.norm_upper(jnp.asarray(bad))) == np.inf
    bad[-1] = np.nan
    assert float(quant.norm_upper(jnp.asarray(bad))) == np.inf


def test_a_block_whose_weights_all_underflow_escalates(monkeypatch):
    """Simulate what a compiler that evaluates the score twice (once for the block max, once, contracted with
    the subtraction, inside exp) did to a needle scored ~1e10: every weight of the needle's block evaluated to
    0, l = 0, and the block silently left both the output and the bound (certified at rung 0, bound 0.0039,
    true error 56.6). Now a valid item with l < 1/2 is 'broken': infinite bound, the head escalates."""
    from certattn_jax import step

    real = step.tier1_partials

    def lossy(*args):  # the INT8 pass over all blocks (jnp or kernel): block 1 loses every weight
        p = real(*args)
        return p._replace(l=p.l.at[..., 1].set(0.0), acc=p.acc.at[..., 1, :].set(0.0))

    from pallas_kernels import tier1_pass as kernel

    real_kernel = kernel.tier1_pass

    def lossy_kernel(*args, **kwargs):  # the fused rung 0 calls the kernel itself (split layout: l alone is lost)
        p = real_kernel(*args, **kwargs)
        return p._replace(l=p.l.at[..., 1].set(0.0))

    policy = CertPolicy(block_size=16, group_size=16, k_max=1, eps=0.05, tau_cov=1e-6)  # K* = 0: no promotion
    rng = np.random.default_rng(12)
    B, T, H, d = 1, 100, 1, 32
    k = rng.standard_normal((B, T, H, d)).astype(np.float32)
    v = rng.standard_normal((B, T, H, d)).astype(np.float32)
    v[0, 16:32] += 5.0  # block 1's values stand out: dropping it moves the output
    q = rng.standard_normal((B, 2, d)).astype(np.float32)
    cache = TieredKVCache.from_dense(jnp.asarray(k), jnp.asarray(v), policy)
    # where kernels run compiled (a GPU), their self-checks must see the real kernels, not the lossy ones below
    # (a check run under the patch finds the "kernel" wrong and sends the ladder to jnp: the H200 did, 2026-12-03)
    step.tier1_kernel_runs(cache, policy.tier1), step.uses_fused_rung0(cache, policy)
    monkeypatch.setattr(step, "tier1_partials", lossy)
    monkeypatch.setattr(kernel, "tier1_pass", lossy_kernel)
    out, cert = certified_attention(jnp.asarray(q), cache, policy)  # eager: the patched function is used
    c = jax.tree.map(np.asarray, cert)
    assert np.all(c.rung >= 1), c.rung  # rung 0 (and its K* = 0 selection) could not be bounded
    err = np.linalg.norm(np.asarray(out, np.float64) - reference(q, k.astype(np.float64), v.astype(np.float64),
                                                                 [T]), axis=-1)
    assert np.all(err <= c.error_bound), (err, c.error_bound)


def _spread_block_trials(alpha, trials=25):
    """One INT4 block per trial (Bk = d = 64, group 32; magnitudes 1 and 1e-25, 1e25, 1e-30: the audit's
    tiny_values family, whose squares underflow) and adversarial softmax weights q_i ~ exp(alpha <e_i, u>) that
    favour the tokens whose error points along u, from flat (alpha 0: the mean error alone) to one token (alpha 30:
    eta). Yields (writer annotations t1, the block's float32 sum-exp l32 as the tier-1 pass computes it, q, the
    float64 errors e [Bk, d]), after checking the spectral and mean-error annotations against float64 SVD / mean."""
    from certattn_jax.cache import _quantize_blocks

    rng = np.random.default_rng(17)
    Bk, d, gs = 64, 64, 32
    for trial in range(trials):
        magnitude = [1.0, 1e-25, 1e25, 1e-30][trial % 4]
        v = (rng.normal(size=(1, 1, 1, Bk, d)) * rng.uniform(0.1, 10.0) + rng.normal() * 3.0) * magnitude
        v32 = jnp.asarray(v, jnp.float32)
        t1 = _quantize_blocks(jnp.zeros_like(v32), v32, 8, gs, 4)
        v_hat = np.asarray(quant.dequantize_values(t1["v_codes"], t1["v_scale"], t1["v_zero"], gs, 4), np.float64)
        e = (np.asarray(v32, np.float64) - v_hat)[0, 0, 0]  # [Bk, d]
        u = rng.normal(size=d)
        u /= np.linalg.norm(u)
        s = (alpha * (e @ u) / max(np.abs(e).max(), 1e-30) + rng.normal(size=Bk) * 0.01).astype(np.float32)
        w = np.exp(s.astype(np.float64) - s.max())
        q = w / w.sum()
        l32 = jnp.sum(jnp.exp(jnp.asarray(s) - jnp.max(jnp.asarray(s))))  # as the tier-1 pass computes it
        assert np.linalg.norm(e, 2) <= float(t1["v_err_op"][0, 0, 0])
        assert np.linalg.norm(e.mean(axis=0)) <= float(t1["v_mean_err"][0, 0, 0])
        yield t1, l32, q, e


@pytest.mark.parametrize("alpha", [0.0, 0.3, 3.0, 30.0])
def test_block_value_errors_bound_the_weighted_error_of_a_block(alpha):
    """docs/bounds.md section 4 (the spread-block form): for one INT4 block and any softmax weights q over its
    tokens, ||sum_i q_i (v_i - v_hat_i)|| <= bounds.block_value_errors(eta, eta_mean, eta_op, l) with l = sum_i
    exp(s_i - max s) computed in float32 (`_spread_block_trials`: adversarial weights, extreme magnitudes)."""
    worst = 0.0
    for trial, (t1, l32, q, e) in enumerate(_spread_block_trials(alpha)):
        bound = float(bounds.block_value_errors(t1["v_err"][0, 0, 0], t1["v_mean_err"][0, 0, 0],
                                                t1["v_err_op"][0, 0, 0], l32, 64))
        true = float(np.linalg.norm(q @ e))
        assert true <= bound, (trial, true, bound)
        assert bound <= float(t1["v_err"][0, 0, 0])  # never looser than the per-token maximum
        worst = max(worst, true / bound)
    assert worst > 0.05, worst  # not vacuous


def _round_up_f32(y: np.ndarray) -> np.ndarray:
    """The smallest float32 >= y (float64), elementwise."""
    r = y.astype(np.float32)
    return np.where(r.astype(np.float64) < y, np.nextafter(r, np.float32(np.inf)), r)


def _worst_reciprocal(rel: float):
    """A reciprocal as low as a relative error `rel` allows: the smallest float32 >= (1/x)(1 - rel)."""
    return lambda x: jnp.asarray(_round_up_f32((1.0 / np.asarray(x, np.float64)) * (1.0 - rel)))


def _worst_sqrt(rel: float):
    """A square root as low as a relative error `rel` allows: the smallest float32 >= sqrt(t)(1 - rel)."""
    return lambda t: jnp.asarray(_round_up_f32(np.sqrt(np.asarray(t, np.float64)) * (1.0 - rel)))


# what the compiled certify kernel passes (Triton: div.full.f32, libdevice sqrt), and the whole relative error of
# each operation it allows: the margin beyond a correctly rounded result plus that rounding's u
KERNEL_MARGINS = dict(div_error=bounds.APPROX_DIV_ERROR, sqrt_rel_error=quant.KERNEL_SQRT_REL_ERROR)
WORST_OPS = dict(reciprocal=_worst_reciprocal(bounds.U + bounds.APPROX_DIV_ERROR),
                 sqrt=_worst_sqrt(bounds.U + quant.KERNEL_SQRT_REL_ERROR))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 3.0, 30.0])
def test_block_value_errors_with_kernel_margins_bound_a_block_under_the_worst_rounding(alpha):
    """As `test_block_value_errors_bound_the_weighted_error_of_a_block`, for the compiled certify kernel's form
    (`div_error` = APPROX_DIV_ERROR, `sqrt_rel_error` = KERNEL_SQRT_REL_ERROR) with its reciprocal and square root
    replaced by the lowest results those errors allow: still a bound, and the margins cost almost nothing."""
    worst = 0.0
    for trial, (t1, l32, q, e) in enumerate(_spread_block_trials(alpha)):
        args = (t1["v_err"][0, 0, 0], t1["v_mean_err"][0, 0, 0], t1["v_err_op"][0, 0, 0], l32, 64)
        bound = float(bounds._block_value_errors(*args, **KERNEL_MARGINS, **WORST_OPS))
        plain = float(bounds.block_value_errors(*args))
        true = float(np.linalg.norm(q @ e))
        assert true <= bound, (trial, true, bound)
        assert bound <= float(t1["v_err"][0, 0, 0])
        assert plain * (1 - 1e-5) <= bound <= plain * (1 + 1e-5), (trial, plain, bound)
        worst = max(worst, true / bound)
    assert worst > 0.05, worst


def _sum_exp_cases(B: int, rng) -> np.ndarray:
    """Computed sum-exps l of a B-token block, dense where 1/l - 1/B cancels (l near B, both sides), near one
    token (l ~ 1), spread over [1, B] and beyond, and degenerate (0, below the smallest normal, NaN, inf)."""
    ks = np.arange(-3000, 3000)
    return np.concatenate([
        B * (1.0 + ks * 2.0 ** -24), B * (1.0 + ks * 2.0 ** -16), 1.0 + np.abs(ks) * 2.0 ** -20,
        rng.uniform(1.0, B, 20000), np.exp(rng.uniform(np.log(1e-3), np.log(4.0 * B), 20000)),
        [0.0, 1e-39, 1e-30, B / 2, B - 1, B + 1, 1e30, np.nan, np.inf]]).astype(np.float32)


@pytest.mark.parametrize("B", [16, 32, 48, 64, 128])
@pytest.mark.parametrize("form", ["xla", "kernel margins, XLA rounding", "kernel margins, worst rounding"])
def test_block_value_errors_bound_their_formula_in_exact_arithmetic(B, form):
    """The computed spread-block error is never below min(eta, eta_mean + sqrt((1/L - 1/B)^+) eta_op) evaluated in
    float64, L = max(l_low, TINY) the float32 lower bound of the block's sum-exp the function forms (its proof:
    docs/bounds.md section 4): correctly rounded (the jnp path), and in the compiled kernel's form with correctly
    rounded or the worst allowed division and square root. Dense where 1/L - 1/B cancels; eta_op and eta_mean
    from 1e-30 to 1e30."""
    rng = np.random.default_rng(B)
    l = _sum_exp_cases(B, rng)
    n = l.size
    eta_op = (10.0 ** rng.uniform(-30, 30, n) * rng.uniform(0.5, 1.0, n)).astype(np.float32)
    eta_mean = np.where(rng.uniform(size=n) < 0.3, 0.0, eta_op * rng.uniform(0, 0.3, n)).astype(np.float32)
    eta = np.where(rng.uniform(size=n) < 0.8, np.inf, eta_op * rng.uniform(0.2, 3.0, n)).astype(np.float32)
    kw = {} if form == "xla" else dict(KERNEL_MARGINS, **(WORST_OPS if "worst" in form else {}))
    got = np.asarray(bounds._block_value_errors(jnp.asarray(eta), jnp.asarray(eta_mean), jnp.asarray(eta_op),
                                                jnp.asarray(l), B, **{"div_error": 0.0, "sqrt_rel_error": 0.0, **kw}),
                     np.float64)
    c1 = np.float32(1.0 - bounds.EPS_WEIGHT - bounds.gamma(B + 1))
    L = np.maximum(l * c1, np.float32(bounds.TINY)).astype(np.float64)  # as the function forms it (float32)
    with np.errstate(invalid="ignore", over="ignore"):
        want = eta_mean + np.sqrt(np.maximum(1.0 / L - 1.0 / B, 0.0)) * eta_op.astype(np.float64)
        want = np.minimum(eta.astype(np.float64), want)
    num = ~np.isnan(l)
    assert np.all(got[num] >= want[num]), [(l[i], got[i], want[i]) for i in np.flatnonzero(got[num] < want[num])[:5]]
    assert np.array_equal(got[~num], eta[~num])  # NaN l: the plain eta
    # and tight (where float32 did not overflow): the sqrt(4u/B) slack, as much again from the rounding of 1/L -
    # 1/B where it cancels (|sqrt(x) - sqrt(y)| <= sqrt(|x - y|)), and a few dozen u
    slack = (3 * math.sqrt(4 * bounds.U / B) * eta_op + want * 64 * bounds.U) * 1.01
    fin = num & np.isfinite(got)
    bad = np.flatnonzero(fin & (got > want + slack))
    assert bad.size == 0, [(l[i], eta_op[i], got[i], want[i]) for i in bad[:5]]
    assert fin.sum() > 0.9 * n
    if "worst" in form:  # not vacuous: the same worst rounding breaks the form without the margins
        plain = np.asarray(bounds._block_value_errors(jnp.asarray(eta), jnp.asarray(eta_mean), jnp.asarray(eta_op),
                                                      jnp.asarray(l), B, 0.0, 0.0, **WORST_OPS), np.float64)
        assert np.any(plain[num] < want[num])


def test_block_value_errors_default_is_the_formula_before_the_margins():
    """Without margins (the jnp path, the interpreted kernel) the result is bit for bit the formula as it was
    before `div_error` / `sqrt_rel_error` existed (a copy of it here), jitted and not, at every magnitude."""
    def before(eta, eta_mean, eta_op, l, block_size):
        B = block_size
        l_low = l * (1.0 - bounds.EPS_WEIGHT - bounds.gamma(B + 1))
        dev = jnp.sqrt(jnp.maximum(1.0 / jnp.maximum(l_low, bounds.TINY) - 1.0 / B, 0.0)) + math.sqrt(4 * bounds.U / B)
        tight = (eta_mean + dev * eta_op) * (1.0 + 8 * bounds.U)
        return jnp.where(tight < eta, tight, jnp.broadcast_to(eta, tight.shape))

    rng = np.random.default_rng(5)
    for B in (16, 48, 64):
        l = _sum_exp_cases(B, rng)[None, :]
        n = l.shape[-1]
        vals = np.concatenate([[0.0, np.inf, np.nan, 1e-45, 1e-39, 3e38],
                               10.0 ** rng.uniform(-40, 38, n - 6)]).astype(np.float32)
        eta, eta_mean, eta_op = (jnp.asarray(rng.permutation(vals)[None, :]) for _ in range(3))
        l2 = jnp.asarray(np.concatenate([l, rng.permutation(l[0])[None, :]]))  # [G = 2, n] against [1, n]
        for wrap in (lambda f: f, jax.jit):
            args = (eta, eta_mean, eta_op, l2)
            want = np.asarray(wrap(functools.partial(before, block_size=B))(*args))
            got = np.asarray(wrap(functools.partial(bounds.block_value_errors, block_size=B))(*args))
            np.testing.assert_array_equal(got, want)
            assert got.shape == (2, n)


def test_bf16_annotations_round_up():
    """The spread-block annotations are stored in bfloat16 rounded toward +inf: never below the float32 bound
    (subnormal, normal, near the largest finite value), +inf and NaN kept, at most one bf16 ulp above."""
    from certattn_jax import quant

    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(0, 10, 5000), 10.0 ** rng.uniform(-45, 38, 5000),
                        [0.0, 1e-40, 3.0, 3.3e38, np.inf, np.nan]]).astype(np.float32)
    y = np.asarray(jax.jit(quant.round_up_to_bf16)(jnp.asarray(x)).astype(jnp.float32)).astype(np.float64)
    x64 = x.astype(np.float64)
    finite = np.isfinite(x64)
    assert np.all(y[finite] >= x64[finite])
    normal = finite & (x64 > 1e-37) & (x64 < 3e38)
    assert np.all(y[normal] <= x64[normal] * (1 + 2.0 ** -7))
    assert np.isinf(y[-2]) and np.isnan(y[-1])


def test_the_audit_s_hostile_families_hold_and_do_what_they_say():
    """scripts/soundness_audit.py's opt-in families: "midpoint" moves every key strictly inside its block's range
    to the middle between two quantization levels (the quantizer's largest rounding error everywhere), and a few
    cases of them and of "value_outlier" hold (the script exits 0 only without a violation)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import soundness_audit

    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 40, 2, 8))
    mid = soundness_audit._midpoint_keys(rng, k.copy(), 16, 8)
    for start in range(0, 40, 16):
        blk, orig = mid[:, start:start + 16], k[:, start:start + 16]
        lo, hi = orig.min(axis=1, keepdims=True), orig.max(axis=1, keepdims=True)
        pos = (blk - lo) / ((hi - lo) / 255) - 0.5
        inner = (orig > lo) & (orig < hi)
        assert np.allclose(pos[inner], np.round(pos[inner]), atol=1e-6)
        assert np.array_equal(blk[~inner], orig[~inner])  # the extremes (which set the levels) stay
    assert soundness_audit.main(["--cases", "1", "--seed", "3", "--families", "midpoint,value_outlier"]) == 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=["bf16", "f16", "f32"])
def test_the_cast_error_bounds_the_cast_and_is_inf_exactly_where_the_cast_is_not_finite(dtype):
    """`bounds.cast_error_bound` (which the ladder and the certify kernel rely on for the output's finiteness: no
    separate check follows) against float64: finite rows bounded, rows whose cast holds inf / NaN +inf; rows that
    sit just above the dtype's largest value may be +inf (conservative), and nothing else is."""
    rng = np.random.default_rng(11)
    fmax = float(jnp.finfo(dtype).max)
    d = 64
    rows = [rng.normal(size=d) * s for s in (1e-45, 1e-30, 1e-8, 1.0, 1e4, fmax / 64)]
    near = np.full(d, fmax, np.float64) * 0.999
    rows += [near, near * -1.0]
    over = rng.normal(size=d)
    over[3] = min(fmax * 1.01, float(np.finfo(np.float32).max)) if dtype != jnp.float32 else np.inf
    rows += [over]
    for bad in (np.nan, np.inf, -np.inf):
        r = rng.normal(size=d)
        r[5] = bad
        rows.append(r)
    x = jnp.asarray(np.stack(rows), jnp.float32)
    err = np.asarray(bounds.cast_error_bound(x, dtype), np.float64)
    cast = np.asarray(x.astype(dtype).astype(jnp.float32), np.float64)
    x64 = np.asarray(x, np.float64)
    cast_finite = np.all(np.isfinite(cast), axis=-1) & np.all(np.isfinite(x64), axis=-1)
    assert np.all(np.isinf(err[~cast_finite]))
    assert np.all(np.isfinite(err[cast_finite][:6]))  # the ordinary rows
    ok = cast_finite & np.isfinite(err)
    with np.errstate(invalid="ignore"):  # inf - inf in rows that are not compared
        true_err = np.linalg.norm(np.where(ok[:, None], x64 - cast, 0.0), axis=-1)
    assert np.all(true_err[ok] <= err[ok])
    np.testing.assert_array_equal(np.asarray(bounds.cast_error(x, dtype)[1]), err)


def test_an_output_whose_cast_overflows_gets_an_infinite_bound():
    """Values of a float32 cache beyond float16's range, a float16 query: the output's cast to the query's dtype
    overflows, so nothing is proven (+inf) at whatever rung (the cast's error bound says so; the ladder has no
    separate finiteness check)."""
    policy = CertPolicy(block_size=16, k_max=2, eps=1e9)
    rng = np.random.default_rng(5)
    k = jnp.asarray(rng.normal(size=(1, 40, 1, 32)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 40, 1, 32)) * 1e3 + 1e5, jnp.float32)  # averages ~1e5 > 65504
    cache = TieredKVCache.from_dense(k, v, policy)
    q = jnp.asarray(rng.normal(size=(1, 2, 32)), jnp.float16)
    out, cert = certified_attention(q, cache, policy)
    assert not np.all(np.isfinite(np.asarray(out, np.float32)))
    assert np.all(np.isinf(np.asarray(cert.error_bound))) and not np.any(np.asarray(cert.certified))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_narrowing_writes_into_other_dtypes_still_cover_the_stored_values(dtype):
    """float32 tokens into a float8 cache (no exact rounding helper: the half-ulp widening stays) -- the first
    stored-range fix refused them (review of 2026-12-07). The recorded range still covers every stored value."""
    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(5)
    k = jnp.asarray(rng.standard_normal((1, 40, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 40, 2, 16)) * 3, jnp.float32)
    cache = TieredKVCache.init(batch=1, capacity=64, num_kv_heads=2, head_dim=16, dtype=dt, policy=INC_POLICY)
    cache = _append(cache, k, v)
    vs = np.asarray(v.astype(dt).astype(jnp.float32))
    assert np.all(np.asarray(cache.v_min) <= vs.min(axis=1)) and np.all(np.asarray(cache.v_max) >= vs.max(axis=1))
    _, cert = attn(jnp.asarray(rng.standard_normal((1, 4, 16)), jnp.float32), cache, INC_POLICY)
    assert np.all(np.isfinite(np.asarray(cert.error_bound)))
