"""The stacked-weight GEMM kernel (pallas_kernels.stacked_matmul) against float64 and its XLA reference, on fresh
random inputs (interpret mode on the CPU; compiled on a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.stacked_matmul import default_tiling, stacked_matmul, stacked_matmul_reference, supports


def _inputs(seed, M, K, N, L=3, dtype=jnp.bfloat16):
    kx, kw = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, (M, K), jnp.float32).astype(dtype),
            jax.random.normal(kw, (L, K, N), jnp.float32).astype(dtype))


@pytest.mark.parametrize("M,K,N,tiling", [
    (1, 256, 384, {}),                                          # one row: the vector path, default tiling
    (1, 192, 128, dict(block_k=32, splits=3, tile_acc=False)),  # one row, reduced every k step
    (1, 256, 128, dict(block_k=32, splits=2, unroll=2)),        # one row, two k tiles loaded per loop step
    (1, 256, 128, dict(block_k=32, splits=2, tile_acc=True, unroll=4)),  # tile accumulation, four per step
    (1, 192, 128, dict(block_k=32, splits=2, dot=True)),        # one row on the MMA path (padded to 16)
    (5, 256, 128, dict(block_k=32, splits=2, unroll=2)),        # the dot path, two k tiles per loop step
    (3, 256, 128, dict(block_n=64, block_k=64, splits=2)),      # rows padded to 16 for the dot
    (20, 128, 64, {}),                                          # rows padded to 32
])
def test_stacked_matmul_matches_float64_for_every_layer(M, K, N, tiling):
    """Every layer of the stack: within one output rounding (bf16: 2^-8 relative) of the float64 product, and as
    close to it as XLA's own GEMM on the copied row."""
    x, w = _inputs(M * 1000 + K + N, M, K, N)
    for layer in range(w.shape[0]):
        got = stacked_matmul(x, w, jnp.int32(layer), **tiling)
        assert got.shape == (M, N) and got.dtype == x.dtype
        exact = np.asarray(x, np.float64) @ np.asarray(w[layer], np.float64)
        err = np.abs(np.asarray(got, np.float64) - exact)
        assert np.all(err <= 2.0 ** -8 * np.abs(exact) + 1e-6 * np.max(np.abs(exact))), (layer, float(err.max()))
        ref_err = np.abs(np.asarray(stacked_matmul_reference(x, w, layer), np.float64) - exact)
        assert err.max() <= 2 * ref_err.max() + 1e-6


def test_stacked_matmul_float32_reads_the_named_layer():
    """float32 operands: the product of the named layer to float32 rounding, and a different layer's differs; the
    index is clipped into [0, L) like the other stacked kernels' layer inputs."""
    x, w = _inputs(7, 2, 64, 32, L=4, dtype=jnp.float32)
    exact = np.einsum("mk,lkn->lmn", np.asarray(x, np.float64), np.asarray(w, np.float64))
    for layer in range(4):
        np.testing.assert_allclose(np.asarray(stacked_matmul(x, w, layer)), exact[layer], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(stacked_matmul(x, w, 9)), exact[3], rtol=1e-5, atol=1e-5)


def test_stacked_matmul_refuses_bad_inputs():
    x, w = _inputs(8, 2, 64, 32)
    with pytest.raises(ValueError, match="x \\[M, K\\] and w \\[L, K, N\\]"):
        stacked_matmul(x[None], w, 0)
    with pytest.raises(ValueError, match="x has 32 columns but w\\[layer\\] has 64 rows"):
        stacked_matmul(x[:, :32], w, 0)
    with pytest.raises(TypeError, match="floating"):
        stacked_matmul(x.astype(jnp.int32), w, 0)
    with pytest.raises(ValueError, match="does not divide"):
        stacked_matmul(x, w, 0, block_k=64, splits=2)
    with pytest.raises(ValueError, match="does not divide"):
        stacked_matmul(x, w, 0, block_k=16, splits=1, unroll=3)


def test_default_tiling_and_supports():
    """Enough programs for the 8B decode GEMMs (about two per SM of an H200), whole k tiles per split; Triton's
    power-of-two tiles decide `supports` when compiled (interpret mode takes any)."""
    for K, N in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (576, 960)):
        block_n, block_k, splits = default_tiling(1, K, N)
        assert N % block_n == 0 and K % (block_k * splits) == 0
        assert (N // block_n) * splits >= min(264, (N // block_n) * (K // block_k))
    assert supports(4096, 6144)


def test_every_tuned_setting_tiles_its_shape():
    """The measured table (`TUNED`, compiled only): each entry tiles its own shape exactly (whole column tiles,
    whole k tiles per split, whole unrolled steps) with power-of-two tiles Triton compiles, and names only
    settings the kernel takes."""
    from pallas_kernels.stacked_matmul import TUNED

    allowed = {"block_n", "block_k", "splits", "num_warps", "num_stages", "tile_acc", "dot", "unroll"}
    assert TUNED
    for (rows, K, N), s in TUNED.items():
        assert set(s) <= allowed, s
        bn, bk, splits, unroll = s["block_n"], s["block_k"], s["splits"], s.get("unroll", 1)
        assert N % bn == 0 and K % (bk * splits) == 0 and (K // (bk * splits)) % unroll == 0, (rows, K, N, s)
        assert all(v & (v - 1) == 0 for v in (bn, bk, s["num_warps"])), s
        assert rows == 1 or rows >= 16


def test_a_tuning_file_overrides_the_table(tmp_path, monkeypatch):
    """CERTATTN_STACKED_TUNING names a file of measured settings (scripts/pick_stacked_tiling.py); a file that is
    not a list of {rows, K, N, settings} entries is refused by name."""
    from pallas_kernels import stacked_matmul as sm

    f = tmp_path / "tuning.json"
    f.write_text('[{"rows": 1, "K": 64, "N": 32, "settings": {"block_n": 32, "block_k": 16, "splits": 2}}]')
    monkeypatch.setenv(sm.TUNING_ENV, str(f))
    assert sm.tuned_settings(1, 64, 32) == {"block_n": 32, "block_k": 16, "splits": 2}
    assert sm.tuned_settings(4, 64, 32) == {}
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": 1}')
    monkeypatch.setenv(sm.TUNING_ENV, str(bad))
    with pytest.raises(ValueError, match="CERTATTN_STACKED_TUNING"):
        sm.tuned_settings(1, 64, 32)
