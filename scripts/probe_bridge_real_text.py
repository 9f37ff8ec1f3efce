"""The decode bridge on real text: how many decode steps its rung-0 first passes answer.

    python scripts/probe_bridge_real_text.py --out results/bridge_real_text_cpu.json

SmolLM2-135M-Instruct's own weights (the bundled GGUF), a chat prompt of about 1.8K tokens (the start of
docs/architecture.md to summarise), greedy, the default policy, `CERTATTN_DECODE_BRIDGE=1` (on a CPU the bridge is
off by default). Per schedule: the steps the first passes answered (`BridgedDecode.first_pass_steps`), the first
passes' compile and the wait for the whole program, and each step's highest rung (the certificates). Where the
first step already needs rung 1 (the hot set is empty after the prefill), the first passes answer nothing and
the bridge only overlaps the two compiles (docs/architecture.md "The decode bridge").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("CERTATTN_DECODE_BRIDGE", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="+", default=["adaptive", "looped"])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from certattn_jax.model_cache import cache_spec
    from certattn_jax.policy import CertPolicy
    from models import generate as gen
    from models.pretrained import load_pretrained

    pre = load_pretrained("smollm2-135m-instruct", dtype=jnp.float32)
    text = (ROOT / "docs" / "architecture.md").read_text()[:6000]
    chat = pre.tokenizer.apply_chat_template([{"role": "user", "content": "Summarise this design note:\n" + text}])
    ids = pre.tokenizer.encode(chat, add_bos=False)
    bridges = []
    real_call = gen.BridgedDecode.__call__

    def recording_call(self, *a):
        bridges.append(self)
        return real_call(self, *a)

    gen.BridgedDecode.__call__ = recording_call
    rows = []
    for schedule in args.schedules:
        spec = cache_spec("certified", pre.config, jnp.float32, CertPolicy(), schedule=schedule)
        out = gen.generate(pre.params, pre.config, [ids], args.new_tokens, cache_factory=spec, progress=False,
                           record_steps=True)
        top = np.asarray(out.step_records.rung).reshape(out.num_steps - 1, -1).max(axis=1)
        rows.append({"schedule": schedule, "prompt_tokens": len(ids), "steps": out.num_steps,
                     "first_pass_steps": bridges[-1].first_pass_steps if bridges else None,
                     "compile_s": round(out.compile_seconds, 2), "compile_wait_s": round(out.compile_wait_seconds, 2),
                     "steps_above_rung0": int(np.sum(top >= 1)), "top_rung_per_step": top.tolist()})
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
