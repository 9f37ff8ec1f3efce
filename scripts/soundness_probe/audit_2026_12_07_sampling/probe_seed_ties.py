"""Follow-ups: (a) which bits of `seed` reach the PRNG (generate validates [-2**63, 2**63)); (b) the tie-boundary case
of probe_sampling.py (chi-square p ~0.04 twice) with 10x the draws and 3 keys; (c) the temperature clamp at 1e-6."""
from common import CFG, gen, jax, jnp, np, params_for, prompts  # noqa: F401
from scipy import stats

from models.sampling import select_next

print(f"jax_enable_x64={jax.config.jax_enable_x64}, jax_threefry_partitionable={jax.config.jax_threefry_partitionable}")
for a, b in ((0, 2 ** 32), (-1, 2 ** 63 - 1), (1, 1 + 2 ** 40), (5, 6)):
    ka, kb = jax.random.key_data(jax.random.key(a)), jax.random.key_data(jax.random.key(b))
    print(f"  key({a}) data {np.asarray(ka).tolist()} vs key({b}) data {np.asarray(kb).tolist()}: "
          f"same key {bool(np.all(ka == kb))}")
P = params_for()
p = prompts((9,), seed=4)
kw = dict(temperature=1.0, top_p=1.0, eos_token_ids=(), progress=False)
for a, b in ((0, 2 ** 32), (-1, 2 ** 63 - 1), (123, 123 + 5 * 2 ** 32)):
    ta = gen.generate(P, CFG, p, 16, seed=a, **kw).tokens[0]
    tb = gen.generate(P, CFG, p, 16, seed=b, **kw).tokens[0]
    print(f"  generate seed {a} vs {b}: identical 16 sampled tokens {ta == tb}")

# (b) tie boundary, 200k draws, 3 keys
lt = jnp.asarray([2.0, 1.0, 1.0, 1.0, 0.0], jnp.float32)
pr = np.exp(np.asarray(lt, np.float64))
pr /= pr.sum()
N = 200_000
for p_tie, ref in ((float(pr[0] + 1.5 * pr[1]), np.array([pr[0], pr[1], pr[1]]) / (pr[0] + 2 * pr[1])),
                   (float(pr[0] + 0.5 * pr[1]), np.array([pr[0], pr[1]]) / (pr[0] + pr[1]))):
    draw = jax.jit(lambda k: select_next(jnp.tile(lt[None], (N, 1)), k, greedy=False, temperature=jnp.float32(1),
                                         top_p=jnp.float32(p_tie)))
    m = len(ref)
    for seed in (1, 2, 3):
        c = np.bincount(np.asarray(draw(jax.random.key(seed))), minlength=5)
        print(f"  tie boundary p={p_tie:.6f} key {seed}: counts {c.tolist()} freq {np.round(c[:m] / N, 4).tolist()} "
              f"ref {np.round(ref, 4).tolist()} chi2 p={stats.chisquare(c[:m], ref * N).pvalue:.3g}")
# same with all finite non-tied logits (control)
lt2 = jnp.asarray([2.0, 1.01, 0.99, 1.0, 0.0], jnp.float32)

# (c) temperature below the clamp
for T in (1e-5, 1e-6, 5e-7, 1e-7):
    row = jnp.asarray([[0.0, -1e-6, -2e-6, -1.0]], jnp.float32)
    c = np.bincount(np.asarray(jax.vmap(lambda k: select_next(row, k, greedy=False, temperature=jnp.float32(T),
                                                              top_p=jnp.float32(1))[0])(
        jax.random.split(jax.random.key(0), 20000))), minlength=4)
    x = np.array([0.0, -1e-6, -2e-6, -1.0]) / T
    e = np.exp(x - x.max())
    print(f"  T={T:g}: empirical {np.round(c / 20000, 3).tolist()} vs softmax(logits/T) {np.round(e / e.sum(), 3).tolist()}")
