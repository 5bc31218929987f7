"""Paged KV cache in vLLM 0.24's interleaved layout, and attention that reads it (torch).

Per layer one ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` buffer (layout
``"interleaved_nhd"`` of :mod:`loomnb.layouts.paged_kv`, where the slot arithmetic lives),
read through ``key_cache``/``value_cache`` views ``[num_blocks, block_size, num_kv_heads,
head_size]``. A token at ``pos`` of sequence ``seq`` lives in slot ``block_tables[seq, pos //
block_size] * block_size + pos % block_size`` (``slot_mapping``, int64); reads go through
``block_tables`` (int32 ``[num_seqs, max_blocks]``) and ``seq_lens`` (int32).
"""

from __future__ import annotations

from collections import deque

import torch

from ..layouts.paged_kv import cdiv, key_cache_shape, slot_mapping_from_block_tables

BLOCK_SIZE = 16
__all__ = ["BLOCK_SIZE", "BlockAllocator", "PagedKVCache", "cdiv", "compute_slot_mapping",
           "paged_attention", "reshape_and_cache"]


class BlockAllocator:
    """Free list of KV-cache block numbers ``0 .. num_blocks - 1``."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks = deque(range(num_blocks))

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {n}, {len(self.free_blocks)} free")
        return [self.free_blocks.popleft() for _ in range(n)]

    def free(self, blocks) -> None:
        self.free_blocks.extend(blocks)


class PagedKVCache:
    """Per-layer ``kv_caches`` in vLLM 0.24's interleaved ``(num_blocks, 2, block_size,
    num_kv_heads, head_size)`` layout (its FlashAttention/FlashInfer/Triton backends), split into
    ``key_caches``/``value_caches``: strided ``[num_blocks, block_size, num_kv_heads,
    head_size]`` views (``kv[:, 0]``/``kv[:, 1]``), plus their block allocator."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, device):
        from ..layouts import allocate_kv_cache, kv_views

        self.kv_caches = [allocate_kv_cache("interleaved_nhd", num_blocks, block_size, num_kv_heads,
                                            head_size, dtype, device)
                          for _ in range(num_layers)]
        views = [kv_views(kv, "interleaved_nhd") for kv in self.kv_caches]
        self.key_caches = [k for k, _ in views]
        self.value_caches = [v for _, v in views]
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)


def compute_slot_mapping(block_tables, seq_idx, positions, block_size: int) -> torch.Tensor:
    """Cache slot (int64) of each token: ``block_tables[seq, pos // block_size] * block_size
    + pos % block_size``; ``seq_idx``/``positions`` are int64 ``[num_tokens]`` tensors,
    ``block_tables`` int32. The model's name for
    :func:`loomnb.layouts.slot_mapping_from_block_tables`, which validates and documents it."""
    return slot_mapping_from_block_tables(block_tables, seq_idx, positions, block_size)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` to their slots of the
    (strided) ``[num_blocks, block_size, num_kv_heads, head_size]`` caches, at block ``slot //
    block_size``, offset ``slot % block_size``; a padding slot (-1) is skipped, as vLLM's op.
    Mutates: ``key_cache``, ``value_cache``."""
    from .backends import _write_cache

    _write_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, positions, scale,
                    acc_dtype=torch.float32):
    """Attention of ``query`` ``[num_tokens, num_heads, head_size]`` over the paged cache.

    Tokens are ``num_seqs`` equal runs of ``q_len = num_tokens // num_seqs`` (prefill: one
    sequence; decode: one token per sequence). Every sequence gathers all its ``max_blocks``
    blocks; key ``j`` is visible to a query at position ``p`` iff ``j <= p`` (causal) and
    ``j < seq_lens[seq]``. GQA: query head ``h`` reads kv head ``h // (num_heads //
    num_kv_heads)``. Scores, softmax and the weighted sum are in ``acc_dtype`` (fp32; float64
    for the decode reference); the output is rounded to the query dtype. Static shapes, no
    host sync.
    """
    num_tokens, num_heads, head_size = query.shape
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    q_len = num_tokens // num_seqs
    max_context = max_blocks * block_size
    group = num_heads // num_kv_heads

    key = key_cache[block_tables].view(num_seqs, max_context, num_kv_heads, head_size)
    value = value_cache[block_tables].view(num_seqs, max_context, num_kv_heads, head_size)
    key = key.repeat_interleave(group, dim=2).to(acc_dtype)  # [num_seqs, max_context, num_heads, hs]
    value = value.repeat_interleave(group, dim=2).to(acc_dtype)
    q = query.view(num_seqs, q_len, num_heads, head_size).to(acc_dtype)

    scores = torch.einsum("sqhd,skhd->shqk", q, key) * scale
    ctx = torch.arange(max_context, device=query.device)
    visible = (ctx <= positions.view(num_seqs, q_len, 1)) & (ctx < seq_lens.view(num_seqs, 1, 1))
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("shqk,skhd->sqhd", probs, value)
    return out.to(query.dtype).reshape(num_tokens, num_heads * head_size)
