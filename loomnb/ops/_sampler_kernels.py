"""The sampler family's kernels: logits penalties (elementwise), one row kernel for every
top-k / top-p / min-p filter, renormalisation and seeded sample, and the split kernels that
spread each of a few rows over many blocks (the block comment "split rows" below).

**Penalties** (``penalty_kernel``): one thread an element, a 2-D grid of (row chunks, rows);
vLLM's formulas in its order (see ``loomnb.ops.sampler``), every step rounded as vLLM's CUDA
op and torch's in-place float32 arithmetic round it.

**The row kernel** (``row_kernel``): one block a row, several passes over the row (the row is
read from L2 after the first). A pass loads ``G = 4`` units a thread before it uses any: 16-byte
vectors where every row is 16-byte aligned and holds whole vectors (layout "vec"), four
elements read one by one otherwise ("scalar"), so a pass is bound by bytes, not by one load's
latency. Every filter keeps a prefix of the row's tokens in descending
order of their ordered 32-bit key (the float's bits made unsigned-monotone: ``+-0`` as one key,
NaN below everything and never kept), so each filter is a threshold on that key, found by a
radix select: four levels of 8-bit digits, most significant first; at each level the block
histograms the digit of the elements whose higher digits equal the prefix found so far, and a
block scan from the top bin finds the bin where the running total first reaches the target.
The histogram has 16 copies of the 256 bins in shared memory, lane ``l`` of every warp adding to
copy ``l % 16`` (a copy's stride of 257 bins puts one bin of different copies in different
banks), so the lanes of a warp that hit the same bin -- most of them at the first level, where
a row's values share a few exponents -- add to different words; the copies are summed after.
A bin is exact 64-bit, kept as two uint32 words added to with 32-bit atomics and a carry
(``_reduce.wide_add``): a 64-bit shared-memory atomic add is a compare-and-swap loop on sm_90,
which under the first level's contention made the row kernel 1.6x slower.

* top-k: the weight is 1 and the target ``k``: the threshold is the ``k``-th largest key, and
  every element with that key is kept (ties at the boundary too).
* top-p: the weight is the token's mass in fixed point, ``W = floor(w * 2^32)`` (int64) with
  ``w = expf(r32(r32(x / T) - r32(x_max / T)))`` from logits (1 for ``x = x_max``) or
  ``r32(p * r32(1 / p_max))`` from probabilities, and the target ``top_p * Z`` (float64; ``Z``
  the sum of ``W`` over the candidates). A token is kept when the mass of the keys above its own
  is below the target: the smallest prefix whose mass reaches ``top_p``, ties kept. Integer sums
  make the choice independent of the order of the atomics (deterministic).
* min-p: a predicate, ``w >= min_p`` from logits (``p / p_max >= min_p``) or ``p >= r32(p_max *
  min_p)`` from probabilities.

At each level one block scan over the 256 bins (from the top) gives every bin the weight above
it; the bins that reach the target take a shared atomic min, the non-empty ones an atomic max
(the last non-empty bin when none reaches it): one barrier a level. **Candidates**: as soon as
top-k's select finds at most ``CAP = 1024`` eligible elements at or above the prefix found so
far, one pass copies them into shared memory as uint64 order keys (value, then index: the
value is recovered from the key), and the remaining levels, top-p over the top-k set and the
sample read those instead of the row (the kept set is inside them). So a top-k + top-p sample
reads the row 3-4 times (the max, one or two levels, the copy) instead of 10. Top-p alone (or
"joint") selects over the whole row.

Then the row's output: a sample is the Gumbel-max over the kept tokens, ``argmax r32(s + g)``
with ``s = r32(x / T)`` (or ``log p``) and ``g = -log(-log(u))``, ``u`` from Philox-4x32-10
(``_philox``) at key ``(seed_lo, seed_hi)`` and counter ``(i >> 2, salt, offset_lo,
offset_hi)``, word ``i & 3`` for token ``i`` (``salt`` is the row unless every row has its own
seed); the lowest index wins a tie. A row at temperature ``< 1e-5`` takes the argmax instead
(the lowest index of the largest non-NaN logit). ``mask`` writes the logits with the dropped
tokens at ``-inf``; ``processed`` writes fp32 ``s = r32(x / T)`` for the kept tokens and
``-inf`` elsewhere (a row at temperature ``< 1e-5``: its logits, unfiltered); ``renorm``
writes ``r32(p / r32(S))`` for the kept tokens and 0 elsewhere, ``S`` their float64 sum (a
block reduction in thread order: deterministic).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

from numba import cuda, float32, float64, int32, int64, uint32, uint64

from .._dtypes import storage_dtype
from .._numba_internals import device
from ..layouts.dtypes import f32_bits
from . import _launch as L
from ._philox import gumbel, philox
from ._reduce import (REDUCE_SCRATCH, block_max_u64, block_reduce, block_scan,
                      key_index, key_value, last_block, mul_rn, order_key, umax, wide_add,
                      wide_get)
from ._vector import CODECS, UNIT_ELEMS, row_loader

KINDS = ("f32", "bf16", "f16")
SOURCES = ("logits", "probs")
OUTPUTS = ("sample", "mask", "renorm", "processed")
BINS = 256          # radix digit: 8 bits
LEVELS = 4          # 32-bit keys
COPIES = 16         # histogram copies: lane l adds to copy l % COPIES
STRIDE = BINS + 1   # a copy's stride (bins of two words): copies of a bin in different banks
HIST = COPIES * STRIDE  # bins
HIST_WORDS = 2 * HIST   # uint32 words: two a bin (``wide_add``)
MASS_SCALE = 4294967296.0   # 2^32: the fixed point of a token's mass
SAMPLING_EPS = 1e-5         # vLLM's _SAMPLING_EPS: a lower temperature is greedy
NO_BIN = 1 << 20
G = 4               # units a thread loads in a pass before it uses any (loads in flight)
CAP = 1024          # candidates a row may compact into shared memory (uint64 order keys)
LAYOUTS = ("vec", "scalar")
PENALTY_MODES = ("repetition", "all")


@dataclass(frozen=True)
class RowSpec:
    kind: str             # the row's dtype
    source: str           # "logits" or "probs"
    output: str           # "sample", "mask" or "processed" (logits), "renorm" (probs)
    joint: bool = False   # top-p on the whole row's mass (FlashInfer's "joint"), else on top-k's
    layout: str = "vec"   # "vec": 16-byte loads (rows aligned, whole units); "scalar"
    finish: bool = False  # finish a split top-k sample (state and candidates of the split kernels)

    def __post_init__(self):
        assert self.kind in KINDS and self.source in SOURCES and self.output in OUTPUTS
        assert self.layout in LAYOUTS
        assert not self.finish or (self.output == "sample" and not self.joint
                                   and self.layout == "vec")
        assert not (self.output in ("mask", "processed") and self.source != "logits")
        assert not (self.output == "renorm" and self.source != "probs")


@dataclass(frozen=True)
class PenaltySpec:
    kind: str             # logits dtype
    mode: str             # "repetition" (vLLM's CUDA op) or "all" (apply_penalties)
    counts: str = "i32"   # output_token_counts dtype in "all"

    def __post_init__(self):
        assert self.kind in KINDS and self.mode in PENALTY_MODES and self.counts in ("i32", "i64")


@device
def fkey(v):
    """The ordered key of float32 ``v``: unsigned order = float order, ``-0.0`` as ``+0.0``,
    every NaN 0 (below ``-inf``, whose key is ``0x007FFFFF``)."""
    if v != v:
        return uint32(0)
    b = uint32(f32_bits(v + float32(0)))
    if (b & uint32(0x80000000)) != 0:
        return uint32(b ^ uint32(0xFFFFFFFF))
    return uint32(b | uint32(0x80000000))


@device
def _add_f64(a, b):
    return a + b


_block_sum_f64 = block_reduce(_add_f64, float64)
_block_scan_i64 = block_scan(int64)


@device
def _request_key(sd, so, seed_val, off_val, per_row_seed, row):
    """``(salt, c2, c3, k0, k1)``: the Philox counter words 1-3 and key of request ``row``,
    from the seed and offset arguments (the row kernel's and the chain kernel's)."""
    seed = seed_val
    off = off_val
    if sd.shape[0] > 0:
        seed = sd[row] if per_row_seed != 0 else sd[0]
    if so.shape[0] > 0:
        off = so[row] if so.shape[0] > 1 else so[0]
    salt = uint32(0) if per_row_seed != 0 else uint32(row)
    useed = uint64(seed)
    uoff = uint64(off)
    return (salt, uint32(uoff & uint64(0xFFFFFFFF)), uint32(uoff >> uint64(32)),
            uint32(useed & uint64(0xFFFFFFFF)), uint32(useed >> uint64(32)))


@device
def _row_config(tk, tp, tt, tmp, row, k_val, p_val, t_val, mp_val, V, logits_sample):
    """``(k, p, T, min_p, use_k, use_p, use_min_p, greedy)`` of ``row``: its entries of the
    per-row arrays (length 0: the scalar), ``T = 1`` unless the kernel samples or processes
    logits (``logits_sample``)."""
    k = int64(tk[row]) if tk.shape[0] > 0 else k_val
    p = tp[row] if tp.shape[0] > 0 else p_val
    t = tt[row] if tt.shape[0] > 0 else t_val
    mpv = tmp[row] if tmp.shape[0] > 0 else mp_val
    if not logits_sample:
        t = float32(1)
    use_k = k > 0 and k < V
    use_p = p < float32(1)
    use_mp = mpv > float32(0)
    greedy = logits_sample and t < float32(SAMPLING_EPS)
    return k, p, t, mpv, use_k, use_p, use_mp, greedy


def output_storage(spec):
    """The storage dtype of a row kernel's ``y``: fp32 for renorm and processed logits, the
    logits' for a mask."""
    return "float32" if spec.output in ("renorm", "processed") else storage_dtype(spec.kind)


def _row_argtypes(spec):
    st = storage_dtype(spec.kind)
    xs = "uint32" if spec.layout == "vec" else st
    y = output_storage(spec)
    i64, f32 = L.i64(0).numba_type, L.f32(0).numba_type
    return (L.array_type(xs, 2), L.array_type("int32", 1), L.array_type(y, 2),
            L.array_type("int32", 1), L.array_type("float32", 1), L.array_type("float32", 1),
            L.array_type("float32", 1), L.array_type("int64", 1), L.array_type("int64", 1),
            i64, f32, f32, f32, i64, i64, i64, i64, i64, L.array_type("int64", 2),
            L.array_type("uint64", 2), L.array_type("int32", 1))


def _unit_loader(kind, layout):
    """``(UE, load(row, u, V))``: a pass's unit of ``UE`` values, ``load`` returning unit ``u``
    of the row as float32 values -- a 16-byte vector (layout "vec", the row as uint32 words) or
    four elements read one by one (layout "scalar"; NaN past ``V``, never used)."""
    if layout == "vec":
        unit_of = row_loader(kind, "vec")[0]

        @device
        def load_vec(row, u, V):
            return unit_of(row, u)

        return UNIT_ELEMS[kind], load_vec
    one = row_loader(kind, "scalar")[1]

    @device
    def load_quad(row, u, V):
        i = 4 * u
        nan = float32(math.nan)
        return (one(row, i) if i < V else nan, one(row, i + 1) if i + 1 < V else nan,
                one(row, i + 2) if i + 2 < V else nan, one(row, i + 3) if i + 3 < V else nan)

    return 4, load_quad


def _chunk_pass(UE, load, visit, loads=G):
    """``run(row, V, u0, nu, st, ctx) -> st``: this thread's units ``u0 <= u < nu`` of the row
    (stride ``blockDim``), ``G`` of them loaded before any is used (G loads in flight: a pass is
    bound by the bytes, not by one load's latency), each given to ``visit(unit, first_index, V,
    st, ctx) -> st``. ``loads=1``: one unit at a time (the split kernels, whose many blocks keep
    the loads in flight, and whose registers set how many blocks an SM holds)."""
    if loads == 1:
        @device
        def run1(row, V, u0, nu, st, ctx):
            for u in range(u0 + cuda.threadIdx.x, nu, cuda.blockDim.x):
                st = visit(load(row, u, V), u * UE, V, st, ctx)
            return st

        return run1
    assert loads == G

    @device
    def run(row, V, u0, nu, st, ctx):
        nt = cuda.blockDim.x
        for u in range(u0 + cuda.threadIdx.x, nu, G * nt):
            u1 = u + nt
            u2 = u1 + nt
            u3 = u2 + nt
            a = load(row, u, V)
            b = load(row, u1 if u1 < nu else u, V)
            c = load(row, u2 if u2 < nu else u, V)
            d = load(row, u3 if u3 < nu else u, V)
            st = visit(a, u * UE, V, st, ctx)
            if u1 < nu:
                st = visit(b, u1 * UE, V, st, ctx)
            if u2 < nu:
                st = visit(c, u2 * UE, V, st, ctx)
            if u3 < nu:
                st = visit(d, u3 * UE, V, st, ctx)
        return st

    return run


def _row_pass(UE, load, visit):
    """``run(row, V, st, ctx) -> st``: :func:`_chunk_pass` over the whole row."""
    chunk = _chunk_pass(UE, load, visit)

    @device
    def run(row, V, st, ctx):
        return chunk(row, V, 0, (V + UE - 1) // UE, st, ctx)

    return run


def _row_parts(kind, source, layout):
    """The per-element steps of a row (the row kernel's and the split kernels'): the unit
    loader, the filters' ``weight``/``eligible``/``score``, ``hist_one`` and the unit visitors
    of the passes, as a namespace."""
    UE, load = _unit_loader(kind, layout)
    LOGITS = source == "logits"
    WHOLE = layout == "vec"  # rows of whole 16-byte units: no element past V in a unit
    NEG_INF = float32(-math.inf)
    enc = CODECS[kind].encode

    @device
    def weight(v, xm, sm, t, inv):
        """``w``: the token's probability over the row's largest (see the module docstring)."""
        if LOGITS:
            if v == xm:
                return float32(1)
            return float32(math.exp(float32(float32(v / t) - sm)))
        return float32(v * inv)

    @device
    def eligible(v, key, f):
        """``f = (lo, x_max, x_max / T, T, 1 / p_max, use_min_p, min_p threshold)``."""
        if v != v or key < f[0]:
            return False
        if f[5]:
            if LOGITS:
                return weight(v, f[1], f[2], f[3], f[4]) >= f[6]
            return v >= f[6]
        return True

    @device
    def derive(xm, t, mpv, use_mp):
        """``(x_max / T, 1 / p_max, min-p threshold)`` of a row of largest value ``xm``."""
        sm = float32(xm / t) if LOGITS else float32(0)
        inv = float32(0)
        if not LOGITS and xm > float32(0):
            inv = float32(float32(1) / xm)
        thr = mpv
        if use_mp and not LOGITS:
            thr = float32(xm * mpv)
        return sm, inv, thr

    @device
    def score(v, t):
        if LOGITS:
            return float32(v / t)
        if v > float32(0):
            return float32(math.log(v))
        return NEG_INF

    # ---- per-element steps, shared by the row passes and the candidate loops
    @device
    def hist_one(v, hist, copy, prefix, pmask, shift, mass, f):
        key = fkey(v)
        if (key & pmask) == prefix and eligible(v, key, f):
            w = int64(1)
            if mass:
                w = int64(weight(v, f[1], f[2], f[3], f[4]) * float32(MASS_SCALE))
            if w > 0:
                wide_add(hist, copy * STRIDE + int32((key >> shift) & uint32(255)), w)

    # ---- unit visitors
    @device
    def v_max(a, i0, V, best, ctx):
        """``best = (value, index)``: the largest value above -inf, the lowest index first
        (index -1: none yet); NaN never replaces it. See :func:`max_key`."""
        bv, bi = best
        for j in range(UE):
            if WHOLE or i0 + j < V:
                v = a[j]
                if v > bv:
                    bv = v
                    bi = i0 + j
        return bv, bi

    @device
    def max_key(best, u_first, nu):
        """The order key of a thread's :func:`v_max` result ``best``, whose first unit was
        ``u_first`` (of ``nu``): ``order_key(value, index)`` -- as the largest key over the
        thread's elements with NaN as -inf -- or, when every element was -inf or NaN, that of
        -inf at its first element (the lowest index), 0 when it had none."""
        if best[1] >= 0:
            return order_key(best[0], best[1])
        if u_first < nu:
            return order_key(NEG_INF, u_first * UE)
        return uint64(0)

    @device
    def v_hist(a, i0, V, st, ctx):
        for j in range(UE):
            if WHOLE or i0 + j < V:
                hist_one(a[j], ctx[0], ctx[1], ctx[2], ctx[3], ctx[4], ctx[5], ctx[6])
        return st

    @device
    def v_compact(a, i0, V, st, ctx):
        cand, cnt, floor, f = ctx
        for j in range(UE):
            if WHOLE or i0 + j < V:
                v = a[j]
                key = fkey(v)
                if key >= floor and eligible(v, key, f):
                    s = cuda.atomic.add(cnt, 0, 1)
                    if s < CAP:
                        cand[s] = order_key(v, i0 + j)
        return st

    @device
    def v_sample(a, i0, V, best, ctx):
        salt, c2, c3, k0, k1, f = ctx
        for q in range(UE // 4):  # Philox's four words serve four consecutive tokens
            w0 = w1 = w2 = w3 = uint32(0)
            drawn = False
            for jj in range(4):
                j = 4 * q + jj
                if WHOLE or i0 + j < V:
                    v = a[j]
                    if eligible(v, fkey(v), f):
                        if not drawn:
                            w0, w1, w2, w3 = philox(uint32((i0 >> 2) + q), salt, c2, c3, k0, k1)
                            drawn = True
                        w = w0 if jj == 0 else (w1 if jj == 1 else (w2 if jj == 2 else w3))
                        best = umax(best, order_key(float32(score(v, f[3]) + gumbel(w)), i0 + j))
        return best

    @device
    def v_mask(a, i0, V, st, ctx):
        yr, lo = ctx
        for j in range(UE):
            if WHOLE or i0 + j < V:
                v = a[j]
                yr[i0 + j] = enc(v) if (v == v and fkey(v) >= lo) else enc(NEG_INF)
        return st

    @device
    def v_processed(a, i0, V, st, ctx):
        yr, f, raw = ctx
        for j in range(UE):
            if WHOLE or i0 + j < V:
                v = a[j]
                if raw:
                    yr[i0 + j] = v
                else:
                    yr[i0 + j] = score(v, f[3]) if eligible(v, fkey(v), f) else NEG_INF
        return st

    @device
    def v_sum(a, i0, V, s, f):
        for j in range(UE):
            if WHOLE or i0 + j < V:
                v = a[j]
                if eligible(v, fkey(v), f):
                    s += float64(v)
        return s

    @device
    def v_renorm(a, i0, V, st, ctx):
        yr, s32, f = ctx
        for j in range(UE):
            if WHOLE or i0 + j < V:
                v = a[j]
                yr[i0 + j] = float32(v / s32) if eligible(v, fkey(v), f) else float32(0)
        return st

    return types.SimpleNamespace(
        UE=UE, load=load, weight=weight, eligible=eligible, derive=derive, score=score,
        hist_one=hist_one, max_key=max_key,
        v_max=v_max, v_hist=v_hist, v_compact=v_compact, v_sample=v_sample, v_mask=v_mask,
        v_processed=v_processed, v_sum=v_sum, v_renorm=v_renorm)


def row_kernel(spec):
    """The ``@cuda.jit`` function of ``spec``. Parameters: ``x [R, V]`` (storage dtype; layout
    "vec": its rows as uint32 words), ``ids [R]`` int32 (sample), ``y [R, V]`` (mask: logits
    dtype; renorm: fp32), the per-row ``top_k`` int32, ``top_p``, ``temperature``, ``min_p``
    fp32, ``seed``, ``offset`` int64 arrays (length 0 where the scalar after them holds for every
    row), then ``k, p, T, min_p, seed, offset`` scalars, ``per_row_seed`` (1: ``seed[r]`` is row
    r's and the salt is 0), ``V`` and ``cap``, the candidates a row may compact (``<= CAP``;
    tests lower it to reach every path, -1 never compacts)."""
    P = _row_parts(spec.kind, spec.source, spec.layout)
    UE, load, weight, eligible, score = P.UE, P.load, P.weight, P.eligible, P.score
    derive = P.derive
    hist_one, v_max, v_hist, v_compact = P.hist_one, P.v_max, P.v_hist, P.v_compact
    max_key = P.max_key
    v_sample, v_mask, v_sum, v_renorm = P.v_sample, P.v_mask, P.v_sum, P.v_renorm
    LOGITS = spec.source == "logits"
    SAMPLE, MASK, RENORM, PROCESSED = (spec.output == o for o in OUTPUTS)
    JOINT = spec.joint
    FINISH = spec.finish
    NEG_INF = float32(-math.inf)

    max_pass = _row_pass(UE, load, v_max)
    hist_pass = _row_pass(UE, load, v_hist)
    compact_pass = _row_pass(UE, load, v_compact)
    sample_pass = _row_pass(UE, load, v_sample)
    mask_pass = _row_pass(UE, load, v_mask)
    sum_pass = _row_pass(UE, load, v_sum)
    renorm_pass = _row_pass(UE, load, v_renorm)
    processed_pass = _row_pass(UE, load, P.v_processed)

    @device
    def row_max(lr, V, nu, scr_u):
        """The row's largest key (NaN as -inf, the lowest index first), in every thread."""
        best = block_max_u64(max_key(max_pass(lr, V, (NEG_INF, int64(-1)), int64(0)),
                                     int64(cuda.threadIdx.x), nu), scr_u)
        cuda.syncthreads()
        return best

    @device
    def select(lr, V, mass, p, f, n, cap, sh):
        """``(threshold key, n)``: the threshold of top-k (``mass`` False: target ``p``
        elements) or top-p (``mass`` True: target ``p`` times the candidates' mass) over the
        eligible elements (``f``; key ``>= f[0]``), ``f[0]`` if there are none. The elements
        are the row's, or, with ``n >= 0``, the ``n`` candidates in shared memory. Reading the
        row, as soon as at most ``cap`` eligible elements share the prefix found so far or lie
        above it, one pass copies them to the candidates and ``n`` becomes their count:
        the later levels, filters and the sample read shared memory, not the row."""
        hist, tot, above, res, cand, cnt, scr_i = sh
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        copy = (tid & 31) & (COPIES - 1)
        prefix = uint32(0)
        pmask = uint32(0)
        base = int64(0)
        target = float64(p)
        for level in range(LEVELS):
            shift = uint32(24 - 8 * level)
            r0 = 2 * (level & 1)  # two result slots a level, alternating: no barrier to reuse
            for b in range(tid, HIST_WORDS, nt):
                hist[b] = uint32(0)
            if tid == 0:
                res[r0] = int32(NO_BIN)
                res[r0 + 1] = int32(-1)
            cuda.syncthreads()
            if n >= 0:
                for c in range(tid, n, nt):
                    hist_one(key_value(cand[c]), hist, copy, prefix, pmask, shift, mass, f)
            else:
                hist_pass(lr, V, int64(0), (hist, copy, prefix, pmask, shift, mass, f))
            cuda.syncthreads()
            # bins from the top (j = 0 is bin 255): totals, and the weight above each
            run = int64(0)
            for j0 in range(0, BINS, nt):
                j = j0 + tid
                c = int64(0)
                if j < BINS:
                    for k in range(COPIES):
                        c += wide_get(hist, k * STRIDE + BINS - 1 - j)
                    tot[j] = c
                before, total = _block_scan_i64(c, scr_i)
                if j < BINS:
                    above[j] = base + run + before
                run += total
                cuda.syncthreads()  # the scan's scratch is used again
            if mass and level == 0:
                target = float64(p) * float64(run)  # run: the candidates' whole mass
            # the first bin whose running total reaches the target; the last non-empty one
            for j in range(tid, BINS, nt):
                c = tot[j]
                if c > 0:
                    if float64(above[j] + c) >= target:
                        cuda.atomic.min(res, r0, int32(j))
                    cuda.atomic.max(res, r0 + 1, int32(j))
            cuda.syncthreads()
            found = int64(res[r0])
            if found == NO_BIN:
                found = int64(res[r0 + 1])
                if found < 0:
                    return f[0], n  # no eligible element under this prefix
            base = above[found]
            prefix = uint32(prefix | (uint32(BINS - 1 - found) << shift))
            pmask = uint32(pmask | (uint32(255) << shift))
            if n < 0 and base + tot[found] <= cap:
                if tid == 0:
                    cnt[0] = int32(0)
                cuda.syncthreads()
                compact_pass(lr, V, int64(0), (cand, cnt, prefix, f))
                cuda.syncthreads()
                n = int64(cnt[0])
        return prefix, n

    def kernel(x, ids, y, tk, tp, tt, tmp, sd, so, k_val, p_val, t_val, mp_val, seed_val,
               off_val, per_row_seed, V, cap, st, gcand, gcnt):
        row = int64(cuda.blockIdx.x)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        lr = x[row]
        nu = (V + UE - 1) // UE
        hist = cuda.shared.array(HIST_WORDS, uint32)
        tot = cuda.shared.array(BINS, int64)
        above = cuda.shared.array(BINS, int64)
        res = cuda.shared.array(4, int32)
        cand = cuda.shared.array(CAP, uint64)
        cnt = cuda.shared.array(1, int32)
        scr_u = cuda.shared.array(REDUCE_SCRATCH, uint64)
        scr_i = cuda.shared.array(REDUCE_SCRATCH, int64)
        scr_f = cuda.shared.array(REDUCE_SCRATCH, float64)
        sh = (hist, tot, above, res, cand, cnt, scr_i)

        k, p, t, mpv, use_k, use_p, use_mp, greedy = _row_config(
            tk, tp, tt, tmp, row, k_val, p_val, t_val, mp_val, V, LOGITS and not MASK)

        xm = NEG_INF
        im = int64(0)
        lo = uint32(0)
        n = int64(-1)  # the candidates in shared memory (-1: none, the row is read)
        if PROCESSED and greedy:  # vLLM's greedy rows: the logits at temperature 1, unfiltered
            processed_pass(lr, V, int64(0), (y[row], (lo, xm, xm, float32(1), float32(0), False,
                                                      float32(0)), True))
            return
        if FINISH:  # after the split kernels' PH_LEVEL 0 (top-k, every row) and PH_COMPACT
            if use_k and st[row, S_KCOUNT] <= cap:
                # every eligible key in or above top-k's first-level bin, compacted by the split
                # kernels: the row kernel's candidates
                if tid == 0:
                    cnt[0] = gcnt[row]
                cuda.syncthreads()
                n = int64(cnt[0])
                if n > CAP:  # never after a whole call (level 0 zeroes the count); a guard
                    n = int64(CAP)
                for c in range(tid, n, nt):
                    cand[c] = gcand[row, c]
                cuda.syncthreads()
                if tid == 0:
                    gcnt[row] = int32(0)
            if greedy or use_mp or use_p:
                # the row's largest is a candidate (the top bin is at or above top-k's); a row
                # whose largest is -inf, or without candidates, takes the max pass (NaN counts
                # as -inf there, as in the row kernel)
                best = uint64(0)
                for c in range(tid, n, nt):
                    best = umax(best, cand[c])
                best = block_max_u64(best, scr_u)
                cuda.syncthreads()
                if best == uint64(0) or key_value(best) == NEG_INF:
                    best = row_max(lr, V, nu, scr_u)
                xm = key_value(best)
                im = key_index(best)
        elif greedy or use_mp or use_p:
            best = row_max(lr, V, nu, scr_u)
            xm = key_value(best)
            im = key_index(best)
        if greedy:
            if tid == 0:
                ids[row] = int32(im)
            return
        sm, inv, thr = derive(xm, t, mpv, use_mp)

        if use_k:
            lo, n = select(lr, V, False, float32(k), (lo, xm, sm, t, inv, use_mp, thr), n,
                           cap, sh)
        if use_p:
            fp = (uint32(0) if JOINT else lo, xm, sm, t, inv, use_mp, thr)
            tp_key, _ = select(lr, V, True, p, fp, int64(-1) if JOINT else n, int64(-1), sh)
            if tp_key > lo:
                lo = tp_key
        f = (lo, xm, sm, t, inv, use_mp, thr)

        if SAMPLE:
            salt, c2, c3, k0, k1 = _request_key(sd, so, seed_val, off_val, per_row_seed, row)
            best = uint64(0)
            if n >= 0:  # the kept tokens are among the candidates
                for c in range(tid, n, nt):
                    kk = cand[c]
                    v = key_value(kk)
                    i = key_index(kk)
                    if eligible(v, fkey(v), f):
                        w0, w1, w2, w3 = philox(uint32(i >> 2), salt, c2, c3, k0, k1)
                        jj = i & 3
                        w = w0 if jj == 0 else (w1 if jj == 1 else (w2 if jj == 2 else w3))
                        best = umax(best, order_key(float32(score(v, t) + gumbel(w)), i))
            else:
                best = sample_pass(lr, V, best, (salt, c2, c3, k0, k1, f))
            best = block_max_u64(best, scr_u)
            if tid == 0:
                ids[row] = int32(key_index(best)) if best > uint64(0) else int32(im)
            return
        if MASK:
            mask_pass(lr, V, int64(0), (y[row], lo))
            return
        if PROCESSED:
            processed_pass(lr, V, int64(0), (y[row], f, False))
            return
        # RENORM
        s64 = float64(0)
        if n >= 0:
            for c in range(tid, n, nt):
                v = key_value(cand[c])
                if eligible(v, fkey(v), f):
                    s64 += float64(v)
        else:
            s64 = sum_pass(lr, V, s64, f)
        s64 = _block_sum_f64(s64, scr_f)
        renorm_pass(lr, V, int64(0), (y[row], float32(s64), f))

    kernel.__name__ = (f"sampler_{spec.source}_{spec.output}_{spec.kind}_{spec.layout}"
                       f"{'_joint' if JOINT else ''}{'_finish' if FINISH else ''}")
    return kernel


# ---------------------------------------------------------------- split rows
# A few rows (decode batches) give the row kernel a few blocks: one SM a row, bound by its
# issue rate, not by the bytes. The split kernels spread each row over ``S`` blocks (``grid =
# R * S``; block ``b`` works on chunk ``b % S`` of row ``b // S``; ``S = 1`` for many rows on
# the finish path below) and run the same steps as launches of one kernel, by ``phase``:
#
# * ``PH_MAX``: the largest key of each chunk; the row's last block to finish (a ticket on the
#   stream's split counters, ``loomnb.ops._workspace``) folds them into ``st[r, S_XM]`` and
#   writes a greedy row's token.
# * ``PH_LEVEL``, ``level`` 0, 1, 2: one level of the radix select over digits of 11, 11 and 10
#   bits (``SPLIT_BINS`` bins; a block histograms its chunk in shared memory and adds the
#   non-empty bins to the row's global histogram ``hist[r, h]``); the last block scans it from
#   the top exactly as the row kernel's ``select`` does, keeps the prefix, the weight above it
#   and "done" in ``st``, and zeroes the histogram. ``which``: ``W_TOPK`` (``h = 0``, counts),
#   ``W_TOPP`` (``h = 1``, fixed-point mass, over keys ``>=`` the top-k threshold when the row
#   has one: top-k first), ``W_JOINT`` both at once over the whole row ("joint"), ``W_FINISH``
#   top-k on the finish path (every row, greedy ones too). The thresholds are the row
#   kernel's: each is the key where a running total over the eligible keys, from the top, first
#   reaches its target, which does not depend on how the key's bits are cut into digits.
# * ``PH_SAMPLE``: the Gumbel-max of each chunk over the kept tokens, folded by the last block
#   into ``ids`` (the same draws as the row kernel: the same token).
# * ``PH_SUM`` / ``PH_WRITE``: renorm's float64 sum (the chunks' partial sums added in chunk
#   order by the last block) and the output pass (mask or renorm).
# * ``PH_COMPACT``: a top-k-first sample whose every row takes top-k (a scalar ``k <= CAP``)
#   stops after the first top-k level: the blocks copy every eligible key in or above its bin
#   (``st[r, S_KCOUNT]`` of them, when at most ``cap``) into ``gcand[r]``, and the row kernel
#   (``RowSpec.finish``) finishes each row from those candidates in one block -- the row's
#   largest (a candidate: no PH_MAX unless min-p needs it for the candidates), the greedy
#   token, the rest of top-k, top-p over the top-k set and the sample: 3 launches instead of
#   8, the row read twice -- or, when they did not fit, from the row.
#
# Every counter a launch uses returns to 0 (``atomicInc`` wraps), and every histogram is zeroed
# by the block that read it, so the workspaces are ready for the next call (graph replays too).
SPLIT_BINS = 2048           # 11-bit digits (the last level's 10 bits use half the bins)
SPLIT_LEVELS = 3            # 11 + 11 + 10 = 32 bits
SPLIT_LOADS = 1             # units a thread loads at once (registers: blocks an SM holds)
SPLIT_THREADS = 256         # a power of two: SPLIT_BINS is a multiple of it
SPLIT_WORDS = 2 * SPLIT_BINS  # a block's mass bins, two uint32 words each (``wide_add``)
PH_MAX, PH_LEVEL, PH_SAMPLE, PH_SUM, PH_WRITE, PH_COMPACT = range(6)
W_TOPK, W_TOPP, W_JOINT, W_FINISH = range(4)  # ``which``: the filter a PH_LEVEL launch selects
(S_XM, S_KPRE, S_KMASK, S_KBASE, S_KDONE, S_KCOUNT, S_PPRE, S_PMASK, S_PBASE, S_PDONE,
 S_PCOUNT) = range(11)
NSTATE = 11                 # int64 state a row
F_TARGET, F_SUM = 0, 1      # float64 state a row: top-p's mass target, renorm's sum
NFSTATE = 2
SPLIT_CASES = tuple((k, "logits", o) for k in KINDS for o in ("sample", "mask")) + (
    ("f32", "probs", "sample"), ("f32", "probs", "renorm"))


@dataclass(frozen=True)
class SplitSpec:
    kind: str             # the row's dtype (rows as uint32 words: 16-byte loads only)
    source: str           # "logits" or "probs"
    output: str           # "sample", "mask" (logits) or "renorm" (probs)

    def __post_init__(self):
        assert self.kind in KINDS and self.source in SOURCES and self.output in OUTPUTS


def _split_argtypes(spec):
    i64 = L.i64(0).numba_type
    return _row_argtypes(RowSpec(spec.kind, spec.source, spec.output))[:-3] + (
        L.array_type("int64", 2), L.array_type("float64", 2), L.array_type("int64", 3),
        L.array_type("uint64", 1), L.array_type("float64", 1), L.array_type("uint32", 1),
        L.array_type("uint64", 2), L.array_type("int32", 1), i64, i64, i64, i64)


@device
def _split_max(best, part, counters, row, S, flag, scr_u):
    """``(last, the row's largest key)`` over its ``S`` blocks: each block's ``best`` (its block
    max, in every thread) recorded in ``part``; ``last`` True in the row's last block only."""
    if cuda.threadIdx.x == 0:
        part[int64(cuda.blockIdx.x)] = best
    if not last_block(counters, row, S, flag):
        return False, uint64(0)
    best = uint64(0)
    for q in range(cuda.threadIdx.x, S, cuda.blockDim.x):
        best = umax(best, part[row * S + q])
    return True, block_max_u64(best, scr_u)


@device
def _split_select(hist, st, stf, row, h, level, target, mass, lo, above, res, scr_i, cols):
    """The last block's step of a split level over ``hist[row, h]`` (see the block comment):
    ``cols = (prefix, mask, base, done, count)`` columns of ``st`` (count: the weight at or
    above the found bin); ``target`` (top-k: ``k``; top-p: ``top_p``, times the total mass at
    level 0, kept in ``stf``); ``lo``: the threshold when no key is eligible. Thread ``t``
    owns ``SPLIT_BINS / blockDim`` consecutive bins from the top: it reads (and zeroes) them at
    once, one block scan of the threads' sums gives each bin the weight above it."""
    tid = cuda.threadIdx.x
    bpt = SPLIT_BINS // cuda.blockDim.x
    c_pre, c_mask, c_base, c_done, c_count = cols
    shift = uint32(21 - 11 * level) if level < 2 else uint32(0)
    prefix = uint32(0)
    pmask = uint32(0)
    base = int64(0)
    if level > 0:
        prefix = uint32(st[row, c_pre])
        pmask = uint32(st[row, c_mask])
        base = st[row, c_base]
    if tid == 0:
        res[0] = int32(NO_BIN)
        res[1] = int32(-1)
    j0 = tid * bpt  # j = 0 is the top bin, SPLIT_BINS - 1
    mine = int64(0)
    for q in range(bpt):
        b = SPLIT_BINS - 1 - (j0 + q)
        c = hist[row, h, b]
        hist[row, h, b] = int64(0)
        above[j0 + q] = c
        mine += c
    before, total = _block_scan_i64(mine, scr_i)
    t = float64(target)
    if mass:
        if level == 0:
            t = float64(target) * float64(total)
            if tid == 0:
                stf[row, F_TARGET] = t
        else:
            t = stf[row, F_TARGET]
    run = base + before
    for q in range(bpt):
        j = j0 + q
        c = above[j]
        above[j] = run
        if c > 0:
            if float64(run + c) >= t:
                cuda.atomic.min(res, 0, int32(j))
            cuda.atomic.max(res, 1, int32(j))
        run += c
    cuda.syncthreads()
    found = int64(res[0])
    if found == NO_BIN:
        found = int64(res[1])
    if tid == 0:
        if found < 0:  # no eligible key under the prefix (level 0: none at all)
            st[row, c_pre] = int64(lo)
            st[row, c_done] = int64(1)
            st[row, c_count] = int64(0)
        else:
            st[row, c_pre] = int64(prefix | (uint32(SPLIT_BINS - 1 - found) << shift))
            st[row, c_mask] = int64(pmask | (uint32(SPLIT_BINS - 1) << shift))
            st[row, c_base] = above[found]
            st[row, c_count] = above[found + 1] if found + 1 < SPLIT_BINS else base + total
            st[row, c_done] = int64(1 if level == SPLIT_LEVELS - 1 else 0)
    cuda.syncthreads()


def split_kernel(spec):
    """The ``@cuda.jit`` function of ``spec``: the row kernel's parameters up to ``cap`` (the
    candidates PH_COMPACT may copy), then the workspaces ``st [R, NSTATE]`` int64, ``stf [R,
    NFSTATE]`` float64, ``hist [R, 2, SPLIT_BINS]`` int64 (zero between launches), ``part [R *
    S]`` uint64 and ``psum [R * S]`` float64 (the chunks' records), the split ``counters``
    (uint32, one a row), the candidates ``gcand [R, CAP]`` uint64 (order keys) and their count
    ``gcnt [R]`` int32 (zeroed by the first top-k level of every call, and again by the finishing
    row kernel), then ``S``,
    ``phase``, ``level``, ``which`` (see the block comment)."""
    P = _row_parts(spec.kind, spec.source, "vec")
    UE, load, weight, eligible, derive = P.UE, P.load, P.weight, P.eligible, P.derive
    max_key = P.max_key
    LOGITS = spec.source == "logits"
    SAMPLE = spec.output == "sample"
    RENORM = spec.output == "renorm"
    NEG_INF = float32(-math.inf)

    @device
    def v_level(a, i0, V, st, ctx):
        cnt, mass, do_k, kpre, kmask, do_p, ppre, pmask, shift, fk, fp = ctx
        for j in range(UE):  # rows of whole units (16-byte loads only): no bound check
            v = a[j]
            key = fkey(v)
            b = int32((key >> shift) & uint32(SPLIT_BINS - 1))
            if do_k and (key & kmask) == kpre and eligible(v, key, fk):
                cuda.atomic.add(cnt, b, int32(1))
            if do_p and (key & pmask) == ppre and eligible(v, key, fp):
                w = int64(weight(v, fp[1], fp[2], fp[3], fp[4]) * float32(MASS_SCALE))
                if w > 0:
                    wide_add(mass, b, w)
        return st

    max_pass = _chunk_pass(UE, load, P.v_max, SPLIT_LOADS)
    level_pass = _chunk_pass(UE, load, v_level, SPLIT_LOADS)
    sample_pass = _chunk_pass(UE, load, P.v_sample, SPLIT_LOADS)
    compact_pass = _chunk_pass(UE, load, P.v_compact, SPLIT_LOADS)
    sum_pass = _chunk_pass(UE, load, P.v_sum, SPLIT_LOADS)
    mask_pass = _chunk_pass(UE, load, P.v_mask, SPLIT_LOADS)
    renorm_pass = _chunk_pass(UE, load, P.v_renorm, SPLIT_LOADS)

    def kernel(x, ids, y, tk, tp, tt, tmp, sd, so, k_val, p_val, t_val, mp_val, seed_val,
               off_val, per_row_seed, V, cap, st, stf, hist, part, psum, counters, gcand, gcnt,
               S, phase, level, which):
        b = int64(cuda.blockIdx.x)
        row = b // S
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        cnt = cuda.shared.array(SPLIT_BINS, int32)
        mass = cuda.shared.array(SPLIT_WORDS, uint32)  # wide_add bins
        above = cuda.shared.array(SPLIT_BINS, int64)  # the last block's select
        res = cuda.shared.array(2, int32)
        flag = cuda.shared.array(1, int32)
        scr_u = cuda.shared.array(REDUCE_SCRATCH, uint64)
        scr_i = cuda.shared.array(REDUCE_SCRATCH, int64)
        scr_f = cuda.shared.array(REDUCE_SCRATCH, float64)
        lr = x[row]
        nu = (V + UE - 1) // UE
        cu = (nu + S - 1) // S
        u0 = (b - row * S) * cu
        u1 = u0 + cu
        if u1 > nu:
            u1 = nu
        k, p, t, mpv, use_k, use_p, use_mp, greedy = _row_config(
            tk, tp, tt, tmp, row, k_val, p_val, t_val, mp_val, V, LOGITS and SAMPLE)

        if phase == PH_MAX:
            mine = max_key(max_pass(lr, V, u0, u1, (NEG_INF, int64(-1)), int64(0)),
                           u0 + tid, u1)
            last, best = _split_max(block_max_u64(mine, scr_u), part, counters, row, S, flag,
                                    scr_u)
            if not last:
                return
            if tid == 0:
                st[row, S_XM] = int64(best)
                if greedy:
                    ids[row] = int32(key_index(best))
            return
        fin = which == W_FINISH  # PH_LEVEL 0 and PH_COMPACT of the finish path: every row
        if greedy and not fin:
            return  # its token is written
        xm = NEG_INF
        im = int64(0)
        if use_mp or (use_p and not fin):  # the finisher finds the largest itself
            best = uint64(st[row, S_XM])
            xm = key_value(best)
            im = key_index(best)
        sm, inv, thr = derive(xm, t, mpv, use_mp)

        if phase == PH_LEVEL:
            do_k = use_k and which != W_TOPP and (level == 0 or st[row, S_KDONE] == 0)
            do_p = (use_p and (which == W_TOPP or which == W_JOINT)
                    and (level == 0 or st[row, S_PDONE] == 0))
            if not (do_k or do_p):
                return
            shift = uint32(21 - 11 * level) if level < 2 else uint32(0)
            kpre = kmask = ppre = pmask = uint32(0)
            if level > 0:
                kpre = uint32(st[row, S_KPRE])
                kmask = uint32(st[row, S_KMASK])
                ppre = uint32(st[row, S_PPRE])
                pmask = uint32(st[row, S_PMASK])
            lo_p = uint32(st[row, S_KPRE]) if (which == W_TOPP and use_k) else uint32(0)
            fk = (uint32(0), xm, sm, t, inv, use_mp, thr)
            fp = (lo_p, xm, sm, t, inv, use_mp, thr)
            for j in range(tid, SPLIT_BINS, nt):
                cnt[j] = int32(0)
                mass[2 * j] = uint32(0)
                mass[2 * j + 1] = uint32(0)
            cuda.syncthreads()
            level_pass(lr, V, u0, u1, int64(0),
                       (cnt, mass, do_k, kpre, kmask, do_p, ppre, pmask, shift, fk, fp))
            cuda.syncthreads()
            for j in range(tid, SPLIT_BINS, nt):
                if cnt[j] != 0:
                    cuda.atomic.add(hist, (row, 0, j), int64(cnt[j]))
                m = wide_get(mass, j)
                if m != 0:
                    cuda.atomic.add(hist, (row, 1, j), m)
            if not last_block(counters, row, S, flag):
                return
            if do_k:
                if level == 0 and tid == 0:
                    gcnt[row] = int32(0)  # the candidates' count starts at 0 in every call
                _split_select(hist, st, stf, row, 0, level, float64(k), False, uint32(0), above,
                              res, scr_i, (S_KPRE, S_KMASK, S_KBASE, S_KDONE, S_KCOUNT))
            if do_p:
                _split_select(hist, st, stf, row, 1, level, float64(p), True, lo_p, above, res,
                              scr_i, (S_PPRE, S_PMASK, S_PBASE, S_PDONE, S_PCOUNT))
            return

        lo = uint32(0)
        if use_k:
            lo = uint32(st[row, S_KPRE])
        if use_p:
            lp = uint32(st[row, S_PPRE])
            if lp > lo:
                lo = lp
        f = (lo, xm, sm, t, inv, use_mp, thr)
        if phase == PH_COMPACT:  # top-k's first-level candidates, for the row kernel to finish
            if use_k and st[row, S_KCOUNT] <= cap:
                f = (uint32(0), xm, sm, t, inv, use_mp, thr)
                compact_pass(lr, V, u0, u1, int64(0),
                             (gcand[row], gcnt[row:row + 1], uint32(st[row, S_KPRE]), f))
            return
        if phase == PH_SAMPLE:
            salt, c2, c3, k0, k1 = _request_key(sd, so, seed_val, off_val, per_row_seed, row)
            last, best = _split_max(block_max_u64(sample_pass(lr, V, u0, u1, uint64(0),
                                                              (salt, c2, c3, k0, k1, f)), scr_u),
                                    part, counters, row, S, flag, scr_u)
            if not last:
                return
            if tid == 0:
                ids[row] = int32(key_index(best)) if best > uint64(0) else int32(im)
            return
        if phase == PH_SUM:
            s64 = _block_sum_f64(sum_pass(lr, V, u0, u1, float64(0), f), scr_f)
            if tid == 0:
                psum[b] = s64
            if not last_block(counters, row, S, flag):
                return
            if tid == 0:
                s64 = float64(0)
                for q in range(S):  # in chunk order: deterministic
                    s64 += psum[row * S + q]
                stf[row, F_SUM] = s64
            return
        # PH_WRITE
        if RENORM:
            renorm_pass(lr, V, u0, u1, int64(0), (y[row], float32(stf[row, F_SUM]), f))
        else:
            mask_pass(lr, V, u0, u1, int64(0), (y[row], lo))

    kernel.__name__ = f"sampler_split_{spec.source}_{spec.output}_{spec.kind}"
    return kernel


# ---------------------------------------------------------------- penalties
def _penalty_argtypes(spec):
    st = storage_dtype(spec.kind)
    rep = st if spec.mode == "repetition" else "float32"
    counts = "uint8" if spec.mode == "repetition" else {"i32": "int32", "i64": "int64"}[spec.counts]
    return (L.array_type(st, 2), L.array_type("uint8", 2), L.array_type(counts, 2),
            L.array_type(rep, 1), L.array_type("float32", 1), L.array_type("float32", 1),
            L.i64(0).numba_type, L.i64(0).numba_type)


def penalty_kernel(spec):
    """The ``@cuda.jit`` function of ``spec``. Parameters: ``logits [R, V]`` (storage dtype,
    written in place), ``prompt_mask [R, V]`` uint8 (bool), ``output [R, V]`` (uint8 mask in
    "repetition", int counts in "all"), ``repetition [R]`` (logits dtype in "repetition",
    fp32 in "all"), ``frequency [R]``, ``presence [R]`` fp32, ``V``, ``R``. Grid ``(ceil(V /
    block), min(R, 65535))``, rows past the grid looping."""
    codec = CODECS[spec.kind]
    dec, enc = codec.decode, codec.encode
    ALL = spec.mode == "all"

    def kernel(logits, pmask, out, rep, freq, pres, V, R):
        i = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
        if i >= V:
            return
        row = int64(cuda.blockIdx.y)
        while row < R:  # rows past the grid's 65,535 loop
            x = dec(logits[row, i])
            seen = pmask[row, i] != 0
            c = out[row, i]
            if ALL:
                seen = seen or c > 0
                r = rep[row]
            else:
                seen = seen or c != 0
                r = dec(rep[row])
            y = x
            if seen:
                y = dec(enc(float32(x / r) if x > float32(0) else mul_rn(x, r)))
            if ALL:  # products through mul_rn: ptxas would fuse a plain mul with the sub
                y = dec(enc(float32(y - mul_rn(freq[row], float32(c)))))
                y = dec(enc(float32(y - mul_rn(pres[row], float32(1 if c > 0 else 0)))))
            if ALL or seen:
                logits[row, i] = enc(y)
            row += int64(cuda.gridDim.y)

    kernel.__name__ = f"penalties_{spec.mode}_{spec.kind}{'_' + spec.counts if ALL else ''}"
    return kernel


def argtypes(spec):
    if isinstance(spec, ChainSpec):
        return _chain_argtypes(spec)
    if isinstance(spec, SplitSpec):
        return _split_argtypes(spec)
    return _row_argtypes(spec) if isinstance(spec, RowSpec) else _penalty_argtypes(spec)


def variants():
    """Every ``(factory, spec, argtypes)`` the family's ops launch (the PTX test compiles them
    all)."""
    out = []
    for kind in KINDS:
        for joint in (False, True):
            for source in SOURCES if kind == "f32" else ("logits",):
                for layout in LAYOUTS:
                    spec = RowSpec(kind, source, "sample", joint, layout)
                    out.append((row_kernel, spec, argtypes(spec)))
        for layout in LAYOUTS:
            spec = RowSpec(kind, "logits", "mask", layout=layout)
            out.append((row_kernel, spec, argtypes(spec)))
            for joint in (False, True):
                spec = RowSpec(kind, "logits", "processed", joint, layout)
                out.append((row_kernel, spec, argtypes(spec)))
        spec = PenaltySpec(kind, "repetition")
        out.append((penalty_kernel, spec, argtypes(spec)))
    for counts in ("i32", "i64"):
        spec = PenaltySpec("f32", "all", counts)
        out.append((penalty_kernel, spec, argtypes(spec)))
    for layout in LAYOUTS:
        spec = RowSpec("f32", "probs", "renorm", layout=layout)
        out.append((row_kernel, spec, argtypes(spec)))
    for kind, source, output in SPLIT_CASES:
        spec = SplitSpec(kind, source, output)
        out.append((split_kernel, spec, argtypes(spec)))
        if output == "sample":
            spec = RowSpec(kind, source, "sample", finish=True)
            out.append((row_kernel, spec, argtypes(spec)))
    for draft in (True, False):
        for layout in LAYOUTS:
            spec = ChainSpec(draft, layout)
            out.append((chain_kernel, spec, argtypes(spec)))
    return out


# ---------------------------------------------------------------- chain speculative sampling
# One block a request verifies its whole chain of draft tokens in one launch (see
# ``loomnb.ops.sampler.chain_speculative_sampling`` for the rule):
#
# 1. the threads verify positions ``j = tid, tid + blockDim, ...`` of the chain at once -- each
#    reads ``p(d)`` and ``q(d)`` of its draft token ``d`` and its uniform ``u_j`` -- and a
#    shared 64-bit atomic add counts the accepted positions, an atomic min finds the first
#    rejected one (``pos``; ``n`` when every draft is accepted);
# 2. the accepted drafts are copied to ``out[b, :pos]``, ``-1`` after ``pos``, the two counts
#    added to (or written into) ``acc[b]`` / ``emi[b]``;
# 3. one pass over position ``pos``'s rows (16-byte loads of both rows where they are aligned,
#    ``_row_pass``/``_unit_loader``) draws ``out[b, pos] = argmax_i r32(log r_i + g_i)`` over
#    the residual ``r = relu(p - q)`` (without draft probabilities: ``p`` with ``p(d)`` zeroed;
#    at the bonus position ``pos = n``: ``p``), lowest index on a tie; an empty residual takes a
#    second pass over ``p``, a ``p`` with no positive entry a third (its argmax).
#
# Philox streams: counter word 0 is ``(stream << SPEC_STREAM_SHIFT) | (i >> 2)`` for token (or
# position) ``i``, word ``i & 3``; the other counter words and the key are the row kernel's
# (``salt`` = the request unless every request has its own seed, the offset, the seed). Stream
# ``SPEC_ACCEPT_STREAM`` holds the acceptance uniforms (``i = j``), stream ``SPEC_GUMBEL_STREAM
# + j`` position ``j``'s Gumbel variates (``i`` = the token); the row kernel's draws are stream
# 0, so no draw of this kernel repeats one of the other sampling ops for the same seed.
from ._philox import uniform  # noqa: E402  (the acceptance uniforms; the rest draws Gumbels)

SPEC_STREAM_SHIFT = 20      # tokens < 2^21 (MAX_VOCAB): i >> 2 < 2^19 fits below the stream
SPEC_ACCEPT_STREAM = 1
SPEC_GUMBEL_STREAM = 2      # position j's stream: 2 + j (j = n: the bonus token)
SPEC_MAX_DRAFTS = 1024      # streams up to 2 + 1024 < 2^12: counter word 0 stays 32 bits


@dataclass(frozen=True)
class ChainSpec:
    draft: bool = True    # draft probabilities given (else one-hot drafts: q = e_d)
    layout: str = "vec"   # "vec": 16-byte loads (rows aligned, whole units); "scalar"
    output = "chain"      # what the kernel writes (a RowSpec's "sample"/"mask"/"renorm")

    def __post_init__(self):
        assert self.layout in LAYOUTS


def _chain_argtypes(spec):
    rows = "uint32" if spec.layout == "vec" else "float32"
    i64 = L.i64(0).numba_type
    return (L.array_type(rows, 3), L.array_type("int32", 2), L.array_type(rows, 3),
            L.array_type("int32", 2), L.array_type("int32", 1), L.array_type("int32", 1),
            L.array_type("int64", 1), L.array_type("int64", 1), i64, i64, i64, i64, i64, i64, i64)


@device
def _philox_words(w0, w1, w2, w3, jj):
    """Word ``jj`` (0..3) of one Philox output, by branches (no runtime tuple index: no local
    memory)."""
    return w0 if jj == 0 else (w1 if jj == 1 else (w2 if jj == 2 else w3))


@device
def _stream_counter(stream, i):
    """Counter word 0 of token (or position) ``i`` in ``stream``."""
    return uint32((uint32(stream) << uint32(SPEC_STREAM_SHIFT)) | uint32(i >> 2))


def chain_kernel(spec):
    """The ``@cuda.jit`` function of ``spec``. Parameters: ``draft_probs [B, n, V]`` (absent
    without draft probabilities), ``draft_token_ids [B, n]`` int32, ``target_probs [B, n + 1,
    V]`` (layout "vec": rows as uint32 words), ``out [B, n + 1]``, ``acc [B]``, ``emi [B]``
    int32, the ``seed``, ``offset`` int64 arrays (length 0 where the scalar after them holds),
    ``seed, offset`` scalars, ``per_row_seed``, ``add_acc``, ``add_emi`` (1: add the count to
    the array, 0: write it), ``n``, ``V``. Grid: one block a request."""
    UE, load = _unit_loader("f32", spec.layout)
    one = row_loader("f32", spec.layout)[1]
    assert UE == 4  # one Philox call (four words) serves a unit's four tokens
    DRAFT = spec.draft
    NEG_INF = float32(-math.inf)

    @device
    def load_pq(rows, u, V):
        return load(rows[0], u, V), load(rows[1], u, V)

    @device
    def draw(best, r, i, w, drawn, ctx):
        """``best`` with token ``i`` of residual mass ``r`` (used when ``r > 0``) in the race;
        ``w`` the unit's Philox words, drawn at the first token that needs them."""
        c0, salt, c2, c3, k0, k1, skip = ctx
        if r > float32(0):
            if not drawn:
                w = philox(uint32(c0 | uint32(i >> 2)), salt, c2, c3, k0, k1)
                drawn = True
            g = gumbel(_philox_words(w[0], w[1], w[2], w[3], i & 3))
            best = umax(best, order_key(float32(float32(math.log(r)) + g), i))
        return best, w, drawn

    @device
    def v_residual(a, i0, V, best, ctx):  # a = (p unit, q unit): r = relu(p - q)
        pu, qu = a
        w = (uint32(0), uint32(0), uint32(0), uint32(0))
        drawn = False
        for j in range(UE):
            if i0 + j < V:
                d = float32(pu[j] - qu[j])
                best, w, drawn = draw(best, d if d > float32(0) else float32(0), i0 + j, w,
                                      drawn, ctx)
        return best

    @device
    def v_target(a, i0, V, best, ctx):  # a = p unit: r = p, token ctx[6] excluded
        w = (uint32(0), uint32(0), uint32(0), uint32(0))
        drawn = False
        for j in range(UE):
            if i0 + j < V:
                v = a[j]
                best, w, drawn = draw(best, v if i0 + j != ctx[6] else float32(0), i0 + j, w,
                                      drawn, ctx)
        return best

    @device
    def v_argmax(a, i0, V, best, ctx):  # the lowest index of the largest (NaN as -inf)
        for j in range(UE):
            if i0 + j < V:
                v = a[j]
                best = umax(best, order_key(v if v == v else NEG_INF, i0 + j))
        return best

    residual_pass = _row_pass(UE, load_pq, v_residual)
    target_pass = _row_pass(UE, load, v_target)
    argmax_pass = _row_pass(UE, load, v_argmax)

    def kernel(dp, ids, tp, out, acc, emi, sd, so, seed_val, off_val, per_row_seed, add_acc,
               add_emi, n, V):
        b = int64(cuda.blockIdx.x)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        scr_u = cuda.shared.array(REDUCE_SCRATCH, uint64)
        chain = cuda.shared.array(2, int64)  # [first rejected position, accepted positions]
        salt, c2, c3, k0, k1 = _request_key(sd, so, seed_val, off_val, per_row_seed, b)
        if tid == 0:
            chain[0] = n
            chain[1] = int64(0)
        cuda.syncthreads()
        for j in range(tid, n, nt):  # every position verified at once
            d = int64(ids[b, j])
            pd = float32(0)
            qd = float32(0)
            if d >= 0 and d < V:  # an id outside the vocabulary reads p(d) = q(d) = 0
                pd = one(tp[b, j], d)
                qd = one(dp[b, j], d) if DRAFT else float32(1)
            w0, w1, w2, w3 = philox(_stream_counter(SPEC_ACCEPT_STREAM, j), salt, c2, c3, k0, k1)
            u = uniform(_philox_words(w0, w1, w2, w3, j & 3))
            if float32(u * qd) < pd:
                cuda.atomic.add(chain, 1, int64(1))
            else:
                cuda.atomic.min(chain, 0, int64(j))
        cuda.syncthreads()
        pos = chain[0]
        for j in range(tid, n + 1, nt):
            if j < pos:
                out[b, j] = ids[b, j]
            elif j > pos:
                out[b, j] = int32(-1)
        if tid == 0:
            acc[b] = int32((int64(acc[b]) if add_acc != 0 else int64(0)) + chain[1])
            emi[b] = int32((int64(emi[b]) if add_emi != 0 else int64(0)) + pos)

        ctx = (_stream_counter(SPEC_GUMBEL_STREAM + pos, 0), salt, c2, c3, k0, k1, int64(-1))
        prow = tp[b, pos]
        if DRAFT and pos < n:
            best = residual_pass((prow, dp[b, pos]), V, uint64(0), ctx)
        else:
            skip = int64(ids[b, pos]) if pos < n else int64(-1)  # one-hot q: p without p(d)
            best = target_pass(prow, V, uint64(0), (ctx[0], salt, c2, c3, k0, k1, skip))
        best = block_max_u64(best, scr_u)
        cuda.syncthreads()
        if best == uint64(0) and pos < n:  # an empty residual: a sample from p
            best = block_max_u64(target_pass(prow, V, uint64(0), ctx), scr_u)
            cuda.syncthreads()
        if best == uint64(0):  # no positive p: its argmax
            best = block_max_u64(argmax_pass(prow, V, uint64(0), ctx), scr_u)
        if tid == 0:
            out[b, pos] = int32(key_index(best))

    kernel.__name__ = f"sampler_chain_speculative_{'draft' if DRAFT else 'onehot'}_{spec.layout}"
    return kernel
