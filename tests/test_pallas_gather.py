"""pallas_kernels.gather_blocks (rung 1's tier-2 read in one launch) against its jnp reference.

On the CPU the kernel runs interpreted over device arrays; on a GPU it reads pinned-host tier 2 in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certattn_jax import tiers
from pallas_kernels import backend
from pallas_kernels.gather_blocks import gather_blocks, gather_reference


def _tier2(rng, shape, dtype):
    x = jnp.asarray(rng.normal(size=shape), dtype)
    # the interpreter cannot read host operands; a compiled kernel reads them where they live
    return x if backend.interpret() else tiers.to_host(x)


@pytest.mark.parametrize("stacked", [False, True], ids=["one layer", "stacked"])
@pytest.mark.parametrize("B,H,nb,S", [(1, 3, 5, 16), (2, 2, 7, 3)])
def test_the_kernel_fills_wanted_slots_and_leaves_the_rest(stacked, B, H, nb, S):
    rng = np.random.default_rng(B * 100 + nb * 10 + S + stacked)
    Bk, d = 16, 32
    lead = (3,) if stacked else ()
    host_k = _tier2(rng, lead + (B, H, nb, Bk, d), jnp.bfloat16)
    host_v = _tier2(rng, lead + (B, H, nb, Bk, d), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(-1, nb, size=(B, H, S)), jnp.int32)
    ids = ids.at[0, 0, 0].set(nb - 1).at[-1, -1, -1].set(-1)  # the last block, and one slot left alone
    poison = jnp.full((B, H, S, Bk, d), jnp.nan, jnp.float32)  # written slots must overwrite it, others keep it
    layer = jnp.int32(2) if stacked else None
    got = jax.jit(gather_blocks)(poison, poison, host_k, host_v, ids, layer)
    dev = (lambda x: x) if backend.interpret() else tiers.to_device
    want = gather_reference(poison, poison, dev(host_k), dev(host_v), ids, layer)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))  # NaN where left alone, in both
    kept = np.asarray(ids) < 0
    assert np.all(np.isnan(np.asarray(got[0])[kept])) and not np.any(np.isnan(np.asarray(got[1])[~kept]))


def test_every_layer_at_once():
    """A stacked tier 2 without a layer index and fetch_ids [L, B, H, S]: each layer's slots from that layer."""
    rng = np.random.default_rng(3)
    L, B, H, nb, S, Bk, d = 3, 2, 2, 5, 4, 16, 32
    host_k = _tier2(rng, (L, B, H, nb, Bk, d), jnp.bfloat16)
    host_v = _tier2(rng, (L, B, H, nb, Bk, d), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(-1, nb, size=(L, B, H, S)), jnp.int32)
    poison = jnp.full((L, B, H, S, Bk, d), jnp.nan, jnp.bfloat16)
    got = jax.jit(gather_blocks)(poison, poison, host_k, host_v, ids)
    dev = (lambda x: x) if backend.interpret() else tiers.to_device
    for lay in range(L):
        want = gather_reference(poison[lay], poison[lay], dev(host_k)[lay], dev(host_v)[lay], ids[lay])
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g[lay], np.float32), np.asarray(w, np.float32))


def test_no_wanted_block_changes_nothing():
    rng = np.random.default_rng(1)
    host = _tier2(rng, (1, 2, 4, 16, 32), jnp.bfloat16)
    dst = jnp.asarray(rng.normal(size=(1, 2, 3, 16, 32)), jnp.bfloat16)
    got = jax.jit(gather_blocks)(dst, dst, host, host, jnp.full((1, 2, 3), -1, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(dst))


@pytest.mark.skipif(backend.interpret(), reason="a compiled kernel on a GPU: tier 2 read in pinned host memory")
def test_the_compiled_kernel_does_not_copy_tier2_whole():
    rng = np.random.default_rng(2)
    host = _tier2(rng, (2, 1, 2, 64, 64, 64), jnp.bfloat16)  # [L, B, H, nb, Bk, d]
    dst = jnp.zeros((1, 2, 8, 64, 64), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(-1, 64, size=(1, 2, 8)), jnp.int32)
    hlo = jax.jit(gather_blocks).lower(dst, dst, host, host, ids, jnp.int32(1)).compile().as_text()
    moves = [ln for ln in hlo.splitlines() if "[2,1,2,64,64,64]" in ln.split("=")[0] and "copy" in ln]
    assert not moves, moves


def test_bad_shapes_are_named():
    x = jnp.zeros((1, 2, 4, 16, 32))
    with pytest.raises(ValueError, match="fetch_ids"):
        gather_blocks(x[:, :, :3], x[:, :, :3], x, x, jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="layer"):
        gather_blocks(x[:, :, :3], x[:, :, :3], x[None], x[None], jnp.zeros((1, 2, 3), jnp.int32))
    with pytest.raises(ValueError, match="disagree"):
        gather_blocks(x[:, :, :3], x[:, :, :3], x, x, jnp.zeros((1, 3, 3), jnp.int32))


@pytest.mark.parametrize("every_layer", [False, True], ids=["one layer of a stack", "every layer"])
def test_the_kernel_lowers_to_triton(every_layer, monkeypatch):
    """Cross-lower the compiled kernel for CUDA on this machine (what the Pallas Triton lowering rejects shows
    here without a GPU; Triton's own compile to PTX runs only on the GPU)."""
    monkeypatch.setenv("CERTATTN_PALLAS_INTERPRET", "0")
    host = jnp.zeros((3, 2, 2, 5, 16, 32), jnp.bfloat16)  # [L, B, H, nb, Bk, d]
    if every_layer:
        dst, ids = jnp.zeros((3, 2, 2, 4, 16, 32), jnp.bfloat16), jnp.zeros((3, 2, 2, 4), jnp.int32)
        f = jax.jit(lambda d, h, i: gather_blocks(d, d, h, h, i, interpret=False))
        args = (dst, host, ids)
    else:
        dst, ids = jnp.zeros((2, 2, 4, 16, 32), jnp.bfloat16), jnp.zeros((2, 2, 4), jnp.int32)
        f = jax.jit(lambda d, h, i, lay: gather_blocks(d, d, h, h, i, lay, interpret=False))
        args = (dst, host, ids, jnp.int32(1))
    allow = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = jax.export.export(f, platforms=["cuda"], disabled_checks=allow)(*args).mlir_module()
    assert "xla.gpu.triton" in text
