"""A model plus the cache modes under test, with one fixed cache capacity and prefill chunk for the whole run
(so each mode's prefill, teacher-forced and greedy loops compile once and are reused by every experiment).

A `Mode` is a label, a cache variant (`decode.VARIANTS`) and a `CertPolicy`. Tiered modes are audited by
default: every decode step's records stream into that mode's `AuditCollector`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax.evals import decode
from certattn_jax.evals.audit import AuditCollector
from certattn_jax.policy import CertPolicy
from models.decode_loop import NONFINITE_TOKEN
from models.generate import check_params


@dataclasses.dataclass(frozen=True)
class Mode:
    label: str
    variant: str
    policy: CertPolicy = dataclasses.field(default_factory=CertPolicy)

    def __post_init__(self) -> None:
        if self.variant not in decode.VARIANTS:
            raise ValueError(f"unknown cache variant {self.variant!r}; choose from {decode.VARIANTS}")

    @property
    def tiered(self) -> bool:
        return self.variant not in decode.EXACT_VARIANTS


class Session:
    """params/config/tokenizer of one model, the capacity (tokens) and prefill chunk of every cache."""

    def __init__(self, params: Any, config: Any, tokenizer: Any, capacity: int, chunk: int = 256,
                 audit: bool = True, audit_log: Any = None):
        if capacity % chunk:
            raise ValueError(f"capacity {capacity} must be a multiple of the prefill chunk {chunk}")
        # as `generate` does: params that do not match the config, hold NaN / Inf or carry a stale stacked copy
        # of the layers would give garbage tokens rather than fail
        check_params(params, config)
        self.params, self.config, self.tokenizer = params, config, tokenizer
        self.capacity, self.chunk, self.audit = capacity, chunk, audit
        self.audit_log = audit_log
        self.collectors: dict[str, AuditCollector] = {}
        self.runs = 0

    def collector(self, mode: Mode) -> AuditCollector:
        if mode.label not in self.collectors:
            self.collectors[mode.label] = AuditCollector(self.config.num_layers, log=self.audit_log
                                                         if mode.variant == "certified" else None)
        return self.collectors[mode.label]

    def _check_ids(self, ids: np.ndarray) -> None:
        """A token id outside the vocabulary (a tokenizer that does not match the model) named as such: the
        embedding lookup would clip it and the run fail later as "non-finite logits" or score nonsense."""
        vocab = self.config.vocab_size
        if len(ids) and (int(np.min(ids)) < 0 or int(np.max(ids)) >= vocab):
            raise ValueError(f"token ids outside [0, {vocab}): the tokenizer does not match the model's vocabulary")

    def _start(self, mode: Mode, ids: np.ndarray, extra: int):
        if len(ids) + extra > self.capacity:
            raise ValueError(f"{len(ids)} prompt tokens + {extra} decode steps exceed the session's cache "
                             f"capacity {self.capacity}; raise --capacity")
        audit = self.audit and mode.tiered
        cache = decode.make_cache(mode.variant, self.params, self.config, self.capacity, mode.policy, audit=audit)
        self.runs += 1
        sink = self.collector(mode) if (audit or mode.variant == "certified") else None
        if isinstance(sink, AuditCollector):
            sink.run = f"{mode.label}#{self.runs}"
        decode.set_sink(sink)
        cache, logits = decode.prefill(self.params, self.config, cache, ids, self.chunk)
        return decode.for_decode(mode.variant, cache), logits

    def nll(self, mode: Mode, ids: Sequence[int], prefix: int) -> tuple[np.ndarray, np.ndarray]:
        """Prefill ids[:prefix], then teacher-force ids[prefix:-1] through decode steps. Returns the
        negative log-likelihoods [len(ids) - prefix - 1] of ids[prefix+1:] and whether each was the argmax."""
        ids = np.asarray(ids, np.int32)
        if not 0 < prefix < len(ids) - 1:
            raise ValueError(f"need 0 < prefix < len(ids) - 1, got prefix {prefix} for {len(ids)} tokens")
        self._check_ids(ids)  # the prompt and the teacher-forced targets
        cache, _ = self._start(mode, ids[:prefix], len(ids) - prefix)
        nll, ok, cache = decode.teacher_forced(self.params, self.config, cache, jnp.asarray(ids[None, prefix:-1]),
                                               jnp.asarray(ids[None, prefix + 1:]), stream=True)
        nll, ok = np.asarray(nll[0]), np.asarray(ok[0])
        jax.effects_barrier()
        decode.set_sink(None)
        if not np.all(np.isfinite(nll)):
            step = int(np.argmin(np.isfinite(nll)))
            raise ValueError(f"non-finite logits (NaN or Inf) at teacher-forced step {step}: the model's "
                             "activations overflowed")
        return nll, ok

    def generate(self, mode: Mode, ids: Sequence[int], num_steps: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation of ids: num_steps tokens (cut before the first stop id)."""
        ids = np.asarray(ids, np.int32)
        self._check_ids(ids)
        cache, logits = self._start(mode, ids, num_steps)
        toks, cache = decode.greedy(self.params, self.config, cache, logits, num_steps, stream=True)
        toks = np.asarray(toks[0]).tolist()
        jax.effects_barrier()
        decode.set_sink(None)
        if NONFINITE_TOKEN in toks:
            raise ValueError(f"non-finite logits (NaN or Inf) at generated token {toks.index(NONFINITE_TOKEN)}:"
                             " the model's activations overflowed")
        for i, t in enumerate(toks):
            if t in stop_ids:
                return toks[:i]
        return toks

    def audit_summaries(self) -> dict[str, Any]:
        return {label: c.summary() for label, c in self.collectors.items()}
