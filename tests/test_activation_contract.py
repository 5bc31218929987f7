"""Activation family: bad input gets a clear error naming the argument, what was expected and
what came, before any launch, and nothing the caller passed is modified (the error-message table
of the family template). Runs in the simulator pass (NumPy arrays are the device arrays there);
the GPU-only cases (host arrays, devices, torch dtypes) are in ``test_activation_gpu.py``.
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb import LoomnbTypeError, LoomnbValueError

from family import rejects

pytestmark = pytest.mark.sim
BF16 = ml_dtypes.bfloat16
ONE = np.ones(1, np.float32)


def _bf16(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(BF16)


# (call(x [4, 256] bf16, s [1] f32), error, message)
TABLE = [
    (lambda x, s: loomnb.silu_and_mul(x.astype(np.float64)), LoomnbTypeError,
     r"loomnb.silu_and_mul: argument 'x' must be of dtype bfloat16 or float16 or float32; got dtype float64"),
    (lambda x, s: loomnb.silu_and_mul(x[:, :255]), LoomnbValueError,
     r"argument 'x' must be of shape \[\.\.\., 2\*d\] \(an even last dimension\); got shape \[4, 255\]"),
    (lambda x, s: loomnb.silu_and_mul(x[:, ::2]), LoomnbValueError,
     r"argument 'x' must be contiguous in its last dimension"),
    (lambda x, s: loomnb.silu_and_mul(x, out=np.empty((4, 256), BF16)), LoomnbValueError,
     r"argument 'out' must be of shape \[4, 128\]"),
    (lambda x, s: loomnb.silu_and_mul(x, out=np.empty((4, 128), np.float32)), LoomnbTypeError,
     r"argument 'out' must be of dtype bfloat16; got dtype float32"),
    (lambda x, s: loomnb.silu_and_mul(x, out=x[:, :128]), LoomnbValueError,
     r"argument 'out' must be a buffer that does not overlap 'x'"),
    (lambda x, s: loomnb.silu_and_mul(x, out=np.broadcast_to(np.zeros((1, 128), BF16), (4, 128))),
     LoomnbValueError, r"argument 'out' must be a writable array"),
    (lambda x, s: loomnb.silu_and_mul(np.zeros(()), ), LoomnbTypeError, r"argument 'x' must be of dtype"),
    (lambda x, s: loomnb.silu_and_mul(np.zeros((), BF16)), LoomnbValueError,
     r"argument 'x' must be an array of shape \[\.\.\., d\]; got a 0-D array"),
    (lambda x, s: loomnb.silu_and_mul([[1.0, 2.0]]), LoomnbTypeError,
     r"argument 'x' must be a NumPy array \(simulator\); got builtins.list"),
    (lambda x, s: loomnb.fatrelu_and_mul(x, threshold="0"), LoomnbTypeError,
     r"argument 'threshold' must be a real number; got '0'"),
    (lambda x, s: loomnb.fatrelu_and_mul(x, threshold=float("nan")), LoomnbValueError,
     r"argument 'threshold' must be finite"),
    (lambda x, s: loomnb.swigluoai_and_mul(x, limit=True), LoomnbTypeError,
     r"argument 'limit' must be a real number; got True"),
    (lambda x, s: loomnb.static_scaled_fp8_quant(x, np.ones(2, np.float32)), LoomnbValueError,
     r"argument 'scale' must be a float32 array of one element \(shape \[\] or \[1\]\); got shape \[2\]"),
    (lambda x, s: loomnb.static_scaled_fp8_quant(x, np.ones(1, BF16)), LoomnbTypeError,
     r"argument 'scale' must be of dtype float32; got dtype bfloat16"),
    (lambda x, s: loomnb.static_scaled_fp8_quant(x, s, out=np.empty((4, 256), np.int8)), LoomnbTypeError,
     r"argument 'out' must be of dtype float8_e4m3fn or uint8; got dtype int8"),
    (lambda x, s: loomnb.static_scaled_fp8_quant(x, s, out=x.view(np.uint8)[:, :256]), LoomnbValueError,
     r"argument 'out' must be a buffer that does not overlap 'x'"),
    (lambda x, s: loomnb.silu_and_mul_quant(x, s, out=np.empty((4, 256), np.uint8)), LoomnbValueError,
     r"argument 'out' must be of shape \[4, 128\]"),
    (lambda x, s: loomnb.dynamic_scaled_fp8_quant(x, scale=np.empty(2, np.float32)), LoomnbValueError,
     r"argument 'scale' must be of shape \[1\]"),
    (lambda x, s: loomnb.dynamic_per_token_scaled_fp8_quant(x, scales=np.empty((4,), np.float32)),
     LoomnbValueError, r"argument 'scales' must be of shape \[4, 1\]"),
    (lambda x, s: loomnb.dynamic_per_token_scaled_fp8_quant(x, scale_ub=np.ones(3, np.float32)),
     LoomnbValueError, r"argument 'scale_ub' must be a float32 array of one element"),
    (lambda x, s: loomnb.per_token_group_quant_fp8(x, 96), LoomnbValueError,
     r"argument 'group_size' must be one of 64, 128; got 96"),
    (lambda x, s: loomnb.per_token_group_quant_fp8(x, 64.0), LoomnbTypeError,
     r"argument 'group_size' must be an int; got 64.0"),
    (lambda x, s: loomnb.per_token_group_quant_fp8(x[:, :192], 128), LoomnbValueError,
     r"argument 'group_size' must be a divisor of the last dimension of the output \(d = 192\); got 128"),
    (lambda x, s: loomnb.silu_and_mul_per_token_group_quant_fp8(x[:, :192], 64), LoomnbValueError,
     r"argument 'group_size' must be a divisor of the last dimension of the output \(d = 96\); got 64"),
    (lambda x, s: loomnb.per_token_group_quant_fp8(x, 64, eps=-1.0), LoomnbValueError,
     r"argument 'eps' must be finite and >= 0"),
    (lambda x, s: loomnb.per_token_group_quant_fp8(x, 64, use_ue8m0=1), LoomnbTypeError,
     r"argument 'use_ue8m0' must be a bool; got 1"),
    (lambda x, s: loomnb.per_token_group_quant_fp8(x.reshape(2, 2, 256), 64, column_major_scales=True),
     LoomnbValueError, r"argument 'x' must be 2-D \[num_tokens, d\] with column-major or TMA-aligned scales"),
    (lambda x, s: loomnb.per_token_group_quant_fp8(x, 64, out_s=np.empty((4, 2), np.float32)),
     LoomnbValueError, r"argument 'out_s' must be of shape \[4, 4\]"),
    (lambda x, s: loomnb.per_token_group_quant_fp8(x, 64, out_q=np.empty((4, 256), BF16)),
     LoomnbTypeError, r"argument 'out_q' must be of dtype float8_e4m3fn or uint8; got dtype bfloat16"),
    (lambda x, s: loomnb.silu_and_mul_per_token_group_quant_fp8(x, 64, numerics="fp32"), LoomnbValueError,
     r"argument 'numerics' must be one of 'unfused', 'per_block'; got 'fp32'"),
    (lambda x, s: loomnb.silu_and_mul_per_token_group_quant_fp8(x, 64, use_ue8m0=True, numerics="per_block"),
     LoomnbValueError, r"argument 'use_ue8m0' must be False with numerics='per_block'"),
    (lambda x, s: loomnb.scaled_fp8_dequant(x, s, "float32"), LoomnbTypeError,
     r"argument 'q' must be of dtype float8_e4m3fn or uint8; got dtype bfloat16"),
    (lambda x, s: loomnb.scaled_fp8_dequant(x.view(np.uint8), s, "int8"), LoomnbTypeError,
     r"argument 'dtype' must be bfloat16, float16 or float32; got 'int8'"),
    (lambda x, s: loomnb.scaled_fp8_dequant(x.view(np.uint8), np.ones((4, 3), np.float32), "float32"),
     LoomnbValueError, r"argument 'scale' must be one element, \[\.\.\., 1\] or \[\.\.\., G\] with G dividing 512"),
]


@pytest.mark.parametrize("row", range(len(TABLE)))
def test_bad_input_is_rejected_before_launch(row):
    call, exc, match = TABLE[row]
    x, s = _bf16(4, 256), np.full(1, 0.5, np.float32)
    rejects(lambda: call(x, s), exc, match, x, s)


def test_partial_overlap_of_group_outputs_is_rejected():
    x = _bf16(4, 256)
    buf = np.zeros(4 * 256 + 64, np.uint8)
    q = buf[:4 * 256].reshape(4, 256)
    s_over = buf[64:64 + 64].view(np.float32).reshape(4, 4)  # inside q's memory
    rejects(lambda: loomnb.per_token_group_quant_fp8(x, 64, out_q=q, out_s=s_over), LoomnbValueError,
            r"argument 'out_q' must be a buffer that does not overlap 'out_s'", x, buf)


def test_errors_are_value_and_type_errors():
    assert issubclass(LoomnbValueError, ValueError) and issubclass(LoomnbTypeError, TypeError)
