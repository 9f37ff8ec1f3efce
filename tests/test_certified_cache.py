"""The tiered cache and certified attention: storage, the ladder's rungs, integration, bad input.
(Bound soundness under random and adversarial inputs: tests/test_soundness.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certattn_jax import bounds, quant
from certattn_jax.attention import (
    certified_attention,
    certified_attention_step,
    dense_attention,
    exact_keys_values,
    naive_attention,
)
from certattn_jax.cache import TieredKVCache
from certattn_jax.memory import memory_report
from certattn_jax.policy import CertPolicy

POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=4)
cert_attn = jax.jit(certified_attention)  # the policy's tolerances are traced: one compile per layout


def _data(seed, B=2, T=150, H=2, G=2, d=32, q_scale=1.0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(keys[0], (B, T, H, d)).astype(dtype)
    v = jax.random.normal(keys[1], (B, T, H, d)).astype(dtype)
    q = (q_scale * jax.random.normal(keys[2], (B, H * G, d))).astype(dtype)
    return q, k, v


def _reference(q, k, v, lengths=None):
    """float64 exact attention [B, Hq, d] over the first lengths[b] tokens."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, d = k.shape
    G = q.shape[1] // H
    out = np.zeros(q.shape)
    for b in range(B):
        n = T if lengths is None else int(lengths[b])
        for h in range(q.shape[1]):
            s = k[b, :n, h // G] @ q[b, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ v[b, :n, h // G]
    return out


def _errors(out, ref):
    return np.linalg.norm(np.asarray(out, np.float64) - ref, axis=-1)


def test_quantizers_meet_their_error_bounds():
    x = jax.random.normal(jax.random.key(0), (4, 64, 32)) * jnp.linspace(0.01, 40, 32)
    for bits in (8, 4):
        packed, s, z = quant.quantize_keys(x, bits)
        assert packed.dtype == jnp.uint8 and packed.shape[-1] == 32 * bits // 8
        err = jnp.abs(quant.dequantize_keys(packed, s, z, bits) - x)
        assert bool(jnp.all(err <= s.astype(jnp.float32)[:, None] * (0.5 + quant.QUANT_ROUNDING_SLACK)))
    v = jax.random.normal(jax.random.key(1), (4, 64, 64)) * 3 + 1
    for bits in (4, 2):
        packed, s, z = quant.quantize_values(v, 32, bits)
        v_hat = quant.dequantize_values(packed, s, z, 32, bits)
        assert packed.shape[-1] == 64 * bits // 8
        # per-token error norms are what the value term uses
        assert bool(jnp.all(quant.token_error_norms(v, v_hat) >= jnp.linalg.norm(v - v_hat, axis=-1)))
    codes = jax.random.randint(jax.random.key(2), (3, 16), 0, 16).astype(jnp.uint8)
    assert bool(jnp.all(quant.unpack(quant.pack(codes, 4), 4) == codes))
    for packing in quant.VALUE_PACKINGS:  # either value packing round-trips and reconstructs the same values
        assert bool(jnp.all(quant.unpack_values(quant.pack_values(codes, 4, packing), 4, packing) == codes))
        packed, s, z = quant.quantize_values(v, 32, 4, packing)
        np.testing.assert_array_equal(np.asarray(quant.dequantize_values(packed, s, z, 32, 4, packing)),
                                      np.asarray(quant.dequantize_values(*quant.quantize_values(v, 32, 4), 32, 4)))
    planar = quant.pack_values(codes, 4, "planar")  # byte i: channel i (low nibble) and i + 8 (high)
    np.testing.assert_array_equal(np.asarray(planar & 15), np.asarray(codes[:, :8]))
    np.testing.assert_array_equal(np.asarray(planar >> 4), np.asarray(codes[:, 8:]))


@pytest.mark.parametrize("T", [5, 16, 47, 64])
def test_tier2_keeps_the_originals_and_append_paths_agree(T):
    _, k, v = _data(1, T=T)
    whole = TieredKVCache.from_dense(k, v, POLICY, capacity=80)
    step = TieredKVCache.init(batch=2, capacity=80, num_kv_heads=2, head_dim=32, dtype=jnp.float32, policy=POLICY)
    append = jax.jit(lambda c, a, b: c.append(a, b))
    for t in range(0, T, 7):
        step = append(step, k[:, t:t + 7], v[:, t:t + 7])
    for c in (whole, step):
        assert np.asarray(c.lengths).tolist() == [T, T]
        assert np.asarray(c.flushed).tolist() == [T // 16 * 16] * 2
        from certattn_jax.attention import exact_keys_values

        ek, ev = exact_keys_values(c)
        np.testing.assert_array_equal(np.asarray(ek)[:, :, :T], np.asarray(k).transpose(0, 2, 1, 3))
        np.testing.assert_array_equal(np.asarray(ev)[:, :, :T], np.asarray(v).transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(np.asarray(whole.k_codes), np.asarray(step.k_codes))
    np.testing.assert_array_equal(np.asarray(whole.v_codes), np.asarray(step.v_codes))
    # the running maxima (what a step reads instead of reducing tier 1) equal the maxima over the full blocks,
    # on both paths (one batched conversion, flushes one block at a time)
    n_full = T // 16
    # the running value norm covers every token written, the residual's included, as tightly as one norm bound
    norms = np.linalg.norm(np.asarray(v, np.float64), axis=-1).max(axis=1)  # [B, H]
    for c in (whole, step):
        for name, field, axes in (("v_err_max", "v_err", (2,)), ("v_scale_max", "v_scale", (2, 3)),
                                  ("v_zero_max", "v_zero", (2, 3))):
            blocks = np.abs(np.asarray(getattr(c, field), np.float32)[:, :, :n_full])
            want = blocks.max(axis=axes) if n_full else np.zeros(getattr(c, name).shape, np.float32)
            np.testing.assert_array_equal(np.asarray(getattr(c, name)), want, err_msg=name)
        got = np.asarray(c.v_norm_max, np.float64)
        assert np.all(got >= norms) and np.all(got <= norms * (1 + 1e-5) + 1e-30)
        # the statistics a step reads are those of the running fields, as every write leaves them
        cols = bounds.value_statistics(c.v_min, c.v_max, c.v_err_max, c.v_scale_max, c.v_zero_max, c.block_size,
                                       c.value_bits)
        np.testing.assert_array_equal(np.asarray(c.value_stats), np.asarray(jnp.stack(cols, axis=-1)))
        value_abs = np.maximum(np.abs(np.asarray(v, np.float64)).max(axis=1), 0)  # [B, H, d]
        assert np.all(np.asarray(c.value_stats)[..., bounds.STAT_ABS_NORM] >= np.linalg.norm(value_abs, axis=-1))


def test_certified_output_is_within_bound_and_better_than_naive():
    q, k, v = _data(2, q_scale=2.0)
    cache = TieredKVCache.from_dense(k, v, POLICY)
    out, cert = cert_attn(q, cache, POLICY)
    ref = _reference(q, k, v)
    err = _errors(out, ref)
    assert np.all(err <= np.asarray(cert.error_bound))
    naive_err = _errors(naive_attention(q, cache), ref)
    # diffuse random attention, promotions only from the resident hot set: certified may equal naive up to the
    # float rounding of the tier-1 implementation (the int_kv kernel rounds differently from XLA), never worse
    assert err.mean() <= naive_err.mean() * (1 + 1e-6)
    assert np.all(np.asarray(cert.rung) == 0)
    assert cert.error_bound.shape == (2, 4)
    # a NumPy query is taken as a jax array (the ladder indexes it with traced values)
    out_np, cert_np = cert_attn(np.asarray(q), cache, POLICY)
    np.testing.assert_array_equal(np.asarray(out_np), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(cert_np.error_bound), np.asarray(cert.error_bound))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_naive_through_the_tier1_kernel_matches_the_xla_naive(dtype):
    """naive_attention with policy.tier1 = "pallas" (the kernel's per-split sums + the residual's exact partials)
    computes what the XLA path computes over dequantized copies, on a ragged batch with residual tokens and a
    sequence shorter than one block (interpret mode on CPU)."""
    policy = dataclasses.replace(POLICY, tier1="pallas")
    q, k, v = _data(11, B=3, T=150, dtype=dtype)
    lengths = jnp.asarray([150, 9, 77], jnp.int32)
    cache = TieredKVCache.from_dense(k, v, policy, lengths=lengths)
    got = np.asarray(jax.jit(naive_attention)(q, cache, policy), np.float32)
    want = np.asarray(naive_attention(q, cache), np.float32)  # no policy: XLA
    tol = 2.0 ** -7 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert np.all(np.isfinite(got))


def _escalation_policy(**kw):
    return dataclasses.replace(POLICY, **kw)


def test_rung_1_widens_k_star_and_fills_the_hot_set():
    # tau_cov tiny -> K* = 0 at rung 0; a tight eps then needs the widened set.
    q, k, v = _data(3, q_scale=3.0)
    cache = TieredKVCache.from_dense(k, v, POLICY)
    probe = _escalation_policy(tau_cov=1e-9, eps=10.0)
    _, c0 = cert_attn(q, cache, probe)
    assert np.all(np.asarray(c0.rung) == 0) and np.all(np.asarray(c0.k_star) == 0)
    # rung 0 promotes only what the hot set holds: a fresh cache holds nothing, so nothing is promoted (no tier-2
    # read), whatever tau_cov asks for
    _, cold = cert_attn(q, cache, _escalation_policy(tau_cov=1.0, eps=10.0))
    assert np.all(np.asarray(cold.k_star) == 0)
    # a step that climbs to rung 1 fetches the top candidates and leaves them in the hot set
    step = jax.jit(certified_attention_step)
    _, c1, warm = step(q, cache, _escalation_policy(eps=0.0, abs_tol=0.0, v_max=0))
    assert np.all(np.asarray(c1.rung) >= 1)
    assert np.all(np.asarray(warm.hot_ids) >= 0) and np.all(np.asarray(cache.hot_ids) == -1)
    ek, ev = (np.asarray(x) for x in exact_keys_values(warm))
    for b in range(2):
        for h in range(2):
            for s, blk in enumerate(np.asarray(warm.hot_ids)[b, h]):
                np.testing.assert_array_equal(np.asarray(warm.hot_k)[b, h, s], ek[b, h, blk * 16:blk * 16 + 16])
                np.testing.assert_array_equal(np.asarray(warm.hot_v)[b, h, s], ev[b, h, blk * 16:blk * 16 + 16])
    # a tolerance between the rung-0 bound and the bound with the top candidates exact (at rung 0, now resident)
    _, wide = cert_attn(q, warm, _escalation_policy(tau_cov=1.0, eps=10.0))
    assert np.all(np.asarray(wide.rung) == 0) and np.all(np.asarray(wide.k_star) > 0)
    rel0 = np.asarray(c0.error_bound / c0.tolerance * 10.0)
    rel1 = np.asarray(wide.error_bound / wide.tolerance * 10.0)
    assert np.all(rel1 < rel0)
    eps = float(np.max(rel1)) * 1.01
    out, cert = cert_attn(q, cache, _escalation_policy(tau_cov=1e-9, eps=eps, v_max=0))
    rung = np.asarray(cert.rung)
    assert np.any(rung == 1)
    assert np.all(np.asarray(cert.k_star)[rung == 1] > 0)
    assert np.all(_errors(out, _reference(q, k, v)) <= np.asarray(cert.error_bound))


def test_rung_2_promotes_values_of_an_outlier_block():
    q, k, v = _data(4, q_scale=1e-3)  # near-uniform attention: E_key ~ 0, E_val dominated by the outlier
    v = v.at[:, 20].multiply(1e3)  # one token's value x1000 -> its block's INT4 error dominates E_val
    cache = TieredKVCache.from_dense(k, v, POLICY)
    _, base = cert_attn(q, cache, _escalation_policy(eps=10.0))
    eps = float(np.max(np.asarray(base.error_bound / base.tolerance * 10.0))) * 0.5
    out, cert = cert_attn(q, cache, _escalation_policy(eps=eps, k_max=1, layer_fallback_fraction=1.0))
    rung = np.asarray(cert.rung)
    assert np.any(rung == 2), rung
    assert np.all(_errors(out, _reference(q, k, v)) <= np.asarray(cert.error_bound))


@pytest.mark.parametrize("fetch_kernel", [None, True], ids=["default", "gather kernel"])
def test_rung_3_exact_head_and_rung_4_exact_layer(monkeypatch, fetch_kernel):
    """Rungs 3 and 4 forced: sound, and rung 4 is the dense path's output -- also when its tier-2 read is the
    gather kernel (interpreted here), which must copy the originals bit for bit."""
    from certattn_jax import select

    monkeypatch.setattr(select, "FETCH_KERNEL", fetch_kernel)
    # a fresh jit: the module-level one's cache does not key the fetch switch (read while tracing)
    cert_attn = jax.jit(lambda q, cache, policy: certified_attention(q, cache, policy))
    q, k, v = _data(5)
    cache = TieredKVCache.from_dense(k, v, POLICY)
    ref = _reference(q, k, v)
    impossible = _escalation_policy(eps=0.0, abs_tol=0.0, layer_fallback_fraction=2.0)
    # eps = 0 can never be met (not even by exact attention: its float error is counted); rung 4 disabled
    out3, c3 = cert_attn(q, cache, impossible)
    assert np.all(np.asarray(c3.rung) == 3)
    assert np.all(_errors(out3, ref) <= np.asarray(c3.error_bound))
    assert np.all(np.asarray(c3.k_star) == 150 // 16)
    out4, c4 = cert_attn(q, cache, _escalation_policy(eps=0.0, layer_fallback_fraction=0.5))
    assert np.all(np.asarray(c4.rung) == 4)
    dense = np.asarray(dense_attention(q, cache))
    if jax.default_backend() == "cpu":  # the dense path's computation, bit for bit
        np.testing.assert_array_equal(np.asarray(out4), dense)
    else:  # a GPU compiles the same float32 math in another program with its sums associated differently
        np.testing.assert_allclose(np.asarray(out4), dense, rtol=1e-4, atol=1e-6)  # H200: <= 1.6e-5 relative
    assert np.all(_errors(out4, ref) <= np.asarray(c4.error_bound))
    assert np.all(np.asarray(c4.ranking_ok))


def test_rung_3_in_one_gather_reads_only_the_flagged_heads_and_answers_as_the_per_head_loop(monkeypatch):
    """With the gather kernel, rung 3 fetches every block of the flagged KV heads in one launch (nothing for the
    others) and one dense attention answers them: the same outputs and bounds as the loop over heads (to
    float32 reassociation), 0 / inf for unflagged heads; and its answers hold against the float64 reference."""
    from certattn_jax import ladder, select, step

    q, k, v = _data(21, T=150)
    cache = TieredKVCache.from_dense(k, v, POLICY)
    ctx = step.build_context(q, cache, POLICY)
    need = jnp.array([[True, False], [False, True]])
    loop = jax.jit(ladder._rung3_per_head)(q, cache, need, ctx)
    asked = []
    fetch = select.fetch_blocks
    monkeypatch.setattr(select, "fetch_blocks", lambda *a: asked.append(a[4]) or fetch(*a))
    monkeypatch.setattr(select, "FETCH_KERNEL", True)  # the gather kernel (interpreted here)
    one = ladder.rung3_exact_heads(q, cache, need, ctx)  # eagerly: the fetch's ids are concrete
    (ids,) = asked
    flagged = np.asarray(need)
    np.testing.assert_array_equal(np.asarray(ids)[flagged], np.tile(np.arange(cache.num_blocks), (2, 1)))
    assert np.all(np.asarray(ids)[~flagged] == -1)  # nothing read for the other heads
    for got, want, name in zip(one, loop, ("out", "e_key", "e_num"), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7, err_msg=name)
    assert np.all(np.asarray(one[0])[~flagged] == 0) and np.all(np.isinf(np.asarray(one[1])[~flagged]))
    # through the whole ladder (rung 3 for every head, rung 4 off): within the certificates' bounds
    out3, c3 = cert_attn(q, cache, _escalation_policy(eps=0.0, abs_tol=0.0, layer_fallback_fraction=2.0))
    assert np.all(np.asarray(c3.rung) == 3)
    assert np.all(_errors(out3, _reference(q, k, v)) <= np.asarray(c3.error_bound))


def test_rung_4_equals_the_dense_cache_path_bit_for_bit():
    from certattn_jax.dense_cache import DenseKVCache

    q, k, v = _data(6, T=96, dtype=jnp.bfloat16)
    cache = TieredKVCache.from_dense(k, v, POLICY)
    out4, c4 = cert_attn(q, cache, _escalation_policy(eps=0.0, layer_fallback_fraction=0.1))
    assert np.all(np.asarray(c4.rung) == 4)
    dense = DenseKVCache.init(num_layers=1, batch=2, capacity=96, num_kv_heads=2, head_dim=32, dtype=jnp.bfloat16)
    dense = dense.replace(k=(k.transpose(0, 2, 1, 3),), v=(v.transpose(0, 2, 1, 3),),
                          lengths=jnp.array([95, 95], jnp.int32))
    out_dense, _ = dense.attend(0, q[:, None], k[:, 95:96], v[:, 95:96], jnp.array([96, 96], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out4), np.asarray(out_dense[:, 0]))


def test_ranking_check_fails_when_int4_keys_misrank_a_needle():
    B, T, H, d = 1, 256, 1, 32
    rng = np.random.default_rng(7)
    k = rng.normal(size=(B, T, H, d)).astype(np.float32)
    k[0, 100, 0, 0] = 40.0  # an outlier channel that the 4-bit grid of its block cannot resolve finely
    q = np.zeros((B, 1, d), np.float32)
    q[0, 0, 0] = 1.0
    q[0, 0, 1:] = rng.normal(size=d - 1) * 3
    v = rng.normal(size=(B, T, H, d)).astype(np.float32)
    pol = CertPolicy(block_size=16, group_size=16, key_bits=4, k_max=2, rank_margin=0.0, eps=10.0)
    cache = TieredKVCache.from_dense(jnp.asarray(k), jnp.asarray(v), pol)
    # one escalating step fills the hot set with the top candidates (rung 0 promotes only resident blocks)
    _, _, cache = jax.jit(certified_attention_step)(jnp.asarray(q), cache, dataclasses.replace(pol, eps=0.0))
    assert np.all(np.asarray(cache.hot_ids) >= 0)
    out, cert = cert_attn(jnp.asarray(q), cache, pol)
    assert np.all(_errors(out, _reference(q, k, v)) <= np.asarray(cert.error_bound))
    # with zero margin and 4-bit keys, some tail block's upper bound outranks a promoted one: escalation
    assert int(cert.rung[0, 0]) >= 1 or not bool(cert.ranking_ok[0, 0])


def test_hot_set_keeps_resident_blocks_and_fetches_only_missing():
    q, k, v = _data(8)
    cache = TieredKVCache.from_dense(k, v, POLICY)
    step = jax.jit(certified_attention_step)
    _, c0, same = step(q, cache, POLICY)  # answered at rung 0: no fetch, the hot set stays empty
    assert np.all(np.asarray(c0.rung) == 0) and np.all(np.asarray(same.hot_ids) == -1)
    _, _, c1 = step(q, cache, _escalation_policy(eps=0.0, abs_tol=0.0))  # rung 1 ran: it fetched the candidates
    ids1 = np.asarray(c1.hot_ids)
    assert np.all(ids1 >= 0)
    # the hot blocks hold exactly the originals of their block ids
    hk = np.asarray(c1.hot_k)
    kt = np.asarray(k).transpose(0, 2, 1, 3)
    for b in range(2):
        for h in range(2):
            for s, blk in enumerate(ids1[b, h]):
                np.testing.assert_array_equal(hk[b, h, s], kt[b, h, blk * 16:(blk + 1) * 16])
    _, _, c2 = step(q, c1, _escalation_policy(eps=0.0, abs_tol=0.0))  # same candidates: nothing moves
    np.testing.assert_array_equal(np.asarray(c2.hot_ids), ids1)
    _, c3, _ = step(q, c1, POLICY)  # now rung 0 promotes the resident candidates
    assert np.all(np.asarray(c3.rung) == 0) and np.all(np.asarray(c3.k_star) > 0)


def test_nonfinite_values_escalate_and_never_claim_a_bound():
    q, k, v = _data(9)
    v = v.at[0, 33, 1, 5].set(jnp.nan)
    cache = TieredKVCache.from_dense(k, v, POLICY)
    out, cert = cert_attn(q, cache, POLICY)
    bad = np.asarray(cert.error_bound)[0, 2:]  # query heads 2, 3 read KV head 1 of row 0
    assert np.all(np.isinf(bad))
    assert not np.any(np.asarray(cert.certified)[0, 2:])
    assert np.all(np.asarray(cert.rung)[0, 2:] >= 3)
    good = _errors(out, _reference(q, k, v))
    assert np.all(good[1] <= np.asarray(cert.error_bound)[1])
    assert np.all(good[0, :2] <= np.asarray(cert.error_bound)[0, :2])


def test_bad_input_errors():
    q, k, v = _data(10)
    cache = TieredKVCache.from_dense(k, v, POLICY, capacity=160)
    with pytest.raises(ValueError, match="overflow"):
        cache.append(k[:, :11], v[:, :11])
    with pytest.raises(ValueError, match="does not fit"):
        certified_attention(q[:, :3], cache, POLICY)
    with pytest.raises(ValueError, match="does not fit"):
        certified_attention(q[:1], cache, POLICY)
    with pytest.raises(TypeError, match="floating"):
        certified_attention(q.astype(jnp.int32), cache, POLICY)
    with pytest.raises(ValueError, match="policy layout"):
        certified_attention(q, cache, dataclasses.replace(POLICY, block_size=32))
    with pytest.raises(ValueError, match="Hkv"):
        TieredKVCache.from_dense(k, v[:, :, :1], POLICY)
    with pytest.raises(TypeError, match="floating"):
        TieredKVCache.from_dense(k.astype(jnp.int8), v.astype(jnp.int8), POLICY)
    with pytest.raises(ValueError, match="batch, kv heads"):
        cache.append(k[:1, :2], v[:1, :2])
    empty = TieredKVCache.init(batch=2, capacity=64, num_kv_heads=2, head_dim=32, policy=POLICY)
    with pytest.raises(ValueError, match="empty cache"):
        certified_attention(q, empty, POLICY)
    with pytest.raises(ValueError, match="key_bits"):
        CertPolicy(key_bits=3)
    kv = jnp.ones((1, 10, 2, 32))
    with pytest.raises(TypeError, match="lengths must be integers"):  # never truncated to 10
        TieredKVCache.from_dense(kv, kv, POLICY, lengths=[10.7])
    with pytest.raises(ValueError, match="capacity must be a positive integer"):  # never "the tokens given"
        TieredKVCache.from_dense(kv, kv, POLICY, capacity=0)


def test_memory_target_at_32k():
    cache = TieredKVCache.init(batch=1, capacity=32768, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
    report = memory_report(cache)
    assert report["tier1_fraction"] <= 0.44
    assert report["tier2_host_bytes"] == report["dense_bf16_bytes"]


def test_hot_set_replacement_is_least_recently_used():
    from certattn_jax import select

    hot = jnp.array([[[5, 6, 7, 8]]])
    wanted = jnp.array([[[6, 9, -1, -1]]])
    new, slot_of, fetch = select.plan_residency(hot, wanted, jnp.array([[[10, 3, 1, 7]]]))
    assert np.asarray(new).tolist() == [[[5, 6, 9, 8]]]  # slot 1 keeps 6; 9 evicts 7, the least recently used
    assert np.asarray(fetch).tolist() == [[[-1, -1, 9, -1]]] and np.asarray(slot_of).tolist() == [[[1, 2, -1, -1]]]
    new, _, _ = select.plan_residency(hot, wanted)  # without a use record: the first free slot
    assert np.asarray(new).tolist() == [[[9, 6, 7, 8]]]


def test_a_flushed_block_enters_the_hot_set_without_a_tier2_read(monkeypatch):
    from certattn_jax import tiers

    _, k, v = _data(12, T=40)
    cache = TieredKVCache.init(batch=2, capacity=64, num_kv_heads=2, head_dim=32, dtype=jnp.float32, policy=POLICY)
    for name in ("read_all", "read_head", "read_block"):
        monkeypatch.setattr(tiers, name, lambda *a, **kw: (_ for _ in ()).throw(AssertionError("tier-2 read")))
    write = jax.jit(lambda c, k1, v1: c.write_token(k1, v1).flush())  # traced (under the patch) once, not per op
    for t in range(40):  # decode-style writes; the model flushes after each step
        cache = write(cache, k[:, t:t + 1], v[:, t:t + 1])
        if t == 20:  # pretend slot 0 (block 0) was promoted at this step: block 1 must not evict it
            cache = cache.replace(hot_used=cache.hot_used.at[:, :, 0].set(21))
    monkeypatch.undo()
    ids = np.asarray(cache.hot_ids)
    assert ids[:, :, :2].tolist() == [[[0, 1]] * 2] * 2 and np.all(ids[:, :, 2:] == -1)
    kt = np.asarray(k).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(np.asarray(cache.hot_k)[:, :, 1], kt[:, :, 16:32])
    assert np.asarray(cache.hot_used)[:, :, 1].tolist() == [[32, 32]] * 2


def test_certificates_pack_into_one_array_exactly():
    """A model cache records a layer's certificate with one write of the packed form: every leaf comes back
    exactly (an infinite bound, rung 4, a large K*, both booleans)."""
    from certattn_jax.certificate import Certificate, pack, unpack

    f = jnp.asarray([[0.5, jnp.inf], [1e-30, 3.0]], jnp.float32)
    cert = Certificate(error_bound=f, e_key=f * 2, e_val=f / 3, e_num=f + 1, tolerance=f * 0 + 0.25,
                       k_star=jnp.asarray([[0, 7], [8191, 2]], jnp.int32),
                       rung=jnp.asarray([[0, 4], [1, 3]], jnp.int32),
                       ranking_ok=jnp.asarray([[True, False], [False, True]]),
                       certified=jnp.asarray([[False, True], [True, False]]))
    packed = pack(cert)
    assert packed.shape == (2, 2, 9) and packed.dtype == jnp.float32
    back = unpack(packed)
    for name in Certificate.__dataclass_fields__:
        got, want = np.asarray(getattr(back, name)), np.asarray(getattr(cert, name))
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)


def _model_step_inputs(seed: int, L: int, B: int, H: int, G: int, d: int):
    """One decode step's random inputs for every layer of a model cache: q [L, B, H*G, d], k, v [L, B, 1, H, d]."""
    keys = jax.random.split(jax.random.key(seed), 3)
    return (3.0 * jax.random.normal(keys[0], (L, B, H * G, d)), jax.random.normal(keys[1], (L, B, 1, H, d)),
            jax.random.normal(keys[2], (L, B, 1, H, d)))


@pytest.mark.parametrize("slots", [pytest.param(0, marks=pytest.mark.breadth), 8], ids=["k_max slots", "8 hot slots"])
def test_prefetch_makes_every_heads_candidates_resident_like_rung_1_would(slots):
    """hot_refresh "prefetch": after every step, each KV head's candidates of that step are resident -- the hot set
    that a deferred rung 1 leaves when every head widens (eps = 0 makes every head fail rung 0), step after step,
    although with a reachable eps almost every head answers at rung 0."""
    from certattn_jax.model_cache import TieredModelCache

    L, B, H, G, d, steps = 2, 2, 2, 2, 32, 8
    caches = {}
    for name, refresh, eps in (("prefetch", "prefetch", 0.05), ("every head at rung 1", "deferred", 0.0)):
        policy = dataclasses.replace(POLICY, eps=eps, abs_tol=0.0, hot_slots=slots, hot_refresh=refresh)
        singles = []
        for layer in range(L):
            _, k, v = _data(40 + layer, B=B, T=75, H=H, G=G, d=d)
            singles.append(TieredKVCache.from_dense(k, v, policy, capacity=96))
        caches[name] = TieredModelCache.from_layers(singles, num_q_heads=H * G, policy=policy).decode_fast_path()

    @jax.jit
    def model_step(model, q, k, v):
        for layer in range(L):
            _, model = model.attend(layer, q[layer][:, None], k[layer], v[layer], model.lengths + 1)
        return model.with_lengths(model.lengths + 1), model.last_certificate.rung

    at_rung0 = []
    for step in range(steps):
        q, k, v = _model_step_inputs(200 + step, L, B, H, G, d)
        rungs = {}
        for name in caches:
            caches[name], rungs[name] = model_step(caches[name], q, k, v)
        at_rung0.append(float(np.mean(np.asarray(rungs["prefetch"]) == 0)))
        assert np.all(np.asarray(rungs["every head at rung 1"]) >= 1)
        a, b = caches["prefetch"].store, caches["every head at rung 1"].store
        assert np.all(np.asarray(a.hot_pending) == -1)
        for f in ("hot_ids", "hot_k", "hot_v"):
            np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), err_msg=f"{f} {step}")
    assert np.mean(at_rung0) > 0.5, at_rung0  # the prefetching cache answered mostly at rung 0 meanwhile


@pytest.mark.parametrize("stacked", [False, True], ids=["row", "stacked LRU record"])
def test_layer_views_write_their_lru_record_back_through_jit_and_in_turn(monkeypatch, stacked):
    """A layer view stepped by the ladder and written back (`with_layer`) stores exactly its layer's `hot_used`,
    with or without CERTATTN_HOT_USED_STACKED: after a `jax.jit` boundary (which returns new arrays: identity says
    nothing there), for several views of one state written back in turn (the second must not put back its
    snapshot of the first's row), and for a traced negative layer index (the row a write of it updates)."""
    from certattn_jax import cache as cache_module
    from certattn_jax.model_cache import TieredModelCache

    monkeypatch.setattr(cache_module, "HOT_USED_STACKED", stacked)
    policy = dataclasses.replace(POLICY, k_max=2, hot_slots=4, eps=0.002, abs_tol=0.0)
    rng = np.random.default_rng(11)
    layers = []
    for _ in range(3):
        k = jnp.asarray(rng.standard_normal((1, 64, 2, 32)), jnp.float32)
        c = TieredKVCache.from_dense(k, k, policy)
        for _ in range(3):  # hot sets filled by rung 1
            c = certified_attention_step(jnp.asarray(rng.standard_normal((1, 4, 32)) * 3, jnp.float32), c, policy)[2]
        layers.append(c)
    model = TieredModelCache.from_layers(layers, num_q_heads=4, policy=policy)
    model = model.replace(store=model.store.replace(lengths=model.store.lengths + 7))  # a mark is a new value
    q = jnp.asarray(rng.standard_normal((1, 4, 32)), jnp.float32)

    def expect(model, rows):
        want = np.asarray(model.store.hot_used).copy()
        for layer, row in rows.items():
            want[layer] = np.asarray(row)
        return want

    view = model.layer_view(1)
    # a fresh jit (a lambda): traces are cached per function, and the switch is read while tracing (in a process
    # it is constant: CERTATTN_HOT_USED_STACKED is read at import)
    jitted = jax.jit(lambda q, c: certified_attention_step(q, c, policy))
    for step in (certified_attention_step, lambda q, c, _: jitted(q, c)):
        c = step(q, view, policy)[2]
        assert np.any(np.asarray(c.hot_used) != np.asarray(view.hot_used))  # the step marked some slot
        np.testing.assert_array_equal(np.asarray(model.with_layer(1, c, view).store.hot_used),
                                      expect(model, {1: c.hot_used}))
    v0, v1, _ = model.layers
    c0, c1 = (certified_attention_step(q, v, policy)[2] for v in (v0, v1))
    np.testing.assert_array_equal(np.asarray(model.with_layer(0, c0, v0).with_layer(1, c1, v1).store.hot_used),
                                  expect(model, {0: c0.hot_used, 1: c1.hot_used}))

    @jax.jit
    def at(model, i):
        v = model.layer_view(i)
        c = certified_attention_step(q, v, policy)[2]
        return model.with_layer(i, c, v).store.hot_used, c.hot_used

    stored, row = at(model, jnp.int32(-1))
    np.testing.assert_array_equal(np.asarray(stored), expect(model, {2: row}))


@pytest.mark.parametrize("fast,slots,refresh", [(False, 0, "deferred"),
                                                pytest.param(True, 0, "deferred", marks=pytest.mark.breadth),
                                                (True, 8, "deferred"),
                                                pytest.param(True, 8, "immediate", marks=pytest.mark.breadth),
                                                (True, 8, "deferred, stacked hot_used")],
                         ids=["whole ladder", "fast pass", "fast pass, 8 hot slots",
                              "fast pass, 8 hot slots, immediate", "fast pass, 8 hot slots, stacked LRU record"])
def test_a_model_cache_refreshes_hot_sets_after_the_step_like_a_layer_cache_does_at_once(fast, slots, refresh,
                                                                                          monkeypatch):
    """A model cache's layer views record rung 1's candidates (`hot_pending`) instead of writing the hot set back
    per layer; `with_lengths` makes them resident after the last layer (hot_refresh "deferred"), or write the
    hot set back from rung 1 itself ("immediate"). Step after step (hot sets filling, blocks flushing into LRU
    slots), every layer's outputs, certificates and hot set equal those of a single-layer cache that refreshes
    its hot set inside rung 1."""
    from certattn_jax import cache as cache_module
    from certattn_jax.attention import certified_attention_fast
    from certattn_jax.model_cache import TieredModelCache

    if refresh.endswith("stacked hot_used"):  # the layer views record their slots' use in the whole stack
        refresh = refresh.split(",")[0]
        monkeypatch.setattr(cache_module, "HOT_USED_STACKED", True)
    policy = dataclasses.replace(POLICY, eps=0.02, abs_tol=0.0, hot_slots=slots, hot_refresh=refresh)
    L, B, H, G, d, steps = 2, 2, 2, 2, 32, 12
    singles = []
    for layer in range(L):
        _, k, v = _data(40 + layer, B=B, T=75, H=H, G=G, d=d)
        singles.append(TieredKVCache.from_dense(k, v, policy, capacity=96))
    model = TieredModelCache.from_layers(singles, num_q_heads=H * G, policy=policy)
    if fast:
        model = model.decode_fast_path()

    @jax.jit
    def model_step(model, q, k, v):
        outs = []
        for layer in range(L):
            out, model = model.attend(layer, q[layer][:, None], k[layer], v[layer], model.lengths + 1)
            outs.append(out[:, 0])
        return outs, model.with_lengths(model.lengths + 1)

    @jax.jit
    def single_step(c, q, k, v):
        c = c.write_token(k, v)
        if fast:
            out, cert, c, _ = certified_attention_fast(q, c, policy)
        else:
            out, cert, c = certified_attention_step(q, c, policy)
        return out, cert, c.flush()

    rungs = []
    for step in range(steps):
        q, k, v = _model_step_inputs(100 + step, L, B, H, G, d)
        outs, model = model_step(model, q, k, v)
        assert np.all(np.asarray(model.store.hot_pending) == -1)
        certs = model.last_certificate
        for layer in range(L):
            out, cert, singles[layer] = single_step(singles[layer], q[layer], k[layer], v[layer])
            where = f"step {step} layer {layer}"
            # Two compiled programs: float32 sums may be fused in another order. On the H200 that moved one element
            # of 256 by 1.1e-6 (outputs of order 1), in a different parametrization from run to run, with either
            # tier-2 fetch (docs/performance.md, 2026-12-02 third session); a different block or rung moves them by
            # far more, and rungs, K* and hot sets are compared exactly below.
            np.testing.assert_allclose(np.asarray(outs[layer]), np.asarray(out), rtol=1e-5,
                                       atol=1e-5 * float(np.max(np.abs(np.asarray(out)))), err_msg=where)
            np.testing.assert_allclose(np.asarray(certs.error_bound[layer]), np.asarray(cert.error_bound),
                                       rtol=1e-5, err_msg=where)
            for field in ("rung", "k_star"):
                np.testing.assert_array_equal(np.asarray(getattr(certs, field)[layer]),
                                              np.asarray(getattr(cert, field)), where)
            view = model.layer_view(layer)
            for field in ("hot_k", "hot_v", "hot_ids", "hot_used"):
                np.testing.assert_array_equal(np.asarray(getattr(view, field)),
                                              np.asarray(getattr(singles[layer], field)), field)
            rungs.append(np.asarray(cert.rung))
    rungs = np.stack(rungs)
    assert np.any(rungs == 1) and np.any(rungs == 0)  # rung 1 refreshed hot sets that later steps used


def test_more_hot_slots_keep_rung_1s_widened_set_resident():
    """hot_slots > k_max: the cache holds that many exact blocks per KV head, rung 1 leaves as much of its
    widened set (the top 2 k_max) resident as fits -- so the next step promotes from it without tier 2 -- and the
    certificates stay sound against exact attention."""
    policy = dataclasses.replace(POLICY, k_max=2, hot_slots=4)
    with pytest.raises(ValueError, match="hot_slots"):
        dataclasses.replace(POLICY, k_max=4, hot_slots=2)
    q, k, v = _data(21, q_scale=3.0)
    cache = TieredKVCache.from_dense(k, v, policy)
    assert cache.hot_ids.shape[-1] == 4 and TieredKVCache.from_dense(k, v, POLICY).hot_ids.shape[-1] == 4
    narrow = TieredKVCache.from_dense(k, v, dataclasses.replace(policy, hot_slots=0))
    assert narrow.hot_ids.shape[-1] == 2
    step = jax.jit(certified_attention_step)
    strict = dataclasses.replace(policy, eps=0.0, abs_tol=0.0, v_max=0)
    _, c1, warm = step(q, cache, strict)
    _, _, warm_narrow = step(q, narrow, dataclasses.replace(strict, hot_slots=0))
    assert np.all(np.asarray(c1.rung) >= 1)
    resident = np.sum(np.asarray(warm.hot_ids) >= 0, axis=-1)
    assert np.all(resident == 4) and np.all(np.sum(np.asarray(warm_narrow.hot_ids) >= 0, axis=-1) == 2)
    ek, ev = (np.asarray(x) for x in exact_keys_values(warm))
    for b in range(2):
        for h in range(2):
            for s, blk in enumerate(np.asarray(warm.hot_ids)[b, h]):
                np.testing.assert_array_equal(np.asarray(warm.hot_k)[b, h, s], ek[b, h, blk * 16:blk * 16 + 16])
    out, cert = cert_attn(q, warm, policy)
    err = _errors(out, _reference(q, k, v))
    assert np.all(err <= np.asarray(cert.error_bound)), (err, cert.error_bound)


@pytest.mark.parametrize("how", ["whole", "unrolled", "kernel"])
@pytest.mark.parametrize("stacked", [False, True], ids=["one layer", "stacked layer 1"])
def test_fetching_the_whole_layer_or_slot_by_slot_gives_what_the_block_loop_gives(monkeypatch, stacked, how):
    """select.fetch_blocks below FETCH_WHOLE_LAYER_BELOW_BYTES (one transfer of the layer's tier 2, a gather on
    the device), up to FETCH_UNROLL_UP_TO slots (one copy per slot, no loop) or with the kernel (one Pallas
    kernel reading tier 2 in place; on the CPU interpreted over a device copy) fills exactly the slots the
    per-block loop fills, and leaves the others alone."""
    from certattn_jax import select, tiers

    rng = np.random.default_rng(4)
    lead = (3,) if stacked else ()
    host_k = tiers.to_host(jnp.asarray(rng.normal(size=lead + (2, 2, 5, 16, 32)), jnp.float32))
    host_v = tiers.to_host(jnp.asarray(rng.normal(size=lead + (2, 2, 5, 16, 32)), jnp.float32))
    ids = jnp.asarray(rng.integers(-1, 5, size=(2, 2, 4)), jnp.int32)
    dst = jnp.full((2, 2, 4, 16, 32), 7.0, jnp.float32)
    layer = jnp.int32(1) if stacked else None
    monkeypatch.setattr(select, "FETCH_KERNEL", False)  # the block loop, also where "auto" takes the kernel
    fetch = jax.jit(select.fetch_blocks)
    loop = fetch(dst, dst, host_k, host_v, ids, layer)
    if how == "kernel":
        monkeypatch.setattr(select, "FETCH_KERNEL", True)
    else:
        monkeypatch.setattr(select, "FETCH_WHOLE_LAYER_BELOW_BYTES" if how == "whole" else "FETCH_UNROLL_UP_TO",
                            1 << 30)
    whole_fn = jax.jit(lambda *a: select.fetch_blocks(*a))  # a new function: traced with the new threshold
    assert "while" not in str(jax.make_jaxpr(lambda *a: select.fetch_blocks(*a))(dst, dst, host_k, host_v, ids,
                                                                                  layer))
    whole = whole_fn(dst, dst, host_k, host_v, ids, layer)
    for a, b in zip(loop, whole, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.asarray(whole[0])[np.asarray(ids) < 0] == 7.0)
    none = jax.jit(select.fetch_blocks)(dst, dst, host_k, host_v, jnp.full_like(ids, -1), layer)
    assert np.all(np.asarray(none[1]) == 7.0)


@pytest.mark.parametrize("bad, message", [
    (dict(tau_cov=0.0), "tau_cov"), (dict(tau_cov=np.float32(1.5)), "tau_cov"), (dict(eps=-0.1), "eps"),
    (dict(layer_fallback_fraction=0.0), "layer_fallback")])
def test_a_policy_with_a_bad_tolerance_is_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message):
        CertPolicy(**bad)


def test_a_policy_rebuilt_from_device_arrays_reads_nothing_back(monkeypatch):
    """Every jitted call that returns a cache rebuilds its policy from device arrays: validating those would read
    each tolerance back to the host (a blocking transfer per call; 7 per prefill chunk, conversion or user decode
    step). Host-given tolerances are validated when the policy is made (above)."""
    from jax._src import array as jax_array

    policy = jax.jit(lambda p: p)(CertPolicy(eps=0.02))
    leaves, tree = jax.tree.flatten(policy)
    assert all(isinstance(x, jax.Array) for x in leaves)

    def read_back(self):
        raise AssertionError("a tolerance was read back to the host")

    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(read_back))
    rebuilt = jax.tree.unflatten(tree, leaves)
    assert rebuilt.k_max == policy.k_max and any(rebuilt.eps is x for x in leaves)


def test_writes_that_would_lose_tokens_raise_or_poison():
    """The thirtieth session's audit: a token written into a full residual without flush() was dropped while the
    length counted it, and attention certified the wrong output; append's `valid` was not checked (phantom tokens,
    a length lowered, 2.7 truncated, another shape); inside jit, writes past the capacity and from_dense lengths out
    of range changed lengths with nothing stored, and attention certified; a length of 2**32 + 5 wrapped to 5.
    Outside jit these raise; inside jit the sequence is marked non-finite (never certified again)."""
    q, k, v = _data(31, B=1, T=40)
    c = TieredKVCache.from_dense(k[:, :15], v[:, :15], POLICY, capacity=64)
    c = c.write_token(k[:, 15:16], v[:, 15:16])  # the residual is now full
    with pytest.raises(ValueError, match=r"residual block of sequence\(s\) \[0\] is full: call flush"):
        c.write_token(k[:, 16:17], v[:, 16:17])
    assert int(c.flush().write_token(k[:, 16:17], v[:, 16:17]).lengths[0]) == 17
    # inside jit the dropped token poisons its sequence instead
    lost = jax.jit(lambda c, k, v: c.write_token(k, v))(c, k[:, 16:17], v[:, 16:17])
    _, cert = cert_attn(q, lost, POLICY)
    assert np.all(np.isposinf(np.asarray(cert.error_bound))) and not np.any(np.asarray(cert.certified))

    base = TieredKVCache.from_dense(k[:, :20], v[:, :20], POLICY, capacity=64)
    for valid, err, match in (([10], ValueError, r"valid must lie in \[0, 4\]"), ([-2], ValueError, "valid must lie"),
                              ([2.7], TypeError, "valid must be integers"), ([2, 3], ValueError, r"\[B\] = \[1\]"),
                              ([[2]], ValueError, r"\[B\] = \[1\]")):
        with pytest.raises(err, match=match):
            base.append(k[:, 20:24], v[:, 20:24], valid=np.asarray(valid))
    with pytest.raises(ValueError, match="at least one token"):
        base.append(k[:, :0], v[:, :0])
    over = jax.jit(lambda c, k, v, n: c.append(k, v, n))(base, k[:, 20:24], v[:, 20:24], jnp.asarray([9]))
    assert np.all(np.isposinf(np.asarray(cert_attn(q, over, POLICY)[1].error_bound)))

    full = TieredKVCache.from_dense(k[:, :32], v[:, :32], POLICY, capacity=32).flush()
    past = jax.jit(lambda c, k, v: c.flush().write_token(k, v))(full, k[:, 32:33], v[:, 32:33])
    assert np.all(np.isposinf(np.asarray(cert_attn(q, past, POLICY)[1].error_bound)))

    build = jax.jit(lambda k, v, n: TieredKVCache.from_dense(k, v, POLICY, lengths=n))
    for n in ([100], [-3]):
        bad = build(k, v, jnp.asarray(n))
        assert np.all(np.isposinf(np.asarray(cert_attn(q, bad, POLICY)[1].error_bound)))
    good = build(k, v, jnp.asarray([33]))
    assert np.all(np.isfinite(np.asarray(cert_attn(q, good, POLICY)[1].error_bound)))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 40\]"):
        TieredKVCache.from_dense(k, v, POLICY, lengths=np.asarray([2 ** 32 + 5], np.int64))


def test_wrong_kinds_of_arguments_get_errors_that_name_them():
    """Unclear errors the audit found (an AttributeError deep inside, a silent empty answer): lists for keys, a
    dict for a policy, a float capacity, a tuple for a cache, zero query heads, a policy of another layout given
    to naive attention."""
    q, k, v = _data(32, B=1, T=40)
    c = TieredKVCache.from_dense(k, v, POLICY)
    cases = [(TypeError, "keys must be arrays", lambda: TieredKVCache.from_dense(np.asarray(k).tolist(), v, POLICY)),
             (TypeError, "policy must be a certattn_jax.CertPolicy", lambda: TieredKVCache.from_dense(k, v, {"e": 1})),
             (TypeError, "sizes must be integers", lambda: TieredKVCache.init(batch=1, capacity=32.5, num_kv_heads=2,
                                                                              head_dim=32, policy=POLICY)),
             (TypeError, "policy must be a certattn_jax.CertPolicy", lambda: certified_attention(q, c, {"e": 1})),
             (TypeError, "cache must be a certattn_jax.TieredKVCache", lambda: certified_attention(q, (1, 2), POLICY)),
             (ValueError, "no query heads", lambda: certified_attention(q[:, :0], c, POLICY)),
             (ValueError, "no query heads", lambda: dense_attention(q[:, :0], c)),
             (ValueError, "does not match this cache", lambda: naive_attention(
                 q, c, CertPolicy(block_size=32, group_size=16)))]
    for err, match, call in cases:
        with pytest.raises(err, match=match):
            call()
