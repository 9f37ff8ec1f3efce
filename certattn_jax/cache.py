"""TieredKVCache: one attention layer's two-tier quantized KV cache, an immutable pytree.

Tier 1 (device), per sequence b and KV head h, for the full blocks n < nb of B tokens:
    k_codes [B, H, nb, Bk, d*kbits/8] uint8   keys, per-channel asymmetric (scale/zero per block)
    k_scale, k_zero [B, H, nb, d]             16-bit floats
    v_codes [B, H, nb, Bk, d*vbits/8] uint8   values, per-token asymmetric per group of channels
    v_scale, v_zero [B, H, nb, Bk, d/g]
    v_err   [B, H, nb] f32                    eta_n = max_{i in n} ||v_i - v_hat_i||_2 (exact, at write time)
    v_mean_err [B, H, nb] bf16                ||(1/Bk) sum_{i in n} (v_i - v_hat_i)||_2, rounded up, and
    v_err_op [B, H, nb] bf16                  ||E_n||_2 (spectral norm of the block's error matrix), an upper
                                              bound: E_val of a block whose attention is spread (bounds.md §4)
    v_err_max [B, H] f32                      running maximum of v_err over the blocks flushed so far
    v_norm_max [B, H] f32                     running maximum of ||v_i||_2 (an upper bound, of the value as stored)
                                              over every token written, residual included: the key term's
                                              centre-0 form (docs/bounds.md section 3), noted at the write
    v_scale_max, v_zero_max [B, H, d/gs] f32  running maxima of |v_scale| and |v_zero| per value group (E_int's
                                              inputs): a step reads these instead of reducing tier 1 again
    v_min, v_max [B, H, d] f32                running per-channel range of the values written so far
    value_stats [B, H, 4] f32                 what a step's bound needs of the five running statistics above
                                              (`bounds.value_statistics`: ||r||_2, ||value_abs||_2, max value_abs,
                                              E_int's norm), recomputed by every write that changes them, so that
                                              no step reduces them again (the token-write kernel included)
    nonfinite [B, H] bool                     a NaN/Inf was written to this head (it can no longer be certified)
    stack        (layer views of a model cache only) {field: the model's stacked [L, ...] array} for every
                 device field: the tier-1 kernel reads layer `layer` of the tier-1 arrays in place
                 (`tier1_arrays`), and the ladder's rung-1 branch slices the fields it reads inside the branch
                 (`resliced`), so that a step which skips rung 1 does not materialise them for it
    res_k, res_v [B, H, Bk, d]                the newest, partial block, exact (per-channel scales need a full one)
    hot_k, hot_v [B, H, K, Bk, d], hot_ids [B, H, K]   device-resident exact copies of K blocks (K = the
                                              policy's `slots`: hot_slots, or k_max)
    hot_used [B, H, K] int32                  when each slot was last promoted (the sequence length then; -1
                                              never): a block leaving the residual (flush) takes the least
                                              recently used slot, so the recent window is resident at no
                                              tier-2 cost
    hot_pending [B, H, K] int32               blocks rung 1 wants resident (-1 none), in a model cache's layer
                                              views only: there rung 1 records its candidates here and the model
                                              makes them resident once per step, after the last layer
                                              (`apply_pending_hot_sets`), so the per-layer path never writes the
                                              hot set back; -1 everywhere between steps
Tier 2 (pinned host memory):
    host_k, host_v [B, H, nb, Bk, d]          the originals, in the model's dtype; one block of one head and
                                              one whole head are each contiguous
Bookkeeping: lengths [B] (valid tokens), flushed [B] (tokens in full blocks, a multiple of Bk).

Stacked form (a whole model's cache, `certattn_jax.model_cache.TieredModelCache`): every array above gets a
leading layer axis L. A *layer view* of it holds one layer's device arrays, the whole stacked tier 2
[L, B, H, nb, Bk, d] and `layer` (int32 scalar): tier-2 reads and writes slice the layer inside the transfer
(`tiers`), so no layer-sized copy of tier 2 is ever made. `layer` is None for a single-layer cache.
Invariant between calls: 0 <= lengths - flushed <= Bk; tokens [flushed, lengths) live in res_*.

Writes never lose data: every token is in tier 2 (full blocks) or in the exact residual block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from certattn_jax import bounds, quant, select, tiers
from certattn_jax.env import choice_from_env, positive_int_from_env, switch_from_env
from certattn_jax.kv_cache import commit_arrays, is_concrete, write_positions
from certattn_jax.policy import CertPolicy
from certattn_jax.validate import checked_counts, is_integer


def checked_layer(layer: int | jax.Array, num_layers: int) -> int | jax.Array:
    """A Python layer index of a stack of num_layers checked and made non-negative (negative counts from the end,
    beyond the stack raises IndexError), so that every consumer -- slices, kernels (which clip), updates -- means
    the same layer; a traced index unchanged (a loop over the layers is in range by construction)."""
    if isinstance(layer, int | np.integer):
        return range(num_layers)[layer]
    return layer


# The tier-1 arrays a tier-1 pass reads, in its argument order (a layer view's `stack` holds them stacked).
TIER1_FIELDS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
# The fields that only a flush (tier 1, its annotations and running maxima), rung 1 (the hot set) or a token
# write (the residual) changes: a layer view with a `stack` holds exactly its stack's slices of them (`resliced`,
# `tier1_arrays`, `slot_arrays`); whatever changes one of them drops the stack.
# Whether a model cache's decode step writes its token with one Pallas kernel (`pallas_kernels.write_token`: the
# residual row and the running value statistics of the layer, in place, one launch) instead of XLA's updates (one
# dynamic-update-slice launch per written array and layer-step on a GPU). None ("auto", the default): wherever
# compiled kernels run (a GPU) and the kernel passed its known-answer check (`pallas_kernels.selftest.write_trusted`);
# in interpret mode (the CPU) XLA's updates, which cost nothing extra there. CERTATTN_WRITE_KERNEL=1 / 0 forces it on
# (also interpreted: the CPU tests) / off.
WRITE_KERNEL: bool | None = switch_from_env("CERTATTN_WRITE_KERNEL")

# Whether a layer view records its hot slots' use in the whole stacked `hot_used` (`with_hot_used_marked`) instead
# of its row, CERTATTN_HOT_USED_STACKED=1. Off by default: measured on an H100 (SmolLM2 1K, twenty-fifth session,
# one row per call, docs/performance.md) it lets `--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE` take the
# rung-0 pass's loop over layers into one graph (11.3 host graph launches per step instead of 31.9), but with
# XLA's default command buffers it decoded 546.9 tokens/s against 560-562 without it (other calls, dense equal)
# and compiled ~4 s longer. To be A/B'd in one call, with the flags, before it becomes a default. Constant in a
# process (read while tracing: a trace made with one setting and used with the other would mismatch).
HOT_USED_STACKED: bool = bool(switch_from_env("CERTATTN_HOT_USED_STACKED"))

BLOCK_FIELDS = TIER1_FIELDS + ("v_err", "v_mean_err", "v_err_op", "v_err_max", "v_norm_max", "v_scale_max",
                               "v_zero_max", "value_stats", "hot_k", "hot_v", "hot_ids", "res_k", "res_v")


@struct.dataclass
class TieredKVCache:
    k_codes: jax.Array
    k_scale: jax.Array
    k_zero: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_zero: jax.Array
    v_err: jax.Array
    v_mean_err: jax.Array
    v_err_op: jax.Array
    v_err_max: jax.Array
    v_norm_max: jax.Array
    v_scale_max: jax.Array
    v_zero_max: jax.Array
    v_min: jax.Array
    v_max: jax.Array
    value_stats: jax.Array
    nonfinite: jax.Array
    res_k: jax.Array
    res_v: jax.Array
    hot_k: jax.Array
    hot_v: jax.Array
    hot_ids: jax.Array
    hot_used: jax.Array
    hot_pending: jax.Array
    host_k: jax.Array
    host_v: jax.Array
    lengths: jax.Array
    flushed: jax.Array
    layer: jax.Array | None = None
    stack: dict[str, jax.Array] | None = None
    block_size: int = struct.field(pytree_node=False, default=64)
    group_size: int = struct.field(pytree_node=False, default=32)
    key_bits: int = struct.field(pytree_node=False, default=8)
    value_bits: int = struct.field(pytree_node=False, default=4)

    # ------------------------------------------------------------------ construction
    @classmethod
    def init(cls, *, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype: Any = jnp.bfloat16,
             policy: CertPolicy | None = None, layers: int | None = None, host: bool = True) -> TieredKVCache:
        """An empty cache holding up to `capacity` tokens (rounded up to a multiple of the block size); with
        `layers`, the stacked form (every array with a leading axis of that size). host=False leaves tier 2 in
        device memory (for building a cache whose tier 2 is moved to the host afterwards in one copy)."""
        policy = _checked_policy(policy)
        Bk, g = policy.block_size, policy.group_size
        sizes = dict(batch=batch, capacity=capacity, num_kv_heads=num_kv_heads, head_dim=head_dim)
        if not all(is_integer(n) for n in sizes.values()):
            raise TypeError(f"TieredKVCache.init: sizes must be integers, got {sizes}")
        if min(batch, capacity, num_kv_heads, head_dim) <= 0:
            raise ValueError("TieredKVCache.init: batch, capacity, num_kv_heads and head_dim must be positive")
        quant.check_group_size(head_dim, g)
        if head_dim % (8 // min(policy.key_bits, 8)) or head_dim % (8 // policy.value_bits):
            raise ValueError(f"head_dim {head_dim} cannot be packed at {policy.key_bits}/{policy.value_bits} bits")
        if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            raise TypeError(f"cache dtype must be floating, got {dtype}")
        nb = -(-capacity // Bk)
        K = policy.slots
        B, H, d = batch, num_kv_heads, head_dim
        dk, dv = d * policy.key_bits // 8, d * policy.value_bits // 8
        sdt = quant.SCALE_DTYPE
        lead = () if layers is None else (layers,)
        alloc = _Prefixed(lead, host)
        return commit_arrays(cls(
            k_codes=alloc.zeros((B, H, nb, Bk, dk), jnp.uint8),
            k_scale=alloc.zeros((B, H, nb, d), sdt), k_zero=alloc.zeros((B, H, nb, d), sdt),
            v_codes=alloc.zeros((B, H, nb, Bk, dv), jnp.uint8),
            v_scale=alloc.zeros((B, H, nb, Bk, d // g), sdt), v_zero=alloc.zeros((B, H, nb, Bk, d // g), sdt),
            v_err=alloc.zeros((B, H, nb), jnp.float32),
            v_mean_err=alloc.zeros((B, H, nb), jnp.bfloat16), v_err_op=alloc.zeros((B, H, nb), jnp.bfloat16),
            v_err_max=alloc.zeros((B, H), jnp.float32), v_norm_max=alloc.zeros((B, H), jnp.float32),
            v_scale_max=alloc.zeros((B, H, d // g), jnp.float32), v_zero_max=alloc.zeros((B, H, d // g), jnp.float32),
            v_min=alloc.full((B, H, d), jnp.inf, jnp.float32), v_max=alloc.full((B, H, d), -jnp.inf, jnp.float32),
            value_stats=alloc.zeros((B, H, bounds.N_VALUE_STATS), jnp.float32),  # (what no value gives)
            nonfinite=alloc.zeros((B, H), bool),
            res_k=alloc.zeros((B, H, Bk, d), dtype), res_v=alloc.zeros((B, H, Bk, d), dtype),
            hot_k=alloc.zeros((B, H, K, Bk, d), dtype), hot_v=alloc.zeros((B, H, K, Bk, d), dtype),
            hot_ids=alloc.full((B, H, K), -1, jnp.int32), hot_used=alloc.full((B, H, K), -1, jnp.int32),
            hot_pending=alloc.full((B, H, K), -1, jnp.int32),
            host_k=alloc.zeros_on_host((B, H, nb, Bk, d), dtype),
            host_v=alloc.zeros_on_host((B, H, nb, Bk, d), dtype),
            lengths=alloc.zeros((B,), jnp.int32), flushed=alloc.zeros((B,), jnp.int32),
            block_size=Bk, group_size=g, key_bits=policy.key_bits, value_bits=policy.value_bits))

    @classmethod
    def from_dense(cls, k: jax.Array, v: jax.Array, policy: CertPolicy | None = None,
                   capacity: int | None = None, lengths: jax.Array | None = None) -> TieredKVCache:
        """Build from keys/values [B, T, Hkv, d] (all T tokens valid unless `lengths` [B] says fewer).

        One bulk conversion (see `from_head_major`); the result equals `init(...).append(k, v, lengths)` on every
        valid token. Works eagerly (one compiled program per shape, reused) and inside jit.
        """
        _check_kv(k, v)
        policy = _checked_policy(policy)
        B, T, H, d = k.shape
        Bk = policy.block_size
        if capacity is not None and (not is_integer(capacity) or capacity < 1):
            raise ValueError(f"capacity must be a positive integer (or None: the tokens given), got {capacity!r}")
        cap = -(-(capacity or T) // Bk) * Bk
        if T > cap:
            raise ValueError(f"KV cache overflow: {T} tokens do not fit a capacity of {cap}")
        valid, bad = (jnp.full((B,), T, jnp.int32), None) if lengths is None else \
            checked_counts(lengths, B, T, "lengths")

        def head_major(x):
            return jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, cap - T), (0, 0)))

        return _poisoned(cls.from_head_major(head_major(k), head_major(v), valid, policy), bad)

    @classmethod
    def from_head_major(cls, k: jax.Array, v: jax.Array, lengths: jax.Array,
                        policy: CertPolicy | None = None) -> TieredKVCache:
        """Build from head-major keys/values k, v [B, Hkv, S, d] (a dense cache layer; S = the capacity, a multiple
        of the block size), the first lengths[b] tokens valid.

        Every full block is quantized into tier 1 in one batched pass; the originals go to tier 2 in one
        contiguous copy per array ([B, H, S, d] is [B, H, nb, Bk, d] reshaped), the partial last block into the
        exact residual. Nothing is read back from tier 2. Positions past the full blocks are zero in tier 1 and
        tier 2, as `init` + `append` leave them.
        """
        policy = _checked_policy(policy)
        _check_kv(k, v)
        lengths, bad = _check_head_major(k.shape, lengths, policy)
        return _poisoned(_from_head_major(k, v, lengths, policy), bad)

    @classmethod
    def stacked_from_head_major(cls, k: jax.Array, v: jax.Array, lengths: jax.Array,
                                policy: CertPolicy | None = None) -> TieredKVCache:
        """The stacked form (a whole model) from k, v [L, B, Hkv, S, d] (a dense cache's layers stacked), the first
        lengths[b] tokens of every layer valid: every layer quantized in one batched pass, tier 2 moved to the
        host in one copy per array. Same checks and result per layer as `from_head_major`."""
        policy = _checked_policy(policy)
        if k.ndim != 5 or v.shape != k.shape:
            raise ValueError(f"keys and values must both be [L, B, H, S, d]; got {k.shape} and {v.shape}")
        _check_kv(k[0], v[0])
        lengths, bad = _check_head_major(k.shape[1:], lengths, policy)
        return _poisoned(_from_head_major(k, v, lengths, policy), bad)

    @classmethod
    def stacked_from_layers(cls, ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...], lengths: jax.Array,
                            policy: CertPolicy | None = None, checked: bool = False) -> TieredKVCache:
        """The stacked form from per-layer k, v [B, Hkv, S, d] (a dense cache's own layers), the first lengths[b]
        tokens of every layer valid; eager only. Where one group of layers (`conversion_group_layers`: up to
        CONVERT_GROUP_BYTES of K/V) holds every layer (CONVERT_GROUP_FORM "batched"), one program whose outputs are
        the cache, tier 2 its pinned-host output; otherwise `with_rows_converted` writes the layers in place
        (donated) into a preallocated stacked cache, a layer per program (`layers_per_program`), the originals
        straight into the pinned-host tier 2. Unlike `stacked_from_head_major` it needs no stacked copy of more
        than a group's layers (the model's asked the H200 for 66.6 GiB at the 8B shape, 32K, batch 8:
        docs/performance.md, fourteenth session): the peak is the inputs, the result and a group's temporaries
        (`conversion_temp_bytes`: ~16-22 bytes per K/V element of the group measured on the CPU). Tier 2 larger than
        the host's available memory is refused by name before anything is allocated. Same result, bit for bit, as
        a layer at a time. checked: lengths [B] are not read back (`TieredModelCache.from_dense` with host-given
        lengths: the dense cache's own); the conversion clips them to [0, S] on the device."""
        policy = _checked_policy(policy)
        _check_layers(ks, vs)
        if checked:
            _check_blocks(ks[0].shape, policy)
            bad = None
        else:
            lengths, bad = _check_head_major(ks[0].shape, lengths, policy)
        B, H, S, d = ks[0].shape
        layout = conversion_layout(policy)
        ks, vs = tuple(ks), tuple(vs)
        if converts_all_layers_batched(ks[0].nbytes + vs[0].nbytes, len(ks)):
            # one group holds every layer: its program's outputs are the cache (no preallocated cache to write
            # into, tier 2 allocated by XLA in host memory as the program's output)
            _check_live_layers("stacked_from_layers", ks, vs, (lengths,))
            # tier 2 (both arrays) is this program's host output: the check `zeros_on_host` makes for a
            # preallocated cache
            tiers.check_host_fits(2 * len(ks) * ks[0].nbytes, f"tier 2 (the original keys and values, "
                                  f"{2 * len(ks)} x {tuple(ks[0].shape)} {jnp.dtype(ks[0].dtype)})")
            return _poisoned(_convert_all_layers(ks, vs, lengths, layout), bad)
        store = cls.init(batch=B, capacity=S, num_kv_heads=H, head_dim=d, dtype=ks[0].dtype, policy=layout,
                         layers=len(ks))
        return _poisoned(store.with_rows_converted(0, ks, vs, lengths, checked=checked), bad)

    def with_rows_converted(self, start: int, ks: Sequence[jax.Array], vs: Sequence[jax.Array],
                            lengths: jax.Array, checked: bool = False) -> TieredKVCache:
        """This stacked cache [L, B, ...] with sequences [start, start + n) converted from per-layer k, v [n, Hkv, S, d]
        (the first lengths[i] tokens valid): groups of g layers (`layers_per_program`: 1, or `conversion_group_layers`
        with CONVERT_GROUPS_INTO), each a call of one compiled program written in place (this cache is donated), tier 1
        on the device and the originals from the device into their rows of the pinned-host tier 2. Every group has g
        layers (the last starts at L - g and converts again, identically, layers the one before wrote), so one program
        serves them all: compiled and run by the first group before anything else is consumed. The rows hold what
        converting k, v on their own gives (`stacked_from_layers`), bit for bit. Eager only. Everything is checked
        before the first layer is written (a refusal halfway would lose the cache): one live k and one live v per layer
        of this cache, each of its KV heads, capacity, head_dim and dtype; 0 <= start <= B - n; the lengths in [0, S].
        (A runtime failure of a later group, e.g. the device running out of memory, leaves this cache consumed, as any
        failing donated call does.) checked: lengths [n] are not read back; the conversion clips them to [0, S] on the
        device."""
        ks, vs = tuple(ks), tuple(vs)
        _check_layers(ks, vs)
        if not self.stacked or self.layer is not None:
            raise ValueError("with_rows_converted writes a model's stacked cache, not a layer or a layer's view")
        if len(ks) != self.k_codes.shape[0]:
            raise ValueError(f"{len(ks)} layers given; this cache holds {self.k_codes.shape[0]}")
        n, H, S, d = ks[0].shape
        mine = (self.num_kv_heads, self.capacity, self.head_dim, jnp.dtype(self.dtype))
        if (H, S, d, jnp.dtype(ks[0].dtype)) != mine:
            raise ValueError(f"the layers hold (KV heads, capacity, head_dim, dtype) = {(H, S, d, ks[0].dtype)}; "
                             f"this cache {mine}")
        if not is_integer(start) or not 0 <= start <= self.batch - n:
            raise ValueError(f"start {start!r} with {n} sequences does not fit a batch of {self.batch}")
        _check_live_layers("with_rows_converted", ks, vs, (lengths, self.k_codes))
        layout = self.layout_policy()
        if not checked:
            lengths, _ = _check_head_major(ks[0].shape, lengths, layout)  # concrete: raises outside [0, S]
        L = len(ks)
        group = layers_per_program(ks[0].nbytes + vs[0].nbytes, L, preallocated=True)
        firsts = list(range(0, L - group + 1, group))
        if firsts[-1] + group < L:  # the last group overlaps the one before: one program (one compile) for all
            firsts.append(L - group)
        store = self
        for n, i in enumerate(firsts):
            # the first call is the one a shared buffer refuses (before running: nothing written); later calls
            # take the first's outputs
            with tiers.shared_buffers_named("with_rows_converted") if n == 0 else contextlib.nullcontext():
                store = _convert_layers_into(store, ks[i:i + group], vs[i:i + group], lengths, jnp.int32(i), layout,
                                             jnp.int32(start), form=CONVERT_GROUP_FORM)
        return store

    def layout_policy(self) -> CertPolicy:
        """The layout this cache's arrays were built with (block, group, bits, hot-set slots), as a policy: what a
        conversion into its rows must use (a narrowed policy, `with_policy(k_max=2)`, keeps the cache's slots)."""
        return CertPolicy(block_size=self.block_size, group_size=self.group_size, key_bits=self.key_bits,
                          value_bits=self.value_bits, k_max=self.k_max)

    # ------------------------------------------------------------------ shape facts
    @property
    def is_stacked_view(self) -> bool:
        """A model cache's layer view that still holds its stack."""
        return self.stack is not None and self.layer is not None

    @property
    def kernels_read_stack_in_place(self) -> bool:
        """A layer view whose kernels read its layer of the stacked arrays in place (`tier1_arrays`,
        `slot_arrays`): one that holds its stack, where a compiled kernel can address the whole stacked tier 1
        (`pallas_kernels.backend.arrays_fit`: 1-byte codes of 2**31 to 2**32 bytes are not, the lowering's
        32-bit offsets wrap there). Otherwise the kernels get the layer's own arrays (a slice: a copy per
        layer-step, correct)."""
        from pallas_kernels import backend

        return self.is_stacked_view and backend.arrays_fit(*(self.stack[f] for f in TIER1_FIELDS))

    def tier1_arrays(self, in_place: bool = True) -> tuple[tuple[jax.Array, ...], jax.Array | None]:
        """(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), layer: a layer view's stacked arrays and its layer
        (for a kernel that reads the layer in place: in_place), else this cache's own arrays and None."""
        if in_place and self.kernels_read_stack_in_place:
            return tuple(self.stack[f] for f in TIER1_FIELDS), self.layer
        return tuple(getattr(self, f) for f in TIER1_FIELDS), None

    def slot_arrays(self, in_place: bool = True) -> tuple[jax.Array, ...]:
        """(hot_k, hot_v, hot_ids, res_k, res_v): a layer view's stacked arrays (in_place; the caller reads layer
        `layer` of them, as `tier1_arrays`), else this cache's own."""
        names = ("hot_k", "hot_v", "hot_ids", "res_k", "res_v")
        if in_place and self.kernels_read_stack_in_place:
            return tuple(self.stack[f] for f in names)
        return tuple(getattr(self, f) for f in names)

    def resliced(self) -> TieredKVCache:
        """A layer view with its BLOCK_FIELDS sliced afresh from its `stack` (the same values: no token write
        changes them), any other cache itself. Called inside a lax.cond branch it keeps those fields out of the
        conditional's operands: the stacked buffers are passed instead (they live in the decode loop anyway, no
        copy) and the slices happen only when the branch runs."""
        if self.stack is None or self.layer is None:
            return self
        return self.replace(**{f: self.stack[f][self.layer] for f in BLOCK_FIELDS})

    @property
    def batch(self) -> int:
        return self.k_codes.shape[-5]

    @property
    def num_kv_heads(self) -> int:
        return self.k_codes.shape[-4]

    @property
    def num_blocks(self) -> int:
        return self.k_codes.shape[-3]

    def reads_tier2_by_kernel(self) -> bool:
        """Whether rung 1 and the hot-set refresh read this cache's tier 2 with the gather kernel
        (`select.fetch_by_kernel`), else with XLA's block transfers."""
        return select.fetch_by_kernel(self.host_k, self.hot_k)

    @property
    def stacked(self) -> bool:
        """The stacked form of a whole model (every array with a leading layer axis)."""
        return self.k_codes.ndim == 6

    @property
    def head_dim(self) -> int:
        return self.res_k.shape[-1]

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def dtype(self) -> Any:
        return self.res_k.dtype

    @property
    def k_max(self) -> int:
        return self.hot_ids.shape[-1]

    def check_policy(self, policy: CertPolicy) -> None:
        mine = (self.block_size, self.group_size, self.key_bits, self.value_bits)
        if policy.layout() != mine:
            raise ValueError(f"policy layout (block, group, key bits, value bits) = {policy.layout()} "
                             f"does not match this cache's {mine}")
        if policy.k_max > self.k_max:
            raise ValueError(f"policy k_max {policy.k_max} exceeds this cache's {self.k_max} hot-set slots")

    # ------------------------------------------------------------------ writing
    def append(self, k: jax.Array, v: jax.Array, valid: jax.Array | None = None) -> TieredKVCache:
        """Append k, v [B, T, Hkv, d] (the first valid[b] tokens of each row are real; default all T).

        Tokens go through an exact staging window (residual block + new tokens); every block that fills is
        quantized into tier 1 and copied to tier 2 (host). Returns the new cache.
        """
        self._check_new(k, v)
        B, T = k.shape[:2]
        if T == 0:
            raise ValueError("append needs at least one token per sequence, got k, v with T = 0")
        valid, bad = (jnp.full((B,), T, jnp.int32), None) if valid is None else checked_counts(valid, B, T, "valid")
        lost = self._check_room(valid)
        bad = lost if bad is None else bad | lost
        c = _poisoned(self.flush(), bad)  # a deferred full residual (see write_token) must leave first
        Bk = c.block_size
        nw = -(-(Bk + T) // Bk)
        r = c.lengths - c.flushed
        win_k = jnp.zeros((B, c.num_kv_heads, nw * Bk, c.head_dim), c.dtype).at[:, :, :Bk].set(c.res_k)
        win_v = jnp.zeros_like(win_k).at[:, :, :Bk].set(c.res_v)
        win_k = write_positions(win_k, k, r)
        win_v = write_positions(win_v, v, r)
        n_full = (r + valid) // Bk  # [B] blocks of the window that are now full
        blocks_k = win_k.reshape(B, c.num_kv_heads, nw, Bk, c.head_dim)
        blocks_v = win_v.reshape(B, c.num_kv_heads, nw, Bk, c.head_dim)
        c = c._store_blocks(blocks_k, blocks_v, jnp.arange(nw)[None, :] < n_full[:, None])
        pick = jnp.minimum(n_full, nw - 1)[:, None, None, None, None]
        res_k = jnp.take_along_axis(blocks_k, pick, axis=2)[:, :, 0]
        res_v = jnp.take_along_axis(blocks_v, pick, axis=2)[:, :, 0]
        c = c.replace(res_k=res_k, res_v=res_v, flushed=c.flushed + n_full * Bk)
        return c._note_values(k, v, valid).replace(lengths=c.lengths + valid)

    def prefill(self, k: jax.Array, v: jax.Array, valid: jax.Array | None = None) -> TieredKVCache:
        """Write a prompt chunk k, v [B, T, Hkv, d]: the same as `append` (every full block is quantized and
        copied to tier 2 at once; a partial last block stays exact in the residual)."""
        return self.append(k, v, valid)

    def write_token(self, k: jax.Array, v: jax.Array, active: jax.Array | None = None) -> TieredKVCache:
        """Decode fast path: put one token k, v [B, 1, Hkv, d] into the exact residual block *without*
        flushing it, even if it fills (call `flush` before the next write). Keeps host traffic and control
        flow out of the per-layer path: the model flushes all layers at once, once per step.

        active [B] bool (default all): the sequences whose token is written; an inactive one (a sequence that
        stopped, in a batch that decodes on) is left exactly as it was -- residual, running statistics, flag and
        length."""
        self._check_new(k, v)
        if k.shape[1] != 1:
            raise ValueError(f"write_token takes one token per sequence, got {k.shape[1]}")
        B = k.shape[0]
        active = _active_mask(active, B)
        lost = self._check_room(active.astype(jnp.int32))
        r = self.lengths - self.flushed
        if is_concrete(r) and is_concrete(active) and bool(jnp.any(active & (r >= self.block_size))):
            full = np.flatnonzero(np.asarray(active & (r >= self.block_size))).tolist()
            raise ValueError(f"write_token: the residual block of sequence(s) {full} is full: call flush() before "
                             f"writing the next token")
        # inside jit a token into a full residual would be dropped: that sequence is poisoned instead
        lost = lost | (active & (r >= self.block_size))
        r = jnp.where(active, r, self.block_size)  # nothing is written at or past the block's end
        # a layer view's stack no longer holds this residual (a model cache writes the token back and views again)
        c = self.replace(res_k=_write_residual_token(self.res_k, k, r),
                         res_v=_write_residual_token(self.res_v, v, r), stack=None)
        c = c._note_values(k, v, active.astype(jnp.int32), lost=lost)
        return c.replace(lengths=self.lengths + active.astype(jnp.int32))

    def writes_token_by_kernel(self, token_dtype: Any = None) -> bool:
        """Whether `write_layer_token` (a model cache's decode step) writes a token of token_dtype (default: the
        cache dtype) with the `pallas_kernels.write_token` kernel, else with XLA (`WRITE_KERNEL`)."""
        from pallas_kernels import selftest
        from pallas_kernels import write_token as kernel

        token_dtype = self.dtype if token_dtype is None else token_dtype
        if WRITE_KERNEL is False or not kernel.supports(self.dtype, token_dtype):
            return False
        if WRITE_KERNEL:
            return True
        return selftest.runs_compiled_kernels() and selftest.write_trusted(self.block_size, self.head_dim,
                                                                           jnp.dtype(self.dtype).name)

    def write_layer_token(self, layer: jax.Array, k: jax.Array, v: jax.Array, active: jax.Array | None = None,
                          ) -> TieredKVCache:
        """The stacked form (a model's cache): `write_token` of layer `layer`'s token k, v [B, 1, Hkv, d] into this
        cache in place -- that layer's residual row and running value statistics through one kernel
        (`pallas_kernels.write_token`, where `writes_token_by_kernel`), its non-finite flag through XLA. Lengths
        are left to the caller (a model records every layer's once per step). The same cache as writing a layer
        view's token with `write_token` (`active` as there) and writing the view back."""
        from pallas_kernels import write_token as kernel

        if not self.stacked:
            raise ValueError("write_layer_token writes into a model's stacked cache (one layer: write_token)")
        self._check_new(k, v)
        if k.shape[1] != 1:
            raise ValueError(f"write_layer_token takes one token per sequence, got {k.shape[1]}")
        if not self.writes_token_by_kernel(k.dtype):
            raise ValueError("write_layer_token needs the token-write kernel (writes_token_by_kernel is False)")
        L = self.nonfinite.shape[0]
        # a traced index is clipped, as the kernel and the slices below clip it: all write the same layer
        layer = jnp.clip(jnp.asarray(checked_layer(layer, L), jnp.int32), 0, L - 1)
        lengths = jax.lax.dynamic_index_in_dim(self.lengths, layer, 0, keepdims=False)
        flushed = jax.lax.dynamic_index_in_dim(self.flushed, layer, 0, keepdims=False)
        active = _active_mask(active, k.shape[0])
        # an inactive sequence's position is past the block: the kernel writes neither its row nor its statistics
        # (nor for a position below the block, which no valid cache has: lengths >= flushed)
        r = jnp.where(active & (lengths >= flushed), lengths - flushed, self.block_size)
        res_k, res_v, v_min, v_max, v_norm_max, value_stats = kernel.write_token(
            self.res_k, self.res_v, self.v_min, self.v_max, self.v_norm_max, self.value_stats, self.v_err_max,
            k[:, 0], v[:, 0], r, layer)
        bad = ~jnp.all(jnp.isfinite(k[:, 0]) & jnp.isfinite(v[:, 0]), axis=-1)  # [B, H]
        # a token the kernel cannot store (a full residual, past the capacity) poisons its sequence, as in write_token
        lost = (lengths - flushed >= self.block_size) | (lengths + 1 > self.capacity)
        bad = (bad | lost[:, None]) & active[:, None]
        # the flag of every layer at once ([L, B, H] booleans: a tiny fusion), not the layer's slice read and
        # written back: on a GPU that slice is a copy of its own (an async dynamic-slice launch pair per
        # layer-step) whose host-computed, loop-dependent offset keeps XLA from taking the loop over layers into
        # one CUDA graph (docs/performance.md, twenty-fourth session)
        at_layer = (jnp.arange(L) == layer)[:, None, None]
        nonfinite = self.nonfinite | (at_layer & bad[None])
        return self.replace(res_k=res_k, res_v=res_v, v_min=v_min, v_max=v_max, v_norm_max=v_norm_max,
                            value_stats=value_stats, nonfinite=nonfinite, stack=None)

    def with_hot_used_marked(self, used: jax.Array) -> TieredKVCache:
        """This cache with the step (the sequence length) recorded in `hot_used` where used [B, H, K] (hot slots
        promoted this step; LRU bookkeeping, never read by a bound). With HOT_USED_STACKED a layer view also
        updates its stack's `hot_used` for every layer at once ([L, B, H, K] int32: a tiny fusion), so that
        `TieredModelCache.with_layer` stores it as is instead of writing the layer's row back: that row's read (a
        dynamic slice) and write are the last slice left in the rung-0 pass's loop body, on a GPU an async copy
        launch pair per layer-step that keeps `+WHILE` command buffers from taking the loop over layers into one
        graph (docs/performance.md, twenty-fifth session). The view's own row stays the layer's value, for the
        rungs that read it; both agree (STACK_TRACKED_FIELDS)."""
        row = jnp.where(used, self.lengths[:, None, None], self.hot_used)
        if not (HOT_USED_STACKED and self.is_stacked_view and "hot_used" in self.stack):
            return self.replace(hot_used=row)
        stacked = self.stack["hot_used"]
        L = stacked.shape[0]
        layer = jnp.where(self.layer < 0, self.layer + L, self.layer)  # the row a write of `layer` would update
        at = (jnp.arange(L) == layer)[:, None, None, None] & used[None]
        stack = {**self.stack, "hot_used": jnp.where(at, self.lengths[None, :, None, None], stacked)}
        return self.replace(hot_used=row, stack=stack)

    def needs_flush(self) -> jax.Array:
        """[B] bool: the residual block is full."""
        return (self.lengths - self.flushed) >= self.block_size

    def flush(self) -> TieredKVCache:
        """Move full residual blocks to tier 1 + tier 2 (a no-op unless one is full; one lax.cond)."""
        full = self.needs_flush()
        c = self.replace(stack=None)  # a layer view's stack would go stale in the flushing branch
        return jax.lax.cond(jnp.any(full), lambda c: c.flush_unconditionally(full), lambda c: c, c)

    def flush_unconditionally(self, full: jax.Array) -> TieredKVCache:
        """Flush the residual of the sequences where full [B] is set (no control flow of its own). In the stacked
        form every layer flushes at once (one batched quantization, one tier-2 write per block of all layers)."""
        c = self._store_blocks(jnp.expand_dims(self.res_k, -3), jnp.expand_dims(self.res_v, -3), full[:, None])
        c = c.with_value_stats()._keep_resident(full)  # (append's blocks: its _note_values recomputes them)
        return c.replace(flushed=c.flushed + jnp.where(full, c.block_size, 0))

    def _keep_resident(self, full: jax.Array) -> TieredKVCache:
        """The block being flushed (the residual, sequences where full [B]) also goes into the hot set, in each
        head's least recently used slot: a device-to-device copy, no tier-2 read (recent blocks are the ones
        attention most often wants next)."""
        lead = self.hot_ids.ndim - 3  # 1 for the stacked form
        slot = jnp.argmin(self.hot_used, axis=-1)  # [..., B, H]; never-used slots (-1) first
        flushed = self.flushed[0] if self.stacked else self.flushed
        stored = full & (flushed // self.block_size < self.num_blocks)
        put = (jnp.arange(self.k_max) == slot[..., None]) & stored.reshape((1,) * lead + (-1, 1, 1))  # [.., B, H, K]
        block_id = jnp.broadcast_to((flushed // self.block_size)[:, None, None], put.shape)
        return self.replace(
            stack=None,  # a layer view's stack no longer holds this hot set (`resliced`)
            hot_k=jnp.where(put[..., None, None], jnp.expand_dims(self.res_k, -3).astype(self.hot_k.dtype), self.hot_k),
            hot_v=jnp.where(put[..., None, None], jnp.expand_dims(self.res_v, -3).astype(self.hot_v.dtype), self.hot_v),
            hot_ids=jnp.where(put, block_id, self.hot_ids),
            hot_used=jnp.where(put, jnp.broadcast_to(self.lengths[..., None, None], put.shape), self.hot_used))

    def apply_pending_hot_sets(self) -> TieredKVCache:
        """The stacked form (a model's cache): make resident the blocks that a deferred rung 1 recorded in
        `hot_pending`, in every layer, and clear it. The same hot set that rung 1 would have left
        (`ladder.refresh_hot_set`: slots holding a candidate keep it, a missing candidate takes the least recently
        used slot whose block is not a candidate), the blocks copied from tier 2 straight into their slots. Call it
        under a lax.cond on `any(hot_pending >= 0)`: the common step has nothing pending."""
        if not self.stacked:
            raise ValueError("apply_pending_hot_sets works on a model's stacked cache (single-layer caches refresh "
                             "their hot set inside rung 1)")
        new_ids, _, fetch_into = select.plan_residency(self.hot_ids, self.hot_pending, self.hot_used)
        hot_k, hot_v = select.fetch_blocks_every_layer(self.hot_k, self.hot_v, self.host_k, self.host_v, fetch_into)
        take = fetch_into >= 0
        return self.replace(hot_k=hot_k, hot_v=hot_v, hot_ids=jnp.where(take, new_ids, self.hot_ids),
                            hot_used=jnp.where(take, self.lengths[:, :, None, None], self.hot_used),
                            hot_pending=jnp.full_like(self.hot_pending, -1), stack=None)

    def _store_blocks(self, blocks_k: jax.Array, blocks_v: jax.Array, store: jax.Array) -> TieredKVCache:
        """Quantize blocks [B, H, n, Bk, d] ([L, B, H, n, Bk, d] when stacked) into block slots flushed//Bk + j
        where store [B, n] is set (a stacked cache's layers share `flushed`: they flush together)."""
        B, H, n, Bk, d = blocks_k.shape[-5:]
        nb = self.num_blocks
        t1 = _quantize_blocks(blocks_k, blocks_v, self.key_bits, self.group_size, self.value_bits)
        flushed = self.flushed[0] if self.stacked else self.flushed
        ids = flushed[:, None] // Bk + jnp.arange(n)[None, :]  # [B, n]
        ids = jnp.where(store & (ids < nb), ids, nb)  # nb = out of range: dropped by the scatter
        b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, n))

        def put(buf, val):  # val [B, H, n, ...] -> buf[b, :, ids[b, j]] = val[b, :, j]
            return buf.at[b_idx, :, ids].set(jnp.moveaxis(val, 2, 1), mode="drop")

        put_all = jax.vmap(put) if self.stacked else put
        c = self.replace(**{name: put_all(getattr(self, name), x) for name, x in t1.items()})
        c = c.replace(**_running_maxima(c, t1, ids < nb))  # (value_stats: by the caller, once per write)
        host_k, host_v = _write_host_blocks(c.host_k, c.host_v, blocks_k, blocks_v, ids, nb, self.layer)
        # a layer view's stack no longer holds this view's tier 1: drop it (`tier1_arrays`, `resliced`)
        return c.replace(host_k=host_k, host_v=host_v, stack=None)

    def _note_values(self, k: jax.Array, v: jax.Array, valid: jax.Array, lost: jax.Array | None = None
                     ) -> TieredKVCache:
        """Update the running value range, the running value norm and the non-finite flag with the valid new
        tokens *as stored*.

        When the inputs are wider than the cache dtype (float32 into bf16/f16) the stored values are the inputs
        rounded: the extremes are rounded as the cast rounds them (`_stored_extremes`), so the range is the stored
        values' own, and the norm is widened by that rounding (`quant.narrowing_slack`); an input at or beyond the
        dtype's largest finite value (it may round to Inf) sets the flag. An f32 -> bf16 -> f32 round trip is not
        an option: XLA may elide it (excess precision, on GPU). (An f32 1002.1 is stored as 1000 in bf16; 7e4 is
        Inf in f16: an audit found a range recorded before the cast, 0.2 against a stored 4. Widening the range by
        half an ulp per side instead, as before, inflated the tolerance eps ||r|| up to 3x: values 1000 and 1004
        written as float32 into bf16 were certified against 2.96 eps times their stored range.) The norm is noted
        here, per token, rather than per flushed block plus the residual at every step: the step then reads one
        number (docs/performance.md, twenty-first session).
        """
        T = k.shape[1]
        mask = (jnp.arange(T)[None, :] < valid[:, None])[:, :, None, None]  # [B, T, 1, 1]
        k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
        lo = jnp.min(jnp.where(mask, v32, jnp.inf), axis=1)
        hi = jnp.max(jnp.where(mask, v32, -jnp.inf), axis=1)
        finite = jnp.isfinite(k32) & jnp.isfinite(v32)
        norms = quant.norm_upper(v32)  # [B, T, H]
        slack = quant.narrowing_slack(k.dtype, self.dtype)
        if slack is not None:
            lo, hi = _stored_extremes(lo, hi, self.dtype, slack)
            finite = finite & (jnp.abs(k32) < slack.fmax) & (jnp.abs(v32) < slack.fmax)
            norms = quant.widen_norm(norms, slack, v.shape[-1])
        v_min = jnp.minimum(self.v_min, lo)
        v_max = jnp.maximum(self.v_max, hi)
        v_norm_max = jnp.maximum(self.v_norm_max, jnp.max(jnp.where(mask[..., 0], norms, 0.0), axis=1))
        bad = jnp.any(mask & ~finite, axis=(1, 3))  # [B, H]
        if lost is not None:  # sequences whose tokens were dropped (`write_token`, `_check_room`)
            bad = bad | lost[:, None]
        return self.replace(v_min=v_min, v_max=v_max, v_norm_max=v_norm_max,
                            nonfinite=self.nonfinite | bad).with_value_stats()

    def with_value_stats(self) -> TieredKVCache:
        """This cache with `value_stats` recomputed from its running statistics (`bounds.value_statistics`); every
        write that changes v_min, v_max, v_err_max, v_scale_max or v_zero_max ends here."""
        cols = bounds.value_statistics(self.v_min, self.v_max, self.v_err_max, self.v_scale_max, self.v_zero_max,
                                       self.block_size, self.value_bits)
        return self.replace(value_stats=jnp.stack(cols, axis=-1))

    # ------------------------------------------------------------------ checks
    def _check_new(self, k: jax.Array, v: jax.Array) -> None:
        _check_kv(k, v)
        B, _, H, d = k.shape
        if (B, H, d) != (self.batch, self.num_kv_heads, self.head_dim):
            raise ValueError(f"new keys/values have (batch, kv heads, head_dim) = {(B, H, d)} but the cache holds "
                             f"{(self.batch, self.num_kv_heads, self.head_dim)}")

    def _check_room(self, valid: jax.Array) -> jax.Array:
        """Raise where writing valid [B] more tokens would run past the capacity (outside jit); returns the mask
        [B] of sequences that would (inside jit: their tokens past the capacity are dropped, so the caller
        poisons them; all False outside jit, where it raised instead)."""
        over = self.lengths + valid > self.capacity
        if is_concrete(over):
            if bool(jnp.any(over)):
                raise ValueError(f"KV cache overflow: appending would reach {int(jnp.max(self.lengths + valid))} "
                                 f"tokens but the capacity is {self.capacity}")
        return over

    def with_tier2_on_host(self) -> TieredKVCache:
        """This cache with tier 2 (host_k, host_v) in host memory again (`tiers.check_on_host` explains when it is
        not); a copy only where it is elsewhere."""
        if tiers.host_memory_kind() is None:
            return self

        def home(x):
            return x if jax.typeof(x).memory_space == jax.memory.Space.Host else tiers.to_host(x)

        return self.replace(host_k=home(self.host_k), host_v=home(self.host_v))

    # ------------------------------------------------------------------ exact view (tier 2 + residual)
    def exact_kv(self) -> tuple[jax.Array, jax.Array]:
        """All originals on the device, [B, H, capacity + Bk, d] each (tier 2 then the residual block
        overlaid at `flushed`; the extra Bk slots keep the overlay in range when the cache is full)."""
        B, H, nb, Bk, d = self.host_k.shape[-5:]
        pad = jnp.zeros((B, H, Bk, d), self.dtype)
        k = jnp.concatenate([tiers.read_all(self.host_k, self.layer).reshape(B, H, nb * Bk, d), pad], axis=2)
        v = jnp.concatenate([tiers.read_all(self.host_v, self.layer).reshape(B, H, nb * Bk, d), pad], axis=2)
        put = jax.vmap(lambda buf, blk, at: jax.lax.dynamic_update_slice(buf, blk, (0, at, 0)))
        return put(k, self.res_k, self.flushed), put(v, self.res_v, self.flushed)


class _Prefixed:
    """Array constructors that prepend a fixed leading shape (the stacked form's layer axis)."""

    def __init__(self, lead: tuple[int, ...], host: bool = True):
        self.lead, self.host = lead, host

    def zeros(self, shape, dtype):
        return jnp.zeros(self.lead + tuple(shape), dtype)

    def full(self, shape, value, dtype):
        return jnp.full(self.lead + tuple(shape), value, dtype)

    def zeros_on_host(self, shape, dtype):
        make = tiers.zeros_on_host if self.host else jnp.zeros
        return make(self.lead + tuple(shape), dtype)


def _write_residual_token(buf: jax.Array, new: jax.Array, r: jax.Array) -> jax.Array:
    """buf [B, H, Bk, d] with new [B, 1, H, d] at residual position r[b] (nothing written where r >= Bk, as
    `write_positions` drops it). A select over the residual block rather than a scatter: XLA turns a scatter at a
    traced position into a dynamic-update-slice guarded by a bounds-check reduction, a launch of its own per
    written array and layer-step on a GPU; the select fuses into the write-back (docs/performance.md, twentieth
    session). The residual block is small (Bk tokens), so rewriting it costs nothing measurable."""
    at = jnp.arange(buf.shape[-2])[None, None, :, None] == r[:, None, None, None]  # [B, 1, Bk, 1]
    return jnp.where(at, new.astype(buf.dtype).transpose(0, 2, 1, 3), buf)


# the per-layer arrays of a TieredKVCache that live on the device (tier 2, the layer index and a view's stack aside)
DEVICE_FIELDS = tuple(f.name for f in dataclasses.fields(TieredKVCache)
                      if f.metadata.get("pytree_node", True) and f.name not in ("host_k", "host_v", "layer", "stack"))
# The fields whose update on a layer view also updates the view's stack (`with_hot_used_marked`): where such a
# field's stacked array in the view's stack is a new one, it is the whole model's array with this layer's row set to
# the view's field, and `TieredModelCache.with_layer` stores it as is. Whatever changes one of these fields
# otherwise must drop the stack or leave the stack's array untouched (then the row is written back as usual).
STACK_TRACKED_FIELDS = ("hot_used",)


def _check_head_major(shape: tuple[int, ...], lengths: Any,
                      policy: CertPolicy) -> tuple[jax.Array, jax.Array | None]:
    """Check one layer's head-major shape [B, H, S, d] against the block size and lengths [B] (each in [0, S]);
    returns (lengths int32, the mask [B] of traced lengths outside [0, S], None outside jit:
    `validate.checked_counts`)."""
    _check_blocks(shape, policy)
    return checked_counts(lengths, shape[0], shape[2], "lengths")


def _check_blocks(shape: tuple[int, ...], policy: CertPolicy) -> None:
    """One layer's head-major shape [B, H, S, d]: the capacity S a multiple of the policy's block size."""
    if shape[2] % policy.block_size:
        raise ValueError(f"capacity {shape[2]} must be a multiple of the block size {policy.block_size}")


def _checked_policy(policy: CertPolicy | None) -> CertPolicy:
    """policy, or the default one for None; a TypeError for anything but a CertPolicy."""
    if policy is None:
        return CertPolicy()
    if not isinstance(policy, CertPolicy):
        raise TypeError(f"policy must be a certattn_jax.CertPolicy, got {type(policy).__name__}")
    return policy


def _active_mask(active: jax.Array | None, batch: int) -> jax.Array:
    """active [batch] bool (a token write's sequences that take their token; None: all of them)."""
    if active is None:
        return jnp.ones((batch,), bool)
    active = jnp.asarray(active)
    if active.shape != (batch,) or active.dtype != jnp.bool_:
        raise ValueError(f"active must be a [{batch}] bool mask, got {active.dtype}{list(active.shape)}")
    return active


def _check_live_layers(method: str, ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...], others: tuple = ()) -> None:
    """An eager conversion's inputs: every k, v (and `others`) concrete, no layer's k or v deleted (donated to an
    earlier call: it would fail only when its group runs, after earlier groups had written the cache)."""
    if not all(is_concrete(x) for x in (*others, *ks, *vs)):
        raise ValueError(f"{method} is eager only (a traced input)")
    dead = [i for i, kv in enumerate(zip(ks, vs, strict=True))
            if any(isinstance(x, jax.Array) and x.is_deleted() for x in kv)]
    if dead:
        raise ValueError(f"{method}: the keys or values of layer(s) {dead} were deleted (donated to an earlier call)")


def _poisoned(c: TieredKVCache, bad: jax.Array | None) -> TieredKVCache:
    """c with the sequences where bad [B] marked non-finite (never certified again: their contents are not what
    the caller meant, e.g. a traced length out of range); c itself where bad is None (`checked_counts` outside
    jit: the values were checked on the host)."""
    if bad is None:
        return c
    return c.replace(nonfinite=c.nonfinite | bad[:, None])


def _check_layers(ks: Sequence[jax.Array], vs: Sequence[jax.Array]) -> None:
    """Per-layer k, v [B, Hkv, S, d] of a model: as many values as keys, at least one, every layer's k and v of
    layer 0's shape and floating dtype."""
    if not ks or len(ks) != len(vs):
        raise ValueError(f"need as many key layers as value layers, at least one; got {len(ks)} and {len(vs)}")
    _check_kv(ks[0], vs[0])
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        if k.shape != ks[0].shape or v.shape != ks[0].shape or k.dtype != ks[0].dtype or v.dtype != k.dtype:
            raise ValueError(f"layer {i} holds k {k.shape} {k.dtype}, v {v.shape} {v.dtype}; layer 0 "
                             f"{ks[0].shape} {ks[0].dtype}")


def _check_kv(k: jax.Array, v: jax.Array) -> None:
    for name, x in (("keys", k), ("values", v)):
        if not (hasattr(x, "ndim") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be arrays (jax or NumPy), got {type(x).__name__}")
    if k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"keys and values must both be [B, T, Hkv, d]; got {k.shape} and {v.shape}")
    for name, x in (("keys", k), ("values", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got {x.dtype}")
    if k.dtype != v.dtype:
        raise TypeError(f"keys ({k.dtype}) and values ({v.dtype}) must share a dtype")


@functools.partial(jax.jit, static_argnames=("policy", "batched"))
def _from_head_major_impl(k: jax.Array, v: jax.Array, lengths: jax.Array, policy: CertPolicy,
                          batched: bool = False) -> TieredKVCache:
    """k, v [B, H, S, d], or [L, B, H, S, d] for the stacked form (every layer converted in one program: batched,
    as `stacked_from_layers`' direct path, or a layer at a time); tier 2 goes to the host in one copy per array."""
    if k.ndim == 5 and batched:
        c = jax.vmap(lambda kl, vl: _convert_on_device(kl, vl, lengths, policy))(k, v)
    elif k.ndim == 5:
        c = _convert_layers_on_device(k, v, lengths, policy)
    else:
        c = _convert_on_device(k, v, lengths, policy)
    return c.replace(host_k=tiers.to_host(c.host_k), host_v=tiers.to_host(c.host_v))


def _convert_layers_on_device(k: jax.Array, v: jax.Array, lengths: jax.Array, policy: CertPolicy) -> TieredKVCache:
    """`_convert_on_device` of every layer of k, v [L, B, H, S, d]: the stacked cache [L, B, ...], tier 2 still on
    the device. lax.map, not vmap: the conversion's float32 temporaries (errors, Gram matrices: ~6x a layer's K/V)
    then live for one layer, not for every layer at once (CPU memory analysis, 32 layers of 8B at 4K: 6.3x -> 2.2x
    the K/V; at 8B 128K the batched form tried to allocate 32 GiB on the H200; docs/performance.md)."""
    return jax.lax.map(lambda kv: _convert_on_device(kv[0], kv[1], lengths, policy), (k, v))


def _convert_on_device(k: jax.Array, v: jax.Array, lengths: jax.Array, policy: CertPolicy) -> TieredKVCache:
    """The cache holding k, v [B, H, S, d] (first lengths[b] valid), its tier 2 still in device memory. lengths are
    clipped to [0, S] here (a no-op for checked ones): a caller whose lengths were never read back (`from_dense`
    with host-given lengths) needs no program of its own for it."""
    B, H, S, d = k.shape
    lengths = jnp.clip(lengths, 0, S).astype(jnp.int32)
    Bk = policy.block_size
    nb = S // Bk
    c = TieredKVCache.init(batch=B, capacity=S, num_kv_heads=H, head_dim=d, dtype=k.dtype, policy=policy,
                           host=False)
    n_full = lengths // Bk  # [B]
    flushed = n_full * Bk
    full = jnp.arange(nb)[None, :] < n_full[:, None]  # [B, nb]
    blocks_k, blocks_v = k.reshape(B, H, nb, Bk, d), v.reshape(B, H, nb, Bk, d)
    t1 = _quantize_blocks(blocks_k, blocks_v, c.key_bits, c.group_size, c.value_bits)

    def keep(x):  # zero the slots of blocks that are not full (what init leaves there)
        return jnp.where(full.reshape(B, 1, nb, *(1,) * (x.ndim - 3)), x, jnp.zeros((), x.dtype))

    c = c.replace(**{name: keep(x) for name, x in t1.items()})
    c = c.replace(**_running_maxima(c, t1, full))  # (value_stats: by _note_values below)
    # the partial last block -> residual (exact), its invalid tail zeroed
    pick = jnp.minimum(n_full, nb - 1)[:, None, None, None, None]
    r_valid = (jnp.arange(Bk)[None, :] < (lengths - flushed)[:, None])[:, None, :, None]  # [B, 1, Bk, 1]
    res_k = jnp.where(r_valid, jnp.take_along_axis(blocks_k, pick, axis=2)[:, :, 0], 0).astype(k.dtype)
    res_v = jnp.where(r_valid, jnp.take_along_axis(blocks_v, pick, axis=2)[:, :, 0], 0).astype(k.dtype)
    in_tier2 = (jnp.arange(S)[None, :] < flushed[:, None])[:, None, :, None]  # [B, 1, S, 1]
    orig_k = jnp.where(in_tier2, k, 0).astype(k.dtype).reshape(B, H, nb, Bk, d)
    orig_v = jnp.where(in_tier2, v, 0).astype(v.dtype).reshape(B, H, nb, Bk, d)
    c = c.replace(res_k=res_k, res_v=res_v, host_k=orig_k, host_v=orig_v, flushed=flushed)
    c = c._note_values(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), lengths)
    return c.replace(lengths=lengths)


def _from_head_major(k: jax.Array, v: jax.Array, lengths: jax.Array, policy: CertPolicy) -> TieredKVCache:
    # jit (layout static) so the eager call compiles once per shape and its host arrays come out pinned_host; the
    # tolerances may be tracers (a policy passed through jit), and they play no part here
    # the stacked form batched as the eager direct path is (a loop of layers is a host round per layer on a GPU),
    # decided here: the jitted conversion must not read the group budget or form
    batched = k.ndim == 5 and converts_all_layers_batched(
        2 * math.prod(k.shape[1:]) * jnp.dtype(k.dtype).itemsize, k.shape[0])
    return commit_arrays(_from_head_major_impl(k, v, lengths, conversion_layout(policy), batched=batched))


# Staging K/V bytes one conversion program takes at most (`conversion_group_layers`); CERTATTN_CONVERT_GROUP_BYTES.
CONVERT_GROUP_BYTES = positive_int_from_env("CERTATTN_CONVERT_GROUP_BYTES", 256 * 2**20)


# How a conversion group's layers are converted inside its program (`_convert_layers_into`): "batched" (vmap: one
# pass of kernels for the whole group; its float32 temporaries, ~5 per K/V element of the group, are what
# CONVERT_GROUP_BYTES bounds: `conversion_temp_bytes`) or "loop" (lax.map: one layer's temporaries at a time, but on
# a GPU a while loop of the layer's kernels with a host round per iteration: the thirty-seventh session measured the
# loop form at 2.5x dense's TTFT at SmolLM2 1K and 0.5 s slower than a layer at a time at the 8B shape's 8K, where
# the 2026-12-02 batched stacked conversion had taken 1.5 ms for SmolLM2's 30 layers; the batched form is not yet
# measured on a GPU). CERTATTN_CONVERT_GROUP_FORM.
CONVERT_GROUP_FORMS = ("batched", "loop")
CONVERT_GROUP_FORM = choice_from_env("CERTATTN_CONVERT_GROUP_FORM", CONVERT_GROUP_FORMS, "batched")


# Whether `with_rows_converted` writes several layers per program into a preallocated cache (groups of
# `conversion_group_layers`), else a layer per program (the default). Measured on an H100 (thirty-eighth session,
# `probe_ttft_phases.py --quick`, the 8B shape at 8K, 7 layers per group): the 5 group programs took 558 ms batched
# and 562 ms looped against 84 ms for 32 programs of a layer, while one program for every layer whose outputs are
# the cache (`stacked_from_layers`'s direct path, SmolLM2 1K) took 2.4 ms against 41 ms. The cause inside the group
# programs is not located. CERTATTN_CONVERT_GROUPS_INTO=1 writes groups.
CONVERT_GROUPS_INTO = switch_from_env("CERTATTN_CONVERT_GROUPS_INTO") is True


def converts_all_layers_batched(layer_bytes: int, num_layers: int) -> bool:
    """Whether one batched program (vmap) converts every layer of a dense cache whose layers hold `layer_bytes` of
    K and V each: CONVERT_GROUP_FORM "batched" and one group (`conversion_group_layers`) holds them all. The eager
    direct path (`stacked_from_layers`), the traced stacked conversion and `prefill`'s conversion inside its last
    chunk all ask this."""
    return CONVERT_GROUP_FORM == "batched" and conversion_group_layers(layer_bytes, num_layers) == num_layers


def layers_per_program(layer_bytes: int, num_layers: int, preallocated: bool = False) -> int:
    """Layers one conversion program takes: into a preallocated cache (`with_rows_converted`, preallocated) a layer
    at a time, or `conversion_group_layers` with CONVERT_GROUPS_INTO; from a dense cache (`stacked_from_layers`)
    every layer where one group of the batched form holds them all (the program's outputs are the cache), else as
    into a preallocated one."""
    if not preallocated and converts_all_layers_batched(layer_bytes, num_layers):
        return num_layers
    return conversion_group_layers(layer_bytes, num_layers) if CONVERT_GROUPS_INTO else 1


def conversion_group_layers(layer_bytes: int, num_layers: int, budget: int | None = None) -> int:
    """Layers converted per program by `with_rows_converted`: as many as keep the program's staging K/V within
    `budget` bytes (CONVERT_GROUP_BYTES), at least 1. Each program costs a dispatch and a host round of its own
    (a layer at a time, SmolLM2's 30 layers made a 1K prompt's time to first token 3x dense's on an H100,
    docs/performance.md, thirty-sixth session), while a group holds a stacked copy of its K/V, its converted tier 2
    and (CONVERT_GROUP_FORM "batched") every layer's float32 temporaries on the device (a layer at a time keeps the
    8B shape's long contexts within the device)."""
    budget = CONVERT_GROUP_BYTES if budget is None else budget
    return int(max(1, min(num_layers, budget // max(int(layer_bytes), 1))))


def conversion_temp_bytes(layer_kv_elements: int, num_layers: int, itemsize: int, form: str | None = None) -> int:
    """Device temporaries of one conversion program (an upper estimate): `layer_kv_elements` elements of one
    layer's staging K and V together (every sequence converted), `itemsize` bytes each, `num_layers` layers in
    groups of `conversion_group_layers`. Per K/V element of a layer the conversion holds ~5 float32 temporaries
    (errors, Gram matrices, codes) and the group's stacked copy; XLA:CPU's memory analysis of `_convert_layers_into`
    (8 KV heads, d 128, 2K tokens) measured, in bytes per K/V element, 18.5 (bf16; 12.7 float32) a layer at a time,
    20.5-21 per element of the group batched, and 35-53 per element of one layer in the loop form with 2-8 layers
    per group (its stacked outputs). Counted: batched 24 per element of the group; loop 24 per element of one
    layer plus 4 itemsize per element of the group. `tests/test_staging_groups.py` checks it against XLA's memory
    analysis. On a GPU XLA fuses more: the H100's staged 8B 128K batch (thirty-fifth session) peaked with at most
    3.5 GB besides weights, tier 1 and staging while converting a 537 MB layer (<= 13 bytes per element), so this
    errs towards smaller staging groups there."""
    form = CONVERT_GROUP_FORM if form is None else form
    group = layers_per_program(layer_kv_elements * itemsize, num_layers)
    per_element = 24
    if form == "batched" or group == 1:
        return group * layer_kv_elements * per_element
    return layer_kv_elements * per_element + group * layer_kv_elements * 4 * itemsize


def _convert_batched(ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...], lengths: jax.Array,
                     policy: CertPolicy) -> TieredKVCache:
    """`_convert_on_device` of every layer k, v [n, H, S, d] of ks, vs under vmap: the stacked [g, n, ...] cache of
    the group, tier 2 still on the device."""
    return jax.vmap(lambda k, v: _convert_on_device(k, v, lengths, policy))(jnp.stack(ks), jnp.stack(vs))


@functools.partial(jax.jit, static_argnames=("policy",))
def _convert_all_layers(ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...], lengths: jax.Array,
                        policy: CertPolicy) -> TieredKVCache:
    """The stacked cache of every layer k, v [B, H, S, d] of a model in one batched program (one conversion group
    holds them all: `stacked_from_layers`), tier 2 moved to the host as the program's output; the same values, bit
    for bit, as a group written into a preallocated cache (`_convert_layers_into`)."""
    c = _convert_batched(ks, vs, lengths, policy)
    return c.replace(host_k=tiers.to_host(c.host_k), host_v=tiers.to_host(c.host_v))


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("policy", "form"))
def _convert_layers_into(store: TieredKVCache, ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...],
                         lengths: jax.Array, first: jax.Array, policy: CertPolicy, start: jax.Array,
                         form: str = "batched") -> TieredKVCache:
    """store (stacked [L, B, ...], donated) with layers first, first + 1, ... (one per k, v [n, H, S, d]) of
    sequences [start, start + n) converted (the first lengths[i] tokens valid). The group's layers are stacked and
    converted together (form "batched": `_convert_on_device` under vmap) or one after another ("loop":
    `_convert_layers_on_device`, as in `stacked_from_head_major`), then written as one slice per field; tier 2 goes
    to the host in one copy per array."""
    if form not in CONVERT_GROUP_FORMS:
        raise ValueError(f"unknown conversion group form {form!r}; one of {CONVERT_GROUP_FORMS}")
    if len(ks) == 1:  # a layer at a time: no stack, no loop
        c = jax.tree.map(lambda x: x[None], _convert_on_device(ks[0], vs[0], lengths, policy))
    elif form == "batched":
        c = _convert_batched(ks, vs, lengths, policy)
    else:
        c = _convert_layers_on_device(jnp.stack(ks), jnp.stack(vs), lengths, policy)

    def put(stacked: jax.Array, rows: jax.Array) -> jax.Array:  # rows [g, n, ...] at (first, start)
        return jax.lax.dynamic_update_slice(stacked, rows, (first, start) + (0,) * (rows.ndim - 2))

    host = {f: put(getattr(store, f), tiers.to_host(getattr(c, f))) for f in ("host_k", "host_v")}
    return store.replace(**{f: put(getattr(store, f), getattr(c, f)) for f in DEVICE_FIELDS}, **host)


def conversion_layout(policy: CertPolicy) -> CertPolicy:
    """The policy's layout fields alone (block, group, bits, k_max, v_max, hot slots): what a conversion depends
    on. The tolerances may be tracers (a policy passed through jit) and play no part there."""
    return CertPolicy(block_size=policy.block_size, group_size=policy.group_size, key_bits=policy.key_bits,
                      value_bits=policy.value_bits, k_max=policy.k_max, v_max=policy.v_max,
                      hot_slots=policy.hot_slots)


def _quantize_blocks(blocks_k: jax.Array, blocks_v: jax.Array, key_bits: int, group_size: int,
                     value_bits: int) -> dict[str, jax.Array]:
    """Tier-1 fields of blocks [B, H, n, Bk, d]: codes/scales/zeros [B, H, n, ...], v_err, v_mean_err, v_err_op
    [B, H, n]."""
    kc, ks, kz = quant.quantize_keys(blocks_k, key_bits)
    vc, vs, vz = quant.quantize_values(blocks_v, group_size, value_bits)
    v_hat = quant.dequantize_values(vc, vs, vz, group_size, value_bits)
    err = jnp.max(quant.token_error_norms(blocks_v, v_hat), axis=-1)
    return {"k_codes": kc, "k_scale": ks, "k_zero": kz, "v_codes": vc, "v_scale": vs, "v_zero": vz,
            "v_err": err,
            # bf16 rounded up (upper bounds stay upper bounds) keeps tier 1 within 44% of dense bf16
            "v_mean_err": quant.round_up_to_bf16(quant.mean_error_norm(blocks_v, v_hat)),
            "v_err_op": quant.round_up_to_bf16(quant.error_op_norm(blocks_v, v_hat))}


def _stored_extremes(lo: jax.Array, hi: jax.Array, dtype, slack: quant.NarrowingSlack,
                     ) -> tuple[jax.Array, jax.Array]:
    """The per-channel extremes lo, hi (float32) of values about to be cast to the narrower `dtype`, as that cast
    stores them: for bfloat16 and float16 rounded as the cast rounds (`quant.round_nearest_to`; rounding is
    monotone, so the rounded extremes are the stored values' extremes), for float32 (float64 tokens, with x64) as
    they are (lo, hi were taken of the float32 values themselves). Within float32's smallest normal TINY of 0 a
    platform may store 0 instead (it flushes subnormal inputs, and XLA:CPU's min / max may read them as 0): there
    each extreme also covers 0 and moves out by TINY, so the recorded range covers the stored one and exceeds it by
    at most 3 TINY per channel (an extreme of exactly TINY is recorded as [-TINY, 2 TINY]; `bounds.tolerance_range`
    takes that off again). Other narrow dtypes (float8) are widened by half an ulp per side (`slack`): an upper
    bound, but their tolerance may then exceed eps times the stored range by that much (docs/bounds.md section 3)."""
    dt = jnp.dtype(dtype)
    if dt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        lo, hi = quant.round_nearest_to(lo, dt), quant.round_nearest_to(hi, dt)
    elif dt != jnp.dtype(jnp.float32):
        lo = jnp.where(jnp.isfinite(lo), lo - jnp.abs(lo) * slack.rel - slack.absolute, lo)
        hi = jnp.where(jnp.isfinite(hi), hi + jnp.abs(hi) * slack.rel + slack.absolute, hi)
        return lo, hi
    tiny = bounds.TINY
    lo = jnp.where(jnp.abs(lo) <= tiny, jnp.minimum(lo, 0.0) - tiny, lo)
    hi = jnp.where(jnp.abs(hi) <= tiny, jnp.maximum(hi, 0.0) + tiny, hi)
    return lo, hi


def _running_maxima(c: TieredKVCache, t1: dict[str, jax.Array], stored: jax.Array) -> dict[str, jax.Array]:
    """The running maxima (v_err_max, v_scale_max, v_zero_max) of cache c after storing the blocks of
    t1 ([..., B, H, n, ...], `_quantize_blocks`) where stored [B, n]. A maximum over a superset of the valid
    blocks only loosens the bounds that read it (they are upper bounds), so nothing is ever subtracted."""
    ok = stored[:, None, :]  # [B, 1, n]: broadcasts over a leading layer axis and the heads

    def per_block(x):  # [..., B, H, n] -> [..., B, H], blocks not stored as 0
        return jnp.max(jnp.where(ok, jnp.abs(x.astype(jnp.float32)), 0.0), axis=-1)

    def per_group(x):  # [..., B, H, n, Bk, ng] -> [..., B, H, ng]
        return jnp.max(jnp.where(ok[..., None, None], jnp.abs(x.astype(jnp.float32)), 0.0), axis=(-3, -2))

    return {"v_err_max": jnp.maximum(c.v_err_max, per_block(t1["v_err"])),
            "v_scale_max": jnp.maximum(c.v_scale_max, per_group(t1["v_scale"])),
            "v_zero_max": jnp.maximum(c.v_zero_max, per_group(t1["v_zero"]))}


def _write_host_blocks(host_k, host_v, blocks_k, blocks_v, ids, nb, layer=None):
    """Tier-2 writes, one block (all heads; all layers for a stacked cache's blocks [L, B, H, n, Bk, d]) at a
    time, only for the stored ones (host arrays take no scatter)."""
    B, n = ids.shape

    def body(e, hosts):
        b, j = e // n, e % n
        blk_id = ids[b, j]

        def write(h):
            hk, hv = h
            return (tiers.write_block(hk, blocks_k[..., b, :, j, :, :], b, blk_id, layer),
                    tiers.write_block(hv, blocks_v[..., b, :, j, :, :], b, blk_id, layer))

        return jax.lax.cond(blk_id < nb, write, lambda h: h, hosts)

    return jax.lax.fori_loop(0, B * n, body, (host_k, host_v))
