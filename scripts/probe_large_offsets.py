"""Does a compiled Pallas kernel read the right bytes of a 1-byte array of 2**31 to 2**32 elements?

    PYTHONPATH=. python scripts/probe_large_offsets.py --out results/probe_large_offsets.json   # a GPU, ~4 GiB
    PYTHONPATH=. python scripts/probe_large_offsets.py --smoke                                    # CPU, interpreted

Why (docs/performance.md, twenty-fifth session): Pallas's Triton lowering addresses an array with 32-bit
offsets unless it is larger than 2**32 bytes, and Triton adds a 32-bit offset to a pointer as a signed number,
so rows past 2**31 bytes of a uint8 array of at most 2**32 bytes should be read from the wrong place (or fault).
`pallas_kernels.backend.offsets_fit` keeps the product's kernels away from such arrays (a model's stacked INT8
key codes reach that size at 64K-128K tokens of the 8B shape); this probe shows on the GPU what it guards
against. For x [L, n] uint8 (row r filled with r + 1), a kernel copies each row's first 128 bytes out:
  rows_ok      which rows came back right, for the given shape (default [3, 2**30]: 3 GiB, 32-bit offsets) and
               for one of more than 2**32 bytes ([5, 2**30]: 64-bit offsets)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _device_timing import write_json  # noqa: E402


def read_rows(x, interpret: bool):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from pallas_kernels import backend

    L = x.shape[0]

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...].astype(jnp.int32)

    return pl.pallas_call(kernel, grid=(L,), in_specs=[pl.BlockSpec((None, 128), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((None, 128), lambda i: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct((L, 128), jnp.int32), interpret=interpret,
                          compiler_params=None if interpret else backend.compiler_params(1, 1))(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row-bytes", type=int, default=2**30)
    ap.add_argument("--rows", type=int, nargs="+", default=[3, 5],
                    help="array rows per case (on a GPU run one case per process: a case that reads an illegal "
                         "address leaves the CUDA context unusable for the next)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.row_bytes, args.rows = 1024, [3]

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import backend

    interpret = backend.interpret()
    dev = jax.devices()[0]
    out = {"device": dev.device_kind, "jax": jax.__version__, "interpret": interpret, "cases": []}
    for L in args.rows:
        shape = (L, args.row_bytes)
        case = {"shape": list(shape), "bytes": L * args.row_bytes,
                "offsets_fit": backend.offsets_fit(shape, jnp.uint8)}
        try:
            x = jax.jit(lambda L=L, shape=shape: (jnp.arange(L, dtype=jnp.uint8)[:, None] + 1)
                        * jnp.ones(shape, jnp.uint8))()
            got = np.asarray(jax.jit(lambda x: read_rows(x, interpret))(x))
            case["rows_ok"] = [bool(np.all(got[r] == r + 1)) for r in range(L)]
            case["first_values"] = [int(got[r, 0]) for r in range(L)]
            del x
        except Exception as e:  # noqa: BLE001 -- the probe reports what fails (an illegal address, say)
            case["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        out["cases"].append(case)
        print(json.dumps(case), flush=True)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
