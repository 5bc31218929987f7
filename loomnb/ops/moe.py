"""MoE routing and token movement around the grouped GEMM: ``topk_softmax``, ``topk_sigmoid``,
``grouped_topk``, ``moe_align_block_size``, ``moe_permute``, ``moe_unpermute`` and
``moe_sum``.

A mixture-of-experts layer routes each token to ``topk`` of ``num_experts`` experts (the
routing ops: scores from the router's logits, a top-k, optionally DeepSeek's group
restriction), sorts the ``num_tokens * topk`` (token, expert) pairs into per-expert segments
padded to the GEMM's block size (``moe_align_block_size``), runs the experts' GEMMs (torch,
cuBLAS or a grouped GEMM: not loomnb's), and combines each token's ``topk`` expert outputs
weighted by the routing weights (``moe_unpermute``, or vLLM's ``moe_sum`` after a GEMM that
already scattered and weighted its rows). ``moe_permute`` gathers the token rows into the
sorted order (optionally quantised to FP8 per token) for a GEMM that reads them densely.

Shapes: ``num_tokens`` (M), ``num_experts`` (E), ``topk`` (k), ``hidden_size`` (H); the flat
index of pair ``(t, j)`` is ``t * k + j``. Bytes moved (the benchmark's model): routing reads
``M * E`` logits and writes ``12 * M * k`` bytes; align reads the ``M * k`` ids once per pass
and writes ``4 * L`` bytes; ``moe_permute`` reads and writes ``L`` rows, ``moe_unpermute``
reads ``M * k`` rows and writes ``M``; ``moe_sum`` reads ``M * k`` rows and writes ``M``.

The rounding rules, and where they differ from vLLM, are in ``docs/numerics.md`` ("MoE
routing and movement"); each op's docstring states them too.
"""

from __future__ import annotations

import math

from .. import _adapter as ad
from ..checks import check_kind, check_same_device, fail_value
from . import _contract as C
from . import _launch as L
from . import _workspace as W
from ._moe_kernels import (ALIGN_PER, F_BIAS, F_GROUPED, F_RENORM, F_SCALED, F_TEI, FP8_WARPS,
                           KINDS, MAX_EXPERTS, MAX_TOPK, ROUTE_WARPS, ROW_SLOTS, ROW_UNITS,
                           AlignSpec, InverseSpec, RouteSpec, RowsSpec, align_kernel, align_warps,
                           ch_for, inverse_kernel, route_kernel, rows_kernel, vpl_for)
from ._torch_ops import torch_op

__all__ = ["topk_softmax", "topk_sigmoid", "grouped_topk", "moe_align_block_size",
           "moe_permute", "moe_unpermute", "moe_sum"]

ALIGN_CHUNK = 8192   # flat ids a thread block of the align's passes owns at most
ROW_THREADS = 256    # threads of a row kernel at most
SCORING = ("softmax", "sigmoid")

_RAISES = """Raises ``LoomnbTypeError`` (a ``TypeError``) for a wrong dtype or a host/unknown
    array and ``LoomnbValueError`` (a ``ValueError``) for shapes, layout, devices, overlapping
    or read-only outputs and out-of-range options -- before any launch. Zero tokens is a no-op
    (the outputs are allocated, empty)."""


# ------------------------------------------------------------------------------ checks
def _gating(op, obj):
    ga = ad.wrap(op, "gating_output", obj)
    check_kind(op, "gating_output", ga, KINDS)
    if ga.ndim != 2 or ga.shape[1] < 1:
        fail_value(op, "gating_output", "of shape [num_tokens, num_experts] with num_experts >= 1",
                   f"shape {list(ga.shape)}")
    if ga.shape[1] > MAX_EXPERTS:
        fail_value(op, "gating_output", f"at most {MAX_EXPERTS} experts",
                   f"{ga.shape[1]} experts")
    if ga.shape[0] > 0 and ga.shape[1] > 1 and ga.strides[1] != 1:
        fail_value(op, "gating_output", "contiguous in its last dimension (stride 1)",
                   f"strides {list(ga.strides)} (in elements)")
    return ga


def _topk(op, topk, limit, what):
    return C.integer(op, "topk", topk, 1, min(limit, MAX_TOPK),
                     expected=f"1 <= topk <= min({what}, {MAX_TOPK})")


def _bias(op, obj, ga):
    if obj is None:
        return None
    ba = ad.wrap(op, "e_score_correction_bias", obj)
    check_kind(op, "e_score_correction_bias", ba, ("f32",))
    if ba.shape != (ga.shape[1],):
        fail_value(op, "e_score_correction_bias", f"of shape [num_experts] = [{ga.shape[1]}]",
                   f"shape {list(ba.shape)}")
    check_same_device(op, "e_score_correction_bias", ba, "gating_output", ga)
    return ba


def _route(op, spec, ga, ba, wa, ia, ta, k, groups, topk_group, scale, flags, stream, key):
    M, E = ga.shape
    if M == 0:
        return
    threads = min(L.forced_threads() or 32 * min(ROUTE_WARPS, M), 32 * ROUTE_WARPS)
    params = [L.array(ga), L.array(ba) if ba is not None else L.absent("float32", 1),
              L.array(wa), L.array(ia), L.array(ta) if ta is not None else L.absent("int32", 2),
              L.i64(E), L.i64(k), L.i64(groups), L.i64(topk_group), L.f32(scale), L.i64(flags)]
    L.launch(route_kernel, spec, -(-M // (threads // 32)), threads, params, like=ga,
             stream=stream, key=key)


def _fake_route3(gating_output, topk, *_, **__):
    m = gating_output.shape[0]
    t = ad._torch
    return (gating_output.new_empty((m, topk), dtype=t.float32),
            gating_output.new_empty((m, topk), dtype=t.int32),
            gating_output.new_empty((m, topk), dtype=t.int32))


def _topk_route(op, score, gating_output, topk, renormalize, bias, topk_weights, topk_ids,
                token_expert_indices, stream, launch_key):
    ga = _gating(op, gating_output)
    M, E = ga.shape
    k = _topk(op, topk, E, "num_experts")
    C.flag(op, "renormalize", renormalize)
    ba = _bias(op, bias, ga)
    wa = C.output(op, "topk_weights", topk_weights, like=ga, kind="f32", shape=(M, k),
                  like_name="gating_output")
    ia = C.output(op, "topk_ids", topk_ids, like=ga, kind="i32", shape=(M, k),
                  like_name="gating_output")
    ta = C.output(op, "token_expert_indices", token_expert_indices, like=ga, kind="i32",
                  shape=(M, k), like_name="gating_output")
    C.no_overlap(op, {"topk_weights": wa, "topk_ids": ia, "token_expert_indices": ta},
                 {"gating_output": ga, "e_score_correction_bias": ba})
    flags = F_TEI | (F_BIAS if ba is not None else 0) | (F_RENORM if renormalize else 0)
    _route(op, RouteSpec(ga.kind, score, vpl_for(E)), ga, ba, wa, ia, ta, k, 0, 0, 1.0, flags,
           stream, launch_key)
    return wa.obj, ia.obj, ta.obj


_ROUTE_DOC = """

    Per token, in float32: {scores}; the selection score ``s_i = r32(p_i + bias_i)`` with
    ``e_score_correction_bias`` (else ``p_i``). The ``topk`` experts of largest ``s`` are
    picked one at a time -- NaN counts as the largest, the lowest expert wins ties -- so
    ``topk_ids[t]`` is in descending order of ``s``; ``topk_weights[t, j]`` is the picked
    expert's unbiased ``p``, divided by ``r32(sum_j w_j)`` (a float32 sum in pick order; 1
    where it is 0) when ``renormalize``; ``token_expert_indices[t, j] = j * num_tokens + t``.

    Args:
        gating_output: ``[num_tokens, num_experts]`` bf16/fp16/fp32 router logits
            (``num_experts <= 1024``), last dimension contiguous. Not modified.
        topk: experts a token, ``1 <= topk <= min(num_experts, 32)``.
        renormalize: divide the weights by their sum (a bool).
        e_score_correction_bias: optional ``[num_experts]`` float32 (DeepSeek-V3's
            correction bias): changes which experts are picked, not their weights.
        topk_weights, topk_ids, token_expert_indices: optional outputs ``[num_tokens, topk]``
            float32 / int32 / int32; allocated when None.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(topk_weights, topk_ids, token_expert_indices)``. Mutates only the outputs.

    {raises}

    Matches vLLM 0.24's ``torch.ops._moe_C.{vllm}(topk_weights, topk_indices,
    token_expert_indices, gating_output, renormalize, bias)``. vLLM sums the softmax in float32
    in its own order, so weights agree to a few float32 ulps and ids are the same except where
    two scores are that close; vLLM's order among exactly equal scores is its own.
    """


@torch_op("Tensor gating_output, int topk, bool renormalize=False, *, "
          "Tensor? e_score_correction_bias=None",
          outputs=("topk_weights", "topk_ids", "token_expert_indices"), fake=_fake_route3)
def topk_softmax(gating_output, topk, renormalize=False, *, e_score_correction_bias=None,
                 topk_weights=None, topk_ids=None, token_expert_indices=None, stream=None,
                 launch_key=None):
    return _topk_route("loomnb.topk_softmax", "softmax", gating_output, topk, renormalize,
                       e_score_correction_bias, topk_weights, topk_ids, token_expert_indices,
                       stream, launch_key)


@torch_op("Tensor gating_output, int topk, bool renormalize=False, *, "
          "Tensor? e_score_correction_bias=None",
          outputs=("topk_weights", "topk_ids", "token_expert_indices"), fake=_fake_route3)
def topk_sigmoid(gating_output, topk, renormalize=False, *, e_score_correction_bias=None,
                 topk_weights=None, topk_ids=None, token_expert_indices=None, stream=None,
                 launch_key=None):
    return _topk_route("loomnb.topk_sigmoid", "sigmoid", gating_output, topk, renormalize,
                       e_score_correction_bias, topk_weights, topk_ids, token_expert_indices,
                       stream, launch_key)


_SOFTMAX = ("``x_i = f(g_i)``, ``m = max_i x_i`` (NaN ignored), ``e_i = r32(exp(r32(x_i - "
            "m)))``, ``S = r32(sum_i e_i)`` (summed in float64), ``p_i = r32(e_i * r32(1 / S))``")
_SIGMOID = "``p_i = r32(1 / r32(1 + r32(exp(-f(g_i)))))``"
topk_softmax.__doc__ = ("Top-k softmax routing (Mixtral, Qwen3-MoE): each token's ``topk`` "
                        "experts and their weights." + _ROUTE_DOC.format(
                            scores=_SOFTMAX, raises=_RAISES, vllm="topk_softmax"))
topk_sigmoid.__doc__ = ("Top-k sigmoid routing (Llama-4, DeepSeek-style scores without "
                        "groups): each token's ``topk`` experts and their weights."
                        + _ROUTE_DOC.format(scores=_SIGMOID, raises=_RAISES,
                                            vllm="topk_sigmoid"))


def _fake_grouped(hidden_states, gating_output, topk, *_, **__):
    m = gating_output.shape[0]
    t = ad._torch
    return (gating_output.new_empty((m, topk), dtype=t.float32),
            gating_output.new_empty((m, topk), dtype=t.int32))


@torch_op("Tensor hidden_states, Tensor gating_output, int topk, bool renormalize, "
          "int num_expert_group=0, int topk_group=0, str scoring_func='softmax', "
          "float routed_scaling_factor=1.0, Tensor? e_score_correction_bias=None",
          outputs=("topk_weights", "topk_ids"), fake=_fake_grouped)
def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                 topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                 e_score_correction_bias=None, *, topk_weights=None, topk_ids=None, stream=None,
                 launch_key=None):
    """Grouped top-k routing (DeepSeek-V2/V3): the experts form ``num_expert_group`` groups of
    ``E / G``; a token keeps its ``topk_group`` best groups and picks ``topk`` experts in them.

    Scores ``p`` in float32 as :func:`topk_softmax` (``"softmax"``) or :func:`topk_sigmoid`
    (``"sigmoid"``) compute them, ``s = r32(p + bias)`` with a bias (else ``p``). A group's
    score is, with a bias, ``r32(a + b)`` of its two largest ``s`` (``a`` the larger), else
    its largest ``s``. The ``topk_group`` groups of largest score are kept, then the ``topk``
    experts of largest ``s`` among theirs picked -- NaN largest, the lower index winning ties,
    ``topk_ids[t]`` in pick order. ``topk_weights`` are the picked unbiased ``p``, divided by
    ``r32(sum_j w_j)`` (float32, pick order; 1 where 0) when ``renormalize``, then multiplied
    by ``r32(routed_scaling_factor)`` when it is not 1.

    Args:
        hidden_states: any array with ``shape[0] == num_tokens`` (vLLM's signature: only its
            first dimension is checked; never read).
        gating_output: ``[num_tokens, num_experts]`` bf16/fp16/fp32, last dimension contiguous,
            ``num_experts <= 1024`` and a multiple of ``num_expert_group``. Not modified.
        topk: ``1 <= topk <= min(topk_group * num_experts / num_expert_group, 32)``.
        renormalize: a bool.
        num_expert_group: ``G``, ``1 <= G <= 32``.
        topk_group: ``1 <= topk_group <= G``.
        scoring_func: ``"softmax"`` or ``"sigmoid"``.
        routed_scaling_factor: a finite float.
        e_score_correction_bias: optional ``[num_experts]`` float32; with it every group needs
            at least 2 experts.
        topk_weights, topk_ids: optional outputs ``[num_tokens, topk]`` float32 / int32.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(topk_weights, topk_ids)``. Mutates only the outputs.

    {raises}

    Matches vLLM 0.24's ``grouped_topk`` (``fused_moe/router/grouped_topk_router.py``, and its
    fused CUDA op ``_moe_C.grouped_topk`` taken when a bias is given). Where loomnb differs:
    vLLM computes the scores in the logits' dtype (bf16 logits give bf16-rounded scores;
    loomnb's are float32 from the exact widening) and returns ``torch.topk(sorted=False)``'s
    order; loomnb's order is the pick order.
    """
    op = "loomnb.grouped_topk"
    ga = _gating(op, gating_output)
    M, E = ga.shape
    ha = ad.wrap(op, "hidden_states", hidden_states)
    if ha.ndim < 1 or ha.shape[0] != M:
        fail_value(op, "hidden_states", f"shape[0] == num_tokens ({M})", f"shape {list(ha.shape)}")
    C.flag(op, "renormalize", renormalize)
    G = C.integer(op, "num_expert_group", num_expert_group, 1, 32,
                  expected="1 <= num_expert_group <= 32")
    if E % G:
        fail_value(op, "num_expert_group", f"a divisor of num_experts ({E})", repr(G))
    tg = C.integer(op, "topk_group", topk_group, 1, G, expected=f"1 <= topk_group <= {G}")
    k = _topk(op, topk, tg * (E // G), "topk_group * num_experts / num_expert_group")
    score = C.choice(op, "scoring_func", scoring_func, SCORING)
    scale = C.real(op, "routed_scaling_factor", routed_scaling_factor)
    ba = _bias(op, e_score_correction_bias, ga)
    if ba is not None and E // G < 2:
        fail_value(op, "num_expert_group", "groups of at least 2 experts with "
                   "e_score_correction_bias (a group scores its best two)", f"{E // G} a group")
    wa = C.output(op, "topk_weights", topk_weights, like=ga, kind="f32", shape=(M, k),
                  like_name="gating_output")
    ia = C.output(op, "topk_ids", topk_ids, like=ga, kind="i32", shape=(M, k),
                  like_name="gating_output")
    C.no_overlap(op, {"topk_weights": wa, "topk_ids": ia},
                 {"gating_output": ga, "e_score_correction_bias": ba})
    flags = (F_GROUPED | (F_BIAS if ba is not None else 0) | (F_RENORM if renormalize else 0)
             | (F_SCALED if scale != 1.0 else 0))
    _route(op, RouteSpec(ga.kind, score, vpl_for(E)), ga, ba, wa, ia, None, k, G, tg, scale,
           flags, stream, launch_key)
    return wa.obj, ia.obj


grouped_topk.__doc__ = grouped_topk.__doc__.replace("{raises}", _RAISES)


# ------------------------------------------------------------------------------ align
def align_sizes(num_pairs, num_experts, block_size, pad_sorted_ids):
    """``(L, num_blocks)``: ``sorted_token_ids``' and ``expert_ids``' lengths, as vLLM's
    ``moe_align_block_size`` allocates them."""
    n = num_pairs + num_experts * (block_size - 1)
    if pad_sorted_ids:
        n = -(-n // block_size) * block_size
    if num_pairs < num_experts:
        n = min(num_pairs * block_size, n)
    return n, -(-n // block_size)


def _fake_align(topk_ids, block_size, num_experts, expert_map=None, pad_sorted_ids=False, *_,
                **__):
    t = ad._torch
    n, nb = align_sizes(topk_ids.numel(), num_experts, block_size, pad_sorted_ids)
    return (topk_ids.new_empty((n,), dtype=t.int32), topk_ids.new_empty((nb,), dtype=t.int32),
            topk_ids.new_empty((1,), dtype=t.int32))


@torch_op("Tensor topk_ids, int block_size, int num_experts, Tensor? expert_map=None, "
          "bool pad_sorted_ids=False",
          outputs=("sorted_token_ids", "expert_ids", "num_tokens_post_pad"),
          stream_key="topk_ids", fake=_fake_align)
def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, *, sorted_token_ids=None, expert_ids=None,
                         num_tokens_post_pad=None, stream=None, launch_key=None):
    """Sort the ``num_tokens * topk`` (token, expert) pairs into per-expert segments padded to
    ``block_size`` -- the layout a blocked MoE GEMM (vLLM's ``fused_moe``) reads.

    With ``N = topk_ids.numel()``, ``count_e`` the pairs routed to expert ``e`` and
    ``padded_e = ceil(count_e / block_size) * block_size``, segment ``e`` starts at
    ``offset_e = sum_{e' < e} padded_e'`` and holds the flat indices ``i = t * topk + j`` of
    its pairs **in ascending order**, then the sentinel ``N``; every position past the last
    segment holds ``N`` too. ``expert_ids[b]`` is the expert of block ``b`` (``expert_map[e]``
    with a map, ``-1`` marking a non-local expert), and every block past
    ``num_tokens_post_pad / block_size`` holds -1 (no expert).
    ``num_tokens_post_pad[0] = sum_e padded_e``. Computed on the device, no host sync.

    Args:
        topk_ids: ``[num_tokens, topk]`` int32 or int64 (any layout with a flat view: C- or
            row-contiguous). Ids outside ``[0, num_experts)`` are dropped (counted nowhere,
            their flat index appears nowhere); vLLM's kernel would write out of bounds.
            Not modified.
        block_size: the GEMM's block of rows, ``>= 1``.
        num_experts: ``1 <= num_experts <= 1024`` (the global count under expert parallelism).
        expert_map: optional ``[num_experts]`` int32 global -> local expert ids (``-1``: not
            on this rank).
        pad_sorted_ids: round ``sorted_token_ids``' length up to a multiple of ``block_size``.
        sorted_token_ids, expert_ids, num_tokens_post_pad: optional int32 outputs of lengths
            ``L = N + E * (block_size - 1)`` (rounded up with ``pad_sorted_ids``; at most
            ``N * block_size`` when ``N < E``), ``ceil(L / block_size)`` and 1.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(sorted_token_ids, expert_ids, num_tokens_post_pad)``. Mutates only the outputs.

    {raises}

    Matches vLLM 0.24's ``moe_align_block_size`` (``fused_moe/moe_align_block_size.py`` over
    ``_moe_C.moe_align_block_size``) with ``ignore_invalid_experts=False``: the same lengths,
    counts, offsets, sentinels and ``expert_ids`` (with an ``expert_map``, vLLM's wrapper maps
    the tail's -1 too, to ``expert_map[-1]``: loomnb leaves it -1); vLLM's CUDA kernel orders a segment by
    atomics above its small-batch path (the same set of indices in an order that varies from
    run to run), loomnb always ascending -- the order of its small-batch path and of its Triton
    kernel. One launch up to ``ALIGN_PER`` ids a thread of one block (4,096 pairs at 128 or
    256 experts), two above.
    """
    op = "loomnb.moe_align_block_size"
    ia = ad.wrap(op, "topk_ids", topk_ids)
    check_kind(op, "topk_ids", ia, ("i32", "i64"))
    bs = C.integer(op, "block_size", block_size, 1, 1 << 20, expected="1 <= block_size")
    E = C.integer(op, "num_experts", num_experts, 1, MAX_EXPERTS,
                  expected=f"1 <= num_experts <= {MAX_EXPERTS}")
    C.flag(op, "pad_sorted_ids", pad_sorted_ids)
    flat = _flat(op, "topk_ids", ia)
    N = flat.shape[0]
    ma = None
    if expert_map is not None:
        ma = ad.wrap(op, "expert_map", expert_map)
        check_kind(op, "expert_map", ma, ("i32",))
        if ma.shape != (E,):
            fail_value(op, "expert_map", f"of shape [num_experts] = [{E}]", f"shape {list(ma.shape)}")
        check_same_device(op, "expert_map", ma, "topk_ids", ia)
    n, nb = align_sizes(N, E, bs, pad_sorted_ids)
    sa = C.output(op, "sorted_token_ids", sorted_token_ids, like=ia, kind="i32", shape=(n,),
                  like_name="topk_ids")
    ea = C.output(op, "expert_ids", expert_ids, like=ia, kind="i32", shape=(nb,),
                  like_name="topk_ids")
    pa = C.output(op, "num_tokens_post_pad", num_tokens_post_pad, like=ia, kind="i32", shape=(1,),
                  like_name="topk_ids")
    C.no_overlap(op, {"sorted_token_ids": sa, "expert_ids": ea, "num_tokens_post_pad": pa},
                 {"topk_ids": ia, "expert_map": ma})
    threads, chunk = _align_config(N, E)
    chunks = max(1, -(-N // chunk))
    idt = "int32" if ia.kind == "i32" else "int64"
    emap = L.array(ma) if ma is not None else L.absent("int32", 1)
    if chunks == 1:
        params = [flat, emap, L.array(sa), L.array(ea), L.array(pa), L.absent("int32", 1),
                  L.absent("int32", 1), L.absent("uint32", 1), L.i64(N), L.i64(E), L.i64(bs),
                  L.i64(n), L.i64(max(N, 1)), L.i64(_shift(bs))]
        L.launch(align_kernel, AlignSpec(idt, ma is not None, "fused"), 1, threads, params,
                 like=ia, stream=stream, key=launch_key,
                 warm=lambda: _align_siblings(idt, ma is not None, params))
        return sa.obj, ea.obj, pa.obj
    counts = W.buffer("moe.align_counts", ia, stream, chunks * E, (), "int32")
    offsets = W.buffer("moe.align_offsets", ia, stream, E + 1, (), "int32")
    ctr = W.counters(ia, stream, 1)
    params = [flat, emap, L.array(sa), L.array(ea), L.array(pa), W.param(counts, "int32", ia),
              W.param(offsets, "int32", ia), W.param(ctr, "uint32", ia), L.i64(N), L.i64(E),
              L.i64(bs), L.i64(n), L.i64(chunk), L.i64(_shift(bs))]
    for i, part in enumerate(("count", "place")):
        L.launch(align_kernel, AlignSpec(idt, ma is not None, part), chunks, threads, params,
                 like=ia, stream=stream, key=launch_key, part=(i, 2))
    return sa.obj, ea.obj, pa.obj


moe_align_block_size.__doc__ = moe_align_block_size.__doc__.replace("{raises}", _RAISES)


def _align_config(N, E):
    """``(threads, chunk)`` of the align's blocks: enough threads for ``ALIGN_PER`` ids each
    (and at least one an expert, up to 256, for the prefix), as many as the shared per-warp
    counts allow; a block owns ``chunk`` ids (at most ``ALIGN_CHUNK``), so up to
    ``ALIGN_PER * threads`` ids take one launch."""
    most = 32 * align_warps(E)
    threads = min(L.forced_threads() or L.whole_warps(max(-(-N // ALIGN_PER), min(E, 256))),
                  most)
    return threads, min(ALIGN_CHUNK, ALIGN_PER * threads)


def _shift(bs):
    """``log2(bs)`` for a power of two (the kernels shift), else -1 (they divide)."""
    return bs.bit_length() - 1 if bs & (bs - 1) == 0 else -1


def _align_siblings(idt, emap, params):
    """The passes a larger call of the same op launches (compiled with the fused one)."""
    sig = L.argtypes(params)
    return [(align_kernel, AlignSpec(idt, emap, p), sig) for p in ("count", "place")]


def _flat(op, name, a):
    """The 1-D parameter over ``a``'s elements in C order (which must be equally spaced)."""
    n = math.prod(a.shape)
    if n == 0:
        return L.array(a, (0,), (1,))
    stride = None
    expect = None
    for size, st in reversed(list(zip(a.shape, a.strides))):
        if size == 1:
            continue
        if stride is None:
            stride, expect = st, st * size
        elif st != expect:
            fail_value(op, name, "an array whose elements, in C order, are equally spaced "
                       "(contiguous, or a row-contiguous view)", f"shape {list(a.shape)}, "
                       f"strides {list(a.strides)} (in elements)")
        else:
            expect = st * size
    return L.array(a, (n,), (stride or 1,))


# ------------------------------------------------------------------------------ rows
def _rows(op, name, obj, ndim):
    a = ad.wrap(op, name, obj)
    check_kind(op, name, a, KINDS)
    if a.ndim != ndim:
        fail_value(op, name, f"a {ndim}-D array", f"shape {list(a.shape)}")
    if a.shape[-1] > 1 and math.prod(a.shape) > 0 and a.strides[-1] != 1:
        fail_value(op, name, "contiguous in its last dimension (stride 1)",
                   f"strides {list(a.strides)} (in elements)")
    return a


def _sorted_ids(op, obj, like, like_name):
    a = ad.wrap(op, "sorted_token_ids", obj)
    check_kind(op, "sorted_token_ids", a, ("i32",))
    if a.ndim != 1:
        fail_value(op, "sorted_token_ids", "a 1-D array", f"shape {list(a.shape)}")
    check_same_device(op, "sorted_token_ids", a, like_name, like)
    return a


def _vector(arrs, H, kind):
    """Whether every row of each ``(array, unit_bytes)`` of ``arrs`` is whole aligned units
    (16 bytes; an FP8 output's unit is 8 or 4)."""
    if H % ROW_UNITS[kind]:
        return False
    for a, unit in arrs:
        if a.ptr % unit:
            return False
        for s in a.strides[:-1]:
            if (s * a.itemsize) % unit:
                return False
    return True


def _row_grid(rows, units, upt=1):
    """``(grid, threads)`` of a row kernel: ``(ceil(rows / upt), splits)`` blocks, each thread
    one unit of ``upt`` rows (a small call spreads its rows over more blocks)."""
    threads = L.forced_threads() or min(ROW_THREADS, L.whole_warps(units))
    return (-(-rows // upt), max(1, -(-units // threads))), threads


def _fp8_grid(rows):
    """A quantising permute's launch: one warp a row, ``FP8_WARPS`` rows a block."""
    warps = (L.forced_threads() or 32 * FP8_WARPS) // 32
    return -(-rows // warps), 32 * warps


def _sum_spec(kind, op, vec, k, round_each=False):
    """A combine / moe_sum variant: ``ch_for(k)`` rows a token at once in the vector layout."""
    return RowsSpec(kind, op, "vector" if vec else "scalar", round_each=round_each,
                    ch=ch_for(k) if vec else ROW_SLOTS)


def _words(a, vec):
    return L.array(a, words=True) if vec else L.array(a)


def _fp8_words(a, vec):
    """An FP8 output ``[rows, H]`` as uint32 words (vector) or uint8 codes."""
    if not vec:
        return L.ArrayParam(a, a.ptr, a.shape, a.strides, "uint8")
    return L.ArrayParam(a, a.ptr, (a.shape[0], a.shape[1] // 4), (a.strides[0] // 4, 1), "uint32")


def _fake_permute(hidden_states, sorted_token_ids, topk, quant_dtype="none", *_, **__):
    t = ad._torch
    n, h = sorted_token_ids.shape[0], hidden_states.shape[1]
    if quant_dtype != "fp8":
        return hidden_states.new_empty((n, h)), hidden_states.new_empty((0, 1), dtype=t.float32)
    return (hidden_states.new_empty((n, h), dtype=t.float8_e4m3fn),
            hidden_states.new_empty((n, 1), dtype=t.float32))


@torch_op("Tensor hidden_states, Tensor sorted_token_ids, int topk, str quant_dtype='none', "
          "Tensor? scale_ub=None", outputs=("out", "scales"), fake=_fake_permute)
def moe_permute(hidden_states, sorted_token_ids, topk, quant_dtype="none", scale_ub=None, *,
                out=None, scales=None, stream=None, launch_key=None):
    """Gather token rows into expert order: ``out[p] = hidden_states[sorted_token_ids[p] //
    topk]``, a row of zeros where ``sorted_token_ids[p] >= num_tokens * topk`` (a padding
    slot), so a GEMM can read each expert's rows as one dense, block-aligned slab.

    ``quant_dtype="fp8"``: the gathered rows are quantised to FP8 E4M3 per row, exactly as
    :func:`~loomnb.dynamic_per_token_scaled_fp8_quant` quantises them (``scale = max(min(amax,
    scale_ub) / 448, 1/(448*512))``, ``out = e4m3(clamp(f(x) / scale))``); a padding row gets
    codes 0 and the floor scale.

    Args:
        hidden_states: ``[num_tokens, hidden_size]`` bf16/fp16/fp32, last dimension contiguous.
            Not modified.
        sorted_token_ids: ``[L]`` int32, as :func:`moe_align_block_size` gives (ids ``< 0``
            are padding too).
        topk: experts a token (``sorted_token_ids`` holds ``t * topk + j``), ``>= 1``.
        quant_dtype: ``"none"`` (a bit copy) or ``"fp8"``.
        scale_ub: optional float32 one-element device array (FP8 only).
        out: optional ``[L, hidden_size]`` output, hidden_states' dtype (FP8:
            ``float8_e4m3fn`` or uint8); allocated when None.
        scales: FP8 only: optional float32 ``[L, 1]`` output.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(out, scales)`` (``scales`` empty ``[0, 1]`` without quantisation). Mutates only
    the outputs.

    {raises}

    vLLM's fused_moe reads rows through ``sorted_token_ids`` inside its GEMM; its
    ``moe_permute`` (``moe_permute_unpermute_op.cu``) returns more (an inverse permutation and
    expert offsets) and orders rows by its own sort. This op is the gather a dense grouped GEMM
    needs, in :func:`moe_align_block_size`'s order.
    """
    op = "loomnb.moe_permute"
    ha = _rows(op, "hidden_states", hidden_states, 2)
    sa = _sorted_ids(op, sorted_token_ids, ha, "hidden_states")
    k = C.integer(op, "topk", topk, 1, 1 << 20, expected="1 <= topk")
    q = C.choice(op, "quant_dtype", quant_dtype, ("none", "fp8")) == "fp8"
    M, H = ha.shape
    n = sa.shape[0]
    ua = None
    if scale_ub is not None:
        if not q:
            fail_value(op, "scale_ub", "None without quant_dtype='fp8'", "an array")
        ua = C.one_element(op, "scale_ub", scale_ub, ha, like_name="hidden_states")
    if not q:
        oa = C.output(op, "out", out, like=ha, kind=ha.kind, shape=(n, H),
                      like_name="hidden_states")
        if scales is not None:
            fail_value(op, "scales", "None without quant_dtype='fp8'", "an array")
        sc = C.output(op, "scales", None, like=ha, kind="f32", shape=(0, 1),
                      like_name="hidden_states")
    else:
        oa = C.output(op, "out", out, like=ha, kind=("fp8", "u8") if out is not None else "fp8",
                      shape=(n, H), like_name="hidden_states")
        sc = C.output(op, "scales", scales, like=ha, kind="f32", shape=(n, 1),
                      like_name="hidden_states")
    C.no_overlap(op, {"out": oa, "scales": sc}, {"hidden_states": ha, "sorted_token_ids": sa,
                                                 "scale_ub": ua})
    if n == 0 or (H == 0 and not q):  # an FP8 row of no elements still gets its scale
        return oa.obj, sc.obj
    if not q:
        vec = _vector([(ha, 16), (oa, 16)], H, ha.kind)
        spec = RowsSpec(ha.kind, "permute", "vector" if vec else "scalar")
        dst = _words(oa, vec)
    else:
        unit_out = ROW_UNITS[ha.kind]  # FP8 bytes of a unit
        vec = _vector([(ha, 16), (oa, unit_out)], H, ha.kind)
        spec = RowsSpec(ha.kind, "permute_fp8", "vector" if vec else "scalar",
                        scale_ub=ua is not None)
        dst = _fp8_words(oa, vec)
    units = H // ROW_UNITS[ha.kind] if vec else H
    params = [dst, _words(ha, vec), L.array(sa), L.absent("int32", 1), L.absent("float32", 2),
              L.array(sc),  # [0, 1] without quantisation: a replay allocates it too
              L.array(ua) if ua is not None else L.absent("float32", 1), L.i64(H), L.i64(k),
              L.i64(M * k)]
    grid, threads = _fp8_grid(n) if q else _row_grid(n, units, spec.upt)
    L.launch(rows_kernel, spec, grid, threads, params, like=ha, stream=stream, key=launch_key)
    return oa.obj, sc.obj


moe_permute.__doc__ = moe_permute.__doc__.replace("{raises}", _RAISES)


def _fake_unpermute(permuted, sorted_token_ids, topk_weights, *_, **__):
    return permuted.new_empty((topk_weights.shape[0], permuted.shape[1]))


@torch_op("Tensor permuted, Tensor sorted_token_ids, Tensor topk_weights", outputs=("out",),
          stream_key="permuted", fake=_fake_unpermute)
def moe_unpermute(permuted, sorted_token_ids, topk_weights, *, out=None, stream=None,
                  launch_key=None):
    """The weighted combine: each token's ``topk`` expert outputs, found in the sorted order,
    summed with its routing weights.

    ``out[t] = r(acc)``, ``acc = sum_j r32(topk_weights[t, j] * f(permuted[pos(t * topk +
    j)]))`` in float32, added in ``j`` order with one rounding an operation (no FMA), where
    ``pos(i)`` is the position of flat index ``i`` in ``sorted_token_ids``. A flat index that
    appears nowhere (its expert id was dropped) adds nothing.

    Args:
        permuted: ``[L, hidden_size]`` bf16/fp16/fp32 expert outputs in the sorted order
            (``L = len(sorted_token_ids)``), last dimension contiguous. Not modified.
        sorted_token_ids: ``[L]`` int32 from :func:`moe_align_block_size`.
        topk_weights: ``[num_tokens, topk]`` float32 (the routing weights). Not modified.
        out: optional ``[num_tokens, hidden_size]`` output in permuted's dtype.
        stream: CUDA stream; default the caller's current stream.

    Returns ``out``. Mutates only ``out`` (and a per-stream workspace of ``num_tokens * topk``
    int32, the inverse map, written by the first of two launches).

    {raises}

    In vLLM's fused_moe the second GEMM writes each row back to its flat position multiplied
    by its weight, and ``moe_sum`` adds a token's ``topk`` rows; this op does both after a GEMM
    that wrote the sorted order (a dense grouped GEMM).
    """
    op = "loomnb.moe_unpermute"
    pa = _rows(op, "permuted", permuted, 2)
    sa = _sorted_ids(op, sorted_token_ids, pa, "permuted")
    if sa.shape[0] != pa.shape[0]:
        fail_value(op, "sorted_token_ids", f"of shape [L] = [{pa.shape[0]}] (permuted's rows)",
                   f"shape {list(sa.shape)}")
    wa = ad.wrap(op, "topk_weights", topk_weights)
    check_kind(op, "topk_weights", wa, ("f32",))
    if wa.ndim != 2 or wa.shape[1] < 1:
        fail_value(op, "topk_weights", "of shape [num_tokens, topk] with topk >= 1",
                   f"shape {list(wa.shape)}")
    check_same_device(op, "topk_weights", wa, "permuted", pa)
    M, k = wa.shape
    H = pa.shape[1]
    oa = C.output(op, "out", out, like=pa, kind=pa.kind, shape=(M, H), like_name="permuted")
    C.no_overlap(op, {"out": oa}, {"permuted": pa, "sorted_token_ids": sa, "topk_weights": wa})
    if M == 0 or H == 0:
        return oa.obj
    inv = W.buffer("moe.inverse", pa, stream, M * k, (), "int32")
    invp = W.param(inv, "int32", pa)
    n = sa.shape[0]
    if n > 0:
        L.launch(inverse_kernel, InverseSpec(), -(-n // 256), 256,
                 [invp, L.array(sa), L.i64(M * k)], like=pa, stream=stream, key=launch_key,
                 part=(0, 2))
    vec = _vector([(pa, 16), (oa, 16)], H, pa.kind)
    units = H // ROW_UNITS[pa.kind] if vec else H
    params = [_words(oa, vec), _words(pa, vec), invp, L.array(sa), L.array(wa),
              L.absent("float32", 2), L.absent("float32", 1), L.i64(H), L.i64(k), L.i64(M * k)]
    spec = _sum_spec(pa.kind, "combine", vec, k)
    grid, threads = _row_grid(M, units, spec.upt)
    L.launch(rows_kernel, spec, grid, threads, params, like=pa, stream=stream, key=launch_key,
             part=(1, 2) if n > 0 else (0, 1))
    return oa.obj


moe_unpermute.__doc__ = moe_unpermute.__doc__.replace("{raises}", _RAISES)


def _fake_sum(input, *_, **__):
    return input.new_empty((input.shape[0], input.shape[2]))


@torch_op("Tensor input", outputs=("out",), fake=_fake_sum)
def moe_sum(input, *, out=None, stream=None, launch_key=None):
    """Sum each token's ``topk`` expert rows: vLLM's ``moe_sum``, bit for bit.

    ``topk`` in 2..4 (vLLM's kernel): ``x = r(0)``, then ``x = r(f(x) + f(input[t, j, h]))``
    for ``j = 0..topk-1`` (rounded to the dtype after every add); any other ``topk`` (vLLM's
    ``at::sum_out``): ``r(sum_j f(input[t, j, h]))``, a float32 sum in ``j`` order from +0.0
    (so ``topk = 1`` turns -0.0 into +0.0, as torch's sum does).

    Args:
        input: ``[num_tokens, topk, hidden_size]`` bf16/fp16/fp32, last dimension contiguous.
            Not modified.
        out: optional ``[num_tokens, hidden_size]`` output, input's dtype.
        stream: CUDA stream; default the caller's current stream.

    Returns ``out``. Mutates only ``out``.

    {raises}

    Matches vLLM 0.24's ``torch.ops._moe_C.moe_sum(input, output)``.
    """
    op = "loomnb.moe_sum"
    xa = _rows(op, "input", input, 3)
    M, k, H = xa.shape
    oa = C.output(op, "out", out, like=xa, kind=xa.kind, shape=(M, H), like_name="input")
    C.no_overlap(op, {"out": oa}, {"input": xa})
    if M == 0 or H == 0:
        return oa.obj
    vec = _vector([(xa, 16), (oa, 16)], H, xa.kind)
    units = H // ROW_UNITS[xa.kind] if vec else H
    spec = _sum_spec(xa.kind, "sum", vec, k, round_each=2 <= k <= 4 and xa.kind != "f32")
    params = [_words(oa, vec), _words(xa, vec), L.absent("int32", 1), L.absent("int32", 1),
              L.absent("float32", 2), L.absent("float32", 2), L.absent("float32", 1), L.i64(H),
              L.i64(k), L.i64(0)]
    grid, threads = _row_grid(M, units, spec.upt)
    L.launch(rows_kernel, spec, grid, threads, params, like=xa, stream=stream, key=launch_key)
    return oa.obj


moe_sum.__doc__ = moe_sum.__doc__.replace("{raises}", _RAISES)
