"""Case 1: capacity. generate's up-front checks; forward eager and jitted (donated) at / past capacity;
batch 2 ragged where only one sequence overflows, dense and certified; the cache passed in after an error."""
import dataclasses

from common import *  # noqa: F403

params = params_for()
P = prompts((20,))
small = dataclasses.replace(CFG, max_position_embeddings=64)

print("== generate: up-front checks ==")
attempt("generate dense prompt20+12 capacity=32 (exact)",
        lambda: gen.generate(params, CFG, P, 12, capacity=32, progress=False).tokens[0][:4])
attempt("generate dense prompt20+12 capacity=31 (one short)",
        lambda: gen.generate(params, CFG, P, 12, capacity=31, progress=False))
attempt("generate certified prompt20+12 capacity=31 (one short; tiered would round to 32)",
        lambda: gen.generate(params, CFG, P, 12, capacity=31, cache_factory="certified", policy=POLICY,
                             progress=False))
attempt("generate max_pos=64: prompt 63 + 1 (exactly at context)",
        lambda: len(gen.generate(params, small, prompts((63,)), 1, progress=False).tokens[0]))
attempt("generate max_pos=64: prompt 63 + 2 (one past context)",
        lambda: gen.generate(params, small, prompts((63,)), 2, progress=False))
attempt("generate max_pos=64: prompt 20 + 10**6 (much past)",
        lambda: gen.generate(params, small, P, 10 ** 6, progress=False))
attempt("generate max_pos=64 ragged [60, 10] + 5 (only seq 0 overflows)",
        lambda: gen.generate(params, small, prompts((60, 10)), 5, progress=False))
attempt("prefill() prompt 33 into capacity 32",
        lambda: gen.prefill(params, CFG, prompts((33,)), 32))
attempt("prefill() certified prompt 33 into capacity 20 (staging rounds to 32)",
        lambda: gen.prefill(params, CFG, prompts((33,)), 20, cache_factory="certified", policy=POLICY))
attempt("prefill() certified prompt 30 into capacity 20 (staging rounds to 32)",
        lambda: gen.prefill(params, CFG, prompts((30,)), 20, cache_factory="certified", policy=POLICY)[0].capacity)

# a user cache_factory that returns a too-small cache
spec = cache_spec("dense", CFG, jnp.float32)
attempt("generate cache_factory returning capacity 16 for need 32",
        lambda: gen.generate(params, CFG, P, 12, cache_factory=lambda b, c: spec(b, 16), progress=False))

print("== forward eagerly at / past capacity ==")
for mode in ("dense", "certified"):
    s = cache_spec(mode, CFG, jnp.float32, POLICY)
    st = s.staging(2, 32)
    ids = np.asarray(prompts((32, 32)), np.int32)
    # exactly at capacity: 32 tokens into 32
    lg, st2 = llama.forward(params, CFG, jnp.asarray(ids), st)
    print(f"[{mode}] prefill exactly at capacity: lengths {np.asarray(st2.lengths).tolist()} finite "
          f"{bool(np.isfinite(np.asarray(lg)).all())}")
    c = s.from_staging(st2)
    attempt(f"{mode} forward eager 1 token past capacity",
            lambda: llama.forward(params, CFG, jnp.asarray([[1], [2]]), c))
    print(f"[{mode}] after the error: cache alive {alive(c)} lengths {np.asarray(c.lengths).tolist()}")
    attempt(f"{mode} prefill eager 33 tokens into capacity 32",
            lambda: llama.forward(params, CFG, jnp.asarray(np.asarray(prompts((33, 33)), np.int32)), s.staging(2, 32)))

print("== jitted, donated (README's own loop): ragged batch, only seq 0 overflows ==")
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)
for mode in ("dense", "naive", "certified"):
    s = cache_spec(mode, CFG, jnp.float32, POLICY)
    # seq 0: 30 tokens, seq 1: 10 tokens; capacity 32; decode 6 steps: seq 0 reaches 36 (overflow at step 3)
    pr = prompts((30, 10))
    cache, logits = gen.prefill(params, CFG, pr, 32, cache_factory=s)
    # reference for seq 1 alone (batch 1, same capacity)
    ref_cache, ref_logits = gen.prefill(params, CFG, [pr[1]], 32, cache_factory=s)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    rtok = jnp.argmax(ref_logits, -1).astype(jnp.int32)
    rows = []
    for step in range(6):
        old = cache
        lg, cache = fwd(params, CFG, tok[:, None], cache)
        rlg, ref_cache = fwd(params, CFG, rtok[:, None], ref_cache)
        lg, rlg = np.asarray(lg[:, -1]), np.asarray(rlg[:, -1])
        rows.append((step, np.asarray(cache.lengths).tolist(), bool(np.isfinite(lg[0]).all()),
                     bool(np.isfinite(lg[1]).all()), float(np.max(np.abs(lg[1] - rlg[0]))),
                     "old deleted" if not alive(old) else "old ALIVE"))
        nxt = np.argmax(np.where(np.isfinite(lg), lg, -np.inf), -1)
        tok = jnp.asarray(nxt, jnp.int32)
        rtok = jnp.argmax(jnp.asarray(rlg), -1).astype(jnp.int32)
    for r in rows:
        print(f"[{mode}] step {r[0]} lengths {r[1]} seq0 finite {r[2]} seq1 finite {r[3]} "
              f"|seq1 - alone| {r[4]:.2e} {r[5]}")
    if mode == "certified":
        cert = cache.last_certificate
        eb = np.asarray(cert.error_bound)
        print(f"[{mode}] last cert error_bound seq0 {eb[:, 0].ravel()[:4]} seq1 {eb[:, 1].ravel()[:4]}")
