"""Bad input to the KV-cache movement ops gets a clear error naming the argument, expected and
received, before any launch, and nothing the caller passed is modified (the error table of the
family template). Simulator pass (NumPy arrays are the device arrays there); the GPU-only
cases (pageable host memory, devices, the device-side ``check_indices`` assert, capture) are
in ``test_kv_blocks_gpu.py``; the torch custom-op schemas in the plain pass at the end.
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb import LoomnbTypeError, LoomnbValueError
from loomnb.layouts import paged_kv as pk

from family import rejects

BF16 = ml_dtypes.bfloat16


def make():
    kvc = pk.allocate_kv_cache("interleaved_nhd", 4, 2, 1, 8, BF16, lib="numpy", fill=1)
    kc, vc = pk.kv_views(kvc, "interleaved_nhd")
    return dict(kvc=kvc, kc=kc, vc=vc, m=np.array([[0, 1]], np.int64),
                src=np.zeros((4, 2, 1, 8), BF16), dst=np.ones((6, 2, 1, 8), BF16),
                bt=np.zeros((2, 3), np.int32), cu=np.array([0, 2, 3], np.int32),
                out=np.zeros((4, 1, 8), BF16), s=np.ones(1, np.float32),
                kv_c=np.ones((3, 16), BF16), k_pe=np.ones((3, 8), BF16),
                mla=np.zeros((2, 2, 24), BF16), slots=np.array([0, -1, 3], np.int64))


V, T = LoomnbValueError, LoomnbTypeError

CASES = [
    # copy_blocks
    ("copy_blocks not a list", T, r"'key_caches' must be a list",
     lambda a: loomnb.copy_blocks(a["kc"], [a["vc"]], a["m"]), ("kvc",)),
    ("copy_blocks lists differ", V, r"'value_caches' must be a list of 2 caches",
     lambda a: loomnb.copy_blocks([a["kc"], a["kc"][:, :1]], [a["vc"]], a["m"]), ("kvc",)),
    ("copy_blocks mapping dtype", T, r"'block_mapping' must be of dtype int64; got dtype int32",
     lambda a: loomnb.copy_blocks([a["kc"]], [a["vc"]], a["m"].astype(np.int32)), ("kvc",)),
    ("copy_blocks mapping shape", V, r"'block_mapping' must be of shape \[n, 2\]",
     lambda a: loomnb.copy_blocks([a["kc"]], [a["vc"]], np.zeros((2, 3), np.int64)), ("kvc",)),
    ("copy_blocks block not dense", V, r"'key_caches\[0\]' must be a cache whose every block",
     lambda a: loomnb.copy_blocks([a["kvc"][:, :, :, :, ::2]], [], a["m"]), ("kvc",)),
    ("copy_blocks overlapping caches", V, r"does not overlap",
     lambda a: loomnb.copy_blocks([a["kc"], a["kc"]], [a["vc"], a["vc"]], a["m"]), ("kvc",)),
    ("copy_blocks check_indices", V, r"'block_mapping' must be -1 or in \[0, 3\]",
     lambda a: loomnb.copy_blocks([a["kc"]], [a["vc"]], np.array([[0, 4]], np.int64),
                                  check_indices=True), ("kvc",)),
    # swap_blocks
    ("swap_blocks too many bytes", V, r"'block_size_in_bytes' must be an int in \[0, 32\]",
     lambda a: loomnb.swap_blocks(a["src"], a["dst"], 33, a["m"]), ("dst",)),
    ("swap_blocks mapping range", V, r"'block_mapping' must be -1 or a block of 'dst' in \[0, 6\)",
     lambda a: loomnb.swap_blocks(a["src"], a["dst"], 32, np.array([[0, 6]], np.int64)),
     ("dst",)),
    ("swap_blocks mapping dtype", T, r"'block_mapping' must be int64",
     lambda a: loomnb.swap_blocks(a["src"], a["dst"], 32, a["m"].astype(np.int32)), ("dst",)),
    # compact_blocks
    ("compact not a permutation", V, r"'permutation' must be a permutation of 0 .. 3",
     lambda a: loomnb.compact_blocks([a["kc"], a["vc"]], np.array([0, 1, 1, 2], np.int64)),
     ("kvc",)),
    ("compact too long", V, r"'permutation' must be of length at most num_blocks = 4",
     lambda a: loomnb.compact_blocks([a["kc"]], np.arange(5, dtype=np.int64)), ("kvc",)),
    ("compact permutation dtype", T, r"'permutation' must be int64",
     lambda a: loomnb.compact_blocks([a["kc"]], np.arange(4, dtype=np.int32)), ("kvc",)),
    # gather_cache
    ("gather dst shape", V, r"'dst' must be of shape \[num_tokens, 1, 8\]",
     lambda a: loomnb.gather_cache(a["src"], a["out"][:, :, :4], a["bt"], a["cu"]), ("out",)),
    ("gather dst dtype auto", T, r"'dst'",
     lambda a: loomnb.gather_cache(a["src"], a["out"].astype(np.float32), a["bt"], a["cu"]),
     ("out",)),
    ("gather fp8 needs scale", V, r"'scale' must be a float32 device array",
     lambda a: loomnb.gather_cache(a["src"].view(np.uint16)[..., :4].copy().view(np.uint8)
                                   .reshape(4, 2, 1, 8), a["out"], a["bt"], a["cu"], "fp8"),
     ("out",)),
    ("gather block_table rows", V, r"'block_table' must be at least batch = 2 rows",
     lambda a: loomnb.gather_cache(a["src"], a["out"], a["bt"][:1], a["cu"]), ("out",)),
    ("gather cu dtype", T, r"'cu_seq_lens' must be of dtype int32; got dtype int64",
     lambda a: loomnb.gather_cache(a["src"], a["out"], a["bt"], a["cu"].astype(np.int64)),
     ("out",)),
    ("gather seq_starts length", V, r"'seq_starts' must be of length batch = 2",
     lambda a: loomnb.gather_cache(a["src"], a["out"], a["bt"], a["cu"],
                                   seq_starts=np.zeros(3, np.int32)), ("out",)),
    ("gather kv dtype", V, r"'kv_cache_dtype'",
     lambda a: loomnb.gather_cache(a["src"], a["out"], a["bt"], a["cu"], "int8"), ("out",)),
    ("gather check_indices", V, r"'block_table' must be in \[0, 3\]",
     lambda a: loomnb.gather_cache(a["src"], a["out"], a["bt"] + 4, a["cu"], check_indices=True),
     ("out",)),
    # concat_and_cache_mla
    ("mla cache width", V, r"'kv_cache' must be 3-D \[num_blocks, block_size, kv_lora_rank",
     lambda a: loomnb.concat_and_cache_mla(a["kv_c"], a["k_pe"][:, :4], a["mla"], a["slots"],
                                           "auto", None), ("mla",)),
    ("mla ds layout", V, r"'kv_cache_dtype'",
     lambda a: loomnb.concat_and_cache_mla(a["kv_c"], a["k_pe"], a["mla"], a["slots"],
                                           "fp8_ds_mla", a["s"]), ("mla",)),
    ("mla fp8 needs scale", V, r"'scale' must be a float32 device array",
     lambda a: loomnb.concat_and_cache_mla(a["kv_c"], a["k_pe"], a["mla"].view(np.uint8)[..., :24],
                                           a["slots"], "fp8", None), ("mla",)),
    ("mla k_pe tokens", V, r"'k_pe' must be \[3, pe_dim\]",
     lambda a: loomnb.concat_and_cache_mla(a["kv_c"], a["k_pe"][:2], a["mla"], a["slots"],
                                           "auto", None), ("mla",)),
    ("mla slots too many", V, r"'slot_mapping' must be of length at most 3",
     lambda a: loomnb.concat_and_cache_mla(a["kv_c"], a["k_pe"], a["mla"],
                                           np.zeros(4, np.int64), "auto", None), ("mla",)),
    ("mla k_pe dtype", T, r"'k_pe'",
     lambda a: loomnb.concat_and_cache_mla(a["kv_c"], a["k_pe"].astype(np.float32), a["mla"],
                                           a["slots"], "auto", None), ("mla",)),
    ("mla check_indices", V, r"'slot_mapping' must be -1 or in \[0, 3\]",
     lambda a: loomnb.concat_and_cache_mla(a["kv_c"], a["k_pe"], a["mla"],
                                           np.array([0, 4, -1], np.int64), "auto", None,
                                           check_indices=True), ("mla",)),
]


@pytest.mark.sim
@pytest.mark.parametrize("what, exc, match, call, keep", CASES, ids=[c[0] for c in CASES])
def test_error_table(what, exc, match, call, keep):
    a = make()
    rejects(lambda: call(a), exc, match, *[a[k] for k in keep])


@pytest.mark.sim
def test_empty_calls_are_noops():
    a = make()
    before = a["kvc"].copy()
    loomnb.copy_blocks([], [], a["m"])
    loomnb.copy_blocks([a["kc"]], [a["vc"]], np.zeros((0, 2), np.int64))
    loomnb.compact_blocks([a["kc"]], np.zeros(0, np.int64))
    assert np.array_equal(a["kvc"].view(np.uint16), before.view(np.uint16))
    out = a["out"].copy()
    loomnb.gather_cache(a["src"], a["out"], a["bt"][:0], a["cu"][:1])
    assert np.array_equal(a["out"].view(np.uint16), out.view(np.uint16))


@pytest.mark.nosim
def test_torch_schemas_mark_the_mutated_lists():
    import torch
    s = str(torch.ops.loomnb.copy_blocks.default._schema)
    assert "Tensor(a!)[] key_caches, Tensor(b!)[] value_caches" in s and s.endswith("-> ()")
    s = str(torch.ops.loomnb.compact_blocks.default._schema)
    assert "Tensor(a!)[] kv_cache" in s
    s = str(torch.ops.loomnb.swap_blocks.default._schema)
    assert "Tensor(a!) dst, int block_size_in_bytes" in s
