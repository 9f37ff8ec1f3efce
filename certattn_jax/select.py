"""Adaptive top-K* block selection, hot-set residency, and the ranking-consistency check.

Shapes: B sequences, H KV heads, G query heads per KV head, nb key blocks, K = k_max promotion slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax import tiers
from certattn_jax.env import positive_int_from_env, switch_from_env

# Below this many bytes of one layer's tier 2 (keys and values), `fetch_blocks` copies the layer's whole tier 2 to
# the device in one transfer and gathers the wanted blocks there, instead of one transfer per block in a loop whose
# trip count only the device knows (on a GPU plausibly a host round trip per block). Off (0) until the H200 says
# which is faster (docs/performance.md, "what rung 1's tier-2 read costs"); CERTATTN_FETCH_WHOLE_BELOW sets it.
FETCH_WHOLE_LAYER_BELOW_BYTES = positive_int_from_env("CERTATTN_FETCH_WHOLE_BELOW", 0, minimum=0)
# Up to this many slots (B * H * S of one fetch), `fetch_blocks` copies one block per slot in straight-line code
# instead of the loop: no trip count for the host to read back per block (~14 µs per block on the H200 in the
# loop, docs/performance.md 2026-12-02), at the price of reading a block for every slot, wanted or not. Off (0)
# until the H200 prices it; CERTATTN_FETCH_UNROLL sets it.
FETCH_UNROLL_UP_TO = positive_int_from_env("CERTATTN_FETCH_UNROLL", 0, minimum=0)
# Whether `fetch_blocks` is one Pallas kernel (`pallas_kernels.gather_blocks`) that reads the wanted blocks out of
# pinned host memory itself: one launch per fetch, no per-block transfer (on the H200 64 blocks in ~23 µs against
# ~1,300 µs for the loop, scripts/probe_host_kernel.py; rung 1 at 32K 2,026 -> 360 µs). None ("auto", the
# default): wherever compiled kernels run (a GPU) and the kernel passed its known-answer check for the
# configuration (`pallas_kernels.selftest.gather_trusted`); in interpret mode (the CPU) the block loop, since the
# interpreter needs a device copy of the layer's tier 2. CERTATTN_FETCH_KERNEL=1 / 0 forces it on / off.
FETCH_KERNEL: bool | None = switch_from_env("CERTATTN_FETCH_KERNEL")


def fetch_by_kernel(host: jax.Array, dst: jax.Array) -> bool:
    """Whether a fetch from tier 2 `host` into slots `dst` runs the gather kernel (FETCH_KERNEL above; never on
    arrays a compiled kernel cannot address, `pallas_kernels.backend.arrays_fit`: a 1-byte cache dtype of 2-4
    GiB)."""
    from pallas_kernels import backend, selftest

    if not backend.arrays_fit(host, dst):
        return False
    if FETCH_KERNEL is not None:
        return FETCH_KERNEL
    return selftest.runs_compiled_kernels() and selftest.gather_trusted(
        int(host.shape[-2]), int(host.shape[-1]), str(host.dtype), str(dst.dtype))


def select_candidates(block_mass: jax.Array, block_valid: jax.Array, residual_mass: jax.Array,
                      k_max: int, tau_cov: float) -> tuple[jax.Array, jax.Array]:
    """Top-k_max blocks per KV head and the adaptive K*.

    block_mass:    [B, H, G, nb] estimated (INT8) attention mass of each block for each query head
    block_valid:   [B, nb] the block is full (holds data)
    residual_mass: [B, H, G] mass of the exact residual block (always exact, counts as covered)
    Returns (cand [B, H, K] block ids in decreasing max-over-G mass, -1 for none;
             k_star [B, H] the smallest k such that every query head's covered mass >= tau_cov,
             or the number of valid candidates when k_max blocks are not enough).
    """
    nb = block_mass.shape[-1]
    K = min(k_max, nb)
    score = jnp.where(block_valid[:, None, :], jnp.max(block_mass, axis=2), -1.0)  # [B, H, nb]
    top_score, cand = jax.lax.top_k(score, K)
    cand_ok = top_score >= 0
    cand = jnp.where(cand_ok, cand, -1)
    if K < k_max:  # fewer blocks than slots: pad
        pad = k_max - K
        cand = jnp.concatenate([cand, jnp.full(cand.shape[:-1] + (pad,), -1, cand.dtype)], axis=-1)
        cand_ok = jnp.concatenate([cand_ok, jnp.zeros(cand_ok.shape[:-1] + (pad,), bool)], axis=-1)
    cand_mass = jnp.take_along_axis(block_mass, jnp.maximum(cand, 0)[:, :, None, :], axis=-1)
    cand_mass = jnp.where(cand_ok[:, :, None, :], cand_mass, 0.0)  # [B, H, G, K]
    covered = residual_mass[..., None] + jnp.concatenate(
        [jnp.zeros_like(cand_mass[..., :1]), jnp.cumsum(cand_mass, axis=-1)], axis=-1)  # [B, H, G, K+1]
    enough = jnp.min(covered, axis=2) >= tau_cov  # [B, H, K+1]
    n_valid = jnp.sum(cand_ok, axis=-1)
    k_star = jnp.where(jnp.any(enough, axis=-1), jnp.argmax(enough, axis=-1), n_valid)
    return cand, jnp.minimum(k_star, n_valid).astype(jnp.int32)


def plan_residency(hot_ids: jax.Array, wanted: jax.Array, last_used: jax.Array | None = None,
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Decide which hot slots receive which wanted blocks (no data moved).

    hot_ids [B, H, K] (block id per slot, -1 empty); wanted [B, H, K] distinct block ids (-1 none).
    Slots holding a wanted block keep it; each missing wanted block takes a slot whose block is not wanted, the
    least recently used first when last_used [B, H, K] is given (else in slot order).
    Returns (new_hot_ids [B, H, K], slot_of_wanted [B, H, K] (-1 for none), fetch_into [B, H, K]: for each
    slot, the block id to fetch from tier 2 or -1).
    """
    match = (hot_ids[..., :, None] == wanted[..., None, :]) & (wanted[..., None, :] >= 0)  # [B,H,slot,want]
    resident = jnp.any(match, axis=-2)  # [B, H, want]
    keep = jnp.any(match, axis=-1)  # [B, H, slot]
    missing = (wanted >= 0) & ~resident
    free = ~keep
    if last_used is None:
        free_rank = jnp.cumsum(free, axis=-1) - 1  # rank of each free slot
    else:  # rank of each free slot among the free ones, least recently used first (ties: slot order)
        K = hot_ids.shape[-1]
        key = jnp.where(free, last_used, jnp.iinfo(jnp.int32).max)
        before = (key[..., None, :] < key[..., :, None]) | (
            (key[..., None, :] == key[..., :, None]) & (jnp.arange(K)[None, :] < jnp.arange(K)[:, None]))
        free_rank = jnp.sum(before & free[..., None, :], axis=-1)
    miss_rank = jnp.cumsum(missing, axis=-1) - 1  # rank of each missing wanted block
    # slot s receives the missing block whose rank equals s's free rank
    assign = free[..., :, None] & missing[..., None, :] & (free_rank[..., :, None] == miss_rank[..., None, :])
    gets = jnp.any(assign, axis=-1)  # [B, H, slot]
    incoming = jnp.max(jnp.where(assign, wanted[..., None, :], -1), axis=-1)
    fetch_into = jnp.where(gets, incoming, -1)
    new_hot = jnp.where(gets, incoming, hot_ids)
    slot_match = (new_hot[..., :, None] == wanted[..., None, :]) & (wanted[..., None, :] >= 0)
    slot_of_wanted = jnp.where(jnp.any(slot_match, axis=-2), jnp.argmax(slot_match, axis=-2), -1)
    return new_hot, slot_of_wanted.astype(jnp.int32), fetch_into


def fetch_blocks(dst_k: jax.Array, dst_v: jax.Array, host_k: jax.Array, host_v: jax.Array,
                 fetch_ids: jax.Array, layer: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Copy tier-2 blocks into device slots: dst[b, h, s] = host[b, h, fetch_ids[b, h, s]] where the id >= 0.

    dst_k/dst_v [B, H, S, Bk, d] (device), host_k/host_v [B, H, nb, Bk, d] (tier 2; a model's stacked
    [L, B, H, nb, Bk, d] with `layer`), fetch_ids [B, H, S].
    One lax.cond around the whole copy (the common case, nothing to fetch, costs one predicate), and inside it a
    loop over the wanted blocks only (compacted first: its trip count is the number of fetches, not B*H*S, and
    it carries no per-iteration branch). Each iteration reads one block of keys and one of values from tier 2.
    A layer whose tier 2 is smaller than FETCH_WHOLE_LAYER_BELOW_BYTES is instead copied whole, in one transfer
    per array, and the wanted blocks gathered on the device; a fetch of at most FETCH_UNROLL_UP_TO slots copies
    one block per slot in straight-line code (no loop); with the kernel (`fetch_by_kernel`) one Pallas kernel reads
    the wanted blocks out of tier 2 where it lives (`pallas_kernels.gather_blocks`).
    """
    B, H, S = fetch_ids.shape
    flat = fetch_ids.reshape(-1)
    count = jnp.sum(flat >= 0)
    if fetch_by_kernel(host_k, dst_k):
        return _fetch_by_kernel(dst_k, dst_v, host_k, host_v, fetch_ids, layer, count)
    layer_bytes = 2 * int(np.prod(host_k.shape[-5:])) * jnp.dtype(host_k.dtype).itemsize
    if layer_bytes < FETCH_WHOLE_LAYER_BELOW_BYTES:
        def copy_layer(dst):  # one transfer per array, then a gather on the device
            want = (fetch_ids >= 0)[..., None, None]
            idx = jnp.maximum(fetch_ids, 0)[..., None, None]  # [B, H, S, 1, 1]
            return tuple(jnp.where(want, jnp.take_along_axis(tiers.read_all(host, layer), idx, axis=2).astype(d.dtype),
                                   d) for host, d in ((host_k, dst[0]), (host_v, dst[1])))

        return jax.lax.cond(count > 0, copy_layer, lambda d: d, (dst_k, dst_v))
    if B * H * S <= FETCH_UNROLL_UP_TO:
        def copy_slots(dst):  # every slot reads a block (block 0 when unwanted) and keeps it only where wanted
            ak, av = dst
            for b in range(B):
                for h in range(H):
                    for s in range(S):
                        want, blk = fetch_ids[b, h, s] >= 0, jnp.maximum(fetch_ids[b, h, s], 0)
                        nk = tiers.read_block(host_k, b, h, blk, layer).astype(ak.dtype)
                        nv = tiers.read_block(host_v, b, h, blk, layer).astype(av.dtype)
                        ak = ak.at[b, h, s].set(jnp.where(want, nk, ak[b, h, s]))
                        av = av.at[b, h, s].set(jnp.where(want, nv, av[b, h, s]))
            return ak, av

        return jax.lax.cond(count > 0, copy_slots, lambda d: d, (dst_k, dst_v))
    order = jnp.argsort(flat < 0, stable=True)  # the wanted entries first, in slot order

    def copy_all(dst):
        def body(j, acc):
            e = order[j]
            b, h, s = e // (H * S), (e // S) % H, e % S
            blk = flat[e]
            ak, av = acc
            nk = tiers.read_block(host_k, b, h, blk, layer).astype(ak.dtype)
            nv = tiers.read_block(host_v, b, h, blk, layer).astype(av.dtype)
            return (jax.lax.dynamic_update_slice(ak, nk[None, None, None], (b, h, s, 0, 0)),
                    jax.lax.dynamic_update_slice(av, nv[None, None, None], (b, h, s, 0, 0)))

        return jax.lax.fori_loop(0, count, body, dst)

    return jax.lax.cond(count > 0, copy_all, lambda d: d, (dst_k, dst_v))


def fetch_blocks_every_layer(dst_k: jax.Array, dst_v: jax.Array, host_k: jax.Array, host_v: jax.Array,
                             fetch_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`fetch_blocks` of every layer of a model's stacked cache: dst [L, B, H, S, Bk, d], host [L, B, H, nb, Bk, d],
    fetch_ids [L, B, H, S]. With the kernel (`fetch_by_kernel`) one launch for all layers; else a loop over the
    layers."""
    if fetch_by_kernel(host_k, dst_k):
        return _fetch_by_kernel(dst_k, dst_v, host_k, host_v, fetch_ids, None, jnp.sum(fetch_ids >= 0))

    def one_layer(i, hot):
        hk, hv = fetch_blocks(hot[0][i], hot[1][i], host_k, host_v, fetch_ids[i], i)
        return hot[0].at[i].set(hk), hot[1].at[i].set(hv)

    return jax.lax.fori_loop(0, host_k.shape[0], one_layer, (dst_k, dst_v))


def _fetch_by_kernel(dst_k, dst_v, host_k, host_v, fetch_ids, layer, count):
    """`pallas_kernels.gather_blocks` (one layer, or every layer with layer None and a 4-D fetch_ids)."""
    from pallas_kernels import backend, gather_blocks

    if not backend.interpret():  # a slot with nothing to fetch costs its program one compare: no conditional
        return gather_blocks.gather_blocks(dst_k, dst_v, host_k, host_v, fetch_ids, layer)

    def gather_interpreted(dst):  # the interpreter cannot read host operands: tier 2 (that layer's) copied over
        copy = tiers.to_device if layer is None else functools.partial(tiers.read_all, layer=layer)
        return gather_blocks.gather_blocks(dst[0], dst[1], copy(host_k), copy(host_v), fetch_ids)

    return jax.lax.cond(count > 0, gather_interpreted, lambda d: d, (dst_k, dst_v))


def ranking_consistent(approx_lm: jax.Array, exact_lm: jax.Array, active: jax.Array, tail_upper: jax.Array,
                       margin: float) -> jax.Array:
    """The ranking-consistency check, per KV head (promotion is per KV head, so is the check).

    All log-masses are normalized per query head (log of the block's share of that head's attention) and a
    block's KV-head score is the max over the G query heads -- the same criterion the selection ranks by.
    approx_lm, exact_lm: [B, H, G, K] normalized log-mass of each slot's block from INT8 and from exact scores
    active:              [B, H, K] the slot is promoted at this rung
    tail_upper:          [B, H, G, nb] upper bound of each non-promoted block's exact normalized log-mass
                         (INT8 log-mass + Delta), -inf for promoted or empty blocks
    Fails (False) when (a) two promoted blocks are ranked one way by INT8 but the other way by the exact
    scores by more than `margin` nats, or (b) some tail block could outrank the weakest promoted block by
    more than `margin` nats. With nothing promoted it holds trivially. Returns [B, H] bool.
    """
    a = jnp.max(approx_lm, axis=2)
    e = jnp.max(exact_lm, axis=2)
    tail = jnp.max(tail_upper, axis=(2, 3))
    pair = active[..., :, None] & active[..., None, :]
    inverted = pair & (a[..., :, None] > a[..., None, :]) & (e[..., None, :] > e[..., :, None] + margin)
    weakest = jnp.min(jnp.where(active, e, jnp.inf), axis=-1)  # [B, H]
    tail_bad = jnp.any(active, axis=-1) & (tail > weakest + margin)
    return ~jnp.any(inverted, axis=(-2, -1)) & ~tail_bad
