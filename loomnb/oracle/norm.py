"""NumPy + ml_dtypes references for the RMSNorm family: the truth every test compares against.

With ``f`` = widen to float32 and ``r`` = round to the activation dtype T (:func:`to_dtype`):

* ``rms_norm``: ``inv = 1 / sqrt(sum(f(x)^2) / H + eps)``, ``y = r(f(r(f(x)*inv)) * f(w))``
  (``rounding="twice"``) or ``y = r(f(x) * inv * f(w))`` (``"once"``);
* ``fused_add_rms_norm``: ``z = r(f(x) + f(residual))``; residual <- z; x <- rms_norm(z);
* static FP8: ``q = e4m3(clamp(f(y) * (1/scale)))``, ``y`` the norm in T as ``rms_norm`` with
  the same ``rounding`` (``"once"``, the default: vLLM 0.24's compiled kernels); the fused-add
  form normalises z;
* dynamic per-token FP8: ``s = f(x) [+ f(residual)]`` kept in fp32 (residual <- r(s)),
  ``n = f(r(f(r(s*inv)) * f(w)))``, ``scale = max(min(amax(|n|), scale_ub)/448, 1/(448*512))``,
  ``q = e4m3(clamp(n / scale))`` with a true division.

``inv`` is ``r32(1 / sqrt(sum(s^2) / H + eps))`` evaluated in float64, exactly as the kernels
do it (vLLM: a float32 reduction and ``rsqrtf``; see ``loomnb.ops._norm_kernels.inv_rms`` for
why loomnb differs there). A float64 sum rounds to the same float32 in any order except within
~1e-16 of a rounding boundary, so kernels and oracle agree bit for bit in practice.
Arguments are NumPy arrays (bf16 as ``ml_dtypes.bfloat16``); ``stream`` is accepted and ignored
so the signatures equal the ops'. Rows are the flattened leading dimensions.
"""

import numpy as np

from .fp8 import clamp_fp8, e4m3_encode, scale_from_amax
from .numerics import as_rows, to_dtype

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_static_fp8_quant",
           "fused_add_rms_norm_static_fp8_quant", "rms_norm_dynamic_per_token_quant"]


def _rows(a):
    return as_rows(a)


def _inv_rms(s, eps):
    """``r32(1 / sqrt(sum(s^2) / H + eps))`` per row in float64 (the kernels' ``inv_rms``)."""
    s64 = s.astype(np.float64)
    ss = np.sum(s64 * s64, axis=-1, keepdims=True)
    eps64 = np.float64(np.float32(eps))
    with np.errstate(invalid="ignore", over="ignore"):
        return (1.0 / np.sqrt(ss / np.float64(s.shape[-1]) + eps64)).astype(np.float32)


def _normed(s, weight, eps, dtype, rounding="twice"):
    """r(f(r(s*inv)) * f(w)) (or r(s*inv*f(w)) for "once"), in the activation dtype."""
    inv = _inv_rms(s, eps)
    w = np.asarray(weight).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        if rounding == "once":
            return to_dtype(s * inv * w, dtype)
        n = to_dtype(s * inv, dtype).astype(np.float32)
        return to_dtype(n * w, dtype)


def rms_norm(x, weight, eps, *, out=None, rounding="twice", stream=None):
    """Reference ``rms_norm``: returns ``out`` (allocated like ``x`` when None)."""
    x = np.asarray(x)
    y = _normed(_rows(x).astype(np.float32), weight, eps, x.dtype, rounding).reshape(x.shape)
    if out is None:
        return y
    out[...] = y
    return out


def fused_add_rms_norm(x, residual, weight, eps, *, rounding="twice", stream=None):
    """Reference ``fused_add_rms_norm``: mutates and returns ``(x, residual)``."""
    z = to_dtype(x.astype(np.float32) + residual.astype(np.float32), x.dtype)
    residual[...] = z
    x[...] = rms_norm(z, weight, eps, rounding=rounding)
    return x, residual


def rms_norm_static_fp8_quant(x, weight, scale, eps, *, out=None, check_scale=False,
                              rounding="once", stream=None):
    """Reference ``rms_norm_static_fp8_quant``: FP8 E4M3 ``out`` (allocated when None)."""
    x = np.asarray(x)
    y = rms_norm(x, weight, eps, rounding=rounding).astype(np.float32)  # the norm in T
    inv_s = np.float32(1.0) / np.float32(np.asarray(scale, dtype=np.float32).reshape(-1)[0])
    with np.errstate(invalid="ignore", over="ignore"):
        codes = e4m3_encode(clamp_fp8(y * inv_s)).reshape(x.shape)
    return _put_fp8(out, codes)


def fused_add_rms_norm_static_fp8_quant(x, residual, weight, scale, eps, *, out=None,
                                        check_scale=False, rounding="once", stream=None):
    """Reference fused-add static FP8: residual <- z = r(x + residual); out <- quant(rms_norm(z)).

    ``x`` is not modified. Returns ``(out, residual)``.
    """
    z = to_dtype(x.astype(np.float32) + residual.astype(np.float32), x.dtype)
    residual[...] = z
    return rms_norm_static_fp8_quant(z, weight, scale, eps, out=out, rounding=rounding), residual


def rms_norm_dynamic_per_token_quant(x, weight, eps, scale_ub=None, residual=None, *,
                                     out=None, scales=None, check_scale=False, stream=None):
    """Reference dynamic per-token FP8 RMSNorm: returns ``(out, scales)``.

    ``out`` FP8 E4M3 ``[..., hidden_size]``, ``scales`` float32 ``[num_rows, 1]``; with
    ``residual``, the sum stays fp32 for the norm and ``residual <- r(x + residual)``.
    """
    x = np.asarray(x)
    s = _rows(x).astype(np.float32)
    if residual is not None:
        s = s + _rows(residual).astype(np.float32)
    n = _normed(s, weight, eps, x.dtype).astype(np.float32)
    amax = np.max(np.where(np.isnan(n), np.float32(0), np.abs(n)), axis=-1, keepdims=True,
                  initial=np.float32(0))
    row_scale = scale_from_amax(amax, scale_ub)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        codes = e4m3_encode(clamp_fp8(n / row_scale)).reshape(x.shape)
    if residual is not None:
        residual[...] = to_dtype(s, x.dtype).reshape(residual.shape)
    if scales is None:
        scales = row_scale
    else:
        scales[...] = row_scale
    return _put_fp8(out, codes), scales


def _put_fp8(out, codes):
    import ml_dtypes
    if out is None:
        return codes.view(ml_dtypes.float8_e4m3fn)
    np.asarray(out).view(np.uint8)[...] = codes
    return out
