"""The activation-family kernels: one factory, specialised by a frozen :class:`ActSpec`.

Every op of the family is one elementwise *source* followed by one *sink*:

* source (``act``): ``"none"`` reads ``y = f(x)``; the gated activations read a gate ``g`` and a
  multiplier ``u`` -- the two halves of a ``[..., 2d]`` row (``silu``, ``gelu``, ``gelu_tanh``,
  ``fatrelu``; ``mul_silu`` swaps the halves) or its interleaved pairs (``swigluoai``) -- and
  compute ``y = r(f(r(act(g))) * f(u))`` in float32 (``numerics="per_block"``: vLLM's fused
  ``silu_and_mul_per_block_quant``, ``y = (g * (1/(1 + expf(-g)))) * u`` with no rounding);
* sink (``quant``): ``"none"`` stores ``y`` as T; ``"static"`` stores ``e4m3(clamp(y * (1/s)))``
  with ``s = scale[0]``; ``"tensor"`` is ``"static"`` walking the rows backwards (the last
  pass of the dynamic per-tensor quant: the rows its amax pass read last come first); ``"token"``
  reduces the row's amax over the block, ``s = max(min(amax, ub)/448, 1/(448*512))``, stores
  ``e4m3(clamp(y / s))``; ``"group"`` reduces each group of ``group`` elements over the
  ``group/8`` lanes that hold it (warp shuffles), ``s = max(eps, amax)/448`` (UE8M0: rounded up
  to a power of two), stores ``e4m3(clamp_nan_low(y / s))``; ``"amax"`` (the first pass of the
  dynamic per-tensor quant) only writes each block's ``max|y|`` to ``partials`` -- or, when the
  grid is one block, ``scale[0] = max|y| / 448`` itself (one block over the partials, read as a
  float32 row, is the middle pass that turns them into the scale).

Threads work on *units* of 8 consecutive output elements (16 bytes of bf16/fp16, 32 of fp32,
8 FP8 codes). Layout ``"vector"`` (rows 16-byte aligned, d a multiple of 8) moves a unit with
16-byte loads and stores (``ld.v4.u32``; FP8 units as one 8-byte store); ``"scalar"`` moves one
element at a time (any alignment, any d: the last unit may be partial). Thread ``t`` of block
``(row, c)`` owns units ``c*T*upt + t + j*T``, ``j < upt``, so a 64- or 128-element group is 8
or 16 consecutive lanes. Chunked sinks (none, static, tensor, group) split a row over
``chunks = ceil(units / (T*upt))`` blocks of a 1-D grid in row-major order (block ``b`` is row
``b // chunks``; the per-tensor last pass walks it backwards, so the rows its amax pass read
last, still in L2, come first); ``"token"`` needs the whole row in one block: ``upt`` units a thread held
in registers (all loads in flight), or ``upt = 0`` for rows too long for that: loop, reduce,
loop again (the second read mostly hits L1/L2). Layout ``"small"`` (decode-size calls of the
gated activations, no quant: :func:`_small`) gives each thread one 32-bit word -- two outputs --
of a 2-D grid, the row from ``blockIdx.y``: no division before the first load.

Rows are 1-D views ``x[i0, i1]`` of 3-D row arrays ``[n0, n1, row]`` (``n0 = 1`` with stride 0
when the leading dimensions merge into one); the row index comes from ``blockIdx.x`` (32-bit:
a grid has fewer than 2^31 blocks) and every element and word offset is 64-bit.

Parameters (one signature for every variant; an unused array is empty):
``out, x, scales, scale, partials, p0, p1, d`` -- ``out``/``x`` ``[n0, n1, *]`` (uint32 words in
the vector and small layouts, storage elements in the scalar one), ``scales [rows, G]`` float32 with any
strides (token: ``G = 1``), ``scale [1]`` float32 (static scale, per-tensor scale out, or
``scale_ub``), ``partials [P]`` float32, ``p0``/``p1`` float32 (FATReLU threshold; SwiGLU-OAI
alpha and limit; group eps), ``d`` int64 (the output row length).

A second, small factory :func:`dequant_kernel` serves ``scaled_fp8_dequant``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int64, uint32

from .._dtypes import storage_dtype
from .._numba_internals import SIM, device
from ..layouts.dtypes import e4m3_to_f32
from . import _launch as L
from ._activation_io import UNIT, unit_io, words_per_unit
from ._fp8 import clamp_fp8, clamp_fp8_nan_low, div_rn, scale_from_amax, ue8m0
from ._reduce import REDUCE_SCRATCH, block_max, fmax_nan, fmaxf, fmin_nan, group_reduce
from ._vector import CODECS

ACTS = ("none", "silu", "mul_silu", "gelu", "gelu_tanh", "fatrelu", "swigluoai")
GATED = ACTS[1:]
QUANTS = ("none", "static", "tensor", "token", "group", "amax")
NUMERICS = ("unfused", "per_block")
GROUP_SIZES = (64, 128)
CHUNK_UPTS = (1, 2, 4)  # units a thread holds in the chunked sinks (1: small calls, 4: large)
CHUNK_UPT = 2           # ActSpec's default width (mid-size calls)
TOKEN_UPT = (2, 4)      # units a thread holds in the register-cached per-token sink (0: reread)
AMAX_UPT = 4            # rows whose units a thread of the amax pass has in flight at once
                        # (vector layout; the element-wise one has 8 loads a unit already: 1)
KINDS = ("bf16", "f16", "f32")
LAYOUTS = ("vector", "scalar", "small")
SMALL_ACTS = ("silu", "mul_silu", "gelu", "gelu_tanh", "fatrelu")  # gated halves, no quant

F32 = np.float32
ONE, HALF, ZERO = F32(1.0), F32(0.5), F32(0.0)
FP8_MAX = F32(448.0)
GELU_ALPHA = F32(0.7071067811865476)   # M_SQRT1_2
GELU_BETA = F32(0.7978845608028654)    # M_SQRT2 * M_2_SQRTPI * 0.5
GELU_KAPPA = F32(0.044715)
PER_BLOCK_MIN_SCALE = F32(1e-10)


@dataclass(frozen=True)
class ActSpec:
    kind: str                   # input (and T output) dtype: bf16, f16, f32
    act: str = "none"           # ACTS
    quant: str = "none"         # QUANTS
    numerics: str = "unfused"   # NUMERICS ("per_block": silu + group only)
    group: int = 0              # quant == "group": GROUP_SIZES
    ue8m0: bool = False         # group scales rounded up to powers of two
    scale_ub: bool = False      # token: clip the amax by scale[0]
    layout: str = "vector"      # LAYOUTS
    upt: int = CHUNK_UPT        # units a thread holds (token: TOKEN_UPT or 0 = reread loop)

    def __post_init__(self):
        assert self.kind in KINDS and self.act in ACTS and self.quant in QUANTS
        assert self.numerics in NUMERICS and self.layout in LAYOUTS
        assert self.layout != "small" or small_ok(self)
        assert (self.group in GROUP_SIZES) == (self.quant == "group")
        assert not self.ue8m0 or (self.quant == "group" and self.numerics == "unfused")
        assert not self.scale_ub or self.quant == "token"
        assert self.numerics == "unfused" or (self.act == "silu" and self.quant == "group")
        assert self.act == "none" or self.quant in ("none", "static", "group")
        if self.quant == "token":
            assert self.upt in TOKEN_UPT + (0,)
        elif self.quant == "amax":
            assert self.upt == (AMAX_UPT if self.layout == "vector" else 1)
        else:
            assert self.upt in chunk_upts(self)


def chunk_upts(spec):
    """The widths a chunked sink of ``spec`` compiles at: 1, 2 and 4 units a thread, except the
    fused gated group quant (two halves of 4 units are more values than a thread's registers
    hold: at 4, numba's arrays spill to local memory)."""
    return CHUNK_UPTS[:2] if spec.act != "none" and spec.quant == "group" else CHUNK_UPTS


def small_ok(spec):
    """Whether ``spec`` has the ``"small"`` layout: a gated activation of two halves (not
    SwiGLU-OAI's interleaved pairs), a 2-byte dtype, no quantisation, unfused numerics."""
    return (spec.act in SMALL_ACTS and spec.quant == "none" and spec.kind in ("bf16", "f16")
            and spec.numerics == "unfused")


def size_siblings(spec):
    """The ``(factory, spec, argtypes)`` a call of another num_tokens could launch instead of
    ``spec``: its other widths (units a thread; per-token: the register widths and the reread
    loop), and for the per-tensor amax pass the fold of its partials and the quant pass at
    every width. Compiled together with ``spec`` (``_launch.launch(warm=)``)."""
    import dataclasses
    if spec.quant == "amax":
        tensor = dataclasses.replace(spec, quant="tensor", upt=CHUNK_UPTS[0])
        out = [ActSpec("f32", "none", "amax", layout="scalar", upt=1)]
        out += [dataclasses.replace(tensor, upt=u) for u in chunk_upts(tensor)]
    elif spec.quant == "token":
        out = [dataclasses.replace(spec, upt=u)
               for u in ((TOKEN_UPT + (0,)) if spec.layout == "vector" else (0,))]
    else:
        layout = "vector" if spec.layout == "small" else spec.layout
        out = [dataclasses.replace(spec, layout=layout, upt=u) for u in chunk_upts(spec)]
        if small_ok(spec) and layout == "vector":
            out.append(dataclasses.replace(spec, layout="small", upt=1))
    return [(act_quant_kernel, s, argtypes(s)) for s in out if s != spec]


def argtypes(spec):
    """The numba signature of ``act_quant_kernel(spec)``'s parameters."""
    vec = spec.layout != "scalar"
    store = storage_dtype(spec.kind)
    xt = "uint32" if vec else store
    ot = "uint32" if vec else (store if spec.quant == "none" else "uint8")
    return (L.array_type(ot, 3), L.array_type(xt, 3), L.array_type("float32", 2),
            L.array_type("float32", 1), L.array_type("float32", 1), L.f32(0).numba_type,
            L.f32(0).numba_type, L.i64(0).numba_type)


# ---------------------------------------------------------------- float32 math (libdevice)
if SIM:
    _FLT_OVER = float(np.finfo(np.float32).max) + 2.0 ** 103  # rounds to inf as a float32

    @device
    def expf(v):
        """float32 ``exp`` as the oracle computes it: float64 ``exp`` rounded once (NaN stays
        NaN, as libdevice's)."""
        if v != v:
            return F32(v)
        r = math.exp(float(v)) if float(v) < 709.0 else math.inf
        return F32(math.inf) if r >= _FLT_OVER else F32(r)

    @device
    def erff(v):
        return F32(math.erf(float(v)))

    @device
    def tanhf(v):
        return F32(math.tanh(float(v)))

    @device
    def fmaf(a, b, c):
        """float32 FMA as the oracle's twin: exact product, sum rounded via float64."""
        return F32(float(a) * float(b) + float(c))
else:
    from numba.cuda import libdevice

    @device
    def expf(v):
        """libdevice ``__nv_expf``: the ``expf`` nvcc links into vLLM's and torch's kernels."""
        return libdevice.expf(v)

    @device
    def erff(v):
        return libdevice.erff(v)

    @device
    def tanhf(v):
        return libdevice.tanhf(v)

    @device
    def fmaf(a, b, c):
        return cuda.fma(a, b, c)


def _act_fn(spec, pair=False):
    """``act8(gv, uv, b, p0, p1)``: the source values of one unit, in place in ``gv[b:b+8]``
    (``pair=True``: ``act2(g0, g1, u0, u1, p0, p1) -> (y0, y1)``, two of them).

    Gated sources compute ``a = act(g)`` in float32, round it to T (``r(a)``, two values per
    conversion instruction), and multiply by ``u``; the product's own rounding ``r(a * u)`` is
    left to the store (which rounds to nearest even as it packs) unless the sink quantises the
    value, which must then be ``r(a * u)`` as a float32 (``FINAL``)."""
    codec = CODECS[spec.kind]
    act, per_block, f32 = spec.act, spec.numerics == "per_block", spec.kind == "f32"
    unpack, pack = codec.unpack, codec.pack
    ROUND_ACT = act in ("silu", "mul_silu", "gelu", "gelu_tanh") and not per_block and not f32
    MUL = act not in ("none", "swigluoai")
    FINAL = MUL and spec.quant != "none" and not per_block and not f32

    if act == "none":
        @device
        def a_fn(g, u, p0, p1):
            return g
    elif act in ("silu", "mul_silu") and per_block:
        @device
        def a_fn(g, u, p0, p1):
            return g * (ONE / (ONE + expf(-g)))
    elif act in ("silu", "mul_silu"):
        @device
        def a_fn(g, u, p0, p1):
            return g / (ONE + expf(-g))
    elif act == "gelu":
        @device
        def a_fn(g, u, p0, p1):
            return (g * HALF) * (ONE + erff(g * GELU_ALPHA))
    elif act == "gelu_tanh":
        @device
        def a_fn(g, u, p0, p1):
            inner = GELU_BETA * fmaf(GELU_KAPPA, (g * g) * g, g)
            return (HALF * g) * (ONE + tanhf(inner))
    elif act == "fatrelu":  # g and 0 are values of T already: r(a) = a
        @device
        def a_fn(g, u, p0, p1):
            return g if g > p0 else ZERO
    else:  # swigluoai, rounded once (by the store): p0 = alpha, p1 = limit
        @device
        def a_fn(g, u, p0, p1):
            gg = fmin_nan(g, p1)
            uu = fmax_nan(fmin_nan(u, p1), -p1)
            return ((uu + ONE) * gg) / (ONE + expf((-gg) * p0))

    @device
    def act2(g0, g1, u0, u1, p0, p1):
        a0 = a_fn(g0, u0, p0, p1)
        a1 = a_fn(g1, u1, p0, p1)
        if ROUND_ACT:
            a0, a1 = unpack(pack(a1, a0))
        if MUL:
            a0 = a0 * u0
            a1 = a1 * u1
        if FINAL:
            a0, a1 = unpack(pack(a1, a0))
        return a0, a1

    if pair:
        return act2

    @device
    def act8(gv, uv, b, p0, p1):
        for k in range(0, UNIT, 2):
            gv[b + k], gv[b + k + 1] = act2(gv[b + k], gv[b + k + 1], uv[b + k], uv[b + k + 1],
                                            p0, p1)

    return act8


@device
def _row_view(a, row):
    """``(i0, i1)`` of flattened row ``row`` in a ``[n0, n1, *]`` row array (32-bit division:
    a grid has fewer than 2^31 rows)."""
    n1 = uint32(a.shape[1])
    i0 = uint32(row) // n1
    return i0, uint32(row) - i0 * n1


# ---------------------------------------------------------------- the kernels
def act_quant_kernel(spec):
    """The ``@cuda.jit`` function for ``spec`` (see the module docstring)."""
    if spec.quant == "amax":
        return _amax(spec)
    if spec.quant == "token" and spec.upt == 0:
        return _token_loop(spec)
    if spec.layout == "small":
        return _small(spec)
    return _units(spec)


act_quant_kernel.__name__ = "act_quant_kernel"


def _name(spec):
    extra = (f"_g{spec.group}{'_ue8m0' if spec.ue8m0 else ''}" if spec.quant == "group" else
             "_ub" if spec.scale_ub else "")
    nums = "_perblock" if spec.numerics == "per_block" else ""
    return f"act_{spec.kind}_{spec.act}_{spec.quant}{extra}{nums}_{spec.layout}_upt{spec.upt}"


def _small(spec):
    """The ``"small"`` layout (decode-size gated activations): one 32-bit word -- two outputs --
    a thread, a 2-D grid of ``(ceil(d / 2 / T), rows)`` blocks, so the first loads are issued
    after one multiply-add: no row or chunk division, no unit loop (rows from ``blockIdx.y``,
    the leading dimensions merged into one: ``out``/``x`` are ``[1, rows, *]``). The numerics
    are the vector layout's (``act2`` is ``act8``'s pair)."""
    act2 = _act_fn(spec, pair=True)
    unpack, pack = CODECS[spec.kind].unpack, CODECS[spec.kind].pack
    G, U = (1, 0) if spec.act == "mul_silu" else (0, 1)  # which half is the gate

    def kernel(out, x, scales, scale, partials, p0, p1, d):
        w = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        nw = d >> 1
        if w < nw:
            row = cuda.blockIdx.y
            xr = x[0, row]
            g0, g1 = unpack(xr[G * nw + w])
            u0, u1 = unpack(xr[U * nw + w])
            y0, y1 = act2(g0, g1, u0, u1, p0, p1)
            out[0, row, w] = pack(y1, y0)

    kernel.__name__ = _name(spec)
    return kernel


def _units(spec):
    """Chunked sinks (none, static, tensor, group) and the register-cached per-token sink."""
    fetch, decode, store_t, store_q = unit_io(spec)
    act8 = _act_fn(spec)
    Q, UPT = spec.quant, spec.upt
    NS, NW = UNIT * UPT, words_per_unit(spec) * UPT
    GW = spec.group // UNIT if Q == "group" else 1  # lanes a group spans
    gmax = group_reduce(fmaxf, GW) if Q == "group" else None
    UE8M0, UB, PER_BLOCK = spec.ue8m0, spec.scale_ub, spec.numerics == "per_block"
    TOKEN, TENSOR = Q == "token", Q == "tensor"

    def kernel(out, x, scales, scale, partials, p0, p1, d):
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        wv = cuda.local.array(NW, uint32)
        gv = cuda.local.array(NS, float32)
        uv = cuda.local.array(NS, float32)
        sm = cuda.shared.array(REDUCE_SCRATCH, float32)
        # a 1-D grid of rows x chunks, row-major: consecutive blocks stream consecutive memory
        nu = (d + (UNIT - 1)) >> 3
        chunks = max((nu + nt * UPT - 1) // (nt * UPT), 1)
        blk = uint32(cuda.blockIdx.x)
        inv = ONE
        if Q == "static" or TENSOR:
            inv = ONE / scale[0]
        if TENSOR:
            blk = uint32(uint32(cuda.gridDim.x) - uint32(1) - blk)  # last rows first (in L2)
        row = int64(blk // uint32(chunks))  # 32-bit division; int64 from here on
        chunk = int64(blk) - row * chunks
        if row < int64(x.shape[0]) * int64(x.shape[1]):
            i0, i1 = _row_view(x, row)
            xr, orow = x[i0, i1], out[i0, i1]
            first = int64(chunk) * nt * UPT + tid
            for j in range(UPT):  # every load of the thread's units in flight at once
                u = first + j * nt
                if u < nu:
                    fetch(wv, gv, uv, j, xr, u << 3, d)
            amax = ZERO
            for j in range(UPT):
                u = first + j * nt
                o = UNIT * j
                ga = ZERO
                if u < nu:
                    decode(wv, gv, uv, j)
                    act8(gv, uv, o, p0, p1)
                    for k in range(UNIT):
                        ga = fmaxf(ga, abs(gv[o + k]))
                    amax = fmaxf(amax, ga)
                if Q == "group":  # every lane of the warp takes part, in range or not
                    ga = gmax(ga)
                    if PER_BLOCK:
                        s = fmax_nan(ga / FP8_MAX, PER_BLOCK_MIN_SCALE)
                    else:
                        s = fmax_nan(ga, p0) / FP8_MAX
                        if UE8M0:
                            s = ue8m0(s)
                    if u < nu:
                        if u % GW == 0:
                            scales[row, u // GW] = s
                        rs = ONE / s
                        for k in range(UNIT):
                            v = div_rn(gv[o + k], s, rs)
                            gv[o + k] = v if PER_BLOCK else clamp_fp8_nan_low(v)
                        store_q(orow, u << 3, gv, o, d)
                elif not TOKEN and u < nu:
                    if Q == "none":
                        store_t(orow, u << 3, gv, o, d)
                    else:
                        for k in range(UNIT):
                            gv[o + k] = clamp_fp8(gv[o + k] * inv)
                        store_q(orow, u << 3, gv, o, d)
            if TOKEN:
                s = scale_from_amax(block_max(amax, sm), scale[0] if UB else ZERO, UB)
                if tid == 0:
                    scales[row, 0] = s
                rs = ONE / s
                for j in range(UPT):
                    u = first + j * nt
                    if u < nu:
                        for k in range(UNIT):
                            gv[UNIT * j + k] = clamp_fp8(div_rn(gv[UNIT * j + k], s, rs))
                        store_q(orow, u << 3, gv, UNIT * j, d)

    kernel.__name__ = _name(spec)
    return kernel


def _token_loop(spec):
    """Per-token sink for rows too long to hold in registers: amax pass, block reduction, then
    a second pass that reads the row again and quantises it."""
    fetch, decode, store_t, store_q = unit_io(spec)
    UB, NW = spec.scale_ub, words_per_unit(spec)

    def kernel(out, x, scales, scale, partials, p0, p1, d):
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        row = cuda.blockIdx.x
        wv = cuda.local.array(NW, uint32)
        gv = cuda.local.array(UNIT, float32)
        uv = cuda.local.array(UNIT, float32)
        sm = cuda.shared.array(REDUCE_SCRATCH, float32)
        i0, i1 = _row_view(x, row)
        xr, orow = x[i0, i1], out[i0, i1]
        nu = (d + (UNIT - 1)) >> 3
        amax = ZERO
        for u in range(int64(tid), nu, nt):
            fetch(wv, gv, uv, 0, xr, u << 3, d)
            decode(wv, gv, uv, 0)
            for k in range(UNIT):
                amax = fmaxf(amax, abs(gv[k]))
        s = scale_from_amax(block_max(amax, sm), scale[0] if UB else ZERO, UB)
        if tid == 0:
            scales[row, 0] = s
        rs = ONE / s
        for u in range(int64(tid), nu, nt):
            fetch(wv, gv, uv, 0, xr, u << 3, d)
            decode(wv, gv, uv, 0)
            for k in range(UNIT):
                gv[k] = clamp_fp8(div_rn(gv[k], s, rs))
            store_q(orow, u << 3, gv, 0, d)

    kernel.__name__ = _name(spec)
    return kernel


def _amax(spec):
    """First pass of the dynamic per-tensor quant: block ``(bx, by)`` folds ``max|x|`` over units
    ``by*T + t, ...`` (step ``gy*T``) of rows ``bx, bx + gx, ...``, ``upt`` rows at a time with
    every load in flight, and writes it to ``partials[by*gx + bx]`` (every slot is written: no
    zeroing, no atomics, deterministic). A grid of one block writes ``scale[0] = max / 448``
    instead: the whole amax of a small tensor, or the middle pass over the partials."""
    fetch, decode, _, _ = unit_io(spec)
    NW, NS, UPT = words_per_unit(spec) * spec.upt, UNIT * spec.upt, spec.upt

    def kernel(out, x, scales, scale, partials, p0, p1, d):
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        gx = cuda.gridDim.x
        gy = cuda.gridDim.y
        wv = cuda.local.array(NW, uint32)
        gv = cuda.local.array(NS, float32)
        uv = cuda.local.array(NS, float32)
        sm = cuda.shared.array(REDUCE_SCRATCH, float32)
        nu = (d + (UNIT - 1)) >> 3
        rows = int64(x.shape[0]) * x.shape[1]
        amax = ZERO
        for r0 in range(int64(cuda.blockIdx.x), rows, int64(gx) * UPT):
            for u in range(int64(cuda.blockIdx.y) * nt + tid, nu, int64(gy) * nt):
                for j in range(UPT):  # every row's load in flight before any is folded
                    row = r0 + j * gx
                    if row < rows:
                        i0, i1 = _row_view(x, row)
                        fetch(wv, gv, uv, j, x[i0, i1], u << 3, d)
                for j in range(UPT):
                    if r0 + j * gx < rows:
                        decode(wv, gv, uv, j)
                        for k in range(UNIT):
                            amax = fmaxf(amax, abs(gv[UNIT * j + k]))
        amax = block_max(amax, sm)
        if tid == 0:
            if gx * gy == 1:
                scale[0] = amax / FP8_MAX
            else:
                partials[int64(cuda.blockIdx.y) * gx + cuda.blockIdx.x] = amax

    kernel.__name__ = _name(spec)
    return kernel


# ---------------------------------------------------------------- dequantisation
@dataclass(frozen=True)
class DequantSpec:
    kind: str  # output dtype: bf16, f16, f32


DEQUANT_EPT = 4  # elements a thread converts


def dequant_argtypes(spec):
    return (L.array_type(storage_dtype(spec.kind), 3), L.array_type("uint8", 3), L.array_type("float32", 2),
            L.i64(0).numba_type, L.i64(0).numba_type)


def dequant_kernel(spec):
    """``out[row, e] = r(f(q[row, e]) * scale[row, e // group])``: ``scale`` is a ``[rows, G]``
    view (strides 0 broadcast a per-tensor or per-token scale). Block ``(row, c)``, thread ``t``
    converts elements ``c*T*4 + t + j*T``, ``j < 4`` (coalesced)."""
    enc = CODECS[spec.kind].encode

    def kernel(out, q, scale, group, d):
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        row = cuda.blockIdx.x
        i0, i1 = _row_view(q, row)
        qr, orow = q[i0, i1], out[i0, i1]
        first = int64(cuda.blockIdx.y) * nt * DEQUANT_EPT + tid
        for j in range(DEQUANT_EPT):
            e = first + j * nt
            if e < d:
                orow[e] = enc(e4m3_to_f32(qr[e]) * scale[row, e // group])

    kernel.__name__ = f"fp8_dequant_{spec.kind}"
    return kernel


# ---------------------------------------------------------------- declared variants
def op_specs():
    """Every ActSpec the ops launch, layout and width left to the launcher (``layout="vector"``,
    ``upt`` the chunk/amax default): one per (op, dtype, option)."""
    specs = []
    for kind in KINDS:
        specs += [ActSpec(kind, act) for act in GATED]
        specs.append(ActSpec(kind, "silu", "static"))
        for g in GROUP_SIZES:
            for ue in (False, True):
                specs.append(ActSpec(kind, "silu", "group", group=g, ue8m0=ue))
                specs.append(ActSpec(kind, "none", "group", group=g, ue8m0=ue))
            specs.append(ActSpec(kind, "silu", "group", numerics="per_block", group=g))
        specs += [ActSpec(kind, "none", "static"), ActSpec(kind, "none", "tensor"),
                  ActSpec(kind, "none", "amax", upt=AMAX_UPT)]  # (scalar: upt 1)
        specs += [ActSpec(kind, "none", "token", scale_ub=ub, upt=TOKEN_UPT[0]) for ub in (False, True)]
    return specs


def variants():
    """Every ``(factory, spec, argtypes)`` the family's ops can launch (the PTX test compiles
    them all): both layouts of every op spec, every per-token width (vector layout) and the
    reread loop (both layouts), the small layout of the gated activations, and the
    dequantisation kernels."""
    import dataclasses
    out = []
    for base in op_specs():
        for layout in ("vector", "scalar"):
            if base.quant == "token":
                widths = (TOKEN_UPT + (0,)) if layout == "vector" else (0,)
            elif base.quant == "amax":
                widths = (AMAX_UPT if layout == "vector" else 1,)
            else:
                widths = chunk_upts(base)
            for upt in widths:
                spec = dataclasses.replace(base, layout=layout, upt=upt)
                out.append((act_quant_kernel, spec, argtypes(spec)))
        if small_ok(base):
            spec = dataclasses.replace(base, layout="small", upt=1)
            out.append((act_quant_kernel, spec, argtypes(spec)))
    for kind in KINDS:
        spec = DequantSpec(kind)
        out.append((dequant_kernel, spec, dequant_argtypes(spec)))
    return out
