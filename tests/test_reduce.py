"""The shared reductions and scans (``loomnb.ops._reduce``) against NumPy:

* block sum/max/min/argmax and group (sub-warp) reductions, on all-negative values (a max that
  pads with 0 would be wrong), NaNs, ties, and block sizes of one warp to 32 warps;
* ``wide_add`` / ``wide_get``: 64-bit bins from 32-bit atomics, with weights near 2^32 that
  carry into the high word many times, against NumPy's int64 sums;
* the prefix sums (``group_scan`` / ``block_scan``, added for the speculative-verification
  family's compaction): inclusive scans over aligned lane groups of every width, the block's
  exclusive scan and total at one to 32 warps, called twice in a row (the documented barrier
  between uses of one scratch array).

The same kernels run in the simulator pass (shared-memory twins) and on the GPU (warp
shuffles, ``shfl.sync.up`` and one barrier): the GPU path is what the simulator cannot check.
"""

import numpy as np
import pytest
from numba import cuda, float32, float64, int64, uint32, uint64

from conftest import HAS_GPU, SIM
from loomnb.ops._reduce import (REDUCE_SCRATCH, block_argmax, block_max, block_max_u64, block_min,
                                block_scan, block_sum64, fadd, fmax_nan, group_argmax, group_reduce,
                                group_scan, key_index, order_key, wide_add, wide_get)


@cuda.jit
def _block_kernel(vals, out):
    t = cuda.threadIdx.x
    b = cuda.blockIdx.x
    s64 = cuda.shared.array(REDUCE_SCRATCH, float64)
    smax = cuda.shared.array(REDUCE_SCRATCH, float32)
    smin = cuda.shared.array(REDUCE_SCRATCH, float32)
    sav = cuda.shared.array(REDUCE_SCRATCH, float32)
    sai = cuda.shared.array(REDUCE_SCRATCH, int64)
    sk = cuda.shared.array(REDUCE_SCRATCH, uint64)
    v = vals[b, t]
    s = block_sum64(float64(v), s64)
    mx = block_max(v, smax)
    mn = block_min(v, smin)
    av, ai = block_argmax(v, int64(t), sav, sai)
    out[b, t, 0] = s
    out[b, t, 1] = mx
    out[b, t, 2] = mn
    out[b, t, 3] = av
    out[b, t, 4] = ai
    out[b, t, 5] = key_index(block_max_u64(order_key(v, t), sk))  # the argmax as one key


def _make_group_kernel(width):
    gsum = group_reduce(fadd, width)
    gmax = group_reduce(fmax_nan, width)
    garg = group_argmax(width)

    @cuda.jit
    def k(vals, out):
        t = cuda.threadIdx.x
        v = vals[0, t]
        for rep in range(2):  # called twice in a row: group reductions need no barrier
            out[t, 0] = gsum(v)
            out[t, 1] = gmax(v)
            av, ai = garg(v, int64(t))
            out[t, 2] = av
            out[t, 3] = ai
    return k


def _values(rng, blocks, threads):
    v = -(rng.random((blocks, threads)) * 100 + 1).astype(np.float32)  # all negative
    v[0, threads // 3] = v[0, 5]  # a tie
    if blocks > 1:
        v[1, threads - 2] = np.nan
    return v


def _to(a):
    return a if SIM else cuda.to_device(a)


def _back(a):
    return a if SIM else a.copy_to_host()


def _check_block(threads):
    rng = np.random.default_rng(threads)
    v = _values(rng, 3, threads)
    out = _to(np.zeros((3, threads, 6), np.float64))
    _block_kernel[3, threads](_to(v), out)
    o = _back(out)
    for b in range(3):
        row = v[b]
        assert np.array_equal(o[b, :, 0], np.full(threads, o[b, 0, 0]), equal_nan=True), "every thread holds the same sum"
        np.testing.assert_allclose(o[b, 0, 0], row.astype(np.float64).sum(), rtol=1e-12)  # NaN == NaN here
        assert o[b, 0, 1] == np.nanmax(row) and o[b, 0, 2] == np.nanmin(row), "NaN ignored, no 0 padding"
        want_i = int(np.argmax(np.where(np.isnan(row), np.inf, row)))  # NaN is the largest, first wins
        assert np.all(o[b, :, 5] == want_i), "block_max_u64 of order keys: the same argmax"
        assert o[b, 0, 4] == want_i and (np.isnan(o[b, 0, 3]) if np.isnan(row).any() else o[b, 0, 3] == row[want_i])


def _check_group(width):
    rng = np.random.default_rng(width)
    v = _values(rng, 1, 64)
    v[0, 3] = v[0, 1]  # a tie inside group 0
    out = _to(np.zeros((64, 4), np.float64))
    _make_group_kernel(width)[1, 64](_to(v), out)
    o = _back(out)
    for g in range(64 // width):
        seg = v[0, g * width:(g + 1) * width].astype(np.float64)
        lanes = o[g * width:(g + 1) * width]
        np.testing.assert_allclose(lanes[:, 0], seg.sum(), rtol=1e-6)
        assert np.all(lanes[:, 1] == np.max(seg))
        assert np.all(lanes[:, 3] == g * width + int(np.argmax(seg)))


@cuda.jit
def _wide_kernel(w, bins, out):
    words = cuda.shared.array(8, uint32)
    t = cuda.threadIdx.x
    if t < 8:
        words[t] = uint32(0)
    cuda.syncthreads()
    wide_add(words, bins[t], w[t])
    cuda.syncthreads()
    if t < 4:
        out[t] = wide_get(words, t)


def _check_wide(threads):
    rng = np.random.default_rng(threads)
    w = rng.integers(2**32 - 2**20, 2**32 + 1, threads).astype(np.int64)  # up to 2^32 itself
    w[::7] = rng.integers(0, 4, len(w[::7]))
    bins = rng.integers(0, 3, threads).astype(np.int32)  # bin 3 stays empty
    out = _to(np.zeros(4, np.int64))
    _wide_kernel[1, threads](_to(w), _to(bins), out)
    want = np.array([w[bins == b].sum() for b in range(4)], np.int64)
    assert want[:3].max() > 2**33, "the test must carry into the high word"
    np.testing.assert_array_equal(_back(out), want)


@pytest.mark.sim
def test_wide_bins_sim():
    _check_wide(64)


@pytest.mark.gpu
def test_wide_bins_gpu():
    _check_wide(1024)


@pytest.mark.sim
@pytest.mark.parametrize("threads", [32, 96])
def test_block_reductions_sim(threads):
    _check_block(threads)


@pytest.mark.sim
@pytest.mark.parametrize("width", [8, 32])
def test_group_reductions_sim(width):
    _check_group(width)


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [32, 96, 256, 1024])
def test_block_reductions_gpu(threads):
    _check_block(threads)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [4, 8, 16, 32])
def test_group_reductions_gpu(width):
    _check_group(width)


# ------------------------------------------------------------------ prefix sums (scans)
_bscan = block_scan(int64)


def _group_scan_kernel(width):
    scan = group_scan(width)

    @cuda.jit
    def k(vals, out):
        t = cuda.threadIdx.x
        v = vals[t]
        for rep in range(2):  # twice in a row: no barrier needed between group scans
            out[rep, t] = scan(v)
    return k


@cuda.jit
def _block_scan_kernel(vals, out):
    t = cuda.threadIdx.x
    scratch = cuda.shared.array(REDUCE_SCRATCH, int64)
    for rep in range(2):
        before, total = _bscan(vals[rep, t], scratch)
        out[rep, t, 0] = before
        out[rep, t, 1] = total
        cuda.syncthreads()  # before the scratch is used again


def _check_group_scan(width, threads=64):
    v = np.random.default_rng(width).integers(-5, 1000, threads).astype(np.int64)
    out = _to(np.zeros((2, threads), np.int64))
    _group_scan_kernel(width)[1, threads](_to(v), out)
    o = _back(out)
    want = np.concatenate([np.cumsum(g) for g in v.reshape(-1, width)])
    np.testing.assert_array_equal(o[0], want)
    np.testing.assert_array_equal(o[1], want)


def _check_block_scan(threads):
    v = np.random.default_rng(threads).integers(0, 1 << 40, (2, threads)).astype(np.int64)
    v[1, ::3] = 0
    out = _to(np.zeros((2, threads, 2), np.int64))
    _block_scan_kernel[1, threads](_to(v), out)
    o = _back(out)
    for rep in range(2):
        np.testing.assert_array_equal(o[rep, :, 0], np.cumsum(v[rep]) - v[rep], "exclusive prefix")
        assert (o[rep, :, 1] == v[rep].sum()).all(), "every thread holds the total"


@pytest.mark.sim
@pytest.mark.parametrize("width", [2, 8, 32])
def test_group_scan_sim(width):
    _check_group_scan(width)


@pytest.mark.sim
@pytest.mark.parametrize("threads", [32, 96])
def test_block_scan_sim(threads):
    _check_block_scan(threads)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [2, 4, 8, 16, 32])
def test_group_scan_gpu(width):
    _check_group_scan(width, threads=128)


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [32, 96, 256, 1024])
def test_block_scan_gpu(threads):
    _check_block_scan(threads)


@pytest.mark.sim
def test_simulator_threads_share_one_shared_array_per_line():
    """The simulator's shared arrays are one per source line and block even when threads reach
    the line together (loomnb._numba_internals item 6): at a 0.1 ms switch interval, with the
    lock removed, some launches of this kernel see a thread's write lost."""
    import sys

    from loomnb._numba_internals import _lock_sim_shared_arrays
    from numba.cuda.simulator import kernelapi

    assert getattr(kernelapi.FakeCUDAShared.array, "_loomnb_locked", False)
    _lock_sim_shared_arrays()  # idempotent

    @cuda.jit
    def neighbours(out):
        sm = cuda.shared.array(64, int64)
        other = cuda.shared.array(64, int64)
        t = cuda.threadIdx.x
        sm[t] = t
        other[t] = -t
        cuda.syncthreads()
        out[cuda.blockIdx.x, t] = sm[(t + 1) % 64] + 1000 * other[(t + 1) % 64]

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        out = np.zeros((8, 64), np.int64)
        neighbours[8, 64](out)
    finally:
        sys.setswitchinterval(old)
    want = (np.arange(1, 65) % 64) * -999
    assert (out == want).all(), "a thread's shared write was lost (or two lines aliased)"
