"""Repro: a config.json that omits a field gets a different default in certattn-jax than in transformers.

`models.config.LlamaConfig.from_hf_dict` defaults rms_norm_eps to 1e-5 and max_position_embeddings to 4096 and reads
no bos / eos default; transformers' LlamaConfig (which is what reads the same directory in HF) defaults them to
1e-6, 2048, bos 1 / eos 2. For rms_norm_eps the logits then differ silently (here ~1e-3 relative in float32).

Usage: .venv/bin/python scripts/soundness_probe/audit_2026_12_07_configs/repro_config_defaults.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from models import llama  # noqa: E402
from models import pretrained as pre  # noqa: E402

torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
model = transformers.LlamaForCausalLM(cfg).float().eval()
with torch.no_grad():
    for n, p in model.named_parameters():
        if "norm" in n:
            p.copy_(1 + 0.2 * torch.randn_like(p))
tokens = np.random.default_rng(1).integers(0, 256, size=(1, 20))
with tempfile.TemporaryDirectory() as tmp:
    model.save_pretrained(tmp)
    path = Path(tmp) / "config.json"
    raw = json.loads(path.read_text())
    for key in ("rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        raw.pop(key, None)
    path.write_text(json.dumps(raw))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    ours = pre.load_pretrained(tmp, dtype=jnp.float32)
print("field                    transformers     certattn-jax")
print(f"rms_norm_eps             {hf.config.rms_norm_eps!r:<16} {ours.config.rms_norm_eps!r}")
print(f"max_position_embeddings  {hf.config.max_position_embeddings!r:<16} {ours.config.max_position_embeddings!r}")
print(f"bos_token_id             {hf.config.bos_token_id!r:<16} {ours.config.bos_token_id!r}")
print(f"eos_token_id             {hf.config.eos_token_id!r:<16} {ours.config.eos_token_ids!r}")
with torch.no_grad():
    ref = hf(torch.from_numpy(tokens)).logits.numpy()
logits, _ = llama.forward(ours.params, ours.config, jnp.asarray(tokens, jnp.int32))
rel = np.abs(np.asarray(logits, np.float64) - ref).max() / np.abs(ref).max()
print(f"max |logit diff| / max |logit| = {rel:.3e}  (float32 noise ~1e-6; finding if > 1e-3)")
