"""Where tier 2 lives, and moving blocks between the tiers inside jit.

Tier 2 (the original keys/values) lives in `pinned_host` memory when the backend has it (GPU, and CPU jax
too), else in device memory (`memory_report` says which). Inside jit a host array is read by
`lax.dynamic_slice` + `jax.device_put(..., Space.Device)` and written by `dynamic_update_slice` with a
host-placed update; gathers/scatters on host arrays do not compile, so transfers go block by block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.cache
def host_memory_kind() -> str | None:
    """'pinned_host' when the default device offers it, else None (tier 2 then stays on the device)."""
    try:
        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    except Exception:  # pragma: no cover - backends without memory spaces
        return None
    return "pinned_host" if "pinned_host" in kinds else None


def to_host(x: jax.Array) -> jax.Array:
    """Place x in tier-2 memory (works eagerly and inside jit)."""
    if host_memory_kind() is None:
        return x
    return jax.device_put(x, jax.memory.Space.Host)


def to_device(x: jax.Array) -> jax.Array:
    if host_memory_kind() is None:
        return x
    return jax.device_put(x, jax.memory.Space.Device)


def read_block(host: jax.Array, b: jax.Array, h: jax.Array, block: jax.Array) -> jax.Array:
    """host [B, H, nb, Bk, d] -> device [Bk, d] (block `block` of head h of sequence b)."""
    _, _, _, Bk, d = host.shape
    blk = jax.lax.dynamic_slice(host, (b, h, block, 0, 0), (1, 1, 1, Bk, d))
    return to_device(blk)[0, 0, 0]


def read_head(host: jax.Array, b: jax.Array, h: jax.Array) -> jax.Array:
    """host [B, H, nb, Bk, d] -> device [nb, Bk, d] (one whole head: contiguous)."""
    _, _, nb, Bk, d = host.shape
    return to_device(jax.lax.dynamic_slice(host, (b, h, 0, 0, 0), (1, 1, nb, Bk, d)))[0, 0]


def read_all(host: jax.Array) -> jax.Array:
    return to_device(host)


def write_block(host: jax.Array, blk: jax.Array, b: jax.Array, block: jax.Array) -> jax.Array:
    """Write one block of all heads, blk [H, Bk, d], at host[b, :, block]."""
    upd = to_host(blk[None, :, None].astype(host.dtype))
    return jax.lax.dynamic_update_slice(host, upd, (b, 0, block, 0, 0))


def zeros_on_host(shape: tuple[int, ...], dtype) -> jax.Array:
    return to_host(jnp.zeros(shape, dtype))
