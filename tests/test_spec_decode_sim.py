"""Speculative-verification kernels under numba's CUDA simulator against the oracles (the family
template of ``tests/family.py``).

Ragged batches (draft counts 0..max_spec_len mixed) at batches 1, 8, 32, 128 and 256 for
``rejection_greedy_sample``, and at the small batches for ``greedy_verify`` (its argmax launches
one simulated block per draft row; ``tests/test_spec_decode_gpu.py`` runs every batch size on
the GPU); the issue's placeholder case and its whole kind (placeholder and out-of-range drafts
anywhere, requests with no drafts, impossible ``cu`` rows); the argmax's tie, NaN and signed-zero
rules across split chunks; every logits dtype, the vector and scalar paths and strided
``[num_reqs, k, V]`` views; ``out`` given or not; and a sweep of the block size (groups per
block, rounds of the fused form).
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb.ops import _launch as L
from loomnb.ops import spec_decode as S

from family import assert_bits, call_both, out_given_and_not
from test_spec_decode_oracle import RAGGED, make_batch, ragged_counts, vllm_rule

pytestmark = pytest.mark.sim
LOGITS_DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
UNFUSED = ("draft_token_ids", "cu_num_draft_tokens", "target_argmax", "bonus_token_ids", "max_spec_len")
FUSED = ("draft_token_ids", "cu_num_draft_tokens", "target_logits", "bonus_token_ids", "max_spec_len")


def _args(b, names):
    return tuple(b[n] for n in names)


def _check_fused(b, what, **kw):
    got, want, after, _ = call_both("greedy_verify", *_args(b, FUSED), **kw)
    for g, w, name in zip(got, want, ("output_token_ids", "num_emitted", "emitted_token_ids",
                                      "cu_num_emitted")):
        assert g.dtype == np.int32, name
        assert_bits(g, w, f"{what}: {name}")
    for a, x in zip(after, _args(b, FUSED)):
        if isinstance(x, np.ndarray):
            assert_bits(a, x, f"{what}: inputs are not modified")
    return got


# ---------------------------------------------------------------- the case, whole kind
def test_case_placeholder_draft():
    """Drafts [5, 9, -1] with target argmax [5, 9, 7] give [5, 9, 7]: a -1 draft is a mismatch."""
    d, cu, bonus = np.array([5, 9, -1], np.int32), np.array([3], np.int32), np.array([[4]], np.int32)
    out = loomnb.rejection_greedy_sample(d, cu, np.array([5, 9, 7], np.int64), bonus, 3)
    assert out.tolist() == [[5, 9, 7, -1]]
    logits = np.zeros((3, 12), np.float32)
    logits[[0, 1, 2], [5, 9, 7]] = 1.0
    rows, num, emitted, cu_out = loomnb.greedy_verify(d, cu, logits, bonus, 3)
    assert rows.tolist() == [[5, 9, 7, -1]] and num.tolist() == [3]
    assert emitted.tolist() == [5, 9, 7, -1] and cu_out.tolist() == [0, 3]


@pytest.mark.parametrize("bad", [-1, -7, -(2 ** 31), 12, 2 ** 31 - 1])
@pytest.mark.parametrize("where", [0, 1, 3])
def test_placeholder_and_out_of_range_drafts_anywhere(bad, where):
    """A negative or >= V draft at any position is a mismatch there (the target is emitted, then
    nothing); the fused form never indexes the logits with it (V = 12)."""
    rng = np.random.default_rng(where)
    logits = rng.standard_normal((4, 12)).astype(np.float32)
    target = loomnb.oracle.spec_decode.target_argmax(logits)
    d = target.astype(np.int32)
    d[where] = bad
    cu, bonus = np.array([4], np.int32), np.array([[3]], np.int32)
    want = [int(t) for t in target[:where + 1]] + [-1] * (4 - where)
    assert loomnb.rejection_greedy_sample(d, cu, target, bonus, 4).tolist() == [want]
    rows, num, emitted, _ = loomnb.greedy_verify(d, cu, logits, bonus, 4)
    assert rows.tolist() == [want] and num.tolist() == [where + 1]
    assert emitted[:where + 1].tolist() == want[:where + 1]


def test_all_placeholder_requests_and_requests_without_drafts():
    """A request of only -1 drafts emits its first target; one with no drafts its bonus only."""
    d = np.array([-1, -1, -1, 4, 4], np.int32)
    cu = np.array([3, 3, 5, 5], np.int32)
    target = np.array([2, 2, 2, 4, 4], np.int64)
    bonus = np.array([[9], [8], [7], [6]], np.int32)
    out = loomnb.rejection_greedy_sample(d, cu, target, bonus, 3)
    assert out.tolist() == [[2, -1, -1, -1], [8, -1, -1, -1], [4, 4, 7, -1], [6, -1, -1, -1]]
    np.testing.assert_array_equal(out, loomnb.oracle.rejection_greedy_sample(d, cu, target, bonus, 3))


def test_equal_negative_ids_are_rejected_unlike_vllm():
    """The one documented difference from vLLM: draft -1 == target -1 is still a mismatch."""
    args = (np.array([-1, 3], np.int32), np.array([2], np.int32), np.array([-1, 3], np.int32),
            np.array([[8]], np.int32), 2)
    assert loomnb.rejection_greedy_sample(*args).tolist() == [[-1, -1, -1]]
    assert vllm_rule(*args).tolist() == [[-1, 3, 8]]


def test_int64_targets_are_compared_as_int64_and_stored_as_int32():
    """target 2**32 + 5 against draft 5: a mismatch (int64 compare), stored as 5 (low bits)."""
    d = np.array([5, 6], np.int32)
    t = np.array([2 ** 32 + 5, 6], np.int64)
    got = loomnb.rejection_greedy_sample(d, np.array([2], np.int32), t, np.array([[1]], np.int32), 2)
    assert got.tolist() == [[5, -1, -1]]
    assert got.tolist() == loomnb.oracle.rejection_greedy_sample(d, np.array([2], np.int32), t,
                                                                 np.array([[1]], np.int32), 2).tolist()


@pytest.mark.parametrize("draft_kind, bonus_kind", [(np.int64, np.int64), (np.int32, np.int64),
                                                     (np.int64, np.int32)])
def test_int64_draft_and_bonus_ids_like_vllm(draft_kind, bonus_kind):
    """vLLM's sampler takes token ids of any integer dtype (its tests pass int64): int32 or
    int64 drafts and bonus ids, in both ops, give the oracle's bits and the int32 ids' result."""
    rng = np.random.default_rng(64)
    b = make_batch(rng, [3, 0, 2, 1], 3, 40)
    want_rows = loomnb.rejection_greedy_sample(*_args(b, UNFUSED))
    want_fused = loomnb.greedy_verify(*_args(b, FUSED))
    b["draft_token_ids"] = b["draft_token_ids"].astype(draft_kind)
    b["bonus_token_ids"] = b["bonus_token_ids"].astype(bonus_kind)
    got, want, _, _ = call_both("rejection_greedy_sample", *_args(b, UNFUSED))
    assert_bits(got, want, "rejection_greedy_sample vs oracle")
    assert_bits(got, want_rows, "rejection_greedy_sample vs int32 ids")
    got = _check_fused(b, "greedy_verify")
    for g, w in zip(got, want_fused):
        assert_bits(g, w, "greedy_verify vs int32 ids")


def test_int64_ids_are_compared_as_int64_and_the_bonus_stored_as_int32():
    """A draft 2**32 + 5 against target 5: a mismatch (compared as int64, not by its low 32
    bits); a bonus 2**32 + 9 stored as 9 (the low 32 bits, as the targets and vLLM's int32
    store: 2**33 - 1 becomes -1); the oracle agrees."""
    cu, bonus = np.array([2, 3], np.int32), np.array([[2 ** 32 + 9], [2 ** 33 - 1]], np.int64)
    for d in (np.array([5, 6, 3], np.int64), np.array([2 ** 32 + 5, 6, 3], np.int64)):
        t = np.array([5, 6, 3], np.int64)
        got = loomnb.rejection_greedy_sample(d, cu, t, bonus, 2)
        want = [[5, 6, 9], [3, -1, -1]] if d[0] == 5 else [[5, -1, -1], [3, -1, -1]]
        assert got.tolist() == want
        assert_bits(got, loomnb.oracle.rejection_greedy_sample(d, cu, t, bonus, 2), str(d))


def test_impossible_cu_rows_are_all_placeholder():
    """cu values are device data (unchecked): impossible rows read nothing and stay -1."""
    d = np.array([1, 2, 3, 4], np.int32)
    t = d.astype(np.int64)
    bonus = np.array([[7], [8], [9], [6]], np.int32)
    for cu in ([3, 1, 4, 9], [2, 2, 4, -1], [-5, 2, 4, 4]):
        cu = np.array(cu, np.int32)
        got = loomnb.rejection_greedy_sample(d, cu, t, bonus, 2)
        assert_bits(got, loomnb.oracle.rejection_greedy_sample(d, cu, t, bonus, 2), str(cu))
        logits = np.eye(8, dtype=np.float32)[d]
        g = loomnb.greedy_verify(d, cu, logits, bonus, 2)
        for a, w in zip(g, loomnb.oracle.greedy_verify(d, cu, logits, bonus, 2)):
            assert_bits(a, w, f"greedy_verify {cu}")


# ---------------------------------------------------------------- ragged batches vs the oracle
# batches >= 128 with 64+ drafts: ~6-15 s each here; the GPU test runs them, and
# test_every_group_width covers their 32-lane groups at 3 requests
SIM_RAGGED = [s for s in RAGGED if not (s[0] >= 128 and s[1] >= 64)]


@pytest.mark.parametrize("num_reqs, max_spec_len, pattern", SIM_RAGGED)
def test_rejection_greedy_sample_ragged(num_reqs, max_spec_len, pattern):
    rng = np.random.default_rng(num_reqs * 131 + max_spec_len)
    b = make_batch(rng, ragged_counts(rng, num_reqs, max_spec_len, pattern), max_spec_len, 64)
    # int64 targets (torch.argmax's) and int32 ones on alternate shapes
    target = b["target_argmax"].astype(np.int32 if RAGGED.index(
        (num_reqs, max_spec_len, pattern)) % 2 else np.int64)
    args = _args(b, UNFUSED[:2]) + (target,) + _args(b, UNFUSED[3:])
    got, want, after, _ = call_both("rejection_greedy_sample", *args)
    assert_bits(got, want, f"{num_reqs}x{max_spec_len} {pattern} {target.dtype}")
    assert_bits(got, vllm_rule(*args), "vLLM's loop (all targets are argmaxes)")
    for a, x in zip(after, args):
        if isinstance(x, np.ndarray):
            assert_bits(a, x, "inputs are not modified")


FUSED_RAGGED = [s for s in RAGGED if s[0] <= 8 and s[1] < 128] + [(32, 3, "zeros"), (32, 4, "uniform")]


@pytest.mark.parametrize("num_reqs, max_spec_len, pattern", FUSED_RAGGED)
def test_greedy_verify_ragged(num_reqs, max_spec_len, pattern):
    rng = np.random.default_rng(num_reqs * 7 + max_spec_len)
    b = make_batch(rng, ragged_counts(rng, num_reqs, max_spec_len, pattern), max_spec_len, 24)
    rows, num, *_ = _check_fused(b, f"{num_reqs}x{max_spec_len} {pattern}")
    assert_bits(rows, vllm_rule(*_args(b, UNFUSED)), "rows equal vLLM's rule on the argmax")
    counts = np.diff(np.concatenate([[0], b["cu_num_draft_tokens"]]))
    assert ((num >= 1) & (num <= counts + 1)).all()


def test_greedy_verify_longest_drafts():
    """max_spec_len 128 (32 lanes, 5 column steps, 129 columns) with 37 drafts accepted."""
    rng = np.random.default_rng(128)
    b = make_batch(rng, [0, 37, 5], 128, 24, accept=1.0)
    rows, num, *_ = _check_fused(b, "max_spec_len 128")
    assert num.tolist() == [1, 38, 6] and rows[1, 37] == b["bonus_token_ids"][1, 0]


@pytest.mark.parametrize("kind", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("vocab", [24, 19])  # 24: 16-byte loads; 19: the scalar path
def test_greedy_verify_dtypes_and_layouts(kind, vocab):
    rng = np.random.default_rng(vocab)
    b = make_batch(rng, [2, 0, 3, 1], 3, vocab, logits_dtype=LOGITS_DTYPES[kind])
    _check_fused(b, f"{kind} V={vocab}")
    _check_fused(b, f"{kind} V={vocab} vocab_size", vocab_size=vocab - 5)


def test_greedy_verify_on_strided_draft_rows_of_a_verification_pass():
    """``logits.view(R, k + 1, V)[:, :k]``: the draft rows of k+1 positions per request, no copy
    (two leading dimensions that do not merge)."""
    rng = np.random.default_rng(5)
    R, k, V = 3, 4, 32
    full = rng.standard_normal((R * (k + 1), V)).astype(np.float32)
    view = full.reshape(R, k + 1, V)[:, :k]
    target = loomnb.oracle.spec_decode.target_argmax(view)
    drafts = target.astype(np.int32)
    drafts[[2, 5, 11]] = [-1, (target[5] + 1) % V, -1]
    cu = np.array([4, 8, 12], np.int32)
    bonus = full.reshape(R, k + 1, V)[:, k].argmax(-1).astype(np.int32).reshape(R, 1)
    got = loomnb.greedy_verify(drafts, cu, view, bonus, k)
    want = loomnb.oracle.greedy_verify(drafts, cu, np.ascontiguousarray(view), bonus, k)
    for g, w in zip(got, want):
        assert_bits(g, w, "strided view")
    assert got[0].tolist() == [[*target[:3].tolist(), -1, -1], [*target[4:6].tolist(), -1, -1, -1],
                               [*target[8:12].tolist(), -1]]


# ---------------------------------------------------------------- the argmax's rules
def test_argmax_ties_nan_and_signed_zero_across_split_chunks():
    """V = 1100 fp32 with 32 threads: 3 chunks per row. Ties across chunks go to the lower
    index, a NaN in a later chunk beats everything, -0.0 ties +0.0, an all -inf row gives 0."""
    V = 1100
    with L.force_threads(32):
        assert S.argmax_config(6, V // 4, 32)[1] == 3
        x = np.full((6, V), -3.0, np.float32)
        x[0, [900, 5, 600]] = 2.0             # tie: 5 wins
        x[1, [3, 1000]] = [np.inf, np.nan]    # NaN wins over +inf
        x[2, [700, 1050]] = [np.nan, np.nan]  # first NaN
        x[3, :] = -np.inf                     # all -inf: index 0
        x[4, [520, 10]] = [0.0, -0.0]         # -0.0 == +0.0: 10
        x[5, [1099, 0]] = [1e30, -1e30]       # last element
        target = [5, 1000, 700, 0, 10, 1099]
        assert loomnb.oracle.spec_decode.target_argmax(x).tolist() == target
        d = np.array(target, np.int32)
        cu = np.arange(1, 7, dtype=np.int32)
        rows, *_ = loomnb.greedy_verify(d, cu, x, np.full((6, 1), 2, np.int32), 1)
    assert rows[:, 0].tolist() == target and (rows[:, 1] == 2).all(), "all accepted + bonus"


# ---------------------------------------------------------------- template: out=, sweep, empty
def test_out_given_and_not():
    rng = np.random.default_rng(3)
    b = make_batch(rng, [3, 0, 2], 3, 16)
    out_given_and_not(lambda out: loomnb.rejection_greedy_sample(*_args(b, UNFUSED), out=out),
                      lambda: np.full((3, 4), 77, np.int32))
    bufs = [np.full(s, 77, np.int32) for s in ((3, 4), (3,), (8,), (4,))]
    res = loomnb.greedy_verify(*_args(b, FUSED), output_token_ids=bufs[0], num_emitted=bufs[1],
                               emitted_token_ids=bufs[2], cu_num_emitted=bufs[3])
    assert all(r is buf for r, buf in zip(res, bufs)), "given outputs are returned"
    for g, w in zip(res, loomnb.greedy_verify(*_args(b, FUSED))):
        assert_bits(g, w, "given vs allocated")


def test_strided_outputs_and_inputs():
    rng = np.random.default_rng(4)
    b = make_batch(rng, [2, 3, 1], 3, 16)
    wide = np.full((3, 9), 55, np.int32)
    d2 = np.zeros(12, np.int32)
    d2[::2] = b["draft_token_ids"]
    args = (d2[::2],) + _args(b, UNFUSED[1:])
    loomnb.rejection_greedy_sample(*args, out=wide[:, ::2][:, :4])
    assert_bits(wide[:, ::2][:, :4], loomnb.oracle.rejection_greedy_sample(*_args(b, UNFUSED)),
                "strided out and drafts")
    assert (wide[:, 1::2] == 55).all(), "between the strided columns: untouched"


@pytest.mark.parametrize("threads", [32, 64])
def test_block_size_sweep(threads):
    """Correctness must not depend on the launch configuration: groups per block, blocks, and
    the fused form's rounds over requests (12 requests x 4 lanes in a 32-thread block: 2 rounds;
    the scan of the counts then spans one block of 32 or 64 threads)."""
    rng = np.random.default_rng(threads)
    b = make_batch(rng, ragged_counts(rng, 12, 8, "uniform"), 8, 20)
    want = loomnb.oracle.greedy_verify(*_args(b, FUSED))
    with L.force_threads(threads):
        got = loomnb.greedy_verify(*_args(b, FUSED))
        rows = loomnb.rejection_greedy_sample(*_args(b, UNFUSED))
    for g, w in zip(got, want):
        assert_bits(g, w, f"threads={threads}")
    assert_bits(rows, want[0], f"threads={threads} unfused")


def test_fused_rounds_over_many_requests_in_one_block():
    """40 requests of at most 1 draft in 32 threads (4 lanes each): 5 rounds, then a scan of
    40 counts in two chunks of the 32-thread block."""
    rng = np.random.default_rng(40)
    b = make_batch(rng, ragged_counts(rng, 40, 1, "uniform"), 1, 8)
    want = loomnb.oracle.greedy_verify(*_args(b, FUSED))
    with L.force_threads(32):
        got = loomnb.greedy_verify(*_args(b, FUSED))
    for g, w in zip(got, want):
        assert_bits(g, w, "40 requests, 32 threads")


@pytest.mark.parametrize("max_spec_len", [1, 15, 16, 31, 63, 64, 128])
def test_every_group_width(max_spec_len):
    """The group width follows max_spec_len (4, 8, 16, 32 lanes, up to 5 column steps)."""
    rng = np.random.default_rng(max_spec_len)
    b = make_batch(rng, ragged_counts(rng, 3, max_spec_len, "uniform"), max_spec_len, 16, accept=0.97)
    got = loomnb.rejection_greedy_sample(*_args(b, UNFUSED))
    assert_bits(got, loomnb.oracle.rejection_greedy_sample(*_args(b, UNFUSED)), f"L={max_spec_len}")


def test_empty_batch():
    e = np.zeros(0, np.int32)
    out = loomnb.rejection_greedy_sample(e, e, e.astype(np.int64), np.zeros((0, 1), np.int32), 4)
    assert out.shape == (0, 5) and out.dtype == np.int32
    rows, num, emitted, cu = loomnb.greedy_verify(e, e, np.zeros((0, 8), np.float32),
                                                  np.zeros((0, 1), np.int32), 4)
    assert rows.shape == (0, 5) and num.shape == (0,) and emitted.shape == (0,)
    assert cu.tolist() == [0], "cu_num_emitted of an empty batch is [0]"


def test_no_drafts_at_all():
    """max_spec_len 0 or requests without drafts: each request emits its bonus token only."""
    bonus = np.array([[3], [4]], np.int32)
    e = np.zeros(0, np.int32)
    cu = np.zeros(2, np.int32)
    for spec_len in (0, 2):
        rows = loomnb.rejection_greedy_sample(e, cu, e.astype(np.int64), bonus, spec_len)
        assert rows[:, 0].tolist() == [3, 4] and (rows[:, 1:] == -1).all()
        rows, num, emitted, cu_out = loomnb.greedy_verify(e, cu, np.zeros((0, 5), np.float32), bonus,
                                                          spec_len)
        assert num.tolist() == [1, 1] and emitted.tolist() == [3, 4] and cu_out.tolist() == [0, 1, 2]


def test_vocab_size_filter_drops_ids_in_the_middle():
    """parse_output's filter is per entry: a target >= vocab_size in the middle of a row is
    dropped and the entries after it stay (logits wider than the vocabulary)."""
    logits = np.zeros((3, 10), np.float32)
    logits[[0, 1, 2], [2, 8, 3]] = 1.0
    d = np.array([2, 8, 3], np.int32)
    rows, num, emitted, cu = loomnb.greedy_verify(d, np.array([3], np.int32), logits,
                                                  np.array([[9]], np.int32), 3, 7)
    assert rows.tolist() == [[2, 8, 3, 9]]
    assert num.tolist() == [2] and emitted.tolist() == [2, 3, -1, -1] and cu.tolist() == [0, 2]
