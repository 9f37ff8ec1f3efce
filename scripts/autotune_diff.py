"""Which fusions one program's XLA autotuning covered that another's did not (`--xla_gpu_dump_autotune_results_to`).

    python scripts/autotune_diff.py autotune_8b_dense.textproto autotune_8b_certified.textproto --out diff.json

Each file is XLA's autotune dump in text form: one entry per autotuned fusion, keyed by the fusion's HLO (older
XLA: `results { hlo: ... result { triton / gemm ... } }`, GEMMs only; jax 0.11's: `entries { key { target {
hlo_fingerprint } } value { optimal_config { backend: ... } } }`, plain fusions too). Reports per file the entry count
and, for the second file, the entries whose `hlo` key the first lacks, with the chosen backend of each (what the
extra autotuning time of the second program's compile went into).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def entries(text: str) -> dict[str, str]:
    """{fusion key: the entry's text} of a dump: the older AutotuneResults format (top-level `results { ... hlo:
    "..." }` blocks) or the newer autotuner's (`entries { key { target { hlo_fingerprint: "..." } } value { ... } }`,
    jax 0.11's XLA, which also picks an emitter for plain fusions)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"^(?:results|entries) \{\n(.*?)^\}", text, flags=re.S | re.M):
        body = m.group(1)
        key = re.search(r'^\s*(?:hlo|hlo_fingerprint): "((?:[^"\\]|\\.)*)"', body, flags=re.M)
        if key:
            out[key.group(1)] = body
    return out


def backend_of(body: str) -> str:
    """The chosen backend: the newer format's `backend: NAME`, else the older format's result kind."""
    named = re.search(r"^\s*backend: (\w+)", body, flags=re.M)
    if named:
        return named.group(1)
    for name in ("triton", "gemm", "cudnn", "algorithm", "custom_kernel_fusion", "other"):
        if re.search(rf"^\s*{name}\s*\{{", body, flags=re.M):
            return name
    return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("other")
    ap.add_argument("--out")
    args = ap.parse_args()
    base, other = (entries(Path(p).read_text()) for p in (args.base, args.other))
    extra = {k: v for k, v in other.items() if k not in base}
    by_backend: dict[str, int] = {}
    for body in extra.values():
        by_backend[backend_of(body)] = by_backend.get(backend_of(body), 0) + 1
    def count(found: dict[str, str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for body in found.values():
            out[backend_of(body)] = out.get(backend_of(body), 0) + 1
        return out

    report = {"base": args.base, "other": args.other, "base_entries": len(base), "other_entries": len(other),
              "base_by_backend": count(base), "other_by_backend": count(other),
              "only_in_other": len(extra), "only_in_other_by_backend": by_backend,
              "only_in_other_keys": [k[:400] for k in extra]}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
