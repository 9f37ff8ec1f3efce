# ruff: noqa  (the README snippet is kept verbatim, as a user would paste it)
from certattn_jax import TieredKVCache, certified_attention, naive_attention, dense_attention, memory_report
cache = TieredKVCache.from_dense(k, v, policy=CertPolicy())   # k, v [B, T, Hkv, d]
out, cert = certified_attention(q, cache, CertPolicy())      # q [B, Hq, d]; cert.error_bound [B, Hq], .rung, .k_star, ...
