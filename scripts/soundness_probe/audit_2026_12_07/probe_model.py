"""Probe C: model-level certificates and cache invariants (tiny LlamaConfig "gqa": vocab 97, hidden 48, 2 layers,
6 heads / 2 KV heads, head_dim 8).

 1. models.generate.generate dense vs cache_factory="certified" (record_steps), greedy, ragged prompts (one of a
    single token): tokens compared; for every certified step the largest certificate bound against the dense
    model's top-2 logit gap on the certified sequence (teacher forced, full recomputation).
 2. The certified generate's final cache: lengths, flushed, tier 1 vs tier 2 per block within the annotations,
    running statistics, hot set, value_stats; layer 0's originals against a dense cache fed the same tokens.
 3. A decode loop of llama.forward over a certified cache of the "unrolled" schedule whose `attend` is wrapped
    (this script only) to capture each layer's query: every head-step's output against float64 attention over
    that layer's originals, and the certificate's fields (as probe_cert: bound, certified, rung 4 == dense,
    e_val == 0 / k_star == full blocks at the exact rungs).

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07/probe_model.py [--scale S] [--new N]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import PATH, Tally, attn64, dequantized, f64  # noqa: E402

from certattn_jax import bounds, model_cache  # noqa: E402
from certattn_jax.attention import dense_attention  # noqa: E402
from certattn_jax.model_cache import cache_spec  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402
from models import generate as gen  # noqa: E402
from models import llama  # noqa: E402
from models.config import LlamaConfig  # noqa: E402

CFG = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=8, max_position_embeddings=512)

ap = argparse.ArgumentParser()
ap.add_argument("--scale", type=float, default=0.25)
ap.add_argument("--new", type=int, default=40)
ap.add_argument("--eps", type=float, default=0.05)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--skip-manual", action="store_true")
args = ap.parse_args()

POL = CertPolicy(block_size=8, group_size=8, k_max=2, v_max=2, eps=args.eps)
fwd = jax.jit(llama.forward, static_argnums=1)


def check_cache_invariants(t: Tally, tag, cache, lens_expected):
    """Every layer of a TieredModelCache: lengths, flushed, tier 1 vs its own tier 2 within the annotations, the
    statistics against the stored values, hot slots == their blocks' originals."""
    s = cache.store
    L = cache.num_layers
    lens = np.asarray(cache.lengths)
    if not np.array_equal(lens, lens_expected):
        t.bad(f"{tag}: model lengths {lens} != expected {lens_expected}")
    for layer in range(L):
        c = cache.layer_view(layer)
        if not np.array_equal(np.asarray(c.lengths), lens):
            t.bad(f"{tag} layer {layer}: layer lengths {np.asarray(c.lengths)} != model {lens}")
        Bk = c.block_size
        F = np.asarray(c.flushed)
        for b, n in enumerate(lens):
            if not (F[b] == (n // Bk) * Bk):
                t.bad(f"{tag} layer {layer} b={b}: flushed {F[b]} for length {n} (after the step's maintenance)")
        ek, ev = c.exact_kv()
        K = f64(ek).transpose(0, 2, 1, 3)  # [B, S, H, d]
        V = f64(ev).transpose(0, 2, 1, 3)
        khat, vhat = dequantized(c)
        ks = f64(c.k_scale)
        for b, n in enumerate(lens):
            fl = int(F[b])
            for h in range(c.num_kv_heads):
                for j in range(fl // Bk):
                    blk = slice(j * Bk, (j + 1) * Bk)
                    kerr = np.abs(khat[b, h, j] - K[b, blk, h])
                    if np.any(kerr > ks[b, h, j] * 0.5000001 + 1e-30):
                        t.bad(f"{tag} layer {layer} b={b} h={h} blk={j}: key error {kerr.max()} > s/2")
                    tok = np.linalg.norm(V[b, blk, h] - vhat[b, h, j], axis=-1).max()
                    if tok > float(np.asarray(c.v_err)[b, h, j]):
                        t.bad(f"{tag} layer {layer} b={b} h={h} blk={j}: value error {tok} > v_err")
                vv = V[b, :n, h]
                if not (np.array_equal(np.asarray(c.v_min)[b, h], vv.min(0))
                        and np.array_equal(np.asarray(c.v_max)[b, h], vv.max(0))):
                    t.bad(f"{tag} layer {layer} b={b} h={h}: v_min/v_max differ from the stored values' range")
                if np.linalg.norm(vv, axis=-1).max() > float(np.asarray(c.v_norm_max)[b, h]):
                    t.bad(f"{tag} layer {layer} b={b} h={h}: v_norm_max below a stored norm")
                ids = np.asarray(c.hot_ids)[b, h]
                live = [i for i in ids if i >= 0]
                if len(set(live)) != len(live):
                    t.bad(f"{tag} layer {layer} b={b} h={h}: duplicate hot ids {ids}")
                for sl, i in enumerate(ids):
                    if i < 0:
                        continue
                    if i >= fl // Bk or not (np.array_equal(f64(c.hot_k)[b, h, sl], K[b, i * Bk:(i + 1) * Bk, h])
                                             and np.array_equal(f64(c.hot_v)[b, h, sl], V[b, i * Bk:(i + 1) * Bk, h])):
                        t.bad(f"{tag} layer {layer} b={b} h={h}: hot slot {sl} (block {i}) not its block's originals")
                if np.any(np.asarray(c.nonfinite)[b, h]):
                    t.bad(f"{tag} layer {layer} b={b} h={h}: nonfinite set")
        cols = bounds.value_statistics(c.v_min, c.v_max, c.v_err_max, c.v_scale_max, c.v_zero_max, Bk, c.value_bits)
        rec = np.stack([np.asarray(x) for x in cols], -1)
        st = np.asarray(c.value_stats)
        rel = float(np.max(np.abs(rec.astype(np.float64) - st) / np.maximum(np.abs(rec), 1e-30)))
        if rel > 1e-5:
            t.bad(f"{tag} layer {layer}: value_stats off by {rel} relative from recomputed")
        if np.any(np.asarray(s.hot_pending) >= 0):
            t.bad(f"{tag}: hot_pending not cleared between steps")
    return K, V  # the last layer's


def dense_kv_of(params, tokens_rows, capacity):
    """A dense cache fed each row's tokens (one row at a time: rows of different lengths), [layers] of
    [B, H, S, d] float64 and the lengths."""
    B = len(tokens_rows)
    ks = [np.zeros((B, CFG.num_kv_heads, capacity, CFG.head_dim)) for _ in range(CFG.num_layers)]
    vs = [np.zeros_like(ks[0]) for _ in range(CFG.num_layers)]
    for b, row in enumerate(tokens_rows):
        cache = llama.init_cache_for(params, CFG, 1, capacity)
        _, cache = fwd(params, CFG, jnp.asarray([row], jnp.int32), cache)
        for layer in range(CFG.num_layers):
            ks[layer][b] = f64(cache.k[layer][0])
            vs[layer][b] = f64(cache.v[layer][0])
    return ks, vs


def part1_2(t: Tally, params, prompts, n_new):
    kw = dict(eos_token_ids=[], progress=False)
    t0 = time.time()
    dense = gen.generate(params, CFG, prompts, n_new, **kw)
    cert = gen.generate(params, CFG, prompts, n_new, cache_factory="certified", policy=POL, record_steps=True, **kw)
    print(f"generate dense + certified {time.time() - t0:.0f}s, schedule {cert.cache.schedule}", flush=True)
    recs = jax.tree.map(np.asarray, cert.step_records)  # leaves [steps - 1, L, B, Hq]
    print("records", recs.rung.shape, "rung histogram", np.bincount(recs.rung.ravel(), minlength=5).tolist(),
          "certified fraction", float(recs.certified.mean()), "max bound", float(recs.error_bound.max()), flush=True)
    for f in ("error_bound", "e_key", "e_val", "e_num", "tolerance"):
        x = getattr(recs, f)
        if np.any(np.isnan(x)) or np.any(x < 0):
            t.bad(f"generate records: field {f} NaN/negative")
    if np.any(recs.certified != ((recs.error_bound <= recs.tolerance) & np.isfinite(recs.error_bound))):
        t.bad("generate records: certified != (bound <= tolerance)")
    if np.any(~recs.ranking_ok):
        t.bad("generate records: ranking_ok False")
    ex = recs.rung >= 3
    if np.any(recs.e_val[ex] != 0):
        t.bad("generate records: e_val != 0 at an exact rung")
    for b, p in enumerate(prompts):
        same = dense.tokens[b] == cert.tokens[b]
        seq = list(p) + cert.tokens[b]
        logits, _ = fwd(params, CFG, jnp.asarray([seq], jnp.int32))
        lg = np.asarray(logits[0], np.float64)
        first_diff = None
        for i, tok in enumerate(cert.tokens[b]):
            row = lg[len(p) - 1 + i]
            top2 = np.sort(row)[-2:]
            gap = top2[1] - top2[0]
            arg = int(np.argmax(row))
            # the step that produced token i (i >= 1) is record i - 1
            bound = float(recs.error_bound[i - 1, :, b].max()) if i >= 1 else 0.0
            if arg != tok:
                first_diff = (i, tok, arg, gap, bound)
                break
            t.head_steps += 1
        print(f"row {b}: prompt {len(p)}, tokens equal dense generate: {same}; first disagreement with the dense "
              f"argmax on the certified sequence: {first_diff}", flush=True)
        if first_diff is not None:
            i, tok, arg, gap, bound = first_diff
            msg = (f"row {b} token {i}: certified {tok} vs dense argmax {arg}, top-2 gap {gap:.3g}, "
                   f"max bound {bound:.3g}")
            (t.bad if bound < 1e-2 * gap else t.note)(msg)
        # the smallest gap over agreeing positions against the bounds
        gaps = []
        for i in range(1, len(cert.tokens[b]) if first_diff is None else first_diff[0]):
            row = np.sort(lg[len(p) - 1 + i])[-2:]
            gaps.append((row[1] - row[0], float(recs.error_bound[i - 1, :, b].max())))
        if gaps:
            g = np.asarray(gaps)
            print(f"   min gap {g[:, 0].min():.3g}, max bound {g[:, 1].max():.3g}, max bound/gap "
                  f"{(g[:, 1] / g[:, 0]).max():.3g}", flush=True)
    # part 2: the final cache
    c = cert.cache
    n_steps = cert.num_steps
    lens_expected = np.asarray([len(p) + n_steps - 1 for p in prompts])
    check_cache_invariants(t, "generate cache", c, lens_expected)
    rows = [list(p) + cert.tokens[b][:-1] for b, p in enumerate(prompts)]
    dk, dv = dense_kv_of(params, rows, c.capacity)
    for layer in range(CFG.num_layers):
        ek, ev = c.layer_view(layer).exact_kv()
        ek, ev = f64(ek), f64(ev)
        worst = 0.0
        for b, n in enumerate(lens_expected):
            diff = max(np.abs(ek[b, :, :n] - dk[layer][b, :, :n]).max(),
                       np.abs(ev[b, :, :n] - dv[layer][b, :, :n]).max())
            worst = max(worst, diff / (1 + np.abs(dv[layer][b, :, :n]).max()))
        print(f"layer {layer}: originals vs a dense cache fed the same tokens: max rel diff {worst:.3g}", flush=True)
        if layer == 0 and worst > 1e-5:
            t.bad(f"layer 0 originals differ from the dense cache's by {worst:.3g} (same tokens)")
    return cert


def part3(t: Tally, params, prompts, n_new):
    """A manual certified decode loop with each layer's query captured."""
    spec = cache_spec("certified", CFG, jnp.float32, POL, schedule="unrolled")
    B = len(prompts)
    cap = 8 * (-(-(max(map(len, prompts)) + n_new) // 8))
    staging = spec.staging(B, cap)
    T = max(map(len, prompts))
    padded = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    lens = np.asarray([len(p) for p in prompts], np.int32)
    logits, staging = jax.jit(llama.forward, static_argnums=1)(params, CFG, jnp.asarray(padded), staging,
                                                               valid_lengths=jnp.asarray(lens))
    cache = spec.from_staging(staging)
    last = np.asarray(logits)[np.arange(B), lens - 1]
    tok = np.argmax(last, -1)
    captured = []
    orig_attend = model_cache.TieredModelCache.attend
    jit_attend = jax.jit(orig_attend, static_argnums=(1,))

    def attend(self, layer, q, k, v, new_lengths):
        out, new = jit_attend(self, layer, q, k, v, new_lengths)
        if q.shape[1] == 1:
            captured.append((layer, q, out, new))
        return out, new

    model_cache.TieredModelCache.attend = attend
    try:
        step = 0
        while step < n_new - 1:
            captured.clear()
            logits, cache = llama.forward(params, CFG, jnp.asarray(tok[:, None], jnp.int32), cache)
            tok = np.argmax(np.asarray(logits)[:, -1], -1)
            for layer, q, out, new in captured:
                check_layer_step(t, f"manual step {step} layer {layer}", layer, q[:, 0], out[:, 0], new)
            step += 1
    finally:
        model_cache.TieredModelCache.attend = orig_attend
    return cache


def check_layer_step(t: Tally, tag, layer, q, out, model):
    c = model.layer_view(layer)
    cert = jax.tree.map(lambda x: np.asarray(x)[layer], model.last_certificate)
    lens = np.asarray(model.lengths) + 1  # the model's lengths are recorded after the last layer (with_lengths)
    ek, ev = c.replace(lengths=jnp.asarray(lens, jnp.int32)).exact_kv()
    K = f64(ek).transpose(0, 2, 1, 3)
    V = f64(ev).transpose(0, 2, 1, 3)
    q64, o64 = f64(q), f64(out)
    B, Hq, d = q.shape
    G = Hq // c.num_kv_heads
    dense = f64(dense_attention(q, c.replace(lengths=jnp.asarray(lens, jnp.int32))))
    for b in range(B):
        n = int(lens[b])
        ref = attn64(q64[b], K[b], V[b], n)
        nfull = int(np.asarray(c.flushed)[b]) // c.block_size
        for h in range(Hq):
            t.head_steps += 1
            rung = int(cert.rung[b, h])
            t.rungs[rung] += 1
            err = float(np.linalg.norm(o64[b, h] - ref[h]))
            bound = float(cert.error_bound[b, h])
            where = f"{tag} b={b} h={h} n={n} rung={rung} k*={int(cert.k_star[b, h])}"
            if not err <= bound:
                t.bad(f"{where}: error {err:.6g} > bound {bound:.6g}")
            tol = float(cert.tolerance[b, h])
            if bool(cert.certified[b, h]) != (bound <= tol and math.isfinite(bound)):
                t.bad(f"{where}: certified flag inconsistent")
            vv = V[b, :n, h // G]
            want = float(POL.eps) * np.linalg.norm(vv.max(0) - vv.min(0))
            if tol < want * (1 - 1e-6):
                t.bad(f"{where}: tolerance {tol} < eps * range {want}")
            if rung >= 3:
                if int(cert.k_star[b, h]) != nfull or float(cert.e_val[b, h]) != 0:
                    t.bad(f"{where}: k_star/e_val at an exact rung")
                if rung == 4 and np.any(o64[b, h] != dense[b, h]):
                    t.bad(f"{where}: rung-4 output != dense_attention")
            elif int(cert.k_star[b, h]) > 2 * POL.k_max + POL.v_max:
                t.bad(f"{where}: k_star above 2 k_max + v_max")


def main():
    t = Tally(f"model scale={args.scale} eps={args.eps}")
    params = llama.init_params(CFG, jax.random.key(args.seed), jnp.float32, scale=args.scale)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, CFG.vocab_size, 37).tolist(), rng.integers(0, CFG.vocab_size, 1).tolist(),
               rng.integers(0, CFG.vocab_size, 16).tolist()]
    t0 = time.time()
    part1_2(t, params, prompts, args.new)
    print(t.summary(), f"{time.time() - t0:.0f}s", flush=True)
    if not args.skip_manual:
        cache = part3(t, params, prompts, min(args.new, 20))
        check_cache_invariants(t, "manual loop cache", cache, np.asarray(cache.lengths))
    print("=== SUMMARY", PATH)
    print(t.summary(), f"{time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
