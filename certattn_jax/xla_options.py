"""XLA compile options the product's GPU programs ask for, decided in one place.

XLA's fusion autotuner (`xla_gpu_experimental_enable_fusion_autotuner`, on by default in jax 0.11's XLA) times
every plain fusion of a program with both its native emitter and the Triton block-level emitter. On an H100
(twenty-sixth session, `results/gpu_2026-12-06f/`, `scripts/autotune_diff.py`) the 8B certified decode process
autotuned 910 fusions against dense's 296 -- the certified step's glue (bounds, selection, the ladder's branches)
-- and kept the native emitter for 821 of them. Turning it off for the decode loop and the kernel self-checks
was measured in one call (docs/performance.md, twenty-sixth session): 8B 8K certified compile 31.1 s against
33.5 s with it, but SmolLM2 1K 27.3 s against 21.4 s, decode speed within 2 %: no clear gain, so unless asked
XLA's setting stays. CERTATTN_FUSION_AUTOTUNER=1 / 0 / auto: on / off / XLA's, for the programs that ask (the
decode loop, `compile_options(program="decode")`; the kernel self-checks, `jit`); an XLA_FLAGS that names the
option always wins.
The kernel self-checks' programs also compile without any autotuning on a GPU (`checks_autotune_off`,
CERTATTN_CHECKS_AUTOTUNE=1 keeps XLA's): their speed does not matter, their compile time does.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

from certattn_jax.env import switch_from_env

FUSION_AUTOTUNER_OPTION = "xla_gpu_experimental_enable_fusion_autotuner"
PROGRAMS = ("decode", "checks")


def _left_to_xla(option: str, backend: str | None) -> bool:
    """Whether this module leaves `option` to XLA on `backend` (default: JAX's default): off a GPU, or where
    XLA_FLAGS names it (the user's flag always wins)."""
    return (backend or jax.default_backend()) != "gpu" or option in os.environ.get("XLA_FLAGS", "")


def fusion_autotuner_on(backend: str | None = None) -> bool | None:
    """Whether the programs that ask compile with XLA's fusion autotuner on `backend` (default: JAX's default):
    True / False as CERTATTN_FUSION_AUTOTUNER says, or None where XLA's own setting stays (auto, off a GPU, or
    XLA_FLAGS names the option)."""
    if _left_to_xla(FUSION_AUTOTUNER_OPTION, backend):
        return None
    return switch_from_env("CERTATTN_FUSION_AUTOTUNER")


AUTOTUNE_LEVEL_OPTION = "xla_gpu_autotune_level"


def checks_autotune_off(backend: str | None = None) -> bool:
    """Whether the kernel self-checks' programs compile without any XLA autotuning on `backend`
    (`xla_gpu_autotune_level=0`): on a GPU unless CERTATTN_CHECKS_AUTOTUNE=1 or XLA_FLAGS names the level.
    Why: a check's programs (its inputs' quantization, the jnp reference of a rung, the kernel's program) are run
    once on a tiny cache, so their speed is worthless, while their compile -- GEMM and fusion autotuning on the GPU
    that the decode loop's compile is autotuning on at the same time -- is the 8B decode compile's long pole (the
    fused rung 0's check 36-53 s beside it, twenty-sixth session). What a check is for does not depend on it: the
    Pallas kernels' code is fixed when jax lowers them, before any option applies, and XLA does not autotune a
    kernel, so the check runs the code the decode loop runs; the reference's GEMM tiling changes only its float
    rounding, far inside the check's tolerance. (The plain XLA fusions around the kernels in a check's program are
    then always emitted natively; the decode loop's may take Triton's emitter -- XLA's code, not ours, and not
    what the checks are there to verify.)"""
    if _left_to_xla(AUTOTUNE_LEVEL_OPTION, backend):
        return False
    return not switch_from_env("CERTATTN_CHECKS_AUTOTUNE")


COMMAND_BUFFER_OPTION = "xla_gpu_enable_command_buffer"
# XLA's default command-buffer contents (xla/debug_options_flags.cc, jax 0.11) plus conditionals and while loops.
# Through compiler options the list is spelled out: the "+CONDITIONAL" form is for XLA_FLAGS only.
CONTROL_FLOW_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE"


def decode_control_flow_graphs(backend: str | None = None) -> bool:
    """Whether the decode loop compiles with conditionals and while loops inside its command buffers (CUDA graphs
    whose conditional nodes the device decides: no predicate read by the host) on `backend`:
    CERTATTN_DECODE_CONTROL_FLOW_GRAPHS=1 / 0 / auto (auto: off), never off a GPU or where XLA_FLAGS names the
    option. Measured on an H100 (twenty-seventh session, docs/performance.md): with the nested decode loop and the
    stacked LRU record -- the loop body meant to become one graph -- certified SmolLM2 1K decoded 345 tokens/s
    against the plain loop's 561 with XLA's command buffers: the trace shows the inner loop's kernels launched one
    by one by the host (144 Pallas launches per step) instead of in graphs. An experiment knob, off."""
    if _left_to_xla(COMMAND_BUFFER_OPTION, backend):
        return False
    return bool(switch_from_env("CERTATTN_DECODE_CONTROL_FLOW_GRAPHS"))


def compile_options(backend: str | None = None, program: str = "decode") -> dict[str, Any]:
    """The options (`jax.jit(..., compiler_options=...)`, `Lowered.compile(compiler_options=...)`) for `program`
    on `backend`: the fusion autotuner's setting where one is asked (`fusion_autotuner_on`); for the decode loop,
    control flow inside its command buffers where asked (`decode_control_flow_graphs`); for the checks, no
    autotuning (`checks_autotune_off`); each only where this XLA knows the option (`_known`)."""
    if program not in PROGRAMS:
        raise ValueError(f"program must be one of {PROGRAMS}, got {program!r}")
    options: dict[str, Any] = {}
    on = fusion_autotuner_on(backend)
    if on is not None and _known(FUSION_AUTOTUNER_OPTION, on):
        options[FUSION_AUTOTUNER_OPTION] = on
    if (program == "decode" and decode_control_flow_graphs(backend)
            and _known(COMMAND_BUFFER_OPTION, CONTROL_FLOW_COMMAND_BUFFERS)):
        options[COMMAND_BUFFER_OPTION] = CONTROL_FLOW_COMMAND_BUFFERS
    if program == "checks" and checks_autotune_off(backend) and _known(AUTOTUNE_LEVEL_OPTION, 0):
        options[AUTOTUNE_LEVEL_OPTION] = 0
    return options


_KNOWN: dict[tuple[str, Any], bool] = {}


def _known(option: str, value: Any) -> bool:
    """Whether XLA compiles a trivial program with option=value (an option renamed in another jax release would
    otherwise fail every compile that asks for it). Only a definite answer is remembered: a compile that failed
    for another reason (the device out of memory beside a prefill, say) is asked again next time."""
    if (option, value) in _KNOWN:
        return _KNOWN[option, value]
    try:
        jax.jit(lambda x: x + 1, compiler_options={option: value}).lower(jnp.zeros((), jnp.float32)).compile()
    except Exception as e:  # noqa: BLE001 -- XLA's error type differs across jax releases
        if option in str(e) or "compile option" in str(e).lower():
            _KNOWN[option, value] = False
        return False
    _KNOWN[option, value] = True
    return True


# a typo in a switch fails here, at import, naming the variable (not later inside a background kernel check,
# where it would quietly mark every kernel untrusted)
for _name in ("CERTATTN_FUSION_AUTOTUNER", "CERTATTN_CHECKS_AUTOTUNE", "CERTATTN_DECODE_CONTROL_FLOW_GRAPHS"):
    switch_from_env(_name)


def jit(fun, **kwargs):
    """`jax.jit(fun, **kwargs)` with the kernel self-checks' `compile_options` (programs compiled and run once per
    process)."""
    options = compile_options(program="checks")
    return jax.jit(fun, compiler_options=options, **kwargs) if options else jax.jit(fun, **kwargs)
