"""The paged decode attention oracle's own checks (plain pass, no kernels): the float64 oracle
(``loomnb.oracle.attention``) reads the same rows through every KV layout, a split at any point
merged with ``merge_exact`` equals the whole, and its special cases (q = 0, seq_len 0, a window
of one token). The cases are ``tests/test_attention_cases.py``'s.
"""

import numpy as np
import pytest

from loomnb.oracle.attention import merge_exact
from test_attention_cases import LAYOUTS, exact, exact_suffix, make_case


@pytest.mark.nosim
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_every_layout_gathers_the_same_rows(layout, cache):
    """The oracle reads the same float64 keys and values through every layout (same seed:
    the same random rows), and its softmax weights sum to one."""
    base = make_case(1, seq_lens=[17, 5], num_heads=4, num_kv_heads=2, head_size=32,
                     block_size=4, cache=cache, layout="nhd")
    case = make_case(1, seq_lens=[17, 5], num_heads=4, num_kv_heads=2, head_size=32,
                     block_size=4, cache=cache, layout=layout)
    o1, l1, v1 = exact(base)
    o2, l2, v2 = exact(case)
    assert np.array_equal(o1, o2) and np.array_equal(l1, l2) and np.array_equal(v1, v2)
    assert np.isfinite(o1).all(), "NaN-filled slots were read"


@pytest.mark.nosim
def test_oracle_split_and_merge_equals_the_whole():
    """Attention over [0, L) equals the merge of [0, a) (seq_len a) and [a, L) (window L - a):
    the LSE convention of decode and merge agree (natural log, [num_heads, num_seqs])."""
    case = make_case(2, seq_lens=[40, 23], num_heads=6, num_kv_heads=2, head_size=16,
                     block_size=8)
    whole, lse, _ = exact(case)
    pre = dict(case, seq_lens=np.array([25, 10], np.int32))
    o1, l1, _ = exact(pre)
    o2, l2, _ = exact_suffix(case, [15, 13])
    o, merged_lse, _ = merge_exact(o1, l1, o2, l2)
    np.testing.assert_allclose(o, whole, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(merged_lse, lse, rtol=1e-12)


@pytest.mark.nosim
def test_oracle_special_cases():
    """q = 0: the mean of the visible values; seq_len 0: out 0, lse -inf; a window of 1: the
    last value; softcap bounds the logits."""
    case = make_case(3, seq_lens=[19, 0, 5], num_heads=2, num_kv_heads=1, head_size=8,
                     block_size=4, q_zero=True)
    o, lse, _ = exact(case)
    for s, L in enumerate(case["seq_lens"]):
        j = np.arange(L)
        blk, off = case["block_tables"][s, j // 4], j % 4
        v = case["value_cache"][blk, off].astype(np.float64)  # [L, 1, 8]
        want = v.mean(axis=0) if L else np.zeros((1, 8))
        np.testing.assert_allclose(o[s], np.repeat(want, 2, axis=0), atol=1e-12)
    assert np.isneginf(lse[:, 1]).all() and (o[1] == 0).all()
    np.testing.assert_allclose(lse[:, 0], np.log(19.0))
    o1, _, _ = exact(case, sliding_window=1)
    np.testing.assert_allclose(o1[0, 0], case["value_cache"][case["block_tables"][0, 4], 2, 0])
