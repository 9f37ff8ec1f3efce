"""Minimal reproduction of the process abort seen at d 128, G 8, H 8 (64 query heads): XLA:CPU's LLVM backend
fails instruction selection ("LLVM ERROR: Cannot select ... v64i8 ... X86ISD::SUBV_BROADCAST_LOAD ... In function:
not_and_fusion.1") while compiling the certified step, and the process aborts (no result, wrong or right).

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_shapes/repro_llvm_crash.py [Hq] [stage]
stage: "build" (from_dense only), "attend" (jitted certified_attention_step), "write" (jitted flush+write_token).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax.attention import certified_attention_step
from certattn_jax.cache import TieredKVCache
from certattn_jax.policy import CertPolicy

G = int(sys.argv[1]) if len(sys.argv) > 1 else 8
stage = sys.argv[2] if len(sys.argv) > 2 else "attend"
H, d, Bk, B = 8, 128, 16, 1
print("jax", jax.__version__, "devices", jax.devices(), "G", G, "stage", stage, flush=True)
rng = np.random.default_rng(0)
pol = CertPolicy(block_size=Bk, group_size=32, k_max=2, v_max=2)
k = jnp.asarray(rng.standard_normal((B, 44, H, d)), jnp.bfloat16)
v = jnp.asarray(rng.standard_normal((B, 44, H, d)), jnp.bfloat16)
c = TieredKVCache.from_dense(k, v, policy=pol, capacity=64, lengths=jnp.asarray([44], jnp.int32))
print("built", flush=True)
if stage == "write":
    c = jax.jit(lambda c, k, v: c.flush().write_token(k, v))(c, k[:, :1], v[:, :1])
    print("written", flush=True)
elif stage == "attend":
    q = jnp.asarray(rng.standard_normal((B, H * G, d)), jnp.bfloat16)
    o, cert, _ = jax.jit(certified_attention_step)(q, c, pol)
    print("attended", np.asarray(cert.rung).ravel()[:8], flush=True)
