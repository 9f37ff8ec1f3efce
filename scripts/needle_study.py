"""Which needle format does SmolLM2 retrieve with the dense cache? (issue 10; the demo's choice rests on this)

For each needle format, document length, depth and seed: one greedy generation per cache mode (dense by
default; batch 1, the demo's path), and whether the answer contains the needle's value. Prints a table of
retrieval rates, and writes every row to JSON (incrementally, so an interrupted run keeps what it measured).

    python scripts/needle_study.py --out results/needle_study.json
    python scripts/needle_study.py --formats magic-prose-primed --lengths 1500 --depths 0.1,0.9 --seeds 0-9
    # the demo's part 3: does a naive K4V2 cache lose needles that dense finds?
    python scripts/needle_study.py --formats magic-towns-primed --lengths 1500 --seeds 0-3 --modes dense,naive \
        --key-bits 4 --value-bits 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from certattn_jax import cli  # noqa: E402
from certattn_jax.needle import FORMATS, build_needle_prompt, contains_needle  # noqa: E402


def _ints(spec: str) -> list[int]:
    """'0-9' or '0,3,5'."""
    if "-" in spec:
        lo, hi = map(int, spec.split("-"))
        return list(range(lo, hi + 1))
    return [int(s) for s in spec.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, from {', '.join(FORMATS)}")
    ap.add_argument("--lengths", default="1000,1500,2000", help="document lengths in tokens")
    ap.add_argument("--depths", default="0.5", help="needle depths (0 = start of the document, 1 = end)")
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--modes", default="dense", help=f"comma-separated cache modes, from {', '.join(cli.CACHE_MODES)}")
    ap.add_argument("--key-bits", type=int, default=None, choices=[4, 8], help="naive/certified layout")
    ap.add_argument("--value-bits", type=int, default=None, choices=[2, 4])
    ap.add_argument("--block-size", type=int, default=None, help="naive/certified key block size")
    ap.add_argument("--group-size", type=int, default=None, help="naive/certified value group size")
    ap.add_argument("--out", default=None, help="JSON file (rows are appended to an existing file's)")
    args = ap.parse_args()
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; known: {', '.join(FORMATS)}")
    modes = args.modes.split(",")
    if not set(modes) <= set(cli.CACHE_MODES):
        raise SystemExit(f"unknown modes in {modes}; known: {', '.join(cli.CACHE_MODES)}")
    gen_args = argparse.Namespace(max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=1.0, seed=0,
                                  prefill_chunk=256, eps=None, key_bits=args.key_bits, value_bits=args.value_bits)
    layout = {k: v for k, v in (("block_size", args.block_size), ("group_size", args.group_size)) if v is not None}
    policy = dataclasses.replace(cli.policy_from_args(gen_args), **layout)
    cli.enable_compilation_cache()
    pre = cli.load_model(args.model, args.dtype)
    rows = []
    if args.out and Path(args.out).exists():
        rows = json.loads(Path(args.out).read_text())["rows"]
    for fmt in formats:
        for length in _ints(args.lengths):
            for depth in map(float, args.depths.split(",")):
                for seed in _ints(args.seeds):
                    p = build_needle_prompt(pre.tokenizer, fmt, length, seed, depth)
                    dense_tokens = None
                    for mode in modes:
                        t0 = time.perf_counter()
                        out = cli.run_generation(pre, p.ids, gen_args, mode, policy)
                        text = pre.tokenizer.decode(out.tokens[0], skip_special_tokens=True)
                        dense_tokens = out.tokens[0] if mode == "dense" else dense_tokens
                        row = {"format": fmt, "doc_tokens_target": length, "doc_tokens": p.doc_tokens,
                               "prompt_tokens": len(p.ids), "depth": depth, "seed": seed, "value": p.value,
                               "mode": mode, "policy": "" if mode == "dense" else _layout(policy),
                               "found": contains_needle(text, p.value), "answer": text,
                               "same_tokens_as_dense": (None if mode == "dense" or dense_tokens is None
                                                        else out.tokens[0] == dense_tokens),
                               "wall_s": round(time.perf_counter() - t0, 2)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        _write(args.out, args.model, rows)
    _table(rows)


def _layout(policy) -> str:
    return f"K{policy.key_bits}V{policy.value_bits} block {policy.block_size} group {policy.group_size}"


def _write(out: str | None, model: str, rows: list) -> None:
    if not out:
        return
    result = {"description": "needle retrieval per cache mode, greedy, batch 1 (scripts/needle_study.py)",
              "device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "model": model,
              "formats": {name: vars(f) for name, f in FORMATS.items()}, "rows": rows}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))


def _table(rows: list) -> None:
    cells: dict[tuple, list[bool]] = defaultdict(list)
    for r in rows:
        group = (r["format"], r["depth"], r.get("mode", "dense"), r.get("policy", ""))
        cells[group + (r["doc_tokens_target"],)].append(r["found"])
    lengths = sorted({k[-1] for k in cells})
    print(f"\n{'format':24s} {'depth':>5s} {'cache':24s} " + " ".join(f"{n:>9d}" for n in lengths))
    for group in sorted({k[:-1] for k in cells}):
        found = [cells.get(group + (n,), []) for n in lengths]
        fmt, depth, mode, layout = group
        print(f"{fmt:24s} {depth:5.2f} {(mode + ' ' + layout).strip():24s} "
              + " ".join(f"{sum(f):>4d}/{len(f):<4d}" if f else f"{'-':>9s}" for f in found))


if __name__ == "__main__":
    main()
