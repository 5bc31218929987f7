"""MoE kernels under numba's CUDA simulator against the oracles, bit for bit.

The simulator computes ``exp`` as the oracle does (float64, rounded once), so the routing
weights are compared bit for bit too (the GPU's libdevice ``expf`` is not: see
``test_moe_gpu.py``). The ladder at simulator sizes: routing with softmax and sigmoid scores,
a correction bias, renormalisation, NaN and all ``-inf`` rows, exact ties, every lane width
(1..32 experts a lane), idle warps (a token count not a multiple of the warps a block);
grouped routing in DeepSeek-V3's shape scaled down, with and without a bias; the align in its
one-launch form and its two passes (a small chunk forced), dropped ids, ``expert_map``,
``pad_sorted_ids`` and the ``N < E`` clamp; the row ops in both layouts (odd widths take the
scalar path), FP8 quantisation with and without ``scale_ub``; ``moe_sum`` at every ``topk``
regime. A block-size sweep covers the launch configuration.
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb.ops import _moe_kernels as MOEK
from loomnb.ops import moe as MOE

from family import assert_bits, block_size_sweep, call_both

pytestmark = pytest.mark.sim
BF16 = ml_dtypes.bfloat16
DT = {"bf16": BF16, "f16": np.float16, "f32": np.float32}


def compare(got, want, what=""):
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bits(g, w, f"{what}[{i}]")


def logits(rng, M, E, kind="f32", scale=2.0):
    return (rng.standard_normal((M, E)) * scale).astype(DT[kind])


# ------------------------------------------------------------------------------ routing
@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax(kind, renormalize):
    rng = np.random.default_rng(1)
    g = logits(rng, 5, 24, kind)  # 5 tokens: a block of 4 warps and one of 1
    got, want, _, _ = call_both("topk_softmax", g, 4, renormalize)
    compare(got, want, kind)


@pytest.mark.parametrize("E, k", [(8, 8), (33, 3), (64, 6), (130, 2)])  # 1, 2, 2, 8 a lane
def test_topk_softmax_widths(E, k):
    rng = np.random.default_rng(E)
    g = logits(rng, 3, E)
    got, want, _, _ = call_both("topk_softmax", g, k, True)
    compare(got, want, f"E={E}")


def test_topk_softmax_bias_moves_selection_not_weights():
    rng = np.random.default_rng(2)
    g = logits(rng, 3, 16)
    bias = np.zeros(16, np.float32)
    bias[[3, 9]] = 10.0  # experts 3 and 9 always picked, with their own probabilities
    got, want, _, _ = call_both("topk_softmax", g, 4, False, e_score_correction_bias=bias)
    compare(got, want, "bias")
    assert (np.sort(got[1][:, :2], 1) == [3, 9]).all()


def test_topk_softmax_edge_rows():
    g = np.zeros((4, 16), np.float32)         # row 0: all equal (ties: lowest index first)
    g[1, 5] = np.nan                          # row 1: a NaN
    g[2, :] = -np.inf                         # row 2: all -inf (every p NaN)
    g[3, [2, 7, 11]] = 3.0                    # row 3: a three-way tie at the top
    got, want, _, _ = call_both("topk_softmax", g, 3, True)
    compare(got, want, "edges")
    assert got[1][0].tolist() == [0, 1, 2] and got[1][3].tolist() == [2, 7, 11]


@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_sigmoid(renormalize):
    rng = np.random.default_rng(3)
    g = logits(rng, 6, 40, "bf16")
    bias = (rng.standard_normal(40) * 0.1).astype(np.float32)
    got, want, _, _ = call_both("topk_sigmoid", g, 5, renormalize, e_score_correction_bias=bias)
    compare(got, want, "sigmoid")


@pytest.mark.parametrize("score, bias, renorm, scale", [
    ("sigmoid", True, True, 2.5),    # DeepSeek-V3's routing
    ("softmax", False, False, 1.0),  # DeepSeek-V2's
    ("softmax", True, True, 1.0),
    ("sigmoid", False, False, 16.0),
])
def test_grouped_topk(score, bias, renorm, scale):
    rng = np.random.default_rng(4)
    E, G, tg, k = 64, 8, 4, 6  # V3's 256 / 8 / 4 / 8 scaled down
    g = logits(rng, 5, E)
    b = (rng.standard_normal(E) * 0.5).astype(np.float32) if bias else None
    got, want, _, _ = call_both("grouped_topk", g, g, k, renorm, G, tg, score, scale, b)
    compare(got, want, score)
    groups = got[1] // (E // G)
    assert all(len(set(r)) <= tg for r in groups.tolist())


def test_grouped_topk_ties_between_groups():
    g = np.zeros((2, 16), np.float32)
    g[1, [1, 5, 9, 13]] = 1.0  # four groups tie: the lower groups win
    got, want, _, _ = call_both("grouped_topk", g, g, 2, False, 4, 2, "sigmoid")
    compare(got, want, "ties")
    assert sorted(got[1][1].tolist()) == [1, 5]


def test_routing_block_sizes():
    rng = np.random.default_rng(5)
    g = logits(rng, 7, 48)
    want = loomnb.oracle.topk_softmax(g, 5, True)
    block_size_sweep(lambda: loomnb.topk_softmax(g, 5, True),
                     lambda got, what: compare(got, want, what), threads=(32, 64, 128))


# ------------------------------------------------------------------------------ align
def ids(rng, M, k, E, dtype=np.int32):
    return np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(dtype)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_align_fused(dtype, bs):
    rng = np.random.default_rng(6)
    t = ids(rng, 6, 3, 10, dtype)
    got, want, _, _ = call_both("moe_align_block_size", t, bs, 10)
    compare(got, want, f"bs={bs}")


@pytest.mark.parametrize("pad, emap", [(False, False), (True, True)])
def test_align_two_passes(monkeypatch, pad, emap):
    monkeypatch.setattr(MOE, "ALIGN_CHUNK", 24)  # 5 chunks: the count, the ticket, the place
    rng = np.random.default_rng(7)
    E = 12
    t = ids(rng, 30, 4, E)
    m = np.where(np.arange(E) % 3 == 0, -1, np.arange(E) // 2).astype(np.int32) if emap else None
    got, want, _, _ = call_both("moe_align_block_size", t, 8, E, m, pad)
    compare(got, want, "two passes")


def test_align_drops_out_of_range_ids_and_clamps():
    t = np.array([[0, 5], [-1, 2], [9, 2]], np.int32)  # -1 and 9 are not experts of 8
    got, want, _, _ = call_both("moe_align_block_size", t, 4, 8)
    compare(got, want, "dropped")
    assert 2 not in got[0] and 4 not in got[0] and got[2][0] == 12
    t = np.array([[1]], np.int32)  # N = 1 < E = 8: L = min(N * bs, N + E * (bs - 1)) = 4
    got, want, _, _ = call_both("moe_align_block_size", t, 4, 8)
    compare(got, want, "clamped")
    assert got[0].shape == (4,)


def test_align_block_sizes(monkeypatch):
    monkeypatch.setattr(MOE, "ALIGN_CHUNK", 40)
    rng = np.random.default_rng(8)
    t = ids(rng, 25, 4, 16)
    want = loomnb.oracle.moe_align_block_size(t, 4, 16)
    block_size_sweep(lambda: loomnb.moe_align_block_size(t, 4, 16),
                     lambda got, what: compare(got, want, what), threads=(32, 64))


# ------------------------------------------------------------------------------ rows
def routed(rng, M, k, E, bs=4):
    t = ids(rng, M, k, E)
    return loomnb.oracle.moe_align_block_size(t, bs, E)[0]


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("H", [16, 13])  # vector and scalar layouts
def test_permute(kind, H):
    rng = np.random.default_rng(9)
    sorted_ids = routed(rng, 4, 2, 6)
    h = rng.standard_normal((4, H)).astype(DT[kind])
    got, want, _, _ = call_both("moe_permute", h, sorted_ids, 2)
    compare(got, want, kind)


@pytest.mark.parametrize("kind", ["bf16", "f32"])
@pytest.mark.parametrize("H, ub", [(16, False), (24, True), (13, False)])
def test_permute_fp8(kind, H, ub):
    rng = np.random.default_rng(10)
    sorted_ids = routed(rng, 3, 2, 5)
    h = (rng.standard_normal((3, H)) * 4).astype(DT[kind])
    scale_ub = np.array([2.0], np.float32) if ub else None
    got, want, _, _ = call_both("moe_permute", h, sorted_ids, 2, "fp8", scale_ub)
    compare(got, want, f"{kind} H={H}")


def test_permute_fp8_long_rows():
    """Rows longer than the KEEP units a lane holds (the rest re-read), and a block's last warp
    past the last row (it takes part in nothing it stores)."""
    rng = np.random.default_rng(15)
    sorted_ids = np.array([3, 0, 4], np.int32)  # token 1, token 0, a sentinel (N = 4)
    H = 8 * (32 * MOEK.KEEP["bf16"] + 5)
    h = (rng.standard_normal((2, H)) * 3).astype(BF16)
    h[1, H - 1] = 40.0  # the amax in the re-read part
    got, want, _, _ = call_both("moe_permute", h, sorted_ids, 2, "fp8")
    compare(got, want, "long rows")


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("H", [16, 10])
def test_unpermute(kind, H):
    rng = np.random.default_rng(11)
    M, k = 5, 3
    sorted_ids = routed(rng, M, k, 7)
    y = rng.standard_normal((sorted_ids.shape[0], H)).astype(DT[kind])
    w = rng.random((M, k)).astype(np.float32)
    got, want, _, _ = call_both("moe_unpermute", y, sorted_ids, w)
    assert_bits(got, want, kind)


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8, 10])  # 10: two rounds of 8 rows
def test_moe_sum(kind, k):
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, k, 16)).astype(DT[kind])
    got, want, _, _ = call_both("moe_sum", x)
    assert_bits(got, want, f"{kind} k={k}")


def test_moe_sum_scalar_layout():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 2, 7)).astype(BF16)
    got, want, _, _ = call_both("moe_sum", x)
    assert_bits(got, want, "scalar")


def test_rows_block_sizes():
    rng = np.random.default_rng(14)
    sorted_ids = routed(rng, 3, 2, 4)
    y = rng.standard_normal((sorted_ids.shape[0], 40)).astype(BF16)
    w = rng.random((3, 2)).astype(np.float32)
    want = loomnb.oracle.moe_unpermute(y, sorted_ids, w)
    block_size_sweep(lambda: loomnb.moe_unpermute(y, sorted_ids, w),
                     lambda got, what: assert_bits(got, want, what), threads=(32, 64))
