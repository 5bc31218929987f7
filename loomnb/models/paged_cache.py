"""Paged KV cache in vLLM 0.24's interleaved layout, and attention that reads it (torch).

Per layer one ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` buffer (layout
``"interleaved_nhd"`` of :mod:`loomnb.layouts.paged_kv`, where the slot arithmetic lives),
read through ``key_cache``/``value_cache`` views ``[num_blocks, block_size, num_kv_heads,
head_size]``. A token at ``pos`` of sequence ``seq`` lives in slot ``block_tables[seq, pos //
block_size] * block_size + pos % block_size`` (``slot_mapping``, int64); reads go through
``block_tables`` (int32 ``[num_seqs, max_blocks]``) and ``seq_lens`` (int32).

One block more than asked for is allocated and never handed out: the *scratch block*
(``PagedKVCache.scratch_block``, the last). Padded rows of a CUDA-graph batch
(:mod:`loomnb.models.graphs`) point their block tables at it, and the torch cache write sends
their padding slot (-1) to its last row (torch indexing wraps -1), so padding never touches a
sequence's blocks.

FP8 mode (``kv_cache_dtype="fp8"``): the caches hold ``uint8`` E4M3 codes, ``stored = real /
scale`` with per-layer float32 ``k_scale``/``v_scale`` ``[1]`` set by the first forward pass
(vLLM's ``calculate_kv_scales``: ``max|k| / 200``, ``max|v| / 100``) and fixed afterwards.
"""

from __future__ import annotations

from collections import deque

import torch

from ..layouts.paged_kv import cdiv, key_cache_shape, slot_mapping_from_block_tables

BLOCK_SIZE = 16
KV_CACHE_DTYPES = ("auto", "fp8")
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0  # vLLM's calculate_kv_scales divisors
FP8_E4M3_MAX = 448.0
__all__ = ["BLOCK_SIZE", "BlockAllocator", "KV_CACHE_DTYPES", "PagedKVCache", "cdiv",
           "calculate_kv_scales", "compute_slot_mapping", "fp8_e4m3_codes", "kv_bytes_per_token",
           "paged_attention", "reshape_and_cache"]


class BlockAllocator:
    """Reference-counted free list of KV-cache block numbers ``0 .. num_blocks - 1``, and the
    prefix cache's table of full blocks by their chained hash (vLLM's ``BlockPool``;
    :mod:`loomnb.models.prefix_cache` computes the hashes and decides the reuse).

    ``ref_counts[b]``: how many block tables hold block ``b`` (0: on the free list).
    ``cached_blocks``: block hash -> block, for full blocks whose K/V are written;
    ``block_hashes``: the inverse. A block leaves both when its count reaches 0 (unlike vLLM,
    which keeps a freed block findable until the free list hands it out again), so a block on
    the free list is never a cache hit."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.cached_blocks: dict[bytes, int] = {}
        self.block_hashes: dict[int, bytes] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the front of the free list, each with ``ref_counts`` 1.
        Raises ``RuntimeError`` when fewer than ``n`` are free."""
        if n > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {n}, {len(self.free_blocks)} free")
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, blocks) -> None:
        """One more block table holds each of ``blocks`` (allocated ones): ``ref_counts += 1``.
        Raises ``ValueError`` for a block on the free list."""
        for b in blocks:
            if self.ref_counts[b] < 1:
                raise ValueError(f"block {b} is free; only an allocated block can be shared")
            self.ref_counts[b] += 1

    def free(self, blocks) -> None:
        """One block table less holds each of ``blocks``: ``ref_counts -= 1``; a block whose
        count reaches 0 leaves the prefix cache and goes to the back of the free list.
        Raises ``ValueError`` for a block that is already free (a double free)."""
        for b in blocks:
            if self.ref_counts[b] < 1:
                raise ValueError(f"block {b} is already free (ref count 0): a double free")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                h = self.block_hashes.pop(b, None)
                if h is not None:
                    del self.cached_blocks[h]
                self.free_blocks.append(b)

    def cache_block(self, block_hash: bytes, block: int) -> None:
        """Make allocated ``block`` the cache hit for ``block_hash`` (its K/V are written). A
        hash that already has a block keeps it (the same tokens computed twice)."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is free; only an allocated block can be cached")
        if block_hash not in self.cached_blocks and block not in self.block_hashes:
            self.cached_blocks[block_hash] = block
            self.block_hashes[block] = block_hash

    def lookup(self, block_hashes) -> list[int]:
        """The cached blocks of the leading run of ``block_hashes`` that hit (stops at the
        first miss: a chained hash hits only when every block before it does)."""
        hits = []
        for h in block_hashes:
            b = self.cached_blocks.get(h)
            if b is None:
                break
            hits.append(b)
        return hits


class PagedKVCache:
    """Per-layer ``kv_caches`` in vLLM 0.24's interleaved ``(num_blocks + 1, 2, block_size,
    num_kv_heads, head_size)`` layout (its FlashAttention/FlashInfer/Triton backends), split into
    ``key_caches``/``value_caches``: strided ``[num_blocks + 1, block_size, num_kv_heads,
    head_size]`` views (``kv[:, 0]``/``kv[:, 1]``), plus their block allocator, which hands out
    blocks ``0 .. num_blocks - 1``; block ``num_blocks`` is the scratch block (module docstring).

    ``kv_cache_dtype``: ``"auto"`` stores ``dtype``; ``"fp8"`` stores ``uint8`` E4M3 codes and
    keeps ``k_scales``/``v_scales`` (per layer, float32 ``[1]`` on ``device``, 1.0 until
    :meth:`calibrate`); with ``"auto"`` they are ``None`` per layer. ``calibrated``: whether the
    scales are final (always True for ``"auto"``). Zero-filled."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, device,
                 kv_cache_dtype="auto"):
        from ..layouts import allocate_kv_cache, kv_views

        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}; got "
                             f"{kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = kv_cache_dtype == "fp8"
        self.cache_dtype = torch.uint8 if self.fp8 else dtype
        self.kv_caches = [allocate_kv_cache("interleaved_nhd", num_blocks + 1, block_size,
                                            num_kv_heads, head_size, self.cache_dtype, device)
                          for _ in range(num_layers)]
        views = [kv_views(kv, "interleaved_nhd") for kv in self.kv_caches]
        self.key_caches = [k for k, _ in views]
        self.value_caches = [v for _, v in views]
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        one = (lambda: torch.ones(1, dtype=torch.float32, device=device)) if self.fp8 else None
        self.k_scales = [one() if one else None for _ in range(num_layers)]
        self.v_scales = [one() if one else None for _ in range(num_layers)]
        self.calibrated = not self.fp8

    def calibrate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Set layer ``layer``'s scales from this forward's (rotated) ``key`` and ``value``
        (:func:`calculate_kv_scales`; on the device, no host sync). Mutates ``k_scales[layer]``,
        ``v_scales[layer]``. The model calls it for every layer of the first forward pass, then
        sets ``calibrated``."""
        k_scale, v_scale = calculate_kv_scales(key, value)
        self.k_scales[layer].copy_(k_scale)
        self.v_scales[layer].copy_(v_scale)

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers: ``2 * num_layers * num_kv_heads *
        head_size * element_size`` (the scratch block and the scales not counted)."""
        _, _, _, num_kv_heads, head_size = self.kv_caches[0].shape
        return kv_bytes_per_token(len(self.kv_caches), num_kv_heads, head_size,
                                  self.kv_caches[0].element_size())


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, elem_size: int) -> int:
    """``2 * num_layers * num_kv_heads * head_size * elem_size``: K and V of one token."""
    return 2 * num_layers * num_kv_heads * head_size * elem_size


def calculate_kv_scales(key: torch.Tensor, value: torch.Tensor):
    """vLLM's ``Attention.calc_kv_scales``: ``k_scale = max|key| / 200``, ``v_scale = max|value|
    / 100``, float32 ``[1]`` on the inputs' device (no host sync). A zero amax gives the
    smallest normal float32 instead of 0 (vLLM would divide by zero)."""
    tiny = torch.finfo(torch.float32).tiny
    k_scale = (key.abs().amax().float() / K_SCALE_CONSTANT).clamp_min(tiny).reshape(1)
    v_scale = (value.abs().amax().float() / V_SCALE_CONSTANT).clamp_min(tiny).reshape(1)
    return k_scale, v_scale


def fp8_e4m3_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``uint8`` E4M3 codes of ``x / scale``: the float32 division (IEEE), saturated to
    +-448, rounded to nearest even by torch's ``float8_e4m3fn`` cast; NaN -> 0x7F, the sign
    of zero kept. ``loomnb.reshape_and_cache_flash``'s ``kv_cache_dtype="fp8"`` rule (its
    oracle ``loomnb.oracle.fp8.e4m3_encode``). ``scale``: float32 ``[1]`` or broadcastable to
    ``x``; returns ``x``'s shape."""
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.masked_fill(torch.isnan(q), 0x7F)


def dequantize(cache_rows: torch.Tensor, scale, dtype=torch.float32) -> torch.Tensor:
    """Cache elements as ``dtype``: E4M3 codes (``uint8``/``float8_e4m3fn``) are read as
    ``code * scale`` computed in ``dtype`` (float32: the kernel's ``f32(code) * k_scale``;
    float64: exact, as ``loomnb.oracle``'s decode), others are cast."""
    if cache_rows.dtype in (torch.uint8, torch.float8_e4m3fn):
        if scale is None:
            raise ValueError("an FP8 cache needs its k_scale/v_scale")
        return cache_rows.view(torch.float8_e4m3fn).to(dtype) * scale.to(dtype)
    return cache_rows.to(dtype)


def compute_slot_mapping(block_tables, seq_idx, positions, block_size: int) -> torch.Tensor:
    """Cache slot (int64) of each token: ``block_tables[seq, pos // block_size] * block_size
    + pos % block_size``; ``seq_idx``/``positions`` are int64 ``[num_tokens]`` tensors,
    ``block_tables`` int32. The model's name for
    :func:`loomnb.layouts.slot_mapping_from_block_tables`, which validates and documents it."""
    return slot_mapping_from_block_tables(block_tables, seq_idx, positions, block_size)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                      k_scale=None, v_scale=None) -> None:
    """vLLM's ``reshape_and_cache_flash`` in torch: write ``key``/``value`` ``[num_tokens,
    num_kv_heads, head_size]`` to their slots of the (strided) ``[num_blocks, block_size,
    num_kv_heads, head_size]`` caches, at block ``slot // block_size``, offset ``slot %
    block_size``, cast to the cache dtype (``"auto"``) or as E4M3 codes (``"fp8"``:
    :func:`fp8_e4m3_codes` with ``k_scale``/``v_scale``, the op's rule, so the bytes equal
    loomnb's). Static shapes, no host sync (CUDA-graph capturable), hence no mask: a padding
    slot (-1) wraps to the last block's last row, the scratch block that :class:`PagedKVCache`
    never hands out (loomnb's op skips the slot instead).
    Mutates: ``key_cache``, ``value_cache``."""
    block_size = key_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    if kv_cache_dtype == "fp8":
        key_cache[blocks, offsets] = fp8_e4m3_codes(key, k_scale).view(key_cache.dtype)
        value_cache[blocks, offsets] = fp8_e4m3_codes(value, v_scale).view(value_cache.dtype)
        return
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8'; got {kv_cache_dtype!r}")
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, positions, scale,
                    acc_dtype=torch.float32, k_scale=None, v_scale=None):
    """Attention of ``query`` ``[num_tokens, num_heads, head_size]`` over the paged cache.

    Tokens are ``num_seqs`` equal runs of ``q_len = num_tokens // num_seqs`` (prefill: one
    sequence; decode: one token per sequence). Every sequence gathers all its ``max_blocks``
    blocks; key ``j`` is visible to a query at position ``p`` iff ``j <= p`` (causal) and
    ``j < seq_lens[seq]``. GQA: query head ``h`` reads kv head ``h // (num_heads //
    num_kv_heads)``. Scores, softmax and the weighted sum are in ``acc_dtype`` (fp32; float64
    for the decode reference); the output is rounded to the query dtype. An FP8 cache
    (``uint8``/``float8_e4m3fn`` E4M3 codes) is read as ``f32(code) * k_scale`` (``v_scale``
    for values; float32 ``[1]``), the product in ``acc_dtype`` (:func:`dequantize`). Static
    shapes, no host sync.
    """
    num_tokens, num_heads, head_size = query.shape
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    q_len = num_tokens // num_seqs
    max_context = max_blocks * block_size
    group = num_heads // num_kv_heads

    key = key_cache[block_tables].view(num_seqs, max_context, num_kv_heads, head_size)
    value = value_cache[block_tables].view(num_seqs, max_context, num_kv_heads, head_size)
    key = dequantize(key, k_scale, acc_dtype).repeat_interleave(group, dim=2)  # [.., num_heads, hs]
    value = dequantize(value, v_scale, acc_dtype).repeat_interleave(group, dim=2)
    q = query.view(num_seqs, q_len, num_heads, head_size).to(acc_dtype)

    scores = torch.einsum("sqhd,skhd->shqk", q, key) * scale
    ctx = torch.arange(max_context, device=query.device)
    visible = (ctx <= positions.view(num_seqs, q_len, 1)) & (ctx < seq_lens.view(num_seqs, 1, 1))
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("shqk,skhd->sqhd", probs, value)
    return out.to(query.dtype).reshape(num_tokens, num_heads * head_size)
