"""Case 2c focus: a certified cache rewound with `with_lengths` below its flushed blocks, then decoded: per step,
logits against a fresh dense prefill of the kept tokens (teacher-forced with the same tokens), and the step's
certificates. Also the cache's `flushed` field vs the new lengths."""
from common import *  # noqa: F403

params = params_for()
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)
P = prompts((23,))
C = 128
spec = cache_spec("certified", CFG, jnp.float32, POLICY)
base = gen.generate(params, CFG, P, 30, cache_factory=spec, capacity=C, progress=False)
ids = P[0] + base.tokens[0]  # 53 tokens; the cache holds 52
for keep in (33, 30, 20, 10):
    o = gen.generate(params, CFG, P, 30, cache_factory=spec, capacity=C, progress=False)
    L = int(o.cache.lengths[0])
    cache = o.cache.with_lengths(jnp.asarray([keep], jnp.int32))
    print(f"rewind {L} -> {keep}: store.flushed {np.asarray(cache.store.flushed)[:, 0].tolist()} "
          f"store.lengths {np.asarray(cache.store.lengths)[:, 0].tolist()} model lengths {cache.lengths.tolist()}")
    ref, _ = gen.prefill(params, CFG, [ids[:keep]], C, cache_factory="dense")
    rows = []
    for s in range(8):  # teacher-forced: feed the true next tokens to both
        t = jnp.asarray([[ids[keep + s]]], jnp.int32)
        lg, cache = fwd(params, CFG, t, cache)
        rlg, ref = fwd(params, CFG, t, ref)
        cert = cache.last_certificate
        rows.append(f"{float(np.max(np.abs(np.asarray(lg) - np.asarray(rlg)))):.2g}"
                    f"/{float(np.max(np.asarray(cert.error_bound))):.2g}"
                    f"/{'all-cert' if bool(np.all(np.asarray(cert.certified))) else 'NOT-all-cert'}")
    print("   per step max|logit - fresh dense| / max error_bound / certified:", rows)
