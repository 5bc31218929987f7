"""The logprob tail and Min-P: ``greedy_sample_logprob``, ``selected_token_logprob_rank``,
``top_k_logprobs`` and ``min_p_filter_``, each for either of vLLM 0.24's samplers.

vLLM 0.24 has two samplers. ``sampler="v1"`` (``vllm/v1/sample/``; Qwen2.5, speculative
decoding) takes ``log_softmax`` of the fp32 logits and ranks a token by counting logprobs
``>=`` its own; its Min-P works on probabilities. ``sampler="v2"`` (Model Runner V2,
``vllm/v1/worker/gpu/sample/``; the default for Llama-architecture models such as SmolLM2)
ranks on the raw logits, counts the lanes past the vocabulary that its 8192-wide blocks load as
``-inf``, and applies Min-P in logit space. ``docs/numerics.md`` has the family's numerics.

With ``m`` the row's largest non-NaN logit and ``L = r32(log(sum_v exp(x_v - m)))`` (the sum
accumulated in float64, ``exp`` in float32), a token's logprob is ``r32(r32(x_t - m) - L)`` --
the fp32 order of operations of torch's ``log_softmax`` and of V2's Triton kernel; the float64
sum makes ``L`` independent of the launch configuration (vLLM sums in fp32, so its last bits
depend on the reduction order: ulp-level differences, see ``tests/tolerances.py``).

Bytes moved: every op reads each row of logits once (``R * V * b``, ``b`` = 4 fp32, 2 bf16)
and writes a few values per row; the greedy/given-token tie check may read a row a second time
when two distinct logits round to the same logprob (rare: it needs a value within half an ulp
of ``L`` of the token's). ``min_p_filter_`` reads each row twice and writes the masked
elements. Many thread blocks share a row when rows are few (``launch_config``).
"""

from __future__ import annotations

import contextlib

from .. import _adapter as ad
from ..checks import check_kind, check_ndim, check_same_device, check_shape
from . import _contract as C
from . import _launch as L
from . import _workspace as W
from ._sampling_kernels import (NF, NI, SAMPLERS, LogprobSpec, MinPSpec, logprob_kernel,
                                min_p_kernel)
from ._sampling_rows import MAX_LOGPROBS, UNIT
from ._torch_ops import torch_op

__all__ = ["greedy_sample_logprob", "selected_token_logprob_rank", "top_k_logprobs",
           "min_p_filter_"]

LOGITS_KINDS = ("f32", "bf16")
THREADS = 512            # threads per block (fewer when a block's share of a row is small)
TOPK_THREADS = 256       # top-k variants hold 20 candidates a thread (~170 registers): 256 fit
UNITS_PER_THREAD = 4     # 16-byte units a thread reads at least, before a row is split further
BLOCKS_PER_SM = 2        # target: about two blocks per SM in flight (one wave)
MAX_RECORDS = 4096       # records (num_rows * splits) a split launch may use; workspaces hold at least these
V2_BLOCK = 8192          # V2's rank kernel loads 8192-wide blocks, padding with -inf
SIMULATOR_SMS = 4        # the simulator's SM count for the split rule: any small number


def v2_pad(vocab_size):
    """Lanes past the vocabulary that V2's rank kernel counts for a ``-inf`` token:
    ``ceil(V / 8192) * 8192 - V``."""
    return -(-vocab_size // V2_BLOCK) * V2_BLOCK - vocab_size


def launch_config(num_rows, vocab_size, unit, num_sms, threads=None, splits=None,
                  max_threads=THREADS):
    """(threads per block, blocks per row ``splits``, elements per block ``chunk``).

    Each block reads ``chunk`` elements of one row (a multiple of ``unit``, the values of a
    16-byte unit). Rows are split until there are about ``BLOCKS_PER_SM * num_sms`` blocks
    (one wave: few rows are latency-bound, so spread them over the whole GPU), but never below
    a warp's worth of ``UNITS_PER_THREAD`` units a block, and never past ``MAX_RECORDS``
    records; threads are ``max_threads`` or fewer for short chunks (a multiple of 32). E.g. an
    H200 (132 SMs), V = 151,936 fp32: 1 row -> 264 blocks of 64 threads, 32 rows -> 8 x 512, 512
    rows -> 1 x 512. ``threads``/``splits`` force a configuration (tests); a forced block size
    is still capped at ``max_threads``, the most the variant's registers allow
    (``tests/test_sampling_registers.py``: registers x threads must fit an SM's 65,536).
    """
    units = -(-vocab_size // unit)
    rows = max(num_rows, 1)
    if splits is None:
        want = max(1, round(BLOCKS_PER_SM * num_sms / rows))
        splits = max(1, min(want, units // (32 * UNITS_PER_THREAD), MAX_RECORDS // rows))
    splits = max(1, min(splits, units, MAX_RECORDS // rows))
    chunk_units = -(-units // splits)
    splits = -(-units // chunk_units)  # no empty block
    if threads is None:
        threads = L.whole_warps(-(-chunk_units // UNITS_PER_THREAD))
    return min(threads, max_threads), splits, chunk_units * unit


_forced_splits = None


@contextlib.contextmanager
def force_splits(n):
    """Test hook: every launch of this family splits each row into ``n`` blocks (as far as the
    vocabulary allows). Clears the fast-path cache."""
    global _forced_splits
    old, _forced_splits = _forced_splits, n
    L.clear_launch_cache()
    try:
        yield
    finally:
        _forced_splits = old
        L.clear_launch_cache()


# ---------------------------------------------------------------- workspace
class _Workspace:
    """The records of a split launch (``f`` float64 and ``i`` int64 fields, ``MAX_RECORDS`` or
    the launch's ``num_rows x splits`` if more) and the stream's split counters (one a row),
    from the scaffold's persistent workspaces (:mod:`loomnb.ops._workspace`)."""
    __slots__ = ("f", "i", "counters")


def _workspace(like, stream, records):
    """The records and counters of a launch of ``records`` records on ``stream``: Min-P writes a
    record for every block, one per row when rows are many, so more than ``MAX_RECORDS`` rows
    get larger record buffers (the smaller ones kept alive, not reused)."""
    ws = _Workspace()
    ws.f = W.buffer("sampling.f", like, stream, records, (NF,), "float64", MAX_RECORDS)
    ws.i = W.buffer("sampling.i", like, stream, records, (NI,), "int64", MAX_RECORDS)
    ws.counters = W.counters(like, stream, MAX_RECORDS)
    return ws


# ---------------------------------------------------------------- checks
def _logits(op, obj, kinds=LOGITS_KINDS):
    la = ad.wrap(op, "logits", obj)
    check_kind(op, "logits", la, kinds)
    check_ndim(op, "logits", la, 2)
    if la.shape[1] < 1:
        C.fail_value(op, "logits", "of shape [num_rows, vocab_size] with vocab_size >= 1",
                     f"shape {list(la.shape)}")
    if la.shape[0] > 0 and la.shape[1] > 1 and la.strides[1] != 1:
        C.fail_value(op, "logits", "contiguous in its last dimension (stride 1)",
                     f"strides {la.strides} (in elements)")
    return la


def _token_ids(op, obj, la):
    ta = ad.wrap(op, "token_ids", obj)
    check_kind(op, "token_ids", ta, ("i64",))
    check_shape(op, "token_ids", ta, (la.shape[0],), "[num_rows]")
    check_same_device(op, "token_ids", ta, "logits", la)
    return ta


def _sampler(op, sampler):
    return C.choice(op, "sampler", sampler, SAMPLERS)


def _k(op, k, vocab_size):
    k = C.integer(op, "k", k, 0, MAX_LOGPROBS,
                  expected=f"0 <= k <= {MAX_LOGPROBS} (vLLM's max_logprobs)")
    if k > vocab_size:
        C.fail_value(op, "k", f"at most vocab_size ({vocab_size})", repr(k))
    return k


def _out(op, name, obj, la, kind, shape):
    return C.output(op, name, obj, like=la, kind=kind, shape=shape, like_name="logits")


# ---------------------------------------------------------------- the launch
def _launch_logprob(op, spec, la, ta, tok, idx, lp, rank, k, stream, key):
    R, V = la.shape
    if R == 0:
        return
    unit = UNIT[spec.kind]
    vec = C.vectors_ok(la)
    threads, splits, chunk = launch_config(R, V, unit, L.sm_count(la, simulator=SIMULATOR_SMS),
                                           L.forced_threads(), _forced_splits,
                                           TOPK_THREADS if spec.topk else THREADS)
    if splits > 1:  # records (and a counter a row) only when rows are split
        assert R * splits <= MAX_RECORDS
    spec = LogprobSpec(spec.kind, spec.sampler, spec.given, spec.topk, "vec" if vec else "scalar")
    ws = _workspace(la, stream, R * splits if splits > 1 else 0)
    lp_view = lp if lp.ndim == 2 else lp.view((R, 1), (lp.strides[0], 1))
    params = [L.array(la, words=vec),
              L.array(ta) if ta is not None else L.absent("int64", 1),
              L.array(tok) if tok is not None else L.absent("int64", 1),
              L.array(idx) if idx is not None else L.absent("int32", 2),
              L.array(lp_view), L.array(rank),
              W.param(ws.f, "float64", la), W.param(ws.i, "int64", la),
              W.param(ws.counters, "uint32", la),
              L.i64(V), L.i64(splits), L.i64(chunk), L.i64(k), L.i64(v2_pad(V))]
    L.launch(logprob_kernel, spec, R * splits, threads, params, like=la, stream=stream, key=key)


def _fake_greedy(logits, *_, **__):
    r = logits.shape[0]
    return (logits.new_empty((r,), dtype=ad._torch.int64),
            logits.new_empty((r,), dtype=ad._torch.float32),
            logits.new_empty((r,), dtype=ad._torch.int64))


def _fake_selected(logits, *_, **__):
    r = logits.shape[0]
    return (logits.new_empty((r,), dtype=ad._torch.float32),
            logits.new_empty((r,), dtype=ad._torch.int64))


def _fake_top_k(logits, k, *_, **__):
    r = logits.shape[0]
    return (logits.new_empty((r, k + 1), dtype=ad._torch.int32),
            logits.new_empty((r, k + 1), dtype=ad._torch.float32),
            logits.new_empty((r,), dtype=ad._torch.int64))


_RAISES = """Raises ``LoomnbTypeError`` (a ``TypeError``) for a wrong dtype or a host/unknown
    array, ``LoomnbValueError`` (a ``ValueError``) for shapes, layout, devices, overlapping or
    read-only outputs and unknown options -- before any launch. Zero rows is a no-op."""


# ---------------------------------------------------------------------------------------------
@torch_op("Tensor logits, str sampler='v1'", outputs=("token_ids", "logprobs", "ranks"),
          stream_key="logits", fake=_fake_greedy)
def greedy_sample_logprob(logits, sampler="v1", *, token_ids=None, logprobs=None, ranks=None,
                          stream=None, launch_key=None):
    """Greedy sampling with the sampled token's logprob and rank, in one pass over each row.

    ``token_ids[r] = argmax_v logits[r, v]`` (the lowest index among equal maxima; a NaN counts
    as the largest, as ``torch.argmax``); ``logprobs[r] = r32(r32(x_t - m) - L)`` with ``m``
    the row's largest non-NaN logit and ``L = r32(log(sum_v exp(x_v - m)))``; ``ranks[r]`` is
    1-based with ties counting against the token:

    * ``sampler="v1"``: ``#{v : logprob_v >= logprob_t}`` on the fp32 logprob vector (so
      distinct logits whose logprobs round equal are ties);
    * ``sampler="v2"``: ``#{v : x_v >= x_t}`` on the raw logits.

    NaN and infinities (both samplers, as vLLM): a row with a NaN gives the first NaN's index,
    logprob NaN, rank 0; a row with ``+inf`` gives the first ``+inf``'s index and logprob NaN
    (V1 rank 0; V2 rank = the number of ``+inf``); a row of ``-inf`` gives token 0, logprob NaN
    and rank 0 (V1) or ``ceil(V / 8192) * 8192`` (V2, whose rank kernel pads with ``-inf``).

    Args:
        logits: ``[num_rows, vocab_size]`` fp32 or bf16 (widened exactly), last dimension
            contiguous, any row stride. Not modified.
        sampler: ``"v1"`` (default) or ``"v2"``.
        token_ids, logprobs, ranks: optional outputs ``[num_rows]`` int64 / fp32 / int64;
            allocated when None.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(token_ids, logprobs, ranks)``. Mutates only the outputs.

    {raises}

    Matches vLLM 0.24's greedy path with ``logprobs=0`` (raw logprobs, no logits processors):
    V1 ``Sampler.forward`` (``argmax``, ``log_softmax``, ``gather_logprobs``), V2
    ``gumbel_sample`` at temperature 0 and ``compute_topk_logprobs`` (``_ranks_kernel``).
    vLLM returns ``sampled_token_ids`` as int32 ``[num_rows, 1]``; loomnb int64 ``[num_rows]``
    (what ``gather_logprobs`` takes). ``L`` differs from vLLM's fp32 sums by ulps.
    """
    op = "loomnb.greedy_sample_logprob"
    la = _logits(op, logits)
    _sampler(op, sampler)
    R = la.shape[0]
    tok = _out(op, "token_ids", token_ids, la, "i64", (R,))
    lp = _out(op, "logprobs", logprobs, la, "f32", (R,))
    rk = _out(op, "ranks", ranks, la, "i64", (R,))
    C.no_overlap(op, {"token_ids": tok, "logprobs": lp, "ranks": rk}, {"logits": la})
    _launch_logprob(op, LogprobSpec(la.kind, sampler), la, None, tok, None, lp, rk, 0, stream,
                    launch_key)
    return tok.obj, lp.obj, rk.obj


@torch_op("Tensor logits, Tensor token_ids, str sampler='v1'", outputs=("logprobs", "ranks"),
          stream_key="logits", fake=_fake_selected)
def selected_token_logprob_rank(logits, token_ids, sampler="v1", *, logprobs=None, ranks=None,
                                stream=None, launch_key=None):
    """Logprob and rank of tokens sampled elsewhere (top-k/top-p, FlashInfer), one pass a row.

    ``logprobs[r] = r32(r32(x_t - m) - L)`` for ``t = token_ids[r]`` and ``ranks[r]`` as
    :func:`greedy_sample_logprob` (V1: ``#{logprob_v >= logprob_t}``; V2: ``#{x_v >= x_t}``,
    plus ``ceil(V / 8192) * 8192 - V`` padding lanes when ``x_t = -inf``). A NaN anywhere in a
    row makes its logprob NaN (and V1's rank 0); a NaN token has rank 0 under both samplers;
    a ``-inf`` token has logprob ``-inf`` and rank V (V1) or ``ceil(V / 8192) * 8192`` (V2).

    Args:
        logits: ``[num_rows, vocab_size]`` fp32 or bf16, last dimension contiguous. Not modified.
        token_ids: ``[num_rows]`` int64 (vLLM casts FlashInfer's int32 to int64 before its
            gather; loomnb takes int64 only). Ids outside ``[0, vocab_size)`` cannot be checked
            without reading the device: they give logprob NaN and rank 0 (vLLM's gather would
            fault).
        sampler: ``"v1"`` (default) or ``"v2"``.
        logprobs, ranks: optional outputs ``[num_rows]`` fp32 / int64; allocated when None.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(logprobs, ranks)``. Mutates only the outputs.

    {raises}

    Matches V1 ``Sampler.gather_logprobs(log_softmax(logits), 0, token_ids)`` and V2
    ``compute_topk_logprobs(logits, 0, token_ids)``.
    """
    op = "loomnb.selected_token_logprob_rank"
    la = _logits(op, logits)
    ta = _token_ids(op, token_ids, la)
    _sampler(op, sampler)
    R = la.shape[0]
    lp = _out(op, "logprobs", logprobs, la, "f32", (R,))
    rk = _out(op, "ranks", ranks, la, "i64", (R,))
    C.no_overlap(op, {"logprobs": lp, "ranks": rk}, {"logits": la, "token_ids": ta})
    _launch_logprob(op, LogprobSpec(la.kind, sampler, given=True), la, ta, None, None, lp, rk, 0,
                    stream, launch_key)
    return lp.obj, rk.obj


@torch_op("Tensor logits, int k, Tensor? token_ids=None, str sampler='v1'",
          outputs=("indices", "logprobs", "ranks"), stream_key="logits", fake=_fake_top_k)
def top_k_logprobs(logits, k, token_ids=None, sampler="v1", *, indices=None, logprobs=None,
                   ranks=None, stream=None, launch_key=None):
    """vLLM's ``LogprobsTensors`` for ``logprobs=k``: the sampled token and the ``k`` most
    likely tokens of each row, their logprobs, and the sampled token's rank.

    Column 0 is ``token_ids[r]`` (the greedy argmax of :func:`greedy_sample_logprob` when
    ``token_ids`` is None); columns ``1..k`` are the ``k`` best tokens in this order: NaN
    logits first, then larger logits, then lower indices (so logprobs never increase along a
    row, and equal logprobs come in decreasing-logit, then increasing-index order; vLLM's
    ``torch.topk`` leaves the order of equal values unspecified). Every logprob is
    ``r32(r32(x - m) - L)``; ``ranks`` is column 0's rank under ``sampler``, as
    :func:`greedy_sample_logprob`/:func:`selected_token_logprob_rank`.

    Args:
        logits: ``[num_rows, vocab_size]`` fp32 or bf16, last dimension contiguous. Not modified.
        k: ``0 <= k <= 20`` (vLLM's default ``max_logprobs``) and ``k <= vocab_size``.
        token_ids: optional ``[num_rows]`` int64, the sampled tokens (out-of-range ids: logprob
            NaN, rank 0, the id kept in column 0 as int32).
        sampler: ``"v1"`` (default) or ``"v2"``: the rank's definition.
        indices, logprobs, ranks: optional outputs ``[num_rows, k+1]`` int32,
            ``[num_rows, k+1]`` fp32, ``[num_rows]`` int64; allocated when None.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(indices, logprobs, ranks)``. Mutates only the outputs.

    {raises}

    Matches V1 ``Sampler.gather_logprobs`` (``torch.topk`` of the logprobs) and V2
    ``compute_topk_logprobs`` (``torch.topk`` of the raw logits); both pick the same k values.
    """
    op = "loomnb.top_k_logprobs"
    la = _logits(op, logits)
    k = _k(op, k, la.shape[1])
    ta = _token_ids(op, token_ids, la) if token_ids is not None else None
    _sampler(op, sampler)
    R = la.shape[0]
    ix = _out(op, "indices", indices, la, "i32", (R, k + 1))
    lp = _out(op, "logprobs", logprobs, la, "f32", (R, k + 1))
    rk = _out(op, "ranks", ranks, la, "i64", (R,))
    C.no_overlap(op, {"indices": ix, "logprobs": lp, "ranks": rk},
                 {"logits": la, "token_ids": ta})
    spec = LogprobSpec(la.kind, sampler, given=ta is not None, topk=True)
    _launch_logprob(op, spec, la, ta, None, ix, lp, rk, k, stream, launch_key)
    return ix.obj, lp.obj, rk.obj


@torch_op("Tensor(a!) logits, Tensor min_p, str sampler='v1'", returns=("logits",),
          stream_key="logits")
def min_p_filter_(logits, min_p, sampler="v1", *, stream=None, launch_key=None):
    """Min-P in place: set to ``-inf`` the logits of tokens much less likely than the row's best.

    * ``sampler="v1"`` (probability space, ``MinPLogitsProcessor``): ``p_v = r32(r32(expf(
      r32(x_v - m))) / S)`` with ``S = r32(sum_v exp(x_v - m))`` (float64 sum), ``p_max =
      r32(1 / S)``; masks ``p_v < r32(p_max * min_p[r])``.
    * ``sampler="v2"`` (logit space, ``_min_p_kernel``): masks ``x_v < r32(m + r32(log(
      min_p[r])))``, ``m`` the largest non-NaN logit, ``log`` correctly rounded (vLLM: Triton's
      ``tl.log``, which may differ by an ulp).

    Rows whose ``min_p`` is 0 are neither read nor written (vLLM's V2 returns early; V1's
    threshold is 0 there, which masks nothing). The largest logit always survives (for
    ``min_p <= 1``); ``min_p = 1`` keeps exactly the tokens whose probability (V1) or logit (V2)
    equals the maximum. NaN: V1 leaves a row containing NaN, ``+inf`` or only ``-inf``
    untouched (its probabilities are NaN); V2 ignores NaN for the maximum, leaves NaN logits as
    they are, and with a ``+inf`` logit masks every finite one. ``min_p`` outside ``[0, 1]`` is
    not checked (a device read): NaN or negative masks nothing, above 1 masks every token.

    Args:
        logits: ``[num_rows, vocab_size]`` fp32 (vLLM's processed logits, after temperature),
            last dimension contiguous, any row stride, writable. Mutated in place.
        min_p: ``[num_rows]`` fp32 on the same device.
        sampler: ``"v1"`` (default) or ``"v2"``.
        stream: CUDA stream; default the caller's current stream.

    Returns ``logits``. Mutates: ``logits`` (masked elements only). No temporary the size of
    the logits: two kernels, per-block statistics in a small workspace, then the mask.

    {raises}
    """
    op = "loomnb.min_p_filter_"
    la = _logits(op, logits, ("f32",))
    _sampler(op, sampler)
    ma = ad.wrap(op, "min_p", min_p)
    check_kind(op, "min_p", ma, ("f32",))
    check_shape(op, "min_p", ma, (la.shape[0],), "[num_rows]")
    check_same_device(op, "min_p", ma, "logits", la)
    C.writable(op, {"logits": la})
    C.no_overlap(op, {"logits": la}, {"min_p": ma})
    R, V = la.shape
    if R == 0:
        return logits
    vec = C.vectors_ok(la)
    layout = "vec" if vec else "scalar"
    threads, splits, chunk = launch_config(R, V, UNIT["f32"], L.sm_count(la, simulator=SIMULATOR_SMS),
                                           L.forced_threads(), _forced_splits)
    ws = _workspace(la, stream, R * splits)  # a record for every block, split or not
    params = [L.array(la, words=vec), L.array(ma), W.param(ws.f, "float64", la),
              L.i64(V), L.i64(splits), L.i64(chunk)]
    for i, phase in enumerate(("stats", "mask")):  # one call: a replay runs both
        L.launch(min_p_kernel, MinPSpec(sampler, phase, layout), R * splits, threads, params,
                 like=la, stream=stream, key=launch_key, part=(i, 2))
    return logits


for _op in (greedy_sample_logprob, selected_token_logprob_rank, top_k_logprobs, min_p_filter_):
    _op.__doc__ = _op.__doc__.replace("{raises}", _RAISES)
del _op
