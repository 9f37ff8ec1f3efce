"""pallas_kernels.selftest: the known-answer check that stands between a compiled tier-1 kernel and a certificate."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certattn_jax import CertPolicy, step
from certattn_jax.cache import TieredKVCache
from pallas_kernels import selftest
from pallas_kernels import tier1_pass as t1


@pytest.mark.parametrize("cfg", [(16, 64, 16, 8, 4), (64, 128, 32, 4, 2)], ids=["Bk16-K8V4", "Bk64-K4V2"])
def test_the_kernel_agrees_with_its_reference_in_every_layout_the_product_uses(cfg):
    assert selftest.tier1_disagreement(*cfg) is None


def _doubling_acc(*args, **kw):
    """What the H200 did with 16-term int8 dots: every value sum twice what it should be."""
    out = t1.tier1_pass(*args, variant="int_kv", **kw)
    return out._replace(acc=2 * out.acc)


def _nan_m(*args, **kw):
    out = t1.tier1_pass(*args, variant="int_kv", **kw)
    return out._replace(m=jnp.full_like(out.m, jnp.nan))


@pytest.mark.parametrize("bad,what", [(_doubling_acc, "acc off by"), (_nan_m, "m has")])
def test_a_miscompiled_kernel_is_caught_and_named(bad, what):
    problem = selftest.tier1_disagreement(16, 64, 16, 8, 4, run=bad)
    assert problem is not None and what in problem


def test_the_check_runs_eagerly_inside_a_jit_trace():
    """The certified step asks while it is being traced: the check must evaluate, not stage into the step."""
    seen = []

    @jax.jit
    def f(x):
        seen.append(selftest.tier1_disagreement(16, 64, 16, 8, 4, run=_doubling_acc))
        return x + 1

    f(jnp.zeros(()))
    assert seen and seen[0] is not None and "acc" in seen[0]


def test_an_untrusted_kernel_sends_the_certified_path_to_jnp(monkeypatch):
    """A compiled kernel that fails its check is not used (warning naming the configuration); interpret mode is
    trusted without a check; the verdict is cached per configuration."""
    cache = TieredKVCache.init(batch=1, capacity=128, num_kv_heads=1, head_dim=64, dtype=jnp.float32,
                               policy=CertPolicy(block_size=16, group_size=16))
    calls = []

    def fake_check(*cfg, **_):
        calls.append(cfg)
        return "acc off by 1 of its magnitude"

    selftest.tier1_trusted.cache_clear()
    try:
        assert step.tier1_kernel_runs(cache, "pallas")  # interpret mode: no check
        monkeypatch.setattr(selftest, "tier1_disagreement", fake_check)
        assert step.tier1_kernel_runs(cache, "pallas") and not calls  # cached verdict of interpret mode
        # compiled kernels from now on (CERTATTN_PALLAS_INTERPRET unset): interpret mode's True, kept in the same
        # process, must not vouch for them (it did until 2026-12-07: no check ever ran)
        monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
        with pytest.warns(RuntimeWarning, match="block_size=16.*acc off by"):
            assert not step.tier1_kernel_runs(cache, "pallas")
        assert not step.tier1_kernel_runs(cache, "pallas") and len(calls) == 1  # checked once
        assert not step.tier1_kernel_runs(cache, "jnp")
    finally:
        selftest.tier1_trusted.cache_clear()


def test_every_certified_variant_input_layout_is_checked():
    """The check covers the per-block layout (tier1_partials) and the fused layout (fused_items: splits, hot set,
    slots, a stacked layer read in place): a kernel wrong only in the second is caught too."""
    def wrong_in_fused(*args, **kw):
        out = t1.tier1_pass(*args, variant="int_kv", **kw)
        return out if kw.get("per_block_acc") else out._replace(slot_acc=out.slot_acc + 1.0)

    problem = selftest.tier1_disagreement(16, 64, 16, 8, 4, run=functools.partial(wrong_in_fused))
    assert problem is not None and problem.startswith("split") and "slot_acc" in problem


@pytest.mark.parametrize("cfg,slots", [((32, 32, 32, 8, 4, 4), 0), ((64, 64, 32, 4, 2, 8), 0),
                                       ((32, 32, 32, 8, 4, 2), 8)],
                         ids=["Bk32-K8V4", "Bk64-K4V2", "Bk32-k_max2-of-8-slots"])
def test_the_fused_rung0_agrees_with_the_jnp_rung0(cfg, slots):
    assert selftest.rung0_disagreement(*cfg, hot_slots=slots) is None


def test_the_fused_rung0_is_checked_with_the_policys_k_max_and_the_caches_slots(monkeypatch):
    """A cache with more hot slots than the policy promotes runs the kernel with both numbers: the check asks
    for exactly that configuration."""
    asked = []
    monkeypatch.setattr(selftest, "rung0_trusted", lambda *a, **kw: asked.append((a, kw)) or True)
    k = jnp.zeros((1, 64, 1, 32), jnp.float32)
    policy = CertPolicy(block_size=16, group_size=16, k_max=2, hot_slots=8)
    cache = TieredKVCache.from_dense(k, k, policy)
    assert step.fused_supported(cache, 2) and step.fused_supported(cache)
    from pallas_kernels import certify_rung0

    base = {"tuning": (256, 4), "select": certify_rung0.DEFAULT_SELECT,  # 4 blocks: the small-cache setting,
            "picks": "count" if certify_rung0.DEFAULT_SELECT == "count" else "loop"}  # in one chunk
    assert asked[0] == ((16, 32, 16, 8, 4, 2), {"hot_slots": 8, **base, "layer_view": False})
    assert asked[1] == ((16, 32, 16, 8, 4, 8), {"hot_slots": 0, **base, "layer_view": False})
    # a model's layer view asks about the form its kernels run: its layer of the stacked arrays, in place
    from certattn_jax.model_cache import TieredModelCache

    model = TieredModelCache.from_layers([cache, cache], num_q_heads=2, policy=policy)
    assert step.fused_supported(model.layer_view(1), 2)
    assert asked[2] == ((16, 32, 16, 8, 4, 2), {"hot_slots": 8, **base, "layer_view": True})


def _halved_bound(q, cache, policy):
    fused = step.rung0_fused(q, cache, policy)
    return fused._replace(stage=fused.stage._replace(bound=fused.stage.bound / 2))


def _shifted_out(q, cache, policy):
    fused = step.rung0_fused(q, cache, policy)
    return fused._replace(stage=fused.stage._replace(out=fused.stage.out * 2))


def _scaled_e_val(factor):
    def run(q, cache, policy):
        fused = step.rung0_fused(q, cache, policy)
        return fused._replace(stage=fused.stage._replace(e_val=fused.stage.e_val * factor))

    return run


def _wrong_layer(q, cache, policy):
    """Reads layer 0 of a model's stacked arrays where the view is layer 1 (a kernel indexing the wrong layer)."""
    if cache.stack is not None:
        cache = cache.replace(layer=jnp.zeros_like(cache.layer))
    return step.rung0_fused(q, cache, policy)


def _last_layer_clipped(q, cache, policy):
    """Never reads the last layer of a stack (an index clipped one short): right at every other layer."""
    if cache.stack is not None:
        last = cache.stack["k_codes"].shape[0] - 1
        cache = cache.replace(layer=jnp.minimum(cache.layer, last - 1))
    return step.rung0_fused(q, cache, policy)


def _certify_reads_layer0(q, cache, policy):
    """Only the certify kernel reads the wrong layer's hot ids (layer 0, empty), the tier-1 pass the right one."""
    from pallas_kernels import certify_rung0 as ck

    real = ck.certify_rung0

    def wrong(*args, layer=None, **kwargs):
        return real(*args, layer=None if layer is None else jnp.zeros_like(layer), **kwargs)

    ck.certify_rung0 = wrong
    try:
        return step.rung0_fused(q, cache, policy)
    finally:
        ck.certify_rung0 = real


@pytest.mark.parametrize("bad,what", [(_halved_bound, "bound"), (_shifted_out, "out off by"),
                                      (_scaled_e_val(1 - 3e-4), "e_val smaller"),
                                      (_scaled_e_val(1.01), "e_val off by"),
                                      (_wrong_layer, "stacked layer view, layer 1 of 3"),
                                      (_certify_reads_layer0, "stacked layer view, layer 1 of 3"),
                                      (_last_layer_clipped, "stacked layer view, layer 2 of 3")])
def test_a_wrong_fused_rung0_is_caught(bad, what):
    """Caught: a bound or E_val below the jnp rung 0's beyond float32 reordering (even within TOLERANCE), an output
    or a bound term off by more than TOLERANCE (too large as well), in either form; a kernel that reads another
    layer of a model's stacked arrays than its view's, by the layer-view form (what a model's decode step runs)."""
    stacked_only = "layer view" in what  # the layer-view form checks the first, a middle and the last layer
    problem = selftest.rung0_disagreement(32, 32, 32, 8, 4, 4, run=bad, layer_view=True)
    assert problem is not None and what in problem, problem
    problem = selftest.rung0_disagreement(32, 32, 32, 8, 4, 4, run=bad)
    assert (problem is None) if stacked_only else (problem is not None and what in problem), problem


def test_the_compiled_margins_of_the_block_value_errors_pass_the_check():
    """Compiled, the certify kernel's E_val carries the Triton division and sqrt margins of
    `bounds.block_value_errors` (relatively ~3e-6 larger than the jnp rung 0's): accepted."""
    assert selftest.rung0_disagreement(32, 32, 32, 8, 4, 4, run=_scaled_e_val(1 + 2.0 ** -16)) is None


def test_an_untrusted_fused_rung0_sends_the_ladder_to_the_jnp_rung0(monkeypatch):
    cache = TieredKVCache.init(batch=1, capacity=128, num_kv_heads=1, head_dim=32, dtype=jnp.float32,
                               policy=CertPolicy(block_size=32, group_size=32, k_max=4))
    selftest.rung0_trusted.cache_clear()
    try:
        assert step.fused_supported(cache)
        monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
        monkeypatch.setattr(selftest, "rung0_disagreement", lambda *cfg, **_: "bound smaller than the jnp rung 0's")
        selftest.rung0_trusted.cache_clear()
        with pytest.warns(RuntimeWarning, match="k_max=4.*bound smaller"):
            assert not step.fused_supported(cache)
    finally:
        selftest.rung0_trusted.cache_clear()


def _recording_checks(calls: list):
    """check(found): a check that records `found` in `calls` when it runs and returns it as its verdict."""
    def check(found):
        def run():
            calls.append(found)
            return found
        return run
    return check


def test_verdicts_are_kept_on_disk_per_machine_code_and_configuration(monkeypatch, tmp_path):
    """A configuration is checked once per machine and code: the verdict is read back from the file (no second
    check), a failure included (it still warns and sends the caller to jnp); another configuration, a damaged
    file or a changed source digest checks again; "off" (no file) checks once per process."""
    path = tmp_path / "verdicts.json"
    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", str(path))
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
    calls = []
    check = _recording_checks(calls)

    cfg = dict(block_size=16, head_dim=32)
    assert selftest._trusted("kernel A", cfg, check(None), "")
    assert selftest._trusted("kernel A", cfg, check("never asked"), "") and len(calls) == 1
    with pytest.warns(RuntimeWarning, match="off by 2"):
        assert not selftest._trusted("kernel A", dict(cfg, k_max=1), check("out off by 2"), "jnp instead")
    with pytest.warns(RuntimeWarning, match="off by 2"):
        assert not selftest._trusted("kernel A", dict(cfg, k_max=1), check(None), "jnp instead")
    assert len(calls) == 2
    monkeypatch.setattr(selftest, "_sources_digest", lambda: "edited")
    assert selftest._trusted("kernel A", cfg, check(None), "") and len(calls) == 3
    path.write_text("{not json")
    selftest._PROCESS_VERDICTS.clear()  # another process: the damaged file holds no verdict
    assert selftest._trusted("kernel A", cfg, check(None), "") and len(calls) == 4
    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", "off")
    selftest._PROCESS_VERDICTS.clear()  # another process, no file: it checks, once
    assert selftest._trusted("kernel A", cfg, check(None), "")
    assert selftest._trusted("kernel A", cfg, check("never asked"), "") and len(calls) == 5


def test_the_time_spent_checking_is_counted_and_a_kept_verdict_costs_none(monkeypatch, tmp_path):
    """Benchmarks split a compile's one-time self-checks out of it (`seconds_checking`): a check that runs adds
    its wall time; a verdict read back from the file adds nothing."""
    import time

    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", str(tmp_path / "verdicts.json"))
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)

    def slow_check():
        time.sleep(0.05)
        return None

    before = selftest.seconds_checking()
    runs = len(selftest.check_runs())
    assert selftest._trusted("kernel B", dict(block_size=16), slow_check, "")
    spent = selftest.seconds_checking() - before
    assert 0.05 <= spent < 5.0, spent
    assert selftest._trusted("kernel B", dict(block_size=16), slow_check, "")
    assert selftest.seconds_checking() - before == spent
    # the check that ran is listed once, with its time, in the foreground (the file's verdict is not a run)
    (run,) = selftest.check_runs()[runs:]
    assert run["what"] == "kernel B" and run["config"] == {"block_size": 16} and not run["background"]
    assert 0.05 <= run["seconds"] <= spent + 1e-3


def test_an_unknown_layout_setting_is_an_error_naming_it():
    """A mistyped layout switch must not silently run the default layout."""
    import subprocess
    import sys

    code = "import pallas_kernels.tier1_pass"
    var = "CERTATTN_VALUE_PACKING"
    env = {**__import__("os").environ, var: "plannar", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and var in proc.stderr


def test_a_verdict_on_one_value_packing_never_vouches_for_another(monkeypatch, tmp_path):
    """The tier-1 kernel's code path depends on the value packing, not only on the shapes: the kept verdict is
    keyed by it, so switching CERTATTN_VALUE_PACKING checks the kernel again."""
    from certattn_jax import quant

    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", str(tmp_path / "verdicts.json"))
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
    calls = []
    monkeypatch.setattr(selftest, "tier1_disagreement", lambda **cfg: calls.append(cfg))
    for packing in ("interleaved", "interleaved", "planar"):
        monkeypatch.setattr(quant, "VALUE_PACKING", packing)
        selftest.tier1_trusted.cache_clear()
        assert selftest.tier1_trusted(16, 32, 16, 8, 4)
    assert len(calls) == 2  # the repeat was read back; the new layout was checked
    selftest.tier1_trusted.cache_clear()


def test_auto_takes_the_kernels_only_where_they_compile(monkeypatch):
    """"auto" (tier 1's and rung 0's default): the Pallas tier-1 kernel and the fused rung 0 on a GPU at every
    context (the H200 measured the fused rung 0 faster from 16 to 2,048 blocks), jnp where kernels would be
    interpreted; an explicit choice is kept."""
    from certattn_jax import policy as pol
    from pallas_kernels import backend

    assert CertPolicy().tier1 in pol.TIER1_IMPLS and CertPolicy(rung0="auto").rung0 == "auto"
    with pytest.raises(ValueError, match="tier-1"):
        CertPolicy(tier1="triton")
    short, long = 16, 1 << 16
    monkeypatch.setattr(backend, "interpret", lambda: True)
    assert (pol.tier1_impl("auto"), pol.rung0_impl("auto", short), pol.rung0_impl("auto", long)) == ("jnp",) * 3
    monkeypatch.setattr(backend, "interpret", lambda: False)
    assert pol.tier1_impl("auto") == "pallas"
    assert (pol.rung0_impl("auto", short), pol.rung0_impl("auto", long)) == ("fused", "fused")
    assert (pol.tier1_impl("jnp"), pol.rung0_impl("jnp", 1), pol.rung0_impl("fused", 10**6)) == ("jnp", "jnp", "fused")


@pytest.mark.parametrize("cfg", [(16, 32, "bfloat16", "bfloat16"), (64, 64, "float32", "float32"),
                                 (16, 64, "float16", "float32")])
def test_the_gather_kernel_copies_tier2_blocks_bit_for_bit(cfg):
    assert selftest.gather_disagreement(*cfg) is None


def test_a_gather_that_corrupts_a_block_is_caught_and_named():
    from pallas_kernels import gather_blocks as gb

    def off_by_one_block(dk, dv, hk, hv, ids, layer=None):  # reads the next block when asked for block 0
        return gb.gather_blocks(dk, dv, hk, hv, jnp.where(ids == 0, 1, ids), layer)

    problem = selftest.gather_disagreement(16, 32, "bfloat16", "bfloat16", run=off_by_one_block)
    assert problem is not None and "keys differ" in problem


def test_the_fetch_takes_the_kernel_only_where_it_runs_compiled_and_passed_its_check(monkeypatch):
    """select.FETCH_KERNEL None ("auto"): the kernel where compiled kernels run and its check passed, the block
    loop in interpret mode (the CPU) or after a failed check; True / False force it."""
    from certattn_jax import select

    host, dst = jnp.zeros((1, 1, 4, 16, 32), jnp.bfloat16), jnp.zeros((1, 1, 2, 16, 32), jnp.bfloat16)
    monkeypatch.setattr(select, "FETCH_KERNEL", None)
    asked = []
    monkeypatch.setattr(selftest, "gather_trusted", lambda *cfg: asked.append(cfg) or verdict[0])
    verdict = [True]
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: False)
    assert not select.fetch_by_kernel(host, dst)  # interpreted kernels (the CPU): the loop is faster
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
    assert select.fetch_by_kernel(host, dst) and asked[-1] == (16, 32, "bfloat16", "bfloat16")
    verdict[0] = False
    assert not select.fetch_by_kernel(host, dst)
    for forced in (True, False):
        monkeypatch.setattr(select, "FETCH_KERNEL", forced)
        assert select.fetch_by_kernel(host, dst) is forced


def test_a_check_in_progress_is_awaited_not_run_twice(monkeypatch, tmp_path):
    """Two callers of the same check at once (a background start and the trace that needs the verdict): one runs
    it, the other waits for its verdict; the waiting is counted as time spent checking, the background's own
    running is not."""
    import threading
    import time

    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", "off")
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
    started, calls = threading.Event(), []

    def slow_check():
        calls.append(1)
        started.set()
        time.sleep(0.3)
        return "out off by 3"

    before = selftest.seconds_checking()
    runs = len(selftest.check_runs())
    (t,) = selftest.start_in_background(lambda: selftest._trusted("kernel C", dict(block_size=8), slow_check, ""))
    assert started.wait(10)
    with pytest.warns(RuntimeWarning, match="off by 3"):  # the warning reaches the foreground caller
        assert not selftest._trusted("kernel C", dict(block_size=8), slow_check, "jnp instead")
    t.join(10)
    assert len(calls) == 1
    (run,) = selftest.check_runs()[runs:]  # one run, by the background thread; the foreground awaited it
    assert run["what"] == "kernel C" and run["background"] and run["seconds"] >= 0.3
    waited = selftest.seconds_checking() - before
    assert 0.0 < waited < 0.3 + 5.0, waited


def test_a_failed_background_check_is_run_again_in_the_foreground(monkeypatch, tmp_path):
    """An error in a background check is not handed to the trace as a verdict: the foreground runs the check
    itself (where an error makes the kernel untrusted: the next test)."""
    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", str(tmp_path / "verdicts.json"))
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
    outcomes = [RuntimeError("compile failed in the background"), None]

    def flaky():
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    for t in selftest.start_in_background(lambda: selftest._trusted("kernel D", dict(block_size=8), flaky, "")):
        t.join(10)
    assert selftest._trusted("kernel D", dict(block_size=8), flaky, "") and not outcomes


def test_a_check_that_raises_in_the_foreground_leaves_the_kernel_unused_and_is_not_kept(monkeypatch, tmp_path):
    """A kernel whose check cannot run here (e.g. it does not compile on this device) is not trusted: the caller is
    warned with the error and takes the jnp path; the verdict is not kept on disk, so the next process (here: a
    check that passes) checks again. Interrupts still propagate."""
    path = tmp_path / "verdicts.json"
    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", str(path))
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)

    def broken():
        raise RuntimeError("Triton: cannot compile this kernel\nsecond line")

    with pytest.warns(RuntimeWarning, match="kernel E failed its check.*raised RuntimeError: Triton: cannot compile"):
        assert not selftest._trusted("kernel E", dict(block_size=8), broken, "jnp instead")
    assert not path.exists() or "kernel E" not in path.read_text()
    assert selftest._trusted("kernel E", dict(block_size=8), lambda: None, "jnp instead")

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        selftest._trusted("kernel F", dict(block_size=8), interrupted, "jnp instead")


def test_a_tiered_cache_spec_starts_its_kernel_checks_before_the_prefill(monkeypatch, tmp_path):
    """`CacheSpec.staging` (the prefill's cache) starts the checks the decode step will ask for, in the
    background, with the configuration the step asks with: the step's own predicates then find the verdicts
    (no second check) and still warn about a failed one. Nothing starts where kernels are interpreted."""
    from certattn_jax import model_cache

    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", str(tmp_path / "verdicts.json"))
    policy = CertPolicy(block_size=16, group_size=16, k_max=2, tier1="pallas", rung0="fused")
    spec = model_cache.CacheSpec(mode="certified", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32,
                                 dtype=jnp.float32, policy=policy)
    asked = {"tier1": [], "rung0": [], "gather": [], "write": []}

    def record(what, problem=None):
        return lambda **cfg: asked[what].append(cfg) or problem

    monkeypatch.setattr(selftest, "tier1_disagreement", record("tier1"))
    monkeypatch.setattr(selftest, "rung0_disagreement", record("rung0", "bound smaller than the jnp rung 0's"))
    monkeypatch.setattr(selftest, "gather_disagreement", record("gather"))
    monkeypatch.setattr(selftest, "write_disagreement", record("write"))
    for fn in (selftest.tier1_trusted, selftest.rung0_trusted, selftest.gather_trusted, selftest.write_trusted):
        fn.cache_clear()
    try:
        # where kernels are interpreted (the CPU; forced here so that the test means the same on a GPU): nothing
        monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: False)
        assert model_cache.kernel_checks.start(mode="certified", batch=1, capacity=64, num_kv_heads=2, head_dim=32,
                                               dtype=jnp.float32, policy=policy) == []
        monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
        warmed = []  # the compiler's one-time setup is paid in the background too (a Triton compile: not here)
        monkeypatch.setattr(selftest, "warm_compiler", lambda: warmed.append(1))
        threads = []
        real_start = selftest.start_in_background
        monkeypatch.setattr(selftest, "start_in_background", lambda *fns: threads.extend(real_start(*fns)) or threads)
        model_cache.kernel_checks.forget()
        spec.staging(1, 60)
        assert len(threads) == 5
        for t in threads:
            t.join(30)
        assert [len(v) for v in asked.values()] == [1, 1, 1, 1] and warmed == [1]
        # the next prefill of this configuration starts nothing (no shapes traced, no predicate asked: host time
        # per prompt, scripts/probe_prefill_host_work.py); another configuration starts its own
        shapes_traced = []
        real_eval_shape = jax.eval_shape
        monkeypatch.setattr(jax, "eval_shape", lambda *a, **k: shapes_traced.append(1) or real_eval_shape(*a, **k))
        spec.staging(1, 60)
        assert len(threads) == 5 and not shapes_traced
        spec.staging(2, 60)
        assert len(threads) == 10 and shapes_traced
        for t in threads:
            t.join(30)
        assert asked["rung0"][0]["layer_view"] is True  # the form a model's decode step runs, checked as such
        layer = model_cache.TieredModelCache.init(num_layers=2, batch=1, capacity=64, num_kv_heads=2,
                                                  num_q_heads=4, head_dim=32, dtype=jnp.float32,
                                                  policy=policy).layer_view(0)
        assert step.tier1_kernel_runs(layer, policy.tier1)
        with pytest.warns(RuntimeWarning, match="bound smaller"):
            assert not step.uses_fused_rung0(layer, policy)
        assert layer.reads_tier2_by_kernel() and layer.writes_token_by_kernel()
        # the step's questions were answered, not re-asked
        assert [len(v) for v in asked.values()] == [1, 1, 1, 1], asked
    finally:
        model_cache.kernel_checks.forget()
        for fn in (selftest.tier1_trusted, selftest.rung0_trusted, selftest.gather_trusted, selftest.write_trusted):
            fn.cache_clear()


def test_the_compiler_warm_up_compiles_one_kernel_once_per_process(monkeypatch):
    """`warm_compiler` (run at the prefill) compiles a tiny Pallas kernel the first time and nothing later."""
    monkeypatch.setattr(selftest, "_COMPILER_WARMED", threading.Event())
    compiled = []
    real_jit = jax.jit
    monkeypatch.setattr(jax, "jit", lambda f, *a, **k: compiled.append(f) or real_jit(f, *a, **k))
    selftest.warm_compiler(interpret=True)
    selftest.warm_compiler(interpret=True)
    assert len(compiled) == 1 and selftest._COMPILER_WARMED.is_set()


def test_a_fused_rung0_verdict_on_one_warp_setting_never_vouches_for_another(monkeypatch, tmp_path):
    """CERTATTN_RUNG0_WARPS changes the compiled certify kernel: its kept verdict is keyed by a non-default
    setting (the default's key is unchanged, so kept verdicts stay valid), and a bad setting is refused by name."""
    import subprocess
    import sys

    from pallas_kernels import certify_rung0

    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", str(tmp_path / "verdicts.json"))
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
    calls = []
    monkeypatch.setattr(selftest, "rung0_disagreement", lambda **cfg: calls.append(cfg))
    try:
        for warps in (4, 4, 8, 8, 4):
            monkeypatch.setattr(certify_rung0, "DEFAULT_WARPS", warps)
            selftest.rung0_trusted.cache_clear()
            assert selftest.rung0_trusted(16, 32, 16, 8, 4, 2)
        assert len(calls) == 2  # once for 4 warps, once for 8; the repeats were read back
    finally:
        selftest.rung0_trusted.cache_clear()
    env = {**__import__("os").environ, "CERTATTN_RUNG0_WARPS": "3", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", "import pallas_kernels.certify_rung0"], env=env, capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "CERTATTN_RUNG0_WARPS" in proc.stderr


def test_the_certify_kernel_takes_its_warps_and_chunk_by_size_and_each_setting_is_checked_where_used(monkeypatch,
                                                                                                      tmp_path):
    """`certify_rung0.tuning`: 4 warps up to 64 padded blocks, 8 warps in 128-block chunks up to 512, 16 warps in
    256-block chunks beyond (measured on the H200); a fixed setting overrides it at every size. A cache asks the
    self-check about the setting its own block count compiles, keyed by it, and the check runs that setting
    on a cache whose passes walk two chunks."""
    from pallas_kernels import certify_rung0 as ck

    assert [ck.tuning(n) for n in (16, 64, 128, 512, 1024, 4096)] == [(256, 4)] * 2 + [(128, 8)] * 2 + [(256, 16)] * 2
    monkeypatch.setattr(ck, "DEFAULT_WARPS", 2)
    assert [ck.tuning(n) for n in (16, 4096)] == [(256, 2), (256, 2)]
    monkeypatch.setattr(ck, "DEFAULT_WARPS", None)

    real_check = selftest.rung0_disagreement
    monkeypatch.setattr(ck, "DEFAULT_SELECT", "count")  # the default (an environment may choose the loop)
    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", str(tmp_path / "verdicts.json"))
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
    monkeypatch.setattr(ck, "supports", lambda *a: True)
    calls = []
    monkeypatch.setattr(selftest, "rung0_disagreement", lambda **cfg: calls.append(cfg))
    policy = CertPolicy(block_size=16, group_size=16, k_max=2, tier1="pallas", rung0="fused")
    try:
        for T in (16 * 10, 16 * 200, 16 * 100, 16 * 1500):  # 10, 200, 100 and 1,500 blocks
            cache = TieredKVCache.init(batch=1, capacity=T, num_kv_heads=1, head_dim=32, policy=policy)
            assert step.fused_supported(cache, 2)
        # 100 blocks (128 columns, one chunk: the candidates counted) and 200 (256: two chunks, the loop) run
        # the same setting two different ways: each asks a verdict of its own, on the way it runs
        assert [c["tuning"] for c in calls] == [(256, 4), (128, 8), (128, 8), (256, 16)]
        assert [c["picks"] for c in calls] == ["count", "walk", "count", "walk"]
        for T in (16 * 120, 16 * 250):  # 128 and 256 columns again: the verdicts reached are reused
            cache = TieredKVCache.init(batch=1, capacity=T, num_kv_heads=1, head_dim=32, policy=policy)
            assert step.fused_supported(cache, 2)
        assert len(calls) == 4
        # a chunk width set by the environment: 128 columns walk two chunks of 64 (the chunk, not the count,
        # decides); 4 warps at any size (the small-cache setting then walks too)
        monkeypatch.setattr(ck, "DEFAULT_CHUNK", 64)
        cache = TieredKVCache.init(batch=1, capacity=16 * 100, num_kv_heads=1, head_dim=32, policy=policy)
        assert step.fused_supported(cache, 2) and (calls[-1]["tuning"], calls[-1]["picks"]) == ((64, 8), "walk")
        monkeypatch.setattr(ck, "DEFAULT_CHUNK", None)
        monkeypatch.setattr(ck, "DEFAULT_WARPS", 4)
        cache = TieredKVCache.init(batch=1, capacity=16 * 1500, num_kv_heads=1, head_dim=32, policy=policy)
        assert step.fused_supported(cache, 2) and (calls[-1]["tuning"], calls[-1]["picks"]) == ((256, 4), "walk")
        monkeypatch.setattr(ck, "DEFAULT_WARPS", None)
    finally:
        selftest.rung0_trusted.cache_clear()

    # the check itself, on the CPU (interpret mode): a non-base setting runs on a cache of two chunks of its width
    ran = []
    real = ck.certify_rung0

    def spy(*args, **kwargs):
        ran.append((args[0].shape[-1], kwargs.get("chunk_blocks"), kwargs.get("num_warps")))
        return real(*args, **kwargs)

    monkeypatch.setattr(ck, "certify_rung0", spy)
    monkeypatch.setattr(ck, "DEFAULT_SELECT", "loop")
    assert real_check(16, 32, 16, 8, 4, 2, tuning=(16, 8)) is None
    # 16 + 8 + 3 full blocks, padded to 32 block columns
    assert ran == [(32, 16, 8)]
    # with the counted selection (CERTATTN_RUNG0_SELECT=count), also a cache whose one chunk takes it; the
    # layer-view form walks the same sizes
    monkeypatch.setattr(ck, "DEFAULT_SELECT", "count")
    for layer_view in (False, True):
        ran.clear()
        assert real_check(16, 32, 16, 8, 4, 2, tuning=(16, 8), layer_view=layer_view) is None
        assert ran == [(32, 16, 8), (16, 16, 8)]
    # asked for one way of picking (the asking cache's), only a cache that picks that way
    for picks, want in (("walk", [(32, 16, 8)]), ("count", [(16, 16, 8)])):
        ran.clear()
        assert real_check(16, 32, 16, 8, 4, 2, tuning=(16, 8), picks=picks) is None
        assert ran == want, picks
    with pytest.raises(ValueError, match="picks"):
        real_check(16, 32, 16, 8, 4, 2, tuning=(16, 8), picks="sometimes")
    with pytest.raises(ValueError, match="no cache picks"):  # one chunk of 16 columns always counts
        real_check(16, 32, 16, 8, 4, 2, tuning=(16, 8), picks="loop")
    # the cache each way runs on, at every chunk width (each padded block count as the kernel computes it)
    for chunk, small in itertools.product(ck.CHUNK_CHOICES, (False, True)):
        for select in ("count", "loop"):
            for picks in ck.SELECTION_REGIMES:
                try:
                    blocks = selftest._regime_full_blocks(picks, chunk, select, small=small)
                except ValueError:
                    # no such cache: the loop selection never counts; one chunk of at most 128 columns always does
                    assert (picks, select) == ("count", "loop") or (
                        (picks, select) == ("loop", "count") and chunk <= ck.COUNT_SELECT_MAX_COLUMNS)
                    continue
                assert ck.selection_regime(ck.padded_blocks(blocks + 1), chunk, select) == picks
    assert ck.counts_picks(16, 16) and not ck.counts_picks(32, 16)
    # and its verdict is keyed apart from the loop's
    keys = []
    monkeypatch.setattr(selftest, "_trusted", lambda what, config, *a: keys.append(config) or True)
    try:
        selftest.rung0_trusted.cache_clear()
        selftest.rung0_trusted(16, 32, 16, 8, 4, 2, select="count")
        selftest.rung0_trusted(16, 32, 16, 8, 4, 2, select="loop")
    finally:
        selftest.rung0_trusted.cache_clear()
    assert keys[0]["rung0_select"] == "count" and "rung0_select" not in keys[1]
    # and the way of picking is keyed
    try:
        for picks in ("count", "walk"):
            selftest.rung0_trusted.cache_clear()
            selftest.rung0_trusted(16, 32, 16, 8, 4, 2, tuning=(128, 8), select="count", picks=picks)
    finally:
        selftest.rung0_trusted.cache_clear()
    assert (keys[2]["rung0_picks"], keys[3]["rung0_picks"]) == ("count", "walk")
    del keys[2:]
    # and the layer-view form's apart from the cache's own arrays' (whose key is unchanged: kept verdicts stay)
    try:
        selftest.rung0_trusted.cache_clear()
        selftest.rung0_trusted(16, 32, 16, 8, 4, 2, layer_view=True)
    finally:
        selftest.rung0_trusted.cache_clear()
    assert keys[2]["rung0_form"] == "layer_view" and "rung0_form" not in keys[1]


def _slow_verdict(problem, seconds, log):
    """A stand-in for a kernel check: logs when it starts and ends, sleeps, answers `problem`."""
    import time

    def check(**cfg):
        log.append(("check starts", time.perf_counter()))
        time.sleep(seconds)
        log.append(("check ends", time.perf_counter()))
        return problem

    return check


@pytest.mark.parametrize("kept", [False, True], ids=["checking", "kept-on-disk"])
def test_a_compile_overlaps_the_checks_and_is_kept_once_they_pass(monkeypatch, tmp_path, kept):
    """compile_while_checking: the trace asks a predicate whose check is still running and goes on at once (the
    check runs beside it); the build is returned, unbuilt again, once the verdict is in. A verdict already kept on
    disk is simply read (nothing assumed, nothing started)."""
    import time

    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", str(tmp_path / "verdicts.json"))
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
    log = []
    monkeypatch.setattr(selftest, "tier1_disagreement", _slow_verdict(None, 0.5, log))
    selftest.tier1_trusted.cache_clear()
    try:
        if kept:
            assert selftest.tier1_trusted(16, 32, 16, 8, 4)
            selftest.tier1_trusted.cache_clear()
            log.clear()
        builds = []

        def build():
            builds.append((selftest.tier1_trusted(16, 32, 16, 8, 4), time.perf_counter()))
            assert selftest.tier1_trusted(16, 32, 16, 8, 4)  # asked again (another layer): one check all the same
            assert len(selftest._OPTIMISTIC.assumed) == (0 if kept else 1)
            return f"program {len(builds)}"

        assert selftest.compile_while_checking(build) == "program 1"
        assert len(builds) == 1 and builds[0][0]
        if kept:
            assert log == []
        else:
            (_, start), (_, end) = log
            assert builds[0][1] < end  # the trace did not wait for the check
        assert selftest.tier1_trusted(16, 32, 16, 8, 4) and len(log) == (0 if kept else 2)  # memoised: no recheck
    finally:
        selftest.tier1_trusted.cache_clear()


def test_a_compile_built_on_a_kernel_that_then_fails_its_check_is_rebuilt_without_it(monkeypatch, tmp_path):
    """The fused rung 0's check fails after the trace assumed it: the first program is dropped (never returned),
    the step is traced and compiled again -- now on the jnp rung 0 (the fused one is not even traced) -- with
    the failure warned, and that program computes what the jnp rung 0 computes."""
    from certattn_jax.attention import certified_attention

    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", str(tmp_path / "verdicts.json"))
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
    log = []
    monkeypatch.setattr(selftest, "rung0_disagreement", _slow_verdict("bound smaller than the jnp rung 0's", 0.3, log))
    monkeypatch.setattr(selftest, "tier1_disagreement", lambda **cfg: None)
    from certattn_jax import ladder

    fused_traces = []
    real_fused = ladder.rung0_fused
    monkeypatch.setattr(ladder, "rung0_fused", lambda *a, **k: fused_traces.append(1) or real_fused(*a, **k))
    policy = CertPolicy(block_size=16, group_size=16, k_max=2, tier1="jnp", rung0="fused")
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.standard_normal((1, 70, 1, 32)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((1, 2, 32)), jnp.float32)
    cache = TieredKVCache.from_dense(k, v, policy)
    for fn in (selftest.tier1_trusted, selftest.rung0_trusted, selftest.gather_trusted):
        fn.cache_clear()
    try:
        def build():
            return jax.jit(lambda q, c: certified_attention(q, c, policy)).lower(q, cache).compile()

        with pytest.warns(RuntimeWarning, match="bound smaller"):
            program = selftest.compile_while_checking(build)
        assert len(fused_traces) == 1 and len(log) == 2  # traced once with the kernel, then without; checked once
        out, cert = program(q, cache)
        jnp_policy = dataclasses.replace(policy, rung0="jnp")
        want, want_cert = jax.jit(lambda q, c: certified_attention(q, c, jnp_policy))(q, cache)
        assert len(fused_traces) == 1
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(cert.rung, want_cert.rung)
        np.testing.assert_allclose(cert.error_bound, want_cert.error_bound, rtol=1e-6)
    finally:
        for fn in (selftest.tier1_trusted, selftest.rung0_trusted, selftest.gather_trusted):
            fn.cache_clear()


def test_a_check_finished_in_the_background_is_not_run_again_without_a_verdict_file(monkeypatch):
    """A verdict the background reached before anyone asked is the foreground's verdict too, also where no file
    keeps verdicts (on the GPU, SmolLM2's fused rung 0 check ran a second time, 7 s, in the foreground: twenty-sixth
    session); so is a failure (it still warns, in the foreground)."""
    monkeypatch.setenv("CERTATTN_SELFTEST_CACHE", "off")
    monkeypatch.setattr(selftest, "runs_compiled_kernels", lambda: True)
    calls = []
    check = _recording_checks(calls)

    for what, found in (("kernel D", None), ("kernel E", "out off by 4")):
        threads = selftest.start_in_background(lambda what=what, found=found: selftest._trusted(
            what, dict(block_size=8), check(found), ""))
        for t in threads:
            t.join(10)
        runs = len(calls)
        if found is None:
            assert selftest._trusted(what, dict(block_size=8), check("never asked"), "")
        else:
            with pytest.warns(RuntimeWarning, match="off by 4"):
                assert not selftest._trusted(what, dict(block_size=8), check(None), "jnp instead")
        assert len(calls) == runs == (1 if found is None else 2)


def test_a_verdict_reached_meanwhile_is_not_run_again(monkeypatch):
    """`_run_once` reads this process's verdicts under its lock: a check that finished after the caller looked
    for a kept verdict (and before it asked to run one) is not run a second time."""
    key = "a key of kernel F"
    monkeypatch.setitem(selftest._PROCESS_VERDICTS, key, {"problem": "out off by 5"})

    def never():
        raise AssertionError("the check ran again")

    assert selftest._run_once(key, never) == (False, "out off by 5")
