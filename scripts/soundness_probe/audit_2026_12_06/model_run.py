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

import jax.numpy as jnp
import model_audit

from certattn_jax.policy import CertPolicy as P

f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
CFGS = [
    dict(
        L=2,
        B=2,
        H=2,
        G=2,
        D=32,
        dtype=f32,
        policy=P(block_size=16, group_size=16, k_max=2, hot_slots=4, eps=0.05),
        L0=[20, 47],
        top=1,
    ),
    dict(
        L=1,
        B=2,
        H=1,
        G=8,
        D=64,
        dtype=bf16,
        policy=P(
            block_size=16,
            group_size=32,
            key_bits=4,
            value_bits=2,
            k_max=1,
            tau_cov=0.99,
            eps=0.2,
            hot_refresh="immediate",
        ),
        L0=[5, 33],
        top=1,
    ),
    dict(
        L=2,
        B=2,
        H=2,
        G=1,
        D=64,
        dtype=f16,
        policy=P(block_size=16, group_size=16, k_max=8, eps=0.05, hot_refresh="prefetch"),
        L0=[0, 17],
        top=0,
    ),
    dict(
        L=1,
        B=2,
        H=2,
        G=4,
        D=128,
        dtype=bf16,
        policy=P(block_size=32, group_size=64, value_bits=2, k_max=1, hot_slots=3, eps=0.05),
        L0=[64, 3],
        top=1,
        schedule="two-pass",
    ),
    dict(
        L=2,
        B=2,
        H=1,
        G=2,
        D=32,
        dtype=f32,
        policy=P(block_size=16, group_size=16, key_bits=4, value_bits=2, k_max=1, hot_slots=2, tau_cov=0.999, eps=0.02),
        L0=[31, 16],
        top=1,
    ),
]
fl = sys.argv[1].split(",")
T = int(sys.argv[2])
cis = [int(x) for x in sys.argv[3].split(",")]
seeds = int(sys.argv[4]) if len(sys.argv) > 4 else 1
tag = os.environ.get("CERTATTN_TIER1", "jnp")
tot = {}
for ci in cis:
    kw = CFGS[ci]
    for fam in fl:
        for s in range(seeds):
            t0 = time.time()
            try:
                st = model_audit.run(**kw, T=T, family=fam, seed=5000 + 100 * ci + s)
            except Exception as e:
                print("ERR", ci, fam, s, repr(e)[:400], flush=True)
                continue
            a = tot.setdefault(fam, [0, 0])
            a[0] += st["heads"]
            a[1] += st["viol"]
            print(
                tag,
                ci,
                fam,
                s,
                "T",
                T,
                "heads",
                st["heads"],
                "viol",
                st["viol"],
                "rungs",
                st["rungs"],
                "slow",
                st["slow"],
                f"{time.time() - t0:.0f}s",
                st["examples"][:3],
                flush=True,
            )
print("TOTAL", tag, tot, flush=True)
