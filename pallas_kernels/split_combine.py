"""Split-K combine of the tier-1 pass, with promoted blocks' approximate contributions removed (option (b) of
docs/kernels.md): small-array jnp, run by XLA after the kernel.

    approx = promoted_block_partials(q, k_codes, ..., ids)      # INT partials of the K promoted blocks
    parts = drop_blocks(parts, ids, approx, blocks_per_split)   # subtract them from their splits
    out, log_masses = combine(parts, [exact items...])          # normalized output and per-item log shares

Shapes: parts = Tier1Partials with m, l [B, H, G, nb] and per-split acc [B, H, G, S, d], acc_m [B, H, G, S];
ids [B, H, K] int32 block ids (-1 = empty slot; a repeated id counts once); approx = (m, l, pv) of those blocks,
[B, H, G, K] and [B, H, G, K, d]; an exact item list entry is (m, l, acc) with [B, H, G, n] / [B, H, G, n, d].

The subtraction is cancellation: its rounding is relative to the whole split's magnitude (promoted blocks
included); docs/kernels.md §2.9 states the bound E_num must carry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.tier1_pass import Tier1Partials, block_partials_reference

_HI = "highest"


def _first_occurrence(ids: jax.Array) -> jax.Array:
    """[..., K] bool: ids[..., j] >= 0 and not equal to an earlier entry."""
    K = ids.shape[-1]
    same = ids[..., :, None] == ids[..., None, :]  # [..., K, K]
    earlier = jnp.tril(jnp.ones((K, K), bool), k=-1)
    return (ids >= 0) & ~jnp.any(same & earlier, axis=-1)


def promoted_block_partials(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, ids, *, group_size: int,
                            key_bits: int = 8, value_bits: int = 4) -> tuple[jax.Array, jax.Array, jax.Array]:
    """INT8/INT4 partials (m, l, pv) of the blocks ids [B, H, K] (gathered, then the jnp reference math).
    Empty slots (-1) give m = -inf, l = 0, pv = 0."""
    B, H, K = ids.shape
    safe = jnp.maximum(ids, 0)

    def take(x):  # x [B, H, nb, ...] -> [B, H, K, ...]
        idx = safe.reshape(B, H, K, *([1] * (x.ndim - 3)))
        return jnp.take_along_axis(x, idx, axis=2)

    m, l, pv = block_partials_reference(q, take(k_codes), take(k_scale), take(k_zero), take(v_codes),
                                        take(v_scale), take(v_zero), jnp.full((B,), K, jnp.int32),
                                        group_size=group_size, key_bits=key_bits, value_bits=value_bits)
    keep = (ids >= 0)[:, :, None, :]
    return (jnp.where(keep, m, -jnp.inf), jnp.where(keep, l, 0.0), jnp.where(keep[..., None], pv, 0.0))


def drop_blocks(parts: Tier1Partials, ids: jax.Array, approx: tuple[jax.Array, jax.Array, jax.Array],
                blocks_per_split: int) -> Tier1Partials:
    """Remove blocks ids [B, H, K] from per-split partials: acc_s -= exp(m_n - acc_m_s) pv_n for each distinct
    valid id n in split s = n // blocks_per_split; their m becomes -inf and l 0. approx = (m, l, pv) of those
    blocks as the tier-1 pass computed them (`promoted_block_partials`)."""
    B, H, G, nb = parts.m.shape
    S = parts.acc.shape[-2]
    if S != -(-nb // blocks_per_split):
        raise ValueError(f"acc has {S} splits but {nb} blocks at {blocks_per_split} per split give "
                         f"{-(-nb // blocks_per_split)} (per-block partials need no subtraction: mask them)")
    a_m, _, a_pv = approx
    use = _first_occurrence(ids) & (ids < nb)  # [B, H, K]
    safe = jnp.where(use, ids, 0)
    split = safe // blocks_per_split  # [B, H, K]
    ref_m = jnp.take_along_axis(parts.acc_m, jnp.broadcast_to(split[:, :, None, :], a_m.shape), axis=-1)
    in_parts = jnp.take_along_axis(parts.m, jnp.broadcast_to(safe[:, :, None, :], a_m.shape), axis=-1)
    # only blocks the pass actually added (valid for this sequence) are subtracted
    live = use[:, :, None, :] & jnp.isfinite(a_m) & jnp.isfinite(in_parts)  # [B, H, G, K]
    w = jnp.where(live, jnp.exp(a_m - jnp.where(live, ref_m, 0.0)), 0.0)
    onehot = (split[..., None] == jnp.arange(S)) & use[..., None]  # [B, H, K, S]
    sub = jnp.einsum("bhgk,bhks,bhgkd->bhgsd", w, onehot.astype(w.dtype), a_pv, precision=_HI)
    drop = jnp.any((safe[..., None] == jnp.arange(nb)) & use[..., None], axis=-2)[:, :, None, :]  # [B, H, 1, nb]
    return Tier1Partials(m=jnp.where(drop, -jnp.inf, parts.m), l=jnp.where(drop, 0.0, parts.l),
                         acc=parts.acc - sub, acc_m=parts.acc_m)


def combine(parts: Tier1Partials, items: list[tuple[jax.Array, jax.Array, jax.Array]] = (),
            ) -> tuple[jax.Array, jax.Array]:
    """Normalized output [B, H, G, d] (float32) of the tier-1 partials (either layout) plus extra items (exact
    blocks, the residual), and log_masses [B, H, G, nb + n_items]: each tier-1 block's and item's natural-log
    share of the softmax (-inf when empty), as `attention.combine` returns them. NaN output if nothing is valid."""
    ms = [parts.m] + [m for m, _, _ in items]
    big = jnp.max(jnp.concatenate([parts.acc_m] + ms[1:], axis=-1), axis=-1, keepdims=True)
    big = jnp.where(jnp.isfinite(big), big, 0.0)

    def weight(m):
        return jnp.where(jnp.isfinite(m), jnp.exp(m - big), 0.0)

    num = jnp.einsum("bhgs,bhgsd->bhgd", weight(parts.acc_m), parts.acc, precision=_HI)
    den = jnp.sum(weight(parts.m) * parts.l, axis=-1)
    for m, l, acc in items:
        num = num + jnp.einsum("bhgn,bhgnd->bhgd", weight(m), acc, precision=_HI)
        den = den + jnp.sum(weight(m) * l, axis=-1)
    m_all = jnp.concatenate(ms, axis=-1)
    l_all = jnp.concatenate([parts.l] + [l for _, l, _ in items], axis=-1)
    item_lm = jnp.where(l_all > 0, m_all + jnp.log(jnp.where(l_all > 0, l_all, 1.0)), -jnp.inf)
    safe = jnp.where(den > 0, den, 1.0)
    out = jnp.where((den > 0)[..., None], num / safe[..., None], jnp.nan)
    return out, item_lm - (big[..., 0] + jnp.log(safe))[..., None]
