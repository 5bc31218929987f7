"""CPU references (NumPy + ml_dtypes) with the same names and signatures as the ops.

``loomnb.oracle.<name>`` is the truth for ``loomnb.<name>``; each function's docstring and
``docs/numerics.md`` give the rounding points. One module per family, mirroring ``loomnb.ops``
(each public module's ``__all__`` is exported here); ``fp8`` and ``numerics`` hold the shared
conversions. The oracles compute; they do not validate their arguments (the ops do).

What they take: NumPy arrays (bf16 and FP8 as ``ml_dtypes`` dtypes) or torch CPU tensors. Every
function exported here converts each torch tensor argument (also inside a list or tuple) to a
zero-copy NumPy view at entry -- ``torch.bfloat16`` as ``ml_dtypes.bfloat16``,
``torch.float8_e4m3fn`` as ``ml_dtypes.float8_e4m3fn`` and so on -- so an oracle that mutates
an input in place (``fused_add_rms_norm``'s ``x`` and ``residual``) mutates the tensor. Results
are NumPy arrays. A tensor on another device is a :class:`~loomnb.LoomnbTypeError` (the GPU op
is ``loomnb.<name>``). The per-family modules (``loomnb.oracle.norm``, ...) take NumPy only.
"""

import functools as _functools
import importlib as _importlib
import pkgutil as _pkgutil
import sys as _sys

from ..checks import LoomnbTypeError as _LoomnbTypeError
from .fp8 import clamp_fp8, e4m3_decode, e4m3_encode
from .numerics import to_dtype

_SHARED = ("fp8", "numerics")
FAMILIES = tuple(m.name for m in _pkgutil.iter_modules(__path__)
                 if not m.name.startswith("_") and m.name not in _SHARED)


def _as_numpy(value, where: str):
    """``value`` with torch tensors (top level, or items of a list/tuple) as NumPy views."""
    torch = _sys.modules.get("torch")
    if torch is None:  # no torch imported: no tensor can have been passed
        return value
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_as_numpy(v, where) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.device.type != "cpu":
        raise _LoomnbTypeError(f"{where}: the oracles take NumPy arrays or CPU tensors; got a "
                               f"tensor on {value.device} (use loomnb.{where.rsplit('.', 1)[-1]} "
                               "there, or pass .cpu())")
    t = value.detach()
    if t.dtype in (torch.bfloat16,) or "float8" in str(t.dtype):
        import ml_dtypes

        name = str(t.dtype).removeprefix("torch.")
        np_dtype = getattr(ml_dtypes, name, None)
        if np_dtype is None:
            raise _LoomnbTypeError(f"{where}: no NumPy dtype for a {t.dtype} tensor")
        bits = torch.int16 if t.element_size() == 2 else torch.uint8
        return t.view(bits).numpy().view(np_dtype)
    return t.numpy()


def _accepting_tensors(fn):
    """``fn`` taking torch CPU tensors too (module docstring); same name, signature, doc."""
    where = f"loomnb.oracle.{fn.__name__}"

    @_functools.wraps(fn)
    def oracle(*args, **kwargs):
        if _sys.modules.get("torch") is not None:
            args = tuple(_as_numpy(a, where) for a in args)
            kwargs = {k: _as_numpy(v, where) for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    return oracle


__all__ = ["e4m3_encode", "e4m3_decode", "clamp_fp8", "to_dtype"]
for _family in FAMILIES:
    _module = _importlib.import_module(f".{_family}", __name__)
    for _name in _module.__all__:
        globals()[_name] = getattr(_module, _name)
    __all__ += list(_module.__all__)
for _name in __all__:
    globals()[_name] = _accepting_tensors(globals()[_name])
del _family, _module, _name
