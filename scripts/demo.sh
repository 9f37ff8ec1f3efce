#!/usr/bin/env bash
# Set up .venv, fetch the default model (SmolLM2-135M-Instruct) once, and run greedy generation.
# Extra args go to `python -m certattn_jax demo` (e.g. --max-new-tokens 128; see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv ""
exec .venv/bin/python -m certattn_jax demo "$@"
