"""Where a prefill's time goes on the device and the host: profiler traces of `models.generate.prefill`.

    python scripts/trace_prefill.py --model smollm2 --prompt 1024 --caches dense certified \\
        --prefill-chunk 1024 --keep-traces /tmp/traces --out results/trace_prefill.json

For each cache mode the prefill runs warm (compiled first) `--repeats` times untraced (wall-clock, the bench's
measure: `prefill` returns with the logits and the cache ready), then once under `jax.profiler.trace`. The
traced run is cut into its programs by the host's execute events (one per compiled program the prefill ran:
the chunks, for tiered modes the conversion and the fresh arrays), and for each program the device's kernels and
copies that ran while it was the latest one launched: first kernel start and last end relative to the call, busy
time (the union of kernel intervals), kernel count, copies by direction. What this answers: whether the certified
prefill's extra time is the conversion's device work, its host work (the gap between the last chunk's kernels and
the conversion's first), or transfers (tier 2 to pinned host). Runs on CPU too (the events are then the CPU
thunks; checks the script, not numbers). The raw traces are kept with --keep-traces for reading later.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.trace_decode import _kind, device_events  # noqa: E402


def host_executions(trace: dict) -> list[dict]:
    """The host's program launches, in time order: {"name", "ts", "dur"} (µs) of jax's `PjitFunction(<name>)`
    events (one per call of a jitted function or eager op; a nested event of the same launch is dropped)."""
    out = [{"name": e["name"], "ts": e["ts"], "dur": e["dur"]} for e in trace.get("traceEvents", [])
           if e.get("ph") == "X" and "dur" in e and e.get("name", "").startswith("PjitFunction(")]
    out.sort(key=lambda r: r["ts"])
    kept: list[dict] = []
    for r in out:
        if kept and r["ts"] < kept[-1]["ts"] + kept[-1]["dur"] and r["name"] == kept[-1]["name"]:
            continue
        kept.append(r)
    return kept


def _busy(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, -1e30
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def split_by_program(events: list[dict], execs: list[dict], t0: float) -> list[dict]:
    """Each device event assigned to the latest program launched before it started; per program: host launch
    start and duration, device first start / last end, busy, kernels, copies (µs from t0)."""
    rows = [{"program": x["name"][:120], "host_launch_at_us": round(x["ts"] - t0, 1),
             "host_launch_us": round(x["dur"], 1), "_iv": [], "_kinds": {}} for x in execs]
    starts = [x["ts"] for x in execs]
    unassigned = []
    for e in sorted(events, key=lambda e: e["ts"]):
        i = max((j for j, s in enumerate(starts) if s <= e["ts"]), default=None)
        if i is None:
            unassigned.append(e)
            continue
        rows[i]["_iv"].append((e["ts"], e["ts"] + e["dur"]))
        k = _kind(e.get("name", ""))
        rows[i]["_kinds"][k] = rows[i]["_kinds"].get(k, 0) + 1
        if k != "kernel":
            rows[i].setdefault("copies", []).append({"name": e.get("name", "")[:60], "at_us": round(e["ts"] - t0, 1),
                                                     "us": round(e["dur"], 1)})
    for r in rows:
        iv = r.pop("_iv")
        r["events"] = r.pop("_kinds")
        if iv:
            r["device_first_us"] = round(min(a for a, _ in iv) - t0, 1)
            r["device_last_us"] = round(max(b for _, b in iv) - t0, 1)
            r["device_busy_us"] = round(_busy(iv), 1)
        if "copies" in r and len(r["copies"]) > 12:
            r["copies"] = r["copies"][:12] + [{"more": len(r["copies"]) - 12}]
    if unassigned:
        rows.insert(0, {"program": "(before any launch)", "events": len(unassigned),
                        "device_busy_us": round(_busy([(e["ts"], e["ts"] + e["dur"]) for e in unassigned]), 1)})
    return rows


def run_mode(mode: str, model: str, prompt: int, new_tokens: int, chunk: int, repeats: int, trace_dir: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from certattn_jax.model_cache import cache_spec
    from certattn_jax.policy import CertPolicy
    from models import generate as gen
    from models import llama
    from scripts.bench_generate import _model_config

    cfg = _model_config(model)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    policy = CertPolicy(block_size=16, group_size=16) if model == "tiny" else CertPolicy()
    params = llama.fuse_projections(llama.init_params(cfg, jax.random.key(0), dtype))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt).tolist()
    cap = gen.round_up(prompt + new_tokens, gen.CAPACITY_BUCKET)
    factory = cache_spec(mode, cfg, dtype, policy)

    def once() -> float:
        t = time.perf_counter()
        c, logits = gen.prefill(params, cfg, [ids], cap, cache_factory=factory, policy=policy, prefill_chunk=chunk)
        s = time.perf_counter() - t
        del c, logits
        return s

    cold = once()
    times = [once() for _ in range(repeats)]
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t_call = time.perf_counter()
        traced = once()
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
                   + glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    row = {"mode": mode, "model": model, "prompt": prompt, "capacity": cap, "prefill_chunk": chunk,
           "cold_s": round(cold, 4), "warm_median_ms": round(statistics.median(times) * 1e3, 3),
           "warm_min_ms": round(min(times) * 1e3, 3), "traced_ms": round(traced * 1e3, 3)}
    del t_call
    if not files:
        row["error"] = f"no trace file under {trace_dir}"
        return row
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    events, processes = device_events(trace)
    execs = host_executions(trace)
    row["processes"] = processes
    row["trace_file"] = files[-1]
    if events:
        arg_keys = sorted({k for e in events[:200] for k in e.get("args", {})})
        row["device_event_arg_keys"] = arg_keys
    t0 = min([x["ts"] for x in execs] + [e["ts"] for e in events]) if (execs or events) else 0.0
    row["programs"] = split_by_program(events, execs, t0)
    if events:
        iv = [(e["ts"], e["ts"] + e["dur"]) for e in events]
        row["device_first_us"] = round(min(a for a, _ in iv) - t0, 1)
        row["device_last_us"] = round(max(b for _, b in iv) - t0, 1)
        row["device_busy_us"] = round(_busy(iv), 1)
        row["device_events"] = len(events)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--caches", nargs="+", default=["dense", "certified"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--keep-traces", default=None, help="a folder to keep the raw traces in")
    ap.add_argument("--out", default=str(ROOT / "results/trace_prefill.json"))
    args = ap.parse_args(argv)
    import jax

    rows = []
    for mode in args.caches:
        if args.keep_traces:
            Path(args.keep_traces).mkdir(parents=True, exist_ok=True)
        d = tempfile.mkdtemp(prefix=f"prefill_{mode}_", dir=args.keep_traces)
        try:
            row = run_mode(mode, args.model, args.prompt, args.new_tokens, args.prefill_chunk, args.repeats, d)
        except Exception as e:  # noqa: BLE001 -- one mode failing must not lose the others' rows
            row = {"mode": mode, "error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps({k: v for k, v in row.items() if k != "programs"}), flush=True)
        for p in row.get("programs", []):
            print("   ", json.dumps({k: v for k, v in p.items() if k != "copies"}), flush=True)
        rows.append(row)
        Path(args.out).write_text(json.dumps({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                                              "backend": jax.default_backend(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
