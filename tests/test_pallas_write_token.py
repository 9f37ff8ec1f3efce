"""pallas_kernels.write_token (a decode step's token write into a model's stacked cache, one launch, in place)
against its jnp reference and against float64 numpy; its use in a model cache's decode step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certattn_jax import bounds
from pallas_kernels.write_token import write_token, write_token_reference


def _stack(rng, L, B, H, Bk, d, dtype, poison: bool):
    """Stacked cache arrays; with `poison`, the residual rows hold NaN (a row the kernel must not touch keeps it)."""
    fill = np.nan if poison else 0.0
    res_k = jnp.asarray(np.where(rng.random((L, B, H, Bk, d)) < 0.5, fill, rng.normal(size=(L, B, H, Bk, d))), dtype)
    res_v = jnp.asarray(np.where(rng.random((L, B, H, Bk, d)) < 0.5, fill, rng.normal(size=(L, B, H, Bk, d))), dtype)
    v_min = jnp.asarray(rng.normal(size=(L, B, H, d)) - 1.5, jnp.float32)
    v_max = v_min + jnp.asarray(rng.random((L, B, H, d)) * 3, jnp.float32)
    v_norm_max = jnp.asarray(rng.random((L, B, H)) * 8, jnp.float32)
    value_stats = jnp.asarray(rng.random((L, B, H, bounds.N_VALUE_STATS)), jnp.float32)
    v_err_max = jnp.asarray(rng.random((L, B, H)) * 0.2, jnp.float32)
    return res_k, res_v, v_min, v_max, v_norm_max, value_stats, v_err_max


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("L,B,H,Bk,d,layer", [(3, 2, 3, 16, 32, 2), (5, 1, 2, 64, 64, 0), (2, 3, 1, 16, 128, 1)])
def test_the_kernel_writes_one_row_and_the_statistics_of_one_layer(dtype, L, B, H, Bk, d, layer):
    rng = np.random.default_rng(L * 1000 + B * 100 + Bk + d + layer)
    stack = _stack(rng, L, B, H, Bk, d, dtype, poison=True)
    scale = 10.0 ** rng.uniform(-3, 3, size=(B, H, 1))  # each head its own magnitude
    k = jnp.asarray(rng.normal(size=(B, H, d)) * scale, dtype)
    v = jnp.asarray(rng.normal(size=(B, H, d)) * scale, dtype)
    r = jnp.asarray(rng.integers(0, Bk, size=B), jnp.int32).at[0].set(Bk - 1)
    if B > 1:  # a full residual or a sequence that takes no token: nothing is stored, neither row nor statistics
        r = r.at[-1].set(Bk)
    if B > 2:  # a position below the block (no valid cache has one): nothing stored either
        r = r.at[1].set(-3)
    got = jax.jit(write_token)(*stack, k, v, r, jnp.int32(layer))
    want = write_token_reference(*stack, k, v, r, jnp.int32(layer))
    names = ("res_k", "res_v", "v_min", "v_max")
    for name, g, w in zip(names, got, want, strict=False):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        # NaN where nothing was written, in both: the other rows, layers and heads are left alone
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)),
                                      err_msg=name)
    # the norm bounds: compiled, their sums run in another order and their square roots count Triton's error
    np.testing.assert_allclose(np.asarray(got[4]), np.asarray(want[4]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[5]), np.asarray(want[5]), rtol=1e-5)
    # the statistics a step reads: what `bounds.value_statistics` gives for the new range (STAT_INT kept)
    cols = bounds.value_statistics(got[2][layer], got[3][layer], stack[6][layer], jnp.zeros((B, H, 1)),
                                   jnp.zeros((B, H, 1)), Bk, 4)
    w = (np.asarray(r) >= 0) & (np.asarray(r) < Bk)  # the sequences written
    for i in (bounds.STAT_RANGE, bounds.STAT_ABS_NORM, bounds.STAT_ABS_MAX):
        np.testing.assert_allclose(np.asarray(got[5])[layer, ..., i][w], np.asarray(cols[i])[w], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[5])[layer, ..., bounds.STAT_INT],
                                  np.asarray(stack[5])[layer, ..., bounds.STAT_INT])
    others = [i for i in range(L) if i != layer]
    np.testing.assert_array_equal(np.asarray(got[5])[others], np.asarray(stack[5])[others])
    # against float64: the row holds the token, the range covers it, the norm bound covers its norm, tightly
    k64, v64 = np.asarray(k.astype(jnp.float32), np.float64), np.asarray(v.astype(jnp.float32), np.float64)
    rows_k, rows_v = np.asarray(got[0].astype(jnp.float32)), np.asarray(got[1].astype(jnp.float32))
    for b in range(B):
        if 0 <= int(r[b]) < Bk:
            np.testing.assert_array_equal(rows_k[layer, b, :, int(r[b])], k64[b])
            np.testing.assert_array_equal(rows_v[layer, b, :, int(r[b])], v64[b])
    assert np.all(np.asarray(got[2])[layer][w] <= v64[w]) and np.all(np.asarray(got[3])[layer][w] >= v64[w])
    norms = np.linalg.norm(v64, axis=-1)[w]
    bound = np.asarray(got[4], np.float64)[layer][w]
    assert np.all(bound >= norms) and np.all(bound <= np.maximum(norms * (1 + 1e-4), np.asarray(stack[4])[layer][w]))
    for i, name in zip(range(2, 6), ("v_min", "v_max", "v_norm_max", "value_stats"), strict=True):
        np.testing.assert_array_equal(np.asarray(got[i])[layer][~w], np.asarray(stack[i])[layer][~w], err_msg=name)


def test_a_non_finite_value_makes_the_norm_infinite():
    rng = np.random.default_rng(7)
    L, B, H, Bk, d = 2, 1, 2, 16, 32
    stack = _stack(rng, L, B, H, Bk, d, jnp.bfloat16, poison=False)
    v = jnp.asarray(rng.normal(size=(B, H, d)), jnp.bfloat16).at[0, 1, 3].set(jnp.inf)  # (k = v here)
    got = jax.jit(write_token)(*stack, v, v, jnp.zeros((B,), jnp.int32), jnp.int32(1))
    assert np.isinf(np.asarray(got[4])[1, 0, 1]) and np.isfinite(np.asarray(got[4])[1, 0, 0])


def test_bad_arguments_are_named():
    rng = np.random.default_rng(0)
    stack = _stack(rng, 2, 1, 2, 16, 32, jnp.bfloat16, poison=False)
    k = jnp.zeros((1, 2, 32), jnp.bfloat16)
    with pytest.raises(TypeError, match="cache dtype"):
        write_token(*stack, k.astype(jnp.float32), k, jnp.zeros((1,), jnp.int32), jnp.int32(0))
    with pytest.raises(ValueError, match="v_norm_max"):
        write_token(*stack[:4], stack[4][0], *stack[5:], k, k, jnp.zeros((1,), jnp.int32), jnp.int32(0))
    with pytest.raises(ValueError, match="value_stats"):
        write_token(*stack[:5], stack[5][..., :3], stack[6], k, k, jnp.zeros((1,), jnp.int32), jnp.int32(0))
    with pytest.raises(ValueError, match="r must be"):
        write_token(*stack, k, k, jnp.zeros((2,), jnp.int32), jnp.int32(0))


def test_the_kernel_lowers_to_triton(monkeypatch):
    """Cross-lower the compiled kernel for CUDA on this machine (what the Pallas Triton lowering rejects shows here
    without a GPU; Triton's own compile to PTX runs only on the GPU)."""
    monkeypatch.setenv("CERTATTN_PALLAS_INTERPRET", "0")
    stack = _stack(np.random.default_rng(1), 30, 1, 3, 64, 64, jnp.bfloat16, poison=False)
    k = jnp.zeros((1, 3, 64), jnp.bfloat16)
    f = jax.jit(lambda *a: write_token(*a, interpret=False))
    allow = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = jax.export.export(f, platforms=["cuda"], disabled_checks=allow)(
        *stack, k, k, jnp.zeros((1,), jnp.int32), jnp.int32(3)).mlir_module()
    assert "xla.gpu.triton" in text


def test_a_non_finite_token_flags_its_layer_and_heads_only(monkeypatch):
    """`TieredKVCache.write_layer_token` (the kernel path, interpreted) sets the non-finite flag of the written
    layer's (b, h) whose token holds a NaN or an inf, and no other layer's (the flag is updated for every layer
    at once, with the written layer selected, rather than through a slice of it)."""
    from certattn_jax import cache as cache_module
    from certattn_jax.cache import TieredKVCache
    from certattn_jax.policy import CertPolicy

    monkeypatch.setattr(cache_module, "WRITE_KERNEL", True)
    rng = np.random.default_rng(9)
    policy = CertPolicy(block_size=16, group_size=16, k_max=2)
    L, B, H, S, T, d = 3, 2, 2, 64, 20, 32  # per-layer k, v [B, H, S, d], the first T tokens valid
    kv = [(jnp.asarray(rng.normal(size=(B, H, S, d)), jnp.float32),
           jnp.asarray(rng.normal(size=(B, H, S, d)), jnp.float32)) for _ in range(L)]
    store = TieredKVCache.stacked_from_layers(tuple(k for k, _ in kv), tuple(v for _, v in kv),
                                             jnp.full((B,), T, jnp.int32), policy)
    assert store.writes_token_by_kernel(jnp.float32) and not bool(jnp.any(store.nonfinite))
    k = jnp.asarray(rng.normal(size=(B, 1, H, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, 1, H, d)), jnp.float32)
    k = k.at[1, 0, 0, 5].set(jnp.nan)  # (b, h) = (1, 0)
    v = v.at[0, 0, 1, 7].set(jnp.inf)  # (b, h) = (0, 1)
    out = jax.jit(lambda s, k, v, i: s.write_layer_token(i, k, v))(store, k, v, jnp.int32(1))
    want = np.zeros((L, B, H), bool)
    want[1, 1, 0] = want[1, 0, 1] = True
    np.testing.assert_array_equal(np.asarray(out.nonfinite), want)
    clean = jnp.asarray(rng.normal(size=(B, 1, H, d)), jnp.float32)
    again = jax.jit(lambda s, k, v, i: s.write_layer_token(i, k, v))(out, clean, clean, jnp.int32(2))
    np.testing.assert_array_equal(np.asarray(again.nonfinite), want)  # a finite token clears nothing, sets nothing


def test_a_negative_layer_means_the_same_layer_to_every_consumer(monkeypatch):
    """A model cache's `attend(-1, ...)` is `attend(L - 1, ...)` on the write-kernel path (the kernel clips its
    layer where a Python index counts from the end: the token once landed in layer 0 while layer L - 1 was read and
    certified); `write_layer_token` flags layer L - 1 for -1 and refuses a layer beyond the stack."""
    from certattn_jax import cache as cache_module
    from certattn_jax.cache import TieredKVCache
    from certattn_jax.model_cache import TieredModelCache
    from certattn_jax.policy import CertPolicy

    monkeypatch.setattr(cache_module, "WRITE_KERNEL", True)
    rng = np.random.default_rng(0)
    policy = CertPolicy(block_size=16, group_size=16, k_max=2)
    L, B, H, G, T, d = 3, 1, 1, 2, 40, 32
    layers = [TieredKVCache.from_dense(jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.float32),
                                       jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.float32), policy=policy,
                                       capacity=64) for _ in range(L)]
    model = TieredModelCache.from_layers(layers, num_q_heads=H * G, policy=policy)
    q = jnp.asarray(rng.normal(size=(B, 1, H * G, d)), jnp.float32)
    k = q[:, :, :1] * 3  # aligned with the query: the new token dominates the softmax
    v = jnp.full((B, 1, H, d), 20.0, jnp.float32)
    out_last, last = model.attend(L - 1, q, k, v, model.lengths + 1)
    out_neg, neg = model.attend(-1, q, k, v, model.lengths + 1)
    np.testing.assert_array_equal(np.asarray(out_neg), np.asarray(out_last))
    assert int(model.layer_view(-1).layer) == L - 1  # the layer the kernels read in place
    with pytest.raises(IndexError):
        model.layer_view(L)
    for a, b in zip(jax.tree.leaves(neg.replace(policy=None)), jax.tree.leaves(last.replace(policy=None)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    store = model.store
    bad = k.at[0, 0, 0, 3].set(jnp.nan)
    np.testing.assert_array_equal(np.asarray(store.write_layer_token(-1, bad, v).nonfinite)[:, 0, 0],
                                  [False, False, True])
    with pytest.raises(IndexError):
        store.write_layer_token(L, bad, v)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "xla"])
def test_a_sequence_that_takes_no_token_is_left_exactly_as_it_was(kernel, monkeypatch):
    """`active` (a stopped sequence in a batch that decodes on): through the kernel (interpreted) and through XLA, the
    inactive sequence's residual, running statistics, non-finite flag (its token holds a NaN here) and length stay
    as they were, bit for bit; the active one is written as without the mask."""
    from certattn_jax import cache as cache_module
    from certattn_jax.cache import TieredKVCache
    from certattn_jax.policy import CertPolicy

    monkeypatch.setattr(cache_module, "WRITE_KERNEL", kernel)
    rng = np.random.default_rng(4)
    policy = CertPolicy(block_size=16, group_size=16, k_max=2)
    L, B, H, S, T, d = 2, 2, 2, 64, 21, 32
    kv = [(jnp.asarray(rng.normal(size=(B, H, S, d)), jnp.float32),
           jnp.asarray(rng.normal(size=(B, H, S, d)), jnp.float32)) for _ in range(L)]
    store = TieredKVCache.stacked_from_layers(tuple(k for k, _ in kv), tuple(v for _, v in kv),
                                             jnp.full((B,), T, jnp.int32), policy)
    k = jnp.asarray(rng.normal(size=(B, 1, H, d)) * 50, jnp.float32).at[1, 0, 0, 2].set(jnp.nan)
    v = jnp.asarray(rng.normal(size=(B, 1, H, d)) * 50, jnp.float32)
    active = jnp.asarray([True, False])
    if kernel:
        got = jax.jit(lambda s, k, v, a: s.write_layer_token(1, k, v, a))(store, k, v, active)
        full = jax.jit(lambda s, k, v: s.write_layer_token(1, k, v))(store, k, v)
    else:
        store = TieredKVCache.from_dense(jnp.swapaxes(kv[1][0][:, :, :T], 1, 2),
                                         jnp.swapaxes(kv[1][1][:, :, :T], 1, 2), policy=policy, capacity=S)
        got = store.write_token(k, v, active)
        full = store.write_token(k, v)
        assert np.asarray(got.lengths).tolist() == [T + 1, T]
    for f in ("res_k", "res_v", "v_min", "v_max", "v_norm_max", "value_stats", "nonfinite"):
        g, s0, f_all = (np.asarray(getattr(x, f)) for x in (got, store, full))
        ax = g.ndim - (4 if f.startswith("res") else 3 if f in ("v_min", "v_max", "value_stats") else 2)  # B
        np.testing.assert_array_equal(np.take(g, 1, axis=ax), np.take(s0, 1, axis=ax), err_msg=f)  # untouched
        np.testing.assert_array_equal(np.take(g, 0, axis=ax), np.take(f_all, 0, axis=ax), err_msg=f)  # as unmasked
    assert bool(np.asarray(full.nonfinite).any())  # the NaN token, taken, would have flagged the sequence
    with pytest.raises(ValueError, match="active must be"):
        store.write_token(k, v, jnp.asarray([1, 0])) if not kernel else store.write_layer_token(1, k, v, [True])
