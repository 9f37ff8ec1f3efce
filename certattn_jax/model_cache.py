"""TieredModelCache: a whole model's tiered KV cache (one TieredKVCache per layer) behind the KVCache
interface, so the LLaMA and the decode loop run with `dense | naive | certified` caches alike.

Decode steps (one new token) use the cache mode's attention -- certified (with a Certificate per layer,
kept in `last_certificate` and returned by `step_record()`) or naive. Prefill chunks (several tokens) attend
exactly over the originals (tier 2 + residual) in every mode: certificates are about decoding. The new
token goes into each layer's exact residual block without flushing; `with_lengths` (called once per step,
after the last layer) flushes every layer's full residual block under a single lax.cond.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from certattn_jax.attention import certified_attention_step, exact_keys_values, naive_attention
from certattn_jax.cache import TieredKVCache
from certattn_jax.certificate import Certificate, empty_like_heads
from certattn_jax.kv_cache import check_capacity, commit_arrays, masked_attention
from certattn_jax.policy import CertPolicy

MODES = ("certified", "naive")


@struct.dataclass
class TieredModelCache:
    layers: tuple[TieredKVCache, ...]
    lengths: jax.Array
    last_certificate: Certificate  # leaves [L, B, Hq]
    policy: CertPolicy  # tolerances are leaves: changing them does not recompile the decode loop
    mode: str = struct.field(pytree_node=False, default="certified")

    @classmethod
    def init(cls, *, num_layers: int, batch: int, capacity: int, num_kv_heads: int, num_q_heads: int,
             head_dim: int, dtype: Any = jnp.bfloat16, policy: CertPolicy | None = None,
             mode: str = "certified") -> TieredModelCache:
        if mode not in MODES:
            raise ValueError(f"unknown tiered cache mode {mode!r}; choose from {MODES}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        policy = policy or CertPolicy()
        layers = tuple(TieredKVCache.init(batch=batch, capacity=capacity, num_kv_heads=num_kv_heads,
                                          head_dim=head_dim, dtype=dtype, policy=policy)
                       for _ in range(num_layers))
        cert = jax.tree.map(lambda x: jnp.zeros((num_layers,) + x.shape, x.dtype),
                            empty_like_heads(batch, num_q_heads))
        return commit_arrays(cls(layers=layers, lengths=jnp.zeros((batch,), jnp.int32), last_certificate=cert,
                                 policy=policy, mode=mode))

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
               new_lengths: jax.Array) -> tuple[jax.Array, TieredModelCache]:
        check_capacity(self.lengths, new_lengths, self.capacity)
        c = self.layers[layer]
        T = q.shape[1]
        cert = self.last_certificate
        if T == 1:
            c = c.write_token(k, v)
            if self.mode == "certified":
                out, step_cert, c = certified_attention_step(q[:, 0], c, self.policy)
                cert = jax.tree.map(lambda buf, x: buf.at[layer].set(x), cert, step_cert)
            else:
                out = naive_attention(q[:, 0], c)
            out = out[:, None]
        else:
            c = c.append(k, v, new_lengths - self.lengths)
            k_all, v_all = exact_keys_values(c)
            q_pos = self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
            out = masked_attention(q, k_all, v_all, q_pos, new_lengths)
        layers = self.layers[:layer] + (c,) + self.layers[layer + 1:]
        return out, self.replace(layers=layers, last_certificate=cert)

    def with_lengths(self, new_lengths: jax.Array) -> TieredModelCache:
        full = self.layers[0].needs_flush()
        layers = jax.lax.cond(jnp.any(full), lambda ls: tuple(c.flush_unconditionally(full) for c in ls),
                              lambda ls: ls, self.layers)
        return self.replace(layers=layers, lengths=new_lengths.astype(jnp.int32))

    def step_record(self) -> Certificate | dict:
        return self.last_certificate if self.mode == "certified" else {}


def tiered_cache_factory(config: Any, dtype: Any, policy: CertPolicy | None = None, mode: str = "certified",
                         ) -> Callable[[int, int], TieredModelCache]:
    """A cache factory (batch, capacity) -> TieredModelCache for a LLaMA-like config (num_layers, num_heads,
    num_kv_heads, head_dim)."""

    def make(batch: int, capacity: int) -> TieredModelCache:
        return TieredModelCache.init(num_layers=config.num_layers, batch=batch, capacity=capacity,
                                     num_kv_heads=config.num_kv_heads, num_q_heads=config.num_heads,
                                     head_dim=config.head_dim, dtype=dtype, policy=policy, mode=mode)

    return make
