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

import numpy as np

from . import _dtypes
from ._numba_internals import SIM
from .checks import LoomnbTypeError, LoomnbValueError

CU_STREAM_LEGACY, CU_STREAM_PER_THREAD = 1, 2
CAI_MAX_VERSION = 3  # the newest __cuda_array_interface__ version this adapter knows

try:  # torch is optional: loomnb also runs on CuPy and numba arrays, and NumPy (simulator)
    import torch as _torch
    _torch_kinds = {_dtypes.torch_dtype(k): k for k in _dtypes.DTYPES}
    is_compiling = _torch.compiler.is_compiling
except ImportError:  # pragma: no cover - CI always has torch
    _torch, _torch_kinds = None, {}

    def is_compiling():
        return False


class Arr:
    """What a kernel needs to know about one caller array: no data is touched or copied.

    ``shape`` and ``strides`` are in elements; ``readonly`` is set for read-only NumPy arrays
    and ``__cuda_array_interface__`` exports that say so; ``sync_stream`` is the producer
    stream a ``__cuda_array_interface__`` v3 export asks its consumer to synchronise with.
    """

    __slots__ = ("obj", "lib", "kind", "dtype_name", "shape", "strides", "ptr", "device",
                 "readonly", "sync_stream", "alloc", "_extent")

    def __init__(self, obj, lib, kind, dtype_name, shape, strides, ptr, device, readonly=False,
                 sync_stream=None, alloc=None):
        self.obj, self.lib, self.kind, self.dtype_name = obj, lib, kind, dtype_name
        self.shape, self.strides, self.ptr, self.device = tuple(shape), tuple(strides), ptr, device
        self.readonly, self.sync_stream = readonly, sync_stream
        self.alloc = alloc  # set when loomnb allocated it: how to allocate it again (fast path)
        self._extent = None

    def view(self, shape, strides, ptr=None):
        """The same memory described with another shape and strides (in elements)."""
        return Arr(self.obj, self.lib, self.kind, self.dtype_name, shape, strides,
                   self.ptr if ptr is None else ptr, self.device, self.readonly, self.sync_stream,
                   self.alloc)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def itemsize(self):
        return _dtypes.itemsize(self.kind)

    @property
    def size(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

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


def _describe(obj):
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def wrap(op, name, obj):
    """Describe ``obj`` as an :class:`Arr`, or raise a clear error naming ``name``."""
    torch = _torch
    if torch is not None and isinstance(obj, torch.Tensor):
        dev = obj.get_device()
        if SIM:
            raise LoomnbTypeError(
                f"{op}: argument '{name}' must be a NumPy array under the CUDA simulator "
                f"(NUMBA_ENABLE_CUDASIM=1); got a torch tensor on {obj.device}")
        if dev < 0:
            raise LoomnbTypeError(
                f"{op}: argument '{name}' must be a CUDA device array; got a host torch tensor "
                f"(device {obj.device}). Move it with .cuda() first")
        kind = _torch_kinds.get(obj.dtype)
        return Arr(obj, "torch", kind, str(obj.dtype).replace("torch.", ""), obj.shape,
                   obj.stride(), obj.data_ptr(), dev)
    if isinstance(obj, np.ndarray):
        if not SIM:
            raise LoomnbTypeError(
                f"{op}: argument '{name}' must be a CUDA device array (torch CUDA tensor, CuPy or "
                f"numba device array); got a host numpy.ndarray of shape {obj.shape}. Host arrays "
                "are accepted only under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
        kind = _dtypes.KIND_OF_NAME.get(obj.dtype.name)  # None: rejected by the op's dtype check
        if any(s % obj.itemsize for s in obj.strides):
            raise LoomnbValueError(f"{op}: argument '{name}' must have strides that are whole "
                                   f"elements; got byte strides {obj.strides}")
        strides = tuple(s // obj.itemsize for s in obj.strides)
        return Arr(obj, "numpy", kind, obj.dtype.name, obj.shape, strides,
                   obj.__array_interface__["data"][0], 0, readonly=not obj.flags.writeable)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None or SIM:
        where = "a NumPy array (simulator)" if SIM else "a CUDA device array"
        raise LoomnbTypeError(f"{op}: argument '{name}' must be {where}; got {_describe(obj)}")
    return _wrap_cai(op, name, obj, cai)


def wrap_host(op, name, obj):
    """:func:`wrap`, also taking page-locked (pinned) host memory: a CPU torch tensor made with
    ``pin_memory=True`` (``.pin_memory()``), described by the pointer a kernel reads it
    through (``cuMemHostGetDevicePointer``: the host pointer itself under unified addressing);
    ``device`` is ``-1``. Under the simulator, every NumPy array is "host memory". A pageable
    host tensor is a :class:`LoomnbValueError` (kernels cannot reach it)."""
    torch = _torch
    if SIM or torch is None or not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
        return wrap(op, name, obj)
    if not obj.is_pinned():
        raise LoomnbValueError(
            f"{op}: argument '{name}' must be a CUDA tensor or pinned (page-locked) host memory; "
            f"got a pageable CPU tensor of shape {list(obj.shape)}. Allocate it with "
            "pin_memory=True, or call .pin_memory()")
    ptr = obj.data_ptr()
    if obj.numel():
        from cuda.bindings import driver
        err, dptr = driver.cuMemHostGetDevicePointer(ptr, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise LoomnbValueError(f"{op}: argument '{name}': its pinned memory is not mapped "
                                   f"into the device's address space ({err!r})")
        ptr = int(dptr)
    kind = _torch_kinds.get(obj.dtype)
    return Arr(obj, "torch", kind, str(obj.dtype).replace("torch.", ""), obj.shape,
               obj.stride(), ptr, -1)


def _wrap_cai(op, name, obj, cai):
    """An object exporting ``__cuda_array_interface__`` (versions 0-3), read whole: the dtype
    from the object (never the typestr, which torch has exported as ``<f2``/``<V2`` for bf16),
    ``data`` = (pointer, read-only flag), ``strides`` in bytes or None (C-contiguous), zero-size
    arrays (pointer 0), no ``mask`` (rejected: loomnb's kernels read every element), and v3's
    ``stream`` (the producer's stream, synchronised before the launch when it differs)."""
    def bad(expected, got):
        raise LoomnbValueError(f"{op}: argument '{name}' must be {expected}; got {got}")

    version = cai.get("version", 0)
    if not isinstance(version, int) or not 0 <= version <= CAI_MAX_VERSION:
        bad(f"a __cuda_array_interface__ of version 0..{CAI_MAX_VERSION}", f"version {version!r}")
    if cai.get("mask") is not None:
        bad("an array without a __cuda_array_interface__ mask (loomnb reads every element)",
            "an export with a mask")
    dtype = getattr(obj, "dtype", None)
    kind = _dtypes.KIND_OF_NAME.get(getattr(dtype, "name", None))
    if kind is None:
        raise LoomnbTypeError(
            f"{op}: argument '{name}' has dtype {dtype!r} (typestr {cai.get('typestr')}); loomnb "
            "reads the dtype from the array object, and supports "
            + ", ".join(d.name for d in _dtypes.DTYPES.values()))
    isz = _dtypes.itemsize(kind)
    typestr = cai.get("typestr")
    try:
        typestr_size = np.dtype(typestr).itemsize if typestr else isz
    except TypeError:
        typestr_size = isz  # a typestr NumPy cannot parse says nothing about the size
    if typestr_size != isz:
        bad(f"an export whose typestr has the itemsize of {dtype.name} ({isz})", f"typestr {typestr}")
    shape = tuple(int(n) for n in cai["shape"])
    if cai.get("strides") is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    else:
        if any(s % isz for s in cai["strides"]):
            bad("strides that are whole elements", f"byte strides {tuple(cai['strides'])}")
        strides = tuple(s // isz for s in cai["strides"])
    ptr, readonly = cai["data"]
    size = 1
    for n in shape:
        size *= n
    if ptr is None or ptr == 0:  # the spec allows a null pointer for an empty array only
        if size:
            bad("a non-null data pointer for a non-empty array", f"data = {cai['data']!r} for "
                f"shape {list(shape)}")
        ptr = 0
    elif not isinstance(ptr, int):
        bad("an integer data pointer", f"data = {cai['data']!r}")
    lib = "cupy" if type(obj).__module__.startswith("cupy") else (
        "numba" if type(obj).__module__.startswith("numba") else "cai")
    stream = cai.get("stream") if version >= 3 else None
    if stream == 0:
        bad("an export whose stream is not 0 (the spec disallows 0)", "stream 0")
    return Arr(obj, lib, kind, dtype.name, shape, strides, ptr, _device_of(obj, lib, ptr),
               readonly=bool(readonly), sync_stream=stream)


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


def sync_producers(arrs, stream):
    """``__cuda_array_interface__`` v3: before launching on ``stream``, wait (on the host) for
    each export's producer stream that differs from it, as the protocol asks of a consumer."""
    from cuda.bindings import driver
    legacy = (0, CU_STREAM_LEGACY)
    for a in arrs:
        s = a.sync_stream
        if s is None or s == stream or (s in legacy and stream in legacy):
            continue
        err, = driver.cuStreamSynchronize(s)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"loomnb: synchronising the producer stream {s:#x} failed: {err!r}")


# --------------------------------------------------------------------------------------------
def empty(like, shape, kind):
    """A new uninitialised array of ``kind`` and ``shape``, from ``like``'s library and device."""
    if like.lib == "torch":
        return _torch.empty(shape, dtype=_dtypes.torch_dtype(kind), device=like.obj.device)
    npdtype = _dtypes.numpy_dtype(kind)
    if like.lib == "numpy":
        return np.empty(shape, dtype=npdtype)
    if like.lib == "cupy":
        import cupy
        with cupy.cuda.Device(like.device):
            # CuPy has no FP8 dtype: FP8 outputs come back as uint8 codes.
            return cupy.empty(shape, dtype=np.uint8 if kind.startswith("fp8") else npdtype)
    from numba import cuda
    with cuda.gpus[like.device]:
        return cuda.device_array(shape, dtype=npdtype)


def torch_allocator(like, shape, kind):
    """``() -> new torch tensor`` of ``shape``/``kind`` on ``like``'s device (what the eager
    fast path calls to allocate an output on a replayed call); None for other libraries."""
    if like.lib != "torch":
        return None
    import functools
    return functools.partial(_torch.empty, shape, dtype=_dtypes.torch_dtype(kind),
                             device=like.obj.device)


def torch_runtime():
    """(current device, current raw stream of a device, more than one GPU) from torch."""
    torch = _torch
    return (torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream,
            torch.cuda.device_count() > 1)


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


def device_guard(arr):
    """Make ``arr``'s device current for the launch (a no-op when it already is)."""
    if arr.lib == "torch":
        if _torch._C._cuda_getDevice() == arr.device:
            return _noop()
        return _torch.cuda.device(arr.device)
    if arr.lib == "numpy":
        return _noop()
    from numba import cuda
    return cuda.gpus[arr.device]
