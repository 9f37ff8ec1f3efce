# ruff: noqa: E402  (the sys.path setup above the imports: run as a script from anywhere)
"""Thirtieth-session soundness audit probe (docs/performance.md, thirtieth session); see README.md here."""

import os as _os
import sys as _sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_ROOT = _os.path.abspath(_os.path.join(_HERE, "..", "..", ".."))
for _p in (_ROOT, _os.path.join(_ROOT, "tests"), _os.path.join(_ROOT, "scripts", "soundness_probe"), _HERE):
    if _p not in _sys.path:
        _sys.path.insert(0, _p)

exec(
    open(_os.path.join(_HERE, "model_run.py"))
    .read()
    .replace("import fams, model_audit", "import fams, model_audit")
    .replace('tag = os.environ.get("CERTATTN_TIER1", "jnp")', 'tag = "undo-" + os.environ.get("CERTATTN_TIER1", "jnp")')
)
