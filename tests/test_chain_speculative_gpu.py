"""``chain_speculative_sampling`` on a real GPU: a serving vocabulary, libdevice's ``logf``, the
sampled distribution over many requests, and the random stream's contract under CUDA graphs
and torch.compile.

* Outputs against the oracle at 151,936 tokens, 4 requests x 4 draft positions, torch tensors,
  with and without draft probabilities, 16-byte rows and element loads (a row view off a
  16-byte boundary). The acceptance test ``r32(u * q(d)) < p(d)`` has no libdevice math, so
  the counts are exact; the residual's Gumbel-max runs ``logf`` (within 2 ulps of the oracle's
  correctly rounded one), so a token may differ only where two scores lie within ~1e-6 of each
  other (probability ~1e-6 a draw): the test asserts equality and prints the two scores should
  one differ.
* Distribution: 200,000 requests at 48 tokens, drafts drawn from ``q`` on the device; the
  emitted token at position 0 against the target ``p`` (chi-square, p > 0.01), and the
  accepted count's mean against ``sum_j sum_t min(p_j, q_j)``.
* A CUDA graph whose replays advance a device-side offset tensor: replay ``i`` equals the
  eager call at offset ``i``, and accumulators passed to the captured call grow each replay.

Skipped, with that reason, on machines without a CUDA GPU (CI's CPU machine).
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import loomnb  # noqa: E402
from loomnb.oracle import sampler as O  # noqa: E402

from test_sampler_oracle import assert_distribution  # noqa: E402

V = 151936
OP = "chain_speculative_sampling"


def host(t):
    return t.detach().cpu().numpy()


def serving_batch(B=4, n=4, vocab=V, seed=0, draft=True):
    """Target rows from random logits, draft rows close to them (drafts often accepted), draft
    tokens drawn from the draft rows (or, without draft rows, the targets' argmax)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(B, n + 1, vocab, generator=g, device="cuda") * 3
    tp = torch.softmax(logits, -1)
    noise = torch.softmax(logits[:, :n] + torch.randn(B, n, vocab, generator=g, device="cuda"), -1)
    dp = (0.5 * tp[:, :n] + 0.5 * noise).contiguous()
    ids = torch.multinomial(dp.reshape(B * n, vocab), 1, generator=g).reshape(B, n).int()
    if not draft:
        ids = tp[:, :n].argmax(-1).int()
        dp = None
    return dp, ids, tp.contiguous()


def _explain(dp, ids, tp, b, got, want, seed, offset):
    pos = int(want[2][b])
    p = host(tp[b, pos])
    r = p - host(dp[b, pos]) if dp is not None and pos < ids.shape[1] else p.copy()
    g = O.gumbel(O.stream_words(p.size, O.SPEC_GUMBEL_STREAM + pos, [seed], [offset], [b])[0])
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.log(np.where(r > 0, r, np.nan).astype(np.float64)) + g
    t_got, t_want = int(got[0][b, pos]), int(want[0][b, pos])
    return f"request {b} position {pos}: got {t_got} (score {sc[t_got]:.7g}), want {t_want} " \
           f"(score {sc[t_want]:.7g})"


@pytest.mark.parametrize("draft", [True, False])
@pytest.mark.parametrize("aligned", [True, False])
def test_serving_vocabulary_equals_the_oracle(draft, aligned):
    dp, ids, tp = serving_batch(draft=draft)
    if not aligned:  # a view that starts one float past a 16-byte boundary: element loads
        buf = torch.empty(tp.numel() + 1, device="cuda")
        view = buf[1:].view(tp.shape)
        view.copy_(tp)
        tp = view
    acc = torch.arange(4, dtype=torch.int32, device="cuda")
    acc0 = host(acc).copy()
    got = loomnb.chain_speculative_sampling(dp, ids, tp, acc, seed=20261207, offset=3)
    torch.cuda.synchronize()
    got = tuple(host(t) for t in got)
    acc_o = acc0.copy()
    want = O.chain_speculative_sampling(None if dp is None else host(dp), host(ids), host(tp),
                                        acc_o, seed=20261207, offset=3)
    assert np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2]), \
        "the counts have no libdevice math: exact"
    assert np.array_equal(host(acc), acc_o), "accumulated in place"
    for b in range(4):
        assert np.array_equal(got[0][b], want[0][b]), _explain(dp, ids, tp, b, got, want,
                                                               20261207, 3)


DIST_V = 48


def test_distribution_over_many_requests():
    n_req = 200_000
    x = np.linspace(2.0, -3.0, DIST_V)
    p0 = np.exp(x) / np.exp(x).sum()
    q0 = np.exp(-0.5 * x) / np.exp(-0.5 * x).sum()  # a draft that favours the tail
    p1, q1 = q0, p0
    tp = torch.tensor(np.stack([p0, p1, p0]), dtype=torch.float32, device="cuda")
    dq = torch.tensor(np.stack([q0, q1]), dtype=torch.float32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.stack([torch.multinomial(dq[j], n_req, replacement=True, generator=g)
                       for j in range(2)], 1).int()
    tpb = tp[None].expand(n_req, 3, DIST_V)
    dpb = dq[None].expand(n_req, 2, DIST_V)
    out, acc, emi = loomnb.chain_speculative_sampling(dpb, ids, tpb, seed=77, offset=5)
    pf, qf = host(tp).astype(np.float64), host(dq).astype(np.float64)
    assert_distribution(host(out[:, 0]).astype(np.int64), pf[0] / pf[0].sum(), "position 0")
    mean = np.minimum(pf[:2], qf).sum()
    a = host(acc).astype(np.float64)
    assert abs(a.mean() - mean) < 5 * a.std() / np.sqrt(n_req), (a.mean(), mean)
    # without draft probabilities: one-hot drafts, position 0 still distributed as p_0
    out, _, _ = loomnb.chain_speculative_sampling(None, ids, tpb, seed=78)
    assert_distribution(host(out[:, 0]).astype(np.int64), pf[0] / pf[0].sum(), "one-hot drafts")


def test_cuda_graph_replays_advance_a_device_offset():
    dp, ids, tp = serving_batch(B=8, n=3, vocab=32000, seed=2)
    seeds = torch.arange(100, 108, dtype=torch.int64, device="cuda")
    offset = torch.zeros(1, dtype=torch.int64, device="cuda")
    out = torch.empty(8, 4, dtype=torch.int32, device="cuda")
    acc = torch.zeros(8, dtype=torch.int32, device="cuda")
    emi = torch.zeros(8, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile) off the capture
        loomnb.chain_speculative_sampling(dp, ids, tp, acc, emi, seed=seeds, offset=offset, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loomnb.chain_speculative_sampling(dp, ids, tp, acc, emi, seed=seeds, offset=offset, out=out)
        offset.add_(1)
    offset.zero_()
    acc.zero_()
    emi.zero_()
    acc_sum = torch.zeros_like(acc)
    emi_sum = torch.zeros_like(emi)
    for i in range(3):
        graph.replay()
        want, a, e = loomnb.chain_speculative_sampling(dp, ids, tp, seed=seeds, offset=i)
        acc_sum += a
        emi_sum += e
        assert torch.equal(out, want), f"replay {i}"
        assert torch.equal(acc, acc_sum) and torch.equal(emi, emi_sum), f"replay {i}: counts"
    other = loomnb.chain_speculative_sampling(dp, ids, tp, seed=seeds, offset=0)[0]
    perm = torch.tensor([3, 1, 7, 0, 2, 6, 4, 5], device="cuda")
    moved = loomnb.chain_speculative_sampling(None if dp is None else dp[perm], ids[perm], tp[perm],
                                              seed=seeds[perm], offset=0)[0]
    assert torch.equal(other[perm], moved), "a request's outputs do not depend on its row"


def test_torch_compile():
    dp, ids, tp = serving_batch(B=4, n=2, vocab=4096, seed=3)

    def step(dp, ids, tp):
        return loomnb.chain_speculative_sampling(dp * 1.0, ids, tp, seed=5, offset=2)

    eager = step(dp, ids, tp)
    compiled = torch.compile(step, fullgraph=True)(dp, ids, tp)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)
