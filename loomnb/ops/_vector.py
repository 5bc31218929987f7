"""16-byte vector loads and stores, and the dtype codecs kernels use to read and write them.

Vector kernels see a row as ``uint32`` words (a 1-D row view, see ``_launch.array(...,
words=True)``). A *unit* is 16 bytes: 8 bf16/fp16 values in 4 words, or 8 FP8 codes in 2 words.

* ``load_u32x4(row, i)`` / ``load_u32x2`` read words ``i .. i+3`` (``i+1``) in one instruction;
  ``store_u32x4`` / ``store_u32x2`` write them. The address must be 16- (8-) byte aligned.
* ``CODECS[kind]`` (bf16, f16, f32): ``decode`` (storage bits -> float32, exact), ``encode``
  (float32 -> storage, round to nearest even), ``rnd`` (``r(x)``: round to the dtype and widen
  back), ``unpack`` (a word of two 16-bit values -> ``(lo, hi)`` float32) and ``pack``
  (``(hi, lo)`` -> a word).
* ``row_loader(kind, layout)``: a row's 16-byte units (or elements) as float32 values.
* ``unit_io(kind)``: ``load8(vals, row, u, j)`` decodes unit ``u`` of ``row`` into
  ``vals[8j : 8j+8]``; ``store8(row, u, vals, j)`` rounds and stores them as the dtype;
  ``store8_fp8(row, u, vals, j)`` stores them as 8 FP8 E4M3 codes (``row`` is the FP8 array's
  words).

Each has a simulator twin (plain Python on NumPy values); the GPU versions are numba intrinsics
(``loomnb._numba_internals``) and Hopper's packed conversion instructions.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from numba import float32

from .._numba_internals import SIM, device
from ..layouts.dtypes import (bf16_round, bf16_to_f32, bits_f32, f16_round, f16_to_f32,
                              f32_to_bf16, f32_to_f16, pack_bf16x2, pack_e4m3x2, pack_f16x2)

if SIM:
    @device
    def load_u32x4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    @device
    def load_u32x2(a, i):
        return a[i], a[i + 1]

    @device
    def store_u32x4(a, i, v):
        for k in range(4):
            a[i + k] = v[k]

    @device
    def store_u32x2(a, i, v):
        a[i] = v[0]
        a[i + 1] = v[1]
else:
    from .._numba_internals import load_u32x2, load_u32x4, store_u32x2, store_u32x4  # noqa: F401


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


class Codec(NamedTuple):
    decode: object
    encode: object
    rnd: object
    unpack: object
    pack: object


CODECS = {
    "bf16": Codec(bf16_to_f32, f32_to_bf16, bf16_round, _bf16_pair, pack_bf16x2),
    "f16": Codec(f16_to_f32, f32_to_f16, f16_round, _f16_pair, pack_f16x2),
    "f32": Codec(_ident, _ident, _ident, None, None),
}


@functools.cache
def unit_io(kind):
    """(load8, store8, store8_fp8) for 16-byte units of a ``kind`` row (bf16 or f16)."""
    unpack, pack = CODECS[kind].unpack, CODECS[kind].pack

    @device
    def load8(vals, row, u, j):
        w = load_u32x4(row, u << 2)
        for k in range(4):
            lo, hi = unpack(w[k])
            vals[8 * j + 2 * k] = lo
            vals[8 * j + 2 * k + 1] = hi

    @device
    def store8(row, u, vals, j):
        b = 8 * j
        store_u32x4(row, u << 2, (pack(vals[b + 1], vals[b]), pack(vals[b + 3], vals[b + 2]),
                                  pack(vals[b + 5], vals[b + 4]), pack(vals[b + 7], vals[b + 6])))

    @device
    def store8_fp8(row, u, vals, j):
        b = 8 * j
        lo = (int(pack_e4m3x2(vals[b + 3], vals[b + 2])) << 16) | int(pack_e4m3x2(vals[b + 1], vals[b]))
        hi = (int(pack_e4m3x2(vals[b + 7], vals[b + 6])) << 16) | int(pack_e4m3x2(vals[b + 5], vals[b + 4]))
        store_u32x2(row, u << 1, (lo, hi))

    return load8, store8, store8_fp8


UNIT_ELEMS = {"bf16": 8, "f16": 8, "f32": 4, "fp8": 16}  # elements per 16-byte unit


@functools.cache
def row_loader(kind, layout):
    """``(unit_of, one)`` for a row view of ``kind`` (bf16, f16, f32) in ``layout``:
    ``unit_of(row, u)`` -> the float32 values of 16-byte unit ``u`` (``layout`` "vec": the row
    seen as uint32 words, :func:`loomnb.ops._launch.array` with ``words``; ``None`` for
    "scalar"), ``one(row, i)`` -> element ``i`` as float32 (either layout)."""
    if layout == "scalar":
        dec = CODECS[kind].decode

        @device
        def one_scalar(row, i):
            return dec(row[i])

        return None, one_scalar
    assert layout == "vec", layout
    if kind == "f32":
        @device
        def unit_f32(row, u):
            w = load_u32x4(row, u << 2)
            return (bits_f32(w[0]), bits_f32(w[1]), bits_f32(w[2]), bits_f32(w[3]))

        @device
        def one_f32(row, i):
            return bits_f32(row[i])

        return unit_f32, one_f32
    unpack = CODECS[kind].unpack

    @device
    def unit_16(row, u):
        w = load_u32x4(row, u << 2)
        a0, a1 = unpack(w[0])
        b0, b1 = unpack(w[1])
        c0, c1 = unpack(w[2])
        d0, d1 = unpack(w[3])
        return (a0, a1, b0, b1, c0, c1, d0, d1)

    @device
    def one_16(row, i):
        lo, hi = unpack(row[i >> 1])
        return hi if i & 1 else lo

    return unit_16, one_16
