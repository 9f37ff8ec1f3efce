"""Functional LLaMA (LLaMA 2 / 3 / 3.1, SmolLM2): pure functions over an explicit parameter pytree.

Parameter layout (weights stored [in, out] so that y = x @ W):

    params = {
      "embed":      [V, D],
      "layers":     [ {"attn_norm": [D], "wq": [D, Hq*d], "wk": [D, Hkv*d], "wv": [D, Hkv*d],
                       "wo": [Hq*d, D], "mlp_norm": [D], "w_gate": [D, F], "w_up": [D, F],
                       "w_down": [F, D]} for each layer ],
      "final_norm": [D],
      "lm_head":    [D, V]   # absent when the embeddings are tied
    }

`fuse_projections` rewrites each layer to "wqkv" [D, (Hq + 2 Hkv) d] and "w_gate_up" [D, 2F]: the same
math with fewer, larger matrix-vector products (measured on an H200: 1.3 ms less per LLaMA-8B decode step,
docs/results.md). `forward` accepts either form.

Layers are a Python list (unrolled in the trace) rather than stacked arrays: each layer's weights are then
separate buffers that the GEMMs read in place (a loop over stacked weights copies each layer's slice before its
GEMM: 2.5x slower per step for the 8B shape on the H200, results/probe_layer_loop_h200.json). A certified
decode step runs in two passes: every layer at rungs 0-1, or at rung 0 alone (`decode_fast_path`; in a loop over
layers by default; "adaptive", the GPU's default, picks the rung-0 pass after steps that stayed at rung 0: see
`TieredModelCache.schedule`), and only when some head needs a higher rung, the step again with the whole ladder
in a `lax.fori_loop` over layers (`_layers_looped`), so the rarely-taken rungs are compiled once instead of once
per layer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.env import choice_from_env, positive_int_from_env
from certattn_jax.kv_cache import KVCache, check_cache_fits, einsum_f32, is_concrete, overflow_mask
from certattn_jax.model_cache import SMALL_LAYER_BYTES, cache_spec
from certattn_jax.validate import checked_counts
from models.config import LlamaConfig
from models.params import FUSED_LAYER_KEYS, STACKED_LAYERS, check_one_dtype_per_layer_weight
from models.rope import apply_rope, rope_cos_sin
from pallas_kernels import backend as pallas_backend
from pallas_kernels import stacked_matmul as stacked_kernel

Params = dict[str, Any]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * weight, computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed.astype(x.dtype) * weight.astype(x.dtype)).astype(x.dtype)


class StackedWeight(NamedTuple):
    """Row `index` of a stacked weight `stacked` [L, K, N], as a layer's weight inside a loop over layers: `_dot`
    multiplies it with `pallas_kernels.stacked_matmul`, which reads that row in place (XLA would copy the
    dynamic slice before its GEMM)."""
    stacked: jax.Array
    index: jax.Array


def _dot(x: jax.Array, w: jax.Array | StackedWeight) -> jax.Array:
    if isinstance(w, StackedWeight):
        out = stacked_kernel.stacked_matmul(x.reshape(-1, x.shape[-1]), w.stacked, w.index)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return jnp.matmul(x, w.astype(x.dtype))


def _mlp(layer: Params, x: jax.Array) -> jax.Array:
    if "w_gate_up" in layer:
        gate, up = jnp.split(_dot(x, layer["w_gate_up"]), 2, axis=-1)
    else:
        gate = _dot(x, layer["w_gate"])
        up = _dot(x, layer["w_up"])
    return _dot(jax.nn.silu(gate) * up, layer["w_down"])


def _qkv(layer: Params, h: jax.Array, config: LlamaConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    if "wqkv" in layer:
        nq, nk = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        qkv = _dot(h, layer["wqkv"])
        return qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:]
    return _dot(h, layer["wq"]), _dot(h, layer["wk"]), _dot(h, layer["wv"])


def fuse_projections(params: Params) -> Params:
    """The same model with q|k|v and gate|up concatenated per layer (idempotent; the inputs are not kept)."""
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        for fused, parts in FUSED_LAYER_KEYS.items():
            if parts[0] in layer:
                layer[fused] = jnp.concatenate([layer.pop(p) for p in parts], axis=1)
        layers.append(layer)
    return {**params, "layers": layers}


def _check_tokens(tokens: jax.Array, config: LlamaConfig) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array, got dtype {tokens.dtype}")
    if tokens.shape[1] == 0:
        raise ValueError("tokens is empty: need at least one token per sequence")
    if is_concrete(tokens):
        lo, hi = int(np.min(np.asarray(tokens))), int(np.max(np.asarray(tokens)))
        if lo < 0 or hi >= config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {config.vocab_size}), got range [{lo}, {hi}]")


def _check_cache(cache: KVCache, config: LlamaConfig) -> None:
    check_cache_fits(cache, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim)


def _embed(params: Params, tokens: jax.Array) -> jax.Array:
    """The token embeddings [B, T, D]; NaN rows for ids outside the vocabulary (inside jit they cannot raise,
    and a gather would clamp or wrap them into another token's row: a silent wrong answer)."""
    vocab = params["embed"].shape[0]
    ok = (tokens >= 0) & (tokens < vocab)
    x = params["embed"][jnp.clip(tokens, 0, vocab - 1)]
    return jnp.where(ok[..., None], x, jnp.asarray(jnp.nan, x.dtype))


def _model_dtype(params: Params) -> Any:
    return params["embed"].dtype


def init_cache_for(params: Params, config: LlamaConfig, batch: int, capacity: int) -> DenseKVCache:
    """A dense cache in the model's dtype."""
    return init_cache(params, config, batch, capacity)


def init_cache(params: Params, config: LlamaConfig, batch: int, capacity: int, mode: str = "dense",
               policy: Any = None) -> KVCache:
    """A KV cache for this model: mode "dense" (model dtype), or "naive" / "certified" (tiered, with an
    optional `certattn_jax.CertPolicy`); see `certattn_jax.model_cache.cache_spec`."""
    return cache_spec(mode, config, _model_dtype(params), policy)(batch, capacity)


def forward_hidden(params: Params, config: LlamaConfig, tokens: jax.Array, cache: KVCache,
                   valid_lengths: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Run the transformer; return final-normed hidden states [B, T, D] and the updated cache.

    tokens [B, T] continue each sequence from `cache.lengths[b]`; only the first valid_lengths[b]
    (default T) tokens are real, the rest are padding (their outputs are meaningless).
    """
    _check_tokens(tokens, config)
    _check_cache(cache, config)
    B, T = tokens.shape
    cache_batch = cache.lengths.shape[-1]
    if cache_batch != B:
        raise ValueError(f"tokens have batch {B} but the cache holds {cache_batch} sequences")
    bad_valid = None
    if valid_lengths is None:
        valid_lengths = jnp.full((B,), T, jnp.int32)
    else:  # inside jit out-of-range counts cannot raise: clipped, and those sequences' outputs are NaN
        valid_lengths, bad_valid = checked_counts(valid_lengths, B, T, "valid_lengths")
    start = cache.lengths
    new_lengths = start + valid_lengths
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    cos, sin = rope_cos_sin(config, positions)

    x = _embed(params, tokens)
    fast = cache.decode_fast_path() if T == 1 and hasattr(cache, "decode_fast_path") else None
    if fast is None and T == 1 and getattr(cache, "loops_naive_decode", lambda: False)():
        x, cache = _layers_looped(params, config, x, cache, cos, sin, new_lengths)
    elif fast is None:
        x, cache = _layers_unrolled(params, config, x, cache, cos, sin, new_lengths)
    else:
        # Two passes (docs/performance.md, "compile time"): every layer at rungs 0-1 (looped, or unrolled for the
        # "two-pass" schedule; at rung 0 alone for the "straight" ones; "adaptive" picks per step); only if some
        # head of some layer needs a higher rung, the step again from its start with the whole ladder, in a loop
        # over layers, so the ladder is compiled once rather than once per layer.
        # One conditional for all a common step skips (each is a host round trip on a GPU): the second pass and
        # the end of the step's maintenance (`with_lengths`: pending hot-set blocks, a full residual block).
        def second_pass_if_needed(x_fast, c_fast):
            def rare():
                x_done, c_done = jax.lax.cond(
                    c_fast.needs_slow_path(),
                    lambda: _slow_path_done(*_layers_looped(params, config, x, cache, cos, sin, new_lengths,
                                                            rare=True)),
                    lambda: (x_fast, c_fast.fast_path_done()))
                return x_done, c_done.with_lengths(new_lengths)

            def common():  # nothing due: the lengths recorded, nothing else
                return x_fast, _common_step_done(c_fast, new_lengths)

            return jax.lax.cond(_step_is_rare(c_fast, new_lengths), rare, common)

        schedule = getattr(fast, "schedule", "")
        if schedule == "adaptive":  # rung 1 in the first pass unless the last steps stayed at rung 0
            def first_pass(layers, top_rung):
                def run():
                    x_fast, c_fast = layers(params, config, x, cache.decode_fast_path(top_rung), cos, sin,
                                            new_lengths)
                    return x_fast, c_fast.fast_pass_result()
                return run

            # one second pass after either first pass: the whole ladder is compiled once, not once per branch
            x, cache = second_pass_if_needed(*jax.lax.cond(cache.wants_rung1_pass(),
                                                           first_pass(_layers_looped, 1),
                                                           first_pass(_layers_looped_stacked, 0)))
        else:
            first_pass = {"looped": _layers_looped, "straight-looped": _layers_looped_stacked}.get(
                schedule, _layers_unrolled)
            x, cache = second_pass_if_needed(*first_pass(params, config, x, fast, cos, sin, new_lengths))
    x = _final_hidden(params, config, x, new_lengths, cache.capacity, bad_valid)
    return x, (cache if fast is not None else cache.with_lengths(new_lengths))  # (the fast path's: recorded)


def _final_hidden(params: Params, config: LlamaConfig, x: jax.Array, new_lengths: jax.Array,
                  capacity: int, bad: jax.Array | None = None) -> jax.Array:
    """The final norm of x [B, T, D]; never a silent wrong answer: a sequence that overflowed the cache, or whose
    valid length was out of range (bad [B], inside jit), gets NaN."""
    x = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    poison = overflow_mask(new_lengths, capacity)
    if bad is not None:
        poison = poison | bad
    return jnp.where(poison[:, None, None], jnp.nan, x)


def _step_is_rare(c_fast: KVCache, new_lengths: jax.Array) -> jax.Array:
    """After a decode step's first pass: some head needs the second pass, or the end of the step has maintenance."""
    return c_fast.needs_slow_path() | c_fast.maintenance_due(new_lengths)


def _common_step_done(c_fast: KVCache, new_lengths: jax.Array) -> KVCache:
    """A first pass's cache as the step's result when nothing is rare: the step counted, the lengths recorded."""
    return c_fast.fast_path_done().with_lengths(new_lengths, maintain=False)


FIRST_PASS_SCHEDULES = ("adaptive", "straight", "straight-looped")  # a rung-0 first pass: `decode_first_pass`


def has_decode_first_pass(cache: Any) -> bool:
    """Whether `decode_first_pass` serves this cache: a certified model cache whose decode step has a rung-0
    first pass (`FIRST_PASS_SCHEDULES`; a rung-1 pass may change the hot set, which a redo could not undo
    without copying it)."""
    return _has_first_pass(cache, FIRST_PASS_SCHEDULES)


def _has_first_pass(cache: Any, schedules: tuple[str, ...]) -> bool:
    """A certified model cache (one that undoes a step and has a fast pass) whose schedule is one of `schedules`."""
    return (getattr(cache, "schedule", None) in schedules and hasattr(cache, "undo_step")
            and hasattr(cache, "decode_fast_path") and cache.decode_fast_path() is not None)


# Schedules whose decode step can be bridged by a rung-0 first pass (`decode_first_pass(..., rung0=True)`): every
# certified schedule with a fast pass. For "looped" and "two-pass" (whose own fast pass includes rung 1) the rung-0
# pass answers a step only where every head answers at rung 0, which the rung-0-1 pass would answer identically
# (rung 1 runs only for a head that fails rung 0); any other step is redone by the plain step.
BRIDGE_SCHEDULES = FIRST_PASS_SCHEDULES + ("looped", "two-pass")


def has_rung0_first_pass(cache: Any) -> bool:
    """Whether `decode_first_pass(..., rung0=True)` serves this cache (`BRIDGE_SCHEDULES`)."""
    return _has_first_pass(cache, BRIDGE_SCHEDULES)


# How the decode bridge's rung-0 first pass (`decode_first_pass(..., rung0=True)`) runs its layers for a schedule
# whose own pass loops over them, CERTATTN_FIRST_PASS_UNROLLED:
#   "auto" (the default): "background" where the looped pass would hold a per-layer switch for the weights (large
#     layers on a GPU without the stacked-weight kernel: 8B-sized, 33 host round trips per step looped, 1 unrolled;
#     thirty-third session, H100: 103.7 against 101.5 tokens/s at 8B 8K), else "0" (small layers read stacked
#     weights in the loop: SmolLM2 4K unrolled was 21 % slower);
#   "0": in a loop over layers (compiled once);
#   "1": unrolled (straight-line code: each layer's weights and cache read in place at a constant index, no loop
#     over layers), from the first step: decoding waits for its compile;
#   "background": looped until the unrolled pass has compiled in the background, then unrolled
#     (`models.generate.BridgedDecode`): decoding waits only for the looped pass's compile.
# On a GPU every iteration of a loop over layers is driven by the host (~11 us each on the H200,
# scripts/probe_cmdbuf.py; 30 per SmolLM2 step), and large layers hold their dense code in per-layer switches (a
# host round trip each); unrolled, a step is one CUDA graph as dense's is, for more compile (the rung-0 attention
# once per layer). The "straight" and "two-pass" schedules' first passes are unrolled anyway.
FIRST_PASS_CHOICES = ("auto", "0", "1", "background")
_FIRST_PASS_UNROLLED = choice_from_env("CERTATTN_FIRST_PASS_UNROLLED", FIRST_PASS_CHOICES, "auto")


def first_pass_mode(params: Params | None = None) -> str:
    """CERTATTN_FIRST_PASS_UNROLLED resolved for these params: "0" (looped), "1" (unrolled) or "background".
    "auto" is "background" where the looped pass would switch per layer to reach the weights
    (`loops_switch_weights`), else "0"; without params, "auto" is "0"."""
    if _FIRST_PASS_UNROLLED != "auto":
        return _FIRST_PASS_UNROLLED
    return "background" if params is not None and loops_switch_weights(params) else "0"


def loops_switch_weights(params: Params) -> bool:
    """Whether a rung-0 first pass in a loop over layers reaches each layer's weights through a per-layer
    `lax.switch` (a host round trip per layer on a GPU): large layers on a GPU, unless the stacked-weight kernel
    reads them in place (CERTATTN_LOOPED_WEIGHTS=kernel). See `_layers_looped_stacked`."""
    return (jax.default_backend() == "gpu" and not _small_layers(params)
            and _weights_mode(params) != "kernel")


def first_pass_unrolled() -> bool:
    """Whether the bridge's rung-0 first pass unrolls its layers from the first step (CERTATTN_FIRST_PASS_UNROLLED
    "1"); "background" builds the unrolled pass beside the looped one (`models.generate.BridgedDecode`)."""
    return first_pass_mode() == "1"


def decode_first_pass(params: Params, config: LlamaConfig, tokens: jax.Array, cache: KVCache,
                      rung0: bool = False, unrolled: bool | None = None, valid_lengths: jax.Array | None = None,
                      ) -> tuple[jax.Array, KVCache, jax.Array]:
    """A decode step's first pass alone, without the step's top-level conditionals (each one a host round trip on
    a GPU): (hidden [B, 1, D] final-normed, cache, redo scalar bool). Where redo is clear, (hidden, cache) equal
    `forward_hidden`'s for this step. Where it is set (some head needs a rung above the pass's, or the end of the
    step has maintenance to do: a full residual block, pending hot-set blocks) the step is not done: hidden is
    not valid and the cache is `cache.undo_step(...)`'s, i.e. the step must be answered by `forward_hidden` from
    it (the pass's other writes -- the token's row and running statistics, the certificates, the hot set's usage
    marks -- are those the step writes again, value for value). A decode loop can thus ask "is a step rare"
    with its own loop predicate (`models.generate`'s "nested" loop). The "adaptive" schedule's pass is its
    rung-0 pass (the caller asks `wants_rung1_pass` first).
    rung0: the pass is rung 0 alone for any schedule of `BRIDGE_SCHEDULES` ("looped" and "two-pass" too: a step
    where some head needs rung 1 is then redone), in a loop over layers except for the unrolled fast passes
    ("straight", "two-pass") and, with unrolled (default `first_pass_unrolled()`), for every schedule;
    `models.generate`'s decode bridge runs it while the whole step still compiles.
    valid_lengths [B] (0 or 1; default 1): as `forward_hidden`'s (0: the sequence takes no token this step)."""
    _check_tokens(tokens, config)
    _check_cache(cache, config)
    serves = has_rung0_first_pass(cache) if rung0 else has_decode_first_pass(cache)
    if tokens.shape[1] != 1 or not serves:
        raise ValueError("decode_first_pass: one token per sequence, with a certified model cache whose schedule "
                         f"has a rung-0 first pass {BRIDGE_SCHEDULES if rung0 else FIRST_PASS_SCHEDULES}")
    start = cache.lengths
    B = tokens.shape[0]
    valid, bad_valid = (jnp.ones((B,), jnp.int32), None) if valid_lengths is None else \
        checked_counts(valid_lengths, B, 1, "valid_lengths")
    new_lengths = start + valid
    cos, sin = rope_cos_sin(config, start[:, None])
    x = _embed(params, tokens)
    schedule = cache.schedule
    fast = cache.decode_fast_path(0)  # rung 0 alone (the straight schedules' own fast pass)
    if unrolled is None:
        unrolled = first_pass_unrolled()
    straight_line = schedule in ("straight", "two-pass") or (rung0 and unrolled)
    layers = _layers_unrolled if straight_line else _layers_looped_stacked
    x, c_fast = layers(params, config, x, fast, cos, sin, new_lengths)
    redo = _step_is_rare(c_fast, new_lengths)
    done = _common_step_done(c_fast, new_lengths).undo_step(redo, cache)
    return _final_hidden(params, config, x, new_lengths, cache.capacity, bad_valid), done, redo


def _slow_path_done(x: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    return x, cache.slow_path_done()


def _attention_inputs(layer: Params, config: LlamaConfig, x: jax.Array, cos: jax.Array, sin: jax.Array,
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The layer's q [B, T, Hq, d], k, v [B, T, Hkv, d] (RoPE applied) from x [B, T, D]."""
    B, T, _ = x.shape
    Hq, Hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
    q, k, v = _qkv(layer, h, config)
    q = apply_rope(q.reshape(B, T, Hq, d), cos, sin)
    k = apply_rope(k.reshape(B, T, Hkv, d), cos, sin)
    return q, k, v.reshape(B, T, Hkv, d)


def _attention_output_and_mlp(layer: Params, config: LlamaConfig, x: jax.Array, attn: jax.Array) -> jax.Array:
    """The rest of the layer: x + attn W_o, then the MLP block (attn [B, T, Hq, d])."""
    B, T, _ = x.shape
    x = x + _dot(attn.reshape(B, T, -1), layer["wo"])
    h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
    return x + _mlp(layer, h)


def _layer(layer: Params, config: LlamaConfig, x: jax.Array, cache: KVCache, i: int | jax.Array,
           cos: jax.Array, sin: jax.Array, new_lengths: jax.Array) -> tuple[jax.Array, KVCache]:
    """One transformer layer on x [B, T, D]; `i` (a Python int, or traced inside a loop over layers) picks the
    layer's cache."""
    q, k, v = _attention_inputs(layer, config, x, cos, sin)
    attn, cache = cache.attend(i, q, k, v, new_lengths)
    return _attention_output_and_mlp(layer, config, x, attn), cache


def _layers_unrolled(params: Params, config: LlamaConfig, x: jax.Array, cache: KVCache, cos: jax.Array,
                     sin: jax.Array, new_lengths: jax.Array) -> tuple[jax.Array, KVCache]:
    """Every layer in a Python loop: each layer's weights and cache are separate buffers, read in place."""
    for i, layer in enumerate(params["layers"]):
        x, cache = _layer(layer, config, x, cache, i, cos, sin, new_lengths)
    return x, cache


# Per backend, the layer-weight size (bytes) below which the looped schedule selects a layer's weights with one
# `lax.switch` (a copy) instead of computing inside per-layer switch branches (no copy, a second conditional).
# Measured: on the H200 (docs/performance.md, 2026-12-01) a conditional costs ~20 µs per step and a copy of W
# bytes ~2W / 3 TB/s, so copying wins below ~30 MB per layer (SmolLM2, 7 MB per layer: 170 tokens/s copying vs
# 142 in branches; 8B, 436 MB: 49.8 vs 68.6); on a 2-core CPU conditionals are cheap and copies are not
# (SmolLM2: 16.5 tokens/s copying vs 30.3 in branches), so never. Other backends: in branches.
COPY_WEIGHTS_BELOW_BYTES = SMALL_LAYER_BYTES  # the same dict: the cache's "auto" schedule reads it too
# How layers reach the looped body (CERTATTN_LOOPED_WEIGHTS). "stacked": small layers (below
# COPY_WEIGHTS_BELOW_BYTES) read row i of the stacked copy that `params_for_decoding` adds for certified caches
# (a copy, no conditional); "switch": small layers take their weights out of a `lax.switch` (a copy and a
# conditional per layer-step, each conditional a host round trip on the GPU: docs/performance.md, 2026-12-02 sixth
# session); "kernel": layers of any size read stacked, the GEMMs by `pallas_kernels.stacked_matmul` on row i in
# place (no copy, no conditional; large layers then hold their weights twice, per layer for the prefill and stacked
# for the decode loop: +5.8 GB peak at 8B). Large layers outside "kernel" compute in per-layer switch branches.
# "auto" (the default): "kernel" for small layers where the kernel compiles (a GPU; their stacked copy exists
# anyway), else "stacked". Measured on the H200 (nineteenth session, tuned kernel): SmolLM2 1K certified 355.4
# against 335.2 tokens/s stacked; 8B 8K 103.1 / 103.5 "kernel" against 98.6 "switch" (host round trips 67 -> 35),
# left opt-in for its memory.
LOOPED_WEIGHTS = ("auto", "stacked", "switch", "kernel")
_LOOPED_WEIGHTS = os.environ.get("CERTATTN_LOOPED_WEIGHTS", "auto").strip() or "auto"
if _LOOPED_WEIGHTS not in LOOPED_WEIGHTS:
    raise ValueError(f"CERTATTN_LOOPED_WEIGHTS={_LOOPED_WEIGHTS!r}: choose from {LOOPED_WEIGHTS}")


def looped_weights(params: Params | None = None) -> str:
    """How layers reach the looped body in this process (CERTATTN_LOOPED_WEIGHTS); with params, "auto" resolved
    for their layer size on this backend. Benchmarks record it."""
    return _LOOPED_WEIGHTS if params is None else _weights_mode(params)


def _weights_mode(params: Params) -> str:
    """CERTATTN_LOOPED_WEIGHTS for these params: "auto" resolved ("kernel" for small layers where the stacked-weight
    kernel compiles, else "stacked")."""
    if _LOOPED_WEIGHTS != "auto":
        return _LOOPED_WEIGHTS
    return "kernel" if _small_layers(params) and not pallas_backend.interpret() else "stacked"


def _small_layers(params: Params) -> bool:
    """Layers small enough (on this backend) that the looped schedule copies each layer's weights per step."""
    return max(_nbytes(w) for w in params["layers"]) < COPY_WEIGHTS_BELOW_BYTES.get(jax.default_backend(), 0)


def _nbytes(tree: Any) -> int:
    """Bytes of a pytree's arrays (tracers included: from shape and dtype)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _layers_looped(params: Params, config: LlamaConfig, x: jax.Array, cache: KVCache, cos: jax.Array,
                   sin: jax.Array, new_lengths: jax.Array, rare: bool = False) -> tuple[jax.Array, KVCache]:
    """Every layer in a `lax.fori_loop`: the cache's attention (the certified ladder) is compiled once. The
    cache must accept a traced layer index (TieredModelCache).

    How layer i's weights reach its GEMMs depends on their size and the backend (`COPY_WEIGHTS_BELOW_BYTES`):
      * large layers: the layer's dense parts run inside one `lax.switch` per layer over the layer index whose
        branch i computes with the weights it names (layer i's output projection and MLP after its attention,
        then layer i + 1's projections before the next one's), so every GEMM reads its weights in place (a
        switch that returned the weights copied them: 8.9 ms of a 20.1 ms 8B step on the H200; a loop over
        stacked weights copies each slice before its GEMM, 2.5x per step: results/probe_layer_loop_h200.json);
      * small layers on a GPU: row i of the stacked weights (`with_stacked_layers`, which `params_for_decoding`
        adds for a certified cache), read by index: a copy, and no conditional (`_layers_looped_stacked`); without
        the stacked copy (or with CERTATTN_LOOPED_WEIGHTS=switch), one `lax.switch` returns the layer's weights (a
        copy and a conditional, still cheaper there than a second conditional).
    rare: the loop runs on few steps (the second pass, when some head needs a rung above 1): large layers too take
    their weights out of one `lax.switch` (a copy of each layer's weights, ~0.3 ms per 8B layer, paid only on such
    steps), so the dense code is compiled once instead of once per layer (docs/performance.md, 2026-12-03).
    The attention is compiled once; the dense code once (stacked, or copied out of a switch) or once per layer in
    the branches."""
    layers = list(params["layers"])
    check_one_dtype_per_layer_weight(layers)
    small = _small_layers(params)
    # "kernel": any size (the GEMMs read row i in place); "stacked": small layers (row i copied)
    mode = _weights_mode(params)
    if STACKED_LAYERS in params and (mode == "kernel" or (small and mode == "stacked")):
        return _layers_looped_stacked(params, config, x, cache, cos, sin, new_lengths)
    if small or rare:  # one switch returns the layer's weights (a copy)
        pick = [lambda w=w: w for w in layers]

        def body(i, carry):
            x, cache = carry
            return _layer(jax.lax.switch(i, pick), config, x, cache, i, cos, sin, new_lengths)

        return jax.lax.fori_loop(0, len(layers), body, (x, cache))

    # One switch per layer, not two: branch i runs layer i's output projection and MLP and then layer i + 1's
    # projections (the loop is software-pipelined by one half-layer; layer 0's projections run before it, the
    # last branch returns zeros for the q, k, v no layer reads). Each switch is a host round trip on a GPU.
    q0, k0, v0 = _attention_inputs(layers[0], config, x, cos, sin)

    def post_then_pre(i: int) -> Callable:
        def branch(x, attn):
            x = _attention_output_and_mlp(layers[i], config, x, attn)
            if i + 1 == len(layers):
                return x, jnp.zeros_like(q0), jnp.zeros_like(k0), jnp.zeros_like(v0)
            return (x, *_attention_inputs(layers[i + 1], config, x, cos, sin))
        return branch

    branches = [post_then_pre(i) for i in range(len(layers))]

    def body(i, carry):
        x, q, k, v, cache = carry
        attn, cache = cache.attend(i, q, k, v, new_lengths)
        x, q, k, v = jax.lax.switch(i, branches, x, attn)
        return x, q, k, v, cache

    x, _, _, _, cache = jax.lax.fori_loop(0, len(layers), body, (x, q0, k0, v0, cache))
    return x, cache




def _stack_layer_weights(layers: Sequence[Params]) -> Params:
    """Per-layer weight dicts -> one dict of [L, ...] arrays."""
    return jax.tree.map(lambda *w: jnp.stack(w), *layers)


def with_stacked_layers(params: Params) -> Params:
    """params plus a stacked copy of the layer weights, `params["layers_stacked"]` (each weight [L, ...]), which
    the "straight-looped" and "adaptive" schedules read by index. Build it once, outside the decode loop
    (`params_for_decoding`; `generate` and the eval's loops do): a loop given only the per-layer weights stacks
    them on every step (476 µs per SmolLM2 step on the H200, traced; docs/performance.md, 2026-12-02). It costs
    the layer weights' bytes once more on the device. The copy is kept as it is when params already carry one:
    after changing params["layers"], drop it and build it again (`generate` refuses a copy that differs from the
    layers: `models.params.stale_stacked_layers`)."""
    if STACKED_LAYERS in params:
        return params
    return {**params, STACKED_LAYERS: jax.jit(_stack_layer_weights)(params["layers"])}


STACKED_SCHEDULES = ("straight-looped", "adaptive")  # schedules whose first pass reads small layers stacked

# Layers per iteration of the rung-0 first pass's loop over layers (`_layers_looped_stacked`), CERTATTN_LAYER_UNROLL.
# On a GPU the host drives the loop: each iteration is one command-buffer launch and update (H100 trace, SmolLM2
# 1K: 31.9 graph launches per certified step against dense's 1; docs/performance.md, twenty-fourth session).
# k layers per iteration cut those to ceil(L / k) at more compile; 1 (the default) until measured end to end
# (on 2026-12-02 it bought nothing, but then every layer also held a conditional, whose predicate read cost more).
LAYER_UNROLL: int = positive_int_from_env("CERTATTN_LAYER_UNROLL", 1)


def reads_stacked_weights(params: Params, cache: Any) -> bool:
    """Whether a decode loop over `cache` reads the stacked layer weights: every certified schedule's loops over
    small layers (`_small_layers`: on a GPU, below COPY_WEIGHTS_BELOW_BYTES; `_layers_looped` is the "looped"
    fast pass and every schedule's second pass; `_layers_looped_stacked` the `STACKED_SCHEDULES`' first pass).
    Large layers never: a stacked copy would double their memory and copy each layer's slice on every step."""
    if getattr(cache, "mode", None) != "certified":
        return False
    mode = _weights_mode(params)
    if mode == "kernel":  # every looped pass reads them, whatever their size
        return True
    if not _small_layers(params):
        return False  # large layers run in place, in per-layer switch branches (`_layers_looped`)
    return getattr(cache, "schedule", None) in STACKED_SCHEDULES or mode == "stacked"


def params_for_decoding(params: Params, cache: Any) -> Params:
    """params ready for a decode loop over `cache`: with the stacked layer weights when the loop reads them
    (`reads_stacked_weights`), built here once, outside the loop; else params unchanged."""
    return with_stacked_layers(params) if reads_stacked_weights(params, cache) else params


def _layers_looped_stacked(params: Params, config: LlamaConfig, x: jax.Array, cache: KVCache, cos: jax.Array,
                           sin: jax.Array, new_lengths: jax.Array) -> tuple[jax.Array, KVCache]:
    """Every layer in a `lax.fori_loop` whose body holds no conditional: layer i's weights are row i of the
    stacked weights (`with_stacked_layers`; stacked here when params lack them), read with a dynamic index. For
    the "straight-looped" schedule, whose attention at rung 0 has no conditional either (docs/performance.md,
    2026-12-02). Large layers without a stacked copy (`_small_layers` false: 8B-sized, or any on the CPU) run
    `_layers_looped`'s per-layer switch branches instead: copying a 436 MB layer every step costs far more than
    two conditionals. With CERTATTN_LOOPED_WEIGHTS=kernel the GEMMs read row i in place (`_row`, `StackedWeight`):
    no copy at any size."""
    check_one_dtype_per_layer_weight(params["layers"])
    stacked = params.get(STACKED_LAYERS)
    if stacked is None and not _small_layers(params):  # large layers: in place, in per-layer switch branches
        return _layers_looped(params, config, x, cache, cos, sin, new_lengths)
    if stacked is None:  # a caller's own loop without `params_for_decoding`: stacked on every call
        stacked = _stack_layer_weights(params["layers"])

    in_place = _weights_mode(params) == "kernel"

    def body(i, carry):
        x, cache = carry
        layer = {name: _row(name, w, i, in_place) for name, w in stacked.items()}
        return _layer(layer, config, x, cache, i, cos, sin, new_lengths)

    n = len(params["layers"])
    return jax.lax.fori_loop(0, n, body, (x, cache), unroll=min(LAYER_UNROLL, n))


_GEMM_WEIGHTS = ("wq", "wk", "wv", "wqkv", "wo", "w_gate", "w_up", "w_gate_up", "w_down")


def _row(name: str, w: jax.Array, i: jax.Array, in_place: bool) -> jax.Array | StackedWeight:
    """Layer i's weight `name` of the stacked weights: for a GEMM when in_place (the "kernel" weights mode) and the
    kernel tiles it here and can address it (`pallas_kernels.backend.arrays_fit`: 1-byte weights of 2-4 GiB
    cannot), the stacked array and i, multiplied in place by `_dot`; else the row (a copy)."""
    if (in_place and name in _GEMM_WEIGHTS and w.ndim == 3
            and stacked_kernel.supports(w.shape[1], w.shape[2]) and pallas_backend.arrays_fit(w)):
        return StackedWeight(w, i)
    return jax.lax.dynamic_index_in_dim(w, i, keepdims=False)


def logits_from_hidden(params: Params, config: LlamaConfig, hidden: jax.Array) -> jax.Array:
    """Project hidden states [..., D] to float32 logits [..., V] (tied embeddings when no lm_head)."""
    if config.tie_word_embeddings:
        w = params["embed"]
        return einsum_f32("...d,vd->...v", hidden, w.astype(hidden.dtype))
    return einsum_f32("...d,dv->...v", hidden, params["lm_head"].astype(hidden.dtype))


def forward(params: Params, config: LlamaConfig, tokens: jax.Array, cache: KVCache | None = None,
            *, valid_lengths: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Logits [B, T, V] (float32) for tokens [B, T], continuing from `cache` (a fresh dense cache of
    capacity T when None). Pure: returns the updated cache instead of mutating it."""
    tokens = jnp.asarray(tokens)
    if cache is None:
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
        cache = init_cache_for(params, config, tokens.shape[0], tokens.shape[1])
    hidden, cache = forward_hidden(params, config, tokens, cache, valid_lengths)
    return logits_from_hidden(params, config, hidden), cache


def init_params(config: LlamaConfig, key: jax.Array, dtype: Any = jnp.float32,
                scale: float = 0.02) -> Params:
    """Random parameters (normal(0, scale) matrices, unit norms) — for tests and benchmarks."""
    shapes = config.param_shapes()
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, shape in zip(keys, leaves, strict=True):
        if len(shape) == 1:
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
