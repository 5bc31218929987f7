"""Every use of numba-cuda internals in loomnb lives in this module.

numba-cuda is in maintenance mode, so anything here may break on an upgrade; the public kernels
only see the small functions below, and ``tests/test_numba_internals.py`` fails loudly when the
assumptions change. What we rely on:

1. **Inline PTX through ``numba.cuda.extending.intrinsic``** (llvmlite ``InlineAsm``): Hopper's
   packed conversions ``cvt.rn.bf16x2.f32``, ``cvt.rn.f16x2.f32``,
   ``cvt.rn.satfinite.e4m3x2.f32``, ``cvt.rn.f16x2.e4m3x2`` and ``cvt.f32.f16``, and 16-byte vector loads/stores
   (``ld.global.v4.u32``, ``v2``) on 1-D ``uint32`` row views. Each has a portable twin in
   :mod:`loomnb.layouts.dtypes`, and a GPU test proves them bit-identical. Also the warp
   reduction ``redux.sync.max.u32`` (its simulator twin is in :mod:`loomnb.ops._reduce`).
2. **The kernel parameter ABI** (``_Kernel._prepare_args``): a kernel argument of type
   ``Array(dtype, ndim)`` becomes ``5 + 2*ndim`` parameters (meminfo, parent, nitems, itemsize,
   data, shape..., strides-in-bytes...), each 8 bytes; ``float32`` is 4 bytes, ``int64`` 8.
   :class:`FastKernel` packs that block itself and calls ``cuLaunchKernel`` (through
   ``cuda.bindings``) directly, which takes the per-call host cost from numba's 24-88 us to the
   driver's own cost plus a dictionary lookup.
3. **The simulator's device-array wrapper** (``FakeCUDAArray``): wrapping NumPy arrays in it
   makes the simulator run on the caller's memory instead of copying each argument in and out
   (its copy-back would let an unmodified alias overwrite an in-place result).
4. **Where device functions take their target**: ``cuda.compile_ptx`` compiles a kernel for a
   given ``cc``, but the ``@cuda.jit(device=True)`` functions it calls ask
   ``numba.cuda.dispatcher.get_current_device()`` -- which needs a GPU. :func:`compile_ptx`
   answers that question with the requested ``cc`` so CI can compile every kernel on a CPU.
5. **The compiled function handle**: ``dispatcher.overloads[argtypes]._codelibrary.get_cufunc()``
   (loads the module into the current context) and its ``.handle``.
6. **The simulator's shared-memory allocator** (``FakeCUDAShared.array``): it keys a block's
   shared arrays by the calling source line and creates one on first use with an unlocked
   check-then-insert, so two threads that reach a line together can each create their own
   array and no longer see each other's writes (a race CPython's thread switching hides only
   at coarse switch intervals). :func:`_lock_sim_shared_arrays` wraps it in a lock; the
   simulator's results are otherwise unchanged.
"""

from __future__ import annotations

import ctypes
import functools
import struct

from numba import types
from numba.cuda import config as _config

SIM = bool(_config.ENABLE_CUDASIM)


def _lock_sim_shared_arrays():
    """Simulator only: ``FakeCUDAShared.array`` with its first allocation at a line made atomic
    (item 6 of the module docstring), the same keys (the caller's file and line, read from its
    frame rather than a formatted stack). Idempotent."""
    import sys
    import threading

    import numpy as np
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    cls = kernelapi.FakeCUDAShared
    if getattr(cls.array, "_loomnb_locked", False):
        return
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None:
            raise RuntimeError("Array alignment is not supported in cudasim")
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        if shape == 0:  # dynamic shared memory: one buffer
            count = self._dynshared_size // dtype.itemsize
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
        f = sys._getframe(1)
        caller = (f.f_code.co_filename, f.f_lineno)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    array._loomnb_locked = True
    cls.array = array


if SIM:
    _lock_sim_shared_arrays()

if not SIM:
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _i16, _i32, _f32 = ir.IntType(16), ir.IntType(32), ir.FloatType()

    def _asm(builder, ret, argtys, text, constraints, args):
        fn = ir.InlineAsm(ir.FunctionType(ret, argtys), text, constraints)
        return builder.call(fn, args)

    def _cvt_x2(ptx_type):
        """Round two float32 to ``ptx_type`` (RNE) and pack them, ``hi`` in the upper half:
        ``bf16x2`` and ``f16x2`` fill a uint32 (bits 31..16 and 15..0); the FP8 pairs
        ``satfinite.e4m3x2`` and ``satfinite.e5m2x2`` (saturating to +-448 and +-57344, NaN ->
        0x7F) its low 16 bits (15..8 and 7..0), from a 16-bit register."""
        fp8 = ptx_type.startswith("satfinite.")

        @intrinsic
        def cvt(typingctx, hi, lo):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, sig, args):
                text = f"cvt.rn.{ptx_type}.f32 $0, $1, $2;"
                if not fp8:
                    return _asm(builder, _i32, [_f32, _f32], text, "=r,f,f", args)
                return builder.zext(_asm(builder, _i16, [_f32, _f32], text, "=h,f,f", args), _i32)

            return sig, codegen

        return cvt

    cvt_bf16x2 = _cvt_x2("bf16x2")
    cvt_f16x2 = _cvt_x2("f16x2")
    cvt_e4m3x2 = _cvt_x2("satfinite.e4m3x2")
    cvt_e5m2x2 = _cvt_x2("satfinite.e5m2x2")

    @intrinsic
    def cvt_f16x2_e4m3x2(typingctx, bits):
        """Two FP8 E4M3 codes (the low 16 bits of a uint32) -> two fp16 packed in a uint32
        (``cvt.rn.f16x2.e4m3x2``, sm_89+; exact: E4M3 is a subset of fp16): the code in bits
        15..8 becomes bits 31..16, the code in bits 7..0 bits 15..0."""
        sig = types.uint32(types.uint32)

        def codegen(context, builder, sig, args):
            h = builder.trunc(args[0], _i16)
            return _asm(builder, _i32, [_i16], "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [h])

        return sig, codegen

    @intrinsic
    def cvt_f16_to_f32(typingctx, bits):
        """fp16 bit pattern (low 16 bits of a uint32) -> float32, exact."""
        sig = types.float32(types.uint32)

        def codegen(context, builder, sig, args):
            h = builder.trunc(args[0], _i16)
            return _asm(builder, _f32, [_i16], "cvt.f32.f16 $0, $1;", "=f,h", [h])

        return sig, codegen

    def _vec_ptr(context, builder, aryty, ary, idx, n):
        arr = context.make_array(aryty)(context, builder, ary)
        ptr = cgutils.get_item_pointer2(
            context, builder, data=arr.data, shape=cgutils.unpack_tuple(builder, arr.shape),
            strides=cgutils.unpack_tuple(builder, arr.strides), layout=aryty.layout, inds=[idx],
        )
        return builder.bitcast(ptr, ir.PointerType(ir.VectorType(_i32, n)))

    def _make_load(n):
        """``load(a, i)``: words ``a[i : i + n]`` of a 1-D uint32 array in one ``ld.v{n}.u32``
        (the address must be ``4 * n``-byte aligned)."""
        @intrinsic
        def load(typingctx, ary, idx):
            sig = types.UniTuple(types.uint32, n)(ary, types.intp)

            def codegen(context, builder, sig, args):
                ary_v, idx_v = args
                ptr = _vec_ptr(context, builder, sig.args[0], ary_v, idx_v, n)
                vec = builder.load(ptr, align=4 * n)
                items = [builder.extract_element(vec, ir.Constant(_i32, k)) for k in range(n)]
                return context.make_tuple(builder, sig.return_type, items)

            return sig, codegen

        return load

    def _make_store(n):
        """``store(a, i, vals)``: the ``n`` words of ``vals`` to ``a[i : i + n]`` in one
        ``st.v{n}.u32``."""
        @intrinsic
        def store(typingctx, ary, idx, vals):
            sig = types.void(ary, types.intp, types.UniTuple(types.uint32, n))

            def codegen(context, builder, sig, args):
                ary_v, idx_v, vals_v = args
                ptr = _vec_ptr(context, builder, sig.args[0], ary_v, idx_v, n)
                vec = ir.Constant(ir.VectorType(_i32, n), None)
                for k in range(n):
                    vec = builder.insert_element(vec, builder.extract_value(vals_v, k), ir.Constant(_i32, k))
                builder.store(vec, ptr, align=4 * n)

            return sig, codegen

        return store

    @intrinsic
    def redux_max_u32(typingctx, v):
        """The largest of ``v`` over the full warp, in every lane (``redux.sync.max.u32``,
        sm_80+: one instruction for a 5-step shuffle butterfly). Every lane must call it."""
        sig = types.uint32(types.uint32)

        def codegen(context, builder, sig, args):
            fn = ir.InlineAsm(ir.FunctionType(_i32, [_i32]),
                              "redux.sync.max.u32 $0, $1, 0xffffffff;", "=r,r", side_effect=True)
            return builder.call(fn, args)

        return sig, codegen

    load_u32x4 = _make_load(4)
    load_u32x2 = _make_load(2)
    store_u32x4 = _make_store(4)
    store_u32x2 = _make_store(2)


def compile_ptx(pyfunc, argtypes, cc=(9, 0)):
    """PTX of kernel ``pyfunc`` for ``argtypes`` and compute capability ``cc``, with no GPU."""
    import unittest.mock

    from numba import cuda
    from numba.cuda import dispatcher

    class _Device:
        compute_capability = cc

    with unittest.mock.patch.object(dispatcher, "get_current_device", lambda: _Device):
        ptx, _ = cuda.compile_ptx(pyfunc, argtypes, cc=cc)
    return ptx


def device(fn):
    """``@cuda.jit(device=True)`` on the GPU; under the simulator, the plain Python function.

    For device functions that use no thread API (indices, shared memory, barriers): the
    simulator wraps every call of a device function in a module swap guarded by two global
    locks, and with one Python thread per CUDA thread those locks convoy with the GIL -- a
    kernel that makes thousands of per-element calls could stall for minutes. Plain calls
    compute the same thing without the locks.
    """
    if SIM:
        return fn
    from numba import cuda
    return cuda.jit(device=True)(fn)


def sim_device_array(ary):
    """Simulator only: present a NumPy array to a kernel without a copy-in/copy-out."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    return FakeCUDAArray(ary)


# --------------------------------------------------------------------------------------------
# Direct launch of a compiled kernel
# --------------------------------------------------------------------------------------------

_SCALAR_SLOTS = {types.float32: "f4x", types.float64: "d", types.int32: "i4x",
                 types.uint32: "I4x", types.int64: "q", types.uint64: "Q", types.boolean: "?7x"}


def _dim3(v):
    return (v, 1, 1) if isinstance(v, int) else tuple(v) + (1,) * (3 - len(v))


def param_slots(argtypes):
    """Struct-pack format of the kernel parameters numba generates for ``argtypes``.

    Every parameter gets an 8-byte slot (``cuLaunchKernel`` takes a pointer per parameter);
    float32 fills 4 bytes of its slot. Returns ``(format, n_params)``.
    """
    fmt, n = "", 0
    for ty in argtypes:
        if isinstance(ty, types.Array):
            k = 5 + 2 * ty.ndim
            fmt += "q" * k
            n += k
        elif ty in _SCALAR_SLOTS:
            fmt += _SCALAR_SLOTS[ty]
            n += 1
        else:  # pragma: no cover - a kernel author error, caught by the internals test
            raise TypeError(f"loomnb FastKernel: unsupported kernel parameter type {ty}")
    return "<" + fmt, n


def array_params(ptr, shape, strides_bytes, itemsize):
    """The ``5 + 2*ndim`` values numba passes for one array argument (see module docstring)."""
    nitems = 1
    for s in shape:
        nitems *= s
    return (0, 0, nitems, itemsize, ptr, *shape, *strides_bytes)


class FastKernel:
    """One compiled specialisation of a ``@cuda.jit`` kernel, launched with ``cuLaunchKernel``.

    ``dispatcher`` is a lazily compiling ``cuda.jit`` dispatcher and ``argtypes`` the numba types
    of its arguments. Compilation happens once per device, on first use; :meth:`prepare` packs
    the flattened parameters once into a :class:`PreparedLaunch`, whose launch is one driver
    call (through ``cuda.bindings``, the CUDA driver bindings numba-cuda itself depends on) on
    the stream given at that call.
    """

    def __init__(self, dispatcher, argtypes, name):
        self.dispatcher = dispatcher
        self.argtypes = tuple(argtypes)
        self.name = name
        self._fmt, self._nparams = param_slots(self.argtypes)
        self._ptr_fmt = f"<{self._nparams}Q"  # the parameter-pointer array, packed in one go
        self._ptr_array = ctypes.c_void_p * self._nparams
        self._handles = {}
        self._driver_calls = {}  # (device, grid, block) -> cuLaunchKernel with all but 3 args bound

    def compile(self, device_index):
        """Compile (once) for ``device_index`` and return the CUfunction handle as an int."""
        h = self._handles.get(device_index)
        if h is None:
            from numba import cuda

            with cuda.gpus[device_index]:
                self.dispatcher.compile(self.argtypes)
                kernel = self.dispatcher.overloads[self.argtypes]
                kernel.bind()
                cufunc = kernel._codelibrary.get_cufunc()
                h = int(cufunc.handle)
            self._handles[device_index] = h
        return h

    def prepare(self, device_index, grid, block, params, shared_bytes=0):
        """A :class:`PreparedLaunch`: the parameters packed once, replayable on any stream.
        ``grid`` and ``block`` are ints or tuples of up to three; ``shared_bytes`` is the
        dynamic shared memory."""
        call = self._driver_calls.get((device_index, grid, block, shared_bytes))
        if call is None:
            from cuda.bindings import driver

            func = driver.CUfunction(self._handles.get(device_index) or self.compile(device_index))
            call = functools.partial(driver.cuLaunchKernel, func, *_dim3(grid), *_dim3(block),
                                     shared_bytes)
            self._driver_calls[(device_index, grid, block, shared_bytes)] = call
        return PreparedLaunch(self, call, device_index, params)


class PreparedLaunch:
    """One kernel launch with fixed arguments, packed once; ``launch(stream)`` only calls the
    driver. The stream is a per-call argument (never stored), so graph capture sees each launch.
    The packed block is read-only after construction (except through :meth:`set_slot`), so
    concurrent launches need no lock.

    ``driver_call(stream, params, 0)`` is the bare driver call (``cuLaunchKernel`` with every
    argument but the stream bound) returning ``(CUresult,)``; ``params`` is the address of the
    parameter-pointer array. Hot paths call it directly and hand a non-success result to
    :meth:`failed`.
    """

    __slots__ = ("kernel", "device", "driver_call", "params", "_buf", "_ptrs")

    def __init__(self, kernel, driver_call, device, params):
        self.kernel, self.device, self.driver_call = kernel, device, driver_call
        n = kernel._nparams
        self._buf = ctypes.create_string_buffer(8 * n)
        struct.pack_into(kernel._fmt, self._buf, 0, *params)
        base = ctypes.addressof(self._buf)  # parameter i lives at base + 8*i
        self._ptrs = kernel._ptr_array.from_buffer_copy(
            struct.pack(kernel._ptr_fmt, *range(base, base + 8 * n, 8)))
        self.params = ctypes.addressof(self._ptrs)

    def set_slot(self, slot, value):
        """Overwrite the 8-byte parameter ``slot`` with the integer ``value`` (a data pointer:
        the eager fast path points a replayed launch at a newly allocated output). Not
        thread-safe on its own: the caller holds a lock from here to the launch."""
        struct.pack_into("<q", self._buf, 8 * slot, value)

    def launch(self, stream_handle):
        err, = self.driver_call(stream_handle, self.params, 0)
        if err is not CUDA_SUCCESS:
            self.failed(err, stream_handle)

    def failed(self, err, stream_handle):
        """A launch returned ``err``: retry once if the thread had no current CUDA context
        (a thread that never touched CUDA), else raise."""
        from cuda.bindings import driver

        if err == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            _, ctx = driver.cuDevicePrimaryCtxRetain(self.device)
            driver.cuCtxSetCurrent(ctx)
            driver.cuDevicePrimaryCtxRelease(self.device)  # the runtime keeps its own reference
            err, = self.driver_call(stream_handle, self.params, 0)
            if err is CUDA_SUCCESS:
                return
        raise RuntimeError(f"loomnb: cuLaunchKernel({self.kernel.name}) on device {self.device} "
                           f"failed with {err!r}")


def _success():
    from cuda.bindings import driver
    return driver.CUresult.CUDA_SUCCESS


CUDA_SUCCESS = None if SIM else _success()
