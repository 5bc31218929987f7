"""vLLM's paged KV cache: slots, block tables and the cache layouts, in vLLM's vocabulary.

A sequence's KV cache lives in fixed-size blocks of ``block_size`` tokens taken from a pool of
``num_blocks``. ``block_tables`` (int32 ``[num_seqs, max_blocks]``) lists each sequence's
blocks in order (unused entries are 0 by convention); ``seq_lens`` (int32 ``[num_seqs]``)
counts its tokens, the new ones included. Token ``pos`` of sequence ``seq`` lives in::

    slot = block_tables[seq, pos // block_size] * block_size + pos % block_size
    block, offset = slot // block_size, slot % block_size

``slot_mapping`` (int64 ``[num_tokens]``) holds that slot for every token of a batch; a
padded token (CUDA-graph padding) has slot ``PAD_SLOT_ID = -1`` and vLLM's cache writes
(``reshape_and_cache[_flash]``) skip it.

Layouts of one layer's ``key_cache``/``value_cache`` (``LAYOUTS``), each a C-contiguous array
of its own:

* ``"NHD"``: ``[num_blocks, block_size, num_kv_heads, head_size]`` -- the K (or V) page order of
  vLLM's flash layouts and FlashInfer's default, and :mod:`loomnb.models.paged_cache`.
  Slot-major: ``cache.view(-1, num_kv_heads, head_size)[slot]``.
* ``"HND"``: ``[num_blocks, num_kv_heads, block_size, head_size]`` -- FlashInfer's other order.
* ``"paged_attention"``: vLLM's ``paged_attention_v1/v2`` kernels: ``key_cache [num_blocks,
  num_kv_heads, head_size // x, block_size, x]`` with ``x = 16 // element_size`` (16 bytes of
  a key row stay together), ``value_cache [num_blocks, num_kv_heads, head_size, block_size]``.

Whole-cache allocations of one layer (``KV_LAYOUTS``): one buffer holding K and V, split by
:func:`kv_views` into two **strided views** (no copy) that the cache-writing and attention ops
take as they are:

* ``"interleaved_nhd"`` / ``"interleaved_hnd"``: ``kv_cache`` of logical shape ``(num_blocks,
  2, block_size, num_kv_heads, head_size)``, ``key_cache = kv_cache[:, 0]``, ``value_cache =
  kv_cache[:, 1]`` -- what vLLM 0.24's FlashAttention, FlashInfer and Triton backends allocate
  (``get_kv_cache_shape``, split with ``unbind(1)``), and FlashInfer's own paged format
  ``[max_num_pages, 2, page_size, num_kv_heads, head_dim]``. A block's K page and V page are
  adjacent (block stride ``2 * block_size * num_kv_heads * head_size``). HND is the same
  logical shape over physical memory ``[num_blocks, 2, num_kv_heads, block_size, head_size]``
  (vLLM's ``VLLM_KV_CACHE_LAYOUT=HND``: stride order (0, 1, 3, 2, 4)).
* ``"split_nhd"`` / ``"split_hnd"``: ``kv_cache`` of logical shape ``(2, num_blocks,
  block_size, num_kv_heads, head_size)``, ``key_cache = kv_cache[0]``, ``value_cache =
  kv_cache[1]`` -- older vLLM trees and vLLM 0.24's ROCm backend; HND physical memory ``[2,
  num_blocks, num_kv_heads, block_size, head_size]``.
* ``"legacy_xpacked"``: ``kv_cache`` of shape ``(2, num_blocks, block_size * num_kv_heads *
  head_size)`` (vLLM's PagedAttention wrapper), ``key_cache = kv_cache[0].view(num_blocks,
  num_kv_heads, head_size // x, block_size, x)`` (the x-packed key) and ``value_cache =
  kv_cache[1].view(num_blocks, num_kv_heads, head_size, block_size)`` -- the per-layer
  ``"paged_attention"`` layout above, written by ``reshape_and_cache``.

**Logical axis order of the views.** For the four flash layouts both views are ``[num_blocks,
block_size, num_kv_heads, head_size]`` (index ``[block, offset, kv_head, d]``) whatever the
physical order; only their strides differ (NHD: ``(2*B*Hk*D or B*Hk*D, Hk*D, D, 1)``; HND:
``(..., D, B*D, 1)``), and ``head_size`` is always the contiguous axis. For
``legacy_xpacked`` the views keep vLLM's own axis order: key ``[block, kv_head, d // x,
offset, d % x]``, value ``[block, kv_head, d, offset]``. :func:`kv_element_offset` gives the
element offset of ``(slot, kv_head, d)`` in either view from its strides.

FlashInfer names the same things differently (``FLASHINFER_TO_VLLM``). It describes the pages
of a batch in CSR form: ``kv_indptr`` (``[num_seqs + 1]``), ``kv_indices`` (the pages of all
sequences back to back) and ``kv_last_page_len`` (tokens in each sequence's last page).
Worked example, ``block_size = page_size = 16``, ``seq_lens = [5, 17]``, ``block_tables =
[[3, 0], [7, 2]]`` (sequence 0 needs ``cdiv(5, 16) = 1`` block, sequence 1 needs 2)::

    kv_indptr        = [0, 1, 3]        # cumulative blocks per sequence
    kv_indices       = [3, 7, 2]        # block_tables rows cut to their used blocks
    kv_last_page_len = [5, 1]           # (seq_len - 1) % block_size + 1
    seq_len          = (kv_indptr[i+1] - kv_indptr[i] - 1) * page_size + kv_last_page_len[i]
    slot of (seq 1, pos 16) = block_tables[1, 16 // 16] * 16 + 16 % 16 = 2 * 16 + 0 = 32

Arrays are NumPy arrays or torch tensors and results come back in the caller's library (and
device). Index dtypes are vLLM's and are checked, never cast: int32 ``block_tables``,
``seq_lens``, ``query_lens`` and FlashInfer's arrays; int64 ``positions``, ``seq_idx`` and
``slot_mapping``.
"""

from __future__ import annotations

import sys

import numpy as np

from ..checks import fail_type, fail_value

PAD_SLOT_ID = -1
LAYOUTS = ("NHD", "HND", "paged_attention")
KV_LAYOUTS = ("interleaved_nhd", "interleaved_hnd", "split_nhd", "split_hnd", "legacy_xpacked")

FLASHINFER_TO_VLLM = {
    "page_size": "block_size",
    "head_dim": "head_size",
    "num_qo_heads": "num_heads",
    "num_kv_heads": "num_kv_heads",
    "batch_size": "num_seqs",
    "max_num_pages": "num_blocks",
    "kv_indptr": "block_tables + seq_lens (cumulative cdiv(seq_lens, block_size))",
    "kv_indices": "block_tables (each row cut to its cdiv(seq_len, block_size) used blocks)",
    "kv_last_page_len": "seq_lens ((seq_len - 1) % block_size + 1)",
    "qo_indptr": "query_start_loc",
    "batch_indices": "seq_idx (vLLM v1: req_indices)",
    "positions": "positions",
    "append_paged_kv_cache": "reshape_and_cache_flash (slot_mapping instead of the CSR arrays)",
    "kv_layout": "layout ('NHD' = vLLM's flash layout, or 'HND')",
    "paged_kv_cache": "kv_cache of KV_LAYOUTS 'interleaved_nhd'/'interleaved_hnd' (same memory)",
}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints: the blocks that ``a`` tokens need."""
    return -(-a // b)


def slot_to_block_offset(slot, block_size: int):
    """``(slot // block_size, slot % block_size)``: the block and the offset inside it.

    ``slot``: a non-negative int or an integer array (NumPy/torch, elementwise).
    """
    _check_block_size("slot_to_block_offset", block_size)
    return slot // block_size, slot % block_size


def block_offset_to_slot(block, offset, block_size: int):
    """``block * block_size + offset``, the inverse of :func:`slot_to_block_offset`.

    Array arithmetic keeps the dtype of ``block``: pass int64 blocks (vLLM's slot dtype) when
    ``num_blocks * block_size`` can exceed 2**31 - 1."""
    _check_block_size("block_offset_to_slot", block_size)
    return block * block_size + offset


def slot_mapping_from_block_tables(block_tables, seq_idx, positions, block_size: int):
    """Cache slot of each token: ``block_tables[seq_idx, pos // block_size] * block_size +
    pos % block_size``; ``PAD_SLOT_ID`` (-1) where ``seq_idx < 0`` (a padded token).

    Args:
        block_tables: int32 ``[num_seqs, max_blocks]``.
        seq_idx: int64 ``[num_tokens]``, the sequence of each token; -1 marks padding, whose
            ``positions`` entry is then ignored.
        positions: int64 ``[num_tokens]``, each token's position in its sequence.
        block_size: tokens per block, >= 1.

    Returns int64 ``slot_mapping [num_tokens]`` in the library (and on the device) of the
    inputs. Vectorised with no host sync and no data-dependent Python, so a decode step can
    build it inside a CUDA graph or ``torch.compile``.

    Raises ``LoomnbTypeError`` for a wrong array type or index dtype, ``LoomnbValueError`` for
    wrong ranks, mismatched lengths or devices. Values are range-checked for NumPy inputs
    only (free on the host); out-of-range torch indices fail in torch's own indexing.
    Matches vLLM v1 ``BlockTable.compute_slot_mapping`` (``req_indices`` = ``seq_idx``).
    """
    op = "slot_mapping_from_block_tables"
    _check_block_size(op, block_size)
    lib = _lib_of(op, "block_tables", block_tables)
    _check_index(op, "block_tables", block_tables, lib, "int32", 2, "[num_seqs, max_blocks]")
    _check_index(op, "seq_idx", seq_idx, lib, "int64", 1, "[num_tokens]")
    _check_index(op, "positions", positions, lib, "int64", 1, "[num_tokens]")
    if positions.shape[0] != seq_idx.shape[0]:
        fail_value(op, "positions", f"of length {seq_idx.shape[0]} (len(seq_idx))",
                   f"length {positions.shape[0]}")
    if lib == "torch":
        for name, a in (("seq_idx", seq_idx), ("positions", positions)):
            if a.device != block_tables.device:
                fail_value(op, name, f"on {block_tables.device} like 'block_tables'",
                           f"a tensor on {a.device}")
        valid = seq_idx >= 0
        pos = positions.where(valid, 0)
        block = block_tables[seq_idx.where(valid, 0), pos // block_size].long()
        return (block * block_size + pos % block_size).where(valid, PAD_SLOT_ID)
    valid = seq_idx >= 0
    pos = np.where(valid, positions, 0)
    _check_range(op, "seq_idx", seq_idx[valid], block_tables.shape[0], "num_seqs")
    _check_range(op, "positions", pos, block_tables.shape[1] * block_size,
                 "max_blocks * block_size")
    block = block_tables[np.where(valid, seq_idx, 0), pos // block_size].astype(np.int64)
    return np.where(valid, block * block_size + pos % block_size, PAD_SLOT_ID)


def seq_idx_and_positions(seq_lens, query_lens=None, num_tokens=None):
    """``(seq_idx, positions)`` (int64 ``[num_tokens]``) of the new tokens of a batch.

    Sequence ``i`` contributes its last ``query_lens[i]`` positions ``seq_lens[i] -
    query_lens[i] .. seq_lens[i] - 1``, sequences back to back (vLLM's ``query_start_loc``
    order). ``query_lens=None`` means the whole sequences (prefill); all ones is a decode
    step. With ``num_tokens`` the result is padded to that length with ``seq_idx = -1`` and
    ``positions = 0`` (vLLM's padded positions). FlashInfer: ``get_batch_indices_positions``.

    Args: ``seq_lens``, ``query_lens`` int32 ``[num_seqs]``, ``0 <= query_lens <= seq_lens``.

    Host-side: torch inputs are copied to the host and results back (a CUDA input syncs).
    """
    op = "seq_idx_and_positions"
    lib, seq_lens_np = _host(op, "seq_lens", seq_lens, "int32", 1, "[num_seqs]")
    q = seq_lens_np if query_lens is None else _host_like(op, "query_lens", query_lens, lib,
                                                          seq_lens, "int32", "[num_seqs]")
    if q.shape != seq_lens_np.shape:
        fail_value(op, "query_lens", f"of shape {list(seq_lens_np.shape)} like 'seq_lens'",
                   f"shape {list(q.shape)}")
    if np.any(q < 0) or np.any(q > seq_lens_np):
        fail_value(op, "query_lens", "0 <= query_lens <= seq_lens elementwise",
                   f"query_lens {q.tolist()} for seq_lens {seq_lens_np.tolist()}")
    total = int(q.sum())
    n = total if num_tokens is None else num_tokens
    if not isinstance(n, int) or n < total:
        fail_value(op, "num_tokens", f"an int >= sum(query_lens) = {total}", repr(num_tokens))
    seq_idx = np.full(n, -1, np.int64)
    positions = np.zeros(n, np.int64)
    seq_idx[:total] = np.repeat(np.arange(len(q), dtype=np.int64), q)
    query_start = np.cumsum(q, dtype=np.int64) - q
    first_pos = (seq_lens_np - q).astype(np.int64)
    positions[:total] = np.arange(total) - query_start[seq_idx[:total]] + first_pos[seq_idx[:total]]
    return _back(seq_idx, lib, seq_lens), _back(positions, lib, seq_lens)


def slot_mapping_from_seq_lens(block_tables, seq_lens, block_size: int, query_lens=None,
                               num_tokens=None):
    """``slot_mapping`` (int64) of the new tokens of a batch: :func:`seq_idx_and_positions`
    then :func:`slot_mapping_from_block_tables`; padding slots are ``PAD_SLOT_ID`` (-1).

    Host-side like :func:`seq_idx_and_positions`.
    """
    seq_idx, positions = seq_idx_and_positions(seq_lens, query_lens, num_tokens)
    return slot_mapping_from_block_tables(block_tables, seq_idx, positions, block_size)


def block_tables_to_flashinfer(block_tables, seq_lens, block_size: int):
    """FlashInfer's ``(kv_indptr, kv_indices, kv_last_page_len)`` (int32) for a batch.

    ``kv_indptr = [0, cumsum(cdiv(seq_lens, block_size))]``, ``kv_indices`` = each
    ``block_tables`` row cut to its used blocks, ``kv_last_page_len = (seq_len - 1) %
    block_size + 1`` (0 for an empty sequence). See the module docstring's worked example.
    Host-side like :func:`seq_idx_and_positions`.
    """
    op = "block_tables_to_flashinfer"
    _check_block_size(op, block_size)
    lib, bt = _host(op, "block_tables", block_tables, "int32", 2, "[num_seqs, max_blocks]")
    sl = _host_like(op, "seq_lens", seq_lens, lib, block_tables, "int32", "[num_seqs]")
    if sl.shape != (bt.shape[0],) or np.any(sl < 0) or np.any(sl > bt.shape[1] * block_size):
        fail_value(op, "seq_lens", f"[num_seqs] = [{bt.shape[0]}] values in 0 .. max_blocks * "
                   f"block_size = {bt.shape[1] * block_size}", f"{sl.tolist()}")
    num_pages = (sl + block_size - 1) // block_size
    kv_indptr = np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32)
    kv_indices = bt[np.arange(bt.shape[1]) < num_pages[:, None]].astype(np.int32)
    last = np.where(sl > 0, (sl - 1) % block_size + 1, 0).astype(np.int32)
    return tuple(_back(a, lib, block_tables) for a in (kv_indptr, kv_indices, last))


def flashinfer_to_block_tables(kv_indptr, kv_indices, kv_last_page_len, page_size: int,
                               max_blocks=None):
    """``(block_tables, seq_lens)`` (int32) from FlashInfer's CSR page arrays.

    ``seq_lens[i] = (num_pages_i - 1) * page_size + kv_last_page_len[i]`` (0 without pages);
    ``block_tables`` is ``[num_seqs, max_blocks]`` (default: the most pages of a sequence),
    unused entries 0. Inverse of :func:`block_tables_to_flashinfer`. Host-side.
    """
    op = "flashinfer_to_block_tables"
    _check_block_size(op, page_size, "page_size")
    lib, indptr = _host(op, "kv_indptr", kv_indptr, "int32", 1, "[num_seqs + 1]")
    indices = _host_like(op, "kv_indices", kv_indices, lib, kv_indptr, "int32", "[kv_indptr[-1]]")
    last = _host_like(op, "kv_last_page_len", kv_last_page_len, lib, kv_indptr, "int32",
                      "[num_seqs]")
    num_pages = np.diff(indptr)
    if len(indptr) < 1 or indptr[0] != 0 or np.any(num_pages < 0) or indptr[-1] != len(indices):
        fail_value(op, "kv_indptr", f"non-decreasing from 0 to len(kv_indices) = {len(indices)}",
                   f"{indptr.tolist()}")
    if last.shape != num_pages.shape or np.any((last < 1) & (num_pages > 0)) or np.any(
            last > page_size):
        fail_value(op, "kv_last_page_len", f"[num_seqs] = [{len(num_pages)}] values in 1 .. "
                   f"page_size = {page_size}", f"{last.tolist()}")
    width = int(num_pages.max(initial=0)) if max_blocks is None else max_blocks
    if not isinstance(width, int) or width < num_pages.max(initial=0):
        fail_value(op, "max_blocks", f"an int >= the most pages of a sequence "
                   f"({num_pages.max(initial=0)})", repr(max_blocks))
    block_tables = np.zeros((len(num_pages), width), np.int32)
    block_tables[np.arange(width) < num_pages[:, None]] = indices
    seq_lens = np.where(num_pages > 0, (num_pages - 1) * page_size + last, 0).astype(np.int32)
    return _back(block_tables, lib, kv_indptr), _back(seq_lens, lib, kv_indptr)


# --- layouts ----------------------------------------------------------------------------------

def paged_attention_x(dtype_itemsize: int) -> int:
    """vLLM's ``x = 16 // element_size``: key elements kept together in the v1/v2 key layout."""
    return _x_for("paged_attention_x", None, dtype_itemsize)


def key_cache_shape(layout, num_blocks, block_size, num_kv_heads, head_size, dtype_itemsize):
    """Shape of one layer's ``key_cache`` in ``layout`` (see the module docstring)."""
    _check_dims("key_cache_shape", num_blocks, block_size, num_kv_heads, head_size)
    if _layout("key_cache_shape", layout) == "paged_attention":
        x = _x_for("key_cache_shape", head_size, dtype_itemsize)
        return (num_blocks, num_kv_heads, head_size // x, block_size, x)
    return value_cache_shape(layout, num_blocks, block_size, num_kv_heads, head_size)


def value_cache_shape(layout, num_blocks, block_size, num_kv_heads, head_size):
    """Shape of one layer's ``value_cache`` in ``layout`` (see the module docstring)."""
    _check_dims("value_cache_shape", num_blocks, block_size, num_kv_heads, head_size)
    return {"NHD": (num_blocks, block_size, num_kv_heads, head_size),
            "HND": (num_blocks, num_kv_heads, block_size, head_size),
            "paged_attention": (num_blocks, num_kv_heads, head_size, block_size),
            }[_layout("value_cache_shape", layout)]


def element_index(layout, slot, kv_head, d, *, block_size, num_kv_heads, head_size,
                  dtype_itemsize=2, which="key"):
    """Flat element index of (token ``slot``, ``kv_head``, dim ``d``) in a C-contiguous
    ``key_cache`` (``which="key"``) or ``value_cache`` of ``layout``. Plain ints::

        NHD:              (slot * num_kv_heads + kv_head) * head_size + d
        HND:              ((block * num_kv_heads + kv_head) * block_size + offset) * head_size + d
        paged_attention:  key   (((block * num_kv_heads + kv_head) * (head_size // x) + d // x)
                                 * block_size + offset) * x + d % x
                          value ((block * num_kv_heads + kv_head) * head_size + d) * block_size
                                + offset

    with ``block, offset = slot // block_size, slot % block_size``, ``x = 16 // dtype_itemsize``.
    """
    op = "element_index"
    layout = _layout(op, layout)
    _check_dims(op, 1, block_size, num_kv_heads, head_size)
    _check_which(op, which)
    for name, v, hi in (("slot", slot, None), ("kv_head", kv_head, num_kv_heads),
                        ("d", d, head_size)):
        if not isinstance(v, int) or v < 0 or (hi is not None and v >= hi):
            fail_value(op, name, "an int >= 0" + ("" if hi is None else f" and < {hi}"), repr(v))
    block, offset = slot // block_size, slot % block_size
    if layout == "NHD":
        return (slot * num_kv_heads + kv_head) * head_size + d
    if layout == "HND":
        return ((block * num_kv_heads + kv_head) * block_size + offset) * head_size + d
    if which == "value":
        return ((block * num_kv_heads + kv_head) * head_size + d) * block_size + offset
    x = _x_for(op, head_size, dtype_itemsize)
    return (((block * num_kv_heads + kv_head) * (head_size // x) + d // x) * block_size
            + offset) * x + d % x


def to_nhd(cache, layout, which="key"):
    """``cache`` in ``layout`` seen as NHD ``[num_blocks, block_size, num_kv_heads, head_size]``:
    a view for NHD, HND and the paged_attention value cache, a copy for its key cache."""
    op = "to_nhd"
    layout, lib = _layout(op, layout), _lib_of(op, "cache", cache)
    _check_which(op, which)
    nd = 5 if (layout, which) == ("paged_attention", "key") else 4
    if cache.ndim != nd:
        fail_value(op, "cache", f"{nd}-D for layout {layout!r} ({which})",
                   f"shape {list(cache.shape)}")
    if layout == "NHD":
        return cache
    if layout == "HND":
        return _permute(cache, lib, (0, 2, 1, 3))
    if which == "value":
        return _permute(cache, lib, (0, 3, 1, 2))
    nb, kvh, hx, bs, x = cache.shape
    return _permute(cache, lib, (0, 3, 1, 2, 4)).reshape(nb, bs, kvh, hx * x)


def from_nhd(cache, layout, which="key"):
    """An NHD ``cache`` rewritten (C-contiguous copy) in ``layout``; NHD is returned as is.
    The paged_attention key layout takes ``x`` from the element size of ``cache``."""
    op = "from_nhd"
    layout, lib = _layout(op, layout), _lib_of(op, "cache", cache)
    _check_which(op, which)
    if cache.ndim != 4:
        fail_value(op, "cache", "4-D [num_blocks, block_size, num_kv_heads, head_size]",
                   f"shape {list(cache.shape)}")
    if layout == "NHD":
        return cache
    if layout == "HND":
        return _contiguous(_permute(cache, lib, (0, 2, 1, 3)), lib)
    if which == "value":
        return _contiguous(_permute(cache, lib, (0, 2, 3, 1)), lib)
    nb, bs, kvh, hs = cache.shape
    itemsize = cache.itemsize if lib == "numpy" else cache.element_size()
    x = _x_for(op, hs, itemsize)
    return _contiguous(_permute(cache.reshape(nb, bs, kvh, hs // x, x), lib, (0, 2, 3, 1, 4)), lib)


# --- whole-cache allocations and their K/V views ----------------------------------------------

def kv_cache_shape(layout, num_blocks, block_size, num_kv_heads, head_size):
    """Logical shape of one layer's ``kv_cache`` in ``layout`` (``KV_LAYOUTS``; see the module
    docstring): ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` for the interleaved
    layouts, ``(2, num_blocks, ...)`` for the split ones, ``(2, num_blocks, block_size *
    num_kv_heads * head_size)`` for ``legacy_xpacked``."""
    op = "kv_cache_shape"
    _check_dims(op, num_blocks, block_size, num_kv_heads, head_size)
    layout = _kv_layout(op, layout)
    if layout == "legacy_xpacked":
        return (2, num_blocks, block_size * num_kv_heads * head_size)
    page = (block_size, num_kv_heads, head_size)
    return (num_blocks, 2, *page) if layout.startswith("interleaved") else (2, num_blocks, *page)


_PHYSICAL = {  # physical (allocation) order of the logical axes, as vLLM's stride order
    "interleaved_nhd": (0, 1, 2, 3, 4), "interleaved_hnd": (0, 1, 3, 2, 4),
    "split_nhd": (0, 1, 2, 3, 4), "split_hnd": (0, 1, 3, 2, 4), "legacy_xpacked": (0, 1, 2)}


def allocate_kv_cache(layout, num_blocks, block_size, num_kv_heads, head_size, dtype,
                      device=None, *, lib="torch", fill=0):
    """One layer's ``kv_cache`` in ``layout``: a new buffer of :func:`kv_cache_shape` whose
    strides follow the layout's physical order (HND: heads outside the block offset), filled
    with ``fill`` (None: uninitialised). ``dtype`` is a torch dtype (``lib="torch"``, on
    ``device``) or a NumPy/ml_dtypes dtype (``lib="numpy"``); FP8 caches may be ``uint8`` (as
    vLLM allocates them) or ``float8_e4m3fn``/``float8_e5m2``. Split it with :func:`kv_views`.

    The legacy layout needs ``head_size`` to be a multiple of ``x = 16 // element_size``."""
    op = "allocate_kv_cache"
    shape = kv_cache_shape(layout, num_blocks, block_size, num_kv_heads, head_size)
    order = _PHYSICAL[layout]
    phys = tuple(shape[i] for i in order)
    inverse = tuple(order.index(i) for i in range(len(order)))
    if lib == "torch":
        torch = __import__("torch")
        buf = torch.empty(phys, dtype=dtype, device=device)
        if layout == "legacy_xpacked":
            _x_for(op, head_size, buf.element_size())
        if fill is not None:
            buf.fill_(fill)
        return buf.permute(inverse)
    if lib != "numpy":
        fail_value(op, "lib", "'torch' or 'numpy'", repr(lib))
    buf = np.empty(phys, dtype=dtype)
    if layout == "legacy_xpacked":
        _x_for(op, head_size, buf.itemsize)
    if fill is not None:
        buf[...] = fill
    return buf.transpose(inverse)


def kv_views(kv_cache, layout, num_kv_heads=None, head_size=None):
    """``(key_cache, value_cache)``: strided views of ``kv_cache`` (never copies).

    Flash layouts: both ``[num_blocks, block_size, num_kv_heads, head_size]`` (``kv_cache[:,
    0]``/``[:, 1]`` interleaved, ``kv_cache[0]``/``[1]`` split). ``legacy_xpacked`` needs
    ``num_kv_heads`` and ``head_size``: key ``[num_blocks, num_kv_heads, head_size // x,
    block_size, x]``, value ``[num_blocks, num_kv_heads, head_size, block_size]``."""
    op = "kv_views"
    layout = _kv_layout(op, layout)
    lib = _lib_of(op, "kv_cache", kv_cache)
    if layout == "legacy_xpacked":
        if kv_cache.ndim != 3 or kv_cache.shape[0] != 2:
            fail_value(op, "kv_cache", "of shape (2, num_blocks, block_size * num_kv_heads * "
                       "head_size)", f"shape {list(kv_cache.shape)}")
        _check_dims(op, kv_cache.shape[1], 1, num_kv_heads, head_size)
        per_block = kv_cache.shape[2]
        if per_block % (num_kv_heads * head_size):
            fail_value(op, "kv_cache", f"pages of block_size * {num_kv_heads} * {head_size} "
                       "elements", f"{per_block} elements per block")
        nb, bs = kv_cache.shape[1], per_block // (num_kv_heads * head_size)
        itemsize = kv_cache.itemsize if lib == "numpy" else kv_cache.element_size()
        x = _x_for(op, head_size, itemsize)
        return (kv_cache[0].reshape(nb, num_kv_heads, head_size // x, bs, x),
                kv_cache[1].reshape(nb, num_kv_heads, head_size, bs))
    if kv_cache.ndim != 5 or kv_cache.shape[0 if layout.startswith("split") else 1] != 2:
        fail_value(op, "kv_cache", "of shape " + ("(2, num_blocks, ...)" if layout.startswith(
            "split") else "(num_blocks, 2, ...)") + f" for {layout!r}", f"shape {list(kv_cache.shape)}")
    if layout.startswith("split"):
        return kv_cache[0], kv_cache[1]
    return kv_cache[:, 0], kv_cache[:, 1]


def kv_element_offset(view, slot, kv_head, d, block_size=None):
    """Element offset (from the view's first element, in elements) of ``(slot, kv_head, d)`` in
    a K or V view from :func:`kv_views`, computed from the view's strides: flash views
    ``[block, offset, kv_head, d]``; a 5-D view is the x-packed legacy key ``[block, kv_head,
    d // x, offset, d % x]``; a 4-D view with ``block_size`` given is the legacy value
    ``[block, kv_head, d, offset]``."""
    st = view.strides if isinstance(view, np.ndarray) else view.stride()
    if isinstance(view, np.ndarray):
        st = tuple(s // view.itemsize for s in st)
    if view.ndim == 5:
        x = view.shape[4]
        bs = view.shape[3]
        blk, off = slot // bs, slot % bs
        return blk * st[0] + kv_head * st[1] + (d // x) * st[2] + off * st[3] + (d % x) * st[4]
    if block_size is not None:  # legacy value [block, kv_head, d, offset]
        blk, off = slot // block_size, slot % block_size
        return blk * st[0] + kv_head * st[1] + d * st[2] + off * st[3]
    bs = view.shape[1]
    blk, off = slot // bs, slot % bs
    return blk * st[0] + off * st[1] + kv_head * st[2] + d * st[3]


# --- private helpers --------------------------------------------------------------------------

def _kv_layout(op, layout):
    if layout not in KV_LAYOUTS:
        fail_value(op, "layout", "one of " + ", ".join(map(repr, KV_LAYOUTS)), repr(layout))
    return layout



def _lib_of(op, name, arr):
    if isinstance(arr, np.ndarray):
        return "numpy"
    torch = sys.modules.get("torch")  # a tensor implies torch is imported; never import it here
    if torch is not None and isinstance(arr, torch.Tensor):
        return "torch"
    fail_type(op, name, "a numpy.ndarray or torch.Tensor", type(arr).__name__)


def _dtype_name(arr):
    return str(arr.dtype).removeprefix("torch.")


def _check_index(op, name, arr, lib, dtype, ndim, dims):
    if _lib_of(op, name, arr) != lib:
        fail_type(op, name, f"a {'numpy.ndarray' if lib == 'numpy' else 'torch.Tensor'} like the "
                  "other arrays", type(arr).__name__)
    if _dtype_name(arr) != dtype:
        fail_type(op, name, f"of dtype {dtype} (vLLM's index dtype; loomnb does not cast)",
                  f"dtype {_dtype_name(arr)}")
    if arr.ndim != ndim:
        fail_value(op, name, f"{ndim}-D {dims}", f"shape {list(arr.shape)}")


def _check_range(op, name, values, hi, hi_name):
    if values.size and (values.min() < 0 or values.max() >= hi):
        fail_value(op, name, f"in 0 .. {hi_name} - 1 = {hi - 1}",
                   f"values {values.min()} .. {values.max()}")


def _check_block_size(op, block_size, name="block_size"):
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        fail_value(op, name, "an int >= 1", repr(block_size))


def _check_dims(op, num_blocks, block_size, num_kv_heads, head_size):
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                    ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "num_blocks" else 1):
            fail_value(op, name, "an int >= " + ("0" if name == "num_blocks" else "1"), repr(v))


def _check_which(op, which):
    if which not in ("key", "value"):
        fail_value(op, "which", "'key' or 'value'", repr(which))


def _layout(op, layout):
    if layout not in LAYOUTS:
        fail_value(op, "layout", "one of " + ", ".join(map(repr, LAYOUTS)), repr(layout))
    return layout


def _x_for(op, head_size, dtype_itemsize):
    if dtype_itemsize not in (1, 2, 4) or isinstance(dtype_itemsize, bool):
        fail_value(op, "dtype_itemsize", "1, 2 or 4 (bytes)", repr(dtype_itemsize))
    x = 16 // dtype_itemsize
    if head_size is not None and head_size % x:
        fail_value(op, "head_size", f"a multiple of x = 16 // {dtype_itemsize} = {x}",
                   repr(head_size))
    return x


def _host(op, name, arr, dtype, ndim, dims):
    lib = _lib_of(op, name, arr)
    _check_index(op, name, arr, lib, dtype, ndim, dims)
    return lib, (arr if lib == "numpy" else arr.cpu().numpy())


def _host_like(op, name, arr, lib, ref, dtype, dims):
    _check_index(op, name, arr, lib, dtype, 1, dims)
    if lib == "torch" and arr.device != ref.device:
        fail_value(op, name, f"on {ref.device} like the other tensors", f"a tensor on {arr.device}")
    return arr if lib == "numpy" else arr.cpu().numpy()


def _back(a, lib, ref):
    if lib == "numpy":
        return a
    return sys.modules["torch"].from_numpy(np.ascontiguousarray(a)).to(ref.device)


def _permute(a, lib, dims):
    return a.transpose(dims) if lib == "numpy" else a.permute(dims)


def _contiguous(a, lib):
    return np.ascontiguousarray(a) if lib == "numpy" else a.contiguous()
