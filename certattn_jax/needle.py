"""Needle-in-a-haystack prompts for the demo and `scripts/needle_study.py`, and the found/missed check.

A prompt is a long filler document (the haystack) with one key-value fact (the needle) inserted at a relative
depth, a question about that key, and optionally an answer prefix ("priming") that opens the assistant's turn,
e.g. "The special magic number for quiet-harbor is", so that the model's next tokens are the value itself.
Everything is generated from a seed (Python's `random.Random`), so a (format, length, seed) triple is one
reproducible prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# RULER's noise haystack (Hsieh et al. 2024, "niah_single_1"): one sentence group repeated.
_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_NAMES = ["Arden", "Brisk", "Calder", "Dunmore", "Elwood", "Farrow", "Glenby", "Harlow", "Ivel", "Jasper",
          "Kestrel", "Lomond", "Marsh", "Norwick", "Oakham", "Pryor", "Quill", "Rowan", "Selby", "Thorne"]
_SUFFIXES = ["Vale", "Ford", "Hill", "Port", "Cross"]
_KEY_ADJ = ["quiet", "amber", "hollow", "brisk", "silver", "crooked", "gentle", "rusty", "velvet", "frosty",
            "lucky", "narrow", "sunny", "wild", "proud", "tidy"]
_KEY_NOUN = ["harbor", "lantern", "meadow", "otter", "falcon", "compass", "orchard", "kettle", "ribbon", "anchor",
             "pebble", "thimble", "walrus", "quarry", "saddle", "beacon"]
_PROSE = ["The road to {town} follows the river past old mills and quiet farms.",
          "In {town} the market opens early and the bakers sell bread before sunrise.",
          "Travellers often say that {town} is windy in spring and calm in autumn.",
          "The library of {town} keeps maps of the valley drawn by hand long ago.",
          "Most families in {town} keep a small garden with beans, onions and roses.",
          "A stone bridge crosses the stream on the eastern edge of {town}.",
          "The school in {town} teaches music, history and the names of the stars.",
          "Fishermen from {town} mend their nets on the pier every evening."]


@dataclass(frozen=True)
class NeedleFormat:
    """How a needle prompt is written.

    haystack: "towns" (facts with numbers: "The town of X has 12 bridges and 345 houses."), "prose" (varied
    sentences without digits) or "noise" (RULER's repeated sentence group). needle / question / prime are
    templates over {key} and {value}; an empty prime means the assistant's turn starts empty. value: "number"
    (a 7-digit number) or "word" (an adjective-noun-number password like "amber-falcon-15", the old demo's).
    """

    name: str
    haystack: str
    needle: str
    question: str
    prime: str = ""
    value: str = "number"


FORMATS: dict[str, NeedleFormat] = {f.name: f for f in [
    # The demo's original format (issue 10: dense misses it at ~1.5K tokens).
    NeedleFormat("password-towns", "towns", "Remember this: the secret password is {value}.",
                 "What is the secret password mentioned in the document above? Answer with the password only.",
                 value="word"),
    NeedleFormat("password-towns-primed", "towns", "Remember this: the secret password is {value}.",
                 "What is the secret password mentioned in the document above? Answer with the password only.",
                 prime="The secret password is", value="word"),
    # RULER-style key-value needles.
    NeedleFormat("magic-towns-primed", "towns", "The special magic number for {key} is {value}.",
                 "What is the special magic number for {key} mentioned in the document above?",
                 prime="The special magic number for {key} is"),
    NeedleFormat("magic-prose", "prose", "The special magic number for {key} is {value}.",
                 "What is the special magic number for {key} mentioned in the document above?"),
    NeedleFormat("magic-prose-primed", "prose", "The special magic number for {key} is {value}.",
                 "What is the special magic number for {key} mentioned in the document above?",
                 prime="The special magic number for {key} is"),
    NeedleFormat("magic-noise-primed", "noise", "The special magic number for {key} is {value}.",
                 "What is the special magic number for {key} mentioned in the document above?",
                 prime="The special magic number for {key} is"),
]}


@dataclass(frozen=True)
class NeedlePrompt:
    """One generated prompt: `ids` is the full token sequence (chat template + prime); `value` is what the
    answer must contain; `doc_tokens` the haystack's length with the needle; depth the needle's position."""

    ids: list[int]
    value: str
    key: str
    depth: float
    doc_tokens: int
    fmt: NeedleFormat


def _sentence(haystack: str, rng: random.Random) -> str:
    town = f"{rng.choice(_NAMES)} {rng.choice(_SUFFIXES)}"
    if haystack == "towns":
        return f"The town of {town} has {rng.randint(2, 90)} bridges and {rng.randint(100, 9999)} houses."
    if haystack == "prose":
        return rng.choice(_PROSE).format(town=town)
    if haystack == "noise":
        return _NOISE
    raise ValueError(f"unknown haystack {haystack!r}; expected 'towns', 'prose' or 'noise'")


def build_needle_prompt(tokenizer, fmt: NeedleFormat | str, doc_tokens: int, seed: int = 0,
                        depth: float = 0.5) -> NeedlePrompt:
    """A chat prompt of about `doc_tokens` document tokens with the needle at relative `depth` (0 = first
    sentence, 1 = last), the question after the document, and fmt.prime opening the assistant's turn."""
    if isinstance(fmt, str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown needle format {fmt!r}; known: {', '.join(FORMATS)}")
        fmt = FORMATS[fmt]
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth must be in [0, 1], got {depth}")
    if doc_tokens < 1:
        raise ValueError(f"doc_tokens must be >= 1, got {doc_tokens}")
    if tokenizer is None or not tokenizer.chat_template:
        raise ValueError("needle prompts need a tokenizer with a chat template")
    rng = random.Random(seed)
    key = f"{rng.choice(_KEY_ADJ)}-{rng.choice(_KEY_NOUN)}"
    if fmt.value == "number":
        value = str(rng.randint(1_000_000, 9_999_999))
    elif fmt.value == "word":
        value = f"{rng.choice(['amber', 'cobalt', 'scarlet', 'violet'])}-{rng.choice(['falcon', 'otter', 'heron'])}" \
                f"-{rng.randint(10, 99)}"
    else:
        raise ValueError(f"unknown needle value kind {fmt.value!r}; expected 'number' or 'word'")
    needle = fmt.needle.format(key=key, value=value)
    # Grow the filler by sentences (token counts are additive enough across sentence boundaries).
    filler: list[str] = []
    n = len(tokenizer.encode(needle))
    while n < doc_tokens:
        s = _sentence(fmt.haystack, rng)
        filler.append(s)
        n += len(tokenizer.encode(" " + s))
    filler.insert(round(depth * len(filler)), needle)
    document = " ".join(filler)
    user = ("Read the document and answer the question.\n\n" + document + "\n\n"
            + fmt.question.format(key=key, value=value))
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
    text += fmt.prime.format(key=key, value=value)
    return NeedlePrompt(ids=tokenizer.encode(text), value=value, key=key, depth=depth,
                        doc_tokens=len(tokenizer.encode(document)), fmt=fmt)


def contains_needle(answer: str, value: str) -> bool:
    """Whether the generated answer contains the needle's value verbatim, ignoring case ("Amber-otter-31"
    counts for amber-otter-31; "7,341,826" does not count for 7341826)."""
    return value.lower() in answer.lower()
