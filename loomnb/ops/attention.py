"""Paged decode attention (MQA/GQA over a paged KV cache, split-K with an LSE merge) and vLLM's
``merge_attn_states``.

Bytes (the benchmark's model): a decode step reads every visible key and value once --
``seq_len * num_kv_heads * head_size * 2`` elements per sequence (bf16: 4 bytes, FP8: 2 bytes
per head dimension and token) -- plus the query, the block table row and the output, which are
noise next to it at any real context. At 32 sequences x 4096 tokens of Llama-3-8B's 8 x 128
bf16 KV heads that is 537 MB, 127 µs at the H200's ~4.2 TB/s copy rate; one query head per KV
head would be the same bytes, so GQA's query heads must share each page read (here: up to 4
per CTA). Small work is latency instead -- one CTA's instruction path -- and there a CTA serves
one or two heads and the shared pages meet in L2 (:func:`heads_per_cta`).

Layouts: ``key_cache``/``value_cache`` are strided views with the logical axes ``[num_blocks,
block_size, num_kv_heads, head_size]``. Every layout of :mod:`loomnb.layouts.paged_kv` is such a
view: vLLM 0.24's interleaved ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (NHD:
``kv[:, 0]``, ``kv[:, 1]``; HND: the ``[num_blocks, 2, num_kv_heads, block_size, head_size]``
buffer permuted), split caches, and the legacy transposed value ``[num_blocks, num_kv_heads,
head_size, block_size]`` permuted to ``(0, 3, 1, 2)`` -- except vLLM's legacy x-packed key
``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` (``x = 16 / element size``),
which is passed as that 5-D array and recognised by its ``ndim``. Caches whose head rows are
contiguous, 16-byte aligned and whose block/token/head strides are multiples of 16 bytes (NHD,
HND, split, the x-packed key) take 16-byte loads; anything else (the transposed value, an odd
offset) takes element loads through the strides -- same results, fewer bytes per instruction.
``layout(query, key_cache, value_cache)`` says which one a call takes.
"""

from __future__ import annotations

from .. import _adapter as ad
from . import _contract as C
from . import _launch as L
from ._attention_args import (cache_strides, check_decode, check_decode_indices, check_states,
                              vectorizable)
from . import _workspace as W
from ._attention_kernels import (ESIZE, LOG2E, MAX_GC, MAX_SPLITS, MERGE_LOADS, SCALAR_LANES,
                                 DecodeSpec, MergeSpec, decode_argtypes, decode_kernel,
                                 head_chunks, lanes_for, merge_argtypes, merge_states_kernel,
                                 split_merge_kernel, tokens_per_tile)
from ._torch_ops import torch_op

__all__ = ["paged_decode_attention", "merge_attn_states"]

DECODE_THREADS = 128             # 4 warps per CTA
MAX_DECODE_THREADS = 256         # up to 255 registers a thread: more threads could not launch
TOKENS_PER_TILE = None           # None: _attention_kernels.tokens_per_tile (a tuning knob)
ELEMENTS_PER_LANE = None         # None: EPL_VEC on the vector path (a tuning knob: 8 or 16)
MAX_HEADS_PER_CTA = None         # None: heads_per_cta's rule (a tuning knob: 1 to MAX_GC)
STATES_THREADS = 128             # merge_attn_states: 4 (token, head) rows per CTA
SPLIT_TARGET_PER_SM = 2          # CTAs per SM the split rule aims for (about one resident wave)
MIN_SPLIT_TOKENS = 128           # a split reads at least this many tokens
SPLIT_MIN_CONTEXT = 256          # shorter contexts are never split (the merge costs more)
SMALL_KV_ELEMENTS = 3 << 20      # heads_per_cta: at most this many key elements is latency-bound
SMALL_KV_WAVES = 4               # ... and then one or two heads a CTA, up to 4 CTAs per SM
DEFAULT_SMS = 132                # H200; the simulator and unknown devices


def num_splits(num_seqs, num_kv_heads, head_chunks, context, sms=DEFAULT_SMS):
    """Split-K rule: the number of splits of each sequence's context.

    ``ctas = num_seqs * num_kv_heads * head_chunks`` CTAs without splitting. When they already
    fill the GPU (``ctas >= 2 * sms``: about one wave at two resident CTAs per SM) or the
    context is short (``< SPLIT_MIN_CONTEXT`` = 256 tokens), one split; else ``min(ceil(2 *
    sms / ctas), context // 128, 64)`` splits, so each reads at least ``MIN_SPLIT_TOKENS`` = 128
    tokens. (Measured on the H200 with ``bench_decode_attention.py --tune``: 64 tokens a split
    is 10-15% faster at 1-8 sequences of 256-512 tokens but up to 24% slower at 1 x 4096 and 8 x
    1024 of SmolLM2's geometry, where the extra splits cost more in the merge than they gain.)
    ``context`` is a host-side bound (``max_seq_len``, else ``max_blocks * block_size``); each
    sequence divides its own visible range on the device, so a loose bound costs speed, never
    correctness. H200 (132 SMs), 8 KV heads: 1 x 1024 -> 8 splits, 8 x 4096 -> 5, 32 x 4096 ->
    2, 128 x 1024 -> 1; SmolLM2's 3 KV heads: 32 x 4096 -> 3, 8 x 16384 -> 11.
    """
    ctas = max(1, num_seqs * num_kv_heads * head_chunks)
    target = SPLIT_TARGET_PER_SM * sms
    if ctas >= target or context < SPLIT_MIN_CONTEXT:
        return 1
    return max(1, min(-(-target // ctas), context // MIN_SPLIT_TOKENS, MAX_SPLITS))


def fused_merge(outputs, splits, threads):
    """Whether the last split CTA merges the splits itself (else :func:`split_merge_kernel`, a
    second launch of one CTA per (sequence, head)): when each of its ``threads`` has at most one
    of the ``outputs = heads a CTA * head_size`` elements and at most ``2 * MERGE_LOADS`` (32)
    partials to load -- two rounds of loads, the first issued while the weights form. Measured
    on the H200 (graph replay, bf16; fused against the two launches): SmolLM2's 9/3/64 at 1 x
    2048 (one head a CTA, 16 splits) 10.9 against 13.6 µs, 1 x 4096 (30 splits) 13.4 against
    16.5; larger merges lose in one CTA: 32/8/128 at 1 x 4096 (4 heads a CTA, 512 outputs on
    128 threads) 31.1 against 24.5, SmolLM2 at 64 x 2048 (3 heads a CTA) 58.4 against 54.1."""
    return outputs <= threads and splits <= 2 * MERGE_LOADS


def heads_per_cta(group, num_seqs, num_kv_heads, context, head_size, sms=DEFAULT_SMS):
    """The most query heads one CTA serves (``DecodeSpec.gc``), for ``group`` query heads per
    KV head.

    A CTA serving ``gc`` heads reads each KV page once for all of them, but its critical path
    (the q load, ``gc`` dot products a token, ``gc`` softmax states, the merge) grows with
    ``gc``. When the work is small -- at most ``SMALL_KV_ELEMENTS`` (3 Mi) visible key
    elements, ``num_seqs * num_kv_heads * context * head_size`` -- the kernel is latency-bound,
    so it takes the smallest ``gc`` in (1, 2) whose grid, ``num_seqs * num_kv_heads *
    ceil(group / gc)`` CTAs before splitting, is at most ``SMALL_KV_WAVES`` (4) CTAs per SM;
    the pages a KV head's CTAs share meet in L2. Otherwise ``MAX_GC`` (4). Measured on the H200
    (``bench_decode_attention.py --tune``, graph replay, bf16; 4 heads a CTA -> 1): SmolLM2's
    9/3/64 at 1 x 160 tokens 11.5 -> 7.3 µs, 1 x 32 7.7 -> 5.2, 1 x 4096 17.6 -> 15.9, 32 x
    160 11.9 -> 8.8; 32/8/128 at 1 x 1024 17.7 -> 13.7, 8 x 160 16.1 -> 10.2, and 32 x 32
    13.0 -> 9.5 with 2 heads a CTA. Past the bound one head a CTA loses up to 2x (32/8/128,
    32 x 4096: 234 -> 465 µs; 9/3/64, 8 x 4096: 22.7 -> 32.1)."""
    if num_seqs * num_kv_heads * context * head_size <= SMALL_KV_ELEMENTS:
        for gc in (1, 2):
            if num_seqs * num_kv_heads * -(-group // gc) <= SMALL_KV_WAVES * sms:
                return gc
    return MAX_GC


def _decode_siblings(spec, group, head_size):
    """The decode variants another batch size or context of the same call could pick -- heads
    a CTA (:func:`heads_per_cta`: 1, 2 or up to ``MAX_GC``), the vector path's lanes and tile
    (:func:`vector_config` below and past a full wave) -- and the split merge that large merges
    take (:func:`fused_merge`), compiled with the first (``_launch.launch(warm=)``). None under
    the tuning knobs."""
    if TOKENS_PER_TILE or ELEMENTS_PER_LANE or MAX_HEADS_PER_CTA:
        return []
    specs = set()
    for max_gc in (1, 2, MAX_GC):
        gch = head_chunks(group, max_gc)[1]
        if spec.path == "scalar":
            specs.add(DecodeSpec(spec.kind, spec.cache, "scalar", SCALAR_LANES, gch))
            continue
        for ctas in (1, 1 << 30):
            epl, tt = vector_config(spec.cache, head_size, ctas)
            specs.add(DecodeSpec(spec.kind, spec.cache, "vec", lanes_for(head_size, epl), gch,
                                 tt, epl))
    merge = MergeSpec(spec.kind)
    return ([(decode_kernel, s, decode_argtypes(s)) for s in sorted(specs, key=str) if s != spec]
            + [(split_merge_kernel, merge, merge_argtypes(merge))])


def vector_config(cache, head_size, ctas, sms=DEFAULT_SMS):
    """``(elements per lane, tokens per tile)`` of the vector path, from a launch-config sweep
    on the H200 (``bench_decode_attention.py --tune``, 2026-11-30; graph replay, 32 sequences
    x 16384 tokens): 8 elements a lane (16 lanes a 128-row, 168 registers, 3 CTAs an SM) is
    fastest when the context is split over few sequences and for head_size 64 with a bf16
    cache (9/3/64: 217 against 315 µs); 16 elements (8 lanes, 255 registers, 2 CTAs an SM,
    fewer instructions a token: less than half the shuffles, and each token's softmax repeated
    by 8 lanes instead of 16) is fastest with an FP8 cache (16-byte loads of 16 codes;
    32/8/128: 726 against 1163 µs) and for a 2-byte
    cache with head_size > 64 once ``ctas = num_seqs * num_kv_heads * head_chunks`` fills the
    SMs without splitting (32/8/128 bf16: 836 against 1122 µs; at 8 sequences, 278 against
    335 µs the other way). 4 tokens a tile, 2 for fp32 caches and for 16-element lanes of
    head_size <= 64."""
    es = ESIZE[cache]
    epl = 16 if es == 1 or (es == 2 and head_size > 64 and ctas >= sms) else 8
    return epl, (2 if epl == 16 and head_size <= 64 else tokens_per_tile(cache))


def decode_threads(context, splits, spec, ctas=None, sms=DEFAULT_SMS):
    """CTA size of the decode pass: ``DECODE_THREADS`` (4 warps), fewer when a split holds
    fewer tokens than one tile of them takes (``lanes * ceil(tokens / TT)`` threads, at least
    one warp): a 32-token context of head_size 64 runs on 2 warps, 16 tokens on one (no
    cross-warp merge). When the whole grid (``ctas`` CTAs, splits included) is smaller than
    the GPU, up to ``MAX_DECODE_THREADS`` (8 warps), so a short context takes fewer tiles in a
    row (each a block-table read, then a KV read). Measured on the H200 this changed nothing
    that shows with 3-4 heads a CTA (SmolLM2 at batch 1 and ~150 tokens: 3 CTAs, 11.2-11.4 µs
    a call either way): that latency was each warp's instruction path (the q load, a dot
    product and a softmax state per served head, the merge), which :func:`heads_per_cta`
    shortens instead (9 CTAs of one head: 7.3 µs; with one head 8 warps beat 2, 7.3 against
    9.8 µs)."""
    tokens = -(-context // splits)
    need = spec.lanes * -(-tokens // spec.tt)
    cap = MAX_DECODE_THREADS if ctas is not None and ctas < sms else DECODE_THREADS
    return min(cap, L.whole_warps(need))


def layout(query, key_cache, value_cache, kv_cache_dtype="auto"):
    """``"vec"`` (16-byte loads) or ``"scalar"`` (element loads): the path
    :func:`paged_decode_attention` takes for these arrays."""
    op = "loomnb.layout"
    q = ad.wrap(op, "query", query)
    fp8 = kv_cache_dtype != "auto"
    esize = 1 if fp8 else q.itemsize
    ok = True
    for name, obj in (("key_cache", key_cache), ("value_cache", value_cache)):
        c = ad.wrap(op, name, obj)
        shape, strides, _ = cache_strides(op, name, c, 16 // esize)
        ok = ok and vectorizable(c, strides, shape, esize)
    return "vec" if ok else "scalar"


def _fake_decode(query, *_, **__):
    return (query.new_empty(query.shape),
            query.new_empty((query.shape[1], query.shape[0]), dtype=ad._torch.float32))


# ---------------------------------------------------------------------------------------------
@torch_op("Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
          "Tensor seq_lens, float scale, *, float? softcap=None, int? sliding_window=None, "
          "str kv_cache_dtype='auto', Tensor? k_scale=None, Tensor? v_scale=None, "
          "int? max_seq_len=None, bool check_indices=False", outputs=("out", "lse"),
          optional={"lse": "return_lse"}, stream_key="query", fake=_fake_decode)
def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, *,
                           softcap=None, sliding_window=None, kv_cache_dtype="auto", k_scale=None,
                           v_scale=None, out=None, return_lse=False, max_seq_len=None, lse=None,
                           check_indices=False, stream=None, launch_key=None):
    """Decode attention of one query token per sequence over its paged KV cache (MQA/GQA).

    For sequence ``s`` (``L = seq_lens[s]`` tokens, the new one included) and query head ``h``
    (KV head ``hk = h // (num_heads // num_kv_heads)``), over the visible keys ``j in [start,
    L)``, ``start = max(0, L - sliding_window)`` (0 without a window)::

        z_j = scale * sum_d f(q[s, h, d]) * k_j[hk, d]        (softcap: z_j = cap * tanh(z_j / cap))
        lse[h, s] = log(sum_j exp(z_j))                        natural log
        out[s, h] = r(sum_j exp(z_j - lse[h, s]) * v_j[hk])

    where token ``j``'s rows sit in block ``block_tables[s, j // block_size]`` at offset ``j %
    block_size``; FP8 caches hold ``stored = real / scale`` E4M3 codes, read as
    ``f(code) * k_scale[hk]`` (``v_scale`` for values). Float32 throughout (FlashAttention's
    numerics: online softmax, normalised once at the end, no epsilon; split-K partials merged
    by their LSEs), ``r`` rounds once to the query dtype. No visible key (``L = 0``): ``out =
    0``, ``lse = -inf``. NaN in a visible key or value propagates; rows past ``seq_len`` and
    ``block_tables`` entries past ``cdiv(seq_len, block_size)`` are never read (stale values,
    NaN, any block number).

    Args:
        query: ``[num_seqs, num_heads, head_size]`` bf16, fp16 or fp32, any strides;
            ``head_size`` 1..256.
        key_cache, value_cache: logical ``[num_blocks, block_size, num_kv_heads, head_size]``
            strided views (module docstring), non-negative strides; ``key_cache`` may be vLLM's
            5-D x-packed key. The query's dtype, or ``float8_e4m3fn``/``uint8`` E4M3 codes
            with an FP8 ``kv_cache_dtype``. ``num_heads % num_kv_heads == 0``.
        block_tables: int32 ``[num_seqs, max_blocks]``; the entries a sequence reads must be
            in ``[0, num_blocks)``: unchecked device reads unless ``check_indices=True``.
        seq_lens: int32 ``[num_seqs]``; a value outside ``[0, max_blocks * block_size]`` is
            clamped into it on the device (so no read leaves ``block_tables``), and flagged by
            ``check_indices=True``.
        scale: the softmax scale (usually ``head_size ** -0.5``), a finite real.
        softcap: None or 0 (off), or ``cap > 0``: logits ``cap * tanh(z / cap)``.
        sliding_window: None, or ``W >= 1``: the last ``W`` tokens only -- vLLM's FlashAttention
            window ``(W - 1, 0)``.
        kv_cache_dtype: ``"auto"`` (the caches hold the query's dtype), ``"fp8"`` or
            ``"fp8_e4m3"`` (E4M3 codes); ``"fp8_e5m2"`` is rejected.
        k_scale, v_scale: float32 device arrays ``[1]`` (or 0-D) or ``[num_kv_heads]``;
            required with an FP8 cache, ignored (but checked) with ``"auto"``, as vLLM's
            FlashAttention backend.
        out: optional ``[num_seqs, num_heads, head_size]`` of the query dtype; allocated when
            None. Must not overlap any input.
        return_lse: also return ``lse``, float32 ``[num_heads, num_seqs]`` (natural log: what
            :func:`merge_attn_states` and vLLM's merge expect).
        max_seq_len: optional host-side bound of ``seq_lens``: only chooses the launch (the
            splits, :func:`num_splits`, and the heads a CTA, :func:`heads_per_cta`; default
            ``max_blocks * block_size``); a wrong bound is slower, never wrong.
        lse: optional float32 ``[num_heads, num_seqs]`` output; implies ``return_lse``.
        check_indices: opt-in check, with no host synchronisation, that every ``seq_lens``
            entry is in ``[0, max_blocks * block_size]`` and every block number a sequence
            reads (columns ``[start // block_size, cdiv(L, block_size))`` of its row; stale
            entries past them are never read and not checked) is in ``[0, num_blocks)``. On
            torch tensors: an asynchronous device-side assert queued before the kernel (when
            it fires, the CUDA context ends and the kernel does not run: a debugging aid, not
            control flow); under the simulator a ``LoomnbValueError`` before the launch. Off
            by default, as vLLM never checks; a checked call skips the eager fast path.
        stream: CUDA stream; default the caller's current stream.

    Returns ``out``, or ``(out, lse)``. Mutates ``out`` and ``lse`` only. Empty batch: no launch.

    Raises ``LoomnbTypeError`` for a wrong dtype (index arrays are int32, never cast) and
    ``LoomnbValueError`` for shapes, strides, devices, overlaps and options -- before any launch,
    naming the argument at fault (a ``num_heads`` that ``num_kv_heads`` does not divide is the
    query's; a cache's shape, the cache's), what was expected and what came.

    Matches vLLM 0.24's FlashAttention decode (``flash_attn_varlen_func`` with ``seqused_k``,
    ``block_table``, ``window_size = (W - 1, 0)``, ``softcap``, ``return_softmax_lse``) and
    FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``. Differs: FP8 caches are dequantised to
    float32 (vLLM's FA3 path also quantises the query to FP8; the legacy ``paged_attention``
    rounds keys, values and probabilities to the query dtype and adds 1e-6 to the sum); the
    split count (hence the last float32 bits) depends on the batch shape, as FlashAttention's.
    """
    op = "loomnb.paged_decode_attention"
    want_lse = return_lse is True or lse is not None
    a = check_decode(op, query, key_cache, value_cache, block_tables, seq_lens, scale, softcap,
                      sliding_window, kv_cache_dtype, k_scale, v_scale, return_lse, max_seq_len,
                      check_indices)
    q = a.q
    S, Hq = a.num_seqs, a.num_heads
    oa = C.output(op, "out", out, like=q, kind=q.kind, shape=q.shape, like_name="query")
    la = (C.output(op, "lse", lse, like=q, kind="f32", shape=(Hq, S), like_name="query")
          if want_lse else None)
    C.writable(op, {"out": oa, "lse": la})
    C.no_overlap(op, {"out": oa, "lse": la},
                 {"query": q, "key_cache": a.k, "value_cache": a.v, "block_tables": a.bt,
                  "seq_lens": a.sl, "k_scale": a.ks, "v_scale": a.vs})
    if check_indices:
        check_decode_indices(op, a, sliding_window, stream)
    if S == 0 or Hq == 0:
        return (oa.obj, la.obj) if want_lse else oa.obj
    _launch_decode(op, a, oa, la, float(scale), softcap, sliding_window, max_seq_len, stream,
                   launch_key)
    return (oa.obj, la.obj) if want_lse else oa.obj


def _launch_decode(op, a, oa, la, scale, softcap, sliding_window, max_seq_len, stream, key):
    q = a.q
    S, Hq, D, Hk, B = a.num_seqs, a.num_heads, a.head_size, a.num_kv_heads, a.block_size
    G = Hq // Hk
    max_blocks = a.bt.shape[1]
    context = max_blocks * B if max_seq_len is None else min(max_seq_len, max_blocks * B)
    if sliding_window:
        context = min(context, sliding_window)
    sms = L.sm_count(q, simulator=DEFAULT_SMS, others=DEFAULT_SMS)
    NC, GCH = head_chunks(G, MAX_HEADS_PER_CTA or heads_per_cta(G, S, Hk, context, D, sms))
    P = num_splits(S, Hk, NC, context, sms)
    esize = 1 if a.fp8 else q.itemsize
    vec = (vectorizable(a.k, a.kstr, a.kshape, esize)
           and vectorizable(a.v, a.vstr, a.kshape, esize))
    if vec:
        epl, tt = vector_config(a.cache_kind, D, S * Hk * NC, sms)
        epl, tt = ELEMENTS_PER_LANE or epl, TOKENS_PER_TILE or tt
        spec = DecodeSpec(q.kind, a.cache_kind, "vec", lanes_for(D, epl), GCH, tt, epl)
    else:
        spec = DecodeSpec(q.kind, a.cache_kind, "scalar", SCALAR_LANES, GCH, TOKENS_PER_TILE or 0)
    threads = min(L.forced_threads() or decode_threads(context, P, spec, S * P * Hk * NC, sms),
                  MAX_DECODE_THREADS)

    def cache_param(c, ext):
        return L.array(c, (ext,), (1,), words=vec)

    def strides(st):
        sb, so, sh, su, se, xl = st
        if vec:  # words; the unit stride in words (contiguous head rows: one unit = 4 words)
            w = lambda n: n * esize // 4  # noqa: E731
            return [w(sb), w(so), w(sh), w(su) if xl else 4, 0, 0]
        return [sb, so, sh, su, se, xl]

    fuse = P > 1 and fused_merge(GCH * D, P, threads)
    if P > 1:  # float32 partials, and a counter per (sequence, KV head, head chunk)
        ws_acc = C.output(op, "workspace", None, like=q, kind="f32", shape=(S, Hq, P, D))
        ws_ml = C.output(op, "workspace", None, like=q, kind="f32", shape=(S, Hq, P, 2))
        pacc, pml = L.array(ws_acc), L.array(ws_ml)
        counters = (W.param(W.counters(q, stream, S * Hk * NC), "uint32", q) if fuse
                    else L.absent("uint32", 1))
    else:
        pacc, pml = L.absent("float32", 4), L.absent("float32", 4)
        counters = L.absent("uint32", 1)
    lse_p = L.array(la) if la is not None else L.absent("float32", 2)
    absent_scale = L.absent("float32", 1)
    ks = L.array(a.ks) if a.fp8 else absent_scale  # [Hk] views (stride 0 for one scale)
    vs = L.array(a.vs) if a.fp8 else absent_scale
    cap = float(softcap) if softcap else 0.0
    bsh = B.bit_length() - 1 if B & (B - 1) == 0 else -1
    ints = [D, Hk, G, NC, GCH, P, B, bsh, *strides(a.kstr), *strides(a.vstr),
            sliding_window or 0, 1 if la is not None else 0, 1 if fuse else 0]
    params = ([L.array(oa), lse_p, pacc, pml, counters, L.array(q), cache_param(a.k, a.kext),
               cache_param(a.v, a.vext), L.array(a.bt), L.array(a.sl), ks, vs]
              + [L.i64(v) for v in ints]
              + [L.f32(scale if cap else scale * LOG2E), L.f32(1.0 / cap if cap else 0.0),
                 L.f32(cap * LOG2E)])
    grid = S * P * Hk * NC
    two = P > 1 and not fuse
    L.launch(decode_kernel, spec, grid, threads, params, like=q, stream=stream, key=key,
             part=(0, 2) if two else (0, 1), warm=lambda: _decode_siblings(spec, G, D))
    if two:
        mspec = MergeSpec(q.kind)
        mthreads = L.forced_threads() or min(256, L.whole_warps(D))
        mparams = [L.array(oa), lse_p, pacc, pml, L.i64(D), L.i64(Hq), L.i64(P),
                   L.i64(1 if la is not None else 0)]
        L.launch(split_merge_kernel, mspec, S * Hq, mthreads, mparams, like=q, stream=stream,
                 key=key, part=(1, 2))


# ---------------------------------------------------------------------------------------------
@torch_op("Tensor(a!) output, Tensor prefix_output, Tensor prefix_lse, Tensor suffix_output, "
          "Tensor suffix_lse, Tensor(b!)? output_lse=None", returns=("output",))
def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                      output_lse=None, *, stream=None, launch_key=None):
    """Merge two attention results over disjoint key sets by their LSEs (vLLM 0.24's CUDA op).

    Per token ``n`` and head ``h``, with ``a = prefix_lse[h, n]``, ``b = suffix_lse[h, n]``
    (an infinite LSE counts as -inf), ``M = fmaxf(a, b)``::

        both -inf:  output[n, h] = prefix_output[n, h] (bit for bit), output_lse[h, n] = -inf
        else:       pa, pb = expf(a - M), expf(b - M);  wa, wb = pa / (pa + pb), pb / (pa + pb)
                    output[n, h, d] = r(fmaf(f(prefix_output[n, h, d]), wa, f(suffix_output[n, h, d]) * wb))
                    output_lse[h, n] = logf(pa + pb) + M

    So a partition with LSE -inf (no keys) contributes nothing: the result is the other one
    exactly, never NaN (a NaN LSE makes the row NaN).

    Args:
        output: ``[num_tokens, num_heads, head_size]`` bf16/fp16/fp32, any strides; written.
        prefix_output, suffix_output: like ``output`` (same dtype and shape), any strides.
        prefix_lse, suffix_lse: float32 ``[num_heads, num_tokens]``, natural log (what
            :func:`paged_decode_attention` and FlashAttention return).
        output_lse: optional float32 ``[num_heads, num_tokens]``; written.
        stream: CUDA stream; default the caller's current stream.

    Returns ``output``. Mutates ``output`` and ``output_lse``; ``output`` may not overlap an
    input. Raises as :func:`paged_decode_attention`. Matches vLLM
    ``torch.ops._C.merge_attn_states(output, output_lse, prefix_output, prefix_lse,
    suffix_output, suffix_lse)`` (since PR #28181; its Triton fallback still gives NaN for two
    empty partitions); unlike it, any strides and head sizes are accepted.
    """
    op = "loomnb.merge_attn_states"
    o, ins = check_states(op, output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                           output_lse)
    ol = ins.pop("output_lse")
    C.writable(op, {"output": o, "output_lse": ol})
    C.no_overlap(op, {"output": o, "output_lse": ol}, ins)
    N, H, D = o.shape
    if N * H == 0:
        return output
    threads = L.forced_threads() or STATES_THREADS
    rows_per_block = threads // 32
    params = [L.array(o), L.array(ol) if ol is not None else L.absent("float32", 2),
              L.array(ins["prefix_output"]), L.array(ins["prefix_lse"]),
              L.array(ins["suffix_output"]), L.array(ins["suffix_lse"]),
              L.i64(N), L.i64(H), L.i64(D), L.i64(1 if ol is not None else 0)]
    L.launch(merge_states_kernel, MergeSpec(o.kind), -(-(N * H) // rows_per_block), threads,
             params, like=o, stream=stream, key=launch_key)
    return output
