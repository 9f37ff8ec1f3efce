"""The two-term error bound (plus a floating-point term), computed from tier 1 only.

Notation (one query head, one step; docs/bounds.md has the proofs). Exact scores s_i = q.k_i / sqrt(d),
p = softmax(s), o = sum_i p_i v_i over the originals. We return o_hat = sum_i p_hat_i v_tilde_i with
p_hat = softmax(s_hat), s_hat the scores we compute (exact keys for the residual and promoted blocks, INT8/INT4
keys for the tail) and v_tilde the values we use (exact or dequantized).

  |s_i - s_hat_i| <= Delta_n for every token i of item n (a block, a hot slot or the residual).
  TV(p, p_hat) <= min( tanh(max_n Delta_n / 2),  X / (1 - Y) ),
      X = sum_n m_n (e^{Delta_n} - 1),  Y = sum_n m_n (1 - e^{-Delta_n}),  m_n = sum_{i in n} p_hat_i.
  E_key = TV * min(||r||_2, 2 max_i ||v_i||_2),   r_c = max_i v_ic - min_i v_ic   (since sum_i (p_i - p_hat_i) = 0)
  E_val = sum_n m_n * eta_n,     eta_n = max_{i in n} ||v_i - v_tilde_i||_2  (0 for exact values)
  E_num = floating-point error of our own softmax / weighted sum, plus the final cast to the output dtype.
  ||o - o_returned||_2 <= E_key + E_val + E_num.

Every quantity here is an upper bound evaluated in float32 and rounded *up* for its own evaluation error. A
bound is a number or +inf, never NaN (`finite_or_inf`): whatever cannot be evaluated proves nothing.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax import quant

U = 2.0 ** -24  # float32 unit roundoff
TINY = float(jnp.finfo(jnp.float32).tiny)  # smallest normal float32 (XLA:CPU flushes subnormals to zero)
# A float32 division compiled by Triton (the Pallas kernels on a GPU) is PTX `div.full.f32`, not IEEE `div.rn`:
# at most 2 ulp off, i.e. 4 u relative for a normal result (docs/bounds.md section 10). Formulas that the kernels
# evaluate avoid dividing by a constant (`_over_sqrt`); the kernels' own divisions carry this error explicitly.
APPROX_DIV_ERROR = 4 * U


def _inv_sqrt_up(d: int) -> float:
    """The smallest float32 >= 1 / sqrt(d) (a constant: multiplying by it is one IEEE rounding on every backend,
    where a division by sqrt(d) inside a Triton kernel would be `div.full.f32`)."""
    c = np.float32(1.0 / math.sqrt(d))
    if float(c) < 1.0 / math.sqrt(d):
        c = np.nextafter(c, np.float32(np.inf))
    return float(c)


def _over_sqrt(x: jax.Array, d: int) -> jax.Array:
    """An upper bound's x / sqrt(d) as x * `_inv_sqrt_up(d)` (one rounding, as a correctly rounded division)."""
    return x * _inv_sqrt_up(d)


def gamma(n: int | float) -> float:
    """Higham's gamma_n = n u / (1 - n u): relative error bound of an n-term float32 sum or dot product."""
    return n * U / (1.0 - n * U)


def round_up_sum(x: jax.Array, n_terms: int) -> jax.Array:
    """A computed n-term sum of non-negative terms (plus one product), inflated to bound the exact sum."""
    return x * (1.0 + gamma(n_terms + 4))


# XLA's exp is assumed accurate to 8 ulp = 16 u (libdevice's expf: 2 ulp; measured 1.83 ulp on an H200).
EXP_ERROR = 16 * U
# Relative error of one softmax weight exp(s - m) computed in float32: exp's own error plus the subtraction's
# rounding amplified by |s - m| <= 104 (below that the weight underflows to 0, an absolute error < TINY
# accounted for by `flush_floor`). Used where a worst case over all weights is needed (the item masses).
EPS_WEIGHT = EXP_ERROR + 105 * U
# The dense/exact path (kv_cache.masked_attention_f32) evaluates exp((r - m) * c) with c = fl(1/sqrt(d)): three
# roundings of the argument (subtraction, c, product), each amplified by |argument| <= 104.
EPS_WEIGHT_DENSE = EXP_ERROR + 3 * 105 * U
# Slack for the float32 probabilities x values product of the exact path (kv_cache.probs_times_values): its
# n-term sums are in gamma_n; this covers the product's own rounding.
SPLIT_PROBS_ERROR = 2 * U


def softmax_average_error(n_tokens: int, sum_rel: float, n_exps: int, arg_roundings: int) -> float:
    """Relative factor F with ||o_returned_f32 - sum_i p_i v_i||_2 <= F * ||V_abs||_2 for a softmax-weighted
    average computed in float32 (docs/bounds.md section 5), where p is the exact softmax of the computed scores.

    Each weight is e^{x_i} (1 + delta_i), x_i = s_i - max s <= 0, with |delta_i| <= n_exps * EXP_ERROR +
    arg_roundings * u |x_i| (times 1 + 1e-6): the exps' own error and the argument's roundings. Only their
    p-weighted mean D = sum_i p_i |delta_i| enters the error, and sum_i p_i |x_i| = H(p) - log Z <= log n
    (Z >= 1 since the max has x = 0), so D <= n_exps EXP_ERROR + arg_roundings u log(n). With sum_rel the
    relative error of the (products and) sums, the error per channel is <= 2 (D + sum_rel + u)(1 + 3e-6) max|v|.
    This replaces a worst case over all weights (|x| up to 104) by the softmax's entropy: ~10x tighter at short
    contexts, where the float error dominated the bound.
    """
    D = (n_exps * EXP_ERROR + arg_roundings * U * math.log(max(n_tokens, 2))) * (1 + 1e-6)
    # second-order terms: 1 / (1 - D) and the sums' (1 + 2 sum_rel)
    return 2.0 * (D + sum_rel + U) * (1 + 3e-6 + 2 * (D + sum_rel)) + 4 * U


def sum_error(n_inner: int, n_outer: int) -> float:
    """Relative error bound of a two-level float32 sum: blocks of n_inner terms, then n_outer partials."""
    return gamma(n_inner) + gamma(n_outer) * (1 + gamma(n_inner))


def merge_sum_error(n_inner: int, n_outer: int, chain: int = 0) -> float:
    """`sum_error` of a merge whose inner partials reach the outer sum through an online-softmax accumulator of
    `chain` items (the tier-1 pass's split layout: acc <- acc * alpha + beta * pv, one product and one sum per
    item after a term joins, then the rescaling products of the later items): each term carries at most
    2 chain more roundings, and (1 + gamma_a)(1 + gamma_b)(1 + gamma_c) - 1 <= gamma_{a + b + c}."""
    if not chain:
        return sum_error(n_inner, n_outer)
    return gamma(n_inner + 2 * chain + n_outer)


def flush_floor(n_terms: int, value_abs: jax.Array) -> jax.Array:
    """Absolute error from results below the smallest normal float (underflow to 0, or flushed subnormals on
    XLA:CPU) in a normalized weighted sum of n_terms values: each weight and each product loses < TINY, and
    the normalizer is >= 1/2 (`combine` checks it), so the output moves by < 2 (2 n + 8) TINY (max|v| + 1)
    per channel. value_abs [..., d] bounds |v|; returns [...]."""
    return flush_floor_from_max(n_terms, jnp.max(value_abs, axis=-1), value_abs.shape[-1])


def flush_floor_from_max(n_terms: int, abs_max: jax.Array, d: int) -> jax.Array:
    """`flush_floor` from abs_max = max_c value_abs_c [...] of d channels."""
    return 2.0 * (2 * n_terms + 8) * TINY * (abs_max + 1.0) * math.sqrt(d) * 2.0


def key_delta_quantized(q_abs: jax.Array, k_scale: jax.Array, k_zero: jax.Array, bits: int,
                        int_pieces: bool = False) -> jax.Array:
    """Delta_n for INT keys: [..., G, nb] from |q| [..., G, d] and scale/zero [..., nb, d].

    Each reconstructed key element is within s_c (1/2 + slack) of the original (quant.py), and the float32
    scores of q / sqrt(d) (rounded) against the reconstruction add at most gamma(d + 6) * sum_c |q_c|
    (L s_c + |z_c|) / sqrt(d): for the jnp path (dequantize, then dot: |k_hat_c| <= max(|z_c|, |z_c + L s_c|)
    <= L s_c + |z_c|) and for the tier-1 kernel (scale folded into the query: sum_c fl(q_c s_c) code_c plus
    sum_c q_c z_c, whose terms are bounded by |q_c| L s_c and |q_c| |z_c|; docs/bounds.md section 11). The
    einsums evaluating this bound are rounded up for their own error.

    int_pieces: the scores come from the tier-1 kernel's exact integer key dot (`int_keys`: fl(q_c s_c) split
    into four int8 pieces times the codes shifted by off = 2^(bits-1), int32 accumulation), whose float part
    is bounded by gamma(d + 6) sum_c |q_c| (2 L s_c + |z_c|) + gamma(d + 6) 0.032 d off A + d off 2^-26 A
    (A = max_c |q_c| s_c: the piece split's remainder and the rounding of its four-term sum) plus a
    d (L + off) 2^-124 floor for flushed products (docs/bounds.md section 12). Every Delta also carries
    `query_flush_delta` of the block's magnitudes (a query element a platform flushes to zero).
    """
    s = k_scale.astype(jnp.float32)
    z = k_zero.astype(jnp.float32)
    mag = key_magnitude(s, z, bits, int_pieces)
    quant_dot = jnp.einsum("...gd,...nd->...gn", q_abs, s, precision="highest")
    fp_dot = jnp.einsum("...gd,...nd->...gn", q_abs, mag, precision="highest")
    a_max = jnp.max(q_abs[..., :, None, :] * s[..., None, :, :], axis=-1) if int_pieces else None  # [..., G, nb]
    return key_delta_from_sums(quant_dot, fp_dot, a_max, jnp.sum(q_abs, axis=-1)[..., None], q_abs.shape[-1], bits,
                               int_pieces, key_sum_scaled(mag)[..., None, :])


def key_magnitude(s: jax.Array, z: jax.Array, bits: int, int_pieces: bool) -> jax.Array:
    """The per-channel magnitude whose q-weighted sum bounds the float part of a quantized key's score
    (`key_delta_quantized`): (L s_c + |z_c|), or (2 L s_c + |z_c|) for the integer pieces, rounded up."""
    L = quant.levels(bits)
    return ((2 * L if int_pieces else L) * s + jnp.abs(z)) * (1.0 + 2 * U)


def key_delta_from_sums(quant_dot: jax.Array, fp_dot: jax.Array, a_max: jax.Array | None, q_abs_sum: jax.Array,
                        d: int, bits: int, int_pieces: bool, mag_sum_scaled: jax.Array) -> jax.Array:
    """`key_delta_quantized` from its sums over the channels (any summation order: the round-up covers it):
    quant_dot = sum_c |q_c| s_c, fp_dot = sum_c |q_c| key_magnitude_c, a_max = max_c |q_c| s_c (int_pieces only),
    q_abs_sum = sum_c |q_c| (for the flush term), mag_sum_scaled = `key_sum_scaled` of the key magnitudes (for
    the query flush term). Shared by the jnp path and the tier-1 kernel, which evaluates it per block in
    registers."""
    L = quant.levels(bits)
    quant_part = quant_dot * (0.5 + quant.QUANT_ROUNDING_SLACK)
    fp_part = fp_dot * gamma(d + 6)
    if int_pieces:
        off = 2 ** (bits - 1)
        fp_part = fp_part + a_max * (1.0 + 2 * U) * (gamma(d + 6) * 0.032 * d * off
                                                     + d * off * 2.0 ** -26 * (1.0 + 4 * U))
    delta = _over_sqrt(round_up_sum(quant_part + fp_part, d + 4), d) * (1.0 + 2 * U)
    if int_pieces:
        delta = delta + d * (L + off) * 2.0 ** -124
    return delta + flush_delta_from_sum(q_abs_sum, d) + query_flush_delta_from_sum(mag_sum_scaled, d)


def dequantization_mismatch(value_abs: jax.Array) -> jax.Array:
    """E_num term [...] for value reconstructions that round differently from the writer's.

    A block's eta (cache.v_err) was measured on the writer's float32 reconstruction v_hat = fl(t code + y) of
    the INT values; the reader (an XLA fusion or the tier-1 kernel, with or without FMA contraction) may round
    it differently. Each rounding is within 2u (|t code| + |y|) of the exact t code + y, and |t code| + |y| <=
    |v_hat| + 2 |y| with |y| (a group minimum, bf16-rounded) <= 1.008 max_c value_abs_c: per channel the two
    reconstructions differ by at most 4u (value_abs_c + 2.016 max value_abs). Softmax-averaged (weights summing to
    at most 1 + 1e-3) and taken as a vector norm: <= 4.01u (||value_abs||_2 + 2.016 sqrt(d) max value_abs);
    5u (||value_abs||_2 + 2.01 sqrt(d) max value_abs) here covers it. value_abs [..., d] bounds |v_hat| per channel."""
    return dequantization_mismatch_from(l2(value_abs), jnp.max(value_abs, axis=-1), value_abs.shape[-1])


def dequantization_mismatch_from(abs_norm: jax.Array, abs_max: jax.Array, d: int) -> jax.Array:
    """`dequantization_mismatch` from abs_norm >= ||value_abs||_2 and abs_max = max_c value_abs_c [...]."""
    return 5 * U * (abs_norm + 2.01 * math.sqrt(d) * abs_max)


def flush_delta(q_abs: jax.Array) -> jax.Array:
    """Score error [...] from subnormal keys or products flushed to zero (XLA:CPU): each of the d products
    loses < TINY, and a flushed key element moves its product by < |q_c| TINY."""
    return flush_delta_from_sum(jnp.sum(q_abs, axis=-1), q_abs.shape[-1])


def flush_delta_from_sum(q_abs_sum: jax.Array, d: int) -> jax.Array:
    """`flush_delta` from q_abs_sum = sum_c |q_c|."""
    return (2.0 * q_abs_sum + 2 * d + 8) * TINY


# Query elements flushed to zero. A platform that flushes subnormals (XLA:CPU: inputs and results; a GPU may)
# reads a subnormal q_c as 0, and flushes q'_c = fl(q_c fl(1/sqrt(d))) to 0 where |q_c| < ~TINY sqrt(d): the
# whole term q'_c k_ic of every score is lost, up to TINY (1 + 3u) |k_ic|, which no |q_c|-weighted term
# covers when keys are huge (~1e36 and up: several nats; the thirtieth session's audit, docs/bounds.md section 1).
# The term is 2 (1 + 3u) TINY sum_c K_c = 2^-61 (1 + 3u) sum_c (K_c 2^-64) for per-channel key bounds K_c
# (|k_ic| <= 2 K_c), evaluated as 2^-60 sum_c fl(K_c 2^-64) so that neither the products (K_c up to 3.4e38)
# overflow nor, for ordinary keys, underflow.
KEY_SUM_SCALE = 2.0 ** -64


def key_sum_scaled(key_abs: jax.Array) -> jax.Array:
    """sum_c key_abs_c 2^-64 [...] of per-channel key bounds key_abs [..., d] (`query_flush_delta_from_sum`'s
    input; the tier-1 kernel evaluates the same sum per block)."""
    return jnp.sum(key_abs * KEY_SUM_SCALE, axis=-1)


def query_flush_delta_from_sum(scaled_sum: jax.Array, d: int) -> jax.Array:
    """Score error [...] from query elements flushed to zero, from scaled_sum = `key_sum_scaled` of K_c >=
    max_i |k_ic| / 2 (an INT block's key_magnitude M_c: |k_ic| <= |k_hat_ic| + s_c (1/2 + rho_q) <= 2 M_c; an
    exact item's max |k_ic|, with a factor 2 to spare). A lost channel moves a score by < TINY (1 + 3u) |k_ic|
    <= 2^-125 (1 + 3u) K_c; the computed sum is at least (1 - gamma_d) times the exact one less d TINY for
    scaled products that flush, and 2^-60 covers 2^-61 (1 + 3u) / (1 - gamma_d); (2d + 4) TINY covers the flushed
    products and a subnormal result (2^-60 scaled_sum is exact otherwise: a power of two)."""
    return scaled_sum * 2.0 ** -60 + (2 * d + 4) * TINY


def query_flush_delta(key_abs: jax.Array) -> jax.Array:
    """`query_flush_delta_from_sum` of per-channel key bounds key_abs [..., d] -> [...]."""
    return query_flush_delta_from_sum(key_sum_scaled(key_abs), key_abs.shape[-1])


def key_delta_exact(q_abs: jax.Array, k_abs_max: jax.Array) -> jax.Array:
    """Delta for exact keys (float32 rounding only, and flushed query elements): [..., G, n] from |q|
    [..., G, d] and max_i |k_ic| over each item [..., n, d]."""
    dot = jnp.einsum("...gd,...nd->...gn", q_abs, k_abs_max, precision="highest")
    return key_delta_exact_from_sum(dot, jnp.sum(q_abs, axis=-1)[..., None], q_abs.shape[-1],
                                    key_sum_scaled(k_abs_max)[..., None, :])


def key_delta_exact_from_sum(dot: jax.Array, q_abs_sum: jax.Array, d: int, kmax_sum_scaled: jax.Array) -> jax.Array:
    """`key_delta_exact` from dot = sum_c |q_c| max_i |k_ic| (any summation order: rounded up here),
    q_abs_sum = sum_c |q_c| and kmax_sum_scaled = `key_sum_scaled` of max_i |k_ic|; shared with the tier-1
    kernel's slot programs."""
    return (_over_sqrt(round_up_sum(dot, d + 2) * gamma(d + 6), d) * (1.0 + 2 * U)
            + flush_delta_from_sum(q_abs_sum, d) + query_flush_delta_from_sum(kmax_sum_scaled, d))


def _exp_up(arg: jax.Array) -> jax.Array:
    """An upper bound of e^a for a computed argument `arg` whose own absolute rounding error is at most
    4 u (|arg| + 1) (covered here), with exp accurate to 8 ulp."""
    return jnp.exp(arg + 4 * U * (jnp.abs(arg) + 1.0)) * (1.0 + 16 * U)


def log_mass_upper(log_masses: jax.Array, log_mass_err: jax.Array, mass_rel_err: float) -> jax.Array:
    """Upper bounds of the items' log-masses: computed log-mass + its absolute rounding (log_mass_err, from
    `combine`) + log(1 + relative error of the weights and sums)."""
    return log_masses + log_mass_err + math.log1p(mass_rel_err) * (1.0 + 4 * U)


def item_broken(valid: jax.Array, log_masses: jax.Array, deltas: jax.Array, item_ok: jax.Array) -> jax.Array:
    """[...] True when some valid item cannot be bounded: its partial sums failed `combine`'s checks
    (item_ok), its log-mass is not finite (e.g. every weight underflowed), or its Delta is not finite."""
    fine = item_ok & jnp.isfinite(log_masses) & jnp.isfinite(deltas)
    return jnp.any(valid & ~fine, axis=-1)


def tv_bound(log_mass_up: jax.Array, deltas: jax.Array, valid: jax.Array, broken: jax.Array) -> jax.Array:
    """Total-variation bound [...] from per-item upper log-masses and deltas [..., n].

    valid [..., n]: the item holds tokens (decided from validity masks, never from its computed mass: a valid
    item whose mass evaluated to 0 still counts). broken [...]: some valid item cannot be bounded -> +inf.
    Works in log space: an item whose computed mass underflows float32 still contributes m_n (e^{Delta_n} - 1),
    which can be large when Delta_n is. Each term is rounded up (`_exp_up`); terms that underflow are each
    below TINY, so n_items of those are added back.
    """
    lm = jnp.where(valid, log_mass_up, 0.0)
    dl = jnp.where(valid, deltas, 0.0)
    use = valid & (dl > 0)
    n = log_mass_up.shape[-1]
    slack = (n + 1) * TINY
    log_em1 = jnp.log(jnp.where(use, jnp.expm1(dl), 1.0))  # log(e^D - 1)
    log_1me = jnp.log(jnp.where(use, -jnp.expm1(-dl), 1.0))  # log(1 - e^-D)
    x = jnp.sum(jnp.where(use, _exp_up(lm + log_em1), 0.0), axis=-1)
    y = jnp.sum(jnp.where(use, _exp_up(lm + log_1me), 0.0), axis=-1)
    x = round_up_sum(x, n) + slack
    y = round_up_sum(y, n) + slack
    weighted = jnp.where(y < 1.0, x / jnp.maximum(1.0 - y, 1e-30) * (1.0 + 4 * U), jnp.inf)
    uniform = jnp.tanh(jnp.max(dl, axis=-1) * 0.5) * (1 + 4 * U)
    tv = jnp.minimum(jnp.minimum(weighted, uniform), 1.0)
    return jnp.where(broken | jnp.isnan(tv), jnp.inf, tv)


def key_error(tv: jax.Array, key_scale: jax.Array) -> jax.Array:
    """E_key = TV * key_scale, +inf when TV is (an unbounded TV proves nothing even for constant values: the
    computed weights themselves may be garbage)."""
    e = tv * key_scale * (1.0 + 2 * U)
    return jnp.where(jnp.isinf(tv) | jnp.isnan(e), jnp.inf, e)


def weighted_sum(log_mass_up: jax.Array, errors: jax.Array, valid: jax.Array, broken: jax.Array) -> jax.Array:
    """sum_n m_n * errors_n over the last axis with masses given as upper log-masses (no underflow of large
    products); +inf when broken or when a valid item's error is not finite."""
    use = valid & (errors > 0)
    lm = jnp.where(use, log_mass_up, 0.0)
    terms = _exp_up(lm + jnp.log(jnp.where(use, errors, 1.0)))
    n = log_mass_up.shape[-1]
    total = round_up_sum(jnp.sum(jnp.where(use, terms, 0.0), axis=-1), n) + (n + 1) * TINY
    bad = broken | jnp.any(valid & ~jnp.isfinite(errors), axis=-1)
    return jnp.where(bad | jnp.isnan(total), jnp.inf, total)


def block_value_errors(eta: jax.Array, eta_mean: jax.Array, eta_op: jax.Array, l: jax.Array, block_size: int,
                       div_error: float = 0.0, sqrt_rel_error: float = 0.0) -> jax.Array:
    """What each INT block contributes to E_val per unit of its mass, per query head (docs/bounds.md section 4):

        min(eta_n, ||e_bar_n|| + sqrt((1/l_n - 1/B)^+) ||E_n||_2)

    eta [..., nb] the block's largest token error norm, eta_mean [..., nb] the norm of its mean error vector,
    eta_op [..., nb] the spectral norm of its error matrix E_n [B, d] (all from the writer, upper bounds); l
    [..., G, nb] the block's computed sum of exp(s_i - max s) (B when the block's scores are equal, 1 when one
    token holds all its weight). Why: with the block's softmax weights q (sum 1, max 1/l), sum_i q_i e_i = e_bar +
    E^T (q - 1/B) and ||q - 1/B||_2^2 = sum q_i^2 - 1/B <= 1/l - 1/B. Broadcasts eta* against l.

    div_error, sqrt_rel_error: how far the reciprocal 1/L and the square root may be off beyond a correctly
    rounded result (relative), 0 for XLA; the certify kernel compiled by Triton passes `APPROX_DIV_ERROR`
    (div.full.f32) and `quant.KERNEL_SQRT_REL_ERROR` (libdevice's sqrt). Both 0: the formula below, whose
    constants (the sqrt(4u/B) slack for the cancellation in 1/L - 1/B, the final 1 + 8u) assume correctly rounded
    operations (bit for bit as before these parameters). Either one set: the margined form (docs/bounds.md
    section 4, "Compiled by Triton"). With a = u + div_error and sigma = u + sqrt_rel_error the two operations'
    whole relative errors (each <= 2^-14), L = max(l_low, TINY) <= the exact sum-exp (as in the first form), X =
    1/L - 1/B (L > B: X < 0 and there is nothing to show; else 1/L >= 1/B is normal):
      * the reciprocal is multiplied by f = fl_up(1 + a + u) (its rounding: 1 - u), so r' >= (1/L)(1 - a)(1 + a +
        u)(1 - u) >= (1/L)(1 - k), k = a^2 + a u + u^2 <= 3 a^2 < u/4: a lower bound of 1/L but for a second-order
        term (an FMA of this product with the subtraction only rounds less);
      * b = fl(1/B) <= (1/B)(1 + u), so r' - b >= X - k/L - u/B = (1 - k) X - (u + k)/B. If r' - b <= 0, then X <=
        (u + k) / ((1 - k) B) <= 2u/B, the square root is of 0 and dev = c = fl(sqrt(4u/B)) >= sqrt(2u/B) >=
        sqrt(X). Else t = fl(r' - b) >= (r' - b)(1 - u), s = sqrt~(t) >= sqrt(t)(1 - sigma), and with sqrt(x + y)
        <= sqrt(x) + sqrt(y): sqrt(X) <= (s / (1 - sigma) + sqrt(2u/B)) / ((1 - u)(1 - k))^(1/2) <= (s + c) /
        ((1 - sigma)(1 - u)); dev = fl(s + c) >= (s + c)(1 - u);
      * so sqrt(X^+) <= dev / ((1 - sigma)(1 - u)^2) in both cases. The product dev eta_op, the sum with eta_mean
        (terms >= 0: each rounding, or one FMA, loses at most a factor 1 - u) and the product by F (1 - u) give
        eta_mean + sqrt(X^+) eta_op <= tight / (F (1 - u)^5 (1 - sigma)) <= tight, as F = fl_up((1 + 16u)(1 + 2
        sqrt_rel_error)) >= 1 + 12u + 2 sqrt_rel_error >= 1 / (1 - 5u - sigma) (1/(1 - x) <= 1 + 2x for x <= 1/2).
    Underflow is the same in either form (a product flushed to zero loses less than TINY per block; E_val's
    (n + 1) TINY). NaN l: the plain eta."""
    return _block_value_errors(eta, eta_mean, eta_op, l, block_size, div_error, sqrt_rel_error)


def _block_value_errors(eta, eta_mean, eta_op, l, block_size: int, div_error: float, sqrt_rel_error: float,
                        reciprocal=lambda x: 1.0 / x, sqrt=jnp.sqrt) -> jax.Array:
    """`block_value_errors` with its two operations that a compiler may not round correctly as arguments (the
    tests put the worst results their error bounds allow in their place)."""
    B = block_size
    l_low = l * (1.0 - EPS_WEIGHT - gamma(B + 1))  # the exact sum-exp is at least this
    if not (div_error or sqrt_rel_error):  # correctly rounded operations (XLA)
        dev = sqrt(jnp.maximum(reciprocal(jnp.maximum(l_low, TINY)) - 1.0 / B, 0.0)) + math.sqrt(4 * U / B)
        tight = (eta_mean + dev * eta_op) * (1.0 + 8 * U)  # sqrt(4u/B): the cancellation in 1/l - 1/B
        return jnp.where(tight < eta, tight, jnp.broadcast_to(eta, tight.shape))  # NaN l: the plain eta
    a = U + div_error
    if not (0.0 <= div_error and 0.0 <= sqrt_rel_error and a <= 2.0 ** -14 and U + sqrt_rel_error <= 2.0 ** -14):
        raise ValueError(f"block_value_errors: margins div_error {div_error}, sqrt_rel_error {sqrt_rel_error}")
    recip = reciprocal(jnp.maximum(l_low, TINY)) * _f32_up(1.0 + a + U)  # >= (1/L)(1 - 3a^2)
    dev = sqrt(jnp.maximum(recip - 1.0 / B, 0.0)) + math.sqrt(4 * U / B)
    tight = (eta_mean + dev * eta_op) * _f32_up((1.0 + 16 * U) * (1.0 + 2 * sqrt_rel_error))
    return jnp.where(tight < eta, tight, jnp.broadcast_to(eta, tight.shape))  # NaN l: the plain eta


def _f32_up(x: float) -> float:
    """The smallest float32 >= x (a constant factor of a bound, so that its conversion never rounds it down)."""
    c = np.float32(x)
    if float(c) < x:
        c = np.nextafter(c, np.float32(np.inf))
    return float(c)


def int_value_rounding(scale_max: jax.Array, zero_max: jax.Array, block_size: int, value_bits: int, group: int,
                       n_items: int, chain: int = 0) -> jax.Array:
    """E_int [...]: the float32 rounding of the tier-1 kernel's exact-integer value sums (`int_kv`: per block,
    the weights w_i = p_i t_i split into int8 pieces, an int32 dot with the shifted codes; docs/bounds.md section
    13), as an l2 bound over the output's channels. It comes on top of E_num's own sum terms (which stay, so the
    inner sum is counted twice: conservative).

    scale_max, zero_max [..., ng]: per group of `group` channels, the largest value scale t and |zero y| of any
    token the pass reads. Per channel of group j, with B = block_size, off = 2^(bits-1):
        (a off t_max,j + b y_max,j)(1 + 2 sigma + 2 eps_w) + 2 n (4 B off 2^-126),
        a = 5u + B 2^-26 + gamma_3 (1 + 0.0315 B) + gamma_{B-1},   b = gamma_B + 2u,
    sigma the two-level sum error over n items (the merge), eps_w a merge weight's error. chain > 0: the blocks'
    sums reach the merge through online-softmax split accumulators of `chain` blocks (`merge_sum_error`): each
    weight is then a product of up to chain + 1 exps (eps_w times chain + 1)."""
    return int_value_rounding_from_norm(l2(int_sum_vector(scale_max, zero_max, block_size, value_bits)),
                                        scale_max.shape[-1], block_size, value_bits, group, n_items, chain)


def int_sum_vector(scale_max: jax.Array, zero_max: jax.Array, block_size: int, value_bits: int) -> jax.Array:
    """[..., ng]: a off t_max,j + b y_max,j of `int_value_rounding` (a, b rounded up by 1e-5, far more than this
    evaluation's own float32 rounding), the part of E_int that depends on the cache's contents."""
    B, off = block_size, 2 ** (value_bits - 1)
    a = (5 * U + B * 2.0 ** -26 + gamma(3) * (1 + 0.0315 * B) + gamma(B - 1)) * (1 + 1e-5)
    b = (gamma(B) + 2 * U) * (1 + 1e-5)
    return a * off * scale_max + b * zero_max


def int_value_rounding_from_norm(sum_norm: jax.Array, n_groups: int, block_size: int, value_bits: int, group: int,
                                 n_items: int, chain: int = 0) -> jax.Array:
    """`int_value_rounding` from sum_norm >= ||int_sum_vector||_2 [...] over n_groups value groups: by the triangle
    inequality ||X merge + floor||_2 <= merge ||X||_2 + floor sqrt(n_groups), rounded up."""
    B, off = block_size, 2 ** (value_bits - 1)
    merge = (1 + 2 * merge_sum_error(B + 1, n_items + 1, chain) + 2 * (1 + chain) * EPS_WEIGHT) * (1 + 1e-5)
    floor = 2.0 * n_items * 4 * B * off * 2.0 ** -126
    return (sum_norm * merge + floor * math.sqrt(n_groups)) * math.sqrt(group) * (1.0 + 8 * U)


def l2(x: jax.Array) -> jax.Array:
    """Euclidean norm over the last axis as an upper bound (+inf for a non-finite entry): `quant.norm_upper`."""
    return quant.norm_upper(x)


def approx_division_error(value_abs: jax.Array) -> jax.Array:
    """What a Triton-compiled output division (out_c = num_c / denom, PTX `div.full.f32`: <= 2 ulp) adds to E_num
    beyond the correctly rounded division E_num already counts: <= APPROX_DIV_ERROR |num_c / denom| per channel,
    and |num_c / denom| <= 1.001 value_abs_c (a weighted average of reconstructed values whose computed numerator
    and denominator carry relative errors far below 1e-3), so as a vector norm <= 4.004 u ||value_abs||_2; a
    subnormal quotient is off by at most 2^-148 per channel. value_abs [..., d] -> [...]."""
    return approx_division_error_from_norm(l2(value_abs), value_abs.shape[-1])


def approx_division_error_from_norm(abs_norm: jax.Array, d: int) -> jax.Array:
    """`approx_division_error` from abs_norm >= ||value_abs||_2 [...] of d channels."""
    return (APPROX_DIV_ERROR * 1.01) * abs_norm + math.sqrt(d) * TINY


def numeric_error(v_abs_bound: jax.Array, factor: float) -> jax.Array:
    """E_num (before the cast and the underflow floor): factor * ||V_abs||_2, V_abs_c bounding |v_tilde_ic| over
    every token, factor from `softmax_average_error` (rounded up)."""
    return numeric_error_from_norm(l2(v_abs_bound), factor)


def numeric_error_from_norm(abs_norm: jax.Array, factor: float) -> jax.Array:
    """`numeric_error` from abs_norm >= ||V_abs||_2."""
    return factor * abs_norm * (1.0 + 4 * U)


# A cache's `value_stats` [..., N_VALUE_STATS] (cache.py): the query-independent value statistics every step's bound
# reads, kept current by every write of the cache (a token, a flush, a conversion) rather than reduced again at every
# step (docs/performance.md, twenty-first session). Columns:
STAT_RANGE = 0  # ||r||_2, r_c = v_max_c - v_min_c (0 before any value): the key term's mid-range form (section 3)
STAT_ABS_NORM = 1  # ||value_abs||_2, value_abs_c >= |v_tilde_ic| for every stored and reconstructed value (E_num)
STAT_ABS_MAX = 2  # max_c value_abs_c (E_num's floors)
STAT_INT = 3  # ||int_sum_vector||_2 (E_int of the exact-integer value sums, section 13)
N_VALUE_STATS = 4


def value_range_vector(v_min: jax.Array, v_max: jax.Array) -> jax.Array:
    """r [..., d] = v_max - v_min per channel, 0 where no (finite) value was recorded."""
    has_values = jnp.isfinite(v_min) & jnp.isfinite(v_max)
    return jnp.where(has_values, v_max - v_min, 0.0)


def tolerance_range(range_norm: jax.Array, d: int) -> jax.Array:
    """A lower bound of ||r||_2, r_c = the range of channel c's *stored* values, from range_norm [...] = the cache's
    STAT_RANGE (an upper bound of it: `quant.norm_upper` of the recorded range over d channels), for the tolerance
    eps ||r||_2 + abs_tol (docs/bounds.md section 6: a certificate must not be measured against more than the stored
    values' range). STAT_RANGE exceeds ||r||_2 by at most: its own rounding and floor (`quant.norm_upper`: relative
    (n + 8) eps with gamma_n, a Triton square root's error, 2^-40 relative in its scaled branch, and
    sqrt(4 n TINY) + (n + 2) TINY absolute), the subtraction v_max - v_min (relative u), and the 3 TINY per
    channel by which a narrowing write's recorded extremes may lie outside the stored ones
    (`cache._stored_extremes`). Each is taken off, with margin; the result errs low by ~5e-5 relative at d = 128."""
    eps = 2 * U
    rel = 3 * (d + 8) * eps + quant.KERNEL_SQRT_REL_ERROR + 2.0 ** -40 + 8 * U
    absolute = 2 * (math.sqrt(4 * d * TINY) + (d + 2) * TINY) + 3 * math.sqrt(d) * TINY * (1 + rel)
    low = jnp.maximum(range_norm - absolute, 0.0) * (1.0 - rel)
    # the largest finite range norm stays finite (an upper bound of inf only says the range is unknown: +inf stays)
    return jnp.where(jnp.isnan(range_norm), 0.0, low)


def value_abs_bound(v_min: jax.Array, v_max: jax.Array, v_err_max: jax.Array) -> jax.Array:
    """value_abs [..., d]: per channel a bound on |v| of every stored value and of every INT reconstruction (the
    largest reconstruction error v_err_max [...] added), rounded up."""
    has_values = jnp.isfinite(v_min) & jnp.isfinite(v_max)
    value_abs = jnp.where(has_values, jnp.maximum(jnp.abs(v_min), jnp.abs(v_max)), 0.0)
    return (value_abs + v_err_max[..., None]) * (1.0 + 2 * U)


def value_statistics(v_min: jax.Array, v_max: jax.Array, v_err_max: jax.Array, scale_max: jax.Array,
                     zero_max: jax.Array, block_size: int, value_bits: int, sqrt_rel_error: float = 0.0,
                     ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The columns of `value_stats` (STAT_RANGE, STAT_ABS_NORM, STAT_ABS_MAX, STAT_INT), each [...], from a cache's
    running statistics v_min, v_max [..., d], v_err_max [...], scale_max, zero_max [..., ng]. Only operations a
    Pallas kernel can lower (the token-write kernel evaluates the first three; sqrt_rel_error: `quant.norm_upper`)."""
    return (*range_statistics(v_min, v_max, v_err_max, sqrt_rel_error),
            quant.norm_upper(int_sum_vector(scale_max, zero_max, block_size, value_bits), sqrt_rel_error))


def range_statistics(v_min: jax.Array, v_max: jax.Array, v_err_max: jax.Array, sqrt_rel_error: float = 0.0,
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The columns STAT_RANGE, STAT_ABS_NORM, STAT_ABS_MAX of `value_statistics` (those a token write changes)."""
    value_abs = value_abs_bound(v_min, v_max, v_err_max)
    return (quant.norm_upper(value_range_vector(v_min, v_max), sqrt_rel_error),
            quant.norm_upper(value_abs, sqrt_rel_error), jnp.max(value_abs, axis=-1))


def cast_error(out_f32: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(out cast to dtype, an upper bound of ||out_f32 - cast||_2, +inf where the cast is not finite):
    `cast_error_bound`."""
    return out_f32.astype(dtype), cast_error_bound(out_f32, dtype)


def cast_error_bound(out_f32: jax.Array, dtype, sqrt_rel_error: float = 0.0) -> jax.Array:
    """An upper bound of ||out_f32 - cast(out_f32, dtype)||_2 over the last axis, +inf where the cast holds a
    non-finite entry (out_f32 not finite, or an entry beyond the dtype's largest finite value: it may round to
    inf), so that a bound built on it is +inf wherever the output is: the ladder reads no separate finiteness.

    The bound is analytic, u_dtype ||out_f32||_2 plus half the dtype's smallest subnormal per channel, not the
    difference out_f32 - f32(cast): XLA may evaluate that round trip at excess precision (it does on GPU) and
    report 0 for a cast that did round. Only operations a Pallas kernel can lower (no boolean reductions; the
    certify kernel evaluates it on its output rows; sqrt_rel_error: `quant.norm_upper`)."""
    dt = jnp.dtype(dtype)
    x = out_f32.astype(jnp.float32)
    if dt.itemsize >= 4:  # no rounding; only finiteness
        finite = jnp.min(jnp.isfinite(x).astype(jnp.int32), axis=-1) > 0
        return jnp.where(finite, 0.0, jnp.inf).astype(jnp.float32)
    fi = jnp.finfo(dt)
    d = x.shape[-1]
    half_subnormal = float(fi.smallest_subnormal) / 2 if hasattr(fi, "smallest_subnormal") else float(fi.tiny) / 2
    floor = (max(half_subnormal, TINY) * d + TINY) * (1.0 + 4 * U)
    err = float(fi.eps) / 2 * quant.norm_upper(x, sqrt_rel_error) + floor
    # beyond the largest finite value a cast may round to inf (from max + ulp / 2 up: counting from max is
    # conservative); NaN fails the comparison, and norm_upper is +inf for any non-finite entry
    fits = jnp.max(jnp.abs(x), axis=-1) <= float(fi.max)
    return jnp.where(fits, err * (1.0 + 4 * U), jnp.inf)


def finite_or_inf(bound: jax.Array) -> jax.Array:
    """A bound is a number or +inf, never NaN."""
    return jnp.where(jnp.isnan(bound), jnp.inf, bound)


def low_precision_unit(dtype) -> float:
    """Unit roundoff of a storage dtype (0 for float32 and wider)."""
    dt = jnp.dtype(dtype)
    if dt.itemsize >= 4:
        return 0.0
    return float(jnp.finfo(dt).eps) / 2
