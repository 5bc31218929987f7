"""loomnb: fused, memory-bound LLM-inference operators as readable Numba-CUDA kernels.

Each operator is ``loomnb.<name>``; its NumPy/ml_dtypes reference is ``loomnb.oracle.<name>``
with the same signature. On a GPU the ops take device arrays (torch CUDA tensors, CuPy arrays,
numba device arrays) without copying and launch on the caller's current stream; under numba's
CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) they take NumPy arrays (bf16/FP8 as ml_dtypes).
With torch installed every op is also ``torch.ops.loomnb.<name>`` (torch.compile sees one node).
"""

from . import ops, oracle
from .checks import LoomnbError, LoomnbTypeError, LoomnbValueError

__version__ = "0.1.0"

for _name in ops.OPS:  # every family's ops
    globals()[_name] = getattr(ops, _name)
del _name
__all__ = [*ops.OPS, "oracle", "LoomnbError", "LoomnbTypeError", "LoomnbValueError"]
