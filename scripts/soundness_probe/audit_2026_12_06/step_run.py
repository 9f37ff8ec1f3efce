# ruff: noqa: E402  (the sys.path setup above the imports: run as a script from anywhere)
"""Thirtieth-session soundness audit probe (docs/performance.md, thirtieth session); see README.md here."""

import os as _os
import sys as _sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_ROOT = _os.path.abspath(_os.path.join(_HERE, "..", "..", ".."))
for _p in (_ROOT, _os.path.join(_ROOT, "tests"), _os.path.join(_ROOT, "scripts", "soundness_probe"), _HERE):
    if _p not in _sys.path:
        _sys.path.insert(0, _p)
import os
import sys
import time

import audit2
import jax.numpy as jnp
import numpy as np

from certattn_jax.policy import CertPolicy as P

f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
CFGS = [
    (2, 2, 2, 32, f32, f32, P(block_size=16, group_size=16, key_bits=8, value_bits=4, k_max=2, eps=0.05), [40, 7]),
    (
        1,
        1,
        8,
        64,
        bf16,
        f32,
        P(block_size=32, group_size=32, key_bits=4, value_bits=2, k_max=1, eps=0.5, tau_cov=0.99),
        [70],
    ),
    (2, 2, 1, 64, f16, bf16, P(block_size=16, group_size=64, key_bits=8, value_bits=4, k_max=8, eps=0.05), [50, 17]),
    (
        1,
        1,
        8,
        128,
        f16,
        f16,
        P(block_size=16, group_size=16, key_bits=4, value_bits=2, k_max=1, eps=0.2, tau_cov=0.999),
        [48],
    ),
    (2, 2, 1, 128, bf16, bf16, P(block_size=32, group_size=64, key_bits=8, value_bits=2, k_max=8, eps=0.05), [65, 30]),
    (
        1,
        1,
        8,
        64,
        f16,
        bf16,
        P(block_size=16, group_size=64, key_bits=4, value_bits=2, k_max=8, eps=0.3, tau_cov=0.999),
        [80],
    ),
    (
        2,
        1,
        8,
        128,
        bf16,
        f16,
        P(block_size=32, group_size=32, key_bits=4, value_bits=2, k_max=1, eps=0.3, tau_cov=0.98),
        [96, 41],
    ),
    (
        2,
        1,
        2,
        32,
        f32,
        bf16,
        P(block_size=16, group_size=32, key_bits=4, value_bits=4, k_max=1, eps=0.05, abs_tol=1e-3),
        [33, 64],
    ),
]
fl = sys.argv[1].split(",")
T = int(sys.argv[2])
cis = [int(x) for x in sys.argv[3].split(",")]
seeds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
tag = os.environ.get("CERTATTN_TIER1", "jnp")
tot = {}
for ci in cis:
    B, H, G, D, dt, qdt, pol, L0 = CFGS[ci]
    for fam in fl:
        for s in range(seeds):
            t0 = time.time()
            try:
                st = audit2.run_config(
                    B=B,
                    H=H,
                    G=G,
                    D=D,
                    dtype=dt,
                    qdtype=qdt,
                    policy=pol,
                    L0=L0,
                    T=T,
                    family=fam,
                    seed=1000 * ci + s + 77,
                )
            except Exception as e:
                print("ERR", ci, fam, s, repr(e)[:300], flush=True)
                continue
            r = np.asarray(st["ratios"])
            a = tot.setdefault(fam, [0, 0])
            a[0] += st["heads"]
            a[1] += st["viol"]
            print(
                tag,
                ci,
                fam,
                s,
                "heads",
                st["heads"],
                "viol",
                st["viol"],
                "rungs",
                st["rungs"],
                "minratio",
                r.min() if len(r) else None,
                f"{time.time() - t0:.0f}s",
                st["examples"][:2],
                flush=True,
            )
print("TOTAL", tag, tot, flush=True)
