"""Table of results.jsonl (last record per case) as Markdown: python summarize.py > table.md"""
import json
from pathlib import Path

recs = {}
for line in (Path(__file__).parent / "results.jsonl").read_text().splitlines():
    r = json.loads(line)
    recs[r["case"]] = r


def f(x):
    return "-" if x is None else f"{x:.1e}"


print("| case | supported | fwd rel | dense prefill rel | dense max step rel | dense greedy = HF | cert prefill rel "
      "| cert max step rel | cert greedy = HF | cert (teacher-forced): certified, rungs | lockstep: err>bound, "
      "max err/bound, rungs | len > max_pos |")
print("|" + "---|" * 12)
for name, r in recs.items():
    if not r.get("supported", False):
        print(f"| {name} | no: {r.get('load_error', r.get('probe_error', ''))[:110]} |" + " |" * 10)
        continue
    d, c = r.get("dense", {}), r.get("certified", {})
    def side(x):
        if x.get("teacher_forced_error"):
            return ("err", "err")
        return f(x.get("prefill_rel")), f(max(x.get("step_rel") or [float("nan")]))
    dp, ds = side(d)
    cp, cs = side(c)
    cert = c.get("tf_cert")
    cert_s = (f"{cert['fraction_certified']:.2f}, {dict((k, v) for k, v in cert['rung_histogram'].items() if v)}"
              if cert else (c.get("teacher_forced_error") or "-")[:70])
    ls = r.get("lockstep")
    ls_s = (f"{ls['bound_violations']}, {ls['worst_err_over_bound']:.3f}, {ls['rung_hist']}" if ls
            else (r.get("lockstep_error") or "-")[:70])
    ge = lambda x: x.get("gen_equal_hf", (x.get("generate_error") or "-")[:60])
    bm = (r.get("beyond_maxpos") or "-").split(":")[0]
    print(f"| {name} | yes | {f(r.get('forward_rel'))} | {dp} | {ds} | {ge(d)} | {cp} | {cs} | {ge(c)} | {cert_s} "
          f"| {ls_s} | {bm} |")
