"""Does a loop over layers (stacked weights + stacked KV cache) cost decode speed on the GPU? (docs/performance.md)

    PYTHONPATH=. python scripts/probe_layer_loop.py --out results/probe_layer_loop.json

The certified step compiles once per layer when the layers are unrolled (issue 7); a `fori_loop` over stacked
layers compiles it once. The open question is what the loop costs when it runs: XLA must read layer i's weights
and KV slice through a dynamic slice, and a consumer that cannot fuse one (a cuBLAS GEMM) gets a materialized
copy. This probe times dense decode steps (random bf16 weights, batch 1, the model's own layer math) in three
forms, all in one process and one run:
  unrolled     models.llama.forward with a DenseKVCache (per-layer weights and K/V buffers, as today)
  loop         fori_loop over layers: weights [L, ...], K/V [L, B, H, S, d]; the new token written in place
  loop_reduce  the same with the broadcast-multiply-reduce attention (fusible with the dynamic slice)
  loop_switch  fori_loop over layers, the dense parts in one `lax.switch` per layer over per-layer weights (the
               certified "looped" schedule's large-layer form: a host round trip per layer on a GPU)
  loop_pallas  fori_loop over stacked weights, every GEMM `pallas_kernels.stacked_matmul` (reads w[i] in place)
It reports compile seconds, median microseconds per decode step (N steps in one jit, device-timed by
block_until_ready around the whole call), and the number of copy / dynamic-slice kernels in the loop body.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from certattn_jax.dense_cache import DenseKVCache  # noqa: E402
from certattn_jax.kv_cache import masked_attention  # noqa: E402
from models import llama  # noqa: E402
from models.config import LlamaConfig  # noqa: E402
from models.rope import apply_rope, rope_cos_sin  # noqa: E402
from pallas_kernels.stacked_matmul import stacked_matmul  # noqa: E402

SHAPES = {
    "smollm2": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                           num_kv_heads=3, head_dim=64, tie_word_embeddings=True),
    "llama3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                               num_heads=32, num_kv_heads=8, head_dim=128),
}


def gemv_reduce(x, w):
    """x [B, 1, D] @ w [D, N] as a broadcast-multiply-reduce (a reduction fusion can read a dynamic slice of w)."""
    return jnp.sum(x[..., :, None].astype(jnp.float32) * w.astype(jnp.float32), axis=-2).astype(x.dtype)


def pallas_dot(w_all, i):
    """x [B, 1, D] @ w_all[i] by the stacked-weight kernel (w_all [L, D, N] read in place)."""
    return lambda x, _w: stacked_matmul(x[:, 0], w_all, i)[:, None]


def stacked_step(params, config, token, k_all, v_all, pos, impl, matmul="dot"):
    """One decode step over stacked layers: x [B, 1, D]; k_all/v_all [L, B, H, S, d]; pos [B] (int32)."""
    B = token.shape[0]
    Hq, Hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    cos, sin = rope_cos_sin(config, pos[:, None])
    x = params["embed"][token][:, None]

    def body(i, carry):
        x, k_all, v_all = carry
        if matmul == "pallas":  # the norms by index (small), the GEMMs from the stacked weights in place
            layer = {name: (w if w.ndim == 3 else w[i]) for name, w in params["layers"].items()}
            dots = {name: pallas_dot(params["layers"][name], i) for name in ("wqkv", "wo", "w_gate_up", "w_down")}
        else:
            layer = jax.tree.map(lambda w: w[i], params["layers"])
            dots = {}
        base = llama._dot if matmul in ("dot", "pallas") else gemv_reduce

        def dot(h, name):
            return dots.get(name, base)(h, layer[name])
        h = llama.rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        nq, nk = Hq * d, Hkv * d
        qkv = dot(h, "wqkv")
        q, k, v = qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:]
        q = apply_rope(q.reshape(B, 1, Hq, d), cos, sin)
        k = apply_rope(k.reshape(B, 1, Hkv, d), cos, sin)
        v = v.reshape(B, 1, Hkv, d)
        b_idx = jnp.arange(B)
        k_all = k_all.at[i, b_idx, :, pos].set(k[:, 0].astype(k_all.dtype))
        v_all = v_all.at[i, b_idx, :, pos].set(v[:, 0].astype(v_all.dtype))
        attn = masked_attention(q, k_all[i], v_all[i], pos[:, None], pos + 1, impl)
        x = x + dot(attn.reshape(B, 1, Hq * d), "wo")
        h = llama.rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
        gate, up = jnp.split(dot(h, "w_gate_up"), 2, axis=-1)
        return x + dot(jax.nn.silu(gate) * up, "w_down"), k_all, v_all

    x, k_all, v_all = jax.lax.fori_loop(0, config.num_layers, body, (x, k_all, v_all))
    x = llama.rms_norm(x, params["final_norm"], config.rms_norm_eps)
    logits = llama.logits_from_hidden(params, config, x)
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), k_all, v_all


def switch_step(params, config, token, k_all, v_all, pos, impl):
    """The same step with per-layer weights (params["layers"] a list) reached through one `lax.switch` per
    layer: branch i runs layer i's output projection and MLP, then layer i + 1's q/k/v projections (the
    certified "looped" schedule's structure for large layers, models.llama._layers_looped)."""
    B = token.shape[0]
    Hq, Hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    nq, nk = Hq * d, Hkv * d
    cos, sin = rope_cos_sin(config, pos[:, None])
    layers = params["layers"]

    def pre(layer, x):
        h = llama.rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        qkv = llama._dot(h, layer["wqkv"])
        q, k, v = qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:]
        return (apply_rope(q.reshape(B, 1, Hq, d), cos, sin), apply_rope(k.reshape(B, 1, Hkv, d), cos, sin),
                v.reshape(B, 1, Hkv, d))

    def post(layer, x, attn):
        x = x + llama._dot(attn.reshape(B, 1, Hq * d), layer["wo"])
        h = llama.rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
        gate, up = jnp.split(llama._dot(h, layer["w_gate_up"]), 2, axis=-1)
        return x + llama._dot(jax.nn.silu(gate) * up, layer["w_down"])

    x = params["embed"][token][:, None]
    q0, k0, v0 = pre(layers[0], x)

    def branch(i):
        def run(x, attn):
            x = post(layers[i], x, attn)
            if i + 1 == len(layers):
                return x, jnp.zeros_like(q0), jnp.zeros_like(k0), jnp.zeros_like(v0)
            return (x, *pre(layers[i + 1], x))
        return run

    branches = [branch(i) for i in range(len(layers))]

    def body(i, carry):
        x, q, k, v, k_all, v_all = carry
        b_idx = jnp.arange(B)
        k_all = k_all.at[i, b_idx, :, pos].set(k[:, 0].astype(k_all.dtype))
        v_all = v_all.at[i, b_idx, :, pos].set(v[:, 0].astype(v_all.dtype))
        attn = masked_attention(q, k_all[i], v_all[i], pos[:, None], pos + 1, impl)
        x, q, k, v = jax.lax.switch(i, branches, x, attn)
        return x, q, k, v, k_all, v_all

    x, _, _, _, k_all, v_all = jax.lax.fori_loop(0, len(layers), body, (x, q0, k0, v0, k_all, v_all))
    x = llama.rms_norm(x, params["final_norm"], config.rms_norm_eps)
    logits = llama.logits_from_hidden(params, config, x)
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), k_all, v_all


def count_kernels(hlo: str) -> dict:
    return {"dynamic_slice_fusions": len(re.findall(r"= \S+ fusion\(.*dynamic-slice", hlo)),
            "copies": len(re.findall(r"= \S+ copy\(", hlo)),
            "copy_start": len(re.findall(r"copy-start", hlo))}


def time_call(fn, args, repeats):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


ALL_FORMS = ("unrolled", "loop", "loop_reduce", "loop_dsf", "loop_gemv_reduce", "loop_switch", "loop_pallas")


def run_shape(name, config, context, steps, repeats, forms_wanted=ALL_FORMS):
    key = jax.random.PRNGKey(0)
    params = llama.fuse_projections(llama.init_params(config, key, jnp.bfloat16))
    B, L = 1, config.num_layers
    rows = []
    start = context - steps - 1

    # unrolled: the product's forward
    cache = DenseKVCache.init(num_layers=L, batch=B, capacity=context, num_kv_heads=config.num_kv_heads,
                              head_dim=config.head_dim, dtype=jnp.bfloat16)
    cache = cache.replace(lengths=jnp.full((B,), start, jnp.int32))

    def unrolled(params, cache, tok):
        def step(_, c):
            cache, tok = c
            logits, cache = llama.forward(params, config, tok[:, None], cache)
            return cache, jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, steps, step, (cache, tok))

    tok = jnp.zeros((B,), jnp.int32)
    if "unrolled" in forms_wanted:
        f = jax.jit(unrolled)
        t0 = time.perf_counter()
        compiled = f.lower(params, cache, tok).compile()
        compile_s = time.perf_counter() - t0
        med = time_call(compiled, (params, cache, tok), repeats)
        rows.append({"model": name, "context": context, "form": "unrolled", "compile_s": round(compile_s, 2),
                     "us_per_step": round(med / steps * 1e6, 1), **count_kernels(compiled.as_text())})
    del cache

    stacked_params = {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"])}
    shape = (L, B, config.num_kv_heads, context, config.head_dim)
    dsf = {"xla_gpu_enable_dynamic_slice_fusion": True}
    forms = (("loop", "einsum", "dot", None), ("loop_reduce", "reduce", "dot", None),
             ("loop_dsf", "einsum", "dot", dsf), ("loop_gemv_reduce", "reduce", "reduce", None),
             ("loop_switch", "einsum", "switch", None), ("loop_pallas", "einsum", "pallas", None))
    written = {}  # form -> the K written by its steps (float32), to compare the forms' numbers
    for form, impl, matmul, opts in forms:
        if form not in forms_wanted or (opts and jax.default_backend() != "gpu"):
            continue
        k_all, v_all = jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)

        def looped(params, k_all, v_all, tok, impl=impl, matmul=matmul):
            def step(s, c):
                k_all, v_all, tok = c
                pos = jnp.full((B,), start, jnp.int32) + s
                if matmul == "switch":
                    tok, k_all, v_all = switch_step(params, config, tok, k_all, v_all, pos, impl)
                else:
                    tok, k_all, v_all = stacked_step(params, config, tok, k_all, v_all, pos, impl, matmul)
                return k_all, v_all, tok
            return jax.lax.fori_loop(0, steps, step, (k_all, v_all, tok))

        f = jax.jit(looped)
        form_params = params if matmul == "switch" else stacked_params
        t0 = time.perf_counter()
        try:
            compiled = f.lower(form_params, k_all, v_all, tok).compile(compiler_options=opts)
        except Exception as e:  # an unknown option on this jaxlib, or a kernel this backend rejects
            rows.append({"model": name, "context": context, "form": form, "error": str(e)[:300]})
            continue
        compile_s = time.perf_counter() - t0
        med = time_call(compiled, (form_params, k_all, v_all, tok), repeats)
        k_out = compiled(form_params, k_all, v_all, tok)[0]
        # the first step's K (every layer, from the same first token): later steps follow each form's own argmax
        # tokens, which random weights make diverge at the first near-tie
        written[form] = k_out[:, :, :, start].astype(jnp.float32)
        row = {"model": name, "context": context, "form": form, "compile_s": round(compile_s, 2),
               "us_per_step": round(med / steps * 1e6, 1), **count_kernels(compiled.as_text())}
        if form != "loop" and "loop" in written:  # same steps, same math; only the GEMMs' summation order differs
            ref = written["loop"]
            row["k_rel_diff_vs_loop"] = float(jnp.max(jnp.abs(written[form] - ref)) / jnp.max(jnp.abs(ref)))
        rows.append(row)
        del k_all, v_all, k_out
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/probe_layer_loop.json")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--grid", default="smollm2:1024,smollm2:8192,llama3.1-8b:8192,llama3.1-8b:32768")
    ap.add_argument("--forms", default=",".join(ALL_FORMS), help=f"comma-separated subset of {ALL_FORMS}")
    args = ap.parse_args()
    forms = tuple(f.strip() for f in args.forms.split(",") if f.strip())
    unknown = set(forms) - set(ALL_FORMS)
    if unknown:
        ap.error(f"unknown forms {sorted(unknown)}: choose from {ALL_FORMS}")
    rows = []
    for item in args.grid.split(","):
        name, ctx = item.split(":")
        rows += run_shape(name, SHAPES[name], int(ctx), args.steps, args.repeats, forms)
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "steps": args.steps,
           "repeats": args.repeats, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
