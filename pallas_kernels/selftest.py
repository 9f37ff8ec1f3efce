"""Known-answer checks of the compiled tier-1 kernel, once per shape configuration, before a certificate uses it.

A certificate is only as sound as the arithmetic its bound describes. The bound covers the kernel's float32
rounding, not a compiler that gets the arithmetic wrong: on the H200 (jax 0.11.2) Triton's int8 MMA over 16
terms returned twice the product, and the `int_kv` kernel certified wrong outputs for block_size 16 until the
kernel stopped using it there (tier1_pass.MIN_INT8_CONTRACTION; docs/performance.md, 2026-12-01). The next such
miscompile (another shape, another jax or Triton) must not be silent either: before the certified path (or the
naive one) routes a configuration through the compiled kernel, `tier1_trusted` runs that kernel once on small
random inputs of the same static configuration -- the layouts the product uses (per-block accumulators; split
accumulators with the hot set left out, the slot programs and a stacked layer read in place) -- against the
pure-jnp reference. A disagreement warns, names the output, and the caller takes the jnp computation instead
(same bound, no kernel). In interpret mode (the CPU) the kernel *is* jnp code, so nothing is checked.

The fused rung 0 (`certify_rung0`, fed by the tier-1 kernel) gets the same treatment (`rung0_trusted`): on a
small random cache with a hot set, its promoted slots, K* and ranking check must equal the jnp rung 0's, its
output and bound terms agree to float32 rounding (TOLERANCE: the compiled kernel's rounding margins are far
inside it), and its E_val and bound may not be smaller; else the ladder takes the jnp rung 0 for that
configuration.

Rung 1's tier-2 read (`gather_blocks`, a kernel that dereferences pinned host memory) is checked the same way
(`gather_trusted`): a few blocks copied out of a small tier 2 in pinned host memory, bit for bit against jnp;
a difference sends rung 1 back to XLA's block transfers.

Cost: a compile and run of each kernel and its reference per configuration: ~30 s for the two checks the
fused rung 0 needs on the H200 (SmolLM2's decode compile, 29.6 -> 59.4 s; docs/performance.md, 2026-12-01
fifth session). Verdicts are therefore kept on disk (`verdict_cache_path`: CERTATTN_SELFTEST_CACHE, default
~/.cache/certattn_jax/kernel_selftest.json; "off" disables it), keyed by what the verdict depends on: the device
kind and its platform version (driver / CUDA), the jax and jaxlib versions, a hash of this package's sources
(kernels and references) and the configuration. A machine checks each configuration once; a failed check is
kept too (the warning repeats, the fallback holds, nothing recompiles). A process also remembers the verdicts it
reached (`_PROCESS_VERDICTS`), so without a file too each check runs at most once per process. A check that cannot
run here (the kernel does not compile on this device or jax, or fails at run time) counts as failed in the
caller's thread -- warn, take jnp -- but is not kept: the next process checks again. In a background thread an
error decides nothing (the foreground runs the check again).

An ahead-of-time compile need not wait for checks still running (`compile_while_checking`, used by the decode loop
of `models.generate`): inside `optimistic_verdicts` a predicate whose verdict is not known yet answers True and is
recorded; the compiled program is handed out only after `confirm` has every recorded verdict, and is compiled
again without the kernel where one failed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax import quant, source_digest, xla_options
from pallas_kernels import backend

# Relative to the largest magnitude of each output: the kernel and the reference agree to ~1e-6 (float32 sums
# in another order); a miscompile shows as O(1) (the int8 one: a factor of 2)
TOLERANCE = 1e-3
T = TypeVar("T")


def _eagerly(check: Callable[[], str | None]) -> str | None:
    """Run `check` in a thread of its own. JAX's trace state is per thread: there the check runs eagerly even
    when the caller is in the middle of tracing a jitted step (jax.ensure_compile_time_eval would also evaluate
    a kernel's own body)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(check).result()


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| over the largest |want| (both float64; NaN in got compares as an infinite error)."""
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
    err = float(np.max(np.abs(got - want), initial=0.0)) / scale
    return float("inf") if np.isnan(err) else err


def verdict_cache_path() -> Path | None:
    """Where checked verdicts are kept (module docstring), or None when CERTATTN_SELFTEST_CACHE is "off"."""
    where = os.environ.get("CERTATTN_SELFTEST_CACHE", "")
    if where.lower() in ("off", "0", "none"):
        return None
    return Path(where) if where else Path.home() / ".cache" / "certattn_jax" / "kernel_selftest.json"


def _sources_digest() -> str:
    """The hash of the sources as `certattn_jax` was imported (`certattn_jax.source_digest`)."""
    return source_digest.SOURCES_DIGEST


def _memo_per_mode(fn: Callable) -> Callable:
    """`functools.cache` of fn, keyed also by `runs_compiled_kernels()`: a True answered without a check (interpret
    mode) must not vouch for compiled kernels later in the same process (CERTATTN_PALLAS_INTERPRET unset, audit of
    2026-12-07). `cache_clear` clears it."""
    cached = functools.cache(lambda compiled, *args, **kwargs: fn(*args, **kwargs))

    @functools.wraps(fn)
    def memo(*args, **kwargs):
        return cached(runs_compiled_kernels(), *args, **kwargs)

    memo.cache_clear = cached.cache_clear
    memo.cache_info = cached.cache_info
    return memo


def _verdict_key(what: str, config: dict[str, int | str]) -> str:
    import jaxlib

    dev = jax.devices()[0]
    parts = [what, dev.device_kind, str(getattr(dev.client, "platform_version", "")), jax.__version__,
             jaxlib.__version__, _sources_digest(), sorted(config.items())]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def _load_verdicts(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent or damaged: check again


_STORE_LOCK = threading.Lock()  # checks finish in several threads: no lost update of the verdict file


def _store_verdict(path: Path, key: str, verdict: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _STORE_LOCK:  # read, add, replace: one thread at a time
            verdicts = _load_verdicts(path)
            verdicts[key] = verdict
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernel_selftest.")
            with os.fdopen(fd, "w") as f:
                json.dump(verdicts, f, indent=1)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # a read-only home: the check simply runs again next time


_SECONDS_CHECKING = [0.0]  # wall seconds callers of this process were held up by checks (running or awaiting one)
# verdict key -> the Future of a check in progress in this process: a check started in the background
# (`start_in_background`) is awaited, not run a second time, by the trace that needs its verdict (which then
# reads it from the verdict file, or runs the check itself where that is off)
_CHECKS: dict[str, concurrent.futures.Future] = {}
_CHECKS_LOCK = threading.Lock()
_THREAD = threading.local()  # .background: this thread runs `start_in_background`'s checks


# verdicts this process reached ({"problem": str | None} by verdict key): a check that finished in the background
# is not run again by the foreground that asks later, also where no verdict file is kept (CERTATTN_SELFTEST_CACHE
# off, twenty-sixth session: the fused rung 0's check ran twice, 7 s in the foreground)
_PROCESS_VERDICTS: dict[str, dict] = {}
_CHECK_RUNS: list[dict] = []  # every check this process ran: {"what", "config", "start_s", "seconds", "background"}
_IMPORTED_AT = time.perf_counter()  # the origin of a check run's start_s


def check_runs() -> list[dict]:
    """The kernel checks this process ran so far (not those read from the verdict file or awaited): what, its
    configuration, when it started (seconds after this module's import), wall seconds, and whether a background
    thread ran it -- which check is the long pole of a cold process's first decode compile, and whether it ran
    beside the prefill or queued behind a compile (`seconds_checking` says how long callers waited in all)."""
    return [dict(r) for r in _CHECK_RUNS]


def seconds_checking() -> float:
    """Wall seconds this process's callers have been held up by kernel self-checks so far: running one, or
    waiting for one started in the background (benchmarks report the share of a compile that was checking: a
    one-time cost per machine and configuration, not the compile's). Checks that finish in the background
    before anyone asks for their verdict cost nothing here."""
    return _SECONDS_CHECKING[0]


def _timed(run: Callable[[], str | None]) -> str | None:
    t0 = time.perf_counter()
    try:
        return run()
    finally:
        if not getattr(_THREAD, "background", False):  # nobody waits on a background thread
            _SECONDS_CHECKING[0] += time.perf_counter() - t0


def _run_once(key: str, problem: Callable[[], str | None],
              keep: Callable[[str | None], None] = lambda found: None) -> tuple[bool, str | None]:
    """(ran, problem()) with each key's check run at most once at a time in this process: a caller that finds
    the same check in progress (another thread, e.g. a background start) waits for its verdict instead. A check
    that raised hands its waiters nothing: they run it again (and see the error themselves). `keep(found)` (the
    verdict file's update, and this process's memo) runs before the check stops being "in progress", so a later
    caller finds one or the other; a verdict this process already reached is returned without running (read under
    the lock: a check that finished since the caller looked is not run again)."""
    while True:
        with _CHECKS_LOCK:
            reached = _PROCESS_VERDICTS.get(key)
            if reached is not None:
                return False, reached["problem"]
            fut = _CHECKS.get(key)
            owner = fut is None
            if owner:
                fut = _CHECKS[key] = concurrent.futures.Future()
        if not owner:
            try:
                return False, fut.result()
            except Exception:  # the running caller's error is its own; check here instead
                continue
        try:
            found = problem()
        except BaseException as e:
            fut.set_exception(e)
            raise
        else:
            keep(found)
            fut.set_result(found)
        finally:
            with _CHECKS_LOCK:
                _CHECKS.pop(key, None)
        return True, found


def _kept_verdict(what: str, config: dict[str, int | str]) -> dict | None:
    """The verdict this process already reached for this check, else the one kept on disk ({"problem": str |
    None, ...}), or None (none reached or kept)."""
    reached = _PROCESS_VERDICTS.get(_verdict_key(what, config))
    if reached is not None:
        return reached
    path = verdict_cache_path()
    if path is None:
        return None
    kept = _load_verdicts(path).get(_verdict_key(what, config))
    return kept if isinstance(kept, dict) and "problem" in kept else None


def _checked(what: str, config: dict[str, int | str], problem: Callable[[], str | None]) -> str | None:
    """problem(), or the verdict kept on disk for the same key, or that of the same check in progress."""
    kept = _kept_verdict(what, config)
    if kept is not None:
        return kept["problem"]
    path = verdict_cache_path()
    key = _verdict_key(what, config)

    def keep(found: str | None) -> None:
        _PROCESS_VERDICTS[key] = {"problem": found}
        if path is not None:
            _store_verdict(path, key, {"what": what, "config": config, "problem": found,
                                       "device": jax.devices()[0].device_kind, "jax": jax.__version__})

    def timed_problem() -> str | None:
        t0 = time.perf_counter()
        try:
            return problem()
        finally:
            _CHECK_RUNS.append({"what": what, "config": dict(config), "start_s": round(t0 - _IMPORTED_AT, 3),
                                "seconds": round(time.perf_counter() - t0, 3),
                                "background": bool(getattr(_THREAD, "background", False))})

    try:
        return _timed(lambda: _run_once(key, timed_problem, keep))[1]
    except Exception as e:  # noqa: BLE001
        if getattr(_THREAD, "background", False):  # the foreground runs the check again (a transient error, e.g.
            raise  # memory taken by the prefill beside it, must not decide)
        # in the foreground a kernel whose check cannot run here (it does not compile on this device or jax, or
        # fails at run time) is not trusted: the caller warns and takes the jnp path. Not kept on disk: the next
        # process checks again.
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return f"the check raised {type(e).__name__}: {first}"


class _CheckedInBackground(Exception):
    """Raised by `_trusted` in a background check thread once the verdict is known: the `*_trusted` functions'
    per-process memo (functools.cache) does not keep exceptions, so the foreground call still runs `_trusted`
    -- and warns there, where the caller sees it -- reading the verdict the background left (`_run_once`)."""


def start_in_background(*verdicts: Callable[[], object]) -> list[threading.Thread]:
    """Start each `verdicts` callable (e.g. `lambda: step.tier1_kernel_runs(cache, impl)`) in a thread of its own
    and return at once: the checks it leads to run while the caller does other work (a prompt's prefill),
    and the trace that later asks for the same verdict waits for it (`_run_once`) instead of checking again.
    Nothing is memoised or warned in the background (`_CheckedInBackground`). Where no compiled kernel runs,
    nothing is started. An error in the background is dropped: the foreground call checks again and raises it."""
    if not runs_compiled_kernels():
        return []

    def quietly(fn: Callable[[], object]) -> None:
        _THREAD.background = True
        try:
            fn()
        except Exception:  # noqa: BLE001 -- _CheckedInBackground, or an error the foreground call will raise
            pass

    # not daemons: a process that exits before a check ends waits for it (tearing XLA down under a running
    # compile can crash the interpreter's exit)
    threads = [threading.Thread(target=quietly, args=(fn,), name="certattn-selftest") for fn in verdicts]
    for t in threads:
        t.start()
    return threads


_OPTIMISTIC = threading.local()  # .assumed: the list `optimistic_verdicts` collects in this thread, else None


class _VerdictPending(Exception):
    """Raised by `_trusted` inside `optimistic_verdicts` when no verdict is known yet; the memoised `*_trusted`
    functions do not keep it (functools.cache keeps no exception), and `_assumable` answers True for them."""


def _assumable(trusted: Callable[..., bool]) -> Callable[..., bool]:
    """Wrap a memoised `*_trusted` predicate: inside `optimistic_verdicts` a configuration whose verdict is not
    known yet is answered True at once -- recorded, its check started (or left running) in the background --
    instead of holding up the trace; everywhere else the predicate as it was."""

    @functools.wraps(trusted)
    def ask(*args, **kwargs) -> bool:
        try:
            return trusted(*args, **kwargs)
        except _VerdictPending:
            assumed = _OPTIMISTIC.assumed
            if not any(a.func is trusted and a.args == args and a.keywords == kwargs for a in assumed):
                # once per configuration (an unrolled model asks once per layer); a check already in progress
                # is awaited by this thread, not repeated
                again = functools.partial(trusted, *args, **kwargs)
                assumed.append(again)
                start_in_background(again)
            return True

    ask.cache_clear = trusted.cache_clear  # type: ignore[attr-defined]
    ask.cache_info = trusted.cache_info  # type: ignore[attr-defined]
    return ask


@contextlib.contextmanager
def optimistic_verdicts():
    """Within the block (this thread only), a kernel predicate whose self-check has not reported yet answers
    True -- the trace goes on and its compile overlaps the check -- and is recorded in the list this yields.
    Nothing compiled inside may *run* before `confirm(assumed)` says every assumption held; where one did not,
    compile again outside the block (`compile_while_checking` does both). Verdicts already known (memoised, or
    kept on disk) are answered as usual, failures warned."""
    previous = getattr(_OPTIMISTIC, "assumed", None)
    assumed: list[Callable[[], bool]] = []
    _OPTIMISTIC.assumed = assumed
    try:
        yield assumed
    finally:
        _OPTIMISTIC.assumed = previous


def confirm(assumed: list[Callable[[], bool]]) -> bool:
    """Ask each predicate that `optimistic_verdicts` answered on trust again, now waiting for its verdict (each
    failed one warns, as it would have at the trace): True when every one holds."""
    return all([ask() for ask in assumed])  # a list: every one is asked (and warns), not only up to a failure


def compile_while_checking(build: Callable[[], T]) -> T:
    """`build()` (a trace and compile that asks the kernel predicates) run while the kernels' self-checks it
    needs are still running, instead of after them: optimistic inside (`optimistic_verdicts`), then wait for
    the verdicts it assumed. If one failed, jax's trace caches (which hold the trust the first trace assumed)
    are cleared and `build()` runs again, now taking the jnp path for that kernel. Nothing built on an
    unconfirmed assumption is ever returned. On a fresh GPU the decode compile and the checks then overlap (8B
    at 8K: a ~20 s decode compile waited ~17 s for the checks before it, 2026-12-03)."""
    with optimistic_verdicts() as assumed:
        built = build()
    if confirm(assumed):
        return built
    del built
    jax.clear_caches()
    return build()


def _trusted(what: str, config: dict[str, int | str], problem: Callable[[], str | None], fallback: str) -> bool:
    """True where no compiled kernel executes or `problem()` finds nothing (or found nothing before, on this
    machine and code: `verdict_cache_path`); else warn (naming the configuration, the device and what
    disagrees) and False."""
    if not runs_compiled_kernels():
        return True
    if getattr(_OPTIMISTIC, "assumed", None) is not None and _kept_verdict(what, config) is None:
        raise _VerdictPending(what)
    found = _checked(what, config, problem)
    if getattr(_THREAD, "background", False):
        raise _CheckedInBackground(what)
    if found is None:
        return True
    cfg = ", ".join(f"{k}={v}" for k, v in config.items())
    warnings.warn(f"{what} failed its check against its reference for {cfg} on {jax.devices()[0].device_kind} "
                  f"(jax {jax.__version__}): {found}. {fallback}", RuntimeWarning, stacklevel=3)
    return False


def _inputs(block_size: int, head_dim: int, group_size: int, key_bits: int, value_bits: int, seed: int = 0):
    """A 2-layer stacked tier 1 (B = 1, H = 1, G = 4, 4 blocks, 3 of them valid) and a hot set of 2 slots."""
    from pallas_kernels.tier1_pass import Slots

    rng = np.random.default_rng(seed)
    L, B, H, G, nb, Bk, d = 2, 1, 1, 4, 4, block_size, head_dim
    k = rng.normal(size=(L, B, H, nb, Bk, d)) * rng.uniform(0.5, 3.0, size=(1, 1, 1, 1, 1, d))
    v = rng.normal(size=(L, B, H, nb, Bk, d)) + 0.5
    # jitted: one compile instead of an op-by-op dispatch (each op its own first-time compile: ~2.7 s on the CPU
    # against 0.3 s, and this runs on a fresh machine's first decode, inside its wait for the checks)
    kc, ks, kz, vc, vs, vz = xla_options.jit(lambda k, v: (*quant.quantize_keys(k, key_bits),
                                                   *quant.quantize_values(v, group_size, value_bits)))(
        jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32))
    q = jnp.asarray(rng.normal(size=(B, H, G, d)) / np.sqrt(d), jnp.float32)
    hot_ids = jnp.asarray([[[2, 0]]], jnp.int32)
    slots = Slots(hot_k=jnp.asarray(k[1][:, :, [2, 0]], jnp.bfloat16),
                  hot_v=jnp.asarray(v[1][:, :, [2, 0]], jnp.bfloat16), hot_ids=hot_ids,
                  res_k=jnp.asarray(k[1][:, :, 3], jnp.bfloat16),
                  res_v=jnp.asarray(v[1][:, :, 3], jnp.bfloat16), r_count=jnp.asarray([Bk // 2], jnp.int32),
                  n_slots=4)
    return q, (kc, ks, kz, vc, vs, vz), jnp.asarray([3], jnp.int32), hot_ids, slots


def _layouts(block_size, head_dim, group_size, key_bits, value_bits):
    """(name, args, kwargs) of the calls the product makes (step.tier1_partials, step.fused_items, naive)."""
    q, stacked, n_valid, hot_ids, slots = _inputs(block_size, head_dim, group_size, key_bits, value_bits)
    one_layer = tuple(x[1] for x in stacked)
    common = dict(group_size=group_size, key_bits=key_bits, value_bits=value_bits, score_scale=1.0)
    yield "per-block", (q, *one_layer, n_valid), dict(common, per_block_acc=True)
    yield "split, hot set, slots, stacked layer", (q, *stacked, n_valid), dict(
        common, per_block_acc=False, blocks_per_split=2, hot_ids=hot_ids, q_abs=jnp.abs(q), out_blocks=8,
        out_splits=4, slots=slots, layer=jnp.asarray(1, jnp.int32))


def tier1_disagreement(block_size: int, head_dim: int, group_size: int, key_bits: int, value_bits: int,
                       variant: str | None = None, run: Callable | None = None) -> str | None:
    """None when the tier-1 kernel (`run`, default `tier1_pass` with `variant`, default the certified one) agrees
    with `tier1_pass_reference` on every output of every layout, else what disagrees. Evaluated eagerly (in a
    thread of its own), also when called while a jitted function is being traced."""
    from pallas_kernels import tier1_pass as t1

    variant = variant or t1.CERTIFIED_VARIANT
    run = run or functools.partial(t1.tier1_pass, variant=variant)

    def check() -> str | None:
        for name, args, kw in _layouts(block_size, head_dim, group_size, key_bits, value_bits):
            # jitted: one compile each instead of an op-by-op dispatch of the reference on a GPU
            got = xla_options.jit(lambda *a, kw=kw: run(*a, **kw))(*args)
            want = xla_options.jit(lambda *a, kw=kw: t1.tier1_pass_reference(*a, **kw))(*args)
            for field in t1.Tier1Partials._fields:
                w = getattr(want, field)
                if w is None:
                    continue
                g, w = np.asarray(getattr(got, field)), np.asarray(w)
                fin = np.isfinite(w)
                if g.shape != w.shape or np.isnan(g).any() or not np.array_equal(g[~fin], w[~fin]):
                    return f"{name}: {field} has the wrong shape, NaN or wrong empty entries"
                err = _relative_error(g[fin], w[fin])
                if not err <= TOLERANCE:
                    return f"{name}: {field} off by {err:.3g} of its magnitude"
        return None

    return _eagerly(check)


def _rung0_case(block_size: int, head_dim: int, group_size: int, key_bits: int, value_bits: int, k_max: int,
                seed: int = 0, hot_slots: int = 0, full_blocks: int = 3):
    """A cache (B = 1, H = 1, G = 4, bfloat16, full_blocks and a half: a residual) whose hot set holds exact copies
    of two of its blocks, a policy of that layout (tier 1 through the kernel) and a query with a few needle
    keys."""
    from certattn_jax.cache import TieredKVCache
    from certattn_jax.policy import CertPolicy

    rng = np.random.default_rng(seed)
    Bk, d, G = block_size, head_dim, 4
    T = full_blocks * Bk + Bk // 2
    policy = CertPolicy(tier1="pallas", rung0="fused", block_size=Bk, group_size=group_size, key_bits=key_bits,
                        value_bits=value_bits, k_max=k_max, hot_slots=hot_slots)
    k = rng.normal(size=(1, T, 1, d)) * rng.uniform(0.5, 3.0, size=d)
    v = rng.normal(size=(1, T, 1, d)) + 1.0
    q = rng.normal(size=(1, G, d)) * 1.5
    for t in rng.choice(T, size=4, replace=False):
        k[0, t, 0] = q[0].mean(0) * 2.5
    kj, vj = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    ids = np.full((1, 1, policy.slots), -1, np.int32)
    ids[0, 0, :min(2, k_max)] = [1, 0][:min(2, k_max)]

    def build(kj, vj, ids):  # jitted: one compile instead of an op-by-op dispatch (see `_inputs`)
        cache = TieredKVCache.from_dense(kj, vj, policy, lengths=jnp.asarray([T], jnp.int32))
        slot_blocks = jnp.maximum(ids, 0)[..., None, None]

        def hot(x):  # the hot slots' exact copies of blocks 1 and 0 of x [B, T, H, d]
            blocks = x[:, :2 * Bk].reshape(1, 2, Bk, 1, d).transpose(0, 3, 1, 2, 4)  # [B, H, 2, Bk, d]
            return jnp.take_along_axis(blocks, slot_blocks, axis=2)

        return cache.replace(hot_ids=ids, hot_k=hot(kj).astype(cache.hot_k.dtype),
                             hot_v=hot(vj).astype(cache.hot_v.dtype))

    return jnp.asarray(q, jnp.bfloat16), xla_options.jit(build)(kj, vj, jnp.asarray(ids)), policy


def rung0_disagreement(block_size: int, head_dim: int, group_size: int, key_bits: int, value_bits: int,
                       k_max: int, run: Callable | None = None, hot_slots: int = 0,
                       tuning: tuple[int, int] | None = None, select: str | None = None,
                       layer_view: bool = False, picks: str | None = None) -> str | None:
    """None when the fused rung 0 (`run`, default `step.rung0_fused`) agrees with the jnp rung 0 on a small random
    cache of this configuration (hot_slots: a hot set larger than k_max), else what disagrees. Evaluated eagerly
    in a thread. tuning: the certify kernel's (chunk width, warps) to check (`certify_rung0.tuning`), on a cache
    whose passes walk two chunks (the second one ragged) unless the chunk is the small-cache setting's; with the
    counted candidate selection (select "count", default `certify_rung0.DEFAULT_SELECT`, which the run uses), also
    on a cache whose one chunk takes it. picks (`certify_rung0.SELECTION_REGIMES`): instead, only a cache on
    which the kernel picks its candidates that way at this setting -- the one way a cache of a given block count
    runs (`certify_rung0.selection_regime`): "count" a cache whose one chunk counts, "walk" one of two chunks
    (the second ragged), "loop" one chunk with the loop selection (the check's compiles halved where a setting
    ran two caches: the 8B shape's fused check ran 30-37 s beside its decode compile, twenty-seventh session).
    layer_view: run the kernels as a model's decode step runs them, on a layer view of stacked arrays
    (`as_layer_view`: both kernels read the layer in place, the other layers' arrays empty, so a read of the
    wrong layer changes the answer; as the first, a middle and the last layer), instead of on the cache's own
    arrays: the two are different compiled code, each checked where it is used (one compile of the kernels per
    size, not two)."""
    from certattn_jax import ladder, step
    from pallas_kernels import certify_rung0

    if picks not in (None, *certify_rung0.SELECTION_REGIMES):
        raise ValueError(f"picks must be one of {certify_rung0.SELECTION_REGIMES} or None, got {picks!r}")
    run = run or step.rung0_fused
    if tuning is not None:
        run = functools.partial(run, tuning=tuning)
    setting = tuning or certify_rung0.BASE_TUNING
    if picks is not None:
        sizes = [_regime_full_blocks(picks, setting[0], select, small=setting == certify_rung0.BASE_TUNING)]
    elif setting == certify_rung0.BASE_TUNING:
        sizes = [3]
    else:
        sizes = [setting[0] + setting[0] // 2 + 3]  # two chunks, the second ragged
        if (select or certify_rung0.DEFAULT_SELECT) == "count":  # also a cache whose one chunk counts
            sizes.append(min(setting[0], certify_rung0.COUNT_SELECT_MAX_COLUMNS) * 3 // 4)

    def check() -> str | None:
        for full_blocks in sizes:
            problem = check_one(full_blocks)
            if problem is not None:
                return problem if len(sizes) == 1 else f"{problem} ({full_blocks} full blocks)"
        return None

    def check_one(full_blocks: int) -> str | None:
        q, cache, policy = _rung0_case(block_size, head_dim, group_size, key_bits, value_bits, k_max,
                                       hot_slots=hot_slots, full_blocks=full_blocks)

        def jnp_rung0(q, cache):
            ctx = step.build_context(q, cache, policy)
            return step.evaluate_stage(ctx, [ladder.select_and_promote(ctx, cache, policy).hot], q.dtype, policy)

        ref = xla_options.jit(jnp_rung0)(q, cache)
        fused = xla_options.jit(lambda q, cache: run(q, cache, policy).stage)
        if not layer_view:
            return _rung0_stage_problem(fused(q, cache), ref)
        # the cache as each layer of the stack in turn, the others empty: first, middle and last (a traced index:
        # one compile, three runs)
        for at in range(_VIEW_LAYERS):
            problem = _rung0_stage_problem(fused(q, as_layer_view(cache, at)), ref)
            if problem is not None:
                return f"{problem} (stacked layer view, layer {at} of {_VIEW_LAYERS})"
        return None

    return _eagerly(check)


def _regime_full_blocks(picks: str, chunk: int, select: str | None, small: bool = False) -> int:
    """Full blocks of a check cache (plus a half block) on which the kernel, at this chunk width, picks its
    candidates the way `picks` names (`certify_rung0.selection_regime`). small: the small-cache setting, whose
    caches count in 16-64 columns (checked on 16, as before the ways were told apart); else a counted chunk is
    checked at the widest counted width."""
    from pallas_kernels import certify_rung0

    counted = min(chunk, certify_rung0.COUNT_SELECT_MAX_COLUMNS)
    full_blocks = {"walk": chunk + chunk // 2 + 3,  # 2 x chunk columns
                   "count": 3 if small else counted * 3 // 4,  # one counted chunk
                   "loop": 3 if (select or certify_rung0.DEFAULT_SELECT) == "loop" else chunk * 3 // 4}[picks]
    padded = certify_rung0.padded_blocks(full_blocks + 1)
    if certify_rung0.selection_regime(padded, chunk, select) != picks:  # e.g. "loop" in one chunk that counts
        raise ValueError(f"no cache picks its candidates by {picks!r} at chunk width {chunk} (select {select!r})")
    return full_blocks


_VIEW_LAYERS = 3  # like a real model's 30 or 32 layers not a power of two, which a kernel's stacked block must take


def as_layer_view(cache, layer: int = 1):
    """`cache` as layer `layer` of a 3-layer model's stacked cache (`TieredModelCache.layer_view`'s form), the
    other layers zero (hot ids -1: an empty hot set)."""
    from certattn_jax.cache import DEVICE_FIELDS

    def stacked(name):
        x = getattr(cache, name)
        other = jnp.full_like(x, -1) if name == "hot_ids" else jnp.zeros_like(x)
        return jnp.stack([x if i == layer else other for i in range(_VIEW_LAYERS)])

    return cache.replace(layer=jnp.asarray(layer, jnp.int32), stack={f: stacked(f) for f in DEVICE_FIELDS})


def _rung0_stage_problem(got, ref) -> str | None:
    """What differs between the fused rung 0's stage (got) and the jnp rung 0's (ref), or None."""
    for name in ("k_star", "ranking_ok"):
        if not np.array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(ref, name))):
            return f"{name} differs"
    for name in ("out", "e_key", "e_val", "e_num", "bound"):
        err = _relative_error(np.asarray(getattr(got, name), np.float64),
                              np.asarray(getattr(ref, name), np.float64))
        # bf16 outputs may round the other way; the split merge's E_num may grow (docs/bounds.md section 14)
        tol = 2.0 ** -7 if name == "out" else 4.0 if name in ("e_num", "bound") else TOLERANCE
        if not err <= tol:
            return f"{name} off by {err:.3g} of its magnitude"
    # never smaller beyond the float32 reordering of sums (compiled, E_val may be larger: the Triton division
    # and sqrt margins of bounds.block_value_errors, ~3e-6 of it, and the bound also by the output division's)
    for name in ("e_val", "bound"):
        if np.any(np.asarray(getattr(got, name)) < np.asarray(getattr(ref, name)) * (1 - 1e-4)):
            return f"{name} smaller than the jnp rung 0's"
    return None


@_memo_per_mode
def rung0_trusted(block_size: int, head_dim: int, group_size: int, key_bits: int, value_bits: int,
                  k_max: int, hot_slots: int = 0, tuning: tuple[int, int] | None = None,
                  select: str = "loop", layer_view: bool = False, picks: str | None = None) -> bool:
    """Whether the ladder may use the compiled fused rung 0 for this configuration (module docstring; hot_slots:
    the cache's hot-set slots when more than k_max; tuning: the kernel's (chunk width, warps), default the
    small-cache setting `certify_rung0.tuning(16)`; layer_view: on a model's layer view, reading the stacked
    arrays in place, else on a cache's own arrays; picks: how the kernel picks its candidates on the asking
    cache (`certify_rung0.selection_regime`), or None for every way the setting's check cache sizes run:
    `rung0_disagreement`); True without a check where no compiled kernel executes. Checked once per
    configuration and process."""
    from pallas_kernels import certify_rung0

    cfg = dict(block_size=block_size, head_dim=head_dim, group_size=group_size, key_bits=key_bits,
               value_bits=value_bits, k_max=k_max)
    if hot_slots and hot_slots != k_max:
        cfg["hot_slots"] = hot_slots
    chunk, warps = tuning = tuple(tuning or certify_rung0.tuning(certify_rung0.padded_blocks(1)))
    # the warps per program and the chunk width change the compiled code: a verdict on one setting never vouches
    # for another (keyed only when not the base setting, so its kept verdicts stay valid)
    keyed = {} if warps == certify_rung0.BASE_TUNING[1] else {"rung0_warps": warps}
    if chunk != certify_rung0.BASE_TUNING[0]:
        keyed["rung0_chunk"] = chunk
    if select != "loop":  # another candidate selection is other compiled code
        keyed["rung0_select"] = select
    if picks is not None:  # a cache picks its candidates one way at its block count: a verdict on one way never
        keyed["rung0_picks"] = picks  # vouches for another
    if layer_view:  # so is the kernels' in-place read of a layer of stacked arrays
        keyed["rung0_form"] = "layer_view"
    return _trusted("the compiled fused rung 0", dict(cfg, **_process_layouts(), **keyed),
                    lambda: rung0_disagreement(**cfg, tuning=tuning, select=select, layer_view=layer_view,
                                               picks=picks),
                    "The ladder uses the jnp rung 0 for this configuration instead.")


rung0_trusted = _assumable(rung0_trusted)


def _process_layouts() -> dict[str, str]:
    """The process-wide choices the kernels' code paths depend on beyond the shapes (the value packing): part of
    a verdict's key, so a verdict on one layout never vouches for another."""
    from pallas_kernels import certify_rung0

    return dict(value_packing=quant.VALUE_PACKING, rung0_single_chunk=str(certify_rung0.SINGLE_CHUNK))


def runs_compiled_kernels() -> bool:
    """Whether kernels launched here execute compiled (a GPU, not interpret mode). Forcing compiled kernels on
    a CPU (CERTATTN_PALLAS_INTERPRET=0) only lowers them, e.g. for `jax.export` to CUDA: nothing to check."""
    return not backend.interpret() and jax.default_backend() == "gpu"


_COMPILER_WARMED = threading.Event()


def warm_compiler(interpret: bool = False) -> None:
    """Compile one tiny Pallas kernel, once per process (later calls return at once). The first Pallas-Triton
    compile in a process pays a one-time setup: on the H200 the fused rung 0 compiled in 15.1 s first and 5.2 s
    again (docs/performance.md, thirteenth session). `certattn_jax.kernel_checks.start` runs this in the
    background while a tiered cache's prompt is prefilled, so that the decode compile does not pay it where the
    self-checks' verdicts are kept on disk (then no check compiles a kernel during the prefill)."""
    if _COMPILER_WARMED.is_set():
        return
    _COMPILER_WARMED.set()
    from jax.experimental import pallas as pl

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    shape = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    xla_options.jit(pl.pallas_call(add_one, out_shape=shape, interpret=interpret)).lower(shape).compile()


@_memo_per_mode
def tier1_trusted(block_size: int, head_dim: int, group_size: int, key_bits: int, value_bits: int) -> bool:
    """Whether the certified path may use the compiled tier-1 kernel for this configuration (module docstring);
    True without a check where no compiled kernel executes (`runs_compiled_kernels`). Checked once per
    configuration and process."""
    cfg = dict(block_size=block_size, head_dim=head_dim, group_size=group_size, key_bits=key_bits,
               value_bits=value_bits)
    return _trusted("the compiled tier-1 kernel", dict(cfg, **_process_layouts()), lambda: tier1_disagreement(**cfg),
                    "Certified and naive attention use the jnp tier-1 computation for this configuration instead.")


tier1_trusted = _assumable(tier1_trusted)


def gather_disagreement(block_size: int, head_dim: int, host_dtype: str, dst_dtype: str,
                        run: Callable | None = None) -> str | None:
    """Run the gather kernel (`run`, default `gather_blocks`) on a small tier 2 placed where the product places
    it (pinned host memory; a device copy in interpret mode, which cannot read host operands) -- one layer of a
    stacked tier 2, and every layer at once -- and compare with `gather_reference` on device copies, bit for bit
    (a copy has no rounding).
    Returns a description of the first difference, or None. Evaluated eagerly, like `tier1_disagreement`."""
    from certattn_jax import tiers
    from pallas_kernels import gather_blocks as gb

    run = run or gb.gather_blocks

    def check() -> str | None:
        rng = np.random.default_rng(5)
        L, B, H, nb, S = 2, 1, 2, 4, 3
        host = [jnp.asarray(rng.normal(size=(L, B, H, nb, block_size, head_dim)), host_dtype) for _ in range(2)]
        dk, dv = (jnp.asarray(rng.normal(size=(L, B, H, S, block_size, head_dim)), dst_dtype) for _ in range(2))
        ids = jnp.asarray([[[[2, -1, 0], [-1, 3, 1]]], [[[1, 1, -1], [0, -1, 3]]]], jnp.int32)  # [L, B, H, S]
        place = (lambda x: x) if backend.interpret() else tiers.to_host
        hk, hv = (place(x) for x in host)
        layer = jnp.asarray(1, jnp.int32)
        cases = [("one layer of a stacked tier 2", xla_options.jit(run)(dk[1], dv[1], hk, hv, ids[1], layer),
                  gb.gather_reference(dk[1], dv[1], *host, ids[1], layer)),  # the jnp reference, on device copies
                 ("every layer", xla_options.jit(run)(dk, dv, hk, hv, ids), gb.gather_reference(dk, dv, *host, ids))]
        for name, got, ref in cases:
            for which, g, r in zip(("keys", "values"), got, ref, strict=True):
                g, r = np.asarray(g.astype(jnp.float32)), np.asarray(r.astype(jnp.float32))
                if g.shape != r.shape or not np.array_equal(g, r):
                    return f"{name}: {which} differ in {int(np.sum(g != r)) if g.shape == r.shape else 'shape'}" \
                           f" of {r.size} elements"
        return None

    return _eagerly(check)


@_memo_per_mode
def gather_trusted(block_size: int, head_dim: int, host_dtype: str, dst_dtype: str) -> bool:
    """Whether rung 1's fetch may use the compiled `gather_blocks` kernel for this configuration; True without
    a check where no compiled kernel executes. Checked once per configuration and process (and machine and
    code: `verdict_cache_path`)."""
    cfg = dict(block_size=block_size, head_dim=head_dim, host_dtype=host_dtype, dst_dtype=dst_dtype)
    return _trusted("the compiled tier-2 gather kernel", cfg, lambda: gather_disagreement(**cfg),
                    "Rung 1 reads tier 2 with XLA's block transfers instead.")


gather_trusted = _assumable(gather_trusted)


def write_disagreement(block_size: int, head_dim: int, dtype: str, run: Callable | None = None) -> str | None:
    """Run the token-write kernel (`run`, default `write_token.write_token`) on small stacked cache arrays and
    compare with `write_token_reference`: the residual rows, value range and the arrays it must leave alone bit for
    bit (a store and a min / max round nothing); the value norm bound no smaller than the float64 norm and within
    1e-4 of the reference's. Returns a description of the first difference, or None. Evaluated eagerly."""
    from pallas_kernels import write_token as wt

    run = run or wt.write_token

    def check() -> str | None:
        rng = np.random.default_rng(11)
        L, B, H = 3, 4, 2
        shape = (L, B, H, block_size, head_dim)
        res = [jnp.asarray(rng.normal(size=shape), dtype) for _ in range(2)]
        v_min = jnp.asarray(rng.normal(size=(L, B, H, head_dim)) - 1, jnp.float32)
        v_max = v_min + 2
        v_norm_max = jnp.asarray(rng.random((L, B, H)) * head_dim ** 0.5, jnp.float32)
        value_stats = jnp.asarray(rng.random((L, B, H, 4)), jnp.float32)
        v_err_max = jnp.asarray(rng.random((L, B, H)) * 0.1, jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(B, H, head_dim)) * 10.0 ** rng.uniform(-2, 2, (B, H, 1)), dtype)
                for _ in range(2))
        # the last two write nothing (a stopped sequence's position past the block; a position below it): a stray
        # write would land in another head's or sequence's rows, which the whole-array comparison sees
        r = jnp.asarray([block_size - 1, 1, block_size, -3], jnp.int32)
        args = (*res, v_min, v_max, v_norm_max, value_stats, v_err_max, k, v, r, jnp.asarray(1, jnp.int32))
        got, ref = xla_options.jit(run)(*args), wt.write_token_reference(*args)
        for name, g, w in zip(("res_k", "res_v", "v_min", "v_max"), got[:4], ref[:4], strict=False):
            g, w = np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
            if g.shape != w.shape or not np.array_equal(g, w):
                return f"{name} differs in {int(np.sum(g != w)) if g.shape == w.shape else 'shape'} of {w.size}"
        exact = np.linalg.norm(np.asarray(v.astype(jnp.float32), np.float64), axis=-1)
        for name, g, w in (("v_norm_max", got[4], ref[4]), ("value_stats", got[5], ref[5])):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            if g.shape != w.shape or np.any(np.abs(g - w) > 1e-4 * np.abs(w)) or np.any(g < w * (1 - 1e-4)):
                return f"{name}: off the reference's"
        if np.any(np.asarray(got[4], np.float64)[1][:2] < exact[:2]):  # (the rows written)
            return "v_norm_max: the norm bound is below the norm"
        return None

    return _eagerly(check)


@_memo_per_mode
def write_trusted(block_size: int, head_dim: int, dtype: str) -> bool:
    """Whether a model cache's decode step may write its token with the compiled `write_token` kernel for this
    configuration; True without a check where no compiled kernel executes."""
    cfg = dict(block_size=block_size, head_dim=head_dim, dtype=dtype)
    return _trusted("the compiled token-write kernel", cfg, lambda: write_disagreement(**cfg),
                    "The decode step writes its token with XLA's updates instead.")


write_trusted = _assumable(write_trusted)
