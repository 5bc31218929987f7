"""The shared FP8 device helpers (``loomnb.ops._fp8``) and every FP8 encoder on the GPU, where
the hardware instructions run (the simulator runs the portable twins): correctly rounded
division with signed zeros, the sign of zero in every encoder, the NaN clamps, UE8M0 scales."""

import ml_dtypes
import numpy as np
import pytest
from numba import cuda, float32

from loomnb.layouts import dtypes as d
from loomnb.oracle import fp8 as ofp8
from loomnb.ops import _fp8

pytestmark = pytest.mark.gpu


@cuda.jit
def _divide(a, b, out, ref):
    """``out = div_rn(a, b, RN(1/b))`` and ``ref = a / b`` (IEEE ``div.rn.f32``)."""
    i = cuda.grid(1)
    if i < a.shape[0]:
        rb = float32(1.0) / b[i]
        out[i] = _fp8.div_rn(a[i], b[i], rb)
        ref[i] = a[i] / b[i]


def test_reciprocal_division_equals_ieee_division_signed_zeros_included():
    """div_rn (Markstein's correction from RN(1/b)) equals a true float32 division bit for bit,
    -0.0 numerators and tiny quotients that round to zero included."""
    k = _divide
    rng = np.random.default_rng(0)
    n = 1 << 22
    amax = rng.uniform(1e-3, 1e3, n).astype(np.float32)
    b = np.maximum(amax / np.float32(448.0), np.float32(1 / (448 * 512.0))).astype(np.float32)
    a = (rng.uniform(-1, 1, n) * amax).astype(ml_dtypes.bfloat16).astype(np.float32)
    b[:1000] = np.float32(1 / (448 * 512.0))  # the floor scale
    b[1000:2000] = np.nextafter(np.float32(1), np.float32(2)) * rng.uniform(0.5, 2, 1000).astype(np.float32)
    a[2000:3000] = -0.0
    a[3000:4000] = 0.0
    a[4000:5000] = -np.float32(1e-44)  # denormal numerators: quotients underflow, keep the sign
    b[4000:5000] = np.float32(3e38)
    out, ref = cuda.device_array(n, np.float32), cuda.device_array(n, np.float32)
    k[(n + 255) // 256, 256](cuda.to_device(a), cuda.to_device(b), out, ref)
    o, r = out.copy_to_host(), ref.copy_to_host()
    assert np.array_equal(o.view(np.uint32), r.view(np.uint32))
    assert (o[2000:3000].view(np.uint32) == 0x80000000).all() and (o[4000:5000].view(np.uint32) == 0x80000000).all()


def test_division_by_scales_outside_the_normal_range_and_overflowing_quotients():
    """The divisors Markstein's correction cannot take -- subnormal (a group of tiny values with
    eps = 0: amax 6.3e-38 / 448), zero, huge, infinite, NaN -- and quotients that overflow
    (a scale_ub far below the amax) give IEEE's quotient, bit for bit."""
    k = _divide
    rng = np.random.default_rng(1)
    n = 1 << 16
    a = (rng.standard_normal(n) * 10.0 ** rng.uniform(-40, 38, n)).astype(np.float32)
    b = np.empty(n, np.float32)
    q = n // 8
    b[:q] = np.float32(6.3e-38) / np.float32(448.0)                      # subnormal scale
    b[q:2 * q] = rng.uniform(1e-45, 1.2e-38, q).astype(np.float32)      # any subnormal
    b[2 * q:3 * q] = rng.choice(np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32), q)
    b[3 * q:4 * q] = rng.uniform(1e37, 3e38, q).astype(np.float32)      # huge: 1/b subnormal
    b[4 * q:5 * q] = np.float32(1 / 448.0)                              # quotients overflow ...
    a[4 * q:5 * q] = rng.choice(np.array([3e38, -3e38, 1e36, -1e37], np.float32), q)
    b[5 * q:] = rng.uniform(2.0 ** -124, 2.0 ** 124, n - 5 * q).astype(np.float32)
    a[:q:7] = -0.0
    out, ref = cuda.device_array(n, np.float32), cuda.device_array(n, np.float32)
    k[(n + 255) // 256, 256](cuda.to_device(a), cuda.to_device(b), out, ref)
    o, r = out.copy_to_host(), ref.copy_to_host()
    same = (o.view(np.uint32) == r.view(np.uint32)) | (np.isnan(o) & np.isnan(r))
    assert same.all(), f"{int((~same).sum())} quotients differ; first: a={a[~same][:3]}, b={b[~same][:3]}"


def test_group_quant_of_a_tiny_group_with_eps_zero_and_an_inf_group():
    """The issue's Qwen3.5 expert: amax 6.3e-38 with eps = 0 gives a subnormal scale whose
    reciprocal is inf; the codes must equal the oracle's true division (zeros stay 0x00, not
    0xFE). A group holding +inf gets scale +inf (UE8M0 too), as the oracle."""
    import torch
    import loomnb
    x = torch.zeros(2, 128, dtype=torch.float32, device="cuda")
    x[0, :5] = torch.tensor([6.3e-38, -6.3e-38, 3e-38, 0.0, -0.0])
    x[1, 3] = float("inf")
    x[1, 4] = -2.0
    for ue8m0 in (False, True):
        q, s = loomnb.per_token_group_quant_fp8(x, 128, eps=0.0, use_ue8m0=ue8m0)
        wq, ws = loomnb.oracle.per_token_group_quant_fp8(x.cpu().numpy(), 128, eps=0.0,
                                                         use_ue8m0=ue8m0)
        assert np.array_equal(q.view(torch.uint8).cpu().numpy(), np.asarray(wq).view(np.uint8)), ue8m0
        assert np.array_equal(s.cpu().numpy().view(np.uint32), np.asarray(ws).view(np.uint32)), ue8m0
        assert q.view(torch.uint8)[0, 5:].eq(0).all(), "zeros of a tiny group encode as 0x00"
        assert s[1, 0].item() == float("inf")


def test_every_fp8_encoder_keeps_the_sign_of_zero_and_clamps_nan():
    @cuda.jit
    def k(xs, out):
        i = cuda.grid(1)
        if i < xs.shape[0]:
            v = xs[i]
            out[i, 0] = d.f32_to_e4m3(v)                            # hardware cvt.rn.satfinite
            out[i, 1] = d.f32_to_e4m3_portable(v)                   # integer twin
            out[i, 2] = d.pack_e4m3x2(v, float32(1.0)) >> 8         # packed pair, high half
            out[i, 3] = d.f32_to_e4m3(_fp8.clamp_fp8(v))            # per-token/static path
            out[i, 4] = d.f32_to_e4m3(_fp8.clamp_fp8_nan_low(v))    # group-quant path

    xs = np.array([-0.0, 0.0, -1e-30, -2.0 ** -11, -2.0 ** -10 * 1.01, 1e-30, -1e5, 1e5, np.nan, -np.nan],
                  np.float32)
    out = cuda.device_array((xs.size, 5), np.uint32)
    k[1, 32](cuda.to_device(xs), out)
    o = out.copy_to_host()
    want = ofp8.e4m3_encode(xs)
    for c in range(3):
        assert list(o[:8, c]) == list(want[:8]), c
    assert list(o[:4, 0]) == [0x80, 0x00, 0x80, 0x80]
    assert list(o[8:, 3]) == [0x7E, 0x7E], "NaN -> +448 after fminf"
    assert list(o[8:, 4]) == [0xFE, 0xFE], "NaN -> -448 after fmaxf first"
    assert list(o[:8, 3]) == list(ofp8.e4m3_encode(ofp8.clamp_fp8(xs[:8])))
    assert list(o[:8, 4]) == list(ofp8.e4m3_encode(ofp8.clamp_fp8_nan_low(xs[:8])))


def test_ue8m0_reproduces_log2f_rounding():
    """exp2f(ceilf(log2f(max(s, 1e-10)))) on the GPU equals the oracle, including scales just
    above and below powers of two (where log2f may round to the integer) and amax = 300."""
    @cuda.jit
    def k(s, out):
        i = cuda.grid(1)
        if i < s.shape[0]:
            out[i] = _fp8.ue8m0(s[i])

    rng = np.random.default_rng(1)
    pow2 = np.float32(2.0) ** np.arange(-40, 40, dtype=np.float32)
    s = np.concatenate([rng.uniform(1e-12, 1e4, 1 << 16).astype(np.float32), pow2,
                        np.nextafter(pow2, np.float32(np.inf)), np.nextafter(pow2, np.float32(0)),
                        pow2 * np.float32(1 + 2 ** -22), np.array([300 / 448, 0.0, 1e-12], np.float32)]
                       ).astype(np.float32)
    out = cuda.device_array(s.size, np.float32)
    k[(s.size + 255) // 256, 256](cuda.to_device(s), out)
    got = out.copy_to_host()
    want = ofp8.ue8m0(s)
    bad = got != want
    assert not bad.any(), f"{bad.sum()} differ, e.g. s={s[bad][:5]} gpu={got[bad][:5]} oracle={want[bad][:5]}"
    assert ofp8.ue8m0(np.float32(300 / 448)) == 1.0
