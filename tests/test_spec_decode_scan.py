"""The scaffold's prefix sums (``loomnb.ops._reduce.group_scan`` / ``block_scan``), added for the
speculative-verification family's compaction, against NumPy: inclusive scans over aligned lane
groups of every width, the block's exclusive scan and total at one to 32 warps, called twice in
a row (the documented barrier between uses of one scratch array).

The same kernels run in the simulator pass (shared-memory twins) and on the GPU (``shfl.sync.up``
and one barrier): the GPU path is what the simulator cannot check.
"""

import numpy as np
import pytest
from numba import cuda, int64

from conftest import SIM
from loomnb.ops._reduce import REDUCE_SCRATCH, block_scan, group_scan

_bscan = block_scan(int64)


def _group_kernel(width):
    scan = group_scan(width)

    @cuda.jit
    def k(vals, out):
        t = cuda.threadIdx.x
        v = vals[t]
        for rep in range(2):  # twice in a row: no barrier needed between group scans
            out[rep, t] = scan(v)
    return k


@cuda.jit
def _block_kernel(vals, out):
    t = cuda.threadIdx.x
    scratch = cuda.shared.array(REDUCE_SCRATCH, int64)
    for rep in range(2):
        before, total = _bscan(vals[rep, t], scratch)
        out[rep, t, 0] = before
        out[rep, t, 1] = total
        cuda.syncthreads()  # before the scratch is used again


def _to(a):
    return a if SIM else cuda.to_device(a)


def _back(a):
    return a if SIM else a.copy_to_host()


def _check_group(width, threads=64):
    v = np.random.default_rng(width).integers(-5, 1000, threads).astype(np.int64)
    out = _to(np.zeros((2, threads), np.int64))
    _group_kernel(width)[1, threads](_to(v), out)
    o = _back(out)
    want = np.concatenate([np.cumsum(g) for g in v.reshape(-1, width)])
    np.testing.assert_array_equal(o[0], want)
    np.testing.assert_array_equal(o[1], want)


def _check_block(threads):
    v = np.random.default_rng(threads).integers(0, 1 << 40, (2, threads)).astype(np.int64)
    v[1, ::3] = 0
    out = _to(np.zeros((2, threads, 2), np.int64))
    _block_kernel[1, threads](_to(v), out)
    o = _back(out)
    for rep in range(2):
        np.testing.assert_array_equal(o[rep, :, 0], np.cumsum(v[rep]) - v[rep], "exclusive prefix")
        assert (o[rep, :, 1] == v[rep].sum()).all(), "every thread holds the total"


@pytest.mark.sim
@pytest.mark.parametrize("width", [2, 8, 32])
def test_group_scan_sim(width):
    _check_group(width)


@pytest.mark.sim
@pytest.mark.parametrize("threads", [32, 96])
def test_block_scan_sim(threads):
    _check_block(threads)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [2, 4, 8, 16, 32])
def test_group_scan_gpu(width):
    _check_group(width, threads=128)


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [32, 96, 256, 1024])
def test_block_scan_gpu(threads):
    _check_block(threads)
