"""The RMSNorm-family kernels: one kernel factory, specialised by a frozen :class:`NormSpec`.

One thread block per row (token, or token x head for per-head q/k norms). Per row:

* ``s = f(x)``; with a residual, ``s = f(x) + f(residual)``: ``residual="add"`` rounds it
  (``z = r(s)``, written to ``residual``, normalised: vLLM's ``fused_add_rms_norm``), while
  ``"add_fp32"`` normalises the fp32 sum and writes ``r(s)`` to ``residual`` (vLLM's
  dynamic-quant op);
* ``inv = r32(1 / sqrt(sum(s^2) / H + eps))``, the sum accumulated and ``inv`` evaluated in
  float64 (:func:`inv_rms`);
* ``n = r(f(r(s * inv)) * f(w))`` (``rounding="twice"``: HF, vLLM's ``forward_native``) or
  ``r(s * inv * f(w))`` (``"once"``: vLLM 0.24's compiled ops and FlashInfer);
* then ``out = n`` in the activation dtype, or FP8 E4M3: ``e4m3(clamp(f(n) * (1/scale)))``
  (``quant="static"``: the norm in the activation dtype, quantised -- with ``"once"``, vLLM
  0.24's compiled static kernels) or, with a per-row ``scale = max(min(amax|n|, ub)/448,
  1/(448*512))`` written to ``scales``, ``e4m3(clamp(n / scale))`` (``"dynamic"``, rounded
  twice).

Two layouts of the same body. ``"cached"`` (bf16/fp16 rows of whole 16-byte units): thread
``t`` owns units ``t, t + nt, ..., t + (vpt-1)*nt`` of 8 elements, loads them (and the weight's)
once with all loads in flight, and keeps them in registers for every later step. ``"scalar"``
(any dtype, size and alignment): one element per step, re-reading the row from L1/L2 in each
pass. Rows are 1-D views ``x[row]`` (``lead=1``) or ``x[i0, i1]`` (``lead=2``: per-head views
whose leading dimensions do not merge); every index is 64-bit.

Parameters (one signature for every variant; an unused array is empty):
``out, x, residual, weight, scales, scale, eps, hidden_size`` -- ``out``/``x``/``residual``
``[rows..., H]`` (uint32 words in the cached layout; FP8 ``out`` as words of 4 codes),
``weight [H]``, ``scales [rows]`` fp32, ``scale [1]`` fp32 (the static scale or ``scale_ub``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from numba import cuda, float32, float64, uint32

from .._dtypes import storage_dtype
from .._numba_internals import device
from ..layouts.dtypes import f32_to_e4m3
from . import _launch as L
from ._fp8 import clamp_fp8, div_rn, scale_from_amax
from ._reduce import REDUCE_SCRATCH, block_max, block_sum64, fmax_nan
from ._vector import CODECS, load_u32x4, unit_io

RESIDUALS = ("none", "add", "add_fp32")
QUANTS = ("none", "static", "dynamic")
ROUNDINGS = ("twice", "once")
CACHED_VPT = (1, 2, 4, 8)  # 16-byte units a thread of the cached layout may hold


@dataclass(frozen=True)
class NormSpec:
    kind: str                 # activation dtype: bf16, f16, f32
    residual: str = "none"    # RESIDUALS
    quant: str = "none"       # QUANTS
    rounding: str = "twice"   # ROUNDINGS (quant "none" or "static")
    scale_ub: bool = False    # dynamic quant: clip the amax by scale[0]
    layout: str = "scalar"    # "scalar" or "cached" (vpt units of 16 bytes a thread)
    vpt: int = 0
    lead: int = 1             # leading dimensions of the row views (1 or 2)

    def __post_init__(self):
        assert self.residual in RESIDUALS and self.quant in QUANTS and self.rounding in ROUNDINGS
        assert self.layout == "scalar" and self.vpt == 0 or self.vpt in CACHED_VPT
        assert self.lead in (1, 2) and not (self.layout == "cached" and self.kind == "f32")
        assert not (self.quant == "dynamic" and self.rounding == "once")


def argtypes(spec):
    """The numba signature of ``norm_kernel(spec)``'s parameters."""
    words = spec.layout == "cached"
    act = "uint32" if words else storage_dtype(spec.kind)
    out = ("uint32" if words else "uint8") if spec.quant != "none" else act
    rows = 1 + spec.lead
    return (L.array_type(out, rows), L.array_type(act, rows), L.array_type(act, rows),
            L.array_type(act, 1), L.array_type("float32", 1), L.array_type("float32", 1),
            L.f32(0).numba_type, L.i64(0).numba_type)


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


def _row_index(lead):
    """``row_index(a, row)``: the leading index tuple of row ``row`` (``a[idx]`` is its 1-D view):
    ``(row,)``, or ``(i0, i1)`` of ``a``'s two leading dimensions (32-bit division: a grid has
    fewer than 2^31 rows)."""
    if lead == 1:
        @device
        def row_index(a, row):
            return (row,)
    else:
        @device
        def row_index(a, row):
            n1 = uint32(a.shape[1])
            i0 = uint32(row) // n1
            return (i0, uint32(row) - i0 * n1)
    return row_index


def norm_kernel(spec):
    """The ``@cuda.jit`` function for ``spec`` (see the module docstring)."""
    return (_cached if spec.layout == "cached" else _scalar)(spec)


norm_kernel.__name__ = "norm_kernel"


def _scalar(spec):
    codec = CODECS[spec.kind]
    dec, enc, rnd = codec.decode, codec.encode, codec.rnd
    ADD, FP32 = spec.residual == "add", spec.residual == "add_fp32"
    RES = ADD or FP32
    QUANT, ONCE, UB = spec.quant, spec.rounding == "once", spec.scale_ub
    row_index = _row_index(spec.lead)

    @device
    def src(xr, rr, i):
        s = dec(xr[i])
        if RES:
            s = s + dec(rr[i])
            if ADD:
                s = rnd(s)
        return s

    def kernel(out, x, residual, weight, scales, scale, eps, H):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        ri = row_index(x, row)
        xr, orow = x[ri], out[ri]
        rr = residual[ri] if RES else xr
        sm64 = cuda.shared.array(REDUCE_SCRATCH, float64)
        sm32 = cuda.shared.array(REDUCE_SCRATCH, float32)
        ss = float64(0)
        for i in range(tid, H, nt):
            s = src(xr, rr, i)
            if ADD:
                rr[i] = enc(s)
            ss += float64(s) * float64(s)
        inv = inv_rms(block_sum64(ss, sm64), H, eps)
        q = float32(1.0)
        if QUANT == "dynamic":
            amax = float32(0)
            for i in range(tid, H, nt):
                n = rnd(rnd(src(xr, rr, i) * inv) * dec(weight[i]))
                amax = fmax_nan(amax, abs(n))
            q = scale_from_amax(block_max(amax, sm32), scale[0] if UB else float32(0), UB)
            if tid == 0:
                scales[row] = q
        elif QUANT == "static":
            q = float32(1.0) / scale[0]
        for i in range(tid, H, nt):
            s = dec(rr[i]) if ADD else src(xr, rr, i)  # z was written by this thread in pass 1
            if ONCE:
                n = s * inv * dec(weight[i])
            else:
                n = rnd(s * inv) * dec(weight[i])
            if QUANT == "dynamic":
                orow[i] = f32_to_e4m3(clamp_fp8(rnd(n) / q))
            elif QUANT == "static":
                orow[i] = f32_to_e4m3(clamp_fp8(rnd(n) * q))  # the norm in T, quantised
            else:
                orow[i] = enc(n)
            if FP32:
                rr[i] = enc(s)

    kernel.__name__ = f"norm_{spec.kind}_{spec.residual}_{spec.quant}_{spec.rounding}_scalar_lead{spec.lead}"
    return kernel


def _cached(spec):
    codec = CODECS[spec.kind]
    rnd, unpack = codec.rnd, codec.unpack
    load8, store8, store8_fp8 = unit_io(spec.kind)
    ADD, FP32 = spec.residual == "add", spec.residual == "add_fp32"
    RES = ADD or FP32
    QUANT, ONCE, UB = spec.quant, spec.rounding == "once", spec.scale_ub
    VPT = spec.vpt
    NW, NS = 4 * VPT, 8 * VPT  # words and values a thread holds
    row_index = _row_index(spec.lead)

    @device
    def load_words(words, a, tid, nt, nv):
        for j in range(VPT):
            v = tid + j * nt
            if v < nv:
                w = load_u32x4(a, v << 2)
                for k in range(4):
                    words[4 * j + k] = w[k]
            else:  # units past the row: zeros, never stored
                for k in range(4):
                    words[4 * j + k] = 0

    @device
    def decode(vals, words):
        for k in range(NW):
            lo, hi = unpack(words[k])
            vals[2 * k] = lo
            vals[2 * k + 1] = hi

    def kernel(out, x, residual, weight, scales, scale, eps, H):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        nv = H >> 3
        ri = row_index(x, row)
        xr, orow = x[ri], out[ri]
        sm64 = cuda.shared.array(REDUCE_SCRATCH, float64)
        sm32 = cuda.shared.array(REDUCE_SCRATCH, float32)
        xw = cuda.local.array(NW, uint32)
        ww = cuda.local.array(NW, uint32)
        vals = cuda.local.array(NS, float32)
        wv = cuda.local.array(NS, float32)
        # every load of the row (and of the weight, and the residual) in flight at once
        load_words(ww, weight, tid, nt, nv)
        load_words(xw, xr, tid, nt, nv)
        decode(vals, xw)
        rr = residual[ri] if RES else xr
        if RES:
            load_words(xw, rr, tid, nt, nv)
            decode(wv, xw)
            for k in range(NS):
                vals[k] += wv[k]
                if ADD:
                    vals[k] = rnd(vals[k])
        # four independent float64 accumulators: a dependent chain of 8*vpt additions was a
        # measurable part of the small-batch latency (the order does not change the float32 inv)
        acc = cuda.local.array(4, float64)
        for k in range(4):
            acc[k] = float64(0)
        for j in range(VPT):
            u = tid + j * nt
            if u < nv:
                for k in range(8):
                    acc[k & 3] += float64(vals[8 * j + k]) * float64(vals[8 * j + k])
                if RES:
                    store8(rr, u, vals, j)  # r(x + residual)
        ss = (acc[0] + acc[1]) + (acc[2] + acc[3])
        inv = inv_rms(block_sum64(ss, sm64), H, eps)
        decode(wv, ww)
        amax = float32(0)
        for j in range(VPT):
            if tid + j * nt < nv:
                for k in range(8):
                    if ONCE:
                        n = vals[8 * j + k] * inv * wv[8 * j + k]
                    else:
                        n = rnd(vals[8 * j + k] * inv) * wv[8 * j + k]
                    if QUANT != "none":  # both FP8 forms quantise the norm in T
                        n = rnd(n)
                    if QUANT == "dynamic":
                        amax = fmax_nan(amax, abs(n))
                    vals[8 * j + k] = n
        q = float32(1.0)
        rq = float32(1.0)
        if QUANT == "dynamic":
            q = scale_from_amax(block_max(amax, sm32), scale[0] if UB else float32(0), UB)
            rq = float32(1.0) / q
            if tid == 0:
                scales[row] = q
        elif QUANT == "static":
            q = float32(1.0) / scale[0]
        for j in range(VPT):
            u = tid + j * nt
            if u < nv:
                if QUANT == "none":
                    store8(orow, u, vals, j)
                else:
                    for k in range(8):
                        if QUANT == "dynamic":
                            vals[8 * j + k] = clamp_fp8(div_rn(vals[8 * j + k], q, rq))
                        else:
                            vals[8 * j + k] = clamp_fp8(vals[8 * j + k] * q)
                    store8_fp8(orow, u, vals, j)

    kernel.__name__ = (f"norm_{spec.kind}_{spec.residual}_{spec.quant}_{spec.rounding}"
                       f"_cached{VPT}_lead{spec.lead}")
    return kernel


def variants():
    """Every ``(factory, spec, argtypes)`` the family's ops can launch (the PTX test compiles
    them all): both layouts, every vpt, both row-view shapes, each op's variant."""
    out = []
    ops = [("none", "none", "twice", False), ("none", "none", "once", False),
           ("add", "none", "twice", False), ("add", "none", "once", False),
           ("none", "static", "twice", False), ("add", "static", "twice", False),
           ("none", "static", "once", False), ("add", "static", "once", False),
           ("none", "dynamic", "twice", False), ("none", "dynamic", "twice", True),
           ("add_fp32", "dynamic", "twice", False), ("add_fp32", "dynamic", "twice", True)]
    for kind in ("bf16", "f16", "f32"):
        for residual, quant, rounding, ub in ops:
            for lead in (1, 2):
                layouts = [("scalar", 0)] + ([("cached", v) for v in CACHED_VPT] if kind != "f32" else [])
                for layout, vpt in layouts:
                    spec = NormSpec(kind, residual, quant, rounding, ub, layout, vpt, lead)
                    out.append((norm_kernel, spec, argtypes(spec)))
    return out
