"""KV-cache movement kernels under numba's CUDA simulator against the oracles, bit for bit
(the family template of ``tests/family.py``; every op here copies or converts elementwise, so
no tolerance).

The ladder at simulator sizes: ``copy_blocks`` over every KV layout (the legacy one too), many
layers, forks of one block to several, padding rows, whole ``[num_blocks, 2, ...]`` buffers,
caches at unrelated addresses (the arena), every copy unit (16, 8, 4, 2 and 1 bytes);
``swap_blocks`` with partial blocks and pools of different sizes; ``compact_blocks`` with cycles
longer than a segment (the workspace pass), only short cycles (none), fixed points and several
layers; ``gather_cache`` with empty sequences, ``seq_starts``, an MLA latent cache, strided
(HND) pages and FP8 dequantisation to every dtype, in both kernel layouts; and
``concat_and_cache_mla`` with vLLM's widths scaled down, odd widths (the scalar path), padded
slots and FP8. A block-size sweep covers the launch configuration.
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb.layouts import paged_kv as pk
from loomnb.ops import kv_blocks as KB

from family import assert_bits, block_size_sweep, call_both

pytestmark = pytest.mark.sim
BF16 = ml_dtypes.bfloat16
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
DT = {"bf16": BF16, "f16": np.float16, "f32": np.float32}


def garbage(rng, a):
    a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape)
    return a


def compare(got, want, what=""):
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, (list, tuple)):
            compare(g, w, f"{what}[{i}]")
        elif g is not None:
            assert_bits(g, w, f"{what}[{i}]")


def layer_caches(rng, layout, L, nb=5, bs=4, Hk=2, D=16, dtype=BF16):
    caches = [garbage(rng, pk.allocate_kv_cache(layout, nb, bs, Hk, D, dtype, lib="numpy",
                                                fill=0)) for _ in range(L)]
    views = [pk.kv_views(c, layout, Hk, D) for c in caches]
    return caches, [k for k, _ in views], [v for _, v in views]


# ------------------------------------------------------------------------------ copy_blocks
@pytest.mark.parametrize("layout", pk.KV_LAYOUTS)
def test_copy_blocks_every_layout(layout):
    rng = np.random.default_rng(1)
    _, kcs, vcs = layer_caches(rng, layout, 3)
    m = np.array([[0, 3], [0, 4], [-1, 2], [1, -1]], np.int64)  # a fork to two, padding rows
    got, want, _, _ = call_both("copy_blocks", kcs, vcs, m)
    compare(got, want, layout)


def test_copy_blocks_whole_buffers_and_unrelated_addresses():
    """One list of whole ``[num_blocks, 2, ...]`` buffers (``copy_blocks_mla``'s form) of
    separately allocated layers, one of them fp32 and larger: the arena spans them all."""
    rng = np.random.default_rng(2)
    a = garbage(rng, np.zeros((6, 2, 4, 2, 8), BF16))
    b = garbage(rng, np.zeros((9, 3, 16), np.float32))
    c = garbage(rng, np.zeros((7, 2, 4, 1, 8), BF16))
    m = np.array([[5, 0], [2, 1]], np.int64)
    got, want, _, _ = call_both("copy_blocks", [a, b, c], [], m)
    compare(got, want)


@pytest.mark.parametrize("unit, shape, dtype", [(16, (4, 2, 8), BF16), (8, (4, 1, 4), BF16),
                                                (4, (2, 1, 2), BF16), (2, (3, 1, 1), BF16),
                                                (1, (3, 1, 1), np.uint8)])
def test_copy_blocks_every_unit(unit, shape, dtype):
    rng = np.random.default_rng(3)
    buf = garbage(rng, np.zeros((8 * np.prod(shape) * np.dtype(dtype).itemsize + 64,), np.uint8))
    off = 16 if unit >= 16 else unit  # a start aligned to exactly `unit`
    n = 8 * int(np.prod(shape))
    cache = buf[off:off + n * np.dtype(dtype).itemsize].view(dtype).reshape((8,) + shape)
    span = KB._block_span("t", "c", loomnb._adapter.wrap("t", "c", cache))
    assert KB._unit([cache.__array_interface__["data"][0], *span]) == unit
    m = np.array([[1, 6], [7, 2]], np.int64)
    got, want, _, _ = call_both("copy_blocks", [cache], [], m)
    compare(got, want, f"unit {unit}")


def test_copy_blocks_block_size_sweep():
    rng = np.random.default_rng(4)
    _, kcs, vcs = layer_caches(rng, "interleaved_hnd", 2, bs=8, D=32)
    m = np.array([[0, 1], [2, 3]], np.int64)

    def check(res, what):
        want = loomnb.oracle.copy_blocks([k.copy() for k in kcs0], [v.copy() for v in vcs0], m)
        compare(res, want, what)

    kcs0, vcs0 = [k.copy() for k in kcs], [v.copy() for v in vcs]
    block_size_sweep(lambda: loomnb.copy_blocks([k.copy() for k in kcs0],
                                                [v.copy() for v in vcs0], m), check)


# ------------------------------------------------------------------------------ swap_blocks
@pytest.mark.parametrize("nbytes", [None, 64, 37, 0])
def test_swap_blocks(nbytes):
    rng = np.random.default_rng(5)
    src = garbage(rng, np.zeros((4, 4, 2, 8), BF16))
    dst = garbage(rng, np.zeros((9, 4, 2, 8), BF16))
    n = src[0].nbytes if nbytes is None else nbytes
    m = np.array([[3, 8], [0, 0], [3, 1], [-1, 2]], np.int64)
    got, want, a1, a2 = call_both("swap_blocks", src, dst, n, m)
    assert_bits(got, want)
    assert_bits(a1[0], a2[0], "src untouched")


# ------------------------------------------------------------------------------ compact_blocks
def test_segments_cover_every_cycle():
    """The host split: every moved block once in ``chain``, a whole cycle of at most SEGMENT
    blocks in one segment with no workspace, a longer one cut into segments whose workspace
    slot saves the block after them; applying the segments in NumPy gives the permutation."""
    rng = np.random.default_rng(6)
    for n in (0, 1, 2, 17, 40, 100):
        perm = rng.permutation(n).astype(np.int64)
        heads, chain, segs = KB._segments(perm)
        moved = np.flatnonzero(perm != np.arange(n))
        assert sorted(chain.tolist()) == moved.tolist()
        assert (segs[:, 1] <= KB.SEGMENT).all() and (segs[:, 1] >= 2 - (segs[:, 2] >= 0)).all()
        a = np.arange(n) * 10
        ws = {w: a[b].copy() for b, w in heads}
        for start, length, w in segs:
            c = chain[start:start + length]
            tmp = ws[w] if w >= 0 else a[c[0]]
            for j in range(length - 1):
                a[c[j]] = a[c[j + 1]]
            a[c[-1]] = tmp
        assert np.array_equal(a, perm * 10), n


@pytest.mark.parametrize("n, layers", [(40, 2), (12, 1), (33, 3)])
def test_compact_blocks(n, layers):
    rng = np.random.default_rng(7 + n)
    _, kcs, vcs = layer_caches(rng, "interleaved_nhd", layers, nb=n + 2, bs=2, Hk=1, D=8)
    perm = rng.permutation(n).astype(np.int64)
    if n == 12:  # short cycles only: no workspace pass
        perm = np.arange(n)[::-1].copy()
    got, want, _, _ = call_both("compact_blocks", kcs + vcs, perm)
    compare(got, want, f"n={n}")


def test_compact_blocks_one_array_and_identity():
    rng = np.random.default_rng(8)
    c = garbage(rng, np.zeros((20, 2, 2, 1, 8), np.float16))
    got, want, _, _ = call_both("compact_blocks", c, rng.permutation(20).astype(np.int64))
    compare(got, want)
    before = c.copy()
    loomnb.compact_blocks(c, np.arange(20, dtype=np.int64))
    assert_bits(c, before, "the identity moves nothing")


# ------------------------------------------------------------------------------ gather_cache
def gather_case(rng, kv, dkind, *, layout=None, mla=False, starts=False, D=16, Hk=2, bs=4,
                nb=6, lens=(5, 0, 7)):
    if kv == "auto":
        if layout:
            kvc = garbage(rng, pk.allocate_kv_cache(layout, nb, bs, Hk, D, DT[dkind],
                                                    lib="numpy", fill=0))
            src = pk.kv_views(kvc, layout, Hk, D)[1]
        else:
            src = garbage(rng, np.zeros((nb, bs, Hk, D), DT[dkind]))
    else:
        src = garbage(rng, np.zeros((nb, bs, Hk, D), {"fp8": E4M3, "fp8_e4m3": np.uint8,
                                                       "fp8_e5m2": E5M2}[kv]))
    if mla:
        src = src[:, :, 0]
    S = len(lens)
    st = rng.integers(0, 3, S).astype(np.int32) if starts else None
    top = np.array(lens) + (st if starts else 0)
    bt = rng.integers(0, nb, (S + 1, -(-int(top.max()) // bs) + 1)).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    dst = garbage(rng, np.zeros((int(cu[-1]) + 2,) + src.shape[2:], DT[dkind]))
    return src, dst, bt, cu, kv, np.array([0.37], np.float32), st


@pytest.mark.parametrize("kv, dkind", [("auto", "bf16"), ("auto", "f32"), ("auto", "f16"),
                                       ("fp8", "bf16"), ("fp8_e4m3", "f16"), ("fp8_e5m2", "f32"),
                                       ("fp8_e5m2", "bf16")])
@pytest.mark.parametrize("D", [16, 6])
def test_gather_cache(kv, dkind, D):
    rng = np.random.default_rng(9)
    args = gather_case(rng, kv, dkind, D=D, starts=True)
    got, want, _, _ = call_both("gather_cache", *args)
    if dkind == "f32" and kv != "auto":  # a NaN code's float32 payload is not compared
        got, want = (np.nan_to_num(got, nan=0.5),), (np.nan_to_num(want, nan=0.5),)
    compare((got,), (want,), f"{kv} {dkind} D={D}")


@pytest.mark.parametrize("layout", ["interleaved_hnd", "split_hnd", "interleaved_nhd"])
def test_gather_cache_strided_pages_and_mla(layout):
    rng = np.random.default_rng(10)
    got, want, _, _ = call_both("gather_cache", *gather_case(rng, "auto", "bf16", layout=layout))
    compare((got,), (want,), layout)
    got, want, _, _ = call_both("gather_cache", *gather_case(rng, "auto", "bf16", mla=True,
                                                             D=24, Hk=1))
    compare((got,), (want,), "mla")


def test_gather_cache_leaves_rows_past_the_total():
    rng = np.random.default_rng(11)
    src, dst, bt, cu, kv, sc, st = gather_case(rng, "auto", "bf16")
    tail = dst[int(cu[-1]):].copy()
    loomnb.gather_cache(src, dst, bt, cu)
    assert_bits(dst[int(cu[-1]):], tail, "rows past cu_seq_lens[-1]")


def test_gather_cache_block_size_sweep():
    rng = np.random.default_rng(12)
    args = gather_case(rng, "fp8", "bf16", D=32, Hk=1)

    def check(res, what):
        want = loomnb.oracle.gather_cache(*[a.copy() if isinstance(a, np.ndarray) else a
                                            for a in args])
        assert_bits(res, want, what)

    block_size_sweep(lambda: loomnb.gather_cache(*[a.copy() if isinstance(a, np.ndarray) else a
                                                   for a in args]), check)


# ------------------------------------------------------------------------------ MLA
@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("Lr, P", [(32, 8), (12, 5)])
def test_concat_and_cache_mla(kind, kv, Lr, P):
    rng = np.random.default_rng(13)
    T = 4
    buf = (rng.standard_normal((T, Lr + P + 8)) * 3).astype(DT[kind])
    buf.reshape(-1)[::7] = np.array(np.nan, np.float32).astype(DT[kind])
    kv_c, k_pe = buf[:, :Lr], buf[:, Lr + 8:][:, None, :]
    cdt = DT[kind] if kv == "auto" else {"fp8": np.uint8, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}[kv]
    cache = garbage(rng, np.zeros((3, 2, Lr + P), cdt))
    slots = np.array([5, -1, 0, 2], np.int64)
    got, want, a1, a2 = call_both("concat_and_cache_mla", kv_c, k_pe, cache, slots, kv,
                                  np.array([0.2], np.float32))
    assert_bits(got, want, f"{kind} {kv}")
    assert_bits(a1[0], a2[0], "kv_c untouched")


def test_concat_and_cache_mla_fewer_slots_than_tokens():
    """CUDA-graph padding: more kv_c rows than slots; the extra rows are not read."""
    rng = np.random.default_rng(14)
    kv_c = rng.standard_normal((6, 16)).astype(BF16)
    k_pe = rng.standard_normal((6, 8)).astype(BF16)
    cache = garbage(rng, np.zeros((2, 4, 24), BF16))
    got, want, _, _ = call_both("concat_and_cache_mla", kv_c, k_pe, cache,
                                np.array([7, 1], np.int64), "auto", None)
    assert_bits(got, want)
