"""NumPy references for greedy speculative verification: the truth the kernels are compared with.

vLLM's V1 rejection sampler, greedy rows (``vllm/v1/sample/rejection_sampler.py``:
``rejection_greedy_sample_kernel`` and ``RejectionSampler.parse_output``), written as a plain
loop per request:

* request ``r``'s drafts are ``draft_token_ids[start:end]`` with ``start = cu[r-1]`` (0 for the
  first request) and ``end = cu[r]`` -- ``cu_num_draft_tokens`` is an inclusive cumulative sum;
* ``out`` is ``[num_reqs, max_spec_len + 1]`` int32 filled with the placeholder ``-1``;
* for ``p = 0, 1, ...`` while no mismatch occurred: ``out[r, p] = int32(target_argmax[start+p])``;
  a mismatch is ``not (draft >= 0 and draft == target)`` (compared as int64), and the target
  written at the first mismatch is the "recovered" token; stop there;
* no mismatch among all ``n = end - start`` drafts: ``out[r, n] = bonus_token_ids[r]``;
* a row whose ``cu`` values are impossible (``start < 0``, ``end < start``, ``end >
  num_draft_tokens`` or ``n > max_spec_len``) stays all ``-1`` (vLLM would read and write out of
  bounds; the kernels never do).

``greedy_verify`` takes the target logits instead: ``target_argmax = argmax(target_logits,
-1)``, the lowest index winning ties and NaN counting as the largest value (``torch.argmax``),
then the same rule, then ``parse_output``'s compaction -- per row the entries ``!= -1`` and ``<
vocab_size``, in column order -- packed into one int32 array of capacity ``num_draft_tokens +
num_reqs`` (the tail filled with ``-1``), with ``num_emitted`` and their offsets
``cu_num_emitted`` (``[0, cumsum(num_emitted)]``).

The only place loomnb differs from vLLM's kernel: vLLM accepts a draft that equals its target
even when both are negative; here a negative draft (the placeholder ``-1`` of a short draft
list) is always a mismatch. An argmax is never negative, so the two agree on every input a
sampler produces. Arguments are NumPy arrays; ``stream`` is accepted and ignored.
"""

import numpy as np

from .numerics import as_rows

__all__ = ["rejection_greedy_sample", "greedy_verify"]

PLACEHOLDER_TOKEN_ID = -1


def _rows(draft_token_ids, cu_num_draft_tokens, max_spec_len):
    """(request, start, n) per request; n = -1 marks an impossible row."""
    cu = np.asarray(cu_num_draft_tokens).astype(np.int64).reshape(-1)
    num_drafts = np.asarray(draft_token_ids).reshape(-1).shape[0]
    out, start = [], 0
    for r, end in enumerate(cu.tolist()):
        n = end - start
        ok = start >= 0 and end >= start and end <= num_drafts and n <= max_spec_len
        out.append((r, start, n if ok else -1))
        start = end
    return out


def rejection_greedy_sample(draft_token_ids, cu_num_draft_tokens, target_argmax, bonus_token_ids,
                            max_spec_len, *, out=None, stream=None):
    """Reference ``rejection_greedy_sample``: int32 ``[num_reqs, max_spec_len + 1]``, padded
    with -1 (written into ``out`` when given)."""
    drafts = np.asarray(draft_token_ids).reshape(-1).astype(np.int64)
    targets = np.asarray(target_argmax).reshape(-1).astype(np.int64)
    bonus = np.asarray(bonus_token_ids).reshape(-1).astype(np.int32)
    rows = _rows(drafts, cu_num_draft_tokens, max_spec_len)
    res = np.full((len(rows), max_spec_len + 1), PLACEHOLDER_TOKEN_ID, np.int32)
    for r, start, n in rows:
        if n < 0:
            continue
        for p in range(n):
            t = targets[start + p]
            res[r, p] = np.int64(t).astype(np.int32)  # int32 store: the low 32 bits, as vLLM's
            d = drafts[start + p]
            if not (d >= 0 and d == t):
                break
        else:
            res[r, n] = bonus[r]
    if out is None:
        return res
    out[...] = res
    return out


def target_argmax(target_logits):
    """``argmax`` over the last dimension of ``[..., V]`` logits, flattened to ``[rows]`` int64:
    the first NaN if a row has one, else the first maximum (``-0.0 == +0.0``)."""
    x = np.asarray(target_logits)
    x = as_rows(x).astype(np.float32)
    nan = np.isnan(x)
    first_nan = np.argmax(nan, axis=-1)
    first_max = np.argmax(np.where(nan, -np.inf, x), axis=-1)
    return np.where(nan.any(axis=-1), first_nan, first_max).astype(np.int64)


def parse_output(output_token_ids, vocab_size, capacity):
    """vLLM's ``RejectionSampler.parse_output`` packed: (num_emitted int32 [R], emitted int32
    [capacity] padded with -1, cu_num_emitted int32 [R + 1])."""
    rows = np.asarray(output_token_ids).astype(np.int64)
    keep = (rows != PLACEHOLDER_TOKEN_ID) & (rows < vocab_size)
    num = keep.sum(axis=1).astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(num)]).astype(np.int64)
    flat = rows[keep].astype(np.int32)  # row-major: row by row, column order
    emitted = np.full(capacity, PLACEHOLDER_TOKEN_ID, np.int32)
    n = min(capacity, flat.shape[0])
    emitted[:n] = flat[:n]
    return num.astype(np.int32), emitted, cu.astype(np.int32)


def greedy_verify(draft_token_ids, cu_num_draft_tokens, target_logits, bonus_token_ids,
                  max_spec_len, vocab_size=None, *, output_token_ids=None, num_emitted=None,
                  emitted_token_ids=None, cu_num_emitted=None, stream=None):
    """Reference ``greedy_verify``: ``(output_token_ids, num_emitted, emitted_token_ids,
    cu_num_emitted)`` (each written into the array given for it, if any)."""
    logits = np.asarray(target_logits)
    vocab = logits.shape[-1] if vocab_size is None else vocab_size
    rows = rejection_greedy_sample(draft_token_ids, cu_num_draft_tokens, target_argmax(logits),
                                   bonus_token_ids, max_spec_len)
    num_drafts = np.asarray(draft_token_ids).reshape(-1).shape[0]
    capacity = num_drafts + rows.shape[0]
    num, emitted, cu = parse_output(rows, vocab, capacity)
    res = []
    for given, value in ((output_token_ids, rows), (num_emitted, num),
                         (emitted_token_ids, emitted), (cu_num_emitted, cu)):
        if given is None:
            res.append(value)
        else:
            given[...] = value
            res.append(given)
    return tuple(res)
