"""XLA memory analysis (CPU) of the fused last-chunk program against the eager path's two programs (the donating
chunk program, then the one-program conversion): is the staging K/V copied once more inside the fused program
(it is not donated)?"""
import dataclasses

from common import CertPolicy, gen, jax, jnp, np

from certattn_jax import cache as cache_mod
from certattn_jax import tiers
from certattn_jax.cache import conversion_layout
from certattn_jax.model_cache import cache_spec
from models import llama
from models.config import LlamaConfig

cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=64, max_position_embeddings=4096)
pol = CertPolicy(block_size=64, group_size=32)
B, S, C = 4, 2048, 256
p = llama.init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
spec = cache_spec("certified", cfg, jnp.float32, pol)
staging = spec.staging(B, S)
print("host memory kind:", tiers.host_memory_kind(), "converts_in_one_program:", spec.converts_in_one_program(staging))
kv = sum(x.nbytes for x in staging.k) + sum(x.nbytes for x in staging.v)
print(f"staging K/V bytes: {kv / 2**20:.1f} MiB")
tokens = np.zeros((B, C), np.int32)
valid = np.full((B,), C, np.int32)
last = np.full((B,), C - 1, np.int32)
lens = np.full((B,), S, np.int32)
logits = gen._zero_logits(B, cfg.vocab_size)


def mem(compiled, name):
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    print(f"{name}: args {m.argument_size_in_bytes / 2**20:.1f} out {m.output_size_in_bytes / 2**20:.1f} "
          f"alias {m.alias_size_in_bytes / 2**20:.1f} temp {m.temp_size_in_bytes / 2**20:.1f} "
          f"-> peak~ {peak / 2**20:.1f} MiB; host out {getattr(m, 'host_output_size_in_bytes', 0) / 2**20:.1f}")
    return peak


chunk = gen._prefill_chunk.lower(p, cfg, staging, tokens, valid, last, logits).compile()
conv = cache_mod._convert_all_layers.lower(tuple(staging.k), tuple(staging.v), staging.lengths,
                                           conversion_layout(pol)).compile()
fused = gen._prefill_last_chunk_converted.lower(p, cfg, staging, tokens, valid, last, logits, lens, pol,
                                                dataclasses.replace(spec, policy=None)).compile()
a = mem(chunk, "eager chunk (donating)")
b = mem(conv, "eager conversion (_convert_all_layers)")
c = mem(fused, "fused last chunk + conversion")
print(f"eager peak~ max = {max(a, b) / 2**20:.1f} MiB; fused peak~ {c / 2**20:.1f} MiB; "
      f"difference {(c - max(a, b)) / 2**20:.1f} MiB (staging K/V {kv / 2**20:.1f} MiB)")


# a variant (not the library's): the staging cache donated and returned too (aliased), the tiered cache beside it
@jax.jit
def _variant(params, cache, chunk, valid, last_index, last_logits, lengths, policy):
    cache, logits = gen._prefill_chunk_body(params, cfg, cache, chunk, valid, last_index, last_logits)
    return dataclasses.replace(spec, policy=policy).from_staging(cache, lengths=lengths), logits, cache


variant = jax.jit(_variant.__wrapped__ if hasattr(_variant, "__wrapped__") else _variant, donate_argnums=1)
v = mem(variant.lower(p, staging, tokens, valid, last, logits, lens, pol).compile(),
        "variant: staging donated and returned (aliased)")
print(f"variant peak~ {v / 2**20:.1f} MiB vs eager {max(a, b) / 2**20:.1f} MiB")
