"""Which instructions of the compiled decode loop produce host-memory (S(5)) buffers? (docs/performance.md)

    PYTHONPATH=. python scripts/probe_host_copies.py --model smollm2 --caches naive certified_looped

Compiles `generate`'s decode loop (random bf16 weights, prompt 1024) and lists, per cache, every instruction
whose *result* lives in host memory, by opcode, with the bytes of that result: a `copy` (or copy-start) of a
tier-2-sized array on every step would cost a whole pass over tier 2 per step.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# this script reads the one decode program (`_COMPILED`): the decode bridge (two programs, one compiling in the
# background) off unless asked for
os.environ.setdefault("CERTATTN_DECODE_BRIDGE", "0")

_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1, "s32": 4, "pred": 1}


def host_results(hlo: str) -> list[dict]:
    rows = []
    for line in hlo.splitlines():
        if " = " not in line:
            continue
        lhs, rhs = line.split(" = ", 1)
        m = re.match(r"\s*(\(?[^ ]*?(?:S\(5\))[^ ]*\)?)\s+([a-z\-]+)\(", rhs)
        if not m:
            continue
        shape, op = m.group(1), m.group(2)
        if op in ("parameter", "get-tuple-element", "tuple", "bitcast"):
            continue
        size = 0
        for dt, dims in re.findall(r"(f32|bf16|f16|u8|s32|pred)\[([\d,]*)\]\{[^}]*S\(5\)", shape):
            n = 1
            for x in dims.split(","):
                n *= int(x) if x else 1
            size += n * _BYTES[dt]
        rows.append({"op": op, "bytes": size, "name": lhs.strip()[:60]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--caches", nargs="+", default=["naive", "certified_looped"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from certattn_jax.model_cache import DEFAULT_SCHEDULE, cache_spec
    from certattn_jax.policy import CertPolicy
    from models import generate as gen
    from models import llama
    from scripts.bench_decode import MODELS

    cfg = MODELS[args.model]
    params = llama.fuse_projections(llama.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt).tolist()
    report = {}
    for cache in args.caches:
        mode, _, schedule = cache.partition("_")
        spec = cache_spec(mode, cfg, jnp.bfloat16, CertPolicy(), schedule=schedule or DEFAULT_SCHEDULE)
        gen._COMPILED.clear()
        gen.generate(params, cfg, [ids], 4, eos_token_ids=(), progress=False, cache_factory=spec)
        (dec,) = gen._COMPILED.values()
        rows = host_results(dec.as_text())
        by_op = collections.Counter()
        for r in rows:
            by_op[r["op"]] += r["bytes"]
        big = sorted(rows, key=lambda r: -r["bytes"])[:12]
        report[cache] = {"host_result_bytes_by_op": dict(by_op), "largest": big}
        print(cache, json.dumps(report[cache]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
