"""NumPy references for the sampler family: penalties, top-k / top-p / min-p filtering,
renormalisation and seeded sampling -- the truth the kernels are tested on.

The filters are written directly (sorted keys and sums), not as the kernels' radix select:

* a token's key is its float32's ordered bits (``+-0`` one key, NaN never kept);
* top-k keeps the keys ``>=`` the ``k``-th largest among the eligible tokens (ties kept);
* top-p keeps the keys ``>=`` the first key ``t``, going down, with ``A(t) + W(t) >= top_p *
  Z``: ``W`` the fixed-point mass ``floor(w * 2^32)`` of the tokens with key ``t``, ``A(t)`` that
  of the keys above, ``Z`` the candidates' total (float64 product, exact integer sums);
* min-p keeps ``w >= min_p`` (logits; ``w = expf(r32(r32(x / T) - r32(x_max / T)))``, 1 at the
  maximum) or ``p >= r32(p_max * min_p)`` (probabilities);
* a sample is ``argmax_i r32(s_i + g_i)`` over the kept tokens (the lowest index on a tie),
  ``g_i = -log(-log(u_i))`` from Philox-4x32-10 (:func:`philox`) at key ``(seed_lo, seed_hi)``,
  counter ``(i >> 2, salt, offset_lo, offset_hi)``, word ``i & 3``; ``exp`` and ``log`` are
  correctly rounded to float32 here (the GPU's libdevice ``expf``/``logf`` are within 2 ulps).

Arguments are NumPy arrays (bf16 as ``ml_dtypes.bfloat16``) or numbers; ``stream``,
``deterministic`` and ``generator`` are accepted so the signatures equal the ops'. Without a
``seed`` (and without a generator) the oracle draws one from NumPy's global generator: the op
and its oracle agree on tokens only for a given seed.
"""

import numpy as np

from .numerics import to_dtype

__all__ = ["apply_repetition_penalties_", "apply_penalties_", "top_k_top_p_sampling_from_logits",
           "top_k_top_p_sampling_from_probs", "sampling_from_logits", "sampling_from_probs",
           "top_k_sampling_from_probs", "top_p_sampling_from_probs", "min_p_sampling_from_probs",
           "top_k_mask_logits", "top_k_top_p_mask_logits", "top_k_renorm_probs",
           "top_p_renorm_probs"]

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
MASS_SCALE = np.float32(2.0 ** 32)
SAMPLING_EPS = np.float32(1e-5)


# ---------------------------------------------------------------- Philox-4x32-10
def philox(c0, c1, c2, c3, k0, k1, rounds=10):
    """The four uint32 words of Philox-4x32-``rounds`` for arrays (broadcast) of counter words
    ``c0..c3`` and key words ``k0, k1``."""
    c0, c1, c2, c3, k0, k1 = (np.asarray(v, np.uint64) & np.uint64(0xFFFFFFFF)
                              for v in np.broadcast_arrays(c0, c1, c2, c3, k0, k1))
    low = np.uint64(0xFFFFFFFF)
    for _ in range(rounds):
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & low,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & low)
        k0, k1 = (k0 + np.uint64(W0)) & low, (k1 + np.uint64(W1)) & low
    return tuple(v.astype(np.uint32) for v in (c0, c1, c2, c3))


def uniform(w):
    """``(w >> 9) * 2^-23 + 2^-24`` in float32, in ``(0, 1)``."""
    w = np.asarray(w, np.uint32)
    return ((w >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)


def _log32(v):
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(v, np.float32).astype(np.float64)).astype(np.float32)


def gumbel(w):
    """``-log(-log(uniform(w)))``, each ``log`` correctly rounded to float32."""
    return -_log32(-_log32(uniform(w)))


def token_gumbels(V, seed, offset, salt):
    """The Gumbel variate of tokens ``0..V-1`` of a row (see the module docstring)."""
    i = np.arange(V, dtype=np.uint64)
    seed, offset = np.uint64(np.int64(seed).view(np.uint64)), np.uint64(np.int64(offset).view(np.uint64))
    k0, k1 = seed & np.uint64(0xFFFFFFFF), seed >> np.uint64(32)
    c2, c3 = offset & np.uint64(0xFFFFFFFF), offset >> np.uint64(32)
    words = philox(i >> np.uint64(2), np.uint64(salt), c2, c3, k0, k1)
    w = np.choose((i & np.uint64(3)).astype(np.int64), words)
    return gumbel(w)


# ---------------------------------------------------------------- keys and filters
def keys(x):
    """Ordered uint32 keys of float32 ``x`` (``-0.0`` as ``+0.0``, NaN 0)."""
    x = np.asarray(x, np.float32) + np.float32(0)
    b = x.view(np.uint32)
    k = np.where(b & np.uint32(0x80000000), b ^ np.uint32(0xFFFFFFFF), b | np.uint32(0x80000000))
    return np.where(np.isnan(x), np.uint32(0), k).astype(np.uint32)


def _exp32(v):
    with np.errstate(over="ignore", invalid="ignore"):
        return np.exp(np.asarray(v, np.float32).astype(np.float64)).astype(np.float32)


def _per_row(v, R, dtype):
    if v is None:
        return None
    a = np.asarray(v)
    return np.broadcast_to(a.astype(dtype), (R,)) if a.ndim == 0 else a.astype(dtype)


def _threshold(key, weight, target, elig):
    """The first key ``t`` going down with mass(keys > t) + mass(key t) >= target over the
    eligible tokens of positive weight; the lowest such key if none reaches it; None if there
    is no such token."""
    m = elig & (weight > 0)
    if not m.any():
        return None
    ks, ws = key[m], weight[m].astype(np.uint64)
    uk, inv = np.unique(ks, return_inverse=True)
    mass = np.zeros(len(uk), np.uint64)
    np.add.at(mass, inv, ws)
    uk, mass = uk[::-1], mass[::-1]           # descending keys
    cum = np.cumsum(mass)                     # inclusive, exact integers
    hit = np.nonzero(cum.astype(np.float64) >= target)[0]
    return int(uk[hit[0]] if len(hit) else uk[-1])


def _row(x, *, logits, k, p, t, mp, joint):
    """(kept mask, x_max index, s values) of one fp32 row under the filters."""
    V = len(x)
    key = keys(x)
    nan = np.isnan(x)
    use_k = 0 < k < V
    use_p = p < 1
    use_mp = mp > 0
    xf = np.where(nan, -np.inf, x).astype(np.float32)
    xm = np.float32(xf.max()) if V else np.float32(-np.inf)
    # the lowest index of the largest (NaN as -inf): the kernel finds it only when it needs
    # the maximum, and answers it for a row with nothing kept
    im = int(np.argmax(keys(xf))) if (use_mp or use_p) and V else 0
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if logits:
            sm = np.float32(xm / np.float32(t))
            s = (x / np.float32(t)).astype(np.float32)
            w = np.where(x == xm, np.float32(1), _exp32((s - sm).astype(np.float32)))
        else:
            inv = np.float32(1) / xm if xm > 0 else np.float32(0)
            w = (x * np.float32(inv)).astype(np.float32)
            s = _log32(np.where(x > 0, x, np.float32(0)))
    elig = ~nan
    if use_mp:
        elig &= (w >= np.float32(mp)) if logits else (x >= np.float32(xm * np.float32(mp)))
    lo = 0
    if use_k:
        t_k = _threshold(key, np.ones(V, np.uint64), float(k), elig)
        lo = t_k if t_k is not None else 0
    if use_p:
        cand = elig & (key >= (0 if joint else lo))
        W = (w * MASS_SCALE).astype(np.float64)
        W = np.where(cand, np.floor(np.where(np.isfinite(W), W, 0)), 0).astype(np.uint64)
        Z = int(W.sum(dtype=np.uint64))
        t_p = _threshold(key, W, float(np.float64(np.float32(p)) * np.float64(Z)), cand)
        if t_p is not None and t_p > lo:
            lo = t_p
    return elig & (key >= lo), im, s


def _rows_and_params(x, top_k, top_p, temperature, min_p):
    """``(fp32 rows, k, p, T, min_p)``: the rows and each parameter a row (None: off)."""
    R = x.shape[0]
    return (to_dtype(x, np.float32) if x.dtype != np.float32 else x,
            _per_row(0 if top_k is None else top_k, R, np.int64),
            _per_row(1.0 if top_p is None else top_p, R, np.float32),
            _per_row(1.0 if temperature is None else temperature, R, np.float32),
            _per_row(0.0 if min_p is None else min_p, R, np.float32))


def _sample(x, logits, top_k, top_p, temperature, min_p, order, seed, offset):
    x = np.asarray(x)
    R, V = x.shape
    xs, k, p, t, mp = _rows_and_params(x, top_k, top_p, temperature, min_p)
    if seed is None:
        seed = int(np.random.randint(0, 2 ** 62))
    sa = np.asarray(seed, np.int64).reshape(-1)
    oa = np.asarray(0 if offset is None else offset, np.int64).reshape(-1)
    per_row = sa.size > 1
    out = np.zeros(R, np.int32)
    for r in range(R):
        if logits and t[r] < SAMPLING_EPS:
            xf = np.where(np.isnan(xs[r]), -np.inf, xs[r]).astype(np.float32)
            out[r] = int(np.argmax(keys(xf)))
            continue
        tr = t[r] if logits else np.float32(1)
        kept, im, s = _row(xs[r], logits=logits, k=int(k[r]), p=p[r], t=tr, mp=mp[r],
                           joint=order == "joint")
        if not kept.any():
            out[r] = im
            continue
        g = token_gumbels(V, sa[r] if per_row else sa[0], oa[r] if oa.size > 1 else oa[0],
                          0 if per_row else r)
        score = np.where(kept, (s + g).astype(np.float32), np.float32(np.nan))
        sk = np.where(kept, keys(score), 0).astype(np.int64)
        sk[~kept] = -1
        out[r] = int(np.argmax(sk))  # the largest score, the lowest index first
    return out


# ---------------------------------------------------------------- sampling ops
def top_k_top_p_sampling_from_logits(logits, top_k, top_p, *, temperature=None, min_p=None,
                                     filter_apply_order="top_k_first", deterministic=True,
                                     generator=None, seed=None, offset=None, out=None,
                                     stream=None):
    res = _sample(logits, True, top_k, top_p, temperature, min_p, filter_apply_order, seed, offset)
    return _into(out, res)


def top_k_top_p_sampling_from_probs(probs, top_k, top_p, *, min_p=None,
                                    filter_apply_order="top_k_first", deterministic=True,
                                    generator=None, seed=None, offset=None, out=None, stream=None):
    res = _sample(probs, False, top_k, top_p, None, min_p, filter_apply_order, seed, offset)
    return _into(out, res)


def sampling_from_logits(logits, *, temperature=None, deterministic=True, generator=None,
                         seed=None, offset=None, out=None, stream=None):
    return _into(out, _sample(logits, True, None, None, temperature, None, "top_k_first", seed,
                              offset))


def sampling_from_probs(probs, *, deterministic=True, generator=None, seed=None, offset=None,
                        out=None, stream=None):
    return _into(out, _sample(probs, False, None, None, None, None, "top_k_first", seed, offset))


def top_k_sampling_from_probs(probs, top_k, *, deterministic=True, generator=None, seed=None,
                              offset=None, out=None, stream=None):
    return _into(out, _sample(probs, False, top_k, None, None, None, "top_k_first", seed, offset))


def top_p_sampling_from_probs(probs, top_p, *, deterministic=True, generator=None, seed=None,
                              offset=None, out=None, stream=None):
    return _into(out, _sample(probs, False, None, top_p, None, None, "top_k_first", seed, offset))


def min_p_sampling_from_probs(probs, min_p, *, deterministic=True, generator=None, seed=None,
                              offset=None, out=None, stream=None):
    return _into(out, _sample(probs, False, None, None, None, min_p, "top_k_first", seed, offset))


def _into(out, res):
    if out is None:
        return res
    np.asarray(out)[...] = res
    return out


# ---------------------------------------------------------------- masks and renormalisation
def top_k_mask_logits(logits, top_k, *, out=None, stream=None):
    x = np.asarray(logits)
    R, V = x.shape
    xs = to_dtype(x, np.float32)
    k = _per_row(top_k, R, np.int64)
    res = np.empty_like(x)
    for r in range(R):
        kept, _, _ = _row(xs[r], logits=True, k=int(k[r]), p=np.float32(1), t=np.float32(1),
                          mp=np.float32(0), joint=False)
        res[r] = to_dtype(np.where(kept, xs[r], np.float32(-np.inf)), x.dtype)
    return _into(out, res)


def top_k_top_p_mask_logits(logits, top_k, top_p, *, temperature=None, min_p=None,
                            filter_apply_order="top_k_first", out=None, stream=None):
    x = np.asarray(logits)
    R, V = x.shape
    xs, k, p, t, mp = _rows_and_params(x, top_k, top_p, temperature, min_p)
    res = np.empty((R, V), np.float32)
    for r in range(R):
        if t[r] < SAMPLING_EPS:  # greedy: the logits, unfiltered
            res[r] = xs[r]
            continue
        kept, _, s = _row(xs[r], logits=True, k=int(k[r]), p=p[r], t=t[r], mp=mp[r],
                          joint=filter_apply_order == "joint")
        res[r] = np.where(kept, s, np.float32(-np.inf))
    return _into(out, res)


def _renorm(probs, k, p):
    x = np.asarray(probs, np.float32)
    R, V = x.shape
    k = _per_row(k, R, np.int64)
    p = _per_row(p, R, np.float32)
    res = np.zeros((R, V), np.float32)
    for r in range(R):
        kept, _, _ = _row(x[r], logits=False, k=int(k[r]), p=p[r], t=np.float32(1),
                          mp=np.float32(0), joint=False)
        S = np.float32(np.sum(x[r][kept].astype(np.float64)))
        with np.errstate(invalid="ignore", divide="ignore"):
            res[r] = np.where(kept, (x[r] / S).astype(np.float32), np.float32(0))
    return res


def top_k_renorm_probs(probs, top_k, *, out=None, stream=None):
    return _into(out, _renorm(probs, top_k, 1.0))


def top_p_renorm_probs(probs, top_p, *, out=None, stream=None):
    return _into(out, _renorm(probs, 0, top_p))


# ---------------------------------------------------------------- penalties
def apply_repetition_penalties_(logits, prompt_mask, output_mask, repetition_penalties, *,
                                stream=None):
    """vLLM's CUDA op: ``x / r`` where ``x > 0`` and ``x * r`` elsewhere, for the tokens seen in
    the prompt or the output, in the logits' dtype (one rounding)."""
    x = np.asarray(logits)
    xs = to_dtype(x, np.float32)
    r = to_dtype(np.asarray(repetition_penalties), np.float32)[:, None]
    seen = np.asarray(prompt_mask, bool) | np.asarray(output_mask, bool)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        y = np.where(xs > 0, (xs / r).astype(np.float32), (xs * r).astype(np.float32))
    x[...] = np.where(seen, to_dtype(y, x.dtype), x)
    return None


def apply_penalties_(logits, prompt_token_mask, output_token_counts, repetition_penalties,
                     frequency_penalties, presence_penalties, *, stream=None):
    """vLLM's ``apply_penalties`` on fp32 logits: the repetition op over ``prompt | counts > 0``,
    then ``x -= r32(f * r32(count))`` and ``x -= r32(p * (count > 0))``."""
    x = np.asarray(logits)
    counts = np.asarray(output_token_counts)
    apply_repetition_penalties_(x, prompt_token_mask, counts > 0,
                                np.asarray(repetition_penalties, np.float32))
    f = np.asarray(frequency_penalties, np.float32)[:, None]
    pr = np.asarray(presence_penalties, np.float32)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        x -= (f * counts.astype(np.float32)).astype(np.float32)
        x -= (pr * (counts > 0).astype(np.float32)).astype(np.float32)
    return logits


# ---------------------------------------------------------------- chain speculative sampling
__all__ += ["chain_speculative_sampling"]

SPEC_STREAM_SHIFT = 20   # counter word 0 = (stream << 20) | (i >> 2)
SPEC_ACCEPT_STREAM = 1   # the acceptance uniforms, i = the position
SPEC_GUMBEL_STREAM = 2   # position j's Gumbel variates: stream 2 + j, i = the token


def stream_words(count, stream, seed, offset, salt):
    """The Philox words of ``i = 0 .. count-1`` in ``stream`` for requests of ``seed``,
    ``offset``, ``salt`` (arrays ``[B]``; ``stream`` a number or ``[B]``): ``[B, count]``, key
    ``seed``, counter ``((stream << 20) | (i >> 2), salt, offset_lo, offset_hi)``, word
    ``i & 3``."""
    col = lambda v: np.asarray(v, np.int64).reshape(-1, 1).view(np.uint64)  # noqa: E731
    i = np.arange(count, dtype=np.uint64)[None, :]
    seed, offset, salt = col(seed), col(offset), col(salt)
    stream = np.asarray(stream, np.uint64).reshape(-1, 1)
    low = np.uint64(0xFFFFFFFF)
    c0 = (stream << np.uint64(SPEC_STREAM_SHIFT)) | (i >> np.uint64(2))
    words = philox(c0, salt, offset & low, offset >> np.uint64(32), seed & low,
                   seed >> np.uint64(32))
    return np.choose(np.broadcast_to((i & np.uint64(3)).astype(np.int64), c0.shape), words)


def _gumbel_max(r, g):
    """Per row: the lowest index of the largest ``r32(log r_i + g_i)`` over ``r_i > 0``, -1
    where no ``r_i > 0``."""
    pos = r > 0
    score = (_log32(np.where(pos, r, np.float32(1))) + g).astype(np.float32)
    sk = np.where(pos, keys(score).astype(np.int64), -1)
    return np.where(pos.any(1), np.argmax(sk, 1), -1)


def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs,
                               maybe_output_accepted_token_num=None,
                               maybe_output_emitted_draft_token_num=None, deterministic=True,
                               generator=None, seed=None, offset=None, *, out=None, stream=None):
    """FlashInfer's chain speculative sampling with loomnb's rule and random streams (the op's
    docstring), every request at once: ``accept_j = r32(u_j * q(d)) < p(d)`` (``u_j`` from
    stream 1; an id outside ``[0, V)`` reads ``p(d) = q(d) = 0``), ``pos`` the first rejected
    position (``n`` if none); at ``pos < n`` a Gumbel-max draw (stream ``2 + pos``) from
    ``relu(p - q)`` (one-hot drafts: ``p`` with ``p(d) = 0``), from ``p`` if that is empty, else
    ``p``'s argmax; at ``pos = n`` the bonus token from ``target_probs[b, n]``. The
    accumulators, when given, are added to in place (int32, wrapping)."""
    d = np.asarray(draft_token_ids).astype(np.int64)
    tp = np.asarray(target_probs, np.float32)
    dp = None if draft_probs is None else np.asarray(draft_probs, np.float32)
    B, n = d.shape
    V = tp.shape[2]
    if seed is None:
        seed = int(np.random.randint(0, 2 ** 62))
    sa = np.asarray(seed, np.int64).reshape(-1)
    oa = np.asarray(0 if offset is None else offset, np.int64).reshape(-1)
    per_row = sa.size > 1
    if B == 0:
        return (_into(out, np.zeros((0, n + 1), np.int32)),
                *(np.zeros(0, np.int32) if a is None else a for a in
                  (maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num)))
    rows = np.arange(B)
    s = sa if per_row else np.broadcast_to(sa[0], (B,))
    o = oa if oa.size > 1 else np.broadcast_to(oa[0], (B,))
    salt = np.zeros(B, np.int64) if per_row else rows
    u = uniform(stream_words(n, SPEC_ACCEPT_STREAM, s, o, salt))
    ok = (d >= 0) & (d < V)
    dc = np.where(ok, d, 0)
    at = (rows[:, None], np.arange(n)[None, :], dc)
    pd = np.where(ok, tp[at], np.float32(0)).astype(np.float32)
    qd = np.where(ok, dp[at] if dp is not None else np.float32(1), np.float32(0)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        acc = (u * qd).astype(np.float32) < pd
    pos = np.where(acc.all(1), n, np.argmin(acc, 1))
    res = np.where(np.arange(n + 1)[None, :] < pos[:, None], np.pad(d, ((0, 0), (0, 1))), -1)
    p = tp[rows, pos]
    g = gumbel(stream_words(V, SPEC_GUMBEL_STREAM + pos, s, o, salt))
    drafted = pos < n
    with np.errstate(invalid="ignore"):
        if dp is not None:
            r = np.where(drafted[:, None], (p - dp[rows, np.minimum(pos, n - 1)]), p)
        else:
            dpos = np.where(drafted, np.pad(d, ((0, 0), (0, 1)))[rows, pos], -1)
            r = np.where(np.arange(V)[None, :] == dpos[:, None], np.float32(0), p)
        r = np.where(r > 0, r, np.float32(0)).astype(np.float32)
        t = _gumbel_max(r, g)
        t = np.where((t < 0) & drafted, _gumbel_max(np.where(p > 0, p, np.float32(0)), g), t)
    argmax = np.argmax(keys(np.where(np.isnan(p), np.float32(-np.inf), p)), 1) if V else 0
    res[rows, pos] = np.where(t < 0, argmax, t)
    counts = []
    for given, c in ((maybe_output_accepted_token_num, acc.sum(1)),
                     (maybe_output_emitted_draft_token_num, pos)):
        if given is None:
            counts.append(c.astype(np.int32))
        else:
            a = np.asarray(given)
            a[...] = (a.astype(np.int64) + c).astype(np.int32)
            counts.append(given)
    return _into(out, res.astype(np.int32)), counts[0], counts[1]


def _doc_from_ops():
    """The oracles without a docstring of their own say which op they mirror: the formula,
    shapes and rounding points are those of ``loomnb.<name>``'s docstring and
    ``docs/numerics.md``'s sampling section."""
    for name in __all__:
        fn = globals().get(name)
        if callable(fn) and not fn.__doc__:
            fn.__doc__ = (f"NumPy reference of ``loomnb.{name}``: the same signature and result "
                          f"(its docstring gives the formula, shapes and errors; the rounding "
                          f"points are in docs/numerics.md, 'The sampling tail'). Inputs are not "
                          f"validated.")


_doc_from_ops()
