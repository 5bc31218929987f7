"""Contracts every family's ops share: wrapping, output allocation, aliasing, scales, and the
row view of ``[..., n]`` arrays. Each raises a ``LoomnbError`` naming the argument, what was
expected and what came, before any launch (the primitive checks are in ``loomnb.checks``).

An op reads: validate every argument with these, allocate what the caller did not pass
(:func:`output`), then one launch.
"""

from __future__ import annotations

from .. import _adapter as ad
from ..checks import (check_kind, check_same_device, check_shape, check_writable,
                      fail_type, fail_value)

wrap = ad.wrap
VECTOR_BYTES = 16  # one vector load or store


def choice(op, name, value, allowed):
    """``value`` must be one of ``allowed`` (strings such as rounding modes)."""
    if not isinstance(value, str) or value not in allowed:
        fail_value(op, name, "one of " + ", ".join(repr(a) for a in allowed), repr(value))
    return value


def real(op, name, value, *, low=None, finite=True):
    """A real Python/NumPy number (not a bool), optionally ``>= low`` and finite."""
    import numbers
    if isinstance(value, (bool, str, bytes)) or not isinstance(value, numbers.Real):
        fail_type(op, name, "a real number", repr(value))
    v = float(value)
    if v != v or (finite and v in (float("inf"), float("-inf"))) or (low is not None and not v >= low):
        fail_value(op, name, ("finite" if finite else "a number") + (f" and >= {low}" if low is not None else ""),
                   repr(value))
    return v


def integer(op, name, value, low=None, high=None, *, expected=None):
    """A Python/NumPy integer (not a bool) in ``[low, high]`` (each bound optional), as an
    ``int``. Another type is a ``LoomnbTypeError``; a value out of range a ``LoomnbValueError``
    that names ``expected`` (default: "an int >= low", "an int in [low, high]")."""
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail_type(op, name, "an int", repr(value))
    if (low is not None and value < low) or (high is not None and value > high):
        if expected is None:
            expected = (f"an int in [{low}, {high}]" if low is not None and high is not None
                        else f"an int >= {low}" if low is not None else f"an int <= {high}")
        fail_value(op, name, expected, repr(value))
    return int(value)


def flag(op, name, value):
    """A bool option (``is_neox``, ``check_indices``...): nothing else, not even 0 or 1."""
    if not isinstance(value, bool):
        fail_type(op, name, "a bool", repr(value))
    return value


# ---------------------------------------------------------------- KV-cache arguments
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's kv_cache_dtype strings


def kv_scale(op, name, obj, like, num_kv_heads, like_name, *, one_element_any_shape=True):
    """A KV-cache scale (``k_scale``/``v_scale``; stored = real / scale): float32 on ``like``'s
    device, one element or ``[num_kv_heads]``, as the ``[num_kv_heads]`` view the kernels index
    (stride 0 for one element). ``one_element_any_shape=False`` takes a single scale only as a
    0-D or 1-D array (the attention family's rule; the cache writes take any shape of one
    element, as :func:`one_element`). None (no scale) stays None."""
    if obj is None:
        return None
    s = ad.wrap(op, name, obj)
    check_kind(op, name, s, ("f32",))
    check_same_device(op, name, s, like_name, like)
    if s.size == 1 and (one_element_any_shape or s.ndim <= 1):
        return s.view((num_kv_heads,), (0,))
    if s.ndim != 1 or s.shape[0] != num_kv_heads:
        fail_value(op, name, f"a float32 array of shape [1] or [num_kv_heads] = [{num_kv_heads}]",
                   f"shape {list(s.shape)}")
    return s


def output(op, name, obj, *, like, kind, shape, like_name="x"):
    """The output ``name``: checked when the caller passed it, else allocated in ``like``'s
    library and device (and marked so the fast path allocates it again on a replay)."""
    if obj is None:
        new = ad.empty(like, tuple(shape), kind)
        a = ad.wrap(op, name, new)
        a.alloc = ad.torch_allocator(like, tuple(shape), kind)
        return a
    a = ad.wrap(op, name, obj)
    check_kind(op, name, a, (kind,) if isinstance(kind, str) else kind)
    check_shape(op, name, a, shape, f"from '{like_name}'")
    check_same_device(op, name, a, like_name, like)
    writable(op, {name: a})
    return a


def same_place(a, b):
    """Exactly in place: the same bytes element for element (same address, element size and
    byte strides). An FP8 view of a bf16 buffer at the same address is *not* in place."""
    return (a.ptr == b.ptr and a.itemsize == b.itemsize and a.shape == b.shape
            and all(s * a.itemsize == t * b.itemsize for s, t in zip(a.strides, b.strides)))


def no_overlap(op, writes, reads, in_place=(), *, interleaved=False):
    """No array the op writes may overlap another argument, except a (write, read) pair named
    in ``in_place`` that is exactly the same memory (:func:`same_place`). ``writes``/``reads``
    map names to :class:`~loomnb._adapter.Arr` (None entries are skipped).

    ``interleaved=True`` also accepts arrays whose extents overlap but whose elements cannot
    (:func:`elements_may_overlap`): the q/k/v slices of one fused QKV buffer, the K and V pages
    of one interleaved KV cache. The default compares extents only."""
    items = [(n, a, True) for n, a in writes.items() if a is not None]
    items += [(n, a, False) for n, a in reads.items() if a is not None]
    for i, (n1, a1, w1) in enumerate(items):
        for n2, a2, w2 in items[i + 1:]:
            if not (w1 or w2) or not a1.overlaps(a2):
                continue
            if interleaved and not elements_may_overlap(a1, a2):
                continue
            if ((n1, n2) in in_place or (n2, n1) in in_place) and same_place(a1, a2):
                continue
            why = ("" if a1.ptr != a2.ptr else " (the same memory)" if same_place(a1, a2)
                   else " (same address, different element size or strides)")
            fail_value(op, n1 if w1 else n2, f"a buffer that does not overlap '{n2 if w1 else n1}'",
                       "overlapping memory" + why)


def elements_may_overlap(a, b):
    """Whether two arrays may share a byte, decided from the outermost stride: when both have
    the same largest byte stride ``S`` (over dimensions of size > 1), each spans less than
    ``S`` bytes without that dimension, and their byte ranges within one period of ``S`` are
    disjoint modulo ``S``, no element of one can touch the other (row-interleaved slices of one
    buffer). Otherwise: whether their extents overlap (conservative)."""
    if not a.overlaps(b):
        return False

    def period(x):
        dims = [(abs(s) * x.itemsize, n, s) for n, s in zip(x.shape, x.strides) if n > 1]
        if not dims or any(s < 0 for _, _, s in dims):
            return None
        big = max(dims)
        inner = x.itemsize + sum((n - 1) * st for st, n, _ in dims if (st, n) != big[:2])
        return big[0], inner

    pa, pb = period(a), period(b)
    if pa is None or pb is None or pa[0] != pb[0]:
        return True
    S, wa = pa
    wb = pb[1]
    if wa > S or wb > S:
        return True
    d = (b.ptr - a.ptr) % S
    return not (wa <= d and d + wb <= S)


def one_element(op, name, obj, like, kind="f32", like_name="x"):
    """A device scalar such as a static FP8 scale: one element of ``kind``, shape ``[]`` or
    ``[1]`` (or any shape of one element), on ``like``'s device."""
    s = ad.wrap(op, name, obj)
    check_kind(op, name, s, (kind,))
    if s.size != 1:
        fail_value(op, name, f"a {s.dtype_name if s.kind else kind} array of one element (shape [] or [1])",
                   f"shape {list(s.shape)}")
    check_same_device(op, name, s, like_name, like)
    return s.view((1,), (1,))


def assert_positive_finite(op, name, a):
    """The opt-in ``check_scale=True``: every element of device scalar ``a`` must be finite and
    > 0. torch tensors: ``torch._assert_async`` -- no host synchronisation, a failure surfaces
    as a CUDA device-side assert at the next synchronisation (which ends the CUDA context:
    a debugging aid, not control flow). NumPy (simulator): checked here, ``LoomnbValueError``.
    Other device arrays: copied to the host and checked (that synchronises)."""
    if a.lib == "torch":
        t = a.obj
        ad._torch._assert_async(ad._torch.logical_and(t > 0, ad._torch.isfinite(t)).all(),
                                f"{op}: argument '{name}' must be finite and > 0")
        return
    import numpy as np
    host = a.obj if a.lib == "numpy" else (a.obj.get() if a.lib == "cupy" else a.obj.copy_to_host())
    vals = np.asarray(host, dtype=np.float32).reshape(-1)
    if not (np.all(np.isfinite(vals)) and np.all(vals > 0)):
        fail_value(op, name, "finite and > 0 (check_scale=True)", f"{vals.tolist()}")


def rows(op, named):
    """The row view of arrays of equal shape ``[..., n]`` (last dimension contiguous): their
    leading dimensions, merged where every array allows it, as one or two dimensions ``lead``.

    Returns ``(lead, views)``, each view an ``Arr`` of shape ``lead + (n,)``. Any leading
    strides work -- per-head views ``[num_tokens, num_heads, head_size]`` cut out of a wider
    buffer, a size-1 dimension with an arbitrary stride -- as long as they merge into at most
    two strided dimensions (else an error names the shape and strides).
    """
    shape = named[0][1].shape
    for name, a in named:
        if a.ndim < 1:
            fail_value(op, name, "an array of shape [..., n]", "a 0-D array")
        if a.shape[-1] > 1 and a.strides[-1] != 1 and 0 not in a.shape:
            fail_value(op, name, "contiguous in its last dimension (stride 1)",
                       f"strides {a.strides} (in elements)")
    lead = [(d, [a.strides[i] for _, a in named]) for i, d in enumerate(shape[:-1]) if d != 1]
    if any(d == 0 for d, _ in lead):
        lead = [(0, [0] * len(named))]
    merged, culprit = [], None
    for d, st in lead:
        if merged and all(ps == s * d for ps, s in zip(merged[-1][1], st)):
            merged[-1] = (merged[-1][0] * d, st)
        else:
            if merged and culprit is None:  # the first array that keeps this boundary
                culprit = next(j for j, (ps, s) in enumerate(zip(merged[-1][1], st)) if ps != s * d)
            merged.append((d, st))
    if len(merged) > 2:
        name, a = named[culprit]
        fail_value(op, name, "leading dimensions that merge into at most two strided "
                   "dimensions", f"shape {tuple(a.shape)} with strides {tuple(a.strides)}")
    if not merged:
        merged = [(1, [0] * len(named))]
    sizes = tuple(d for d, _ in merged)
    views = [a.view(sizes + (shape[-1],), tuple(st[j] for _, st in merged) + (1,))
             for j, (_, a) in enumerate(named)]
    return sizes, views


def vectors_ok(*arrs, unit=VECTOR_BYTES):
    """Whether every row of every array (row views from :func:`rows`) starts on a ``unit``-byte
    boundary and holds whole units, so kernels may move ``unit`` bytes per load and store.
    Sizes and strides of dimensions of size 1 do not matter."""
    for a in arrs:
        if a is None:
            continue
        isz = a.itemsize
        if a.ptr % unit or (a.shape[-1] * isz) % unit:
            return False
        if any(d > 1 and (s * isz) % unit for d, s in zip(a.shape[:-1], a.strides[:-1])):
            return False
    return True


def writable(op, named):
    """Every array the op writes or mutates is writable, and no two of its elements share
    memory (a broadcast or overlapping-rows view would race) -- checked before any launch."""
    for name, a in named.items():
        if a is None:
            continue
        check_writable(op, name, a)
        if a.size == 0:
            continue
        dims = sorted((abs(s), n) for n, s in zip(a.shape, a.strides) if n > 1)
        reach = 0  # elements spanned by the faster-varying dimensions
        for s, n in dims:
            if s <= reach:
                fail_value(op, name, "an array whose elements do not overlap each other",
                           f"shape {a.shape} with strides {a.strides} (in elements)")
            reach += (n - 1) * s


def assert_in_range(op, name, a, lo, hi, *, allow=None, where=None, given=(), meaning="",
                    stream=None, flag="check_indices=True"):
    """The opt-in ``check_indices=True`` of the ops that read device indices: every element of
    the integer array ``a`` (the ``Arr`` of the caller's whole array, not a view) is in ``[lo,
    hi]`` (both inclusive) or equals ``allow``. ``where(xp, x, *others) -> bool array`` of
    ``x``'s shape, when given, selects the elements to check (the block-table entries a
    sequence reads); ``xp`` is ``torch`` or ``numpy``, ``x`` and ``others`` are the values of
    ``a`` and of the ``Arr`` s in ``given`` in that library.

    torch tensors: ``torch._assert_async`` on the launch stream (``stream``, else the current
    one) -- no host synchronisation; a failure is a CUDA device-side assert at the next
    synchronisation, which ends the CUDA context (a debugging aid, not control flow); the op's
    kernel, queued after it on the same stream, does not run. NumPy (the simulator): checked
    here, ``LoomnbValueError`` naming the first bad element. Other device arrays: copied to the
    host and checked (that synchronises). Bounds past the dtype's range are clipped to it."""
    bits = 8 * a.itemsize
    lo, hi = max(lo, -(1 << (bits - 1))), min(hi, (1 << (bits - 1)) - 1)
    expected = (f"{allow} or " if allow is not None else "") + f"in [{lo}, {hi}]" + (
        f" {meaning}" if meaning else "")

    def ok(xp, x, *others):
        good = (x >= lo) & (x <= hi)
        if allow is not None:
            good = good | (x == allow)
        if where is not None:
            good = good | ~where(xp, x, *others)
        return good

    if a.lib == "torch" and all(g.lib == "torch" for g in given):
        torch = ad._torch
        run = lambda: torch._assert_async(  # noqa: E731
            ok(torch, a.obj, *(g.obj for g in given)).all(),
            f"{op}: argument '{name}' must be {expected} ({flag})")
        if stream is None:
            run()
        else:
            with torch.cuda.stream(torch.cuda.ExternalStream(ad.stream_handle(a, stream),
                                                             device=a.obj.device)):
                run()
        return
    import numpy as np

    def host(arr):
        if arr.lib == "numpy":
            return arr.obj
        if arr.lib == "torch":
            return arr.obj.cpu().numpy()
        if arr.lib == "cupy":
            return arr.obj.get()
        from numba import cuda
        return cuda.as_cuda_array(arr.obj).copy_to_host()

    x = np.asarray(host(a))
    good = np.asarray(ok(np, x, *(np.asarray(host(g)) for g in given)))
    if not good.all():
        idx = tuple(int(i) for i in np.argwhere(~good)[0])
        fail_value(op, name, f"{expected} ({flag})", f"{x[idx]} at index {list(idx)}")
