"""Time to first token, dense against the tiered caches, measured in one process with the prefills interleaved.

    PYTHONPATH=. python scripts/bench_ttft.py --models smollm2 --prompts 1024 4096 --rounds 15 \
        --out results/bench_ttft.json
    PYTHONPATH=. python scripts/bench_ttft.py --tiny --rounds 3        # CPU check of the script

Issue 7's target is certified TTFT <= 1.2x dense. At SmolLM2 sizes a prefill takes tens of milliseconds, and the
dense prefill alone moved by 11 ms between this project's runs (docs/performance.md, 2026-12-02), so separate
processes' best-of-three cannot decide it. Here every cache's prefill is compiled first (a cold call each), then
the caches take turns, `rounds` times (dense, naive, certified, dense, ...): each round gives one ratio per cache
against that round's dense time. Reported per cache: the median and the spread (min, max) of the prefill times,
and the median of the per-round ratios with the rounds' 10th and 90th percentiles. A prefill is timed to the
first token's logits with the cache ready on the device (`bench_generate._prefill_times`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_generate import _model_config, _prefill_times  # noqa: E402


def measure(model: str, prompt: int, caches: list[str], rounds: int, new_tokens: int, prefill_chunk: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from certattn_jax.policy import CertPolicy
    from models import generate as gen
    from models import llama

    cfg = _model_config(model)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    policy = CertPolicy(block_size=16, group_size=16) if model == "tiny" else CertPolicy()
    params = llama.fuse_projections(llama.init_params(cfg, jax.random.key(0), dtype))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt).tolist()
    total = prompt + new_tokens

    def once(cache: str) -> float:
        return _prefill_times(gen, params, cfg, ids, total, cache, policy, prefill_chunk, 1)[0]

    cold = {c: once(c) for c in caches}  # compiles
    times: dict[str, list[float]] = {c: [] for c in caches}
    for _ in range(rounds):
        for c in caches:
            times[c].append(once(c))
    dense = np.asarray(times["dense"])
    row = {"model": model, "prompt": prompt, "rounds": rounds, "backend": jax.default_backend(),
           "device": jax.devices()[0].device_kind, "dtype": str(jnp.dtype(dtype)), "prefill_chunk": prefill_chunk,
           "caches": {}}
    for c in caches:
        t = np.asarray(times[c])
        ratio = t / dense
        row["caches"][c] = {"cold_s": round(cold[c], 4), "median_s": round(float(np.median(t)), 5),
                            "min_s": round(float(t.min()), 5), "max_s": round(float(t.max()), 5),
                            "ratio_median": round(float(np.median(ratio)), 3),
                            "ratio_p10_p90": [round(float(np.percentile(ratio, 10)), 3),
                                              round(float(np.percentile(ratio, 90)), 3)]}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2"])
    ap.add_argument("--prompts", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--caches", nargs="+", default=["dense", "naive", "certified"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--new-tokens", type=int, default=32, help="sizes the capacity, as in bench_generate")
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="the tiny model at a 100-token prompt (CPU check)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if "dense" not in args.caches:
        ap.error("--caches must include dense (the ratios' denominator)")
    if args.tiny:
        args.models, args.prompts, args.prefill_chunk = ["tiny"], [100], 32
    rows = []
    for model in args.models:
        for prompt in args.prompts:
            rows.append(measure(model, prompt, args.caches, args.rounds, args.new_tokens, args.prefill_chunk))
            print(json.dumps(rows[-1]), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
