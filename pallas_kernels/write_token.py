"""A decode step's token write into a model's stacked cache, in one launch, in place.

    res_k, res_v, v_min, v_max, v_norm_max, value_stats = write_token(
        res_k, res_v, v_min, v_max, v_norm_max, value_stats, v_err_max, k, v, r, layer)
    # reference: write_token_reference (same signature, jnp)

Stacked cache arrays (a model's, every layer): res_k, res_v [L, B, H, Bk, d] (the exact residual blocks, in the
cache dtype), v_min, v_max [L, B, H, d] float32 (the running per-channel value range), v_norm_max [L, B, H] float32
(the running maximum of an upper bound of ||v_i||_2 over every token written), value_stats [L, B, H, 4] float32
(`bounds.value_statistics`, which a step's bound reads) and v_err_max [L, B, H] (read only). The new token: k, v
[B, H, d] in the cache dtype (so storing it rounds nothing); r [B] int32 its position in the residual block (nothing
is written where r is outside [0, Bk), neither the row nor the statistics: a full residual's token, which
`TieredKVCache.write_token` drops and flags, or a sequence that takes no token this step); layer an int32 scalar.
Returns the six written arrays with layer `layer` updated: row r[b] of the residual blocks, v_min / v_max widened to
the token's values, v_norm_max raised to the token's norm bound (`quant.norm_upper`), and value_stats' columns that
depend on the range (STAT_RANGE, STAT_ABS_NORM, STAT_ABS_MAX) recomputed from it (STAT_INT changes only at a flush).
The kernel's square roots count Triton's error (`quant.KERNEL_SQRT_REL_ERROR`). The outputs alias the inputs: only
the token's row and the (b, h) statistics of that layer are written.

Why a kernel (docs/performance.md, twenty-first session): written back through XLA, each of these arrays is a
dynamic-update-slice launch of its own per layer-step (XLA does not fuse in-place updates of different buffers),
and the values' statistics were reduced again at every step. Here one program per (b, h) does it all.
The non-finite flag stays with XLA (a boolean array; its update is one small fusion).

A value with a NaN: Triton's float minimum ignores NaN (PTX min.f32) where XLA's propagates it, so v_min / v_max
may differ from the reference for such a token; both are then irrelevant, since the non-finite flag makes every
later certificate of that head +inf. v_norm_max is +inf for it on both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from certattn_jax import bounds, quant
from pallas_kernels import backend

__all__ = ["write_token", "write_token_reference", "supports"]


def supports(cache_dtype, token_dtype) -> bool:
    """The kernel stores the token as it comes: it must already be in the cache dtype (no rounding to bound)."""
    return jnp.dtype(cache_dtype) == jnp.dtype(token_dtype) and jnp.issubdtype(jnp.dtype(cache_dtype), jnp.floating)


def write_token_reference(res_k: jax.Array, res_v: jax.Array, v_min: jax.Array, v_max: jax.Array,
                          v_norm_max: jax.Array, value_stats: jax.Array, v_err_max: jax.Array, k: jax.Array,
                          v: jax.Array, r: jax.Array, layer: jax.Array) -> tuple[jax.Array, ...]:
    """The same result with jnp (tests, the known-answer check)."""
    _check(res_k, res_v, v_min, v_max, v_norm_max, value_stats, v_err_max, k, v, r)
    Bk = res_k.shape[-2]
    at = (jnp.arange(Bk)[None, None, :, None] == r[:, None, None, None])  # [B, 1, Bk, 1]

    def put_row(buf, new):
        old = jax.lax.dynamic_index_in_dim(buf, layer, 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(at, new[:, :, None, :].astype(buf.dtype), old),
                                                   layer, 0)

    def update(buf, new, combine):
        old = jax.lax.dynamic_index_in_dim(buf, layer, 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(buf, combine(old, new), layer, 0)

    v32 = v.astype(jnp.float32)
    writes = ((r >= 0) & (r < Bk))[:, None]  # [B, 1]: elsewhere the statistics stay as they were, like the row
    new_min = update(v_min, v32, lambda old, x: jnp.where(writes[..., None], jnp.minimum(old, x), old))
    new_max = update(v_max, v32, lambda old, x: jnp.where(writes[..., None], jnp.maximum(old, x), old))
    lo, hi, err = (jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False) for x in (new_min, new_max, v_err_max))
    old_stats = jax.lax.dynamic_index_in_dim(value_stats, layer, 0, keepdims=False)
    stats = jnp.where(writes[..., None], _range_stats(lo, hi, err, old_stats, 0.0), old_stats)
    return (put_row(res_k, k), put_row(res_v, v), new_min, new_max,
            update(v_norm_max, quant.norm_upper(v32), lambda old, x: jnp.where(writes, jnp.maximum(old, x), old)),
            jax.lax.dynamic_update_index_in_dim(value_stats, stats, layer, 0))


def _range_stats(v_min: jax.Array, v_max: jax.Array, v_err_max: jax.Array, old: jax.Array, sqrt_rel_error: float,
                 ) -> jax.Array:
    """old [..., 4] value_stats with the columns that depend on v_min, v_max [..., d] (and v_err_max [...])
    recomputed (`bounds.value_statistics`; STAT_INT kept). Built with selects on an iota, which Triton lowers."""
    cols = zip((bounds.STAT_RANGE, bounds.STAT_ABS_NORM, bounds.STAT_ABS_MAX),
               bounds.range_statistics(v_min, v_max, v_err_max, sqrt_rel_error), strict=True)
    col = jax.lax.broadcasted_iota(jnp.int32, old.shape, old.ndim - 1)
    out = old
    for i, x in cols:
        out = jnp.where(col == i, x[..., None], out)
    return out


def _kernel(r_ref, layer_ref, k_ref, v_ref, err_ref, rk_in, rv_in, lo_in, hi_in, nm_in, st_in, rk_ref, rv_ref,
            lo_ref, hi_ref, nm_ref, st_ref, *, block_size: int, sqrt_rel_error: float):
    # refs (one (b, h), every layer): r [1], layer [1]; k, v [1, d]; err [L]; rk, rv [L, Bk, d]; lo, hi [L, d];
    # nm [L]; st [L, 4] (the *_in refs alias the outputs and are not read)
    del rk_in, rv_in, lo_in, hi_in, nm_in, st_in
    lay = layer_ref[0]
    pos = r_ref[0]
    k = k_ref[...]
    v = v_ref[...]

    @pl.when((pos >= 0) & (pos < block_size))  # outside the block: nothing written, neither row nor statistics
    def _store():
        rk_ref[pl.ds(lay, 1), pl.ds(pos, 1), :] = k[None].astype(rk_ref.dtype)
        rv_ref[pl.ds(lay, 1), pl.ds(pos, 1), :] = v[None].astype(rv_ref.dtype)
        v32 = v.astype(jnp.float32)  # [1, d]
        lo = jnp.minimum(lo_ref[pl.ds(lay, 1), :], v32)
        hi = jnp.maximum(hi_ref[pl.ds(lay, 1), :], v32)
        lo_ref[pl.ds(lay, 1), :] = lo
        hi_ref[pl.ds(lay, 1), :] = hi
        norm = quant.norm_upper(v32, sqrt_rel_error=sqrt_rel_error)  # [1]
        nm_ref[pl.ds(lay, 1)] = jnp.maximum(nm_ref[pl.ds(lay, 1)], norm)
        st_ref[pl.ds(lay, 1), :] = _range_stats(lo, hi, err_ref[pl.ds(lay, 1)], st_ref[pl.ds(lay, 1), :],
                                                sqrt_rel_error)


def _check(res_k, res_v, v_min, v_max, v_norm_max, value_stats, v_err_max, k, v, r) -> None:
    if res_k.ndim != 5 or res_v.shape != res_k.shape:
        raise ValueError(f"res_k, res_v must both be stacked [L, B, H, Bk, d], got {res_k.shape}, {res_v.shape}")
    L, B, H, Bk, d = res_k.shape
    want = {"v_min": (v_min, (L, B, H, d)), "v_max": (v_max, (L, B, H, d)), "v_norm_max": (v_norm_max, (L, B, H)),
            "value_stats": (value_stats, (L, B, H, bounds.N_VALUE_STATS)), "v_err_max": (v_err_max, (L, B, H)),
            "k": (k, (B, H, d)), "v": (v, (B, H, d)), "r": (r, (B,))}
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"write_token: {name} must be {list(shape)}, got {list(x.shape)}")
    for name in ("v_min", "v_max", "v_norm_max", "value_stats", "v_err_max"):
        if want[name][0].dtype != jnp.float32:
            raise TypeError(f"write_token: {name} must be float32, got {want[name][0].dtype}")
    if not supports(res_k.dtype, k.dtype) or not supports(res_v.dtype, v.dtype):
        raise TypeError(f"write_token stores the token unrounded: k, v ({k.dtype}, {v.dtype}) must have the cache "
                        f"dtype {res_k.dtype}")


def write_token(res_k: jax.Array, res_v: jax.Array, v_min: jax.Array, v_max: jax.Array, v_norm_max: jax.Array,
                value_stats: jax.Array, v_err_max: jax.Array, k: jax.Array, v: jax.Array, r: jax.Array,
                layer: jax.Array, *, interpret: bool | None = None) -> tuple[jax.Array, ...]:
    """See the module docstring. Grid (B, H), one warp per program (a row of d values)."""
    _check(res_k, res_v, v_min, v_max, v_norm_max, value_stats, v_err_max, k, v, r)
    interpret = backend.interpret() if interpret is None else interpret
    L, B, H, Bk, d = res_k.shape
    row = pl.BlockSpec((None, 1, d), lambda b, h: (b, h, 0))  # the token's [1, d] (a 2-D tile for Triton)
    res = pl.BlockSpec((L, None, None, Bk, d), lambda b, h: (0, b, h, 0, 0))
    stat = pl.BlockSpec((L, None, None, d), lambda b, h: (0, b, h, 0))
    norm = pl.BlockSpec((L, None, None), lambda b, h: (0, b, h))
    stats = pl.BlockSpec((L, None, None, bounds.N_VALUE_STATS), lambda b, h: (0, b, h, 0))
    scalar = pl.BlockSpec((1,), lambda b, h: (0,))
    lay = jnp.clip(jnp.asarray(layer, jnp.int32), 0, L - 1).reshape(1)
    kernel = functools.partial(_kernel, block_size=Bk,
                               sqrt_rel_error=0.0 if interpret else quant.KERNEL_SQRT_REL_ERROR)
    outs = (res_k, res_v, v_min, v_max, v_norm_max, value_stats)
    return tuple(pl.pallas_call(
        kernel,
        grid=(B, H),
        in_specs=[pl.BlockSpec((1,), lambda b, h: (b,)), scalar, row, row, norm, res, res, stat, stat, norm, stats],
        out_specs=[res, res, stat, stat, norm, stats],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outs],
        input_output_aliases={5: 0, 6: 1, 7: 2, 8: 3, 9: 4, 10: 5},
        compiler_params=backend.compiler_params(1, 1) if not interpret else None,
        interpret=interpret,
        name="certattn_write_token",
    )(jnp.asarray(r, jnp.int32), lay, k, v, v_err_max, *outs))
