"""A small, strict reader for `.safetensors` files, returning memory-mapped numpy arrays.

`safetensors`' own numpy backend cannot return bfloat16; this reader can (via `ml_dtypes`) and
validates the header so a truncated or corrupt file fails with a message naming the file and tensor.

Format: 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the data section; offsets are relative to its start.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
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
    """All tensors of a `.safetensors` file as read-only memory-mapped arrays, keyed by name."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file not found: {path}")
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"corrupt safetensors file {path}: shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > file_size - 8 or n > 100 * 2**20:
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
    mm = np.memmap(path, dtype=np.uint8, mode="r") if data_size > 0 else np.zeros(0, np.uint8)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            dtype_name, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"corrupt safetensors file {path}: bad header entry for {name!r}") from None
        if dtype_name not in _DTYPES:
            raise SafetensorsError(
                f"tensor {name!r} in {path} has unsupported dtype {dtype_name} "
                f"(supported: {', '.join(_DTYPES)})")
        dtype = _DTYPES[dtype_name]
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize or begin < 0:
            raise SafetensorsError(
                f"corrupt safetensors file {path}: tensor {name!r} has {end - begin} bytes for "
                f"shape {tuple(shape)} of {dtype_name}")
        if end > data_size:
            raise SafetensorsError(
                f"corrupt (truncated?) safetensors file {path}: tensor {name!r} needs bytes up to "
                f"{end} of the data section, the file has only {data_size}")
        buf = mm[data_start + begin: data_start + end]
        out[name] = buf.view(dtype).reshape(shape)
    return out
