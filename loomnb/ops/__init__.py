"""loomnb's operators: one module per family (``norm``, ...), each a set of contract-checked
public functions over its ``_<family>_kernels`` module, on the shared scaffold (``_launch``,
``_contract``, ``_vector``, ``_fp8``, ``_reduce``, ``_torch_ops``).

Every public module here is a family; its ``__all__`` lists its ops, which this package (and
``loomnb``) export. A new family is a new module: nothing else needs editing to export it.
"""

import importlib
import pkgutil

from ._launch import clear_launch_cache, launch_cache_info

FAMILIES = tuple(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
OPS = []  # every public op's name, family by family
for _family in FAMILIES:
    _module = importlib.import_module(f".{_family}", __name__)
    for _name in _module.__all__:
        globals()[_name] = getattr(_module, _name)
    OPS += list(_module.__all__)
del _family, _module, _name, importlib, pkgutil
__all__ = ["FAMILIES", "OPS", "launch_cache_info", "clear_launch_cache", *OPS]
