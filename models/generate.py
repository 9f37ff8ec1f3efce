"""Text generation: chunked prefill, then the whole decode loop inside one jit (`lax.while_loop`).

    out = generate(params, config, [prompt_ids_1, prompt_ids_2], max_new_tokens=64)

Prompts of different lengths are right-padded; each sequence continues from its own length. The
prefill runs chunk by chunk (each chunk a call of one compiled function, so a 32K prompt needs
chunk x capacity attention memory, never T x T) with a progress bar. The decode loop's shapes depend
only on the batch and the cache capacity (rounded up to `CAPACITY_BUCKET`), never on
`max_new_tokens`, so asking for more tokens does not recompile.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax import kernel_checks, xla_options
from certattn_jax.cache import conversion_temp_bytes
from certattn_jax.certificate import Certificate, mark_stopped
from certattn_jax.env import choice_from_env, switch_from_env
from certattn_jax.kv_cache import KVCache, commit_arrays, committed_jit, was_donated
from certattn_jax.model_cache import CacheSpec, cache_spec
from certattn_jax.validate import is_finite_number, is_integer
from models.config import LlamaConfig
from models.decode_loop import (
    NONFINITE_TOKEN,
    TRACE_COUNTS,
    bridge_first_passes,
    bridge_start,
    decode_loop,
    decode_loop_resumed,
    outputs,
)
from models.llama import (
    Params,
    first_pass_mode,
    forward_hidden,
    has_decode_first_pass,
    has_rung0_first_pass,
    logits_from_hidden,
    params_for_decoding,
)
from models.params import STACKED_LAYERS, nonfinite_parameter, stale_stacked_layers, unfused_shapes, validate_params
from models.sampling import key_from_seed

CAPACITY_BUCKET = 256

CacheFactory = Callable[[int, int], KVCache]

# The certified decode loop's shape (`decode_loop.decode_loop`): "plain" (one while loop; each step asks its own
# rare-path conditionals, each a host round trip on a GPU) or "nested" (an inner loop of first passes whose own
# predicate also asks "is this step rare": no conditional on a common step, the rare ones leave the inner loop and are
# taken by the plain step). CERTATTN_DECODE_LOOP_NESTED=1 / 0 / auto (unset: auto = plain: on an H100, SmolLM2 1K, the
# nested loop decoded 5 % slower than the plain one although it waits for the device once per step instead of three
# times; docs/performance.md, twenty-third session; with control flow in the command buffers and the stacked LRU
# record, 334-345 against 561 tokens/s: its inner loop's kernels were then launched by the host one by one,
# twenty-seventh session).
DECODE_LOOPS = ("plain", "nested")


# How XLA records a GPU program's command buffers (CUDA graphs: where a decode step's launches run): "CONCURRENT"
# records each as a graph of its launches' data dependencies (independent launches may overlap), "SERIALIZE" as one
# chain (XLA's default). Measured on an H100 (SmolLM2 1K, docs/performance.md, twenty-third session): CONCURRENT
# decodes faster (dense +3 %, certified +6 %), so the decode loop asks for it. CERTATTN_COMMAND_BUFFER_SCHEDULING
# = CONCURRENT / SERIALIZE / xla (leave XLA's setting); an XLA_FLAGS that names the mode always wins.
COMMAND_BUFFER_SCHEDULING_MODES = ("CONCURRENT", "SERIALIZE", "xla")
_SCHEDULING_OPTION = "xla_gpu_command_buffer_scheduling_mode"


def command_buffer_scheduling(backend: str | None = None) -> str:
    """The command-buffer scheduling mode the decode loop compiles with on `backend` (default: JAX's default
    backend): one of COMMAND_BUFFER_SCHEDULING_MODES; "xla" off a GPU, or where XLA_FLAGS names the mode."""
    mode = choice_from_env("CERTATTN_COMMAND_BUFFER_SCHEDULING", COMMAND_BUFFER_SCHEDULING_MODES, "CONCURRENT")
    if (backend or jax.default_backend()) != "gpu" or _SCHEDULING_OPTION in os.environ.get("XLA_FLAGS", ""):
        return "xla"
    return mode


def decode_compiler_options(backend: str | None = None) -> dict[str, Any]:
    """XLA options the decode loop is compiled with (`jax.stages.Lowered.compile(compiler_options=...)`): the
    command-buffer scheduling mode and `certattn_jax.xla_options.compile_options` (the fusion autotuner, control
    flow in the command buffers)."""
    mode = command_buffer_scheduling(backend)
    return {**({} if mode == "xla" else {_SCHEDULING_OPTION: mode}), **xla_options.compile_options(backend, "decode")}


def _compile_with_options(lowered: Any, options: dict[str, str]) -> Any:
    """lowered.compile(compiler_options=options); an XLA that does not know one of the options (a renamed debug
    option in another jax release) compiles without them, with a warning, rather than not at all."""
    if not options:
        return lowered.compile()
    try:
        return lowered.compile(compiler_options=options)
    except Exception as e:  # noqa: BLE001 -- XLA's error type differs across jax releases
        if not any(name in str(e) for name in options):
            raise
        warnings.warn(f"XLA refused the decode loop's options {options} ({str(e).splitlines()[0][:200]}); "
                      "compiling without them", RuntimeWarning, stacklevel=3)
        return lowered.compile()


def decode_loop_kind(cache: Any) -> str:
    """The decode loop `generate` compiles for this cache (`DECODE_LOOPS`)."""
    nested = switch_from_env("CERTATTN_DECODE_LOOP_NESTED")
    return "nested" if nested and has_decode_first_pass(cache) else "plain"


@dataclasses.dataclass
class GenerationOutput:
    """tokens[i]: the new tokens of prompt i (stopping before EOS); finished[i]: it hit EOS.
    step_records: per-step cache diagnostics stacked over decode steps (certificates for the certified
    cache, leaves [num_steps - 1, L, B, Hq]: record s is the step that took tokens[i][s]; a sequence's entries
    after its stop are marked "no step", rung -1: `certificate.mark_stopped`); empty for the dense cache.
    cache: the cache after decoding; a sequence that stopped early stopped taking tokens there (it holds its
    prompt and tokens[i] with their statistics, as the batch-1 run's cache does; its hot set of exact blocks may
    differ, since its queries went on until the batch stopped), so decoding can continue from it.
    `cache.last_certificate` is the last step's, for every row (a stopped row's: of a step that was not its own)."""

    tokens: list[list[int]]
    finished: list[bool]
    prefill_seconds: float
    decode_seconds: float
    num_steps: int
    cache: Any
    compile_seconds: float = 0.0
    step_records: Any = None
    # seconds of decode_seconds spent waiting for the decode loop's whole program, still compiling in the background
    # when the decode bridge's first passes met a step they cannot answer (`decode_bridge`); compile_seconds is
    # then the first-pass program's compile
    compile_wait_seconds: float = 0.0

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_steps * len(self.tokens) / max(self.decode_seconds, 1e-9)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _prefill_chunk(params: Params, config: LlamaConfig, cache: KVCache, chunk: jax.Array,
                   valid: jax.Array, last_index: jax.Array, last_logits: jax.Array):
    """One prefill chunk [B, C]; keeps the logits at each prompt's last position (last_index in chunk)."""
    TRACE_COUNTS["prefill_chunk"] += 1
    return _prefill_chunk_body(params, config, cache, chunk, valid, last_index, last_logits)


def _prefill_chunk_body(params: Params, config: LlamaConfig, cache: KVCache, chunk: jax.Array,
                        valid: jax.Array, last_index: jax.Array, last_logits: jax.Array):
    hidden, cache = forward_hidden(params, config, chunk, cache, valid)
    C = chunk.shape[1]
    in_chunk = (last_index >= 0) & (last_index < C)
    rows = jnp.take_along_axis(hidden, jnp.clip(last_index, 0, C - 1)[:, None, None], axis=1)[:, 0]
    logits = logits_from_hidden(params, config, rows)
    return cache, jnp.where(in_chunk[:, None], logits, last_logits)


# (no donation: the staging cache's buffers fit none of the tiered cache's; they are freed when the program is done)
@functools.partial(jax.jit, static_argnames=("config", "spec"))
def _prefill_last_chunk_converted(params: Params, config: LlamaConfig, cache: KVCache, chunk: jax.Array,
                                  valid: jax.Array, last_index: jax.Array, last_logits: jax.Array,
                                  lengths: jax.Array, policy: Any, spec: CacheSpec):
    """`_prefill_chunk` of the prompts' last chunk, then the staging cache converted into the tiered cache in the same
    program (`CacheSpec.from_staging` traced: `TieredModelCache.from_dense`'s one batched program of every layer,
    the same values bit for bit as the eager conversion; lengths [B] the prompts' lengths as the host knows them,
    a sequence whose staging lengths differ poisoned). spec: the static layout (its policy None), policy the
    spec's policy (its tolerances may be arrays). Returns (tiered cache, last logits [B, V])."""
    TRACE_COUNTS["prefill_chunk_converted"] += 1
    cache, logits = _prefill_chunk_body(params, config, cache, chunk, valid, last_index, last_logits)
    return dataclasses.replace(spec, policy=policy).from_staging(cache, lengths=lengths), logits


# The tiered prefill's conversion inside its last chunk's program (CERTATTN_PREFILL_CONVERSION_IN_CHUNK = 1 / 0 /
# auto; auto: on a GPU). Where one conversion program takes every layer (`CacheSpec.converts_in_one_program`, e.g.
# SmolLM2), the staging cache is converted by the program of the prompts' last chunk: nothing runs on the host and
# nothing is dispatched between the prefill and the conversion. On a GPU the prefill of a small model is bound by
# the host (kernel launches), so the host's conversion work (checks, dispatches) and the conversion's device time
# were serial after it: SmolLM2's 1K prompt took 1.45x dense's time to first token (H100, thirty-eighth session).
# Off a GPU a multi-chunk prompt's second chunk program costs more compile time than the dispatch saves.
PREFILL_CONVERSION_IN_CHUNK = switch_from_env("CERTATTN_PREFILL_CONVERSION_IN_CHUNK")


def conversion_in_chunk(spec: CacheSpec | None, cache: Any) -> bool:
    """Whether `prefill` converts the staging `cache` inside its last chunk's program (see
    PREFILL_CONVERSION_IN_CHUNK)."""
    if spec is None or not spec.tiered:
        return False
    on = PREFILL_CONVERSION_IN_CHUNK
    if on is None:
        on = jax.default_backend() == "gpu"
    return bool(on) and spec.converts_in_one_program(cache)


_COMPILED: dict[Any, Any] = {}  # the decode loops: `decode_loop.decode_loop`, or the bridge's whole program
_BRIDGE_COMPILED: dict[Any, Any] = {}  # the decode bridge's start and first-pass programs
_PENDING: dict[Any, concurrent.futures.Future] = {}  # whole programs still compiling in the background
_DEFERRED: dict[Any, Callable[[], Any]] = {}  # whole programs to build when first needed (BRIDGE_BACKGROUND off)
_BACKGROUND = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="certattn-compile")
_BRIDGE_LOCK = threading.Lock()  # guards _PENDING and _DEFERRED (a program is looked up and started in one step)
# seconds of the last decode-loop build (`compiled_decode_loop`): "lower_s" tracing and lowering (the Pallas
# kernels to Triton IR included), "xla_compile_s" XLA's compile (the kernels' Triton compile and GEMM autotuning
# included), "started_at" its time.perf_counter() at the start; a build repeated after a failed self-check
# overwrites them. For the decode bridge these are its first-pass program's (what decoding waits for), and
# "full_lower_s", "full_xla_compile_s", "full_ready_at" (time.perf_counter() when it was ready) the whole program's
LAST_BUILD_SECONDS: dict[str, float] = {}

# The decode bridge (CERTATTN_DECODE_BRIDGE = 1 / 0 / auto; auto: on a GPU, where compiles are long and cores many). A
# certified decode step holds two kinds of code: the rung-0 pass that answers nearly every step, and the rarely taken
# rest (rungs 1-4, the block flush, the hot-set refresh, their tier-2 transfers), which is most of the compile (the
# second pass alone ~54 % of the 8B loop's, docs/performance.md, 2026-12-03). With the bridge the decode loop is
# compiled as two programs: a small one of rung-0 first passes (`decode_loop.bridge_first_passes`), which decoding
# waits for, and the whole loop (`decode_loop.resume`), compiled in a background thread meanwhile. Decoding starts
# with the first passes; at the first step they cannot answer (undone, as in the "nested" loop) it waits for the whole
# program if it is not ready yet; the steady bridge (below, the default) hands back to the first passes after the run
# of such steps, the other goes on with the whole program to the end (and a later call runs it alone). Every step is
# answered by the same code as without the bridge (`tests/test_e2e_cache.py`: tokens and integer leaves bit for bit,
# floats to their rounding: separately compiled programs may round a bound's sum differently). Off a GPU the two
# compiles would share two cores: off by default. docs/architecture.md "The decode bridge"; measured in
# docs/performance.md, twenty-eighth session.


# The steady bridge (CERTATTN_DECODE_BRIDGE_STEADY = 1 / 0 / auto; auto: on): the first passes stay the decode loop
# after the whole program is compiled too, and the whole program ("escalated" loop) takes only the runs of steps
# they leave: from such a step on, until `adaptive_rung0_streak()` steps in a row stayed at rung 0, then back to the
# first passes. A common step
# then waits for the device once (the first-pass loop's predicate, as dense's loop), a run of rare ones a few
# times more. Measured on an H100 (twenty-eighth session, call C): against the one program, SmolLM2 1K 557.6
# against 563.1 tokens/s, 4K 487.2 against 470.9, 8B 8K 104.0 against 93.5 (108.7 with the layers read stacked
# by the kernel). (The non-steady bridge's rows read 13-26 % slower: most likely the whole program's first
# execution inside the timed run, a constant ~30-50 ms, docs/performance.md.)
BRIDGE_STEADY: bool = switch_from_env("CERTATTN_DECODE_BRIDGE_STEADY") is not False
# CERTATTN_DECODE_BRIDGE_BACKGROUND=0 (a diagnosis knob; auto = on): the whole program is compiled in the decoding
# thread when a step first needs it, instead of in the background from the start (to rule the thread out as the
# cause of the non-steady bridge's slower rows, docs/performance.md twenty-eighth session)
BRIDGE_BACKGROUND: bool = switch_from_env("CERTATTN_DECODE_BRIDGE_BACKGROUND") is not False
# While the unrolled first passes compile (CERTATTN_FIRST_PASS_UNROLLED=background), the looped ones run at most this
# many steps per call before the host looks whether the unrolled ones are ready (a host round trip each time).
UPGRADE_POLL_STEPS = 16


def decode_bridge(cache: Any) -> bool:
    """Whether `generate` bridges this cache's decode loop (see above): a certified model cache whose schedule
    has a rung-0 first pass (`models.llama.BRIDGE_SCHEDULES`), on a GPU unless CERTATTN_DECODE_BRIDGE says."""
    on = switch_from_env("CERTATTN_DECODE_BRIDGE")
    if on is None:
        on = jax.default_backend() == "gpu"
    # with hot_refresh="prefetch" rung 0 itself asks for hot-set blocks on every step, so every first pass would be
    # undone and redone (found by review): no bridge there
    prefetch = getattr(getattr(cache, "policy", None), "hot_refresh", None) == "prefetch"
    return bool(on) and has_rung0_first_pass(cache) and decode_loop_kind(cache) == "plain" and not prefetch


def _jax_settings() -> tuple:
    """The JAX settings a trace depends on, as `jax.jit` keys its own cache on them (its trace context: PRNG
    partitioning, default matmul precision, x64, dtype promotion, ...). A setting changed between two `generate`
    calls once reused the first call's program: `jax_threefry_partitionable` flipped, the same sampled tokens as
    before where a fresh process gave others (audit of 2026-12-07)."""
    try:
        from jax._src import config as jax_config

        return ("trace_context", jax_config.trace_context())
    except (ImportError, AttributeError):  # a jax without it: the public settings that change a decode loop
        names = ("jax_threefry_partitionable", "jax_default_matmul_precision", "jax_enable_x64",
                 "jax_default_prng_impl", "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion")
        return tuple((n, str(getattr(jax.config, n, None))) for n in names)


def background_sees_these_settings() -> bool:
    """Whether a program built in another thread (the decode bridge's background builds) is traced under this
    thread's JAX settings: JAX's context managers (`with jax.threefry_partitionable(...)`, `with
    jax.default_matmul_precision(...)`) set them for the calling thread only, and a worker sees the global ones.
    Where they differ the bridge builds in the calling thread instead (else its whole program would be traced under
    other settings than its first passes, and kept under their key; review of 2026-12-07)."""
    seen: list[tuple] = []
    worker = threading.Thread(target=lambda: seen.append(_jax_settings()))
    worker.start()
    worker.join()
    return bool(seen) and seen[0] == _jax_settings()


def _signature(name: str, config: LlamaConfig, greedy: bool, record: bool, loop: str, options: dict,
               args: tuple) -> tuple:
    """A compiled program's cache key: its name, the static settings, the JAX settings (`_jax_settings`), and its
    arguments' shapes, dtypes and memory kinds (only shapes matter: a different max_new reuses the executable)."""
    leaves, treedef = jax.tree.flatten(args)
    return (name, config, greedy, record, loop, tuple(sorted(options.items())), _jax_settings(), treedef, tuple(
        (np.shape(x), str(jnp.result_type(x)), getattr(getattr(x, "sharding", None), "memory_kind", None))
        for x in leaves))


def _build(fn: Callable, args: tuple, options: dict, donate: tuple[int, ...], seconds_prefix: str = "",
           after_lowering: Callable[[], None] | None = None) -> Any:
    """jit(fn) lowered for args and compiled with options, its seconds in LAST_BUILD_SECONDS (keys prefixed);
    after_lowering runs between the two (the bridge starts the whole program's build there: its lowering is
    Python and would share the interpreter with this one's)."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
    t1 = time.perf_counter()
    if after_lowering is not None:
        after_lowering()
    compiled = _compile_with_options(lowered, options)
    t2 = time.perf_counter()
    LAST_BUILD_SECONDS.update({f"{seconds_prefix}lower_s": t1 - t0, f"{seconds_prefix}xla_compile_s": t2 - t1})
    if not seconds_prefix:
        LAST_BUILD_SECONDS["started_at"] = t0
    return compiled


def compiled_decode_loop(config: LlamaConfig, greedy: bool, record: bool, args: tuple,
                         loop: str = "plain") -> Callable:
    """The compiled decode loop for these argument shapes (compiled once per shape signature).

    args = (params, cache, first_logits [B, V], max_new, eos_ids, key, temperature, top_p); only the
    shapes matter, so a different max_new reuses the same executable.
    """
    options = decode_compiler_options()
    sig = _signature("loop", config, greedy, record, loop, options, args)
    if sig not in _COMPILED:
        fn = functools.partial(decode_loop, config=config, greedy=greedy, record=record, loop=loop)
        # on a fresh GPU the kernels' self-checks (started at the prefill) still run: compile beside them, keep
        # the program only once they confirm the kernels it uses (else it is compiled again without them)
        _COMPILED[sig] = kernel_checks.compile_while_checking(lambda: _build(fn, args, options, (1,)))
    return _COMPILED[sig]


class NonFiniteLogitsError(ValueError):
    """A step's logits held a NaN or Inf (an activation overflow in the model, or a row it poisoned for bad input),
    so no token could honestly be chosen. `output` is the GenerationOutput up to that step (its sequences cut
    before the first bad step; `cache` as the decode left it), `rows` the (sequence, step) pairs that met one."""

    def __init__(self, output: Any, rows: list[tuple[int, int]]):
        where = ", ".join(f"sequence {i} at generated token {t}" for i, t in rows[:4])
        super().__init__(f"non-finite logits (NaN or Inf) in {where}{' ...' if len(rows) > 4 else ''}: the model's "
                         "activations overflowed or its inputs were bad; the tokens before it are this error's "
                         "`.output`")
        self.output, self.rows = output, rows


class DecodeBridgeError(RuntimeError):
    """The decode bridge's whole program failed to build after its first passes had decoded some steps. `cache`
    holds the cache as they left it (the argument cache was donated to them), `steps` the steps they decoded; the
    error it chains is the build's. A later call builds the whole program again."""

    def __init__(self, cache: Any, steps: int):
        super().__init__(f"the decode loop's whole program failed to compile after {steps} decode steps of its "
                         "first passes (the cache as they left it is this error's `.cache`)")
        self.cache, self.steps = cache, steps


def _whole_program_now(sig: tuple) -> Any:
    """The decode bridge's whole program for sig, waiting for its background build or building it here where it
    was deferred (CERTATTN_DECODE_BRIDGE_BACKGROUND=0). A failed build raises here and is forgotten (the next
    call builds it again), never kept to fail later calls."""
    with _BRIDGE_LOCK:
        build = _DEFERRED.pop(sig, None)
        future = _PENDING.get(sig)
    try:
        if build is not None:
            build()
        if sig in _COMPILED:
            return _COMPILED[sig]
        return future.result()
    except Exception:
        with _BRIDGE_LOCK:
            if _PENDING.get(sig) is future:
                _PENDING.pop(sig, None)
        raise


def finish_background_compiles() -> None:
    """Make every decode bridge's whole program ready: wait for those compiling in the background, build the
    deferred ones (a benchmark then times the steady state; a failed build raises here)."""
    for sig in list(_DEFERRED) + list(_PENDING):
        _whole_program_now(sig)


def clear_compiled() -> None:
    """Drop every decode program this module keeps, and JAX's own caches (`jax.clear_caches`), after the builds
    still running in the background have ended: for a long-lived process that goes through many models or shapes
    (each one's programs hold thousands of memory maps: an audit's sweep ran out of them, at the kernel's
    vm.max_map_count, after 15 tiny configs). The next `generate` compiles afresh. Not while another thread is
    inside `generate`: its decode bridge may be waiting for a program this drops."""
    with _BRIDGE_LOCK:
        pending = list(_PENDING.values())
        _DEFERRED.clear()
    for future in pending:
        concurrent.futures.wait([future])  # (a failed build is of no interest any more)
    with _BRIDGE_LOCK:
        for table in (_COMPILED, _BRIDGE_COMPILED, _PENDING, _DEFERRED):
            table.clear()
    jax.clear_caches()


class BridgedDecode:
    """The decode bridge's programs for one argument signature (`decode_bridge`); call it with the decode
    loop's args to decode. Of the last call: `waited_s` seconds it waited for the whole program to finish
    compiling, `first_pass_steps` the decode steps the first-pass program answered."""

    def __init__(self, config: LlamaConfig, greedy: bool, record: bool, args: tuple, loop: str = "plain"):
        params, cache, first_logits, max_new, eos, key, temperature, top_p = args
        options = decode_compiler_options()
        self.steady = BRIDGE_STEADY
        start_args = (cache, first_logits, eos, key, temperature, top_p)
        start_sig = _signature("start", config, greedy, record, loop, {}, start_args)
        if start_sig not in _BRIDGE_COMPILED:  # a tiny program: no options, no kernels; its output shapes kept
            start_fn = functools.partial(bridge_start, greedy=greedy, record=record)
            _BRIDGE_COMPILED[start_sig] = (_build(start_fn, start_args, {}, (), seconds_prefix="start_"),
                                           jax.eval_shape(start_fn, *start_args))
        self.start, start_shapes = _BRIDGE_COMPILED[start_sig]
        state = (jnp.int32(0), cache, *start_shapes)
        run_args = (params, state, max_new, eos, temperature, top_p)
        self.full_sig = _signature("resume", config, greedy, record, "escalated" if self.steady else loop,
                                   options, run_args)
        self.waited_s = 0.0
        self.upgrade_sig = None  # the unrolled first passes' program (CERTATTN_FIRST_PASS_UNROLLED=background)
        if self.full_sig in _COMPILED and not self.steady:  # compiled before: decoding runs it alone
            self.first_passes = None
            return
        full_fn = functools.partial(decode_loop_resumed, config=config, greedy=greedy, record=record,
                                    loop="escalated" if self.steady else loop)
        background = BRIDGE_BACKGROUND and background_sees_these_settings()

        def start_whole_program():
            with _BRIDGE_LOCK:
                if self.full_sig in _PENDING or self.full_sig in _COMPILED or self.full_sig in _DEFERRED:
                    return

                def build_whole():
                    compiled = kernel_checks.compile_while_checking(
                        lambda: _build(full_fn, run_args, options, (1,), seconds_prefix="full_"))
                    LAST_BUILD_SECONDS["full_ready_at"] = time.perf_counter()
                    _COMPILED[self.full_sig] = compiled
                    return compiled

                if background:
                    _PENDING[self.full_sig] = _BACKGROUND.submit(build_whole)
                else:  # built in the calling thread when a step first needs it (`_whole_program_now`)
                    _DEFERRED[self.full_sig] = build_whole

        # keyed by the first pass's form too (CERTATTN_FIRST_PASS_UNROLLED "1": unrolled from the first step)
        passes_sig = _signature("first_passes", config, greedy, record, (loop, first_pass_mode(params) == "1"), options,
                                run_args)
        if passes_sig not in _BRIDGE_COMPILED:
            passes_fn = functools.partial(bridge_first_passes, config=config, greedy=greedy, record=record)
            _BRIDGE_COMPILED[passes_sig] = kernel_checks.compile_while_checking(
                lambda: _build(passes_fn, run_args, options, (1,), after_lowering=start_whole_program))
        else:
            start_whole_program()
        self.first_passes = _BRIDGE_COMPILED[passes_sig]
        # CERTATTN_FIRST_PASS_UNROLLED=background: the unrolled first passes compile after the whole program, in
        # the background, and replace the looped ones once ready (a failed build only keeps the looped ones)
        if first_pass_mode(params) == "background" and background:
            self.upgrade_sig = _signature("first_passes_unrolled", config, greedy, record, loop, options, run_args)
            unrolled_fn = functools.partial(bridge_first_passes, config=config, greedy=greedy, record=record,
                                            unrolled=True)
            sig = self.upgrade_sig

            def build_unrolled():
                try:
                    compiled = kernel_checks.compile_while_checking(
                        lambda: _build(unrolled_fn, run_args, options, (1,), seconds_prefix="unrolled_"))
                except Exception as e:  # noqa: BLE001 -- an optional speed-up: the looped passes stay
                    warnings.warn(f"the unrolled first passes did not build ({e!r}); the looped ones stay",
                                  stacklevel=2)
                    return None
                LAST_BUILD_SECONDS["unrolled_ready_at"] = time.perf_counter()
                _COMPILED[sig] = compiled
                return compiled

            with _BRIDGE_LOCK:
                if sig not in _PENDING and sig not in _COMPILED:
                    _PENDING[sig] = _BACKGROUND.submit(build_unrolled)

    def whole_program(self) -> Any | None:
        """The whole decode loop if it has finished compiling, else None."""
        return _COMPILED.get(self.full_sig)

    def _passes(self, step: int, max_new: jax.Array) -> tuple[Any, jax.Array]:
        """The first-pass program to run from `step` and the step limit to give it: the unrolled passes once they
        are ready (CERTATTN_FIRST_PASS_UNROLLED=background), with the caller's max_new; while they compile, the
        looped ones for at most UPGRADE_POLL_STEPS steps (then the host looks again)."""
        if self.upgrade_sig is None:
            return self.first_passes, max_new
        build = _PENDING.get(self.upgrade_sig)
        finished = build is None or build.done()  # read before the program: a build may end between the two
        ready = _COMPILED.get(self.upgrade_sig)
        if ready is not None:
            self.unrolled_steps_from = min(self.unrolled_steps_from, step)
            return ready, max_new
        if finished:  # its build failed (it warned): the looped passes for good, no more looks
            self.upgrade_sig = None
            return self.first_passes, max_new
        return self.first_passes, jnp.minimum(max_new, step + 1 + UPGRADE_POLL_STEPS).astype(max_new.dtype)

    def __call__(self, params, cache, first_logits, max_new, eos, key, temperature, top_p):
        """(out, done, steps, cache, records), as `decode_loop.decode_loop` returns them."""
        state = (jnp.int32(0), cache, *self.start(cache, first_logits, eos, key, temperature, top_p))
        rest = (max_new, eos, temperature, top_p)
        self.waited_s, self.first_pass_steps = 0.0, 0
        self.unrolled_steps_from = int(max_new)  # the first step the unrolled first passes ran (if any)
        full = self.whole_program()
        while full is None or self.steady:
            start = int(state[0])
            passes, limit = self._passes(start, max_new)
            state, more = passes(params, state, limit, *rest[1:])
            self.first_pass_steps += int(state[0]) - start
            if not bool(more):
                # stopped at the limit, short of max_new, to look for the unrolled passes again (never where the
                # limit is max_new itself: the loop is then done, whether or not they are ever ready)
                if limit is not max_new and int(state[0]) + 1 >= int(limit) and int(limit) < int(max_new):
                    continue
                return outputs(state)  # every remaining step answered by the first passes
            if full is None:
                t0 = time.perf_counter()
                try:
                    full = _whole_program_now(self.full_sig)
                except Exception as e:
                    raise DecodeBridgeError(state[1], int(state[0])) from e
                self.waited_s = time.perf_counter() - t0
            if self.steady:  # the run of steps the first passes leave (`decode_loop.resume`); then them again
                state = full(params, state, *rest)
                continue
            break
        return outputs(full(params, state, *rest))


def _token_ids(p: Any, i: int) -> list[int]:
    """Prompt i as a list of int token ids: a sequence or 1-D array of integers (not a bare int, not floats)."""
    try:
        arr = None if isinstance(p, (str, bytes)) else np.asarray(p)
    except ValueError:  # a ragged nesting
        arr = None
    if arr is None or arr.ndim != 1:
        hint = "" if arr is None or arr.ndim else " (prompts is a list of token-id lists: [[1, 2, 3]], not [1, 2, 3])"
        raise ValueError(f"prompt {i} must be a list (or 1-D array) of token ids, got {type(p).__name__}{hint}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"prompt {i} must hold integer token ids, got {arr.dtype} values")
    return [int(t) for t in arr.reshape(-1)]


def _validate_prompts(prompts: Sequence[Sequence[int]], config: LlamaConfig) -> list[list[int]]:
    if (isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__")
            or (isinstance(prompts, np.ndarray) and prompts.ndim == 0) or len(prompts) == 0):
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        ids = _token_ids(p, i)
        if not ids:
            raise ValueError(f"prompt {i} is empty: need at least one token")
        bad = [t for t in ids if t < 0 or t >= config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {config.vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def generate(params: Params, config: LlamaConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             *, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             eos_token_ids: Sequence[int] | None = None, cache_factory: CacheFactory | str | None = None,
             policy: Any = None,
             capacity: int | None = None, prefill_chunk: int = 256, progress: bool = True,
             record_steps: bool = False, staging_batch: int | str | None = "auto") -> GenerationOutput:
    """Generate up to max_new_tokens for each prompt (lists of token ids).

    temperature 0 means greedy (top_p is then unused); otherwise softmax(logits / temperature) restricted to the
    smallest most likely set reaching top_p (ties at the cut keep the lower token id; transformers keeps the
    higher). Every bit of `seed` counts; one key per step serves the whole batch, so a prompt's samples depend on
    its row (row 0 samples as the prompt alone), not on the batch size. A sequence that stops early (EOS) takes no
    more tokens into its cache. cache_factory(batch, capacity) builds the KV cache; it may also be a mode
    name, "dense" (the default), "naive" or "certified" (with `policy`, a certattn_jax.CertPolicy), or a
    `certattn_jax.model_cache.CacheSpec`. For a mode name or a CacheSpec the prompt is prefilled into a dense
    staging cache and converted once into the mode's cache (tier 2 is never read back during prefill);
    `prefill_seconds` includes that conversion (it is the time to the first token's logits).
    capacity defaults to prompt + max_new rounded up to CAPACITY_BUCKET. staging_batch (tiered modes): prefill
    that many prompts at a time (see `prefill`; "auto", the default, splits a batch only where its dense K/V would
    not fit on the device).
    With record_steps, the cache's per-step records (e.g. certificates) are returned stacked.
    """
    prompts = _validate_prompts(prompts, config)
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if capacity is not None and not is_integer(capacity):
        raise ValueError(f"capacity must be an integer (or None), got {capacity!r}")
    # (a NaN temperature once passed `temperature < 0` and sampled token 0 every step)
    if not (is_finite_number(temperature) and is_finite_number(top_p) and temperature >= 0 and 0 < top_p <= 1):
        raise ValueError(f"need a finite temperature >= 0 and 0 < top_p <= 1, got {temperature!r}, {top_p!r}")
    if not is_integer(prefill_chunk) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
    lens = np.array([len(p) for p in prompts], np.int32)
    need = int(lens.max()) + max_new_tokens
    if need > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({int(lens.max())} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the "
            f"model's context of {config.max_position_embeddings} tokens")
    if capacity is None:
        capacity = round_up(need, CAPACITY_BUCKET)
    elif capacity < need:
        raise ValueError(f"cache capacity {capacity} is smaller than prompt + max_new_tokens = {need}")
    if not is_integer(seed) or not -2 ** 63 <= seed < 2 ** 63:
        raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {seed!r}")
    eos = _validate_eos(eos_token_ids, config) if eos_token_ids is not None else config.eos_token_ids
    eos_arr = jnp.asarray(eos if eos else (-2,), jnp.int32)
    check_params(params, config)  # before the clock: prefill_seconds stays the time to the first token's logits
    t0 = time.perf_counter()
    cache, last_logits = prefill(params, config, prompts, capacity, cache_factory=cache_factory, policy=policy,
                                 prefill_chunk=prefill_chunk, progress=progress, min_capacity=need,
                                 check_finite=False, staging_batch=staging_batch)
    prefill_s = time.perf_counter() - t0

    # ---- decode, one jit (compiled ahead so that the timing below is the decode alone) ----
    params = params_for_decoding(params, cache)  # stacked weights, once, for the schedules that read them
    args = (params, cache, last_logits, jnp.int32(max_new_tokens), eos_arr, key_from_seed(seed),
            jnp.float32(temperature), jnp.float32(top_p))
    t0 = time.perf_counter()
    if decode_bridge(cache):  # decoding waits only for the first-pass program (see `decode_bridge`)
        decode = BridgedDecode(config, temperature == 0.0, record_steps, args, decode_loop_kind(cache))
    else:
        decode = compiled_decode_loop(config, temperature == 0.0, record_steps, args, decode_loop_kind(cache))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out, done, steps, cache, records = decode(*args)
    out = np.asarray(jax.block_until_ready(out))
    decode_s = time.perf_counter() - t0
    steps = int(steps)
    done = np.asarray(done)
    tokens, nonfinite = [], []
    for i, row in enumerate(out[:, :steps]):
        stop = np.flatnonzero(row < 0)
        tokens.append(row[: stop[0] if stop.size else steps].tolist())
        if stop.size and row[stop[0]] == NONFINITE_TOKEN:
            nonfinite.append((i, int(stop[0])))
    if record_steps:
        records = jax.tree.map(lambda x: np.asarray(x)[: max(steps - 1, 0)], records)
        if isinstance(records, Certificate):  # record s consumed token s: live while s < the sequence's tokens
            n = np.asarray([len(t) for t in tokens])
            records = mark_stopped(records, np.arange(max(steps - 1, 0))[:, None] < n[None, :])
    bad = {i for i, _ in nonfinite}
    result = GenerationOutput(tokens=tokens, finished=[bool(d) and i not in bad for i, d in enumerate(done)],
                              prefill_seconds=prefill_s, decode_seconds=decode_s, compile_seconds=compile_s,
                              num_steps=steps, cache=cache, step_records=records if record_steps else None,
                              compile_wait_seconds=getattr(decode, "waited_s", 0.0))
    if nonfinite:
        raise NonFiniteLogitsError(result, nonfinite)
    return result


def check_params(params: Params, config: LlamaConfig, finite: bool = True) -> None:
    """Raise ValueError naming the first tensor of `params` whose name, shape or dtype the config does not
    imply (fused projections accepted) or, with `finite`, that holds NaN / Inf: either would make generation emit
    garbage tokens (a NaN logit row argmaxes to token 0) rather than fail."""
    validate_params(unfused_shapes(params, config), config)
    bad = nonfinite_parameter(params) if finite else None
    if bad is not None:
        raise ValueError(f"parameter {bad!r} holds NaN or Inf values: generation would emit garbage tokens")
    stale = stale_stacked_layers(params)
    if stale is not None:
        raise ValueError(f"params['{STACKED_LAYERS}'] {stale}: rebuild it with models.llama.with_stacked_layers "
                         "after changing params['layers'], or drop it")


def _validate_eos(eos_token_ids: Any, config: LlamaConfig) -> tuple[int, ...]:
    """End-of-sequence ids: a sequence of integer token ids inside the vocabulary."""
    if isinstance(eos_token_ids, np.ndarray) and eos_token_ids.ndim == 1:
        eos_token_ids = eos_token_ids.tolist()
    if isinstance(eos_token_ids, (str, bytes)) or not isinstance(eos_token_ids, (Sequence, set, frozenset)):
        raise TypeError(f"eos_token_ids must be a sequence of token ids, got {eos_token_ids!r}")
    ids = list(eos_token_ids)
    if not all(is_integer(t) and 0 <= t < config.vocab_size for t in ids):
        raise ValueError(f"eos_token_ids must be token ids in [0, {config.vocab_size}), got {ids!r}")
    return tuple(int(t) for t in ids)


def prefill(params: Params, config: LlamaConfig, prompts: Sequence[Sequence[int]], capacity: int, *,
            cache_factory: CacheFactory | str | None = None, policy: Any = None, prefill_chunk: int = 256,
            progress: bool = False, min_capacity: int | None = None,
            check_finite: bool = False, staging_batch: int | str | None = "auto") -> tuple[KVCache, jax.Array]:
    """Prefill prompts (token-id lists, right-padded into chunks of `prefill_chunk`) into a new cache of
    `capacity`; returns (cache, logits [B, V] at each prompt's last token), both ready (blocked on).

    cache_factory as in `generate`. A mode name or CacheSpec prefills into the dense staging cache and converts
    it once (`CacheSpec.from_staging`); another factory's cache prefills through its own `attend`.
    staging_batch (tiered modes): prefill at most this many prompts at a time in a dense staging cache of their
    own, each group converted into its rows of the batch's tiered cache (`TieredModelCache.with_staged_sequences`), so
    the device holds the batch's tier 1 plus one group's dense K/V instead of the whole batch's dense K/V: a
    batch larger than a dense cache could hold (tier 1 is 44 % of the dense bytes). None: the whole batch at once.
    "auto" (the default): the whole batch where the device's free memory holds it by `auto_staging_batch`'s
    estimate (always on a device without memory statistics, e.g. the CPU), else groups that fit.
    The dense mode's cache is its staging cache: it prefills the batch at once.
    The params are checked against the config and, with check_finite, for NaN / Inf (`check_params`: a read of
    every weight; `generate` checks them before its clock, and the loaders when they read them).
    """
    prompts = _validate_prompts(prompts, config)
    if not is_integer(prefill_chunk) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
    check_params(params, config, finite=check_finite)
    B = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    min_capacity = int(lens.max()) if min_capacity is None else min_capacity
    if not (cache_factory is None or isinstance(cache_factory, (str, CacheSpec)) or callable(cache_factory)):
        raise TypeError(f"cache_factory must be a mode name, a CacheSpec or a callable (batch, capacity) -> cache, "
                        f"got {type(cache_factory).__name__}")
    if cache_factory is None or isinstance(cache_factory, str):
        spec: CacheSpec | None = cache_spec("dense" if cache_factory is None else cache_factory, config,
                                            params["embed"].dtype, policy)
    else:
        spec = cache_factory if isinstance(cache_factory, CacheSpec) else None
    if spec is not None:
        spec.check_model(config)
        if was_donated(spec.policy):
            raise ValueError("the policy's arrays were donated with the cache they came from (e.g. "
                             "`policy=cache.policy` after that cache went through a donating step): pass a CertPolicy "
                             "built anew, or take the policy before donating the cache")
    if staging_batch == "auto":
        staging_batch = None if spec is None else auto_staging_batch(spec, config, B, capacity, prefill_chunk)
    if staging_batch is not None and (not is_integer(staging_batch) or staging_batch < 1):
        raise ValueError(f"staging_batch must be an integer >= 1, None or 'auto', got {staging_batch!r}")
    if staging_batch is not None and spec is None:
        raise ValueError("staging_batch needs a mode name or a CacheSpec as cache_factory (a callable factory's "
                         "cache prefills through its own attend)")
    if spec is not None and spec.tiered and staging_batch is not None and staging_batch < B:
        return _prefill_in_groups(params, config, prompts, capacity, spec, prefill_chunk, progress, min_capacity,
                                  staging_batch)
    cache = spec.staging(B, capacity) if spec is not None else cache_factory(B, capacity)
    if not (hasattr(cache, "lengths") and hasattr(cache, "capacity") and hasattr(cache, "attend")):
        raise TypeError(f"cache_factory({B}, {capacity}) must return a KV cache, got {type(cache).__name__}")
    if cache.lengths.shape[-1] != B:
        raise ValueError(f"cache_factory({B}, {capacity}) returned a cache for {cache.lengths.shape[-1]} sequences")
    if was_donated(cache):
        raise ValueError(f"cache_factory({B}, {capacity}) returned a cache whose arrays were donated to an earlier "
                         "call (prefill and decoding consume the cache they are given): build a fresh one per call")
    converting = spec if conversion_in_chunk(spec, cache) else None
    cache, last_logits = _prefill_into(params, config, cache, prompts, prefill_chunk, progress, min_capacity,
                                       convert=converting)
    if spec is not None and converting is None:  # the prompts' lengths given: no read-back of the cache's own
        cache = spec.from_staging(cache, lengths=np.array([len(p) for p in prompts], np.int32))
    jax.block_until_ready((last_logits, cache))
    return cache, last_logits


@functools.partial(committed_jit, static_argnums=(0, 1))
def _zero_logits(batch: int, vocab: int) -> jax.Array:
    """Zero logits [batch, vocab] float32, committed, in one program (the prefill's initial last-token logits)."""
    return jnp.zeros((batch, vocab), jnp.float32)


def _prefill_into(params: Params, config: LlamaConfig, cache: KVCache, prompts: list[list[int]], prefill_chunk: int,
                  progress: bool, min_capacity: int, convert: CacheSpec | None = None) -> tuple[KVCache, jax.Array]:
    """The prompts (checked) prefilled chunk by chunk into an empty cache (donated); (cache, last logits [B, V]).
    convert: a tiered spec whose `from_staging` the last chunk's program runs too (`conversion_in_chunk`); the
    returned cache is then its tiered cache."""
    cache = commit_arrays(cache)
    if cache.capacity < min_capacity:
        raise ValueError(f"cache capacity {cache.capacity} is smaller than the {min_capacity} tokens needed")
    B = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    C = min(prefill_chunk, round_up(int(lens.max()), 8))
    n_chunks = -(-int(lens.max()) // C)
    padded = np.zeros((B, n_chunks * C), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    last_logits = _zero_logits(B, config.vocab_size)
    bar = _progress(n_chunks, C, enabled=progress and n_chunks > 2)
    for c in range(n_chunks):
        valid = np.clip(lens - c * C, 0, C).astype(np.int32)
        last_index = (lens - 1 - c * C).astype(np.int32)
        # NumPy arguments: the jitted call transfers them itself (`jnp.asarray` of each was an eager dispatch of
        # its own, three per chunk, before the chunk's program could be launched)
        tokens = np.ascontiguousarray(padded[:, c * C:(c + 1) * C])
        if convert is not None and c == n_chunks - 1:
            convert.check_tier2_fits(cache)  # what the eager conversion refuses before it allocates
            cache, last_logits = _prefill_last_chunk_converted(
                params, config, cache, tokens, valid, last_index, last_logits, lens,
                convert._policy(), dataclasses.replace(convert, policy=None))
        else:
            cache, last_logits = _prefill_chunk(params, config, cache, tokens, valid, last_index, last_logits)
        if bar is not None:
            jax.block_until_ready(last_logits)
            bar.update(1)
    if bar is not None:
        bar.close()
    return cache, last_logits


# The share of the device's free memory that `auto_staging_batch` plans to fill (the rest: XLA's own temporaries
# beyond the estimate, fragmentation).
STAGING_MEMORY_SHARE = 0.85


def auto_staging_batch(spec: CacheSpec, config: LlamaConfig, batch: int, capacity: int, prefill_chunk: int,
                       device: Any = None) -> int | None:
    """`prefill`'s staging_batch="auto": None (the whole batch in one staging cache) where the device's free memory
    holds it, else the most prompts per group that fit beside the batch's tiered cache; None as well where the
    device reports no memory statistics (the CPU) or the mode has no staging of its own (dense).

    Estimate, per sequence (`CacheSpec.bytes_per_sequence`): the staging cache's dense K/V, the tiered cache's
    device bytes, and the prefill's temporaries: one chunk's float32 scores, weights and probabilities
    [Hq, chunk, capacity]; and for the conversion of n sequences, the temporaries of one conversion program
    (`cache.conversion_temp_bytes`: ~5 float32 per K/V element of the layers it takes). The whole batch at once
    needs all of it for the batch; in groups of n, the batch's tiered cache plus n sequences' staging and
    temporaries. An estimate: XLA's own temporaries may differ (STAGING_MEMORY_SHARE of the free memory is
    planned)."""
    if not spec.tiered:
        return None
    device = device or jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    free = (stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * STAGING_MEMORY_SHARE
    per = spec.bytes_per_sequence(capacity)
    chunk = min(prefill_chunk, capacity)
    prefill_temps = 3 * 4 * config.num_heads * chunk * capacity
    layer_elems = config.num_kv_heads * capacity * config.head_dim  # one layer's keys of one sequence

    def conversion_temps(n: int) -> int:  # the temporaries of the conversion program that n sequences take
        return conversion_temp_bytes(n * 2 * layer_elems, config.num_layers, jnp.dtype(spec.dtype).itemsize)

    def group_fits(n: int, batch_rows: int) -> bool:  # n staged beside a tiered cache of batch_rows already made
        one = per["staging"] + per["device"] + prefill_temps  # (the device bytes: the group's converted tier 1)
        return batch_rows * per["device"] + n * one + conversion_temps(n) <= free

    if group_fits(batch, 0):
        return None
    return next((n for n in range(batch - 1, 1, -1) if group_fits(n, batch)), 1)


def _prefill_in_groups(params: Params, config: LlamaConfig, prompts: list[list[int]], capacity: int,
                       spec: CacheSpec, prefill_chunk: int, progress: bool, min_capacity: int,
                       group: int) -> tuple[KVCache, jax.Array]:
    """`prefill`'s staging_batch: the batch's tiered cache built empty (tier 2 made in host memory), then `group`
    prompts at a time prefilled in their own dense staging cache and converted in groups of layers into their rows
    (`TieredModelCache.with_staged_sequences`)."""
    cache = commit_arrays(spec(len(prompts), capacity))
    if cache.capacity < min_capacity:
        raise ValueError(f"cache capacity {cache.capacity} is smaller than the {min_capacity} tokens needed")
    logits = []
    starts = range(0, len(prompts), group)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc=f"prefill ({group} prompts at a time)", unit="prompt", file=sys.stderr)
    for start in starts:
        group_prompts = prompts[start:start + group]
        staging = spec.staging(len(group_prompts), capacity)
        staging, part_logits = _prefill_into(params, config, staging, group_prompts, prefill_chunk, False,
                                             min_capacity)
        cache = cache.with_staged_sequences(start, staging)  # converted in groups of layers into the group's rows
        del staging
        logits.append(part_logits)
        if bar is not None:
            bar.update(len(group_prompts))
    if bar is not None:
        bar.close()
    last_logits = jnp.concatenate(logits, axis=0)
    jax.block_until_ready((last_logits, cache))
    return cache, last_logits


def _progress(n_chunks: int, chunk: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=n_chunks, desc=f"prefill ({chunk}-token chunks)", unit="chunk", file=sys.stderr)
