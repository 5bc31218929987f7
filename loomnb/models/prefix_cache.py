"""Prefix reuse (vLLM's automatic prefix caching) for the decode loop's prompts.

Sequences whose prompts share a prefix share its full KV blocks. A full block (``block_size``
prompt tokens) is identified by a chained hash::

    block_hash[0] = H(NONE_HASH, token_ids[0 : block_size])
    block_hash[j] = H(block_hash[j - 1], token_ids[j * block_size : (j + 1) * block_size])

``H`` is SHA-256 over the parent hash and the token ids as little-endian int64, so equal hashes
mean equal prefixes (up to a SHA-256 collision), and a block equal in tokens but after another
prefix has another hash. The :class:`~loomnb.models.paged_cache.BlockAllocator` keeps the
table ``block hash -> block`` and each block's reference count (the block tables holding it).

A prompt of ``num_tokens`` tokens whose first ``k`` full blocks hit reuses them (ref counts
+1) and its prefill computes from position ``num_computed_tokens = min(k * block_size,
num_tokens - 1)`` on: at least the last prompt token is computed, since its logits give the
first new token. Its partial last block (the ``num_tokens % block_size`` tail) is found too
while the sequence that wrote it has not decoded yet (during one generate call's prefills;
keyed by the parent hash and the tail's tokens), so an identical prompt computes only its
last token. Whenever the block holding ``num_computed_tokens`` is shared, the sequence would
write into a block that another one reads: copy-on-write gives it a fresh block, copied from
the shared one by the backend's ``copy_blocks`` when it holds cached tokens (``block_mapping``
rows ``(src, dst)``). So no block is ever written while another block table holds it: the
shared full blocks are before every write position, and each sequence decodes into blocks of
its own.

Exactness: the reused K/V were computed for the same tokens at the same positions, so the
result is the same computation; the partial prefill's GEMMs have fewer rows, and CPU and GPU
GEMM kernels may round a row differently for another row count (one ulp), so greedy tokens
equal those without reuse except where such an ulp flips a near-tie of the top two logits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from .paged_cache import BlockAllocator

NONE_HASH = hashlib.sha256(b"loomnb prefix caching: no parent block").digest()


def hash_block_tokens(parent_block_hash: bytes | None, token_ids) -> bytes:
    """``SHA-256(parent_block_hash || int64_le(token_ids))``, 32 bytes; ``NONE_HASH`` stands
    for the parent of the first block (``parent_block_hash=None``)."""
    h = hashlib.sha256(NONE_HASH if parent_block_hash is None else parent_block_hash)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest()


def block_hashes(token_ids, block_size: int) -> list[bytes]:
    """Chained hashes of the ``len(token_ids) // block_size`` full blocks of ``token_ids``."""
    hashes, parent = [], None
    for j in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[j * block_size:(j + 1) * block_size])
        hashes.append(parent)
    return hashes


@dataclass
class PromptBlocks:
    """One sequence's blocks for its prefill: ``blocks`` its block-table row (shared hits
    first), ``num_computed_tokens`` the prompt tokens already in the cache (its prefill
    computes from there), ``block_mapping`` the copy-on-write ``(src, dst)`` pairs to copy
    before the prefill, ``block_hashes`` its full blocks' hashes, ``tail_key`` the key of its
    partial last block (``None`` when ``num_tokens`` is a multiple of ``block_size``)."""

    blocks: list[int]
    num_computed_tokens: int = 0
    block_mapping: list[tuple[int, int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    tail_key: tuple | None = None


class PrefixCache:
    """One generate call's prompt-block allocation over ``allocator``; with ``enabled=False``
    every sequence gets fresh blocks and nothing is cached (the loop without prefix reuse).

    Per sequence: :meth:`allocate` before its prefill, :meth:`commit` after it (its blocks'
    K/V written), :meth:`end_prefill` once every prompt is in (before any decode step writes
    into a partial block). Mutates ``allocator`` (ref counts, free list, cached blocks)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, enabled: bool = True):
        self.allocator, self.block_size, self.enabled = allocator, block_size, enabled
        self.tails: dict[tuple, int] = {}  # (parent hash, tail token ids) -> block, this prefill

    def allocate(self, token_ids, num_blocks: int, may_reuse: bool = True) -> PromptBlocks:
        """``num_blocks`` blocks for a sequence whose prompt is ``token_ids``: its longest run of
        cached leading blocks (shared, ref counts +1; with ``may_reuse`` and ``enabled``), a
        fresh copy-on-write block in place of the shared block its prefill would write into,
        then fresh blocks. ``may_reuse=False`` (an FP8 cache not yet calibrated, whose first
        prefill must see every key) allocates fresh blocks but still caches them at
        :meth:`commit`."""
        alloc, bs = self.allocator, self.block_size
        if not self.enabled:
            return PromptBlocks(alloc.allocate(num_blocks))
        n = len(token_ids)
        hashes = block_hashes(token_ids, bs)
        full = len(hashes) * bs
        tail_key = (hashes[-1] if hashes else None, tuple(token_ids[full:])) if n > full else None
        hit = alloc.lookup(hashes) if may_reuse else []
        num_hit = len(hit) * bs
        if may_reuse and tail_key in self.tails and len(hit) == len(hashes):
            hit.append(self.tails[tail_key])
            num_hit = n
        alloc.share(hit)
        start = min(num_hit, n - 1)
        mapping = []
        j = start // bs
        if j < len(hit):  # the prefill writes position `start` into shared block j: copy on write
            (own,) = alloc.allocate(1)
            if start % bs:  # block j holds cached tokens before `start`
                mapping.append((hit[j], own))
            alloc.free([hit[j]])
            hit[j] = own
        blocks = hit + alloc.allocate(num_blocks - len(hit))
        return PromptBlocks(blocks, start, mapping, hashes, tail_key)

    def commit(self, seq: PromptBlocks) -> None:
        """After ``seq``'s prefill: its full blocks become cache hits (a hash already cached
        keeps its block) and its partial last block a hit for this prefill's later prompts."""
        if not self.enabled:
            return
        for h, b in zip(seq.block_hashes, seq.blocks):
            self.allocator.cache_block(h, b)
        if seq.tail_key is not None:
            self.tails.setdefault(seq.tail_key, seq.blocks[len(seq.block_hashes)])

    def end_prefill(self) -> None:
        """Forget the partial blocks: their sequences decode into them from now on."""
        self.tails.clear()
