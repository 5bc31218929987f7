"""The RMSNorm-family kernels: one kernel body, specialised at compile time per dtype and variant.

One thread block per token (row). Each thread walks its row with a stride of the block size:

* pass 1: the sum of squares of ``s`` (fp32), reduced over the block; for the fused-add
  variants ``residual <- z = r(x + residual)`` is written here and ``s = z``;
* ``inv = r32(1 / sqrt(ss / hidden_size + eps))`` with ``ss`` accumulated and ``inv`` computed in
  float64 (see :func:`inv_rms`);
* dynamic quant only: pass 2, the row's ``amax`` of the normalised values;
* last pass: ``n = r(r(s * inv) * w)`` written as the activation dtype, or as FP8 E4M3.

Three layouts of the same body: a *scalar* kernel that reads one element per step (any hidden
size, any alignment); a *vector* kernel for bf16/fp16 that moves 16 bytes (8 elements) per load
and store, used when the rows allow it (see ``ops.norm.vector_ok``); and its *cached* form, the
fast path, in which each thread loads its ``vpt`` 16-byte units of the row once, all loads in
flight together, and keeps them in registers for every later pass (no re-read). Rows past 2**31
elements are fine: numba indexes with 64-bit integers.

Variants (``variant``):

==================  =====================================================================
``rms``             out <- rms_norm(x)                                   (vLLM ``rms_norm``)
``add``             residual <- z = r(x + residual); x <- rms_norm(z)    (``fused_add_rms_norm``)
``static``          out <- e4m3(clamp(rms_norm(x) * (1/scale)))          (``rms_norm_static_fp8_quant``)
``add_static``      residual <- z; out <- e4m3(clamp(rms_norm(z) * (1/scale)))
``dynamic``         per-token scale = max(min(amax, ub)/448, 1/(448*512)); out <- e4m3(clamp(n/scale))
``dynamic_res``     as ``dynamic`` on the fp32 sum s = x + residual, residual <- r(s)
==================  =====================================================================
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, uint32

from .._numba_internals import SIM, device
from ..layouts.dtypes import (bf16_round, bf16_to_f32, bits_f32, f16_round, f16_to_f32,
                              f32_to_bf16, f32_to_e4m3, f32_to_f16, pack_bf16x2, pack_e4m3x2,
                              pack_f16x2)
from ._reduce import block_max, block_sum64, fmax_nan

VARIANTS = ("rms", "add", "static", "add_static", "dynamic", "dynamic_res")
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)  # vLLM's min_scaling_factor<fp8>
FLAG_SCALE_UB = 1

if SIM:
    @device
    def load_u32x4(a, row, col):
        return a[row, col], a[row, col + 1], a[row, col + 2], a[row, col + 3]

    @device
    def store_u32x4(a, row, col, v):
        for k in range(4):
            a[row, col + k] = v[k]

    @device
    def store_u32x2(a, row, col, v):
        a[row, col] = v[0]
        a[row, col + 1] = v[1]
else:
    from .._numba_internals import load_u32x4, store_u32x2, store_u32x4


@device
def _ident(x):
    return float32(x)


@device
def _bf16_pair(w):
    w = int(w)
    return bf16_to_f32(w & 0xFFFF), bits_f32(w & 0xFFFF0000)


@device
def _f16_pair(w):
    w = int(w)
    return f16_to_f32(w & 0xFFFF), f16_to_f32(w >> 16)


# (decode one element, encode one element, r(x), decode a word of two, pack two into a word)
_CODECS = {
    "bf16": (bf16_to_f32, f32_to_bf16, bf16_round, _bf16_pair, pack_bf16x2),
    "f16": (f16_to_f32, f32_to_f16, f16_round, _f16_pair, pack_f16x2),
    "f32": (_ident, _ident, _ident, None, None),
}


@device
def inv_rms(ss, H, eps):
    """``r32(1 / sqrt(ss / H + eps))`` in float64, ``ss`` the float64 sum of squares.

    vLLM computes ``rsqrtf(ss32 / H + eps)`` from a float32 CUB reduction, so its result depends
    on the block size and summation order (not batch-invariant) and carries rsqrt.approx's ~2 ulp.
    Accumulating the squares in float64 (exact products of bf16/fp16 values, 2^-53 relative per
    addition) and taking the square root and reciprocal in float64 makes ``inv`` the correctly
    rounded value for all practical purposes: independent of order and launch configuration and
    equal to the oracle's. The elementwise rounding points are vLLM's.
    """
    return float32(float64(1.0) / math.sqrt(ss / float64(H) + float64(eps)))


if SIM:
    @device
    def div_rn(a, b, rb):
        """``a / b`` rounded to nearest (IEEE float32 division)."""
        return a / b
else:
    @device
    def div_rn(a, b, rb):
        """``a / b`` correctly rounded, from ``rb = RN(1/b)`` (computed once per row): one
        correction step with exact FMA remainders (Markstein's theorem), which avoids a full
        ``div.rn.f32`` per element. ``tests/test_gpu_norm.py`` checks it against IEEE division.
        """
        q = a * rb
        r = cuda.fma(-q, b, a)
        return cuda.fma(r, rb, q)


if SIM:
    @device
    def _clamp_fp8(v):
        """``fminf(v, 448)``: see the GPU twin."""
        return np.fmin(np.float32(v), np.float32(FP8_MAX))
else:
    from numba.cuda import libdevice

    @device
    def _clamp_fp8(v):
        """vLLM's ``fmaxf(-448, fminf(v, 448))`` before the E4M3 encode, in one instruction:
        ``fminf`` turns a NaN into +448 and caps the top; the saturating encoder
        (``cvt.rn.satfinite``) already maps everything below -448 to -448."""
        return libdevice.fminf(v, float32(FP8_MAX))


@device
def _row_scale(amax, scale, flags):
    """Dynamic per-token scale from the row's amax (and the optional ``scale_ub``)."""
    if flags & FLAG_SCALE_UB:
        ub = scale[0]
        amax = amax if amax < ub else ub  # fminf
    s = amax / float32(FP8_MAX)
    m = float32(1.0) / float32(448.0 * 512.0)
    return fmax_nan(s, m)


def _flags(variant):
    add = variant in ("add", "add_static")
    res = add or variant == "dynamic_res"
    quant = {"static": "static", "add_static": "static", "dynamic": "dynamic",
             "dynamic_res": "dynamic"}.get(variant)
    return add, res, quant


def make_scalar_kernel(kind, variant):
    """The one-element-per-step kernel for ``kind`` in bf16/f16/f32 and ``variant``."""
    dec, enc, rnd, _, _ = _CODECS[kind]
    ADD, RES, QUANT = _flags(variant)
    DYN_RES = RES and not ADD

    @device
    def src(x, residual, row, i):
        s = dec(x[row, i])
        if RES:
            s = s + dec(residual[row, i])
            if ADD:
                s = rnd(s)
        return s

    def kernel(out, x, residual, weight, scales, scale, eps, H, flags):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        ss = float64(0)
        for i in range(tid, H, nt):
            s = src(x, residual, row, i)
            if ADD:
                residual[row, i] = enc(s)
            ss += float64(s) * float64(s)
        inv = inv_rms(block_sum64(ss), H, eps)
        q = float32(1.0)
        if QUANT == "dynamic":
            amax = float32(0)
            for i in range(tid, H, nt):
                n = rnd(rnd(src(x, residual, row, i) * inv) * dec(weight[i]))
                amax = fmax_nan(amax, abs(n))
            q = _row_scale(block_max(amax), scale, flags)
            if tid == 0:
                scales[row, 0] = q
        elif QUANT == "static":
            q = float32(1.0) / scale[0]
        for i in range(tid, H, nt):
            if ADD:
                s = dec(residual[row, i])  # z, written in pass 1 by this same thread
            else:
                s = src(x, residual, row, i)
            n = rnd(s * inv) * dec(weight[i])
            if QUANT == "dynamic":
                out[row, i] = f32_to_e4m3(_clamp_fp8(rnd(n) / q))
            elif QUANT == "static":
                out[row, i] = f32_to_e4m3(_clamp_fp8(rnd(n) * q))
            else:
                out[row, i] = enc(n)
            if DYN_RES:
                residual[row, i] = enc(s)

    kernel.__name__ = f"norm_{variant}_{kind}_scalar"
    return kernel


def _make_stores(pack):
    """Stores of the 8 values ``vals[8*j : 8*j + 8]`` as one 16-byte unit at word ``c`` of
    ``row``: as the activation dtype (``pack`` rounds and pairs them), or as 8 FP8 E4M3 codes
    (8 bytes, at word ``c >> 1`` of the FP8 output's words)."""

    @device
    def store8(a, row, c, vals, j):
        b = 8 * j
        store_u32x4(a, row, c, (pack(vals[b + 1], vals[b]), pack(vals[b + 3], vals[b + 2]),
                                pack(vals[b + 5], vals[b + 4]), pack(vals[b + 7], vals[b + 6])))

    @device
    def store8_fp8(a, row, c, vals, j):
        b = 8 * j
        lo = (int(pack_e4m3x2(vals[b + 3], vals[b + 2])) << 16) | int(pack_e4m3x2(vals[b + 1], vals[b]))
        hi = (int(pack_e4m3x2(vals[b + 7], vals[b + 6])) << 16) | int(pack_e4m3x2(vals[b + 5], vals[b + 4]))
        store_u32x2(a, row, c >> 1, (lo, hi))

    return store8, store8_fp8


def make_vector_kernel(kind, variant):
    """The 16-bytes-per-step kernel for ``kind`` in bf16/f16: arrays arrive as ``uint32`` words.

    ``out``/``x``/``residual`` are ``[num_tokens, hidden_size/2]`` words (FP8 ``out``:
    ``hidden_size/4``), ``weight`` is ``[1, hidden_size/2]``; hidden_size % 8 == 0.
    """
    _, _, rnd, pair, pack = _CODECS[kind]
    ADD, RES, QUANT = _flags(variant)
    DYN_RES = RES and not ADD

    @device
    def load8(buf, a, row, c):
        w = load_u32x4(a, row, c)
        for k in range(4):
            lo, hi = pair(w[k])
            buf[2 * k] = lo
            buf[2 * k + 1] = hi

    @device
    def add8(buf, a, row, c):
        w = load_u32x4(a, row, c)
        for k in range(4):
            lo, hi = pair(w[k])
            buf[2 * k] += lo
            buf[2 * k + 1] += hi

    store8, store8_fp8 = _make_stores(pack)

    @device
    def src8(buf, x, residual, row, c):
        load8(buf, x, row, c)
        if RES:
            add8(buf, residual, row, c)
            if ADD:
                for k in range(8):
                    buf[k] = rnd(buf[k])

    def kernel(out, x, residual, weight, scales, scale, eps, H, flags):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        nv = H >> 3
        s = cuda.local.array(8, float32)
        w = cuda.local.array(8, float32)
        ss = float64(0)
        for v in range(tid, nv, nt):
            src8(s, x, residual, row, v << 2)
            if ADD:
                store8(residual, row, v << 2, s, 0)
            for k in range(8):
                ss += float64(s[k]) * float64(s[k])
        inv = inv_rms(block_sum64(ss), H, eps)
        q = float32(1.0)
        if QUANT == "dynamic":
            amax = float32(0)
            for v in range(tid, nv, nt):
                src8(s, x, residual, row, v << 2)
                load8(w, weight, 0, v << 2)
                for k in range(8):
                    amax = fmax_nan(amax, abs(rnd(rnd(s[k] * inv) * w[k])))
            q = _row_scale(block_max(amax), scale, flags)
            if tid == 0:
                scales[row, 0] = q
        elif QUANT == "static":
            q = float32(1.0) / scale[0]
        for v in range(tid, nv, nt):
            c = v << 2
            if ADD:
                load8(s, residual, row, c)
            else:
                src8(s, x, residual, row, c)
            if DYN_RES:
                store8(residual, row, c, s, 0)
            load8(w, weight, 0, c)
            for k in range(8):
                n = rnd(s[k] * inv) * w[k]
                if QUANT == "dynamic":
                    w[k] = _clamp_fp8(rnd(n) / q)
                elif QUANT == "static":
                    w[k] = _clamp_fp8(rnd(n) * q)
                else:
                    w[k] = n
            if QUANT is None:
                store8(out, row, c, w, 0)
            else:
                store8_fp8(out, row, c, w, 0)

    kernel.__name__ = f"norm_{variant}_{kind}_vector"
    return kernel


def make_cached_kernel(kind, variant, vpt):
    """The register-cached vector kernel: thread ``t`` owns units ``t, t + nt, ..., t + (vpt-1)*nt``
    of 8 elements (16 bytes); requires ``vpt * blockDim.x * 8 >= hidden_size``. Same parameters
    and layouts as :func:`make_vector_kernel`.
    """
    _, _, rnd, pair, pack = _CODECS[kind]
    ADD, RES, QUANT = _flags(variant)
    DYN_RES = RES and not ADD
    NW = 4 * vpt  # uint32 words per thread
    NS = 8 * vpt  # values per thread

    @device
    def decode(vals, words, j):
        for k in range(4):
            lo, hi = pair(words[4 * j + k])
            vals[8 * j + 2 * k] = lo
            vals[8 * j + 2 * k + 1] = hi

    store8, store8_fp8 = _make_stores(pack)

    @device
    def load_words(words, a, row, tid, nt, nv):
        for j in range(vpt):
            v = tid + j * nt
            if v < nv:
                w = load_u32x4(a, row, v << 2)
                for k in range(4):
                    words[4 * j + k] = w[k]
            else:  # units past the row: zeros, never read back
                for k in range(4):
                    words[4 * j + k] = 0

    def kernel(out, x, residual, weight, scales, scale, eps, H, flags):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        nv = H >> 3
        xw = cuda.local.array(NW, uint32)
        ww = cuda.local.array(NW, uint32)
        vals = cuda.local.array(NS, float32)
        wv = cuda.local.array(NS, float32)
        # pass 1: every load of the row (and of the weight) in flight at once, then the sum
        # of squares; the weight words wait in registers for pass 2
        load_words(ww, weight, 0, tid, nt, nv)
        load_words(xw, x, row, tid, nt, nv)
        for j in range(vpt):
            decode(vals, xw, j)
        if RES:
            load_words(xw, residual, row, tid, nt, nv)
            for j in range(vpt):
                decode(wv, xw, j)
            for k in range(NS):
                vals[k] += wv[k]
                if ADD:
                    vals[k] = rnd(vals[k])
        ss = float64(0)
        for j in range(vpt):
            if tid + j * nt < nv:
                for k in range(8):
                    ss += float64(vals[8 * j + k]) * float64(vals[8 * j + k])
                if ADD or DYN_RES:
                    store8(residual, row, (tid + j * nt) << 2, vals, j)  # r(x + residual)
        inv = inv_rms(block_sum64(ss), H, eps)
        # pass 2: normalise in registers
        for j in range(vpt):
            decode(wv, ww, j)
        amax = float32(0)
        for j in range(vpt):
            if tid + j * nt < nv:
                for k in range(8):
                    n = rnd(vals[8 * j + k] * inv) * wv[8 * j + k]
                    if QUANT is not None:
                        n = rnd(n)
                        amax = fmax_nan(amax, abs(n))
                    vals[8 * j + k] = n
        q = float32(1.0)
        rq = float32(1.0)
        if QUANT == "dynamic":
            q = _row_scale(block_max(amax), scale, flags)
            rq = float32(1.0) / q
            if tid == 0:
                scales[row, 0] = q
        elif QUANT == "static":
            q = float32(1.0) / scale[0]
        for j in range(vpt):
            v = tid + j * nt
            if v < nv:
                if QUANT is None:
                    store8(out, row, v << 2, vals, j)
                else:
                    for k in range(8):
                        if QUANT == "dynamic":
                            vals[8 * j + k] = _clamp_fp8(div_rn(vals[8 * j + k], q, rq))
                        else:
                            vals[8 * j + k] = _clamp_fp8(vals[8 * j + k] * q)
                    store8_fp8(out, row, v << 2, vals, j)

    kernel.__name__ = f"norm_{variant}_{kind}_cached{vpt}"
    return kernel
