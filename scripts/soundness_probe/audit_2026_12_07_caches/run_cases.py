"""Run the named cases (common.CASES) in this one process, in order; one JSON line per case on stdout.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_caches/run_cases.py dense dense_theta ...

Environment switches between cases: a name `ENV:VAR=VALUE` sets os.environ[VAR] before the next case
(`ENV:VAR=` removes it)."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    for name in sys.argv[1:]:
        if name.startswith("ENV:"):
            var, _, value = name[4:].partition("=")
            if value:
                os.environ[var] = value
            else:
                os.environ.pop(var, None)
            continue
        t0 = time.perf_counter()
        result = common.run(name)
        print(json.dumps({"case": name, "seconds": round(time.perf_counter() - t0, 1), **result}), flush=True)
