"""GGUF loader on the same config variety: write a tiny LLaMA as llama.cpp's convert_hf_to_gguf.py would (its
`LlamaModel.permute` of q/k rows, `rope_freqs` for llama3, key_length for an explicit head_dim; every tensor F32)
and check that `models.gguf_loader.load_gguf` gives exactly the config and params `models.hf_loader.load_hf_dir`
gives for the HF directory.

Usage: .venv/bin/python scripts/soundness_probe/audit_2026_12_07_configs/probe_gguf.py
Writes probe_gguf.out beside this file (also printed).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import gguf  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_configs import CASES, hf_model  # noqa: E402

from models.gguf_loader import load_gguf  # noqa: E402
from models.hf_loader import load_hf_dir  # noqa: E402

GGUF_CASES = ["baseline_gqa2", "mha", "gqa4", "mqa_8q_1kv", "head_dim32_explicit", "head_dim80_explicit",
              "head_dim96_explicit", "head_dim96_implicit", "rope_llama3_theta5e5", "rope_llama3_theta1e4",
              "rope_theta5e5", "tied", "eps1e-6", "vocab1003_ffn200"]


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_factors(hp: dict, rope: dict) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (rope_freqs for rope_type llama3)."""
    base = rope.get("rope_theta", hp.get("rope_theta", 10000.0))
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    lw, hw = old / low, old / high
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < hw:
            out.append(1)
        elif wl > lw:
            out.append(factor)
        else:
            s = (old / wl - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.asarray(out, np.float32)


def write_gguf(model, path: Path, orig_ctx_meta: bool) -> None:
    hp = model.config.to_dict()
    rope = hp.get("rope_parameters") or {}
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    nh, nkv = hp["num_attention_heads"], hp["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    head_dim = hp.get("head_dim") or hp["hidden_size"] // nh
    w.add_rope_dimension_count(head_dim)
    if hp.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(hp["vocab_size"])
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(hp, rope))
        if orig_ctx_meta:
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(hp["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], nh, nh))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], nh, nkv))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not hp.get("tie_word_embeddings"):
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def compare(a, b, path="") -> list[str]:
    if isinstance(a, dict):
        keys = set(a) | set(b)
        return [m for k in sorted(keys) for m in (compare(a.get(k), b.get(k), f"{path}.{k}") if k in a and k in b
                                                  else [f"{path}.{k}: only in {'gguf' if k in a else 'hf'}"])]
    if isinstance(a, list):
        return [m for i, (x, y) in enumerate(zip(a, b, strict=True)) for m in compare(x, y, f"{path}.{i}")]
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.shape != b.shape:
        return [f"{path}: shape {a.shape} vs {b.shape}"]
    if not np.array_equal(a, b):
        return [f"{path}: max |diff| {np.abs(a - b).max():.3g}"]
    return []


def main() -> None:
    lines = []
    for name in GGUF_CASES:
        model = hf_model(CASES[name][0])
        for orig_meta in ((False, True) if "llama3" in name else (False,)):
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp)
                hf_cfg, hf_params = load_hf_dir(tmp)
                g = Path(tmp) / "m.gguf"
                write_gguf(model, g, orig_meta)
                tag = f"{name}{' (orig ctx in metadata)' if orig_meta else ''}"
                try:
                    g_cfg, g_params, _ = load_gguf(g)
                except Exception as e:  # noqa: BLE001
                    lines.append(f"{tag}: REFUSED {type(e).__name__}: {e}")
                    continue
            cfg_diff = {f.name: (getattr(g_cfg, f.name), getattr(hf_cfg, f.name))
                        for f in dataclasses.fields(g_cfg)
                        if getattr(g_cfg, f.name) != getattr(hf_cfg, f.name) and f.name not in ("bos_token_id",
                                                                                                 "eos_token_ids")}
            inv = ""
            if g_cfg.rope_scaling is not None or hf_cfg.rope_scaling is not None:
                from models.rope import rope_inv_freq
                inv = f" inv_freq max rel diff {np.max(np.abs(rope_inv_freq(g_cfg) / rope_inv_freq(hf_cfg) - 1)):.2e}"
            diffs = compare(g_params, hf_params)
            lines.append(f"{tag}: config diffs {cfg_diff or 'none'}; param diffs {diffs[:4] or 'none'}{inv}")
        print(lines[-1], flush=True)
    (Path(__file__).resolve().parent / "probe_gguf.out").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
