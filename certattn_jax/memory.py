"""memory_report(cache): bytes held by each tier, against a dense bf16 KV cache of the same capacity."""

from __future__ import annotations

from typing import Any

import jax

from certattn_jax.cache import TieredKVCache
from certattn_jax.dense_cache import DenseKVCache

_TIER2_FIELDS = ("host_k", "host_v")


def _nbytes(x: jax.Array) -> int:
    return int(x.size) * x.dtype.itemsize


def _tiered_layers(cache: Any) -> list[TieredKVCache]:
    if isinstance(cache, TieredKVCache):
        return [cache]
    if isinstance(getattr(cache, "store", None), TieredKVCache):  # a model's stacked cache
        return [cache.store]
    layers = getattr(cache, "layers", None)
    if layers and all(isinstance(c, TieredKVCache) for c in layers):
        return list(layers)
    raise TypeError(f"memory_report: unsupported cache type {type(cache).__name__}")


def memory_report(cache: Any) -> dict[str, Any]:
    """Bytes per tier. For a tiered cache (one layer or a whole model):

    tier1_device_bytes: everything on the device (codes, scales, annotations, residual block, hot set)
    tier2_host_bytes:   the originals (pinned host memory when the backend has it)
    dense_bf16_bytes:   a bf16 K+V cache of the same capacity, batch and heads
    tier1_fraction:     tier1 / dense_bf16
    breakdown:          tier-1 bytes by field
    """
    if isinstance(cache, DenseKVCache):
        dev = sum(_nbytes(x) for x in (*cache.k, *cache.v))
        dense = sum(int(x.size) * 2 for x in (*cache.k, *cache.v))
        return {"tier1_device_bytes": dev, "tier2_host_bytes": 0, "dense_bf16_bytes": dense,
                "tier1_fraction": dev / dense, "breakdown": {"k": dev // 2, "v": dev // 2}}
    layers = _tiered_layers(cache)
    breakdown: dict[str, int] = {}
    tier2 = 0
    dense = 0
    kind = None
    for c in layers:
        for name in c.__dataclass_fields__:
            x = getattr(c, name)
            if not isinstance(x, jax.Array) or name == "layer":
                continue
            if name in _TIER2_FIELDS:
                tier2 += _nbytes(x)
                kind = getattr(x.sharding, "memory_kind", None)
            else:
                breakdown[name] = breakdown.get(name, 0) + _nbytes(x)
        n_layers = c.k_codes.shape[0] if c.stacked else 1
        dense += 2 * n_layers * c.batch * c.num_kv_heads * c.capacity * c.head_dim * 2
    tier1 = sum(breakdown.values())
    return {"tier1_device_bytes": tier1, "tier2_host_bytes": tier2, "tier2_memory_kind": kind,
            "dense_bf16_bytes": dense, "tier1_fraction": tier1 / dense, "breakdown": breakdown}
