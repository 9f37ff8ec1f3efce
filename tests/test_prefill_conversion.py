"""The tiered prefill's conversion inside the last chunk's program (`models.generate.conversion_in_chunk`): the same
cache, bit for bit, as the eager conversion after the prefill, chosen only where one program converts every layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certattn_jax import cache as cache_mod
from certattn_jax import tiers
from certattn_jax.cache import TieredKVCache
from certattn_jax.model_cache import cache_spec
from models import generate as gen
from models import llama
from models.decode_loop import TRACE_COUNTS
from tests.test_staging_groups import CAPACITY, CFG, POLICY, _prompts  # the staging tests' shapes


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)


def _prefilled(params, monkeypatch, in_chunk: bool, mode: str, prompts, chunk: int, policy=POLICY):
    monkeypatch.setattr(gen, "PREFILL_CONVERSION_IN_CHUNK", in_chunk)
    spec = cache_spec(mode, CFG, jnp.float32, policy)
    return gen.prefill(params, CFG, prompts, CAPACITY, cache_factory=spec, policy=policy, prefill_chunk=chunk)


def _assert_same(a, b) -> None:
    """Same pytree, and every leaf the same bits, dtype, weak type, memory kind and commitment."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert (x.shape, x.dtype, x.weak_type) == (y.shape, y.dtype, y.weak_type)
        assert (x.sharding.memory_kind, x.committed) == (y.sharding.memory_kind, y.committed)
        np.testing.assert_array_equal(tiers.to_numpy(x), tiers.to_numpy(y))


@pytest.mark.parametrize("mode", ["certified", "naive"])
@pytest.mark.parametrize("chunk", [64, 16])  # one chunk holds both prompts / four chunks
def test_the_last_chunk_s_program_converts_like_the_eager_conversion(params, monkeypatch, mode, chunk):
    prompts = _prompts(5, [53, 21])  # ragged: a partial last block each, the second prompt done chunks earlier
    fused_before = TRACE_COUNTS["prefill_chunk_converted"]
    cache, logits = _prefilled(params, monkeypatch, True, mode, prompts, chunk)
    traced = TRACE_COUNTS["prefill_chunk_converted"] - fused_before
    assert traced in (0, 1)  # (0: another test of this worker compiled it)
    eager_cache, eager_logits = _prefilled(params, monkeypatch, False, mode, prompts, chunk)
    _assert_same(cache, eager_cache)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(eager_logits))
    assert tiers.host_memory_kind() is None or cache.store.host_k.sharding.memory_kind == tiers.host_memory_kind()
    again, _ = _prefilled(params, monkeypatch, True, mode, _prompts(6, [53, 21]), chunk)  # new tokens, same shapes
    assert TRACE_COUNTS["prefill_chunk_converted"] - fused_before == traced  # compiled once
    assert again.store.k_codes.shape == cache.store.k_codes.shape


def test_generate_decodes_the_same_after_either_conversion(params, monkeypatch):
    """Same tokens and certificates, and one decode program for both caches (same avals, memory kinds, commitment)."""
    prompts = _prompts(7, [40, 33])
    outs = []
    for in_chunk in (True, False):
        monkeypatch.setattr(gen, "PREFILL_CONVERSION_IN_CHUNK", in_chunk)
        outs.append(gen.generate(params, CFG, prompts, 5, cache_factory="certified", policy=POLICY,
                                 prefill_chunk=16, progress=False, record_steps=True, eos_token_ids=()))
    decode_before = TRACE_COUNTS["decode_loop"]
    monkeypatch.setattr(gen, "PREFILL_CONVERSION_IN_CHUNK", True)
    gen.generate(params, CFG, prompts, 5, cache_factory="certified", policy=POLICY, prefill_chunk=16,
                 progress=False, record_steps=True, eos_token_ids=())
    assert TRACE_COUNTS["decode_loop"] == decode_before  # the decode loop the eager conversion's cache compiled
    assert outs[0].tokens == outs[1].tokens
    for x, y in zip(jax.tree.leaves(outs[0].step_records), jax.tree.leaves(outs[1].step_records), strict=True):
        np.testing.assert_array_equal(x, y)  # (NumPy: generate returns the records read back)


def test_a_policy_s_array_tolerances_pass_through_the_program(params, monkeypatch):
    """A policy taken from a cache (its tolerances arrays, `owned_policy`) converts as with Python floats."""
    prompts = _prompts(8, [30])
    first, _ = _prefilled(params, monkeypatch, False, "certified", prompts, 16)
    policy = first.policy.replace(eps=jnp.float32(0.01))
    a, _ = _prefilled(params, monkeypatch, True, "certified", prompts, 16, policy=policy)
    b, _ = _prefilled(params, monkeypatch, False, "certified", prompts, 16, policy=policy)
    _assert_same(a, b)
    assert float(a.policy.eps) == pytest.approx(0.01)


def test_the_conversion_in_chunk_is_chosen_where_one_program_converts_every_layer(params, monkeypatch):
    spec = cache_spec("certified", CFG, jnp.float32, POLICY)
    staging = spec.staging(1, CAPACITY)
    monkeypatch.setattr(gen, "PREFILL_CONVERSION_IN_CHUNK", True)
    assert gen.conversion_in_chunk(spec, staging)
    assert not gen.conversion_in_chunk(cache_spec("dense", CFG, jnp.float32, POLICY), staging)
    assert not gen.conversion_in_chunk(None, staging)
    monkeypatch.setattr(cache_mod, "CONVERT_GROUP_BYTES", 1)  # a layer per program: the eager conversion's groups
    assert not gen.conversion_in_chunk(spec, staging)
    monkeypatch.setattr(cache_mod, "CONVERT_GROUP_BYTES", 2**40)
    monkeypatch.setattr(cache_mod, "CONVERT_GROUP_FORM", "loop")  # asked for the loop: never the batched program
    monkeypatch.setattr(cache_mod, "CONVERT_GROUPS_INTO", True)
    assert not gen.conversion_in_chunk(spec, staging)
    monkeypatch.undo()
    monkeypatch.setattr(gen, "PREFILL_CONVERSION_IN_CHUNK", None)  # auto: on a GPU only
    assert gen.conversion_in_chunk(spec, staging) == (jax.default_backend() == "gpu")
    monkeypatch.setattr(gen, "PREFILL_CONVERSION_IN_CHUNK", False)
    assert not gen.conversion_in_chunk(spec, staging)


def test_tier2_beyond_the_host_s_memory_is_named_before_the_program_runs(params, monkeypatch):
    if tiers.host_memory_kind() is None:
        pytest.skip("no host memory space on this backend")
    monkeypatch.setattr(tiers, "host_memory_available", lambda: 1000)
    with pytest.raises(MemoryError, match=r"tier 2 .* needs 0.00 GB of host memory; 0.00 GB is available"):
        _prefilled(params, monkeypatch, True, "certified", _prompts(3, [20]), 16)


def _loops(fn, *args) -> bool:
    """Whether fn's lowered program holds a loop (lax.map lowers to a while loop)."""
    return "stablehlo.while" in jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("budget_layers", [CFG.num_layers, 1])
def test_the_traced_stacked_conversion_equals_the_eager_one(monkeypatch, budget_layers):
    """`stacked_from_head_major` (the traced conversion) converts every layer in one batched pass where one group
    holds them all (no loop of layers: on a GPU a host round per layer), else a layer at a time; both equal the eager
    conversion bit for bit."""
    rng = np.random.default_rng(11)
    B, H, S, d = 2, CFG.num_kv_heads, CAPACITY, CFG.head_dim
    ks = tuple(jnp.asarray(rng.standard_normal((B, H, S, d)), jnp.float32) for _ in range(CFG.num_layers))
    vs = tuple(jnp.asarray(rng.standard_normal((B, H, S, d)), jnp.float32) for _ in range(CFG.num_layers))
    lengths = jnp.array([70, 9], jnp.int32)
    layer_bytes = ks[0].nbytes + vs[0].nbytes
    monkeypatch.setattr(cache_mod, "CONVERT_GROUP_BYTES", layer_bytes * budget_layers)
    eager = TieredKVCache.stacked_from_layers(ks, vs, lengths, POLICY)

    def traced(k, v, n):
        return TieredKVCache.stacked_from_head_major(k, v, n, POLICY)

    stacked = (jnp.stack(ks), jnp.stack(vs), lengths)
    loops = _loops(traced, *stacked)
    assert loops == (budget_layers == 1)
    _assert_same(jax.jit(traced)(*stacked), eager)
    monkeypatch.setattr(cache_mod, "CONVERT_GROUP_FORM", "loop")  # the form asked for is kept whatever the budget
    # (a new function: jit would reuse the trace it cached for `traced`, module settings and all)
    assert _loops(lambda k, v, n: TieredKVCache.stacked_from_head_major(k, v, n, POLICY), *stacked)
