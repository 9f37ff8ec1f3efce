"""Programs compiled per call (same shapes, new tokens / policies) on the eager and the fused prefill paths, and by
eager from_dense with host-given lengths of each kind."""
from common import POLICY, gen, jnp, np, prefilled, prompts

from certattn_jax import cache as cache_mod
from certattn_jax import model_cache as mc
from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.model_cache import TieredModelCache

fns = {"_prefill_chunk": gen._prefill_chunk, "_prefill_last_chunk_converted": gen._prefill_last_chunk_converted,
       "_zero_logits": gen._zero_logits, "_convert_all_layers": cache_mod._convert_all_layers,
       "_fresh_model_arrays": mc._fresh_model_arrays, "_from_head_major_impl": cache_mod._from_head_major_impl}


def sizes():
    out = {}
    for k, f in fns.items():
        try:
            out[k] = f._cache_size()
        except Exception:  # noqa: BLE001
            out[k] = None
    return out


for fused in (False, True):
    for i in range(3):
        before = sizes()
        pol = POLICY.replace(eps=0.01 * (i + 1))
        prefilled(fused, "certified", prompts(20 + i, [53, 21]), 96, 16, policy=pol)
        after = sizes()
        print(f"fused={fused} call {i}: new programs",
              {k: after[k] - before[k] for k in fns if after[k] is not None and after[k] != before[k]}, flush=True)

rng = np.random.default_rng(0)
ks = tuple(jnp.asarray(rng.standard_normal((2, 2, 64, 32)), jnp.float32) for _ in range(2))
dn = DenseKVCache(k=ks, v=ks, lengths=jnp.array([10, 64], jnp.int32))
for _i, given in enumerate([[10, 64], np.array([10, 64]), jnp.array([10, 64]), [10, 64], np.array([10, 64], np.int32),
                           None, None]):
    before = sizes()
    TieredModelCache.from_dense(dn, num_q_heads=4, policy=POLICY, lengths=given)
    after = sizes()
    print(f"from_dense lengths={type(given).__name__}: new programs",
          {k: after[k] - before[k] for k in fns if after[k] is not None and after[k] != before[k]}, flush=True)
