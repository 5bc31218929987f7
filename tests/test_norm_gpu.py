"""The RMSNorm family on a real GPU: correctness against the oracles, the adapter's contracts
(zero copy, streams, devices, dtypes read from the array), CUDA-graph capture and replay,
torch.compile, buffer reuse, no recompilation for a new num_tokens, and 64-bit offsets.

Skipped, with that reason, on machines without a CUDA GPU (CI's CPU machine).
"""

import ml_dtypes
import numpy as np
import pytest

from helpers import assert_fp8_codes, assert_ulps
from tolerances import SCALE_RTOL, ulps

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import loomnb  # noqa: E402
from loomnb.ops import _launch as L  # noqa: E402
from loomnb.ops._norm_kernels import NormSpec, argtypes, norm_kernel  # noqa: E402

EPS = 1e-6
TORCH_DT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
NP_DT = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}


def to_np(t):
    """torch tensor -> NumPy with the same bits (bf16/fp8 as ml_dtypes)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def rand(shape, kind, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda") * scale).to(TORCH_DT[kind])


SHAPES = [(1, 8), (19, 576), (111, 4096), (989, 19), (1823, 4104), (7, 8200), (3, 12288)]


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("num_tokens, hidden_size", SHAPES)
def test_rms_norm_and_fused_add(kind, num_tokens, hidden_size):
    x = rand((num_tokens, hidden_size), kind, 3.0, seed=hidden_size)
    w = rand((hidden_size,), kind, seed=1)
    r = rand((num_tokens, hidden_size), kind, 2.0, seed=2)
    x0, w0 = x.clone(), w.clone()
    y = loomnb.rms_norm(x, w, EPS)
    assert y.device == x.device and y.dtype == x.dtype
    assert torch.equal(x, x0) and torch.equal(w, w0), "inputs must not be modified"
    assert_ulps(to_np(y), loomnb.oracle.rms_norm(to_np(x), to_np(w), EPS), ulps("norm", kind), "rms_norm")
    xo, ro = to_np(x).copy(), to_np(r).copy()
    loomnb.oracle.fused_add_rms_norm(xo, ro, to_np(w), EPS)
    rx, rr = loomnb.fused_add_rms_norm(x, r, w, EPS)
    assert rx is x and rr is r
    assert np.array_equal(to_np(r).view(np.uint8), ro.view(np.uint8)), "residual sum is exact"
    assert_ulps(to_np(x), xo, ulps("norm", kind), "fused_add x")


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("num_tokens, hidden_size", [(1, 8), (19, 576), (111, 4096), (989, 19), (5, 4104)])
@pytest.mark.parametrize("residual", [False, True])
def test_dynamic_and_static_fp8(kind, num_tokens, hidden_size, residual):
    x = rand((num_tokens, hidden_size), kind, 2.0, seed=3)
    w = rand((hidden_size,), kind, seed=4)
    res = rand((num_tokens, hidden_size), kind, seed=5) if residual else None
    ub = torch.tensor([1.5], device="cuda")
    res_o = None if res is None else to_np(res).copy()
    qo, so = loomnb.oracle.rms_norm_dynamic_per_token_quant(to_np(x), to_np(w), EPS, scale_ub=to_np(ub),
                                                            residual=res_o)
    q, s = loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS, scale_ub=ub, residual=res)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (num_tokens, 1) and s.dtype == torch.float32
    np.testing.assert_allclose(to_np(s), so, rtol=SCALE_RTOL[0])
    assert_fp8_codes(to_np(q), qo, ulps("norm_fp8", "fp8"), "dynamic")
    if residual:
        assert np.array_equal(to_np(res).view(np.uint8), res_o.view(np.uint8))
    scale = torch.tensor([0.02], device="cuda")
    out = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    if residual:
        x0 = x.clone()
        r2, r2o = rand((num_tokens, hidden_size), kind, seed=6), None
        r2o = to_np(r2).copy()
        loomnb.fused_add_rms_norm_static_fp8_quant(x, r2, w, scale, EPS, out=out)
        want, _ = loomnb.oracle.fused_add_rms_norm_static_fp8_quant(to_np(x), r2o, to_np(w), to_np(scale), EPS)
        assert torch.equal(x, x0)
        assert np.array_equal(to_np(r2).view(np.uint8), r2o.view(np.uint8))
    else:
        loomnb.rms_norm_static_fp8_quant(x, w, scale, EPS, out=out)
        want = loomnb.oracle.rms_norm_static_fp8_quant(to_np(x), to_np(w), to_np(scale), EPS)
    assert_fp8_codes(to_np(out), want, ulps("norm_fp8", "fp8"), "static")


@pytest.mark.parametrize("threads", [32, 96, 256, 1024])
def test_block_size_sweep(threads):
    x, w = rand((33, 4096), "bf16", seed=7), rand((4096,), "bf16", seed=8)
    with L.force_threads(threads):
        y = loomnb.rms_norm(x, w, EPS)
    assert_ulps(to_np(y), loomnb.oracle.rms_norm(to_np(x), to_np(w), EPS), ulps("norm", "bf16"), f"threads={threads}")


def test_strided_rows_vector_and_scalar_paths():
    wide = rand((64, 4096 + 64), "bf16", seed=9)
    for x in (wide[:, 64:], wide[:, 1:4097], wide[::2, :4096]):
        w = rand((x.shape[1],), "bf16", seed=10)
        y = loomnb.rms_norm(x, w, EPS)
        assert_ulps(to_np(y), loomnb.oracle.rms_norm(np.ascontiguousarray(to_np(x)), to_np(w), EPS), ulps("norm", "bf16"), "strided")


def test_bf16_is_read_from_the_dtype_not_the_typestr():
    """bf16 [1, 3, -1] must be read as 1, 3, -1 (an fp16 misread gives 1.875, 2.125, -1.875)."""
    x = torch.tensor([[1.0, 3.0, -1.0, 1.0, 3.0, -1.0, 1.0, 3.0]], dtype=torch.bfloat16, device="cuda")
    w = torch.ones(8, dtype=torch.bfloat16, device="cuda")
    y = loomnb.rms_norm(x, w, 0.0)
    want = loomnb.oracle.rms_norm(np.array([[1, 3, -1, 1, 3, -1, 1, 3]], ml_dtypes.bfloat16),
                                  np.ones(8, ml_dtypes.bfloat16), 0.0)
    assert np.array_equal(to_np(y).view(np.uint16), want.view(np.uint16))
    from numba import cuda
    cai_only = cuda.as_cuda_array(x)  # dtype comes from the typestr: not bf16
    with pytest.raises(loomnb.LoomnbTypeError, match="reads the dtype from the array object"):
        loomnb.rms_norm(cai_only, cuda.as_cuda_array(w), 0.0)


def test_cupy_and_numba_arrays_zero_copy():
    cupy = pytest.importorskip("cupy")
    from numba import cuda
    xn = np.random.default_rng(0).standard_normal((17, 576)).astype(ml_dtypes.bfloat16)
    wn = np.random.default_rng(1).standard_normal(576).astype(ml_dtypes.bfloat16)
    want = loomnb.oracle.rms_norm(xn, wn, EPS)
    # numba cannot copy ml_dtypes buffers: move the bits, then view them as bf16 on the device
    xd = cuda.to_device(xn.view(np.uint16)).view(ml_dtypes.bfloat16)
    wd = cuda.to_device(wn.view(np.uint16)).view(ml_dtypes.bfloat16)
    yd = loomnb.rms_norm(xd, wd, EPS)
    cuda.synchronize()
    got = yd.view(np.uint16).copy_to_host().view(ml_dtypes.bfloat16)
    assert_ulps(got, want, ulps("norm", "bf16"), "numba device arrays")
    xf, wf = cupy.asarray(xn.astype(np.float32)), cupy.asarray(wn.astype(np.float32))
    yf = loomnb.rms_norm(xf, wf, EPS)
    assert isinstance(yf, cupy.ndarray)
    assert_ulps(cupy.asnumpy(yf), loomnb.oracle.rms_norm(xn.astype(np.float32), wn.astype(np.float32), EPS),
                ulps("norm", "f32"), "cupy")


def test_host_arrays_are_rejected_clearly():
    w = rand((8,), "bf16")
    with pytest.raises(loomnb.LoomnbTypeError, match="must be a CUDA device array.*host numpy.ndarray"):
        loomnb.rms_norm(np.zeros((2, 8), ml_dtypes.bfloat16), w, EPS)
    with pytest.raises(loomnb.LoomnbTypeError, match="host torch tensor"):
        loomnb.rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), w, EPS)


def test_reads_data_written_on_a_non_default_stream_without_sync():
    s = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda")
    w = rand((4096,), "bf16", seed=11)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        for _ in range(3):
            prod = a @ a  # keeps the stream busy for milliseconds
        x = (prod[:64, :4096] * 1e-3).to(torch.bfloat16)
        y = loomnb.rms_norm(x, w, EPS)  # no synchronisation in between
    torch.cuda.synchronize()
    assert_ulps(to_np(y), loomnb.oracle.rms_norm(to_np(x), to_np(w), EPS), ulps("norm", "bf16"), "stream order")


def test_explicit_stream_argument():
    s = torch.cuda.Stream()
    x, w = rand((5, 64), "bf16"), rand((64,), "bf16")
    torch.cuda.synchronize()
    y = loomnb.rms_norm(x, w, EPS, stream=s)
    s.synchronize()
    assert_ulps(to_np(y), loomnb.oracle.rms_norm(to_np(x), to_np(w), EPS), ulps("norm", "bf16"), "explicit stream")


def _graph_roundtrip(run, inputs, fresh):
    """Capture ``run()`` on a side stream, refill the static inputs, replay, compare with eager."""
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g, stream=side):
        outs = run()
    for t, f in zip(inputs, fresh):
        t.copy_(f)
    g.replay()
    torch.cuda.synchronize()
    return outs


def test_cuda_graph_capture_and_replay_each_op():
    T, H = 40, 4096
    x, w, r = rand((T, H), "bf16", seed=1), rand((H,), "bf16", seed=2), rand((T, H), "bf16", seed=3)
    ub = torch.tensor([2.0], device="cuda")
    fx, fr = rand((T, H), "bf16", seed=4), rand((T, H), "bf16", seed=5)
    out = torch.empty_like(x)
    y = _graph_roundtrip(lambda: loomnb.rms_norm(x, w, EPS, out=out), [x], [fx])
    assert_ulps(to_np(y), loomnb.oracle.rms_norm(to_np(fx), to_np(w), EPS), ulps("norm", "bf16"), "graph rms_norm")
    q = torch.empty(T, H, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(T, 1, device="cuda")
    _graph_roundtrip(lambda: loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS, ub, out=q, scales=s), [x], [fr])
    qo, so = loomnb.oracle.rms_norm_dynamic_per_token_quant(to_np(fr), to_np(w), EPS, scale_ub=to_np(ub))
    assert_fp8_codes(to_np(q), qo, ulps("norm_fp8", "fp8"), "graph dynamic")
    # fused add mutates its inputs: capture, then refill and replay once
    _graph_roundtrip(lambda: loomnb.fused_add_rms_norm(x, r, w, EPS), [x, r], [fx, fr])
    xo, ro = to_np(fx).copy(), to_np(fr).copy()
    loomnb.oracle.fused_add_rms_norm(xo, ro, to_np(w), EPS)
    assert np.array_equal(to_np(r).view(np.uint8), ro.view(np.uint8))
    assert_ulps(to_np(x), xo, ulps("norm", "bf16"), "graph fused add")


def test_eager_on_one_stream_then_capture_on_another_replays_the_work():
    """A launcher that cached its stream at first use captured nothing; replay must do the work."""
    x, w = rand((16, 576), "bf16", seed=1), rand((576,), "bf16", seed=2)
    out = torch.empty_like(x)
    s1 = torch.cuda.Stream()
    with torch.cuda.stream(s1):
        loomnb.rms_norm(x, w, EPS, out=out)
    s1.synchronize()
    eager = out.clone()
    out.zero_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # a different (capture) stream
        loomnb.rms_norm(x, w, EPS, out=out)
    torch.cuda.synchronize()
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_new_num_tokens_does_not_recompile_and_buffers_are_reusable():
    w = rand((576,), "bf16")
    out = torch.empty(300, 576, dtype=torch.bfloat16, device="cuda")
    loomnb.rms_norm(rand((3, 576), "bf16"), w, EPS, out=out[:3])
    before = {k: len(v._handles) for k, v in L._kernels.items()}
    for n in (1, 7, 250, 2):  # all small batches: one launch configuration
        x = rand((n, 576), "bf16", seed=n)
        y = loomnb.rms_norm(x, w, EPS, out=out[:n])
        assert_ulps(to_np(y), loomnb.oracle.rms_norm(to_np(x), to_np(w), EPS), ulps("norm", "bf16"), f"n={n}")
    assert {k: len(v._handles) for k, v in L._kernels.items()} == before, "a new num_tokens compiled"
    for (factory, spec, sig), k in L._kernels.items():
        assert len(k.dispatcher.overloads) == 1


def test_torch_compile_around_an_op():
    x, w = rand((9, 576), "bf16"), rand((576,), "bf16")

    def f(x, w):
        return loomnb.rms_norm(x * 2, w, EPS) + 1

    compiled = torch.compile(f)
    assert torch.equal(compiled(x, w), f(x, w))


def test_64bit_offsets_last_row():
    """524,289 tokens x 4096 bf16 (past 2^31 elements): the last row equals that row alone."""
    T, H = 524_289, 4096
    x = torch.empty(T, H, dtype=torch.bfloat16, device="cuda").normal_()
    w = rand((H,), "bf16", seed=3)
    y = loomnb.rms_norm(x, w, EPS)
    alone = loomnb.rms_norm(x[-1:].clone(), w, EPS)
    assert torch.equal(y[-1:], alone)
    r = torch.empty_like(x).normal_()
    last_x, last_r = x[-1:].clone(), r[-1:].clone()
    loomnb.fused_add_rms_norm(x, r, w, EPS)
    loomnb.fused_add_rms_norm(last_x, last_r, w, EPS)
    assert torch.equal(x[-1:], last_x) and torch.equal(r[-1:], last_r)


def test_fast_launch_packs_what_numba_packs():
    """FastKernel's parameter block equals numba's own _prepare_args for the same arrays."""
    import ctypes
    import struct

    from numba import cuda
    from loomnb import _adapter
    x, w = rand((3, 16), "bf16"), rand((16,), "bf16")
    spec = NormSpec("bf16")
    k = L.kernel(norm_kernel, spec, argtypes(spec))
    k.compile(0)
    kernel = k.dispatcher.overloads[k.argtypes]
    xa = _adapter.wrap("t", "x", x)
    mine = list(L.array(xa).gpu_values())
    theirs = []
    kernel._prepare_args(k.argtypes[1], cuda.as_cuda_array(x.view(torch.int16)).view(np.uint16), 0, [], theirs)
    theirs = [v.value if isinstance(v, ctypes._SimpleCData) else int(v) for v in theirs]
    assert mine == theirs
    assert struct.calcsize(k._fmt) == 8 * k._nparams


def test_second_device_if_present():
    """cuda:1, called with cuda:0 current (the slow path switches device) and with cuda:1
    current (the fast path replays on cuda:1's current stream), eagerly and in a CUDA graph."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (this machine has one)")
    x, w = rand((5, 576), "bf16").to("cuda:1"), rand((576,), "bf16").to("cuda:1")
    ref = loomnb.oracle.rms_norm(to_np(x), to_np(w), EPS)
    for _ in range(2):  # the second call finds the remembered launch for another device
        y = loomnb.rms_norm(x, w, EPS)
        assert y.device == x.device
        assert_ulps(to_np(y), ref, ulps("norm", "bf16"), "cuda:1, cuda:0 current")
    out = torch.empty_like(x)
    with torch.cuda.device(1):
        for _ in range(3):
            out.zero_()
            loomnb.rms_norm(x, w, EPS, out=out)
            torch.cuda.synchronize(1)
            assert_ulps(to_np(out), ref, ulps("norm", "bf16"), "cuda:1 current")
        # torch.cuda.graph's default capture stream is made once per process, on the device
        # current at the first capture: capture cuda:1 work on a cuda:1 stream, as torch needs.
        g, twice = torch.cuda.CUDAGraph(), torch.empty_like(x)
        with torch.cuda.graph(g, stream=torch.cuda.Stream(device=1)):
            loomnb.rms_norm(x, w, EPS, out=out)
            torch.mul(x, 2.0, out=twice)
        out.zero_()
        twice.zero_()
        g.replay()
        torch.cuda.synchronize(1)
    assert torch.equal(twice, x * 2.0)  # the graph holds cuda:1 work ...
    assert_ulps(to_np(out), ref, ulps("norm", "bf16"), "cuda:1 graph replay")  # ... and ours
    with pytest.raises(loomnb.LoomnbValueError, match="on the same device as 'x'"):
        loomnb.rms_norm(x, w.to("cuda:0"), EPS)


def test_fast_path_in_a_thread_with_no_current_context():
    """A remembered launch replayed from a thread whose CUDA context was never made current
    (the driver answers CUDA_ERROR_INVALID_CONTEXT) binds the primary context and launches."""
    import threading

    from cuda.bindings import driver

    x, w = rand((3, 576), "bf16", seed=1), rand((576,), "bf16", seed=2)
    out = torch.empty_like(x)
    loomnb.rms_norm(x, w, EPS, out=out)  # remembered
    torch.cuda.synchronize()
    out.zero_()
    torch.cuda.synchronize()
    result = {}

    def work():
        try:
            driver.cuCtxSetCurrent(driver.CUcontext(0))  # no current context in this thread
            result["ctx_before"] = int(driver.cuCtxGetCurrent()[1])
            loomnb.rms_norm(x, w, EPS, out=out)
            torch.cuda.synchronize()
        except Exception as e:  # reported below
            result["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in result, result.get("error")
    assert result["ctx_before"] == 0
    assert_ulps(to_np(out), loomnb.oracle.rms_norm(to_np(x), to_np(w), EPS), ulps("norm", "bf16"), "thread")


def test_fast_path_key_rejects_what_the_checks_reject():
    """Calls that equal a remembered call in every way but one the checks care about are
    checked again: eps=True (== 1.0), a strided weight at the same address, a dtype view."""
    x, w = rand((4, 64), "bf16", seed=1), rand((128,), "bf16", seed=2)
    out = torch.empty_like(x)
    loomnb.rms_norm(x, w[:64], 1.0, out=out)
    loomnb.rms_norm(x, w[:64], 1.0, out=out)  # replayed
    with pytest.raises(loomnb.LoomnbTypeError, match="argument 'eps'"):
        loomnb.rms_norm(x, w[:64], True, out=out)
    with pytest.raises(loomnb.LoomnbValueError, match="argument 'weight'"):
        loomnb.rms_norm(x, w[::2], 1.0, out=out)
    with pytest.raises(loomnb.LoomnbTypeError, match="argument 'weight'"):
        loomnb.rms_norm(x, w[:64].view(torch.float16), 1.0, out=out)



def test_hardware_conversions_equal_the_portable_ones():
    """Hopper's cvt instructions vs the integer bit manipulation, over every input that matters."""
    from numba import cuda, float32
    from loomnb.layouts import dtypes as d

    @cuda.jit
    def conv(xs, bits, out):
        i = cuda.grid(1)
        if i < xs.shape[0]:
            v = xs[i]
            out[i, 0] = d.f32_to_bf16(v)
            out[i, 1] = d.f32_to_bf16_portable(v)
            out[i, 2] = d.f32_to_f16(v)
            out[i, 3] = d.f32_to_f16_portable(v)
            out[i, 4] = d.f32_to_e4m3(v)
            out[i, 5] = d.f32_to_e4m3_portable(v)
        if i < bits.shape[0]:
            out[i, 6] = d.f32_bits(d.f16_to_f32(bits[i]))
            out[i, 7] = d.f32_bits(d.f16_to_f32_portable(bits[i]))
            out[i, 8] = d.f32_bits(d.bf16_round(float32(d.bf16_to_f32(bits[i]))))

    rng = np.random.default_rng(0)
    xs = np.concatenate([
        rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
        np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32),
        np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32),
        np.linspace(-500, 500, 200001, dtype=np.float32),
        np.linspace(-2 ** -5, 2 ** -5, 200001, dtype=np.float32)]).astype(np.float32)
    bits = np.arange(1 << 16, dtype=np.uint32)
    out = cuda.device_array((xs.shape[0], 9), np.uint32)
    conv[(xs.shape[0] + 255) // 256, 256](cuda.to_device(xs), cuda.to_device(bits), out)
    o = out.copy_to_host()
    nan = np.isnan(xs)
    for hw, pt, name in ((0, 1, "bf16"), (2, 3, "fp16"), (4, 5, "e4m3")):
        bad = (o[:, hw] != o[:, pt]) & ~nan
        assert not bad.any(), f"{name}: hardware != portable for {xs[bad][:5]}"
        nan_codes = {(int(a), int(b)) for a, b in zip(o[nan, hw], o[nan, pt])}
        assert nan_codes == {(0x7FFF, 0x7FFF)} or nan_codes == {(0x7F, 0x7F)}, (name, nan_codes)
    dec = o[:1 << 16, 6:8].view(np.float32)
    same = (o[:1 << 16, 6] == o[:1 << 16, 7]) | (np.isnan(dec[:, 0]) & np.isnan(dec[:, 1]))
    assert same.all(), "fp16 decode: hardware != portable"


def test_eager_fast_path_replays_validated_calls_only():
    """A repeated call with the same tensor metadata replays the prepared launch (a cache hit),
    reads the tensors' current contents, and a call with new metadata is validated again."""
    x, w = rand((4, 576), "bf16", seed=1), rand((576,), "bf16", seed=2)
    out = torch.empty_like(x)
    loomnb.ops.clear_launch_cache()
    loomnb.rms_norm(x, w, EPS, out=out)
    info = loomnb.ops.launch_cache_info()
    assert info["size"] == 1
    x.copy_(rand((4, 576), "bf16", seed=3))
    loomnb.rms_norm(x, w, EPS, out=out)
    assert loomnb.ops.launch_cache_info() == info  # found (no new miss), nothing new stored
    assert_ulps(to_np(out), loomnb.oracle.rms_norm(to_np(x), to_np(w), EPS), ulps("norm", "bf16"), "replayed")
    with pytest.raises(loomnb.LoomnbValueError, match="argument 'out' must be of shape"):
        loomnb.rms_norm(x, w, EPS, out=out[:3])  # new metadata: checked, rejected
    with pytest.raises(loomnb.LoomnbValueError, match="argument 'eps'"):
        loomnb.rms_norm(x, w, -1.0, out=out)


def test_eager_fast_path_allocates_outputs_on_replay():
    """An allocating call replays too: each replay returns a new output tensor, and the
    launch writes into it (not into the first call's output)."""
    x, w = rand((4, 576), "bf16", seed=1), rand((576,), "bf16", seed=2)
    loomnb.ops.clear_launch_cache()
    outs = [loomnb.rms_norm(x, w, EPS) for _ in range(3)]
    assert loomnb.ops.launch_cache_info()["size"] == 1
    assert len({o.data_ptr() for o in outs}) == 3, "three live outputs, three allocations"
    q = [loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS) for _ in range(2)]
    torch.cuda.synchronize()
    want = loomnb.oracle.rms_norm(to_np(x), to_np(w), EPS)
    for o in outs:
        assert_ulps(to_np(o), want, ulps("norm", "bf16"), "replayed allocation")
    assert q[0][0].data_ptr() != q[1][0].data_ptr()
    assert torch.equal(q[0][0].view(torch.uint8), q[1][0].view(torch.uint8)) and torch.equal(q[0][1], q[1][1])


@pytest.mark.parametrize("rounding", ["twice", "once"])
@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
def test_rounding_modes(kind, rounding):
    x, w, r = rand((33, 4096), kind, 3.0, seed=1), rand((4096,), kind, seed=2), rand((33, 4096), kind, seed=3)
    y = loomnb.rms_norm(x, w, EPS, rounding=rounding)
    assert_ulps(to_np(y), loomnb.oracle.rms_norm(to_np(x), to_np(w), EPS, rounding=rounding), ulps("norm", kind), rounding)
    xo, ro = to_np(x).copy(), to_np(r).copy()
    loomnb.oracle.fused_add_rms_norm(xo, ro, to_np(w), EPS, rounding=rounding)
    loomnb.fused_add_rms_norm(x, r, w, EPS, rounding=rounding)
    assert_ulps(to_np(x), xo, ulps("norm", kind), "fused add " + rounding)


@pytest.mark.parametrize("head_size", [64, 128, 72])
def test_per_head_views_of_a_qkv_buffer(head_size):
    """q/k norm on ``[num_tokens, num_heads, head_size]`` views of a fused QKV buffer (two
    leading dimensions that do not merge: the lead=2 kernels)."""
    num_tokens, num_heads, num_kv = 37, 8, 2
    qkv = rand((num_tokens, (num_heads + 2 * num_kv) * head_size), "bf16", 2.0, seed=head_size)
    q = qkv[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    k = qkv[:, num_heads * head_size: (num_heads + num_kv) * head_size].view(num_tokens, num_kv, head_size)
    w = rand((head_size,), "bf16", seed=5)
    before = qkv.clone()
    for t in (q, k):
        want = loomnb.oracle.rms_norm(to_np(t.contiguous()), to_np(w), EPS)
        loomnb.rms_norm(t, w, EPS, out=t)
        assert np.array_equal(to_np(t).view(np.uint16), want.view(np.uint16))
    tail = (num_heads + num_kv) * head_size
    assert torch.equal(qkv[:, tail:], before[:, tail:]), "v untouched"
    one = torch.as_strided(qkv, (1, 4, head_size), (12345, head_size, 1))  # size-1 dim, any stride
    want = loomnb.oracle.rms_norm(to_np(one.contiguous()), to_np(w), EPS)
    assert np.array_equal(to_np(loomnb.rms_norm(one, w, EPS)).view(np.uint16), want.view(np.uint16))


def test_signed_zero_in_fp8_on_the_gpu():
    """bf16 row of 4096 random values with one +inf, unit weight: inv = 0, so the others
    normalise to -0.0/+0.0 and must encode as 0x80/0x00 (the hardware encoder and the oracle);
    the Markstein division used to turn -0.0 into +0.0."""
    x = rand((3, 4096), "bf16", 2.0, seed=11)
    x[0, 17] = float("inf")
    x[1, 4095] = float("inf")
    w = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    q, s = loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS)
    qo, so = loomnb.oracle.rms_norm_dynamic_per_token_quant(to_np(x), to_np(w), EPS)
    assert np.array_equal(to_np(q).view(np.uint8), qo.view(np.uint8))
    codes = to_np(q).view(np.uint8)[0]
    x0 = to_np(x).astype(np.float32)[0]
    assert (codes[x0 < 0] == 0x80).all() and (codes[(x0 >= 0) & np.isfinite(x0)] == 0).all()
    for scale_val in (1e30, 3.0e38):  # static: tiny products round to -0 -> 0x80
        out = loomnb.rms_norm_static_fp8_quant(x[2:], w, torch.tensor(scale_val, device="cuda"), EPS)
        want = loomnb.oracle.rms_norm_static_fp8_quant(to_np(x[2:]), to_np(w), np.array([scale_val], np.float32), EPS)
        assert np.array_equal(to_np(out).view(np.uint8), want.view(np.uint8))
        assert (to_np(out).view(np.uint8)[0][to_np(x[2]).astype(np.float32) < 0] == 0x80).all()


def test_nan_rows_are_bit_identical_to_the_oracle():
    x = rand((4, 4096), "bf16", seed=12)
    x[1, 7] = float("nan")
    x[2, 9] = -float("nan")
    w = rand((4096,), "bf16", seed=13)
    for kind in ("bf16", "f16"):
        xk, wk = x.to(TORCH_DT[kind]), w.to(TORCH_DT[kind])
        y = loomnb.rms_norm(xk, wk, EPS)
        want = loomnb.oracle.rms_norm(to_np(xk), to_np(wk), EPS)
        assert np.array_equal(to_np(y).view(np.uint16), want.view(np.uint16)), kind


def test_static_scale_0d_and_uint8_out():
    x, w = rand((5, 4096), "bf16", seed=1), rand((4096,), "bf16", seed=2)
    want = loomnb.oracle.rms_norm_static_fp8_quant(to_np(x), to_np(w), np.array([0.02], np.float32), EPS)
    got = loomnb.rms_norm_static_fp8_quant(x, w, torch.tensor(0.02, device="cuda"), EPS)
    assert np.array_equal(to_np(got).view(np.uint8), want.view(np.uint8))
    codes = torch.empty(5, 4096, dtype=torch.uint8, device="cuda")
    assert loomnb.rms_norm_static_fp8_quant(x, w, torch.tensor([0.02], device="cuda"), EPS, out=codes) is codes
    assert np.array_equal(codes.cpu().numpy(), want.view(np.uint8))


class _Export:
    """A ``__cuda_array_interface__`` v3 export of a torch tensor, with optional read-only flag
    and mask (what other libraries may hand loomnb)."""

    def __init__(self, t, readonly=False, mask=None):
        self._t = t
        self.dtype = np.dtype(np.float32)
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": "<f4", "version": 3, "stream": None,
            "strides": tuple(s * 4 for s in t.stride()), "data": (t.data_ptr(), readonly),
            "mask": mask}


def test_read_only_and_masked_exports_are_rejected():
    x, w = rand((4, 128), "f32", seed=1), rand((128,), "f32", seed=2)
    out = torch.full_like(x, 7.0)
    with pytest.raises(loomnb.LoomnbValueError, match="argument 'out' must be a writable array"):
        loomnb.rms_norm(_Export(x), _Export(w), EPS, out=_Export(out, readonly=True))
    torch.cuda.synchronize()
    assert torch.all(out == 7.0), "nothing written"
    big = torch.full((4, 128), 1e30, device="cuda")
    with pytest.raises(loomnb.LoomnbValueError, match="mask"):
        loomnb.rms_norm(_Export(x, mask=_Export(big)), _Export(w), EPS)
    loomnb.rms_norm(_Export(x, readonly=True), _Export(w), EPS, out=_Export(out))  # read-only input: fine
    torch.cuda.synchronize()
    assert_ulps(to_np(out), loomnb.oracle.rms_norm(to_np(x), to_np(w), EPS), ulps("norm", "f32"), "export")


class _NullExport:
    """An empty float32 ``[0, hidden]`` export whose data pointer is None or 0 (the CAI v3 spec
    allows both for empty arrays)."""

    def __init__(self, shape, ptr):
        self.dtype = np.dtype(np.float32)
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "version": 3,
                                         "strides": None, "data": (ptr, False), "stream": None}


@pytest.mark.parametrize("ptr", [None, 0])
def test_empty_exports_with_a_null_pointer_are_no_ops(ptr):
    w = rand((4096,), "f32", seed=2)
    y = loomnb.rms_norm(_NullExport((0, 4096), ptr), _Export(w), EPS)
    assert tuple(y.shape) == (0, 4096)
    g = loomnb.silu_and_mul(_NullExport((0, 8192), ptr))
    torch.cuda.synchronize()
    assert tuple(g.shape) == (0, 4096)


def test_row_strides_of_2_31_elements_and_more():
    """One row stride >= 2^31 elements (a 4 GiB bf16 buffer): every op equals itself on the
    same rows copied out contiguously (64-bit index arithmetic everywhere)."""
    big = 2 ** 31
    buf = torch.empty(big + 256, dtype=torch.bfloat16, device="cuda").normal_()
    rbuf = torch.empty(big + 256, dtype=torch.bfloat16, device="cuda").normal_()
    x = torch.as_strided(buf, (2, 128), (big, 1))
    r = torch.as_strided(rbuf, (2, 128), (big, 1))
    rows = lambda b: torch.stack([b[:128].clone(), b[big: big + 128].clone()])  # noqa: E731
    xc, rc = rows(buf), rows(rbuf)
    w = rand((128,), "bf16", seed=3)
    scale = torch.tensor([0.02], device="cuda")
    u8 = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    assert torch.equal(loomnb.rms_norm(x, w, EPS), loomnb.rms_norm(xc, w, EPS))
    for a, b in zip(loomnb.rms_norm_dynamic_per_token_quant(x, w, EPS),
                    loomnb.rms_norm_dynamic_per_token_quant(xc, w, EPS)):
        assert torch.equal(u8(a), u8(b))
    assert torch.equal(u8(loomnb.rms_norm_static_fp8_quant(x, w, scale, EPS)),
                       u8(loomnb.rms_norm_static_fp8_quant(xc, w, scale, EPS)))
    rc2 = rc.clone()
    q1, _ = loomnb.fused_add_rms_norm_static_fp8_quant(x, r, w, scale, EPS)
    q2, _ = loomnb.fused_add_rms_norm_static_fp8_quant(xc, rc2, w, scale, EPS)
    assert torch.equal(u8(q1), u8(q2)) and torch.equal(rows(rbuf), rc2)
    loomnb.fused_add_rms_norm(x, r, w, EPS)
    loomnb.fused_add_rms_norm(xc, rc2, w, EPS)
    assert torch.equal(rows(buf), xc) and torch.equal(rows(rbuf), rc2)
    obuf = torch.empty(big + 256, dtype=torch.bfloat16, device="cuda")
    out = torch.as_strided(obuf, (2, 128), (big, 1))
    loomnb.rms_norm(xc, w, EPS, out=out)
    assert torch.equal(rows(obuf), loomnb.rms_norm(xc, w, EPS))
    del buf, rbuf, obuf, x, r, out
    torch.cuda.empty_cache()


def test_check_scale_asserts_on_the_device_without_a_sync():
    """check_scale=True on torch tensors: a valid scale passes; an invalid one fires a
    device-side assert at the next synchronisation (in a subprocess: it ends the context)."""
    import subprocess
    import sys
    x, w = rand((4, 256), "bf16"), rand((256,), "bf16", seed=1)
    good = torch.tensor([0.5], device="cuda")
    a = loomnb.rms_norm_static_fp8_quant(x, w, good, EPS, check_scale=True)
    assert torch.equal(a.view(torch.uint8), loomnb.rms_norm_static_fp8_quant(x, w, good, EPS).view(torch.uint8))
    code = ("import torch, loomnb; x = torch.ones(4, 256, dtype=torch.bfloat16, device='cuda'); "
            "loomnb.rms_norm_static_fp8_quant(x, x[0], torch.zeros(1, device='cuda'), 1e-6, check_scale=True); "
            "torch.cuda.synchronize()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "assert" in (run.stderr + run.stdout).lower(), run.stderr[-2000:]


# ---------------------------------------------------------------- vLLM's compiled static FP8 norms
@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("num_tokens, hidden_size", [(1, 4096), (7, 576), (129, 8192), (33, 24)])
def test_static_fp8_norms_are_byte_exact_with_vllm(vllm_c, kind, num_tokens, hidden_size):
    """``rms_norm_static_fp8_quant`` and ``fused_add_rms_norm_static_fp8_quant`` with the default
    ``rounding="once"`` against vLLM 0.24's compiled ops on the same inputs: the residual bit
    for bit; the FP8 codes bit for bit except where loomnb's float64 ``inv`` and vLLM's
    ``rsqrtf`` of a float32 sum round the normalised value differently (the plain norms' one
    documented difference: a code one step apart on rows whose product lies on a rounding
    boundary, <= 1e-4 of codes). Also reports how far the ``"twice"`` form is (the old default,
    which vLLM's own test_fused_rms_norm_quant rejected)."""
    x = rand((num_tokens, hidden_size), kind, 2.0, seed=hidden_size)
    w = (1 + 0.1 * rand((hidden_size,), "f32", seed=3)).to(TORCH_DT[kind])
    r = rand((num_tokens, hidden_size), kind, seed=5)
    scale = torch.tensor([0.013], device="cuda")
    want = torch.empty(num_tokens, hidden_size, dtype=torch.float8_e4m3fn, device="cuda")
    vllm_c._C.rms_norm_static_fp8_quant(want, x, w, scale, EPS)
    got = loomnb.rms_norm_static_fp8_quant(x, w, scale, EPS)
    twice = loomnb.rms_norm_static_fp8_quant(x, w, scale, EPS, rounding="twice")
    assert_fp8_codes(to_np(got), to_np(want), (1, 1e-4), f"static {kind}")
    want_f, rv = torch.empty_like(want), r.clone()
    vllm_c._C.fused_add_rms_norm_static_fp8_quant(want_f, x.clone(), rv, w, scale, EPS)
    rl = r.clone()
    got_f, _ = loomnb.fused_add_rms_norm_static_fp8_quant(x, rl, w, scale, EPS)
    assert torch.equal(rl.view(torch.uint8), rv.view(torch.uint8)), "residual"
    assert_fp8_codes(to_np(got_f), to_np(want_f), (1, 1e-4), f"fused static {kind}")
    differ = (twice.view(torch.uint8) != want.view(torch.uint8)).float().mean().item()
    print(f"{kind} {num_tokens}x{hidden_size}: rounding='twice' differs from vLLM on {differ:.4%} of codes")
