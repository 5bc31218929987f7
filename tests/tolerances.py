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
    # sampling: logprob = r32(r32(x - m) - L) is the oracle's own rounding order; only
    # L = r32(log S) differs: the kernels sum expf terms (libdevice, <= 2 ulp each) in float64,
    # the oracle exact float64 exps, so S differs by < 2^-22 relative and L by at most 2 ulps
    # (ulp(L) <= ulp(logprob) since |logprob| >= L). Token ids, indices and ranks are exact.
    ("sampling_logprob", "f32"): (2, 1.0, "L from expf terms: <= 2 ulps of L, hence of the logprob"),
    # attention (decode and split merge): a reduction over the context with exp, so the rows
    # read (0, atol_rel, reason): the output must equal the float64 oracle's value correctly
    # rounded to the dtype, up to an absolute error of atol_rel * max|V| (the largest visible
    # value of the sequence). Budget: float32 dot products over head_size <= 256 (exact bf16
    # products, sums off by ~sqrt(D) * 2^-24 * |z|), ex2.approx (2^-22 relative per weight),
    # libdevice tanhf for the softcap, float32 sums in chains of <= ~L / 16 tokens and the
    # split merge: ~1e-6 * max|V| typical, 1e-5 worst; a token missed at 16384 tokens moves
    # some output of a 32-head batch by ~1e-3 * max|V|.
    ("attention", "bf16"): (0, 2.0 ** -15, "decode: correctly rounded float64 value + 2^-15 * max|V|"),
    ("attention", "f16"): (0, 2.0 ** -15, "same"),
    ("attention", "f32"): (0, 2.0 ** -15, "same (fp32 outputs: the absolute term dominates)"),
    # the LSE (float32, natural log): |got - exact| <= atol_rel * (1 + |exact|): the same score
    # and sum errors, ~1e-6 absolute at |lse| ~ 10
    ("attention_lse", "f32"): (0, 2.0 ** -16, "decode LSE: 2^-16 * (1 + |lse|)"),
    # merge_attn_states: expf/logf (<= 2 ulps), one division, one fmaf: the output is the
    # float64 value correctly rounded up to 2^-20 * (|prefix_output| + |suffix_output|), the
    # LSE up to 2^-20 * (1 + |lse|); rows with both LSEs -inf are prefix_output bit for bit
    ("attention_merge", "any"): (0, 2.0 ** -20, "merge: correctly rounded + 2^-20 * (|p_out| + |s_out|)"),

    # activation (GPU vs oracle; the simulator equals the oracle bit for bit): the kernels call
    # libdevice expf/erff/tanhf -- what vLLM's and torch's CUDA kernels call, and the GPU tests
    # compare with torch eager bit for bit -- which are within 2 ulps of the oracle's correctly
    # rounded float32. bf16/fp16: an element moves one ulp where that error crosses a rounding
    # boundary of r(act) or of the product (~1e-4 of bf16 elements, ~1e-3 of fp16); fp32: any
    # element may carry it (<= ~3 ulps through silu, the division and the product). GELU: 1 + erf(g)
    # and 1 + tanh(.) cancel for g < 0; the GPU tests draw g in [-2, 2], where that amplifies the
    # 2 ulps at most ~20x (fp32 <= 64 ulps; bf16/fp16 still one-ulp flips, more of them).
    ("activation", "bf16"): (1, 1e-3, "libdevice expf vs correctly rounded: rare one-ulp flips"),
    ("activation", "f16"): (1, 5e-3, "same, 3 more mantissa bits: more flips"),
    ("activation", "f32"): (8, 1.0, "libdevice expf (<= 2 ulps) through the division and product"),
    ("activation_gelu", "bf16"): (1, 1e-2, "erff/tanhf <= 2 ulps, 1 + erf cancellation (g in [-2, 2])"),
    ("activation_gelu", "f16"): (1, 3e-2, "same"),
    ("activation_gelu", "f32"): (64, 1.0, "same, amplified <= ~20x by the cancellation"),
    # fused SiLU + FP8 on the GPU vs the oracle: a one-ulp activation flip moves its code one
    # step -- or, when it is its group's amax, the group's scale by one bf16 ulp and any code of
    # the group one step. (Fused vs unfused loomnb on the GPU is compared bit for bit.)
    ("activation_fp8", "fp8"): (1, 1e-2, "activation flips, and the scales of groups whose amax flips"),
    # rope_cache: everything is elementwise -- RoPE in fp32 with each output rounded once (an
    # FMA emulated exactly by fma_f32), bit copies and FP8 conversions of x / scale (IEEE).
    ("rope_cache", "any"): (0, 0.0, "elementwise: bit-exact, FMA contraction reproduced exactly"),
    # spec_decode: integer comparisons, an argmax (an order, no arithmetic) and integer scans --
    # every output of rejection_greedy_sample and greedy_verify is compared bit for bit.
    ("spec_decode", "any"): (0, 0.0, "comparisons, argmax and integer compaction: bit-exact"),
    # kv_blocks: byte copies, and FP8 conversions of one element each (x / scale to a code,
    # f32(code) * scale to the dst dtype): bit-exact; a float32 NaN's payload is not compared.
    ("kv_blocks", "any"): (0, 0.0, "copies and per-element FP8 conversions: bit-exact"),
    # moe routing weights on the GPU: softmax p = r32(e * r32(1 / S)) from libdevice expf
    # terms (<= 2 ulps each; the oracle rounds float64 exp once), S their float64 sum (so <= 2
    # ulps relative), hence p within ~5 ulps; renormalising divides by the float32 sum of the
    # picks (itself within ~5 ulps) -- <= ~11 ulps, 16 allowed; sigmoid r32(1 / (1 + expf(-x)))
    # <= 3. Against vLLM's op the same budget covers its float32 butterfly sums. Ids, the
    # align, the gathers, the combine (IEEE products and sums in a fixed order) and moe_sum are
    # bit-exact (the simulator's weights too: it computes exp as the oracle does).
    ("moe_route", "f32"): (16, 1.0, "libdevice expf terms through the softmax and renormalisation"),
    ("moe", "any"): (0, 0.0, "align, gathers, fixed-order float32 combine, moe_sum: bit-exact"),
    # sampler: penalties are elementwise IEEE steps (bit-exact); a renormalised probability is
    # r32(p / r32(S)) with S the kept tokens' float64 sum -- the kernel's block reduction and
    # the oracle's NumPy sum add in other orders, which moves r32(S) only when S sits within
    # ~1e-16 (relative) of a float32 rounding boundary, and then every p of the row one ulp.
    # Tokens and masks are bit-exact under the simulator; on the GPU see test_sampler_gpu.py.
    ("sampler_renorm", "f32"): (1, 1.0, "float64 sum in another order: r32(S) may move an ulp"),
    ("sampler", "any"): (0, 0.0, "penalties, masks and (simulator) tokens: bit-exact"),
}

# relative tolerance of the per-token FP8 scale: amax/448 of values that are bit-exact but for
# the rare boundary rows above, where amax can move one bf16 ulp (2^-8 relative).
SCALE_RTOL = (2.0 ** -7, "amax may move one bf16 ulp on a boundary row")


def ulps(family, kind):
    """(max ulps, max fraction of elements that may differ) for an oracle comparison."""
    u, frac, _ = TOL[(family, kind)]
    return u, frac
