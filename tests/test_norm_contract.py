"""Bad input gets a clear error before any launch, and nothing the caller passed is modified
(the error-message table of the family template).

Runs in the simulator pass (NumPy arrays are the device arrays there); the GPU-only cases
(host array on a GPU, arrays on different devices, ``__cuda_array_interface__`` read-only and
masked exports) are in ``test_norm_gpu.py`` and ``test_adapter.py``.
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb import LoomnbTypeError, LoomnbValueError

from family import rejects

pytestmark = pytest.mark.sim
EPS = 1e-6
ONE = np.ones(1, np.float32)


def _bf16(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(ml_dtypes.bfloat16)


TABLE = [
    (lambda x, w, r: loomnb.rms_norm(x.astype(np.float64), w, EPS), LoomnbTypeError,
     r"argument 'x' must be of dtype bfloat16 or float16 or float32; got dtype float64"),
    (lambda x, w, r: loomnb.rms_norm(x, w.astype(np.float32), EPS), LoomnbTypeError,
     r"argument 'weight' must be of the same dtype as 'x' \(bfloat16\); got dtype float32"),
    (lambda x, w, r: loomnb.rms_norm(x, w[:8], EPS), LoomnbValueError,
     r"argument 'weight' must be of shape \[16\] \(\[hidden_size\]\); got shape \[8\]"),
    (lambda x, w, r: loomnb.rms_norm(x[:, ::2], w[:8], EPS), LoomnbValueError,
     r"argument 'x' must be contiguous in its last dimension"),
    (lambda x, w, r: loomnb.rms_norm(x, w, EPS, out=np.empty((4, 16), np.float32)), LoomnbTypeError,
     r"argument 'out' must be of dtype bfloat16; got dtype float32"),
    (lambda x, w, r: loomnb.rms_norm(x, w, EPS, out=np.empty((3, 16), x.dtype)), LoomnbValueError,
     r"argument 'out' must be of shape \[4, 16\]"),
    (lambda x, w, r: loomnb.rms_norm(x, w, -1.0), LoomnbValueError, r"argument 'eps' must be finite and >= 0"),
    (lambda x, w, r: loomnb.rms_norm(x, w, "a"), LoomnbTypeError, r"argument 'eps' must be a real number"),
    (lambda x, w, r: loomnb.rms_norm(x, w, EPS, rounding="thrice"), LoomnbValueError,
     r"argument 'rounding' must be one of 'twice', 'once'; got 'thrice'"),
    (lambda x, w, r: loomnb.rms_norm([[1.0]], w, EPS), LoomnbTypeError,
     r"argument 'x' must be a NumPy array \(simulator\); got builtins.list"),
    (lambda x, w, r: loomnb.fused_add_rms_norm(x, r[:3], w, EPS), LoomnbValueError,
     r"argument 'residual' must be of shape \[4, 16\]"),
    (lambda x, w, r: loomnb.fused_add_rms_norm(x, x, w, EPS), LoomnbValueError,
     r"argument 'residual' must be a buffer that does not overlap 'x'"),
    (lambda x, w, r: loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS, scale_ub=np.ones(2, np.float32)),
     LoomnbValueError, r"argument 'scale_ub' must be a float32 array of one element"),
    (lambda x, w, r: loomnb.rms_norm_static_fp8_quant(x, w, np.ones(1, ml_dtypes.bfloat16), EPS),
     LoomnbTypeError, r"argument 'scale' must be of dtype float32"),
    (lambda x, w, r: loomnb.rms_norm_static_fp8_quant(x, w, ONE, EPS, out=np.empty((4, 16), np.int8)),
     LoomnbTypeError, r"argument 'out' must be of dtype float8_e4m3fn or uint8; got dtype int8"),
    (lambda x, w, r: loomnb.rms_norm(x, w, EPS, out=np.broadcast_to(x[:1], x.shape)), LoomnbValueError,
     r"argument 'out' must be a writable array"),
    (lambda x, w, r: loomnb.rms_norm(np.lib.stride_tricks.as_strided(x, (2, 2, 2, 2), (64, 24, 10, 2)), w[:2], EPS),
     LoomnbValueError, r"argument 'x' must be leading dimensions that merge into at most two strided"),
]


@pytest.mark.parametrize("row", range(len(TABLE)))
def test_bad_input_is_rejected_before_launch(row):
    call, exc, match = TABLE[row]
    x, w, r = _bf16(4, 16), _bf16(16, seed=1), _bf16(4, 16, seed=2)
    rejects(lambda: call(x, w, r), exc, match, x, w, r)


def test_partial_overlap_of_out_is_rejected_but_exact_in_place_is_fine():
    buf = _bf16(5, 16)
    x, out = buf[:4], buf[1:]
    w = _bf16(16, seed=1)
    rejects(lambda: loomnb.rms_norm(x, w, EPS, out=out), LoomnbValueError,
            "argument 'out' must be a buffer that does not overlap 'x'", buf)
    loomnb.rms_norm(x, w, EPS, out=x)


@pytest.mark.parametrize("op", ["static", "fused_static", "dynamic"])
def test_fp8_out_at_the_same_address_as_x_is_not_in_place(op):
    """A uint8-sized view of x's own memory is an overlap, not "exactly in place": the
    exemption compares bytes (element size and byte strides), not element indices."""
    x, w, r = _bf16(4, 16), _bf16(16, seed=1), _bf16(4, 16, seed=2)
    out = x.view(np.uint8)[:, :16]  # same address, 1-byte elements
    calls = {"static": lambda: loomnb.rms_norm_static_fp8_quant(x, w, ONE, EPS, out=out),
             "fused_static": lambda: loomnb.fused_add_rms_norm_static_fp8_quant(x, r, w, ONE, EPS, out=out),
             "dynamic": lambda: loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS, out=out)}
    rejects(calls[op], LoomnbValueError, r"argument 'out' must be a buffer that does not overlap 'x'; "
            r"got overlapping memory \(same address, different element size or strides\)", x, w, r)


def test_read_only_arrays_are_rejected_before_anything_is_written():
    """fused_add_rms_norm writes x and residual: a read-only x is rejected up front, and the
    residual is not half-written."""
    x, w, r = _bf16(4, 16), _bf16(16, seed=1), _bf16(4, 16, seed=2)
    x.flags.writeable = False
    rejects(lambda: loomnb.fused_add_rms_norm(x, r, w, EPS), LoomnbValueError,
            "argument 'x' must be a writable array; got a read-only array", x, r, w)
    out = np.empty_like(r)
    out.flags.writeable = False
    rejects(lambda: loomnb.rms_norm(r, w, EPS, out=out), LoomnbValueError,
            "argument 'out' must be a writable array", r, out)


def test_errors_are_value_and_type_errors():
    assert issubclass(LoomnbValueError, ValueError) and issubclass(LoomnbTypeError, TypeError)


@pytest.mark.parametrize("eps", ["1e-6", True, None, 1j])
def test_eps_must_be_a_real_number(eps):
    x, w = _bf16(2, 16), _bf16(16, seed=1)
    rejects(lambda: loomnb.rms_norm(x, w, eps), LoomnbTypeError, "argument 'eps' must be a real number", x, w)


def test_check_scale_is_an_opt_in_check():
    """Unchecked scales behave as vLLM's (no error); ``check_scale=True`` rejects 0, negative,
    NaN and inf before any launch (under the simulator: a host check; on a GPU with torch: an
    asynchronous device-side assert, ``test_norm_gpu.py``)."""
    x, w, r = _bf16(4, 16), _bf16(16, seed=1), _bf16(4, 16, seed=2)
    for bad in (0.0, -1.0, np.nan, np.inf):
        scale = np.array([bad], np.float32)
        loomnb.rms_norm_static_fp8_quant(x, w, scale, EPS)  # as vLLM: no check
        rejects(lambda: loomnb.rms_norm_static_fp8_quant(x, w, scale, EPS, check_scale=True),
                LoomnbValueError, r"argument 'scale' must be finite and > 0 \(check_scale=True\)", x, w)
        rejects(lambda: loomnb.fused_add_rms_norm_static_fp8_quant(x, r, w, scale, EPS, check_scale=True),
                LoomnbValueError, "argument 'scale' must be finite and > 0", x, w, r)
        rejects(lambda: loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS, scale_ub=scale, check_scale=True),
                LoomnbValueError, "argument 'scale_ub' must be finite and > 0", x, w)
    loomnb.rms_norm_static_fp8_quant(x, w, np.array([0.5], np.float32), EPS, check_scale=True)


def test_nan_scale_ub_is_ignored_like_fminf():
    x, w = _bf16(3, 16), _bf16(16, seed=1)
    q1, s1 = loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS, scale_ub=np.array([np.nan], np.float32))
    q2, s2 = loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS)
    qo, so = loomnb.oracle.rms_norm_dynamic_per_token_quant(x, w, EPS, scale_ub=np.array([np.nan], np.float32))
    assert np.array_equal(s1, s2) and np.array_equal(s1, so)
    assert np.array_equal(q1.view(np.uint8), q2.view(np.uint8))
