"""Extra edge repros (each prints ours vs HF).  usage: .venv/bin/python .../probe_edge_extra.py"""
import json
from pathlib import Path

from _load import hf_tok, ours_from_gguf

from models.tokenizer import Tokenizer

ours, hf = ours_from_gguf(), hf_tok()
out = {}


def safe(f):
    try:
        return f()
    except BaseException as e:  # noqa: BLE001
        return f"RAISES {type(e).__name__}: {str(e)[:200]}"


def show(name, a, b):
    out[name] = {"ours": a, "hf": b, "same": a == b}
    print(("SAME " if a == b else "DIFF ") + name, "\n   ours:", repr(a)[:300], "\n   hf:  ", repr(b)[:300])


# 1. lone surrogate from ordinary JSON data (a truncated emoji escape)
s = json.loads('"broken emoji \\ud83d here"')
show("encode lone surrogate from json.loads", safe(lambda: ours.encode(s)), safe(lambda: hf.encode(s, add_special_tokens=False)))
# 2. decode of non-int ids
show("decode [1.5]", safe(lambda: ours.decode([1.5])), safe(lambda: hf.decode([1.5])))
show("decode ['42']", safe(lambda: ours.decode(["42"])), safe(lambda: hf.decode(["42"])))
show("decode out-of-vocab [42, 49152, 43]", safe(lambda: ours.decode([42, 49152, 43])), safe(lambda: hf.decode([42, 49152, 43])))
# 3. OpenAI-style assistant tool-call message (content=None) with a generic `{{ message['content'] }}` template
tmpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
gen = Tokenizer(ours.backend, bos_token=ours.bos_token, eos_tokens=ours.eos_tokens, chat_template=tmpl)
msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "w"}}]}]
show("generic template content=None", safe(lambda: gen.apply_chat_template(msgs, add_generation_prompt=False)),
     safe(lambda: hf.apply_chat_template(msgs, chat_template=tmpl, tokenize=False)))
# 4. generic template testing `tools is none` / using pad/unk tokens
tmpl2 = "{% if tools is not none %}[TOOLS]{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}{{ pad_token }}"
gen2 = Tokenizer(ours.backend, bos_token=ours.bos_token, eos_tokens=ours.eos_tokens, chat_template=tmpl2)
u = [{"role": "user", "content": "hi"}]
show("generic template `tools is not none` + pad_token", safe(lambda: gen2.apply_chat_template(u, add_generation_prompt=False)),
     safe(lambda: hf.apply_chat_template(u, chat_template=tmpl2, tokenize=False)))
# 5. SmolLM2 template, swallowed HF keyword arguments
show("continue_final_message=True", safe(lambda: ours.apply_chat_template(u + [{"role": "assistant", "content": "Sure,"}],
                                                                            add_generation_prompt=False, continue_final_message=True)),
     safe(lambda: hf.apply_chat_template(u + [{"role": "assistant", "content": "Sure,"}], continue_final_message=True, tokenize=False)))
show("apply_chat_template(msgs) defaults", safe(lambda: ours.apply_chat_template(u)), safe(lambda: hf.apply_chat_template(u, tokenize=False)))
show("empty conversation", safe(lambda: ours.apply_chat_template([])), safe(lambda: hf.apply_chat_template([], tokenize=False, add_generation_prompt=True)))
Path(__file__).with_name("edge_extra_results.json").write_text(json.dumps(out, indent=1, ensure_ascii=False, default=str))
