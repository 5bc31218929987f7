"""NumPy references for the logprob tail and Min-P: the truth the sampling kernels are tested on.

Per row of fp32 values ``x`` (bf16 logits are widened exactly):

* ``m`` = the largest non-NaN value (``-inf`` when none); ``S = sum_{x_v > -inf} exp(x_v - m)``
  in float64 (exact to ~1e-16), NaN when the row holds a NaN, a ``+inf`` (``inf - inf``) or
  only ``-inf``; ``L = r32(log(S))``;
* ``logprob(x) = r32(r32(x - m) - L)``: torch's ``log_softmax`` and V2's Triton kernel round
  in this order, so the only approximation left to the kernels is ``L`` (their ``expf`` terms);
* greedy token: ``torch.argmax`` (the first NaN if any, else the first maximum);
* rank V1: ``#{v : logprob_v >= logprob_t}`` over this fp32 logprob vector; V2:
  ``#{v : x_v >= x_t}`` plus ``ceil(V/8192)*8192 - V`` padding lanes when ``x_t = -inf``;
* top-k: NaN first, then larger ``x``, then lower index;
* Min-P V1: ``p_v = r32(r32(exp(r32(x_v - m))) / r32(S))`` (``exp`` correctly rounded here,
  ``expf`` within 2 ulp on the GPU), masked where ``p_v < r32(r32(1 / r32(S)) * min_p)``;
  V2: masked where ``x_v < r32(m + r32(log(min_p)))``; rows with ``min_p == 0`` untouched.

Arguments are NumPy arrays (bf16 as ``ml_dtypes.bfloat16``); ``stream`` is accepted and ignored
so the signatures equal the ops'. The oracles do not validate their arguments.
"""

import numpy as np

__all__ = ["greedy_sample_logprob", "selected_token_logprob_rank", "top_k_logprobs",
           "min_p_filter_"]

V2_BLOCK = 8192


def _f32(logits):
    return np.asarray(logits).astype(np.float32)


def row_stats(x):
    """``(m, L, S)`` per row of fp32 ``x [R, V]``: the largest non-NaN value, ``r32(log S)``
    and the float64 sum ``S`` (see the module docstring)."""
    x = np.asarray(x, np.float32)
    R = x.shape[0]
    m = np.full(R, -np.inf, np.float32)
    S = np.full(R, np.nan)
    for r in range(R):
        row = x[r]
        ok = ~np.isnan(row)
        if ok.any():
            m[r] = row[ok].max()
        if m[r] == -np.inf:
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            d = row.astype(np.float64) - np.float64(m[r])
            S[r] = np.sum(np.exp(d[row != -np.inf]))
    with np.errstate(invalid="ignore", divide="ignore"):
        L = np.log(S).astype(np.float32)
    return m, L, S


def logprobs_of(x, m, L):
    """``r32(r32(x - m) - L)`` elementwise, ``m``/``L`` per row (broadcast)."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        return (x - np.float32(m)) - np.float32(L)


def _greedy(x):
    nan = np.isnan(x)
    out = np.empty(x.shape[0], np.int64)
    for r in range(x.shape[0]):
        out[r] = np.argmax(nan[r]) if nan[r].any() else np.argmax(x[r])
    return out


def _rank(x, m, L, t, sampler):
    """Ranks of tokens ``t`` (int64 [R]) under ``sampler``; out-of-range ids rank 0."""
    R, V = x.shape
    ranks = np.zeros(R, np.int64)
    lps = np.full(R, np.nan, np.float32)
    pad = -(-V // V2_BLOCK) * V2_BLOCK - V
    for r in range(R):
        if not 0 <= t[r] < V:
            continue
        lp_all = logprobs_of(x[r], m[r], L[r])
        lps[r] = lp_all[t[r]]
        xt = x[r, t[r]]
        with np.errstate(invalid="ignore"):
            if sampler == "v1":
                ranks[r] = np.count_nonzero(lp_all >= lps[r])
            else:
                ranks[r] = np.count_nonzero(x[r] >= xt) + (pad if xt == -np.inf else 0)
    return lps, ranks


def _put(out, value):
    if out is None:
        return value
    out[...] = value
    return out


def greedy_sample_logprob(logits, sampler="v1", *, token_ids=None, logprobs=None, ranks=None,
                          stream=None):
    """Reference greedy token, logprob and rank: ``(token_ids int64, logprobs fp32, ranks
    int64)``, each ``[num_rows]``."""
    x = _f32(logits)
    m, L, _ = row_stats(x)
    t = _greedy(x)
    lps, rks = _rank(x, m, L, t, sampler)
    return _put(token_ids, t), _put(logprobs, lps), _put(ranks, rks)


def selected_token_logprob_rank(logits, token_ids, sampler="v1", *, logprobs=None, ranks=None,
                                stream=None):
    """Reference logprob and rank of given tokens: ``(logprobs fp32, ranks int64)``."""
    x = _f32(logits)
    m, L, _ = row_stats(x)
    lps, rks = _rank(x, m, L, np.asarray(token_ids, np.int64), sampler)
    return _put(logprobs, lps), _put(ranks, rks)


def top_k_order(row):
    """Indices of one fp32 row, best first: NaN (by index), then larger values, then lower
    indices."""
    row = np.asarray(row, np.float32)
    idx = np.arange(row.size)
    nan = np.isnan(row)
    key = np.where(nan, 0.0, row.astype(np.float64))
    return idx[np.lexsort((idx, -key, ~nan))]


def top_k_logprobs(logits, k, token_ids=None, sampler="v1", *, indices=None, logprobs=None,
                   ranks=None, stream=None):
    """Reference ``LogprobsTensors``: ``(indices int32 [R, k+1], logprobs fp32 [R, k+1],
    ranks int64 [R])``; column 0 the given (or greedy) token."""
    x = _f32(logits)
    R = x.shape[0]
    m, L, _ = row_stats(x)
    t = _greedy(x) if token_ids is None else np.asarray(token_ids, np.int64)
    lp0, rks = _rank(x, m, L, t, sampler)
    ix = np.zeros((R, k + 1), np.int32)
    lp = np.zeros((R, k + 1), np.float32)
    for r in range(R):
        top = top_k_order(x[r])[:k]
        ix[r, 0] = np.int64(t[r]).astype(np.int32)
        ix[r, 1:] = top
        lp[r, 0] = lp0[r]
        lp[r, 1:] = logprobs_of(x[r, top], m[r], L[r])
    return _put(indices, ix), _put(logprobs, lp), _put(ranks, rks)


def min_p_mask(logits, min_p, sampler="v1"):
    """The boolean mask ``min_p_filter_`` sets to ``-inf`` (``[R, V]``), and for V1 the
    probabilities and thresholds it compared (for boundary checks): ``(mask, p, thr)``."""
    x = _f32(logits)
    mp = np.asarray(min_p, np.float32)
    m, _, S = row_stats(x)
    mask = np.zeros(x.shape, bool)
    p = np.full(x.shape, np.nan, np.float32)
    thr = np.full(x.shape[0], np.nan, np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for r in range(x.shape[0]):
            if mp[r] == 0:
                continue
            if sampler == "v1":
                S32 = np.float32(S[r])
                e = np.exp((x[r] - m[r]).astype(np.float64)).astype(np.float32)
                p[r] = e / S32
                thr[r] = (np.float32(1) / S32) * mp[r]
                mask[r] = p[r] < thr[r]
            else:
                thr[r] = m[r] + np.float32(np.log(np.float64(mp[r])))
                mask[r] = x[r] < thr[r]
    return mask, p, thr


def min_p_filter_(logits, min_p, sampler="v1", *, stream=None):
    """Reference Min-P: sets the masked logits to ``-inf`` in place and returns ``logits``."""
    mask, _, _ = min_p_mask(logits, min_p, sampler)
    logits[mask] = -np.inf
    return logits
