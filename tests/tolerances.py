"""One tolerance table for every comparison with an oracle, keyed by (family, dtype).

Elementwise math is compared bit for bit. The RMSNorm family's only non-elementwise step is
``inv = r32(1 / sqrt(sum(s^2) / H + eps))``, which kernels and oracle both evaluate in float64
(``loomnb.ops._norm_kernels.inv_rms``). A float64 sum rounds to the same float32 whatever the
order of additions, except when it lands within ~1e-16 (relative) of a float32 rounding boundary:
about 1e-7 of rows. Such a row's ``inv`` moves one float32 ulp, which can move an output one ulp
of its dtype (an FP8 code one step). So outputs must be bit-identical except for at most
``frac`` of the elements, and those by at most ``ulps``.
"""

# (family, dtype) -> (ulps, frac, reason)
TOL = {
    ("norm", "bf16"): (1, 1e-4, "float64 RMS: exact but for rows whose sum sits on a float32 rounding boundary"),
    ("norm", "f16"): (1, 1e-4, "same"),
    ("norm", "f32"): (1, 1e-4, "same"),
    ("norm_fp8", "fp8"): (1, 1e-4, "same, one FP8 code step"),
    ("residual", "any"): (0, 0.0, "r(x + residual) is elementwise: bit-exact"),
}

# relative tolerance of the per-token FP8 scale: amax/448 of values that are bit-exact but for
# the rare boundary rows above, where amax can move one bf16 ulp (2^-8 relative).
SCALE_RTOL = (2.0 ** -7, "amax may move one bf16 ulp on a boundary row")


def ulps(family, kind):
    """(max ulps, max fraction of elements that may differ) for an oracle comparison."""
    u, frac, _ = TOL[(family, kind)]
    return u, frac
