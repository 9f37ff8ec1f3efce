"""DenseKVCache: the plain full-precision KV cache (the reference every other cache is compared to)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from certattn_jax.kv_cache import check_capacity, committed_jit, masked_attention, write_positions


@struct.dataclass
class DenseKVCache:
    """Per-layer keys and values in the model's dtype.

    k, v:    tuples (one entry per layer) of [B, Hkv, S, d] arrays, S = capacity
    lengths: [B] int32, valid tokens per sequence
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    attn_impl: str = struct.field(pytree_node=False, default="einsum")

    @classmethod
    def init(cls, *, num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
             dtype: Any = jnp.bfloat16, attn_impl: str = "einsum") -> DenseKVCache:
        if min(num_layers, batch, capacity, num_kv_heads, head_dim) <= 0:
            raise ValueError("DenseKVCache.init: all sizes must be positive")
        k, v, lengths = _zeros(num_layers, (batch, num_kv_heads, capacity, head_dim), jnp.dtype(dtype))
        return cls(k=k, v=v, lengths=lengths, attn_impl=attn_impl)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k[0].shape[1]

    @property
    def head_dim(self) -> int:
        return self.k[0].shape[3]

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
               new_lengths: jax.Array) -> tuple[jax.Array, DenseKVCache]:
        """Write k, v [B, T, Hkv, d] at positions lengths + t, then attend q [B, T, Hq, d] causally."""
        check_capacity(self.lengths, new_lengths, self.capacity)
        k_buf = write_positions(self.k[layer], k, self.lengths)
        v_buf = write_positions(self.v[layer], v, self.lengths)
        T = q.shape[1]
        q_pos = self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        out = masked_attention(q, k_buf, v_buf, q_pos, new_lengths, self.attn_impl)
        new = self.replace(k=_replace_at(self.k, layer, k_buf), v=_replace_at(self.v, layer, v_buf))
        return out, new

    def with_lengths(self, new_lengths: jax.Array) -> DenseKVCache:
        return self.replace(lengths=new_lengths.astype(jnp.int32))

    def step_record(self) -> dict:
        return {}


def _replace_at(items: tuple, index: int, value: Any) -> tuple:
    return items[:index] + (value,) + items[index + 1:]


@committed_jit(static_argnums=(0, 1, 2))
def _zeros(num_layers: int, shape: tuple[int, ...],
           dtype: Any) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], jax.Array]:
    """An empty cache's arrays in one committed program (eagerly, two dispatches per array, ~4 per layer: a
    prefill's time to first token): k and v, num_layers zero arrays each of `shape` [B, Hkv, S, d], and the
    lengths [B] int32. Every output its own buffer (a prefill donates them)."""
    k = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    return k, v, jnp.zeros(shape[:1], jnp.int32)
