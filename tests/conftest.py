import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite is compile-bound on CPU: skip LLVM's expensive optimisation passes (same float semantics:
# XLA never enables fast-math reassociation), about a third less compile time.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
# every run checks compiled kernels afresh (pallas_kernels.selftest keeps verdicts on disk for users)
os.environ.setdefault("CERTATTN_SELFTEST_CACHE", "off")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop the compiled programs it left behind (jit caches, generate's compiled decode
    loops). Every XLA:CPU executable keeps ~3 memory maps of JIT code: a worker that ran half the suite held
    ~56,000 maps and 8 GB, and the kernel's limit (vm.max_map_count, 65,530 by default) makes the next
    compilation segfault inside LLVM -- the "unexplained" XLA:CPU crash of long test processes."""
    yield
    from models import generate

    generate._COMPILED.clear()
    jax.clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
    """Keep the tests that compare SmolLM2 with transformers on one xdist worker: they share a session
    fixture that loads the model into transformers (~30 s). scripts/test.sh fetches and converts SmolLM2
    into the user cache before the workers start, so no two workers race to create it."""
    for item in items:
        if item.get_closest_marker("slow") and item.module.__name__.endswith("test_parity_hf"):
            item.add_marker(pytest.mark.xdist_group("hf-smollm2"))
