"""The one place that decides how the Pallas kernels of this package run.

On a GPU, `pl.pallas_call` lowers through Triton (jax 0.10-0.11; Mosaic GPU `plgpu` is the successor and is
not used yet). Everywhere else the kernels run in Pallas interpret mode (the kernel body evaluated with jnp
ops), which is how the CPU tests exercise the exact kernel code.

`CERTATTN_PALLAS_INTERPRET=1` (or `0`) overrides the choice, e.g. to run the interpreter on a GPU.
"""

from __future__ import annotations

import os
from typing import Any

import jax


def interpret() -> bool:
    """True when kernels run in Pallas interpret mode (no GPU, or forced by the environment)."""
    env = os.environ.get("CERTATTN_PALLAS_INTERPRET")
    if env is not None:
        return env.strip().lower() not in ("", "0", "false", "no")
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
