"""Sanity: the tokenizer that `load_pretrained("smollm2")` returns is the one probed (same tokenizer.json, special
tokens, template).  usage: .venv/bin/python .../probe_entrypoint.py"""
import json

from _load import ours_from_gguf

from models import load_pretrained

m = load_pretrained("smollm2")
t, g = m.tokenizer, ours_from_gguf()
print("backend json equal:", json.loads(t.backend.to_str()) == json.loads(g.backend.to_str()))
print("bos/eos/add_bos/template equal:", (t.bos_token, t.eos_tokens, t.add_bos_token, t.chat_template) ==
      (g.bos_token, g.eos_tokens, g.add_bos_token, g.chat_template))
print("config eos ids", m.config.eos_token_ids, "tokenizer eos ids", t.eos_token_ids, "vocab", m.config.vocab_size, t.vocab_size)
