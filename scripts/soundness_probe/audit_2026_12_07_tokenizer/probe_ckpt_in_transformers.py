"""Tokenizer.save claims the checkpoint's tokenizer files are readable by transformers: load the cached
checkpoint dir with AutoTokenizer and compare with ours on the whole corpus + fuzz (ids, decode, chat).

usage: .venv/bin/python scripts/soundness_probe/audit_2026_12_07_tokenizer/probe_ckpt_in_transformers.py"""
import json
from collections import Counter
from pathlib import Path

import transformers
from _load import ours_from_ckpt
from corpus import CASES, fuzz

from models import pretrained as pre

HERE = Path(__file__).resolve().parent
ours = ours_from_ckpt()
d = pre.cache_dir() / "models" / "smollm2-135m-instruct"
hf = transformers.AutoTokenizer.from_pretrained(str(d))
print(type(hf).__name__, "bos", hf.bos_token, "eos", hf.eos_token, "clean_up", hf.clean_up_tokenization_spaces)
c, ex = Counter(), []
for x in [t for _, t in CASES] + fuzz():
    o, h = ours.encode(x), hf.encode(x, add_special_tokens=False)
    hd = hf.encode(x)
    c["n"] += 1
    if o != h: c["ids"] += 1; ex.append(("ids", x, o, h))
    if o != hd: c["ids_default_add_special"] += 1; ex.append(("ids_default", x, o, hd))
    for skip in (False, True):
        if ours.decode(o, skip_special_tokens=skip) != hf.decode(o, skip_special_tokens=skip):
            c["decode"] += 1; ex.append(("decode", x, ours.decode(o, skip_special_tokens=skip), hf.decode(o, skip_special_tokens=skip)))
    m = [{"role": "user", "content": x}]
    if ours.apply_chat_template(m, add_generation_prompt=True) != hf.apply_chat_template(m, tokenize=False, add_generation_prompt=True):
        c["chat"] += 1
print(dict(c)); print(ex[:5])
(HERE / "ckpt_in_transformers_results.json").write_text(json.dumps({"counts": c, "examples": ex[:50]}, ensure_ascii=False, indent=1))
