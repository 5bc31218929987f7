"""Bad input gets a clear error before any launch, and nothing the caller passed is modified.

Runs in the simulator pass (NumPy arrays are the device arrays there); the GPU-only cases
(host array on a GPU, arrays on different devices) are in ``test_gpu_norm.py``.
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb import LoomnbTypeError, LoomnbValueError

pytestmark = pytest.mark.sim
EPS = 1e-6


def _bf16(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(ml_dtypes.bfloat16)


def _unchanged(*arrays):
    snaps = [a.copy() for a in arrays]
    return lambda: all(np.array_equal(a.view(np.uint8), s.view(np.uint8)) for a, s in zip(arrays, snaps))


@pytest.mark.parametrize("call, exc, match", [
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
    (lambda x, w, r: loomnb.rms_norm([[1.0]], w, EPS), LoomnbTypeError,
     r"argument 'x' must be a NumPy array \(simulator\); got builtins.list"),
    (lambda x, w, r: loomnb.fused_add_rms_norm(x, r[:3], w, EPS), LoomnbValueError,
     r"argument 'residual' must be of shape \[4, 16\]"),
    (lambda x, w, r: loomnb.fused_add_rms_norm(x, x, w, EPS), LoomnbValueError,
     r"argument 'residual' must be a buffer that does not overlap 'x'"),
    (lambda x, w, r: loomnb.fused_add_rms_norm(x, np.asfortranarray(r), w, EPS), LoomnbValueError,
     r"argument 'residual' must be C-contiguous"),
    (lambda x, w, r: loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS, scale_ub=np.ones(2, np.float32)),
     LoomnbValueError, r"argument 'scale_ub' must be a float32 array of one element"),
    (lambda x, w, r: loomnb.rms_norm_static_fp8_quant(None, x, w, np.ones(1, ml_dtypes.bfloat16), EPS),
     LoomnbTypeError, r"argument 'scale' must be of dtype float32"),
    (lambda x, w, r: loomnb.rms_norm_static_fp8_quant(np.empty((4, 16), np.uint8), x, w,
                                                      np.ones(1, np.float32), EPS),
     LoomnbTypeError, r"argument 'out' must be of dtype float8_e4m3fn; got dtype uint8"),
])
def test_bad_input_is_rejected_before_launch(call, exc, match):
    x, w, r = _bf16(4, 16), _bf16(16, seed=1), _bf16(4, 16, seed=2)
    same = _unchanged(x, w, r)
    with pytest.raises(exc, match=match):
        call(x, w, r)
    assert same(), "a rejected call must not modify its arguments"


def test_partial_overlap_of_out_is_rejected_but_exact_in_place_is_fine():
    buf = _bf16(5, 16)
    x, out = buf[:4], buf[1:]
    w = _bf16(16, seed=1)
    with pytest.raises(LoomnbValueError, match="argument 'out' must be a buffer that does not overlap 'x'"):
        loomnb.rms_norm(x, w, EPS, out=out)
    loomnb.rms_norm(x, w, EPS, out=x)


def test_errors_are_value_and_type_errors():
    assert issubclass(LoomnbValueError, ValueError) and issubclass(LoomnbTypeError, TypeError)


@pytest.mark.parametrize("eps", ["1e-6", True, None, 1j])
def test_eps_must_be_a_real_number(eps):
    x, w = _bf16(2, 16), _bf16(16, seed=1)
    with pytest.raises(LoomnbTypeError, match="argument 'eps' must be a real number"):
        loomnb.rms_norm(x, w, eps)
