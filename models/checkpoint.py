"""Converted checkpoints: (params, config, tokenizer) in one directory, params stored with orbax.

Layout of a checkpoint directory:

    certattn_checkpoint.json   marker: {"format": "certattn-checkpoint", "version": 1, "dtype": ..., "source": ...}
    config.json                Hugging Face LLaMA config (`LlamaConfig.to_hf_dict`)
    params/                    orbax PyTree checkpoint of the parameter tree (see `models.params`)
    tokenizer.json, tokenizer_config.json   (when the model has a tokenizer)

Params are restored as host numpy arrays (`restore_type=np.ndarray`), so a checkpoint written on a
GPU machine restores on CPU and vice versa without sharding metadata getting in the way; the caller
then places them on the default device (`cast_params`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from models.config import LlamaConfig, read_json
from models.params import Params, dotted_name, params_to_numpy, validate_params
from models.tokenizer import TOKENIZER_FILE, Tokenizer

MARKER_FILE = "certattn_checkpoint.json"
FORMAT_NAME = "certattn-checkpoint"
FORMAT_VERSION = 1
PARAMS_DIR = "params"


def is_checkpoint_dir(path: str | Path) -> bool:
    """Whether `path` is a directory holding our marker file."""
    return (Path(path) / MARKER_FILE).is_file()


def save_checkpoint(path: str | Path, params: Params, config: LlamaConfig, tokenizer: Tokenizer | None = None,
                    *, source: str | None = None, overwrite: bool = False) -> Path:
    """Write a checkpoint directory at `path` (atomically: built beside it, then renamed).

    Params are stored in their own dtype (numpy/jax arrays, any floating dtype).
    Raises FileExistsError if `path` exists and not `overwrite`, or exists and is not a checkpoint directory
    (`overwrite` replaces only a checkpoint: never a model directory or a user's files).
    """
    path = Path(path).expanduser().resolve()
    validate_params(params, config)
    if path.exists() and not overwrite:
        raise FileExistsError(f"checkpoint directory already exists: {path} (pass overwrite=True to replace it)")
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    host = params_to_numpy(params)
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(host)})
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        ocp.PyTreeCheckpointer().save(tmp / PARAMS_DIR, host)
        (tmp / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
        if tokenizer is not None:
            tokenizer.save(tmp)
        marker = {"format": FORMAT_NAME, "version": FORMAT_VERSION,
                  "dtype": dtypes[0] if len(dtypes) == 1 else dtypes, "source": source,
                  "checksums": _checksums(host)}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def check_replaceable(path: Path) -> None:
    """FileExistsError unless `path` is absent, an empty directory or a checkpoint directory (which `overwrite`
    may replace)."""
    empty_dir = path.is_dir() and not any(path.iterdir())
    if path.exists() and not empty_dir and not is_checkpoint_dir(path):
        kind = "directory" if path.is_dir() else "file"
        raise FileExistsError(f"refusing to replace {path}: it is a {kind} but not a certattn checkpoint (no "
                              f"{MARKER_FILE}); remove it yourself or choose another output directory")


def cast_array(x: Any, dtype: np.dtype, name: str) -> np.ndarray:
    """Host array `x` cast to `dtype`; ValueError naming parameter `name` where a value is beyond the dtype's range.

    A float32 weight above 65504 passes the loaders' finiteness check but becomes Inf in float16. NumPy's own
    float casts raise on that overflow under `np.errstate(over="raise")` (no second pass over the data); for the
    ml_dtypes ones (bfloat16, which ignore errstate) the result is checked only where `dtype` is narrower in range
    than `x`'s dtype.
    """
    x = np.asarray(x)
    if x.dtype == dtype:
        return x
    try:
        with np.errstate(over="raise"):
            out = x.astype(dtype)
    except FloatingPointError:
        out = None
    narrower = (jnp.issubdtype(x.dtype, jnp.floating)
                and float(jnp.finfo(dtype).max) < float(jnp.finfo(x.dtype).max))
    if out is None or (narrower and not np.isfinite(out).all() and np.isfinite(x).all()):
        biggest = float(np.max(np.abs(x.astype(np.float32))))
        wider = [n for n in ("bfloat16", "float32") if float(jnp.finfo(n).max) > biggest and n != dtype.name]
        raise ValueError(f"parameter {name!r} overflows {dtype.name} (max |value| {biggest:.1e} > "
                         f"{float(jnp.finfo(dtype).max):.6g}): load in {' or '.join(wider) or 'float32'}")
    return out


def cast_host_params(params: Params, dtype: Any) -> Params:
    """Every leaf as a host numpy array of `dtype` (None: unchanged), refusing values the dtype cannot hold
    (`cast_array`): never an Inf made by the cast after the finiteness check passed."""
    if dtype is None:
        return params
    dt = np.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"params dtype must be floating, got {dt}")
    return jax.tree_util.tree_map_with_path(lambda path, x: cast_array(x, dt, dotted_name(path)), params)


def _checksums(params: Params) -> dict[str, int]:
    """CRC-32 of every parameter's bytes, by tree path (a corrupt byte in the stored params shows at load)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return {jax.tree_util.keystr(k): zlib.crc32(np.ascontiguousarray(x).view(np.uint8).reshape(-1))
            for k, x in flat}


def _verify_checksums(params: Params, want: dict[str, int] | None, path: Path) -> None:
    """Compare the restored params with the marker's checksums (checkpoints written before they existed have
    none: nothing to compare)."""
    if want is None:
        return
    got = _checksums(params)
    bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    if bad:
        raise ValueError(f"checkpoint {path} is corrupt: the stored bytes of {bad[:3]}"
                         f"{f' (and {len(bad) - 3} more)' if len(bad) > 3 else ''} differ from what was written")


def read_marker(path: str | Path) -> dict[str, Any]:
    """The marker of checkpoint dir `path`, checking format name and version."""
    path = Path(path)
    marker_path = path / MARKER_FILE
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    if not marker_path.is_file():
        raise ValueError(f"{path} is not a certattn checkpoint: {MARKER_FILE} is missing")
    marker = read_json(marker_path, f"{MARKER_FILE} is missing in {path}")
    if not isinstance(marker, dict) or marker.get("format") != FORMAT_NAME:
        raise ValueError(f"{marker_path} is not a {FORMAT_NAME} marker")
    if marker.get("version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format version {marker.get('version')!r}; "
                         f"this code reads version {FORMAT_VERSION}")
    return marker


def _restore_params(params_dir: Path, config: LlamaConfig) -> Params:
    shapes = config.param_shapes()
    item = jax.tree.map(lambda s: jax.ShapeDtypeStruct(tuple(s), np.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    if not params_dir.is_dir():
        raise FileNotFoundError(f"checkpoint params not found: {params_dir}")
    try:
        return ocp.PyTreeCheckpointer().restore(params_dir, item=item, restore_args=restore_args)
    except FileNotFoundError:
        raise
    except Exception as e:  # orbax/tensorstore raise ValueError, KeyError, RuntimeError, ...
        raise ValueError(f"cannot restore params from {params_dir} (corrupt, or does not match config.json): "
                         f"{type(e).__name__}: {e}") from None


def load_checkpoint(path: str | Path, dtype: Any = None) -> tuple[LlamaConfig, Params, Tokenizer | None]:
    """(config, params, tokenizer) from a checkpoint dir; params as numpy, cast to `dtype` if given.

    Checks the marker, `config.json` and every parameter shape (`validate_params`).
    """
    path = Path(path).expanduser().resolve()
    marker = read_marker(path)
    config = LlamaConfig.from_json_file(path / "config.json")
    params = _restore_params(path / PARAMS_DIR, config)
    _verify_checksums(params, marker.get("checksums"), path)  # before the values are read as numbers
    validate_params(params, config, finite=True)
    params = cast_host_params(params, dtype)  # refuses a value `dtype` cannot hold (it would become Inf)
    tokenizer = Tokenizer.load(path) if (path / TOKENIZER_FILE).is_file() else None
    return config, params, tokenizer
