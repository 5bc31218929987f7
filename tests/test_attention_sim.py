"""Paged decode attention and merge_attn_states under numba's CUDA simulator against the float64
oracle (the family template of ``tests/family.py``), at tiny shapes (one Python thread per CUDA
thread): every (query, cache) dtype pair, every cache layout (16-byte and element loads), GQA
ratios 1..16 (head chunks of 1 to 4 heads), head sizes of 8, 16 and 32 lanes, block sizes 1, 3 (not a power of
two), 4, 16, 32, contexts around block boundaries, split-K with its merge, sliding window,
softcap, stale block-table entries and NaN in every slot no visible token owns, and a sweep of
the block size (the multi-round cross-warp merge included).
"""

import numpy as np
import pytest

import loomnb
from loomnb.ops import _launch as L
from loomnb.ops import attention as A
from loomnb.oracle.attention import merge_exact

from family import assert_bits, block_size_sweep, out_given_and_not
from test_attention_cases import (BF16, NP_DT, assert_attention, assert_merge, exact, exact_suffix,
                                  make_case, op_args)

pytestmark = pytest.mark.sim
THREADS = 64  # two warps: the cross-warp merge runs; small enough for the simulator


def run(case, threads=THREADS, **options):
    args, kw = op_args(case, **options)
    with L.force_threads(threads):
        return loomnb.paged_decode_attention(*args, **kw)


def check(case, what, threads=THREADS, kind=None, **options):
    kind = kind or next(k for k, d in NP_DT.items() if case["query"].dtype == np.dtype(d))
    out, lse = run(case, threads, return_lse=True, **options)
    o, l_, vmax = exact(case, **options)
    assert out.dtype == case["query"].dtype and lse.dtype == np.float32
    assert_attention(out, o, vmax, kind, what, lse, l_)
    return out, lse


@pytest.mark.parametrize("kind, cache", [("bf16", "auto"), ("f16", "auto"), ("f32", "auto"),
                                         ("bf16", "fp8"), ("f16", "fp8"), ("f32", "fp8")])
def test_dtypes(kind, cache):
    case = make_case(10, seq_lens=[21, 6], num_heads=4, num_kv_heads=2, head_size=32,
                     block_size=4, kind=kind, cache=cache)
    assert A.layout(case["query"], case["key_cache"], case["value_cache"],
                    case["kv_cache_dtype"]) == "vec"
    check(case, f"{kind}/{cache}")


@pytest.mark.parametrize("layout, path", [("hnd", "vec"), ("split", "vec"), ("legacy", "scalar"),
                                          ("offset", "scalar")])
@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_layouts(layout, path, cache):
    """Every layout is a view the op reads directly; the x-packed key (5-D) and the transposed
    value take element loads, as does a cache one element off a 16-byte boundary."""
    case = make_case(11, seq_lens=[13, 9], num_heads=2, num_kv_heads=2, head_size=32,
                     block_size=4, cache=cache, layout=layout)
    assert A.layout(case["query"], case["key_cache"], case["value_cache"],
                    case["kv_cache_dtype"]) == path
    check(case, f"{layout}/{cache}")


def test_legacy_key_with_an_aligned_value_takes_element_loads_for_both():
    case = make_case(12, seq_lens=[7], num_heads=1, num_kv_heads=1, head_size=16, block_size=4,
                     layout="legacy")
    k5 = case["key_cache"]
    assert k5.ndim == 5 and k5.shape == (case["value_cache"].shape[0], 1, 2, 4, 8)
    check(case, "legacy")


@pytest.mark.parametrize("max_gc", [None, 4])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(1, 1), (3, 1), (4, 1), (7, 1), (8, 2), (16, 1)])
def test_gqa_ratios(num_heads, num_kv_heads, max_gc, monkeypatch):
    """Group sizes 1..16, with the heads-per-CTA rule (small work: one or two heads a CTA) and
    forced up to 4 query heads a CTA (larger groups in ceil(group/4) chunks), which the rule
    takes only past shapes the simulator can reach."""
    monkeypatch.setattr(A, "MAX_HEADS_PER_CTA", max_gc)
    case = make_case(13 + num_heads, seq_lens=[9, 3], num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_size=16, block_size=4)
    check(case, f"{num_heads}/{num_kv_heads}, max_gc {max_gc}")


def test_heads_per_cta_rule():
    """Small work (<= 3 Mi key elements): one head a CTA while the grid stays within 4 CTAs an
    SM, else two; larger work: 4."""
    assert A.heads_per_cta(3, 1, 3, 160, 64) == 1            # SmolLM2, batch 1
    assert A.heads_per_cta(3, 64, 3, 192, 64) == 2           # batch 64: 576 CTAs of one head > 528
    assert A.heads_per_cta(4, 32, 8, 32, 128) == 2           # 32/8/128, 32 x 32
    assert A.heads_per_cta(4, 1, 8, 1024, 128) == 1
    assert A.heads_per_cta(4, 1, 8, 4096, 128) == 4          # 4 Mi elements
    assert A.heads_per_cta(3, 8, 3, 4096, 64) == 4
    assert A.heads_per_cta(4, 128, 8, 32, 128) == 4          # 1024 CTAs even at two heads
    assert A.head_chunks(3, 1) == (3, 1) and A.head_chunks(3, 2) == (2, 2)
    assert A.head_chunks(7) == (2, 4) and A.head_chunks(16, 2) == (8, 2)


@pytest.mark.parametrize("head_size", [8, 40, 64, 80, 96, 128, 256])
def test_head_sizes(head_size):
    """8, 16 and 32 lanes per row (8 elements a lane on the vector path); 80 and 96 leave lanes
    idle; 8 and 40 are not 16-aligned units for every lane."""
    case = make_case(20 + head_size, seq_lens=[5], num_heads=2, num_kv_heads=1,
                     head_size=head_size, block_size=4)
    check(case, f"head_size {head_size}")


@pytest.mark.parametrize("head_size, kind", [(80, "bf16"), (128, "f16"), (256, "bf16")])
def test_sixteen_elements_a_lane_for_two_byte_caches(head_size, kind, monkeypatch):
    """The vector path's 16-elements-a-lane configuration, which ``vector_config`` picks for a
    2-byte cache of head_size > 64 once the CTAs fill the GPU (shapes the simulator cannot
    reach), forced: 8 lanes a 128-row (5 of them real at 80), 16 at 256."""
    monkeypatch.setattr(A, "ELEMENTS_PER_LANE", 16)
    case = make_case(25 + head_size, seq_lens=[9, 4], num_heads=4, num_kv_heads=1,
                     head_size=head_size, block_size=4, kind=kind)
    assert A.vector_config("bf16", head_size, 10_000) == (16, 4)
    assert A.vector_config("bf16", head_size, 1) == (8, 4)
    check(case, f"epl 16, head_size {head_size}")


@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
def test_block_sizes(block_size):
    case = make_case(30 + block_size, seq_lens=[block_size + 1, 2 * block_size - 1, 1],
                     num_heads=2, num_kv_heads=1, head_size=16, block_size=block_size)
    check(case, f"block_size {block_size}")


@pytest.mark.parametrize("seq_len", [0, 1, 15, 16, 17, 33])
def test_context_ladder(seq_len):
    """Contexts around block boundaries (block 16); 0: out 0, lse -inf."""
    case = make_case(40 + seq_len, seq_lens=[seq_len, 1], num_heads=2, num_kv_heads=1,
                     head_size=16, block_size=16)
    out, lse = check(case, f"seq_len {seq_len}")
    if seq_len == 0:
        assert (out[0].astype(np.float32) == 0).all() and np.isneginf(lse[:, 0]).all()


def test_split_k_and_its_merge(monkeypatch):
    """Force several splits on a short context: the partials and their merge (LSE included)
    equal the oracle, splits may be empty (a short sequence next to a long one), and the
    max_seq_len hint changes only the split count."""
    monkeypatch.setattr(A, "MIN_SPLIT_TOKENS", 8)
    monkeypatch.setattr(A, "SPLIT_MIN_CONTEXT", 16)
    case = make_case(50, seq_lens=[37, 2, 0], num_heads=4, num_kv_heads=1, head_size=16,
                     block_size=4)
    assert A.num_splits(3, 1, 1, 40) == 5
    check(case, "splits", threads=32)
    check(case, "splits, hint", threads=32, max_seq_len=15)
    assert A.num_splits(3, 1, 1, 15) == 1


@pytest.mark.parametrize("num_heads, num_kv_heads, max_gc, fused", [(7, 1, 4, True), (6, 2, 2, True),
                                                                     (6, 2, 2, False)])
def test_split_k_merge_by_the_last_split_cta(num_heads, num_kv_heads, max_gc, fused, monkeypatch):
    """The last split CTA of each (sequence, KV head, head chunk) merges its heads' splits:
    chunks of 4 + 3 heads (the second one short), 2 KV heads of 2 heads a CTA, 3 sequences x 5
    splits (one sequence empty, one with empty splits) -- all equal the oracle, the LSE
    included, and every split counter is 0 after the launch (``conftest``'s check); and the
    same through the separate merge launch that large merges take (``fused_merge``)."""
    monkeypatch.setattr(A, "fused_merge", lambda *_: fused)
    names, launch = [], L.launch
    monkeypatch.setattr(L, "launch", lambda f, *a, **k: (names.append(f.__name__), launch(f, *a, **k)))
    monkeypatch.setattr(A, "MIN_SPLIT_TOKENS", 8)
    monkeypatch.setattr(A, "SPLIT_MIN_CONTEXT", 16)
    monkeypatch.setattr(A, "MAX_HEADS_PER_CTA", max_gc)
    case = make_case(51 + num_heads, seq_lens=[37, 2, 0], num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_size=8, block_size=4)
    check(case, f"{num_heads}/{num_kv_heads}, {max_gc} heads a CTA, splits", threads=32)
    assert names == ["decode_kernel"] if fused else ["decode_kernel", "split_merge_kernel"], names


def test_split_rule():
    assert A.num_splits(8, 8, 1, 4096) == 5 and A.num_splits(32, 8, 1, 4096) == 2
    assert A.num_splits(128, 8, 1, 1024) == 1 and A.num_splits(32, 8, 1, 32) == 1
    assert A.num_splits(32, 3, 1, 4096) == 3 and A.num_splits(8, 3, 1, 16384) == 11
    assert A.num_splits(1, 8, 1, 1024) == 8 and A.num_splits(1, 1, 1, 10 ** 6) == 64
    assert A.num_splits(1, 3, 1, 255) == 1 and A.num_splits(1, 3, 1, 256) == 2  # 128 tokens a split


@pytest.mark.parametrize("window", [1, 5, 100])
def test_sliding_window(window, monkeypatch):
    monkeypatch.setattr(A, "MIN_SPLIT_TOKENS", 8)
    monkeypatch.setattr(A, "SPLIT_MIN_CONTEXT", 16)
    case = make_case(60 + window, seq_lens=[23, 3], num_heads=2, num_kv_heads=1, head_size=16,
                     block_size=4)
    check(case, f"window {window}", sliding_window=window)


@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_softcap(cache):
    case = make_case(70, seq_lens=[11], num_heads=2, num_kv_heads=1, head_size=16, block_size=4,
                     cache=cache)
    case["query"] = (case["query"].astype(np.float32) * 8).astype(case["query"].dtype)
    check(case, "softcap 5", softcap=5.0)
    check(case, "softcap 0 is off", softcap=0.0)


def test_per_head_and_0d_scales():
    case = make_case(71, seq_lens=[10, 4], num_heads=4, num_kv_heads=2, head_size=16,
                     block_size=4, cache="fp8", per_head_scales=True)
    check(case, "per-head scales")
    case1 = make_case(72, seq_lens=[6], num_heads=2, num_kv_heads=2, head_size=16, block_size=4,
                      cache="fp8")
    want, _ = run(case1, return_lse=True)
    case1["k_scale"], case1["v_scale"] = case1["k_scale"].reshape(()), case1["v_scale"].reshape(())
    assert_bits(run(case1), want, "0-d scales")


def test_q_zero_gives_the_mean_of_the_valid_values_and_nan_past_seq_len_never_leaks():
    """The issue's case: seq_len not a multiple of the block size, q = 0, every cache slot past
    seq_len (and every stale table entry's block) NaN: the output is the mean of the valid V
    rows, finite."""
    case = make_case(80, seq_lens=[19, 5], num_heads=2, num_kv_heads=1, head_size=16,
                     block_size=4, q_zero=True)
    out, _ = check(case, "q = 0")
    for s, n in enumerate(case["seq_lens"]):
        j = np.arange(n)
        v = case["value_cache"][case["block_tables"][s, j // 4], j % 4, 0].astype(np.float64)
        np.testing.assert_allclose(out[s, 0].astype(np.float64), v.mean(axis=0), rtol=2 ** -7,
                                   atol=1e-6)
    assert np.isfinite(out.astype(np.float32)).all()


def test_nan_in_a_visible_value_propagates():
    case = make_case(81, seq_lens=[9], num_heads=2, num_kv_heads=1, head_size=16, block_size=4)
    case["value_cache"][case["block_tables"][0, 1], 2, 0, 3] = np.nan  # token 6, dim 3
    out, _ = check(case, "NaN value")
    assert np.isnan(out[0, :, 3].astype(np.float32)).all()
    assert np.isfinite(np.delete(out[0].astype(np.float32), 3, axis=1)).all()


def test_out_given_and_lse_given_and_inputs_untouched():
    case = make_case(82, seq_lens=[9, 4], num_heads=4, num_kv_heads=2, head_size=16, block_size=4)
    args, kw = op_args(case)
    before = [np.array(a, copy=True) for a in args[:5]]
    with L.force_threads(THREADS):
        out_given_and_not(lambda out: loomnb.paged_decode_attention(*args, **kw, out=out),
                          lambda: np.full(case["query"].shape, 7, BF16))
        lse = np.full((4, 2), 7, np.float32)
        o, l_ = loomnb.paged_decode_attention(*args, **kw, lse=lse)
        assert l_ is lse
        _, l2 = loomnb.paged_decode_attention(*args, **kw, return_lse=True)
    assert_bits(lse, l2, "lse given vs allocated")
    for a, b in zip(args[:5], before):
        assert_bits(a, b, "inputs are not modified")


def test_block_size_sweep(monkeypatch):
    """32 .. 160 threads: one warp, two, and five (two rounds of the cross-warp merge)."""
    monkeypatch.setattr(A, "MIN_SPLIT_TOKENS", 8)
    monkeypatch.setattr(A, "SPLIT_MIN_CONTEXT", 16)
    case = make_case(90, seq_lens=[45], num_heads=3, num_kv_heads=1, head_size=16, block_size=4)
    o, l_, vmax = exact(case)
    args, kw = op_args(case)
    block_size_sweep(lambda: loomnb.paged_decode_attention(*args, **kw, return_lse=True),
                     lambda got, what: assert_attention(got[0], o, vmax, "bf16", what, got[1], l_),
                     threads=(32, 96, 160))


def test_empty_batch():
    case = make_case(91, seq_lens=[3], num_heads=2, num_kv_heads=1, head_size=16, block_size=4)
    args, kw = op_args(case)
    q, bt, sl = args[0][:0], args[3][:0], args[4][:0]
    out, lse = loomnb.paged_decode_attention(q, args[1], args[2], bt, sl, args[5], **kw,
                                             return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)


# ---------------------------------------------------------------- merge_attn_states
def _states(seed, N, H, D, kind, *, lse_inf=None):
    rng = np.random.default_rng(seed)
    dt = NP_DT[kind]
    p, s = (rng.standard_normal((N, H, D)).astype(dt) for _ in range(2))
    pl, sl = (rng.standard_normal((H, N)).astype(np.float32) * 3 for _ in range(2))
    return p, pl, s, sl


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
def test_merge_attn_states(kind):
    p, pl, s, sl = _states(1, 5, 3, 24, kind)
    out, olse = np.empty_like(p), np.empty((3, 5), np.float32)
    with L.force_threads(64):
        assert loomnb.merge_attn_states(out, p, pl, s, sl, olse) is out
    assert_merge(out, olse, p, pl, s, sl, kind, kind)
    out2 = np.empty_like(p)
    loomnb.merge_attn_states(out2, p, pl, s, sl)
    assert_bits(out2, out, "output_lse None")


def test_merge_attn_states_empty_partitions_never_nan():
    """Both LSEs -inf: prefix_output unchanged (bit for bit), LSE -inf; +inf counts as -inf;
    one partition empty: the other one exactly."""
    p, pl, s, sl = _states(2, 4, 2, 16, "bf16")
    pl[0, 0] = sl[0, 0] = -np.inf          # both empty
    pl[1, 1], sl[1, 1] = np.inf, -np.inf  # +inf is -inf: both empty
    sl[0, 2] = -np.inf                    # suffix empty: prefix exactly
    pl[1, 3] = -np.inf                    # prefix empty: suffix exactly
    out, olse = np.empty_like(p), np.empty((2, 4), np.float32)
    loomnb.merge_attn_states(out, p, pl, s, sl, olse)
    assert_merge(out, olse, p, pl, s, sl, "bf16", "empty partitions")
    assert not np.isnan(out.astype(np.float32)).any()
    assert_bits(out[0, 0], p[0, 0], "both -inf")
    assert_bits(out[1, 1], p[1, 1], "+inf and -inf")
    assert np.isneginf(olse[0, 0]) and np.isneginf(olse[1, 1])
    assert_bits(out[2, 0], p[2, 0], "suffix empty -> prefix exactly")
    assert_bits(out[3, 1], s[3, 1], "prefix empty -> suffix exactly")
    assert olse[0, 2] == pl[0, 2] and olse[1, 3] == sl[1, 3]


def test_merge_attn_states_strided_views():
    p, pl, s, sl = _states(3, 3, 4, 16, "f16")
    wide = np.zeros((3, 4, 40), np.float16)
    out = wide[:, :, 8:24]
    plw = np.zeros((4, 5), np.float32)
    plw[:, ::2] = pl
    loomnb.merge_attn_states(out, p[:, ::-1], plw[:, ::2], s, sl)
    assert_merge(out, None, p[:, ::-1], pl, s, sl, "f16", "strided")
    assert (wide[:, :, :8] == 0).all() and (wide[:, :, 24:] == 0).all()


def test_decode_partials_merge_into_the_whole(monkeypatch):
    """decode over [0, a) (seq_len a) and over [a, L) (a window of L - a), merged by
    merge_attn_states with their LSEs, equals decode over [0, L): the two ops' LSE conventions
    agree."""
    case = make_case(5, seq_lens=[14], num_heads=2, num_kv_heads=1, head_size=16, block_size=4,
                     kind="f32")
    pre = dict(case, seq_lens=np.array([9], np.int32))
    o1, l1 = run(pre, return_lse=True)
    o2, l2 = run(case, return_lse=True, sliding_window=5)
    out, olse = np.empty_like(o1), np.empty_like(l1)
    loomnb.merge_attn_states(out, o1, l1, o2, l2, olse)
    o, l_, vmax = exact(case)
    assert_attention(out, o, vmax, "f32", "merged halves", olse, l_)
    want, wl, _ = merge_exact(*exact(pre)[:2], *exact_suffix(case, [5])[:2])
    np.testing.assert_allclose(want, o, atol=1e-12)


# ---------------------------------------------------------------- scaffold additions
@pytest.mark.parametrize("width, stride", [(4, 1), (8, 4), (4, 8), (2, 16)])
def test_strided_group_reductions(width, stride):
    """``group_reduce(..., stride)`` and ``group_reduce_array`` (the simulator twins; the GPU
    shuffles in test_attention_gpu.py)."""
    from test_attention_cases import check_strided_reductions
    check_strided_reductions(width, stride, threads=64)


def test_unpack_e4m3x2_portable_all_pairs():
    """The simulator's (portable) E4M3 pair decoder against ml_dtypes for all 65536 pairs."""
    import ml_dtypes

    from loomnb.layouts.dtypes import unpack_e4m3x2
    codes = np.arange(256, dtype=np.uint8)
    ref = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    for hi in range(0, 256, 17):
        for lo in range(256):
            a, b = unpack_e4m3x2(lo | (hi << 8))
            for got, want in ((a, ref[lo]), (b, ref[hi])):
                assert (np.isnan(got) and np.isnan(want)) or np.float32(got).view(np.uint32) == want.view(np.uint32)


# ---------------------------------------------------------------- check_indices (issue 23)
@pytest.mark.parametrize("window", [None, 6])
def test_check_indices_checks_only_the_blocks_a_sequence_reads(window):
    """check_indices=True on a valid batch whose block tables hold stale garbage past each
    seq_len (-7, 2**30) and, with a sliding window, a bad block before the window: none of
    them is read, none is flagged, and the result is bit-equal to the unchecked call; an
    out-of-range block in a column the sequence reads is refused before the launch."""
    case = make_case(77, seq_lens=[13, 3, 0], num_heads=2, num_kv_heads=1, head_size=16,
                     block_size=4)
    if window:
        case["block_tables"][0, 0] = -5  # tokens 0-3 of a 13-token sequence: outside a window of 6
    opts = {} if window is None else {"sliding_window": window}
    plain = run(case, return_lse=True, **opts)
    checked = run(case, return_lse=True, check_indices=True, **opts)
    for g, w in zip(checked, plain):
        assert_bits(g, w, "checked vs unchecked")
    o, l_, vmax = exact(case, **opts)
    assert_attention(plain[0], o, vmax, "bf16", "vs the oracle", plain[1], l_)
    bt = case["block_tables"].copy()
    bt[0, 2] = case["key_cache"].shape[0]  # block 2 holds tokens 8-11: read in both cases
    case["block_tables"] = bt
    with pytest.raises(loomnb.LoomnbValueError, match=r"'block_tables' must be in \[0, \d+\] .*"
                       r"\(check_indices=True\); got \d+ at index \[0, 2\]"):
        run(case, check_indices=True, **opts)


def test_check_indices_seq_len_at_the_table_capacity_is_valid():
    """seq_len = max_blocks * block_size (every column read) passes; one more is flagged
    (unchecked, the kernel clamps it)."""
    case = make_case(78, seq_lens=[8], num_heads=1, num_kv_heads=1, head_size=16, block_size=4,
                     extra_cols=0)
    assert case["block_tables"].shape == (1, 2)
    run(case, check_indices=True)
    case["seq_lens"] = np.array([9], np.int32)
    run(case)
    with pytest.raises(loomnb.LoomnbValueError, match=r"'seq_lens' must be in \[0, 8\]"):
        run(case, check_indices=True)
