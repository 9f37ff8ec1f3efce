"""Functional LLaMA models: configuration, forward pass, generation, and weight loading.

Heavy loaders (orbax, gguf) are imported lazily, so `import models.llama` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from models.config import LlamaConfig, RopeScaling

_LAZY = {
    "validate_params": "models.params",
    "cast_params": "models.params",
    "Tokenizer": "models.tokenizer",
    "Pretrained": "models.pretrained",
    "load_pretrained": "models.pretrained",
    "convert": "models.pretrained",
    "fetch_gguf": "models.pretrained",
    "cache_dir": "models.pretrained",
    "KNOWN_MODELS": "models.pretrained",
    "save_checkpoint": "models.checkpoint",
    "load_checkpoint": "models.checkpoint",
    "is_checkpoint_dir": "models.checkpoint",
    "load_hf_dir": "models.hf_loader",
    "load_gguf": "models.gguf_loader",
}

__all__ = ["LlamaConfig", "RopeScaling", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
