"""A JAX configuration flipped between two generate() calls in one process. `models.generate._COMPILED` keys a
decode loop by (name, config, greedy, record, loop, options, treedef, leaf shapes / dtypes / memory kinds) -- not by
JAX's trace-context settings, which `jax.jit`'s own cache keys on. The second call's answer is compared with a fresh
process started with the flipped setting.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_caches/probe_jax_config.py FLAG VALUE MODE [TEMP]

e.g. `jax_threefry_partitionable 0 dense 1.5`, `jax_enable_x64 1 certified`, `jax_default_matmul_precision
highest certified`. A VALUE of 0 / 1 is a bool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import jax  # noqa: E402


def value(raw: str):
    return {"0": False, "1": True}.get(raw, raw)


PARAMS: dict = {}


def answer(mode: str, temperature: float) -> dict:
    params = PARAMS["p"]  # made once, before the flag is flipped (init_params draws random numbers too)
    out = common.gen.generate(params, common.CFG, common.prompts(2), 12, temperature=temperature, seed=3,
                              eos_token_ids=(), progress=False, cache_factory=mode, policy=common.POLICY,
                              record_steps=mode != "dense")
    return common.summary(out)


def jit_draw() -> list:
    """A draw and a matmul's digest through plain jax.jit, whose cache keys on the trace context."""
    logits = jax.numpy.zeros((4, 96))
    draw = jax.jit(lambda k: jax.random.categorical(jax.random.split(k)[1], logits))(jax.random.key(3)).tolist()
    x = jax.numpy.asarray(common.np.random.default_rng(0).normal(size=(64, 64)), jax.numpy.float32)
    return [draw, common.digest(jax.jit(lambda a: a @ a)(x))]


def differences(a: dict, b: dict) -> list[str]:
    out = [] if a["tokens"] == b["tokens"] else ["tokens"]
    return out + [k for k in b["records"] if a["records"].get(k, [None])[0] != b["records"][k][0]]


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    flag, raw, mode = sys.argv[1:4]
    temperature = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    PARAMS["p"] = common.params_for(common.CFG)
    if os.environ.get("PROBE_FRESH"):
        jax.config.update(flag, value(raw))
        print(json.dumps({"answer": answer(mode, temperature), "jit": jit_draw()}))
        sys.exit(0)
    before = getattr(jax.config, flag)
    first = answer(mode, temperature), jit_draw()
    jax.config.update(flag, value(raw))
    second = answer(mode, temperature), jit_draw()
    done = subprocess.run([sys.executable, *sys.argv], capture_output=True, text=True, check=True,
                          env={**os.environ, "PROBE_FRESH": "1"})
    fresh = json.loads(done.stdout.splitlines()[-1])
    print(f"jax {jax.__version__}, mode {mode}, temperature {temperature}: {flag} {before!r} -> {value(raw)!r}")
    print(f"call 1 ({flag}={before!r}) tokens {first[0]['tokens']}")
    print(f"call 2 ({flag}={value(raw)!r}) tokens {second[0]['tokens']}")
    print(f"fresh process ({flag}={value(raw)!r}) tokens {fresh['answer']['tokens']}")
    print(f"plain jax.jit draw: call 1 {first[1]}, call 2 {second[1]}, fresh {fresh['jit']}")
    print(f"call 2 vs fresh differ in: {differences(second[0], fresh['answer']) or 'nothing'}")
    print(f"call 2 vs call 1 differ in: {differences(second[0], first[0]) or 'nothing'}")
    print(f"call 1 vs fresh differ in: {differences(first[0], fresh['answer']) or 'nothing'}")
