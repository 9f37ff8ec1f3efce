"""Where a compiled decode loop's kernel launches come from, grouped by the `jax.named_scope` / op name that
produced them (tier1_context, select_and_promote, rung0_certified, rung0_fused, rung1_widen, ...).

Reads an HLO text dump (`bench_generate.py --dump-hlo DIR`, `profile_cert_step.py --dump-hlo DIR`) and counts,
per step of the outermost while loop, the launching instructions (as `bench_generate.count_launches` does:
nested loops times their trip counts, conditional branches apart), keyed by the first of `--scopes` found in
each instruction's op_name (else its last op_name component).

    python scripts/launches_by_scope.py DIR/smollm2_certified_1024_pallas_fused.hlo
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

SCOPES = ("rung0_fused", "tier1_context", "select_and_promote", "rung0_certified", "rung1_widen",
          "rung2_exact_values", "rung3_exact_heads", "rung4_exact_layer", "certattn_tier1_pass",
          "certattn_certify_rung0", "scatter", "dynamic_slice", "dynamic_update_slice", "switch", "cond")


def launches_by_scope(hlo: str, scopes: tuple[str, ...] = SCOPES, descend_loops: bool = True,
                      ) -> dict[str, dict[str, int]]:
    """{"step": {scope: launches per step}, "branch": {...}} for the outermost while loop's body
    (descend_loops: see `hlo_walk.launching_instructions`)."""
    counts = {"step": collections.Counter(), "branch": collections.Counter()}
    for instr, op, mult, where in launching_instructions(hlo, descend_loops):
        m = re.search(r'op_name="([^"]*)"', instr)
        name = m.group(1) if m else ""
        key = next((s for s in scopes if s in name), None)
        counts[where][key or (f"{op}:{name.rsplit('/', 1)[-1]}" if name else op)] += mult
    return {w: dict(c.most_common()) for w, c in counts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hlo")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--interpret-proxy", action="store_true",
                    help="count a loop inside the step as one launch (CPU HLO, Pallas kernels in interpret mode)")
    args = ap.parse_args()
    result = launches_by_scope(Path(args.hlo).read_text(), descend_loops=not args.interpret_proxy)
    out = {w: {"total": sum(c.values()), "top": dict(list(c.items())[:args.top])} for w, c in result.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
