"""Does XLA run a decode step's many small kernels as CUDA graphs (command buffers) here, and what does a launch cost?

    PYTHONPATH=. python scripts/probe_cmdbuf.py --out results/probe_cmdbuf.json   # every flag setting, a process each
    PYTHONPATH=. python scripts/probe_cmdbuf.py --smoke                           # tiny, CPU: checks the script runs

docs/performance.md (2026-12-02): the certified SmolLM2 step keeps the H200 busy 1.6 of its 3.4 ms even with no
conditional in its fast pass (schedule "straight"): ~3.5 µs of host time per kernel, as if no kernel ran inside
a graph. This probe times the same kind of code in isolation: per step, `bodies` small dependent bodies of two
kernels each (a row reduction, then an elementwise update on a [rows, width] float32 array), in three forms:

  straight         the bodies unrolled (straight-line code, what the "straight" schedule's fast pass is)
  straight_pallas  the same with a one-program Pallas kernel (a custom call) in every 4th body
  looped           the bodies in a `fori_loop` (a while loop, what the "looped" schedule is)

µs per body, device-timed as (t(n2) - t(n1)) / ((n2 - n1) * bodies) inside one jit (median of reps), under
each XLA flag setting in its own process (XLA reads its flags once): the default, command buffers off, and
command buffers for fusions and custom calls (with and without WHILE / CONDITIONAL). Equal times with and
without command buffers mean the default does not capture these kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "default": "",
    "off": "--xla_gpu_enable_command_buffer=",
    "fusion_custom": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
    "fusion_custom_control": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,"
                             "CONDITIONAL",
}
FORMS = ("straight", "straight_pallas", "looped")


def _measure(args: argparse.Namespace) -> dict:
    """Run in a child process: time every form under this process's XLA_FLAGS."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    interpret = jax.default_backend() == "cpu"

    def bump_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 0.999 + 0.001

    def bump(x):
        return pl.pallas_call(bump_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)

    def body(j, x, pallas):
        x = x + jnp.sum(x, axis=1, keepdims=True) * 1e-4 + j * 1e-6  # a reduction, then an elementwise kernel
        return bump(x) if pallas and j % 4 == 3 else jnp.tanh(x)

    def step(x, form):
        if form == "looped":
            return jax.lax.fori_loop(0, args.bodies, lambda j, x: body(j, x, False), x)
        for j in range(args.bodies):
            x = body(j, x, form == "straight_pallas")
        return x

    def program(form, n):
        return jax.jit(lambda x: jax.lax.fori_loop(0, n, lambda i, x: step(x, form), x))

    x0 = jnp.ones((args.rows, args.width), jnp.float32)
    out = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "forms": {}}
    for form in FORMS:
        times = {}
        for n in (args.n1, args.n2):
            f = program(form, n)
            t0 = time.perf_counter()
            f(x0).block_until_ready()
            compile_s = time.perf_counter() - t0
            reps = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                f(x0).block_until_ready()
                reps.append(time.perf_counter() - t0)
            times[n] = (sorted(reps)[len(reps) // 2], compile_s)
        per_body = (times[args.n2][0] - times[args.n1][0]) / ((args.n2 - args.n1) * args.bodies)
        out["forms"][form] = {"us_per_body": round(per_body * 1e6, 3),
                              "compile_s": round(times[args.n2][1], 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bodies", type=int, default=100)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--n1", type=int, default=5)
    ap.add_argument("--n2", type=int, default=25)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.bodies, args.n1, args.n2, args.reps, args.settings = 4, 1, 2, 1, ["default"]
    if args.child:
        print(json.dumps(_measure(args)))
        return
    rows = {}
    for name in args.settings:
        env = dict(os.environ, XLA_FLAGS=SETTINGS[name])
        cmd = [sys.executable, __file__, "--child", "--bodies", str(args.bodies), "--rows", str(args.rows),
               "--width", str(args.width), "--n1", str(args.n1), "--n2", str(args.n2), "--reps", str(args.reps)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode:
            rows[name] = {"error": p.stderr[-2000:], "xla_flags": SETTINGS[name]}
        else:
            rows[name] = json.loads(p.stdout.strip().splitlines()[-1])
        print(name, json.dumps(rows[name]), flush=True)
    result = {"bodies": args.bodies, "rows": args.rows, "width": args.width, "n1": args.n1, "n2": args.n2,
              "reps": args.reps, "settings": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
