"""Probe 1-2: does models.sampling.select_next sample from the distribution transformers defines
(TemperatureLogitsWarper then TopPLogitsWarper, softmax), and does greedy break ties like argmax?

For each crafted logits row: N i.i.d. draws (the row tiled N times, one key: every row gets its own Gumbel noise;
plus, for a few cases, N separate seeds of a [1, V] call), compared with
  ref_hf : softmax(HF-warped scores) computed in float64 from transformers' own warpers (torch float32 masks),
  ref_ex : the exact float64 definition: softmax(logits/T) restricted to the smallest prefix of the descending
           order whose mass >= p (ties broken by lower index first), renormalised.
Reports the chi-square p-value against each reference (cells with expected < 5 merged), the draws that fall
outside each reference's support, and the total-variation distance between the empirical and the references.
"""
import math
import sys

import torch
from common import jax, jnp, np  # noqa: F401  (sets the CPU environment first)
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from models.sampling import select_next

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20000


def hf_probs(logits: np.ndarray, T: float, p: float) -> np.ndarray:
    s = torch.tensor(np.asarray(logits, np.float32)[None, :])
    s = TemperatureLogitsWarper(T)(None, s)
    if p < 1.0:  # transformers' generate adds TopPLogitsWarper only for top_p < 1.0
        s = TopPLogitsWarper(p)(None, s)
    keep = torch.isfinite(s)[0].numpy()
    x = np.asarray(logits, np.float64) / T
    x = np.where(keep, x, -np.inf)
    x = x - x[np.isfinite(x)].max()
    e = np.exp(x)
    return e / e.sum()


def exact_probs(logits: np.ndarray, T: float, p: float) -> np.ndarray:
    x = np.asarray(logits, np.float64) / T
    order = np.argsort(-x, kind="stable")
    fin = np.isfinite(x)
    e = np.where(fin, np.exp(x - x[fin].max()), 0.0)
    pr = e / e.sum()
    cum = np.cumsum(pr[order])
    k = int(np.searchsorted(cum, p - 1e-15)) + 1  # smallest prefix with mass >= p
    keep = np.zeros_like(fin)
    keep[order[:k]] = True
    q = np.where(keep, pr, 0.0)
    return q / q.sum()


def replica_keep(logits, T, p):
    """select_next's own keep mask, recomputed with its exact lines (a replica, for the support count)."""
    lg = jnp.asarray(logits)[None, :]
    scaled = lg / jnp.maximum(jnp.float32(T), 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    sl = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sl, axis=-1)
    mb = jnp.cumsum(probs, axis=-1) - probs
    keep = (mb < jnp.float32(p)).at[:, 0].set(True)
    out = np.zeros(lg.shape[1], bool)
    out[np.asarray(order[0])[np.asarray(keep[0])]] = True
    return out & np.isfinite(np.asarray(logits, np.float64))


@jax.jit
def _draw_rows(logits_rows, key, T, p):
    return select_next(logits_rows, key, greedy=False, temperature=T, top_p=p)


def _draw_tiled(logits_row, key, T, p):
    """N draws: the row tiled into chunks of at most ~4M elements (one key per chunk, split from `key`)."""
    V = logits_row.shape[0]
    ch = max(1, min(N, 4_000_000 // V))
    rows = jnp.tile(logits_row[None, :], (ch, 1))
    out, k = [], key
    for start in range(0, N, ch):
        k, sub = jax.random.split(k)
        out.append(np.asarray(_draw_rows(rows, sub, T, p))[: N - start])
    return np.concatenate(out)


@jax.jit
def _draw_seeds(logits_row, seeds, T, p):
    return jax.vmap(lambda s: select_next(logits_row[None, :], jax.random.key(s), greedy=False, temperature=T,
                                          top_p=p)[0])(seeds)


def chi2(counts, probs):
    exp = probs * counts.sum()
    outside = int(counts[probs == 0].sum())
    big = exp >= 5
    obs_c, exp_c = list(counts[big]), list(exp[big])
    rest_o, rest_e = counts[~big & (probs > 0)].sum(), exp[~big & (probs > 0)].sum()
    if rest_e > 0:
        obs_c.append(rest_o)
        exp_c.append(rest_e)
    obs_c, exp_c = np.array(obs_c, float), np.array(exp_c, float)
    if len(obs_c) < 2:
        return float("nan"), outside
    # the outside draws are counted in no cell: scale expected to the inside total
    exp_c = exp_c * obs_c.sum() / exp_c.sum()
    return float(stats.chisquare(obs_c, exp_c).pvalue), outside


def case(name, logits, T, p, seeds=False, dtype=jnp.float32):
    logits = np.asarray(logits, np.float64)
    V = logits.size
    lj = jnp.asarray(logits, dtype)
    used = np.asarray(lj.astype(jnp.float32), np.float64)  # what the function actually sees
    try:
        toks = np.asarray(_draw_tiled(lj, jax.random.key(12345), jnp.float32(T), jnp.float32(p)))
        if seeds:
            toks_s = np.asarray(_draw_seeds(lj, jnp.arange(N), jnp.float32(T), jnp.float32(p)))
    except Exception as e:  # noqa: BLE001
        print(f"{name}: RAISED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return
    counts = np.bincount(toks, minlength=V)[:V].astype(float)
    bad_idx = int(((toks < 0) | (toks >= V)).sum())
    ref_hf, ref_ex = hf_probs(used, T, p), exact_probs(used, T, p)
    emp = counts / max(counts.sum(), 1)
    p_hf, out_hf = chi2(counts, ref_hf)
    p_ex, out_ex = chi2(counts, ref_ex)
    keep = replica_keep(used.astype(np.float32), T, p)
    sup = dict(impl=int(keep.sum()), hf=int((ref_hf > 0).sum()), exact=int((ref_ex > 0).sum()))
    lost_hf = float(ref_hf[~keep].sum())  # reference mass on tokens select_next can never draw
    extra_hf = float(ref_ex[keep & (ref_hf == 0)].sum())
    flag = ""
    if min(p_hf if not math.isnan(p_hf) else 1, 1) < 1e-3 or out_hf or bad_idx or sup["impl"] != sup["hf"]:
        flag = "  <-- differs from HF"
    print(f"{name}: V={V} T={T:g} p={p:g} dtype={jnp.dtype(dtype).name} | chi2 p HF={p_hf:.3g} exact={p_ex:.3g} | "
          f"draws outside support HF={out_hf} exact={out_ex} invalid ids={bad_idx} | support sizes {sup} | "
          f"HF mass never drawable={lost_hf:.3g} | TV(emp,HF)={0.5*np.abs(emp-ref_hf).sum():.4f}{flag}")
    if V <= 12:
        print(f"    empirical {np.round(emp, 4).tolist()}\n    HF        {np.round(ref_hf, 4).tolist()}\n"
              f"    exact     {np.round(ref_ex, 4).tolist()}")
    if seeds:
        cs = np.bincount(toks_s, minlength=V)[:V].astype(float)
        ps, os_ = chi2(cs, ref_hf)
        print(f"    per-seed draws ([1,V] per seed, seeds 0..{N-1}): chi2 p HF={ps:.3g} outside={os_}")
    return counts, ref_hf, ref_ex


print(f"jax {jax.__version__}, N={N} draws per case")
rng = np.random.default_rng(0)
e = math.e
# 1. a dominant token
case("dominant", [12.0, 0.0, 0.0, 1.0, -1.0, 0.5, 0.2], 1.0, 0.9, seeds=True)
case("dominant p=1", [6.0, 0.0, 0.0, 1.0, -1.0, 0.5, 0.2], 1.0, 1.0, seeds=True)
# 2. ties at the nucleus boundary: probs ~ [e^2, e, e, e, 1]; p between top + 1 tie and top + 2 ties
lt = np.array([2.0, 1.0, 1.0, 1.0, 0.0])
pr = np.exp(lt) / np.exp(lt).sum()
case("tie boundary (1.5 ties)", lt, 1.0, float(pr[0] + 1.5 * pr[1]))
case("tie boundary (top+0.5 tie)", lt, 1.0, float(pr[0] + 0.5 * pr[1]))
case("tie at top (2 equal max)", [1.0, 3.0, 3.0, 0.0], 1.0, 0.3)
# exactly at a boundary: mass_before == p exactly (powers of two)
lt2 = np.log(np.array([0.5, 0.25, 0.125, 0.125]))
case("boundary exactly p=0.75", lt2, 1.0, 0.75)
case("boundary exactly p=0.5", lt2, 1.0, 0.5)
# 3. p very small / p = 1
case("p=1e-6", rng.normal(size=11) * 2, 1.0, 1e-6)
case("p=1 random V=11", rng.normal(size=11) * 2, 1.0, 1.0, seeds=True)
# 4. temperature extremes
lt3 = np.array([1.0, 1.0 - 5e-5, 1.0 - 1e-4, 1.0 - 3e-4, 0.0])
case("T=1e-4 close logits", lt3, 1e-4, 1.0)
case("T=1e-4 close logits p=0.5", lt3, 1e-4, 0.5)
case("T=1e-7 (below the 1e-6 clamp)", [0.0, -1e-6, -2e-6, -1.0], 1e-7, 1.0)
case("T=1e4", rng.normal(size=10) * 3, 1e4, 1.0)
case("T=1e4 p=0.5", rng.normal(size=10) * 3, 1e4, 0.5)
# 5. -inf entries
case("-inf entries p=1", [-np.inf, 1.0, -np.inf, 0.5, 0.0, -np.inf], 1.0, 1.0)
case("-inf entries p=0.6", [-np.inf, 1.0, -np.inf, 0.5, 0.0, -np.inf], 0.7, 0.6)
case("single finite", [-np.inf, -np.inf, 3.0, -np.inf], 1.0, 0.9)
# 6. odd vocab sizes, random logits
for V in (37, 97, 1009):
    case(f"random V={V}", rng.normal(size=V) * 2.5, 0.7, 0.8)
# 7. bf16 logits
case("bf16 logits", rng.normal(size=37) * 3, 0.9, 0.9, dtype=jnp.bfloat16)
case("bf16 logits with ties (bf16 rounding)", np.array([2.0, 2.001, 2.002, 1.0, 0.0]), 1.0, 0.5, dtype=jnp.bfloat16)
# 8. larger vocab (SmolLM2 size), realistic spread
big = rng.normal(size=49152) * 2.0
case("V=49152 T=1 p=0.9", big, 1.0, 0.9)
case("V=49152 T=1 p=1", big, 1.0, 1.0)
case("V=49152 uniform T=1 p=1", np.zeros(49152), 1.0, 1.0)
case("V=49152 uniform T=1 p=0.99", np.zeros(49152), 1.0, 0.99)
