"""The sampling tail: logits penalties, temperature, top-k / top-p / min-p filtering and
renormalisation, and seeded sampling -- FlashInfer 0.6.12's sampling ops (names, arguments,
int32 samples) and vLLM 0.24's penalties, on one row kernel and one elementwise kernel.

**Filters.** Every filter keeps a prefix of a row's tokens in descending order of value, found
exactly (a radix select over the values' ordered bits; ``loomnb.ops._sampler_kernels``), ties at
a boundary kept:

* top-k: the tokens whose value is at least the ``k``-th largest (``k <= 0`` or ``k >=
  vocab_size``: no filter);
* top-p: the smallest set of most likely tokens whose probability reaches ``top_p`` (``top_p
  >= 1``: no filter; ``top_p <= 0`` keeps the most likely tokens), probabilities in a 2^-32
  fixed point of the row's largest, summed exactly -- so the choice does not depend on the
  order of a reduction (``deterministic=True`` always holds);
* min-p: ``p >= min_p * p_max`` (``min_p <= 0``: no filter).

``filter_apply_order="top_k_first"`` (default) measures top-p on the top-k set renormalised (as
vLLM's torch path and FlashInfer); ``"joint"`` measures it on the whole row. Min-p applies to the
whole row first (vLLM's order: a logits processor before top-k/top-p).

**Sampling** draws ``argmax_i (s_i + g_i)`` over the kept tokens, ``s_i = x_i / T`` (logits) or
``log p_i`` (probabilities) and ``g_i`` a Gumbel variate of a counter-based Philox-4x32-10
stream: exactly a draw from the renormalised distribution (the Gumbel-max theorem; vLLM's
sampler draws ``argmax p_i / E_i`` with exponential ``E_i``, the same law). Token ``i`` of row
``r`` reads the stream at key ``seed`` and counter ``(i // 4, salt, offset)``, so a sample
depends on nothing but ``(seed, offset)`` and the row's values -- not on the batch, the launch
configuration or a CUDA-graph replay:

* ``seed``: an int (one stream for the batch, ``salt`` = the row), or an int64 tensor
  ``[num_rows]`` (a seed per request, as vLLM's ``SamplingParams.seed``; ``salt`` = 0, so the
  row's position in the batch does not matter) or ``[1]``;
* ``offset``: an int or an int64 tensor ``[num_rows]`` / ``[1]`` (default 0); a decode loop
  advances it each step (a device tensor it increments keeps a captured graph drawing fresh
  numbers on every replay);
* neither ``seed`` nor ``generator``: a seed is drawn on the device from torch's default CUDA
  generator (``torch.randint``; graph-safe), for other arrays from NumPy's;
* ``generator``: a ``torch.Generator`` the seed is drawn from, on its device.

FlashInfer draws by rejection over pivots with a per-row cuRAND state, so its tokens differ
from loomnb's for the same seed; both sample the same distribution. Rows with ``temperature <
1e-5`` (vLLM's ``_SAMPLING_EPS``) take the argmax of the logits (the lowest index of the largest
non-NaN value): greedy and random rows mix in one batch. NaN values are never kept; a row with
nothing kept answers the argmax (0 when every value is NaN).

Bytes: a sample reads each row 1 + 4 x (filters) + 1 times (the radix levels; from L2 after the
first pass when the rows fit), writes 4 bytes a row. Up to ``SPLIT_MAX_ROWS`` (64) rows with
16-byte-aligned rows, each row is split over several blocks (the split kernels: the same
thresholds and draws, in 2 + 3 x (filters) launches; one block a row is one SM, bound by its
issue rate at decode batch sizes); more rows take one block a row, one launch. A top-k-first
sample with a scalar ``top_k`` (at most 1,024) takes the finish path up to ``FINISH_MAX_ROWS``
(128) rows: the first top-k level and the compaction of its candidates on the split kernels,
then one block a row finishes from the candidates -- 3 launches, the row read twice (with
min-p, whose threshold needs the max first, 4 launches and up to 64 rows).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from .. import _adapter as ad
from ..checks import check_kind, check_ndim, check_same_device, check_shape
from . import _contract as C
from . import _launch as L
from . import _sampler_kernels as K
from . import _workspace as W
from ._sampler_kernels import (CAP, SPEC_MAX_DRAFTS, ChainSpec, PenaltySpec, RowSpec, SplitSpec,
                               chain_kernel, penalty_kernel, row_kernel, split_kernel)
from ._torch_ops import torch_op

__all__ = ["top_k_top_p_sampling_from_logits", "top_k_top_p_sampling_from_probs",
           "sampling_from_logits", "sampling_from_probs", "top_k_sampling_from_probs",
           "top_p_sampling_from_probs", "min_p_sampling_from_probs", "top_k_mask_logits",
           "top_k_top_p_mask_logits", "top_k_renorm_probs", "top_p_renorm_probs",
           "apply_repetition_penalties_", "apply_penalties_", "chain_speculative_sampling"]

LOGITS_KINDS = ("f32", "bf16", "f16")
THREADS = 512                 # threads of a row block (fewer for short rows)
PENALTY_THREADS = 256
MAX_VOCAB = 1 << 21           # mass sums stay below 2^53 (exact in float64)
PENALTY_GRID_ROWS = 65535     # the penalty grid's y dimension: more rows loop
ORDERS = ("top_k_first", "joint")
SPLIT_MAX_ROWS = 64           # up to this many rows, each row is split over several blocks
FINISH_MAX_ROWS = 128         # the finish path takes the split kernels up to this many rows
FINISH_THREADS = 256          # the finishing row kernel's block: a few candidates a row, so
                              # more blocks an SM, not more threads a block
SPLIT_BLOCKS = 384            # the blocks a split launch aims at (3 an SM of an H100 / H200)


# ---------------------------------------------------------------- checks
def _rows(op, name, obj, kinds=LOGITS_KINDS):
    a = ad.wrap(op, name, obj)
    check_kind(op, name, a, kinds)
    check_ndim(op, name, a, 2)
    R, V = a.shape
    if V < 1 or V > MAX_VOCAB:
        C.fail_value(op, name, f"of shape [num_rows, vocab_size], 1 <= vocab_size <= {MAX_VOCAB}",
                     f"shape {list(a.shape)}")
    if R > 0 and V > 1 and a.strides[1] != 1:
        C.fail_value(op, name, "contiguous in its last dimension (stride 1)",
                     f"strides {a.strides} (in elements)")
    return a


def _per_row(op, name, value, like, kind, default):
    """(array or None, scalar) of a per-row parameter: a number for every row, or a ``[num_rows]``
    tensor of ``kind`` on ``like``'s device (the scalar is then ``default``, unused); None is
    ``default``."""
    if value is None:
        return None, default
    if isinstance(value, (bool, np.bool_, str, bytes)):
        C.fail_type(op, name, "a number or a [num_rows] tensor", repr(value))
    if isinstance(value, (int, float, np.integer, np.floating)):
        if kind == "i32":
            return None, C.integer(op, name, value, -(1 << 31), (1 << 31) - 1,
                                   expected="an int32 value (or a [num_rows] int32 tensor)")
        return None, C.real(op, name, value, finite=False)
    a = ad.wrap(op, name, value)
    check_kind(op, name, a, (kind,))
    check_shape(op, name, a, (like.shape[0],), "[num_rows]")
    check_same_device(op, name, a, "logits/probs", like)
    return a, default


def _seed_arg(op, name, value, like):
    """(array or None, int) of ``seed``/``offset``: an int, or an int64 tensor [num_rows] or [1]."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        v = int(value)
        if not -(1 << 63) <= v < (1 << 64):
            C.fail_value(op, name, "an int that fits 64 bits", repr(value))
        return None, v - (1 << 64) if v >= (1 << 63) else v
    if isinstance(value, (bool, np.bool_, float, np.floating, str, bytes)):
        C.fail_type(op, name, "an int or an int64 tensor", repr(value))
    a = ad.wrap(op, name, value)
    check_kind(op, name, a, ("i64",))
    check_ndim(op, name, a, 1)
    if a.shape[0] not in (1, like.shape[0]):
        C.fail_value(op, name, f"of shape [num_rows] ({like.shape[0]}) or [1]",
                     f"shape {list(a.shape)}")
    check_same_device(op, name, a, "logits/probs", like)
    return a, 0


def _draw_seed(op, like, generator):
    """A seed drawn for this call: on the device from ``generator`` (or torch's default
    generator), or from NumPy for arrays that are not torch tensors."""
    if like.lib == "torch":
        torch = ad._torch
        return torch.randint(0, 1 << 62, (1,), dtype=torch.int64, device=like.obj.device,
                             generator=generator), 0
    return None, int(np.random.randint(0, 1 << 62))


_forced = {"cap": None, "split": None}  # the test hooks' values (None: the launch rules)


@contextlib.contextmanager
def _force(name, n):
    old, _forced[name] = _forced[name], n
    L.clear_launch_cache()
    try:
        yield
    finally:
        _forced[name] = old
        L.clear_launch_cache()


def force_candidates(n):
    """Test hook: the row kernel compacts at most ``n`` candidates into shared memory (-1: it
    reads the row at every level; None: the kernel's ``CAP``), so tests reach every path of
    the kernel at small vocabularies."""
    return _force("cap", n)


def force_split(n):
    """Test hook: ``n >= 1`` takes the split kernels with every row with 16-byte loads over
    ``n`` blocks, 0 the row kernel, None restores the launch rule (:func:`_splits`)."""
    return _force("split", n)


def _splits(R, V, kind, vec, finish, mp_on):
    """The blocks the split kernels spread a row over, 0 for the row kernel: the row kernel for
    rows without 16-byte loads or more than ``SPLIT_MAX_ROWS`` rows (one block a row fills the
    GPU), or, on the finish path without min-p (``finish``, not ``mp_on``: its row is read
    twice, the row kernel's 3-4 times), more than ``FINISH_MAX_ROWS``; else enough blocks to
    give ``SPLIT_BLOCKS`` in all, at least one, each with at least one unit (16 bytes) a
    thread: a pass's time is the latency of a thread's chain of elements, so more blocks, each
    shorter. The limits are where the row kernel was as fast, measured (H100, 151,936 tokens):
    without min-p the finish path takes 0.99x the row kernel's time at 128 rows, 1.15x at 256."""
    if not vec:
        return 0
    if _forced["split"] is not None:
        return max(0, _forced["split"])
    if R > (FINISH_MAX_ROWS if finish and not mp_on else SPLIT_MAX_ROWS):
        return 0
    units = -(-V // K.UNIT_ELEMS[kind])
    return max(1, min(-(-units // K.SPLIT_THREADS), -(-SPLIT_BLOCKS // R)))


def _split_steps(spec, k_on, p_on, mp_on, finish):
    """``[(phase, level, which)]``: the split launches of a call (``k_on`` / ``p_on`` /
    ``mp_on``: some row may filter by top-k / top-p / min-p). ``finish``: every row takes top-k
    (a scalar ``k <= CAP``) and samples with top-k first: the max only for min-p, the first
    top-k level, then the compaction of its candidates, after which the row kernel finishes
    the rows (``RowSpec.finish``)."""
    if finish:
        first = [(K.PH_MAX, 0, 0)] if mp_on else []
        return first + [(K.PH_LEVEL, 0, K.W_FINISH), (K.PH_COMPACT, 0, K.W_FINISH)]
    steps = []
    if spec.output == "sample" or p_on:
        steps.append((K.PH_MAX, 0, 0))
    both = spec.joint and k_on and p_on
    if k_on:
        steps += [(K.PH_LEVEL, lv, K.W_JOINT if both else K.W_TOPK)
                  for lv in range(K.SPLIT_LEVELS)]
    if p_on and not both:
        steps += [(K.PH_LEVEL, lv, K.W_TOPP) for lv in range(K.SPLIT_LEVELS)]
    if spec.output == "sample":
        steps.append((K.PH_SAMPLE, 0, 0))
    else:
        if spec.output == "renorm":
            steps.append((K.PH_SUM, 0, 0))
        steps.append((K.PH_WRITE, 0, 0))
    return steps


def _row_siblings(spec):
    """The row kernel of ``spec`` (16-byte rows) and, for a top-k-first sample, its finishing
    twin: what a call of another size may launch, compiled ahead with this one."""
    out = [(row_kernel, spec, K.argtypes(spec))]
    if spec.output == "sample" and not spec.joint:
        fin = dataclasses.replace(spec, finish=True)
        out.append((row_kernel, fin, K.argtypes(fin)))
    return out


def _launch_split(spec, S, params, steps, finish, xa, stream, key):
    """The split launches of one call (``params``: the row kernel's up to ``cap``), and with
    ``finish`` the row kernel's that ends it."""
    R, V = xa.shape
    like = xa
    st = W.param(W.buffer("sampler_split_state", like, stream, R, (K.NSTATE,), "int64"),
                 "int64", like)
    cand = W.param(W.buffer("sampler_split_cand", like, stream, R, (CAP,), "int64"), "uint64",
                   like)
    count = W.param(W.buffer("sampler_split_count", like, stream, R, (), "int32"), "int32", like)
    stf = W.buffer("sampler_split_fstate", like, stream, R, (K.NFSTATE,), "float64")
    hist = W.buffer("sampler_split_hist", like, stream, R, (2, K.SPLIT_BINS), "int64")
    part = W.buffer("sampler_split_part", like, stream, R * S, (), "int64")
    psum = W.buffer("sampler_split_psum", like, stream, R * S, (), "float64")
    ctr = W.counters(like, stream, R)
    base = params + [st, W.param(stf, "float64", like), W.param(hist, "int64", like),
                     W.param(part, "uint64", like), W.param(psum, "float64", like),
                     W.param(ctr, "uint32", like), cand, count, L.i64(S)]
    sspec = SplitSpec(spec.kind, spec.source, spec.output)
    forced = L.forced_threads()
    # a power of two (each thread of the selecting block owns SPLIT_BINS / threads bins)
    threads = 1 << (min(forced, 1024).bit_length() - 1) if forced is not None else K.SPLIT_THREADS
    row_twin = dataclasses.replace(spec, layout="vec")
    n = len(steps) + (1 if finish else 0)
    for i, (phase, level, which) in enumerate(steps):
        L.launch(split_kernel, sspec, R * S, threads,
                 base + [L.i64(phase), L.i64(level), L.i64(which)], like=xa, stream=stream,
                 key=key, part=(i, n),
                 warm=lambda: _row_siblings(row_twin))
    if finish:
        fspec = dataclasses.replace(row_twin, finish=True)
        threads = _threads(V) if forced is not None else min(FINISH_THREADS, _threads(V))
        L.launch(row_kernel, fspec, R, threads, params + [st, cand, count],
                 like=xa, stream=stream, key=key, part=(n - 1, n))


def _seeds(op, like, seed, offset, generator):
    """``(seed array or None, seed int, offset array or None, offset int, fresh)`` of a sampling
    call: ``generator`` checked (a ``torch.Generator`` with torch tensors), the seed and offset
    as :func:`_seed_arg` takes them, or, without a seed, one drawn for this call (``fresh``)."""
    torch = ad._torch
    if generator is not None and (torch is None or not isinstance(generator, torch.Generator)
                                  or like.lib != "torch"):
        C.fail_type(op, "generator", "a torch.Generator (with torch tensors) or None",
                    repr(generator))
    fresh = seed is None
    if not fresh:
        sa, sv = _seed_arg(op, "seed", seed, like)
    else:
        sa, sv = _draw_seed(op, like, generator)
        if sa is not None:
            sa = ad.wrap(op, "seed", sa)
    oa, ov = _seed_arg(op, "offset", offset, like) if offset is not None else (None, 0)
    return sa, sv, oa, ov, fresh


def _threads(V):
    forced = L.forced_threads()
    if forced is not None:
        return forced
    return min(THREADS, L.whole_warps(-(-V // 4)))


def _launch_rows(op, spec, xa, ids, y, k, p, t, mp, seed, offset, generator, stream, key):
    """Checks of the per-row parameters, then one launch of ``row_kernel(spec)``."""
    R, V = xa.shape
    ka, kv = _per_row(op, "top_k", k, xa, "i32", 0)
    pa, pv = _per_row(op, "top_p", p, xa, "f32", 1.0)
    ta, tv = _per_row(op, "temperature", t, xa, "f32", 1.0)
    ma, mv = _per_row(op, "min_p", mp, xa, "f32", 0.0)
    sa, sv, oa, ov = None, 0, None, 0
    if spec.output == "sample":
        sa, sv, oa, ov, fresh = _seeds(op, xa, seed, offset, generator)
        if fresh:
            key = None  # a fresh seed every call: nothing to replay
    outs = {n: a for n, a in (("out", ids), ("out", y)) if a is not None}
    C.no_overlap(op, outs, {spec.source: xa, "top_k": ka, "top_p": pa, "temperature": ta, "min_p": ma,
                            "seed": sa, "offset": oa})
    if R == 0:
        return
    per_row_seed = int(sa is not None and sa.shape[0] > 1)
    vec = C.vectors_ok(xa)  # 16-byte loads where every row allows them
    spec = dataclasses.replace(spec, layout="vec" if vec else "scalar")
    params = [L.array(xa, words=vec),
              L.array(ids) if ids is not None else L.absent("int32", 1),
              L.array(y) if y is not None else L.absent(K.output_storage(spec), 2),
              L.array(ka) if ka is not None else L.absent("int32", 1),
              L.array(pa) if pa is not None else L.absent("float32", 1),
              L.array(ta) if ta is not None else L.absent("float32", 1),
              L.array(ma) if ma is not None else L.absent("float32", 1),
              L.array(sa) if sa is not None else L.absent("int64", 1),
              L.array(oa) if oa is not None else L.absent("int64", 1),
              L.i64(kv), L.f32(pv), L.f32(tv), L.f32(mv), L.i64(sv), L.i64(ov),
              L.i64(per_row_seed), L.i64(V), L.i64(CAP if _forced["cap"] is None else _forced["cap"])]
    finish = (spec.output == "sample" and not spec.joint and ka is None
              and 0 < kv <= min(V - 1, CAP))
    mp_on = ma is not None or mv > 0.0
    # the processed logits have no split kernels (a diagnostic output, once a step at most)
    split_ok = vec and spec.output != "processed"
    S = _splits(R, V, xa.kind, split_ok, finish, mp_on)
    if S > 0:
        k_on = ka is not None or 0 < kv < V
        p_on = pa is not None or pv < 1.0
        _launch_split(spec, S, params, _split_steps(spec, k_on, p_on, mp_on, finish), finish,
                      xa, stream, key)
        return
    twin = SplitSpec(spec.kind, spec.source, spec.output)  # what a call of fewer rows launches
    warm = (lambda: [(split_kernel, twin, K.argtypes(twin))]
            + _row_siblings(dataclasses.replace(spec, layout="vec"))[1:]) if split_ok else None
    params += [L.absent("int64", 2), L.absent("uint64", 2), L.absent("int32", 1)]
    L.launch(row_kernel, spec, R, _threads(V), params, like=xa, stream=stream, key=key, warm=warm)


def _order(op, filter_apply_order):
    return C.choice(op, "filter_apply_order", filter_apply_order, ORDERS) == "joint"


def _sample_op(op, source, x, k, p, t, mp, order, deterministic, generator, seed, offset, out,
               stream, key):
    xa = _rows(op, source, x, LOGITS_KINDS if source == "logits" else ("f32",))
    C.flag(op, "deterministic", deterministic)
    joint = _order(op, order)
    ids = C.output(op, "out", out, like=xa, kind="i32", shape=(xa.shape[0],), like_name=source)
    spec = RowSpec(xa.kind, source, "sample", joint)
    _launch_rows(op, spec, xa, ids, None, k, p, t, mp, seed, offset, generator, stream, key)
    return ids.obj


def _fake_ids(x, *_, **__):
    return x.new_empty((x.shape[0],), dtype=ad._torch.int32)


def _fake_like(x, *_, **__):
    return ad._torch.empty_like(x)


def _fake_f32(x, *_, **__):
    return x.new_empty(x.shape, dtype=ad._torch.float32)


_SEEDS = "Generator? generator=None, Tensor|int? seed=None, Tensor|int? offset=None"

_RAISES = """Raises ``LoomnbTypeError`` (a ``TypeError``) for a wrong dtype, a host or unknown
    array or a parameter of the wrong type, ``LoomnbValueError`` (a ``ValueError``) for shapes,
    layout, devices, overlapping or read-only outputs and unknown options -- before any launch.
    Parameter values on the device (a top-k tensor...) are not read: any value is defined above.
    Zero rows is a no-op."""

_FILTER_ARGS = """logits: ``[num_rows, vocab_size]`` fp32, bf16 or fp16, last dimension
            contiguous, any row stride; ``vocab_size <= 2^21``. Not modified.
        top_k: an int, or a ``[num_rows]`` int32 tensor; ``<= 0`` or ``>= vocab_size``: off.
        top_p: a float, or a ``[num_rows]`` fp32 tensor; ``>= 1``: off.
        temperature: optional float or ``[num_rows]`` fp32 tensor (default 1).
        min_p: optional float or ``[num_rows]`` fp32 tensor (default 0: off).
        filter_apply_order: ``"top_k_first"`` (default) or ``"joint"``."""

_SAMPLING_ARGS = """deterministic: accepted for FlashInfer's signature; the sample is always
            deterministic for a given seed.
        generator: optional ``torch.Generator`` the seed is drawn from (when ``seed`` is None).
        seed, offset: the Philox stream (module docstring): an int, or an int64 tensor
            ``[num_rows]`` or ``[1]``.
        out: optional ``[num_rows]`` int32 output; allocated when None.
        stream: CUDA stream; default the caller's current stream."""


# ---------------------------------------------------------------------------------------------
@torch_op("Tensor logits, Tensor|int top_k, Tensor|float top_p, *, Tensor|float? temperature=None, "
          "Tensor|float? min_p=None, str filter_apply_order='top_k_first', bool deterministic=True, "
          + _SEEDS, outputs=("out",), fake=_fake_ids)
def top_k_top_p_sampling_from_logits(logits, top_k, top_p, *, temperature=None, min_p=None,
                                     filter_apply_order="top_k_first", deterministic=True,
                                     generator=None, seed=None, offset=None, out=None,
                                     stream=None, launch_key=None):
    """Sample one token a row from ``softmax(logits / T)`` restricted by min-p, top-k and top-p.

    ``out[r] = argmax_{i kept} (r32(logits[r, i] / T_r) + g_{r,i})`` (Gumbel-max, module
    docstring), the kept set the prefix that survives min-p (``w_i = expf(r32(x_i / T) -
    r32(x_max / T)) >= min_p``), top-k (values ``>=`` the ``k``-th largest) and top-p (the
    smallest most-likely set reaching ``top_p`` of the top-k set's mass, or of the whole row's
    with ``filter_apply_order="joint"``); rows with ``T < 1e-5`` take the argmax.

    Args:
        {filter_args}
        {sampling_args}

    Returns ``out``: ``[num_rows]`` int32 token ids. Mutates only ``out``.

    {raises}

    Matches FlashInfer 0.6.12's ``top_k_top_p_sampling_from_logits`` (its distribution, not its
    tokens: FlashInfer samples by rejection from a cuRAND state) with vLLM's ``temperature`` and
    ``min_p`` added, and vLLM 0.24's ``TopKTopPSampler`` for a batch of random and greedy rows.
    """
    return _sample_op("loomnb.top_k_top_p_sampling_from_logits", "logits", logits, top_k, top_p,
                      temperature, min_p, filter_apply_order, deterministic, generator, seed,
                      offset, out, stream, launch_key)


@torch_op("Tensor probs, Tensor|int top_k, Tensor|float top_p, *, Tensor|float? min_p=None, "
          "str filter_apply_order='top_k_first', bool deterministic=True, " + _SEEDS,
          outputs=("out",), fake=_fake_ids)
def top_k_top_p_sampling_from_probs(probs, top_k, top_p, *, min_p=None,
                                    filter_apply_order="top_k_first", deterministic=True,
                                    generator=None, seed=None, offset=None, out=None, stream=None,
                                    launch_key=None):
    """Sample one token a row from probabilities restricted by min-p, top-k and top-p.

    ``out[r] = argmax_{i kept} (log p_{r,i} + g_{r,i})``; the kept set as
    :func:`top_k_top_p_sampling_from_logits`, with ``w_i = r32(p_i * r32(1 / p_max))`` as the
    mass and min-p keeping ``p_i >= r32(p_max * min_p)``. The probabilities need not sum to 1.

    Args:
        probs: ``[num_rows, vocab_size]`` fp32, non-negative, last dimension contiguous. Not
            modified.
        top_k, top_p, min_p, filter_apply_order: as :func:`top_k_top_p_sampling_from_logits`.
        {sampling_args}

    Returns ``out``: ``[num_rows]`` int32 token ids. Mutates only ``out``.

    {raises}

    Matches FlashInfer 0.6.12's ``top_k_top_p_sampling_from_probs`` (its distribution).
    """
    return _sample_op("loomnb.top_k_top_p_sampling_from_probs", "probs", probs, top_k, top_p,
                      None, min_p, filter_apply_order, deterministic, generator, seed, offset,
                      out, stream, launch_key)


@torch_op("Tensor logits, *, Tensor|float? temperature=None, bool deterministic=True, " + _SEEDS,
          outputs=("out",), fake=_fake_ids)
def sampling_from_logits(logits, *, temperature=None, deterministic=True, generator=None,
                         seed=None, offset=None, out=None, stream=None, launch_key=None):
    """Sample one token a row from ``softmax(logits / T)``: ``argmax_i (r32(x_i / T) + g_i)``
    (one pass a row; rows with ``T < 1e-5`` take the argmax).

    Args:
        logits: ``[num_rows, vocab_size]`` fp32, bf16 or fp16, last dimension contiguous.
        temperature: optional float or ``[num_rows]`` fp32 tensor (default 1).
        {sampling_args}

    Returns ``out``: ``[num_rows]`` int32 token ids. Mutates only ``out``.

    {raises}

    Matches FlashInfer 0.6.12's ``sampling_from_logits`` (its distribution).
    """
    return _sample_op("loomnb.sampling_from_logits", "logits", logits, None, None, temperature,
                      None, "top_k_first", deterministic, generator, seed, offset, out, stream,
                      launch_key)


@torch_op("Tensor probs, *, bool deterministic=True, " + _SEEDS, outputs=("out",),
          fake=_fake_ids)
def sampling_from_probs(probs, *, deterministic=True, generator=None, seed=None, offset=None,
                        out=None, stream=None, launch_key=None):
    """Sample one token a row with probability ``p_i / sum(p)``: ``argmax_i (log p_i + g_i)``.

    Args:
        probs: ``[num_rows, vocab_size]`` fp32, non-negative, last dimension contiguous.
        {sampling_args}

    Returns ``out``: ``[num_rows]`` int32 token ids. Mutates only ``out``.

    {raises}

    Matches FlashInfer 0.6.12's ``sampling_from_probs`` (its distribution).
    """
    return _sample_op("loomnb.sampling_from_probs", "probs", probs, None, None, None, None,
                      "top_k_first", deterministic, generator, seed, offset, out, stream,
                      launch_key)


@torch_op("Tensor probs, Tensor|int top_k, *, bool deterministic=True, " + _SEEDS,
          outputs=("out",), fake=_fake_ids)
def top_k_sampling_from_probs(probs, top_k, *, deterministic=True, generator=None, seed=None,
                              offset=None, out=None, stream=None, launch_key=None):
    """Sample one token a row from the ``top_k`` most likely (ties at the boundary kept).

    Args:
        probs: ``[num_rows, vocab_size]`` fp32, non-negative, last dimension contiguous.
        top_k: an int or a ``[num_rows]`` int32 tensor; ``<= 0`` or ``>= vocab_size``: off.
        {sampling_args}

    Returns ``out``: ``[num_rows]`` int32 token ids. Mutates only ``out``.

    {raises}

    Matches FlashInfer 0.6.12's ``top_k_sampling_from_probs`` (its distribution).
    """
    return _sample_op("loomnb.top_k_sampling_from_probs", "probs", probs, top_k, None, None,
                      None, "top_k_first", deterministic, generator, seed, offset, out, stream,
                      launch_key)


@torch_op("Tensor probs, Tensor|float top_p, *, bool deterministic=True, " + _SEEDS,
          outputs=("out",), fake=_fake_ids)
def top_p_sampling_from_probs(probs, top_p, *, deterministic=True, generator=None, seed=None,
                              offset=None, out=None, stream=None, launch_key=None):
    """Sample one token a row from the smallest most-likely set whose mass reaches ``top_p``.

    Args:
        probs: ``[num_rows, vocab_size]`` fp32, non-negative, last dimension contiguous.
        top_p: a float or a ``[num_rows]`` fp32 tensor; ``>= 1``: off.
        {sampling_args}

    Returns ``out``: ``[num_rows]`` int32 token ids. Mutates only ``out``.

    {raises}

    Matches FlashInfer 0.6.12's ``top_p_sampling_from_probs`` (its distribution).
    """
    return _sample_op("loomnb.top_p_sampling_from_probs", "probs", probs, None, top_p, None,
                      None, "top_k_first", deterministic, generator, seed, offset, out, stream,
                      launch_key)


@torch_op("Tensor probs, Tensor|float min_p, *, bool deterministic=True, " + _SEEDS,
          outputs=("out",), fake=_fake_ids)
def min_p_sampling_from_probs(probs, min_p, *, deterministic=True, generator=None, seed=None,
                              offset=None, out=None, stream=None, launch_key=None):
    """Sample one token a row from the tokens with ``p >= r32(p_max * min_p)``.

    Args:
        probs: ``[num_rows, vocab_size]`` fp32, non-negative, last dimension contiguous.
        min_p: a float or a ``[num_rows]`` fp32 tensor; ``<= 0``: off.
        {sampling_args}

    Returns ``out``: ``[num_rows]`` int32 token ids. Mutates only ``out``.

    {raises}

    Matches FlashInfer 0.6.12's ``min_p_sampling_from_probs`` (its distribution; the same
    kept set, ``p >= p_max * min_p``).
    """
    return _sample_op("loomnb.min_p_sampling_from_probs", "probs", probs, None, None, None,
                      min_p, "top_k_first", deterministic, generator, seed, offset, out, stream,
                      launch_key)


@torch_op("Tensor logits, Tensor|int top_k", outputs=("out",), fake=_fake_like)
def top_k_mask_logits(logits, top_k, *, out=None, stream=None, launch_key=None):
    """The logits with every token outside the top-k set at ``-inf``: ``out[r, i] = x`` where
    ``x = logits[r, i] >=`` the row's ``k``-th largest value (ties kept), else ``-inf`` (NaN
    included).

    Args:
        logits: ``[num_rows, vocab_size]`` fp32, bf16 or fp16, last dimension contiguous.
        top_k: an int or a ``[num_rows]`` int32 tensor; ``<= 0`` or ``>= vocab_size``: the row
            is copied (NaN as ``-inf``).
        out: optional ``[num_rows, vocab_size]`` output of the logits' dtype; allocated when None.
        stream: CUDA stream; default the caller's current stream.

    Returns ``out``. Mutates only ``out``.

    {raises}

    Matches FlashInfer 0.6.12's ``top_k_mask_logits`` (ties at the k-th value are kept here).
    """
    op = "loomnb.top_k_mask_logits"
    xa = _rows(op, "logits", logits)
    y = C.output(op, "out", out, like=xa, kind=xa.kind, shape=xa.shape, like_name="logits")
    _launch_rows(op, RowSpec(xa.kind, "logits", "mask"), xa, None, y, top_k, None, None, None,
                 None, None, None, stream, launch_key)
    return y.obj


@torch_op("Tensor logits, Tensor|int top_k, Tensor|float top_p, *, Tensor|float? temperature=None, "
          "Tensor|float? min_p=None, str filter_apply_order='top_k_first'", outputs=("out",),
          fake=_fake_f32)
def top_k_top_p_mask_logits(logits, top_k, top_p, *, temperature=None, min_p=None,
                            filter_apply_order="top_k_first", out=None, stream=None,
                            launch_key=None):
    """The processed logits a sample draws from: ``out[r, i] = r32(logits[r, i] / T_r)`` for the
    tokens :func:`top_k_top_p_sampling_from_logits` keeps with the same arguments, ``-inf``
    elsewhere (a NaN logit is never kept); a row with ``T < 1e-5`` gets its logits unchanged
    and unfiltered (vLLM's greedy rows: temperature 1, no filter). The kept set, as there:
    min-p keeps ``w_i = expf(r32(x_i / T) - r32(x_max / T)) >= min_p``; top-k the values ``>=``
    the ``k``-th largest of those (ties kept); top-p the smallest most-likely set whose mass
    reaches ``top_p`` of the top-k set's (``filter_apply_order="joint"``: of the min-p set's),
    the crossing token and its ties included; ``top_p <= 0`` keeps the largest and its ties.
    A loomnb op (FlashInfer has ``top_k_mask_logits`` only).

    With ``selected_token_logprob_rank(out, token_ids)`` this gives vLLM's
    ``logprobs_mode="processed_logprobs"``: the log-softmax of the temperature-scaled, masked
    logits, ``-inf`` for a dropped token.

    Args:
        {filter_args}
        out: optional ``[num_rows, vocab_size]`` fp32 output; allocated when None.
        stream: CUDA stream; default the caller's current stream.

    Returns ``out``. Mutates only ``out``.

    {raises}

    Matches vLLM 0.24's processed logits (``TopKTopPSampler`` with ``logprobs_mode=
    "processed_logits"``; its torch path keeps every token equal to the ``k``-th value too)
    with the filters of the sampler ops here, which differ from vLLM's only at top-p's
    crossing: every token tied there is kept and the mass is summed exactly in fixed point
    (vLLM's fp32 cumulative sum from the least likely token breaks ties by sort order and can
    round across the crossing). One block a row, the row read 2-4 times.
    """
    op = "loomnb.top_k_top_p_mask_logits"
    xa = _rows(op, "logits", logits)
    joint = _order(op, filter_apply_order)
    y = C.output(op, "out", out, like=xa, kind="f32", shape=xa.shape, like_name="logits")
    _launch_rows(op, RowSpec(xa.kind, "logits", "processed", joint), xa, None, y, top_k, top_p,
                 temperature, min_p, None, None, None, stream, launch_key)
    return y.obj


def _renorm_op(op, probs, k, p, out, stream, key):
    xa = _rows(op, "probs", probs, ("f32",))
    y = C.output(op, "out", out, like=xa, kind="f32", shape=xa.shape, like_name="probs")
    _launch_rows(op, RowSpec("f32", "probs", "renorm"), xa, None, y, k, p, None, None, None,
                 None, None, stream, key)
    return y.obj


@torch_op("Tensor probs, Tensor|int top_k", outputs=("out",), fake=_fake_f32)
def top_k_renorm_probs(probs, top_k, *, out=None, stream=None, launch_key=None):
    """The probabilities of the top-k set renormalised: ``out[r, i] = r32(p_i / r32(S))`` for the
    kept tokens (``S`` their float64 sum), 0 elsewhere (NaN included).

    Args:
        probs: ``[num_rows, vocab_size]`` fp32, last dimension contiguous. Not modified.
        top_k: an int or a ``[num_rows]`` int32 tensor; ``<= 0`` or ``>= vocab_size``: off.
        out: optional ``[num_rows, vocab_size]`` fp32 output; allocated when None.
        stream: CUDA stream; default the caller's current stream.

    Returns ``out``. Mutates only ``out``.

    {raises}

    Matches FlashInfer 0.6.12's ``top_k_renorm_probs`` (its sum is fp32).
    """
    return _renorm_op("loomnb.top_k_renorm_probs", probs, top_k, None, out, stream, launch_key)


@torch_op("Tensor probs, Tensor|float top_p", outputs=("out",), fake=_fake_f32)
def top_p_renorm_probs(probs, top_p, *, out=None, stream=None, launch_key=None):
    """The probabilities of the top-p set renormalised: ``out[r, i] = r32(p_i / r32(S))`` for
    the kept tokens, 0 elsewhere.

    Args:
        probs: ``[num_rows, vocab_size]`` fp32, last dimension contiguous. Not modified.
        top_p: a float or a ``[num_rows]`` fp32 tensor; ``>= 1``: off.
        out: optional ``[num_rows, vocab_size]`` fp32 output; allocated when None.
        stream: CUDA stream; default the caller's current stream.

    Returns ``out``. Mutates only ``out``.

    {raises}

    Matches FlashInfer 0.6.12's ``top_p_renorm_probs`` (its sum is fp32).
    """
    return _renorm_op("loomnb.top_p_renorm_probs", probs, None, top_p, out, stream, launch_key)


# ---------------------------------------------------------------- penalties
def _launch_penalty(op, spec, la, pm, om, rep, freq, pres, stream, key):
    R, V = la.shape
    if R == 0:
        return
    threads = L.forced_threads() or PENALTY_THREADS
    params = [L.array(la), L.array(pm), L.array(om), L.array(rep),
              L.array(freq) if freq is not None else L.absent("float32", 1),
              L.array(pres) if pres is not None else L.absent("float32", 1), L.i64(V), L.i64(R)]
    L.launch(penalty_kernel, spec, (-(-V // threads), min(R, PENALTY_GRID_ROWS)), threads, params,
             like=la,
             stream=stream, key=key)


def _mask(op, name, obj, la, kinds=("bool",)):
    a = ad.wrap(op, name, obj)
    check_kind(op, name, a, kinds)
    check_shape(op, name, a, la.shape, "[num_seqs, vocab_size], the logits' shape")
    check_same_device(op, name, a, "logits", la)
    return a


def _per_seq(op, name, obj, la, kind):
    a = ad.wrap(op, name, obj)
    check_kind(op, name, a, (kind,))
    check_shape(op, name, a, (la.shape[0],), "[num_seqs]")
    check_same_device(op, name, a, "logits", la)
    return a


def _penalty_logits(op, logits, kinds):
    la = _rows(op, "logits", logits, kinds)
    C.writable(op, {"logits": la})
    return la


@torch_op("Tensor(a!) logits, Tensor prompt_mask, Tensor output_mask, Tensor repetition_penalties")
def apply_repetition_penalties_(logits, prompt_mask, output_mask, repetition_penalties, *,
                                stream=None, launch_key=None):
    """Repetition penalties in place, vLLM's CUDA op: for the tokens seen in the prompt or the
    output (``prompt_mask | output_mask``), ``x / r`` where ``x > 0`` and ``x * r`` elsewhere,
    computed in float32 and rounded once to the logits' dtype; other tokens untouched.

    Args:
        logits: ``[num_seqs, vocab_size]`` fp32, bf16 or fp16, last dimension contiguous,
            writable. Mutated in place.
        prompt_mask, output_mask: ``[num_seqs, vocab_size]`` bool.
        repetition_penalties: ``[num_seqs]`` of the logits' dtype (vLLM's op takes that dtype).
        stream: CUDA stream; default the caller's current stream.

    Returns None. Mutates ``logits``.

    {raises}

    Matches vLLM 0.24's ``apply_repetition_penalties_`` (``csrc/sampler.cu``), bit for bit.
    """
    op = "loomnb.apply_repetition_penalties_"
    la = _penalty_logits(op, logits, LOGITS_KINDS)
    pm = _mask(op, "prompt_mask", prompt_mask, la)
    om = _mask(op, "output_mask", output_mask, la)
    rp = _per_seq(op, "repetition_penalties", repetition_penalties, la, la.kind)
    C.no_overlap(op, {"logits": la}, {"prompt_mask": pm, "output_mask": om,
                                      "repetition_penalties": rp})
    _launch_penalty(op, PenaltySpec(la.kind, "repetition"), la, pm, om, rp, None, None, stream,
                    launch_key)


@torch_op("Tensor(a!) logits, Tensor prompt_token_mask, Tensor output_token_counts, "
          "Tensor repetition_penalties, Tensor frequency_penalties, Tensor presence_penalties",
          returns=("logits",))
def apply_penalties_(logits, prompt_token_mask, output_token_counts, repetition_penalties,
                     frequency_penalties, presence_penalties, *, stream=None, launch_key=None):
    """vLLM's three penalties in place, in its order, one pass:

    ``x = seen ? (x > 0 ? x / rep : x * rep) : x`` with ``seen = prompt_token_mask | counts > 0``,
    then ``x = r32(x - r32(freq * r32(counts)))`` and ``x = r32(x - r32(pres * (counts > 0)))``
    (OpenAI's frequency and presence penalties), per-row parameters; every token is rewritten
    (``0 * inf`` gives NaN, as torch's in-place arithmetic does).

    Args:
        logits: ``[num_seqs, vocab_size]`` fp32 (the sampler's logits), last dimension
            contiguous, writable. Mutated in place.
        prompt_token_mask: ``[num_seqs, vocab_size]`` bool, the tokens of the prompt.
        output_token_counts: ``[num_seqs, vocab_size]`` int32 or int64, each token's count in
            the output so far.
        repetition_penalties, frequency_penalties, presence_penalties: ``[num_seqs]`` fp32
            (1, 0 and 0 leave a row unchanged).
        stream: CUDA stream; default the caller's current stream.

    Returns ``logits``. Mutates ``logits``.

    {raises}

    Matches vLLM 0.24's ``apply_penalties`` (``model_executor/layers/utils.py``: the repetition
    CUDA op, then the in-place fp32 subtractions), bit for bit; vLLM builds the mask and counts
    from token lists (``get_token_bin_counts_and_mask``), loomnb takes them built.
    """
    op = "loomnb.apply_penalties_"
    la = _penalty_logits(op, logits, ("f32",))
    pm = _mask(op, "prompt_token_mask", prompt_token_mask, la)
    ca = _mask(op, "output_token_counts", output_token_counts, la, ("i32", "i64"))
    rp = _per_seq(op, "repetition_penalties", repetition_penalties, la, "f32")
    fr = _per_seq(op, "frequency_penalties", frequency_penalties, la, "f32")
    pr = _per_seq(op, "presence_penalties", presence_penalties, la, "f32")
    C.no_overlap(op, {"logits": la}, {"prompt_token_mask": pm, "output_token_counts": ca,
                                      "repetition_penalties": rp, "frequency_penalties": fr,
                                      "presence_penalties": pr})
    _launch_penalty(op, PenaltySpec("f32", "all", ca.kind), la, pm, ca, rp, fr, pr, stream,
                    launch_key)
    return logits


for _op in (top_k_top_p_sampling_from_logits, top_k_top_p_sampling_from_probs,
            sampling_from_logits, sampling_from_probs, top_k_sampling_from_probs,
            top_p_sampling_from_probs, min_p_sampling_from_probs, top_k_mask_logits,
            top_k_top_p_mask_logits, top_k_renorm_probs, top_p_renorm_probs,
            apply_repetition_penalties_, apply_penalties_):
    _op.__doc__ = (_op.__doc__.replace("{raises}", _RAISES)
                   .replace("{sampling_args}", _SAMPLING_ARGS)
                   .replace("{filter_args}", _FILTER_ARGS))
del _op


# ---------------------------------------------------------------- chain speculative sampling
def _chain_rows(op, name, obj, B, rows, V, like):
    """``draft_probs``/``target_probs``: fp32 ``[B, rows, V]``, last dimension contiguous, on
    ``like``'s device (``like`` None: this is the array the others are checked against)."""
    a = ad.wrap(op, name, obj)
    check_kind(op, name, a, ("f32",))
    check_ndim(op, name, a, 3)
    sym = "num_speculative_tokens" + (" + 1" if name == "target_probs" else "")
    if V is None:
        if a.shape[:2] != (B, rows) or not 1 <= a.shape[2] <= MAX_VOCAB:
            C.fail_value(op, name, f"of shape [batch_size, {sym}, vocab_size] = [{B}, {rows}, "
                         f"vocab_size] with 1 <= vocab_size <= {MAX_VOCAB}",
                         f"shape {list(a.shape)}")
    else:
        check_shape(op, name, a, (B, rows, V), f"[batch_size, {sym}, vocab_size], vocab_size "
                    "from 'target_probs'")
    if a.size > 0 and a.shape[2] > 1 and a.strides[2] != 1:
        C.fail_value(op, name, "contiguous in its last dimension (stride 1)",
                     f"strides {a.strides} (in elements)")
    if like is not None:
        check_same_device(op, name, a, "target_probs", like)
    return a


def _fake_chain(draft_probs, draft_token_ids, target_probs, *_, **__):
    B, n = draft_token_ids.shape
    # zeros: the .out form fills the accumulators the caller did not pass, and adds to them
    return (draft_token_ids.new_empty((B, n + 1)),
            draft_token_ids.new_zeros((B,)), draft_token_ids.new_zeros((B,)))


@torch_op("Tensor? draft_probs, Tensor draft_token_ids, Tensor target_probs, "
          "bool deterministic=True, " + _SEEDS,
          outputs=("out", "maybe_output_accepted_token_num",
                   "maybe_output_emitted_draft_token_num"), fake=_fake_chain)
def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs,
                               maybe_output_accepted_token_num=None,
                               maybe_output_emitted_draft_token_num=None, deterministic=True,
                               generator=None, seed=None, offset=None, *, out=None, stream=None,
                               launch_key=None):
    """Verify a chain of ``n`` draft tokens per request against the target model by rejection
    sampling (speculative sampling), all requests and positions in one launch.

    For request ``b`` and position ``j = 0 .. n-1``, with ``d = draft_token_ids[b, j]``, ``p =
    target_probs[b, j]`` and ``q = draft_probs[b, j]`` (without ``draft_probs``: ``q`` is the
    one-hot of ``d``, as n-gram drafts; ``q(d) = 1``)::

        accept_j = r32(u_j * q(d)) < p(d)          (u_j uniform in (0, 1), Philox below)
        pos      = the first j with not accept_j   (n if there is none)
        out[b, j] = d_j for j < pos;  out[b, pos] = t;  out[b, j] = -1 for j > pos
        t ~ relu(p - q) normalised at j = pos < n  (one-hot q: p with p(d) set to 0)
        t ~ target_probs[b, n]                     at pos = n (the bonus token)

    ``t = argmax_i r32(log r_i + g_i)`` over the tokens of positive mass ``r_i`` (``r = p - q``
    in float32 where positive, else 0; NaN counts as 0), the lowest index on a tie: a Gumbel-max
    draw from ``r`` normalised. If the residual has no positive entry, ``t`` is drawn from ``p``
    the same way, and if ``p`` has none either, ``t`` is the argmax of ``p`` (lowest index, NaN
    as ``-inf``). A draft id outside ``[0, vocab_size)`` reads ``p(d) = q(d) = 0``: it is
    rejected, and the residual is the whole ``relu(p - q)`` (one-hot drafts: ``p``). NaN in
    ``p(d)`` or ``q(d)`` rejects. The rule samples exactly from the target distribution at every
    emitted position (the rejection-sampling theorem) whatever ``q`` is.

    Counts, as FlashInfer defines them:

    * ``output_emitted_draft_token_num[b] = pos``: the accepted drafts emitted before the
      first rejection (``out[b]`` holds ``pos + 1`` tokens);
    * ``output_accepted_token_num[b] = sum_j accept_j``: the positions whose draft would be
      accepted if each were verified on its own (not stopping at the first rejection), for
      acceptance-rate statistics; its expectation over ``d ~ q`` is ``sum_j sum_t min(p_j(t),
      q_j(t))``.

    Given ``maybe_output_accepted_token_num`` / ``maybe_output_emitted_draft_token_num``, the
    counts are *added* to them in place (int32, wrapping) and they are returned; otherwise new
    arrays hold the counts.

    **Random numbers.** Philox-4x32-10 as the other sampling ops (module docstring): key
    ``seed``, counter ``(c0, salt, offset_lo, offset_hi)``, word ``i & 3``, ``salt`` the request
    ``b`` (an int ``seed``) or 0 (a ``[batch_size]`` seed tensor: a request's draws depend on its
    seed, not on where it sits in the batch). ``c0 = (stream << 20) | (i >> 2)``: stream 1 holds
    the acceptance uniforms (``i = j``, ``u_j = uniform(word)``), stream ``2 + j`` the Gumbel
    variates of position ``j``'s draw (``i`` the token; ``j = n`` the bonus token). Every draw
    depends only on (seed, offset, request or its seed, position, token), never on the batch
    layout or the launch configuration; the other sampling ops draw stream 0.

    Args:
        draft_probs: ``[batch_size, num_speculative_tokens, vocab_size]`` fp32, or None (one-hot
            drafts). Last dimension contiguous. Not modified.
        draft_token_ids: ``[batch_size, num_speculative_tokens]`` int32,
            ``1 <= num_speculative_tokens <= 1024``. Not modified; its values are not checked
            (an id outside the vocabulary is rejected, above).
        target_probs: ``[batch_size, num_speculative_tokens + 1, vocab_size]`` fp32, ``1 <=
            vocab_size <= 2^21``, last dimension contiguous. Not modified.
        maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num: optional
            ``[batch_size]`` int32 accumulators, added to in place.
        deterministic: accepted for FlashInfer's signature; the result is always
            deterministic for a given seed.
        generator: optional ``torch.Generator`` the seed is drawn from (when ``seed`` is None).
        seed, offset: an int, or an int64 tensor ``[batch_size]`` or ``[1]`` (a device offset
            tensor that a CUDA graph's step increments keeps each replay drawing fresh numbers);
            without a seed, one is drawn (as the other sampling ops).
        out: optional ``[batch_size, num_speculative_tokens + 1]`` int32 output for the token
            ids (loomnb's addition); allocated when None.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(output_token_ids, output_accepted_token_num, output_emitted_draft_token_num)``:
    ``[batch_size, num_speculative_tokens + 1]`` int32 padded with -1, and two ``[batch_size]``
    int32 (the accumulators when given). Mutates only ``out`` and the two accumulators.

    Raises ``LoomnbTypeError`` (a ``TypeError``) for a wrong dtype, a host or unknown array or a
    parameter of the wrong type, ``LoomnbValueError`` (a ``ValueError``) for shapes (the three
    inputs' ``batch_size``, ``num_speculative_tokens`` and ``vocab_size`` must agree), layout,
    devices, ``num_speculative_tokens`` outside ``[1, 1024]``, overlapping or read-only outputs
    -- before any launch; nothing is modified. ``batch_size = 0`` is a no-op (empty outputs).

    Matches FlashInfer 0.6.12's ``chain_speculative_sampling`` (name, arguments, outputs, the
    acceptance test ``u * q(d) < p(d)``, the residual, the -1 padding, the in-place counts; its
    distribution, not its tokens: FlashInfer draws from a cuRAND state by inverse CDF). Where
    loomnb differs: ``draft_probs=None`` (one-hot drafts) and ``out=`` are loomnb's; the
    accepted count uses the chain's own ``u_j`` at every position (FlashInfer draws a fresh
    uniform for the position that stopped the chain, so it may count it); an id outside the
    vocabulary is rejected (FlashInfer reads out of bounds); an empty residual draws from ``p``
    (FlashInfer's answer is then undefined).
    """
    op = "loomnb.chain_speculative_sampling"
    ida = ad.wrap(op, "draft_token_ids", draft_token_ids)
    check_kind(op, "draft_token_ids", ida, ("i32",))
    check_ndim(op, "draft_token_ids", ida, 2)
    B, n = ida.shape
    if not 1 <= n <= SPEC_MAX_DRAFTS:
        C.fail_value(op, "draft_token_ids", "of shape [batch_size, num_speculative_tokens] "
                     f"with 1 <= num_speculative_tokens <= {SPEC_MAX_DRAFTS}",
                     f"shape {list(ida.shape)}")
    tpa = _chain_rows(op, "target_probs", target_probs, B, n + 1, None, None)
    V = tpa.shape[2]
    check_same_device(op, "draft_token_ids", ida, "target_probs", tpa)
    dpa = None
    if draft_probs is not None:
        dpa = _chain_rows(op, "draft_probs", draft_probs, B, n, V, tpa)
    C.flag(op, "deterministic", deterministic)
    ids = C.output(op, "out", out, like=tpa, kind="i32", shape=(B, n + 1),
                   like_name="target_probs")
    acc = C.output(op, "maybe_output_accepted_token_num", maybe_output_accepted_token_num,
                   like=tpa, kind="i32", shape=(B,), like_name="target_probs")
    emi = C.output(op, "maybe_output_emitted_draft_token_num",
                   maybe_output_emitted_draft_token_num, like=tpa, kind="i32", shape=(B,),
                   like_name="target_probs")
    sa, sv, oa, ov, fresh = _seeds(op, tpa, seed, offset, generator)
    if fresh:
        launch_key = None  # a fresh seed every call: nothing to replay
    C.no_overlap(op, {"out": ids, "maybe_output_accepted_token_num": acc,
                      "maybe_output_emitted_draft_token_num": emi},
                 {"draft_probs": dpa, "draft_token_ids": ida, "target_probs": tpa, "seed": sa,
                  "offset": oa})
    result = (ids.obj, acc.obj, emi.obj)
    if B == 0:
        return result
    vec = C.vectors_ok(tpa, dpa)  # 16-byte loads where every row of both allows them
    spec = ChainSpec(dpa is not None, "vec" if vec else "scalar")
    rows = "uint32" if vec else "float32"
    params = [L.array(dpa, words=vec) if dpa is not None else L.absent(rows, 3),
              L.array(ida), L.array(tpa, words=vec), L.array(ids), L.array(acc), L.array(emi),
              L.array(sa) if sa is not None else L.absent("int64", 1),
              L.array(oa) if oa is not None else L.absent("int64", 1),
              L.i64(sv), L.i64(ov), L.i64(int(sa is not None and sa.shape[0] > 1)),
              L.i64(int(maybe_output_accepted_token_num is not None)),
              L.i64(int(maybe_output_emitted_draft_token_num is not None)), L.i64(n), L.i64(V)]
    L.launch(chain_kernel, spec, B, _threads(V), params, like=tpa, stream=stream,
             key=launch_key)
    return result
