"""Case 1b: the README loop (jit, cache donated): an argument error raised while tracing must leave the cache
passed in alive and usable."""
from common import *  # noqa: F403

params = params_for()
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)
spec = cache_spec("certified", CFG, jnp.float32, POLICY)
cache, logits = gen.prefill(params, CFG, prompts((23, 45)), 64, cache_factory=spec)
tok = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
attempt("tokens of batch 3 for a batch-2 cache", lambda: fwd(params, CFG, jnp.zeros((3, 1), jnp.int32), cache))
print("cache alive after the error:", alive(cache))
attempt("float tokens", lambda: fwd(params, CFG, jnp.zeros((2, 1), jnp.float32), cache))
print("cache alive after the error:", alive(cache))
other = cache_spec("certified", CFG, jnp.float32, CertPolicy(block_size=32, group_size=16, k_max=4, v_max=2))
attempt("params of another model (num_layers 3) with this cache",
        lambda: fwd(params_for(LlamaConfig(**{**CFG.__dict__, "num_layers": 3})),
                    LlamaConfig(**{**CFG.__dict__, "num_layers": 3}), tok, cache))
print("cache alive after the error:", alive(cache))
lg, c2 = fwd(params, CFG, tok, cache)
print("the cache still decodes afterwards: finite", bool(np.isfinite(np.asarray(lg)).all()))
