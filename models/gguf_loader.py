"""Load a LLaMA-architecture `.gguf` file (llama.cpp format) into our parameter layout.

Tensors are dequantized exactly with `gguf.quants.dequantize` to float32 (numpy, host memory).
GGUF names map to ours as follows; dequantized matrices come out [out, in] (numpy order, the
reverse of the shape gguf lists) and are transposed to our [in, out]:

    token_embd          [V, D]       -> embed          blk.N.attn_norm  [D]  -> attn_norm
    blk.N.attn_q        [Hq*hd, D]   -> wq  (RoPE row permutation undone, see `unpermute_rope_rows`)
    blk.N.attn_k        [Hkv*hd, D]  -> wk  (idem)     blk.N.attn_v     -> wv
    blk.N.attn_output   [D, Hq*hd]   -> wo             blk.N.ffn_norm   -> mlp_norm
    blk.N.ffn_gate / ffn_up [F, D]   -> w_gate / w_up  blk.N.ffn_down   [D, F] -> w_down
    output_norm         [D]          -> final_norm     output [V, D]    -> lm_head [D, V] (absent: tied)

llama3 RoPE scaling (LLaMA 3.1/3.2) is stored by llama.cpp as a `rope_freqs.weight` tensor of
per-frequency divisors; we recover `RopeScaling` from it and refuse files where that fails.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from models.config import LlamaConfig, RopeScaling
from models.params import Params, validate_params

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
})

_LAYER_MAP = {
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
    "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
}
_MISSING = object()


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """A `gguf.GGUFReader` for `path` (memory-mapped), with clear errors for missing/corrupt files."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct.error/IndexError on garbage
        raise ValueError(f"corrupt or unreadable GGUF file {path}: {type(e).__name__}: {e}") from None


def gguf_meta(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """Metadata value `key` (scalars as Python values, arrays as lists); KeyError-like ValueError if absent."""
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _f32(x: float) -> float:
    """A float32 metadata value at its shortest decimal spelling (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def check_architecture(reader: gguf.GGUFReader) -> None:
    arch = gguf_meta(reader, "general.architecture", None)
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}: only 'llama' is supported")


def llama3_rope_factors(scaling: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` divisors [head_dim/2] for llama3 scaling (as its HF->GGUF converter)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wl = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wl = scaling.original_max_position_embeddings / scaling.high_freq_factor
    out = []
    for f in freqs.astype(np.float64):
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(scaling.factor)
        else:
            smooth = ((scaling.original_max_position_embeddings / wl - scaling.low_freq_factor)
                      / (scaling.high_freq_factor - scaling.low_freq_factor))
            out.append(1.0 / ((1 - smooth) / scaling.factor + smooth))
    return np.asarray(out, np.float32)


def _fit_llama3_scaling(rope_freqs: np.ndarray, theta: float, head_dim: int,
                        orig_ctx: int | None) -> RopeScaling | None:
    """A `RopeScaling` whose divisors reproduce `rope_freqs` (rtol 1e-5), or None if none does."""
    factor = float(np.max(rope_freqs))
    if factor <= 0:
        return None
    candidates: list[tuple[float, float, int]] = []
    origs = [orig_ctx] if orig_ctx else [8192, 4096, 2048, 16384, 32768, 131072]
    # fit low/high from the smooth region: 1/r = (1-s)/factor + s, s = (orig/wl - low)/(high - low)
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)).astype(np.float64)
    r = rope_freqs.astype(np.float64)
    mid = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    for orig in origs:
        candidates.append((1.0, 4.0, orig))
        if factor > 1 and mid.sum() >= 2:
            s = (1 / r[mid] - 1 / factor) / (1 - 1 / factor)
            x = orig * freqs[mid] / (2 * math.pi)  # orig / wavelength
            slope, icpt = np.polyfit(x, s, 1)  # s = x/(high-low) - low/(high-low)
            if slope > 0:
                width = 1 / slope
                low = -icpt * width
                candidates.append((round(low, 4), round(low + width, 4), orig))
    for low, high, orig in candidates:
        if not (0 < low < high):
            continue
        sc = RopeScaling(factor=factor, low_freq_factor=low, high_freq_factor=high,
                         original_max_position_embeddings=int(orig))
        if np.allclose(llama3_rope_factors(sc, theta, head_dim), rope_freqs, rtol=1e-5, atol=0):
            return sc
    return None


def gguf_config(reader: gguf.GGUFReader) -> LlamaConfig:
    """`LlamaConfig` from a llama GGUF's metadata (and the presence of `output.weight` / `rope_freqs`)."""
    check_architecture(reader)
    names = {t.name: t for t in reader.tensors}
    hidden = int(gguf_meta(reader, "llama.embedding_length"))
    heads = int(gguf_meta(reader, "llama.attention.head_count"))
    kv_heads = int(gguf_meta(reader, "llama.attention.head_count_kv", heads))
    rope_dim = gguf_meta(reader, "llama.rope.dimension_count", None)
    head_dim = int(gguf_meta(reader, "llama.attention.key_length", rope_dim or hidden // heads))
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"unsupported partial RoPE: llama.rope.dimension_count={rope_dim} != head_dim {head_dim}")
    value_len = gguf_meta(reader, "llama.attention.value_length", head_dim)
    if int(value_len) != head_dim:
        raise ValueError(f"unsupported GGUF: value_length {value_len} != key_length {head_dim}")
    tokens = gguf_meta(reader, "tokenizer.ggml.tokens", None)
    if tokens is not None:
        vocab = len(tokens)
    elif "token_embd.weight" in names:
        vocab = int(names["token_embd.weight"].shape[-1])
    else:
        vocab = int(gguf_meta(reader, "llama.vocab_size"))
    theta = _f32(gguf_meta(reader, "llama.rope.freq_base", 10000.0))

    scaling_type = gguf_meta(reader, "llama.rope.scaling.type", "none")
    scaling_factor = float(gguf_meta(reader, "llama.rope.scaling.factor", 1.0))
    if scaling_type not in ("none", "llama3") and scaling_factor != 1.0:
        raise ValueError(f"unsupported RoPE scaling type {scaling_type!r} (factor {scaling_factor}) in GGUF")
    rope_scaling = None
    if "rope_freqs.weight" in names:
        rf = gguf.quants.dequantize(names["rope_freqs.weight"].data, names["rope_freqs.weight"].tensor_type)
        rf = np.asarray(rf, np.float32).reshape(-1)
        if rf.shape != (head_dim // 2,):
            raise ValueError(f"GGUF rope_freqs.weight has shape {rf.shape}, expected ({head_dim // 2},)")
        if not np.allclose(rf, 1.0):
            orig = gguf_meta(reader, "llama.rope.scaling.original_context_length", None)
            rope_scaling = _fit_llama3_scaling(rf, theta, head_dim, int(orig) if orig else None)
            if rope_scaling is None:
                raise ValueError(
                    "GGUF rope_freqs.weight does not match any llama3 RoPE scaling we can reproduce; "
                    f"refusing to ignore it (divisors range {rf.min():.4g}..{rf.max():.4g})")
    elif scaling_type == "llama3":
        raise ValueError("GGUF says llama3 RoPE scaling but has no rope_freqs.weight tensor")

    bos = gguf_meta(reader, "tokenizer.ggml.bos_token_id", None)
    eos_ids = [gguf_meta(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(gguf_meta(reader, "llama.feed_forward_length")),
        num_layers=int(gguf_meta(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=_f32(gguf_meta(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(gguf_meta(reader, "llama.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        rope_scaling=rope_scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos_ids if e is not None)),
    )


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A GGUF `ReaderTensor` as float32 numpy, numpy-ordered (the reverse of gguf's listed shape)."""
    ttype = Q(tensor.tensor_type)
    if ttype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(f"GGUF tensor {tensor.name!r} has unsupported type {ttype.name} (supported: {supported})")
    arr = np.asarray(gguf.quants.dequantize(tensor.data, ttype), dtype=np.float32)
    want = tuple(int(s) for s in reversed(tensor.shape.tolist()))
    if arr.size != math.prod(want):
        raise ValueError(f"GGUF tensor {tensor.name!r} ({ttype.name}) has {arr.size} values, expected {want}")
    return arr.reshape(want)


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. `w`: [n_head*hd, in] ([out, in]) -> same shape.

    llama.cpp's converter interleaves each head's rows (pairs (j, j + hd/2) become adjacent) for its
    RoPE; Hugging Face / our RoPE rotates the two halves of a head.
    """
    out_dim, in_dim = w.shape
    hd = out_dim // n_head
    return w.reshape(n_head, hd // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def gguf_to_params(reader: gguf.GGUFReader, config: LlamaConfig, dtype: Any = None) -> Params:
    """Our parameter tree (numpy; float32 unless `dtype`) from the reader's tensors."""
    tensors = {t.name: t for t in reader.tensors}
    shapes = config.param_shapes()
    for t in reader.tensors:
        if Q(t.tensor_type) not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
            raise ValueError(f"GGUF tensor {t.name!r} has unsupported type {Q(t.tensor_type).name} "
                             f"(supported: {supported})")
    known = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
    known |= {f"blk.{i}.{g}.weight" for i in range(config.num_layers) for g in _LAYER_MAP.values()}
    unknown = sorted(set(tensors) - known)
    if unknown:
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise ValueError(f"unexpected tensor(s) in the GGUF file: {unknown[:5]}{more}")

    def take(name: str, want: tuple[int, ...], transpose: bool, n_head: int | None = None) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"missing tensor {name!r} in the GGUF file")
        arr = dequantize_tensor(tensors[name])
        stored = tuple(want[::-1]) if transpose else tuple(want)
        if arr.shape != stored:
            raise ValueError(f"GGUF tensor {name!r} has shape {arr.shape} ([out, in]), expected {stored} "
                             "from the metadata")
        if n_head is not None:
            arr = unpermute_rope_rows(arr, n_head)
        if transpose:
            arr = arr.T
        return np.ascontiguousarray(arr if dtype is None else arr.astype(dtype))

    params: Params = {"embed": take("token_embd.weight", shapes["embed"], False), "layers": []}
    for i in range(config.num_layers):
        want = shapes["layers"][i]
        layer = {}
        for ours, g in _LAYER_MAP.items():
            n_head = {"wq": config.num_heads, "wk": config.num_kv_heads}.get(ours)
            layer[ours] = take(f"blk.{i}.{g}.weight", want[ours], len(want[ours]) == 2, n_head)
        params["layers"].append(layer)
    params["final_norm"] = take("output_norm.weight", shapes["final_norm"], False)
    if not config.tie_word_embeddings:
        params["lm_head"] = take("output.weight", shapes["lm_head"], True)
    validate_params(params, config, finite=True)
    return params


def load_gguf(path: str | Path, dtype: Any = None) -> tuple[LlamaConfig, Params, gguf.GGUFReader]:
    """(config, params, reader) from a llama `.gguf` file; params are host numpy arrays (float32 default).

    The reader is returned so the caller can build the tokenizer from the same file.
    """
    reader = open_gguf(path)
    config = gguf_config(reader)
    params = gguf_to_params(reader, config, dtype)
    return config, params, reader
