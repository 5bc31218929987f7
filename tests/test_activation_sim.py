"""Activation-family kernels under numba's CUDA simulator against the oracles (the family template
of ``tests/family.py``), bit for bit: the simulator evaluates expf/erff/tanhf exactly as the
oracle does (float64, rounded once), so every op is compared with ``assert_bits``.

Small awkward shapes (one Python thread per CUDA thread): d a multiple of 8 and not (the 16-byte
and the element-wise layouts), d = 3420 (the second half starts 6,840 bytes into a bf16 row, only
8-byte aligned), strided and 3-D rows, ``out`` given or not, every scale layout, special values,
a sweep of the block size, and the per-token sink's register and reread forms.
"""

import ml_dtypes
import numpy as np
import pytest

import loomnb
from loomnb.ops import _launch as L
from loomnb.ops import activation as act_ops

from family import assert_bits, block_size_sweep, call_both, out_given_and_not
from helpers import random_rows

pytestmark = pytest.mark.sim
KINDS = ["bf16", "f16", "f32"]
GATED = ["silu_and_mul", "mul_and_silu", "gelu_and_mul", "gelu_tanh_and_mul", "fatrelu_and_mul",
         "swigluoai_and_mul"]
BF16 = ml_dtypes.bfloat16
F8 = ml_dtypes.float8_e4m3fn
SCALE = np.array([0.02], np.float32)


def _bits(a):
    return np.ascontiguousarray(a)


def assert_same(got, want, what):
    """Bit-equal values (NaN payloads included) and, for arrays with strides, equal values."""
    assert_bits(_bits(got), _bits(want), what)


def _kwargs(name):
    return {"fatrelu_and_mul": {"threshold": -0.25}, "swigluoai_and_mul": {"alpha": 1.702, "limit": 2.5}}.get(name, {})


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize("num_tokens, d", [(1, 8), (3, 19), (2, 64)])
def test_gated_activations_bit_identical_to_the_oracle(name, kind, num_tokens, d):
    rng = np.random.default_rng(d)
    x = random_rows(rng, num_tokens, 2 * d, kind, 3.0)
    got, want, (x_after, *_), _ = call_both(name, x, **_kwargs(name))
    assert got.shape == (num_tokens, d) and got.dtype == x.dtype
    assert_same(got, want, name)
    assert_bits(x_after, x, "x must not be modified")


@pytest.mark.parametrize("name", ["silu_and_mul", "swigluoai_and_mul"])
def test_out_given_and_not(name):
    rng = np.random.default_rng(1)
    x = random_rows(rng, 3, 48, "bf16", 2.0)
    fn = getattr(loomnb, name)
    out_given_and_not(lambda out: fn(x, out=out), lambda: np.full((3, 24), 7, BF16))


def test_d3420_second_half_is_only_8_byte_aligned():
    """d = 3420 bf16: gate and multiplier of a row start 6,840 bytes apart (8-byte aligned);
    the op takes the element-wise layout and every element equals silu(g) * u as specified."""
    rng = np.random.default_rng(3420)
    x = random_rows(rng, 2, 2 * 3420, "bf16", 3.0)
    got = loomnb.silu_and_mul(x)
    assert_same(got, loomnb.oracle.silu_and_mul(x), "d = 3420")
    from loomnb.ops._activation_kernels import act_quant_kernel
    specs = {s for f, s, _ in L.launched() if f is act_quant_kernel and s.act == "silu" and s.kind == "bf16"}
    assert any(s.layout == "scalar" for s in specs)


def test_layout_choice_follows_alignment():
    """16-byte units only where every row start is 16-byte aligned and d % 8 == 0."""
    from loomnb import _adapter as ad
    op = "t"
    for d, start, vec in ((64, 0, True), (60, 0, False), (64, 4, False)):
        buf = np.zeros((3, 2 * d + 8), BF16)
        x = buf[:, start:start + 2 * d]
        xa = ad.wrap(op, "x", x)
        oa = ad.wrap(op, "out", np.zeros((3, d), BF16))
        lead, ov, xv = act_ops._rows_of(op, oa, xa, d, True)
        assert act_ops._vector_ok(ov, xv, d, False) == vec, (d, start)


def test_strided_and_3d_rows():
    """Rows of a wider buffer (row stride != 2d) and leading dimensions that do not merge."""
    rng = np.random.default_rng(5)
    wide = random_rows(rng, 4, 2 * 32 + 16, "bf16", 2.0)
    x = wide[:, 16:]                      # stride 80, 16-byte aligned rows: vector layout
    want = loomnb.oracle.silu_and_mul(np.ascontiguousarray(x))
    assert_same(loomnb.silu_and_mul(x), want, "strided rows")
    x3 = random_rows(rng, 6, 2 * 2 * 24, "bf16").reshape(3, 2, 96)[:, :, :48]  # [3, 2, 48], no merge
    out = np.full((3, 2, 24), 9, BF16)
    loomnb.silu_and_mul(x3, out=out)
    assert_same(out, loomnb.oracle.silu_and_mul(np.ascontiguousarray(x3)), "3-D rows")
    q, s = loomnb.per_token_group_quant_fp8(random_rows(rng, 6, 128, "f32").reshape(3, 2, 128), 64)
    assert q.shape == (3, 2, 128) and s.shape == (3, 2, 2)


def test_out_untouched_outside_the_view():
    rng = np.random.default_rng(6)
    x = random_rows(rng, 2, 2 * 16, "bf16")
    big = np.full((2, 40), 5, BF16)
    loomnb.silu_and_mul(x, out=big[:, 8:24])
    assert_same(big[:, 8:24], loomnb.oracle.silu_and_mul(x), "view")
    assert (big[:, :8].astype(np.float32) == 5).all() and (big[:, 24:].astype(np.float32) == 5).all()



@pytest.mark.parametrize("kind", ["bf16", "f32"])
@pytest.mark.parametrize("blocks, one_block", [(2, 0), (512, 0)])
@pytest.mark.parametrize("num_tokens, d", [(9, 64), (3, 19), (5, 520)])
def test_dynamic_per_tensor_partials(monkeypatch, kind, blocks, one_block, num_tokens, d):
    """The three-launch path of the dynamic per-tensor quant at simulator shapes: partial maxima
    over several blocks (each folding several rows when ``AMAX_BLOCKS`` is small, four at a
    time), the one-block pass that turns them into the scale, then the quant; the maximum sits
    in the last row, past a NaN."""
    monkeypatch.setattr(act_ops, "AMAX_BLOCKS", blocks)
    monkeypatch.setattr(act_ops, "AMAX_ONE_BLOCK", one_block)
    rng = np.random.default_rng(d)
    x = random_rows(rng, num_tokens, d, kind, 2.0)
    x[-1, -1] = 40.0
    x[0, 1] = np.nan
    (q, s), (qo, so), _, _ = call_both("dynamic_scaled_fp8_quant", x)
    assert s[0] == np.float32(40.0) / np.float32(448.0)
    assert_same(s, so, "per-tensor scale")
    assert_same(q, qo, "per-tensor codes")


# ---------------------------------------------------------------- FP8 quantisation
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens, d", [(1, 8), (3, 19), (2, 256), (9, 64)])
def test_static_dynamic_and_per_token_quant(kind, num_tokens, d):
    rng = np.random.default_rng(7 * d)
    x = random_rows(rng, num_tokens, d, kind, 3.0)
    got, want, (xa, _), _ = call_both("static_scaled_fp8_quant", x, SCALE)
    assert got.dtype == F8 and got.shape == x.shape
    assert_same(got, want, "static")
    assert_bits(xa, x, "x not modified")
    (q, s), (qo, so), _, _ = call_both("dynamic_scaled_fp8_quant", x)
    assert s.shape == (1,) and s.dtype == np.float32
    assert_same(q, qo, "dynamic per-tensor")
    assert_same(s, so, "per-tensor scale")
    for ub in (None, np.array([0.5], np.float32)):
        (q, s), (qo, so), _, _ = call_both("dynamic_per_token_scaled_fp8_quant", x, ub)
        assert s.shape == (num_tokens, 1)
        assert_same(q, qo, "per-token")
        assert_same(s, so, "per-token scales")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("layout", ["row", "column", "tma"])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_per_token_group_quant(kind, group_size, layout, use_ue8m0):
    rng = np.random.default_rng(group_size)
    x = random_rows(rng, 3, 256, kind, 4.0)
    kw = dict(column_major_scales=layout == "column", tma_aligned_scales=layout == "tma",
              use_ue8m0=use_ue8m0)
    (q, s), (qo, so), _, _ = call_both("per_token_group_quant_fp8", x, group_size, **kw)
    assert_same(q, qo, "group q")
    assert s.shape == (3, 256 // group_size) and s.strides == so.strides, (s.strides, so.strides)
    assert_same(s, so, "group scales")
    if layout == "tma":
        assert s.strides == (4, 16), "column stride rounded up to a multiple of 4"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numerics, use_ue8m0", [("unfused", False), ("unfused", True), ("per_block", False)])
@pytest.mark.parametrize("layout", ["row", "column"])
def test_fused_silu_and_mul_group_quant(kind, numerics, use_ue8m0, layout):
    rng = np.random.default_rng(11)
    x = random_rows(rng, 2, 2 * 128, kind, 3.0)
    kw = dict(column_major_scales=layout == "column", use_ue8m0=use_ue8m0, numerics=numerics)
    (q, s), (qo, so), _, _ = call_both("silu_and_mul_per_token_group_quant_fp8", x, 64, **kw)
    assert q.shape == (2, 128)
    assert_same(q, qo, "fused q")
    assert_same(s, so, "fused scales")
    if numerics == "unfused":  # the fused op equals the two ops, bit for bit
        q2, s2 = loomnb.per_token_group_quant_fp8(loomnb.silu_and_mul(x), 64,
                                                  column_major_scales=layout == "column",
                                                  use_ue8m0=use_ue8m0)
        assert_same(q, q2, "fused == unfused")
        assert_same(s, s2, "fused == unfused scales")


@pytest.mark.parametrize("kind", ["bf16", "f32"])
def test_silu_and_mul_quant_equals_the_two_ops(kind):
    rng = np.random.default_rng(12)
    x = random_rows(rng, 3, 2 * 40, kind, 3.0)
    got, want, _, _ = call_both("silu_and_mul_quant", x, SCALE)
    assert_same(got, want, "silu_and_mul_quant")
    assert_same(got, loomnb.static_scaled_fp8_quant(loomnb.silu_and_mul(x), SCALE), "fused == 2 ops")


def test_out_and_scales_given():
    rng = np.random.default_rng(13)
    x = random_rows(rng, 3, 128, "bf16", 2.0)
    out_given_and_not(lambda out: loomnb.dynamic_per_token_scaled_fp8_quant(x, out=out),
                      lambda: np.zeros(x.shape, F8))
    q, s = np.zeros(x.shape, np.uint8), np.zeros((3, 1), np.float32)
    rq, rs = loomnb.dynamic_per_token_scaled_fp8_quant(x, out=q, scales=s)
    qo, so = loomnb.oracle.dynamic_per_token_scaled_fp8_quant(x)
    assert rq is q and rs is s
    assert_same(q, qo, "uint8 codes")
    assert_same(s, so, "scales given")
    sc = np.zeros(1, np.float32)
    q2, s2 = loomnb.dynamic_scaled_fp8_quant(x, scale=sc)
    assert s2 is sc and sc[0] == loomnb.oracle.dynamic_scaled_fp8_quant(x)[1][0]
    cm = np.zeros((2, 8), np.float32)[:, :3].T  # [3, 2] with strides (4, 32): a padded column-major
    rq, rs = loomnb.per_token_group_quant_fp8(x, 64, out_s=cm)
    assert rs is cm
    assert_same(cm, loomnb.oracle.per_token_group_quant_fp8(x, 64)[1], "caller's strided out_s")


@pytest.mark.parametrize("src", ["per_tensor", "per_token", "group_row", "group_column"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dequant_every_scale_layout(src, dtype):
    rng = np.random.default_rng(14)
    x = random_rows(rng, 3, 128, "bf16", 3.0)
    if src == "per_tensor":
        q, s = loomnb.dynamic_scaled_fp8_quant(x)
    elif src == "per_token":
        q, s = loomnb.dynamic_per_token_scaled_fp8_quant(x)
    else:
        q, s = loomnb.per_token_group_quant_fp8(x, 64, column_major_scales=src == "group_column")
    got, want, _, _ = call_both("scaled_fp8_dequant", q, s, dtype)
    assert got.dtype.name == dtype
    assert_same(got, want, "dequant")
    err = np.abs(got.astype(np.float32) - x.astype(np.float32))
    assert (err <= np.abs(x.astype(np.float32)) * 2.0 ** -3 + 2e-2).all(), "FP8 round trip"


# ---------------------------------------------------------------- special values and cases
def test_nan_policy_and_signed_zero():
    """NaN -> +448 (0x7E) in static, per-tensor and per-token quant, -448 (0xFE) in group
    quant; -0.0 -> 0x80 everywhere; the amax ignores NaN."""
    x = np.array([[np.nan, -0.0, 1.0, -2.0, 0.0, 3.0, -1e-30, 0.5] * 8], np.float32).astype(BF16)
    for q, what in ((loomnb.static_scaled_fp8_quant(x, SCALE), "static"),
                    (loomnb.dynamic_scaled_fp8_quant(x)[0], "per-tensor"),
                    (loomnb.dynamic_per_token_scaled_fp8_quant(x)[0], "per-token")):
        c = q.view(np.uint8)[0]
        assert c[0] == 0x7E and c[1] == 0x80 and c[6] == 0x80 and c[4] == 0x00, (what, c[:8])
    q, s = loomnb.per_token_group_quant_fp8(x, 64)
    c = q.view(np.uint8)[0]
    assert c[0] == 0xFE and c[1] == 0x80 and c[6] == 0x80, c[:8]
    assert s[0, 0] == np.float32(3.0) / np.float32(448.0), "amax ignores NaN"
    assert_same(q, loomnb.oracle.per_token_group_quant_fp8(x, 64)[0], "group NaN")


def test_all_zero_tensor_per_tensor_scale_is_zero_and_codes_448():
    """vLLM's dynamic per-tensor scale has no floor: 0 / 0 -> NaN -> +448, dequantising to 0."""
    x = np.zeros((2, 16), BF16)
    q, s = loomnb.dynamic_scaled_fp8_quant(x)
    assert s[0] == 0 and (q.view(np.uint8) == 0x7E).all()
    assert (loomnb.scaled_fp8_dequant(q, s, "float32") == 0).all()
    q, s = loomnb.dynamic_per_token_scaled_fp8_quant(x)
    assert (s == np.float32(1.0) / np.float32(448.0 * 512.0)).all() and (q.view(np.uint8) == 0).all()
    q, s = loomnb.per_token_group_quant_fp8(np.zeros((1, 64), BF16), 64)
    assert s[0, 0] == np.float32(1e-10) / np.float32(448.0) and (q.view(np.uint8) == 0).all()


def test_ue8m0_case_from_the_issue():
    """A group whose amax is 300 gets scale 2^ceil(log2(300/448)) = 1.0; 300 encodes as 288.
    The same through the fused op, whose multiplier is 1 (silu(300) = 300 in bf16)."""
    g = np.zeros((1, 128), BF16)
    g[0, :3] = [300.0, -1.5, 0.1]
    fused_x = np.concatenate([g, np.ones_like(g)], axis=1)
    for q, s in (loomnb.per_token_group_quant_fp8(g, 128, use_ue8m0=True),
                 loomnb.per_token_group_quant_fp8(g, 128, use_ue8m0=True, column_major_scales=True),
                 loomnb.silu_and_mul_per_token_group_quant_fp8(fused_x, 128, use_ue8m0=True)):
        assert s[0, 0] == 1.0
        assert q.view(F8)[0, 0].astype(np.float32) == 288.0 and q.view(np.uint8)[0, 0] == 0x79
    q, s = loomnb.per_token_group_quant_fp8(g, 128)
    assert s[0, 0] == np.float32(300.0) / np.float32(448.0) and q.view(np.uint8)[0, 0] == 0x7E


@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("eps", [1e-10, 0.0])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_group_quant_inf_nan_and_tiny_groups_agree_with_the_oracle(use_ue8m0, eps):
    """The issue's cases, in every mode: a group holding +inf (scale +inf, UE8M0 too: the
    simulator's helper raised OverflowError), -inf, NaN, all-NaN, and a group of tiny values
    with eps = 0 (a subnormal scale whose reciprocal is inf: true division, zeros stay zeros);
    plain and fused (SiLU of the same values with a multiplier of 1)."""
    x = np.zeros((6, 128), np.float32)
    x[0, :3] = [np.inf, 1.0, -0.0]
    x[1, 5] = -np.inf
    x[2, :2] = [np.nan, 3.0]
    x[3, :] = np.nan
    x[4, :4] = [6.3e-38, -6.3e-38, 3e-38, -0.0]
    x[5, :3] = [300.0, -1.5, 0.1]
    for kind in ("f32", "bf16"):
        xk = x.astype(BF16) if kind == "bf16" else x
        got = loomnb.per_token_group_quant_fp8(xk, 128, eps=eps, use_ue8m0=use_ue8m0)
        want = loomnb.oracle.per_token_group_quant_fp8(xk, 128, eps=eps, use_ue8m0=use_ue8m0)
        assert_bits(got[0], want[0], f"{kind} codes")
        assert_bits(got[1], want[1], f"{kind} scales")
        assert got[1][0, 0] == np.inf
        fused = np.concatenate([xk, np.ones_like(xk)], axis=1)
        got = loomnb.silu_and_mul_per_token_group_quant_fp8(fused, 128, eps=eps, use_ue8m0=use_ue8m0)
        want = loomnb.oracle.silu_and_mul_per_token_group_quant_fp8(fused, 128, eps=eps,
                                                                     use_ue8m0=use_ue8m0)
        assert_bits(got[0], want[0], f"{kind} fused codes")
        assert_bits(got[1], want[1], f"{kind} fused scales")


def test_inf_inputs():
    x = np.array([[np.inf, -np.inf, 1.0, 0.0] * 16], np.float32).astype(BF16)
    for name, args in (("dynamic_scaled_fp8_quant", ()), ("dynamic_per_token_scaled_fp8_quant", ()),
                       ("per_token_group_quant_fp8", (64,)), ("silu_and_mul", ())):
        got, want, _, _ = call_both(name, x, *args)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert_same(g, w, name)


def test_empty_batches_are_no_ops():
    e = np.zeros((0, 16), BF16)
    assert loomnb.silu_and_mul(e).shape == (0, 8)
    assert loomnb.static_scaled_fp8_quant(e, SCALE).shape == (0, 16)
    q, s = loomnb.dynamic_per_token_scaled_fp8_quant(e)
    assert q.shape == (0, 16) and s.shape == (0, 1)
    q, s = loomnb.per_token_group_quant_fp8(np.zeros((0, 64), BF16), 64)
    assert q.shape == (0, 64) and s.shape == (0, 1)
    q, s = loomnb.dynamic_scaled_fp8_quant(e)
    assert q.shape == (0, 16) and s[0] == 0, "an empty tensor's per-tensor scale is 0"


# ---------------------------------------------------------------- launch configurations
@pytest.mark.parametrize("name, args", [("silu_and_mul", ()), ("per_token_group_quant_fp8", (64,)),
                                        ("dynamic_scaled_fp8_quant", ()),
                                        ("dynamic_per_token_scaled_fp8_quant", ())])
def test_block_size_sweep(name, args):
    """The result must not depend on the launch configuration (32 threads: several chunks a row
    and, per token, the reread loop; 256: one block covers the row)."""
    rng = np.random.default_rng(21)
    x = random_rows(rng, 2, 256, "bf16", 3.0)
    want = getattr(loomnb.oracle, name)(x, *args)
    want = want if isinstance(want, tuple) else (want,)

    def check(got, what):
        for g, w in zip(got if isinstance(got, tuple) else (got,), want):
            assert_same(g, w, what)

    block_size_sweep(lambda: getattr(loomnb, name)(x, *args), check, threads=(32, 64, 256))


SMALL_GATED = ["silu_and_mul", "mul_and_silu", "gelu_and_mul", "gelu_tanh_and_mul", "fatrelu_and_mul"]


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("name", SMALL_GATED)
def test_small_layout_equals_the_unit_layout_and_the_oracle(monkeypatch, name, kind):
    """Decode-size gated activations take the small layout (one word, two outputs, a thread;
    rows from blockIdx.y): 3 rows of 36 words on blocks of 32 threads (the second block
    partial), and 2 x 3 rows that merge into one dimension -- bit-identical to the oracle and
    to the 8-outputs-a-thread layout that larger calls take. Rows whose leading dimensions do
    not merge, or an unaligned row, take the unit layouts."""
    rng = np.random.default_rng(7)
    specs, launch = [], L.launch
    monkeypatch.setattr(L, "launch", lambda f, spec, *a, **k: (specs.append(spec), launch(f, spec, *a, **k)))
    x = random_rows(rng, 6, 2 * 72, kind, 3.0)
    kw = _kwargs(name)
    want = getattr(loomnb.oracle, name)(x, **kw)
    for shape in ((6, 144), (2, 3, 144)):
        with L.force_threads(32):
            got = getattr(loomnb, name)(x.reshape(shape), **kw)
        assert_same(got.reshape(6, 72), want, f"{name} small {shape}")
    assert [s.layout for s in specs] == ["small", "small"]
    monkeypatch.setattr(act_ops, "SMALL_LAYOUT_WORK", -1)
    assert_same(getattr(loomnb, name)(x, **kw), want, f"{name} units")
    assert specs[-1].layout == "vector" and specs[-1].upt == 1
    monkeypatch.undo()
    buf = random_rows(rng, 2, 3 * 144 + 8, kind, 3.0)
    specs, launch = [], L.launch
    monkeypatch.setattr(L, "launch", lambda f, spec, *a, **k: (specs.append(spec), launch(f, spec, *a, **k)))
    unmerged = buf[:, :2 * 144].reshape(2, 2, 144)  # rows 3 * 144 + 8 apart: no single row stride
    shifted = buf[:, 1:145]  # rows 2 bytes off 16: the element-wise layout
    for xx in (unmerged, shifted):
        assert_same(getattr(loomnb, name)(xx, **kw), getattr(loomnb.oracle, name)(np.ascontiguousarray(xx), **kw),
                    f"{name} {xx.shape}")
    assert [s.layout for s in specs] == ["vector", "scalar"]


@pytest.mark.parametrize("name, args", [("silu_and_mul", ()), ("gelu_and_mul", ()),
                                        ("per_token_group_quant_fp8", (64,)),
                                        ("per_token_group_quant_fp8", (128,)),
                                        ("silu_and_mul_per_token_group_quant_fp8", (128,)),
                                        ("static_scaled_fp8_quant", (SCALE,)),
                                        ("dynamic_scaled_fp8_quant", ())])
@pytest.mark.parametrize("layout", ["vector", "scalar"])
@pytest.mark.parametrize("upt", [2, 4])
def test_chunked_sinks_with_two_and_four_units_a_thread(monkeypatch, name, args, layout, upt):
    """The mid-size and large-call forms of every chunked sink (2 and 4 units of 8 a thread,
    ``chunk_upt``; simulator shapes are small calls, 1 unit, everywhere else): 32 threads, so
    a row of 144 units is two chunks and the second is partial; the element-wise layout for
    rows that are not 16-byte aligned."""
    monkeypatch.setattr(act_ops, "SMALL_WORK", -1)
    monkeypatch.setattr(act_ops, "SMALL_LAYOUT_WORK", -1)
    monkeypatch.setattr(act_ops, "LARGE_WORK", 0 if upt == 4 else 2 ** 40)
    rng = np.random.default_rng(23)
    gated = name.startswith(("silu", "gelu"))
    d = 1152  # 144 units: a chunk of 32 x 4 and one of 16
    n = 2 * d if gated else d
    buf = random_rows(rng, 3, n + 8, "bf16", 3.0)
    x = buf[:, :n] if layout == "vector" else buf[:, 1:n + 1]
    specs, launch = [], L.launch
    monkeypatch.setattr(L, "launch", lambda f, spec, *a, **k: (specs.append(spec), launch(f, spec, *a, **k)))
    want = getattr(loomnb.oracle, name)(np.ascontiguousarray(x), *args)
    with L.force_threads(32):
        got = getattr(loomnb, name)(x, *args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert_same(g, w, f"{name} upt={upt} {layout}")
    assert [s.layout for s in specs if s.quant != "amax"] == [layout]
    fused_group = name == "silu_and_mul_per_token_group_quant_fp8"  # compiles at 1 and 2 only
    assert [s.upt for s in specs if s.quant != "amax"] == [2 if fused_group else upt], specs


@pytest.mark.parametrize("threads, d, upt", [(64, 512, 2), (32, 1024, 4), (32, 1032, 0)])
def test_per_token_register_widths_and_reread(threads, d, upt):
    """Each per-token form: 2 or 4 units of 8 a thread in registers, or the reread loop."""
    assert act_ops.token_config(1, -(-d // 8), True, threads) == (threads, upt)
    rng = np.random.default_rng(d)
    x = random_rows(rng, 1, d, "bf16", 3.0)
    with L.force_threads(threads):
        q, s = loomnb.dynamic_per_token_scaled_fp8_quant(x)
    qo, so = loomnb.oracle.dynamic_per_token_scaled_fp8_quant(x)
    assert_same(q, qo, f"upt={upt}")
    assert_same(s, so, f"upt={upt} scales")


def test_scalar_layout_of_every_sink():
    """Rows that are not 16-byte aligned take the element-wise layout in every sink."""
    rng = np.random.default_rng(22)
    buf = random_rows(rng, 2, 2 * 128 + 1, "bf16", 3.0)
    x = buf[:, 1:]  # 2-byte aligned rows
    for name, args in (("silu_and_mul_per_token_group_quant_fp8", (64,)), ("silu_and_mul_quant", (SCALE,)),
                       ("dynamic_scaled_fp8_quant", ()), ("dynamic_per_token_scaled_fp8_quant", ()),
                       ("per_token_group_quant_fp8", (128,))):
        got = getattr(loomnb, name)(x, *args)
        want = getattr(loomnb.oracle, name)(np.ascontiguousarray(x), *args)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert_same(g, w, name)
    from loomnb.ops._activation_kernels import act_quant_kernel
    assert any(f is act_quant_kernel and s.layout == "scalar" and s.quant == "group"
               for f, s, _ in L.launched())
