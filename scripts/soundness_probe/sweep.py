"""Soundness probe sweep (an independent review, 2026-12-06): decode steps of many configurations and data
families checked head by head against float64 (audit2.run_config); one JSON line per family.

    PYTHONPATH=. python scripts/soundness_probe/sweep.py OUT.jsonl [config indices...]   # SEED0=N offsets seeds
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import os

import jax.numpy as jnp
import numpy as np
from audit2 import run_config

from certattn_jax import step as stepmod
from certattn_jax.cache import TieredKVCache
from certattn_jax.policy import CertPolicy

f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
P = CertPolicy
# fmt: off
CONFIGS = [
 # name, B,H,G,D, dtype,qdtype, policy, L0, T, fast
 ("G1_d16_bs16_k1", 3, 2, 1, 16, f32, f32, P(block_size=16, group_size=16, k_max=1, eps=0.05), [3, 16, 47], 40, None),
 ("G8_d128_bs32_bf16", 2, 1, 8, 128, bf16, f32, P(block_size=32, group_size=32, k_max=2, eps=0.05), [64, 5], 45,
     None),
 ("G8_d32_bs128_f16_K4V2", 2, 2, 8, 32, f16, f32, P(block_size=128, group_size=32, key_bits=4, value_bits=2, k_max=1,
     eps=0.1), [120, 250], 20, None),
 ("G1_d128_bs16_tau1_epstiny", 2, 2, 1, 128, f32, f32, P(block_size=16, group_size=32, key_bits=4, value_bits=4,
     k_max=1, tau_cov=1.0, eps=1e-7), [33, 80], 40, None),
 ("G4_d16_bs16_bf16_manyflush", 2, 2, 4, 16, bf16, bf16, P(block_size=16, group_size=16, key_bits=8, value_bits=2,
     k_max=1, eps=1e-9), [0, 1], 150, None),
 ("G3_d48_nonpow2", 2, 2, 3, 48, f32, f32, P(block_size=16, group_size=16, k_max=2, eps=0.05), [17, 70], 40, None),
 ("G2_d32_f16_qf16", 2, 2, 2, 32, f16, f16, P(block_size=16, group_size=16, k_max=2, eps=0.05, hot_slots=6), [31,
     96], 40, None),
 ("G8_d16_bs32_tau1_k1_rm0", 2, 1, 8, 16, f32, f32, P(block_size=32, group_size=16, k_max=1, tau_cov=1.0,
     rank_margin=0.0, eps=1e-3), [300, 9], 30, None),
 ("G2_d64_rung2", 2, 2, 2, 64, bf16, f32, P(block_size=16, group_size=32, key_bits=8, value_bits=2, k_max=2, v_max=1,
     v_tol=0.0, eps=0.02, layer_fallback_fraction=1.0), [100, 40], 30, None),
 ("G1_d32_fallback0", 2, 2, 1, 32, f32, f32, P(block_size=16, group_size=16, k_max=2, eps=1e-4,
     layer_fallback_fraction=0.01), [50, 20], 25, None),
 ("G4_d32_fast1", 2, 2, 4, 32, f32, f32, P(block_size=16, group_size=16, k_max=2, eps=0.05), [64, 13], 40, 1),
 ("G4_d32_fast0", 2, 2, 4, 32, bf16, f32, P(block_size=16, group_size=16, k_max=2, eps=0.05), [64, 13], 40, 0),
 ("G2_d32_immediate", 2, 2, 2, 32, f32, f32, P(block_size=16, group_size=16, k_max=2, hot_slots=4, eps=0.02,
     hot_refresh="immediate"), [70, 130], 30, None),
 ("mismatch_build_k4_hot8_call_k1", 2, 2, 2, 32, f32, f32, (P(block_size=16, group_size=16, k_max=1, eps=0.05,
     tau_cov=1.0), P(block_size=16, group_size=16, k_max=4, hot_slots=8)), [100, 37], 40, None),
 ("mismatch_bf16_call_k2_rm0", 2, 1, 4, 32, bf16, f32, (P(block_size=32, group_size=32, key_bits=4, value_bits=4,
     k_max=2, eps=0.01, rank_margin=0.0, v_tol=0.0, v_max=1), P(block_size=32, group_size=32, key_bits=4,
     value_bits=4, k_max=3)), [200, 64], 40, None),
 ("G1_d16_bs16_f16_K4V2_k1", 3, 1, 1, 16, f16, f32, P(block_size=16, group_size=16, key_bits=4, value_bits=2,
     k_max=1, eps=1.0), [0, 16, 160], 40, None),
 ("long_G4_bs16_nb128", 1, 1, 4, 32, bf16, f32, P(block_size=16, group_size=16, k_max=2, eps=0.05), [1990], 25, None),
 ("long_G2_bs32_nb70_ragged", 2, 2, 2, 64, f32, f32, P(block_size=32, group_size=32, key_bits=4, value_bits=4,
     k_max=3, eps=0.02), [2170, 40], 20, None),
]
# fmt: on
FAMS = ["gauss", "q_zero", "q_tiny", "q_huge", "q_mixed", "key_spike", "key_spike_aligned", "val_const_one",
        "val_const", "f16_edge", "val_near_max", "needle", "huge_scores", "offset", "tied", "q_nonfinite",
        "kv_nonfinite"]

if __name__ == "__main__":
    out = open(sys.argv[1], "a")
    idx = [int(a) for a in sys.argv[2:]] or range(len(CONFIGS))
    seed0 = int(os.environ.get("SEED0", "0"))
    for i in idx:
        name, B, H, G, D, dt, qdt, pol, L0, T, fast = CONFIGS[i]
        bpol = None
        if isinstance(pol, tuple):
            pol, bpol = pol
        t0 = time.time()
        tot = {"heads": 0, "viol": 0}
        for j, fam in enumerate(FAMS):
            s = run_config(
                B=B,
                H=H,
                G=G,
                D=D,
                dtype=dt,
                qdtype=qdt,
                policy=pol,
                L0=L0,
                T=T,
                family=fam,
                seed=1000 * i + j + seed0,
                fast=fast,
                build_policy=bpol,
            )
            r = np.asarray(s.pop("ratios"))
            rec = {
                "cfg": name,
                "fam": fam,
                "seed": 1000 * i + j + seed0,
                **s,
                "min_ratio": float(r.min()) if r.size else None,
                "env": {k: os.environ.get(k) for k in ("CERTATTN_TIER1", "CERTATTN_RUNG0", "CERTATTN_TIER1_BPS")},
            }
            out.write(json.dumps(rec) + "\n")
            out.flush()
            tot["heads"] += s["heads"]
            tot["viol"] += s["viol"]
            if s["viol"]:
                print("VIOLATION", name, fam, s["examples"][:2], flush=True)
        # which path ran
        c = TieredKVCache.init(
            batch=B, capacity=max(L0) + T + pol.block_size, num_kv_heads=H, head_dim=D, dtype=dt, policy=bpol or pol
        )
        print(
            f"{name}: heads {tot['heads']} viol {tot['viol']} fused={stepmod.uses_fused_rung0(c, pol)} "
            f"tier1_kernel={stepmod.tier1_kernel_runs(c, pol.tier1)} {time.time() - t0:.0f}s",
            flush=True,
        )
