"""A batch's tiered cache built a few sequences at a time (`prefill(..., staging_batch=n)`,
`TieredModelCache.with_sequences`): the device never holds more than n sequences' dense K/V, so a certified or naive
cache can take a batch whose dense cache would not fit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certattn_jax import tiers
from certattn_jax.cache import DEVICE_FIELDS, TieredKVCache
from certattn_jax.model_cache import CacheSpec, TieredModelCache, cache_spec
from certattn_jax.policy import CertPolicy
from models import generate as gen
from models import llama
from models.config import LlamaConfig

# the shapes of tests/test_e2e_cache.py (compiled programs shared within a worker)
CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
CAPACITY = 96


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


def _rows(cache: TieredModelCache, start: int, n: int) -> list[np.ndarray]:
    """Every per-sequence array of a model cache (every store field, whatever is added later), sequences
    [start, start + n)."""
    s = cache.store
    leaves = [getattr(s, f) for f in DEVICE_FIELDS + ("host_k", "host_v")] + [cache.cert_packed]
    # tiers.to_numpy: np.asarray of a host-memory array is a view of its buffer, which then cannot be donated (the
    # GPU refuses the next with_staged_sequences)
    return [tiers.to_numpy(x)[:, start:start + n] for x in leaves] + [np.asarray(cache.lengths)[start:start + n]]


def _decoded(params, spec, lengths, steps: int = 3) -> TieredModelCache:
    """A cache whose every row holds data (prefilled, then decoded: hot sets filled, certificates written)."""
    cache, _ = gen.prefill(params, CFG, _prompts(9, lengths), CAPACITY, cache_factory=spec, policy=POLICY,
                           prefill_chunk=16)
    tok = jnp.ones((len(lengths), 1), jnp.int32)
    for _ in range(steps):
        _, cache = llama.forward(params, CFG, tok, cache)
    return cache


def _staged_batches(monkeypatch) -> list[int]:
    """The batch of every dense staging cache made from here on (a spy on CacheSpec.staging)."""
    staged = []
    original = CacheSpec.staging

    def spy(self, batch, capacity):
        staged.append(batch)
        return original(self, batch, capacity)

    monkeypatch.setattr(CacheSpec, "staging", spy)
    return staged


@pytest.mark.parametrize("mode", ["certified", "naive"])
def test_with_sequences_writes_each_part_in_its_rows(params, mode):
    spec = cache_spec(mode, CFG, jnp.float32, POLICY)
    prompts = _prompts(1, (40, 7, 33, 16))  # a full block and a residual, one short of a block, exactly a block
    parts = [gen.prefill(params, CFG, prompts[i:i + 2], CAPACITY, cache_factory=spec, policy=POLICY,
                         prefill_chunk=16)[0] for i in (0, 2)]
    full = _decoded(params, spec, (20, 30, 50, 10))  # every row written before: nothing of it may survive
    for start, part in zip((0, 2), parts, strict=True):
        full = full.with_sequences(start, part)
    assert full.store.host_k.sharding.memory_kind == tiers.host_memory_kind()
    assert full.lengths.tolist() == [40, 7, 33, 16]
    for start, part in zip((0, 2), parts, strict=True):
        for got, want in zip(_rows(full, start, 2), _rows(part, 0, 2), strict=True):
            np.testing.assert_array_equal(got, want)


def _spec(**policy):
    return cache_spec("certified", CFG, jnp.float32, POLICY.replace(**policy) if policy else POLICY)


def test_with_sequences_refuses_what_does_not_fit(params):
    spec = _spec()
    part = spec(2, CAPACITY)
    with pytest.raises(ValueError, match="start 3 with 2 sequences does not fit a batch of 4"):
        spec(4, CAPACITY).with_sequences(3, part)
    with pytest.raises(ValueError, match="start -1"):
        spec(4, CAPACITY).with_sequences(-1, part)
    with pytest.raises(TypeError, match="start must be a Python or NumPy int"):
        spec(4, CAPACITY).with_sequences(jnp.int32(0), part)
    with pytest.raises(ValueError, match="mode: certified here, naive in the part"):
        spec(4, CAPACITY).with_sequences(0, cache_spec("naive", CFG, jnp.float32, POLICY)(2, CAPACITY))
    with pytest.raises(ValueError, match="does not fit this cache's sequences.*host_k"):
        spec(4, CAPACITY).with_sequences(0, spec(2, CAPACITY + 16))
    with pytest.raises(ValueError, match="group_size"):
        spec(4, CAPACITY).with_sequences(0, _spec(group_size=8)(2, CAPACITY))
    with pytest.raises(TypeError, match="TieredModelCache"):
        spec(4, CAPACITY).with_sequences(0, llama.init_cache(params, CFG, 2, CAPACITY))


@pytest.mark.parametrize("slots", [2, 6])
def test_a_part_with_other_hot_slots_is_refused(params, slots):
    """A part holding fewer hot slots than the cache would leave another sequence's exact blocks in the row's
    other slots, which rung 0 would then take as this sequence's (a review found certificates lying that way);
    more slots do not fit. Both are refused by name, whatever the policies' k_max say."""
    full = _spec(hot_slots=4)(2, CAPACITY)
    with pytest.raises(ValueError, match="hot_ids"):
        full.with_sequences(0, _spec(k_max=min(slots, 4), v_max=2, hot_slots=slots)(1, CAPACITY))
    narrowed = full.with_policy(full.policy.replace(k_max=2))  # the store keeps its 4 slots
    with pytest.raises(ValueError, match="hot_ids"):
        narrowed.with_sequences(0, _spec(k_max=2, hot_slots=2)(1, CAPACITY))


def test_with_sequences_names_a_consumed_or_shared_cache(params):
    spec = _spec()
    full, part = spec(2, CAPACITY), spec(1, CAPACITY)
    with pytest.raises(ValueError, match="shares arrays"):
        full.with_sequences(0, full.replace(store=full.store))
    new = full.with_sequences(1, part)
    with pytest.raises(ValueError, match="this cache was donated"):
        full.with_sequences(0, spec(1, CAPACITY))
    with pytest.raises(ValueError, match="the part was donated"):
        spec(2, CAPACITY).with_sequences(0, full.replace(lengths=jnp.zeros(1, jnp.int32)))
    assert new.lengths.tolist() == [0, 0]
    shared_policy = spec(1, CAPACITY).with_policy(new.policy)  # tolerances may be the same arrays: fine
    assert new.with_sequences(0, shared_policy).lengths.tolist() == [0, 0]


def _staging(params, spec, prompts):
    """A dense staging cache of `spec` holding the prompts' prefill (not converted)."""
    cache, _ = gen.prefill(params, CFG, prompts, CAPACITY, cache_factory=lambda b, c: spec.staging(b, c),
                           prefill_chunk=16)
    return cache


@pytest.mark.parametrize("mode", ["certified", "naive"])
def test_with_staged_sequences_converts_into_the_rows(params, mode):
    """with_staged_sequences(start, staging): the rows hold what converting the staging cache on its own gives
    (`from_staging`), every field, bit for bit; certificates start empty; rows outside are untouched; tier 2
    stays in host memory; the staging cache is left intact (only the tiered cache is donated)."""
    spec = cache_spec(mode, CFG, jnp.float32, POLICY)
    full = _decoded(params, spec, (20, 30, 50, 10))  # every row written before: nothing of it may survive
    before = _rows(full, 0, 4)
    staging = _staging(params, spec, _prompts(11, (40, 16)))
    full = full.with_staged_sequences(1, staging)
    own = spec.from_staging(staging)
    assert full.store.host_k.sharding.memory_kind == tiers.host_memory_kind()
    assert full.lengths.tolist() == [23, 40, 16, 13]  # (rows 0 and 3 decoded 3 tokens)
    for got, want in zip(_rows(full, 1, 2), _rows(own, 0, 2), strict=True):
        np.testing.assert_array_equal(got, want)
    for b in (0, 3):
        for got, want in zip(_rows(full, b, 1), [x[:, b:b + 1] if x.ndim > 1 else x[b:b + 1] for x in before],
                             strict=True):
            np.testing.assert_array_equal(got, want)


def test_with_staged_sequences_fills_a_narrowed_cache_s_every_slot(params):
    """A cache narrowed by with_policy(k_max=2) keeps its 4 hot slots: the conversion takes the store's layout,
    so slots 2-3 of the rows are cleared too (a conversion at the policy's 2 slots would leave the previous
    sequence's exact blocks there, which rung 0 takes as this sequence's)."""
    spec = _spec()  # k_max 4, hot slots = k_max
    full = _decoded(params, spec, (60, 50))
    assert np.any(np.asarray(full.store.hot_ids)[:, 0, :, 2:] >= 0)  # the old row uses slots 2-3
    narrowed = full.with_policy(full.policy.replace(k_max=2))
    assert narrowed.policy.slots == 2 and narrowed.store.k_max == 4
    staging = _staging(params, spec, _prompts(12, (33,)))
    got = narrowed.with_staged_sequences(0, staging)
    own = spec.from_staging(staging)
    for a, b in zip(_rows(got, 0, 1), _rows(own, 0, 1), strict=True):
        np.testing.assert_array_equal(a, b)


def test_with_staged_sequences_refuses_what_does_not_fit(params):
    spec = _spec()
    staging = spec.staging(2, CAPACITY)
    with pytest.raises(ValueError, match="start 3 with 2 sequences does not fit a batch of 4"):
        spec(4, CAPACITY).with_staged_sequences(3, staging)
    with pytest.raises(TypeError, match="start must be a Python or NumPy int"):
        spec(4, CAPACITY).with_staged_sequences(jnp.int32(0), staging)
    with pytest.raises(TypeError, match="DenseKVCache"):
        spec(4, CAPACITY).with_staged_sequences(0, spec(2, CAPACITY))
    with pytest.raises(ValueError, match=r"capacity.*\(2, 2, 112, 32, 'float32'\); this cache \(2, 2, 96"):
        spec(4, CAPACITY).with_staged_sequences(0, spec.staging(2, CAPACITY + 16))
    with pytest.raises(ValueError, match="float16"):
        spec(4, CAPACITY).with_staged_sequences(0, cache_spec("certified", CFG, jnp.float16, POLICY).staging(
            2, CAPACITY))
    full = spec(2, CAPACITY)
    new = full.with_staged_sequences(0, staging)
    with pytest.raises(ValueError, match="this cache was donated"):
        full.with_staged_sequences(0, staging)
    assert new.lengths.tolist() == [0, 0]


@pytest.mark.parametrize("bad", ["kv_heads", "capacity", "dtype", "batch", "missing_v"])
def test_a_bad_later_layer_is_refused_before_anything_is_written(params, bad):
    """Every layer of the staging cache is checked before the first is converted into the rows (an independent
    review: layer 1 with fewer KV heads was written over part of each row; a refusal after layer 0 had been
    written consumed the whole batch cache). The cache stays usable after the refusal."""
    spec = _spec()
    full = _decoded(params, spec, (20, 30))
    before = _rows(full, 0, 2)
    staging = _staging(params, spec, _prompts(13, (40,)))
    k1, v1 = staging.k[1], staging.v[1]
    layer1 = {"kv_heads": (k1[:, :1], v1[:, :1]), "capacity": (k1[:, :, :80], v1[:, :, :80]),
              "dtype": (k1.astype(jnp.float16), v1.astype(jnp.float16)),
              "batch": (jnp.concatenate([k1, k1]), jnp.concatenate([v1, v1])), "missing_v": (k1, None)}[bad]
    vs = (staging.v[0],) if bad == "missing_v" else (staging.v[0], layer1[1])
    broken = staging.replace(k=(staging.k[0], layer1[0]), v=vs)
    with pytest.raises(ValueError, match="layer|layers"):
        full.with_staged_sequences(0, broken)
    for got, want in zip(_rows(full, 0, 2), before, strict=True):  # nothing consumed, nothing written
        np.testing.assert_array_equal(got, want)


def test_with_rows_converted_checks_its_inputs(params):
    """The stacked store's own row conversion (public) checks start, the layer count and the layers' shapes."""
    spec = _spec()
    store = spec(4, CAPACITY).store
    staging = _staging(params, spec, _prompts(14, (40, 9)))
    ks, vs, lengths = staging.k, staging.v, staging.lengths
    for start in (3, 7, -2, True):
        with pytest.raises(ValueError, match="does not fit a batch of 4"):
            store.with_rows_converted(start, ks, vs, lengths)
    with pytest.raises(ValueError, match="3 layers given; this cache holds 2"):
        store.with_rows_converted(0, ks + ks[:1], vs + vs[:1], lengths)
    with pytest.raises(ValueError, match="1 layers given"):
        store.with_rows_converted(0, ks[:1], vs[:1], lengths)
    short = spec.staging(2, CAPACITY - 32)
    with pytest.raises(ValueError, match=r"capacity.*\(2, 64, 32"):
        store.with_rows_converted(0, short.k, short.v, short.lengths)
    with pytest.raises(ValueError, match="stacked"):
        spec(4, CAPACITY).layer_view(0).with_rows_converted(0, ks, vs, lengths)
    assert store.with_rows_converted(2, ks, vs, lengths).hot_ids.shape == store.hot_ids.shape


def test_zeros_on_host_are_made_in_host_memory(monkeypatch):
    """Eagerly, tier 2's zeros are made in host memory directly, never on the device first (a batch's tier 2 may
    exceed the device's free memory: 34 GB per array at 4 x 128K of the 8B shape); traced, they are placed by
    XLA."""
    if tiers.host_memory_kind() is None:
        pytest.skip("no host memory space on this backend")

    def refuse(x):
        raise AssertionError("zeros made on the device and moved")

    monkeypatch.setattr(tiers, "to_host", refuse)
    x = tiers.zeros_on_host((2, 3, 5), jnp.bfloat16)
    assert x.sharding.memory_kind == "pinned_host" and x.dtype == jnp.bfloat16 and x.shape == (2, 3, 5)
    assert not np.any(np.asarray(x, np.float32))
    monkeypatch.undo()
    y = jax.jit(lambda: tiers.zeros_on_host((4,), jnp.float32))()
    assert y.sharding.memory_kind == "pinned_host" and not np.any(np.asarray(y))


def test_tier2_beyond_the_host_s_memory_is_named(monkeypatch):
    """A tier 2 larger than the host's available memory is refused by name before anything is allocated (pinned
    pages cannot be swapped: the OS would otherwise kill the process)."""
    if tiers.host_memory_kind() is None:
        pytest.skip("no host memory space on this backend")
    monkeypatch.setattr(tiers, "host_memory_available", lambda: 1000)
    with pytest.raises(MemoryError, match=r"needs 0.00 GB of host memory; 0.00 GB is available"):
        _spec()(4, CAPACITY)
    assert tiers.zeros_on_host((10, 10), jnp.bfloat16).shape == (10, 10)  # 200 bytes: fits
    # converting a prefill: every path, the one where the conversion program's outputs are the cache included
    from certattn_jax import cache as cache_mod

    ks, vs = _layers_kv(3, 2, 2)
    lengths = jnp.array([40, 7], jnp.int32)
    for form, budget in (("batched", cache_mod.CONVERT_GROUP_BYTES), ("batched", 1), ("loop", 10**9)):
        monkeypatch.setattr(cache_mod, "CONVERT_GROUP_FORM", form)
        monkeypatch.setattr(cache_mod, "CONVERT_GROUP_BYTES", budget)
        with pytest.raises(MemoryError, match=r"tier 2 .* needs 0.00 GB of host memory; 0.00 GB is available"):
            TieredKVCache.stacked_from_layers(ks, vs, lengths, POLICY)
    monkeypatch.undo()
    assert tiers.host_memory_available() is None or tiers.host_memory_available() > 0


@pytest.mark.parametrize("group", [1, 2, 3])
def test_prefill_in_groups_stages_at_most_the_group(params, group, monkeypatch):
    """staging_batch n: every dense staging cache holds at most n sequences, and the result holds what the groups'
    own prefills give, row for row; its last logits are the whole batch's (the same math a few rows at a time)."""
    spec = cache_spec("certified", CFG, jnp.float32, POLICY)
    prompts = _prompts(2, (40, 7, 33, 16, 25))
    staged = _staged_batches(monkeypatch)
    cache, logits = gen.prefill(params, CFG, prompts, CAPACITY, cache_factory=spec, policy=POLICY,
                                prefill_chunk=16, staging_batch=group)
    assert staged == [min(group, 5 - s) for s in range(0, 5, group)]
    assert isinstance(cache, TieredModelCache) and cache.store.batch == 5
    whole, whole_logits = gen.prefill(params, CFG, prompts, CAPACITY, cache_factory=spec, policy=POLICY,
                                      prefill_chunk=16)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(whole_logits), rtol=1e-5, atol=1e-5)
    assert cache.lengths.tolist() == whole.lengths.tolist()
    for s in range(0, 5, group):
        part, part_logits = gen.prefill(params, CFG, prompts[s:s + group], CAPACITY, cache_factory=spec,
                                        policy=POLICY, prefill_chunk=16)
        n = len(prompts[s:s + group])
        np.testing.assert_array_equal(np.asarray(logits)[s:s + n], np.asarray(part_logits))
        for got, want in zip(_rows(cache, s, n), _rows(part, 0, n), strict=True):
            np.testing.assert_array_equal(got, want)


def test_generate_decodes_a_batch_staged_in_groups(params):
    """generate(staging_batch=1): the decode runs on the batch built one sequence at a time, every head-step
    certified or escalated, and each row decodes what that prompt decodes when its group is the whole batch
    (the decode's rows are independent; a batch of one is that group's prefill)."""
    prompts = _prompts(3, (40, 21))
    out = gen.generate(params, CFG, prompts, 6, cache_factory="certified", policy=POLICY, progress=False,
                       staging_batch=1, record_steps=True)
    assert [len(t) for t in out.tokens] == [6, 6]
    rec = out.step_records
    assert np.all(np.asarray(rec.certified) | (np.asarray(rec.rung) >= 1))
    assert np.all(np.asarray(rec.error_bound)[np.asarray(rec.certified)]
                  <= np.asarray(rec.tolerance)[np.asarray(rec.certified)])
    whole = gen.generate(params, CFG, prompts, 6, cache_factory="certified", policy=POLICY, progress=False)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(whole.tokens))


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_a_bad_staging_batch_is_named(params, bad):
    with pytest.raises(ValueError, match="staging_batch"):
        gen.prefill(params, CFG, _prompts(4, (9, 5)), CAPACITY, cache_factory="certified", policy=POLICY,
                    staging_batch=bad)


def test_staging_batch_needs_a_mode_or_spec(params):
    factory = _spec()
    with pytest.raises(ValueError, match="staging_batch needs a mode name or a CacheSpec"):
        gen.prefill(params, CFG, _prompts(4, (9, 5)), CAPACITY, cache_factory=lambda b, c: factory(b, c),
                    staging_batch=1)


def test_the_dense_cache_prefills_its_batch_at_once(params):
    """The dense mode's cache is its own staging cache: staging_batch does not split it (nothing to save)."""
    prompts = _prompts(5, (12, 30))
    grouped, logits = gen.prefill(params, CFG, prompts, CAPACITY, cache_factory="dense", staging_batch=1)
    whole, whole_logits = gen.prefill(params, CFG, prompts, CAPACITY, cache_factory="dense")
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(whole_logits))
    for a, b in zip(jax.tree.leaves(grouped), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bytes_per_sequence_are_the_cache_arrays_bytes():
    """CacheSpec.bytes_per_sequence: from shapes alone, what a built cache's arrays take per sequence (device and
    host apart for the tiered modes; the staging cache's dense K/V and length)."""
    def nbytes(tree):
        return sum(x.nbytes for x in jax.tree.leaves(tree))

    for mode in ("dense", "naive", "certified"):
        spec = cache_spec(mode, CFG, jnp.bfloat16, POLICY)
        per = spec.bytes_per_sequence(CAPACITY)
        assert 2 * per["staging"] == nbytes(spec.staging(2, CAPACITY))
        if mode == "dense":
            assert per["host"] == 0 and per["device"] == per["staging"]
            continue
        two = spec(2, CAPACITY)
        host = two.store.host_k.nbytes + two.store.host_v.nbytes
        assert 2 * per["host"] == host and per["host"] == per["staging"] - 4  # the originals, once (not the length)
        shared = 2 * per["device"] - (nbytes(two) - host)  # what a cache holds once, whatever its batch
        assert 0 <= shared <= 256, shared
    # the 8B shape at 128K, default policy (shapes only, nothing allocated): tier 1 and the rest are ~44 % of the
    # dense bytes (hot set and residual are a few blocks per head)
    big = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, max_position_embeddings=131072)
    per = cache_spec("certified", big, jnp.bfloat16, CertPolicy()).bytes_per_sequence(131072)
    assert per["host"] == 2 * 32 * 8 * 131072 * 128 * 2
    assert 0.40 < per["device"] / per["host"] < 0.47, per


def test_bytes_per_sequence_starts_no_kernel_checks(monkeypatch):
    """The estimate reads shapes only: it must not start the compiled kernels' self-checks (`CacheSpec.staging`
    does, for the batch it is given), which would compile for a batch of one beside the real prefill's."""
    from certattn_jax import kernel_checks

    def refuse(**kw):
        raise AssertionError(f"kernel checks started: {kw}")

    monkeypatch.setattr(kernel_checks, "start", refuse)
    per = cache_spec("certified", CFG, jnp.bfloat16, POLICY.replace(k_max=3)).bytes_per_sequence(CAPACITY + 32)
    assert per["host"] > 0


class _Device:
    def __init__(self, limit, in_use=0):
        self.stats = None if limit is None else {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


@pytest.mark.parametrize("layers_per_program", [1, CFG.num_layers])
def test_auto_staging_batch_splits_only_what_would_not_fit(monkeypatch, layers_per_program):
    """The estimate counts the temporaries of the conversion program (~5 float32 per K/V element of the layers it
    takes: a layer at a time where the budget says so, every layer of this small model by default)."""
    from certattn_jax import cache as cache_mod

    if layers_per_program == 1:
        monkeypatch.setattr(cache_mod, "CONVERT_GROUP_BYTES", 1)
    spec = cache_spec("certified", CFG, jnp.bfloat16, POLICY)
    per = spec.bytes_per_sequence(CAPACITY)
    temps = (3 * 4 * CFG.num_heads * 16 * CAPACITY
             + 24 * layers_per_program * 2 * CFG.num_kv_heads * CAPACITY * CFG.head_dim)
    one = per["staging"] + per["device"] + temps
    share = gen.STAGING_MEMORY_SHARE

    def auto(limit, batch=8, in_use=0, mode_spec=spec):
        return gen.auto_staging_batch(mode_spec, CFG, batch, CAPACITY, 16, device=_Device(limit, in_use))

    assert auto(None) is None  # no memory statistics (the CPU): the whole batch, as before
    assert auto(int(8 * one / share) + 64) is None  # it fits: the whole batch
    for in_use in (one, 3 * one, 5 * one):  # less free: the largest group that fits beside the batch's tier 1
        limit = int(8 * one / share) + 64
        n = auto(limit, in_use=in_use)
        free = (limit - in_use) * share
        assert 1 <= n < 8 and 8 * per["device"] + n * one <= free < 8 * per["device"] + (n + 1) * one, (in_use, n)
    assert auto(int((8 * per["device"] + 3 * one) / share) + 64) == 3
    assert auto(int(8 * per["device"] / share)) == 1  # nothing fits: one at a time, the best chance
    assert auto(10, mode_spec=cache_spec("dense", CFG, jnp.bfloat16, POLICY)) is None


def test_prefill_auto_stages_in_groups_where_memory_says(params, monkeypatch):
    """prefill's default staging_batch="auto" follows `auto_staging_batch`: groups where it says, the whole batch
    where it says None."""
    spec = cache_spec("certified", CFG, jnp.float32, POLICY)
    staged = _staged_batches(monkeypatch)
    prompts = _prompts(6, (20, 9, 31))
    monkeypatch.setattr(gen, "auto_staging_batch", lambda *a, **k: 2)
    cache, _ = gen.prefill(params, CFG, prompts, CAPACITY, cache_factory=spec, policy=POLICY, prefill_chunk=16)
    assert staged == [2, 1] and cache.lengths.tolist() == [20, 9, 31]
    staged.clear()
    monkeypatch.setattr(gen, "auto_staging_batch", lambda *a, **k: None)
    gen.prefill(params, CFG, prompts, CAPACITY, cache_factory=spec, policy=POLICY, prefill_chunk=16)
    assert staged == [3]


def test_the_pinned_host_pool_is_sized_for_tier_2(monkeypatch):
    """XLA's pinned-host pool (tier 2) is capped at XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, 64 GiB unless set; a 68.7 GB
    tier 2 left the kernels' self-checks no room on an H100. Unless the user set it, the cap becomes the host's
    memory; a host of less than XLA's default leaves it alone; the user's value always wins."""
    import os

    from certattn_jax import host_limit

    monkeypatch.delenv(host_limit.ENV, raising=False)
    monkeypatch.setattr(host_limit, "host_memory_total_gib", lambda: 125)
    assert host_limit.default_pinned_host_limit() == "125"
    monkeypatch.delenv(host_limit.ENV)
    monkeypatch.setattr(host_limit, "host_memory_total_gib", lambda: 32)
    assert host_limit.default_pinned_host_limit() is None and host_limit.ENV not in os.environ
    monkeypatch.setenv(host_limit.ENV, "7")
    monkeypatch.setattr(host_limit, "host_memory_total_gib", lambda: 125)
    assert host_limit.default_pinned_host_limit() == "7"


def _layers_kv(seed: int, layers: int, batch: int, dtype=jnp.bfloat16):
    key = jax.random.key(seed)
    shape = (batch, CFG.num_kv_heads, CAPACITY, CFG.head_dim)
    ks = tuple(jax.random.normal(jax.random.fold_in(key, i), shape, dtype) * (1 + i) for i in range(layers))
    vs = tuple(jax.random.normal(jax.random.fold_in(key, 100 + i), shape, dtype) - i for i in range(layers))
    return ks, vs


def _store_fields(store) -> list[np.ndarray]:
    return [tiers.to_numpy(getattr(store, f)) for f in DEVICE_FIELDS + ("host_k", "host_v", "lengths", "flushed")]


def _five_layers_spied(monkeypatch, form: str | None = None):
    """Five layers' K/V of 3 ragged sequences, and the list that records the layers of every call of the conversion
    program into a preallocated cache (`cache._convert_layers_into`, spied; its form checked where given):
    (ks, vs, lengths, one layer's K+V bytes, calls)."""
    from certattn_jax import cache as cache_mod

    ks, vs = _layers_kv(3, 5, 3)
    calls = []
    real = cache_mod._convert_layers_into

    def spy(store, ks_, *args, **kw):
        calls.append(len(ks_))
        assert form is None or kw["form"] == form
        return real(store, ks_, *args, **kw)

    monkeypatch.setattr(cache_mod, "_convert_layers_into", spy)
    return ks, vs, jnp.array([96, 37, 5], jnp.int32), ks[0].nbytes + vs[0].nbytes, calls


@pytest.mark.parametrize("form", ["batched", "loop"])
@pytest.mark.parametrize("budget_layers", [2, 3, 5])
def test_layers_converted_together_equal_a_layer_at_a_time(monkeypatch, budget_layers, form):
    """with_rows_converted converts as many layers per program as CONVERT_GROUP_BYTES of staging K/V allows (a
    program per layer made SmolLM2's 1K time to first token 3x the dense one on an H100): every field bit for bit
    what a layer at a time gives, with 5 layers by 2 and by 3 (the last group overlaps the one before: every
    group the same size, one compiled program), and one program call per group; in either form of the group's
    program (CONVERT_GROUP_FORM: the layers under vmap, or a lax.map over them)."""
    from certattn_jax import cache as cache_mod

    monkeypatch.setattr(cache_mod, "CONVERT_GROUP_FORM", form)
    monkeypatch.setattr(cache_mod, "CONVERT_GROUPS_INTO", True)  # groups into a preallocated cache too
    ks, vs, lengths, layer_bytes, calls = _five_layers_spied(monkeypatch, form)

    monkeypatch.setattr(cache_mod, "CONVERT_GROUP_BYTES", layer_bytes)  # a layer at a time
    one = TieredKVCache.stacked_from_layers(ks, vs, lengths, POLICY)
    assert calls == [1] * 5
    calls.clear()
    monkeypatch.setattr(cache_mod, "CONVERT_GROUP_BYTES", budget_layers * layer_bytes + layer_bytes // 2)
    grouped = TieredKVCache.stacked_from_layers(ks, vs, lengths, POLICY)
    # one group of every layer, batched: the program's outputs are the cache (nothing preallocated to write into)
    assert calls == {2: [2, 2, 2], 3: [3, 3], 5: [5] if form == "loop" else []}[budget_layers]
    assert len(set(calls)) <= 1  # every group the same size: one compiled program
    assert jax.tree.structure(grouped) == jax.tree.structure(one)
    for f, a, b in zip(DEVICE_FIELDS + ("host_k", "host_v", "lengths", "flushed"), _store_fields(one),
                       _store_fields(grouped), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=f)
    assert grouped.host_k.sharding.memory_kind == tiers.host_memory_kind()
    # and into rows of a batch: rows 1-3 of a 4-row store equal the 3-row conversion
    store = cache_spec("certified", CFG, jnp.bfloat16, POLICY)(4, CAPACITY).store
    ks2, vs2 = ks[:CFG.num_layers], vs[:CFG.num_layers]
    part = TieredKVCache.stacked_from_layers(ks2, vs2, lengths, POLICY)
    rows = store.with_rows_converted(1, ks2, vs2, lengths)
    for f in DEVICE_FIELDS + ("host_k", "host_v"):
        np.testing.assert_array_equal(tiers.to_numpy(getattr(rows, f))[:, 1:4], tiers.to_numpy(getattr(part, f)),
                                      err_msg=f)


@pytest.mark.parametrize("form", ["batched", "loop"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_conversion_temp_bytes_cover_the_compiled_program(form, dtype, monkeypatch):
    """`auto_staging_batch`'s estimate of a conversion program's temporaries covers what XLA's memory analysis of
    the compiled program (this CPU) says, for 1, 2, 4 and 8 layers per program, in both forms (the batched one
    holds every layer's float32 temporaries at once; the estimate once counted a quarter of that)."""
    from certattn_jax import cache as cache_mod

    monkeypatch.setattr(cache_mod, "CONVERT_GROUPS_INTO", True)  # `group` layers per program, preallocated or not
    policy = cache_mod.conversion_layout(CertPolicy())
    B, H, S, d, L = 1, 4, 1024, 128, 8
    store = cache_mod.TieredKVCache.init(batch=B, capacity=S, num_kv_heads=H, head_dim=d, dtype=dtype,
                                         policy=policy, layers=L)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    item = jnp.dtype(dtype).itemsize
    elems = 2 * B * H * S * d  # one layer's K and V
    for group in (1, 2, 4, 8):
        kv = tuple(jax.ShapeDtypeStruct((B, H, S, d), dtype) for _ in range(group))
        compiled = cache_mod._convert_layers_into.lower(store, kv, kv, jax.ShapeDtypeStruct((B,), jnp.int32), scalar,
                                                        policy, scalar, form=form).compile()
        measured = compiled.memory_analysis().temp_size_in_bytes
        monkeypatch.setattr(cache_mod, "CONVERT_GROUP_BYTES", group * elems * item)  # `group` layers per program
        estimate = cache_mod.conversion_temp_bytes(elems, L, item, form=form)
        assert measured <= estimate, (group, measured, estimate)
        if dtype == jnp.bfloat16 and (form == "batched" or group == 1):  # near what it covers where it matters
            assert estimate <= 2 * measured, (group, measured, estimate)


def test_a_preallocated_cache_is_written_a_layer_per_program_by_default(monkeypatch):
    """Groups of layers written into a preallocated cache measured 6.6x slower than a layer per program on an H100
    (8B shape, 8K: `cache.CONVERT_GROUPS_INTO`), so by default only the direct path (one program for every layer,
    its outputs the cache) converts layers together; with_rows_converted writes one layer per program unless
    CONVERT_GROUPS_INTO."""
    from certattn_jax import cache as cache_mod

    ks, vs, lengths, layer_bytes, calls = _five_layers_spied(monkeypatch)
    monkeypatch.setattr(cache_mod, "CONVERT_GROUPS_INTO", False)
    monkeypatch.setattr(cache_mod, "CONVERT_GROUP_BYTES", 2 * layer_bytes)  # groups of 2 would be allowed
    assert cache_mod.layers_per_program(layer_bytes, 5) == 1
    assert cache_mod.layers_per_program(layer_bytes, 5, preallocated=True) == 1
    TieredKVCache.stacked_from_layers(ks, vs, lengths, POLICY)
    assert calls == [1] * 5
    monkeypatch.setattr(cache_mod, "CONVERT_GROUP_BYTES", 5 * layer_bytes)  # one group holds every layer: direct
    assert cache_mod.layers_per_program(layer_bytes, 5) == 5
    assert cache_mod.layers_per_program(layer_bytes, 5, preallocated=True) == 1
    calls.clear()
    TieredKVCache.stacked_from_layers(ks, vs, lengths, POLICY)
    assert calls == []
    monkeypatch.setattr(cache_mod, "CONVERT_GROUPS_INTO", True)
    assert cache_mod.layers_per_program(layer_bytes, 5, preallocated=True) == 5


def test_conversion_group_layers_keeps_the_budget():
    """Layers per conversion program: within the byte budget, at least one, at most every layer."""
    from certattn_jax.cache import conversion_group_layers

    assert conversion_group_layers(100, 30, budget=1000) == 10
    assert conversion_group_layers(100, 30, budget=99) == 1
    assert conversion_group_layers(100, 30, budget=10**9) == 30
    assert conversion_group_layers(0, 4, budget=10) == 4
    # SmolLM2 at a 1K prompt converts in one program; the 8B shape at 128K a layer at a time
    smol = 2 * 2 * 3 * 1280 * 64
    assert conversion_group_layers(smol, 30) == 30
    assert conversion_group_layers(2 * 2 * 8 * 131072 * 128, 32) == 1


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="the CPU client does not refuse a shared buffer's donation")
def test_a_numpy_view_of_tier_2_is_named_and_loses_nothing(params):
    """np.asarray of a host-memory array is a view of its buffer, which the GPU then refuses to donate: the
    conversion names the problem and the remedy (tiers.to_numpy), and the cache is unchanged and usable after."""
    spec = _spec()
    full = _decoded(params, spec, (20, 30))
    view = np.asarray(full.store.host_k)  # noqa: F841 -- the view alive is the point
    before = _rows(full, 0, 2)
    staging = _staging(params, spec, _prompts(15, (40,)))
    with pytest.raises(ValueError, match="tiers.to_numpy"):
        full.with_staged_sequences(0, staging)
    part = spec.from_staging(staging)
    with pytest.raises(ValueError, match="with_sequences: .*tiers.to_numpy"):
        full.with_sequences(0, part)
    for got, want in zip(_rows(full, 0, 2), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_refused_donation_is_named_where_the_cpu_cannot_refuse(params, monkeypatch):
    """The GPU's refusal to donate a shared buffer (the test above, GPU only) as the CPU can see it: the
    conversion's program raising XLA's error. with_staged_sequences names it, the cache stays usable; any other
    runtime error passes through unchanged."""
    from certattn_jax import cache as cache_mod

    spec = _spec()
    full = _decoded(params, spec, (20, 30))
    before = _rows(full, 0, 2)
    staging = _staging(params, spec, _prompts(16, (40,)))
    part = spec.from_staging(staging)

    refusal = ("INVALID_ARGUMENT: Invalid buffer passed to Execute() as argument 24 to replica 0: INVALID_ARGUMENT: "
               "Donation requested for buffer with external reference")
    # the slow path raises JaxRuntimeError; a jitted call's C++ fast path, once installed, a plain ValueError with
    # the same message (both seen on an H100, jax 0.11.2)
    for kind in (jax.errors.JaxRuntimeError, ValueError):
        monkeypatch.setattr(cache_mod, "_convert_layers_into", lambda *a, kind=kind, **k: (_ for _ in ()).throw(
            kind(refusal)))
        with pytest.raises(ValueError, match=r"with_rows_converted: .*NumPy.*tiers.to_numpy.*unchanged"):
            full.with_staged_sequences(0, staging)
    monkeypatch.setattr(cache_mod, "_convert_layers_into",
                        lambda *a, **k: (_ for _ in ()).throw(ValueError("some other problem")))
    with pytest.raises(ValueError, match="^some other problem$"):
        full.with_staged_sequences(0, staging)
    from certattn_jax import model_cache

    monkeypatch.setattr(model_cache, "_put_sequences", lambda *a, **k: (_ for _ in ()).throw(ValueError(refusal)))
    with pytest.raises(ValueError, match=r"with_sequences: .*NumPy.*tiers.to_numpy.*unchanged"):
        full.with_sequences(0, part)
    monkeypatch.setattr(cache_mod, "_convert_layers_into",
                        lambda *a, **k: (_ for _ in ()).throw(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: x")))
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        full.with_staged_sequences(0, staging)
    monkeypatch.undo()
    for got, want in zip(_rows(full, 0, 2), before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert full.with_staged_sequences(0, staging).lengths.tolist() == [40, 33]  # (row 1: 30 + 3 decoded)


def test_a_deleted_layer_is_refused_before_anything_is_written(params):
    """A layer's keys deleted (donated elsewhere) would fail only when its group runs, after the first group had
    consumed the cache: with_rows_converted checks every layer first."""
    spec = _spec()
    store = spec(4, CAPACITY).store
    staging = _staging(params, spec, _prompts(17, (40, 9)))
    ks = tuple(jnp.array(k, copy=True) for k in staging.k)
    ks[-1].delete()
    with pytest.raises(ValueError, match=r"layer\(s\) \[1\] were deleted"):
        store.with_rows_converted(1, ks, staging.v, staging.lengths)
    with pytest.raises(ValueError, match=r"stacked_from_layers: .*layer\(s\) \[1\] were deleted"):
        TieredKVCache.stacked_from_layers(ks, staging.v, staging.lengths, POLICY)  # every layer in one program
    assert store.with_rows_converted(1, staging.k, staging.v, staging.lengths).batch == 4  # not consumed


def test_host_known_lengths_convert_without_reading_back_and_poison_a_mismatch(params):
    """`prefill` gives the conversion its prompts' lengths (`from_staging(..., lengths=)`) so that it need not
    read the staging cache's back from the device (a wait for the whole prefill before the conversion is even
    dispatched). Given lengths that agree convert to the same cache, bit for bit; a sequence whose given lengths
    differ from the cache's is poisoned (never certified: answered exactly from tier 2), eagerly and in jit; out of
    range is named."""
    spec = cache_spec("certified", CFG, jnp.float32, POLICY)
    staging = cache_spec("dense", CFG, jnp.float32, POLICY)
    prompts = _prompts(3, [39, 17])
    staged, _ = gen.prefill(params, CFG, prompts, CAPACITY, cache_factory=staging, policy=POLICY, prefill_chunk=16)
    read_back = spec.from_staging(staged)
    given = spec.from_staging(staged, lengths=np.array([39, 17], np.int32))
    assert jax.tree.structure(read_back) == jax.tree.structure(given)
    for a, b in zip(jax.tree.leaves(read_back), jax.tree.leaves(given), strict=True):
        np.testing.assert_array_equal(tiers.to_numpy(a), tiers.to_numpy(b))
    assert not np.asarray(given.store.nonfinite).any()
    wrong = spec.from_staging(staged, lengths=[39, 18])
    np.testing.assert_array_equal(np.asarray(wrong.store.nonfinite).any(axis=(0, 2)), [False, True])
    np.testing.assert_array_equal(np.asarray(wrong.lengths), [39, 17])  # the cache's own lengths are kept
    _, after = llama.forward(params, CFG, jnp.ones((2, 1), jnp.int32), wrong)
    cert = after.last_certificate
    assert not np.asarray(cert.certified)[:, 1].any() and (np.asarray(cert.rung)[:, 1] >= 3).all()
    assert np.asarray(cert.certified)[:, 0].all()
    in_jit = jax.jit(lambda d, n: TieredModelCache.from_dense(d, num_q_heads=CFG.num_heads, policy=POLICY,
                                                              lengths=n))
    np.testing.assert_array_equal(np.asarray(in_jit(staged, jnp.array([40, 17])).store.nonfinite).any(axis=(0, 2)),
                                  [True, False])
    with pytest.raises(ValueError, match="lengths must lie in"):
        spec.from_staging(staged, lengths=[39, CAPACITY + 1])


def test_a_poisoned_sequence_s_exact_rungs_answer_its_own_tokens(params):
    """A sequence whose given lengths differ from the cache's is never certified, and its exact rungs must still
    attend the tokens the cache holds (review 2026-12-07 38th: masked by the given lengths, tier 2 and the residual
    lacked the tokens past them, or held none where they counted more: logits off by ~20), eagerly and in jit."""
    spec = cache_spec("certified", CFG, jnp.float32, POLICY)
    staging = cache_spec("dense", CFG, jnp.float32, POLICY)
    prompts = _prompts(3, [39, 17])
    tok = jnp.ones((2, 1), jnp.int32)
    for given in ([30, 17], [39, 33], [39, 0]):
        staged, _ = gen.prefill(params, CFG, prompts, CAPACITY, cache_factory=staging, policy=POLICY,
                                prefill_chunk=16)
        in_jit = jax.jit(lambda d, g=given: TieredModelCache.from_dense(d, num_q_heads=CFG.num_heads, policy=POLICY,
                                                                        lengths=g))(staged)
        for cache in (spec.from_staging(staged, lengths=given), in_jit):
            want, _ = llama.forward(params, CFG, tok, staged)
            got, after = llama.forward(params, CFG, tok, cache)
            bad = np.asarray(given) != [39, 17]
            np.testing.assert_array_equal(np.asarray(after.last_certificate.certified).any(axis=(0, 2)), ~bad)
            # the poisoned rows exactly (rungs 3-4; the others are certified within their tolerance)
            np.testing.assert_allclose(np.asarray(got)[bad], np.asarray(want)[bad], atol=1e-4)


def test_an_empty_dense_cache_is_committed_in_distinct_buffers():
    """`DenseKVCache.init` (one program): every array committed (a jitted step's outputs are; jit keys on it) and
    its own buffer (a prefill donates them)."""
    from certattn_jax.dense_cache import DenseKVCache

    cache = DenseKVCache.init(num_layers=3, batch=2, capacity=32, num_kv_heads=2, head_dim=8, dtype=jnp.bfloat16)
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == 7 and all(x.committed for x in leaves)
    assert len({x.unsafe_buffer_pointer() for x in leaves}) == len(leaves)
    assert all(x.dtype == jnp.bfloat16 and x.shape == (2, 2, 32, 8) and not x.any() for x in cache.k + cache.v)
    assert cache.lengths.dtype == jnp.int32 and cache.lengths.shape == (2,) and not cache.lengths.any()
