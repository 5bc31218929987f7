"""Bad input to the RoPE / KV-cache ops gets a clear error naming the argument, expected and
received, before any launch, and nothing the caller passed is modified (the error table of the
family template). Simulator pass (NumPy arrays are the device arrays there); the GPU-only
cases (host arrays, devices, the device-side ``check_indices`` assert) are in
``test_rope_cache_gpu.py``; the torch custom-op schemas and a trace are checked in the plain
pass at the end.
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb import LoomnbTypeError, LoomnbValueError
from loomnb.layouts import paged_kv as pk

from family import rejects

BF16 = ml_dtypes.bfloat16
T, HQ, HK, D = 3, 4, 2, 32


def make():
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((T, (HQ + 2 * HK) * D)).astype(BF16)
    q, k, v = qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HK) * D], qkv[:, (HQ + HK) * D:]
    cs = rng.standard_normal((16, D)).astype(BF16)
    pos = np.array([0, 5, 9], np.int64)
    kvc = pk.allocate_kv_cache("interleaved_nhd", 2, 16, HK, D, BF16, lib="numpy", fill=0)
    kc, vc = pk.kv_views(kvc, "interleaved_nhd")
    slots = np.array([1, -1, 20], np.int64)
    s = np.ones(1, np.float32)
    return dict(qkv=qkv, q=q, k=k, v=v, cs=cs, pos=pos, kvc=kvc, kc=kc, vc=vc, slots=slots, s=s,
                k3=k.reshape(T, HK, D), v3=v.reshape(T, HK, D))


def legacy(a):
    """A legacy (x-packed key, transposed value) cache pair of 2 blocks of 16, zero-filled."""
    return (np.zeros((2, HK, D // 8, 16, 8), BF16), np.zeros((2, HK, D, 16), BF16))


def rope(a, **kw):
    args = dict(positions=a["pos"], query=a["q"], key=a["k"], head_size=D, cos_sin_cache=a["cs"],
                is_neox=True)
    args.update(kw)
    return loomnb.rotary_embedding(**args)


def cache(a, **kw):
    args = dict(key=a["k3"], value=a["v3"], key_cache=a["kc"], value_cache=a["vc"],
                slot_mapping=a["slots"], kv_cache_dtype="auto", k_scale=a["s"], v_scale=a["s"])
    args.update(kw)
    return loomnb.reshape_and_cache_flash(**args)


def fused(a, **kw):
    args = dict(positions=a["pos"], query=a["q"], key=a["k"], value=a["v"], key_cache=a["kc"],
                value_cache=a["vc"], slot_mapping=a["slots"], head_size=D,
                cos_sin_cache=a["cs"], is_neox=True)
    args.update(kw)
    return loomnb.rotary_embedding_and_cache(**args)


TABLE = [
    (lambda a: rope(a, positions=a["pos"].astype(np.int32)), LoomnbTypeError,
     r"loomnb.rotary_embedding: argument 'positions' must be of dtype int64; got dtype int32"),
    (lambda a: rope(a, positions=a["pos"][:2]), LoomnbValueError,
     r"argument 'query' must be of shape \[2, ...\]"),
    (lambda a: rope(a, query=a["q"].astype(np.float64)), LoomnbTypeError,
     r"argument 'query' must be of dtype bfloat16 or float16 or float32; got dtype float64"),
    (lambda a: rope(a, key=a["k"].astype(np.float16)), LoomnbTypeError,
     r"argument 'key' must be of the same dtype as 'query' \(bfloat16\); got dtype float16"),
    (lambda a: rope(a, head_size=24), LoomnbValueError,
     r"argument 'query' must be a last dimension that is a positive multiple of head_size = 24"),
    (lambda a: rope(a, head_size=0), LoomnbValueError, r"argument 'head_size' must be an int >= 1"),
    (lambda a: rope(a, head_size=32.0), LoomnbTypeError, r"argument 'head_size' must be an int"),
    (lambda a: rope(a, cos_sin_cache=a["cs"][:, :7]), LoomnbValueError,
     r"argument 'cos_sin_cache' must be an even rot_dim = cos_sin_cache.shape\[1\] >= 2"),
    (lambda a: rope(a, cos_sin_cache=a["cs"].astype(np.float16)), LoomnbTypeError,
     r"argument 'cos_sin_cache' must be of dtype bfloat16 or float32; got dtype float16"),
    (lambda a: rope(a, rope_dim_offset=2), LoomnbValueError,
     r"argument 'cos_sin_cache' must be rot_dim \+ rope_dim_offset <= head_size = 32"),
    (lambda a: rope(a, rope_dim_offset=-1), LoomnbValueError,
     r"argument 'rope_dim_offset' must be an int >= 0"),
    (lambda a: rope(a, is_neox=1), LoomnbTypeError, r"argument 'is_neox' must be a bool; got 1"),
    (lambda a: rope(a, inverse="no"), LoomnbTypeError, r"argument 'inverse' must be a bool"),
    (lambda a: rope(a, fma="fast"), LoomnbValueError,
     r"argument 'fma' must be one of 'vllm', 'none'; got 'fast'"),
    (lambda a: rope(a, query=a["qkv"][:, ::2][:, :HQ * D]), LoomnbValueError,
     r"argument 'query' must be contiguous in its last dimension"),
    (lambda a: rope(a, key=a["qkv"][:, HQ * D - D:(HQ + HK) * D - D]), LoomnbValueError,
     r"argument 'query' must be a buffer that does not overlap 'key'"),
    (lambda a: rope(a, query=np.broadcast_to(a["q"][:1], a["q"].shape)), LoomnbValueError,
     r"argument 'query' must be a writable array"),
    (lambda a: rope(a, query=[[1.0]]), LoomnbTypeError,
     r"argument 'query' must be a NumPy array \(simulator\); got builtins.list"),
    (lambda a: cache(a, kv_cache_dtype="int8"), LoomnbValueError,
     r"argument 'kv_cache_dtype' must be one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'; got 'int8'"),
    (lambda a: cache(a, kv_cache_dtype="fp8"), LoomnbTypeError,
     r"argument 'key_cache' must be of dtype float8_e4m3fn or uint8; got dtype bfloat16"),
    (lambda a: cache(a, key=a["k"]), LoomnbValueError,
     r"argument 'key' must be 3-D \[num_tokens, num_kv_heads, head_size\]"),
    (lambda a: cache(a, value=a["v3"][:, :1]), LoomnbValueError,
     r"argument 'value' must be of shape \[3, 2, 32\] like 'key' \(\[num_tokens, num_kv_heads, "
     r"head_size\]; num_kv_heads \* head_size when 2-D\); got shape \[3, 1, 32\]"),
    # key and value with different numbers of tokens, either way round, 3-D or 2-D value
    (lambda a: cache(a, value=a["v3"][:2]), LoomnbValueError,
     r"argument 'value' must be of shape \[3, 2, 32\] like 'key' .*; got shape \[2, 2, 32\]"),
    (lambda a: cache(a, key=a["k3"][:2], slot_mapping=a["slots"][:2]), LoomnbValueError,
     r"reshape_and_cache_flash: argument 'value' must be of shape \[2, 2, 32\] like 'key' .*; "
     r"got shape \[3, 2, 32\]"),
    (lambda a: cache(a, value=a["v"][:2]), LoomnbValueError,
     r"argument 'value' must be of shape \[3, 2, 32\] like 'key' .*; got shape \[2, 64\]"),
    (lambda a: loomnb.reshape_and_cache(a["k3"], a["v3"][:2], *legacy(a), a["slots"], "auto",
                                        None, None), LoomnbValueError,
     r"reshape_and_cache: argument 'value' must be of shape \[3, 2, 32\] like 'key'"),
    (lambda a: cache(a, slot_mapping=a["slots"][:, None]), LoomnbValueError,
     r"argument 'slot_mapping' must be 1-D \[num_tokens\]; got a 2-D array of shape \[3, 1\]"),
    (lambda a: cache(a, value_cache=a["vc"][:1]), LoomnbValueError,
     r"argument 'value_cache' must be of shape \[2, 16, 2, 32\] like 'key_cache'; got shape \[1, 16, 2, 32\]"),
    (lambda a: loomnb.reshape_and_cache(a["k3"], a["v3"], legacy(a)[0], legacy(a)[1][:, :, :, :8],
                                        a["slots"], "auto", None, None), LoomnbValueError,
     r"argument 'value_cache' must be of shape \[2, 2, 32, 16\] \(\[num_blocks, num_kv_heads, "
     r"head_size, block_size\]\); got shape \[2, 2, 32, 8\]"),
    (lambda a: cache(a, kv_cache_dtype="fp8", key_cache=a["kc"].view(np.uint8)[..., :D],
                     value_cache=a["vc"].view(np.uint8)[..., :D], v_scale=np.ones(3, np.float32)),
     LoomnbValueError, r"argument 'v_scale' must be a float32 array of shape \[1\] or "
     r"\[num_kv_heads\] = \[2\]; got shape \[3\]"),
    (lambda a: cache(a, slot_mapping=a["slots"].astype(np.int32)), LoomnbTypeError,
     r"argument 'slot_mapping' must be of dtype int64; got dtype int32"),
    (lambda a: cache(a, slot_mapping=np.zeros(4, np.int64)), LoomnbValueError,
     r"argument 'slot_mapping' must be of length at most 3 \(the num_tokens of 'key' and "
     r"'value'; .*\); got length 4"),
    (lambda a: cache(a, key_cache=a["kc"][:, :, :1]), LoomnbValueError,
     r"argument 'key_cache' must be 4-D \[num_blocks, block_size, 2, 32\]"),
    (lambda a: cache(a, value_cache=a["kc"]), LoomnbValueError,
     r"argument 'key_cache' must be a buffer that does not overlap 'value_cache'"),
    (lambda a: cache(a, k_scale=np.ones(3, np.float32)), LoomnbValueError,
     r"argument 'k_scale' must be a float32 array of shape \[1\] or \[num_kv_heads\] = \[2\]"),
    (lambda a: cache(a, kv_cache_dtype="fp8_e5m2", key_cache=a["kc"].view(np.uint16)[..., :0],
                     value_cache=a["vc"]), LoomnbTypeError,
     r"argument 'key_cache' must be of dtype float8_e5m2 or uint8"),
    (lambda a: loomnb.reshape_and_cache(a["k3"], a["v3"], a["kc"], a["vc"], a["slots"], "auto",
                                        None, None), LoomnbValueError,
     r"argument 'key_cache' must be 5-D \[num_blocks, 2, 32 // x, block_size, x\] with x = 16 // 2 = 8"),
    (lambda a: fused(a, key=None), LoomnbValueError,
     r"loomnb.rotary_embedding_and_cache: argument 'key' must be an array"),
    (lambda a: fused(a, cos_sin_cache=a["cs"].astype(np.float32)), LoomnbTypeError,
     r"argument 'cos_sin_cache' must be of the same dtype as 'query' \(bfloat16\)"),
    (lambda a: fused(a, value=a["v"][:2]), LoomnbValueError,
     r"argument 'value' must be of shape \[3, ...\]"),
    (lambda a: fused(a, value=a["v"][:, :D]), LoomnbValueError,
     r"rotary_embedding_and_cache: argument 'value' must be of shape \[3, 2, 32\] like 'key' .*; "
     r"got shape \[3, 32\]"),
    (lambda a: fused(a, slot_mapping=np.zeros(4, np.int64)), LoomnbValueError,
     r"rotary_embedding_and_cache: argument 'slot_mapping' must be of length at most 3"),
    (lambda a: fused(a, key_cache=a["kc"][:, :, :1], value_cache=a["vc"][:, :, :1]),
     LoomnbValueError, r"argument 'key_cache' must be 4-D \[num_blocks, block_size, 2, 32\]"),
    (lambda a: fused(a, key_cache=a["kvc"][:, 0, :, :, :], value_cache=a["kvc"][:, 0]),
     LoomnbValueError, r"argument 'key_cache' must be a buffer that does not overlap 'value_cache'"),
    (lambda a: fused(a, kv_cache_dtype="fp8_e4m3"), LoomnbTypeError,
     r"argument 'key_cache' must be of dtype float8_e4m3fn or uint8; got dtype bfloat16"),
    # check_indices=True (simulator: a host check before the launch; torch: a device assert)
    (lambda a: cache(a, slot_mapping=np.array([1, -1, 32], np.int64), check_indices=True),
     LoomnbValueError, r"reshape_and_cache_flash: argument 'slot_mapping' must be -1 or in "
     r"\[0, 31\] \(slots of num_blocks \* block_size = 32\) \(check_indices=True\); got 32 at index \[2\]"),
    (lambda a: cache(a, slot_mapping=np.array([1, -2, 3], np.int64), check_indices=True),
     LoomnbValueError, r"argument 'slot_mapping' must be -1 or in \[0, 31\] .*; got -2 at index \[1\]"),
    (lambda a: loomnb.reshape_and_cache(a["k3"], a["v3"], *legacy(a), np.array([0, 40, 1], np.int64),
                                        "auto", None, None, check_indices=True), LoomnbValueError,
     r"reshape_and_cache: argument 'slot_mapping' must be -1 or in \[0, 31\] .*; got 40 at index \[1\]"),
    (lambda a: cache(a, check_indices=1), LoomnbTypeError,
     r"argument 'check_indices' must be a bool; got 1"),
    (lambda a: rope(a, positions=np.array([0, 16, 9], np.int64), check_indices=True),
     LoomnbValueError, r"rotary_embedding: argument 'positions' must be in \[0, 15\] \(rows of "
     r"cos_sin_cache: max_position = 16\) \(check_indices=True\); got 16 at index \[1\]"),
    (lambda a: rope(a, positions=np.array([[0, -1, 9]], np.int64), query=a["q"][None],
                    key=a["k"][None], check_indices=True),
     LoomnbValueError, r"argument 'positions' must be in \[0, 15\] .*; got -1 at index \[0, 1\]"),
    (lambda a: loomnb.apply_rope_with_cos_sin_cache(np.array([0, 99, 9], np.int64), a["q"], a["k"],
                                                    D, a["cs"], check_indices=True),
     LoomnbValueError, r"apply_rope_with_cos_sin_cache: argument 'positions' must be in \[0, 15\]"),
    (lambda a: fused(a, slot_mapping=np.array([1, 99, 20], np.int64), check_indices=True),
     LoomnbValueError, r"rotary_embedding_and_cache: argument 'slot_mapping' must be -1 or in \[0, 31\]"),
    (lambda a: fused(a, positions=np.array([0, 5, 16], np.int64), check_indices=True),
     LoomnbValueError, r"rotary_embedding_and_cache: argument 'positions' must be in \[0, 15\]"),
    (lambda a: fused(a, key_cache=a["q"].reshape(T, 1, HQ, D)[:, :, :HK],
                     value_cache=np.zeros((T, 1, HK, D), BF16)),
     LoomnbValueError, r"argument 'query' must be a buffer that does not overlap 'key_cache'"),
]


@pytest.mark.sim
@pytest.mark.parametrize("row", range(len(TABLE)))
def test_bad_input_is_rejected_before_launch(row):
    call, exc, match = TABLE[row]
    a = make()
    rejects(lambda: call(a), exc, match, a["qkv"], a["kvc"], a["cs"], a["pos"], a["slots"])


@pytest.mark.sim
def test_fp8_needs_scales():
    a = make()
    kvc = pk.allocate_kv_cache("interleaved_nhd", 2, 16, HK, D, np.uint8, lib="numpy", fill=0)
    kc, vc = pk.kv_views(kvc, "interleaved_nhd")
    rejects(lambda: cache(a, key_cache=kc, value_cache=vc, kv_cache_dtype="fp8", k_scale=None),
            LoomnbValueError, r"argument 'k_scale' must be a float32 device array for "
            r"kv_cache_dtype 'fp8'; got None", kvc, a["qkv"])


@pytest.mark.sim
def test_interleaved_qkv_slices_and_kv_pages_are_accepted():
    """q/k/v slices of one fused buffer and the K/V pages of one interleaved cache overlap in
    extent but not in elements: accepted (C.no_overlap(..., interleaved=True))."""
    a = make()
    fused(a)
    assert np.count_nonzero(a["kvc"].view(np.uint16)) > 0


def test_errors_are_value_and_type_errors():
    assert issubclass(LoomnbValueError, ValueError) and issubclass(LoomnbTypeError, TypeError)


# ---------------------------------------------------------------- torch custom ops (plain pass)
@pytest.mark.nosim
def test_schemas_carry_check_indices_and_trace_to_one_node_each():
    """``check_indices`` is in every registered schema (keyword-only, default False), so
    ``torch.ops.loomnb.<op>`` and torch.compile take it; a traced call passes it to its node."""
    torch = pytest.importorskip("torch")
    for name in ("rotary_embedding", "apply_rope_with_cos_sin_cache", "reshape_and_cache_flash",
                 "reshape_and_cache", "rotary_embedding_and_cache"):
        schema = torch.ops.loomnb.__getattr__(name).default._schema
        arg = next(a for a in schema.arguments if a.name == "check_indices")
        assert arg.kwarg_only and arg.default_value is False, (name, str(schema))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(pos, q, k, v, kc, vc, slots, cs):
        loomnb.reshape_and_cache_flash(k.view(3, HK, D), v.view(3, HK, D), kc, vc, slots, "auto",
                                       None, None, check_indices=True)
        loomnb.rotary_embedding_and_cache(pos, q, k, v, kc, vc, slots, D, cs, True,
                                          check_indices=True)
        qo, ko = loomnb.apply_rope_with_cos_sin_cache(pos, q, k, D, cs, check_indices=True)
        return qo + 1, ko

    m = dict(device="meta")
    qkv = torch.empty(T, (HQ + 2 * HK) * D, dtype=torch.bfloat16, **m)
    q, k, v = qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HK) * D], qkv[:, (HQ + HK) * D:]
    kv = torch.empty(2, 2, 16, HK, D, dtype=torch.bfloat16, **m)
    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(
        torch.empty(T, dtype=torch.int64, **m), q, k, v, kv[:, 0], kv[:, 1],
        torch.empty(T, dtype=torch.int64, **m), torch.empty(16, D, dtype=torch.bfloat16, **m))
    assert len(graphs) == 1
    nodes = [n for n in graphs[0].graph.nodes if n.op == "call_function"
             and str(n.target).startswith("loomnb.")]
    assert [str(n.target) for n in nodes] == ["loomnb.reshape_and_cache_flash.default",
                                              "loomnb.rotary_embedding_and_cache.default",
                                              "loomnb.apply_rope_with_cos_sin_cache.default"]
    assert all(n.kwargs.get("check_indices") is True for n in nodes)
