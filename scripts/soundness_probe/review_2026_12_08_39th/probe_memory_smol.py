"""XLA:CPU memory analysis at SmolLM2-135M's shape (bf16, 1K prompt in one 1024-token chunk, batch 1 and 3):
fused last-chunk program vs the eager path's chunk program (donating) and conversion program. Abstract inputs only
(nothing allocated, nothing run)."""
import dataclasses
import sys

from common import CertPolicy, gen, jax, jnp, np

from certattn_jax import cache as cache_mod
from certattn_jax.cache import conversion_layout
from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.model_cache import cache_spec
from models import llama
from models.config import LlamaConfig

cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                  num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
pol = CertPolicy()
S = C = 1024
p = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0), jnp.bfloat16))
spec = cache_spec("certified", cfg, jnp.bfloat16, pol)
for B in [int(b) for b in sys.argv[1:]] or [1, 3]:
    st = jax.eval_shape(lambda B=B: DenseKVCache.init(num_layers=30, batch=B, capacity=S, num_kv_heads=3, head_dim=64,
                                                  dtype=jnp.bfloat16))
    kv = 2 * 30 * int(np.prod(st.k[0].shape)) * 2
    tok = jax.ShapeDtypeStruct((B, C), jnp.int32)
    vec = jax.ShapeDtypeStruct((B,), jnp.int32)
    lg = jax.ShapeDtypeStruct((B, cfg.vocab_size), jnp.float32)

    def mem(c):
        m = c.memory_analysis()
        return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes,
                m.temp_size_in_bytes)

    a = mem(gen._prefill_chunk.lower(p, cfg, st, tok, vec, vec, lg).compile())
    b = mem(cache_mod._convert_all_layers.lower(tuple(st.k), tuple(st.v), vec, conversion_layout(pol)).compile())
    c = mem(gen._prefill_last_chunk_converted.lower(p, cfg, st, tok, vec, vec, lg, vec, pol,
                                                    dataclasses.replace(spec, policy=None)).compile())
    M = 2**20
    print(f"B={B}: staging K/V {kv / M:.0f} MiB; eager chunk peak~{a[0] / M:.0f} (temp {a[1] / M:.0f}), eager "
          f"conversion peak~{b[0] / M:.0f} (temp {b[1] / M:.0f}); fused peak~{c[0] / M:.0f} (temp {c[1] / M:.0f}); "
          f"fused - max(eager) = {(c[0] - max(a[0], b[0])) / M:.0f} MiB", flush=True)
