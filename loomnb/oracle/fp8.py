"""CPU reference for FP8 E4M3 (``float8_e4m3fn``) encoding, on top of ml_dtypes.

ml_dtypes' plain cast rounds to nearest even but does not saturate (465 becomes NaN) and keeps a
NaN's sign; CUDA's ``__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`` and Hopper's
``cvt.rn.satfinite.e4m3x2.f32`` saturate to +-448 and return the canonical NaN 0x7F. These
helpers give the CUDA behaviour.
"""

import ml_dtypes
import numpy as np

FP8_MAX = np.float32(448.0)


def e4m3_encode(x):
    """float32 array -> uint8 E4M3 codes, RNE, saturating to +-448, NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float32)
    flat = x.reshape(-1)
    sat = np.clip(flat, -FP8_MAX, FP8_MAX)  # NaN passes through np.clip
    with np.errstate(invalid="ignore"):
        codes = sat.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).copy()
    codes[np.isnan(flat)] = 0x7F
    return codes.reshape(x.shape)


def clamp_fp8(v):
    """``fmaxf(-448, fminf(v, 448))`` in float32: NaN -> +448 (vLLM's quant kernels)."""
    v = np.asarray(v, dtype=np.float32)
    return np.where(np.isnan(v), FP8_MAX, np.clip(v, -FP8_MAX, FP8_MAX)).astype(np.float32)


def e4m3_decode(codes):
    """uint8 E4M3 codes -> float32 (exact)."""
    return np.asarray(codes, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
