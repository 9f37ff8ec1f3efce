"""Next-token selection: greedy, or temperature + nucleus (top-p) sampling. jit-friendly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def select_next(logits: jax.Array, key: jax.Array, *, greedy: bool, temperature: jax.Array,
                top_p: jax.Array) -> jax.Array:
    """Pick one token per row of logits [B, V] (float32). Returns int32 [B].

    greedy (static): argmax. Otherwise sample from softmax(logits / temperature) restricted to the
    smallest set of most likely tokens whose probability reaches top_p (the top token always stays).
    """
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # logits less their row maximum, then over T: the softmax is the same, and no T is too small (an audit: dividing
    # by max(T, 1e-6) sampled T = 1e-7 as 1e-6, 34% off the top token where all mass belongs to it). A T that is
    # 0 in float32 (a Python 1e-320) keeps the top tokens only: the limit T -> 0
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    positive = temperature > 0
    scaled = jnp.where(positive, shifted / jnp.where(positive, temperature, 1.0),
                       jnp.where(shifted == 0, 0.0, -jnp.inf))
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p
    keep = keep.at[:, 0].set(True)
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = jax.random.categorical(key, masked, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def key_from_seed(seed: int) -> jax.Array:
    """A PRNG key from a seed in [-2**63, 2**63), every bit of it counted: `jax.random.key` keeps only the low 32
    bits where 64-bit integers are off (an audit: seeds 0 and 2**32 sampled the same tokens). Seeds in [0, 2**32)
    give `jax.random.key(seed)` itself; above, the high word is folded in."""
    seed = int(seed)
    if not -2 ** 63 <= seed < 2 ** 63:
        raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {seed}")
    word = seed & 0xFFFFFFFF
    high = (seed >> 32) & 0xFFFFFFFF  # (arithmetic shift: -1 has the high word 0xFFFFFFFF)
    key = jax.random.key(np.uint32(word))  # (uint32: the same key with 64-bit integers on or off)
    return key if high == 0 else jax.random.fold_in(key, high)
