"""Device timing shared by the benchmark scripts (bench_attention.py, bench_kernels.py).

per_call_us: each variant runs n1 and n2 times inside one jit; per call = (t(n2) - t(n1)) / (n2 - n1), which
removes dispatch and the fixed cost of a call; median of `reps`. torch_sdpa_us: torch's SDPA replayed from a
CUDA graph, timed with CUDA events.
"""

from __future__ import annotations

import json
import math
import statistics
import time

import jax
import jax.numpy as jnp


def write_json(path: str | None, obj: dict) -> None:
    """Write a result to path (folders made) when a path is given: benchmarks save after every row."""
    if path:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=1))


def run_info() -> dict:
    """What a benchmark ran on: the device kind, the jax version and torch's (None where torch is absent)."""
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return dict(device=jax.devices()[0].device_kind, jax=jax.__version__, torch=torch_version)


def per_call_us(make, n1: int, n2: int, reps: int) -> tuple[float, object]:
    """make(n) -> zero-arg function running n calls in one jit. (median per-call µs, the last n2 run's output)."""
    f1, f2 = make(n1), make(n2)
    jax.block_until_ready(f1())
    out = jax.block_until_ready(f2())
    diffs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f1())
        t1 = time.perf_counter()
        out = jax.block_until_ready(f2())
        t2 = time.perf_counter()
        diffs.append(((t2 - t1) - (t1 - t0)) / (n2 - n1))
    return statistics.median(diffs) * 1e6, out


def measure_bandwidth(nbytes: int = 2 << 30) -> float:
    """Read bandwidth (bytes/s) of a sum over nbytes of bf16, device-timed."""
    n = nbytes // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)

    def make(k):
        @jax.jit
        def reads(x):
            return jax.lax.fori_loop(0, k, lambda i, c: jnp.sum(x * c, dtype=jnp.float32).astype(
                jnp.bfloat16) * jnp.bfloat16(1e-9) + c, jnp.bfloat16(1.0))
        return lambda: reads(x)

    us, _ = per_call_us(make, 2, 6, 3)
    return n * 2 / (us * 1e-6)


def xla_attention(q, k, v):
    """Dense decode attention with XLA: q [B, Hq, d], k, v [B, T, H, d] (einsum, float32 accumulation)."""
    B, Hq, d = q.shape
    H = k.shape[2]
    qg = q.reshape(B, H, Hq // H, d)
    s = jnp.einsum("bhgd,bthd->bhgt", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhgt,bthd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, Hq, d).astype(q.dtype)


def cudnn_attention(q, k, v):
    return jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn")[:, 0]


def torch_sdpa_us(B: int, T: int, H: int, Hq: int, d: int, n: int) -> float:
    """torch SDPA (GQA) per call in µs: a CUDA graph of n calls, median of 5 replays."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(B, Hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, H, T, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, H, T, d, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    times = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / n)
    del g, q, k, v
    torch.cuda.empty_cache()
    return statistics.median(times)


def attempt(result: dict, name: str, context: int, batch: int, fn) -> bool:
    """Run fn(); a failure is recorded in result["errors"] and printed instead of stopping the benchmark grid
    (one variant that does not compile or run must not cost the others their numbers). True if it ran."""
    import traceback

    try:
        fn()
        return True
    except Exception as e:  # noqa: BLE001 - any failure of one variant is recorded, never fatal
        result["errors"].append({"impl": name, "context": context, "batch": batch,
                                 "error": f"{type(e).__name__}: {e}"[:800]})
        print("FAILED", name, context, batch, type(e).__name__, str(e)[:300], flush=True)
        traceback.print_exc(limit=2)
        return False


# The part of a TieredKVCache that a certified step changes: timing loops carry only this and read the rest from
# the jit argument (carrying the whole cache makes XLA copy it, tier 2 included, on entry to every call).
HOT_FIELDS = ("hot_k", "hot_v", "hot_ids", "hot_used")


def hot_set(cache) -> dict:
    return {f: getattr(cache, f) for f in HOT_FIELDS}


def q_at(q0: jax.Array, i: jax.Array) -> jax.Array:
    """A query that depends on the loop step (nothing can be hoisted out of a timing loop)."""
    return (q0.astype(jnp.float32) * (1 + 1e-3 * i.astype(jnp.float32))).astype(q0.dtype)


LAYER_SHAPES = {"8b": (8, 4, 128), "smol": (3, 3, 64)}  # KV heads, query heads per KV head, head dim


def random_layer(spec: str, batch: int = 1) -> tuple[str, int, int, jax.Array, jax.Array, jax.Array]:
    """One attention layer's random bf16 inputs for "NAME:CONTEXT" (NAME in LAYER_SHAPES): (name, context T,
    query heads per KV head G, keys and values [batch, T, H, d], query [batch, H * G, d]), seeded by T."""
    name, T = spec.split(":")
    T = int(T)
    H, G, d = LAYER_SHAPES[name]
    keys = jax.random.split(jax.random.key(T), 3)
    k = jax.random.normal(keys[0], (batch, T, H, d), jnp.bfloat16)
    v = jax.random.normal(keys[1], (batch, T, H, d), jnp.bfloat16)
    q = jax.random.normal(keys[2], (batch, H * G, d), jnp.bfloat16)
    return name, T, G, k, v, q
