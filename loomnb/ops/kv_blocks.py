"""KV-cache movement: ``copy_blocks``, ``swap_blocks``, ``gather_cache``, ``compact_blocks``
and MLA's cache write ``concat_and_cache_mla``.

The scheduler-facing work on the paged KV cache: forking blocks for copy-on-write, swapping
blocks to pinned host memory and back, gathering a sequence's pages into contiguous rows (for
attention over a cached prefix or a chunked context), defragmenting the pool in place, and
DeepSeek MLA's compressed cache write. All are memory-bound copies; loomnb does each in one
launch (two for a compaction), on the caller's stream.

Caches are the views of :mod:`loomnb.layouts.paged_kv` (``kv_views``: NHD, HND, interleaved,
split, legacy): the block ops need only that every block of a cache is a dense span of memory
(``cache[b]``'s elements contiguous in some order, as in every vLLM layout) and move its bytes;
``gather_cache`` and ``concat_and_cache_mla`` index ``[num_blocks, block_size, ...]`` views
through their strides, the last dimension contiguous.

Bytes moved (the benchmark's model): ``copy_blocks`` and ``swap_blocks`` read and write each
block once (``2 * num_pairs * block_bytes`` per cache, + 16 bytes a pair); ``gather_cache``
reads ``num_tokens`` page rows and writes them (``num_tokens * entries * (cache element + dst
element)``); ``concat_and_cache_mla`` reads ``kv_c`` and ``k_pe`` and writes the cache rows
(``num_tokens * (kv_lora_rank + pe_dim) * (b + cache element size)``, + 8 bytes of slot).
"""

from __future__ import annotations

import math

import numpy as np

from .. import _adapter as ad
from .._dtypes import storage_dtype
from ..checks import (check_kind, check_same_device, check_same_kind, fail_type, fail_value)
from . import _contract as C
from . import _launch as L
from . import _workspace as W
from ._kv_blocks_kernels import (ILP, KINDS, MAX_ROWS, UNITS, BlockCopySpec, ChainSpec,
                                 GatherSpec, MlaSpec, block_copy_argtypes, block_copy_kernel,
                                 chain_kernel,
                                 gather_kernel, mla_kernel, unit_storage, unit_words)
from ._torch_ops import torch_op

__all__ = ["copy_blocks", "swap_blocks", "gather_cache", "compact_blocks", "concat_and_cache_mla"]

MAX_THREADS = 256
GATHER_BLOCKS = 256  # thread blocks a gather aims for before it puts more rows in each
SEGMENT = 16  # cycle members a compaction segment moves (the workspace is <= 1/SEGMENT of them)
_KV = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_CACHE_KINDS = {"fp8_e4m3": ("fp8", "u8"), "fp8_e5m2": ("fp8_e5m2", "u8")}
AUTO_KINDS = ("bf16", "f16", "f32", "fp8", "fp8_e5m2", "u8")  # what a cache holds


# ------------------------------------------------------------------------------ block spans
def _block_span(op, name, a):
    """``(block_stride_bytes, block_bytes)`` of cache ``a`` (``[num_blocks, ...]``), whose
    every block must be one dense span of memory (vLLM's layouts all are)."""
    isz = a.itemsize
    dims = sorted((s, n) for n, s in zip(a.shape[1:], a.strides[1:]) if n != 1)
    span = 1
    for s, n in dims:
        if n == 0:
            return a.strides[0] * isz, 0
        if s != span:
            fail_value(op, name, "a cache whose every block is one dense span of memory (a "
                       "[num_blocks, ...] view of one of vLLM's layouts: the strides of the "
                       "dimensions after the first pack them with no gap)",
                       f"shape {list(a.shape)}, strides {list(a.strides)} (in elements)")
        span *= n
    if a.shape[0] > 1 and a.strides[0] < span:
        fail_value(op, name, f"blocks that do not overlap (a block stride of at least {span} "
                   "elements)", f"block stride {a.strides[0]}")
    return a.strides[0] * isz, span * isz


def _unit(values):
    """The largest of :data:`UNITS` dividing every value (addresses, strides, sizes)."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    return next(u for u in UNITS if g % u == 0)


def _arena(like, base, end, unit):
    """The 1-D arena parameter over bytes ``[base, end)`` in elements of ``unit`` bytes."""
    n = (end - base) // unit * unit_words(unit)
    return L.ArrayParam(like, base, (max(n, 1),), (1,), unit_storage(unit))


def _threads(block_units):
    return L.forced_threads() or min(MAX_THREADS, L.whole_warps(max(1, -(-block_units // ILP))))


def _cache_list(op, name, caches):
    if isinstance(caches, (list, tuple)):
        items = list(caches)
    else:
        fail_type(op, name, "a list of cache arrays (one per layer)", type(caches).__name__)
    return [(f"{name}[{i}]", ad.wrap(op, f"{name}[{i}]", c)) for i, c in enumerate(items)]


def _index_array(op, name, obj, like, like_name, kind="i64", ndim=None, cols=None):
    a = ad.wrap(op, name, obj)
    check_kind(op, name, a, (kind,))
    check_same_device(op, name, a, like_name, like)
    if ndim is not None and a.ndim != ndim:
        fail_value(op, name, f"a {ndim}-D array", f"a {a.ndim}-D array of shape {list(a.shape)}")
    if cols is not None and a.shape[1] != cols:
        fail_value(op, name, f"of shape [n, {cols}]", f"shape {list(a.shape)}")
    return a


def _fp8_scale(op, kvd, kv_cache_dtype, scale, like, like_name):
    """The one-element float32 ``scale`` an FP8 cache needs (None for ``"auto"``)."""
    if kvd == "auto":
        return None
    if scale is None:
        fail_value(op, "scale", f"a float32 device array for kv_cache_dtype {kv_cache_dtype!r}",
                   "None")
    return C.one_element(op, "scale", scale, like, like_name=like_name)


def _last_contiguous(op, named):
    for name, a in named.items():
        if a.shape[-1] > 1 and a.strides[-1] != 1 and 0 not in a.shape:
            fail_value(op, name, "contiguous in its last dimension (stride 1)",
                       f"strides {list(a.strides)} (in elements)")


def _host_int64(op, name, obj, ndim):
    """A host int64 array (NumPy or a CPU torch tensor) as NumPy, ``ndim``-D."""
    torch = ad._torch
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            return None
        if obj.dtype != torch.int64:
            fail_type(op, name, "int64", str(obj.dtype).replace("torch.", ""))
        host = obj.numpy()
    elif isinstance(obj, np.ndarray):
        if obj.dtype != np.int64:
            fail_type(op, name, "int64", obj.dtype.name)
        host = obj
    else:
        return None
    if host.ndim != ndim:
        fail_value(op, name, f"a {ndim}-D array", f"a {host.ndim}-D array of shape "
                   f"{list(host.shape)}")
    return host


# ------------------------------------------------------------------------------ copy_blocks
@torch_op("Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping, *, "
          "bool check_indices=False", returns=("key_caches", "value_caches"))
def copy_blocks(key_caches, value_caches, block_mapping, *, check_indices=False, stream=None,
                launch_key=None):
    """Copy whole blocks within every layer's caches, in **one launch** for all layers.

    For every cache ``c`` of ``key_caches + value_caches`` and every row ``(src, dst)`` of
    ``block_mapping``::

        c[dst] = c[src]        (the block's bytes)

    A row with a negative entry copies nothing (pad ``block_mapping`` with ``-1`` rows to
    capture one CUDA graph for any number of pairs up to its length). The rows run
    concurrently: no ``dst`` may be another row's ``src`` or ``dst`` (a fork's copy-on-write
    never does that); otherwise which bytes a block ends with is unspecified.

    Args:
        key_caches, value_caches: lists (one entry per layer, the same length) of cache arrays
            ``[num_blocks, ...]`` of any dtype and layout whose every block is a dense span of
            memory: the views of ``loomnb.layouts.kv_views`` (NHD, HND, interleaved, split,
            the legacy x-packed key and value), or whole ``[num_blocks, 2, ...]`` buffers
            passed in one list with the other list empty.
        block_mapping: int64 ``[num_pairs, 2]`` on the caches' device, ``(src, dst)`` block
            numbers, each -1 or below every cache's ``num_blocks`` (unchecked device reads
            unless ``check_indices=True``).
        check_indices: opt-in check of ``block_mapping`` with no host synchronisation (as
            :func:`loomnb.reshape_and_cache_flash`'s). Off by default.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(key_caches, value_caches)``. Mutates: the ``dst`` blocks of every cache.

    The first call with a set of caches copies a small table of their addresses to the device
    (synchronously) and keeps it; a CUDA graph can capture later calls. A first call during
    capture raises ``LoomnbValueError``.

    Raises ``LoomnbTypeError`` / ``LoomnbValueError`` naming the argument for a wrong dtype,
    shape, device, a block that is not a dense span, or lists of different lengths, before any
    launch. No pair or no cache is a no-op.

    Matches vLLM's ``copy_blocks(key_caches, value_caches, block_mapping)`` (``csrc/
    cache_kernels.cu``; vLLM 0.24 removed the op and forks blocks with torch indexing);
    ``copy_blocks_mla`` is this op with one list of caches.
    """
    op = "loomnb.copy_blocks"
    kcs = _cache_list(op, "key_caches", key_caches)
    vcs = _cache_list(op, "value_caches", value_caches)
    if vcs and len(vcs) != len(kcs):
        fail_value(op, "value_caches", f"a list of {len(kcs)} caches, one per key cache (or "
                   "empty)", f"{len(vcs)} caches")
    caches = kcs + vcs
    if not caches:
        return key_caches, value_caches
    first_name, first = caches[0]
    m = _index_array(op, "block_mapping", block_mapping, first, first_name, ndim=2, cols=2)
    spans = []
    for name, c in caches:
        check_same_device(op, name, c, first_name, first)
        spans.append(_block_span(op, name, c))
    C.writable(op, dict(caches))
    C.no_overlap(op, dict(caches), {"block_mapping": m}, interleaved=True)
    if C.flag(op, "check_indices", check_indices):
        nb = min(c.shape[0] for _, c in caches)
        C.assert_in_range(op, "block_mapping", m, 0, nb - 1, allow=-1,
                          meaning=f"(blocks of the caches: num_blocks = {nb})", stream=stream)
    if m.shape[0] == 0:
        return key_caches, value_caches
    _launch_copy(op, [c for _, c in caches], spans, [c for _, c in caches], spans, m,
                 first, stream, launch_key)
    return key_caches, value_caches


def _launch_copy(op, srcs, src_spans, dsts, dst_spans, m, like, stream, key, nbytes=None):
    """One block-copy launch: pair ``p``, cache ``c`` copies block ``m[p, 0]`` of ``srcs[c]``
    to block ``m[p, 1]`` of ``dsts[c]`` (``nbytes`` of each block, default the block's).
    ``srcs is dsts``: one arena for both."""
    same = srcs is dsts
    sizes = [nbytes if nbytes is not None else b for _, b in src_spans]
    unit = _unit([a.ptr for a in srcs + dsts] + [s for s, _ in src_spans + dst_spans] + sizes)
    ends = [a.ptr + max(a.shape[0], 1) * sp[0] for a, sp in zip(srcs + dsts, src_spans + dst_spans)]
    if same:
        sbase = dbase = min(a.ptr for a in srcs)
        send = dend = max(ends)
    else:
        sbase, dbase = min(a.ptr for a in srcs), min(a.ptr for a in dsts)
        send, dend = max(ends[:len(srcs)]), max(ends[len(srcs):])
    rows = tuple(((s.ptr - sbase) // unit, ss[0] // unit, (d.ptr - dbase) // unit, ds[0] // unit,
                  n // unit)
                 for s, ss, d, ds, n in zip(srcs, src_spans, dsts, dst_spans, sizes))
    desc = W.table(op, like, rows)
    src_p = _arena(srcs[0], sbase, send, unit)
    dst_p = src_p if same else _arena(dsts[0], dbase, dend, unit)
    spec = BlockCopySpec(unit)
    params = [src_p, dst_p, W.param(desc, "int64", like),
              m if isinstance(m, L.ArrayParam) else L.array(m), L.i64(len(srcs))]
    threads = _threads(max(r[4] for r in rows))
    L.launch(block_copy_kernel, spec, m.shape[0] * len(srcs), threads, params, like=like,
             stream=stream, key=key)


# ------------------------------------------------------------------------------ swap_blocks
@torch_op("Tensor src, Tensor(a!) dst, int block_size_in_bytes, Tensor block_mapping",
          returns=("dst",))
def swap_blocks(src, dst, block_size_in_bytes, block_mapping, *, stream=None, launch_key=None):
    """Copy blocks between two pools -- GPU to pinned host memory, host to GPU, or GPU to GPU
    -- in **one launch**, on the caller's stream.

    For every row ``(s, d)`` of ``block_mapping``, the ``block_size_in_bytes`` bytes at byte
    offset ``s * src.stride(0) * src.element_size()`` of ``src`` are copied to byte offset
    ``d * dst.stride(0) * dst.element_size()`` of ``dst``. A row with a negative entry copies
    nothing. Host memory is read and written by the kernel through unified addressing (no
    staging copy, one launch however small the blocks).

    Args:
        src, dst: ``[num_blocks, ...]`` pools of any dtype whose every block is a dense span
            of memory, each a CUDA tensor or a pinned (page-locked) CPU tensor
            (``pin_memory=True``); at least one on the GPU (the launch's device).
        block_size_in_bytes: bytes per block to copy, at most either pool's block.
        block_mapping: int64 ``[num_pairs, 2]`` ``(s, d)`` block numbers, on the CPU (vLLM's
            rule; checked there: each -1 or below its pool's ``num_blocks``) or on the GPU
            (unchecked device reads). A CPU mapping is copied to the device on the launch
            stream (no host synchronisation; not for CUDA-graph capture, which needs the
            mapping on the device).
        stream: CUDA stream; default the caller's current stream.

    Returns ``dst``. Mutates: ``dst``'s blocks.

    Raises ``LoomnbTypeError`` / ``LoomnbValueError`` naming the argument (a pageable host
    tensor, both pools on the host, a bad block, size or mapping) before any launch. No pair
    is a no-op.

    Matches vLLM 0.24's ``swap_blocks(src, dst, block_size_in_bytes, block_mapping)``, which
    issues one ``cudaMemcpyAsync`` per pair. Differs: one kernel for all pairs; a GPU
    ``block_mapping`` is accepted; rows with a negative entry are skipped.
    """
    op = "loomnb.swap_blocks"
    s = ad.wrap_host(op, "src", src)
    d = ad.wrap_host(op, "dst", dst)
    like = d if d.device >= 0 else s
    if like.device < 0:
        fail_value(op, "src", "a CUDA array when 'dst' is host memory (one of the two pools is "
                   "on the GPU)", "pinned host memory")
    if s.device >= 0 and d.device >= 0:
        check_same_device(op, "dst", d, "src", s)
    C.writable(op, {"dst": d})
    if s.ndim == 0 or d.ndim == 0:
        fail_value(op, "src" if s.ndim == 0 else "dst", "a [num_blocks, ...] pool", "a 0-D array")
    sspan, dspan = _block_span(op, "src", s), _block_span(op, "dst", d)
    n = C.integer(op, "block_size_in_bytes", block_size_in_bytes, 0,
                  min(sspan[1], dspan[1]),
                  expected=f"an int in [0, {min(sspan[1], dspan[1])}] (a block of 'src' is "
                           f"{sspan[1]} bytes, of 'dst' {dspan[1]})")
    host = _host_int64(op, "block_mapping", block_mapping, 2)
    if host is None:
        m = _index_array(op, "block_mapping", block_mapping, like, "dst" if like is d else "src",
                         ndim=2, cols=2)
        rows = m.shape[0]
    else:
        if host.shape[1] != 2:
            fail_value(op, "block_mapping", "of shape [n, 2]", f"shape {list(host.shape)}")
        for col, (name, pool) in enumerate((("src", s), ("dst", d))):
            bad = (host[:, col] >= pool.shape[0]) | (host[:, col] < -1)
            if bad.any():
                i = int(np.argwhere(bad)[0][0])
                fail_value(op, "block_mapping", f"-1 or a block of '{name}' in [0, "
                           f"{pool.shape[0]}) in column {col}", f"{host[i, col]} in row {i}")
        rows = host.shape[0]
    if rows == 0 or n == 0:
        return dst
    if host is not None:
        buf = W.upload("swap_blocks_mapping", like, stream, host)
        m = W.param(buf, "int64", like)
    _launch_copy(op, [s], [sspan], [d], [dspan], m, like, stream, None, nbytes=n)
    return dst


# ------------------------------------------------------------------------------ compact_blocks
def _segments(perm):
    """``(heads, chain, segments)`` of permutation ``perm`` (``new[i] = old[perm[i]]``): its
    cycles of two or more blocks ``c_0, c_1 = perm[c_0], ...`` cut into segments of at most
    :data:`SEGMENT` members; ``chain`` their members back to back, ``segments [S, 3]`` ``(first
    index into chain, length, workspace slot or -1)`` and ``heads [H, 2]`` ``(block, slot)``:
    the old block each slot saves (the member after a segment that is not a whole cycle).
    Compiled for the CPU (``numba.njit``) once per process: a Python loop would cost about a
    millisecond per 2,000 blocks."""
    perm = np.ascontiguousarray(perm, dtype=np.int64)
    return _split_cycles(perm, SEGMENT)


def _split_cycles_py(perm, seg):
    n = perm.shape[0]
    seen = np.zeros(n, np.bool_)
    chain = np.empty(n, np.int64)
    segs = np.empty((n, 3), np.int64)
    heads = np.empty((n, 2), np.int64)
    nc = ns = nh = 0
    for i0 in range(n):
        if seen[i0] or perm[i0] == i0:
            seen[i0] = True
            continue
        start = nc
        j = i0
        while not seen[j]:  # the cycle, in order
            seen[j] = True
            chain[nc] = j
            nc += 1
            j = perm[j]
        k = nc - start
        if k <= seg:
            segs[ns, 0], segs[ns, 1], segs[ns, 2] = start, k, -1
            ns += 1
            continue
        for a in range(0, k, seg):
            b = min(a + seg, k)
            heads[nh, 0], heads[nh, 1] = chain[start + b % k], nh
            segs[ns, 0], segs[ns, 1], segs[ns, 2] = start + a, b - a, nh
            nh += 1
            ns += 1
    return heads[:nh].copy(), chain[:nc].copy(), segs[:ns].copy()


try:
    import numba as _numba
    _split_cycles = _numba.njit(cache=True)(_split_cycles_py)
except Exception:  # pragma: no cover - numba is a dependency; keep the pure-Python twin usable
    _split_cycles = _split_cycles_py


@torch_op("Tensor(a!)[] kv_cache, Tensor permutation", returns=("kv_cache",))
def compact_blocks(kv_cache, permutation, *, stream=None, launch_key=None):
    """Permute the blocks of a pool in place -- defragmentation -- without a temporary pool.

    For every cache ``c`` of ``kv_cache`` and every block ``i < len(permutation)``::

        c[i] = c_before[permutation[i]]

    (so after moving live blocks to the front, a block table entry ``b`` becomes
    ``inverse[b]``, ``inverse[permutation[i]] = i``). The host splits the permutation's
    cycles into segments of at most 16 blocks; a first launch saves the block after each
    segment that is not a whole cycle to a workspace (at most a sixteenth of the moved blocks;
    none when every cycle is at most 16 blocks long), a second moves every segment's blocks
    down its chain, in parallel over segments, caches and each block's bytes.

    Args:
        kv_cache: a cache array ``[num_blocks, ...]``, or a list of them (every layer's caches:
            one launch pair for all), any dtype, each block a dense span of memory (as
            :func:`copy_blocks`).
        permutation: int64 ``[n]``, ``n <= num_blocks`` of every cache, a permutation of
            ``0 .. n-1`` (checked on the host): NumPy or a CPU tensor, or a CUDA tensor, which
            is copied to the host first (a synchronisation).
        stream: CUDA stream; default the caller's current stream.

    Returns ``kv_cache``. Mutates: every cache's first ``n`` blocks. The permutation's tables are
    made on the host and copied to the device on the launch stream at every call (no host
    synchronisation): not for CUDA-graph capture.

    Raises ``LoomnbTypeError`` / ``LoomnbValueError`` naming the argument (not a permutation,
    longer than a pool, a block that is not a dense span) before any launch; the identity is a
    no-op.

    vLLM has no such op (its engines defragment by recomputing or by copying through a second
    pool); loomnb's moves each block once in place.
    """
    op = "loomnb.compact_blocks"
    torch = ad._torch
    given = kv_cache
    caches = _cache_list(op, "kv_cache", kv_cache if isinstance(kv_cache, (list, tuple))
                         else [kv_cache])
    if not caches:
        return given
    first_name, first = caches[0]
    spans = []
    for name, c in caches:
        check_same_device(op, name, c, first_name, first)
        spans.append(_block_span(op, name, c))
    C.writable(op, dict(caches))
    C.no_overlap(op, dict(caches), {}, interleaved=True)
    if torch is not None and isinstance(permutation, torch.Tensor) and permutation.is_cuda:
        permutation = permutation.cpu()  # the host splits the cycles: a synchronisation
    perm = _host_int64(op, "permutation", permutation, 1)
    if perm is None:
        got = (f"a tensor on {permutation.device}" if torch is not None and
               isinstance(permutation, torch.Tensor) else type(permutation).__name__)
        fail_type(op, "permutation", "an int64 array (NumPy or a torch tensor)", got)
    n = perm.shape[0]
    nb = min(c.shape[0] for _, c in caches)
    if n > nb:
        fail_value(op, "permutation", f"of length at most num_blocks = {nb}", f"length {n}")
    if n and not np.array_equal(np.sort(perm), np.arange(n)):
        fail_value(op, "permutation", f"a permutation of 0 .. {n - 1}",
                   "repeated or out-of-range entries")
    heads, chain, segs = _segments(perm)
    if segs.shape[0] == 0:
        return given
    arrs = [c for _, c in caches]
    sizes = [b for _, b in spans]
    total = sum(sizes)
    ws = None
    if heads.shape[0]:
        ws = W.buffer("compact_blocks", first, stream, heads.shape[0] * total, (), "uint8", 1 << 16)
        ws_arr = W.param(ws, "uint8", first).arr
    pieces = arrs + ([ws_arr] if ws is not None else [])
    unit = _unit([a.ptr for a in pieces] + [s for s, _ in spans] + sizes)
    base = min(a.ptr for a in pieces)
    end = max([a.ptr + max(a.shape[0], 1) * s for a, (s, _) in zip(arrs, spans)]
              + ([ws_arr.ptr + ws_arr.shape[0]] if ws is not None else []))
    ws_base = (ws_arr.ptr - base) // unit if ws is not None else 0
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int) // unit
    rows = tuple(((a.ptr - base) // unit, s // unit, ws_base + int(o), total // unit, b // unit)
                 for a, (s, b), o in zip(arrs, spans, offs))
    desc = W.param(W.table(op, first, rows), "int64", first)
    arena = _arena(first, base, end, unit)
    threads = _threads(max(r[4] for r in rows))
    if heads.shape[0]:
        hp = W.param(W.upload("compact_blocks_heads", first, stream, heads), "int64", first)
        L.launch(block_copy_kernel, BlockCopySpec(unit), heads.shape[0] * len(arrs), threads,
                 [arena, arena, desc, hp, L.i64(len(arrs))], like=first, stream=stream)
    cp = W.param(W.upload("compact_blocks_chain", first, stream, chain), "int64", first)
    sp = W.param(W.upload("compact_blocks_segments", first, stream, segs), "int64", first)
    copy = BlockCopySpec(unit)  # the first pass, compiled with the chains for any permutation
    L.launch(chain_kernel, ChainSpec(unit), segs.shape[0] * len(arrs), threads,
             [arena, desc, cp, sp, L.i64(len(arrs))], like=first, stream=stream,
             warm=lambda: [(block_copy_kernel, copy, block_copy_argtypes(copy))])
    return given


# ------------------------------------------------------------------------------ gather_cache
@torch_op("Tensor src_cache, Tensor(a!) dst, Tensor block_table, Tensor cu_seq_lens, "
          "str kv_cache_dtype='auto', Tensor? scale=None, Tensor? seq_starts=None, *, "
          "bool check_indices=False", returns=("dst",))
def gather_cache(src_cache, dst, block_table, cu_seq_lens, kv_cache_dtype="auto", scale=None,
                 seq_starts=None, *, check_indices=False, stream=None, launch_key=None):
    """Gather each sequence's cached tokens from its pages into contiguous rows of ``dst``.

    For sequence ``b < batch = len(cu_seq_lens) - 1`` and token ``t < cu_seq_lens[b+1] -
    cu_seq_lens[b]``, with ``pos = seq_starts[b] + t`` (``t`` without ``seq_starts``)::

        dst[cu_seq_lens[b] + t] = cv(src_cache[block_table[b, pos // block_size],
                                               pos % block_size])

    ``cv`` copies the bits (``kv_cache_dtype="auto"``) or dequantises an FP8 cache,
    ``r(f32(code) * scale)``, rounded once to ``dst``'s dtype (vLLM's ``scaled_convert``).
    Rows of ``dst`` from ``cu_seq_lens[batch]`` on are not written.

    Args:
        src_cache: ``[num_blocks, block_size, num_kv_heads, head_size]`` or ``[num_blocks,
            block_size, entries]`` (MLA's latent cache), any strides, the last dimension
            contiguous (every layout of ``loomnb.layouts.kv_views`` but the legacy one). dtype:
            ``dst``'s for ``"auto"``, else ``uint8`` or the FP8 dtype.
        dst: ``[num_tokens, *src_cache.shape[2:]]``, last dimension contiguous, bf16/fp16/fp32
            for an FP8 cache (any dtype for ``"auto"``); ``num_tokens >= cu_seq_lens[batch]``
            (a fixed size: the op never reads the total on the host, so CUDA graphs capture
            it). Written in place.
        block_table: int32 ``[>= batch, max_blocks]`` (vLLM's ``block_tables``); each entry a
            sequence reads below ``num_blocks``.
        cu_seq_lens: int32 ``[batch + 1]``, non-decreasing from 0.
        kv_cache_dtype: ``"auto"``, ``"fp8"`` (= ``"fp8_e4m3"``), ``"fp8_e4m3"``, ``"fp8_e5m2"``.
        scale: float32, one element, on the device (required for FP8; ignored for ``"auto"``).
        seq_starts: int32 ``[batch]``, each sequence's first position (chunked context), or
            None.
        check_indices: opt-in check that every ``block_table`` entry is in ``[0, num_blocks)``
            without a host synchronisation. Off by default (unchecked device reads).
        stream: CUDA stream; default the caller's current stream.

    Returns ``dst``. Mutates: ``dst``'s first ``cu_seq_lens[batch]`` rows.

    Raises ``LoomnbTypeError`` / ``LoomnbValueError`` naming the argument before any launch.
    No sequence, no row of ``dst``, or empty entries is a no-op.

    Matches vLLM 0.24's ``cp_gather_cache(src_cache, dst, block_table, cu_seq_lens,
    batch_size, seq_starts)`` (``"auto"``) and ``gather_and_maybe_dequant_cache`` (an FP8
    cache). Differs: ``batch_size`` is ``len(cu_seq_lens) - 1``; the cache may be any strided
    layout (vLLM's copies contiguous entries); one op for both.
    """
    op = "loomnb.gather_cache"
    C.choice(op, "kv_cache_dtype", kv_cache_dtype, C.KV_CACHE_DTYPES)
    kvd = _KV[kv_cache_dtype]
    s = ad.wrap(op, "src_cache", src_cache)
    if s.ndim not in (3, 4):
        fail_value(op, "src_cache", "3-D [num_blocks, block_size, entries] or 4-D [num_blocks, "
                   "block_size, num_kv_heads, head_size]", f"a {s.ndim}-D array of shape "
                   f"{list(s.shape)}")
    d = ad.wrap(op, "dst", dst)
    check_same_device(op, "dst", d, "src_cache", s)
    if d.ndim != s.ndim - 1 or tuple(d.shape[1:]) != tuple(s.shape[2:]):
        fail_value(op, "dst", f"of shape [num_tokens, {', '.join(map(str, s.shape[2:]))}] "
                   "(src_cache's entries)", f"shape {list(d.shape)}")
    if kvd == "auto":
        check_kind(op, "src_cache", s, AUTO_KINDS)
        check_same_kind(op, "dst", d, "src_cache", s)
    else:
        check_kind(op, "src_cache", s, _CACHE_KINDS[kvd])
        check_kind(op, "dst", d, KINDS)
    _last_contiguous(op, {"src_cache": s, "dst": d})
    bt = _index_array(op, "block_table", block_table, s, "src_cache", "i32", ndim=2)
    cu = _index_array(op, "cu_seq_lens", cu_seq_lens, s, "src_cache", "i32", ndim=1)
    if cu.shape[0] < 1:
        fail_value(op, "cu_seq_lens", "of length batch + 1 >= 1", "length 0")
    batch = cu.shape[0] - 1
    if bt.shape[0] < batch:
        fail_value(op, "block_table", f"at least batch = {batch} rows (len(cu_seq_lens) - 1)",
                   f"shape {list(bt.shape)}")
    st = None
    if seq_starts is not None:
        st = _index_array(op, "seq_starts", seq_starts, s, "src_cache", "i32", ndim=1)
        if st.shape[0] != batch:
            fail_value(op, "seq_starts", f"of length batch = {batch}", f"length {st.shape[0]}")
    sc = _fp8_scale(op, kvd, kv_cache_dtype, scale, s, "src_cache")
    C.writable(op, {"dst": d})
    C.no_overlap(op, {"dst": d}, {"src_cache": s, "block_table": bt, "cu_seq_lens": cu,
                                  "seq_starts": st, "scale": sc})
    if C.flag(op, "check_indices", check_indices):
        C.assert_in_range(op, "block_table", bt, 0, s.shape[0] - 1,
                          meaning=f"(blocks of src_cache: num_blocks = {s.shape[0]})",
                          stream=stream)
    if batch == 0 or d.size == 0 or s.shape[1] == 0:
        return dst
    if s.ndim == 3:  # [NB, B, E] as [NB, B, 1, E]
        s = s.view((s.shape[0], s.shape[1], 1, s.shape[2]), (s.strides[0], s.strides[1],
                                                             s.shape[2], 1))
        d = d.view((d.shape[0], 1, d.shape[1]), (d.strides[0], d.shape[1], 1))
    D = s.shape[3]
    if kvd == "auto":
        vec = (D * s.itemsize) % 16 == 0 and C.vectors_ok(s, d)
        spec = GatherSpec("uint32" if vec else np.dtype(storage_dtype(s.kind)).name, "auto",
                          "vector" if vec else "scalar")
        units = D * s.itemsize // 16 if vec else D
    else:
        vec = D % 8 == 0 and C.vectors_ok(d) and C.vectors_ok(s, unit=8)
        spec = GatherSpec(d.kind, kvd, "vector" if vec else "scalar")
        units = D // 8 if vec else D
    per_row = d.shape[1] * units
    # rows a thread block: enough to amortise its binary searches, few enough for ~256 blocks
    rows = max(1, min(MAX_ROWS, d.shape[0] // GATHER_BLOCKS))
    threads = L.forced_threads() or min(MAX_THREADS, L.whole_warps(rows * per_row))
    params = [L.array(s, words=vec), L.array(d, words=vec), L.array(bt), L.array(cu),
              L.array(st) if st is not None else L.absent("int32", 1),
              L.array(sc) if sc is not None else L.absent("float32", 1),
              L.i64(batch), L.i64(rows)]
    grid = -(-d.shape[0] // rows)
    L.launch(gather_kernel, spec, grid, threads, params, like=s, stream=stream, key=launch_key)
    return dst


# ------------------------------------------------------------------------------ MLA
@torch_op("Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
          "str kv_cache_dtype, Tensor? scale, *, bool check_indices=False", returns=("kv_cache",))
def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, *,
                         check_indices=False, stream=None, launch_key=None):
    """DeepSeek MLA's cache write: each token's latent ``kv_c`` and rotary key ``k_pe``, side
    by side in its cache slot.

    For ``t < num_tokens = slot_mapping.shape[0]`` with ``slot = slot_mapping[t] >= 0``,
    ``block, offset = slot // block_size, slot % block_size``::

        kv_cache[block, offset, :kv_lora_rank] = cv(kv_c[t])
        kv_cache[block, offset, kv_lora_rank:] = cv(k_pe[t])

    ``cv`` copies the bits (``"auto"``) or stores ``fp8(f(x) / scale)`` -- IEEE float32
    division, round to nearest even, saturating, NaN kept (0x7F), the sign of zero kept (as
    :func:`loomnb.reshape_and_cache_flash`). A negative slot writes nothing.

    Args:
        kv_c: ``[num_tokens_padded, kv_lora_rank]`` bf16/fp16/fp32, last dimension
            contiguous, any row stride (a slice of a projection's output).
        k_pe: ``[num_tokens_padded, pe_dim]`` or ``[num_tokens_padded, 1, pe_dim]``, kv_c's
            dtype, last dimension contiguous.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + pe_dim]``, any strides, last
            dimension contiguous; kv_c's dtype for ``"auto"``, else ``uint8`` or the FP8 dtype.
        slot_mapping: int64 ``[num_tokens]``, ``num_tokens <= num_tokens_padded``; each -1 or
            below ``num_blocks * block_size`` (unchecked device writes unless
            ``check_indices=True``), distinct.
        kv_cache_dtype: ``"auto"``, ``"fp8"`` (= ``"fp8_e4m3"``), ``"fp8_e4m3"``, ``"fp8_e5m2"``
            (vLLM's ``"fp8_ds_mla"`` layout is not supported).
        scale: float32, one element, on the device (required for FP8; may be None for
            ``"auto"``).
        check_indices: opt-in check of ``slot_mapping`` without a host synchronisation.
        stream: CUDA stream; default the caller's current stream.

    Returns ``kv_cache``. Mutates: ``kv_cache`` (the slots of ``slot_mapping`` only).

    Raises ``LoomnbTypeError`` / ``LoomnbValueError`` naming the argument before any launch.
    Zero tokens is a no-op.

    Matches vLLM 0.24's ``concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping,
    kv_cache_dtype, scale)``, byte for byte.
    """
    op = "loomnb.concat_and_cache_mla"
    C.choice(op, "kv_cache_dtype", kv_cache_dtype, C.KV_CACHE_DTYPES)
    kvd = _KV[kv_cache_dtype]
    c = ad.wrap(op, "kv_c", kv_c)
    check_kind(op, "kv_c", c, KINDS)
    if c.ndim != 2:
        fail_value(op, "kv_c", "2-D [num_tokens, kv_lora_rank]",
                   f"a {c.ndim}-D array of shape {list(c.shape)}")
    p = ad.wrap(op, "k_pe", k_pe)
    check_same_kind(op, "k_pe", p, "kv_c", c)
    check_same_device(op, "k_pe", p, "kv_c", c)
    if p.ndim == 3 and p.shape[1] == 1:
        p = p.view((p.shape[0], p.shape[2]), (p.strides[0], p.strides[2]))
    if p.ndim != 2 or p.shape[0] != c.shape[0]:
        fail_value(op, "k_pe", f"[{c.shape[0]}, pe_dim] or [{c.shape[0]}, 1, pe_dim] (kv_c's "
                   "tokens)", f"shape {list(ad.wrap(op, 'k_pe', k_pe).shape)}")
    Lr, P = c.shape[1], p.shape[1]
    kc = ad.wrap(op, "kv_cache", kv_cache)
    check_same_device(op, "kv_cache", kc, "kv_c", c)
    check_kind(op, "kv_cache", kc, (c.kind,) if kvd == "auto" else _CACHE_KINDS[kvd])
    if kc.ndim != 3 or kc.shape[2] != Lr + P:
        fail_value(op, "kv_cache", f"3-D [num_blocks, block_size, kv_lora_rank + pe_dim = "
                   f"{Lr + P}]", f"shape {list(kc.shape)}")
    _last_contiguous(op, {"kv_c": c, "k_pe": p, "kv_cache": kc})
    sl = _index_array(op, "slot_mapping", slot_mapping, c, "kv_c", ndim=1)
    if sl.shape[0] > c.shape[0]:
        fail_value(op, "slot_mapping", f"of length at most {c.shape[0]} (kv_c's tokens)",
                   f"length {sl.shape[0]}")
    sc = _fp8_scale(op, kvd, kv_cache_dtype, scale, c, "kv_c")
    if kvd == "auto" and scale is not None:
        C.one_element(op, "scale", scale, c, like_name="kv_c")
    C.writable(op, {"kv_cache": kc})
    C.no_overlap(op, {"kv_cache": kc}, {"kv_c": c, "k_pe": p, "slot_mapping": sl, "scale": sc})
    if C.flag(op, "check_indices", check_indices):
        n = kc.shape[0] * kc.shape[1]
        C.assert_in_range(op, "slot_mapping", sl, 0, n - 1, allow=-1,
                          meaning=f"(slots of num_blocks * block_size = {n})", stream=stream)
    if sl.shape[0] == 0 or Lr + P == 0:
        return kv_cache
    isz = c.itemsize
    if kvd == "auto":
        vec = (Lr * isz) % 16 == 0 and (P * isz) % 16 == 0 and C.vectors_ok(c, p, kc)
    else:
        vec = (c.kind != "f32" and Lr % 8 == 0 and P % 8 == 0 and C.vectors_ok(c, p)
               and C.vectors_ok(kc, unit=8))
    spec = MlaSpec(c.kind, kvd, "vector" if vec else "scalar")
    uc, up = (Lr * isz // 16, P * isz // 16) if vec else (Lr, P)
    threads = L.forced_threads() or min(MAX_THREADS, L.whole_warps(uc + up))
    params = [L.array(c, words=vec), L.array(p, words=vec), L.array(kc, words=vec), L.array(sl),
              L.array(sc) if sc is not None else L.absent("float32", 1), L.i64(uc), L.i64(up)]
    L.launch(mla_kernel, spec, sl.shape[0], threads, params, like=c, stream=stream,
             key=launch_key)
    return kv_cache
