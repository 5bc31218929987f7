"""CPU references (NumPy + ml_dtypes) with the same names and signatures as the ops.

``loomnb.oracle.<name>`` is the truth for ``loomnb.<name>``; see each function's docstring and
``../shared/reference/vllm-operator-semantics.md`` (beside the repository) for the rounding points.
"""

from .fp8 import clamp_fp8, e4m3_decode, e4m3_encode
from .norm import (fused_add_rms_norm, fused_add_rms_norm_static_fp8_quant, rms_norm,
                   rms_norm_dynamic_per_token_quant, rms_norm_static_fp8_quant)

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_dynamic_per_token_quant",
           "rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant",
           "e4m3_encode", "e4m3_decode", "clamp_fp8"]
