"""Can a Pallas kernel write tier 2 where it lives, in pinned host memory, in place (no whole-array copy)?

    PYTHONPATH=. python scripts/probe_host_write.py --out results/probe_host_write.json
    PYTHONPATH=. python scripts/probe_host_write.py --smoke      # tiny, CPU (interpret mode): the script runs

Why (docs/performance.md, twenty-fifth session): a certified decode step keeps three host round trips (predicate
reads) because its rare-step conditional (the flush, rungs 3-4) moves tier-2 bytes with XLA host transfers,
which XLA cannot record into a CUDA graph: the conditional, and so the decode loop around it, stays a host
decision. Rung 1's tier-2 read is already a kernel that dereferences pinned host memory
(`pallas_kernels.gather_blocks`, `scripts/probe_host_kernel.py`). The flush's write is the open question: a kernel
whose output aliases the pinned-host tier-2 operand (input_output_aliases) must get that buffer as it is, and
XLA must keep the result in host memory -- not copy tier 2 to the device to satisfy the alias and back.

For tier-2 arrays x [N, Bk, d] of the sizes --mib, S blocks [S, Bk, d] (device) written at ids [S] by:
  xla_dus        `dynamic_update_slice` of host-placed blocks, one per block (what `tiers.write_block` does)
  kernel_alias   a Pallas kernel, one program per block, its output aliased to x (pinned host), the jit's output
                 placed in pinned host memory (on the CPU: interpreted over device arrays)
Per variant and size: compiled or the error, correct (x with the blocks written equals numpy's), the output's
memory kind, whether the compiled HLO moves an array of x's whole shape (a copy / transfer of all of tier 2),
and µs per write (device-timed: x carried through a loop of n writes, from two loop lengths). With
--in-cond the write sits in a `lax.cond` on a device-computed predicate inside the loop, as the rare branch of a
decode step would: run once with XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE and once
without; a conditional that runs on the device costs no host round trip per iteration.
kernel_alias correct, output in pinned_host, no whole-array move and a time flat in N = in-place host writes work.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _device_timing import write_json  # noqa: E402


def write_kernel(ids_ref, blk_ref, x_ref, o_ref):
    """o[ids[0]] = blk[0] (o aliases x: the other blocks keep their contents)."""
    import jax.experimental.pallas as pl

    del x_ref
    o_ref[pl.ds(ids_ref[0], 1), :, :] = blk_ref[...].astype(o_ref.dtype)


def kernel_write(x, blocks, ids, interpret: bool):
    import jax
    import jax.experimental.pallas as pl

    from pallas_kernels import backend

    N, Bk, d = x.shape
    S = ids.shape[0]
    whole = pl.BlockSpec((N, Bk, d), lambda s: (0, 0, 0))
    return pl.pallas_call(
        write_kernel, grid=(S,),
        in_specs=[pl.BlockSpec((1,), lambda s: (s,)), pl.BlockSpec((1, Bk, d), lambda s: (s, 0, 0)), whole],
        out_specs=whole, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={2: 0},
        compiler_params=None if interpret else backend.compiler_params(1, 1), interpret=interpret,
        name="probe_host_write")(ids, blocks, x)


def dus_write(x, blocks, ids, host: bool):
    """x with blocks [S, Bk, d] written at ids [S], one dynamic-update-slice each (host: x in pinned host memory,
    so each update is placed there first, as `tiers.write_block` does)."""
    import jax

    from certattn_jax import tiers

    for s in range(ids.shape[0]):
        upd = blocks[s:s + 1].astype(x.dtype)
        x = jax.lax.dynamic_update_slice(x, tiers.to_host(upd) if host else upd, (ids[s], 0, 0))
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", nargs="+", type=int, default=[64, 512], help="tier-2 array sizes, MiB")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=8, help="blocks written per call (S)")
    ap.add_argument("--n1", type=int, default=4)
    ap.add_argument("--n2", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--in-cond", action="store_true", help="each write inside a lax.cond on a device predicate")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.mib, args.block, args.head_dim, args.blocks, args.n1, args.n2, args.reps = [1], 16, 32, 2, 1, 2, 1

    import os

    import jax
    import jax.numpy as jnp
    import numpy as np

    from certattn_jax import tiers

    interpret = jax.default_backend() != "gpu"
    dev = jax.devices()[0]
    host_kind = tiers.host_memory_kind() if not interpret else None  # interpret mode: device arrays only
    out_sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind=host_kind) if host_kind else None
    out = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
           "host_memory_kind": host_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""), "in_cond": args.in_cond,
           "block": args.block, "head_dim": args.head_dim, "blocks": args.blocks, "rows": []}
    rng = np.random.default_rng(0)
    for mib in args.mib:
        N = max(4 * args.blocks, mib * 2**20 // (args.block * args.head_dim * 2))
        Bk, d = args.block, args.head_dim
        x_np = rng.standard_normal((N, Bk, d), dtype=np.float32).astype(jnp.bfloat16)
        b_np = rng.standard_normal((args.blocks, Bk, d), dtype=np.float32).astype(jnp.bfloat16)
        ids_np = np.sort(rng.choice(N, args.blocks, replace=False)).astype(np.int32)
        want = x_np.astype(np.float32).copy()
        want[ids_np] = b_np.astype(np.float32)
        blocks = jax.device_put(jnp.asarray(b_np), dev)
        ids = jax.device_put(jnp.asarray(ids_np), dev)

        def fresh_x(x_np=x_np):
            x = jnp.asarray(x_np)
            return tiers.to_host(x) if host_kind else jax.device_put(x, dev)

        variants = {"xla_dus": lambda x, b, i: dus_write(x, b, i, host_kind is not None),
                    # the kernel's result annotated back into host memory: inside a loop or a conditional the
                    # carried tier 2 must keep its memory kind (without it jax refuses the program: device result
                    # against a pinned-host carry, the twenty-sixth session's first run)
                    "kernel_alias": lambda x, b, i: (tiers.to_host if host_kind else (lambda y: y))(
                        kernel_write(x, b, i, interpret))}
        whole = re.compile(rf"\[{N},{Bk},{d}\]")
        for name, fn in variants.items():
            row = {"variant": name, "mib": mib, "blocks_total": N}
            try:
                if args.in_cond:  # the write as the taken branch of a conditional on a device-computed predicate
                    def step(x, b, i, fn=fn):
                        return jax.lax.cond(jnp.sum(i) >= 0, lambda: fn(x, b, i), lambda: x)
                else:
                    step = fn
                once = jax.jit(step, donate_argnums=0, out_shardings=out_sharding)
                hlo = once.lower(fresh_x(), blocks, ids).compile().as_text()
                moves = [ln.strip()[:200] for ln in hlo.splitlines()
                         if whole.search(ln.split("=")[0] if "=" in ln else "")
                         and re.search(r"copy|dynamic-slice|MoveToDevice|MoveToHost", ln)]
                row["whole_array_moves_in_hlo"] = moves[:4]
                got = once(fresh_x(), blocks, ids)
                row["out_memory_kind"] = getattr(got.sharding, "memory_kind", None)
                row["correct"] = bool(np.array_equal(np.asarray(jax.device_get(got)).astype(np.float32), want))

                def loop_of(n, step=step):  # n writes, x carried through the loop (donated)
                    return jax.jit(lambda xa, ba, ia: jax.lax.fori_loop(0, n, lambda _, xc: step(xc, ba, ia), xa),
                                   donate_argnums=0, out_shardings=out_sharding)

                times = {}
                for n in (args.n1, args.n2):
                    f = loop_of(n)
                    jax.block_until_ready(f(fresh_x(), blocks, ids))
                    reps = []
                    for _ in range(args.reps):
                        x = jax.block_until_ready(fresh_x())
                        t0 = time.perf_counter()
                        jax.block_until_ready(f(x, blocks, ids))
                        reps.append(time.perf_counter() - t0)
                    times[n] = sorted(reps)[len(reps) // 2]
                row["us_per_write"] = round((times[args.n2] - times[args.n1]) / (args.n2 - args.n1) * 1e6, 2)
            except Exception as e:  # noqa: BLE001 -- the probe reports what does not compile or run
                row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
