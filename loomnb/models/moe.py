"""A reference mixture-of-experts layer over loomnb's MoE ops, and an independent torch twin.

:func:`moe_forward` is the routed-experts block of a Qwen3-MoE or DeepSeek-V3 layer, built the
way a serving engine's fused MoE is: routing -> per-expert segments padded to a GEMM block ->
gather -> one GEMM pair per expert -> weighted combine. The routing and the token movement are
loomnb's ops (``ops="loomnb"``: ``loomnb.<op>`` on CUDA tensors, the NumPy oracles
``loomnb.oracle.<op>`` on CPU tensors, as the decode loop's ``loomnb-cuda`` / ``loomnb-cpu``
backends split them, :mod:`loomnb.models.backends`); the GEMMs and the activation are torch.
``ops="torch"`` computes the same layer in plain torch, written without loomnb, so the two can
be compared (``tests/test_expert_layer.py``).

Shapes. ``M`` tokens, ``E`` experts, ``k = topk``, ``H = hidden_size``, ``I =
intermediate_size``; ``x [M, H]`` (bf16/fp16/fp32, the activation dtype T). Weights
(:class:`MoEWeights`): ``router [E, H]`` (T), ``correction_bias [E]`` float32 or None,
``w13 [E, 2I, H]`` (T; rows ``0..I-1`` the gate projection, ``I..2I-1`` the up projection),
``w2 [E, H, I]`` (T). The flat index of the pair (token ``t``, pick ``j``) is ``t * k + j``.

The layer. Notation of ``docs/numerics.md``: ``f`` widens to float32, ``r`` rounds float32 to
T, ``r32`` is one float32 rounding, every other float32 operation one IEEE operation.

1. Router logits ``g = x @ router.T`` (a torch GEMM in T, both paths).
2. Routing (float32, from the exact widening of ``g``): scores ``p`` -- softmax ``p_i =
   r32(e_i * r32(1 / S))`` with ``e_i = r32(exp(r32(x_i - max x)))`` and ``S`` the float64 sum
   of the ``e_i`` rounded once, or sigmoid ``p_i = r32(1 / r32(1 + r32(exp(-x_i))))`` (``exp``
   evaluated in float64, rounded once); selection score ``s = r32(p + correction_bias)`` (or
   ``p``); with ``num_expert_group = G > 0`` the ``topk_group`` groups of ``E / G``
   consecutive experts with the best group score (``r32(a + b)`` of a group's two best ``s``
   with a bias, else its best ``s``) are kept and the ``k`` experts chosen among theirs,
   else among all. "Best" is always repeated argmax: NaN largest, ties to the lowest index;
   ids in pick order. The weight of a pick is its unbiased ``p``; ``renormalize`` divides by
   ``r32(sum_j w_j)`` (float32, pick order; 1 if 0); then ``r32(w * r32(routed_scaling_factor))``
   when the factor is not 1. loomnb: ``topk_softmax`` / ``topk_sigmoid`` (no groups) or
   ``grouped_topk``; torch: the same formulas and a stable descending sort.
3. Alignment (``moe_align_block_size``, ``block_size`` 16 by default): expert ``e``'s flat
   indices, ascending, padded to a multiple of the block; the segments in expert order.
   ``moe_permute`` gathers the token rows in that order (zero rows for padding).
4. Experts, a Python loop over the segments read from the host copy of ``expert_ids``,
   ``num_tokens_post_pad`` and ``sorted_token_ids`` (a host sync: this is a reference): for
   the ``n_e`` real rows ``X_e`` of expert ``e``'s segment (its padding rows are not
   multiplied), ``h = X_e @ w13[e].T`` (T), ``a = r(f32(silu(f(h[:, :I]))) * f(h[:, I:]))``
   (``F.silu`` in float32, the product rounded once to T) and ``y_e = a @ w2[e].T`` (T). The
   torch path gathers the same rows (the token rows of expert ``e``'s flat indices in
   ascending order) with ``index_select`` and runs the same three steps on them.
5. Combine (``moe_unpermute``): ``out[t] = r(acc)``, ``acc = r32(acc + r32(w[t, j] *
   f(y[t * k + j])))`` for ``j = 0..k-1`` from ``acc = 0``, float32; the torch path adds the
   same terms in the same order.

What it matches. On CPU tensors ``ops="loomnb"`` (the oracles) and ``ops="torch"`` give the
same bits in fp32 and bf16: the routing formulas are the same IEEE operations (the softmax's
float64 sum of float32 terms rounds to the oracle's exact sum except within ~1e-16 of a float32
rounding boundary), and each expert's GEMMs run on the same rows with the same shapes -- which
is why the padding rows are left out of them: a CPU GEMM or an elementwise kernel can round a
row differently when the tensor around it has another number of rows. On CUDA, loomnb's
routing kernels use libdevice ``expf`` (within 2 ulps of a correctly rounded ``exp``), so the
weights differ from the torch path's by a few float32 ulps (``tests/tolerances.py``'s
``moe_route`` budget) and the outputs by as much; the ids agree except at near-ties.

Where it differs from the models it is shaped after. It is the routed experts only
(DeepSeek-V3's shared expert, and the dense layers, are not here). The router GEMM runs in
the activation dtype (DeepSeek-V3's reference implementation takes its gate in float32).
The activation rounds ``silu(gate) * up`` once; vLLM's ``silu_and_mul`` rounds ``silu(gate)``
to T before the product (:meth:`loomnb.models.backends.TorchReferenceOps.silu_and_mul`), up to
one ulp of T apart. vLLM's fused MoE multiplies by the routing weight in its second GEMM's
epilogue, rounds each weighted row to T and sums the ``k`` rows with ``moe_sum``; here the
weighted sum is float32, rounded once. The routing differs from vLLM's as the ops' docstrings
say (float32 scores from bf16 logits, pick order instead of ``torch.topk(sorted=False)``'s).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from .backends import _to_torch

SCORING_FUNCS = ("softmax", "sigmoid")
DEFAULT_BLOCK_SIZE = 16  # rows of an expert's GEMM block (moe_align_block_size's block_size)
OPS = ("loomnb", "torch")  # moe_forward's implementations
# the loomnb ops the loomnb path runs (the routing op one of the first three)
LOOMNB_MOE_OPS = ("topk_softmax", "topk_sigmoid", "grouped_topk", "moe_align_block_size",
                  "moe_permute", "moe_unpermute")


@dataclass(frozen=True)
class MoEConfig:
    """Geometry and routing of a routed-experts block.

    ``num_expert_group = 0`` routes over all experts (``topk_softmax`` / ``topk_sigmoid`` as
    ``scoring_func`` says); ``> 0`` is DeepSeek's grouped routing (``grouped_topk``), keeping
    ``topk_group`` of the ``num_expert_group`` groups. ``has_correction_bias``: the weights
    carry a float32 ``[E]`` bias added to the scores for the selection only.
    ``routed_scaling_factor`` multiplies the (renormalised) weights when it is not 1.
    """

    num_experts: int
    topk: int
    hidden_size: int
    intermediate_size: int
    scoring_func: str = "softmax"
    renormalize: bool = False
    num_expert_group: int = 0
    topk_group: int = 0
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False

    def __post_init__(self):
        E, k, G = self.num_experts, self.topk, self.num_expert_group
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}; got "
                             f"{self.scoring_func!r}")
        if min(E, k, self.hidden_size, self.intermediate_size) < 1 or k > E:
            raise ValueError(f"need 1 <= topk <= num_experts and positive sizes; got {self}")
        if G:
            if G < 0 or E % G or not 1 <= self.topk_group <= G or k > self.topk_group * (E // G):
                raise ValueError("grouped routing needs num_expert_group | num_experts, 1 <= "
                                 "topk_group <= num_expert_group and topk <= topk_group * "
                                 f"num_experts / num_expert_group; got {self}")
        elif self.topk_group:
            raise ValueError(f"topk_group without num_expert_group; got {self}")

    @property
    def grouped(self) -> bool:
        return self.num_expert_group > 0

    def scaled(self, hidden_size: int, intermediate_size: int) -> MoEConfig:
        """The same routing with other GEMM sizes (tests scale the GEMMs down)."""
        return replace(self, hidden_size=hidden_size, intermediate_size=intermediate_size)


# Qwen3-30B-A3B: 128 experts, top-8, softmax routing, the top-8 weights renormalised.
QWEN3_30B_A3B = MoEConfig(num_experts=128, topk=8, hidden_size=2048, intermediate_size=768,
                          scoring_func="softmax", renormalize=True)
# DeepSeek-V3: 256 experts in 8 groups, 4 groups kept, top-8 by sigmoid + correction bias,
# weights renormalised then scaled by 2.5.
DEEPSEEK_V3 = MoEConfig(num_experts=256, topk=8, hidden_size=7168, intermediate_size=2048,
                        scoring_func="sigmoid", renormalize=True, num_expert_group=8,
                        topk_group=4, routed_scaling_factor=2.5, has_correction_bias=True)
PRESETS = {"qwen3-30b-a3b": QWEN3_30B_A3B, "deepseek-v3": DEEPSEEK_V3}


@dataclass
class MoEWeights:
    """``router [E, H]``, ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]`` in the
    activation dtype; ``correction_bias`` float32 ``[E]`` or None."""

    router: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    correction_bias: torch.Tensor | None = None


def synthetic_weights(config: MoEConfig, dtype: torch.dtype = torch.bfloat16,
                      device: torch.device | str = "cpu", seed: int = 0) -> MoEWeights:
    """Random weights of ``config``'s shapes, drawn in float32 on ``device`` (a generator of
    that device seeded with ``seed``: the same seed gives the same weights on the same kind of
    device) and rounded to ``dtype``. Scaled so that with ``x ~ N(0, 1)`` everything is O(1):
    ``router, w13 ~ N(0, 1/H)`` (logits, gate and up ~ N(0, 1)), ``w2 ~ N(0, 1/I)``; the
    correction bias ``~ 0.1 * N(0, 1)``, enough to change some picks."""
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(shape, std):
        w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        return w.mul_(std).to(dtype)

    router = normal((E, H), H ** -0.5)
    bias = None
    if config.has_correction_bias:  # float32, not rounded to dtype
        bias = torch.randn((E,), generator=gen, device=device, dtype=torch.float32).mul_(0.1)
    w13 = normal((E, 2 * I, H), H ** -0.5)
    w2 = normal((E, H, I), I ** -0.5)
    return MoEWeights(router=router, w13=w13, w2=w2, correction_bias=bias)


# ------------------------------------------------------------------------------ shared
def _check(x, weights, config, ops):
    if ops not in OPS:
        raise ValueError(f"ops must be one of {OPS}; got {ops!r}")
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
    if x.dim() != 2 or x.shape[1] != H:
        raise ValueError(f"x must be [num_tokens, {H}]; got {list(x.shape)}")
    want = {"router": (E, H), "w13": (E, 2 * I, H), "w2": (E, H, I)}
    for name, shape in want.items():
        w = getattr(weights, name)
        if tuple(w.shape) != shape or w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"weights.{name} must be {list(shape)} {x.dtype} on {x.device}; "
                             f"got {list(w.shape)} {w.dtype} on {w.device}")
    b = weights.correction_bias
    if config.has_correction_bias:
        if b is None or tuple(b.shape) != (E,) or b.dtype != torch.float32 or b.device != x.device:
            raise ValueError(f"config.has_correction_bias: weights.correction_bias must be "
                             f"[{E}] float32 on {x.device}")
    elif b is not None:
        raise ValueError("weights.correction_bias given but config.has_correction_bias is False")


def router_logits(x: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
    """``x @ router.T`` in the activation dtype, ``[M, E]`` (contiguous)."""
    return (x @ weights.router.T).contiguous()


def _expert_mlp(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on its rows ``[n, H]``: ``(r(silu(f(gate)) * f(up))) @ w2.T`` with ``gate,
    up = rows @ w13.T`` split in halves; the same code on the same shapes in both paths (the
    rows are copied to a fresh tensor, so the GEMM sees the same layout and alignment too)."""
    rows = rows.clone(memory_format=torch.contiguous_format)
    inter = w2.shape[1]
    h = rows @ w13.T
    act = (F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(rows.dtype)
    return act @ w2.T


def _scale_weights(tw, config):
    if config.routed_scaling_factor == 1.0:
        return tw
    return tw * float(np.float32(config.routed_scaling_factor))


# ------------------------------------------------------------------------------ loomnb path
class _LoomnbMoeOps:
    """``loomnb.<op>`` on CUDA tensors, or ``loomnb.oracle.<op>`` on CPU tensors (which takes
    them as zero-copy NumPy views and returns NumPy, converted back here)."""

    def __init__(self, device: torch.device):
        if device.type == "cuda":
            import loomnb  # lazy, as the backends import it

            self.m, self._back = loomnb, (lambda t: t)
        elif device.type == "cpu":
            from loomnb import oracle

            self.m, self._back = oracle, _to_torch
        else:
            raise ValueError(f"ops='loomnb' runs on CUDA or CPU tensors; got {device}")

    def __getattr__(self, name):
        if name not in LOOMNB_MOE_OPS:
            raise AttributeError(name)
        fn = getattr(self.m, name)

        def call(*args, **kwargs):
            res = fn(*args, **kwargs)
            if isinstance(res, tuple):
                return tuple(self._back(r) for r in res)
            return self._back(res)

        return call


def _loomnb_route(ops, x, logits, weights, config):
    k, bias = config.topk, weights.correction_bias
    if config.grouped:
        tw, ids = ops.grouped_topk(x, logits, k, config.renormalize, config.num_expert_group,
                                   config.topk_group, config.scoring_func,
                                   config.routed_scaling_factor, bias)
        return tw, ids
    route = ops.topk_softmax if config.scoring_func == "softmax" else ops.topk_sigmoid
    tw, ids, _ = route(logits, k, config.renormalize, e_score_correction_bias=bias)
    return _scale_weights(tw, config), ids


def _loomnb_forward(x, weights, config, block_size):
    ops = _LoomnbMoeOps(x.device)
    M, k, E = x.shape[0], config.topk, config.num_experts
    tw, ids = _loomnb_route(ops, x, router_logits(x, weights), weights, config)
    sorted_ids, expert_ids, post_pad = ops.moe_align_block_size(ids, block_size, E)
    permuted, _ = ops.moe_permute(x, sorted_ids, k)
    y = torch.zeros_like(permuted)  # padding rows stay zero; moe_unpermute never reads them
    s_host = sorted_ids.cpu().numpy()
    blocks = expert_ids.cpu().numpy()[:int(post_pad.cpu()[0]) // block_size]
    N = M * k
    b = 0
    while b < blocks.shape[0]:  # one segment: the consecutive blocks of one expert
        e, first = int(blocks[b]), b
        while b < blocks.shape[0] and blocks[b] == e:
            b += 1
        lo, hi = first * block_size, b * block_size
        real = s_host[lo:hi] < N
        n = int(real.sum())
        if not real[:n].all():
            raise RuntimeError(f"moe_align_block_size: expert {e}'s segment [{lo}, {hi}) does "
                               "not start with its real rows")
        if e >= 0 and n:
            y[lo:lo + n] = _expert_mlp(permuted[lo:lo + n], weights.w13[e], weights.w2[e])
    return ops.moe_unpermute(y, sorted_ids, tw)


# ------------------------------------------------------------------------------ torch path
def _select(s, k, allowed=None):
    """int64 ``[M, k]``: the top ``k`` of each row of ``s`` (float32) by repeated argmax -- NaN
    largest (torch's sort order), ties to the lowest index (a stable sort) -- with the
    candidates where ``allowed`` is False after all others."""
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    if allowed is not None:
        barred = (~allowed).gather(-1, order).to(torch.int8)
        order = order.gather(-1, torch.sort(barred, dim=-1, stable=True).indices)
    return order[:, :k]


def _exp32(v):
    """``r32(exp(float64(v)))``."""
    return torch.exp(v.double()).float()


def _torch_scores(logits, scoring_func):
    x = logits.float()
    if scoring_func == "softmax":
        m = torch.where(torch.isnan(x), float("-inf"), x).amax(-1, keepdim=True)
        e = _exp32(x - m)
        S = e.double().sum(-1, keepdim=True).float()
        return e * (torch.ones_like(S) / S)
    return torch.ones_like(x) / (1 + _exp32(-x))


def _torch_route(logits, weights, config):
    p = _torch_scores(logits, config.scoring_func)
    bias = weights.correction_bias
    s = p if bias is None else p + bias
    allowed = None
    if config.grouped:
        M, E, G = p.shape[0], p.shape[1], config.num_expert_group
        sg = s.view(M * G, E // G)
        if bias is not None:
            two = sg.gather(-1, _select(sg, 2))
            group_score = two[:, 0] + two[:, 1]
        else:
            group_score = sg.gather(-1, _select(sg, 1))[:, 0]
        groups = _select(group_score.view(M, G), config.topk_group)
        kept = torch.zeros((M, G), dtype=torch.bool, device=p.device)
        kept.scatter_(-1, groups, True)
        allowed = kept.repeat_interleave(E // G, dim=-1)
    ids = _select(s, config.topk, allowed)
    tw = p.gather(-1, ids)
    if config.renormalize:
        D = torch.zeros_like(tw[:, 0])
        for j in range(config.topk):
            D = D + tw[:, j]
        D = torch.where(D == 0, torch.ones_like(D), D)
        tw = tw / D[:, None]
    return _scale_weights(tw, config), ids.to(torch.int32)


def _torch_forward(x, weights, config):
    M, k = x.shape[0], config.topk
    tw, ids = _torch_route(router_logits(x, weights), weights, config)
    flat = ids.reshape(-1).long()
    y = torch.zeros((M * k, x.shape[1]), dtype=x.dtype, device=x.device)  # pair t*k+j's output
    for e in torch.unique(flat).tolist():  # ascending experts
        idx = torch.nonzero(flat == e).squeeze(1)  # ascending flat indices
        y[idx] = _expert_mlp(x.index_select(0, idx // k), weights.w13[e], weights.w2[e])
    y = y.float().view(M, k, -1)
    acc = torch.zeros((M, x.shape[1]), dtype=torch.float32, device=x.device)
    for j in range(k):
        acc = acc + tw[:, j:j + 1] * y[:, j]
    return acc.to(x.dtype)


# ------------------------------------------------------------------------------ public
def moe_route(x: torch.Tensor, weights: MoEWeights, config: MoEConfig, ops: str = "loomnb"):
    """The layer's routing alone: ``(topk_weights float32 [M, k], topk_ids int32 [M, k])``, ids
    in pick order (module docstring, step 2)."""
    _check(x, weights, config, ops)
    logits = router_logits(x, weights)
    if ops == "torch":
        return _torch_route(logits, weights, config)
    return _loomnb_route(_LoomnbMoeOps(x.device), x, logits, weights, config)


def moe_forward(x: torch.Tensor, weights: MoEWeights, config: MoEConfig, ops: str = "loomnb",
                *, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """The routed-experts block on ``x [M, H]``: ``out [M, H]`` in x's dtype (module
    docstring). ``ops="loomnb"``: routing, alignment, gather and combine through loomnb's ops
    (the kernels on CUDA tensors, the oracles on CPU tensors), GEMMs in torch; ``ops="torch"``:
    all torch. Syncs with the host (the expert loop reads the segment layout)."""
    _check(x, weights, config, ops)
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    if ops == "torch":
        return _torch_forward(x, weights, config)
    return _loomnb_forward(x, weights, config, int(block_size))
