"""RULER's synthetic tasks, written from its published definitions (NVIDIA/RULER `scripts/data/synthetic/`:
`niah.py`, `variable_tracking.py`, `common_words_extraction.py`, `freq_words_extraction.py`, `constants.py`,
`synthetic.yaml`), with its templates, answer prefixes and scoring. Our own code; seeded and deterministic.

Differences from RULER, all forced by offline data: the essay haystack is Project Gutenberg prose
(`data.essay_words`, RULER: Paul Graham essays), sentences are split by a regex (RULER: nltk), and common-words
extraction draws only from wonderwords' lists (RULER falls back to a larger English list past ~8.7K words;
we raise instead). Each sample gets its own `random.Random` seeded by (task, length, index, seed).

A sample's prompt is `input` (the user turn; the chat template goes around it) followed by `answer_prefix`
(the start of the assistant's answer, as RULER appends it after the model template). `generate_samples`
fits every sample to `max_len` tokens including `max_new_tokens`, by a binary search over the haystack size
with the caller's token counter (which should include the chat template).
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from certattn_jax.evals import data

NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                 "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                 "magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize "
                "the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
                "above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.round(np.linspace(0, 100, 40))

# synthetic.yaml's task table: (generator, arguments)
TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "niah_single_1": ("niah", dict(haystack="noise", key="words", value="numbers", num_k=1, num_v=1, num_q=1)),
    "niah_single_2": ("niah", dict(haystack="essay", key="words", value="numbers", num_k=1, num_v=1, num_q=1)),
    "niah_single_3": ("niah", dict(haystack="essay", key="words", value="uuids", num_k=1, num_v=1, num_q=1)),
    "niah_multikey_1": ("niah", dict(haystack="essay", key="words", value="numbers", num_k=4, num_v=1, num_q=1)),
    "niah_multikey_2": ("niah", dict(haystack="needle", key="words", value="numbers", num_k=1, num_v=1, num_q=1)),
    "niah_multikey_3": ("niah", dict(haystack="needle", key="uuids", value="uuids", num_k=1, num_v=1, num_q=1)),
    "niah_multivalue": ("niah", dict(haystack="essay", key="words", value="numbers", num_k=1, num_v=4, num_q=1)),
    "niah_multiquery": ("niah", dict(haystack="essay", key="words", value="numbers", num_k=1, num_v=1, num_q=4)),
    "vt": ("vt", dict(num_chains=1, num_hops=4)),
    "cwe": ("cwe", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("fwe", dict(alpha=2.0)),
}
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}


@dataclasses.dataclass(frozen=True)
class Sample:
    task: str
    input: str  # the user turn
    answer_prefix: str  # appended after the chat template's assistant header
    outputs: tuple[str, ...]  # references
    max_new_tokens: int
    meta: dict = dataclasses.field(default_factory=dict, compare=False)


# ---------------------------------------------------------------------------------------------- scoring
def postprocess(pred: str) -> str:
    """RULER's postprocess_pred: control characters become newlines, outer whitespace is stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip())


def string_match_all(pred: str, refs: Sequence[str]) -> float:
    """Fraction of the references found in the prediction (case-insensitive), in [0, 1]."""
    if not refs:
        raise ValueError("string_match_all needs at least one reference")
    p = postprocess(pred).lower()
    return sum(r.lower() in p for r in refs) / len(refs)


def string_match_part(pred: str, refs: Sequence[str]) -> float:
    """1 if any reference is found in the prediction (case-insensitive), else 0."""
    if not refs:
        raise ValueError("string_match_part needs at least one reference")
    p = postprocess(pred).lower()
    return float(any(r.lower() in p for r in refs))


def score(task: str, pred: str, refs: Sequence[str]) -> float:
    """RULER's metric of this task (all synthetic tasks we generate use string_match_all)."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {sorted(TASKS)}")
    return string_match_all(pred, refs)


# ---------------------------------------------------------------------------------------------- randomness
class _Gen:
    """Random draws of one sample (keys, values, words), from one seeded random.Random."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        w = data.word_lists()
        self.nouns, self.adjs, self.verbs = w["nouns"], w["adjectives"], w["verbs"]

    def number(self, digits: int = 7) -> str:
        return str(self.rng.randint(10 ** (digits - 1), 10 ** digits - 1))

    def word(self) -> str:
        # RULER draws uniformly from sorted(set(adj-noun pairs)); drawing adj and noun independently is the
        # same distribution (the lists have no duplicates) without building the 6M-entry product.
        return f"{self.rng.choice(self.adjs)}-{self.rng.choice(self.nouns)}"

    def uuid(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def draw(self, kind: str) -> str:
        if kind == "numbers":
            return self.number()
        if kind == "words":
            return self.word()
        if kind == "uuids":
            return self.uuid()
        raise ValueError(f"unknown needle type {kind!r}")


def split_sentences(text: str) -> list[str]:
    """Sentences (a regex stand-in for nltk's sent_tokenize: split after . ! ? followed by whitespace)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def insert_at_depths(sentences: list[str], items: Sequence[str], depths: Sequence[int]) -> str:
    """RULER's essay insertion: item i goes before sentence int(n * depth_i / 100), depths sorted."""
    n = len(sentences)
    cuts = [0] + sorted(int(n * d / 100) for d in depths) + [n]
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(items):
            parts.append(items[i - 1])
    return " ".join(p for p in parts if p)


# ---------------------------------------------------------------------------------------------- generators
def niah(rng: random.Random, size: int, *, haystack: str, key: str, value: str, num_k: int, num_v: int,
         num_q: int, depths: Sequence[int] | None = None) -> tuple[str, str, list[str], dict]:
    """(input, answer_prefix, answers, meta) with a haystack of `size` units (words for essay, sentences for
    noise/needle). `depths` (percent) fixes the needle depths instead of RULER's random draw (the NIAH grid)."""
    g = _Gen(rng)
    num_k = max(num_k, num_q)
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(g.draw(key))
        vals = [g.draw(value) for _ in range(num_v)]
        values.append(vals)
        needles += [NEEDLE.format(type_needle_v=value, key=keys[-1], value=v) for v in vals]
    rng.shuffle(needles)
    if haystack == "essay":
        words = data.essay_words()
        start = rng.randrange(max(1, len(words) - size))  # a random passage (RULER: always the start)
        sents = split_sentences(" ".join(words[start:start + size]))
        used = list(depths) if depths is not None else rng.sample(DEPTHS, len(needles))
        if len(used) != len(needles):
            raise ValueError(f"{len(needles)} needles but {len(used)} depths")
        context = insert_at_depths(sents, needles, used)
        meta = {"depths": sorted(used)}
    elif haystack in ("noise", "needle"):
        if haystack == "noise":
            sents = [NOISE] * size
        else:
            sents = [NEEDLE.format(type_needle_v=value, key=g.draw(key), value=g.draw(value)) for _ in range(size)]
        if depths is not None:
            idx = sorted((min(size, int(size * d / 100)) for d in depths), reverse=True)
        else:
            idx = sorted(rng.sample(range(size), len(needles)), reverse=True)
        for i, needle in zip(idx, needles, strict=True):
            sents.insert(i, needle)
        context = "\n".join(sents)
        meta = {"positions": sorted(idx)}
    else:
        raise ValueError(f"unknown haystack {haystack!r}")
    picked = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in picked]
    answers = [a for i in picked for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, prefix, kind = NIAH_TEMPLATE, NIAH_PREFIX, value
    if num_q * num_v == 1:  # RULER's singular rewrite, applied to template + answer prefix
        def single(t: str) -> str:
            return (t.replace("Some", "A").replace("are all", "is").replace("are", "is")
                    .replace("answers", "answer"))
        template, prefix, kind = single(template), single(prefix), value[:-1]
    return (template.format(type_needle_v=kind, context=context, query=query),
            prefix.format(type_needle_v=kind, query=query), answers, meta)


def _vt_chain(rng: random.Random, num_hops: int, letters: int, value: str) -> tuple[list[str], list[str]]:
    names: list[str] = []
    while len(names) < num_hops + 1:
        n = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if n not in names:
            names.append(n)
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(num_hops)]
    return names, chain


def _vt_text(rng: random.Random, noises: int, chains: list[list[str]]) -> str:
    sents = [NOISE] * noises
    for chain in chains:
        pos = sorted(rng.sample(range(len(sents)), len(chain)))
        for j, (p, item) in enumerate(zip(pos, chain, strict=True)):
            sents.insert(p + j, item)
    return "\n".join(sents).replace(". \n", ".\n")


def vt(rng: random.Random, size: int, *, num_chains: int, num_hops: int) -> tuple[str, str, list[str], dict]:
    """Variable tracking over a noise haystack of `size` sentences, with one in-context example (RULER
    builds it at ~500 tokens with 3-letter names; ours has 15 noise sentences, ~450 tokens)."""
    icl_names, icl_chain = _vt_chain(rng, num_hops, 3, str(rng.randint(10000, 99999)))
    icl_value = icl_chain[0].split("=")[-1].strip()
    icl = (VT_TEMPLATE.format(context=_vt_text(rng, 15, [icl_chain]), query=icl_value)
           + VT_PREFIX.format(num_v=num_hops + 1, query=icl_value) + " " + " ".join(icl_names) + "\n")
    chains, names0 = [], None
    for c in range(num_chains):
        names, chain = _vt_chain(rng, num_hops, 5, str(rng.randint(10000, 99999)))
        chains.append(chain)
        names0 = names if c == 0 else names0
    value = chains[0][0].split("=")[-1].strip()
    text = VT_TEMPLATE.format(context=_vt_text(rng, size, chains), query=value)
    return icl + "\n" + text, VT_PREFIX.format(num_v=num_hops + 1, query=value), list(names0), {}


def _cwe_words() -> list[str]:
    w = data.word_lists()
    return sorted(set(w["nouns"]) | set(w["adjectives"]) | set(w["verbs"]))


def _cwe_example(rng: random.Random, words: list[str], num_words: int, common_repeats: int,
                 uncommon_repeats: int, num_cw: int) -> tuple[str, list[str]]:
    if num_words > len(words):
        raise ValueError(f"common-words extraction needs {num_words} distinct words; the word lists hold "
                         f"{len(words)}")
    chosen = rng.sample(words, num_words)
    common, uncommon = chosen[:num_cw], chosen[num_cw:]
    listed = common * common_repeats + uncommon * uncommon_repeats
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common


def cwe(rng: random.Random, size: int, *, freq_cw: int, freq_ucw: int, num_cw: int,
        max_len: int = 4096) -> tuple[str, str, list[str], dict]:
    """Common-words extraction over `size` distinct words, with one in-context example. Below 4K tokens
    RULER uses repeats 6/1 (example: 20 words, 3/1); from 4K, freq_cw/freq_ucw (example: 40 words, 10/3)."""
    words = _cwe_words()
    rng.shuffle(words)
    if max_len < 4096:
        ex = _cwe_example(rng, words, 20, 3, 1, num_cw)
        context, answer = _cwe_example(rng, words, size, 6, 1, num_cw)
    else:
        ex = _cwe_example(rng, words, 40, 10, 3, num_cw)
        context, answer = _cwe_example(rng, words, size, freq_cw, freq_ucw, num_cw)
    shot = (CWE_TEMPLATE.format(context=ex[0]) + CWE_PREFIX + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex[1])))
    return shot + "\n" + CWE_TEMPLATE.format(context=context), CWE_PREFIX, answer, {}


def _zeta(alpha: float, n: int = 1000) -> float:
    """Riemann zeta(alpha), alpha > 1: partial sum plus the Euler-Maclaurin tail (error << 1e-9)."""
    head = math.fsum(k ** -alpha for k in range(1, n + 1))
    return head + n ** (1 - alpha) / (alpha - 1) - 0.5 * n ** -alpha + alpha * n ** (-alpha - 1) / 12


def fwe(rng: random.Random, size: int, *, alpha: float, max_len: int = 4096,
        coded_wordlen: int = 6) -> tuple[str, str, list[str], dict]:
    """Frequent-words extraction: `size` coded words drawn with Zipf(alpha) counts from a vocabulary of
    max_len // 50 random words; the most frequent is '...' (noise), the answer is ranks 2-4."""
    vocab_size = max(10, (max_len - TOKENS_TO_GENERATE["fwe"]) // 50)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)))
    ordered = sorted(vocab)
    rng.shuffle(ordered)
    ordered[0] = "..."
    z = _zeta(alpha)
    listed = [w for k, w in enumerate(ordered, start=1) for _ in range(int(size * k ** -alpha / z))]
    rng.shuffle(listed)
    return FWE_TEMPLATE.format(context=" ".join(listed)), FWE_PREFIX, ordered[1:4], {}


_GENERATORS: dict[str, Callable[..., tuple[str, str, list[str], dict]]] = {
    "niah": niah, "vt": vt, "cwe": cwe, "fwe": fwe}
_MIN_SIZE = {"essay": 50, "noise": 5, "needle": 5, "vt": 5, "cwe": 20, "fwe": 50}


def _unit(task: str) -> str:
    kind, args = TASKS[task]
    return args["haystack"] if kind == "niah" else kind


def make_sample(task: str, size: int, max_len: int, index: int, seed: int = 0, max_new_tokens: int | None = None,
                **overrides: Any) -> Sample:
    """One sample of `task` with haystack size `size` (deterministic in task, max_len, index, seed)."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {sorted(TASKS)}")
    kind, args = TASKS[task]
    args = {**args, **overrides}
    if kind in ("cwe", "fwe"):
        args["max_len"] = max_len
    rng = random.Random(f"{task}|{max_len}|{index}|{seed}")
    text, prefix, answers, meta = _GENERATORS[kind](rng, size, **args)
    return Sample(task=task, input=text, answer_prefix=prefix, outputs=tuple(answers),
                  max_new_tokens=max_new_tokens or TOKENS_TO_GENERATE[kind], meta={"size": size, **meta})


def fit_size(task: str, max_len: int, count_tokens: Callable[[Sample], int], index: int = 0, seed: int = 0,
             max_new_tokens: int | None = None, **overrides: Any) -> int:
    """The largest haystack size whose sample fits count_tokens(sample) + max_new_tokens <= max_len
    (binary search; RULER does the same). Raises ValueError if even the smallest size does not fit."""
    lo = _MIN_SIZE[_unit(task)]
    gen = TOKENS_TO_GENERATE[TASKS[task][0]] if max_new_tokens is None else max_new_tokens

    def fits(n: int) -> bool:
        try:
            s = make_sample(task, n, max_len, index, seed, gen, **overrides)
        except ValueError:
            return False
        return count_tokens(s) + gen <= max_len

    if not fits(lo):
        raise ValueError(f"{task}: even the smallest haystack ({lo}) does not fit in {max_len} tokens")
    hi = lo
    while fits(hi * 2):
        hi *= 2
        if hi > 10 ** 7:
            raise ValueError(f"{task}: the token counter never reaches {max_len}")
    lo, hi = hi, hi * 2  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def generate_samples(task: str, max_len: int, num_samples: int, count_tokens: Callable[[Sample], int],
                     seed: int = 0, max_new_tokens: int | None = None, **overrides: Any) -> list[Sample]:
    """`num_samples` samples of `task` that fit `max_len` tokens (haystack size fitted on sample 0, then
    shrunk per sample if a draw runs long, as RULER does)."""
    size = fit_size(task, max_len, count_tokens, 0, seed, max_new_tokens, **overrides)
    gen = max_new_tokens or TOKENS_TO_GENERATE[TASKS[task][0]]
    out = []
    for i in range(num_samples):
        n = size
        while True:
            s = make_sample(task, n, max_len, i, seed, gen, **overrides)
            if count_tokens(s) + gen <= max_len or n <= _MIN_SIZE[_unit(task)]:
                break
            n = max(_MIN_SIZE[_unit(task)], int(n * 0.97))
        out.append(s)
    return out
