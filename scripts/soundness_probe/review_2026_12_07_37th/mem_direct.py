"""`conversion_temp_bytes` against XLA:CPU's memory analysis of the direct path's program `_convert_all_layers`
(the test in tests/test_staging_groups.py checks only `_convert_layers_into`), and of `_convert_layers_into` in the
batched form at the SmolLM2 shape. Bytes per K/V element of the group reported.

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_37th/mem_direct.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

from certattn_jax import cache as cm
from certattn_jax.policy import CertPolicy

policy = cm.conversion_layout(CertPolicy())
SHAPES = [("test shape", 1, 4, 1024, 128, 8), ("SmolLM2 1K", 1, 3, 1024, 64, 30), ("SmolLM2 4K", 1, 3, 4096, 64, 30),
          ("8B-like 2K, 8 layers", 1, 8, 2048, 128, 8), ("batch 4 tiny", 4, 2, 256, 64, 12)]
for dtype in (jnp.bfloat16, jnp.float32, jnp.float16):
    for name, B, H, S, d, L in SHAPES:
        item = jnp.dtype(dtype).itemsize
        elems = 2 * B * H * S * d  # one layer's K and V
        kv = tuple(jax.ShapeDtypeStruct((B, H, S, d), dtype) for _ in range(L))
        n = jax.ShapeDtypeStruct((B,), jnp.int32)
        group = cm.conversion_group_layers(elems * item, L)
        if group != L:
            print(f"{name}: group {group} < L {L}: the direct path is not taken")
            continue
        m = cm._convert_all_layers.lower(kv, kv, n, policy).compile().memory_analysis()
        est = cm.conversion_temp_bytes(elems, L, item, form="batched")
        total_el = L * elems
        print(f"{jnp.dtype(dtype).name:8s} {name:22s} L={L}: temp {m.temp_size_in_bytes / 2**20:8.1f} MiB "
              f"({m.temp_size_in_bytes / total_el:5.1f} B/elem), output {m.output_size_in_bytes / 2**20:8.1f} MiB "
              f"(host part excluded? {m.host_output_size_in_bytes / 2**20 if hasattr(m, 'host_output_size_in_bytes') else 'n/a'}), "
              f"estimate {est / 2**20:8.1f} MiB ({est / total_el:4.1f} B/elem) -> "
              f"{'covers' if m.temp_size_in_bytes <= est else 'UNDER-COUNTS'}", flush=True)
