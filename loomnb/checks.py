"""loomnb's exceptions and the argument checks every public op runs before a launch.

Every message names the argument, what was expected and what was received. Nothing here
coerces: a wrong dtype or layout is rejected, never silently cast or copied.
"""

from __future__ import annotations

import numpy as np

from ._dtypes import DTYPES


class LoomnbError(Exception):
    """Base class of loomnb's errors."""


class LoomnbValueError(LoomnbError, ValueError):
    """A bad shape, layout, value or combination of arguments."""


class LoomnbTypeError(LoomnbError, TypeError):
    """A bad dtype or kind of array (host array where a device array is needed, ...)."""


def fail_type(op, name, expected, got):
    raise LoomnbTypeError(f"{op}: argument '{name}' must be {expected}; got {got}")


def fail_value(op, name, expected, got):
    raise LoomnbValueError(f"{op}: argument '{name}' must be {expected}; got {got}")


def check_kind(op, name, arr, allowed):
    """``arr.kind`` (a kind of ``loomnb._dtypes.DTYPES``) must be in ``allowed``."""
    if arr.kind not in allowed:
        fail_type(op, name, "of dtype " + " or ".join(DTYPES[k].name for k in allowed),
                  f"dtype {arr.dtype_name}")


def check_same_kind(op, name, arr, ref_name, ref):
    if arr.kind != ref.kind:
        fail_type(op, name, f"of the same dtype as '{ref_name}' ({ref.dtype_name})",
                  f"dtype {arr.dtype_name}")


def check_ndim(op, name, arr, ndim):
    if arr.ndim != ndim:
        fail_value(op, name, f"{ndim}-D", f"a {arr.ndim}-D array of shape {list(arr.shape)}")


def check_shape(op, name, arr, shape, dims):
    """``arr.shape == shape``; ``dims`` names the symbolic dims for the message."""
    if tuple(arr.shape) != tuple(shape):
        fail_value(op, name, f"of shape {list(shape)} ({dims})", f"shape {list(arr.shape)}")


def check_same_device(op, name, arr, ref_name, ref):
    if arr.device != ref.device:
        fail_value(op, name, f"on the same device as '{ref_name}' (cuda:{ref.device})",
                   f"an array on cuda:{arr.device}")


def check_eps(op, eps):
    if isinstance(eps, (bool, str, bytes)) or not isinstance(eps, (int, float, np.integer, np.floating)):
        fail_type(op, "eps", "a real number", repr(eps))
    e = float(eps)
    if not (e >= 0.0) or e == float("inf"):
        fail_value(op, "eps", "finite and >= 0", repr(eps))
    return e


def check_writable(op, name, arr):
    """An array the op writes must be writable (a read-only NumPy array, or a
    ``__cuda_array_interface__`` whose ``data`` says read-only, is rejected before any launch)."""
    if arr.readonly:
        fail_value(op, name, "a writable array", "a read-only array")
