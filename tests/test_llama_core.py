"""The functional LLaMA and the decode loop: cache consistency, chunking, compile-once, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decode_loop as decode_loop_module
from models import generate as gen
from models import llama
from models.config import LlamaConfig, RopeScaling

CONFIGS = {
    "gqa": LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=512),
    "mha_headdim": LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=3, num_heads=2,
                               num_kv_heads=2, head_dim=24, max_position_embeddings=512, rope_theta=500.0),
    "llama3_rope": LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                               num_kv_heads=1, head_dim=8, max_position_embeddings=512, rope_theta=10000.0,
                               rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16), tie_word_embeddings=True),
}

fwd = jax.jit(llama.forward, static_argnums=1)


def _setup(name, seed=0):
    cfg = CONFIGS[name]
    params = llama.init_params(cfg, jax.random.key(seed), jnp.float32, scale=0.25)
    return cfg, params


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("prompt_len", [1, 5, 17])
def test_cached_decode_equals_full_recomputation(name, prompt_len):
    cfg, params = _setup(name, seed=prompt_len)
    rng = np.random.default_rng(prompt_len)
    total = prompt_len + 12
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, total)), jnp.int32)
    full, _ = fwd(params, cfg, tokens)
    cache = llama.init_cache_for(params, cfg, 2, 64)
    logits, cache = fwd(params, cfg, tokens[:, :prompt_len], cache)
    steps = [logits]
    for t in range(prompt_len, total):
        step, cache = fwd(params, cfg, tokens[:, t:t + 1], cache)
        steps.append(step)
    assert _rel(jnp.concatenate(steps, axis=1), full) <= 1e-4
    assert np.asarray(cache.lengths).tolist() == [total, total]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chunked_prefill_equals_one_shot(name):
    cfg, params = _setup(name, seed=3)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 40)), jnp.int32)
    full, _ = fwd(params, cfg, tokens)
    cache = llama.init_cache_for(params, cfg, 1, 64)
    parts = []
    for s in range(0, 40, 16):
        out, cache = fwd(params, cfg, tokens[:, s:s + 16], cache)
        parts.append(out)
    assert _rel(jnp.concatenate(parts, axis=1), full) <= 1e-4


def _greedy_reference(params, cfg, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        logits, _ = fwd(params, cfg, jnp.asarray([seq], jnp.int32))
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("chunk", [3, 256])
def test_generate_ragged_batch_matches_recomputation(chunk):
    cfg, params = _setup("gqa", seed=11)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 9, 14)]
    out = gen.generate(params, cfg, prompts, 8, prefill_chunk=chunk, eos_token_ids=(), progress=False)
    for prompt, toks in zip(prompts, out.tokens, strict=True):
        assert toks == _greedy_reference(params, cfg, prompt, 8)
    assert out.num_steps == 8


def test_decode_loop_compiles_once_for_more_tokens():
    cfg, params = _setup("gqa", seed=5)
    prompt = [[1, 2, 3, 4]]
    gen.generate(params, cfg, prompt, 6, eos_token_ids=(), progress=False)
    before = dict(gen.TRACE_COUNTS)
    out = gen.generate(params, cfg, prompt, 12, eos_token_ids=(), progress=False)
    assert len(out.tokens[0]) == 12
    assert gen.TRACE_COUNTS == before


def test_generate_stops_at_eos():
    cfg, params = _setup("gqa", seed=6)
    prompt = [5, 6, 7]
    ref = _greedy_reference(params, cfg, prompt, 6)
    eos = ref[2]
    out = gen.generate(params, cfg, [prompt], 6, eos_token_ids=(eos,), progress=False)
    assert out.tokens[0] == ref[:ref.index(eos)]
    assert out.finished == [True]


def test_sampling_is_seeded_and_top_p_tiny_is_greedy():
    cfg, params = _setup("gqa", seed=7)
    prompt = [[3, 1, 4, 1, 5]]
    a = gen.generate(params, cfg, prompt, 8, temperature=1.0, top_p=0.9, seed=1, eos_token_ids=(), progress=False)
    b = gen.generate(params, cfg, prompt, 8, temperature=1.0, top_p=0.9, seed=1, eos_token_ids=(), progress=False)
    assert a.tokens == b.tokens
    greedy = gen.generate(params, cfg, prompt, 8, eos_token_ids=(), progress=False)
    nucleus = gen.generate(params, cfg, prompt, 8, temperature=1.0, top_p=1e-6, seed=3, eos_token_ids=(),
                           progress=False)
    assert nucleus.tokens == greedy.tokens


def test_every_bit_of_the_seed_counts_and_no_temperature_is_too_small():
    """An audit: `jax.random.key` keeps the low 32 bits of a seed (64-bit integers off), so seeds 0 and 2**32 sampled
    the same tokens; and temperatures below 1e-6 were sampled as 1e-6 (T = 1e-7 drew the top token 66% of the time
    where it holds all the mass). Seeds below 2**32 keep their keys."""
    import jax

    from models.sampling import key_from_seed, select_next

    data = jax.random.key_data
    assert np.array_equal(data(key_from_seed(7)), data(jax.random.key(7)))
    keys = [tuple(np.asarray(data(key_from_seed(s))).tolist()) for s in (0, 2**32, -1, 2**32 - 1, 2**63 - 1, -2**63)]
    assert len(set(keys)) == len(keys)
    logits = jnp.asarray([[0.0, -1e-6, -2e-6, -1.0]] * 256, jnp.float32)
    for t in (1e-7, 5e-7, 1e-30):
        picks = select_next(logits, jax.random.key(0), greedy=False, temperature=jnp.float32(t), top_p=jnp.float32(1))
        want = np.exp(-np.asarray([0.0, 1e-6, 2e-6, 1.0], np.float64) / t)
        # the top token's share: ~1 at T = 1e-7 (0.66 before), ~0.87 at 5e-7
        assert abs(np.mean(np.asarray(picks) == 0) - want[0] / want.sum()) < 0.08, t
    zero = select_next(logits, jax.random.key(0), greedy=False, temperature=jnp.float32(0), top_p=jnp.float32(1))
    assert np.all(np.asarray(zero) == 0)  # a temperature that is 0 in float32: the top token
    cfg, params = _setup("gqa", seed=7)
    kw = dict(temperature=1.0, eos_token_ids=(), progress=False)
    assert gen.generate(params, cfg, [[3, 1, 4]], 12, seed=0, **kw).tokens != \
        gen.generate(params, cfg, [[3, 1, 4]], 12, seed=2**32, **kw).tokens


def test_bad_inputs_raise_clear_errors():
    cfg, params = _setup("gqa")
    with pytest.raises(ValueError, match="empty"):
        gen.generate(params, cfg, [[]], 4)
    with pytest.raises(ValueError, match="non-empty"):
        gen.generate(params, cfg, [], 4)
    with pytest.raises(ValueError, match="outside"):
        gen.generate(params, cfg, [[cfg.vocab_size]], 4)
    with pytest.raises(ValueError, match="context"):
        gen.generate(params, cfg, [[1] * 500], 20)
    with pytest.raises(ValueError, match="capacity"):
        gen.generate(params, cfg, [[1] * 10], 20, capacity=16)
    with pytest.raises(TypeError, match="integer"):
        llama.forward(params, cfg, jnp.ones((1, 3), jnp.float32))
    with pytest.raises(ValueError, match="token ids"):
        llama.forward(params, cfg, jnp.asarray([[1, -1]]))
    cache = llama.init_cache_for(params, cfg, 1, 4)
    with pytest.raises(ValueError, match="overflow"):
        llama.forward(params, cfg, jnp.asarray([[1, 2, 3, 4, 5]]), cache)


def test_inputs_that_would_decode_silently_wrong_are_refused():
    """Inputs that once produced a wrong answer without an error (a flat prompt list read as one prompt per
    token, float ids truncated, a NaN temperature sampling token 0, a NaN rope_theta, an integer dense cache, a
    cache spec of another model) and unclear crashes (float sizes, a bad cache_factory or policy type)."""
    import dataclasses

    from certattn_jax import CertPolicy
    from certattn_jax.model_cache import cache_spec

    cfg, params = _setup("gqa")
    cases = [
        (ValueError, "list of token-id lists", dict(prompts=[5, 6, 7])),
        (ValueError, "integer token ids", dict(prompts=[[1.7, 2.2]])),
        (ValueError, "finite temperature", dict(temperature=float("nan"))),
        (ValueError, "finite temperature", dict(top_p=float("nan"))),
        (ValueError, "max_new_tokens must be an integer", dict(max_new_tokens=2.0)),
        (ValueError, "capacity must be an integer", dict(capacity=64.0)),
        (ValueError, "prefill_chunk must be an integer", dict(prefill_chunk=0)),
        (TypeError, "cache_factory must be", dict(cache_factory=3)),
        (ValueError, "unknown cache mode ''", dict(cache_factory="")),
        (TypeError, "policy must be a certattn_jax.CertPolicy", dict(cache_factory="certified", policy={"eps": 1})),
        (ValueError, "the cache spec is for", dict(cache_factory=cache_spec(
            "dense", dataclasses.replace(cfg, head_dim=2 * cfg.head_dim), jnp.float32))),
    ]
    for err, match, kw in cases:
        kw = {"prompts": [[5, 6, 7]], "max_new_tokens": 2, **kw}
        with pytest.raises(err, match=match):
            gen.generate(params, cfg, kw.pop("prompts"), kw.pop("max_new_tokens"), progress=False, **kw)
    # what stays accepted: a 1-D integer array per prompt, numpy integer sizes
    out = gen.generate(params, cfg, [np.array([5, 6, 7])], np.int64(2), progress=False, eos_token_ids=())
    assert len(out.tokens[0]) == 2
    with pytest.raises(TypeError, match="floating point"):
        cache_spec("dense", cfg, jnp.int8)
    for bad in (dict(rope_theta=0.0), dict(rope_theta=float("nan")), dict(rms_norm_eps=-1.0),
                dict(tie_word_embeddings="yes")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            dataclasses.replace(cfg, **bad)
    with pytest.raises(ValueError, match="must be true or false"):
        LlamaConfig.from_hf_dict({**cfg.to_hf_dict(), "tie_word_embeddings": "yes"})
    with pytest.raises(ValueError, match="JSON object"):
        LlamaConfig.from_hf_dict([1, 2])
    for kw, err in ((dict(eps=float("nan")), ValueError), (dict(rank_margin=float("nan")), ValueError),
                    (dict(v_tol=float("nan")), ValueError), (dict(eps="0.1"), TypeError),
                    (dict(k_max=2.5), TypeError), (dict(block_size=True), TypeError)):
        with pytest.raises(err, match=next(iter(kw))):
            CertPolicy(**kw)


def test_out_of_vocabulary_ids_inside_jit_poison_instead_of_wrapping():
    """Inside jit a token id cannot raise: an id outside the vocabulary gives NaN logits for its sequence (never
    the logits of another token's row), the other sequences are untouched."""
    cfg, params = _setup("gqa")
    f = jax.jit(lambda t: llama.forward(params, cfg, t)[0])
    good = np.asarray(f(jnp.asarray([[1, 2, 3], [4, 5, 6]])))
    for bad_id in (cfg.vocab_size, -1):
        out = np.asarray(f(jnp.asarray([[1, 2, bad_id], [4, 5, 6]])))
        assert np.all(np.isnan(out[0, 2]))  # (earlier positions may be NaN too: masked NaN values times 0)
        np.testing.assert_allclose(out[1], good[1], rtol=1e-6)


def test_overflow_inside_jit_poisons_instead_of_wrapping():
    cfg, params = _setup("gqa")
    cache = llama.init_cache_for(params, cfg, 1, 4)
    logits, cache = fwd(params, cfg, jnp.asarray([[1, 2, 3, 4]]), cache)
    assert np.isfinite(np.asarray(logits)).all()
    logits, _ = fwd(params, cfg, jnp.asarray([[5]]), cache)
    assert np.isnan(np.asarray(logits)).all()


def test_decode_loop_command_buffer_scheduling(monkeypatch):
    """The decode loop asks a GPU for concurrent command buffers, nothing elsewhere; the environment can choose the
    mode or leave XLA's; XLA_FLAGS naming the mode wins; a bad value is an error naming the variable."""
    monkeypatch.delenv("CERTATTN_COMMAND_BUFFER_SCHEDULING", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    option = "xla_gpu_command_buffer_scheduling_mode"
    monkeypatch.setenv("CERTATTN_FUSION_AUTOTUNER", "auto")  # (its own option: test_fusion_autotuner_option)

    def scheduling(backend):
        return {k: v for k, v in gen.decode_compiler_options(backend).items() if k == option}

    assert scheduling("gpu") == {option: "CONCURRENT"}
    assert gen.decode_compiler_options("cpu") == {}
    monkeypatch.setenv("CERTATTN_COMMAND_BUFFER_SCHEDULING", "serialize")
    assert scheduling("gpu") == {option: "SERIALIZE"}
    monkeypatch.setenv("CERTATTN_COMMAND_BUFFER_SCHEDULING", "xla")
    assert scheduling("gpu") == {}
    monkeypatch.setenv("CERTATTN_COMMAND_BUFFER_SCHEDULING", "CONCURRENT")
    monkeypatch.setenv("XLA_FLAGS", f"--{option}=SERIALIZE")
    assert gen.command_buffer_scheduling("gpu") == "xla"
    monkeypatch.setenv("CERTATTN_COMMAND_BUFFER_SCHEDULING", "sometimes")
    with pytest.raises(ValueError, match="CERTATTN_COMMAND_BUFFER_SCHEDULING"):
        gen.decode_compiler_options("gpu")
    # XLA accepts the option by name (a renamed option would fail here, not silently on the GPU)
    lowered = jax.jit(lambda x: x + 1).lower(jnp.ones(2))
    assert float(gen._compile_with_options(lowered, {option: "CONCURRENT"})(jnp.ones(2))[0]) == 2.0
    # an option this XLA does not know (or a value it refuses): compiled without it, with a warning naming it
    with pytest.warns(RuntimeWarning, match=option):
        compiled = gen._compile_with_options(lowered, {option: "NOT_A_MODE"})
    assert float(compiled(jnp.ones(2))[0]) == 2.0


def test_fusion_autotuner_option(monkeypatch):
    """The decode loop and the kernels' self-checks keep XLA's fusion autotuner setting on a GPU (auto), off / on
    with CERTATTN_FUSION_AUTOTUNER=0 / 1; nothing off a GPU or where XLA_FLAGS names the option; XLA knows the
    option by name; a bad value (or program kind) is an error naming it."""
    from certattn_jax import xla_options

    option = xla_options.FUSION_AUTOTUNER_OPTION
    monkeypatch.setenv("CERTATTN_CHECKS_AUTOTUNE", "1")  # (its own option: the next test)
    monkeypatch.delenv("CERTATTN_FUSION_AUTOTUNER", raising=False)
    monkeypatch.delenv("CERTATTN_COMMAND_BUFFER_SCHEDULING", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    assert xla_options.compile_options("gpu") == {} == xla_options.compile_options("gpu", "checks")  # XLA's
    assert option not in gen.decode_compiler_options("gpu")
    with pytest.raises(ValueError, match="program"):
        xla_options.compile_options("gpu", "prefill")
    assert xla_options.compile_options("cpu") == {} and option not in gen.decode_compiler_options("cpu")
    monkeypatch.setenv("CERTATTN_FUSION_AUTOTUNER", "0")
    assert xla_options.compile_options("gpu") == {option: False} == xla_options.compile_options("gpu", "checks")
    assert gen.decode_compiler_options("gpu")[option] is False
    monkeypatch.setenv("CERTATTN_FUSION_AUTOTUNER", "1")
    assert xla_options.compile_options("gpu") == {option: True}
    monkeypatch.setenv("XLA_FLAGS", f"--{option}=false")
    assert xla_options.compile_options("gpu") == {} and xla_options.fusion_autotuner_on("gpu") is None
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("CERTATTN_FUSION_AUTOTUNER", "maybe")
    with pytest.raises(ValueError, match="CERTATTN_FUSION_AUTOTUNER"):
        xla_options.compile_options("gpu")
    # an option this XLA does not know is left out rather than failing every compile that asks for it
    assert xla_options._known(option, False) and not xla_options._known("xla_no_such_option_here", False)


def test_the_kernel_checks_compile_without_autotuning_on_a_gpu(monkeypatch):
    """The self-checks' programs (run once, on tiny inputs) take no XLA autotuning on a GPU unless asked
    (CERTATTN_CHECKS_AUTOTUNE=1) or XLA_FLAGS names the level; the decode loop keeps XLA's; nothing off a GPU; the
    checks' jit compiles and runs with the options (here: the CPU, where none are asked)."""
    from certattn_jax import xla_options

    level = xla_options.AUTOTUNE_LEVEL_OPTION
    for name in ("CERTATTN_CHECKS_AUTOTUNE", "CERTATTN_FUSION_AUTOTUNER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    assert xla_options.compile_options("gpu", "checks") == {level: 0}
    assert level not in xla_options.compile_options("gpu", "decode")
    assert level not in gen.decode_compiler_options("gpu")
    assert xla_options.compile_options("cpu", "checks") == {}
    monkeypatch.setenv("CERTATTN_FUSION_AUTOTUNER", "0")
    assert xla_options.compile_options("gpu", "checks") == {level: 0, xla_options.FUSION_AUTOTUNER_OPTION: False}
    monkeypatch.delenv("CERTATTN_FUSION_AUTOTUNER")
    monkeypatch.setenv("CERTATTN_CHECKS_AUTOTUNE", "1")
    assert xla_options.compile_options("gpu", "checks") == {}
    monkeypatch.setenv("CERTATTN_CHECKS_AUTOTUNE", "auto")
    monkeypatch.setenv("XLA_FLAGS", f"--{level}=2")
    assert xla_options.compile_options("gpu", "checks") == {}
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("CERTATTN_CHECKS_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="CERTATTN_CHECKS_AUTOTUNE"):
        xla_options.checks_autotune_off("gpu")
    monkeypatch.delenv("CERTATTN_CHECKS_AUTOTUNE")
    assert xla_options._known(level, 0)  # XLA knows the option by name
    assert float(xla_options.jit(lambda x: x * 2)(jnp.ones(()))) == 2.0


def test_the_kernel_checks_compile_through_their_options(monkeypatch):
    """The self-checks' programs are compiled by `xla_options.jit` (a check built with a plain jax.jit would not
    get the checks' options), and that jit passes the options to XLA (here the GPU's set, which XLA:CPU accepts)."""
    from certattn_jax import xla_options
    from pallas_kernels import selftest

    level, fusion = xla_options.AUTOTUNE_LEVEL_OPTION, xla_options.FUSION_AUTOTUNER_OPTION
    gpu_options = {level: 0, fusion: False}
    monkeypatch.setattr(xla_options, "compile_options", lambda backend=None, program="decode": dict(gpu_options))
    seen = []
    real_jit = jax.jit

    def spying_jit(fun, **kwargs):
        seen.append(kwargs.get("compiler_options"))
        return real_jit(fun, **kwargs)

    monkeypatch.setattr(xla_options.jax, "jit", spying_jit)
    assert float(xla_options.jit(lambda x: x * 2)(jnp.ones(()))) == 2.0 and seen == [gpu_options]
    seen.clear()
    assert selftest.write_disagreement(16, 32, "bfloat16") is None  # a whole check (interpreted kernel here)
    assert seen and all(options == gpu_options for options in seen), seen


def test_xla_option_switches_fail_at_import_and_only_definite_answers_are_kept(monkeypatch):
    """A typo in CERTATTN_CHECKS_AUTOTUNE / CERTATTN_FUSION_AUTOTUNER fails when the module is imported, naming
    the variable; `_known` keeps a definite answer but asks again after a failure for another reason."""
    import importlib

    from certattn_jax import xla_options

    for name in ("CERTATTN_CHECKS_AUTOTUNE", "CERTATTN_FUSION_AUTOTUNER"):
        monkeypatch.setenv(name, "perhaps")
        with pytest.raises(ValueError, match=name):
            importlib.reload(xla_options)
        monkeypatch.delenv(name)
    importlib.reload(xla_options)
    option = "xla_gpu_autotune_level"
    xla_options._KNOWN.clear()
    real_zeros = xla_options.jnp.zeros

    def out_of_memory(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(xla_options.jnp, "zeros", out_of_memory)
    assert not xla_options._known(option, 0) and (option, 0) not in xla_options._KNOWN
    monkeypatch.setattr(xla_options.jnp, "zeros", real_zeros)
    assert xla_options._known(option, 0) and xla_options._KNOWN[option, 0]
    assert not xla_options._known("xla_no_such_option_here", 0) and not xla_options._KNOWN["xla_no_such_option_here", 0]


def test_the_decode_loop_can_ask_for_control_flow_in_its_graphs(monkeypatch):
    """CERTATTN_DECODE_CONTROL_FLOW_GRAPHS=1 compiles the decode loop (only) with conditionals and while loops
    inside its command buffers on a GPU, XLA's default contents spelled out (the "+" form is refused through
    compiler options); off by default, off a GPU and where XLA_FLAGS names the option; XLA knows the value."""
    from certattn_jax import xla_options

    option = xla_options.COMMAND_BUFFER_OPTION
    for name in ("CERTATTN_DECODE_CONTROL_FLOW_GRAPHS", "CERTATTN_FUSION_AUTOTUNER", "CERTATTN_CHECKS_AUTOTUNE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    assert option not in gen.decode_compiler_options("gpu")
    monkeypatch.setenv("CERTATTN_DECODE_CONTROL_FLOW_GRAPHS", "1")
    assert gen.decode_compiler_options("gpu")[option] == xla_options.CONTROL_FLOW_COMMAND_BUFFERS
    assert {"CONDITIONAL", "WHILE", "FUSION"} <= set(xla_options.CONTROL_FLOW_COMMAND_BUFFERS.split(","))
    assert option not in xla_options.compile_options("gpu", "checks")
    assert gen.decode_compiler_options("cpu") == {}
    monkeypatch.setenv("XLA_FLAGS", f"--{option}=+CONDITIONAL")
    assert option not in gen.decode_compiler_options("gpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert xla_options._known(option, xla_options.CONTROL_FLOW_COMMAND_BUFFERS)
    assert not xla_options._known(option, "+CONDITIONAL,+WHILE")
    monkeypatch.setenv("CERTATTN_DECODE_CONTROL_FLOW_GRAPHS", "sometimes")
    with pytest.raises(ValueError, match="CERTATTN_DECODE_CONTROL_FLOW_GRAPHS"):
        gen.decode_compiler_options("gpu")


def test_the_model_level_inputs_of_the_thirtieth_session_audit_are_refused_or_poisoned():
    """An audit's silent wrong answers at the model level: tokens of another batch than the cache (wrong logits
    and a corrupted cache), valid_lengths out of range or non-integer (lengths moved past the tokens given),
    params that do not match the config (a layer short, fused widths wrong) or hold NaN / Inf (token 0 forever),
    a cache_factory of another batch, seeds and eos ids of the wrong kind."""
    from certattn_jax.model_cache import cache_spec

    cfg, params = _setup("gqa")
    cache = llama.init_cache_for(params, cfg, 1, 32)
    with pytest.raises(ValueError, match="batch 2 but the cache holds 1"):
        llama.forward(params, cfg, jnp.asarray([[1, 2], [3, 4]]), cache)
    for bad, err, match in (([5], ValueError, r"valid_lengths must lie in \[0, 2\]"),
                            ([-1], ValueError, "valid_lengths must lie"),
                            ([1.5], TypeError, "valid_lengths must be integers"),
                            ([1, 1], ValueError, r"valid_lengths must be \[B\] = \[1\]")):
        with pytest.raises(err, match=match):
            llama.forward(params, cfg, jnp.asarray([[1, 2]]), cache, valid_lengths=jnp.asarray(bad))
    # inside jit the count cannot raise: that sequence's logits are NaN, the other's are untouched
    cache2 = llama.init_cache_for(params, cfg, 2, 32)
    f = jax.jit(lambda t, vl, c: llama.forward(params, cfg, t, c, valid_lengths=vl)[0])
    toks = jnp.asarray([[1, 2], [3, 4]])
    good = np.asarray(f(toks, jnp.asarray([2, 2]), cache2))
    out = np.asarray(f(toks, jnp.asarray([7, 2]), cache2))
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
    np.testing.assert_allclose(out[1], good[1], rtol=1e-6)

    def run(p=params, **kw):
        kw = {"eos_token_ids": (), **kw}
        return gen.generate(p, cfg, [[1, 2, 3]], 2, progress=False, **kw)

    short = {**params, "layers": params["layers"][:1]}
    with pytest.raises(ValueError, match="params has 1 layers"):
        run(short)
    nan_embed = {**params, "embed": params["embed"].at[3].set(jnp.nan)}
    with pytest.raises(ValueError, match="parameter 'embed' holds NaN or Inf"):
        run(nan_embed)
    inf_wq = {**params, "layers": [{**params["layers"][0], "wq": params["layers"][0]["wq"].at[0, 0].set(jnp.inf)},
                                   params["layers"][1]]}
    with pytest.raises(ValueError, match="layers.0.wq"):
        run(inf_wq)
    fused = llama.fuse_projections(params)
    assert run(fused).tokens == run().tokens  # fused projections are accepted
    bad_fused = {**fused, "layers": [{**fused["layers"][0], "wqkv": fused["layers"][0]["wqkv"][:, :-1]},
                                     fused["layers"][1]]}
    with pytest.raises(ValueError, match="layers.0.wqkv"):
        run(bad_fused)
    spec = cache_spec("dense", cfg, jnp.float32)
    with pytest.raises(ValueError, match="returned a cache for 2 sequences"):
        run(cache_factory=lambda b, cap: spec(2, cap))
    with pytest.raises(TypeError, match="must return a KV cache"):
        run(cache_factory=lambda b, cap: None)
    for seed in (1.5, None, 2 ** 70):
        with pytest.raises(ValueError, match="seed must be an integer"):
            run(seed=seed)
    for eos, err in ((5, TypeError), ("5", TypeError), ([5.5], ValueError), ([cfg.vocab_size], ValueError),
                     ([2 ** 40], ValueError)):
        with pytest.raises(err, match="eos_token_ids"):
            run(eos_token_ids=eos)
    assert len(run(eos_token_ids=np.asarray([96])).tokens[0]) >= 1  # a NumPy array of ids is accepted


def test_non_finite_logits_stop_the_sequence_and_raise_naming_it(monkeypatch):
    """A step whose logits hold NaN / Inf (activations that overflow from finite weights) once chose token 0
    (argmax of NaN) and went on silently. Now that sequence stops there and generate raises
    NonFiniteLogitsError naming (sequence, step), with the tokens before it as `.output`."""
    cfg, params = _setup("gqa", seed=6)
    prompts = [[5, 6, 7], [8, 9]]
    ref = gen.generate(params, cfg, prompts, 6, eos_token_ids=(), progress=False).tokens
    # a real overflow from finite weights: one lm_head column of 3e38 sends every logit row to +-Inf (the first
    # token's, from the prefill, already)
    huge = {**params, "lm_head": params["lm_head"].at[:, 4].set(3e38)}
    with pytest.raises(gen.NonFiniteLogitsError, match="sequence 0 at generated token 0") as info:
        gen.generate(huge, cfg, prompts, 6, eos_token_ids=(), progress=False)
    assert info.value.rows == [(0, 0), (1, 0)] and info.value.output.tokens == [[], []]
    assert info.value.output.finished == [False, False]

    # an overflow at a later step, injected where a token T would be chosen; the decode loops are traced again
    trigger = ref[0][2]
    first = [r.index(trigger) if trigger in r else None for r in ref]
    assert first[0] == 2
    real = decode_loop_module.logits_from_hidden

    def overflowing(p, c, hidden):
        logits = real(p, c, hidden)
        hit = jnp.argmax(logits, axis=-1) == trigger
        return jnp.where(hit[:, None], jnp.nan, logits)

    monkeypatch.setattr(decode_loop_module, "logits_from_hidden", overflowing)
    monkeypatch.setattr(gen, "_COMPILED", {})
    monkeypatch.setattr(gen, "_BRIDGE_COMPILED", {})
    with pytest.raises(gen.NonFiniteLogitsError, match="sequence 0 at generated token 2") as info:
        gen.generate(params, cfg, prompts, 6, eos_token_ids=(), progress=False)
    assert info.value.rows == [(i, f) for i, f in enumerate(first) if f is not None]
    assert info.value.output.tokens == [r[:f] if f is not None else r for r, f in zip(ref, first, strict=True)]
    assert info.value.output.finished == [False, False]


def test_a_jax_setting_changed_between_generate_calls_is_honoured(monkeypatch):
    """The compiled decode loops are cached by `generate`'s own key; it once left out JAX's settings, so a second
    call after `jax_threefry_partitionable` flipped reused the first call's program and sampled other tokens than
    a fresh process (audit of 2026-12-07). The key now holds them, as jax.jit's does."""
    cfg, params = _setup("gqa")

    def run():
        return gen.generate(params, cfg, [[1, 2, 3]], 8, temperature=1.5, seed=3, eos_token_ids=(),
                            progress=False).tokens

    before = jax.config.jax_threefry_partitionable
    first = run()
    try:
        jax.config.update("jax_threefry_partitionable", not before)
        second = run()
        monkeypatch.setattr(gen, "_COMPILED", {})
        monkeypatch.setattr(gen, "_BRIDGE_COMPILED", {})
        fresh = run()
    finally:
        jax.config.update("jax_threefry_partitionable", before)
    assert first != fresh  # the setting changes the samples (else this test would prove nothing)
    assert second == fresh


def test_a_stale_stacked_copy_of_the_layers_is_refused():
    """params carrying `layers_stacked` (`with_stacked_layers`, which keeps a copy already there) whose `layers`
    were replaced afterwards: the certified first passes read the stale copy and decoded with the old weights under
    rung-0 certificates (audit of 2026-12-07). generate now refuses a copy that differs from the layers, by name."""
    cfg, params = _setup("gqa")
    _, other = _setup("gqa", seed=1)
    stacked = llama.with_stacked_layers(params)
    assert gen.generate(stacked, cfg, [[1, 2, 3]], 3, eos_token_ids=(), progress=False).tokens  # a true copy passes
    edited = {**stacked, "layers": other["layers"]}
    with pytest.raises(ValueError, match=r"layers_stacked'\] 'w\w+' of layer 0 differs .* stale copy"):
        gen.generate(edited, cfg, [[1, 2, 3]], 3, eos_token_ids=(), progress=False)
    one_layer = [other["layers"][0], params["layers"][1]]  # only layer 0 replaced
    with pytest.raises(ValueError, match="of layer 0 differs"):
        gen.generate({**stacked, "layers": one_layer}, cfg, [[1, 2, 3]], 3, eos_token_ids=(), progress=False)
    short = {**stacked, "layers_stacked": {k: v[:1] for k, v in stacked["layers_stacked"].items()}}
    with pytest.raises(ValueError, match=r"expected \(2, "):
        gen.generate(short, cfg, [[1, 2, 3]], 3, eos_token_ids=(), progress=False)


def test_the_bridge_builds_in_the_calling_thread_under_thread_local_jax_settings():
    """JAX's context managers set a setting for the calling thread only; the decode bridge's background builds
    would trace the whole program under the global one (review of 2026-12-07). The bridge asks first."""
    assert gen.background_sees_these_settings()
    with jax.threefry_partitionable(not jax.config.jax_threefry_partitionable):
        assert not gen.background_sees_these_settings()
    assert gen.background_sees_these_settings()
