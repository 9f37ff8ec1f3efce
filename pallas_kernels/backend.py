"""The one place that decides how the Pallas kernels of this package run.

On a GPU, `pl.pallas_call` lowers through Triton (jax 0.10-0.11; Mosaic GPU `plgpu` is the successor and is
not used yet). Everywhere else the kernels run in Pallas interpret mode (the kernel body evaluated with jnp
ops), which is how the CPU tests exercise the exact kernel code.

`CERTATTN_PALLAS_INTERPRET=1` (or `0`) overrides the choice, e.g. to run the interpreter on a GPU.
"""

from __future__ import annotations

from typing import Any

import jax

from certattn_jax.env import switch_from_env


def interpret() -> bool:
    """True when kernels run in Pallas interpret mode (no GPU, or forced by CERTATTN_PALLAS_INTERPRET: 1/on/true
    or 0/off/false; unset, empty or auto: the backend decides; anything else is an error naming the variable)."""
    forced = switch_from_env("CERTATTN_PALLAS_INTERPRET")
    if forced is not None:
        return forced
    return jax.default_backend() != "gpu"


def compiler_params(num_warps: int, num_stages: int) -> Any:
    """Triton compiler parameters for a compiled kernel (None in interpret mode)."""
    if interpret():
        return None
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def supports_sizes(*sizes: int) -> bool:
    """Whether a kernel whose tensors have these sizes runs here: compiled (Triton) tensors need powers of two;
    interpret mode takes any size."""
    return interpret() or all(n > 0 and n & (n - 1) == 0 for n in sizes)


# Pallas's Triton lowering computes a ref's element offsets in 32-bit integers unless the whole array is larger
# than 2**32 bytes (`jax._src.pallas.triton.lowering._compute_offsets_from_indices`, jax 0.10-0.11), and Triton
# adds a 32-bit offset to a pointer as a signed number. A 1-byte array (INT8 key codes, packed INT4 value codes)
# of more than 2**31 elements but at most 2**32 bytes therefore wraps: offsets past 2**31 - 1 turn negative, and a
# kernel reads (or writes) the wrong bytes. For a model's stacked codes (the 8B shape: 32 KiB of key codes per
# token) that is 64K-128K tokens x batch: a silent wrong answer that no small known-answer check would see.
# Wider elements never reach it (2**31 elements of 2 bytes are 2**32 bytes); the shipped caches and weights are
# 2-4 bytes wide, but the gather and stacked-weight kernels check too (a float8 cache or weights would be 1 byte).
# tests/test_pallas_offsets.py pins the rule against the lowering.
_I32_OFFSETS_UP_TO_BYTES = 2**32


def offsets_fit(shape: tuple[int, ...], dtype: Any) -> bool:
    """Whether a compiled kernel can address every element of an array of this shape and dtype (see above): its
    offsets fit the lowering's 32-bit integers, or the lowering takes 64-bit ones."""
    size = 1
    for n in shape:
        size *= int(n)
    return size <= 2**31 or size * jax.numpy.dtype(dtype).itemsize > _I32_OFFSETS_UP_TO_BYTES


def arrays_fit(*arrays: Any) -> bool:
    """`offsets_fit` for every array (anything with .shape and .dtype: arrays, ShapeDtypeStructs, tracers)."""
    return all(offsets_fit(tuple(a.shape), a.dtype) for a in arrays)
