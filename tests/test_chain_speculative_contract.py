"""Bad input to ``chain_speculative_sampling`` gets a clear error naming the argument, what was
expected and what came, before any launch, and nothing the caller passed is modified (the
family's error-message table, as ``tests/test_sampler_contract.py``); an empty batch is a no-op.

Runs in the simulator pass (NumPy arrays are the device arrays there). ``loomnb.ops._launch.
launch`` is replaced by a function that fails the test: no call here launches a kernel. Draft
ids outside the vocabulary are not an error (they are rejected by the rule:
``tests/test_chain_speculative_sim.py``).
"""

import re

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb import LoomnbTypeError, LoomnbValueError

from family import Launched, no_launch, rejects  # noqa: F401 (no_launch: a fixture)

pytestmark = [pytest.mark.sim, pytest.mark.usefixtures("no_launch")]

OP = "chain_speculative_sampling"
T, V = LoomnbTypeError, LoomnbValueError
B, N, VOCAB = 3, 2, 16


def make():
    rng = np.random.default_rng(0)
    tp = rng.random((B, N + 1, VOCAB)).astype(np.float32)
    dp = rng.random((B, N, VOCAB)).astype(np.float32)
    return dict(draft_probs=dp / dp.sum(-1, keepdims=True),
                draft_token_ids=rng.integers(0, VOCAB, (B, N)).astype(np.int32),
                target_probs=tp / tp.sum(-1, keepdims=True),
                maybe_output_accepted_token_num=np.zeros(B, np.int32),
                maybe_output_emitted_draft_token_num=np.zeros(B, np.int32),
                seed=np.array([1, 2, 3], np.int64))


POSITIONAL = ("draft_probs", "draft_token_ids", "target_probs")


def call(a, over):
    """The op on valid arguments (an int seed) with ``over`` replacing them; returns (the call,
    every NumPy array it passes)."""
    over = dict(over)
    args = [over.pop(n) if n in over else a[n] for n in POSITIONAL]
    over.setdefault("seed", 7)
    arrays = [x for x in (*args, *over.values()) if isinstance(x, np.ndarray)]
    return (lambda: getattr(loomnb, OP)(*args, **over)), arrays


def msg(name, expected, got):
    return "^" + re.escape(f"loomnb.{OP}: argument '{name}' must be {expected}; got {got}") + "$"


TP_SHAPE = ("of shape [batch_size, num_speculative_tokens + 1, vocab_size] = [3, 3, vocab_size] "
            "with 1 <= vocab_size <= 2097152")
DP_SHAPE = ("of shape [3, 2, 16] ([batch_size, num_speculative_tokens, vocab_size], vocab_size "
            "from 'target_probs')")
IDS_SHAPE = ("of shape [batch_size, num_speculative_tokens] with 1 <= num_speculative_tokens "
             "<= 1024")
STRIDED = "contiguous in its last dimension (stride 1)"
SEED = "an int or an int64 tensor"


def _ro(x):
    x = x.copy()
    x.setflags(write=False)
    return x


CASES = [  # (what, overrides(a), error, message)
    # draft_token_ids
    ("ids int64", lambda a: {"draft_token_ids": a["draft_token_ids"].astype(np.int64)}, T,
     msg("draft_token_ids", "of dtype int32", "dtype int64")),
    ("ids float", lambda a: {"draft_token_ids": a["draft_token_ids"].astype(np.float32)}, T,
     msg("draft_token_ids", "of dtype int32", "dtype float32")),
    ("ids 1-D", lambda a: {"draft_token_ids": a["draft_token_ids"][:, 0]}, V,
     msg("draft_token_ids", "2-D", "a 1-D array of shape [3]")),
    ("no draft tokens", lambda a: {"draft_token_ids": a["draft_token_ids"][:, :0]}, V,
     msg("draft_token_ids", IDS_SHAPE, "shape [3, 0]")),
    ("1025 draft tokens", lambda a: {"draft_token_ids": np.zeros((B, 1025), np.int32)}, V,
     msg("draft_token_ids", IDS_SHAPE, "shape [3, 1025]")),
    ("ids a list", lambda a: {"draft_token_ids": a["draft_token_ids"].tolist()}, T,
     msg("draft_token_ids", "a NumPy array (simulator)", "builtins.list")),
    # target_probs
    ("target bf16", lambda a: {"target_probs": a["target_probs"].astype(ml_dtypes.bfloat16)}, T,
     msg("target_probs", "of dtype float32", "dtype bfloat16")),
    ("target float64", lambda a: {"target_probs": a["target_probs"].astype(np.float64)}, T,
     msg("target_probs", "of dtype float32", "dtype float64")),
    ("target 2-D", lambda a: {"target_probs": a["target_probs"][:, 0]}, V,
     msg("target_probs", "3-D", "a 2-D array of shape [3, 16]")),
    ("target n rows, not n + 1", lambda a: {"target_probs": a["target_probs"][:, :N]}, V,
     msg("target_probs", TP_SHAPE, "shape [3, 2, 16]")),
    ("target batch", lambda a: {"target_probs": a["target_probs"][:2]}, V,
     msg("target_probs", TP_SHAPE, "shape [2, 3, 16]")),
    ("vocab_size 0", lambda a: {"target_probs": a["target_probs"][..., :0],
                                "draft_probs": None}, V,
     msg("target_probs", TP_SHAPE, "shape [3, 3, 0]")),
    ("target strided last dim", lambda a: {"target_probs": a["target_probs"][..., ::2],
                                           "draft_probs": a["draft_probs"][..., ::2]}, V,
     msg("target_probs", STRIDED, "strides (48, 16, 2) (in elements)")),
    # draft_probs
    ("draft bf16", lambda a: {"draft_probs": a["draft_probs"].astype(ml_dtypes.bfloat16)}, T,
     msg("draft_probs", "of dtype float32", "dtype bfloat16")),
    ("draft 2-D", lambda a: {"draft_probs": a["draft_probs"][:, 0]}, V,
     msg("draft_probs", "3-D", "a 2-D array of shape [3, 16]")),
    ("draft n + 1 rows", lambda a: {"draft_probs": a["target_probs"]}, V,
     msg("draft_probs", DP_SHAPE, "shape [3, 3, 16]")),
    ("draft vocab differs", lambda a: {"draft_probs": a["draft_probs"][..., :8]}, V,
     msg("draft_probs", DP_SHAPE, "shape [3, 2, 8]")),
    ("draft strided last dim",
     lambda a: {"draft_probs": np.repeat(a["draft_probs"], 2, -1)[..., ::2]}, V,
     msg("draft_probs", STRIDED, "strides (64, 32, 2) (in elements)")),
    # the accumulators and out
    ("accepted int64", lambda a: {"maybe_output_accepted_token_num": np.zeros(B, np.int64)}, T,
     msg("maybe_output_accepted_token_num", "of dtype int32", "dtype int64")),
    ("accepted rows", lambda a: {"maybe_output_accepted_token_num": np.zeros(B + 1, np.int32)}, V,
     msg("maybe_output_accepted_token_num", "of shape [3] (from 'target_probs')", "shape [4]")),
    ("emitted 2-D", lambda a: {"maybe_output_emitted_draft_token_num": np.zeros((B, 1), np.int32)},
     V, msg("maybe_output_emitted_draft_token_num", "of shape [3] (from 'target_probs')",
            "shape [3, 1]")),
    ("emitted read-only",
     lambda a: {"maybe_output_emitted_draft_token_num":
                _ro(a["maybe_output_emitted_draft_token_num"])},
     V, msg("maybe_output_emitted_draft_token_num", "a writable array", "a read-only array")),
    ("one array for both counts", lambda a: {
        "maybe_output_accepted_token_num": a["maybe_output_accepted_token_num"],
        "maybe_output_emitted_draft_token_num": a["maybe_output_accepted_token_num"]}, V,
     msg("maybe_output_accepted_token_num",
         "a buffer that does not overlap 'maybe_output_emitted_draft_token_num'",
         "overlapping memory (the same memory)")),
    ("out shape", lambda a: {"out": np.zeros((B, N), np.int32)}, V,
     msg("out", "of shape [3, 3] (from 'target_probs')", "shape [3, 2]")),
    ("out int64", lambda a: {"out": np.zeros((B, N + 1), np.int64)}, T,
     msg("out", "of dtype int32", "dtype int64")),
    # options and the random stream
    ("deterministic 1", lambda a: {"deterministic": 1}, T, msg("deterministic", "a bool", "1")),
    ("generator", lambda a: {"generator": object()}, T,
     "^" + re.escape(f"loomnb.{OP}: argument 'generator' must be a torch.Generator (with torch "
                     "tensors) or None; got <object object at")),
    ("seed float", lambda a: {"seed": 1.0}, T, msg("seed", SEED, "1.0")),
    ("seed int32 tensor", lambda a: {"seed": a["seed"].astype(np.int32)}, T,
     msg("seed", "of dtype int64", "dtype int32")),
    ("seed rows", lambda a: {"seed": a["seed"][:2]}, V,
     msg("seed", "of shape [num_rows] (3) or [1]", "shape [2]")),
    ("offset bool", lambda a: {"offset": True}, T, msg("offset", SEED, "True")),
    ("offset beyond 64 bits", lambda a: {"offset": 1 << 64}, V,
     msg("offset", "an int that fits 64 bits", "18446744073709551616")),
]


@pytest.mark.parametrize("what, over, exc, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_before_any_launch(what, over, exc, match):
    a = make()
    fn, arrays = call(a, over(a))
    rejects(fn, exc, match, *arrays, *a.values())


def test_empty_batch_is_a_no_op():
    a = make()
    acc = np.zeros(0, np.int32)
    out, got_acc, emi = loomnb.chain_speculative_sampling(
        a["draft_probs"][:0], a["draft_token_ids"][:0], a["target_probs"][:0], acc, seed=1)
    assert out.shape == (0, N + 1) and out.dtype == np.int32
    assert got_acc is acc and emi.shape == (0,) and emi.dtype == np.int32
    out, _, _ = loomnb.chain_speculative_sampling(None, a["draft_token_ids"][:0],
                                                  a["target_probs"][:0], seed=np.zeros(0, np.int64))
    assert out.shape == (0, N + 1)


def test_valid_arguments_reach_the_launch():
    """The table's base call is valid: only the launch stops it."""
    a = make()
    for over in ({}, {"draft_probs": None}, {"seed": a["seed"], "offset": np.array([4], np.int64)},
                 {"maybe_output_accepted_token_num": a["maybe_output_accepted_token_num"]}):
        fn, _ = call(a, over)
        with pytest.raises(Launched):
            fn()
