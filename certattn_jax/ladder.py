"""The fallback ladder: which rung each query head is answered at, jit-compatible.

  rung 0  certified as is: the top-K* blocks (covering tau_cov of the estimated mass) that the device hot set
          holds exact, everything else INT8 (no tier-2 read: a step answered at rung 0 moves nothing);
  rung 1  widen K*: all of the top 2 k_max candidates exact, the ones not resident fetched from tier 2; the
          hot set then takes the top k_max for later steps;
  rung 2  also fetch exact keys+values from tier 2 for blocks whose share of E_val exceeds v_tol;
  rung 3  exact dense attention for the head (its whole tier 2 fetched);
  rung 4  exact dense attention for the whole layer (that sequence's every head), when at least
          layer_fallback_fraction of its heads would need rung 3 — bit-for-bit the dense path's output.
A head stops at the first rung whose bound is within tolerance and whose ranking check passes. Rungs 1-4 are
computed only when some head needs them (lax.cond); heads whose cache or query holds NaN/Inf go straight to
rung 3/4 and get an infinite bound (nothing can be proven about them). Each rung is a named function under a
`jax.named_scope`, so profiles read "rung1_widen" etc.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from certattn_jax import bounds, select, tiers
from certattn_jax.cache import TieredKVCache
from certattn_jax.certificate import Certificate
from certattn_jax.policy import CertPolicy
from certattn_jax.step import (
    ExactItems,
    Partials,
    StageResult,
    StepContext,
    build_context,
    dense_attention_f32,
    evaluate_stage,
    exact_items,
    exact_keys_values,
    log_mass,
    overlay_residual,
    rung0_fused,
    uses_fused_rung0,
)

__all__ = ["run", "run_fast", "exact_bound"]


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
                seq_len: int) -> tuple[jax.Array, jax.Array]:
    """(e_key, e_num before the output cast) of exact dense attention (kv_cache.masked_attention_f32) over
    seq_len keys.

    q_abs [..., G, d], k_abs_max [..., d] (max |k| over valid keys), value_abs [..., d] (max |v|),
    key_scale [...] (step.key_term_scale): the float32 rounding of the raw scores (tanh bound -> key term),
    the weights exp((r - m)/sqrt(d)), the seq_len-term sums and the probabilities x values product at float32
    precision (docs/bounds.md section 7).
    """
    d = q_abs.shape[-1]
    dot = jnp.einsum("...gd,...d->...g", q_abs, k_abs_max, precision="highest")
    delta = (bounds.round_up_sum(dot, d + 2) * bounds.gamma(d + 6) / math.sqrt(d) + bounds.flush_delta(q_abs)
             + bounds.query_flush_delta(k_abs_max)[..., None])
    tv = jnp.tanh(delta / 2) * (1 + 4 * bounds.U)
    e_key = bounds.key_error(jnp.where(jnp.isnan(tv), jnp.inf, tv), key_scale[..., None])
    # one exp of an argument rounded three times; the normalizer's sum, the probabilities' division and the
    # seq_len-term probabilities x values sum
    sum_rel = 2 * bounds.gamma(seq_len + 1) + bounds.U + bounds.SPLIT_PROBS_ERROR
    factor = bounds.softmax_average_error(seq_len, sum_rel, n_exps=1, arg_roundings=3)
    e_num = bounds.numeric_error(value_abs, factor) + bounds.flush_floor(seq_len, value_abs)
    return e_key, jnp.broadcast_to(e_num[..., None], e_key.shape)


def _value_abs_exact(cache: TieredKVCache) -> jax.Array:
    ok = jnp.isfinite(cache.v_min) & jnp.isfinite(cache.v_max)
    return jnp.where(ok, jnp.maximum(jnp.abs(cache.v_min), jnp.abs(cache.v_max)), 0.0) * (1.0 + 2 * bounds.U)


class Selection(NamedTuple):
    """The step's candidate blocks and what of them is resident in the device hot set (no tier-2 read made):
    hot [rung 0] the resident top-K* candidates, hot_wide [rung 1] every resident block among the top 2 k_max
    candidates, wide_missing [B, H, 2 k_max] the top 2 k_max candidates that are not resident (-1 elsewhere),
    cand [B, H, K] the top k_max candidates (padded with -1 to the cache's K slots): the hot set's next content."""

    hot: ExactItems
    hot_wide: ExactItems
    wide_missing: jax.Array
    cand: jax.Array


def select_and_promote(ctx: StepContext, cache: TieredKVCache, policy: CertPolicy) -> Selection:
    """INT8 estimate -> top candidates -> promote those the hot set already holds. Never reads tier 2: a wanted
    block that is not resident stays INT8 at rung 0 (its Delta in the bound; the ranking check sees it in the
    tail), and is fetched by rung 1, which also refreshes the hot set for later steps (DESIGN.md section 4: host
    traffic stays off the per-step path)."""
    nb, K = cache.num_blocks, cache.k_max
    est = jnp.exp(jnp.concatenate([ctx.apx_lm, log_mass(ctx.res)], axis=-1) - ctx.log_norm[..., None])
    kp = policy.k_max
    ranked, k_star = select.select_candidates(est[..., :nb], ctx.block_valid, est[..., nb], 2 * kp,
                                              policy.tau_cov)
    k_star = jnp.minimum(k_star, kp)
    hot_ids = cache.hot_ids
    match = (hot_ids[..., :, None] == ranked[..., None, :]) & (hot_ids[..., :, None] >= 0)  # [B, H, K, 2kp]
    slot_rank = jnp.min(jnp.where(match, jnp.arange(2 * kp), 2 * kp), axis=-1)  # rank of each slot's block
    hot = exact_items(ctx, cache.hot_k, cache.hot_v, hot_ids, slot_rank < k_star[..., None])
    hot_wide = hot._replace(active=(slot_rank < 2 * kp) & (hot_ids >= 0))
    resident = jnp.any(match, axis=-2)  # [B, H, 2kp]
    wide_missing = jnp.where(resident | (ranked < 0), -1, ranked)
    # what rung 1 makes resident: the top k_max, or, where the cache has more hot slots than this policy
    # promotes, as much of rung 1's widened set (the top 2 k_max) as fits, so that a later rung 1 finds it on the
    # device instead of reading tier 2 again
    n_res = min(K, 2 * kp)
    cand = ranked[..., :n_res]
    if n_res < K:
        cand = jnp.concatenate([cand, jnp.full(cand.shape[:-1] + (K - n_res,), -1, cand.dtype)], -1)
    return Selection(hot=hot, hot_wide=hot_wide, wide_missing=wide_missing, cand=cand)


def _fetch_exact(ctx: StepContext, cache: TieredKVCache, ids: jax.Array,
                 ) -> tuple[ExactItems, jax.Array, jax.Array]:
    """Exact keys+values of blocks ids [B, H, S] (-1 = none) fetched from tier 2 into temporaries: (items, the
    fetched keys, values [B, H, S, Bk, d])."""
    shape = ids.shape + (cache.block_size, cache.head_dim)
    xk, xv = select.fetch_blocks(jnp.zeros(shape, cache.dtype), jnp.zeros(shape, cache.dtype),
                                 cache.host_k, cache.host_v, ids, cache.layer)
    return exact_items(ctx, xk, xv, ids, ids >= 0), xk, xv


def mark_used(cache: TieredKVCache, used: jax.Array) -> TieredKVCache:
    """Record the step (the sequence length) at which hot slots where used [B, H, K] were promoted (LRU)."""
    return cache.with_hot_used_marked(used)


HOT_FIELDS = ("hot_k", "hot_v", "hot_ids", "hot_used")  # what rung 1 changes (refresh_hot_set)


def refresh_hot_set(cache: TieredKVCache, cand: jax.Array, ids: jax.Array, xk: jax.Array, xv: jax.Array,
                    ) -> TieredKVCache:
    """Make the top candidates cand [B, H, K] resident for later steps, copying (on the device) the blocks rung 1
    fetched: ids [B, H, S] with their data xk, xv [B, H, S, Bk, d]. Slots holding a candidate keep it; a missing
    candidate takes a slot whose block is not a candidate, when rung 1 fetched it (else the slot is unchanged)."""
    new_ids, _, fetch_into = select.plan_residency(cache.hot_ids, cand, cache.hot_used)
    hit = (ids[..., None, :] == fetch_into[..., :, None]) & (fetch_into[..., :, None] >= 0)  # [B, H, K, S]
    take = jnp.any(hit, axis=-1)  # [B, H, K]
    gather = jax.vmap(jax.vmap(lambda x, j: x[j]))  # over B, H: x [S, Bk, d], j [K] -> [K, Bk, d]
    src = jnp.argmax(hit, axis=-1)
    new_k = jnp.where(take[..., None, None], gather(xk, src).astype(cache.hot_k.dtype), cache.hot_k)
    new_v = jnp.where(take[..., None, None], gather(xv, src).astype(cache.hot_v.dtype), cache.hot_v)
    hot_ids = jnp.where(take, new_ids, cache.hot_ids)
    hot_used = jnp.where(take, cache.lengths[:, None, None], cache.hot_used)
    return cache.replace(hot_k=new_k, hot_v=new_v, hot_ids=hot_ids, hot_used=hot_used)


def rung1_widen(ctx: StepContext, cache: TieredKVCache, sel: Selection, failing: jax.Array, out_dtype,
                policy: CertPolicy, defer: bool = False, prefetch: bool = False,
                ) -> tuple[StageResult, ExactItems, TieredKVCache]:
    """Every one of the top 2 k_max candidates exact, for the KV heads with a failing head: the resident ones from
    the hot set, the others fetched from tier 2 (which also refreshes the hot set for later steps; with `defer`,
    the candidates are only recorded in `hot_pending`, for `TieredKVCache.apply_pending_hot_sets` to make
    resident after the step's last layer -- with `prefetch`, every KV head's candidates, not only the widened
    heads')."""
    need = jnp.any(failing, axis=-1, keepdims=True)
    ids = jnp.where(need, sel.wide_missing, -1)
    extra, xk, xv = _fetch_exact(ctx, cache, ids)
    if defer:
        cache = cache.replace(hot_pending=sel.cand if prefetch else jnp.where(need, sel.cand, -1))
    else:
        cache = refresh_hot_set(cache, sel.cand, ids, xk, xv)
    return evaluate_stage(ctx, [sel.hot_wide, extra], out_dtype, policy), extra, cache


def rung2_exact_values(ctx: StepContext, cache: TieredKVCache, sel: Selection, wide: ExactItems,
                       st1: StageResult, failing: jax.Array, out_dtype, policy: CertPolicy) -> StageResult:
    """Also exact keys+values for the blocks carrying more than v_tol of a failing head's value-error term."""
    nb = cache.num_blocks
    share = st1.masses * ctx.eta[:, :, None, :] / jnp.maximum(st1.e_val, 1e-30)[..., None]
    share = jnp.max(jnp.where(failing[..., None], share, 0.0), axis=2)  # [B, H, nb]
    top, ids = jax.lax.top_k(share, min(policy.v_max, nb))
    ids = jnp.where(top > policy.v_tol, ids, -1)
    return evaluate_stage(ctx, [sel.hot_wide, wide, _fetch_exact(ctx, cache, ids)[0]], out_dtype, policy)


def rung3_exact_heads(q: jax.Array, cache: TieredKVCache, need: jax.Array, ctx: StepContext):
    """Exact dense attention for the KV heads where need [B, H]: out [B, H, G, d] f32, e_key, e_num [B, H, G]
    (elsewhere 0, inf, inf). With the gather kernel (`select.fetch_by_kernel`), one launch reads the flagged heads'
    tier 2 and one dense attention answers them all (`_rung3_gathered`); else a loop over the heads reads each
    flagged head whole (a conditional per head)."""
    if _gathers_whole_heads(cache):
        return _rung3_gathered(q, cache, need, ctx)
    return _rung3_per_head(q, cache, need, ctx)


def _gathers_whole_heads(cache: TieredKVCache) -> bool:
    """Whether rungs 3 and 4 read whole heads of tier 2 with the gather kernel (`_rung3_gathered`: every block of
    each head into device slots [B, H, nb, Bk, d], the pair the kernel's check covers)."""
    slots = (cache.batch, cache.num_kv_heads, cache.num_blocks, cache.block_size, cache.head_dim)
    return select.fetch_by_kernel(cache.host_k, jax.ShapeDtypeStruct(slots, cache.dtype))


def _rung3_gathered(q: jax.Array, cache: TieredKVCache, need: jax.Array, ctx: StepContext):
    """`rung3_exact_heads` in one gather launch: every block of each flagged head (-1, nothing read, for the
    others), the residual overlaid, the dense path's exact attention over all heads (the unflagged ones see zeros
    and are masked out), and `exact_bound` per head: the same computation per flagged head as the per-head loop
    (float32 sums possibly associated otherwise, which `exact_bound`'s order-free terms cover). Moves only the
    flagged heads' tier-2 bytes, with no conditional per head (forced rung 3 at 32K on the H200 cost 3.4 ms in
    the loop, more than rung 4's 2.6 ms for every head; docs/performance.md, eleventh session)."""
    B, H = need.shape
    d = ctx.q32.shape[3]
    nb, Bk = cache.num_blocks, cache.block_size
    S = nb * Bk
    ids = jnp.where(need[..., None], jnp.arange(nb, dtype=jnp.int32), -1)  # [B, H, nb]
    dst = jnp.zeros((B, H, nb, Bk, d), cache.dtype)  # as rung 1 fetches (the gather kernel's checked pair)
    k, v = select.fetch_blocks(dst, dst, cache.host_k, cache.host_v, ids, cache.layer)
    k = overlay_residual(k.reshape(B, H, S, d), cache.res_k, cache.flushed, cache.lengths)
    v = overlay_residual(v.reshape(B, H, S, d), cache.res_v, cache.flushed, cache.lengths)
    out, e_key, e_num = _exact_attention(q, k, v, cache, ctx)
    flagged = need[..., None]
    return (jnp.where(flagged[..., None], out, 0.0), jnp.where(flagged, e_key, jnp.inf),
            jnp.where(flagged, e_num, jnp.inf))


def _rung3_per_head(q: jax.Array, cache: TieredKVCache, need: jax.Array, ctx: StepContext):
    """`rung3_exact_heads` as a loop over the KV heads, each flagged one's tier 2 read whole."""
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
            k = tiers.read_head(cache.host_k, b, h, cache.layer).reshape(1, 1, S, d)
            v = tiers.read_head(cache.host_v, b, h, cache.layer).reshape(1, 1, S, d)
            fl, ln = cache.flushed[b][None], cache.lengths[b][None]
            k = overlay_residual(k, cache.res_k[b, h][None, None], fl, ln)
            v = overlay_residual(v, cache.res_v[b, h][None, None], fl, ln)
            o = dense_attention_f32(q_heads[b, h][None], k, v, ln)[0]  # [G, d]
            valid = (jnp.arange(S) < ln[0])[:, None]
            kmax = jnp.max(jnp.where(valid, jnp.abs(k[0, 0].astype(jnp.float32)), 0.0), axis=0)
            k_e, n_e = exact_bound(ctx.q_abs[b, h], kmax, v_abs[b, h], ctx.key_scale[b, h], S)
            return (jax.lax.dynamic_update_slice(out, o[None, None], (b, h, 0, 0)),
                    jax.lax.dynamic_update_slice(ek, k_e[None, None], (b, h, 0)),
                    jax.lax.dynamic_update_slice(en, n_e[None, None], (b, h, 0)))

        return jax.lax.cond(need[b, h], compute, lambda a: a, acc)

    init = (jnp.zeros((B, H, G, d), jnp.float32), jnp.full((B, H, G), jnp.inf), jnp.full((B, H, G), jnp.inf))
    return jax.lax.fori_loop(0, B * H, one, init)


def rung4_exact_layer(q: jax.Array, cache: TieredKVCache, ctx: StepContext):
    """Exact dense attention for every head (the dense path's computation): out [B, H, G, d] f32, bounds. With
    the gather kernel (`select.fetch_by_kernel`, the check rung 3's gather passed: the same slots), the layer's
    tier 2 is read by one launch of the kernel (`_rung3_gathered` with every head flagged: the originals bit for
    bit, so the same output) instead of XLA's host transfer: a kernel reading pinned host memory is device work
    that a CUDA graph can hold, a host transfer is not (docs/performance.md, twenty-fifth session)."""
    if _gathers_whole_heads(cache):
        return _rung3_gathered(q, cache, jnp.ones((cache.batch, cache.num_kv_heads), bool), ctx)
    k, v = exact_keys_values(cache)
    return _exact_attention(q, k, v, cache, ctx)


def _exact_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: TieredKVCache, ctx: StepContext):
    """The dense path's exact attention of q [B, Hq, d] over the originals k, v [B, H, S, d] (residual
    overlaid) and its bound: out [B, H, G, d] f32, e_key, e_num [B, H, G] (`exact_bound`)."""
    B, Hq, d = q.shape
    H, S = k.shape[1], k.shape[2]
    out = dense_attention_f32(q, k, v, cache.lengths)
    valid = (jnp.arange(S)[None, :] < cache.lengths[:, None])[:, None, :, None]
    kmax = jnp.max(jnp.where(valid, jnp.abs(k.astype(jnp.float32)), 0.0), axis=2)  # [B, H, d]
    e_key, e_num = exact_bound(ctx.q_abs, kmax, _value_abs_exact(cache), ctx.key_scale, S)
    return out.reshape(B, H, Hq // H, d), e_key, e_num


def run(q: jax.Array, cache: TieredKVCache, policy: CertPolicy, min_rung: int = 0,
        ) -> tuple[jax.Array, Certificate, TieredKVCache]:
    """The whole ladder: (out [B, Hq, d] in q's dtype, Certificate [B, Hq], the cache with its hot set updated).
    min_rung (static, for benchmarks): treat every rung below it as failing, so each head climbs at least that
    high (a higher rung is always a valid answer); with min_rung 3, rung 4 follows unless the policy's
    layer_fallback_fraction is above 1."""
    out, cert, cache, _ = _ladder(q, cache, policy, top_rung=4, min_rung=min_rung)
    return out, cert, cache


def run_fast(q: jax.Array, cache: TieredKVCache, policy: CertPolicy, top_rung: int = 1,
             ) -> tuple[jax.Array, Certificate, TieredKVCache, jax.Array]:
    """Rungs 0 to top_rung only (the fast pass of a decode step; top_rung 1, or 0 for a pass without any
    conditional): (out, Certificate, cache, escalate [B] bool). Where escalate[b] is set, some head of sequence b
    needs a rung above top_rung and its out / certificate are *not* valid: the caller must answer that step with
    `run`. Such a head, and only such a head, has rung 3 in the certificate (a model cache reads escalation from
    the certificates it keeps: `TieredModelCache.needs_slow_path`). Where it is clear, (out, certificate, cache)
    equal what `run` returns (`run` stops at rung top_rung or below for every head, with the same computation).
    With top_rung 0, out is rung 0's output for every head, whatever its certificate says (it does not wait for
    the bound)."""
    if top_rung not in (0, 1):
        raise ValueError(f"the fast pass stops at rung 0 or 1, not {top_rung}")
    return _ladder(q, cache, policy, top_rung=top_rung)


def _ladder(q: jax.Array, cache: TieredKVCache, policy: CertPolicy, top_rung: int, min_rung: int = 0,
            ) -> tuple[jax.Array, Certificate, TieredKVCache, jax.Array]:
    B, Hq, d = q.shape
    H = cache.num_kv_heads
    G = Hq // H
    cache0 = cache  # the step's input: the selection reads its hot set (rung 1 refreshes the hot set)
    # the fused rung 0: one kernel; a higher rung builds its own context
    if uses_fused_rung0(cache, policy):
        with jax.named_scope("rung0_fused"):
            fused = rung0_fused(q, cache0, policy)
        st0, tol, bad, active0 = fused.stage, fused.tolerance, fused.bad, fused.active

        # called inside the branches of the rare rungs (computed only there), on the cache the branch reads
        def context(c: TieredKVCache = cache0) -> StepContext:
            return build_context(q, c, policy, apx=fused.tier1())

        def selection(ctx: StepContext, c: TieredKVCache = cache0) -> Selection:
            return select_and_promote(ctx, c, policy)
    else:
        with jax.named_scope("tier1_context"):
            ctx0 = build_context(q, cache0, policy)
        with jax.named_scope("select_and_promote"):
            sel0 = select_and_promote(ctx0, cache, policy)
        with jax.named_scope("rung0_certified"):
            st0 = evaluate_stage(ctx0, [sel0.hot], q.dtype, policy)
        tol, bad, active0 = ctx0.tolerance, ctx0.bad, sel0.hot.active

        def context(c: TieredKVCache = cache0) -> StepContext:
            return ctx0

        def selection(ctx: StepContext, c: TieredKVCache = cache0) -> Selection:
            return sel0

    def passes(st: StageResult, rung: int) -> jax.Array:
        return (st.bound <= tol) & jnp.isfinite(st.bound) & st.ranking_ok & ~bad & (rung >= min_rung)

    ok0 = passes(st0, 0)
    cache = mark_used(cache, active0)

    # A model cache's layer view may defer the hot-set refresh to the end of the step (`hot_pending`,
    # policy.hot_refresh "deferred"): the conditional then returns only the small candidate list, and the layer's
    # hot set is never written back on the per-layer path, at the price of reading the fetched blocks from tier 2
    # a second time after the last layer. Its pending list is -1 here (it is cleared after every step), so the
    # skipped branch returns a constant.
    defer = cache.layer is not None and policy.hot_refresh in ("deferred", "prefetch")
    # "prefetch": every KV head's candidates become resident after the step, not only rung 1's
    prefetch = defer and policy.hot_refresh == "prefetch"
    changed = ("hot_pending",) if defer else HOT_FIELDS

    def widen():
        # the branch slices the tier-1 and hot-set fields it reads from a layer view's stacked arrays itself, so
        # a step that skips rung 1 does not materialise them for it
        c = cache.resliced()
        ctx = context(c)
        st, items, new = rung1_widen(ctx, c, selection(ctx, c), ~ok0, q.dtype, policy, defer=defer,
                                     prefetch=prefetch)
        return st, items, {f: getattr(new, f) for f in changed}

    def skip():
        if prefetch:
            kept = {"hot_pending": selection(context()).cand}
        elif defer:
            # nothing pending: the view's own list, which is -1 between steps (`apply_pending_hot_sets` clears it
            # after the last layer) -- a new array here would be written back into the stack every layer-step
            kept = {"hot_pending": cache.hot_pending}
        else:
            kept = {f: getattr(cache, f) for f in HOT_FIELDS}
        return _skipped_like(st0), _no_items(B, H, G, 2 * policy.k_max, d), kept

    if top_rung >= 1:
        with jax.named_scope("rung1_widen"):
            st1, wide, hot = jax.lax.cond(jnp.any(~ok0), widen, skip)
    else:  # a fast pass without conditionals: a head that fails rung 0 escalates (to `run`)
        st1, wide, hot = skip()
    cache = cache.replace(**hot)
    if not defer:
        cache = cache.replace(stack=None)  # the stack no longer holds this hot set (`resliced`)
    ok1 = passes(st1, 1)

    def exact_values(failing):
        ctx = context()
        return rung2_exact_values(ctx, cache, selection(ctx), wide, st1, failing, q.dtype, policy)

    with jax.named_scope("rung2_exact_values"):
        failing2 = ~ok0 & ~ok1
        if policy.v_max > 0 and top_rung >= 2:
            st2 = jax.lax.cond(jnp.any(failing2), lambda: exact_values(failing2), lambda: _skipped_like(st0))
        else:
            st2 = _skipped_like(st0)
    ok2 = passes(st2, 2)

    need3 = ~ok0 & ~ok1 & ~ok2  # [B, H, G]
    need4 = jnp.mean(need3, axis=(1, 2)) >= policy.layer_fallback_fraction  # [B]
    need3_kv = jnp.any(need3, axis=-1) & ~need4[:, None]
    zeros_out = jnp.zeros((B, H, G, d), jnp.float32)
    infs = jnp.full((B, H, G), jnp.inf)
    if top_rung >= 3:
        with jax.named_scope("rung3_exact_heads"):
            out3, ek3, en3 = jax.lax.cond(jnp.any(need3_kv),
                                          lambda: rung3_exact_heads(q, cache, need3_kv, context()),
                                          lambda: (zeros_out, infs, infs))
        with jax.named_scope("rung4_exact_layer"):
            out4, ek4, en4 = jax.lax.cond(jnp.any(need4), lambda: rung4_exact_layer(q, cache, context()),
                                          lambda: (zeros_out, infs, infs))
        escalate = jnp.zeros((B,), bool)
    else:  # the caller answers sequences with a head above top_rung with the whole ladder
        out3, ek3, en3 = out4, ek4, en4 = zeros_out, infs, infs
        need4 = jnp.zeros((B,), bool)
        escalate = jnp.any(need3, axis=(1, 2))  # some head needs rung 2 or above

    rung = jnp.where(ok0, 0, jnp.where(ok1, 1, jnp.where(ok2, 2, 3)))
    rung = jnp.where(need4[:, None, None], 4, rung).astype(jnp.int32)

    def pick(a0, a1, a2, a3, a4):
        r = rung.reshape(rung.shape + (1,) * (a0.ndim - rung.ndim))
        return jnp.where(r == 0, a0, jnp.where(r == 1, a1, jnp.where(r == 2, a2, jnp.where(r == 3, a3, a4))))

    out_exact3, cast3 = bounds.cast_error(out3, q.dtype)
    out_exact4, cast4 = bounds.cast_error(out4, q.dtype)
    if top_rung == 0:
        # a fast pass of rung 0 alone answers every head with rung 0's output (where a head fails, its sequence
        # escalates and the caller discards the output): no select on the bound, so on a GPU the bound's launches
        # are off the chain from the attention kernels to the layer's output projection
        out = st0.out
    else:
        out = pick(st0.out, st1.out, st2.out, out_exact3, out_exact4)
    zero = jnp.zeros_like(st0.bound)
    e_key = pick(st0.e_key, st1.e_key, st2.e_key, ek3, ek4)
    e_val = pick(st0.e_val, st1.e_val, st2.e_val, zero, zero)
    e_num = pick(st0.e_num, st1.e_num, st2.e_num, en3 + cast3, en4 + cast4)
    # Nothing is proven for NaN/Inf data or queries (bad), nor for an output that is not finite (e.g. scores that
    # overflow float32, or a cast that overflows the output dtype): +inf, never NaN. The latter needs no check here:
    # every rung's e_num holds its output's cast error, which is +inf exactly there (`bounds.cast_error_bound`).
    bound = jnp.where(bad, jnp.inf, bounds.finite_or_inf((e_key + e_val + e_num) * (1.0 + 2 * bounds.U)))
    # every full block (rungs 3-4 attend all of them exactly): as `block_validity` counts them, without a reduction
    n_full = jnp.clip(cache.flushed // cache.block_size, 0, cache.num_blocks).astype(jnp.int32)
    all_blocks = jnp.broadcast_to(n_full[:, None, None], rung.shape)
    k_used = pick(st0.k_star, st1.k_star, st2.k_star, all_blocks, all_blocks)
    true_ = jnp.ones_like(st0.ranking_ok)
    ranking_ok = pick(st0.ranking_ok, st1.ranking_ok, st2.ranking_ok, true_, true_)

    def heads(x):
        return x.reshape(B, Hq, *x.shape[3:])

    cert = Certificate(error_bound=heads(bound), e_key=heads(e_key), e_val=heads(e_val), e_num=heads(e_num),
                       tolerance=heads(tol), k_star=heads(k_used), rung=heads(rung), ranking_ok=heads(ranking_ok),
                       certified=heads((bound <= tol) & jnp.isfinite(bound)))
    return heads(out), cert, cache, escalate
