"""The speculative-verification oracles (plain pass, no kernels) and the ragged batches the
simulator and GPU tests share.

The oracle ``loomnb.oracle.rejection_greedy_sample`` is checked against ``vllm_rule``, vLLM's
Triton kernel transcribed loop for loop: equal on every batch whose targets are argmaxes
(>= 0), different exactly where a negative draft equals a negative target.

``make_batch(rng, counts, max_spec_len, V, accept=...)`` builds one batch from per-request draft
counts: target logits with a known argmax, drafts that follow the target for a random prefix
(so every acceptance length occurs) and then diverge -- a wrong id, the placeholder -1, another
negative id or an id >= V -- and bonus ids. ``RAGGED`` lists the shapes: draft counts from 0 to
max_spec_len mixed in one batch, at batches 1, 8, 32, 128 and 256.
"""

from __future__ import annotations

import numpy as np
import pytest

from loomnb import oracle

MAX_SPEC_LEN = 128


def ragged_counts(rng, num_reqs, max_spec_len, pattern):
    """Draft counts of one batch: ``pattern`` "uniform" (0..max), "full" (all max), "zeros"
    (all 0 but one max), "alternate" (0, max, 0, ...) or "skewed" (mostly 0/1, a few max)."""
    if pattern == "uniform":
        c = rng.integers(0, max_spec_len + 1, num_reqs)
    elif pattern == "full":
        c = np.full(num_reqs, max_spec_len)
    elif pattern == "zeros":
        c = np.zeros(num_reqs, np.int64)
    elif pattern == "alternate":
        c = np.where(np.arange(num_reqs) % 2 == 1, max_spec_len, 0)
    else:
        c = np.where(rng.random(num_reqs) < 0.85, rng.integers(0, 2, num_reqs), max_spec_len)
    c[rng.integers(0, num_reqs)] = max_spec_len  # max_spec_len is the batch's maximum
    return c.astype(np.int64)


# (num_reqs, max_spec_len, pattern): 20 distinct ragged shapes over the five batch sizes
RAGGED = [
    (1, 1, "full"), (1, 4, "uniform"), (1, 16, "full"), (1, 128, "full"),
    (8, 1, "uniform"), (8, 4, "alternate"), (8, 8, "skewed"), (8, 16, "uniform"),
    (32, 3, "zeros"), (32, 4, "uniform"), (32, 8, "alternate"), (32, 33, "skewed"),
    (128, 1, "alternate"), (128, 4, "skewed"), (128, 16, "uniform"), (128, 64, "skewed"),
    (256, 2, "uniform"), (256, 8, "zeros"), (256, 16, "skewed"), (256, 128, "skewed"),
]


def make_batch(rng, counts, max_spec_len, vocab, *, logits_dtype=np.float32, accept=0.7):
    """``dict(draft_token_ids, cu_num_draft_tokens, target_logits, target_argmax,
    bonus_token_ids, max_spec_len)`` for the draft ``counts`` (NumPy arrays)."""
    counts = np.asarray(counts, np.int64)
    num_reqs, num_drafts = len(counts), int(counts.sum())
    cu = np.cumsum(counts).astype(np.int32)
    logits = rng.standard_normal((num_drafts, vocab)).astype(np.float32)
    target = rng.integers(0, vocab, num_drafts)
    logits[np.arange(num_drafts), target] = 10.0  # a clear winner: N(0,1) never reaches it
    logits = logits.astype(logits_dtype)
    drafts = target.copy()
    start = 0
    for n in counts.tolist():
        k = n if accept >= 1 else int(rng.geometric(1 - accept)) - 1  # accepted before the miss
        for p in range(k, n):
            kind = rng.integers(0, 4)
            drafts[start + p] = [(target[start + p] + 1) % vocab, -1, -7, vocab + 3][kind]
        start += n
    bonus = rng.integers(0, vocab, (num_reqs, 1)).astype(np.int32)
    return dict(draft_token_ids=drafts.astype(np.int32), cu_num_draft_tokens=cu,
                target_logits=logits, target_argmax=target.astype(np.int64),
                bonus_token_ids=bonus, max_spec_len=max_spec_len)


def vllm_rule(draft_token_ids, cu_num_draft_tokens, target_argmax, bonus_token_ids, max_spec_len):
    """vLLM's ``rejection_greedy_sample_kernel`` as written (one program per request, a loop over
    its positions, ``draft != target`` rejects), after ``torch.full(-1)``: the independent
    reference the oracle is checked against."""
    cu = [int(c) for c in cu_num_draft_tokens]
    out = np.full((len(cu), max_spec_len + 1), -1, np.int64)
    for r, end in enumerate(cu):
        start = 0 if r == 0 else cu[r - 1]
        rejected = False
        for pos in range(end - start):
            if not rejected:
                d, t = int(draft_token_ids[start + pos]), int(target_argmax[start + pos])
                out[r, pos] = t
                if d != t:
                    rejected = True
        if not rejected:
            out[r, end - start] = int(np.asarray(bonus_token_ids).reshape(-1)[r])
    return out.astype(np.int32)


# ---------------------------------------------------------------- the oracle's own tests
def test_case_a_placeholder_draft_is_a_mismatch():
    """Issue 13's case: drafts [5, 9, -1], target argmax [5, 9, 7] -> [5, 9, 7]."""
    got = oracle.rejection_greedy_sample(np.array([5, 9, -1], np.int32), np.array([3], np.int32),
                                         np.array([5, 9, 7]), np.array([[4]], np.int32), 3)
    assert got.tolist() == [[5, 9, 7, -1]]


@pytest.mark.parametrize("num_reqs, max_spec_len, pattern", RAGGED)
def test_oracle_equals_vllms_loop(num_reqs, max_spec_len, pattern):
    rng = np.random.default_rng(num_reqs * 1000 + max_spec_len)
    b = make_batch(rng, ragged_counts(rng, num_reqs, max_spec_len, pattern), max_spec_len, 50)
    args = (b["draft_token_ids"], b["cu_num_draft_tokens"], b["target_argmax"],
            b["bonus_token_ids"], max_spec_len)
    got = oracle.rejection_greedy_sample(*args)
    assert got.dtype == np.int32 and got.shape == (num_reqs, max_spec_len + 1)
    np.testing.assert_array_equal(got, vllm_rule(*args))
    assert np.array_equal(oracle.spec_decode.target_argmax(b["target_logits"]), b["target_argmax"])
    emitted = (got != -1).sum(axis=1)
    counts = np.diff(np.concatenate([[0], b["cu_num_draft_tokens"]]))
    assert (emitted >= 1).all() and (emitted <= counts + 1).all(), "accepted + 1 tokens per request"


def test_oracle_differs_from_vllm_only_on_equal_negative_ids():
    """vLLM accepts draft -1 against a target -1 (no argmax gives one); loomnb rejects it."""
    args = (np.array([-1, 3], np.int32), np.array([2], np.int32), np.array([-1, 3]),
            np.array([[8]], np.int32), 2)
    assert vllm_rule(*args).tolist() == [[-1, 3, 8]]
    assert oracle.rejection_greedy_sample(*args).tolist() == [[-1, -1, -1]]


def test_oracle_argmax_rules():
    """Lowest index wins ties, the first NaN wins, -0.0 == +0.0, all -inf -> 0."""
    x = np.array([[1, 3, 3, 2], [1, np.nan, 5, np.nan], [-0.0, 0.0, -1, -2],
                  [-np.inf] * 4, [0.0, -0.0, -1, -2]], np.float32)
    assert oracle.spec_decode.target_argmax(x).tolist() == [1, 1, 0, 0, 0]


def test_oracle_parse_output():
    """vLLM's parse_output: drop -1 and ids >= vocab_size, keep order, pack, offsets."""
    rows = np.array([[3, 9, -1], [12, 1, 5], [-1, -1, -1]], np.int32)
    num, emitted, cu = oracle.spec_decode.parse_output(rows, 10, 8)
    assert num.tolist() == [2, 2, 0] and cu.tolist() == [0, 2, 4, 4]
    assert emitted.tolist() == [3, 9, 1, 5, -1, -1, -1, -1]


def test_oracle_impossible_rows_stay_placeholder():
    """cu decreasing, beyond num_draft_tokens, or a count above max_spec_len: all -1."""
    d = np.array([1, 2, 3, 4], np.int32)
    got = oracle.rejection_greedy_sample(d, np.array([3, 1, 4, 9], np.int32), d.astype(np.int64),
                                         np.array([[7], [8], [9], [6]], np.int32), 2)
    assert got.tolist() == [[-1, -1, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]
    got = oracle.rejection_greedy_sample(d, np.array([2, 2, 4], np.int32), d.astype(np.int64),
                                         np.array([[7], [8], [9]], np.int32), 2)
    assert got.tolist() == [[1, 2, 7], [8, -1, -1], [3, 4, 9]]


# ---------------------------------------------------------------- torch custom ops (CPU trace)
@pytest.mark.nosim
def test_fullgraph_trace_one_node_per_op():
    """Dynamo on meta tensors: each op is one torch.ops.loomnb node, outputs from the fakes."""
    torch = pytest.importorskip("torch")
    import loomnb
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(d, cu, logits, bonus, rows):
        out = loomnb.greedy_verify(d, cu, logits, bonus, 4, 1000)
        loomnb.rejection_greedy_sample(d, cu, logits.argmax(-1), bonus, 4, out=rows)
        return out

    meta = dict(device="meta")
    d, cu = torch.empty(10, dtype=torch.int32, **meta), torch.empty(3, dtype=torch.int32, **meta)
    logits = torch.empty(10, 1024, dtype=torch.bfloat16, **meta)
    bonus, rows = torch.empty(3, 1, dtype=torch.int32, **meta), torch.empty(3, 5, dtype=torch.int32, **meta)
    torch._dynamo.reset()
    o, num, emitted, cu_out = torch.compile(f, backend=backend, fullgraph=True)(d, cu, logits, bonus, rows)
    nodes = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert [t for t in nodes if t.startswith("loomnb.")] == ["loomnb.greedy_verify.default",
                                                             "loomnb.rejection_greedy_sample.out"]
    assert o.shape == (3, 5) and num.shape == (3,) and emitted.shape == (13,) and cu_out.shape == (4,)
    assert all(t.dtype == torch.int32 for t in (o, num, emitted, cu_out))
