"""Where a certified layer-step's launches come from: the rung-0 looped body of `TieredModelCache.attend`, compiled,
each launch (fusion or kernel) with the functions its instructions came from.

The step functions (`step.query_terms`, `bounds.cast_error`, `TieredKVCache.write_token`, ...) are wrapped in
`jax.named_scope("G_<name>")` for the trace, so the compiled HLO's op_names say which function made each fusion.
The program is a `fori_loop` over `--layers` layers of `attend` at rung 0 only (the "adaptive" schedule's rung-0
pass) on random bf16 K/V, SmolLM2's attention shape by default; the model's dense code (projections, MLP) is left
out. Prints the loop body's launches and writes the HLO and the listing to --out.

    python scripts/probe_glue_launches.py --out /tmp/glue     # on a GPU: the launches that run per layer-step
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from hlo_walk import computations, launching_instructions  # noqa: E402

from certattn_jax import bounds, ladder, model_cache, step  # noqa: E402
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.model_cache import TieredModelCache  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402
from pallas_kernels import certify_rung0, tier1_pass  # noqa: E402

TAGGED = ((step, "query_terms fused_items residual_tokens value_terms block_validity int_value_term "
                 "kernel_division_term total_bound numeric_term slot_inputs"),
          (bounds, "block_value_errors cast_error finite_or_inf"),
          (ladder, "mark_used run_fast"),
          (certify_rung0, "certify_rung0"), (tier1_pass, "tier1_pass"), (model_cache, "pack"))
TAGGED_METHODS = ((TieredKVCache, "write_token"), (TieredKVCache, "write_layer_token"),
                  (TieredModelCache, "layer_view"), (TieredModelCache, "with_layer"))


def _scoped(name: str, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.named_scope(name):
            return fn(*args, **kwargs)
    return wrapped


def tag_functions() -> None:
    for module, names in TAGGED:
        for name in names.split():
            setattr(module, name, _scoped("G_" + name, getattr(module, name)))
    for cls, name in TAGGED_METHODS:
        setattr(cls, name, _scoped("G_" + name, getattr(cls, name)))


def _op_names(comps: dict, instr: str, depth: int = 0) -> list[str]:
    names = re.findall(r'op_name="([^"]*)"', instr)
    for m in re.finditer(r"(?:calls|to_apply)=%?([\w.\-]+)", instr):
        if m.group(1) in comps and depth < 4:
            for sub in comps[m.group(1)]:
                names += _op_names(comps, sub, depth + 1)
    return names


def listing(hlo: str) -> list[dict]:
    """The launches of the layer loop's body (the entry computation's first while loop; a nested loop, e.g. an
    interpret-mode kernel on the CPU, counts as one launch), each with the tagged functions its instructions came
    from and its reductions."""
    comps, _ = computations(hlo)
    rows = []
    for instr, op, _, where in launching_instructions(hlo, descend_loops=False):
        names = _op_names(comps, instr)
        scopes = collections.Counter(">".join(re.findall(r"G_[a-z_0-9]+", n)) or "-" for n in names)
        prims = sorted({n.rsplit("/", 1)[-1] for n in names})
        rows.append({"op": op, "where": where, "name": instr.split(" = ", 1)[0].strip(), "scopes": dict(scopes),
                     "reductions": [p for p in prims if p.startswith("reduce") or p in ("argmin", "argmax")]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=3, help="KV heads (SmolLM2: 3)")
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tag_functions()
    B, H, G, d, T, L = 1, args.heads, args.group, args.head_dim, args.context, args.layers
    policy = CertPolicy(tier1="pallas", rung0="fused")
    rng = np.random.default_rng(0)
    capacity = -(-(T + 1) // policy.block_size) * policy.block_size
    k = jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.bfloat16)
    layer = TieredKVCache.from_dense(k, v, policy, capacity=capacity)
    cache = TieredModelCache.from_layers([layer] * L, num_q_heads=H * G, policy=policy, schedule="straight-looped")
    q = jnp.asarray(rng.normal(size=(B, 1, H * G, d)), jnp.bfloat16)
    kn = jnp.asarray(rng.normal(size=(B, 1, H, d)), jnp.bfloat16)

    def rung0_pass(cache, q, k, v):
        def body(i, carry):
            out, c = carry
            attn, c = c.attend(i, q, k, v, c.lengths + 1)
            return out + attn.astype(jnp.float32), c
        out, c = jax.lax.fori_loop(0, L, body, (jnp.zeros(q.shape, jnp.float32), cache.decode_fast_path(0)))
        return out, c.needs_slow_path()

    hlo = jax.jit(rung0_pass).lower(cache, q, kn, kn).compile().as_text()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rung0_pass.hlo").write_text(hlo)
    rows = listing(hlo)
    dev = jax.devices()[0]
    (out / "rung0_pass.launches.json").write_text(json.dumps(
        {"device": dev.device_kind, "jax": jax.__version__, "shape": vars(args), "launches": rows}, indent=1))
    kinds = collections.Counter(x["op"] for x in rows)
    print(f"{dev.device_kind}: {len(rows)} launches per layer-step {dict(kinds)}")
    for x in rows:
        print(f"  {x['op']:20s} {x['where']:6s} {x['name'][:40]:40s} {x['reductions']} {x['scopes']}")


if __name__ == "__main__":
    main()
