"""The oracles' one rounding helper: float32 -> the activation dtype, as the GPU rounds.

``to_dtype(v, dtype)`` rounds to nearest even (ml_dtypes / NumPy) and writes every NaN as the
canonical NaN the GPU's conversion instructions produce -- 0x7FFF for bf16 and fp16 (CUDA's
``__float2bfloat16_rn``/``cvt.rn.bf16.f32``, which vLLM's and torch's CUDA kernels use) --
where ml_dtypes would keep the sign and write 0x7FC0/0xFFC0 (torch's CPU conversion does the
same). So "bit-identical to the oracle" holds for NaN rows too.
"""

import numpy as np

CANONICAL_NAN = {2: np.uint16(0x7FFF)}


def to_dtype(v, dtype):
    """``r(v)``: float32 ``v`` rounded to ``dtype`` (bf16, fp16 or fp32), NaN canonical."""
    out = np.asarray(v, dtype=np.float32).astype(dtype)
    if out.dtype.itemsize == 2:
        nan = np.isnan(out.astype(np.float32))
        if nan.any():
            out.view(np.uint16)[nan] = CANONICAL_NAN[2]
    return out


def fma_f32(a, b, c):
    """``fma(a, b, c)`` in float32, rounded once (IEEE ``fma.rn.f32``), on NumPy arrays/scalars.

    NumPy's float32 arithmetic never fuses, so an oracle that must reproduce a GPU's FMA
    emulates it: ``a * b`` of two float32 values is exact in float64 (48 significant bits), and
    ``p + c`` is then computed in float64 with **round to odd** (the float64 sum plus its exact
    TwoSum error: an inexact sum whose last bit is even is moved one float64 ulp toward the
    error), which makes the final rounding to float32 (nearest even) correct -- no double
    rounding, since float64 keeps 29 > 2 extra bits. Exact for every input, subnormal results,
    overflow to inf, NaN and signed zeros included (``tests/test_rope_cache_oracle.py`` checks
    it against exact rational arithmetic; ``tests/test_rope_cache_gpu.py`` against the GPU).
    """
    a64 = np.asarray(a, dtype=np.float32).astype(np.float64)
    b64 = np.asarray(b, dtype=np.float32).astype(np.float64)
    c64 = np.asarray(c, dtype=np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = a64 * b64  # exact
        s = p + c64
        bb = s - p  # TwoSum: err = (p - (s - bb)) + (c - bb), exact when s is finite
        err = (p - (s - bb)) + (c64 - bb)
        odd = (s.view(np.int64) & 1) == 1
        fix = np.isfinite(s) & (err != 0) & ~odd
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


def as_rows(a):
    """``a [..., n]`` as ``[rows, n]`` (``rows`` the product of the leading dimensions; also
    when ``n`` is 0, where ``reshape(-1, 0)`` is ambiguous)."""
    a = np.asarray(a)
    rows = 1
    for d in a.shape[:-1]:
        rows *= d
    return a.reshape(rows, a.shape[-1])
