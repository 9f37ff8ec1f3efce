#!/usr/bin/env bash
# Set up .venv (dev + parity extras) and run the whole test suite on CPU. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv "dev,parity"
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -q "$@"
