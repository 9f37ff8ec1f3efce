"""Large 1-byte arrays and the compiled kernels' 32-bit offsets (`pallas_kernels.backend.offsets_fit`).

Pallas's Triton lowering addresses an array with 32-bit offsets unless it is larger than 2**32 bytes, so a
1-byte array (INT8 / packed INT4 codes) of 2**31 to 2**32 elements cannot be read correctly by a compiled kernel:
the offsets wrap. A model's stacked codes reach that size (the 8B shape's key codes at 64K-128K tokens), so the
kernels read a layer in place only where they can address the stack, and the tier-1 kernel runs only on codes it
can address. Everything here is abstract (shapes, cross-lowering): nothing of that size is allocated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from certattn_jax import step
from certattn_jax.cache import TieredKVCache
from certattn_jax.policy import CertPolicy
from pallas_kernels import backend


@pytest.mark.parametrize("elements,dtype,fits", [
    (2**31, jnp.uint8, True),            # the last offset, 2**31 - 1, fits a signed 32-bit integer
    (2**31 + 64, jnp.uint8, False),      # 32-bit offsets (at most 2**32 bytes) that wrap
    (2**32, jnp.uint8, False),
    (2**32 + 64, jnp.uint8, True),       # more than 2**32 bytes: the lowering takes 64-bit offsets
    (2**31, jnp.bfloat16, True),
    (2**31 + 64, jnp.bfloat16, True),    # 2-byte elements: past 2**31 of them is past 2**32 bytes
    (2**30 + 64, jnp.float32, True),
])
def test_which_arrays_a_compiled_kernel_can_address(elements, dtype, fits):
    assert backend.offsets_fit((elements // 64, 64), dtype) is fits
    assert backend.arrays_fit(jax.ShapeDtypeStruct((64, elements // 64), dtype)) is fits


def _lowered_offset_types(shape, dtype, capsys) -> set[str]:
    """The integer types of the offsets added to the 1-byte input's pointers (`tt.addptr` on `!tt.ptr<i8>`) in the
    Triton IR of a kernel reading row l of an array of this shape, cross-lowered for CUDA here (no GPU, nothing
    allocated; `debug=True` prints the IR)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    L, n = shape

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...].astype(jnp.float32)

    def f(x):
        return pl.pallas_call(kernel, grid=(L,), in_specs=[pl.BlockSpec((None, 128), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((None, 128), lambda i: (i, 0)),
                              out_shape=jax.ShapeDtypeStruct((L, 128), jnp.float32), interpret=False, debug=True,
                              compiler_params=pl_triton.CompilerParams(num_warps=1, num_stages=1))(x)

    capsys.readouterr()
    allow = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=allow)(jax.ShapeDtypeStruct(shape, dtype))
    ir = capsys.readouterr().out
    return {line.rsplit("tensor<128x", 1)[-1].split(">")[0] for line in ir.splitlines()
            if "tt.addptr" in line and "!tt.ptr<i8>" in line}


def test_the_lowering_uses_32_bit_offsets_up_to_2_to_the_32_bytes(capsys):
    """Pins the rule `offsets_fit` encodes: a 3 GiB uint8 array is addressed with 32-bit offsets (which wrap past
    2**31), a 5 GiB one with 64-bit offsets. If a jax release changes this, this test says so (and
    `offsets_fit` may be relaxed)."""
    assert _lowered_offset_types((3, 2**30), jnp.uint8, capsys) >= {"i32"}
    assert not backend.offsets_fit((3, 2**30), jnp.uint8)
    assert "i32" not in _lowered_offset_types((5, 2**30), jnp.uint8, capsys)
    assert backend.offsets_fit((5, 2**30), jnp.uint8)


def _view(num_layers: int, capacity: int) -> TieredKVCache:
    """Layer 0's view of an 8B-shaped model cache (8 KV heads, d = 128, blocks of 64), abstract."""
    from certattn_jax.model_cache import TieredModelCache

    policy = CertPolicy(block_size=64, group_size=32, k_max=8, tier1="pallas", rung0="fused")
    return jax.eval_shape(lambda: TieredModelCache.init(
        num_layers=num_layers, batch=1, capacity=capacity, num_kv_heads=8, num_q_heads=32, head_dim=128,
        dtype=jnp.bfloat16, policy=policy).layer_view(0))


def test_a_model_whose_stacked_codes_the_kernels_cannot_address_reads_each_layers_own():
    """The 8B shape at 96K tokens: 32 layers of key codes are 3 GiB (32-bit offsets that wrap), so the kernels get
    the layer's own arrays (a slice each layer-step) and the fused rung 0 is checked in that form; at 32K (1 GiB)
    they read the stack in place. The tier-1 kernel still runs on the layer's own codes (96 MiB)."""
    big, small = _view(32, 96 * 1024), _view(32, 32 * 1024)
    assert big.is_stacked_view and not big.kernels_read_stack_in_place
    assert small.kernels_read_stack_in_place
    arrays, layer = big.tier1_arrays()
    assert layer is None and arrays[0].shape == big.k_codes.shape  # the layer's own codes
    assert small.tier1_arrays()[1] is not None and small.slot_arrays()[0].ndim == small.hot_k.ndim + 1
    assert len(big.slot_arrays()) == 5 and big.slot_arrays()[0].shape == big.hot_k.shape
    assert step.tier1_kernel_runs(big, "pallas") and step.tier1_kernel_runs(small, "pallas")


def test_codes_the_tier1_kernel_cannot_address_at_all_take_the_jnp_path():
    """One layer's codes of 2**31 to 2**32 bytes (batch 18 at 128K of the 8B shape: 2.25 GiB of key codes): the
    tier-1 kernel does not run on them (the jnp path does, correctly)."""
    policy = CertPolicy(block_size=64, group_size=32, k_max=8, tier1="pallas")
    cache = jax.eval_shape(lambda: TieredKVCache.init(batch=18, capacity=128 * 1024, num_kv_heads=8, head_dim=128,
                                                      dtype=jnp.bfloat16, policy=policy))
    assert not backend.arrays_fit(cache.k_codes) and not step.tier1_kernel_runs(cache, "pallas")
    fits = jax.eval_shape(lambda: TieredKVCache.init(batch=1, capacity=128 * 1024, num_kv_heads=8, head_dim=128,
                                                     dtype=jnp.bfloat16, policy=dataclasses.replace(policy)))
    assert step.tier1_kernel_runs(fits, "pallas")


def test_the_gather_kernel_and_the_stacked_weight_kernel_refuse_what_they_cannot_address(monkeypatch):
    """The other kernels' inputs are wide in every shipped configuration, but a 1-byte cache dtype (float8) or
    1-byte weights of 2-4 GiB would wrap too: the gather kernel is not used for such a tier 2 (even when forced),
    and the stacked-weight GEMM reads such a weight's row instead (a copy)."""
    from certattn_jax import select
    from models import llama

    monkeypatch.setattr(select, "FETCH_KERNEL", True)
    host = jax.ShapeDtypeStruct((32, 1, 8, 1536, 64, 128), jnp.float8_e4m3fn)  # 3 GiB of 1-byte tier 2
    dst = jax.ShapeDtypeStruct((1, 8, 16, 64, 128), jnp.float8_e4m3fn)
    assert not select.fetch_by_kernel(host, dst)
    assert select.fetch_by_kernel(jax.ShapeDtypeStruct(host.shape, jnp.bfloat16), dst)
    big = jax.ShapeDtypeStruct((32, 4096, 28672), jnp.float8_e4m3fn)  # the 8B w_gate_up in 1-byte elements
    row = jax.eval_shape(lambda w: llama._row("w_gate_up", w, jnp.int32(3), True), big)
    assert not isinstance(row, llama.StackedWeight) and row.shape == (4096, 28672)
    wide = jax.eval_shape(lambda w: llama._row("w_gate_up", w, jnp.int32(3), True),
                          jax.ShapeDtypeStruct(big.shape, jnp.bfloat16))
    assert isinstance(wide, llama.StackedWeight) == llama.stacked_kernel.supports(4096, 28672)
