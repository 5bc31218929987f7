"""loomnb: fused, memory-bound LLM-inference operators as readable Numba-CUDA kernels.

Each operator is ``loomnb.<name>``; its NumPy/ml_dtypes reference is ``loomnb.oracle.<name>``
with the same signature. On a GPU the ops take device arrays (torch CUDA tensors, CuPy arrays,
numba device arrays) without copying and launch on the caller's current stream; under numba's
CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) they take NumPy arrays (bf16/FP8 as ml_dtypes).
"""

from . import oracle
from .checks import LoomnbError, LoomnbTypeError, LoomnbValueError
from .ops import (fused_add_rms_norm, fused_add_rms_norm_static_fp8_quant, rms_norm,
                  rms_norm_dynamic_per_token_quant, rms_norm_static_fp8_quant)

__version__ = "0.1.0"

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_dynamic_per_token_quant",
           "rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant", "oracle",
           "LoomnbError", "LoomnbTypeError", "LoomnbValueError"]
