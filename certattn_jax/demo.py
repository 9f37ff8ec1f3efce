"""The main job (`bash scripts/demo.sh`): generation with the default model, then the three KV caches side by
side on one long prompt (a needle-in-a-haystack document)."""

from __future__ import annotations

import argparse
import random

from certattn_jax import runner as cli  # the helpers once in cli (no import cycle)
from certattn_jax.certificate import summarize
from certattn_jax.memory import memory_report

DEFAULT_CHAT_PROMPT = "Explain in a few sentences why the sky is blue."
_NAMES = ["Arden", "Brisk", "Calder", "Dunmore", "Elwood", "Farrow", "Glenby", "Harlow", "Ivel", "Jasper",
          "Kestrel", "Lomond", "Marsh", "Norwick", "Oakham", "Pryor", "Quill", "Rowan", "Selby", "Thorne"]


def haystack_prompt(tokenizer, approx_tokens: int, seed: int = 0) -> tuple[str, str]:
    """A long document of filler facts with one needle; returns (document + question, the needle's answer)."""
    rng = random.Random(seed)
    answer = f"{rng.choice(['amber', 'cobalt', 'scarlet', 'violet'])}-{rng.choice(['falcon', 'otter', 'heron'])}-" \
             f"{rng.randint(10, 99)}"
    facts = []
    while True:
        name = f"{rng.choice(_NAMES)} {rng.choice(['Vale', 'Ford', 'Hill', 'Port', 'Cross'])}"
        facts.append(f"The town of {name} has {rng.randint(2, 90)} bridges and {rng.randint(100, 9999)} houses.")
        if len(tokenizer.encode(" ".join(facts))) >= approx_tokens:
            break
    facts.insert(len(facts) // 2, f"Remember this: the secret password is {answer}.")
    question = "What is the secret password mentioned in the document above? Answer with the password only."
    return "Read the document and answer the question.\n\n" + " ".join(facts) + "\n\n" + question, answer


def _agreement(a: list[int], b: list[int]) -> str:
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    if first is None and len(a) == len(b):
        return "identical"
    return f"first differs at token {first if first is not None else n}"


def run_demo(args: argparse.Namespace) -> None:
    pretrained = cli.load_model(args.model, args.dtype)
    tok = pretrained.tokenizer
    policy = cli.policy_from_args(args)

    print("=== 1. Chat generation (dense bf16/f32 cache) ===")
    prompt = args.prompt or DEFAULT_CHAT_PROMPT
    ids = cli.prompt_ids(pretrained, prompt, args.raw)
    out = cli.run_generation(pretrained, ids, args, "dense")
    print(f"> {prompt}\n{tok.decode(out.tokens[0], skip_special_tokens=True)}")
    print(f"[{len(out.tokens[0])} tokens, {out.tokens_per_s:.1f} tokens/s decode, prompt {len(ids)} tokens "
          f"in {out.prefill_seconds:.2f} s, compile {out.compile_seconds:.1f} s]\n")
    if args.skip_comparison:
        return

    text, answer = haystack_prompt(tok, args.long_tokens)
    ids = cli.prompt_ids(pretrained, text, args.raw)
    print(f"=== 2. dense vs naive vs certified on a {len(ids)}-token prompt (needle: {answer}) ===")
    print(f"policy: K{policy.key_bits}V{policy.value_bits}, block {policy.block_size}, group {policy.group_size}, "
          f"eps {policy.eps}, tau_cov {policy.tau_cov}, k_max {policy.k_max}")
    results = {}
    for mode in cli.CACHE_MODES:
        results[mode] = cli.run_generation(pretrained, ids, args, mode, policy, record=mode == "certified")
    dense_tokens = results["dense"].tokens[0]
    for mode, res in results.items():
        text_out = tok.decode(res.tokens[0], skip_special_tokens=True).strip().replace("\n", " ")
        line = f"--- {mode:9s} {res.tokens_per_s:7.1f} tok/s  {_agreement(res.tokens[0], dense_tokens):28s}"
        print(line)
        print(f"    {text_out[:300]}")
    mem = memory_report(results["certified"].cache)
    mem32k = memory_report(_empty_tiered(pretrained, policy, 32768))
    print(f"tier 1 (device) here: {mem['tier1_device_bytes'] / 2**20:.1f} MiB vs {mem['dense_bf16_bytes'] / 2**20:.1f} "
          f"MiB for a dense bf16 cache of the same capacity (the exact residual block and k_max hot blocks weigh "
          f"most at short contexts); at 32K tokens: {100 * mem32k['tier1_fraction']:.1f}% of dense bf16. "
          f"Tier 2 ({mem['tier2_memory_kind'] or 'device'}): {mem['tier2_host_bytes'] / 2**20:.1f} MiB.")
    s = summarize(results["certified"].step_records)
    print(f"certificates: {s['heads']} head-steps, rungs {s['rung_histogram']}, "
          f"{100 * s['fraction_certified_without_escalation']:.1f}% certified without escalation, "
          f"mean K* {s['mean_k_star']:.2f}, max bound {s['max_error_bound']:.3g}")


def _empty_tiered(pretrained, policy, capacity: int):
    import jax.numpy as jnp

    from certattn_jax.cache import TieredKVCache

    cfg = pretrained.config
    return TieredKVCache.init(batch=1, capacity=capacity, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              dtype=jnp.bfloat16, policy=policy)
