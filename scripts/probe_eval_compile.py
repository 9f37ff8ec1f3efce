"""How long the evaluation's certified teacher-forced loop takes to compile, per layer schedule.

The eval (`certattn_jax.evals.decode.teacher_forced`) wraps the model cache in an `EvalCache`. Until
2026-12-01 that wrapper did not expose the inner cache's `schedule`, so `models.llama.forward_hidden` ran the
fast pass unrolled over every layer (the "two-pass" schedule): ~100 s of compiling on the H200 before the first
step, against ~14 s for `generate`'s looped loop. This script compiles the loop for each schedule (random
weights, nothing is run) and prints the compile seconds and the kernel launches per step of the compiled loop.

    python scripts/probe_eval_compile.py --model smollm2 --schedules looped two-pass --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_generate import _model_config, count_launches  # noqa: E402

from certattn_jax.evals import decode  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402
from models import llama  # noqa: E402


def compile_seconds(model: str, schedule: str, capacity: int, steps: int) -> dict:
    config = _model_config(model)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    policy = CertPolicy(block_size=16, group_size=16) if model == "tiny" else CertPolicy()
    params = llama.fuse_projections(llama.init_params(config, jax.random.key(0), dtype))
    cache = decode.make_cache("certified", params, config, capacity, policy)
    cache = cache.replace(inner=cache.inner.replace(schedule=schedule))
    tokens = jnp.zeros((1, steps), jnp.int32)
    t0 = time.perf_counter()
    compiled = decode.teacher_forced.lower(params, config, cache, tokens, tokens).compile()
    seconds = time.perf_counter() - t0
    launches = count_launches(compiled.as_text())
    return {"model": model, "schedule": schedule, "capacity": capacity, "compile_s": round(seconds, 2),
            "launches_per_step": launches["launches"], "cond_branch_launches": launches["cond_branch_launches"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="tiny, smollm2 or llama3.1-8b (random weights)")
    ap.add_argument("--schedules", nargs="+", default=["looped", "two-pass"])
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for schedule in args.schedules:
        row = compile_seconds(args.model, schedule, args.capacity, args.steps)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__,
                                              "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
