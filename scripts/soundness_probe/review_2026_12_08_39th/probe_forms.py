"""CONVERT_GROUP_FORM / CONVERT_GROUPS_INTO / CONVERT_GROUP_BYTES variants: which path the fused prefill takes,
bit equality with the eager path, and whether the traced conversion honours the "loop" form."""

from common import CFG, POLICY, diff, gen, jax, jnp, np, prefilled, prompts

from certattn_jax import cache as cache_mod
from certattn_jax.cache import TieredKVCache
from certattn_jax.model_cache import cache_spec

ps = prompts(3, [53, 21])
spec = cache_spec("certified", CFG, jnp.float32, POLICY)
staging = spec.staging(2, 96)
for form, into, budget in [("batched", False, None), ("loop", False, None), ("loop", True, None),
                           ("batched", True, None), ("batched", False, 1), ("batched", True, 1)]:
    cache_mod.CONVERT_GROUP_FORM, cache_mod.CONVERT_GROUPS_INTO = form, into
    saved = cache_mod.CONVERT_GROUP_BYTES
    if budget is not None:
        cache_mod.CONVERT_GROUP_BYTES = budget
    gen.PREFILL_CONVERSION_IN_CHUNK = True
    fused_chosen = gen.conversion_in_chunk(spec, staging)
    a, la = prefilled(True, "certified", ps, 96, 16)
    b, lb = prefilled(False, "certified", ps, 96, 16)
    k = jnp.stack(staging.k)
    jaxpr = str(jax.make_jaxpr(lambda k, v, n: TieredKVCache.stacked_from_head_major(k, v, n, POLICY))(
        k, k, staging.lengths))
    traced_form = "lax.map (scan)" if "scan" in jaxpr else "batched (vmap)"
    d = diff(a, b)
    print(f"form={form} groups_into={into} budget={budget}: fused chosen={fused_chosen}; traced conversion "
          f"{traced_form}; fused vs eager {'same' if not d and np.array_equal(la, lb) else d[:3]}", flush=True)
    cache_mod.CONVERT_GROUP_BYTES = saved
