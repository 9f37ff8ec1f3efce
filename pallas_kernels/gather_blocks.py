"""Rung 1's tier-2 read in one launch: a kernel that copies the wanted blocks out of tier 2 where it lives.

    new_k, new_v = gather_blocks(dst_k, dst_v, host_k, host_v, fetch_ids, layer)       # reference: gather_reference

dst_k, dst_v [B, H, S, Bk, d] device slots; host_k, host_v [B, H, nb, Bk, d] tier 2 (a model's stacked
[L, B, H, nb, Bk, d] with `layer`, an int32 scalar); fetch_ids [B, H, S] int32 block ids, -1 = leave the slot.
Returns dst with dst[b, h, s] = host[(layer,) b, h, fetch_ids[b, h, s]] wherever the id is >= 0 (cast to dst's
dtype); the other slots keep their contents (the outputs alias dst_k, dst_v). Every layer at once: a stacked
tier 2 with layer=None, dst [L, B, H, S, Bk, d] and fetch_ids [L, B, H, S] (the end-of-step hot-set refresh).

Why a kernel: tier 2 is in `pinned_host` memory. XLA moves host data with one transfer per slice, so a fetch
of n blocks is a loop of n transfers, ~14-23 µs each on the H200 (loop trip counts read back by the host), or
~4.7 µs each unrolled. A GPU kernel can dereference pinned host memory itself (unified addressing), and XLA hands
the pinned-host operand to the Pallas custom call as it is: `scripts/probe_host_kernel.py` on the H200
(`results/probe_host_kernel_h200.json`) gathered 64 blocks of 16 KiB in 23 µs from a 64 MiB host array, correct
and with no whole-array copy in the HLO, against ~1,300 µs for the loop. One program per slot: a slot whose id
is negative reads nothing.

In interpret mode (CPU tests) Pallas cannot mix host and device operands, so `fetch_blocks` there hands the
kernel a device copy of the layer's tier 2: the same kernel code and index arithmetic, at the price of a copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import backend


def gather_reference(dst_k: jax.Array, dst_v: jax.Array, host_k: jax.Array, host_v: jax.Array,
                     fetch_ids: jax.Array, layer: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The same result with jnp on device arrays (tests; host arrays must be copied to the device first)."""
    want = (fetch_ids >= 0)[..., None, None]
    idx = jnp.maximum(fetch_ids, 0)[..., None, None]
    out = []
    for host, dst in ((host_k, dst_k), (host_v, dst_v)):
        x = host if host.ndim == 5 or layer is None else jax.lax.dynamic_index_in_dim(host, layer, 0, keepdims=False)
        out.append(jnp.where(want, jnp.take_along_axis(x, idx, axis=-3).astype(dst.dtype), dst))
    return out[0], out[1]


def _gather_kernel(ids_ref, layer_ref, hk_ref, hv_ref, dk_ref, dv_ref, ok_ref, ov_ref, *, stacked: bool):
    # refs: ids [1]; layer [1]; hk, hv [(L,) nb, Bk, d] (this (b, h)'s blocks, every layer when stacked, or this
    # layer's when every layer is gathered); dk, dv (aliased to ok, ov, unused here) and ok, ov [1, Bk, d]
    del dk_ref, dv_ref
    blk = ids_ref[0]

    @pl.when(blk >= 0)
    def _copy():
        if stacked:
            lay = layer_ref[0]
            k = hk_ref[lay, pl.ds(blk, 1), :, :]
            v = hv_ref[lay, pl.ds(blk, 1), :, :]
        else:
            k = hk_ref[pl.ds(blk, 1), :, :]
            v = hv_ref[pl.ds(blk, 1), :, :]
        ok_ref[...] = k.astype(ok_ref.dtype)
        ov_ref[...] = v.astype(ov_ref.dtype)


def _check(dst_k, dst_v, host_k, host_v, fetch_ids, layer) -> tuple[bool, bool]:
    """(stacked, every_layer) after checking the shapes."""
    if host_k.shape != host_v.shape or host_k.ndim not in (5, 6):
        raise ValueError(f"host_k, host_v must both be [(L,) B, H, nb, Bk, d], got {host_k.shape}, {host_v.shape}")
    stacked = host_k.ndim == 6
    every_layer = stacked and layer is None
    if stacked and layer is None and fetch_ids.ndim != 4:
        raise ValueError("a stacked tier 2 [L, B, H, nb, Bk, d] needs a layer index (or fetch_ids [L, B, H, S] "
                         "for every layer at once)")
    if fetch_ids.ndim != (4 if every_layer else 3):
        raise ValueError(f"fetch_ids must be [B, H, S] ([L, B, H, S] for every layer), got {fetch_ids.shape}")
    lead = fetch_ids.shape[:-2]  # ((L,) B, H) of the slots
    nb, Bk, d = host_k.shape[-3:]
    want_dst = tuple(fetch_ids.shape) + (Bk, d)
    if tuple(host_k.shape[-5:-3]) != tuple(fetch_ids.shape[-3:-1]) or dst_k.shape != want_dst \
            or dst_v.shape != want_dst or (every_layer and host_k.shape[0] != lead[0]):
        raise ValueError(f"shapes disagree: fetch_ids {fetch_ids.shape}, host {host_k.shape}, dst {dst_k.shape}, "
                         f"{dst_v.shape}")
    return stacked, every_layer


def gather_blocks(dst_k: jax.Array, dst_v: jax.Array, host_k: jax.Array, host_v: jax.Array, fetch_ids: jax.Array,
                  layer: jax.Array | None = None, *, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """See the module docstring. One program per slot (grid (B, H, S), or (L * B, H, S) for every layer);
    1 warp (a copy of one block)."""
    stacked, every_layer = _check(dst_k, dst_v, host_k, host_v, fetch_ids, layer)
    interpret = backend.interpret() if interpret is None else interpret
    nb, Bk, d = host_k.shape[-3:]
    H, S = fetch_ids.shape[-2:]
    if every_layer:  # grid axis 0 runs over (layer, sequence) pairs
        L, B = fetch_ids.shape[:2]
        grid = (L * B, H, S)
        ids_spec = pl.BlockSpec((None, None, None, 1), lambda i, h, s: (i // B, i % B, h, s))
        slot = pl.BlockSpec((None, None, None, 1, Bk, d), lambda i, h, s: (i // B, i % B, h, s, 0, 0))
        tier2 = pl.BlockSpec((None, None, None, nb, Bk, d), lambda i, h, s: (i // B, i % B, h, 0, 0, 0))
    else:
        B = fetch_ids.shape[0]
        grid = (B, H, S)
        lead = host_k.shape[:1] if stacked else ()
        ids_spec = pl.BlockSpec((None, None, 1), lambda b, h, s: (b, h, s))
        slot = pl.BlockSpec((None, None, 1, Bk, d), lambda b, h, s: (b, h, s, 0, 0))
        tier2 = pl.BlockSpec((*lead, None, None, nb, Bk, d), lambda b, h, s: (0,) * len(lead) + (b, h, 0, 0, 0))
    lay = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    return pl.pallas_call(
        functools.partial(_gather_kernel, stacked=stacked and not every_layer),
        grid=grid,
        in_specs=[ids_spec, pl.BlockSpec((1,), lambda *_: (0,)), tier2, tier2, slot, slot],
        out_specs=[slot, slot],
        out_shape=[jax.ShapeDtypeStruct(dst_k.shape, dst_k.dtype), jax.ShapeDtypeStruct(dst_v.shape, dst_v.dtype)],
        input_output_aliases={4: 0, 5: 1},
        compiler_params=backend.compiler_params(1, 1) if not interpret else None,
        interpret=interpret,
        name="certattn_gather_tier2_blocks",
    )(fetch_ids.astype(jnp.int32), lay, host_k, host_v, dst_k, dst_v)
