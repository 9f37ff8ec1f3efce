"""Encode / decode / round-trip / per-token / prefix-decode parity: ours (models.tokenizer.Tokenizer from the
SmolLM2 GGUF, and from the cached checkpoint dir) vs transformers' AutoTokenizer on the same GGUF, plus a
"canonical" reference = transformers' backend with SmolLM2's Digits(individual_digits) pre-tokenizer put back.

usage: .venv/bin/python scripts/soundness_probe/audit_2026_12_07_tokenizer/probe_encode_decode.py
writes encode_decode_results.json next to this file."""
import json
import time
from collections import Counter, defaultdict
from pathlib import Path

from _load import hf_tok, ours_from_ckpt, ours_from_gguf
from corpus import CASES, fuzz

HERE = Path(__file__).resolve().parent
t0 = time.time()
ours, ck, hf = ours_from_gguf(), ours_from_ckpt(), hf_tok()
import tokenizers
from tokenizers import pre_tokenizers

canon = tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str())
canon.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False)])
print(f"loaded in {time.time()-t0:.1f}s", flush=True)


def safe(f, *a, **k):
    try:
        return f(*a, **k)
    except BaseException as e:  # noqa: BLE001 (record everything, incl. pyo3 panics)
        return ("__ERR__", f"{type(e).__name__}: {str(e)[:300]}")


def is_err(v):
    return isinstance(v, tuple) and len(v) == 2 and v[0] == "__ERR__"


def enc_pair(x):
    return safe(ours.encode, x), safe(hf.encode, x, add_special_tokens=False)


def shrink(x, pred, budget=4000):
    """Greedy delta-debugging: drop chunks/characters while pred(x) stays true."""
    calls = 0
    n = 2
    while len(x) >= 2 and calls < budget:
        chunk = max(1, len(x) // n)
        reduced = False
        for i in range(0, len(x), chunk):
            y = x[:i] + x[i + chunk:]
            calls += 1
            if y != x and pred(y):
                x, reduced = y, True
                n = max(n - 1, 2)
                break
        if not reduced:
            if chunk == 1:
                break
            n = min(len(x), n * 2)
    return x


records = []  # every disagreement
counts = Counter()
per_cat = defaultdict(Counter)
texts = [(c, t) for c, t in CASES] + [("fuzz", t) for t in fuzz()]

for cat, x in texts:
    counts["texts"] += 1
    per_cat[cat]["texts"] += 1
    o = safe(ours.encode, x)
    ob = safe(ours.encode, x, add_bos=True)
    oc = safe(ck.encode, x)
    h = safe(hf.encode, x, add_special_tokens=False)
    hs = safe(hf.encode, x)  # add_special_tokens=True (HF default)
    hcall = safe(lambda s: hf(s)["input_ids"], x)
    cn = safe(lambda s: canon.encode(s, add_special_tokens=False).ids, x)

    def rec(kind, **kw):
        counts[kind] += 1
        per_cat[cat][kind] += 1
        records.append({"kind": kind, "category": cat, "text": x, **kw})

    if is_err(o) or is_err(h):
        if o != h or is_err(o):
            rec("encode_error", ours=o if is_err(o) else "ok", hf=h if is_err(h) else "ok")
        continue
    if oc != o:
        rec("ckpt_vs_gguf_encode", ckpt=oc, gguf=o)
    if ob != ([ours.bos_token_id] + o):
        rec("add_bos_unexpected", ours=ob)
    if hs != h or hcall != h:
        rec("hf_internal_add_special_tokens", hf_nospecial=h, hf_default=hs, hf_call=hcall)
    if o != h:
        kind = "encode_mismatch_digits_only" if o == cn else "encode_mismatch_OTHER"
        mini = shrink(x, lambda y: (lambda a, b: not is_err(a) and not is_err(b) and a != b)(*enc_pair(y)), 2000) \
            if len(x) < 3000 else None
        rec(kind, ours=o if len(o) < 60 else f"{len(o)} ids", hf=h if len(h) < 60 else f"{len(h)} ids",
            minimal=mini, minimal_ours=safe(ours.encode, mini) if mini is not None else None,
            minimal_hf=safe(hf.encode, mini, add_special_tokens=False) if mini is not None else None)
    if o != cn:
        rec("ours_vs_canonical_encode", ours=o, canonical=cn)
    # ---- decode of the same ids (ours' ids and HF's ids) ----
    for tag, ids in (("ours_ids", o), ("hf_ids", h)):
        for skip in (False, True):
            do = safe(ours.decode, ids, skip_special_tokens=skip)
            dh = safe(hf.decode, ids, skip_special_tokens=skip)
            if do != dh:
                rec("decode_mismatch", ids_from=tag, skip=skip, ours=do, hf=dh)
            dc = safe(ck.decode, ids, skip_special_tokens=skip)
            if dc != do:
                rec("ckpt_vs_gguf_decode", ids_from=tag, skip=skip, ckpt=dc, gguf=do)
    # ---- round trip ----
    rt_o, rt_h = ours.decode(o), hf.decode(h)
    if rt_o != x:
        rec("roundtrip_ours_not_identity", decoded=rt_o)
    if rt_h != x:
        counts["roundtrip_hf_not_identity"] += 1
    if rt_o != rt_h:
        rec("roundtrip_ours_vs_hf", ours=rt_o, hf=rt_h)
    # ---- per-token and prefix ("streaming") decode on ours' ids ----
    ids = o[:300]
    pt_o = [ours.decode([i]) for i in ids]
    pt_h = [hf.decode([i]) for i in ids]
    if pt_o != pt_h:
        rec("per_token_decode_mismatch", diffs=[(i, a, b) for i, a, b in zip(ids, pt_o, pt_h) if a != b][:10])
    tok_o = [ours.id_to_token(i) for i in ids]
    tok_h = hf.convert_ids_to_tokens(ids)
    if tok_o != tok_h:
        rec("id_to_token_mismatch", ours=tok_o[:20], hf=tok_h[:20])
    step = 1 if len(ids) <= 120 else 7
    for k in range(0, len(ids) + 1, step):
        a, b = ours.decode(ids[:k]), hf.decode(ids[:k])
        if a != b:
            rec("prefix_decode_mismatch", k=k, ours=a, hf=b)
            break
    # concatenated per-token decode vs whole decode (what a naive streamer prints) -- informational, same for HF
    if "".join(pt_o) != rt_o:
        counts["info_naive_stream_differs_from_full_decode"] += 1
        if "".join(pt_h) == rt_h:
            rec("naive_stream_ours_differs_but_hf_not")

print(f"texts done in {time.time()-t0:.1f}s", flush=True)

# ---- whole-vocabulary single-id decode and id_to_token ----
V = ours.vocab_size
vocab_diffs = []
for i in range(V):
    for skip in (False, True):
        a, b = ours.decode([i], skip_special_tokens=skip), hf.decode([i], skip_special_tokens=skip)
        if a != b:
            vocab_diffs.append((i, skip, a, b))
    if ours.id_to_token(i) != hf.convert_ids_to_tokens(i):
        vocab_diffs.append((i, "tok", ours.id_to_token(i), hf.convert_ids_to_tokens(i)))
counts["vocab_single_id_checked"] = V
counts["vocab_single_id_mismatch"] = len(vocab_diffs)
print(f"vocab done in {time.time()-t0:.1f}s", flush=True)

# ---- random id sequences (incl. special ids, byte tokens splitting UTF-8) decode ----
import random

rng = random.Random(7)
byte_ids = [i for i in range(V) if len(ours.id_to_token(i)) == 1]  # single byte-level symbols
seq_diffs = []
for n in range(5000):
    pool = rng.choice([range(V), byte_ids, list(range(17)) + byte_ids])
    ids = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
    for skip in (False, True):
        a, b = ours.decode(ids, skip_special_tokens=skip), hf.decode(ids, skip_special_tokens=skip)
        if a != b:
            seq_diffs.append((ids, skip, a, b))
counts["random_id_seqs_checked"] = 5000
counts["random_id_seqs_mismatch"] = len(seq_diffs)

# ---- odd decode inputs (error behaviour) ----
import numpy as np

odd = {"out_of_range_49152": [49152], "negative": [-1], "huge": [2**40], "empty": [], "np_int64": np.array([1, 42, 2]),
       "np_2d": np.array([[1, 42]]), "float": [1.0, 42.0], "float_frac": [1.5], "bool": [True], "str_ids": ["42"], "none": None}
odd_res = {}
for name, v in odd.items():
    a, b = safe(ours.decode, v), safe(hf.decode, v)
    odd_res[name] = {"ours": a, "hf": b, "same": a == b}
odd_enc = {"lone_surrogate": "\ud800", "lone_low_surrogate": "a\udc00b", "bytes": b"abc", "none": None, "int": 5,
           "list_of_str": ["hello", "world"], "tuple_pair": ("hello", "world")}
odd_enc_res = {}
for name, v in odd_enc.items():
    a, b = safe(ours.encode, v), safe(hf.encode, v, add_special_tokens=False)
    odd_enc_res[name] = {"ours": a, "hf": b, "same": a == b}

out = {"counts": dict(counts), "per_category": {k: dict(v) for k, v in per_cat.items()}, "records": records,
       "vocab_diffs": vocab_diffs[:200], "seq_diffs": seq_diffs[:200], "odd_decode": odd_res, "odd_encode": odd_enc_res,
       "seconds": time.time() - t0}
(HERE / "encode_decode_results.json").write_text(json.dumps(out, indent=1, ensure_ascii=False, default=str))
print(json.dumps(out["counts"], indent=1))
print("odd_decode", json.dumps(odd_res, default=str, ensure_ascii=False, indent=0)[:3000])
print("odd_encode", json.dumps(odd_enc_res, default=str, ensure_ascii=False, indent=0)[:3000])
