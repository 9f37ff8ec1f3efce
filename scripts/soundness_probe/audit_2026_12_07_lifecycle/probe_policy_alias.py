"""Case 4c: a converted cache's policy leaves are device arrays; reusing `cache.policy` for a second run shares
them, and the second run's donation then deletes the first cache's policy."""
from common import *  # noqa: F403

params = params_for()
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)
P = prompts((23,))
out1 = gen.generate(params, CFG, P, 6, cache_factory="certified", policy=POLICY, progress=False)
print("out1.cache.policy.eps:", type(out1.cache.policy.eps).__name__)
out2 = gen.generate(params, CFG, P, 6, cache_factory="certified", policy=out1.cache.policy, progress=False)
print("second generate with policy=out1.cache.policy: tokens equal", out1.tokens == out2.tokens)
print("out1.cache alive after the second generate:", alive(out1.cache),
      "| dead leaves:", [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(out1.cache)[0]
                         if x.is_deleted()])
tok = jnp.asarray([out1.tokens[0][-1]], jnp.int32)[:, None]
attempt("continue out1.cache with the README loop", lambda: np.asarray(fwd(params, CFG, tok, out1.cache)[0]).shape)
attempt("read out1.cache.last_certificate", lambda: np.asarray(out1.cache.last_certificate.error_bound).shape)
attempt("third generate with policy=out1.cache.policy",
        lambda: gen.generate(params, CFG, P, 6, cache_factory="certified", policy=out1.cache.policy,
                             progress=False).tokens)
