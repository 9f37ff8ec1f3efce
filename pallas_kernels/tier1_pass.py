"""The tier-1 pass of certified decode attention: one read of the quantized KV bytes.

Per sequence b, KV head h and block n < n_valid[b] of Bk tokens, for each of the G query heads g that share
the KV head (all G scored together, so every byte is read once):

    k_hat_ic = s_nc * code_ic + z_nc              INT keys, per-block per-channel scale/zero (quant.py)
    v_hat_ic = t_i,c//gs * code'_ic + y_i,c//gs    INT values, per-token scale/zero per group of gs channels
    s_gi  = (q_g . k_hat_i) / sqrt(d)
    m_gn  = max_{i in n} s_gi                      (block max score)
    l_gn  = sum_{i in n} exp(s_gi - m_gn)          (block sum-exp: log-mass = m + log l)
    pv_gn = sum_{i in n} exp(s_gi - m_gn) v_hat_i  (block value sum)

which are the flash-decoding partials that `certattn_jax.attention.build_context` computes with jnp. The
value sums leave the kernel in one of two layouts (`per_block_acc`):

  * per block:  acc [B, H, G, nb, d] = pv, acc_m = m (what the jnp code keeps; 4 d bytes per block and query
    head of extra writes: ~15% of the bytes read for G = 4, d = 128);
  * per split:  the blocks are cut into S = ceil(nb / bps) splits of `bps` blocks; each split keeps an online-
    softmax accumulator acc [B, H, G, S, d] = sum_{n in split} exp(m_n - acc_m) pv_n with acc_m [B, H, G, S] =
    max_{n in split} m_n (-inf and 0 for a split without valid blocks). The promoted blocks' approximate
    contributions are removed later by subtracting exp(m_n - acc_m) pv_n recomputed for those blocks only
    (docs/kernels.md: rounding model).

Blocks n >= n_valid[b] are never read; their m is -inf, l is 0 (and acc 0 in the per-block layout). Float32
dequantized keys or values never exist in memory: codes are unpacked and dequantized in registers.

Layouts are those of `certattn_jax.cache.TieredKVCache` (codes packed along d, low bits = lower channel):
    q        [B, H, G, d]          float32 (any float: cast)
    k_codes  [B, H, nb, Bk, d*kb/8] uint8,   k_scale, k_zero [B, H, nb, d]        (bf16)
    v_codes  [B, H, nb, Bk, d*vb/8] uint8,   v_scale, v_zero [B, H, nb, Bk, d/gs] (bf16)
    n_valid  [B] int32             full blocks of each sequence (clipped to [0, nb])
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
from pallas_kernels import backend

_HI = "highest"
# Default number of programs to aim for when choosing blocks per split (a few waves of 132 SMs).
_TARGET_PROGRAMS = 1024
SLOT_ROWS = 16  # tokens of a hot slot / the residual per step of the slot programs (see slot_work)


class Tier1Partials(NamedTuple):
    """m, l [B, H, G, nb]; acc [B, H, G, n_acc, d] relative to acc_m [B, H, G, n_acc] (n_acc = nb per block,
    S per split); delta [B, H, G, nb] each block's Delta (bounds.key_delta_quantized) when asked for, else None;
    hot_acc [B, H, G, K, d] the value sums of the hot set's blocks (left out of the split accumulators) when
    hot_ids are given, else None; slot_m, slot_l, slot_delta [B, H, G, P], slot_acc [B, H, G, P, d] the exact
    partials of the hot slots and the residual (slot K) when `slots` are given (`slot_partials_reference`)."""

    m: jax.Array
    l: jax.Array
    acc: jax.Array
    acc_m: jax.Array
    delta: jax.Array | None = None
    hot_acc: jax.Array | None = None
    slot_m: jax.Array | None = None
    slot_l: jax.Array | None = None
    slot_acc: jax.Array | None = None
    slot_delta: jax.Array | None = None


def supports(block_size: int, head_dim: int, group_size: int, value_bits: int | None = None) -> bool:
    """Whether the kernel runs on these shapes here: compiled (Triton) tensors need power-of-two sizes;
    interpret mode takes any; with value_bits, also the walk of the cache's value packing (`value_parts`: planar
    codes need head_dim / codes-per-byte and the group size to divide one another, e.g. not 48 with 16 at 4 bits)."""
    if not backend.supports_sizes(block_size, head_dim, group_size):
        return False
    if value_bits is not None:
        try:
            value_parts(head_dim, group_size, value_bits, cache_values_planar())
        except ValueError:
            return False
    return True


def default_blocks_per_split(batch: int, kv_heads: int, num_blocks: int) -> int:
    """Blocks per split so that batch * kv_heads * splits is about _TARGET_PROGRAMS."""
    splits = max(1, min(num_blocks, -(-_TARGET_PROGRAMS // max(1, batch * kv_heads))))
    return max(1, -(-num_blocks // splits))


# How the certified fast pass splits the blocks (`fast_pass_blocks_per_split`), CERTATTN_TIER1_BPS:
#   unset / "fewer" (the default): at least min(4, max(1, nb // _BLOCKS_PER_STEP)) blocks per split (nb: blocks
#     per KV head), else as "programs". A split's blocks are a serial chain in its tier-1 program, and the certify
#     kernel merges one accumulator per split: more blocks per split lengthen the first, shorten the second, so
#     the best count grows with the blocks per head. Measured: on the H200 (8B layer, 8K, 128 blocks) the full
#     fast-pass launch 35.1 us at 1 block per split (1,024 programs) against 28.3 us at 4, 56.6 us at 8 (fifteenth
#     session); end to end 8B 8K certified 97.2 and 97.5 tokens/s at 4 against 93.5 at 1, alternated
#     (results/bench_generate_h200_fewer_pair_*_2026-12-04e.json); on the H100 (SmolLM2, twenty-third session,
#     results/gpu_2026-12-06c/abb_*.json) 1K (16 blocks): 1 block 514.6, 2 510.1, 4 450.4 tokens/s; 4K (64
#     blocks): 1 block 415.8 / 415.1, 2 444.8, 4 413.5 / 410.3. Every size from 32K keeps what "programs" gives;
#   "programs": `default_blocks_per_split` (about _TARGET_PROGRAMS programs), the rule before;
#   an integer N >= 1: N blocks per split at every size (tests and measurements).
# The bound follows whatever is chosen: E_num's chain term takes the blocks per split (docs/bounds.md section 14).
_BLOCKS_PER_STEP = 32


def _valid_split_rule(rule: str) -> bool:
    return rule in ("programs", "fewer") or (rule.isdigit() and int(rule) >= 1)


FAST_PASS_BPS = os.environ.get("CERTATTN_TIER1_BPS", "").strip() or "fewer"
if not _valid_split_rule(FAST_PASS_BPS):
    raise ValueError(f"CERTATTN_TIER1_BPS={FAST_PASS_BPS!r}: choose programs, fewer or a positive integer")


def fast_pass_blocks_per_split(batch: int, kv_heads: int, num_blocks: int, rule: str | None = None) -> int:
    """Blocks per split of the certified fast pass's tier-1 launch (`rule`, default FAST_PASS_BPS: see there)."""
    rule = rule or FAST_PASS_BPS
    if not _valid_split_rule(rule):
        raise ValueError(f"split rule {rule!r}: choose programs, fewer or a positive integer")
    if rule.isdigit():
        return max(1, min(int(rule), max(num_blocks, 1)))
    bps = default_blocks_per_split(batch, kv_heads, num_blocks)
    if rule == "fewer":
        bps = max(bps, min(4, max(1, num_blocks // _BLOCKS_PER_STEP)))
    return bps


def _check_inputs(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_valid, group_size, key_bits,
                  value_bits, key_signed: bool = False) -> tuple[int, ...]:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, H, G, d], got {q.shape}")
    B, H, G, d = q.shape
    for bits, name in ((key_bits, "key_bits"), (value_bits, "value_bits")):
        if bits not in (2, 4, 8):
            raise ValueError(f"{name} must be 2, 4 or 8, got {bits}")
    if k_codes.ndim != 5 or k_codes.shape[:2] != (B, H):
        raise ValueError(f"k_codes must be [B, H, nb, Bk, d*kb/8] with (B, H) = {(B, H)}, got {k_codes.shape}")
    nb, Bk = k_codes.shape[2], k_codes.shape[3]
    if d % group_size:
        raise ValueError(f"head_dim {d} must be a multiple of the value group size {group_size}")
    want = {
        "k_codes": (k_codes, (B, H, nb, Bk, d * key_bits // 8), jnp.int8 if key_signed else jnp.uint8),
        "k_scale": (k_scale, (B, H, nb, d), None),
        "k_zero": (k_zero, (B, H, nb, d), None),
        "v_codes": (v_codes, (B, H, nb, Bk, d * value_bits // 8), jnp.uint8),
        "v_scale": (v_scale, (B, H, nb, Bk, d // group_size), None),
        "v_zero": (v_zero, (B, H, nb, Bk, d // group_size), None),
        "n_valid": (n_valid, (B,), None),
    }
    for name, (x, shape, dtype) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {shape}")
        if dtype is not None and x.dtype != dtype:
            raise TypeError(f"{name} must be {jnp.dtype(dtype).name}, got {x.dtype}")
    if key_signed and key_bits != 8:
        raise ValueError(f"signed key codes (key_signed) are 8-bit keys only, got key_bits={key_bits}")
    if not jnp.issubdtype(n_valid.dtype, jnp.integer):
        raise TypeError(f"n_valid must be integer, got {n_valid.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q must be floating point, got {q.dtype}")
    return B, H, G, d, nb, Bk


def cache_values_planar() -> bool:
    """Whether the cache packs value codes planar (`quant.VALUE_PACKING`): the kernel's `value_planar` default."""
    return quant.VALUE_PACKING == "planar"


def _repack_values(v_codes: jax.Array, value_bits: int, from_planar: bool, to_planar: bool) -> jax.Array:
    if from_planar == to_planar:
        return v_codes
    codes = quant.unpack_values(v_codes, value_bits, "planar" if from_planar else "interleaved")
    return quant.pack_values(codes, value_bits, "planar" if to_planar else "interleaved")


def standard_layout(k_codes: jax.Array, v_codes: jax.Array, key_bits: int, value_bits: int, key_signed: bool,
                    value_planar: bool) -> tuple[jax.Array, jax.Array]:
    """The key and value codes in the cache's layout (uint8 key codes, values packed as `quant.VALUE_PACKING`)
    from the kernel's optional layouts: signed int8 keys (code - 2^(bits-1)); values planar or interleaved."""
    if key_signed:
        k_codes = (k_codes.astype(jnp.int32) + (1 << (key_bits - 1))).astype(jnp.uint8)
    return k_codes, _repack_values(v_codes, value_bits, value_planar, cache_values_planar())


def kernel_layout(k_codes: jax.Array, v_codes: jax.Array, key_bits: int, value_bits: int, key_signed: bool,
                  value_planar: bool) -> tuple[jax.Array, jax.Array]:
    """Inverse of `standard_layout`: the cache's codes in the kernel's optional layouts."""
    if key_signed:
        k_codes = (k_codes.astype(jnp.int32) - (1 << (key_bits - 1))).astype(jnp.int8)
    return k_codes, _repack_values(v_codes, value_bits, cache_values_planar(), value_planar)


# ---------------------------------------------------------------------------------------------- reference
def block_partials_reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_valid, *, group_size: int,
                             key_bits: int = 8, value_bits: int = 4, score_scale: float | None = None,
                             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-block (m, l, pv) with jnp, the math of `attention.build_context` / `attention.partials`:
    m, l [B, H, G, nb], pv [B, H, G, nb, d] (float32 dequantized keys/values are materialized here). Scores are
    q . k_hat times score_scale (default 1/sqrt(d), as `tier1_pass`)."""
    B, H, G, d, nb, Bk = _check_inputs(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_valid,
                                       group_size, key_bits, value_bits)
    q32 = q.astype(jnp.float32)
    valid = jnp.arange(nb)[None, :] < jnp.clip(n_valid, 0, nb)[:, None]  # [B, nb]
    k_hat = quant.dequantize_keys(k_codes, k_scale, k_zero, key_bits)
    s = jnp.einsum("bhgd,bhntd->bhgnt", q32, k_hat, precision=_HI) * _score_scale(d, score_scale)
    s = jnp.where(valid[:, None, None, :, None], s, -jnp.inf)
    v_hat = quant.dequantize_values(v_codes, v_scale, v_zero, group_size, value_bits)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(s - m_safe[..., None])
    l = jnp.sum(w, axis=-1)
    pv = jnp.einsum("bhgnt,bhntd->bhgnd", w, v_hat, precision=_HI)
    return m, l, pv


def tier1_pass_reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_valid, *, group_size: int,
                         key_bits: int = 8, value_bits: int = 4, per_block_acc: bool = False,
                         blocks_per_split: int | None = None, q_abs: jax.Array | None = None,
                         out_blocks: int | None = None, hot_ids: jax.Array | None = None,
                         out_splits: int | None = None, slots: Slots | None = None,
                         score_scale: float | None = None, layer: jax.Array | None = None,
                         key_signed: bool = False, value_planar: bool | None = None, **_unused) -> Tier1Partials:
    """Pure-jnp `tier1_pass` (same signature and outputs; query heads never padded). Split accumulators are
    formed from the per-block partials as sum_n exp(m_n - M_s) pv_n, M_s = max_{n in s} m_n. delta (with q_abs):
    bounds.key_delta_quantized with the integer pieces, 0 for invalid blocks. layer: the tier-1 arrays are stacked
    [L, ...]; that layer's are read."""
    if layer is not None:
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = (x[layer] for x in (k_codes, k_scale, k_zero, v_codes,
                                                                                 v_scale, v_zero))
        if hot_ids is not None and hot_ids.ndim == 4:  # the hot set and the residual stacked too
            hot_ids = hot_ids[layer]
            if slots is not None:
                slots = slots._replace(hot_k=slots.hot_k[layer], hot_v=slots.hot_v[layer], hot_ids=hot_ids,
                                       res_k=slots.res_k[layer], res_v=slots.res_v[layer])
    value_planar = cache_values_planar() if value_planar is None else value_planar
    k_codes, v_codes = standard_layout(k_codes, v_codes, key_bits, value_bits, key_signed, value_planar)
    m, l, pv = block_partials_reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_valid,
                                        group_size=group_size, key_bits=key_bits, value_bits=value_bits,
                                        score_scale=score_scale)
    B, H, G, nb = m.shape
    delta = None
    if q_abs is not None:
        valid = jnp.arange(nb)[None, :] < jnp.clip(n_valid, 0, nb)[:, None]
        delta = bounds.key_delta_quantized(q_abs.astype(jnp.float32), k_scale, k_zero, key_bits, int_pieces=True)
        delta = jnp.where(valid[:, None, None, :], delta, 0.0)
    extra = (out_blocks or nb) - nb

    def cols(x, value, trailing=0):  # pad the block axis (3) to out_blocks with empty blocks
        if x is None or not extra:
            return x
        return jnp.pad(x, ((0, 0),) * 3 + ((0, extra),) + ((0, 0),) * trailing, constant_values=value)

    if per_block_acc:
        m_o = cols(m, -jnp.inf)
        return Tier1Partials(m=m_o, l=cols(l, 0.0), acc=cols(pv, 0.0, 1), acc_m=m_o, delta=cols(delta, 0.0))
    bps = blocks_per_split or default_blocks_per_split(B, H, nb)
    S = -(-nb // bps)
    pad = S * bps - nb
    m_in = m
    hot_acc = None
    if hot_ids is not None:  # the hot set's blocks leave the splits; their value sums go to their slots
        valid = jnp.arange(nb)[None, :] < jnp.clip(n_valid, 0, nb)[:, None]  # [B, nb]
        is_hot = jnp.any(hot_ids[..., :, None] == jnp.arange(nb), axis=-2)  # [B, H, nb]
        m_in = jnp.where(is_hot[:, :, None, :], -jnp.inf, m)
        ok = (hot_ids >= 0) & (hot_ids < jnp.sum(valid, axis=-1)[:, None, None])  # [B, H, K]
        taken = jnp.take_along_axis(pv, jnp.maximum(hot_ids, 0)[:, :, None, :, None], axis=3)
        hot_acc = jnp.where(ok[:, :, None, :, None], taken, 0.0)
    m_p = jnp.pad(m_in, ((0, 0),) * 3 + ((0, pad),), constant_values=-jnp.inf).reshape(B, H, G, S, bps)
    pv_p = jnp.pad(pv, ((0, 0),) * 3 + ((0, pad), (0, 0))).reshape(B, H, G, S, bps, -1)
    acc_m = jnp.max(m_p, axis=-1)
    w = jnp.where(jnp.isfinite(m_p), jnp.exp(m_p - jnp.where(jnp.isfinite(acc_m), acc_m, 0.0)[..., None]), 0.0)
    acc = jnp.einsum("bhgsn,bhgsnd->bhgsd", w, pv_p, precision=_HI)
    if out_splits and out_splits > S:
        acc = jnp.pad(acc, ((0, 0),) * 3 + ((0, out_splits - S), (0, 0)))
        acc_m = jnp.pad(acc_m, ((0, 0),) * 3 + ((0, out_splits - S),), constant_values=-jnp.inf)
    slot_out = [None] * 4
    if slots is not None:
        scale = _score_scale(q.shape[-1], score_scale)
        slot_out = slot_partials_reference(q.astype(jnp.float32) * scale, q_abs.astype(jnp.float32), slots)
    return Tier1Partials(m=cols(m, -jnp.inf), l=cols(l, 0.0), acc=acc, acc_m=acc_m, delta=cols(delta, 0.0),
                         hot_acc=hot_acc, slot_m=slot_out[0], slot_l=slot_out[1], slot_acc=slot_out[2],
                         slot_delta=slot_out[3])


class Slots(NamedTuple):
    """The exact items a certified step attends besides the INT blocks: the hot set's blocks hot_k, hot_v
    [B, H, K, Bk, d] (hot_ids [B, H, K], -1 = empty) and the residual block res_k, res_v [B, H, Bk, d] whose first
    r_count [B] tokens are valid; computed as n_slots >= K + 1 items (slot K the residual, the rest empty)."""

    hot_k: jax.Array
    hot_v: jax.Array
    hot_ids: jax.Array
    res_k: jax.Array
    res_v: jax.Array
    r_count: jax.Array
    n_slots: int


def slot_partials_reference(q_scaled: jax.Array, q_abs: jax.Array, slots: Slots,
                            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(m, l [B, H, G, P], acc [B, H, G, P, d], Delta [B, H, G, P]) of the slots' exact keys and values for the
    pre-scaled query q_scaled and |q| q_abs [B, H, G, d]: m the max score, l the sum of exp(s - m), acc the
    exp-weighted value sum (empty slots m = -inf, l = 0, acc = 0), Delta = bounds.key_delta_exact over each slot's
    valid tokens. Float32, `precision=highest` (the jnp path; the kernel's slot programs compute the same)."""
    B, H, K, Bk, d = slots.hot_k.shape
    pad = slots.n_slots - K - 1
    if pad < 0:
        raise ValueError(f"n_slots {slots.n_slots} must be at least the hot slots + 1 = {K + 1}")
    keys = [slots.hot_k, slots.res_k[:, :, None].astype(slots.hot_k.dtype)]
    values = [slots.hot_v, slots.res_v[:, :, None].astype(slots.hot_v.dtype)]
    res_tok = jnp.arange(Bk)[None, :] < slots.r_count[:, None]  # [B, Bk]
    ok = [jnp.broadcast_to((slots.hot_ids >= 0)[..., None], (B, H, K, Bk)),
          jnp.broadcast_to(res_tok[:, None, None, :], (B, H, 1, Bk))]
    if pad:
        keys.append(jnp.zeros((B, H, pad, Bk, d), slots.hot_k.dtype))
        values.append(jnp.zeros((B, H, pad, Bk, d), slots.hot_v.dtype))
        ok.append(jnp.zeros((B, H, pad, Bk), bool))
    tok = jnp.concatenate(ok, axis=2)  # [B, H, P, Bk]
    k32 = jnp.where(tok[..., None], jnp.concatenate(keys, axis=2).astype(jnp.float32), 0.0)
    v32 = jnp.where(tok[..., None], jnp.concatenate(values, axis=2).astype(jnp.float32), 0.0)
    s = jnp.einsum("bhgd,bhstd->bhgst", q_scaled, k32, precision=_HI)
    s = jnp.where(tok[:, :, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    w = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    acc = jnp.einsum("bhgst,bhstd->bhgsd", w, v32, precision=_HI)
    return m, jnp.sum(w, axis=-1), acc, bounds.key_delta_exact(q_abs, jnp.max(jnp.abs(k32), axis=-2))


# ---------------------------------------------------------------------------------------------- kernel
def _interleave(parts: list[jax.Array]) -> jax.Array:
    """parts[k][..., j] -> out[..., j * len(parts) + k] (len a power of 2; only 2-way stacks: Triton's join)."""
    if len(parts) == 1:
        return parts[0]
    a = _interleave(parts[0::2])
    b = _interleave(parts[1::2])
    return jnp.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])


def _unpack(packed: jax.Array, bits: int) -> jax.Array:
    """uint8 [..., m] -> int32 codes [..., m * 8 / bits] (quant.pack's layout: lowest bits = lowest index)."""
    x = packed.astype(jnp.int32)
    if bits == 8:
        return x
    per, mask = 8 // bits, (1 << bits) - 1
    return _interleave([(x >> (k * bits)) & mask for k in range(per)])


def _split_range(nvalid_ref, nb: int, bps: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """This program's blocks [start, stop) of its split (grid axis 2), and v_stop: the end of its valid ones."""
    start = pl.program_id(2) * bps
    stop = jnp.minimum(start + bps, nb)
    n_valid = jnp.clip(nvalid_ref[()], 0, nb)
    return start, stop, jnp.clip(n_valid, start, stop)


def _write_empty_block(m_ref, l_ref, acc_ref, n, G: int, d: int, per_block: bool) -> None:
    """Statistics of an invalid block n: m = -inf, l = 0 (and acc = 0 in the per-block layout). Broadcast
    arrays, not Python scalars: the Triton lowering of jax 0.11 mis-types literal stores."""
    m_ref[:, n] = jnp.full((G,), -jnp.inf, jnp.float32)
    l_ref[:, n] = jnp.zeros((G,), jnp.float32)
    if per_block:
        acc_ref[:, n, :] = jnp.zeros((G, d), jnp.float32)


def _tier1_kernel(nvalid_ref, q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, m_ref, l_ref, acc_ref,
                  *maybe_am_ref, nb: int, bps: int, G: int, d: int, Bk: int, group: int, key_bits: int,
                  value_bits: int, per_block: bool, scale: float):
    # refs (b, h squeezed): q [G, d]; kc [nb, Bk, dk]; ks, kz [nb, d]; vc [nb, Bk, dv]; vs, vz [nb, Bk, d/gs];
    # m, l [G, nb]; acc [G, nb | S, d]; am [G, S] (split layout only)
    f32 = jnp.float32
    split = pl.program_id(2)
    start, stop, v_stop = _split_range(nvalid_ref, nb, bps)
    inv_sqrt_d = scale
    ng = d // group
    qs = [q_ref[g, :].astype(f32) for g in range(G)]

    def valid_block(n, carry):
        ks = ks_ref[n, :].astype(f32)
        kz = kz_ref[n, :].astype(f32)
        k_hat = _unpack(kc_ref[n, :, :], key_bits).astype(f32) * ks[None, :] + kz[None, :]  # [Bk, d]
        vcodes = _unpack(vc_ref[n, :, :], value_bits).astype(f32).reshape(Bk, ng, group)
        vs = vs_ref[n, :, :].astype(f32)
        vz = vz_ref[n, :, :].astype(f32)
        v_hat = (vcodes * vs[:, :, None] + vz[:, :, None]).reshape(Bk, d)  # [Bk, d]
        new = []
        for g in range(G):
            s = _scaled(jnp.sum(k_hat * qs[g][None, :], axis=1), inv_sqrt_d)  # [Bk]
            m = jnp.max(s)
            p = jnp.exp(s - m)
            pv = jnp.sum(p[:, None] * v_hat, axis=0)  # [d]
            m_ref[g, n] = m
            l_ref[g, n] = jnp.sum(p)
            if per_block:
                acc_ref[g, n, :] = pv
            else:
                m_run, acc = carry[g]
                m_new = jnp.maximum(m_run, m)
                new.append((m_new, acc * jnp.exp(m_run - m_new) + jnp.exp(m - m_new) * pv))
        return tuple(new) if not per_block else carry

    def empty_block(n, carry):
        _write_empty_block(m_ref, l_ref, acc_ref, n, G, d, per_block)
        return carry

    init = () if per_block else tuple((jnp.array(-jnp.inf, f32), jnp.zeros((d,), f32)) for _ in range(G))
    final = jax.lax.fori_loop(start, v_stop, valid_block, init)
    jax.lax.fori_loop(v_stop, stop, empty_block, 0)
    if not per_block:
        (am_ref,) = maybe_am_ref
        for g in range(G):
            m_run, acc = final[g]
            acc_ref[g, split, :] = acc
            am_ref[g, split] = m_run


def _scaled(scores: jax.Array, scale: float) -> jax.Array:
    """scores * scale, or the scores themselves when scale is 1 (a query already divided by sqrt(d): then no
    multiply follows the dot that a compiler could contract with the softmax's subtraction)."""
    return scores if scale == 1.0 else scores * scale


def _codes_f32(codes: jax.Array, magic: bool) -> jax.Array:
    """int32 codes in [0, 255] -> exact float32. magic: bit trick (2^23 + c) - 2^23 (an OR and an exact FADD)
    instead of an int->float conversion instruction (quarter rate on the GPU)."""
    if not magic:
        return codes.astype(jnp.float32)
    return jax.lax.bitcast_convert_type(codes | 0x4B000000, jnp.float32) - 8388608.0


def _dot(a: jax.Array, b: jax.Array, b_contract: int, a_contract: int = 1) -> jax.Array:
    """2-D a . b contracting a's axis a_contract with b's axis b_contract, in float32 with HIGHEST precision: the
    Triton lowering then asks for IEEE float32 inputs (no TF32), i.e. FMA accumulation (pl.dot is gone in
    jax 0.11, so lax directly)."""
    return jax.lax.dot_general(a, b, (((a_contract,), (b_contract,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _pow2(e: jax.Array) -> jax.Array:
    """2.0 ** e for int32 e in [-126, 127], built from the exponent bits (exact)."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _int8_pieces(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exact fixed-point split of each row of a [G, d] (float32) into 4 int8 pieces:

        a_gc = inv_f_g * sum_k P[g*4 + k, c] 2^(-7k) + r_gc,   |P| <= 65,   |r_gc| <= max(2^-26 max_c |a_gc|, 2^-126)

    with inv_f_g = 2^(E_g - 6) a power of two, 2^(E_g - 1) <= max_c |a_gc| < 2^E_g. Returns (P int8 [4G, d],
    inv_f [G]). All steps are exact in float32 (power-of-two scalings, floor, differences of nearby integers);
    the 2^-126 covers platforms that flush subnormal inputs to zero."""
    G, d = a.shape
    amax = jnp.max(jnp.abs(a), axis=1)  # [G]
    e = jnp.maximum((jax.lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF, 6)  # biased exponent of amax
    x = a * _pow2(132 - e)[:, None]  # |x| < 64 (E = e - 126; scale 2^(6 - E))
    k = jax.lax.broadcasted_iota(jnp.int32, (1, 4, 1), 1)
    y = x[:, None, :] * _pow2(7 * k)  # [G, 4, d]: x 2^(7k), exact
    # floor(y + 1/2): round to nearest (no round primitive in the Triton lowering); off by at most 1 where
    # |y| >= 2^23, which keeps |P| <= 65 and the telescoped remainder below 2^-21 in units of x.
    r_k = jnp.floor(y + 0.5)
    # the previous piece's rounding; none for k = 0. (Not floor(x / 128 + 1/2), which is 0 only while |x| < 64:
    # where a compiler evaluates the max and the values from two computations of `a` that differ in the last
    # bit -- XLA on the CPU fused exp twice in interpret mode -- x reaches 64 and that piece came out 128 low.)
    r_prev = jnp.where(k == 0, 0.0, jnp.floor(y * (1.0 / 128.0) + 0.5))
    pieces = (r_k - 128.0 * r_prev).astype(jnp.int8).reshape(4 * G, d)
    return pieces, _pow2(e - 132)


def _int8_pieces_cols(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`_int8_pieces` of each column of w [n, G] (exponent shared down a column): (P int8 [n, 4G] with
    w_ig = inv_f_g sum_k P[i, g*4 + k] 2^(-7k) + r_ig, inv_f [G]); same bounds."""
    amax = jnp.max(jnp.abs(w), axis=0)  # [G]
    e = jnp.maximum((jax.lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF, 6)
    x = w * _pow2(132 - e)[None, :]
    k = jax.lax.broadcasted_iota(jnp.int32, (1, 1, 4), 2)
    y = x[:, :, None] * _pow2(7 * k)  # [n, G, 4]
    r_prev = jnp.where(k == 0, 0.0, jnp.floor(y * (1.0 / 128.0) + 0.5))  # as in `_int8_pieces`
    pieces = (jnp.floor(y + 0.5) - 128.0 * r_prev).astype(jnp.int8)
    return pieces.reshape(w.shape[0], 4 * w.shape[1]), _pow2(e - 132)


def _int_scores(q, ks, kz, codes_packed, key_bits: int, inv_sqrt_d: float, signed: bool = False):
    """Scores [Bk, G] of q [G, d] against one block's packed key codes with the exact int8 dot (see
    _tier1_kernel_dot, int_keys). signed: the codes come as int8 code - 2^(bits-1) already (8-bit keys), so
    the tile feeds the dot as loaded."""
    G = q.shape[0]
    off = 1 << (key_bits - 1)
    a = q * ks[None, :]
    pieces, inv_f = _int8_pieces(a)
    codes_i8 = codes_packed if signed else (_unpack(codes_packed, key_bits) - off).astype(jnp.int8)  # [Bk, d]
    si = _exact_int_dot(codes_i8, pieces, 1, 1)  # [Bk, 4G]
    kk = jax.lax.broadcasted_iota(jnp.int32, (1, 1, 4), 2)
    t = jnp.sum(si.reshape(codes_i8.shape[0], G, 4) * _pow2(-7 * kk), axis=2)  # [Bk, G]
    base = off * jnp.sum(a, axis=1) + jnp.sum(q * kz[None, :], axis=1)  # [G]
    return _scaled(t * inv_f[None, :] + base[None, :], inv_sqrt_d)


# Shortest contraction an int8 x int8 -> int32 dot may have. Triton's int8 MMA instruction contracts 32 at a
# time; with 16 (a block of 16 tokens, or head_dim 16) the compiled dot on the H200 returns exactly twice the
# product (jax 0.11.2; scripts/probe_int_dot.py, results/probe_int_dot_h200.log), which made rung 0 certify wrong
# outputs for block_size 16 (docs/performance.md, 2026-12-01). Shorter contractions take a float32 IEEE dot of
# the same integers, which is exact too: every product and partial sum is an integer below 2^24 (|P| <= 65,
# |code| <= 128, fewer than 32 terms).
MIN_INT8_CONTRACTION = 32


def _exact_int_dot(a: jax.Array, b: jax.Array, a_contract: int, b_contract: int) -> jax.Array:
    """The exact 2-D product of int8 a and b contracting a's axis a_contract with b's b_contract, as float32."""
    if a.shape[a_contract] >= MIN_INT8_CONTRACTION:
        return jax.lax.dot_general(a, b, (((a_contract,), (b_contract,)), ((), ())),
                                   preferred_element_type=jnp.int32).astype(jnp.float32)
    return _dot(a.astype(jnp.float32), b.astype(jnp.float32), b_contract=b_contract, a_contract=a_contract)


def _value_weights(p: jax.Array, t_j: jax.Array, y_j: jax.Array, value_bits: int):
    """The per-group half of `_int_value_sum`: (int8 pieces [Bk, 4G] of w = p t_j, their inv_f [G], the base
    off sum_i w_ig + sum_i p_ig y_ij [G])."""
    w = p * t_j[:, None]  # [Bk, G]
    pieces, inv_f = _int8_pieces_cols(w)
    base = (1 << (value_bits - 1)) * jnp.sum(w, axis=0) + jnp.sum(p * y_j[:, None], axis=0)
    return pieces, inv_f, base


def _int_value_part(weights, codes_i8: jax.Array) -> jax.Array:
    """sum_i p_ig (t_i code_ic + y_i) [G, n] for n channels of one value group from that group's
    `_value_weights` and its signed codes (code - off) int8 [Bk, n]: an exact int32 dot plus the base."""
    pieces, inv_f, base = weights
    G = inv_f.shape[0]
    si = _exact_int_dot(pieces, codes_i8, 0, 0)  # [4G, n]
    kk = jax.lax.broadcasted_iota(jnp.int32, (1, 4, 1), 1)
    t = jnp.sum(si.reshape(G, 4, codes_i8.shape[1]) * _pow2(-7 * kk), axis=1)  # [G, n]
    return t * inv_f[:, None] + base[:, None]


def value_parts(d: int, group: int, value_bits: int, planar: bool) -> list[tuple[int, int, int, int, int]]:
    """How the kernel walks one token row of packed value codes: (first channel, channels, value group, first
    byte, plane) per part. Interleaved (`quant.pack`): one part per group, its bytes unpacked by interleaving.
    Planar (`quant.pack_planar`): byte i holds the codes of channels i + k d/per in bits [k b, (k+1) b) (per = 8/b
    codes per byte, plane k); a part is a chunk of bytes read once, and each plane of it is one value group's
    channels, taken with a shift and a mask (no interleave)."""
    if not planar or value_bits == 8:
        return [(j * group, group, j, j * group * value_bits // 8, -1) for j in range(d // group)]
    per = 8 // value_bits
    plane = d // per
    chunk = min(group, plane)
    if d % per or plane % chunk or group % chunk:
        raise ValueError(f"planar {value_bits}-bit values need head_dim / {per} ({d} / {per}) and the group size "
                         f"{group} to divide one another")
    return [(k * plane + i * chunk, chunk, (k * plane + i * chunk) // group, i * chunk, k)
            for i in range(plane // chunk) for k in range(per)]


def _int_value_sum(p: jax.Array, t_j: jax.Array, y_j: jax.Array, codes_packed: jax.Array, value_bits: int,
                   ) -> jax.Array:
    """sum_i p_ig (t_i code_ic + y_i) [G, group] for one block and value group j, in exact integer arithmetic
    (int_kv): w_ig = p_ig t_i split into int8 pieces down the tokens (`_int8_pieces_cols`), an int32 dot with the
    codes shifted to signed, plus off sum_i w_ig + sum_i p_ig y_i. p [Bk, G], t_j, y_j [Bk] (scale, zero),
    codes_packed [Bk, group * bits / 8]. Rounding: docs/bounds.md section 13 (bounds.int_value_rounding)."""
    codes = (_unpack(codes_packed, value_bits) - (1 << (value_bits - 1))).astype(jnp.int8)  # [Bk, group]
    return _int_value_part(_value_weights(p, t_j, y_j, value_bits), codes)


class _LayerRef:
    """A stacked [L, ...] ref read as one layer's [...] (index tuples get the layer prepended)."""

    def __init__(self, ref, layer):
        self.ref, self.layer = ref, layer

    def __getitem__(self, idx):
        return self.ref[(self.layer,) + (idx if isinstance(idx, tuple) else (idx,))]


def _tier1_kernel_int(nvalid_ref, q_ref, *refs, nb: int, bps: int, G: int, d: int, Bk: int, group: int,
                      key_bits: int, value_bits: int, per_block: bool, scale: float, with_delta: bool = False,
                      out_blocks: int | None = None, n_hot: int = 0, out_splits: int | None = None,
                      n_slots: int = 0, stacked: bool = False, stacked_slots: bool = False,
                      key_signed: bool = False, value_planar: bool = False):
    """Same contract as _tier1_kernel; both dots exact integer arithmetic (int8 x int8 -> int32 MMA):
    scores as in `int_keys`; values per group j of channels, with w_ig = p_i t_ij split into int8 pieces down the
    tokens (`_int8_pieces_cols`) and codes shifted to signed:
        pv_gc = inv_f_g sum_k 2^-7k sum_i P_i,gk (code_ic - off) + off sum_i w_ig + sum_i p_ig y_ij.
    No float32 dequantized value exists; no [Bk, d] float tile either (each group is [Bk, group]).
    with_delta: an extra input |q| [G, d] (the unscaled query) and an extra output Delta [G, out_blocks], each INT
    block's score error bound (bounds.key_delta_quantized with the integer pieces), evaluated from the scale and
    zero the block loads anyway. out_blocks >= nb: the outputs' block columns (columns past nb: empty blocks,
    written by the last split's program), so that a consumer needing power-of-two sizes reads them unpadded.
    n_hot > 0 (split layout): an extra input hot_ids [n_hot] and an extra output x_acc [G, n_hot, d]: the blocks
    the hot set holds stay out of the split accumulators, and each one's value sum pv goes to its slot of x_acc
    instead (0 for a slot whose id is empty or not a valid block, written by split 0's program). out_splits >= S
    (split layout): the split axis of acc / acc_m padded with empty splits (acc 0, acc_m -inf) by the last
    split's program.
    n_slots > 0 (with n_hot and with_delta): n_slots more programs along the split axis compute the exact partials
    of the hot slots (inputs hot_k, hot_v [n_hot, Bk, d]) and of the residual block (res_k, res_v [Bk, d], its
    first r_count tokens) into slot outputs m, l, Delta [G, n_slots] and acc [G, n_slots, d] (slot n_hot: the
    residual; slots past it: empty), the math of `slot_partials_reference` (float32 IEEE dots).
    stacked: the six tier-1 inputs are a model's stacked arrays [L, ...] (their blocks cover every layer) and an
    extra input after q holds the layer to read: the kernel reads that layer in place, so no per-layer slice of
    tier 1 has to be materialised for the launch. stacked_slots (with stacked): hot_ids, hot_k, hot_v, res_k and
    res_v are stacked [L, ...] as well and read in place.
    key_signed: the key codes are int8 code - 128 (8-bit keys), fed to the dot as loaded. value_planar: the value
    codes are packed by `quant.pack_planar` (each plane of a byte one group's channels: no interleave to unpack)."""
    f32 = jnp.float32
    if stacked:
        layer_ref, *refs = refs
    if with_delta:
        qa_ref, *refs = refs
    if n_hot:
        hid_ref, *refs = refs
    if n_slots:
        hk_ref, hv_ref, rk_ref, rv_ref, rc_ref, *refs = refs
    kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, m_ref, l_ref, acc_ref, *rest = refs
    if stacked:
        layer = layer_ref[0]
        kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref = (_LayerRef(r, layer) for r in
                                                          (kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref))
        if stacked_slots:
            if n_hot:
                hid_ref = _LayerRef(hid_ref, layer)
            if n_slots:
                hk_ref, hv_ref, rk_ref, rv_ref = (_LayerRef(r, layer) for r in (hk_ref, hv_ref, rk_ref, rv_ref))
    am_ref = None if per_block else rest.pop(0)
    dl_ref = rest.pop(0) if with_delta else None
    xa_ref = rest.pop(0) if n_hot else None
    if n_slots:
        sm_ref, sl_ref, sacc_ref, sdl_ref = rest[:4]
    n_split = -(-nb // bps)
    split = pl.program_id(2)
    start, stop, v_stop = _split_range(nvalid_ref, nb, bps)
    inv_sqrt_d = scale
    ng = d // group
    hg = group * value_bits // 8  # packed bytes per group and token
    # (first channel, channels) of each value part: a whole group (interleaved) or one plane of a byte chunk
    parts = value_parts(d, group, value_bits, value_planar)
    vmask, voff = (1 << value_bits) - 1, 1 << (value_bits - 1)
    q = q_ref[...].astype(f32)  # [G, d]
    if with_delta:
        qa = qa_ref[...].astype(f32)
        qa_sum = jnp.sum(qa, axis=1)

    def valid_block(n, carry):
        ks = ks_ref[n, :].astype(f32)
        kz = kz_ref[n, :].astype(f32)
        s = _int_scores(q, ks, kz, kc_ref[n, :, :], key_bits, inv_sqrt_d, signed=key_signed)  # [Bk, G]
        m = jnp.max(s, axis=0)  # [G]
        p = jnp.exp(s - m[None, :])
        m_ref[:, n] = m
        l_ref[:, n] = jnp.sum(p, axis=0)
        if with_delta:
            mag = bounds.key_magnitude(ks, kz, key_bits, int_pieces=True)
            dl_ref[:, n] = bounds.key_delta_from_sums(
                jnp.sum(qa * ks[None, :], axis=1), jnp.sum(qa * mag[None, :], axis=1),
                jnp.max(qa * ks[None, :], axis=1), qa_sum, d, key_bits, int_pieces=True,
                mag_sum_scaled=jnp.sum(mag * bounds.KEY_SUM_SCALE))
        if value_planar and value_bits < 8:
            pvs, weights, chunks = [], {}, {}
            for _c0, width, j, b0, plane in parts:
                if j not in weights:
                    weights[j] = _value_weights(p, vs_ref[n, :, j].astype(f32), vz_ref[n, :, j].astype(f32),
                                                value_bits)
                if b0 not in chunks:  # each byte chunk read once, for all its planes
                    chunks[b0] = vc_ref[n, :, pl.ds(b0, width)].astype(jnp.int32)
                codes = ((chunks[b0] >> (plane * value_bits)) & vmask) - voff
                pvs.append(_int_value_part(weights[j], codes.astype(jnp.int8)))
        else:
            pvs = [_int_value_sum(p, vs_ref[n, :, j].astype(f32), vz_ref[n, :, j].astype(f32),
                                  vc_ref[n, :, pl.ds(j * hg, hg)], value_bits) for j in range(ng)]
        if per_block:
            for (c0, width, *_), pv in zip(parts, pvs, strict=True):
                acc_ref[:, n, pl.ds(c0, width)] = pv
            return carry
        m_run, accs = carry
        m_new = jnp.maximum(m_run, m)
        alpha = jnp.exp(m_run - m_new)[:, None]
        beta = jnp.exp(m - m_new)[:, None]
        new = tuple(acc * alpha + beta * pv for acc, pv in zip(accs, pvs, strict=True))
        if not n_hot:
            return m_new, new
        # one scalar compare per slot: a vector load of the K ids needs K a power of two in Triton
        is_hot = functools.reduce(jnp.logical_or, [hid_ref[k] == n for k in range(n_hot)])
        for k in range(n_hot):
            @pl.when(hid_ref[k] == n)
            def _store(k=k):
                for (c0, width, *_), pv in zip(parts, pvs, strict=True):
                    xa_ref[:, k, pl.ds(c0, width)] = pv
        # a hot block leaves the split's accumulator as it was (the unselected branch may hold NaN: -inf - -inf)
        return (jnp.where(is_hot, m_run, m_new),
                tuple(jnp.where(is_hot, acc, a) for acc, a in zip(accs, new, strict=True)))

    def empty_block(n, carry):
        _write_empty_block(m_ref, l_ref, acc_ref, n, G, d, per_block)
        if with_delta:
            dl_ref[:, n] = jnp.zeros((G,), f32)
        return carry

    def split_work():
        if n_hot:  # slots no split program writes: empty ids and ids of blocks that are not valid
            n_valid = jnp.clip(nvalid_ref[()], 0, nb)
            for k in range(n_hot):
                @pl.when((split == 0) & ((hid_ref[k] < 0) | (hid_ref[k] >= n_valid)))
                def _empty(k=k):
                    xa_ref[:, k, :] = jnp.zeros((G, d), f32)

        init = 0 if per_block else (jnp.full((G,), -jnp.inf, f32),
                                    tuple(jnp.zeros((G, width), f32) for _, width, *_ in parts))
        final = jax.lax.fori_loop(start, v_stop, valid_block, init)
        jax.lax.fori_loop(v_stop, stop, empty_block, 0)
        last = split == n_split - 1
        n_out = out_blocks or nb
        if n_out > nb:  # the padding columns, by the last split's program
            jax.lax.fori_loop(jnp.where(last, jnp.int32(nb), jnp.int32(n_out)), n_out, empty_block, 0)
        if not per_block:
            for (c0, width, *_), acc in zip(parts, final[1], strict=True):
                acc_ref[:, split, pl.ds(c0, width)] = acc
            am_ref[:, split] = final[0]
            if out_splits and out_splits > n_split:
                def empty_split(i, carry):
                    acc_ref[:, i, :] = jnp.zeros((G, d), f32)
                    am_ref[:, i] = jnp.full((G,), -jnp.inf, f32)
                    return carry

                jax.lax.fori_loop(jnp.where(last, jnp.int32(n_split), jnp.int32(out_splits)), out_splits,
                                  empty_split, 0)

    def slot_work():
        # The block is read in chunks of SLOT_ROWS tokens, twice (max score and key magnitudes, then the
        # weights and sums at that max): one [Bk, d] float32 tile per operand would raise the whole kernel's
        # registers (both branches share one allocation) and slow every split program (H200, 2026-12-03:
        # +36 us at 32K, +114 us at 128K; scripts/probe_tier1_features.py).
        slot = split - n_split
        hot = jnp.minimum(slot, n_hot - 1)
        is_res = slot == n_hot
        rows = min(SLOT_ROWS, Bk)
        limit = jnp.where(is_res, rc_ref[()],
                          jnp.where((slot < n_hot) & (hid_ref[hot] >= 0), jnp.int32(Bk), jnp.int32(0)))
        t = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)

        def chunk(c, ref_res, ref_hot):  # tokens [c*rows, (c+1)*rows) of the slot's block, 0 past its end
            tok = t + c * rows < limit  # [rows, 1]
            sl = pl.ds(pl.multiple_of(c * rows, rows), rows)
            x = jnp.where(is_res, ref_res[sl, :].astype(f32), ref_hot[hot, sl, :].astype(f32))
            return tok, jnp.where(tok, x, 0.0)

        def scores(c):
            tok, k32 = chunk(c, rk_ref, hk_ref)
            return jnp.where(tok, _scaled(_dot(k32, q, 1), inv_sqrt_d), -jnp.inf), k32  # [rows, G] exact

        def first(c, carry):
            m, kmax = carry
            s, k32 = scores(c)
            return jnp.maximum(m, jnp.max(s, axis=0)), jnp.maximum(kmax, jnp.max(jnp.abs(k32), axis=0))

        m, kmax = jax.lax.fori_loop(0, Bk // rows, first, (jnp.full((G,), -jnp.inf, f32), jnp.zeros((d,), f32)))
        m0 = jnp.where(jnp.isfinite(m), m, 0.0)

        def second(c, carry):
            l, acc = carry
            p = jnp.exp(scores(c)[0] - m0[None, :])
            return l + jnp.sum(p, axis=0), acc + _dot(p, chunk(c, rv_ref, hv_ref)[1], 0, a_contract=0)

        l, acc = jax.lax.fori_loop(0, Bk // rows, second, (jnp.zeros((G,), f32), jnp.zeros((G, d), f32)))
        sm_ref[:, slot] = m
        sl_ref[:, slot] = l
        sacc_ref[:, slot, :] = acc  # [G, d]
        sdl_ref[:, slot] = bounds.key_delta_exact_from_sum(jnp.sum(qa * kmax[None, :], axis=1), qa_sum, d,
                                                           jnp.sum(kmax * bounds.KEY_SUM_SCALE))

    if n_slots:
        pl.when(split < n_split)(split_work)
        pl.when(split >= n_split)(slot_work)
    else:
        split_work()


def _tier1_kernel_dot(nvalid_ref, q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, m_ref, l_ref, acc_ref,
                      *maybe_am_ref, nb: int, bps: int, G: int, d: int, Bk: int, group: int, key_bits: int,
                      value_bits: int, per_block: bool, scale: float, magic: bool, transposed: bool = False,
                      int_keys: bool = False):
    """Same contract as _tier1_kernel; the G query heads are scored together with float32 dot products
    (IEEE inputs, `precision=HIGHEST`: FMA, no TF32) and the key scale is folded into the query:
    s_gi = (sum_c (q_gc s_c) code_ic + sum_c q_gc z_c) / sqrt(d).
    transposed: compute the scores as [Bk, G] (codes . (q s)^T) so that only the small operands are transposed
    (the [G, Bk] form transposes the [Bk, d] code tile, which the ablation in docs/kernels.md found costly).
    int_keys (implies transposed): the key dot is exact integer arithmetic on the tensor cores: q s split into
    int8 pieces (`_int8_pieces`), codes shifted to signed, int32 accumulation (no rounding at all);
    s_gi = (inv_f_g sum_k 2^-7k S_ik + off sum_c a_gc + sum_c q_gc z_c) / sqrt(d), off = 2^(bits-1)."""
    f32 = jnp.float32
    split = pl.program_id(2)
    start, stop, v_stop = _split_range(nvalid_ref, nb, bps)
    inv_sqrt_d = scale
    ng = d // group
    q = q_ref[...].astype(f32)  # [G, d]

    def valid_block(n, carry):
        ks = ks_ref[n, :].astype(f32)
        kz = kz_ref[n, :].astype(f32)
        qz = None if int_keys else jnp.sum(q * kz[None, :], axis=1)  # [G]
        if int_keys:
            s = _int_scores(q, ks, kz, kc_ref[n, :, :], key_bits, inv_sqrt_d)  # [Bk, G]
            m = jnp.max(s, axis=0)
            p = jnp.exp(s - m[None, :])
        elif transposed:
            codes = _codes_f32(_unpack(kc_ref[n, :, :], key_bits), magic)  # [Bk, d]
            s = _scaled(_dot(codes, q * ks[None, :], 1) + qz[None, :], inv_sqrt_d)  # [Bk, G]
            m = jnp.max(s, axis=0)  # [G]
            p = jnp.exp(s - m[None, :])
        else:
            codes = _codes_f32(_unpack(kc_ref[n, :, :], key_bits), magic)  # [Bk, d]
            s = _scaled(_dot(q * ks[None, :], codes, 1) + qz[:, None], inv_sqrt_d)  # [G, Bk]
            m = jnp.max(s, axis=1)  # [G]
            p = jnp.exp(s - m[:, None])
        vcodes = _codes_f32(_unpack(vc_ref[n, :, :], value_bits), magic).reshape(Bk, ng, group)
        vs = vs_ref[n, :, :].astype(f32)
        vz = vz_ref[n, :, :].astype(f32)
        v_hat = (vcodes * vs[:, :, None] + vz[:, :, None]).reshape(Bk, d)
        tr = transposed or int_keys
        pv = _dot(p, v_hat, 0, a_contract=0 if tr else 1)  # [G, d]
        m_ref[:, n] = m
        l_ref[:, n] = jnp.sum(p, axis=0 if tr else 1)
        if per_block:
            acc_ref[:, n, :] = pv
            return carry
        m_run, acc = carry
        m_new = jnp.maximum(m_run, m)
        return m_new, acc * jnp.exp(m_run - m_new)[:, None] + jnp.exp(m - m_new)[:, None] * pv

    def empty_block(n, carry):
        _write_empty_block(m_ref, l_ref, acc_ref, n, G, d, per_block)
        return carry

    init = 0 if per_block else (jnp.full((G,), -jnp.inf, f32), jnp.zeros((G, d), f32))
    final = jax.lax.fori_loop(start, v_stop, valid_block, init)
    jax.lax.fori_loop(v_stop, stop, empty_block, 0)
    if not per_block:
        (am_ref,) = maybe_am_ref
        acc_ref[:, split, :] = final[1]
        am_ref[:, split] = final[0]


def tier1_pass(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_valid, *, group_size: int,
               key_bits: int = 8, value_bits: int = 4, per_block_acc: bool = False,
               blocks_per_split: int | None = None, num_warps: int | None = None, num_stages: int = 2,
               variant: str = "dot_magic", interpret: bool | None = None,
               score_scale: float | None = None, q_abs: jax.Array | None = None, out_blocks: int | None = None,
               padded_heads: bool = False, hot_ids: jax.Array | None = None,
               out_splits: int | None = None, slots: Slots | None = None,
               layer: jax.Array | None = None, key_signed: bool = False,
               value_planar: bool | None = None) -> Tier1Partials:
    """The tier-1 pass as one Pallas kernel; grid (B, H, S), each program one split of `blocks_per_split`
    blocks of one KV head with its G query heads. See the module docstring for the math and layouts.
    score_scale: the factor applied to q . k_hat (default 1/sqrt(d)); 1.0 for a query already divided by
    sqrt(d), as the certified path passes it (`certattn_jax.step`). num_warps: default `_DEFAULT_WARPS`.

    For the fused certify kernel (variant `int_kv` only): q_abs [B, H, G, d] (|q| of the unscaled query) adds
    the output delta; out_blocks >= nb pads the block axis of m, l, delta (and a per-block acc) with empty
    blocks; padded_heads returns the query-head axis padded to the kernel's power of two (padding rows: a zero
    query; their statistics are finite and meaningless); hot_ids [B, H, K] (split layout): the blocks the hot
    set holds stay out of the split accumulators and their value sums come back in hot_acc, slot by slot;
    out_splits >= S (split layout) pads the split axis of acc / acc_m with empty splits; slots (with hot_ids
    equal to slots.hot_ids, and q_abs): the exact partials of the hot slots and the residual, computed by extra
    programs of the same launch (slot_m, slot_l, slot_acc, slot_delta; `slot_partials_reference`); layer (int_kv):
    the six tier-1 arrays are a model's stacked [L, B, H, ...] arrays and the kernel reads layer `layer` of them
    in place (a per-layer slice feeding the launch would be a copy of that layer's tier 1); hot_ids [L, B, H, K]
    and slots with stacked hot_k, hot_v, res_k, res_v ([L, B, H, ...]) are then read in place as well.
    key_signed (int_kv): int8 key codes code - 128 (`kernel_layout`). value_planar: whether the value codes are
    packed planar (default: as the cache packs them, `quant.VALUE_PACKING`); the other variants read interleaved
    codes and get planar ones repacked first."""
    if layer is not None:
        if variant != "int_kv":
            raise ValueError(f"layer (stacked tier-1 arrays) is implemented for the int_kv variant only, not "
                             f"{variant!r}")
        L = k_codes.shape[0]
        stacked_arrays = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
        if any(x.ndim < 2 or x.shape[0] != L for x in stacked_arrays):
            raise ValueError(f"with layer, the tier-1 arrays must share a leading layer axis, got "
                             f"{[tuple(x.shape) for x in stacked_arrays]}")
        layer = jnp.clip(jnp.asarray(layer, jnp.int32).reshape(1), 0, L - 1)
        B, H, G, d, nb, Bk = _check_inputs(q, *(x[0] for x in stacked_arrays), n_valid, group_size, key_bits,
                                           value_bits, key_signed)
    else:
        B, H, G, d, nb, Bk = _check_inputs(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_valid,
                                           group_size, key_bits, value_bits, key_signed)
    value_planar = cache_values_planar() if value_planar is None else value_planar
    if key_signed and variant != "int_kv":
        raise ValueError(f"key_signed is an option of the int_kv variant only, not {variant!r}")
    if value_planar and variant != "int_kv":  # the other variants unpack interleaved codes
        v_codes, value_planar = _repack_values(v_codes, value_bits, True, False), False
    bps = blocks_per_split or default_blocks_per_split(B, H, nb)
    if bps <= 0:
        raise ValueError(f"blocks_per_split must be positive, got {bps}")
    if variant not in _VARIANTS:
        raise ValueError(f"unknown kernel variant {variant!r}: choose one of {sorted(_VARIANTS)}")
    interpret = backend.interpret() if interpret is None else interpret
    if not interpret:  # Triton tensors must have power-of-two sizes
        for name, n in (("block size", Bk), ("head_dim", d), ("value group size", group_size)):
            if n & (n - 1):
                raise ValueError(f"the compiled tier-1 kernel needs a power-of-two {name}, got {n}")
    # query heads per KV head, padded to a power of two (SmolLM2: 3 -> 4) and to what the variant's dots need
    Gp = padded_heads_for(G, variant)
    if slots is not None and (hot_ids is None or q_abs is None or per_block_acc):
        raise ValueError("slots need hot_ids, q_abs and the split layout")
    if slots is not None and not interpret and slots.n_slots & (slots.n_slots - 1):
        raise ValueError(f"the compiled tier-1 kernel needs a power-of-two n_slots, got {slots.n_slots}")
    if out_splits is not None and (per_block_acc or out_splits < -(-nb // bps)):
        raise ValueError(f"out_splits {out_splits} needs the split layout and at least {-(-nb // bps)} splits")
    if (q_abs is not None or out_blocks is not None or hot_ids is not None or out_splits is not None) \
            and variant != "int_kv":
        raise ValueError(f"q_abs / out_blocks / hot_ids / out_splits are implemented for the int_kv variant only, "
                         f"not {variant!r}")
    stacked_hot = layer is not None and hot_ids is not None and hot_ids.ndim == 4
    hot_shape = None if hot_ids is None else hot_ids.shape[1:] if stacked_hot else hot_ids.shape
    if hot_ids is not None and (per_block_acc or len(hot_shape) != 3 or hot_shape[:2] != (B, H)
                                or (stacked_hot and hot_ids.shape[0] != k_codes.shape[0])):
        raise ValueError(f"hot_ids must be [B, H, K] = ({B}, {H}, K) (or [L, B, H, K] stacked like the tier-1 "
                         f"arrays, with layer) with the split layout, got {hot_ids.shape}"
                         f"{' and per_block_acc' if per_block_acc else ''}")
    if slots is not None and stacked_hot != (slots.res_k.ndim == 5):
        raise ValueError("slots and hot_ids must both be stacked [L, ...] (with layer) or both one layer's")
    if q_abs is not None and q_abs.shape != q.shape:
        raise ValueError(f"q_abs must have q's shape {q.shape}, got {q_abs.shape}")
    if out_blocks is not None and out_blocks < nb:
        raise ValueError(f"out_blocks {out_blocks} must be at least the number of blocks {nb}")
    if not interpret and out_blocks is not None and out_blocks & (out_blocks - 1):
        raise ValueError(f"the compiled tier-1 kernel needs a power-of-two out_blocks, got {out_blocks}")

    def rows(x):  # the query-head axis padded with zero queries
        x = x.astype(jnp.float32)
        return x if Gp == G else jnp.pad(x, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))

    out = _tier1_call(rows(q), None if q_abs is None else rows(q_abs), k_codes, k_scale, k_zero, v_codes, v_scale,
                      v_zero, n_valid.astype(jnp.int32), group=group_size, key_bits=key_bits, value_bits=value_bits,
                      per_block=per_block_acc, bps=bps, num_stages=num_stages,
                      num_warps=num_warps or _DEFAULT_WARPS.get(variant, 4),
                      variant=variant, interpret=interpret,
                      scale=_score_scale(d, score_scale),
                      out_blocks=out_blocks or nb, hot_ids=None if hot_ids is None else hot_ids.astype(jnp.int32),
                      out_splits=out_splits, slots=None if slots is None else slots._replace(
                          hot_ids=None, r_count=slots.r_count.astype(jnp.int32), n_slots=None),
                      n_slots=0 if slots is None else slots.n_slots, layer=layer, key_signed=key_signed,
                      value_planar=value_planar)
    if Gp == G or padded_heads:
        return out
    return Tier1Partials(*(None if x is None else x[:, :, :G] for x in out))  # (every field: axis 2 is G)


def _score_scale(d: int, score_scale: float | None) -> float:
    """The factor applied to q . k_hat: score_scale, or 1/sqrt(d) by default."""
    return float(1.0 / math.sqrt(d) if score_scale is None else score_scale)


def padded_heads_for(G: int, variant: str) -> int:
    """The query-head rows the kernel computes: G padded to a power of two and to what the variant's dots need."""
    return max(1 << (G - 1).bit_length(), _MIN_G.get(variant, 1))


@functools.partial(jax.jit, static_argnames=("group", "key_bits", "value_bits", "per_block", "bps", "num_warps",
                                             "num_stages", "variant", "interpret", "scale", "out_blocks", "out_splits",
                                             "n_slots", "key_signed", "value_planar"))
def _tier1_call(q, q_abs, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_valid, *, group, key_bits, value_bits,
                per_block, bps, num_warps, num_stages, variant, interpret, scale, out_blocks, hot_ids=None,
                out_splits=None, slots=None, n_slots=0, layer=None, key_signed=False,
                value_planar=False) -> Tier1Partials:
    B, H, G, d = q.shape
    stacked = layer is not None
    lead = k_codes.shape[:1] if stacked else ()  # the layer axis of stacked tier-1 arrays
    nb, Bk = k_codes.shape[len(lead) + 2], k_codes.shape[len(lead) + 3]
    dk, dv, ng = k_codes.shape[-1], v_codes.shape[-1], d // group
    S = -(-nb // bps)
    with_delta = q_abs is not None
    n_hot = 0 if hot_ids is None else hot_ids.shape[-1]
    stacked_slots = stacked and n_hot > 0 and hot_ids.ndim == 4
    extra = {} if variant != "int_kv" else dict(with_delta=with_delta, out_blocks=out_blocks, n_hot=n_hot,
                                                out_splits=out_splits, n_slots=n_slots, stacked=stacked,
                                                stacked_slots=stacked_slots, key_signed=key_signed,
                                                value_planar=value_planar)
    kernel = functools.partial(_VARIANTS[variant], nb=nb, bps=bps, G=G, d=d, Bk=Bk, group=group, key_bits=key_bits,
                               value_bits=value_bits, per_block=per_block, scale=scale, **extra)
    whole = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, h, s: (b, h) + (0,) * len(shape))  # noqa: E731
    nbo = out_blocks
    n_acc = nbo if per_block else (out_splits or S)
    out_shape = [jax.ShapeDtypeStruct((B, H, G, nbo), jnp.float32), jax.ShapeDtypeStruct((B, H, G, nbo), jnp.float32),
                 jax.ShapeDtypeStruct((B, H, G, n_acc, d), jnp.float32)]
    out_specs = [whole(G, nbo), whole(G, nbo), whole(G, n_acc, d)]
    if not per_block:
        out_shape.append(jax.ShapeDtypeStruct((B, H, G, n_acc), jnp.float32))
        out_specs.append(whole(G, n_acc))
    if with_delta:
        out_shape.append(jax.ShapeDtypeStruct((B, H, G, nbo), jnp.float32))
        out_specs.append(whole(G, nbo))
    if n_hot:
        out_shape.append(jax.ShapeDtypeStruct((B, H, G, n_hot, d), jnp.float32))
        out_specs.append(whole(G, n_hot, d))
    if n_slots:
        out_shape += [jax.ShapeDtypeStruct((B, H, G, n_slots), jnp.float32)] * 2
        out_shape += [jax.ShapeDtypeStruct((B, H, G, n_slots, d), jnp.float32),
                      jax.ShapeDtypeStruct((B, H, G, n_slots), jnp.float32)]
        out_specs += [whole(G, n_slots), whole(G, n_slots), whole(G, n_slots, d), whole(G, n_slots)]
    def tier1(*shape):  # a tier-1 array's block: one (b, h), every layer when stacked
        if not stacked:
            return whole(*shape)
        return pl.BlockSpec((*lead, None, None, *shape), lambda b, h, s: (0, b, h) + (0,) * len(shape))

    in_specs = [pl.BlockSpec((None,), lambda b, h, s: (b,)), whole(G, d)]
    in_specs += [pl.BlockSpec((1,), lambda b, h, s: (0,))] if stacked else []  # the layer, read by the kernel
    in_specs += [whole(G, d)] if with_delta else []
    slot_block = tier1 if stacked_slots else whole  # the hot set and the residual: stacked, or this layer's
    in_specs += [slot_block(n_hot)] if n_hot else []
    if n_slots:
        in_specs += [slot_block(n_hot, Bk, d), slot_block(n_hot, Bk, d), slot_block(Bk, d), slot_block(Bk, d),
                     pl.BlockSpec((None,), lambda b, h, s: (b,))]
    in_specs += [tier1(nb, Bk, dk), tier1(nb, d), tier1(nb, d), tier1(nb, Bk, dv), tier1(nb, Bk, ng),
                 tier1(nb, Bk, ng)]
    args = [n_valid, q] + ([layer] if stacked else []) + ([q_abs] if with_delta else []) + ([hot_ids] if n_hot else [])
    if n_slots:
        args += [slots.hot_k, slots.hot_v, slots.res_k, slots.res_v, slots.r_count]
    args += [k_codes, k_scale, k_zero, v_codes, v_scale, v_zero]
    outs = pl.pallas_call(
        kernel,
        grid=(B, H, S + n_slots),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=backend.compiler_params(num_warps, num_stages) if not interpret else None,
        interpret=interpret,
        name="certattn_tier1_pass",
    )(*args)
    outs = list(outs)
    slot_out = [None] * 4
    if n_slots:
        slot_out, outs = outs[-4:], outs[:-4]
    hot_acc = outs.pop() if n_hot else None
    delta = outs.pop() if with_delta else None
    if per_block:
        m, l, acc = outs[:3]
        return Tier1Partials(m=m, l=l, acc=acc, acc_m=m, delta=delta)
    return Tier1Partials(*outs[:4], delta=delta, hot_acc=hot_acc, slot_m=slot_out[0], slot_l=slot_out[1],
                         slot_acc=slot_out[2], slot_delta=slot_out[3])


# variant name -> kernel: "reduce" (broadcast-multiply-reduce per query head), "dot" (float32 IEEE dots,
# scale folded into q), "dot_magic" (as dot, codes converted to float by the 2^23 bit trick), "dot_t" (as
# dot_magic with [Bk, G] scores), "int_keys" (exact int8 tensor-core key dot), "int_kv" (exact int8 dots for
# keys and values); the last three are not yet timed on the GPU. docs/kernels.md has the measurements.
_VARIANTS = {"reduce": _tier1_kernel, "dot": functools.partial(_tier1_kernel_dot, magic=False),
             "dot_magic": functools.partial(_tier1_kernel_dot, magic=True),
             "dot_t": functools.partial(_tier1_kernel_dot, magic=True, transposed=True),
             "int_keys": functools.partial(_tier1_kernel_dot, magic=True, int_keys=True),
             "int_kv": _tier1_kernel_int}
# The variant the certified path uses (`certattn_jax.step.tier1_partials`): exact int8 dots for the keys and the
# values, the fastest variant on the H200 (66 µs at 32K vs 82 for int_keys and 163 for dot_magic,
# results/bench_kernels_int_variants_h200.json); its score rounding is bounded in bounds.key_delta_quantized
# (int_pieces, docs/bounds.md section 12), its value sums' rounding in bounds.int_value_rounding (section 13).
CERTIFIED_VARIANT = "int_kv"
INT_KEY_VARIANTS = ("int_keys", "int_kv")  # exact integer key scores: Delta of docs/bounds.md section 12
INT_VALUE_VARIANTS = ("int_kv",)  # exact integer value sums: E_int of section 13 (bounds.int_value_rounding)
# fewest query-head rows a variant's dots need (int8 MMA tiles: 4 pieces x 4 heads = 16)
_MIN_G = {"int_keys": 4, "int_kv": 4}
# Warps per program when the caller names none: the H200 sweep (results/bench_kernels_h200_int_kv_sweep.json)
# found 2 warps faster than 4 for int_kv at every shape timed (32K and 128K batch 1, 32K batch 8: -4 to -8 %)
# and 8 warps ~1.8x slower; the other variants were only timed with 4.
_DEFAULT_WARPS = {"int_kv": 2}


def naive_output(p: Tier1Partials) -> jax.Array:
    """The normalized attention output [B, H, G, d] over the tier-1 blocks alone (INT keys and values, no
    residual block, no certification): sum_s e^{acc_m_s - M} acc_s / sum_n e^{m_n - M} l_n, M = max_n m_n.
    NaN where no block is valid."""
    big = jnp.max(p.m, axis=-1, keepdims=True)
    big = jnp.where(jnp.isfinite(big), big, 0.0)
    w_acc = jnp.where(jnp.isfinite(p.acc_m), jnp.exp(p.acc_m - big), 0.0)
    w_l = jnp.where(jnp.isfinite(p.m), jnp.exp(p.m - big), 0.0)
    num = jnp.einsum("bhgs,bhgsd->bhgd", w_acc, p.acc, precision=_HI)
    return num / jnp.sum(w_l * p.l, axis=-1)[..., None]
