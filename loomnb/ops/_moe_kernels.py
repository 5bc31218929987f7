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
one fused launch when ``C == 1``). Each thread holds ``ALIGN_PER`` ids in registers (all
loads in flight at once), and every position first takes the sentinel ``N`` (a coalesced fill).
Pass ``count``: thread block ``c`` counts its chunk's experts (shared-memory atomics: exact)
into ``counts[c, :]``; the last block to finish (a ticket on the stream's split counters) sums
the columns, pads each expert's count to the block size, scans them (``offsets``), and writes
``num_tokens_post_pad`` and ``expert_ids`` (-1 past the segments). Pass ``place``: an id's
position is its expert's start (``offsets[e] + sum(counts[:c, e])``) + the equal ids of earlier
warps (a scan of shared per-warp counts) + those earlier in its warp (one ballot a bit of the
id, and a warp-synchronous running count), so every segment lists its flat indices in
ascending order -- the same result at any size, grid or thread count -- with two barriers a
block.

**Rows** (:func:`rows_kernel`): each thread one 16-byte unit (``"vector"``, when every row
allows; else an element) of ``upt`` destination rows, every load issued before the first is
used; ``"permute"`` gathers ``hidden_states[sorted_token_ids[p] // topk]`` (zeros for a
sentinel) as bits, ``"permute_fp8"`` (one warp a row) as FP8 E4M3 codes with the row's dynamic
per-token scale; ``"combine"`` sums ``r32(w * f(y))`` of a token's ``k`` expert rows in float32
(``y`` found through the inverse map that :func:`inverse_kernel` scatters first, checked
against ``sorted_token_ids``); ``"sum"`` is ``moe_sum``.
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
from ._reduce import (FULL_MASK, REDUCE_SCRATCH, block_scan, fadd, fmax_nan, fmaxf,
                      group_max_u64, group_reduce, group_top2_u64, key_index, key_value,
                      last_block, lane_broadcast, mul_rn, order_key, umax)
from ._vector import CODECS, load_u32x4, store_u32x4, unit_io

KINDS = ("bf16", "f16", "f32")
SCORES = ("softmax", "sigmoid")
ROUTE_WARPS = 4          # tokens (warps) a routing thread block handles
MAX_EXPERTS = 1024
MAX_TOPK = 32
VPLS = (1, 2, 4, 8, 16, 32)  # experts a lane holds: ceil(E / 32) rounded up to a power of two
ALIGN_MAX_THREADS = 512  # (the place pass needs up to 128 registers a thread)
ALIGN_PER = 8            # flat ids an align thread holds in registers
ROW_UNITS = {"bf16": 8, "f16": 8, "f32": 4}  # elements of a 16-byte unit
ROW_SLOTS = 8            # units a combine / moe_sum thread loads before it adds them
CHS = (2, 4, 8)          # a token's expert rows loaded at once (ROW_SLOTS // ch tokens a thread)
PERMUTE_UPT = 4          # destination rows a permute thread copies (a unit of each)
KEEP = {"bf16": 8, "f16": 4, "f32": 8}  # units an FP8 permute lane keeps in registers (the
# rest re-read; fp16's conversions make 8 too long a loop to unroll, and its arrays would spill)
FP8_WARPS = 4            # rows (one a warp) of an FP8 permute block
_SPARE = ROW_SLOTS       # the slot an FP8 permute lane re-reads its units past KEEP into
_WB_N = 4 * (ROW_SLOTS + 1)  # a row thread's staged words (the slots and the spare)
_FB_N = ROW_SLOTS + 1    # its staged values in the scalar layout
_ACC_N = 4 * 8           # a row thread's float32 sums: up to ROW_SLOTS // 2 tokens x 8
_CNT_N = MAX_EXPERTS + 1           # shared counts / offsets of the align
_WC_N = 8192             # shared per-warp counts of the align: warps * num_experts at most

NEG_INF = float32(-np.inf)
ZERO = float32(0)
ONE = float32(1)

if SIM:
    @device
    def popc32(x):
        """The set bits of a uint32."""
        return bin(int(x) & 0xFFFFFFFF).count("1")
else:
    @device
    def popc32(x):
        """The set bits of a uint32 (``popc.b32``)."""
        return cuda.popc(x)


@device
def token_of(sid, topk):
    """``sid // topk`` for a valid flat index (``0 <= sid < 2**31``): a 32-bit division."""
    return int64(uint32(sid) // uint32(topk))


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


def align_warps(num_experts):
    """Warps an align block may have: its per-warp counts (``warps * num_experts``) fit
    ``_WC_N`` shared entries."""
    return max(1, min(ALIGN_MAX_THREADS // 32, _WC_N // num_experts))


def align_kernel(spec):
    """``(ids, emap, sorted_ids, expert_ids, post_pad, counts, offsets, counters, N, E, bs,
    L, chunk, bshift)``: thread block ``c`` owns flat ids ``[c * chunk, (c + 1) * chunk)``,
    ``chunk <= ALIGN_PER * blockDim``; warp ``w`` holds ``ALIGN_PER`` runs of 32 of them in
    registers (from ``c * chunk + w * 32 * ALIGN_PER``). ``bshift = log2(bs)`` when ``bs`` is
    a power of two (else -1: divisions). Every position first takes the sentinel ``N`` (a
    coalesced fill, as vLLM's kernel); the place then writes each id at ``start[e]`` + the ids of
    expert ``e`` in earlier warps (a scan of shared per-warp counts) + those earlier in its warp
    (a ballot match and a warp-synchronous running count): two barriers a block, whatever its
    chunk. Loops are ``while`` loops: a 64-bit division (a range's trip count, an index by
    ``bs``) costs ~100 instructions, and these kernels are latency-bound."""
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
    def warp_sync():
        if SIM:
            cuda.syncthreads()  # the simulator's threads are never warp-synchronous
        else:
            cuda.syncwarp(FULL_MASK)

    @device
    def prefix(tot, offs_sh, scratch, emap, expert_ids, post_pad, offsets, E, bs, bshift, Lt,
               tid, nt):
        """Padded counts -> offsets (shared and, for the place pass, global), expert_ids and
        num_tokens_post_pad. ``tot[e]``: expert e's count. ``offs_sh`` is complete on return."""
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
            e += nt
        b = div_bs(int64(carry), bs, bshift) + tid
        while b * bs < Lt:
            expert_ids[b] = -1
            b += nt

    @device
    def warp_matches(eid, mk, te, tid, E):
        """``mk[t]``: the lanes of this warp whose id ``t`` equals this lane's (``eid[t]``, -1
        for none). On the GPU one ballot a bit of the id (``e``, or ``E`` for none), the
        ``ALIGN_PER`` ids' ballots of a bit issued together (``match.any`` serialises over the
        distinct values: ~10x slower on a warp of distinct experts). In the simulator: the
        warp's ids in shared memory (every thread calls this together)."""
        if SIM:
            w = tid >> 5
            for t in range(ALIGN_PER):
                te[tid] = eid[t]
                cuda.syncthreads()
                m = 0
                for q in range(32):
                    if te[w * 32 + q] == eid[t]:
                        m |= 1 << q
                mk[t] = uint32(m)
                cuda.syncthreads()
            return
        for t in range(ALIGN_PER):
            mk[t] = uint32(FULL_MASK)
        b = uint32(0)
        while (int64(1) << b) <= E:
            for t in range(ALIGN_PER):
                e = eid[t]
                bit = ((uint32(e if e >= 0 else E) >> b) & uint32(1)) != 0
                bal = uint32(cuda.ballot_sync(FULL_MASK, bit))
                mk[t] &= bal if bit else ~bal
            b += uint32(1)

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
        te = cuda.shared.array(ALIGN_MAX_THREADS, int32)
        wc = cuda.shared.array(_WC_N, int32)
        last = cuda.shared.array(1, int32)
        eid = cuda.local.array(ALIGN_PER, int32)
        off = cuda.local.array(ALIGN_PER, int32)
        mk = cuda.local.array(ALIGN_PER, uint32)
        lane, w, nw = tid & 31, tid >> 5, nt >> 5
        lo = c * chunk
        hi = min(N, lo + chunk)
        first = lo + w * (32 * ALIGN_PER) + lane
        for t in range(ALIGN_PER):  # every load in flight at once
            eid[t] = int32(expert_of(ids, first + t * 32, hi, E))
        if PART != "place":  # the sentinel everywhere (the count pass: all blocks together)
            q = c * nt + tid
            step = nt * int64(cuda.gridDim.x)
            while q < Lt:
                sorted_ids[q] = int32(N)
                q += step
        if PART == "count":
            zero(cnt, E, tid, nt)
            cuda.syncthreads()
            for t in range(ALIGN_PER):
                if eid[t] >= 0:
                    cuda.atomic.add(cnt, eid[t], 1)
            cuda.syncthreads()
            e = tid
            while e < E:
                counts[c * E + e] = cnt[e]
                e += nt
            if not last_block(counters, 0, cuda.gridDim.x, last):
                return
            e = tid
            while e < E:
                cnt[e] = int32(column_sum(counts, e, E, int64(cuda.gridDim.x)))
                e += nt
            cuda.syncthreads()
            prefix(cnt, offs_sh, scratch, emap, expert_ids, post_pad, offsets, E, bs, bshift,
                   Lt, tid, nt)
            return
        zero(wc, nw * E, tid, nt)
        cuda.syncthreads()
        warp_matches(eid, mk, te, tid, E)
        below = (uint32(1) << uint32(lane)) - uint32(1)
        for t in range(ALIGN_PER):  # ranks within the warp's runs (warp-synchronous counts)
            e = int64(eid[t])
            r, cw = int64(popc32(mk[t] & below)), int64(popc32(mk[t]))
            pre = int64(0)
            if e >= 0:
                pre = int64(wc[w * E + e])
            warp_sync()
            if e >= 0 and r == 0:
                wc[w * E + e] = int32(pre + cw)
            warp_sync()
            off[t] = int32(pre + r)
        cuda.syncthreads()
        e = tid
        while e < E:  # per-warp counts -> each warp's start relative to the block's (and total)
            run = int32(0)
            for w2 in range(nw):
                v = wc[w2 * E + e]
                wc[w2 * E + e] = run
                run += v
            if PART == "fused":
                cnt[e] = run
            else:
                offs_sh[e] = int32(int64(offsets[e]) + column_sum(counts, e, E, c))
            e += nt
        cuda.syncthreads()
        if PART == "fused":
            prefix(cnt, offs_sh, scratch, emap, expert_ids, post_pad, offsets, E, bs, bshift,
                   Lt, tid, nt)
        for t in range(ALIGN_PER):
            e = int64(eid[t])
            if e >= 0:
                p = int64(offs_sh[e]) + int64(wc[w * E + e]) + int64(off[t])
                sorted_ids[p] = int32(first + t * 32)

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
    ch: int = ROW_SLOTS     # "combine" / "sum": expert rows of a token loaded at once (CHS)

    def __post_init__(self):
        assert self.kind in KINDS and self.layout in ("vector", "scalar")
        assert self.op in ("permute", "permute_fp8", "combine", "sum") and self.ch in CHS

    @property
    def upt(self):
        """Destination rows a thread writes (one unit of each)."""
        if self.layout == "scalar" or self.op == "permute_fp8":
            return 1
        return PERMUTE_UPT if self.op == "permute" else ROW_SLOTS // self.ch


def ch_for(topk):
    """Expert rows a combine / moe_sum thread loads at once for ``topk``."""
    return next((c for c in CHS if c >= topk), CHS[-1])


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
    """Row movement, one unit (16 bytes, or an element in the scalar layout) of ``upt``
    destination rows a thread: rows ``blockIdx.x * upt + q``, unit ``blockIdx.y * blockDim.x +
    threadIdx.x``; every load of a thread is issued before the first is used. ``permute``:
    ``dst[p] = src[idx[p] // topk]`` as bits (a zero row where ``idx[p]`` is not below ``N``);
    ``permute_fp8`` (one warp a row, ``blockDim / 32`` rows a block, no barrier): the same row
    as E4M3 codes and its per-token scale in ``scales[p, 0]`` (a warp amax), the first ``KEEP``
    units of a lane held in registers between the amax and the quantisation; ``combine``:
    ``dst[t] = r(sum_j r32(w[t, j] * f(src[idx[t * topk + j]])))`` (``idx``: the inverse map;
    an entry whose ``idx2`` does not point back adds nothing); ``sum``: ``dst[t] =
    moe_sum(src[t])``. ``H``: elements of a row. A token's ``topk`` rows are loaded ``ch`` at
    a time (``ROW_SLOTS`` loads in flight with its ``upt`` tokens) and added in ``j`` order."""
    OP, VEC, KIND = spec.op, spec.layout == "vector", spec.kind
    codec = CODECS[KIND]
    dec, enc, rnd = codec.decode, codec.encode, codec.rnd
    unpack = codec.unpack
    U = ROW_UNITS[KIND] if VEC else 1
    F32 = KIND == "f32"
    ROUND_EACH = spec.round_each
    UB = spec.scale_ub
    CH, UPT, KEEP_U = spec.ch, spec.upt, KEEP[KIND]
    wmax = group_reduce(fmaxf, 32)

    @device
    def take(row, u, wb, o, fb, k):
        """Unit ``u`` of ``row``: four words into ``wb[o:o+4]`` (vector) or one value into
        ``fb[k]``."""
        if VEC:
            w = load_u32x4(row, u << 2)
            for m in range(4):
                wb[o + m] = w[m]
        else:
            fb[k] = dec(row[u])

    @device
    def value(wb, o, fb, k, c):
        """Element ``c`` of the unit taken into slot ``k`` (words from ``o``), as float32."""
        if not VEC:
            return fb[k]
        if F32:
            return _bits_f32(wb[o + c])
        lo, hi = unpack(wb[o + (c >> 1)])
        return hi if (c & 1) else lo

    if VEC and not F32:
        _, store8, store8_fp8 = unit_io(KIND)

    @device
    def store(row, u, vals, q):
        """Unit ``u`` of ``row`` from ``vals[q * U : (q + 1) * U]``."""
        if not VEC:
            row[u] = enc(vals[q])
        elif F32:
            o = q * 4
            store_u32x4(row, u << 2, (_f32_bits(vals[o]), _f32_bits(vals[o + 1]),
                                      _f32_bits(vals[o + 2]), _f32_bits(vals[o + 3])))
        else:
            store8(row, u, vals, q)

    @device
    def store_fp8(row, u, vals):
        """``U`` FP8 codes of ``vals[0:U]`` (already divided and clamped) at element ``u * U``."""
        if not VEC:
            row[u] = f32_to_e4m3(vals[0])
        elif F32:
            row[u] = uint32((int(pack_e4m3x2(vals[3], vals[2])) << 16)
                            | int(pack_e4m3x2(vals[1], vals[0])))
        else:
            store8_fp8(row, u, vals, 0)

    def kernel(dst, src, idx, idx2, weights, scales, scale_ub, H, topk, N):
        wb = cuda.local.array(_WB_N, uint32)
        fb = cuda.local.array(_FB_N, float32)
        acc = cuda.local.array(_ACC_N, float32)
        pos = cuda.local.array(ROW_SLOTS, int64)
        wts = cuda.local.array(ROW_SLOTS, float32)
        tid, nt = int64(cuda.threadIdx.x), int64(cuda.blockDim.x)
        R = int64(dst.shape[0])
        nu = H // U
        if OP == "permute_fp8":
            lane = tid & 31
            r = int64(cuda.blockIdx.x) * (nt >> 5) + (tid >> 5)
            live = r < R
            if not live:  # every lane takes part in the warp amax: the last row again, unstored
                r = R - 1
            sid = int64(idx[r])
            valid = sid >= 0 and sid < N
            ri = token_of(sid, topk) if valid else int64(0)
            amax = ZERO
            for q in range(KEEP_U):  # held in registers until the scale is known
                u = lane + q * 32
                for m in range(4):
                    wb[q * 4 + m] = uint32(0)
                fb[q] = ZERO
                if valid and u < nu:
                    take(src[ri], u, wb, q * 4, fb, q)
                for c in range(U):
                    amax = fmaxf(amax, abs(value(wb, q * 4, fb, q, c)))
            u = lane + KEEP_U * 32
            while valid and u < nu:
                take(src[ri], u, wb, 4 * _SPARE, fb, _SPARE)
                for c in range(U):
                    amax = fmaxf(amax, abs(value(wb, 4 * _SPARE, fb, _SPARE, c)))
                u += 32
            sc = scale_from_amax(wmax(amax), scale_ub[0] if UB else ZERO, UB)
            if not live:
                return
            if lane == 0:
                scales[r, 0] = sc
            rs = ONE / sc
            orow = dst[r]
            for q in range(KEEP_U):
                u = lane + q * 32
                if u < nu:
                    for c in range(U):
                        acc[c] = clamp_fp8(div_rn(value(wb, q * 4, fb, q, c), sc, rs))
                    store_fp8(orow, u, acc)
            u = lane + KEEP_U * 32
            while u < nu:
                for m in range(4):
                    wb[4 * _SPARE + m] = uint32(0)
                fb[_SPARE] = ZERO
                if valid:
                    take(src[ri], u, wb, 4 * _SPARE, fb, _SPARE)
                for c in range(U):
                    acc[c] = clamp_fp8(div_rn(value(wb, 4 * _SPARE, fb, _SPARE, c), sc, rs))
                store_fp8(orow, u, acc)
                u += 32
            return
        u = int64(cuda.blockIdx.y) * nt + tid
        if u >= nu:  # no barrier below
            return
        r0 = int64(cuda.blockIdx.x) * UPT
        if OP == "permute":  # bits: words (vector) or storage elements, never converted
            if not VEC:
                if r0 < R:
                    sid = int64(idx[r0])
                    dst[r0, u] = src[token_of(sid, topk), u] if (sid >= 0 and sid < N) else 0
                return
            for q in range(UPT):
                r = r0 + q
                for m in range(4):
                    wb[q * 4 + m] = uint32(0)
                if r < R:
                    sid = int64(idx[r])
                    if sid >= 0 and sid < N:
                        take(src[token_of(sid, topk)], u, wb, q * 4, fb, q)
            for q in range(UPT):
                r = r0 + q
                if r < R:
                    store_u32x4(dst[r], u << 2, (wb[q * 4], wb[q * 4 + 1], wb[q * 4 + 2],
                                                 wb[q * 4 + 3]))
            return
        COMBINE = OP == "combine"
        L_rows = int64(src.shape[0])
        for q in range(UPT * U):
            acc[q] = ZERO
        j0 = int64(0)
        while j0 < topk:
            for q in range(UPT):  # the positions and weights of the slots, then their rows
                r = r0 + q
                for s in range(CH):
                    k = q * CH + s
                    j = j0 + s
                    p = int64(-1)
                    if j < topk and r < R:
                        if COMBINE:
                            i = r * topk + j
                            p = int64(idx[i])
                            wts[k] = weights[r, j]
                            if not (p >= 0 and p < L_rows and int64(idx2[p]) == i):
                                p = -1
                        else:
                            p = j
                    pos[k] = p
            for q in range(UPT):
                for s in range(CH):
                    k = q * CH + s
                    if pos[k] >= 0:
                        if COMBINE:
                            take(src[pos[k]], u, wb, k * 4, fb, k)
                        else:
                            take(src[r0 + q, pos[k]], u, wb, k * 4, fb, k)
            for q in range(UPT):
                for s in range(CH):
                    k = q * CH + s
                    if pos[k] >= 0:
                        for c in range(U):
                            y = value(wb, k * 4, fb, k, c)
                            a = q * U + c
                            if COMBINE:
                                acc[a] = acc[a] + mul_rn(wts[k], y)
                            elif ROUND_EACH:
                                acc[a] = rnd(acc[a] + y)
                            else:
                                acc[a] = acc[a] + y
            j0 += CH
        for q in range(UPT):
            if r0 + q < R:
                store(dst[r0 + q], u, acc, q)

    kernel.__name__ = (f"moe_rows_{spec.op}_{KIND}_{spec.layout}{'_each' if ROUND_EACH else ''}"
                       f"{'_ub' if UB else ''}_c{CH}")
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
            chs = CHS if layout == "vector" else (ROW_SLOTS,)
            spec = RowsSpec(kind, "permute", layout)
            out.append((rows_kernel, spec, rows_argtypes(spec)))
            for ub in (False, True):
                spec = RowsSpec(kind, "permute_fp8", layout, scale_ub=ub)
                out.append((rows_kernel, spec, rows_argtypes(spec)))
            for ch in chs:
                spec = RowsSpec(kind, "combine", layout, ch=ch)
                out.append((rows_kernel, spec, rows_argtypes(spec)))
                for each in (False, True):
                    if each and (ch == 8 and layout == "vector" or kind == "f32"):
                        continue  # rounded adds are k = 2..4 of a 16-bit dtype only
                    spec = RowsSpec(kind, "sum", layout, round_each=each, ch=ch)
                    out.append((rows_kernel, spec, rows_argtypes(spec)))
    out.append((inverse_kernel, InverseSpec(), inverse_argtypes(InverseSpec())))
    return out
