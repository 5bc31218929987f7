"""The sampling-family kernels: the logprob tail (greedy / given token, logprob, rank, top-k) and
Min-P, each one factory specialised by a frozen spec.

**Row statistics, one pass** (:mod:`loomnb.ops._sampling_rows`): every thread walks its part
of a row once, keeping the row's maximum, its index and count, the float64 sum of exponentials,
the first NaN, the given token's count and the top-k candidates; the block combines them.

**Many blocks per row** (``splits > 1``, few rows): block ``b`` handles elements
``[split * chunk, (split + 1) * chunk)`` of row ``b // splits``, writes its statistics to the
workspace (``ws_f``/``ws_i``, record ``row * splits + split``), fences, and takes a ticket with
``atomicInc(counters[row], splits - 1)``; the block that draws ``splits - 1`` is the last one,
and ``atomicInc`` wraps the counter back to 0 as it does, so the counters are zero again after
every launch (CUDA-graph replays included). The last block folds the records in split order
(deterministic: bit-identical run to run) and finishes the row.

**Finishing a row** (``L = r32(log(S))`` from the float64 sum, ``S`` NaN when ``m == -inf``):
``logprob(x) = r32(r32(x - m) - L)``; V1's rank counts ``logprob_v >= logprob_t``, which is
``#{x_v >= x_t}`` plus the values just below ``x_t`` whose logprob rounds onto ``logprob_t``:
when the largest value under ``x_t`` does, the row is counted again exactly (a second pass,
rare). V2's rank counts raw logits ``x_v >= x_t`` plus, for ``x_t = -inf``, the ``pad`` lanes
past the vocabulary that V2's 8192-wide blocks load as ``-inf``.

**Min-P** runs in two kernels: ``phase="stats"`` writes each split's ``(m, s)``; ``"mask"``
folds the row's records (every block of the row the same way) and writes ``-inf`` where V1's
``r32(r32(expf(r32(x - m))) / S32) < r32(r32(1 / S32) * min_p)`` or V2's
``x < r32(m + r32(log(min_p)))``. Rows whose ``min_p`` is 0 are not read or written.

Layouts: ``"vec"`` reads a row as 16-byte units of uint32 words (4 fp32 or 8 bf16 values; the
row must start on 16 bytes and hold whole units), ``"scalar"`` one element per step (any row
stride). Every index is 64-bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from numba import cuda, float32, float64, int32, int64, uint32

from .._dtypes import storage_dtype
from .._numba_internals import device
from ..layouts.dtypes import bits_f32
from . import _launch as L
from ._reduce import REDUCE_SCRATCH, block_max, block_sum64, fmaxf, last_block
from ._sampling_rows import (IDENTITY, MAX_LOGPROBS, NO_INDEX, block_state_fn, logprob_of, merge,
                             push, row_walker, stepper, take_top_k)
from ._vector import load_u32x4, store_u32x4

NF = NI = 4 + MAX_LOGPROBS  # workspace fields per record (float64 / int64)
F_M, F_M2, F_BELOW, F_S = 0, 1, 2, 3        # ws_f fields, then the top-k values
I_C, I_MI, I_NAN, I_CGE = 0, 1, 2, 3        # ws_i fields, then the top-k indices
KINDS = ("f32", "bf16")
SAMPLERS = ("v1", "v2")
LAYOUTS = ("scalar", "vec")
NEG_INF_BITS = 0xFF800000
MIN_P_UPT = 4  # 16-byte units a thread of Min-P has in flight (mask pass; V2's max pass)


@dataclass(frozen=True)
class LogprobSpec:
    kind: str             # logits dtype: "f32" or "bf16"
    sampler: str          # "v1" (rank on the fp32 logprobs) or "v2" (rank on the raw logits)
    given: bool = False   # column 0 is token_ids[row] (else the greedy argmax)
    topk: bool = False    # write indices/logprobs [R, k+1] with the k best tokens
    layout: str = "scalar"

    def __post_init__(self):
        assert self.kind in KINDS and self.sampler in SAMPLERS and self.layout in LAYOUTS


@dataclass(frozen=True)
class MinPSpec:
    sampler: str          # "v1" (probability space) or "v2" (logit space)
    phase: str            # "stats" (per-split max and sum) or "mask"
    layout: str = "scalar"

    def __post_init__(self):
        assert self.sampler in SAMPLERS and self.phase in ("stats", "mask") and self.layout in LAYOUTS


def _logits_type(kind, layout):
    return "uint32" if layout == "vec" else storage_dtype(kind)


def argtypes(spec):
    """The numba signature of ``logprob_kernel(spec)`` / ``min_p_kernel(spec)``."""
    i64 = L.i64(0).numba_type
    if isinstance(spec, MinPSpec):
        return (L.array_type(_logits_type("f32", spec.layout), 2), L.array_type("float32", 1),
                L.array_type("float64", 2), i64, i64, i64)
    return (L.array_type(_logits_type(spec.kind, spec.layout), 2), L.array_type("int64", 1),
            L.array_type("int64", 1), L.array_type("int32", 2), L.array_type("float32", 2),
            L.array_type("int64", 1), L.array_type("float64", 2), L.array_type("int64", 2),
            L.array_type("uint32", 1), i64, i64, i64, i64, i64)


@cuda.jit(device=True)
def _row_and_split(splits):
    """``(row, split)`` of this block: blocks ``row * splits ... row * splits + splits - 1``
    share row ``row``, each its split of the row's elements (64-bit)."""
    bid = int64(cuda.blockIdx.x)
    row = bid // splits
    return row, bid - row * splits


# ---------------------------------------------------------------- the logprob tail
def logprob_kernel(spec):
    """The ``@cuda.jit`` function of ``spec`` (see the module docstring). Parameters:
    ``logits [R, V] (words in vec), token_ids [R] int64, tok_out [R] int64, idx_out [R, k+1]
    int32, lp_out [R, 1 or k+1] f32, rank_out [R] int64, ws_f [P, NF] f64, ws_i [P, NI] int64,
    counters [P] uint32, V, splits, chunk (elements), k, pad``."""
    GIVEN, TOPK, V1 = spec.given, spec.topk, spec.sampler == "v1"
    K = MAX_LOGPROBS
    step = stepper(GIVEN, TOPK, V1 and not GIVEN)
    walk, one = row_walker(spec.kind, spec.layout, step)
    block_state = block_state_fn((not GIVEN, V1 and not GIVEN, True, GIVEN))
    NEG_INF = float32(-math.inf)
    NAN = float32(math.nan)

    def kernel(logits, token_ids, tok_out, idx_out, lp_out, rank_out, ws_f, ws_i, counters,
               V, splits, chunk, k, pad):
        row, split = _row_and_split(splits)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        lr = logits[row]
        sf = cuda.shared.array((3, 32), float32)
        sd = cuda.shared.array(32, float64)
        si = cuda.shared.array((5, 32), int64)
        av = cuda.shared.array(REDUCE_SCRATCH, float32)
        ai = cuda.shared.array(REDUCE_SCRATCH, int64)
        sc = cuda.shared.array(REDUCE_SCRATCH, float64)
        topv = cuda.shared.array(MAX_LOGPROBS, float32)
        topi = cuda.shared.array(MAX_LOGPROBS, int64)
        last = cuda.shared.array(1, int32)
        lv = cuda.local.array(MAX_LOGPROBS, float32)
        li = cuda.local.array(MAX_LOGPROBS, int64)
        for j in range(K):
            lv[j], li[j] = NEG_INF, int64(NO_INDEX)

        t = int64(0)
        xt = NAN
        if GIVEN:
            t = token_ids[row]
            if t >= 0 and t < V:
                xt = one(lr, t)
        lo = split * chunk
        hi = lo + chunk
        if hi > V:
            hi = V
        st = walk(lr, lo, hi, IDENTITY, xt, lv, li, k > 0)
        st = block_state(st, sf, sd, si)
        if TOPK:
            take_top_k(lv, li, k, av, ai, topv, topi, tid)

        if splits > 1:
            rec = row * splits + split
            if tid == 0:
                ws_f[rec, F_M], ws_f[rec, F_M2] = st[0], st[3]
                ws_f[rec, F_BELOW], ws_f[rec, F_S] = st[7], st[4]
                ws_i[rec, I_C], ws_i[rec, I_MI], ws_i[rec, I_NAN] = st[2], st[1], st[5]
                ws_i[rec, I_CGE] = st[6]
                if TOPK:
                    for j in range(k):
                        ws_f[rec, 4 + j], ws_i[rec, 4 + j] = topv[j], topi[j]
            if not last_block(counters, row, splits, last):
                return
            # the last block of the row: fold every split's record, in split order per thread
            st = IDENTITY
            for j in range(K):
                lv[j], li[j] = NEG_INF, int64(NO_INDEX)
            for q in range(tid, splits, nt):
                r = row * splits + q
                b = (float32(ws_f[r, F_M]), ws_i[r, I_MI], ws_i[r, I_C], float32(ws_f[r, F_M2]),
                     ws_f[r, F_S], ws_i[r, I_NAN], ws_i[r, I_CGE], float32(ws_f[r, F_BELOW]))
                st = merge(st, b)
                if TOPK:
                    for j in range(k):
                        push(lv, li, float32(ws_f[r, 4 + j]), ws_i[r, 4 + j], K)
            cuda.syncthreads()
            st = block_state(st, sf, sd, si)
            if TOPK:
                take_top_k(lv, li, k, av, ai, topv, topi, tid)

        # ---- finish the row (every thread holds the same statistics)
        m, mi, c, m2, s, nan_i, cge, below = st
        if m == NEG_INF:
            s = float64(math.nan)
        lse = float32(math.log(s))
        if not GIVEN:
            if nan_i < NO_INDEX:
                t, xt = nan_i, NAN
            else:
                t, xt = mi, m
        lp_t = logprob_of(xt, m, lse)
        if V1:
            rank = int64(0)
            if lp_t == lp_t:
                base, cand = (cge, below) if GIVEN else (c, m2)
                if cand < xt and logprob_of(cand, m, lse) >= lp_t:
                    n = float64(0)  # a value under x_t rounds onto logprob_t: count exactly
                    for i in range(tid, V, nt):
                        if logprob_of(one(lr, i), m, lse) >= lp_t:
                            n += 1
                    cuda.syncthreads()
                    rank = int64(block_sum64(n, sc))
                else:
                    rank = base
        else:
            rank = int64(0)
            if xt == xt:
                rank = (cge if GIVEN else c) + (pad if xt == NEG_INF else int64(0))
        if tid == 0:
            if TOPK:
                idx_out[row, 0] = int32(t)
            elif not GIVEN:
                tok_out[row] = t
            lp_out[row, 0] = lp_t
            rank_out[row] = rank
        if TOPK:
            cuda.syncthreads()
            if tid < k:
                idx_out[row, 1 + tid] = int32(topi[tid])
                lp_out[row, 1 + tid] = logprob_of(topv[tid], m, lse)

    kernel.__name__ = (f"logprob_{spec.kind}_{spec.sampler}_{'given' if GIVEN else 'greedy'}"
                       f"{'_topk' if TOPK else ''}_{spec.layout}")
    return kernel


# ---------------------------------------------------------------- Min-P
@device
def log_min_p(mp):
    """``log(min_p)`` in float64 for every float ``min_p``: ``-inf`` at 0, ``+inf`` at ``+inf``,
    NaN for a negative or NaN ``min_p`` (V2's threshold is then NaN and masks nothing, as a
    negative ``min_p`` does in V1). Python's ``math.log`` raises there, so the simulator needs
    the branches; on the GPU they give what ``log`` gives."""
    if mp > 0:
        return math.log(mp)
    if mp == 0:
        return -math.inf
    return math.nan


@device
def _fetch_units(lr, ub, nt, u1, wv):
    """Units ``ub + j*nt`` (``j < MIN_P_UPT``) of a row into ``wv``, every load issued before any
    is used; a unit past ``u1`` reads as four ``-inf``."""
    for j in range(MIN_P_UPT):
        if ub + j * nt < u1:
            w = load_u32x4(lr, (ub + j * nt) << 2)
            for k in range(4):
                wv[4 * j + k] = w[k]
        else:
            for k in range(4):
                wv[4 * j + k] = uint32(NEG_INF_BITS)


def min_p_kernel(spec):
    """The ``@cuda.jit`` function of ``spec``. Parameters: ``logits [R, V] fp32 (words in vec),
    min_p [R] f32, ws_f [P, NF] f64, V, splits, chunk``."""
    V1, MASK = spec.sampler == "v1", spec.phase == "mask"
    WV = 4 * MIN_P_UPT
    step = stepper(False, False, False, sumexp=V1)
    walk, one = row_walker("f32", spec.layout, step, sumexp=V1)
    block_state = block_state_fn((False, False, V1, False))
    VEC = spec.layout == "vec"

    @device
    def masked(x, m, S32, thr):
        if V1:
            return float32(float32(math.exp(float32(x - m))) / S32) < thr
        return x < thr

    def kernel(logits, min_p, ws_f, V, splits, chunk):
        row, split = _row_and_split(splits)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        mp = min_p[row]
        if mp == float32(0):
            return  # vLLM skips these rows: nothing read or written
        lr = logits[row]
        sf = cuda.shared.array((3, 32), float32)
        sd = cuda.shared.array(32, float64)
        si = cuda.shared.array((5, 32), int64)
        sm = cuda.shared.array(REDUCE_SCRATCH, float32)
        lv = cuda.local.array(1, float32)
        li = cuda.local.array(1, int64)
        lo = split * chunk
        hi = lo + chunk
        if hi > V:
            hi = V
        wv = cuda.local.array(WV, uint32)
        if VEC and not MASK and not V1:  # V2 needs the largest non-NaN value only
            u1 = hi // 4
            m = float32(-math.inf)
            for ub in range(lo // 4 + tid, u1, MIN_P_UPT * nt):
                _fetch_units(lr, ub, nt, u1, wv)
                for k in range(4 * MIN_P_UPT):
                    m = fmaxf(m, bits_f32(wv[k]))
            m = block_max(m, sm)
            if tid == 0:
                ws_f[row * splits + split, F_M] = m
                ws_f[row * splits + split, F_S] = float64(0)
            return
        if not MASK:
            st = walk(lr, lo, hi, IDENTITY, float32(0), lv, li, False)
            st = block_state(st, sf, sd, si)
            if tid == 0:
                ws_f[row * splits + split, F_M] = st[0]
                ws_f[row * splits + split, F_S] = st[4]
            return
        st = IDENTITY
        for q in range(tid, splits, nt):
            r = row * splits + q
            b = (float32(ws_f[r, F_M]), int64(NO_INDEX), int64(0), float32(-math.inf),
                 ws_f[r, F_S], int64(NO_INDEX), int64(0), float32(-math.inf))
            st = merge(st, b)
        st = block_state(st, sf, sd, si)
        m, s = st[0], st[4]
        S32 = float32(0)
        if V1:
            if m == float32(-math.inf):
                s = float64(math.nan)
            S32 = float32(s)
            thr = float32(float32(float32(1) / S32) * mp)
        else:
            thr = float32(m + float32(log_min_p(float64(mp))))
        if VEC:
            u1 = hi // 4
            for ub in range(lo // 4 + tid, u1, MIN_P_UPT * nt):
                _fetch_units(lr, ub, nt, u1, wv)
                for j in range(MIN_P_UPT):
                    u = ub + j * nt
                    if u < u1:
                        w0, w1, w2, w3 = wv[4 * j], wv[4 * j + 1], wv[4 * j + 2], wv[4 * j + 3]
                        k0 = masked(bits_f32(w0), m, S32, thr)
                        k1 = masked(bits_f32(w1), m, S32, thr)
                        k2 = masked(bits_f32(w2), m, S32, thr)
                        k3 = masked(bits_f32(w3), m, S32, thr)
                        if k0 or k1 or k2 or k3:  # a unit with a masked element is written whole
                            store_u32x4(lr, u << 2, (uint32(NEG_INF_BITS) if k0 else w0,
                                                     uint32(NEG_INF_BITS) if k1 else w1,
                                                     uint32(NEG_INF_BITS) if k2 else w2,
                                                     uint32(NEG_INF_BITS) if k3 else w3))
        else:
            for i in range(lo + tid, hi, nt):
                if masked(lr[i], m, S32, thr):
                    lr[i] = float32(-math.inf)

    kernel.__name__ = f"min_p_{spec.sampler}_{spec.phase}_{spec.layout}"
    return kernel


def variants():
    """Every ``(factory, spec, argtypes)`` the family's ops can launch (the PTX test compiles
    them all): both samplers, both layouts, each op's (given, topk) pair; Min-P's two phases."""
    out = []
    for kind in KINDS:
        for sampler in SAMPLERS:
            for given, topk in ((False, False), (True, False), (False, True), (True, True)):
                for layout in LAYOUTS:
                    spec = LogprobSpec(kind, sampler, given, topk, layout)
                    out.append((logprob_kernel, spec, argtypes(spec)))
    for sampler in SAMPLERS:
        for phase in ("stats", "mask"):
            for layout in LAYOUTS:
                spec = MinPSpec(sampler, phase, layout)
                out.append((min_p_kernel, spec, argtypes(spec)))
    return out
