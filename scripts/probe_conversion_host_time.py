"""Host time of the certified prefill's conversion (`CacheSpec.from_staging`), section by section, no profiler.

    python scripts/probe_conversion_host_time.py --out results/probe_conversion_host_time.json

A SmolLM2-shaped cache (30 layers, 3 KV heads, head_dim 64; small hidden size: only the K/V shapes matter here),
bf16, one 1024-token prompt staged once; then --repeats conversions of it, each with the staging cache and the
previous result ready first. Reported (medians, ms): `from_staging` until it returns (host time only: nothing in it
waits for the device), and each wrapped section (the checks, the conversion program's dispatch, `_wrap`); plus a
dense staging cache's init. Times on whatever machine runs it; on a busy CPU they are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "results/probe_conversion_host_time.json"))
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from certattn_jax import cache as cm
    from certattn_jax import model_cache, tiers
    from certattn_jax.policy import CertPolicy
    from models import generate as gen
    from models import llama
    from models.config import LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
    policy, dtype, prompt = CertPolicy(), jnp.bfloat16, 1024
    params = llama.fuse_projections(llama.init_params(cfg, jax.random.key(0), dtype))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt).tolist()
    cap = gen.round_up(prompt + 64, gen.CAPACITY_BUCKET)
    cert = model_cache.cache_spec("certified", cfg, dtype, policy)
    staging = model_cache.cache_spec("dense", cfg, dtype, policy)
    staged, _ = gen.prefill(params, cfg, [ids], cap, cache_factory=staging, policy=policy)
    lengths = np.array([prompt], np.int32)

    sections: dict[str, list[float]] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sections.setdefault(name, []).append(time.perf_counter() - t0)
            return out
        return wrapper

    patches = [(model_cache, "host_checked_counts"), (cm, "_check_layers"), (cm, "_check_head_major"),
               (cm, "_check_blocks"), (cm, "_check_live_layers"), (tiers, "check_host_fits"),
               (cm, "_convert_all_layers"), (model_cache, "_fresh_model_arrays"), (model_cache, "commit_arrays")]
    # (a section the tree no longer has is skipped: the probe runs on older trees too)
    originals = [(mod, name, getattr(mod, name)) for mod, name in patches if hasattr(mod, name)]
    for mod, name, fn in originals:
        setattr(mod, name, timed(name, fn))
    total = []
    try:
        for _ in range(args.repeats + 5):
            jax.block_until_ready(staged)
            t0 = time.perf_counter()
            out = cert.from_staging(staged, lengths=lengths)
            total.append(time.perf_counter() - t0)
            jax.block_until_ready(out)
    finally:
        for mod, name, fn in originals:
            setattr(mod, name, fn)
    init = []
    for _ in range(args.repeats + 5):
        t0 = time.perf_counter()
        s = staging.staging(1, cap)
        init.append(time.perf_counter() - t0)
        jax.block_until_ready(s)

    def ms(xs: list[float]) -> float:
        return round(statistics.median(xs[5:]) * 1e3, 3)  # the first 5: compiles and warm-up

    row = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "repeats": args.repeats, "from_staging_host_ms": ms(total),
           "sections_ms": {k: ms(v) for k, v in sections.items()}, "dense_staging_init_host_ms": ms(init)}
    print(json.dumps(row, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
