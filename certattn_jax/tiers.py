"""Where tier 2 lives, and moving blocks between the tiers inside jit.

Tier 2 (the original keys/values) lives in `pinned_host` memory when the backend has it (GPU, and CPU jax
too), else in device memory (`memory_report` says which). Inside jit a host array is read by
`lax.dynamic_slice` + `jax.device_put(..., Space.Device)` and written by `dynamic_update_slice` with a
host-placed update; gathers/scatters on host arrays do not compile as device code, so transfers go block by
block, or a Pallas kernel reads the blocks in place (`pallas_kernels.gather_blocks`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax.host_limit import meminfo_bytes


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


def check_on_host(*arrays: jax.Array) -> None:
    """A clear error where tier-2 arrays (eager or traced) are not in host memory although the device offers it:
    a cache that went through pickle, `jax.device_get` / `device_put` or a generic checkpoint restore comes back
    with tier 2 in device memory, which the cache's writes cannot mix with their host-memory blocks (and which would
    hold the originals on the device after all). Static: costs nothing at run time."""
    if host_memory_kind() is None:
        return
    for x in arrays:
        if jax.typeof(x).memory_space != jax.memory.Space.Host:
            raise ValueError("the cache's tier 2 (the original keys and values) is not in host memory, e.g. after "
                             "pickle, device_get/device_put or a checkpoint restore: put it back with "
                             "`cache.with_tier2_on_host()`")


def to_numpy(x: jax.Array) -> np.ndarray:
    """A NumPy copy of x that shares no buffer with it. `np.asarray` / `jax.device_get` of an array in host memory
    (tier 2) return a view of its buffer: while that view (or a slice of it) lives, the buffer cannot be donated,
    so the cache's next donating call (a decode step, `with_staged_sequences`) fails on a GPU with "Donation
    requested for buffer with external reference" (the CPU client skips such a donation silently). Here the view
    is of a fresh copy instead."""
    if not isinstance(x, jax.Array):
        return np.array(x)
    return np.asarray(jax.device_put(x, x.sharding, may_alias=False))


@contextlib.contextmanager
def shared_buffers_named(where: str) -> Iterator[None]:
    """Around a donating call: a donation refused because a NumPy view shares a buffer (see `to_numpy`) raised as
    a ValueError that names the problem and the remedy; other errors pass unchanged. The refusal comes before the
    program runs, so the cache is unchanged."""
    try:
        yield
    # A jitted call's C++ fast path (installed by its first successful call) raises XLA's error as a plain
    # ValueError, the slow path as JaxRuntimeError (jax-ml/jax#34083, open in jax 0.11): the message decides.
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        if "Donation requested for buffer with external reference" not in str(e):
            raise
        raise ValueError(f"{where}: this cache's arrays cannot be donated because a NumPy array shares one of their "
                         "buffers (np.asarray / jax.device_get of a host-memory array such as tier 2 return a view "
                         "of its buffer, which cannot be donated while the view lives): read tier 2 with "
                         "`certattn_jax.tiers.to_numpy`, which copies. The cache is unchanged") from e


def to_device(x: jax.Array) -> jax.Array:
    if host_memory_kind() is None:
        return x
    return jax.device_put(x, jax.memory.Space.Device)


def _start(host: jax.Array, layer, *index) -> tuple:
    """The start index into host [B, H, ...] or, for a model's stacked tier 2 [L, B, H, ...], at `layer`."""
    lead = () if host.ndim == 5 else (layer,)
    if host.ndim == 6 and layer is None:
        raise ValueError("a stacked tier 2 [L, B, H, nb, Bk, d] needs a layer index")
    return lead + tuple(index) + (0,) * (5 - len(index))


def read_block(host: jax.Array, b: jax.Array, h: jax.Array, block: jax.Array, layer=None) -> jax.Array:
    """host [B, H, nb, Bk, d] (or [L, ...] with `layer`) -> device [Bk, d]: block `block` of head h of sequence b."""
    Bk, d = host.shape[-2:]
    lead = (1,) * (host.ndim - 5)
    blk = jax.lax.dynamic_slice(host, _start(host, layer, b, h, block), lead + (1, 1, 1, Bk, d))
    return to_device(blk).reshape(Bk, d)


def read_head(host: jax.Array, b: jax.Array, h: jax.Array, layer=None) -> jax.Array:
    """host [B, H, nb, Bk, d] (or [L, ...] with `layer`) -> device [nb, Bk, d] (one whole head: contiguous)."""
    nb, Bk, d = host.shape[-3:]
    lead = (1,) * (host.ndim - 5)
    return to_device(jax.lax.dynamic_slice(host, _start(host, layer, b, h), lead + (1, 1, nb, Bk, d))).reshape(
        nb, Bk, d)


def read_all(host: jax.Array, layer=None) -> jax.Array:
    """All of one layer's tier 2 on the device, [B, H, nb, Bk, d] (host [B, H, ...], or [L, ...] at `layer`)."""
    if host.ndim == 5:
        return to_device(host)
    return to_device(jax.lax.dynamic_slice(host, _start(host, layer), (1,) + host.shape[1:]))[0]


def write_block(host: jax.Array, blk: jax.Array, b: jax.Array, block: jax.Array, layer=None) -> jax.Array:
    """Write one block of all heads, blk [H, Bk, d], at host[b, :, block] (host[layer, b, :, block] when stacked;
    blk [L, H, Bk, d] with layer=None writes that block of every layer at once)."""
    if host.ndim == 6 and layer is None:  # every layer
        upd = to_host(blk[:, None, :, None].astype(host.dtype))
        return jax.lax.dynamic_update_slice(host, upd, (0, b, 0, block, 0, 0))
    upd = to_host(blk.reshape((1,) * (host.ndim - 5) + (1, blk.shape[0], 1) + blk.shape[1:]).astype(host.dtype))
    return jax.lax.dynamic_update_slice(host, upd, _start(host, layer, b, 0, block))


def zeros_on_host(shape: tuple[int, ...], dtype) -> jax.Array:
    """Zeros of `shape` in tier-2 memory. Eagerly they are made in host memory directly (NumPy's zero pages put
    into `pinned_host`): a batch's tier 2 may be larger than the device's free memory, and zeros made on the
    device first (34 GB per array for 4 sequences at the 8B shape, 128K) ran an 80 GB H100 out of memory
    (docs/performance.md, thirty-fifth session). Inside a trace, zeros moved to the host (XLA places them)."""
    kind = host_memory_kind()
    if kind is None or isinstance(jnp.zeros((), jnp.int8), jax.core.Tracer):
        return to_host(jnp.zeros(shape, dtype))
    check_host_fits(int(np.prod(shape)) * jnp.dtype(dtype).itemsize,
                    f"tier 2 (the original keys or values, {tuple(shape)} {jnp.dtype(dtype)})")
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
    return jax.device_put(np.zeros(shape, jnp.dtype(dtype)), sharding)


def check_host_fits(nbytes: int, what: str) -> None:
    """A MemoryError naming `what` where `nbytes` of tier 2 exceed the host's available memory (pinned pages cannot
    be swapped: fail by name, not by the OS); nothing where tier 2 has no host memory or the host does not say."""
    if host_memory_kind() is None:
        return
    available = host_memory_available()
    if available is not None and nbytes > available:
        raise MemoryError(f"{what} needs {nbytes / 1e9:.2f} GB of host memory; {available / 1e9:.2f} GB is "
                          "available: choose a smaller batch or capacity")


def host_memory_available() -> int | None:
    """Bytes of host memory available for new allocations (Linux's MemAvailable), or None where unknown."""
    return meminfo_bytes("MemAvailable")
