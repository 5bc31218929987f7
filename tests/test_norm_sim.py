"""RMSNorm-family kernels under numba's CUDA simulator against the oracles (the family template
of ``tests/family.py``).

Small awkward shapes (the simulator runs one Python thread per CUDA thread): hidden sizes that
are and are not multiples of 8 (cached and scalar layouts), one and several rows, strided and
per-head rows, ``out`` given or not, both rounding modes, and a sweep of the block size
(correctness must not depend on it).
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb.ops import _launch as L
from loomnb.ops import norm as norm_ops

from family import assert_bits, block_size_sweep, call_both, out_given_and_not
from helpers import assert_fp8_codes, assert_ulps, random_rows
from tolerances import ulps

pytestmark = pytest.mark.sim
KINDS = ["bf16", "f16", "f32"]
SHAPES = [(1, 8), (3, 19), (2, 72), (5, 24)]  # 72 = SmolLM2's 576 / 8; 19, 24 exercise both layouts
EPS = 1e-5
BF16 = ml_dtypes.bfloat16


@pytest.mark.parametrize("rounding", ["twice", "once"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens, hidden_size", SHAPES)
def test_rms_norm(kind, num_tokens, hidden_size, rounding):
    rng = np.random.default_rng(hidden_size)
    x = random_rows(rng, num_tokens, hidden_size, kind, 3.0)
    w = random_rows(rng, 1, hidden_size, kind)[0]
    got, want, (x_after, *_), _ = call_both("rms_norm", x, w, EPS, rounding=rounding)
    assert_ulps(got, want, ulps("norm", kind), "rms_norm")
    assert_bits(x_after, x, "x must not be modified")
    out_given_and_not(lambda out: loomnb.rms_norm(x, w, EPS, out=out, rounding=rounding),
                      lambda: np.full_like(x, 7))


@pytest.mark.parametrize("rounding", ["twice", "once"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens, hidden_size", SHAPES)
def test_fused_add_rms_norm(kind, num_tokens, hidden_size, rounding):
    rng = np.random.default_rng(hidden_size + 1)
    x = random_rows(rng, num_tokens, hidden_size, kind)
    res = random_rows(rng, num_tokens, hidden_size, kind, 4.0)
    w = random_rows(rng, 1, hidden_size, kind)[0]
    got, _, (x1, r1, _, _), (x2, r2, _, _) = call_both("fused_add_rms_norm", x, res, w, EPS,
                                                       rounding=rounding)
    assert got[0] is x1 and got[1] is r1
    assert_bits(r1, r2, "residual is elementwise: exact")
    assert_ulps(x1, x2, ulps("norm", kind), "fused_add_rms_norm x")


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
    (q, s), (qo, so), _, _ = call_both("rms_norm_dynamic_per_token_quant", x, w, EPS,
                                         scale_ub=ub, residual=res)
    assert q.dtype.name == "float8_e4m3fn" and q.shape == x.shape and s.shape == (num_tokens, 1)
    np.testing.assert_allclose(s, so, rtol=2.0 ** -7)
    assert_fp8_codes(q, qo, ulps("norm_fp8", "fp8"), "dynamic quant")
    out_given_and_not(
        lambda out: loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS, scale_ub=ub, out=out),
        lambda: np.zeros(x.shape, ml_dtypes.float8_e4m3fn))


def test_dynamic_quant_residual_is_written():
    rng = np.random.default_rng(3)
    x, w = random_rows(rng, 3, 24, "bf16"), random_rows(rng, 1, 24, "bf16")[0]
    r1, r2 = random_rows(rng, 3, 24, "bf16", 5.0), None
    r2 = r1.copy()
    loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS, residual=r1)
    loomnb.oracle.rms_norm_dynamic_per_token_quant(x, w, EPS, residual=r2)
    assert_bits(r1, r2, "residual <- r(x + residual)")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens, hidden_size", [(1, 8), (3, 19)])
def test_static_fp8_quant(kind, num_tokens, hidden_size):
    rng = np.random.default_rng(11 * hidden_size)
    x = random_rows(rng, num_tokens, hidden_size, kind, 2.0)
    w = random_rows(rng, 1, hidden_size, kind)[0]
    scale = np.array([0.01], np.float32)
    got = loomnb.rms_norm_static_fp8_quant(x, w, scale, EPS)
    want = loomnb.oracle.rms_norm_static_fp8_quant(x, w, scale, EPS)
    assert_fp8_codes(got, want, ulps("norm_fp8", "fp8"), "static")
    res = random_rows(rng, num_tokens, hidden_size, kind)
    (out, r), (out_o, r_o), (x1, *_), _ = call_both("fused_add_rms_norm_static_fp8_quant",
                                                    x, res, w, scale, EPS)
    assert_bits(r, r_o, "residual")
    assert_bits(x1, x, "x is not modified")
    assert_fp8_codes(out, out_o, ulps("norm_fp8", "fp8"), "fused add static")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rounding", ["once", "twice"])
def test_static_fp8_rounding_modes(kind, rounding):
    """``rounding="once"`` (the default, vLLM 0.24's compiled kernels) quantises ``r(x * inv *
    w)``, the norm rounded once to the activation dtype; ``"twice"`` the two-rounding norm: both
    equal their oracle, plain and fused-add; for 16-bit inputs the two differ on some codes,
    for float32 they are the same."""
    rng = np.random.default_rng(5)
    x = random_rows(rng, 3, 40, kind, 2.0)
    w = random_rows(rng, 1, 40, kind)[0]
    res = random_rows(rng, 3, 40, kind)
    scale = np.array([0.01], np.float32)
    got = loomnb.rms_norm_static_fp8_quant(x, w, scale, EPS, rounding=rounding)
    want = loomnb.oracle.rms_norm_static_fp8_quant(x, w, scale, EPS, rounding=rounding)
    assert_fp8_codes(got, want, ulps("norm_fp8", "fp8"), rounding)
    (out, r), (out_o, r_o), _, _ = call_both("fused_add_rms_norm_static_fp8_quant", x, res, w,
                                             scale, EPS, rounding=rounding)
    assert_bits(r, r_o, "residual")
    assert_fp8_codes(out, out_o, ulps("norm_fp8", "fp8"), f"fused {rounding}")
    if rounding == "once":
        assert_bits(got, loomnb.rms_norm_static_fp8_quant(x, w, scale, EPS), "the default is once")
        big = (random_rows(np.random.default_rng(6), 64, 512, kind, 2.0),
               random_rows(np.random.default_rng(7), 1, 512, kind)[0])
        differ = (loomnb.oracle.rms_norm_static_fp8_quant(*big, scale, EPS).view(np.uint8) !=
                  loomnb.oracle.rms_norm_static_fp8_quant(*big, scale, EPS, rounding="twice").view(np.uint8))
        assert differ.any() == (kind != "f32"), "16-bit inputs: the rounding point shows"


def test_static_scale_may_be_0d_and_out_may_be_uint8_codes():
    rng = np.random.default_rng(12)
    x, w = random_rows(rng, 2, 16, "bf16", 2.0), random_rows(rng, 1, 16, "bf16")[0]
    want = loomnb.oracle.rms_norm_static_fp8_quant(x, w, np.array([0.02], np.float32), EPS)
    got = loomnb.rms_norm_static_fp8_quant(x, w, np.array(0.02, np.float32), EPS)
    assert_bits(got, want, "0-d scale")
    codes = np.zeros(x.shape, np.uint8)
    assert loomnb.rms_norm_static_fp8_quant(x, w, np.array([0.02], np.float32), EPS, out=codes) is codes
    assert_bits(codes, want, "uint8 out")


@pytest.mark.parametrize("hidden_size", [19, 72])
def test_block_size_sweep(hidden_size):
    """The result must not depend on the launch configuration."""
    rng = np.random.default_rng(hidden_size)
    x = random_rows(rng, 2, hidden_size, "bf16", 3.0)
    w = random_rows(rng, 1, hidden_size, "bf16")[0]
    want = loomnb.oracle.rms_norm(x, w, EPS)
    block_size_sweep(lambda: loomnb.rms_norm(x, w, EPS),
                     lambda got, what: assert_ulps(got, want, ulps("norm", "bf16"), what),
                     threads=(32, 64, 256))


def _check_variant_with_32_threads(variant, num_tokens, hidden_size, seed):
    rng = np.random.default_rng(seed)
    x = random_rows(rng, num_tokens, hidden_size, "bf16", 2.0)
    w = random_rows(rng, 1, hidden_size, "bf16")[0]
    r = random_rows(rng, num_tokens, hidden_size, "bf16")
    xo, ro = x.copy(), r.copy()
    with L.force_threads(32):
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
    assert_bits(r, ro, "residual is exact")


@pytest.mark.parametrize("hidden_size, vpt", [(512, 2), (1024, 4), (2048, 8)])
@pytest.mark.parametrize("variant", ["rms", "add", "dynamic"])
def test_cached_kernel_units_per_thread(hidden_size, vpt, variant):
    """Each register-cached width (units of 16 bytes a thread) against the oracle."""
    assert norm_ops.launch_config(hidden_size, True, 32) == (32, vpt)
    _check_variant_with_32_threads(variant, 2, hidden_size, vpt)


@pytest.mark.parametrize("variant", ["rms", "add", "dynamic"])
def test_rows_too_long_to_cache_take_the_scalar_layout(variant):
    hidden_size = 8 * 257  # 257 units of 16 bytes: more than 8 units x 32 threads
    assert norm_ops.launch_config(hidden_size, True, 32) == (32, 0)
    _check_variant_with_32_threads(variant, 1, hidden_size, 9)


def test_strided_rows_and_in_place():
    """Rows of x may be strided (a slice of a wider buffer); out may be x itself."""
    rng = np.random.default_rng(5)
    wide = random_rows(rng, 3, 40, "bf16", 2.0)
    x = wide[:, 8:32]  # stride 40, 24 columns, 16-byte-aligned rows: cached layout
    w = random_rows(rng, 1, 24, "bf16")[0]
    want = loomnb.oracle.rms_norm(np.ascontiguousarray(x), w, EPS)
    assert_ulps(loomnb.rms_norm(x, w, EPS), want, ulps("norm", "bf16"), "strided")
    before = wide.copy()
    loomnb.rms_norm(x, w, EPS, out=x)
    assert_ulps(np.ascontiguousarray(x), want, ulps("norm", "bf16"), "in place")
    assert_bits(wide[:, :8], before[:, :8], "left of the slice")
    assert_bits(wide[:, 32:], before[:, 32:], "right of the slice")


@pytest.mark.parametrize("head_size", [16, 19])
def test_per_head_views_of_a_wider_buffer(head_size):
    """Qwen3/Gemma 3 q/k norm: ``[num_tokens, num_heads, head_size]`` cut out of a QKV buffer
    (strides (2*num_heads*head_size, head_size, 1)) -- no copy, the rest untouched."""
    rng = np.random.default_rng(head_size)
    num_tokens, num_heads = 3, 4
    qkv = random_rows(rng, num_tokens, 2 * num_heads * head_size, "bf16", 2.0)
    q = qkv.reshape(num_tokens, 2 * num_heads, head_size)[:, :num_heads]
    w = random_rows(rng, 1, head_size, "bf16")[0]
    want = loomnb.oracle.rms_norm(np.ascontiguousarray(q), w, EPS)
    assert_bits(loomnb.rms_norm(q, w, EPS), want, "per-head rms_norm")
    before = qkv.copy()
    loomnb.rms_norm(q, w, EPS, out=q)
    assert_bits(q, want, "per-head in place")
    assert_bits(qkv[:, num_heads * head_size:], before[:, num_heads * head_size:], "k half untouched")
    r = random_rows(rng, num_tokens * num_heads, head_size, "bf16").reshape(num_tokens, num_heads, head_size)
    x1, r1 = np.ascontiguousarray(qkv.reshape(num_tokens, 2 * num_heads, head_size)[:, num_heads:]), r.copy()
    kv = qkv.reshape(num_tokens, 2 * num_heads, head_size)[:, num_heads:]
    loomnb.oracle.fused_add_rms_norm(x1, r1, w, EPS)
    loomnb.fused_add_rms_norm(kv, r, w, EPS)
    assert_bits(kv, x1, "per-head fused add")
    assert_bits(r, r1, "per-head residual")


def test_size_one_leading_dimension_with_any_stride():
    rng = np.random.default_rng(8)
    buf = random_rows(rng, 1, 8 * 64, "bf16")
    x = np.lib.stride_tricks.as_strided(buf, (1, 4, 64), (512 * 2, 64 * 2, 2))
    w = random_rows(rng, 1, 64, "bf16")[0]
    assert_bits(loomnb.rms_norm(x, w, EPS), loomnb.oracle.rms_norm(np.ascontiguousarray(x), w, EPS), "(1, 4, 64)")


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


@pytest.mark.parametrize("hidden_size", [16, 19])
def test_special_values_bit_identical_to_the_oracle(hidden_size):
    """Zero row -> 0; an inf element -> NaN there and +-0 elsewhere (signed zeros kept in FP8:
    0x80); NaN rows as the canonical 0x7FFF; NaN -> +448 in FP8."""
    rng = np.random.default_rng(hidden_size)
    x = (rng.standard_normal((4, hidden_size)) * 2).astype(BF16)
    x[0] = 0
    x[1, 3] = np.inf
    x[2, 5] = np.nan
    w = np.ones(hidden_size, BF16)
    y = loomnb.rms_norm(x, w, EPS)
    assert_bits(y, loomnb.oracle.rms_norm(x, w, EPS), "rms_norm special values")
    assert set(y.view(np.uint16)[2].tolist()) == {0x7FFF}
    q, s = loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS)
    qo, so = loomnb.oracle.rms_norm_dynamic_per_token_quant(x, w, EPS)
    assert_bits(q, qo, "dynamic quant special values")
    np.testing.assert_array_equal(s, so)
    neg = x[1].astype(np.float32) < 0
    assert (q.view(np.uint8)[1][neg & np.isfinite(x[1].astype(np.float32))] == 0x80).all()
    assert np.all(q.view(np.uint8)[2] == 0x7E), "NaN values are stored as +448"
