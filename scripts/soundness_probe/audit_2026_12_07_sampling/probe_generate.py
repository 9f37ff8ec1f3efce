"""Probes 3-4: generate's batch invariance (greedy, dense and certified eps=1e-6), seeds, batch-composition dependence
of sampling, stop tokens, finished flags and num_steps. Tiny random model of tests/test_llama_core.py."""
import sys

from common import CFG, POLICY, attempt, gen, jax, jnp, llama, np, params_for, prompts  # noqa: F401

P = params_for()
NEW = 20
CERT = POLICY.replace(eps=1e-6)
MODES = {"dense": dict(cache_factory="dense"), "certified": dict(cache_factory="certified", policy=CERT)}
which = sys.argv[1:] or ["batch", "seeds", "stops"]


def g(ps, n=NEW, mode="dense", **kw):
    kw.setdefault("eos_token_ids", ())
    return gen.generate(P, CFG, ps, n, progress=False, **MODES[mode], **kw)


def margin_report(prompt, toks, step):
    """top-1 minus top-2 logit (dense forward) at the step where two runs diverged."""
    seq = jnp.asarray([prompt + toks[:step]], jnp.int32)
    logits, _ = llama.forward(P, CFG, seq)
    last = np.sort(np.asarray(logits[0, -1]))[::-1]
    return float(last[0] - last[1])


if "batch" in which:
    print("== 3a. greedy batch invariance (ragged prompts; 250-token prompt lifts the capacity to 512) ==")
    ps = prompts((5, 23, 1, 40, 250), seed=11)
    for mode in MODES:
        alone = [g([p], mode=mode).tokens[0] for p in ps]
        batch = g(ps, mode=mode)
        rev = g(ps[::-1], mode=mode)
        for i, p in enumerate(ps):
            same_b = batch.tokens[i] == alone[i]
            same_r = rev.tokens[len(ps) - 1 - i] == alone[i]
            extra = ""
            if not (same_b and same_r):
                other = batch.tokens[i] if not same_b else rev.tokens[len(ps) - 1 - i]
                d = next(k for k in range(NEW) if other[k] != alone[i][k])
                extra = f" first diff at token {d}, dense top-2 logit margin there {margin_report(p, alone[i], d):.3g}"
            print(f"  {mode:9s} prompt len {len(p):3d}: batch==alone {same_b}, reversed batch==alone {same_r}{extra}")
        print(f"  {mode:9s} batch num_steps={batch.num_steps} finished={batch.finished}")
    d_alone = [g([p]).tokens[0] for p in ps]
    c_alone = [g([p], mode="certified").tokens[0] for p in ps]
    print(f"  certified(eps=1e-6) == dense, per prompt alone: {[a == b for a, b in zip(d_alone, c_alone)]}")
    # batch of duplicates; batch padded with a long prompt in chunks
    dup = g([ps[1]] * 3)
    print(f"  3 copies of one prompt -> identical rows: {all(t == d_alone[1] for t in dup.tokens)}")
    ch = g(ps, prefill_chunk=8)
    print(f"  prefill_chunk=8 batch == alone: {[a == b for a, b in zip(ch.tokens, d_alone)]}")

if "seeds" in which:
    print("== 3b. seeds and batch composition (temperature 1.0, top_p 0.9) ==")
    ps = prompts((5, 23, 12), seed=3)
    kw = dict(temperature=1.0, top_p=0.9)
    a = g([ps[0]], seed=1, **kw).tokens[0]
    b = g([ps[0]], seed=1, **kw).tokens[0]
    c = g([ps[0]], seed=2, **kw).tokens[0]
    print(f"  same seed same tokens: {a == b}; seed 1 vs 2 differ: {a != c} (tokens equal at "
          f"{sum(x == y for x, y in zip(a, c))}/{NEW} positions)")
    for mode in MODES:
        alone = [g([p], mode=mode, seed=5, **kw).tokens[0] for p in ps]
        batch = g(ps, mode=mode, seed=5, **kw).tokens
        swapped = g([ps[1], ps[0], ps[2]], mode=mode, seed=5, **kw).tokens
        pair = g(ps[:2], mode=mode, seed=5, **kw).tokens
        print(f"  {mode}: prompt0 alone==row0 of batch3 {alone[0] == batch[0]}, ==row0 of batch2 {alone[0] == pair[0]},"
              f" ==row1 of swapped batch {alone[0] == swapped[1]}")
        print(f"  {mode}: prompt1 alone==row1 of batch3 {alone[1] == batch[1]}, ==row0 of swapped {alone[1] == swapped[0]}"
              f"; prompt2 alone==row2 of batch3 {alone[2] == batch[2]}")
        print(f"  {mode}: row1 batch3 == row1 batch2 (same position, other batch size) {batch[1] == pair[1]}")
    # seed edge values
    attempt("seed=-1", lambda: g([ps[0]], n=4, seed=-1, **kw).tokens)
    attempt("seed=2**63-1", lambda: g([ps[0]], n=4, seed=2 ** 63 - 1, **kw).tokens)
    attempt("seed=2**63", lambda: g([ps[0]], n=4, seed=2 ** 63, **kw).tokens)
    attempt("seed=2**32 vs 0 equal?", lambda: g([ps[0]], n=8, seed=2 ** 32, **kw).tokens[0] == g([ps[0]], n=8, seed=0, **kw).tokens[0])
    attempt("seed=np.int64(7) == 7", lambda: g([ps[0]], n=8, seed=np.int64(7), **kw).tokens == g([ps[0]], n=8, seed=7, **kw).tokens)
    # temperature tiny vs greedy; top_p tiny vs greedy
    gr = g([ps[1]]).tokens[0]
    attempt("temperature 1e-5 == greedy", lambda: g([ps[1]], temperature=1e-5, seed=9).tokens[0] == gr)
    attempt("top_p 1e-9 (T=1) == greedy", lambda: g([ps[1]], temperature=1.0, top_p=1e-9, seed=9).tokens[0] == gr)
    attempt("temperature -0.0 (greedy?)", lambda: g([ps[1]], temperature=-0.0).tokens[0] == gr)
    attempt("temperature 1e-320 (denormal, > 0)", lambda: g([ps[1]], temperature=1e-320).tokens[0] == gr)
    attempt("temperature np.float32(0.5)", lambda: len(g([ps[1]], temperature=np.float32(0.5)).tokens[0]))
    attempt("temperature jnp 0.5", lambda: len(g([ps[1]], temperature=jnp.float32(0.5)).tokens[0]))
    attempt("top_p 0", lambda: g([ps[1]], temperature=1.0, top_p=0.0))
    attempt("top_p 1.5", lambda: g([ps[1]], temperature=1.0, top_p=1.5))
    attempt("temperature nan", lambda: g([ps[1]], temperature=float("nan")))
    attempt("temperature inf", lambda: g([ps[1]], temperature=float("inf")))
    attempt("temperature -1", lambda: g([ps[1]], temperature=-1.0))
    attempt("temperature True", lambda: g([ps[1]], temperature=True))

if "stops" in which:
    print("== 4. stop tokens, finished, num_steps ==")
    ps = prompts((9, 30), seed=5)
    for mode in MODES:
        ref = g(ps, mode=mode)
        t0, t1 = ref.tokens
        print(f"  {mode}: no-eos run: tokens0={t0[:8]}... tokens1={t1[:8]}... num_steps={ref.num_steps} "
              f"finished={ref.finished}")

        def show(label, out, exp_tokens=None, exp_fin=None, exp_steps=None):
            ok = []
            if exp_tokens is not None:
                ok.append(out.tokens == exp_tokens)
            if exp_fin is not None:
                ok.append(out.finished == exp_fin)
            if exp_steps is not None:
                ok.append(out.num_steps == exp_steps)
            flag = "" if all(ok) else "   <-- UNEXPECTED"
            print(f"  {mode} {label}: lens={[len(t) for t in out.tokens]} finished={out.finished} "
                  f"num_steps={out.num_steps} expected lens={None if exp_tokens is None else [len(t) for t in exp_tokens]}"
                  f" fin={exp_fin} steps={exp_steps}{flag}")

        e0 = t0[0]
        if e0 in t1:
            k1 = t1.index(e0)
            exp = [[], t1[:k1]]
            show("eos = seq0's first token", g(ps, mode=mode, eos_token_ids=(e0,)), exp, [True, True], k1 + 1)
        else:
            show("eos = seq0's first token", g(ps, mode=mode, eos_token_ids=(e0,)), [[], t1], [True, False], NEW)
        # both sequences' first token as eos
        show("eos = both first tokens", g(ps, mode=mode, eos_token_ids=(t0[0], t1[0])), [[], []], [True, True], 1)
        # multiple eos ids: the 3rd token of seq0 and the 5th of seq1 (the earliest hit counts)
        ids = (t0[2], t1[4])

        def cut(t):
            k = next((i for i, x in enumerate(t) if x in ids), None)
            return (t, False) if k is None else (t[:k], True)

        (c0, f0), (c1, f1) = cut(t0), cut(t1)
        steps = NEW if not (f0 and f1) else max(len(c0), len(c1)) + 1
        show(f"multiple eos {ids}", g(ps, mode=mode, eos_token_ids=ids), [c0, c1], [f0, f1], steps)
        show("multiple eos as numpy array + duplicates", g(ps, mode=mode, eos_token_ids=np.array(ids + ids)),
             [c0, c1], [f0, f1], steps)
        show("max_new_tokens=1", g(ps, n=1, mode=mode), [[t0[0]], [t1[0]]], [False, False], 1)
        show("max_new_tokens=1, eos=seq0 first", g(ps, n=1, mode=mode, eos_token_ids=(t0[0],)),
             [[], [t1[0]] if t1[0] != t0[0] else []], [True, t1[0] == t0[0]], 1)
        # eos as exactly the last allowed token (max_new = k+1 where t0[k] is the eos)
        k = 3
        if t0[k] not in t0[:k]:
            out = g([ps[0]], n=k + 1, mode=mode, eos_token_ids=(t0[k],))
            show(f"eos = the last allowed token (max_new={k + 1})", out, [t0[:k]], [True], k + 1)
            out = g([ps[0]], n=k, mode=mode, eos_token_ids=(t0[k],))
            show(f"eos one past max_new (max_new={k})", out, [t0[:k]], [False], k)
        # prompt of length 1
        one = g([[ps[0][0]]], mode=mode)
        print(f"  {mode} prompt length 1: {len(one.tokens[0])} tokens, num_steps={one.num_steps}")
        # capacity bucket boundary: prompt + new == 256 exactly, and 257
        for L, n in ((256 - NEW, NEW), (255, 1), (256, 1), (236, 21)):
            p = prompts((L,), seed=L)[0]
            o_auto = g([p], n=n, mode=mode)
            o_big = g([p], n=n, mode=mode, capacity=1024)
            cap = o_auto.cache.capacity if hasattr(o_auto.cache, "capacity") else "?"
            print(f"  {mode} prompt {L} + new {n} = {L + n}: auto capacity {cap}; tokens == capacity 1024's "
                  f"{o_auto.tokens == o_big.tokens}; lens {len(o_auto.tokens[0])}, num_steps {o_auto.num_steps}")
        attempt(f"{mode} capacity = need - 1", lambda: g([ps[0]], n=5, mode=mode, capacity=len(ps[0]) + 4))
        attempt(f"{mode} capacity = need exactly", lambda: g([ps[0]], n=5, mode=mode, capacity=len(ps[0]) + 5).tokens)
    # bad eos values
    attempt("eos int", lambda: g(ps, n=2, eos_token_ids=5))
    attempt("eos out of vocab", lambda: g(ps, n=2, eos_token_ids=(96,)))
    attempt("eos negative", lambda: g(ps, n=2, eos_token_ids=(-1,)))
    attempt("eos jnp array", lambda: g(ps, n=2, eos_token_ids=jnp.array([3, 4])).tokens)
    attempt("eos empty list (no stop)", lambda: [len(t) for t in g(ps, n=4, eos_token_ids=[]).tokens])
    attempt("eos None -> config.eos_token_ids (=())", lambda: [len(t) for t in g(ps, n=4, eos_token_ids=None).tokens])
    attempt("max_new_tokens 0", lambda: g(ps, n=0))
    attempt("max_new_tokens -3", lambda: g(ps, n=-3))
    attempt("max_new_tokens 2.0", lambda: g(ps, n=2.0))
    attempt("max_new_tokens np.int64(2)", lambda: g(ps, n=np.int64(2)).num_steps)
    attempt("max_new beyond context", lambda: g(ps, n=2048))
