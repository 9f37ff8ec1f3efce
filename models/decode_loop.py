"""The decode loop's traced code: the loop over decode steps that `models.generate` compiles.

The loop's state is (step, cache, tok [B], done [B], out [B, capacity], key, records). `decode_loop` samples up to
max_new tokens from a prefilled cache, in one `lax.while_loop` ("plain": each step `forward_hidden`, with its
conditionals) or the "nested" loop (an inner loop of rung-0 first passes, rare steps left to the plain step). The
decode bridge (`models.generate.BridgedDecode`) compiles three programs of these pieces instead: `bridge_start`
(the state before the first step), `bridge_first_passes` (rung-0 first passes while they answer) and
`decode_loop_resumed` (the plain loop, or the "escalated" one, from a state). Everything here is traced, never run
eagerly; `TRACE_COUNTS` counts the traces (tests prove "compiles once" with it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from certattn_jax.kv_cache import KVCache
from models.config import LlamaConfig
from models.llama import Params, decode_first_pass, forward_hidden, logits_from_hidden
from models.sampling import select_next

# How many times each jitted function has been traced (tests use it to prove "compiles once").
TRACE_COUNTS: dict[str, int] = {"prefill_chunk": 0, "prefill_chunk_converted": 0, "decode_loop": 0,
                                  "decode_bridge": 0}

# What `out` holds at a step whose logits were not all finite (NaN / Inf: an activation overflow, or a row the model
# poisoned for bad input); the sequence stops there and `models.generate` raises `NonFiniteLogitsError` naming it.
NONFINITE_TOKEN = -2


def token_or_marker(nxt: jax.Array, logits: jax.Array, stops: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(what `out` records [B], whether the sequence ends [B]): -1 where it stops (EOS or already done),
    NONFINITE_TOKEN where its logits [B, V] hold a NaN / Inf (a token sampled from them would be garbage: argmax of
    NaN is token 0), else the token."""
    bad = ~jnp.all(jnp.isfinite(logits), axis=-1)
    return jnp.where(bad, NONFINITE_TOKEN, jnp.where(stops, -1, nxt)), stops | bad


def start_state(cache: KVCache, first_logits: jax.Array, eos_ids: jax.Array, key: jax.Array, temperature: jax.Array,
           top_p: jax.Array, *, greedy: bool, record: bool) -> tuple:
    """The decode loop's state before its first step, without the cache (which the caller adds: a program that
    returned it would copy it): (tok [B], done [B], out [B, capacity], key, records)."""
    B = first_logits.shape[0]
    cap = cache.capacity
    key, sub = jax.random.split(key)
    tok = select_next(first_logits, sub, greedy=greedy, temperature=temperature, top_p=top_p)
    first, done = token_or_marker(tok, first_logits, jnp.isin(tok, eos_ids))
    out = jnp.full((B, cap), -1, jnp.int32).at[:, 0].set(first)
    rec0 = cache.step_record()
    records = jax.tree.map(lambda x: jnp.zeros((cap,) + x.shape, x.dtype), rec0) if record else {}
    return tok, done, out, key, records


def live(state: tuple) -> jax.Array:
    """[B] int32: 1 for a sequence that takes this step's token into its cache, 0 for one that has stopped. A batch
    decodes on while any sequence is live; a stopped one's cache row stays as it stopped (its length, residual and
    running statistics), so the returned cache holds what the batch-1 run's would, and decoding can continue."""
    return (~state[3]).astype(jnp.int32)


def loop_parts(params: Params, config: LlamaConfig, max_new: jax.Array, eos_ids: jax.Array,
                temperature: jax.Array, top_p: jax.Array, greedy: bool, record: bool) -> tuple[Callable, ...]:
    """(cond, body, advance) of the decode loop over the state (step, cache, tok, done, out, key, records)."""
    pick = functools.partial(select_next, greedy=greedy, temperature=temperature, top_p=top_p)

    def cond(state):
        step, _, _, done, _, _, _ = state
        return (step + 1 < max_new) & ~jnp.all(done)

    def advance(state, hidden, cache):  # the step's token from its hidden state, written out; the loop's state
        step, _, _, done, out, key, records = state
        logits = logits_from_hidden(params, config, hidden[:, 0])
        key, sub = jax.random.split(key)
        nxt = pick(logits, sub)
        if record:
            records = jax.tree.map(lambda buf, r: buf.at[step].set(r), records, cache.step_record())
        written, ends = token_or_marker(nxt, logits, jnp.isin(nxt, eos_ids))
        out = out.at[:, step + 1].set(jnp.where(done, -1, written))
        return step + 1, cache, nxt, done | ends, out, key, records

    def body(state):
        return advance(state, *forward_hidden(params, config, state[2][:, None], state[1], live(state)))

    return cond, body, advance


def decode_loop(params: Params, cache: KVCache, first_logits: jax.Array,
                 max_new: jax.Array, eos_ids: jax.Array, key: jax.Array, temperature: jax.Array,
                 top_p: jax.Array, *, config: LlamaConfig, greedy: bool, record: bool, loop: str = "plain"):
    """Sample up to max_new tokens per sequence; stops early when every sequence has hit EOS.

    loop "nested" (a certified model cache, `decode_loop_kind`): while steps remain, an inner while loop runs
    steps' first passes (`models.llama.decode_first_pass`) as long as none needs its rare path (its predicate
    asks; the "adaptive" schedule also leaves it while it `wants_rung1_pass`); a step that does is undone there and
    taken by the plain step (`forward_hidden`, with its conditionals) in a second inner loop, which for "adaptive"
    goes on while the schedule wants rung 1. The same tokens, cache and records as "plain", with one host round
    trip per common step (the first inner loop's predicate) instead of the plain step's conditionals plus the
    loop's, and as many as the plain loop on the steps "adaptive" answers with rung 1 in its first pass.

    Returns (generated [B, capacity] int32 (-1 after EOS / past the end, NONFINITE_TOKEN = -2 where a step's
    logits held a NaN / Inf, the sequence finished there), finished [B], steps, cache, records) where records
    stacks `cache.step_record()` over decode steps ([capacity, ...] leaves).
    """
    TRACE_COUNTS["decode_loop"] += 1
    state = (jnp.int32(0), cache, *start_state(cache, first_logits, eos_ids, key, temperature, top_p, greedy=greedy,
                                          record=record))
    return outputs(resume(params, state, max_new, eos_ids, temperature, top_p, config=config, greedy=greedy,
                            record=record, loop=loop))


def outputs(state: tuple) -> tuple:
    """The decode loop's outputs (out, done, steps, cache, records) from its final state."""
    step, cache, _, done, out, _, records = state
    return out, done, step + 1, cache, records


def resume(params: Params, state: tuple, max_new: jax.Array, eos_ids: jax.Array, temperature: jax.Array,
            top_p: jax.Array, *, config: LlamaConfig, greedy: bool, record: bool, loop: str = "plain") -> tuple:
    """`decode_loop`'s loop from a state (step, cache, tok, done, out, key, records) on: the final state."""
    cond, body, advance = loop_parts(params, config, max_new, eos_ids, temperature, top_p, greedy, record)
    if loop == "nested":
        return _nested(cond, body, advance, state, params, config)
    if loop == "escalated":  # the steady bridge's: at least one step, then on until `adaptive_rung0_streak()` steps
        # in a row answered every head at rung 0 (`wants_rung1_pass` false: the "adaptive" schedule's predictor), so
        # that text which leaves rung 0 on most steps does not bounce between the two programs (each hand-back costs
        # a rung-0 pass that is redone and two program calls)
        def go(st):
            state, first = st
            return cond(state) & (first | state[1].wants_rung1_pass())

        return jax.lax.while_loop(go, lambda st: (body(st[0]), jnp.bool_(False)), (state, jnp.bool_(True)))[0]
    return jax.lax.while_loop(cond, body, state)


def bridge_start(cache: KVCache, first_logits: jax.Array, eos_ids: jax.Array, key: jax.Array,
                  temperature: jax.Array, top_p: jax.Array, *, greedy: bool, record: bool) -> tuple:
    """The decode bridge's first program: `start_state` (the cache only read for its shapes)."""
    TRACE_COUNTS["decode_bridge"] += 1
    return start_state(cache, first_logits, eos_ids, key, temperature, top_p, greedy=greedy, record=record)


def bridge_first_passes(params: Params, state: tuple, max_new: jax.Array, eos_ids: jax.Array,
                         temperature: jax.Array, top_p: jax.Array, *, config: LlamaConfig, greedy: bool,
                         record: bool, unrolled: bool | None = None) -> tuple[tuple, jax.Array]:
    """The decode bridge's loop: steps answered by a rung-0 first pass (`decode_first_pass(rung0=True)`) while
    one answers; it stops before the first step that needs more (undone: the whole step takes it) or when the
    loop is done. Returns (state, more): more is set when steps remain. Holds no rung above 0, no flush and no
    tier-2 transfer, so it compiles in a fraction of the whole step's time. unrolled: `decode_first_pass`'s."""
    TRACE_COUNTS["decode_bridge"] += 1
    cond, _, advance = loop_parts(params, config, max_new, eos_ids, temperature, top_p, greedy, record)

    def go(st):
        state, redo = st
        return cond(state) & ~redo

    first_pass = _first_pass_step(params, config, advance, rung0=True, unrolled=unrolled)
    state, _ = jax.lax.while_loop(go, first_pass, (state, jnp.bool_(False)))
    return state, cond(state)


def _first_pass_step(params: Params, config: LlamaConfig, advance: Callable, rung0: bool,
                     unrolled: bool | None = None) -> Callable:
    """A while-loop body over (state, redo): one step's first pass (`decode_first_pass`), the state advanced, or
    left as it was where the pass asks for a redo."""
    def first_pass(st):
        state, _ = st
        hidden, new_cache, redo = decode_first_pass(params, config, state[2][:, None], state[1], rung0=rung0,
                                                    unrolled=unrolled, valid_lengths=live(state))
        new = advance(state, hidden, new_cache)
        # a redo leaves step, token, done and key as they were (the cache is undone by decode_first_pass); what
        # it wrote at step + 1 (the token, the records) the step that redoes it writes again
        step, tok, done, key = (jax.lax.select(redo, state[i], new[i]) for i in (0, 2, 3, 5))
        return (step, new[1], tok, done, new[4], key, new[6]), redo

    return first_pass


def _nested(cond, body, advance, state, params, config):
    """`decode_loop`'s "nested" loop over the plain loop's (cond, body, state); advance(state, hidden, cache): the
    plain step after its forward pass."""
    adaptive = state[1].schedule == "adaptive"

    def first_passes_cond(st):
        state, redo = st
        go = cond(state) & ~redo
        return go & ~state[1].wants_rung1_pass() if adaptive else go

    first_pass = _first_pass_step(params, config, advance, rung0=False)

    def plain_steps_cond(st):  # the step the first passes left, and for "adaptive" those that want rung 1
        state, first = st
        go = cond(state) & first
        return go | (cond(state) & state[1].wants_rung1_pass()) if adaptive else go

    def plain_step(st):
        return body(st[0]), jnp.bool_(False)

    def outer(state):
        state, _ = jax.lax.while_loop(first_passes_cond, first_pass, (state, jnp.bool_(False)))
        state, _ = jax.lax.while_loop(plain_steps_cond, plain_step, (state, jnp.bool_(True)))
        return state

    return jax.lax.while_loop(cond, outer, state)


def decode_loop_resumed(params: Params, state: tuple, max_new: jax.Array, eos_ids: jax.Array,
                         temperature: jax.Array, top_p: jax.Array, *, config: LlamaConfig, greedy: bool,
                         record: bool, loop: str = "plain"):
    """The decode bridge's whole program: `resume`, the final state (named for the decode loop it is, in
    profiles)."""
    TRACE_COUNTS["decode_loop"] += 1
    return resume(params, state, max_new, eos_ids, temperature, top_p, config=config, greedy=greedy,
                   record=record, loop=loop)
