"""CPU references (NumPy + ml_dtypes) with the same names and signatures as the ops.

``loomnb.oracle.<name>`` is the truth for ``loomnb.<name>``; each function's docstring and
``docs/numerics.md`` give the rounding points. One module per family, mirroring ``loomnb.ops``
(each public module's ``__all__`` is exported here); ``fp8`` and ``numerics`` hold the shared
conversions. The oracles compute; they do not validate their arguments (the ops do).
"""

import importlib
import pkgutil

from .fp8 import clamp_fp8, e4m3_decode, e4m3_encode
from .numerics import to_dtype

_SHARED = ("fp8", "numerics")
FAMILIES = tuple(m.name for m in pkgutil.iter_modules(__path__)
                 if not m.name.startswith("_") and m.name not in _SHARED)
__all__ = ["e4m3_encode", "e4m3_decode", "clamp_fp8", "to_dtype"]
for _family in FAMILIES:
    _module = importlib.import_module(f".{_family}", __name__)
    for _name in _module.__all__:
        globals()[_name] = getattr(_module, _name)
    __all__ += list(_module.__all__)
del _family, _module, _name
