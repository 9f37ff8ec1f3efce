"""Parity probe: tiny random transformers LlamaForCausalLM configs vs certattn-jax (HF loader, dense and certified).

For each case: build a random float32 LlamaForCausalLM (seed 0, non-trivial norm weights, non-zero biases when the
config has them), save_pretrained it, load it with `models.pretrained.load_pretrained(dtype=float32)`, and compare

  * full-sequence logits of `models.llama.forward` (no cache) vs HF forward, all positions;
  * prefill (`models.generate.prefill`, cache mode dense / certified) last-token logits vs HF;
  * 5 teacher-forced decode steps (the HF greedy tokens fed to a jitted `llama.forward` on the cache) vs HF;
  * `models.generate.generate` greedy tokens (dense / certified, record_steps) vs HF greedy tokens;
  * for certified: certificate summary (`certattn_jax.certificate.summarize`) of the teacher-forced steps and of
    generate's step records.

Usage:  .venv/bin/python scripts/soundness_probe/audit_2026_12_07_configs/probe_configs.py [case ...]
        (no case: all; `--list` lists them). One JSON line per case is appended to results.jsonl beside this file.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from certattn_jax import CertPolicy  # noqa: E402
from certattn_jax.certificate import summarize  # noqa: E402
from models import llama  # noqa: E402
from models import pretrained as pre  # noqa: E402
from models.generate import generate, prefill  # noqa: E402

HERE = Path(__file__).resolve().parent
torch.set_num_threads(2)

BASE = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
            initializer_range=0.1, attention_bias=False, mlp_bias=False, tie_word_embeddings=False)

# name -> (HF config overrides, probe options)
CASES: dict[str, tuple[dict, dict]] = {
    "baseline_gqa2": ({}, {}),
    "mha": (dict(num_attention_heads=4, num_key_value_heads=4), {}),
    "gqa4": (dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=256), {}),
    "mqa_8q_1kv": (dict(num_attention_heads=8, num_key_value_heads=1, hidden_size=256), {}),
    "head_dim32_explicit": (dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32), {}),
    "head_dim80_explicit": (dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=80),
                            dict(group_size=16)),
    "head_dim80_default_group": (dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=80),
                                 {}),
    "head_dim96_explicit": (dict(hidden_size=160, num_attention_heads=4, num_key_value_heads=1, head_dim=96), {}),
    "head_dim96_implicit": (dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=1), {}),
    "rope_llama3_theta5e5": (dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)), dict(prompt_len=40)),
    "rope_llama3_theta1e4": (dict(rope_theta=10000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=2.0,
        original_max_position_embeddings=16)), dict(prompt_len=40)),
    "rope_linear": (dict(rope_scaling=dict(rope_type="linear", factor=2.0)), {}),
    "rope_dynamic": (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0), max_position_embeddings=16), {}),
    "rope_yarn": (dict(rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64)), {}),
    "rope_theta5e5": (dict(rope_theta=500000.0), {}),
    "tied": (dict(tie_word_embeddings=True), {}),
    "untied": (dict(tie_word_embeddings=False), {}),
    "attention_bias": (dict(attention_bias=True), {}),
    "mlp_bias": (dict(mlp_bias=True), {}),
    "eps1e-6": (dict(rms_norm_eps=1e-6), {}),
    "vocab1003_ffn200": (dict(vocab_size=1003, intermediate_size=200), {}),
    "prompt100_block64": ({}, dict(prompt_len=100, block_size=64)),
    "prompt20_block64": ({}, dict(prompt_len=20, block_size=64)),
    "prompt37_block16": ({}, dict(prompt_len=37, block_size=16)),
    "maxpos_small": (dict(max_position_embeddings=22), dict(prompt_len=20)),
    # config.json with rms_norm_eps removed: transformers' LlamaConfig default is 1e-6
    "eps_omitted_in_json": (dict(rms_norm_eps=1e-6), dict(drop_keys=("rms_norm_eps",))),
    # config.json with max_position_embeddings removed: transformers' default 2048
    "maxpos_omitted_in_json": ({}, dict(drop_keys=("max_position_embeddings",))),
    "hidden_act_gelu": (dict(hidden_act="gelu"), {}),
    # OpenLLaMA-3B-like head_dim 100 (hidden 3200 / 32 heads): no power of two, value groups of 20 / 25
    "head_dim100_group20": (dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=100),
                            dict(group_size=20)),
    "head_dim100_group25": (dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=100),
                            dict(group_size=25)),
    # decode steps that cross a block flush (lengths 62..66 with 64-token blocks)
    "prompt61_block64_flush": ({}, dict(prompt_len=61, block_size=64)),
    # tight tolerance (eps 1e-4): the higher rungs (2-4) on the odd shapes
    "tight_mqa_8q_1kv": (dict(num_attention_heads=8, num_key_value_heads=1, hidden_size=256), dict(eps=1e-4)),
    "tight_head_dim80_group16": (dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=80),
                                 dict(group_size=16, eps=1e-4)),
    "tight_head_dim100_group25": (dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=100),
                                  dict(group_size=25, eps=1e-4)),
    "tight_mha_llama3": (dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)), dict(prompt_len=40, eps=1e-4)),
    # more blocks than k_max, tight eps: rungs 2-4 on odd shapes
    "ladder_head_dim100_group25": (dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=100),
                                   dict(group_size=25, eps=1e-5, k_max=2, prompt_len=120)),
    "ladder_mqa_8q_1kv": (dict(num_attention_heads=8, num_key_value_heads=1, hidden_size=256),
                          dict(eps=1e-5, k_max=2, prompt_len=120)),
    "ladder_head_dim100_group25_eps2e-3": (
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=100),
        dict(group_size=25, eps=2e-3, k_max=2, prompt_len=120)),
}


def hf_model(overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**BASE, **overrides})
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return model


def rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


def absd(ours, ref) -> float:
    return float(np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64)).max())


def hf_greedy(model, prompt: np.ndarray, steps: int):
    """(all-position prefill logits [T, V], per-step last logits [steps + 1, V], greedy tokens [steps])."""
    seq = list(int(t) for t in prompt)
    per_step, toks = [], []
    with torch.no_grad():
        full = model(torch.tensor([seq])).logits[0].numpy()
        per_step.append(full[-1])
        for _ in range(steps):
            t = int(np.argmax(per_step[-1]))
            toks.append(t)
            seq.append(t)
            per_step.append(model(torch.tensor([seq])).logits[0, -1].numpy())
    return full, np.stack(per_step), toks


_FWD = jax.jit(llama.forward, static_argnums=1)


def _lockstep(params, config, dense, cert, tok):
    """One decode step through both caches with the same layer inputs (the dense path's): per layer, the dense
    (exact) and certified attention outputs and the certified layer's certificate."""
    from models.rope import rope_cos_sin
    x = llama._embed(params, tok)
    cos, sin = rope_cos_sin(config, dense.lengths[:, None])
    new_lengths = dense.lengths + 1
    errs, bounds, tols, rungs = [], [], [], []
    for i, layer in enumerate(params["layers"]):
        q, k, v = llama._attention_inputs(layer, config, x, cos, sin)
        a_d, dense = dense.attend(i, q, k, v, new_lengths)
        a_c, cert = cert.attend(i, q, k, v, new_lengths)
        lc = cert.last_certificate
        errs.append(jnp.linalg.norm((a_c - a_d)[:, 0].astype(jnp.float32), axis=-1))  # [B, Hq]
        bounds.append(lc.error_bound[i])
        tols.append(lc.tolerance[i])
        rungs.append(lc.rung[i])
        x = llama._attention_output_and_mlp(layer, config, x, a_d)
    return (dense.with_lengths(new_lengths), cert.with_lengths(new_lengths),
            jnp.stack(errs), jnp.stack(bounds), jnp.stack(tols), jnp.stack(rungs))


_LOCKSTEP = jax.jit(_lockstep, static_argnums=1)


def run_case(name: str, steps: int = 5) -> dict:
    overrides, opts = CASES[name]
    T = opts.get("prompt_len", 20)
    rec: dict = {"case": name, "hf_overrides": overrides, "opts": {k: v for k, v in opts.items()}, "prompt_len": T}
    model = hf_model(overrides)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        cfg_path = Path(tmp) / "config.json"
        raw = json.loads(cfg_path.read_text())
        for k in opts.get("drop_keys", ()):
            raw.pop(k, None)
            (raw.get("rope_parameters") or {}).pop(k, None)
        cfg_path.write_text(json.dumps(raw))
        rec["config_json_keys"] = {k: raw.get(k) for k in ("rms_norm_eps", "max_position_embeddings", "head_dim",
                                                            "tie_word_embeddings", "rope_parameters", "rope_scaling",
                                                            "rope_theta", "attention_bias", "mlp_bias", "hidden_act")}
        # what transformers itself reads back from the (possibly edited) directory
        hf_back = transformers.LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        try:
            m = pre.load_pretrained(tmp, dtype=jnp.float32)
        except Exception as e:  # noqa: BLE001
            rec["supported"] = False
            rec["load_error"] = f"{type(e).__name__}: {e}"
            return rec
    rec["supported"] = True
    c = m.config
    rec["lib_config"] = dict(head_dim=c.head_dim, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                             rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                             max_position_embeddings=c.max_position_embeddings,
                             rope_scaling=None if c.rope_scaling is None else str(c.rope_scaling),
                             tie=c.tie_word_embeddings)
    rec["hf_config_readback"] = dict(rms_norm_eps=hf_back.config.rms_norm_eps,
                                     max_position_embeddings=hf_back.config.max_position_embeddings)
    ref_model = hf_back  # compare against what transformers loads from the same directory
    prompt = np.random.default_rng(1).integers(0, c.vocab_size, size=T).astype(np.int32)
    full_ref, step_ref, hf_toks = hf_greedy(ref_model, prompt, steps)
    rec["hf_greedy"] = hf_toks
    # also the original in-memory model (differs from ref_model only when a config key was dropped)
    if opts.get("drop_keys"):
        full_orig, _, toks_orig = hf_greedy(model, prompt, steps)
        rec["hf_inmemory_vs_reloaded_rel"] = rel(full_ref, full_orig)
        rec["hf_inmemory_greedy"] = toks_orig

    # 1. plain forward, all positions
    try:
        logits, _ = _FWD(m.params, c, jnp.asarray(prompt[None]))
        rec["forward_rel"] = rel(logits[0], full_ref)
        rec["forward_abs"] = absd(logits[0], full_ref)
    except Exception as e:  # noqa: BLE001
        rec["forward_error"] = f"{type(e).__name__}: {e}"

    pol_kw = {k: opts[k] for k in ("block_size", "group_size", "eps", "k_max") if k in opts}
    if "block_size" not in pol_kw:
        pol_kw["block_size"] = 8  # so that a 20-token prompt has flushed (quantized) blocks
    policy = CertPolicy(**pol_kw)
    rec["policy"] = pol_kw
    for mode in ("dense", "certified"):
        r: dict = {}
        rec[mode] = r
        pol = policy if mode == "certified" else None
        # 2. prefill + teacher-forced decode
        try:
            capacity = -(-(T + steps + 1) // 64) * 64
            cache, last = prefill(m.params, c, [prompt.tolist()], capacity, cache_factory=mode, policy=pol)
            r["prefill_rel"] = rel(last[0], step_ref[0])
            r["prefill_abs"] = absd(last[0], step_ref[0])
            r["prefill_argmax_eq"] = int(np.argmax(last[0])) == int(np.argmax(step_ref[0]))
            step_rel, step_abs, argmax_eq, certs = [], [], [], []
            for s in range(steps):
                tok = jnp.asarray([[hf_toks[s]]], jnp.int32)
                lg, cache = _FWD(m.params, c, tok, cache)
                step_rel.append(rel(lg[0, 0], step_ref[s + 1]))
                step_abs.append(absd(lg[0, 0], step_ref[s + 1]))
                argmax_eq.append(int(np.argmax(lg[0, 0])) == int(np.argmax(step_ref[s + 1])))
                if mode == "certified":
                    certs.append(jax.tree.map(np.asarray, cache.last_certificate))
            r["step_rel"], r["step_abs"], r["step_argmax_eq"] = step_rel, step_abs, argmax_eq
            if certs:
                stacked = jax.tree.map(lambda *x: np.stack(x), *certs)
                r["tf_cert"] = summarize(stacked)
        except Exception as e:  # noqa: BLE001
            r["teacher_forced_error"] = f"{type(e).__name__}: {e}"
            r["teacher_forced_tb"] = traceback.format_exc()[-1500:]
        # 3. generate
        try:
            out = generate(m.params, c, [prompt.tolist()], steps, cache_factory=mode, policy=pol, progress=False,
                           record_steps=(mode == "certified"), eos_token_ids=[])
            r["gen_tokens"] = out.tokens[0]
            r["gen_equal_hf"] = out.tokens[0] == hf_toks
            if mode == "certified" and out.step_records is not None:
                r["gen_cert"] = summarize(out.step_records)
        except Exception as e:  # noqa: BLE001
            r["generate_error"] = f"{type(e).__name__}: {e}"
    # 4. lockstep soundness: per head, measured ||o_cert - o_exact|| against the certificate's error_bound
    try:
        capacity = -(-(T + steps + 1) // 64) * 64
        dcache, _ = prefill(m.params, c, [prompt.tolist()], capacity, cache_factory="dense")
        ccache, _ = prefill(m.params, c, [prompt.tolist()], capacity, cache_factory="certified", policy=policy)
        worst_ratio, viol, over_tol, max_err, rung_hist = 0.0, 0, 0, 0.0, {}
        for s in range(steps):
            tok = jnp.asarray([[hf_toks[s]]], jnp.int32)
            dcache, ccache, err, bnd, tol, rung = _LOCKSTEP(m.params, c, dcache, ccache, tok)
            err, bnd, tol, rung = (np.asarray(a, np.float64) for a in (err, bnd, tol, rung))
            viol += int(np.sum(err > bnd))
            over_tol += int(np.sum(err > tol))
            worst_ratio = max(worst_ratio, float(np.max(err / np.maximum(bnd, 1e-30))))
            max_err = max(max_err, float(err.max()))
            for r_ in rung.reshape(-1):
                rung_hist[int(r_)] = rung_hist.get(int(r_), 0) + 1
        rec["lockstep"] = dict(bound_violations=viol, err_over_tolerance=over_tol, worst_err_over_bound=worst_ratio,
                               max_attn_err=max_err, rung_hist=rung_hist)
    except Exception as e:  # noqa: BLE001
        rec["lockstep_error"] = f"{type(e).__name__}: {e}"
        rec["lockstep_tb"] = traceback.format_exc()[-1500:]
    # requested length beyond max_position_embeddings
    try:
        long_new = c.max_position_embeddings - T + 3
        if long_new >= 1:
            out = generate(m.params, c, [prompt.tolist()], long_new, progress=False, eos_token_ids=[])
            rec["beyond_maxpos"] = f"accepted: {len(out.tokens[0])} tokens"
    except Exception as e:  # noqa: BLE001
        rec["beyond_maxpos"] = f"{type(e).__name__}: {e}"
    return rec


def main(argv: list[str]) -> None:
    if "--list" in argv:
        print("\n".join(CASES))
        return
    names = [a for a in argv if not a.startswith("--")] or list(CASES)
    out_path = HERE / "results.jsonl"
    for name in names:
        t0 = time.time()
        try:
            rec = run_case(name)
        except Exception as e:  # noqa: BLE001
            rec = {"case": name, "probe_error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-2000:]}
        rec["seconds"] = round(time.time() - t0, 1)
        with open("/proc/self/maps") as f:  # XLA CPU executables are mmapped; vm.max_map_count is 65530 here
            rec["process_memory_maps"] = sum(1 for _ in f)
        with open(out_path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        brief = {k: rec.get(k) for k in ("case", "supported", "load_error", "forward_rel", "lockstep",
                                         "lockstep_error", "beyond_maxpos", "probe_error", "seconds",
                                         "process_memory_maps")}
        for mode in ("dense", "certified"):
            if mode in rec:
                r = rec[mode]
                brief[mode] = {k: r.get(k) for k in ("prefill_rel", "step_rel", "gen_equal_hf", "teacher_forced_error",
                                                     "generate_error")}
                if "tf_cert" in r:
                    brief[mode]["cert"] = (r["tf_cert"]["fraction_certified"], r["tf_cert"]["rung_histogram"])
        print(json.dumps(brief, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
