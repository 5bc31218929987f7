"""Fails loudly if a numba-cuda upgrade changes the internals loomnb relies on.

See ``loomnb/_numba_internals.py`` for the list. On the CPU we check the kernel parameter ABI
against the compiled PTX's ``.param`` list and that the attributes we reach for exist; the GPU
test file checks the packing against numba's own ``_prepare_args`` on real device arrays.
"""

import re

import numba.cuda
import pytest
from numba import cuda, types

from loomnb._numba_internals import compile_ptx, param_slots

pytestmark = pytest.mark.nosim


def test_numba_cuda_version_is_the_pinned_one():
    import importlib.metadata
    assert importlib.metadata.version("numba-cuda") == "0.30.4", (
        "numba-cuda changed: re-check every item in loomnb/_numba_internals.py, then update the pin")


def _kernel(out, x, w, eps, n):
    i = cuda.grid(1)
    if i < n:
        out[i, 0] = x[i, 0] * w[0] * eps


def test_kernel_parameter_abi_matches_param_slots():
    argtypes = (types.Array(types.uint16, 2, "A"), types.Array(types.uint32, 2, "A"),
                types.Array(types.float32, 1, "A"), types.float32, types.int64)
    ptx = compile_ptx(_kernel, argtypes)
    params = re.findall(r"\.param \.(\w+) \S+_param_\d+", ptx)
    fmt, n = param_slots(argtypes)
    assert n == len(params) == 9 + 9 + 7 + 1 + 1
    sizes = {"u64": 8, "b64": 8, "f32": 4, "u32": 4}
    expect = [8] * 25 + [4, 8]
    assert [sizes[p] for p in params] == expect
    assert fmt == "<" + "q" * 25 + "f4x" + "q"


def test_internal_attributes_exist():
    from numba.cuda import dispatcher
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray  # noqa: F401
    assert hasattr(dispatcher, "get_current_device")
    assert hasattr(dispatcher._Kernel, "bind") and hasattr(dispatcher._Kernel, "_prepare_args")
    assert hasattr(numba.cuda.extending, "intrinsic")
    import numba.cuda.cgutils as cg
    assert hasattr(cg, "get_item_pointer2") and hasattr(cg, "unpack_tuple")


def test_prepared_launch_points_each_parameter_at_its_slot():
    """The packed block holds the values in numba's order, and the pointer array that
    ``cuLaunchKernel`` reads points at each 8-byte slot (checked here without a GPU)."""
    import ctypes
    import struct

    from loomnb._numba_internals import FastKernel

    argtypes = (types.Array(types.uint16, 2, "A"), types.float32, types.int64)
    def three(x, eps, n):
        x[0, 0] = n

    k = FastKernel(cuda.jit(three), argtypes, "t")
    k._handles[0] = 0x1234  # a stand-in CUfunction handle: nothing is compiled or launched
    params = (0, 0, 6, 2, 0xABC000, 2, 3, 6, 2, 0.5, 7)
    p = k.prepare(0, 5, 64, params)
    base = ctypes.addressof(p._buf)
    assert [p._ptrs[i] for i in range(k._nparams)] == [base + 8 * i for i in range(k._nparams)]
    assert p.params == ctypes.addressof(p._ptrs)
    assert struct.unpack(k._fmt, p._buf.raw) == params
    assert p.driver_call.args[1:] == (5, 1, 1, 64, 1, 1, 0) and int(p.driver_call.args[0]) == 0x1234
    assert k.prepare(0, 5, 64, params).driver_call is p.driver_call  # bound once per (device, grid, block)
