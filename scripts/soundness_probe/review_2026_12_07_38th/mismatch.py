"""from_staging(dense, lengths=given) where the given lengths differ from the device lengths for one sequence of a
ragged batch of 3. Decodes N steps with the tiered cache, a reference tiered cache (lengths=None) and the dense
staging cache itself (exact attention), same forced tokens. Reports, per sequence: whether any head was certified,
the max |logits - dense logits|, and whether the unaffected sequences match the reference cache bit for bit.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/soundness_probe/review_2026_12_07_38th/mismatch.py
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax.model_cache import cache_spec
from certattn_jax.policy import CertPolicy
from models import generate as gen
from models import llama
from models.config import LlamaConfig

CFG = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=8, max_position_embeddings=512)
POL = CertPolicy(block_size=8, group_size=8, eps=1e-3, hot_slots=8, k_max=4)
DT = jnp.float32
CAP = 88
N = 12
spec = cache_spec("certified", CFG, DT, POL, schedule="unrolled")
params = llama.init_params(CFG, jax.random.key(0), DT, scale=1.0)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (45, 50, 24)]
true = np.array([45, 50, 24])


fwd = jax.jit(lambda p, t, c: llama.forward(p, CFG, t, c))


def staging():
    st, lg = gen.prefill(params, CFG, prompts, CAP, cache_factory=lambda b, c: spec.staging(b, c))
    return st, lg


def run(given):
    dense, lg = staging()
    ref_st, _ = staging()
    tiered = spec.from_staging(dense, lengths=given)
    ref = spec.from_staging(ref_st)
    toks = rng.integers(0, CFG.vocab_size, (N, 3))
    err = np.zeros(3)
    certified_any = np.zeros(3, bool)
    same_as_ref = np.ones(3, bool)
    for t in range(N):
        tok = jnp.asarray(toks[t][:, None], jnp.int32)
        lg_d, dense = fwd(params, tok, dense)
        lg_t, tiered = fwd(params, tok, tiered)
        lg_r, ref = fwd(params, tok, ref)
        cert = tiered.last_certificate
        certified_any |= np.asarray(cert.certified).any(axis=(0, 2))
        err = np.maximum(err, np.abs(np.asarray(lg_t) - np.asarray(lg_d)).max(axis=(1, 2)))
        same_as_ref &= np.all(np.asarray(lg_t) == np.asarray(lg_r), axis=(1, 2))
    err_ref = 0.0
    print(f"given {list(given)} (device {true.tolist()}): certified_any={certified_any.tolist()} "
          f"max|logit - dense|={np.array2string(err, precision=3)} same_as_ref={same_as_ref.tolist()}", flush=True)
    return certified_any, err


run(true)                      # control
run(np.array([45, 40, 24]))    # below, spanning a block boundary (device 50, flushed 48 -> given 40)
run(np.array([45, 49, 24]))    # below, same block
run(np.array([45, 56, 24]))    # above, a block further
run(np.array([45, 50, 0]))     # 0 for a 24-token prompt
