"""loomnb's operators: Numba-CUDA kernels behind contract-checked public functions."""

from .norm import (fused_add_rms_norm, fused_add_rms_norm_static_fp8_quant, rms_norm,
                   rms_norm_dynamic_per_token_quant, rms_norm_static_fp8_quant)

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_dynamic_per_token_quant",
           "rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant"]
