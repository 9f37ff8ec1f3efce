"""Dense vs naive vs certified KV caches on needle-in-a-haystack prompts of several lengths, with one model.

For each prompt length: greedy generation with each cache mode; reports whether naive and certified
reproduce the dense tokens, whether the answer contains the needle, decode tokens/s, the certificate
summary and tier-1 memory. Writes JSON.

    python scripts/compare_caches.py --lengths 1000,4000 --out results/compare_caches.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from certattn_jax import cli  # noqa: E402
from certattn_jax.certificate import summarize  # noqa: E402
from certattn_jax.demo import haystack_prompt  # noqa: E402
from certattn_jax.memory import memory_report  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", default="1000,4000")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen_args = argparse.Namespace(max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=1.0, seed=0,
                                  prefill_chunk=512, eps=None, key_bits=None, value_bits=None)
    cli.enable_compilation_cache()
    pre = cli.load_model(args.model, args.dtype)
    policy = cli.policy_from_args(gen_args)
    rows = []
    for n in map(int, args.lengths.split(",")):
        for seed in map(int, args.seeds.split(",")):
            text, answer = haystack_prompt(pre.tokenizer, n, seed)
            ids = cli.prompt_ids(pre, text, raw=False)
            row = {"prompt_tokens": len(ids), "seed": seed, "needle": answer}
            outs = {}
            for mode in cli.CACHE_MODES:
                t0 = time.perf_counter()
                out = cli.run_generation(pre, ids, gen_args, mode, policy, record=mode == "certified")
                outs[mode] = out
                text_out = pre.tokenizer.decode(out.tokens[0], skip_special_tokens=True)
                row[mode] = {"tokens_per_s": out.tokens_per_s, "wall_s": time.perf_counter() - t0,
                             "found_needle": answer in text_out, "text": text_out,
                             "same_tokens_as_dense": out.tokens[0] == outs["dense"].tokens[0]}
                if mode != "dense":
                    row[mode]["tier1_fraction"] = memory_report(out.cache)["tier1_fraction"]
            row["certificates"] = summarize(outs["certified"].step_records)
            rows.append(row)
            _write(args.out, policy, args.model, rows)
            print(json.dumps({k: v for k, v in row.items() if k != "certificates"} | {
                "cert": {k: row["certificates"][k] for k in ("rung_histogram", "mean_k_star",
                                                              "fraction_certified", "max_error_bound")}}), flush=True)


def _write(out: str | None, policy, model: str, rows: list) -> None:
    if not out:
        return
    result = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "model": model,
              "policy": repr(policy), "rows": rows}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
