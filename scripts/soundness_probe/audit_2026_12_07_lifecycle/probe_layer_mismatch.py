"""Case 1c: forward (the README loop) with a cache built for another number of layers / heads than the model:
is the mismatch named, or does a traced layer index silently clamp into another layer's cache?"""
from common import *  # noqa: F403

cfg3 = LlamaConfig(**{**CFG.__dict__, "num_layers": 3})
cfg1 = LlamaConfig(**{**CFG.__dict__, "num_layers": 1})
cfg_kv = LlamaConfig(**{**CFG.__dict__, "num_kv_heads": 4})
P = prompts((23,))
fwd = jax.jit(llama.forward, static_argnums=1)  # no donation: the cache is reused below
for cfg_model, label in ((cfg3, "3-layer model, 2-layer cache"), (cfg1, "1-layer model, 2-layer cache"),
                         (cfg_kv, "4-KV-head model, 2-KV-head cache")):
    pm = params_for(cfg_model)
    for mode, sched in (("dense", "auto"), ("naive", "auto"), ("certified", "looped"), ("certified", "unrolled")):
        spec_small = cache_spec(mode, CFG, jnp.float32, POLICY, schedule=sched)  # built for CFG (2 layers)
        spec_right = cache_spec(mode, cfg_model, jnp.float32, POLICY, schedule=sched)

        def run():
            c, lg = gen.prefill(pm, cfg_model, P, 64, cache_factory=spec_right)  # the right cache, for reference
            tok = jnp.argmax(lg, -1).astype(jnp.int32)[:, None]
            good, _ = fwd(pm, cfg_model, tok, c)
            # the wrong cache: prefilled with the README recipe (staging -> from_staging), all through forward
            st = spec_small.staging(1, 64)
            _, st = fwd(pm, cfg_model, jnp.asarray(P), st)
            wrong = spec_small.from_staging(st)
            bad, _ = fwd(pm, cfg_model, tok, wrong)
            return f"ran silently; max|logits - right cache| = {float(np.max(np.abs(np.asarray(bad) - np.asarray(good)))):.3g}"
        attempt(f"{label} [{mode}/{sched}]", run)

print("== decode steps (T = 1) of a 3-layer model straight into an empty 2-layer tiered cache ==")
pm = params_for(cfg3)
for mode, sched in (("naive", "auto"), ("certified", "looped"), ("certified", "straight-looped"),
                    ("certified", "unrolled")):
    spec_small = cache_spec(mode, CFG, jnp.float32, POLICY, schedule=sched)
    spec_right = cache_spec(mode, cfg3, jnp.float32, POLICY, schedule=sched)

    def run():
        good_c, bad_c = spec_right(1, 64), spec_small(1, 64)
        diffs = []
        for t in P[0][:6]:
            tok = jnp.asarray([[t]], jnp.int32)
            g, good_c = fwd(pm, cfg3, tok, good_c)
            b, bad_c = fwd(pm, cfg3, tok, bad_c)
            diffs.append(float(np.max(np.abs(np.asarray(b) - np.asarray(g)))))
        return "ran silently; per-step max|logits - right cache| " + ", ".join(f"{d:.2g}" for d in diffs)
    attempt(f"3-layer model, empty 2-layer cache, 6 decode steps [{mode}/{sched}]", run)
