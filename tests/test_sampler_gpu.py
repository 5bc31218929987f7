"""The sampler family on a real GPU: serving vocabularies, libdevice's math, the RNG's contract
under CUDA graphs and torch.compile, and the sampled distribution over many draws.

* Tokens against the oracle at 151,936 tokens a row, per-row configurations, fp32 and bf16.
  The GPU's ``expf``/``logf`` are within 2 ulps of the oracle's correctly rounded ones, so a
  token may differ only where two Gumbel scores, or a token's mass and a top-p/min-p boundary,
  lie within ~1e-6 of each other (probability ~1e-6 a row): the test asserts equality on every
  row and, should one differ, prints that row's margin. Masks, renormalised probabilities
  (no ``expf``: the mass of a probability is ``p * r32(1 / p_max)``) and penalties are compared
  as under the simulator.
* Distribution: 200,000 rows of the same logits with per-row seeds, against the exact
  renormalised probabilities (chi-square, p > 0.01), for top-k, top-p crossing a token, min-p,
  temperature, penalties applied first, and probabilities as input.
* Seeds: the same (seed, offset) gives the same tokens run to run, in any batch order, and in
  a CUDA graph whose replays advance a device-side offset; a torch.Generator draws reproducibly.

Skipped, with that reason, on machines without a CUDA GPU (CI's CPU machine).
"""

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import loomnb  # noqa: E402
from loomnb.oracle import sampler as O  # noqa: E402
from loomnb.ops.sampler import force_candidates, force_split  # noqa: E402

from helpers import assert_ulps  # noqa: E402
from test_sampler_oracle import assert_distribution, reference_kept  # noqa: E402
from tolerances import ulps  # noqa: E402

BF16 = ml_dtypes.bfloat16
V = 151936


def host(t):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def model_logits(R, vocab=V, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(R, vocab, generator=g, device="cuda") * 3).to(dtype)


ROWS = 8
CONFIG = dict(top_k=[50, 0, 1000, 20, 0, 5, V + 1, 100],
              top_p=[0.9, 0.8, 1.0, 0.5, 1.0, 0.95, 0.7, 0.0],
              temperature=[1.0, 0.7, 1.3, 0.0, 1.0, 0.5, 1.0, 1.0],
              min_p=[0.0, 0.0, 0.05, 0.0, 0.1, 0.0, 0.02, 0.0])


def _config_tensors():
    return (torch.tensor(CONFIG["top_k"], dtype=torch.int32, device="cuda"),
            torch.tensor(CONFIG["top_p"], device="cuda"),
            torch.tensor(CONFIG["temperature"], device="cuda"),
            torch.tensor(CONFIG["min_p"], device="cuda"))


def _explain(x, r, got, want, seed, offset):
    kept, _, s = O._row(x[r], logits=True, k=CONFIG["top_k"][r], p=np.float32(CONFIG["top_p"][r]),
                        t=np.float32(CONFIG["temperature"][r]), mp=np.float32(CONFIG["min_p"][r]),
                        joint=False)
    g = O.token_gumbels(x.shape[1], seed[r], offset, 0)
    sc = s + g
    return (f"row {r}: got {got} (kept {bool(kept[got])}, score {sc[got]:.7g}), want {want} "
            f"(score {sc[want]:.7g})")


# The paths: "split" the launch rule at 8 rows (each row over many blocks: the split
# kernels); the row kernel with "vec" 16-byte loads and candidates compacted into shared
# memory, "row" the same loads reading the row at every level (no compaction), "scalar"
# element loads (the rows shifted by one element: no 16-byte alignment, never split).
@pytest.mark.parametrize("path", ["split", "vec", "row", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_equal_the_oracle_at_a_serving_vocabulary(dtype, path):
    x = model_logits(ROWS, dtype=dtype)
    if path == "scalar":
        x = x[:, 1:]
    k, p, t, mp = _config_tensors()
    seed = torch.arange(100, 100 + ROWS, dtype=torch.int64, device="cuda")
    with force_candidates(-1 if path == "row" else None), \
            force_split(None if path == "split" else 0):
        got = loomnb.top_k_top_p_sampling_from_logits(x, k, p, temperature=t, min_p=mp,
                                                      seed=seed, offset=5)
    xh = host(x).astype(np.float32)
    want = O.top_k_top_p_sampling_from_logits(xh, np.array(CONFIG["top_k"], np.int32),
                                              np.array(CONFIG["top_p"], np.float32),
                                              temperature=np.array(CONFIG["temperature"], np.float32),
                                              min_p=np.array(CONFIG["min_p"], np.float32),
                                              seed=host(seed), offset=5)
    g = host(got)
    bad = [_explain(xh, r, g[r], want[r], host(seed), 5) for r in range(ROWS) if g[r] != want[r]]
    assert not bad, "\n".join(bad)
    assert g[3] == int(np.argmax(xh[3])), "temperature 0 takes the argmax"


# The finish path (a scalar top-k, no min-p: two split launches and the finishing row kernel)
# at the launch rule's blocks a row and at one block a row (its form at many rows).
@pytest.mark.parametrize("split", [None, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finish_path_equals_the_oracle_at_a_serving_vocabulary(dtype, split):
    x = model_logits(ROWS, dtype=dtype, seed=4)
    _, p, t, _ = _config_tensors()
    seed = torch.arange(7, 7 + ROWS, dtype=torch.int64, device="cuda")
    with force_split(split):
        got = loomnb.top_k_top_p_sampling_from_logits(x, 50, p, temperature=t, seed=seed,
                                                      offset=1)
    xh = host(x).astype(np.float32)
    want = O.top_k_top_p_sampling_from_logits(
        xh, 50, np.array(CONFIG["top_p"], np.float32),
        temperature=np.array(CONFIG["temperature"], np.float32), seed=host(seed), offset=1)
    assert np.array_equal(host(got), want), (host(got), want)
    assert host(got)[3] == int(np.argmax(xh[3])), "temperature 0 takes the argmax"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_processed_logits_at_a_serving_vocabulary(dtype):
    """The processed logits against the oracle (equal: a boundary within the GPU's 2-ulp
    ``expf`` of a top-p / min-p threshold is as unlikely as for the tokens above), and the
    processed logprob of a token sampled with the same arguments finite on every row."""
    x = model_logits(ROWS, dtype=dtype, seed=6)
    k, p, t, mp = _config_tensors()
    got = loomnb.top_k_top_p_mask_logits(x, k, p, temperature=t, min_p=mp)
    want = O.top_k_top_p_mask_logits(host(x), *(np.array(CONFIG[n], np.int32 if n == "top_k"
                                                          else np.float32)
                                                 for n in ("top_k", "top_p")),
                                     temperature=np.array(CONFIG["temperature"], np.float32),
                                     min_p=np.array(CONFIG["min_p"], np.float32))
    assert np.array_equal(bits(host(got)), bits(want))
    ids = loomnb.top_k_top_p_sampling_from_logits(x, k, p, temperature=t, min_p=mp, seed=3)
    lp, rank = loomnb.selected_token_logprob_rank(got, ids.to(torch.int64))
    assert np.isfinite(host(lp)).all() and (host(rank) >= 1).all(), (host(lp), host(rank))


@pytest.mark.parametrize("split", [None, 0])  # 4 rows: split by the rule, or never
def test_from_probs_masks_and_renorm_at_a_serving_vocabulary(split):
    with force_split(split):
        _from_probs_masks_and_renorm()


def _from_probs_masks_and_renorm():
    x = model_logits(4)
    p = torch.softmax(x, -1)
    ph = host(p)
    for name, args in (("top_k_top_p_sampling_from_probs", (40, 0.9)), ("min_p_sampling_from_probs", (0.1,)),
                       ("top_p_sampling_from_probs", (0.6,)), ("sampling_from_probs", ())):
        got = getattr(loomnb, name)(p, *args, seed=3)
        want = getattr(O, name)(ph, *args, seed=3)
        assert np.array_equal(host(got), want), name
    xb = x.to(torch.bfloat16)
    got = loomnb.top_k_mask_logits(xb, 64)
    assert np.array_equal(bits(host(got)), bits(O.top_k_mask_logits(host(xb), 64)))
    assert int((host(got).astype(np.float32) != -np.inf).sum(1).min()) >= 64
    for name, arg in (("top_k_renorm_probs", 200), ("top_p_renorm_probs", 0.9)):
        assert_ulps(host(getattr(loomnb, name)(p, arg)), getattr(O, name)(ph, arg),
                    ulps("sampler_renorm", "f32"), name)


def test_penalties_equal_the_oracle_and_torch():
    R = 6
    rng = np.random.default_rng(1)
    x = model_logits(R)
    pm = torch.from_numpy(rng.random((R, V)) < 0.01).cuda()
    counts = torch.from_numpy(np.where(rng.random((R, V)) < 0.01, rng.integers(1, 6, (R, V)),
                                       0).astype(np.int32)).cuda()
    rep = torch.tensor([1.1, 1.0, 0.9, 1.5, 2.0, 1.2], device="cuda")
    freq = torch.tensor([0.2, 0.0, -0.1, 0.5, 0.0, 1.0], device="cuda")
    pres = torch.tensor([0.3, 0.0, 0.1, 0.0, 1.0, 2.0], device="cuda")
    got = x.clone()
    loomnb.apply_penalties_(got, pm, counts, rep, freq, pres)
    want = host(x).copy()
    O.apply_penalties_(want, host(pm), host(counts), host(rep), host(freq), host(pres))
    assert np.array_equal(bits(host(got)), bits(want))
    seen = pm | (counts > 0)
    ref = torch.where(seen, torch.where(x > 0, x / rep[:, None], x * rep[:, None]), x)
    ref -= freq[:, None] * counts
    ref -= pres[:, None] * (counts > 0)
    assert torch.equal(got, ref), "vLLM's apply_penalties (its CUDA op's division, torch's subtractions)"
    xb = x.to(torch.bfloat16)
    a = xb.clone()
    loomnb.apply_repetition_penalties_(a, pm, counts > 0, rep.to(torch.bfloat16))
    b = host(xb).copy()
    O.apply_repetition_penalties_(b, host(pm), host(counts > 0), host(rep.to(torch.bfloat16)))
    assert np.array_equal(bits(host(a)), bits(b))


DIST_V = 48


def _dist_logits():
    x = np.linspace(2.5, -3.0, DIST_V).astype(np.float32)
    x[7] = x[6]
    return x


@pytest.mark.parametrize("k, p, mp, t", [(0, 1.0, 0.0, 1.0), (10, 1.0, 0.0, 1.0),
                                         (0, 0.6, 0.0, 1.0), (12, 0.8, 0.0, 0.7),
                                         (0, 1.0, 0.08, 1.4), (5, 0.3, 0.0, 1.0)])
def test_distribution_over_many_draws(k, p, mp, t):
    n = 200_000
    x = _dist_logits()
    xs = torch.from_numpy(x).cuda()[None].expand(n, DIST_V)
    seeds = torch.arange(n, dtype=torch.int64, device="cuda")
    tok = host(loomnb.top_k_top_p_sampling_from_logits(xs, k, p, temperature=t, min_p=mp,
                                                       seed=seeds))
    ref = reference_kept(x, k, p, mp, t, False)
    q = np.where(ref, np.exp(x.astype(np.float64) / t), 0)
    assert_distribution(tok.astype(np.int64), q / q.sum(), f"k={k} p={p} min_p={mp} T={t}")


def test_distribution_from_probs_and_after_penalties():
    n = 200_000
    x = _dist_logits()
    pm = np.zeros(DIST_V, bool)
    pm[[0, 3, 20]] = True
    xs = torch.from_numpy(x).cuda()[None].repeat(n, 1)
    loomnb.apply_penalties_(xs, torch.from_numpy(pm).cuda()[None].expand(n, DIST_V).contiguous(),
                            torch.zeros(n, DIST_V, dtype=torch.int32, device="cuda"),
                            torch.full((n,), 1.5, device="cuda"), torch.zeros(n, device="cuda"),
                            torch.zeros(n, device="cuda"))
    seeds = torch.arange(n, dtype=torch.int64, device="cuda")
    tok = host(loomnb.sampling_from_logits(xs, seed=seeds))
    xp = np.where(pm, np.where(x > 0, x / np.float32(1.5), x * np.float32(1.5)), x)
    q = np.exp(xp.astype(np.float64))
    assert_distribution(tok.astype(np.int64), q / q.sum(), "after repetition penalties")
    probs = torch.softmax(torch.from_numpy(x).cuda(), -1)[None].expand(n, DIST_V)
    tok = host(loomnb.top_p_sampling_from_probs(probs, 0.7, seed=seeds))
    ref = reference_kept(x, 0, 0.7, 0.0, 1.0, False)
    q = np.where(ref, np.exp(x.astype(np.float64)), 0)
    assert_distribution(tok.astype(np.int64), q / q.sum(), "top-p from probabilities")


def test_seeds_batch_order_graphs_and_generators():
    R = 16
    x = model_logits(R, 32000)
    seeds = torch.arange(7, 7 + R, dtype=torch.int64, device="cuda")
    a = loomnb.top_k_top_p_sampling_from_logits(x, 50, 0.9, seed=seeds, offset=11)
    assert torch.equal(a, loomnb.top_k_top_p_sampling_from_logits(x, 50, 0.9, seed=seeds,
                                                                   offset=11))
    perm = torch.randperm(R, device="cuda")
    b = loomnb.top_k_top_p_sampling_from_logits(x[perm].contiguous(), 50, 0.9, seed=seeds[perm],
                                                offset=11)
    assert torch.equal(a[perm], b), "a request's token does not depend on its row"
    # a graph whose replays advance a device-side offset: replay i equals eager offset i
    offset = torch.zeros(1, dtype=torch.int64, device="cuda")
    out = torch.empty(R, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        loomnb.top_k_top_p_sampling_from_logits(x, 50, 0.9, seed=seeds, offset=offset, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loomnb.top_k_top_p_sampling_from_logits(x, 50, 0.9, seed=seeds, offset=offset, out=out)
        offset.add_(1)
    offset.zero_()
    for i in range(3):
        graph.replay()
        want = loomnb.top_k_top_p_sampling_from_logits(x, 50, 0.9, seed=seeds, offset=i)
        assert torch.equal(out, want), f"replay {i}"
    g1 = torch.Generator(device="cuda").manual_seed(5)
    g2 = torch.Generator(device="cuda").manual_seed(5)
    assert torch.equal(loomnb.sampling_from_logits(x, generator=g1),
                       loomnb.sampling_from_logits(x, generator=g2))
    fresh = [loomnb.sampling_from_logits(x) for _ in range(3)]  # no seed: a new one every call
    assert not all(torch.equal(fresh[0], f) for f in fresh[1:])


def test_torch_compile_and_streams():
    R = 8
    x = model_logits(R, 4096)
    k = torch.full((R,), 20, dtype=torch.int32, device="cuda")
    seed = torch.arange(R, dtype=torch.int64, device="cuda")

    def step(logits, k, seed):
        return loomnb.top_k_top_p_sampling_from_logits(logits * 1.0, k, 0.9, temperature=0.8,
                                                       seed=seed, offset=3)

    eager = step(x, k, seed)
    compiled = torch.compile(step, fullgraph=True)(x, k, seed)
    assert torch.equal(eager, compiled)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        on_s = step(x, k, seed)
    s.synchronize()
    assert torch.equal(eager, on_s)
    with_s = loomnb.top_k_top_p_sampling_from_logits(x, k, 0.9, temperature=0.8, seed=seed,
                                                     offset=3, stream=s)
    s.synchronize()
    assert torch.equal(eager, with_s)


# The split kernels against the row kernel on the same GPU: the same expf, logf and draws, so
# the same tokens and masks bit for bit (renormalised probabilities within the renorm budget:
# the float64 sum is added in another order), at decode batch sizes where the launch rule
# splits, with random per-row configurations and every filter order.
def split_and_row(call):
    """``call()`` with the launch rule's split kernels, then with the row kernel only."""
    runs = []
    for split in (None, 0):
        with force_split(split):
            runs.append(call())
    return runs


@pytest.mark.parametrize("R, vocab", [(1, V), (3, 49152), (32, 128256), (64, V), (300, 49152),
                                     (512, 49152)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_rows_equal_the_row_kernel(R, vocab, dtype):
    g = torch.Generator(device="cuda").manual_seed(R)
    x = model_logits(R, vocab, dtype, seed=R)
    k = torch.randint(0, 300, (R,), generator=g, device="cuda", dtype=torch.int32)
    p = torch.rand(R, generator=g, device="cuda") * 0.6 + 0.45
    t = torch.rand(R, generator=g, device="cuda") + 0.3
    t[1::5] = 0.0  # greedy rows mixed in (row 0 samples: at R = 1 the filters are checked)
    mp = torch.where(torch.rand(R, generator=g, device="cuda") < 0.3, 0.05, 0.0)
    seed = torch.arange(R, dtype=torch.int64, device="cuda") + 17
    for order in ("top_k_first", "joint"):
        a, b = split_and_row(lambda: loomnb.top_k_top_p_sampling_from_logits(
            x, k, p, temperature=t, min_p=mp, filter_apply_order=order, seed=seed, offset=2))
        assert torch.equal(a, b), order
    # a scalar top-k: the row kernel finishes from the first level's candidates (k = 50; with
    # min-p after the max pass, without it from the candidates' largest), or from the row when
    # they do not fit (k = 1024: more than 1,024 keys in or above its bin); at 300 and 512
    # rows one or two blocks a row
    for kk, m in ((50, mp), (50, None), (1024, mp), (1024, None)):
        a, b = split_and_row(lambda: loomnb.top_k_top_p_sampling_from_logits(
            x, kk, p, temperature=t, min_p=m, seed=seed, offset=2))
        assert torch.equal(a, b), f"k={kk}, min_p {m is not None}"
    a, b = split_and_row(lambda: loomnb.top_k_mask_logits(x, k))
    assert np.array_equal(bits(host(a)), bits(host(b))), "top_k_mask_logits"
    a, b = split_and_row(lambda: loomnb.sampling_from_logits(x, seed=seed))
    assert torch.equal(a, b), "sampling_from_logits"
    if dtype == torch.float32:
        probs = torch.softmax(x, -1)
        for name, args in (("top_k_top_p_sampling_from_probs", (k, p)),
                           ("min_p_sampling_from_probs", (0.1,))):
            a, b = split_and_row(lambda: getattr(loomnb, name)(probs, *args, seed=seed))
            assert torch.equal(a, b), name
        for name, args in (("top_k_renorm_probs", (k,)), ("top_p_renorm_probs", (p,))):
            a, b = split_and_row(lambda: getattr(loomnb, name)(probs, *args))
            assert_ulps(host(a), host(b), ulps("sampler_renorm", "f32"), name)
