"""The RoPE / KV-cache family on a real GPU: the ladder bit for bit against the oracles (16-byte
vector path and scalar path), the GPU-only pieces the simulator cannot check (hardware E5M2
conversion, explicit-rounding FMA arithmetic, vector loads/stores, partial warps), CUDA-graph
capture, the eager fast path, no recompilation for a new num_tokens, torch.compile, 64-bit
cache offsets, and -- when ``$LOOMNB_VLLM_LIB`` points at vLLM 0.24's ``_C`` library -- byte
equality with vLLM's ``rotary_embedding`` / ``reshape_and_cache_flash`` / ``reshape_and_cache``
plus a report of which FMA contraction vLLM's build uses.

Skipped, with that reason, on machines without a CUDA GPU (CI's CPU machine).
"""


import ml_dtypes
import numpy as np
import pytest
from helpers import assert_device_assert

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import loomnb  # noqa: E402
from loomnb.layouts import paged_kv as pk  # noqa: E402
from loomnb.ops import _launch as L  # noqa: E402
from loomnb.oracle.numerics import fma_f32  # noqa: E402

TORCH_DT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
CACHE_TORCH = {"auto": None, "fp8": torch.uint8, "fp8_e4m3": torch.float8_e4m3fn,
               "fp8_e5m2": torch.float8_e5m2}
MAX_POS = 4096


def to_np(t):
    """torch tensor -> NumPy with the same bits (bf16/FP8 as ml_dtypes)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    if t.dtype == torch.float8_e5m2:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e5m2)
    return t.numpy()


def u8(t):
    return t.detach().contiguous().view(torch.uint8).cpu().numpy()


def cos_sin_cache(rot_dim, dtype, base=10000.0, max_pos=MAX_POS):
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], -1).to(dtype).cuda()


def setup(T, Hq, Hk, D, layout, bs, kv, kind="bf16", rot_dim=None, seed=0, pad_tokens=0):
    """A fused QKV buffer (q/k/v slices), positions, cos/sin, a garbage-filled cache, slots."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = TORCH_DT[kind]
    qkv = (torch.randn(T + pad_tokens, (Hq + 2 * Hk) * D, generator=g, device="cuda") * 2).to(dt)
    positions = torch.randint(0, MAX_POS, (T,), generator=g, device="cuda")
    cs = cos_sin_cache(rot_dim or D, dt)
    nb = -(-T // bs) + 3
    cdt = dt if kv == "auto" else CACHE_TORCH[kv]
    kvc = pk.allocate_kv_cache(layout, nb, bs, Hk, D, cdt, "cuda", fill=None)
    kvc.view(torch.uint8).copy_(torch.randint(0, 256, kvc.view(torch.uint8).shape, generator=g,
                                              device="cuda", dtype=torch.uint8))
    slots = torch.randperm(nb * bs, generator=g, device="cuda")[:T]
    if T > 2:
        slots[T // 2] = -1
    ks = torch.rand(Hk, generator=g, device="cuda") * 0.1 + 0.01
    vs = torch.rand(1, generator=g, device="cuda") * 0.1 + 0.01
    return qkv, positions, cs, kvc, slots, ks, vs


def split(qkv, Hq, Hk, D, T):
    return (qkv[:T, :Hq * D], qkv[:T, Hq * D:(Hq + Hk) * D], qkv[:T, (Hq + Hk) * D:])


def oracle_fused(qkv, positions, cs, kvc, slots, ks, vs, Hq, Hk, D, layout, kv, is_neox, off=0):
    b, c = to_np(qkv).copy(), to_np(kvc).copy()
    T = positions.shape[0]
    q, k, v = b[:T, :Hq * D], b[:T, Hq * D:(Hq + Hk) * D], b[:T, (Hq + Hk) * D:]
    kc, vc = pk.kv_views(c, layout, Hk, D)
    loomnb.oracle.rotary_embedding_and_cache(to_np(positions), q, k, v, kc, vc, to_np(slots), D,
                                             to_np(cs), is_neox, kv, to_np(ks), to_np(vs),
                                             rope_dim_offset=off)
    return b, c


def assert_same(got_t, want_np, what):
    got = to_np(got_t)
    g = got.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[got.dtype.itemsize])
    w = np.asarray(want_np).view(g.dtype)
    diff = g != w
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.size} differ, first {np.argwhere(diff)[:3].tolist()}"


# ---------------------------------------------------------------------------------- the ladder
LADDER = [(layout, D, kv, bs, Hk) for layout in pk.KV_LAYOUTS for D in (64, 80, 96, 128, 256)
          for kv, bs, Hk in (("auto", 16, 8), ("fp8_e4m3", 32, 2), ("fp8_e5m2", 1, 1))]


@pytest.mark.parametrize("layout, head_size, kv, block_size, num_kv_heads", LADDER)
@pytest.mark.parametrize("num_tokens", [1, 111])
def test_fused_ladder_against_the_oracle(num_tokens, layout, head_size, kv, block_size,
                                         num_kv_heads):
    Hq = num_kv_heads * 4
    for is_neox in (True, False):
        qkv, pos, cs, kvc, slots, ks, vs = setup(num_tokens, Hq, num_kv_heads, head_size, layout,
                                                 block_size, kv, seed=head_size + num_tokens)
        want_b, want_c = oracle_fused(qkv, pos, cs, kvc, slots, ks, vs, Hq, num_kv_heads,
                                      head_size, layout, kv, is_neox)
        q, k, v = split(qkv, Hq, num_kv_heads, head_size, num_tokens)
        kc, vc = pk.kv_views(kvc, layout, num_kv_heads, head_size)
        loomnb.rotary_embedding_and_cache(pos, q, k, v, kc, vc, slots, head_size, cs, is_neox, kv,
                                          ks, vs)
        torch.cuda.synchronize()
        assert_same(qkv, want_b, f"qkv {layout} {kv} neox={is_neox}")
        assert_same(kvc, want_c, f"cache {layout} {kv} neox={is_neox}")


@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("layout", pk.KV_LAYOUTS)
def test_fused_equals_the_two_ops_and_the_vector_path_runs(layout, kv):
    T, Hq, Hk, D = 19, 28, 4, 128
    qkv, pos, cs, kvc, slots, ks, vs = setup(T, Hq, Hk, D, layout, 16, kv, seed=3, pad_tokens=5)
    qkv2, kvc2 = qkv.clone(), kvc.clone()
    L.clear_launch_cache()
    q, k, v = split(qkv, Hq, Hk, D, T)
    kc, vc = pk.kv_views(kvc, layout, Hk, D)
    loomnb.rotary_embedding_and_cache(pos, q, k, v, kc, vc, slots, D, cs, True, kv, ks, vs)
    q2, k2, v2 = split(qkv2, Hq, Hk, D, T)
    kc2, vc2 = pk.kv_views(kvc2, layout, Hk, D)
    loomnb.rotary_embedding(pos, q2, k2, D, cs, True)
    write = loomnb.reshape_and_cache if layout == "legacy_xpacked" else loomnb.reshape_and_cache_flash
    write(k2.view(T, Hk, D), v2.view(T, Hk, D), kc2, vc2, slots, kv, ks, vs)
    torch.cuda.synchronize()
    assert torch.equal(qkv.view(torch.int16), qkv2.view(torch.int16))
    assert torch.equal(kvc.view(torch.uint8), kvc2.view(torch.uint8))
    from loomnb.ops._rope_cache_kernels import rope_cache_kernel
    assert {s.layout for f, s, _ in L.launched()
            if f is rope_cache_kernel and s.cache != "none" and s.kind == "bf16"} >= {"vector"}


@pytest.mark.parametrize("fma, inverse", [("vllm", False), ("vllm", True), ("none", False)])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("kind, cs_kind", [("bf16", "bf16"), ("bf16", "f32"), ("f16", "f32"),
                                           ("f32", "f32")])
@pytest.mark.parametrize("rot_dim, off, head_size", [(128, 0, 128), (32, 16, 96), (24, 4, 80)])
def test_rotary_embedding_forms_partial_rotary(kind, cs_kind, is_neox, fma, inverse, rot_dim,
                                               off, head_size):
    """Every form, pairing and dtype pair; partial rotary with offsets (vector and scalar);
    channels outside the rotated span keep their bits."""
    T, Hq, Hk = 37, 8, 2
    g = torch.Generator(device="cuda").manual_seed(rot_dim)
    q = (torch.randn(T, Hq, head_size, generator=g, device="cuda") * 4).to(TORCH_DT[kind])
    k = (torch.randn(T, Hk * head_size, generator=g, device="cuda") * 4).to(TORCH_DT[kind])
    pos = torch.randint(0, MAX_POS, (T,), generator=g, device="cuda")
    cs = cos_sin_cache(rot_dim, TORCH_DT[cs_kind])
    qo, ko = to_np(q).copy(), to_np(k).copy()
    loomnb.oracle.rotary_embedding(to_np(pos), qo, ko, head_size, to_np(cs), is_neox, off,
                                   inverse, fma=fma)
    q0 = q.clone()
    loomnb.rotary_embedding(pos, q, k, head_size, cs, is_neox, off, inverse, fma=fma)
    torch.cuda.synchronize()
    assert_same(q, qo, "query")
    assert_same(k, ko, "key")
    keep = torch.ones(head_size, dtype=torch.bool)
    keep[off:off + rot_dim] = False
    assert torch.equal(q[..., keep.cuda()].view(torch.int16 if kind != "f32" else torch.int32),
                       q0[..., keep.cuda()].view(torch.int16 if kind != "f32" else torch.int32))


def test_unit_vector_on_the_gpu():
    for is_neox, sin_at in ((False, 1), (True, 64)):
        q = torch.zeros(1, 128, dtype=torch.bfloat16, device="cuda")
        q[0, 0] = 1
        loomnb.rotary_embedding(torch.tensor([1], device="cuda"), q, None, 128,
                                cos_sin_cache(128, torch.bfloat16), is_neox)
        assert q[0, 0].item() == 0.5390625 and q[0, sin_at].item() == 0.83984375
        assert int((q != 0).sum()) == 2


def test_padded_slots_write_nothing_and_sentinel_survives():
    T, Hq, Hk, D, bs = 64, 8, 2, 128, 16
    qkv, pos, cs, kvc, slots, ks, vs = setup(T, Hq, Hk, D, "interleaved_nhd", bs, "auto", seed=9)
    slots[:] = -1
    before = kvc.clone()
    q, k, v = split(qkv, Hq, Hk, D, T)
    kc, vc = pk.kv_views(kvc, "interleaved_nhd")
    loomnb.rotary_embedding_and_cache(pos, q, k, v, kc, vc, slots, D, cs, True)
    torch.cuda.synchronize()
    assert torch.equal(kvc.view(torch.int16), before.view(torch.int16))


# ---------------------------------------------------------------------------------- GPU-only pieces
def test_hardware_e5m2_and_explicit_rounding_arithmetic():
    """``cvt.rn.satfinite.e5m2x2.f32`` equals the portable encoder (hence the oracle) over every
    bf16/fp16 value and random bits; ``fma_rn``/``mul_rn``/``add_rn``/``sub_rn`` (``fma.rn`` and
    ``.rn`` products ptxas cannot re-fuse) equal the exact oracle ``fma_f32`` and IEEE float32."""
    from numba import cuda

    from loomnb.layouts import dtypes as d
    from loomnb.ops._rope_cache_kernels import add_rn, fma_rn, mul_rn, sub_rn

    @cuda.jit
    def conv(xs, out):
        i = cuda.grid(1)
        if i < xs.shape[0]:
            out[i, 0] = d.f32_to_e5m2(xs[i])
            out[i, 1] = d.f32_to_e5m2_portable(xs[i])
            out[i, 2] = d.pack_e5m2x2(xs[i], -xs[i])

    rng = np.random.default_rng(0)
    xs = np.concatenate([
        rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
        np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32),
        np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32),
        np.linspace(-70000, 70000, 200001, dtype=np.float32),
        np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)]).astype(np.float32)
    out = cuda.device_array((xs.shape[0], 3), np.uint32)
    conv[(xs.shape[0] + 255) // 256, 256](cuda.to_device(xs), out)
    o = out.copy_to_host()
    assert np.array_equal(o[:, 0], o[:, 1]), xs[o[:, 0] != o[:, 1]][:5]
    assert np.array_equal(o[:, 0], loomnb.oracle.fp8.e5m2_encode(xs))
    # pack_e5m2x2(hi, lo): hi in bits 15..8 (here x), lo in bits 7..0 (here -x)
    assert np.array_equal(o[:, 2] >> 8, o[:, 1]) and np.array_equal(
        o[:, 2] & 0xFF, loomnb.oracle.fp8.e5m2_encode(-xs))

    @cuda.jit
    def arith(a, b, c, out):
        i = cuda.grid(1)
        if i < a.shape[0]:
            out[i, 0] = fma_rn(a[i], b[i], c[i])
            out[i, 1] = mul_rn(a[i], b[i])
            out[i, 2] = add_rn(a[i], c[i])
            out[i, 3] = sub_rn(a[i], c[i])

    n = 1 << 20
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    p = a.astype(np.float64) * b
    c = np.where(rng.random(n) < 0.5, rng.standard_normal(n), -p * (1 + 2.0 ** -24)).astype(np.float32)
    res = cuda.device_array((n, 4), np.float32)
    arith[(n + 255) // 256, 256](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), res)
    r = res.copy_to_host()
    assert np.array_equal(r[:, 0].view(np.uint32), fma_f32(a, b, c).view(np.uint32))
    assert np.array_equal(r[:, 1], a * b) and np.array_equal(r[:, 2], a + c)
    assert np.array_equal(r[:, 3], a - c)


@pytest.mark.parametrize("threads", [32, 96, 1024])
def test_block_size_sweep_and_partial_warps(threads):
    """Partial warps (items not a multiple of 32 -- SmolLM2's 9/3/64 has 72 items a token) and
    forced block sizes give the same bits."""
    T, Hq, Hk, D = 33, 9, 3, 64
    qkv, pos, cs, kvc, slots, ks, vs = setup(T, Hq, Hk, D, "interleaved_hnd", 16, "fp8", seed=4)
    want_b, want_c = oracle_fused(qkv, pos, cs, kvc, slots, ks, vs, Hq, Hk, D, "interleaved_hnd",
                                  "fp8", True)
    q, k, v = split(qkv, Hq, Hk, D, T)
    kc, vc = pk.kv_views(kvc, "interleaved_hnd")
    with L.force_threads(threads):
        loomnb.rotary_embedding_and_cache(pos, q, k, v, kc, vc, slots, D, cs, True, "fp8", ks, vs)
    torch.cuda.synchronize()
    assert_same(qkv, want_b, "qkv")
    assert_same(kvc, want_c, "cache")


def _graph(run):
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g, stream=side):
        run()
    return g


def test_cuda_graph_capture_replay_and_fast_path():
    T, Hq, Hk, D = 8, 32, 8, 128
    qkv, pos, cs, kvc, slots, ks, vs = setup(T, Hq, Hk, D, "interleaved_nhd", 16, "auto", seed=5)
    q, k, v = split(qkv, Hq, Hk, D, T)
    kc, vc = pk.kv_views(kvc, "interleaved_nhd")
    run = lambda: loomnb.rotary_embedding_and_cache(pos, q, k, v, kc, vc, slots, D, cs, True)  # noqa: E731
    g = _graph(run)
    fresh, fresh_c = qkv.clone(), kvc.clone()
    want_b, want_c = oracle_fused(fresh, pos, cs, fresh_c, slots, ks, vs, Hq, Hk, D,
                                  "interleaved_nhd", "auto", True)
    qkv.copy_(fresh)
    kvc.copy_(fresh_c)
    g.replay()
    torch.cuda.synchronize()
    assert_same(qkv, want_b, "graph qkv")
    assert_same(kvc, want_c, "graph cache")
    L.clear_launch_cache()
    run()
    info = loomnb.ops.launch_cache_info()
    run()
    assert loomnb.ops.launch_cache_info() == info, "the second eager call replays"


def test_new_num_tokens_does_not_recompile():
    Hq, Hk, D = 32, 8, 128
    cs = cos_sin_cache(D, torch.bfloat16)
    kvc = pk.allocate_kv_cache("interleaved_nhd", 64, 16, Hk, D, torch.bfloat16, "cuda")
    kc, vc = pk.kv_views(kvc, "interleaved_nhd")
    for T in (3, 1, 250, 17):
        qkv = torch.randn(T, (Hq + 2 * Hk) * D, device="cuda").to(torch.bfloat16)
        q, k, v = split(qkv, Hq, Hk, D, T)
        pos = torch.arange(T, device="cuda")
        slots = torch.arange(T, device="cuda")
        loomnb.rotary_embedding_and_cache(pos, q, k, v, kc, vc, slots, D, cs, True)
        if T == 3:
            before = {key: len(kern._handles) for key, kern in L._kernels.items()}
    assert {key: len(kern._handles) for key, kern in L._kernels.items()} == before


def test_torch_compile_around_the_fused_op():
    """One torch.ops.loomnb node inside a compiled function (separate q/k/v and cache tensors
    as arguments); the result equals the oracle."""
    T, Hq, Hk, D = 5, 8, 2, 64
    qkv, pos, cs, kvc, slots, ks, vs = setup(T, Hq, Hk, D, "interleaved_nhd", 16, "auto", seed=6)
    want_b, want_c = oracle_fused(qkv, pos, cs, kvc, slots, ks, vs, Hq, Hk, D, "interleaved_nhd",
                                  "auto", True)
    q, k, v = (t.contiguous() for t in split(qkv, Hq, Hk, D, T))
    kc, vc = pk.kv_views(kvc, "interleaved_nhd")

    def f(q, k, v, kc, vc, pos, slots):
        loomnb.rotary_embedding_and_cache(pos, q, k, v, kc, vc, slots, D, cs, True)
        return q.float().sum() + k.float().sum()

    torch.compile(f)(q, k, v, kc, vc, pos, slots)
    torch.cuda.synchronize()
    assert_same(torch.cat([q, k, v], 1), want_b, "compiled q/k/v")
    assert_same(kvc, want_c, "compiled cache")


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("kind, cs_kind, rot_dim, head_size", [
    ("bf16", "bf16", 64, 64), ("bf16", "f32", 32, 96), ("f16", "f16", 128, 128),
    ("f32", "f32", 24, 80)])
def test_apply_rope_out_of_place(kind, cs_kind, rot_dim, head_size, is_neox):
    """The out-of-place form on slices of a fused QKV buffer (SmolLM2's 9/3 heads): the oracle's
    bits, the in-place op's bits, the QKV buffer unmodified, contiguous outputs; partial rotary
    copies the other channels (vector path at 32/96, scalar at f32)."""
    T, Hq, Hk = 37, 9, 3
    D = head_size
    g = torch.Generator(device="cuda").manual_seed(rot_dim + D)
    qkv = (torch.randn(T, (Hq + 2 * Hk) * D, generator=g, device="cuda") * 3).to(TORCH_DT[kind])
    q, k, _ = split(qkv, Hq, Hk, D, T)
    pos = torch.randint(0, MAX_POS, (T,), generator=g, device="cuda")
    cs = cos_sin_cache(rot_dim, TORCH_DT[cs_kind])
    before = qkv.clone()
    qo, ko = loomnb.apply_rope_with_cos_sin_cache(pos, q, k, D, cs, is_neox)
    torch.cuda.synchronize()
    assert torch.equal(qkv.view(torch.uint8), before.view(torch.uint8)), "inputs unmodified"
    assert qo.shape == q.shape and ko.shape == k.shape and qo.is_contiguous() and ko.is_contiguous()
    want = loomnb.oracle.apply_rope_with_cos_sin_cache(to_np(pos), to_np(q), to_np(k), D,
                                                        to_np(cs), is_neox)
    assert_same(qo, want[0], "query_out")
    assert_same(ko, want[1], "key_out")
    qi, ki = q.clone(), k.clone()
    loomnb.rotary_embedding(pos, qi, ki, D, cs, is_neox)
    assert torch.equal(qo.view(torch.uint8), qi.view(torch.uint8)), "query_out vs in place"
    assert torch.equal(ko.view(torch.uint8), ki.view(torch.uint8)), "key_out vs in place"


def test_apply_rope_replay_graph_and_torch_compile():
    """The eager fast path allocates new outputs on each replayed call; CUDA-graph capture; and
    under torch.compile the out-of-place op on views of a QKV buffer is one loomnb node with no
    copy of the views (what the vLLM plug-in relies on)."""
    from torch._inductor.utils import run_and_get_code
    T, Hq, Hk, D = 4, 9, 3, 64
    g = torch.Generator(device="cuda").manual_seed(8)
    qkv = (torch.randn(T, (Hq + 2 * Hk) * D, generator=g, device="cuda")).to(torch.bfloat16)
    q, k, _ = split(qkv, Hq, Hk, D, T)
    pos = torch.randint(0, MAX_POS, (T,), generator=g, device="cuda")
    cs = cos_sin_cache(D, torch.bfloat16)
    want = [w.copy() for w in loomnb.oracle.apply_rope_with_cos_sin_cache(
        to_np(pos), to_np(q), to_np(k), D, to_np(cs), True)]
    L.clear_launch_cache()
    a = loomnb.apply_rope_with_cos_sin_cache(pos, q, k, D, cs, True)
    info = loomnb.ops.launch_cache_info()
    b = loomnb.apply_rope_with_cos_sin_cache(pos, q, k, D, cs, True)
    assert loomnb.ops.launch_cache_info() == info, "the second eager call replays"
    assert b[0].data_ptr() != a[0].data_ptr() and b[1].data_ptr() != a[1].data_ptr()
    for got in (a, b):
        assert_same(got[0], want[0], "query_out")
        assert_same(got[1], want[1], "key_out")
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    gr = _graph(lambda: loomnb.apply_rope_with_cos_sin_cache(pos, q, k, D, cs, True,
                                                             query_out=qo, key_out=ko))
    qo.zero_()
    gr.replay()
    torch.cuda.synchronize()
    assert_same(qo, want[0], "graph query_out")
    assert_same(ko, want[1], "graph key_out")

    def f(qkv, pos):
        q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
        q, k = loomnb.apply_rope_with_cos_sin_cache(pos, q, k, D, cs, True)
        return q * 2, k, v

    (oq, ok, _), codes = run_and_get_code(torch.compile(f, fullgraph=True), qkv, pos)
    torch.cuda.synchronize()
    assert_same(oq, (want[0].astype(np.float32) * 2).astype(want[0].dtype), "compiled query")
    assert_same(ok, want[1], "compiled key")
    code = "\n".join(codes)
    calls = [ln for ln in code.splitlines()
             if "= torch.ops.loomnb.apply_rope_with_cos_sin_cache.default(" in ln]
    assert len(calls) == 1 and "reinterpret_tensor(" in calls[0], code  # the views themselves
    assert "copy_" not in code and "auto_functionalized" not in code, code


def test_host_arrays_and_devices_are_rejected():
    q = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(loomnb.LoomnbTypeError, match="argument 'positions' must be a CUDA device array"):
        loomnb.rotary_embedding(torch.zeros(2, dtype=torch.int64), q.cuda(), None, 64,
                                cos_sin_cache(64, torch.bfloat16), True)
    with pytest.raises(loomnb.LoomnbTypeError, match="argument 'query' must be a CUDA device array"):
        loomnb.rotary_embedding(torch.zeros(2, dtype=torch.int64, device="cuda"), q, None, 64,
                                cos_sin_cache(64, torch.bfloat16), True)


def test_64bit_cache_offsets():
    """A cache past 2^31 elements (4.3 GB bf16): the last slot of the last block is written where
    a copy-out says."""
    Hk, D, bs = 8, 128, 16
    nb = (2 ** 31) // (bs * Hk * D * 2) + 2  # the K view alone spans > 2^31 elements
    kvc = pk.allocate_kv_cache("interleaved_nhd", nb, bs, Hk, D, torch.bfloat16, "cuda", fill=None)
    kc, vc = pk.kv_views(kvc, "interleaved_nhd")
    key = torch.randn(2, Hk, D, device="cuda").to(torch.bfloat16)
    value = torch.randn(2, Hk, D, device="cuda").to(torch.bfloat16)
    slots = torch.tensor([nb * bs - 1, 7], device="cuda")
    loomnb.reshape_and_cache_flash(key, value, kc, vc, slots, "auto", None, None)
    torch.cuda.synchronize()
    assert torch.equal(kc[nb - 1, bs - 1], key[0]) and torch.equal(vc[nb - 1, bs - 1], value[0])
    assert torch.equal(kc[0, 7], key[1])
    del kvc, kc, vc
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- vLLM 0.24
@pytest.fixture(scope="module")
def vllm_ops(vllm_c):
    return vllm_c._C.rotary_embedding, vllm_c._C_cache_ops


def test_rotary_embedding_bytes_equal_vllm_and_which_fma_form(vllm_ops):
    """vLLM's rotary_embedding against loomnb's default bit for bit, for bf16 and fp32 queries
    with bf16 and fp32 caches, NeoX and GPT-J, inverse or not; prints which of the nine oracle
    contraction forms reproduce vLLM's bytes (the fp32 cases tell them apart)."""
    rope, _ = vllm_ops
    T, Hq, Hk, D = 257, 32, 8, 128
    forms = [f"{x}{y}" for x in "abn" for y in "den"]
    report = []
    for kind, cs_kind in (("bf16", "bf16"), ("bf16", "f32"), ("f32", "f32")):
        for is_neox in (True, False):
            for inverse in (False, True):
                g = torch.Generator(device="cuda").manual_seed(1)
                q = (torch.randn(T, Hq * D, generator=g, device="cuda") * 3).to(TORCH_DT[kind])
                k = (torch.randn(T, Hk * D, generator=g, device="cuda") * 3).to(TORCH_DT[kind])
                pos = torch.randint(0, MAX_POS, (T,), generator=g, device="cuda")
                cs = cos_sin_cache(D, TORCH_DT[cs_kind])
                qv, kv_ = q.clone(), k.clone()
                rope(pos, qv, kv_, D, cs, is_neox, 0, inverse)
                matching = []
                for f in forms:
                    qo, ko = to_np(q).copy(), to_np(k).copy()
                    loomnb.oracle.rotary_embedding(to_np(pos), qo, ko, D, to_np(cs), is_neox, 0,
                                                   inverse, form=f)
                    if (np.array_equal(u8(qv), qo.view(np.uint8).reshape(u8(qv).shape))
                            and np.array_equal(u8(kv_), ko.view(np.uint8).reshape(u8(kv_).shape))):
                        matching.append(f)
                ql, kl = q.clone(), k.clone()
                loomnb.rotary_embedding(pos, ql, kl, D, cs, is_neox, 0, inverse)
                exact = float((u8(ql) == u8(qv)).mean())
                report.append(f"{kind}/{cs_kind} neox={is_neox} inverse={inverse}: vLLM == "
                              f"oracle forms {matching}; loomnb fma='vllm' bytes equal {exact:.6f}")
                assert torch.equal(ql.view(torch.uint8), qv.view(torch.uint8)), report[-1]
                assert torch.equal(kl.view(torch.uint8), kv_.view(torch.uint8)), report[-1]
    print("\n".join(report))


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("layout", pk.KV_LAYOUTS)
def test_cache_writes_and_fused_bytes_equal_vllm(vllm_ops, layout, kv):
    rope, cache_ops = vllm_ops
    T, Hq, Hk, D, bs = 111, 32, 8, 128, 16
    qkv, pos, cs, kvc, slots, ks, vs = setup(T, Hq, Hk, D, layout, bs, kv, seed=2, pad_tokens=3)
    ks = ks[:1].clone()  # vLLM 0.24 reads one scale
    qkv2, kvc2 = qkv.clone(), kvc.clone()
    q, k, v = split(qkv, Hq, Hk, D, T)
    kc, vc = pk.kv_views(kvc, layout, Hk, D)
    rope(pos, q, k, D, cs, True, 0, False)
    write = cache_ops.reshape_and_cache if layout == "legacy_xpacked" else cache_ops.reshape_and_cache_flash
    write(k.reshape(T, Hk, D), v.reshape(T, Hk, D), kc, vc, slots, kv, ks, vs)
    q2, k2, v2 = split(qkv2, Hq, Hk, D, T)
    kc2, vc2 = pk.kv_views(kvc2, layout, Hk, D)
    loomnb.rotary_embedding_and_cache(pos, q2, k2, v2, kc2, vc2, slots, D, cs, True, kv, ks, vs)
    torch.cuda.synchronize()
    assert torch.equal(qkv.view(torch.uint8), qkv2.view(torch.uint8)), "query/key vs vLLM"
    assert torch.equal(kvc.view(torch.uint8), kvc2.view(torch.uint8)), "cache vs vLLM"


@pytest.mark.parametrize("num_tokens", [1, 7, 80, 300])
def test_rotary_embedding_bytes_equal_vllm_on_qkv_views(vllm_ops, num_tokens):
    """vLLM's rotary_embedding against loomnb's in-place and out-of-place forms on the layout a
    vLLM engine passes: SmolLM2's 9 query / 3 KV heads of 64 on views of one fused QKV buffer
    (row stride 960), a bf16 cos/sin cache, NeoX pairs, positions up to 2048."""
    rope, _ = vllm_ops
    Hq, Hk, D = 9, 3, 64
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    qkv = (torch.randn(num_tokens, (Hq + 2 * Hk) * D, generator=g, device="cuda") * 3).to(
        torch.bfloat16)
    pos = torch.randint(0, 2048, (num_tokens,), generator=g, device="cuda")
    cs = cos_sin_cache(D, torch.bfloat16)
    ref, mine = qkv.clone(), qkv.clone()
    rope(pos, *split(ref, Hq, Hk, D, num_tokens)[:2], D, cs, True, 0, False)
    loomnb.rotary_embedding(pos, *split(mine, Hq, Hk, D, num_tokens)[:2], D, cs, True)
    qo, ko = loomnb.apply_rope_with_cos_sin_cache(pos, *split(qkv, Hq, Hk, D, num_tokens)[:2], D,
                                                  cs, True)
    torch.cuda.synchronize()
    rq, rk, _ = split(ref, Hq, Hk, D, num_tokens)
    for what, got, want in (("in place", mine, ref), ("query_out", qo, rq), ("key_out", ko, rk)):
        same = got.view(torch.int16) == want.view(torch.int16)
        bad = (~same).nonzero()[:4].tolist()
        assert bool(same.all()), (f"{what}: {int((~same).sum())} of {same.numel()} differ; first "
                                  f"{bad}: loomnb {[float(got[i, j]) for i, j in bad]} vLLM "
                                  f"{[float(want[i, j]) for i, j in bad]} input "
                                  f"{[float(qkv[i, j]) for i, j in bad]}")


# ---------------------------------------------------------------------------------- check_indices
def _run_every_op(inputs, layout, check):
    """Every op of the family on ``inputs`` with ``check_indices=check``, twice (an unchecked
    second call replays; a checked one never does): the last call's outputs."""
    qkv, pos, cs, kvc, slots, Hq, Hk, D, T = inputs
    cache_op = loomnb.reshape_and_cache if layout == "legacy_xpacked" else loomnb.reshape_and_cache_flash
    for _ in range(2):
        b, c, c2 = qkv.clone(), kvc.clone(), kvc.clone()
        q, k, v = split(b, Hq, Hk, D, T)
        kc, vc = pk.kv_views(c, layout, Hk, D)
        loomnb.rotary_embedding_and_cache(pos, q, k, v, kc, vc, slots, D, cs, True,
                                          check_indices=check)
        kc2, vc2 = pk.kv_views(c2, layout, Hk, D)
        k0, v0 = split(qkv, Hq, Hk, D, T)[1:]
        cache_op(k0.unflatten(1, (Hk, D)), v0.unflatten(1, (Hk, D)), kc2, vc2, slots, "auto",
                 None, None, check_indices=check)
        q2 = qkv[:, :Hq * D].clone()
        loomnb.rotary_embedding(pos, q2, None, D, cs, True, check_indices=check)
        qo, ko = loomnb.apply_rope_with_cos_sin_cache(pos, qkv[:, :Hq * D], k0, D, cs,
                                                      check_indices=check)
    return b, c, c2, q2, qo, ko


@pytest.mark.parametrize("layout", ["interleaved_nhd", "interleaved_hnd", "legacy_xpacked"])
def test_check_indices_on_valid_indices_same_bytes_no_sync_no_replay(layout):
    """check_indices=True with in-range indices (the last slot, -1 padding, positions 0 and
    max_position - 1): the same bytes as the unchecked ops, no host synchronisation (torch's
    sync debug mode raises on one), and no eager fast-path replay (the device check is not part
    of a remembered launch, so a checked call is never remembered)."""
    T, Hq, Hk, D, bs = 9, 8, 2, 128, 16
    qkv, pos, cs, kvc, _, _, _ = setup(T, Hq, Hk, D, layout, bs, "auto", seed=11)
    nb = -(-T // bs) + 3
    slots = torch.tensor([nb * bs - 1, 3, 17, -1, 40, 5, 22, 33, 0], device="cuda")
    pos[0], pos[1] = 0, MAX_POS - 1
    inputs = (qkv, pos, cs, kvc, slots, Hq, Hk, D, T)
    L.clear_launch_cache()
    plain = _run_every_op(inputs, layout, False)
    assert L.launch_cache_info()["size"] > 0
    L.clear_launch_cache()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        checked = _run_every_op(inputs, layout, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert L.launch_cache_info()["size"] == 0, "a checked call must not be remembered for replay"
    for a, b, what in zip(checked, plain, ("fused qkv", "fused cache", "cache op", "rope",
                                            "query_out", "key_out")):
        assert np.array_equal(u8(a), u8(b)), what


BAD_INDEX = {  # case: (the call, the op and argument the assert names)
    "slot past the cache": ("loomnb.reshape_and_cache_flash(k, k, kc, vc, "
                            "torch.tensor([0, -1, 32], device='cuda'), 'auto', None, None, check_indices=True)",
                            "reshape_and_cache_flash: argument 'slot_mapping'"),
    "slot -2": ("loomnb.reshape_and_cache_flash(k, k, kc, vc, torch.tensor([0, -2, 3], device='cuda'), "
                "'auto', None, None, check_indices=True)", "reshape_and_cache_flash: argument 'slot_mapping'"),
    "legacy slot": ("loomnb.reshape_and_cache(k, k, torch.zeros(2, 1, 8, 16, 8, dtype=k.dtype, device='cuda'), "
                    "torch.zeros(2, 1, 64, 16, dtype=k.dtype, device='cuda'), "
                    "torch.tensor([0, 40, 1], device='cuda'), 'auto', None, None, check_indices=True)",
                    "reshape_and_cache: argument 'slot_mapping'"),
    "position": ("loomnb.rotary_embedding(torch.tensor([0, 16, 1], device='cuda'), q, None, 64, cs, True, "
                 "check_indices=True)", "rotary_embedding: argument 'positions'"),
    "fused slot": ("loomnb.rotary_embedding_and_cache(torch.tensor([0, 1, 2], device='cuda'), q, "
                   "k.clone().view(3, 64), k.view(3, 64), kc, vc, torch.tensor([5, 99, 1], device='cuda'), "
                   "64, cs, True, check_indices=True)", "rotary_embedding_and_cache: argument 'slot_mapping'"),
    "fused position": ("loomnb.rotary_embedding_and_cache(torch.tensor([0, -3, 2], device='cuda'), q, "
                       "k.clone().view(3, 64), k.view(3, 64), kc, vc, torch.tensor([5, 9, 1], device='cuda'), "
                       "64, cs, True, check_indices=True)", "rotary_embedding_and_cache: argument 'positions'"),
}


@pytest.mark.parametrize("case", list(BAD_INDEX))
def test_check_indices_fires_the_device_assert_on_a_bad_index(case):
    """An out-of-range index with check_indices=True: a device-side assert at the next
    synchronisation, naming the op and the argument (in a subprocess: it ends the CUDA
    context); the op's kernel, queued after it, does not run (its launch reports the assert)."""
    code = ("import torch, loomnb\n"
            "from loomnb.layouts import paged_kv as pk\n"
            "kvc = pk.allocate_kv_cache('interleaved_nhd', 2, 16, 1, 64, torch.bfloat16, 'cuda')\n"
            "kc, vc = pk.kv_views(kvc, 'interleaved_nhd')\n"
            "k = torch.ones(3, 1, 64, dtype=torch.bfloat16, device='cuda')\n"
            "q = torch.ones(3, 128, dtype=torch.bfloat16, device='cuda')\n"
            "cs = torch.ones(16, 64, dtype=torch.bfloat16, device='cuda')\n"
            f"{BAD_INDEX[case][0]}\n"
            "torch.cuda.synchronize()\n")
    assert_device_assert(code, f"loomnb.{BAD_INDEX[case][1]} must be")
