"""The interface every KV cache implements, so the model and the decode loop are cache-agnostic.

A cache is an immutable pytree (a `flax.struct.dataclass`) holding, per layer, whatever the cache type
stores, plus `lengths [B]` (int32): the number of valid tokens of each sequence. The model calls, per layer,

    out[B, T, Hq, d], cache = cache.attend(layer, q[B, T, Hq, d], k[B, T, Hkv, d], v[B, T, Hkv, d],
                                           new_lengths[B])

which writes the T new keys/values at positions `lengths[b] + t` (only the first `new_lengths[b] - lengths[b]`
are real; the rest are padding whose slots are overwritten later) and returns causal attention of the new
queries over everything written so far. After the last layer the model calls `cache.with_lengths(new_lengths)`.

Caches may also expose `num_kv_heads`, `head_dim` and `num_q_heads` (the model checks them against its config:
`check_cache_fits`), and `step_record()`: a pytree of per-step diagnostics (the certified cache returns its
certificates) that the decode loop can accumulate; the default is an empty dict.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np


@runtime_checkable
class KVCache(Protocol):
    lengths: jax.Array

    @property
    def capacity(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
               new_lengths: jax.Array) -> tuple[jax.Array, KVCache]: ...

    def with_lengths(self, new_lengths: jax.Array) -> KVCache: ...

    def step_record(self) -> Any: ...


def check_cache_fits(cache: Any, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """A clear error where a cache was built for another model shape (a cache with fewer layers than the model
    would otherwise be read at a clipped layer index: two layers sharing one cache, a silent wrong answer).
    Static shapes only: checks inside jit too. A cache that does not expose a dimension is not checked on it."""
    want = {"layers": num_layers, "query heads": num_q_heads, "KV heads": num_kv_heads, "head_dim": head_dim}
    have = {"layers": cache.num_layers, "query heads": getattr(cache, "num_q_heads", None),
            "KV heads": getattr(cache, "num_kv_heads", None), "head_dim": getattr(cache, "head_dim", None)}
    wrong = [f"{k} {have[k]} (the model has {want[k]})" for k in want if have[k] is not None and have[k] != want[k]]
    if wrong:
        raise ValueError(f"the cache was built for another model shape: {', '.join(wrong)}")


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum with float32 accumulation and result.

    XLA:CPU has no BF16 x BF16 -> F32 dot kernel, so on CPU the operands are upcast first (exact); on
    GPU the low-precision operands go straight into the dot (an upcast copy would double the bytes read).
    """
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, precision="highest")


def was_donated(tree: Any) -> bool:
    """Whether some array of `tree` was donated (deleted) by an earlier call."""
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(tree))


def commit_arrays(tree: Any) -> Any:
    """Commit freshly created (uncommitted) arrays to the default device, each in its own memory kind.

    jit keys its compiled programs on whether arguments are committed; a cache built by `jnp.zeros`
    (uncommitted) and the same cache returned by a jitted step (committed) would otherwise compile twice.
    An array in `pinned_host` memory (tier 2) stays there: committing never moves data between memories.
    """
    device = jax.devices()[0]

    def commit(x):
        if isinstance(x, jax.Array) and is_concrete(x) and not getattr(x, "committed", True):
            kind = getattr(x.sharding, "memory_kind", None)
            return jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind=kind))
        return x

    return jax.tree.map(commit, tree)


def committed_jit(fn: Callable | None = None, **jit_kwargs: Any) -> Callable:
    """fn jitted with its outputs committed to the default device, as `commit_arrays` commits them, in the one
    dispatch of the program (jit alone returns uncommitted arrays from uncommitted inputs, e.g. Python floats, and
    jit keys its programs on whether arguments are committed). As a decorator, with or without jit's keywords."""
    if fn is None:
        return functools.partial(committed_jit, **jit_kwargs)

    @functools.cache
    def on(device: Any) -> Callable:
        return jax.jit(fn, out_shardings=jax.sharding.SingleDeviceSharding(device), **jit_kwargs)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return on(jax.devices()[0])(*args, **kwargs)

    return call


def is_concrete(x: Any) -> bool:
    """True when x holds values we can inspect in Python (not inside a jit trace)."""
    return not isinstance(x, jax.core.Tracer)


def check_capacity(lengths: jax.Array, new_lengths: jax.Array, capacity: int) -> None:
    """Raise a clear error when a write would run past the cache capacity (only checkable eagerly)."""
    if is_concrete(new_lengths):
        # numpy, not jnp: inside a traced loop body (a looped schedule called eagerly) a jnp op on a concrete
        # closure value is staged, and its result cannot be read
        new = np.asarray(new_lengths)
        worst = int(np.max(new))
        if worst > capacity:
            raise ValueError(
                f"KV cache overflow: a sequence would reach {worst} tokens but the cache capacity is "
                f"{capacity}; allocate a larger cache")
        if is_concrete(lengths) and bool(np.any(new < np.asarray(lengths))):
            raise ValueError("new_lengths must be >= the cache's current lengths")


def write_positions(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Scatter new tokens into a head-major buffer.

    buf:   [B, H, S, d]
    new:   [B, T, H, d]   tokens to write at positions start[b] + t
    start: [B] int32
    Writes that would land at positions >= S are dropped (never wrapped or clamped); callers detect
    overflow from the lengths (see `overflow_mask`).
    """
    B, T = new.shape[:2]
    pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    b_idx = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    return buf.at[b_idx, :, pos].set(new.astype(buf.dtype), mode="drop")


def overflow_mask(new_lengths: jax.Array, capacity: int) -> jax.Array:
    """[B] bool: sequences whose writes ran past the capacity (their outputs must be poisoned)."""
    return new_lengths > capacity


ATTENTION_IMPLS = ("einsum", "reduce")


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                     kv_lengths: jax.Array, impl: str = "einsum") -> jax.Array:
    """Exact causal attention of new queries over a head-major KV buffer (float32 softmax).

    q:           [B, T, Hq, d]
    k, v:        [B, Hkv, S, d]  (Hq = G * Hkv; query head h reads KV head h // G)
    q_positions: [B, T] absolute position of each query
    kv_lengths:  [B] number of valid keys
    impl:        "einsum" (dot products) or "reduce" (broadcast-multiply-reduce; lets XLA fuse the
                 decode case into bandwidth-bound reductions) — same math, float32 accumulation.
    returns      [B, T, Hq, d] in q's dtype.
    Key j is visible to a query at position p iff j <= p and j < kv_lengths[b].
    """
    return masked_attention_f32(q, k, v, q_positions, kv_lengths, impl).astype(q.dtype)


def masked_attention_f32(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                         kv_lengths: jax.Array, impl: str = "einsum") -> jax.Array:
    """`masked_attention` before the final cast: float32 [B, T, Hq, d].

    Arithmetic (docs/bounds.md section 7, relied on by the exact rungs' bound): raw scores r = q.k in float32
    (computed once); per row m = max r; weights exp((r - m) / sqrt(d)) -- the scaling comes *after* the
    subtraction, so the max key's weight is exactly 1 whatever a compiler contracts or recomputes, and the
    normalizer is >= 1. Decode (T = 1) multiplies the float32 probabilities with the values at float32
    precision (`probs_times_values`): the exact rungs are never less exact than the quantized rung 0.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose from {ATTENTION_IMPLS}")
    B, T, Hq, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q5 = q.reshape(B, T, Hkv, G, d)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    if impl == "einsum":
        raw = einsum_f32("btkgd,bksd->bkgts", q5, k)
    else:
        q6 = q5.transpose(0, 2, 3, 1, 4)[:, :, :, :, None, :].astype(jnp.float32)  # [B,K,G,T,1,d]
        raw = jnp.sum(q6 * k[:, :, None, None, :, :].astype(jnp.float32), axis=-1)
    key_pos = jnp.arange(S, dtype=jnp.int32)
    visible = (key_pos[None, None, :] <= q_positions[:, :, None]) & (
        key_pos[None, None, :] < kv_lengths[:, None, None])  # [B, T, S]
    raw = jnp.where(visible[:, None, None, :, :], raw, -jnp.inf)
    m = jnp.max(raw, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a query with no visible key (padding rows): all weights 0
    w = jnp.exp((raw - m) * scale)
    denom = jnp.sum(w, axis=-1, keepdims=True)
    probs = w / jnp.where(denom > 0, denom, 1.0)
    if impl == "einsum":
        out = probs_times_values(probs, v) if T == 1 else einsum_f32("bkgts,bksd->btkgd", probs.astype(v.dtype), v)
    else:
        out = jnp.sum(probs[..., None] * v[:, :, None, None, :, :].astype(jnp.float32), axis=-2)
        out = out.transpose(0, 3, 1, 2, 4)
    return out.reshape(B, T, Hq, d)


def probs_times_values(probs: jax.Array, v: jax.Array) -> jax.Array:
    """out[b, t, k, g, d] = sum_s probs[b, k, g, t, s] v[b, k, s, d] with float32 probabilities (no rounding
    of the probabilities to the values' dtype): a float32 product, the values upcast (exactly).

    (A cheaper-looking alternative, splitting the probabilities into three bf16 parts for a bf16 x bf16 -> f32
    product, returned NaN for some heads on an H200 under jax 0.11.2 when XLA fused the bit masks into the
    gemm, and an f32 -> bf16 -> f32 split is elided by XLA's excess-precision rule: docs/bounds.md section 7.)
    """
    return jnp.einsum("bkgts,bksd->btkgd", probs, v.astype(jnp.float32), precision="highest",
                      preferred_element_type=jnp.float32)
