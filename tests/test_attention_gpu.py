"""Paged decode attention and merge_attn_states on a real GPU, against the float64 oracle: the
issue's context ladder (1 .. 16384 tokens, shuffled non-contiguous blocks, stale table entries,
NaN in every slot no visible token owns) on Llama-3-8B's 32/8/128 and SmolLM2's 9/3/64, every
dtype pair, layout (16-byte and element loads), GQA ratio, head size and block size, split-K
at real split counts, sliding window, softcap, per-head FP8 scales, 64-bit offsets, and the
GPU-only paths the simulator cannot check: warp shuffles (strided group reductions), the
hardware E4M3 pair decode, 16-byte loads, partial warps, block sizes up to 1024 threads, CUDA
graphs, the two-launch fast-path replay, streams, torch.compile and no recompilation.

``test_memcheck_small_shapes`` is the set to run under ``compute-sanitizer --tool memcheck``.
Skipped, with that reason, on machines without a CUDA GPU.
"""

import os

import numpy as np
import pytest

from helpers import assert_device_assert
from test_attention_cases import (assert_attention, assert_merge, check_strided_reductions, exact,
                                  make_case, op_args, to_numpy, to_torch)

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import loomnb  # noqa: E402
from loomnb.ops import _launch as L  # noqa: E402
from loomnb.ops import attention as A  # noqa: E402

LADDER = [1, 15, 16, 17, 511, 512, 513, 4096, 16384]
GEOMETRIES = {"32/8/128": (32, 8, 128), "9/3/64": (9, 3, 64)}
KIND = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def run(case_t, **options):
    args, kw = op_args(case_t, **options)
    return loomnb.paged_decode_attention(*args, **kw)


def check(case, what, **options):
    """Run on the GPU (torch tensors, same strides) and compare with the float64 oracle."""
    t = to_torch(case)
    out, lse = run(t, return_lse=True, **options)
    torch.cuda.synchronize()
    assert out.dtype == t["query"].dtype and out.device == t["query"].device
    assert lse.shape == (t["query"].shape[1], t["query"].shape[0]) and lse.dtype == torch.float32
    o, l_, vmax = exact(case, **options)
    assert_attention(to_numpy(out), o, vmax, KIND[out.dtype], what, to_numpy(lse), l_)
    return t, out, lse


# ---------------------------------------------------------------- the ladder
@pytest.mark.parametrize("kind, cache", [("bf16", "auto"), ("f16", "auto"), ("f32", "auto"),
                                         ("bf16", "fp8")])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_context_ladder(geometry, kind, cache):
    """All nine ladder contexts in one batch (each split differently on the device), block 16."""
    hq, hk, d = GEOMETRIES[geometry]
    case = make_case(1, seq_lens=LADDER, num_heads=hq, num_kv_heads=hk, head_size=d,
                     block_size=16, kind=kind, cache=cache)
    t, _, _ = check(case, f"{geometry} {kind}/{cache}")
    assert A.layout(t["query"], t["key_cache"], t["value_cache"], t["kv_cache_dtype"]) == "vec"


@pytest.mark.parametrize("seq_len", [1, 17, 513, 4096, 16384])
def test_each_ladder_context_alone(seq_len):
    """One sequence of each ladder length, 32/8/128: the split count the rule picks for a batch
    of one (up to 64 splits)."""
    case = make_case(2 + seq_len, seq_lens=[seq_len], num_heads=32, num_kv_heads=8, head_size=128)
    check(case, f"L={seq_len}")


@pytest.mark.parametrize("layout", ["hnd", "split", "legacy", "offset"])
@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_layouts(layout, cache):
    case = make_case(3, seq_lens=[1, 17, 513, 1000], num_heads=32, num_kv_heads=8, head_size=128,
                     cache=cache, layout=layout)
    want = "scalar" if layout in ("legacy", "offset") else "vec"
    t, _, _ = check(case, f"{layout}/{cache}")
    assert A.layout(t["query"], t["key_cache"], t["value_cache"], t["kv_cache_dtype"]) == want


@pytest.mark.parametrize("max_gc", [None, 1, 2, 4])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (12, 4), (16, 4), (28, 4), (64, 8), (16, 1)])
def test_gqa_ratios(num_heads, num_kv_heads, max_gc, monkeypatch):
    """Group sizes 1, 3, 4, 7, 8, 16, at every heads-per-CTA bound (None: the rule's)."""
    monkeypatch.setattr(A, "MAX_HEADS_PER_CTA", max_gc)
    case = make_case(4, seq_lens=[33, 700], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=128)
    check(case, f"{num_heads}/{num_kv_heads}")


@pytest.mark.parametrize("head_size", [19, 40, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_head_and_block_sizes(head_size, block_size):
    case = make_case(5, seq_lens=[3, 64, 300], num_heads=8, num_kv_heads=2, head_size=head_size,
                     block_size=block_size)
    check(case, f"D={head_size} B={block_size}")


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
def test_fp8_cache_per_head_scales_every_query_dtype(kind):
    case = make_case(6, seq_lens=[5, 1500], num_heads=12, num_kv_heads=4, head_size=128,
                     kind=kind, cache="fp8", per_head_scales=True)
    check(case, f"fp8 {kind}")


def test_block_size_not_a_power_of_two_and_sliding_window_and_softcap():
    case = make_case(7, seq_lens=[40, 1000, 3], num_heads=8, num_kv_heads=2, head_size=64,
                     block_size=3)
    check(case, "block 3")
    check(case, "window 100", sliding_window=100)
    check(case, "window 1", sliding_window=1)
    q = case["query"].astype(np.float32) * 6
    case["query"] = q.astype(case["query"].dtype)
    check(case, "softcap 30", softcap=30.0)
    check(case, "softcap 30 + window", softcap=30.0, sliding_window=257)


def test_q_zero_is_the_mean_of_the_valid_values_and_nan_past_seq_len_never_leaks():
    """The issue's case on the GPU: seq_len not a multiple of the block size, q = 0, NaN in
    every slot past seq_len and in every block a stale entry names."""
    case = make_case(8, seq_lens=[19, 1001, 5], num_heads=9, num_kv_heads=3, head_size=64,
                     q_zero=True)
    _, out, _ = check(case, "q = 0")
    o = to_numpy(out).astype(np.float64)
    assert np.isfinite(o).all()
    for s, n in enumerate(case["seq_lens"]):
        j = np.arange(n)
        v = case["value_cache"][case["block_tables"][s, j // 16], j % 16].astype(np.float64)
        np.testing.assert_allclose(o[s].reshape(3, 3, 64), np.repeat(v.mean(axis=0)[:, None], 3, axis=1),
                                   rtol=2 ** -7, atol=1e-6)


def test_seq_len_past_the_table_is_clamped_and_zero_is_empty():
    case = make_case(9, seq_lens=[32, 0], num_heads=4, num_kv_heads=1, head_size=64, extra_cols=0)
    t = to_torch(case)
    ref, ref_lse = run(t, return_lse=True)
    t["seq_lens"] = torch.tensor([10 ** 6, 0], dtype=torch.int32, device="cuda")
    out, lse = run(t, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert (out[1] == 0).all() and torch.isneginf(lse[:, 1]).all()


def test_split_counts_and_the_max_seq_len_hint():
    """The same batch at 1, the rule's and 64 splits (max_seq_len hints): all within the
    tolerance of the oracle; a wrong hint is only slower."""
    case = make_case(10, seq_lens=[4000, 100], num_heads=8, num_kv_heads=2, head_size=128)
    assert A.num_splits(2, 2, 1, case["block_tables"].shape[1] * 16) > 1
    for hint in (None, 0, 100, 4000, 10 ** 6):
        check(case, f"hint {hint}", max_seq_len=hint)


def test_split_merge_by_the_last_cta_is_deterministic_and_leaves_the_counters_at_zero():
    """SmolLM2 at 2 x 2048 and 1 x 16384 tokens (16 and 64 splits): the last split CTA of each
    (sequence, KV head, head chunk) merges the splits in split order, so 50 launches, whichever
    CTA finishes last, give the same bits; within the tolerance of the oracle; and every split
    counter is 0 afterwards (``conftest``'s check, after every test)."""
    for seed, lens in ((40, [2048, 2048]), (41, [16384])):
        case = make_case(seed, seq_lens=lens, num_heads=9, num_kv_heads=3, head_size=64)
        assert A.num_splits(len(lens), 3, 3, lens[0]) > 1
        t, out, lse = check(case, f"{lens}")
        for _ in range(50):
            o2, l2 = run(t, return_lse=True)
            assert torch.equal(o2, out) and torch.equal(l2, lse)


@pytest.mark.parametrize("threads", [32, 64, 96, 128, 160, 256, 1024])
def test_block_size_sweep(threads):
    """Correctness does not depend on the CTA size: one warp .. 8 (96: three warps; 160: two
    rounds of the cross-warp merge). A forced size above 256 is capped at 256 (the kernel holds
    ~200 registers a thread: 1024 threads could not launch)."""
    case = make_case(11, seq_lens=[7, 900, 3000], num_heads=9, num_kv_heads=3, head_size=64)
    t = to_torch(case)
    with L.force_threads(threads):
        out, lse = run(t, return_lse=True)
    o, l_, vmax = exact(case)
    assert_attention(to_numpy(out), o, vmax, "bf16", f"threads={threads}", to_numpy(lse), l_)


def test_64bit_offsets():
    """A 4.3 GB bf16 cache (more than 2^31 elements): blocks past element 2^31 read the same as
    the same rows copied into a small cache."""
    num_blocks, bs, hk, d = 2 ** 31 // (16 * 8 * 128) + 64, 16, 8, 128
    big = torch.empty(num_blocks, 2, bs, hk, d, dtype=torch.bfloat16, device="cuda")
    small_case = make_case(12, seq_lens=[100, 37], num_heads=32, num_kv_heads=8, head_size=128)
    t = to_torch(small_case)
    bt_far = t["block_tables"].clone()
    for s, n in ((0, 7), (1, 3)):  # the blocks each sequence uses, moved to the end of `big`
        used = t["block_tables"][s, :n].long()
        far = torch.arange(num_blocks - 10 + 7 * s, num_blocks - 10 + 7 * s + n, device="cuda")
        big[far, 0] = t["key_cache"][used]
        big[far, 1] = t["value_cache"][used]
        bt_far[s, :n] = far.int()
    assert bt_far[0, 6].item() * 2 * bs * hk * d > 2 ** 32, "element offsets past 2^32"
    want = run(t)
    got = loomnb.paged_decode_attention(t["query"], big[:, 0], big[:, 1], bt_far, t["seq_lens"],
                                        t["scale"])
    assert torch.equal(got, want)
    del big
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- GPU-only primitives
def test_unpack_e4m3x2_hardware_equals_portable_all_pairs():
    """``cvt.rn.f16x2.e4m3x2`` + ``cvt.f32.f16`` (the kernels' FP8 decode) equals the portable
    decode for all 65536 code pairs, byte order included; NaN codes decode to NaN."""
    from numba import cuda

    from loomnb.layouts.dtypes import e4m3_to_f32, unpack_e4m3x2

    @cuda.jit
    def k(out):
        i = cuda.grid(1)
        if i < 65536:
            a, b = unpack_e4m3x2(i)
            out[i, 0] = a
            out[i, 1] = b
            out[i, 2] = e4m3_to_f32(i & 0xFF)
            out[i, 3] = e4m3_to_f32(i >> 8)

    d = cuda.device_array((65536, 4), np.float32)
    k[256, 256](d)
    o = d.copy_to_host()
    for hw, pt, name in ((0, 2, "lo"), (1, 3, "hi")):
        nan = np.isnan(o[:, pt])
        assert np.array_equal(np.isnan(o[:, hw]), nan), name
        assert np.array_equal(o[~nan, hw].view(np.uint32), o[~nan, pt].view(np.uint32)), name


@pytest.mark.parametrize("width, stride", [(4, 1), (8, 1), (16, 1), (8, 4), (4, 8), (2, 16)])
def test_strided_group_reductions_shuffles(width, stride):
    check_strided_reductions(width, stride, threads=128)


# ---------------------------------------------------------------- launch machinery
def _capture(fn):
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g, stream=side):
        res = fn()
    return g, res


@pytest.mark.parametrize("seq_lens", [[30, 5], [3000, 20]])
def test_cuda_graph_capture_and_replay(seq_lens):
    """One launch (short) and the split pass + merge (long): captured, then new query, caches
    contents and seq_lens written into the static tensors, replayed: equal to the eager result."""
    case = make_case(13, seq_lens=seq_lens, num_heads=32, num_kv_heads=8, head_size=128,
                     extra_cols=4)
    t = to_torch(case)
    out = torch.empty_like(t["query"])
    lse = torch.empty(32, 2, device="cuda")
    g, _ = _capture(lambda: run(t, out=out, lse=lse))
    t["query"].copy_(torch.randn_like(t["query"], dtype=torch.float32).to(t["query"].dtype))
    t["seq_lens"].copy_(torch.tensor([s - 1 for s in seq_lens], dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    case2 = dict(case, query=to_numpy(t["query"]), seq_lens=to_numpy(t["seq_lens"]))
    o, l_, vmax = exact(case2)
    assert_attention(to_numpy(out), o, vmax, "bf16", "graph replay", to_numpy(lse), l_)
    eager, eager_lse = run(t, return_lse=True)
    assert torch.equal(eager, out) and torch.equal(eager_lse, lse)


@pytest.mark.parametrize("seq_lens", [[30, 5], [3000, 20]])
def test_eager_fast_path_replays_every_launch(seq_lens):
    """A repeated call replays the remembered launches (two for a split call whose merge is a
    second launch) with new allocations of out, lse and the workspace; a new shape is
    validated again."""
    case = make_case(14, seq_lens=seq_lens, num_heads=32, num_kv_heads=8, head_size=128)
    t = to_torch(case)
    loomnb.ops.clear_launch_cache()
    first = run(t, return_lse=True)
    info = loomnb.ops.launch_cache_info()
    outs = [run(t, return_lse=True) for _ in range(3)]
    assert loomnb.ops.launch_cache_info() == info, "replayed, nothing new remembered"
    assert len({o.data_ptr() for o, _ in outs}) == 3 and len({l_.data_ptr() for _, l_ in outs}) == 3
    torch.cuda.synchronize()
    for o, l_ in outs:
        assert torch.equal(o, first[0]) and torch.equal(l_, first[1])
    only_out = run(t)
    assert torch.equal(only_out, first[0])
    with pytest.raises(loomnb.LoomnbValueError, match="argument 'out' must be of shape"):
        run(t, out=torch.empty(1, 32, 128, dtype=torch.bfloat16, device="cuda"))


def test_explicit_stream_and_torch_compile():
    case = make_case(15, seq_lens=[700, 9], num_heads=9, num_kv_heads=3, head_size=64)
    t = to_torch(case)
    want = run(t)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    args, kw = op_args(t)
    got = loomnb.paged_decode_attention(*args, **kw, stream=s)
    s.synchronize()
    assert torch.equal(got, want)

    def f(q, kc, vc, bt, sl):
        o, lse = loomnb.paged_decode_attention(q * 1, kc, vc, bt, sl, t["scale"], return_lse=True)
        return o.float() + 1, lse

    c = torch.compile(f)
    o1, l1 = c(*args[:5])
    o2, l2 = f(*args[:5])
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.parametrize("seq_lens, window", [([30, 5, 0], None), ([3000, 20], None), ([700, 9], 100)])
def test_check_indices_on_valid_indices_same_result_no_sync_no_replay(seq_lens, window):
    """check_indices=True on a valid batch (stale garbage past each seq_len, -7 and 2**30; with
    a window, a bad block before it): the same bits as the unchecked call (split-K included),
    no host synchronisation (torch's sync debug mode raises on one), never remembered for
    replay, and inside torch.compile too."""
    case = make_case(17, seq_lens=seq_lens, num_heads=8, num_kv_heads=2, head_size=64)
    if window:
        case["block_tables"][0, 0] = -3  # tokens 0-15 of 700: outside the window of 100
    t = to_torch(case)
    opts = {} if window is None else {"sliding_window": window}
    want = run(t, return_lse=True, **opts)
    loomnb.ops.clear_launch_cache()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [run(t, return_lse=True, check_indices=True, **opts) for _ in range(2)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert loomnb.ops.launch_cache_info()["size"] == 0, "a checked call is never remembered"
    for o, l_ in got:
        assert torch.equal(o, want[0]) and torch.equal(l_, want[1])
    args, kw = op_args(t, check_indices=True, **opts)
    compiled = torch.compile(lambda *a: loomnb.paged_decode_attention(*a, **kw))(*args)
    assert torch.equal(compiled, want[0])


BAD_DECODE = {  # case: (block_tables, seq_lens, the argument the assert names)
    "block past the cache": ("[[0, 5]]", "[6]", "block_tables"),  # tokens 4-5: column 1, block 5 of 2
    "negative block": ("[[-1, 1]]", "[2]", "block_tables"),
    "seq_len past the table": ("[[0, 1]]", "[9]", "seq_lens"),    # 2 columns of 4 tokens
    "negative seq_len": ("[[0, 1]]", "[-1]", "seq_lens"),
}


@pytest.mark.parametrize("case", list(BAD_DECODE))
def test_check_indices_fires_the_device_assert_on_a_bad_index(case):
    """An out-of-range block number in a column a sequence reads, or a seq_len outside the
    table, with check_indices=True: a device-side assert naming the argument (in a subprocess:
    it ends the CUDA context); the decode kernel queued after it does not run."""
    bt, sl, name = BAD_DECODE[case]
    code = ("import torch, loomnb\n"
            "q = torch.ones(1, 2, 16, dtype=torch.bfloat16, device='cuda')\n"
            "kv = torch.ones(2, 2, 4, 1, 16, dtype=torch.bfloat16, device='cuda')\n"
            f"bt = torch.tensor({bt}, dtype=torch.int32, device='cuda')\n"
            f"sl = torch.tensor({sl}, dtype=torch.int32, device='cuda')\n"
            "loomnb.paged_decode_attention(q, kv[:, 0], kv[:, 1], bt, sl, 0.25, check_indices=True)\n"
            "torch.cuda.synchronize()\n")
    assert_device_assert(code, f"loomnb.paged_decode_attention: argument '{name}' must be")


def test_new_batch_or_context_does_not_recompile():
    t = to_torch(make_case(16, seq_lens=[50, 3], num_heads=9, num_kv_heads=3, head_size=64))
    run(t)
    before = {k: len(v._handles) for k, v in L._kernels.items()}
    for seed, lens in ((17, [1, 2, 3]), (18, [4000]), (19, [77] * 9)):
        c = make_case(seed, seq_lens=lens, num_heads=9, num_kv_heads=3, head_size=64)
        tt = to_torch(c)
        out, lse = run(tt, return_lse=True)
        o, l_, vmax = exact(c)
        assert_attention(to_numpy(out), o, vmax, "bf16", str(lens), to_numpy(lse), l_)
    new = {k for k in L._kernels if k not in before}
    assert all(k[0].__name__ == "split_merge_kernel" for k in new), "only the merge may be new"
    assert all(len(L._kernels[k]._handles) == n for k, n in before.items())


# ---------------------------------------------------------------- merge_attn_states
def _states(n, h, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = torch.randn(n, h, d, generator=g, device="cuda").to(dtype)
    s = torch.randn(n, h, d, generator=g, device="cuda").to(dtype)
    pl = torch.randn(h, n, generator=g, device="cuda") * 3
    sl = torch.randn(h, n, generator=g, device="cuda") * 3
    return p, pl, s, sl


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n, d", [(1, 128), (37, 64), (1000, 80)])
def test_merge_attn_states(dtype, n, d):
    p, pl, s, sl = _states(n, 8, d, dtype)
    pl[0, 0] = sl[0, 0] = -float("inf")
    pl[1, 0], sl[1, 0] = float("inf"), -float("inf")
    sl[2, 0] = -float("inf")
    out, olse = torch.empty_like(p), torch.empty(8, n, device="cuda")
    assert loomnb.merge_attn_states(out, p, pl, s, sl, olse) is out
    torch.cuda.synchronize()
    args = [to_numpy(a) for a in (p, pl, s, sl)]
    assert_merge(to_numpy(out), to_numpy(olse), args[0], args[1], args[2], args[3],
                 KIND[dtype], str(dtype))
    assert torch.equal(out[0, 0], p[0, 0]) and torch.equal(out[0, 1], p[0, 1])
    assert not torch.isnan(out).any()


def test_merge_attn_states_against_vllm_if_available():
    """With ``$LOOMNB_VLLM_LIB`` (vLLM 0.24's ``_C`` library): vLLM's CUDA op on the same
    inputs is within the same tolerance of the oracle, rows with both LSEs -inf are bit-equal,
    and the fraction of bit-equal outputs is printed (expected: all, same libdevice functions)."""
    lib = os.environ.get("LOOMNB_VLLM_LIB")
    if not lib:
        pytest.skip("LOOMNB_VLLM_LIB is not set (vLLM 0.24's _C library)")
    torch.ops.load_library(lib)
    p, pl, s, sl = _states(300, 32, 128, torch.bfloat16, seed=3)
    pl[0, :5] = sl[0, :5] = -float("inf")
    mine, mine_lse = torch.empty_like(p), torch.empty(32, 300, device="cuda")
    theirs, theirs_lse = torch.empty_like(p), torch.empty(32, 300, device="cuda")
    loomnb.merge_attn_states(mine, p, pl, s, sl, mine_lse)
    op = torch.ops._C.merge_attn_states
    values = {"output": theirs, "output_lse": theirs_lse, "prefix_output": p, "prefix_lse": pl,
              "suffix_output": s, "suffix_lse": sl}
    kwargs = {a.name: values.get(a.name) for a in op.default._schema.arguments
              if a.name in values or not a.has_default_value()}
    op(**kwargs)  # bound by the schema's names (0.24: output, output_lse, prefix_..., suffix_...)
    torch.cuda.synchronize()
    args = [to_numpy(a) for a in (p, pl, s, sl)]
    assert_merge(to_numpy(theirs), to_numpy(theirs_lse), *args, "bf16", "vLLM")
    same = (mine.view(torch.int16) == theirs.view(torch.int16)).float().mean().item()
    print(f"merge_attn_states: {same:.6f} of bf16 outputs bit-equal to vLLM 0.24")
    assert torch.equal(mine[:5, 0], theirs[:5, 0])


def test_decode_partials_merge_into_the_whole():
    """decode over [0, a) and over [a, L) (a window of L - a), merged with merge_attn_states,
    equals decode over [0, L) within the tolerance."""
    case = make_case(20, seq_lens=[2000], num_heads=32, num_kv_heads=8, head_size=128, kind="f32")
    t = to_torch(case)
    pre = dict(t, seq_lens=torch.tensor([1200], dtype=torch.int32, device="cuda"))
    o1, l1 = run(pre, return_lse=True)
    o2, l2 = run(t, return_lse=True, sliding_window=800)
    out, olse = torch.empty_like(o1), torch.empty_like(l1)
    loomnb.merge_attn_states(out, o1, l1, o2, l2, olse)
    o, l_, vmax = exact(case)
    assert_attention(to_numpy(out), o, vmax, "f32", "merged halves", to_numpy(olse), l_)


# ---------------------------------------------------------------- compute-sanitizer set
def test_memcheck_small_shapes():
    """Small shapes through every path (run under compute-sanitizer --tool memcheck): both load
    paths, FP8, splits, a 5-D key, head sizes of every lane count, partial warps."""
    cases = [make_case(21, seq_lens=[17, 1, 0], num_heads=4, num_kv_heads=2, head_size=64),
             make_case(22, seq_lens=[600, 3], num_heads=9, num_kv_heads=3, head_size=64, cache="fp8"),
             make_case(23, seq_lens=[40], num_heads=8, num_kv_heads=1, head_size=256, layout="legacy"),
             make_case(24, seq_lens=[33, 2], num_heads=7, num_kv_heads=1, head_size=80, layout="offset"),
             make_case(25, seq_lens=[300], num_heads=2, num_kv_heads=2, head_size=19, block_size=3)]
    for i, c in enumerate(cases):
        for threads in (32, 128):
            with L.force_threads(threads):
                t = to_torch(c)
                out, lse = run(t, return_lse=True)
                torch.cuda.synchronize()
            o, l_, vmax = exact(c)
            assert_attention(to_numpy(out), o, vmax, KIND[out.dtype], f"case {i}", to_numpy(lse), l_)
    p, pl, s, sl = _states(5, 3, 24, torch.float16)
    out = torch.empty_like(p)
    loomnb.merge_attn_states(out, p, pl, s, sl)
    torch.cuda.synchronize()


def test_registers_fit_and_nothing_spills():
    """The decode kernels' register arrays (query and accumulator of 4 heads x 16 elements,
    a tile of keys and values) stay in registers after ptxas too: no local memory per thread,
    and 256 threads (the CTA cap) can launch. A spill would cost bandwidth, not correctness."""
    for seed, (hq, hk, d, cache) in enumerate([(32, 8, 128, "auto"), (9, 3, 64, "auto"),
                                               (32, 8, 128, "fp8"), (8, 1, 256, "auto")]):
        run(to_torch(make_case(30 + seed, seq_lens=[40], num_heads=hq, num_kv_heads=hk,
                               head_size=d, cache=cache)))
    seen = []
    for (factory, spec, sig), k in L._kernels.items():
        if factory.__name__ != "decode_kernel":
            continue
        compiled = k.dispatcher.overloads[sig]  # keyed by the argument types (a tuple)
        regs, local = compiled.regs_per_thread, compiled.local_mem_per_thread
        seen.append(f"{spec}: {regs} registers, {local} B local")
        assert regs * A.MAX_DECODE_THREADS <= 65536, seen[-1]
        assert local == 0, f"spills: {seen[-1]}"
    assert len(seen) >= 4, seen
    print("\n".join(seen))
