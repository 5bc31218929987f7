"""Greedy speculative-verification kernels: the target argmax over the vocabulary, and the
per-request verification (vLLM's ``rejection_greedy_sample_kernel``) with on-device compaction.

**argmax_kernel** (:class:`ArgmaxSpec`): the draft rows of ``target_logits`` are split into
``S`` chunks of ``chunk`` units each (a unit: one 16-byte load -- 4 fp32 or 8 bf16/fp16 values
-- or one element on the scalar path); block ``b`` takes row ``b // S``, chunk ``b % S``. Each
thread keeps the best ``(value, index)`` of the units it loads (``ILP`` independent 16-byte
loads in flight), the block combines them with the scaffold's ``block_argmax``, and thread 0
stores one int64 **argmax key** per (row, chunk):

    key = ((u(value) - 2**31) << 32) + (2**32 - 1 - index)

where ``u`` maps float32 to uint32 in order (negative values flipped, -0.0 read as +0.0, every
NaN as 2**32 - 1, above +inf). The largest key is the row's argmax with ``torch.argmax``'s
rules -- NaN is the largest value, the lowest index wins ties -- so merging chunks is an int64
``max`` and the index is ``2**32 - 1 - (key & (2**32 - 1))``. Several blocks per row keep a
batch of a few rows (decode: 1-8 requests x a few drafts) spread over the GPU.

**verify_kernel** (:class:`VerifySpec`): a group of ``G`` lanes (4, 8, 16 or 32: enough that
``max_spec_len + 1`` columns take at most ``CH_MAX`` = 5 steps) verifies one request: it loads
``cu[r-1]``, ``cu[r]`` and the bonus id, then the drafts and targets of its positions (the
target from ``target_argmax`` int32/int64, or the merge of the ``S`` argmax keys), finds the
first mismatch with a group minimum, and writes the request's whole output row (placeholder
-1 included: nothing is pre-filled). A mismatch is ``not (draft >= 0 and draft == target)``,
compared as int64; the target is stored as int32 (its low 32 bits, as vLLM's ``tl.store``).
A row whose ``cu`` values are impossible (``start < 0``, ``end < start``, ``end > N`` or
``end - start > max_spec_len``) is written all -1 and nothing is read through it. Draft and
bonus ids are int32 or int64 (``VerifySpec.draft``/``bonus``), read as int64; a bonus id is
stored, like a target, as its low 32 bits.

``pack=True`` (the fused ``greedy_verify``; one block): each group also counts its row's valid
entries (``!= -1`` and ``< vocab_size``: vLLM's ``parse_output``), ranks them with a group
prefix sum and stages them in the workspace; after a barrier the block scans the counts into
``cu_num_emitted`` and copies the staged ids to their packed offsets, the tail set to -1.
Groups loop over requests in rounds with a uniform trip count (every lane takes part in every
shuffle). Every index is 64-bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from numba import cuda, float32, int32, int64, uint32

from .._dtypes import storage_dtype
from .._numba_internals import device
from ..layouts.dtypes import bits_f32, f32_bits
from . import _launch as L
from ._reduce import (REDUCE_SCRATCH, block_argmax, block_scan, fadd, group_reduce, group_scan,
                      imin)
from ._vector import CODECS, load_u32x4

CH_MAX = 5           # column steps of a group: (max_spec_len + 1) <= CH_MAX * G
GROUPS = (4, 8, 16, 32)
ILP = 4              # 16-byte loads a thread has in flight in the argmax kernel
SOURCES = ("i32", "i64", "keys")
ID_KINDS = ("i32", "i64")  # draft and bonus token ids (vLLM passes either)
KINDS = ("bf16", "f16", "f32")
NO_INDEX = 1 << 62   # "no candidate yet" index of the argmax (loses every tie)
KEY_NONE = -(1 << 63)


def group_for(max_spec_len):
    """Lanes per request: the smallest of GROUPS whose CH_MAX steps cover the row's
    ``max_spec_len + 1`` columns, at least a quarter of them (few steps, many requests per
    warp): 4 lanes up to max_spec_len 15, 8 up to 31, 16 up to 63, 32 up to 128."""
    cols = max_spec_len + 1
    want = -(-cols // 4)
    return next((g for g in GROUPS if g >= want and CH_MAX * g >= cols), 32)


@dataclass(frozen=True)
class ArgmaxSpec:
    kind: str          # logits dtype: bf16, f16, f32
    vec: bool = True   # 16-byte loads (rows aligned to 16 bytes, whole units) or one element a step

    def __post_init__(self):
        assert self.kind in KINDS


@dataclass(frozen=True)
class VerifySpec:
    source: str        # SOURCES: target_argmax int32 / int64, or the argmax kernel's keys
    group: int         # lanes per request (GROUPS)
    pack: bool = False  # count, stage and pack the emitted ids (fused op, one block)
    draft: str = "i32"  # ID_KINDS: draft_token_ids dtype
    bonus: str = "i32"  # ID_KINDS: bonus_token_ids dtype

    def __post_init__(self):
        assert self.source in SOURCES and self.group in GROUPS
        assert self.draft in ID_KINDS and self.bonus in ID_KINDS
        assert not self.pack or self.source == "keys"


# ---------------------------------------------------------------- argmax keys
@device
def argmax_key(v, i):
    """The int64 key of candidate ``(v, i)``: larger key = larger value, then lower index;
    NaN above everything, -0.0 equal to +0.0. ``i`` must be < 2**32 - 1."""
    if v != v:
        u = int64(0xFFFFFFFF)
    else:
        if v == 0:
            v = float32(0.0)
        b = int64(f32_bits(v))
        if b < 0x80000000:
            u = b + 0x80000000
        else:
            u = 0xFFFFFFFF - b
    return ((u - 0x80000000) << 32) + (0xFFFFFFFF - int64(i))


@device
def key_index(k):
    """The vocabulary index an argmax key stands for."""
    return int64(0xFFFFFFFF) - (k & 0xFFFFFFFF)


def argmax_argtypes(spec):
    logits = "uint32" if spec.vec else storage_dtype(spec.kind)
    i64 = L.i64(0).numba_type
    return (L.array_type(logits, 3), L.array_type("int64", 1), i64, i64, i64)


def argmax_kernel(spec):
    """``kernel(logits, keys, units, chunk, S)``: ``logits`` ``[n0, n1, V]`` (row ``i`` is
    ``logits[i // n1, i % n1]``; uint32 words on the vector path), ``keys`` int64 ``[rows * S]``,
    ``units`` per row, ``chunk`` units per block."""
    VEC, F32 = spec.vec, spec.kind == "f32"
    codec = CODECS[spec.kind]
    dec, unpack = codec.decode, codec.unpack
    NW = 4 * ILP  # words a thread holds in flight

    @device
    def better(v, i, bv, bi):
        """Thread-local step: indices only grow within a thread, so ties keep the first."""
        return v > bv or (v != v and bv == bv) or bi == NO_INDEX

    def kernel(logits, keys, units, chunk, S):
        b = int64(cuda.blockIdx.x)
        row = b // S
        s = b - row * S
        tid = int64(cuda.threadIdx.x)
        nt = int64(cuda.blockDim.x)
        n1 = uint32(logits.shape[1])
        i0 = uint32(row) // n1
        x = logits[i0, uint32(row) - i0 * n1]
        u0 = s * chunk
        u1 = min(u0 + chunk, units)
        bv = float32(-math.inf)
        bi = int64(NO_INDEX)
        if VEC:
            words = cuda.local.array(NW, uint32)
            for base in range(u0 + tid, u1, nt * ILP):
                for q in range(ILP):  # every load first, then the compares
                    u = base + q * nt
                    if u < u1:
                        w = load_u32x4(x, u << 2)
                        for k in range(4):
                            words[4 * q + k] = w[k]
                for q in range(ILP):
                    u = base + q * nt
                    if u < u1:
                        for k in range(4):
                            if F32:
                                v = bits_f32(words[4 * q + k])
                                i = u * 4 + k
                                if better(v, i, bv, bi):
                                    bv, bi = v, i
                            else:
                                lo, hi = unpack(words[4 * q + k])
                                i = u * 8 + 2 * k
                                if better(lo, i, bv, bi):
                                    bv, bi = lo, i
                                if better(hi, i + 1, bv, bi):
                                    bv, bi = hi, i + 1
        else:
            for u in range(u0 + tid, u1, nt):
                v = dec(x[u])
                if better(v, u, bv, bi):
                    bv, bi = v, u
        sv = cuda.shared.array(REDUCE_SCRATCH, float32)
        si = cuda.shared.array(REDUCE_SCRATCH, int64)
        bv, bi = block_argmax(bv, bi, sv, si)
        if tid == 0:
            keys[b] = argmax_key(bv, bi) if bi != NO_INDEX else int64(KEY_NONE)

    kernel.__name__ = f"spec_argmax_{spec.kind}_{'vec' if VEC else 'scalar'}"
    return kernel


# ---------------------------------------------------------------- verification
def verify_argtypes(spec):
    a = L.array_type
    i64 = L.i64(0).numba_type
    ids = {"i32": "int32", "i64": "int64", "keys": "int64"}
    return (a("int64", 1), a("int32", 2), a(ids[spec.draft], 1), a("int32", 1),
            a(ids[spec.source], 1), a(ids[spec.bonus], 1), a("int32", 1), a("int32", 1),
            a("int32", 1), i64, i64, i64, i64, i64)


def verify_kernel(spec):
    """``kernel(stage, out, drafts, cu, targets, bonus, num_emitted, packed, cu_emitted, R, N,
    L, S, vocab)``: ``out`` int32 ``[R, L + 1]``; ``targets`` ``[N]`` (or the argmax keys,
    ``[N * S]``); ``stage`` int64 ``[R * (L + 1)]``, ``num_emitted`` ``[R]``, ``packed``, and
    ``cu_emitted`` ``[R + 1]`` only with ``pack``."""
    G, KEYS, PACK = spec.group, spec.source == "keys", spec.pack
    gmin = group_reduce(imin, G)
    gsum = group_reduce(fadd, G)
    gscan = group_scan(G)
    bscan = block_scan(int64)

    def kernel(stage, out, drafts, cu, targets, bonus, num_emitted, packed, cu_emitted,
               R, N, L, S, vocab):
        tid = int64(cuda.threadIdx.x)
        nt = int64(cuda.blockDim.x)
        lane = tid & (G - 1)
        per_block = nt // G
        groups = per_block * int64(cuda.gridDim.x)
        gid = int64(cuda.blockIdx.x) * per_block + tid // G
        ncols = L + 1
        nch = (ncols + G - 1) // G
        tv = cuda.local.array(CH_MAX, int64)
        for base in range(0, R, groups):  # the same trip count in every thread
            r = base + gid
            live = r < R
            start = int64(0)
            end = int64(0)
            bonus_id = int64(-1)
            if live:
                end = int64(cu[r])
                if r > 0:
                    start = int64(cu[r - 1])
                bonus_id = int64(int32(bonus[r]))  # the int32 store keeps the low 32 bits
            n = end - start
            ok = live and start >= 0 and end >= start and end <= N and n <= L
            if not ok:
                n = int64(0)
            first = n  # this lane's first mismatch (n: none)
            for c in range(CH_MAX):
                p = c * G + lane
                t = int64(-1)
                if c < nch and p < n:
                    i = start + p
                    d = int64(drafts[i])
                    if KEYS:
                        key = targets[i * S]
                        for j in range(1, S):
                            key = max(key, targets[i * S + j])
                        t = key_index(key)
                    else:
                        t = int64(targets[i])
                    if not (d >= 0 and d == t):
                        first = min(first, p)
                tv[c] = t
            first = gmin(first)
            kept = int64(0)
            for c in range(CH_MAX):
                if c < nch:  # uniform: depends on L only
                    p = c * G + lane
                    v = int64(-1)
                    if ok:
                        if p < n and p <= first:
                            v = int64(int32(tv[c]))  # the int32 store keeps the low 32 bits
                        elif p == n and first == n:
                            v = bonus_id
                    if live and p < ncols:
                        out[r, p] = v
                    if PACK:
                        keep = int64(1) if (p < ncols and v != -1 and v < vocab) else int64(0)
                        rank = kept + gscan(keep) - 1
                        if live and keep == 1:
                            stage[r * ncols + rank] = v
                        kept += gsum(keep)
            if PACK and live and lane == 0:
                num_emitted[r] = kept
        if PACK:  # one block: offsets, then the packed copy
            cuda.syncthreads()
            scratch = cuda.shared.array(REDUCE_SCRATCH, int64)
            carry = int64(0)
            for base in range(0, R, nt):
                r = base + tid
                cnt = int64(num_emitted[r]) if r < R else int64(0)
                before, total = bscan(cnt, scratch)
                if r < R:
                    cu_emitted[r] = carry + before
                carry += total
                cuda.syncthreads()
            if tid == 0:
                cu_emitted[R] = carry
            cuda.syncthreads()
            cap = int64(packed.shape[0])
            for e in range(tid, R * ncols, nt):
                r = e // ncols
                j = e - r * ncols
                if j < num_emitted[r]:
                    dest = int64(cu_emitted[r]) + j
                    if dest < cap:
                        packed[dest] = stage[e]
            for e in range(carry + tid, cap, nt):
                packed[e] = -1

    kernel.__name__ = (f"spec_verify_{spec.source}_d{spec.draft}_b{spec.bonus}_g{G}"
                       f"{'_pack' if PACK else ''}")
    return kernel


def variants():
    """Every ``(factory, spec, argtypes)`` the family's ops can launch."""
    out = []
    for kind in KINDS:
        for vec in (True, False):
            spec = ArgmaxSpec(kind, vec)
            out.append((argmax_kernel, spec, argmax_argtypes(spec)))
    for g in GROUPS:
        for draft in ID_KINDS:
            for bonus in ID_KINDS:
                for source in ("i32", "i64"):
                    spec = VerifySpec(source, g, draft=draft, bonus=bonus)
                    out.append((verify_kernel, spec, verify_argtypes(spec)))
                spec = VerifySpec("keys", g, pack=True, draft=draft, bonus=bonus)
                out.append((verify_kernel, spec, verify_argtypes(spec)))
    return out
