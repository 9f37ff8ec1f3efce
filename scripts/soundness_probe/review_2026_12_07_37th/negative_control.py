"""The comparator of equiv_direct.py detects a one-ulp change in one element of one leaf, a changed memory kind and
a changed static field (a check that the probe can fail).

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_37th/negative_control.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax.numpy as jnp
import numpy as np
from equiv_direct import POLICY, build, compare, layers_kv

ks, vs = layers_kv(3, 2, jnp.bfloat16, 0)
lengths = jnp.array([40, 96], jnp.int32)
ref, _ = build(ks, vs, lengths, POLICY, 1, "loop")
rep = []
compare("control: itself", ref, ref, rep)
x = np.array(ref.v_err)
x.flat[17] = np.nextafter(x.flat[17], np.float32(np.inf))
compare("control: v_err one ulp up", ref.replace(v_err=jnp.asarray(x)), ref, rep)
compare("control: host_k on the device", ref.replace(host_k=jnp.asarray(np.array(ref.host_k))), ref, rep)
compare("control: static value_bits", ref.replace(value_bits=2), ref, rep)
print("expected [True, False, False, False]:", [ok for _, ok, _ in rep])
