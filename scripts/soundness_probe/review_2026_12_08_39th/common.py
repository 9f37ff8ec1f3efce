"""Shared helpers of the 39th-session review probes (fused vs eager prefill conversion)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from certattn_jax import tiers  # noqa: E402
from certattn_jax.model_cache import cache_spec  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402
from models import generate as gen  # noqa: E402
from models import llama  # noqa: E402
from models.config import LlamaConfig  # noqa: E402

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)

_PARAMS = {}


def params(dtype=jnp.float32):
    key = jnp.dtype(dtype).name
    if key not in _PARAMS:
        _PARAMS[key] = llama.init_params(CFG, jax.random.key(0), dtype, scale=0.3)
    return _PARAMS[key]


def prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


def prefilled(fused, mode, ps, capacity, chunk, policy=POLICY, dtype=jnp.float32, spec_policy="same", **kw):
    gen.PREFILL_CONVERSION_IN_CHUNK = fused
    sp = policy if spec_policy == "same" else spec_policy
    spec = cache_spec(mode, CFG, dtype, sp)
    return gen.prefill(params(dtype), CFG, ps, capacity, cache_factory=spec, policy=policy, prefill_chunk=chunk, **kw)


def diff(a, b):
    """A list of the differences between two pytrees (leaf paths, what differs)."""
    out = []
    pa, ta = jax.tree_util.tree_flatten_with_path(a)
    pb, tb = jax.tree_util.tree_flatten_with_path(b)
    if ta != tb:
        return [f"treedef differs: {ta} vs {tb}"]
    for (path, x), (_, y) in zip(pa, pb, strict=False):
        name = jax.tree_util.keystr(path)
        if (x.shape, x.dtype, x.weak_type) != (y.shape, y.dtype, y.weak_type):
            out.append(f"{name}: aval {(x.shape, x.dtype, x.weak_type)} vs {(y.shape, y.dtype, y.weak_type)}")
        if (x.sharding.memory_kind, x.committed) != (y.sharding.memory_kind, y.committed):
            out.append(f"{name}: kind/committed {(x.sharding.memory_kind, x.committed)} vs "
                       f"{(y.sharding.memory_kind, y.committed)}")
        xa, ya = tiers.to_numpy(x), tiers.to_numpy(y)
        if xa.shape == ya.shape and xa.dtype == ya.dtype and np.ascontiguousarray(xa).tobytes() != \
                np.ascontiguousarray(ya).tobytes():
            out.append(f"{name}: values differ")
    return out
