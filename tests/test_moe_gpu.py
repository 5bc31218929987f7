"""MoE routing and movement on a real GPU: what the simulator cannot check.

Warp shuffles and 16-byte moves at serving sizes (Qwen3-30B-A3B's 128 experts top-8 and
DeepSeek-V3's 256 / 8 groups / top-8, up to 4,096 tokens; hidden 2,048 and 4,096 rows), the
align's two passes over many chunks, CUDA-graph capture and replay with new routing, explicit
streams, the eager fast path and torch.compile; and vLLM 0.24's own ops where they are staged
(``LOOMNB_VLLM_MOE_LIB``): ``topk_softmax``, ``topk_sigmoid``, ``grouped_topk``,
``moe_align_block_size`` and ``moe_sum``.

Routing weights are compared within ``tests/tolerances.py``'s ``moe_route`` row (libdevice
``expf``, and vLLM's own float32 summation order); logits are drawn with distinct, well
separated values so that the ids are compared exactly. Everything else is bit for bit.

Skipped, with that reason, on machines without a CUDA GPU (CI's CPU machine).
"""

import os

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import loomnb  # noqa: E402

from helpers import assert_ulps  # noqa: E402
from tolerances import ulps  # noqa: E402

BF16 = ml_dtypes.bfloat16


def host(t):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy()
    return t.numpy()


def bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def same(got, want, what=""):
    g = bits(host(got) if isinstance(got, torch.Tensor) else got)
    w = bits(want)
    assert g.shape == w.shape, (what, g.shape, w.shape)
    diff = g != w
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.size} differ, first {np.argwhere(diff)[:3].tolist()}"


def gapped_logits(rng, M, E, dtype=np.float32, gap=0.05):
    """Logits whose values in a row are distinct multiples of ``gap`` (exact in bf16 for E <=
    256 at this gap's scale): no two scores within rounding of each other."""
    x = np.stack([rng.permutation(E) for _ in range(M)]).astype(np.float64) * gap
    x -= x.mean(1, keepdims=True)
    return x.astype(np.float32).astype(dtype)


def cuda(a, dtype=None):
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


@pytest.fixture(scope="session")
def vllm_moe():
    path = os.environ.get("LOOMNB_VLLM_MOE_LIB")
    if not path or not os.path.isfile(path):
        pytest.skip("set LOOMNB_VLLM_MOE_LIB to vLLM 0.24's _moe_C_stable_libtorch.abi3.so to "
                    "compare with vLLM")
    torch.ops.load_library(path)
    return torch.ops._moe_C


TOL = ulps("moe_route", "f32")


# ------------------------------------------------------------------------------ routing
@pytest.mark.parametrize("E", [128, 256])
@pytest.mark.parametrize("M", [1, 64, 4096])
@pytest.mark.parametrize("kind", ["bf16", "f32"])
def test_topk_softmax_serving(E, M, kind):
    rng = np.random.default_rng(E + M)
    g = gapped_logits(rng, M, E, BF16 if kind == "bf16" else np.float32)
    w, i, t = loomnb.topk_softmax(cuda(g), 8, True)
    ww, wi, wt = loomnb.oracle.topk_softmax(g, 8, True)
    same(i, wi, "ids")
    same(t, wt, "token_expert_indices")
    assert_ulps(host(w), ww, TOL, "weights")


@pytest.mark.parametrize("M", [1, 300])
def test_topk_sigmoid_bias_serving(M):
    rng = np.random.default_rng(M)
    g = gapped_logits(rng, M, 128, gap=0.03)
    b = (rng.permutation(128) * 1e-3).astype(np.float32)
    w, i, _ = loomnb.topk_sigmoid(cuda(g), 8, True, e_score_correction_bias=cuda(b))
    ww, wi, _ = loomnb.oracle.topk_sigmoid(g, 8, True, e_score_correction_bias=b)
    same(i, wi, "ids")
    assert_ulps(host(w), ww, TOL, "weights")


@pytest.mark.parametrize("M", [1, 128, 4096])
def test_grouped_topk_deepseek_v3(M):
    rng = np.random.default_rng(M)
    g = gapped_logits(rng, M, 256, gap=0.02)
    b = (rng.permutation(256) * 1e-4).astype(np.float32)
    h = torch.empty((M, 1), device="cuda")
    w, i = loomnb.grouped_topk(h, cuda(g), 8, True, 8, 4, "sigmoid", 2.5, cuda(b))
    ww, wi = loomnb.oracle.grouped_topk(g, g, 8, True, 8, 4, "sigmoid", 2.5, b)
    same(i, wi, "ids")
    assert_ulps(host(w), ww, TOL, "weights")


def test_grouped_topk_softmax_no_bias():
    rng = np.random.default_rng(7)
    g = gapped_logits(rng, 50, 160)
    h = torch.empty((50, 4), device="cuda")
    w, i = loomnb.grouped_topk(h, cuda(g), 6, False, 8, 3, "softmax")
    ww, wi = loomnb.oracle.grouped_topk(g, g, 6, False, 8, 3, "softmax")
    same(i, wi, "ids")
    assert_ulps(host(w), ww, TOL, "weights")


# ------------------------------------------------------------------------------ align
def routed_ids(rng, M, k, E, dtype=np.int32, skew=False):
    if skew:  # a hot expert: one segment of most of the pairs
        p = np.full(E, 1.0)
        p[3] = E * 4.0
        p /= p.sum()
        return np.stack([rng.choice(E, k, replace=False, p=p) for _ in range(M)]).astype(dtype)
    return np.argsort(rng.random((M, E)), 1)[:, :k].astype(dtype)


@pytest.mark.parametrize("E, bs", [(128, 16), (256, 64), (8, 1)])
@pytest.mark.parametrize("M", [1, 64, 4096])
def test_align_serving(E, bs, M):
    rng = np.random.default_rng(E * M + bs)
    t = routed_ids(rng, M, min(8, E), E, np.int64 if M == 64 else np.int32)
    got = loomnb.moe_align_block_size(cuda(t), bs, E)
    want = loomnb.oracle.moe_align_block_size(t, bs, E)
    for g, w, name in zip(got, want, ("sorted_token_ids", "expert_ids", "num_tokens_post_pad")):
        same(g, w, name)


def test_align_skewed_with_map_and_padding():
    rng = np.random.default_rng(3)
    E = 64
    t = routed_ids(rng, 3000, 6, E, skew=True)
    m = np.where(np.arange(E) % 4 == 0, -1, np.arange(E) // 4).astype(np.int32)
    got = loomnb.moe_align_block_size(cuda(t), 32, E, cuda(m), True)
    want = loomnb.oracle.moe_align_block_size(t, 32, E, m, True)
    for g, w in zip(got, want):
        same(g, w, "skewed")


def test_align_repeats_bit_for_bit():
    """Deterministic: the same sorted order every call (vLLM's large path is not)."""
    rng = np.random.default_rng(4)
    t = cuda(routed_ids(rng, 4096, 8, 128))
    first = [x.clone() for x in loomnb.moe_align_block_size(t, 16, 128)]
    for _ in range(5):
        for a, b in zip(loomnb.moe_align_block_size(t, 16, 128), first):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------ rows
@pytest.mark.parametrize("H, dtype", [(2048, torch.bfloat16), (4096, torch.float16),
                                      (1000, torch.float32), (2050, torch.bfloat16)])
@pytest.mark.parametrize("M", [1, 512])
def test_permute_unpermute_serving(H, dtype, M):
    rng = np.random.default_rng(H + M)
    E, k = 128, 8
    t = routed_ids(rng, M, k, E)
    sorted_ids = loomnb.oracle.moe_align_block_size(t, 16, E)[0]
    x = torch.randn((M, H), device="cuda").to(dtype)
    out, _ = loomnb.moe_permute(x, cuda(sorted_ids), k)
    same(out, loomnb.oracle.moe_permute(host(x), sorted_ids, k)[0], "permute")
    y = torch.randn((sorted_ids.shape[0], H), device="cuda").to(dtype)
    w = torch.rand((M, k), device="cuda")
    got = loomnb.moe_unpermute(y, cuda(sorted_ids), w)
    same(got, loomnb.oracle.moe_unpermute(host(y), sorted_ids, host(w)), "unpermute")


@pytest.mark.parametrize("H", [2048, 1000])
def test_permute_fp8_serving(H):
    rng = np.random.default_rng(H)
    t = routed_ids(rng, 256, 8, 64)
    sorted_ids = loomnb.oracle.moe_align_block_size(t, 16, 64)[0]
    x = (torch.randn((256, H), device="cuda") * 3).to(torch.bfloat16)
    ub = torch.tensor([5.0], device="cuda")
    q, s = loomnb.moe_permute(x, cuda(sorted_ids), 8, "fp8", ub)
    wq, ws = loomnb.oracle.moe_permute(host(x), sorted_ids, 8, "fp8", host(ub))
    same(q, wq, "codes")
    same(s, ws, "scales")


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_sum_serving(k, dtype):
    x = torch.randn((1024, k, 4096), device="cuda").to(dtype)
    same(loomnb.moe_sum(x), loomnb.oracle.moe_sum(host(x)), f"k={k}")


# ------------------------------------------------------------------------------ vLLM
@pytest.mark.parametrize("E, M", [(128, 1), (128, 4096), (256, 64)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax_matches_vllm(vllm_moe, E, M, renormalize):
    rng = np.random.default_rng(E + M)
    g = cuda(gapped_logits(rng, M, E, BF16))
    w, i, t = loomnb.topk_softmax(g, 8, renormalize)
    vw = torch.empty((M, 8), device="cuda")
    vi = torch.empty((M, 8), device="cuda", dtype=torch.int32)
    vt = torch.empty((M, 8), device="cuda", dtype=torch.int32)
    vllm_moe.topk_softmax(vw, vi, vt, g, renormalize, None)
    same(i, host(vi), "ids")
    same(t, host(vt), "token_expert_indices")
    assert_ulps(host(w), host(vw), TOL, "weights vs vLLM")


def test_topk_sigmoid_matches_vllm(vllm_moe):
    if not hasattr(vllm_moe, "topk_sigmoid"):
        pytest.skip("this vLLM build has no topk_sigmoid")
    rng = np.random.default_rng(9)
    g = cuda(gapped_logits(rng, 200, 128, gap=0.03))
    b = cuda((rng.permutation(128) * 1e-3).astype(np.float32))
    w, i, _ = loomnb.topk_sigmoid(g, 8, True, e_score_correction_bias=b)
    vw = torch.empty((200, 8), device="cuda")
    vi = torch.empty((200, 8), device="cuda", dtype=torch.int32)
    vt = torch.empty((200, 8), device="cuda", dtype=torch.int32)
    vllm_moe.topk_sigmoid(vw, vi, vt, g, True, b)
    same(i, host(vi), "ids")
    assert_ulps(host(w), host(vw), TOL, "weights vs vLLM")


@pytest.mark.parametrize("M", [1, 512])
def test_grouped_topk_matches_vllm(vllm_moe, M):
    """vLLM's fused grouped top-k (what its grouped_topk runs with a bias): the same experts
    (vLLM's order sorted by its own rule: compared as sets) and weights."""
    rng = np.random.default_rng(M)
    g = cuda(gapped_logits(rng, M, 256, gap=0.02))
    b = cuda((rng.permutation(256) * 1e-4).astype(np.float32))
    w, i = loomnb.grouped_topk(g, g, 8, True, 8, 4, "sigmoid", 2.5, b)
    vw, vi = vllm_moe.grouped_topk(g, 8, 4, 8, True, 2.5, b, 1)
    order = torch.argsort(vi.long(), 1)
    mine = torch.argsort(i.long(), 1)
    same(torch.gather(i, 1, mine), host(torch.gather(vi.int(), 1, order)), "ids as sets")
    assert_ulps(host(torch.gather(w, 1, mine)), host(torch.gather(vw.float(), 1, order)), TOL,
                "weights vs vLLM")


@pytest.mark.parametrize("E, bs, M", [(128, 16, 4096), (256, 64, 64), (32, 16, 20)])
def test_align_matches_vllm(vllm_moe, E, bs, M):
    """The same counts, offsets, sentinels and expert_ids; each segment the same set of flat
    indices (vLLM orders them by atomics above its small-batch path: sorted before comparing)."""
    rng = np.random.default_rng(E + M)
    t = cuda(routed_ids(rng, M, 8, E))
    s, e, n = loomnb.moe_align_block_size(t, bs, E)
    vs, ve, vn = torch.empty_like(s), torch.empty_like(e), torch.empty_like(n)
    vllm_moe.moe_align_block_size(t, E, bs, vs, ve, vn, None)
    same(n, host(vn), "num_tokens_post_pad")
    same(e, host(ve), "expert_ids")
    total = int(n.item())
    blocks = host(e)[:total // bs]
    mine, theirs = host(s)[:total], host(vs)[:total]
    starts = np.flatnonzero(np.r_[True, blocks[1:] != blocks[:-1]]) * bs
    for a, b in zip(starts, list(starts[1:]) + [total]):  # one expert's segment
        same(mine[a:b], np.sort(theirs[a:b]), f"segment at {a} (vLLM's sorted)")
    same(s[total:], host(vs[total:]), "tail sentinels")


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_moe_sum_matches_vllm(vllm_moe, k):
    x = torch.randn((777, k, 2048), device="cuda").to(torch.bfloat16)
    want = torch.empty((777, 2048), device="cuda", dtype=torch.bfloat16)
    vllm_moe.moe_sum(x, want)
    same(loomnb.moe_sum(x), host(want), f"k={k}")


# ------------------------------------------------------------------------------ graphs, streams
def test_routing_and_align_in_a_cuda_graph():
    """Capture route -> align -> permute -> unpermute once; replay with new logits and rows."""
    rng = np.random.default_rng(11)
    M, E, k, H = 64, 128, 8, 512
    g = cuda(gapped_logits(rng, M, E))
    x = torch.randn((M, H), device="cuda").to(torch.bfloat16)
    for _ in range(2):  # warm: compile and remember the launches
        w, i, _ = loomnb.topk_softmax(g, k, True)
        s, e, n = loomnb.moe_align_block_size(i, 16, E)
        p, _ = loomnb.moe_permute(x, s, k)
        y = loomnb.moe_unpermute(p, s, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, i, _ = loomnb.topk_softmax(g, k, True)
        s, e, n = loomnb.moe_align_block_size(i, 16, E)
        p, _ = loomnb.moe_permute(x, s, k)
        y = loomnb.moe_unpermute(p, s, w)
    for trial in range(3):
        g.copy_(cuda(gapped_logits(rng, M, E)))
        x.copy_(torch.randn((M, H), device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        gh, xh = host(g), host(x)
        ww, wi, _ = loomnb.oracle.topk_softmax(gh, k, True)
        same(i, wi, f"replay {trial}: ids")
        ws = loomnb.oracle.moe_align_block_size(wi, 16, E)
        same(s, ws[0], f"replay {trial}: sorted")
        wp = loomnb.oracle.moe_permute(xh, ws[0], k)[0]
        same(p, wp, f"replay {trial}: permuted")
        same(y, loomnb.oracle.moe_unpermute(wp, ws[0], host(w)), f"replay {trial}: combined")


def test_side_stream_and_fast_path():
    rng = np.random.default_rng(12)
    t = cuda(routed_ids(rng, 3000, 8, 128))
    want = loomnb.oracle.moe_align_block_size(host(t), 16, 128)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # the second and third calls replay the remembered launches
            got = loomnb.moe_align_block_size(t, 16, 128)
    side.synchronize()
    for g, w in zip(got, want):
        same(g, w, "side stream")
    got = loomnb.moe_align_block_size(t, 16, 128, stream=side)
    side.synchronize()
    same(got[0], want[0], "stream=")


def test_torch_compile_router():
    rng = np.random.default_rng(13)
    g = cuda(gapped_logits(rng, 32, 64))
    x = torch.randn((32, 256), device="cuda").to(torch.bfloat16)

    def layer(g, x):
        w, i, _ = loomnb.topk_softmax(g, 4, True)
        s, _, _ = loomnb.moe_align_block_size(i, 16, 64)
        p, _ = loomnb.moe_permute(x, s, 4)
        return loomnb.moe_unpermute(p * 2, s, w)

    compiled = torch.compile(layer, fullgraph=True)
    same(compiled(g, x), host(layer(g, x)), "compiled")
