"""NumPy + ml_dtypes references for MoE routing and token movement: the truth the ``moe`` ops
are compared with (``docs/numerics.md``, section "MoE routing and movement").

Notation: ``f`` widens bf16/fp16/fp32 to float32, ``r`` rounds float32 to the activation dtype T
(:func:`to_dtype`), ``r32`` is one float32 rounding; every other operation is one IEEE float32
operation (NumPy float32 arithmetic never fuses). ``exp32(x) = r32(exp(float64(x)))``.

* selection ("top-k by score"): repeated argmax over the candidates not yet chosen, NaN the
  largest, ties to the lowest index; results in selection order;
* ``topk_softmax``: ``m = max x`` (NaN ignored), ``e = exp32(r32(x - m))``, ``S = r32(fsum(e))``,
  ``p = r32(e * r32(1 / S))``; ``topk_sigmoid``: ``p = r32(1 / r32(1 + exp32(-x)))``; the score
  is ``p`` or ``r32(p + bias)``, the weight the unbiased ``p``; renormalised ``w / D``, ``D`` the
  float32 sum of the ``k`` weights in selection order (``D = 0`` -> 1);
  ``token_expert_indices[t, j] = j * M + t``;
* ``grouped_topk``: group score ``r32(a + b)`` of the group's two best scores with a bias, else
  its best score; ``topk_group`` groups, then ``k`` experts inside them; weights renormalised,
  then ``r32(w * r32(routed_scaling_factor))``;
* ``moe_align_block_size``: per expert the flat indices ``i`` of ``topk_ids`` (ascending),
  padded with ``N = topk_ids.size`` to a multiple of ``block_size``, experts back to back in
  ascending order, ids outside ``[0, E)`` dropped; ``expert_ids`` one entry a block
  (``expert_map[e]`` with a map; -1 past the segments);
* ``moe_permute``: ``out[p] = x[sorted_token_ids[p] // k]`` (bits), zeros for padding; FP8:
  :func:`~loomnb.oracle.activation.dynamic_per_token_scaled_fp8_quant` of those rows;
* ``moe_unpermute``: ``out[t] = r(acc)``, ``acc = r32(acc + r32(w[t, j] * f(y[pos(t*k + j)])))``
  for ``j = 0..k-1`` from ``acc = 0`` (a flat index found nowhere adds nothing);
* ``moe_sum``: ``k`` in 2..4: ``x = r(f(x) + f(in_j))`` from ``x = r(0)`` (a rounding every
  add); other ``k`` (1 too): ``r(float32 sum over j from +0.0)``.

Arguments are NumPy arrays (bf16 as ``ml_dtypes.bfloat16``, FP8 as ``uint8`` codes or
``ml_dtypes.float8_e4m3fn``); results are NumPy (weights float32, ids int32). ``out``-style
arguments are written and returned; ``stream`` and ``launch_key`` are accepted and ignored. The
oracles compute; they do not validate.
"""

import math

import numpy as np

from .activation import dynamic_per_token_scaled_fp8_quant
from .numerics import to_dtype

__all__ = ["topk_softmax", "topk_sigmoid", "grouped_topk", "moe_align_block_size", "moe_permute",
           "moe_unpermute", "moe_sum"]

F32 = np.float32


def _errs():
    return np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore")


def _exp32(x):
    """``r32(exp(float64(x)))``."""
    with _errs():
        return np.exp(np.asarray(x, F32).astype(np.float64)).astype(F32)


def _rows_f32(gating_output):
    g = np.asarray(gating_output)
    return g.reshape(-1, g.shape[-1]).astype(F32)


def _softmax_scores(x):
    """float32 ``p [M, E]`` of float32 logits ``x [M, E]`` (module docstring)."""
    M, E = x.shape
    finite_or_inf = np.where(np.isnan(x), F32(-np.inf), x)
    m = np.max(finite_or_inf, axis=-1, keepdims=True, initial=F32(-np.inf)).astype(F32)
    with _errs():
        e = _exp32((x - m).astype(F32))
    S = np.array([F32(math.fsum(e[t].astype(np.float64).tolist())) if E else F32(0)
                  for t in range(M)], F32).reshape(M, 1)
    with _errs():
        inv = (F32(1) / S).astype(F32)
        return (e * inv).astype(F32)


def _sigmoid_scores(x):
    """float32 ``p = r32(1 / r32(1 + exp32(-x)))``."""
    with _errs():
        d = (F32(1) + _exp32(-x)).astype(F32)
        return (F32(1) / d).astype(F32)


def _biased(p, bias):
    if bias is None:
        return p
    b = np.asarray(bias).astype(F32).reshape(1, -1)
    with _errs():
        return (p + b).astype(F32)


def _select(s, k, allowed=None):
    """Indices ``[M, k]`` (int64) of the top ``k`` of the rows of ``s`` by the selection rule: NaN
    largest, then larger values, then lower indices; candidates with ``allowed`` False last."""
    s = np.asarray(s, F32)
    M, E = s.shape
    nan = np.isnan(s)
    value = np.where(nan, F32(0), s).astype(np.float64)
    idx = np.broadcast_to(np.arange(E), (M, E))
    keys = [idx, -value, ~nan]
    if allowed is not None:
        keys.append(~np.asarray(allowed, bool))
    order = np.lexsort(keys, axis=-1)  # the last key is the primary one
    return order[:, :k]


def _renormalize(w):
    """``r32(w_j / D)``, ``D`` the float32 sum of the row in order (``D == 0`` -> 1)."""
    D = np.zeros((w.shape[0],), F32)
    with _errs():
        for j in range(w.shape[1]):
            D = (D + w[:, j]).astype(F32)
        D = np.where(D == 0, F32(1), D).astype(F32)
        return (w / D[:, None]).astype(F32)


def _put(out, y):
    if out is None:
        return y
    np.asarray(out)[...] = y
    return out


def _topk(p, topk, renormalize, bias, topk_weights, topk_ids, token_expert_indices):
    M = p.shape[0]
    ids = _select(_biased(p, bias), topk)
    w = np.take_along_axis(p, ids, axis=-1).astype(F32)
    if renormalize:
        w = _renormalize(w)
    tei = (np.arange(topk)[None, :] * M + np.arange(M)[:, None]).astype(np.int32)
    return (_put(topk_weights, w), _put(topk_ids, ids.astype(np.int32)),
            _put(token_expert_indices, tei))


def topk_softmax(gating_output, topk, renormalize=False, *, e_score_correction_bias=None,
                 topk_weights=None, topk_ids=None, token_expert_indices=None, stream=None,
                 launch_key=None):
    """Reference ``topk_softmax``: float32 softmax ``p`` of each row (``exp32``, a float64 sum
    rounded once, ``p = r32(e * r32(1/S))``), the ``topk`` experts by the selection rule on ``p``
    (or ``r32(p + bias)``), their unbiased ``p`` (renormalised if asked). Returns
    ``(topk_weights f32 [M, k], topk_ids i32 [M, k], token_expert_indices i32 [M, k])``."""
    p = _softmax_scores(_rows_f32(gating_output))
    return _topk(p, int(topk), renormalize, e_score_correction_bias, topk_weights, topk_ids,
                 token_expert_indices)


def topk_sigmoid(gating_output, topk, renormalize=False, *, e_score_correction_bias=None,
                 topk_weights=None, topk_ids=None, token_expert_indices=None, stream=None,
                 launch_key=None):
    """Reference ``topk_sigmoid``: as :func:`topk_softmax` with ``p = r32(1 / r32(1 +
    exp32(-x)))``."""
    p = _sigmoid_scores(_rows_f32(gating_output))
    return _topk(p, int(topk), renormalize, e_score_correction_bias, topk_weights, topk_ids,
                 token_expert_indices)


def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                 topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                 e_score_correction_bias=None, *, topk_weights=None, topk_ids=None, stream=None,
                 launch_key=None):
    """Reference ``grouped_topk`` (DeepSeek-V2/V3 routing): scores ``p`` as :func:`topk_softmax`
    or :func:`topk_sigmoid`, ``s = r32(p + bias)`` (or ``p``); group score ``r32(a + b)`` of the
    group's two best ``s`` with a bias, else its best; ``topk_group`` groups and then ``topk``
    experts within them by the selection rule; weights the unbiased ``p``, renormalised if asked,
    then times ``r32(routed_scaling_factor)`` when that is not 1. ``hidden_states`` is not read.
    Returns ``(topk_weights f32 [M, k], topk_ids i32 [M, k])``."""
    x = _rows_f32(gating_output)
    M, E = x.shape
    p = _softmax_scores(x) if scoring_func == "softmax" else _sigmoid_scores(x)
    s = _biased(p, e_score_correction_bias)
    G = int(num_expert_group)
    per = E // G
    sg = s.reshape(M * G, per)
    if e_score_correction_bias is not None:
        two = np.take_along_axis(sg, _select(sg, 2), axis=-1)
        with _errs():
            gs = (two[:, 0] + two[:, 1]).astype(F32)
    else:
        gs = np.take_along_axis(sg, _select(sg, 1), axis=-1)[:, 0]
    groups = _select(gs.reshape(M, G), int(topk_group))
    chosen = np.zeros((M, G), bool)
    np.put_along_axis(chosen, groups, True, axis=-1)
    ids = _select(s, int(topk), allowed=np.repeat(chosen, per, axis=-1))
    w = np.take_along_axis(p, ids, axis=-1).astype(F32)
    if renormalize:
        w = _renormalize(w)
    if routed_scaling_factor != 1.0:
        with _errs():
            w = (w * F32(routed_scaling_factor)).astype(F32)
    return _put(topk_weights, w), _put(topk_ids, ids.astype(np.int32))


def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, *, sorted_token_ids=None, expert_ids=None,
                         num_tokens_post_pad=None, stream=None, launch_key=None):
    """Reference ``moe_align_block_size``: ``L = N + E*(bs - 1)`` (rounded up to ``bs`` with
    ``pad_sorted_ids``; ``min(L, N*bs)`` when ``N < E``); expert ``e``'s flat indices ascending at
    ``offsets[e]`` (the exclusive prefix sum of the counts rounded up to ``bs``), every other entry
    ``N``; ``expert_ids`` the expert of each block, mapped through ``expert_map`` when given, and
    -1 past ``num_tokens_post_pad``. Ids outside ``[0, E)`` belong to no expert. Returns
    ``(sorted_token_ids i32 [L], expert_ids i32 [ceil(L/bs)], num_tokens_post_pad i32 [1])``."""
    flat = np.asarray(topk_ids).reshape(-1).astype(np.int64)
    N, E, bs = flat.shape[0], int(num_experts), int(block_size)
    L = N + E * (bs - 1)
    if pad_sorted_ids:
        L = -(-L // bs) * bs
    if N < E:
        L = min(L, N * bs)
    valid = (flat >= 0) & (flat < E)
    counts = np.bincount(flat[valid], minlength=E)[:E]
    padded = -(-counts // bs) * bs
    offsets = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
    total = int(offsets[-1])
    sorted_ids = np.full((L,), N, np.int32)
    blocks = np.full((-(-L // bs),), -1, np.int32)
    emap = None if expert_map is None else np.asarray(expert_map).astype(np.int32)
    for e in range(E):
        members = np.flatnonzero(flat == e)
        sorted_ids[offsets[e]:offsets[e] + members.shape[0]] = members
        blocks[offsets[e] // bs:offsets[e + 1] // bs] = e if emap is None else emap[e]
    return (_put(sorted_token_ids, sorted_ids), _put(expert_ids, blocks),
            _put(num_tokens_post_pad, np.array([total], np.int32)))


def _gather_rows(hidden_states, sorted_token_ids, topk):
    x = np.asarray(hidden_states)
    ids = np.asarray(sorted_token_ids).reshape(-1).astype(np.int64)
    M = x.shape[0]
    real = (ids >= 0) & (ids < M * int(topk))
    rows = np.zeros((ids.shape[0],) + x.shape[1:], x.dtype)
    rows[real] = x[ids[real] // int(topk)]
    return rows


def moe_permute(hidden_states, sorted_token_ids, topk, quant_dtype="none", scale_ub=None, *,
                out=None, scales=None, stream=None, launch_key=None):
    """Reference ``moe_permute``: row ``p`` is ``hidden_states[sorted_token_ids[p] // topk]``
    (bits) where ``0 <= sorted_token_ids[p] < M * topk``, else zeros. Returns ``(out [L, H],
    scales)``: ``quant_dtype`` ``"none"`` (or None): ``out`` in hidden_states' dtype, ``scales``
    empty ``[0, 1]``; ``"fp8"``: ``out`` E4M3 and ``scales [L, 1]`` float32, the rows quantised
    as :func:`~loomnb.oracle.activation.dynamic_per_token_scaled_fp8_quant` (``scale_ub``
    passed on; a padding row has zero codes and the floor scale)."""
    rows = _gather_rows(hidden_states, sorted_token_ids, topk)
    if quant_dtype is None or quant_dtype == "none":
        return _put(out, rows), np.zeros((0, 1), F32)
    return dynamic_per_token_scaled_fp8_quant(rows, scale_ub, out, scales=scales)


def moe_unpermute(permuted, sorted_token_ids, topk_weights, *, out=None, stream=None,
                  launch_key=None):
    """Reference ``moe_unpermute``: ``out[t, h] = r(acc)`` with ``acc = r32(acc + r32(w[t, j] *
    f(permuted[pos(t*k + j), h])))`` for ``j = 0..k-1`` in order from ``acc = 0``, ``pos(i)`` the
    position of ``i`` in ``sorted_token_ids`` (an ``i`` missing from it adds nothing).
    Returns ``out [M, H]`` in ``permuted``'s dtype."""
    y = np.asarray(permuted)
    w = np.asarray(topk_weights, F32)
    M, k = w.shape
    ids = np.asarray(sorted_token_ids).reshape(-1).astype(np.int64)
    n = M * k
    pos = np.full((n,), -1, np.int64)
    hit = np.flatnonzero((ids >= 0) & (ids < n))
    pos[ids[hit]] = hit
    yf = np.concatenate([y.astype(F32), np.zeros((1,) + y.shape[1:], F32)])  # row -1: zeros
    acc = np.zeros((M,) + y.shape[1:], F32)
    lead = (M,) + (1,) * (y.ndim - 1)
    with _errs():
        for j in range(k):
            p = pos[np.arange(M) * k + j]
            term = (w[:, j].reshape(lead) * yf[p]).astype(F32)
            acc = np.where((p >= 0).reshape(lead), (acc + term).astype(F32), acc)
    return _put(out, to_dtype(acc, y.dtype))


def moe_sum(input, *, out=None, stream=None, launch_key=None):
    """Reference ``moe_sum`` (vLLM's ``_moe_C.moe_sum``) of ``input [M, k, H]``: ``k`` in 2..4,
    ``x = r(f(x) + f(input[:, j]))`` from ``x = r(0)``, rounded to T every add; any other ``k``,
    ``r(acc)`` of the float32 sum ``acc = acc + f(input[:, j])`` in order from ``acc = +0.0`` (``k = 1``
    too: -0.0 becomes +0.0, NaN canonical, as torch's sum). Returns ``out [M, H]``."""
    x = np.asarray(input)
    k = x.shape[1]
    T = x.dtype
    with _errs():
        if 2 <= k <= 4:
            acc = to_dtype(np.zeros((x.shape[0],) + x.shape[2:], F32), T)
            for j in range(k):
                acc = to_dtype((acc.astype(F32) + x[:, j].astype(F32)).astype(F32), T)
            return _put(out, acc)
        acc = np.zeros((x.shape[0],) + x.shape[2:], F32)
        for j in range(k):
            acc = (acc + x[:, j].astype(F32)).astype(F32)
    return _put(out, to_dtype(acc, T))
