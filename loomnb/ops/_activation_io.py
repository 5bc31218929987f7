"""How the activation kernels move a *unit* -- 8 consecutive output elements, with the gate and
multiplier halves (or interleaved pairs) it reads -- between memory and float32 registers, in
both layouts (``_activation_kernels``' module docstring): 16-byte vector loads and stores of
uint32 words, or one element at a time."""

from __future__ import annotations

import numpy as np
from numba import uint32

from .._numba_internals import device
from ..layouts.dtypes import bits_f32, f32_bits, f32_to_e4m3, pack_e4m3x2
from ._vector import CODECS, load_u32x4, store_u32x2, store_u32x4

UNIT = 8                # output elements per unit
ZERO = np.float32(0.0)


def words_per_unit(spec):
    """uint32 words a thread keeps per unit between its loads and their decoding."""
    if spec.layout == "scalar":
        return 1
    return 16 if spec.kind == "f32" else 8


def unit_io(spec):
    """(fetch, decode, store_t, store_q): move one unit of 8 elements starting at output
    element ``e`` (unit ``j`` of a thread: values ``[8j, 8j+8)`` of its arrays).

    ``fetch(wv, gv, uv, j, xr, e, d)`` issues the unit's loads -- raw words into ``wv`` in the
    vector layout, so a thread can have all its units' loads in flight before it decodes any;
    decoded float32 values straight into ``gv`` (and ``uv`` for gated sources, zeros past the
    row) in the element-wise layout. ``decode(wv, gv, uv, j)`` turns the words into float32
    (a no-op element-wise). ``store_t(orow, e, yv, b, d)`` rounds ``yv[b:b+8]`` to T and stores
    it; ``store_q(orow, e, qv, b, d)`` stores it as E4M3 codes (values already clamped)."""
    kind, act = spec.kind, spec.act
    codec = CODECS[kind]
    dec, enc = codec.decode, codec.encode
    inter, split, swap = act == "swigluoai", act not in ("none", "swigluoai"), act == "mul_silu"
    W = words_per_unit(spec)

    if spec.layout == "scalar":
        @device
        def fetch(wv, gv, uv, j, xr, e, d):
            b = UNIT * j
            for k in range(UNIT):
                if e + k < d:
                    if inter:
                        gv[b + k] = dec(xr[2 * (e + k)])
                        uv[b + k] = dec(xr[2 * (e + k) + 1])
                    elif split:
                        a, c = dec(xr[e + k]), dec(xr[d + e + k])
                        gv[b + k] = c if swap else a
                        uv[b + k] = a if swap else c
                    else:
                        gv[b + k] = dec(xr[e + k])
                else:
                    gv[b + k] = ZERO
                    uv[b + k] = ZERO

        @device
        def decode(wv, gv, uv, j):
            pass

        @device
        def store_t(orow, e, yv, b, d):
            for k in range(UNIT):
                if e + k < d:
                    orow[e + k] = enc(yv[b + k])

        @device
        def store_q(orow, e, qv, b, d):
            for k in range(UNIT):
                if e + k < d:
                    orow[e + k] = f32_to_e4m3(qv[b + k])

        return fetch, decode, store_t, store_q

    @device
    def put4(wv, o, xr, w):
        t = load_u32x4(xr, w)
        for k in range(4):
            wv[o + k] = t[k]

    if kind == "f32":  # words are the float bits: a unit is two 16-byte vectors a half
        @device
        def fetch(wv, gv, uv, j, xr, e, d):
            o = W * j
            if inter:  # 16 floats from element 2e: gate at even, up at odd positions
                for h in range(4):
                    put4(wv, o + 4 * h, xr, 2 * e + 4 * h)
            else:
                ga, ua = (d, 0) if swap else (0, d)
                put4(wv, o, xr, ga + e)
                put4(wv, o + 4, xr, ga + e + 4)
                if split:
                    put4(wv, o + 8, xr, ua + e)
                    put4(wv, o + 12, xr, ua + e + 4)

        @device
        def decode(wv, gv, uv, j):
            o, b = W * j, UNIT * j
            if inter:
                for h in range(4):
                    gv[b + 2 * h] = bits_f32(wv[o + 4 * h])
                    uv[b + 2 * h] = bits_f32(wv[o + 4 * h + 1])
                    gv[b + 2 * h + 1] = bits_f32(wv[o + 4 * h + 2])
                    uv[b + 2 * h + 1] = bits_f32(wv[o + 4 * h + 3])
            else:
                for k in range(UNIT):
                    gv[b + k] = bits_f32(wv[o + k])
                    if split:
                        uv[b + k] = bits_f32(wv[o + UNIT + k])

        @device
        def store_t(orow, e, yv, b, d):
            for h in range(2):
                c = b + 4 * h
                store_u32x4(orow, e + 4 * h, (f32_bits(yv[c]), f32_bits(yv[c + 1]),
                                              f32_bits(yv[c + 2]), f32_bits(yv[c + 3])))
    else:  # bf16/fp16: a unit is one 16-byte vector of 4 words a half, 2 values a word
        unpack, pack = codec.unpack, codec.pack

        @device
        def fetch(wv, gv, uv, j, xr, e, d):
            o = W * j
            if inter:  # 16 elements from element 2e (word e): each word is one (gate, up) pair
                put4(wv, o, xr, e)
                put4(wv, o + 4, xr, e + 4)
            else:
                ga, ua = (d, 0) if swap else (0, d)
                put4(wv, o, xr, (ga + e) >> 1)
                if split:
                    put4(wv, o + 4, xr, (ua + e) >> 1)

        @device
        def decode(wv, gv, uv, j):
            o, b = W * j, UNIT * j
            if inter:
                for k in range(UNIT):
                    lo, hi = unpack(wv[o + k])
                    gv[b + k] = lo
                    uv[b + k] = hi
            else:
                for k in range(4):
                    lo, hi = unpack(wv[o + k])
                    gv[b + 2 * k] = lo
                    gv[b + 2 * k + 1] = hi
                    if split:
                        lo, hi = unpack(wv[o + 4 + k])
                        uv[b + 2 * k] = lo
                        uv[b + 2 * k + 1] = hi

        @device
        def store_t(orow, e, yv, b, d):
            store_u32x4(orow, e >> 1, (pack(yv[b + 1], yv[b]), pack(yv[b + 3], yv[b + 2]),
                                       pack(yv[b + 5], yv[b + 4]), pack(yv[b + 7], yv[b + 6])))

    @device
    def store_q(orow, e, qv, b, d):
        lo = (int(pack_e4m3x2(qv[b + 3], qv[b + 2])) << 16) | int(pack_e4m3x2(qv[b + 1], qv[b]))
        hi = (int(pack_e4m3x2(qv[b + 7], qv[b + 6])) << 16) | int(pack_e4m3x2(qv[b + 5], qv[b + 4]))
        store_u32x2(orow, e >> 2, (uint32(lo), uint32(hi)))

    return fetch, decode, store_t, store_q
