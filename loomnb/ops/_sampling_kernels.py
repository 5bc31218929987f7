"""The sampling-family kernels: the logprob tail (greedy / given token, logprob, rank, top-k) and
Min-P, each one factory specialised by a frozen spec.

**Row statistics, one pass.** Every thread walks its part of a row once and keeps

* ``m``: the largest non-NaN logit (``-inf`` when none), ``mi`` the lowest index holding it,
  ``c`` how many elements equal it, ``m2`` the largest value below it (V1's tie check);
* ``s``: ``sum exp(x - m)`` over the elements other than ``-inf``, accumulated in float64 with
  ``exp`` in float32 (libdevice ``expf``); when the maximum grows, ``s`` is rescaled by
  ``exp(m_old - m_new)`` in float64 (online softmax), once per pair of 16-byte units (the
  pair's maximum first; :func:`_row_walker`). A NaN element makes ``s`` NaN;
* ``nan_i``: the lowest index of a NaN (``torch.argmax`` returns it);
* with a given token ``t`` (logit ``x_t``, read first): ``cge = #{x >= x_t}`` and ``below``,
  the largest value under ``x_t`` (V1's tie check);
* with top-k: the thread's best ``MAX_LOGPROBS`` (value, index) pairs, NaN first, then larger
  values, then lower indices (:func:`loomnb.ops._reduce.argmax_combine`'s order).

Threads combine field by field with the scaffold's warp reductions (``group_reduce``), then
warps through shared memory (every warp repeats the second level, so every thread holds the
block's result); the top-k lists merge in ``k`` rounds of ``block_argmax``.

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

from .._numba_internals import device
from ..layouts.dtypes import bits_f32
from . import _launch as L
from ._reduce import (REDUCE_SCRATCH, block_argmax, block_max, block_sum64, fadd, fmax_nan,
                      fmaxf, fmin_nan, group_reduce)
from ._vector import CODECS, load_u32x4, store_u32x4

MAX_LOGPROBS = 20          # vLLM's default max_logprobs: top-k lists hold this many
NO_INDEX = 1 << 52         # "no index" (exact in the simulator's float64 reductions)
NF = NI = 4 + MAX_LOGPROBS  # workspace fields per record (float64 / int64)
F_M, F_M2, F_BELOW, F_S = 0, 1, 2, 3        # ws_f fields, then the top-k values
I_C, I_MI, I_NAN, I_CGE = 0, 1, 2, 3        # ws_i fields, then the top-k indices
KINDS = ("f32", "bf16")
SAMPLERS = ("v1", "v2")
LAYOUTS = ("scalar", "vec")
UNIT = {"f32": 4, "bf16": 8}  # values per 16-byte unit
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
    return "uint32" if layout == "vec" else {"f32": "float32", "bf16": "uint16"}[kind]


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


# ---------------------------------------------------------------- device helpers
@device
def _imin(a, b):
    return a if a <= b else b


@device
def _better(va, ia, vb, ib):
    """(va, ia) comes before (vb, ib): NaN first, then the larger value, then the lower index."""
    a_nan, b_nan = va != va, vb != vb
    if a_nan or b_nan:
        return a_nan and (not b_nan or ia < ib)
    return va > vb or (va == vb and ia < ib)


@device
def _rescale(s, m_from, m_to):
    """``s * exp(m_from - m_to)`` in float64; an empty sum (0) stays 0 whatever the maxima."""
    if s == 0:
        return s
    return s * math.exp(float64(m_from) - float64(m_to))


@device
def _lp(x, m, lse):
    """The fp32 logprob of logit ``x``: ``r32(r32(x - m) - lse)`` (torch's and Triton's order)."""
    return float32(float32(x - m) - lse)


@device
def _push(lv, li, v, i, K):
    """Insert (v, i) into the sorted list ``lv``/``li`` of length ``K`` (every index static
    after unrolling, so the list stays in registers); the last entry falls off."""
    if _better(v, i, lv[K - 1], li[K - 1]):
        cv, ci = v, i
        for j in range(K):
            if _better(cv, ci, lv[j], li[j]):
                tv, ti = lv[j], li[j]
                lv[j], li[j] = cv, ci
                cv, ci = tv, ti


@device
def _pop(lv, li, K):
    for j in range(K - 1):
        lv[j], li[j] = lv[j + 1], li[j + 1]
    lv[K - 1], li[K - 1] = float32(-math.inf), int64(NO_INDEX)


def _loader(kind, layout):
    """(``unit_of(row, u)`` -> the values of 16-byte unit ``u`` (vec), ``one(row, i)`` -> element
    ``i`` as float32) for a row view of ``kind`` in ``layout``."""
    if layout == "scalar":
        dec = CODECS[kind].decode

        @device
        def one(row, i):
            return dec(row[i])

        return None, one
    if kind == "f32":
        @device
        def unit_of(row, u):
            w = load_u32x4(row, u << 2)
            return (bits_f32(w[0]), bits_f32(w[1]), bits_f32(w[2]), bits_f32(w[3]))

        @device
        def one(row, i):
            return bits_f32(row[i])

        return unit_of, one
    unpack = CODECS["bf16"].unpack

    @device
    def unit_of(row, u):
        w = load_u32x4(row, u << 2)
        a0, a1 = unpack(w[0])
        b0, b1 = unpack(w[1])
        c0, c1 = unpack(w[2])
        d0, d1 = unpack(w[3])
        return (a0, a1, b0, b1, c0, c1, d0, d1)

    @device
    def one(row, i):
        lo, hi = unpack(row[i >> 1])
        return hi if i & 1 else lo

    return unit_of, one


# per-field warp reductions (scaffold shuffles; simulator twins)
_wmax = group_reduce(fmax_nan, 32)
_wmin = group_reduce(fmin_nan, 32)
_wsum = group_reduce(fadd, 32)


def _group_state_fn(need):
    """``group_state(8 fields) -> 8 fields``: a warp's 32 states as one (every lane gets it).
    ``need`` = (argmax fields mi/c/nan_i, m2, sum s, given-token fields cge/below): fields a
    variant never reads are not reduced (they keep the identity)."""
    ARG, M2, SUM, GIVEN = need

    @device
    def group_state(m, mi, c, m2, s, nan_i, cge, below):
        gm = _wmax(m)
        on = m == gm
        gs = _wsum(_rescale(s, m, gm)) if SUM else float64(0)
        gc, gmi, gnan = int64(0), int64(NO_INDEX), int64(NO_INDEX)
        if ARG:
            gc = _wsum(c if on else int64(0))
            gmi = _wmin(mi if on else int64(NO_INDEX))
            gnan = _wmin(nan_i)
        gm2 = _wmax(m2 if on else m) if M2 else float32(-math.inf)
        gcge, gbelow = int64(0), float32(-math.inf)
        if GIVEN:
            gcge = _wsum(cge)
            gbelow = _wmax(below)
        return gm, gmi, gc, gm2, gs, gnan, gcge, gbelow

    return group_state


@device
def _merge(a, b):
    """Two states (tuples of the eight fields) as one, in this order."""
    m = fmax_nan(a[0], b[0])
    s = _rescale(a[4], a[0], m) + _rescale(b[4], b[0], m)
    c = (a[2] if a[0] == m else int64(0)) + (b[2] if b[0] == m else int64(0))
    mi = _imin(a[1] if a[0] == m else int64(NO_INDEX), b[1] if b[0] == m else int64(NO_INDEX))
    m2 = fmax_nan(a[3] if a[0] == m else a[0], b[3] if b[0] == m else b[0])
    return (m, mi, c, m2, s, _imin(a[5], b[5]), a[6] + b[6], fmax_nan(a[7], b[7]))


def _block_state(need):
    """``block_state(st, sh_f32, sh_f64, sh_i64)``: the block's statistics in every thread
    (fields as :func:`_group_state_fn`'s ``need``). The shared arrays hold one entry per warp and
    field (``[3, 32]`` f32, ``[32]`` f64, ``[5, 32]`` i64); the caller puts a barrier before
    reusing them. A one-warp block stops after the warp level."""
    group_state = _group_state_fn(need)

    @cuda.jit(device=True)
    def block_state(st, sf, sd, si):
        g = group_state(st[0], st[1], st[2], st[3], st[4], st[5], st[6], st[7])
        nw = cuda.blockDim.x >> 5
        if nw == 1:
            return g
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        if lane == 0:
            sf[0, warp], sf[1, warp], sf[2, warp] = g[0], g[3], g[7]
            sd[warp] = g[4]
            si[0, warp], si[1, warp], si[2, warp], si[3, warp] = g[1], g[2], g[5], g[6]
        cuda.syncthreads()
        if lane < nw:
            w = (sf[0, lane], si[0, lane], si[1, lane], sf[1, lane], sd[lane], si[2, lane],
                 si[3, lane], sf[2, lane])
        else:
            w = _IDENTITY
        return group_state(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7])

    return block_state


_IDENTITY = (float32(-math.inf), int64(NO_INDEX), int64(0), float32(-math.inf), float64(0),
             int64(NO_INDEX), int64(0), float32(-math.inf))


def _stepper(given, topk, track_m2, sumexp=True):
    """``step(x, i, st, xt, lv, li, do_topk, ms) -> st``: one element into a thread's state
    (into the top-k list too when the variant has one and ``do_topk``, i.e. ``k > 0``). The sum
    ``s`` is held relative to ``ms``, a maximum the walker raised beforehand to at least ``x``
    (:func:`_row_walker`), so a step never rescales."""

    @device
    def step(x, i, st, xt, lv, li, do_topk, ms):
        m, mi, c, m2, s, nan_i, cge, below = st
        if x != x:
            nan_i = _imin(nan_i, i)
            s = s + float64(x)
        else:
            if x > m:
                if track_m2:
                    m2 = m
                m, mi, c = x, i, int64(1)
            elif x == m:
                c += 1
                mi = _imin(mi, i)
            elif track_m2 and x > m2:
                m2 = x
            if sumexp and x != float32(-math.inf):
                s += float64(float32(math.exp(float32(x - ms))))
            if given:
                if x >= xt:
                    cge += 1
                elif x > below:
                    below = x
        if topk and do_topk:
            _push(lv, li, x, i, MAX_LOGPROBS)
        return (m, mi, c, m2, s, nan_i, cge, below)

    return step


@device
def _with_sum(st, s):
    return (st[0], st[1], st[2], st[3], s, st[5], st[6], st[7])


def _row_walker(kind, layout, step, sumexp=True):
    """``walk(row, lo, hi, st, xt, lv, li, do_topk) -> st``: elements ``[lo, hi)`` of a row
    view, this thread's share (stride ``blockDim``), in increasing index order; ``vec`` loads two
    units before using either (two 16-byte loads in flight per thread).

    The sum of exponentials is kept relative to ``ms``, the largest value seen so far, raised
    once per pair of units (``vec``) or per element (``scalar``) before the steps: ``s`` is
    rescaled by ``exp(ms_old - ms_new)`` (float64) at most once per pair of units, not at each
    element that raises the maximum. That rescale is the one float64 ``exp`` of the walk; in a
    warp it ran whenever any lane's maximum grew, which made it most of the kernel's
    instructions (Nsight Compute, 128 rows x 151,936: 6.5 float64 FMAs an element). At the
    end ``ms`` is the state's maximum ``m`` again (both are the largest non-NaN value), so the
    state means what it did: ``s = sum exp(x - m)``."""
    unit_of, one = _loader(kind, layout)
    UE = UNIT[kind]

    if layout == "scalar":
        @device
        def walk(row, lo, hi, st, xt, lv, li, do_topk):
            nt = cuda.blockDim.x
            ms = st[0]
            for i in range(lo + cuda.threadIdx.x, hi, nt):
                x = one(row, i)
                if sumexp and x > ms:
                    st = _with_sum(st, _rescale(st[4], ms, x))
                    ms = x
                st = step(x, i, st, xt, lv, li, do_topk, ms)
            return st
    else:
        @device
        def walk(row, lo, hi, st, xt, lv, li, do_topk):
            nt = cuda.blockDim.x
            u0, u1 = lo // UE, hi // UE
            ms = st[0]
            for u in range(u0 + cuda.threadIdx.x, u1, 2 * nt):
                a = unit_of(row, u)
                two = u + nt < u1
                b = unit_of(row, u + nt) if two else a
                if sumexp:
                    um = ms
                    for j in range(UE):  # NaN compares false: the largest non-NaN value
                        if a[j] > um:
                            um = a[j]
                        if b[j] > um:
                            um = b[j]
                    if um > ms:
                        st = _with_sum(st, _rescale(st[4], ms, um))
                        ms = um
                for j in range(UE):
                    st = step(a[j], u * UE + j, st, xt, lv, li, do_topk, ms)
                if two:
                    for j in range(UE):
                        st = step(b[j], (u + nt) * UE + j, st, xt, lv, li, do_topk, ms)
            return st
    return walk, one


# ---------------------------------------------------------------- the logprob tail
def logprob_kernel(spec):
    """The ``@cuda.jit`` function of ``spec`` (see the module docstring). Parameters:
    ``logits [R, V] (words in vec), token_ids [R] int64, tok_out [R] int64, idx_out [R, k+1]
    int32, lp_out [R, 1 or k+1] f32, rank_out [R] int64, ws_f [P, NF] f64, ws_i [P, NI] int64,
    counters [P] uint32, V, splits, chunk (elements), k, pad``."""
    GIVEN, TOPK, V1 = spec.given, spec.topk, spec.sampler == "v1"
    K = MAX_LOGPROBS
    step = _stepper(GIVEN, TOPK, V1 and not GIVEN)
    walk, one = _row_walker(spec.kind, spec.layout, step)
    block_state = _block_state((not GIVEN, V1 and not GIVEN, True, GIVEN))
    NEG_INF = float32(-math.inf)
    NAN = float32(math.nan)

    def kernel(logits, token_ids, tok_out, idx_out, lp_out, rank_out, ws_f, ws_i, counters,
               V, splits, chunk, k, pad):
        bid = int64(cuda.blockIdx.x)
        row = bid // splits
        split = bid - row * splits
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
        st = walk(lr, lo, hi, _IDENTITY, xt, lv, li, k > 0)
        st = block_state(st, sf, sd, si)
        if TOPK:
            for j in range(k):
                cuda.syncthreads()
                wv, wi = block_argmax(lv[0], li[0], av, ai)
                if li[0] == wi:
                    _pop(lv, li, K)
                if tid == 0:
                    topv[j], topi[j] = wv, wi

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
                cuda.threadfence()
                ticket = cuda.atomic.inc(counters, row, uint32(splits - 1))
                last[0] = 1 if ticket == splits - 1 else 0
            cuda.syncthreads()
            if last[0] == 0:
                return
            cuda.threadfence()
            # the last block of the row: fold every split's record, in split order per thread
            st = _IDENTITY
            for j in range(K):
                lv[j], li[j] = NEG_INF, int64(NO_INDEX)
            for q in range(tid, splits, nt):
                r = row * splits + q
                b = (float32(ws_f[r, F_M]), ws_i[r, I_MI], ws_i[r, I_C], float32(ws_f[r, F_M2]),
                     ws_f[r, F_S], ws_i[r, I_NAN], ws_i[r, I_CGE], float32(ws_f[r, F_BELOW]))
                st = _merge(st, b)
                if TOPK:
                    for j in range(k):
                        _push(lv, li, float32(ws_f[r, 4 + j]), ws_i[r, 4 + j], K)
            cuda.syncthreads()
            st = block_state(st, sf, sd, si)
            if TOPK:
                for j in range(k):
                    cuda.syncthreads()
                    wv, wi = block_argmax(lv[0], li[0], av, ai)
                    if li[0] == wi:
                        _pop(lv, li, K)
                    if tid == 0:
                        topv[j], topi[j] = wv, wi

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
        lp_t = _lp(xt, m, lse)
        if V1:
            rank = int64(0)
            if lp_t == lp_t:
                base, cand = (cge, below) if GIVEN else (c, m2)
                if cand < xt and _lp(cand, m, lse) >= lp_t:
                    n = float64(0)  # a value under x_t rounds onto logprob_t: count exactly
                    for i in range(tid, V, nt):
                        if _lp(one(lr, i), m, lse) >= lp_t:
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
                lp_out[row, 1 + tid] = _lp(topv[tid], m, lse)

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
    step = _stepper(False, False, False, sumexp=V1)
    walk, one = _row_walker("f32", spec.layout, step, sumexp=V1)
    block_state = _block_state((False, False, V1, False))
    VEC = spec.layout == "vec"

    @device
    def masked(x, m, S32, thr):
        if V1:
            return float32(float32(math.exp(float32(x - m))) / S32) < thr
        return x < thr

    def kernel(logits, min_p, ws_f, V, splits, chunk):
        bid = int64(cuda.blockIdx.x)
        row = bid // splits
        split = bid - row * splits
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
            st = walk(lr, lo, hi, _IDENTITY, float32(0), lv, li, False)
            st = block_state(st, sf, sd, si)
            if tid == 0:
                ws_f[row * splits + split, F_M] = st[0]
                ws_f[row * splits + split, F_S] = st[4]
            return
        st = _IDENTITY
        for q in range(tid, splits, nt):
            r = row * splits + q
            b = (float32(ws_f[r, F_M]), int64(NO_INDEX), int64(0), float32(-math.inf),
                 ws_f[r, F_S], int64(NO_INDEX), int64(0), float32(-math.inf))
            st = _merge(st, b)
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
