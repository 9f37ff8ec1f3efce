"""Command line: `python -m certattn_jax generate|convert|demo ...` (see `--help`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

DEFAULT_DEMO_PROMPT = "Explain in a few sentences why the sky is blue."


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m certattn_jax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    _add_generation_args(g)
    g.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    g.add_argument("--json", action="store_true", help="print one JSON object last")

    d = sub.add_parser("demo", help="the main job: generation with the default model")
    _add_generation_args(d, default_new=96)
    d.add_argument("--prompt", default=DEFAULT_DEMO_PROMPT)

    c = sub.add_parser("convert", help="convert an HF directory or GGUF file to an orbax checkpoint")
    c.add_argument("source")
    c.add_argument("outdir")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    return p


def _add_generation_args(g: argparse.ArgumentParser, default_new: int = 64) -> None:
    g.add_argument("--model", default="smollm2", help="'smollm2', an HF dir, a .gguf file or a checkpoint dir")
    g.add_argument("--max-new-tokens", type=int, default=default_new)
    g.add_argument("--cache", default="dense", choices=["dense"])
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    g.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    g.add_argument("--prefill-chunk", type=int, default=256)


def _dtype(name: str):
    import jax.numpy as jnp

    return {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}[name]


def _prompt_ids(pretrained, text: str, raw: bool) -> list[int]:
    tok = pretrained.tokenizer
    if tok is None:
        raise SystemExit("error: this model has no tokenizer; cannot encode a text prompt")
    if not raw and tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tok.encode(text)


def _run_generation(args: argparse.Namespace, emit_json: bool) -> dict:
    from models import load_pretrained
    from models.generate import generate

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise SystemExit("error: empty prompt")
    pretrained = load_pretrained(args.model, dtype=_dtype(args.dtype))
    ids = _prompt_ids(pretrained, prompt, args.raw)
    eos = pretrained.tokenizer.eos_token_ids if pretrained.tokenizer else None
    out = generate(pretrained.params, pretrained.config, [ids], args.max_new_tokens,
                   temperature=args.temperature, top_p=args.top_p, seed=args.seed, eos_token_ids=eos,
                   prefill_chunk=args.prefill_chunk)
    new_ids = out.tokens[0]
    text = pretrained.tokenizer.decode(new_ids) if pretrained.tokenizer else ""
    result = {"token_ids": new_ids, "text": text, "tokens_per_s": out.tokens_per_s,
              "prompt_tokens": len(ids), "prefill_seconds": out.prefill_seconds,
              "decode_seconds": out.decode_seconds, "cache": args.cache}
    if not emit_json:
        print(text)
    print(f"[{len(new_ids)} tokens, {out.tokens_per_s:.1f} tokens/s decode (incl. compile on first call), "
          f"prompt {len(ids)} tokens in {out.prefill_seconds:.2f} s]", file=sys.stderr)
    if emit_json:
        print(json.dumps(result))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            _run_generation(args, emit_json=args.json)
        elif args.command == "demo":
            _run_generation(args, emit_json=False)
        elif args.command == "convert":
            from models import convert

            path = convert(args.source, args.outdir, dtype=_dtype(args.dtype))
            print(f"wrote {path}")
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
