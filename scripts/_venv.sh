# Sourced by demo.sh / test.sh: create or refresh .venv with the given extras, quickly when nothing changed.
# usage: ensure_venv "dev,parity"   (or "" for the runtime only)
ensure_venv() {
  local extras="$1" root stamp want
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  cd "$root" || return 1
  local py="${PYTHON:-python3}"
  if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($py --version 2>&1)" >&2
    "$py" -m venv .venv || return 1
  fi
  stamp=.venv/.certattn-installed
  want="$(cat pyproject.toml | sha256sum | cut -c1-16) extras=[$extras]"
  # A stamp for a superset of extras is good enough (test.sh installs more than demo.sh).
  if [ -f "$stamp" ] && grep -qF "$(cat pyproject.toml | sha256sum | cut -c1-16)" "$stamp" \
     && { [ -z "$extras" ] || grep -qF "extras=[$extras]" "$stamp"; }; then
    return 0
  fi
  echo "[setup] installing certattn-jax${extras:+[$extras]} into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip >&2 || return 1
  .venv/bin/python -m pip install -q -e ".${extras:+[$extras]}" >&2 || return 1
  echo "$want" > "$stamp"
}
