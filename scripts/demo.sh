#!/usr/bin/env bash
# Set up .venv, fetch the default model (SmolLM2-135M-Instruct) once, and run greedy generation.
# Extra args go to `python -m certattn_jax generate` (e.g. --max-new-tokens 64 --prompt "...").
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv ""
exec .venv/bin/python -m certattn_jax demo "$@"
