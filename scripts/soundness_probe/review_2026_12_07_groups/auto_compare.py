"""auto_staging_batch before (f55e263's formula, copied) and after (HEAD) on a fake device (H100: 0.75 x 79.6 GiB),
for the bench shapes; and the estimate's parts for one case. No device needed.

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_groups/auto_compare.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax.numpy as jnp

from certattn_jax.model_cache import cache_spec
from certattn_jax.policy import CertPolicy
from models import generate as gen
from scripts.bench_decode import MODELS


class Dev:
    def __init__(self, limit, in_use=0):
        self.s = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.s


def old(spec, config, batch, capacity, chunk, dev):
    st = dev.memory_stats()
    free = (st["bytes_limit"] - st["bytes_in_use"]) * gen.STAGING_MEMORY_SHARE
    per = spec.bytes_per_sequence(capacity)
    c = min(chunk, capacity)
    temps = 3 * 4 * config.num_heads * c * capacity + 2 * 2 * 4 * config.num_kv_heads * capacity * config.head_dim
    one = per["staging"] + per["device"] + temps
    if batch * one <= free:
        return None
    return max(1, min(int((free - batch * per["device"]) // one), batch - 1))


LIMIT = int(0.75 * 79.6 * 2**30)
for model, caps, batches in (("llama3.1-8b", (8192, 32768, 131072), (1, 2, 4, 8, 16)),
                             ("smollm2", (1024, 4096, 16384), (8, 64, 256))):
    cfg = MODELS[model]
    spec = cache_spec("certified", cfg, jnp.bfloat16, CertPolicy())
    for cap in caps:
        for b in batches:
            o = old(spec, cfg, b, cap, 256, Dev(LIMIT))
            n = gen.auto_staging_batch(spec, cfg, b, cap, 256, device=Dev(LIMIT))
            flag = "" if o == n else "   <- differs"
            print(f"{model:12s} cap {cap:6d} batch {b:3d}: before {o}, now {n}{flag}")
