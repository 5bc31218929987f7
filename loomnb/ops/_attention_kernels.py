"""Paged decode attention kernels: a split-K pass over the context whose last split CTA does the
LSE merge where ``attention.fused_merge`` says so (else a separate merge kernel), and vLLM's
``merge_attn_states``. Each factory is specialised by a small frozen spec.

**Decode pass** (:func:`decode_kernel`, :class:`DecodeSpec`). One CTA per ``(sequence, split,
KV head, head chunk)``: it serves ``GC = spec.gc`` (1 to 4) query heads of one KV head, so a KV
page is read from memory once for all of them (a larger group, ``num_heads / num_kv_heads >
4``, takes ``ceil(group / 4)`` CTAs per KV head, which read the same pages; the repeats meet in
L2; :func:`head_chunks`). ``GC`` is the chunk's real head count (SmolLM2's 3, not 4): each head
costs ``2 * EPL`` registers a thread.

* Lanes and rows: ``R = spec.lanes`` lanes hold one head row of ``head_size`` elements, ``EPL``
  elements each (vector path: ``EPL = 8``, R = 8 up to head_size 64, 16 up to 128, 32 up to
  256; scalar path: ``EPL = 16``, R = 16); the CTA's ``nt / R`` lane groups take consecutive
  tokens. Lane ``r`` holds the row's units ``r, r + R, ...`` (a unit is one load: 16 bytes =
  8 bf16/fp16 or 4 fp32 elements, or 8 bytes = 8 FP8 codes), element ``k`` of the lane being
  head dimension ``dim(r, k) = (r + (k // UE) * R) * UE + k % UE`` (``UE`` elements per
  unit). The query of each served head is held the same way, pre-multiplied by ``scale`` (and
  ``k_scale`` for FP8, and log2(e) without a softcap: the softmax runs in base 2).
* ``path="vec"``: each unit is one 16-byte (``ld.global.v4.u32``) or 8-byte (``v2``) load from
  the cache seen as ``uint32`` words; ``path="scalar"``: element loads through the strides (any
  alignment, the legacy transposed value cache). Both read a token's row at ``block * sb +
  offset * so + kv_head * sh`` plus, for head dimension ``d``, ``(d >> xl) * su + (d & (2^xl -
  1)) * se`` (``xl = log2(x)`` for vLLM's x-packed key, 0 otherwise); ``block =
  block_tables[seq, pos // block_size]``. Only tokens below ``seq_len`` are read.
* Registers decide the speed: ptxas gives the vector bf16 kernel (GC = 4, TT = 4) 168
  registers a thread, so three 128-thread CTAs fit an SM, each thread with ``TT * 2 * 16``
  bytes of loads in flight (the previous layout, 16 elements a lane and 2 tokens a tile, took
  241 registers: two CTAs and a third less in flight).
* Per tile of ``TT`` tokens per lane group: all loads of the tile issued first, partial dot
  products reduced over the ``R`` lanes (``group_reduce_array``), softcap ``cap * tanh(z /
  cap)``, then a FlashAttention online softmax in float32 per lane group: running max ``m``,
  sum ``l`` and unnormalised output ``acc``, rescaled only when the max grows (``exp2(0) = 1``
  makes the skipped rescale exact).
* End: lane groups merge (max, then rescaled sums over lanes ``R`` apart), warps merge through
  shared memory, and warp 0 writes either ``out = r(acc * v_scale / l)`` and ``lse = (m +
  log2 l) * ln 2`` (one split) or the split's float32 partial ``(acc * v_scale, m, l)``.
  No visible key: ``out = 0``, ``lse = -inf``. No epsilon anywhere.

**Split merge**, in the same kernel: with ``P > 1`` splits each CTA writes its partial,
fences, and takes a ticket with ``atomicInc(counters[(s * Hk + hk) * NC + c], P - 1)``
(:mod:`loomnb.ops._workspace`: the counter wraps back to 0, so it is 0 at every launch); the
CTA that draws ``P - 1`` is the last of its (sequence, KV head, head chunk) and merges the
splits of its heads: ``M = max m_p``, ``w_p = exp2(m_p - M)``, ``out = r(sum_p w_p acc_p /
sum_p w_p l_p)``, ``lse = (M + log2(sum w l)) * ln 2``. Warp ``g`` forms head ``g``'s weights
(two splits a lane, warp shuffles) while each thread's first ``MERGE_LOADS`` partials are
already in flight; then one thread per output element sums its partials in split order
(deterministic: bit-identical run to run). No second launch, and nothing walks the splits
one load at a time. Merges with more outputs than the CTA has threads, or more than ``2 *
MERGE_LOADS`` splits (``attention.fused_merge``), go to :func:`split_merge_kernel` instead,
one CTA per (sequence, head), launched after the pass (``fuse = 0``). The kernel's merge is
correct for any ``P <= MAX_SPLITS`` (two splits a lane); the bound is only the rule's.

**merge_attn_states** (:func:`merge_states_kernel`): one warp per (token, head), lanes over
head_size, vLLM 0.24's formula (``expf``, ``logf``, ``fmaf(p_out, p_scale, s_out * s_scale)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from numba import cuda, float32, int32, int64, uint32

from .._dtypes import storage_dtype
from .._numba_internals import device
from ..layouts.dtypes import bits_f32, unpack_e4m3x2
from . import _launch as L
from ._reduce import fadd, fmax_nan, group_reduce, group_reduce_array
from ._vector import CODECS, load_u32x2, load_u32x4

EPL_VEC = 8     # head-row elements a lane holds on the vector path (one 16-byte unit of bf16)
EPL_SCALAR = 16  # ... on the scalar path
MAX_GC = 4      # query heads one CTA serves at most (registers: GC * EPL floats of q and of acc)
LANES = (8, 16, 32)  # lanes per head row on the vector path: head_size <= EPL_VEC * lanes
SCALAR_LANES = 16    # lanes per head row on the scalar path (head_size <= 256)
MAX_SPLITS = 64  # splits of one context at most (two a lane in the in-kernel merge's warps)
MERGE_LOADS = 16  # partials a thread of the in-kernel merge has in flight
SLOTS = 4       # warp states the cross-warp merge takes per round through shared memory
KINDS = ("bf16", "f16", "f32")
CACHES = ("bf16", "f16", "f32", "fp8")
ESIZE = {"bf16": 2, "f16": 2, "f32": 4, "fp8": 1}
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_INF = -math.inf


def lanes_for(head_size, epl=EPL_VEC):
    """Lanes per head row on the vector path (``DecodeSpec.lanes``) for ``head_size`` (at most
    256): 8 up to 64, 16 up to 128, 32 up to 256 (``epl = 16``: half as many, at least 4)."""
    return next(r for r in (4,) + LANES if head_size <= epl * r and (r > 4 or epl == 16))


def tokens_per_tile(cache, path="vec"):
    """Tokens a lane group loads per tile: on the vector path 4 (1- and 2-byte caches) or 2
    (fp32); on the scalar path, which holds 16 elements a lane, 2 or 1."""
    tt = 2 if ESIZE[cache] == 4 else 4
    return tt if path == "vec" else tt // 2


def head_chunks(group, max_gc=MAX_GC):
    """``(chunks, heads per chunk)`` of a KV head's ``group`` query heads: ``ceil(group /
    max_gc)`` CTAs, each serving at most ``max_gc`` (<= ``MAX_GC``) heads (3 -> one CTA of 3;
    7 -> two of 4 (4 + 3); 3 with ``max_gc = 1`` -> three of 1)."""
    nc = -(-group // max_gc)
    return nc, -(-group // nc)


@dataclass(frozen=True)
class DecodeSpec:
    kind: str          # query and output dtype: bf16, f16, f32
    cache: str         # the caches' dtype: the query's, or "fp8" (E4M3 codes)
    path: str = "vec"  # "vec" (16- or 8-byte unit loads) or "scalar" (element loads)
    lanes: int = 16    # lanes per head row (LANES; SCALAR_LANES on the scalar path)
    gc: int = MAX_GC   # query heads a CTA serves (1..MAX_GC; :func:`head_chunks`)
    tt: int = 0        # tokens per lane group per tile; 0: :func:`tokens_per_tile`
    epl: int = 0       # head-row elements a lane holds; 0: EPL_VEC / EPL_SCALAR

    def __post_init__(self):
        assert self.kind in KINDS and self.cache in (self.kind, "fp8")
        assert self.path in ("vec", "scalar") and self.lanes in (4,) + LANES
        assert 1 <= self.gc <= MAX_GC and 0 <= self.tt <= 8 and self.epl in (0, 8, 16)
        if self.tt == 0:
            object.__setattr__(self, "tt", tokens_per_tile(self.cache, self.path))
        if self.epl == 0:
            object.__setattr__(self, "epl", EPL_VEC if self.path == "vec" else EPL_SCALAR)

    @property
    def unit_bytes(self):
        """Bytes of one load: 16, or 8 for an FP8 row on the vector path (8 codes a lane)."""
        return min(16, self.epl * ESIZE[self.cache]) if self.path == "vec" else 16


@dataclass(frozen=True)
class MergeSpec:
    kind: str          # output dtype


def decode_argtypes(spec):
    """The numba signature of ``decode_kernel(spec)``'s parameters (see :func:`decode_params`)."""
    act, f32 = storage_dtype(spec.kind), "float32"
    cache = "uint32" if spec.path == "vec" else storage_dtype(spec.cache)
    i, f = L.i64(0).numba_type, L.f32(0).numba_type
    return (L.array_type(act, 3), L.array_type(f32, 2), L.array_type(f32, 4),
            L.array_type(f32, 4), L.array_type("uint32", 1), L.array_type(act, 3),
            L.array_type(cache, 1), L.array_type(cache, 1), L.array_type("int32", 2),
            L.array_type("int32", 1),
            L.array_type(f32, 1), L.array_type(f32, 1)) + (i,) * 23 + (f, f, f)


def merge_argtypes(spec):
    act, f32 = storage_dtype(spec.kind), "float32"
    i = L.i64(0).numba_type
    return (L.array_type(act, 3), L.array_type(f32, 2), L.array_type(f32, 4),
            L.array_type(f32, 4), i, i, i, i)


def states_argtypes(spec):
    act, f32 = storage_dtype(spec.kind), "float32"
    i = L.i64(0).numba_type
    return (L.array_type(act, 3), L.array_type(f32, 2), L.array_type(act, 3),
            L.array_type(f32, 2), L.array_type(act, 3), L.array_type(f32, 2), i, i, i, i)


# ---------------------------------------------------------------- device helpers
def _units(spec):
    """``(EPL, UE, VPL, KW, UW)``: elements a lane holds, elements per unit, units per lane,
    words a lane holds of one row (vector path; elements on the scalar path), words per unit."""
    EPL, es = spec.epl, ESIZE[spec.cache]
    UB = spec.unit_bytes
    UE = UB // es
    return EPL, UE, EPL // UE, EPL * es // 4, UB // 4


def _row_decoder(spec):
    """``decode_row(vals, w, j)``: the ``EPL`` float32 values of token ``j`` of a tile from what
    ``load_row`` stored (words of 8- or 16-byte units, or the raw elements of the scalar path)."""
    EPL, UE, VPL, KW, UW = _units(spec)
    if spec.path == "scalar":
        if spec.cache == "fp8":
            @device
            def decode_row(vals, w, j):
                for k in range(0, EPL, 2):
                    a, b = unpack_e4m3x2(w[j * EPL + k] | (w[j * EPL + k + 1] << 8))
                    vals[k] = a
                    vals[k + 1] = b
        elif spec.cache == "f32":
            @device
            def decode_row(vals, w, j):
                for k in range(EPL):
                    vals[k] = w[j * EPL + k]
        else:
            dec = CODECS[spec.cache].decode

            @device
            def decode_row(vals, w, j):
                for k in range(EPL):
                    vals[k] = dec(w[j * EPL + k])
    elif spec.cache == "fp8":
        @device
        def decode_row(vals, w, j):
            for c in range(KW):
                x = w[j * KW + c]
                a, b = unpack_e4m3x2(x & 0xFFFF)
                e, f = unpack_e4m3x2(x >> 16)
                vals[4 * c] = a
                vals[4 * c + 1] = b
                vals[4 * c + 2] = e
                vals[4 * c + 3] = f
    elif spec.cache == "f32":
        @device
        def decode_row(vals, w, j):
            for k in range(EPL):
                vals[k] = bits_f32(w[j * KW + k])
    else:
        unpack = CODECS[spec.cache].unpack

        @device
        def decode_row(vals, w, j):
            for c in range(KW):
                lo, hi = unpack(w[j * KW + c])
                vals[2 * c] = lo
                vals[2 * c + 1] = hi
    return decode_row


def _row_loader(spec):
    """``load_row(w, j, cache, blk, off, ok, hk, sb, so, sh, su, se, xl, D, r)``: lane ``r``'s
    part of the row at (block ``blk``, offset ``off``) of KV head ``hk`` into slot ``j`` of ``w``
    (zeros where ``ok`` is false or past ``head_size``): units as words (``"vec"``; unit ``u``
    at word ``(u >> US) * su + (u & (2^US - 1)) * UW``, ``su`` the words between 16-byte
    chunks, ``US = log2(16 / unit bytes)``), or the raw elements (``"scalar"``: bits as
    uint32, fp32 as float32), decoded by ``decode_row``."""
    R = spec.lanes
    EPL, UE, VPL, KW, UW = _units(spec)
    US = (16 // spec.unit_bytes).bit_length() - 1
    USM = (1 << US) - 1
    if spec.path == "vec":
        load = load_u32x4 if UW == 4 else load_u32x2

        @device
        def load_row(w, j, cache, blk, off, ok, hk, sb, so, sh, su, se, xl, D, r):
            if ok:
                base = blk * sb + off * so + hk * sh
                for i in range(VPL):
                    u = r + i * R
                    if u * UE < D:
                        x = load(cache, base + (u >> US) * su + (u & USM) * UW)
                        for c in range(UW):
                            w[j * KW + UW * i + c] = x[c]
                    else:
                        for c in range(UW):
                            w[j * KW + UW * i + c] = 0
            else:
                for c in range(KW):
                    w[j * KW + c] = 0
        return load_row

    if spec.cache == "f32":
        @device
        def raw(v):
            return v
        zero = float32(0)
    else:
        @device
        def raw(v):
            return uint32(v)
        zero = uint32(0)

    @device
    def load_row(w, j, cache, blk, off, ok, hk, sb, so, sh, su, se, xl, D, r):
        if ok:
            base = blk * sb + off * so + hk * sh
            xm = (int64(1) << xl) - 1
            for k in range(EPL):
                d = (r + (k // UE) * R) * UE + (k % UE)
                v = zero
                if d < D:
                    v = raw(cache[base + (d >> xl) * su + (d & xm) * se])
                w[j * EPL + k] = v
        else:
            for k in range(EPL):
                w[j * EPL + k] = zero
    return load_row


# ---------------------------------------------------------------- the decode pass
def decode_kernel(spec):
    """The ``@cuda.jit`` function of the decode pass for ``spec`` (see the module docstring)."""
    R = spec.lanes
    LOG2R = R.bit_length() - 1
    NGW = 32 // R                        # lane groups per warp
    EPL, UE, VPL, KW, UW = _units(spec)
    TT, GC = spec.tt, spec.gc
    VEC, FP8 = spec.path == "vec", spec.cache == "fp8"
    NW_ = TT * (KW if VEC else EPL)      # per-lane tile storage of K (or V)
    WTYPE = float32 if spec.cache == "f32" and not VEC else uint32
    QN, SCN, SMA, SMS = GC * EPL, GC * TT, SLOTS * GC * EPL * R, SLOTS * GC  # array sizes
    SMP, MU = MAX_GC * MAX_SPLITS, MERGE_LOADS  # the split merge's weights, loads in flight
    split_max = group_reduce(fmax_nan, 32)
    split_sum = group_reduce(fadd, 32)
    dec_q, enc = CODECS[spec.kind].decode, CODECS[spec.kind].encode
    load_row, decode_row = _row_loader(spec), _row_decoder(spec)
    dot_sum = group_reduce_array(fadd, R, GC * TT)
    warp_max = group_reduce_array(fmax_nan, NGW, GC, R)
    warp_sum_acc = group_reduce_array(fadd, NGW, GC * EPL, R)
    warp_sum_l = group_reduce_array(fadd, NGW, GC, R)

    def kernel(out, lse, pacc, pml, counters, q, kc, vc, bt, sl, ksc, vsc,
               D, Hk, G, NC, GCH, P, B, BSH, kb, ko, kh, ku, ke, kxl,
               vb, vo, vh, vu, ve, vxl, W, wlse, fuse, qmul, inv_cap, capl2):
        bid = int64(cuda.blockIdx.x)
        c = bid % NC
        t1 = bid // NC
        hk = t1 % Hk
        t2 = t1 // Hk
        p = t2 % P
        s = t2 // P
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        lane = tid & 31
        warp = tid >> 5
        nw = nt >> 5
        r = lane & (R - 1)
        grp = int64(tid >> LOG2R)
        ngroups = int64(nt >> LOG2R)
        h0 = hk * G + c * GCH
        nh = min(GCH, G - c * GCH)

        # the tokens of this split: [beg, end) of the visible [start, L)
        L = min(max(int64(sl[s]), int64(0)), int64(bt.shape[1]) * B)
        start = max(L - W, int64(0)) if W > 0 else int64(0)
        chunk = (L - start + P - 1) // P
        beg = start + p * chunk
        end = min(L, beg + chunk)

        ks = ksc[hk] if FP8 else float32(1)
        vs = vsc[hk] if FP8 else float32(1)
        qm = float32(qmul * ks)
        qv = cuda.local.array(QN, float32)
        for g in range(GC):
            for k in range(EPL):
                d = (r + (k // UE) * R) * UE + (k % UE)
                x = float32(0)
                if g < nh and d < D:
                    x = dec_q(q[s, h0 + g, d]) * qm
                qv[g * EPL + k] = x

        m = cuda.local.array(GC, float32)
        lsum = cuda.local.array(GC, float32)
        acc = cuda.local.array(QN, float32)
        for g in range(GC):
            m[g] = NEG_INF
            lsum[g] = float32(0)
            for k in range(EPL):
                acc[g * EPL + k] = float32(0)
        kw = cuda.local.array(NW_, WTYPE)
        vw = cuda.local.array(NW_, WTYPE)
        vals = cuda.local.array(EPL, float32)
        sc = cuda.local.array(SCN, float32)

        span = ngroups * TT
        ntiles = (end - beg + span - 1) // span if end > beg else int64(0)
        for it in range(ntiles):  # the same count in every thread: the reductions need all lanes
            tb = beg + it * span
            for j in range(TT):
                t = tb + j * ngroups + grp
                ok = t < end
                blk = int64(0)
                off = int64(0)
                if ok:  # one block-table read per token, for its key and its value
                    if BSH >= 0:
                        bi = t >> BSH
                        off = t & (B - 1)
                    else:
                        bi = t // B
                        off = t - bi * B
                    blk = int64(bt[s, bi])
                load_row(kw, j, kc, blk, off, ok, hk, kb, ko, kh, ku, ke, kxl, D, r)
                load_row(vw, j, vc, blk, off, ok, hk, vb, vo, vh, vu, ve, vxl, D, r)
            for j in range(TT):
                decode_row(vals, kw, j)
                for g in range(GC):
                    a = float32(0)
                    for k in range(EPL):
                        a += qv[g * EPL + k] * vals[k]
                    sc[g * TT + j] = a
            dot_sum(sc)
            for j in range(TT):
                ok = tb + j * ngroups + grp < end
                for g in range(GC):
                    x = sc[g * TT + j]
                    if inv_cap > 0:
                        x = capl2 * math.tanh(x * inv_cap)
                    if not ok:
                        x = NEG_INF
                    sc[g * TT + j] = x
            for g in range(GC):
                mo = m[g]
                mx = mo
                for j in range(TT):
                    mx = fmax_nan(mx, sc[g * TT + j])
                if mx > mo:  # rescale only when the max grows (else the factor is exactly 1)
                    corr = math.exp2(mo - mx)
                    lsum[g] *= corr
                    for k in range(EPL):
                        acc[g * EPL + k] *= corr
                    m[g] = mx
            for j in range(TT):
                decode_row(vals, vw, j)
                for g in range(GC):
                    mu = m[g] if m[g] != NEG_INF else float32(0)
                    pj = math.exp2(sc[g * TT + j] - mu)
                    lsum[g] += pj
                    for k in range(EPL):
                        acc[g * EPL + k] += pj * vals[k]

        # lane groups of a warp -> one state (in every group)
        mw = cuda.local.array(GC, float32)
        for g in range(GC):
            mw[g] = m[g]
        warp_max(mw)
        for g in range(GC):
            e = math.exp2(m[g] - mw[g]) if mw[g] != NEG_INF else float32(0)
            lsum[g] *= e
            for k in range(EPL):
                acc[g * EPL + k] *= e
            m[g] = mw[g]
        warp_sum_l(lsum)
        warp_sum_acc(acc)

        # warps -> warp 0, SLOTS warps per round through shared memory
        smA = cuda.shared.array(SMA, float32)
        smM = cuda.shared.array(SMS, float32)
        smL = cuda.shared.array(SMS, float32)
        for base in range(0, nw, SLOTS):
            slot = warp - base
            if warp != 0 and slot >= 0 and slot < SLOTS and lane < R:
                for g in range(GC):
                    for k in range(EPL):
                        smA[((slot * GC + g) * EPL + k) * R + r] = acc[g * EPL + k]
                    if r == 0:
                        smM[slot * GC + g] = m[g]
                        smL[slot * GC + g] = lsum[g]
            cuda.syncthreads()
            if warp == 0:
                for sl_ in range(SLOTS):
                    w_ = base + sl_
                    if w_ != 0 and w_ < nw:
                        for g in range(GC):
                            mo = smM[sl_ * GC + g]
                            mx = fmax_nan(m[g], mo)
                            if mx != NEG_INF:
                                a = math.exp2(m[g] - mx)
                                b = math.exp2(mo - mx)
                                lsum[g] = lsum[g] * a + smL[sl_ * GC + g] * b
                                for k in range(EPL):
                                    acc[g * EPL + k] = (acc[g * EPL + k] * a
                                                        + smA[((sl_ * GC + g) * EPL + k) * R + r] * b)
                                m[g] = mx
            cuda.syncthreads()

        if warp == 0:
            gi = lane >> LOG2R
            for g in range(GC):
                if g < nh and g % NGW == gi:
                    h = h0 + g
                    if P == 1:
                        inv = vs / lsum[g] if lsum[g] != 0 else float32(0)
                        for k in range(EPL):
                            d = (r + (k // UE) * R) * UE + (k % UE)
                            if d < D:
                                out[s, h, d] = enc(acc[g * EPL + k] * inv)
                        if wlse != 0 and r == 0:
                            lse[h, s] = ((m[g] + math.log2(lsum[g])) * float32(LN2)
                                         if lsum[g] != 0 else float32(NEG_INF))
                    else:
                        for k in range(EPL):
                            d = (r + (k // UE) * R) * UE + (k % UE)
                            if d < D:
                                pacc[s, h, p, d] = acc[g * EPL + k] * vs
                        if r == 0:
                            pml[s, h, p, 0] = m[g]
                            pml[s, h, p, 1] = lsum[g]
        if P == 1 or fuse == 0:  # one split, or the partials merged by split_merge_kernel
            return

        # ---- split-K: the last split CTA of (sequence, KV head, head chunk) merges them all
        last = cuda.shared.array(1, int32)
        if warp == 0:
            cuda.threadfence()  # the partials warp 0 wrote: visible device-wide before the ticket
        cuda.syncthreads()
        if tid == 0:
            ticket = cuda.atomic.inc(counters, (s * Hk + hk) * NC + c, uint32(P - 1))
            cuda.threadfence()
            last[0] = 1 if ticket == P - 1 else 0  # atomicInc wraps: the counter is 0 again
        cuda.syncthreads()
        if last[0] == 0:
            return
        smw = cuda.shared.array(SMP, float32)  # w_p = exp2(m_p - M) of each head
        smi = cuda.shared.array(MAX_GC, float32)  # 1 / sum_p w_p l_p
        pv = cuda.local.array(MU, float32)
        nout = uint32(nh * D)
        ud = uint32(D)
        # the first MU partials of this thread's first output: in flight while the weights form
        if uint32(tid) < nout:
            g = uint32(tid) // ud
            d = uint32(tid) - g * ud
            for k in range(MU):
                pv[k] = pacc[s, h0 + g, k, d] if k < P else float32(0)
        # the weights: warp g folds head g's splits (lanes p and p + 32), every warp the same
        # number of rounds (the reductions need whole warps)
        for g0 in range(0, nh, nw):
            g = g0 + warp
            ok0 = g < nh and lane < P
            ok1 = g < nh and lane + 32 < P
            m0 = pml[s, h0 + g, lane, 0] if ok0 else float32(NEG_INF)
            m1 = pml[s, h0 + g, lane + 32, 0] if ok1 else float32(NEG_INF)
            l0 = pml[s, h0 + g, lane, 1] if ok0 else float32(0)
            l1 = pml[s, h0 + g, lane + 32, 1] if ok1 else float32(0)
            mx = split_max(fmax_nan(m0, m1))
            w0 = float32(0)
            w1 = float32(0)
            if mx != NEG_INF:
                if ok0:
                    w0 = math.exp2(m0 - mx)
                if ok1:
                    w1 = math.exp2(m1 - mx)
            tot = split_sum(w0 * l0 + w1 * l1)
            if ok0:
                smw[g * MAX_SPLITS + lane] = w0
            if ok1:
                smw[g * MAX_SPLITS + lane + 32] = w1
            if g < nh and lane == 0:
                smi[g] = float32(1) / tot if tot != 0 else float32(0)
                if wlse != 0:
                    lse[h0 + g, s] = ((mx + math.log2(tot)) * float32(LN2) if tot != 0
                                      else float32(NEG_INF))
        cuda.syncthreads()
        for i in range(tid, nh * D, nt):
            g = uint32(i) // ud
            d = uint32(i) - g * ud
            a = float32(0)
            for c0 in range(0, P, MU):
                if i != tid or c0 > 0:
                    for k in range(MU):
                        pv[k] = pacc[s, h0 + g, c0 + k, d] if c0 + k < P else float32(0)
                for k in range(MU):
                    if c0 + k < P:
                        a += smw[g * MAX_SPLITS + c0 + k] * pv[k]
            out[s, h0 + g, d] = enc(a * smi[g])

    kernel.__name__ = f"paged_decode_{spec.kind}_{spec.cache}_{spec.path}_r{R}_g{GC}_t{TT}_e{EPL}"
    return kernel


# ---------------------------------------------------------------- the split merge
def split_merge_kernel(spec):
    """One CTA per (sequence, head): the splits' partials -> ``out`` (and ``lse``), for merges
    too large for the decode kernel's last CTA (``attention.fused_merge``)."""
    enc = CODECS[spec.kind].encode

    def kernel(out, lse, pacc, pml, D, Hq, P, wlse):
        row = int64(cuda.blockIdx.x)
        s = row // Hq
        h = row - s * Hq
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        mx = float32(NEG_INF)
        for p in range(P):
            mx = fmax_nan(mx, pml[s, h, p, 0])
        tot = float32(0)
        if mx != NEG_INF:
            for p in range(P):
                tot += math.exp2(pml[s, h, p, 0] - mx) * pml[s, h, p, 1]
        inv = float32(1) / tot if tot != 0 else float32(0)
        for d in range(tid, D, nt):
            a = float32(0)
            if mx != NEG_INF:
                for p in range(P):
                    a += math.exp2(pml[s, h, p, 0] - mx) * pacc[s, h, p, d]
            out[s, h, d] = enc(a * inv)
        if wlse != 0 and tid == 0:
            lse[h, s] = (mx + math.log2(tot)) * float32(LN2) if tot != 0 else float32(NEG_INF)

    kernel.__name__ = f"paged_decode_split_merge_{spec.kind}"
    return kernel


# ---------------------------------------------------------------- merge_attn_states
def merge_states_kernel(spec):
    """One warp per (token, head) row: vLLM 0.24's ``merge_attn_states``."""
    dec, enc = CODECS[spec.kind].decode, CODECS[spec.kind].encode

    def kernel(out, olse, pout, plse, sout, slse, N, H, D, wlse):
        tid = cuda.threadIdx.x
        lane = tid & 31
        row = int64(cuda.blockIdx.x) * (cuda.blockDim.x >> 5) + (tid >> 5)
        if row < N * H:
            n = row // H
            h = row - n * H
            pl = plse[h, n]
            sl = slse[h, n]
            if math.isinf(pl):
                pl = float32(NEG_INF)
            if math.isinf(sl):
                sl = float32(NEG_INF)
            mx = fmax_nan(pl, sl)
            if math.isinf(mx):  # both -inf: prefix_output unchanged, lse -inf (vLLM PR #28181)
                for d in range(lane, D, 32):
                    out[n, h, d] = pout[n, h, d]
                if wlse != 0 and lane == 0:
                    olse[h, n] = mx
            else:
                pse = float32(math.exp(pl - mx))
                sse = float32(math.exp(sl - mx))
                tot = float32(pse + sse)
                ps = float32(pse / tot)
                ss = float32(sse / tot)
                for d in range(lane, D, 32):
                    out[n, h, d] = enc(cuda.fma(dec(pout[n, h, d]), ps, dec(sout[n, h, d]) * ss))
                if wlse != 0 and lane == 0:
                    olse[h, n] = float32(math.log(tot)) + mx

    kernel.__name__ = f"merge_attn_states_{spec.kind}"
    return kernel


def variants():
    """Every ``(factory, spec, argtypes)`` the family's ops can launch (the PTX test compiles
    them all): the decode pass for each (query, cache) dtype pair and heads per CTA -- the
    vector path at every lane count of the configurations ``attention.vector_config`` picks
    (8 elements a lane for 2- and 4-byte caches, 16 for FP8 and for 2-byte caches of
    head_size > 64), and the scalar path (any strides), each with its in-kernel split merge;
    the separate split merge and ``merge_attn_states`` for each output dtype."""
    out = []
    for kind in KINDS:
        for cache in (kind, "fp8"):
            es = ESIZE[cache]
            vec = ([] if es == 1 else [(8, r, 2 if es == 4 else 4) for r in LANES])
            vec += ([(16, r, 4 if r > 4 else 2) for r in (4, 8, 16)] if es == 1 else
                    [(16, r, 4) for r in (8, 16)] if es == 2 else [])
            for gc in range(1, MAX_GC + 1):
                specs = [DecodeSpec(kind, cache, "vec", r, gc, tt, epl) for epl, r, tt in vec]
                specs.append(DecodeSpec(kind, cache, "scalar", SCALAR_LANES, gc))
                for spec in specs:
                    out.append((decode_kernel, spec, decode_argtypes(spec)))
        spec = MergeSpec(kind)
        out.append((split_merge_kernel, spec, merge_argtypes(spec)))
        out.append((merge_states_kernel, spec, states_argtypes(spec)))
    return out
