"""The main job (`bash scripts/demo.sh`): generation with the default model, then the three KV caches side by
side on a needle-in-a-haystack prompt that the model solves with the dense cache, then the same prompt under a
lower-bit policy. The needle format and the default seed come from `scripts/needle_study.py` (docs/demo.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from typing import Any

from certattn_jax import runner as cli  # the helpers once in cli (no import cycle)
from certattn_jax.certificate import summarize
from certattn_jax.memory import memory_report
from certattn_jax.needle import build_needle_prompt, contains_needle

DEFAULT_CHAT_PROMPT = "Explain in a few sentences why the sky is blue."
# The demo's needle setting (docs/demo.md has the dense retrieval rates behind this choice).
DEMO_FORMAT = "magic-towns-primed"
DEMO_SEED = 0
DEMO_DEPTH = 0.5
# Part 3: the lower-bit layout (K4V2) whose naive cache is compared with the certified one.
HARDER_BITS = {"key_bits": 4, "value_bits": 2}
_NAMES = ["Arden", "Brisk", "Calder", "Dunmore", "Elwood", "Farrow", "Glenby", "Harlow", "Ivel", "Jasper",
          "Kestrel", "Lomond", "Marsh", "Norwick", "Oakham", "Pryor", "Quill", "Rowan", "Selby", "Thorne"]


def haystack_prompt(tokenizer, approx_tokens: int, seed: int = 0) -> tuple[str, str]:
    """The old demo's prompt text (filler town facts + a password needle; kept for the tests and
    scripts/compare_caches.py that use it as a long realistic prompt); returns (text, the needle's answer).
    SmolLM2-135M mostly misses this needle at ~1.5K tokens (docs/demo.md), so the demo no longer uses it."""
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


def agreement(tokens: list[int], reference: list[int]) -> str:
    """'identical', or where the token sequences first differ (a length difference counts)."""
    n = min(len(tokens), len(reference))
    first = next((i for i in range(n) if tokens[i] != reference[i]), None)
    if first is None and len(tokens) == len(reference):
        return "identical"
    return f"differs from token {first if first is not None else n}"


@dataclasses.dataclass(frozen=True)
class ModeResult:
    """One cache mode's answer on the needle prompt, with where its time went (seconds)."""

    mode: str
    text: str
    tokens: list[int]
    compile_s: float
    prefill_s: float
    decode_s: float
    wall_s: float
    tokens_per_s: float


def verdicts(results: list[ModeResult], value: str, dense: ModeResult) -> list[dict[str, Any]]:
    """Per mode: found (the answer contains the needle's value) and agreement with the dense tokens."""
    return [{"mode": r.mode, "found": contains_needle(r.text, value),
             "vs_dense": "(reference)" if r is dense else agreement(r.tokens, dense.tokens)} for r in results]


def conclusion(rows: list[dict[str, Any]]) -> str:
    """One plain sentence on what the rows show (rows from `verdicts`, the dense one first)."""
    dense, others = rows[0], rows[1:]
    if not dense["found"]:
        return ("The DENSE cache MISSED the needle: the model itself fails this prompt, so agreement with dense "
                "says only that the caches behave alike, not that anything retrieved the needle.")
    missed = [r["mode"] for r in others if not r["found"]]
    if not missed:
        return "Every cache found the needle."
    kept = [r["mode"] for r in others if r["found"]]
    return (f"Dense found the needle; {' and '.join(missed)} missed it"
            + (f", {' and '.join(kept)} found it." if kept else "."))


def _run_mode(pretrained, ids: list[int], args: argparse.Namespace, mode: str, policy) -> tuple[ModeResult, Any]:
    t0 = time.perf_counter()
    out = cli.run_generation(pretrained, ids, args, mode, policy, record=mode == "certified")
    wall = time.perf_counter() - t0
    text = pretrained.tokenizer.decode(out.tokens[0], skip_special_tokens=True)
    return ModeResult(mode, text, out.tokens[0], out.compile_seconds, out.prefill_seconds, out.decode_seconds,
                      wall, out.tokens_per_s), out


def _print_table(results: list[ModeResult], rows: list[dict[str, Any]], prime: str) -> None:
    print(f"{'cache':10s} {'needle':7s} {'vs dense':24s} {'compile':>8s} {'prefill':>8s} {'decode':>8s} "
          f"{'total':>8s} {'tok/s':>7s}")
    for r, v in zip(results, rows, strict=True):
        print(f"{r.mode:10s} {'found' if v['found'] else 'MISSED':7s} {v['vs_dense']:24s} {r.compile_s:7.1f}s "
              f"{r.prefill_s:7.1f}s {r.decode_s:7.1f}s {r.wall_s:7.1f}s {r.tokens_per_s:7.1f}")
    for r in results:
        print(f"    {r.mode:9s} {prime}{r.text.strip()[:200]!r}".replace("\n", " "))


def run_demo(args: argparse.Namespace) -> None:
    pretrained = cli.load_model(args.model, args.dtype)
    tok = pretrained.tokenizer
    policy = cli.policy_from_args(args)
    fmt = getattr(args, "needle_format", None) or DEMO_FORMAT
    seed = DEMO_SEED if getattr(args, "needle_seed", None) is None else args.needle_seed
    depth = DEMO_DEPTH if getattr(args, "needle_depth", None) is None else args.needle_depth
    # built first so that a bad needle option fails before part 1 runs
    needle = None if args.skip_comparison else build_needle_prompt(tok, fmt, args.long_tokens, seed, depth)
    context = pretrained.config.max_position_embeddings
    answer = getattr(args, "needle_new_tokens", 24)
    if needle is not None and len(needle.ids) + answer > context:
        raise ValueError(f"--long-tokens {args.long_tokens}: part 2's prompt ({len(needle.ids)} tokens) and its "
                         f"{answer} answer tokens exceed the model's context of {context} tokens")

    print("=== 1. Chat generation (dense cache) ===")
    prompt = args.prompt or DEFAULT_CHAT_PROMPT
    ids = cli.prompt_ids(pretrained, prompt, args.raw)
    out = cli.run_generation(pretrained, ids, args, "dense")
    print(f"> {prompt}\n{tok.decode(out.tokens[0], skip_special_tokens=True)}")
    print(f"[{len(out.tokens[0])} tokens, {out.tokens_per_s:.1f} tokens/s decode, prompt {len(ids)} tokens "
          f"in {out.prefill_seconds:.2f} s, compile {out.compile_seconds:.1f} s]\n")
    if args.skip_comparison:
        return

    needle_args = argparse.Namespace(**{**vars(args), "max_new_tokens": getattr(args, "needle_new_tokens", 24)})
    prime = needle.fmt.prime.format(key=needle.key, value=needle.value)
    prime = prime + " " if prime else ""
    print(f"=== 2. Needle in a haystack: dense vs naive vs certified on a {len(needle.ids)}-token prompt ===")
    print(f"needle format {needle.fmt.name!r} (seed {seed}): a {needle.doc_tokens}-token document "
          f"({needle.fmt.haystack} filler) holds, at depth {depth:.2f}, "
          f"{needle.fmt.needle.format(key=needle.key, value=needle.value)!r}")
    print(f"question: {needle.fmt.question.format(key=needle.key, value=needle.value)!r}"
          + (f"; the answer is primed with {prime.strip()!r}" if prime else ""))
    print(f"policy: K{policy.key_bits}V{policy.value_bits}, block {policy.block_size}, group {policy.group_size}, "
          f"eps {policy.eps}, tau_cov {policy.tau_cov}, k_max {policy.k_max}")
    results, certified = [], None
    for mode in cli.CACHE_MODES:
        res, out = _run_mode(pretrained, needle.ids, needle_args, mode, policy)
        results.append(res)
        certified = out if mode == "certified" else certified
        del out  # only the certified output (cache, certificates) is needed below: keep peak memory down
    rows = verdicts(results, needle.value, results[0])
    _print_table(results, rows, prime)
    print(conclusion(rows))
    print("(compile: compiling the decode loop; prefill: the prompt's forward pass, including the compilation of "
          "the prefill step the first time a cache layout is seen; compiled programs are kept in the on-disk "
          "compilation cache, which shortens later runs)")
    mem = memory_report(certified.cache)
    mem32k = memory_report(_empty_tiered(pretrained, policy, 32768))
    print(f"tier 1 (device) here: {mem['tier1_device_bytes'] / 2**20:.1f} MiB vs {mem['dense_bf16_bytes'] / 2**20:.1f} "
          f"MiB for a dense bf16 cache of the same capacity (the exact residual block and k_max hot blocks weigh "
          f"most at short contexts); at 32K tokens: {100 * mem32k['tier1_fraction']:.1f}% of dense bf16. "
          f"Tier 2 ({mem['tier2_memory_kind'] or 'device'}): {mem['tier2_host_bytes'] / 2**20:.1f} MiB.")
    _print_certificates(certified.step_records)
    del certified
    if getattr(args, "skip_harder", False):
        return

    harder = dataclasses.replace(policy, **HARDER_BITS)
    print(f"\n=== 3. Harder: the same prompt with {harder.key_bits}-bit keys and {harder.value_bits}-bit values "
          f"(K{harder.key_bits}V{harder.value_bits}) ===")
    results3 = [results[0]]
    for mode in ("naive", "certified"):
        res, out = _run_mode(pretrained, needle.ids, needle_args, mode, harder)
        results3.append(res)
    rows3 = verdicts(results3, needle.value, results3[0])
    _print_table(results3, rows3, prime)
    print(conclusion(rows3))
    if rows3[0]["found"] and rows3[1]["found"]:
        print("No harder setting found: in our search (docs/demo.md) the naive K4V2 cache retrieved every needle "
              "that dense did on this model (10 prompts: 1,500 and 3,000 tokens, block 64 and 256), so the difference "
              "between the caches here is token agreement with dense, not the needle.")
    _print_certificates(out.step_records)


def _print_certificates(records) -> None:
    s = summarize(records)
    if not s["heads"]:
        print("certificates: none recorded (a one-token answer)")
        return
    print(f"certificates: {s['heads']} head-steps, rungs {s['rung_histogram']}, "
          f"{100 * s['fraction_certified_without_escalation']:.1f}% certified without escalation, "
          f"{100 * s['fraction_certified']:.1f}% certified, mean K* {s['mean_k_star']:.2f}, "
          f"max bound {s['max_error_bound']:.3g}")


def _empty_tiered(pretrained, policy, capacity: int):
    import jax.numpy as jnp

    from certattn_jax.cache import TieredKVCache

    cfg = pretrained.config
    return TieredKVCache.init(batch=1, capacity=capacity, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              dtype=jnp.bfloat16, policy=policy)

