"""The sampler family's oracle against independent references: Random123's Philox known-answer
vectors, a float64 sort-and-cumsum reading of the filters (vLLM's torch path), torch's own
arithmetic for the penalties, and the sampled distribution against the exact renormalised
probabilities (chi-square over many draws)."""

import math

import numpy as np
import pytest

from loomnb.oracle import sampler as O

# Random123 tests/kat_vectors, "philox4x32 10": counter[4], key[2] -> result[4]
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("ctr, key, want", KAT)
def test_philox_known_answers(ctr, key, want):
    got = O.philox(*ctr, *key)
    assert tuple(int(w) for w in got) == want


def test_uniform_is_strictly_inside_the_unit_interval_and_exact():
    w = np.array([0, 1, 511, 512, 0x7FFFFFFF, 0xFFFFFFFF], np.uint32)
    u = O.uniform(w)
    assert u.dtype == np.float32 and (u > 0).all() and (u < 1).all()
    assert u[0] == np.float32(2.0 ** -24) and u[-1] == np.float32(1 - 2.0 ** -24)
    assert u[2] == u[0] and u[3] == np.float32(1.5 * 2.0 ** -23)
    assert np.isfinite(O.gumbel(w)).all()


def reference_kept(x, k, p, mp, t, joint):
    """vLLM's torch reading of the filters, in float64: min-p on the softmax, top-k by the
    k-th largest value, top-p by the cumulative sum of the renormalised set (the top-k set, or
    with ``joint`` the min-p set), a token kept while the mass above it is below ``p``."""
    x = np.asarray(x, np.float64)
    s = x / t
    pr = np.exp(s - s.max())
    pr /= pr.sum()
    base = pr >= mp * pr.max() if mp > 0 else np.ones(len(x), bool)
    keep = base.copy()
    if 0 < k < len(x):
        kth = np.sort(x[base])[::-1][min(k, base.sum()) - 1]
        keep &= x >= kth
    if p < 1:
        q = np.where(base if joint else keep, pr, 0)
        q = q / q.sum()
        order = np.argsort(-q, kind="stable")
        above = np.concatenate([[0], np.cumsum(q[order])[:-1]])
        kp = np.zeros(len(x), bool)
        kp[order] = above < p
        kp[q == q.max()] = True  # ties with the most likely token: at least those
        keep &= kp
    return keep


@pytest.mark.parametrize("k, p, mp, t, joint", [
    (5, 1.0, 0.0, 1.0, False), (0, 0.8, 0.0, 1.0, False), (20, 0.6, 0.0, 0.7, False),
    (20, 0.6, 0.0, 1.3, True), (0, 1.0, 0.05, 1.0, False), (30, 0.9, 0.02, 0.8, False),
    (1, 0.5, 0.0, 1.0, False), (0, 0.0, 0.0, 1.0, False)])
def test_filters_equal_the_sort_and_cumsum_reading(k, p, mp, t, joint):
    rng = np.random.default_rng(7)
    for _ in range(20):
        x = (rng.standard_normal(200) * 2.5).astype(np.float32)
        kept, _, _ = O._row(x, logits=True, k=k, p=np.float32(p), t=np.float32(t),
                            mp=np.float32(mp), joint=joint)
        ref = reference_kept(x, k, p, mp, t, joint)
        assert np.array_equal(kept, ref), (np.flatnonzero(kept), np.flatnonzero(ref))


def test_ties_at_the_boundary_are_kept():
    x = np.array([3, 1, 2, 2, 2, 0, -1], np.float32)
    kept, _, _ = O._row(x, logits=True, k=2, p=np.float32(1), t=np.float32(1),
                        mp=np.float32(0), joint=False)
    assert np.flatnonzero(kept).tolist() == [0, 2, 3, 4]


def test_penalties_equal_torch_arithmetic():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    R, V = 4, 300
    x = (rng.standard_normal((R, V)) * 4).astype(np.float32)
    x[0, :3] = [np.inf, -np.inf, np.nan]
    pm = rng.random((R, V)) < 0.1
    counts = np.where(rng.random((R, V)) < 0.1, rng.integers(1, 5, (R, V)), 0).astype(np.int64)
    rep = np.array([1.3, 1.0, 0.7, 2.0], np.float32)
    freq = np.array([0.1, 0.0, -0.5, 0.3], np.float32)
    pres = np.array([0.2, 0.0, 1.5, np.inf], np.float32)
    got = x.copy()
    O.apply_penalties_(got, pm, counts, rep, freq, pres)
    lt, ct = torch.from_numpy(x.copy()), torch.from_numpy(counts)
    seen = torch.from_numpy(pm) | (ct > 0)
    r = torch.from_numpy(rep)[:, None]
    lt = torch.where(seen, torch.where(lt > 0, lt / r, lt * r), lt)
    lt -= torch.from_numpy(freq)[:, None] * ct
    lt -= torch.from_numpy(pres)[:, None] * (ct > 0)
    assert np.array_equal(got.view(np.uint32), lt.numpy().view(np.uint32))


# ---------------------------------------------------------------- the sampled distribution
def chi_square_critical(dof, z=2.3263):
    """The 0.99 quantile of chi-square with ``dof`` degrees of freedom (Wilson-Hilferty:
    within a percent for dof >= 3): a statistic below it has p > 0.01."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def oracle_draws(x, n, *, k=0, p=1.0, mp=0.0, t=1.0, seed=11, logits=True):
    """``n`` samples of one row by the oracle's rule, offsets 0..n-1 (vectorised)."""
    V = len(x)
    kept, _, s = O._row(np.asarray(x, np.float32), logits=logits, k=k, p=np.float32(p),
                        t=np.float32(t), mp=np.float32(mp), joint=False)
    i = np.arange(V, dtype=np.uint64)[None, :]
    off = np.arange(n, dtype=np.uint64)[:, None]
    words = O.philox(i >> np.uint64(2), 0, off & np.uint64(0xFFFFFFFF), off >> np.uint64(32),
                     seed, 0)
    w = np.choose((i & np.uint64(3)).astype(np.int64) + np.zeros((n, 1), np.int64), words)
    score = np.where(kept[None, :], s[None, :] + O.gumbel(w), -np.inf)
    return np.argmax(score, axis=1), kept


def assert_distribution(tokens, probs, what):
    n = len(tokens)
    support = probs > 0
    counts = np.bincount(tokens, minlength=len(probs))
    assert not counts[~support].any(), f"{what}: tokens outside the kept set"
    e = probs[support] * n
    stat = float(((counts[support] - e) ** 2 / e).sum())
    dof = int(support.sum()) - 1
    if dof >= 1:
        assert stat < chi_square_critical(max(dof, 3)), f"{what}: chi-square {stat:.1f}, dof {dof}"


@pytest.mark.parametrize("k, p, mp, t", [(0, 1.0, 0.0, 1.0), (6, 1.0, 0.0, 1.0),
                                         (0, 0.75, 0.0, 1.0), (8, 0.5, 0.0, 0.8),
                                         (0, 1.0, 0.1, 1.5)])
def test_oracle_samples_the_renormalised_distribution(k, p, mp, t):
    x = np.linspace(2.0, -2.5, 24).astype(np.float32)
    x[5] = x[4]  # a tie inside the kept set
    tokens, kept = oracle_draws(x, 200_000, k=k, p=p, mp=mp, t=t)
    ref = reference_kept(x, k, p, mp, t, False)
    assert np.array_equal(kept, ref)
    q = np.where(ref, np.exp(x.astype(np.float64) / t), 0)
    assert_distribution(tokens, q / q.sum(), f"k={k} p={p} min_p={mp} T={t}")


def test_the_check_fails_on_a_wrong_distribution():
    """The chi-square check can fail: the same draws against a slightly wrong law."""
    x = np.linspace(1.0, -1.0, 10).astype(np.float32)
    tokens, _ = oracle_draws(x, 200_000)
    q = np.exp(x.astype(np.float64) * 1.05)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_distribution(tokens, q / q.sum(), "T = 1 / 1.05")
