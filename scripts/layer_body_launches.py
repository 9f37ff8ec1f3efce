"""Launches of one layer-step of a compiled decode loop, by kind: the instructions that run once per layer per
step (the layer loop's body: multiplicity = number of layers), counted as slices (dynamic-slice fusions),
write-backs (scatter / dynamic-update-slice), copies, conditionals, custom calls (kernels) and the rest.

Reads an HLO dump (`bench_generate.py --dump-hlo DIR`). The numbers of docs/performance.md's "where a certified
layer's launches go" (CPU HLO, SmolLM2 shapes):

    python scripts/bench_generate.py --cpu-smollm2 --prompts 256 --new-tokens 2 --caches certified \\
        --tier1 pallas --rung0 fused --dump-hlo /tmp/hlo
    python scripts/layer_body_launches.py /tmp/hlo/smollm2_certified_256_pallas_fused.hlo --layers 30
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hlo_walk import launching_instructions  # noqa: E402


def layer_body_launches(hlo: str, layers: int) -> dict[str, int]:
    """{kind: launches per layer-step} over the instructions that run `layers` times per step."""
    kinds = collections.Counter()
    for instr, op, mult, where in launching_instructions(hlo):
        if where != "step" or mult != layers:
            continue
        m = re.search(r'op_name="([^"]*)"', instr)
        name = m.group(1) if m else ""
        if op == "custom-call":
            kind = "kernels"
        elif op == "dynamic-slice" or "dynamic_slice" in name:
            kind = "slices"
        elif op in ("scatter", "dynamic-update-slice") or "scatter" in name or "dynamic_update_slice" in name:
            kind = "write-backs"
        elif op in ("copy", "conditional"):
            kind = op + ("s" if op == "conditional" else "")
        else:
            kind = "other"
        kinds[kind] += 1
    return {"total": sum(kinds.values()), **dict(kinds.most_common())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hlo")
    ap.add_argument("--layers", type=int, required=True, help="the model's layer count (the loop's trip count)")
    args = ap.parse_args()
    print(json.dumps(layer_body_launches(Path(args.hlo).read_text(), args.layers)))


if __name__ == "__main__":
    main()
