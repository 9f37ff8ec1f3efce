"""Asymmetric integer quantization with provable reconstruction error, and bit packing.

A group of numbers x (the tokens of one block for one key channel; the channels of one group of one token
for values) is stored as codes c in [0, L] (L = 2^bits - 1) with a scale s and zero z kept in a 16-bit
float (`SCALE_DTYPE`):

    x_hat = s * c + z                 (evaluated in float32 by `dequantize`)

The stored z is rounded *down* from min(x) and s *up* from (max(x) - z) / L, so every x lies in
[z, z + L*s]: nothing clips and, for c = round((x - z) / s),

    |x - x_hat| <= s * (1/2 + QUANT_ROUNDING_SLACK)              (QUANT_ROUNDING_SLACK covers float32 rounding)

This is the per-element bound the key-error term uses (`bounds.py`). Values additionally record their exact
per-token error ||v - v_hat||_2 at write time (`token_error_norms`).

Packing: several codes < 2^bits share a byte. Keys are packed "interleaved" (`pack`: byte i holds codes
per*i ... per*i + per - 1). Values are packed by `VALUE_PACKING`: "planar" (the default since 2026-12-02:
`pack_planar`, byte i of a row of n codes holds codes i + k n/per, so each bit plane is a contiguous run of
channels, which the tier-1 kernel unpacks with a shift and a mask instead of an interleave: on the H200 the tier-1
pass takes 53.9 / 248.5 / 486.6 us against 69.9 / 265.4 / 510.1 interleaved at 32K, 128K and 8 x 32K, and the
compiled kernel tests and soundness suites pass with it; docs/performance.md, eighth session), or "interleaved"
(as keys). CERTATTN_VALUE_PACKING=planar|interleaved chooses it at import.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

SCALE_DTYPE = jnp.bfloat16
# float32 rounding in (x - z) / s and in s * c + z: a few ulps of L (<= 255) in units of s.
QUANT_ROUNDING_SLACK = 4 * 256 * float(jnp.finfo(jnp.float32).eps)
_TINY_SCALE = float(jnp.finfo(SCALE_DTYPE).tiny)
VALUE_PACKINGS = ("planar", "interleaved")
VALUE_PACKING = os.environ.get("CERTATTN_VALUE_PACKING", "planar").strip() or "planar"
if VALUE_PACKING not in VALUE_PACKINGS:
    raise ValueError(f"CERTATTN_VALUE_PACKING={VALUE_PACKING!r}: choose one of {VALUE_PACKINGS}")


def levels(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"unsupported bit width {bits}: choose 2, 4 or 8")
    return (1 << bits) - 1


def _round_bf16(x: jax.Array, up: bool) -> jax.Array:
    """float32 x rounded toward +inf (up) or -inf to a bfloat16 value, returned as bfloat16.

    Done on the bit pattern (truncate toward zero, then step one bf16 ulp away from zero where that rounds the
    wrong way): the result is exactly representable, so the final conversion is exact and no compiler can
    make the stored value and the value used for the codes differ (XLA on GPU elides f32 -> bf16 -> f32 round
    trips under its excess-precision rule, which an `astype` + compare formulation relied on)."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    trunc_bits = bits & jnp.uint32(0xFFFF0000)
    trunc = jax.lax.bitcast_convert_type(trunc_bits, jnp.float32)  # toward zero
    away = jax.lax.bitcast_convert_type(trunc_bits + jnp.uint32(0x10000), jnp.float32)  # one ulp further out
    inexact = trunc != x
    wrong_way = (x > 0) if up else (x < 0)  # truncation moved it down (x > 0) or up (x < 0)
    y = jnp.where(inexact & wrong_way & jnp.isfinite(x), away, trunc)
    return y.astype(jnp.bfloat16)


def _round_down(x: jax.Array, dtype) -> jax.Array:
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(f"scales are stored in bfloat16, not {dtype}")
    return _round_bf16(x, up=False)


def _round_up(x: jax.Array, dtype) -> jax.Array:
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(f"scales are stored in bfloat16, not {dtype}")
    return _round_bf16(x, up=True)


def quantize(x: jax.Array, axis: int, bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantize x along `axis` (the group axis). Returns (codes uint8 (x's shape), scale, zero) where
    scale/zero have x's shape with `axis` removed, in SCALE_DTYPE. Non-finite inputs give non-finite
    scales (callers flag them; see `cache.py`)."""
    L = levels(bits)
    x32 = x.astype(jnp.float32)
    lo = jnp.min(x32, axis=axis)
    hi = jnp.max(x32, axis=axis)
    zero = _round_down(lo, SCALE_DTYPE)
    # (1 + 2^-20): the float32 division may round below the exact quotient; stay on the safe side.
    need = (hi - zero.astype(jnp.float32)) / L * (1.0 + 2.0 ** -20)
    scale = _round_up(jnp.maximum(need, _TINY_SCALE), SCALE_DTYPE)
    s = jnp.expand_dims(scale.astype(jnp.float32), axis)
    z = jnp.expand_dims(zero.astype(jnp.float32), axis)
    codes = jnp.clip(jnp.round((x32 - z) / s), 0, L)
    codes = jnp.where(jnp.isfinite(codes), codes, 0).astype(jnp.uint8)
    return codes, scale, zero


def dequantize(codes: jax.Array, scale: jax.Array, zero: jax.Array, axis: int) -> jax.Array:
    """float32 reconstruction s * c + z (scale/zero broadcast along `axis`)."""
    s = jnp.expand_dims(scale.astype(jnp.float32), axis)
    z = jnp.expand_dims(zero.astype(jnp.float32), axis)
    return codes.astype(jnp.float32) * s + z


def _codes_per_byte(codes: jax.Array, bits: int) -> int:
    """How many `bits`-bit codes share a byte; the last axis of `codes` must hold a whole number of bytes."""
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"last axis ({codes.shape[-1]}) must be a multiple of {per} to pack {bits}-bit codes")
    return per


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Pack uint8 codes < 2^bits along the last axis: [..., n] -> [..., n * bits / 8]."""
    if bits == 8:
        return codes.astype(jnp.uint8)
    per = _codes_per_byte(codes, bits)
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    return _or_reduce(c << shifts)


def _or_reduce(x: jax.Array) -> jax.Array:
    out = x[..., 0]
    for i in range(1, x.shape[-1]):
        out = out | x[..., i]
    return out


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack`: [..., m] -> [..., m * 8 / bits] uint8 codes."""
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    mask = jnp.uint8((1 << bits) - 1)
    c = (packed[..., None] >> shifts) & mask
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def pack_planar(codes: jax.Array, bits: int) -> jax.Array:
    """Pack uint8 codes < 2^bits along the last axis, planar: [..., n] -> [..., n * bits / 8], byte i holding
    codes i + k n/per at bits [k bits, (k+1) bits) (per = 8 / bits). `unpack_planar` inverts it."""
    if bits == 8:
        return codes.astype(jnp.uint8)
    per = _codes_per_byte(codes, bits)
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], per, codes.shape[-1] // per)
    out = c[..., 0, :]
    for k in range(1, per):
        out = out | (c[..., k, :] << (k * bits))
    return out


def unpack_planar(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack_planar`: [..., m] -> [..., m * 8 / bits] uint8 codes."""
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    return jnp.concatenate([(packed >> (k * bits)) & mask for k in range(8 // bits)], axis=-1).astype(jnp.uint8)


def pack_values(codes: jax.Array, bits: int, packing: str | None = None) -> jax.Array:
    """Value codes packed as `packing` (default `VALUE_PACKING`)."""
    return (pack_planar if (packing or VALUE_PACKING) == "planar" else pack)(codes, bits)


def unpack_values(packed: jax.Array, bits: int, packing: str | None = None) -> jax.Array:
    """Inverse of `pack_values`."""
    return (unpack_planar if (packing or VALUE_PACKING) == "planar" else unpack)(packed, bits)


def quantize_keys(k: jax.Array, bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Keys [..., Bk, d] (one block of tokens): per-channel scale/zero over the block's tokens.
    Returns (packed codes [..., Bk, d*bits/8], scale [..., d], zero [..., d])."""
    codes, scale, zero = quantize(k, axis=-2, bits=bits)
    return pack(codes, bits), scale, zero


def dequantize_keys(packed: jax.Array, scale: jax.Array, zero: jax.Array, bits: int) -> jax.Array:
    """float32 keys [..., Bk, d] from `quantize_keys` output."""
    return dequantize(unpack(packed, bits), scale, zero, axis=-2)


def check_group_size(head_dim: int, group: int, fix: str = "CertPolicy(group_size=...)") -> None:
    """ValueError, naming the fix (`fix`: how the caller sets the group size), where the value group size does not
    divide head_dim."""
    if head_dim % group:
        if head_dim % 2:
            raise ValueError(f"head_dim {head_dim} is odd: the INT4 / INT2 value codes pack two or four channels per "
                             f"byte, so no value group size fits this model")
        raise ValueError(f"head_dim {head_dim} must be a multiple of the value group size {group}: pass "
                         f"{fix} with a divisor of {head_dim}, e.g. {suggested_group_size(head_dim, group)}")


def suggested_group_size(head_dim: int, group: int) -> int:
    """A value group size to suggest for an even head_dim: gcd(head_dim, group), a valid size (>= 2) there."""
    return max(math.gcd(head_dim, group), 2)


def quantize_values(v: jax.Array, group: int, bits: int, packing: str | None = None,
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Values [..., d]: per-token scale/zero for each group of `group` channels.
    Returns (packed codes [..., d*bits/8] (`pack_values`), scale [..., d/group], zero [..., d/group])."""
    d = v.shape[-1]
    check_group_size(d, group)
    g = v.reshape(*v.shape[:-1], d // group, group)
    codes, scale, zero = quantize(g, axis=-1, bits=bits)
    return pack_values(codes.reshape(v.shape), bits, packing), scale, zero


def dequantize_values(packed: jax.Array, scale: jax.Array, zero: jax.Array, group: int, bits: int,
                      packing: str | None = None) -> jax.Array:
    """float32 values [..., d] from `quantize_values` output (packed as `packing`, default `VALUE_PACKING`)."""
    codes = unpack_values(packed, bits, packing)
    d = codes.shape[-1]
    g = codes.reshape(*codes.shape[:-1], d // group, group)
    return dequantize(g, scale, zero, axis=-1).reshape(codes.shape)


# `norm_upper`'s three scalings: the squares of x * 2^k are summed in one pass for each k, and the one whose range
# holds the largest entry is used. (largest entry at least / below this, the scale 2^k)
_NORM_MID = (2.0 ** -40, 2.0 ** 58)  # unscaled: squares of entries up to 2^58, n of them, stay below 2^127
_NORM_BIG_SCALE = -71  # entries above 2^58: (x 2^-71)^2 <= 2^114, n of them below 2^127 (n <= 2^11)
_NORM_SMALL_SCALE = 64  # entries below 2^-40: (x 2^64)^2 < 2^48; squares of normal entries stay normal
_NORM_MAX_TERMS = 1 << 11  # beyond: the two-pass form (scaled by the largest entry)
# A Triton-compiled square root (libdevice __nv_sqrtf: sqrt.rn, or sqrt.approx whose relative error PTX bounds by
# about 2^-23 depending on nvvm-reflect settings we do not control): counted as 2^-20, with room to spare.
KERNEL_SQRT_REL_ERROR = 2.0 ** -20


def norm_upper(x: jax.Array, sqrt_rel_error: float = 0.0) -> jax.Array:
    """An upper bound of ||x||_2 over the last axis (float32), rounded up for its own float32 error and for entries
    whose squares underflow (or that were flushed below the smallest normal float). +inf when x holds a non-finite
    entry. (docs/bounds.md section 3, "Norms".)

    One pass: the sums of the squares of x, x 2^-71 and x 2^64 are sibling reductions of the largest |x| and the
    finiteness check (a GPU runs them as one kernel; scaling by the largest entry first made every norm two
    dependent reductions, two launches: docs/performance.md, twentieth session), and the sum whose scale keeps
    the largest entry's square in range is used: with S that sum and 2^k its scale, ||x||_2 <= 2^-k
    sqrt(S (1 + gamma_n) + 4 n TINY) (each square rounds once and the scalings are exact; a square that underflows,
    or an input flushed to 0, is off by less than 4 TINY in the scaled units), rounded up by 1 + (n + 8) eps.

    sqrt_rel_error: the relative error of a square root that is not correctly rounded (0 for XLA's; a Pallas kernel
    compiled by Triton calls libdevice's `__nv_sqrtf`, which may be `sqrt.approx`: pass `KERNEL_SQRT_REL_ERROR`).
    Only operations a Pallas kernel can lower are used (no boolean reductions: Triton has none), so a kernel calls
    this same function on its rows."""
    a = jnp.abs(x.astype(jnp.float32))
    n = x.shape[-1]
    eps = float(jnp.finfo(jnp.float32).eps)
    tiny = float(jnp.finfo(jnp.float32).tiny)
    big = jnp.max(a, axis=-1)
    if n > _NORM_MAX_TERMS:
        r = a / jnp.where(big > 0, big, 1.0)[..., None]
        norm = big * (jnp.sqrt(jnp.sum(r * r, axis=-1)) * (1.0 + sqrt_rel_error)) * (1.0 + (n + 8) * eps) \
            + tiny * (n + 2)
    else:
        lo, hi = _NORM_MID
        big_scale, small_scale = 2.0 ** _NORM_BIG_SCALE, 2.0 ** _NORM_SMALL_SCALE
        sums = {k: jnp.sum(jnp.square(a * f), axis=-1) for k, f in (("mid", 1.0), ("big", big_scale),
                                                                    ("small", small_scale))}
        squares = jnp.where(big > hi, sums["big"], jnp.where(big < lo, sums["small"], sums["mid"]))
        unscale = jnp.where(big > hi, 1.0 / big_scale, jnp.where(big < lo, 1.0 / small_scale, 1.0))
        root = jnp.sqrt(squares + 4 * n * tiny) * (1.0 + sqrt_rel_error)
        norm = (unscale * root) * (1.0 + (n + 8) * eps) + tiny * (n + 2)
    finite = (jnp.min(jnp.isfinite(x).astype(jnp.int32), axis=-1) > 0) & jnp.isfinite(norm)
    # 0 only for a vector of zeros, read from the bits: a platform that treats subnormal inputs as zero (XLA:CPU)
    # sees big == 0 for a vector of subnormals, whose norm (< sqrt(n) TINY) the floor above still bounds
    magnitude_bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) & jnp.int32(0x7FFFFFFF)
    nonzero = jnp.max(magnitude_bits, axis=-1) > 0
    return jnp.where(finite, jnp.where(nonzero, norm, 0.0), jnp.inf)


class NarrowingSlack(NamedTuple):
    """How far a value may move when it is stored in a narrower float dtype: |stored_c - x_c| <= rel |x_c| +
    absolute per element, and an |x_c| >= fmax may become Inf."""

    rel: float
    absolute: float
    fmax: float


def narrowing_slack(src, dst) -> NarrowingSlack | None:
    """The rounding of a cast from src to dst (None when dst holds every src value exactly: the same dtype, or a
    wider one): half an ulp relative (with a 2^-20 margin), plus the larger of dst's smallest subnormal and float32's
    smallest normal (a platform may flush either)."""
    a, b = jnp.finfo(src), jnp.finfo(dst)
    if not (b.nmant < a.nmant or float(b.max) < float(a.max)):
        return None
    absolute = max(float(b.smallest_subnormal), float(jnp.finfo(jnp.float32).tiny))
    return NarrowingSlack(rel=float(b.eps) / 2 * (1.0 + 2.0 ** -20), absolute=absolute, fmax=float(b.max))


def round_nearest_to(x: jax.Array, dtype) -> jax.Array:
    """float32 x rounded to the nearest value of `dtype` (bfloat16 or float16, ties to even), as float32: what a
    cast to dtype stores. Computed on the bit pattern with integer operations, so that no compiler can elide it
    (XLA on GPU drops f32 -> bf16 -> f32 round trips under its excess-precision rule) and no float flushing
    touches it. Overflow gives +-inf, NaN stays NaN, and float16's subnormals are rounded on their fixed grid of
    2^-24. A platform that flushes subnormal float32 inputs stores 0 where this returns a bfloat16 subnormal (a
    difference below float32's smallest normal; callers allow for it)."""
    dt = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    if dt == jnp.bfloat16:  # the top 16 bits of a float32, rounded to nearest even on the 16 dropped
        rounded = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
        return jnp.where(jnp.isnan(x), x, jax.lax.bitcast_convert_type(rounded, jnp.float32))
    if dt != jnp.float16:
        raise ValueError(f"round_nearest_to rounds to bfloat16 or float16, not {dt}")
    mag = bits & jnp.uint32(0x7FFFFFFF)
    # normal float16 range (from 2^-14): 10 of float32's 23 mantissa bits kept, to nearest even; 2^16 and above
    # (65520 rounds up to it) is beyond float16's largest finite value: inf
    normal = (mag + jnp.uint32(0xFFF) + ((mag >> 13) & jnp.uint32(1))) & jnp.uint32(0xFFFFE000)
    normal = jnp.where(normal >= jnp.uint32(0x47800000), jnp.uint32(0x7F800000), normal)
    # subnormal range (below 2^-14): multiples k 2^-24 of the smallest subnormal, k = the significand m (implicit
    # bit included) shifted right by s = 126 - exponent, rounded to nearest even; s >= 25 (below 2^-25) gives 0
    exponent = (mag >> 23).astype(jnp.int32)
    m = (mag & jnp.uint32(0x7FFFFF)) | jnp.uint32(0x800000)
    s = jnp.clip(126 - exponent, 1, 31).astype(jnp.uint32)
    half = (jnp.uint32(1) << (s - jnp.uint32(1))) - jnp.uint32(1)
    k = (m + half + ((m >> s) & jnp.uint32(1))) >> s
    k = jnp.where((126 - exponent >= 25) | (exponent == 0), jnp.uint32(0), k)
    sub = k.astype(jnp.float32) * jnp.float32(2.0 ** -24)  # exact: k <= 2^10
    out = jnp.where(mag >= jnp.uint32(0x38800000), jax.lax.bitcast_convert_type(normal, jnp.float32), sub)
    out = jnp.where(bits >> 31 == jnp.uint32(1), -out, out)
    return jnp.where(jnp.isnan(x), x, out)


def widen_norm(norm: jax.Array, slack: NarrowingSlack, d: int) -> jax.Array:
    """An upper bound of ||stored||_2 from norm >= ||x||_2 (float32) of a d-vector x stored with `slack`:
    ||stored|| <= (1 + rel) ||x|| + absolute sqrt(d), rounded up."""
    eps = float(jnp.finfo(jnp.float32).eps)
    return (norm * (1.0 + slack.rel) + slack.absolute * math.sqrt(d)) * (1.0 + 4 * eps)


def round_up_to_bf16(x: jax.Array) -> jax.Array:
    """x >= 0 (float32) as bfloat16 rounded toward +inf, so an upper bound stays one: bfloat16 is the top half of
    a float32's bits, and adding 0xFFFF before dropping the low half rounds every non-negative number (subnormal,
    normal, the largest finite -> +inf) up; +inf and NaN stay as they are. Integer operations only (no float
    flushing of subnormals, no nextafter, which XLA:CPU did not compile reliably inside a donated decode step)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    bits = jnp.where(bits >> 31 == 1, jnp.uint32(0), bits)  # a negative input (never a norm): 0
    top = ((bits + jnp.uint32(0xFFFF)) >> 16).astype(jnp.uint16)
    keep = bits >= jnp.uint32(0x7F800000)  # +inf / NaN: their top half as is
    top = jnp.where(keep, (bits >> 16).astype(jnp.uint16), top)
    return jax.lax.bitcast_convert_type(top, jnp.bfloat16)


def mean_error_norm(v: jax.Array, v_hat: jax.Array) -> jax.Array:
    """An upper bound of ||(1/n) sum_i (v_i - v_hat_i)||_2 over the token axis (-2) of v, v_hat [..., n, d]:
    the float32 mean per channel, inflated by gamma_{n+3} of the mean |error| (the subtractions, the n-term
    sum and the division) plus 2 TINY (flushed subnormals), then `norm_upper`. +inf for non-finite input."""
    n = v.shape[-2]
    e = v.astype(jnp.float32) - v_hat
    slack = (n + 3) * 2.0 ** -24 / (1 - (n + 3) * 2.0 ** -24)
    tiny = float(jnp.finfo(jnp.float32).tiny)
    per_channel = jnp.abs(jnp.mean(e, axis=-2)) + slack * jnp.mean(jnp.abs(e), axis=-2) + 2 * tiny
    return norm_upper(per_channel)


def error_op_norm(v: jax.Array, v_hat: jax.Array) -> jax.Array:
    """An upper bound of the spectral norm ||E||_2 of the error matrix E = v - v_hat [..., n, d] (one block):
    sqrt of Gershgorin's bound on the largest eigenvalue of the smaller Gram matrix (E^T E or E E^T), each
    entry's float32 rounding added (gamma_{m+1} of |E|^T |E|, m the contracted size), plus u ||E||_F for the
    subtraction's own rounding and a floor for flushed subnormals. E is first scaled by a power of two that
    brings its largest entry into [1/2, 1) (exact), so that the squares neither underflow (values ~1e-22) nor
    overflow. +inf for non-finite input."""
    n, d = v.shape[-2:]
    e = v.astype(jnp.float32) - v_hat
    amax = jnp.max(jnp.abs(e), axis=(-2, -1), keepdims=True)
    tiny = float(jnp.finfo(jnp.float32).tiny)
    _, ex = jnp.frexp(jnp.where(amax >= tiny, amax, 1.0))  # amax = m 2^ex, m in [1/2, 1)
    e = e * jnp.ldexp(jnp.float32(1.0), -ex)  # exact (a power of two); entries below tiny * 2^-ex may flush
    a = jnp.abs(e)
    if d <= n:
        gram = jnp.einsum("...nc,...nk->...ck", e, e, precision="highest")
        gram_abs = jnp.einsum("...nc,...nk->...ck", a, a, precision="highest")
        m = n
    else:
        gram = jnp.einsum("...nc,...mc->...nm", e, e, precision="highest")
        gram_abs = jnp.einsum("...nc,...mc->...nm", a, a, precision="highest")
        m = d
    u = 2.0 ** -24
    g = (m + 2) * u / (1 - (m + 2) * u)
    rows = jnp.sum(jnp.abs(gram), axis=-1) + g * (1 + g) * jnp.sum(gram_abs, axis=-1)
    lam = jnp.max(rows, axis=-1) * (1 + (min(n, d) + 4) * u)
    frob = jnp.sqrt(jnp.sum(a * a, axis=(-2, -1)))
    scaled = jnp.sqrt(lam) * (1 + 4 * u) + u * frob * (1 + 4 * u) + 4 * tiny * math.sqrt(n * d)
    scale = jnp.ldexp(jnp.float32(1.0), ex[..., 0, 0])
    # back to the input's units (exact), plus the absolute floor of entries flushed in either scale
    bound = jnp.where(amax[..., 0, 0] >= tiny, scaled * scale, 0.0) + 4 * tiny * math.sqrt(n * d)
    return jnp.where(jnp.isfinite(bound) & jnp.all(jnp.isfinite(e), axis=(-2, -1)), bound, jnp.inf)


def token_error_norms(v: jax.Array, v_hat: jax.Array) -> jax.Array:
    """Upper bounds of ||v_i - v_hat_i||_2 per token (float32), see `norm_upper`."""
    return norm_upper(v.astype(jnp.float32) - v_hat)
