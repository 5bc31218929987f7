"""The argument checks of the rope_cache family's ops: each op's validated values as one record
(:class:`Rope`, :class:`Cache`), the arrays as the ``[num_tokens, num_heads, head_size]`` and
cache views its kernel indexes, before any launch (``loomnb.ops.rope_cache`` documents the
contracts)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _adapter as ad
from .._dtypes import ACTIVATION_KINDS
from ..checks import check_kind, check_same_device, check_same_kind, fail_value
from . import _contract as C
from ._rope_cache_kernels import CS_KINDS, FMAS

_KV = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_CACHE_KINDS = {"fp8_e4m3": ("fp8", "u8"), "fp8_e5m2": ("fp8_e5m2", "u8")}


@dataclass(frozen=True)
class Rope:
    """The checked RoPE arguments of one call (:func:`rope_inputs`)."""
    positions: ad.Arr     # as passed (check_indices reads it whole)
    pv: ad.Arr            # the positions as one [num_tokens] view
    q: ad.Arr             # the query as passed
    qv: ad.Arr            # query [T, Hq, D]
    kv: ad.Arr | None     # key [T, Hk, D], or None
    cs: ad.Arr            # cos_sin_cache [max_position, rot_dim]
    head_size: int
    off: int              # rope_dim_offset
    rot_dim: int


@dataclass(frozen=True)
class Cache:
    """The checked cache-write arguments of one call (:func:`kv_inputs`)."""
    k: ad.Arr             # key [T, Hk, D]
    v: ad.Arr             # value [T, Hk, D]
    kcv: ad.Arr           # key cache [num_blocks, block_size, Hk, D] (legacy: [..., D // x, x])
    vcv: ad.Arr           # value cache [num_blocks, block_size, Hk, D]
    slots: ad.Arr         # slot_mapping [T']
    ks: ad.Arr | None     # k_scale / v_scale as [Hk] views (stride 0 for one scale)
    vs: ad.Arr | None
    kv: str               # "auto", "fp8_e4m3" or "fp8_e5m2"
    legacy: bool          # the x-packed legacy key cache


def _tokens(op, name, a, lead, what):
    """``a`` ``[*lead, ...]`` with its leading dims (``lead``, the positions' shape) merged into
    one token dimension: returns (token stride, remaining shape, remaining strides)."""
    n = len(lead)
    if tuple(a.shape[:n]) != tuple(lead):
        fail_value(op, name, f"of shape [{', '.join(map(str, lead))}, ...] ({what})",
                   f"shape {list(a.shape)}")
    if n == 2 and lead[0] > 1 and lead[1] > 1 and a.strides[0] != lead[1] * a.strides[1]:
        fail_value(op, name, "batch and sequence dimensions that merge into one token dimension",
                   f"shape {list(a.shape)} with strides {a.strides} (in elements)")
    ts = a.strides[n - 1] if lead[n - 1] > 1 or n == 1 else a.strides[0]
    return ts, a.shape[n:], a.strides[n:]


def heads(op, name, a, lead, head_size, what):
    """A ``[*lead, H * D]`` or ``[*lead, H, D]`` array as a ``[T, H, D]`` view."""
    if a.ndim not in (len(lead) + 1, len(lead) + 2):
        fail_value(op, name, f"{len(lead) + 1}-D [..., num_heads * head_size] or "
                   f"{len(lead) + 2}-D [..., num_heads, head_size] ({what})",
                   f"a {a.ndim}-D array of shape {list(a.shape)}")
    ts, rest, st = _tokens(op, name, a, lead, what)
    if rest[-1] > 1 and st[-1] != 1 and 0 not in a.shape:
        fail_value(op, name, "contiguous in its last dimension (stride 1)",
                   f"strides {a.strides} (in elements)")
    if len(rest) == 1:
        if rest[0] % head_size or rest[0] == 0:
            fail_value(op, name, f"a last dimension that is a positive multiple of head_size = "
                       f"{head_size}", f"shape {list(a.shape)}")
        H, hs = rest[0] // head_size, head_size
    else:
        if rest[1] != head_size:
            fail_value(op, name, f"a last dimension of head_size = {head_size}",
                       f"shape {list(a.shape)}")
        H, hs = rest[0], st[0]
    T = 1
    for d in lead:
        T *= d
    return a.view((T, H, head_size), (ts, hs, 1))


def _positions(op, positions):
    p = ad.wrap(op, "positions", positions)
    check_kind(op, "positions", p, ("i64",))
    if p.ndim not in (1, 2):
        fail_value(op, "positions", "1-D [num_tokens] or 2-D [batch_size, seq_len]",
                   f"a {p.ndim}-D array of shape {list(p.shape)}")
    T = p.size
    if p.ndim == 2 and p.shape[0] > 1 and p.shape[1] > 1 and p.strides[0] != p.shape[1] * p.strides[1]:
        fail_value(op, "positions", "batch and sequence dimensions that merge into one",
                   f"strides {p.strides} (in elements)")
    st = p.strides[-1] if p.shape[-1] > 1 or p.ndim == 1 else p.strides[0]
    return p, p.view((T,), (st,))


def rope_inputs(op, positions, query, key, head_size, cos_sin_cache, is_neox, off, inverse,
                fma, cs_kinds=None):
    """Validate the RoPE arguments: a :class:`Rope` record."""
    p, pv = _positions(op, positions)
    head_size = C.integer(op, "head_size", head_size, 1)
    off = C.integer(op, "rope_dim_offset", off, 0)
    C.flag(op, "is_neox", is_neox)
    C.flag(op, "inverse", inverse)
    C.choice(op, "fma", fma, FMAS)
    q = ad.wrap(op, "query", query)
    check_kind(op, "query", q, ACTIVATION_KINDS)
    check_same_device(op, "query", q, "positions", p)
    qv = heads(op, "query", q, p.shape, head_size, "positions.shape + heads")
    kv = None
    if key is not None:
        k = ad.wrap(op, "key", key)
        check_same_kind(op, "key", k, "query", q)
        check_same_device(op, "key", k, "query", q)
        kv = heads(op, "key", k, p.shape, head_size, "positions.shape + heads")
        # any num_kv_heads: the kernel rotates query heads and key heads as separate items and
        # never uses their ratio (vLLM's rotary_embedding checks num_heads % num_kv_heads == 0)
    cs = ad.wrap(op, "cos_sin_cache", cos_sin_cache)
    allowed = cs_kinds or CS_KINDS[q.kind]
    check_kind(op, "cos_sin_cache", cs, allowed)
    check_same_device(op, "cos_sin_cache", cs, "query", q)
    if cs.ndim != 2:
        fail_value(op, "cos_sin_cache", "2-D [max_position, rot_dim]",
                   f"a {cs.ndim}-D array of shape {list(cs.shape)}")
    rot_dim = cs.shape[1]
    if rot_dim < 2 or rot_dim % 2:
        fail_value(op, "cos_sin_cache", "an even rot_dim = cos_sin_cache.shape[1] >= 2",
                   f"shape {list(cs.shape)}")
    if rot_dim > 1 and cs.strides[1] != 1:
        fail_value(op, "cos_sin_cache", "contiguous in its last dimension (stride 1)",
                   f"strides {cs.strides} (in elements)")
    if rot_dim + off > head_size:
        if off:
            fail_value(op, "cos_sin_cache", f"rot_dim + rope_dim_offset <= head_size = "
                       f"{head_size}", f"rot_dim {rot_dim} + rope_dim_offset {off}")
        fail_value(op, "cos_sin_cache", f"rot_dim <= head_size = {head_size}", f"rot_dim {rot_dim}")
    return Rope(p, pv, q, qv, kv, cs, head_size, off, rot_dim)


def kv_inputs(op, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
              v_scale, *, legacy, like=None, kview=None, vview=None, value_shape=None):
    """Validate the cache-write arguments: a :class:`Cache` record. ``kview``/``vview``: [T, Hk,
    D] views already made (the fused op; ``value_shape``: the value's shape as passed, for
    messages). Every dimension the kernel relies on agrees:
    key/value tokens, heads and head_size, slot_mapping no longer than the tokens, the caches'
    heads and head_size, the caches with each other, the scales with num_kv_heads."""
    C.choice(op, "kv_cache_dtype", kv_cache_dtype, C.KV_CACHE_DTYPES)
    kvd = _KV[kv_cache_dtype]
    if kview is None:
        k = ad.wrap(op, "key", key)
        check_kind(op, "key", k, ACTIVATION_KINDS)
        if k.ndim != 3:
            fail_value(op, "key", "3-D [num_tokens, num_kv_heads, head_size]",
                       f"a {k.ndim}-D array of shape {list(k.shape)}")
        C.rows(op, [("key", k)])  # last dimension contiguous
        kview = k
        like = k
    if vview is None:
        v = ad.wrap(op, "value", value)
        value_shape = list(v.shape)
        check_same_kind(op, "value", v, "key", like)
        check_same_device(op, "value", v, "key", like)
        if v.ndim == 3:
            C.rows(op, [("value", v)])
            vview = v
        elif kview is not None and v.ndim == 2 and v.shape[-1] == kview.shape[1] * kview.shape[2]:
            if v.shape[-1] > 1 and v.strides[-1] != 1 and 0 not in v.shape:
                fail_value(op, "value", "contiguous in its last dimension (stride 1)",
                           f"strides {v.strides} (in elements)")
            vview = v.view((v.shape[0], kview.shape[1], kview.shape[2]),
                           (v.strides[0], kview.shape[2], 1))
        else:
            fail_value(op, "value", "3-D [num_tokens, num_kv_heads, head_size]",
                       f"a {v.ndim}-D array of shape {list(v.shape)}")
    T, Hk, D = kview.shape
    if tuple(vview.shape) != (T, Hk, D):
        fail_value(op, "value", f"of shape {[T, Hk, D]} like 'key' ([num_tokens, num_kv_heads, "
                   "head_size]; num_kv_heads * head_size when 2-D)",
                   f"shape {list(value_shape or vview.shape)}")
    s = ad.wrap(op, "slot_mapping", slot_mapping)
    check_kind(op, "slot_mapping", s, ("i64",))
    check_same_device(op, "slot_mapping", s, "key", like)
    if s.ndim != 1:
        fail_value(op, "slot_mapping", "1-D [num_tokens]", f"a {s.ndim}-D array of shape {list(s.shape)}")
    if s.shape[0] > T:
        fail_value(op, "slot_mapping", f"of length at most {T} (the num_tokens of 'key' and "
                   "'value'; a slot past them would read past their rows)", f"length {s.shape[0]}")
    cache_kinds = (like.kind,) if kvd == "auto" else _CACHE_KINDS[kvd]
    kc = ad.wrap(op, "key_cache", key_cache)
    vc = ad.wrap(op, "value_cache", value_cache)
    for name, c in (("key_cache", kc), ("value_cache", vc)):
        check_kind(op, name, c, cache_kinds)
        check_same_device(op, name, c, "key", like)
    csz = kc.itemsize
    if legacy:
        x = 16 // csz
        if kc.ndim != 5 or kc.shape[1] != Hk or kc.shape[2] * x != D or kc.shape[4] != x:
            fail_value(op, "key_cache", f"5-D [num_blocks, {Hk}, {D} // x, block_size, x] with "
                       f"x = 16 // {csz} = {x}", f"shape {list(kc.shape)}")
        nb, bs = kc.shape[0], kc.shape[3]
        if tuple(vc.shape) != (nb, Hk, D, bs):
            fail_value(op, "value_cache", f"of shape [{nb}, {Hk}, {D}, {bs}] ([num_blocks, "
                       "num_kv_heads, head_size, block_size])", f"shape {list(vc.shape)}")
        if x > 1 and kc.strides[4] != 1:
            fail_value(op, "key_cache", "contiguous in its last dimension (stride 1)",
                       f"strides {kc.strides} (in elements)")
        s0, s1, s2, s3, s4 = kc.strides
        kcv = kc.view((nb, bs, Hk, D // x, x), (s0, s3, s1, s2, s4))
        t0, t1, t2, t3 = vc.strides
        vcv = vc.view((nb, bs, Hk, D), (t0, t3, t1, t2))
    else:
        if kc.ndim != 4 or tuple(kc.shape[2:]) != (Hk, D):
            fail_value(op, "key_cache", f"4-D [num_blocks, block_size, {Hk}, {D}]",
                       f"shape {list(kc.shape)}")
        if tuple(vc.shape) != tuple(kc.shape):
            fail_value(op, "value_cache", f"of shape {list(kc.shape)} like 'key_cache'",
                       f"shape {list(vc.shape)}")
        for name, c in (("key_cache", kc), ("value_cache", vc)):
            if D > 1 and c.strides[3] != 1:
                fail_value(op, name, "contiguous in its last dimension (stride 1)",
                           f"strides {c.strides} (in elements)")
        kcv, vcv = kc, vc
    if kvd != "auto":
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None:
                fail_value(op, name, f"a float32 device array for kv_cache_dtype {kv_cache_dtype!r}",
                           "None")
    ks = C.kv_scale(op, "k_scale", k_scale, like, Hk, "key")
    vs = C.kv_scale(op, "v_scale", v_scale, like, Hk, "key")
    C.writable(op, {"key_cache": kcv, "value_cache": vcv})
    return Cache(kview, vview, kcv, vcv, s, ks, vs, kvd, legacy)


def check_indices(op, check, rope=None, cache=None, stream=None):
    """The opt-in ``check_indices=True`` (``check``): the positions of ``rope`` in ``[0,
    max_position)`` and each ``slot_mapping`` entry of ``cache`` -1 (``PAD_SLOT_ID``) or in
    ``[0, num_blocks * block_size)``, without a host sync
    (:func:`loomnb.ops._contract.assert_in_range`). Off: nothing is read."""
    if not C.flag(op, "check_indices", check):
        return
    if rope is not None:
        P = rope.cs.shape[0]
        C.assert_in_range(op, "positions", rope.positions, 0, P - 1,
                          meaning=f"(rows of cos_sin_cache: max_position = {P})", stream=stream)
    if cache is not None:
        n = cache.kcv.shape[0] * cache.kcv.shape[1]
        C.assert_in_range(op, "slot_mapping", cache.slots, 0, n - 1, allow=-1,
                          meaning=f"(slots of num_blocks * block_size = {n})", stream=stream)
