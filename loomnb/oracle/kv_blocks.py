"""NumPy + ml_dtypes references for KV-cache movement: the truth the ``kv_blocks`` ops are
compared with.

* ``copy_blocks``: for every cache ``c`` of ``key_caches + value_caches`` and every row
  ``(src, dst)`` of ``block_mapping`` with no negative entry, ``c[dst] = c[src]`` (bits), the
  rows in order;
* ``swap_blocks``: for every row ``(s, d)`` of ``block_mapping``, the first
  ``block_size_in_bytes`` bytes at byte ``s * src.strides[0]`` of ``src`` are copied to byte
  ``d * dst.strides[0]`` of ``dst`` (rows with a negative entry skipped);
* ``gather_cache``: for sequence ``b`` and ``t < cu_seq_lens[b+1] - cu_seq_lens[b]``, with
  ``pos = seq_starts[b] + t`` (``t`` without ``seq_starts``), ``dst[cu_seq_lens[b] + t] =
  cv(src_cache[block_table[b, pos // B], pos % B])``, ``cv`` the bits (``"auto"``) or
  ``r(f32(fp8) * scale)`` (an FP8 cache, ``r`` rounding to the dst dtype); rows of ``dst`` past
  ``cu_seq_lens[-1]`` untouched;
* ``compact_blocks``: ``c[i] = c_before[permutation[i]]`` for every block ``i`` of every cache;
* ``concat_and_cache_mla``: for tokens with ``slot >= 0``, ``kv_cache[slot // B, slot % B] =
  cv([kv_c[t], k_pe[t]])``, ``cv`` the bits or ``fp8(f32(x) / scale)`` (IEEE division,
  saturating, NaN kept), as ``reshape_and_cache_flash``.

Arrays are NumPy arrays (bf16 as ``ml_dtypes.bfloat16``, FP8 caches as ``uint8`` or ml_dtypes
FP8) and are mutated in place like the ops'; ``stream`` and ``check_indices`` are accepted and
ignored.
"""

import numpy as np

from .fp8 import e4m3_decode, e4m3_encode, e5m2_decode, e5m2_encode
from .numerics import to_dtype

__all__ = ["copy_blocks", "swap_blocks", "gather_cache", "compact_blocks", "concat_and_cache_mla"]

_KV = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def _pairs(block_mapping):
    return np.asarray(block_mapping, dtype=np.int64).reshape(-1, 2)


def copy_blocks(key_caches, value_caches, block_mapping, *, check_indices=False, stream=None):
    """Reference ``copy_blocks``: copies block ``src`` to block ``dst`` of every cache, for each
    ``(src, dst)`` row in order; mutates the caches and returns ``(key_caches, value_caches)``."""
    for src, dst in _pairs(block_mapping):
        if src < 0 or dst < 0:  # a padding row
            continue
        for c in (*key_caches, *value_caches):
            c[dst] = c[src]
    return key_caches, value_caches


def swap_blocks(src, dst, block_size_in_bytes, block_mapping, *, stream=None):
    """Reference ``swap_blocks``: byte copies of ``block_size_in_bytes`` from block ``s`` of
    ``src`` (byte offset ``s * src.strides[0]``) to block ``d`` of ``dst``; mutates ``dst``."""
    sb, db, n = _bytes(src), _bytes(dst), int(block_size_in_bytes)
    for s, d in _pairs(block_mapping):
        if s < 0 or d < 0:
            continue
        so, do = int(s) * src.strides[0], int(d) * dst.strides[0]
        db[do:do + n] = sb[so:so + n]
    return dst


class _Bytes:
    def __init__(self, a):
        self.a = a  # keeps the memory alive
        self.__array_interface__ = {"shape": (a.shape[0] * a.strides[0],), "typestr": "|u1",
                                    "data": (a.__array_interface__["data"][0], False),
                                    "version": 3}


def _bytes(a):
    """The ``shape[0] * strides[0]`` bytes of ``a``'s blocks from its first element (a view)."""
    return np.asarray(_Bytes(a))


def gather_cache(src_cache, dst, block_table, cu_seq_lens, kv_cache_dtype="auto", scale=None,
                 seq_starts=None, *, check_indices=False, stream=None):
    """Reference ``gather_cache``: the tokens of each sequence's pages, back to back in ``dst``
    (mutated, returned)."""
    kvd = _KV[kv_cache_dtype]
    cu = np.asarray(cu_seq_lens, dtype=np.int64)
    bt = np.asarray(block_table)
    B = src_cache.shape[1]
    rows = []
    for b in range(cu.shape[0] - 1):
        n = int(cu[b + 1] - cu[b])
        start = 0 if seq_starts is None else int(np.asarray(seq_starts)[b])
        pos = start + np.arange(n)
        rows.append((int(cu[b]), bt[b, pos // B], pos % B))
    for r0, blk, off in rows:
        if blk.size == 0:
            continue
        x = src_cache[blk, off]
        if kvd != "auto":
            codes = x.view(np.uint8) if x.dtype != np.uint8 else x
            f = (e4m3_decode if kvd == "fp8_e4m3" else e5m2_decode)(codes)
            s = np.float32(np.asarray(scale, dtype=np.float32).reshape(-1)[0])
            with np.errstate(over="ignore", invalid="ignore"):
                x = to_dtype(np.multiply(f, s, dtype=np.float32), dst.dtype)
        dst[r0:r0 + blk.shape[0]] = x
    return dst


def compact_blocks(kv_cache, permutation, *, stream=None):
    """Reference ``compact_blocks``: ``c[i] = c_before[permutation[i]]`` for every cache ``c``
    of ``kv_cache`` (one array or a list of arrays; mutated, returned)."""
    perm = np.asarray(permutation, dtype=np.int64).reshape(-1)
    caches = kv_cache if isinstance(kv_cache, (list, tuple)) else [kv_cache]
    for c in caches:
        c[:perm.shape[0]] = c[perm].copy()
    return kv_cache


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, *,
                         check_indices=False, stream=None):
    """Reference ``concat_and_cache_mla``: ``kv_cache[slot] = cv(concat(kv_c[t], k_pe[t]))`` for
    the tokens with ``slot >= 0``; mutates ``kv_cache`` and returns it."""
    kvd = _KV[kv_cache_dtype]
    slots = np.asarray(slot_mapping, dtype=np.int64).reshape(-1)
    n = slots.shape[0]
    kc = np.asarray(kv_c)[:n]
    kp = np.asarray(k_pe)[:n]
    kp = kp.reshape(kp.shape[0], kp.shape[-1])
    rows = np.concatenate([kc, kp], axis=1)
    keep = slots >= 0
    B = kv_cache.shape[1]
    blk, off = slots[keep] // B, slots[keep] % B
    rows = rows[keep]
    if kvd == "auto":
        kv_cache[blk, off] = rows
        return kv_cache
    s = np.float32(np.asarray(scale, dtype=np.float32).reshape(-1)[0])
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        q = rows.astype(np.float32) / s
    codes = (e4m3_encode if kvd == "fp8_e4m3" else e5m2_encode)(q)
    kv_cache.view(np.uint8)[blk, off] = codes
    return kv_cache
