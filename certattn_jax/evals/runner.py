"""The evaluation jobs over one `Session`: ppl, niah, ruler, audit, ablations, aggressive (K4V2), and `all`.
Each job returns a JSON-ready dict; `summarize` turns the results into `results/eval_summary.json`'s schema."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from certattn_jax.evals import niah, plots, ppl, ruler
from certattn_jax.evals.cli import JOBS
from certattn_jax.evals.session import Mode, Session
from certattn_jax.policy import CertPolicy


@dataclasses.dataclass
class EvalConfig:
    modes: list[Mode]
    policy: CertPolicy
    lengths: list[int]
    samples: int
    ppl_steps: int
    depths: list[int]
    tasks: list[str]
    max_new_tokens: int | None  # cap on generated tokens (None: RULER's per task)
    niah_new_tokens: int
    seed: int
    plot_dir: str | None
    sweep_tau: list[float]
    sweep_eps: list[float]


class Prompts:
    """Token ids of a RULER sample: chat template around the input, then the answer prefix."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._cache: dict[int, list[int]] = {}

    def __call__(self, s: ruler.Sample) -> list[int]:
        key = hash((s.input, s.answer_prefix))
        if key not in self._cache:
            text = s.input
            if self.tok.chat_template:
                text = self.tok.apply_chat_template([{"role": "user", "content": s.input}],
                                                    add_generation_prompt=True)
            self._cache[key] = self.tok.encode(text + s.answer_prefix.lstrip())
        return self._cache[key]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def run_ruler(session: Session, modes: Sequence[Mode], prompts: Prompts, tasks: Sequence[str],
              lengths: Sequence[int], samples: int, max_new_tokens: int | None, stop_ids: Sequence[int],
              seed: int = 0) -> dict[str, Any]:
    """RULER scores (0-100, string_match_all averaged over samples) per task, length and mode."""
    out: dict[str, Any] = {"tasks": list(tasks), "lengths": list(lengths), "samples": samples, "scores": {},
                           "outputs": []}
    bar = tqdm(total=len(tasks) * len(lengths) * samples * len(modes), desc="ruler", unit="run")
    for task in tasks:
        default = ruler.TOKENS_TO_GENERATE[ruler.TASKS[task][0]]
        gen = min(default, max_new_tokens) if max_new_tokens else default
        for n in lengths:
            try:
                batch = ruler.generate_samples(task, n, samples, lambda s: len(prompts(s)), seed, gen)
            except ValueError as e:  # e.g. vt's in-context example alone is longer than a 256-token context
                out.setdefault("skipped", []).append({"task": task, "length": n, "reason": str(e)})
                bar.update(samples * len(modes))
                continue
            scores: dict[str, list[float]] = {m.label: [] for m in modes}
            for s in batch:
                ids = prompts(s)
                rec: dict[str, Any] = {"task": task, "length": n, "prompt_tokens": len(ids), "outputs": s.outputs}
                for m in modes:
                    text = prompts.decode(session.generate(m, ids, gen, stop_ids))
                    sc = ruler.score(task, text, s.outputs)
                    scores[m.label].append(sc)
                    rec[m.label] = {"score": sc, "text": text}
                    bar.update(1)
                out["outputs"].append(rec)
            out["scores"].setdefault(task, {})[str(n)] = {k: 100.0 * float(np.mean(v)) for k, v in scores.items()}
    bar.close()
    return out


def audit_report(session: Session, plot_dir: str | None) -> dict[str, Any]:
    """The collectors' summaries, with bound-vs-error and rungs-per-layer plots for certified modes."""
    out = session.audit_summaries()
    if plot_dir:
        for label, col in session.collectors.items():
            if not col.has_cert:
                continue
            slug = niah._slug(label)
            files = []
            if col.has_error:
                files.append(str(plots.bound_vs_error(col.samples(), f"{label}: certificate vs true error",
                                                      f"{plot_dir}/audit_bound_vs_error_{slug}.png")))
            files.append(str(plots.rungs_per_layer(col.rungs, f"{label}: rungs per layer",
                                                   f"{plot_dir}/audit_rungs_{slug}.png")))
            out[label]["plots"] = files
    return out


def run_audit(session: Session, cfg: EvalConfig) -> dict[str, Any]:
    """Teacher-forced decoding of prose windows with the certified mode(s), every head-step audited."""
    modes = [m for m in cfg.modes if m.variant == "certified"] or [Mode("certified", "certified", cfg.policy)]
    res = ppl.run_ppl(session, modes, cfg.lengths, cfg.samples, cfg.ppl_steps, cfg.seed)
    return {"ppl": res, "audit": audit_report(session, cfg.plot_dir)}


def _fresh(session: Session) -> Session:
    return Session(session.params, session.config, session.tokenizer, session.capacity, session.chunk,
                   session.audit, session.audit_log)


def run_ablations(session: Session, cfg: EvalConfig) -> dict[str, Any]:
    """(1) which quantization costs quality: naive vs naive with exact values vs naive with exact keys (ppl, and
    the audited true error of each); (2) a sweep of tau_cov x eps for the certified cache: perplexity change,
    escalation rate (1 - share at rung 0), mean K*, and the share of the context read exact per step (K* blocks;
    the tolerances do not change the cache's size, see `memory_table`)."""
    s1 = _fresh(session)
    p = cfg.policy
    value_modes = [Mode("dense", "dense", p), Mode("naive", "naive", p),
                   Mode("naive-exact-values", "naive-exact-values", p),
                   Mode("naive-exact-keys", "naive-exact-keys", p)]
    values = ppl.run_ppl(s1, value_modes, cfg.lengths, cfg.samples, cfg.ppl_steps, cfg.seed)
    values_audit = {k: {f: v.get(f) for f in ("mean_true_error_per_layer", "max_relative_true_error")}
                    for k, v in s1.audit_summaries().items()}
    sweep = []
    dense = Mode("dense", "dense", p)
    for tau in cfg.sweep_tau:
        for eps in cfg.sweep_eps:
            s2 = _fresh(session)
            m = Mode(f"certified tau={tau} eps={eps}", "certified", dataclasses.replace(p, tau_cov=tau, eps=eps))
            r = ppl.run_ppl(s2, [dense, m], cfg.lengths, cfg.samples, cfg.ppl_steps, cfg.seed)
            a = s2.audit_summaries()[m.label]
            sweep.append({"tau_cov": tau, "eps": eps,
                          "ppl_delta_percent": {n: row[m.label]["delta_vs_dense_percent"]
                                                for n, row in r["per_length"].items()},
                          "ppl_delta_ci95_percent": {n: row[m.label]["paired_vs_dense"]["ci95_percent"]
                                                     for n, row in r["per_length"].items()},
                          "escalation_rate": 1.0 - a["share_rung0"], "share_certified": a["share_certified"],
                          "mean_k_star": a["mean_k_star"], "violations": a.get("violations"),
                          "head_steps": a["head_steps"],
                          "rung_histogram": a["rung_histogram"],
                          "exact_kv_bytes_per_step_fraction": a["mean_k_star"] * p.block_size / max(cfg.lengths)})
    return {"values": values, "values_true_error": values_audit, "sweep": sweep}


def run_aggressive(session: Session, cfg: EvalConfig, prompts: Prompts, stop_ids: Sequence[int]) -> dict[str, Any]:
    """K4V2 (key_bits=4, value_bits=2) naive and certified vs dense: ppl, NIAH, tier-1 bytes vs dense."""
    s = _fresh(session)
    k4v2 = dataclasses.replace(cfg.policy, key_bits=4, value_bits=2)
    modes = [Mode("dense", "dense", cfg.policy), Mode("naive K4V2", "naive", k4v2),
             Mode("certified K4V2", "certified", k4v2)]
    res: dict[str, Any] = {"policy": repr(k4v2)}
    res["ppl"] = ppl.run_ppl(s, modes, cfg.lengths, cfg.samples, cfg.ppl_steps, cfg.seed)
    res["niah"] = niah.run_niah(s, modes, prompts, cfg.lengths, cfg.depths, cfg.samples, cfg.niah_new_tokens,
                                stop_ids, cfg.seed, cfg.plot_dir, prompts.decode)
    res["memory"] = memory_table(session.config, cfg.policy, sorted({session.capacity, 8192, 32768}))
    res["audit"] = audit_report(s, cfg.plot_dir)
    return res


def memory_table(config: Any, policy: CertPolicy, capacities: Sequence[int]) -> list[dict[str, Any]]:
    """certattn_jax.memory_report of a bfloat16 TieredModelCache (batch 1) for the default layout and K4V2 at each
    capacity: tier-1 bytes against a dense bf16 cache. (The hot set of k_max blocks and the residual block are
    a fixed cost per head, so the fraction falls with the context.)"""
    import jax.numpy as jnp

    from certattn_jax.memory import memory_report
    from certattn_jax.model_cache import TieredModelCache

    rows = []
    for cap in capacities:
        for name, pol in (("INT8/INT4", policy), ("K4V2", dataclasses.replace(policy, key_bits=4, value_bits=2))):
            c = TieredModelCache.init(num_layers=config.num_layers, batch=1, capacity=cap,
                                      num_kv_heads=config.num_kv_heads, num_q_heads=config.num_heads,
                                      head_dim=config.head_dim, dtype=jnp.bfloat16, policy=pol, mode="naive")
            rep = memory_report(c)
            rows.append({"capacity": cap, "layout": name, "tier1_device_bytes": rep["tier1_device_bytes"],
                         "dense_bf16_bytes": rep["dense_bf16_bytes"], "tier1_fraction": rep["tier1_fraction"],
                         "breakdown": rep["breakdown"]})
            del c
    return rows


def run_job(job: str, session: Session, cfg: EvalConfig, stop_ids: Sequence[int],
            save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Run one job (or all of them), calling save(result) after each part so partial results survive."""
    if job not in JOBS:
        raise ValueError(f"unknown eval job {job!r}; choose from {JOBS}")
    prompts = Prompts(session.tokenizer)
    result: dict[str, Any] = {}
    parts = ["ppl", "niah", "ruler", "ablations", "aggressive", "memory"] if job == "all" else [job]
    for part in parts:
        if part == "ppl":
            result["ppl"] = ppl.run_ppl(session, cfg.modes, cfg.lengths, cfg.samples, cfg.ppl_steps, cfg.seed)
        elif part == "niah":
            result["niah"] = niah.run_niah(session, cfg.modes, prompts, cfg.lengths, cfg.depths, cfg.samples,
                                           cfg.niah_new_tokens, stop_ids, cfg.seed, cfg.plot_dir, prompts.decode)
        elif part == "ruler":
            result["ruler"] = run_ruler(session, cfg.modes, prompts, cfg.tasks, cfg.lengths, cfg.samples,
                                        cfg.max_new_tokens, stop_ids, cfg.seed)
        elif part == "audit":
            result.update(run_audit(session, cfg))
        elif part == "ablations":
            result["ablations"] = run_ablations(session, cfg)
        elif part == "aggressive":
            result["aggressive"] = run_aggressive(session, cfg, prompts, stop_ids)
        elif part == "memory":
            result["memory"] = memory_table(session.config, cfg.policy, sorted(set(cfg.lengths) | {8192, 32768}))
            save(result)
            continue
        if part != "audit":
            result["audit"] = audit_report(session, cfg.plot_dir)
        save(result)
    return result


def ruler_means(scores: dict[str, dict]) -> dict[str, dict[str, float]]:
    """RULER scores {task: {length: {mode: score}}} -> {task: {mode: mean over the lengths}}."""
    return {task: {mode: float(np.mean([by_length[n][mode] for n in by_length]))
                   for mode in next(iter(by_length.values()))} for task, by_length in scores.items()}


def summarize(result: dict[str, Any], model: str, device: str) -> dict[str, Any]:
    """The headline figures in results/eval_summary.json's schema (parts not run are absent)."""
    out: dict[str, Any] = {"model": model, "device": device}
    if "ppl" in result:
        rows = result["ppl"]["per_length"]
        labels = list(next(iter(rows.values())).keys()) if rows else []
        out["ppl"] = {lab: {n: rows[n][lab]["ppl"] for n in rows} for lab in labels}
    if "niah" in result:
        r = result["niah"]
        out["niah"] = {**r["accuracy"], "n": r["n"]}
        for k, v in r.get("mcnemar_vs_dense", {}).items():
            out["niah"][f"mcnemar_p_{k}_vs_dense"] = v["p_value"]
    if "ruler" in result:
        out["ruler"] = ruler_means(result["ruler"]["scores"])
        out["ruler_lengths"] = result["ruler"]["lengths"]
    audits = [v for v in result.get("audit", {}).values() if "violations" in v]
    audits += [v for v in result.get("aggressive", {}).get("audit", {}).values() if "violations" in v]
    sweep = [r for r in result.get("ablations", {}).get("sweep", []) if r.get("violations") is not None]
    if audits or sweep:
        out["soundness"] = {
            "head_steps": sum(v["head_steps"] for v in audits) + sum(r["head_steps"] for r in sweep),
            "violations": sum(v["violations"] for v in audits) + sum(r["violations"] for r in sweep),
            "violations_beyond_reference_rounding": sum(v["violations_beyond_reference_rounding"] for v in audits),
            "tightness_median": {k: v["tightness_median"] for k, v in result.get("audit", {}).items()
                                 if "violations" in v},
            "rung_histogram": np.sum([v["rung_histogram"] for v in audits] + [r["rung_histogram"] for r in sweep],
                                     axis=0).tolist(),
            "mean_k_star": {k: v["mean_k_star"] for k, v in result.get("audit", {}).items() if "mean_k_star" in v},
            "share_rung0": {k: v["share_rung0"] for k, v in result.get("audit", {}).items() if "share_rung0" in v},
            "sources": "certified runs of ppl/niah/ruler, the tau/eps sweep and the K4V2 runs",
        }
    if "aggressive" in result:
        a = result["aggressive"]
        rows = a["ppl"]["per_length"]
        out["aggressive"] = {
            "ppl": {lab: {n: rows[n][lab]["ppl"] for n in rows} for lab in next(iter(rows.values()))},
            "niah": a["niah"]["accuracy"],
            "mcnemar_p_vs_dense": {k: v["p_value"] for k, v in a["niah"].get("mcnemar_vs_dense", {}).items()},
            "escalation_rate": {k: 1.0 - v["share_rung0"] for k, v in a["audit"].items() if "share_rung0" in v},
            "rung_histogram": {k: v["rung_histogram"] for k, v in a["audit"].items() if "rung_histogram" in v},
            "mean_k_star": {k: v["mean_k_star"] for k, v in a["audit"].items() if "mean_k_star" in v},
        }
    table = result.get("memory") or result.get("aggressive", {}).get("memory")
    if isinstance(table, list):  # memory_table rows (older aggressive results held a dict: skipped)
        out.setdefault("aggressive", {})["tier1_fraction_bf16_by_capacity"] = {
            f'{r["layout"]}@{r["capacity"]}': r["tier1_fraction"] for r in table}
    return out
