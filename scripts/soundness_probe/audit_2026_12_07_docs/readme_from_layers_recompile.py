"""README.md:89-95 rule: caches built with `TieredKVCache.from_dense(k, v, policy)` + `TieredModelCache.from_layers(...)`
"return committed arrays with tier 2 in pinned_host, exactly what the jitted step returns, so the second call
reuses the first call's executable". Checked with the README's own jit (`jax.jit(llama.forward, static_argnums=1,
donate_argnums=3)`) on the tests' tiny model: programs compiled after each call, and which leaves differ between
the built cache and the one the step returns (shape/dtype/sharding/committed/pytree structure)."""
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

COMPILES = []


class _H(logging.Handler):
    def emit(self, r):
        m = r.getMessage()
        if "Finished XLA compilation" in m or "Finished jaxpr to MLIR" in m or "Finished tracing" in m:
            COMPILES.append(m.split(" in ")[0][:90])


jax.config.update("jax_log_compiles", True)
logging.getLogger("jax").addHandler(_H())
logging.getLogger("jax").setLevel(logging.DEBUG)

from certattn_jax import CertPolicy, TieredKVCache, TieredModelCache
from models import llama
from models.config import LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
params = llama.init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)

rng = np.random.default_rng(1)
kv = [(jnp.asarray(rng.normal(size=(1, 37, 2, 32)), jnp.float32),
       jnp.asarray(rng.normal(size=(1, 37, 2, 32)), jnp.float32)) for _ in range(CFG.num_layers)]
cache = TieredModelCache.from_layers([TieredKVCache.from_dense(k, v, POLICY) for k, v in kv],
                                     num_q_heads=CFG.num_heads, policy=POLICY)


def describe(c):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(c)
    return treedef, {jax.tree_util.keystr(p): (getattr(x, "shape", None), str(getattr(x, "dtype", type(x).__name__)),
                                               str(getattr(getattr(x, "sharding", None), "memory_kind", None)),
                                               getattr(x, "committed", None), getattr(x, "weak_type", None))
                     for p, x in leaves}


before_def, before = describe(cache)
tok = jnp.array([[5]], jnp.int32)
sizes = []
for i in range(4):
    n0 = len(COMPILES)
    t0 = time.perf_counter()
    logits, cache = fwd(params, CFG, tok, cache)
    jax.block_until_ready(logits)
    dt = time.perf_counter() - t0
    sizes.append(fwd._cache_size())
    print(f'call {i + 1}: {dt:.2f} s; trace/lower/compile events: {COMPILES[n0:]}')
    if i == 0:
        after_def, after = describe(cache)
print("programs after calls 1..4:", sizes, "(README: the second call reuses the first call's executable -> [1, 1, 1, 1])")
print("pytree structure equal:", before_def == after_def)
for key in sorted(set(before) | set(after)):
    if before.get(key) != after.get(key):
        print("differs:", key, "built:", before.get(key), "returned:", after.get(key))
