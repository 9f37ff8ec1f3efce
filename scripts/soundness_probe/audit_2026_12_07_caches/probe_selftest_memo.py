"""The kernel self-check predicates (`pallas_kernels.selftest.tier1_trusted`, `rung0_trusted`, `gather_trusted`,
`write_trusted`) are `functools.cache`d by their configuration alone, but `_trusted` answers True *without a check*
while `runs_compiled_kernels()` is False (CERTATTN_PALLAS_INTERPRET set, read at every call). That True is memoised:
once the variable is unset in the same process the compiled kernel is trusted for that configuration with no check
ever run. Needs a GPU (on the CPU nothing is compiled, so nothing is checked either way).

    CERTATTN_SELFTEST_CACHE=off python3 scripts/soundness_probe/audit_2026_12_07_caches/probe_selftest_memo.py
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402, F401 -- the import path
import jax  # noqa: E402

from pallas_kernels import selftest  # noqa: E402

if __name__ == "__main__":
    warnings.simplefilter("default")
    os.environ.setdefault("CERTATTN_SELFTEST_CACHE", "off")
    print("backend", jax.default_backend(), jax.devices()[0].device_kind, "verdict file", selftest.verdict_cache_path())
    a = (16, 32, 16, 8, 4)  # block, head_dim, group, key bits, value bits
    b = (16, 64, 16, 8, 4)
    os.environ["CERTATTN_PALLAS_INTERPRET"] = "1"
    print("interpret on : runs_compiled_kernels", selftest.runs_compiled_kernels(), "tier1_trusted(a)",
          selftest.tier1_trusted(*a), "write_trusted", selftest.write_trusted(16, 32, "bfloat16"))
    del os.environ["CERTATTN_PALLAS_INTERPRET"]
    print("interpret off: runs_compiled_kernels", selftest.runs_compiled_kernels(), "tier1_trusted(a)",
          selftest.tier1_trusted(*a), "write_trusted", selftest.write_trusted(16, 32, "bfloat16"))
    print("checks run so far:", [(r["what"], r["config"]) for r in selftest.check_runs()])
    print("interpret off: tier1_trusted(b) (never asked before)", selftest.tier1_trusted(*b))
    print("checks run so far:", [(r["what"], r["config"].get("head_dim")) for r in selftest.check_runs()])
