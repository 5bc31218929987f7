"""Bad input to the RoPE / KV-cache ops gets a clear error naming the argument, expected and
received, before any launch, and nothing the caller passed is modified (the error table of the
family template). Simulator pass (NumPy arrays are the device arrays there); the GPU-only
cases (host arrays, devices) are in ``test_rope_cache_gpu.py``.
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb import LoomnbTypeError, LoomnbValueError
from loomnb.layouts import paged_kv as pk

from family import rejects

pytestmark = pytest.mark.sim
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
    (lambda a: rope(a, key=a["qkv"][:, :3 * D]), LoomnbValueError,
     r"argument 'key' must be a number of heads that divides query's 4; got 3 heads"),
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
     r"argument 'value' must be of shape \[num_tokens, 2, 32\] like 'key'"),
    (lambda a: cache(a, slot_mapping=a["slots"].astype(np.int32)), LoomnbTypeError,
     r"argument 'slot_mapping' must be of dtype int64; got dtype int32"),
    (lambda a: cache(a, slot_mapping=np.zeros(4, np.int64)), LoomnbValueError,
     r"argument 'slot_mapping' must be at most as long as key and value have tokens \(3\)"),
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
    (lambda a: fused(a, key_cache=a["kvc"][:, 0, :, :, :], value_cache=a["kvc"][:, 0]),
     LoomnbValueError, r"argument 'key_cache' must be a buffer that does not overlap 'value_cache'"),
    (lambda a: fused(a, kv_cache_dtype="fp8_e4m3"), LoomnbTypeError,
     r"argument 'key_cache' must be of dtype float8_e4m3fn or uint8; got dtype bfloat16"),
    (lambda a: fused(a, key_cache=a["q"].reshape(T, 1, HQ, D)[:, :, :HK],
                     value_cache=np.zeros((T, 1, HK, D), BF16)),
     LoomnbValueError, r"argument 'query' must be a buffer that does not overlap 'key_cache'"),
]


@pytest.mark.parametrize("row", range(len(TABLE)))
def test_bad_input_is_rejected_before_launch(row):
    call, exc, match = TABLE[row]
    a = make()
    rejects(lambda: call(a), exc, match, a["qkv"], a["kvc"], a["cs"], a["pos"], a["slots"])


def test_fp8_needs_scales():
    a = make()
    kvc = pk.allocate_kv_cache("interleaved_nhd", 2, 16, HK, D, np.uint8, lib="numpy", fill=0)
    kc, vc = pk.kv_views(kvc, "interleaved_nhd")
    rejects(lambda: cache(a, key_cache=kc, value_cache=vc, kv_cache_dtype="fp8", k_scale=None),
            LoomnbValueError, r"argument 'k_scale' must be a float32 device array for "
            r"kv_cache_dtype 'fp8'; got None", kvc, a["qkv"])


def test_interleaved_qkv_slices_and_kv_pages_are_accepted():
    """q/k/v slices of one fused buffer and the K/V pages of one interleaved cache overlap in
    extent but not in elements: accepted (C.no_overlap(..., interleaved=True))."""
    a = make()
    fused(a)
    assert np.count_nonzero(a["kvc"].view(np.uint16)) > 0


def test_errors_are_value_and_type_errors():
    assert issubclass(LoomnbValueError, ValueError) and issubclass(LoomnbTypeError, TypeError)
