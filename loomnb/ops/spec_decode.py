"""Greedy speculative verification: ``rejection_greedy_sample`` (vLLM's greedy rejection rule on
a given target argmax) and ``greedy_verify`` (the target argmax over the logits fused in, plus
the emitted tokens compacted on the device).

vLLM's V1 rejection sampler (``vllm/v1/sample/rejection_sampler.py``), which n-gram speculative
decoding runs on in vLLM 0.24: ``MAX_SPEC_LEN = 128``, the placeholder token id ``-1``. For
request ``r`` with drafts ``draft_token_ids[cu[r-1]:cu[r]]`` (``cu = cu_num_draft_tokens``,
inclusive; ``cu[-1]`` read as 0), every position up to and including the first mismatch emits
the target's token, and a request whose drafts all match also emits its bonus token:

    out[r, p] = target_argmax[cu[r-1] + p]   for p <= first mismatch (p < n_r)
    out[r, n_r] = bonus_token_ids[r]          if no draft mismatched
    every other entry of out[r, :max_spec_len + 1] = -1

so a request emits ``accepted + 1`` tokens, a request with no drafts only its bonus token.
A draft mismatches when ``not (draft >= 0 and draft == target)``: a negative draft (the ``-1``
of a request that has fewer drafts than its slots) is always a mismatch, and a draft id is
never used as an index. ``docs/numerics.md`` has the family's contract in one place.

Bytes moved (the benchmark's model), with ``N = num_draft_tokens``, ``R = num_reqs``, ``L =
max_spec_len``: ``rejection_greedy_sample`` reads ``4N`` or ``8N`` drafts (int32 or int64),
``4N`` or ``8N`` targets, ``4R`` cu and ``4R`` or ``8R`` bonus ids, writes ``4R(L+1)``; ``greedy_verify`` reads the ``N x V`` logits
instead of the targets and also writes ``4R`` counts, ``4(N+R)`` packed ids and ``4(R+1)``
offsets. One launch for ``rejection_greedy_sample``, two for ``greedy_verify`` (the split
argmax, then verification and compaction in one block); both replay on the eager fast path.
"""

from __future__ import annotations

from .. import _adapter as ad
from ..checks import check_kind, check_ndim, check_same_device, check_shape
from . import _contract as C
from . import _launch as L
from ._spec_decode_kernels import (ID_KINDS, ILP, ArgmaxSpec, VerifySpec, argmax_argtypes,
                                   argmax_kernel, group_for, verify_kernel)
from ._torch_ops import torch_op
from ._vector import UNIT_ELEMS

__all__ = ["rejection_greedy_sample", "greedy_verify"]

MAX_SPEC_LEN = 128           # vLLM 0.24's rejection sampler limit
PLACEHOLDER_TOKEN_ID = -1    # vLLM's padding of the output rows
TARGET_BLOCKS = 528          # argmax blocks worth launching: ~4 resident per SM of a 132-SM H200
ARGMAX_THREADS = 256
VERIFY_THREADS = 128         # rejection_greedy_sample: blocks of 4 warps, one group per request
PACK_THREADS = 256           # greedy_verify's one block: more requests take more rounds (its
                             # register count does not allow 1024 threads: measured on the H200,
                             # a 1024-thread launch failed with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)


def argmax_config(num_rows, units, threads=None):
    """(threads, S splits per row, chunk units per split) for the argmax over ``num_rows`` rows
    of ``units`` loads each: a block takes at least ``threads * ILP`` units, and rows are split
    until about TARGET_BLOCKS blocks run (no split once there are that many rows)."""
    t = threads or min(ARGMAX_THREADS, L.whole_warps(-(-units // ILP)))
    splits = max(1, min(-(-units // (t * ILP)), -(-TARGET_BLOCKS // max(num_rows, 1))))
    chunk = -(-units // splits)
    return t, -(-units // chunk), chunk


def verify_config(num_reqs, max_spec_len, pack, threads=None):
    """(group lanes per request, threads per block, blocks): one group per request; the fused
    form runs in one block (up to ``PACK_THREADS``, a forced size included; more requests take
    more rounds)."""
    g = group_for(max_spec_len)
    if pack:
        t = min(threads or L.whole_warps(num_reqs * g), PACK_THREADS)
        return g, t, 1
    t = threads or min(VERIFY_THREADS, L.whole_warps(num_reqs * g))
    return g, t, -(-num_reqs * g // t)


# ---------------------------------------------------------------- checks
def _ids(op, name, obj, kinds, ndim, like=None, like_name="draft_token_ids"):
    a = ad.wrap(op, name, obj)
    check_kind(op, name, a, kinds)
    check_ndim(op, name, a, ndim)
    if like is not None:
        check_same_device(op, name, a, like_name, like)
    return a


def _inputs(op, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len):
    """The checks both ops run: ``(drafts, cu, bonus [R] view, N, R, L)``."""
    da = _ids(op, "draft_token_ids", draft_token_ids, ID_KINDS, 1)
    ca = _ids(op, "cu_num_draft_tokens", cu_num_draft_tokens, ("i32",), 1, da)
    ba = ad.wrap(op, "bonus_token_ids", bonus_token_ids)
    check_kind(op, "bonus_token_ids", ba, ID_KINDS)
    check_same_device(op, "bonus_token_ids", ba, "draft_token_ids", da)
    num_drafts, num_reqs = da.shape[0], ca.shape[0]
    if ba.shape not in ((num_reqs, 1), (num_reqs,)):
        C.fail_value(op, "bonus_token_ids", f"of shape [{num_reqs}, 1] ([num_reqs, 1]) or [{num_reqs}]",
                     f"shape {list(ba.shape)}")
    ba = ba.view((num_reqs,), (ba.strides[0],))
    spec_len = C.integer(op, "max_spec_len", max_spec_len, 0, MAX_SPEC_LEN)
    if num_drafts > num_reqs * spec_len:
        C.fail_value(op, "max_spec_len", f"at least the batch's largest draft count (num_draft_tokens "
                     f"{num_drafts} > num_reqs {num_reqs} x max_spec_len)", repr(spec_len))
    if num_drafts >= 2 ** 31 - 1:
        C.fail_value(op, "draft_token_ids", "fewer than 2**31 - 1 drafts (int32 offsets)",
                     f"{num_drafts} drafts")
    return da, ca, ba, num_drafts, num_reqs, spec_len


def _verify_params(stage, out, drafts, cu, targets, bonus, counts, packed, cu_emitted,
                   num_reqs, num_drafts, spec_len, splits, vocab):
    arr = lambda a, storage: L.array(a) if a is not None else L.absent(storage, 1)  # noqa: E731
    return [arr(stage, "int64"), L.array(out), L.array(drafts), L.array(cu),
            L.array(targets) if targets is not None else L.absent("int64", 1), L.array(bonus),
            arr(counts, "int32"), arr(packed, "int32"), arr(cu_emitted, "int32"),
            L.i64(num_reqs), L.i64(num_drafts), L.i64(spec_len), L.i64(splits), L.i64(vocab)]


def _fake_rows(draft_token_ids, cu_num_draft_tokens, target, bonus_token_ids, max_spec_len, *_, **__):
    import torch
    return draft_token_ids.new_empty((cu_num_draft_tokens.shape[0], max_spec_len + 1),
                                     dtype=torch.int32)


def _fake_verify(draft_token_ids, cu_num_draft_tokens, target_logits, bonus_token_ids, max_spec_len,
                 *_, **__):
    import torch
    R, N = cu_num_draft_tokens.shape[0], draft_token_ids.shape[0]
    new = lambda *s: draft_token_ids.new_empty(s, dtype=torch.int32)  # noqa: E731
    return new(R, max_spec_len + 1), new(R), new(N + R), new(R + 1)


# ---------------------------------------------------------------- ops
@torch_op("Tensor draft_token_ids, Tensor cu_num_draft_tokens, Tensor target_argmax, "
          "Tensor bonus_token_ids, int max_spec_len", outputs=("out",), fake=_fake_rows)
def rejection_greedy_sample(draft_token_ids, cu_num_draft_tokens, target_argmax, bonus_token_ids,
                            max_spec_len, *, out=None, stream=None, launch_key=None):
    """vLLM's greedy rejection rule: the accepted drafts, then the recovered or bonus token, per
    request, in vLLM's padded layout.

    ``out[r, p] = int32(target_argmax[cu[r-1] + p])`` for every position ``p`` of request ``r``
    up to and including its first mismatch (``not (draft >= 0 and draft == target)``, compared
    as int64); ``out[r, n_r] = bonus_token_ids[r]`` when none of its ``n_r = cu[r] - cu[r-1]``
    drafts mismatched; every other entry is -1 (``PLACEHOLDER_TOKEN_ID``). Request ``r`` emits
    ``accepted_r + 1`` tokens; one with no drafts emits only ``out[r, 0] = bonus``.

    Args:
        draft_token_ids: int32 or int64 ``[num_draft_tokens]``, the requests' drafts one after
            another (any stride), compared as int64. A negative id is a placeholder: always a
            mismatch, never an index.
        cu_num_draft_tokens: int32 ``[num_reqs]``, the inclusive cumulative draft counts
            (counts [2, 3, 1] give [2, 5, 6]); int32 only (an offset, vLLM's dtype: not cast).
        target_argmax: int32 or int64 ``[num_draft_tokens]``, the target model's token at each
            draft position (``torch.argmax`` gives int64).
        bonus_token_ids: int32 or int64 ``[num_reqs, 1]`` (or ``[num_reqs]``): the token after
            the last draft, emitted when every draft was accepted (stored as int32: an int64
            id keeps its low 32 bits, as vLLM's ``tl.store`` and the targets).
        max_spec_len: the batch's largest draft count, an int in [0, 128] (vLLM's
            ``MAX_SPEC_LEN``); the rows have ``max_spec_len + 1`` columns.
        out: optional int32 ``[num_reqs, max_spec_len + 1]`` (any strides), allocated when None.
        stream: CUDA stream; default the caller's current stream.

    Returns ``out``. Mutates ``out`` only (every entry: nothing needs pre-filling).

    Raises ``LoomnbTypeError`` (a wrong dtype or array type) or ``LoomnbValueError`` (shape,
    device, overlap, writability, or ``max_spec_len`` out of range or below
    ``num_draft_tokens / num_reqs``) before any launch; ``num_reqs == 0`` is a no-op. The values
    in ``cu_num_draft_tokens`` are not checked and need no ``check_indices`` option: the kernel
    bounds every read they steer, so a row whose counts are impossible (``cu`` decreasing,
    beyond ``num_draft_tokens``, or a count above ``max_spec_len``) is written all -1 and
    nothing is read through it; token ids are compared, never used as indices.

    Matches vLLM 0.24's ``rejection_greedy_sample_kernel`` (with ``is_greedy`` None) and the
    ``torch.full(..., -1)`` before it, bit for bit, for every ``target_argmax >= 0`` (every
    argmax), with draft, target and bonus ids of int32 or int64 as vLLM's Triton kernel takes
    (its tests pass int64). Differs where a draft and its target are equal and negative: vLLM
    accepts it, loomnb rejects it.
    """
    op = "loomnb.rejection_greedy_sample"
    da, ca, ba, num_drafts, num_reqs, spec_len = _inputs(op, draft_token_ids, cu_num_draft_tokens,
                                                         bonus_token_ids, max_spec_len)
    ta = _ids(op, "target_argmax", target_argmax, ("i32", "i64"), 1, da)
    check_shape(op, "target_argmax", ta, (num_drafts,), "[num_draft_tokens]")
    oa = C.output(op, "out", out, like=da, kind="i32", shape=(num_reqs, spec_len + 1),
                  like_name="draft_token_ids")
    C.no_overlap(op, {"out": oa}, {"draft_token_ids": da, "cu_num_draft_tokens": ca,
                                   "target_argmax": ta, "bonus_token_ids": ba})
    if num_reqs == 0:
        return oa.obj
    g, threads, blocks = verify_config(num_reqs, spec_len, False, L.forced_threads())
    spec = VerifySpec(ta.kind, g, draft=da.kind, bonus=ba.kind)
    params = _verify_params(None, oa, da, ca, ta, ba, None, None, None, num_reqs, num_drafts,
                            spec_len, 1, 0)
    L.launch(verify_kernel, spec, blocks, threads, params, like=da, stream=stream, key=launch_key)
    return oa.obj


@torch_op("Tensor draft_token_ids, Tensor cu_num_draft_tokens, Tensor target_logits, "
          "Tensor bonus_token_ids, int max_spec_len, int? vocab_size=None",
          outputs=("output_token_ids", "num_emitted", "emitted_token_ids", "cu_num_emitted"),
          workspaces_first=1, fake=_fake_verify)
def greedy_verify(draft_token_ids, cu_num_draft_tokens, target_logits, bonus_token_ids,
                  max_spec_len, vocab_size=None, *, output_token_ids=None, num_emitted=None,
                  emitted_token_ids=None, cu_num_emitted=None, stream=None, launch_key=None):
    """Greedy verification from the target logits, with the emitted tokens compacted on the
    device: ``target_argmax = argmax(target_logits, -1)`` then :func:`rejection_greedy_sample`,
    then vLLM's ``parse_output`` without the trip to the host.

    ``target_argmax[i]`` is the index of the largest of row ``i``'s ``V`` logits, the lowest
    index winning ties; a NaN counts as the largest value (the first NaN wins) and -0.0 equals
    +0.0 -- ``torch.argmax``'s rules. The row ``output_token_ids`` is exactly
    :func:`rejection_greedy_sample`'s. Then, per request, the entries ``!= -1`` and ``<
    vocab_size`` in column order (``parse_output``'s filter) are its ``num_emitted[r]`` emitted
    tokens, stored at ``emitted_token_ids[cu_num_emitted[r] : cu_num_emitted[r + 1]]``, with
    ``cu_num_emitted = [0, cumsum(num_emitted)]``; the entries after ``cu_num_emitted[-1]`` are
    -1. ``num_accepted[r] = num_emitted[r] - 1`` when every emitted id is below ``vocab_size``.

    Args:
        draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len: as
            :func:`rejection_greedy_sample`.
        target_logits: bf16, fp16 or fp32 ``[num_draft_tokens, V]``, the logits at the draft
            positions (not the bonus rows), last dimension contiguous; or any ``[..., V]`` whose
            leading dimensions hold ``num_draft_tokens`` rows and merge into at most two strided
            dimensions -- e.g. ``logits.view(num_reqs, k + 1, V)[:, :k]``, the draft rows of a
            verification pass of ``k + 1`` tokens per request, without a copy. ``V >= 1``.
        vocab_size: the filter's bound; None means ``V``. An int >= 0.
        output_token_ids: optional int32 ``[num_reqs, max_spec_len + 1]``.
        num_emitted: optional int32 ``[num_reqs]``.
        emitted_token_ids: optional int32 ``[num_draft_tokens + num_reqs]`` (room for every
            request emitting ``n_r + 1`` tokens).
        cu_num_emitted: optional int32 ``[num_reqs + 1]``.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(output_token_ids, num_emitted, emitted_token_ids, cu_num_emitted)``, each
    allocated when not given. Mutates those four only; nothing is read back to the host.

    Raises as :func:`rejection_greedy_sample`, and for a bad ``target_logits`` (dtype, shape,
    layout) or ``vocab_size``, before any launch. Impossible ``cu`` values give all -1 rows (as
    there) and ids past the capacity of ``emitted_token_ids`` are dropped. ``num_reqs == 0``
    still launches the verification kernel once, to write ``cu_num_emitted = [0]``.

    Matches vLLM 0.24's V1 rejection sampler for an all-greedy batch -- ``target_logits.argmax(
    dim=-1)``, ``rejection_greedy_sample_kernel``, ``RejectionSampler.parse_output(output,
    vocab_size)`` (its ``cu_num_tokens``) -- bit for bit, with the one difference of
    :func:`rejection_greedy_sample` (which an argmax never triggers). vLLM applies its logits
    processors before the argmax; pass the processed logits.
    """
    op = "loomnb.greedy_verify"
    da, ca, ba, num_drafts, num_reqs, spec_len = _inputs(op, draft_token_ids, cu_num_draft_tokens,
                                                         bonus_token_ids, max_spec_len)
    la = ad.wrap(op, "target_logits", target_logits)
    check_kind(op, "target_logits", la, ("bf16", "f16", "f32"))
    check_same_device(op, "target_logits", la, "draft_token_ids", da)
    if la.ndim < 2 or la.shape[-1] < 1 or la.size // la.shape[-1] != num_drafts:
        C.fail_value(op, "target_logits", f"of shape [{num_drafts}, V] ([num_draft_tokens, V], "
                     "V >= 1) or [..., V] holding num_draft_tokens rows", f"shape {list(la.shape)}")
    V = la.shape[-1]
    if V >= 2 ** 31:
        C.fail_value(op, "target_logits", "fewer than 2**31 columns", f"V = {V}")
    vocab = V if vocab_size is None else C.integer(op, "vocab_size", vocab_size, 0)
    lead, (lv,) = C.rows(op, [("target_logits", la)])
    out = lambda name, obj, shape: C.output(op, name, obj, like=da, kind="i32", shape=shape,  # noqa: E731
                                            like_name="draft_token_ids")
    oa = out("output_token_ids", output_token_ids, (num_reqs, spec_len + 1))
    na = out("num_emitted", num_emitted, (num_reqs,))
    ea = out("emitted_token_ids", emitted_token_ids, (num_drafts + num_reqs,))
    cua = out("cu_num_emitted", cu_num_emitted, (num_reqs + 1,))
    C.no_overlap(op, {"output_token_ids": oa, "num_emitted": na, "emitted_token_ids": ea,
                      "cu_num_emitted": cua},
                 {"draft_token_ids": da, "cu_num_draft_tokens": ca, "target_logits": la,
                  "bonus_token_ids": ba})
    forced = L.forced_threads()
    lv3 = lv.view((lead[0], 1, V), (lv.strides[0], 0, 1)) if len(lead) == 1 else lv
    vec = C.vectors_ok(lv3)
    units = V // UNIT_ELEMS[la.kind] if vec else V
    threads, splits, chunk = argmax_config(num_drafts, units, forced)
    ws = C.output(op, "workspace", None, like=da, kind="i64",
                  shape=(num_drafts * splits + num_reqs * (spec_len + 1),))
    keys = ws.view((num_drafts * splits,), (1,))
    stage = ws.view((num_reqs * (spec_len + 1),), (1,), ptr=ws.ptr + 8 * num_drafts * splits)
    launches = 2 if num_drafts else 1
    if num_drafts:
        L.launch(argmax_kernel, ArgmaxSpec(la.kind, vec), num_drafts * splits, threads,
                 [L.array(lv3, words=vec), L.array(keys), L.i64(units), L.i64(chunk),
                  L.i64(splits)], like=da, stream=stream, key=launch_key, part=(0, launches))
    g, vthreads, _ = verify_config(num_reqs, spec_len, True, forced)
    params = _verify_params(stage, oa, da, ca, keys if num_drafts else None, ba, na, ea, cua,
                            num_reqs, num_drafts, spec_len, splits, vocab)
    argmax = ArgmaxSpec(la.kind, vec)  # a step without drafts launches no argmax: warm it
    L.launch(verify_kernel, VerifySpec("keys", g, pack=True, draft=da.kind, bonus=ba.kind), 1,
             vthreads, params, like=da, stream=stream, key=launch_key,
             part=(launches - 1, launches),
             warm=lambda: [(argmax_kernel, argmax, argmax_argtypes(argmax))])
    return oa.obj, na.obj, ea.obj, cua.obj
