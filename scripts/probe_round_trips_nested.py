"""Host round trips per common decode step, plain vs "nested" decode loop (`models.generate`), from the compiled
CPU HLO of a tiny certified LLaMA whose layers count as small (their weights read stacked, as SmolLM2's on a GPU).
`hlo_walk.host_round_trips` counts what would make a GPU's host wait (each conditional's predicate, the loop's
own predicate); for the nested loop the common step is the inner loop's iteration.

    PYTHONPATH=. python scripts/probe_round_trips_nested.py --out results/round_trips_nested_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from bench_generate import count_launches  # noqa: E402
from hlo_walk import host_round_trips, launching_instructions  # noqa: E402

from certattn_jax.model_cache import cache_spec  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402
from models import generate as gen  # noqa: E402
from models import llama  # noqa: E402
from models.config import LlamaConfig  # noqa: E402

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4)
WHAT = ("CPU HLO of the decode loop, 4-layer tiny LLaMA, small layers (weights read stacked, as SmolLM2 on a GPU), "
        "jnp rung 0; per common decode step (hlo_walk.host_round_trips; nested: the inner loop's iteration)")


def row(params, schedule: str, nested: bool) -> dict:
    os.environ["CERTATTN_DECODE_LOOP_NESTED"] = "1" if nested else "0"
    gen._COMPILED.clear()
    out = gen.generate(params, CFG, [[1, 2, 3, 4, 5]], 4, eos_token_ids=(), progress=False,
                       cache_factory=cache_spec("certified", CFG, jnp.float32, POLICY, schedule=schedule))
    (decode,) = gen._COMPILED.values()
    loop = gen.decode_loop_kind(out.cache)
    hlo = decode.as_text()
    trips = host_round_trips(hlo, inner_step=loop == "nested")
    copies = [(instr, mult) for instr, op, mult, where in launching_instructions(hlo, inner_step=loop == "nested")
              if where == "step" and op == "copy"]
    return {"schedule": schedule, "decode_loop": loop, "host_round_trips_per_common_step": trips["total"],
            "host_round_trips_in_branches": trips["in_branches"],
            "launches_per_step": count_launches(hlo, inner_step=loop == "nested")["launches"],
            # copies per step, and those of uint32 values (on the CPU: the sampling key's threefry, a loop)
            "copies_per_step": sum(m for _, m in copies),
            "uint32_copies_per_step": sum(m for i, m in copies if i.split(" = ", 1)[1].startswith("u32"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="round_trips_nested.json")
    args = ap.parse_args()
    llama.COPY_WEIGHTS_BELOW_BYTES[jax.default_backend()] = 1 << 40  # small layers, as SmolLM2's on a GPU
    params = llama.init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
    rows = []
    for schedule in ("adaptive", "straight-looped"):
        for nested in (False, True):
            rows.append(row(params, schedule, nested))
            print(rows[-1])
    Path(args.out).write_text(json.dumps({"what": WHAT, "backend": jax.default_backend(), "jax": jax.__version__,
                                          "command": "PYTHONPATH=. python scripts/probe_round_trips_nested.py",
                                          "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
