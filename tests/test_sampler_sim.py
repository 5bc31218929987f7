"""The sampler kernels under numba's CUDA simulator against the oracle: tokens, masks and
penalties bit for bit (the simulator's ``exp``/``log`` round as the oracle's), renormalised
probabilities within an ulp (their float64 sum is a block reduction, the oracle's a NumPy sum).

One batch carries several configurations through per-row tensors (top-k, top-p, temperature,
min-p, greedy rows), so each launch checks many; the edge rows of the distribution contract
(NaN, a single finite logit, ties at the top-k boundary, ``top_k > V``, ``top_p = 0``, equal
probabilities) and the seed's contract (a per-request seed gives a request the same token
wherever it sits in the batch; another offset another stream) follow. Shapes stay tiny: the
simulator runs every barrier of the radix select in Python threads.
"""

import contextlib

import ml_dtypes
import numpy as np
import pytest

import loomnb
from helpers import assert_ulps
from tolerances import ulps
from loomnb.oracle import sampler as O
from loomnb.ops import _launch as L
from loomnb.ops import _workspace as W
from loomnb.ops.sampler import force_candidates, force_split

from family import assert_bits, block_size_sweep, call_both, out_given_and_not

pytestmark = pytest.mark.sim
DT = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}


def logits(rng, R, V, kind="f32", scale=2.0):
    return (rng.standard_normal((R, V)) * scale).astype(DT[kind])


def probs_of(x):
    e = np.exp(x.astype(np.float64) - x.astype(np.float64).max(1, keepdims=True))
    return (e / e.sum(1, keepdims=True)).astype(np.float32)


ROWS = dict(top_k=np.array([5, 0, 8, 40, 3], np.int32),
            top_p=np.array([1.0, 0.7, 0.5, 0.9, 0.0], np.float32),
            temperature=np.array([1.0, 0.8, 1.4, 0.0, 1.0], np.float32),
            min_p=np.array([0.0, 0.0, 0.05, 0.0, 0.2], np.float32))


def sample_rows(x):
    """(got, want) of the op and its oracle over ``ROWS``' per-row configurations."""
    return call_both("top_k_top_p_sampling_from_logits", x, ROWS["top_k"], ROWS["top_p"],
                     temperature=ROWS["temperature"], min_p=ROWS["min_p"], seed=1234,
                     offset=7)[:2]


# The row kernel's paths: V = 40 rows take 16-byte loads, V = 37 element loads; with the
# default capacity every row is compacted into shared memory at the first level, with 6 at a
# later one (or never), with -1 the row is read at every level.
@pytest.mark.parametrize("cap", [None, 6, -1])
@pytest.mark.parametrize("V", [37, 40])
@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_top_k_top_p_from_logits_per_row_configs(kind, V, cap):
    x = logits(np.random.default_rng(1), 5, V, kind)
    with force_candidates(cap):
        got, want = sample_rows(x)
    assert_bits(got, want, kind)
    assert got[3] == np.argmax(x[3].astype(np.float32)), "temperature 0: the argmax"


@pytest.mark.parametrize("V, cap", [(29, None), (32, 7)])
def test_joint_order_and_scalar_parameters(V, cap):
    x = logits(np.random.default_rng(2), 3, V, "f16")
    with force_candidates(cap):
        got, want, _, _ = call_both("top_k_top_p_sampling_from_logits", x, 6, 0.6,
                                    filter_apply_order="joint", seed=5)
    assert_bits(got, want, "joint")


@pytest.mark.parametrize("name, args", [
    ("top_k_top_p_sampling_from_probs", (7, 0.8)), ("sampling_from_probs", ()),
    ("top_k_sampling_from_probs", (4,)), ("top_p_sampling_from_probs", (0.6,)),
    ("min_p_sampling_from_probs", (0.15,))])
@pytest.mark.parametrize("V", [33, 36])
def test_from_probs(name, args, V):
    p = probs_of(logits(np.random.default_rng(3), 3, V))
    got, want, _, _ = call_both(name, p, *args, seed=np.array([3, 4, 5], np.int64))
    assert_bits(got, want, name)


@pytest.mark.parametrize("V, cap", [(41, None), (48, None), (48, -1)])
def test_mask_and_renorm(V, cap):
    rng = np.random.default_rng(4)
    x = logits(rng, 3, V, "bf16")
    with force_candidates(cap):
        got, want, _, _ = call_both("top_k_mask_logits", x, np.array([3, 0, 50], np.int32))
    assert_bits(got, want, "mask")
    assert (got[0] != -np.inf).sum() == 3 and (got[1] != -np.inf).all()
    p = probs_of(logits(rng, 3, V))
    for name, arg in (("top_k_renorm_probs", 5), ("top_p_renorm_probs", 0.7)):
        with force_candidates(cap):
            got, want, _, _ = call_both(name, p, arg)
        assert_ulps(got, want, ulps("sampler_renorm", "f32"), name)
        assert np.allclose(got.sum(1), 1, atol=1e-6)


@pytest.mark.parametrize("cap", [None, 6])
@pytest.mark.parametrize("V, kind", [(37, "f32"), (40, "bf16")])
def test_processed_logits_are_the_sampled_set(V, kind, cap):
    """``top_k_top_p_mask_logits`` keeps exactly the tokens the sampler may draw, at
    ``r32(x / T)``; a greedy row keeps its logits (vLLM's processed logits); both orders."""
    x = logits(np.random.default_rng(12), 5, V, kind)
    cfg = dict(temperature=ROWS["temperature"], min_p=ROWS["min_p"])
    for order in ("top_k_first", "joint"):
        with force_candidates(cap):
            got, want, _, _ = call_both("top_k_top_p_mask_logits", x, ROWS["top_k"],
                                        ROWS["top_p"], filter_apply_order=order, **cfg)
        assert_bits(got, want, f"processed {order}")
        xf = x.astype(np.float32)
        assert np.array_equal(got[3], xf[3]), "a greedy row: its logits"
        for r in (0, 1, 2, 4):
            kept = got[r] != -np.inf
            assert np.array_equal(got[r][kept], (xf[r][kept] / ROWS["temperature"][r]
                                                 ).astype(np.float32))
        assert (got[0] != -np.inf).sum() == 5, "top_k = 5"
    tokens = [call_both("top_k_top_p_sampling_from_logits", x, ROWS["top_k"], ROWS["top_p"],
                        seed=s, **cfg)[0] for s in range(3)]
    for t in tokens:
        assert (got[np.arange(5), t] != -np.inf).all(), "a sampled token is a kept one"


def edge_rows():
    """``(logits, top_k, top_p)`` of the distribution contract's edge rows (V = 24)."""
    V = 24
    x = np.linspace(2, -2, V, dtype=np.float32)[None].repeat(6, 0)
    x[0, ::3] = np.nan                       # NaN never sampled
    x[1, :] = -np.inf
    x[1, 17] = 0.5                           # one finite logit
    x[2, [4, 9, 13]] = 5.0                   # a three-way tie at the top, top_k = 2: all kept
    x[3, :] = 1.0                            # all equal, top_p = 0: ties with the top kept
    x[5, :] = np.nan                         # nothing can be kept
    k = np.array([0, 3, 2, 0, 30, 0], np.int32)   # row 4: top_k > V
    p = np.array([1.0, 0.5, 1.0, 0.0, 0.9, 0.5], np.float32)
    return x, k, p


def test_edge_rows():
    x, k, p = edge_rows()
    got, want, _, _ = call_both("top_k_top_p_sampling_from_logits", x, k, p, seed=9)
    assert_bits(got, want, "edges")
    assert not np.isnan(x[0, got[0]]) and got[1] == 17 and got[2] in (4, 9, 13)
    assert got[5] == 0
    got, want, _, _ = call_both("top_k_top_p_mask_logits", x, k, p)
    assert_bits(got, want, "processed edges")
    assert (got[0, ::3] == -np.inf).all() and (got[5] == -np.inf).all(), "NaN dropped"
    assert (got[2] != -np.inf).sum() == 3 and (got[1] != -np.inf).sum() == 1


def test_a_request_keeps_its_token_wherever_it_sits_in_the_batch():
    x = logits(np.random.default_rng(5), 4, 31)
    seeds = np.array([11, 12, 13, 14], np.int64)
    a = loomnb.top_k_top_p_sampling_from_logits(x, 10, 0.9, seed=seeds, offset=3)
    perm = np.array([2, 0, 3, 1])
    b = loomnb.top_k_top_p_sampling_from_logits(x[perm].copy(), 10, 0.9, seed=seeds[perm],
                                                offset=3)
    assert np.array_equal(a[perm], b)
    assert np.array_equal(a, O.top_k_top_p_sampling_from_logits(x, 10, 0.9, seed=seeds, offset=3))
    g3 = O.token_gumbels(31, 11, 3, 0)  # another offset: another stream
    g4 = O.token_gumbels(31, 11, 4, 0)
    assert not np.array_equal(g3, g4)


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_repetition_penalties(kind):
    rng = np.random.default_rng(6)
    x = logits(rng, 3, 45, kind, 3.0)
    x[0, :3] = [np.inf, -np.inf, np.nan]
    pm, om = rng.random((3, 45)) < 0.3, rng.random((3, 45)) < 0.3
    rep = np.array([1.3, 1.0, 0.6], DT[kind])
    got, want, a1, a2 = call_both("apply_repetition_penalties_", x, pm, om, rep)
    assert_bits(a1[0], a2[0], kind)
    assert not np.array_equal(a1[0].view(np.uint8), x.view(np.uint8))


@pytest.mark.parametrize("counts", ["int32", "int64"])
def test_penalties(counts):
    rng = np.random.default_rng(7)
    x = logits(rng, 3, 45, "f32", 3.0)
    pm = rng.random((3, 45)) < 0.2
    c = np.where(rng.random((3, 45)) < 0.3, rng.integers(1, 4, (3, 45)), 0).astype(counts)
    rep = np.array([1.2, 1.0, 0.8], np.float32)
    freq = np.array([0.1, 0.0, -0.4], np.float32)
    pres = np.array([0.3, 0.0, np.inf], np.float32)
    got, want, a1, a2 = call_both("apply_penalties_", x, pm, c, rep, freq, pres)
    assert_bits(got, want, counts)
    assert got is a1[0]


def test_block_size_and_out():
    x = logits(np.random.default_rng(8), 2, 152)  # 16-byte loads, several a thread at 32
    want = O.top_k_top_p_sampling_from_logits(x, 20, 0.8, seed=77)

    def call():
        return loomnb.top_k_top_p_sampling_from_logits(x, 20, 0.8, seed=77)

    block_size_sweep(call, lambda g, w: assert_bits(g, want, w), threads=(32, 64))
    out_given_and_not(lambda out: loomnb.top_k_top_p_sampling_from_logits(x, 20, 0.8, seed=77,
                                                                         out=out),
                      lambda: np.empty(2, np.int32))


# ---------------------------------------------------------------- the split kernels
# A few rows are split over several blocks a row (``force_split``; the launch rule splits
# serving vocabularies at up to 64 rows): the same tokens, masks and sums as the oracle, every
# workspace histogram zero again afterwards. 16-byte rows only (V a multiple of 4 / 8);
# ``S`` from 2 to more blocks than the row has units (empty chunks).
@contextlib.contextmanager
def split(n, threads=32):
    with force_split(n), L.force_threads(threads):
        yield
    for key, buf in W._buffers.items():
        if key[0] in ("sampler_split_hist", "sampler_split_count"):
            assert not np.asarray(buf).any(), f"{key[0]} was left non-zero"


@pytest.mark.parametrize("kind, V, S", [("f32", 40, 3), ("bf16", 48, 2), ("f16", 48, 4),
                                        ("f32", 40, 12)])
def test_split_rows_per_row_configs(kind, V, S):
    x = logits(np.random.default_rng(11), 5, V, kind)
    with split(S):
        got, want = sample_rows(x)
    assert_bits(got, want, kind)
    with split(S):
        got, want, _, _ = call_both("top_k_top_p_sampling_from_logits", x, 6, 0.6,
                                    filter_apply_order="joint", seed=5)
    assert_bits(got, want, "joint")


# A scalar top-k: the first top-k level, its candidates compacted, the row kernel finishing
# each row from them (cap None), from the row when they do not fit (4: some rows' first-level
# bins hold 5 keys, some fewer), or never compacting (-1). The max pass runs only for min-p
# (without it the finisher takes each row's largest, and the greedy row's token, from the
# candidates); one block a row (S = 1, many rows) runs the same launches. The edge rows take
# the finish path too: a row of NaN and -inf, or of NaN only, has its largest from the row.
@pytest.mark.parametrize("S, min_p", [(3, True), (1, False)])
@pytest.mark.parametrize("cap", [None, 4, -1])
@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_split_rows_finished_by_the_row_kernel(kind, cap, S, min_p, monkeypatch):
    x = logits(np.random.default_rng(13), 5, 40 if kind == "f32" else 48, kind)
    specs, launch = [], L.launch

    def recording(factory, spec, *args, **kw):  # this call's launches, in order
        specs.append(spec)
        return launch(factory, spec, *args, **kw)

    monkeypatch.setattr(L, "launch", recording)
    with split(S), force_candidates(cap):
        got, want, _, _ = call_both("top_k_top_p_sampling_from_logits", x, 4, ROWS["top_p"],
                                    temperature=ROWS["temperature"],
                                    min_p=ROWS["min_p"] if min_p else None,
                                    seed=np.arange(5, dtype=np.int64), offset=3)
    assert_bits(got, want, kind)
    assert [type(s).__name__ for s in specs] == ["SplitSpec"] * (2 + min_p) + ["RowSpec"], specs
    assert specs[-1].finish
    if kind == "f32" and cap is None:
        x, _, pp = edge_rows()
        t = np.array([1.0, 0.0, 1.0, 0.7, 0.0, 0.0], np.float32)  # greedy rows among them
        x[4, :3] = [np.nan, -np.inf, -np.inf]
        x[4, 3:] = -np.inf  # greedy over NaN and -inf: the lowest index (NaN as -inf)
        with split(S):
            got, want, _, _ = call_both("top_k_top_p_sampling_from_logits", x, 2, pp,
                                        temperature=t, seed=9)
        assert_bits(got, want, "edges")
        assert got[1] == 17 and got[2] in (4, 9, 13) and got[4] == 0 and got[5] == 0


def test_split_rows_from_probs_mask_renorm_and_edges():
    rng = np.random.default_rng(12)
    p = probs_of(logits(rng, 3, 36))
    with split(3):
        for name, args in (("top_k_top_p_sampling_from_probs", (7, 0.8)),
                           ("min_p_sampling_from_probs", (0.15,)), ("sampling_from_logits", ()),
                           ("top_p_sampling_from_probs", (0.6,))):
            x = np.log(p) if name == "sampling_from_logits" else p
            got, want, _, _ = call_both(name, x, *args, seed=np.array([3, 4, 5], np.int64))
            assert_bits(got, want, name)
        x = logits(rng, 3, 48, "bf16")
        got, want, _, _ = call_both("top_k_mask_logits", x, np.array([3, 0, 50], np.int32))
        assert_bits(got, want, "mask")
        for name, arg in (("top_k_renorm_probs", 5), ("top_p_renorm_probs", 0.7)):
            got, want, _, _ = call_both(name, p, arg)
            assert_ulps(got, want, ulps("sampler_renorm", "f32"), name)
    x, k, pp = edge_rows()
    with split(2):
        got, want, _, _ = call_both("top_k_top_p_sampling_from_logits", x, k, pp, seed=9)
    assert_bits(got, want, "edges")
    assert got[1] == 17 and got[2] in (4, 9, 13) and got[5] == 0
