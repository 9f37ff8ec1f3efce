"""Join the headline figures of evaluation runs split over several calls (e.g. one device call per job) into
results/eval_summary.json's schema.

    python scripts/eval_summary_from_parts.py results/eval_h200_ppl.json results/eval_h200_niah.json \
        results/eval_h200_ruler_8k.json results/eval_h200_audit_8k.json --keep-aggressive results/eval_summary.json \
        --out results/eval_summary.json

Each part is summarised by `certattn_jax.evals.runner.summarize`; perplexities merge per length, a later part's
figures replacing every mode's at the lengths it ran (e.g. a larger 8K sample after a first run's), unless it
scored the same windows (`same_windows`), when it adds the modes they lack (e.g. naive run later on the
same sample); the modes of a length always come from the same windows; `ppl_source` names each length's
file(s); the soundness section adds up
every part's certified audit (head-steps, violations, rung histogram) and lists each part's median tightness and
mean K* (medians of different runs do not combine into one median); NIAH pools the needles of every part (each
needle is one paired outcome per mode: accuracies and McNemar's exact test over all of them, each part's own
figures under "niah_parts"); RULER's scores merge per task and length ("ruler" averages each task over the lengths,
"ruler_by_length" keeps them apart). `--keep-aggressive FILE` carries the
"aggressive" section of an earlier summary over (with its source) when this set of parts has none.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from certattn_jax.evals.runner import ruler_means, summarize  # noqa: E402
from certattn_jax.evals.stats import mcnemar_exact  # noqa: E402


def pooled_niah(parts: dict[str, dict]) -> dict:
    """Accuracy per mode and McNemar's exact test against dense over the needles of every NIAH part."""
    samples = [x for r in parts.values() for x in r["niah"]["samples"]]
    modes = [m for m in ("dense", "naive", "certified") if all(m in x for x in samples)]
    out: dict = {m: float(np.mean([x[m]["correct"] for x in samples])) for m in modes}
    out["n"] = len(samples)
    for m in modes[1:]:
        test = mcnemar_exact([x["dense"]["correct"] for x in samples], [x[m]["correct"] for x in samples])
        out[f"mcnemar_p_{m}_vs_dense"] = test["p_value"]
    return out


def ruler_figures(scores: dict[str, dict]) -> dict:
    """RULER's headline figures from {task: {length: {mode: score}}}: "ruler" {task: {mode: mean over lengths}}
    (the schema of a single run's summary), "ruler_lengths", and "ruler_by_length" {length: {task: {mode: score}}}."""
    lengths = sorted({n for by_length in scores.values() for n in by_length}, key=int)
    by_length = {n: {task: scores[task][n] for task in scores if n in scores[task]} for n in lengths}
    return {"ruler": ruler_means(scores), "ruler_lengths": [int(n) for n in lengths], "ruler_by_length": by_length}


def same_windows(a: dict | None, b: dict | None) -> bool:
    """Whether two runs scored the same tokens, from their dense rows: as many windows and tokens, and the same
    total perplexity to 1e-5 (another sample of the prose differs by percents). Per-window perplexities are not
    compared: on the H200 the two 8K runs of 2026-12-02 agree to 1e-6 in total but differ by up to 0.56 % per
    window (docs/evaluation.md, sixth run)."""
    if a is None or b is None or "per_window_ppl" not in a or "per_window_ppl" not in b:
        return False
    return (len(a["per_window_ppl"]) == len(b["per_window_ppl"]) and a.get("tokens") == b.get("tokens")
            and abs(a["ppl"] - b["ppl"]) <= 1e-5 * abs(a["ppl"]))


def merge_ppl(out: dict, windows: dict, path: str, per_length: dict) -> None:
    """Merge one part's perplexities {length: {mode: row}} into out["ppl"] {mode: {length: ppl}}. A part that
    scored the same windows as the figures already held for a length (`same_windows`) adds the modes they lack;
    otherwise it replaces every mode's figure at that length. So the modes of one length always come from the
    same windows; `ppl_source` names the file(s) of each length."""
    ppl, source = out.setdefault("ppl", {}), out.setdefault("ppl_source", {})
    for n, rows in per_length.items():
        dense = rows.get("dense")
        if n in windows and same_windows(windows[n], dense):
            for mode, row in rows.items():
                ppl.setdefault(mode, {}).setdefault(n, row["ppl"])
            source[n] = [*([source[n]] if isinstance(source[n], str) else source[n]), path]
            continue
        for mode in ppl:
            ppl[mode].pop(n, None)
        for mode, row in rows.items():
            ppl.setdefault(mode, {})[n] = row["ppl"]
        windows[n], source[n] = dense, path


def combine(parts: dict[str, dict]) -> dict:
    """The summary of several result files, {path: result}."""
    first = next(iter(parts.values()))
    out: dict = {"model": first["model"], "device": first["device"], "sources": {}}
    audits = {}
    ruler: dict[str, dict] = {}
    windows: dict[str, dict | None] = {}  # per length: the dense row of the part its figures come from
    for path, result in parts.items():
        s = summarize(result, result["model"], result["device"])
        if "aggressive" in s:
            out["aggressive"] = s["aggressive"]
        if "ruler" in result:  # {task: {length: {mode: score}}}, merged over the parts (a later part's length wins)
            for task, by_length in result["ruler"]["scores"].items():
                ruler.setdefault(task, {}).update(by_length)
        if "niah" in s:
            out.setdefault("niah_parts", {})[path] = s["niah"]
        if "ppl" in s and result.get("job") != "audit":  # audit: certified-only windows
            merge_ppl(out, windows, path, result["ppl"]["per_length"])
        cert = result.get("audit", {}).get("certified")
        if cert and "violations" in cert:
            audits[path] = cert
        out["sources"][path] = result.get("command")
    if ruler:
        out.update(ruler_figures(ruler))
    niah = {p: r for p, r in parts.items() if "niah" in r}
    if niah:
        out["niah"] = pooled_niah(niah)
    if audits:
        out["soundness"] = {
            "head_steps": sum(a["head_steps"] for a in audits.values()),
            "violations": sum(a["violations"] for a in audits.values()),
            "violations_beyond_reference_rounding": sum(a["violations_beyond_reference_rounding"]
                                                        for a in audits.values()),
            "tightness_median": {p: a["tightness_median"] for p, a in audits.items()},
            "rung_histogram": np.sum([a["rung_histogram"] for a in audits.values()], axis=0).tolist(),
            "mean_k_star": {p: a["mean_k_star"] for p, a in audits.items()},
            "share_rung0": sum(a["rung_histogram"][0] for a in audits.values())
            / sum(a["head_steps"] for a in audits.values()),
            "share_certified": min(a["share_certified"] for a in audits.values()),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="+")
    ap.add_argument("--keep-aggressive", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    summary = combine({p: json.loads(Path(p).read_text()) for p in args.parts})
    if args.keep_aggressive and "aggressive" not in summary:
        old = json.loads(Path(args.keep_aggressive).read_text())
        if "aggressive" in old:
            source = old["aggressive"].get("source", "an earlier run (see docs/evaluation.md)")
            summary["aggressive"] = {**old["aggressive"], "device": old.get("device"), "source": source}
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary.get("soundness", {}), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
