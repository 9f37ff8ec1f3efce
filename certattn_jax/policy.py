"""CertPolicy: the cache layout and the certification tolerances, one frozen dataclass.

It is a pytree: the layout fields (which fix array shapes) are static, the tolerances are leaves. So a jitted
function that takes a policy as an ordinary argument compiles once per layout and accepts any tolerances
without recompiling; the policy is also hashable, so it can be a static argument too.

Every field is checked when a policy is made (the constructor, `replace`, `dataclasses.replace`): a tolerance must
be a real finite scalar (a Python or NumPy number, a 0-d array, or a 0-d jax array, whose value is read then; a
tracer, inside jit, is checked for shape and dtype only). jax's own rebuilds of the pytree (every jitted call that
returns a cache, `jax.tree.map`, placeholders jax fills the tree with) skip the checks: `_unflatten`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from certattn_jax.validate import is_integer

_static = {"pytree_node": False}
TIER1_IMPLS = ("auto", "jnp", "pallas")
RUNG0_IMPLS = ("auto", "jnp", "fused")
HOT_REFRESH = ("deferred", "immediate", "prefetch")
# The default implementations: tier 1 "auto" (`tier1_impl`), rung 0 "auto" (`rung0_impl`).
# CERTATTN_TIER1=pallas (CERTATTN_RUNG0=fused) runs e.g. the whole soundness suite through the tier-1 kernel (the
# fused rung-0 kernel) in interpret mode.
_DEFAULT_TIER1 = os.environ.get("CERTATTN_TIER1", "auto").strip() or "auto"
_DEFAULT_RUNG0 = os.environ.get("CERTATTN_RUNG0", "auto").strip() or "auto"
_DEFAULT_HOT_REFRESH = os.environ.get("CERTATTN_HOT_REFRESH", "deferred").strip() or "deferred"
# rung0="auto" takes the fused rung 0 wherever the kernels are compiled. On the H200 it decodes SmolLM2 faster than the
# jnp rung 0 at 1K (16 blocks: 361 against 235 tokens/s, straight-looped) and 4K (64 blocks: +9 %), the 8B shape's
# 8K (128 blocks: 77.6 against 75.6 tokens/s end to end) and 32K (512 blocks: the layer's fast pass 264 against
# 275 us; ninth session). At 128K (2,048 blocks) it was slower (639 against 576 us) until the slot fix (524 us,
# eleventh session) and the per-size warps (449 us, twelfth session; `certify_rung0.tuning`), so the limit of 512
# blocks it had until then is gone (docs/performance.md, twelfth session).


def tier1_impl(impl: str) -> str:
    """The tier-1 implementation `impl` stands for here: "auto" is "pallas" where the kernels are compiled (a GPU)
    and "jnp" where they would be interpreted (the CPU)."""
    if impl != "auto":
        return impl
    from pallas_kernels import backend

    return "jnp" if backend.interpret() else "pallas"


def rung0_impl(impl: str, num_blocks: int) -> str:
    """The rung-0 implementation `impl` stands for on a layer of `num_blocks` key blocks: "auto" is "fused" where
    the kernels are compiled, else "jnp" (num_blocks: kept for a size-dependent choice; none is made today).

    The default since 2026-12-02 (fourth session; docs/performance.md): on the H200, looped schedule, the fused
    rung 0 decodes random-weight SmolLM2 1K at 220 tokens/s (the jnp rung 0: 152 in an earlier run) and real
    text at 2K 16 % faster (5.42 against 6.46 ms per step, same run); with its loops rolled it compiles within
    issue 7's target (adaptive 16.8 s against 2 x 5.3 + 10 s); it checks itself once per machine (~22 s, the
    verdicts kept on disk: pallas_kernels/selftest.py)."""
    if impl != "auto":
        return impl
    from pallas_kernels import backend

    return "jnp" if backend.interpret() else "fused"


TOLERANCES = ("eps", "abs_tol", "tau_cov", "v_tol", "rank_margin", "layer_fallback_fraction")


def _tolerance_value(name: str, x: Any) -> float | None:
    """The value of tolerance `name` as a float, or None for a tracer (inside jit: no value to read).

    Raises TypeError unless `x` is a real number (a Python or NumPy int or float, not a bool; a 0-d array of
    one), ValueError for a non-scalar array. A concrete jax.Array is read back here, once, when a policy is made
    by hand; the pytree rebuilds that jax makes from device arrays never come here (`_unflatten`).
    """
    if isinstance(x, (bool, type)) or not (isinstance(x, (int, float)) or hasattr(x, "dtype")):
        raise TypeError(f"CertPolicy.{name} must be a real number, got {x!r}")
    if not isinstance(x, (int, float)):  # NumPy / ml_dtypes scalars, NumPy and jax arrays, tracers
        dtype = np.dtype(x.dtype)
        if dtype == np.bool_ or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
            raise TypeError(f"CertPolicy.{name} must be a real number, got {x!r} of dtype {dtype}")
        if np.ndim(x) != 0:
            raise ValueError(f"CertPolicy.{name} must be a scalar, got shape {tuple(np.shape(x))}")
        if isinstance(x, jax.core.Tracer):
            return None
    try:
        value = float(x)
    except OverflowError:  # a Python int beyond float64
        value = math.inf if x > 0 else -math.inf
    if math.isnan(value):  # NaN passes every comparison below as False
        raise ValueError(f"CertPolicy.{name} must not be NaN")
    if math.isinf(value):  # an infinite eps or abs_tol would certify every head whatever its bound
        raise ValueError(f"CertPolicy.{name} must be finite, got {value}")
    return value


def _check_tolerances(values: dict[str, float]) -> None:
    """Range checks of the (finite, host) tolerances `values`, by name."""
    if "tau_cov" in values and not 0.0 < values["tau_cov"] <= 1.0:
        raise ValueError(f"CertPolicy.tau_cov must be in (0, 1], got {values['tau_cov']}")
    for name in ("eps", "abs_tol", "v_tol", "rank_margin"):
        if name in values and values[name] < 0:
            raise ValueError(f"CertPolicy.{name} must be >= 0 (and finite), got {values[name]}")
    if "layer_fallback_fraction" in values and not values["layer_fallback_fraction"] > 0.0:
        raise ValueError(f"CertPolicy.layer_fallback_fraction must be > 0, got {values['layer_fallback_fraction']}")


@dataclasses.dataclass(frozen=True)
class CertPolicy:
    """Layout (fixed when a cache is built) and tolerances (may change per call).

    Layout
      block_size:  tokens per key block B (per-channel key scales are per block; a block is also the unit of
                   promotion and of tier-2 transfers).
      group_size:  value channels per quantization group (per-token scales).
      key_bits:    8 (default) or 4.   value_bits: 4 (default) or 2.
      k_max:       promotion buffer: at most k_max blocks per KV head get exact keys and values from the
                   device-resident hot set (a later call may use a smaller k_max, never more than the cache's
                   hot slots).
      hot_slots:   blocks per KV head the hot set holds (0: k_max). More slots than k_max keep rung 1's
                   widened set (the top 2 k_max candidates) resident as far as they fit, so a later step finds it
                   on the device: on SmolLM2 and real prose (1K prompts, 2 windows of 32 steps), 16 slots for
                   k_max 8 cut the steps that leave rung 0 from 64 of 64 to 14 and rung 1's tier-2 reads from
                   1,058 to 127 (results/probe_rung1_cpu_1k*.json, docs/performance.md). Each slot costs Bk exact
                   tokens of keys and values on the device and work in every step's promotion.
    Implementation (static, not part of the layout)
      tier1:       how the tier-1 pass (INT scores and per-block partials of every full block) is computed:
                   "jnp" (XLA) or "pallas" (`pallas_kernels.tier1_pass`, one read of the quantized bytes; interpret
                   mode off the GPU). Both are covered by the same bound (docs/bounds.md section 11). Default
                   "auto" (`tier1_impl`: "pallas" on a GPU, "jnp" elsewhere), or the environment variable
                   CERTATTN_TIER1.
      rung0:       how rung 0 (selection, promotion of resident blocks, merge, bound, ranking check) is computed:
                   "jnp" (XLA, ~60 small kernels per layer) or "fused" (`pallas_kernels.certify_rung0`, one
                   kernel per layer; a higher rung then builds its context inside its own branch). Same
                   arithmetic up to the order of float32 sums. "auto" (`rung0_impl`) takes "fused" on a GPU, where
                   it is faster at every context measured (1K to 128K), and "jnp" off the GPU. Default "auto"
                   (measured on the H200: faster on random weights and on real text, compiles within issue 7's
                   target; docs/performance.md, 2026-12-02 fourth session and 2026-12-03 twelfth), or
                   CERTATTN_RUNG0.
      hot_refresh: when a model's cache makes rung 1's candidates resident: "deferred" (once per step, after
                   the last layer: `TieredKVCache.apply_pending_hot_sets` reads the blocks from tier 2 again) or
                   "immediate" (inside rung 1, from the blocks it has just fetched: no second read of tier 2,
                   a few more writes per layer-step). Both leave the same hot sets. On real text rung 1 runs in
                   ~40 % of layer-steps and each tier-2 block read costs a host round trip on the GPU
                   (docs/performance.md, 2026-12-02). "prefetch": as "deferred", but every KV head's top k_max
                   candidates of the step are made resident after the last layer, not only those of heads that
                   ran rung 1, so that the hot set follows the attention from step to step and the next step's
                   rung 0 finds its candidates resident (a tier-2 read of the blocks that changed, every step).
                   It pays only where the hot set holds the working set (SmolLM2, 1K, 16 slots: 2 instead of 14
                   of 64 steps leave rung 0); at 2K real text it does not (docs/performance.md).
                   Default "deferred" until the H200 prices them, or CERTATTN_HOT_REFRESH. Single-layer caches
                   always refresh immediately.
    A compiled kernel needs power-of-two shapes (block size, head dim, value group, hot slots); for other
    shapes the step falls back to the jnp computation of that part (same bound).
    Tolerances
      eps:         a head is certified when error_bound <= eps * value_scale + abs_tol, where value_scale is
                   ||r||_2, r_c = max_i v_ic - min_i v_ic the per-channel range of that KV head's values as
                   the cache stores them (so eps is a relative error of the attention output, relative to how
                   much the output can vary at all; taken from a lower bound of ||r||_2, so a certificate never
                   measures against more). See docs/bounds.md section 6.
      abs_tol:     absolute slack added to the tolerance (default 0).
      tau_cov:     adaptive K*: the smallest number of top blocks whose estimated mass (plus the exact
                   residual block's) reaches tau_cov for every query head of the KV head.
      v_tol:       rung 2 promotes exact values for blocks whose share of the value-error term exceeds
                   v_tol (at most v_max of them).
      rank_margin: the ranking check tolerates inversions smaller than this many nats of block log-mass.
      layer_fallback_fraction: rung 4 (exact dense attention for the whole layer) when at least this
                   fraction of the layer's query heads would need rung 3 (a value > 1 disables rung 4).
    """

    block_size: int = struct.field(default=64, **_static)
    group_size: int = struct.field(default=32, **_static)
    key_bits: int = struct.field(default=8, **_static)
    value_bits: int = struct.field(default=4, **_static)
    k_max: int = struct.field(default=8, **_static)
    v_max: int = struct.field(default=8, **_static)
    hot_slots: int = struct.field(default=0, **_static)
    eps: float = 0.05
    abs_tol: float = 0.0
    tau_cov: float = 0.995
    v_tol: float = 0.1
    rank_margin: float = 0.5
    layer_fallback_fraction: float = 0.5
    tier1: str = struct.field(default=_DEFAULT_TIER1, **_static)
    rung0: str = struct.field(default=_DEFAULT_RUNG0, **_static)
    hot_refresh: str = struct.field(default=_DEFAULT_HOT_REFRESH, **_static)

    def __post_init__(self) -> None:
        if self.tier1 not in TIER1_IMPLS:
            raise ValueError(f"unknown tier-1 implementation {self.tier1!r}; choose from {TIER1_IMPLS}")
        if self.rung0 not in RUNG0_IMPLS:
            raise ValueError(f"unknown rung-0 implementation {self.rung0!r}; choose from {RUNG0_IMPLS}")
        if self.hot_refresh not in HOT_REFRESH:
            raise ValueError(f"unknown hot-set refresh {self.hot_refresh!r}; choose from {HOT_REFRESH}")
        for name in ("block_size", "group_size", "key_bits", "value_bits", "k_max", "v_max", "hot_slots"):
            value = getattr(self, name)
            if not is_integer(value):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        if self.block_size < 2 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 2, got {self.block_size}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2, got {self.group_size}")
        if self.key_bits not in (4, 8):
            raise ValueError(f"key_bits must be 8 or 4, got {self.key_bits}")
        if self.value_bits not in (2, 4):
            raise ValueError(f"value_bits must be 4 or 2, got {self.value_bits}")
        if self.k_max < 1 or self.v_max < 0:
            raise ValueError(f"need k_max >= 1 and v_max >= 0, got {self.k_max}, {self.v_max}")
        if self.hot_slots and self.hot_slots < self.k_max:
            raise ValueError(f"hot_slots ({self.hot_slots}) must be 0 (= k_max) or at least k_max ({self.k_max})")
        values = {name: _tolerance_value(name, getattr(self, name)) for name in TOLERANCES}
        _check_tolerances({name: v for name, v in values.items() if v is not None})

    def replace(self, **updates: Any) -> CertPolicy:
        """A copy with `updates` applied (checked like a new policy)."""
        return dataclasses.replace(self, **updates)

    @property
    def slots(self) -> int:
        """The hot-set slots per KV head a cache built with this policy holds (hot_slots, or k_max)."""
        return self.hot_slots or self.k_max

    def layout(self) -> tuple[int, int, int, int]:
        """The storage fields a cache is built with (must match between a cache and the policy used on it;
        the cache's hot set is sized by its policy's k_max, and a later policy may use fewer slots)."""
        return (self.block_size, self.group_size, self.key_bits, self.value_bits)


# The pytree: the tolerances are leaves, the other fields static (`pytree_node=False`). Registered by hand rather
# than with flax.struct / jax.tree_util.register_dataclass, whose rebuilds call the constructor: those would check
# every leaf, read each device-array tolerance back to the host (a blocking transfer, 7 per prefill chunk,
# conversion or user decode step; docs/performance.md, 2026-12-02 seventh session) and refuse the placeholders jax
# puts in a tree (tracers are fine, but `flatten_axes` fills one with sentinel objects).
_DATA_FIELDS = tuple(f.name for f in dataclasses.fields(CertPolicy) if f.metadata.get("pytree_node", True))
_META_FIELDS = tuple(f.name for f in dataclasses.fields(CertPolicy) if not f.metadata.get("pytree_node", True))
assert _DATA_FIELDS == TOLERANCES


def _flatten(policy: CertPolicy) -> tuple[list[Any], tuple[Any, ...]]:
    return [getattr(policy, n) for n in _DATA_FIELDS], tuple(getattr(policy, n) for n in _META_FIELDS)


def _flatten_with_keys(policy: CertPolicy) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
    leaves, meta = _flatten(policy)
    return [(jax.tree_util.GetAttrKey(n), x) for n, x in zip(_DATA_FIELDS, leaves, strict=True)], meta


def _unflatten(meta: tuple[Any, ...], leaves: Any) -> CertPolicy:
    """A policy from jax's pieces, unchecked and without reading any leaf (see above)."""
    policy = object.__new__(CertPolicy)
    for name, value in (*zip(_META_FIELDS, meta, strict=True), *zip(_DATA_FIELDS, leaves, strict=True)):
        object.__setattr__(policy, name, value)
    return policy


jax.tree_util.register_pytree_with_keys(CertPolicy, _flatten_with_keys, _unflatten, _flatten)
