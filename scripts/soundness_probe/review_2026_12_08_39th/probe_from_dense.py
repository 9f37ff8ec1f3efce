"""TieredModelCache.from_dense with host-given lengths (list / NumPy / jax / traced), out of range, mismatched
(poisoned), inside a user's jit; validate.checked_counts / host_checked_counts errors."""
from common import POLICY, diff, jax, jnp, np

from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.model_cache import TieredModelCache
from certattn_jax.validate import checked_counts, host_checked_counts

B, H, S, d, L = 3, 2, 64, 32, 2
rng = np.random.default_rng(0)


def dense(lengths):
    ks = [jnp.asarray(rng.standard_normal((B, H, S, d)), jnp.float32) for _ in range(L)]
    vs = [jnp.asarray(rng.standard_normal((B, H, S, d)), jnp.float32) for _ in range(L)]
    return DenseKVCache(k=tuple(ks), v=tuple(vs), lengths=jnp.asarray(lengths, jnp.int32))


def conv(dn, lengths=None):
    return TieredModelCache.from_dense(dn, num_q_heads=4, policy=POLICY, lengths=lengths)


dn = dense([40, 0, 64])
ref = conv(dn)
for name, given in [("list", [40, 0, 64]), ("tuple", (40, 0, 64)), ("np int64", np.array([40, 0, 64])),
                    ("np uint8", np.array([40, 0, 64], np.uint8)), ("jax int32", jnp.array([40, 0, 64])),
                    ("jax uint32", jnp.array([40, 0, 64], jnp.uint32))]:
    got = conv(dn, given)
    print(f"given {name}: {'same as no lengths' if not diff(got, ref) else diff(got, ref)[:3]}")
nf = lambda c: np.asarray(c.store.nonfinite).any(axis=(0, 2)).tolist()  # noqa: E731
print("mismatched [41, 0, 64] -> poisoned per sequence:", nf(conv(dn, [41, 0, 64])))
print("mismatched [40, 1, 63] -> poisoned per sequence:", nf(conv(dn, [40, 1, 63])))
for bad in ([65, 0, 0], [-1, 0, 0], [2**32 + 5, 0, 0], np.array([2**32 + 5, 0, 0]), [1.0, 2.0, 3.0],
            [True, False, True],
            [1, 2], np.array([[1, 2, 3]]), jnp.array([1.5, 2, 3]), np.array([2**64 - 1, 0, 0], np.uint64)):
    try:
        conv(dn, bad)
        print(f"given {bad!r}: NO ERROR")
    except Exception as e:  # noqa: BLE001
        print(f"given {bad!r}: {type(e).__name__}: {e}")
# the staging cache's own lengths out of range with given lengths in range: clipped, poisoned
dn2 = dense([40, 0, 64])
dn2 = dn2.replace(lengths=jnp.array([70, -3, 64], jnp.int32)) if hasattr(dn2, "replace") else dn2
c = conv(dn2, [40, 0, 64])
print("dense lengths [70,-3,64], given [40,0,64]: store.lengths", np.asarray(c.store.lengths).tolist(),
      "cache.lengths", np.asarray(c.lengths).tolist(), "poisoned", nf(c))

# inside a user's jit: traced lengths, NumPy lengths closed over
f = jax.jit(lambda dn, n: conv(dn, n))
got = f(dn, jnp.array([40, 0, 64]))
d = diff(got, conv(dn, [40, 0, 64]))
print("jit traced given:", "same as eager" if not d else d[:5])
got = f(dn, jnp.array([40, 0, 99]))
print("jit traced given out of range [40,0,99]: poisoned", nf(got))
g = jax.jit(lambda dn: conv(dn, np.array([40, 0, 64])))
got = g(dn)
d = diff(got, conv(dn, [40, 0, 64]))
print("jit NumPy given:", "same as eager" if not d else d[:5])
try:
    jax.jit(lambda dn: conv(dn, np.array([40, 0, 65])))(dn)
    print("jit NumPy given out of range: NO ERROR")
except Exception as e:  # noqa: BLE001
    print(f"jit NumPy given out of range: {type(e).__name__}: {e}")

print("--- checked_counts / host_checked_counts")
for bad in ([1.0, 2.0], np.array([True, False]), [1, 2, 3], [[1, 2]], [3, 0], [-1, 0], [2**32 + 5, 0],
            np.array([2**32 + 5, 0]), jnp.array([1.0, 2.0]), "ab", None, 5, np.array([2**63 - 1, 0])):
    for fn in (checked_counts, host_checked_counts):
        try:
            r = fn(bad, 2, 2, "n")
            print(f"{fn.__name__}({bad!r}): NO ERROR -> {r}")
        except Exception as e:  # noqa: BLE001
            print(f"{fn.__name__}({bad!r}): {type(e).__name__}: {e}")
r, b = checked_counts([1, 2], 2, 2, "n")
h = host_checked_counts([1, 2], 2, 2, "n")
print("ok:", type(r).__name__, r.dtype, r.tolist(), b, "| host:", type(h).__name__, h.dtype, h.tolist())
print("traced:", jax.jit(lambda x: checked_counts(x, 2, 2, "n"))(jnp.array([3, -1])))
try:
    jax.jit(lambda x: host_checked_counts(x, 2, 2, "n"))(jnp.array([1, 1]))
except Exception as e:  # noqa: BLE001
    print(f"host_checked_counts traced: {type(e).__name__}: {e}")
