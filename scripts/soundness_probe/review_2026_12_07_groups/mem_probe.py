"""What one conversion program (`_convert_layers_into`) holds, from XLA:CPU's memory analysis of the compiled
program (compile only, nothing run, production XLA flags), against what `auto_staging_batch` counts for it.
XLA:GPU's buffer assignment differs; this is an indication, not the H100's number.

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_groups/mem_probe.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

from certattn_jax import cache as cm
from certattn_jax.cache import TieredKVCache
from certattn_jax.model_cache import cache_spec
from certattn_jax.policy import CertPolicy
from models.config import LlamaConfig
from scripts.bench_decode import MODELS

dev = jax.devices()[0]
MiB = 2**20


def sds(x, kind):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(dev, memory_kind=kind))


def analyse(name, cfg: LlamaConfig, cap, n, g, B=None, dtype=jnp.bfloat16, chunk=256):
    B = B or n
    pol = CertPolicy()
    spec = cache_spec("certified", cfg, dtype, pol)
    # a real store of g layers (the program's temporaries do not depend on the layers it does not write; tier 2
    # zeros are NumPy zero pages in pinned_host): ShapeDtypeStructs lose the host memory space in jax 0.10
    store = TieredKVCache.init(batch=B, capacity=cap, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                               dtype=dtype, policy=pol, layers=g)
    kv = sds(jax.ShapeDtypeStruct((n, cfg.num_kv_heads, cap, cfg.head_dim), dtype), "device")
    lengths = sds(jax.ShapeDtypeStruct((n,), jnp.int32), "device")
    i32 = sds(jax.ShapeDtypeStruct((), jnp.int32), "device")
    layout = TieredKVCache.init(batch=1, capacity=pol.block_size, num_kv_heads=1, head_dim=cfg.head_dim,
                                dtype=dtype, policy=pol, host=False).layout_policy()
    compiled = cm._convert_layers_into.lower(store, (kv,) * g, (kv,) * g, lengths, i32, layout, i32).compile()
    ma = compiled.memory_analysis()
    e = cfg.num_kv_heads * cap * cfg.head_dim
    isz = jnp.dtype(dtype).itemsize
    group_kv = g * n * 2 * e * isz                       # the group's staging K/V (one stacked copy)
    per = spec.bytes_per_sequence(cap)
    conv_temps = 2 * 2 * 4 * g * n * e                   # auto_staging_batch's conversion_temps(n)
    prefill_temps = 3 * 4 * cfg.num_heads * min(chunk, cap) * cap
    group_t1 = per["device"] * n * g / cfg.num_layers    # converted tier 1 of the group's layers (approx.)
    print(f"{name}: L={cfg.num_layers} cap={cap} n={n} g={g}  groups/conv={-(-cfg.num_layers // g)}\n"
          f"   XLA temp {ma.temp_size_in_bytes / MiB:8.1f} MiB   (= {ma.temp_size_in_bytes / group_kv:.2f}x the group's "
          f"K/V {group_kv / MiB:.1f} MiB; host temp {getattr(ma, 'host_temp_size_in_bytes', 0) / MiB:.1f})\n"
          f"   estimate: conversion_temps {conv_temps / MiB:8.1f}  + n*device {n * per['device'] / MiB:8.1f}"
          f"  (+ n*prefill_temps {n * prefill_temps / MiB:.1f}, not live during the conversion)\n"
          f"   group's tier 1 ~{group_t1 / MiB:.1f} MiB; conversion_temps + n*device - temp = "
          f"{(conv_temps + n * per['device'] - ma.temp_size_in_bytes) / MiB:+.1f} MiB", flush=True)
    return ma


smol, b8 = MODELS["smollm2"], MODELS["llama3.1-8b"]
print("layers per program (default budget): smol 1K", cm.conversion_group_layers(2 * 2 * 3 * 1088 * 64, 30),
      "8B 8K", cm.conversion_group_layers(2 * 2 * 8 * 8256 * 128, 32))
runs = [("smol 1K, whole model", smol, 1088, 1, 30), ("smol 1K, a layer", smol, 1088, 1, 1),
        ("smol 4K batch 4, whole model", smol, 4160, 4, 30),
        ("8B 4K, 16 layers", b8, 4096, 1, 16), ("8B 4K, a layer", b8, 4096, 1, 1),
        ("8B 8K, 7 layers", b8, 8256, 1, 7)]
sel = sys.argv[1:]
for r in runs:
    if not sel or r[0] in sel:
        analyse(*r)
if "f32" in sel:
    analyse("smol 1K f32, whole model", smol, 1088, 1, 30, dtype=jnp.float32)
    analyse("smol 1K f32, a layer", smol, 1088, 1, 1, dtype=jnp.float32)
