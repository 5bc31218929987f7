"""RMSNorm-family kernels under numba's CUDA simulator against the oracles.

Small awkward shapes (the simulator runs one Python thread per CUDA thread): hidden sizes that
are and are not multiples of 8 (vector and scalar kernels), one and several tokens, strided
rows, ``out`` given or not, and a sweep of the block size (correctness must not depend on it).
"""

import numpy as np
import pytest

import loomnb
from loomnb.ops import norm as norm_ops

from helpers import assert_fp8_codes, assert_ulps, random_rows
from tolerances import ulps

pytestmark = pytest.mark.sim
KINDS = ["bf16", "f16", "f32"]
SHAPES = [(1, 8), (3, 19), (2, 72), (5, 24)]  # 72 = SmolLM2's 576 / 8; 19, 24 exercise both paths
EPS = 1e-5


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens, hidden_size", SHAPES)
def test_rms_norm(kind, num_tokens, hidden_size):
    rng = np.random.default_rng(hidden_size)
    x = random_rows(rng, num_tokens, hidden_size, kind, 3.0)
    w = random_rows(rng, 1, hidden_size, kind)[0]
    x0 = x.copy()
    got = loomnb.rms_norm(x, w, EPS)
    assert_ulps(got, loomnb.oracle.rms_norm(x, w, EPS), ulps("norm", kind), "rms_norm")
    assert np.array_equal(x.view(np.uint8), x0.view(np.uint8)), "x must not be modified"
    out = np.full_like(x, 7)
    assert loomnb.rms_norm(x, w, EPS, out=out) is out
    assert np.array_equal(out.view(np.uint8), got.view(np.uint8))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens, hidden_size", SHAPES)
def test_fused_add_rms_norm(kind, num_tokens, hidden_size):
    rng = np.random.default_rng(hidden_size + 1)
    x = random_rows(rng, num_tokens, hidden_size, kind)
    res = random_rows(rng, num_tokens, hidden_size, kind, 4.0)
    w = random_rows(rng, 1, hidden_size, kind)[0]
    xo, ro = x.copy(), res.copy()
    got_x, got_r = loomnb.fused_add_rms_norm(x, res, w, EPS)
    assert got_x is x and got_r is res
    loomnb.oracle.fused_add_rms_norm(xo, ro, w, EPS)
    assert np.array_equal(res.view(np.uint8), ro.view(np.uint8)), "residual is elementwise: exact"
    assert_ulps(x, xo, ulps("norm", kind), "fused_add_rms_norm x")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens, hidden_size", [(1, 8), (3, 19), (2, 72)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_ub", [False, True])
def test_rms_norm_dynamic_per_token_quant(kind, num_tokens, hidden_size, with_residual, with_ub):
    rng = np.random.default_rng(7 * hidden_size)
    x = random_rows(rng, num_tokens, hidden_size, kind, 2.0)
    w = random_rows(rng, 1, hidden_size, kind)[0]
    res = random_rows(rng, num_tokens, hidden_size, kind) if with_residual else None
    ub = np.array([0.5], np.float32) if with_ub else None
    res_o = None if res is None else res.copy()
    q, s = loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS, scale_ub=ub, residual=res)
    qo, so = loomnb.oracle.rms_norm_dynamic_per_token_quant(x, w, EPS, scale_ub=ub, residual=res_o)
    assert q.dtype.name == "float8_e4m3fn" and q.shape == x.shape and s.shape == (num_tokens, 1)
    np.testing.assert_allclose(s, so, rtol=2.0 ** -7)
    assert_fp8_codes(q, qo, ulps("norm_fp8", "fp8"), "dynamic quant")
    if with_residual:
        assert np.array_equal(res.view(np.uint8), res_o.view(np.uint8))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens, hidden_size", [(1, 8), (3, 19)])
def test_static_fp8_quant(kind, num_tokens, hidden_size):
    rng = np.random.default_rng(11 * hidden_size)
    x = random_rows(rng, num_tokens, hidden_size, kind, 2.0)
    w = random_rows(rng, 1, hidden_size, kind)[0]
    scale = np.array([0.01], np.float32)
    got = loomnb.rms_norm_static_fp8_quant(None, x, w, scale, EPS)
    assert_fp8_codes(got, loomnb.oracle.rms_norm_static_fp8_quant(None, x, w, scale, EPS), ulps("norm_fp8", "fp8"), "static")
    res = random_rows(rng, num_tokens, hidden_size, kind)
    res_o, x0 = res.copy(), x.copy()
    out, r = loomnb.fused_add_rms_norm_static_fp8_quant(None, x, res, w, scale, EPS)
    out_o, _ = loomnb.oracle.fused_add_rms_norm_static_fp8_quant(None, x, res_o, w, scale, EPS)
    assert r is res and np.array_equal(res.view(np.uint8), res_o.view(np.uint8))
    assert np.array_equal(x.view(np.uint8), x0.view(np.uint8)), "x is not modified"
    assert_fp8_codes(out, out_o, ulps("norm_fp8", "fp8"), "fused add static")


@pytest.mark.parametrize("threads", [32, 64, 256])
@pytest.mark.parametrize("hidden_size", [19, 72])
def test_block_size_sweep(threads, hidden_size):
    """The result must not depend on the launch configuration."""
    rng = np.random.default_rng(threads)
    x = random_rows(rng, 2, hidden_size, "bf16", 3.0)
    w = random_rows(rng, 1, hidden_size, "bf16")[0]
    with norm_ops.force_num_threads(threads):
        got = loomnb.rms_norm(x, w, EPS)
    assert_ulps(got, loomnb.oracle.rms_norm(x, w, EPS), ulps("norm", "bf16"), f"threads={threads}")


def _check_variant_with_32_threads(variant, num_tokens, hidden_size, seed):
    """Run ``variant`` with 32 threads a block and compare it with the oracle."""
    rng = np.random.default_rng(seed)
    x = random_rows(rng, num_tokens, hidden_size, "bf16", 2.0)
    w = random_rows(rng, 1, hidden_size, "bf16")[0]
    r = random_rows(rng, num_tokens, hidden_size, "bf16")
    xo, ro = x.copy(), r.copy()
    with norm_ops.force_num_threads(32):
        if variant == "rms":
            assert_ulps(loomnb.rms_norm(x, w, EPS), loomnb.oracle.rms_norm(x, w, EPS), ulps("norm", "bf16"), variant)
        elif variant == "add":
            loomnb.fused_add_rms_norm(x, r, w, EPS)
            loomnb.oracle.fused_add_rms_norm(xo, ro, w, EPS)
            assert_ulps(x, xo, ulps("norm", "bf16"), variant)
        else:
            q, s = loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS, residual=r)
            qo, so = loomnb.oracle.rms_norm_dynamic_per_token_quant(x, w, EPS, residual=ro)
            assert_fp8_codes(q, qo, ulps("norm_fp8", "fp8"), variant)
            np.testing.assert_array_equal(s, so)
    assert np.array_equal(r.view(np.uint16), ro.view(np.uint16)), "residual is exact"


@pytest.mark.parametrize("hidden_size, vpt", [(512, 2), (1024, 4), (2048, 8)])
@pytest.mark.parametrize("variant", ["rms", "add", "dynamic"])
def test_cached_kernel_units_per_thread(hidden_size, vpt, variant):
    """Each register-cached width (units of 16 bytes a thread) against the oracle."""
    assert norm_ops.launch_config(hidden_size, True, 32) == (32, vpt)
    _check_variant_with_32_threads(variant, 2, hidden_size, vpt)


@pytest.mark.parametrize("variant", ["rms", "add", "dynamic"])
def test_streaming_vector_kernel(variant):
    """Rows too long for the register-cached kernel stream through the vector kernel."""
    hidden_size = 8 * 257  # 257 units of 16 bytes: more than 8 units x 32 threads
    assert norm_ops.launch_config(hidden_size, True, 32) == (32, 0)
    _check_variant_with_32_threads(variant, 1, hidden_size, 9)


def test_strided_rows_and_in_place():
    """Rows of x may be strided (a slice of a wider buffer); out may be x itself."""
    rng = np.random.default_rng(5)
    wide = random_rows(rng, 3, 40, "bf16", 2.0)
    x = wide[:, 8:32]  # stride 40, 24 columns, 16-byte-aligned rows: vector path
    w = random_rows(rng, 1, 24, "bf16")[0]
    want = loomnb.oracle.rms_norm(np.ascontiguousarray(x), w, EPS)
    assert_ulps(loomnb.rms_norm(x, w, EPS), want, ulps("norm", "bf16"), "strided")
    before = wide.copy()
    loomnb.rms_norm(x, w, EPS, out=x)
    assert_ulps(np.ascontiguousarray(x), want, ulps("norm", "bf16"), "in place")
    assert np.array_equal(wide[:, :8].view(np.uint16), before[:, :8].view(np.uint16))
    assert np.array_equal(wide[:, 32:].view(np.uint16), before[:, 32:].view(np.uint16))


def test_3d_input_and_empty_batch():
    rng = np.random.default_rng(6)
    x = random_rows(rng, 4, 16, "bf16").reshape(2, 2, 16)
    w = random_rows(rng, 1, 16, "bf16")[0]
    got = loomnb.rms_norm(x, w, EPS)
    assert got.shape == (2, 2, 16)
    assert_ulps(got, loomnb.oracle.rms_norm(x, w, EPS), ulps("norm", "bf16"), "3-D")
    empty = np.zeros((0, 16), x.dtype)
    assert loomnb.rms_norm(empty, w, EPS).shape == (0, 16)
    r = np.zeros((0, 16), x.dtype)
    loomnb.fused_add_rms_norm(empty, r, w, EPS)
    q, s = loomnb.rms_norm_dynamic_per_token_quant(empty, w, EPS)
    assert q.shape == (0, 16) and s.shape == (0, 1)


def test_special_values():
    """Zero row -> 0; an inf element -> NaN there and 0 elsewhere; NaN -> +448 in FP8."""
    import ml_dtypes
    x = np.zeros((3, 16), ml_dtypes.bfloat16)
    x[1, 3] = np.inf
    x[2, :] = 1.0
    x[2, 5] = np.nan
    w = np.ones(16, ml_dtypes.bfloat16)
    y = loomnb.rms_norm(x, w, EPS).astype(np.float32)
    assert np.all(y[0] == 0)
    assert np.isnan(y[1, 3]) and np.all(y[1, np.arange(16) != 3] == 0)
    assert np.isnan(y[2]).all()
    q, s = loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS)
    qo, so = loomnb.oracle.rms_norm_dynamic_per_token_quant(x, w, EPS)
    assert np.array_equal(q.view(np.uint8), qo.view(np.uint8))
    assert np.all(q.view(np.uint8)[2] == 0x7E), "NaN values are stored as +448"
    np.testing.assert_array_equal(s, so)
