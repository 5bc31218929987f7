"""The torch custom ops on the GPU: ``torch.library.opcheck`` for every op and form,
``torch.compile(fullgraph=True)`` of a module calling loomnb equals eager bit for bit, and the
compiled module captured in a CUDA graph replays the same."""

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import loomnb  # noqa: E402

from test_torch_ops import Block  # noqa: E402


def _inputs(rows=8, hidden=256, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, device="cuda").to(torch.bfloat16)
    r = torch.randn(rows, hidden, generator=g, device="cuda").to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).to(torch.bfloat16)
    return x, r, w


def _cases():
    """Every op and form. The ``.out`` forms write FP8 codes into ``uint8`` outputs (an
    accepted form of ``out``): opcheck's schema check compares mutated tensors with
    ``torch.allclose``, which torch does not implement for float8."""
    x, r, w = _inputs()
    s = torch.tensor([0.05], device="cuda")
    fp8 = lambda: torch.empty(x.shape, dtype=torch.uint8, device="cuda")  # noqa: E731
    ops = torch.ops.loomnb
    return [
        (ops.rms_norm.default, (x, w, 1e-6), {"rounding": "once"}),
        (ops.rms_norm.out, (x, w, 1e-6), {"rounding": "twice", "out": torch.empty_like(x)}),
        (ops.fused_add_rms_norm.default, (x.clone(), r.clone(), w, 1e-6), {}),
        (ops.rms_norm_static_fp8_quant.default, (x, w, s, 1e-6), {}),
        (ops.rms_norm_static_fp8_quant.out, (x, w, s, 1e-6), {"out": fp8()}),
        (ops.fused_add_rms_norm_static_fp8_quant.default, (x, r.clone(), w, s, 1e-6), {}),
        (ops.fused_add_rms_norm_static_fp8_quant.out, (x, r.clone(), w, s, 1e-6), {"out": fp8()}),
        (ops.rms_norm_dynamic_per_token_quant.default, (x, w, 1e-6, s, r.clone()), {}),
        (ops.rms_norm_dynamic_per_token_quant.out, (x, w, 1e-6, None, None),
         {"out": fp8(), "scales": torch.empty(x.shape[0], 1, device="cuda")}),
    ]


@pytest.mark.parametrize("i", range(9))
def test_opcheck(i):
    op, args, kwargs = _cases()[i]
    torch.library.opcheck(op, args, kwargs)


def test_compiled_module_equals_eager_and_replays_in_a_cuda_graph():
    x, r, _ = _inputs(rows=16, hidden=4096, seed=3)
    m = Block(4096).cuda()
    with torch.no_grad():
        m.w.copy_((1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16))
    out_e, out_c = torch.empty_like(x), torch.empty_like(x)
    eager = m(x.clone(), r.clone(), out_e)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True)
    got = compiled(x.clone(), r.clone(), out_c)
    for a, b in zip(eager, got):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(out_e, out_c)
    # capture the compiled module in a CUDA graph on static buffers, refill, replay
    xs, rs, outs = x.clone(), r.clone(), torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        compiled(xs.clone(), rs.clone(), outs)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = compiled(xs, rs, outs)
    x2, r2, _ = _inputs(rows=16, hidden=4096, seed=4)
    xs.copy_(x2)
    rs.copy_(r2)
    g.replay()
    torch.cuda.synchronize()
    want = m(x2.clone(), r2.clone(), torch.empty_like(x2))
    for a, b in zip(want, static):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_per_call_cost_smoke():
    """Both entry points work eagerly and agree (the timing is benchmarks/bench_overhead.py)."""
    x, _, w = _inputs()
    out = torch.empty_like(x)
    assert torch.equal(torch.ops.loomnb.rms_norm(x, w, 1e-6), loomnb.rms_norm(x, w, 1e-6))
    torch.ops.loomnb.rms_norm.out(x, w, 1e-6, out=out)
    assert torch.equal(out, loomnb.rms_norm(x, w, 1e-6))
