import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

from certattn_jax.model_cache import cache_spec
from certattn_jax.policy import CertPolicy
from models.config import LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POL = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
spec = cache_spec("certified", CFG, jnp.float32, POL)
c = spec(2, 96)
try:
    c.with_sequences(0, c)
except Exception as e:
    print("self-as-part:", type(e).__name__)
print("  after the failed call, self's arrays deleted:", [x.is_deleted() for x in jax.tree.leaves(c)][:3], "...",
      any(x.is_deleted() for x in jax.tree.leaves(c)))
# a part sharing only its tier 2 with self (e.g. part = self.replace(...)): same error?
d = spec(2, 96)
part = d.replace(lengths=d.lengths + 0)
try:
    d.with_sequences(0, part); print("shared-leaves part: OK")
except Exception as e:
    print("shared-leaves part:", type(e).__name__, str(e)[:120])
# int start inside jit
r = jax.jit(lambda f, p: f.with_sequences(1, p))(spec(3, 96), spec(1, 96))
print("inside jit with an int start: OK", r.store.host_k.sharding.memory_kind)
# part with more slots than self (policy narrowed on the part)
wide = cache_spec("certified", CFG, jnp.float32, POL.replace(k_max=8))(1, 96).with_policy(POL)
try:
    spec(3, 96).with_sequences(0, wide); print("wider part: OK")
except Exception as e:
    print("wider part:", type(e).__name__, str(e)[:200])
