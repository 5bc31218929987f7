"""The oracle of ``chain_speculative_sampling`` (``loomnb/oracle/sampler.py``), the truth the
kernel is tested on, checked against the laws it must obey:

* the rejection-sampling theorem: whatever the draft distribution ``q``, the token emitted at
  position 0 (an accepted draft or the residual's draw) is distributed as the target ``p_0``
  (chi-square over 200,000 requests at a small vocabulary, p > 0.01), and so is the token at
  position 1 among the requests that reach it; the same check rejects the draft tokens
  themselves (``q != p``), so it can fail;
* the counts: the accepted count's mean is ``sum_j sum_t min(p_j(t), q_j(t))`` (each position
  verified on its own), the emitted count's ``a_0 + a_0 a_1`` for two positions;
* one-hot drafts (``draft_probs=None``): accepted with probability ``p(d)``, the output still
  distributed as ``p``;
* the rule's edges, the random streams' layout, and the accumulators.
"""

import numpy as np
import pytest

from loomnb.oracle import sampler as O
from test_sampler_oracle import assert_distribution

N_REQ = 200_000
P0 = np.array([0.30, 0.05, 0.25, 0.0, 0.15, 0.25], np.float32)
Q0 = np.array([0.10, 0.40, 0.10, 0.20, 0.20, 0.00], np.float32)
P1 = np.array([0.05, 0.35, 0.10, 0.20, 0.20, 0.10], np.float32)
Q1 = np.array([0.30, 0.10, 0.30, 0.10, 0.10, 0.10], np.float32)
BONUS = np.array([0.1, 0.2, 0.3, 0.4, 0.0, 0.0], np.float32)
V = len(P0)


def batch(n_req=N_REQ, seed=0, draft=True):
    """``n_req`` requests of two draft positions: drafts drawn from ``Q0``/``Q1`` (NumPy's
    generator), every request the same distributions."""
    rng = np.random.default_rng(seed)
    q = np.stack([Q0, Q1]).astype(np.float64)
    d = np.stack([rng.choice(V, n_req, p=q[j] / q[j].sum()) for j in range(2)], 1).astype(np.int32)
    tp = np.broadcast_to(np.stack([P0, P1, BONUS]), (n_req, 3, V)).copy()
    dp = np.broadcast_to(np.stack([Q0, Q1]), (n_req, 2, V)).copy() if draft else None
    return dp, d, tp


def test_position_0_is_distributed_as_the_target():
    dp, d, tp = batch()
    out, acc, emi = O.chain_speculative_sampling(dp, d, tp, seed=1234, offset=5)
    assert_distribution(out[:, 0], P0.astype(np.float64), "position 0")
    reached = emi >= 1
    assert_distribution(out[reached, 1], P1.astype(np.float64), "position 1, draft 0 accepted")
    both = emi == 2
    assert_distribution(out[both, 2], BONUS.astype(np.float64), "the bonus token")


def test_the_chi_square_check_can_fail():
    dp, d, tp = batch()
    with pytest.raises(AssertionError, match="chi-square|outside"):
        assert_distribution(d[:, 0], P0.astype(np.float64), "the drafts are not the target")
    # and a slightly wrong target: the emitted tokens against p_0 tilted by 5 %
    out, _, _ = O.chain_speculative_sampling(dp, d, tp, seed=1234, offset=5)
    tilt = P0.astype(np.float64) * np.array([1.05, 1, 1, 1, 1, 0.95])
    with pytest.raises(AssertionError, match="chi-square"):
        assert_distribution(out[:, 0], tilt / tilt.sum(), "p_0 tilted")


def _mean_within(x, mean, what, z=5.0):
    se = x.std() / np.sqrt(len(x))
    assert abs(x.mean() - mean) < z * se + 1e-12, f"{what}: mean {x.mean():.5f}, want {mean:.5f}"


def test_count_expectations():
    dp, d, tp = batch()
    out, acc, emi = O.chain_speculative_sampling(dp, d, tp, seed=99)
    a0 = float(np.minimum(P0, Q0).astype(np.float64).sum())
    a1 = float(np.minimum(P1, Q1).astype(np.float64).sum())
    _mean_within(acc.astype(np.float64), a0 + a1, "accepted (each position on its own)")
    _mean_within(emi.astype(np.float64), a0 + a0 * a1, "emitted (the chain stops at a rejection)")
    assert np.all(acc >= emi) and np.all((out >= 0).sum(1) == emi + 1)


def test_one_hot_drafts():
    """n-gram drafts: ``q = e_d``, accepted with probability ``p(d)``, else a draw from ``p``
    without ``d``: position 0 is still distributed as ``p_0``."""
    _, d, tp = batch(draft=False)
    out, acc, emi = O.chain_speculative_sampling(None, d, tp, seed=7, offset=1)
    assert_distribution(out[:, 0], P0.astype(np.float64), "one-hot drafts, position 0")
    rej = emi == 0
    assert np.all(out[rej, 0] != d[rej, 0]), "a rejected one-hot draft is never redrawn"
    mean = P0[d[:, 0]].astype(np.float64) + P1[d[:, 1]].astype(np.float64)
    _mean_within(acc.astype(np.float64) - mean, 0.0, "accepted = sum_j p_j(d_j)")


def test_rule_edges():
    """All accepted -> the bonus token; q(d) = 0 accepts where p(d) > 0; an id outside the
    vocabulary is rejected; an empty residual draws from p; p without mass: its argmax."""
    n, Vs = 3, 8
    tp = np.full((5, n + 1, Vs), 1 / Vs, np.float32)
    dp = np.full((5, n, Vs), 1 / Vs, np.float32)
    d = np.array([[1, 2, 3], [0, 1, 2], [Vs, 1, 2], [-1, 1, 2], [4, 4, 4]], np.int32)
    dp[0] = 0  # q(d) = 0 everywhere: always accepted (u * 0 < p(d))
    tp[0, n] = 0
    tp[0, n, 6] = 1  # the bonus: token 6 surely
    dp[1, 0] = tp[1, 0]
    dp[1, 0, 0] = 1.0  # q(0) = 1 > p(0): rejected when u > p(0) / q(0); residual empty -> from p
    tp[4, 0] = 0  # p with no mass at position 0: rejected, residual empty, p empty: argmax 0
    out, acc, emi = O.chain_speculative_sampling(dp, d, tp, seed=3)
    assert out[0].tolist() == [1, 2, 3, 6] and acc[0] == 3 and emi[0] == 3
    assert emi[2] == 0 and emi[3] == 0, "ids outside [0, V) are rejected"
    assert 0 <= out[2, 0] < Vs and out[2, 1:].tolist() == [-1] * n
    assert out[4].tolist() == [0, -1, -1, -1] and emi[4] == 0
    # the empty residual of request 1 draws from p (uniform): over many seeds every token comes
    many = [O.chain_speculative_sampling(dp[1:2], d[1:2], tp[1:2], seed=s)[0][0, 0]
            for s in range(400)]
    assert set(many) == set(range(Vs))


def test_streams_are_distinct():
    """The acceptance uniforms (stream 1) and each position's Gumbel stream (2 + j) are
    different words, and none equals the row kernel's stream 0 for the same seed."""
    s, o, salt = np.array([5]), np.array([0]), np.array([0])
    w = [O.stream_words(64, k, s, o, salt)[0] for k in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not np.array_equal(w[a], w[b])
    i = np.arange(64, dtype=np.uint64)
    words = O.philox(i >> np.uint64(2), 0, 0, 0, 5, 0)
    assert np.array_equal(w[0], np.choose((i & np.uint64(3)).astype(np.int64), words)), \
        "stream 0 is the row kernel's counter"


def test_per_request_seeds_do_not_depend_on_the_batch_order():
    dp, d, tp = batch(64, seed=3)
    seeds = np.arange(1000, 1064, dtype=np.int64)
    want = O.chain_speculative_sampling(dp, d, tp, seed=seeds, offset=9)
    perm = np.random.default_rng(0).permutation(64)
    got = O.chain_speculative_sampling(dp[perm], d[perm], tp[perm], seed=seeds[perm], offset=9)
    for g, w in zip(got, want):
        assert np.array_equal(g, w[perm])
    other = O.chain_speculative_sampling(dp, d, tp, seed=seeds, offset=10)
    assert not np.array_equal(other[0], want[0]), "another offset: other draws"


def test_accumulators_are_added_to_in_place():
    dp, d, tp = batch(16, seed=4)
    acc0 = np.arange(16, dtype=np.int32)
    emi0 = np.full(16, 2 ** 31 - 1, np.int32)  # wraps, as int32 does
    acc, emi = acc0.copy(), emi0.copy()
    out, a, e = O.chain_speculative_sampling(dp, d, tp, acc, emi, seed=8)
    _, a_new, e_new = O.chain_speculative_sampling(dp, d, tp, seed=8)
    assert a is acc and e is emi
    assert np.array_equal(acc, acc0 + a_new)
    assert np.array_equal(emi, (emi0.astype(np.int64) + e_new).astype(np.int32))
