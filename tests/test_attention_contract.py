"""Bad input to paged_decode_attention and merge_attn_states gets a clear error before any
launch, and nothing the caller passed is modified (the error-message table of the family
template). Runs in the simulator pass (NumPy arrays are the device arrays there); the torch
custom-op schemas and the trace are checked in the plain pass at the end.
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb import LoomnbTypeError, LoomnbValueError

from family import rejects
from test_attention_cases import make_case, op_args

BF16 = ml_dtypes.bfloat16


def _case(**kw):
    base = dict(seq_lens=[5, 3], num_heads=4, num_kv_heads=2, head_size=16, block_size=4)
    base.update(kw)
    return make_case(0, **base)


def _call(case, **changes):
    args, kw = op_args(case)
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "scale")
    a = dict(zip(names, args))
    for k, v in changes.items():
        (a if k in a else kw)[k] = v
    return lambda: loomnb.paged_decode_attention(*(a[n] for n in names), **kw)


def _strided_negative(c):
    return c["key_cache"][::-1]


def _set(name, index, value):
    """A changed copy of the case's array ``name``: ``index`` set to ``value``."""
    def change(c):
        a = c[name].copy()
        a[index] = value
        return a
    return change


TABLE = [
    (dict(query=lambda c: c["query"].astype(np.float64)), LoomnbTypeError,
     r"argument 'query' must be of dtype bfloat16 or float16 or float32; got dtype float64"),
    (dict(query=lambda c: c["query"][0]), LoomnbValueError, r"argument 'query' must be 3-D"),
    (dict(key_cache=lambda c: c["key_cache"].astype(np.float16)), LoomnbTypeError,
     r"argument 'key_cache' must be of the query's dtype \(bfloat16\) with kv_cache_dtype='auto'"),
    (dict(kv_cache_dtype=lambda c: "fp8", k_scale=lambda c: np.ones(1, np.float32),
          v_scale=lambda c: np.ones(1, np.float32)), LoomnbTypeError,
     r"argument 'key_cache' must be of dtype float8_e4m3fn or uint8; got dtype bfloat16"),
    (dict(kv_cache_dtype=lambda c: "fp8_e5m2"), LoomnbValueError,
     r"argument 'kv_cache_dtype' must be 'auto', 'fp8' or 'fp8_e4m3' \(E5M2 caches are not supported\)"),
    (dict(kv_cache_dtype=lambda c: "int8"), LoomnbValueError,
     r"argument 'kv_cache_dtype' must be one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'; got 'int8'"),
    (dict(value_cache=lambda c: c["value_cache"][..., None]), LoomnbValueError,
     r"argument 'value_cache' must be 4-D \[num_blocks, block_size, num_kv_heads, head_size\]"),
    (dict(key_cache=lambda c: c["key_cache"][0]), LoomnbValueError,
     r"argument 'key_cache' must be 4-D .* or the 5-D x-packed"),
    (dict(key_cache=lambda c: c["key_cache"][:, :2]), LoomnbValueError,
     r"argument 'key_cache' must be of logical shape \[6, 4, 2, 16\] like 'value_cache' "
     r"\(\[num_blocks, block_size, num_kv_heads, head_size\]\); got shape \[6, 2, 2, 16\]"),
    # each message names the argument at fault (issue 23: these named 'value_cache' in garbled
    # wording for a problem of the query's)
    (dict(query=lambda c: c["query"][:, :, :8]), LoomnbValueError,
     r"argument 'value_cache' must be of logical shape \[num_blocks, block_size, num_kv_heads, 8\] "
     r"\(head_size 8 from 'query'\); got shape \[6, 4, 2, 16\] \(head_size 16\)"),
    (dict(query=lambda c: c["query"][:, :3]), LoomnbValueError,
     r"paged_decode_attention: argument 'query' must be of shape \[num_seqs, num_heads, head_size\] "
     r"with num_heads a multiple of num_kv_heads = 2 \(from 'value_cache'; .*\); got num_heads 3"),
    (dict(query=lambda c: c["query"][:, :, :0]), LoomnbValueError,
     r"argument 'query' must be of shape \[num_seqs, num_heads, head_size\] with head_size in "
     r"\[1, 256\]; got shape \[2, 4, 0\]"),
    (dict(key_cache=lambda c: c["key_cache"][:, :0], value_cache=lambda c: c["value_cache"][:, :0]),
     LoomnbValueError, r"argument 'value_cache' must be of logical shape \[num_blocks, block_size, "
     r"num_kv_heads, head_size\] with block_size >= 1; got shape \[6, 0, 2, 16\] \(block_size 0\)"),
    (dict(key_cache=lambda c: c["key_cache"][:, :, :0], value_cache=lambda c: c["value_cache"][:, :, :0]),
     LoomnbValueError, r"argument 'value_cache' must be of logical shape .* with num_kv_heads >= 1; "
     r"got shape \[6, 4, 0, 16\] \(num_kv_heads 0\)"),
    (dict(value_cache=lambda c: c["value_cache"].astype(np.float16)), LoomnbTypeError,
     r"argument 'value_cache' must be of the query's dtype \(bfloat16\) with kv_cache_dtype='auto'; "
     r"got dtype float16"),
    (dict(block_tables=lambda c: c["block_tables"].astype(np.int64)), LoomnbTypeError,
     r"argument 'block_tables' must be of dtype int32 \(vLLM's index dtype; not cast\)"),
    (dict(block_tables=lambda c: c["block_tables"][0]), LoomnbValueError,
     r"argument 'block_tables' must be 2-D"),
    (dict(block_tables=lambda c: c["block_tables"][:1]), LoomnbValueError,
     r"argument 'block_tables' must be of shape \[2, 4\] \(\[num_seqs, max_blocks\], num_seqs "
     r"from 'query'\); got shape \[1, 4\]"),
    (dict(seq_lens=lambda c: c["seq_lens"].astype(np.int64)), LoomnbTypeError,
     r"argument 'seq_lens' must be of dtype int32"),
    (dict(seq_lens=lambda c: c["seq_lens"][:1]), LoomnbValueError,
     r"argument 'seq_lens' must be of shape \[2\] \(\[num_seqs\], num_seqs from 'query'\); got shape \[1\]"),
    (dict(seq_lens=lambda c: c["seq_lens"].reshape(2, 1)), LoomnbValueError,
     r"argument 'seq_lens' must be 1-D; got a 2-D array of shape \[2, 1\]"),
    (dict(scale=lambda c: float("nan")), LoomnbValueError, r"argument 'scale' must be finite"),
    (dict(scale=lambda c: "0.25"), LoomnbTypeError, r"argument 'scale' must be a real number"),
    (dict(softcap=lambda c: -1.0), LoomnbValueError, r"argument 'softcap' must be finite and >= 0"),
    (dict(sliding_window=lambda c: 0), LoomnbValueError,
     r"argument 'sliding_window' must be None or an int >= 1"),
    (dict(sliding_window=lambda c: True), LoomnbValueError, r"argument 'sliding_window'"),
    (dict(max_seq_len=lambda c: -1), LoomnbValueError, r"argument 'max_seq_len' must be None or an int >= 0"),
    (dict(return_lse=lambda c: 1), LoomnbTypeError, r"argument 'return_lse' must be a bool; got 1"),
    (dict(k_scale=lambda c: np.ones(3, np.float32)), LoomnbValueError,
     r"argument 'k_scale' must be a float32 array of shape \[1\] or \[num_kv_heads\] = \[2\]"),
    (dict(v_scale=lambda c: np.ones(1, BF16)), LoomnbTypeError, r"argument 'v_scale' must be of dtype float32"),
    (dict(out=lambda c: np.empty((2, 4, 16), np.float32)), LoomnbTypeError,
     r"argument 'out' must be of dtype bfloat16; got dtype float32"),
    (dict(out=lambda c: np.empty((2, 4, 8), BF16)), LoomnbValueError, r"argument 'out' must be of shape \[2, 4, 16\]"),
    (dict(out=lambda c: c["query"]), LoomnbValueError,
     r"argument 'out' must be a buffer that does not overlap 'query'"),
    (dict(out=lambda c: np.broadcast_to(np.zeros((1, 4, 16), BF16), (2, 4, 16))), LoomnbValueError,
     r"argument 'out' must be a writable array"),
    (dict(lse=lambda c: np.empty((2, 4), np.float32)), LoomnbValueError,
     r"argument 'lse' must be of shape \[4, 2\]"),
    (dict(key_cache=_strided_negative, value_cache=lambda c: c["value_cache"][::-1]), LoomnbValueError,
     r"argument 'value_cache' must be a view with non-negative strides"),
    (dict(query=lambda c: [[1.0]]), LoomnbTypeError,
     r"argument 'query' must be a NumPy array \(simulator\); got builtins.list"),
    # check_indices=True (simulator: a host check before the launch; torch: a device assert).
    # The case: 6 blocks of 4 tokens, max_blocks 4, seq_lens [5, 3] (columns 0-1 and 0 read).
    (dict(block_tables=_set("block_tables", (0, 1), 6), check_indices=lambda c: True),
     LoomnbValueError, r"paged_decode_attention: argument 'block_tables' must be in \[0, 5\] "
     r"\(num_blocks = 6\) in the columns each sequence's seq_len reads \(check_indices=True\); "
     r"got 6 at index \[0, 1\]"),
    (dict(block_tables=_set("block_tables", (1, 0), -1), check_indices=lambda c: True),
     LoomnbValueError, r"argument 'block_tables' must be in \[0, 5\] .*; got -1 at index \[1, 0\]"),
    (dict(seq_lens=_set("seq_lens", 1, 17), check_indices=lambda c: True), LoomnbValueError,
     r"argument 'seq_lens' must be in \[0, 16\] \(max_blocks \* block_size = 4 \* 4\) "
     r"\(check_indices=True\); got 17 at index \[1\]"),
    (dict(seq_lens=_set("seq_lens", 0, -1), check_indices=lambda c: True), LoomnbValueError,
     r"argument 'seq_lens' must be in \[0, 16\] .*; got -1 at index \[0\]"),
    (dict(check_indices=lambda c: 1), LoomnbTypeError, r"argument 'check_indices' must be a bool; got 1"),
]


@pytest.mark.sim
@pytest.mark.parametrize("row", range(len(TABLE)))
def test_bad_input_is_rejected_before_launch(row):
    changes, exc, match = TABLE[row]
    case = _case()
    vals = {k: f(case) for k, f in changes.items()}
    arrays = [case[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
    arrays += [v for v in vals.values() if isinstance(v, np.ndarray) and v.flags.writeable]
    rejects(_call(case, **vals), exc, match, *arrays)


@pytest.mark.sim
def test_fp8_cache_needs_both_scales():
    case = make_case(1, seq_lens=[3], num_heads=2, num_kv_heads=1, head_size=16, block_size=4,
                     cache="fp8")
    rejects(_call(case, v_scale=None), LoomnbValueError,
            r"argument 'v_scale' must be a float32 device array \(\[1\] or \[num_kv_heads\]\) "
            r"with kv_cache_dtype='fp8'; got None", case["key_cache"])


@pytest.mark.sim
def test_x_packed_key_must_pack_16_bytes():
    case = make_case(2, seq_lens=[3], num_heads=2, num_kv_heads=1, head_size=16, block_size=4,
                     layout="legacy")
    k5 = case["key_cache"]  # [num_blocks, 1, 2, 4, 8]
    wrong = k5.reshape(k5.shape[0], 1, 4, 4, 4)
    rejects(_call(case, key_cache=wrong), LoomnbValueError,
            r"argument 'key_cache' must be of shape \[num_blocks, num_kv_heads, head_size // x, "
            r"block_size, x\] with x = 8 \(the x-packed key: 16 bytes of the cache dtype\); "
            r"got shape \[4, 1, 4, 4, 4\]", k5)


def _states():
    rng = np.random.default_rng(0)
    p = rng.standard_normal((3, 2, 16)).astype(BF16)
    return p, np.zeros((2, 3), np.float32), p.copy(), np.zeros((2, 3), np.float32)


STATES_TABLE = [
    (lambda o, p, pl, s, sl: loomnb.merge_attn_states(o[0], p, pl, s, sl), LoomnbValueError,
     r"argument 'output' must be 3-D"),
    (lambda o, p, pl, s, sl: loomnb.merge_attn_states(o, p.astype(np.float32), pl, s, sl), LoomnbTypeError,
     r"argument 'prefix_output' must be of the same dtype as 'output' \(bfloat16\)"),
    (lambda o, p, pl, s, sl: loomnb.merge_attn_states(o, p, pl.T.copy(), s, sl), LoomnbValueError,
     r"argument 'prefix_lse' must be of shape \[2, 3\] \(\[num_heads, num_tokens\] from 'output'\)"),
    (lambda o, p, pl, s, sl: loomnb.merge_attn_states(o, p, pl, s[:, :1], sl), LoomnbValueError,
     r"argument 'suffix_output' must be of shape \[3, 2, 16\] \(\[num_tokens, num_heads, head_size\] "
     r"like 'output'\); got shape \[3, 1, 16\]"),
    (lambda o, p, pl, s, sl: loomnb.merge_attn_states(o, p, pl, s, sl, np.zeros((3, 2), np.float32)),
     LoomnbValueError, r"argument 'output_lse' must be of shape \[2, 3\]"),
    (lambda o, p, pl, s, sl: loomnb.merge_attn_states(o, p, pl, s, sl.astype(np.float64)), LoomnbTypeError,
     r"argument 'suffix_lse' must be of dtype float32"),
    (lambda o, p, pl, s, sl: loomnb.merge_attn_states(p, p, pl, s, sl), LoomnbValueError,
     r"argument 'output' must be a buffer that does not overlap 'prefix_output'"),
    (lambda o, p, pl, s, sl: loomnb.merge_attn_states(o, p, None, s, sl), LoomnbTypeError,
     r"argument 'prefix_lse' must be a float32 array \[num_heads, num_tokens\]; got None"),
    (lambda o, p, pl, s, sl: loomnb.merge_attn_states(o, p, pl, s, sl, pl), LoomnbValueError,
     r"argument 'output_lse' must be a buffer that does not overlap 'prefix_lse'"),
]


@pytest.mark.sim
@pytest.mark.parametrize("row", range(len(STATES_TABLE)))
def test_merge_attn_states_rejects(row):
    call, exc, match = STATES_TABLE[row]
    p, pl, s, sl = _states()
    o = np.zeros_like(p)
    rejects(lambda: call(o, p, pl, s, sl), exc, match, o, p, pl, s, sl)


# ---------------------------------------------------------------- torch custom ops (plain pass)
@pytest.mark.nosim
def test_schemas_and_one_node_each_under_torch_compile():
    """Both ops are torch.ops.loomnb custom ops; a traced module calling them directly gets one
    node per call and no graph break, ``return_lse`` picking what the Python op returns (the
    registered op always returns both)."""
    torch = pytest.importorskip("torch")
    s = str(torch.ops.loomnb.paged_decode_attention.default._schema)
    assert s.endswith("-> (Tensor, Tensor)") and "int? max_seq_len=None" in s
    assert "bool check_indices=False" in s.split("*")[1]  # keyword-only, default off
    assert "Tensor(z!) out, Tensor(y!) lse" in str(torch.ops.loomnb.paged_decode_attention.out._schema)
    s = str(torch.ops.loomnb.merge_attn_states.default._schema)
    assert "Tensor(a!) output" in s and "Tensor(b!)? output_lse=None" in s and s.endswith("-> ()")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, kc, vc, bt, sl, prev, prev_lse):
        o = loomnb.paged_decode_attention(q, kc, vc, bt, sl, 0.125)
        o2, lse = loomnb.paged_decode_attention(q, kc, vc, bt, sl, 0.125, return_lse=True,
                                                check_indices=True)
        loomnb.merge_attn_states(o2, prev, prev_lse, o2.clone(), lse)
        return o + 1, o2, lse

    m = dict(device="meta")
    q = torch.empty(3, 8, 64, dtype=torch.bfloat16, **m)
    kv = torch.empty(10, 2, 16, 2, 64, dtype=torch.bfloat16, **m)
    bt = torch.empty(3, 4, dtype=torch.int32, **m)
    sl = torch.empty(3, dtype=torch.int32, **m)
    prev, prev_lse = torch.empty_like(q), torch.empty(8, 3, **m)
    torch._dynamo.reset()
    o, o2, lse = torch.compile(f, backend=backend, fullgraph=True)(q, kv[:, 0], kv[:, 1], bt, sl,
                                                                  prev, prev_lse)
    assert len(graphs) == 1
    nodes = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"
             and str(n.target).startswith("loomnb.")]
    assert nodes == ["loomnb.paged_decode_attention.default",
                     "loomnb.paged_decode_attention.default", "loomnb.merge_attn_states.default"]
    calls = [n for n in graphs[0].graph.nodes if str(n.target) == "loomnb.paged_decode_attention.default"]
    assert [n.kwargs.get("check_indices", False) for n in calls] == [False, True]
    assert o.shape == q.shape and lse.shape == (8, 3) and lse.dtype == torch.float32
