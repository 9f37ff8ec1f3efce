"""Load a Hugging Face LLaMA checkpoint directory into our parameter layout (numpy, host memory).

A directory holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`. Hugging Face names map to ours as follows (HF Linear weights are
[out, in] and are transposed to our [in, out]):

    model.embed_tokens.weight                      [V, D]        -> embed        [V, D]
    model.layers.{i}.input_layernorm.weight        [D]           -> attn_norm    [D]
    model.layers.{i}.self_attn.q_proj.weight       [Hq*hd, D]    -> wq           [D, Hq*hd]
    model.layers.{i}.self_attn.k_proj.weight       [Hkv*hd, D]   -> wk           [D, Hkv*hd]
    model.layers.{i}.self_attn.v_proj.weight       [Hkv*hd, D]   -> wv           [D, Hkv*hd]
    model.layers.{i}.self_attn.o_proj.weight       [D, Hq*hd]    -> wo           [Hq*hd, D]
    model.layers.{i}.post_attention_layernorm.weight [D]         -> mlp_norm     [D]
    model.layers.{i}.mlp.gate_proj.weight          [F, D]        -> w_gate       [D, F]
    model.layers.{i}.mlp.up_proj.weight            [F, D]        -> w_up         [D, F]
    model.layers.{i}.mlp.down_proj.weight          [D, F]        -> w_down       [F, D]
    model.norm.weight                              [D]           -> final_norm   [D]
    lm_head.weight                                 [V, D]        -> lm_head      [D, V] (untied only)

With `tie_word_embeddings`, a stored `lm_head.weight` is ignored.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from certattn_jax.validate import is_finite_number
from models.config import LlamaConfig, read_json
from models.params import Params, validate_params

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)

# our per-layer name -> (HF suffix under model.layers.{i}., transpose?)
_LAYER_MAP: dict[str, tuple[str, bool]] = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
# tensors some checkpoints carry that carry no information for us
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---- safetensors ------------------------------------------------------------------------------
_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class SafetensorsError(ValueError):
    """A `.safetensors` file is corrupt, truncated or uses an unsupported dtype."""


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a `.safetensors` file as read-only memory-mapped numpy arrays, keyed by name.

    (`safetensors`' own numpy backend cannot return bfloat16; this reader can, via `ml_dtypes`.)
    Format: 8-byte little-endian header length N, N bytes of JSON
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then data.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file not found: {path}")
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"corrupt safetensors file {path}: shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > file_size - 8:
            raise SafetensorsError(f"corrupt safetensors file {path}: header length {n} exceeds the file size")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"corrupt safetensors file {path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"corrupt safetensors file {path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + n
    data_size = file_size - data_start
    mm = np.memmap(path, dtype=np.uint8, mode="r") if data_size > 0 else np.zeros(data_start, np.uint8)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            dtype_name, shape = info["dtype"], [int(s) for s in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"corrupt safetensors file {path}: bad header entry for {name!r}") from None
        if dtype_name not in _ST_DTYPES:
            raise SafetensorsError(
                f"tensor {name!r} in {path} has unsupported dtype {dtype_name} (supported: {', '.join(_ST_DTYPES)})")
        dtype = _ST_DTYPES[dtype_name]
        count = int(np.prod(shape, dtype=np.int64))
        if begin < 0 or end - begin != count * dtype.itemsize:
            raise SafetensorsError(
                f"corrupt safetensors file {path}: tensor {name!r} spans {end - begin} bytes, "
                f"but shape {tuple(shape)} of {dtype_name} needs {count * dtype.itemsize}")
        if end > data_size:
            raise SafetensorsError(
                f"corrupt (truncated?) safetensors file {path}: tensor {name!r} needs data bytes up to "
                f"{end}, the file holds only {data_size}")
        out[name] = mm[data_start + begin: data_start + end].view(dtype).reshape(shape)
    return out


# ---- directory --------------------------------------------------------------------------------
def read_hf_config(path: str | Path) -> tuple[LlamaConfig, dict[str, Any]]:
    """(`LlamaConfig`, raw dict) from `<path>/config.json`, rejecting non-LLaMA architectures."""
    path = Path(path)
    cfg_path = path / "config.json"
    raw = read_json(cfg_path, f"config.json not found in Hugging Face model directory {path}")
    archs = raw.get("architectures") or []
    if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"unsupported architecture {archs} in {cfg_path}: supported {list(SUPPORTED_ARCHITECTURES)}")
    check_rope_scaling(raw, cfg_path)  # (hidden_act and biases: `LlamaConfig.from_hf_dict`, every loader's)
    try:
        config = LlamaConfig.from_hf_dict(raw)
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    # generation_config.json may list more stop tokens (e.g. LLaMA 3 instruct: <|eot_id|>)
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        try:
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            gen_eos = None
        if gen_eos is not None:
            extra = gen_eos if isinstance(gen_eos, list) else [gen_eos]
            eos = tuple(dict.fromkeys([*config.eos_token_ids, *(int(e) for e in extra)]))
            config = dataclasses.replace(config, eos_token_ids=eos)
    return config, raw


_LLAMA3_FLOAT_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")


def check_rope_scaling(raw: dict[str, Any], cfg_path: Path) -> None:
    """Refuse a `rope_scaling` / `rope_parameters` entry of config.json that `LlamaConfig.from_hf_dict` cannot read,
    naming `cfg_path` and the field: not an object, or (rope_type llama3) a missing or non-numeric, non-finite or
    non-positive factor, or an original_max_position_embeddings that is no positive integer."""
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    rope = raw.get(key)
    if not rope:
        return
    if not isinstance(rope, dict):
        raise ValueError(f"{cfg_path}: field {key!r} must be a JSON object, got {rope!r}")
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return  # default, or a type from_hf_dict refuses by name
    for name in (*_LLAMA3_FLOAT_FIELDS, "original_max_position_embeddings"):
        if name not in rope:
            raise ValueError(f"{cfg_path}: {key} (rope_type 'llama3') is missing field {name!r}")
        value = rope[name]
        if name in _LLAMA3_FLOAT_FIELDS:
            ok = is_finite_number(value) and value > 0
            want = "a finite number > 0"
        else:  # an integral float (8192.0) reads as its int, as from_hf_dict's int() does
            ok = is_finite_number(value) and value > 0 and float(value).is_integer()
            want = "a positive integer"
        if not ok:
            raise ValueError(f"{cfg_path}: {key} field {name!r} must be {want}, got {value!r}")


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"corrupt safetensors index {index}: {e!r}") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f.name} listed in {index} not found")
        return files
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no weights in {path}: expected model.safetensors or model.safetensors.index.json")


def load_hf_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a HF directory's safetensors file(s), memory-mapped, keyed by HF name."""
    tensors: dict[str, np.ndarray] = {}
    for f in _safetensors_files(Path(path)):
        for name, arr in read_safetensors(f).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears in more than one shard (second: {f})")
            tensors[name] = arr
    return tensors


def hf_to_params(tensors: dict[str, np.ndarray], config: LlamaConfig, dtype: Any = None) -> Params:
    """Map HF-named tensors ([out, in] Linear weights) to our layout ([in, out]), as numpy arrays.

    Raises ValueError naming a missing tensor, a tensor whose shape disagrees with `config`, a
    non-floating tensor, or a tensor we do not know how to use.
    """
    used: set[str] = set()

    def take(name: str, want: tuple[int, ...], transpose: bool) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"missing tensor {name!r} in the checkpoint")
        arr = tensors[name]
        hf_want = want[::-1] if transpose else want
        if tuple(arr.shape) != tuple(hf_want):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(hf_want)} from config.json")
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype != ml_dtypes.bfloat16:
            raise ValueError(f"tensor {name!r} has non-floating dtype {arr.dtype}")
        used.add(name)
        out = arr.T if transpose else arr
        out = out.astype(dtype) if dtype is not None else out
        return np.ascontiguousarray(out)

    shapes = config.param_shapes()
    params: Params = {"embed": take("model.embed_tokens.weight", shapes["embed"], False), "layers": []}
    for i in range(config.num_layers):
        layer = {ours: take(f"model.layers.{i}.{hf}", shapes["layers"][i][ours], tr)
                 for ours, (hf, tr) in _LAYER_MAP.items()}
        params["layers"].append(layer)
    params["final_norm"] = take("model.norm.weight", shapes["final_norm"], False)
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # ignored when tied
    else:
        params["lm_head"] = take("lm_head.weight", shapes["lm_head"], True)
    unknown = sorted(n for n in set(tensors) - used if not n.endswith(_IGNORED_SUFFIXES))
    if unknown:
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise ValueError(f"unexpected tensor(s) in the checkpoint: {unknown[:5]}{more}")
    validate_params(params, config, finite=True)
    return params


def load_hf_dir(path: str | Path, dtype: Any = None) -> tuple[LlamaConfig, Params]:
    """(config, params) from a Hugging Face LLaMA directory; params are host numpy arrays.

    `dtype=None` keeps the stored dtype; otherwise every tensor is cast to it.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"Hugging Face model directory not found: {path}")
    config, _ = read_hf_config(path)
    tensors = load_hf_tensors(path)
    return config, hf_to_params(tensors, config, dtype)
