"""The kernel self-check verdicts kept on disk are keyed by `selftest._sources_digest()`: a hash of the *files* under
pallas_kernels/ and certattn_jax/, read when a verdict is first needed (functools.cache), not when the code was
imported. A process whose sources change on disk between its import and its first check (a `git checkout`, an edit
during a long run) stores the verdict on the code it runs under the key of code it never ran. Shown on a copy of the
packages in a temporary folder (the repository is not touched); CPU only: nothing here runs a kernel.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_caches/probe_sources_digest.py
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

CHILD = r"""
import hashlib, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path.insert(0, str(root))
from pallas_kernels import selftest, tier1_pass  # the code this process runs
loaded = Path(tier1_pass.__file__).read_bytes()
with open(tier1_pass.__file__, "a") as f:  # the sources change on disk after the import
    f.write("\nMIN_INT8_CONTRACTION_EDITED = 1  # another kernel version\n")
print("digest used as the verdict key:", selftest._sources_digest()[:16])
print("tier1_pass.py loaded sha:", hashlib.sha256(loaded).hexdigest()[:16], "on disk now:",
      hashlib.sha256(Path(tier1_pass.__file__).read_bytes()).hexdigest()[:16])
"""


def digest(root: Path) -> str:  # selftest._sources_digest's recipe
    h = hashlib.sha256()
    for f in sorted([*root.joinpath("pallas_kernels").glob("*.py"), *root.joinpath("certattn_jax").glob("*.py")]):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        for pkg in ("pallas_kernels", "certattn_jax", "models"):
            shutil.copytree(ROOT / pkg, copy / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        before = digest(copy)
        out = subprocess.run([sys.executable, "-c", CHILD, str(copy)], capture_output=True, text=True, check=True)
        print("digest of the sources the process imported:", before)
        print(out.stdout.strip())
        print("digest of the edited sources:              ", digest(copy))
