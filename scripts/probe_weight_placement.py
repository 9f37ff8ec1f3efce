"""Decode speed of the looped certified schedule with each weight placement (docs/performance.md, "Decision").

    PYTHONPATH=. python scripts/probe_weight_placement.py copy      # one lax.switch returns the layer's weights
    PYTHONPATH=. python scripts/probe_weight_placement.py inplace   # per-layer switch branches, weights in place

SmolLM2 shapes (random float32 weights), a 256-token prompt, 16 new tokens, default CertPolicy; prints compile
seconds (first call) and decode tokens/s (second call) as one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_generate import _model_config  # noqa: E402

from certattn_jax.model_cache import cache_spec  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402
from models import generate as gen  # noqa: E402
from models import llama  # noqa: E402


def main(mode: str) -> None:
    if mode not in ("copy", "inplace"):
        raise SystemExit("usage: probe_weight_placement.py copy|inplace")
    llama.COPY_WEIGHTS_BELOW_BYTES[jax.default_backend()] = 1 << 40 if mode == "copy" else 0
    cfg = _model_config("smollm2")
    params = llama.fuse_projections(llama.init_params(cfg, jax.random.key(0), jnp.float32))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 256).tolist()
    pol = CertPolicy()
    kw = dict(eos_token_ids=(), progress=False, prefill_chunk=256, policy=pol,
              cache_factory=cache_spec("certified", cfg, jnp.float32, pol))
    first = gen.generate(params, cfg, [ids], 16, **kw)
    second = gen.generate(params, cfg, [ids], 16, **kw)
    print(json.dumps({"mode": mode, "backend": jax.default_backend(), "compile_s": round(first.compile_seconds, 2),
                      "decode_tokens_per_s": round(second.tokens_per_s, 2)}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
