"""Rung 0 of a certified decode step, fused into one kernel: selection, promotion, merge, bound, ranking check.

Everything a certified step does after the tier-1 pass, when no tier-2 byte is needed (the common case), in
one launch per layer instead of ~60 small XLA kernels (docs/performance.md: at 1K context those launches, not
bytes, are the certified step's cost). One program per (sequence b, KV head h) with its G query heads.

The exact partials of the hot slots and of the residual block are inputs (since version 2; version 3 has
the tier-1 launch compute them in extra programs, `tier1_pass(slots=...)`). (Version 1 computed them in the
kernel, slot after slot: one program per KV head ran K dependent load-dot-reduce chains, 70 µs at 1K on the
H200 — slower than the ~30 XLA launches it replaced; docs/performance.md.)

Inputs (b, h omitted; G query heads, nb full blocks, K hot slots):
    apx_m, apx_l      [G, nb]      tier-1 partials of every full block (INT keys / values): max score, sum-exp
    apx_acc           [G, nb, d]   their value sums (per-block layout of `tier1_pass`); or, split layout (version 3,
                                   `split_max` given), [G, S, d] split accumulators without the hot set's blocks,
                                   split_max [G, S] their maxima and hot_acc [G, K, d] the hot blocks' INT sums
    apx_delta         [G, nb]      Delta_n, the score error bound of each INT block (bounds.key_delta_quantized)
    eta, eta_mean,    [nb]         each block's value error annotations, the same for the G query heads (step.
      eta_op                       value_terms: largest token error, mean error, spectral norm; 0 invalid): the
                                   kernel turns them into the per-head error per unit mass with the block's l
                                   (bounds.block_value_errors, compiled with the Triton division and sqrt margins)
    n_valid           []           full blocks holding tokens;  r_count []: tokens in the residual block
    hot_ids           [K]          block id held by each hot slot (-1: empty)
    slot_m, slot_l    [G, P]       exact partials of each hot slot (empty: -inf, 0) and, in slot K, of the
                                   residual block; slot_acc [G, P, d]; P >= K + 1 a power of two
    slot_delta        [G, P]       Delta of each slot's exact scores (bounds.key_delta_exact)
    key_scale         []           E_key = TV * key_scale (step.key_term_scale)

What it computes is, operation for operation, the jnp path's rung 0 (`step.build_context`'s log-masses and
normalizer, `ladder.select_and_promote`, `step.evaluate_stage` with the promoted hot slots; the reference is
that code, run by the tests):
  1. INT8 log-masses m + log l, normalizer log_norm = logsumexp(blocks, residual), estimated masses;
  2. the top-k_max blocks by max-over-G estimated mass (ties: lower id first, as lax.top_k) and K*, the
     fewest of them whose mass with the residual's covers tau_cov for every query head;
  3. the hot slots holding one of the top-K* blocks are promoted: their exact partials replace the block's;
  4. the merge of the non-promoted INT blocks, the promoted slots and the residual (out, per-item log-masses
     and their rounding, the arithmetic checks of `step.combine`);
  5. TV (bounds.tv_bound) -> E_key, E_val (bounds.block_value_errors, bounds.weighted_sum), `broken`; the
     ranking-consistency check.
E_num depends on the value statistics only and is added by the caller with the output cast's error (computed
here), and, compiled, the output division's extra rounding (Triton divides with PTX div.full.f32:
`bounds.approx_division_error`).
Outputs: out [G, d] float32, e_key, e_val [G], broken [G], ranking_ok, active [K] (promoted slots), K* [G], and
the error bound of casting out to the caller's dtype [G] (`bounds.cast_error_bound`; +inf where that cast is not
finite).

Compile time: the candidate loop (k_max steps) and the per-slot work (K steps) are rolled loops and the hot slots
vectors over the slot axis, so the kernel's code does not grow with k_max. (Unrolled in Python, k_max = 8 cost
14.6 s of Triton compile at SmolLM2 1K on the H200 against 2.0 s at k_max = 2: the fused rung 0's whole extra
compile time; `scripts/probe_kernel_compile.py`, docs/performance.md.)

Rounding: the same float32 operations as the jnp path, in another order inside sums and dots; every bound
term used is order-free (gamma_n) and the evaluation of the bound is rounded up as in `bounds`
(docs/bounds.md section 12; the split layout's merge: section 14).
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from certattn_jax import bounds, quant
from certattn_jax.env import choice_from_env, switch_from_env
from pallas_kernels import backend

_F32 = jnp.float32
_NEG_INF = -jnp.inf
# Warps per program and block columns per chunk of the kernel's passes, by the padded block count (`tuning`).
# The kernel is a long chain of small reductions, one program per (sequence, KV head): few blocks favour few warps
# (a reduction within a warp is shuffles, no shared memory or barrier); many blocks favour more warps, whose
# registers hold the [G, chunk] float32 tiles of the passes without spilling. Each pass walks chunks of `chunk`
# block columns (a power of two; the block axis is padded to one, so a chunk never straddles its end), only those
# holding valid blocks. Measured on the H200 (the 8B layer's fast pass, docs/performance.md, twelfth session):
# SmolLM2 1K / 4K (16 / 64 blocks) 4 warps 83.5 / 91.4 us against 8 warps 88.7 / 97.3; 8B 8K (128 blocks) 128x8
# 131.4 against 256x4 139.2; 32K (512) 128x8 209.3, 256x16 208.9, 256x4 251.4; 128K (2,048) 256x16 449.4, 128x8
# 484.1, 256x4 520.8. CERTATTN_RUNG0_WARPS / CERTATTN_RUNG0_CHUNK fix one setting at every size (measurements).
# The self-check verdict is keyed by the setting (`pallas_kernels.selftest.rung0_trusted`).
WARP_CHOICES = (1, 2, 4, 8, 16)
CHUNK_CHOICES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# (largest padded block count, chunk, warps), in order; the last row takes every larger count
SIZE_TUNING = ((64, 256, 4), (512, 128, 8), (None, 256, 16))
BASE_TUNING = (256, 4)  # the setting before the per-size choice (its kept self-check verdicts stay valid)


def _env_choice(name: str, choices: tuple[int, ...]) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if value not in {str(c) for c in choices}:
        raise ValueError(f"{name}={value!r}: choose one of {choices}")
    return int(value)


# None: by size (`tuning`); set (environment, or assigned by a benchmark) it holds at every size
DEFAULT_WARPS: int | None = _env_choice("CERTATTN_RUNG0_WARPS", WARP_CHOICES)
DEFAULT_CHUNK: int | None = _env_choice("CERTATTN_RUNG0_CHUNK", CHUNK_CHOICES)


# How the kernel picks the top-k_max candidates (step 2 of the module docstring), CERTATTN_RUNG0_SELECT:
#   "count" (the default since 2026-12-06d): where one chunk holds every block column (padded blocks == chunk
#     width <= COUNT_SELECT_MAX_COLUMNS), each block's rank is counted in one pairwise pass (the eligible blocks
#     before it: estimated mass down, id up) and the k_max picks read off the ranks: two reductions per pick
#     instead of five dependent ones and a pass over the chunk. The same picks, K* and coverage sums (added in pick
#     order) as "loop", bit for bit (tests, interpreted and compiled on the H100); other shapes keep "loop".
#     H100, SmolLM2 end to end: 1K 519.5 / 523.0 against 491.8 tokens/s, 4K 445.2 against 436.7 / 427.2
#     (docs/performance.md, twenty-fourth session);
#   "loop": k_max dependent passes, each finding the best block ranked after the previous pick.
SELECT_CHOICES = ("loop", "count")
COUNT_SELECT_MAX_COLUMNS = 128  # the pairwise pass holds [columns, columns] values


DEFAULT_SELECT: str = choice_from_env("CERTATTN_RUNG0_SELECT", SELECT_CHOICES, "count")


# CERTATTN_RUNG0_SINGLE_CHUNK=1: where one chunk holds every block column, the kernel loads the block statistics
# once and runs its passes over chunks as straight-line code, taking a hot slot's column from the loaded tile (no
# dependent load per slot). Off by default: measured on an H200 (thirty-fourth session, SmolLM2, bench_generate,
# alternated processes) the general form (loops over chunks, loads per pass and per slot) decodes 5-6 % faster at
# 1K and 4K (4K: 469.3 / 476.4 against 443.1 / 448.3 tokens/s; 1K: 575.8 against 548.2), and without the
# single-chunk form 4K is back at the twenty-eighth session's tree (476.0). The same float operations either way
# (tests compare the two bit for bit under the suite's XLA flags; an optimizing compiler may fuse them into another
# rounding).
SINGLE_CHUNK: bool = bool(switch_from_env("CERTATTN_RUNG0_SINGLE_CHUNK"))


def counts_picks(padded_block_count: int, chunk: int, select: str | None = None) -> bool:
    """Whether the kernel ranks the candidates by counting (`DEFAULT_SELECT` "count") at this padded block count
    and chunk width: one chunk holds every column, at most COUNT_SELECT_MAX_COLUMNS of them."""
    select = select or DEFAULT_SELECT
    return (select == "count" and min(chunk, padded_block_count) == padded_block_count
            and padded_block_count <= COUNT_SELECT_MAX_COLUMNS)


SELECTION_REGIMES = ("count", "walk", "loop")


def selection_regime(padded_block_count: int, chunk: int, select: str | None = None) -> str:
    """How the kernel picks candidates at this padded block count and chunk width -- compiled code paths of
    their own, which a self-check must run to vouch for: "count" (`counts_picks`), "walk" (the loop selection over
    two or more chunks) or "loop" (the loop selection within one chunk)."""
    if counts_picks(padded_block_count, chunk, select):
        return "count"
    return "walk" if padded_block_count > chunk else "loop"


def tuning(padded_block_count: int) -> tuple[int, int]:
    """(chunk width, warps per program) of the kernel for `padded_blocks(nb)` block columns (`SIZE_TUNING`, or
    DEFAULT_CHUNK / DEFAULT_WARPS where set)."""
    chunk, warps = next((c, w) for limit, c, w in SIZE_TUNING if limit is None or padded_block_count <= limit)
    return DEFAULT_CHUNK or chunk, DEFAULT_WARPS or warps


def _i32(x: int) -> jax.Array:
    """An int32 constant. (jnp.where(pred, 0, -1) with two Python ints mis-lowers to Triton in jax 0.10-0.11:
    an i1 compared with an i32.)"""
    return jnp.int32(x)


class Rung0(NamedTuple):
    """out [B, H, G, d] float32 (before the output cast); e_key, e_val [B, H, G]; broken [B, H, G] bool (some
    valid item could not be bounded: the bound is +inf); ranking_ok [B, H] bool; active [B, H, K] bool; k_star
    [B, H, G] int32 (the promoted slots, counted in the kernel: no reduction after it); cast [B, H, G] the error of
    casting out to the output dtype (`bounds.cast_error_bound`, evaluated in the kernel)."""

    out: jax.Array
    e_key: jax.Array
    e_val: jax.Array
    broken: jax.Array
    ranking_ok: jax.Array
    active: jax.Array
    k_star: jax.Array
    cast: jax.Array


def _any_row(x: jax.Array) -> jax.Array:
    """jnp.any over axis 1 (Triton has no boolean reduction: a max of int32)."""
    return jnp.max(x.astype(jnp.int32), axis=1) > 0


def _log_mass(m: jax.Array, l: jax.Array) -> jax.Array:
    """step.log_mass: log sum_i e^{s_i} of an item, -inf for an empty one."""
    return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), _NEG_INF)


class _Item(NamedTuple):
    """An attention item's merge terms: log-mass (normalized), its rounding, arithmetic ok, validity, Delta."""

    lm: jax.Array
    err: jax.Array
    ok: jax.Array
    valid: jax.Array
    delta: jax.Array


def _item(m, l, big, log_denom, denom_ok, valid, delta) -> _Item:
    """step.combine's per-item terms: m, l of the item (masked: -inf, 0), big and log_denom broadcastable."""
    live = l > 0
    log_l = jnp.log(jnp.where(live, l, 1.0))
    lm = jnp.where(live, m + log_l, _NEG_INF) - (big + log_denom)
    finite_lm = jnp.where(jnp.isfinite(lm), lm, 0.0)
    err = 8 * bounds.U * (jnp.abs(jnp.where(jnp.isfinite(m), m, 0.0)) + jnp.abs(log_l) + jnp.abs(big)
                          + jnp.abs(log_denom) + jnp.abs(finite_lm) + 2.0)
    ok = jnp.isfinite(m) & jnp.isfinite(l) & (l >= 0.5) & denom_ok
    return _Item(lm=lm, err=err, ok=ok, valid=valid, delta=delta)


def _kernel(tau_ref, mg_ref, nv_ref, rc_ref, ks_ref, m_ref, l_ref, dl_ref, ann_ref, acc_ref,
            *refs, G: int, nb: int, K: int, kp: int, ch: int, cw: int, block_size: int, split: bool = False,
            margins: bool = False, out_dtype: str = "float32", count_select: bool = False, stacked_hot: bool = False,
            single_chunk: bool = True):
    # ann_ref [4, NBp]: the blocks' value error annotations (per KV head), rows eta, eta_mean, eta_op and a zero
    # row (one input, one XLA fusion producing it, instead of three; 4 rows: Triton tiles are powers of two).
    # margins (compiled):
    # Triton's division and square root in bounds.block_value_errors are not correctly rounded.
    # slots: hm, hl, hdl [Gp, P], hacc [Gp, P, d]; slots [0, K) the hot set, slot K the residual block.
    # split: acc_ref [Gp, Sp, d] holds the tier-1 pass's split accumulators (hot blocks left out) with their maxima
    # am_ref [Gp, Sp], and xa_ref [Gp, K, d] the hot blocks' INT value sums; else acc_ref [Gp, NBp, d] per block.
    # cw: the block columns one pass handles at a time (`chunk_blocks`): every per-block quantity lives in [Gp, cw]
    # tiles, so the registers a program needs do not grow with the context, and only chunks holding valid blocks
    # are visited. Sums and maxima run element-wise across chunks and are reduced once at the end.
    # stacked_hot: hid_ref [L, K] holds every layer's hot ids and lay_ref [1] the layer to read
    if split:
        am_ref, xa_ref, *refs = refs
    lay_ref, *refs = refs if stacked_hot else (None, *refs)
    (hid_ref, hm_ref, hl_ref, hacc_ref, hdl_ref, out_ref, ekey_ref, eval_ref, broken_ref, rank_ref,
     active_ref, kstar_ref, cast_ref) = refs
    Gp, NBp = m_ref.shape
    n_valid = jnp.clip(nv_ref[()], 0, nb)
    r_count = rc_ref[()]
    key_scale = ks_ref[()]
    tau = tau_ref[0]  # the policy's tolerances are traced values (a new tau_cov must not recompile)
    margin = mg_ref[0]
    g_real = jax.lax.broadcasted_iota(jnp.int32, (Gp,), 0) < G  # padded query-head rows never count
    g_real2 = g_real[:, None]
    cidx = jax.lax.broadcasted_iota(jnp.int32, (1, cw), 1)
    n_chunks = (n_valid + cw - 1) // cw  # chunks holding valid blocks (the rest are empty: never read)

    # One chunk holds every block column (the common case at short contexts): the block statistics are loaded
    # once, the passes over chunks are straight-line code (no loop, no reload), and a block's column is taken from
    # the loaded tile instead of a dependent load per hot slot. The same float operations in the same order (a
    # compiler may still contract or fuse them differently: 1 ulp seen with XLA:CPU's optimizations on; every
    # bound holds for any rounding order). With no valid block (n_chunks 0) every pass's body leaves its initial
    # value as it is (its items are masked), but for `pick`'s column search, whose changed carry is masked by
    # its `ok` (no pick) all the same.
    single = single_chunk and NBp == cw
    tiles = (m_ref[...], l_ref[...]) if single else None

    def stats(c):  # a chunk's m, l [Gp, cw]
        if single:
            return tiles
        sl = pl.ds(c * cw, cw)
        return m_ref[:, sl], l_ref[:, sl]

    def columns(c):  # a chunk's block ids [1, cw] and which of them hold tokens
        ids = c * cw + cidx
        return ids, ids < n_valid

    def chunk_lm(c):  # a chunk's INT8 log-masses [Gp, cw] (-inf where no block), ids and validity
        ids, valid = columns(c)
        return jnp.where(valid, _log_mass(*stats(c)), _NEG_INF), ids, valid

    def column(which, blk):  # one block's column of m (which 0) or l (1), [Gp, NBp]: [Gp]
        blk = jnp.clip(blk, 0, NBp - 1)
        if single:  # x + 0 + ... = x (a NaN stays a NaN, as in the load)
            return jnp.sum(jnp.where(cidx == blk, tiles[which], 0.0), axis=1)
        return jnp.sum((m_ref, l_ref)[which][:, pl.ds(blk, 1)], axis=1)

    def fold(body, init):  # body(c, carry) over the chunks holding valid blocks
        if single:
            return body(0, init)
        return jax.lax.fori_loop(0, n_chunks, body, init)

    # 1. INT8 log-masses, the residual block (exact), the normalizer and the estimated masses
    res_m, res_l, res_acc, res_delta = hm_ref[:, K], hl_ref[:, K], hacc_ref[:, K, :], hdl_ref[:, K]
    res_lm = _log_mass(res_m, res_l)  # [Gp]
    lm_max = fold(lambda c, x: jnp.maximum(x, chunk_lm(c)[0]), jnp.full((Gp, cw), _NEG_INF, _F32))
    top = jnp.maximum(jnp.max(lm_max, axis=1), res_lm)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    sum_exp = fold(lambda c, x: x + jnp.exp(chunk_lm(c)[0] - top[:, None]), jnp.zeros((Gp, cw), _F32))
    log_norm = jnp.log(jnp.sum(sum_exp, axis=1) + jnp.exp(res_lm - top)) + top
    covered = jnp.exp(res_lm - log_norm)  # [Gp]

    def est_of(lm):  # estimated masses
        return jnp.exp(lm - log_norm[:, None])

    # 2. top-k_max candidates (ties: lower block id first) and K*: one loop iteration per candidate (a rolled loop:
    # unrolled, k_max = 8 made this kernel the fused rung 0's whole extra compile time, docs/performance.md). Each
    # pick is the best block that ranks after the previous pick (value down, id up), found by one pass over the
    # chunks that keeps each column's best; a block's score is its estimated mass, max over query heads.
    def chunk_score(c):
        lm, ids, valid = chunk_lm(c)
        return jnp.where(valid, jnp.max(jnp.where(g_real2, est_of(lm), _NEG_INF), axis=0, keepdims=True), -1.0), ids

    def min_real(x):
        return jnp.min(jnp.where(g_real, x, jnp.inf))

    KP = _pow2(kp)
    jidx = jax.lax.broadcasted_iota(jnp.int32, (KP,), 0)
    no_block = _i32(NBp)

    def pick(j, carry):
        last, last_id, covered, k_star, ranked = carry

        def best_per_column(c, col):
            col_best, col_id = col
            score, ids = chunk_score(c)
            after = (score < last) | ((score == last) & (ids > last_id))
            score = jnp.where(after, score, -3.0)
            better = score > col_best  # chunks in id order: a tie keeps the lower id
            return jnp.where(better, score, col_best), jnp.where(better, ids, col_id)

        col_best, col_id = fold(best_per_column, (jnp.full((1, cw), -3.0, _F32), jnp.full((1, cw), NBp, jnp.int32)))
        best = jnp.max(col_best)
        idx = jnp.min(jnp.where(col_best == best, col_id, no_block))
        ok = best >= 0
        lm_blk = _log_mass(column(0, idx), column(1, idx))  # [Gp]
        covered = covered + jnp.where(ok, jnp.exp(lm_blk - log_norm), 0.0)
        k_star = jnp.where((k_star < 0) & (min_real(covered) >= tau), j + 1, k_star)
        ranked = jnp.where(jidx == j, jnp.where(ok, idx, _i32(-1)), ranked)
        return jnp.where(ok, best, last), jnp.where(ok, idx, last_id), covered, k_star, ranked

    def count_picks(covered, k_star):  # the same picks at once, where one chunk holds every column (NBp == cw)
        lm, _, _ = chunk_lm(0)  # [Gp, cw]
        ids = jax.lax.broadcasted_iota(jnp.int32, (cw,), 0)
        mass = est_of(lm)  # the estimated masses [Gp, cw]; a block's score: their max over the query heads
        score = jnp.max(jnp.where(g_real2, mass, _NEG_INF), axis=0)  # [cw]
        eligible = (ids < n_valid) & (score >= 0)  # what `pick` can pick (never a NaN score)
        mine, other = score[:, None], score[None, :]  # [cw, 1] the block ranked, [1, cw] every other
        before = eligible[None, :] & ((other > mine) | ((other == mine) & (ids[None, :] < ids[:, None])))
        rank = jnp.where(eligible, jnp.sum(before.astype(jnp.int32), axis=1), _i32(NBp))  # [cw]
        n_eligible = jnp.sum(eligible.astype(jnp.int32))
        def read_off(j, carry):  # the j-th pick from the ranks: two reductions, chained only through `covered`
            covered, k_star, ranked = carry
            at = rank == j  # the j-th pick's column, or none
            ok = j < n_eligible
            covered = covered + jnp.sum(jnp.where(at[None, :], mass, 0.0), axis=1)  # + the pick's mass, exactly
            k_star = jnp.where((k_star < 0) & (min_real(covered) >= tau), j + 1, k_star)
            ranked = jnp.where(jidx == j, jnp.where(ok, jnp.sum(jnp.where(at, ids, 0)), _i32(-1)), ranked)
            return covered, k_star, ranked

        # rolled, like `pick` (unrolled loops cost the kernel seconds of Triton compile; module docstring)
        _, k_star, ranked = jax.lax.fori_loop(0, kp, read_off, (covered, k_star, jnp.full((KP,), -1, jnp.int32)))
        return k_star, ranked

    k_star = jnp.where(min_real(covered) >= tau, _i32(0), _i32(-1))
    if count_select:
        k_star, ranked = count_picks(covered, k_star)
    else:
        _, _, _, k_star, ranked = jax.lax.fori_loop(
            0, kp, pick, (jnp.float32(jnp.inf), _i32(-1), covered, k_star, jnp.full((KP,), -1, jnp.int32)))
    n_cands = jnp.minimum(n_valid, _i32(2 * kp))  # the jnp path ranks 2 k_max candidates
    k_star = jnp.minimum(jnp.minimum(jnp.where(k_star >= 0, k_star, n_cands), n_cands), _i32(kp))

    # 3. hot slots, as vectors over the slot axis P (slots [0, K) the hot set; slot K, the residual, and the
    # padding never promoted): promoted when they hold one of the top-K* blocks (their exact partials are inputs)
    P = hm_ref.shape[1]
    pidx = jax.lax.broadcasted_iota(jnp.int32, (P,), 0)
    kidx = jax.lax.broadcasted_iota(jnp.int32, (K,), 0)
    slot_of = pidx[:, None] == kidx[None, :]  # [P, K]
    hot_row = hid_ref[lay_ref[0]] if stacked_hot else hid_ref[...]  # [K]
    hid = jnp.max(jnp.where(slot_of, hot_row[None, :], _i32(-1)), axis=1)  # [P], -1 beyond the hot set
    filled = hid >= 0
    match = (ranked[None, :] == hid[:, None]) & filled[:, None] & (jidx[None, :] < kp)  # [P, KP]
    rank = jnp.min(jnp.where(match, jidx[None, :], _i32(kp)), axis=1)
    active = (rank < k_star) & filled  # [P]

    def promoted(ids):  # [1, n] bool: the block is answered by a promoted hot slot
        hit = (ids == hid[:, None]) & active[:, None]  # [P, n]
        return (jnp.max(hit.astype(jnp.int32), axis=0) > 0)[None, :]

    def chunk_kept(c):  # a chunk's INT blocks that are merged (valid, not promoted): m, l masked, and the mask
        ids, valid = columns(c)
        sl = pl.ds(c * cw, cw)
        keep = ~promoted(ids) & valid
        m, l = stats(c)
        return jnp.where(keep, m, _NEG_INF), jnp.where(keep, l, 0.0), keep, sl

    # 4. the merge (step.combine over [INT blocks not promoted, promoted slots, residual])
    act2 = active[None, :]
    slot_m, slot_l = hm_ref[...], hl_ref[...]  # [Gp, P]
    hm = jnp.where(act2, slot_m, _NEG_INF)
    hl = jnp.where(act2, slot_l, 0.0)
    am_max = fold(lambda c, x: jnp.maximum(x, chunk_kept(c)[0]), jnp.full((Gp, cw), _NEG_INF, _F32))
    big = jnp.maximum(jnp.maximum(jnp.max(am_max, axis=1), res_m), jnp.max(hm, axis=1))
    big = jnp.where(jnp.isfinite(big), big, 0.0)

    def weight(x):
        return jnp.where(jnp.isfinite(x), jnp.exp(x - big if x.ndim == 1 else x - big[:, None]), 0.0)

    def denom_chunk(c, x):
        am, al, _, _ = chunk_kept(c)
        return x + al * weight(am)

    w_hot = weight(hm)  # [Gp, P]
    denom = (jnp.sum(fold(denom_chunk, jnp.zeros((Gp, cw), _F32)), axis=1) + res_l * weight(res_m)
             + jnp.sum(hl * w_hot, axis=1))
    hot_acc = jnp.where(act2[:, :, None], hacc_ref[...], 0.0)  # [Gp, P, d]
    num = weight(res_m)[:, None] * res_acc + jnp.sum(w_hot[:, :, None] * hot_acc, axis=1)

    # per hot slot, a loop: the INT log-mass of the slot's block (the ranking check) and, split layout, its INT
    # value sum where the split accumulators left it out and the slot does not promote it
    if split:
        # a hot block that is not promoted adds its INT value sum once (the first slot holding its id), not where
        # any slot promotes the block (hot ids are distinct by construction; were they not, a block must still
        # never count both exact and INT)
        earlier = pidx[None, :] < pidx[:, None]  # [P, P]: column t before row p
        same = hid[None, :] == hid[:, None]
        dup = jnp.max((same & earlier).astype(jnp.int32), axis=1) > 0
        block_promoted = jnp.max((same & active[None, :]).astype(jnp.int32), axis=1) > 0
        use = filled & ~dup & ~block_promoted & (hid < n_valid)  # [P]

    if split and single:  # the hot blocks' INT value sums loaded at once (K is a power of two when compiled)
        xa_all = xa_ref[...]  # [Gp, K, d]
        kslot = jax.lax.broadcasted_iota(jnp.int32, (1, K, 1), 1)

    def slot(s, carry):
        num, a_blk = carry
        at = pidx == s
        blk = jnp.maximum(jnp.max(jnp.where(at, hid, _i32(-1))), 0)
        m_blk = column(0, blk)  # [Gp]
        at_block = _log_mass(m_blk, column(1, blk))
        a_blk = jnp.where(at, jnp.max(jnp.where(g_real, at_block - log_norm, _NEG_INF)), a_blk)
        if split:
            use_s = jnp.max(jnp.where(at & use, _i32(1), _i32(0))) > 0
            xa = (jnp.sum(jnp.where(kslot == s, xa_all, 0.0), axis=1) if single  # [Gp, d]
                  else jnp.sum(xa_ref[:, pl.ds(s, 1), :], axis=1))
            num = num + jnp.where(use_s, weight(m_blk)[:, None] * xa, 0.0)
        return num, a_blk

    if split:
        Sp = am_ref.shape[1]
        cs = min(Sp, 16)

        def split_chunk(c, acc):  # the split accumulators: every valid block that is not in the hot set
            sl = pl.ds(c * cs, cs)
            return acc + jnp.sum(weight(am_ref[:, sl])[:, :, None] * acc_ref[:, sl, :], axis=1)

        num = jax.lax.fori_loop(0, Sp // cs, split_chunk, num)
    else:
        def chunk(c, acc):  # the INT blocks' value sums, ch blocks at a time (only chunks holding valid blocks)
            sl = pl.ds(c * ch, ch)
            ids = c * ch + jax.lax.broadcasted_iota(jnp.int32, (1, ch), 1)
            mc = jnp.where(promoted(ids), _NEG_INF, m_ref[:, sl])
            return acc + jnp.sum(weight(mc)[:, :, None] * acc_ref[:, sl, :], axis=1)

        num = jax.lax.fori_loop(0, (n_valid + ch - 1) // ch, chunk, num)
    num, a_blk = jax.lax.fori_loop(0, K, slot, (num, jnp.full((P,), _NEG_INF, _F32)))
    safe = jnp.where(denom > 0, denom, 1.0)
    out = num / safe[:, None]  # div.full.f32 when compiled: E_num adds bounds.approx_division_error (step.rung0_fused)
    log_denom = jnp.log(safe)
    denom_ok = jnp.isfinite(denom)

    # 5. the bound (bounds.tv_bound, key_error, weighted_sum with evaluate_stage's constants)
    n_items = nb + K + 1
    sum_rel = bounds.sum_error(block_size + 1, n_items + 1)
    lm_shift = math.log1p(2 * (sum_rel + 2 * bounds.EPS_WEIGHT)) * (1.0 + 4 * bounds.U)

    def item_terms(it: _Item):  # per item: bad, the TV sums' terms x, y, and Delta (0 where not valid)
        lm_up = it.lm + it.err + lm_shift
        bad = it.valid & ~(it.ok & jnp.isfinite(it.lm) & jnp.isfinite(it.delta))
        lmv = jnp.where(it.valid, lm_up, 0.0)
        dlv = jnp.where(it.valid, it.delta, 0.0)
        use_it = it.valid & (dlv > 0)
        xs = jnp.where(use_it, bounds._exp_up(lmv + jnp.log(jnp.where(use_it, jnp.expm1(dlv), 1.0))), 0.0)
        ys = jnp.where(use_it, bounds._exp_up(lmv + jnp.log(jnp.where(use_it, -jnp.expm1(-dlv), 1.0))), 0.0)
        return bad, xs, ys, dlv, lm_up

    def bound_chunk(c, acc):  # the INT blocks' terms of TV, E_val and the ranking check's tail, element-wise
        bad_a, x_a, y_a, d_a, v_a, vbad_a, tail_a = acc
        am, al, keep, sl = chunk_kept(c)
        it = _item(am, al, big[:, None], log_denom[:, None], denom_ok[:, None], keep, dl_ref[:, sl])
        bad, xs, ys, dlv, lm_up = item_terms(it)
        # the blocks' value errors per unit mass [Gp, cw], from the annotations [1, cw] and the chunk's sum-exps
        eta = bounds.block_value_errors(
            ann_ref[pl.ds(0, 1), sl], ann_ref[pl.ds(1, 1), sl], ann_ref[pl.ds(2, 1), sl], stats(c)[1], block_size,
            div_error=bounds.APPROX_DIV_ERROR if margins else 0.0,
            sqrt_rel_error=quant.KERNEL_SQRT_REL_ERROR if margins else 0.0)
        use_b = keep & (eta > 0)
        terms = bounds._exp_up(jnp.where(use_b, lm_up, 0.0) + jnp.log(jnp.where(use_b, eta, 1.0)))
        vbad = keep & ~jnp.isfinite(eta)  # never from columns not kept (invalid: padding or garbage)
        apx_lm = _log_mass(*stats(c))
        tail = jnp.where(g_real2 & keep, apx_lm + dl_ref[:, sl] - log_norm[:, None], _NEG_INF)
        return (jnp.maximum(bad_a, bad.astype(jnp.int32)), x_a + xs, y_a + ys, jnp.maximum(d_a, dlv),
                v_a + jnp.where(use_b, terms, 0.0), jnp.maximum(vbad_a, vbad.astype(jnp.int32)),
                jnp.maximum(tail_a, tail))

    zeros, izeros = jnp.zeros((Gp, cw), _F32), jnp.zeros((Gp, cw), jnp.int32)
    bad_a, x_a, y_a, d_a, v_a, vbad_a, tail_a = fold(
        bound_chunk, (izeros, zeros, zeros, zeros, zeros, izeros, jnp.full((Gp, cw), _NEG_INF, _F32)))
    broken = jnp.max(bad_a, axis=1) > 0
    x_sum = jnp.sum(x_a, axis=1)
    y_sum = jnp.sum(y_a, axis=1)
    d_max = jnp.max(d_a, axis=1)
    items = [_item(hm, hl, big[:, None], log_denom[:, None], denom_ok[:, None], jnp.broadcast_to(act2, (Gp, P)),
                   hdl_ref[...]),
             _item(res_m, res_l, big, log_denom, denom_ok, jnp.broadcast_to(r_count > 0, (Gp,)), res_delta)]
    for it in items:
        bad, xs, ys, dlv, _ = item_terms(it)
        if it.lm.ndim == 2:  # the hot slots: reduce over them
            bad, xs, ys, dlv = _any_row(bad), jnp.sum(xs, axis=1), jnp.sum(ys, axis=1), jnp.max(dlv, axis=1)
        broken = broken | bad
        x_sum = x_sum + xs
        y_sum = y_sum + ys
        d_max = jnp.maximum(d_max, dlv)
    slack = (n_items + 1) * bounds.TINY
    x_sum = bounds.round_up_sum(x_sum, n_items) + slack
    y_sum = bounds.round_up_sum(y_sum, n_items) + slack
    # Triton's float32 division is div.full.f32 (<= 2 ulp, bounds.APPROX_DIV_ERROR): the jnp path's margin for
    # one correctly rounded division (bounds.tv_bound) widened by that much; the halving is an exact multiply
    weighted = jnp.where(y_sum < 1.0, x_sum / jnp.maximum(1.0 - y_sum, 1e-30)
                         * (1.0 + 4 * bounds.U + bounds.APPROX_DIV_ERROR), jnp.inf)
    uniform = jnp.tanh(d_max * 0.5) * (1 + 4 * bounds.U)
    tv = jnp.minimum(jnp.minimum(weighted, uniform), 1.0)
    tv = jnp.where(broken | jnp.isnan(tv), jnp.inf, tv)
    e_key = bounds.key_error(tv, key_scale)
    e_val = bounds.round_up_sum(jnp.sum(v_a, axis=1), nb) + (nb + 1) * bounds.TINY
    e_val_bad = broken | (jnp.max(vbad_a, axis=1) > 0)
    e_val = jnp.where(e_val_bad | jnp.isnan(e_val), jnp.inf, e_val)

    # the ranking-consistency check (select.ranking_consistent), per KV head, over pairs of promoted slots
    e_blk = jnp.max(jnp.where(g_real2, _log_mass(slot_m, slot_l) - log_norm[:, None], _NEG_INF), axis=0)  # [P]
    tail = jnp.max(tail_a)
    pair = active[:, None] & active[None, :]
    inv = pair & (a_blk[:, None] > a_blk[None, :]) & (e_blk[None, :] > e_blk[:, None] + margin)
    inverted = jnp.max(inv.astype(jnp.int32)) > 0
    weakest = jnp.min(jnp.where(active, e_blk, jnp.inf))
    any_active = jnp.max(active.astype(jnp.int32)) > 0
    ranking_ok = ~inverted & ~(any_active & (tail > weakest + margin))

    out_ref[...] = out
    ekey_ref[...] = e_key
    eval_ref[...] = e_val
    broken_ref[...] = broken.astype(jnp.int32)
    rank_ref[...] = jnp.broadcast_to(ranking_ok.astype(jnp.int32), (Gp,))
    act = jnp.max(jnp.where(slot_of & active[:, None], _i32(1), _i32(0)), axis=0)  # [K]
    active_ref[...] = act
    kstar_ref[...] = jnp.broadcast_to(jnp.sum(act), (Gp,))
    # the output cast's error (+inf where the cast is not finite), from the rows in registers: no reduction of the
    # output after the launch
    cast_ref[...] = bounds.cast_error_bound(out, jnp.dtype(out_dtype),
                                            quant.KERNEL_SQRT_REL_ERROR if margins else 0.0)


def supports(head_dim: int, hot_slots: int) -> bool:
    """Whether the kernel runs on these shapes here: compiled (Triton) tensors need power-of-two sizes;
    interpret mode takes any."""
    return backend.supports_sizes(head_dim, hot_slots)


def _pow2(n: int, at_least: int = 1) -> int:
    return max(1 << (max(n, 1) - 1).bit_length(), at_least)


def padded_blocks(nb: int) -> int:
    """The block columns the kernel reads: nb padded to a power of two of at least 16."""
    return _pow2(nb, 16)


def padded_slots(k_slots: int) -> int:
    """The slot columns the kernel reads: the K hot slots and the residual, padded to a power of two."""
    return _pow2(k_slots + 1)


def certify_rung0(apx_m, apx_l, apx_acc, apx_delta, eta, eta_mean, eta_op, n_valid, hot_ids, slot_m, slot_l,
                  slot_acc, slot_delta, r_count, key_scale, *, block_size: int, k_max: int, tau_cov: float,
                  rank_margin: float, heads: int | None = None, num_blocks: int | None = None,
                  split_max: jax.Array | None = None, hot_acc: jax.Array | None = None, interpret: bool | None = None,
                  num_warps: int | None = None, chunk_blocks: int | None = None,
                  triton_margins: bool | None = None, out_dtype=jnp.float32, select: str | None = None,
                  layer: jax.Array | None = None) -> Rung0:
    """Rung 0 fused (module docstring): shapes with leading [B, H] (n_valid, r_count [B]; key_scale [B, H]).
    eta, eta_mean, eta_op [B, H, nb] (padded inputs: [B, H, padded_blocks(nb)], 0 past nb) per KV head: the kernel
    evaluates `bounds.block_value_errors` per query head from them and apx_l (no XLA launch between the tier-1
    pass and this one).

    The exact items come as slots: slot_m, slot_l, slot_delta [B, H, G, P], slot_acc [B, H, G, P, d] with P >=
    K + 1: slots [0, K) are the hot set's (hot_ids [B, H, K]), slot K the residual block, any others ignored.
    With heads=None, the inputs have G = heads query-head rows and nb blocks, and are padded here (query heads
    to a power of two, blocks to `padded_blocks(nb)`, slots to `padded_slots(K)`; padding: empty items). With
    heads (and num_blocks) given, they arrive padded already (the lean path of `step.rung0_fused`: the tier-1
    pass writes them so, with zero-query rows): G a power of two >= heads, the block axis `padded_blocks`, the
    slot axis a power of two; rows >= heads and blocks >= num_blocks never count.

    Split layout (split_max given, padded inputs only): apx_acc [B, H, G, Sp, d] are the tier-1 pass's split
    accumulators with the hot set's blocks left out (`tier1_pass(hot_ids=...)`), split_max [B, H, G, Sp] their
    maxima (Sp a power of two; padding splits empty: -inf), hot_acc [B, H, G, K, d] the hot blocks' INT value
    sums. The kernel then reads Sp + K value vectors per query head instead of nb (docs/kernels.md).

    num_warps, chunk_blocks: the compiled program's warps and pass width (default: `tuning` of the padded block
    count). triton_margins: evaluate the block value errors with the margins of Triton's division and square root
    (default: when compiled; True in interpret mode runs the compiled kernel's arithmetic on the CPU, for tests).
    out_dtype: the dtype the caller casts out to (the query's); the kernel returns that cast's error bound.
    select: how the candidates are picked, "loop" or "count" (default `DEFAULT_SELECT`; `counts_picks`).
    layer: hot_ids is a model's stacked [L, B, H, K] and the kernel reads layer `layer` of it in place (a layer's
    slice feeding the launch would be a copy of its own, an extra launch pair per layer-step, and a loop-dependent
    slice that keeps XLA from taking the loop over layers into one CUDA graph: docs/performance.md)."""
    B, H, Gx, nbx = apx_m.shape
    d = apx_acc.shape[-1]
    K = hot_ids.shape[-1]
    if hot_ids.shape[-3:] != (B, H, K) or hot_ids.ndim != (3 if layer is None else 4):
        want = "[B, H, K]" if layer is None else "[L, B, H, K] (stacked, with layer)"
        raise ValueError(f"certify_rung0: hot_ids {hot_ids.shape}, expected {want} with B, H = {B}, {H}")
    P = slot_m.shape[-1]
    split = split_max is not None
    if split:
        Sp = split_max.shape[-1]
        if (heads is None or split_max.shape != (B, H, Gx, Sp) or apx_acc.shape != (B, H, Gx, Sp, d)
                or hot_acc is None or hot_acc.shape != (B, H, Gx, K, d) or Sp & (Sp - 1)):
            raise ValueError(f"certify_rung0: split layout needs padded inputs: acc {apx_acc.shape}, split_max "
                             f"{split_max.shape}, hot_acc {None if hot_acc is None else hot_acc.shape}")
    if ((not split and apx_acc.shape != (B, H, Gx, nbx, d)) or slot_acc.shape != (B, H, Gx, P, d)
            or any(x.shape != (B, H, nbx) for x in (eta, eta_mean, eta_op)) or slot_m.shape != (B, H, Gx, P)
            or apx_delta.shape != apx_m.shape or P < K + 1):
        raise ValueError(f"certify_rung0: inconsistent shapes m {apx_m.shape}, acc {apx_acc.shape}, slot_acc "
                         f"{slot_acc.shape}, slot_m {slot_m.shape}, eta / eta_mean / eta_op {eta.shape} / "
                         f"{eta_mean.shape} / {eta_op.shape} (per KV head: {(B, H, nbx)}), hot_ids {hot_ids.shape}")
    if not 0 < k_max <= K:
        raise ValueError(f"k_max {k_max} must be in [1, {K}] (the hot slots)")
    interpret = backend.interpret() if interpret is None else interpret
    triton_margins = not interpret if triton_margins is None else bool(triton_margins)
    if not (interpret or triton_margins):
        raise ValueError("certify_rung0: a compiled kernel needs the Triton rounding margins")
    if not interpret:
        for name, n in (("head_dim", d), ("hot slots", K)):
            if n & (n - 1):
                raise ValueError(f"the compiled rung-0 kernel needs a power-of-two {name}, got {n}")
    f32 = jnp.float32
    if heads is None:
        G, nb = Gx, nbx
        Gp, NBp, Pp = _pow2(G), padded_blocks(nb), padded_slots(K)
    else:
        G, nb = heads, num_blocks if num_blocks is not None else nbx
        Gp, NBp, Pp = Gx, nbx, P
        if Gp < G or Gp & (Gp - 1) or NBp != padded_blocks(nb) or P & (P - 1):
            raise ValueError(f"certify_rung0: padded inputs expected ({Gx} rows for {G} heads, {nbx} block "
                             f"columns for {nb} blocks, {P} slots)")
    pg, pn, ps = Gp - Gx, NBp - nbx, Pp - P
    tuned_chunk, tuned_warps = tuning(NBp)
    num_warps = num_warps or tuned_warps
    chunk_blocks = chunk_blocks or tuned_chunk
    select = select or DEFAULT_SELECT
    if select not in SELECT_CHOICES:
        raise ValueError(f"select {select!r}: choose one of {SELECT_CHOICES}")
    if chunk_blocks not in CHUNK_CHOICES or num_warps not in WARP_CHOICES:
        raise ValueError(f"chunk_blocks {chunk_blocks} / num_warps {num_warps}: choose from {CHUNK_CHOICES} / "
                         f"{WARP_CHOICES}")

    def pad(x, value, axis3, trailing=0):  # query-head rows (axis 2) and axis 3 (blocks or slots)
        x = x.astype(f32)
        if not (pg or axis3):
            return x
        return jnp.pad(x, ((0, 0), (0, 0), (0, pg), (0, axis3)) + ((0, 0),) * trailing, constant_values=value)

    apx_m, apx_l, apx_delta = pad(apx_m, -jnp.inf, pn), pad(apx_l, 0.0, pn), pad(apx_delta, 0.0, pn)
    # the annotations per KV head (no query-head axis): blocks past nb count 0
    eta, eta_mean, eta_op = (jnp.pad(x.astype(f32), ((0, 0), (0, 0), (0, pn))) if pn else x.astype(f32)
                             for x in (eta, eta_mean, eta_op))
    apx_acc = pad(apx_acc, 0.0, pn, 1)
    slot_m, slot_l, slot_delta = pad(slot_m, -jnp.inf, ps), pad(slot_l, 0.0, ps), pad(slot_delta, 0.0, ps)
    slot_acc = pad(slot_acc, 0.0, ps, 1)
    # two [1] inputs, not one stacked [2]: a reshape of a scalar is free, a stack is a launch per layer-step
    tau, margin = (jnp.asarray(x, f32).reshape(1) for x in (tau_cov, rank_margin))
    split_args = (split_max.astype(f32), hot_acc.astype(f32)) if split else ()
    layer_args = () if layer is None else (jnp.clip(jnp.asarray(layer, jnp.int32).reshape(1), 0,
                                                    hot_ids.shape[0] - 1),)
    # the three annotations as one [B, H, 4, NBp] input (row 3 zero): XLA computes them in one fusion
    annotations = jnp.stack([eta, eta_mean, eta_op, jnp.zeros_like(eta)], axis=2)
    out = _call(tau, margin, n_valid.astype(jnp.int32), r_count.astype(jnp.int32), key_scale.astype(f32), apx_m, apx_l,
                apx_delta, annotations, apx_acc, *split_args, *layer_args, hot_ids.astype(jnp.int32),
                slot_m, slot_l, slot_acc, slot_delta, G=G, nb=nb, kp=k_max, block_size=block_size,
                interpret=interpret, num_warps=num_warps, cw=min(chunk_blocks, NBp), margins=triton_margins,
                out_dtype=jnp.dtype(out_dtype).name, count_select=counts_picks(NBp, chunk_blocks, select),
                stacked_hot=layer is not None, single_chunk=SINGLE_CHUNK)
    o, ek, ev, br, rk, act, ks, cast = out
    return Rung0(out=o[:, :, :G], e_key=ek[:, :, :G], e_val=ev[:, :, :G], broken=br[:, :, :G] != 0,
                 ranking_ok=rk[:, :, 0] != 0, active=act != 0, k_star=ks[:, :, :G], cast=cast[:, :, :G])


@functools.partial(jax.jit, static_argnames=("G", "nb", "kp", "block_size", "interpret", "num_warps", "cw",
                                             "margins", "out_dtype", "count_select", "stacked_hot", "single_chunk"))
def _call(tau, margin, n_valid, r_count, key_scale, m, l, delta, annotations, acc, *rest, G, nb, kp,
          block_size, interpret, num_warps, cw, margins, out_dtype, count_select=False, stacked_hot=False,
          single_chunk=True):
    split = len(rest) == 7 + stacked_hot
    split_args, rest = (rest[:2], rest[2:]) if split else ((), rest)
    layer_args, (hot_ids, slot_m, slot_l, slot_acc, slot_delta) = (rest[:1], rest[1:]) if stacked_hot else ((), rest)
    B, H, Gp, NBp = m.shape
    d = acc.shape[-1]
    K = hot_ids.shape[-1]
    P = slot_m.shape[-1]
    kernel = functools.partial(_kernel, G=G, nb=nb, K=K, kp=kp, ch=min(NBp, 16), cw=cw, block_size=block_size,
                               split=split, margins=margins, out_dtype=out_dtype, count_select=count_select,
                               stacked_hot=stacked_hot, single_chunk=single_chunk)

    def whole(*shape):
        return pl.BlockSpec((None, None, *shape), lambda b, h: (b, h) + (0,) * len(shape))

    per_seq = pl.BlockSpec((None,), lambda b, h: (b,))
    one = pl.BlockSpec((1,), lambda b, h: (0,))
    per_head = pl.BlockSpec((None, None), lambda b, h: (b, h))
    return pl.pallas_call(
        kernel,
        grid=(B, H),
        in_specs=[one, one, per_seq, per_seq, per_head, whole(Gp, NBp), whole(Gp, NBp), whole(Gp, NBp),
                  whole(4, NBp), whole(Gp, *acc.shape[3:])]
        + ([whole(Gp, split_args[0].shape[-1]), whole(Gp, K, d)] if split else [])
        # stacked hot ids: every layer's row of this (b, h) in the block, the kernel reads the layer's
        + ([one, pl.BlockSpec((hot_ids.shape[0], None, None, K), lambda b, h: (0, b, h, 0))] if stacked_hot
           else [whole(K)])
        + [whole(Gp, P), whole(Gp, P), whole(Gp, P, d), whole(Gp, P)],
        out_specs=[whole(Gp, d), whole(Gp), whole(Gp), whole(Gp), whole(Gp), whole(K), whole(Gp), whole(Gp)],
        out_shape=[jax.ShapeDtypeStruct((B, H, Gp, d), jnp.float32)]
        + [jax.ShapeDtypeStruct((B, H, Gp), jnp.float32)] * 2
        + [jax.ShapeDtypeStruct((B, H, Gp), jnp.int32)] * 2 + [jax.ShapeDtypeStruct((B, H, K), jnp.int32),
                                                                jax.ShapeDtypeStruct((B, H, Gp), jnp.int32),
                                                                jax.ShapeDtypeStruct((B, H, Gp), jnp.float32)],
        compiler_params=backend.compiler_params(num_warps, 1) if not interpret else None,
        interpret=interpret,
        name="certattn_certify_rung0",
    )(tau, margin, n_valid, r_count, key_scale, m, l, delta, annotations, acc, *split_args, *layer_args,
      hot_ids, slot_m, slot_l, slot_acc, slot_delta)
