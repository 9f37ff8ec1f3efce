"""Case 7b: one weight of one layer in another dtype: dense/naive accept it, certified (looped layers) fails inside
tracing; where, and with which schedule."""
import traceback

from common import *  # noqa: F403

p32 = params_for()
mixed = {**p32, "layers": [{**p32["layers"][0], "wk": p32["layers"][0]["wk"].astype(jnp.bfloat16)}] + p32["layers"][1:]}
P = prompts((23,))
for mode, sched in [("naive", "auto"), ("certified", "looped"), ("certified", "unrolled")]:
    spec = cache_spec(mode, CFG, jnp.float32, POLICY, schedule=sched)
    try:
        out = gen.generate(mixed, CFG, P, 4, cache_factory=spec, progress=False)
        print(f"[{mode}/{sched}] OK {out.tokens}")
    except Exception as e:  # noqa: BLE001
        tb = traceback.extract_tb(e.__traceback__)
        ours = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in tb if "/work/main/" in f.filename
                and "audit" not in f.filename][-4:]
        print(f"[{mode}/{sched}] RAISED {type(e).__name__}: {str(e).splitlines()[0][:200]}\n    last library frames: {ours}")
