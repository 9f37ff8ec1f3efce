import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite is compile-bound on CPU: skip LLVM's expensive optimisation passes (same float semantics:
# XLA never enables fast-math reassociation), about a third less compile time.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """Run the tests that load the real SmolLM2 (marked slow) on one xdist worker: they share its download
    and converted checkpoint in the user cache, and one worker keeps them from racing to create it."""
    import pytest

    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group("smollm2"))
