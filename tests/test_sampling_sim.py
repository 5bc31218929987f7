"""Sampling-family kernels under numba's CUDA simulator against the oracles (the family template
of ``tests/family.py``).

Tiny rows (the simulator runs one Python thread per CUDA thread, and every barrier is slow):
vocabularies that do (64: 16-byte units) and do not (37) take the vector layout, one and several
blocks per row (``force_splits``: the last-block-done merge), both samplers, fp32 and bf16,
the NaN/inf policy with explicit values, V1's merged-logprob ties (the recount pass), Min-P's
boundaries, and a block-size sweep.
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb import _adapter as ad
from loomnb.ops import _launch as L
from loomnb.ops import _workspace as W
from loomnb.ops import sampling as S

from family import assert_bits, out_given_and_not
from helpers import assert_ulps
from tolerances import ulps

# NaN/inf rows compute inf - inf on purpose (NumPy warns in the simulator; the GPU does not)
pytestmark = [pytest.mark.sim, pytest.mark.filterwarnings("ignore::RuntimeWarning")]
BF16 = ml_dtypes.bfloat16
NP = {"f32": np.float32, "bf16": BF16}
INF = np.float32(np.inf)


def logits(rng, rows, vocab, kind="f32", scale=3.0):
    return (rng.standard_normal((rows, vocab)) * scale).astype(NP[kind])


def run(splits, threads, fn):
    with S.force_splits(splits), L.force_threads(threads):
        return fn()


def compare(got, want, what):
    """Token ids, indices and ranks exactly; logprobs within the table's ulp budget."""
    for g, w in zip(got, want):
        if np.asarray(w).dtype == np.float32:
            assert_ulps(g, w, ulps("sampling_logprob", "f32"), what)
        else:
            assert_bits(g, w, what)


# ---------------------------------------------------------------- the issue's cases
@pytest.mark.parametrize("sampler", ["v1", "v2"])
def test_issue_case_2_2_1(sampler):
    """logits [2, 2, 1]: token 0, logprob -0.861995, rank 2 under both samplers."""
    x = np.array([[2, 2, 1]], np.float32)
    tok, lp, rank = loomnb.greedy_sample_logprob(x, sampler)
    assert tok.tolist() == [0] and rank.tolist() == [2]
    assert abs(float(lp[0]) - (-0.861995)) < 5e-7
    compare((tok, lp, rank), loomnb.oracle.greedy_sample_logprob(x, sampler), sampler)


# ---------------------------------------------------------------- against the oracle
@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("sampler", ["v1", "v2"])
@pytest.mark.parametrize("rows, vocab, splits", [(1, 37, 1), (3, 64, 3)])
def test_greedy_sample_logprob(kind, sampler, rows, vocab, splits):
    rng = np.random.default_rng(vocab + rows)
    x = logits(rng, rows, vocab, kind)
    x[-1, 5] = x[-1, 40 % vocab] = np.float32(x[-1].astype(np.float32).max() + 1)  # a tie at the max
    got = run(splits, 32, lambda: loomnb.greedy_sample_logprob(x, sampler))
    want = loomnb.oracle.greedy_sample_logprob(x, sampler)
    compare(got, want, f"{kind} {sampler}")
    assert got[2][-1] == 2 and got[0][-1] == min(5, 40 % vocab), "tie at the max: lowest index, rank 2"


@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("sampler", ["v1", "v2"])
def test_selected_token_logprob_rank(kind, sampler):
    rng = np.random.default_rng(7)
    x = logits(rng, 4, 64, kind)
    x[2, 9] = -np.inf
    t = np.array([3, 63, 9, 70], np.int64)  # row 2: a -inf token; row 3: out of range
    got = run(3, 32, lambda: loomnb.selected_token_logprob_rank(x, t, sampler))
    want = loomnb.oracle.selected_token_logprob_rank(x, t, sampler)
    compare(got, want, f"{kind} {sampler}")
    lp, rank = got
    assert lp[2] == -np.inf and rank[2] == (64 if sampler == "v1" else 8192), "-inf token"
    assert np.isnan(lp[3]) and rank[3] == 0, "out-of-range id: NaN and rank 0"


@pytest.mark.parametrize("k, given, splits, sampler",
                         [(0, False, 1, "v1"), (3, True, 2, "v2"), (20, False, 3, "v1")])
def test_top_k_logprobs(k, given, splits, sampler):
    rng = np.random.default_rng(k)
    x = logits(rng, 2, 64)
    x[0, [4, 9, 30, 50]] = 50.0  # four-way tie at the top: columns in index order
    x[1, 11] = np.nan            # NaN first, all logprobs NaN
    t = np.array([30, 2], np.int64) if given else None
    got = run(splits, 32, lambda: loomnb.top_k_logprobs(x, k, t, sampler))
    want = loomnb.oracle.top_k_logprobs(x, k, t, sampler)
    compare(got, want, f"k={k}")
    ix, lp, rank = got
    assert ix.dtype == np.int32 and ix.shape == (2, k + 1) and lp.shape == (2, k + 1)
    if k >= 3:
        assert ix[0, 1:4].tolist() == [4, 9, 30] and ix[1, 1] == 11
    if given:
        assert ix[:, 0].tolist() == [30, 2]
        assert rank[0] == (4 if sampler == "v1" else 4)  # ties count against the token
    assert np.isnan(lp[1]).all()


# ---------------------------------------------------------------- NaN and infinities
@pytest.mark.parametrize("sampler", ["v1", "v2"])
def test_nan_and_inf_policy(sampler):
    """vLLM's values (docs/numerics.md): a NaN row, a +inf row, an all -inf row, a normal row."""
    V = 16
    x = np.linspace(-3, 3, 4 * V, dtype=np.float32).reshape(4, V)
    x[0, 6] = x[0, 9] = np.nan
    x[1, 3] = x[1, 12] = INF
    x[2] = -INF
    got = run(2, 32, lambda: loomnb.greedy_sample_logprob(x, sampler))
    compare(got, loomnb.oracle.greedy_sample_logprob(x, sampler), sampler)
    tok, lp, rank = got
    assert tok.tolist() == [6, 3, 0, V - 1]
    assert np.isnan(lp[:3]).all() and np.isfinite(lp[3])
    assert rank.tolist() == ([0, 0, 0, 1] if sampler == "v1" else [0, 2, 8192, 1])


def test_selected_token_nan_cases():
    """A NaN elsewhere: V1 logprob NaN and rank 0 (every logprob is NaN); V2 counts raw logits
    (NaN never counts). A NaN token: rank 0 under both."""
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    x[0, 0] = np.nan
    x[1, 5] = np.nan
    t = np.array([10, 5], np.int64)
    for sampler, want in (("v1", [0, 0]), ("v2", [6, 0])):
        lp, rank = run(2, 32, lambda: loomnb.selected_token_logprob_rank(x, t, sampler))
        assert rank.tolist() == want and np.isnan(lp).all(), sampler
        compare((lp, rank), loomnb.oracle.selected_token_logprob_rank(x, t, sampler), sampler)


# ---------------------------------------------------------------- V1's merged ties
def test_v1_counts_logits_whose_logprobs_round_equal():
    """Distinct logits within half an ulp of L of the maximum have the maximum's fp32 logprob:
    V1 counts them as ties (the recount pass), V2 does not. The near-equal values sit in other
    blocks than the maximum."""
    m = np.float32(2.0 ** -10)
    d = np.float32(2.0 ** -33)  # the spacing of floats near m
    x = np.full((2, 64), -30.0, np.float32)
    x[0, 60], x[0, 5] = m, m - d          # two values, one merged tie
    x[1, 60], x[1, 5], x[1, 30] = m, m - d, m - 2 * d
    tok, lp, rank = run(3, 32, lambda: loomnb.greedy_sample_logprob(x, "v1"))
    assert tok.tolist() == [60, 60] and rank.tolist() == [2, 3]
    compare((tok, lp, rank), loomnb.oracle.greedy_sample_logprob(x, "v1"), "v1")
    assert run(3, 32, lambda: loomnb.greedy_sample_logprob(x, "v2"))[2].tolist() == [1, 1]
    t = np.array([5, 5], np.int64)  # m - d: V1 also counts m - 2d (merged), V2 does not
    lp, rank = run(2, 32, lambda: loomnb.selected_token_logprob_rank(x, t, "v1"))
    assert rank.tolist() == [2, 3]
    assert run(2, 32, lambda: loomnb.selected_token_logprob_rank(x, t, "v2"))[1].tolist() == [2, 2]


# ---------------------------------------------------------------- Min-P
@pytest.mark.parametrize("sampler", ["v1", "v2"])
@pytest.mark.parametrize("splits, vocab", [(1, 37), (3, 64), (1, 1104), (2, 1104)])
def test_min_p_filter(sampler, splits, vocab):
    """(1, 1104): 276 units of 4 over 32 threads, 4 units a thread in flight, the last round
    partial; the maximum sits in it (row 0), past a NaN (row 3)."""
    rng = np.random.default_rng(vocab)
    x = logits(rng, 4, vocab, scale=2.0)
    x[1, 7] = -np.inf
    if vocab > 1000:
        x[0, vocab - 3] = 9.0
        x[3, 5] = np.nan
    mp = np.array([0.05, 0.2, 0.0, 1.0], np.float32)
    got, want = x.copy(), x.copy()
    out = run(splits, 32, lambda: loomnb.min_p_filter_(got, mp, sampler))
    assert out is got
    loomnb.oracle.min_p_filter_(want, mp, sampler)
    kept = got != -np.inf
    assert_bits(got[kept], x[kept], "unmasked logits are untouched")
    if sampler == "v2":
        assert_bits(got, want, "v2 is a compare against r32(m + r32(log(min_p))): exact")
    else:  # expf on the GPU (2 ulp): only elements at the threshold may differ
        from loomnb.oracle.sampling import min_p_mask
        mask, p, thr = min_p_mask(x, mp, "v1")
        near = np.abs(p.astype(np.float64) - thr[:, None]) <= 4 * np.spacing(thr[:, None])
        assert not ((got == -np.inf) != mask)[~near].any()
    assert_bits(got[2], x[2], "min_p = 0: row untouched")
    assert (got[:, :] != -np.inf).any(axis=1).all(), "the maximum always survives"


@pytest.mark.parametrize("sampler", ["v1", "v2"])
def test_min_p_edges(sampler):
    """min_p = 0 masks nothing (-inf stays -inf, finite logits stay as they were); min_p = 1
    with all-equal probabilities keeps every token; NaN and +inf rows as documented."""
    x = np.zeros((4, 16), np.float32)
    x[0] = np.linspace(-5, 5, 16)
    x[0, 3] = -np.inf
    x[1] = 0.75                     # all equal
    x[2] = np.linspace(-1, 1, 16)
    x[2, 4] = np.nan
    x[3] = np.linspace(-1, 1, 16)
    x[3, 8] = np.inf
    mp = np.array([0.0, 1.0, 0.5, 0.5], np.float32)
    got = x.copy()
    run(2, 32, lambda: loomnb.min_p_filter_(got, mp, sampler))
    assert_bits(got[0], x[0], "min_p = 0")
    assert_bits(got[1], x[1], "min_p = 1, all equal")
    if sampler == "v1":  # NaN probabilities: nothing masked
        assert_bits(got[2:], x[2:], "NaN / +inf rows untouched (v1)")
    else:
        assert np.isnan(got[2, 4]) and (got[2, :4] == -np.inf).all() and got[2, 15] == 1
        assert got[3, 8] == np.inf and (np.delete(got[3], 8) == -np.inf).all()
    want = x.copy()
    loomnb.oracle.min_p_filter_(want, mp, sampler)
    assert_bits(got, want, "oracle")


# ---------------------------------------------------------------- launch independence, outputs
def test_block_size_and_split_sweep_give_identical_bits():
    """Correctness must not depend on the launch configuration; the float64 sum makes the
    logprobs independent of it too."""
    rng = np.random.default_rng(3)
    x = logits(rng, 2, 64)
    ref = loomnb.oracle.greedy_sample_logprob(x, "v1")
    runs = [run(s, t, lambda: loomnb.greedy_sample_logprob(x, "v1")) for s, t in ((1, 64), (4, 32))]
    for got in runs:
        compare(got, ref, "sweep")
        for g, h in zip(got, runs[0]):
            assert_bits(g, h, "identical across configurations")


def test_outputs_given_empty_batch_and_counters_reset():
    rng = np.random.default_rng(4)
    x = logits(rng, 2, 37)
    out_given_and_not(lambda out: run(2, 32, lambda: loomnb.greedy_sample_logprob(x, "v2", logprobs=out)[1]),
                      lambda: np.full(2, 7, np.float32))
    empty = np.zeros((0, 37), np.float32)
    tok, lp, rank = loomnb.greedy_sample_logprob(empty)
    assert tok.shape == lp.shape == rank.shape == (0,)
    loomnb.min_p_filter_(empty, np.zeros(0, np.float32))
    ws = S._workspace(ad.wrap("test", "logits", x), None, 0)
    assert not ws.counters.any(), "the last block of each row leaves its counter at 0"
    before = x.copy()
    run(3, 32, lambda: loomnb.top_k_logprobs(x, 2))
    assert_bits(x, before, "logits are not modified")


@pytest.mark.parametrize("sampler", ["v1", "v2"])
def test_min_p_outside_zero_one_is_applied_whole_or_not_at_all(sampler):
    """The issue's case: a negative min_p (-0.5, -1e-30, -inf) or NaN masks nothing in either
    sampler -- V2's log(min_p) is NaN there, which the simulator's math.log used to raise on
    after row 0 was masked -- and min_p > 1 or +inf masks everything but nothing below the
    maximum survives; every row is written or not as a whole, as the oracle."""
    rng = np.random.default_rng(3)
    x = logits(rng, 8, 37)
    mp = np.array([0.3, -0.5, 0.2, -1e-30, -np.inf, np.nan, 2.0, np.inf], np.float32)
    got = x.copy()
    run(2, 32, lambda: loomnb.min_p_filter_(got, mp, sampler))
    want = x.copy()
    loomnb.oracle.min_p_filter_(want, mp, sampler)
    assert_bits(got, want, "oracle")
    for r in (1, 3, 4, 5):
        assert_bits(got[r], x[r], f"min_p = {mp[r]} masks nothing")
    assert (got[0] == -np.inf).any() and (got[2] == -np.inf).any(), "rows 0 and 2 were masked"


def test_min_p_rows_past_the_workspace_records(monkeypatch):
    """Min-P writes a record for every block, one a row when rows are many: more rows than the
    workspace's records get a larger workspace (the old one kept alive for captured graphs),
    not writes past its end -- on the GPU those landed in the split counters and broke the
    next split launch's rows (``MAX_RECORDS`` shrunk to 4 here: the simulator bounds-checks)."""
    monkeypatch.setattr(S, "MAX_RECORDS", 4)
    monkeypatch.setattr(W, "_buffers", {})
    monkeypatch.setattr(W, "_retired", [])
    rng = np.random.default_rng(3)
    for rows in (2, 7):
        x = logits(rng, rows, 16)
        mp = np.full(rows, 0.2, np.float32)
        got, want = x.copy(), x.copy()
        run(None, 32, lambda: loomnb.min_p_filter_(got, mp, "v2"))
        loomnb.oracle.min_p_filter_(want, mp, "v2")
        assert_bits(got, want, f"{rows} rows")
    ws = S._workspace(ad.wrap("test", "logits", x), None, 0)
    assert ws.f.shape[0] == ws.i.shape[0] == 8, "grown once, to a power of two"
    assert [k[0] for k, _ in W._retired] == ["sampling.f", "sampling.i"], "the first set kept"
    assert not ws.counters.any()
