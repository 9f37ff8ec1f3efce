"""Which XLA instructions of a compiled decode loop write large buffers on every step (copies the code did not
ask for: a layer's tier 1 sliced out of the stacked cache for a custom call, weights out of a switch, ...).

Reads an HLO text dump (`bench_generate.py --dump-hlo DIR`) and lists, for the outermost while loop's body
(nested loops multiplied by their trip counts, conditional branches apart), every launching instruction that is
not a custom call (the kernels themselves) with its output size, sorted by bytes written per step.

    python scripts/big_writes.py DIR/smollm2_certified_1024_pallas_jnp.hlo --min-bytes 1e5
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hlo_walk import launching_instructions  # noqa: E402

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}


def output_bytes(instr: str) -> int:
    """Bytes of an instruction's output shape(s) (tuples summed)."""
    rhs = instr.split(" = ", 1)[1]
    shape = rhs.split(" ", 1)[0] if not rhs.startswith("(") else rhs[:rhs.index(")") + 1]
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
        if dtype in _BYTES:
            n = 1
            for x in filter(None, dims.split(",")):
                n *= int(x)
            total += n * _BYTES[dtype]
    return total


def big_writes(hlo: str, min_bytes: float) -> list[dict]:
    rows = []
    for instr, op, mult, where in launching_instructions(hlo):
        if op in ("custom-call", "conditional"):  # the kernels themselves; a conditional writes no buffer itself
            continue
        size = output_bytes(instr)
        if size >= min_bytes:
            name = re.search(r'op_name="([^"]*)"', instr)
            # an in-place update (scatter / dynamic-update-slice fusion) outputs the whole buffer but writes only
            # its slice: listed, not counted
            update = bool(name) and re.search(r"(scatter|dynamic_update_slice)$", name.group(1)) is not None
            rows.append({"op": op, "bytes": size, "times_per_step": mult, "where": where, "in_place_update": update,
                         "shape": instr.split(" = ", 1)[1].split(" ", 1)[0][:80],
                         "op_name": (name.group(1) if name else "")[-100:]})
    return sorted(rows, key=lambda r: (r["where"] != "step", r["in_place_update"], -r["bytes"] * r["times_per_step"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hlo")
    ap.add_argument("--min-bytes", type=float, default=1e5)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    rows = big_writes(Path(args.hlo).read_text(), args.min_bytes)
    step = sum(r["bytes"] * r["times_per_step"] for r in rows if r["where"] == "step" and not r["in_place_update"])
    print(json.dumps({"bytes_per_step_outside_kernels": step, "rows": rows[:args.top]}, indent=1))


if __name__ == "__main__":
    main()
