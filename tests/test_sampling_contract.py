"""Bad input gets a clear error before any launch, and nothing the caller passed is modified
(the error-message table of the family template), for the sampling family.

Runs in the simulator pass (NumPy arrays are the device arrays there); host-array and
cross-device cases are GPU-only (``test_sampling_gpu.py``).
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb import LoomnbTypeError, LoomnbValueError

from family import rejects

pytestmark = pytest.mark.sim


def _x(rows=3, vocab=16, dtype=np.float32):
    return np.random.default_rng(0).standard_normal((rows, vocab)).astype(dtype)


T = np.array([1, 2, 3], np.int64)
MP = np.array([0.1, 0.1, 0.1], np.float32)

TABLE = [
    (lambda x: loomnb.greedy_sample_logprob(x.astype(np.float64)), LoomnbTypeError,
     r"argument 'logits' must be of dtype float32 or bfloat16; got dtype float64"),
    (lambda x: loomnb.greedy_sample_logprob(x[0]), LoomnbValueError,
     r"argument 'logits' must be 2-D; got a 1-D array of shape \[16\]"),
    (lambda x: loomnb.greedy_sample_logprob(x[:, :0]), LoomnbValueError,
     r"argument 'logits' must be of shape \[num_rows, vocab_size\] with vocab_size >= 1"),
    (lambda x: loomnb.greedy_sample_logprob(x[:, ::2]), LoomnbValueError,
     r"argument 'logits' must be contiguous in its last dimension"),
    (lambda x: loomnb.greedy_sample_logprob(x, "v3"), LoomnbValueError,
     r"argument 'sampler' must be one of 'v1', 'v2'; got 'v3'"),
    (lambda x: loomnb.greedy_sample_logprob(x, token_ids=np.empty(3, np.int32)), LoomnbTypeError,
     r"argument 'token_ids' must be of dtype int64; got dtype int32"),
    (lambda x: loomnb.greedy_sample_logprob(x, ranks=np.empty(4, np.int64)), LoomnbValueError,
     r"argument 'ranks' must be of shape \[3\]"),
    (lambda x: loomnb.greedy_sample_logprob(x, logprobs=x[:, 0]), LoomnbValueError,
     r"argument 'logprobs' must be a buffer that does not overlap 'logits'"),
    (lambda x: loomnb.greedy_sample_logprob([[1.0]]), LoomnbTypeError,
     r"argument 'logits' must be a NumPy array \(simulator\); got builtins.list"),
    (lambda x: loomnb.selected_token_logprob_rank(x, T.astype(np.int32)), LoomnbTypeError,
     r"argument 'token_ids' must be of dtype int64; got dtype int32"),
    (lambda x: loomnb.selected_token_logprob_rank(x, T[:2]), LoomnbValueError,
     r"argument 'token_ids' must be of shape \[3\] \(\[num_rows\]\); got shape \[2\]"),
    (lambda x: loomnb.selected_token_logprob_rank(x, T, logprobs=np.broadcast_to(np.float32(0), (3,))),
     LoomnbValueError, r"argument 'logprobs' must be a writable array"),
    (lambda x: loomnb.top_k_logprobs(x, 21), LoomnbValueError,
     r"argument 'k' must be 0 <= k <= 20 \(vLLM's max_logprobs\); got 21"),
    (lambda x: loomnb.top_k_logprobs(x, -1), LoomnbValueError, r"argument 'k' must be 0 <= k <= 20"),
    (lambda x: loomnb.top_k_logprobs(x, True), LoomnbTypeError, r"argument 'k' must be an int; got True"),
    (lambda x: loomnb.top_k_logprobs(x, 2.0), LoomnbTypeError, r"argument 'k' must be an int; got 2.0"),
    (lambda x: loomnb.top_k_logprobs(x[:, :4], 5), LoomnbValueError,
     r"argument 'k' must be at most vocab_size \(4\); got 5"),
    (lambda x: loomnb.top_k_logprobs(x, 2, indices=np.empty((3, 3), np.int64)), LoomnbTypeError,
     r"argument 'indices' must be of dtype int32; got dtype int64"),
    (lambda x: loomnb.top_k_logprobs(x, 2, logprobs=np.empty((3, 2), np.float32)), LoomnbValueError,
     r"argument 'logprobs' must be of shape \[3, 3\]"),
    (lambda x: loomnb.min_p_filter_(x.astype(ml_dtypes.bfloat16), MP), LoomnbTypeError,
     r"argument 'logits' must be of dtype float32; got dtype bfloat16"),
    (lambda x: loomnb.min_p_filter_(x, MP.astype(np.float64)), LoomnbTypeError,
     r"argument 'min_p' must be of dtype float32; got dtype float64"),
    (lambda x: loomnb.min_p_filter_(x, MP[:2]), LoomnbValueError,
     r"argument 'min_p' must be of shape \[3\] \(\[num_rows\]\); got shape \[2\]"),
    (lambda x: loomnb.min_p_filter_(x, MP, sampler="V1"), LoomnbValueError,
     r"argument 'sampler' must be one of 'v1', 'v2'; got 'V1'"),
    (lambda x: loomnb.min_p_filter_(np.broadcast_to(x[:1], x.shape), MP), LoomnbValueError,
     r"argument 'logits' must be a writable array"),
    (lambda x: loomnb.min_p_filter_(x, x[0, :3]), LoomnbValueError,
     r"argument 'logits' must be a buffer that does not overlap 'min_p'"),
]


@pytest.mark.parametrize("row", range(len(TABLE)))
def test_bad_input_is_rejected_before_launch(row):
    call, exc, match = TABLE[row]
    x = _x()
    rejects(lambda: call(x), exc, match, x)


def test_read_only_logits_are_fine_for_the_logprob_ops():
    x = _x()
    x.flags.writeable = False
    tok, lp, rank = loomnb.greedy_sample_logprob(x)
    assert tok.shape == (3,)
    rejects(lambda: loomnb.min_p_filter_(x, MP), LoomnbValueError,
            "argument 'logits' must be a writable array; got a read-only array", x)
