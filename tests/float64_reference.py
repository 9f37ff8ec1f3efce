"""The independent reference every soundness test compares with: exact softmax attention in float64."""

from __future__ import annotations

import math

import numpy as np


def attention_f64(q, k, v, lengths) -> np.ndarray:
    """Exact attention in float64: q [B, Hq, d], k, v [B, T, Hkv, d] (any float dtype, cast exactly), over the
    first lengths[b] tokens of row b (scale 1/sqrt(d); query head h reads KV head h // G). Independent of the
    library's math."""
    q = np.asarray(q).astype(np.float64)
    k = np.asarray(k).astype(np.float64)
    v = np.asarray(v).astype(np.float64)
    B, T, H, d = k.shape
    Hq = q.shape[1]
    G = Hq // H
    out = np.empty((B, Hq, d))
    for b in range(B):
        n = int(lengths[b])
        for h in range(Hq):
            s = k[b, :n, h // G] @ q[b, h] / math.sqrt(d)
            w = np.exp(s - np.max(s))
            out[b, h] = (w @ v[b, :n, h // G]) / np.sum(w)
    return out
