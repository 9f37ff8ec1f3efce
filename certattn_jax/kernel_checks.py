"""The compiled kernels' one-time self-checks, started early for a cache about to be built.

Before a tiered cache's step routes a configuration through a compiled Pallas kernel, the kernel is checked once
per machine against its jnp reference (`pallas_kernels.selftest`: the tier-1 pass, the fused rung 0, rung 1's
tier-2 gather, the token write). Run where the step is first traced, those checks sit inside the decode compile,
one after the other (11 s of a 31 s SmolLM2 compile on a fresh H200, eighth session of 2026-12-02). `start` asks
the very predicates the step asks (`step.tier1_kernel_runs`, `step.uses_fused_rung0`,
`TieredKVCache.reads_tier2_by_kernel`, `TieredKVCache.writes_token_by_kernel`), on the cache's shapes alone
(`jax.eval_shape`), each in a background thread: the checks run side by side while the prompt is prefilled, and
the step's trace then reads their verdicts (or waits for the rest). An ahead-of-time compile need not wait at all
(`compile_while_checking`): it traces on trust and is kept only once the verdicts confirm it. A first thread
compiles one tiny kernel (`selftest.warm_compiler`): the first Pallas compile in a process pays a one-time setup
(~10 s on the H200), which then overlaps the prefill too. Where no compiled kernel runs (the CPU) nothing starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from certattn_jax.cache import TieredKVCache, conversion_layout
from certattn_jax.policy import CertPolicy

T = TypeVar("T")


# Configurations `start` has started in this process -> their threads. A prefill asks every call, and building the
# shapes (two traces of the cache's init: 9.7 ms median, up to 55 ms, on a CPU at SmolLM2 1K shapes,
# scripts/probe_prefill_host_work.py) and asking the predicates again in five threads cost host time that the GPU's
# time to first token paid on every prompt (thirty-seventh session). A
# configuration's verdicts do not change once checked; and where a skipped start would have mattered (a setting
# changed in between), the step's own predicates check at the trace instead: later, never wrong.
_STARTED: dict[tuple, list[threading.Thread]] = {}
_STARTED_LIMIT = 256


def forget() -> None:
    """Forget which configurations `start` has started (tests that count the checks started)."""
    _STARTED.clear()


def start(*, mode: str, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype: Any,
          policy: CertPolicy) -> list[threading.Thread]:
    """Start, in the background, the kernel checks a model's tiered cache of `mode` ("naive" or "certified") with
    these shapes will need (module docstring; its decode steps run on layer views of the stacked arrays); returns
    the threads (empty where no compiled kernel runs). Once per configuration and process: a later call with the
    same configuration returns the first call's threads, started or finished, and starts nothing."""
    from pallas_kernels import selftest

    if not selftest.runs_compiled_kernels():
        return []
    key = (mode, int(batch), int(capacity), int(num_kv_heads), int(head_dim), jax.numpy.dtype(dtype).name,
           conversion_layout(policy), str(policy.tier1), str(policy.rung0))
    if key in _STARTED:
        return _STARTED[key]
    if len(_STARTED) >= _STARTED_LIMIT:
        _STARTED.clear()
    _STARTED[key] = threads = _start(mode, batch, capacity, num_kv_heads, head_dim, dtype, policy)
    return threads


def _start(mode: str, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype: Any,
           policy: CertPolicy) -> list[threading.Thread]:
    """`start`'s work: the cache's shapes, and the step's predicates asked in background threads."""
    from certattn_jax import step
    from pallas_kernels import selftest

    def init(layers):
        return TieredKVCache.init(batch=batch, capacity=capacity, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                  dtype=dtype, policy=policy, layers=layers)

    try:
        shapes: TieredKVCache = jax.eval_shape(lambda: init(1))
        # a model's decode step runs the fused rung 0 on layer views of its stacked arrays: that form's verdict
        view: TieredKVCache = jax.eval_shape(lambda: selftest.as_layer_view(init(None)))
    except (ValueError, TypeError):  # a configuration the cache refuses: its own construction says why, later
        return []
    # the compiler's one-time setup first (a no-op once paid): with verdicts kept on disk no check below compiles
    # a kernel, and the decode compile would pay it
    checks = [selftest.warm_compiler, lambda: step.tier1_kernel_runs(shapes, policy.tier1),
              shapes.writes_token_by_kernel]
    if mode == "certified":
        checks += [lambda: step.uses_fused_rung0(view, policy), shapes.reads_tier2_by_kernel]
    return selftest.start_in_background(*checks)


def compile_while_checking(build: Callable[[], T]) -> T:
    """`build()` -- a trace and compile of a step that uses the kernels, e.g. `jax.jit(f).lower(*args).compile()`
    -- overlapped with the kernels' self-checks it needs instead of waiting for them at the trace: predicates
    whose verdict is still out answer "trusted" for the trace, and the result is returned only once every such
    verdict came in good; otherwise it is traced and compiled again, taking the jnp path for the failed kernel
    (`pallas_kernels.selftest.compile_while_checking`). Use it for ahead-of-time compiles (the decode loop of
    `models.generate` does): a plain `jax.jit` call traces and runs in one go, so it keeps waiting at the trace."""
    from pallas_kernels import selftest

    return selftest.compile_while_checking(build)
