"""Merge result files of `python -m certattn_jax eval ...` runs (later files add or replace parts) and write the
headline figures in results/eval_summary.json's schema.

    python scripts/eval_summary.py results/eval_cpu_1k.json results/eval_cpu_1k_aggressive.json \
        --out results/eval_summary.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from certattn_jax.evals.runner import summarize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    merged: dict = {}
    for path in args.inputs:
        r = json.loads(Path(path).read_text())
        audit = {**merged.get("audit", {}), **r.get("audit", {})} if r.get("job") != "aggressive" else merged.get(
            "audit", {})
        merged.update({k: v for k, v in r.items() if k != "audit"})
        merged["audit"] = audit
    summary = summarize(merged, merged["model"], merged["device"])
    summary["sources"] = args.inputs
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
