"""KV-cache movement on a real GPU: what the simulator cannot check.

16- and 8-byte vector moves at serving sizes (64 KB blocks of 16 tokens x 8 KV heads x 128,
32 layers in one launch, MLA's 512 + 64 channels, 2,048-block compactions with the workspace
pass), pinned host memory reached through unified addressing (``swap_blocks`` both ways, a
pageable tensor rejected), a mapping on the device, CUDA-graph capture and replay with new
block numbers, explicit streams, the eager fast path, torch.compile, and the device-side index
check. Everything bit for bit against the oracles.

Skipped, with that reason, on machines without a CUDA GPU (CI's CPU machine).
"""

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import loomnb  # noqa: E402
from loomnb.layouts import paged_kv as pk  # noqa: E402
from loomnb.ops import _launch as L  # noqa: E402

from helpers import assert_device_assert  # noqa: E402

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
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def same(got, want, what=""):
    g, w = bits(host(got) if isinstance(got, torch.Tensor) else got), bits(want)
    assert g.shape == w.shape and np.array_equal(g, w), what


def caches(layers, nb, layout="interleaved_nhd", dtype=torch.bfloat16, bs=16, Hk=8, D=128):
    g = torch.Generator(device="cuda").manual_seed(layers * 1000 + nb)
    out = []
    for _ in range(layers):
        kv = pk.allocate_kv_cache(layout, nb, bs, Hk, D, dtype, "cuda")
        kv.view(torch.uint8).copy_(torch.randint(0, 256, kv.view(torch.uint8).shape,
                                                 generator=g, device="cuda", dtype=torch.uint8))
        out.append(kv)
    return out


def pairs(rng, P, nb):
    perm = rng.permutation(nb)
    return np.stack([perm[P:2 * P], perm[:P]], 1).astype(np.int64)


# ------------------------------------------------------------------------------ copy_blocks
@pytest.mark.parametrize("layout", pk.KV_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.float32])
def test_copy_blocks_serving_sizes(layout, dtype):
    rng = np.random.default_rng(0)
    D = 128 if dtype != torch.float32 else 64
    kvs = caches(4, 512, layout, dtype, D=D)
    views = [pk.kv_views(kv, layout, 8, D) for kv in kvs]
    m = pairs(rng, 200, 512)
    want = [host(kv) for kv in kvs]
    wv = [pk.kv_views(w, layout, 8, D) for w in want]
    loomnb.oracle.copy_blocks([k for k, _ in wv], [v for _, v in wv], m)
    loomnb.copy_blocks([k for k, _ in views], [v for _, v in views], torch.from_numpy(m).cuda())
    for kv, w in zip(kvs, want):
        same(kv, w, layout)


def test_copy_blocks_32_layers_one_launch_graph_and_fast_path():
    """Captured once after a warm-up, the graph replays new pairs written into the same
    mapping tensor (and -1 padding rows), and eager calls replay the remembered launch."""
    rng = np.random.default_rng(1)
    kvs = caches(32, 64, Hk=2, D=64)
    views = [pk.kv_views(kv, "interleaved_nhd") for kv in kvs]
    kcs, vcs = [k for k, _ in views], [v for _, v in views]
    m = torch.full((8, 2), -1, dtype=torch.int64, device="cuda")
    loomnb.copy_blocks(kcs, vcs, m)  # warm-up: compiles, uploads the address table
    misses = L.launch_cache_info()["misses"]
    loomnb.copy_blocks(kcs, vcs, m)
    assert L.launch_cache_info()["misses"] == misses, "the second call replays"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loomnb.copy_blocks(kcs, vcs, m)
    for _ in range(3):
        new = pairs(rng, 5, 64)
        m.fill_(-1)
        m[:5] = torch.from_numpy(new).cuda()
        want = [host(kv) for kv in kvs]
        wv = [pk.kv_views(w, "interleaved_nhd") for w in want]
        loomnb.oracle.copy_blocks([k for k, _ in wv], [v for _, v in wv], new)
        graph.replay()
        torch.cuda.synchronize()
        for kv, w in zip(kvs, want):
            same(kv, w, "graph replay")


def test_copy_blocks_first_call_inside_capture_is_a_clear_error():
    kvs = caches(2, 8, Hk=1, D=64)
    m = torch.zeros((1, 2), dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(loomnb.LoomnbValueError, match="before capturing"):
        with torch.cuda.graph(graph):
            loomnb.copy_blocks(kvs, [], m)


def test_copy_blocks_on_a_side_stream_and_torch_compile():
    rng = np.random.default_rng(2)
    kvs = caches(2, 32, Hk=2, D=64)
    m = pairs(rng, 6, 32)
    want = [host(kv) for kv in kvs]
    loomnb.oracle.copy_blocks(want, [], m)
    s = torch.cuda.Stream()
    md = torch.from_numpy(m).cuda()
    torch.cuda.synchronize()
    loomnb.copy_blocks(kvs, [], md, stream=s)
    s.synchronize()
    for kv, w in zip(kvs, want):
        same(kv, w, "stream=")

    def f(kv0, kv1, mapping):
        loomnb.copy_blocks([kv0, kv1], [], mapping)
        return kv0.sum()

    torch._dynamo.reset()
    m2 = pairs(rng, 4, 32)
    want = [host(kv) for kv in kvs]
    loomnb.oracle.copy_blocks(want, [], m2)
    torch.compile(f, fullgraph=True)(kvs[0], kvs[1], torch.from_numpy(m2).cuda())
    for kv, w in zip(kvs, want):
        same(kv, w, "torch.compile")


def test_copy_blocks_check_indices_is_a_device_assert():
    assert_device_assert(
        "import torch, loomnb\n"
        "kv = torch.zeros(4, 2, 16, 1, 64, dtype=torch.bfloat16, device='cuda')\n"
        "loomnb.copy_blocks([kv], [], torch.tensor([[0, 9]], device='cuda'), check_indices=True)\n"
        "torch.cuda.synchronize()\n",
        "loomnb.copy_blocks: argument 'block_mapping'")


# ------------------------------------------------------------------------------ swap_blocks
@pytest.mark.parametrize("block", [(16, 8, 128), (16, 4, 128), (16, 1, 64)])
def test_swap_blocks_pinned_host_both_ways(block):
    rng = np.random.default_rng(3)
    gpu = caches(1, 300, bs=block[0], Hk=block[1], D=block[2])[0]
    cpu = torch.zeros((200,) + tuple(gpu.shape[1:]), dtype=gpu.dtype).pin_memory()
    n = gpu[0].numel() * gpu.element_size()
    out_m = np.stack([rng.permutation(300)[:150], rng.permutation(200)[:150]], 1)
    want = host(cpu).copy()
    loomnb.oracle.swap_blocks(host(gpu), want, n, out_m)
    loomnb.swap_blocks(gpu, cpu, n, torch.from_numpy(out_m))  # swap out, CPU mapping
    torch.cuda.synchronize()
    same(cpu, want, "swap out")
    back = torch.zeros_like(gpu)
    in_m = np.stack([out_m[:, 1], rng.permutation(300)[:150]], 1)
    want = host(back)
    loomnb.oracle.swap_blocks(host(cpu), want, n, in_m)
    loomnb.swap_blocks(cpu, back, n, torch.from_numpy(in_m).cuda())  # swap in, GPU mapping
    torch.cuda.synchronize()
    same(back, want, "swap in")


def test_swap_blocks_rejects_pageable_and_two_host_pools():
    gpu = torch.zeros(4, 16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(loomnb.LoomnbValueError, match="'dst' must be a CUDA tensor or pinned"):
        loomnb.swap_blocks(gpu, torch.zeros(4, 16, dtype=torch.bfloat16), 32,
                           torch.zeros(1, 2, dtype=torch.int64))
    pin = torch.zeros(4, 16, dtype=torch.bfloat16).pin_memory()
    with pytest.raises(loomnb.LoomnbValueError, match="'src' must be a CUDA array"):
        loomnb.swap_blocks(pin, pin.clone().pin_memory(), 32, torch.zeros(1, 2, dtype=torch.int64))


# ------------------------------------------------------------------------------ compact_blocks
@pytest.mark.parametrize("nb, layers", [(2048, 1), (700, 8)])
def test_compact_blocks_large(nb, layers):
    rng = np.random.default_rng(4)
    kvs = caches(layers, nb, Hk=8 if layers == 1 else 2, D=128 if layers == 1 else 64)
    views = [c for kv in kvs for c in pk.kv_views(kv, "interleaved_nhd")]
    perm = rng.permutation(nb).astype(np.int64)
    want = [host(kv) for kv in kvs]
    loomnb.oracle.compact_blocks(want, perm)
    loomnb.compact_blocks(views, torch.from_numpy(perm))
    torch.cuda.synchronize()
    for kv, w in zip(kvs, want):
        same(kv, w, f"compact {nb}")


# ------------------------------------------------------------------------------ gather_cache
@pytest.mark.parametrize("kv, dtype", [("auto", torch.bfloat16), ("fp8", torch.bfloat16),
                                       ("fp8_e5m2", torch.float16), ("fp8", torch.float32),
                                       ("auto", torch.float32)])
@pytest.mark.parametrize("layout", ["interleaved_nhd", "interleaved_hnd"])
def test_gather_cache_serving_sizes(kv, dtype, layout):
    rng = np.random.default_rng(5)
    cdt = dtype if kv == "auto" else torch.uint8
    kvc = caches(1, 400, layout, cdt, Hk=8, D=128)[0]
    src = pk.kv_views(kvc, layout)[0]
    lens = rng.integers(0, 300, 24)
    starts = rng.integers(0, 40, 24).astype(np.int32)
    bt = rng.integers(0, 400, (24, 22)).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    dst = torch.zeros((int(cu[-1]) + 5, 8, 128), dtype=dtype, device="cuda")
    scale = torch.tensor([0.3], device="cuda")
    want = host(dst)
    loomnb.oracle.gather_cache(host(src), want, bt, cu, kv, np.array([0.3], np.float32), starts)
    loomnb.gather_cache(src, dst, torch.from_numpy(bt).cuda(), torch.from_numpy(cu).cuda(), kv,
                        scale, torch.from_numpy(starts).cuda())
    got = host(dst)
    if dtype == torch.float32 and kv != "auto":
        got, want = np.nan_to_num(got, nan=0.5), np.nan_to_num(want, nan=0.5)
    same(got, want, f"{kv} {dtype} {layout}")


def test_gather_cache_mla_latent_and_graph_capture():
    rng = np.random.default_rng(6)
    src = torch.randn(256, 16, 576, device="cuda").to(torch.bfloat16)
    lens = np.array([100, 3, 900, 0, 40])
    bt = torch.from_numpy(rng.integers(0, 256, (5, 64)).astype(np.int32)).cuda()
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)).cuda()
    dst = torch.zeros(2048, 576, dtype=torch.bfloat16, device="cuda")
    loomnb.gather_cache(src, dst, bt, cu)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loomnb.gather_cache(src, dst, bt, cu)
    new = np.array([7, 1000, 0, 1, 30])
    cu.copy_(torch.from_numpy(np.concatenate([[0], np.cumsum(new)]).astype(np.int32)))
    dst.zero_()
    graph.replay()
    want = np.zeros((2048, 576), BF16)
    loomnb.oracle.gather_cache(host(src), want, host(bt), host(cu))
    same(dst, want, "replayed with new lengths")


# ------------------------------------------------------------------------------ MLA
@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("T", [1, 37, 4096])
def test_concat_and_cache_mla_vllm_widths(kv, T):
    rng = np.random.default_rng(7)
    nb, B = 300, 16
    proj = torch.randn(T, 512 + 64 + 1536, device="cuda").to(torch.bfloat16) * 3
    kv_c, k_pe = proj[:, :512], proj[:, 512:576].unsqueeze(1)
    cache = torch.zeros(nb, B, 576, dtype=torch.bfloat16 if kv == "auto" else torch.uint8,
                        device="cuda")
    slots = rng.permutation(nb * B)[:T].astype(np.int64)
    slots[rng.random(T) < 0.1] = -1
    scale = torch.tensor([0.05], device="cuda")
    want = host(cache)
    loomnb.oracle.concat_and_cache_mla(host(kv_c), host(k_pe), want, slots, kv,
                                       np.array([0.05], np.float32))
    loomnb.concat_and_cache_mla(kv_c, k_pe, cache, torch.from_numpy(slots).cuda(), kv, scale)
    same(cache, want, f"{kv} T={T}")
