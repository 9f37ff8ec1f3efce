import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite is compile-bound on CPU: skip LLVM's expensive optimisation passes (same float semantics:
# XLA never enables fast-math reassociation), about a third less compile time; and emit fusions with XLA:CPU's
# elemental emitters instead of its newer MLIR fusion emitters (the same HLO computed, about 40 % less compile
# CPU time again: one end-to-end test 44.7 -> 26.5 s of CPU; docs/performance.md, thirteenth session).
# CPU-only flags, so only where the tests run on the CPU: a jaxlib that no longer knows one aborts every process
# at start-up (jaxlib 0.11.2 on the H200 with --xla_cpu_use_fusion_emitters, 2026-12-04), and a GPU run needs neither.
if os.environ["JAX_PLATFORMS"].strip().lower() == "cpu":
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
# every run checks compiled kernels afresh (pallas_kernels.selftest keeps verdicts on disk for users)
os.environ.setdefault("CERTATTN_SELFTEST_CACHE", "off")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _fresh_kernel_verdicts():
    """Each test reaches its own kernel verdicts: those a process reached are remembered (a check is not run
    twice per process, `pallas_kernels.selftest._PROCESS_VERDICTS`), which would hand one test's verdict -- a
    kernel made wrong on purpose, say -- to the next."""
    from pallas_kernels import selftest

    selftest._PROCESS_VERDICTS.clear()
    yield
    selftest._PROCESS_VERDICTS.clear()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop the compiled programs it left behind (jit caches, generate's compiled decode
    loops). Every XLA:CPU executable keeps ~3 memory maps of JIT code: a worker that ran half the suite held
    ~56,000 maps and 8 GB, and the kernel's limit (vm.max_map_count, 65,530 by default) makes the next
    compilation segfault inside LLVM -- the "unexplained" XLA:CPU crash of long test processes."""
    yield
    from models import generate

    for future in list(generate._PENDING.values()):  # a bridge's background build must finish (and not fail)
        future.result()
    generate._COMPILED.clear()
    generate._BRIDGE_COMPILED.clear()
    generate._PENDING.clear()
    generate._DEFERRED.clear()
    jax.clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
    """Cases marked `breadth` (more cases of a test whose other cases run everywhere) are skipped on the CPU unless
    CERTATTN_TEST_BREADTH=1: they run compiled on the GPU (scripts/gpu_session.sh), where they cost seconds."""
    breadth_off = os.environ.get("CERTATTN_TEST_BREADTH") != "1" and jax.default_backend() == "cpu"
    for item in items:
        if breadth_off and item.get_closest_marker("breadth"):
            item.add_marker(pytest.mark.skip(reason="breadth case: CERTATTN_TEST_BREADTH=1 runs it on the CPU"))


def pytest_runtest_logreport(report):
    """CERTATTN_FAILURE_LOG=PATH: each failure's report appended to PATH as it happens (a device call stopped at its
    time limit loses pytest's end-of-run summary, not these). Written by the controlling process only."""
    path = os.environ.get("CERTATTN_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a") as f:
        f.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")
