"""RMSNorm family: ``rms_norm``, ``fused_add_rms_norm`` and their FP8 E4M3 quantising forms.

Numerically interchangeable with vLLM's CUDA ops (``csrc/layernorm_kernels.cu``,
``layernorm_quant_kernels.cu``, ``fused_layernorm_dynamic_per_token_quant.cu``) under the
two-rounding contract: the normalised value is rounded to the activation dtype before the
weight multiply, as HF transformers' ``LlamaRMSNorm`` and vLLM's ``forward_native`` and current
kernels do. vLLM 0.24.0's compiled ``rms_norm``/``fused_add_rms_norm`` round once instead (about
25% of bf16 outputs differ from ours by one ulp); its dynamic-quant op rounds twice, like us.

Bytes moved (the benchmark's model), per token of hidden_size H and element size b:
``rms_norm`` reads x and writes out (2·H·b, + H·b weight once); ``fused_add_rms_norm`` reads x
and residual and writes both (4·H·b); the FP8 forms write H bytes (+4 for the scale).
"""

from __future__ import annotations

import contextlib

import numpy as np
from numba import cuda, types

from .. import _adapter as ad
from .._numba_internals import CUDA_SUCCESS, SIM, FastKernel, array_params, sim_device_array
from ..checks import (check_contiguous, check_eps, check_kind, check_last_contiguous,
                      check_ndim, check_not_aliased, check_rows_non_overlapping,
                      check_same_device, check_same_kind, check_shape, fail_value)
from ._norm_kernels import FLAG_SCALE_UB, make_cached_kernel, make_scalar_kernel, make_vector_kernel

CACHED_VPT = (1, 2, 4, 8)  # 16-byte units a thread of the cached kernel may hold

ACT_KINDS = ("bf16", "f16", "f32")
_STORAGE = {"bf16": types.uint16, "f16": types.uint16, "f32": types.float32, "fp8": types.uint8}
_A2 = {k: types.Array(t, 2, "A") for k, t in _STORAGE.items()}
_A1 = {k: types.Array(t, 1, "A") for k, t in _STORAGE.items()}
_U32_2D = types.Array(types.uint32, 2, "A")
_F32_2D, _F32_1D = types.Array(types.float32, 2, "A"), types.Array(types.float32, 1, "A")

_kernels = {}
_threads_override = None


def kernel_argtypes(kind, variant, vector):
    """numba types of the kernel's parameters (out, x, residual, weight, scales, scale, eps, H, flags)."""
    out_kind = "fp8" if variant not in ("rms", "add") else kind
    if vector:
        arrays = (_U32_2D, _U32_2D, _U32_2D, _U32_2D)
    else:
        arrays = (_A2[out_kind], _A2[kind], _A2[kind], _A1[kind])
    return arrays + (_F32_2D, _F32_1D, types.float32, types.int64, types.int64)


def get_kernel(kind, variant, vector, vpt=0):
    """The kernel for one specialisation, compiled once: a FastKernel on a GPU, a dispatcher in
    the simulator. ``vpt > 0`` selects the register-cached vector kernel with ``vpt`` units a thread.
    """
    key = (kind, variant, vector, vpt)
    k = _kernels.get(key)
    if k is None:
        if vpt:
            pyfunc = make_cached_kernel(kind, variant, vpt)
        else:
            pyfunc = (make_vector_kernel if vector else make_scalar_kernel)(kind, variant)
        disp = cuda.jit(pyfunc)
        k = disp if SIM else FastKernel(disp, kernel_argtypes(kind, variant, vector), pyfunc.__name__)
        _kernels[key] = k
    return k


@contextlib.contextmanager
def force_num_threads(n):
    """Test hook: launch every norm kernel with ``n`` threads per block (a multiple of 32)."""
    global _threads_override
    old, _threads_override = _threads_override, n
    _launch_cache.clear()
    try:
        yield
    finally:
        _threads_override = old
        _launch_cache.clear()


def vector_ok(*arrs):
    """16-byte vector path: 16-bit dtype, rows 16-byte aligned, hidden_size % 8 == 0."""
    for a in arrs:
        if a is None:
            continue
        if a.kind not in ("bf16", "f16", "fp8") or a.ptr % 16 or a.shape[-1] % 8:
            return False
        if a.ndim == 2 and a.shape[0] > 1 and (a.strides[0] * a.itemsize) % 16:
            return False
    return True


def _rows(op, name, a):
    """View an ``[..., hidden_size]`` array as 2-D rows without copying, or raise."""
    if a.ndim == 2:
        return a
    if a.ndim < 1:
        fail_value(op, name, "an array of shape [..., hidden_size]", f"a {a.ndim}-D array")
    if a.ndim == 1:
        return ad.Arr(a.obj, a.lib, a.kind, a.dtype_name, (1, a.shape[0]), (a.shape[0], a.strides[0]),
                      a.ptr, a.device)
    lead = a.shape[:-1]
    for i in range(len(lead) - 1):
        if lead[i + 1] != 1 and a.strides[i] != a.strides[i + 1] * lead[i + 1]:
            fail_value(op, name, "leading dimensions that flatten to rows without a copy",
                       f"shape {a.shape} with strides {a.strides}")
    n = int(np.prod(lead))
    return ad.Arr(a.obj, a.lib, a.kind, a.dtype_name, (n, a.shape[-1]), (a.strides[-2], a.strides[-1]),
                  a.ptr, a.device)


SMALL_BATCH = 256  # about two rows per SM on an H200 (132 SMs): latency-bound


def launch_config(hidden_size, vector, threads=None, num_tokens=None):
    """(threads per block, units a thread holds) for one row of ``hidden_size``.

    Vector rows use the register-cached kernel. Large batches: about 4 units of 16 bytes a
    thread (all in flight at once), fewer for short rows -- at 16384 x 4096 bf16 that (128
    threads) beat 64/256/512/1024 by 3-40% on the H200. Small batches (``num_tokens <=
    SMALL_BATCH``) are latency-bound: one unit a thread where the row allows (512 threads at
    4096), 5-10% faster there. At least 32 and at most 1024 threads; rows too long for 8 units x
    1024 threads stream (vpt 0). Scalar rows take min(hidden_size, 1024) threads, rounded up to
    a warp, like vLLM. Measurements: ``benchmarks/results/launch_config_sweep_*.log``.
    """
    ceil32 = lambda n: max(32, -(-n // 32) * 32)  # noqa: E731
    if not vector:
        return (threads or min(1024, ceil32(hidden_size))), 0
    nv = hidden_size // 8
    if threads:
        vpt = -(-nv // threads)
        return threads, next((v for v in CACHED_VPT if v >= vpt), 0)
    small = num_tokens is not None and num_tokens <= SMALL_BATCH
    for vpt in (CACHED_VPT if small or nv < 64 else (4, 8) if nv >= 256 else (2, 4, 8)):
        t = ceil32(-(-nv // vpt))
        if t <= 1024:
            return t, vpt
    return 1024, 0


def _launch(variant, out, x, residual, weight, scales, scale, eps, flags, stream, key=None):
    """Grid/block arithmetic and the launch: one block per token (row).

    On a GPU the launch is prepared once (parameters packed) and, when ``key`` (a torch call's
    signature, see :func:`_key3`) is given, remembered so the next identical call skips the
    checks and the packing. In the simulator the kernel runs on the NumPy arrays at once.
    """
    num_tokens, hidden_size = x.shape
    vector = vector_ok(out, x, residual, weight)
    threads, vpt = launch_config(hidden_size, vector, _threads_override, num_tokens)
    kern = get_kernel(x.kind, variant, vector, vpt)
    res = residual if residual is not None else x
    if SIM:
        views = [a.sim_view(words=vector).reshape(a.shape[0], -1) for a in (out, x, res)]
        w = weight.sim_view(words=vector).reshape(1, -1) if vector else weight.sim_view()
        sc = scales.obj.reshape(-1, 1) if scales is not None else np.zeros((1, 1), np.float32)
        s1 = scale.obj.reshape(-1) if scale is not None else np.zeros(1, np.float32)
        arrays = [sim_device_array(a) for a in (*views, w, sc, s1)]
        kern[num_tokens, threads](*arrays, np.float32(eps), hidden_size, flags)
        return
    if vector:  # weight as [1, hidden_size/2] uint32 words
        w = array_params(weight.ptr, (1, hidden_size // 2), (0, 4), 4)
    else:
        w = array_params(weight.ptr, (hidden_size,), (weight.itemsize,), weight.itemsize)
    params = (out.params(vector) + x.params(vector) + res.params(vector) + w
              + (array_params(scales.ptr, (num_tokens, 1), (4, 4), 4) if scales is not None
                 else array_params(0, (0, 0), (0, 0), 4))
              + (array_params(scale.ptr, (1,), (4,), 4) if scale is not None
                 else array_params(0, (0,), (0,), 4))
              + (eps, hidden_size, flags))
    with ad.device_guard(x):
        prepared = kern.prepare(x.device, num_tokens, threads, params)
        prepared.launch(ad.stream_handle(x, stream))
    if key is not None:
        _remember(key, prepared)


# --- the eager fast path for torch tensors ---------------------------------------------------
# A call whose arguments have exactly the metadata of an earlier, validated call would pass the
# same checks and pack the same kernel parameters, so it replays the prepared launch on the
# current stream (looked up at every call, so CUDA-graph capture records it). The key holds,
# for every tensor, its data pointer, shape, strides and dtype, plus eps (a Python float only:
# ``True == 1.0`` must not reach a cached launch). The device is implied by the data pointer
# (CUDA's unified virtual addressing gives every device and the host disjoint addresses).
# The per-call cost is then the key (about a dozen tensor-attribute reads), one dict lookup
# and the driver call. launch_cache_info() counts; clear_launch_cache() empties.

LAUNCH_CACHE_SIZE = 1024
_launch_cache = {}  # key -> PreparedLaunch
_cache_stats = {"misses": 0}
_torch_rt = None  # (getDevice, getCurrentRawStream, more than one GPU), set at the first store


def launch_cache_info():
    """``{"misses", "size"}``: fast-path lookups that found nothing, and remembered launches."""
    return dict(_cache_stats, size=len(_launch_cache))


def clear_launch_cache():
    _launch_cache.clear()


def _remember(key, prepared):
    global _torch_rt
    if _torch_rt is None:
        torch = ad._torch
        _torch_rt = (torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream,
                     torch.cuda.device_count() > 1)
    if len(_launch_cache) >= LAUNCH_CACHE_SIZE:
        _launch_cache.clear()
    _launch_cache[key] = prepared


def _key3(tag, a, b, c, eps):
    """The fast-path key of a call with three tensors (written out: this is the hot path of
    ``rms_norm`` and ``fused_add_rms_norm``); None when they are not torch tensors."""
    if type(eps) is not float:
        return None
    try:
        return (tag, eps, a.data_ptr(), a.shape, a.stride(), a.dtype,
                b.data_ptr(), b.shape, b.stride(), b.dtype,
                c.data_ptr(), c.shape, c.stride(), c.dtype)
    except AttributeError:  # not torch tensors: the general path
        return None


def _key(tag, eps, *tensors):
    """The fast-path key of a call with any number of tensors (None allowed)."""
    if type(eps) is not float:
        return None
    key = [tag, eps]
    try:
        for t in tensors:
            key += (None,) if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype)
    except AttributeError:
        return None
    return tuple(key)


def _fast(key):
    """Launch the remembered call for ``key`` on the current stream; False if there is none
    (for the current device)."""
    hit = _launch_cache.get(key)
    if hit is None:
        _cache_stats["misses"] += 1
        return False
    get_device, get_stream, multi_gpu = _torch_rt
    if multi_gpu and get_device() != hit.device:
        return False
    stream = get_stream(hit.device)
    err, = hit.driver_call(stream, hit.params, 0)
    if err is not CUDA_SUCCESS:
        hit.failed(err, stream)
    return True


def _torch_empty(like, shape=None, dtype=None):
    """Allocate an output before the checks (fast path): only for torch tensors."""
    torch = ad._torch
    if torch is None or not isinstance(like, torch.Tensor):
        return None
    if shape is None and like.is_contiguous():
        return torch.empty_like(like, dtype=dtype)
    return torch.empty(like.shape if shape is None else shape, dtype=dtype or like.dtype, device=like.device)


def _check_act(op, x_obj, weight_obj, eps):
    """Shared checks of ``x``/``weight``/``eps``; returns (x rows, weight, eps)."""
    x = _rows(op, "x", ad.wrap(op, "x", x_obj))
    check_kind(op, "x", x, ACT_KINDS)
    check_last_contiguous(op, "x", x)
    w = ad.wrap(op, "weight", weight_obj)
    check_same_kind(op, "weight", w, "x", x)
    check_ndim(op, "weight", w, 1)
    check_shape(op, "weight", w, (x.shape[1],), "[hidden_size]")
    check_contiguous(op, "weight", w)
    check_same_device(op, "weight", w, "x", x)
    return x, w, check_eps(op, eps)


def _check_residual(op, x, residual_obj, weight):
    r = _rows(op, "residual", ad.wrap(op, "residual", residual_obj))
    check_same_kind(op, "residual", r, "x", x)
    check_shape(op, "residual", r, x.shape, "[num_tokens, hidden_size] like 'x'")
    check_contiguous(op, "residual", r)
    check_same_device(op, "residual", r, "x", x)
    check_not_aliased(op, "residual", r, "x", x)
    check_not_aliased(op, "residual", r, "weight", weight)
    return r


def _check_out(op, out_obj, x, weight, kind, name="out"):
    o = _rows(op, name, ad.wrap(op, name, out_obj))
    check_kind(op, name, o, (kind,))
    check_shape(op, name, o, x.shape, "[num_tokens, hidden_size] like 'x'")
    check_last_contiguous(op, name, o)
    check_rows_non_overlapping(op, name, o)
    check_same_device(op, name, o, "x", x)
    if not (o.ptr == x.ptr and o.strides == x.strides):  # exactly in place is fine
        check_not_aliased(op, name, o, "x", x)
    check_not_aliased(op, name, o, "weight", weight)
    return o


def _check_scale(op, name, scale_obj, x):
    s = ad.wrap(op, name, scale_obj)
    check_kind(op, name, s, ("f32",))
    if int(np.prod(s.shape)) != 1:
        fail_value(op, name, "a float32 array of one element", f"shape {list(s.shape)}")
    check_same_device(op, name, s, "x", x)
    return s


# ---------------------------------------------------------------------------------------------
def rms_norm(x, weight, eps, out=None, *, stream=None):
    """RMSNorm of each token: ``y = r(f(r(f(x) * inv)) * f(weight))``.

    ``inv = r32(1 / sqrt(sum_i f(x_i)^2 / hidden_size + eps))`` per token, accumulated and
    evaluated in float64 and rounded once to float32; ``f`` widens to float32, ``r`` rounds to the
    dtype of ``x`` (round to nearest even).

    Args:
        x: ``[..., hidden_size]`` bf16, fp16 or fp32; last dimension contiguous, rows may be
            strided. Not modified.
        weight: ``[hidden_size]``, same dtype as ``x``, contiguous.
        eps: absolute epsilon added to the mean square (inside the square root).
        out: optional ``[..., hidden_size]`` output of ``x``'s dtype; may be ``x`` itself
            (exactly in place), must not partially overlap it. Allocated when None.
        stream: CUDA stream to launch on; default: the caller's current stream.

    Returns ``out``. Mutates: ``out`` only.

    Raises ``LoomnbTypeError`` (a ``TypeError``) for a wrong dtype, host array on a GPU or
    unknown array type, and ``LoomnbValueError`` (a ``ValueError``) for shape, layout, device,
    aliasing or ``eps`` problems -- before any launch. ``num_tokens == 0`` is a no-op.

    Matches vLLM ``torch.ops._C.rms_norm(out, input, weight, epsilon)`` with the two-rounding
    contract (HF ``LlamaRMSNorm``); vLLM 0.24.0's compiled op rounds once. NaN propagates; an
    ``inf`` element makes its row's ``inv = 0`` (that element NaN, the others 0).

    Differs from vLLM in ``inv``: vLLM takes ``rsqrtf`` of a float32 block reduction, whose
    last bits depend on the block size and summation order; loomnb's float64 evaluation is
    independent of both (batch-invariant) and bit-identical to ``loomnb.oracle.rms_norm``.
    """
    if out is None:
        out = _torch_empty(x)
    key = _key3("rms", x, weight, out, eps) if stream is None else None
    if key is not None and _fast(key):
        return out
    op = "loomnb.rms_norm"
    xa, wa, eps = _check_act(op, x, weight, eps)
    if out is None:
        out = ad.empty(xa, tuple(xa.obj.shape), xa.kind)
    oa = _check_out(op, out, xa, wa, xa.kind)
    if xa.shape[0]:
        _launch("rms", oa, xa, None, wa, None, None, eps, 0, stream, key)
    return out


def fused_add_rms_norm(x, residual, weight, eps, *, stream=None):
    """Residual add then RMSNorm, in place: ``residual <- z = r(f(x) + f(residual))``,
    ``x <- r(f(r(f(z) * inv)) * f(weight))`` with ``inv`` computed from the rounded sum ``z``.

    Args:
        x: ``[..., hidden_size]`` bf16, fp16 or fp32; last dimension contiguous, rows may be
            strided. Overwritten with the normalised result.
        residual: same shape and dtype, contiguous; overwritten with the rounded sum.
        weight: ``[hidden_size]``, same dtype, contiguous.
        eps: absolute epsilon (inside the square root).
        stream: CUDA stream; default the caller's current stream.

    Returns ``(x, residual)``, the mutated arrays. Mutates: ``x`` and ``residual``.

    Raises as :func:`rms_norm`; also when ``x`` and ``residual`` overlap. Matches vLLM
    ``torch.ops._C.fused_add_rms_norm(input, residual, weight, epsilon)`` (two-rounding contract;
    vLLM 0.24.0's compiled op rounds the output once).
    """
    key = _key3("add", x, residual, weight, eps) if stream is None else None
    if key is not None and _fast(key):
        return x, residual
    op = "loomnb.fused_add_rms_norm"
    xa, wa, eps = _check_act(op, x, weight, eps)
    check_rows_non_overlapping(op, "x", xa)
    check_not_aliased(op, "x", xa, "weight", wa)
    ra = _check_residual(op, xa, residual, wa)
    if xa.shape[0]:
        _launch("add", xa, xa, ra, wa, None, None, eps, 0, stream, key)
    return x, residual


def rms_norm_static_fp8_quant(out, x, weight, scale, eps, *, stream=None):
    """RMSNorm then static FP8 E4M3 quantisation: ``out = e4m3(clamp(f(y) * (1/scale), +-448))``.

    ``y`` is :func:`rms_norm`'s result (rounded to ``x``'s dtype); ``1/scale`` is computed once
    in float32 and multiplied (vLLM's static kernels do not divide). Units: stored = real / scale.

    Args:
        out: ``[..., hidden_size]`` float8_e4m3fn (torch) / uint8-coded FP8, contiguous rows;
            allocated when None.
        x: ``[..., hidden_size]`` bf16/fp16/fp32, last dim contiguous; not modified.
        weight: ``[hidden_size]`` like ``x``.  scale: float32, one element (device array).
        eps: absolute epsilon.  stream: as :func:`rms_norm`.

    Returns ``out``. Mutates ``out``. A NaN becomes +448 (``fminf``/``fmaxf`` clamp), like vLLM.
    Matches vLLM ``torch.ops._C.rms_norm_static_fp8_quant(out, input, weight, scale, epsilon)``.
    """
    if out is None and ad._torch is not None:
        out = _torch_empty(x, dtype=ad._torch.float8_e4m3fn)
    key = _key("static", eps, out, x, weight, scale) if stream is None else None
    if key is not None and _fast(key):
        return out
    op = "loomnb.rms_norm_static_fp8_quant"
    xa, wa, eps = _check_act(op, x, weight, eps)
    sa = _check_scale(op, "scale", scale, xa)
    if out is None:
        out = ad.empty(xa, tuple(xa.obj.shape), "fp8")
    oa = _check_out(op, out, xa, wa, "fp8")
    if xa.shape[0]:
        _launch("static", oa, xa, None, wa, None, sa, eps, 0, stream, key)
    return out


def fused_add_rms_norm_static_fp8_quant(out, x, residual, weight, scale, eps, *, stream=None):
    """Residual add, RMSNorm, static FP8: ``residual <- z = r(x + residual)``,
    ``out = e4m3(clamp(f(rms_norm(z)) * (1/scale)))``. ``x`` is **not** modified.

    Shapes, dtypes and errors as :func:`rms_norm_static_fp8_quant` and
    :func:`fused_add_rms_norm`. Returns ``(out, residual)``; mutates ``out`` and ``residual``.
    Matches vLLM ``torch.ops._C.fused_add_rms_norm_static_fp8_quant(out, input, residual,
    weight, scale, epsilon)``.
    """
    if out is None and ad._torch is not None:
        out = _torch_empty(x, dtype=ad._torch.float8_e4m3fn)
    key = _key("add_static", eps, out, x, residual, weight, scale) if stream is None else None
    if key is not None and _fast(key):
        return out, residual
    op = "loomnb.fused_add_rms_norm_static_fp8_quant"
    xa, wa, eps = _check_act(op, x, weight, eps)
    sa = _check_scale(op, "scale", scale, xa)
    ra = _check_residual(op, xa, residual, wa)
    if out is None:
        out = ad.empty(xa, tuple(xa.obj.shape), "fp8")
    oa = _check_out(op, out, xa, wa, "fp8")
    check_not_aliased(op, "out", oa, "residual", ra)
    if xa.shape[0]:
        _launch("add_static", oa, xa, ra, wa, None, sa, eps, 0, stream, key)
    return out, residual


def rms_norm_dynamic_per_token_quant(x, weight, eps, scale_ub=None, residual=None, *,
                                     out=None, scales=None, stream=None):
    """RMSNorm with a dynamic per-token FP8 E4M3 scale.

    Per token: ``s = f(x)`` (``+ f(residual)``, kept in float32), ``inv = r32(1 / sqrt(mean(s^2)
    + eps))`` evaluated in float64 (vLLM: ``rsqrtf`` of a float32 reduction; see
    :func:`rms_norm`), ``n = f(r(f(r(s*inv)) * f(weight)))``, ``amax = max|n|`` (NaN ignored), clipped by
    ``scale_ub`` if given (it clips the amax, despite its name), ``scale = max(amax / 448,
    1/(448*512))``, ``out = e4m3(clamp(n / scale))`` with a true float32 division.
    With ``residual``: ``residual <- r(s)`` (the norm uses the unrounded fp32 sum -- unlike
    :func:`fused_add_rms_norm`).

    Args:
        x: ``[..., hidden_size]`` bf16/fp16/fp32, last dim contiguous; not modified.
        weight: ``[hidden_size]`` like ``x``.  eps: absolute epsilon.
        scale_ub: optional float32 one-element device array.
        residual: optional, like ``x``, contiguous; overwritten with ``r(x + residual)``.
        out: optional FP8 ``[..., hidden_size]``; scales: optional float32 ``[num_tokens, 1]``.

    Returns ``(out, scales)``; mutates ``out``, ``scales`` and ``residual``. A NaN is stored
    as +448. Matches vLLM ``ops.rms_norm_dynamic_per_token_quant(input, weight, epsilon,
    quant_dtype=float8_e4m3fn, scale_ub, residual)`` (the int8 output is not supported).
    """
    if ad._torch is not None and isinstance(x, ad._torch.Tensor) and x.ndim >= 1:
        if out is None:
            out = _torch_empty(x, dtype=ad._torch.float8_e4m3fn)
        if scales is None:
            scales = _torch_empty(x, shape=(x.numel() // max(x.shape[-1], 1), 1), dtype=ad._torch.float32)
    key = _key("dynamic", eps, x, weight, scale_ub, residual, out, scales) if stream is None else None
    if key is not None and _fast(key):
        return out, scales
    op = "loomnb.rms_norm_dynamic_per_token_quant"
    xa, wa, eps = _check_act(op, x, weight, eps)
    ua = _check_scale(op, "scale_ub", scale_ub, xa) if scale_ub is not None else None
    ra = _check_residual(op, xa, residual, wa) if residual is not None else None
    num_tokens = xa.shape[0]
    if out is None:
        out = ad.empty(xa, tuple(xa.obj.shape), "fp8")
    oa = _check_out(op, out, xa, wa, "fp8")
    if scales is None:
        scales = ad.empty(xa, (num_tokens, 1), "f32")
    sa = ad.wrap(op, "scales", scales)
    check_kind(op, "scales", sa, ("f32",))
    check_shape(op, "scales", sa, (num_tokens, 1), "[num_tokens, 1]")
    check_contiguous(op, "scales", sa)
    check_same_device(op, "scales", sa, "x", xa)
    for name, other in (("x", xa), ("residual", ra), ("out", oa)):
        if other is not None:
            check_not_aliased(op, "scales", sa, name, other)
    if ra is not None:
        check_not_aliased(op, "out", oa, "residual", ra)
    if num_tokens:
        variant = "dynamic_res" if ra is not None else "dynamic"
        _launch(variant, oa, xa, ra, wa, sa, ua, eps, FLAG_SCALE_UB if ua is not None else 0, stream, key)
    return out, scales
