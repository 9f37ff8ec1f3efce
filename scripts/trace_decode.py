"""Where a decode step's time goes on the device: a profiler trace of the product's decode loop, per kernel.

    python scripts/trace_decode.py --model smollm2 --prompt 1024 --caches dense certified:pallas:jnp \\
        certified:pallas:fused --steps 16 --out results/trace_decode.json

For each cache (mode[_schedule][:tier1[:rung0]], e.g. certified_straight:pallas:fused),
`models.generate.generate` runs once to compile and once more under `jax.profiler.trace` (a Perfetto trace).
The device's kernel events of the traced decode loop are summed by kernel name and by the HLO scope that
emitted them (the compiled loop's `op_name` metadata, matched on the instruction name the kernel carries), and
set against the loop's wall time: busy (time with a kernel running) vs idle (the launch gaps). The layer loop's
trip count makes per-layer numbers comparable across caches.

Reports per cache: wall ms per step, device-busy ms per step, kernels per step, the 30 costliest kernels
(name, scope, count, µs per step) and µs per step by scope. Runs on CPU too (the events are then the CPU
thunks; useful to check this script, not for numbers).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# this script reads the one decode program (`_COMPILED`): the decode bridge (two programs, one compiling in the
# background) off unless asked for
os.environ.setdefault("CERTATTN_DECODE_BRIDGE", "0")


def hlo_scopes(hlo: str) -> dict[str, str]:
    """{instruction name (dots and dashes as underscores too): its op_name scope, shortened} of an HLO text."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name=\"([^\"]*)\"", hlo, re.M):
        name, scope = m.group(1), m.group(2)
        scope = re.sub(r"^jit\([^)]*\)/", "", scope)
        scope = re.sub(r"(while/body/|closed_call/|eval_jaxpr/|cond/branch_\d+_fun/)", "", scope)
        out[name] = scope
        out[name.replace(".", "_").replace("-", "_")] = scope
    return out


def device_events(trace: dict) -> tuple[list[dict], str]:
    """The kernel events ("X" events) of the device processes of a Chrome/Perfetto trace, and which processes
    they came from (GPU processes when any exist, else every process: the CPU run)."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in trace.get("traceEvents", [])
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in names.items() if "GPU" in n or "gpu" in n}
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if gpu:
        events = [e for e in events if e["pid"] in gpu]
    return events, ", ".join(sorted({names.get(e["pid"], str(e["pid"])) for e in events}))


def host_events(trace: dict, t0: float, t1: float, steps: int, top: int = 25) -> list[dict]:
    """What the host threads did while the decode loop ran (between t0 and t1, µs): the `top` event names by
    total time, per step (count, µs; nested events each count: a parent's time includes its children's). The
    host's side of a launch-bound step: which runtime calls (kernel launches, command-buffer updates, predicate
    reads) take its time."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in trace.get("traceEvents", [])
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    host = {pid for pid, n in names.items() if not ("GPU" in n or "gpu" in n)}
    groups = collections.defaultdict(lambda: [0, 0.0])
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and "dur" in e and e.get("pid") in host and t0 <= e["ts"] <= t1:
            g = groups[re.sub(r"\d+", "#", e.get("name", ""))[:80]]
            g[0] += 1
            g[1] += e["dur"]
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": n, "per_step": round(c / steps, 2), "us_per_step": round(t / steps, 2)} for n, (c, t) in rows]


def decode_window(trace: dict, program: str = "_decode_loop") -> tuple[float, float] | None:
    """(start, end) µs from the host's first execution of the decode loop's program (the host event naming it) to
    the trace's end, or None. The prefill's programs run before it; the loop's kernels may finish after the
    host's call returns (asynchronous dispatch), so the window stays open to the end."""
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in trace.get("traceEvents", [])
             if e.get("ph") == "X" and "dur" in e and program in e.get("name", "") and "Execute" in e.get("name", "")]
    if not spans:
        return None
    return min(a for a, _ in spans), float("inf")


def idle_after(events: list[dict]) -> dict[str, float]:
    """Device idle time (µs) between the end of each event and the start of the next one (the events in time
    order; overlapping events leave no gap), summed by what came before the gap: a device-to-host copy (a
    conditional's predicate or a loop's trip test read back by the host), a host-to-device copy, or a kernel."""
    out = collections.defaultdict(float)
    ordered = sorted(events, key=lambda e: e["ts"])
    end, last = None, None
    for e in ordered:
        if end is not None and e["ts"] > end:
            name = last.get("name", "")
            out[_kind(name) if _kind(name) != "memcpy_other" else "kernel"] += e["ts"] - end
        if end is None or e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e
    return dict(out)


def _kind(name: str) -> str:
    return "MemcpyD2H" if "D2H" in name else "MemcpyH2D" if "H2D" in name else \
        "memcpy_other" if "Memcpy" in name or "Memset" in name else "kernel"


def idle_by_scope(events: list[dict], scope_of, top: int = 15) -> list[dict]:
    """The device's idle gaps grouped by the scope (and kind) of the event that ended before each gap: which
    operation the device waits after (a conditional's predicate read, a loop's trip test, a transfer). The `top`
    groups with the most idle time: idle µs, gap count, and the median gap."""
    groups = collections.defaultdict(list)
    ordered = sorted(events, key=lambda e: e["ts"])
    end, last = None, None
    for e in ordered:
        if end is not None and e["ts"] > end:
            groups[(_kind(last.get("name", "")), scope_of(last))].append(e["ts"] - end)
        if end is None or e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"after": kind, "scope": scope[-120:], "idle_us": round(sum(g), 1), "gaps": len(g),
             "median_gap_us": round(sorted(g)[len(g) // 2], 2)} for (kind, scope), g in rows]


def summarize(events: list[dict], scopes: dict[str, str], steps: int, wall_s: float) -> dict:
    """Per-step totals, the costliest kernels and time by scope."""
    if not events:
        return {"error": "no device events in the trace"}
    by_name = collections.defaultdict(lambda: [0, 0.0])
    by_scope = collections.defaultdict(float)
    intervals = []
    for e in events:
        name = e.get("name", "")
        hlo_name = e.get("args", {}).get("hlo_op") or name
        scope = scopes.get(hlo_name) or scopes.get(name) or scopes.get(name.split(".")[0]) or "?"
        by_name[(name, scope)][0] += 1
        by_name[(name, scope)][1] += e["dur"]
        top = scope.split("/")[0] if scope != "?" else "? (" + re.sub(r"[_.]?\d+$", "", name)[:40] + ")"
        by_scope[top] += e["dur"]
        intervals.append((e["ts"], e["ts"] + e["dur"]))
    intervals.sort()
    busy, end = 0.0, -1e30
    for a, b in intervals:  # union of the kernel intervals (streams may overlap)
        if b > end:
            busy += b - max(a, end)
            end = b
    span = intervals[-1][1] - intervals[0][0]
    idle = idle_after(events)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]

    def scope_of(e: dict) -> str:
        name = e.get("name", "")
        hlo_name = e.get("args", {}).get("hlo_op") or name
        return scopes.get(hlo_name) or scopes.get(name) or scopes.get(name.split(".")[0]) or name[:60]

    counts = collections.Counter(_kind(e.get("name", "")) for e in events)
    return {"wall_ms_per_step": round(wall_s * 1e3 / steps, 4),
            "trace_span_ms_per_step": round(span / 1e3 / steps, 4),
            "busy_ms_per_step": round(busy / 1e3 / steps, 4),
            "kernels_per_step": round(len(events) / steps, 1),
            "idle_ms_per_step_after": {k: round(v / 1e3 / steps, 4) for k, v in idle.items()},
            "kernel_us_per_step_summed": round(sum(e["dur"] for e in events) / steps, 2),
            "events_per_step_by_kind": {k: round(v / steps, 2) for k, v in sorted(counts.items())},
            "idle_after_scope_per_step": [{**r, "idle_us": round(r["idle_us"] / steps, 2),
                                           "gaps": round(r["gaps"] / steps, 2)}
                                          for r in idle_by_scope(events, scope_of)],
            "top_kernels": [{"name": n[:80], "scope": s[-120:], "per_step": round(c / steps, 2),
                             "us_per_step": round(t / steps, 2)} for (n, s), (c, t) in top],
            "us_per_step_by_scope": {k: round(v / steps, 2)
                                     for k, v in sorted(by_scope.items(), key=lambda kv: -kv[1])}}


def run_cache(spec: str, model: str, prompt: int, steps: int, trace_dir: str, eps: float | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from certattn_jax.model_cache import cache_spec
    from certattn_jax.policy import CertPolicy
    from models import generate as gen
    from models import llama
    from scripts.bench_generate import _model_config

    mode, tier1, rung0 = (spec.split(":") + ["", ""])[:3]
    mode, _, schedule = mode.partition("_")  # e.g. certified_straight
    cfg = _model_config(model)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    policy = CertPolicy(block_size=16, group_size=16) if model == "tiny" else CertPolicy()
    policy = dataclasses.replace(policy, **{k: v for k, v in (("tier1", tier1), ("rung0", rung0)) if v})
    if eps is not None:
        policy = dataclasses.replace(policy, eps=eps)
    params = llama.fuse_projections(llama.init_params(cfg, jax.random.key(0), dtype))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt).tolist()
    kw = dict(eos_token_ids=(), progress=False, prefill_chunk=1024, policy=policy,
              cache_factory=cache_spec(mode, cfg, dtype, policy, **({"schedule": schedule} if schedule else {})),
              record_steps=False)
    gen._COMPILED.clear()
    t0 = time.perf_counter()
    cold = gen.generate(params, cfg, [ids], steps, **kw)
    compile_and_first_s = time.perf_counter() - t0
    del cold
    (decode,) = gen._COMPILED.values()
    scopes = hlo_scopes(decode.as_text())
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        warm = gen.generate(params, cfg, [ids], steps, **kw)
        jax.block_until_ready(warm.tokens if hasattr(warm, "tokens") else 0)
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
                   + glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        return {"cache": spec, "error": f"no trace file under {trace_dir}"}
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    events, processes = device_events(trace)
    # only the decode loop: kernels named in the loop's HLO, run while the host executed the loop's program (the
    # prefill's program reuses fusion names such as input_reduce_fusion_62: without the time window its GEMMs
    # were counted as the decode step's)
    window = decode_window(trace)
    loop_events = [e for e in events if ((e.get("args", {}).get("hlo_op") or e.get("name", "")) in scopes
                                         or e.get("name", "").split(".")[0] in scopes)
                   and (window is None or window[0] <= e["ts"] <= window[1])]
    row = {"cache": spec, "model": model, "prompt": prompt, "decode_steps": warm.num_steps,
           "decode_tokens_per_s": round(warm.tokens_per_s, 2), "compile_and_first_run_s": round(compile_and_first_s, 2),
           "trace_file": os.path.relpath(files[-1], trace_dir), "processes": processes,
           "events_total": len(events), "events_in_loop": len(loop_events),
           "layers": cfg.num_layers, "eps": float(policy.eps),
           "looped_weights": llama.looped_weights(params)}
    decode_s = warm.num_steps / warm.tokens_per_s if warm.tokens_per_s else float("nan")
    row.update(summarize(loop_events or events, scopes, max(warm.num_steps, 1), decode_s))
    # every copy the device made while the loop ran, named in the loop's HLO or not: a conditional's predicate
    # or a loop's trip test read back by the host is a device-to-host copy (none when the command buffers
    # decide them on the device)
    in_window = [e for e in events if window is None or window[0] <= e["ts"] <= window[1]]
    copies = collections.Counter(_kind(e.get("name", "")) for e in in_window)
    row["copies_per_step_in_window"] = {k: round(copies[k] / max(warm.num_steps, 1), 2)
                                        for k in ("MemcpyD2H", "MemcpyH2D", "memcpy_other")}
    span = loop_events or events
    if span:
        row["host_events_per_step"] = host_events(trace, min(e["ts"] for e in span),
                                                  max(e["ts"] + e["dur"] for e in span), max(warm.num_steps, 1))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--caches", nargs="+", default=["dense", "certified:pallas:jnp", "certified:pallas:fused"],
                    help="mode[:tier1[:rung0]] each")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "results/trace_decode.json"))
    ap.add_argument("--eps", type=float, default=None, help="the policy's eps (default CertPolicy's)")
    ap.add_argument("--keep-traces", default=None, help="a folder to keep the raw traces in")
    args = ap.parse_args(argv)
    import jax

    rows = []
    for spec in args.caches:
        if args.keep_traces:
            Path(args.keep_traces).mkdir(parents=True, exist_ok=True)
        d = tempfile.mkdtemp(prefix="trace_", dir=args.keep_traces)
        try:
            row = run_cache(spec, args.model, args.prompt, args.steps, d, args.eps)
        except Exception as e:  # noqa: BLE001 -- one cache failing must not lose the others' rows
            row = {"cache": spec, "error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps({k: v for k, v in row.items() if k not in ("top_kernels",)}), flush=True)
        rows.append(row)
        Path(args.out).write_text(json.dumps({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
