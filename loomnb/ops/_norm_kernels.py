"""The RMSNorm-family kernels: one kernel body, specialised at compile time per dtype and variant.

One thread block per token (row). Each thread walks its row with a stride of the block size:

* pass 1: the sum of squares of ``s`` (fp32), reduced over the block; for the fused-add
  variants ``residual <- z = r(x + residual)`` is written here and ``s = z``;
* ``inv = rsqrtf(ss / hidden_size + eps)``;
* dynamic quant only: pass 2, the row's ``amax`` of the normalised values;
* last pass: ``n = r(r(s * inv) * w)`` written as the activation dtype, or as FP8 E4M3.

Two layouts of the same body: a *scalar* kernel that reads one element per step (any hidden
size, any alignment) and a *vector* kernel for bf16/fp16 that moves 16 bytes (8 elements) per
load and store, used when the rows allow it (see :func:`vector_ok`). Rows past 2**31 elements
are fine: numba indexes with 64-bit integers.

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

from numba import cuda, float32

from .._numba_internals import SIM
from ..layouts.dtypes import (bf16_round, bf16_to_f32, bits_f32, f16_round, f16_to_f32,
                              f32_to_bf16, f32_to_e4m3, f32_to_f16, pack_bf16x2, pack_e4m3x2,
                              pack_f16x2, rsqrt)
from ._reduce import block_max, block_sum, fmax_nan

VARIANTS = ("rms", "add", "static", "add_static", "dynamic", "dynamic_res")
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)  # vLLM's min_scaling_factor<fp8>
FLAG_SCALE_UB = 1

if SIM:
    @cuda.jit(device=True)
    def load_u32x4(a, row, col):
        return a[row, col], a[row, col + 1], a[row, col + 2], a[row, col + 3]

    @cuda.jit(device=True)
    def store_u32x4(a, row, col, v):
        for k in range(4):
            a[row, col + k] = v[k]

    @cuda.jit(device=True)
    def store_u32x2(a, row, col, v):
        a[row, col] = v[0]
        a[row, col + 1] = v[1]
else:
    from .._numba_internals import load_u32x4, store_u32x2, store_u32x4


@cuda.jit(device=True)
def _ident(x):
    return float32(x)


@cuda.jit(device=True)
def _bf16_pair(w):
    w = int(w)
    return bf16_to_f32(w & 0xFFFF), bits_f32(w & 0xFFFF0000)


@cuda.jit(device=True)
def _f16_pair(w):
    w = int(w)
    return f16_to_f32(w & 0xFFFF), f16_to_f32(w >> 16)


# (decode one element, encode one element, r(x), decode a word of two, pack two into a word)
_CODECS = {
    "bf16": (bf16_to_f32, f32_to_bf16, bf16_round, _bf16_pair, pack_bf16x2),
    "f16": (f16_to_f32, f32_to_f16, f16_round, _f16_pair, pack_f16x2),
    "f32": (_ident, _ident, _ident, None, None),
}


@cuda.jit(device=True)
def _clamp_fp8(v):
    """``fmaxf(-448, fminf(v, 448))``: a NaN becomes +448, as in vLLM's quant kernels."""
    if not (v < float32(FP8_MAX)):
        v = float32(FP8_MAX)
    if not (v > float32(-FP8_MAX)):
        v = float32(-FP8_MAX)
    return v


@cuda.jit(device=True)
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

    @cuda.jit(device=True)
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
        ss = float32(0)
        for i in range(tid, H, nt):
            s = src(x, residual, row, i)
            if ADD:
                residual[row, i] = enc(s)
            ss += s * s
        inv = rsqrt(block_sum(ss) / float32(H) + eps)
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


def make_vector_kernel(kind, variant):
    """The 16-bytes-per-step kernel for ``kind`` in bf16/f16: arrays arrive as ``uint32`` words.

    ``out``/``x``/``residual`` are ``[num_tokens, hidden_size/2]`` words (FP8 ``out``:
    ``hidden_size/4``), ``weight`` is ``[1, hidden_size/2]``; hidden_size % 8 == 0.
    """
    _, _, rnd, pair, pack = _CODECS[kind]
    ADD, RES, QUANT = _flags(variant)
    DYN_RES = RES and not ADD

    @cuda.jit(device=True)
    def load8(buf, a, row, c):
        w = load_u32x4(a, row, c)
        for k in range(4):
            lo, hi = pair(w[k])
            buf[2 * k] = lo
            buf[2 * k + 1] = hi

    @cuda.jit(device=True)
    def add8(buf, a, row, c):
        w = load_u32x4(a, row, c)
        for k in range(4):
            lo, hi = pair(w[k])
            buf[2 * k] += lo
            buf[2 * k + 1] += hi

    @cuda.jit(device=True)
    def store8(a, row, c, buf):
        store_u32x4(a, row, c, (pack(buf[1], buf[0]), pack(buf[3], buf[2]),
                                pack(buf[5], buf[4]), pack(buf[7], buf[6])))

    @cuda.jit(device=True)
    def store8_fp8(a, row, c, buf):
        lo = (int(pack_e4m3x2(buf[3], buf[2])) << 16) | int(pack_e4m3x2(buf[1], buf[0]))
        hi = (int(pack_e4m3x2(buf[7], buf[6])) << 16) | int(pack_e4m3x2(buf[5], buf[4]))
        store_u32x2(a, row, c >> 1, (lo, hi))

    @cuda.jit(device=True)
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
        ss = float32(0)
        for v in range(tid, nv, nt):
            src8(s, x, residual, row, v << 2)
            if ADD:
                store8(residual, row, v << 2, s)
            for k in range(8):
                ss += s[k] * s[k]
        inv = rsqrt(block_sum(ss) / float32(H) + eps)
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
                store8(residual, row, c, s)
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
                store8(out, row, c, w)
            else:
                store8_fp8(out, row, c, w)

    kernel.__name__ = f"norm_{variant}_{kind}_vector"
    return kernel
