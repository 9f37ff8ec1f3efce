"""The evaluation's model loops: chunked prefill, a teacher-forced decode loop and a greedy decode loop, each
one jit over `models.llama.forward_hidden` with ONE token per step, so that the cache under test (dense,
naive or certified: its decode path, not the exact prefill path) is what is measured.

Per-step records (certificates, and with `EvalCache(audit=True)` the true error of every head's output
against exact attention over tier 2) leave the jitted loop through `jax.experimental.io_callback` once per
step, into whatever `set_sink` installed (e.g. `audit.AuditCollector`): device memory does not grow with the
number of steps or the capacity.

Cache variants (`make_cache`):
  dense                 models' DenseKVCache (model dtype)
  naive, certified      certattn_jax's TieredModelCache
  naive-exact-values    tier-1 keys (INT8/INT4) with the exact tier-2 values  } ablation: which of the two
  naive-exact-keys      exact keys with tier-1 values (INT4/INT2)             } quantizations costs quality
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import io_callback

from certattn_jax import quant
from certattn_jax.kv_cache import commit_arrays
from certattn_jax.model_cache import TieredModelCache, convert_staging
from certattn_jax.policy import CertPolicy
from certattn_jax.step import dense_attention_f32, exact_keys_values, overlay_residual
from models.config import LlamaConfig
from models.decode_loop import token_or_marker
from models.llama import Params, forward_hidden, init_cache_for, logits_from_hidden, params_for_decoding

VARIANTS = ("dense", "naive", "certified", "naive-exact-values", "naive-exact-keys", "dense-reduce")
# Exact caches: "dense-reduce" is the dense cache attending with the other exact float32 implementation
# (`kv_cache.ATTENTION_IMPLS`, a different summation order). Dense vs dense-reduce is the measurement's noise
# floor: any change a bf16 model's perplexity shows between two exact attentions is not a cache's error.
EXACT_VARIANTS = ("dense", "dense-reduce")
TRACE_COUNTS: dict[str, int] = {"prefill": 0, "teacher": 0, "greedy": 0}


@struct.dataclass
class EvalCache:
    """A TieredModelCache with an optional decode-step override and an optional audit.

    inner:      the TieredModelCache (naive or certified mode)
    true_error: [L, B, Hq] float32, ||out - exact||_2 per query head at the last decode step (audit only),
                exact = float32 attention over the originals (tier 2 + residual) of the same layer cache
    exact_norm: [L, B, Hq] ||exact||_2 (to express errors relative to the output's size)
    variant:    "tiered" (the inner cache's own decode attention), "exact-values" or "exact-keys"
    audit:      compute true_error on decode steps
    """

    inner: TieredModelCache
    true_error: jax.Array
    exact_norm: jax.Array
    variant: str = struct.field(pytree_node=False, default="tiered")
    audit: bool = struct.field(pytree_node=False, default=False)

    @property
    def lengths(self) -> jax.Array:
        return self.inner.lengths

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def num_layers(self) -> int:
        return self.inner.num_layers

    @property
    def layers(self):
        return self.inner.layers

    @property
    def num_kv_heads(self) -> int:
        return self.inner.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.inner.head_dim

    @property
    def num_q_heads(self) -> int:
        return self.inner.num_q_heads

    @property
    def mode(self) -> str:
        """The inner cache's mode ("certified" | "naive"): `models.llama.params_for_decoding` reads it."""
        return self.inner.mode

    @property
    def schedule(self) -> str:
        """The inner cache's layer schedule: `models.llama.forward_hidden` reads it to run the fast pass in a loop
        over layers (without it the eval's fast pass was unrolled over every layer: the ~100 s certified compile
        on the H200, against ~14 s for `generate`'s loop; docs/performance.md)."""
        return self.inner.schedule

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
               new_lengths: jax.Array) -> tuple[jax.Array, EvalCache]:
        if q.shape[1] != 1 or self.variant == "tiered":
            out, inner = self.inner.attend(layer, q, k, v, new_lengths)
        else:
            base = self.inner.layer_view(layer)
            c = base.write_token(k, v, new_lengths > self.inner.lengths)
            out = _mixed_attention(q[:, 0], c, exact_values=self.variant == "exact-values")[:, None]
            inner = self.inner.with_layer(layer, c, base)
        new = self.replace(inner=inner)
        if self.audit and q.shape[1] == 1:
            c = inner.layer_view(layer).replace(lengths=new_lengths)  # (the stack records lengths after the step)
            kk, vv = exact_keys_values(c)
            ref = dense_attention_f32(q[:, 0], kk, vv, c.lengths)  # [B, Hq, d] float32
            err = jnp.sqrt(jnp.sum(jnp.square(out[:, 0].astype(jnp.float32) - ref), axis=-1))
            new = new.replace(true_error=self.true_error.at[layer].set(err),
                              exact_norm=self.exact_norm.at[layer].set(jnp.sqrt(jnp.sum(ref * ref, axis=-1))))
        return out, new

    def decode_fast_path(self, top_rung: int | None = None) -> EvalCache | None:
        """The inner cache's two-pass decode step (models.llama), where it has one (the tiered variant)."""
        if self.variant != "tiered":
            return None
        fast = self.inner.decode_fast_path(top_rung)
        return None if fast is None else self.replace(inner=fast)

    def wants_rung1_pass(self) -> jax.Array:
        return self.inner.wants_rung1_pass()

    def needs_slow_path(self) -> jax.Array:
        return self.inner.needs_slow_path()

    def fast_pass_result(self) -> EvalCache:
        return self.replace(inner=self.inner.fast_pass_result())

    def fast_path_done(self) -> EvalCache:
        return self.replace(inner=self.inner.fast_path_done())

    def slow_path_done(self) -> EvalCache:
        return self.replace(inner=self.inner.slow_path_done())

    def with_lengths(self, new_lengths: jax.Array, maintain: bool = True) -> EvalCache:
        return self.replace(inner=self.inner.with_lengths(new_lengths, maintain))

    def maintenance_due(self, new_lengths: jax.Array) -> jax.Array:
        return self.inner.maintenance_due(new_lengths)

    def step_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {}
        cert = self.inner.step_record()
        if not isinstance(cert, dict):
            rec["cert"] = cert
        if self.audit:
            rec["true_error"] = self.true_error
            rec["exact_norm"] = self.exact_norm
        return rec


def _mixed_attention(q: jax.Array, c, exact_values: bool) -> jax.Array:
    """Attention of q [B, Hq, d] with tier-1 keys and exact values (exact_values) or exact keys and tier-1
    values, the residual exact either way. Float32 softmax; returns q's dtype."""
    B, H, nb, Bk, _ = c.k_codes.shape
    d = c.head_dim
    k_ex, v_ex = exact_keys_values(c)
    if exact_values:
        k_hat = quant.dequantize_keys(c.k_codes, c.k_scale, c.k_zero, c.key_bits).reshape(B, H, nb * Bk, d)
        k, v = overlay_residual(k_hat, c.res_k, c.flushed, c.lengths), v_ex
    else:
        v_hat = quant.dequantize_values(c.v_codes, c.v_scale, c.v_zero, c.group_size, c.value_bits)
        k, v = k_ex, overlay_residual(v_hat.reshape(B, H, nb * Bk, d), c.res_v, c.flushed, c.lengths)
    return dense_attention_f32(q.astype(jnp.float32), k, v, c.lengths).astype(q.dtype)


def for_decode(variant: str, cache):
    """The cache the decode steps of `variant` run with, after a prefill with the one `make_cache` built: the
    dense-reduce control switches to the other attention implementation here (its prefill, exact in every mode,
    stays the dense one's: the reduce form of a prefill chunk would hold [T, S, d] products)."""
    return cache.replace(attn_impl="reduce") if variant == "dense-reduce" else cache


def make_cache(variant: str, params: Params, config: LlamaConfig, capacity: int, policy: CertPolicy | None = None,
               audit: bool = False, batch: int = 1, schedule: str | None = None):
    """A fresh cache of `variant` (see module docstring). audit needs a tiered variant. schedule: the tiered
    cache's layer schedule (`TieredModelCache.schedule`; default the library's)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown cache variant {variant!r}; choose from {VARIANTS}")
    if variant in EXACT_VARIANTS:
        if audit:
            raise ValueError("the audit compares a tiered cache with exact attention; the dense cache is exact")
        return init_cache_for(params, config, batch, capacity)  # dense-reduce: `for_decode` after the prefill
    mode = "certified" if variant == "certified" else "naive"
    inner = TieredModelCache.init(num_layers=config.num_layers, batch=batch, capacity=capacity,
                                  num_kv_heads=config.num_kv_heads, num_q_heads=config.num_heads,
                                  head_dim=config.head_dim, dtype=params["embed"].dtype, policy=policy, mode=mode,
                                  **({"schedule": schedule} if schedule else {}))
    shape = (config.num_layers, batch, config.num_heads)
    inner_variant = {"naive-exact-values": "exact-values", "naive-exact-keys": "exact-keys"}.get(variant, "tiered")
    return commit_arrays(EvalCache(inner=inner, true_error=jnp.zeros(shape, jnp.float32),
                                   exact_norm=jnp.zeros(shape, jnp.float32), variant=inner_variant,
                                   audit=audit))


# ---------------------------------------------------------------------------------------------- record sink
_SINK: dict[str, Callable[[int, dict[str, np.ndarray]], None] | None] = {"fn": None}


def set_sink(fn: Callable[[int, dict[str, np.ndarray]], None] | None) -> None:
    """Install the host function that receives (step, record) from the loops (None: drop records)."""
    _SINK["fn"] = fn


def _deliver(step, record) -> None:
    fn = _SINK["fn"]
    if fn is not None:
        fn(int(step), jax.tree.map(np.asarray, record))


def platforms_with_cpu(platforms: str | None) -> str | None:
    """The `jax_platforms` setting with "cpu" added where it names only accelerators ("cuda" -> "cuda,cpu").
    None / "" (JAX picks every platform it finds, CPU included) and lists that already hold "cpu" are returned
    unchanged. The accelerator stays first, so it stays the default device."""
    if not platforms:
        return platforms
    names = [p.strip() for p in platforms.split(",") if p.strip()]
    return platforms if "cpu" in names else ",".join([*names, "cpu"])


def ensure_host_callback_platform() -> None:
    """Make the records' `io_callback` possible: it places its operands on a CPU device, which JAX does not
    create under e.g. JAX_PLATFORMS=cuda ("failed to find a local CPU device" at the first step, measured on the
    H200). Adds "cpu" to `jax_platforms` when called before the first backend starts (the eval CLI does);
    afterwards `require_host_callback_device` explains the fix instead."""
    wanted = platforms_with_cpu(jax.config.jax_platforms)
    if wanted != jax.config.jax_platforms:
        jax.config.update("jax_platforms", wanted)


def require_host_callback_device() -> None:
    """Raise a clear error when JAX has no CPU device (the per-step records could not leave the loop)."""
    try:
        jax.local_devices(backend="cpu")
    except RuntimeError as e:
        raise RuntimeError(
            "the evaluation streams per-step records to the host through jax.experimental.io_callback, which "
            f"needs JAX's CPU backend; JAX_PLATFORMS={jax.config.jax_platforms!r} leaves it out. Set "
            "JAX_PLATFORMS=cuda,cpu (or leave it unset), or call "
            "certattn_jax.evals.decode.ensure_host_callback_platform() before JAX starts.") from e


def _emit(step: jax.Array, cache) -> None:
    rec = cache.step_record()
    if jax.tree.leaves(rec):
        require_host_callback_device()  # at trace time: a clear error instead of one inside the compiled loop
        io_callback(_deliver, None, step, rec, ordered=False)


# ---------------------------------------------------------------------------------------------- loops
@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def prefill_chunk(params: Params, config: LlamaConfig, cache, chunk: jax.Array, valid: jax.Array):
    """Write one prompt chunk [B, C] (first valid[b] tokens real); returns (cache, logits [B, V] at each row's
    last valid position of the chunk)."""
    TRACE_COUNTS["prefill"] += 1
    hidden, cache = forward_hidden(params, config, chunk, cache, valid)
    last = jnp.clip(valid - 1, 0, chunk.shape[1] - 1)
    rows = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return cache, logits_from_hidden(params, config, rows)


def prefill(params: Params, config: LlamaConfig, cache, ids: np.ndarray, chunk: int = 256):
    """Prefill token ids [T] (batch 1) in fixed-size chunks (the last one padded: one compile per chunk size).
    Returns (cache, logits [1, V] after the last token).

    A tiered cache (EvalCache) is prefilled like `models.generate.prefill` does it: into a dense staging cache
    of the same capacity (the dense path's own exact attention; one compiled chunk shared by every mode), then
    converted once (`model_cache.convert_staging`): no tier-2 read-back per chunk."""
    if isinstance(cache, EvalCache):
        staging, logits = prefill(params, config, init_cache_for(params, config, 1, cache.capacity), ids, chunk)
        return cache.replace(inner=convert_staging(staging, cache.inner)), logits
    ids = np.asarray(ids, np.int32).reshape(-1)
    if ids.size == 0:
        raise ValueError("prefill needs at least one token")
    logits = None
    for s in range(0, ids.size, chunk):
        part = ids[s:s + chunk]
        buf = np.zeros((1, chunk), np.int32)
        buf[0, :part.size] = part
        cache, logits = prefill_chunk(params, config, cache, jnp.asarray(buf), jnp.asarray([part.size], jnp.int32))
    return cache, logits


@functools.partial(jax.jit, static_argnames=("config", "stream"), donate_argnames=("cache",))
def teacher_forced(params: Params, config: LlamaConfig, cache, inputs: jax.Array, targets: jax.Array,
                   stream: bool = False):
    """Feed inputs [B, S] one token per decode step; returns (nll [B, S] float32 of targets [B, S] under the
    step's logits, argmax-correct [B, S] bool, cache). With stream, each step's record goes to the sink."""
    TRACE_COUNTS["teacher"] += 1
    params = params_for_decoding(params, cache)  # once per call, outside the loop over steps

    def body(cache, xs):
        step, tok, tgt = xs
        hidden, cache = forward_hidden(params, config, tok[:, None], cache)
        logits = logits_from_hidden(params, config, hidden[:, 0])
        nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, tgt[:, None], axis=-1)[:, 0]
        if stream:
            _emit(step, cache)
        return cache, (nll, jnp.argmax(logits, axis=-1) == tgt)

    steps = jnp.arange(inputs.shape[1], dtype=jnp.int32)
    cache, (nll, ok) = jax.lax.scan(body, cache, (steps, inputs.T, targets.T))
    return nll.T, ok.T, cache


def _token_or_marker(logits: jax.Array) -> jax.Array:
    """argmax of logits [B, V] (int32 [B]), NONFINITE_TOKEN where a row holds a NaN / Inf (`token_or_marker`, the
    decode loop's; no EOS here). The marker is fed back as the next input only for a row that is garbage already;
    `Session.generate` raises on it."""
    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return token_or_marker(nxt, logits, jnp.zeros(nxt.shape, bool))[0]


@functools.partial(jax.jit, static_argnames=("config", "num_steps", "stream"), donate_argnames=("cache",))
def greedy(params: Params, config: LlamaConfig, cache, first_logits: jax.Array, num_steps: int,
           stream: bool = False):
    """Greedy decoding: the first token from first_logits [B, V], then num_steps - 1 decode steps.
    Returns (tokens [B, num_steps] int32, NONFINITE_TOKEN from a step whose logits held a NaN / Inf on, cache).
    No early stop: callers cut at EOS (fixed shapes)."""
    TRACE_COUNTS["greedy"] += 1
    params = params_for_decoding(params, cache)  # once per call, outside the loop over steps
    tok0 = _token_or_marker(first_logits)

    def body(carry, step):
        cache, tok = carry
        hidden, cache = forward_hidden(params, config, tok[:, None], cache)
        nxt = _token_or_marker(logits_from_hidden(params, config, hidden[:, 0]))
        if stream:
            _emit(step, cache)
        return (cache, nxt), nxt

    (cache, _), toks = jax.lax.scan(body, (cache, tok0), jnp.arange(num_steps - 1, dtype=jnp.int32))
    return jnp.concatenate([tok0[:, None], toks.T], axis=1), cache
