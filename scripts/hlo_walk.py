"""Reading compiled HLO text: the launching instructions of a decode loop's step.

`launching_instructions(hlo)` walks the body of the entry computation's first while loop (one decode step):
nested while loops count their body that many times (their known trip count, else once), calls are followed,
and a conditional is one launch whose branch computations are walked apart ("branch"). Each computation is
walked once. Instructions that launch nothing (parameters, constants, tuples, bitcasts, ...) are skipped.
Used by `bench_generate.count_launches`, `big_writes.py` and `launches_by_scope.py`.

`host_round_trips(hlo)` counts what makes the host wait for the device inside one step: on a GPU, XLA decides
a `conditional` on the host (it copies the predicate back and waits for it) and so evaluates the condition of a
while loop whose trip count it does not know, once per iteration.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
             "replica-id", "opt-barrier"}


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """{computation name: its instruction lines}, and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    name = entry = None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            name = m.group(2)
            entry = name if m.group(1) else entry
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and " = " in line:
            comps[name].append(line.strip())
    return comps, entry


def opcode(instr: str) -> str:
    rhs = instr.split(" = ", 1)[1]
    m = re.search(r"\b([a-z][a-z0-9\-]*)\(", rhs)
    return m.group(1) if m else ""


def launching_instructions(hlo: str, descend_loops: bool = True, with_loops: bool = False, inner_step: bool = False,
                           ) -> Iterator[tuple[str, str, int, str]]:
    """(instruction, opcode, times per step, "step" | "branch") for every launching instruction of one step.
    descend_loops=False: a while loop inside the step is one launch and is not walked (a CPU proxy for a GPU
    step whose Pallas kernels run in interpret mode, where each kernel is a loop). with_loops: also yield each
    nested while loop that is walked (times per step of the loop itself, not of its body). inner_step: the step
    is the body of the first while loop directly inside that body (the "nested" decode loop's inner loop of
    common steps, `models.generate`)."""
    comps, entry = computations(hlo)
    whiles = [i for i in comps.get(entry, []) if opcode(i) == "while"]
    if not whiles:
        raise ValueError("no while loop in the entry computation")
    body = re.search(r"body=%?([\w.\-]+)", whiles[0]).group(1)
    if inner_step:
        inner = [i for i in comps.get(body, []) if opcode(i) == "while"]
        if not inner:
            raise ValueError("no while loop inside the decode loop's body")
        body = re.search(r"body=%?([\w.\-]+)", inner[0]).group(1)
    seen: set[str] = set()

    def walk(comp: str, mult: int, where: str) -> Iterator[tuple[str, str, int, str]]:
        if comp in seen or comp not in comps:
            return
        seen.add(comp)
        for instr in comps[comp]:
            op = opcode(instr)
            if op in NO_LAUNCH:
                continue
            if op == "while" and not descend_loops:
                yield instr, op, mult, where
                continue
            if op == "while":
                if with_loops:
                    yield instr, op, mult, where
                trips = _known_trips(instr)
                inner = mult * (trips or 1)
                for attr in ("condition", "body"):
                    m = re.search(rf"{attr}=%?([\w.\-]+)", instr)
                    if m:
                        yield from walk(m.group(1), inner, where)
                continue
            if op == "call":
                m = re.search(r"to_apply=%?([\w.\-]+)", instr)
                if m:
                    yield from walk(m.group(1), mult, where)
                continue
            yield instr, op, mult, where
            if op == "conditional":
                names = re.findall(r"branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+)", instr)
                for group in (a or b for a, b in names):
                    for n in group.split(","):
                        yield from walk(n.strip().lstrip("%"), mult, "branch")

    yield from walk(body, 1, "step")


def _known_trips(instr: str) -> int | None:
    """A while instruction's trip count where XLA knows it (its backend config), else None."""
    m = re.search(r'known_trip_count":\{"n":"(\d+)"', instr)
    return int(m.group(1)) if m else None


def host_round_trips(hlo: str, inner_step: bool = False) -> dict[str, int]:
    """Per step of the entry computation's first while loop (a decode step): "conditionals" (conditional
    instructions on the step's own path, times their loops' trip counts), "unknown_trip_loops" (nested while
    loops whose trip count XLA does not know: each iteration is one more round trip, counted here once), "total"
    = those + 1 for the step's own loop predicate (which a dense decode loop pays too), and "in_branches": the
    same two counted inside conditional branches, which run only when their branch is taken (a rarely taken
    rung; but also a schedule choice that takes one of its branches every step). Meaningful for GPU HLO:
    interpret-mode Pallas kernels (the CPU) are loops and conditionals themselves."""
    counts = {"conditionals": 0, "unknown_trip_loops": 0, "in_branches": 0}
    for instr, op, mult, where in launching_instructions(hlo, with_loops=True, inner_step=inner_step):
        if op == "conditional" or (op == "while" and _known_trips(instr) is None):
            key = "in_branches" if where == "branch" else ("conditionals" if op == "conditional"
                                                           else "unknown_trip_loops")
            counts[key] += mult
    counts["total"] = counts["conditionals"] + counts["unknown_trip_loops"] + 1
    return counts
