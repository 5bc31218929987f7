"""The one dtype table of loomnb: the library, the benchmarks and the tests all read it.

Each dtype has a short ``kind`` (what the code passes around: ``"bf16"``), its ``name`` (the
NumPy / ml_dtypes / torch spelling: ``"bfloat16"``), its size, and the ``storage`` dtype kernels
see: bf16 and fp16 travel as ``uint16`` bit patterns and FP8 as ``uint8`` codes, because numba's
kernels (and its simulator) have no bf16 or FP8 types; arithmetic happens in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    kind: str       # loomnb's short name
    name: str       # NumPy / ml_dtypes / torch spelling
    itemsize: int   # bytes
    storage: str    # NumPy dtype of the bits a kernel reads and writes
    is_float: bool


DTYPES = {d.kind: d for d in (
    DType("bf16", "bfloat16", 2, "uint16", True),
    DType("f16", "float16", 2, "uint16", True),
    DType("f32", "float32", 4, "float32", True),
    DType("fp8", "float8_e4m3fn", 1, "uint8", True),
    DType("fp8_e5m2", "float8_e5m2", 1, "uint8", True),
    DType("i32", "int32", 4, "int32", False),
    DType("i64", "int64", 8, "int64", False),
    DType("u8", "uint8", 1, "uint8", False),
    DType("bool", "bool", 1, "uint8", False),  # vLLM's token masks
)}
KIND_OF_NAME = {d.name: d.kind for d in DTYPES.values()}
ACTIVATION_KINDS = ("bf16", "f16", "f32")  # the activation dtypes T of every op


def itemsize(kind: str) -> int:
    return DTYPES[kind].itemsize


def name(kind: str) -> str:
    return DTYPES[kind].name


def numpy_dtype(kind: str) -> np.dtype:
    """The NumPy dtype of ``kind`` (ml_dtypes for bf16 and FP8)."""
    if kind in ("bf16", "fp8", "fp8_e5m2"):
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, DTYPES[kind].name))
    return np.dtype(DTYPES[kind].name)


def storage_dtype(kind: str) -> np.dtype:
    return np.dtype(DTYPES[kind].storage)


def torch_dtype(kind: str):
    import torch
    return getattr(torch, DTYPES[kind].name)
