"""Paged KV cache in vLLM's flash-attention layout, and attention that reads it (torch).

Per layer ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads,
head_size]`` (layout ``"NHD"`` of :mod:`loomnb.layouts.paged_kv`, where the slot arithmetic
lives). A token at ``pos`` of sequence ``seq`` lives in slot ``block_tables[seq, pos //
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
    """Per-layer ``key_cache``/``value_cache`` ``[num_blocks, block_size, num_kv_heads,
    head_size]`` (vLLM's flash-attention layout) plus their block allocator."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, device):
        shape = key_cache_shape("NHD", num_blocks, block_size, num_kv_heads, head_size,
                                dtype.itemsize)  # = value_cache_shape("NHD", ...)
        self.key_caches = [torch.zeros(shape, dtype=dtype, device=device)
                           for _ in range(num_layers)]
        self.value_caches = [torch.zeros_like(k) for k in self.key_caches]
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)


def compute_slot_mapping(block_tables, seq_idx, positions, block_size: int) -> torch.Tensor:
    """Cache slot (int64) of each token: ``block_tables[seq, pos // block_size] * block_size
    + pos % block_size``; ``seq_idx``/``positions`` are int64 ``[num_tokens]`` tensors,
    ``block_tables`` int32. The model's name for
    :func:`loomnb.layouts.slot_mapping_from_block_tables`, which validates and documents it."""
    return slot_mapping_from_block_tables(block_tables, seq_idx, positions, block_size)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` to their slots.

    NHD is slot-major, so the cache viewed as ``[num_blocks * block_size, num_kv_heads,
    head_size]`` is indexed by slot. Mutates: ``key_cache``, ``value_cache``. Unlike vLLM's
    op, a padding slot (-1) is not skipped: torch's ``index_copy_`` raises (this loop never
    pads)."""
    num_kv_heads, head_size = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, positions, scale):
    """Attention of ``query`` ``[num_tokens, num_heads, head_size]`` over the paged cache.

    Tokens are ``num_seqs`` equal runs of ``q_len = num_tokens // num_seqs`` (prefill: one
    sequence; decode: one token per sequence). Every sequence gathers all its ``max_blocks``
    blocks; key ``j`` is visible to a query at position ``p`` iff ``j <= p`` (causal) and
    ``j < seq_lens[seq]``. GQA: query head ``h`` reads kv head ``h // (num_heads //
    num_kv_heads)``. Scores, softmax and the weighted sum are fp32; the output is rounded to
    the query dtype. Static shapes, no host sync.
    """
    num_tokens, num_heads, head_size = query.shape
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    q_len = num_tokens // num_seqs
    max_context = max_blocks * block_size
    group = num_heads // num_kv_heads

    key = key_cache[block_tables].view(num_seqs, max_context, num_kv_heads, head_size)
    value = value_cache[block_tables].view(num_seqs, max_context, num_kv_heads, head_size)
    key = key.repeat_interleave(group, dim=2).float()  # [num_seqs, max_context, num_heads, hs]
    value = value.repeat_interleave(group, dim=2).float()
    q = query.view(num_seqs, q_len, num_heads, head_size).float()

    scores = torch.einsum("sqhd,skhd->shqk", q, key) * scale
    ctx = torch.arange(max_context, device=query.device)
    visible = (ctx <= positions.view(num_seqs, q_len, 1)) & (ctx < seq_lens.view(num_seqs, 1, 1))
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("shqk,skhd->sqhd", probs, value)
    return out.to(query.dtype).reshape(num_tokens, num_heads * head_size)
