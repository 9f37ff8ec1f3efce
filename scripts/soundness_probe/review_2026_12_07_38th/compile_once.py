"""The user-jit-loop pattern (tests/test_e2e_cache.py) with tiered caches from every constructor: one trace, one
executable. Also: DenseKVCache.init donated twice, distinct output buffers; policy copies never alias the caller's.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/soundness_probe/review_2026_12_07_38th/compile_once.py
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.model_cache import TieredModelCache, cache_spec
from certattn_jax.policy import CertPolicy
from models import generate as gen
from models import llama
from models.config import LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=256)
POL = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
params = llama.init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
spec = cache_spec("certified", CFG, jnp.float32, POL)
traces = []


def step_fn(p, tok, cache):
    traces.append(1)
    logits, cache = llama.forward(p, CFG, tok, cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


step = jax.jit(step_fn, donate_argnums=(2,))
prompts = [[1] * 37, [2] * 20]
mk = lambda b, c: spec.staging(b, c)  # noqa: E731


def staged():
    return gen.prefill(params, CFG, prompts, 64, cache_factory=mk)[0]


builders = {
    "prefill(spec)": lambda: gen.prefill(params, CFG, prompts, 64, cache_factory=spec)[0],
    "prefill(staging_batch=1)": lambda: gen.prefill(params, CFG, prompts, 64, cache_factory=spec, staging_batch=1)[0],
    "from_staging(lengths=None)": lambda: spec.from_staging(staged()),
    "from_staging(list)": lambda: spec.from_staging(staged(), lengths=[37, 20]),
    "from_staging(tuple)": lambda: spec.from_staging(staged(), lengths=(37, 20)),
    "from_staging(np.int64)": lambda: spec.from_staging(staged(), lengths=np.array([37, 20], np.int64)),
    "from_staging(jax)": lambda: spec.from_staging(staged(), lengths=jnp.array([37, 20])),
    "from_dense in jit": lambda: jax.jit(lambda d: TieredModelCache.from_dense(d, num_q_heads=4, policy=POL,
                                                                               lengths=[37, 20]))(staged()),
    "empty spec(2, 64)": lambda: spec(2, 64),
    "with_staged_sequences": lambda: spec(2, 64).with_staged_sequences(
        1, gen.prefill(params, CFG, [[3] * 5], 64, cache_factory=mk)[0]),
    "policy from another cache": lambda: spec.from_staging(staged()).with_policy(spec(2, 64).policy),
}
tok = jax.device_put(jnp.zeros((2, 1), jnp.int32), jax.devices()[0])
for name, build in builders.items():
    c = build()
    for _ in range(2):
        t, c = step(params, tok, c)
    print(f"{name:30s} traces={len(traces)} executables={step._cache_size()}", flush=True)

# a caller's policy leaves (jax arrays) are never aliased by the cache
pol = jax.tree.map(lambda x: jax.device_put(jnp.asarray(x)), POL)
c = spec.from_staging(staged())
c2 = TieredModelCache.from_dense(staged(), num_q_heads=4, policy=pol, lengths=[37, 20])
ptrs = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(pol) if isinstance(x, jax.Array)}
mine = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(c2.policy) if isinstance(x, jax.Array)}
print("policy leaves aliased:", len(ptrs & mine))
step(params, tok, c2)
print("caller policy alive after donation:", not any(x.is_deleted() for x in jax.tree.leaves(pol)
                                                     if isinstance(x, jax.Array)))

# DenseKVCache.init: distinct buffers, committed, donated into a jitted step twice
d = DenseKVCache.init(num_layers=3, batch=2, capacity=32, num_kv_heads=2, head_dim=8, dtype=jnp.float32)
leaves = jax.tree.leaves(d)
print("dense init: committed", all(x.committed for x in leaves), "distinct",
      len({x.unsafe_buffer_pointer() for x in leaves}) == len(leaves))
dstep = jax.jit(lambda c: c.replace(lengths=c.lengths + 1, k=tuple(x + 1 for x in c.k)), donate_argnums=0)
d = dstep(dstep(d))
d2 = dstep(DenseKVCache.init(num_layers=3, batch=2, capacity=32, num_kv_heads=2, head_dim=8, dtype=jnp.float32))
print("dense donated twice ok:", np.asarray(d.lengths).tolist(), "executables", dstep._cache_size())
print("eval_shape:", jax.eval_shape(lambda: DenseKVCache.init(num_layers=1, batch=1, capacity=16, num_kv_heads=1,
                                                              head_dim=8)).lengths)
