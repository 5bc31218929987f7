"""Reductions shared by every kernel: over a group of lanes of a warp, and over a thread block.

* ``group_reduce(combine, width, stride=1)``: ``combine`` folded over each aligned group of
  ``width`` lanes (a power of two <= 32), the result in every lane of the group -- a 64- or
  128-element FP8 quant group held by 8 or 16 lanes, or a whole warp (``width = 32``). No
  shared memory and no barrier, so it may be called in loops; every lane of the warp must call
  it. With ``stride`` (a power of two, ``width * stride <= 32``) the group is the ``width``
  lanes ``base + r + j * stride`` that share ``r = lane % stride`` inside each aligned span of
  ``width * stride`` lanes: lanes that hold the same slice of different rows (the attention
  family merges per-row partial results that way).
* ``group_reduce_array(combine, width, n, stride=1)``: the same over each of ``vals[0:n]`` of a
  per-thread array, in place (one call for many values: independent shuffles on the GPU, one
  shared-memory exchange in the simulator).
* ``block_reduce(combine, dtype)``: ``combine`` folded over the whole block, the result in every
  thread. It takes a ``scratch`` shared array the caller declares as
  ``cuda.shared.array(REDUCE_SCRATCH, dtype)``: one barrier, then each thread folds the warps'
  partial results in warp order, so all threads hold bit-identical results. A scratch array
  serves one reduction; before reusing it, the caller puts a ``cuda.syncthreads()``.
* ``group_argmax(width)`` / ``block_argmax``: the (value, index) of the largest value, the lowest
  index winning ties and NaN counting as the largest (``torch.argmax``).
* ``order_key(v, i)`` / ``key_value(k)`` / ``key_index(k)``: a float32 and a non-negative index
  packed into one uint64 whose unsigned order is ``argmax_combine``'s (larger value first, NaN
  largest, then the lower index; ``-0.0`` counts as ``+0.0``); 0 is below every key ("none").
  ``group_max_u64(width)`` folds keys over a lane group with one 64-bit shuffle a step (a
  warp argmax in half the shuffles of ``group_argmax``; over the whole warp, two
  ``redux.sync.max.u32``: the high words, then the low words of the keys that hold the top),
  ``group_top2_u64(a, b, width)`` the two largest keys of a group (``width`` known at run
  time), and ``lane_broadcast(v, src)`` lane ``src``'s float32 ``v`` in every lane of the warp.
* ``last_block(counters, row, S, flag)``: across blocks, True in the last of a row's ``S``
  blocks to finish (the split counters' ticket), which then folds the blocks' records.
* ``wide_add(words, i, w)`` / ``wide_get(words, i)``: a histogram of exact 64-bit bins kept
  as pairs of uint32 words and added to with 32-bit atomics (a 64-bit shared-memory atomic add
  is a compare-and-swap loop on sm_90, a 32-bit one a single instruction).

A lane or warp that holds no value takes part with the combine's identity (a sum pads with 0, a
max with -inf, a min with +inf -- never 0 for a max of negative values). Block sizes must be
multiples of 32 (full warps), at most 1024.

On the GPU the lanes exchange values with warp shuffles (``shfl.sync.bfly``); numba's CUDA
simulator has none, so there the same contracts are met through shared memory (the scratch
array then holds one value per thread: ``REDUCE_SCRATCH`` is 1024 there, 32 on the GPU).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from numba import cuda, float32, float64, int32, int64, uint32, uint64

from .._numba_internals import SIM, device
from ..layouts.dtypes import bits_f32, f32_bits

if not SIM:
    from .._numba_internals import redux_max_u32

FULL_MASK = 0xFFFFFFFF
REDUCE_SCRATCH = 1024 if SIM else 32  # shared-memory values a block reduction needs
SIM_ARRAY_MAX = 256  # group_reduce_array: values per call the simulator twin takes


if SIM:
    @device
    def mul_rn(a, b):
        """``r32(a * b)``, never contracted into an FMA."""
        return float32(float32(a) * float32(b))
else:
    from numba.cuda import libdevice

    @device
    def mul_rn(a, b):
        """``r32(a * b)`` (``__fmul_rn``: ``mul.rn.f32``, which ptxas never fuses with a later
        add into an FMA, as it may a plain ``mul.f32``)."""
        return libdevice.fmul_rn(a, b)


@device
def fadd(a, b):
    return a + b


@device
def fmax_nan(a, b):
    """``fmaxf``: the larger of a and b, ignoring a NaN operand (CUDA's fmaxf semantics)."""
    if b > a or a != a:
        return b
    return a


@device
def fmin_nan(a, b):
    """``fminf``: the smaller of a and b, ignoring a NaN operand."""
    if b < a or a != a:
        return b
    return a


@device
def imin(a, b):
    """The smaller of two integers (the lowest index of a group, a count's minimum)."""
    return b if b < a else a


if SIM:
    fmaxf = fmax_nan
else:
    from numba.cuda import libdevice

    @device
    def fmaxf(a, b):
        """:func:`fmax_nan` in one instruction (``max.f32``); a zero result may differ from it in
        sign only, so it serves folds of magnitudes (an amax)."""
        return libdevice.fmaxf(a, b)


def _offsets(width, stride):
    """The butterfly's lane offsets (largest first) over ``width`` lanes ``stride`` apart."""
    assert width & (width - 1) == 0 and stride & (stride - 1) == 0 and width * stride <= 32
    return tuple(stride << k for k in reversed(range(int(math.log2(width)))))


@device
def argmax_combine(va, ia, vb, ib):
    """(value, index) of the larger of two candidates: NaN is the largest, ties (and NaN vs
    NaN) go to the lower index -- ``torch.argmax``'s rule."""
    a_nan, b_nan = va != va, vb != vb
    if a_nan or b_nan:
        if a_nan and b_nan:
            return (va, ia) if ia <= ib else (vb, ib)
        return (va, ia) if a_nan else (vb, ib)
    if vb > va or (vb == va and ib < ia):
        return vb, ib
    return va, ia


if SIM:
    def _share(v):
        """``(sm, t)``: every thread's ``v`` in the block-wide float64 array ``sm`` (written
        between two barriers) and this thread's index -- the simulator's stand-in for the warp
        shuffles. The simulator keys a shared array by its source line, so every caller shares
        this one; each reads it, then puts a ``cuda.syncthreads()`` before the next write."""
        sm = cuda.shared.array(1024, float64)
        t = cuda.threadIdx.x
        cuda.syncthreads()
        sm[t] = v
        cuda.syncthreads()
        return sm, t

    @functools.cache
    def group_reduce(combine, width, stride=1):
        span = width * stride

        @cuda.jit(device=True)
        def reduce(v):
            sm, t = _share(v)
            first = (t & ~(span - 1)) + (t & (stride - 1))
            acc = sm[first]
            for k in range(1, width):
                acc = combine(acc, sm[first + k * stride])
            cuda.syncthreads()
            return type(v)(acc)

        return reduce

    @functools.cache
    def group_reduce_array(combine, width, n, stride=1):
        span = width * stride
        # the simulator keys a shared array by its source line: one size for every n
        assert n <= SIM_ARRAY_MAX

        @cuda.jit(device=True)
        def reduce(vals):
            sm = cuda.shared.array(1024 * SIM_ARRAY_MAX, float64)
            t = cuda.threadIdx.x
            cuda.syncthreads()
            for i in range(n):
                sm[i * 1024 + t] = vals[i]
            cuda.syncthreads()
            first = (t & ~(span - 1)) + (t & (stride - 1))
            for i in range(n):
                acc = sm[i * 1024 + first]
                for k in range(1, width):
                    acc = combine(acc, sm[i * 1024 + first + k * stride])
                vals[i] = acc
            cuda.syncthreads()

        return reduce

    @functools.cache
    def block_reduce(combine, dtype):
        @cuda.jit(device=True)
        def reduce(v, scratch):
            scratch[cuda.threadIdx.x] = v
            cuda.syncthreads()
            acc = scratch[0]
            for k in range(1, cuda.blockDim.x):
                acc = combine(acc, scratch[k])
            return dtype(acc)

        return reduce

    @functools.cache
    def group_argmax(width):
        @cuda.jit(device=True)
        def reduce(v, i):
            sv = cuda.shared.array(1024, float32)
            si = cuda.shared.array(1024, int64)
            t = cuda.threadIdx.x
            cuda.syncthreads()
            sv[t], si[t] = v, i
            cuda.syncthreads()
            base = t & ~(width - 1)
            bv, bi = sv[base], si[base]
            for k in range(1, width):
                bv, bi = argmax_combine(bv, bi, sv[base + k], si[base + k])
            cuda.syncthreads()
            return bv, bi

        return reduce

    @cuda.jit(device=True)
    def block_argmax(v, i, scratch_v, scratch_i):
        t = cuda.threadIdx.x
        scratch_v[t], scratch_i[t] = v, i
        cuda.syncthreads()
        bv, bi = scratch_v[0], scratch_i[0]
        for k in range(1, cuda.blockDim.x):
            bv, bi = argmax_combine(bv, bi, scratch_v[k], scratch_i[k])
        return bv, bi
else:
    @functools.cache
    def group_reduce(combine, width, stride=1):
        offsets = _offsets(width, stride)

        @cuda.jit(device=True)
        def reduce(v):
            for off in offsets:
                v = combine(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
            return v

        return reduce

    @functools.cache
    def group_reduce_array(combine, width, n, stride=1):
        offsets = _offsets(width, stride)
        if not offsets:  # groups of one lane: nothing to combine
            @cuda.jit(device=True)
            def reduce(vals):
                pass

            return reduce

        @cuda.jit(device=True)
        def reduce(vals):
            for i in range(n):
                v = vals[i]
                for off in offsets:
                    v = combine(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
                vals[i] = v

        return reduce

    @functools.cache
    def block_reduce(combine, dtype):
        warp_reduce = group_reduce(combine, 32)

        @cuda.jit(device=True)
        def reduce(v, scratch):
            v = warp_reduce(v)
            if (cuda.threadIdx.x & 31) == 0:
                scratch[cuda.threadIdx.x >> 5] = v
            cuda.syncthreads()
            acc = scratch[0]
            for k in range(1, cuda.blockDim.x >> 5):
                acc = combine(acc, scratch[k])
            return dtype(acc)

        return reduce

    @functools.cache
    def group_argmax(width):
        offsets = tuple(1 << k for k in reversed(range(int(math.log2(width)))))

        @cuda.jit(device=True)
        def reduce(v, i):
            for off in offsets:
                v, i = argmax_combine(v, i, cuda.shfl_xor_sync(FULL_MASK, v, off),
                                      cuda.shfl_xor_sync(FULL_MASK, i, off))
            return v, i

        return reduce

    _warp_argmax = group_argmax(32)

    @cuda.jit(device=True)
    def block_argmax(v, i, scratch_v, scratch_i):
        v, i = _warp_argmax(v, i)
        if (cuda.threadIdx.x & 31) == 0:
            scratch_v[cuda.threadIdx.x >> 5] = v
            scratch_i[cuda.threadIdx.x >> 5] = i
        cuda.syncthreads()
        bv, bi = scratch_v[0], scratch_i[0]
        for k in range(1, cuda.blockDim.x >> 5):
            bv, bi = argmax_combine(bv, bi, scratch_v[k], scratch_i[k])
        return bv, bi


# ---------------------------------------------------------------- ordered keys
_SIGN = 0x80000000
_LOW = 0xFFFFFFFF


@device
def order_key(v, i):
    """``v`` (float32; every NaN as one, ``-0.0`` as ``+0.0``) and index ``i`` (``0 <= i <
    2^32 - 1``) as one uint64 ordered like :func:`argmax_combine`."""
    if v != v:
        b = uint64(0x7FC00000)
    else:
        b = uint64(f32_bits(v + float32(0)))
    o = (b ^ uint64(_LOW)) if (b & uint64(_SIGN)) != 0 else (b | uint64(_SIGN))
    return (o << uint64(32)) | (uint64(_LOW) - uint64(i))


@device
def key_value(k):
    """The float32 of key ``k`` (NaN as the canonical quiet NaN)."""
    o = k >> uint64(32)
    b = (o & uint64(0x7FFFFFFF)) if (o & uint64(_SIGN)) != 0 else (o ^ uint64(_LOW))
    return bits_f32(uint32(b))


@device
def key_index(k):
    return int64(uint64(_LOW) - (k & uint64(_LOW)))


@device
def umax(a, b):
    return b if b > a else a


if SIM:
    @functools.cache
    def group_max_u64(width):
        @cuda.jit(device=True)
        def reduce(k):
            sm = cuda.shared.array(1024, uint64)
            t = cuda.threadIdx.x
            cuda.syncthreads()
            sm[t] = k
            cuda.syncthreads()
            base = t & ~(width - 1)
            acc = sm[base]
            for j in range(1, width):
                acc = umax(acc, sm[base + j])
            cuda.syncthreads()
            return acc

        return reduce

    @cuda.jit(device=True)
    def group_top2_u64(a, b, width):
        sa = cuda.shared.array(1024, uint64)
        sb = cuda.shared.array(1024, uint64)
        t = cuda.threadIdx.x
        cuda.syncthreads()
        sa[t], sb[t] = a, b
        cuda.syncthreads()
        base = t & ~(width - 1)
        f, s = uint64(0), uint64(0)
        for j in range(width):
            for x in (sa[base + j], sb[base + j]):
                if x > f:
                    f, s = x, f
                elif x > s:
                    s = x
        cuda.syncthreads()
        return f, s

    @cuda.jit(device=True)
    def lane_broadcast(v, src):
        sm = cuda.shared.array(1024, float32)
        t = cuda.threadIdx.x
        cuda.syncthreads()
        sm[t] = v
        cuda.syncthreads()
        r = sm[(t & ~31) + src]
        cuda.syncthreads()
        return r
else:
    @functools.cache
    def group_max_u64(width):
        if width == 32:  # the whole warp: two redux.sync, the high words, then the low words
            @cuda.jit(device=True)
            def reduce(k):
                hi = redux_max_u32(uint32(k >> uint64(32)))
                lo = redux_max_u32(uint32(k & uint64(_LOW)) if uint32(k >> uint64(32)) == hi
                                   else uint32(0))
                return (uint64(hi) << uint64(32)) | uint64(lo)

            return reduce
        offsets = tuple(1 << k for k in reversed(range(int(math.log2(width)))))

        @cuda.jit(device=True)
        def reduce(k):
            for off in offsets:
                k = umax(k, uint64(cuda.shfl_xor_sync(FULL_MASK, int64(k), off)))
            return k

        return reduce

    @cuda.jit(device=True)
    def group_top2_u64(a, b, width):
        """``(a, b)``, ``a >= b``, this lane's two largest keys: the two largest of its aligned
        group of ``width`` lanes (a power of two <= 32, known at run time)."""
        off = width >> 1
        while off > 0:
            c = uint64(cuda.shfl_xor_sync(FULL_MASK, int64(a), off))  # 64-bit shuffles move ints
            d = uint64(cuda.shfl_xor_sync(FULL_MASK, int64(b), off))
            if c > a:  # the larger first; the second is the larger of the rest
                b = umax(a, d)
                a = c
            else:
                b = umax(b, c)
            off >>= 1
        return a, b

    @cuda.jit(device=True)
    def lane_broadcast(v, src):
        return cuda.shfl_sync(FULL_MASK, v, src)


block_sum64 = block_reduce(fadd, float64)   # float64 sum over the block
block_max = block_reduce(fmax_nan, float32)  # fmaxf over the block (NaN ignored)
block_min = block_reduce(fmin_nan, float32)  # fminf over the block (NaN ignored)
_warp_max_u64 = group_max_u64(32)


@cuda.jit(device=True)
def block_max_u64(k, scratch):
    """The largest uint64 ``k`` (an :func:`order_key`: a block argmax in one value) of the block
    in every thread: each warp's (:func:`group_max_u64`), then the warps' in warp order through
    ``scratch``, a ``cuda.shared.array(REDUCE_SCRATCH, uint64)``; one barrier, as
    ``block_reduce`` (shuffles carry 32 or 64 bits, so ``block_reduce`` takes no uint64)."""
    k = _warp_max_u64(k)
    if (cuda.threadIdx.x & 31) == 0:
        scratch[cuda.threadIdx.x >> 5] = k
    cuda.syncthreads()
    best = scratch[0]
    for w in range(1, cuda.blockDim.x >> 5):
        best = umax(best, scratch[w])
    return best


# ---------------------------------------------------------------- prefix sums (scans)
# * ``group_scan(width)``: the inclusive prefix sum of ``v`` over the lanes of each aligned group
#   of ``width`` lanes (a power of two <= 32): lane ``j`` of a group gets ``v_0 + ... + v_j``.
#   Like ``group_reduce``: no shared memory on the GPU (``shfl.sync.up``), every lane of the warp
#   calls it (under the simulator, every thread of the block).
# * ``block_scan(dtype)``: ``(exclusive, total)`` of ``v`` over the whole block in thread order:
#   thread ``t`` gets ``v_0 + ... + v_{t-1}`` and every thread the block's total. It takes a
#   ``cuda.shared.array(REDUCE_SCRATCH, dtype)`` scratch array and has one barrier, as
#   ``block_reduce``; a ``cuda.syncthreads()`` must separate two uses of the same scratch.
# Both are meant for integer counts and offsets (exact); on floats the result is the sum in the
# order of the combination, not a correctly rounded prefix.
if SIM:
    @functools.cache
    def group_scan(width):
        @cuda.jit(device=True)
        def scan(v):
            sm, t = _share(v)
            acc = sm[t & ~(width - 1)]
            for k in range((t & ~(width - 1)) + 1, t + 1):
                acc += sm[k]
            cuda.syncthreads()
            return type(v)(acc)

        return scan

    @functools.cache
    def block_scan(dtype):
        @cuda.jit(device=True)
        def scan(v, scratch):
            t = cuda.threadIdx.x
            scratch[t] = v
            cuda.syncthreads()
            before = dtype(0)
            total = dtype(0)
            for k in range(cuda.blockDim.x):
                s = scratch[k]
                if k < t:
                    before += s
                total += s
            return dtype(before), dtype(total)

        return scan
else:
    @functools.cache
    def group_scan(width):
        assert width & (width - 1) == 0 and 1 <= width <= 32
        offsets = tuple(1 << k for k in range(int(math.log2(width))))

        @cuda.jit(device=True)
        def scan(v):
            lane = cuda.threadIdx.x & (width - 1)
            for off in offsets:
                up = cuda.shfl_up_sync(FULL_MASK, v, off)
                if lane >= off:
                    v += up
            return v

        return scan

    @functools.cache
    def block_scan(dtype):
        warp_scan = group_scan(32)

        @cuda.jit(device=True)
        def scan(v, scratch):
            t = cuda.threadIdx.x
            inclusive = warp_scan(v)
            if (t & 31) == 31:
                scratch[t >> 5] = inclusive
            cuda.syncthreads()
            warp = t >> 5
            before = dtype(0)
            total = dtype(0)
            for k in range(cuda.blockDim.x >> 5):  # warp totals in warp order: same bits everywhere
                s = scratch[k]
                if k < warp:
                    before += s
                total += s
            return dtype(before + inclusive - v), dtype(total)

        return scan


# ---------------------------------------------------------------- split rows
@cuda.jit(device=True)  # the thread API: a simulator device function (not ``device``)
def last_block(counters, row, S, flag):
    """True in every thread of the last of row ``row``'s ``S`` blocks to get here: the "last
    block finishes" ticket on the split counters ``counters`` (uint32, each 0 between launches:
    ``atomicInc`` wraps it back; ``loomnb.ops._workspace``). Each block fences its writes
    first; the last one fences before it reads theirs. ``flag``: a
    ``cuda.shared.array(1, int32)``. Every thread of the block must call it."""
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        ticket = cuda.atomic.inc(counters, row, uint32(S - 1))
        flag[0] = int32(1) if ticket == uint32(S - 1) else int32(0)
    cuda.syncthreads()
    last = flag[0] != 0
    if last:
        cuda.threadfence()
    return last


if SIM:
    @cuda.jit(device=True)
    def _add_u32(words, j, v):
        with np.errstate(over="ignore"):  # the simulator adds NumPy scalars: a wrap warns
            return cuda.atomic.add(words, j, v)
else:
    @cuda.jit(device=True)
    def _add_u32(words, j, v):
        return cuda.atomic.add(words, j, v)


@cuda.jit(device=True)  # the thread API: a simulator device function (not ``device``)
def wide_add(words, i, w):
    """Adds ``w`` (int64, ``0 <= w < 2^63``) to bin ``i`` of ``words`` (uint32 ``[2 n]``; bin
    ``i`` is ``words[2 i] + 2^32 words[2 i + 1]``) with 32-bit atomics: the add to the low word
    returns its old value, and the add that wraps it carries 1 into the high word, so the bin is
    exact whatever order the adds come in."""
    lo = uint32(w & 0xFFFFFFFF)
    hi = uint32(w >> 32)
    old = uint32(_add_u32(words, 2 * i, lo))
    if lo > uint32(0xFFFFFFFF) - old:  # the add wrapped the low word
        hi = uint32(hi + uint32(1))
    if hi != uint32(0):
        cuda.atomic.add(words, 2 * i + 1, hi)


@cuda.jit(device=True)
def wide_get(words, i):
    """Bin ``i`` of a :func:`wide_add` histogram, as int64."""
    return int64(words[2 * i]) | (int64(words[2 * i + 1]) << int64(32))
