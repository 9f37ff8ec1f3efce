"""The two-term error bound (plus a floating-point term), computed from tier 1 only.

Notation (one query head, one step; docs/bounds.md has the proofs). Exact scores s_i = q.k_i / sqrt(d),
p = softmax(s), o = sum_i p_i v_i over the originals. We return o_hat = sum_i p_hat_i v_tilde_i with
p_hat = softmax(s_hat), s_hat the scores we compute (exact keys for the residual and promoted blocks, INT8/INT4
keys for the tail) and v_tilde the values we use (exact or dequantized).

  |s_i - s_hat_i| <= Delta_n for every token i of item n (a block, a hot slot or the residual).
  TV(p, p_hat) <= min( tanh(max_n Delta_n / 2),  X / (1 - Y) ),
      X = sum_n m_n (e^{Delta_n} - 1),  Y = sum_n m_n (1 - e^{-Delta_n}),  m_n = sum_{i in n} p_hat_i.
  E_key = TV * ||r||_2,          r_c = max_i v_ic - min_i v_ic        (since sum_i (p_i - p_hat_i) = 0)
  E_val = sum_n m_n * eta_n,     eta_n = max_{i in n} ||v_i - v_tilde_i||_2  (0 for exact values)
  E_num = floating-point error of our own softmax / weighted sum, plus the final cast to the output dtype.
  ||o - o_returned||_2 <= E_key + E_val + E_num.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from certattn_jax import quant

U = 2.0 ** -24  # float32 unit roundoff


def gamma(n: int | float) -> float:
    """Higham's gamma_n = n u / (1 - n u): relative error bound of an n-term float32 sum or dot product."""
    return n * U / (1.0 - n * U)


# Relative error of one softmax weight exp(s - m) computed in float32 (exp to a few ulps, plus the
# subtraction's rounding amplified by |s - m| <= 104; below that the weight underflows to 0, an absolute
# error < 1e-45 absorbed by the (1 + ...) slack).
EPS_WEIGHT = 8 * U + 104 * U


def sum_error(n_inner: int, n_outer: int) -> float:
    """Relative error bound of a two-level float32 sum: blocks of n_inner terms, then n_outer partials."""
    return gamma(n_inner) + gamma(n_outer) * (1 + gamma(n_inner))


def key_delta_quantized(q_abs: jax.Array, k_scale: jax.Array, k_zero: jax.Array, bits: int) -> jax.Array:
    """Delta_n for INT keys: [..., G, nb] from |q| [..., G, d] and scale/zero [..., nb, d].

    Each reconstructed key element is within s_c (1/2 + slack) of the original (quant.py), and the float32
    dot product of q with the reconstruction adds at most gamma(d + 4) * sum_c |q_c| |k_hat_c|, where
    |k_hat_c| <= M_c = max(|z_c|, |z_c + L s_c|).
    """
    d = q_abs.shape[-1]
    L = quant.levels(bits)
    s = k_scale.astype(jnp.float32)
    z = k_zero.astype(jnp.float32)
    mag = jnp.maximum(jnp.abs(z), jnp.abs(z + L * s))
    quant_part = jnp.einsum("...gd,...nd->...gn", q_abs, s, precision="highest") * (0.5 + quant.QUANT_ROUNDING_SLACK)
    fp_part = jnp.einsum("...gd,...nd->...gn", q_abs, mag, precision="highest") * gamma(d + 6)
    return (quant_part + fp_part) * (1.0 + 4 * U) / math.sqrt(d)


def key_delta_exact(q_abs: jax.Array, k_abs_max: jax.Array) -> jax.Array:
    """Delta for exact keys (float32 rounding only): [..., G, n] from |q| [..., G, d] and
    max_i |k_ic| over each item [..., n, d]."""
    d = q_abs.shape[-1]
    return jnp.einsum("...gd,...nd->...gn", q_abs, k_abs_max, precision="highest") * gamma(d + 6) / math.sqrt(d)


_TINY = float(jnp.finfo(jnp.float32).tiny)


def tv_bound(log_masses: jax.Array, deltas: jax.Array, mass_rel_err: float) -> jax.Array:
    """Total-variation bound [...] from per-item log-masses and deltas [..., n] (empty items: log-mass -inf).

    Works in log space: an item whose computed mass underflows float32 still contributes
    m_n (e^{Delta_n} - 1), which can be large when Delta_n is. mass_rel_err: relative error of the computed
    masses (inflating them only loosens X and Y). Each term that underflows is < the smallest normal float,
    so n_items of those are added back.
    """
    live = jnp.isfinite(log_masses)
    lm = jnp.where(live, log_masses, 0.0) + jnp.log1p(mass_rel_err)
    dl = jnp.where(live, deltas, 0.0)
    slack = log_masses.shape[-1] * _TINY
    x_terms = jnp.exp(lm + jnp.log(jnp.where(dl > 0, jnp.expm1(dl), 1.0)))
    x = jnp.sum(jnp.where(live & (dl > 0), x_terms, 0.0), axis=-1) * (1 + 8 * U) + slack
    y_terms = jnp.exp(lm + jnp.log(jnp.where(dl > 0, -jnp.expm1(-dl), 1.0)))
    y = jnp.sum(jnp.where(live & (dl > 0), y_terms, 0.0), axis=-1) * (1 + 8 * U) + slack
    weighted = jnp.where(y < 1.0, x / jnp.maximum(1.0 - y, 1e-30), jnp.inf)
    uniform = jnp.tanh(jnp.max(dl, axis=-1) / 2.0) * (1 + 4 * U)
    tv = jnp.minimum(jnp.minimum(weighted, uniform), 1.0)
    # A non-finite delta (NaN/Inf keys) proves nothing.
    return jnp.where(jnp.all(jnp.isfinite(deltas) | ~live, axis=-1), tv, jnp.inf)


def weighted_sum(log_masses: jax.Array, errors: jax.Array, mass_rel_err: float) -> jax.Array:
    """sum_n m_n * errors_n over the last axis with masses given as logs (no underflow of large products)."""
    live = jnp.isfinite(log_masses) & (errors > 0)
    lm = jnp.where(live, log_masses, 0.0) + jnp.log1p(mass_rel_err)
    terms = jnp.exp(lm + jnp.log(jnp.where(live, errors, 1.0)))
    n = log_masses.shape[-1]
    total = jnp.sum(jnp.where(live, terms, 0.0), axis=-1) * (1 + (n + 2) * U) + n * _TINY
    broken = jnp.any(jnp.isfinite(log_masses) & ~jnp.isfinite(errors), axis=-1)
    return jnp.where(broken, jnp.inf, total)


def l2(x: jax.Array) -> jax.Array:
    """Euclidean norm over the last axis, rounded up for its own float32 error."""
    n = x.shape[-1]
    return jnp.sqrt(jnp.sum(x * x, axis=-1)) * (1.0 + (n + 4) * U)


def numeric_error(v_abs_bound: jax.Array, rel: float) -> jax.Array:
    """E_num of a softmax-weighted average with weight/sum relative error `rel`: 3 (rel + 2u) ||V_abs||_2,
    V_abs_c bounding |v_tilde_ic| over every token."""
    return 3.0 * (rel + EPS_WEIGHT + 2 * U) * l2(v_abs_bound)


def cast_error(out_f32: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(out cast to dtype, ||out_f32 - cast||_2 exactly up to the norm's rounding)."""
    out = out_f32.astype(dtype)
    return out, l2(out_f32 - out.astype(jnp.float32))


def low_precision_unit(dtype) -> float:
    """Unit roundoff of a storage dtype (0 for float32 and wider)."""
    dt = jnp.dtype(dtype)
    if dt.itemsize >= 4:
        return 0.0
    return float(jnp.finfo(dt).eps) / 2
