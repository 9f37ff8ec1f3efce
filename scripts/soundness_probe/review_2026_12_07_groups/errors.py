"""Error paths of the grouped conversion (CPU). What is left of the caller's cache when a group fails:
 A. TieredKVCache.with_rows_converted (public) with a deleted staging layer in the FIRST group;
 B. the same with the deleted layer in a LATER group (layers 0-1 converted, the caller's store already donated);
 C. TieredModelCache.with_staged_sequences where the second group's program fails (simulated: the real program
    for group 1, a JaxRuntimeError for group 2, as a compile-time RESOURCE_EXHAUSTED of the smaller last group's
    own program would be); and the first group failing with a non-"external reference" error (simulated).
 D. with_staged_sequences with a deleted staging layer >= 1 (its own donation check).

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_groups/errors.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax import cache as cm
from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.kv_cache import was_donated
from certattn_jax.model_cache import cache_spec
from certattn_jax.policy import CertPolicy
from models.config import LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=5, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
CAP = 96
rng = np.random.default_rng(0)
spec = cache_spec("certified", CFG, jnp.float32, POLICY)


def layers(n):
    mk = lambda: tuple(jnp.asarray(rng.normal(size=(n, 2, CAP, 32)), jnp.float32) for _ in range(CFG.num_layers))  # noqa: E731
    return mk(), mk()


def report(tag, fn, victim):
    try:
        fn()
        print(f"{tag}: no error")
    except Exception as e:  # noqa: BLE001
        print(f"{tag}: {type(e).__name__}: {str(e).splitlines()[0][:140]}")
    print(f"    caller's cache donated (lost) afterwards: {was_donated(victim)}", flush=True)


ks, vs = layers(2)
lb = ks[0].nbytes + vs[0].nbytes
cm.CONVERT_GROUP_BYTES = 2 * lb  # groups [2, 2, 1]

# A / B
for bad_layer, tag in ((0, "A first group, deleted layer 0"), (3, "B later group, deleted layer 3")):
    store = spec(4, CAP).store
    ks2 = list(layers(2)[0])
    ks2[bad_layer].delete()
    report(tag, lambda: store.with_rows_converted(1, ks2, vs, jnp.array([40, 17], jnp.int32)), store)

# C
full = spec(4, CAP).with_staged_sequences(0, DenseKVCache(k=layers(4)[0], v=layers(4)[1],
                                                         lengths=jnp.array([50, 50, 50, 50], jnp.int32)))
staging = DenseKVCache(k=ks, v=vs, lengths=jnp.array([40, 17], jnp.int32))
real = cm._convert_layers_into
calls = []


def second_fails(*a, **k):
    calls.append(len(a[1]))
    if len(calls) == 2:
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: simulated failure of the second group's program")
    return real(*a, **k)


cm._convert_layers_into = second_fails
report("C later group fails (simulated)", lambda: full.with_staged_sequences(1, staging), full)
print("    groups run:", calls)
full = spec(4, CAP).with_staged_sequences(0, DenseKVCache(k=layers(4)[0], v=layers(4)[1],
                                                         lengths=jnp.array([50, 50, 50, 50], jnp.int32)))
cm._convert_layers_into = lambda *a, **k: (_ for _ in ()).throw(
    jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: simulated, raised before the program runs"))
report("C' first group fails before running (simulated, as the repo's test)", lambda: full.with_staged_sequences(1, staging), full)
cm._convert_layers_into = real

# D
full = spec(4, CAP).with_staged_sequences(0, DenseKVCache(k=layers(4)[0], v=layers(4)[1],
                                                         lengths=jnp.array([50, 50, 50, 50], jnp.int32)))
k3 = list(layers(2)[0])
k3[3].delete()
report("D with_staged_sequences, deleted staging layer 3", lambda: full.with_staged_sequences(
    1, DenseKVCache(k=tuple(k3), v=vs, lengths=jnp.array([40, 17], jnp.int32))), full)
