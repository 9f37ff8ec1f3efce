"""Command line: `python -m certattn_jax generate|demo|convert|eval ...` (see `--help`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The helpers shared with the demo live in certattn_jax.runner (so cli and demo do not import each other);
# re-exported here under their old names.
from certattn_jax.runner import (  # noqa: F401
    CACHE_MODES,
    _dtype,
    cache_factory,
    enable_compilation_cache,
    load_model,
    policy_from_args,
    prompt_ids,
    run_generation,
    stop_ids,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m certattn_jax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    _add_generation_args(g)
    g.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    g.add_argument("--cache", default="dense", choices=CACHE_MODES)
    g.add_argument("--certificates", default=None, metavar="FILE.jsonl",
                   help="with --cache certified: write every step's per-layer certificates here")
    g.add_argument("--block-size", type=int, default=None,
                   help="naive/certified cache: tokens per key block (CertPolicy.block_size, a power of two)")
    g.add_argument("--group-size", type=int, default=None,
                   help="naive/certified cache: value channels per quantization group (CertPolicy.group_size; "
                        "must divide the model's head_dim)")
    g.add_argument("--json", action="store_true", help="print one JSON object last")

    d = sub.add_parser("demo", help="the main job: generation with the default model, then dense vs naive vs "
                                    "certified caches on one long prompt")
    _add_generation_args(d, default_new=64)
    d.add_argument("--prompt", default=None, help="the chat prompt of part 1")
    d.add_argument("--long-tokens", type=int, default=1500, help="approximate length of part 2's prompt")
    d.add_argument("--skip-comparison", action="store_true", help="only part 1")
    d.add_argument("--needle-format", default=None, help="part 2's needle format (certattn_jax/needle.py FORMATS; "
                                                         "default: the demo's choice, docs/demo.md)")
    d.add_argument("--needle-seed", type=int, default=None, help="seed of part 2's document and needle")
    d.add_argument("--needle-depth", type=float, default=None, help="needle position in the document, 0..1")
    d.add_argument("--skip-harder", action="store_true", help="skip part 3 (the K4V2 naive vs certified run)")
    d.add_argument("--needle-new-tokens", type=int, default=24, help="new tokens for the needle answers (parts 2-3)")

    c = sub.add_parser("convert", help="convert an HF directory or GGUF file to an orbax checkpoint")
    c.add_argument("source")
    c.add_argument("outdir")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    c.add_argument("--overwrite", action="store_true", help="replace OUTDIR if it exists")
    from certattn_jax.evals.cli import add_eval_parser

    add_eval_parser(sub)
    return p


def _add_generation_args(g: argparse.ArgumentParser, default_new: int = 64) -> None:
    g.add_argument("--model", default="smollm2", help="'smollm2', an HF dir, a .gguf file or a checkpoint dir")
    g.add_argument("--max-new-tokens", type=int, default=default_new)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bfloat16 on accelerators, float32 on CPU")
    g.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    g.add_argument("--prefill-chunk", type=int, default=256)
    g.add_argument("--eps", type=float, default=None, help="certified cache: relative tolerance (CertPolicy.eps)")
    g.add_argument("--key-bits", type=int, default=None, choices=[4, 8])
    g.add_argument("--value-bits", type=int, default=None, choices=[2, 4])


def write_certificates(path: str, records) -> int:
    """One JSON line per (decode step, layer) with per-query-head lists (batch element 0)."""
    import numpy as np

    fields = {name: np.asarray(getattr(records, name)) for name in records.__dataclass_fields__}
    steps, layers = fields["rung"].shape[:2]
    with open(path, "w") as f:
        for s in range(steps):
            for layer in range(layers):
                row: dict[str, Any] = {"step": s + 1, "layer": layer}
                for name, arr in fields.items():
                    row[name] = arr[s, layer, 0].tolist()
                f.write(json.dumps(row) + "\n")
    return steps * layers


SEED_RANGE = (-(2**63), 2**63 - 1)  # what models.sampling.key_from_seed takes (all 64 bits count)
# policy flags -> the cache modes they apply to (given for another mode they would be ignored silently)
POLICY_FLAGS = {"eps": ("certified",), "key_bits": ("naive", "certified"), "value_bits": ("naive", "certified"),
                "block_size": ("naive", "certified"), "group_size": ("naive", "certified")}


def check_demo_args(args: argparse.Namespace) -> None:
    """ValueError naming a bad demo-only argument, before part 1 runs (they used to fail after it, or be ignored)."""
    for name in ("needle_new_tokens", "long_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(args, name)}")
    if args.skip_comparison:
        given = [f"--{n.replace('_', '-')}" for n in POLICY_FLAGS if getattr(args, n, None) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} set the cache policy of parts 2-3, which --skip-comparison skips")


def check_generation_args(args: argparse.Namespace) -> None:
    """ValueError naming the first bad sampling argument, checked before the (slow) model load."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be an integer >= 1, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:  # (NaN fails it)
        raise ValueError(f"--top-p must lie in (0, 1], got {args.top_p}")
    if not SEED_RANGE[0] <= args.seed <= SEED_RANGE[1]:
        raise ValueError(f"--seed must lie in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {args.seed}")
    if args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be an integer >= 1, got {args.prefill_chunk}")


def check_output_file(path: str, flag: str = "--certificates", example: str = "certs.jsonl",
                      make_parent: bool = False) -> None:
    """ValueError unless the file `path` (given with `flag`) can be written: checked before any compute, not after
    (which lost the output). make_parent: its directory may be missing (it is created now, as the writer would)."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a directory: give a file name (e.g. {p / example})")
    parent = p.resolve().parent
    if make_parent and not parent.exists():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{flag} {path}: cannot create its directory ({e.strerror})") from None
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: its directory does not exist")
    # an existing file is truncated in place (its directory's permission does not matter: e.g. /dev/null)
    if not os.access(p, os.W_OK) if p.exists() else not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: not writable")


def check_output_dir(path: str, flag: str) -> None:
    """ValueError unless the directory `path` (given with `flag`) exists or can be made, and can be written."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path} is a file: give a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create it ({e.strerror})") from None
    if not os.access(p, os.W_OK):
        raise ValueError(f"{flag} {path}: not writable")


def generation_policy(args: argparse.Namespace) -> Any:
    """The CertPolicy of `generate`'s flags (all of them checked by CertPolicy), refusing a policy flag the cache
    mode does not use; None for the dense cache."""
    for name, modes in POLICY_FLAGS.items():
        if getattr(args, name, None) is not None and args.cache not in modes:
            raise ValueError(f"--{name.replace('_', '-')} applies to --cache {' or '.join(modes)} only")
    if args.cache == "dense":
        return None
    layout = {k: v for k in ("block_size", "group_size") if (v := getattr(args, k)) is not None}
    return policy_from_args(args).replace(**layout)


def check_head_dim(config: Any, policy: Any) -> None:
    """ValueError pointing at --group-size where the model's head_dim is no multiple of the value group size."""
    from certattn_jax import quant

    if policy is not None:
        quant.check_group_size(config.head_dim, policy.group_size, fix="--group-size")


def _cmd_generate(args: argparse.Namespace) -> None:
    from certattn_jax.certificate import summarize

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise ValueError("empty prompt")
    if args.certificates and args.cache != "certified":
        raise ValueError("--certificates needs --cache certified")
    if args.certificates:
        check_output_file(args.certificates)
    check_generation_args(args)
    policy = generation_policy(args)
    enable_compilation_cache()
    pretrained = load_model(args.model, args.dtype)
    check_head_dim(pretrained.config, policy)
    ids = prompt_ids(pretrained, prompt, args.raw)
    certified = args.cache == "certified"
    out = run_generation(pretrained, ids, args, args.cache, policy, record=certified)
    new_ids = out.tokens[0]
    text = pretrained.tokenizer.decode(new_ids, skip_special_tokens=True) if pretrained.tokenizer else ""
    result: dict[str, Any] = {"token_ids": new_ids, "text": text, "tokens_per_s": out.tokens_per_s,
                              "prompt_tokens": len(ids), "prefill_seconds": out.prefill_seconds,
                              "decode_seconds": out.decode_seconds, "compile_seconds": out.compile_seconds,
                              "cache": args.cache}
    if certified:
        result["certificate_summary"] = summarize(out.step_records)
    if not args.json:
        print(text)
        if certified:
            print(json.dumps(result["certificate_summary"]), file=sys.stderr)
    print(f"[{len(new_ids)} tokens, {out.tokens_per_s:.1f} tokens/s decode, compile {out.compile_seconds:.1f} s, "
          f"prompt {len(ids)} tokens in {out.prefill_seconds:.2f} s, cache {args.cache}]", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    if args.certificates:  # last: should writing fail after all, the generated text is out
        try:
            n = write_certificates(args.certificates, out.step_records)
        except OSError as e:
            raise ValueError(f"could not write --certificates {args.certificates}: {e}") from None
        print(f"[certattn] wrote {n} certificate rows to {args.certificates}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            _cmd_generate(args)
        elif args.command == "demo":
            from certattn_jax.demo import run_demo

            check_generation_args(args)
            check_demo_args(args)
            enable_compilation_cache()
            run_demo(args)
        elif args.command == "convert":
            from models import convert

            if Path(args.outdir).exists() and not args.overwrite:  # before the (slow) load of the source
                raise FileExistsError(f"{args.outdir} exists (pass --overwrite to replace it)")
            existing = next(p for p in Path(args.outdir).resolve().parents if p.exists())
            if not (existing.is_dir() and os.access(existing, os.W_OK)):  # also before the load
                raise ValueError(f"cannot write {args.outdir}: {existing} is not a writable directory")
            path = convert(args.source, args.outdir, dtype=_dtype(args.dtype), overwrite=args.overwrite)
            print(f"wrote {path}")
        elif args.command == "eval":
            from certattn_jax.evals.cli import run_eval

            run_eval(args)
    except (ValueError, FileNotFoundError, FileExistsError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
