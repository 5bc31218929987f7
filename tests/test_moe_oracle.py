"""The MoE routing and movement oracles against independent references (plain pass, no
kernels): hand-worked alignments (vLLM's docstring example), the alignment's invariants, float64
softmax/sigmoid and a straightforward float64 re-derivation of grouped top-k (DeepSeek-V3's
geometry among them), the permute/unpermute round trip, and the rounding orders of the
combine and of ``moe_sum`` on values where the order shows."""

import math

import ml_dtypes
import numpy as np
import pytest

from loomnb import oracle as O

pytestmark = pytest.mark.nosim
BF16 = ml_dtypes.bfloat16
F32 = np.float32


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _softmax64(x):
    x = np.asarray(x).astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _sigmoid64(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x).astype(np.float64)))


def _grid_logits(rng, M, E, dtype, step=0.0625):
    """Rows of distinct logits (multiples of ``step``, exact in bf16), shuffled per row."""
    base = (np.arange(E) - E // 2) * step
    return np.stack([rng.permutation(base) for _ in range(M)]).astype(dtype)


# ---------------------------------------------------------------- moe_align_block_size
def test_align_vllm_docstring_example():
    """vLLM's docstring example (its experts run 1..4, so ``num_experts = 5``)."""
    ids = np.array([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], np.int32)
    s, e, n = O.moe_align_block_size(ids, 4, 5)
    L = 12 + 5 * 3
    assert s.dtype == np.int32 and e.dtype == np.int32 and n.dtype == np.int32
    assert s.tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12] + [12] * (L - 16)
    assert e.tolist() == [1, 2, 3, 4, -1, -1, -1] and n.tolist() == [16]


def _expected_length(N, E, bs, pad):
    L = N + E * (bs - 1)
    if pad:
        L = (L + bs - 1) // bs * bs
    return min(L, N * bs) if N < E else L


@pytest.mark.parametrize("M,k,E,bs,pad,idt", [
    (1, 1, 4, 16, False, np.int32), (3, 2, 8, 4, True, np.int64),
    (17, 8, 64, 16, False, np.int64), (64, 8, 256, 64, True, np.int32),
    (5, 2, 256, 16, False, np.int32), (64, 6, 64, 1, False, np.int32)])
def test_align_invariants(M, k, E, bs, pad, idt):
    rng = np.random.default_rng(M * 1000 + E)
    ids = rng.integers(0, E, (M, k)).astype(idt)
    if E > 8:  # some experts get nothing, some many
        ids[: M // 2] = ids[: M // 2] % 5
    s, eids, n = O.moe_align_block_size(ids, bs, E, pad_sorted_ids=pad)
    flat, N = ids.reshape(-1), M * k
    L = _expected_length(N, E, bs, pad)
    total = int(n[0])
    assert s.shape == (L,) and eids.shape == (-(-L // bs),)
    counts = np.bincount(flat, minlength=E)
    assert total == sum(-(-c // bs) * bs for c in counts) and total % bs == 0 and total <= L
    real = s[s != N]
    assert sorted(real.tolist()) == list(range(N))  # every flat index exactly once
    assert np.all(s[total:] == N) and np.all(eids[total // bs:] == -1)
    # blocks: one expert each, the experts ascending and each segment ascending, its entries
    # first and the sentinel after them; the number of blocks of e is ceil(count_e / bs)
    blocks = s[:total].reshape(-1, bs)
    prev = -1
    for b, row in enumerate(blocks):
        e = int(eids[b])
        members = row[row != N]
        assert np.all(flat[members] == e)
        assert e >= prev
        prev = e
    for e in range(E):
        seg = s[:total][np.repeat(eids[:total // bs], bs) == e]
        assert seg.shape[0] == -(-counts[e] // bs) * bs
        want = np.flatnonzero(flat == e)
        assert seg[:counts[e]].tolist() == want.tolist() and np.all(seg[counts[e]:] == N)


def test_align_length_clamp_when_fewer_slots_than_experts():
    s, e, n = O.moe_align_block_size(np.array([[7, 200]], np.int32), 16, 256)
    assert s.shape == (32,) and e.tolist() == [7, 200] and n.tolist() == [32]
    assert s[0] == 0 and s[16] == 1 and np.all(np.delete(s, [0, 16]) == 2)
    s, e, n = O.moe_align_block_size(np.array([[9, 9]], np.int32), 16, 256)
    assert s.shape == (32,) and e.tolist() == [9, -1] and n.tolist() == [16]
    assert s[:2].tolist() == [0, 1] and np.all(s[2:] == 2)


def test_align_pad_sorted_ids_rounds_the_length_up():
    ids = np.array([[0, 2, 2, 1, 0]], np.int32)  # N = 5, E = 3, bs = 4: L = 5 + 9 = 14
    s, e, n = O.moe_align_block_size(ids, 4, 3)
    assert s.shape == (14,) and e.shape == (4,)
    s2, e2, n2 = O.moe_align_block_size(ids, 4, 3, pad_sorted_ids=True)
    assert s2.shape == (16,) and e2.shape == (4,) and n.tolist() == n2.tolist() == [12]
    assert s2[:12].tolist() == [0, 4, 5, 5, 3, 5, 5, 5, 1, 2, 5, 5] and np.all(s2[12:] == 5)
    assert e2.tolist() == [0, 1, 2, -1] and np.array_equal(s2[:14], s)


def test_align_expert_map_maps_the_segments_and_leaves_the_tail():
    ids = np.array([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], np.int32)
    emap = np.array([7, -1, 0, -1, 1], np.int32)
    s, e, n = O.moe_align_block_size(ids, 4, 5, expert_map=emap)
    s0, e0, n0 = O.moe_align_block_size(ids, 4, 5)
    assert np.array_equal(s, s0) and n.tolist() == n0.tolist() == [16]  # counts unchanged
    assert e.tolist() == [-1, 0, -1, 1, -1, -1, -1]  # the tail: -1, no expert


def test_align_drops_ids_outside_the_experts():
    ids = np.array([[0, 5], [-1, 2], [9, 2]], np.int32)  # -1 and 9 are not experts of 8
    s, e, n = O.moe_align_block_size(ids, 4, 8)
    assert n.tolist() == [12] and s.shape == (min(6 + 8 * 3, 6 * 4),)  # N < E: clamped
    assert s[:12].tolist() == [0, 6, 6, 6, 3, 5, 6, 6, 1, 6, 6, 6] and np.all(s[12:] == 6)
    assert e.tolist()[:3] == [0, 2, 5] and not np.isin([2, 4], s).any()


def test_align_writes_the_given_outputs():
    ids = np.array([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], np.int64)
    bufs = np.zeros(27, np.int32), np.zeros(7, np.int32), np.zeros(1, np.int32)
    got = O.moe_align_block_size(ids, 4, 5, sorted_token_ids=bufs[0], expert_ids=bufs[1],
                                 num_tokens_post_pad=bufs[2])
    assert all(g is b for g, b in zip(got, bufs))
    assert all(np.array_equal(g, w) for g, w in zip(got, O.moe_align_block_size(ids, 4, 5)))


def test_align_empty():
    s, e, n = O.moe_align_block_size(np.zeros((0, 2), np.int32), 16, 8)
    assert s.shape == (0,) and e.shape == (0,) and n.tolist() == [0]


# ---------------------------------------------------------------- topk_softmax / topk_sigmoid
@pytest.mark.parametrize("dtype", [F32, BF16, np.float16])
@pytest.mark.parametrize("op,ref", [("topk_softmax", _softmax64), ("topk_sigmoid", _sigmoid64)])
def test_topk_against_float64(op, ref, dtype):
    rng = np.random.default_rng(5)
    M, E, k = 33, 64, 6
    x = _grid_logits(rng, M, E, dtype)
    w, ids, tei = getattr(O, op)(x, k)
    assert w.dtype == F32 and ids.dtype == np.int32 and tei.dtype == np.int32
    p = ref(x)
    want = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    assert np.array_equal(ids, want)
    np.testing.assert_allclose(w, np.take_along_axis(p, want, -1), rtol=6e-7, atol=0)
    assert np.array_equal(tei, np.arange(k)[None, :] * M + np.arange(M)[:, None])


@pytest.mark.parametrize("op", ["topk_softmax", "topk_sigmoid"])
def test_topk_renormalize(op):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((20, 32)).astype(F32)
    w0, i0, _ = getattr(O, op)(x, 4)
    w, i, _ = getattr(O, op)(x, 4, True)
    assert np.array_equal(i, i0)
    np.testing.assert_allclose(w.astype(np.float64).sum(-1), 1.0, rtol=3e-7)
    d = ((w0[:, 0] + w0[:, 1]).astype(F32) + w0[:, 2]).astype(F32)
    d = (d + w0[:, 3]).astype(F32)  # the float32 sum in selection order
    assert np.array_equal(w, (w0 / d[:, None]).astype(F32))


def test_topk_softmax_rounding_points():
    """``p = r32(e * r32(1 / r32(fsum e)))`` with ``e = r32(exp(r32(x - m)))`` on one row."""
    x = np.array([[0.1, -2.7, 3.3, 1.9, -0.4]], F32)
    m = F32(3.3)
    e = [F32(math.exp(float(F32(v - m)))) for v in x[0]]
    inv = F32(1) / F32(math.fsum(float(v) for v in e))
    p = [F32(v * inv) for v in e]
    w, ids, _ = O.topk_softmax(x, 5)
    assert ids.tolist() == [[2, 3, 0, 4, 1]]
    assert _bits(w).tolist() == [[_bits(np.array(p[j], F32)).item() for j in (2, 3, 0, 4, 1)]]


def test_topk_sigmoid_rounding_points():
    x = np.array([[0.3, -1.1, 2.0]], F32)
    p = [F32(F32(1) / F32(F32(1) + F32(math.exp(-float(v))))) for v in x[0]]
    w, ids, _ = O.topk_sigmoid(x, 3)
    assert ids.tolist() == [[2, 0, 1]] and np.array_equal(w[0], np.array([p[2], p[0], p[1]], F32))


@pytest.mark.parametrize("op", ["topk_softmax", "topk_sigmoid"])
def test_topk_ties_go_to_the_lowest_index(op):
    x = np.array([[1, 3, 3, 0, 3], [2, 2, 2, 2, 2]], F32)
    _, ids, _ = getattr(O, op)(x, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]


def test_topk_nan_is_the_largest():
    x = np.array([[0, np.nan, 5, 1, np.nan]], F32)
    w, ids, _ = O.topk_sigmoid(x, 3)
    assert ids.tolist() == [[1, 4, 2]] and np.isnan(w[0, :2]).all() and w[0, 2] == _sigmoid64(
        np.array([5.0], F32)).astype(F32)[0]
    # softmax: the NaN reaches the sum, every probability of the row is NaN: ids 0..k-1
    w, ids, _ = O.topk_softmax(x, 3)
    assert ids.tolist() == [[0, 1, 2]] and np.isnan(w).all()


@pytest.mark.parametrize("op", ["topk_softmax", "topk_sigmoid"])
def test_topk_all_minus_inf_row(op):
    x = np.array([[-np.inf] * 6, [0, 1, 2, 3, 4, 5]], F32)
    w, ids, _ = getattr(O, op)(x, 3)
    assert ids.tolist() == [[0, 1, 2], [5, 4, 3]]
    if op == "topk_softmax":
        assert np.isnan(w[0]).all()
    else:  # sigmoid(-inf) = 0 exactly: a tie of zeros, the renormalisation's D == 0 -> 1
        assert np.array_equal(w[0], [0, 0, 0])
        w, _, _ = O.topk_sigmoid(x, 3, True)
        assert np.array_equal(w[0], [0, 0, 0])


@pytest.mark.parametrize("op", ["topk_softmax", "topk_sigmoid"])
def test_topk_bias_selects_but_does_not_weigh(op):
    x = np.array([[0.5, 2.0, -1.0, 1.0, 0.0, -3.0]], F32)
    full, order, _ = getattr(O, op)(x, 6)
    p = np.empty(6, F32)
    p[order[0]] = full[0]
    bias = np.zeros(6, F32)
    bias[5] = 10.0  # the least likely expert first
    w, ids, _ = getattr(O, op)(x, 2, e_score_correction_bias=bias)
    assert ids.tolist() == [[5, 1]] and np.array_equal(w[0], p[[5, 1]])
    w0, ids0, _ = getattr(O, op)(x, 2)
    assert ids0.tolist() == [[1, 3]]


def test_topk_writes_the_given_outputs():
    x = np.random.default_rng(7).standard_normal((4, 8)).astype(BF16)
    tw, ti, te = np.zeros((4, 2), F32), np.zeros((4, 2), np.int32), np.zeros((4, 2), np.int32)
    got = O.topk_softmax(x, 2, topk_weights=tw, topk_ids=ti, token_expert_indices=te)
    assert got[0] is tw and got[1] is ti and got[2] is te
    want = O.topk_softmax(x, 2)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------- grouped_topk
def _grouped64(x, k, renormalize, G, tg, scoring, rsf, bias):
    """A straightforward float64 re-derivation, one row at a time, sorting by (-score, index)."""
    p_all = _softmax64(x) if scoring == "softmax" else _sigmoid64(x)
    M, E = p_all.shape
    per = E // G
    W, I = [], []
    for t in range(M):
        p = p_all[t]
        s = p + (0.0 if bias is None else bias.astype(np.float64))
        gscore = []
        for g in range(G):
            vals = sorted(s[g * per:(g + 1) * per], reverse=True)
            gscore.append(vals[0] + vals[1] if bias is not None else vals[0])
        groups = sorted(range(G), key=lambda g: (-gscore[g], g))[:tg]
        cands = [e for g in groups for e in range(g * per, (g + 1) * per)]
        ids = sorted(cands, key=lambda e: (-s[e], e))[:k]
        w = p[ids]
        if renormalize:
            w = w / w.sum()
        W.append(w * rsf)
        I.append(ids)
    return np.array(W), np.array(I)


@pytest.mark.parametrize("name,M,E,G,tg,k,scoring,rsf,with_bias,renorm,dtype", [
    ("deepseek_v3", 24, 256, 8, 4, 8, "sigmoid", 2.5, True, True, F32),
    ("deepseek_v3_bf16", 8, 256, 8, 4, 8, "sigmoid", 2.5, True, True, BF16),
    ("softmax_no_bias", 24, 64, 8, 3, 6, "softmax", 1.0, False, False, BF16),
    ("softmax_no_bias_renorm", 24, 64, 8, 3, 6, "softmax", 1.0, False, True, F32),
    ("softmax_bias_scaled", 16, 64, 4, 2, 5, "softmax", 16.0, True, False, F32),
])
def test_grouped_topk_against_float64(name, M, E, G, tg, k, scoring, rsf, with_bias, renorm,
                                      dtype):
    rng = np.random.default_rng(E * 31 + M + k)
    x = rng.standard_normal((M, E)).astype(dtype)
    bias = (rng.standard_normal(E) * 0.1).astype(F32) if with_bias else None
    hidden = np.zeros((M, 16), BF16)
    w, ids = O.grouped_topk(hidden, x, k, renorm, G, tg, scoring, rsf, bias)
    assert w.dtype == F32 and ids.dtype == np.int32 and w.shape == ids.shape == (M, k)
    w64, i64 = _grouped64(x, k, renorm, G, tg, scoring, rsf, bias)
    for t in range(M):
        assert set(ids[t].tolist()) == set(i64[t].tolist()), t
        order = np.argsort(i64[t])
        np.testing.assert_allclose(w[t][np.argsort(ids[t])], w64[t][order], rtol=1e-6,
                                   atol=1e-6 * rsf)
    # selection order: the (biased) scores are non-increasing along each row
    p = O.topk_softmax(x, E)[0] if scoring == "softmax" else O.topk_sigmoid(x, E)[0]
    full = O.topk_softmax(x, E)[1] if scoring == "softmax" else O.topk_sigmoid(x, E)[1]
    pe = np.empty_like(p)
    np.put_along_axis(pe, full, p, axis=-1)
    s = pe if bias is None else (pe + bias).astype(F32)
    assert np.all(np.diff(np.take_along_axis(s, ids.astype(np.int64), -1), axis=-1) <= 0)


def test_grouped_topk_group_rule_by_hand():
    """Group score: with a bias the sum of the two best, else the best: the two rules pick
    different groups here."""
    # 2 groups of 3 (sigmoid of these logits keeps their order); group 0 has one high expert,
    # group 1 two fairly high ones
    x = np.array([[3.0, -4.0, -4.0, 1.0, 1.5, -4.0]], F32)
    w, ids = O.grouped_topk(x, x, 2, False, 2, 1, "sigmoid")
    assert ids.tolist() == [[0, 1]]  # group 0 (max 3.0), its two best
    w, ids = O.grouped_topk(x, x, 2, False, 2, 1, "sigmoid",
                            e_score_correction_bias=np.zeros(6, F32))
    assert ids.tolist() == [[4, 3]]  # group 1 (0.73 + 0.82 > 0.95 + 0.02)
    p = [F32(F32(1) / F32(F32(1) + F32(math.exp(-float(v))))) for v in x[0]]
    assert w[0].tolist() == [p[4], p[3]]  # float32 rounding points, not the float64 sigmoid
    assert w[0, 0] != F32(_sigmoid64(x[0, 4]))


def test_grouped_topk_scaling_rounds_once_after_renormalizing():
    x = np.array([[0.3, 1.2, -0.5, 2.2]], F32)
    w1, ids = O.grouped_topk(x, x, 2, True, 2, 2, "softmax")
    w, ids2 = O.grouped_topk(x, x, 2, True, 2, 2, "softmax", routed_scaling_factor=0.1)
    assert np.array_equal(ids, ids2) and ids.tolist() == [[3, 1]]
    assert np.array_equal(w, (w1 * F32(0.1)).astype(F32))


def test_grouped_topk_nan_group_first():
    x = np.array([[0.0, 5.0, np.nan, -1.0, 1.0, 2.0]], F32)
    _, ids = O.grouped_topk(x, x, 2, False, 3, 1, "sigmoid")
    assert ids.tolist() == [[2, 3]]  # the NaN's group, the NaN first


# ---------------------------------------------------------------- moe_permute / moe_unpermute
def _routing(rng, M, k, E, bs):
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.int32)
    s, _, _ = O.moe_align_block_size(ids, bs, E)
    return ids, s


@pytest.mark.parametrize("dtype", [BF16, np.float16, F32])
def test_permute_unpermute_round_trip(dtype):
    rng = np.random.default_rng(8)
    M, H, k, E = 9, 16, 3, 8
    x = rng.integers(-8, 9, (M, H)).astype(dtype)
    ids, s = _routing(rng, M, k, E, 4)
    y, none = O.moe_permute(x, s, k)
    assert y.dtype == x.dtype and y.shape == (s.shape[0], H)
    assert none.shape == (0, 1) and none.dtype == F32  # no scales without quantisation
    pad = s >= M * k
    assert pad.any() and np.all(_bits(y[pad]) == 0)
    assert np.array_equal(_bits(y[~pad]), _bits(x[s[~pad] // k]))
    out = O.moe_unpermute(y, s, np.ones((M, k), F32))
    assert out.dtype == x.dtype and np.array_equal(out.astype(F32), k * x.astype(F32))
    # one weight a token: its row comes back once, exactly
    w = np.zeros((M, k), F32)
    w[:, 1] = 1
    assert np.array_equal(O.moe_unpermute(y, s, w).astype(F32), x.astype(F32))


def test_permute_keeps_the_bits():
    x = np.array([[np.nan, -0.0, 1.5, -np.inf]], F32)
    x.view(np.uint32)[0, 0] = 0x7FC00123  # a NaN payload
    s = np.array([0, 2, 1], np.int32)  # M = 1, k = 2: 2 is the sentinel
    out = np.full((3, 4), 9.0, F32)
    got, _ = O.moe_permute(x, s, 2, out=out)
    assert got is out
    assert _bits(out).tolist() == [_bits(x[0]).tolist(), [0] * 4, _bits(x[0]).tolist()]


@pytest.mark.parametrize("scale_ub", [None, np.array([0.5], F32)])
def test_permute_fp8_is_the_per_token_quant_of_the_rows(scale_ub):
    rng = np.random.default_rng(9)
    M, H, k, E = 7, 32, 2, 6
    x = (rng.standard_normal((M, H)) * 3).astype(BF16)
    x[3] = 0  # an all-zero token: its rows take the floor scale too
    _, s = _routing(rng, M, k, E, 4)
    q, sc = O.moe_permute(x, s, k, quant_dtype="fp8", scale_ub=scale_ub)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == (s.shape[0], H)
    assert sc.dtype == F32 and sc.shape == (s.shape[0], 1)
    qx, sx = O.dynamic_per_token_scaled_fp8_quant(x, scale_ub)  # quantise, then gather
    pad = s >= M * k
    assert np.array_equal(_bits(q[~pad]), _bits(qx[s[~pad] // k]))
    assert np.array_equal(sc[~pad], sx[s[~pad] // k])
    assert np.all(_bits(q[pad]) == 0) and np.all(sc[pad] == F32(1) / F32(448 * 512))
    assert sc[s == 3 * k].item() == F32(1) / F32(448 * 512)
    q2, sc2 = np.zeros((s.shape[0], H), np.uint8), np.zeros((s.shape[0], 1), F32)
    got = O.moe_permute(x, s, k, "fp8", scale_ub, out=q2, scales=sc2)  # the op's positions
    assert got[0] is q2 and got[1] is sc2
    assert np.array_equal(q2, _bits(q)) and np.array_equal(sc2, sc)


def test_unpermute_is_sequential_in_float32():
    """``acc = r32(acc + r32(w * y))`` for j = 0, 1, 2: 2^24 + 1 rounds back to 2^24 (ties to
    even), so the sum is 0, where float64 (or another order) gives 1."""
    y = np.array([[2.0 ** 24], [1.0], [-(2.0 ** 24)]], F32)
    s = np.array([0, 1, 2, 3], np.int32)  # M = 1, k = 3; 3 is the sentinel
    y = np.concatenate([y, [[7.0]]]).astype(F32)
    assert O.moe_unpermute(y, s, np.ones((1, 3), F32)).tolist() == [[0.0]]
    s = np.array([0, 2, 1, 3], np.int32)  # j = 1 now reads the -2^24 row
    assert O.moe_unpermute(y, s, np.ones((1, 3), F32)).tolist() == [[1.0]]
    # the product is rounded before the add (no FMA): r32(r32(1/3) * 3) = 1, so -1 + 1 = 0
    # (a fused multiply-add would keep the product's 2^-25)
    w = np.array([[1.0, F32(1) / F32(3)]], F32)
    y2 = np.array([[-1.0], [3.0]], F32)
    assert O.moe_unpermute(y2, np.array([0, 1], np.int32), w).tolist() == [[0.0]]


def test_unpermute_skips_a_missing_index():
    """A flat index found nowhere in ``sorted_token_ids`` adds nothing (not ``w * 0``: an
    infinite weight would make that NaN)."""
    y = np.array([[1.5], [2.0], [9.0]], F32)
    s = np.array([0, 2, 4], np.int32)  # M = 2, k = 2: flat 1 and 3 are missing, 4 the sentinel
    w = np.array([[2.0, np.inf], [0.5, np.inf]], F32)
    assert O.moe_unpermute(y, s, w).tolist() == [[3.0], [1.0]]


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_unpermute_against_float64(dtype):
    rng = np.random.default_rng(10)
    M, H, k, E = 13, 24, 4, 16
    ids, s = _routing(rng, M, k, E, 8)
    y = rng.standard_normal((s.shape[0], H)).astype(dtype)
    w = rng.random((M, k)).astype(F32)
    out = O.moe_unpermute(y, s, w)
    pos = {int(v): p for p, v in enumerate(s) if v < M * k}
    want = np.zeros((M, H))
    mag = np.zeros((M, H))
    for t in range(M):
        for j in range(k):
            term = w[t, j].astype(np.float64) * y[pos[t * k + j]].astype(np.float64)
            want[t] += term
            mag[t] += np.abs(term)
    if dtype == F32:
        assert np.all(np.abs(out - want) <= 2 * k * 2.0 ** -24 * mag)
    else:  # within one bf16 rounding of the exact sum (plus the float32 error)
        assert np.all(np.abs(out.astype(np.float64) - want)
                      <= 2.0 ** -8 * np.abs(want) + 2 * k * 2.0 ** -24 * mag)
    o2 = np.zeros((M, H), dtype)
    assert O.moe_unpermute(y, s, w, out=o2) is o2 and np.array_equal(_bits(o2), _bits(out))


# ---------------------------------------------------------------- moe_sum
@pytest.mark.parametrize("dtype,half_ulp", [(BF16, 2.0 ** -8), (np.float16, 2.0 ** -11)])
@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_moe_sum_rounding_order(dtype, half_ulp, k):
    """``1 + h + h + ...`` with ``h`` half an ulp of 1: rounding every add (k = 2..4) keeps 1
    (each add a tie to even); one rounding of the float32 sum (k = 8) gives the nearest value
    to ``1 + 7h`` (a tie: the even ``1 + 8h``)."""
    x = np.array([[[1.0] + [half_ulp] * (k - 1)]], np.float64).transpose(0, 2, 1)
    x = np.concatenate([x, -x], axis=2).astype(dtype)  # H = 2: the negated row too
    got = O.moe_sum(x)
    assert got.dtype == x.dtype and got.shape == (1, 2)
    fp32_once = F32(1.0 + (k - 1) * half_ulp).astype(dtype).astype(F32)
    each_add = F32(1.0)
    want = each_add if k <= 4 else fp32_once
    assert got.astype(F32).tolist() == [[want, -want]]
    if k in (3, 4):  # the case differs between the two rules: the check can fail
        assert fp32_once != each_add


def test_moe_sum_against_float32_sum_and_copy():
    rng = np.random.default_rng(11)
    for k in (2, 3, 4, 5, 8):
        x = rng.standard_normal((6, k, 40)).astype(F32)
        acc = np.zeros((6, 40), F32)
        for j in range(k):
            acc = (acc + x[:, j]).astype(F32)
        out = np.zeros((6, 40), F32)
        assert O.moe_sum(x, out=out) is out and np.array_equal(out, acc)
        xb = x.astype(BF16)
        got = O.moe_sum(xb)
        if k > 4:
            want = O.to_dtype(_seq(xb), BF16)
        else:
            want = np.zeros((6, 40), BF16)
            for j in range(k):
                want = (want.astype(F32) + xb[:, j].astype(F32)).astype(F32).astype(BF16)
        assert np.array_equal(_bits(got), _bits(want)), k
    x = np.array([[[-0.0, np.nan, 2.5]]], BF16)
    x.view(np.uint16)[0, 0, 1] = 0xFFC1
    got = _bits(O.moe_sum(x))  # k = 1: +0.0 + x, as torch's sum: -0.0 -> +0.0, NaN canonical
    assert got[0].tolist() == [0x0000, 0x7FFF, _bits(x)[0, 0, 2]]


def _seq(xb):
    acc = np.zeros((xb.shape[0], xb.shape[2]), F32)
    for j in range(xb.shape[1]):
        acc = (acc + xb[:, j].astype(F32)).astype(F32)
    return acc


def test_moe_sum_nan_is_canonical():
    x = np.array([[[1.0], [np.nan], [2.0]]], BF16)
    assert _bits(O.moe_sum(x)).tolist() == [[0x7FFF]]
