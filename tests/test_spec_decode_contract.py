"""Bad input to the speculative-verification ops gets a clear error before any launch, and
nothing the caller passed is modified (the error-message table of the family template).

Runs in the simulator pass (NumPy arrays are the device arrays there); the GPU-only cases
(host arrays, another device) are in ``test_spec_decode_gpu.py``.
"""

import numpy as np
import pytest

import loomnb
from loomnb import LoomnbTypeError, LoomnbValueError

from family import rejects

pytestmark = pytest.mark.sim


def _batch():
    d = np.array([5, 9, -1, 2], np.int32)
    cu = np.array([3, 3, 4], np.int32)
    t = np.array([5, 9, 7, 2], np.int64)
    bonus = np.array([[1], [2], [3]], np.int32)
    logits = np.zeros((4, 16), np.float32)
    return d, cu, t, bonus, logits


R = loomnb.rejection_greedy_sample
G = loomnb.greedy_verify
TABLE = [
    (lambda d, cu, t, b, x: R(d.astype(np.int16), cu, t, b, 3), LoomnbTypeError,
     r"rejection_greedy_sample: argument 'draft_token_ids' must be of dtype int32 or int64; got dtype int16"),
    (lambda d, cu, t, b, x: G(d.astype(np.float32), cu, x, b, 3), LoomnbTypeError,
     r"greedy_verify: argument 'draft_token_ids' must be of dtype int32 or int64; got dtype float32"),
    (lambda d, cu, t, b, x: R(d, cu.astype(np.int64), t, b, 3), LoomnbTypeError,
     r"argument 'cu_num_draft_tokens' must be of dtype int32; got dtype int64"),
    (lambda d, cu, t, b, x: R(d, cu, t.astype(np.float32), b, 3), LoomnbTypeError,
     r"argument 'target_argmax' must be of dtype int32 or int64; got dtype float32"),
    (lambda d, cu, t, b, x: R(d, cu, t[:3], b, 3), LoomnbValueError,
     r"argument 'target_argmax' must be of shape \[4\] \(\[num_draft_tokens\]\); got shape \[3\]"),
    (lambda d, cu, t, b, x: R(d, cu, t, b.astype(np.uint32), 3), LoomnbTypeError,
     r"argument 'bonus_token_ids' must be of dtype int32 or int64; got dtype uint32"),
    (lambda d, cu, t, b, x: G(d, cu, x, b.astype(np.float64), 3), LoomnbTypeError,
     r"greedy_verify: argument 'bonus_token_ids' must be of dtype int32 or int64; got dtype float64"),
    (lambda d, cu, t, b, x: R(d, cu, t, b[:2], 3), LoomnbValueError,
     r"argument 'bonus_token_ids' must be of shape \[3, 1\] \(\[num_reqs, 1\]\) or \[3\]; got shape \[2, 1\]"),
    (lambda d, cu, t, b, x: R(d.reshape(2, 2), cu, t, b, 3), LoomnbValueError,
     r"argument 'draft_token_ids' must be 1-D; got a 2-D array of shape \[2, 2\]"),
    (lambda d, cu, t, b, x: R(d, cu, t, b, 129), LoomnbValueError,
     r"argument 'max_spec_len' must be an int in \[0, 128\]; got 129"),
    (lambda d, cu, t, b, x: R(d, cu, t, b, -1), LoomnbValueError,
     r"argument 'max_spec_len' must be an int in \[0, 128\]; got -1"),
    (lambda d, cu, t, b, x: R(d, cu, t, b, 3.0), LoomnbTypeError,
     r"argument 'max_spec_len' must be an int; got 3.0"),
    (lambda d, cu, t, b, x: R(d, cu, t, b, True), LoomnbTypeError,
     r"argument 'max_spec_len' must be an int; got True"),
    (lambda d, cu, t, b, x: R(d, cu, t, b, 1), LoomnbValueError,
     r"argument 'max_spec_len' must be at least the batch's largest draft count "
     r"\(num_draft_tokens 4 > num_reqs 3 x max_spec_len\); got 1"),
    (lambda d, cu, t, b, x: R(d, cu, t, b, 3, out=np.zeros((3, 4), np.int64)), LoomnbTypeError,
     r"argument 'out' must be of dtype int32; got dtype int64"),
    (lambda d, cu, t, b, x: R(d, cu, t, b, 3, out=np.zeros((3, 3), np.int32)), LoomnbValueError,
     r"argument 'out' must be of shape \[3, 4\]"),
    (lambda d, cu, t, b, x: R(d, cu, t, b, 3, out=np.broadcast_to(np.zeros(4, np.int32), (3, 4))),
     LoomnbValueError, r"argument 'out' must be a writable array"),
    (lambda d, cu, t, b, x: R([5, 9], cu, t, b, 3), LoomnbTypeError,
     r"argument 'draft_token_ids' must be a NumPy array \(simulator\); got builtins.list"),
    (lambda d, cu, t, b, x: G(d, cu, x.astype(np.float64), b, 3), LoomnbTypeError,
     r"greedy_verify: argument 'target_logits' must be of dtype bfloat16 or float16 or float32; "
     r"got dtype float64"),
    (lambda d, cu, t, b, x: G(d, cu, x[:3], b, 3), LoomnbValueError,
     r"argument 'target_logits' must be of shape \[4, V\] \(\[num_draft_tokens, V\], V >= 1\) "
     r"or \[..., V\] holding num_draft_tokens rows; got shape \[3, 16\]"),
    (lambda d, cu, t, b, x: G(d, cu, x[:, :0], b, 3), LoomnbValueError,
     r"argument 'target_logits' must be of shape \[4, V\]"),
    (lambda d, cu, t, b, x: G(d, cu, x[0], b, 3), LoomnbValueError,
     r"argument 'target_logits' must be of shape \[4, V\]"),
    (lambda d, cu, t, b, x: G(d, cu, x[:, ::2], b, 3), LoomnbValueError,
     r"argument 'target_logits' must be contiguous in its last dimension"),
    (lambda d, cu, t, b, x: G(d, cu, x, b, 3, vocab_size=-1), LoomnbValueError,
     r"argument 'vocab_size' must be an int >= 0; got -1"),
    (lambda d, cu, t, b, x: G(d, cu, x, b, 3, vocab_size=16.0), LoomnbTypeError,
     r"argument 'vocab_size' must be an int; got 16.0"),
    (lambda d, cu, t, b, x: G(d, cu, x, b, 3, emitted_token_ids=np.zeros(6, np.int32)), LoomnbValueError,
     r"argument 'emitted_token_ids' must be of shape \[7\]"),
    (lambda d, cu, t, b, x: G(d, cu, x, b, 3, cu_num_emitted=np.zeros(3, np.int32)), LoomnbValueError,
     r"argument 'cu_num_emitted' must be of shape \[4\]"),
    (lambda d, cu, t, b, x: G(d, cu, x, b, 3, num_emitted=np.zeros(3, np.float32)), LoomnbTypeError,
     r"argument 'num_emitted' must be of dtype int32; got dtype float32"),
]


@pytest.mark.parametrize("row", range(len(TABLE)))
def test_bad_input_is_rejected_before_launch(row):
    call, exc, match = TABLE[row]
    d, cu, t, b, x = _batch()
    rejects(lambda: call(d, cu, t, b, x), exc, match, d, cu, t, b, x)


def test_outputs_must_not_overlap_inputs_or_each_other():
    d, cu, t, b, x = _batch()
    wide = np.zeros((3, 8), np.int32)
    drafts_in_out = wide.reshape(-1)[:4]
    rejects(lambda: R(drafts_in_out, cu, t, b, 3, out=wide[:, :4]), LoomnbValueError,
            r"argument 'out' must be a buffer that does not overlap 'draft_token_ids'", wide, cu, t, b)
    rows = np.zeros((3, 4), np.int32)
    rejects(lambda: G(d, cu, x, b, 3, output_token_ids=rows, num_emitted=rows[0, :3]),
            LoomnbValueError, r"argument 'output_token_ids' must be a buffer that does not overlap "
            r"'num_emitted'", rows, d, cu, b, x)


def test_read_only_outputs_are_rejected():
    d, cu, t, b, x = _batch()
    out = np.zeros((3, 4), np.int32)
    out.flags.writeable = False
    rejects(lambda: R(d, cu, t, b, 3, out=out), LoomnbValueError,
            r"argument 'out' must be a writable array; got a read-only array", d, cu, t, b, out)


def test_num_draft_tokens_must_fit_the_rows():
    """N drafts need max_spec_len >= N / num_reqs; no drafts at all allow max_spec_len 0."""
    d, cu, t, b, x = _batch()
    rejects(lambda: G(d, cu, x, b, 0), LoomnbValueError, r"argument 'max_spec_len' must be at least",
            d, cu, b, x)
    e = np.zeros(0, np.int32)
    assert R(e, np.zeros(3, np.int32), e, b, 0).tolist() == [[1], [2], [3]]
