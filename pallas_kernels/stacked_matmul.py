"""x @ w[layer] for a stacked weight w [L, K, N], reading layer `layer` in place (a decode-time GEMM in a loop over
layers).

Why: a `fori_loop` over layers hands each GEMM a dynamic slice `w[i]` of the stacked weights, and XLA materializes
that slice before the cuBLAS call (2.5x per 8B decode step on the H200, results/probe_layer_loop_h200.json), so
the looped schedules keep per-layer weight buffers and reach them through one `lax.switch` per layer, a host
round trip each on a GPU (docs/performance.md). This kernel takes the whole stacked array plus the layer index
(read by the kernel, as `tier1_pass` reads stacked tier-1 arrays) and streams only that layer's [K, N] slice.
Decode GEMMs have few rows (M = batch), so the work is a bandwidth-bound stream over the weight.

Layout: grid (N // block_n, splits); program (n, s) reads w[layer, s*Ks:(s+1)*Ks, n*block_n:(n+1)*block_n] in
[block_k, block_n] tiles (Ks = K // splits) and writes float32 partial sums [splits, M, N]; the wrapper adds the
splits in float32 and rounds once to x's dtype. Every product and sum is float32 (x and w are bf16/fp16 codes
widened exactly; the MMA's products of two 8-bit-mantissa
values are exact in float32), like XLA's GEMMs; only the summation order differs from `stacked_matmul_reference`.
M == 1 multiplies on vectors (reduced every k step, or with `tile_acc` summed into a tile and reduced once) unless
`dot` is set; M > 1 (or `dot`) uses `jnp.dot` on rows padded to 16 (Triton's smallest dot), whose loads Triton's
software pipeliner can keep `num_stages` deep. `unroll` k tiles are loaded before any of them is used (more bytes
in flight per program).
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import backend

__all__ = ["stacked_matmul", "stacked_matmul_reference", "default_tiling", "supports", "tuned_settings", "TUNED"]

_TARGET_PROGRAMS = 264  # about two programs per SM on the H200 (132 SMs): enough in flight to hide latency
_MIN_DOT_ROWS = 16
_SETTINGS = ("block_n", "block_k", "splits", "num_warps", "num_stages", "tile_acc", "dot", "unroll")
_DEFAULTS = dict(num_warps=4, num_stages=3, tile_acc=False, dot=False, unroll=1)
TUNING_ENV = "CERTATTN_STACKED_TUNING"  # a JSON file of measured settings (scripts/pick_stacked_tiling.py)

# (rows, K, N) -> the setting measured fastest on the H200 among those of `gpu_session.sh mm_tune` (rows: 1, or M
# padded for the dot; results/probe_stacked_matmul_h200_*_2026-12-04f.json, docs/performance.md nineteenth
# session). Comments: its microseconds per GEMM, and XLA's (cuBLAS) on per-layer buffers in the same run. On a
# row the MMA path (`dot`) won every shape: Triton pipelines its loads, which the vector path's are not.
TUNED: dict[tuple[int, int, int], dict] = {
    # LLaMA-3.1-8B: q|k|v, o, gate|up, down
    (1, 4096, 6144): dict(block_n=128, block_k=64, splits=8, num_warps=4, num_stages=3, dot=True),  # 21.8 (17.3)
    (1, 4096, 4096): dict(block_n=128, block_k=64, splits=8, num_warps=4, num_stages=4, dot=True),  # 16.6 (12.0)
    (1, 4096, 28672): dict(block_n=128, block_k=32, splits=2, num_warps=4, num_stages=4, dot=True),  # 67.4 (59.2)
    (1, 14336, 4096): dict(block_n=128, block_k=64, splits=8, num_warps=4, num_stages=4, dot=True),  # 39.2 (31.9)
    (16, 4096, 6144): dict(block_n=128, block_k=32, splits=8, num_warps=4, num_stages=4),  # 21.6 (16.9)
    (16, 4096, 4096): dict(block_n=128, block_k=64, splits=8, num_warps=4, num_stages=4),  # 17.3 (11.8)
    (16, 4096, 28672): dict(block_n=128, block_k=64, splits=2, num_warps=4, num_stages=3),  # 67.4 (60.7)
    (16, 14336, 4096): dict(block_n=128, block_k=64, splits=8, num_warps=4, num_stages=4),  # 39.4 (32.5)
    # SmolLM2-135M
    (1, 576, 960): dict(block_n=64, block_k=32, splits=9, num_warps=4, num_stages=4, dot=True),  # 7.3 (5.1)
    (1, 576, 576): dict(block_n=64, block_k=64, splits=9, num_warps=8, num_stages=4, dot=True),  # 6.9 (4.3)
    (1, 576, 3072): dict(block_n=128, block_k=64, splits=9, num_warps=4, num_stages=4, dot=True),  # 8.8 (7.3)
    (1, 1536, 576): dict(block_n=64, block_k=64, splits=12, num_warps=4, num_stages=3, dot=True),  # 8.2 (9.0)
}


def _rows_class(M: int) -> int:
    return 1 if M == 1 else max(_MIN_DOT_ROWS, 1 << (M - 1).bit_length())


@functools.cache
def _tuning_file(path: str) -> dict[tuple[int, int, int], dict]:
    try:
        entries = json.loads(open(path).read())
        return {(int(e["rows"]), int(e["K"]), int(e["N"])): {k: e["settings"][k] for k in _SETTINGS
                                                             if k in e["settings"]} for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{TUNING_ENV}={path}: not a list of {{rows, K, N, settings}} entries ({err})") from err


def tuned_settings(M: int, K: int, N: int) -> dict:
    """The measured settings (a subset of stacked_matmul's keyword arguments) for an [M, K] x [K, N] product:
    the file named by CERTATTN_STACKED_TUNING when set, else `TUNED`; {} where none was measured."""
    path = os.environ.get(TUNING_ENV)
    table = _tuning_file(path) if path else TUNED
    return dict(table.get((_rows_class(M), K, N), {}))


def stacked_matmul_reference(x: jax.Array, w: jax.Array, layer: jax.Array | int) -> jax.Array:
    """The same product by XLA: x [M, K] @ w[layer] (w [L, K, N]) -> [M, N] in x's dtype (float32 accumulation)."""
    return jnp.matmul(x, jax.lax.dynamic_index_in_dim(w, layer, keepdims=False).astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)


def default_tiling(M: int, K: int, N: int) -> tuple[int, int, int]:
    """(block_n, block_k, splits) for an [M, K] x [K, N] product: 128-wide column tiles, 128-deep k tiles (fewer
    when K is small), and the fewest splits of K into whole k tiles that give ~_TARGET_PROGRAMS programs."""
    block_n = next((b for b in (128, 64, 32, 16) if N % b == 0), N)
    block_k = next((b for b in (128, 64, 32, 16) if K % b == 0), K)
    tiles_k = K // block_k
    want = -(-_TARGET_PROGRAMS // max(1, N // block_n))
    splits = next((s for s in range(max(1, want), tiles_k + 1) if tiles_k % s == 0), tiles_k)
    return block_n, block_k, min(splits, tiles_k)


def supports(K: int, N: int) -> bool:
    """Whether `stacked_matmul` runs compiled here on a [K, N] weight with `default_tiling` (Triton needs
    power-of-two tiles; interpret mode takes any)."""
    block_n, block_k, _ = default_tiling(1, K, N)
    return backend.supports_sizes(block_n, block_k) and N % block_n == 0 and K % block_k == 0


def stacked_matmul(x: jax.Array, w: jax.Array, layer: jax.Array | int, *, block_n: int | None = None,
                   block_k: int | None = None, splits: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None, tile_acc: bool | None = None, dot: bool | None = None,
                   unroll: int | None = None, interpret: bool | None = None) -> jax.Array:
    """x [M, K] @ w[layer] -> [M, N] in x's dtype, w [L, K, N] read in place (module docstring: layout, rounding).

    layer: an int32 scalar (traced in a loop over layers); clipped to [0, L). Settings left None come from
    `tuned_settings` (measured; compiled only), then `default_tiling` (block_n, block_k, splits), 4 warps, 3
    stages and, compiled, the MMA path for a row; block_n
    must divide N and splits * block_k must divide K. tile_acc (M == 1): accumulate
    the products in a [block_k, block_n] tile and reduce over k once at the end (else every k step reduces).
    dot (M == 1): multiply on the MMA path with the row padded to 16. unroll: k tiles loaded per loop step
    (must divide the K // (splits * block_k) steps of a program)."""
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"stacked_matmul takes x [M, K] and w [L, K, N], got {x.shape} and {w.shape}")
    M, K = x.shape
    L, Kw, N = w.shape
    if Kw != K:
        raise ValueError(f"x has {K} columns but w[layer] has {Kw} rows")
    if not (jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(w.dtype, jnp.floating)):
        raise TypeError(f"stacked_matmul multiplies floating arrays, got {x.dtype} and {w.dtype}")
    given = dict(block_n=block_n, block_k=block_k, splits=splits, num_warps=num_warps, num_stages=num_stages,
                 tile_acc=tile_acc, dot=dot, unroll=unroll)
    interpret = backend.interpret() if interpret is None else interpret
    bn, bk, s = default_tiling(M, K, N)
    # untuned shapes compiled: a row on the MMA path (it won every measured shape); interpreted: the vector path
    settings = {**_DEFAULTS, "dot": not interpret, "block_n": bn, "block_k": bk, "splits": s,
                **({} if interpret else tuned_settings(M, K, N)),
                **{k: v for k, v in given.items() if v is not None}}
    block_n, block_k, splits, num_warps, num_stages, tile_acc, dot, unroll = (settings[k] for k in _SETTINGS)
    if N % block_n or K % (block_k * splits) or (K // (block_k * splits)) % unroll:
        raise ValueError(f"tiling (block_n={block_n}, block_k={block_k}, splits={splits}, unroll={unroll}) does "
                         f"not divide K={K}, N={N}")
    layer = jnp.clip(jnp.asarray(layer, jnp.int32).reshape(1), 0, L - 1)
    rows = M if M == 1 and not dot else max(_MIN_DOT_ROWS, 1 << (M - 1).bit_length())
    xp = x if rows == M else jnp.pad(x, ((0, rows - M), (0, 0)))
    partials = _call(xp, w, layer, block_n=block_n, block_k=block_k, splits=splits, num_warps=num_warps,
                     num_stages=num_stages, tile_acc=tile_acc and rows == 1, unroll=unroll, interpret=interpret)
    return jnp.sum(partials[:, :M], axis=0).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "splits", "num_warps", "num_stages",
                                             "tile_acc", "unroll", "interpret"))
def _call(x, w, layer, *, block_n, block_k, splits, num_warps, num_stages, tile_acc, unroll, interpret):
    rows, K = x.shape
    L, _, N = w.shape
    k_split = K // splits
    kernel = functools.partial(_kernel_tile_acc if tile_acc else _kernel, block_k=block_k,
                               steps=k_split // block_k, vector=rows == 1, unroll=unroll)
    return pl.pallas_call(
        kernel,
        grid=(N // block_n, splits),
        in_specs=[pl.BlockSpec((1,), lambda n, s: (0,)),
                  pl.BlockSpec((rows, k_split), lambda n, s: (0, s)),
                  pl.BlockSpec((L, k_split, block_n), lambda n, s: (0, s, n))],
        out_specs=pl.BlockSpec((None, rows, block_n), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((splits, rows, N), jnp.float32),
        compiler_params=None if interpret else backend.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="certattn_stacked_matmul",
    )(layer, x, w)


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, block_k, steps, vector, unroll):
    layer = layer_ref[0]
    rows, block_n = o_ref.shape

    def step(t, acc):
        k0s = [pl.multiple_of((t * unroll + u) * block_k, block_k) for u in range(unroll)]
        ws = [w_ref[layer, pl.ds(k0, block_k), :] for k0 in k0s]  # every load issued before any is used
        for k0, w in zip(k0s, ws, strict=True):
            if vector:  # one row: multiply and reduce over k
                xk = x_ref[0, pl.ds(k0, block_k)].astype(jnp.float32)
                acc = acc + jnp.sum(xk[:, None] * w.astype(jnp.float32), axis=0)[None, :]
            else:  # bf16/fp16 operands, float32 products and sums (the MMA): the same values as widening first
                xk = x_ref[:, pl.ds(k0, block_k)]
                acc = acc + jnp.dot(xk, w.astype(xk.dtype), preferred_element_type=jnp.float32)
        return acc

    o_ref[...] = jax.lax.fori_loop(0, steps // unroll, step, jnp.zeros((rows, block_n), jnp.float32))


def _kernel_tile_acc(layer_ref, x_ref, w_ref, o_ref, *, block_k, steps, vector, unroll):
    """One row (M == 1): products summed elementwise into a [block_k, block_n] float32 tile, reduced over k once."""
    del vector
    layer = layer_ref[0]
    block_n = o_ref.shape[-1]

    def step(t, acc):
        k0s = [pl.multiple_of((t * unroll + u) * block_k, block_k) for u in range(unroll)]
        ws = [w_ref[layer, pl.ds(k0, block_k), :] for k0 in k0s]
        for k0, w in zip(k0s, ws, strict=True):
            acc = acc + x_ref[0, pl.ds(k0, block_k)].astype(jnp.float32)[:, None] * w.astype(jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, steps // unroll, step, jnp.zeros((block_k, block_n), jnp.float32))
    o_ref[...] = jnp.sum(acc, axis=0)[None, :]
