"""CPU reference for FP8 E4M3 (``float8_e4m3fn``) encoding, on top of ml_dtypes.

ml_dtypes' plain cast rounds to nearest even but does not saturate (465 becomes NaN) and keeps a
NaN's sign; CUDA's ``__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`` and Hopper's
``cvt.rn.satfinite.e4m3x2.f32`` saturate to +-448 and return the canonical NaN 0x7F. These
helpers give the CUDA behaviour.
"""

import ml_dtypes
import numpy as np

FP8_MAX = np.float32(448.0)
FP8_MIN_SCALE = np.float32(1.0) / np.float32(448.0 * 512.0)  # vLLM's min_scaling_factor<fp8>
UE8M0_FLOOR = np.float32(1e-10)  # the log2 argument floor of UE8M0 scales


def _encode_satfinite(x, fp8_dtype, fp8_max):
    """float32 array -> uint8 codes of ``fp8_dtype`` (an ml_dtypes FP8 type), same shape: RNE
    after clipping to +-``fp8_max`` (so ml_dtypes' overflow to NaN or inf never happens), NaN
    -> the canonical 0x7F, the sign of zero kept."""
    x = np.asarray(x, dtype=np.float32)
    flat = x.reshape(-1)
    sat = np.clip(flat, -fp8_max, fp8_max)  # NaN passes through np.clip
    with np.errstate(invalid="ignore"):
        codes = sat.astype(fp8_dtype).view(np.uint8).copy()
    codes[np.isnan(flat)] = 0x7F
    return codes.reshape(x.shape)


def e4m3_encode(x):
    """float32 array -> uint8 E4M3 codes, RNE, saturating to +-448, NaN -> 0x7F."""
    return _encode_satfinite(x, ml_dtypes.float8_e4m3fn, FP8_MAX)


def clamp_fp8(v):
    """``fmaxf(-448, fminf(v, 448))`` in float32: NaN -> +448 (vLLM's per-tensor and per-token
    quant kernels)."""
    v = np.asarray(v, dtype=np.float32)
    return np.where(np.isnan(v), FP8_MAX, np.clip(v, -FP8_MAX, FP8_MAX)).astype(np.float32)


def clamp_fp8_nan_low(v):
    """``fminf(fmaxf(v, -448), 448)``: NaN -> -448 (vLLM's per-token-group quant)."""
    v = np.asarray(v, dtype=np.float32)
    return np.where(np.isnan(v), -FP8_MAX, np.clip(v, -FP8_MAX, FP8_MAX)).astype(np.float32)


def scale_from_amax(amax, scale_ub=None):
    """Per-token scale ``fmaxf(fminf(amax, ub) / 448, 1 / (448 * 512))`` in float32 (``fminf``
    and ``fmaxf`` ignore a NaN operand, as CUDA's)."""
    amax = np.asarray(amax, dtype=np.float32)
    if scale_ub is not None:
        amax = np.fmin(amax, np.float32(np.asarray(scale_ub, dtype=np.float32).reshape(-1)[0]))
    return np.fmax(amax / FP8_MAX, FP8_MIN_SCALE).astype(np.float32)


def ue8m0(s):
    """``exp2f(ceilf(log2f(max(s, 1e-10))))``: log2 correctly rounded to float32 before the
    ceiling (so a scale just above a power of two can round down to it), never "the next power
    of two from the exponent bits"."""
    s = np.fmax(np.asarray(s, dtype=np.float32), UE8M0_FLOOR)  # fmaxf: a NaN gives the floor
    lg = np.log2(s.astype(np.float64)).astype(np.float32)
    return np.exp2(np.ceil(lg)).astype(np.float32)


def e4m3_decode(codes):
    """uint8 E4M3 codes -> float32 (exact)."""
    return np.asarray(codes, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


# ---------------------------------------------------------------- FP8 E5M2 (float8_e5m2)
FP8_E5M2_MAX = np.float32(57344.0)


def e5m2_encode(x):
    """float32 array -> uint8 E5M2 (``float8_e5m2``) codes as CUDA's
    ``__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2)`` / ``cvt.rn.satfinite.e5m2x2.f32``:
    round to nearest even, finite overflow and infinities saturate to +-57344 (0x7B/0xFB), NaN
    -> the canonical 0x7F, the sign of zero kept. (ml_dtypes' cast overflows to inf instead.)"""
    return _encode_satfinite(x, ml_dtypes.float8_e5m2, FP8_E5M2_MAX)


def e5m2_decode(codes):
    """uint8 E5M2 codes -> float32 (exact)."""
    return np.asarray(codes, dtype=np.uint8).view(ml_dtypes.float8_e5m2).astype(np.float32)
