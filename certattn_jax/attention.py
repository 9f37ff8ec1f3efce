"""Certified, naive and dense attention of one decode step over a TieredKVCache.

    out, cert = certified_attention(q, cache, policy)          # q [B, Hq, d] -> out [B, Hq, d], Certificate
    out, cert, cache = certified_attention_step(q, cache, policy)   # also returns the cache (hot set updated)
    out = naive_attention(q, cache)                             # INT8/INT4 everywhere, no certificate
    out = dense_attention(q, cache)                             # exact, over the tier-2 originals

Certified attention, per KV head (its G query heads share promotions):
  1. score every full block with INT8 keys, the residual block with exact keys; per block keep the
     flash-decoding partials (max score, sum of exp, exp-weighted value sum) -> estimated block masses;
  2. pick the top k_max blocks, and K* of them covering tau_cov of the mass (select.py); make them resident
     in the device hot set (tier-2 fetches only for blocks that are not);
  3. recombine with exact partials for the promoted blocks, and bound the error (bounds.py);
  4. climb the ladder (ladder.py) for heads whose bound exceeds the tolerance or whose ranking check fails.
All shapes are static; the heavy rungs sit behind lax.cond.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from certattn_jax import bounds, quant, select
from certattn_jax.cache import TieredKVCache
from certattn_jax.certificate import Certificate
from certattn_jax.kv_cache import is_concrete, masked_attention_f32
from certattn_jax.policy import CertPolicy

_HI = "highest"


class Partials(NamedTuple):
    """Flash-decoding partials of attention items (blocks): m [..., n] max score, l [..., n] sum of
    exp(s - m), acc [..., n, d] sum of exp(s - m) * v."""

    m: jax.Array
    l: jax.Array
    acc: jax.Array


def partials(scores: jax.Array, values: jax.Array) -> Partials:
    """scores [B, H, G, n, t] (-inf = masked), values [B, H, n, t, d] shared by the G query heads."""
    m = jnp.max(scores, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(scores - m_safe[..., None])
    l = jnp.sum(w, axis=-1)
    acc = jnp.einsum("bhgnt,bhntd->bhgnd", w, values, precision=_HI)
    return Partials(m=m, l=l, acc=acc)


def mask_partials(p: Partials, keep: jax.Array) -> Partials:
    """Drop items where keep [..., n] (broadcast over G) is False."""
    return Partials(m=jnp.where(keep, p.m, -jnp.inf), l=jnp.where(keep, p.l, 0.0),
                    acc=jnp.where(keep[..., None], p.acc, 0.0))


def combine(parts: list[Partials]) -> tuple[jax.Array, jax.Array]:
    """Merge item partials: returns (out [B, H, G, d] float32, log_masses [B, H, G, n_total]).

    log_masses are the natural logs of each item's share of the softmax (-inf for empty items). They are
    kept in log space because a share can underflow float32 (below e^-87) while its error term, e^Delta
    times larger, does not (bounds.tv_bound).
    """
    m = jnp.concatenate([p.m for p in parts], axis=-1)
    l = jnp.concatenate([p.l for p in parts], axis=-1)
    acc = jnp.concatenate([p.acc for p in parts], axis=-2)
    big = jnp.max(m, axis=-1, keepdims=True)
    big = jnp.where(jnp.isfinite(big), big, 0.0)
    w = jnp.where(jnp.isfinite(m), jnp.exp(m - big), 0.0)
    denom = jnp.sum(l * w, axis=-1, keepdims=True)
    safe = jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgn,bhgnd->bhgd", w, acc, precision=_HI) / safe
    item_lm = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return out, item_lm - (big + jnp.log(safe))


def log_mass(p: Partials) -> jax.Array:
    """log sum_i e^{s_i} of each item (-inf for empty items)."""
    return jnp.where(p.l > 0, p.m + jnp.log(jnp.where(p.l > 0, p.l, 1.0)), -jnp.inf)


class StepContext(NamedTuple):
    """Everything of one step that does not depend on the rung."""

    q32: jax.Array  # [B, H, G, d]
    q_abs: jax.Array
    apx: Partials  # all full blocks, INT keys / INT values  [B, H, G, nb]
    apx_delta: jax.Array  # [B, H, G, nb]
    apx_lm: jax.Array  # [B, H, G, nb] INT8 log-mass
    log_norm: jax.Array  # [B, H, G] log of the INT8 estimate's softmax normalizer (all blocks + residual)
    res: Partials  # residual block, exact  [B, H, G, 1]
    res_delta: jax.Array  # [B, H, G, 1]
    block_valid: jax.Array  # [B, nb]
    eta: jax.Array  # [B, H, nb]
    value_range: jax.Array  # [B, H] ||r||_2
    key_scale: jax.Array  # [B, H] E_key = TV * key_scale, key_scale = min(||r||_2, 2 max_i ||v_i||_2)
    value_abs: jax.Array  # [B, H, d] bound on |v_tilde_ic|
    tolerance: jax.Array  # [B, H, G]


class StageResult(NamedTuple):
    out: jax.Array  # [B, H, G, d] in q's dtype
    bound: jax.Array  # [B, H, G]
    e_key: jax.Array
    e_val: jax.Array
    e_num: jax.Array
    ranking_ok: jax.Array
    k_star: jax.Array  # [B, H, G] int32
    masses: jax.Array  # [B, H, G, nb] mass of each approx (non-exact) block, 0 for exact ones


class ExactItems(NamedTuple):
    """Blocks attended with exact keys and values: partials [B, H, G, S], their block ids [B, H, S],
    which are used at this rung (active [B, H, S]) and their deltas [B, H, G, S]."""

    parts: Partials
    ids: jax.Array
    active: jax.Array
    delta: jax.Array


def _check_query(q: jax.Array, cache: TieredKVCache) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, d], got shape {q.shape}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q must be floating point, got {q.dtype}")
    B, Hq, d = q.shape
    if B != cache.batch or d != cache.head_dim or Hq % cache.num_kv_heads:
        raise ValueError(f"q shape {q.shape} does not fit the cache: batch {cache.batch}, head_dim "
                         f"{cache.head_dim}, query heads must be a multiple of {cache.num_kv_heads} KV heads")
    if is_concrete(cache.lengths) and bool(jnp.any(cache.lengths == 0)):
        raise ValueError("attention over an empty cache: append keys/values first")


def build_context(q: jax.Array, cache: TieredKVCache, policy: CertPolicy) -> StepContext:
    B, Hq, d = q.shape
    H, nb, Bk = cache.num_kv_heads, cache.num_blocks, cache.block_size
    G = Hq // H
    inv_sqrt_d = 1.0 / math.sqrt(d)
    q32 = q.astype(jnp.float32).reshape(B, H, G, d)
    q_abs = jnp.abs(q32)
    block_valid = jnp.arange(nb)[None, :] < (cache.flushed // Bk)[:, None]

    k_hat = quant.dequantize_keys(cache.k_codes, cache.k_scale, cache.k_zero, cache.key_bits)
    s_apx = jnp.einsum("bhgd,bhntd->bhgnt", q32, k_hat, precision=_HI) * inv_sqrt_d
    s_apx = jnp.where(block_valid[:, None, None, :, None], s_apx, -jnp.inf)
    v_hat = quant.dequantize_values(cache.v_codes, cache.v_scale, cache.v_zero, cache.group_size,
                                    cache.value_bits)
    apx = partials(s_apx, v_hat)
    apx_delta = bounds.key_delta_quantized(q_abs, cache.k_scale, cache.k_zero, cache.key_bits)

    r_count = cache.lengths - cache.flushed
    res_valid = jnp.arange(Bk)[None, :] < r_count[:, None]  # [B, Bk]
    res_k = cache.res_k.astype(jnp.float32)
    s_res = jnp.einsum("bhgd,bhtd->bhgt", q32, res_k, precision=_HI) * inv_sqrt_d
    s_res = jnp.where(res_valid[:, None, None, :], s_res, -jnp.inf)[:, :, :, None, :]
    res = partials(s_res, cache.res_v.astype(jnp.float32)[:, :, None])
    res_kmax = jnp.max(jnp.where(res_valid[:, None, :, None], jnp.abs(res_k), 0.0), axis=2)[:, :, None]
    res_delta = bounds.key_delta_exact(q_abs, res_kmax)

    eta = jnp.where(block_valid[:, None, :], cache.v_err, 0.0)
    has_values = jnp.isfinite(cache.v_min) & jnp.isfinite(cache.v_max)
    v_range = jnp.where(has_values, cache.v_max - cache.v_min, 0.0)
    value_range = bounds.l2(v_range)
    eta_inf = jnp.max(eta, axis=-1)
    value_abs = jnp.where(has_values, jnp.maximum(jnp.abs(cache.v_min), jnp.abs(cache.v_max)), 0.0)
    value_abs = value_abs + eta_inf[..., None]
    tolerance = policy.eps * value_range + policy.abs_tol
    res_norm = jnp.max(jnp.where(res_valid[:, None, :], bounds.l2(cache.res_v.astype(jnp.float32)), 0.0), axis=-1)
    max_norm = jnp.maximum(jnp.max(jnp.where(block_valid[:, None, :], cache.v_norm, 0.0), axis=-1), res_norm)
    all_lm = jnp.concatenate([log_mass(apx), log_mass(res)], axis=-1)
    log_norm = jax.scipy.special.logsumexp(all_lm, axis=-1)
    return StepContext(q32=q32, q_abs=q_abs, apx=apx, apx_delta=apx_delta, apx_lm=log_mass(apx),
                       log_norm=log_norm, res=res,
                       res_delta=res_delta, block_valid=block_valid, eta=eta, value_range=value_range,
                       key_scale=key_term_scale(value_range, max_norm),
                       value_abs=value_abs, tolerance=jnp.broadcast_to(tolerance[..., None], (B, H, G)))


def key_term_scale(value_range: jax.Array, max_value_norm: jax.Array) -> jax.Array:
    """The factor turning TV into E_key: ||sum_i (p_i - p_hat_i) v_i|| <= TV * min(||r||_2, 2 max_i ||v_i||_2)
    (centre c = mid-range per channel, or c = 0; docs/bounds.md section 3)."""
    return jnp.minimum(value_range, 2.0 * max_value_norm)


def exact_items(ctx: StepContext, keys: jax.Array, values: jax.Array, ids: jax.Array, active: jax.Array,
                ) -> ExactItems:
    """Exact partials for blocks keys/values [B, H, S, Bk, d] (device), ids [B, H, S] (-1 = empty slot)."""
    d = keys.shape[-1]
    k32 = keys.astype(jnp.float32)
    s = jnp.einsum("bhgd,bhstd->bhgst", ctx.q32, k32, precision=_HI) * (1.0 / math.sqrt(d))
    filled = (ids >= 0)[:, :, None, :, None]
    s = jnp.where(filled, s, -jnp.inf)
    parts = partials(s, values.astype(jnp.float32))
    delta = bounds.key_delta_exact(ctx.q_abs, jnp.max(jnp.abs(k32), axis=-2))
    return ExactItems(parts=parts, ids=ids, active=active & (ids >= 0), delta=delta)


def evaluate_stage(ctx: StepContext, exact: list[ExactItems], out_dtype, policy: CertPolicy) -> StageResult:
    """Output and bound when the blocks of `exact` (where active) use exact keys and values, the other full
    blocks INT keys/values, and the residual is exact."""
    nb = ctx.apx.m.shape[-1]
    is_exact = jnp.zeros(ctx.apx.m.shape[:2] + (nb,), bool)
    for ex in exact:
        hit = (ex.ids[..., :, None] == jnp.arange(nb)) & ex.active[..., None]
        is_exact = is_exact | jnp.any(hit, axis=-2)
    keep = (~is_exact)[:, :, None, :]
    apx = mask_partials(ctx.apx, keep)
    ex_parts = [mask_partials(ex.parts, ex.active[:, :, None, :]) for ex in exact]
    out32, log_masses = combine([apx, *ex_parts, ctx.res])
    n_items = log_masses.shape[-1]
    deltas = jnp.concatenate([ctx.apx_delta, *[ex.delta for ex in exact], ctx.res_delta], axis=-1)

    rel = bounds.sum_error(policy.block_size, n_items) + 2 * bounds.EPS_WEIGHT
    mass_rel = 2 * rel
    tv = bounds.tv_bound(log_masses, deltas, mass_rel)
    e_key = tv * ctx.key_scale[..., None]
    apx_lm = log_masses[..., :nb]
    e_val = bounds.weighted_sum(apx_lm, ctx.eta[:, :, None, :], mass_rel)
    out, cast = bounds.cast_error(out32, out_dtype)
    e_num = bounds.numeric_error(ctx.value_abs, rel)[..., None] + cast
    bound = e_key + e_val + e_num

    norm = ctx.log_norm[..., None]
    approx_lm, exact_lm, active = [], [], []
    for ex in exact:
        approx_lm.append(jnp.take_along_axis(ctx.apx_lm, jnp.maximum(ex.ids, 0)[:, :, None, :], axis=-1) - norm)
        exact_lm.append(log_mass(ex.parts) - norm)
        active.append(ex.active)
    tail_upper = jnp.where(keep & ctx.block_valid[:, None, None, :], ctx.apx_lm + ctx.apx_delta - norm, -jnp.inf)
    ranking_ok = select.ranking_consistent(jnp.concatenate(approx_lm, -1), jnp.concatenate(exact_lm, -1),
                                           jnp.concatenate(active, -1), tail_upper, policy.rank_margin)
    ranking_ok = jnp.broadcast_to(ranking_ok[:, :, None], log_masses.shape[:3])
    k_star = sum(jnp.sum(ex.active, axis=-1) for ex in exact)
    k_star = jnp.broadcast_to(k_star[:, :, None], out.shape[:3]).astype(jnp.int32)
    return StageResult(out=out, bound=bound, e_key=e_key, e_val=e_val, e_num=e_num, ranking_ok=ranking_ok,
                       k_star=k_star, masses=jnp.where(keep, jnp.exp(apx_lm), 0.0))


def certified_attention_step(q: jax.Array, cache: TieredKVCache, policy: CertPolicy,
                             ) -> tuple[jax.Array, Certificate, TieredKVCache]:
    """Certified attention of q [B, Hq, d] over everything in the cache; returns (out [B, Hq, d] in q's dtype,
    Certificate with [B, Hq] leaves, the cache with its hot set updated)."""
    from certattn_jax import ladder

    _check_query(q, cache)
    cache.check_policy(policy)
    return ladder.run(q, cache, policy)


def certified_attention(q: jax.Array, cache: TieredKVCache, policy: CertPolicy | None = None,
                        ) -> tuple[jax.Array, Certificate]:
    """Certified attention of q [B, Hq, d]: (out [B, Hq, d], Certificate). See module docstring."""
    out, cert, _ = certified_attention_step(q, cache, policy or CertPolicy())
    return out, cert


def _overlay_residual(full: jax.Array, res: jax.Array, flushed: jax.Array, lengths: jax.Array) -> jax.Array:
    """full [B, H, S, d] with positions [flushed, lengths) taken from the residual block res [B, H, Bk, d]."""
    S, Bk = full.shape[2], res.shape[2]
    pos = jnp.arange(S)
    idx = jnp.clip(pos[None, :] - flushed[:, None], 0, Bk - 1)  # [B, S]
    taken = jnp.take_along_axis(res, idx[:, None, :, None], axis=2)
    use = (pos[None, :] >= flushed[:, None]) & (pos[None, :] < lengths[:, None])
    return jnp.where(use[:, None, :, None], taken.astype(full.dtype), full)


def exact_keys_values(cache: TieredKVCache) -> tuple[jax.Array, jax.Array]:
    """The originals, [B, H, capacity, d] each: tier 2 (moved to the device) with the residual overlaid."""
    from certattn_jax import tiers

    B, H, nb, Bk, d = cache.host_k.shape
    k = tiers.read_all(cache.host_k).reshape(B, H, nb * Bk, d)
    v = tiers.read_all(cache.host_v).reshape(B, H, nb * Bk, d)
    return (_overlay_residual(k, cache.res_k, cache.flushed, cache.lengths),
            _overlay_residual(v, cache.res_v, cache.flushed, cache.lengths))


def dense_attention_f32(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """Exact attention of q [B, Hq, d] over k, v [B, H, S, d] (first lengths[b] valid): float32 [B, Hq, d].
    The same computation as the dense KV cache's decode step (masked_attention)."""
    out = masked_attention_f32(q[:, None], k, v, (lengths - 1)[:, None], lengths)
    return out[:, 0]


def dense_attention(q: jax.Array, cache: TieredKVCache, policy: CertPolicy | None = None) -> jax.Array:
    """Exact attention over the tier-2 originals (+ residual): what rung 4 returns. [B, Hq, d] in q's dtype.
    (`policy` is accepted for symmetry with certified_attention and unused.)"""
    _check_query(q, cache)
    k, v = exact_keys_values(cache)
    return dense_attention_f32(q, k, v, cache.lengths).astype(q.dtype)


def naive_attention(q: jax.Array, cache: TieredKVCache, policy: CertPolicy | None = None) -> jax.Array:
    """Attention over tier 1 alone (INT keys and values dequantized, residual exact), no certification.
    (`policy` is accepted for symmetry with certified_attention and unused.)"""
    _check_query(q, cache)
    B, H, nb, Bk, _ = cache.k_codes.shape
    d = cache.head_dim
    k_hat = quant.dequantize_keys(cache.k_codes, cache.k_scale, cache.k_zero, cache.key_bits)
    v_hat = quant.dequantize_values(cache.v_codes, cache.v_scale, cache.v_zero, cache.group_size,
                                    cache.value_bits)
    k = _overlay_residual(k_hat.reshape(B, H, nb * Bk, d), cache.res_k, cache.flushed, cache.lengths)
    v = _overlay_residual(v_hat.reshape(B, H, nb * Bk, d), cache.res_v, cache.flushed, cache.lengths)
    return dense_attention_f32(q.astype(jnp.float32), k, v, cache.lengths).astype(q.dtype)
