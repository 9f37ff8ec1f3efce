"""A hash of the certified path's and the kernels' Python sources, taken when `certattn_jax` is first imported.

The kernels' self-check verdicts are kept on disk under a key that holds it (`pallas_kernels.selftest`), so a
verdict vouches only for the code that was checked. Taken at the package's import, before any of that code runs,
not at the first check: a checkout or an edit between the two once stored the old code's verdict under the new
code's key (audit of 2026-12-07). (Python keeps no source text of a loaded module, so the files are read here.)
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def digest_sources() -> str:
    """sha256 over the names and bytes of every `certattn_jax/*.py` and `pallas_kernels/*.py`, in name order."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted([*root.joinpath("pallas_kernels").glob("*.py"), *root.joinpath("certattn_jax").glob("*.py")]):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


SOURCES_DIGEST = digest_sources()
