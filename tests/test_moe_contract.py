"""Bad input to the MoE ops gets a clear error naming the argument, expected and received,
before any launch, and nothing the caller passed is modified (the error table of the family
template). Simulator pass (NumPy arrays are the device arrays there); the torch custom-op
schemas in the plain pass at the end.
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb import LoomnbTypeError, LoomnbValueError

from family import rejects

BF16 = ml_dtypes.bfloat16
V, T = LoomnbValueError, LoomnbTypeError


def make():
    return dict(g=np.zeros((3, 16), np.float32), gb=np.zeros((3, 16), BF16),
                b=np.zeros(16, np.float32), ids=np.array([[0, 1], [2, 3], [1, 5]], np.int32),
                w=np.ones((3, 2), np.float32), h=np.ones((3, 8), BF16),
                s=np.array([0, 1, 6, 6, 2, 3, 6, 6], np.int32), y=np.ones((8, 8), BF16),
                x=np.ones((3, 2, 8), BF16), out=np.zeros((3, 8), BF16),
                emap=np.arange(8, dtype=np.int32))


CASES = [
    # routing
    ("softmax dtype", T, r"'gating_output'",
     lambda a: loomnb.topk_softmax(a["g"].astype(np.int32), 2), ()),
    ("softmax 1-D", V, r"'gating_output' must be of shape \[num_tokens, num_experts\]",
     lambda a: loomnb.topk_softmax(a["g"][0], 2), ()),
    ("softmax too many experts", V, r"'gating_output' must be at most 1024 experts",
     lambda a: loomnb.topk_softmax(np.zeros((1, 1025), np.float32), 2), ()),
    ("softmax strided", V, r"'gating_output' must be contiguous in its last dimension",
     lambda a: loomnb.topk_softmax(a["g"][:, ::2], 2), ()),
    ("softmax topk range", V, r"'topk' must be 1 <= topk <= min\(num_experts, 32\)",
     lambda a: loomnb.topk_softmax(a["g"], 17), ()),
    ("softmax topk zero", V, r"'topk'", lambda a: loomnb.topk_softmax(a["g"], 0), ()),
    ("softmax renormalize bool", T, r"'renormalize'",
     lambda a: loomnb.topk_softmax(a["g"], 2, 1), ()),
    ("softmax bias shape", V, r"'e_score_correction_bias' must be of shape \[num_experts\] = \[16\]",
     lambda a: loomnb.topk_softmax(a["g"], 2, e_score_correction_bias=a["b"][:8]), ()),
    ("softmax bias dtype", T, r"'e_score_correction_bias'",
     lambda a: loomnb.topk_softmax(a["g"], 2, e_score_correction_bias=a["b"].astype(BF16)), ()),
    ("softmax out shape", V, r"'topk_weights'",
     lambda a: loomnb.topk_softmax(a["g"], 2, topk_weights=np.zeros((3, 3), np.float32)), ()),
    ("sigmoid ids dtype", T, r"'topk_ids'",
     lambda a: loomnb.topk_sigmoid(a["g"], 2, topk_ids=np.zeros((3, 2), np.int64)), ()),
    ("grouped hidden rows", V, r"'hidden_states' must be shape\[0\] == num_tokens \(3\)",
     lambda a: loomnb.grouped_topk(a["h"][:2], a["g"], 2, True, 4, 2), ()),
    ("grouped groups divide", V, r"'num_expert_group' must be a divisor of num_experts \(16\)",
     lambda a: loomnb.grouped_topk(a["h"], a["g"], 2, True, 3, 2), ()),
    ("grouped no groups", V, r"'num_expert_group' must be 1 <= num_expert_group <= 32",
     lambda a: loomnb.grouped_topk(a["h"], a["g"], 2, True), ()),
    ("grouped topk_group", V, r"'topk_group' must be 1 <= topk_group <= 4",
     lambda a: loomnb.grouped_topk(a["h"], a["g"], 2, True, 4, 5), ()),
    ("grouped topk too many", V, r"'topk' must be 1 <= topk <= min\(topk_group",
     lambda a: loomnb.grouped_topk(a["h"], a["g"], 9, True, 4, 2), ()),
    ("grouped scoring", V, r"'scoring_func'",
     lambda a: loomnb.grouped_topk(a["h"], a["g"], 2, True, 4, 2, "relu"), ()),
    ("grouped bias needs pairs", V, r"groups of at least 2 experts",
     lambda a: loomnb.grouped_topk(a["h"], a["g"], 2, True, 16, 4, "sigmoid", 1.0, a["b"]), ()),
    ("grouped scale finite", V, r"'routed_scaling_factor'",
     lambda a: loomnb.grouped_topk(a["h"], a["g"], 2, True, 4, 2, "sigmoid", float("nan")), ()),
    # align
    ("align ids dtype", T, r"'topk_ids'",
     lambda a: loomnb.moe_align_block_size(a["ids"].astype(np.float32), 4, 8), ()),
    ("align block_size", V, r"'block_size' must be 1 <= block_size",
     lambda a: loomnb.moe_align_block_size(a["ids"], 0, 8), ()),
    ("align num_experts", V, r"'num_experts' must be 1 <= num_experts <= 1024",
     lambda a: loomnb.moe_align_block_size(a["ids"], 4, 2000), ()),
    ("align expert_map shape", V, r"'expert_map' must be of shape \[num_experts\] = \[6\]",
     lambda a: loomnb.moe_align_block_size(a["ids"], 4, 6, a["emap"]), ()),
    ("align expert_map dtype", T, r"'expert_map'",
     lambda a: loomnb.moe_align_block_size(a["ids"], 4, 8, a["emap"].astype(np.int64)), ()),
    ("align not flat", V, r"'topk_ids' must be an array whose elements, in C order, are equally",
     lambda a: loomnb.moe_align_block_size(np.zeros((4, 6), np.int32)[:, :2], 4, 8), ()),
    ("align output length", V, r"'sorted_token_ids'",
     lambda a: loomnb.moe_align_block_size(a["ids"], 4, 8,
                                           sorted_token_ids=np.zeros(5, np.int32)), ()),
    # rows
    ("permute ids dtype", T, r"'sorted_token_ids'",
     lambda a: loomnb.moe_permute(a["h"], a["s"].astype(np.int64), 2), ()),
    ("permute quant", V, r"'quant_dtype'",
     lambda a: loomnb.moe_permute(a["h"], a["s"], 2, "int8"), ()),
    ("permute ub without fp8", V, r"'scale_ub' must be None without quant_dtype='fp8'",
     lambda a: loomnb.moe_permute(a["h"], a["s"], 2, "none", np.ones(1, np.float32)), ()),
    ("permute strided", V, r"'hidden_states' must be contiguous in its last dimension",
     lambda a: loomnb.moe_permute(np.ones((3, 16), BF16)[:, ::2], a["s"], 2), ()),
    ("permute out dtype", T, r"'out'",
     lambda a: loomnb.moe_permute(a["h"], a["s"], 2, out=a["y"].astype(np.float32)), ()),
    ("unpermute rows", V, r"'sorted_token_ids' must be of shape \[L\] = \[8\]",
     lambda a: loomnb.moe_unpermute(a["y"], a["s"][:4], a["w"]), ()),
    ("unpermute weights dtype", T, r"'topk_weights'",
     lambda a: loomnb.moe_unpermute(a["y"], a["s"], a["w"].astype(BF16)), ()),
    ("unpermute out shape", V, r"'out'",
     lambda a: loomnb.moe_unpermute(a["y"], a["s"], a["w"], out=np.zeros((2, 8), BF16)), ("out",)),
    ("sum 2-D", V, r"'input' must be a 3-D array",
     lambda a: loomnb.moe_sum(a["h"]), ()),
    ("sum out overlaps input", V, r"'out'",
     lambda a: loomnb.moe_sum(a["x"], out=a["x"][:, 0]), ("x",)),
]


@pytest.mark.sim
@pytest.mark.parametrize("what, exc, match, call, keep", CASES, ids=[c[0] for c in CASES])
def test_error_table(what, exc, match, call, keep):
    a = make()
    rejects(lambda: call(a), exc, match, *[a[k] for k in keep])


@pytest.mark.sim
def test_empty_calls_are_noops():
    a = make()
    w, i, t = loomnb.topk_softmax(a["g"][:0], 2)
    assert w.shape == (0, 2) and i.shape == (0, 2) and t.shape == (0, 2)
    w, i = loomnb.grouped_topk(a["h"][:0], a["g"][:0], 2, True, 4, 2)
    assert w.shape == (0, 2)
    s, e, n = loomnb.moe_align_block_size(a["ids"][:0], 4, 8)
    assert s.shape == (0,) and e.shape == (0,)  # N = 0 < E: L = min(0 * 4, ...) = 0
    out = a["out"].copy()
    loomnb.moe_unpermute(a["y"], a["s"], a["w"][:0], out=np.zeros((0, 8), BF16))
    assert loomnb.moe_sum(a["x"][:0]).shape == (0, 8)
    assert np.array_equal(a["out"].view(np.uint16), out.view(np.uint16))


@pytest.mark.nosim
def test_torch_schemas():
    import torch
    s = str(torch.ops.loomnb.moe_align_block_size.default._schema)
    assert "Tensor topk_ids, int block_size, int num_experts, Tensor? expert_map=None" in s
    s = str(torch.ops.loomnb.grouped_topk.default._schema)
    assert 'str scoring_func="softmax", float routed_scaling_factor=1.' in s
    s = str(torch.ops.loomnb.topk_softmax.default._schema)
    assert "-> (Tensor, Tensor, Tensor)" in s
