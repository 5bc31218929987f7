"""The reference MoE layer (``loomnb.models.moe``): loomnb's MoE ops inside a routed-experts
block, against the same block written in plain torch.

On the CPU (CI) ``ops="loomnb"`` runs the oracles (``loomnb.oracle.<op>``) and must give the
pure-torch layer's bits exactly, fp32 and bf16 alike: routing ids and weights, and the output
(the two paths multiply the same rows of each expert with the same shapes, and add the
weighted rows in the same float32 order). Geometries: the presets' real expert counts, top-k
and groups (Qwen3-30B-A3B 128 / top-8; DeepSeek-V3 256 / 8 groups / 4 kept / top-8 with the
correction bias and the 2.5 scale) with the GEMMs scaled down (hidden 64, intermediate 32).
Also: the routing against a naive torch routing (``torch.topk``, compared as sets), the
lowest-index tie rule on bf16 logits (which tie often), the block size not changing the output,
a float64 dense formulation of the layer, and argument checks.

The ``gpu`` class runs the same comparisons on CUDA tensors with loomnb's kernels at Qwen3's
full geometry (64 tokens) and DeepSeek-V3's with hidden scaled to 2048 (32 tokens). There the
routing weights differ from the torch path's by libdevice ``expf``'s few float32 ulps
(``tests/tolerances.py``'s ``moe_route`` row), so the outputs are compared within the
tolerance that implies; the ids are compared exactly.
"""

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from helpers import assert_ulps  # noqa: E402
from tolerances import ulps  # noqa: E402

from loomnb.models.moe import (  # noqa: E402
    DEEPSEEK_V3,
    QWEN3_30B_A3B,
    MoEConfig,
    moe_forward,
    moe_route,
    router_logits,
    synthetic_weights,
)

HIDDEN, INTER, TOKENS = 64, 32, 16
PRESETS = {"qwen3": QWEN3_30B_A3B, "deepseek": DEEPSEEK_V3}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def small(name):
    return PRESETS[name].scaled(HIDDEN, INTER)


def tokens(num_tokens, hidden, dtype, device="cpu", seed=1):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((num_tokens, hidden), generator=gen, device=device).to(dtype)


def setup(name, kind, num_tokens=TOKENS, device="cpu", config=None):
    cfg = config or small(name)
    w = synthetic_weights(cfg, DTYPES[kind], device, seed=0)
    return cfg, w, tokens(num_tokens, cfg.hidden_size, DTYPES[kind], device)


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype,
                                                                 got.shape, want.shape)
    diff = bits(got) != bits(want)
    assert not bool(diff.any()), (f"{what}: {int(diff.sum())} of {diff.numel()} elements differ, "
                                  f"first at {diff.nonzero()[:3].tolist()}")


def host(t):
    """NumPy copy (bf16 as ml_dtypes.bfloat16) for tests/helpers.py's ulp comparisons."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


# ------------------------------------------------------------------------------ configs
def test_presets_are_the_real_geometries():
    q, d = QWEN3_30B_A3B, DEEPSEEK_V3
    assert (q.num_experts, q.topk, q.hidden_size, q.intermediate_size, q.scoring_func,
            q.renormalize, q.num_expert_group, q.routed_scaling_factor,
            q.has_correction_bias) == (128, 8, 2048, 768, "softmax", True, 0, 1.0, False)
    assert (d.num_experts, d.topk, d.hidden_size, d.intermediate_size, d.scoring_func,
            d.renormalize, d.num_expert_group, d.topk_group, d.routed_scaling_factor,
            d.has_correction_bias) == (256, 8, 7168, 2048, "sigmoid", True, 8, 4, 2.5, True)
    s = d.scaled(64, 32)
    assert (s.hidden_size, s.intermediate_size, s.num_experts, s.topk_group) == (64, 32, 256, 4)


@pytest.mark.parametrize("kwargs", [
    dict(scoring_func="tanh"), dict(topk=200), dict(num_expert_group=3, topk_group=1),
    dict(num_expert_group=8, topk_group=9), dict(num_expert_group=8, topk_group=1, topk=32),
    dict(topk_group=2)])
def test_config_rejects_bad_routing(kwargs):
    base = dict(num_experts=128, topk=8, hidden_size=64, intermediate_size=32)
    with pytest.raises(ValueError):
        MoEConfig(**{**base, **kwargs})


def test_synthetic_weights_shapes_and_seed():
    cfg = small("deepseek")
    w = synthetic_weights(cfg, torch.bfloat16, "cpu", seed=3)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    assert w.router.shape == (E, H) and w.w13.shape == (E, 2 * I, H) and w.w2.shape == (E, H, I)
    assert w.router.dtype == w.w13.dtype == w.w2.dtype == torch.bfloat16
    assert w.correction_bias.shape == (E,) and w.correction_bias.dtype == torch.float32
    again = synthetic_weights(cfg, torch.bfloat16, "cpu", seed=3)
    assert torch.equal(w.w13, again.w13) and torch.equal(w.correction_bias, again.correction_bias)
    assert not torch.equal(w.w2, synthetic_weights(cfg, torch.bfloat16, "cpu", seed=4).w2)
    assert synthetic_weights(small("qwen3"), torch.float32).correction_bias is None
    # O(1) activations: logits, gate/up and the output of ~unit size
    x = tokens(64, H, torch.float32)
    w32 = synthetic_weights(cfg, torch.float32)
    assert 0.5 < router_logits(x, w32).std().item() < 2.0
    out = moe_forward(x, w32, cfg, "torch")
    assert 0.1 < out.std().item() < 10.0


def test_lazy_exports():
    import loomnb.models as models

    for name in ("moe_forward", "moe_route", "MoEConfig", "MoEWeights", "synthetic_weights",
                 "QWEN3_30B_A3B", "DEEPSEEK_V3"):
        assert name in models.__all__ and getattr(models, name) is not None
    assert models.moe_forward is moe_forward


# ------------------------------------------------------------------------------ CPU: exact
@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
@pytest.mark.parametrize("num_tokens", [1, TOKENS, 37])
def test_layer_oracles_equal_torch_exactly(name, kind, num_tokens):
    """The loomnb layer (oracles on CPU tensors) gives the pure-torch layer's bits: tolerance 0
    in fp32 and in bf16 (the GEMMs are the same torch calls on the same rows; the routing and
    the combine are the same IEEE float32 operations in the same order)."""
    cfg, w, x = setup(name, kind, num_tokens)
    got = moe_forward(x, w, cfg, ops="loomnb")
    want = moe_forward(x, w, cfg, ops="torch")
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.isfinite(want.float()).all()
    assert_same_bits(got, want, f"{name} {kind} M={num_tokens} output")


@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
def test_routing_oracles_equal_torch_exactly(name, kind):
    cfg, w, x = setup(name, kind, 64)
    tw, ids = moe_route(x, w, cfg, ops="loomnb")
    tw_t, ids_t = moe_route(x, w, cfg, ops="torch")
    assert ids.dtype == ids_t.dtype == torch.int32 and tw.dtype == tw_t.dtype == torch.float32
    assert ids.shape == tw.shape == (64, cfg.topk)
    assert torch.equal(ids, ids_t), f"{name} {kind}: ids differ"
    assert_same_bits(tw, tw_t, f"{name} {kind} weights")
    # each token's picks are distinct experts; renormalised weights sum to the scale factor
    assert all(len(set(r)) == cfg.topk for r in ids.tolist())
    torch.testing.assert_close(tw.sum(-1), torch.full((64,), cfg.routed_scaling_factor),
                               rtol=1e-6, atol=0)


def naive_torch_routing(logits, bias, cfg):
    """Routing as a torch model would write it: torch.softmax / torch.sigmoid and torch.topk
    (vLLM's grouped_topk formulation for the groups). Ties are broken however torch.topk does."""
    g = logits.float()
    scores = g.softmax(-1) if cfg.scoring_func == "softmax" else g.sigmoid()
    s = scores if bias is None else scores + bias
    if cfg.grouped:
        M, G = s.shape[0], cfg.num_expert_group
        grouped = s.view(M, G, -1)
        group_scores = (grouped.topk(2, dim=-1)[0].sum(-1) if bias is not None
                        else grouped.max(-1).values)
        group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        s = s.masked_fill(~mask.repeat_interleave(s.shape[1] // G, dim=-1), float("-inf"))
    ids = s.topk(cfg.topk, dim=-1, sorted=False)[1]
    tw = scores.gather(1, ids)
    if cfg.renormalize:
        tw = tw / tw.sum(-1, keepdim=True)
    return tw * cfg.routed_scaling_factor, ids


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
def test_routing_agrees_with_naive_torch(name):
    """fp32 logits (no ties): the same expert sets as torch.topk, the weights within float32
    rounding of torch's softmax/sigmoid (compared per expert)."""
    cfg, w, x = setup(name, "f32", 64)
    tw, ids = moe_route(x, w, cfg, ops="loomnb")
    tw_n, ids_n = naive_torch_routing(router_logits(x, w), w.correction_bias, cfg)
    o, o_n = ids.long().sort(-1), ids_n.sort(-1)
    assert torch.equal(o.values, o_n.values), "expert sets differ from torch.topk's"
    torch.testing.assert_close(tw.gather(1, o.indices), tw_n.gather(1, o_n.indices),
                               rtol=4e-6, atol=1e-7)
    # pick order: descending selection score
    p = (router_logits(x, w).float().softmax(-1) if cfg.scoring_func == "softmax"
         else router_logits(x, w).float().sigmoid())
    s = p if w.correction_bias is None else p + w.correction_bias
    picked = s.gather(1, ids.long())
    assert bool((picked[:, :-1] >= picked[:, 1:] - 1e-6).all())


def test_correction_bias_changes_picks_not_weights():
    cfg, w, x = setup("deepseek", "f32", 64)
    tw, ids = moe_route(x, w, cfg, ops="loomnb")
    plain = replace(cfg, has_correction_bias=False)
    w0 = replace(w, correction_bias=None)
    tw0, ids0 = moe_route(x, w0, plain, ops="loomnb")
    assert not torch.equal(ids, ids0), "the bias should move some picks"
    # the weights are unbiased sigmoid scores, renormalised and scaled
    p = torch.sigmoid(router_logits(x, w).float()).gather(1, ids.long())
    torch.testing.assert_close(tw, p / p.sum(-1, keepdim=True) * 2.5, rtol=4e-6, atol=0)


def test_ties_go_to_the_lowest_expert():
    """bf16 logits tie often (8 significant bits over 128 experts): the picks follow the rule
    -- descending logits, equal logits in ascending expert order, and an expert left out with
    the last pick's logit has a higher index -- and the test sees such ties."""
    cfg, w, x = setup("qwen3", "bf16", 64)
    _, ids = moe_route(x, w, cfg, ops="loomnb")
    g = router_logits(x, w).float()
    ties = 0
    for t in range(g.shape[0]):
        picks = ids[t].tolist()
        v = g[t, picks].tolist()
        for j in range(len(picks) - 1):
            assert v[j] >= v[j + 1], (t, picks, v)
            if v[j] == v[j + 1]:
                ties += 1
                assert picks[j] < picks[j + 1], (t, picks, v)
        rest = [e for e in range(g.shape[1]) if e not in picks]
        for e in rest:
            assert g[t, e] < v[-1] or (g[t, e] == v[-1] and e > picks[-1]), (t, e, picks)
            ties += int(g[t, e] == v[-1])
    assert ties > 0, "no ties among the picks: the tie rule was not exercised"


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
def test_block_size_does_not_change_the_output(name):
    """The padding is layout only: every block size gives the same bits (the experts multiply
    their real rows)."""
    cfg, w, x = setup(name, "f32")
    ref = moe_forward(x, w, cfg, ops="loomnb")
    for bs in (1, 7, 64):
        assert_same_bits(moe_forward(x, w, cfg, ops="loomnb", block_size=bs), ref, f"bs={bs}")


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
def test_layer_is_the_dense_mixture(name):
    """The layer computes ``sum_j w_j * expert_{id_j}(x)`` with ``expert(x) = (silu(x W_g^T) *
    (x W_u^T)) W_2^T``: the fp32 layer against that written densely in float64 per token, from
    the same routing."""
    cfg, w, x = setup(name, "f32")
    tw, ids = moe_route(x, w, cfg, ops="torch")
    I = cfg.intermediate_size
    want = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(cfg.topk):
            e = int(ids[t, j])
            h = w.w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:I]) * h[I:]
            want[t] += float(tw[t, j]) * (w.w2[e].double() @ act)
    got = moe_forward(x, w, cfg, ops="loomnb")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_argument_checks():
    cfg, w, x = setup("qwen3", "f32", 4)
    with pytest.raises(ValueError, match="ops"):
        moe_forward(x, w, cfg, ops="vllm")
    with pytest.raises(ValueError, match="x must be"):
        moe_forward(x[:, :10], w, cfg)
    with pytest.raises(ValueError, match="weights.router"):
        moe_forward(x.bfloat16(), w, cfg)  # weights in another dtype
    with pytest.raises(ValueError, match="correction_bias"):
        moe_forward(x, w, replace(cfg, has_correction_bias=True))
    with pytest.raises(ValueError, match="correction_bias"):
        moe_forward(x, replace(w, correction_bias=torch.zeros(cfg.num_experts)), cfg)
    empty = moe_forward(x[:0], w, cfg)
    assert empty.shape == (0, HIDDEN)


# ------------------------------------------------------------------------------ GPU
GPU_CASES = {  # name -> (config, tokens): Qwen3's full geometry, DeepSeek-V3's with hidden 2048
    "qwen3": (QWEN3_30B_A3B, 64),
    "deepseek": (DEEPSEEK_V3.scaled(2048, DEEPSEEK_V3.intermediate_size), 32),
}


@pytest.mark.gpu
class TestGpu:
    """loomnb's kernels in the layer (CUDA tensors) against the pure-torch layer on the same
    device. Ids exact; weights within ``moe_route``'s ulps (libdevice ``expf``); the output
    within what those weights move: fp32 ~1e-6 relative (``2^-16`` of the output's scale
    allowed), bf16 one ulp of T on at most 1% of the elements (a float32 sum that moved a few
    ulps can cross a bf16 rounding boundary)."""

    @pytest.fixture(scope="class", params=list(GPU_CASES))
    def case(self, request):
        cfg, m = GPU_CASES[request.param]
        return request.param, cfg, m

    @pytest.mark.parametrize("kind", ["f32", "bf16"])
    def test_layer_kernels_vs_torch(self, case, kind):
        name, cfg, m = case
        cfg, w, x = setup(name, kind, m, device="cuda", config=cfg)
        tw, ids = moe_route(x, w, cfg, ops="loomnb")
        tw_t, ids_t = moe_route(x, w, cfg, ops="torch")
        assert tw.is_cuda and ids.is_cuda
        assert torch.equal(ids.cpu(), ids_t.cpu()), f"{name} {kind}: ids differ"
        assert_ulps(host(tw), host(tw_t), ulps("moe_route", "f32"), f"{name} {kind} weights")
        got = moe_forward(x, w, cfg, ops="loomnb")
        want = moe_forward(x, w, cfg, ops="torch")
        torch.cuda.synchronize()
        assert got.is_cuda and got.dtype == x.dtype and got.shape == x.shape
        assert torch.isfinite(want.float()).all()
        if kind == "f32":
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=2.0 ** -16, atol=2.0 ** -16 * scale)
        else:
            assert_ulps(host(got), host(want), (1, 1e-2), f"{name} {kind} output")

    def test_block_size_does_not_change_the_output(self, case):
        name, cfg, m = case
        cfg, w, x = setup(name, "bf16", m, device="cuda", config=cfg)
        ref = moe_forward(x, w, cfg, ops="loomnb")
        for bs in (1, 64):
            assert_same_bits(moe_forward(x, w, cfg, ops="loomnb", block_size=bs), ref,
                             f"{name} bs={bs}")
