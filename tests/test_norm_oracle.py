"""The oracles themselves: the rounding points of the vLLM semantics, checked independently.

Each test rebuilds the expected value from the formula in float64 (or from a different
rounding choice, to show the test can tell them apart).
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from loomnb import oracle

BF16 = ml_dtypes.bfloat16


def _ref64(x, w, eps):
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)
    return x64 * inv * w.astype(np.float64)


@pytest.mark.parametrize("hidden_size", [1, 19, 111, 989])
def test_rms_norm_close_to_float64(hidden_size):
    rng = np.random.default_rng(hidden_size)
    x = rng.standard_normal((7, hidden_size)).astype(BF16)
    w = rng.standard_normal(hidden_size).astype(BF16)
    y = oracle.rms_norm(x, w, 1e-6).astype(np.float64)
    ref = _ref64(x, w, 1e-6)
    # two bf16 roundings: |err| <= 2^-8 |n| |w| + 2^-9 |y| per element
    bound = np.abs(ref) * 2.0 ** -7 + 1e-30
    assert np.all(np.abs(y - ref) <= bound)


def test_rms_norm_rounds_before_the_weight_multiply():
    """The two-rounding contract differs from a single rounding on a sizeable fraction of elements."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256)).astype(BF16)
    w = (rng.standard_normal(256) * 3).astype(BF16)
    y = oracle.rms_norm(x, w, 1e-6)
    xf = x.astype(np.float32)
    inv = (1 / np.sqrt(((xf * xf).sum(-1, keepdims=True, dtype=np.float32) / 256 + np.float32(1e-6))
                       .astype(np.float64))).astype(np.float32)
    two = ((xf * inv).astype(BF16).astype(np.float32) * w.astype(np.float32)).astype(BF16)
    one = (xf * inv * w.astype(np.float32)).astype(BF16)
    assert np.array_equal(y.view(np.uint16), two.view(np.uint16))
    assert (y.view(np.uint16) != one.view(np.uint16)).mean() > 0.05


def test_fused_add_normalises_the_rounded_sum():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64)).astype(BF16)
    r = (rng.standard_normal((4, 64)) * 100).astype(BF16)
    w = np.ones(64, BF16)
    xo, ro = x.copy(), r.copy()
    oracle.fused_add_rms_norm(xo, ro, w, 1e-6)
    z = (x.astype(np.float32) + r.astype(np.float32)).astype(BF16)
    assert np.array_equal(ro.view(np.uint16), z.view(np.uint16))
    assert np.array_equal(xo.view(np.uint16), oracle.rms_norm(z, w, 1e-6).view(np.uint16))


def test_dynamic_quant_scale_floor_ub_and_fp32_residual_sum():
    x = np.zeros((2, 32), BF16)
    x[1] = 2.0
    w = np.ones(32, BF16)
    q, s = oracle.rms_norm_dynamic_per_token_quant(x, w, 1e-6)
    assert s[0, 0] == np.float32(1.0) / np.float32(448.0 * 512.0), "all-zero row: floor scale"
    assert np.all(q.view(np.uint8)[0] == 0)
    _, s_ub = oracle.rms_norm_dynamic_per_token_quant(x, w, 1e-6, scale_ub=np.array([0.25], np.float32))
    assert s_ub[1, 0] == np.float32(0.25) / np.float32(448.0), "scale_ub clips the amax"
    # with a residual the norm uses the fp32 sum, not the bf16-rounded one
    rng = np.random.default_rng(3)
    a = rng.standard_normal((8, 64)).astype(BF16)
    b = (rng.standard_normal((8, 64)) * 300).astype(BF16)
    res = b.copy()
    q1, s1 = oracle.rms_norm_dynamic_per_token_quant(a, np.ones(64, BF16), 1e-6, residual=res)
    z = (a.astype(np.float32) + b.astype(np.float32)).astype(BF16)
    assert np.array_equal(res.view(np.uint16), z.view(np.uint16))
    q2, s2 = oracle.rms_norm_dynamic_per_token_quant(z, np.ones(64, BF16), 1e-6)
    assert not (np.array_equal(q1.view(np.uint8), q2.view(np.uint8)) and np.array_equal(s1, s2))


def test_static_quant_multiplies_by_reciprocal_and_saturates():
    x = np.array([[1.0, -1.0, 1.0, -1.0]], BF16)
    w = np.array([1.0, 1.0, 500.0, -500.0], BF16)
    q = oracle.rms_norm_static_fp8_quant(x, w, np.array([1.0], np.float32), 0.0)
    assert list(q.view(np.uint8)[0]) == [0x38, 0xB8, 0x7E, 0x7E]  # 1, -1, 448 (sat), 448 (sat)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=40),
       st.floats(1e-8, 1e-2))
def test_rms_norm_fp32_matches_float64_property(values, eps):
    x = np.array([values], np.float32)
    w = np.ones(len(values), np.float32)
    y = oracle.rms_norm(x, w, eps).astype(np.float64)
    ref = _ref64(x, w, np.float32(eps))
    assert np.allclose(y, ref, rtol=1e-5, atol=1e-30)


def test_rounding_once_rounds_only_the_product():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 128)).astype(BF16)
    w = (rng.standard_normal(128) * 3).astype(BF16)
    xf, wf = x.astype(np.float32), w.astype(np.float32)
    inv = oracle.norm._inv_rms(xf, 1e-6)
    want = (xf * inv * wf).astype(BF16)
    assert np.array_equal(oracle.rms_norm(x, w, 1e-6, rounding="once").view(np.uint16), want.view(np.uint16))
    twice = oracle.rms_norm(x, w, 1e-6)
    assert (twice.view(np.uint16) != want.view(np.uint16)).mean() > 0.05


def test_nan_is_the_canonical_gpu_nan():
    """bf16/fp16 NaN outputs are 0x7FFF (the GPU's cvt and vLLM's/torch's CUDA kernels), not
    ml_dtypes' sign-keeping 0x7FC0/0xFFC0."""
    for dt in (BF16, np.float16):
        x = np.array([[1.0, np.nan, -2.0, 3.0]], dt)
        y = oracle.rms_norm(x, np.ones(4, dt), 1e-6)
        assert set(y.view(np.uint16)[0].tolist()) == {0x7FFF}
        neg = oracle.to_dtype(np.array([-np.nan], np.float32), dt)
        assert neg.view(np.uint16)[0] == 0x7FFF


def test_dynamic_quant_keeps_the_sign_of_zero():
    """An inf element makes inv = 0: the others normalise to -0.0/+0.0 and encode as 0x80/0x00."""
    x = np.array([[np.inf, -1.0, 2.0, -3.0, 4.0, -0.5, 0.25, -7.0]], BF16)
    q, s = oracle.rms_norm_dynamic_per_token_quant(x, np.ones(8, BF16), 1e-6)
    codes = q.view(np.uint8)[0]
    assert codes[0] == 0x7E  # NaN (inf * 0) -> +448
    assert list(codes[1:]) == [0x80 if v < 0 else 0x00 for v in x[0, 1:].astype(np.float32)]
