"""Block-wide reductions shared by every kernel (sum and NaN-dropping max over float32).

On the GPU: a butterfly of warp shuffles (``shfl_xor``) inside each warp, the warp totals through
32 floats of shared memory, then a second butterfly, so every thread of the block returns the
total. Under numba's CUDA simulator (no warp shuffles) the same contract is met through shared
memory. The order of additions differs from vLLM's CUB reduction, so results downstream of a sum
agree with vLLM to fp32 rounding, not bit for bit (see ``tests/tolerances.py``).

Block sizes must be multiples of 32, at most 1024.
"""

from numba import cuda, float32

from .._numba_internals import SIM

FULL_MASK = 0xFFFFFFFF


@cuda.jit(device=True)
def fmax_nan(a, b):
    """``fmaxf``: the larger of a and b, ignoring a NaN operand (CUDA's fmaxf semantics)."""
    if b > a or a != a:
        return b
    return a


if SIM:
    @cuda.jit(device=True)
    def block_sum(v):
        """Sum of ``v`` over the block, returned to every thread (simulator path)."""
        sm = cuda.shared.array(1024, float32)
        tid = cuda.threadIdx.x
        sm[tid] = v
        cuda.syncthreads()
        s = float32(0)
        for i in range(cuda.blockDim.x):
            s += sm[i]
        cuda.syncthreads()
        return float32(s)

    @cuda.jit(device=True)
    def block_max(v):
        """``fmaxf`` of ``v`` over the block, returned to every thread (simulator path)."""
        sm = cuda.shared.array(1024, float32)
        tid = cuda.threadIdx.x
        sm[tid] = v
        cuda.syncthreads()
        m = sm[0]
        for i in range(1, cuda.blockDim.x):
            m = fmax_nan(m, sm[i])
        cuda.syncthreads()
        return float32(m)
else:
    @cuda.jit(device=True)
    def _warp_sum(v):
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
        return v

    @cuda.jit(device=True)
    def _warp_max(v):
        for off in (16, 8, 4, 2, 1):
            v = fmax_nan(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
        return v

    @cuda.jit(device=True)
    def block_sum(v):
        """Sum of ``v`` over the block, returned to every thread."""
        sm = cuda.shared.array(32, float32)
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        v = _warp_sum(v)
        if lane == 0:
            sm[warp] = v
        cuda.syncthreads()
        v = sm[lane] if lane < (cuda.blockDim.x >> 5) else float32(0)
        v = _warp_sum(v)
        cuda.syncthreads()  # sm may be reused by the next reduction
        return v

    @cuda.jit(device=True)
    def block_max(v):
        """``fmaxf`` of ``v`` over the block, returned to every thread."""
        sm = cuda.shared.array(32, float32)
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        v = _warp_max(v)
        if lane == 0:
            sm[warp] = v
        cuda.syncthreads()
        v = sm[lane] if lane < (cuda.blockDim.x >> 5) else float32(0)
        v = _warp_max(v)
        cuda.syncthreads()
        return v
