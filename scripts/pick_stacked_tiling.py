"""The fastest checked setting of the stacked-weight GEMM kernel per (rows, K, N), from probe_stacked_matmul.py
results, as the file CERTATTN_STACKED_TUNING reads (pallas_kernels.stacked_matmul.tuned_settings).

    python scripts/pick_stacked_tiling.py results/probe_stacked_matmul.json [more.json ...] --out tuning.json

A setting counts only if its correctness row (form "pallas_check") is finite and within --max-rel-err of the
float64 product. Each entry also records the microseconds measured and XLA's on per-layer buffers (same run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows_class(M: int) -> int:
    return 1 if M == 1 else max(16, 1 << (M - 1).bit_length())


def pick(rows: list[dict], max_rel_err: float) -> list[dict]:
    ok = {(r["model"], r["gemm"], r["M"], r["tiling"]) for r in rows
          if r.get("form") == "pallas_check" and r["finite"] and r["max_rel_err"] <= max_rel_err}
    best: dict[tuple, dict] = {}
    xla: dict[tuple, float] = {}
    for r in rows:
        if "us_per_gemm" not in r:
            continue
        key = (rows_class(r["M"]), r["K"], r["N"])
        if r["form"] == "xla_layers":
            xla[key] = min(xla.get(key, float("inf")), r["us_per_gemm"])
        elif "kwargs" in r and (r["model"], r["gemm"], r["M"], r["form"]) in ok:
            if key not in best or r["us_per_gemm"] < best[key]["us"]:
                best[key] = {"rows": key[0], "K": key[1], "N": key[2], "settings": r["kwargs"],
                             "us": r["us_per_gemm"], "form": r["form"], "gemm": r["gemm"]}
    return [{**e, "xla_layers_us": xla.get((e["rows"], e["K"], e["N"]))} for e in best.values()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-rel-err", type=float, default=1e-2)
    args = ap.parse_args()
    rows = [r for f in args.results for r in json.loads(Path(f).read_text())["rows"]]
    entries = pick(rows, args.max_rel_err)
    Path(args.out).write_text(json.dumps(entries, indent=1))
    for e in entries:
        print(f"{e['gemm']:10s} rows={e['rows']:2d} K={e['K']:6d} N={e['N']:6d} {e['us']:8.2f} us "
              f"(XLA on per-layer buffers {e['xla_layers_us']}) {e['form']}")


if __name__ == "__main__":
    main()
