"""The argument checks of the attention family's ops (``loomnb.ops.attention`` documents the
contracts): the paged caches' logical shape and strides, one :class:`Decode` record of a
``paged_decode_attention`` call's checked values, its opt-in index checks, and the arrays of
``merge_attn_states`` -- each failure a ``LoomnbError`` before any launch."""

from __future__ import annotations

import numbers

from .. import _adapter as ad
from .._dtypes import ACTIVATION_KINDS
from ..checks import (check_kind, check_ndim, check_same_device, check_shape, fail_type,
                      fail_value)
from . import _contract as C
from ._attention_kernels import EPL_VEC, LANES
from ._contract import KV_CACHE_DTYPES

MAX_HEAD_SIZE = EPL_VEC * LANES[-1]  # 256


def cache_strides(op, name, a, x):
    """``(logical shape [num_blocks, block_size, num_kv_heads, head_size], strides (sb, so, sh,
    su, se, xl) in elements, extent in elements)`` of a 4-D cache view or the 5-D x-packed key."""
    if any(s < 0 for s in a.strides):
        fail_value(op, name, "a view with non-negative strides", f"strides {a.strides}")
    if a.ndim == 5:
        nb, hk, dx, bs, xx = a.shape
        if xx != x:
            fail_value(op, name, f"of shape [num_blocks, num_kv_heads, head_size // x, "
                       f"block_size, x] with x = {x} (the x-packed key: 16 bytes of the cache "
                       "dtype)", f"shape {list(a.shape)}")
        s0, s1, s2, s3, s4 = a.strides
        shape, strides = (nb, bs, hk, dx * xx), (s0, s3, s1, s2, s4, x.bit_length() - 1)
    else:
        shape = tuple(a.shape)
        s0, s1, s2, s3 = a.strides
        strides = (s0, s1, s2, s3, 0, 0)
    extent = 1 + sum((n - 1) * st for n, st in zip(a.shape, a.strides)) if a.size else 0
    return shape, strides, extent


def vectorizable(a, strides, shape, esize):
    """16-byte units: aligned base, head rows in whole contiguous units, unit-aligned strides."""
    sb, so, sh, su, se, xl = strides
    ue = 16 // esize
    if a.ptr % 16 or shape[3] % ue:
        return False
    if xl:  # the x-packed key: x elements contiguous, one unit
        inner_ok = (se == 1 or (1 << xl) == 1) and (1 << xl) == ue
        unit_stride = su
    else:
        inner_ok = su == 1 or shape[3] == 1
        unit_stride = ue
    dims = ((shape[0], sb), (shape[1], so), (shape[2], sh), (shape[3] // ue, unit_stride))
    return inner_ok and all(n <= 1 or (st * esize) % 16 == 0 for n, st in dims)


def _check_index(op, name, a, ndim):
    if a.kind != "i32":
        fail_type(op, name, "of dtype int32 (vLLM's index dtype; not cast)", f"dtype {a.dtype_name}")
    check_ndim(op, name, a, ndim)
    return a


class Decode:
    """The checked arguments of one paged_decode_attention call."""
    __slots__ = ("q", "k", "v", "bt", "sl", "ks", "vs", "kshape", "kstr", "kext", "vstr", "vext",
                 "num_seqs", "num_heads", "head_size", "num_kv_heads", "block_size", "num_blocks",
                 "fp8", "cache_kind")


def check_decode(op, query, key_cache, value_cache, block_tables, seq_lens, scale, softcap,
                  sliding_window, kv_cache_dtype, k_scale, v_scale, return_lse, max_seq_len,
                  check_indices=False):
    a = Decode()
    q = a.q = ad.wrap(op, "query", query)
    check_kind(op, "query", q, ACTIVATION_KINDS)
    check_ndim(op, "query", q, 3)
    a.num_seqs, a.num_heads, a.head_size = q.shape
    if not 1 <= a.head_size <= MAX_HEAD_SIZE:
        fail_value(op, "query", f"of shape [num_seqs, num_heads, head_size] with head_size in "
                   f"[1, {MAX_HEAD_SIZE}]", f"shape {list(q.shape)}")
    C.choice(op, "kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    if kv_cache_dtype == "fp8_e5m2":
        fail_value(op, "kv_cache_dtype", "'auto', 'fp8' or 'fp8_e4m3' (E5M2 caches are not "
                   "supported)", repr(kv_cache_dtype))
    a.fp8 = kv_cache_dtype != "auto"
    k = a.k = ad.wrap(op, "key_cache", key_cache)
    v = a.v = ad.wrap(op, "value_cache", value_cache)
    for name, c in (("key_cache", k), ("value_cache", v)):
        if a.fp8:
            check_kind(op, name, c, ("fp8", "u8"))
        elif c.kind != q.kind:
            fail_type(op, name, f"of the query's dtype ({q.dtype_name}) with kv_cache_dtype='auto'",
                      f"dtype {c.dtype_name}")
        check_same_device(op, name, c, "query", q)
    if v.ndim != 4:
        fail_value(op, "value_cache", "4-D [num_blocks, block_size, num_kv_heads, head_size]",
                   f"a {v.ndim}-D array of shape {list(v.shape)}")
    if k.ndim not in (4, 5):
        fail_value(op, "key_cache", "4-D [num_blocks, block_size, num_kv_heads, head_size] or the "
                   "5-D x-packed [num_blocks, num_kv_heads, head_size // x, block_size, x]",
                   f"a {k.ndim}-D array of shape {list(k.shape)}")
    esize = 1 if a.fp8 else q.itemsize
    a.cache_kind = "fp8" if a.fp8 else q.kind
    x = 16 // esize
    vshape, a.vstr, a.vext = cache_strides(op, "value_cache", v, x)
    a.kshape, a.kstr, a.kext = cache_strides(op, "key_cache", k, x)
    a.num_blocks, a.block_size, a.num_kv_heads, hs = vshape
    logical = "[num_blocks, block_size, num_kv_heads, head_size]"
    if hs != a.head_size:
        fail_value(op, "value_cache", f"of logical shape [num_blocks, block_size, num_kv_heads, "
                   f"{a.head_size}] (head_size {a.head_size} from 'query')",
                   f"shape {list(v.shape)} (head_size {hs})")
    if a.kshape != vshape:
        fail_value(op, "key_cache", f"of logical shape {list(vshape)} like 'value_cache' "
                   f"({logical})",
                   f"shape {list(k.shape)}" + (f" (logical {list(a.kshape)})" if k.ndim == 5 else ""))
    if a.block_size < 1:
        fail_value(op, "value_cache", f"of logical shape {logical} with block_size >= 1",
                   f"shape {list(v.shape)} (block_size {a.block_size})")
    if a.num_kv_heads < 1:
        fail_value(op, "value_cache", f"of logical shape {logical} with num_kv_heads >= 1",
                   f"shape {list(v.shape)} (num_kv_heads {a.num_kv_heads})")
    if a.num_heads % a.num_kv_heads:
        fail_value(op, "query", f"of shape [num_seqs, num_heads, head_size] with num_heads a "
                   f"multiple of num_kv_heads = {a.num_kv_heads} (from 'value_cache'; each KV head "
                   "serves num_heads // num_kv_heads query heads)", f"num_heads {a.num_heads}")
    bt = a.bt = _check_index(op, "block_tables", ad.wrap(op, "block_tables", block_tables), 2)
    if bt.shape[0] != a.num_seqs:
        check_shape(op, "block_tables", bt, (a.num_seqs, bt.shape[1]),
                    "[num_seqs, max_blocks], num_seqs from 'query'")
    sl = a.sl = _check_index(op, "seq_lens", ad.wrap(op, "seq_lens", seq_lens), 1)
    check_shape(op, "seq_lens", sl, (a.num_seqs,), "[num_seqs], num_seqs from 'query'")
    for name, arr in (("block_tables", bt), ("seq_lens", sl)):
        check_same_device(op, name, arr, "query", q)
    C.real(op, "scale", scale)
    if softcap is not None:
        C.real(op, "softcap", softcap, low=0.0)
    for name, v, low, what in (("sliding_window", sliding_window, 1,
                                " (tokens a query sees, itself included)"),
                               ("max_seq_len", max_seq_len, 0, "")):
        # None or an int: any other value, of any type, is one LoomnbValueError
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low):
            fail_value(op, name, f"None or an int >= {low}{what}", repr(v))
    C.flag(op, "return_lse", return_lse)
    C.flag(op, "check_indices", check_indices)
    a.ks = C.kv_scale(op, "k_scale", k_scale, q, a.num_kv_heads, "query",
                      one_element_any_shape=False)
    a.vs = C.kv_scale(op, "v_scale", v_scale, q, a.num_kv_heads, "query",
                      one_element_any_shape=False)
    if a.fp8 and (a.ks is None or a.vs is None):
        fail_value(op, "k_scale" if a.ks is None else "v_scale",
                   f"a float32 device array ([1] or [num_kv_heads]) with kv_cache_dtype="
                   f"{kv_cache_dtype!r}", "None")
    return a


def check_decode_indices(op, a, sliding_window, stream):
    """The opt-in ``check_indices=True``: ``seq_lens`` in ``[0, max_blocks * block_size]`` and,
    for every block a sequence reads -- columns ``[start // block_size, cdiv(L, block_size))``
    of its row, ``L`` its seq_len clamped as the kernel does, ``start = max(0, L - W)`` with a
    sliding window ``W`` -- a block number in ``[0, num_blocks)``; the stale entries past them
    are never read and not checked. No host sync (:func:`loomnb.ops._contract.assert_in_range`)."""
    B, nb = a.block_size, a.num_blocks
    cap = a.bt.shape[1] * B
    C.assert_in_range(op, "seq_lens", a.sl, 0, cap,
                      meaning=f"(max_blocks * block_size = {a.bt.shape[1]} * {B})", stream=stream)
    W = sliding_window or 0

    def read(xp, bt, sl):
        L = sl.clip(0, min(cap, 2 ** 31 - 1))
        col = xp.ones_like(bt).cumsum(-1) - 1
        first = (L - W).clip(0, None) // B if W else L * 0
        return (col >= first[:, None]) & (col < ((L + (B - 1)) // B)[:, None])

    C.assert_in_range(op, "block_tables", a.bt, 0, nb - 1, where=read, given=(a.sl,),
                      meaning=f"(num_blocks = {nb}) in the columns each sequence's seq_len "
                      "reads", stream=stream)


def check_states(op, output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse):
    o = ad.wrap(op, "output", output)
    check_kind(op, "output", o, ACTIVATION_KINDS)
    check_ndim(op, "output", o, 3)
    N, H, D = o.shape
    ins = {}
    for name, obj in (("prefix_output", prefix_output), ("suffix_output", suffix_output)):
        a = ins[name] = ad.wrap(op, name, obj)
        if a.kind != o.kind:
            fail_type(op, name, f"of the same dtype as 'output' ({o.dtype_name})", f"dtype {a.dtype_name}")
        check_shape(op, name, a, o.shape, "[num_tokens, num_heads, head_size] like 'output'")
        check_same_device(op, name, a, "output", o)
    for name, obj in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse), ("output_lse", output_lse)):
        if obj is None:
            ins[name] = None
            continue
        a = ins[name] = ad.wrap(op, name, obj)
        check_kind(op, name, a, ("f32",))
        check_shape(op, name, a, (H, N), "[num_heads, num_tokens] from 'output'")
        check_same_device(op, name, a, "output", o)
    if ins["prefix_lse"] is None or ins["suffix_lse"] is None:
        fail_type(op, "prefix_lse" if ins["prefix_lse"] is None else "suffix_lse",
                  "a float32 array [num_heads, num_tokens]", "None")
    return o, ins
