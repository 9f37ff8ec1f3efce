"""F1: with_staged_sequences checks the staging cache's layer 0 only. A DenseKVCache whose layer 1 has fewer KV
heads is accepted, and layer 1's second KV head of the written rows keeps the previous sequence's tier 1, tier 2,
hot set and statistics, while the rows' lengths say the new sequence's. spec.from_staging refuses the same cache.
Then a decode step certifies on that row. Also F2: TieredKVCache.with_rows_converted given 3 layers for a
2-layer store writes layer 2's data over layer 1 (the layer index is clamped), and a start past the batch is
clamped.

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_staged/ragged_layers.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax.numpy as jnp
import numpy as np

from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.model_cache import cache_spec
from certattn_jax.policy import CertPolicy
from models.config import LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
CAP = 96
spec = cache_spec("certified", CFG, jnp.float32, POLICY)
rng = np.random.default_rng(0)
A = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)

old = DenseKVCache(k=(A(2, 2, CAP, 32), A(2, 2, CAP, 32)), v=(A(2, 2, CAP, 32), A(2, 2, CAP, 32)),
                   lengths=jnp.asarray([80, 80]))
cache = spec(2, CAP).with_staged_sequences(0, old)
old_hk = np.asarray(cache.store.host_k)
old_vmax = np.asarray(cache.store.v_max)
bad = DenseKVCache(k=(A(1, 2, CAP, 32), A(1, 1, CAP, 32)), v=(A(1, 2, CAP, 32), A(1, 1, CAP, 32)),
                   lengths=jnp.asarray([40]))
try:
    spec.from_staging(bad)
    print("from_staging: accepted")
except ValueError as e:
    print("from_staging: refused:", str(e)[:100])
new = cache.with_staged_sequences(0, bad)
hk = np.asarray(new.store.host_k)  # [L, B, H, nb, Bk, d]
print("lengths", np.asarray(new.lengths).tolist(), "store lengths", np.asarray(new.store.lengths).tolist(),
      "flushed", np.asarray(new.store.flushed).tolist())
print("layer 1, row 0, KV head 0 holds the new keys:",
      np.array_equal(hk[1, 0, 0].reshape(CAP, 32)[:32], np.asarray(bad.k[1])[0, 0, :32]))
print("layer 1, row 0, KV head 1 still the OLD sequence's tier 2 (80 tokens):",
      np.array_equal(hk[1, 0, 1], old_hk[1, 0, 1]),
      "| its running v_max unchanged (old sequence's):",
      np.array_equal(np.asarray(new.store.v_max)[1, 0, 1], old_vmax[1, 0, 1]))
print("   old tokens 40..63 still in tier 2 of that head (beyond the new flushed 32):",
      bool(np.any(hk[1, 0, 1].reshape(CAP, 32)[32:64] != 0)))

# F2: with_rows_converted
c = spec(4, CAP)
before = np.asarray(c.store.host_k).copy()
ks = tuple(A(2, 2, CAP, 32) for _ in range(3))
st = c.store.with_rows_converted(0, ks, ks, jnp.asarray([32, 32]))
hk = np.asarray(st.host_k)
print("with_rows_converted, 3 layers into 2: layer 1 rows 0-1 hold layer 2's keys:",
      np.array_equal(hk[1, :2].reshape(2, 2, CAP, 32)[:, :, :32], np.asarray(ks[2])[:, :, :32]))
c = spec(4, CAP)
st = c.store.with_rows_converted(7, ks[:2], ks[:2], jnp.asarray([32, 32]))
hk = np.asarray(st.host_k)
print("with_rows_converted start 7 (B 4, n 2): rows written:",
      [bool(np.any(hk[:, b] != 0)) for b in range(4)])
