"""Consistency of `generate --json` outputs (dense / naive / certified) and of the --certificates file."""
import json

out = {}
for mode in ("dense", "naive", "cert"):
    lines = [l for l in open(f"out/ok_json_{mode}.txt") if l.startswith("{")]
    out[mode] = json.loads(lines[-1])
    r = out[mode]
    print(mode, len(r["token_ids"]), repr(r["text"]), r["prompt_tokens"])
d, c = out["dense"], out["cert"]
print("certified == dense tokens:", d["token_ids"] == c["token_ids"], "naive == dense:", out["naive"]["token_ids"] == d["token_ids"])
s = c["certificate_summary"]
rows = [json.loads(l) for l in open("/tmp/cli_audit/certs24.jsonl")]
steps = max(r["step"] for r in rows)
layers = len({r["layer"] for r in rows})
heads = len(rows[0]["rung"])
print("summary:", s)
print(f"file: {len(rows)} rows, {steps} steps x {layers} layers x {heads} heads = {steps * layers * heads}")
hist = [0] * 5
for r in rows:
    for g in r["rung"]:
        if g >= 0:
            hist[g] += 1
print("file rung histogram", hist, "summary", list(s["rung_histogram"].values()))
print("heads==steps*layers*heads:", s["heads"] == steps * layers * heads, "hist sums:", sum(s["rung_histogram"].values()) + s["stopped"] == s["heads"])
nt = len(c["token_ids"])
print("new tokens", nt, "decode steps recorded", steps, "(EOS in token_ids?", 2 in c["token_ids"], ")")
cert_flags = sum(sum(r["certified"]) for r in rows)
print("fraction_certified from file", cert_flags / (len(rows) * heads), "summary", s["fraction_certified"])
print("max bound file", max(max(r["error_bound"]) for r in rows), "summary", s["max_error_bound"])
viol = sum(1 for r in rows for b, t, ok in zip(r["error_bound"], r["tolerance"], r["certified"]) if ok and b > t)
print("certified heads with bound > tolerance:", viol)
