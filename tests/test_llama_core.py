"""The functional LLaMA and the decode loop: cache consistency, chunking, compile-once, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    assert gen.decode_compiler_options("gpu") == {option: "CONCURRENT"}
    assert gen.decode_compiler_options("cpu") == {}
    monkeypatch.setenv("CERTATTN_COMMAND_BUFFER_SCHEDULING", "serialize")
    assert gen.decode_compiler_options("gpu") == {option: "SERIALIZE"}
    monkeypatch.setenv("CERTATTN_COMMAND_BUFFER_SCHEDULING", "xla")
    assert gen.decode_compiler_options("gpu") == {}
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
