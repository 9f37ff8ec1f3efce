# ruff: noqa: E402  (the sys.path setup above the imports: run as a script from anywhere)
"""Thirtieth-session soundness audit probe (docs/performance.md, thirtieth session); see README.md here."""

import os as _os
import sys as _sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_ROOT = _os.path.abspath(_os.path.join(_HERE, "..", "..", ".."))
for _p in (_ROOT, _os.path.join(_ROOT, "tests"), _os.path.join(_ROOT, "scripts", "soundness_probe"), _HERE):
    if _p not in _sys.path:
        _sys.path.insert(0, _p)
# model_audit.run with the nested loop's first pass: rung-0 fast pass; if rare (slow or maintenance), undo_step and
# redo with the whole ladder from the undone cache (as models.llama.decode_first_pass + forward_hidden do)
import functools

import jax
import model_audit


@functools.partial(jax.jit, static_argnames=("top",))
def fast_pass(cache, q, k, v, top):
    nl = cache.lengths + 1
    outs, c = model_audit.layers_loop(cache.decode_fast_path(0), q, k, v, nl)
    c = c.fast_pass_result()
    redo = c.needs_slow_path() | c.maintenance_due(nl)
    done = c.fast_path_done().with_lengths(nl, maintain=False).undo_step(redo, cache)
    return outs, done, redo


@jax.jit
def slow_pass(cache, q, k, v):
    nl = cache.lengths + 1
    outs, c = model_audit.layers_loop(cache, q, k, v, nl)
    return outs, c.slow_path_done().with_lengths(nl)


state = {}


def fp(cache, q, k, v, top):
    outs, done, redo = fast_pass(cache, q, k, v, top)
    state["done"] = done
    return outs, done, redo


def sp(cache, q, k, v):
    return slow_pass(state["done"], q, k, v)  # redo from the undone cache, not the original


def finish(c_fast, nl):
    return c_fast


model_audit.fast_pass = fp
model_audit.slow_pass = sp
model_audit.finish_fast = finish
