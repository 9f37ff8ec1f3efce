"""Type checks for user-given scalars, shared by the constructors and entry points that validate them."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_integer(x: Any) -> bool:
    """A Python or NumPy integer (not a bool, not an integral float such as 2.0)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_finite_number(x: Any) -> bool:
    """A finite real Python or NumPy number (not a bool, NaN or inf)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def checked_counts(x: Any, batch: int, limit: int, name: str) -> tuple[Any, Any | None]:
    """Per-sequence token counts x [batch] (lengths, valid tokens) as int32, each in [0, limit].

    Raises TypeError for a non-integer dtype and ValueError for another shape or, where x holds values (outside
    jit), for a value outside [0, limit] -- checked before the int32 cast, so that 2**32 + 5 does not wrap to 5.
    Inside jit the values cannot be inspected: they come back clipped to [0, limit] together with the mask [batch]
    of the sequences whose count was outside, for the caller to poison (mark non-finite, NaN outputs); outside jit
    the mask is None (nothing to poison: no device array the caller would have to read back, which would wait for
    the device to finish what it runs). Returns (counts int32 [batch], bad bool [batch] or None)."""
    if isinstance(x, (list, tuple)):
        x = np.asarray(x)
    _check_count_array(x, batch, name)
    if not isinstance(x, jax.core.Tracer):
        return jnp.asarray(host_checked_counts(x, batch, limit, name)), None
    bad = (x < 0) | (x > limit)
    return jnp.clip(x, 0, limit).astype(jnp.int32), bad


def host_checked_counts(x: Any, batch: int, limit: int, name: str) -> np.ndarray:
    """`checked_counts` of counts the host holds (a list, tuple, NumPy or concrete jax array [batch]), as a NumPy
    int32 array: no device array made (an eager conversion is a dispatch of its own; a jitted call takes the NumPy
    array in its own transfer). Same errors as `checked_counts`."""
    if isinstance(x, (list, tuple)):
        x = np.asarray(x)
    _check_count_array(x, batch, name)
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name}: host_checked_counts needs values, got a traced array (use checked_counts in jit)")
    values = np.asarray(x).astype(np.int64)
    if np.any(values < 0) or np.any(values > limit):
        raise ValueError(f"{name} must lie in [0, {limit}], got {values.tolist()}")
    return values.astype(np.int32)


def _check_count_array(x: Any, batch: int, name: str) -> None:
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
        raise TypeError(f"{name} must be integers (an array [{batch}]), got {dtype if dtype is not None else type(x)}")
    if tuple(np.shape(x)) != (batch,):
        raise ValueError(f"{name} must be [B] = [{batch}], got shape {tuple(np.shape(x))}")
