"""What does a `lax.cond` / `lax.switch` cost inside a decode loop on this device? (docs/performance.md)

    PYTHONPATH=. python scripts/probe_conditionals.py --out results/probe_conditionals.json
    PYTHONPATH=. python scripts/probe_conditionals.py --smoke        # tiny, CPU: checks the script runs

The certified step has a few conditionals per layer (rung 1, the hot-set fetch, the layer switches of the
looped schedule); on the H200 the 60 switches of a SmolLM2 step cost ~1.2 ms (~20 µs each), which is what made
the weight placement depend on the layer size. This probe isolates that cost: `layers` small "layer bodies"
(a few dependent elementwise/reduction fusions on a [rows, width] array, like the certified step's glue) run
in a `fori_loop` over layers, inside a `fori_loop` of steps, in five forms:

  plain       the bodies alone
  cond_false  plus one `lax.cond` per layer whose (data-dependent) predicate is false: the rare rung
  cond_true   the same with a true predicate (the branch runs one more body)
  switch      the body inside a `lax.switch` over the layer index with `layers` branches (the looped schedule)
  where       the rare branch computed always and selected with `jnp.where` (no conditional at all)

Per form: µs per layer-step, device-timed as (t(n2) - t(n1)) / (n2 - n1) steps in one jit (median of reps),
and the conditional's cost = form - plain. Run it under different XLA_FLAGS (recorded) to compare, e.g.
`--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _device_timing import per_call_us  # noqa: E402

FORMS = ("plain", "cond_false", "cond_true", "switch", "where")


def _body(x: jax.Array, i: jax.Array) -> jax.Array:
    """A few dependent small fusions: normalize, a row reduction, a broadcast update."""
    y = jnp.tanh(x * 1.0001 + i.astype(x.dtype) * 1e-3)
    m = jnp.max(y, axis=-1, keepdims=True)
    z = jnp.exp(y - m)
    return z / jnp.sum(z, axis=-1, keepdims=True) + x * 0.5


def make_step(form: str, layers: int):
    """One decode step: `layers` bodies in a fori_loop, with the form's conditional per layer."""
    branches = [lambda x, k=k: _body(x, jnp.int32(k)) for k in range(layers)]

    def layer(i, x):
        if form == "switch":
            return jax.lax.switch(i, branches, x)
        x = _body(x, i)
        if form == "plain":
            return x
        pred = jnp.sum(x) < (-1e30 if form == "cond_false" else 1e30)  # data-dependent, known by value only
        if form == "where":
            return jnp.where(pred, _body(x, i + 1), x)
        return jax.lax.cond(pred, lambda x: _body(x, i + 1), lambda x: x, x)

    return lambda x: jax.lax.fori_loop(0, layers, layer, x)


def time_form(form: str, layers: int, rows: int, width: int, n1: int, n2: int, reps: int) -> float:
    """µs per layer-step of `form`."""
    step = make_step(form, layers)
    x0 = jax.random.normal(jax.random.key(0), (rows, width), jnp.float32)

    def make(n):
        f = jax.jit(lambda x: jax.lax.fori_loop(0, n, lambda _, x: step(x), x))
        return lambda: f(x0)

    us, _ = per_call_us(make, n1, n2, reps)
    return us / layers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--n1", type=int, default=10)
    ap.add_argument("--n2", type=int, default=60)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.rows, args.width, args.n1, args.n2, args.reps = 3, 2, 16, 1, 3, 1
    dev = jax.devices()[0]
    rows = []
    for form in FORMS:
        us = time_form(form, args.layers, args.rows, args.width, args.n1, args.n2, args.reps)
        rows.append({"form": form, "us_per_layer_step": us})
        print(f"{form:11s} {us:9.2f} µs per layer-step", flush=True)
    plain = rows[0]["us_per_layer_step"]
    for r in rows:
        r["extra_us_vs_plain"] = r["us_per_layer_step"] - plain
    result = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "layers": args.layers, "rows": args.rows,
              "width": args.width, "n1": args.n1, "n2": args.n2, "reps": args.reps, "forms": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
