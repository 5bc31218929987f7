"""vLLM's paged KV-cache layouts (``loomnb.layouts.paged_kv``) against plain Python loops.

Host-only (NumPy and CPU torch), so it runs in the plain pass; awkward sizes throughout.
"""

import itertools

import numpy as np
import pytest
import torch

from loomnb import LoomnbTypeError, LoomnbValueError
from loomnb.layouts import paged_kv as pk

BLOCK_SIZES = [1, 16, 32]
SEQ_LENS = [1, 19, 111]


def random_block_tables(seq_lens, block_size, seed, extra=1):
    """int32 ``[num_seqs, max_blocks]`` of distinct shuffled blocks, unused entries 0."""
    rng = np.random.default_rng(seed)
    need = [pk.cdiv(n, block_size) for n in seq_lens]
    blocks = rng.permutation(sum(need) + 7)
    bt = np.zeros((len(seq_lens), max(need) + extra), np.int32)
    start = 0
    for i, n in enumerate(need):
        bt[i, :n] = blocks[start : start + n]
        start += n
    return bt


def loop_slot_mapping(block_tables, seq_idx, positions, block_size):
    return [pk.PAD_SLOT_ID if s < 0 else
            int(block_tables[s][p // block_size]) * block_size + p % block_size
            for s, p in zip(seq_idx, positions)]


def test_slot_block_offset_round_trip():
    for block_size in BLOCK_SIZES:
        slots = np.arange(5 * block_size + 3, dtype=np.int64)
        block, offset = pk.slot_to_block_offset(slots, block_size)
        assert np.array_equal(pk.block_offset_to_slot(block, offset, block_size), slots)
        assert offset.max() == block_size - 1 and np.all(offset >= 0)
        assert pk.slot_to_block_offset(37, block_size) == divmod(37, block_size)


def test_worked_example():
    """The module docstring's example, and FlashInfer's CSR arrays both ways."""
    bt, sl = np.array([[3, 0], [7, 2]], np.int32), np.array([5, 17], np.int32)
    kv_indptr, kv_indices, last = pk.block_tables_to_flashinfer(bt, sl, 16)
    assert kv_indptr.tolist() == [0, 1, 3] and kv_indices.tolist() == [3, 7, 2]
    assert last.tolist() == [5, 1]
    assert kv_indptr.dtype == kv_indices.dtype == last.dtype == np.int32
    bt2, sl2 = pk.flashinfer_to_block_tables(kv_indptr, kv_indices, last, 16)
    assert np.array_equal(bt2, bt) and np.array_equal(sl2, sl)
    slots = pk.slot_mapping_from_seq_lens(bt, sl, 16)
    assert slots.tolist() == [48, 49, 50, 51, 52] + list(range(112, 128)) + [32]
    assert pk.FLASHINFER_TO_VLLM["page_size"] == "block_size"
    assert pk.FLASHINFER_TO_VLLM["head_dim"] == "head_size"


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_slot_mapping_matches_loop(block_size):
    bt = random_block_tables(SEQ_LENS, block_size, seed=block_size)
    seq_idx = [s for s, n in enumerate(SEQ_LENS) for _ in range(n)] + [-1, -1]
    positions = [p for n in SEQ_LENS for p in range(n)] + [0, 10**9]  # padding: ignored
    want = loop_slot_mapping(bt, seq_idx, positions, block_size)
    got = pk.slot_mapping_from_block_tables(bt, np.array(seq_idx), np.array(positions), block_size)
    assert got.dtype == np.int64 and got.tolist() == want
    assert len(set(want[:-2])) == len(want) - 2, "no two tokens share a slot"
    got_t = pk.slot_mapping_from_block_tables(torch.from_numpy(bt), torch.tensor(seq_idx),
                                              torch.tensor(positions), block_size)
    assert got_t.dtype == torch.int64 and got_t.tolist() == want


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("query", ["prefill", "decode", "chunked"])
def test_seq_lens_helpers_match_loop(block_size, query):
    bt = random_block_tables(SEQ_LENS, block_size, seed=3)
    q = {"prefill": SEQ_LENS, "decode": [1] * 3, "chunked": [1, 4, 100]}[query]
    pairs = [(s, p) for s, (n, k) in enumerate(zip(SEQ_LENS, q)) for p in range(n - k, n)]
    num_tokens = len(pairs) + 5
    want_seq = [s for s, _ in pairs] + [-1] * 5
    want_pos = [p for _, p in pairs] + [0] * 5
    want_slots = loop_slot_mapping(bt, want_seq, want_pos, block_size)
    sl, ql = np.array(SEQ_LENS, np.int32), np.array(q, np.int32)
    for lib in (np.asarray, torch.from_numpy):
        seq_idx, positions = pk.seq_idx_and_positions(lib(sl), lib(ql), num_tokens)
        assert seq_idx.tolist() == want_seq and positions.tolist() == want_pos
        slots = pk.slot_mapping_from_seq_lens(lib(bt), lib(sl), block_size, lib(ql), num_tokens)
        assert type(slots) is type(lib(sl)) and slots.tolist() == want_slots


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_flashinfer_round_trip(block_size):
    sl = np.array(SEQ_LENS + [block_size, 0], np.int32)
    bt = random_block_tables(SEQ_LENS + [block_size, 1], block_size, seed=5, extra=0)
    bt[-1] = 0  # the empty sequence uses no blocks
    for lib in (np.asarray, torch.from_numpy):
        kv_indptr, kv_indices, last = pk.block_tables_to_flashinfer(lib(bt), lib(sl), block_size)
        want = [b for row, n in zip(bt, sl) for b in row[: pk.cdiv(int(n), block_size)]]
        assert kv_indices.tolist() == want
        assert last.tolist() == [(n - 1) % block_size + 1 if n else 0 for n in sl.tolist()]
        bt2, sl2 = pk.flashinfer_to_block_tables(kv_indptr, kv_indices, last, block_size,
                                                 max_blocks=bt.shape[1])
        assert bt2.tolist() == bt.tolist() and sl2.tolist() == sl.tolist()


LAYOUT_CASES = [("NHD", 2), ("HND", 2), ("paged_attention", 2), ("paged_attention", 1),
                ("paged_attention", 4)]


@pytest.mark.parametrize("layout, itemsize", LAYOUT_CASES)
@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_layout_views_and_element_index(layout, itemsize, which, lib):
    """Every (slot, kv_head, d) of an NHD cache lands at element_index() of the other layout,
    the shapes are key/value_cache_shape(), and to_nhd() undoes from_nhd()."""
    num_blocks, block_size, num_kv_heads, head_size = 3, 5, 2, 16
    dtype = {1: np.uint8, 2: np.int16, 4: np.int32}[itemsize]
    nhd = np.arange(num_blocks * block_size * num_kv_heads * head_size).astype(dtype)
    nhd = nhd.reshape(num_blocks, block_size, num_kv_heads, head_size)
    cache_nhd = torch.from_numpy(nhd) if lib == "torch" else nhd
    cache = pk.from_nhd(cache_nhd, layout, which)
    dims = (layout, num_blocks, block_size, num_kv_heads, head_size)
    shape = pk.key_cache_shape(*dims, itemsize) if which == "key" else pk.value_cache_shape(*dims)
    assert tuple(cache.shape) == shape
    flat = np.asarray(cache).reshape(-1)
    for slot, h, d in itertools.product(range(num_blocks * block_size), range(num_kv_heads),
                                        range(head_size)):
        i = pk.element_index(layout, slot, h, d, block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype_itemsize=itemsize, which=which)
        assert flat[i] == nhd[slot // block_size, slot % block_size, h, d], (slot, h, d)
    assert np.array_equal(np.asarray(pk.to_nhd(cache, layout, which)), nhd)


def test_paged_attention_x():
    assert [pk.paged_attention_x(n) for n in (1, 2, 4)] == [16, 8, 4]
    assert pk.key_cache_shape("paged_attention", 7, 16, 2, 64, 2) == (7, 2, 8, 16, 8)
    assert pk.value_cache_shape("paged_attention", 7, 16, 2, 64) == (7, 2, 64, 16)


def _bt():
    return np.array([[3, 0], [7, 2]], np.int32)


def _pos(*v):
    return np.array(v, np.int64)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: pk.slot_mapping_from_block_tables(_bt().astype(np.int64), _pos(0), _pos(0), 16),
     LoomnbTypeError, r"argument 'block_tables' must be of dtype int32 .*; got dtype int64"),
    (lambda: pk.slot_mapping_from_block_tables(_bt(), _pos(0), _pos(0).astype(np.int32), 16),
     LoomnbTypeError, r"argument 'positions' must be of dtype int64 .*; got dtype int32"),
    (lambda: pk.slot_mapping_from_block_tables(torch.from_numpy(_bt()), torch.tensor([0]),
                                               torch.tensor([0], dtype=torch.int32), 16),
     LoomnbTypeError, r"argument 'positions' must be of dtype int64 .*; got dtype int32"),
    (lambda: pk.slot_mapping_from_block_tables(torch.from_numpy(_bt()), _pos(0), _pos(0), 16),
     LoomnbTypeError,
     r"argument 'seq_idx' must be a torch.Tensor like the other arrays; got ndarray"),
    (lambda: pk.slot_mapping_from_block_tables([[3, 0]], _pos(0), _pos(0), 16), LoomnbTypeError,
     r"argument 'block_tables' must be a numpy.ndarray or torch.Tensor; got list"),
    (lambda: pk.slot_mapping_from_block_tables(_bt(), _pos(0, 1), _pos(0), 16), LoomnbValueError,
     r"argument 'positions' must be of length 2 \(len\(seq_idx\)\); got length 1"),
    (lambda: pk.slot_mapping_from_block_tables(_bt(), _pos(0), _pos(32), 16), LoomnbValueError,
     r"argument 'positions' must be in 0 .. max_blocks \* block_size - 1 = 31; got values 32"),
    (lambda: pk.slot_mapping_from_block_tables(_bt(), _pos(2), _pos(0), 16), LoomnbValueError,
     r"argument 'seq_idx' must be in 0 .. num_seqs - 1 = 1; got values 2 .. 2"),
    (lambda: pk.slot_mapping_from_block_tables(_bt(), _pos(0), _pos(0), 0), LoomnbValueError,
     r"argument 'block_size' must be an int >= 1; got 0"),
    (lambda: pk.seq_idx_and_positions(np.array([5], np.int32), np.array([6], np.int32)),
     LoomnbValueError, r"argument 'query_lens' must be 0 <= query_lens <= seq_lens"),
    (lambda: pk.seq_idx_and_positions(np.array([5], np.int32), num_tokens=4), LoomnbValueError,
     r"argument 'num_tokens' must be an int >= sum\(query_lens\) = 5; got 4"),
    (lambda: pk.block_tables_to_flashinfer(_bt(), np.array([5, 33], np.int32), 16),
     LoomnbValueError, r"argument 'seq_lens' must be \[num_seqs\] = \[2\] values in 0 .. "),
    (lambda: pk.flashinfer_to_block_tables(*(np.array(a, np.int32) for a in ([0, 1, 4], [3, 7, 2],
                                                                             [5, 1])), 16),
     LoomnbValueError, r"argument 'kv_indptr' must be non-decreasing from 0 to len\(kv_indices\)"),
    (lambda: pk.key_cache_shape("paged", 1, 16, 1, 64, 2), LoomnbValueError,
     r"argument 'layout' must be one of 'NHD', 'HND', 'paged_attention'; got 'paged'"),
    (lambda: pk.key_cache_shape("paged_attention", 1, 16, 1, 12, 2), LoomnbValueError,
     r"argument 'head_size' must be a multiple of x = 16 // 2 = 8; got 12"),
    (lambda: pk.element_index("HND", 0, 2, 0, block_size=16, num_kv_heads=2, head_size=8),
     LoomnbValueError, r"argument 'kv_head' must be an int >= 0 and < 2; got 2"),
])
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# --- whole-cache allocations (KV_LAYOUTS) and their K/V views -----------------------------------
@pytest.mark.parametrize("layout", pk.KV_LAYOUTS)
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_kv_views_are_views_with_the_documented_axes(layout, lib):
    """Writing K[t] and V[t] through the views lands where the layout says, in one buffer,
    without copies; K and V never share an element."""
    nb, bs, hk, hd = 3, 4, 2, 16
    dtype = np.int16 if lib == "numpy" else torch.int16
    kv = pk.allocate_kv_cache(layout, nb, bs, hk, hd, dtype, lib=lib, fill=0)
    assert tuple(kv.shape) == pk.kv_cache_shape(layout, nb, bs, hk, hd)
    k, v = pk.kv_views(kv, layout, hk, hd)
    base = kv if lib == "numpy" else kv.numpy()
    kn, vn = (k, v) if lib == "numpy" else (k.numpy(), v.numpy())
    assert np.shares_memory(kn, base) and np.shares_memory(vn, base)
    assert not np.shares_memory(kn, vn)
    for slot, h, d in itertools.product([0, 5, nb * bs - 1], range(hk), [0, 7, hd - 1]):
        blk, off = divmod(slot, bs)
        val = 1 + slot * 100 + h * 10 + d
        if layout == "legacy_xpacked":
            x = kn.shape[4]
            kn[blk, h, d // x, off, d % x] = val
            vn[blk, h, d, off] = -val
            ko = pk.kv_element_offset(kn, slot, h, d)
            vo = pk.kv_element_offset(vn, slot, h, d, block_size=bs)
        else:
            kn[blk, off, h, d] = val
            vn[blk, off, h, d] = -val
            ko = pk.kv_element_offset(kn, slot, h, d)
            vo = pk.kv_element_offset(vn, slot, h, d)
        kflat = np.lib.stride_tricks.as_strided(kn, (ko + 1,), (kn.itemsize,))
        vflat = np.lib.stride_tricks.as_strided(vn, (vo + 1,), (vn.itemsize,))
        assert kflat[ko] == val and vflat[vo] == -val
    assert (base != 0).sum() == 2 * 3 * hk * 3


def test_interleaved_and_hnd_strides_are_vllms():
    """interleaved NHD: block stride 2*B*Hk*D, K page then V page; HND: heads outside the block
    offset (physical [NB, 2, Hk, B, D]); split: all K blocks then all V blocks."""
    nb, bs, hk, hd = 3, 16, 2, 8
    kv = pk.allocate_kv_cache("interleaved_nhd", nb, bs, hk, hd, torch.bfloat16)
    k, v = pk.kv_views(kv, "interleaved_nhd")
    assert k.stride() == (2 * bs * hk * hd, hk * hd, hd, 1)
    assert v.data_ptr() - k.data_ptr() == bs * hk * hd * 2
    kv = pk.allocate_kv_cache("interleaved_hnd", nb, bs, hk, hd, torch.bfloat16)
    k, v = pk.kv_views(kv, "interleaved_hnd")
    assert tuple(k.shape) == (nb, bs, hk, hd) and k.stride() == (2 * bs * hk * hd, hd, bs * hd, 1)
    kv = pk.allocate_kv_cache("split_hnd", nb, bs, hk, hd, torch.bfloat16)
    k, v = pk.kv_views(kv, "split_hnd")
    assert k.stride() == (bs * hk * hd, hd, bs * hd, 1)
    assert v.data_ptr() - k.data_ptr() == nb * bs * hk * hd * 2
    kv = pk.allocate_kv_cache("legacy_xpacked", nb, bs, hk, 64, torch.uint8)
    k, v = pk.kv_views(kv, "legacy_xpacked", hk, 64)
    assert tuple(k.shape) == (nb, hk, 4, bs, 16) and tuple(v.shape) == (nb, hk, 64, bs)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: pk.kv_cache_shape("interleaved", 1, 16, 1, 64), LoomnbValueError,
     r"argument 'layout' must be one of 'interleaved_nhd', 'interleaved_hnd', 'split_nhd', "
     r"'split_hnd', 'legacy_xpacked'; got 'interleaved'"),
    (lambda: pk.allocate_kv_cache("legacy_xpacked", 1, 16, 1, 12, np.int16, lib="numpy"),
     LoomnbValueError, r"argument 'head_size' must be a multiple of x = 16 // 2 = 8; got 12"),
    (lambda: pk.kv_views(np.zeros((2, 3, 4, 1, 8)), "interleaved_nhd"), LoomnbValueError,
     r"argument 'kv_cache' must be of shape \(num_blocks, 2, ...\) for 'interleaved_nhd'"),
    (lambda: pk.kv_views(np.zeros((2, 3, 100), np.int16), "legacy_xpacked", 2, 16),
     LoomnbValueError, r"argument 'kv_cache' must be pages of block_size \* 2 \* 16 elements"),
    (lambda: pk.allocate_kv_cache("split_nhd", 1, 16, 1, 64, np.int16, lib="cupy"),
     LoomnbValueError, r"argument 'lib' must be 'torch' or 'numpy'"),
])
def test_kv_layout_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
