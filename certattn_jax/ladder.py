"""The fallback ladder: which rung each query head is answered at, jit-compatible.

  rung 0  certified as is: the top-K* blocks (covering tau_cov of the estimated mass) exact, tail INT8;
  rung 1  widen K*: every one of the k_max hot candidates, plus the next k_max candidates fetched from tier 2;
  rung 2  also fetch exact keys+values from tier 2 for blocks whose share of E_val exceeds v_tol;
  rung 3  exact dense attention for the head (its whole tier 2 fetched);
  rung 4  exact dense attention for the whole layer (that sequence's every head), when at least
          layer_fallback_fraction of its heads would need rung 3 — bit-for-bit the dense path's output.
A head stops at the first rung whose bound is within tolerance and whose ranking check passes. Rungs 1-4 are
computed only when some head needs them (lax.cond); heads whose cache holds NaN/Inf go straight to rung 3/4 and
get an infinite bound (nothing can be proven about them).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from certattn_jax import bounds, select, tiers
from certattn_jax.attention import (
    ExactItems,
    Partials,
    StageResult,
    _overlay_residual,
    build_context,
    dense_attention_f32,
    evaluate_stage,
    exact_items,
    exact_keys_values,
    log_mass,
)
from certattn_jax.cache import TieredKVCache
from certattn_jax.certificate import Certificate
from certattn_jax.policy import CertPolicy


def _skipped_like(st: StageResult) -> StageResult:
    """A stage that was not run: nobody may select it."""
    inf = jnp.full_like(st.bound, jnp.inf)
    return st._replace(bound=inf, e_key=inf, e_val=inf, e_num=inf, ranking_ok=jnp.zeros_like(st.ranking_ok))


def _no_items(B: int, H: int, G: int, S: int, d: int) -> ExactItems:
    """S empty exact-item slots (what a skipped fetch returns)."""
    parts = Partials(m=jnp.full((B, H, G, S), -jnp.inf), l=jnp.zeros((B, H, G, S)), acc=jnp.zeros((B, H, G, S, d)))
    return ExactItems(parts=parts, ids=jnp.full((B, H, S), -1, jnp.int32), active=jnp.zeros((B, H, S), bool),
                      delta=jnp.zeros((B, H, G, S)))


def exact_bound(q_abs: jax.Array, k_abs_max: jax.Array, value_abs: jax.Array, key_scale: jax.Array,
                seq_len: int, value_dtype) -> tuple[jax.Array, jax.Array]:
    """(e_key, e_num before the output cast) of exact dense attention computed in float32 over seq_len keys.

    q_abs [..., G, d], k_abs_max [..., d] (max |k| over valid keys), value_abs [..., d] (max |v|),
    key_scale [...] (attention.key_term_scale): float rounding of the scores (tanh bound) and of the
    softmax-weighted sum, including
    the cast of the probabilities to the value dtype that the dense path makes.
    """
    d = q_abs.shape[-1]
    delta = jnp.einsum("...gd,...d->...g", q_abs, k_abs_max, precision="highest") * bounds.gamma(d + 6) / math.sqrt(d)
    e_key = jnp.tanh(delta / 2) * (1 + 4 * bounds.U) * key_scale[..., None]
    rel = bounds.gamma(seq_len) + 2 * bounds.EPS_WEIGHT + bounds.low_precision_unit(value_dtype)
    e_num = bounds.numeric_error(value_abs, rel)[..., None]
    return e_key, jnp.broadcast_to(e_num, e_key.shape)


def _value_abs_exact(cache: TieredKVCache) -> jax.Array:
    ok = jnp.isfinite(cache.v_min) & jnp.isfinite(cache.v_max)
    return jnp.where(ok, jnp.maximum(jnp.abs(cache.v_min), jnp.abs(cache.v_max)), 0.0)


def _rung3_heads(q: jax.Array, cache: TieredKVCache, need: jax.Array, ctx):
    """Exact dense attention for the KV heads where need [B, H]: out [B, H, G, d] f32, e_key, e_num [B, H, G]."""
    B, H = need.shape
    G, d = ctx.q32.shape[2], ctx.q32.shape[3]
    nb, Bk = cache.num_blocks, cache.block_size
    S = nb * Bk
    q_heads = q.reshape(B, H, G, d)
    v_abs = _value_abs_exact(cache)

    def one(e, acc):
        b, h = e // H, e % H

        def compute(acc):
            out, ek, en = acc
            k = tiers.read_head(cache.host_k, b, h).reshape(1, 1, S, d)
            v = tiers.read_head(cache.host_v, b, h).reshape(1, 1, S, d)
            fl, ln = cache.flushed[b][None], cache.lengths[b][None]
            k = _overlay_residual(k, cache.res_k[b, h][None, None], fl, ln)
            v = _overlay_residual(v, cache.res_v[b, h][None, None], fl, ln)
            o = dense_attention_f32(q_heads[b, h][None], k, v, ln)[0]  # [G, d]
            valid = (jnp.arange(S) < ln[0])[:, None]
            kmax = jnp.max(jnp.where(valid, jnp.abs(k[0, 0].astype(jnp.float32)), 0.0), axis=0)
            k_e, n_e = exact_bound(ctx.q_abs[b, h], kmax, v_abs[b, h], ctx.key_scale[b, h], S, cache.dtype)
            return (jax.lax.dynamic_update_slice(out, o[None, None], (b, h, 0, 0)),
                    jax.lax.dynamic_update_slice(ek, k_e[None, None], (b, h, 0)),
                    jax.lax.dynamic_update_slice(en, n_e[None, None], (b, h, 0)))

        return jax.lax.cond(need[b, h], compute, lambda a: a, acc)

    init = (jnp.zeros((B, H, G, d), jnp.float32), jnp.full((B, H, G), jnp.inf), jnp.full((B, H, G), jnp.inf))
    return jax.lax.fori_loop(0, B * H, one, init)


def _rung4_layer(q: jax.Array, cache: TieredKVCache, ctx):
    """Exact dense attention for every head (the dense path's computation): out [B, Hq, d] f32, bounds."""
    B, Hq, d = q.shape
    H = cache.num_kv_heads
    G = Hq // H
    k, v = exact_keys_values(cache)
    out = dense_attention_f32(q, k, v, cache.lengths)
    S = k.shape[2]
    valid = (jnp.arange(S)[None, :] < cache.lengths[:, None])[:, None, :, None]
    kmax = jnp.max(jnp.where(valid, jnp.abs(k.astype(jnp.float32)), 0.0), axis=2)  # [B, H, d]
    e_key, e_num = exact_bound(ctx.q_abs, kmax, _value_abs_exact(cache), ctx.key_scale, S, cache.dtype)
    return out.reshape(B, H, G, d), e_key, e_num


def run(q: jax.Array, cache: TieredKVCache, policy: CertPolicy) -> tuple[jax.Array, Certificate, TieredKVCache]:
    B, Hq, d = q.shape
    H, nb, K = cache.num_kv_heads, cache.num_blocks, cache.k_max
    G = Hq // H
    ctx = build_context(q, cache, policy)

    # Selection from the INT8 estimate, then make the candidates resident in the hot set.
    # INT8 estimate of each block's (and the residual's) share of attention, from the context's normalizer
    est = jnp.exp(jnp.concatenate([ctx.apx_lm, log_mass(ctx.res)], axis=-1) - ctx.log_norm[..., None])
    kp = policy.k_max
    ranked, k_star = select.select_candidates(est[..., :nb], ctx.block_valid, est[..., nb], 2 * kp,
                                             policy.tau_cov)
    k_star = jnp.minimum(k_star, kp)
    cand, wide_extra = ranked[..., :kp], ranked[..., kp:]
    if kp < K:  # the cache has more hot slots than this policy promotes
        cand = jnp.concatenate([cand, jnp.full(cand.shape[:-1] + (K - kp,), -1, cand.dtype)], -1)
    hot_ids, slot_of_cand, fetch_into = select.plan_residency(cache.hot_ids, cand)
    hot_k, hot_v = select.fetch_blocks(cache.hot_k, cache.hot_v, cache.host_k, cache.host_v, fetch_into)
    cache = cache.replace(hot_k=hot_k, hot_v=hot_v, hot_ids=hot_ids)
    slot_rank = jnp.min(jnp.where(slot_of_cand[..., None, :] == jnp.arange(K)[:, None], jnp.arange(K), K), axis=-1)
    n_cand = jnp.sum(cand >= 0, axis=-1)
    hot = exact_items(ctx, hot_k, hot_v, hot_ids, slot_rank < k_star[..., None])
    hot_wide = hot._replace(active=(slot_rank < n_cand[..., None]) & (hot_ids >= 0))

    bad = cache.nonfinite[:, :, None]
    tol = ctx.tolerance

    def passes(st: StageResult) -> jax.Array:
        return (st.bound <= tol) & st.ranking_ok & ~bad

    st0 = evaluate_stage(ctx, [hot], q.dtype, policy)
    ok0 = passes(st0)

    def fetch_exact(ids: jax.Array) -> ExactItems:
        """Exact keys+values of blocks ids [B, H, S] (-1 = none) fetched from tier 2 into temporaries."""
        shape = ids.shape + (cache.block_size, d)
        xk, xv = select.fetch_blocks(jnp.zeros(shape, cache.dtype), jnp.zeros(shape, cache.dtype),
                                     cache.host_k, cache.host_v, ids)
        return exact_items(ctx, xk, xv, ids, ids >= 0)

    def widened_stage() -> tuple[StageResult, ExactItems]:
        # only the KV heads that need it fetch anything
        need = jnp.any(~ok0, axis=-1, keepdims=True)
        extra = fetch_exact(jnp.where(need, wide_extra, -1))
        return evaluate_stage(ctx, [hot_wide, extra], q.dtype, policy), extra

    st1, wide = jax.lax.cond(jnp.any(~ok0), widened_stage,
                             lambda: (_skipped_like(st0), _no_items(B, H, G, kp, d)))
    ok1 = passes(st1)

    def value_stage() -> StageResult:
        share = st1.masses * ctx.eta[:, :, None, :] / jnp.maximum(st1.e_val, 1e-30)[..., None]
        share = jnp.max(jnp.where((~ok1)[..., None], share, 0.0), axis=2)  # [B, H, nb]
        V = min(policy.v_max, nb)
        top, ids = jax.lax.top_k(share, V)
        ids = jnp.where(top > policy.v_tol, ids, -1)
        return evaluate_stage(ctx, [hot_wide, wide, fetch_exact(ids)], q.dtype, policy)

    if policy.v_max > 0:
        st2 = jax.lax.cond(jnp.any(~ok0 & ~ok1), value_stage, lambda: _skipped_like(st0))
    else:
        st2 = _skipped_like(st0)
    ok2 = passes(st2)

    need3 = ~ok0 & ~ok1 & ~ok2  # [B, H, G]
    need4 = jnp.mean(need3, axis=(1, 2)) >= policy.layer_fallback_fraction  # [B]
    need3_kv = jnp.any(need3, axis=-1) & ~need4[:, None]
    zeros_out = jnp.zeros((B, H, G, d), jnp.float32)
    infs = jnp.full((B, H, G), jnp.inf)
    out3, ek3, en3 = jax.lax.cond(jnp.any(need3_kv), lambda: _rung3_heads(q, cache, need3_kv, ctx),
                                  lambda: (zeros_out, infs, infs))
    out4, ek4, en4 = jax.lax.cond(jnp.any(need4), lambda: _rung4_layer(q, cache, ctx),
                                  lambda: (zeros_out, infs, infs))

    rung = jnp.where(ok0, 0, jnp.where(ok1, 1, jnp.where(ok2, 2, 3)))
    rung = jnp.where(need4[:, None, None], 4, rung).astype(jnp.int32)

    def pick(a0, a1, a2, a3, a4):
        r = rung.reshape(rung.shape + (1,) * (a0.ndim - rung.ndim))
        return jnp.where(r == 0, a0, jnp.where(r == 1, a1, jnp.where(r == 2, a2, jnp.where(r == 3, a3, a4))))

    out_exact3, cast3 = bounds.cast_error(out3, q.dtype)
    out_exact4, cast4 = bounds.cast_error(out4, q.dtype)
    out = pick(st0.out, st1.out, st2.out, out_exact3, out_exact4)
    zero = jnp.zeros_like(st0.bound)
    e_key = pick(st0.e_key, st1.e_key, st2.e_key, ek3, ek4)
    e_val = pick(st0.e_val, st1.e_val, st2.e_val, zero, zero)
    e_num = pick(st0.e_num, st1.e_num, st2.e_num, en3 + cast3, en4 + cast4)
    bound = jnp.where(bad, jnp.inf, e_key + e_val + e_num)
    all_blocks = jnp.broadcast_to(jnp.sum(ctx.block_valid, axis=-1)[:, None, None], rung.shape).astype(jnp.int32)
    k_used = pick(st0.k_star, st1.k_star, st2.k_star, all_blocks, all_blocks)
    true_ = jnp.ones_like(st0.ranking_ok)
    ranking_ok = pick(st0.ranking_ok, st1.ranking_ok, st2.ranking_ok, true_, true_)

    def heads(x):
        return x.reshape(B, Hq, *x.shape[3:])

    cert = Certificate(error_bound=heads(bound), e_key=heads(e_key), e_val=heads(e_val), e_num=heads(e_num),
                       tolerance=heads(tol), k_star=heads(k_used), rung=heads(rung), ranking_ok=heads(ranking_ok),
                       certified=heads(bound <= tol))
    return heads(out), cert, cache


__all__ = ["run", "exact_bound", "ExactItems"]
