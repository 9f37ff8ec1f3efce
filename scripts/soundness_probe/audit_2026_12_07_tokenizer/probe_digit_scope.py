"""Scope of the known Digits divergence (ours/SmolLM2 tokenizer.json vs transformers' GGUF tokenizer):
which (prefix, numeric char) pairs tokenize differently.  usage: .venv/bin/python .../probe_digit_scope.py"""
import json
import unicodedata
from pathlib import Path

from _load import hf_tok, ours_from_gguf

ours, hf = ours_from_gguf(), hf_tok()
numerics = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF and chr(c).isnumeric()]
res = {}
for prefix in [" ", "a ", "  ", "\n", "\t", "x\n", "\r\n"]:
    bad = [ch for ch in numerics if ours.encode(prefix + ch) != hf.encode(prefix + ch, add_special_tokens=False)]
    res[repr(prefix)] = {"numeric_chars": len(numerics), "mismatch": len(bad),
                         "ascii_digits_mismatch": [c for c in bad if c in "0123456789"],
                         "examples": [f"U+{ord(c):04X} {unicodedata.name(c, '?')}" for c in bad[:8]]}
    print(repr(prefix), res[repr(prefix)]["mismatch"], "/", len(numerics), res[repr(prefix)]["ascii_digits_mismatch"], res[repr(prefix)]["examples"][:4])
Path(__file__).with_name("digit_scope_results.json").write_text(json.dumps(res, indent=1, ensure_ascii=False))
