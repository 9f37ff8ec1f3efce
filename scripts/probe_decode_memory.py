"""Where a decode loop's device memory goes: XLA's memory analysis of bench_decode's jitted loop (compiled, not
run) and its largest temporary buffers, named by the instruction that defines them.

bench_decode's 8B rows at 128K failed with "Out of memory while trying to allocate 57.07GiB" in the loop's own
program for naive and certified alike (2026-12-03, H200); at 32K the same programs ran with a peak of 43 GB against
dense's 25.5. This probe compiles each cache's loop at a context that fits and lists what the temporaries are.

    python scripts/probe_decode_memory.py --model llama3.1-8b --context 32768 --caches dense naive certified \
        --out results/probe_decode_memory.json
    python scripts/probe_decode_memory.py --model tiny --context 1024 --caches naive     # CPU check of the script

--conversion instead compiles the stacked dense -> tiered conversion (`cache._from_head_major_impl`, every prefill
of a tiered cache ends with it) for the model's K/V shapes and prints its temporaries against the dense K/V:

    JAX_PLATFORMS=cpu python scripts/probe_decode_memory.py --conversion --model llama3.1-8b --context 4096
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def largest_allocations(dump_dir: Path, top: int) -> list[dict]:
    """The `top` largest buffer allocations of the dumped jit_run module (sizes in bytes) with the HLO values
    they hold and those values' op_name metadata (from the optimized HLO text)."""
    assignment = sorted(dump_dir.glob("*jit_run*buffer-assignment.txt"))
    if not assignment:
        return []
    text = assignment[-1].read_text()
    hlo_files = sorted(dump_dir.glob("*jit_run*after_optimizations.txt"))
    op_names: dict[str, str] = {}
    if hlo_files:
        for line in hlo_files[-1].read_text().splitlines():
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"", line)
            if m:
                op_names[m.group(1)] = m.group(2)
    allocs = []
    for block in re.split(r"\n(?=allocation \d+:)", text):
        m = re.match(r"allocation (\d+): size (\d+)(.*)", block)
        if not m:
            continue
        values = re.findall(r"value: <\d+ ([\w.\-{}]+) @\d+> \(size=(\d+),offset=\d+\): (\S+)", block)
        values.sort(key=lambda v: -int(v[1]))  # the preallocated temp holds every temporary: largest first
        allocs.append(dict(allocation=int(m.group(1)), bytes=int(m.group(2)), kind=m.group(3).strip()[:120],
                           values=[dict(name=v, bytes=int(size), shape=shape, op_name=op_names.get(v, "")[:200])
                                   for v, size, shape in values[:top]]))
    allocs.sort(key=lambda a: -a["bytes"])
    return allocs[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3.1-8b")
    ap.add_argument("--layers", type=int, default=0, help="override the model's layer count (0: keep)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--caches", nargs="+", default=["dense", "naive", "certified"])
    ap.add_argument("--tier1", choices=("jnp", "pallas"), default="pallas")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--conversion", action="store_true", help="the stacked dense -> tiered conversion instead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.conversion:
        conversion_memory(args)
        return

    dump_root = Path(tempfile.mkdtemp(prefix="decode_memory_"))
    rows = []
    for mode in args.caches:
        dump = dump_root / mode
        # each cache's loop in a process of its own: XLA reads the dump flags once per process
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                                          " --xla_dump_hlo_module_re=jit_run --xla_dump_hlo_as_text").strip())
        cmd = [sys.executable, __file__, "--_one", mode, json.dumps(vars(args))]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            rows.append(dict(cache=mode, error=res.stderr[-2000:]))
            print(f"{mode}: FAILED\n{res.stderr[-2000:]}", flush=True)
            continue
        row = json.loads(res.stdout.strip().splitlines()[-1])
        row["largest_allocations"] = largest_allocations(dump, args.top)
        rows.append(row)
        print(f"{mode:9s} temp {row['temp_bytes'] / 2**30:7.2f} GiB  args {row['argument_bytes'] / 2**30:6.2f} GiB  "
              f"tier1 {row['tier1_device_bytes'] / 2**30:6.2f} GiB  kv bf16 {row['kv_bf16_bytes'] / 2**30:6.2f} GiB",
              flush=True)
        for a in row["largest_allocations"][:4]:
            print(f"    allocation {a['allocation']}: {a['bytes'] / 2**30:8.3f} GiB {a['kind'][:40]}", flush=True)
            for v in a["values"][:args.top]:
                print(f"        {v['bytes'] / 2**30:8.3f} GiB  {v['name']} {v['shape'][:50]} "
                      f"[{v['op_name'][-100:]}]", flush=True)
    if args.out:
        import jax

        Path(args.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                                                  args=vars(args), rows=rows), indent=1))
        print(f"wrote {args.out}")


def conversion_memory(args: argparse.Namespace) -> None:
    """XLA's memory analysis of the stacked conversion for [L, batch, Hkv, context, d] bf16 K and V."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "scripts")]
    from bench_decode import MODELS

    from certattn_jax.cache import _from_head_major_impl
    from certattn_jax.policy import CertPolicy

    config = MODELS[args.model]
    if args.layers:
        config = dataclasses.replace(config, num_layers=args.layers)
    shape = (config.num_layers, args.batch, config.num_kv_heads, args.context, config.head_dim)
    kv = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((args.batch,), jnp.int32)
    policy = CertPolicy()
    layout = CertPolicy(block_size=policy.block_size, group_size=policy.group_size, key_bits=policy.key_bits,
                        value_bits=policy.value_bits, k_max=policy.k_max, v_max=policy.v_max,
                        hot_slots=policy.hot_slots)  # what cache._from_head_major compiles with
    m = _from_head_major_impl.lower(kv, kv, lengths, layout).compile().memory_analysis()
    dense = 2 * 2 * int(jnp.prod(jnp.asarray(shape)))
    row = dict(what="conversion", model=args.model, shape=list(shape), temp_bytes=m.temp_size_in_bytes,
               dense_kv_bytes=dense, temp_over_dense_kv=m.temp_size_in_bytes / dense,
               device=jax.devices()[0].device_kind)
    print(f"conversion {shape}: temporaries {m.temp_size_in_bytes / 2**30:.2f} GiB = "
          f"{row['temp_over_dense_kv']:.1f}x the dense bf16 K/V ({dense / 2**30:.2f} GiB)")
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1))


def _one(mode: str, args: dict) -> None:
    """Child process: build the cache, compile bench_decode's loop, print its memory analysis as JSON."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "scripts")]
    from bench_decode import MODELS, build_cache, make_step_loop

    from certattn_jax.memory import memory_report
    from certattn_jax.policy import CertPolicy
    from models import llama

    config = MODELS[args["model"]]
    if args["layers"]:
        config = dataclasses.replace(config, num_layers=args["layers"])
    params = llama.fuse_projections(llama.init_params(config, jax.random.key(0), jnp.bfloat16))
    policy = CertPolicy(tier1=args["tier1"])
    if args["model"] == "tiny":
        policy = CertPolicy(tier1="jnp", block_size=16, group_size=16)
    cache = build_cache(config, args["batch"], args["context"], mode, "einsum", 64, policy)
    if mode == "dense":
        cache = jax.device_put(cache, jax.devices()[0])
    mem = memory_report(cache)
    tokens = jax.device_put(jnp.ones((args["batch"],), jnp.int32), jax.devices()[0])
    compiled = make_step_loop(config, 2).lower(params, cache, tokens).compile()
    m = compiled.memory_analysis()
    kv = 2 * config.num_layers * args["batch"] * config.num_kv_heads * args["context"] * config.head_dim * 2
    print(json.dumps(dict(cache=mode, model=args["model"], layers=config.num_layers, context=args["context"],
                          batch=args["batch"], temp_bytes=m.temp_size_in_bytes,
                          argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
                          alias_bytes=m.alias_size_in_bytes, tier1_device_bytes=mem["tier1_device_bytes"],
                          tier2_host_bytes=mem["tier2_host_bytes"], kv_bf16_bytes=kv)))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_one":
        _one(sys.argv[2], json.loads(sys.argv[3]))
    else:
        main()
