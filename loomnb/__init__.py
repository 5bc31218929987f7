"""loomnb: fused, memory-bound LLM-inference operators as readable Numba-CUDA kernels.

Each operator is ``loomnb.<name>``; its NumPy/ml_dtypes reference is ``loomnb.oracle.<name>``
with the same signature. On a GPU the ops take device arrays (torch CUDA tensors, CuPy arrays,
numba device arrays) without copying and launch on the caller's current stream; under numba's
CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) they take NumPy arrays (bf16/FP8 as ml_dtypes).
With torch installed every op is also ``torch.ops.loomnb.<name>`` (torch.compile sees one node).

When loomnb loads its ops: ``import loomnb`` loads them (numba-cuda, and the torch custom ops)
at once when torch is already imported, as in ``import torch, loomnb``; otherwise at the first
use of ``loomnb.<op>``, ``loomnb.ops`` or ``loomnb.oracle``. So the ``loomnb`` command's
``--version`` and ``--help`` import neither numba nor torch. ``import loomnb.ops`` always loads
them (and registers ``torch.ops.loomnb.*``).
"""

import importlib as _importlib
import sys as _sys

from .checks import LoomnbError, LoomnbTypeError, LoomnbValueError

__version__ = "0.1.0"
_EXCEPTIONS = ["LoomnbError", "LoomnbTypeError", "LoomnbValueError"]


_LOADED = []  # [loomnb.ops] once the ops are in this namespace


def _load():
    """Import ``loomnb.ops`` and ``loomnb.oracle`` and put every op into this namespace (once:
    a name deleted afterwards, say by a test's monkeypatch, stays deleted)."""
    if not _LOADED:
        ops = _importlib.import_module(".ops", __name__)
        _importlib.import_module(".oracle", __name__)
        namespace = globals()
        for name in ops.OPS:
            namespace[name] = getattr(ops, name)
        namespace["__all__"] = [*ops.OPS, "oracle", *_EXCEPTIONS]
        _LOADED.append(ops)
    return _LOADED[0]


def __getattr__(name):  # PEP 562: the ops load at their first use
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in ("ops", "oracle"):
        return _importlib.import_module(f".{name}", __name__)
    if not _LOADED:
        _load()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    _load()
    return sorted(set(globals()) | {"ops", "oracle"})


if _sys.modules.get("torch") is not None:  # a torch user: torch.ops.loomnb.* exist right after the import
    _load()
