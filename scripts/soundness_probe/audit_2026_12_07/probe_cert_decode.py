"""Probe A2: probe_cert's per-head field checks along token-by-token decoding (flush -> write_token -> certified
attention, jitted with the cache donated), so that the hot set is filled by flushes (`_keep_resident`) and rung 1,
across flush boundaries, with ragged rows (one of length 1), GQA 1 and 8, and a cache with more hot slots than
the policy's k_max (hot_slots = 2 k_max, and a later policy with a smaller k_max).

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07/probe_cert_decode.py
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import PATH, Tally, hot_set_consistent  # noqa: E402
from probe_cert import check_step, draw  # noqa: E402

from certattn_jax import step as step_mod  # noqa: E402
from certattn_jax.attention import certified_attention_step  # noqa: E402
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402


@functools.partial(jax.jit, donate_argnums=0)
def write(cache, k, v):
    return cache.flush().write_token(k, v)


attend = jax.jit(certified_attention_step)

CASES = {
    # name: (B, H, G, d, prefix lengths, steps, capacity, layout, policy overrides)
    "ragged": (3, 2, 2, 16, [20, 1, 33], 30, 80, dict(block_size=16, group_size=16, k_max=2, v_max=2), {}),
    "gqa8": (1, 1, 8, 16, [40], 40, 96, dict(block_size=16, group_size=16, k_max=2, v_max=2), {}),
    "gqa1": (2, 3, 1, 16, [16, 47], 34, 96, dict(block_size=16, group_size=8, k_max=2, v_max=2), {}),
    "hot4": (2, 2, 2, 16, [50, 9], 40, 112, dict(block_size=16, group_size=16, k_max=2, v_max=2, hot_slots=4), {}),
    "hot4_kmax1": (2, 2, 2, 16, [50, 9], 40, 112, dict(block_size=16, group_size=16, k_max=2, v_max=2, hot_slots=4),
                   dict(k_max=1)),
    "tight": (2, 2, 2, 16, [40, 5], 30, 80, dict(block_size=16, group_size=16, k_max=2, v_max=2), dict(eps=3e-3)),
    "tighter": (2, 2, 2, 16, [40, 5], 30, 80, dict(block_size=16, group_size=16, k_max=2, v_max=2), dict(eps=2e-4)),
    "full": (2, 2, 2, 16, [40, 24], 24, 64, dict(block_size=16, group_size=16, k_max=2, v_max=2), {}),
    "exact3": (2, 2, 2, 16, [40, 5], 20, 80, dict(block_size=16, group_size=16, k_max=2, v_max=2),
               dict(eps=0.0, layer_fallback_fraction=2.0)),
}
FAMS = ("gauss", "peaked", "one_block", "ties")


def main():
    t0 = time.time()
    out = []
    only = sys.argv[1:]
    for ci, (name, (B, H, G, d, L0, steps, cap, layout, over)) in enumerate(CASES.items()):
        if only and name not in only:
            continue
        t = Tally(f"decode/{name}")
        t.pinned = [0, 0]
        for fi, fam in enumerate(FAMS):
            rng = np.random.default_rng(77 + 10 * ci + fi)
            L0a = np.asarray(L0)
            T = int(L0a.max()) + steps
            k, v, q = draw(rng, fam, B, T, H, G, d, layout["block_size"])
            qs = q[None] + 0.3 * rng.standard_normal((steps, B, H * G, d)).astype(np.float32)
            base = CertPolicy(**layout)
            pol = base.replace(**over) if over else base
            pre_k = np.zeros((B, int(L0a.max()), H, d), np.float32)
            pre_v = np.zeros_like(pre_k)
            # row b: tokens [0, L0[b]) of its own, then the decoded tokens P + t (P = max L0) as in audit2
            P = int(L0a.max())
            for b in range(B):
                pre_k[b, :L0a[b]] = k[b, :L0a[b]]
                pre_v[b, :L0a[b]] = v[b, :L0a[b]]
            cache = TieredKVCache.from_dense(jnp.asarray(pre_k), jnp.asarray(pre_v), policy=base, capacity=cap,
                                             lengths=jnp.asarray(L0a, jnp.int32))
            if fi == 0:
                print(name, "fused rung 0:", step_mod.uses_fused_rung0(cache, pol), flush=True)
            t.cases += 1
            for s in range(steps):
                cache = write(cache, jnp.asarray(k[:, P + s:P + s + 1]), jnp.asarray(v[:, P + s:P + s + 1]))
                lens = L0a + s + 1
                Kr = np.zeros((B, int(lens.max()), H, d))
                Vr = np.zeros_like(Kr)
                for b in range(B):
                    Kr[b, :L0a[b]] = k[b, :L0a[b]]
                    Vr[b, :L0a[b]] = v[b, :L0a[b]]
                    Kr[b, L0a[b]:lens[b]] = k[b, P:P + s + 1]
                    Vr[b, L0a[b]:lens[b]] = v[b, P:P + s + 1]
                qj = jnp.asarray(qs[s])
                o, cert, new = attend(qj, cache, pol)
                tag = f"{name}/{fam}/step{s}"
                check_step(t, tag, qj, cache, new, o, cert, pol, Kr, Vr, lens, 0)
                hot_set_consistent(t, tag, new, Kr, Vr)
                cache = new
        print(t.summary(), "k* pinned:", t.pinned, f"{time.time() - t0:.0f}s", flush=True)
        out.append(t.summary() + f" k* pinned: {t.pinned}")
    print("=== SUMMARY", PATH)
    print("\n".join(out))


if __name__ == "__main__":
    main()
