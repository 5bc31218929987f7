"""KV-cache movement kernels: block copies (one launch for every cache of every layer), the
in-place compaction's chains, the page gather and MLA's cache write.

**Block copies** (:func:`block_copy_kernel`, ``copy_blocks``, ``swap_blocks`` and the first
pass of ``compact_blocks``). Every cache a call touches is seen through one 1-D *arena*: the
memory from the lowest address of all of them, in elements of ``spec.unit`` bytes (16, 8, 4, 2
or 1: the largest that divides every address, block stride and block size; 16 and 8 move as
one vector load/store of 4 or 2 ``uint32`` words). A table ``desc [num_caches, 5]`` (int64, in
units) gives each cache's ``(src_start, src_block_stride, dst_start, dst_block_stride,
block_units)``: block ``s`` of cache ``c`` is ``arena[src_start + s * src_block_stride :
+ block_units]``. ``copy_blocks`` reads and writes one arena; ``swap_blocks`` reads one (the
source tensor, on the GPU or in pinned host memory, reached through unified addressing) and
writes another. Thread block ``(pair, cache)`` copies ``block_units`` units from block
``mapping[pair, 0]`` to block ``mapping[pair, 1]``; each thread keeps ``ILP`` loads in flight
before its stores. A row with a negative entry copies nothing (a padding row).

**Chains** (:func:`chain_kernel`, the second pass of ``compact_blocks``). The host splits the
permutation's cycles into *segments* of consecutive cycle members ``c_a .. c_{b-1}``; each
does ``c_a <- c_{a+1}, ..., c_{b-2} <- c_{b-1}`` and then ``c_{b-1} <- the old c_b``, which is
either in the workspace (saved there by the first pass, a block copy) or, for a segment that
is a whole cycle (``ws < 0``), ``c_a`` itself, read before anything is written. Each thread
moves the same units of every block of its segment, so no thread reads what another writes:
no barrier, and the units stay in registers between the first read and the last write.

**Gather** (:func:`gather_kernel`): thread block ``i`` fills ``dst`` rows ``[i * rows, (i+1) *
rows)``; its first threads find each row's sequence (a binary search of ``cu_seq_lens``), page
and offset, then every thread moves 16-byte units (``"vector"``) or elements (``"scalar"``) of
the rows. ``"auto"`` copies bits; an FP8 cache gives ``r(f32(code) * scale)``.

**MLA cache write** (:func:`mla_kernel`): thread block ``t`` writes token ``t``:
``kv_cache[slot] = cv([kv_c[t], k_pe[t]])``, ``cv`` the bits or ``fp8(f32(x) /
scale)``; slots < 0 skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from numba import cuda, float32, int64

from .._dtypes import storage_dtype
from .._numba_internals import device
from ..layouts.dtypes import f32_bits
from . import _launch as L
from ._fp8 import kv_decoder, kv_encoder, kv_packer, kv_pair_decoder
from ._vector import CODECS, load_u32x2, load_u32x4, store_u32x2, store_u32x4

UNITS = (16, 8, 4, 2, 1)      # bytes a block copy moves per element of its arena
ILP = 4                       # units a thread loads before it stores
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
KINDS = ("bf16", "f16", "f32")
AUTO_STORAGE = ("uint8", "uint16", "float32")  # element storage of a scalar "auto" gather
MAX_ROWS = 32                 # rows a gather or MLA thread block handles at most
UNIT = 8                      # elements of a vector unit (16 bytes of bf16/fp16, 8 of FP8)


def unit_storage(unit):
    """The arena's element dtype for ``unit`` bytes."""
    return {16: "uint32", 8: "uint32", 4: "uint32", 2: "uint16", 1: "uint8"}[unit]


def unit_words(unit):
    """Arena elements per unit."""
    return unit // 4 if unit >= 4 else 1


def _unit_io(unit):
    """``(load(a, i), store(a, i, v), move(src, sb, dst, db, u0, nt, n))``: unit ``i`` of arena
    ``a``, and a thread's move of units ``u0 + k * nt`` (``k < ILP``, those below ``n``) from
    ``src[sb + u]`` to ``dst[db + u]``, every load issued before the first store."""
    if unit == 16:
        @device
        def load(a, i):
            return load_u32x4(a, i << 2)

        @device
        def store(a, i, v):
            store_u32x4(a, i << 2, v)
    elif unit == 8:
        @device
        def load(a, i):
            return load_u32x2(a, i << 1)

        @device
        def store(a, i, v):
            store_u32x2(a, i << 1, v)
    else:
        @device
        def load(a, i):
            return a[i]

        @device
        def store(a, i, v):
            a[i] = v

    @device
    def move(src, sb, dst, db, u0, nt, n):
        u1 = u0 + nt
        u2 = u1 + nt
        u3 = u2 + nt
        v0 = load(src, sb + u0)
        v1 = load(src, sb + u1) if u1 < n else v0
        v2 = load(src, sb + u2) if u2 < n else v0
        v3 = load(src, sb + u3) if u3 < n else v0
        store(dst, db + u0, v0)
        if u1 < n:
            store(dst, db + u1, v1)
        if u2 < n:
            store(dst, db + u2, v2)
        if u3 < n:
            store(dst, db + u3, v3)

    return load, store, move


# ------------------------------------------------------------------------------ block copies
@dataclass(frozen=True)
class BlockCopySpec:
    unit: int  # bytes per arena element: UNITS

    def __post_init__(self):
        assert self.unit in UNITS


def block_copy_argtypes(spec):
    a = L.array_type
    s = unit_storage(spec.unit)
    return (a(s, 1), a(s, 1), a("int64", 2), a("int64", 2), L.i64(0).numba_type)


def block_copy_kernel(spec):
    """The ``@cuda.jit`` function for ``spec`` (module docstring): ``(src, dst, desc, mapping,
    num_caches)``, one thread block per ``(pair, cache)``."""
    _, _, move = _unit_io(spec.unit)

    def kernel(src, dst, desc, mapping, num_caches):
        cta = int64(cuda.blockIdx.x)
        p = cta // num_caches
        c = cta - p * num_caches
        s = mapping[p, 0]
        d = mapping[p, 1]
        if s < 0 or d < 0:
            return
        sb = desc[c, 0] + s * desc[c, 1]
        db = desc[c, 2] + d * desc[c, 3]
        n = desc[c, 4]
        nt = int64(cuda.blockDim.x)
        for u0 in range(int64(cuda.threadIdx.x), n, nt * ILP):
            move(src, sb, dst, db, u0, nt, n)

    kernel.__name__ = f"kv_block_copy_u{spec.unit}"
    return kernel


# ------------------------------------------------------------------------------ chains
@dataclass(frozen=True)
class ChainSpec:
    unit: int  # as BlockCopySpec

    def __post_init__(self):
        assert self.unit in UNITS


def chain_argtypes(spec):
    a = L.array_type
    return (a(unit_storage(spec.unit), 1), a("int64", 2), a("int64", 1), a("int64", 2),
            L.i64(0).numba_type)


def chain_kernel(spec):
    """The ``@cuda.jit`` function for ``spec``: ``(arena, desc, chain, segments,
    num_caches)``; thread block ``(segment, cache)`` runs one segment of a cycle (module
    docstring). ``segments [S, 3]``: ``(first index into chain, length, workspace slot or
    -1)``; ``desc`` as the block copy's, its ``dst`` columns the workspace's (slot ``w`` of
    cache ``c`` at ``dst_start + w * dst_block_stride``)."""
    load, store, move = _unit_io(spec.unit)

    def kernel(arena, desc, chain, segments, num_caches):
        cta = int64(cuda.blockIdx.x)
        g = cta // num_caches
        c = cta - g * num_caches
        a = segments[g, 0]
        length = segments[g, 1]
        w = segments[g, 2]
        start = desc[c, 0]
        stride = desc[c, 1]
        n = desc[c, 4]
        head = desc[c, 2] + w * desc[c, 3] if w >= 0 else start + chain[a] * stride
        last = start + chain[a + length - 1] * stride
        nt = int64(cuda.blockDim.x)
        for u0 in range(int64(cuda.threadIdx.x), n, nt * ILP):
            u1 = u0 + nt
            u2 = u1 + nt
            u3 = u2 + nt
            t0 = load(arena, head + u0)
            t1 = load(arena, head + u1) if u1 < n else t0
            t2 = load(arena, head + u2) if u2 < n else t0
            t3 = load(arena, head + u3) if u3 < n else t0
            for j in range(length - 1):
                move(arena, start + chain[a + j + 1] * stride, arena,
                     start + chain[a + j] * stride, u0, nt, n)
            store(arena, last + u0, t0)
            if u1 < n:
                store(arena, last + u1, t1)
            if u2 < n:
                store(arena, last + u2, t2)
            if u3 < n:
                store(arena, last + u3, t3)

    kernel.__name__ = f"kv_chain_u{spec.unit}"
    return kernel


# ------------------------------------------------------------------------------ gather
@dataclass(frozen=True)
class GatherSpec:
    kind: str            # "auto": the element storage (AUTO_STORAGE, "uint32" for "vector");
    #                      FP8: the dst dtype (KINDS)
    kv: str = "auto"     # KV_DTYPES
    layout: str = "scalar"  # "vector" (16-byte units of dst) or "scalar" (elements)

    def __post_init__(self):
        assert self.kv in KV_DTYPES and self.layout in ("vector", "scalar")
        auto = ("uint32",) if self.layout == "vector" else AUTO_STORAGE
        assert self.kind in (auto if self.kv == "auto" else KINDS)


def gather_argtypes(spec):
    a = L.array_type
    vec = spec.layout == "vector"
    if spec.kv == "auto":
        src = dst = "uint32" if vec else spec.kind
    else:
        src = "uint32" if vec else "uint8"
        dst = "uint32" if vec else storage_dtype(spec.kind)
    return (a(src, 4), a(dst, 3), a("int32", 2), a("int32", 1), a("int32", 1), a("float32", 1),
            L.i64(0).numba_type, L.i64(0).numba_type)


def _row_mover(spec):
    """``move(srow, drow, u, scale)``: unit ``u`` of a page row to a dst row (``spec``)."""
    vec, FP8 = spec.layout == "vector", spec.kv != "auto"
    if not FP8:
        if vec:
            @device
            def move(srow, drow, u, scale):
                store_u32x4(drow, u << 2, load_u32x4(srow, u << 2))
        else:
            @device
            def move(srow, drow, u, scale):
                drow[u] = srow[u]
        return move
    dec = kv_decoder(spec.kv)
    F32 = spec.kind == "f32"
    enc = CODECS[spec.kind].encode
    pack = CODECS[spec.kind].pack
    if not vec:
        @device
        def move(srow, drow, u, scale):
            v = dec(srow[u], scale)
            drow[u] = v if F32 else enc(v)
        return move

    dec2 = kv_pair_decoder(spec.kv)

    @device
    def move(srow, drow, u, scale):
        w = load_u32x2(srow, u << 1)  # 8 codes
        lo = int(w[0])
        hi = int(w[1])
        v0, v1 = dec2(lo, scale)
        v2, v3 = dec2(lo >> 16, scale)
        v4, v5 = dec2(hi, scale)
        v6, v7 = dec2(hi >> 16, scale)
        if F32:
            store_u32x4(drow, u << 3, (f32_bits(v0), f32_bits(v1), f32_bits(v2), f32_bits(v3)))
            store_u32x4(drow, (u << 3) + 4,
                        (f32_bits(v4), f32_bits(v5), f32_bits(v6), f32_bits(v7)))
        else:
            store_u32x4(drow, u << 2, (pack(v1, v0), pack(v3, v2), pack(v5, v4), pack(v7, v6)))

    return move


def gather_kernel(spec):
    """The ``@cuda.jit`` function for ``spec``: ``(src_cache, dst, block_table, cu_seq_lens,
    seq_starts, scale, batch, rows)``; units per head: ``units = dst.shape[2] // (4 or 8)``
    (vector; in the dst's words) or the head's elements (scalar)."""
    move = _row_mover(spec)
    FP8 = spec.kv != "auto"
    vec = spec.layout == "vector"
    SHIFT = (3 if spec.kind == "f32" else 2) if (FP8 and vec) else (2 if vec else 0)

    def kernel(src, dst, block_table, cu, starts, scale, batch, rows):
        sblk = cuda.shared.array(MAX_ROWS, int64)
        soff = cuda.shared.array(MAX_ROWS, int64)
        r0 = int64(cuda.blockIdx.x) * rows
        tid = int64(cuda.threadIdx.x)
        if tid < rows:
            r = r0 + tid
            blk = int64(-1)
            off = int64(0)
            if r < dst.shape[0] and r < cu[batch]:
                lo = int64(0)
                hi = batch
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if cu[mid] <= r:
                        lo = mid
                    else:
                        hi = mid
                pos = r - cu[lo]
                if starts.shape[0] > 0:
                    pos += starts[lo]
                B = int64(src.shape[1])
                bi = pos // B
                blk = int64(block_table[lo, bi])
                off = pos - bi * B
            sblk[tid] = blk
            soff[tid] = off
        cuda.syncthreads()
        sc = scale[0] if FP8 else float32(1)
        H = int64(dst.shape[1])
        U = int64(dst.shape[2]) >> SHIFT
        per_row = H * U
        nt = int64(cuda.blockDim.x)
        for i in range(tid, rows * per_row, nt):
            j = i // per_row
            blk = sblk[j]
            if blk < 0:
                continue
            rem = i - j * per_row
            h = rem // U
            u = rem - h * U
            move(src[blk, soff[j], h], dst[r0 + j, h], u, sc)

    kernel.__name__ = f"kv_gather_{spec.kind}_{spec.kv}_{spec.layout}"
    return kernel


# ------------------------------------------------------------------------------ MLA write
@dataclass(frozen=True)
class MlaSpec:
    kind: str               # activation dtype of kv_c / k_pe: KINDS
    kv: str = "auto"        # KV_DTYPES
    layout: str = "scalar"  # "vector" (16-byte units of the activations) or "scalar"

    def __post_init__(self):
        assert self.kind in KINDS and self.kv in KV_DTYPES and self.layout in ("vector", "scalar")
        assert not (self.layout == "vector" and self.kv != "auto" and self.kind == "f32")


def mla_argtypes(spec):
    a = L.array_type
    vec = spec.layout == "vector"
    act = "uint32" if vec else storage_dtype(spec.kind)
    cache = "uint32" if vec else ("uint8" if spec.kv != "auto" else storage_dtype(spec.kind))
    return (a(act, 2), a(act, 2), a(cache, 3), a("int64", 1), a("float32", 1),
            L.i64(0).numba_type, L.i64(0).numba_type)


def mla_kernel(spec):
    """The ``@cuda.jit`` function for ``spec``: ``(kv_c, k_pe, kv_cache, slot_mapping, scale,
    units_c, units_pe)``, one thread block a token; ``units_*``: 16-byte units (vector: 8
    elements) or elements of ``kv_c``'s / ``k_pe``'s row, ``kv_c``'s first in the cache row."""
    vec, FP8 = spec.layout == "vector", spec.kv != "auto"
    enc = kv_encoder(spec.kv) if FP8 else None
    packw = kv_packer(spec.kv) if FP8 else None
    dec = CODECS[spec.kind].decode
    unpack = CODECS[spec.kind].unpack

    @device
    def put(src, crow, u, cu, sc, vals):
        """Unit (element) ``u`` of activation row ``src`` to unit ``cu`` of the cache row."""
        if not FP8:
            if vec:
                store_u32x4(crow, cu << 2, load_u32x4(src, u << 2))
            else:
                crow[cu] = src[u]
        elif vec:
            w = load_u32x4(src, u << 2)
            for k in range(4):
                lo, hi = unpack(w[k])
                vals[2 * k] = lo
                vals[2 * k + 1] = hi
            store_u32x2(crow, cu << 1, packw(vals, 0, sc))
        else:
            crow[cu] = enc(dec(src[u]), sc)

    def kernel(kv_c, k_pe, kv_cache, slots, scale, units_c, units_pe):
        vals = cuda.local.array(8, float32)
        t = int64(cuda.blockIdx.x)
        slot = slots[t]
        if slot < 0:
            return
        B = int64(kv_cache.shape[1])
        blk = slot // B
        crow = kv_cache[blk, slot - blk * B]
        sc = scale[0] if FP8 else float32(1)
        src_c = kv_c[t]
        src_p = k_pe[t]
        for u in range(int64(cuda.threadIdx.x), units_c + units_pe, int64(cuda.blockDim.x)):
            if u < units_c:
                put(src_c, crow, u, u, sc, vals)
            else:
                put(src_p, crow, u - units_c, u, sc, vals)

    kernel.__name__ = f"kv_mla_{spec.kind}_{spec.kv}_{spec.layout}"
    return kernel


# ------------------------------------------------------------------------------ variants
def mla_layouts(kind, kv):
    return ("scalar",) if (kind == "f32" and kv != "auto") else ("vector", "scalar")


def variants():
    """Every ``(factory, spec, argtypes)`` the family's ops can launch (the PTX test compiles
    them all): block copies and chains of every unit, gathers (bit copies of every element
    size, FP8 dequantisation to every dtype; both layouts) and MLA writes (every dtype and
    kv_cache_dtype; both layouts where they exist)."""
    out = []
    for u in UNITS:
        out.append((block_copy_kernel, BlockCopySpec(u), block_copy_argtypes(BlockCopySpec(u))))
        out.append((chain_kernel, ChainSpec(u), chain_argtypes(ChainSpec(u))))
    for s in ("uint32",) + AUTO_STORAGE:
        spec = GatherSpec(s, "auto", "vector" if s == "uint32" else "scalar")
        out.append((gather_kernel, spec, gather_argtypes(spec)))
    for layout in ("vector", "scalar"):
        for kind in KINDS:
            for kv in KV_DTYPES[1:]:
                spec = GatherSpec(kind, kv, layout)
                out.append((gather_kernel, spec, gather_argtypes(spec)))
    for kind in KINDS:
        for kv in KV_DTYPES:
            for layout in mla_layouts(kind, kv):
                spec = MlaSpec(kind, kv, layout)
                out.append((mla_kernel, spec, mla_argtypes(spec)))
    return out
