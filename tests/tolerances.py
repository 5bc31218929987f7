"""One tolerance table for every comparison with an oracle, keyed by (family, dtype).

Elementwise math is compared bit for bit (tolerance 0). Anything downstream of a reduction
(the RMS) may differ from the oracle because (a) the GPU sums in a different order than NumPy
(fp32 reordering, relative ~1e-7 on the sum of squares) and (b) vLLM's ``rsqrtf`` is the
approximate ``rsqrt.approx.f32`` (relative error up to 2^-22.9, about 2 fp32 ulp) while the
oracle is exact. Both perturb ``inv`` by a few fp32 ulp. In the two-rounding form
``r(f(r(x*inv)) * f(w))`` that can move the intermediate ``r(x*inv)`` by one ulp, and after the
weight multiply and the second rounding the output by at most two ulps (seen on the H200: 2 ulps
on ~1e-5 of bf16 outputs, never 3). So:
"""

# (family, dtype) -> (max ulps of the output dtype, reason)
ULPS = {
    ("norm", "bf16"): (2, "inv differs by a few fp32 ulp; two roundings: <= 2 bf16 ulps"),
    ("norm", "f16"): (2, "same, in fp16 ulps"),
    ("norm", "f32"): (8, "fp32 output carries rsqrt.approx's ~2 ulp plus sum order and 2 roundings"),
    ("norm_fp8", "fp8"): (1, "n/scale can cross one FP8 rounding boundary: <= 1 code step"),
    ("residual", "any"): (0, "r(x + residual) is elementwise: bit-exact"),
}

# relative tolerance of the per-token FP8 scale (amax/448 from values that may differ by 1 ulp)
SCALE_RTOL = (2.0 ** -7, "amax is a bf16 value that may differ by one bf16 ulp (2^-8 relative)")


def ulps(family, kind):
    return ULPS[(family, kind)][0]
