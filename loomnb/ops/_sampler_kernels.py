"""The sampler family's kernels: logits penalties (elementwise) and one row kernel for every
top-k / top-p / min-p filter, renormalisation and seeded sample.

**Penalties** (``penalty_kernel``): one thread an element, a 2-D grid of (row chunks, rows);
vLLM's formulas in its order (see ``loomnb.ops.sampler``), every step rounded as vLLM's CUDA
op and torch's in-place float32 arithmetic round it.

**The row kernel** (``row_kernel``): one block a row, several passes over the row (the row is
read from L2 after the first). Every filter keeps a prefix of the row's tokens in descending
order of their ordered 32-bit key (the float's bits made unsigned-monotone: ``+-0`` as one key,
NaN below everything and never kept), so each filter is a threshold on that key, found by a
radix select: four levels of 8-bit digits, most significant first; at each level the block
histograms the digit of the elements whose higher digits equal the prefix found so far, and a
block scan from the top bin finds the bin where the running total first reaches the target.
The histogram has 16 copies of the 256 bins in shared memory, lane ``l`` of every warp adding to
copy ``l % 16`` (a copy's stride of 257 entries puts one bin of different copies in different
banks), so the lanes of a warp that hit the same bin -- most of them at the first level, where
a row's values share a few exponents -- add to different words; the copies are summed after.

* top-k: the weight is 1 and the target ``k``: the threshold is the ``k``-th largest key, and
  every element with that key is kept (ties at the boundary too).
* top-p: the weight is the token's mass in fixed point, ``W = floor(w * 2^32)`` (int64) with
  ``w = expf(r32(r32(x / T) - r32(x_max / T)))`` from logits (1 for ``x = x_max``) or
  ``r32(p * r32(1 / p_max))`` from probabilities, and the target ``top_p * Z`` (float64; ``Z``
  the sum of ``W`` over the candidates). A token is kept when the mass of the keys above its own
  is below the target: the smallest prefix whose mass reaches ``top_p``, ties kept. Integer sums
  make the choice independent of the order of the atomics (deterministic).
* min-p: a predicate, ``w >= min_p`` from logits (``p / p_max >= min_p``) or ``p >= r32(p_max *
  min_p)`` from probabilities.

Then the row's output: a sample is the Gumbel-max over the kept tokens, ``argmax r32(s + g)``
with ``s = r32(x / T)`` (or ``log p``) and ``g = -log(-log(u))``, ``u`` from Philox-4x32-10
(``_philox``) at key ``(seed_lo, seed_hi)`` and counter ``(i >> 2, salt, offset_lo,
offset_hi)``, word ``i & 3`` for token ``i`` (``salt`` is the row unless every row has its own
seed); the lowest index wins a tie. A row at temperature ``< 1e-5`` takes the argmax instead
(the lowest index of the largest non-NaN logit). ``mask`` writes the logits with the dropped
tokens at ``-inf``; ``renorm`` writes ``r32(p / r32(S))`` for the kept tokens and 0 elsewhere,
``S`` their float64 sum (a block reduction in thread order: deterministic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from numba import cuda, float32, float64, int32, int64, uint32, uint64

from .._dtypes import storage_dtype
from .._numba_internals import device
from ..layouts.dtypes import f32_bits
from . import _launch as L
from ._philox import gumbel, philox
from ._reduce import (REDUCE_SCRATCH, block_max_u64, block_reduce, block_scan, imin,
                      key_index, key_value, mul_rn, order_key, umax)
from ._sampling_rows import _loader
from ._vector import CODECS

KINDS = ("f32", "bf16", "f16")
SOURCES = ("logits", "probs")
OUTPUTS = ("sample", "mask", "renorm")
BINS = 256          # radix digit: 8 bits
LEVELS = 4          # 32-bit keys
COPIES = 16         # histogram copies: lane l adds to copy l % COPIES
STRIDE = BINS + 1   # a copy's stride (int64 entries): copies of one bin fall in different banks
HIST = COPIES * STRIDE
MASS_SCALE = 4294967296.0   # 2^32: the fixed point of a token's mass
SAMPLING_EPS = 1e-5         # vLLM's _SAMPLING_EPS: a lower temperature is greedy
NO_BIN = 1 << 20
PENALTY_MODES = ("repetition", "all")


@dataclass(frozen=True)
class RowSpec:
    kind: str             # the row's dtype
    source: str           # "logits" or "probs"
    output: str           # "sample", "mask" (logits) or "renorm" (probs)
    joint: bool = False   # top-p on the whole row's mass (FlashInfer's "joint"), else on top-k's

    def __post_init__(self):
        assert self.kind in KINDS and self.source in SOURCES and self.output in OUTPUTS
        assert not (self.output == "mask" and self.source != "logits")
        assert not (self.output == "renorm" and self.source != "probs")


@dataclass(frozen=True)
class PenaltySpec:
    kind: str             # logits dtype
    mode: str             # "repetition" (vLLM's CUDA op) or "all" (apply_penalties)
    counts: str = "i32"   # output_token_counts dtype in "all"

    def __post_init__(self):
        assert self.kind in KINDS and self.mode in PENALTY_MODES and self.counts in ("i32", "i64")


@device
def fkey(v):
    """The ordered key of float32 ``v``: unsigned order = float order, ``-0.0`` as ``+0.0``,
    every NaN 0 (below ``-inf``, whose key is ``0x007FFFFF``)."""
    if v != v:
        return uint32(0)
    b = uint32(f32_bits(v + float32(0)))
    if (b & uint32(0x80000000)) != 0:
        return uint32(b ^ uint32(0xFFFFFFFF))
    return uint32(b | uint32(0x80000000))


@device
def _add_i64(a, b):
    return a + b


@device
def _add_f64(a, b):
    return a + b


@device
def _max_i64(a, b):
    return a if a > b else b


_block_sum_i64 = block_reduce(_add_i64, int64)
_block_sum_f64 = block_reduce(_add_f64, float64)
_block_min_i64 = block_reduce(imin, int64)
_block_max_i64 = block_reduce(_max_i64, int64)
_block_scan_i64 = block_scan(int64)


def _row_argtypes(spec):
    st = storage_dtype(spec.kind)
    y = "float32" if spec.output == "renorm" else st
    i64, f32 = L.i64(0).numba_type, L.f32(0).numba_type
    return (L.array_type(st, 2), L.array_type("int32", 1), L.array_type(y, 2),
            L.array_type("int32", 1), L.array_type("float32", 1), L.array_type("float32", 1),
            L.array_type("float32", 1), L.array_type("int64", 1), L.array_type("int64", 1),
            i64, f32, f32, f32, i64, i64, i64, i64)


def row_kernel(spec):
    """The ``@cuda.jit`` function of ``spec``. Parameters: ``x [R, V]`` (storage dtype),
    ``ids [R]`` int32 (sample), ``y [R, V]`` (mask: logits dtype; renorm: fp32), the per-row
    ``top_k`` int32, ``top_p``, ``temperature``, ``min_p`` fp32, ``seed``, ``offset`` int64
    arrays (length 0 where the scalar after them holds for every row), then ``k, p, T, min_p,
    seed, offset`` scalars, ``per_row_seed`` (1: ``seed[r]`` is row r's and the salt is 0) and
    ``V``."""
    one = _loader(spec.kind, "scalar")[1]
    LOGITS = spec.source == "logits"
    SAMPLE, MASK, RENORM = (spec.output == o for o in OUTPUTS)
    JOINT = spec.joint
    NEG_INF = float32(-math.inf)
    enc = CODECS[spec.kind].encode

    @device
    def weight(v, xm, sm, t, inv):
        """``w``: the token's probability over the row's largest (see the module docstring)."""
        if LOGITS:
            if v == xm:
                return float32(1)
            return float32(math.exp(float32(float32(v / t) - sm)))
        return float32(v * inv)

    @device
    def eligible(v, key, lo, xm, sm, t, inv, use_mp, thr):
        if v != v or key < lo:
            return False
        if use_mp:
            if LOGITS:
                return weight(v, xm, sm, t, inv) >= thr
            return v >= thr
        return True

    @cuda.jit(device=True)
    def select(lr, V, mass, p, lo, xm, sm, t, inv, use_mp, thr, hist, tot, res, scr_i):
        """The threshold key of top-k (``mass`` False: target ``p`` elements) or top-p
        (``mass`` True: target ``p`` times the candidates' mass) over the eligible elements
        with key ``>= lo``; ``lo`` if there are none."""
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        copy = (tid & 31) & (COPIES - 1)
        prefix = uint32(0)
        pmask = uint32(0)
        base = int64(0)
        target = float64(p)
        for level in range(LEVELS):
            shift = uint32(24 - 8 * level)
            for b in range(tid, HIST, nt):
                hist[b] = int64(0)
            cuda.syncthreads()
            for i in range(tid, V, nt):
                v = one(lr, i)
                key = fkey(v)
                if (key & pmask) == prefix and eligible(v, key, lo, xm, sm, t, inv, use_mp, thr):
                    w = int64(1)
                    if mass:
                        w = int64(weight(v, xm, sm, t, inv) * float32(MASS_SCALE))
                    if w > 0:
                        cuda.atomic.add(hist, copy * STRIDE + int32((key >> shift) & uint32(255)),
                                        w)
            cuda.syncthreads()
            own = int64(0)
            for b in range(tid, BINS, nt):
                s = int64(0)
                for c in range(COPIES):
                    s += hist[c * STRIDE + b]
                tot[b] = s
                own += s
            if mass and level == 0:
                z = _block_sum_i64(own, scr_i)
                target = float64(p) * float64(z)
                cuda.syncthreads()
            else:
                cuda.syncthreads()
            # the first bin from the top whose running total reaches the target
            run = int64(0)
            found = int64(NO_BIN)
            lowest = int64(-1)
            for j0 in range(0, BINS, nt):
                j = j0 + tid
                c = tot[BINS - 1 - j] if j < BINS else int64(0)
                before, total = _block_scan_i64(c, scr_i)
                hit = c > 0 and float64(base + run + before + c) >= target
                cuda.syncthreads()
                f = _block_min_i64(int64(j) if hit else int64(NO_BIN), scr_i)
                cuda.syncthreads()
                lw = _block_max_i64(int64(j) if c > 0 else int64(-1), scr_i)
                cuda.syncthreads()
                if found == NO_BIN and f != NO_BIN:
                    found = f
                    if j == f:
                        res[1] = base + run + before
                if lw > lowest:
                    lowest = lw
                    if j == lw:
                        res[2] = base + run + before
                run += total
                cuda.syncthreads()
            if found == NO_BIN:
                if lowest < 0:
                    return lo       # no eligible element under this prefix
                found = lowest
                base = res[2]
            else:
                base = res[1]
            cuda.syncthreads()
            prefix = prefix | (uint32(BINS - 1 - found) << shift)
            pmask = pmask | (uint32(255) << shift)
        return prefix

    def kernel(x, ids, y, tk, tp, tt, tmp, sd, so, k_val, p_val, t_val, mp_val, seed_val,
               off_val, per_row_seed, V):
        row = int64(cuda.blockIdx.x)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        lr = x[row]
        hist = cuda.shared.array(HIST, int64)
        tot = cuda.shared.array(BINS, int64)
        res = cuda.shared.array(4, int64)
        scr_u = cuda.shared.array(REDUCE_SCRATCH, uint64)
        scr_i = cuda.shared.array(REDUCE_SCRATCH, int64)
        scr_f = cuda.shared.array(REDUCE_SCRATCH, float64)

        k = int64(tk[row]) if tk.shape[0] > 0 else k_val
        p = tp[row] if tp.shape[0] > 0 else p_val
        t = tt[row] if tt.shape[0] > 0 else t_val
        mpv = tmp[row] if tmp.shape[0] > 0 else mp_val
        if not (LOGITS and SAMPLE):
            t = float32(1)
        use_k = k > 0 and k < V
        use_p = p < float32(1)
        use_mp = mpv > float32(0)
        greedy = LOGITS and SAMPLE and t < float32(SAMPLING_EPS)

        xm = NEG_INF
        im = int64(0)
        if greedy or use_mp or use_p:
            best = uint64(0)
            for i in range(tid, V, nt):
                v = one(lr, i)
                best = umax(best, order_key(v if v == v else NEG_INF, i))
            best = block_max_u64(best, scr_u)
            cuda.syncthreads()
            xm = key_value(best)
            im = key_index(best)
        if greedy:
            if tid == 0:
                ids[row] = int32(im)
            return
        sm = float32(xm / t) if LOGITS else float32(0)
        inv = float32(0)
        if not LOGITS and xm > float32(0):
            inv = float32(float32(1) / xm)
        thr = mpv
        if use_mp and not LOGITS:
            thr = float32(xm * mpv)

        lo = uint32(0)
        if use_k:
            lo = select(lr, V, False, float32(k), lo, xm, sm, t, inv, use_mp, thr, hist, tot,
                        res, scr_i)
        if use_p:
            lo_p = uint32(0) if JOINT else lo
            tp_key = select(lr, V, True, p, lo_p, xm, sm, t, inv, use_mp, thr, hist, tot, res,
                            scr_i)
            if tp_key > lo:
                lo = tp_key

        if SAMPLE:
            seed = seed_val
            off = off_val
            if sd.shape[0] > 0:
                seed = sd[row] if per_row_seed != 0 else sd[0]
            if so.shape[0] > 0:
                off = so[row] if so.shape[0] > 1 else so[0]
            salt = uint32(0) if per_row_seed != 0 else uint32(row)
            useed = uint64(seed)
            uoff = uint64(off)
            k0, k1 = uint32(useed & uint64(0xFFFFFFFF)), uint32(useed >> uint64(32))
            c2, c3 = uint32(uoff & uint64(0xFFFFFFFF)), uint32(uoff >> uint64(32))
            best = uint64(0)
            nq = (V + 3) >> 2
            for q in range(tid, nq, nt):
                w0 = w1 = w2 = w3 = uint32(0)
                drawn = False
                for j in range(4):
                    i = 4 * q + j
                    if i < V:
                        v = one(lr, i)
                        if eligible(v, fkey(v), lo, xm, sm, t, inv, use_mp, thr):
                            if not drawn:
                                w0, w1, w2, w3 = philox(uint32(q), salt, c2, c3, k0, k1)
                                drawn = True
                            w = w0 if j == 0 else (w1 if j == 1 else (w2 if j == 2 else w3))
                            if LOGITS:
                                s = float32(v / t)
                            elif v > float32(0):
                                s = float32(math.log(v))
                            else:
                                s = NEG_INF
                            best = umax(best, order_key(float32(s + gumbel(w)), i))
            best = block_max_u64(best, scr_u)
            if tid == 0:
                ids[row] = int32(key_index(best)) if best > uint64(0) else int32(im)
            return
        if MASK:
            for i in range(tid, V, nt):
                v = one(lr, i)
                keep = v == v and fkey(v) >= lo
                y[row, i] = enc(v) if keep else enc(NEG_INF)
            return
        # RENORM
        s64 = float64(0)
        for i in range(tid, V, nt):
            v = one(lr, i)
            if eligible(v, fkey(v), lo, xm, sm, t, inv, use_mp, thr):
                s64 += float64(v)
        s64 = _block_sum_f64(s64, scr_f)
        s32 = float32(s64)
        for i in range(tid, V, nt):
            v = one(lr, i)
            keep = eligible(v, fkey(v), lo, xm, sm, t, inv, use_mp, thr)
            y[row, i] = float32(v / s32) if keep else float32(0)

    kernel.__name__ = (f"sampler_{spec.source}_{spec.output}_{spec.kind}"
                       f"{'_joint' if JOINT else ''}")
    return kernel


# ---------------------------------------------------------------- penalties
def _penalty_argtypes(spec):
    st = storage_dtype(spec.kind)
    rep = st if spec.mode == "repetition" else "float32"
    counts = "uint8" if spec.mode == "repetition" else {"i32": "int32", "i64": "int64"}[spec.counts]
    return (L.array_type(st, 2), L.array_type("uint8", 2), L.array_type(counts, 2),
            L.array_type(rep, 1), L.array_type("float32", 1), L.array_type("float32", 1),
            L.i64(0).numba_type, L.i64(0).numba_type)


def penalty_kernel(spec):
    """The ``@cuda.jit`` function of ``spec``. Parameters: ``logits [R, V]`` (storage dtype,
    written in place), ``prompt_mask [R, V]`` uint8 (bool), ``output [R, V]`` (uint8 mask in
    "repetition", int counts in "all"), ``repetition [R]`` (logits dtype in "repetition",
    fp32 in "all"), ``frequency [R]``, ``presence [R]`` fp32, ``V``, ``R``. Grid ``(ceil(V /
    block), min(R, 65535))``, rows past the grid looping."""
    codec = CODECS[spec.kind]
    dec, enc = codec.decode, codec.encode
    ALL = spec.mode == "all"

    def kernel(logits, pmask, out, rep, freq, pres, V, R):
        i = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
        if i >= V:
            return
        row = int64(cuda.blockIdx.y)
        while row < R:  # rows past the grid's 65,535 loop
            x = dec(logits[row, i])
            seen = pmask[row, i] != 0
            c = out[row, i]
            if ALL:
                seen = seen or c > 0
                r = rep[row]
            else:
                seen = seen or c != 0
                r = dec(rep[row])
            y = x
            if seen:
                y = dec(enc(float32(x / r) if x > float32(0) else mul_rn(x, r)))
            if ALL:  # products through mul_rn: ptxas would fuse a plain mul with the sub
                y = dec(enc(float32(y - mul_rn(freq[row], float32(c)))))
                y = dec(enc(float32(y - mul_rn(pres[row], float32(1 if c > 0 else 0)))))
            if ALL or seen:
                logits[row, i] = enc(y)
            row += int64(cuda.gridDim.y)

    kernel.__name__ = f"penalties_{spec.mode}_{spec.kind}{'_' + spec.counts if ALL else ''}"
    return kernel


def argtypes(spec):
    return _row_argtypes(spec) if isinstance(spec, RowSpec) else _penalty_argtypes(spec)


def variants():
    """Every ``(factory, spec, argtypes)`` the family's ops launch (the PTX test compiles them
    all)."""
    out = []
    for kind in KINDS:
        for joint in (False, True):
            for source in SOURCES if kind == "f32" else ("logits",):
                spec = RowSpec(kind, source, "sample", joint)
                out.append((row_kernel, spec, argtypes(spec)))
        spec = RowSpec(kind, "logits", "mask")
        out.append((row_kernel, spec, argtypes(spec)))
        spec = PenaltySpec(kind, "repetition")
        out.append((penalty_kernel, spec, argtypes(spec)))
    for counts in ("i32", "i64"):
        spec = PenaltySpec("f32", "all", counts)
        out.append((penalty_kernel, spec, argtypes(spec)))
    spec = RowSpec("f32", "probs", "renorm")
    out.append((row_kernel, spec, argtypes(spec)))
    return out
