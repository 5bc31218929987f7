"""The launch scaffold every family uses: parameters, the kernel registry, the launch itself,
and the eager fast path that replays a remembered launch.

* **Parameters.** An op describes its kernel's arguments once, as a list of :func:`array`,
  :func:`absent`, :func:`f32`, :func:`i64` (...) values. That one list gives the numba
  signature the kernel is compiled for, the packed parameter block a GPU launch passes to
  ``cuLaunchKernel``, and the NumPy views the CUDA simulator runs on -- no family packs
  parameters itself.
* **Registry.** :func:`kernel` compiles ``factory(spec)`` once per ``(factory, spec, argtypes)``:
  a family's kernel factory takes a small frozen spec (dtype, variant, widths...) and returns
  the ``@cuda.jit`` Python function. Array types are ``Array(storage, ndim, "A")``, so a new
  num_tokens (or any new size) never recompiles. :func:`launched` lists what ran, which the
  PTX test checks against each family's declared variants.
* **Launch.** :func:`launch` runs on the caller's stream (see ``loomnb._adapter``), on the
  array's device, with the parameters packed once into a ``PreparedLaunch``.
* **Siblings compile together.** A family whose launch rule picks a variant from the call's
  size (units a thread, a block's row view, heads a CTA, a split-K merge) passes ``warm=``, the
  variants another size of the same call could pick: the first launch of a variant on a device
  compiles them all, so a serving loop whose batch or context grows never stops for a JIT
  compile mid-run (``tests/test_recompile_gpu.py`` checks every op).
* **Eager fast path.** With a ``key`` (see :func:`key`), the launch is remembered; a later call
  whose key is equal -- same data pointers, shapes, strides, dtypes and scalars, so the same
  checks would pass and the same parameters be packed -- replays it with :func:`replay`: one
  dict lookup, the current-stream lookup and one ``cuLaunchKernel``. An output the call
  allocated is allocated again on replay and its pointer patched into the parameters. The
  stream is looked up at every call, so CUDA-graph capture records replayed launches too.
  ``launch_cache_info()`` counts the misses. An op that launches several kernels (a split-K
  pass and its merge) passes ``part=(i, n)`` to each of its ``n`` launches under one key: the
  replay runs all of them in order, every buffer the call allocated (outputs and workspaces)
  allocated once and patched into every launch that uses it.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
from numba import cuda, types
from numba.np import numpy_support

from .. import _adapter as ad
from .. import _dtypes
from .._numba_internals import CUDA_SUCCESS, SIM, FastKernel, array_params, sim_device_array


# ---------------------------------------------------------------- parameters
class ArrayParam:
    """One array argument of a kernel: ``arr``'s memory seen with ``shape``/``strides`` (in
    ``storage`` elements) as an ``Array(storage, ndim, "A")``."""

    __slots__ = ("arr", "ptr", "shape", "strides", "storage", "numba_type")

    def __init__(self, arr, ptr, shape, strides, storage):
        self.arr, self.ptr, self.shape, self.strides = arr, ptr, tuple(shape), tuple(strides)
        self.storage = np.dtype(storage)
        self.numba_type = array_type(self.storage, len(self.shape))

    @property
    def nparams(self):
        return 5 + 2 * len(self.shape)

    def gpu_values(self):
        isz = self.storage.itemsize
        return array_params(self.ptr, self.shape, tuple(s * isz for s in self.strides), isz)

    def sim_value(self):
        """Simulator: a NumPy view of the same memory (no copy), for the simulated kernel."""
        if self.arr is None or 0 in self.shape:
            return sim_device_array(np.zeros(self.shape, self.storage))
        isz = self.storage.itemsize

        class _View:  # the array interface of the view: NumPy reads it without copying
            __array_interface__ = {"shape": self.shape, "typestr": self.storage.str, "version": 3,
                                   "data": (self.ptr, False),
                                   "strides": tuple(s * isz for s in self.strides)}

        return sim_device_array(np.asarray(_View()))


class ScalarParam:
    __slots__ = ("value", "numba_type")
    nparams = 1

    def __init__(self, value, numba_type):
        self.value, self.numba_type = value, numba_type

    def gpu_values(self):
        return (self.value,)

    def sim_value(self):
        return np.dtype(str(self.numba_type)).type(self.value)


def array_type(storage, ndim):
    """The numba type of an array parameter: ``Array(storage, ndim, "A")``."""
    return types.Array(numpy_support.from_dtype(np.dtype(storage)), ndim, "A")


def array(a, shape=None, strides=None, *, words=False):
    """Parameter for :class:`~loomnb._adapter.Arr` ``a`` viewed with ``shape``/``strides``
    (elements; default ``a``'s own) in its storage dtype, or with the last dimension as uint32
    ``words`` (16-byte vector kernels; the caller has checked the alignment)."""
    shape = a.shape if shape is None else tuple(shape)
    strides = a.strides if strides is None else tuple(strides)
    storage = _dtypes.storage_dtype(a.kind)
    if words:
        isz = a.itemsize
        shape = shape[:-1] + (shape[-1] * isz // 4,)
        strides = tuple(s * isz // 4 for s in strides[:-1]) + (1,)
        storage = np.dtype(np.uint32)
    return ArrayParam(a, a.ptr, shape, strides, storage)


def absent(storage, ndim):
    """An empty array parameter where a variant has no such array (never read)."""
    return ArrayParam(None, 0, (0,) * ndim, (0,) * ndim, storage)


def f32(v):
    return ScalarParam(float(v), types.float32)


def i64(v):
    return ScalarParam(int(v), types.int64)


def argtypes(params):
    return tuple(p.numba_type for p in params)


# ---------------------------------------------------------------- block sizes and the device
def whole_warps(n):
    """``n`` threads rounded up to whole warps, at least one warp: ``max(32, ceil(n / 32) *
    32)`` (every block size is a multiple of 32)."""
    return max(32, -(-n // 32) * 32)


_sms = {}  # (library, device) -> streaming multiprocessors


def sm_count(like, *, simulator, others=None):
    """The streaming multiprocessors of ``like``'s device (an :class:`~loomnb._adapter.Arr`),
    looked up once per device: torch's device properties for a torch tensor; for another device
    array (CuPy, numba) ``others``, or numba's device attribute when ``others`` is None; and
    ``simulator`` for NumPy arrays (the simulator has no SMs: each family picks its number)."""
    if like.lib == "numpy":
        return simulator
    if like.lib != "torch" and others is not None:
        return others
    n = _sms.get((like.lib, like.device))
    if n is None:
        if like.lib == "torch":
            n = ad._torch.cuda.get_device_properties(like.device).multi_processor_count
        else:
            with cuda.gpus[like.device]:
                n = cuda.get_current_device().MULTIPROCESSOR_COUNT
        _sms[(like.lib, like.device)] = n
    return n


# ---------------------------------------------------------------- test hook: the block size
_forced_threads = None


def forced_threads():
    """The block size a test forced with :func:`force_threads` (None: the family chooses)."""
    return _forced_threads


@contextlib.contextmanager
def force_threads(n):
    """Test hook: every family's launch configuration uses ``n`` threads per block (a multiple
    of 32) -- correctness must not depend on the block size. Clears the fast-path cache."""
    global _forced_threads
    old, _forced_threads = _forced_threads, n
    clear_launch_cache()
    try:
        yield
    finally:
        _forced_threads = old
        clear_launch_cache()


# ---------------------------------------------------------------- registry
_dispatchers = {}  # (factory, spec) -> cuda.jit dispatcher
_kernels = {}      # (factory, spec, argtypes) -> FastKernel (GPU) or dispatcher (simulator)
_launched = set()  # (factory, spec, argtypes) launched in this process


def dispatcher(factory, spec):
    """The ``cuda.jit`` dispatcher of ``factory(spec)`` (the factory runs once per spec)."""
    d = _dispatchers.get((factory, spec))
    if d is None:
        d = _dispatchers[(factory, spec)] = cuda.jit(factory(spec))
    return d


def kernel(factory, spec, sig):
    """The kernel ``factory(spec)`` compiled for the numba argument types ``sig`` (lazily, once)."""
    k = _kernels.get((factory, spec, sig))
    if k is None:
        disp = dispatcher(factory, spec)
        k = disp if SIM else FastKernel(disp, sig, f"{factory.__name__}({spec})")
        _kernels[(factory, spec, sig)] = k
    return k


def launched():
    """The ``(factory, spec, argtypes)`` launched so far in this process."""
    return set(_launched)


_warmed = set()  # (factory, spec, argtypes, device) whose siblings are compiled


def _warm(factory, spec, sig, device, warm):
    """Compile ``warm()``'s ``(factory, spec, argtypes)`` on ``device`` once, the first time
    ``(factory, spec, sig)`` launches there. The simulator compiles nothing: it records them
    with the launched variants, so the simulator pass checks that each is declared in its
    family's ``variants()`` (and so compiled by the PTX test)."""
    k = (factory, spec, sig, device)
    if k in _warmed:
        return
    _warmed.add(k)
    for f2, s2, sig2 in warm():
        if SIM:
            _launched.add((f2, s2, tuple(sig2)))
        else:
            kernel(f2, s2, tuple(sig2)).compile(device)


# ---------------------------------------------------------------- the launch
def launch(factory, spec, grid, block, params, *, like, stream=None, key=None, part=(0, 1),
           warm=None):
    """Launch ``factory(spec)`` over ``grid`` x ``block`` with ``params`` on ``like``'s device,
    on ``stream`` (default: the caller's current stream). ``key`` (from :func:`key`): remember
    the prepared launch for :func:`replay`. ``part=(i, n)``: this is launch ``i`` of the ``n``
    launches one call makes under ``key``; the last one stores them all for the replay.
    ``warm``: a callable giving the ``(factory, spec, argtypes)`` a call of another size could
    launch instead, compiled with this one (see the module docstring)."""
    sig = argtypes(params)
    k = kernel(factory, spec, sig)
    _launched.add((factory, spec, sig))
    if warm is not None:
        _warm(factory, spec, sig, like.device, warm)
    if SIM:
        k[grid, block](*[p.sim_value() for p in params])
        return
    values = [v for p in params for v in p.gpu_values()]
    handle = ad.stream_handle(like, stream)
    ad.sync_producers([p.arr for p in params if isinstance(p, ArrayParam) and p.arr is not None],
                      handle)
    with ad.device_guard(like):
        prepared = k.prepare(like.device, grid, block, values)
        prepared.launch(handle)
    if key is not None:
        i, n = part
        if n == 1:
            _remember(key, prepared, params)
            return
        chain = _pending.setdefault(threading.get_ident(), {})
        if i == 0:
            chain[key] = []
        launches = chain.get(key)
        if launches is None or len(launches) != i:
            chain.pop(key, None)  # an earlier launch of this call was not recorded: no replay
            return
        launches.append((prepared, params))
        if i == n - 1:
            _remember_chain(key, chain.pop(key))


# ---------------------------------------------------------------- the eager fast path
LAUNCH_CACHE_SIZE = 1024
_KEY_SCALARS = (float, int, str, type(None))  # not bool: True == 1.0 must not find eps=1.0
_cache = {}
_stats = {"misses": 0}
_rt = None  # (current device, current raw stream, more than one GPU), set at the first store


_pending = {}  # thread -> {key: [(prepared, params), ...]}: a multi-launch call being recorded


class _Replay:
    __slots__ = ("prepared", "rest", "device", "allocs", "lock")

    def __init__(self, prepared, allocs, rest=()):
        self.prepared, self.device, self.allocs = prepared, prepared.device, allocs
        self.rest = rest  # the launches after the first of a multi-launch call
        self.lock = threading.Lock() if allocs else None


def key(tag, scalars, *tensors):
    """The fast-path key of a call on torch tensors: ``tag`` (the op), its ``scalars`` (exact
    types only: a bool is not a float) and, per tensor, data pointer, shape, strides and dtype
    (None stays None; a list or tuple of tensors, a ``Tensor[]`` argument, is keyed as one
    tuple of theirs). None when any argument is not a torch tensor or a scalar is unusual:
    the call then takes the checked path."""
    for s in scalars:
        if type(s) not in _KEY_SCALARS:
            return None
    k = [tag, scalars]
    try:
        for t in tensors:
            if t is None:
                k.append(None)
            elif type(t) is list or type(t) is tuple:  # a Tensor[] argument
                k.append(tuple((u.data_ptr(), u.shape, u.stride(), u.dtype) for u in t))
            else:
                k += (t.data_ptr(), t.shape, t.stride(), t.dtype)
    except AttributeError:
        return None
    return tuple(k)


def key3(tag, s, option, a, b, c):
    """:func:`key` written out for the norms' hot path: a float ``s``, a str ``option`` and
    three tensors (``c`` may be None)."""
    if type(s) is not float or type(option) is not str:
        return None
    try:
        return (tag, s, option, a.data_ptr(), a.shape, a.stride(), a.dtype, b.data_ptr(),
                b.shape, b.stride(), b.dtype,
                None if c is None else (c.data_ptr(), c.shape, c.stride(), c.dtype))
    except AttributeError:
        return None


def replay(k):
    """Replay the launch remembered for key ``k`` on the current stream. Returns the tuple of
    outputs it allocated (empty when the caller passed them all), or None on a miss."""
    hit = _cache.get(k)
    if hit is None:
        _stats["misses"] += 1
        return None
    get_device, get_stream, multi_gpu = _rt
    if multi_gpu and get_device() != hit.device:
        return None
    stream = get_stream(hit.device)
    if hit.allocs is None:
        _run(hit, stream)
        return ()
    outs = tuple(alloc() for alloc, _ in hit.allocs)
    with hit.lock:
        for t, (_, slots) in zip(outs, hit.allocs):
            base = t.data_ptr()
            for q, slot, offset in slots:
                q.set_slot(slot, base + offset)
        _run(hit, stream)
    return outs


def _run(hit, stream):
    """The remembered call's launches, in order, on ``stream``."""
    for q in (hit.prepared, *hit.rest):
        err, = q.driver_call(stream, q.params, 0)
        if err is not CUDA_SUCCESS:
            q.failed(err, stream)


def fill(outs, *given):
    """The op's outputs after a replay: each of ``given`` (the caller's, or None) with the
    Nones replaced, in order, by the replay's allocated ``outs``."""
    it = iter(outs)
    return tuple(next(it) if g is None else g for g in given)


def _remember(k, prepared, params):
    _remember_chain(k, [(prepared, params)])


def _remember_chain(k, launches):
    """Store the launches of one call (in order) for :func:`replay` under key ``k``."""
    global _rt
    if _rt is None:
        _rt = ad.torch_runtime()
    # allocated tensor -> (allocator, [(launch, data-pointer slot, byte offset)]), in the order
    # the tensors first appear in the launches' parameters
    allocs = {}
    for prepared, params in launches:
        slot = 0
        for p in params:
            a = p.arr if isinstance(p, ArrayParam) else None
            if a is not None and a.alloc is not None:
                entry = allocs.setdefault(id(a.obj), (a.alloc, []))
                entry[1].append((prepared, slot + 4, p.ptr - a.obj.data_ptr()))  # data: 5th value
            slot += p.nparams
    if len(_cache) >= LAUNCH_CACHE_SIZE:
        _cache.clear()
    _cache[k] = _Replay(launches[0][0], tuple((fn, tuple(s)) for fn, s in allocs.values()) or None,
                        tuple(p for p, _ in launches[1:]))


def launch_cache_info():
    """``{"misses", "size"}``: fast-path lookups that found nothing, and remembered launches."""
    return dict(_stats, size=len(_cache))


def clear_launch_cache():
    _cache.clear()
    _pending.clear()
