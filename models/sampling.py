"""Next-token selection: greedy, or temperature + nucleus (top-p) sampling. jit-friendly."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def select_next(logits: jax.Array, key: jax.Array, *, greedy: bool, temperature: jax.Array,
                top_p: jax.Array) -> jax.Array:
    """Pick one token per row of logits [B, V] (float32). Returns int32 [B].

    greedy (static): argmax. Otherwise sample from softmax(logits / temperature) restricted to the
    smallest set of most likely tokens whose probability reaches top_p (the top token always stays).
    """
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p
    keep = keep.at[:, 0].set(True)
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = jax.random.categorical(key, masked, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
