"""Cases 2b/2c: after generate, (b) feed a multi-token chunk (a next user turn) into the returned cache with
forward and keep decoding, dense vs certified; (c) rewind the cache with `with_lengths` (drop tokens, e.g. the
post-EOS ones), inside the residual block and across a flushed block, then decode: compared with a dense cache
rewound the same way and with a fresh prefill of the kept tokens."""
from common import *  # noqa: F403

params = params_for()
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)
P = prompts((23, 45))
C = 128


def decode(cache, tok, n):
    toks, certs = [], []
    for _ in range(n):
        lg, cache = fwd(params, CFG, tok[:, None], cache)
        lg = lg[:, -1]
        tok = jnp.argmax(lg, -1).astype(jnp.int32)
        toks.append(np.asarray(tok).tolist())
        if hasattr(cache, "last_certificate"):
            certs.append(np.asarray(cache.last_certificate.error_bound))
    return np.array(toks).T.tolist(), cache, certs, np.asarray(lg)


print("== (b) a ragged multi-token chunk into generate's returned cache, then decode ==")
chunk = np.asarray(prompts((20, 20), seed=3), np.int32)
valid = jnp.asarray([20, 13], jnp.int32)
res = {}
for mode in ("dense", "certified"):
    spec = cache_spec(mode, CFG, jnp.float32, POLICY)
    out = gen.generate(params, CFG, P, 6, cache_factory=spec, capacity=C, progress=False)
    cache = out.cache
    lg, cache = llama.forward(params, CFG, jnp.asarray(chunk), cache, valid_lengths=valid)
    last = np.asarray(lg)[np.arange(2), np.asarray(valid) - 1]
    tok = jnp.asarray(np.argmax(last, -1), jnp.int32)
    toks, cache, certs, _ = decode(cache, tok, 12)
    res[mode] = (out.tokens, toks, np.asarray(cache.lengths).tolist())
    extra = f" max bound {max(float(c.max()) for c in certs):.3g}" if certs else ""
    print(f"[{mode}] lengths after {np.asarray(cache.lengths).tolist()} tokens {toks}{extra}")
print("certified == dense after the chunk:", res["dense"] == res["certified"])

print("== (c) rewind with with_lengths ==")
for mode in ("dense", "certified"):
    spec = cache_spec(mode, CFG, jnp.float32, POLICY)
    out = gen.generate(params, CFG, [P[0]], 20, cache_factory=spec, capacity=C, progress=False)
    full_ids = P[0] + out.tokens[0]
    L = int(out.cache.lengths[0])  # 23 + 19 = 42: blocks 0, 1 flushed (32), residual 10
    for keep in (40, 35, 30, 20):
        o = gen.generate(params, CFG, [P[0]], 20, cache_factory=spec, capacity=C, progress=False)
        cache = o.cache.with_lengths(jnp.asarray([keep], jnp.int32))
        # what keeping `keep` tokens means: the context full_ids[:keep], then the next token full_ids[keep]
        tok = jnp.asarray([full_ids[keep]], jnp.int32)
        r = attempt(f"{mode} rewind {L} -> {keep}, decode 4", lambda: decode(cache, tok, 4))  # noqa
        if isinstance(r, Exception):
            continue
        toks, cache2, certs, lg = r
        ref_cache, _ = gen.prefill(params, CFG, [full_ids[:keep]], C, cache_factory="dense")
        rtoks, _, _, rlg = decode(ref_cache, tok, 4)
        extra = ""
        if certs:
            extra = f"; max error_bound {max(float(c.max()) for c in certs):.3g}, certified all: " \
                    f"{bool(np.all(np.asarray(cache2.last_certificate.certified)))}"
        print(f"    rewound tokens {toks[0]} vs fresh prefill of the kept tokens {rtoks[0]}; "
              f"last-step max|logit diff| {float(np.max(np.abs(lg - rlg))):.3g}{extra}")
