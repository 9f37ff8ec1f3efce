"""certattn-jax: long-context decoding with a runtime-certified, bounded-error quantized KV cache."""

from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.kv_cache import KVCache, masked_attention

__all__ = ["DenseKVCache", "KVCache", "masked_attention"]
__version__ = "0.1.0"
