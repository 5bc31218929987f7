"""``chain_speculative_sampling``'s kernel under numba's CUDA simulator against the oracle, bit
for bit (the simulator's ``log`` rounds as the oracle's): 16-byte rows (V = 24, 32) and
element loads (V = 23, a row view that starts off a 16-byte boundary), with and without draft
probabilities, an int seed and per-request seeds; then the edges of the rule (every draft
accepted -> the bonus token, the first position rejected, ``q(d) = 0``, an empty residual, a
target row without mass, ids outside the vocabulary), the seed's contract (per-request seeds
give a request the same outputs wherever it sits in the batch), the block size, more positions
than threads, the accumulators and ``out=``. Shapes stay tiny: the simulator runs each thread
in Python.
"""

import numpy as np
import pytest

import loomnb
from loomnb.ops import _launch as L
from loomnb.ops._sampler_kernels import ChainSpec

from family import assert_bits, block_size_sweep, call_both, out_given_and_not

pytestmark = pytest.mark.sim
OP = "chain_speculative_sampling"


def dist(rng, shape, zeros=0.3):
    """Probability rows with about ``zeros`` of their entries 0."""
    x = rng.random(shape) * (rng.random(shape) > zeros)
    x[..., 0] += 1e-3
    return (x / x.sum(-1, keepdims=True)).astype(np.float32)


def make(B=3, n=3, V=24, seed=0, draft=True, near=True):
    """A batch whose drafts are often accepted (``near``: the draft close to the target), with
    an id outside the vocabulary in the last request."""
    rng = np.random.default_rng(seed)
    tp = dist(rng, (B, n + 1, V))
    dp = dist(rng, (B, n, V)) if draft else None
    if draft and near:
        dp = (0.7 * tp[:, :n] + 0.3 * dp).astype(np.float32)
    ids = np.argmax(tp[:, :n] + rng.random((B, n, V)).astype(np.float32) * 0.2, -1).astype(np.int32)
    if B:
        ids[-1, -1] = V + 3
    return dp, ids, tp


def launched_layouts():
    return {s.layout for f, s, _ in L.launched() if isinstance(s, ChainSpec)}


def assert_same(got, want, what=""):
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bits(g, w, f"{what} result {i}")


@pytest.mark.parametrize("draft", [True, False])
@pytest.mark.parametrize("V, layout", [(24, "vec"), (32, "vec"), (23, "scalar")])
def test_kernel_equals_oracle(V, layout, draft):
    dp, ids, tp = make(V=V, draft=draft)
    L._launched.clear()
    got, want, a1, _ = call_both(OP, dp, ids, tp, seed=1234, offset=7)
    assert_same(got, want, f"V={V} draft={draft}")
    assert launched_layouts() == {layout}
    assert got[0].dtype == np.int32 and got[0].shape == (3, 4) and got[1].shape == (3,)
    assert_bits(a1[2], tp, "target_probs is not modified")
    seeds = np.array([5, -7, 1 << 62], np.int64)
    got, want, _, _ = call_both(OP, dp, ids, tp, seed=seeds, offset=np.array([3, 0, 9], np.int64))
    assert_same(got, want, "per-request seeds and offsets")


def test_unaligned_rows_take_element_loads():
    dp, ids, tp = make(V=32)
    buf = np.zeros(tp.size + 1, np.float32)
    tpv = buf[1:].reshape(tp.shape)
    tpv[...] = tp
    L._launched.clear()
    got = loomnb.chain_speculative_sampling(dp, ids, tpv, seed=5)  # (call_both's copies align)
    assert launched_layouts() == {"scalar"}
    assert_same(got, loomnb.oracle.chain_speculative_sampling(dp, ids, tp, seed=5))
    assert_bits(tpv, tp, "target_probs is not modified")


def test_edges():
    n, V = 3, 24
    tp = np.full((6, n + 1, V), 1 / V, np.float32)
    dp = np.full((6, n, V), 1 / V, np.float32)
    ids = np.array([[1, 2, 3], [0, 1, 2], [V, 1, 2], [-1, 1, 2], [4, 4, 4], [5, 6, 7]], np.int32)
    dp[0] = 0                     # q(d) = 0: accepted wherever p(d) > 0
    tp[0, n] = 0
    tp[0, n, 17] = 1              # every draft accepted: the bonus token, surely 17
    dp[1, 0] = tp[1, 0]
    dp[1, 0, 0] = 1.0             # q(0) > p(0) and the residual empty: a draw from p
    tp[4, 0] = 0                  # no mass at all: rejected, then p's argmax (0)
    tp[5, 0] = 0
    tp[5, 0, 9] = 1               # the first position rejected (p(5) = 0), the residual is token 9
    got, want, _, _ = call_both(OP, dp, ids, tp, seed=11)
    assert_same(got, want)
    out, acc, emi = got
    assert out[0].tolist() == [1, 2, 3, 17] and acc[0] == 3 and emi[0] == 3
    assert emi[2] == 0 and emi[3] == 0 and out[2, 1:].tolist() == [-1] * n, "ids outside [0, V)"
    assert out[4].tolist() == [0, -1, -1, -1]
    assert out[5].tolist() == [9, -1, -1, -1] and emi[5] == 0


def test_one_hot_drafts_never_redraw_the_rejected_token():
    dp, ids, tp = make(B=4, V=24, draft=False, seed=2)
    got, want, _, _ = call_both(OP, None, ids, tp, seed=3)
    assert_same(got, want)
    out, _, emi = got
    for b in range(4):
        if emi[b] < 3 and 0 <= ids[b, emi[b]] < 24:
            assert out[b, emi[b]] != ids[b, emi[b]]


def test_per_request_seeds_give_the_same_outputs_in_any_batch_order():
    dp, ids, tp = make(B=4, V=24, seed=4)
    ids[-1, -1] = 1
    seeds = np.array([10, 20, 30, 40], np.int64)
    out, acc, emi = loomnb.chain_speculative_sampling(dp, ids, tp, seed=seeds, offset=2)
    perm = np.array([2, 0, 3, 1])
    o2, a2, e2 = loomnb.chain_speculative_sampling(dp[perm], ids[perm], tp[perm],
                                                   seed=seeds[perm], offset=2)
    assert_bits(o2, out[perm])
    assert_bits(a2, acc[perm])
    assert_bits(e2, emi[perm])


def test_block_size_and_more_positions_than_threads():
    dp, ids, tp = make(B=2, n=40, V=8, seed=5, near=True)
    want = loomnb.oracle.chain_speculative_sampling(dp, ids, tp, seed=6)
    block_size_sweep(lambda: loomnb.chain_speculative_sampling(dp, ids, tp, seed=6),
                     lambda got, what: assert_same(got, want, what), threads=(32, 64))


def test_accumulators_add_in_place_and_out_given_or_not():
    dp, ids, tp = make(seed=6)
    acc0 = np.array([5, 0, 2 ** 31 - 1], np.int32)
    emi0 = np.array([1, 2, 3], np.int32)
    acc, emi = acc0.copy(), emi0.copy()
    out, a, e = loomnb.chain_speculative_sampling(dp, ids, tp, acc, emi, seed=9)
    assert a is acc and e is emi
    _, a_new, e_new = loomnb.chain_speculative_sampling(dp, ids, tp, seed=9)
    assert_bits(acc, (acc0.astype(np.int64) + a_new).astype(np.int32))
    assert_bits(emi, emi0 + e_new)
    oracle_acc, oracle_emi = acc0.copy(), emi0.copy()
    want = loomnb.oracle.chain_speculative_sampling(dp, ids, tp, oracle_acc, oracle_emi, seed=9)
    assert_same((out, acc, emi), want)
    out_given_and_not(lambda out: loomnb.chain_speculative_sampling(dp, ids, tp, seed=9, out=out),
                      lambda: np.full((3, 4), 77, np.int32))


def test_empty_batch_is_a_no_op():
    dp, ids, tp = make(B=0)
    L._launched.clear()
    out, acc, emi = loomnb.chain_speculative_sampling(dp, ids, tp, seed=1)
    assert out.shape == (0, 4) and acc.shape == (0,) and emi.shape == (0,)
    assert not launched_layouts()
