"""Soundness of certified decode steps through TieredModelCache (stacked layers, traced layer index, two-pass
fast path + second pass, deferred hot-set refresh, stacked flush), driven with random per-layer q/k/v.
python model_audit.py OUT.jsonl [cfg indices]"""

import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import jax
import jax.numpy as jnp
import numpy as np
from audit2 import draw
from float64_reference import attention_f64

from certattn_jax.cache import TieredKVCache
from certattn_jax.model_cache import TieredModelCache
from certattn_jax.policy import CertPolicy


def layers_loop(cache, q, k, v, new_lengths):
    L = q.shape[0]
    outs = jnp.zeros(q.shape, q.dtype)

    def body(i, carry):
        outs, c = carry
        o, c = c.attend(i, q[i][:, None], k[i], v[i], new_lengths)
        return outs.at[i].set(o[:, 0]), c

    return jax.lax.fori_loop(0, L, body, (outs, cache))


@functools.partial(jax.jit, static_argnames=("top",))
def fast_pass(cache, q, k, v, top):
    nl = cache.lengths + 1
    outs, c = layers_loop(cache.decode_fast_path(top), q, k, v, nl)
    c = c.fast_pass_result()
    return outs, c, c.needs_slow_path()


@jax.jit
def finish_fast(c_fast, nl):
    return c_fast.fast_path_done().with_lengths(nl)


@jax.jit
def slow_pass(cache, q, k, v):
    nl = cache.lengths + 1
    outs, c = layers_loop(cache, q, k, v, nl)
    return outs, c.slow_path_done().with_lengths(nl)


def run(*, L, B, H, G, D, dtype, policy, L0, T, family, seed, top, schedule="looped"):
    rng = np.random.default_rng(seed)
    L0 = np.asarray(L0)
    P = int(L0.max())
    N = P + T
    cap = -(-(N + policy.block_size) // policy.block_size) * policy.block_size
    data = [draw(rng, family, B, N, H, G, D, dtype, policy) for _ in range(L)]
    q = np.stack([d[0] for d in data]).astype(np.float32)  # [L, N, B, Hq, D]
    k = np.stack([d[1] for d in data]).astype(np.float32)  # [L, B, N, H, D]
    v = np.stack([d[2] for d in data]).astype(np.float32)
    ks = np.asarray(jnp.asarray(k).astype(dtype).astype(jnp.float32), np.float64)
    vs = np.asarray(jnp.asarray(v).astype(dtype).astype(jnp.float32), np.float64)
    layers = []
    for l in range(L):
        pk = np.zeros((B, P, H, D), np.float32)
        pv = np.zeros_like(pk)
        for b in range(B):
            pk[b, : L0[b]] = k[l, b, : L0[b]]
            pv[b, : L0[b]] = v[l, b, : L0[b]]
        layers.append(
            TieredKVCache.from_dense(
                jnp.asarray(pk, dtype),
                jnp.asarray(pv, dtype),
                policy=policy,
                capacity=cap,
                lengths=jnp.asarray(L0, jnp.int32),
            )
        )
    cache = TieredModelCache.from_layers(layers, num_q_heads=H * G, policy=policy, schedule=schedule)
    st = {"heads": 0, "viol": 0, "rungs": [0] * 5, "slow": 0, "examples": []}
    for t in range(T):
        qt = jnp.asarray(q[:, P + t])
        kt = jnp.asarray(k[:, :, P + t : P + t + 1])
        vt = jnp.asarray(v[:, :, P + t : P + t + 1])
        outs, c_fast, slow = fast_pass(cache, qt, kt, vt, top)
        if bool(slow):
            st["slow"] += 1
            outs, cache = slow_pass(cache, qt, kt, vt)
        else:
            cache = finish_fast(c_fast, cache.lengths + 1)
        cert = jax.tree.map(np.asarray, cache.last_certificate)  # [L, B, Hq]
        lens = L0 + t + 1
        for l in range(L):
            Kr = np.zeros((B, int(lens.max()), H, D))
            Vr = np.zeros_like(Kr)
            for b in range(B):
                Kr[b, : L0[b]] = ks[l, b, : L0[b]]
                Vr[b, : L0[b]] = vs[l, b, : L0[b]]
                Kr[b, L0[b] : lens[b]] = ks[l, b, P : P + t + 1]
                Vr[b, L0[b] : lens[b]] = vs[l, b, P : P + t + 1]
            with np.errstate(all="ignore"):
                ref = attention_f64(q[l, P + t].astype(np.float64), Kr, Vr, lens)
                o64 = np.asarray(outs[l], np.float64)
                err = np.linalg.norm(o64 - ref, axis=-1)
            bound = cert.error_bound[l].astype(np.float64)
            fin_kv = np.stack(
                [
                    np.all(np.isfinite(Kr[b, : lens[b]]), axis=(0, 2))
                    & np.all(np.isfinite(Vr[b, : lens[b]]), axis=(0, 2))
                    for b in range(B)
                ]
            )
            bad = ~np.repeat(fin_kv, G, axis=1) | ~np.all(np.isfinite(q[l, P + t]), axis=-1)
            out_bad = ~np.all(np.isfinite(o64), axis=-1)
            viol = (
                np.isnan(bound)
                | (~bad & ~out_bad & ~(err <= bound))
                | (out_bad & np.isfinite(bound))
                | (bad & cert.certified[l])
                | (bad & np.isfinite(bound))
                | (cert.rung[l] == 3) & ~cert.certified[l] & False
            )
            st["heads"] += bound.size
            for r in range(5):
                st["rungs"][r] += int(np.sum(cert.rung[l] == r))
            if viol.any():
                st["viol"] += int(viol.sum())
                for b, h in np.argwhere(viol)[:2]:
                    st["examples"].append(
                        {
                            "t": t,
                            "layer": l,
                            "b": int(b),
                            "h": int(h),
                            "err": float(err[b, h]),
                            "bound": float(bound[b, h]),
                            "rung": int(cert.rung[l, b, h]),
                            "slow": bool(slow),
                        }
                    )
    return st


f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
P_ = CertPolicy
# fmt: off
CFGS = [
    ("m_G2_bs16_top1", dict(L=3, B=2, H=2, G=2, D=32, dtype=f32, policy=P_(block_size=16, group_size=16, k_max=2,
        eps=0.05), L0=[20, 47], T=40, top=1)),
    ("m_G8_bs32_bf16_top0", dict(L=2, B=2, H=1, G=8, D=64, dtype=bf16, policy=P_(block_size=32, group_size=32,
        k_max=1, hot_slots=3, eps=0.02), L0=[64, 3], T=40, top=0)),
    ("m_G1_bs16_f16_K4V2_top1_prefetch", dict(L=2, B=3, H=2, G=1, D=16, dtype=f16, policy=P_(block_size=16,
        group_size=16, key_bits=4, value_bits=2, k_max=2, eps=0.2, hot_refresh="prefetch"), L0=[0, 16, 90], T=40,
        top=1)),
    ("m_G4_bs16_tau1_top1", dict(L=2, B=2, H=2, G=4, D=32, dtype=f32, policy=P_(block_size=16, group_size=16,
        k_max=1, tau_cov=1.0, eps=1e-3), L0=[100, 31], T=35, top=1)),
]
# fmt: on
FAMS = ["gauss", "needle", "key_spike", "key_spike_aligned", "val_const_one", "q_mixed", "huge_scores", "f16_edge",
        "kv_nonfinite", "q_nonfinite", "tied", "offset"]

if __name__ == "__main__":
    out = open(sys.argv[1], "a")
    idx = [int(a) for a in sys.argv[2:]] or range(len(CFGS))
    for i in idx:
        name, kw = CFGS[i]
        t0 = time.time()
        tot = [0, 0, 0]
        for j, fam in enumerate(FAMS):
            s = run(**kw, family=fam, seed=7000 + 100 * i + j)
            out.write(
                json.dumps(
                    {
                        "cfg": name,
                        "fam": fam,
                        **s,
                        "env": {
                            k: os.environ.get(k)
                            for k in ("CERTATTN_TIER1", "CERTATTN_RUNG0", "CERTATTN_TIER1_BPS", "CERTATTN_WRITE_KERNEL",
                                      "CERTATTN_RUNG0_SELECT")
                        },
                    }
                )
                + "\n"
            )
            out.flush()
            tot[0] += s["heads"]
            tot[1] += s["viol"]
            tot[2] += s["slow"]
            if s["viol"]:
                print("VIOLATION", name, fam, s["examples"][:2], flush=True)
        print(f"{name}: heads {tot[0]} viol {tot[1]} slow steps {tot[2]} {time.time() - t0:.0f}s", flush=True)
