"""Case 7: params and cache in different dtypes (generate with a CacheSpec of another dtype; the README loop)."""
from common import *  # noqa: F403

from models.params import cast_params

p32 = params_for()
p16 = cast_params(p32, jnp.bfloat16)
P = prompts((23, 45))
N = 10
runs = {}
for pname, p in (("f32", p32), ("bf16", p16)):
    for cdt in ("float32", "bfloat16", "float16"):
        for mode in ("dense", "certified"):
            spec = cache_spec(mode, CFG, jnp.dtype(cdt), POLICY)
            label = f"params {pname} / {mode} cache {cdt}"
            r = attempt(label, lambda: gen.generate(p, CFG, P, N, cache_factory=spec, progress=False,
                                                    record_steps=True))
            if not isinstance(r, Exception):
                runs[(pname, cdt, mode)] = r
                extra = ""
                if mode == "certified":
                    rec = r.step_records
                    extra = (f" max bound {float(np.max(rec.error_bound)):.2e}, certified "
                             f"{float(np.mean(rec.certified)):.3f}, cache store dtype {r.cache.store.dtype}")
                print(f"    tokens {r.tokens[0][:6]}.. {r.tokens[1][:6]}..{extra}")
for pname in ("f32", "bf16"):
    for cdt in ("float32", "bfloat16", "float16"):
        d, c = runs.get((pname, cdt, "dense")), runs.get((pname, cdt, "certified"))
        if d and c:
            print(f"params {pname}, cache {cdt}: certified tokens == dense tokens (same cache dtype): "
                  f"{d.tokens == c.tokens}; == the model's own-dtype dense: {runs[(pname, 'float32' if pname == 'f32' else 'bfloat16', 'dense')].tokens == c.tokens}")

# params whose leaves mix dtypes
mixed = {**p32, "embed": p32["embed"].astype(jnp.bfloat16)}
attempt("params with embed bf16, layers f32 (generate)", lambda: gen.generate(mixed, CFG, P, 4, progress=False).tokens)
mixed2 = {**p32, "layers": [{**p32["layers"][0], "wk": p32["layers"][0]["wk"].astype(jnp.bfloat16)}] + p32["layers"][1:]}
attempt("params with one layer's wk bf16 (generate)", lambda: gen.generate(mixed2, CFG, P, 4, progress=False).tokens)
attempt("params with one layer's wk bf16 (certified)",
        lambda: gen.generate(mixed2, CFG, P, 4, cache_factory="certified", policy=POLICY, progress=False).tokens)

# README loop: bf16 params, float32 certified cache from a bf16 staging cache -> from_staging refuses?
spec32 = cache_spec("certified", CFG, jnp.float32, POLICY)
spec16 = cache_spec("certified", CFG, jnp.bfloat16, POLICY)
st = spec16.staging(1, 64)
_, st = llama.forward(p16, CFG, jnp.asarray([P[0]]), st)
attempt("spec(float32).from_staging(bf16 staging)", lambda: spec32.from_staging(st))
