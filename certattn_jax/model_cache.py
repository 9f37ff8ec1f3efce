"""The one place that decides a model's KV cache, and TieredModelCache.

    spec = cache_spec(mode, config, dtype, policy)     # mode in CACHE_MODES: "dense" | "naive" | "certified"
    cache = spec(batch, capacity)                      # an empty cache (DenseKVCache or TieredModelCache)
    staging = spec.staging(batch, capacity)            # where a prompt is prefilled (a DenseKVCache)
    cache = spec.from_staging(staging)                 # ... then converted once into the mode's cache

`models.llama.init_cache`, `models.generate.generate` and the CLI all build caches through `cache_spec`.

TieredModelCache: a whole model's tiered KV cache behind the KVCache interface, so the LLaMA and the decode
loop run with `dense | naive | certified` caches alike. It holds one *stacked* TieredKVCache (a leading layer
axis on every array) so that a loop over layers (`lax.fori_loop`, a traced layer index) can address it: the
certified decode step's rarely-taken rungs are compiled once, in such a loop, instead of once per layer
(`models.llama`, docs/performance.md).

Decode steps (one new token) use the cache mode's attention -- certified (with a Certificate per layer,
kept in `last_certificate` and returned by `step_record()`) or naive. Prefill chunks (several tokens) attend
exactly over the originals (tier 2 + residual) in every mode: certificates are about decoding. That path reads
all of tier 2 back per chunk; `generate` avoids it by prefilling a dense staging cache with the dense path's
attention and converting it once (`CacheSpec.from_staging`: eagerly in groups of layers, one program per group
(the program's outputs are the stacked cache where one group holds every layer, else each group is written in
place into it), tier 1 quantized and the originals copied to the host; inside a trace
`TieredModelCache.from_dense`, every layer in one program). The new
token goes into each layer's exact residual block without flushing; `with_lengths` (called once per step,
after the last layer) applies pending hot-set blocks and flushes every layer's full residual block at once, both
under one outer lax.cond.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from certattn_jax import kernel_checks, tiers
from certattn_jax.attention import (
    certified_attention_fast,
    certified_attention_step,
    exact_keys_values,
    naive_attention,
)
from certattn_jax.cache import (
    DEVICE_FIELDS,
    STACK_TRACKED_FIELDS,
    TieredKVCache,
    checked_layer,
    conversion_layout,
    converts_all_layers_batched,
)
from certattn_jax.certificate import PACKED_FIELDS, Certificate, empty_like_heads, pack, unpack
from certattn_jax.dense_cache import DenseKVCache
from certattn_jax.env import positive_int_from_env
from certattn_jax.kv_cache import (
    KVCache,
    check_capacity,
    commit_arrays,
    committed_jit,
    is_concrete,
    masked_attention,
    was_donated,
)
from certattn_jax.policy import CertPolicy
from certattn_jax.validate import checked_counts, host_checked_counts, is_integer

CACHE_MODES = ("dense", "naive", "certified")  # the one list of cache modes (the CLI's --cache choices)
MODES = CACHE_MODES[1:]  # the tiered ones
# TieredModelCache.schedule: the concrete layer schedules, and "auto" (the default), which a cache resolves when
# it is built: per backend, the schedule measured fastest there (`AUTO_SCHEDULE`; docs/performance.md, 2026-12-02
# seventh session: on the H200 "adaptive" decodes rung-0 steps 1.2x faster than "looped" and rung-1 steps as
# fast; on a CPU conditionals cost no host round trip and "looped" compiles ~30 % faster)
SCHEDULES = ("looped", "two-pass", "straight", "straight-looped", "adaptive", "unrolled")
SCHEDULE_CHOICES = ("auto",) + SCHEDULES
DEFAULT_SCHEDULE = "auto"
AUTO_SCHEDULE = {"gpu": "adaptive"}  # backend -> schedule; other backends "looped"
# Per backend, the layer-weight size (bytes) below which a layer counts as small: the looped schedules read small
# layers' weights from a stacked copy by index and large ones in place, inside per-layer switch branches
# (`models.llama._layers_looped`). For large layers "auto" is "looped": "adaptive"'s extra first pass compiles every
# layer's dense code once more (the 8B shape on the H200, one call: decode compile 22.0 s against 11.8 s looped,
# for 13 % more tokens/s where every head stays at rung 0; docs/performance.md, 2026-12-03). On a 2-core CPU
# copies cost more than conditionals: no layer is small there.
SMALL_LAYER_BYTES = {"gpu": 32 << 20, "cpu": 0}
# Backends where a naive cache's decode step loops over its layers (`models.llama._layers_looped`: the INT attention
# compiled once, each layer's dense code in its own switch branch) instead of unrolling them. On the 2-core CPU
# (SmolLM2 shapes, 256-token prompt, 32 new tokens, three runs each): decode compile 10.1-10.9 s unrolled against
# 3.3-3.5 s looped, decode 26.8-27.8 against 28.6-29.7 tokens/s (docs/performance.md, twentieth session). On a GPU
# the per-layer conditional is a host round trip and the unrolled layers read their weights in place: unrolled.
NAIVE_LOOPED_BACKENDS = frozenset({"cpu"})


def resolve_schedule(schedule: str, layer_bytes: int | None = None) -> str:
    """The concrete layer schedule that `schedule` names on this process's default backend; a concrete name is
    returned as is, unknown names raise. "auto": "looped" for layers of `layer_bytes` (one layer's weights, when
    known) at or above `SMALL_LAYER_BYTES`, else `AUTO_SCHEDULE` (else "looped")."""
    if schedule not in SCHEDULE_CHOICES:
        raise ValueError(f"unknown layer schedule {schedule!r}; choose from {SCHEDULE_CHOICES}")
    if schedule != "auto":
        return schedule
    backend = jax.default_backend()
    if layer_bytes is not None and layer_bytes >= SMALL_LAYER_BYTES.get(backend, 0):
        return "looped"
    return AUTO_SCHEDULE.get(backend, "looped")


def layer_weight_bytes(config: Any, dtype: Any) -> int:
    """One decoder layer's weight bytes for a LLaMA-like config (q, k, v, o projections, the gated MLP, two norms)
    stored in `dtype`."""
    d, hd = config.hidden_size, config.head_dim
    attn = d * hd * (2 * config.num_heads + 2 * config.num_kv_heads)
    return (attn + 3 * d * config.intermediate_size + 2 * d) * jnp.dtype(dtype).itemsize


@struct.dataclass
class TieredModelCache:
    """A whole model's tiered cache: one *stacked* TieredKVCache (every array with a leading layer axis L).

    store:            the stacked TieredKVCache (tier 2 [L, B, H, nb, Bk, d] in pinned host memory)
    lengths:          [B] valid tokens (the model's; every layer holds the same)
    cert_packed:      [L, B, Hq, 9] float32, the last decode step's certificates (`certificate.pack`: one write
                      per layer); `last_certificate` is the Certificate with [L, B, Hq] leaves
    rung0_streak:     int32 scalar, decode steps in a row, up to the last, that answered every head at rung 0
                      (saturating); the "adaptive" schedule's predictor. Counted by the schedules with a fast
                      pass (all but "unrolled")
    slow_steps:       int32 scalar, decode steps since the cache was built that the whole ladder answered (the
                      second pass of a two-pass schedule): benchmarks and users read what the fast pass missed
    policy:           CertPolicy (tolerances are leaves: changing them does not recompile)
    mode:             "certified" | "naive" (static)
    fast:             static; True while a decode step runs its fast pass (rungs 0-1 only, see `models.llama`)
    schedule:         static; how a certified decode step runs the layers (`models.llama`, docs/performance.md):
                      "looped" (the default on a CPU) every layer at rungs 0-1 in a loop over layers, then, only
                      if some head needs more, the step again from its start with the whole ladder, in the same
                      kind of loop:
                      two layer bodies are compiled whatever the depth; small layers (on a GPU) are read from a
                      stacked copy of the weights by index, large ones in place inside per-layer switch branches
                      (`models.llama._layers_looped`);
                      "two-pass" the same, but the fast pass unrolled (the weights read in place; compiles
                      rungs 0-1 once per layer);
                      "straight" as "two-pass", but the fast pass answers at rung 0 only: it holds no conditional
                      at all (straight-line code that CUDA graphs can capture whole); a head that needs rung 1
                      sends the step to the second pass (docs/performance.md, 2026-12-01 fifth session: the
                      certified step keeps the GPU busy only 1.9 of its 5 ms);
                      "straight-looped" as "straight", but the rung-0 fast pass in a loop over layers (compiled once,
                      like "looped"), each layer's weights taken from a stacked copy by index (no `lax.switch`), so
                      the loop body holds no conditional either: a while loop that command buffers may capture;
                      "adaptive" (the default on a GPU) per step, "straight-looped" after
                      `adaptive_rung0_streak()` decode steps in a row
                      that answered every head at rung 0, else "looped" (one conditional on `rung0_streak`): on
                      text where rung 1 is common it does not pay for a rung-0 pass that will be redone (a miss
                      costs a whole second pass); it compiles three layer bodies;
                      "unrolled" one pass, the whole ladder inlined in every layer (the reference; slow to compile).
                      Built with "auto" (the default), a cache holds the schedule measured fastest on the
                      backend (`resolve_schedule`; docs/performance.md, 2026-12-02 seventh session): on the H200
                      "adaptive" decodes 1.2x faster than "looped" where every head stays at rung 0 and as fast
                      on real text (SmolLM2-135M-Instruct, 2K: 4.14 vs 4.11 ms per step).

    `attend(layer, ...)` accepts a Python int or a traced layer index (a loop over layers): it works on a *layer
    view* (`layer_view`) and writes back only the fields the step changed (`with_layer`).
    """

    store: TieredKVCache
    lengths: jax.Array
    cert_packed: jax.Array  # [L, B, Hq, 9] float32 (certificate.pack)
    policy: CertPolicy  # tolerances are leaves: changing them does not recompile the decode loop
    mode: str = struct.field(pytree_node=False, default="certified")
    fast: bool = struct.field(pytree_node=False, default=False)
    fast_top_rung: int = struct.field(pytree_node=False, default=1)  # the fast pass's highest rung (0 or 1)
    schedule: str = struct.field(pytree_node=False, default=DEFAULT_SCHEDULE)
    rung0_streak: jax.Array = None  # int32 scalar (set by `_wrap`)
    slow_steps: jax.Array = None  # int32 scalar (set by `_wrap`)

    @classmethod
    def init(cls, *, num_layers: int, batch: int, capacity: int, num_kv_heads: int, num_q_heads: int,
             head_dim: int, dtype: Any = jnp.bfloat16, policy: CertPolicy | None = None,
             mode: str = "certified", schedule: str = DEFAULT_SCHEDULE) -> TieredModelCache:
        if mode not in MODES:
            raise ValueError(f"unknown tiered cache mode {mode!r}; choose from {MODES}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        policy = policy or CertPolicy()
        store = TieredKVCache.init(batch=batch, capacity=capacity, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                   dtype=dtype, policy=policy, layers=num_layers)
        return cls._wrap(store, jnp.zeros((batch,), jnp.int32), num_q_heads, policy, mode, schedule)

    @classmethod
    def _wrap(cls, store: TieredKVCache, lengths: jax.Array, num_q_heads: int, policy: CertPolicy,
              mode: str, schedule: str = DEFAULT_SCHEDULE, converted_with: Any = None) -> TieredModelCache:
        """The model cache of a stacked store whose sequences hold lengths [B] tokens (copied). converted_with: the
        lengths [B] the store was converted with, where the caller gave them (`from_dense`'s lengths); a sequence
        whose two lengths differ is poisoned (never certified: its tier 1 masks other tokens than it holds)."""
        schedule = resolve_schedule(schedule)
        lengths, cert, policy, rung0_streak, slow_steps, nonfinite = _fresh_model_arrays(
            lengths, policy, None if converted_with is None else store.nonfinite, converted_with,
            layers=store.k_codes.shape[0], heads=num_q_heads)
        if nonfinite is not None:
            store = store.replace(nonfinite=nonfinite)
        return commit_arrays(cls(store=store, lengths=lengths, cert_packed=cert, policy=policy, mode=mode,
                                 schedule=schedule, rung0_streak=rung0_streak, slow_steps=slow_steps))

    @classmethod
    def from_dense(cls, dense: DenseKVCache, *, num_q_heads: int, policy: CertPolicy | None = None,
                   mode: str = "certified", schedule: str = DEFAULT_SCHEDULE, lengths: Any = None) -> TieredModelCache:
        """Convert a (prefilled) dense cache: eagerly in groups of layers (`TieredKVCache.stacked_from_layers`), inside
        a trace every layer in one program (`stacked_from_head_major`); the originals go to tier 2, nothing is read
        back. The dense cache's capacity must be a multiple of the policy's block size. Works eagerly and in jit.

        lengths: optionally dense.lengths [B] as the caller knows them on the host (a list or NumPy array; `prefill`
        knows its prompts' lengths). Eagerly, checking dense.lengths reads them back from the device, which waits
        for everything queued before (the prefill) before the conversion can even be dispatched; given lengths are
        checked on the host instead (out of [0, S]: ValueError), and the conversion masks by dense.lengths on the
        device (clipped to [0, S]), never read back. A sequence whose dense.lengths differ from the given ones is
        poisoned on the device (marked non-finite: never certified; its heads are answered exactly, from the tokens
        the cache holds, by the ladder's top rungs)."""
        if mode not in MODES:
            raise ValueError(f"unknown tiered cache mode {mode!r}; choose from {MODES}")
        policy = policy or CertPolicy()
        if num_q_heads % dense.k[0].shape[1]:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {dense.k[0].shape[1]}")
        B, S = dense.k[0].shape[0], dense.capacity
        # given lengths are only checked (on the host) and compared (on the device): the conversion masks by the
        # cache's own, so a poisoned sequence's exact rungs answer from the tokens it holds (masked by given ones,
        # tier 2 and the residual lacked or invented tokens: logits off by ~20, review 2026-12-07 38th)
        given = None
        if lengths is not None and not isinstance(lengths, jax.core.Tracer):
            # checked on the host and kept there (NumPy): the programs below take it in their own transfer
            given = host_checked_counts(lengths, B, S, "lengths")  # raises outside [0, S]
        elif lengths is not None:
            given, out_of_range = checked_counts(lengths, B, S, "lengths")
            given = jnp.where(out_of_range, -1, given)  # such a sequence is poisoned (-1 never equals a length)
        if is_concrete(dense.lengths) and is_concrete(dense.k[0]):  # eagerly: in groups of layers, in place
            # with given lengths, the cache's own are never read back: the conversion clips them on the device
            store = TieredKVCache.stacked_from_layers(dense.k, dense.v, dense.lengths, policy,
                                                      checked=given is not None)
        else:  # traced: every layer in one program
            store = TieredKVCache.stacked_from_head_major(jnp.stack(dense.k), jnp.stack(dense.v), dense.lengths,
                                                          policy)
        # _wrap copies the lengths: the staging cache's own array would be lost with it when a decode step donates
        # this cache (converting the same prefill again then failed on a deleted array)
        return cls._wrap(store, dense.lengths, num_q_heads, policy, mode, schedule, converted_with=given)

    @classmethod
    def from_layers(cls, layers: Sequence[TieredKVCache], *, num_q_heads: int, policy: CertPolicy | None = None,
                    mode: str = "certified", schedule: str = DEFAULT_SCHEDULE) -> TieredModelCache:
        """A model cache from per-layer caches (e.g. `TieredKVCache.from_dense` of existing K/V), which must agree
        in shape and lengths. Their arrays are copied into the stacked form (tier 2 stays in host memory)."""
        if mode not in MODES:
            raise ValueError(f"unknown tiered cache mode {mode!r}; choose from {MODES}")
        layers = tuple(layers)
        if not layers:
            raise ValueError("from_layers needs at least one layer")
        policy = policy or CertPolicy()
        first = layers[0]
        shape = (first.batch, first.num_kv_heads, first.num_blocks, first.head_dim, first.dtype)
        for i, c in enumerate(layers):
            c.check_policy(policy)
            if c.layer is not None or c.stacked:
                raise ValueError(f"layer {i} is a view of a model cache; pass single-layer caches")
            mine = (c.batch, c.num_kv_heads, c.num_blocks, c.head_dim, c.dtype)
            if mine != shape:
                raise ValueError(f"layer {i} has (batch, kv heads, blocks, head_dim, dtype) {mine}, layer 0 {shape}")
            if is_concrete(c.lengths) and is_concrete(first.lengths) and not bool(jnp.all(c.lengths == first.lengths)):
                raise ValueError(f"layer {i} holds lengths {c.lengths.tolist()}, layer 0 {first.lengths.tolist()}")
            if is_concrete(c.flushed) and is_concrete(first.flushed) and not bool(jnp.all(c.flushed == first.flushed)):
                raise ValueError(f"layer {i} has flushed {c.flushed.tolist()}, layer 0 {first.flushed.tolist()}")
        if num_q_heads % first.num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {first.num_kv_heads}")
        store = _stack_layers(layers)
        return cls._wrap(store, first.lengths, num_q_heads, policy, mode, schedule)

    @property
    def capacity(self) -> int:
        return self.store.capacity

    @property
    def num_layers(self) -> int:
        return self.store.k_codes.shape[0]

    def with_policy(self, policy: CertPolicy) -> TieredModelCache:
        """This cache under another policy of the same layout (e.g. `cache.policy.replace(eps=0.01)`): its tolerances
        held as `owned_policy` holds them, so a jitted decode step that ran on this cache runs on the new one
        without compiling again (`cache.replace(policy=...)` with Python floats would compile once more)."""
        self.store.check_policy(policy)
        return self.replace(policy=owned_policy(policy))

    def with_sequences(self, start: int, part: TieredModelCache) -> TieredModelCache:
        """This cache with sequences [start, start + n) replaced by `part`'s n sequences: every layer's tier 1, hot
        set, residual, statistics and certificates, tier 2 in host memory, and the lengths. `part` must hold
        arrays of this cache's per-sequence shapes and dtypes (layers, KV and query heads, capacity, block and
        group size, bits, hot slots) in the same mode and schedule, e.g. a few prompts prefilled and converted on
        their own, or a finished row's replacement. Eager, with start a Python int; this cache is donated
        (consumed) and written in place, so a batch can be built a few sequences at a time without a dense staging
        cache for the whole batch (`models.generate.prefill`'s `staging_batch`). The step counters (`rung0_streak`,
        `slow_steps`) and the tolerances stay this cache's."""
        if not isinstance(part, TieredModelCache):
            raise TypeError(f"with_sequences takes a TieredModelCache, got {type(part).__name__}")
        _check_start_and_donation("with_sequences", start, (("this cache", self), ("the part", part)))
        mine = {id(x) for x in jax.tree.leaves(self)}
        if any(id(x) in mine for x in jax.tree.leaves((part.store, part.lengths, part.cert_packed))):
            raise ValueError("with_sequences: the part shares arrays with this cache (which is donated and written "
                             "in place): pass a cache of its own")
        differ = []
        for what, a, b in zip(_SEQUENCE_LAYOUT, _sequence_layout(self), _sequence_layout(part), strict=True):
            if a != b and what.startswith("per-sequence"):  # name the arrays that differ, not all of them
                pairs = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
                a, b = [x for x, _ in pairs], [y for _, y in pairs]
            if a != b:
                differ.append(f"{what}: {a} here, {b} in the part")
        if differ:
            raise ValueError("with_sequences: the part does not fit this cache's sequences: " + "; ".join(differ))
        B, n = self.store.batch, part.store.batch
        if not 0 <= start <= B - n:
            raise ValueError(f"with_sequences: start {start} with {n} sequences does not fit a batch of {B}")
        tiers.check_on_host(self.store.host_k, self.store.host_v, part.store.host_k, part.store.host_v)
        with tiers.shared_buffers_named("with_sequences"):
            return _put_sequences(self, part.store, part.lengths, part.cert_packed, jnp.int32(start))

    def with_staged_sequences(self, start: int, staging: DenseKVCache) -> TieredModelCache:
        """This cache with sequences [start, start + n) converted from a prefilled dense staging cache of n
        sequences (`CacheSpec.staging`, `DenseKVCache`): in groups of layers (`cache.conversion_group_layers`),
        straight into this cache's rows, tier 2 from the device into its rows of host memory. The result is
        `with_sequences(start, spec.from_staging(staging))`'s, without the part's tiered copy: the device holds this
        cache, the staging K/V and one group's conversion temporaries. The rows' certificates start empty, as a
        converted cache's do; the step counters (`rung0_streak`, `slow_steps`) and the tolerances stay this
        cache's. Every layer of `staging` is checked before the first is written. Eager, start a Python int; this
        cache is donated (consumed). Drop `staging` afterwards to free its device memory
        (`models.generate.prefill`'s `staging_batch` does this per group)."""
        if not isinstance(staging, DenseKVCache):
            raise TypeError(f"with_staged_sequences takes a DenseKVCache (a prefilled staging cache), got "
                            f"{type(staging).__name__}")
        _check_start_and_donation("with_staged_sequences", start,
                                  (("this cache", self), ("the staging cache", staging)))
        if not all(is_concrete(x) for x in (staging.lengths, *staging.k, *staging.v, self.lengths)):
            raise ValueError("with_staged_sequences is eager only (a traced cache)")
        k0 = staging.k[0]
        mine = (self.num_layers, self.num_kv_heads, self.capacity, self.head_dim, str(jnp.dtype(self.store.dtype)))
        theirs = (staging.num_layers, k0.shape[1], k0.shape[2], k0.shape[3], str(k0.dtype))
        if mine != theirs:
            raise ValueError(f"with_staged_sequences: the staging cache holds (layers, KV heads, capacity, head_dim, "
                             f"dtype) = {theirs}; this cache {mine}")
        B, n = self.store.batch, k0.shape[0]
        if not 0 <= start <= B - n:
            raise ValueError(f"with_staged_sequences: start {start} with {n} sequences does not fit a batch of {B}")
        tiers.check_on_host(self.store.host_k, self.store.host_v)
        store = self.store.with_rows_converted(int(start), staging.k, staging.v, staging.lengths)
        lengths = self.lengths.at[start:start + n].set(jnp.asarray(staging.lengths, jnp.int32))
        empty = pack(empty_like_heads(n, self.num_q_heads))
        cert = self.cert_packed.at[:, start:start + n].set(jnp.broadcast_to(empty, (self.num_layers,) + empty.shape))
        return commit_arrays(self.replace(store=store, lengths=lengths, cert_packed=cert))

    def with_tier2_on_host(self) -> TieredModelCache:
        """This cache with tier 2 moved back to host memory (after pickle, device_get/device_put or a generic
        checkpoint restore put it on the device); the cache itself where it is there already."""
        return self.replace(store=self.store.with_tier2_on_host())

    @property
    def num_kv_heads(self) -> int:
        return self.store.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.store.head_dim

    @property
    def num_q_heads(self) -> int:
        return self.cert_packed.shape[-2]

    @property
    def layers(self) -> tuple[TieredKVCache, ...]:
        """Every layer's view (see `layer_view`)."""
        return tuple(self.layer_view(i) for i in range(self.num_layers))

    def layer_view(self, layer: int | jax.Array) -> TieredKVCache:
        """Layer `layer`'s cache: its device arrays (sliced), the whole stacked tier 2 and the layer index (tier-2
        transfers slice the layer themselves). A full TieredKVCache: read it, attend with it, write it back with
        `with_layer`."""
        s = self.store
        layer = checked_layer(layer, self.num_layers)  # the view's `layer` is what the kernels read in place
        # stack: the stacked arrays, for the Pallas tier-1 pass to read this layer in place (a slice feeding a
        # kernel launch is a copy of the layer's tier 1; jnp consumers fuse the slices below instead), and for
        # the ladder's rung-1 branch to slice what it reads inside the branch (`TieredKVCache.resliced`)
        return s.replace(**{f: _layer_of(getattr(s, f), layer) for f in DEVICE_FIELDS},
                         layer=jnp.asarray(layer, jnp.int32), stack={f: getattr(s, f) for f in DEVICE_FIELDS})

    def with_layer(self, layer: int | jax.Array, view: TieredKVCache,
                   base: TieredKVCache | None = None) -> TieredModelCache:
        """This cache with layer `layer` replaced by `view`; with `base` (the view it was derived from), fields the
        caller did not change are not written back (so a decode step writes its residual token, running range and
        hot set, never the layer's tier 1)."""
        s = self.store
        updates = {}
        for f in DEVICE_FIELDS:
            if base is not None and getattr(view, f) is getattr(base, f):
                continue
            if base is not None and _stack_updated(view, base, f, getattr(s, f)):
                updates[f] = view.stack[f]  # already the whole model's array: no read and write of the row
            else:
                updates[f] = _set_layer(getattr(s, f), layer, getattr(view, f))
        return self.replace(store=s.replace(**updates, host_k=view.host_k, host_v=view.host_v))

    def attend(self, layer: int | jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               new_lengths: jax.Array) -> tuple[jax.Array, TieredModelCache]:
        """Layer `layer`'s attention of q [B, T, Hq, d] over its cache with k, v [B, T, Hkv, d] appended: (out
        [B, T, Hq, d], the cache with the layer written back). A decode step (T = 1) leaves the layers' recorded
        lengths (and `lengths`) to `with_lengths`, which the model calls after its last layer: between the two, a
        layer view still reports the step's starting length."""
        check_capacity(self.lengths, new_lengths, self.capacity)
        tiers.check_on_host(self.store.host_k, self.store.host_v)
        layer = checked_layer(layer, self.num_layers)  # -1: the last layer for every consumer (kernels clip)
        base = self.layer_view(layer)
        T = q.shape[1]
        cert = self.cert_packed
        model = self
        if T == 1:
            # the token goes into the stacked residual first; the attention then works on a fresh view of it, so
            # that the kernels read the layer's residual (like its tier 1 and hot set) in place. The layer's new
            # length stays in the view: `with_lengths` records every layer's at once after the last layer (one
            # write per step instead of one per layer-step). A sequence whose length does not grow (new_lengths ==
            # lengths: it stopped, and the batch decodes on) takes no token: its query attends its tokens as they
            # are, and its residual, running statistics and flag stay as they were
            active = new_lengths > self.lengths
            if self.store.writes_token_by_kernel(k.dtype):  # one launch, in place (a GPU)
                model = self.replace(store=self.store.write_layer_token(layer, k, v, active))
            else:
                written = base.write_token(k, v, active)
                model = self.with_layer(layer, written.replace(lengths=base.lengths), base)
            base = c = model.layer_view(layer).replace(lengths=base.lengths + active.astype(jnp.int32))
            if self.mode == "certified":
                if self.fast:  # a head that escalates says so in its certificate (`needs_slow_path`)
                    out, step_cert, c, _ = certified_attention_fast(q[:, 0], c, self.policy, self.fast_top_rung)
                else:
                    out, step_cert, c = certified_attention_step(q[:, 0], c, self.policy)
                cert = _set_layer(cert, layer, pack(step_cert))
            else:
                out = naive_attention(q[:, 0], c, self.policy)
            out = out[:, None]
        else:
            c = base.append(k, v, new_lengths - self.lengths)
            k_all, v_all = exact_keys_values(c)
            q_pos = self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
            out = masked_attention(q, k_all, v_all, q_pos, new_lengths)
        new = model.with_layer(layer, c, base)
        return out, new.replace(cert_packed=cert)

    def with_lengths(self, new_lengths: jax.Array, maintain: bool = True) -> TieredModelCache:
        """After the last layer: make resident the blocks rung 1 asked for in any layer (`hot_pending`), then
        flush every layer's full residual block at once (one batched quantization) and record the new lengths.

        Both are rare (a flush every block_size steps, pending blocks only after a rung 1), so they sit under
        one outer lax.cond: on a GPU each conditional is a host round trip, and the common step pays one here
        instead of two (each inner conditional runs only inside the taken branch). maintain=False records the
        lengths only: for a caller that knows `maintenance_due` is False (the decode step's common branch, whose
        own conditional already asked it) and whose lengths grow by construction (start + 0 or 1): it skips the
        shrink guard below, which costs a write of the non-finite flags.

        Lengths only grow: the blocks, hot set and running statistics hold every token written, so a shorter
        length would leave them describing tokens no longer there (an audit rewound past a flushed block and got
        logits off by 2-11 with every head certified). Shrinking raises outside jit; inside jit it marks those
        sequences non-finite (never certified again) and leaves their lengths as they were. To go back, keep the
        earlier cache value (an immutable pytree; do not donate it)."""
        if not maintain:  # the decode step's common branch: its lengths grow by construction
            return self.replace(store=self._recorded(new_lengths), lengths=new_lengths.astype(jnp.int32))
        shrink = new_lengths < self.lengths
        if is_concrete(new_lengths) and is_concrete(self.lengths):
            # numpy: inside a traced loop body (a looped schedule called eagerly) a jnp op on concrete values is
            # staged, and its result cannot be read
            back = np.flatnonzero(np.asarray(new_lengths) < np.asarray(self.lengths)).tolist()
            if back:
                raise ValueError(f"with_lengths cannot shrink a certified/naive cache's lengths (sequence(s) {back}: "
                                 f"{np.asarray(self.lengths)[back].tolist()} -> "
                                 f"{np.asarray(new_lengths)[back].tolist()}); to go back, keep the earlier cache "
                                 "value instead of rewinding it")
        # inside jit: the rewound sequence is marked, and keeps its length (a length below `flushed` would make the
        # next token's residual position negative: a kernel write outside the sequence's own rows)
        new_lengths = jnp.maximum(new_lengths, self.lengths)
        store = self._recorded(new_lengths)
        store = store.replace(nonfinite=store.nonfinite | shrink[None, :, None])
        pending, full = _maintenance(store)

        def maintained(s: TieredKVCache) -> TieredKVCache:
            s = jax.lax.cond(pending, lambda s: s.apply_pending_hot_sets(), lambda s: s, s)
            return jax.lax.cond(jnp.any(full), lambda s: s.flush_unconditionally(full), lambda s: s, s)

        store = jax.lax.cond(pending | jnp.any(full), maintained, lambda s: s, store)
        return self.replace(store=store, lengths=new_lengths.astype(jnp.int32))

    def maintenance_due(self, new_lengths: jax.Array) -> jax.Array:
        """Scalar bool: `with_lengths(new_lengths)` has work to do (hot-set blocks pending, or a full residual)."""
        pending, full = _maintenance(self._recorded(new_lengths))
        return pending | jnp.any(full)

    def _recorded(self, new_lengths: jax.Array) -> TieredKVCache:
        # every layer holds the same tokens: their lengths in one write (a decode step's `attend` leaves them)
        return self.store.replace(lengths=jnp.broadcast_to(new_lengths.astype(jnp.int32), self.store.lengths.shape))

    @property
    def last_certificate(self) -> Certificate:
        """The last decode step's certificates, leaves [L, B, Hq]."""
        return unpack(self.cert_packed)

    def step_record(self) -> Certificate | dict:
        return self.last_certificate if self.mode == "certified" else {}

    def loops_naive_decode(self) -> bool:
        """Whether a naive cache's decode step runs its layers in a loop over layers (the attention compiled once)
        rather than unrolled: on the backends of `NAIVE_LOOPED_BACKENDS`."""
        return self.mode == "naive" and jax.default_backend() in NAIVE_LOOPED_BACKENDS

    # ------------------------------------------------------------------ the two-pass decode step (models.llama)
    def decode_fast_path(self, top_rung: int | None = None) -> TieredModelCache | None:
        """The cache for a decode step's fast pass (every layer answers at rung 0 or up to `top_rung` (default:
        0 for the "straight" schedules, else 1; a head that needs more is marked rung 3 in its certificate:
        `needs_slow_path`), or None when this mode has no slower path (naive)."""
        if self.mode != "certified" or self.schedule == "unrolled":
            return None
        if top_rung is None:
            top_rung = 0 if self.schedule.startswith("straight") else 1
        return self.replace(fast=True, fast_top_rung=top_rung)

    def left_rung0_last_step(self) -> jax.Array:
        """Scalar bool: some head of some layer answered above rung 0 in the last decode step (its certificates,
        `cert_packed`)."""
        return jnp.any(self.cert_packed[..., PACKED_FIELDS.index("rung")] > 0)

    def wants_rung1_pass(self) -> jax.Array:
        """Scalar bool, for the "adaptive" schedule: fewer than `adaptive_rung0_streak()` decode steps in a row
        answered every head at rung 0, so this step's fast pass should include rung 1 (a rung-0 pass that misses
        costs the whole ladder's second pass: docs/performance.md, 2026-12-02 seventh session)."""
        return self.rung0_streak < adaptive_rung0_streak()

    def needs_slow_path(self) -> jax.Array:
        """Scalar bool, after a fast pass: some head of some layer needs a rung above the pass's top rung. The
        fast pass (`ladder.run_fast`) computes no rung above 1 and marks such a head rung 3 in its certificate, so
        one reduction of this step's certificates says it (no per-layer flag to carry: one write less per
        layer-step)."""
        return jnp.any(self.cert_packed[..., PACKED_FIELDS.index("rung")] >= 3)

    def fast_pass_result(self) -> TieredModelCache:
        """After a fast pass: the same cache (its certificates kept: `needs_slow_path`) with the pass's static
        rung limit reset, so that the fast passes of the "adaptive" schedule's two branches (rung 0, rungs 0-1)
        return one pytree structure and share one second pass."""
        return self.replace(fast_top_rung=1)

    def fast_path_done(self) -> TieredModelCache:
        """The fast pass's result as an ordinary cache (same pytree structure as the input of the step), the
        step counted (`rung0_streak`)."""
        done = self.replace(fast=False, fast_top_rung=1)
        return done._count_step(slow=False)

    def undo_step(self, undo: jax.Array, before: TieredModelCache) -> TieredModelCache:
        """This cache after a decode step's rung-0 first pass, or where undo (scalar bool) is set, `before` again
        in everything the step's redo reads (`models.llama.decode_first_pass`): the lengths and step counters,
        and the running statistics and hot-set usage marks the pass updated (a layer after one whose head failed
        rung 0 wrote values from an uncertified output: its running range may hold them). What stays is
        rewritten by the redo before anything reads it: the token's residual row (the same position in every
        layer) and the certificates. A rung-0 pass flushes, fetches and refreshes nothing. Selects of small
        arrays only ([L, B, H, d] at most: no copy of the cache's blocks)."""
        def pick(new, old):
            return jnp.where(undo, old, new)

        store = self.store.replace(**{f: pick(getattr(self.store, f), getattr(before.store, f))
                                      for f in UNDONE_STORE_FIELDS})
        return self.replace(store=store, lengths=pick(self.lengths, before.lengths),
                            rung0_streak=pick(self.rung0_streak, before.rung0_streak),
                            slow_steps=pick(self.slow_steps, before.slow_steps))

    def slow_path_done(self) -> TieredModelCache:
        """After a step's second pass (the whole ladder): the step counted (`rung0_streak`, `slow_steps`)."""
        return self._count_step(slow=True)

    def _count_step(self, slow: bool) -> TieredModelCache:
        above0 = self.left_rung0_last_step()
        streak = jnp.where(above0, 0, jnp.minimum(self.rung0_streak, _STREAK_CAP) + 1).astype(jnp.int32)
        return self.replace(rung0_streak=streak, slow_steps=self.slow_steps + jnp.int32(slow))


_STREAK_CAP = 1 << 30
# what a decode step's rung-0 first pass changes in the store besides the token's residual row (`undo_step`)
UNDONE_STORE_FIELDS = ("lengths", "v_min", "v_max", "v_norm_max", "value_stats", "nonfinite", "hot_used")


def _check_start_and_donation(method: str, start: Any, caches: tuple[tuple[str, Any], ...]) -> None:
    """A TypeError for a start that is not a Python or NumPy int; a ValueError naming any of `caches` whose arrays
    were donated to an earlier call (a decode step, `with_sequences` and `with_staged_sequences` consume theirs)."""
    if not is_integer(start):
        raise TypeError(f"{method}: start must be a Python or NumPy int, got {type(start).__name__}")
    for name, c in caches:
        if was_donated(c):
            raise ValueError(f"{method}: {name} was donated to an earlier call (a decode step, with_sequences or "
                             "with_staged_sequences consumes the cache it is given): use the cache that call returned")


_SEQUENCE_LAYOUT = ("mode", "schedule", "store settings", "per-sequence arrays (shape without the batch axis, dtype)",
                    "certificate rows")


def _sequence_layout(c: TieredModelCache) -> tuple:
    """What two caches must share for one to take the other's sequences (`_SEQUENCE_LAYOUT`): every store array's
    shape without its batch axis (axis 1) and its dtype, by field, so that a write replaces whole rows (hot
    slots, blocks, groups and bits included: a narrower part would leave another sequence's hot blocks behind)."""
    s = c.store
    arrays = tuple((f, getattr(s, f).shape[:1] + getattr(s, f).shape[2:], str(getattr(s, f).dtype))
                   for f in DEVICE_FIELDS + ("host_k", "host_v"))
    settings = tuple((f.name, getattr(s, f.name)) for f in dataclasses.fields(s)
                     if not f.metadata.get("pytree_node", True))
    return c.mode, c.schedule, settings, arrays, c.cert_packed.shape[:1] + c.cert_packed.shape[2:]


@functools.partial(jax.jit, donate_argnums=0)
def _put_sequences(full: TieredModelCache, p: TieredKVCache, lengths: jax.Array, cert_packed: jax.Array,
                   start: jax.Array) -> TieredModelCache:
    """full with a part's sequences (its stacked store p, lengths [n], cert_packed [L, n, Hq, 9]) written at batch
    index `start` (axis 1 of the stacked store and certificates, axis 0 of the lengths); tier 2 written in host
    memory. Only full is donated (the part's policy never enters: it may share arrays with full's)."""
    def put(whole: jax.Array, rows: jax.Array, axis: int) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(whole, rows, start, axis)

    s = full.store
    store = s.replace(**{f: put(getattr(s, f), getattr(p, f), 1) for f in DEVICE_FIELDS},
                      **{f: put(getattr(s, f), tiers.to_host(getattr(p, f)), 1) for f in ("host_k", "host_v")})
    return full.replace(store=store, lengths=put(full.lengths, lengths, 0),
                        cert_packed=put(full.cert_packed, cert_packed, 1))


def _maintenance(store: TieredKVCache) -> tuple[jax.Array, jax.Array]:
    """(pending: scalar bool, some layer's rung 1 asked for hot-set blocks; full [B]: the residual block is full,
    in every layer alike) of a stacked store whose lengths are recorded. Pending does not change lengths or flushed,
    so `full` is the same before and after the hot sets are applied."""
    return jnp.any(store.hot_pending >= 0), jnp.any(store.needs_flush(), axis=0)


def _layer_of(stacked: jax.Array, layer: int | jax.Array) -> jax.Array:
    """stacked[layer]: a Python int indexes as usual (negative counts from the end, out of range raises); a traced
    index (a loop over the layers: in range by construction) is a dynamic slice without the negative-index select
    that `stacked[layer]` adds."""
    if isinstance(layer, (int, np.integer)):
        return stacked[layer]
    return jax.lax.dynamic_index_in_dim(stacked, layer, axis=0, keepdims=False)


def _stack_updated(view: TieredKVCache, base: TieredKVCache, field: str, stored: jax.Array) -> bool:
    """Whether the update of `field` from base to view also updated the view's stack, so that the view's stacked
    array is the model's array `stored` with the layer's row set: only with `cache.HOT_USED_STACKED` (the one
    updater that keeps the stack in step, `with_hot_used_marked`; STACK_TRACKED_FIELDS), and only where base's
    stack is `stored` itself -- a view of an older state of the model (several views written back in turn) would
    otherwise put back its snapshot of the other layers' rows. Outside a trace (a view through `jax.jit` comes
    back with new arrays) the identity also fails when nothing was updated, which is why the switch must be on:
    the row is written back instead."""
    from certattn_jax import cache as cache_module

    return (cache_module.HOT_USED_STACKED and field in STACK_TRACKED_FIELDS and view.stack is not None
            and base.stack is not None and base.stack.get(field) is stored
            and view.stack.get(field) is not stored)


def _set_layer(stacked: jax.Array, layer: int | jax.Array, value: jax.Array) -> jax.Array:
    """stacked with row `layer` replaced by value: a dynamic-update-slice (in place in a loop that carries
    `stacked`). `stacked.at[layer].set(value)` with a traced index is a scatter whose bounds check XLA evaluates
    as a reduction of its own: a kernel launch per written field and layer-step on a GPU (docs/performance.md,
    twentieth session). A Python int is checked and normalised here; a traced index is in range by construction."""
    layer = checked_layer(layer, stacked.shape[0])
    return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), layer, axis=0)


# The "adaptive" schedule's threshold: the fast pass stops at rung 0 only after this many decode steps in a row
# answered every head at rung 0. CERTATTN_ADAPTIVE_STREAK (an experiment knob); the default is measured
# (docs/performance.md, 2026-12-02 seventh session).
_ADAPTIVE_RUNG0_STREAK = positive_int_from_env("CERTATTN_ADAPTIVE_STREAK", 4)


def adaptive_rung0_streak() -> int:
    """Rung-0 steps in a row after which the "adaptive" schedule's fast pass stops at rung 0 (this process)."""
    return _ADAPTIVE_RUNG0_STREAK


def _stack_layers(layers: Sequence[TieredKVCache]) -> TieredKVCache:
    """Stack single-layer caches into the stacked form (tier 2 stacked on the device, then moved back in one copy)."""
    first = layers[0]
    arrays = {f: jnp.stack([getattr(c, f) for c in layers]) for f in DEVICE_FIELDS}
    host = {f: tiers.to_host(jnp.stack([tiers.to_device(getattr(c, f)) for c in layers]))
            for f in ("host_k", "host_v")}
    return first.replace(**arrays, **host)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What a model's KV cache is: mode, model shape, dtype, policy. Call it (batch, capacity) for an empty
    cache; `staging` / `from_staging` give the prefill path (module docstring)."""

    mode: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: Any
    policy: CertPolicy | None = None
    schedule: str = DEFAULT_SCHEDULE  # TieredModelCache.schedule

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            raise ValueError(f"unknown cache mode {self.mode!r}; choose from {CACHE_MODES}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        resolve_schedule(self.schedule)  # a clear error for an unknown name, when the spec is made
        if not jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating):
            raise TypeError(f"a cache's dtype must be floating point, got {jnp.dtype(self.dtype)}")
        if self.policy is not None and not isinstance(self.policy, CertPolicy):
            raise TypeError(f"policy must be a certattn_jax.CertPolicy (or None), got {type(self.policy).__name__}")

    def check_model(self, config: Any) -> None:
        """A clear error where this spec was built for another model shape than `config`'s."""
        want = (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim)
        have = (self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim)
        if want != have:
            raise ValueError(f"the cache spec is for (layers, query heads, KV heads, head_dim) = {have}, the model "
                             f"has {want}")

    @property
    def tiered(self) -> bool:
        return self.mode != "dense"

    def _policy(self) -> CertPolicy:
        return self.policy or CertPolicy()

    def staging_capacity(self, capacity: int) -> int:
        """The capacity the cache will really have (tiered caches round up to whole blocks)."""
        if not self.tiered:
            return capacity
        Bk = self._policy().block_size
        return -(-capacity // Bk) * Bk

    def __call__(self, batch: int, capacity: int) -> KVCache:
        if not self.tiered:
            return self.staging(batch, capacity)
        return TieredModelCache.init(num_layers=self.num_layers, batch=batch, capacity=capacity,
                                     num_kv_heads=self.num_kv_heads, num_q_heads=self.num_q_heads,
                                     head_dim=self.head_dim, dtype=self.dtype, policy=self.policy, mode=self.mode,
                                     schedule=self.schedule)

    def bytes_per_sequence(self, capacity: int) -> dict[str, int]:
        """What one sequence of a cache of `capacity` tokens takes, in bytes: "staging" its dense K/V (the prefill's
        staging cache), "device" this mode's cache on the device (tier 1, hot set, residual, statistics,
        certificates; the dense cache itself for "dense"), "host" its tier 2 in host memory (0 for "dense").
        From the shapes alone (nothing is allocated); kept per layout, as a prefill asks it every call."""
        layout = conversion_layout(self._policy()) if self.tiered else None  # hashable: the cache's key
        return dict(_bytes_per_sequence(self.mode, self.num_layers, self.num_q_heads, self.num_kv_heads,
                                        self.head_dim, jnp.dtype(self.dtype).name, layout, self.schedule,
                                        int(capacity)))

    def staging(self, batch: int, capacity: int) -> DenseKVCache:
        """A dense cache to prefill into (for the dense mode: the cache itself). For a tiered mode this also
        starts, in the background, the compiled kernels' one-time self-checks that the decode step will need
        (`kernel_checks.start`): they run while the prompt is prefilled instead of inside the decode compile."""
        capacity = self.staging_capacity(capacity)
        if self.tiered:
            kernel_checks.start(mode=self.mode, batch=batch, capacity=capacity, num_kv_heads=self.num_kv_heads,
                                head_dim=self.head_dim, dtype=self.dtype, policy=self._policy())
        return DenseKVCache.init(num_layers=self.num_layers, batch=batch, capacity=capacity,
                                 num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype)

    def converts_in_one_program(self, staging: DenseKVCache) -> bool:
        """Whether `from_staging(staging)` converts every layer in one program (a tiered mode whose conversion group
        holds every layer in the batched form: `cache.converts_all_layers_batched`, as the traced form asks too)."""
        if not self.tiered:
            return False
        return converts_all_layers_batched(staging.k[0].nbytes + staging.v[0].nbytes, len(staging.k))

    def check_tier2_fits(self, staging: DenseKVCache) -> None:
        """A clear error, before anything is allocated, where the tier 2 that converting `staging` makes (its keys
        and values in host memory) exceeds the host's available memory (`tiers.check_host_fits`)."""
        if self.tiered:
            tiers.check_host_fits(2 * len(staging.k) * staging.k[0].nbytes, f"tier 2 (the original keys and values, "
                                  f"{2 * len(staging.k)} x {tuple(staging.k[0].shape)} {staging.k[0].dtype})")

    def from_staging(self, dense: DenseKVCache, lengths: Any = None) -> KVCache:
        """The mode's cache holding what `dense` holds (dense: itself; tiered: one jitted bulk conversion; drop
        `dense` afterwards to free its device memory). lengths: dense.lengths as known on the host, optional
        (`TieredModelCache.from_dense`: the conversion need not wait for the prefill to read them back)."""
        if not isinstance(dense, DenseKVCache):
            raise TypeError(f"from_staging takes the DenseKVCache that `staging` made, got {type(dense).__name__}")
        shape = (dense.num_layers, dense.k[0].shape[1], dense.k[0].shape[3])
        if shape != (self.num_layers, self.num_kv_heads, self.head_dim) or dense.k[0].dtype != jnp.dtype(self.dtype):
            raise ValueError(f"the staging cache has (layers, KV heads, head_dim) = {shape} in {dense.k[0].dtype}; "
                             f"this spec is for {(self.num_layers, self.num_kv_heads, self.head_dim)} in "
                             f"{jnp.dtype(self.dtype)}")
        if not self.tiered:
            return dense
        return _convert(dense, self._policy(), num_q_heads=self.num_q_heads, mode=self.mode,
                        schedule=self.schedule, lengths=lengths)


@functools.lru_cache(maxsize=64)
def _bytes_per_sequence(mode: str, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: str,
                        layout: CertPolicy | None, schedule: str, capacity: int) -> tuple[tuple[str, int], ...]:
    spec = CacheSpec(mode, num_layers, num_q_heads, num_kv_heads, head_dim, jnp.dtype(dtype), layout, schedule)

    def nbytes(tree: Any) -> int:
        return int(sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))

    # DenseKVCache.init, not spec.staging: that also starts the kernels' self-checks (for a batch of 1 here)
    staging = nbytes(jax.eval_shape(lambda: DenseKVCache.init(
        num_layers=num_layers, batch=1, capacity=spec.staging_capacity(capacity), num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=spec.dtype)))
    if not spec.tiered:
        return (("staging", staging), ("device", staging), ("host", 0))
    shapes = jax.eval_shape(lambda: spec(1, capacity))
    host = nbytes((shapes.store.host_k, shapes.store.host_v))
    return (("staging", staging), ("device", nbytes(shapes) - host), ("host", host))


def owned_policy(policy: CertPolicy) -> CertPolicy:
    """The policy with its tolerances as a jitted step returns them: committed, weakly typed float32 arrays instead of
    Python floats (a step's first call would otherwise compile a second program for its later calls: jit keys on
    whether an argument is committed). Copies, never the caller's arrays: a decode loop donates its cache, and a
    policy taken from another cache (`generate(..., policy=out.cache.policy)`) would lose its leaves to that
    donation."""
    return _copied(policy)


@committed_jit
def _copied(tree: Any) -> Any:
    """Copies of tree's leaves, committed, in one program (an eager copy per leaf is a dispatch each)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


@committed_jit(static_argnames=("layers", "heads"))
def _fresh_model_arrays(lengths: jax.Array, policy: CertPolicy, nonfinite: jax.Array | None,
                        converted_with: jax.Array | None, *, layers: int,
                        heads: int) -> tuple[jax.Array, jax.Array, CertPolicy, jax.Array, jax.Array, jax.Array | None]:
    """What `TieredModelCache._wrap` adds to a layer store, in one program (each eager op would be a dispatch of its
    own, on a GPU a launch each after the conversion: the prefill's time to first token): a copy of lengths [B]
    (int32), the empty certificates [layers, B, heads, len(PACKED_FIELDS)], the policy's `owned_policy` copy, the
    two step counters (int32 scalars, 0), and where converted_with [B] is given, the store's nonfinite
    [layers, B, Hkv] with every sequence whose lengths differ from converted_with marked (else None). All
    committed."""
    B = lengths.shape[0]
    cert = jnp.broadcast_to(pack(empty_like_heads(B, heads)), (layers, B, heads, len(PACKED_FIELDS)))
    zero = jnp.zeros((), jnp.int32)
    if converted_with is not None:
        nonfinite = nonfinite | (lengths != converted_with)[:, None]
    return (jnp.array(lengths, jnp.int32, copy=True), cert, jax.tree.map(lambda x: jnp.array(x, copy=True), policy),
            zero, jnp.array(zero, copy=True), nonfinite)


def _convert(dense: DenseKVCache, policy: CertPolicy, *, num_q_heads: int, mode: str,
             schedule: str, lengths: Any = None) -> TieredModelCache:
    """The staging cache converted (`TieredModelCache.from_dense`: eagerly in groups of layers)."""
    return TieredModelCache.from_dense(dense, num_q_heads=num_q_heads, policy=policy, mode=mode, schedule=schedule,
                                       lengths=lengths)


def convert_staging(dense: DenseKVCache, like: TieredModelCache) -> TieredModelCache:
    """A prefilled dense staging cache converted (one jitted program) into a tiered cache with the mode, policy,
    schedule and query heads of `like` (e.g. an empty cache built for the same run)."""
    if dense.capacity != like.capacity:
        raise ValueError(f"staging capacity {dense.capacity} differs from the tiered cache's {like.capacity}")
    num_q_heads = like.cert_packed.shape[-2]
    return _convert(dense, like.policy, num_q_heads=num_q_heads, mode=like.mode, schedule=like.schedule)


def cache_spec(mode: str, config: Any, dtype: Any, policy: CertPolicy | None = None,
               schedule: str = DEFAULT_SCHEDULE) -> CacheSpec:
    """The cache of a LLaMA-like `config` (num_layers, num_heads, num_kv_heads, head_dim) in `mode`;
    `schedule` see TieredModelCache ("auto" is resolved here with the model's layer size: `resolve_schedule`)."""
    context = getattr(config, "max_position_embeddings", None)
    block = policy.block_size if isinstance(policy, CertPolicy) else CertPolicy().block_size  # others: named later
    if mode != "dense" and context is not None and block > context:  # a block could never fill; its capacity
        # rounding alone would allocate a cache of `block` tokens per sequence (a 2**20 block: killed for memory)
        most = 1 << (max(context, 1).bit_length() - 1)  # the largest power of two within the context
        raise ValueError(f"the policy's block size {block} exceeds the model's context of {context} tokens: "
                         f"choose a block size of at most {most} (e.g. {min(64, most)})")
    if schedule == "auto" and hasattr(config, "intermediate_size"):  # resolved with the model's layer size
        schedule = resolve_schedule(schedule, layer_weight_bytes(config, dtype))
    return CacheSpec(mode=mode, num_layers=config.num_layers, num_q_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=jnp.dtype(dtype), policy=policy,
                     schedule=schedule)


def init_model_cache(mode: str, config: Any, dtype: Any, batch: int, capacity: int,
                     policy: CertPolicy | None = None) -> KVCache:
    """An empty cache: `cache_spec(mode, config, dtype, policy)(batch, capacity)`."""
    return cache_spec(mode, config, dtype, policy)(batch, capacity)


def tiered_cache_factory(config: Any, dtype: Any, policy: CertPolicy | None = None, mode: str = "certified",
                         ) -> Callable[[int, int], TieredModelCache]:
    """A cache factory (batch, capacity) -> TieredModelCache (kept for existing callers: `cache_spec`)."""
    if mode not in MODES:
        raise ValueError(f"unknown tiered cache mode {mode!r}; choose from {MODES}")
    return cache_spec(mode, config, dtype, policy)
