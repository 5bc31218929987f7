"""The sampling ops trace under torch.compile as one ``torch.ops.loomnb`` node each, with no
graph break (meta tensors on the CPU: the fake implementations give the output metadata)."""

import pytest
import torch

import loomnb

pytestmark = pytest.mark.nosim


def test_fullgraph_trace_one_node_per_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def tail(logits, t, mp):
        tok, lp, rank = loomnb.greedy_sample_logprob(logits, "v2")
        lp2, rank2 = loomnb.selected_token_logprob_rank(logits, t)
        ix, lps, rk = loomnb.top_k_logprobs(logits, 5, t, "v1")
        loomnb.min_p_filter_(logits, mp, "v2")
        return tok, lp, rank, lp2, rank2, ix, lps, rk

    x = torch.empty(4, 1000, device="meta")
    t = torch.empty(4, dtype=torch.int64, device="meta")
    mp = torch.empty(4, device="meta")
    torch._dynamo.reset()
    out = torch.compile(tail, backend=backend, fullgraph=True)(x, t, mp)
    assert len(graphs) == 1
    nodes = [str(n.target) for n in graphs[0].graph.nodes
             if n.op == "call_function" and str(n.target).startswith("loomnb.")]
    assert nodes == ["loomnb.greedy_sample_logprob.default",
                     "loomnb.selected_token_logprob_rank.default",
                     "loomnb.top_k_logprobs.default", "loomnb.min_p_filter_.default"], nodes
    tok, lp, rank, lp2, rank2, ix, lps, rk = out
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32 and rank.shape == (4,)
    assert ix.shape == (4, 6) and ix.dtype == torch.int32 and lps.shape == (4, 6)


def test_schemas():
    s = str(torch.ops.loomnb.min_p_filter_.default._schema)
    assert "Tensor(a!) logits" in s and s.endswith("-> ()")
    s = str(torch.ops.loomnb.top_k_logprobs.default._schema)
    assert "Tensor? token_ids=None" in s and s.endswith("-> (Tensor, Tensor, Tensor)")
