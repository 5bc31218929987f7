"""Persistent device workspaces of the scaffold: per-launch scratch that outlives the call, one
set per (library, device, stream), and the split counters every "last block finishes" kernel
shares.

A kernel that splits one row (a logits row, one sequence's attention context) over several
thread blocks lets the last block to finish fold the blocks' partial results: each block writes
its record, fences (``cuda.threadfence``) and takes a ticket with ``atomicInc(counters[i], n -
1)``; the block that draws ``n - 1`` is the last, and ``atomicInc`` wraps the counter back to 0
as it does. So every counter is 0 between launches (CUDA-graph replays included), and one
zeroed buffer a stream serves every family: launches on one stream are ordered, and each leaves
the counters it used at 0. (``tests/conftest.py`` checks that after every test.)

Buffers are made zeroed, ordered before the launch on its stream (:func:`_after_zeroing`), and
never freed: a captured CUDA graph, or a remembered fast-path launch, keeps pointing at the one
it saw. A launch that needs more rows than a buffer holds gets a larger one, rounded up to a
power of two; the smaller one is kept alive in ``_retired``, never reused.

:func:`table` is the other kind: a small int64 table made on the host (a kernel's per-array
descriptors), copied to the device once per distinct content and kept, for the same reason.
"""

from __future__ import annotations

from .. import _adapter as ad
from . import _launch as L

MIN_COUNTERS = 4096  # split counters a stream's buffer holds at least

_buffers = {}  # (name, library, device, stream handle) -> array
_retired = []  # (key, array) replaced by larger ones: kept, as graphs may point at them
_tables = {}   # (library, device, rows) -> device array of the int64 table ``rows``


def buffer(name, like, stream, rows, tail=(), dtype="int32", min_rows=1):
    """The zeroed workspace ``name`` of ``like``'s library, device and ``stream``: an array of
    shape ``(n,) + tail`` and ``dtype`` with ``n >= max(rows, min_rows)`` (a power of two when
    grown past ``min_rows``). Its contents are the caller's: zero only at creation."""
    handle = 0 if like.lib == "numpy" else ad.stream_handle(like, stream)
    key = (name, like.lib, like.device, handle)
    buf = _buffers.get(key)
    if buf is None or buf.shape[0] < rows:
        if buf is not None:
            _retired.append((key, buf))
        n = max(min_rows, 1 << max(rows - 1, 0).bit_length())
        buf = _zeros(like, (n,) + tuple(tail), dtype)
        _after_zeroing(like, handle)
        _buffers[key] = buf
    return buf


def table(op, like, rows):
    """A device copy of the int64 table ``rows`` (a tuple of equal-length tuples) on ``like``'s
    device and library, made the first time these ``rows`` are asked for and kept (launches,
    remembered ones and captured graphs, point at it). The copy is a synchronous host-to-device
    copy, which a CUDA graph being captured cannot hold: a first use while capturing raises
    :class:`~loomnb.LoomnbValueError` (make the call once before capturing)."""
    import numpy as np
    key = (like.lib, like.device, rows)
    t = _tables.get(key)
    if t is not None:
        return t
    host = np.array(rows, dtype=np.int64).reshape(len(rows), -1)
    if like.lib == "torch":
        torch = ad._torch
        if torch.cuda.is_current_stream_capturing():
            from ..checks import LoomnbValueError
            raise LoomnbValueError(
                f"{op}: these arrays have no device descriptor table yet, and one cannot be "
                "copied to the device while a CUDA graph is being captured; make the same call "
                "once before capturing")
        with ad.device_guard(like):
            t = torch.from_numpy(host).to(like.obj.device)
            torch.cuda.current_stream(like.obj.device).synchronize()
    elif like.lib == "numpy":
        t = host
    else:
        from numba import cuda
        with cuda.gpus[like.device]:
            t = cuda.to_device(host)
    _tables[key] = t
    return t


def upload(name, like, stream, host):
    """``host`` (an int64 NumPy array) copied into the workspace ``name`` of ``like``'s device and
    launch ``stream``, as a copy queued on that stream: ordered after the stream's earlier
    launches (which may still read the buffer) and before the launch that follows, with no host
    synchronisation (the driver stages a pageable source before the call returns). The device
    copy of a per-call host table (block numbers a launch reads). Returns the ``[n, ...]``
    view of the buffer; under the simulator, ``host`` itself."""
    import numpy as np
    host = np.ascontiguousarray(host, dtype=np.int64)
    if like.lib == "numpy":
        return host
    n = host.shape[0]
    buf = buffer(name, like, stream, max(n, 1), host.shape[1:], "int64", 64)
    if like.lib == "torch":
        torch = ad._torch
        handle = ad.stream_handle(like, stream)
        src = torch.from_numpy(host)
        with ad.device_guard(like):
            if handle == torch._C._cuda_getCurrentRawStream(like.device):
                buf[:n].copy_(src, non_blocking=True)
            else:
                with torch.cuda.stream(torch.cuda.ExternalStream(handle, device=like.obj.device)):
                    buf[:n].copy_(src, non_blocking=True)
    else:
        from numba import cuda
        with cuda.gpus[like.device]:
            cuda.synchronize()
            buf[:n].copy_to_device(host)
    return buf[:n]


def counters(like, stream, n):
    """The split counters of ``like``'s device and ``stream`` (at least ``n``, all 0 between
    launches; int32 storage, a kernel reads them as uint32: :func:`param`)."""
    return buffer("split_counters", like, stream, n, (), "int32", MIN_COUNTERS)


def all_counters():
    """``[(key, array)]`` of every split-counter buffer, retired ones included (the tests'
    check that each is 0 between launches)."""
    live = [(k, b) for k, b in _buffers.items() if k[0] == "split_counters"]
    return live + [(k, b) for k, b in _retired if k[0] == "split_counters"]


def param(obj, storage, like):
    """A kernel parameter over workspace buffer ``obj`` (on ``like``'s device) seen as
    ``storage`` elements."""
    import numpy as np
    if isinstance(obj, np.ndarray):
        strides = tuple(s // obj.itemsize for s in obj.strides)
        ptr = obj.__array_interface__["data"][0]
    elif ad._torch is not None and isinstance(obj, ad._torch.Tensor):
        strides, ptr = obj.stride(), obj.data_ptr()
    else:  # a numba device array (C-contiguous)
        ptr = obj.__cuda_array_interface__["data"][0]
        strides = tuple(s // obj.dtype.itemsize for s in obj.strides)
    arr = ad.Arr(obj, like.lib, None, str(obj.dtype), obj.shape, strides, ptr, like.device)
    return L.ArrayParam(arr, ptr, obj.shape, strides, storage)


def _zeros(like, shape, dtype):
    """A zeroed buffer on ``like``'s device, in its library (a torch allocation made while a
    CUDA graph is being captured is captured with its zeroing, which re-zeroes on replay:
    harmless, as every counter is 0 between launches)."""
    import numpy as np
    if like.lib == "torch":
        with ad.device_guard(like):
            return ad._torch.zeros(shape, dtype=getattr(ad._torch, dtype), device=like.obj.device)
    if like.lib == "numpy":
        return np.zeros(shape, dtype)
    from numba import cuda
    with cuda.gpus[like.device]:
        return cuda.to_device(np.zeros(shape, dtype))


def _after_zeroing(like, handle):
    """The zero fills ran on torch's current stream: when the launch goes to another stream,
    wait for them (once per buffer; not while a graph is being captured, where the capture
    orders them)."""
    if like.lib != "torch":
        return  # numpy; numba's to_device copies synchronously
    t = ad._torch
    if t.cuda.is_current_stream_capturing():
        return
    cur = t.cuda.current_stream(like.obj.device)
    if cur.cuda_stream != handle:
        cur.synchronize()
