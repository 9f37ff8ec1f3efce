import time

from _load import *

t=time.time(); ours=ours_from_gguf(); print("ours gguf", time.time()-t)
t=time.time(); ck=ours_from_ckpt(); print("ours ckpt", time.time()-t)
t=time.time(); hf=hf_tok(); print("hf", time.time()-t, type(hf))
print("ours bos", ours.bos_token, ours.bos_token_id, ours.eos_tokens, ours.add_bos_token, ours.vocab_size)
print("hf bos", hf.bos_token, hf.bos_token_id, hf.eos_token, hf.eos_token_id, hf.pad_token, hf.unk_token, len(hf))
print("hf special map", hf.special_tokens_map)
print("hf clean_up", getattr(hf, "clean_up_tokenization_spaces", None), "add_bos", getattr(hf,"add_bos_token",None), "add_eos", getattr(hf,"add_eos_token",None))
import json

bj = json.loads(hf.backend_tokenizer.to_str())
print("hf normalizer", bj["normalizer"]); print("hf pre", bj["pre_tokenizer"]); print("hf post", bj["post_processor"]); print("hf decoder", bj["decoder"])
print("hf model keys", {k:v for k,v in bj["model"].items() if k not in ("vocab","merges")})
print("hf added", [(a["id"],a["content"],a["special"],a["normalized"],a["lstrip"],a["rstrip"]) for a in bj["added_tokens"]])
oj = json.loads(ours.backend.to_str())
print("ours normalizer", oj["normalizer"]); print("ours pre", oj["pre_tokenizer"]); print("ours post", oj["post_processor"]); print("ours decoder", oj["decoder"])
print("ours model keys", {k:v for k,v in oj["model"].items() if k not in ("vocab","merges")})
print("ours added", [(a["id"],a["content"],a["special"],a["normalized"],a["lstrip"],a["rstrip"]) for a in oj["added_tokens"]])
cj = json.loads(ck.backend.to_str())
print("ckpt==gguf json", cj == oj)
print("vocab eq", bj["model"]["vocab"] == oj["model"]["vocab"], "merges eq", [tuple(m) if isinstance(m,list) else tuple(m.split(" ")) for m in bj["model"]["merges"]] == [tuple(m) if isinstance(m,list) else tuple(m.split(" ")) for m in oj["model"]["merges"]])
print("hf chat template == ours", hf.chat_template == ours.chat_template)
print(repr(hf.chat_template))
