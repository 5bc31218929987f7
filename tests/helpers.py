"""Comparison helpers shared by the tests."""

import ml_dtypes
import numpy as np

KIND_DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}


def ordered(a):
    """Bit patterns of a float array mapped to integers whose difference counts ulps."""
    a = np.asarray(a)
    bits = a.view({2: np.int16, 4: np.int32}[a.dtype.itemsize]).astype(np.int64)
    sign_bit = 1 << (8 * a.dtype.itemsize - 1)
    return np.where(bits < 0, -(bits + sign_bit), bits)


def assert_ulps(got, want, tol, what=""):
    """Bit-equal, except at most ``frac`` of the elements by at most ``ulps`` units in the last
    place (``tol = (ulps, frac)`` from ``tolerances.ulps``); NaN matches NaN only."""
    max_ulps, frac = tol
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    gn, wn = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    assert np.array_equal(gn, wn), f"{what}: NaN positions differ"
    d = np.abs(ordered(got) - ordered(want))[~gn]
    worst = int(d.max()) if d.size else 0
    ndiff = int((d > 0).sum())
    assert worst <= max_ulps and ndiff <= frac * d.size, (
        f"{what}: {ndiff} of {d.size} elements differ, by up to {worst} ulps "
        f"(allowed: {frac:g} of them, by {max_ulps})")


def assert_fp8_codes(got, want, tol, what=""):
    """FP8 E4M3 codes bit-equal except at most ``frac`` of them by ``steps`` adjacent codes."""
    max_steps, frac = tol
    g = np.asarray(got).view(np.uint8).astype(np.int64)
    w = np.asarray(want).view(np.uint8).astype(np.int64)
    gs = np.where(g & 0x80, -(g & 0x7F), g & 0x7F)
    ws = np.where(w & 0x80, -(w & 0x7F), w & 0x7F)
    d = np.abs(gs - ws)
    ndiff = int((d > 0).sum())
    assert int(d.max(initial=0)) <= max_steps and ndiff <= frac * d.size, (
        f"{what}: {ndiff} of {d.size} FP8 codes differ, by up to {int(d.max(initial=0))} steps")


def random_rows(rng, num_tokens, hidden_size, kind, scale=1.0):
    return (rng.standard_normal((num_tokens, hidden_size)) * scale).astype(KIND_DTYPES[kind])


def assert_device_assert(code, message):
    """Run ``code`` (Python that ends with ``torch.cuda.synchronize()``) in a subprocess -- a
    device-side assert ends its CUDA context -- and check that it fired with ``message`` in
    torch's report and that the kernel queued after it did not run."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-c", code + "print('NO ASSERT')\n"],
                         capture_output=True, text=True, timeout=300)
    out = res.stderr + res.stdout
    assert res.returncode != 0 and "NO ASSERT" not in out, out[-2000:]
    assert f"Assertion `{message}" in out, out[-2000:]
    assert "CUDA_ERROR_ASSERT" in out or "device-side assert" in out, out[-2000:]
