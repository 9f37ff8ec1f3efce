import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite is compile-bound on CPU: skip LLVM's expensive optimisation passes (same float semantics:
# XLA never enables fast-math reassociation), about a third less compile time.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
