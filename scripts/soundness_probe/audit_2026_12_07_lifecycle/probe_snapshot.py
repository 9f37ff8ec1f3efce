"""Case 4b: keeping a copy of a cache before donating it (the README loop donates): the natural ways to snapshot a
certified cache, whether decoding resumes from the snapshot, and whether the original survives the snapshot's
donation. Each snapshot is taken of a fresh generate() output."""
import copy
import pickle

from common import *  # noqa: F403

params = params_for()
spec = cache_spec("certified", CFG, jnp.float32, POLICY)
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)


def fresh():
    out = gen.generate(params, CFG, prompts((23, 45)), 6, cache_factory=spec, progress=False)
    return out.cache, jnp.asarray([t[-1] for t in out.tokens], jnp.int32)[:, None]


def kinds(t):
    return sorted({str(x.sharding.memory_kind) for x in jax.tree.leaves(t)})


c, tok = fresh()
ref = np.asarray(fwd(params, CFG, tok, c)[0])

snaps = {
    "jax.tree.map(jnp.copy, cache)": lambda c: jax.tree.map(jnp.copy, c),
    "jax.tree.map(lambda x: x.copy(), cache)": lambda c: jax.tree.map(lambda x: x.copy(), c),
    "copy.deepcopy(cache)": copy.deepcopy,
    "jax.device_put(cache)": jax.device_put,
    "pickle round trip": lambda c: pickle.loads(pickle.dumps(c)),
    "jax.device_put(jax.device_get(cache))": lambda c: jax.device_put(jax.device_get(c)),
}
for name, f in snaps.items():
    def run(f=f):
        c, tok = fresh()
        s = f(c)
        k = kinds(s)
        lg = np.asarray(fwd(params, CFG, tok, s)[0])
        return (f"snapshot kinds {k}; next logits == reference {np.array_equal(lg, ref)}; "
                f"original alive after donating the snapshot: {alive(c)}")
    attempt(f"snapshot by {name}", run)
