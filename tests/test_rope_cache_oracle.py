"""The RoPE / KV-cache oracles and the scaffold primitives they brought, on the CPU (plain pass):
``loomnb.oracle.numerics.fma_f32`` against exact rational arithmetic, ``e5m2_encode`` against
its definition, the portable E5M2 device encoder against the oracle (every bf16 and fp16 value,
boundaries, specials; simulator pass), and the RoPE oracles (in place and out of place) on
hand-checked values.
"""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import loomnb.oracle as O
from loomnb.layouts import dtypes as d
from loomnb.oracle.fp8 import e5m2_decode, e5m2_encode
from loomnb.oracle.numerics import fma_f32

BF16 = ml_dtypes.bfloat16


def exact_f32(v: Fraction) -> np.float32:
    """``v`` rounded to float32, nearest even, by comparing the neighbours of a close guess."""
    g = np.float32(float(v))
    cands = {np.nextafter(g, np.float32(-np.inf)), g, np.nextafter(g, np.float32(np.inf))}
    best = min(cands, key=lambda x: (abs(Fraction(float(x)) - v),
                                     int(np.float32(x).view(np.uint32)) & 1))
    return np.float32(best)


def fma_cases(rng, n):
    """Random triples plus ``c`` placed so that ``a*b + c`` lands on or next to float32 ties
    (where float64 double rounding goes wrong without round-to-odd)."""
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    p = a.astype(np.float64) * b.astype(np.float64)
    k = rng.integers(0, 4, n)
    c = np.where(k == 0, rng.standard_normal(n), -p * np.choose(k, [1, 1 - 2.0 ** -20, 1 + 2.0 ** -24,
                                                                    3.0])).astype(np.float32)
    # exact ties of float32: c = t - p with p + c a midpoint between two float32 values
    return a, b, c


def test_fma_f32_is_exact():
    rng = np.random.default_rng(0)
    a, b, c = fma_cases(rng, 4000)
    got = fma_f32(a, b, c)
    want = np.array([exact_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                     for x, y, z in zip(a, b, c)], np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_fma_f32_double_rounding_corner():
    """a*b = 1 + 2^-24 + 2^-60 exactly: float64 would round the sum to the float32 tie 1 + 2^-24
    and then to 1.0 (even); the correct float32 result is 1 + 2^-23."""
    a = np.float32(1 + 2.0 ** -12)
    b = np.float32(1 + 2.0 ** -12)  # a*b = 1 + 2^-11 + 2^-24
    c = np.float32(-(2.0 ** -11))
    # a*b + c = 1 + 2^-24 exactly: a tie, rounds to even (1.0)
    assert fma_f32(a, b, c) == np.float32(1.0)
    c2 = np.nextafter(c, np.float32(0))  # a hair above the tie
    want = exact_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c2)))
    assert fma_f32(a, b, c2) == want == np.float32(1 + 2.0 ** -23)


def test_fma_f32_specials():
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    assert np.isnan(fma_f32(inf, np.float32(0), np.float32(1)))
    assert fma_f32(np.float32(3e38), np.float32(3e38), np.float32(-1)) == inf
    assert fma_f32(np.float32(1e-30), np.float32(1e-30), np.float32(0)) == 0
    z = fma_f32(np.float32(-0.0), np.float32(1), np.float32(-0.0))
    assert z == 0 and np.signbit(z)
    assert np.isnan(fma_f32(nan, np.float32(1), np.float32(1)))
    sub = fma_f32(np.float32(2.0 ** -70), np.float32(2.0 ** -70), np.float32(2.0 ** -140))
    assert sub == exact_f32(Fraction(2) ** -140 + Fraction(2) ** -140)


def test_e5m2_encode_saturates_and_keeps_nan_and_signed_zero():
    x = np.array([0, -0.0, 1, 57344, 61439, 61440, 1e9, np.inf, -np.inf, np.nan, 2 ** -16,
                  2 ** -17, 1.5 * 2 ** -17, -3e-6], np.float32)
    assert e5m2_encode(x).tolist() == [0, 0x80, 0x3C, 0x7B, 0x7B, 0x7B, 0x7B, 0x7B, 0xFB, 0x7F,
                                       1, 0, 1, 0x80]
    finite = np.isfinite(x) & (np.abs(x) <= 57344)
    assert np.array_equal(e5m2_decode(e5m2_encode(x))[finite],
                          x[finite].astype(ml_dtypes.float8_e5m2).astype(np.float32))


@pytest.mark.sim
def test_portable_e5m2_equals_the_oracle():
    """Every bf16 and fp16 value, random float32 bits and the rounding boundaries (simulator
    pass: the device functions are plain Python there; tests/test_rope_cache_gpu.py compares
    the hardware encoder with them)."""
    rng = np.random.default_rng(1)
    xs = np.concatenate([
        np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(BF16).astype(np.float32),
        np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32),
        rng.integers(0, 1 << 32, 50000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        np.linspace(-70000, 70000, 20001, dtype=np.float32),
        np.linspace(-2 ** -13, 2 ** -13, 20001, dtype=np.float32)])
    enc = np.vectorize(lambda v: int(d.f32_to_e5m2_portable(np.float32(v))), otypes=[np.int64])
    got = enc(xs)
    assert np.array_equal(got, e5m2_encode(xs).astype(np.int64))
    dec = np.vectorize(lambda c: float(d.e5m2_to_f32(c)), otypes=[np.float32])
    codes = np.arange(256)
    ref = e5m2_decode(codes.astype(np.uint8))
    out = dec(codes)
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    assert np.array_equal(out[~np.isnan(ref)], ref[~np.isnan(ref)])


def cos_sin(rot_dim, dtype, max_pos=8, base=10000.0):
    inv = 1.0 / base ** (np.arange(0, rot_dim, 2, dtype=np.float32) / rot_dim)
    f = np.outer(np.arange(max_pos, dtype=np.float32), inv).astype(np.float32)
    return np.concatenate([np.cos(f), np.sin(f)], -1).astype(dtype)


@pytest.mark.parametrize("is_neox, sin_at", [(False, 1), (True, 64)])
def test_oracle_unit_vector(is_neox, sin_at):
    q = np.zeros((1, 128), BF16)
    q[0, 0] = 1
    O.rotary_embedding(np.array([1], np.int64), q, None, 128, cos_sin(128, BF16), is_neox)
    out = q[0].astype(np.float32)
    assert out[0] == np.float32(0.5390625) and out[sin_at] == np.float32(0.83984375)
    assert np.count_nonzero(out) == 2


def test_oracle_out_of_place_unit_vector_and_pass_through():
    """apply_rope_with_cos_sin_cache's oracle: the hand-checked unit vector (GPT-J, position 1)
    lands in new arrays, the inputs keep their bits, and with rot_dim 64 of head_size 128 the
    channels 64.. are copied as they are; given outputs are filled and returned."""
    q = np.zeros((1, 128), BF16)
    q[0, 0] = 1
    q[0, 100] = 3
    k = q.copy()
    before = q.copy()
    qo, ko = O.apply_rope_with_cos_sin_cache(np.array([1], np.int64), q, k, 128,
                                             cos_sin(64, BF16), False)
    assert np.array_equal(q.view(np.uint16), before.view(np.uint16))
    for out in (qo, ko):
        f = out[0].astype(np.float32)
        assert f[0] == np.float32(0.5390625) and f[1] == np.float32(0.83984375)
        assert f[100] == 3 and np.count_nonzero(f) == 3
    given = np.full_like(q, 7), np.full_like(k, 7)
    got = O.apply_rope_with_cos_sin_cache(np.array([1], np.int64), q, k, 128, cos_sin(64, BF16),
                                          False, query_out=given[0], key_out=given[1])
    assert got[0] is given[0] and np.array_equal(given[0].view(np.uint16), qo.view(np.uint16))


def test_oracle_forms_are_the_formulas():
    """Form 'nn' is plain float32 NumPy; 'ae' fuses x*c and x*s as fma_f32 says."""
    rng = np.random.default_rng(2)
    x, y, c, s = (rng.standard_normal(1000).astype(np.float32) for _ in range(4))
    xo, yo = O.rope_cache.rotate(x, y, c, s, "nn")
    assert np.array_equal(xo, x * c - y * s) and np.array_equal(yo, y * c + x * s)
    xo, yo = O.rope_cache.rotate(x, y, c, s, "ae")
    assert np.array_equal(xo, fma_f32(x, c, -(y * s))) and np.array_equal(yo, fma_f32(x, s, y * c))
    xo, yo = O.rope_cache.rotate(x, y, c, s, "bd")
    assert np.array_equal(xo, fma_f32(-y, s, x * c)) and np.array_equal(yo, fma_f32(y, c, x * s))


def test_oracle_cache_write_skips_padding():
    key = np.arange(2 * 1 * 8, dtype=np.float32).reshape(2, 1, 8).astype(BF16)
    kc = np.zeros((2, 4, 1, 8), BF16)
    vc = np.zeros((2, 4, 1, 8), BF16)
    O.reshape_and_cache_flash(key, key, kc, vc, np.array([5, -1], np.int64), "auto", None, None)
    assert np.array_equal(kc[1, 1, 0], key[0, 0]) and np.count_nonzero(kc.astype(np.float32)) == 7
    kc8 = np.zeros((2, 4, 1, 8), np.uint8)
    O.reshape_and_cache_flash(key, key, kc8, kc8.copy(), np.array([-1, 7], np.int64), "fp8",
                              np.array([2.0], np.float32), np.array([1.0], np.float32))
    assert kc8[1, 3, 0].tolist() == O.e4m3_encode(key[1, 0].astype(np.float32) / 2).tolist()
