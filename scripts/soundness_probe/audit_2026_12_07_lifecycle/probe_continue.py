"""Cases 2 and 6: continue decoding from generate's returned cache (README's own jitted loop, cache donated) and
compare with one generate call of N+M tokens: tokens, per-step certificates, and the final cache's leaves."""
import sys as _sys

from common import *  # noqa: F403

params = params_for()
N, M = 10, 8
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)
schedules = _sys.argv[1:] or ["looped"]


def leaves_diff(a, b):
    fa = jax.tree_util.tree_flatten_with_path(a)[0]
    fb = jax.tree.leaves(b)
    worst = []
    for (path, x), y in zip(fa, fb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            worst.append((jax.tree_util.keystr(path), "shape", x.shape, y.shape))
            continue
        if x.dtype == bool or np.issubdtype(x.dtype, np.integer):
            n = int(np.sum(x != y))
            if n:
                worst.append((jax.tree_util.keystr(path), "int-diff", n))
        else:
            xf, yf = x.astype(np.float64), y.astype(np.float64)
            same_inf = (xf == yf) | (np.isnan(xf) & np.isnan(yf))
            d = float(np.max(np.where(same_inf, 0, np.abs(xf - yf)))) if x.size else 0.0
            if d > 1e-4:
                worst.append((jax.tree_util.keystr(path), "max|diff|", d))
    return worst


for mode, sched in [("dense", "looped")] + [("certified", s) for s in schedules]:
    spec = cache_spec(mode, CFG, jnp.float32, POLICY, schedule=sched)
    for lens in [(23,), (23, 45)]:
        P = prompts(lens)
        C = max(lens) + N + M + 5  # same capacity for both runs
        full = gen.generate(params, CFG, P, N + M, cache_factory=spec, capacity=C, progress=False, record_steps=True)
        first = gen.generate(params, CFG, P, N, cache_factory=spec, capacity=C, progress=False, record_steps=True)
        cache = first.cache
        print(f"[{mode}/{sched} B={len(lens)}] first call: steps {first.num_steps} cache lengths "
              f"{np.asarray(cache.lengths).tolist()} (prompt + steps - 1 = {[n + first.num_steps - 1 for n in lens]})")
        tok = jnp.asarray([t[-1] for t in first.tokens], jnp.int32)
        toks = [list(t) for t in first.tokens]
        certs = []
        for _ in range(M):
            lg, cache = fwd(params, CFG, tok[:, None], cache)
            tok = jnp.argmax(lg[:, -1], -1).astype(jnp.int32)
            for i, t in enumerate(np.asarray(tok)):
                toks[i].append(int(t))
            if mode == "certified":
                certs.append(cache.last_certificate)
        same = toks == full.tokens
        print(f"[{mode}/{sched} B={len(lens)}] continued tokens == one call of N+M: {same}")
        if not same:
            for i in range(len(lens)):
                print("   cont", toks[i], "\n   full", full.tokens[i])
        if mode == "certified":
            r1, rf = first.step_records, full.step_records
            print(f"   records: first {np.shape(r1.error_bound)} full {np.shape(rf.error_bound)} "
                  f"continued {len(certs)} x {np.shape(certs[0].error_bound)}")
            stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *certs)
            both = jax.tree.map(lambda a, b: np.concatenate([np.asarray(a), b]), r1, stacked)
            print(f"   first-call records == full[:N-1]: {leaves_diff(r1, jax.tree.map(lambda x: x[:N - 1], rf)) or 'same'}")
            print(f"   first + continued records vs full: {leaves_diff(both, rf) or 'same'}")
        print(f"   final cache vs one call's cache: {leaves_diff(cache, full.cache) or 'same'}")
