"""FP8 E4M3 device helpers every quantising kernel shares: the constants (defined once here and
in ``loomnb.oracle.fp8``), the clamps, correctly rounded division, scales from an amax, UE8M0.

Conventions (vLLM's): stored = real / scale; ``e4m3`` rounds to nearest even and saturates to
+-448; the sign of zero is kept (-0.0 and negative values that round to zero encode as 0x80).
NaN becomes +448 where vLLM clamps with ``fminf`` first (``clamp_fp8``: per-tensor and per-token
quant) and -448 where it clamps with ``fmaxf`` first (``clamp_fp8_nan_low``: group quant).

KV-cache codes (``kv_encoder`` / ``kv_packer`` / ``kv_decoder``, for ``kv_cache_dtype``
``"fp8_e4m3"`` or ``"fp8_e5m2"``): a cache write stores ``fp8(f(v) / scale)`` (IEEE division,
saturating, NaN kept as 0x7F, the sign of zero kept), a cache read gives ``f32(code) * scale``
-- vLLM's ``scaled_convert`` in both directions.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32

from .._numba_internals import SIM, device
from ..layouts.dtypes import (e4m3_to_f32, e5m2_to_f32, f16_to_f32, f32_to_e4m3, f32_to_e5m2,
                              pack_e4m3x2, pack_e5m2x2, unpack_e4m3x2)
from ..oracle.fp8 import FP8_MAX, FP8_MIN_SCALE, UE8M0_FLOOR  # noqa: F401 (re-exported)
from ._reduce import fmax_nan, fmin_nan

_MAX = float(FP8_MAX)
_MIN_SCALE = float(FP8_MIN_SCALE)
_UE8M0_FLOOR = float(UE8M0_FLOOR)
_DIV_LO, _DIV_HI = 2.0 ** -125, 2.0 ** 125  # divisors for which div_rn's FMA correction is exact
_Q_LO = 2.0 ** -100                         # ... and quotients from which it is

if SIM:
    @device
    def clamp_fp8(v):
        """``fminf(v, 448)``: see the GPU twin."""
        return np.fmin(np.float32(v), np.float32(_MAX))

    @device
    def clamp_fp8_nan_low(v):
        """``fminf(fmaxf(v, -448), 448)``: NaN -> -448."""
        return np.fmin(np.fmax(np.float32(v), np.float32(-_MAX)), np.float32(_MAX))

    @device
    def div_rn(a, b, rb):
        """``a / b`` rounded to nearest (IEEE float32 division)."""
        return np.float32(a) / np.float32(b)

    @device
    def ue8m0(s):
        """``exp2f(ceilf(log2f(fmaxf(s, 1e-10))))``: log2 rounded to float32 first, as log2f;
        NumPy's functions so that an infinite scale gives +inf (as on the GPU) and a NaN one the
        floor's power of two (``fmaxf`` drops the NaN)."""
        v = np.fmax(np.float32(s), np.float32(_UE8M0_FLOOR))
        return np.float32(np.exp2(np.ceil(np.float32(np.log2(np.float64(v))))))
else:
    from numba.cuda import libdevice

    @device
    def clamp_fp8(v):
        """vLLM's ``fmaxf(-448, fminf(v, 448))`` before the E4M3 encode, in one instruction:
        ``fminf`` turns a NaN into +448 and caps the top; the saturating encoder
        (``cvt.rn.satfinite``) already maps everything below -448 to -448."""
        return libdevice.fminf(v, float32(_MAX))

    @device
    def clamp_fp8_nan_low(v):
        """``fminf(fmaxf(v, -448), 448)``: NaN -> -448 (vLLM's group quant clamps max first)."""
        return libdevice.fminf(libdevice.fmaxf(v, float32(-_MAX)), float32(_MAX))

    @device
    def div_rn(a, b, rb):
        """``a / b`` correctly rounded, from ``rb = RN(1/b)`` (computed once per row or group):
        one correction step with exact FMA remainders (Markstein's theorem), which avoids a full
        ``div.rn.f32`` per element. The theorem needs ``b`` and ``1/b`` normal and the quotient
        finite and normal: a scale outside ``[2^-125, 2^125]`` (subnormal, zero, huge, infinite
        or NaN -- a group of tiny values with ``eps = 0``, an unchecked ``scale_ub``) takes
        IEEE's ``div.rn.f32`` instead (the branch is uniform: one scale per row or group), as
        does a quotient below 2^-100 (rare: it encodes as a signed FP8 zero either way); a
        quotient that overflows returns the signed infinity ``a * rb``. When the remainder is
        zero the quotient is exact and returned as is: the correction ``fma(+0, rb, -0)`` would
        turn -0.0 into +0.0; when it is NaN (``a`` infinite) the quotient already is IEEE's.
        ``tests/test_fp8_gpu.py`` checks it against IEEE division, signed zeros, subnormal and
        huge divisors included."""
        if not (abs(b) >= float32(_DIV_LO) and abs(b) <= float32(_DIV_HI)):
            return a / b
        q = a * rb
        if abs(q) < float32(_Q_LO):  # the remainder could underflow: IEEE (zeros stay signed)
            return a / b
        r = cuda.fma(-q, b, a)
        if not abs(r) > float32(0) or not abs(q) < float32(np.inf):  # q exact, or a / b not finite
            return q
        return cuda.fma(r, rb, q)

    @device
    def ue8m0(s):
        """``exp2f(ceilf(log2f(max(s, 1e-10))))`` with libdevice's ``log2f`` (vLLM's
        ``per_token_group_quant.cu``): a scale just above a power of two may round down to it."""
        v = libdevice.fmaxf(s, float32(_UE8M0_FLOOR))
        return libdevice.exp2f(libdevice.ceilf(libdevice.log2f(v)))


@device
def scale_from_amax(amax, ub, has_ub):
    """Per-token scale: ``fmaxf(fminf(amax, ub) / 448, 1 / (448 * 512))`` (``ub`` clips the
    amax; ``fminf`` ignores a NaN ``ub``, as vLLM's kernel)."""
    if has_ub:
        amax = fmin_nan(amax, ub)
    return fmax_nan(amax / float32(_MAX), float32(_MIN_SCALE))


def kv_encoder(kv):
    """``enc(v, scale) -> code``: the FP8 code of ``v / scale`` (IEEE division, saturating, NaN
    kept) for ``kv`` = ``"fp8_e4m3"`` or ``"fp8_e5m2"``."""
    conv = f32_to_e4m3 if kv == "fp8_e4m3" else f32_to_e5m2

    @device
    def enc(v, scale):
        return conv(v / scale)

    return enc


def kv_packer(kv):
    """``pack_words(vals, b, scale) -> (lo, hi)``: the two words of the 8 FP8 codes of
    ``vals[b:b+8] / scale`` (code 0 in the lowest byte), for an 8-byte store."""
    pack = pack_e4m3x2 if kv == "fp8_e4m3" else pack_e5m2x2

    @device
    def pack_words(vals, b, scale):
        lo = (int(pack(vals[b + 3] / scale, vals[b + 2] / scale)) << 16) | int(
            pack(vals[b + 1] / scale, vals[b] / scale))
        hi = (int(pack(vals[b + 7] / scale, vals[b + 6] / scale)) << 16) | int(
            pack(vals[b + 5] / scale, vals[b + 4] / scale))
        return lo, hi

    return pack_words


def kv_decoder(kv):
    """``dec(code, scale) -> float32``: ``f32(code) * scale`` (exact decode, one rounded
    product), for ``kv`` = ``"fp8_e4m3"`` or ``"fp8_e5m2"``."""
    conv = e4m3_to_f32 if kv == "fp8_e4m3" else e5m2_to_f32

    @device
    def dec(c, scale):
        return conv(c) * scale

    return dec


def kv_pair_decoder(kv):
    """``dec2(w, scale) -> (lo, hi)``: the two FP8 codes in the low 16 bits of ``w`` (code 0 in
    bits 7..0) as ``f32(code) * scale`` -- E4M3 through the hardware's ``cvt.rn.f16x2.e4m3x2``
    (exact), E5M2 as the top byte of an fp16 (exact); the simulator decodes portably."""
    if kv == "fp8_e4m3":
        @device
        def dec2(w, scale):
            lo, hi = unpack_e4m3x2(w & 0xFFFF)
            return lo * scale, hi * scale
    else:
        @device
        def dec2(w, scale):
            w = int(w)
            return f16_to_f32((w & 0xFF) << 8) * scale, f16_to_f32(w & 0xFF00) * scale
    return dec2
