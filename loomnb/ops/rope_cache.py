"""RoPE and the paged KV-cache write: ``rotary_embedding``, ``reshape_and_cache_flash``,
``reshape_and_cache`` and the fused ``rotary_embedding_and_cache`` (one launch).

Numerically interchangeable with vLLM 0.24's compiled ops (``torch.ops._C.rotary_embedding``,
``torch.ops._C_cache_ops.reshape_and_cache_flash`` / ``reshape_and_cache``): RoPE in fp32 with
each output rounded once, with the products vLLM's nvcc build fuses into FMAs (``fma="vllm"``;
``"none"`` fuses nothing); cache writes copy the activation bits (``"auto"``) or store
``fp8(f(v) / scale)``. ``docs/numerics.md`` has the family's numerics in one place.

Bytes moved (the benchmark's model), per token, element size ``b``, ``rot_dim = 2e``:
``rotary_embedding`` reads and writes the rotated channels of query and key (``2 * (Hq + Hk)
* rot_dim * b``) and reads its cos/sin row (``rot_dim`` cache elements);
``reshape_and_cache_flash`` reads key and value and writes them to the cache (``2 * Hk * D *
(b + cache element size)``, + 8 bytes of slot); the fused op moves the union, so it saves one
read of the rotated key and one launch.

Arrays: query/key/value are ``[num_tokens, num_heads * head_size]`` or ``[num_tokens,
num_heads, head_size]`` with a contiguous last dimension and any token/head strides (slices of
a fused QKV buffer need no copy); caches are the strided views of :mod:`loomnb.layouts.paged_kv`
(``kv_views``), so one kernel serves every layout through its strides.
"""

from __future__ import annotations

import dataclasses

from .. import _adapter as ad
from .._dtypes import storage_dtype
from ..checks import check_same_device, check_same_kind, fail_type, fail_value
from . import _contract as C
from . import _launch as L
from ._rope_cache_args import check_indices as _check_indices
from ._rope_cache_args import heads, kv_inputs, rope_inputs
from ._rope_cache_kernels import FORMS, RopeCacheSpec, rope_cache_kernel
from ._torch_ops import torch_op

__all__ = ["rotary_embedding", "apply_rope_with_cos_sin_cache", "reshape_and_cache_flash",
           "reshape_and_cache", "rotary_embedding_and_cache"]

MAX_THREADS = 1024


# ------------------------------------------------------------------------------ launch
def _vector_ok(spec, q, k, v, cs, kcv, vcv, off, rot_dim, D):
    """Whether every array allows 16-byte units (8-byte for FP8 caches): see the kernels."""
    if spec.kind == "f32" or D % 8:
        return False
    if spec.rope and ((rot_dim // 2) % 8 or off % 8 or not C.vectors_ok(cs)):
        return False
    if not C.vectors_ok(q, k, v):
        return False
    if spec.cache == "none":
        return True
    unit = 8 if spec.kv != "auto" else 16
    if spec.cache == "legacy":
        return C.vectors_ok(kcv, unit=unit)
    return C.vectors_ok(kcv, vcv, unit=unit)


def _launch(op, spec, rope, cache, stream, key, out=(None, None)):
    """Layout, launch configuration and the launch: one block per token, over the checked
    ``rope`` and ``cache`` arguments (either may be None). ``out``: the ``(query_out, key_out)``
    views of the out-of-place form (``spec.out``); in place they are the query and key."""
    pv, qv, cs = (rope.pv, rope.qv, rope.cs) if rope is not None else (None, None, None)
    kv = rope.kv if rope is not None else cache.k
    vv, slots, kcv, vcv, ks, vs = ((cache.v, cache.slots, cache.kcv, cache.vcv, cache.ks, cache.vs)
                                   if cache is not None else (None,) * 6)
    n_tokens = pv.shape[0] if rope is not None else slots.shape[0]
    off, rot_dim = (rope.off, rope.rot_dim) if rope is not None else (0, 0)
    D = rope.head_size if rope is not None else kv.shape[2]
    if n_tokens == 0:
        return
    qov = qv if out[0] is None else out[0]
    kov = kv if out[1] is None else out[1]
    vec = (_vector_ok(spec, qv, kv, vv, cs, kcv, vcv, off, rot_dim, D)
           and (not spec.out or C.vectors_ok(qov, kov)))
    spec = dataclasses.replace(spec, layout="vector" if vec else "scalar")
    e = rot_dim // 2 if spec.rope else 0
    Hq = qv.shape[1] if qv is not None else 0
    Hk = (kv if kv is not None else vv).shape[1] if (kv is not None or vv is not None) else 0
    if vec:
        items = (Hq + Hk) * (e // 8) + (2 * Hk * (D // 8) if spec.cache != "none" else 0)
        items += (Hq + Hk) * ((D - 2 * e) // 8) if spec.out else 0
    else:
        items = (Hq + Hk) * e + (2 * Hk * D if spec.cache != "none" else 0)
        items += (Hq + Hk) * (D - 2 * e) if spec.out else 0
    threads = L.forced_threads() or min(MAX_THREADS, L.whole_warps(items))
    act = "uint32" if vec else storage_dtype(spec.kind)
    cstore = "uint8" if spec.kv != "auto" else storage_dtype(spec.kind)

    def rows3(a):
        return L.array(a, words=vec) if a is not None else L.absent(act, 3)

    kdim = 5 if spec.cache == "legacy" else 4
    if spec.cache == "none":
        kc_p = L.absent("uint32" if vec else cstore, kdim)
        vc_p = L.absent("uint32" if vec else cstore, 4)
    else:
        kc_p = L.array(kcv, words=vec)
        vc_p = L.array(vcv, words=vec and spec.cache == "flash")
    if spec.rope:
        cs_p = L.array(cs, words=vec)
    else:
        cs_p = L.absent("uint32" if vec else storage_dtype(spec.cs_kind), 2)
    params = [L.array(pv) if pv is not None else L.absent("int64", 1),
              rows3(qv), rows3(kv), rows3(qov), rows3(kov), rows3(vv), cs_p,
              L.array(slots) if slots is not None else L.absent("int64", 1),
              kc_p, vc_p,
              L.array(ks) if ks is not None else L.absent("float32", 1),
              L.array(vs) if vs is not None else L.absent("float32", 1),
              L.i64(slots.shape[0] if slots is not None else 0), L.i64(off), L.i64(e), L.i64(D)]
    like = qv if qv is not None else kv
    L.launch(rope_cache_kernel, spec, n_tokens, threads, params, like=like, stream=stream, key=key)


# ------------------------------------------------------------------------------ the ops
@torch_op("Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
          "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False, *, "
          "str fma='vllm', bool check_indices=False", returns=("query", "key"))
def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0,
                     inverse=False, *, fma="vllm", check_indices=False, stream=None,
                     launch_key=None):
    """Rotary position embedding of ``query`` and ``key``, in place.

    Per token ``t`` (position ``p = positions[t]``), head, and pair ``i < e = rot_dim / 2``
    with ``c = f(cos_sin_cache[p, i])``, ``s = f(cos_sin_cache[p, e + i])`` (``-s`` when
    ``inverse``) and the pair ``(x, y)`` -- channels ``(off + i, off + e + i)`` (NeoX,
    ``is_neox=True``) or ``(off + 2i, off + 2i + 1)`` (GPT-J) of the head, ``off =
    rope_dim_offset`` -- in float32::

        x <- r(x*c - y*s)        y <- r(y*c + x*s)

    rounded once to the activation dtype. ``fma="vllm"`` evaluates them as vLLM 0.24's compiled
    op does on sm_90 (nvcc contracts one product of each into an FMA: ``x' = fma(x, c,
    -r32(y*s))`` and ``y' = fma(x, s, r32(y*c))``; with ``inverse``, ``y' = fma(y, c,
    r32(x*s))``); ``fma="none"`` rounds every product (``r32(r32(x*c) - r32(y*s))``). Channels
    outside ``[off, off + rot_dim)`` are not touched.

    Args:
        positions: int64 ``[num_tokens]`` or ``[batch_size, seq_len]``; each in ``[0,
            max_position)``. Unchecked unless ``check_indices=True`` (a device read: out of
            range reads outside ``cos_sin_cache``, as vLLM).
        query: ``[*positions.shape, num_heads * head_size]`` or ``[*positions.shape, num_heads,
            head_size]``, bf16/fp16/fp32, last dimension contiguous, any token/head strides
            (a slice of a fused QKV buffer). Rotated in place.
        key: like ``query`` with any ``num_kv_heads``, or None. Rotated in place.
        head_size: channels per head.
        cos_sin_cache: ``[max_position, rot_dim]``, cos half first; the query's dtype or float32;
            ``rot_dim`` even, ``rot_dim + rope_dim_offset <= head_size``.
        is_neox: NeoX (rotate-half) or GPT-J (interleaved) pairs.
        rope_dim_offset: first rotated channel of each head.  inverse: negate sin.
        fma: ``"vllm"`` (default) or ``"none"``, see above.
        check_indices: opt-in check that every position is in ``[0, max_position)``, with no
            host synchronisation: on torch tensors an asynchronous device-side assert queued
            before the kernel (when it fires, the CUDA context ends: a debugging aid, not
            control flow); under the simulator a ``LoomnbValueError`` before the launch. Off by
            default, as vLLM never checks; a checked call skips the eager fast path.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(query, key)``. Mutates: ``query`` and ``key``.

    Raises ``LoomnbTypeError`` / ``LoomnbValueError`` naming the argument for a wrong dtype,
    shape, stride, device or overlap, before any launch. Zero tokens is a no-op.

    Matches vLLM ``torch.ops._C.rotary_embedding(positions, query, key, head_size,
    cos_sin_cache, is_neox, rope_dim_offset, inverse)``. Differs: the key's head stride is the
    key's own (vLLM uses the query's for both); the cos/sin dtype is the query's or fp32
    (vLLM's op takes any float dtype); any ``num_kv_heads`` is accepted (vLLM's op requires
    ``num_heads % num_kv_heads == 0``; loomnb's kernel rotates query and key heads as separate
    items and never uses the ratio).
    """
    op = "loomnb.rotary_embedding"
    r = rope_inputs(op, positions, query, key, head_size, cos_sin_cache, is_neox,
                    rope_dim_offset, inverse, fma)
    C.writable(op, {"query": r.qv, "key": r.kv})
    C.no_overlap(op, {"query": r.qv, "key": r.kv}, {"positions": r.pv, "cos_sin_cache": r.cs},
                 interleaved=True)
    _check_indices(op, check_indices, r, stream=stream)
    spec = RopeCacheSpec(r.q.kind, r.cs.kind, True, is_neox, inverse, FORMS[(fma, inverse)])
    _launch(op, spec, r, None, stream, launch_key)
    return query, key


def _fake_rope_out(positions, query, key, head_size, cos_sin_cache, is_neox=True, **_):
    return query.new_empty(query.shape), key.new_empty(key.shape)


@torch_op("Tensor positions, Tensor query, Tensor key, int head_size, Tensor cos_sin_cache, "
          "bool is_neox=True, *, bool check_indices=False", outputs=("query_out", "key_out"),
          fake=_fake_rope_out)
def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True,
                                  *, query_out=None, key_out=None, check_indices=False,
                                  stream=None, launch_key=None):
    """Rotary position embedding of ``query`` and ``key`` into new arrays (out of place).

    ``query_out``/``key_out`` are ``query``/``key`` rotated exactly as :func:`rotary_embedding`
    with ``rope_dim_offset=0``, ``inverse=False``, ``fma="vllm"`` rotates them in place -- the
    same bits -- and the channels past ``rot_dim`` copied unchanged; ``query`` and ``key`` are
    not modified. Under torch.compile this form needs no copies: an in-place op on views of a
    fused QKV buffer is functionalised into a copy of each view and a scatter back, which an
    out-of-place op does not pay (the vLLM plug-in, ``docs/vllm.md``, routes RoPE here).

    Args:
        positions: int64 ``[num_tokens]`` or ``[batch_size, seq_len]``; each in ``[0,
            max_position)``, unchecked (a device read) unless ``check_indices=True``.
        query: ``[*positions.shape, num_heads * head_size]`` or ``[*positions.shape, num_heads,
            head_size]``, bf16/fp16/fp32, last dimension contiguous, any token/head strides.
            Not modified.
        key: like ``query``, any ``num_kv_heads`` (3 query heads with 2 key heads is fine:
            the kernel never uses the ratio). Not modified.
        head_size: channels per head.
        cos_sin_cache: ``[max_position, rot_dim]``, cos half first; the query's dtype or float32;
            ``rot_dim`` even, ``<= head_size``.
        is_neox: a bool: NeoX (rotate-half) or GPT-J (interleaved) pairs.
        query_out, key_out: optional outputs of ``query``'s / ``key``'s shape and dtype, last
            dimension contiguous, sharing no element with any argument (slices of one fused
            output buffer are fine). Allocated (contiguous) when None.
        check_indices: opt-in asynchronous check of ``positions``, as :func:`rotary_embedding`.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(query_out, key_out)``. Mutates: ``query_out`` and ``key_out`` only.

    Raises ``LoomnbTypeError`` / ``LoomnbValueError`` naming the argument for a wrong dtype,
    shape, stride, device or overlap, before any launch. Zero tokens is a no-op.

    Matches FlashInfer ``apply_rope_with_cos_sin_cache(positions, query, key, head_size,
    cos_sin_cache, is_neox)`` (its arguments, out-of-place result and output shapes). Differs:
    the numerics are vLLM's ``rotary_embedding`` (those of :func:`rotary_embedding` with
    ``fma="vllm"``), not FlashInfer's; the cos/sin cache may be of the query's dtype as well as
    float32; ``is_neox`` must be a bool.
    """
    op = "loomnb.apply_rope_with_cos_sin_cache"
    if key is None:
        fail_type(op, "key", "an array (the out-of-place form rotates a query and a key)", "None")
    r = rope_inputs(op, positions, query, key, head_size, cos_sin_cache, is_neox, 0, False,
                    "vllm")
    q, lead, D = r.q, r.positions.shape, r.head_size
    qo = C.output(op, "query_out", query_out, like=q, kind=q.kind, shape=q.shape,
                  like_name="query")
    ko = C.output(op, "key_out", key_out, like=r.kv, kind=q.kind, shape=tuple(r.kv.obj.shape),
                  like_name="key")
    qov = heads(op, "query_out", qo, lead, D, "query's shape")
    kov = heads(op, "key_out", ko, lead, D, "key's shape")
    C.no_overlap(op, {"query_out": qov, "key_out": kov},
                 {"query": r.qv, "key": r.kv, "positions": r.pv, "cos_sin_cache": r.cs},
                 interleaved=True)
    _check_indices(op, check_indices, r, stream=stream)
    spec = RopeCacheSpec(q.kind, r.cs.kind, True, is_neox, False, FORMS[("vllm", False)], out=True)
    _launch(op, spec, r, None, stream, launch_key, out=(qov, kov))
    return qo.obj, ko.obj


def _cache_op(op, legacy, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
              k_scale, v_scale, check_indices, stream, launch_key):
    c = kv_inputs(op, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                  v_scale, legacy=legacy)
    C.no_overlap(op, {"key_cache": c.kcv, "value_cache": c.vcv},
                 {"key": c.k, "value": c.v, "slot_mapping": c.slots, "k_scale": c.ks,
                  "v_scale": c.vs}, interleaved=True)
    _check_indices(op, check_indices, cache=c, stream=stream)
    spec = RopeCacheSpec(c.k.kind, c.k.kind, False, True, False, "nn",
                         "legacy" if legacy else "flash", c.kv)
    _launch(op, spec, None, c, stream, launch_key)
    return key_cache, value_cache


@torch_op("Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
          "Tensor slot_mapping, str kv_cache_dtype, Tensor? k_scale, Tensor? v_scale, *, "
          "bool check_indices=False", returns=("key_cache", "value_cache"))
def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                            k_scale, v_scale, *, check_indices=False, stream=None,
                            launch_key=None):
    """Write each token's key and value to its cache slot (vLLM's flash layouts).

    For ``t < num_tokens = slot_mapping.shape[0]`` with ``slot = slot_mapping[t] >= 0``,
    ``block, offset = slot // block_size, slot % block_size``::

        key_cache[block, offset, h, d] = cv(key[t, h, d], k_scale[h])   (value likewise)

    ``cv`` copies the bits (``kv_cache_dtype="auto"``) or stores ``fp8(f(x) / scale)`` --
    an IEEE float32 division, then round to nearest even, saturating (E4M3 +-448, E5M2
    +-57344; infinities too), NaN kept (0x7F), the sign of zero kept. Units: stored = real /
    scale. A negative slot (padding, ``PAD_SLOT_ID = -1``) writes nothing.

    Args:
        key, value: ``[num_tokens_padded, num_kv_heads, head_size]`` bf16/fp16/fp32 of the
            same shape (``value`` may also be ``[num_tokens_padded, num_kv_heads * head_size]``),
            last dimension contiguous, any token/head strides; may carry more tokens than
            ``slot_mapping`` (CUDA-graph padding), which are ignored.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]`` views
            with any strides and a contiguous last dimension: NHD, HND, interleaved or split
            (``loomnb.layouts.kv_views``). dtype: key's for ``"auto"``, else ``uint8`` or
            ``float8_e4m3fn`` / ``float8_e5m2``.
        slot_mapping: int64 ``[num_tokens]``, ``num_tokens <= num_tokens_padded``; each -1
            (padding) or below ``num_blocks * block_size``. Out-of-range slots are unchecked
            device writes unless ``check_indices=True``. Slots other than -1 must be distinct
            (as vLLM's scheduler assigns them); if two tokens share a slot they race, and which
            one the slot holds is unspecified (as in vLLM's op).
        kv_cache_dtype: ``"auto"``, ``"fp8"`` (= ``"fp8_e4m3"``), ``"fp8_e4m3"``, ``"fp8_e5m2"``.
        k_scale, v_scale: float32 device arrays of shape ``[1]`` or ``[num_kv_heads]``; ignored
            (may be None) for ``"auto"``. Not range-checked (a device read): a zero scale
            saturates, as vLLM.
        check_indices: opt-in check that every slot is -1 (``PAD_SLOT_ID``) or in ``[0,
            num_blocks * block_size)`` -- other negative slots, which the kernel skips as
            padding too, are flagged as likely bugs -- with no host synchronisation: on torch
            tensors an asynchronous device-side assert queued before the kernel (when it fires,
            the CUDA context ends and the kernel does not run: a debugging aid, not control
            flow); under the simulator a ``LoomnbValueError`` before the launch. Off by
            default, as vLLM never checks; a checked call skips the eager fast path.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(key_cache, value_cache)``. Mutates: ``key_cache`` and ``value_cache`` (the slots
    of ``slot_mapping`` only). Raises ``LoomnbTypeError`` / ``LoomnbValueError`` before any
    launch and with nothing written, naming the argument, expected and received -- for a wrong
    dtype, layout or device, and for every pair of dimensions the kernel relies on that
    disagree (``key`` and ``value`` tokens, heads or head_size; ``slot_mapping`` longer than
    the tokens; the caches' heads, head_size or shape; a scale's length); zero tokens is a
    no-op.

    Matches vLLM ``torch.ops._C_cache_ops.reshape_and_cache_flash(key, value, key_cache,
    value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)``; loomnb also accepts a
    per-head ``[num_kv_heads]`` scale.
    """
    return _cache_op("loomnb.reshape_and_cache_flash", False, key, value, key_cache, value_cache,
                     slot_mapping, kv_cache_dtype, k_scale, v_scale, check_indices, stream,
                     launch_key)


@torch_op("Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
          "Tensor slot_mapping, str kv_cache_dtype, Tensor? k_scale, Tensor? v_scale, *, "
          "bool check_indices=False", returns=("key_cache", "value_cache"))
def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                      v_scale, *, check_indices=False, stream=None, launch_key=None):
    """:func:`reshape_and_cache_flash` for the legacy paged-attention layout: ``key_cache
    [num_blocks, num_kv_heads, head_size // x, block_size, x]`` (``x = 16 // cache element
    size``: 8 for bf16/fp16, 16 for FP8, 4 for fp32) and ``value_cache [num_blocks,
    num_kv_heads, head_size, block_size]``, any strides (the key's last dimension contiguous)::

        key_cache[block, h, d // x, offset, d % x] = cv(key[t, h, d], k_scale[h])
        value_cache[block, h, d, offset]           = cv(value[t, h, d], v_scale[h])

    Arguments (``check_indices`` included: the slots of ``num_blocks * block_size``),
    conversion, returns, mutation and errors as :func:`reshape_and_cache_flash`.
    Matches vLLM ``torch.ops._C_cache_ops.reshape_and_cache`` (which assumes contiguous caches).
    """
    return _cache_op("loomnb.reshape_and_cache", True, key, value, key_cache, value_cache,
                     slot_mapping, kv_cache_dtype, k_scale, v_scale, check_indices, stream,
                     launch_key)


@torch_op("Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor value, "
          "Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping, int head_size, "
          "Tensor cos_sin_cache, bool is_neox, str kv_cache_dtype='auto', Tensor? k_scale=None, "
          "Tensor? v_scale=None, *, int rope_dim_offset=0, bool check_indices=False",
          returns=("query", "key", "key_cache", "value_cache"))
def rotary_embedding_and_cache(positions, query, key, value, key_cache, value_cache,
                               slot_mapping, head_size, cos_sin_cache, is_neox,
                               kv_cache_dtype="auto", k_scale=None, v_scale=None, *,
                               rope_dim_offset=0, check_indices=False, stream=None,
                               launch_key=None):
    """:func:`rotary_embedding` of ``query`` and ``key`` then the cache write of the rotated
    key and ``value`` (:func:`reshape_and_cache_flash`, or :func:`reshape_and_cache` when
    ``key_cache`` is the 5-D legacy key), in **one launch**; bit-identical to the two ops in
    sequence (``fma="vllm"``, ``inverse=False``).

    All ``positions.numel()`` tokens are rotated; the first ``slot_mapping.shape[0]`` of them
    are cached (slots < 0 skipped). The cached key is the rotated key as stored (rounded to
    the activation dtype), converted as ``kv_cache_dtype`` says.

    Args: as the two ops; ``value`` is ``[num_tokens, num_kv_heads * head_size]`` or
    ``[num_tokens, num_kv_heads, head_size]``; ``cos_sin_cache`` has the query's dtype (vLLM's
    rotary layer casts it so); ``rope_dim_offset`` keyword-only; ``check_indices=True`` checks
    both ``positions`` (as :func:`rotary_embedding`) and ``slot_mapping`` (as
    :func:`reshape_and_cache_flash`) without a host sync -- off by default: out-of-range
    positions and slots are unchecked device reads and writes.

    Returns ``(query, key, key_cache, value_cache)``. Mutates: ``query``, ``key`` (rotated) and
    the caches (the slots of ``slot_mapping``). Raises as the two ops, before any launch.

    Matches vLLM 0.24's ``rotary_embedding`` + ``reshape_and_cache_flash`` (two launches);
    FlashInfer's ``apply_rope_with_cos_sin_cache_inplace`` + ``append_paged_kv_cache``.
    """
    op = "loomnb.rotary_embedding_and_cache"
    if key is None:
        fail_value(op, "key", "an array (the fused op caches it)", "None")
    r = rope_inputs(op, positions, query, key, head_size, cos_sin_cache, is_neox,
                    rope_dim_offset, False, "vllm", cs_kinds=None)
    q = r.q
    check_same_kind(op, "cos_sin_cache", r.cs, "query", q)
    legacy = ad.wrap(op, "key_cache", key_cache).ndim == 5
    v = ad.wrap(op, "value", value)
    vv = (heads(op, "value", v, (r.qv.shape[0],), r.head_size, "[num_tokens, ...]")
          if v.ndim in (2, 3) else None)
    if vv is None:
        fail_value(op, "value", "[num_tokens, num_kv_heads * head_size] or [num_tokens, "
                   "num_kv_heads, head_size]", f"shape {list(v.shape)}")
    check_same_kind(op, "value", v, "key", q)
    check_same_device(op, "value", v, "key", q)
    c = kv_inputs(op, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                  v_scale, legacy=legacy, like=q, kview=r.kv, vview=vv, value_shape=list(v.shape))
    C.writable(op, {"query": r.qv, "key": r.kv})
    C.no_overlap(op, {"query": r.qv, "key": r.kv, "key_cache": c.kcv, "value_cache": c.vcv},
                 {"positions": r.pv, "value": c.v, "cos_sin_cache": r.cs, "slot_mapping": c.slots,
                  "k_scale": c.ks, "v_scale": c.vs}, interleaved=True)
    _check_indices(op, check_indices, r, c, stream)
    spec = RopeCacheSpec(q.kind, r.cs.kind, True, is_neox, False, FORMS[("vllm", False)],
                         "legacy" if legacy else "flash", c.kv)
    _launch(op, spec, r, c, stream, launch_key)
    return query, key, key_cache, value_cache
