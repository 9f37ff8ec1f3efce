"""A params dict carrying a `layers_stacked` copy (`models.llama.with_stacked_layers` / `params_for_decoding`, the
derived weights a decode loop reads by index) whose per-layer weights were changed afterwards. `generate` keeps
the given copy (`with_stacked_layers` returns params unchanged when the key is there) and `check_params` drops it
before validating, so the prefill reads the new weights and the certified decode's first passes the stale ones.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_caches/probe_stale_stacked.py [schedule]
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from certattn_jax.model_cache import cache_spec  # noqa: E402
from models import llama  # noqa: E402
from models.params import STACKED_LAYERS  # noqa: E402

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    schedule = sys.argv[1] if len(sys.argv) > 1 else "straight-looped"
    cfg, policy = common.CFG, common.POLICY
    old = llama.with_stacked_layers(common.params_for(cfg, seed=0))  # e.g. built once for a user's own loop
    new_layers = common.params_for(cfg, seed=1)["layers"]  # weights replaced afterwards (a fine-tune, an edit)
    edited = {**old, "layers": new_layers}
    clean = {k: v for k, v in edited.items() if k != STACKED_LAYERS}
    kw = dict(eos_token_ids=(), progress=False, record_steps=True, prefill_chunk=32)

    def run(params, mode="certified"):
        factory = mode if mode == "dense" else cache_spec(mode, cfg, np.float32, policy, schedule=schedule)
        out = common.gen.generate(params, cfg, common.prompts(1), 12, cache_factory=factory, **kw)
        rungs = None if mode == "dense" else np.asarray(out.step_records.rung).max(axis=(1, 2, 3)).tolist()
        return out.tokens, rungs

    print(f"schedule {schedule}, jax backend {jax.default_backend()}")
    print("dense, new weights             ", run(clean, "dense")[0])
    print("certified, new weights (clean) ", run(clean))
    print("certified, new weights + stale layers_stacked", run(edited))
    print("dense, same stale params       ", run(edited, "dense")[0])
