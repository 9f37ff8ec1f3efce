"""certattn-jax: long-context decoding with a runtime-certified, bounded-error quantized KV cache."""

# the sources' hash before any of the code it vouches for is imported (`certattn_jax.source_digest`)
from certattn_jax.source_digest import SOURCES_DIGEST as _SOURCES_DIGEST  # noqa: F401

# isort: split
# tier 2's pinned-host pool sized (on import) before jax's GPU client starts (`certattn_jax.host_limit`)
from certattn_jax import host_limit as _host_limit  # noqa: F401

# isort: split
from certattn_jax.attention import certified_attention, certified_attention_step, dense_attention, naive_attention
from certattn_jax.cache import TieredKVCache
from certattn_jax.certificate import Certificate, summarize
from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.kv_cache import KVCache, masked_attention
from certattn_jax.memory import memory_report
from certattn_jax.model_cache import CACHE_MODES, CacheSpec, TieredModelCache, cache_spec, tiered_cache_factory
from certattn_jax.policy import CertPolicy

__all__ = [
    "CACHE_MODES",
    "CacheSpec",
    "CertPolicy",
    "Certificate",
    "DenseKVCache",
    "KVCache",
    "TieredKVCache",
    "TieredModelCache",
    "cache_spec",
    "certified_attention",
    "certified_attention_step",
    "dense_attention",
    "masked_attention",
    "memory_report",
    "naive_attention",
    "summarize",
    "tiered_cache_factory",
]
__version__ = "0.1.0"
