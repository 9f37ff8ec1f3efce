"""Certificate: what certified attention proves about each query head's output, as a pytree."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

RUNG_NAMES = ("certified", "widened K*", "exact values", "exact head", "exact layer")


@struct.dataclass
class Certificate:
    """Per query head, leaves [B, Hq] (stacked [L, B, Hq] or [steps, L, B, Hq] by the model / decode loop).

    error_bound: proven bound on ||o_returned - o_exact||_2 against exact attention over the tier-2 originals
                 (= e_key + e_val + e_num; +inf when nothing can be proven, e.g. NaN/Inf in the cache).
    e_key, e_val, e_num: the key (softmax perturbation), value (quantization) and floating-point terms.
    tolerance:   eps * value_scale + abs_tol for this head (see CertPolicy), value_scale a lower bound of the
                 norm of the stored values' per-channel range (`bounds.tolerance_range`).
    k_star:      number of blocks attended with exact keys (and values).
    rung:        0 = certified as is, 1 = widened K*, 2 = exact values promoted, 3 = exact dense for the head,
                 4 = exact dense for the whole layer; -1 = no step of this sequence (`models.generate`'s records
                 after a sequence stopped while the batch decoded on: `mark_stopped`, whose other fields are NaN,
                 -1 and False; `summarize` leaves them out).
    ranking_ok:  the INT8 block ranking agreed with the exact one on promoted blocks (and no tail block could
                 outrank them) at the rung used (True for the exact rungs 3 and 4).
    certified:   error_bound <= tolerance and error_bound is finite (an infinite tolerance certifies nothing).
    """

    error_bound: jax.Array
    e_key: jax.Array
    e_val: jax.Array
    e_num: jax.Array
    tolerance: jax.Array
    k_star: jax.Array
    rung: jax.Array
    ranking_ok: jax.Array
    certified: jax.Array


def summarize(cert: Certificate) -> dict[str, Any]:
    """Plain-Python summary of any stack of certificates (all leading axes pooled; the entries of stopped sequences,
    rung -1, left out: "heads" counts the rest, "stopped" those left out)."""
    rung_all = np.asarray(cert.rung).reshape(-1)
    live = rung_all >= 0
    rung = rung_all[live]
    stopped = int(rung_all.size - rung.size)
    if rung.size == 0:
        return {"heads": 0, "stopped": stopped}

    def pooled(x, dtype=None):
        return np.asarray(x, dtype).reshape(-1)[live]

    k_star = pooled(cert.k_star)
    bound = pooled(cert.error_bound, np.float64)
    return {
        "heads": int(rung.size),
        "stopped": stopped,
        "rung_histogram": {str(r): int(np.sum(rung == r)) for r in range(5)},
        "mean_k_star": float(k_star.mean()),
        "max_k_star": int(k_star.max()),
        "max_error_bound": float(bound.max()),
        "mean_error_bound": float(bound[np.isfinite(bound)].mean()) if np.isfinite(bound).any() else float("inf"),
        "fraction_certified_without_escalation": float(np.mean(rung == 0)),
        "fraction_certified": float(np.mean(pooled(cert.certified))),
        "fraction_ranking_ok": float(np.mean(pooled(cert.ranking_ok))),
    }


def mark_stopped(cert: Certificate, live: np.ndarray) -> Certificate:
    """A decode loop's stacked certificates (NumPy leaves [steps, L, B, Hq]) with the entries where live [steps, B]
    is False marked "no step": rung and k_star -1, the bounds and tolerance NaN, the flags False. Such a step's query
    was a token after the sequence's stop (which its cache never took): nothing of the sequence's output."""
    dead = ~np.asarray(live, bool)[:, None, :, None]  # [steps, 1, B, 1]

    def mark(x, value):
        x = np.asarray(x)
        return np.where(dead, np.asarray(value, x.dtype), x)

    values = {f: (-1 if f in _INT_FIELDS else False if f in _BOOL_FIELDS else np.nan) for f in PACKED_FIELDS}
    return Certificate(**{f: mark(getattr(cert, f), values[f]) for f in PACKED_FIELDS})


def empty_like_heads(batch: int, heads: int) -> Certificate:
    z = jnp.zeros((batch, heads), jnp.float32)
    i = jnp.zeros((batch, heads), jnp.int32)
    b = jnp.zeros((batch, heads), bool)
    return Certificate(error_bound=z, e_key=z, e_val=z, e_num=z, tolerance=z, k_star=i, rung=i, ranking_ok=b,
                       certified=b)


# The packed form: one float32 array [..., len(PACKED_FIELDS)] holding a Certificate's leaves (the integer and
# boolean leaves are small integers, exact in float32). A model cache records each layer's certificate with
# one write of this array instead of one write per leaf (docs/performance.md: each write is a kernel launch).
PACKED_FIELDS = tuple(f.name for f in Certificate.__dataclass_fields__.values())
_INT_FIELDS = ("k_star", "rung")
_BOOL_FIELDS = ("ranking_ok", "certified")


def pack(cert: Certificate) -> jax.Array:
    """[..., 9] float32 from a Certificate with leaves [...] (exact: rung and k_star < 2^24, booleans 0/1)."""
    return jnp.stack([getattr(cert, f).astype(jnp.float32) for f in PACKED_FIELDS], axis=-1)


def unpack(packed: jax.Array) -> Certificate:
    """The Certificate (leaves [...]) of `pack`'s [..., 9] float32 array."""
    leaves = {}
    for i, f in enumerate(PACKED_FIELDS):
        x = packed[..., i]
        leaves[f] = x.astype(jnp.int32) if f in _INT_FIELDS else (x > 0.5) if f in _BOOL_FIELDS else x
    return Certificate(**leaves)
