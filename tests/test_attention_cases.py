"""Paged decode attention test cases, shared by the oracle, simulator, contract and GPU tests
(``tests/test_attention_oracle.py`` holds the oracle's own checks).

A case is built in NumPy, then moved to torch on a GPU (:func:`to_torch`, same strides):

* caches in every layout the op takes (:data:`LAYOUTS`): vLLM 0.24's interleaved NHD
  ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (``kv[:, 0]``/``kv[:, 1]``), its
  HND twin permuted, split caches, the legacy x-packed key with the transposed value, and a
  cache one element off a 16-byte boundary (the element-load path);
* block tables that are shuffled and non-contiguous, whose entries past ``cdiv(seq_len,
  block_size)`` are garbage (-7, 2^30: a read would fault), and every cache slot that no
  visible token owns -- the tail of a last block included -- holds NaN (FP8: code 0x7F);
* :func:`assert_attention` compares with the float64 oracle under the ``("attention", dtype)``
  rows of ``tests/tolerances.py``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import cuda, float32

from loomnb.oracle.attention import decode_exact, merge_exact
from loomnb.oracle.fp8 import e4m3_encode
from tolerances import TOL

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
NP_DT = {"bf16": BF16, "f16": np.float16, "f32": np.float32}
LAYOUTS = ("nhd", "hnd", "split", "legacy", "offset")
GARBAGE = (-7, 2 ** 30)
MANT = {"bf16": 7, "f16": 10, "f32": 23}      # explicit mantissa bits
MIN_EXP = {"bf16": -126, "f16": -14, "f32": -126}


def cdiv(a, b):
    return -(-a // b)


def _nan_like(dtype):
    return np.uint8(0x7F).view(E4M3) if dtype == E4M3 else dtype.type(np.nan)


def _cache_views(layout, num_blocks, block_size, num_kv_heads, head_size, dtype):
    """(key_cache, value_cache, buffers) NumPy views of NaN-filled buffers in ``layout``."""
    nb, bs, hk, d = num_blocks, block_size, num_kv_heads, head_size
    nan = _nan_like(np.dtype(dtype))
    if layout == "nhd":
        kv = np.full((nb, 2, bs, hk, d), nan, dtype)
        return kv[:, 0], kv[:, 1], (kv,)
    if layout == "hnd":
        kv = np.full((nb, 2, hk, bs, d), nan, dtype)
        return kv[:, 0].transpose(0, 2, 1, 3), kv[:, 1].transpose(0, 2, 1, 3), (kv,)
    if layout == "split":
        kv = np.full((2, nb, bs, hk, d), nan, dtype)
        return kv[0], kv[1], (kv,)
    if layout == "legacy":
        x = 16 // np.dtype(dtype).itemsize
        k = np.full((nb, hk, d // x, bs, x), nan, dtype)
        v = np.full((nb, hk, d, bs), nan, dtype)
        return k, v.transpose(0, 3, 1, 2), (k, v)
    if layout == "offset":  # one element past a 16-byte boundary: the element-load path
        n = nb * bs * hk * d
        flat = np.full(2 * n + 1, nan, dtype)
        return flat[1:n + 1].reshape(nb, bs, hk, d), flat[n + 1:].reshape(nb, bs, hk, d), (flat,)
    raise ValueError(layout)


def _put(cache, blocks, offsets, rows):
    """Write ``rows`` ``[n, num_kv_heads, head_size]`` at (block, offset) of a logical or x-packed view."""
    if cache.ndim == 5:
        n, hk, d = rows.shape
        cache[blocks, :, :, offsets, :] = rows.reshape(n, hk, d // cache.shape[-1], cache.shape[-1])
    else:
        cache[blocks, offsets] = rows


def make_case(seed, *, seq_lens, num_heads, num_kv_heads, head_size, block_size=16,
              kind="bf16", cache="auto", layout="nhd", spare_blocks=3, extra_cols=2,
              per_head_scales=False, q_zero=False, value_scale=1.0):
    """A random decode batch as NumPy arrays (see the module docstring). Returns a dict with
    the op's arguments (``query``, ``key_cache``, ``value_cache``, ``block_tables``,
    ``seq_lens``, ``scale``, ``kv_cache_dtype``, ``k_scale``, ``v_scale``) and ``buffers``."""
    rng = np.random.default_rng(seed)
    dt = NP_DT[kind]
    fp8 = cache != "auto"
    seq_lens = np.asarray(seq_lens, np.int32)
    S = len(seq_lens)
    need = [cdiv(int(L), block_size) for L in seq_lens]
    num_blocks = sum(need) + spare_blocks
    max_blocks = max(need + [1]) + extra_cols
    perm = rng.permutation(num_blocks).astype(np.int32)  # shuffled, non-contiguous
    bt = np.empty((S, max_blocks), np.int32)
    pos = 0
    for s in range(S):
        bt[s, :need[s]] = perm[pos:pos + need[s]]
        pos += need[s]
        bt[s, need[s]:] = np.resize(np.array(GARBAGE, np.int32), max_blocks - need[s])  # stale
    kc, vc, bufs = _cache_views(layout, num_blocks, block_size, num_kv_heads, head_size,
                                E4M3 if fp8 else dt)
    nscale = num_kv_heads if per_head_scales else 1
    k_scale = (0.02 + 0.01 * rng.random(nscale)).astype(np.float32)
    v_scale = (0.02 + 0.01 * rng.random(nscale)).astype(np.float32)
    for s in range(S):
        L = int(seq_lens[s])
        if L == 0:
            continue
        j = np.arange(L)
        blocks, offsets = bt[s, j // block_size], j % block_size
        k = rng.standard_normal((L, num_kv_heads, head_size))
        v = rng.standard_normal((L, num_kv_heads, head_size)) * value_scale
        if fp8:
            ks = np.broadcast_to(k_scale, (num_kv_heads,))[None, :, None]
            vs = np.broadcast_to(v_scale, (num_kv_heads,))[None, :, None]
            k = e4m3_encode((k * 0.05 / ks).astype(np.float32)).view(E4M3)
            v = e4m3_encode((v * 0.05 / vs).astype(np.float32)).view(E4M3)
        else:
            k, v = k.astype(dt), v.astype(dt)
        _put(kc, blocks, offsets, k)
        _put(vc, blocks, offsets, v)
    q = rng.standard_normal((S, num_heads, head_size)).astype(dt)
    if q_zero:
        q[...] = 0
    return {"query": q, "key_cache": kc, "value_cache": vc, "block_tables": bt,
            "seq_lens": seq_lens, "scale": float(head_size) ** -0.5,
            "kv_cache_dtype": "fp8" if fp8 else "auto",
            "k_scale": k_scale if fp8 else None, "v_scale": v_scale if fp8 else None,
            "buffers": bufs, "layout": layout}


def op_args(case, **options):
    """(args, kwargs) of ``paged_decode_attention`` for ``case`` (plus ``options``)."""
    args = tuple(case[k] for k in ("query", "key_cache", "value_cache", "block_tables",
                                   "seq_lens", "scale"))
    kw = {"kv_cache_dtype": case["kv_cache_dtype"], "k_scale": case["k_scale"],
          "v_scale": case["v_scale"], **options}
    return args, kw


def exact(case, **options):
    """The float64 oracle ``(out, lse, vmax)`` of ``case``."""
    args, kw = op_args(case, **{k: v for k, v in options.items()
                                if k in ("softcap", "sliding_window")})
    return decode_exact(*args, **kw)


# ---------------------------------------------------------------- torch (GPU tests)
def to_torch(case, device="cuda"):
    """The same case as torch tensors on ``device``: the buffers moved whole, the views rebuilt
    with the same strides."""
    import torch

    def move(a):
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        if a.dtype == BF16:
            return torch.from_numpy(a.view(np.int16)).to(device).view(torch.bfloat16)
        if a.dtype == E4M3:
            return torch.from_numpy(a.view(np.uint8)).to(device).view(torch.float8_e4m3fn)
        return torch.from_numpy(a).to(device)

    def view_of(buf_t, buf_np, a):
        off = (a.__array_interface__["data"][0] - buf_np.__array_interface__["data"][0]) // a.itemsize
        return torch.as_strided(buf_t, a.shape, tuple(s // a.itemsize for s in a.strides), off)

    out = dict(case)
    bufs = case["buffers"]
    moved = [move(b) for b in bufs]
    for name in ("key_cache", "value_cache"):
        a = case[name]
        i = next(i for i, b in enumerate(bufs) if np.shares_memory(a, b))
        out[name] = view_of(moved[i], bufs[i], a)
    out["buffers"] = tuple(moved)
    for name in ("query", "block_tables", "seq_lens", "k_scale", "v_scale"):
        out[name] = move(case[name])
    return out


def to_numpy(t):
    """torch -> NumPy with the same bits (bf16/FP8 as ml_dtypes)."""
    import torch
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(E4M3)
    return t.numpy()


# ---------------------------------------------------------------- comparisons
def half_ulp(x, kind):
    """Half a unit in the last place of ``kind`` at the float64 values ``x``."""
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** (MIN_EXP[kind] - 1))))
    e = np.maximum(e, MIN_EXP[kind])
    return 2.0 ** (e - MANT[kind] - 1)


def assert_attention(out, want, vmax, kind, what="", lse=None, want_lse=None):
    """``out`` (``[num_seqs, num_heads, head_size]``) within the ``("attention", kind)`` row of
    the float64 ``want``: ``|out - want| <= half an ulp + atol_rel * vmax[seq]``; NaN where
    ``want`` is NaN only; ``lse`` within ``("attention_lse", "f32")``."""
    _, atol_rel, _ = TOL[("attention", kind)]
    got = np.asarray(out).astype(np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    gn, wn = np.isnan(got), np.isnan(want)
    assert np.array_equal(gn, wn), f"{what}: NaN at {np.argwhere(gn != wn)[:4].tolist()}"
    bound = half_ulp(want, kind) + atol_rel * np.asarray(vmax, np.float64)[:, None, None]
    err = np.where(wn, 0.0, np.abs(got - np.where(wn, 0.0, want)))
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} outputs off by more than "
                           f"half an ulp + {atol_rel:g}*max|V|; worst excess {float((err - bound).max()):.3g} at "
                           f"{np.unravel_index(np.argmax(err - bound), err.shape)}")
    if lse is not None:
        _, lrel, _ = TOL[("attention_lse", "f32")]
        g = np.asarray(lse).astype(np.float64)
        assert g.shape == want_lse.shape and g.dtype == np.float64
        both_inf = np.isneginf(g) & np.isneginf(want_lse)
        with np.errstate(invalid="ignore"):
            diff = np.where(both_inf, 0.0, np.abs(g - want_lse))
        lim = lrel * (1.0 + np.where(np.isfinite(want_lse), np.abs(want_lse), 0.0))
        assert np.array_equal(np.isnan(g), np.isnan(want_lse)), f"{what}: lse NaN positions"
        ok = (diff <= lim) | np.isnan(g)
        assert ok.all(), f"{what}: lse off by up to {float(np.nanmax(diff)):.3g} at {np.argwhere(~ok)[:4].tolist()}"


def assert_merge(out, lse, prefix_output, prefix_lse, suffix_output, suffix_lse, kind, what=""):
    """merge_attn_states results within the ``("attention_merge", "any")`` row; rows whose LSEs
    are both -inf are ``prefix_output`` bit for bit."""
    _, rel, _ = TOL[("attention_merge", "any")]
    want, want_lse, copied = merge_exact(prefix_output, prefix_lse, suffix_output, suffix_lse)
    got = np.asarray(out).astype(np.float64)
    p, s = np.asarray(prefix_output).astype(np.float64), np.asarray(suffix_output).astype(np.float64)
    bound = half_ulp(want, kind) + rel * (np.abs(p) + np.abs(s))
    ok = (np.abs(got - want) <= bound) | (np.isnan(got) & np.isnan(want))
    ok[copied] = True
    assert ok.all(), f"{what}: {int((~ok).sum())} outputs off, first at {np.argwhere(~ok)[:3].tolist()}"
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}[np.asarray(out).dtype.itemsize]
    assert np.array_equal(np.asarray(out).view(bits)[copied], np.asarray(prefix_output).view(bits)[copied]), \
        f"{what}: rows with both LSEs -inf must be prefix_output bit for bit"
    if lse is not None:
        g = np.asarray(lse).astype(np.float64)
        both = np.isneginf(g) & np.isneginf(want_lse)
        with np.errstate(invalid="ignore"):
            diff = np.where(both, 0.0, np.abs(g - want_lse))
        lim = rel * (1 + np.where(np.isfinite(want_lse), np.abs(want_lse), 0.0))
        okl = (diff <= lim) | (np.isnan(g) & np.isnan(want_lse))
        assert okl.all(), f"{what}: output_lse off at {np.argwhere(~okl)[:3].tolist()}"


# ---------------------------------------------------------------- oracle helpers
def exact_suffix(case, windows):
    """The float64 oracle of each sequence's last ``windows[s]`` tokens."""
    outs, lses = [], []
    for s, w in enumerate(windows):
        one = dict(case, query=case["query"][s:s + 1], block_tables=case["block_tables"][s:s + 1],
                   seq_lens=case["seq_lens"][s:s + 1])
        o, l_, _ = exact(one, sliding_window=w)
        outs.append(o)
        lses.append(l_)
    return np.concatenate(outs), np.concatenate(lses, axis=1), None


# ---------------------------------------------------------------- scaffold additions
def reduce_kernel(width, stride, n):
    """A kernel checking ``group_reduce(..., stride)`` and ``group_reduce_array`` (sum and max
    of each thread's ``n`` values over its strided group) -- run by the simulator and GPU tests."""
    from loomnb.ops._reduce import fadd, fmax_nan, group_reduce, group_reduce_array
    gsum = group_reduce(fadd, width, stride)
    asum = group_reduce_array(fadd, width, n, stride)
    amax = group_reduce_array(fmax_nan, width, n, stride)

    @cuda.jit
    def k(vals, out):
        t = cuda.threadIdx.x
        a = cuda.local.array(n, float32)
        b = cuda.local.array(n, float32)
        for i in range(n):
            a[i] = vals[t, i]
            b[i] = vals[t, i]
        asum(a)
        amax(b)
        for i in range(n):
            out[t, 0, i] = a[i]
            out[t, 1, i] = b[i]
        out[t, 2, 0] = gsum(vals[t, 0])
    return k


def check_strided_reductions(width, stride, threads=64, n=3):
    """Run :func:`reduce_kernel` and compare with NumPy (sums to float32 rounding)."""
    rng = np.random.default_rng(width * 31 + stride)
    vals = -(rng.random((threads, n)) * 10 + 1).astype(np.float32)  # all negative: a max padded with 0 fails
    out = np.zeros((threads, 3, n), np.float32)
    kern = reduce_kernel(width, stride, n)
    if cuda.is_available():
        dv, do = cuda.to_device(vals), cuda.to_device(out)
        kern[1, threads](dv, do)
        out = do.copy_to_host()
    else:  # the simulator
        kern[1, threads](vals, out)
    span = width * stride
    for t in range(threads):
        members = (t & ~(span - 1)) + (t & (stride - 1)) + stride * np.arange(width)
        np.testing.assert_allclose(out[t, 0], vals[members].sum(axis=0), rtol=1e-5)
        np.testing.assert_array_equal(out[t, 1], vals[members].max(axis=0))
        np.testing.assert_allclose(out[t, 2, 0], vals[members, 0].sum(), rtol=1e-5)


@pytest.mark.nosim
def test_a_multi_launch_call_replays_every_launch_with_one_allocation(monkeypatch):
    """``launch(part=(i, n))``: the fast path stores the n launches of one call under one key;
    the replay allocates each buffer the call allocated once and points every launch that
    uses it at the new one (a split-K pass and its merge share the workspace and the output)."""
    import torch

    from loomnb import _adapter as ad
    from loomnb.ops import _launch as L

    class Fake:
        device, params = 0, 1

        def __init__(self):
            self.slots, self.calls = {}, []

        def set_slot(self, slot, value):
            self.slots[slot] = value

        def driver_call(self, stream, params, extra):
            self.calls.append(dict(self.slots))
            return (L.CUDA_SUCCESS,)

    monkeypatch.setattr(L, "_rt", (lambda: 0, lambda dev: 5, False))
    L.clear_launch_cache()
    ws_t, out_t = torch.empty(8), torch.empty(4)
    ws = ad.Arr(ws_t, "torch", "f32", "float32", (8,), (1,), ws_t.data_ptr(), 0, alloc=lambda: torch.empty(8))
    out = ad.Arr(out_t, "torch", "f32", "float32", (4,), (1,), out_t.data_ptr(), 0, alloc=lambda: torch.empty(4))
    first, second = Fake(), Fake()
    L._remember_chain(("two",), [(first, [L.array(ws), L.f32(1.0)]),
                                 (second, [L.array(out), L.array(ws)])])
    got = L.replay(("two",))
    assert [t.shape for t in got] == [(8,), (4,)]  # first appearance order: ws, then out
    assert first.calls == [{4: got[0].data_ptr()}]
    assert second.calls == [{4: got[1].data_ptr(), 7 + 4: got[0].data_ptr()}]
    assert L.replay(("two",)) is not None and len(second.calls) == 2
    L.clear_launch_cache()
