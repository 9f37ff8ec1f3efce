"""`python -m certattn_jax eval {ppl,niah,ruler,audit,ablations,aggressive,all} ...` (see docs/evaluation.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

JOBS = ("ppl", "niah", "ruler", "audit", "ablations", "aggressive", "memory", "all")
DEFAULT_TASKS = ("niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,"
                 "niah_multivalue,niah_multiquery,vt,cwe,fwe")


def _ints(s: str, flag: str = "") -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {s!r}") from None


def _floats(s: str, flag: str = "") -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers, got {s!r}") from None


SEED_RANGE = (-(2**63), 2**63 - 1)  # as `generate --seed`; jobs drawing windows with numpy need >= 0
STRING_SEEDED_JOBS = ("ruler", "niah")  # their samples are seeded by a string (`ruler.generate_samples`)


def check_outputs(args: argparse.Namespace) -> None:
    """Every output path checked before the model loads (a bad one found after the compute lost the results)."""
    from certattn_jax.cli import check_output_dir, check_output_file

    check_output_file(args.out or f"results/eval_{args.job}.json", "--out", "eval.json", make_parent=True)
    if args.summary:
        check_output_file(args.summary, "--summary", "eval_summary.json", make_parent=True)
    if args.audit_log:
        check_output_file(args.audit_log, "--audit-log", "audit.jsonl")
    if args.plots:
        check_output_dir(args.plots, "--plots")


def add_eval_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the `eval` subcommand to the CLI's subparsers."""
    e = sub.add_parser("eval", help="the paper's evaluation: perplexity, NIAH, RULER, soundness audit, ablations")
    e.add_argument("job", choices=JOBS)
    e.add_argument("--model", default="smollm2")
    e.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    e.add_argument("--cache", default="dense,naive,certified",
                   help="comma-separated cache modes among dense, naive, certified (default: all three), and "
                        "dense-reduce: the noise-floor control (exact attention, another summation order)")
    e.add_argument("--key-bits", type=int, default=None, choices=[4, 8])
    e.add_argument("--value-bits", type=int, default=None, choices=[2, 4])
    e.add_argument("--eps", type=float, default=None, help="CertPolicy.eps (relative value tolerance)")
    e.add_argument("--tau-cov", type=float, default=None, help="CertPolicy.tau_cov")
    e.add_argument("--hot-slots", type=int, default=None,
                   help="CertPolicy.hot_slots (blocks per KV head the hot set holds; default k_max)")
    e.add_argument("--lengths", default="2048,4096,8192", help="context lengths in tokens (comma-separated)")
    e.add_argument("--samples", type=int, default=4, help="windows per length (ppl), needles per cell (niah), "
                                                          "samples per task and length (ruler)")
    e.add_argument("--ppl-steps", type=int, default=256, help="tokens per window teacher-forced through decode")
    e.add_argument("--depths", default="0,25,50,75,100", help="NIAH needle depths in percent")
    e.add_argument("--tasks", default=DEFAULT_TASKS, help="RULER tasks (comma-separated)")
    e.add_argument("--max-new-tokens", type=int, default=None, help="cap on RULER's tokens to generate")
    e.add_argument("--niah-new-tokens", type=int, default=24)
    e.add_argument("--sweep-tau", default="0.9,0.99,0.995", help="ablations: tau_cov values")
    e.add_argument("--sweep-eps", default="0.01,0.05,0.2", help="ablations: eps values")
    e.add_argument("--capacity", type=int, default=None, help="cache capacity (default: the largest length)")
    e.add_argument("--prefill-chunk", type=int, default=256)
    e.add_argument("--layers", type=int, default=None, help="keep only the first N layers (tests, smoke runs)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--no-audit", action="store_true", help="do not compute the true error of tiered caches")
    e.add_argument("--audit-log", default=None, metavar="FILE.jsonl",
                   help="stream every certified decode step's certificates and true errors here")
    e.add_argument("--out", default=None, help="result JSON (default results/eval_<job>.json)")
    e.add_argument("--summary", default=None, help="also write the headline figures here (eval_summary.json)")
    e.add_argument("--plots", default=None, help="directory for PNG plots (default: none)")
    return e


def _device() -> str:
    import jax

    d = jax.devices()[0]
    return f"{d.platform}: {d.device_kind} (jax {jax.__version__})"


def build(args: argparse.Namespace):
    """(session, EvalConfig, stop ids, model label) from parsed arguments."""
    from certattn_jax import cli
    from certattn_jax.evals.runner import EvalConfig
    from certattn_jax.evals.session import Mode, Session
    from certattn_jax.policy import CertPolicy

    modes_named = [m.strip() for m in args.cache.split(",") if m.strip()]
    allowed = tuple(cli.CACHE_MODES) + ("dense-reduce",)
    bad = [m for m in modes_named if m not in allowed]
    if bad or not modes_named:
        raise ValueError(f"--cache takes a comma-separated list of {allowed}, got {args.cache!r}")
    overrides = {k: v for k, v in (("eps", args.eps), ("key_bits", args.key_bits), ("value_bits", args.value_bits),
                                   ("tau_cov", args.tau_cov), ("hot_slots", args.hot_slots)) if v is not None}
    policy = dataclasses.replace(CertPolicy(), **overrides)
    lengths = _ints(args.lengths, "--lengths")
    if not lengths or min(lengths) < 64:
        raise ValueError(f"--lengths must be positive token counts >= 64, got {args.lengths!r}")
    if args.samples < 1:
        raise ValueError("--samples must be >= 1")
    for name in ("prefill_chunk", "ppl_steps", "niah_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1 (leave it out for each task's own cap), got "
                         f"{args.max_new_tokens}")
    if args.capacity is not None and args.capacity < 1:
        raise ValueError(f"--capacity must be >= 1 (leave it out for the largest length), got {args.capacity}")
    low = SEED_RANGE[0] if args.job in STRING_SEEDED_JOBS else 0
    if not low <= args.seed <= SEED_RANGE[1]:
        raise ValueError(f"--seed must lie in [{low}, {SEED_RANGE[1]}] for the {args.job} job, got {args.seed}")
    sweeps = ([dict(eps=e) for e in _floats(args.sweep_eps, "--sweep-eps")]
              + [dict(tau_cov=t) for t in _floats(args.sweep_tau, "--sweep-tau")])
    for sweep in sweeps:  # a bad swept value fails now, not after the runs before it
        dataclasses.replace(policy, **sweep)
    depths = _ints(args.depths, "--depths")
    if any(not 0 <= d <= 100 for d in depths):
        raise ValueError(f"--depths are percentages in [0, 100], got {args.depths!r}")
    from certattn_jax.evals import ruler

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in ruler.TASKS]
    if unknown:
        raise ValueError(f"unknown RULER tasks {unknown}; choose from {sorted(ruler.TASKS)}")
    check_outputs(args)
    pre = cli.load_model(args.model, args.dtype)
    if pre.tokenizer is None:
        raise ValueError("the evaluation needs a model with a tokenizer")
    params, config = pre.params, pre.config
    context = config.max_position_embeddings
    if args.job != "memory" and max(lengths) > context:  # the memory job only counts bytes: any length
        raise ValueError(f"--lengths {max(lengths)} exceeds the model's context of {context} tokens")
    if args.layers is not None:
        if not 1 <= args.layers <= config.num_layers:
            raise ValueError(f"--layers must be in [1, {config.num_layers}]")
        params = {**params, "layers": params["layers"][:args.layers]}
        config = dataclasses.replace(config, num_layers=args.layers)
    chunk = args.prefill_chunk
    capacity = args.capacity or -(-max(lengths) // chunk) * chunk
    if capacity < max(lengths):
        raise ValueError(f"--capacity {capacity} is smaller than the largest length {max(lengths)}")
    # a chunk past the context asked for a cache of that many tokens (100000: 721 GB); a length rounded up to the
    # chunk may pass the context by less than a chunk (positions never pass the largest length)
    if args.job != "memory" and chunk > context:
        raise ValueError(f"--prefill-chunk {chunk} exceeds the model's context of {context} tokens")
    if args.job != "memory" and args.capacity is not None and args.capacity > context:
        raise ValueError(f"--capacity {args.capacity} exceeds the model's context of {context} tokens")
    log = open(args.audit_log, "w") if args.audit_log else None  # noqa: SIM115 - closed in run_eval
    session = Session(params, config, pre.tokenizer, capacity, chunk, audit=not args.no_audit, audit_log=log)
    cfg = EvalConfig(modes=[Mode(m, m, policy) for m in modes_named], policy=policy, lengths=lengths,
                     samples=args.samples, ppl_steps=args.ppl_steps, depths=depths, tasks=tasks,
                     max_new_tokens=args.max_new_tokens, niah_new_tokens=args.niah_new_tokens, seed=args.seed,
                     plot_dir=args.plots, sweep_tau=_floats(args.sweep_tau, "--sweep-tau"),
                     sweep_eps=_floats(args.sweep_eps, "--sweep-eps"))
    label = args.model + (f" (first {args.layers} layers)" if args.layers else "")
    return session, cfg, cli.stop_ids(pre), label


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    """Run the job; write the result JSON (after every part) and, with --summary, the headline figures."""
    from certattn_jax import cli
    from certattn_jax.evals.decode import ensure_host_callback_platform
    from certattn_jax.evals.runner import run_job, summarize

    ensure_host_callback_platform()  # before the first backend starts: JAX_PLATFORMS=cuda must not break records
    cli.enable_compilation_cache()
    session, cfg, stops, label = build(args)
    out = Path(args.out or f"results/eval_{args.job}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    device = _device()
    meta = {"command": "python -m certattn_jax " + " ".join(sys.argv[1:]) if sys.argv[0].endswith(
        ("__main__.py", "certattn")) else None, "model": label, "device": device, "policy": repr(cfg.policy),
        "capacity": session.capacity, "job": args.job}

    def save(result: dict[str, Any]) -> None:
        out.write_text(json.dumps({**meta, **result}, indent=1, default=_json_default))
        if args.summary:
            Path(args.summary).write_text(json.dumps(summarize(result, label, device), indent=1,
                                                     default=_json_default))

    try:
        result = run_job(args.job, session, cfg, stops, save)
    finally:
        if session.audit_log is not None:
            session.audit_log.close()
    print(f"[certattn] wrote {out}" + (f" and {args.summary}" if args.summary else ""), file=sys.stderr)
    return result


def _json_default(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
