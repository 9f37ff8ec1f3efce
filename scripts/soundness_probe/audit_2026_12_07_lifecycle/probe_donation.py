"""Case 4: donation and aliasing. Which public functions donate or alias a cache the caller still holds."""
from common import *  # noqa: F403

from certattn_jax import (
    TieredKVCache,
    TieredModelCache,
    certified_attention,
    certified_attention_step,
    dense_attention,
    naive_attention,
)

params = params_for()
rng = np.random.default_rng(0)
B, T, H, d = 2, 40, 2, 32
k = jnp.asarray(rng.standard_normal((B, T, H, d)), jnp.float32)
v = jnp.asarray(rng.standard_normal((B, T, H, d)), jnp.float32)
q = jnp.asarray(rng.standard_normal((B, 4, d)), jnp.float32)

print("== single-layer APIs (not jitted by the library) ==")
c = TieredKVCache.from_dense(k, v, policy=POLICY)
print("from_dense: k, v alive:", alive((k, v)))
for name, f in [("certified_attention", lambda: certified_attention(q, c, POLICY)[0]),
                ("certified_attention_step", lambda: certified_attention_step(q, c, POLICY)[0]),
                ("naive_attention", lambda: naive_attention(q, c, POLICY)),
                ("dense_attention", lambda: dense_attention(q, c, POLICY))]:
    a, b = np.asarray(f()), np.asarray(f())
    print(f"{name}: twice with the same cache equal {np.array_equal(a, b)}, cache alive {alive(c)}")
c2 = c.write_token(k[:, :1], v[:, :1])
print("write_token: old cache alive", alive(c), "old lengths", np.asarray(c.lengths).tolist(), "new",
      np.asarray(c2.lengths).tolist())
c3 = c2.flush()
print("flush: old alive", alive(c2))

print("== model caches: aliasing between the staging cache and the converted one ==")
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)
spec = cache_spec("certified", CFG, jnp.float32, POLICY)
nspec = cache_spec("naive", CFG, jnp.float32, POLICY)
P = np.asarray(prompts((20, 20)), np.int32)
staging = spec.staging(2, 64)
lg, staging = fwd(params, CFG, jnp.asarray(P), staging)
cert_cache = spec.from_staging(staging)
shared = [(n, a is b) for n, a, b in [("model.lengths is staging.lengths", cert_cache.lengths, staging.lengths),
                                       ("store.lengths is staging.lengths", cert_cache.store.lengths, staging.lengths),
                                       ("model.lengths is store.lengths", cert_cache.lengths, cert_cache.store.lengths)]]
print("aliases:", shared)
tok = jnp.argmax(lg[:, -1], -1).astype(jnp.int32)[:, None]
lg1, after = fwd(params, CFG, tok, cert_cache)
print("after one donated certified step: staging alive", alive(staging),
      "| dead staging leaves:", [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(staging)[0]
                                  if x.is_deleted()])
attempt("second conversion of the same staging cache (naive, e.g. to compare modes on one prefill)",
        lambda: np.asarray(nspec.from_staging(staging).lengths).tolist())
attempt("reading the donated old cache (README: never touch it again)", lambda: np.asarray(cert_cache.lengths))

print("== from_layers (README: per-layer caches may share buffers) ==")
layers = [TieredKVCache.from_dense(k, v, policy=POLICY) for _ in range(CFG.num_layers)]
mc = TieredModelCache.from_layers(layers, num_q_heads=CFG.num_heads, policy=POLICY)
q1 = jnp.asarray(rng.integers(0, 96, (2, 1)), jnp.int32)
_, mc2 = fwd(params, CFG, q1, mc)
print("from_layers -> donated step: input layers alive", alive(layers))
same_layers = [TieredKVCache.from_dense(k, v, policy=POLICY)] * CFG.num_layers
mc = TieredModelCache.from_layers(same_layers, num_q_heads=CFG.num_heads, policy=POLICY)
_, mc2 = fwd(params, CFG, q1, mc)
print("from_layers with one layer object twice -> donated step: OK, layers alive", alive(same_layers))

print("== policy leaves shared between caches ==")
pol = cert_cache.policy if alive(cert_cache.policy) else None
after_policy = after.policy
stage2 = spec.staging(2, 64)
_, stage2 = fwd(params, CFG, jnp.asarray(P), stage2)
spec_shared = cache_spec("certified", CFG, jnp.float32, after_policy)  # a policy taken from a live cache
other = spec_shared.from_staging(stage2)
print("other.policy.eps is after.policy.eps:", other.policy.eps is after.policy.eps)
_, after2 = fwd(params, CFG, tok, after)  # donate `after`
attempt("step the other cache after donating the first (their policies share leaves?)",
        lambda: bool(np.isfinite(np.asarray(fwd(params, CFG, tok, other)[0])).all()))

print("== generate with a user cache_factory that returns a prebuilt cache ==")
pre = cache_spec("dense", CFG, jnp.float32)(1, 64)
fac = lambda b, c: pre  # noqa: E731
attempt("generate #1", lambda: gen.generate(params, CFG, prompts((20,)), 4, cache_factory=fac, progress=False).tokens)
print("prebuilt cache alive after generate #1:", alive(pre))
attempt("generate #2 with the same factory", lambda: gen.generate(params, CFG, prompts((20,)), 4, cache_factory=fac,
                                                                  progress=False).tokens)
print("== generate's out.cache stays valid across later generate calls ==")
o1 = gen.generate(params, CFG, prompts((20,)), 4, cache_factory=spec, progress=False)
o2 = gen.generate(params, CFG, prompts((20,)), 4, cache_factory=spec, progress=False)
print("o1.cache alive after a second generate:", alive(o1.cache), "o1.cache is o2.cache", o1.cache is o2.cache)
