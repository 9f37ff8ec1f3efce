"""Run a list of cases (common.CASES, `ENV:VAR=VALUE` items as in run_cases.py) once in a single process, then each
case alone in a fresh process (with the environment the sequence had set at that point), and print every case
whose answer differs.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_caches/compare.py dense dense_theta ...
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
RUN = str(HERE / "run_cases.py")


def _run(names: list[str], env: dict[str, str] | None = None) -> list[dict]:
    done = subprocess.run([PYTHON, RUN, *names], cwd=ROOT, capture_output=True, text=True,
                          env=env or dict(os.environ), check=False)
    if done.returncode:
        raise RuntimeError(f"{names}: rc {done.returncode}\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(items: list[str]) -> int:
    seq = {r["case"] + f"#{i}": r for i, r in enumerate(_run(items))}
    jobs, env = [], dict(os.environ)
    for item in items:
        if item.startswith("ENV:"):
            var, _, value = item[4:].partition("=")
            env = dict(env)
            if value:
                env[var] = value
            else:
                env.pop(var, None)
        else:
            jobs.append((item, env))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fresh = list(pool.map(lambda job: _run([job[0]], job[1])[0], jobs))
    bad = 0
    for (key, got), want in zip(seq.items(), fresh, strict=True):
        same_tokens = got["tokens"] == want["tokens"] and got["finished"] == want["finished"]
        diff = [k for k in want["records"] if got["records"].get(k, [None])[0] != want["records"][k][0]]
        status = "same" if same_tokens and not diff else "DIFFERENT"
        bad += status != "same"
        print(f"{key:28s} {status}  seq {got['seconds']:5.1f}s fresh {want['seconds']:5.1f}s")
        if not same_tokens:
            print(f"    tokens in sequence {got['tokens']}\n    tokens fresh       {want['tokens']}")
        for k in diff:
            print(f"    record {k}: sequence {got['records'].get(k)} fresh {want['records'][k]}")
    print(f"{bad} of {len(fresh)} cases differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
