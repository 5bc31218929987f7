"""Block-wide reductions shared by every kernel: a float64 sum and a NaN-dropping float32 max.

On the GPU: a butterfly of warp shuffles (``shfl_xor``) inside each warp, the warp totals through
32 floats of shared memory, then a second butterfly, so every thread of the block returns the
total. Under numba's CUDA simulator (no warp shuffles) the same contract is met through shared
memory. Sums are float64, so their rounding to float32 does not depend on the order of additions
(see ``ops._norm_kernels.inv_rms``); ``block_max`` takes non-negative values (0 pads).

Block sizes must be multiples of 32, at most 1024.
"""

from numba import cuda, float32, float64

from .._numba_internals import SIM, device

FULL_MASK = 0xFFFFFFFF


@device
def fmax_nan(a, b):
    """``fmaxf``: the larger of a and b, ignoring a NaN operand (CUDA's fmaxf semantics)."""
    if b > a or a != a:
        return b
    return a


if SIM:
    def _block_reduce(combine, dtype):
        """Simulator path (no warp shuffles): every thread writes ``v`` to shared memory and
        folds ``combine`` over the block's values in thread order."""

        @cuda.jit(device=True)
        def block_reduce(v):
            sm = cuda.shared.array(1024, dtype)
            sm[cuda.threadIdx.x] = v
            cuda.syncthreads()
            acc = sm[0]
            for i in range(1, cuda.blockDim.x):
                acc = combine(acc, sm[i])
            cuda.syncthreads()
            return dtype(acc)

        return block_reduce

    def _add(a, b):
        return a + b

    block_sum64 = _block_reduce(_add, float64)  # float64 sum of ``v`` over the block
    block_max = _block_reduce(fmax_nan, float32)  # ``fmaxf`` of ``v`` over the block
else:
    def _block_reduce(combine, dtype):
        """A device function returning ``combine`` folded over the block's ``v`` to every
        thread: a shuffle butterfly in each warp, the warp results through 32 ``dtype`` of
        shared memory (``dtype(0)`` pads past the last warp), and a second butterfly."""

        @cuda.jit(device=True)
        def warp_reduce(v):
            for off in (16, 8, 4, 2, 1):
                v = combine(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
            return v

        @cuda.jit(device=True)
        def block_reduce(v):
            sm = cuda.shared.array(32, dtype)
            lane = cuda.threadIdx.x & 31
            warp = cuda.threadIdx.x >> 5
            v = warp_reduce(v)
            if lane == 0:
                sm[warp] = v
            cuda.syncthreads()
            v = sm[lane] if lane < (cuda.blockDim.x >> 5) else dtype(0)
            v = warp_reduce(v)
            cuda.syncthreads()  # sm may be reused by the next reduction
            return v

        return block_reduce

    @cuda.jit(device=True)
    def _add(a, b):
        return a + b

    block_sum64 = _block_reduce(_add, float64)  # float64 sum of ``v`` over the block
    block_max = _block_reduce(fmax_nan, float32)  # ``fmaxf`` of ``v`` over the block (v >= 0)
