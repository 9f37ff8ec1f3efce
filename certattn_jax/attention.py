"""Certified, naive and dense attention of one decode step over a TieredKVCache (the public entry points).

    out, cert = certified_attention(q, cache, policy)          # q [B, Hq, d] -> out [B, Hq, d], Certificate
    out, cert, cache = certified_attention_step(q, cache, policy)   # also returns the cache (hot set updated)
    out = naive_attention(q, cache, policy)                     # INT8/INT4 everywhere, no certificate
    out = dense_attention(q, cache)                             # exact, over the tier-2 originals

Certified attention, per KV head (its G query heads share promotions):
  1. score every full block with INT8 keys, the residual block with exact keys; per block keep the
     flash-decoding partials (max score, sum of exp, exp-weighted value sum) -> estimated block masses;
  2. pick the top k_max blocks, and K* of them covering tau_cov of the mass (select.py); promote those the
     device hot set holds (no tier-2 read at rung 0; rung 1 fetches the missing ones and refreshes the hot set);
  3. recombine with exact partials for the promoted blocks, and bound the error (bounds.py);
  4. climb the ladder (ladder.py) for heads whose bound exceeds the tolerance or whose ranking check fails.
All shapes are static; the heavy rungs sit behind lax.cond. The step machinery lives in `step.py`; the flow
is one-directional: attention -> ladder -> step -> bounds/select/quant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from certattn_jax import ladder, quant, step, tiers
from certattn_jax.cache import TieredKVCache
from certattn_jax.certificate import Certificate
from certattn_jax.kv_cache import is_concrete
from certattn_jax.policy import CertPolicy
from certattn_jax.step import dense_attention_f32, exact_keys_values, overlay_residual

__all__ = ["certified_attention", "certified_attention_step", "certified_attention_fast", "dense_attention",
           "naive_attention",
           "dense_attention_f32", "exact_keys_values"]


def _check_query(q: jax.Array, cache: TieredKVCache) -> jax.Array:
    """q as a jax array (a NumPy query is converted: the ladder indexes it with traced values), checked against
    the cache."""
    if not isinstance(cache, TieredKVCache):
        raise TypeError(f"cache must be a certattn_jax.TieredKVCache, got {type(cache).__name__}")
    tiers.check_on_host(cache.host_k, cache.host_v)
    if not isinstance(q, jax.Array):
        q = jnp.asarray(q)
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, d], got shape {q.shape}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q must be floating point, got {q.dtype}")
    B, Hq, d = q.shape
    if Hq == 0:
        raise ValueError(f"q has no query heads: shape {q.shape}")
    if B != cache.batch or d != cache.head_dim or Hq % cache.num_kv_heads:
        raise ValueError(f"q shape {q.shape} does not fit the cache: batch {cache.batch}, head_dim "
                         f"{cache.head_dim}, query heads must be a multiple of {cache.num_kv_heads} KV heads")
    if is_concrete(cache.lengths) and bool(jnp.any(cache.lengths == 0)):
        raise ValueError("attention over an empty cache: append keys/values first")
    return q


def _check_policy(policy: CertPolicy, cache: TieredKVCache) -> None:
    """A CertPolicy whose layout is the cache's (`TieredKVCache.check_policy`)."""
    if not isinstance(policy, CertPolicy):
        raise TypeError(f"policy must be a certattn_jax.CertPolicy, got {type(policy).__name__}")
    cache.check_policy(policy)


def certified_attention_step(q: jax.Array, cache: TieredKVCache, policy: CertPolicy,
                             ) -> tuple[jax.Array, Certificate, TieredKVCache]:
    """Certified attention of q [B, Hq, d] over everything in the cache; returns (out [B, Hq, d] in q's dtype,
    Certificate with [B, Hq] leaves, the cache with its hot set updated)."""
    q = _check_query(q, cache)
    _check_policy(policy, cache)
    return ladder.run(q, cache, policy)


def certified_attention_fast(q: jax.Array, cache: TieredKVCache, policy: CertPolicy, top_rung: int = 1,
                             ) -> tuple[jax.Array, Certificate, TieredKVCache, jax.Array]:
    """The fast path: rungs 0 to top_rung (1, or 0: no conditional; `ladder.run_fast`). Returns (out,
    Certificate, cache, escalate [B]); where escalate[b] is set the step of sequence b must be answered by
    `certified_attention_step` instead."""
    q = _check_query(q, cache)
    _check_policy(policy, cache)
    return ladder.run_fast(q, cache, policy, top_rung)


def certified_attention(q: jax.Array, cache: TieredKVCache, policy: CertPolicy | None = None,
                        ) -> tuple[jax.Array, Certificate]:
    """Certified attention of q [B, Hq, d]: (out [B, Hq, d], Certificate). See module docstring."""
    out, cert, _ = certified_attention_step(q, cache, policy or CertPolicy())
    return out, cert


def dense_attention(q: jax.Array, cache: TieredKVCache, policy: CertPolicy | None = None) -> jax.Array:
    """Exact attention over the tier-2 originals (+ residual): what rung 4 returns. [B, Hq, d] in q's dtype.
    (`policy` is accepted for symmetry with certified_attention and unused.)"""
    q = _check_query(q, cache)
    k, v = exact_keys_values(cache)
    return dense_attention_f32(q, k, v, cache.lengths).astype(q.dtype)


def naive_attention(q: jax.Array, cache: TieredKVCache, policy: CertPolicy | None = None) -> jax.Array:
    """Attention over tier 1 alone (INT keys and values, residual exact), no certification. [B, Hq, d] in q's
    dtype.

    With `policy.tier1 == "pallas"` (and shapes the compiled kernel takes) one read of the quantized bytes by the
    tier-1 kernel (`NAIVE_VARIANT`, per-split value sums) plus the residual block's exact partials, combined in
    float32; otherwise XLA over dequantized copies. Both compute softmax(q k_hat) v_hat; they differ in float32
    rounding only (nothing is certified here, so the kernel may use its fastest variant)."""
    q = _check_query(q, cache)
    if policy is not None:
        _check_policy(policy, cache)
    if policy is not None and step.tier1_kernel_runs(cache, policy.tier1):
        return _naive_through_kernel(q, cache)
    B, H, nb, Bk, _ = cache.k_codes.shape
    d = cache.head_dim
    k_hat = quant.dequantize_keys(cache.k_codes, cache.k_scale, cache.k_zero, cache.key_bits)
    v_hat = quant.dequantize_values(cache.v_codes, cache.v_scale, cache.v_zero, cache.group_size,
                                    cache.value_bits)
    k = overlay_residual(k_hat.reshape(B, H, nb * Bk, d), cache.res_k, cache.flushed, cache.lengths)
    v = overlay_residual(v_hat.reshape(B, H, nb * Bk, d), cache.res_v, cache.flushed, cache.lengths)
    return dense_attention_f32(q.astype(jnp.float32), k, v, cache.lengths).astype(q.dtype)


# The fastest tier-1 kernel variant measured on the H200 (results/bench_kernels_int_variants_h200.json: 66 µs
# at 32K vs 82 for int_keys); its value-side rounding has no written bound, which naive attention does not need.
NAIVE_VARIANT = "int_kv"


def _naive_through_kernel(q: jax.Array, cache: TieredKVCache) -> jax.Array:
    from pallas_kernels import split_combine, tier1_pass  # pallas_kernels imports certattn_jax

    B, Hq, d = q.shape
    qt = step.query_terms(q, cache)
    arrays, layer = cache.tier1_arrays(in_place=NAIVE_VARIANT == "int_kv")  # (stacked reads: int_kv only)
    parts = tier1_pass.tier1_pass(qt.q_scaled, *arrays, cache.flushed // cache.block_size,
                                  group_size=cache.group_size, key_bits=cache.key_bits,
                                  value_bits=cache.value_bits, score_scale=1.0, variant=NAIVE_VARIANT, layer=layer)
    res, _ = step.residual_partials(qt, cache)
    out, _ = split_combine.combine(parts, [(res.m, res.l, res.acc)])
    return out.reshape(B, Hq, d).astype(q.dtype)
