"""Row statistics of the sampling kernels, in one pass over a row (``_sampling_kernels``).

Every thread walks its part of a row once and keeps

* ``m``: the largest non-NaN logit (``-inf`` when none), ``mi`` the lowest index holding it,
  ``c`` how many elements equal it, ``m2`` the largest value below it (V1's tie check);
* ``s``: ``sum exp(x - m)`` over the elements other than ``-inf``, accumulated in float64 with
  ``exp`` in float32 (libdevice ``expf``); when the maximum grows, ``s`` is rescaled by
  ``exp(m_old - m_new)`` in float64 (online softmax), once per pair of 16-byte units (the
  pair's maximum first; :func:`row_walker`). A NaN element makes ``s`` NaN;
* ``nan_i``: the lowest index of a NaN (``torch.argmax`` returns it);
* with a given token ``t`` (logit ``x_t``, read first): ``cge = #{x >= x_t}`` and ``below``,
  the largest value under ``x_t`` (V1's tie check);
* with top-k: the thread's best ``MAX_LOGPROBS`` (value, index) pairs, NaN first, then larger
  values, then lower indices (:func:`loomnb.ops._reduce.argmax_combine`'s order).

Threads combine field by field with the scaffold's warp reductions (``group_reduce``), then
warps through shared memory (every warp repeats the second level, so every thread holds the
block's result); the top-k lists merge in ``k`` rounds of ``block_argmax``.
"""

from __future__ import annotations

import math

from numba import cuda, float32, float64, int64

from .._numba_internals import device
from ._reduce import block_argmax, fadd, fmax_nan, fmin_nan, group_reduce, imin
from ._vector import row_loader

MAX_LOGPROBS = 20          # vLLM's default max_logprobs: top-k lists hold this many
NO_INDEX = 1 << 52         # "no index" (exact in the simulator's float64 reductions)
UNIT = {"f32": 4, "bf16": 8}  # values per 16-byte unit


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
def logprob_of(x, m, lse):
    """The fp32 logprob of logit ``x``: ``r32(r32(x - m) - lse)`` (torch's and Triton's order)."""
    return float32(float32(x - m) - lse)


@device
def push(lv, li, v, i, K):
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


@cuda.jit(device=True)
def take_top_k(lv, li, k, av, ai, topv, topi, tid):
    """The block's ``k`` best (value, index) pairs into ``topv``/``topi`` (shared; thread 0
    writes them), best first: ``k`` rounds of ``block_argmax`` over the head of every thread's
    sorted list ``lv``/``li``, the thread holding the winner dropping it. ``av``/``ai``: the
    reduction's scratch; a barrier opens each round. ``tid``: the thread's index."""
    for j in range(k):
        cuda.syncthreads()
        wv, wi = block_argmax(lv[0], li[0], av, ai)
        if li[0] == wi:
            _pop(lv, li, MAX_LOGPROBS)
        if tid == 0:
            topv[j], topi[j] = wv, wi


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
def merge(a, b):
    """Two states (tuples of the eight fields) as one, in this order."""
    m = fmax_nan(a[0], b[0])
    s = _rescale(a[4], a[0], m) + _rescale(b[4], b[0], m)
    c = (a[2] if a[0] == m else int64(0)) + (b[2] if b[0] == m else int64(0))
    mi = imin(a[1] if a[0] == m else int64(NO_INDEX), b[1] if b[0] == m else int64(NO_INDEX))
    m2 = fmax_nan(a[3] if a[0] == m else a[0], b[3] if b[0] == m else b[0])
    return (m, mi, c, m2, s, imin(a[5], b[5]), a[6] + b[6], fmax_nan(a[7], b[7]))


def block_state_fn(need):
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
            w = IDENTITY
        return group_state(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7])

    return block_state


IDENTITY = (float32(-math.inf), int64(NO_INDEX), int64(0), float32(-math.inf), float64(0),
             int64(NO_INDEX), int64(0), float32(-math.inf))


def stepper(given, topk, track_m2, sumexp=True):
    """``step(x, i, st, xt, lv, li, do_topk, ms) -> st``: one element into a thread's state
    (into the top-k list too when the variant has one and ``do_topk``, i.e. ``k > 0``). The sum
    ``s`` is held relative to ``ms``, a maximum the walker raised beforehand to at least ``x``
    (:func:`row_walker`), so a step never rescales."""

    @device
    def step(x, i, st, xt, lv, li, do_topk, ms):
        m, mi, c, m2, s, nan_i, cge, below = st
        if x != x:
            nan_i = imin(nan_i, i)
            s = s + float64(x)
        else:
            if x > m:
                if track_m2:
                    m2 = m
                m, mi, c = x, i, int64(1)
            elif x == m:
                c += 1
                mi = imin(mi, i)
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
            push(lv, li, x, i, MAX_LOGPROBS)
        return (m, mi, c, m2, s, nan_i, cge, below)

    return step


@device
def _with_sum(st, s):
    return (st[0], st[1], st[2], st[3], s, st[5], st[6], st[7])


def row_walker(kind, layout, step, sumexp=True):
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
    state means what it did: ``s = sum exp(x - m)``. The walks read the thread indices, so they
    are ``cuda.jit(device=True)`` functions, not ``@device`` ones (plain functions under the
    simulator, which see no simulated thread outside the kernel's own module)."""
    unit_of, one = row_loader(kind, layout)
    UE = UNIT[kind]

    if layout == "scalar":
        @cuda.jit(device=True)
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
        @cuda.jit(device=True)
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
