"""Probe F: what the public certified_attention_fast returns for a head it cannot answer (escalate set): its
certificate's rung field and its output, against certified_attention_step.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07/probe_fast_api.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import PATH, f64  # noqa: E402

from certattn_jax.attention import certified_attention_fast, certified_attention_step  # noqa: E402
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402

rng = np.random.default_rng(0)
pol = CertPolicy(block_size=16, group_size=16, k_max=2, v_max=2, eps=0.0, layer_fallback_fraction=2.0)
k = jnp.asarray(rng.standard_normal((1, 70, 2, 16)), jnp.float32)
v = jnp.asarray(rng.standard_normal((1, 70, 2, 16)), jnp.float32)
q = jnp.asarray(rng.standard_normal((1, 4, 16)), jnp.float32)
c = TieredKVCache.from_dense(k, v, policy=pol, capacity=80)
full_out, full_cert, _ = certified_attention_step(q, c, pol)
for top in (0, 1):
    out, cert, _, esc = certified_attention_fast(q, c, pol, top)
    print(f"[{PATH}] top_rung={top}: escalate={np.asarray(esc).tolist()} rung={np.asarray(cert.rung).tolist()} "
          f"bound={np.asarray(cert.error_bound).tolist()} certified={np.asarray(cert.certified).tolist()} "
          f"|out|={np.linalg.norm(f64(out), axis=-1).round(4).tolist()} "
          f"|out - full ladder out|={np.linalg.norm(f64(out) - f64(full_out), axis=-1).round(4).tolist()}")
print(f"[{PATH}] full ladder: rung={np.asarray(full_cert.rung).tolist()} "
      f"bound={np.asarray(full_cert.error_bound).tolist()}")
