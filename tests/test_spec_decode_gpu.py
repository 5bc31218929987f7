"""Speculative verification on a real GPU: what the simulator cannot check.

Warp shuffles (group minimum, prefix sums, block argmax), 16-byte loads and the split argmax
over real vocabularies (49,152 and 151,936 columns; fp32, bf16, fp16), partial groups, every
batch of the ragged table (1 to 256 requests, draft counts 0..max_spec_len mixed) bit for bit
against the oracle, ``torch.argmax``'s int64 output as ``target_argmax``, the launch
configuration sweep, CUDA-graph capture of the two-launch fused op, the eager fast path,
torch.compile and no recompilation for new batch sizes.

Skipped, with that reason, on machines without a CUDA GPU (CI's CPU machine).
"""

import ml_dtypes
import numpy as np
import pytest

from test_spec_decode_oracle import RAGGED, make_batch, ragged_counts, vllm_rule

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import loomnb  # noqa: E402
from loomnb.ops import _launch as L  # noqa: E402
from loomnb.ops import spec_decode as S  # noqa: E402

NAMES = ("output_token_ids", "num_emitted", "emitted_token_ids", "cu_num_emitted")


def dev(a):
    """NumPy -> CUDA tensor with the same bits (bf16 via its int16 pattern)."""
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def host(t):
    return t.detach().cpu().numpy()


def on_gpu(b):
    return {k: dev(v) if isinstance(v, np.ndarray) else v for k, v in b.items()}


def check_fused(b, what, **kw):
    """Run greedy_verify on the GPU copy of batch ``b``; compare all four outputs bit for bit."""
    g = on_gpu(b)
    got = loomnb.greedy_verify(g["draft_token_ids"], g["cu_num_draft_tokens"], g["target_logits"],
                               g["bonus_token_ids"], b["max_spec_len"], **kw)
    want = loomnb.oracle.greedy_verify(b["draft_token_ids"], b["cu_num_draft_tokens"],
                                       b["target_logits"], b["bonus_token_ids"], b["max_spec_len"], **kw)
    for t, w, name in zip(got, want, NAMES):
        assert t.dtype == torch.int32 and t.is_cuda, name
        diff = host(t) != w
        assert not diff.any(), f"{what}: {name}: {int(diff.sum())} of {diff.size} differ, first at {np.argwhere(diff)[:3].tolist()}"
    return got


def check_unfused(b, what, target=None):
    g = on_gpu(b)
    target = g["target_argmax"] if target is None else target
    got = loomnb.rejection_greedy_sample(g["draft_token_ids"], g["cu_num_draft_tokens"], target,
                                         g["bonus_token_ids"], b["max_spec_len"])
    args = (b["draft_token_ids"], b["cu_num_draft_tokens"], host(target), b["bonus_token_ids"],
            b["max_spec_len"])
    want = loomnb.oracle.rejection_greedy_sample(*args)
    assert got.dtype == torch.int32
    diff = host(got) != want
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.size} differ, first at {np.argwhere(diff)[:3].tolist()}"
    assert np.array_equal(host(got), vllm_rule(*args)), f"{what}: vLLM's loop"
    return got


# ---------------------------------------------------------------- the case
def test_case_placeholder_draft():
    d, cu = dev(np.array([5, 9, -1], np.int32)), dev(np.array([3], np.int32))
    bonus = dev(np.array([[4]], np.int32))
    assert loomnb.rejection_greedy_sample(d, cu, dev(np.array([5, 9, 7])), bonus, 3).tolist() == [[5, 9, 7, -1]]
    logits = torch.zeros(3, 49152, device="cuda")
    logits[[0, 1, 2], [5, 9, 7]] = 1.0
    rows, num, emitted, cu_out = loomnb.greedy_verify(d, cu, logits, bonus, 3)
    assert rows.tolist() == [[5, 9, 7, -1]] and num.tolist() == [3]
    assert emitted.tolist() == [5, 9, 7, -1] and cu_out.tolist() == [0, 3]


# ---------------------------------------------------------------- ragged batches, every size
@pytest.mark.parametrize("num_reqs, max_spec_len, pattern", RAGGED)
def test_ragged_batches_bit_exact(num_reqs, max_spec_len, pattern):
    """The 20 ragged shapes at batches 1, 8, 32, 128, 256: both ops vs the oracle (and vLLM's
    loop), with V = 1000 (16-byte loads) and 1003 (scalar path) on alternate shapes, and
    ``torch.argmax``'s int64 result used directly as ``target_argmax``."""
    i = RAGGED.index((num_reqs, max_spec_len, pattern))
    rng = np.random.default_rng(i)
    b = make_batch(rng, ragged_counts(rng, num_reqs, max_spec_len, pattern), max_spec_len,
                   1000 if i % 2 == 0 else 1003)
    what = f"{num_reqs}x{max_spec_len} {pattern}"
    check_fused(b, what)
    target = torch.argmax(dev(b["target_logits"]), dim=-1)
    assert target.dtype == torch.int64 and np.array_equal(host(target), b["target_argmax"])
    check_unfused(b, what + " int64", target)
    check_unfused(b, what + " int32", target.to(torch.int32))


@pytest.mark.parametrize("vocab", [49152, 151936])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("num_reqs, max_spec_len", [(1, 1), (1, 4), (8, 4), (32, 8)])
def test_real_vocabularies(vocab, dtype, num_reqs, max_spec_len):
    """SmolLM2's and Qwen's vocabularies: few draft rows, so each row is split over many
    blocks (the merge of the argmax keys is what the simulator barely exercises)."""
    rng = np.random.default_rng(vocab + num_reqs)
    b = make_batch(rng, ragged_counts(rng, num_reqs, max_spec_len, "uniform"), max_spec_len, vocab,
                   logits_dtype=dtype)
    units = vocab // S.UNIT_ELEMS[{np.float32: "f32"}.get(dtype, "bf16")]
    assert S.argmax_config(len(b["draft_token_ids"]), units)[1] > 1, "split rows"
    check_fused(b, f"V={vocab} {np.dtype(dtype).name}")
    check_fused(b, "vocab_size", vocab_size=vocab - 1000)


@pytest.mark.parametrize("draft_kind, bonus_kind", [(np.int64, np.int64), (np.int32, np.int64),
                                                     (np.int64, np.int32)])
def test_int64_draft_and_bonus_ids(draft_kind, bonus_kind):
    """int64 draft and bonus ids (what vLLM's own tests pass), int64 targets from torch.argmax:
    both ops bit for bit against the oracle, across the ragged patterns of one batch."""
    rng = np.random.default_rng(640)
    b = make_batch(rng, ragged_counts(rng, 32, 8, "uniform"), 8, 49152)
    b["draft_token_ids"] = b["draft_token_ids"].astype(draft_kind)
    b["bonus_token_ids"] = b["bonus_token_ids"].astype(bonus_kind)
    check_unfused(b, f"{draft_kind.__name__}/{bonus_kind.__name__}")
    check_fused(b, f"{draft_kind.__name__}/{bonus_kind.__name__}")


def test_argmax_rules_across_chunks():
    """Ties, NaN, +-inf, -0.0 placed in different chunks of split rows of 151,936 fp32."""
    V = 151936
    x = np.full((7, V), -3.0, np.float32)
    x[0, [150000, 70, 80000]] = 2.0           # tie: 70
    x[1, [3, 151935]] = [np.inf, np.nan]      # NaN beats +inf, in the last chunk
    x[2, [100000, 140000]] = [np.nan, -np.nan]  # first NaN, whatever its sign
    x[3, :] = -np.inf                          # all -inf: 0
    x[4, [90000, 10]] = [0.0, -0.0]            # -0.0 == +0.0 -> 10
    x[5, 151935] = 1e30                        # the very last element
    x[6, [4096, 4095]] = [5.0, 5.0]            # a tie on a chunk/unit boundary
    want = [70, 151935, 100000, 0, 10, 151935, 4095]
    assert loomnb.oracle.spec_decode.target_argmax(x).tolist() == want
    for dtype in (np.float32, ml_dtypes.bfloat16):
        b = dict(draft_token_ids=np.array(want, np.int32), cu_num_draft_tokens=np.arange(1, 8, dtype=np.int32),
                 target_logits=x.astype(dtype), bonus_token_ids=np.full((7, 1), 2, np.int32),
                 max_spec_len=1)
        rows, *_ = check_fused(b, np.dtype(dtype).name)
        assert host(rows)[:, 0].tolist() == want and (host(rows)[:, 1] == 2).all()


def test_misaligned_and_strided_logits():
    """A logits view that starts 4 bytes off a 16-byte boundary takes the scalar path; the draft
    rows of a verification pass, ``logits.view(R, k+1, V)[:, :k]``, the vector path -- no copy."""
    rng = np.random.default_rng(3)
    R, k, V = 16, 4, 49152
    full = dev(rng.standard_normal((R * (k + 1), V + 4)).astype(np.float32))
    d = dev(rng.integers(0, V, R * k).astype(np.int32))
    cu = dev((np.arange(1, R + 1) * k).astype(np.int32))
    bonus = dev(rng.integers(0, V, (R, 1)).astype(np.int32))
    for view in (full[: R * k, 1: V + 1], full[:, :V].view(R, k + 1, V)[:, :k]):
        assert not view.is_contiguous()
        target = view.reshape(-1, V).argmax(-1)
        d2 = torch.where(torch.rand(R * k, device="cuda") < 0.7, target.to(torch.int32), d)
        got = loomnb.greedy_verify(d2, cu, view, bonus, k)
        want = loomnb.oracle.greedy_verify(host(d2), host(cu), host(view.contiguous()), host(bonus), k)
        for t, w, name in zip(got, want, NAMES):
            assert np.array_equal(host(t), w), name


@pytest.mark.parametrize("threads", [32, 64, 256, 1024])
def test_launch_configuration_sweep(threads):
    """Forced block sizes: groups per block, blocks per grid, rounds of the fused block
    (256 requests x 8 lanes over 32..1024 threads), argmax splits per row."""
    rng = np.random.default_rng(threads)
    b = make_batch(rng, ragged_counts(rng, 256, 16, "uniform"), 16, 4096)
    with L.force_threads(threads):
        check_fused(b, f"threads={threads}")
        check_unfused(b, f"threads={threads}")


def test_every_group_width_and_partial_groups():
    """max_spec_len 1..128 (4, 8, 16, 32 lanes); request counts that leave the last warp
    partly idle."""
    for i, spec_len in enumerate([1, 3, 7, 15, 16, 31, 32, 63, 64, 100, 127, 128]):
        rng = np.random.default_rng(i)
        b = make_batch(rng, ragged_counts(rng, 7 + 2 * i, spec_len, "uniform"), spec_len, 512,
                       accept=0.95)
        check_fused(b, f"max_spec_len={spec_len}")
        check_unfused(b, f"max_spec_len={spec_len}")


def test_empty_and_draftless_batches():
    e = torch.zeros(0, dtype=torch.int32, device="cuda")
    out = loomnb.rejection_greedy_sample(e, e, e, torch.zeros(0, 1, dtype=torch.int32, device="cuda"), 4)
    assert out.shape == (0, 5)
    rows, num, emitted, cu = loomnb.greedy_verify(e, e, torch.zeros(0, 8, device="cuda"),
                                                  torch.zeros(0, 1, dtype=torch.int32, device="cuda"), 4)
    assert cu.tolist() == [0] and rows.shape == (0, 5) and emitted.shape == (0,)
    bonus = torch.tensor([[3], [4]], dtype=torch.int32, device="cuda")
    rows, num, emitted, cu = loomnb.greedy_verify(e, torch.zeros(2, dtype=torch.int32, device="cuda"),
                                                  torch.zeros(0, 5, device="cuda"), bonus, 2)
    assert num.tolist() == [1, 1] and emitted.tolist() == [3, 4] and cu.tolist() == [0, 1, 2]


# ---------------------------------------------------------------- launch machinery
def _static_batch(seed, num_reqs=8, spec_len=4, vocab=49152):
    rng = np.random.default_rng(seed)
    b = make_batch(rng, ragged_counts(rng, num_reqs, spec_len, "uniform"), spec_len, vocab)
    return b, on_gpu(b)


def test_cuda_graph_capture_of_both_ops():
    """Capture greedy_verify (two launches, a workspace from the graph's pool) and
    rejection_greedy_sample, refill the static inputs, replay: equals the oracle on the new
    inputs."""
    b, g = _static_batch(1)
    args = lambda t: (t["draft_token_ids"], t["cu_num_draft_tokens"], t["target_logits"],  # noqa: E731
                      t["bonus_token_ids"], b["max_spec_len"])
    outs = [torch.empty(s, dtype=torch.int32, device="cuda") for s in
            ((8, 5), (8,), (len(b["draft_token_ids"]) + 8,), (9,))]
    unf = torch.empty(8, 5, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, remembers the launches
        loomnb.greedy_verify(*args(g), output_token_ids=outs[0], num_emitted=outs[1],
                             emitted_token_ids=outs[2], cu_num_emitted=outs[3])
        loomnb.rejection_greedy_sample(g["draft_token_ids"], g["cu_num_draft_tokens"],
                                       g["target_argmax"], g["bonus_token_ids"], 4, out=unf)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loomnb.greedy_verify(*args(g), output_token_ids=outs[0], num_emitted=outs[1],
                             emitted_token_ids=outs[2], cu_num_emitted=outs[3])
        loomnb.rejection_greedy_sample(g["draft_token_ids"], g["cu_num_draft_tokens"],
                                       g["target_argmax"], g["bonus_token_ids"], 4, out=unf)
    # new values of the same shapes: same draft count needed for the same static shapes
    n = len(b["draft_token_ids"])
    rng = np.random.default_rng(9)
    b3 = make_batch(rng, np.diff(np.concatenate([[0], b["cu_num_draft_tokens"]])), 4, 49152)
    assert len(b3["draft_token_ids"]) == n
    for k in ("draft_token_ids", "cu_num_draft_tokens", "target_logits", "target_argmax", "bonus_token_ids"):
        g[k].copy_(dev(b3[k]))
    for o in outs + [unf]:
        o.fill_(123)
    graph.replay()
    torch.cuda.synchronize()
    want = loomnb.oracle.greedy_verify(*(b3[k] for k in ("draft_token_ids", "cu_num_draft_tokens",
                                                         "target_logits", "bonus_token_ids")), 4)
    for t, w, name in zip(outs, want, NAMES):
        assert np.array_equal(host(t), w), f"graph replay: {name}"
    assert np.array_equal(host(unf), want[0]), "graph replay: rejection_greedy_sample"


def test_eager_fast_path_replays_both_launches():
    """A repeated call replays the remembered launches (both kernels of greedy_verify), reads
    the inputs' current contents, allocates fresh outputs each time."""
    b, g = _static_batch(4)
    loomnb.ops.clear_launch_cache()
    call = lambda: loomnb.greedy_verify(g["draft_token_ids"], g["cu_num_draft_tokens"],  # noqa: E731
                                        g["target_logits"], g["bonus_token_ids"], 4)
    first = call()
    info = loomnb.ops.launch_cache_info()
    assert info["size"] == 1
    g["target_logits"].copy_(dev(np.roll(b["target_logits"], 1, axis=1)))  # every argmax + 1
    second = call()
    assert loomnb.ops.launch_cache_info() == info, "replayed: no new miss, nothing stored"
    assert all(a.data_ptr() != c.data_ptr() for a, c in zip(first, second)), "new outputs"
    torch.cuda.synchronize()
    want = loomnb.oracle.greedy_verify(b["draft_token_ids"], b["cu_num_draft_tokens"],
                                       np.roll(b["target_logits"], 1, axis=1), b["bonus_token_ids"], 4)
    for t, w, name in zip(second, want, NAMES):
        assert np.array_equal(host(t), w), f"replayed {name}"
    with pytest.raises(loomnb.LoomnbValueError, match="argument 'max_spec_len'"):
        loomnb.greedy_verify(g["draft_token_ids"], g["cu_num_draft_tokens"], g["target_logits"],
                             g["bonus_token_ids"], 200)


def test_no_recompilation_for_new_batch_sizes():
    """New num_reqs / num_draft_tokens / V reuse the compiled kernels (same dtypes, same group)."""
    for seed, (num_reqs, vocab) in enumerate([(3, 1000), (8, 1000), (50, 4000)]):
        b, _ = _static_batch(seed, num_reqs, 4, vocab)
        check_fused(b, "warm")
        check_unfused(b, "warm")
        if seed == 0:
            before = len(L._kernels)
    assert len(L._kernels) == before, "a new batch size compiled a new kernel"


def test_torch_compile_and_custom_ops():
    """Inside torch.compile both ops are single torch.ops.loomnb nodes; results equal eager."""
    b, g = _static_batch(5)

    def step(d, cu, logits, bonus):
        rows, num, emitted, cu_out = loomnb.greedy_verify(d, cu, logits, bonus, 4)
        again = loomnb.rejection_greedy_sample(d, cu, logits.argmax(-1), bonus, 4)
        return rows, num, emitted, cu_out, again

    args = (g["draft_token_ids"], g["cu_num_draft_tokens"], g["target_logits"], g["bonus_token_ids"])
    eager = step(*args)
    compiled = torch.compile(step, fullgraph=True)(*args)
    for a, c in zip(eager, compiled):
        assert torch.equal(a, c)
    assert torch.equal(eager[0], eager[4])
    out = torch.ops.loomnb.rejection_greedy_sample(args[0], args[1], g["target_argmax"], args[3], 4)
    assert torch.equal(out, eager[0])


def test_host_arrays_and_other_devices_are_rejected():
    d = torch.zeros(2, dtype=torch.int32, device="cuda")
    cu = torch.tensor([2], dtype=torch.int32, device="cuda")
    bonus = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(loomnb.LoomnbTypeError, match="argument 'target_argmax' must be a CUDA device array"):
        loomnb.rejection_greedy_sample(d, cu, torch.zeros(2, dtype=torch.int64), bonus, 2)
    with pytest.raises(loomnb.LoomnbTypeError, match="host numpy.ndarray"):
        loomnb.greedy_verify(d, cu, np.zeros((2, 8), np.float32), bonus, 2)
    if torch.cuda.device_count() > 1:
        with pytest.raises(loomnb.LoomnbValueError, match="on the same device as 'draft_token_ids'"):
            loomnb.greedy_verify(d, cu, torch.zeros(2, 8, device="cuda:1"), bonus, 2)


def test_opcheck_every_form():
    """torch.library.opcheck: schema (mutation annotations), fake tensors (the fakes' shapes and
    dtypes), dynamic-shape AOT dispatch, for the functional and .out forms of both ops."""
    b, g = _static_batch(6)
    d, cu, logits, bonus = (g[k] for k in ("draft_token_ids", "cu_num_draft_tokens",
                                           "target_logits", "bonus_token_ids"))
    R, N = cu.shape[0], d.shape[0]
    i32 = lambda *s: torch.empty(s, dtype=torch.int32, device="cuda")  # noqa: E731
    ops = torch.ops.loomnb
    cases = [
        (ops.rejection_greedy_sample.default, (d, cu, g["target_argmax"], bonus, 4), {}),
        (ops.rejection_greedy_sample.out, (d, cu, g["target_argmax"], bonus, 4), {"out": i32(R, 5)}),
        (ops.greedy_verify.default, (d, cu, logits, bonus, 4, None), {}),
        (ops.greedy_verify.out, (d, cu, logits, bonus, 4, 40000),
         {"output_token_ids": i32(R, 5), "num_emitted": i32(R), "emitted_token_ids": i32(N + R),
          "cu_num_emitted": i32(R + 1)}),
    ]
    for op, args, kwargs in cases:
        torch.library.opcheck(op, args, kwargs)


def test_memcheck_small_shapes():
    """Every kernel variant at small shapes, for ``compute-sanitizer --tool memcheck``: both
    argmax paths (16-byte and scalar loads, split rows), every group width of both
    verification kernels, the fused form's rounds and compaction, impossible ``cu`` rows,
    an empty batch."""
    rng = np.random.default_rng(11)
    for spec_len, vocab in ((1, 64), (7, 1001), (16, 12288), (40, 40), (128, 96)):  # 12288: 3 splits
        b = make_batch(rng, ragged_counts(rng, 5, spec_len, "uniform"), spec_len, vocab, accept=0.9)
        check_fused(b, f"memcheck L={spec_len} V={vocab}")
        check_unfused(b, f"memcheck L={spec_len}")
        check_unfused(b, f"memcheck L={spec_len} int32", dev(b["target_argmax"].astype(np.int32)))
    with L.force_threads(32):
        b = make_batch(rng, ragged_counts(rng, 40, 4, "uniform"), 4, 300)
        check_fused(b, "memcheck rounds")
    d, t = dev(np.array([1, 2, 3, 4], np.int32)), dev(np.array([1, 2, 3, 4]))
    bonus = dev(np.array([[7], [8], [9], [6]], np.int32))
    cu = dev(np.array([3, 1, 4, 9], np.int32))  # decreasing, beyond N: read nothing
    assert (loomnb.rejection_greedy_sample(d, cu, t, bonus, 2) == -1).all()
    rows, num, emitted, cu_out = loomnb.greedy_verify(d, cu, torch.eye(8, device="cuda")[t], bonus, 2)
    assert (rows == -1).all() and (num == 0).all() and (emitted == -1).all()
    e = torch.zeros(0, dtype=torch.int32, device="cuda")
    assert loomnb.greedy_verify(e, e, torch.zeros(0, 4, device="cuda"), e.view(0, 1), 1)[3].tolist() == [0]
