"""Rotary position embeddings (RoPE), Hugging Face LLaMA convention (rotate-half, non-interleaved).

inv_freq_j = theta^(-2j/d) for j < d/2, optionally rescaled by the `llama3` rule (LLaMA 3.1):
wavelengths longer than original_max/low_freq_factor are divided by `factor`, shorter than
original_max/high_freq_factor are kept, and the band between is interpolated smoothly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] as float32, computed like transformers does."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    inv_freq = inv_freq.astype(np.float32)
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(config: LlamaConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., head_dim] (float32) for integer `positions` [...]."""
    inv_freq = jnp.asarray(rope_inv_freq(config))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, H, d] by cos/sin [B, T, d]; the result has x's dtype."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
