"""The evaluation's decode loops and audit on a tiny random LLaMA: teacher forcing equals a full forward pass,
greedy equals recomputation from scratch, and the audit streams every head-step with the right true error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certattn_jax.attention import naive_attention
from certattn_jax.cache import TieredKVCache
from certattn_jax.evals import decode
from certattn_jax.evals.audit import AuditCollector
from certattn_jax.evals.session import Mode, Session
from certattn_jax.policy import CertPolicy
from models import llama
from models.config import LlamaConfig
from models.rope import apply_rope, rope_cos_sin

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
CAP, CHUNK, PREFIX, STEPS = 128, 32, 70, 24


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, PREFIX + STEPS + 1).astype(np.int32)


def test_teacher_forced_dense_equals_full_forward(params, ids):
    s = Session(params, CFG, None, CAP, CHUNK)
    nll, ok = s.nll(Mode("dense", "dense", POLICY), ids, PREFIX)
    logits = np.asarray(llama.forward(params, CFG, jnp.asarray(ids[None]))[0][0], np.float64)
    rows = logits[PREFIX:-1]
    ref = np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1)) + rows.max(-1) - rows[
        np.arange(STEPS), ids[PREFIX + 1:]]
    np.testing.assert_allclose(nll, ref, atol=2e-4)
    np.testing.assert_array_equal(ok, rows.argmax(-1) == ids[PREFIX + 1:])
    with pytest.raises(ValueError, match="prefix"):
        s.nll(Mode("dense", "dense", POLICY), ids, len(ids) - 1)
    with pytest.raises(ValueError, match="capacity"):
        s.generate(Mode("dense", "dense", POLICY), ids, CAP)


def test_greedy_dense_is_the_argmax_chain(params, ids):
    """Greedy tokens fed back through the teacher-forced loop (checked against a full forward above) are each
    that loop's argmax; stop ids cut the output."""
    s = Session(params, CFG, None, CAP, CHUNK)
    dense = Mode("dense", "dense", POLICY)
    toks = s.generate(dense, ids[:PREFIX], STEPS + 1)
    assert len(toks) == STEPS + 1
    _, ok = s.nll(dense, np.concatenate([ids[:PREFIX], toks]), PREFIX)
    assert ok.all()
    first_stop = toks.index(toks[3])
    assert s.generate(dense, ids[:PREFIX], STEPS + 1, stop_ids=(toks[3],)) == toks[:first_stop]


def _layer0_qkv(params, tokens):
    """Layer 0's q [T, Hq, d], k, v [T, Hkv, d] for tokens at positions 0..T-1, computed directly."""
    layer = params["layers"][0]
    x = params["embed"][jnp.asarray(tokens)][None]
    h = llama.rms_norm(x, layer["attn_norm"], CFG.rms_norm_eps)
    cos, sin = rope_cos_sin(CFG, jnp.arange(len(tokens))[None])
    d = CFG.head_dim
    q = apply_rope((h @ layer["wq"]).reshape(1, -1, CFG.num_heads, d), cos, sin)
    k = apply_rope((h @ layer["wk"]).reshape(1, -1, CFG.num_kv_heads, d), cos, sin)
    v = (h @ layer["wv"]).reshape(1, -1, CFG.num_kv_heads, d)
    return q[0], k[0], v[0]


def test_audit_streams_every_head_step_with_the_true_error(params, ids):
    """Naive cache: every step is streamed, and the true error of layer 0 at the first decode step equals an
    independent computation (float64 exact attention; the library's naive attention on a cache built from the
    same k/v)."""
    s = Session(params, CFG, None, CAP, CHUNK)
    records = []
    naive = Mode("naive", "naive", POLICY)
    col = s.collector(naive)
    s.collectors[naive.label] = lambda step, rec: (records.append((step, rec)), col(step, rec))
    s.nll(naive, ids, PREFIX)
    assert sorted(r[0] for r in records) == list(range(STEPS))
    first = next(rec for step, rec in records if step == 0)
    q, k, v = _layer0_qkv(params, ids[:PREFIX + 1])
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q[-1], k, v))
    G = CFG.num_heads // CFG.num_kv_heads
    kk, vv = np.repeat(k64, G, axis=1), np.repeat(v64, G, axis=1)  # [T, Hq, d]
    sc = np.einsum("hd,thd->ht", q64, kk) / np.sqrt(CFG.head_dim)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    exact = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), vv)
    np.testing.assert_allclose(first["exact_norm"][0, 0], np.linalg.norm(exact, axis=-1), rtol=1e-4)
    tc = TieredKVCache.from_dense(k[None], v[None], POLICY, capacity=CAP)
    out = np.asarray(naive_attention(q[-1][None], tc)[0], np.float64)
    np.testing.assert_allclose(first["true_error"][0, 0], np.linalg.norm(out - exact, axis=-1), rtol=1e-3, atol=1e-6)
    assert first["true_error"].max() > 0

    s.collectors[naive.label] = col
    assert s.audit_summaries()["naive"]["head_steps"] == STEPS * CFG.num_layers * CFG.num_heads
    # (the certified cache's audit -- every head-step recorded, no violation -- runs in test_evals_cli.py)


def test_collector_counts_violations():
    from certattn_jax.certificate import empty_like_heads

    col = AuditCollector(num_layers=1)
    cert = empty_like_heads(1, 3)
    cert = cert.replace(error_bound=np.array([[1.0, 1.0, 1e-9]]), rung=np.array([[0, 2, 4]]),
                        k_star=np.array([[2, 3, 4]]), certified=np.ones((1, 3), bool))
    cert = jax.tree.map(lambda x: np.asarray(x)[None], cert)  # [L=1, B=1, H=3]
    col(0, {"cert": cert, "true_error": np.array([[[0.5, 2.0, 1.5e-9]]]), "exact_norm": np.ones((1, 1, 3))})
    s = col.summary()
    assert s["violations"] == 2 and s["violations_within_reference_rounding"] == 1
    assert s["violations_beyond_reference_rounding"] == 1 and s["max_excess"] == pytest.approx(1.0)
    assert s["rung_histogram"] == [1, 0, 1, 0, 1] and s["mean_k_star"] == pytest.approx(3.0)
    assert s["tightness_median"] == pytest.approx(2 / 3)


def test_variants_and_errors(params):
    with pytest.raises(ValueError, match="unknown cache variant"):
        decode.make_cache("fast", params, CFG, CAP)
    with pytest.raises(ValueError, match="dense cache is exact"):
        decode.make_cache("dense", params, CFG, CAP, audit=True)
    with pytest.raises(ValueError, match="multiple of the prefill chunk"):
        Session(params, CFG, None, 100, CHUNK)


def test_memory_table_k4v2_is_smaller_and_fixed_costs_amortize():
    from certattn_jax.evals.runner import memory_table

    rows = {(r["capacity"], r["layout"]): r["tier1_fraction"] for r in memory_table(CFG, POLICY, [256, 4096])}
    assert rows[(256, "K4V2")] < rows[(256, "INT8/INT4")] and rows[(4096, "K4V2")] < rows[(4096, "INT8/INT4")]
    assert rows[(4096, "INT8/INT4")] < rows[(256, "INT8/INT4")]  # the hot set and residual are a fixed cost
    # codes alone: 8/16 + 4/16 of bf16 = 0.375 (INT8/INT4), 4/16 + 2/16 = 0.1875 (K4V2); scales add more
    assert 0.375 < rows[(4096, "INT8/INT4")] and 0.1875 < rows[(4096, "K4V2")] < rows[(4096, "INT8/INT4")] - 0.15


def test_summary_schema_from_parts():
    from certattn_jax.evals.runner import memory_table, summarize

    audit = {"certified": {"head_steps": 10, "violations": 0, "violations_beyond_reference_rounding": 0,
                           "tightness_median": 3.0, "rung_histogram": [9, 1, 0, 0, 0], "mean_k_star": 2.0,
                           "share_rung0": 0.9}}
    ppl_rows = {"per_length": {"512": {"dense": {"ppl": 10.0}, "certified": {"ppl": 10.01}}}}
    result = {"ppl": ppl_rows, "audit": audit,
              "niah": {"accuracy": {"dense": 1.0, "certified": 0.5}, "n": 2,
                       "mcnemar_vs_dense": {"certified": {"p_value": 1.0}}},
              "ruler": {"lengths": [512], "scores": {"vt": {"512": {"dense": 50.0, "certified": 50.0}}}},
              "ablations": {"sweep": [{"violations": 0, "head_steps": 5, "rung_histogram": [5, 0, 0, 0, 0]}]},
              "aggressive": {"ppl": ppl_rows, "niah": {"accuracy": {"dense": 1.0}}, "audit": audit,
                             "memory": memory_table(CFG, POLICY, [256])}}
    s = summarize(result, "m", "cpu")
    assert s["ppl"] == {"dense": {"512": 10.0}, "certified": {"512": 10.01}}
    assert s["niah"] == {"dense": 1.0, "certified": 0.5, "n": 2, "mcnemar_p_certified_vs_dense": 1.0}
    assert s["ruler"] == {"vt": {"dense": 50.0, "certified": 50.0}}
    assert s["soundness"]["head_steps"] == 25 and s["soundness"]["rung_histogram"] == [23, 2, 0, 0, 0]
    assert s["aggressive"]["escalation_rate"] == {"certified": pytest.approx(0.1)}
    assert set(s["aggressive"]["tier1_fraction_bf16_by_capacity"]) == {"INT8/INT4@256", "K4V2@256"}


def test_tiered_prefill_goes_through_a_dense_staging_cache(params, ids, monkeypatch):
    """The evaluation prefills a tiered cache like `generate` does (dense staging + one conversion): no tier-2
    read, and the result holds what prefilling through the tiered cache's own exact path holds."""
    from certattn_jax import tiers
    from certattn_jax.attention import exact_keys_values

    prompt = ids[:PREFIX]
    direct = decode.make_cache("certified", params, CFG, CAP, POLICY)
    direct_logits = None
    for s in range(0, PREFIX, CHUNK):  # the tiered cache's own (exact, tier-2 reading) prefill path
        part = prompt[s:s + CHUNK]
        buf = np.zeros((1, CHUNK), np.int32)
        buf[0, :part.size] = part
        direct, direct_logits = decode.prefill_chunk(params, CFG, direct, jnp.asarray(buf),
                                                     jnp.asarray([part.size], jnp.int32))
    for name in ("read_all", "read_head", "read_block"):
        monkeypatch.setattr(tiers, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("tier-2 read")))
    staged, logits = decode.prefill(params, CFG, decode.make_cache("certified", params, CFG, CAP, POLICY), prompt,
                                    CHUNK)
    monkeypatch.undo()
    assert isinstance(staged, decode.EvalCache) and staged.inner.mode == "certified"
    np.testing.assert_allclose(np.asarray(logits), np.asarray(direct_logits), rtol=1e-5, atol=1e-5)
    assert np.asarray(staged.lengths).tolist() == [PREFIX]
    for layer in range(CFG.num_layers):
        a, b = staged.inner.layer_view(layer), direct.inner.layer_view(layer)
        np.testing.assert_array_equal(np.asarray(a.flushed), np.asarray(b.flushed))
        for x, y in zip(exact_keys_values(a), exact_keys_values(b), strict=True):
            np.testing.assert_allclose(np.asarray(x)[:, :, :PREFIX], np.asarray(y)[:, :, :PREFIX], rtol=1e-5,
                                       atol=1e-5)


def test_records_need_the_cpu_platform_and_the_cli_adds_it():
    # Measured on the H200: under JAX_PLATFORMS=cuda the records' io_callback failed at the first step.
    assert decode.platforms_with_cpu("cuda") == "cuda,cpu"
    assert decode.platforms_with_cpu("cuda, tpu") == "cuda,tpu,cpu"
    assert decode.platforms_with_cpu("cuda,cpu") == "cuda,cpu"
    assert decode.platforms_with_cpu("cpu") == "cpu"
    assert decode.platforms_with_cpu("") == ""
    assert decode.platforms_with_cpu(None) is None


def test_a_missing_cpu_backend_is_a_clear_error(monkeypatch):
    def no_cpu(backend=None):
        raise RuntimeError("Unknown backend cpu")

    monkeypatch.setattr(decode.jax, "local_devices", no_cpu)
    with pytest.raises(RuntimeError, match="JAX_PLATFORMS=cuda,cpu"):
        decode.require_host_callback_device()


def test_the_dense_reduce_control_is_exact_attention_in_another_summation_order(params, ids):
    """The perplexity noise-floor control: the same dense prefill, then decode steps through the `reduce`
    attention. Exact either way: its NLLs match dense to float32 rounding, yet its decode loop is a different
    program (the attention implementation is static)."""
    s = Session(params, CFG, None, CAP, CHUNK)
    traced = decode.TRACE_COUNTS["teacher"]
    dense, _ = s.nll(Mode("dense", "dense", POLICY), ids, PREFIX)
    after_dense = decode.TRACE_COUNTS["teacher"]
    control_mode = Mode("dense (reduce)", "dense-reduce", POLICY)
    assert not control_mode.tiered
    control, _ = s.nll(control_mode, ids, PREFIX)
    assert decode.TRACE_COUNTS["teacher"] > after_dense >= traced  # compiled for its own attention
    np.testing.assert_allclose(control, dense, atol=2e-4)
    assert not s.collectors.get("dense (reduce)")  # exact: not audited
    with pytest.raises(ValueError, match="dense cache is exact"):
        decode.make_cache("dense-reduce", params, CFG, CAP, audit=True)


def test_the_eval_runs_the_certified_fast_pass_in_a_loop_over_layers(params, monkeypatch):
    """The eval's cache wrapper passes the inner cache's layer schedule on: the certified fast pass of its
    teacher-forced loop is the looped one (compiled once), not unrolled over every layer (which compiled ~5x
    longer: results/probe_eval_compile_cpu.json)."""
    cache = decode.make_cache("certified", params, CFG, 96, POLICY)
    assert cache.decode_fast_path().schedule == cache.inner.schedule == "looped"
    unrolled_fast = []
    real = llama._layers_unrolled

    def spy(params_, config, x, c, *rest):
        if isinstance(c, decode.EvalCache) and c.inner.fast:
            unrolled_fast.append(c)
        return real(params_, config, x, c, *rest)

    monkeypatch.setattr(llama, "_layers_unrolled", spy)
    traces = decode.TRACE_COUNTS["teacher"]
    toks = jnp.zeros((1, 3), jnp.int32)
    decode.teacher_forced(params, CFG, cache, toks, toks)  # capacity 96: a shape no other test traces
    assert decode.TRACE_COUNTS["teacher"] == traces + 1 and not unrolled_fast


@pytest.mark.parametrize("eps", [0.05, 1e-7])
def test_the_eval_decodes_alike_under_every_layer_schedule(params, ids, eps):
    """The eval's cache wrapper carries every method of the two-pass decode step: teacher forcing through it gives
    the looped schedule's NLLs and last certificates under "adaptive" (both of its first passes) -- with the
    default tolerance and with one no head meets below rung 3. (The adaptive
    schedule reached `EvalCache.fast_pass_result`, which did not exist, on the H200: 2026-12-02.)"""
    import dataclasses

    policy = dataclasses.replace(POLICY, eps=eps, abs_tol=0.0)
    toks = jnp.asarray(ids[None, :40])
    runs = {}
    for schedule in ("looped", "adaptive"):  # (straight-looped: test_layer_schedules_decode_identically)
        cache = decode.make_cache("certified", params, CFG, 64, policy, schedule=schedule)
        nll, _, cache = decode.teacher_forced(params, CFG, cache, toks[:, :-1], toks[:, 1:])
        runs[schedule] = (np.asarray(nll), np.asarray(cache.inner.cert_packed))
    ref_nll, ref_cert = runs.pop("looped")
    from certattn_jax.certificate import PACKED_FIELDS

    if eps < 1e-3:  # the last step's heads needed the slow pass
        assert (ref_cert[..., PACKED_FIELDS.index("rung")] >= 3).any()
    exact = [PACKED_FIELDS.index(f) for f in ("k_star", "rung", "ranking_ok", "certified")]
    for name, (nll, cert) in runs.items():
        np.testing.assert_allclose(nll, ref_nll, rtol=0, atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(cert[..., exact], ref_cert[..., exact], err_msg=name)
        # the bounds: the same formulas in two programs, which XLA may associate differently (1 ulp seen on CPU)
        np.testing.assert_allclose(cert, ref_cert, rtol=1e-6, atol=0, err_msg=name)


def test_the_evaluation_refuses_bad_params_and_non_finite_logits(params, ids):
    """The evaluation's own loops (review of 2026-12-07): params that fail `generate`'s checks (a stale stacked
    copy of the layers, NaN) are refused when the session is made, and a NaN / Inf logit row (activations that
    overflow from finite weights) raises instead of scoring argmax-of-NaN, token 0, as a prediction."""
    stale = {**llama.with_stacked_layers(params), "layers": llama.init_params(CFG, jax.random.key(1), jnp.float32,
                                                                               scale=0.3)["layers"]}
    with pytest.raises(ValueError, match="stale copy"):
        Session(stale, CFG, None, CAP, CHUNK)
    with pytest.raises(ValueError, match="'embed' holds NaN"):
        Session({**params, "embed": params["embed"].at[0, 0].set(jnp.nan)}, CFG, None, CAP, CHUNK)
    huge = Session({**params, "lm_head": params["lm_head"].at[:, 5].set(3e38)}, CFG, None, CAP, CHUNK)
    dense = Mode("dense", "dense", POLICY)
    with pytest.raises(ValueError, match="non-finite logits .* generated token 0"):
        huge.generate(dense, ids[:PREFIX], 4)
    with pytest.raises(ValueError, match="non-finite logits .* teacher-forced step 0"):
        huge.nll(dense, ids, PREFIX)
    # token ids of a tokenizer that does not match the model: named, in the prompt and in the scored targets
    s = Session(params, CFG, None, CAP, CHUNK)
    prompt_bad, target_bad = ids.copy(), ids.copy()
    prompt_bad[1], target_bad[-1] = CFG.vocab_size, CFG.vocab_size + 7
    for run in (lambda: s.generate(dense, prompt_bad[:PREFIX], 2), lambda: s.nll(dense, target_bad, PREFIX),
                lambda: s.nll(dense, np.where(ids == ids[0], -1, ids), PREFIX)):
        with pytest.raises(ValueError, match=r"outside \[0, 96\): the tokenizer does not match"):
            run()
