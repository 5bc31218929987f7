"""Every public op is a torch custom op (``torch.ops.loomnb.<name>``), and torch.compile
traces a module calling ``loomnb.<name>`` directly with no graph break.

On the CPU this runs Dynamo with ``fullgraph=True`` on meta tensors: the trace routes each op
to its custom op (one node each) and the fake implementations give the output metadata, no
kernel runs. The GPU file runs ``torch.library.opcheck``, compiled-equals-eager and CUDA-graph
capture of the compiled module (``test_torch_ops_gpu.py``).
"""

import pytest
import torch

import loomnb
from loomnb.ops._torch_ops import REGISTERED

pytestmark = pytest.mark.nosim


def test_every_public_op_is_registered():
    """Every exported op (an alias such as a vLLM name exports the same function) is a
    registered torch custom op under its own name."""
    assert {getattr(loomnb.ops, n).__name__ for n in loomnb.ops.OPS} == set(REGISTERED)
    for name in REGISTERED:
        packet = getattr(torch.ops.loomnb, name)
        schema = str(packet.default._schema)
        assert schema.startswith(f"loomnb::{name}(")


def test_schemas_mark_mutation():
    s = str(torch.ops.loomnb.fused_add_rms_norm.default._schema)
    assert "Tensor(a!) x, Tensor(b!) residual" in s and s.endswith("-> ()")
    s = str(torch.ops.loomnb.rms_norm.out._schema)
    assert "Tensor(z!) out" in s and s.endswith("-> ()")
    s = str(torch.ops.loomnb.rms_norm_dynamic_per_token_quant.default._schema)
    assert "Tensor(a!)? residual" in s and s.endswith("-> (Tensor, Tensor)")


class Block(torch.nn.Module):
    """A decoder-ish block calling loomnb directly, as a research module would."""

    def __init__(self, hidden):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16), requires_grad=False)
        self.scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x, residual, out):
        y = loomnb.rms_norm(x * 2, self.w, 1e-6)
        loomnb.rms_norm(y, self.w, 1e-6, out=out, rounding="once")
        x, residual = loomnb.fused_add_rms_norm(x, residual, self.w, 1e-6)
        q, s = loomnb.rms_norm_dynamic_per_token_quant(x, self.w, 1e-6)
        q2 = loomnb.rms_norm_static_fp8_quant(y, self.w, self.scale, 1e-6)
        q3, residual = loomnb.fused_add_rms_norm_static_fp8_quant(y, residual, self.w, self.scale, 1e-6)
        return y + 1, q, s, q2, q3, residual


def test_fullgraph_trace_has_one_node_per_op_and_no_break():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    m = Block(64).to("meta")
    x = torch.empty(4, 64, dtype=torch.bfloat16, device="meta")
    r, out = torch.empty_like(x), torch.empty_like(x)
    torch._dynamo.reset()
    y, q, s, q2, q3, res = torch.compile(m, backend=backend, fullgraph=True)(x, r, out)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    loomnb_nodes = [t for t in targets if t.startswith("loomnb.")]
    assert loomnb_nodes == ["loomnb.rms_norm.default", "loomnb.rms_norm.out",
                            "loomnb.fused_add_rms_norm.default",
                            "loomnb.rms_norm_dynamic_per_token_quant.default",
                            "loomnb.rms_norm_static_fp8_quant.default",
                            "loomnb.fused_add_rms_norm_static_fp8_quant.default"], targets
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 1) and q3.shape == (4, 64)


def test_stream_is_refused_while_compiling():
    def f(x, w):
        return loomnb.rms_norm(x, w, 1e-6, stream=1)

    x = torch.empty(2, 8, device="meta")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="argument 'stream' must be None under torch.compile"):
        torch.compile(f, backend="eager", fullgraph=True)(x, torch.empty(8, device="meta"))


# ---------------------------------------------------------------- the generated preamble
class _Launch:  # a remembered launch whose driver call does nothing
    device, params = 0, None

    def driver_call(self, stream, params, zero):
        from loomnb._numba_internals import CUDA_SUCCESS
        return (CUDA_SUCCESS,)


class _Hit:
    """What ``_launch._cache`` holds for a remembered call; ``allocs`` outputs of ``made``."""

    def __init__(self, made):
        import threading
        self.prepared, self.rest, self.device = _Launch(), (), 0
        self.allocs = tuple((lambda t=t: t, ()) for t in made) or None
        self.lock = threading.Lock()


class _Cache(dict):
    """Finds every key (recording it), as if each call had been remembered."""

    def __init__(self, made=()):
        super().__init__()
        self.keys, self.made = [], made

    def get(self, k, default=None):
        self.keys.append(k)
        return _Hit(self.made)


@pytest.fixture
def remembered(monkeypatch):
    from loomnb.ops import _launch as L

    def install(made=()):
        cache = _Cache(made)
        monkeypatch.setattr(L, "_cache", cache)
        monkeypatch.setattr(L, "_rt", (lambda: 0, lambda device: 0, False))
        return cache
    return install


def test_public_ops_have_the_bodys_signature_without_launch_key():
    import inspect
    for name, op in REGISTERED.items():
        params = inspect.signature(op).parameters
        assert "launch_key" not in params and list(params)[-1] == "stream", name
        assert op.__name__ == name and op.__doc__ and op.traced is not None, name


def test_a_replayed_call_returns_the_callers_or_the_replays_outputs(remembered):
    from loomnb.ops import _launch as L
    x, w, o = torch.ones(2, 8), torch.ones(8), torch.empty(2, 8)
    cache = remembered()
    assert loomnb.rms_norm(x, w, 1e-6, out=o) is o
    assert cache.keys == [L.key3("rms_norm", 1e-6, "twice", x, w, o)]
    assert loomnb.fused_add_rms_norm(x, o, w, 1e-6) == (x, o)
    made = torch.empty(2, 8), torch.empty(2, 1)
    remembered(made)
    assert loomnb.rms_norm(x, w, 1e-6) is made[0]
    q, s = loomnb.rms_norm_dynamic_per_token_quant(x, w, 1e-6, scales=made[1])
    assert q is made[0] and s is made[1]
    q, b = loomnb.fused_add_rms_norm_static_fp8_quant(x, o, w, torch.ones(1), 1e-6)
    assert q is made[0] and b is o
    assert loomnb.silu_and_mul(x) is made[0]


def test_the_preamble_keeps_its_conditions(remembered, monkeypatch):
    """Checked calls, an explicit stream and options of the wrong type take the checked path
    (which rejects the CPU tensors here); the Python-only ``return_lse`` picks the returns."""
    x, w, s = torch.ones(2, 8), torch.ones(8), torch.ones(1)
    cache = remembered()
    for call in (lambda: loomnb.rms_norm(x, w, 1e-6, stream=0),
                 lambda: loomnb.rms_norm(x, w, 1, out=x),  # key3: a float eps
                 lambda: loomnb.rms_norm_static_fp8_quant(x, w, s, 1e-6, check_scale=True),
                 lambda: loomnb.per_token_group_quant_fp8(x, 8, column_major_scales=1),
                 lambda: loomnb.greedy_sample_logprob(x)):  # CPU: no current CUDA stream
        with pytest.raises((loomnb.LoomnbTypeError, loomnb.LoomnbValueError)):
            call()
    assert cache.keys == []
    q, kc, sl = torch.ones(1, 2, 8), torch.ones(1, 4, 2, 8), torch.ones(1)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(loomnb.LoomnbTypeError):  # stream_key="query": CPU, no current stream
        loomnb.paged_decode_attention(q, kc, kc, bt, sl, 0.5)
    assert cache.keys == []
    made = torch.empty(1, 2, 8), torch.empty(2, 1)
    cache = remembered(made)
    # the current stream of these CPU tensors, as a CUDA tensor's would be: stream 0
    monkeypatch.setitem(loomnb.paged_decode_attention.__globals__, "_stream_of", lambda t: 0)
    assert loomnb.paged_decode_attention(q, kc, kc, bt, sl, 0.5) is made[0]
    assert loomnb.paged_decode_attention(q, kc, kc, bt, sl, 0.5, return_lse=True) == made
    assert cache.keys[0] != cache.keys[1], "return_lse is part of the key"
    with pytest.raises(loomnb.LoomnbTypeError):  # not a bool: checked (here: CPU tensors)
        loomnb.paged_decode_attention(q, kc, kc, bt, sl, 0.5, return_lse=1)
    assert len(cache.keys) == 2
