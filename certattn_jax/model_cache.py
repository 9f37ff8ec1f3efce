"""The one place that decides a model's KV cache, and TieredModelCache.

    spec = cache_spec(mode, config, dtype, policy)     # mode in CACHE_MODES: "dense" | "naive" | "certified"
    cache = spec(batch, capacity)                      # an empty cache (DenseKVCache or TieredModelCache)
    staging = spec.staging(batch, capacity)            # where a prompt is prefilled (a DenseKVCache)
    cache = spec.from_staging(staging)                 # ... then converted once into the mode's cache

`models.llama.init_cache`, `models.generate.generate` and the CLI all build caches through `cache_spec`.

TieredModelCache: a whole model's tiered KV cache (one TieredKVCache per layer) behind the KVCache
interface, so the LLaMA and the decode loop run with `dense | naive | certified` caches alike.

Decode steps (one new token) use the cache mode's attention -- certified (with a Certificate per layer,
kept in `last_certificate` and returned by `step_record()`) or naive. Prefill chunks (several tokens) attend
exactly over the originals (tier 2 + residual) in every mode: certificates are about decoding. That path reads
all of tier 2 back per chunk; `generate` avoids it by prefilling a dense staging cache with the dense path's
attention and converting it once (`TieredModelCache.from_dense`: tier 1 quantized in one pass, the originals
copied to the host in one contiguous copy per layer and array). The new
token goes into each layer's exact residual block without flushing; `with_lengths` (called once per step,
after the last layer) flushes every layer's full residual block under a single lax.cond.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from certattn_jax.attention import certified_attention_step, exact_keys_values, naive_attention
from certattn_jax.cache import TieredKVCache
from certattn_jax.certificate import Certificate, empty_like_heads
from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.kv_cache import KVCache, check_capacity, commit_arrays, is_concrete, masked_attention
from certattn_jax.policy import CertPolicy

CACHE_MODES = ("dense", "naive", "certified")  # the one list of cache modes (the CLI's --cache choices)
MODES = CACHE_MODES[1:]  # the tiered ones


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

    @classmethod
    def from_dense(cls, dense: DenseKVCache, *, num_q_heads: int, policy: CertPolicy | None = None,
                   mode: str = "certified") -> TieredModelCache:
        """Convert a (prefilled) dense cache, every layer at once: tier 1 quantized in one batched pass per
        layer, the originals moved to tier 2 in one contiguous copy per layer and array, nothing read back.
        The dense cache's capacity must be a multiple of the policy's block size. Works eagerly and in jit."""
        if mode not in MODES:
            raise ValueError(f"unknown tiered cache mode {mode!r}; choose from {MODES}")
        policy = policy or CertPolicy()
        if num_q_heads % dense.k[0].shape[1]:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {dense.k[0].shape[1]}")
        layers = tuple(TieredKVCache.from_head_major(k, v, dense.lengths, policy)
                       for k, v in zip(dense.k, dense.v, strict=True))
        L, B = len(layers), dense.batch
        cert = jax.tree.map(lambda x: jnp.zeros((L,) + x.shape, x.dtype), empty_like_heads(B, num_q_heads))
        return commit_arrays(cls(layers=layers, lengths=dense.lengths, last_certificate=cert, policy=policy,
                                 mode=mode))

    @classmethod
    def from_layers(cls, layers: Sequence[TieredKVCache], *, num_q_heads: int, policy: CertPolicy | None = None,
                    mode: str = "certified") -> TieredModelCache:
        """A model cache from per-layer caches (e.g. `TieredKVCache.from_dense` of existing K/V), which must agree
        in shape and lengths. Every layer must own its buffers (a donated jit argument may not hold one buffer
        twice); the model's `lengths` is a fresh copy for the same reason."""
        if mode not in MODES:
            raise ValueError(f"unknown tiered cache mode {mode!r}; choose from {MODES}")
        layers = tuple(layers)
        if not layers:
            raise ValueError("from_layers needs at least one layer")
        policy = policy or CertPolicy()
        first = layers[0]
        shape = (first.batch, first.num_kv_heads, first.num_blocks, first.head_dim, first.dtype)
        for i, c in enumerate(layers):
            c.check_policy(policy)
            mine = (c.batch, c.num_kv_heads, c.num_blocks, c.head_dim, c.dtype)
            if mine != shape:
                raise ValueError(f"layer {i} has (batch, kv heads, blocks, head_dim, dtype) {mine}, layer 0 {shape}")
            if is_concrete(c.lengths) and is_concrete(first.lengths) and not bool(jnp.all(c.lengths == first.lengths)):
                raise ValueError(f"layer {i} holds lengths {c.lengths.tolist()}, layer 0 {first.lengths.tolist()}")
        ids = [id(x) for x in jax.tree.leaves(layers)]
        if len(set(ids)) != len(ids):
            raise ValueError("two layers share a buffer; build each layer's cache separately")
        if num_q_heads % first.num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {first.num_kv_heads}")
        cert = jax.tree.map(lambda x: jnp.zeros((len(layers),) + x.shape, x.dtype),
                            empty_like_heads(first.batch, num_q_heads))
        return commit_arrays(cls(layers=layers, lengths=jnp.array(first.lengths, copy=True), last_certificate=cert,
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


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What a model's KV cache is: mode, model shape, dtype, policy. Call it (batch, capacity) for an empty
    cache; `staging` / `from_staging` give the prefill path (module docstring)."""

    mode: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: Any
    policy: CertPolicy | None = None

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            raise ValueError(f"unknown cache mode {self.mode!r}; choose from {CACHE_MODES}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def tiered(self) -> bool:
        return self.mode != "dense"

    def _policy(self) -> CertPolicy:
        return self.policy or CertPolicy()

    def staging_capacity(self, capacity: int) -> int:
        """The capacity the cache will really have (tiered caches round up to whole blocks)."""
        if not self.tiered:
            return capacity
        Bk = self._policy().block_size
        return -(-capacity // Bk) * Bk

    def __call__(self, batch: int, capacity: int) -> KVCache:
        if not self.tiered:
            return self.staging(batch, capacity)
        return TieredModelCache.init(num_layers=self.num_layers, batch=batch, capacity=capacity,
                                     num_kv_heads=self.num_kv_heads, num_q_heads=self.num_q_heads,
                                     head_dim=self.head_dim, dtype=self.dtype, policy=self.policy, mode=self.mode)

    def staging(self, batch: int, capacity: int) -> DenseKVCache:
        """A dense cache to prefill into (for the dense mode: the cache itself)."""
        return DenseKVCache.init(num_layers=self.num_layers, batch=batch, capacity=self.staging_capacity(capacity),
                                 num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype)

    def from_staging(self, dense: DenseKVCache) -> KVCache:
        """The mode's cache holding what `dense` holds (dense: itself; tiered: one jitted bulk conversion; drop
        `dense` afterwards to free its device memory)."""
        if not self.tiered:
            return dense
        return _convert(dense, self._policy(), num_q_heads=self.num_q_heads, mode=self.mode)


@functools.partial(jax.jit, static_argnames=("num_q_heads", "mode"))
def _convert(dense: DenseKVCache, policy: CertPolicy, *, num_q_heads: int, mode: str) -> TieredModelCache:
    return TieredModelCache.from_dense(dense, num_q_heads=num_q_heads, policy=policy, mode=mode)


def cache_spec(mode: str, config: Any, dtype: Any, policy: CertPolicy | None = None) -> CacheSpec:
    """The cache of a LLaMA-like `config` (num_layers, num_heads, num_kv_heads, head_dim) in `mode`."""
    return CacheSpec(mode=mode, num_layers=config.num_layers, num_q_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=jnp.dtype(dtype), policy=policy)


def init_model_cache(mode: str, config: Any, dtype: Any, batch: int, capacity: int,
                     policy: CertPolicy | None = None) -> KVCache:
    """An empty cache: `cache_spec(mode, config, dtype, policy)(batch, capacity)`."""
    return cache_spec(mode, config, dtype, policy)(batch, capacity)


def tiered_cache_factory(config: Any, dtype: Any, policy: CertPolicy | None = None, mode: str = "certified",
                         ) -> Callable[[int, int], TieredModelCache]:
    """A cache factory (batch, capacity) -> TieredModelCache (kept for existing callers: `cache_spec`)."""
    if mode not in MODES:
        raise ValueError(f"unknown tiered cache mode {mode!r}; choose from {MODES}")
    return cache_spec(mode, config, dtype, policy)
