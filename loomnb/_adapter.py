"""The zero-copy adapter between callers' arrays and loomnb's kernels.

Accepted arrays:

* on a GPU: torch CUDA tensors, CuPy arrays, numba device arrays, and any object exporting
  ``__cuda_array_interface__`` whose dtype can be read from the object itself (see below);
* under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``): NumPy arrays, with bf16 and FP8 as
  ``ml_dtypes.bfloat16`` / ``ml_dtypes.float8_e4m3fn``.

Nothing is copied: kernels receive the caller's pointer, shape and strides. The dtype is read
from the array object (``torch.bfloat16``, a NumPy/ml_dtypes dtype), never from the
``__cuda_array_interface__`` typestr -- torch has exported bf16 there as ``<f2`` in some
versions and ``<V2`` in others, and a consumer trusting ``<f2`` reads bf16 [1, 3, -1] as
[1.875, 2.125, -1.875]. bf16/fp16 reach kernels as ``uint16`` bit patterns, FP8 as ``uint8``.

Streams: the launch goes to ``stream=`` when given (an int ``CUstream``, a ``torch.cuda.Stream``,
a CuPy or numba stream, or any ``__cuda_stream__`` object); otherwise to torch's current stream
for torch tensors and CuPy's for CuPy arrays, looked up at every call (so CUDA-graph capture
sees it); numba and other arrays go to the per-thread default stream. Never to the legacy
default stream. Outputs are allocated by the caller's library on the input's device.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np

from ._numba_internals import SIM, array_params
from .checks import LoomnbTypeError, LoomnbValueError

CU_STREAM_PER_THREAD = 2

_NAME_KINDS = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float8_e4m3fn": "fp8",
               "int32": "i32", "int64": "i64", "uint8": "u8"}
_KIND_STORAGE = {"bf16": np.uint16, "f16": np.uint16, "f32": np.float32, "fp8": np.uint8,
                 "i32": np.int32, "i64": np.int64, "u8": np.uint8}
_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "fp8": 1, "i32": 4, "i64": 8, "u8": 1}

_torch = None
_torch_kinds = {}


def _load_torch():
    global _torch, _torch_kinds
    if _torch is None and "torch" in sys.modules:
        import torch
        _torch = torch
        _torch_kinds = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32",
                        torch.float8_e4m3fn: "fp8", torch.int32: "i32", torch.int64: "i64",
                        torch.uint8: "u8"}
    return _torch


class Arr:
    """What a kernel needs to know about one caller array: no data is touched or copied."""

    __slots__ = ("obj", "lib", "kind", "dtype_name", "shape", "strides", "ptr", "device", "_extent")

    def __init__(self, obj, lib, kind, dtype_name, shape, strides, ptr, device):
        self.obj, self.lib, self.kind, self.dtype_name = obj, lib, kind, dtype_name
        self.shape, self.strides, self.ptr, self.device = shape, strides, ptr, device
        self._extent = None

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def itemsize(self):
        return _ITEMSIZE[self.kind]

    def is_c_contiguous(self):
        if 0 in self.shape:
            return True
        expect = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True

    def extent(self):
        """[first byte, one past the last byte] this array can touch (computed once)."""
        if self._extent is None:
            if 0 in self.shape:
                self._extent = (self.ptr, self.ptr)
            else:
                lo = hi = 0
                for n, s in zip(self.shape, self.strides):
                    (hi, lo) = (hi + (n - 1) * s, lo) if s >= 0 else (hi, lo + (n - 1) * s)
                self._extent = (self.ptr + lo * self.itemsize, self.ptr + (hi + 1) * self.itemsize)
        return self._extent

    def overlaps(self, other):
        a0, a1 = self.extent()
        b0, b1 = other.extent()
        return a0 < b1 and b0 < a1

    # ---- what the kernel receives ------------------------------------------------------
    def sim_view(self, words=False):
        """Simulator: the NumPy array as its storage dtype (uint32 words if ``words``)."""
        a = self.obj.view(_KIND_STORAGE[self.kind])
        return a.view(np.uint32) if words else a

    def params(self, words=False):
        """GPU: the flattened numba parameters for this array (as uint32 words if ``words``)."""
        isz = self.itemsize
        strides = tuple(s * isz for s in self.strides)
        shp = tuple(self.shape)
        if words:
            shp = shp[:-1] + (shp[-1] * isz // 4,)
            strides = strides[:-1] + (4,)
            isz = 4
        return array_params(self.ptr, shp, strides, isz)


_TORCH_DTYPE_NAMES = {}


def _torch_dtype_name(dtype):
    name = _TORCH_DTYPE_NAMES.get(dtype)
    if name is None:
        name = _TORCH_DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _describe(obj):
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def wrap(op, name, obj):
    """Describe ``obj`` as an :class:`Arr`, or raise a clear error naming ``name``."""
    torch = _torch or _load_torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        kind = _torch_kinds.get(obj.dtype)
        dev = obj.get_device()
        if SIM:
            raise LoomnbTypeError(
                f"{op}: argument '{name}' must be a NumPy array under the CUDA simulator "
                f"(NUMBA_ENABLE_CUDASIM=1); got a torch tensor on {obj.device}")
        if dev < 0:
            raise LoomnbTypeError(
                f"{op}: argument '{name}' must be a CUDA device array; got a host torch tensor "
                f"(device {obj.device}). Move it with .cuda() first")
        return Arr(obj, "torch", kind, _torch_dtype_name(obj.dtype), obj.shape,
                   obj.stride(), obj.data_ptr(), dev)
    if isinstance(obj, np.ndarray):
        if not SIM:
            raise LoomnbTypeError(
                f"{op}: argument '{name}' must be a CUDA device array (torch CUDA tensor, CuPy or "
                f"numba device array); got a host numpy.ndarray of shape {obj.shape}. Host arrays "
                "are accepted only under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
        kind = _NAME_KINDS.get(obj.dtype.name)  # None: rejected by the op's dtype check
        strides = tuple(s // obj.itemsize for s in obj.strides)
        return Arr(obj, "numpy", kind, obj.dtype.name, obj.shape, strides,
                   obj.__array_interface__["data"][0], 0)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None or SIM:
        where = "a NumPy array (simulator)" if SIM else "a CUDA device array"
        raise LoomnbTypeError(f"{op}: argument '{name}' must be {where}; got {_describe(obj)}")
    dtype = getattr(obj, "dtype", None)
    kind = _NAME_KINDS.get(getattr(dtype, "name", None))
    if kind is None:
        raise LoomnbTypeError(
            f"{op}: argument '{name}' has dtype {dtype!r} (typestr {cai.get('typestr')}); loomnb "
            "reads the dtype from the array object, and supports " + ", ".join(_NAME_KINDS))
    shape = tuple(cai["shape"])
    isz = np.dtype(cai["typestr"]).itemsize if cai.get("typestr") else _ITEMSIZE[kind]
    if cai.get("strides") is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    else:
        strides = tuple(s // isz for s in cai["strides"])
    lib = "cupy" if type(obj).__module__.startswith("cupy") else (
        "numba" if type(obj).__module__.startswith("numba") else "cai")
    ptr = cai["data"][0]
    return Arr(obj, lib, kind, dtype.name, shape, strides, ptr, _device_of(obj, lib, ptr))


def _device_of(obj, lib, ptr):
    if lib == "cupy":
        return obj.device.id
    if ptr == 0:
        from numba import cuda
        return cuda.get_current_device().id
    from cuda.bindings import driver
    err, dev = driver.cuPointerGetAttribute(
        driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise LoomnbValueError(f"loomnb: cannot find the device of pointer {ptr:#x} ({err})")
    return int(dev)


# --------------------------------------------------------------------------------------------
def empty(like, shape, kind):
    """A new uninitialised array of ``kind`` and ``shape``, from ``like``'s library and device."""
    if like.lib == "torch":
        torch = _torch
        tdtype = {v: k for k, v in _torch_kinds.items()}[kind]
        return torch.empty(shape, dtype=tdtype, device=like.obj.device)
    npdtype = _numpy_dtype(kind)
    if like.lib == "numpy":
        return np.empty(shape, dtype=npdtype)
    if like.lib == "cupy":
        import cupy
        with cupy.cuda.Device(like.device):
            # CuPy has no FP8 dtype: FP8 outputs come back as uint8 codes.
            return cupy.empty(shape, dtype=np.uint8 if kind == "fp8" else npdtype)
    from numba import cuda
    with cuda.gpus[like.device]:
        return cuda.device_array(shape, dtype=npdtype)


def _numpy_dtype(kind):
    import ml_dtypes
    return {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32,
            "fp8": ml_dtypes.float8_e4m3fn, "i32": np.int32, "i64": np.int64,
            "u8": np.uint8}[kind]


def stream_handle(arr, stream):
    """The ``CUstream`` (an int) to launch on: ``stream`` if given, else the caller's current."""
    if stream is not None:
        return _explicit_stream(stream)
    if arr.lib == "torch":
        return _torch._C._cuda_getCurrentRawStream(arr.device)
    if arr.lib == "cupy":
        import cupy
        with cupy.cuda.Device(arr.device):
            return cupy.cuda.get_current_stream().ptr
    return CU_STREAM_PER_THREAD


def _explicit_stream(stream):
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    handle = getattr(stream, "handle", None)  # numba Stream
    if handle is not None:
        return int(getattr(handle, "value", handle) or 0)
    raise LoomnbTypeError(f"loomnb: argument 'stream' must be a CUDA stream or an int CUstream; "
                          f"got {_describe(stream)}")


@contextlib.contextmanager
def _noop():
    yield


_NOOP = _noop


def device_guard(arr):
    """Make ``arr``'s device current for the launch (a no-op when it already is)."""
    if arr.lib == "torch":
        if _torch._C._cuda_getDevice() == arr.device:
            return _NOOP()
        return _torch.cuda.device(arr.device)
    if arr.lib == "numpy":
        return _NOOP()
    from numba import cuda
    return cuda.gpus[arr.device]
