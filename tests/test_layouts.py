"""bf16 / fp16 / FP8 E4M3 packing: the portable device functions against ml_dtypes, exhaustively.

Runs in the simulator pass, where the device functions are plain Python over NumPy scalars;
``test_norm_gpu.py`` (``test_hardware_conversions_equal_the_portable_ones``) runs the same functions compiled on the GPU and proves Hopper's
hardware conversions bit-identical to them.
"""

import ml_dtypes
import numpy as np
import pytest

from loomnb.oracle.fp8 import e4m3_encode

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def d():
    from loomnb.layouts import dtypes
    return dtypes


def _vec(fn):
    return np.vectorize(lambda v: int(fn(v)) if not isinstance(fn(v), (float, np.floating)) else fn(v))


def bits16_all():
    return np.arange(1 << 16, dtype=np.uint32)


def nan_safe_equal(got_bits, want_bits, dtype):
    g = np.asarray(got_bits, dtype=np.uint16).view(dtype).astype(np.float32)
    w = np.asarray(want_bits, dtype=np.uint16).view(dtype).astype(np.float32)
    both_nan = np.isnan(g) & np.isnan(w)
    return both_nan | (np.asarray(got_bits) == np.asarray(want_bits))


def boundary_floats(rng):
    """Dense float32 sweep: random bits, powers of two and values next to rounding boundaries."""
    r = rng.integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    pw = np.ldexp(np.float32(1), np.arange(-30, 20)).astype(np.float32)
    near = np.concatenate([np.nextafter(pw, np.float32(0)), np.nextafter(pw, np.float32(np.inf)), pw])
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65520, 65519.996, 65536,
                         448, 464, 465, 480, 1e9, -1e9], dtype=np.float32)
    x = np.concatenate([r, near, -near, specials]).astype(np.float32)
    return x


def test_bf16_decode_all_65536(d):
    bits = bits16_all()
    got = np.array([d.bf16_to_f32(int(b)) for b in bits], dtype=np.float32)
    want = bits.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_bf16_encode_round_trip_all_65536(d):
    bits = bits16_all()
    f = bits.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    got = np.array([d.f32_to_bf16_portable(v) for v in f])
    nan = np.isnan(f)
    assert np.array_equal(got[~nan], bits[~nan])
    assert np.all(got[nan] == 0x7FFF), "NaN must become CUDA's canonical bf16 NaN 0x7FFF"


def test_bf16_encode_rne_sweep(d):
    x = boundary_floats(np.random.default_rng(1))
    got = np.array([d.f32_to_bf16_portable(v) for v in x])
    with np.errstate(invalid="ignore"):  # the sweep's NaNs: NumPy warns on casting them
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert nan_safe_equal(got, want, ml_dtypes.bfloat16).all()


def test_f16_decode_all_65536(d):
    bits = bits16_all()
    got = np.array([d.f16_to_f32_portable(int(b)) for b in bits], dtype=np.float32)
    want = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()


def test_f16_encode_round_trip_and_sweep(d):
    bits = bits16_all()
    f = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    got = np.array([d.f32_to_f16_portable(v) for v in f])
    nan = np.isnan(f)
    assert np.array_equal(got[~nan], bits[~nan])
    assert np.all(got[nan] == 0x7FFF)
    x = boundary_floats(np.random.default_rng(2))
    got = np.array([d.f32_to_f16_portable(v) for v in x])
    with np.errstate(over="ignore", invalid="ignore"):  # past float16's range: inf, as intended
        want = x.astype(np.float16).view(np.uint16)
    assert nan_safe_equal(got, want, np.float16).all()


def test_e4m3_decode_all_256(d):
    codes = np.arange(256)
    got = np.array([d.e4m3_to_f32(int(c)) for c in codes], dtype=np.float32)
    want = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    nan = np.isnan(want)
    assert nan.sum() == 2
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()


def test_e4m3_encode_every_rounding_boundary(d):
    """Every code, the midpoints between neighbours and one float32 ulp either side of them."""
    vals = np.arange(256).astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    pos = np.unique(vals[(vals >= 0) & np.isfinite(vals)])
    mids = (pos[:-1] + pos[1:]) / 2
    grid = np.concatenate([pos, mids, np.nextafter(mids, np.float32(0)),
                           np.nextafter(mids, np.float32(np.inf)), [464, 465, 479.99, 480, 1e30, np.inf]])
    grid = np.concatenate([grid, -grid, [np.nan]]).astype(np.float32)
    grid = np.concatenate([grid, boundary_floats(np.random.default_rng(3))[:4000]])
    got = np.array([d.f32_to_e4m3_portable(v) for v in grid], dtype=np.uint8)
    want = e4m3_encode(grid)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("x, code", [
    (464.0, 0x7E), (465.0, 0x7E), (-1000.0, 0xFE), (2.0 ** -10, 0x00), (3 * 2.0 ** -10, 0x02),
    (448.0, 0x7E), (-0.0, 0x80), (float("inf"), 0x7E), (float("nan"), 0x7F),
])
def test_e4m3_encode_public_cases(d, x, code):
    """Saturate, never NaN, from finite input; 3*2^-10 rounds to 2^-8; NaN stays NaN."""
    assert d.f32_to_e4m3_portable(np.float32(x)) == code
    assert e4m3_encode(np.float32(x)) == code


def test_bf16_from_torch_like_bits_reads_1_3_minus1(d):
    """bf16 [1, 3, -1] stored as bits must decode to 1, 3, -1 (not fp16's 1.875, 2.125, -1.875)."""
    bits = np.array([1, 3, -1], dtype=ml_dtypes.bfloat16).view(np.uint16)
    assert [float(d.bf16_to_f32(int(b))) for b in bits] == [1.0, 3.0, -1.0]
