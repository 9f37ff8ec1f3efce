"""What the command line and the demo share: loading a model, the cache policy from arguments, prompts, and one
generation run. (Its own module so that `cli` and `demo` need not import each other.)"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from certattn_jax.model_cache import CACHE_MODES

__all__ = ["CACHE_MODES", "cache_factory", "enable_compilation_cache", "load_model", "policy_from_args",
           "prompt_ids", "run_generation", "stop_ids"]


def _dtype(name: str):
    import jax
    import jax.numpy as jnp

    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}[name]


def enable_compilation_cache() -> None:
    """Persist compiled programs under the cache dir, so a second run skips most compilation."""
    import jax

    from models.pretrained import cache_dir

    path = Path(os.environ.get("CERTATTN_JAX_CACHE", cache_dir() / "jax-compilation"))
    try:
        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    except Exception as e:  # pragma: no cover - an unwritable cache dir only costs speed
        print(f"[certattn] compilation cache disabled: {e}", file=sys.stderr)


def policy_from_args(args: argparse.Namespace):
    import dataclasses

    from certattn_jax.policy import CertPolicy

    overrides = {k: v for k, v in (("eps", args.eps), ("key_bits", args.key_bits),
                                   ("value_bits", args.value_bits)) if v is not None}
    return dataclasses.replace(CertPolicy(), **overrides)


def cache_factory(mode: str, pretrained, policy):
    """The model's cache in `mode` (a CacheSpec, which generate() prefills through a dense staging cache)."""
    from certattn_jax.model_cache import cache_spec

    return cache_spec(mode, pretrained.config, pretrained.params["embed"].dtype, policy)


def load_model(name: str, dtype_name: str):
    """load_pretrained with the q|k|v and gate|up projections fused (same math, faster decode)."""
    import dataclasses

    from models import load_pretrained
    from models.llama import fuse_projections

    pretrained = load_pretrained(name, dtype=_dtype(dtype_name))
    return dataclasses.replace(pretrained, params=fuse_projections(pretrained.params))


def prompt_ids(pretrained, text: str, raw: bool) -> list[int]:
    tok = pretrained.tokenizer
    if tok is None:
        raise ValueError("this model has no tokenizer; cannot encode a text prompt")
    if not raw and tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tok.encode(text)


def stop_ids(pretrained) -> tuple[int, ...]:
    ids = set(pretrained.config.eos_token_ids)
    if pretrained.tokenizer is not None:
        ids |= set(pretrained.tokenizer.eos_token_ids)
    return tuple(sorted(ids))


def run_generation(pretrained, ids: list[int], args: argparse.Namespace, mode: str, policy=None,
                   record: bool = False):
    from models.generate import generate

    return generate(pretrained.params, pretrained.config, [ids], args.max_new_tokens,
                    temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                    eos_token_ids=stop_ids(pretrained), prefill_chunk=args.prefill_chunk,
                    cache_factory=cache_factory(mode, pretrained, policy), record_steps=record)
