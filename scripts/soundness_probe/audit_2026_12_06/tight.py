# ruff: noqa: E402, E501  (the sys.path setup above the imports: run as a script from anywhere)
"""Thirtieth-session soundness audit probe (docs/performance.md, thirtieth session); see README.md here."""

import os as _os
import sys as _sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_ROOT = _os.path.abspath(_os.path.join(_HERE, "..", "..", ".."))
for _p in (_ROOT, _os.path.join(_ROOT, "tests"), _os.path.join(_ROOT, "scripts", "soundness_probe"), _HERE):
    if _p not in _sys.path:
        _sys.path.insert(0, _p)
import sys

import audit2
import fams

src = open(audit2.__file__).read()
# instrumented copy of run_config: record the tightest head
src2 = src.replace(
    "        if viol.any():",
    """        ratio = np.where(f, bound / np.where(err > 0, err, 1), np.inf)
        bi = np.unravel_index(np.argmin(ratio), ratio.shape)
        if ratio[bi] < st.get("best", (np.inf,))[0]:
            st["best"] = (float(ratio[bi]), t, bi, float(err[bi]), float(bound[bi]), int(c.rung[bi]), float(c.e_key[bi]), float(c.e_val[bi]), float(c.e_num[bi]), bool(c.certified[bi]), float(c.tolerance[bi]), np.abs(o64[bi]).max(), np.abs(ref[bi]).max())
        if viol.any():""",
)
ns = {"__file__": audit2.__file__, "__name__": "audit2i"}
exec(compile(src2, "audit2i", "exec"), ns)
ns["draw"] = fams.draw
import step_run_cfgs

ci, fam, s, T = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
B, H, G, D, dt, qdt, pol, L0 = step_run_cfgs.CFGS[ci]
st = ns["run_config"](
    B=B, H=H, G=G, D=D, dtype=dt, qdtype=qdt, policy=pol, L0=L0, T=T, family=fam, seed=1000 * ci + s + 77
)
print(st["viol"], st.get("best"))
