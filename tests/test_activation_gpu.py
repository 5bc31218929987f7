"""The activation family on a real GPU: what the simulator cannot check.

* the hardware paths: libdevice expf/erff/tanhf (compared with torch eager bit for bit -- vLLM's
  and torch's kernels call the same functions -- and with the oracle within ``tests/tolerances``),
  16-byte vector loads and stores, the element-wise layout on misaligned rows (d = 3420), warp
  shuffles of the group amax with partial warps, block reductions, hardware conversions;
* the per-tensor quant's two passes over many blocks, CUDA-graph capture and replay with reused
  and with allocated buffers, the eager fast path (one and two remembered launches), no
  recompilation for a new num_tokens, 64-bit offsets, torch.library.opcheck and torch.compile;
* with ``LOOMNB_VLLM_LIB`` set to vLLM 0.24's ``_C_stable_libtorch.abi3.so``: every op against
  vLLM's compiled op, byte for byte.

Skipped, with that reason, on machines without a CUDA GPU. ``-k "not large"`` leaves out the
two tests that allocate several GB (for compute-sanitizer runs).
"""


import ml_dtypes
import numpy as np
import pytest

from helpers import assert_fp8_codes, assert_ulps
from tolerances import ulps

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
F = pytest.importorskip("torch.nn.functional")

import loomnb  # noqa: E402
from loomnb.ops import _launch as L  # noqa: E402

TORCH_DT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
GATED = ["silu_and_mul", "mul_and_silu", "gelu_and_mul", "gelu_tanh_and_mul", "fatrelu_and_mul",
         "swigluoai_and_mul"]
THRESHOLD, ALPHA, LIMIT = 0.25, 1.702, 2.5  # 0.25 is exact in every dtype: torch compares in bf16
SHAPES = [(1, 8), (19, 576), (111, 4096), (989, 19), (7, 3420), (3, 11008), (5, 14336)]


def to_np(t):
    """torch tensor -> NumPy with the same bits (bf16/fp8 as ml_dtypes)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def rand(shape, kind, scale=1.0, seed=0, uniform=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if uniform is not None:
        lo, hi = uniform
        return (torch.rand(shape, generator=g, device="cuda") * (hi - lo) + lo).to(TORCH_DT[kind])
    return (torch.randn(shape, generator=g, device="cuda") * scale).to(TORCH_DT[kind])


def bits(t):
    return t.contiguous().view(INT_OF[t.element_size()])


def assert_same(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    diff = bits(got) != bits(want)
    n = int(diff.sum())
    assert n == 0, f"{what}: {n} of {diff.numel()} elements differ; first at {diff.nonzero()[:3].tolist()}"


def _kw(name):
    return {"fatrelu_and_mul": {"threshold": THRESHOLD},
            "swigluoai_and_mul": {"alpha": ALPHA, "limit": LIMIT}}.get(name, {})


def torch_eager(name, x):
    """The torch eager composites with vLLM's rounding points (what vLLM's ops equal)."""
    d = x.shape[-1] // 2
    g, u = x[..., :d], x[..., d:]
    if name == "silu_and_mul":
        return F.silu(g) * u
    if name == "mul_and_silu":
        return g * F.silu(u)
    if name == "gelu_and_mul":
        return F.gelu(g) * u
    if name == "gelu_tanh_and_mul":
        return F.gelu(g, approximate="tanh") * u
    if name == "fatrelu_and_mul":
        return torch.where(g > THRESHOLD, g, torch.zeros_like(g)) * u
    gi, ui = x[..., 0::2].float(), x[..., 1::2].float()
    gi, ui = gi.clamp(max=LIMIT), ui.clamp(min=-LIMIT, max=LIMIT)
    return (((ui + 1) * gi) / (1 + torch.exp((-gi) * ALPHA))).to(x.dtype)


# ---------------------------------------------------------------- gated activations
@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize("num_tokens, d", SHAPES)
def test_gated_equal_torch_eager_bit_for_bit(name, kind, num_tokens, d):
    """libdevice expf/erff/tanhf, the IEEE division, the two roundings and the FMA of the tanh
    GELU: loomnb equals torch eager (and so vLLM) on every element, both layouts (d = 19 and
    3420 take the element-wise one)."""
    x = rand((num_tokens, 2 * d), kind, 3.0, seed=d)
    x0 = x.clone()
    got = getattr(loomnb, name)(x, **_kw(name))
    assert got.device == x.device and got.shape == (num_tokens, d)
    assert torch.equal(bits(x), bits(x0)), "x must not be modified"
    assert_same(got, torch_eager(name, x), f"{name} vs torch eager")


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("name", GATED)
def test_gated_close_to_the_oracle(name, kind):
    gelu = name.startswith("gelu")
    x = rand((64, 2 * 1000), kind, 3.0, seed=1, uniform=(-2.0, 2.0) if gelu else None)
    got = getattr(loomnb, name)(x, **_kw(name))
    want = getattr(loomnb.oracle, name)(to_np(x), **_kw(name))
    assert_ulps(to_np(got), want, ulps("activation_gelu" if gelu else "activation", kind), name)


@pytest.mark.parametrize("start", [1, 2, 4, 8])
def test_misaligned_rows_take_the_element_wise_layout(start):
    """Rows starting 2, 4, 8 or 16 bytes off a 16-byte boundary: never a misaligned vector access."""
    buf = rand((9, 2 * 512 + 16), "bf16", 3.0, seed=start)
    x = buf[:, start:start + 2 * 512]
    out = torch.empty(9, 512 + 8, dtype=torch.bfloat16, device="cuda")[:, start % 8:start % 8 + 512]
    assert_same(loomnb.silu_and_mul(x, out=out), torch_eager("silu_and_mul", x), "misaligned")
    q = torch.empty(9, 512 + 8, dtype=torch.uint8, device="cuda")[:, start:start + 512]
    loomnb.silu_and_mul_per_token_group_quant_fp8(x, 128, out_q=q)
    q2, _ = loomnb.per_token_group_quant_fp8(torch_eager("silu_and_mul", x), 128)
    assert_same(q, q2.view(torch.uint8), "misaligned fused group quant")


def test_d3420_bf16_second_half_8_byte_aligned():
    x = rand((33, 2 * 3420), "bf16", 3.0, seed=3420)
    assert_same(loomnb.silu_and_mul(x), torch_eager("silu_and_mul", x), "d = 3420")
    assert_ulps(to_np(loomnb.silu_and_mul(x)), loomnb.oracle.silu_and_mul(to_np(x)),
                ulps("activation", "bf16"), "d = 3420 vs oracle")


# ---------------------------------------------------------------- FP8 quantisation
QSHAPES = [(1, 128), (19, 576), (33, 4096), (7, 11008), (130, 14336)]


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("num_tokens, d", QSHAPES)
def test_quantisers_bit_identical_to_the_oracle(kind, num_tokens, d):
    """No transcendental here: static, per-tensor, per-token and group quant equal the oracle
    bit for bit (IEEE division and reciprocal, hardware e4m3 conversion)."""
    x = rand((num_tokens, d), kind, 3.0, seed=d)
    xn = to_np(x)
    scale = torch.tensor([0.02], device="cuda")
    q = loomnb.static_scaled_fp8_quant(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    assert_fp8_codes(to_np(q), loomnb.oracle.static_scaled_fp8_quant(xn, to_np(scale)), (0, 0.0), "static")
    q, s = loomnb.dynamic_scaled_fp8_quant(x)
    qo, so = loomnb.oracle.dynamic_scaled_fp8_quant(xn)
    assert s.shape == (1,) and to_np(s)[0] == so[0], "per-tensor scale"
    assert_fp8_codes(to_np(q), qo, (0, 0.0), "per-tensor")
    for ub in (None, torch.tensor([1.5], device="cuda")):
        q, s = loomnb.dynamic_per_token_scaled_fp8_quant(x, ub)
        qo, so = loomnb.oracle.dynamic_per_token_scaled_fp8_quant(xn, None if ub is None else to_np(ub))
        assert np.array_equal(to_np(s), so), "per-token scales"
        assert_fp8_codes(to_np(q), qo, (0, 0.0), "per-token")
    for g in (64, 128):
        if d % g:
            continue
        for cm, tma, ue in ((False, False, False), (True, False, True), (False, True, False),
                            (False, False, True)):
            q, s = loomnb.per_token_group_quant_fp8(x, g, column_major_scales=cm,
                                                    tma_aligned_scales=tma, use_ue8m0=ue)
            qo, so = loomnb.oracle.per_token_group_quant_fp8(xn, g, column_major_scales=cm,
                                                             tma_aligned_scales=tma, use_ue8m0=ue)
            assert tuple(s.stride()) == tuple(v // 4 for v in so.strides), (s.stride(), so.strides)
            assert np.array_equal(to_np(s), so), ("group scales", g, cm, tma, ue)
            assert_fp8_codes(to_np(q), qo, (0, 0.0), f"group {g} cm={cm} tma={tma} ue8m0={ue}")


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("layout", ["row", "column", "tma"])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("num_tokens, d", [(1, 11008), (37, 1024), (300, 384)])
def test_fused_group_quant_equals_the_two_ops(kind, group, layout, ue8m0, num_tokens, d):
    """One pass equals silu_and_mul then per_token_group_quant_fp8, bit for bit (d = 192 with
    group 64: 24 units, so lanes 24..31 of the warp are out of the row but join the shuffles)."""
    x = rand((num_tokens, 2 * d), kind, 3.0, seed=group + d)
    kw = dict(column_major_scales=layout == "column", tma_aligned_scales=layout == "tma", use_ue8m0=ue8m0)
    q, s = loomnb.silu_and_mul_per_token_group_quant_fp8(x, group, **kw)
    q2, s2 = loomnb.per_token_group_quant_fp8(loomnb.silu_and_mul(x), group, **kw)
    assert_same(q, q2, "fused vs two ops: codes")
    assert_same(s, s2, "fused vs two ops: scales")
    assert s.stride() == s2.stride()
    qo, so = loomnb.oracle.silu_and_mul_per_token_group_quant_fp8(to_np(x), group, **kw)
    assert_fp8_codes(to_np(q), qo, ulps("activation_fp8", "fp8"), "fused vs oracle")
    np.testing.assert_allclose(to_np(s), so, rtol=2.0 ** -7)


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_per_block_numerics_and_silu_and_mul_quant(kind):
    x = rand((40, 2 * 2048), kind, 3.0, seed=5)
    q, s = loomnb.silu_and_mul_per_token_group_quant_fp8(x, 128, numerics="per_block")
    qo, so = loomnb.oracle.silu_and_mul_per_token_group_quant_fp8(to_np(x), 128, numerics="per_block")
    assert_fp8_codes(to_np(q), qo, (1, 1e-2), "per_block vs oracle (fp32 SiLU: libdevice expf)")
    np.testing.assert_allclose(to_np(s), so, rtol=2e-6)  # y in float32 through libdevice expf
    scale = torch.tensor([0.03], device="cuda")
    assert_same(loomnb.silu_and_mul_quant(x, scale),
                loomnb.static_scaled_fp8_quant(loomnb.silu_and_mul(x), scale), "silu_and_mul_quant")


def test_special_values_on_the_gpu():
    """NaN -> +448 (static, per-tensor, per-token) / -448 (group); -0.0 -> 0x80; inf; the
    UE8M0 case of the issue (amax 300 -> scale 1, 300 -> 288)."""
    row = torch.tensor([float("nan"), -0.0, 1.0, -2.0, 0.0, 3.0, -1e-30, 300.0] * 16, device="cuda")
    x = row.to(torch.bfloat16).reshape(1, 128)
    scale = torch.tensor([1.0], device="cuda")
    for q in (loomnb.static_scaled_fp8_quant(x, scale), loomnb.dynamic_scaled_fp8_quant(x)[0],
              loomnb.dynamic_per_token_scaled_fp8_quant(x)[0]):
        c = q.view(torch.uint8)[0, :8].tolist()
        assert c[0] == 0x7E and c[1] == 0x80 and c[6] == 0x80 and c[4] == 0, c
    q, s = loomnb.per_token_group_quant_fp8(x, 128, use_ue8m0=True)
    c = q.view(torch.uint8)[0, :8].tolist()
    assert c[0] == 0xFE and c[1] == 0x80 and c[7] == 0x79, c
    assert s.item() == 1.0
    y = torch.tensor([[float("inf"), float("-inf"), 2.0, 1.0] * 16], device="cuda").to(torch.bfloat16)
    for name, args in (("dynamic_scaled_fp8_quant", ()), ("dynamic_per_token_scaled_fp8_quant", ()),
                       ("per_token_group_quant_fp8", (64,))):
        got = getattr(loomnb, name)(y, *args)
        want = getattr(loomnb.oracle, name)(to_np(y), *args)
        assert_fp8_codes(to_np(got[0]), want[0], (0, 0.0), name)
    assert_same(loomnb.silu_and_mul(y), torch_eager("silu_and_mul", y), "silu of +-inf")


def test_all_zero_tensor_per_tensor_scale_zero():
    q, s = loomnb.dynamic_scaled_fp8_quant(torch.zeros(3, 64, dtype=torch.bfloat16, device="cuda"))
    assert s.item() == 0 and (q.view(torch.uint8) == 0x7E).all()


def test_dynamic_per_tensor_many_blocks_large():
    """4096 x 11008 bf16 (512 partial maxima) with the maximum in the last row, and NaN/inf."""
    x = rand((4096, 11008), "bf16", 1.0, seed=7)
    x[-1, -1] = 100.0
    x[5, 9] = float("nan")
    q, s = loomnb.dynamic_scaled_fp8_quant(x)
    assert s.item() == np.float32(100.0) / np.float32(448.0)
    qo, so = loomnb.oracle.dynamic_scaled_fp8_quant(to_np(x))
    assert_fp8_codes(to_np(q), qo, (0, 0.0), "per-tensor 4096 x 11008")


@pytest.mark.parametrize("src", ["per_tensor", "per_token", "group_row", "group_tma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequant(src, dtype):
    x = rand((77, 1024), "bf16", 3.0, seed=11)
    if src == "per_tensor":
        q, s = loomnb.dynamic_scaled_fp8_quant(x)
    elif src == "per_token":
        q, s = loomnb.dynamic_per_token_scaled_fp8_quant(x)
    else:
        q, s = loomnb.per_token_group_quant_fp8(x, 128, tma_aligned_scales=src == "group_tma")
    y = loomnb.scaled_fp8_dequant(q, s, dtype)
    assert y.dtype == dtype
    want = loomnb.oracle.scaled_fp8_dequant(to_np(q), to_np(s), str(dtype).replace("torch.", ""))
    assert np.array_equal(to_np(y).view(np.uint8), want.view(np.uint8))


# ---------------------------------------------------------------- launch configurations
@pytest.mark.parametrize("threads", [32, 96, 256, 1024])
def test_block_size_sweep(threads):
    x = rand((33, 2 * 4096), "bf16", 3.0, seed=13)
    ref = {"act": torch_eager("silu_and_mul", x)}
    ref["group"] = loomnb.per_token_group_quant_fp8(ref["act"], 128)
    ref["token"] = loomnb.oracle.dynamic_per_token_scaled_fp8_quant(to_np(ref["act"]))
    ref["tensor"] = loomnb.oracle.dynamic_scaled_fp8_quant(to_np(ref["act"]))
    with L.force_threads(threads):
        a = loomnb.silu_and_mul(x)
        fq, fs = loomnb.silu_and_mul_per_token_group_quant_fp8(x, 128)
        tq, ts = loomnb.dynamic_per_token_scaled_fp8_quant(a)
        pq, ps = loomnb.dynamic_scaled_fp8_quant(a)
    assert_same(a, ref["act"], f"threads={threads}")
    assert_same(fq, ref["group"][0], "fused group")
    assert_same(fs, ref["group"][1], "fused group scales")
    assert np.array_equal(to_np(ts), ref["token"][1])
    assert_fp8_codes(to_np(tq), ref["token"][0], (0, 0.0), "per-token")
    assert to_np(ps)[0] == ref["tensor"][1][0]
    assert_fp8_codes(to_np(pq), ref["tensor"][0], (0, 0.0), "per-tensor")
    for shape in ((33, 4096), (2, 4096), (5, 33)):  # float32 rows: partials, one block, scalar
        xf = rand(shape, "f32", 3.0, seed=shape[0])
        qo, so = loomnb.oracle.dynamic_scaled_fp8_quant(to_np(xf))
        with L.force_threads(threads):
            pq, ps = loomnb.dynamic_scaled_fp8_quant(xf)
        assert to_np(ps)[0] == so[0]
        assert_fp8_codes(to_np(pq), qo, (0, 0.0), f"per-tensor f32 {shape}")


@pytest.mark.parametrize("num_tokens, d", [(8, 4096), (300, 4096), (4, 11008), (300, 14336), (2, 40000), (3, 33)])
def test_per_token_register_widths_and_reread(num_tokens, d):
    """2 or 4 units of 8 a thread in registers, the reread loop (d = 40000: 5000 units), and
    the element-wise layout (d = 33)."""
    x = rand((num_tokens, d), "bf16", 3.0, seed=d)
    q, s = loomnb.dynamic_per_token_scaled_fp8_quant(x)
    qo, so = loomnb.oracle.dynamic_per_token_scaled_fp8_quant(to_np(x))
    assert np.array_equal(to_np(s), so)
    assert_fp8_codes(to_np(q), qo, (0, 0.0), f"per-token {num_tokens} x {d}")


def test_strided_3d_rows_and_views():
    wide = rand((6, 2, 2 * 1024 + 64), "bf16", 2.0, seed=17)
    x = wide[:, :, 64:]  # [6, 2, 2048], leading dims that do not merge, 16-byte aligned
    got = loomnb.silu_and_mul(x)
    assert got.shape == (6, 2, 1024)
    assert_same(got, torch_eager("silu_and_mul", x), "3-D strided")
    q, s = loomnb.silu_and_mul_per_token_group_quant_fp8(x, 128)
    assert s.shape == (6, 2, 8)
    q2, s2 = loomnb.per_token_group_quant_fp8(got, 128)
    assert_same(q, q2, "3-D fused")
    assert_same(s, s2, "3-D fused scales")


# ---------------------------------------------------------------- graphs, fast path, streams
def _capture(fn):
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and remember outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        outs = fn()
    return g, outs


def test_cuda_graph_replay_with_reused_buffers():
    """Every op captured with caller-owned outputs; refill the input, replay, compare with an
    eager call on the new input (the per-tensor quant's partials come from the graph's pool)."""
    x = rand((64, 2 * 4096), "bf16", 3.0, seed=1)
    a = torch.empty(64, 4096, dtype=torch.bfloat16, device="cuda")
    q = torch.empty(64, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    gs = torch.empty_strided((64, 32), (1, 64), dtype=torch.float32, device="cuda")
    tq, ts = torch.empty_like(q), torch.empty(64, 1, device="cuda")
    pq, ps = torch.empty_like(q), torch.empty(1, device="cuda")
    sq, scale = torch.empty_like(q), torch.tensor([0.02], device="cuda")

    def run():
        loomnb.silu_and_mul(x, out=a)
        loomnb.silu_and_mul_per_token_group_quant_fp8(x, 128, column_major_scales=True, out_q=q, out_s=gs)
        loomnb.dynamic_per_token_scaled_fp8_quant(a, out=tq, scales=ts)
        loomnb.dynamic_scaled_fp8_quant(a, out=pq, scale=ps)
        loomnb.silu_and_mul_quant(x, scale, out=sq)

    g, _ = _capture(run)
    for seed in (2, 3):
        x.copy_(rand((64, 2 * 4096), "bf16", 3.0 + seed, seed=seed))
        g.replay()
        torch.cuda.synchronize()
        ea = torch_eager("silu_and_mul", x)
        assert_same(a, ea, "graph silu_and_mul")
        eq, es = loomnb.per_token_group_quant_fp8(ea, 128, column_major_scales=True)
        assert_same(q, eq, "graph fused group")
        assert_same(gs, es, "graph fused group scales")
        eq, es = loomnb.dynamic_per_token_scaled_fp8_quant(ea)
        assert_same(tq, eq, "graph per-token")
        assert_same(ts, es, "graph per-token scales")
        eq, es = loomnb.dynamic_scaled_fp8_quant(ea)
        assert_same(pq, eq, "graph per-tensor")
        assert_same(ps, es, "graph per-tensor scale")
        assert_same(sq, loomnb.static_scaled_fp8_quant(ea, scale), "graph silu_and_mul_quant")


def test_cuda_graph_with_allocated_outputs():
    x = rand((16, 2 * 1024), "bf16", 3.0, seed=4)
    g, (a, (q, s), (pq, ps)) = _capture(lambda: (
        loomnb.silu_and_mul(x), loomnb.silu_and_mul_per_token_group_quant_fp8(x, 64, tma_aligned_scales=True),
        loomnb.dynamic_scaled_fp8_quant(x[:, :1024])))
    x.copy_(rand((16, 2 * 1024), "bf16", 2.0, seed=5))
    g.replay()
    torch.cuda.synchronize()
    assert_same(a, torch_eager("silu_and_mul", x), "graph allocated silu")
    eq, es = loomnb.silu_and_mul_per_token_group_quant_fp8(x, 64, tma_aligned_scales=True)
    assert_same(q, eq, "graph allocated group")
    assert_same(s, es, "graph allocated group scales")
    assert s.stride() == (1, 16)
    eq, es = loomnb.dynamic_scaled_fp8_quant(x[:, :1024])
    assert_same(pq, eq, "graph allocated per-tensor")
    assert_same(ps, es, "graph allocated per-tensor scale")


def test_eager_fast_path_replays_one_and_two_launches():
    """A repeated call replays the remembered launch(es): no new miss, new allocations each
    time, results on the current contents -- the per-tensor quant replays every one of its
    launches: two for a small tensor (one amax block), three for a larger one (partials)."""
    x = rand((8, 2 * 576), "bf16", 3.0, seed=6)
    xl = rand((32, 2304), "bf16", 3.0, seed=8)  # 9,216 units of 8: partial maxima
    loomnb.ops.clear_launch_cache()
    loomnb.silu_and_mul(x)
    loomnb.dynamic_scaled_fp8_quant(x)
    loomnb.dynamic_scaled_fp8_quant(xl)
    loomnb.per_token_group_quant_fp8(x, 64, column_major_scales=True)
    info = loomnb.ops.launch_cache_info()
    x.copy_(rand((8, 2 * 576), "bf16", 5.0, seed=7))
    outs = [loomnb.silu_and_mul(x) for _ in range(2)]
    xl.copy_(rand((32, 2304), "bf16", 0.5, seed=9))
    pts = [loomnb.dynamic_scaled_fp8_quant(x) for _ in range(2)]
    pls = [loomnb.dynamic_scaled_fp8_quant(xl) for _ in range(2)]
    gqs = [loomnb.per_token_group_quant_fp8(x, 64, column_major_scales=True) for _ in range(2)]
    assert loomnb.ops.launch_cache_info() == info, "replayed: no new miss, nothing new stored"
    assert outs[0].data_ptr() != outs[1].data_ptr() and pts[0][1].data_ptr() != pts[1][1].data_ptr()
    assert_same(outs[1], torch_eager("silu_and_mul", x), "replayed silu")
    qo, so = loomnb.oracle.dynamic_scaled_fp8_quant(to_np(x))
    for q, s in pts:
        assert to_np(s)[0] == so[0]
        assert_fp8_codes(to_np(q), qo, (0, 0.0), "replayed per-tensor")
    qo, so = loomnb.oracle.dynamic_scaled_fp8_quant(to_np(xl))
    for q, s in pls:
        assert to_np(s)[0] == so[0]
        assert_fp8_codes(to_np(q), qo, (0, 0.0), "replayed per-tensor, three launches")
    qo, so = loomnb.oracle.per_token_group_quant_fp8(to_np(x), 64, column_major_scales=True)
    for q, s in gqs:
        assert s.stride() == (1, 8) and np.array_equal(to_np(s), so)
        assert_fp8_codes(to_np(q), qo, (0, 0.0), "replayed group")
    with pytest.raises(loomnb.LoomnbTypeError, match="argument 'use_ue8m0' must be a bool"):
        loomnb.per_token_group_quant_fp8(x, 64, use_ue8m0=1)


def test_new_num_tokens_does_not_recompile(monkeypatch):
    """In a fresh registry (independent of the tests before it): the first call compiles every
    width a later num_tokens picks (``tests/test_recompile_gpu.py`` checks every op)."""
    for attr in ("_kernels", "_dispatchers"):
        monkeypatch.setattr(L, attr, {})
    monkeypatch.setattr(L, "_warmed", set())
    out = torch.empty(300, 4096, dtype=torch.bfloat16, device="cuda")
    loomnb.silu_and_mul(rand((3, 8192), "bf16"), out=out[:3])
    before = {k: len(v._handles) for k, v in L._kernels.items()}
    for n in (1, 7, 250, 2):
        x = rand((n, 8192), "bf16", seed=n)
        assert_same(loomnb.silu_and_mul(x, out=out[:n]), torch_eager("silu_and_mul", x), f"n={n}")
    assert {k: len(v._handles) for k, v in L._kernels.items()} == before, "a new num_tokens compiled"


def test_streams():
    x = rand((5, 256), "bf16", seed=8)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    y = loomnb.silu_and_mul(x, stream=s)
    s.synchronize()
    assert_same(y, torch_eager("silu_and_mul", x), "explicit stream")
    with torch.cuda.stream(s):
        z = rand((5, 256), "bf16", seed=9)
        q, sc = loomnb.dynamic_scaled_fp8_quant(z)
    s.synchronize()
    assert to_np(sc)[0] == loomnb.oracle.dynamic_scaled_fp8_quant(to_np(z))[1][0]


def test_host_arrays_and_other_libraries():
    with pytest.raises(loomnb.LoomnbTypeError, match="host torch tensor"):
        loomnb.silu_and_mul(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(loomnb.LoomnbTypeError, match="must be a CUDA device array.*host numpy.ndarray"):
        loomnb.silu_and_mul(np.zeros((2, 8), np.float32))
    from numba import cuda
    xn = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    yd = loomnb.silu_and_mul(cuda.to_device(xn))
    cuda.synchronize()
    want = torch_eager("silu_and_mul", torch.from_numpy(xn).cuda())
    assert np.array_equal(yd.copy_to_host().view(np.uint32), want.cpu().numpy().view(np.uint32))


def test_64bit_offsets_large():
    """Past 2^31 elements: the last rows equal those rows computed alone."""
    T, D = 262_145, 4096  # x: T x 8192 bf16 = 2^31 + 8192 elements
    x = torch.empty(T, 2 * D, dtype=torch.bfloat16, device="cuda").normal_()
    y = loomnb.silu_and_mul(x)
    assert_same(y[-2:], loomnb.silu_and_mul(x[-2:].clone()), "silu last rows")
    q, s = loomnb.silu_and_mul_per_token_group_quant_fp8(x, 128)
    q1, s1 = loomnb.silu_and_mul_per_token_group_quant_fp8(x[-2:].clone(), 128)
    assert_same(q[-2:], q1, "fused last rows")
    assert_same(s[-2:], s1, "fused last scales")
    del q, s
    z = x.view(T * 2, D)  # 2^31 + 8192 elements
    tq, ts = loomnb.dynamic_per_token_scaled_fp8_quant(z)
    t1, s1 = loomnb.dynamic_per_token_scaled_fp8_quant(z[-3:].clone())
    assert_same(tq[-3:], t1, "per-token last rows")
    assert_same(ts[-3:], s1, "per-token last scales")
    z[-1, -1] = 8192.0  # exact in bf16, far above every silu(g) * u of normal inputs
    pq, ps = loomnb.dynamic_scaled_fp8_quant(z)
    assert ps.item() == np.float32(8192.0) / np.float32(448.0), "the global max sits in the last element"
    assert pq.view(torch.uint8)[-1, -1].item() == 0x7E


# ---------------------------------------------------------------- torch custom ops
def _opcheck_cases():
    x = rand((8, 512), "bf16", 2.0, seed=1)
    h = x[:, :256].contiguous()
    s = torch.tensor([0.05], device="cuda")
    u8 = lambda shape: torch.empty(shape, dtype=torch.uint8, device="cuda")  # noqa: E731
    ops = torch.ops.loomnb
    q, sc = loomnb.dynamic_per_token_scaled_fp8_quant(h)
    return [
        (ops.silu_and_mul.default, (x,), {}),
        (ops.silu_and_mul.out, (x,), {"out": torch.empty(8, 256, dtype=torch.bfloat16, device="cuda")}),
        (ops.mul_and_silu.default, (x,), {}),
        (ops.gelu_and_mul.default, (x,), {}),
        (ops.gelu_tanh_and_mul.default, (x,), {}),
        (ops.fatrelu_and_mul.default, (x, 0.25), {}),
        (ops.swigluoai_and_mul.default, (x, 1.702, 7.0), {}),
        (ops.static_scaled_fp8_quant.default, (h, s), {}),
        (ops.static_scaled_fp8_quant.out, (h, s), {"out": u8((8, 256))}),
        (ops.silu_and_mul_quant.default, (x, s), {}),
        (ops.dynamic_scaled_fp8_quant.default, (h,), {}),
        (ops.dynamic_scaled_fp8_quant.out, (h,), {"out": u8((8, 256)), "scale": torch.empty(1, device="cuda")}),
        (ops.dynamic_per_token_scaled_fp8_quant.default, (h, s), {}),
        (ops.dynamic_per_token_scaled_fp8_quant.out, (h, None),
         {"out": u8((8, 256)), "scales": torch.empty(8, 1, device="cuda")}),
        (ops.per_token_group_quant_fp8.default, (h, 64, 1e-10, False, False, False), {}),
        (ops.per_token_group_quant_fp8.default, (h, 128, 1e-10, True, False, True), {}),
        (ops.per_token_group_quant_fp8.default, (h, 64, 1e-10, False, True, False), {}),
        (ops.per_token_group_quant_fp8.out, (h, 64), {"out_q": u8((8, 256)),
                                                       "out_s": torch.empty(8, 4, device="cuda")}),
        (ops.silu_and_mul_per_token_group_quant_fp8.default, (x, 128), {}),
        (ops.silu_and_mul_per_token_group_quant_fp8.default, (x, 64, 1e-10, True), {"numerics": "per_block"}),
        # uint8 codes: opcheck compares inputs before and after with torch.allclose, which
        # torch does not implement for float8 (the op takes both)
        (ops.scaled_fp8_dequant.default, (q.view(torch.uint8), sc, torch.bfloat16), {}),
    ]


@pytest.mark.parametrize("i", range(21))
def test_opcheck(i):
    op, args, kwargs = _opcheck_cases()[i]
    torch.library.opcheck(op, args, kwargs)


def test_torch_compile_module_equals_eager():
    class MLP(torch.nn.Module):
        def forward(self, h):
            a = loomnb.silu_and_mul(h * 2)
            q, s = loomnb.silu_and_mul_per_token_group_quant_fp8(h, 128, column_major_scales=True)
            q2, s2 = loomnb.dynamic_per_token_scaled_fp8_quant(a)
            return a + 1, q, s, q2, s2

    h = rand((24, 2048), "bf16", 2.0, seed=3)
    eager = MLP()(h)
    torch._dynamo.reset()
    got = torch.compile(MLP(), fullgraph=True)(h)
    for e, g in zip(eager, got):
        assert_same(g, e, "compiled vs eager")


# ---------------------------------------------------------------- vLLM's compiled ops
VLLM_NAMES = {"out": "out", "result": "out", "output": "out", "input": "x", "output_q": "out",
              "output_s": "scales"}


@pytest.fixture(scope="module")
def vllm_ops(vllm_c):
    return vllm_c._C


def vllm_call(ns, name, values):
    """Call ``torch.ops._C.<name>`` binding its arguments by the schema's names."""
    try:
        packet = getattr(ns, name)
        schema = packet.default._schema
    except (AttributeError, RuntimeError) as e:
        pytest.skip(f"vLLM has no {name}: {e}")
    args, kwargs = [], {}
    for a in schema.arguments:
        key = VLLM_NAMES.get(a.name, a.name)
        if key in values:
            v = values[key]
        elif a.has_default_value():
            v = a.default_value
        elif isinstance(a.type, torch.OptionalType):
            v = None
        else:
            raise AssertionError(f"cannot bind {a.name!r} of {schema}")
        if a.kwarg_only:
            kwargs[a.name] = v
        else:
            args.append(v)
    packet(*args, **kwargs)


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("name", GATED)
def test_gated_equal_vllm(vllm_ops, name, kind):
    for num_tokens, d in ((1, 11008), (129, 14336), (7, 3420), (33, 19)):
        x = rand((num_tokens, 2 * d), kind, 3.0, seed=d)
        out = torch.empty(num_tokens, d, dtype=x.dtype, device="cuda")
        vllm_call(vllm_ops, name, {"out": out, "x": x, "threshold": THRESHOLD, "alpha": ALPHA,
                                   "limit": LIMIT})
        assert_same(getattr(loomnb, name)(x, **_kw(name)), out, f"{name} {num_tokens}x{d} vs vLLM")


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_quantisers_equal_vllm(vllm_ops, kind):
    for num_tokens, d in ((1, 4096), (77, 11008), (256, 14336)):
        x = rand((num_tokens, d), kind, 3.0, seed=d)
        q = lambda: torch.empty(num_tokens, d, dtype=torch.float8_e4m3fn, device="cuda")  # noqa: E731
        scale = torch.tensor([0.02], device="cuda")
        out = q()
        vllm_call(vllm_ops, "static_scaled_fp8_quant", {"out": out, "x": x, "scale": scale})
        assert_same(loomnb.static_scaled_fp8_quant(x, scale), out, "static vs vLLM")
        out, s = q(), torch.zeros(1, device="cuda")  # vLLM's caller zeroes the scale first
        vllm_call(vllm_ops, "dynamic_scaled_fp8_quant", {"out": out, "x": x, "scale": s})
        lq, ls = loomnb.dynamic_scaled_fp8_quant(x)
        assert_same(ls, s, "per-tensor scale vs vLLM")
        assert_same(lq, out, "per-tensor vs vLLM")
        for ub in (None, torch.tensor([1.0], device="cuda")):
            out, s = q(), torch.empty(num_tokens, 1, device="cuda")
            vllm_call(vllm_ops, "dynamic_per_token_scaled_fp8_quant",
                      {"out": out, "x": x, "scale": s, "scale_ub": ub})
            lq, ls = loomnb.dynamic_per_token_scaled_fp8_quant(x, ub)
            assert_same(ls, s, "per-token scales vs vLLM")
            assert_same(lq, out, "per-token vs vLLM")
        for group, cm, ue in ((128, False, False), (64, True, True), (128, False, True)):
            out = q()
            s = (torch.empty_strided((num_tokens, d // group), (1, num_tokens), device="cuda") if cm
                 else torch.empty(num_tokens, d // group, device="cuda"))
            vllm_call(vllm_ops, "per_token_group_fp8_quant",
                      {"x": x, "out": out, "scales": s, "group_size": group, "eps": 1e-10,
                       "fp8_min": -448.0, "fp8_max": 448.0, "scale_ue8m0": ue,
                       "dummy_is_scale_transposed": cm, "dummy_is_tma_aligned": False})
            lq, ls = loomnb.per_token_group_quant_fp8(x, group, column_major_scales=cm, use_ue8m0=ue)
            assert_same(ls, s, f"group {group} scales vs vLLM")
            assert_same(lq, out, f"group {group} vs vLLM")
        xx = rand((num_tokens, 2 * d), kind, 3.0, seed=d + 1)
        out = q()
        vllm_call(vllm_ops, "silu_and_mul_quant", {"out": out, "x": xx, "scale": scale})
        assert_same(loomnb.silu_and_mul_quant(xx, scale), out, "silu_and_mul_quant vs vLLM")
        out, s = q(), torch.empty(num_tokens, d // 128, device="cuda")
        vllm_call(vllm_ops, "silu_and_mul_per_block_quant",
                  {"out": out, "x": xx, "scales": s, "group_size": 128, "scale_ub": None,
                   "is_scale_transposed": False})
        lq, ls = loomnb.silu_and_mul_per_token_group_quant_fp8(xx, 128, numerics="per_block")
        assert_same(ls, s, "per_block scales vs vLLM")
        assert_same(lq, out, "per_block vs vLLM")
