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
