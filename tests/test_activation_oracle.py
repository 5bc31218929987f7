"""The activation family's oracles against independent references (plain pass, no kernels):
float64 formulas, torch's CPU ops with vLLM's rounding points, the FP8 rules of vLLM's kernels;
plus the launch-configuration arithmetic and the torch.compile trace of every op (meta tensors).
"""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import loomnb
from loomnb.ops import activation as A
from loomnb.oracle import activation as O

pytestmark = pytest.mark.nosim
BF16 = ml_dtypes.bfloat16
F32 = np.float32


def _t(a):
    a = np.asarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _np(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def _ulps(a, b):
    a = np.asarray(a, F32).view(np.int32).astype(np.int64)
    b = np.asarray(b, F32).view(np.int32).astype(np.int64)
    return np.abs(a - b)


def test_transcendentals_are_correctly_rounded_float64_evaluations():
    g = np.concatenate([np.linspace(-30, 30, 20001, dtype=F32), np.array([0.0, -0.0, 1e-30], F32)])
    assert (_ulps(O.expf(g), np.exp(g.astype(np.float64)).astype(F32)) == 0).all()
    silu64 = (g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))))
    assert _ulps(O.silu(g), silu64.astype(F32)).max() <= 2, "three float32 roundings (exp, 1 + e, /)"
    gelu64 = 0.5 * g.astype(np.float64) * (1 + np.vectorize(math.erf)(g.astype(np.float64) / math.sqrt(2)))
    ok = g > -1  # away from the cancellation of 1 + erf (float32 erf -> ~1e-7 absolute)
    assert _ulps(O.gelu(g)[ok], gelu64.astype(F32)[ok]).max() <= 4


def test_gated_activations_have_torch_eager_rounding_points():
    """vLLM's ops round like F.silu(g) * u (two roundings); the oracle does too. torch's CPU
    kernels use their own exp/erf/tanh: a few elements differ, by a bf16 ulp or two."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 256)) * 3).astype(BF16)
    g, u = _t(x)[:, :128], _t(x)[:, 128:]
    for name, ref, close in (("silu_and_mul", F.silu(g) * u, True), ("mul_and_silu", g * F.silu(u), True),
                             ("gelu_and_mul", F.gelu(g) * u, False),
                             ("gelu_tanh_and_mul", F.gelu(g, approximate="tanh") * u, False)):
        got = getattr(O, name)(x).astype(F32)
        want = _np(ref).astype(F32)
        diff = got != want
        assert diff.mean() < 2e-2, (name, diff.mean())
        if close:
            assert (np.abs(got - want)[diff] <= np.abs(want[diff]) * 2.0 ** -6).all(), name
    rounded_once = (F.silu(g.float()) * u.float()).to(torch.bfloat16)
    assert (_np(rounded_once) != O.silu_and_mul(x)).any(), "the two roundings are observable"


def test_fatrelu_and_swigluoai_formulas():
    x = np.array([[-1.0, 0.5, np.nan, 3.0, 2.0, -4.0, 5.0, 100.0]], F32)
    t = O.fatrelu_and_mul(x, threshold=0.25)  # g = (-1, .5, nan, 3), u = (2, -4, 5, 100)
    assert t.tolist() == [[0.0, -2.0, 0.0, 300.0]], "g <= threshold and NaN -> 0"
    y = O.swigluoai_and_mul(x, alpha=1.702, limit=7.0)  # pairs (-1, .5) (nan, 3) (2, -4) (5, 100)

    def ref(g, u):
        g, u = F32(g), F32(u)
        return ((u + F32(1)) * g) / (F32(1) + O.expf(-g * F32(1.702)))

    assert y.tolist() == [[ref(-1, 0.5), ref(7, 3), ref(2, -4), ref(5, 7)]], "NaN gate -> limit; up clamped"


def test_static_quant_multiplies_by_the_reciprocal_and_per_token_divides():
    x = np.array([[1.0, -3.0, 0.1, -0.0, np.nan, 1e6]], F32)
    s = np.array([0.3], F32)
    inv = F32(1) / F32(0.3)
    q = O.static_scaled_fp8_quant(x, s).view(np.uint8)[0]
    want = np.array([1.0, -3.0, 0.1], F32) * inv
    assert (q[:3] == np.asarray(want, F32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)).all()
    assert q[3] == 0x80 and q[4] == 0x7E and q[5] == 0x7E, "-0 -> 0x80, NaN -> +448, clamp"
    q, sc = O.dynamic_per_token_scaled_fp8_quant(x)
    assert sc[0, 0] == F32(1e6) / F32(448)
    assert q.view(np.uint8)[0, 4] == 0x7E
    q2, sc2 = O.dynamic_per_token_scaled_fp8_quant(x, np.array([2.0], F32))
    assert sc2[0, 0] == F32(2.0) / F32(448), "scale_ub clips the amax"
    q3, sc3 = O.dynamic_per_token_scaled_fp8_quant(np.zeros((1, 4), F32))
    assert sc3[0, 0] == F32(1) / F32(448 * 512), "the floor"


def test_group_quant_rules():
    x = np.zeros((2, 128), F32)
    x[0, :4] = [300.0, -1.5, np.nan, -0.0]
    q, s = O.per_token_group_quant_fp8(x, 64, use_ue8m0=True)
    assert s[0, 0] == 1.0 and q.view(np.uint8)[0, 0] == 0x79 and q.view(ml_dtypes.float8_e4m3fn)[0, 0] == 288
    assert q.view(np.uint8)[0, 2] == 0xFE and q.view(np.uint8)[0, 3] == 0x80, "NaN -> -448, -0 -> 0x80"
    assert s[1, 0] == 2.0 ** -33, "an all-zero group: max(1e-10/448, 1e-10) -> 2^ceil(log2(1e-10))"
    q, s = O.per_token_group_quant_fp8(x, 64)
    assert s[0, 0] == F32(300) / F32(448) and s[1, 1] == F32(1e-10) / F32(448), "eps floors the amax"
    q, s = O.per_token_group_quant_fp8(x, 64, tma_aligned_scales=True)
    assert s.shape == (2, 2) and s.strides == (4, 16)


def test_ue8m0_uses_log2f_rounding_not_the_exponent_bits():
    """Just above 2^-20, log2 = -20 + 1.7e-7 rounds to -20 in float32 (ulp 2^-19 there): the
    scale stays 2^-20, where "the next power of two from the exponent bits" gives 2^-19."""
    s = np.array([np.nextafter(F32(2.0 ** -20), F32(1))], F32)
    assert float(np.log2(np.float64(s[0]))) > -20.0
    assert O.ue8m0(s)[0] == 2.0 ** -20
    assert F32(2.0 ** np.frexp(s[0])[1]) == 2.0 ** -19
    assert O.ue8m0(np.array([F32(300) / F32(448)]))[0] == 1.0


def test_dynamic_per_tensor_has_no_floor():
    q, s = O.dynamic_scaled_fp8_quant(np.zeros((2, 8), F32))
    assert s[0] == 0 and (q.view(np.uint8) == 0x7E).all()
    x = np.array([[2.0, np.nan, -448.0]], F32)
    q, s = O.dynamic_scaled_fp8_quant(x)
    assert s[0] == 1.0 and q.view(np.uint8).tolist() == [[0x40, 0x7E, 0xFE]]


def test_fused_group_numerics():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 256)) * 3).astype(BF16)
    q, s = O.silu_and_mul_per_token_group_quant_fp8(x, 128)
    q2, s2 = O.per_token_group_quant_fp8(O.silu_and_mul(x), 128)
    assert (q.view(np.uint8) == q2.view(np.uint8)).all() and (s == s2).all()
    qp, sp = O.silu_and_mul_per_token_group_quant_fp8(x, 128, numerics="per_block")
    assert (qp.view(np.uint8) != q.view(np.uint8)).mean() < 0.2, "fp32 path: a few codes differ"


def test_dequant_round_trip():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 128)) * 4).astype(F32)
    for q, s in (O.per_token_group_quant_fp8(x, 64, column_major_scales=True),
                 O.dynamic_per_token_scaled_fp8_quant(x), O.dynamic_scaled_fp8_quant(x)):
        y = O.scaled_fp8_dequant(q, s, np.float32)
        assert (np.abs(y - x) <= np.abs(x) / 16 + 1e-2).all()


# ---------------------------------------------------------------- launch configurations
def test_launch_configurations():
    assert A.chunk_config(1, 1376) == (64, 22)           # 1 row of 11008: 22 blocks of 64 x 1 unit
    assert A.chunk_upt(1, 1376) == 1 and A.chunk_upt(32, 1376) == 2
    assert A.chunk_config(128, 1376) == (128, 6)         # 6 chunks of 256 units a row
    assert A.chunk_upt(4096, 1376) == 4 and A.chunk_upt(128, 1376) == 2
    fused = A.ActSpec("bf16", "silu", "group", group=128)
    assert A.chunk_upt(4096, 1376, fused) == 2, "the fused gated group quant stays at 2 units"
    assert A.chunk_config(4096, 1376) == (128, 3)        # large: 3 chunks of 512 units
    assert A.chunk_config(4096, 1376, upt=2) == (128, 6)  # a width the caller chose
    assert A.chunk_config(3, 1) == (32, 1)
    assert A.chunk_config(2, 100, threads=32) == (32, 4)
    assert A.token_config(8, 1376, True) == (704, 2)     # small batch: 2 units a thread
    assert A.token_config(4096, 1376, True) == (352, 4)  # large batch: 4
    assert A.token_config(4096, 5000, True) == (1024, 0)  # > 4096 units: the reread loop
    assert A.token_config(4, 100, False) == (128, 0)
    assert A.amax_config(4096, 1376) == (256, (85, 6))
    assert A.amax_config(1, 1376) == (512, (1, 1)), "one block for a small tensor: no partials"
    assert A.amax_config(4096, 1376, threads=1024)[0] == 512, "at most 512 threads (registers)"
    assert A.amax_config(9, 64) == (256, (9, 1)), "more than 8 rows: partials"
    assert A.amax_config(2, 1376) == (512, (1, 1))
    assert A.amax_config(4, 1376) == (256, (4, 6))
    t, (gx, gy) = A.amax_config(1, 10 ** 6)
    assert gx * gy <= A.AMAX_BLOCKS and gy == A.AMAX_BLOCKS


def test_every_launchable_spec_is_declared():
    from loomnb.ops import _activation_kernels as K
    declared = {s for _, s, _ in K.variants()}
    assert len(declared) == len(K.variants())
    acts = [s for s in declared if isinstance(s, K.ActSpec)]
    for base in K.op_specs():
        for layout in ("vector", "scalar"):
            assert any(s.kind == base.kind and s.act == base.act and s.quant == base.quant
                       and s.layout == layout for s in acts), (base, layout)
    assert {s.kind for s in declared if isinstance(s, K.DequantSpec)} == set(K.KINDS)


# ---------------------------------------------------------------- torch.compile (meta tensors)
class MLP(torch.nn.Module):
    def forward(self, h, scale):
        a = loomnb.silu_and_mul(h)
        q, s = loomnb.silu_and_mul_per_token_group_quant_fp8(h, 128, column_major_scales=True)
        q2, s2 = loomnb.per_token_group_quant_fp8(a, 64, tma_aligned_scales=True, use_ue8m0=True)
        q3, s3 = loomnb.dynamic_per_token_scaled_fp8_quant(a)
        q4, s4 = loomnb.dynamic_scaled_fp8_quant(a)
        q5 = loomnb.silu_and_mul_quant(h, scale)
        y = loomnb.scaled_fp8_dequant(q3, s3, torch.bfloat16)
        return a, q, s, q2, s2, q4, s4, q5, y


def test_fullgraph_trace_one_node_per_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    h = torch.empty(5, 512, dtype=torch.bfloat16, device="meta")
    scale = torch.empty(1, device="meta")
    torch._dynamo.reset()
    a, q, s, q2, s2, q4, s4, q5, y = torch.compile(MLP(), backend=backend, fullgraph=True)(h, scale)
    assert len(graphs) == 1
    nodes = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert [n for n in nodes if n.startswith("loomnb.")] == [
        "loomnb.silu_and_mul.default", "loomnb.silu_and_mul_per_token_group_quant_fp8.default",
        "loomnb.per_token_group_quant_fp8.default", "loomnb.dynamic_per_token_scaled_fp8_quant.default",
        "loomnb.dynamic_scaled_fp8_quant.default", "loomnb.silu_and_mul_quant.default",
        "loomnb.scaled_fp8_dequant.default"], nodes
    assert a.shape == (5, 256) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (5, 2) and s.stride() == (1, 5)
    assert s2.shape == (5, 4) and s2.stride() == (1, 8)
    assert s4.shape == (1,) and q5.shape == (5, 256) and y.dtype == torch.bfloat16
