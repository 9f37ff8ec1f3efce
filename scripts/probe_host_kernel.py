"""Can a Pallas kernel read tier 2 where it lives, in pinned host memory, without XLA copying it whole first?

    PYTHONPATH=. python scripts/probe_host_kernel.py --out results/probe_host_kernel.json
    PYTHONPATH=. python scripts/probe_host_kernel.py --smoke      # tiny, CPU (interpret mode): the script runs

Why (docs/performance.md, 2026-12-02): on real text the certified step's cost is rung 1's tier-2 read. The block
loop (`select.fetch_blocks`) moves ~14 µs per block on the H200 (2.3 GB/s), where the host link carries 26-33
GB/s; rung 1 needs one transfer per layer. On a GPU with unified addressing a kernel can dereference pinned
host memory itself, so a kernel handed tier 2 could gather the wanted blocks in one launch -- if XLA passes the
pinned-host buffer to the custom call as it is.

For tier-2 arrays [N, Bk, d] of two sizes (--mib), S wanted blocks gathered into a device array [S, Bk, d] by:
  kernel_host    a Pallas kernel given the pinned-host array itself (one program per wanted block)
  kernel_device  the same kernel given a device copy made outside the timed call (the reference speed)
  loop           `select.fetch_blocks`: a dynamic slice + transfer per block in a loop counted on the device
  unrolled       the same per slot in straight-line code (`select.FETCH_UNROLL_UP_TO`)
  gather_blocks  `pallas_kernels.gather_blocks` (rung 1's fetch kernel: one program per slot, outputs aliased to
                 the slots) on the pinned-host array (on the CPU: interpreted over a device copy)
  host_compute   the gather computed by the host CPU (`jax.experimental.compute_on("device_host")`) on the
                 pinned-host array, then one host-to-device copy of the S gathered blocks
Per variant and size: compiled or the error, correct (equals the numpy gather), µs per call (device-timed from
the difference of two loop lengths in one jit), and whether the compiled HLO holds an instruction of the
array's whole shape that moves it (a copy / transfer of all of tier 2). kernel_host correct, its time flat in the
array size and no whole-array move = zero-copy reads work.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def gather_kernel(ids_ref, x_ref, o_ref):
    """o[0] = x[ids[0]]: one wanted block per program."""
    import jax.experimental.pallas as pl

    blk = ids_ref[0]
    o_ref[...] = x_ref[pl.ds(blk, 1), :, :]


def kernel_gather(x, ids, interpret: bool):
    import jax
    import jax.experimental.pallas as pl

    N, Bk, d = x.shape
    S = ids.shape[0]
    return pl.pallas_call(
        gather_kernel, grid=(S,),
        in_specs=[pl.BlockSpec((1,), lambda s: (s,)), pl.BlockSpec((N, Bk, d), lambda s: (0, 0, 0))],
        out_specs=pl.BlockSpec((1, Bk, d), lambda s: (s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((S, Bk, d), x.dtype), interpret=interpret)(ids, x)


def block_fetch(x, ids, unroll: bool):
    """`select.fetch_blocks` of blocks ids [S] of x [N, Bk, d] (tier 2), by its loop or unrolled per slot."""
    import jax.numpy as jnp

    from certattn_jax import select

    N, Bk, d = x.shape
    S = ids.shape[0]
    old = select.FETCH_UNROLL_UP_TO
    select.FETCH_UNROLL_UP_TO = (1 << 30) if unroll else 0  # read while tracing
    try:
        h5 = x.reshape(1, 1, N, Bk, d)
        dst = jnp.zeros((1, 1, S, Bk, d), x.dtype)
        got, _ = select.fetch_blocks(dst, dst, h5, h5, ids.reshape(1, 1, S))
    finally:
        select.FETCH_UNROLL_UP_TO = old
    return got.reshape(S, Bk, d)


def host_compute_gather(x, ids):
    """x [N, Bk, d] in pinned host memory: gather blocks ids [S] on the host CPU, then one transfer of [S, Bk, d]."""
    import jax
    from jax.experimental import compute_on as co

    # jax 0.11's function transform compute_on(f, *, compute_type, out_memory_spaces); jax 0.10 names it compute_on2.
    # No bounds check in the gather: its comparison constants would live in device memory, beside host operands.
    transform = getattr(co, "compute_on2", None) or co.compute_on
    take = transform(jax.jit(lambda xh, ih: xh.at[ih].get(mode="promise_in_bounds")), compute_type="device_host",
                     out_memory_spaces=jax.memory.Space.Host)
    return jax.device_put(take(x, jax.device_put(ids, jax.memory.Space.Host)), jax.memory.Space.Device)


def product_kernel(x, ids):
    """`pallas_kernels.gather_blocks` of blocks ids [S] of x [N, Bk, d] (tier 2 of one head)."""
    import jax.numpy as jnp

    from certattn_jax import tiers
    from pallas_kernels import backend, gather_blocks

    N, Bk, d = x.shape
    S = ids.shape[0]
    h5 = x.reshape(1, 1, N, Bk, d)
    if backend.interpret():
        h5 = tiers.to_device(h5)
    dst = jnp.zeros((1, 1, S, Bk, d), x.dtype)
    got, _ = gather_blocks.gather_blocks(dst, dst, h5, h5, ids.reshape(1, 1, S))
    return got.reshape(S, Bk, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", nargs="+", type=int, default=[64, 512], help="tier-2 array sizes, MiB")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--wanted", type=int, default=64, help="blocks gathered per call (S)")
    ap.add_argument("--n1", type=int, default=4)
    ap.add_argument("--n2", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.mib, args.block, args.head_dim, args.wanted, args.n1, args.n2, args.reps = [1], 16, 32, 4, 1, 2, 1

    import jax
    import jax.numpy as jnp
    import numpy as np

    from certattn_jax import tiers

    interpret = jax.default_backend() != "gpu"
    dev = jax.devices()[0]
    out = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
           "host_memory_kind": tiers.host_memory_kind(), "block": args.block, "head_dim": args.head_dim,
           "wanted": args.wanted, "rows": []}
    rng = np.random.default_rng(0)
    for mib in args.mib:
        N = max(args.wanted, mib * 2**20 // (args.block * args.head_dim * 2))
        x_np = rng.standard_normal((N, args.block, args.head_dim), dtype=np.float32).astype(jnp.bfloat16)
        ids_np = np.sort(rng.choice(N, args.wanted, replace=False)).astype(np.int32)
        want = x_np[ids_np].astype(np.float32)
        x_host = tiers.to_host(jnp.asarray(x_np))
        x_dev = jax.device_put(jnp.asarray(x_np), dev)
        ids = jax.device_put(jnp.asarray(ids_np), dev)
        Bk, d = args.block, args.head_dim

        variants = {"kernel_host": (lambda x, ids: kernel_gather(x, ids, interpret), x_host),
                    "kernel_device": (lambda x, ids: kernel_gather(x, ids, interpret), x_dev),
                    "loop": (lambda x, ids: block_fetch(x, ids, False), x_host),
                    "unrolled": (lambda x, ids: block_fetch(x, ids, True), x_host),
                    "gather_blocks": (product_kernel, x_host),
                    "host_compute": (host_compute_gather, x_host)}
        whole = re.compile(rf"\[{N},{Bk},{d}\]")
        for name, (fn, x) in variants.items():
            row = {"variant": name, "mib": mib, "blocks_total": N}
            try:
                once = jax.jit(fn)
                hlo = once.lower(x, ids).compile().as_text()
                moves = [ln.strip()[:200] for ln in hlo.splitlines()
                         if whole.search(ln.split("=")[0] if "=" in ln else "")
                         and re.search(r"copy|custom-call|dynamic-slice|MoveToDevice", ln)]
                row["whole_array_moves_in_hlo"] = moves[:4]
                got = np.asarray(once(x, ids)).astype(np.float32)
                row["correct"] = bool(np.array_equal(got, want))

                def loop_of(n, fn=fn):  # n calls in one jit (x and ids are arguments, never constants)
                    def run(xa, ia):
                        return jax.lax.fori_loop(
                            0, n, lambda i, acc: acc + fn(xa, ia).astype(jnp.float32)[0, 0, 0], jnp.float32(0))
                    return jax.jit(run)

                times = {}
                for n in (args.n1, args.n2):
                    f = loop_of(n)
                    jax.block_until_ready(f(x, ids))
                    reps = []
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        jax.block_until_ready(f(x, ids))
                        reps.append(time.perf_counter() - t0)
                    times[n] = sorted(reps)[len(reps) // 2]
                row["us_per_call"] = round((times[args.n2] - times[args.n1]) / (args.n2 - args.n1) * 1e6, 2)
            except Exception as e:  # noqa: BLE001 -- the probe reports what does not compile or run
                row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
