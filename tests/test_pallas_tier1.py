"""The tier-1 Pallas kernel (interpret mode on CPU) against its jnp reference, the reference against float64
numpy, and the kernel on a real TieredKVCache against `step.build_context`.

Interpret mode fills every output buffer with NaN before the kernel runs (checked below), so "no NaN in the
output" means the kernel wrote every element. Shapes are tiny: each distinct shape/config is one slow compile.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certattn_jax import quant
from pallas_kernels import backend
from pallas_kernels.tier1_pass import Tier1Partials, naive_output, tier1_pass, tier1_pass_reference

GS = 32


def _inputs(seed, B, H, G, nb, Bk, d, n_valid, key_bits=8):
    """Fresh random tier-1 arrays (quantized from Gaussian keys/values with outliers) and a query."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(B, H, nb, Bk, d)) * rng.uniform(0.5, 3.0, size=(1, 1, 1, 1, d))
    v = rng.normal(size=(B, H, nb, Bk, d)) + rng.normal(size=(1, H, 1, 1, d))
    k[..., 0, 3] = 25.0  # an outlier channel value: a wide per-block scale
    kc, ks, kz = quant.quantize_keys(jnp.asarray(k, jnp.float32), key_bits)
    vc, vs, vz = quant.quantize_values(jnp.asarray(v, jnp.float32), GS, 4)
    q = jnp.asarray(rng.normal(size=(B, H, G, d)) * 2.0, jnp.float32)
    return q, kc, ks, kz, vc, vs, vz, jnp.asarray(n_valid, jnp.int32)


def _assert_close(got: Tier1Partials, want: Tier1Partials, rtol=3e-5):
    for name in Tier1Partials._fields:
        if getattr(want, name) is None:
            assert getattr(got, name) is None, name
            continue
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert g.shape == w.shape, name
        assert not np.isnan(g).any(), f"{name}: unwritten (NaN-poisoned) or NaN entries"
        fin = np.isfinite(w)
        np.testing.assert_array_equal(g[~fin], w[~fin], err_msg=f"{name}: empty blocks/splits must be -inf")
        scale = max(float(np.max(np.abs(w[fin]), initial=0.0)), 1e-30)
        np.testing.assert_allclose(g[fin], w[fin], rtol=rtol, atol=rtol * scale, err_msg=name)


def test_interpret_mode_poisons_outputs():
    """The premise of the NaN checks: an output the kernel never writes comes back NaN."""
    from jax.experimental import pallas as pl

    if not backend.interpret():
        pytest.skip("a compiled GPU kernel leaves unwritten outputs as whatever memory held: interpret mode only")

    def kernel(x_ref, o_ref):
        o_ref[0] = x_ref[0]  # writes one element of eight

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True)(
        jnp.ones((8,), jnp.float32))
    assert float(out[0]) == 1.0 and np.isnan(np.asarray(out[1:])).all()


@pytest.mark.parametrize("K", [16, 32, 64])
@pytest.mark.parametrize("layout", [(0, 0), (1, 1)])
def test_exact_int_dot_is_exact_for_every_contraction_length(K, layout):
    """The integer dots of the INT variants, inside a kernel (compiled on a GPU): exact against numpy. On the
    H200 an int8 MMA over 16 terms returned twice the product (tier1_pass.MIN_INT8_CONTRACTION); shorter
    contractions must take the float32 path and stay exact."""
    from jax.experimental import pallas as pl

    from pallas_kernels.tier1_pass import _exact_int_dot

    rng = np.random.default_rng(K)
    a = rng.integers(-65, 66, size=(K, 16) if layout[0] == 0 else (16, K)).astype(np.int8)
    b = rng.integers(-128, 128, size=(K, 32) if layout[1] == 0 else (32, K)).astype(np.int8)

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = _exact_int_dot(a_ref[...], b_ref[...], *layout)

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 32), jnp.float32),
                         interpret=backend.interpret())(jnp.asarray(a), jnp.asarray(b))
    a64 = a.astype(np.int64) if layout[0] == 1 else a.astype(np.int64).T
    b64 = b.astype(np.int64) if layout[1] == 0 else b.astype(np.int64).T
    np.testing.assert_array_equal(np.asarray(got).astype(np.int64), a64 @ b64)


# Ragged sequences: all blocks full, 2 of 5 (T not a multiple of the block is the same thing for tier 1: the
# partial last block lives in the residual), and none at all (T < one block).
RAGGED = dict(seed=1, B=3, H=2, G=4, nb=5, Bk=16, d=128, n_valid=[5, 2, 0])
SMALL = dict(seed=2, B=2, H=1, G=1, nb=3, Bk=16, d=64, n_valid=[3, 1], key_bits=4)


@pytest.mark.parametrize("case,per_block,bps", [
    (RAGGED, False, 2),  # 3 splits, the last one short; a sequence with no valid block
    (RAGGED, True, 2),
    (SMALL, False, None),  # default split size; G = 1, d = 64, 4-bit keys
    (SMALL, True, None),
    (dict(SMALL, G=3, key_bits=8), False, 2),  # SmolLM2's 3 query heads per KV head: padded to 4 inside
])
def test_kernel_matches_reference(case, per_block, bps):
    args = _inputs(**case)
    kw = dict(group_size=GS, key_bits=case.get("key_bits", 8), per_block_acc=per_block, blocks_per_split=bps)
    got = tier1_pass(*args, **kw)
    _assert_close(got, tier1_pass_reference(*args, **kw))
    m = np.asarray(got.m)
    n_valid = np.asarray(args[-1])
    for b in range(case["B"]):  # invalid blocks are empty, valid ones are not
        assert np.isneginf(m[b, ..., n_valid[b]:]).all() and np.isfinite(m[b, ..., :n_valid[b]]).all()
        assert (np.asarray(got.l)[b, ..., n_valid[b]:] == 0).all()


TWO = dict(RAGGED, B=2, n_valid=[4, 1])


@pytest.mark.parametrize("variant,case,per_block", [
    ("dot", TWO, False),
    ("dot_t", TWO, False),
    ("reduce", TWO, False),
    ("int_keys", TWO, False),
    ("int_keys", SMALL, False),  # G = 1 padded to 4 rows, 4-bit keys
    ("int_kv", TWO, False),
    ("int_kv", SMALL, True),
])
def test_other_variants_match_reference(variant, case, per_block):
    args = _inputs(**case)
    kw = dict(group_size=GS, blocks_per_split=2, key_bits=case.get("key_bits", 8), per_block_acc=per_block)
    _assert_close(tier1_pass(*args, variant=variant, **kw), tier1_pass_reference(*args, **kw))


@pytest.mark.parametrize("case,per_block", [(TWO, True), (dict(SMALL, G=3, key_bits=8), True), (TWO, False)])
def test_int_kv_emits_delta_and_padded_blocks(case, per_block):
    """The certify kernel's inputs straight from the tier-1 pass: Delta of every block (the same bound as
    bounds.key_delta_quantized, up to the order of its sums: the round-up covers any order, so the two agree
    to float32 rounding), the block axis padded with empty blocks, and the query-head axis left padded."""
    args = _inputs(**case)
    q_abs = jnp.abs(args[0]) * 1.5  # any non-negative array: the kernel must use this one, not |q|
    nb = case["nb"]
    kw = dict(group_size=GS, blocks_per_split=2, key_bits=case.get("key_bits", 8), per_block_acc=per_block,
              q_abs=q_abs, out_blocks=8)
    got = tier1_pass(*args, variant="int_kv", **kw)
    want = tier1_pass_reference(*args, **kw)
    _assert_close(got, want)
    assert got.m.shape[-1] == 8 and np.isneginf(np.asarray(got.m)[..., nb:]).all()
    assert (np.asarray(got.delta)[..., nb:] == 0).all()
    padded = tier1_pass(*args, variant="int_kv", padded_heads=True, **kw)
    G = case["G"]
    assert padded.m.shape[2] == 4 and not np.isnan(np.asarray(padded.delta)).any()
    np.testing.assert_array_equal(np.asarray(padded.delta)[:, :, :G], np.asarray(got.delta))
    with pytest.raises(ValueError, match="int_kv"):
        tier1_pass(*args, variant="int_keys", **kw)
    with pytest.raises(ValueError, match="out_blocks"):
        tier1_pass(*args, variant="int_kv", **dict(kw, out_blocks=nb - 1))


def test_int_kv_leaves_the_hot_blocks_out_of_the_splits():
    """hot_ids: the blocks the hot set holds are left out of the split accumulators and their value sums come
    back per slot (0 for an empty slot or a block that is not valid for the sequence); the splits plus the hot
    sums give the same attention output as the plain pass (nothing lost, nothing counted twice)."""
    case = dict(TWO, n_valid=[4, 2])
    args = _inputs(**case)
    hot = jnp.asarray([[[0, 3, -1], [2, -1, 1]], [[1, 3, 0], [-1, -1, -1]]], jnp.int32)  # seq 1: block 3 invalid
    kw = dict(group_size=GS, blocks_per_split=2, hot_ids=hot, q_abs=jnp.abs(args[0]), out_blocks=8, out_splits=4)
    got = tier1_pass(*args, variant="int_kv", **kw)
    _assert_close(got, tier1_pass_reference(*args, **kw))
    assert got.acc.shape[3] == 4 and np.isneginf(np.asarray(got.acc_m)[:, :, :, 3]).all()  # 3 splits, 1 padding
    assert got.hot_acc.shape == (2, 2, 4, 3, 128)
    hacc = np.asarray(got.hot_acc)
    assert (hacc[0, 0, :, 2] == 0).all() and (hacc[1, 0, :, 1] == 0).all() and (hacc[1, 1] == 0).all()
    plain = tier1_pass(*args, variant="int_kv", group_size=GS, blocks_per_split=2)
    m = np.asarray(got.m)[..., :4]
    big = np.max(m, axis=-1, keepdims=True)
    w_s = np.where(np.isfinite(np.asarray(got.acc_m)), np.exp(np.asarray(got.acc_m) - big), 0.0)
    num = np.einsum("bhgs,bhgsd->bhgd", w_s, np.asarray(got.acc))
    ids, nv = np.asarray(hot), np.asarray(args[-1])
    for b in range(2):
        for h in range(2):
            for k in range(3):
                n = ids[b, h, k]
                if 0 <= n < nv[b]:
                    num[b, h] += np.exp(m[b, h, :, n] - big[b, h, :, 0])[:, None] * hacc[b, h, :, k]
    den = np.sum(np.where(np.isfinite(m), np.exp(m - big), 0.0) * np.asarray(got.l)[..., :4], axis=-1)
    np.testing.assert_allclose(num / den[..., None], np.asarray(naive_output(plain)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="split layout"):
        tier1_pass(*args, variant="int_kv", **dict(kw, per_block_acc=True))


@pytest.mark.parametrize("Bk,counts", [(16, ([0, 5], [16, 1])), (64, ([37, 64], [16, 1]))])
def test_int_kv_slot_programs_compute_the_exact_items(Bk, counts):
    """The extra programs of the tier-1 launch: exact partials of the hot slots (one empty) and of the residual
    block (its first r_count tokens: 0, some, all), the padding slots empty; against `slot_partials_reference`
    and against float64; every slot output written (interpret mode poisons them with NaN). Bk = 64: the slot
    programs read a block in several chunks of `SLOT_ROWS` tokens, the residual's count ending inside one."""
    from pallas_kernels.tier1_pass import Slots, slot_partials_reference

    case = dict(TWO, n_valid=[4, 1], Bk=Bk)
    args = _inputs(**case)
    rng = np.random.default_rng(7)
    B, H, G, d, K = 2, 2, 4, 128, 3
    hot_k = jnp.asarray(rng.normal(size=(B, H, K, Bk, d)), jnp.bfloat16)
    hot_v = jnp.asarray(rng.normal(size=(B, H, K, Bk, d)) + 2.0, jnp.bfloat16)
    res_k = jnp.asarray(rng.normal(size=(B, H, Bk, d)) * 3.0, jnp.bfloat16)
    res_v = jnp.asarray(rng.normal(size=(B, H, Bk, d)), jnp.bfloat16)
    hot = jnp.asarray([[[0, 2, -1], [1, -1, 3]], [[0, -1, -1], [-1, 0, -1]]], jnp.int32)
    for r_count in counts:
        slots = Slots(hot_k=hot_k, hot_v=hot_v, hot_ids=hot, res_k=res_k, res_v=res_v,
                      r_count=jnp.asarray(r_count, jnp.int32), n_slots=8)
        q_abs = jnp.abs(args[0])
        kw = dict(group_size=GS, blocks_per_split=2, hot_ids=hot, q_abs=q_abs, out_blocks=8, out_splits=4,
                  slots=slots)
        got = tier1_pass(*args, variant="int_kv", **kw)
        _assert_close(got, tier1_pass_reference(*args, **kw))
        # float64: the slots' softmax statistics from scratch
        q64 = np.asarray(args[0], np.float64) / math.sqrt(d)
        for b in range(B):
            for h in range(H):
                for slot in range(8):
                    if slot < K:
                        keys = np.asarray(hot_k[b, h, slot], np.float64) if hot[b, h, slot] >= 0 else None
                        vals = np.asarray(hot_v[b, h, slot], np.float64)
                    elif slot == K and r_count[b] > 0:
                        keys = np.asarray(res_k[b, h], np.float64)[:r_count[b]]
                        vals = np.asarray(res_v[b, h], np.float64)[:r_count[b]]
                    else:
                        keys = None
                    m, lsum, acc = (np.asarray(x)[b, h, :, slot] for x in (got.slot_m, got.slot_l, got.slot_acc))
                    if keys is None:
                        assert np.isneginf(m).all() and (lsum == 0).all() and (acc == 0).all()
                        continue
                    sc = q64[b, h] @ keys.T  # [G, t]
                    w = np.exp(sc - sc.max(-1, keepdims=True))
                    np.testing.assert_allclose(m, sc.max(-1), rtol=1e-5, atol=1e-5)
                    np.testing.assert_allclose(lsum, w.sum(-1), rtol=1e-5)
                    np.testing.assert_allclose(acc, w @ vals, rtol=1e-4, atol=1e-4)
    ref = slot_partials_reference(args[0] / math.sqrt(d), q_abs, slots)
    assert ref[0].shape == (B, H, G, 8) and ref[2].shape == (B, H, G, 8, d)
    with pytest.raises(ValueError, match="slots need"):
        tier1_pass(*args, variant="int_kv", group_size=GS, slots=slots)


def test_reference_matches_float64_numpy():
    """tier1_pass_reference (float32 jnp) against an independent float64 computation of the block partials
    and of the finished (naive) attention output."""
    case = dict(RAGGED, B=2, n_valid=[5, 3])
    q, kc, ks, kz, vc, vs, vz, nv = _inputs(**case)
    ref = tier1_pass_reference(q, kc, ks, kz, vc, vs, vz, nv, group_size=GS, per_block_acc=True)
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731 - bf16 -> exact float64
    kcodes = np.asarray(quant.unpack(kc, 8), np.float64)
    k_hat = kcodes * f64(ks)[:, :, :, None, :] + f64(kz)[:, :, :, None, :]
    vcodes = np.asarray(quant.unpack_values(vc, 4), np.float64)  # as the cache packs them
    B, H, nb, Bk, d = k_hat.shape
    vg = vcodes.reshape(B, H, nb, Bk, d // GS, GS)
    v_hat = (vg * f64(vs)[..., None] + f64(vz)[..., None]).reshape(B, H, nb, Bk, d)
    s = np.einsum("bhgd,bhntd->bhgnt", f64(q), k_hat) / math.sqrt(d)
    m = s.max(-1)
    w = np.exp(s - m[..., None])
    valid = (np.arange(nb)[None, :] < np.asarray(nv)[:, None])[:, None, None, :]
    np.testing.assert_allclose(np.asarray(ref.m)[np.broadcast_to(valid, m.shape)], m[np.broadcast_to(valid, m.shape)],
                               rtol=1e-5, atol=1e-5)
    sel = np.broadcast_to(valid, m.shape)
    np.testing.assert_allclose(np.asarray(ref.l)[sel], w.sum(-1)[sel], rtol=1e-5)
    pv = np.einsum("bhgnt,bhntd->bhgnd", w, v_hat)
    np.testing.assert_allclose(np.asarray(ref.acc)[sel], pv[sel], rtol=1e-4, atol=1e-4 * np.abs(pv).max())
    # the finished output over the valid tokens, from the kernel's split partials
    got = np.asarray(naive_output(tier1_pass(q, kc, ks, kz, vc, vs, vz, nv, group_size=GS, blocks_per_split=2)))
    tok = np.repeat(valid[..., None], Bk, axis=-1).reshape(B, 1, 1, nb * Bk)
    st = np.where(tok, s.reshape(B, H, -1, nb * Bk), -np.inf)
    p = np.exp(st - st.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bhgt,bhtd->bhgd", p, v_hat.reshape(B, H, nb * Bk, d))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_kernel_on_a_cache_matches_build_context():
    """The kernel reads a TieredKVCache's own arrays and gives the INT8 partials of step.build_context."""
    from certattn_jax.cache import TieredKVCache
    from certattn_jax.policy import CertPolicy
    from certattn_jax.step import build_context

    policy = CertPolicy(block_size=16, group_size=GS)
    rng = np.random.default_rng(3)
    B, T, H, G, d = 2, 60, 2, 4, 128
    k = jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.float32)
    cache = TieredKVCache.from_dense(k, v, policy, capacity=64, lengths=jnp.array([60, 9]))  # 3 and 0 blocks
    q = jnp.asarray(rng.normal(size=(B, H * G, d)), jnp.float32)
    ctx = build_context(q, cache, policy)
    got = tier1_pass(ctx.q32, cache.k_codes, cache.k_scale, cache.k_zero, cache.v_codes, cache.v_scale,
                     cache.v_zero, cache.flushed // cache.block_size, group_size=GS, per_block_acc=True)
    _assert_close(got, Tier1Partials(m=ctx.apx.m, l=ctx.apx.l, acc=ctx.apx.acc, acc_m=ctx.apx.m))
    # the certified path's own call: the pre-scaled query with score_scale = 1 gives the same partials
    kernel_ctx = build_context(q, cache, dataclasses.replace(policy, tier1="pallas"))
    _assert_close(Tier1Partials(m=kernel_ctx.apx.m, l=kernel_ctx.apx.l, acc=kernel_ctx.apx.acc, acc_m=kernel_ctx.apx.m),
                  Tier1Partials(m=ctx.apx.m, l=ctx.apx.l, acc=ctx.apx.acc, acc_m=ctx.apx.m))


@pytest.mark.parametrize("seed", [0, 1])
def test_certified_attention_through_the_kernel(seed):
    """policy.tier1 = "pallas": the same rungs as the jnp path, outputs within float noise of it, and every
    head's true error (against float64 attention over what the cache stores) within its bound."""
    from certattn_jax.attention import certified_attention_step
    from certattn_jax.cache import TieredKVCache
    from certattn_jax.policy import CertPolicy
    from tests.float64_reference import attention_f64

    rng = np.random.default_rng(10 + seed)
    B, T, H, G, d = 2, 150, 2, 4, 32
    k = (rng.normal(size=(B, T, H, d)) * rng.uniform(0.5, 4.0, size=d)).astype(np.float32)
    v = (rng.normal(size=(B, T, H, d)) + 2.0).astype(np.float32)
    k[0, 40] *= 6.0  # a needle
    q = (rng.normal(size=(B, H * G, d)) * 1.5).astype(np.float32)
    jp = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
    step = jax.jit(certified_attention_step)
    cache = TieredKVCache.from_dense(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), jp)
    _, _, cache = step(jnp.asarray(q, jnp.float32), cache, dataclasses.replace(jp, eps=0.0))  # fill the hot set
    ref = attention_f64(q, k, v, [T] * B)
    for tol in (0.05, 1e-4):
        results = {}
        for impl in ("jnp", "pallas"):
            out, cert, _ = step(jnp.asarray(q, jnp.float32), cache, dataclasses.replace(jp, eps=tol, tier1=impl))
            err = np.linalg.norm(np.asarray(out, np.float64) - ref, axis=-1)
            assert np.all(err <= np.asarray(cert.error_bound)), (impl, tol)
            results[impl] = (np.asarray(out), cert)
        np.testing.assert_array_equal(results["pallas"][1].rung, results["jnp"][1].rung)
        np.testing.assert_allclose(results["pallas"][0], results["jnp"][0], rtol=1e-4, atol=1e-5)


def test_bad_inputs_are_named():
    q, kc, ks, kz, vc, vs, vz, nv = _inputs(**SMALL)
    with pytest.raises(ValueError, match="v_scale"):
        tier1_pass(q, kc, ks, kz, vc, vs[..., :1, :], vz, nv, group_size=GS, key_bits=4)
    with pytest.raises(ValueError, match="k_codes"):
        tier1_pass(q, kc, ks, kz, vc, vs, vz, nv, group_size=GS, key_bits=8)  # 4-bit codes read as 8-bit
    with pytest.raises(TypeError, match="k_codes"):
        tier1_pass(q, kc.astype(jnp.int32), ks, kz, vc, vs, vz, nv, group_size=GS, key_bits=4)
    with pytest.raises(ValueError, match="variant"):
        tier1_pass(q, kc, ks, kz, vc, vs, vz, nv, group_size=GS, key_bits=4, variant="fast")
    with pytest.raises(ValueError, match="n_valid"):
        tier1_pass(q, kc, ks, kz, vc, vs, vz, nv[:1], group_size=GS, key_bits=4)


def test_drop_promoted_blocks_and_combine_match_float64():
    """Split partials from the kernel, promoted blocks subtracted (a repeated id, an empty slot, and a block
    past one sequence's valid count), combined with exact items: equals float64 numpy over the per-block
    partials with those blocks masked out."""
    from pallas_kernels.split_combine import combine, drop_blocks, promoted_block_partials

    case = dict(RAGGED, B=2, n_valid=[5, 2])
    args = _inputs(**case)
    q, kc, ks, kz, vc, vs, vz, nv = args
    parts = tier1_pass(*args, group_size=GS, blocks_per_split=2)
    ids = jnp.array([[[1, 4, -1, 1], [0, 3, 2, -1]], [[4, 1, -1, -1], [0, -1, -1, -1]]], jnp.int32)  # [B, H, K]
    approx = promoted_block_partials(q, kc, ks, kz, vc, vs, vz, ids, group_size=GS)
    rng = np.random.default_rng(5)
    B, H, G, K, d = 2, 2, 4, 4, 128
    ex_m = jnp.asarray(np.where(rng.random((B, H, G, K)) < 0.8, rng.normal(size=(B, H, G, K)) * 3, -np.inf),
                       jnp.float32)
    ex_l = jnp.where(jnp.isfinite(ex_m), jnp.asarray(rng.uniform(1, 5, (B, H, G, K)), jnp.float32), 0.0)
    ex_acc = jnp.where(jnp.isfinite(ex_m)[..., None], jnp.asarray(rng.normal(size=(B, H, G, K, d)), jnp.float32), 0.0)
    out, lm = combine(drop_blocks(parts, ids, approx, 2), [(ex_m, ex_l, ex_acc)])

    m, l, pv = (np.asarray(x, np.float64) for x in tier1_pass_reference(*args, group_size=GS, per_block_acc=True)[:3])
    ids_np = np.asarray(ids)
    for b in range(B):
        for h in range(H):
            for n in set(ids_np[b, h][ids_np[b, h] >= 0]):
                m[b, h, :, n], l[b, h, :, n], pv[b, h, :, n] = -np.inf, 0.0, 0.0
    m_all = np.concatenate([m, np.asarray(ex_m, np.float64)], -1)
    l_all = np.concatenate([l, np.asarray(ex_l, np.float64)], -1)
    acc_all = np.concatenate([pv, np.asarray(ex_acc, np.float64)], -2)
    big = m_all.max(-1, keepdims=True)
    w = np.where(np.isfinite(m_all), np.exp(m_all - big), 0.0)
    den = (w * l_all).sum(-1)
    want = np.einsum("bhgn,bhgnd->bhgd", w, acc_all) / den[..., None]
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with np.errstate(divide="ignore"):
        want_lm = np.log(w * l_all) - np.log(den)[..., None]
    fin = np.isfinite(want_lm)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lm)), fin)
    np.testing.assert_allclose(np.asarray(lm)[fin], want_lm[fin], rtol=1e-5, atol=1e-5)
    odd = _inputs(seed=4, B=1, H=1, G=1, nb=1, Bk=16, d=96, n_valid=[1])
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        tier1_pass(*odd, group_size=GS, interpret=False)  # what Triton cannot compile is refused up front


def test_int8_pieces_are_an_exact_split():
    """The int_keys variant's fixed-point split: pieces fit int8 and reconstruct a to the stated remainder,
    for ordinary, huge, tiny (subnormal), zero and mixed-sign rows."""
    from pallas_kernels.tier1_pass import _int8_pieces

    rng = np.random.default_rng(6)
    rows = [rng.normal(size=64), rng.normal(size=64) * 1e30, rng.normal(size=64) * 1e-40, np.zeros(64),
            np.where(rng.random(64) < 0.5, -1.0, 1.0) * 2.0 ** rng.integers(-60, 60, 64)]
    a = jnp.asarray(np.stack(rows), jnp.float32)
    pieces, inv_f = _int8_pieces(a)
    P = np.asarray(pieces, np.float64).reshape(len(rows), 4, 64)
    assert np.abs(P).max() <= 65
    recon = np.asarray(inv_f, np.float64)[:, None] * np.einsum("gkc,k->gc", P, 2.0 ** (-7.0 * np.arange(4)))
    a64 = np.asarray(a, np.float64)
    # 2^-126: a platform that flushes subnormal inputs to zero (XLA on CPU does) loses them entirely
    bound = np.maximum(2.0 ** -26 * np.abs(a64).max(axis=1, keepdims=True), 2.0 ** -126)
    assert (np.abs(a64 - recon) <= bound).all()


@pytest.mark.parametrize("variant", ["dot_magic", "dot", "dot_t", "reduce", "int_keys", "int_kv"])
def test_kernels_lower_to_triton(variant, monkeypatch):
    """Cross-lower the compiled (non-interpret) kernel for CUDA on this CPU machine: catches what the Pallas
    Triton lowering rejects (unsupported primitives, literal stores, non-power-of-two tensors) without a GPU.
    It does not run Triton's own compiler (PTX), which only the GPU bench exercises."""
    monkeypatch.setenv("CERTATTN_PALLAS_INTERPRET", "0")  # Triton compiler params, as on a GPU
    args = _inputs(seed=7, B=1, H=2, G=4, nb=4, Bk=16, d=64, n_valid=[3])
    for per_block in (False, True):
        f = jax.jit(lambda *a, pb=per_block: tier1_pass(*a, group_size=GS, blocks_per_split=2, variant=variant,
                                                         per_block_acc=pb, interpret=False))
        allow = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        text = jax.export.export(f, platforms=["cuda"], disabled_checks=allow)(*args).mlir_module()
        assert "xla.gpu.triton" in text


def _stacked_case(seed=11, L=3, nb=5):
    """Three layers of tier-1 arrays stacked [L, ...], hot ids and slots for the certified launch."""
    from pallas_kernels.tier1_pass import Slots

    layers = [_inputs(seed=seed + i, B=2, H=2, G=4, nb=nb, Bk=16, d=64, n_valid=[4, 1]) for i in range(L)]
    q, nv = layers[0][0], layers[0][-1]
    stacked = [jnp.stack([lay[i] for lay in layers]) for i in range(1, 7)]
    rng = np.random.default_rng(seed)
    hot = jnp.asarray([[[0, 3], [1, -1]], [[0, -1], [-1, -1]]], jnp.int32)
    slots = Slots(hot_k=jnp.asarray(rng.normal(size=(2, 2, 2, 16, 64)), jnp.bfloat16),
                  hot_v=jnp.asarray(rng.normal(size=(2, 2, 2, 16, 64)), jnp.bfloat16), hot_ids=hot,
                  res_k=jnp.asarray(rng.normal(size=(2, 2, 16, 64)), jnp.bfloat16),
                  res_v=jnp.asarray(rng.normal(size=(2, 2, 16, 64)), jnp.bfloat16),
                  r_count=jnp.asarray([3, 16], jnp.int32), n_slots=4)
    kw = dict(group_size=GS, blocks_per_split=2, hot_ids=hot, q_abs=jnp.abs(q), out_blocks=8, out_splits=4,
              slots=slots)
    return q, stacked, nv, layers, kw


def test_int_kv_reads_a_layer_of_stacked_arrays_in_place():
    """layer=i with the stacked [L, ...] tier-1 arrays gives exactly what the kernel gives on layer i's own
    arrays (the model's loop over layers then launches it without slicing tier 1 first)."""
    q, stacked, nv, layers, kw = _stacked_case()
    for i in (0, 2):
        got = tier1_pass(q, *stacked, nv, variant="int_kv", layer=jnp.int32(i), **kw)
        want = tier1_pass(q, *layers[i][1:7], nv, variant="int_kv", **kw)
        for name in Tier1Partials._fields:
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
        _assert_close(got, tier1_pass_reference(q, *stacked, nv, layer=i, **kw))
    with pytest.raises(ValueError, match="leading layer axis"):
        tier1_pass(q, *stacked[:5], stacked[5][0], nv, variant="int_kv", layer=jnp.int32(0), **kw)


@pytest.mark.parametrize("hot_set", ["one layer's", "stacked"])
def test_the_certified_launch_lowers_to_triton(monkeypatch, hot_set):
    """The int_kv launch with everything the fused rung 0 asks of it (Delta, padded outputs, the hot set out of
    the splits, the slot programs, stacked tier-1 arrays read in place -- and the hot set and residual given as
    one layer's or read in place from stacked arrays too) cross-lowered for CUDA."""
    monkeypatch.setenv("CERTATTN_PALLAS_INTERPRET", "0")
    q, stacked, nv, _, kw = _stacked_case() if hot_set == "one layer's" else _stacked_slots_case()
    f = jax.jit(lambda q, layer, *a: tier1_pass(q, *a, variant="int_kv", layer=layer, interpret=False,
                                                padded_heads=True, **kw))
    allow = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = jax.export.export(f, platforms=["cuda"], disabled_checks=allow)(q, jnp.int32(1), *stacked,
                                                                          nv).mlir_module()
    assert "xla.gpu.triton" in text


@pytest.mark.parametrize("family", ["random", "same_sign", "offset", "tiny_weights", "huge_scales", "subnormal"])
def test_int_value_sums_are_within_their_rounding_bound(family):
    """docs/bounds.md section 13, per block and value group: the int_kv kernel's value sum (`_int_value_sum`,
    the function the kernel calls) against sum_i p_i (t_i code_ic + y_i) in float64 is within
    (a off t_max + b y_max) sum_i p_i + 4 B off 2^-126 -- and not vacuously: the worst case comes within a
    factor 1000 of the bound (so a coefficient off by that much would fail here)."""
    from certattn_jax import bounds
    from pallas_kernels.tier1_pass import _int_value_sum

    rng = np.random.default_rng(21)
    Bk, G, gs, bits = 64, 4, 32, 4
    off, u = 2 ** (bits - 1), bounds.U
    a = 5 * u + Bk * 2.0 ** -26 + bounds.gamma(3) * (1 + 0.0315 * Bk) + bounds.gamma(Bk - 1)
    b = bounds.gamma(Bk) + 2 * u
    worst = 0.0
    for trial in range(20):
        p = rng.uniform(0, 1, size=(Bk, G))
        p[rng.integers(Bk)] = 1.0  # the block max has weight 1
        t = rng.uniform(0.01, 1.0, size=Bk)
        y = rng.normal(size=Bk)
        if family == "same_sign":
            y = np.abs(y) + 3.0
            p = np.maximum(p, 0.9)
        elif family == "offset":
            y = 1002.0 + 0.01 * y
            t = t * 1e-3
        elif family == "tiny_weights":
            p = p * 2.0 ** -100
        elif family == "huge_scales":
            t = t * 1e30
            y = y * 1e30
        elif family == "subnormal":
            p = p * 2.0 ** -120
            t = t * 2.0 ** -10
        codes = rng.integers(0, 2 ** bits, size=(Bk, gs))
        packed = quant.pack(jnp.asarray(codes, jnp.uint8), bits)
        p32, t32, y32 = (jnp.asarray(x, jnp.float32) for x in (p, t, y))
        got = np.asarray(jax.jit(_int_value_sum, static_argnums=4)(p32, t32, y32, packed, bits), np.float64)
        p64, t64, y64 = (np.asarray(x, np.float64) for x in (p32, t32, y32))
        exact = np.einsum("ig,ic->gc", p64, t64[:, None] * codes + y64[:, None])  # [G, gs]
        claim = (a * off * np.abs(t64).max() + b * np.abs(y64).max()) * p64.sum(axis=0)[:, None] \
            + 4 * Bk * off * 2.0 ** -126
        err = np.abs(got - exact)
        assert np.all(err <= claim), (family, trial, float(np.max(err / claim)))
        worst = max(worst, float(np.max(err / claim)))
    if family == "subnormal" and not _flushes_subnormals():
        # this family exists for the absolute term, which covers platforms that flush subnormals to zero (XLA on
        # CPU); where they are kept (XLA on the H200), the sum is near exact and only the bound check applies
        return
    assert worst > 1e-3, worst


def _flushes_subnormals() -> bool:
    """Whether the default backend flushes a float32 subnormal product to zero."""
    product = jax.jit(lambda x, y: x * y)(jnp.float32(2.0 ** -127), jnp.float32(0.5))
    return float(product) == 0.0


def test_a_hot_set_of_any_size_lowers_to_triton(monkeypatch):
    """Triton needs power-of-two arrays: the split programs compare the hot ids one scalar at a time, so a hot set
    of 3 slots (and the slot programs reading it) still lowers for CUDA (the H200 run of 2026-12-01 found a
    vector load of the K ids failing to compile for K = 3)."""
    from pallas_kernels.tier1_pass import Slots

    monkeypatch.setenv("CERTATTN_PALLAS_INTERPRET", "0")
    args = _inputs(**dict(TWO, n_valid=[4, 1]))
    B, H, d, Bk, K = 2, 2, 128, 16, 3
    hot = jnp.asarray([[[0, 2, -1], [1, -1, 3]], [[0, -1, -1], [-1, 0, -1]]], jnp.int32)
    block = jnp.zeros((B, H, K, Bk, d), jnp.bfloat16)
    res = jnp.zeros((B, H, Bk, d), jnp.bfloat16)
    slots = Slots(hot_k=block, hot_v=block, hot_ids=hot, res_k=res, res_v=res, r_count=jnp.asarray([0, 5], jnp.int32),
                  n_slots=8)
    kw = dict(group_size=GS, blocks_per_split=2, hot_ids=hot, q_abs=jnp.abs(args[0]), out_blocks=8, out_splits=4,
              slots=slots)
    f = jax.jit(lambda *a: tier1_pass(*a, variant="int_kv", interpret=False, **kw))
    allow = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = jax.export.export(f, platforms=["cuda"], disabled_checks=allow)(*args).mlir_module()
    assert "xla.gpu.triton" in text


def _stacked_slots_case(seed=12, L=3):
    """`_stacked_case` with a different hot set and residual per layer, also stacked [L, ...]."""
    from pallas_kernels.tier1_pass import Slots

    q, stacked, nv, layers, kw = _stacked_case(seed=seed, L=L)
    rng = np.random.default_rng(seed + 100)
    hot = jnp.asarray(rng.integers(-1, 5, size=(L, 2, 2, 2)), jnp.int32)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.bfloat16)

    slots = Slots(hot_k=normal(L, 2, 2, 2, 16, 64), hot_v=normal(L, 2, 2, 2, 16, 64), hot_ids=hot,
                  res_k=normal(L, 2, 2, 16, 64), res_v=normal(L, 2, 2, 16, 64), r_count=kw["slots"].r_count,
                  n_slots=4)
    return q, stacked, nv, layers, dict(kw, hot_ids=hot, slots=slots)


def test_int_kv_reads_a_stacked_hot_set_and_residual_in_place():
    """With layer, a stacked hot set and residual ([L, ...]) are read in place like the tier-1 arrays: exactly
    what the kernel gives on layer i's own hot set and residual, and the reference agrees."""
    q, stacked, nv, _, kw = _stacked_slots_case()
    s = kw["slots"]
    for i in (0, 2):
        got = tier1_pass(q, *stacked, nv, variant="int_kv", layer=jnp.int32(i), **kw)
        own = s._replace(hot_k=s.hot_k[i], hot_v=s.hot_v[i], hot_ids=s.hot_ids[i], res_k=s.res_k[i],
                         res_v=s.res_v[i])
        want = tier1_pass(q, *stacked, nv, variant="int_kv", layer=jnp.int32(i), **dict(kw, hot_ids=own.hot_ids,
                                                                                         slots=own))
        for name in Tier1Partials._fields:
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
        _assert_close(got, tier1_pass_reference(q, *stacked, nv, layer=i, **kw))
    with pytest.raises(ValueError, match="both be stacked"):
        tier1_pass(q, *stacked, nv, variant="int_kv", layer=jnp.int32(0), **dict(kw, slots=own))


@pytest.mark.parametrize("bits,d", [(4, 128), (2, 64), (8, 32)])
def test_planar_packing_round_trips(bits, d):
    """pack_planar / unpack_planar invert each other, and the kernel-layout converters invert each other."""
    from certattn_jax.quant import pack_planar, unpack_planar
    from pallas_kernels.tier1_pass import kernel_layout, standard_layout

    codes = jnp.asarray(np.random.default_rng(bits).integers(0, 1 << bits, size=(3, 5, d)), jnp.uint8)
    packed = pack_planar(codes, bits)
    assert packed.shape == (3, 5, d * bits // 8)
    np.testing.assert_array_equal(np.asarray(unpack_planar(packed, bits)), np.asarray(codes))
    kc = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 16, d)), jnp.uint8)
    vc = quant.pack_values(codes, bits)  # the cache's packing
    np.testing.assert_array_equal(np.asarray(quant.unpack_values(vc, bits)), np.asarray(codes))
    k2, v2 = kernel_layout(kc, vc, 8, bits, True, True)
    assert k2.dtype == jnp.int8
    for got, want in zip(standard_layout(k2, v2, 8, bits, True, True), (kc, vc), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("key_signed,value_planar", [(True, True)])  # both options at once (CI time)
def test_kernel_layouts_give_the_standard_layouts_outputs_bit_for_bit(key_signed, value_planar):
    _check_kernel_options(dict(key_signed=key_signed, value_planar=value_planar))


def _check_kernel_options(lay):
    """Signed int8 key codes and planar value bytes change how the int_kv kernel unpacks, not its integer math:
    every output equals the standard layout's exactly -- for the plain pass and for the certified launch (Delta,
    the hot set out of the splits, the slot programs, stacked arrays read in place); and the reference agrees."""
    from pallas_kernels.tier1_pass import kernel_layout

    def same(got, want, name):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)

    args = _inputs(seed=21, B=2, H=2, G=3, nb=7, Bk=16, d=64, n_valid=[7, 4])
    q, kc, ks, kz, vc, vs, vz, nv = args
    k2, v2 = kernel_layout(kc, vc, 8, 4, lay["key_signed"], lay["value_planar"])
    for per_block in (False, True):
        kw = dict(group_size=GS, blocks_per_split=3, variant="int_kv", per_block_acc=per_block)
        want = tier1_pass(*args, **kw)
        got = tier1_pass(q, k2, ks, kz, v2, vs, vz, nv, **kw, **lay)
        for name in Tier1Partials._fields:
            if getattr(want, name) is not None:
                same(got, want, name)
        _assert_close(got, tier1_pass_reference(q, k2, ks, kz, v2, vs, vz, nv, **kw, **lay))
    q, stacked, nv, _, kw = _stacked_case()
    stacked[0], stacked[3] = kernel_layout(stacked[0], stacked[3], 8, 4, lay["key_signed"], lay["value_planar"])
    got = tier1_pass(q, *stacked, nv, variant="int_kv", layer=jnp.int32(1), **kw, **lay)
    q, stacked, nv, _, kw = _stacked_case()
    want = tier1_pass(q, *stacked, nv, variant="int_kv", layer=jnp.int32(1), **kw)
    for name in Tier1Partials._fields:
        if getattr(want, name) is not None:
            same(got, want, name)


def test_kernel_layouts_lower_to_triton_and_bad_layouts_are_named(monkeypatch):
    """Both layouts cross-lowered for CUDA; signed keys with 4-bit keys, or a layout for another variant, are
    refused with a named error."""
    from pallas_kernels.tier1_pass import kernel_layout

    monkeypatch.setenv("CERTATTN_PALLAS_INTERPRET", "0")
    q, kc, ks, kz, vc, vs, vz, nv = _inputs(seed=7, B=1, H=2, G=4, nb=4, Bk=32, d=64, n_valid=[3])
    k2, v2 = kernel_layout(kc, vc, 8, 4, True, True)
    _, v_inter = kernel_layout(kc, vc, 8, 4, False, False)
    allow = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    f = jax.jit(lambda *a: tier1_pass(*a, group_size=GS, blocks_per_split=2, variant="int_kv", interpret=False,
                                      key_signed=True, value_planar=True))
    text = jax.export.export(f, platforms=["cuda"], disabled_checks=allow)(q, k2, ks, kz, v2, vs, vz, nv).mlir_module()
    assert "xla.gpu.triton" in text
    with pytest.raises(TypeError, match="k_codes must be int8"):
        tier1_pass(q, kc, ks, kz, vc, vs, vz, nv, group_size=GS, variant="int_kv", key_signed=True)
    with pytest.raises(ValueError, match="int_kv variant only"):
        tier1_pass(q, k2, ks, kz, v2, vs, vz, nv, group_size=GS, variant="dot", key_signed=True)
    monkeypatch.setenv("CERTATTN_PALLAS_INTERPRET", "1")  # the other variants read planar values repacked
    _, v_planar = kernel_layout(kc, vc, 8, 4, False, True)
    got = tier1_pass(q, kc, ks, kz, v_planar, vs, vz, nv, group_size=GS, variant="dot", value_planar=True)
    want = tier1_pass(q, kc, ks, kz, v_inter, vs, vz, nv, group_size=GS, variant="dot", value_planar=False)
    for name in ("m", "l", "acc", "acc_m"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)


def test_int_kv_at_the_8b_layer_shape_matches_the_reference():
    """The 8B layer shape (G = 4, d = 128, Bk = 64, value group 32), both layouts. Regression: in interpret mode
    XLA computed a block's weights twice (two fusions of exp, differing in the last bit), so the int8 split's
    column max was a hair below a weight equal to a power of two; the first piece then came out 128 low and a
    value sum was off by 2-4 (docs/kernels.md). The split no longer assumes the max and the values agree."""
    ks = jax.random.split(jax.random.key(200), 3)  # the distribution of scripts/bench_kernels.py's checks
    kc, kscale, kzero = quant.quantize_keys(jax.random.normal(ks[0], (2, 8, 16, 64, 128)) * 2, 8)
    vc, vscale, vzero = quant.quantize_values(jax.random.normal(ks[1], (2, 8, 16, 64, 128)), GS, 4)
    args = (jax.random.normal(ks[2], (2, 8, 4, 128)), kc, kscale, kzero, vc, vscale, vzero,
            jnp.asarray([16, 11], jnp.int32))
    from pallas_kernels.tier1_pass import kernel_layout

    q, kc, ks_, kz, vc, vs, vz, nv = args
    k2, v2 = kernel_layout(kc, vc, 8, 4, True, True)
    lay = dict(key_signed=True, value_planar=True)  # two value groups per nibble plane
    for per_block in (False, True):
        kw = dict(group_size=GS, blocks_per_split=4, per_block_acc=per_block)
        _assert_close(tier1_pass(*args, variant="int_kv", **kw), tier1_pass_reference(*args, **kw))
        _assert_close(tier1_pass(q, k2, ks_, kz, v2, vs, vz, nv, variant="int_kv", **kw, **lay),
                      tier1_pass_reference(*args, **kw))


def test_fast_pass_split_rules():
    """The fast pass's blocks per split: "programs" (about 1,024 programs), "fewer" (the default: at least
    min(4, max(1, nb // 32)) blocks per split, nb per KV head: the 8B layer's 8K goes from 1 to 4, SmolLM2's 4K
    to 2, its 1K keeps 1; batch or large caches with more from "programs" keep those), or a fixed count;
    CERTATTN_TIER1_BPS names a bad choice at import."""
    import subprocess
    import sys

    from pallas_kernels.tier1_pass import fast_pass_blocks_per_split as bps

    assert [bps(1, 8, nb, "programs") for nb in (64, 128, 512, 2048)] == [1, 1, 4, 16]
    assert [bps(1, 8, nb, "fewer") for nb in (64, 128, 512, 2048)] == [2, 4, 4, 16]
    assert bps(1, 3, 16, "fewer") == bps(1, 3, 20, "fewer") == 1  # SmolLM2 1K
    assert bps(1, 3, 64, "fewer") == bps(1, 3, 68, "fewer") == bps(4, 3, 68, "fewer") == 2  # SmolLM2 4K
    assert bps(8, 8, 128, "fewer") == bps(8, 8, 128, "programs") == 8  # batch: "programs" gives more
    assert bps(8, 8, 512, "fewer") == bps(8, 8, 512, "programs") == 32
    assert bps(1, 8, 2, "3") == 2 and bps(1, 8, 100, "3") == 3
    if "CERTATTN_TIER1_BPS" not in os.environ:  # the default rule
        assert [bps(1, 8, nb) for nb in (64, 128, 512)] == [2, 4, 4]
    with pytest.raises(ValueError, match="split rule 'many'"):
        bps(1, 8, 100, "many")
    bad = subprocess.run([sys.executable, "-c", "import pallas_kernels.tier1_pass"], capture_output=True, text=True,
                         env={**os.environ, "CERTATTN_TIER1_BPS": "0", "JAX_PLATFORMS": "cpu"},
                         cwd=Path(__file__).resolve().parents[1])
    assert bad.returncode != 0 and "CERTATTN_TIER1_BPS='0'" in bad.stderr


def test_a_value_packing_the_kernel_cannot_walk_falls_back_to_xla():
    """head_dim 48 with value groups of 16 at 4 bits: planar codes (24 bytes per row) do not split into whole
    groups, so even interpret mode (which takes any size) must not run the kernel: the step answers through XLA
    with the same certificate as tier1="jnp" (it once raised deep inside the kernel's value walk)."""
    from certattn_jax.attention import certified_attention
    from certattn_jax.cache import TieredKVCache
    from certattn_jax.policy import CertPolicy
    from pallas_kernels import tier1_pass

    if not tier1_pass.cache_values_planar():
        pytest.skip("the planar value packing is off in this process")
    assert not tier1_pass.supports(16, 48, 16, 4)
    if not backend.interpret():  # compiled Triton (a GPU): 48 is not a power of two, refused either way
        assert not tier1_pass.supports(16, 48, 16)
        pytest.skip("the compiled kernel does not take head_dim 48 at all")
    assert tier1_pass.supports(16, 48, 16)  # interpreted: any size, so only the value packing refuses it
    policy = CertPolicy(block_size=16, group_size=16, k_max=2, tier1="pallas")
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.standard_normal((1, 40, 1, 48)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((1, 2, 48)), jnp.float32)
    cache = TieredKVCache.from_dense(k, v, policy=policy)
    out, cert = certified_attention(q, cache, policy)
    out_j, cert_j = certified_attention(q, cache, dataclasses.replace(policy, tier1="jnp"))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_j))
    np.testing.assert_array_equal(np.asarray(cert.error_bound), np.asarray(cert_j.error_bound))
