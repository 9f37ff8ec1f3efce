"""LLaMA-family model configuration.

`LlamaConfig` is a frozen (hashable) dataclass so it can be a static argument of `jax.jit`.
It reads the Hugging Face `config.json` fields of LLaMA 2 / 3 / 3.1 (and SmolLM2, which is LLaMA),
including `rope_scaling` or `rope_parameters` (transformers writes either) with `rope_type: llama3`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from certattn_jax.validate import is_finite_number


def read_json(path: Path, missing: str) -> Any:
    """Parse a JSON file; FileNotFoundError(missing) if absent, ValueError naming the file if corrupt."""
    if not path.is_file():
        raise FileNotFoundError(missing)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt {path.name} at {path}: {e}") from None


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """llama3-style RoPE frequency scaling (LLaMA 3.1): see `models.rope.rope_inv_freq`."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def _json_bool(value: Any, name: str) -> bool:
    """A config.json boolean (true / false; 0 / 1 as some exporters write it), never a truthy string."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"config.json field {name!r} must be true or false, got {value!r}")


# what transformers' LlamaConfig assumes for a config.json key left out (`LlamaConfig.from_hf_dict` follows it)
HF_DEFAULT_RMS_NORM_EPS = 1e-6
HF_DEFAULT_MAX_POSITIONS = 2048


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        # NaN fails every comparison: `not x > 0` catches it (a NaN or non-positive theta makes every logit NaN)
        if not (is_finite_number(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"LlamaConfig.rope_theta must be a finite number > 0, got {self.rope_theta!r}")
        if not (is_finite_number(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise ValueError(f"LlamaConfig.rms_norm_eps must be a finite number >= 0, got {self.rms_norm_eps!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"LlamaConfig.tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ---- Hugging Face config.json -------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Build from a transformers `LlamaConfig.to_dict()` / `config.json` dictionary."""
        if not isinstance(d, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "smollm", "smollm2"):
            raise ValueError(f"unsupported model_type {model_type!r}: only LLaMA-family models are supported")
        try:
            hidden = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            cfg = dict(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(d.get("head_dim") or hidden // num_heads),
                # a key left out means transformers' LlamaConfig default (an audit: a config.json without
                # rms_norm_eps loaded with 1e-5, transformers' 1e-6, logits 1e-3 relative off)
                max_position_embeddings=int(d.get("max_position_embeddings", HF_DEFAULT_MAX_POSITIONS)),
                rms_norm_eps=float(d.get("rms_norm_eps", HF_DEFAULT_RMS_NORM_EPS)),
                tie_word_embeddings=_json_bool(d.get("tie_word_embeddings", False), "tie_word_embeddings"),
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only 'silu')")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ValueError(f"unsupported {flag}=True: biases are not implemented")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        cfg["rope_theta"] = float(theta)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            cfg["rope_scaling"] = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in (None, "default"):
            raise ValueError(f"unsupported RoPE type {rope_type!r} (supported: default, llama3)")
        bos = d.get("bos_token_id")
        eos = d.get("eos_token_id")
        cfg["bos_token_id"] = None if bos is None else int(bos)
        if eos is None:
            cfg["eos_token_ids"] = ()
        elif isinstance(eos, (list, tuple)):
            cfg["eos_token_ids"] = tuple(int(e) for e in eos)
        else:
            cfg["eos_token_ids"] = (int(eos),)
        return cls(**cfg)

    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                                 else list(self.eos_token_ids))
        return d

    @classmethod
    def from_json_file(cls, path: str | Path) -> LlamaConfig:
        path = Path(path)
        return cls.from_hf_dict(read_json(path, f"config file not found: {path}"))

    def param_shapes(self) -> dict[str, Any]:
        """Expected shapes of the parameter pytree (see `models.llama` for the layout)."""
        D, F, V = self.hidden_size, self.intermediate_size, self.vocab_size
        layer = {
            "attn_norm": (D,),
            "wq": (D, self.num_heads * self.head_dim),
            "wk": (D, self.num_kv_heads * self.head_dim),
            "wv": (D, self.num_kv_heads * self.head_dim),
            "wo": (self.num_heads * self.head_dim, D),
            "mlp_norm": (D,),
            "w_gate": (D, F),
            "w_up": (D, F),
            "w_down": (F, D),
        }
        shapes: dict[str, Any] = {
            "embed": (V, D),
            "layers": [dict(layer) for _ in range(self.num_layers)],
            "final_norm": (D,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (D, V)
        return shapes
