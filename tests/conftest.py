import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite is compile-bound on CPU: skip LLVM's expensive optimisation passes (same float semantics:
# XLA never enables fast-math reassociation), about a third less compile time.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """Keep the tests that compare SmolLM2 with transformers on one xdist worker: they share a session
    fixture that loads the model into transformers (~30 s). scripts/test.sh fetches and converts SmolLM2
    into the user cache before the workers start, so no two workers race to create it."""
    import pytest

    for item in items:
        if item.get_closest_marker("slow") and item.module.__name__.endswith("test_parity_hf"):
            item.add_marker(pytest.mark.xdist_group("hf-smollm2"))
