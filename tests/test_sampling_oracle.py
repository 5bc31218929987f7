"""The sampling oracles against vLLM's own formulas written in torch (CPU), and the launch
configuration (plain pass: no kernel runs here).

V1 is ``log_softmax(logits.float())``, ``argmax``, ``gather`` and ``(logprobs >= lp_t).sum()``;
V2 is Triton's ``x - max - log(sum(exp(x - max)))`` and ``(logits >= x_t).sum()`` over
8192-wide blocks padded with ``-inf``; Min-P V1 is ``softmax < amax(softmax) * min_p``, V2
``x < max + log(min_p)``. torch's fp32 sums differ from the oracle's float64 ones by ulps, so
logprobs are compared within the table's budget and ranks/masks exactly on data without
near-ties.
"""

import numpy as np
import pytest
import torch

from loomnb.oracle import sampling as O
from loomnb.ops.sampling import launch_config, v2_pad

pytestmark = pytest.mark.nosim


def v1_torch(x, t=None):
    lp = torch.from_numpy(x).float().log_softmax(-1)
    tok = torch.from_numpy(x).float().argmax(-1) if t is None else torch.from_numpy(t)
    lpt = lp.gather(-1, tok[:, None])
    return tok.numpy(), lpt[:, 0].numpy(), (lp >= lpt).sum(-1).numpy()


def v2_rank(x, t):
    xx = torch.from_numpy(x).float()
    V = x.shape[1]
    pad = torch.full((x.shape[0], -(-V // 8192) * 8192 - V), -float("inf"))
    xt = xx.gather(-1, torch.from_numpy(t)[:, None])
    return (torch.cat([xx, pad], 1) >= xt).sum(-1).numpy()


def test_issue_case():
    x = np.array([[2, 2, 1]], np.float32)
    for sampler in ("v1", "v2"):
        tok, lp, rank = O.greedy_sample_logprob(x, sampler)
        assert tok.tolist() == [0] and rank.tolist() == [2] and abs(lp[0] + 0.861995) < 5e-7


@pytest.mark.parametrize("vocab", [50, 1000, 49152])
def test_oracle_equals_vllm_v1_and_v2_formulas(vocab):
    rng = np.random.default_rng(vocab)
    x = (rng.standard_normal((4, vocab)) * 4).astype(np.float32)
    tok, lp, rank = O.greedy_sample_logprob(x, "v1")
    ttok, tlp, trank = v1_torch(x)
    assert np.array_equal(tok, ttok) and np.array_equal(rank, trank)
    # torch's CPU log_softmax (vectorised exp, fp32 sums) is not what vLLM runs and is off the
    # exact value by tens of ulps: a relative check here; the ulp budget is kernel vs oracle.
    np.testing.assert_allclose(lp, tlp, rtol=1e-5, atol=1e-6)
    t = rng.integers(0, vocab, 4)
    lp, rank = O.selected_token_logprob_rank(x, t, "v1")
    assert np.array_equal(rank, v1_torch(x, t)[2])
    lp2, rank2 = O.selected_token_logprob_rank(x, t, "v2")
    assert np.array_equal(rank2, v2_rank(x, t)) and np.array_equal(lp, lp2)
    ix, lps, _ = O.top_k_logprobs(x, 5)
    tv, ti = torch.topk(torch.from_numpy(x), 5)
    assert np.array_equal(ix[:, 1:], ti.numpy())


def test_special_rows_follow_vllm():
    x = np.zeros((3, 20), np.float32)
    x[0, 4] = np.nan
    x[1] = -np.inf
    x[2, 7] = np.inf
    tok, lp, rank = O.greedy_sample_logprob(x, "v1")
    ttok, tlp, trank = v1_torch(x)
    assert np.array_equal(tok, ttok) and np.array_equal(rank, trank) and np.isnan(tlp).all()
    assert np.isnan(lp).all()
    assert O.greedy_sample_logprob(x, "v2")[2].tolist() == [0, 8192, 1]
    assert np.array_equal(O.greedy_sample_logprob(x, "v2")[2], v2_rank(x, tok))


def test_min_p_oracle_equals_vllm_formulas():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 500)) * 3).astype(np.float32)
    mp = np.array([0.05, 0.3, 0.0], np.float32)
    p = torch.from_numpy(x).softmax(-1)
    want_v1 = (p < p.amax(-1, keepdim=True) * torch.from_numpy(mp)[:, None]).numpy()
    xx = torch.from_numpy(x)
    want_v2 = (xx < xx.amax(-1, keepdim=True) + torch.from_numpy(mp).log()[:, None]).numpy()
    want_v2[2] = False  # min_p == 0: V2 returns early
    assert np.array_equal(O.min_p_mask(x, mp, "v1")[0], want_v1)
    assert np.array_equal(O.min_p_mask(x, mp, "v2")[0], want_v2)


def test_top_k_order_puts_nan_first_then_value_then_index():
    row = np.array([1, 3, np.nan, 3, 0, np.nan], np.float32)
    assert O.top_k_order(row).tolist() == [2, 5, 1, 3, 0, 4]


def test_v2_pad():
    assert v2_pad(49152) == 0 and v2_pad(151936) == 155648 - 151936 and v2_pad(1) == 8191


@pytest.mark.parametrize("rows, vocab, unit, want", [
    (1, 151936, 4, (64, 264, 576)),       # latency-bound: the whole GPU on one row
    (32, 151936, 4, (512, 8, 18992)),
    (512, 151936, 4, (512, 1, 151936)),
    (1, 49152, 8, (32, 48, 1024)),         # bf16: never below a warp of 4 units each
    (3, 37, 4, (32, 1, 40)),
])
def test_launch_config(rows, vocab, unit, want):
    assert launch_config(rows, vocab, unit, 132) == want
    threads, splits, chunk = want
    assert chunk % unit == 0 and (splits - 1) * chunk < vocab <= splits * chunk
    assert rows * splits <= 4096 and threads % 32 == 0
