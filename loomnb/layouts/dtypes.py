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


# ---------------------------------------------------------------- minifloat codecs --------
# fp16, E4M3 and E5M2 are one sign bit, ``exp_bits`` exponent bits (bias
# ``2**(exp_bits - 1) - 1``) and ``man_bits`` mantissa bits; one decoder and one encoder serve
# all three, their constants fixed when the device function is made.

def _decoder(name, exp_bits, man_bits, ieee, doc):
    """Device function ``code -> float32``, exact (subnormals included), named ``name`` with
    docstring ``doc``.

    ``ieee``: the all-ones exponent is inf/NaN, the payload kept (fp16); else (E4M3's
    ``fn`` format) only the all-ones exponent and mantissa is NaN (canonical, sign kept) and the
    rest of that exponent are normal numbers."""
    width = 1 + exp_bits + man_bits
    SIGN, SIGN_UP = 1 << (width - 1), 32 - width  # the sign bit, and how far it moves up
    NAN = SIGN - 1                                  # E4M3: the NaN code less the sign
    EMAX, MMASK = (1 << exp_bits) - 1, (1 << man_bits) - 1
    bias = EMAX >> 1
    REBIAS, SHIFT = 127 - bias, 23 - man_bits
    SUB = 2.0 ** (1 - bias - man_bits)              # a subnormal is m * SUB, exact in float32

    def decode(c):
        c = int(c)
        sign = (c & SIGN) << SIGN_UP
        e = (c >> man_bits) & EMAX
        m = c & MMASK
        if ieee:
            if e == EMAX:
                return bits_f32(sign | 0x7F800000 | (m << SHIFT))
        elif (c & NAN) == NAN:
            return bits_f32(sign | 0x7FC00000)
        if e == 0:
            v = float32(m) * float32(SUB)
            return -v if sign else v
        return bits_f32(sign | ((e + REBIAS) << 23) | (m << SHIFT))

    decode.__name__ = decode.__qualname__ = name
    decode.__doc__ = doc
    return device(decode)


def _encoder(name, exp_bits, man_bits, over, over_code, doc):
    """Device function ``float32 -> code``, named ``name`` with docstring ``doc``: round to
    nearest even, NaN -> the canonical ``0x7F..`` (all bits but the sign), ``|x|`` at or above
    the float32 with bits ``over`` -> ``sign | over_code`` (the largest finite code for FP8's
    saturation, inf for fp16's overflow); the sign of zero kept."""
    width = 1 + exp_bits + man_bits
    SIGN, SIGN_DOWN = 1 << (width - 1), 32 - width
    NAN = SIGN - 1
    bias = ((1 << exp_bits) - 1) >> 1
    DROP = 23 - man_bits                          # float32 mantissa bits dropped
    HALF = (1 << (DROP - 1)) - 1                  # RNE: add half less one, plus the kept lsb
    MIN_NORMAL = (128 - bias) << 23               # float32 bits of 2**(1 - bias)
    REBIAS = (127 - bias) << man_bits             # exponent 127 -> bias, after the shift
    SUB = 2.0 ** (bias - 1 + man_bits)            # subnormal steps of 2**(1 - bias - man_bits)

    def encode(x):
        u = int(f32_bits(x))
        sign = (u >> SIGN_DOWN) & SIGN
        a = u & 0x7FFFFFFF
        if a > 0x7F800000:
            return NAN
        if a >= over:
            return sign | over_code
        if a >= MIN_NORMAL:
            return sign | (((a + HALF + ((a >> DROP) & 1)) >> DROP) - REBIAS)
        v = bits_f32(a) * float32(SUB)
        q = (v + float32(12582912.0)) - float32(12582912.0)  # RNE to an integer (< 2**22)
        return sign | int(q)

    encode.__name__ = encode.__qualname__ = name
    encode.__doc__ = doc
    return device(encode)


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

f16_to_f32_portable = _decoder("f16_to_f32_portable", 5, 10, ieee=True,
                               doc="fp16 bits -> float32 (exact, subnormals included).")
f32_to_f16_portable = _encoder(
    "f32_to_f16_portable", 5, 10, over=0x477FF000, over_code=0x7C00,  # 65520 (65504 + half an ulp)
    doc="float32 -> fp16 bits, round to nearest even, overflow to inf; NaN -> 0x7FFF.")

# ---------------------------------------------------------------- fp8 e4m3 ----------------

e4m3_to_f32 = _decoder("e4m3_to_f32", 4, 3, ieee=False,
                       doc="FP8 E4M3 (float8_e4m3fn) code -> float32 (exact); 0x7F/0xFF are NaN.")
f32_to_e4m3_portable = _encoder(
    "f32_to_e4m3_portable", 4, 3, over=0x43E00000, over_code=0x7E,  # 448, the largest finite
    doc="float32 -> FP8 E4M3 code: RNE, saturate to +-448, NaN -> 0x7F (``__NV_SATFINITE``).")

# ---------------------------------------------------------------- fp8 e5m2 ----------------

@device
def e5m2_to_f32(c):
    """FP8 E5M2 (float8_e5m2) code -> float32 (exact): the code is the top byte of an fp16."""
    return f16_to_f32_portable(int(c) << 8)


f32_to_e5m2_portable = _encoder(
    "f32_to_e5m2_portable", 5, 2, over=0x47600000, over_code=0x7B,  # 57344, the largest finite
    doc="float32 -> FP8 E5M2 code: RNE, finite overflow and inf saturate to +-57344 (0x7B), NaN "
        "-> 0x7F (``__NV_SATFINITE``, ``cvt.rn.satfinite.e5m2x2.f32``).")


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
