"""Where a compiled decode step's launches sit: its loops and conditionals as a tree, each body with its launch
count, its launches by opcode and its largest copies. For comparing two schedules' compiled programs (e.g. the
looped branch of "adaptive" against "looped": docs/performance.md, 2026-12-02 fifth session).

    python scripts/loop_bodies.py DIR/smollm2_certified_1024_pallas_fused.hlo --depth 3

A while loop's body is shown once with its known trip count; calls are followed; of a conditional with more than
two branches (a switch over the layer index) only the first branch is shown.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from big_writes import output_bytes  # noqa: E402
from hlo_walk import NO_LAUNCH, computations, opcode  # noqa: E402


def _flat(comps: dict[str, list[str]], comp: str) -> list[tuple[str, str]]:
    """(opcode, instruction) of comp's launching instructions and of the computations it calls; loops and
    conditionals stay single entries."""
    out = []
    for instr in comps.get(comp, []):
        op = opcode(instr)
        if op in NO_LAUNCH:
            continue
        if op == "call":
            out += _flat(comps, re.search(r"to_apply=%?([\w.\-]+)", instr).group(1))
        else:
            out.append((op, instr))
    return out


def _branches(instr: str) -> list[str]:
    groups = re.findall(r"branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+)", instr)
    return [n.strip().lstrip("%") for g in (a or b for a, b in groups) for n in g.split(",")]


def describe(comps: dict[str, list[str]], comp: str, depth: int, max_depth: int, copies: int) -> list[str]:
    items = _flat(comps, comp)
    ops = Counter(op for op, _ in items if op != "while")
    pad = "  " * depth
    lines = [f"{pad}{comp}: {len(items)} launches {dict(ops.most_common(8))}"]
    big = sorted(((output_bytes(i), i) for op, i in items if op in ("copy", "copy-start")), reverse=True)
    lines += [f"{pad}   copy {b} B: {i.split(' = ', 1)[1][:100]}" for b, i in big[:copies]]
    if depth >= max_depth:
        return lines
    for op, instr in items:
        if op == "while":
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', instr)
            lines.append(f"{pad} while x{trips.group(1) if trips else '?'}:")
            lines += describe(comps, re.search(r"body=%?([\w.\-]+)", instr).group(1), depth + 1, max_depth, copies)
        elif op == "conditional":
            names = _branches(instr)
            lines.append(f"{pad} conditional, {len(names)} branches:")
            for name in names[:2] if len(names) <= 2 else names[:1]:
                lines += describe(comps, name, depth + 1, max_depth, copies)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hlo")
    ap.add_argument("--depth", type=int, default=3, help="how many loop / conditional levels to descend")
    ap.add_argument("--copies", type=int, default=3, help="largest copies listed per body")
    args = ap.parse_args()
    comps, entry = computations(Path(args.hlo).read_text())
    loop = next(i for i in comps[entry] if opcode(i) == "while")  # the loop over decode steps
    step = re.search(r"body=%?([\w.\-]+)", loop).group(1)
    print("\n".join(describe(comps, step, 0, args.depth, args.copies)))


if __name__ == "__main__":
    main()
