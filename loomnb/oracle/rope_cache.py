"""NumPy + ml_dtypes references for the RoPE / KV-cache family: the truth every test compares against.

With ``f`` = widen to float32 and ``r`` = round to the activation dtype (:func:`to_dtype`):

* ``rotary_embedding``: for each token, head and pair ``(x, y)`` (NeoX ``(off+i, off+e+i)``,
  GPT-J ``(off+2i, off+2i+1)``), ``c = f(cos[p, i])``, ``s = f(sin[p, i])`` (negated for
  ``inverse``): ``x <- r(x*c - y*s)``, ``y <- r(y*c + x*s)`` in float32 with the FMA
  contraction of ``fma`` (``loomnb.ops._rope_cache_kernels.FORMS``; an FMA is emulated exactly
  by :func:`~loomnb.oracle.numerics.fma_f32`), everything else untouched;
* ``reshape_and_cache_flash`` / ``reshape_and_cache``: ``cache[slot] = key[t]`` bit for bit
  (``"auto"``) or ``e4m3/e5m2(f(key[t]) / scale)`` (IEEE float32 division, saturating, NaN ->
  0x7F, signed zero kept); slots < 0 skipped;
* ``rotary_embedding_and_cache``: the two in sequence;
* ``apply_rope_with_cos_sin_cache``: ``rotary_embedding`` of copies, returned.

``form=`` (oracle only) takes any of the nine two-letter forms (``"ae"``, ``"bd"``, ``"nn"``...)
so a GPU run can ask which one vLLM's compiled op computes. Arguments are NumPy arrays (bf16 as
``ml_dtypes.bfloat16``, FP8 caches as ``uint8`` or ml_dtypes FP8) and are mutated in place like
the ops'; ``stream`` and ``check_indices`` are accepted and ignored (the ops' device-side
index checks; the references index on the host).
"""

import numpy as np

from .fp8 import e4m3_encode, e5m2_encode
from .numerics import fma_f32, to_dtype

__all__ = ["rotary_embedding", "apply_rope_with_cos_sin_cache", "reshape_and_cache_flash",
           "reshape_and_cache", "rotary_embedding_and_cache"]

_FORMS = {("vllm", False): "ae", ("vllm", True): "ae", ("none", False): "nn", ("none", True): "nn"}
_KV = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def rotate(x, y, c, s, form):
    """``(x', y')`` float32 of one of the nine forms (``s`` already negated for ``inverse``)."""
    f32 = np.float32
    with np.errstate(invalid="ignore", over="ignore"):
        xc, ys, yc, xs = (np.multiply(x, c, dtype=f32), np.multiply(y, s, dtype=f32),
                          np.multiply(y, c, dtype=f32), np.multiply(x, s, dtype=f32))
        xo = {"a": lambda: fma_f32(x, c, -ys), "b": lambda: fma_f32(-y, s, xc),
              "n": lambda: np.subtract(xc, ys, dtype=f32)}[form[0]]()
        yo = {"d": lambda: fma_f32(y, c, xs), "e": lambda: fma_f32(x, s, yc),
              "n": lambda: np.add(yc, xs, dtype=f32)}[form[1]]()
    return xo, yo


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0,
                     inverse=False, *, fma="vllm", form=None, check_indices=False, stream=None):
    """Reference ``rotary_embedding``: rotates ``query`` (and ``key``) in place; returns them."""
    form = form or _FORMS[(fma, inverse)]
    pos = np.asarray(positions).reshape(-1)
    T = pos.shape[0]
    cs = np.asarray(cos_sin_cache)
    e = cs.shape[1] // 2
    c = cs[pos, :e].astype(np.float32)[:, None, :]
    s = cs[pos, e:].astype(np.float32)[:, None, :]
    if inverse:
        s = -s
    off = rope_dim_offset
    for arr in (query, key):
        if arr is None:
            continue
        a = np.asarray(arr)
        if a.size == 0:
            continue
        work = a.reshape(T, -1, head_size).astype(np.float32)
        if is_neox:
            xi, yi = off + np.arange(e), off + e + np.arange(e)
        else:
            xi, yi = off + 2 * np.arange(e), off + 2 * np.arange(e) + 1
        xo, yo = rotate(work[:, :, xi], work[:, :, yi], c, s, form)
        out = a.reshape(T, -1, head_size).copy()  # untouched channels keep their bits
        out[:, :, xi] = to_dtype(xo, a.dtype)
        out[:, :, yi] = to_dtype(yo, a.dtype)
        a[...] = out.reshape(a.shape)
    return query, key


def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True,
                                  *, query_out=None, key_out=None, check_indices=False,
                                  stream=None):
    """Reference out-of-place RoPE: ``rotary_embedding`` of copies (``fma="vllm"``), written to
    ``query_out``/``key_out`` (new arrays when None); ``query`` and ``key`` are not modified."""
    q, k = np.array(query, copy=True), np.array(key, copy=True)
    rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)
    if query_out is None:
        query_out = q
    else:
        query_out[...] = q
    if key_out is None:
        key_out = k
    else:
        key_out[...] = k
    return query_out, key_out


def _codes(x, kvd, scale):
    """Cache elements of activation values ``x [T, Hk, D]`` (``scale`` [Hk] or [1])."""
    if kvd == "auto":
        return x
    sc = np.asarray(scale, dtype=np.float32).reshape(-1)
    sc = (sc if sc.size > 1 else np.repeat(sc, x.shape[1]))[None, :, None]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        q = x.astype(np.float32) / sc
    return (e4m3_encode if kvd == "fp8_e4m3" else e5m2_encode)(q)


def _write(cache, blk, off, codes, kvd):
    """cache[blk, off] = codes (bits), ``cache`` a [NB, B, Hk, D] view."""
    if kvd == "auto":
        cache[blk, off] = codes
    else:
        cache.view(np.uint8)[blk, off] = codes


def _kept_tokens(key, value, slot_mapping, block_size):
    """``(blk, off, k, v)`` of the tokens whose slot is >= 0 (the rest write nothing): slot =
    ``blk * block_size + off``, and their rows of ``key``/``value`` (the first
    ``num_tokens = len(slot_mapping)`` rows, ``[num_tokens, Hk, D]``)."""
    slots = np.asarray(slot_mapping)
    keep = slots >= 0
    blk, off = slots[keep] // block_size, slots[keep] % block_size
    n = slots.shape[0]
    return blk, off, np.asarray(key)[:n][keep], np.asarray(value)[:n][keep]


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                            k_scale, v_scale, *, check_indices=False, stream=None):
    """Reference ``reshape_and_cache_flash`` (caches ``[NB, B, Hk, D]`` views): mutates them."""
    kvd = _KV[kv_cache_dtype]
    blk, off, k, v = _kept_tokens(key, value, slot_mapping, key_cache.shape[1])
    _write(key_cache, blk, off, _codes(k, kvd, k_scale), kvd)
    _write(value_cache, blk, off, _codes(v, kvd, v_scale), kvd)
    return key_cache, value_cache


def _legacy_views(key_cache, value_cache):
    """The legacy caches as [NB, B, Hk, D] views: key [NB, Hk, D/x, B, x], value [NB, Hk, D, B]."""
    kview = key_cache.transpose(0, 3, 1, 2, 4)
    vview = value_cache.transpose(0, 3, 1, 2)
    return kview, vview


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                      v_scale, *, check_indices=False, stream=None):
    """Reference ``reshape_and_cache`` (legacy x-packed key, transposed value): mutates them."""
    kvd = _KV[kv_cache_dtype]
    kview, vview = _legacy_views(key_cache, value_cache)
    blk, off, k, v = _kept_tokens(key, value, slot_mapping, kview.shape[1])
    kc = _codes(k, kvd, k_scale)
    kc = kc.reshape(kc.shape[0], kc.shape[1], kview.shape[3], kview.shape[4])
    _write(kview, blk, off, kc, kvd)
    _write(vview, blk, off, _codes(v, kvd, v_scale), kvd)
    return key_cache, value_cache


def rotary_embedding_and_cache(positions, query, key, value, key_cache, value_cache,
                               slot_mapping, head_size, cos_sin_cache, is_neox,
                               kv_cache_dtype="auto", k_scale=None, v_scale=None, *,
                               rope_dim_offset=0, form=None, check_indices=False, stream=None):
    """Reference fused op: ``rotary_embedding`` then the cache write of the rotated key."""
    rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset,
                     form=form)
    T = np.asarray(positions).size
    if np.asarray(key).size == 0:  # no token, head or channel: nothing to write
        return query, key, key_cache, value_cache
    k3 = np.asarray(key).reshape(T, -1, head_size)
    v3 = np.asarray(value).reshape(T, -1, head_size)
    write = reshape_and_cache if np.asarray(key_cache).ndim == 5 else reshape_and_cache_flash
    write(k3, v3, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    return query, key, key_cache, value_cache
