"""Under CONVERT_GROUP_FORM=loop + CONVERT_GROUPS_INTO (SmolLM2 1K bf16, batch 11): the fused prefill is chosen and
converts batched (vmap), while auto_staging_batch's estimate (`conversion_temp_bytes`) counts the loop form."""
import jax.numpy as jnp
from common import gen

from certattn_jax import cache as cache_mod
from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.model_cache import cache_spec
from models.config import LlamaConfig

cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                  num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
B, S = 11, 1024
st = DenseKVCache.init(num_layers=30, batch=B, capacity=S, num_kv_heads=3, head_dim=64, dtype=jnp.bfloat16)
spec = cache_spec("certified", cfg, jnp.bfloat16, None)
layer_elems = B * 2 * 3 * S * 64
gen.PREFILL_CONVERSION_IN_CHUNK = True
for form, into in [("batched", False), ("loop", True)]:
    cache_mod.CONVERT_GROUP_FORM, cache_mod.CONVERT_GROUPS_INTO = form, into
    est = cache_mod.conversion_temp_bytes(layer_elems, 30, 2)
    batched = cache_mod.conversion_temp_bytes(layer_elems, 30, 2, form="batched")
    print(f"form={form} into={into}: fused chosen={gen.conversion_in_chunk(spec, st)}; estimated conversion temps "
          f"{est / 2**30:.2f} GiB (batched form's {batched / 2**30:.2f} GiB)")
