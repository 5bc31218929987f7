"""MoE routing and movement kernels: top-k routing (softmax or sigmoid scores, a correction
bias, DeepSeek's grouped selection), the align-to-block sort, the row gather into expert order
(optionally FP8-quantised), the weighted combine back, and vLLM's ``moe_sum``.

**Routing** (:func:`route_kernel`): one warp a token, no barrier. Lane ``l`` holds experts
``l * VPL .. l * VPL + VPL - 1`` (``VPL = spec.vpl``) in registers: the float32 scores ``p``
(softmax: ``e = expf(x - m)`` with the warp's NaN-ignoring max ``m``, a float64 warp sum
``S``, ``p = r32(e * r32(1 / S))``; sigmoid: ``r32(1 / r32(1 + expf(-x)))``) and each
candidate as an ordered key (:func:`~loomnb.ops._reduce.order_key`) of its selection score
``s = r32(p + bias)`` and its index: NaN largest, the lowest expert winning ties. Grouped
routing first scores each group (its best, or with a bias the sum of its best two: one
butterfly over a group's lanes when a lane's experts share a group, else one warp pass a
group) and keeps ``topk_group`` groups; then ``k`` rounds of a 64-bit warp max pick the
experts, the owner lane clearing its key and broadcasting its unbiased ``p`` (lane ``j``
keeps pick ``j``, renormalised by the float32 sum of the picks in order, then scaled).
Products go through :func:`mul_rn` so no FMA contracts them.

**Align** (:func:`align_kernel`, two passes over ``C`` chunks of the flat ``topk_ids``;
one fused launch when ``C == 1``). Pass ``count``: thread block ``c`` counts its chunk's
experts (shared-memory atomics: exact) into ``counts[c, :]``; the last block to finish (a
ticket on the stream's split counters) sums the columns, pads each expert's count to the block
size, scans them (``offsets``), and writes ``num_tokens_post_pad``, ``expert_ids`` (every
block; -1 past the segments) and the sentinel ``N`` at every position no token takes. Pass
``place``: block ``c`` starts expert ``e`` at ``offsets[e] + sum(counts[:c, e])`` and places
its chunk in tiles of ``blockDim`` ids: an id's rank is the number of equal experts before it
in its warp (``match.any``) plus those of the earlier warps (per-warp counts in shared
memory), so every segment lists its flat indices in ascending order -- the same result at any
size, grid or thread count.

**Rows** (:func:`rows_kernel`): a grid of ``(rows, splits)`` thread blocks, each a slice of
one destination row; ``"permute"`` gathers ``hidden_states[sorted_token_ids[p] // topk]``
(zeros for a sentinel) as bits, ``"permute_fp8"`` (one block a row) as FP8 E4M3 codes with the
row's dynamic per-token scale; ``"combine"`` sums ``r32(w * f(y))`` of a token's ``k`` expert
rows in float32 (``y`` found through the inverse map that :func:`inverse_kernel` scatters
first, checked against ``sorted_token_ids``); ``"sum"`` is ``moe_sum``. Rows are read as
16-byte units (``"vector"``) when every row allows, else element by element.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from .._dtypes import storage_dtype
from .._numba_internals import SIM, device
from ..layouts.dtypes import bits_f32 as _bits_f32
from ..layouts.dtypes import f32_bits as _f32_bits
from ..layouts.dtypes import f32_to_e4m3, pack_e4m3x2
from . import _launch as L
from ._activation_kernels import expf
from ._fp8 import clamp_fp8, div_rn, scale_from_amax
from ._reduce import (FULL_MASK, REDUCE_SCRATCH, block_max, block_scan, fadd, fmax_nan, fmaxf,
                      group_max_u64, group_reduce, group_top2_u64, key_index, key_value,
                      lane_broadcast, order_key, umax)
from ._vector import CODECS, load_u32x4, store_u32x2, store_u32x4

KINDS = ("bf16", "f16", "f32")
SCORES = ("softmax", "sigmoid")
ROUTE_WARPS = 4          # tokens (warps) a routing thread block handles
MAX_EXPERTS = 1024
MAX_TOPK = 32
VPLS = (1, 2, 4, 8, 16, 32)  # experts a lane holds: ceil(E / 32) rounded up to a power of two
ALIGN_THREADS = 256
ALIGN_WARPS = ALIGN_THREADS // 32
ROW_UNITS = {"bf16": 8, "f16": 8, "f32": 4}  # elements of a 16-byte unit
CHUNK = 4                # expert rows a combine / moe_sum thread loads before it adds them
KEEP = 2                 # units an FP8 permute thread keeps in registers (the rest re-read)
_BUF_N = CHUNK * 8       # a row thread's staged values
_CNT_N = MAX_EXPERTS + 1           # shared counts / offsets of the align
_WC_N = ALIGN_WARPS * MAX_EXPERTS  # shared per-warp counts of the align

NEG_INF = float32(-np.inf)
ZERO = float32(0)
ONE = float32(1)

if SIM:
    @device
    def mul_rn(a, b):
        """``r32(a * b)``, never contracted into an FMA."""
        return np.float32(np.float32(a) * np.float32(b))
else:
    from numba.cuda import libdevice

    @device
    def mul_rn(a, b):
        """``r32(a * b)`` (``__fmul_rn``), never contracted into an FMA."""
        return libdevice.fmul_rn(a, b)


def vpl_for(num_experts):
    """Experts a lane holds for ``num_experts`` (a power of two, at least 1)."""
    need = -(-num_experts // 32)
    return next(v for v in VPLS if v >= need)


# ------------------------------------------------------------------------------ routing
@dataclass(frozen=True)
class RouteSpec:
    kind: str               # KINDS: gating_output's dtype
    score: str = "softmax"  # SCORES
    vpl: int = 4            # VPLS

    def __post_init__(self):
        assert self.kind in KINDS and self.score in SCORES and self.vpl in VPLS


# runtime flags of a routing launch (one int64 parameter)
F_BIAS, F_GROUPED, F_RENORM, F_SCALED, F_TEI = 1, 2, 4, 8, 16


def route_argtypes(spec):
    a = L.array_type
    i = L.i64(0).numba_type
    return (a(storage_dtype(spec.kind), 2), a("float32", 1), a("float32", 2), a("int32", 2),
            a("int32", 2), i, i, i, i, L.f32(0).numba_type, i)


def route_kernel(spec):
    """``(logits, bias, weights, ids, tei, E, k, G, topk_group, scale, flags)``: one warp a
    token (``flags``: ``F_*`` bits), ``ROUTE_WARPS`` (or fewer) warps a block; a warp past the
    last token routes the last token again (every thread of a block takes part in the
    reductions) and stores nothing. Lane ``l`` holds experts ``l * VPL .. l * VPL + VPL - 1``;
    candidates are :func:`~loomnb.ops._reduce.order_key` keys (0: none)."""
    dec = CODECS[spec.kind].decode
    VPL, SOFTMAX = spec.vpl, spec.score == "softmax"
    wmax = group_reduce(fmax_nan, 32)
    wsum = group_reduce(fadd, 32)
    wkey = group_max_u64(32)

    @device
    def pair(keys, grp, g):
        """This lane's two largest keys (of group ``g`` when ``g >= 0``)."""
        a, b = uint64(0), uint64(0)
        for v in range(VPL):
            x = keys[v]
            if g < 0 or grp[v] == g:
                if x > a:
                    a, b = x, a
                elif x > b:
                    b = x
        return a, b

    @device
    def group_score(a, b, BIAS):
        if a == 0:
            return NEG_INF
        return key_value(a) + key_value(b) if BIAS else key_value(a)

    def kernel(logits, bias, weights, ids, tei, E, k, G, topk_group, scale, flags):
        BIAS, GROUPED = (flags & F_BIAS) != 0, (flags & F_GROUPED) != 0
        RENORM, SCALED, TEI = (flags & F_RENORM) != 0, (flags & F_SCALED) != 0, (flags & F_TEI) != 0
        p = cuda.local.array(VPL, float32)
        keys = cuda.local.array(VPL, uint64)
        grp = cuda.local.array(VPL, int32)
        tid = int64(cuda.threadIdx.x)
        lane, warp = tid & 31, tid >> 5
        M = int64(logits.shape[0])
        t = int64(cuda.blockIdx.x) * (int64(cuda.blockDim.x) >> 5) + warp
        live = t < M
        if not live:
            t = M - 1
        row = logits[t]
        e0 = int32(lane * VPL)
        E32 = int32(E)
        m = NEG_INF
        for v in range(VPL):
            e = e0 + v
            x = dec(row[e]) if e < E32 else NEG_INF
            p[v] = x
            if SOFTMAX:
                m = fmax_nan(m, x)
        if SOFTMAX:
            m = wmax(m)
            acc = float64(0)
            for v in range(VPL):
                if e0 + v < E32:
                    ev = expf(p[v] - m)
                    p[v] = ev
                    acc += float64(ev)
            inv = ONE / float32(wsum(acc))
            for v in range(VPL):
                p[v] = mul_rn(p[v], inv)
        else:
            for v in range(VPL):
                p[v] = ONE / (ONE + expf(-p[v]))
        for v in range(VPL):
            e = e0 + v
            keys[v] = uint64(0)
            if e < E32:
                keys[v] = order_key(p[v] + bias[e] if BIAS else p[v], e)
        if GROUPED:
            gsize = E32 // int32(G)
            for v in range(VPL):
                grp[v] = (e0 + v) // gsize
            lpg = gsize // VPL  # lanes a group when every lane's experts share one group
            gkey = uint64(0)
            if gsize % VPL == 0 and (lpg & (lpg - 1)) == 0 and lpg <= 32:
                a, b = pair(keys, grp, -1)
                a, b = group_top2_u64(a, b, lpg)  # the butterfly over the group's lanes
                g = int64(grp[0])
                if (lane & (lpg - 1)) == 0 and e0 < E32:
                    gkey = order_key(group_score(a, b, BIAS), g)
            else:
                for g in range(G):
                    a, b = pair(keys, grp, g)
                    a, b = group_top2_u64(a, b, 32)
                    if lane == g:
                        gkey = order_key(group_score(a, b, BIAS), g)
            mask = int64(0)
            for r in range(topk_group):
                best = wkey(gkey)
                g = key_index(best)
                mask |= int64(1) << g
                if gkey == best:
                    gkey = uint64(0)
            for v in range(VPL):
                if ((mask >> int64(grp[v])) & 1) == 0:
                    keys[v] = uint64(0)
        myw, myid = ZERO, int32(0)
        d = ZERO
        for j in range(k):
            a = uint64(0)
            for v in range(VPL):
                a = umax(a, keys[v])
            best = wkey(a)
            e = key_index(best)
            pv = ZERO
            for v in range(VPL):
                if keys[v] == best:
                    keys[v] = uint64(0)
                    pv = p[v]
            pv = lane_broadcast(pv, int32(e // VPL))  # the owner's unbiased p
            d = d + pv
            if lane == j:
                myw, myid = pv, int32(e)
        if live and lane < k:
            w = myw
            if RENORM:
                w = w / (d if d != ZERO else ONE)
            if SCALED:
                w = mul_rn(w, scale)
            weights[t, lane] = w
            ids[t, lane] = myid
            if TEI:
                tei[t, lane] = int32(lane * M + t)

    kernel.__name__ = f"moe_route_{spec.kind}_{spec.score}_v{VPL}"
    return kernel


# ------------------------------------------------------------------------------ align
@dataclass(frozen=True)
class AlignSpec:
    ids: str               # "int32" or "int64": topk_ids' storage
    emap: bool = False     # expert_map given
    part: str = "count"    # "count" (+ the prefix), "place", or "fused" (one block: all)

    def __post_init__(self):
        assert self.ids in ("int32", "int64") and self.part in ("count", "place", "fused")


def align_argtypes(spec):
    a = L.array_type
    i = L.i64(0).numba_type
    return (a(spec.ids, 1), a("int32", 1), a("int32", 1), a("int32", 1), a("int32", 1),
            a("int32", 1), a("int32", 1), a("uint32", 1), i, i, i, i, i, i)


def align_kernel(spec):
    """``(ids, emap, sorted_ids, expert_ids, post_pad, counts, offsets, counters, N, E, bs,
    L, chunk, bshift)``: thread block ``c`` owns flat ids ``[c * chunk, (c + 1) * chunk)``;
    ``bshift = log2(bs)`` when ``bs`` is a power of two (else -1: divisions). Loops are
    ``while`` loops and the warp rank a ``match.any``: a 64-bit division (a range's trip count,
    an index by ``bs``) costs ~100 instructions, and these kernels are latency-bound."""
    PART, MAP = spec.part, spec.emap
    scan = block_scan(int32)

    @device
    def div_bs(a, bs, bshift):
        return a >> bshift if bshift >= 0 else a // bs

    @device
    def expert_of(ids, i, hi, E):
        e = int64(ids[i]) if i < hi else int64(-1)
        return e if (e >= 0 and e < E) else int64(-1)

    @device
    def prefix(tot, offs_sh, scratch, emap, sorted_ids, expert_ids, post_pad, offsets, N, E,
               bs, bshift, Lt, tid, nt):
        """Padded counts -> offsets (shared and, for the place pass, global), the padding
        sentinels, expert_ids and num_tokens_post_pad. ``tot[e]``: expert e's count."""
        carry = int32(0)
        base = int64(0)
        while base < E:
            e = base + tid
            v = int32(0)
            if e < E:
                v = int32(div_bs(int64(tot[e]) + bs - 1, bs, bshift) * bs)
            before, total = scan(v, scratch)
            if e < E:
                offs_sh[e] = carry + before
            carry += total
            cuda.syncthreads()
            base += nt
        if tid == 0:
            offs_sh[E] = carry
            post_pad[0] = carry
        cuda.syncthreads()
        e = tid
        while e < E:
            lo, hi = int64(offs_sh[e]), int64(offs_sh[e + 1])
            if PART == "count":
                offsets[e] = int32(lo)
            val = emap[e] if MAP else int32(e)
            b = div_bs(lo, bs, bshift)
            while b * bs < hi:
                expert_ids[b] = val
                b += 1
            q = lo + tot[e]
            while q < hi:
                sorted_ids[q] = int32(N)
                q += 1
            e += nt
        total = int64(carry)
        b = div_bs(total, bs, bshift) + tid
        while b * bs < Lt:
            expert_ids[b] = -1
            b += nt
        q = total + tid
        while q < Lt:
            sorted_ids[q] = int32(N)
            q += nt

    @device
    def warp_rank(te, e, tid, nt):
        """``(rank, count)``: the lanes of this warp before this one holding expert ``e``, and
        all of them (``match.any`` on the GPU; the tile in shared memory in the simulator)."""
        lane = tid & 31
        if SIM:
            w = tid >> 5
            r, cw = int64(0), int64(0)
            for q in range(32):
                if w * 32 + q < nt and te[w * 32 + q] == e:
                    cw += 1
                    if q < lane:
                        r += 1
            return r, cw
        m = cuda.match_any_sync(FULL_MASK, int32(e))
        return int64(cuda.popc(m & ((uint32(1) << uint32(lane)) - uint32(1)))), int64(cuda.popc(m))

    @device
    def place(ids, sorted_ids, run, te, wc, lo, hi, E, tid, nt):
        """Flat ids ``[lo, hi)`` to their positions, experts starting at ``run[e]``."""
        w = tid >> 5
        base = lo
        while base < hi:
            i = base + tid
            e = expert_of(ids, i, hi, E)
            if SIM:
                te[tid] = int32(e)
                cuda.syncthreads()
            r, cw = warp_rank(te, e, tid, nt)
            lead = e >= 0 and r == 0
            if lead:
                wc[w * E + e] = int32(cw)
            cuda.syncthreads()
            if e >= 0:
                pos = int64(run[e]) + r
                for w2 in range(w):
                    pos += wc[w2 * E + e]
                sorted_ids[pos] = int32(i)
            cuda.syncthreads()
            if lead:
                cuda.atomic.add(run, e, int32(cw))
            cuda.syncthreads()
            if lead:
                wc[w * E + e] = 0
            base += nt

    @device
    def column_sum(counts, e, E, n):
        """``sum(counts[c * E + e] for c < n)``, four loads in flight."""
        r = int64(0)
        c2 = int64(0)
        while c2 < n:
            a0 = counts[c2 * E + e]
            a1 = counts[(c2 + 1) * E + e] if c2 + 1 < n else 0
            a2 = counts[(c2 + 2) * E + e] if c2 + 2 < n else 0
            a3 = counts[(c2 + 3) * E + e] if c2 + 3 < n else 0
            r += int64(a0) + int64(a1) + int64(a2) + int64(a3)
            c2 += 4
        return r

    @device
    def zero(a, n, tid, nt):
        q = tid
        while q < n:
            a[q] = 0
            q += nt

    def kernel(ids, emap, sorted_ids, expert_ids, post_pad, counts, offsets, counters, N, E, bs,
               Lt, chunk, bshift):
        tid, nt = int64(cuda.threadIdx.x), int64(cuda.blockDim.x)
        c = int64(cuda.blockIdx.x)
        cnt = cuda.shared.array(_CNT_N, int32)
        offs_sh = cuda.shared.array(_CNT_N, int32)
        scratch = cuda.shared.array(REDUCE_SCRATCH, int32)
        te = cuda.shared.array(ALIGN_THREADS, int32)
        wc = cuda.shared.array(_WC_N, int32)
        last = cuda.shared.array(1, int32)
        lo = c * chunk
        hi = min(N, lo + chunk)
        if PART == "place":
            e = tid
            while e < E:
                cnt[e] = int32(int64(offsets[e]) + column_sum(counts, e, E, c))
                e += nt
            zero(wc, (nt >> 5) * E, tid, nt)
            cuda.syncthreads()
            place(ids, sorted_ids, cnt, te, wc, lo, hi, E, tid, nt)
            return
        zero(cnt, E, tid, nt)
        cuda.syncthreads()
        i = lo + tid
        while i < hi:
            e = expert_of(ids, i, hi, E)
            if e >= 0:
                cuda.atomic.add(cnt, e, 1)
            i += nt
        cuda.syncthreads()
        if PART == "count":
            e = tid
            while e < E:
                counts[c * E + e] = cnt[e]
                e += nt
            cuda.threadfence()
            cuda.syncthreads()
            if tid == 0:
                nb = uint32(cuda.gridDim.x)
                last[0] = 1 if cuda.atomic.inc(counters, 0, nb - uint32(1)) == nb - uint32(1) else 0
            cuda.syncthreads()
            if last[0] == 0:
                return
            cuda.threadfence()
            e = tid
            while e < E:
                cnt[e] = int32(column_sum(counts, e, E, int64(cuda.gridDim.x)))
                e += nt
            cuda.syncthreads()
        prefix(cnt, offs_sh, scratch, emap, sorted_ids, expert_ids, post_pad, offsets, N, E, bs,
               bshift, Lt, tid, nt)
        if PART == "fused":
            e = tid
            while e < E:
                cnt[e] = offs_sh[e]
                e += nt
            zero(wc, (nt >> 5) * E, tid, nt)
            cuda.syncthreads()
            place(ids, sorted_ids, cnt, te, wc, lo, hi, E, tid, nt)

    kernel.__name__ = f"moe_align_{spec.part}_{spec.ids}{'_map' if MAP else ''}"
    return kernel


# ------------------------------------------------------------------------------ rows
@dataclass(frozen=True)
class RowsSpec:
    kind: str               # KINDS: the rows' dtype
    op: str                 # "permute", "permute_fp8", "combine", "sum"
    layout: str = "vector"  # "vector" (16-byte units) or "scalar"
    round_each: bool = False  # "sum": round every add to the dtype (vLLM's kernel, k = 2..4)
    scale_ub: bool = False  # "permute_fp8": a scale_ub given

    def __post_init__(self):
        assert self.kind in KINDS and self.layout in ("vector", "scalar")
        assert self.op in ("permute", "permute_fp8", "combine", "sum")


def rows_argtypes(spec):
    """``(dst, src, idx, idx2, weights, scales, scale_ub, H, topk, N)``; ``dst``/``src`` are 2-D
    (``src`` 3-D ``[M, k, H]`` for ``"sum"``), as uint32 words in the vector layout."""
    a = L.array_type
    i = L.i64(0).numba_type
    vec = spec.layout == "vector"
    st = storage_dtype(spec.kind)
    src = a("uint32" if vec else st, 3 if spec.op == "sum" else 2)
    if spec.op == "permute_fp8":
        dst = a("uint32" if vec else "uint8", 2)
    else:
        dst = a("uint32" if vec else st, 2)
    return (dst, src, a("int32", 1), a("int32", 1), a("float32", 2), a("float32", 2),
            a("float32", 1), i, i, i)


def rows_kernel(spec):
    """One thread block a slice of a destination row: row ``blockIdx.x``, units ``blockIdx.y *
    blockDim.x + threadIdx.x + q * gridDim.y * blockDim.x``. ``permute``: ``dst[p] =
    src[idx[p] // topk]`` as bits (a zero row where ``idx[p]`` is not below ``N``);
    ``permute_fp8`` (one block a row: ``gridDim.y == 1``): the same row as E4M3 codes and its
    per-token scale in ``scales[p, 0]``, the first ``KEEP`` units a thread held in registers
    between the amax and the quantisation; ``combine``: ``dst[t] = r(sum_j r32(w[t, j] *
    f(src[idx[t * topk + j]])))`` (``idx``: the inverse map; an entry whose ``idx2`` does not
    point back adds nothing); ``sum``: ``dst[t] = moe_sum(src[t])``. ``H``: elements of a row.
    The ``topk`` rows of a unit are loaded ``CHUNK`` at a time before any is added (loads in
    flight), and added in order."""
    OP, VEC, KIND = spec.op, spec.layout == "vector", spec.kind
    codec = CODECS[KIND]
    dec, enc, rnd = codec.decode, codec.encode, codec.rnd
    unpack, pack = codec.unpack, codec.pack
    U = ROW_UNITS[KIND] if VEC else 1
    F32 = KIND == "f32"
    ROUND_EACH = spec.round_each
    UB = spec.scale_ub
    CH = CHUNK

    @device
    def load(row, u, vals, o):
        """Unit (element) ``u`` of ``row`` into ``vals[o:o+U]`` as float32."""
        if not VEC:
            vals[o] = dec(row[u])
        elif F32:
            w = load_u32x4(row, u << 2)
            for q in range(4):
                vals[o + q] = _bits_f32(w[q])
        else:
            w = load_u32x4(row, u << 2)
            for q in range(4):
                lo, hi = unpack(w[q])
                vals[o + 2 * q] = lo
                vals[o + 2 * q + 1] = hi

    @device
    def store(row, u, vals):
        if not VEC:
            row[u] = enc(vals[0])
        elif F32:
            store_u32x4(row, u << 2, (_f32_bits(vals[0]), _f32_bits(vals[1]),
                                      _f32_bits(vals[2]), _f32_bits(vals[3])))
        else:
            store_u32x4(row, u << 2, (pack(vals[1], vals[0]), pack(vals[3], vals[2]),
                                      pack(vals[5], vals[4]), pack(vals[7], vals[6])))

    @device
    def store_fp8(row, u, vals, o):
        """``U`` FP8 codes of ``vals[o:o+U]`` (already divided and clamped) at element ``u * U``."""
        if not VEC:
            row[u] = f32_to_e4m3(vals[o])
        else:
            w0 = uint32((int(pack_e4m3x2(vals[o + 3], vals[o + 2])) << 16)
                        | int(pack_e4m3x2(vals[o + 1], vals[o])))
            if U == 8:
                w1 = uint32((int(pack_e4m3x2(vals[o + 7], vals[o + 6])) << 16)
                            | int(pack_e4m3x2(vals[o + 5], vals[o + 4])))
                store_u32x2(row, u << 1, (w0, w1))
            else:
                row[u] = w0

    def kernel(dst, src, idx, idx2, weights, scales, scale_ub, H, topk, N):
        buf = cuda.local.array(_BUF_N, float32)
        acc = cuda.local.array(8, float32)
        pos = cuda.local.array(CHUNK, int64)
        wts = cuda.local.array(CHUNK, float32)
        sm = cuda.shared.array(REDUCE_SCRATCH, float32)
        r = int64(cuda.blockIdx.x)
        tid, nt = int64(cuda.threadIdx.x), int64(cuda.blockDim.x)
        step = nt * int64(cuda.gridDim.y)
        first = int64(cuda.blockIdx.y) * nt + tid
        nu = H // U
        orow = dst[r]
        if OP == "permute" or OP == "permute_fp8":
            sid = int64(idx[r])
            valid = sid >= 0 and sid < N
            ri = sid // topk
            if OP == "permute":  # bits: words (vector) or storage elements, never converted
                for u in range(first, nu, step):
                    if VEC:
                        w = load_u32x4(src[ri], u << 2) if valid else (uint32(0), uint32(0),
                                                                       uint32(0), uint32(0))
                        store_u32x4(orow, u << 2, w)
                    elif valid:
                        orow[u] = src[ri, u]
                    else:
                        orow[u] = 0
                return
            amax = ZERO
            for q in range(KEEP):  # held in registers until the scale is known
                u = tid + q * nt
                for c in range(U):
                    buf[q * U + c] = ZERO
                if valid and u < nu:
                    load(src[ri], u, buf, q * U)
                    for c in range(U):
                        amax = fmaxf(amax, abs(buf[q * U + c]))
            if valid:
                for u in range(tid + KEEP * nt, nu, nt):
                    load(src[ri], u, acc, 0)
                    for c in range(U):
                        amax = fmaxf(amax, abs(acc[c]))
            sc = scale_from_amax(block_max(amax, sm), scale_ub[0] if UB else ZERO, UB)
            if tid == 0:
                scales[r, 0] = sc
            rs = ONE / sc
            for q in range(KEEP):
                u = tid + q * nt
                if u < nu:
                    for c in range(U):
                        buf[q * U + c] = clamp_fp8(div_rn(buf[q * U + c], sc, rs))
                    store_fp8(orow, u, buf, q * U)
            for u in range(tid + KEEP * nt, nu, nt):
                for c in range(U):
                    acc[c] = ZERO
                if valid:
                    load(src[ri], u, acc, 0)
                for c in range(U):
                    acc[c] = clamp_fp8(div_rn(acc[c], sc, rs))
                store_fp8(orow, u, acc, 0)
            return
        COMBINE = OP == "combine"
        L_rows = int64(src.shape[0])
        for u in range(first, nu, step):
            for c in range(U):
                acc[c] = ZERO
            for j0 in range(0, topk, CH):
                for q in range(CH):  # the chunk's positions and weights, then its rows
                    j = j0 + q
                    pos[q] = -1
                    if j < topk:
                        if COMBINE:
                            i = r * topk + j
                            p = int64(idx[i])
                            wts[q] = weights[r, j]
                            if p >= 0 and p < L_rows and int64(idx2[p]) == i:
                                pos[q] = p
                        else:
                            pos[q] = j
                for q in range(CH):
                    if pos[q] >= 0:
                        if COMBINE:
                            load(src[pos[q]], u, buf, q * U)
                        else:
                            load(src[r, pos[q]], u, buf, q * U)
                for q in range(CH):
                    if pos[q] >= 0:
                        for c in range(U):
                            y = buf[q * U + c]
                            if COMBINE:
                                acc[c] = acc[c] + mul_rn(wts[q], y)
                            elif ROUND_EACH:
                                acc[c] = rnd(acc[c] + y)
                            else:
                                acc[c] = acc[c] + y
            store(orow, u, acc)

    kernel.__name__ = f"moe_rows_{spec.op}_{KIND}_{spec.layout}{'_each' if ROUND_EACH else ''}{'_ub' if UB else ''}"
    return kernel


@dataclass(frozen=True)
class InverseSpec:
    pass


def inverse_argtypes(spec):
    a = L.array_type
    return (a("int32", 1), a("int32", 1), L.i64(0).numba_type)


def inverse_kernel(spec):
    """``(inv, sorted_ids, N)``: ``inv[sorted_ids[p]] = p`` for every ``p`` whose id is below
    ``N`` (one thread a position)."""

    def kernel(inv, sorted_ids, N):
        p = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
        if p < int64(sorted_ids.shape[0]):
            i = int64(sorted_ids[p])
            if i >= 0 and i < N:
                inv[i] = int32(p)

    kernel.__name__ = "moe_inverse"
    return kernel


# ------------------------------------------------------------------------------ variants
def variants():
    """Every ``(factory, spec, argtypes)`` the family's ops can launch (the PTX test compiles
    them all)."""
    out = []
    for kind in KINDS:
        for score in SCORES:
            for vpl in VPLS:
                spec = RouteSpec(kind, score, vpl)
                out.append((route_kernel, spec, route_argtypes(spec)))
    for ids in ("int32", "int64"):
        for emap in (False, True):
            for part in ("count", "place", "fused"):
                spec = AlignSpec(ids, emap, part)
                out.append((align_kernel, spec, align_argtypes(spec)))
    for kind in KINDS:
        for layout in ("vector", "scalar"):
            for op in ("permute", "combine"):
                spec = RowsSpec(kind, op, layout)
                out.append((rows_kernel, spec, rows_argtypes(spec)))
            for ub in (False, True):
                spec = RowsSpec(kind, "permute_fp8", layout, scale_ub=ub)
                out.append((rows_kernel, spec, rows_argtypes(spec)))
            for each in (False, True):
                spec = RowsSpec(kind, "sum", layout, round_each=each)
                out.append((rows_kernel, spec, rows_argtypes(spec)))
    out.append((inverse_kernel, InverseSpec(), inverse_argtypes(InverseSpec())))
    return out
