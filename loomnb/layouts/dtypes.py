"""bf16, fp16 and FP8 (E4M3, E5M2) packing as device functions (usable inside ``@cuda.jit`` kernels).

Storage convention inside kernels: bf16 and fp16 values travel as their ``uint16`` bit patterns,
FP8 E4M3 (``float8_e4m3fn``) as ``uint8`` codes, and arithmetic happens in float32 (the
``f(a)`` of vLLM's semantics). ``r(x)`` -- round a float32 to the activation dtype -- is
``*_round``.

Two implementations of every conversion:

* **portable**: integer bit manipulation only, so it runs identically on the GPU and under
  numba's CUDA simulator (which has no bf16, fp16 or FP8 types). Round-to-nearest-even;
  NaN becomes the CUDA canonical NaN (bf16/fp16 ``0x7FFF``, E4M3 and E5M2 ``0x7F``); E4M3
  saturates to +-448 and E5M2 to +-57344 (``__NV_SATFINITE``, infinities included), never
  producing NaN from a finite input.
* **hardware** (GPU only): Hopper's ``cvt`` instructions through
  :mod:`loomnb._numba_internals`. ``tests/test_norm_gpu.py`` and ``tests/test_fp8_gpu.py`` prove
  them bit-identical to the portable functions over all inputs that matter, and the kernels use
  them on the GPU.

Decoding (``*_to_f32``, ``unpack_e4m3x2``) is exact in both. Matches: CUDA's ``__float2bfloat16_rn``,
``__float2half_rn``, ``__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)``; on the CPU the
oracles use ml_dtypes, which differs only in NaN payloads (it keeps the sign) and in not
saturating E4M3 (it returns NaN above 464): see ``loomnb.oracle.fp8``.
"""

from __future__ import annotations

import numpy as np
from numba import float32, int32, uint32  # noqa: F401 (int32, uint32: the GPU path)

from .._numba_internals import SIM, device

if SIM:
    @device
    def f32_bits(x):
        """float32 -> its IEEE bit pattern as a non-negative integer < 2**32."""
        return int(np.float32(x).view(np.uint32))

    @device
    def bits_f32(b):
        """Bit pattern (integer < 2**32) -> float32."""
        return np.uint32(b & 0xFFFFFFFF).view(np.float32)
else:
    from numba.cuda import libdevice

    @device
    def f32_bits(x):
        """float32 -> its IEEE bit pattern as a uint32."""
        return uint32(libdevice.float_as_int(x))

    @device
    def bits_f32(b):
        """Bit pattern -> float32."""
        return libdevice.int_as_float(int32(b))


# ---------------------------------------------------------------- bf16 --------------------

@device
def bf16_to_f32(h):
    """bf16 bits -> float32 (exact)."""
    return bits_f32((int(h) & 0xFFFF) << 16)


@device
def f32_to_bf16_portable(x):
    """float32 -> bf16 bits, round to nearest even; NaN -> 0x7FFF."""
    u = int(f32_bits(x))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FFF
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


# ---------------------------------------------------------------- fp16 --------------------

@device
def f16_to_f32_portable(h):
    """fp16 bits -> float32 (exact, subnormals included)."""
    h = int(h)
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        return bits_f32(sign | 0x7F800000 | (m << 13))
    if e == 0:
        v = float32(m) * float32(5.9604644775390625e-08)  # m * 2**-24, exact
        return -v if sign else v
    return bits_f32(sign | ((e + 112) << 23) | (m << 13))


@device
def f32_to_f16_portable(x):
    """float32 -> fp16 bits, round to nearest even, overflow to inf; NaN -> 0x7FFF."""
    u = int(f32_bits(x))
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        return 0x7FFF
    if a >= 0x477FF000:  # >= 65520 rounds to inf
        return sign | 0x7C00
    if a < 0x38800000:  # below 2**-14: fp16 subnormal, steps of 2**-24
        v = bits_f32(a) * float32(16777216.0)
        q = (v + float32(12582912.0)) - float32(12582912.0)  # RNE to an integer (< 2**22)
        return sign | int(q)
    return sign | ((a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13)


# ---------------------------------------------------------------- fp8 e4m3 ----------------

@device
def e4m3_to_f32(c):
    """FP8 E4M3 (float8_e4m3fn) code -> float32 (exact); 0x7F/0xFF are NaN."""
    c = int(c)
    sign = (c & 0x80) << 24
    e = (c >> 3) & 0xF
    m = c & 7
    if (c & 0x7F) == 0x7F:
        return bits_f32(sign | 0x7FC00000)
    if e == 0:
        v = float32(m) * float32(0.001953125)  # m * 2**-9
        return -v if sign else v
    return bits_f32(sign | ((e + 120) << 23) | (m << 20))


@device
def f32_to_e4m3_portable(x):
    """float32 -> FP8 E4M3 code: RNE, saturate to +-448, NaN -> 0x7F (``__NV_SATFINITE``)."""
    u = int(f32_bits(x))
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        return 0x7F
    if a >= 0x43E00000:  # |x| >= 448
        return sign | 0x7E
    if a >= 0x3C800000:  # |x| >= 2**-6: normal; drop 20 mantissa bits with RNE, rebias 127 -> 7
        return sign | (((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960)
    v = bits_f32(a) * float32(512.0)  # subnormal: steps of 2**-9
    q = (v + float32(12582912.0)) - float32(12582912.0)
    return sign | int(q)


# ---------------------------------------------------------------- fp8 e5m2 ----------------

@device
def e5m2_to_f32(c):
    """FP8 E5M2 (float8_e5m2) code -> float32 (exact): the code is the top byte of an fp16."""
    return f16_to_f32_portable(int(c) << 8)


@device
def f32_to_e5m2_portable(x):
    """float32 -> FP8 E5M2 code: RNE, finite overflow and inf saturate to +-57344 (0x7B),
    NaN -> 0x7F (``__NV_SATFINITE``, ``cvt.rn.satfinite.e5m2x2.f32``)."""
    u = int(f32_bits(x))
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        return 0x7F
    if a >= 0x47600000:  # |x| >= 57344: the largest finite value, or saturated to it
        return sign | 0x7B
    if a >= 0x38800000:  # |x| >= 2**-14: normal; drop 21 mantissa bits with RNE, rebias 127 -> 15
        return sign | (((a + 0xFFFFF + ((a >> 21) & 1)) >> 21) - 448)
    v = bits_f32(a) * float32(65536.0)  # subnormal: steps of 2**-16
    q = (v + float32(12582912.0)) - float32(12582912.0)
    return sign | int(q)


# ---------------------------------------------------------------- hardware selection ------

if SIM:
    f32_to_bf16 = f32_to_bf16_portable
    f32_to_f16 = f32_to_f16_portable
    f16_to_f32 = f16_to_f32_portable
    f32_to_e4m3 = f32_to_e4m3_portable

    @device
    def pack_bf16x2(hi, lo):
        """Two float32 -> one uint32 of two bf16 (``hi`` in the upper half)."""
        return (int(f32_to_bf16_portable(hi)) << 16) | int(f32_to_bf16_portable(lo))

    @device
    def pack_f16x2(hi, lo):
        """Two float32 -> one uint32 of two fp16 (``hi`` in the upper half)."""
        return (int(f32_to_f16_portable(hi)) << 16) | int(f32_to_f16_portable(lo))

    @device
    def pack_e4m3x2(hi, lo):
        """Two float32 -> 16 bits of two E4M3 codes (``hi`` in bits 15..8)."""
        return (int(f32_to_e4m3_portable(hi)) << 8) | int(f32_to_e4m3_portable(lo))

    f32_to_e5m2 = f32_to_e5m2_portable

    @device
    def pack_e5m2x2(hi, lo):
        """Two float32 -> 16 bits of two E5M2 codes (``hi`` in bits 15..8)."""
        return (int(f32_to_e5m2_portable(hi)) << 8) | int(f32_to_e5m2_portable(lo))
else:
    from .._numba_internals import cvt_bf16x2, cvt_e4m3x2, cvt_e5m2x2, cvt_f16_to_f32, cvt_f16x2

    pack_bf16x2 = cvt_bf16x2
    pack_f16x2 = cvt_f16x2
    pack_e4m3x2 = cvt_e4m3x2
    pack_e5m2x2 = cvt_e5m2x2

    @device
    def f32_to_e5m2(x):
        """float32 -> E5M2 code (hardware ``cvt.rn.satfinite.e5m2x2.f32``)."""
        return cvt_e5m2x2(float32(0), x) & 0xFF

    @device
    def f32_to_bf16(x):
        """float32 -> bf16 bits (hardware ``cvt.rn.bf16x2.f32``)."""
        return cvt_bf16x2(float32(0), x) & 0xFFFF

    @device
    def f32_to_f16(x):
        """float32 -> fp16 bits (hardware ``cvt.rn.f16x2.f32``)."""
        return cvt_f16x2(float32(0), x) & 0xFFFF

    @device
    def f16_to_f32(h):
        """fp16 bits -> float32 (hardware ``cvt.f32.f16``)."""
        return cvt_f16_to_f32(uint32(h))

    @device
    def f32_to_e4m3(x):
        """float32 -> E4M3 code (hardware ``cvt.rn.satfinite.e4m3x2.f32``)."""
        return cvt_e4m3x2(float32(0), x) & 0xFF


if SIM:
    @device
    def unpack_e4m3x2(w):
        """Two FP8 E4M3 codes (bits 7..0 and 15..8 of ``w``) -> ``(lo, hi)`` float32, exact."""
        w = int(w)
        return e4m3_to_f32(w & 0xFF), e4m3_to_f32((w >> 8) & 0xFF)
else:
    from .._numba_internals import cvt_f16x2_e4m3x2

    @device
    def unpack_e4m3x2(w):
        """Two FP8 E4M3 codes -> ``(lo, hi)`` float32 (hardware ``cvt.rn.f16x2.e4m3x2``, then
        ``cvt.f32.f16``; both exact). ``tests/test_attention_gpu.py`` proves it equal to the
        portable :func:`e4m3_to_f32` for all 65536 code pairs."""
        h = cvt_f16x2_e4m3x2(uint32(w))
        return cvt_f16_to_f32(h & 0xFFFF), cvt_f16_to_f32(h >> 16)


@device
def bf16_round(x):
    """``r(x)`` for bf16: round a float32 to bf16 and widen it back."""
    return bf16_to_f32(f32_to_bf16(x))


@device
def f16_round(x):
    """``r(x)`` for fp16: round a float32 to fp16 and widen it back."""
    return f16_to_f32(f32_to_f16(x))
