"""NumPy + ml_dtypes references for paged decode attention and the LSE merge.

``paged_decode_attention``: per sequence ``s`` with ``L = seq_lens[s]`` and query head ``h``
(KV head ``hk = h // (num_heads // num_kv_heads)``), over the visible keys
``j in [start, L)``, ``start = max(0, L - sliding_window)`` (0 without a window)::

    k_j, v_j = the rows of token j: block block_tables[s, j // block_size], offset j % block_size
               (FP8 cache: decoded E4M3 * k_scale[hk] / v_scale[hk])
    z_j  = scale * sum_d f(q_d) * k_jd            softcap: z_j = cap * tanh(z_j / cap)
    lse  = log(sum_j exp(z_j))                    natural log; -inf when no key is visible
    out  = r(sum_j exp(z_j - lse) * v_j)          0 when no key is visible

all in float64 (:func:`decode_exact` returns those float64 values; the public function rounds
``out`` to float32 and then to the query dtype, as the kernels round their float32 result once,
and ``lse`` to float32). The kernels compute in float32 and are compared with the float64
values under the ``("attention", dtype)`` tolerance rows of ``tests/tolerances.py``.

``merge_attn_states`` follows vLLM 0.24's CUDA op (``csrc/attention/merge_attn_states.cu``):
an infinite LSE counts as -inf; ``M = fmax(p_lse, s_lse)``; when both are -inf the output is
``prefix_output`` unchanged (bit for bit) and the LSE -inf; else
``out = r(p_out * p_se / (p_se + s_se) + s_out * s_se / (p_se + s_se))`` with
``p_se = exp(p_lse - M)``, ``s_se = exp(s_lse - M)`` and ``lse = log(p_se + s_se) + M``
(:func:`merge_exact`: the float64 values).

Arguments are NumPy arrays (bf16 as ``ml_dtypes.bfloat16``, FP8 as ``float8_e4m3fn`` or
``uint8`` codes) with the ops' shapes and strides; ``stream`` is accepted and ignored.
"""

import numpy as np

from .fp8 import e4m3_decode
from .numerics import to_dtype

__all__ = ["paged_decode_attention", "merge_attn_states"]


def _f64(a):
    """Activation values (bf16, fp16, fp32 or already float64) as float64, exactly."""
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype == np.float64 else a.astype(np.float32).astype(np.float64)


def _fp8_f64(a):
    a = np.asarray(a)
    return e4m3_decode(a.view(np.uint8)).astype(np.float64)


def _scales(scale, num_kv_heads):
    """``k_scale``/``v_scale`` (``[1]``, ``[]`` or ``[num_kv_heads]``) as float64 ``[num_kv_heads]``."""
    s = np.asarray(scale, dtype=np.float32).reshape(-1).astype(np.float64)
    return np.broadcast_to(s, (num_kv_heads,)) if s.size == 1 else s


def gather_kv(key_cache, value_cache, block_tables, seq, start, stop, *, kv_cache_dtype="auto",
              k_scale=None, v_scale=None):
    """float64 ``(K, V)`` of tokens ``start .. stop-1`` of sequence ``seq``: ``[n, num_kv_heads,
    head_size]`` each, read through ``block_tables`` from the caches' logical views (``key_cache``
    ``[num_blocks, block_size, num_kv_heads, head_size]`` or the legacy x-packed 5-D
    ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``), dequantised for FP8."""
    block_size = value_cache.shape[1]
    num_kv_heads, head_size = value_cache.shape[2], value_cache.shape[3]
    pos = np.arange(start, stop)
    blk = np.asarray(block_tables)[seq, pos // block_size].astype(np.int64)
    off = pos % block_size
    if np.asarray(key_cache).ndim == 5:
        k = np.asarray(key_cache)[blk, :, :, off, :].reshape(len(pos), num_kv_heads, head_size)
    else:
        k = np.asarray(key_cache)[blk, off]
    v = np.asarray(value_cache)[blk, off]
    if kv_cache_dtype == "auto":
        return _f64(k), _f64(v)
    ks, vs = _scales(k_scale, num_kv_heads), _scales(v_scale, num_kv_heads)
    return _fp8_f64(k) * ks[None, :, None], _fp8_f64(v) * vs[None, :, None]


def decode_exact(query, key_cache, value_cache, block_tables, seq_lens, scale, *, softcap=None,
                 sliding_window=None, kv_cache_dtype="auto", k_scale=None, v_scale=None):
    """float64 ``(out [num_seqs, num_heads, head_size], lse [num_heads, num_seqs], vmax
    [num_seqs])`` of :func:`paged_decode_attention` before any rounding; ``vmax`` is the largest
    ``|v|`` among each sequence's visible values (the scale of the absolute tolerance)."""
    q = _f64(query)
    num_seqs, num_heads, head_size = q.shape
    num_kv_heads = value_cache.shape[2]
    group = num_heads // num_kv_heads
    out = np.zeros((num_seqs, num_heads, head_size))
    lse = np.full((num_heads, num_seqs), -np.inf)
    vmax = np.zeros(num_seqs)
    for s in range(num_seqs):
        L = int(seq_lens[s])
        start = max(0, L - sliding_window) if sliding_window else 0
        if L <= start:
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables, s, start, L,
                         kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
        with np.errstate(invalid="ignore", over="ignore"):
            vmax[s] = np.max(np.abs(v))
            qg = q[s].reshape(num_kv_heads, group, head_size)
            z = scale * np.einsum("hgd,nhd->hgn", qg, k)
            if softcap:
                z = softcap * np.tanh(z / softcap)
            m = np.max(z, axis=-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            e = np.exp(z - m)
            tot = e.sum(axis=-1)
            o = np.einsum("hgn,nhd->hgd", e, v) / tot[..., None]
            lse[:, s] = (np.log(tot) + m[..., 0]).reshape(num_heads)
        out[s] = np.where(tot[..., None] > 0, o, 0.0).reshape(num_heads, head_size)
    return out, lse, vmax


def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, *,
                           softcap=None, sliding_window=None, kv_cache_dtype="auto",
                           k_scale=None, v_scale=None, out=None, return_lse=False,
                           max_seq_len=None, lse=None, check_indices=False, stream=None):
    """Reference paged decode attention: ``out`` (query dtype), and ``lse`` (float32 ``[num_heads,
    num_seqs]``, filled when given) with ``return_lse``. ``max_seq_len`` (a launch hint of the
    op) and ``check_indices`` (the op's device-side index check) are ignored."""
    given_lse = lse
    o, lse, _ = decode_exact(query, key_cache, value_cache, block_tables, seq_lens, scale,
                             softcap=softcap, sliding_window=sliding_window,
                             kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    res = to_dtype(o.astype(np.float32), np.asarray(query).dtype)
    if out is not None:
        out[...] = res
        res = out
    lse = lse.astype(np.float32)
    if given_lse is not None:
        given_lse[...] = lse
        lse = given_lse
    return (res, lse) if return_lse or given_lse is not None else res


def merge_exact(prefix_output, prefix_lse, suffix_output, suffix_lse):
    """float64 ``(out [N, H, D], lse [H, N], copied [N, H])`` of :func:`merge_attn_states`;
    ``copied`` marks the rows whose output is ``prefix_output`` bit for bit (both LSEs -inf)."""
    p_lse = np.asarray(prefix_lse, dtype=np.float64).T  # [N, H]
    s_lse = np.asarray(suffix_lse, dtype=np.float64).T
    p_lse = np.where(np.isinf(p_lse), -np.inf, p_lse)
    s_lse = np.where(np.isinf(s_lse), -np.inf, s_lse)
    mx = np.fmax(p_lse, s_lse)
    copied = np.isinf(mx)
    m = np.where(copied, 0.0, mx)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        p_se, s_se = np.exp(p_lse - m), np.exp(s_lse - m)
        tot = p_se + s_se
        o = (_f64(prefix_output) * (p_se / tot)[..., None]
             + _f64(suffix_output) * (s_se / tot)[..., None])
        lse = np.where(copied, mx, np.log(tot) + m)
    return o, lse.T, copied


def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                      output_lse=None, *, stream=None):
    """Reference ``merge_attn_states``: fills ``output`` (and ``output_lse``) and returns ``output``."""
    o, lse, copied = merge_exact(prefix_output, prefix_lse, suffix_output, suffix_lse)
    res = to_dtype(o.astype(np.float32), np.asarray(output).dtype)
    res[copied] = np.asarray(prefix_output)[copied]
    output[...] = res
    if output_lse is not None:
        output_lse[...] = lse.astype(np.float32)
    return output
