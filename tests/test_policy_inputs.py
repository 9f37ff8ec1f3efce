"""CertPolicy's tolerances are real finite scalars, refused by name when the policy is made (not later, deep inside a
certified step, and never silently: an infinite eps certified every head whatever its bound)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certattn_jax.policy import CertPolicy

LAYOUT = dict(block_size=16, group_size=16, k_max=2)


@pytest.mark.parametrize("bad, error, message", [
    (dict(eps=float("inf")), ValueError, "eps must be finite"),
    (dict(abs_tol=float("inf")), ValueError, "abs_tol must be finite"),
    (dict(eps=float("-inf")), ValueError, "eps must be finite"),
    (dict(rank_margin=float("inf")), ValueError, "rank_margin must be finite"),
    (dict(eps=np.float64("nan")), ValueError, "eps must not be NaN"),
    (dict(eps=jnp.float32(float("nan"))), ValueError, "eps must not be NaN"),
    (dict(eps=jnp.float32(float("inf"))), ValueError, "eps must be finite"),
    (dict(eps=jnp.float32(-1.0)), ValueError, "eps.*>= 0"),
    (dict(tau_cov=jnp.float32(5.0)), ValueError, r"tau_cov must be in \(0, 1\]"),
    (dict(tau_cov=jnp.float32(-1.0)), ValueError, "tau_cov"),
    (dict(eps=1 + 2j), TypeError, "eps must be a real number"),
    (dict(eps=np.complex64(1)), TypeError, "eps must be a real number"),
    (dict(eps=None), TypeError, "eps must be a real number, got None"),
    (dict(eps=[0.1]), TypeError, r"eps must be a real number, got \[0.1\]"),
    (dict(v_tol=jnp.asarray(True)), TypeError, "v_tol must be a real number"),
    (dict(eps=np.array([0.1, 0.2])), ValueError, r"eps must be a scalar, got shape \(2,\)"),
    (dict(eps=jnp.array([0.1, 0.2, 0.3])), ValueError, r"eps must be a scalar, got shape \(3,\)"),
])
def test_a_bad_tolerance_is_refused_by_name_when_the_policy_is_made(bad, error, message):
    with pytest.raises(error, match=message):
        CertPolicy(**LAYOUT, **bad)
    with pytest.raises(error, match=message):  # replace() goes through the same checks
        dataclasses.replace(CertPolicy(**LAYOUT), **bad)


@pytest.mark.parametrize("good", [
    dict(eps=0), dict(eps=0.1), dict(eps=np.float32(0.1)), dict(eps=np.array(0.1)), dict(eps=jnp.float32(0.1)),
    dict(eps=1e9, abs_tol=1e-3), dict(tau_cov=np.float32(1.0)), dict(layer_fallback_fraction=2.0),
])
def test_real_finite_scalars_are_accepted(good):
    policy = CertPolicy(**LAYOUT, **good)
    for name, value in good.items():
        assert getattr(policy, name) is value  # kept as given (a device scalar stays on the device)


def test_traced_tolerances_are_accepted_when_scalar_and_real():
    """Inside jit a tolerance cannot be read: its shape and dtype are still checked."""
    eps = jax.jit(lambda e: CertPolicy(**LAYOUT, eps=e).eps * 2)(jnp.float32(0.1))
    assert float(eps) == pytest.approx(0.2)
    with pytest.raises(ValueError, match=r"eps must be a scalar, got shape \(2,\)"):
        jax.jit(lambda e: CertPolicy(**LAYOUT, eps=e))(jnp.zeros(2))
    with pytest.raises(TypeError, match="abs_tol must be a real number"):
        jax.jit(lambda e: CertPolicy(**LAYOUT, abs_tol=e))(jnp.zeros((), jnp.complex64))


def test_the_pytree_rebuilds_without_checks_and_keeps_hashing_and_paths():
    """jax rebuilds a policy from device arrays, tracers and its own placeholders (e.g. `flatten_axes` fills the
    tree with sentinel objects): never validated there, the leaves kept as they are. Hash, equality and key paths
    are those of the frozen dataclass."""
    policy = CertPolicy(**LAYOUT, eps=0.02)
    leaves, tree = jax.tree.flatten(policy)
    assert leaves == [0.02, 0.0, 0.995, 0.1, 0.5, 0.5]
    sentinels = [object() for _ in leaves]
    assert jax.tree.unflatten(tree, sentinels).eps is sentinels[0]
    assert jax.tree.map(lambda _: None, policy).k_max == 2
    moved = jax.jit(lambda p: p)(policy)
    assert isinstance(moved.eps, jax.Array) and moved.layout() == policy.layout()
    assert float(jax.vmap(lambda x, p: x * p.eps, in_axes=(0, None))(jnp.ones(3), policy)[0]) == pytest.approx(0.02)
    assert policy == CertPolicy(**LAYOUT, eps=0.02) and hash(policy) == hash(CertPolicy(**LAYOUT, eps=0.02))
    assert jax.jit(lambda x, p: x * p.eps, static_argnums=1)(1.0, policy) == pytest.approx(0.02)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(policy)[0]]
    assert paths[0] == ".eps" and len(paths) == 6
    assert policy.replace(eps=0.5).eps == 0.5


def test_a_head_dim_the_group_size_does_not_divide_names_the_fix():
    """head_dim 80 (and 48, 100, ...) with the default value group size 32: the error says what to pass (an audit
    found only the CLI's did)."""
    from certattn_jax import TieredKVCache

    k = jnp.ones((1, 20, 1, 80), jnp.float32)
    for build in (lambda: TieredKVCache.init(batch=1, capacity=64, num_kv_heads=1, head_dim=80, policy=CertPolicy()),
                  lambda: TieredKVCache.from_dense(k, k, policy=CertPolicy(), capacity=64)):
        with pytest.raises(ValueError, match=r"value group size 32: pass CertPolicy\(group_size=\.\.\.\).*e\.g\. 16"):
            build()
    TieredKVCache.from_dense(k, k, policy=CertPolicy(group_size=16), capacity=64)  # the fix works
    # the suggestion is a size the policy takes (>= 2), also where gcd(head_dim, group) is 1
    from certattn_jax.quant import suggested_group_size

    assert [suggested_group_size(h, g) for h, g in ((80, 32), (48, 32), (6, 4), (10, 4))] == [16, 16, 2, 2]
    for h, g in ((6, 4), (10, 4)):  # the suggestion builds a cache
        kk = jnp.ones((1, 20, 1, h), jnp.float32)
        TieredKVCache.from_dense(kk, kk, policy=CertPolicy(group_size=suggested_group_size(h, g)), capacity=64)
    k9 = jnp.ones((1, 20, 1, 9), jnp.float32)  # an odd head_dim: no group size fits, and the error says so
    with pytest.raises(ValueError, match="head_dim 9 is odd"):
        TieredKVCache.from_dense(k9, k9, policy=CertPolicy(group_size=4), capacity=64)
