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
