"""The three cache modes inside the LLaMA and the decode loop, the CLI, and SmolLM2 end to end."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certattn_jax import cli
from certattn_jax.certificate import summarize
from certattn_jax.model_cache import tiered_cache_factory
from certattn_jax.policy import CertPolicy
from models import generate as gen
from models import llama
from models.config import LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)


def _run(params, prompts, n, mode=None, policy=POLICY, **kw):
    factory = None if mode is None else tiered_cache_factory(CFG, jnp.float32, policy, mode)
    return gen.generate(params, CFG, prompts, n, eos_token_ids=(), progress=False, cache_factory=factory,
                        prefill_chunk=32, record_steps=mode == "certified", **kw)


@pytest.mark.parametrize("bridge", ["0", "1"])
def test_certified_generation_matches_dense_and_compiles_once(params, bridge, monkeypatch):
    """Certified decoding matches dense on easy prompts and compiles once: more tokens and new tolerances reuse
    the programs; also through the decode bridge (`models.generate.decode_bridge`, the GPU default)."""
    monkeypatch.setenv("CERTATTN_DECODE_BRIDGE", bridge)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (70, 9, 33)]
    dense = _run(params, prompts, 20)
    cert = _run(params, prompts, 20, "certified")
    assert cert.tokens == dense.tokens
    s = summarize(cert.step_records)
    assert s["heads"] == 19 * CFG.num_layers * 3 * CFG.num_heads
    assert s["fraction_certified"] == 1.0
    gen.finish_background_compiles()  # (the bridge's whole program may still be tracing in the background)
    before = dict(gen.TRACE_COUNTS)
    again = _run(params, prompts, 40, "certified")  # twice the tokens: no retrace
    loose = _run(params, prompts, 40, "certified", policy=CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2,
                                                                    eps=0.2, tau_cov=0.9))  # new tolerances
    assert gen.TRACE_COUNTS == before
    assert again.tokens[0][:20] == dense.tokens[0]
    assert loose.num_steps == 40


def test_naive_and_certified_share_storage_and_certificates_are_recorded(params):
    prompts = [list(range(1, 60))]
    naive = _run(params, prompts, 8, "naive")
    cert = _run(params, prompts, 8, "certified")
    assert naive.step_records is None and len(naive.tokens[0]) == 8
    rec = cert.step_records
    assert rec.rung.shape == (7, CFG.num_layers, 1, CFG.num_heads)
    assert np.all(np.asarray(rec.error_bound) >= 0)
    layer0 = cert.cache.layers[0]
    assert int(layer0.lengths[0]) == 59 + 7 and int(layer0.flushed[0]) == (59 + 7) // 16 * 16


def test_forward_with_tiered_cache_matches_dense_logits(params):
    """Prefill is exact in every mode; a decode step differs from dense only within the certified bound."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (1, 50)), jnp.int32)
    fwd = jax.jit(llama.forward, static_argnums=1)
    dense_logits, _ = fwd(params, CFG, tokens)
    cache = tiered_cache_factory(CFG, jnp.float32, POLICY, "certified")(1, 64)
    logits, cache = fwd(params, CFG, tokens[:, :49], cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(dense_logits[:, :49]), rtol=1e-4, atol=1e-4)
    step, cache = fwd(params, CFG, tokens[:, 49:], cache)
    np.testing.assert_allclose(np.asarray(step[:, 0]), np.asarray(dense_logits[:, 49]), rtol=0.05, atol=0.05)
    assert int(cache.lengths[0]) == 50


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, params):
    from models.checkpoint import save_checkpoint
    from tests.test_loaders import tiny_tokenizer

    tok = tiny_tokenizer()
    cfg = LlamaConfig(**{**CFG.__dict__, "vocab_size": tok.vocab_size})
    p = llama.init_params(cfg, jax.random.key(1), jnp.float32, scale=0.3)
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_checkpoint(path, p, cfg, tok)
    return path


@pytest.mark.parametrize("mode", ["dense", "certified"])
def test_cli_generate_json_and_certificates(tiny_checkpoint, tmp_path, capsys, mode):
    certs = tmp_path / "certs.jsonl"
    argv = ["generate", "--model", str(tiny_checkpoint), "--prompt", "hello world", "--max-new-tokens", "6",
            "--cache", mode, "--json", "--dtype", "float32"]
    if mode == "certified":
        argv += ["--certificates", str(certs)]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) >= {"token_ids", "text", "tokens_per_s"}
    assert len(result["token_ids"]) == 6 or result["token_ids"][-1:] != []
    if mode == "certified":
        summary = result["certificate_summary"]
        assert set(summary) >= {"rung_histogram", "mean_k_star", "max_k_star", "max_error_bound",
                                "fraction_certified_without_escalation"}
        rows = [json.loads(line) for line in certs.read_text().splitlines()]
        assert len(rows) == (len(result["token_ids"]) - 1) * CFG.num_layers
        assert len(rows[0]["error_bound"]) == CFG.num_heads


def test_cli_errors_are_clear(tiny_checkpoint, capsys):
    assert cli.main(["generate", "--model", "no-such-model", "--prompt", "x"]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(tiny_checkpoint), "--prompt", "x", "--certificates", "f"]) == 2
    assert "--cache certified" in capsys.readouterr().err
    # checked before generating (not after, losing the output)
    assert cli.main(["generate", "--model", str(tiny_checkpoint), "--prompt", "x", "--cache", "certified",
                     "--certificates", "/no/such/dir/c.jsonl"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # an existing output directory: a one-line error, not a traceback; --overwrite replaces it
    assert cli.main(["convert", str(tiny_checkpoint), str(tiny_checkpoint)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    # an output under a file: named before the source loads
    assert cli.main(["convert", "no-such-source", str(tiny_checkpoint / "config.json" / "out")]) == 2
    assert "is not a writable directory" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--top-p", "0"], r"--top-p must lie in \(0, 1\]"),
    (["--top-p", "1.5"], r"--top-p must lie in \(0, 1\]"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be an integer >= 1"),
    (["--seed", "99999999999999999999"], "--seed must lie in"),
    (["--eps", "0.1"], "--eps applies to --cache certified only"),
    (["--cache", "naive", "--eps", "0.1"], "--eps applies to --cache certified only"),
    (["--key-bits", "4"], "--key-bits applies to --cache naive or certified only"),
    (["--value-bits", "2"], "--value-bits applies to --cache naive or certified only"),
    (["--group-size", "16"], "--group-size applies to --cache naive or certified only"),
    (["--cache", "certified", "--eps", "inf"], "eps must be finite"),
    (["--cache", "certified", "--eps", "-1"], "eps must be >= 0"),
    (["--cache", "certified", "--group-size", "1"], "group_size must be >= 2"),
    (["--cache", "naive", "--block-size", "24"], "block_size must be a power of two"),
    (["--cache", "certified", "--certificates", "{tmp}"], "is a directory"),
])
def test_cli_generate_checks_its_arguments_before_loading_the_model(tmp_path, capsys, monkeypatch, extra, message):
    """Bad generation arguments are a one-line error (exit 2) before the slow model load -- not a traceback
    (a huge --seed, a --certificates directory after the whole generation) and never silently ignored (--eps with
    a cache that has no tolerance)."""
    def load_model(*_):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(cli, "load_model", load_model)
    argv = ["generate", "--model", "unused", "--prompt", "x"] + [a.format(tmp=tmp_path) for a in extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert re.search(message, err[0])


@pytest.mark.parametrize("extra, message", [
    (["--needle-new-tokens", "0"], "--needle-new-tokens must be an integer >= 1"),
    (["--long-tokens", "-5"], "--long-tokens must be an integer >= 1"),
    (["--skip-comparison", "--eps", "0.5"], "--eps set the cache policy of parts 2-3, which --skip-comparison skips"),
    (["--skip-comparison", "--key-bits", "4", "--value-bits", "2"], "--key-bits, --value-bits set the cache"),
])
def test_cli_demo_checks_its_own_arguments_before_part_1(capsys, monkeypatch, extra, message):
    """The demo's own flags are checked with the generation flags, before the model loads (they failed after part
    1, or a policy flag with --skip-comparison was ignored)."""
    def load_model(*_):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(cli, "load_model", load_model)
    assert cli.main(["demo", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


@pytest.fixture(scope="module")
def head_dim_16_checkpoint(tmp_path_factory):
    from models.checkpoint import save_checkpoint
    from tests.test_loaders import tiny_tokenizer

    tok = tiny_tokenizer()
    cfg = LlamaConfig(**{**CFG.__dict__, "vocab_size": tok.vocab_size, "head_dim": 16, "num_heads": 4})
    path = tmp_path_factory.mktemp("ckpt16") / "tiny"
    save_checkpoint(path, llama.init_params(cfg, jax.random.key(1), jnp.float32, scale=0.3), cfg, tok)
    return path


def test_cli_group_size_and_block_size_reach_the_policy(head_dim_16_checkpoint, capsys):
    """head_dim 16 is no multiple of the default value group (32): the error names --group-size, which (with
    --block-size) passes through to CertPolicy."""
    argv = ["generate", "--model", str(head_dim_16_checkpoint), "--prompt", "hello", "--max-new-tokens", "2",
            "--cache", "certified", "--dtype", "float32", "--json"]
    assert cli.main(argv) == 2
    assert "--group-size" in capsys.readouterr().err
    assert cli.main(argv + ["--group-size", "16", "--block-size", "16"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(result["token_ids"]) >= 1 and result["certificate_summary"]["heads"] > 0


def test_cli_convert_refuses_to_overwrite_its_source(tmp_path, capsys):
    """`convert SRC SRC --overwrite` deleted the source model directory: now a one-line error, nothing touched."""
    from tests.test_loaders import random_params, write_hf_dir

    cfg = LlamaConfig(**{**CFG.__dict__, "max_position_embeddings": 128})
    src = write_hf_dir(tmp_path / "hf", random_params(cfg), cfg)
    (src / "notes.txt").write_text("precious")
    before = sorted(f.name for f in src.iterdir())
    assert cli.main(["convert", str(src), str(src), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "the source model" in err
    assert sorted(f.name for f in src.iterdir()) == before


@pytest.mark.slow
def test_smollm2_certified_generation_matches_dense():
    from certattn_jax.demo import haystack_prompt
    from models import load_pretrained

    pre = load_pretrained("smollm2", dtype=jnp.float32)
    tok = pre.tokenizer
    # long enough that most of each prompt sits in quantized blocks (block size 64)
    texts = [haystack_prompt(tok, n, seed)[0] for n, seed in ((150, 1), (260, 2), (380, 3))]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    assert min(len(p) for p in prompts) > 3 * 64
    policy = CertPolicy()
    kw = dict(eos_token_ids=tok.eos_token_ids, progress=False)
    dense = gen.generate(pre.params, pre.config, prompts, 24, **kw)
    cert = gen.generate(pre.params, pre.config, prompts, 24, record_steps=True,
                        cache_factory=tiered_cache_factory(pre.config, jnp.float32, policy, "certified"), **kw)
    # (the naive cache's agreement is the demo's to show, docs/demo.md: nothing here asserted it)
    assert cert.tokens == dense.tokens
    s = summarize(cert.step_records)
    print(f"\nSmolLM2: certified == dense for {len(texts)}/{len(texts)} prompts; certificates {s}")
    assert s["fraction_certified"] > 0.99
