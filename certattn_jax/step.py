"""The machinery of one certified decode step, shared by the attention entry points and the ladder.

    ctx = build_context(q, cache, policy)                  # everything that does not depend on the rung
    items = exact_items(ctx, keys, values, ids, active)    # blocks attended with exact keys and values
    stage = evaluate_stage(ctx, [items, ...], dtype, policy)   # output + bound with those blocks exact

Flow is one-directional: `attention` (public API) -> `ladder` (which rung) -> `step` (this module) ->
`bounds` / `select` / `quant`. Shapes: B sequences, H KV heads, G query heads per KV head, nb full blocks of
Bk tokens, d head dim.

Arithmetic model (docs/bounds.md section 5, relied on by the proofs): scores are the float32 dot products of
the *pre-scaled* query q / sqrt(d) with the keys, computed once; the block max and the weights exp(s - m) read
the same score values (so the max token of every item has weight exactly 1 and its l >= 1, which `combine`
checks at run time: a valid item with l < 1/2, a non-finite l or m, is "broken" and gets an infinite bound).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from certattn_jax import bounds, quant, select
from certattn_jax.cache import TIER1_FIELDS, TieredKVCache
from certattn_jax.kv_cache import masked_attention_f32
from certattn_jax.policy import CertPolicy, rung0_impl, tier1_impl

_HI = "highest"


class Partials(NamedTuple):
    """Flash-decoding partials of attention items (blocks): m [..., n] max score, l [..., n] sum of
    exp(s - m), acc [..., n, d] sum of exp(s - m) * v."""

    m: jax.Array
    l: jax.Array
    acc: jax.Array


def scaled_query(q32: jax.Array) -> jax.Array:
    """q / sqrt(d) in float32: scores are dot products with this (no multiply after the dot that a compiler
    could contract with the softmax's subtraction and evaluate differently in two places)."""
    return q32 * (1.0 / math.sqrt(q32.shape[-1]))


def partials(scores: jax.Array, values: jax.Array) -> Partials:
    """scores [B, H, G, n, t] (-inf = masked), values [B, H, n, t, d] shared by the G query heads (masked
    positions must hold finite values: callers zero them)."""
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


class Combined(NamedTuple):
    """The merge of item partials: out [B, H, G, d] float32; per item [B, H, G, n]: log_masses (natural log
    of the item's share of the softmax, -inf for empty items), log_mass_err (absolute rounding of that log),
    item_ok (l and m finite and l >= 1/2: the arithmetic behaved as modelled)."""

    out: jax.Array
    log_masses: jax.Array
    log_mass_err: jax.Array
    item_ok: jax.Array


def combine(parts: list[Partials]) -> Combined:
    """Merge item partials (docs/bounds.md sections 2 and 5).

    Log-masses are kept in log space because a share can underflow float32 (below e^-87) while its error
    term, e^Delta times larger, does not (bounds.tv_bound). Their absolute rounding, a few ulps of each
    magnitude in m + log l - (big + log denom), is returned so the bound can cover it (it is ~u * |score|
    nats: not negligible when scores are in the thousands).
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
    live = l > 0
    log_l = jnp.log(jnp.where(live, l, 1.0))
    item_lm = jnp.where(live, m + log_l, -jnp.inf)
    log_denom = jnp.log(safe)
    lm = item_lm - (big + log_denom)
    finite_lm = jnp.where(jnp.isfinite(lm), lm, 0.0)
    err = 8 * bounds.U * (jnp.abs(jnp.where(jnp.isfinite(m), m, 0.0)) + jnp.abs(log_l) + jnp.abs(big)
                          + jnp.abs(log_denom) + jnp.abs(finite_lm) + 2.0)
    item_ok = jnp.isfinite(m) & jnp.isfinite(l) & (l >= 0.5) & jnp.isfinite(denom)
    return Combined(out=out, log_masses=lm, log_mass_err=err, item_ok=item_ok)


def log_mass(p: Partials) -> jax.Array:
    """log sum_i e^{s_i} of each item (-inf for empty items)."""
    return jnp.where(p.l > 0, p.m + jnp.log(jnp.where(p.l > 0, p.l, 1.0)), -jnp.inf)


class StepContext(NamedTuple):
    """Everything of one step that does not depend on the rung."""

    q32: jax.Array  # [B, H, G, d]
    q_abs: jax.Array
    q_scaled: jax.Array  # [B, H, G, d] q / sqrt(d)
    apx: Partials  # all full blocks, INT keys / INT values  [B, H, G, nb]
    apx_delta: jax.Array  # [B, H, G, nb]
    apx_lm: jax.Array  # [B, H, G, nb] INT8 log-mass
    log_norm: jax.Array  # [B, H, G] log of the INT8 estimate's softmax normalizer (all blocks + residual)
    res: Partials  # residual block, exact  [B, H, G, 1]
    res_delta: jax.Array  # [B, H, G, 1]
    res_valid: jax.Array  # [B] the residual block holds tokens
    block_valid: jax.Array  # [B, nb]
    eta: jax.Array  # [B, H, nb]
    eta_mean: jax.Array  # [B, H, nb] norm of each block's mean value error (cache.v_mean_err)
    eta_op: jax.Array  # [B, H, nb] spectral norm of each block's value error matrix (cache.v_err_op)
    value_range: jax.Array  # [B, H] ||r||_2
    key_scale: jax.Array  # [B, H] E_key = TV * key_scale, key_scale = min(||r||_2, 2 max_i ||v_i||_2)
    value_stats: jax.Array  # [B, H, 4] the cache's `value_stats` (bounds.STAT_*: ||r||, ||value_abs||, ...)
    tolerance: jax.Array  # [B, H, G]
    bad: jax.Array  # [B, H, G] nothing can be proven: NaN/Inf in the cache or in the query
    value_rounding: jax.Array  # [B, H] E_int: rounding of the tier-1 kernel's integer value sums (0 if none)


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


class QueryTerms(NamedTuple):
    """The query in the forms a step uses: q32, q_abs, q_scaled = q / sqrt(d) [B, H, G, d]; bad [B, H, G]
    (NaN/Inf in the query or the cache: nothing can be proven)."""

    q32: jax.Array
    q_abs: jax.Array
    q_scaled: jax.Array
    bad: jax.Array


def query_terms(q: jax.Array, cache: TieredKVCache) -> QueryTerms:
    B, Hq, d = q.shape
    H = cache.num_kv_heads
    q32 = q.astype(jnp.float32).reshape(B, H, Hq // H, d)
    q_bad = ~jnp.all(jnp.isfinite(q32), axis=-1)
    return QueryTerms(q32=q32, q_abs=jnp.abs(q32), q_scaled=scaled_query(q32),
                      bad=cache.nonfinite[:, :, None] | q_bad)


def block_validity(cache: TieredKVCache) -> jax.Array:
    """[B, nb] the block is full (flushed into tier 1)."""
    return jnp.arange(cache.num_blocks)[None, :] < (cache.flushed // cache.block_size)[:, None]


def residual_tokens(cache: TieredKVCache) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(res_tok [B, Bk] the residual slot holds a token, res_k, res_v [B, H, Bk, d] float32 with padding zeroed:
    padding never counts)."""
    r_count = cache.lengths - cache.flushed
    res_tok = jnp.arange(cache.block_size)[None, :] < r_count[:, None]
    res_k = jnp.where(res_tok[:, None, :, None], cache.res_k.astype(jnp.float32), 0.0)
    res_v = jnp.where(res_tok[:, None, :, None], cache.res_v.astype(jnp.float32), 0.0)
    return res_tok, res_k, res_v


class ValueTerms(NamedTuple):
    """What the bound needs of the values, from tier-1 annotations and the statistics every write keeps current
    (nothing here reduces the values or their statistics again): eta, eta_mean, eta_op [B, H, nb] (0 for invalid
    blocks), value_range [B, H] ||r||_2, key_scale [B, H], stats [B, H, 4] (the cache's `value_stats`: E_num's and
    E_int's inputs), tolerance [B, H]."""

    eta: jax.Array
    eta_mean: jax.Array
    eta_op: jax.Array
    value_range: jax.Array
    key_scale: jax.Array
    stats: jax.Array
    tolerance: jax.Array


def value_terms(cache: TieredKVCache, policy: CertPolicy, block_valid: jax.Array) -> ValueTerms:
    eta = jnp.where(block_valid[:, None, :], cache.v_err, 0.0)
    eta_mean = jnp.where(block_valid[:, None, :], cache.v_mean_err.astype(jnp.float32), 0.0)
    eta_op = jnp.where(block_valid[:, None, :], cache.v_err_op.astype(jnp.float32), 0.0)
    stats = cache.value_stats  # recomputed by every write (`TieredKVCache.with_value_stats`, the write kernel)
    value_range = stats[..., bounds.STAT_RANGE]
    # v_norm_max: every token written, the residual's included (noted at the write, `TieredKVCache._note_values`)
    return ValueTerms(eta=eta, eta_mean=eta_mean, eta_op=eta_op, value_range=value_range,
                      key_scale=key_term_scale(value_range, cache.v_norm_max), stats=stats,
                      tolerance=policy.eps * bounds.tolerance_range(value_range, cache.head_dim) + policy.abs_tol)


def residual_partials(qt: QueryTerms, cache: TieredKVCache) -> tuple[Partials, jax.Array]:
    """The residual block's exact partials (m, l [B, H, G, 1], acc [B, H, G, 1, d]) and its Delta [B, H, G, 1]
    (rounding of the exact scores)."""
    res_tok, res_k, res_v = residual_tokens(cache)
    s_res = jnp.einsum("bhgd,bhtd->bhgt", qt.q_scaled, res_k, precision=_HI)
    s_res = jnp.where(res_tok[:, None, None, :], s_res, -jnp.inf)[:, :, :, None, :]
    res = partials(s_res, res_v[:, :, None])
    res_kmax = jnp.max(jnp.abs(res_k), axis=2)[:, :, None]
    return res, bounds.key_delta_exact(qt.q_abs, res_kmax)


def build_context(q: jax.Array, cache: TieredKVCache, policy: CertPolicy, apx: Partials | None = None,
                  ) -> StepContext:
    """The step's rung-independent terms. apx: the tier-1 partials when already computed (the fused rung 0
    computes them before it knows whether a higher rung needs this context)."""
    B, Hq, d = q.shape
    H = cache.num_kv_heads
    G = Hq // H
    qt = query_terms(q, cache)
    block_valid = block_validity(cache)
    if apx is None:
        apx = tier1_partials(qt.q_scaled, cache, block_valid, policy.tier1)
    apx_delta = key_deltas(qt.q_abs, cache, policy.tier1)

    res, res_delta = residual_partials(qt, cache)
    vt = value_terms(cache, policy, block_valid)
    all_lm = jnp.concatenate([log_mass(apx), log_mass(res)], axis=-1)
    log_norm = jax.scipy.special.logsumexp(all_lm, axis=-1)
    return StepContext(q32=qt.q32, q_abs=qt.q_abs, q_scaled=qt.q_scaled, apx=apx, apx_delta=apx_delta,
                       apx_lm=log_mass(apx), log_norm=log_norm, res=res, res_delta=res_delta,
                       res_valid=cache.lengths > cache.flushed, block_valid=block_valid, eta=vt.eta,
                       eta_mean=vt.eta_mean, eta_op=vt.eta_op,
                       value_range=vt.value_range, key_scale=vt.key_scale, value_stats=vt.stats,
                       tolerance=jnp.broadcast_to(vt.tolerance[..., None], (B, H, G)), bad=qt.bad,
                       value_rounding=int_value_term(cache, policy))


def numeric_term(stats: jax.Array, head_dim: int, n_items: int, block_size: int, chain: int = 0) -> jax.Array:
    """E_num before the output cast [B, H] from a cache's value_stats [B, H, 4] (bounds.STAT_ABS_NORM,
    STAT_ABS_MAX: ||value_abs||_2 and max value_abs of head_dim channels; docs/bounds.md section 5): the softmax
    average's float32 error over
    n_items items of block_size tokens, the underflow floor and the value-reconstruction mismatch. chain > 0: the
    numerator's INT blocks were merged through online-softmax split accumulators of `chain` blocks (the fused
    rung 0's split layout, docs/bounds.md section 14)."""
    n_tokens = n_items * block_size
    # two-level sums (block_size-term blocks, then n_items partials), each term a product; with a chain, up to
    # 2 chain more roundings per term
    sum_rel = bounds.merge_sum_error(block_size + 1, n_items + 1, chain)
    # weights e^{s - m_n} e^{m_n - big}: two exps, two rounded subtractions whose |arguments| add to big - s; with a
    # chain, e^{s - m_n} e^{m_n - m'} ... e^{acc_m - big}: up to chain + 2 exps whose arguments still add to s - big
    factor = bounds.softmax_average_error(n_tokens, sum_rel, n_exps=2 + chain, arg_roundings=1)
    abs_norm, abs_max = stats[..., bounds.STAT_ABS_NORM], stats[..., bounds.STAT_ABS_MAX]
    return (bounds.numeric_error_from_norm(abs_norm, factor) + bounds.flush_floor_from_max(n_tokens, abs_max, head_dim)
            + bounds.dequantization_mismatch_from(abs_norm, abs_max, head_dim))


def int_value_term(cache: TieredKVCache, policy: CertPolicy, chain: int = 0) -> jax.Array:
    """E_int [B, H] (bounds.int_value_rounding) when the tier-1 partials come from a kernel variant that sums
    values in exact integer arithmetic, else 0. The item count is the largest any stage merges (rung 2: the
    blocks, the hot slots, the widened selection, the exact-value blocks and the residual)."""
    from pallas_kernels import tier1_pass as kernel

    B, H = cache.batch, cache.num_kv_heads
    if not (tier1_kernel_runs(cache, policy.tier1) and kernel.CERTIFIED_VARIANT in kernel.INT_VALUE_VARIANTS):
        return jnp.zeros((B, H), jnp.float32)
    # the norm of the running maxima over every flushed block (value_stats, kept by the writes: no per-step reduction)
    n_items = cache.num_blocks + 4 * cache.k_max + policy.v_max + 2
    return bounds.int_value_rounding_from_norm(cache.value_stats[..., bounds.STAT_INT], cache.v_scale_max.shape[-1],
                                               cache.block_size, cache.value_bits, cache.group_size, n_items, chain)


def kernel_division_term(stats: jax.Array, head_dim: int) -> jax.Array:
    """[B, H] from value_stats [B, H, 4]: the certify kernel's output division, compiled by Triton (PTX
    div.full.f32, not IEEE), adds `bounds.approx_division_error` to E_num; 0 where the kernel is interpreted (XLA
    divides correctly rounded)."""
    from pallas_kernels import backend

    if backend.interpret():
        return jnp.zeros(stats.shape[:-1], jnp.float32)
    return bounds.approx_division_error_from_norm(stats[..., bounds.STAT_ABS_NORM], head_dim)


def total_bound(e_key: jax.Array, e_val: jax.Array, stats: jax.Array, head_dim: int, n_items: int, block_size: int,
                cast: jax.Array, broken: jax.Array, value_rounding: jax.Array | None = None, chain: int = 0,
                ) -> tuple[jax.Array, jax.Array]:
    """(E_num [B, H, G] with the output cast and E_int (value_rounding [B, H], if any), +inf where broken; the
    bound E_key + E_val + E_num rounded up). stats: value_stats [B, H, 4]; chain: see `numeric_term`."""
    e_num = numeric_term(stats, head_dim, n_items, block_size, chain)
    if value_rounding is not None:
        e_num = e_num + value_rounding
    e_num = jnp.where(broken, jnp.inf, e_num[..., None] + cast)
    return e_num, bounds.finite_or_inf((e_key + e_val + e_num) * (1.0 + 2 * bounds.U))


class FusedRung0(NamedTuple):
    """Rung 0 through the fused kernel: the stage, the promoted hot slots active [B, H, K], the tier-1
    partials (for a higher rung's context: possibly padded, `FusedRung0.tier1` gives them unpadded), tolerance
    [B, H, G] and bad [B, H, G]."""

    stage: StageResult
    active: jax.Array
    apx: Partials | None
    tolerance: jax.Array
    bad: jax.Array

    def tier1(self) -> Partials | None:
        """The tier-1 partials [B, H, G, nb] without the kernel's padding (call it where it is needed: inside the
        rare rungs' branches, so that the fast path never copies them); None when the fused rung 0 ran the split
        layout (no per-block value sums exist: a higher rung's context recomputes them)."""
        if self.apx is None:
            return None
        B, H, G = self.tolerance.shape
        nb = self.stage.masses.shape[-1]
        return Partials(m=self.apx.m[:, :, :G, :nb], l=self.apx.l[:, :, :G, :nb], acc=self.apx.acc[:, :, :G, :nb])


def fused_supported(cache: TieredKVCache, k_max: int | None = None) -> bool:
    """Whether `rung0_fused` can run on this cache's shapes (compiled kernels need powers of two) and, compiled,
    passed its known-answer check for this configuration (`pallas_kernels.selftest.rung0_trusted`): the policy's
    k_max (default: every hot slot) promoted from the cache's hot slots, in the form the kernels read this cache
    (a model's layer view: its layer of the stacked arrays in place; else the cache's own arrays), picking its
    candidates as the kernel does at this cache's block count (`certify_rung0.selection_regime`: only that way
    is checked)."""
    from pallas_kernels import certify_rung0, selftest

    k_max = k_max or cache.k_max
    padded = certify_rung0.padded_blocks(cache.num_blocks)
    tuning = certify_rung0.tuning(padded)
    return certify_rung0.supports(cache.head_dim, cache.k_max) and selftest.rung0_trusted(
        cache.block_size, cache.head_dim, cache.group_size, cache.key_bits, cache.value_bits, k_max,
        hot_slots=cache.k_max if cache.k_max != k_max else 0, tuning=tuning,
        select=certify_rung0.DEFAULT_SELECT, layer_view=cache.kernels_read_stack_in_place,
        picks=certify_rung0.selection_regime(padded, tuning[0]))


def uses_fused_rung0(cache: TieredKVCache, policy: CertPolicy) -> bool:
    """Whether the ladder answers rung 0 of this cache with the fused kernel (`rung0_fused`): the policy's rung-0
    implementation for the layer's block count (`policy.rung0_impl`), and `fused_supported`."""
    return rung0_impl(policy.rung0, cache.num_blocks) == "fused" and fused_supported(cache, policy.k_max)


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """Pad axis 2 (query heads) of x with zeros to `rows`."""
    extra = rows - x.shape[2]
    return x if not extra else jnp.pad(x, ((0, 0), (0, 0), (0, extra)) + ((0, 0),) * (x.ndim - 3))


def slot_partials(q_scaled: jax.Array, q_abs: jax.Array, cache: TieredKVCache, slots: int,
                  ) -> tuple[Partials, jax.Array]:
    """Exact partials of the hot slots and of the residual block in one computation: `slots` (>= K + 1) items
    [B, H, G, slots] (acc [..., d]): slots [0, K) the hot set (empty slot: m = -inf, l = 0), slot K the residual
    block, the rest empty; and their Delta [B, H, G, slots]. The same arithmetic as `exact_partials` and
    `residual_partials`, which compute these items separately (`pallas_kernels.tier1_pass.slot_partials_reference`;
    the tier-1 kernel computes the same in extra programs when the fused rung 0 runs it)."""
    from pallas_kernels import tier1_pass as kernel

    m, l, acc, delta = kernel.slot_partials_reference(q_scaled, q_abs, slot_inputs(cache, slots))
    return Partials(m=m, l=l, acc=acc), delta


def slot_inputs(cache: TieredKVCache, slots: int, in_place: bool = False):
    """The cache's exact items as `pallas_kernels.tier1_pass.Slots` (hot set, residual, r_count); in_place: a
    layer view's stacked hot set and residual (`TieredKVCache.slot_arrays`), for a kernel that reads the layer in
    place."""
    from pallas_kernels import tier1_pass as kernel

    hot_k, hot_v, hot_ids, res_k, res_v = cache.slot_arrays(in_place)
    return kernel.Slots(hot_k=hot_k, hot_v=hot_v, hot_ids=hot_ids, res_k=res_k, res_v=res_v,
                        r_count=cache.lengths - cache.flushed, n_slots=slots)


class FusedItems(NamedTuple):
    """What the certify kernel reads: the INT blocks' partials apx (m, l [B, H, Gp, NBp]; acc per block or per
    split) and Delta, the exact slots (hot set + residual, [B, H, Gp, P]) and their Delta, the split layout's
    extra arguments (split_max, hot_acc; empty otherwise), the online-softmax chain (blocks per split, 0 for
    the per-block layout), the number of query-head rows the arrays already have padded (None: unpadded), and
    the hot set's block ids the slots were built from: hot_ids [B, H, K] with hot_layer None, or a model's stacked
    [L, B, H, K] with hot_layer its layer (read in place by both kernels, so they agree on the hot set)."""

    apx: Partials
    apx_delta: jax.Array
    slots: Partials
    slot_delta: jax.Array
    split_args: dict
    chain: int
    padded_rows: int | None
    hot_ids: jax.Array
    hot_layer: jax.Array | None


def fused_items(qt: QueryTerms, cache: TieredKVCache, policy: CertPolicy, split: bool) -> FusedItems:
    """The certify kernel's inputs. When the tier-1 kernel runs (`int_kv`), one launch gives them all, padded as
    the certify kernel reads them: each block's Delta, the query heads and blocks padded to powers of two, and
    (split layout) the split accumulators without the hot set's blocks, those blocks' INT sums and, in extra
    programs, the exact partials of the hot slots and the residual. Otherwise XLA computes them (unpadded)."""
    from pallas_kernels import certify_rung0 as ck  # pallas_kernels imports certattn_jax
    from pallas_kernels import tier1_pass as kernel

    B, H, nb, K = cache.batch, cache.num_kv_heads, cache.num_blocks, cache.k_max
    n_slots = ck.padded_slots(K)
    if not (tier1_kernel_runs(cache, policy.tier1) and kernel.CERTIFIED_VARIANT == "int_kv"):
        apx = tier1_partials(qt.q_scaled, cache, block_validity(cache), policy.tier1)
        slots, slot_delta = slot_partials(qt.q_scaled, qt.q_abs, cache, n_slots)
        return FusedItems(apx, key_deltas(qt.q_abs, cache, policy.tier1), slots, slot_delta, {}, 0, None,
                          cache.hot_ids, None)
    layout = {"per_block_acc": True}
    chain = 0
    arrays, layer = cache.tier1_arrays()  # a model's layer: its stacked arrays, read in place by the kernel
    hot_ids, hot_layer = cache.hot_ids, None
    if split:
        chain = kernel.fast_pass_blocks_per_split(B, H, nb)
        n_splits = -(-nb // chain)
        slots = slot_inputs(cache, n_slots, in_place=layer is not None)  # stacked too where tier 1 is
        hot_ids, hot_layer = slots.hot_ids, layer
        layout = dict(per_block_acc=False, blocks_per_split=chain, hot_ids=slots.hot_ids,
                      out_splits=1 << (n_splits - 1).bit_length(), slots=slots)
    t1 = kernel.tier1_pass(qt.q_scaled, *arrays, cache.flushed // cache.block_size, **layout,
                           group_size=cache.group_size, key_bits=cache.key_bits, value_bits=cache.value_bits,
                           score_scale=1.0, variant=kernel.CERTIFIED_VARIANT, q_abs=qt.q_abs,
                           out_blocks=ck.padded_blocks(nb), padded_heads=True, layer=layer)
    rows = t1.m.shape[2]
    if split:
        slots, slot_delta = Partials(m=t1.slot_m, l=t1.slot_l, acc=t1.slot_acc), t1.slot_delta
    else:
        slots, slot_delta = slot_partials(_pad_rows(qt.q_scaled, rows), _pad_rows(qt.q_abs, rows), cache, n_slots)
    split_args = {"split_max": t1.acc_m, "hot_acc": t1.hot_acc} if split else {}
    return FusedItems(Partials(m=t1.m, l=t1.l, acc=t1.acc), t1.delta, slots, slot_delta, split_args, chain, rows,
                      hot_ids, hot_layer)


def rung0_fused(q: jax.Array, cache: TieredKVCache, policy: CertPolicy, split: bool = True,
                tuning: tuple[int, int] | None = None) -> FusedRung0:
    """Rung 0 (the resident top-K* blocks exact, the rest INT) with the Pallas kernels: the tier-1 pass (which,
    through `int_kv`, also computes every item the certify kernel needs: `fused_items`), then
    `pallas_kernels.certify_rung0` for the selection, merge, bound and ranking check; E_num and the output cast
    here. The same stage as `evaluate_stage(build_context(...), [select_and_promote(...).hot])`, up to the order
    of float32 sums (and, with `split`, E_num's chain term: docs/bounds.md section 14). With `split` (the
    default) the certify kernel reads S + K value vectors per query head instead of nb (32K: 136 vs 512).
    tuning: the certify kernel's (chunk width, warps) (default: `certify_rung0.tuning` of its block count; the
    self-check forces the setting it vouches for)."""
    from pallas_kernels import certify_rung0 as ck  # pallas_kernels imports certattn_jax

    B, Hq, d = q.shape
    H, nb, K = cache.num_kv_heads, cache.num_blocks, cache.k_max
    G = Hq // H
    qt = query_terms(q, cache)
    it = fused_items(qt, cache, policy, split)
    vt = value_terms(cache, policy, block_validity(cache))
    extra = it.apx.m.shape[-1] - nb

    def blocks(x):  # [B, H, nb] -> [B, H, block columns of apx]: from the cache alone, off the kernels' chain
        return jnp.pad(x, ((0, 0), (0, 0), (0, extra))) if extra else x

    # the blocks' value errors (bounds.block_value_errors) are evaluated by the certify kernel, from these and l
    r = ck.certify_rung0(it.apx.m, it.apx.l, it.apx.acc, it.apx_delta, blocks(vt.eta), blocks(vt.eta_mean),
                         blocks(vt.eta_op), cache.flushed // cache.block_size,
                         it.hot_ids, it.slots.m, it.slots.l, it.slots.acc, it.slot_delta,
                         cache.lengths - cache.flushed, vt.key_scale, block_size=cache.block_size,
                         k_max=policy.k_max, tau_cov=policy.tau_cov, rank_margin=policy.rank_margin,
                         heads=None if it.padded_rows is None else G, num_blocks=nb, **it.split_args,
                         out_dtype=q.dtype, layer=it.hot_layer,
                         **({} if tuning is None else dict(chunk_blocks=tuning[0], num_warps=tuning[1])))
    out, cast = r.out.astype(q.dtype), r.cast  # the cast's error comes from the kernel (+inf where not finite)
    # items merged: the blocks (split layout: the splits and the hot set's INT sums), the hot slots, the residual
    n_items = nb + K + 1 if not it.chain else max(nb, it.apx.acc.shape[3] + K) + K + 1
    e_num, bound = total_bound(r.e_key, r.e_val, vt.stats, d, n_items, cache.block_size, cast, r.broken,
                               int_value_term(cache, policy, it.chain) + kernel_division_term(vt.stats, d),
                               it.chain)
    stage = StageResult(out=out, bound=bound, e_key=r.e_key, e_val=r.e_val, e_num=e_num,
                        ranking_ok=jnp.broadcast_to(r.ranking_ok[:, :, None], (B, H, G)), k_star=r.k_star,
                        masses=jnp.zeros((B, H, G, nb), jnp.float32))
    return FusedRung0(stage=stage, active=r.active, apx=None if it.chain else it.apx,
                      tolerance=jnp.broadcast_to(vt.tolerance[..., None], (B, H, G)), bad=qt.bad)


def tier1_kernel_runs(cache: TieredKVCache, impl: str) -> bool:
    """Whether `tier1_partials` takes the Pallas kernel for this cache: impl "pallas" (or "auto" on a GPU:
    `policy.tier1_impl`), shapes it supports, codes it can address (the arrays it would read: a layer view's
    stacked ones where it reads them in place, else the cache's own; `pallas_kernels.backend.arrays_fit`), and a
    compiled kernel that passed its known-answer check for this configuration (`pallas_kernels.selftest`)."""
    from pallas_kernels import backend, selftest
    from pallas_kernels import tier1_pass as kernel

    own_arrays = (getattr(cache, f) for f in TIER1_FIELDS)
    return (tier1_impl(impl) == "pallas"
            and kernel.supports(cache.block_size, cache.head_dim, cache.group_size, cache.value_bits)
            and (cache.kernels_read_stack_in_place or backend.arrays_fit(*own_arrays))
            and selftest.tier1_trusted(cache.block_size, cache.head_dim, cache.group_size, cache.key_bits,
                                       cache.value_bits))


def key_deltas(q_abs: jax.Array, cache: TieredKVCache, impl: str) -> jax.Array:
    """Delta_n [B, H, G, nb] of the INT blocks for the tier-1 implementation that computes their scores."""
    from pallas_kernels import tier1_pass as kernel

    int_pieces = tier1_kernel_runs(cache, impl) and kernel.CERTIFIED_VARIANT in kernel.INT_KEY_VARIANTS
    return bounds.key_delta_quantized(q_abs, cache.k_scale, cache.k_zero, cache.key_bits, int_pieces=int_pieces)


def tier1_partials(q_s: jax.Array, cache: TieredKVCache, block_valid: jax.Array, impl: str) -> Partials:
    """Per-block partials (m, l, acc) [B, H, G, nb] of every full block with INT keys and values, for the
    pre-scaled query q_s [B, H, G, d]: with jnp (float32 dequantized copies, XLA) or with the tier-1 Pallas
    kernel (one read of the quantized bytes, dequantized in registers; `score_scale=1`: no multiply follows
    the dot). Empty blocks: m = -inf, l = 0, acc = 0. Both are covered by the same bound (docs/bounds.md 11)."""
    from pallas_kernels import tier1_pass as kernel  # imported here: pallas_kernels imports certattn_jax

    if tier1_kernel_runs(cache, impl):
        arrays, layer = cache.tier1_arrays(in_place=kernel.CERTIFIED_VARIANT == "int_kv")
        t1 = kernel.tier1_pass(q_s, *arrays, cache.flushed // cache.block_size, group_size=cache.group_size,
                               key_bits=cache.key_bits, value_bits=cache.value_bits, per_block_acc=True,
                               score_scale=1.0, variant=kernel.CERTIFIED_VARIANT, layer=layer)
        return Partials(m=t1.m, l=t1.l, acc=t1.acc)
    k_hat = quant.dequantize_keys(cache.k_codes, cache.k_scale, cache.k_zero, cache.key_bits)
    s_apx = jnp.einsum("bhgd,bhntd->bhgnt", q_s, k_hat, precision=_HI)
    s_apx = jnp.where(block_valid[:, None, None, :, None], s_apx, -jnp.inf)
    v_hat = quant.dequantize_values(cache.v_codes, cache.v_scale, cache.v_zero, cache.group_size,
                                    cache.value_bits)
    v_hat = jnp.where(block_valid[:, None, :, None, None], v_hat, 0.0)  # empty slots must not meet 0 * inf
    return partials(s_apx, v_hat)


def key_term_scale(value_range: jax.Array, max_value_norm: jax.Array) -> jax.Array:
    """The factor turning TV into E_key: ||sum_i (p_i - p_hat_i) v_i|| <= TV * min(||r||_2, 2 max_i ||v_i||_2)
    (centre c = mid-range per channel, or c = 0; docs/bounds.md section 3)."""
    return jnp.minimum(value_range, 2.0 * max_value_norm)


def exact_partials(q_scaled: jax.Array, q_abs: jax.Array, keys: jax.Array, values: jax.Array, ids: jax.Array,
                   ) -> tuple[Partials, jax.Array]:
    """Exact partials [B, H, G, S] (acc [..., d]) of blocks keys/values [B, H, S, Bk, d] (device) for the query
    terms [B, H, G, d], and their Delta [B, H, G, S]; ids [B, H, S] (-1: empty slot: m = -inf, l = 0)."""
    filled = ids >= 0
    k32 = jnp.where(filled[..., None, None], keys.astype(jnp.float32), 0.0)
    v32 = jnp.where(filled[..., None, None], values.astype(jnp.float32), 0.0)
    s = jnp.einsum("bhgd,bhstd->bhgst", q_scaled, k32, precision=_HI)
    s = jnp.where(filled[:, :, None, :, None], s, -jnp.inf)
    return partials(s, v32), bounds.key_delta_exact(q_abs, jnp.max(jnp.abs(k32), axis=-2))


def exact_items(ctx: StepContext, keys: jax.Array, values: jax.Array, ids: jax.Array, active: jax.Array,
                ) -> ExactItems:
    """Exact partials for blocks keys/values [B, H, S, Bk, d] (device), ids [B, H, S] (-1 = empty slot)."""
    parts, delta = exact_partials(ctx.q_scaled, ctx.q_abs, keys, values, ids)
    return ExactItems(parts=parts, ids=ids, active=active & (ids >= 0), delta=delta)


def evaluate_stage(ctx: StepContext, exact: list[ExactItems], out_dtype, policy: CertPolicy) -> StageResult:
    """Output and bound when the blocks of `exact` (where active) use exact keys and values, the other full
    blocks INT keys/values, and the residual is exact."""
    B, H, G = ctx.tolerance.shape
    nb = ctx.apx.m.shape[-1]
    is_exact = jnp.zeros((B, H, nb), bool)
    for ex in exact:
        hit = (ex.ids[..., :, None] == jnp.arange(nb)) & ex.active[..., None]
        is_exact = is_exact | jnp.any(hit, axis=-2)
    keep = (~is_exact)[:, :, None, :]
    apx = mask_partials(ctx.apx, keep)
    ex_parts = [mask_partials(ex.parts, ex.active[:, :, None, :]) for ex in exact]
    comb = combine([apx, *ex_parts, ctx.res])
    n_items = comb.log_masses.shape[-1]
    # Which items hold tokens, from the validity masks alone (never from their computed masses).
    valid = jnp.concatenate(
        [jnp.broadcast_to(keep & ctx.block_valid[:, None, None, :], (B, H, G, nb))]
        + [jnp.broadcast_to(ex.active[:, :, None, :], (B, H, G) + ex.active.shape[-1:]) for ex in exact]
        + [jnp.broadcast_to(ctx.res_valid[:, None, None, None], (B, H, G, 1))], axis=-1)
    deltas = jnp.concatenate([ctx.apx_delta, *[ex.delta for ex in exact], ctx.res_delta], axis=-1)

    sum_rel = bounds.sum_error(policy.block_size + 1, n_items + 1)  # as in numeric_term
    rel = sum_rel + 2 * bounds.EPS_WEIGHT  # worst case over an item's weights: for its mass
    lm_up = bounds.log_mass_upper(comb.log_masses, comb.log_mass_err, 2 * rel)
    broken = bounds.item_broken(valid, comb.log_masses, deltas, comb.item_ok)
    tv = bounds.tv_bound(lm_up, deltas, valid, broken)
    e_key = bounds.key_error(tv, ctx.key_scale[..., None])
    errors = bounds.block_value_errors(ctx.eta[:, :, None, :], ctx.eta_mean[:, :, None, :],
                                       ctx.eta_op[:, :, None, :], ctx.apx.l, policy.block_size)
    e_val = bounds.weighted_sum(lm_up[..., :nb], errors, valid[..., :nb], broken)
    out, cast = bounds.cast_error(comb.out, out_dtype)
    e_num, bound = total_bound(e_key, e_val, ctx.value_stats, ctx.q32.shape[-1], n_items, policy.block_size, cast,
                               broken, ctx.value_rounding)

    norm = ctx.log_norm[..., None]
    approx_lm, exact_lm, active = [], [], []
    for ex in exact:
        approx_lm.append(jnp.take_along_axis(ctx.apx_lm, jnp.maximum(ex.ids, 0)[:, :, None, :], axis=-1) - norm)
        exact_lm.append(log_mass(ex.parts) - norm)
        active.append(ex.active)
    tail_upper = jnp.where(keep & ctx.block_valid[:, None, None, :], ctx.apx_lm + ctx.apx_delta - norm, -jnp.inf)
    ranking_ok = select.ranking_consistent(jnp.concatenate(approx_lm, -1), jnp.concatenate(exact_lm, -1),
                                           jnp.concatenate(active, -1), tail_upper, policy.rank_margin)
    ranking_ok = jnp.broadcast_to(ranking_ok[:, :, None], (B, H, G))
    k_star = sum(jnp.sum(ex.active, axis=-1) for ex in exact)
    k_star = jnp.broadcast_to(k_star[:, :, None], (B, H, G)).astype(jnp.int32)
    apx_mass = jnp.exp(jnp.where(valid[..., :nb], comb.log_masses[..., :nb], -jnp.inf))
    return StageResult(out=out, bound=bound, e_key=e_key, e_val=e_val, e_num=e_num, ranking_ok=ranking_ok,
                       k_star=k_star, masses=apx_mass)


def overlay_residual(full: jax.Array, res: jax.Array, flushed: jax.Array, lengths: jax.Array) -> jax.Array:
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

    B, H, nb, Bk, d = cache.host_k.shape[-5:]
    k = tiers.read_all(cache.host_k, cache.layer).reshape(B, H, nb * Bk, d)
    v = tiers.read_all(cache.host_v, cache.layer).reshape(B, H, nb * Bk, d)
    return (overlay_residual(k, cache.res_k, cache.flushed, cache.lengths),
            overlay_residual(v, cache.res_v, cache.flushed, cache.lengths))


def dense_attention_f32(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """Exact attention of q [B, Hq, d] over k, v [B, H, S, d] (first lengths[b] valid): float32 [B, Hq, d].
    The same computation as the dense KV cache's decode step (masked_attention)."""
    out = masked_attention_f32(q[:, None], k, v, (lengths - 1)[:, None], lengths)
    return out[:, 0]
