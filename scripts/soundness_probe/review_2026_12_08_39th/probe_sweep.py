"""Fused (conversion inside the last chunk) vs eager prefill: every cache leaf and the logits, over a sweep."""
import sys
import time

from common import diff, jnp, np, prefilled, prompts

cases = []
for mode in ("certified", "naive"):
    for dtype in (jnp.float32, jnp.bfloat16):
        for lens, cap, chunk in [([53, 21], 96, 64), ([53, 21], 96, 16), ([1], 16, 256), ([1, 1, 1], 16, 8),
                                 ([16, 32], 32, 16), ([32], 32, 32), ([48, 1, 17], 64, 16), ([64], 64, 8),
                                 ([7, 64], 64, 64), ([33], 48, 11)]:
            cases.append((mode, dtype, lens, cap, chunk))
if len(sys.argv) > 1:
    cases = cases[: int(sys.argv[1])]
bad = 0
t0 = time.time()
for i, (mode, dtype, lens, cap, chunk) in enumerate(cases):
    ps = prompts(100 + i, lens)
    a, la = prefilled(True, mode, ps, cap, chunk, dtype=dtype)
    b, lb = prefilled(False, mode, ps, cap, chunk, dtype=dtype)
    d = diff(a, b)
    same_logits = np.asarray(la).tobytes() == np.asarray(lb).tobytes()
    status = "OK" if not d and same_logits else "DIFF"
    bad += status != "OK"
    print(f"{status} mode={mode} dtype={jnp.dtype(dtype).name} lens={lens} cap={cap} chunk={chunk} "
          f"logits_same={same_logits} {d[:4]}", flush=True)
print(f"{bad} of {len(cases)} differ; {time.time() - t0:.0f}s")
