"""Companion of readme_from_layers_recompile.py: the same count of XLA compiles per call of the README's jit
(`jax.jit(llama.forward, static_argnums=1, donate_argnums=3)`, decode of one token per call) for the other
documented builders: `llama.init_cache(..., "certified", policy)` and `spec.from_staging(...)` (after a prefill).
usage: readme_builders_recompile.py init_cache|from_staging"""
import logging
import sys
import time

import jax
import jax.numpy as jnp

from certattn_jax import CertPolicy
from certattn_jax.model_cache import cache_spec
from models import llama
from models.config import LlamaConfig

EVENTS = []


class _H(logging.Handler):
    def emit(self, r):
        m = r.getMessage()
        if "Finished XLA compilation" in m:
            EVENTS.append(m.split(" in ")[0][:60])


jax.config.update("jax_log_compiles", True)
logging.getLogger("jax").addHandler(_H())
logging.getLogger("jax").setLevel(logging.DEBUG)
CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
params = llama.init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)
which = sys.argv[1]
if which == "init_cache":
    cache = llama.init_cache(params, CFG, 1, 64, "certified", POLICY)
else:
    spec = cache_spec("certified", CFG, jnp.float32, POLICY)
    cache = spec.staging(batch=1, capacity=64)
    logits, cache = fwd(params, CFG, jnp.arange(1, 38, dtype=jnp.int32)[None, :], cache)
    cache = spec.from_staging(cache)
print(which, "policy.eps leaf:", type(cache.policy.eps).__name__)
tok = jnp.array([[5]], jnp.int32)
for i in range(3):
    n0 = len(EVENTS)
    t0 = time.perf_counter()
    logits, cache = fwd(params, CFG, tok, cache)
    jax.block_until_ready(logits)
    print(f"{which} decode call {i + 1}: {time.perf_counter() - t0:.2f} s, XLA compiles: {len(EVENTS) - n0}")
