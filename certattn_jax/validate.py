"""Type checks for user-given scalars, shared by the constructors and entry points that validate them."""

from __future__ import annotations

import math
import numbers
from typing import Any


def is_integer(x: Any) -> bool:
    """A Python or NumPy integer (not a bool, not an integral float such as 2.0)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_finite_number(x: Any) -> bool:
    """A finite real Python or NumPy number (not a bool, NaN or inf)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
