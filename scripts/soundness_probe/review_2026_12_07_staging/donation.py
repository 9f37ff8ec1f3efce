import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

from certattn_jax import model_cache
from certattn_jax.model_cache import cache_spec
from certattn_jax.policy import CertPolicy
from models.config import LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
spec = cache_spec("certified", CFG, jnp.float32, CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2))
full, part = spec(3, 96), spec(1, 96)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    comp = model_cache._put_sequences.lower(full, part, jnp.int32(1)).compile()
    print("warnings:", [str(x.message)[:200] for x in w])
txt = comp.as_text()
import re

m = re.search(r"input_output_alias=\{.*?\}, ", txt)
print("aliases:", m.group(0)[:2000] if m else None)
leaves = jax.tree.leaves(full)
print("n leaves of full:", len(leaves), "host_k index:", [i for i, x in enumerate(leaves) if x is full.store.host_k])
line = [l for l in txt.splitlines() if "input_output_alias" in l][0]
al = re.findall(r"\{(\d+)\}: \((\d+), \{\}, (\w[\w-]*)\)", line)
print("aliased outputs:", len(al), "of", len(jax.tree.leaves(full)), "; param 24 (host_k) aliased:",
      any(p == "24" for _, p, _ in al), "; param 25:", any(p == "25" for _, p, _ in al))
