"""MoE routing and token-movement benchmark: loomnb's ``topk_softmax``, ``topk_sigmoid``,
``grouped_topk``, ``moe_align_block_size``, ``moe_permute``, ``moe_unpermute`` and ``moe_sum``
against vLLM 0.24's compiled ``_moe_C`` ops (where vLLM has the op), the torch composites an
engine writes and torch.compile of each composite, in one process, both provider orders.

    python3 benchmarks/bench_moe.py --vllm-moe-lib /path/to/vllm/_moe_C_stable_libtorch.abi3.so
    python3 benchmarks/bench_moe.py                      # without vLLM: loomnb and torch only
    python3 benchmarks/bench_moe.py --quick              # smoke: 14 cases, 5 repeats
    python3 benchmarks/bench_moe.py --dry-run            # no GPU: fake timings, real plumbing
    python3 benchmarks/bench_moe.py --ops topk_softmax,grouped_topk --size 1,4096 --out-dir DIR

vLLM's MoE ops live in the wheel's second library, ``vllm/_moe_C_stable_libtorch.abi3.so``:
``--vllm-moe-lib``, else ``$LOOMNB_VLLM_MOE_LIB``, else the file of that name beside
``--vllm-lib`` / ``$LOOMNB_VLLM_LIB`` (else that library itself). It is loaded with
``torch.ops.load_library`` (vllm is never imported) and its ops bound by their schemas'
argument names (printed, and stored in ``meta.vllm``).

Cases (``num_tokens`` M is the swept axis, ``--size`` / ``--num-tokens``):

* ``topk_softmax``: E = 128, k = 8 (Qwen3-30B-A3B) and E = 256, k = 8, renormalised, fp32 and
  bf16 router logits (``--gating-dtypes``), M = 1 / 8 / 64 / 512 / 4096. Peers: vLLM's
  ``_moe_C.topk_softmax``; torch ``softmax(fp32) -> topk -> w / sum(w)``; torch.compile of it.
* ``topk_sigmoid``: the same shapes with an ``e_score_correction_bias`` (selection on
  ``sigmoid + bias``, weights the unbiased sigmoid); vLLM's ``_moe_C.topk_sigmoid`` where the
  library has it (and it takes a bias), the torch composite, torch.compile.
* ``grouped_topk``: DeepSeek-V3 routing -- E = 256 in 8 groups, 4 groups kept, k = 8, sigmoid
  scores, a bias, renormalised, ``routed_scaling_factor`` 2.5 -- fp32 logits. vLLM's fused
  ``_moe_C.grouped_topk(..., scoring_func=1)`` (what vLLM runs when a bias is given), vLLM's
  Python ``grouped_topk`` restated in torch (``grouped_topk_router.py``), torch.compile of it.
* ``moe_align_block_size``: uniform top-8 routing of E = 128 and 256 (``--experts``), block
  sizes 16 and 64 (``--block-sizes``). vLLM's op with the outputs sized as its Python wrapper
  sizes them (``L = M*k + E*(bs - 1)``, ``min(L, M*k*bs)`` when ``M*k < E``; ``ceil(L/bs)``
  blocks; allocated before the timed calls, for every provider that takes outputs); a torch
  composite (counts by ``scatter_add_``, a stable argsort, prefix sums, ``searchsorted``).
* ``moe_permute``: bf16 rows, H = 2048, k = 8 of E = 128, block 64 (Qwen3-30B-A3B's hidden
  size), M = 1 / 64 / 512 / 4096, without and with FP8 per-token quantisation (``--quant``).
  Torch: ``index_select`` of ``sorted_token_ids // k`` and a zeroing of the padding rows
  (FP8: then the per-token quantiser of ``bench_activation.py``). vLLM's own ``moe_permute``
  sorts into its own order and returns an inverse map: not this op, so n/a.
* ``moe_unpermute``: the weighted combine of the same shapes; torch inverts the permutation
  (``scatter_``), ``index_select``s the rows and sums them weighted in float32. vLLM: n/a
  (its combine is its GEMM's weighted scatter + ``moe_sum``).
* ``moe_sum``: ``[M, 8, 4096]`` and ``[M, 2, 4096]`` bf16 (``--sum-topk``), M = 1 / 64 / 512 /
  4096. vLLM's ``_moe_C.moe_sum`` (its kernel for k <= 4, ``at::sum_out`` otherwise) and
  ``torch.sum(x, 1)``; torch.compile of it.

Bytes model (GB/s and % of the copy rate measured in the same run come from it), with N = M*k
and L the padded length: routing ``M*E*elem + 12*M*k`` (three int32/fp32 outputs; + ``4*E`` of
bias); ``grouped_topk`` ``M*E*elem + 4*E + 8*M*k``; align ``4*N + 4*L + 4*ceil(L/bs) + 4``;
``moe_permute`` ``N*H*2`` (rows read) ``+ L*H*out_elem`` (rows written, padding included)
``+ 4*L`` (ids) ``+ 4*L`` (FP8 scales); ``moe_unpermute`` ``N*H*2 + M*H*2 + 4*L + 4*N``;
``moe_sum`` ``M*k*H*2 + M*H*2``.

Exactness: each provider's outputs on the same fresh inputs are compared byte for byte with
the reference's (vLLM where it has the op, else the torch composite, logged). Where vLLM's
order is unspecified the outputs are compared in a canonical form: ``grouped_topk``'s rows
sorted by expert id (vLLM's ``torch.topk(sorted=False)``), ``moe_align_block_size``'s
segments sorted (vLLM's CUDA kernel orders a segment by atomics). After the sweep the targets
are evaluated on the medians of both passes, stored in ``meta.targets`` and printed: loomnb
>= 1.0x vLLM for ``topk_softmax``, ``grouped_topk`` and ``moe_align_block_size`` at every size;
``moe_sum`` >= 1.3x vLLM and >= 90% of the copy rate at 4096 tokens; ``moe_permute`` >= 90% of
the copy rate at 4096 tokens x top-8. The default sweep is 85 cases; torch.compile compiles
once per case (most of the run's time): split it by ``--ops`` to keep a command short.
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import sys
import types
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import torch  # noqa: E402
from bench_activation import t_per_token  # noqa: E402  (the per-token FP8 quantiser composite)

MOE_LIB = "_moe_C_stable_libtorch.abi3.so"
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ELEM = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
TOKENS = [1, 8, 64, 512, 4096]          # routing and align
MOVE_TOKENS = [1, 64, 512, 4096]        # permute, unpermute, sum
TOPK = 8
RENORMALIZE = True                      # Qwen3-MoE's norm_topk_prob, DeepSeek-V3's
DSV3 = {"num_experts": 256, "num_expert_group": 8, "topk_group": 4, "topk": 8,
        "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "renormalize": True}
PERMUTE = {"hidden_size": 2048, "topk": 8, "num_experts": 128, "block_size": 64}
SUM_HIDDEN = 4096
BIAS_SCALE = 0.1                        # e_score_correction_bias ~ N(0, 0.1^2)

# the default and --quick plans (tuples; the flags replace one position: see _plan)
ROUTE = [(E, TOPK, dt, T) for E in (128, 256) for dt in ("fp32", "bf16") for T in TOKENS]
ROUTE_QUICK = [(128, TOPK, "fp32", 1), (128, TOPK, "fp32", 4096), (256, TOPK, "bf16", 64)]
SIGMOID_QUICK = [(256, TOPK, "fp32", 64)]
GROUPED = [("fp32", T) for T in TOKENS]
GROUPED_QUICK = [("fp32", 1), ("fp32", 4096)]
ALIGN = [(E, TOPK, bs, T) for E in (128, 256) for bs in (16, 64) for T in TOKENS]
ALIGN_QUICK = [(128, TOPK, 16, 1), (128, TOPK, 16, 4096), (256, TOPK, 64, 512)]
PERMUTE_PLAN = [(q, T) for q in ("none", "fp8") for T in MOVE_TOKENS]
PERMUTE_QUICK = [("none", 4096), ("fp8", 64)]
UNPERMUTE = [(T,) for T in MOVE_TOKENS]
UNPERMUTE_QUICK = [(4096,)]
SUM = [(k, SUM_HIDDEN, T) for k in (8, 2) for T in MOVE_TOKENS]
SUM_QUICK = [(8, SUM_HIDDEN, 4096), (2, SUM_HIDDEN, 1)]

_ROUTE_OUT = ("topk_weights", "topk_ids", "token_expert_indices")
OPS = {
    "topk_softmax": H.Op("topk_softmax", ("gating_output",), _ROUTE_OUT),
    "topk_sigmoid": H.Op("topk_sigmoid", ("gating_output", "e_score_correction_bias"), _ROUTE_OUT),
    "grouped_topk": H.Op("grouped_topk", ("gating_output", "e_score_correction_bias"),
                         ("topk_weights", "topk_ids")),
    "moe_align_block_size": H.Op("moe_align_block_size", ("topk_ids",),
                                 ("sorted_token_ids", "expert_ids", "num_tokens_post_pad")),
    "moe_permute": H.Op("moe_permute", ("hidden_states", "sorted_token_ids"), ("out", "scales"),
                        vllm_name=None),
    "moe_unpermute": H.Op("moe_unpermute", ("permuted", "sorted_token_ids", "topk_weights"),
                          ("out",), vllm_name=None),
    "moe_sum": H.Op("moe_sum", ("input",), ("out",)),
}


def cdiv(a, b):
    return -(-a // b)


def align_sizes(num_pairs, num_experts, block_size, pad_sorted_ids=False):
    """``(L, num_blocks)``: the lengths of ``sorted_token_ids`` and ``expert_ids`` as vLLM 0.24's
    Python ``moe_align_block_size`` allocates them (``fused_moe/moe_align_block_size.py``)."""
    n = num_pairs + num_experts * (block_size - 1)
    if pad_sorted_ids:
        n = cdiv(n, block_size) * block_size
    if num_pairs < num_experts:
        n = min(num_pairs * block_size, n)
    return n, cdiv(n, block_size)


def op_bytes(case):
    """The bytes model of one call (module docstring)."""
    op, M = case["op"], case["num_tokens"]
    if op in ("topk_softmax", "topk_sigmoid", "grouped_topk"):
        E, k = case["num_experts"], case["topk"]
        read = M * E * ELEM[case["dtype"]] + (4 * E if case.get("bias") else 0)
        return read + (8 if op == "grouped_topk" else 12) * M * k
    if op == "moe_align_block_size":
        N = M * case["topk"]
        L, nb = align_sizes(N, case["num_experts"], case["block_size"])
        return 4 * N + 4 * L + 4 * nb + 4
    if op in ("moe_permute", "moe_unpermute"):
        k, H_ = case["topk"], case["hidden_size"]
        N = M * k
        L, _ = align_sizes(N, case["num_experts"], case["block_size"])
        if op == "moe_unpermute":
            return N * H_ * 2 + M * H_ * 2 + 4 * L + 4 * N
        fp8 = case["quant"] == "fp8"
        return N * H_ * 2 + L * H_ * (1 if fp8 else 2) + 4 * L + (4 * L if fp8 else 0)
    if op == "moe_sum":
        return M * case["topk"] * case["hidden_size"] * 2 + M * case["hidden_size"] * 2
    raise KeyError(op)


# ---------------------------------------------------------------- torch composites
def token_expert_indices(M, k, device):
    """vLLM's source-row layout: ``[t, j] = j * M + t``."""
    return (torch.arange(k, device=device, dtype=torch.int32) * M)[None, :] + \
        torch.arange(M, device=device, dtype=torch.int32)[:, None]


def t_topk_softmax(gating_output, topk, renormalize):
    """softmax (float32) -> topk -> renormalise: the torch routing an engine writes."""
    scores = torch.softmax(gating_output, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(scores, topk, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    M = gating_output.shape[0]
    return w, ids.to(torch.int32), token_expert_indices(M, topk, gating_output.device)


def t_topk_sigmoid(gating_output, e_score_correction_bias, topk, renormalize):
    """sigmoid (float32); experts chosen on ``sigmoid + bias``, weighted by the unbiased
    sigmoid; renormalise."""
    scores = gating_output.float().sigmoid()
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias
    ids = torch.topk(choice, topk, dim=-1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    M = gating_output.shape[0]
    return w, ids.to(torch.int32), token_expert_indices(M, topk, gating_output.device)


def t_grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                   topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                   e_score_correction_bias=None):
    """vLLM 0.24's Python ``grouped_topk`` (``fused_moe/router/grouped_topk_router.py``, the
    non-fused path, ``VLLM_BATCH_INVARIANT`` off), restated line for line."""
    assert hidden_states.size(0) == gating_output.size(0), "Number of tokens mismatch"
    if scoring_func == "softmax":
        scores = torch.softmax(gating_output, dim=-1)
    elif scoring_func == "sigmoid":
        scores = gating_output.sigmoid()
    else:
        raise ValueError(f"Unsupported scoring function: {scoring_func}")
    num_token = scores.size(0)
    if e_score_correction_bias is not None:
        original_scores = scores
        scores = scores + e_score_correction_bias.unsqueeze(0)
        group_scores = scores.view(num_token, num_expert_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = scores.view(num_token, num_expert_group, -1).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1)
                  .expand(num_token, num_expert_group, scores.size(-1) // num_expert_group)
                  .reshape(num_token, -1))
    tmp_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    if e_score_correction_bias is not None:
        topk_ids = torch.topk(tmp_scores, k=topk, dim=-1, sorted=False)[1]
        topk_weights = original_scores.gather(1, topk_ids)
    else:
        topk_weights, topk_ids = torch.topk(tmp_scores, k=topk, dim=-1, sorted=False)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights.to(torch.float32), topk_ids.to(torch.int32)


def t_moe_align_block_size(topk_ids, block_size, num_experts, L):
    """The alignment in torch, capturable (no host sync): per-expert counts by ``scatter_add_``,
    padded prefix sums, a stable argsort of the flat ids (so a segment is ascending), the
    positions scattered into a sentinel-filled ``[L]``, each block's expert by
    ``searchsorted`` (-1 past the end)."""
    flat = topk_ids.reshape(-1).long()
    N, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(N, device=dev) - (counts.cumsum(0) - counts)[expert]
    sorted_ids = torch.full((L,), N, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, (ends - padded)[expert] + rank, order.to(torch.int32))
    starts = torch.arange(cdiv(L, block_size), device=dev) * block_size
    total = ends[-1]
    block_expert = torch.searchsorted(ends, starts, right=True)
    expert_ids = torch.where(starts < total, block_expert, -1).to(torch.int32)
    return sorted_ids, expert_ids, total.reshape(1).to(torch.int32)


def t_moe_permute(hidden_states, sorted_token_ids, topk, quant):
    """``index_select`` of the token rows, padding rows zeroed; FP8: then per-token quant."""
    n = hidden_states.shape[0] * topk
    ids = sorted_token_ids.long()
    real = (ids >= 0) & (ids < n)
    rows = hidden_states.index_select(0, torch.where(real, ids // topk, 0))
    rows = rows.masked_fill(~real[:, None], 0)
    if quant == "fp8":
        return t_per_token(rows)
    return rows, None


def t_moe_unpermute(permuted, sorted_token_ids, topk_weights):
    """The inverse permutation by ``scatter_`` (padding to a spare slot), ``index_select`` of
    each token's k rows, their weighted float32 sum."""
    M, k = topk_weights.shape
    n, dev = M * k, permuted.device
    ids = sorted_token_ids.long()
    slot = torch.where((ids >= 0) & (ids < n), ids, n)
    inv = torch.zeros(n + 1, dtype=torch.long, device=dev)
    inv.scatter_(0, slot, torch.arange(ids.numel(), device=dev))
    rows = permuted.index_select(0, inv[:n]).view(M, k, -1)
    return (rows.float() * topk_weights[:, :, None]).sum(1).to(permuted.dtype)


def t_moe_sum(input):
    return torch.sum(input, dim=1)


COMPOSITES = {"topk_softmax": t_topk_softmax, "topk_sigmoid": t_topk_sigmoid,
              "grouped_topk": t_grouped_topk, "moe_align_block_size": t_moe_align_block_size,
              "moe_permute": t_moe_permute, "moe_unpermute": t_moe_unpermute,
              "moe_sum": t_moe_sum}


# ---------------------------------------------------------------- inputs and outputs
def routing(M, E, k, g, device):
    """``[M, k]`` int32 ids of ``k`` distinct experts a token, uniform."""
    return torch.rand(M, E, generator=g, device=device).argsort(-1)[:, :k].to(torch.int32) \
        .contiguous()


def make_inputs(case, device, seed):
    """Fresh tensors of one call of ``case`` by role name, outputs preallocated (every
    provider's, same seed: same values)."""
    g = torch.Generator(device=device).manual_seed(seed)
    op, M = case["op"], case["num_tokens"]

    def empty(*shape, dtype=torch.int32):
        return torch.empty(shape, dtype=dtype, device=device)
    if op in ("topk_softmax", "topk_sigmoid", "grouped_topk"):
        E, k = case["num_experts"], case["topk"]
        t = {"gating_output": torch.randn(M, E, generator=g, device=device)
             .to(TORCH_DTYPES[case["dtype"]]),
             "topk_weights": empty(M, k, dtype=torch.float32), "topk_ids": empty(M, k)}
        if case.get("bias"):
            t["e_score_correction_bias"] = BIAS_SCALE * torch.randn(E, generator=g, device=device)
        if op == "grouped_topk":
            t["hidden_states"] = torch.zeros(M, 1, dtype=torch.bfloat16, device=device)
        else:
            t["token_expert_indices"] = empty(M, k)
        return t
    if op == "moe_align_block_size":
        E, k, bs = case["num_experts"], case["topk"], case["block_size"]
        L, nb = align_sizes(M * k, E, bs)
        return {"topk_ids": routing(M, E, k, g, device), "sorted_token_ids": empty(L),
                "expert_ids": empty(nb), "num_tokens_post_pad": empty(1), "L": L,
                "block_size": bs}
    if op in ("moe_permute", "moe_unpermute"):
        E, k, bs, H_ = case["num_experts"], case["topk"], case["block_size"], case["hidden_size"]
        L, _ = align_sizes(M * k, E, bs)
        ids = t_moe_align_block_size(routing(M, E, k, g, device), bs, E, L)[0]
        if op == "moe_unpermute":
            w = torch.rand(M, k, generator=g, device=device)
            return {"permuted": torch.randn(L, H_, generator=g, device=device).to(torch.bfloat16),
                    "sorted_token_ids": ids, "topk_weights": w / w.sum(-1, keepdim=True),
                    "out": empty(M, H_, dtype=torch.bfloat16)}
        fp8 = case["quant"] == "fp8"
        return {"hidden_states": torch.randn(M, H_, generator=g, device=device).to(torch.bfloat16),
                "sorted_token_ids": ids,
                "out": empty(L, H_, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16),
                "scales": empty(L, 1, dtype=torch.float32) if fp8 else None}
    if op == "moe_sum":
        k, H_ = case["topk"], case["hidden_size"]
        return {"input": torch.randn(M, k, H_, generator=g, device=device).to(torch.bfloat16),
                "out": empty(M, H_, dtype=torch.bfloat16)}
    raise KeyError(op)


def canonical_grouped(w, ids):
    """A grouped_topk result with each row sorted by expert id (vLLM's order is unspecified)."""
    ids_sorted, perm = ids.sort(dim=-1)
    return {"topk_weights": w.gather(-1, perm), "topk_ids": ids_sorted}


def canonical_align(sorted_ids, expert_ids, num_tokens_post_pad, block_size):
    """An alignment with each expert's segment sorted (vLLM's CUDA kernel fills a segment by
    atomics): positions below ``num_tokens_post_pad`` sorted by (block's expert, id), the rest
    as they are. A correct result in ascending order is its own canonical form."""
    N1 = max(int(sorted_ids.max()) + 1, 1) if sorted_ids.numel() else 1
    total = min(max(int(num_tokens_post_pad[0]), 0), sorted_ids.numel(),
                expert_ids.numel() * block_size)
    s = sorted_ids.clone()
    seg = expert_ids[:total // block_size].long().repeat_interleave(block_size)
    key = seg * N1 + sorted_ids[:seg.numel()].long()
    s[:seg.numel()] = (key.sort().values % N1).to(s.dtype)
    return {"sorted_token_ids": s, "expert_ids": expert_ids,
            "num_tokens_post_pad": num_tokens_post_pad}


def collect(op, t):
    """``result -> {role: tensor}``: the outputs compared for exactness (canonical where vLLM's
    order is unspecified), from the call's result or the preallocated outputs."""
    if op in ("topk_softmax", "topk_sigmoid"):
        def route(r):
            w, ids, tei = r if r is not None else (t[k] for k in _ROUTE_OUT)
            return {"topk_weights": w, "topk_ids": ids, "token_expert_indices": tei}
        return route
    if op == "grouped_topk":
        return lambda r: canonical_grouped(*r)
    if op == "moe_align_block_size":
        def align(r):
            s, e, n = r if r is not None else (t["sorted_token_ids"], t["expert_ids"],
                                               t["num_tokens_post_pad"])
            return canonical_align(s, e, n, t["block_size"])
        return align
    if op == "moe_permute":
        def permute(r):
            out, scales = r
            return {"out": out} if t["scales"] is None else {"out": out, "scales": scales}
        return permute
    return lambda r: {"out": t["out"] if r is None else r}


def torch_call(op, t, case, fn):
    """The call of composite ``fn`` (eager or compiled) of ``op`` on ``t``."""
    if op == "topk_softmax":
        return partial(fn, t["gating_output"], case["topk"], case["renormalize"])
    if op == "topk_sigmoid":
        return partial(fn, t["gating_output"], t.get("e_score_correction_bias"), case["topk"],
                       case["renormalize"])
    if op == "grouped_topk":
        return partial(fn, t["hidden_states"], t["gating_output"], case["topk"],
                       case["renormalize"], case["num_expert_group"], case["topk_group"],
                       case["scoring_func"], case["routed_scaling_factor"],
                       t.get("e_score_correction_bias"))
    if op == "moe_align_block_size":
        return partial(fn, t["topk_ids"], case["block_size"], case["num_experts"], t["L"])
    if op == "moe_permute":
        return partial(fn, t["hidden_states"], t["sorted_token_ids"], case["topk"], case["quant"])
    if op == "moe_unpermute":
        return partial(fn, t["permuted"], t["sorted_token_ids"], t["topk_weights"])
    if op == "moe_sum":
        return partial(fn, t["input"])
    raise KeyError(op)


# ---------------------------------------------------------------- providers
class Loomnb(H.LoomnbProvider):
    """loomnb's MoE ops (``loomnb.topk_softmax`` ...), outputs passed preallocated where the
    op takes them; a function loomnb lacks makes its rows n/a."""
    _accepts: dict = {}

    def fn(self, name):
        fn = getattr(self.m, name, None)
        if fn is None:
            raise H.NotAvailable(f"loomnb has no {name}")
        return fn

    def outs(self, fn, t, *names):
        """The keyword outputs among ``names`` that ``fn``'s signature takes."""
        if fn not in self._accepts:
            try:
                self._accepts[fn] = set(inspect.signature(fn).parameters)
            except (TypeError, ValueError):
                self._accepts[fn] = set()
        return {n: t[n] for n in names if n in self._accepts[fn] and t.get(n) is not None}

    def bind(self, op, t, case):
        name, fn = op.name, self.fn(op.name)
        if name in ("topk_softmax", "topk_sigmoid"):
            kw = self.outs(fn, t, *_ROUTE_OUT)
            if case.get("bias"):
                kw["e_score_correction_bias"] = t["e_score_correction_bias"]
            call = partial(fn, t["gating_output"], case["topk"], case["renormalize"], **kw)
        elif name == "grouped_topk":
            call = partial(fn, t["hidden_states"], t["gating_output"], case["topk"],
                           case["renormalize"], case["num_expert_group"], case["topk_group"],
                           case["scoring_func"], case["routed_scaling_factor"],
                           t.get("e_score_correction_bias"),
                           **self.outs(fn, t, "topk_weights", "topk_ids"))
        elif name == "moe_align_block_size":
            call = partial(fn, t["topk_ids"], case["block_size"], case["num_experts"],
                           **self.outs(fn, t, "sorted_token_ids", "expert_ids",
                                       "num_tokens_post_pad"))
        elif name == "moe_permute":
            call = partial(fn, t["hidden_states"], t["sorted_token_ids"], case["topk"],
                           **({"quant_dtype": "fp8"} if case["quant"] == "fp8" else {}),
                           **self.outs(fn, t, "out", "scales"))
        elif name == "moe_unpermute":
            call = partial(fn, t["permuted"], t["sorted_token_ids"], t["topk_weights"],
                           **self.outs(fn, t, "out"))
        elif name == "moe_sum":
            call = partial(fn, t["input"], **self.outs(fn, t, "out"))
        else:
            raise H.NotAvailable(f"loomnb has no {name}")
        return call, collect(name, t)


class Torch(H.Provider):
    """The torch composites (functions above): softmax/sigmoid -> topk -> renormalise, vLLM's
    Python grouped_topk, the align in torch, index_select gathers, a weighted float32 sum,
    torch.sum. They return new tensors."""
    name = "torch"

    def fn(self, op):
        return COMPOSITES[op.name]

    def bind(self, op, t, case):
        return torch_call(op.name, t, case, self.fn(op)), collect(op.name, t)


class Vllm(H.Provider):
    """vLLM 0.24's compiled MoE ops (``torch.ops._moe_C``, from ``--vllm-moe-lib`` /
    ``$LOOMNB_VLLM_MOE_LIB`` / the ``_moe_C`` library beside ``--vllm-lib``), loaded without
    importing vllm and bound by their schemas' argument names (printed): ``topk_softmax``,
    ``topk_sigmoid`` (with a bias, where its schema takes one), ``grouped_topk``
    (``scoring_func`` 1 = sigmoid; softmax scores are computed first, as vLLM's
    ``fused_grouped_topk`` does), ``moe_align_block_size``, ``moe_sum``. For an op it lacks its
    rows are n/a and, as the exactness reference, the torch composite stands in (logged)."""
    name = "vllm"
    namespaces = ("_moe_C",)
    NAMES = ("topk_softmax", "topk_sigmoid", "grouped_topk", "moe_align_block_size", "moe_sum")
    REQUIRED = {
        "topk_softmax": ("topk_weights", "topk_ids", "token_expert_indices", "gating_output",
                         "renormalize"),
        "topk_sigmoid": ("topk_weights", "topk_ids", "token_expert_indices", "gating_output",
                         "renormalize", "e_score_correction_bias"),
        "grouped_topk": ("gating_output", "num_expert_group", "topk_group", "topk",
                         "renormalize", "routed_scaling_factor", "e_score_correction_bias",
                         "scoring_func_id"),
        "moe_align_block_size": ("topk_ids", "num_experts", "block_size", "sorted_token_ids",
                                 "expert_ids", "num_tokens_post_pad"),
        "moe_sum": ("input", "out"),
    }
    ALIASES = {"topk_indices": ("topk_ids",), "bias": ("e_score_correction_bias",),
               "scores": ("gating_output",), "n_group": ("num_expert_group",),
               "experts_ids": ("expert_ids",), "output": ("out",),
               "scoring_func": ("scoring_func_id",)}
    BIAS_ARGS = ("bias", "e_score_correction_bias")

    def setup(self, args, log):
        path = moe_lib_path(args)
        path, err = H.load_vllm_library(types.SimpleNamespace(vllm_lib=path))
        if err:
            return err
        self.packets, self.schemas, self.bindings, self.log = {}, {}, {}, log
        self.fallbacks_logged, self.no_bias = set(), set()
        for name in self.NAMES:
            for ns in self.namespaces:
                try:
                    packet = getattr(getattr(torch.ops, ns), name)
                    schema = packet.default._schema
                except (AttributeError, RuntimeError):
                    continue
                self.schemas[name], self.packets[name] = str(schema), packet
                if not any(a.name in self.BIAS_ARGS for a in schema.arguments):
                    self.no_bias.add(name)
                break
            else:
                where = ", ".join(f"torch.ops.{ns}" for ns in self.namespaces)
                self.schemas[name] = f"MISSING {name} (looked in {where})"
            log(f"[vllm] schema {self.schemas[name]}")
        if not self.packets:
            return ("no --vllm-moe-lib / --vllm-lib given and LOOMNB_VLLM_MOE_LIB, "
                    "LOOMNB_VLLM_LIB are unset" if not path
                    else f"{path} registers none of {', '.join(self.NAMES)}")
        self.lib = str(Path(path).resolve()) if path else "ops already registered in this process"

    def unsupported(self, case):
        op = case["op"]
        name = OPS[op].vllm
        if name is None:
            return (f"vLLM has no {op} in this form (its moe_permute/moe_unpermute sort into "
                    "their own order with an inverse map)")
        if hasattr(self, "packets"):  # (set up: what the library lacks)
            if name not in self.packets:
                return f"this vLLM library has no {name}"
            if op == "topk_sigmoid" and name in self.no_bias and case.get("bias"):
                return f"this vLLM library's {name} takes no e_score_correction_bias"

    def bind(self, op, t, case):
        reason = self.unsupported(case)
        if reason:  # only the exactness reference gets here: the torch composite stands in
            if op.name not in self.fallbacks_logged:
                self.fallbacks_logged.add(op.name)
                self.log(f"[exact] {op.name}: {reason}; the torch composite is its reference")
            return torch_call(op.name, t, case, COMPOSITES[op.name]), collect(op.name, t)
        name = op.vllm
        packet = self.packets[name]
        vals = {**t, **{k: case[k] for k in ("topk", "renormalize", "num_experts", "block_size",
                                             "num_expert_group", "topk_group") if k in case},
                "routed_scaling_factor": case.get("routed_scaling_factor", 1.0)}
        softmax_first = False
        if name == "grouped_topk":
            softmax_first = case["scoring_func"] == "softmax"
            vals["scoring_func_id"] = 0 if softmax_first else 1
        args, kwargs, desc = H.bind_schema(packet.default._schema, vals, self.REQUIRED[name],
                                           self.ALIASES)
        if name not in self.bindings:
            self.log(f"[vllm] {name}({desc})")
            self.bindings[name] = desc
        if softmax_first:  # vLLM's fused_grouped_topk: softmax in Python, then the kernel
            g = t["gating_output"]
            pos = next(i for i, a in enumerate(args) if a is g)

            def call():
                a = list(args)
                a[pos] = torch.softmax(g, dim=-1)
                return packet(*a, **kwargs)
            return call, collect(op.name, t)
        call = partial(packet, *args, **kwargs)
        if name == "grouped_topk":
            return call, collect(op.name, t)
        got = collect(op.name, t)
        return call, (lambda _: got(None))


def moe_lib_path(args):
    """vLLM's ``_moe_C`` library: ``--vllm-moe-lib``, ``$LOOMNB_VLLM_MOE_LIB``, the file
    ``_moe_C_stable_libtorch.abi3.so`` beside ``--vllm-lib`` / ``$LOOMNB_VLLM_LIB``, or that
    library itself (None when none is given)."""
    path = getattr(args, "vllm_moe_lib", None) or os.environ.get("LOOMNB_VLLM_MOE_LIB")
    if path:
        return path
    main_lib = getattr(args, "vllm_lib", None) or os.environ.get("LOOMNB_VLLM_LIB")
    if not main_lib:
        return None
    beside = Path(main_lib).with_name(MOE_LIB)
    return str(beside) if beside.is_file() else main_lib


PROVIDERS = {p.name: p for p in (Loomnb, Vllm, Torch, H.compiled(Torch))}


# ---------------------------------------------------------------- the family
def override(plan, pos, values):
    """``plan`` with position ``pos`` of its tuples replaced by each of ``values`` (None: as is)."""
    if not values:
        return plan
    keys = dict.fromkeys(s[:pos] + s[pos + 1:] for s in plan)
    return [k[:pos] + (v,) + k[pos:] for k in keys for v in values]


class MoeFamily(H.Family):
    name = "moe"
    ops = OPS
    providers = PROVIDERS
    x_axis, x_default, x_quick = "num_tokens", TOKENS, [1, 64, 4096]
    dtypes = ("bf16",)   # the cases' own dtypes: --gating-dtypes (routing), bf16 rows (movement)
    vllm_ns = "_moe_C"
    bytes_model = ("routing M*E*elem + 12*M*k (+4*E bias); grouped_topk M*E*elem + 4*E + "
                   "8*M*k; align 4*N + 4*L + 4*ceil(L/bs) + 4; moe_permute N*H*2 + L*H*out_elem "
                   "+ 4*L (+ 4*L FP8 scales); moe_unpermute N*H*2 + M*H*2 + 4*L + 4*N; moe_sum "
                   "M*k*H*2 + M*H*2 (N = M*k, L = N + E*(bs-1), min(L, N*bs) when N < E)")
    fake = {"loomnb": (3.0, 3800.0), "vllm": (4.5, 3000.0), "torch": (15.0, 1500.0),
            "torch_compile": (8.0, 2500.0)}  # (floor µs, GB/s) for --dry-run

    def add_arguments(self, p):
        import argparse
        p.add_argument("--size", dest="num_tokens", type=H.csv_list(int), default=argparse.SUPPRESS,
                       help="the same as --num-tokens")
        p.add_argument("--out-dir", dest="out", type=Path, default=argparse.SUPPRESS,
                       help="the same as --out")
        p.add_argument("--vllm-moe-lib",
                       help=f"vLLM's {MOE_LIB} (default: $LOOMNB_VLLM_MOE_LIB, else the one "
                            "beside --vllm-lib / $LOOMNB_VLLM_LIB)")
        p.add_argument("--experts", type=H.csv_list(int),
                       help="num_experts of topk_softmax, topk_sigmoid and the align "
                            "(default 128,256)")
        p.add_argument("--block-sizes", type=H.csv_list(int),
                       help="moe_align_block_size's block sizes (default 16,64)")
        p.add_argument("--gating-dtypes", type=H.csv_list(str, ("fp32", "bf16", "fp16")),
                       help="router-logit dtypes (default fp32,bf16; grouped_topk fp32)")
        p.add_argument("--quant", type=H.csv_list(str, ("none", "fp8")),
                       help="moe_permute's output: none (bf16 rows) and/or fp8 (default both)")
        p.add_argument("--sum-topk", type=H.csv_list(int),
                       help="moe_sum's k (default 8,2)")

    def cases(self, args):
        default_sizes = self.x_quick if args.quick else self.x_default
        sizes = args.num_tokens if args.num_tokens != default_sizes else None
        out = []
        for op in args.ops:
            for spec in self._plan(op, args.quick, sizes, args):
                case = {"op": op, "l2": "cold" if args.l2_cold else "warm", **spec}
                case["x"] = case["num_tokens"]
                case["bytes"] = op_bytes(case)
                out.append(case)
        return out

    def _plan(self, op, quick, sizes, args):
        """The case specs of ``op``: the default or quick plan, with --size, --experts,
        --block-sizes, --gating-dtypes, --quant, --sum-topk replacing that axis."""
        if op in ("topk_softmax", "topk_sigmoid"):
            plan = (SIGMOID_QUICK if op == "topk_sigmoid" else ROUTE_QUICK) if quick else ROUTE
            plan = override(override(override(plan, 3, sizes), 2, args.gating_dtypes), 0,
                            args.experts)
            bias = op == "topk_sigmoid"
            for E, k, dt, T in plan:
                yield {"num_experts": E, "topk": k, "dtype": dt, "num_tokens": T,
                       "renormalize": RENORMALIZE, "bias": bias,
                       "shape": f"E{E} k{k} {dt} logits" + (", bias" if bias else "")}
        elif op == "grouped_topk":
            plan = override(override(GROUPED_QUICK if quick else GROUPED, 1, sizes), 0,
                            args.gating_dtypes)
            for dt, T in plan:
                yield {**DSV3, "dtype": dt, "num_tokens": T, "bias": True,
                       "shape": f"DeepSeek-V3 E256 8 groups top-4 k8 sigmoid+bias x2.5, "
                                f"{dt} logits"}
        elif op == "moe_align_block_size":
            plan = override(override(override(ALIGN_QUICK if quick else ALIGN, 3, sizes), 2,
                                     args.block_sizes), 0, args.experts)
            for E, k, bs, T in plan:
                yield {"num_experts": E, "topk": k, "block_size": bs, "num_tokens": T,
                       "dtype": "int32", "shape": f"E{E} k{k} block {bs}"}
        elif op == "moe_permute":
            plan = override(override(PERMUTE_QUICK if quick else PERMUTE_PLAN, 1, sizes), 0,
                            args.quant)
            for q, T in plan:
                yield {**PERMUTE, "quant": q, "num_tokens": T, "dtype": "bf16",
                       "shape": _movement_label(q)}
        elif op == "moe_unpermute":
            for (T,) in override(UNPERMUTE_QUICK if quick else UNPERMUTE, 0, sizes):
                yield {**PERMUTE, "num_tokens": T, "dtype": "bf16",
                       "shape": _movement_label("none")}
        elif op == "moe_sum":
            plan = override(override(SUM_QUICK if quick else SUM, 2, sizes), 0, args.sum_topk)
            for k, H_, T in plan:
                yield {"topk": k, "hidden_size": H_, "num_tokens": T, "dtype": "bf16",
                       "shape": f"[M, {k}, {H_}] bf16"}

    def shape_label(self, case):
        return case["shape"]

    def op_bytes(self, op, case):
        return op_bytes(case)

    def make_inputs(self, op, case, device, seed):
        return make_inputs(case, device, seed)


def _movement_label(quant):
    p = PERMUTE
    return (f"H{p['hidden_size']} k{p['topk']} of E{p['num_experts']} block {p['block_size']}, "
            + ("bf16 -> fp8" if quant == "fp8" else "bf16"))


FAMILY = MoeFamily()


# ---------------------------------------------------------------- targets
VS_VLLM = {"topk_softmax": 1.0, "grouped_topk": 1.0, "moe_align_block_size": 1.0}
SUM_VS_VLLM, SUM_PCT_COPY, PERMUTE_PCT_COPY, BIG = 1.3, 0.9, 0.9, 4096


def _medians(rows):
    """(op, shape, num_tokens, provider) -> {"us", "GBps", "exact_min"}: medians over passes."""
    by = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("graph_us"):
            by.setdefault((r["op"], r["shape"], r["x"], r["provider"]), []).append(r)
    out = {}
    for k, rs in by.items():
        ex = [r["exact_min"] for r in rs if r.get("exact_min") is not None]
        out[k] = {"us": statistics.median(r["graph_us"] for r in rs),
                  "GBps": statistics.median(r["GBps"] for r in rs),
                  "exact_min": min(ex) if ex else None}
    return out


def evaluate_targets(rows, copy_GBps):
    """The targets over a run's rows (module docstring): one entry per checked shape and size,
    with the ratio and whether it is met (None: not measured). Speedups are vLLM µs / loomnb
    µs; rates loomnb's GB/s / the run's copy GB/s."""
    med = _medians(rows)
    out = []

    def entry(target, op, shape, size, need, peer, ratio, **extra):
        me = med.get((op, shape, size, "loomnb"))
        out.append({"target": target, "op": op, "shape": shape, "size": size, "need": need,
                    "loomnb_us": me["us"] if me else None, "peer": peer, "ratio": ratio,
                    "met": None if ratio is None else ratio >= need, **extra})

    def speedup(op, shape, size, need):
        me, other = med.get((op, shape, size, "loomnb")), med.get((op, shape, size, "vllm"))
        ratio = other["us"] / me["us"] if me and other else None
        entry(f">= {need}x vLLM", op, shape, size, need, "vllm", ratio,
              peer_us=other["us"] if other else None)

    def rate(op, shape, size, need):
        me = med.get((op, shape, size, "loomnb"))
        pct = me["GBps"] / copy_GBps if me and copy_GBps else None
        entry(f">= {round(100 * need)}% of the copy rate", op, shape, size, need, "copy rate",
              pct, copy_GBps=copy_GBps)

    cases = sorted({k[:3] for k in med} | {(r["op"], r["shape"], r["x"]) for r in rows})
    for op, shape, size in cases:
        if op in VS_VLLM:
            speedup(op, shape, size, VS_VLLM[op])
        elif op == "moe_sum" and size == BIG:
            speedup(op, shape, size, SUM_VS_VLLM)
            rate(op, shape, size, SUM_PCT_COPY)
        elif op == "moe_permute" and size == BIG:
            rate(op, shape, size, PERMUTE_PCT_COPY)
    return out


def add_targets(json_path):
    """Evaluate the targets of a result file, store them in its meta, print them."""
    path = Path(json_path)
    d = json.loads(path.read_text())
    meta = d["meta"]
    targets = evaluate_targets(d["results"], meta.get("copy_GBps"))
    meta["targets"] = targets
    path.write_text(json.dumps(d, indent=1, default=str) + "\n")
    fake = " (DRY RUN: fake timings)" if meta.get("dry_run") else ""
    checked = [t for t in targets if t["met"] is not None]
    print(f"targets: {sum(t['met'] for t in checked)} of {len(checked)} met, "
          f"{len(targets) - len(checked)} not measured{fake}")
    for t in targets:
        state = {True: "met ", False: "MISS", None: "n/m "}[t["met"]]
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        us = "-" if t["loomnb_us"] is None else f"{t['loomnb_us']:.1f} µs"
        print(f"  {state} {t['op']} {t['shape']} M={t['size']}: {t['target']}: ratio {ratio} "
              f"(loomnb {us})")
    return targets


def parse_args(argv=None):
    return H.parse_args(FAMILY, argv)


def main(argv=None) -> Path:
    path = H.run(FAMILY, argv)
    add_targets(path)
    return path


if __name__ == "__main__":
    main()
