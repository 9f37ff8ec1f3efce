"""XLA's pinned-host memory pool, sized for tier 2 before jax starts its GPU client.

jax's GPU client serves pinned host memory (`memory_kind="pinned_host"`: tier 2) from a pool capped at
XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, 64 GiB unless set, read once when the client starts. A batch's tier 2 above the
cap (4 sequences of 128K at the 8B shape: 68.7 GB) left the pool without room on an H100 (thirty-fifth session,
docs/performance.md): the kernels' self-checks then failed to allocate their small host buffers, and the ladder
fell back to its slower jnp rung 0 and block transfers. So unless the user has set it, importing certattn_jax
raises the cap to the host's physical memory (a limit: the pool is allocated as it is used), and
`tiers.zeros_on_host` refuses a tier 2 beyond the memory available. It takes effect only where jax's GPU client
has not started yet: import certattn_jax before running any jax computation.
"""

from __future__ import annotations

import os

ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_DEFAULT_GIB = 64


def meminfo_bytes(field: str) -> int | None:
    """A Linux /proc/meminfo field (e.g. "MemTotal", "MemAvailable") in bytes, or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_memory_total_gib() -> int | None:
    """The host's physical memory in whole GiB (MemTotal), or None where unknown."""
    total = meminfo_bytes("MemTotal")
    return None if total is None else total >> 30


def default_pinned_host_limit() -> str | None:
    """Set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB to the host's memory where the user has not set it and the host has
    more than XLA's default; returns the value in effect (None: XLA's default)."""
    if ENV in os.environ:
        return os.environ[ENV]
    total = host_memory_total_gib()
    if total is not None and total > XLA_DEFAULT_GIB:
        os.environ[ENV] = str(total)
    return os.environ.get(ENV)


default_pinned_host_limit()  # on import: `import certattn_jax` runs it before any of its modules touch jax
