"""The KV-cache movement oracles against independent references: torch's index copies, the
RoPE/cache family's cache-write oracle (a token written with ``reshape_and_cache_flash`` and
gathered back is the token), byte strings, and permutation algebra."""

import ml_dtypes
import numpy as np
import pytest

from loomnb import oracle as O
from loomnb.layouts import paged_kv as pk

pytestmark = pytest.mark.nosim
BF16 = ml_dtypes.bfloat16


def test_copy_blocks_matches_torch_index_copy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    kvs = [rng.standard_normal((7, 2, 4, 2, 8)).astype(np.float32) for _ in range(3)]
    views = [pk.kv_views(kv, "interleaved_nhd") for kv in kvs]
    m = np.array([[0, 5], [0, 6], [3, 1]], np.int64)
    ref = [torch.from_numpy(kv.copy()) for kv in kvs]
    for t in ref:
        t.index_copy_(0, torch.from_numpy(m[:, 1]), t.index_select(0, torch.from_numpy(m[:, 0])))
    O.copy_blocks([k for k, _ in views], [v for _, v in views], m)
    for kv, t in zip(kvs, ref):
        assert np.array_equal(kv, t.numpy())


def test_copy_blocks_skips_padding_rows():
    a = np.arange(12.0).reshape(4, 3)
    O.copy_blocks([a], [], np.array([[-1, 2], [1, -1]], np.int64))
    assert np.array_equal(a, np.arange(12.0).reshape(4, 3))


def test_swap_blocks_is_a_byte_copy():
    rng = np.random.default_rng(1)
    src = rng.integers(0, 255, (5, 3, 4), np.uint8).view(np.uint8)
    dst = np.zeros((4, 3, 4), np.uint8)
    O.swap_blocks(src, dst, 7, np.array([[4, 0], [2, 3]], np.int64))
    raw = dst.tobytes()
    assert raw[0:7] == src[4].tobytes()[:7] and raw[7:12] == bytes(5)
    assert raw[36:43] == src[2].tobytes()[:7]


def test_gather_cache_inverts_the_cache_write():
    """Tokens written to their slots with the cache-write oracle, then gathered through the
    same block table, come back as the tokens (bits, and FP8 as its own dequantisation)."""
    rng = np.random.default_rng(2)
    B, Hk, D, nb = 4, 2, 8, 9
    lens = [5, 3, 0, 6]
    bt = rng.permutation(nb)[:2 * len(lens)].reshape(len(lens), 2).astype(np.int32)
    seq_idx, pos = pk.seq_idx_and_positions(np.array(lens, np.int32))
    slots = pk.slot_mapping_from_block_tables(bt, seq_idx, pos, B)
    k = rng.standard_normal((len(slots), Hk, D)).astype(BF16)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    for kv in ("auto", "fp8"):
        cdt = BF16 if kv == "auto" else np.uint8
        kc, vc = np.zeros((nb, B, Hk, D), cdt), np.zeros((nb, B, Hk, D), cdt)
        s = np.array([0.25], np.float32)
        O.reshape_and_cache_flash(k, k, kc, vc, slots, kv, s, s)
        dst = np.zeros((len(slots) + 1, Hk, D), BF16)
        O.gather_cache(kc, dst, bt, cu, kv, s)
        want = k if kv == "auto" else (
            (O.e4m3_decode(O.e4m3_encode(k.astype(np.float32) / 0.25)) * np.float32(0.25))
            .astype(BF16))
        assert np.array_equal(dst[:len(slots)].view(np.uint16), want.view(np.uint16)), kv


def test_gather_cache_seq_starts_shift_the_positions():
    src = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3)  # [NB, B, E]
    dst = np.full((3, 3), -1.0, np.float32)
    O.gather_cache(src, dst, np.array([[2, 0]], np.int32), np.array([0, 2], np.int32),
                   seq_starts=np.array([1], np.int32))
    assert np.array_equal(dst[0], src[2, 1]) and np.array_equal(dst[1], src[0, 0])
    assert np.array_equal(dst[2], [-1, -1, -1])


def test_compact_blocks_then_the_inverse_restores():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((30, 2, 4)).astype(np.float32)
    before = a.copy()
    perm = rng.permutation(25)
    O.compact_blocks([a], perm)
    assert np.array_equal(a[:25], before[perm]) and np.array_equal(a[25:], before[25:])
    inv = np.empty_like(perm)
    inv[perm] = np.arange(25)
    O.compact_blocks(a, inv)
    assert np.array_equal(a, before)


@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e5m2"])
def test_mla_write_is_a_one_head_cache_write(kv):
    """``concat_and_cache_mla`` = ``reshape_and_cache_flash`` of the concatenated row as one
    head of ``kv_lora_rank + pe_dim`` channels (the same conversion)."""
    rng = np.random.default_rng(4)
    T, Lr, P, nb, B = 5, 16, 8, 3, 4
    kv_c = rng.standard_normal((T, Lr)).astype(BF16)
    k_pe = rng.standard_normal((T, 1, P)).astype(BF16)
    slots = np.array([3, -1, 0, 11, 6], np.int64)
    s = np.array([0.05], np.float32)
    cdt = BF16 if kv == "auto" else np.uint8
    got = np.zeros((nb, B, Lr + P), cdt)
    O.concat_and_cache_mla(kv_c, k_pe, got, slots, kv, s)
    row = np.concatenate([kv_c, k_pe[:, 0]], 1)[:, None, :]
    kc, vc = np.zeros((nb, B, 1, Lr + P), cdt), np.zeros((nb, B, 1, Lr + P), cdt)
    O.reshape_and_cache_flash(row, row, kc, vc, slots, kv, s, s)
    assert np.array_equal(got.view(np.uint8), kc[:, :, 0].view(np.uint8))
