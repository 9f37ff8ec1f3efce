"""Edge cases of TieredModelCache.with_sequences (review 2026-12-07, staging). CPU."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax import tiers
from certattn_jax.model_cache import cache_spec
from certattn_jax.policy import CertPolicy
from models import generate as gen
from models import llama
from models.config import LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POL = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
CAP = 96
params = llama.init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
spec = cache_spec("certified", CFG, jnp.float32, POL)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 96, n).tolist() for n in (40, 7, 33)]
print("host memory kind", tiers.host_memory_kind(), "backend", jax.default_backend())

def attempt(name, f):
    try:
        r = f()
        print(f"[{name}] OK ->", type(r).__name__)
        return r
    except Exception as e:
        print(f"[{name}] {type(e).__name__}: {str(e)[:300]}")

# 1. self passed as part (same batch)
part, _ = gen.prefill(params, CFG, prompts[:2], CAP, cache_factory=spec, policy=POL)
r = attempt("self as part", lambda: part.with_sequences(0, part))
if r is not None:
    print("   result lengths", r.lengths.tolist(), "part deleted?", part.store.k_codes.is_deleted())

# 2. traced start inside jit
full = spec(3, CAP)
part1, _ = gen.prefill(params, CFG, prompts[:1], CAP, cache_factory=spec, policy=POL)
attempt("traced start", lambda: jax.jit(lambda f, p, s: f.with_sequences(s, p))(spec(3, CAP), part1, 1))
# 3. jax array start
attempt("jnp start", lambda: spec(3, CAP).with_sequences(jnp.int32(1), part1))
attempt("np start", lambda: spec(3, CAP).with_sequences(np.int64(1), part1))
# 4. different tolerances, same layout
other = cache_spec("certified", CFG, jnp.float32, CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2, eps=0.5,
                                                             abs_tol=1.0))
p_other, _ = gen.prefill(params, CFG, prompts[:1], CAP, cache_factory=other, policy=other.policy)
r = attempt("other tolerances", lambda: spec(3, CAP).with_sequences(0, p_other))
if r is not None:
    print("   result eps", float(r.policy.eps), "abs_tol", float(r.policy.abs_tol))
# 4b. other hot_refresh / tier1 / rung0 (non-layout policy fields)
oth2 = cache_spec("certified", CFG, jnp.float32, CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2,
                                                             hot_refresh="immediate"))
r = attempt("other hot_refresh", lambda: spec(3, CAP).with_sequences(0, oth2(1, CAP)))
# 4c. other schedule
oth3 = cache_spec("certified", CFG, jnp.float32, POL, schedule="unrolled")
attempt("other schedule", lambda: spec(3, CAP).with_sequences(0, oth3(1, CAP)))
# 4d. other hot_slots
oth4 = cache_spec("certified", CFG, jnp.float32, CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2, hot_slots=8))
attempt("other hot_slots", lambda: spec(3, CAP).with_sequences(0, oth4(1, CAP)))
# 5. part whose tier 2 is on the device
p_dev = part1.replace(store=part1.store.replace(host_k=tiers.to_device(part1.store.host_k),
                                                host_v=tiers.to_device(part1.store.host_v)))
print("   p_dev host_k memory kind", p_dev.store.host_k.sharding.memory_kind)
attempt("tier 2 on device (part)", lambda: spec(3, CAP).with_sequences(0, p_dev))
f_dev = spec(3, CAP)
f_dev = f_dev.replace(store=f_dev.store.replace(host_k=tiers.to_device(f_dev.store.host_k),
                                                host_v=tiers.to_device(f_dev.store.host_v)))
attempt("tier 2 on device (self)", lambda: f_dev.with_sequences(0, part1))
# 6. part is the whole batch (n == B): start 0 ok, start 1 refused
attempt("n == B", lambda: spec(2, CAP).with_sequences(0, part))
# 7. empty part? batch 0 not constructible probably
# 8. part of a deleted (donated) cache
f8 = spec(3, CAP)
g8 = f8.with_sequences(0, part1)
attempt("self already donated", lambda: f8.with_sequences(1, part1))
attempt("part after use, reuse", lambda: g8.with_sequences(1, part1))
# 9. layer view / non-model caches
attempt("bool start", lambda: spec(3, CAP).with_sequences(True, part1))
# 10. naive into certified
nv = cache_spec("naive", CFG, jnp.float32, POL)
attempt("naive part into certified", lambda: spec(3, CAP).with_sequences(0, nv(1, CAP)))
