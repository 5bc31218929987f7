"""NumPy + ml_dtypes references for the activation family and the FP8 quantisers: the truth
every test compares against (``docs/numerics.md``, section "Activation and FP8 quantisation").

Notation: ``f`` widens to float32, ``r`` rounds to the activation dtype T (:func:`to_dtype`),
every other operation is one IEEE float32 operation (NumPy float32 arithmetic), ``e4m3`` is
:func:`~loomnb.oracle.fp8.e4m3_encode`.

* ``*_and_mul``: ``out = r(f(r(act(f(g)))) * f(u))``, gate ``g = x[..., :d]``, ``u = x[..., d:]``
  (``mul_and_silu``: SiLU on the second half; ``swigluoai_and_mul``: interleaved pairs and one
  rounding, see its docstring). ``act`` in float32:
  SiLU ``g / (1 + expf(-g))``; GELU ``(g * 0.5) * (1 + erff(g * 1/sqrt2))``; GELU-tanh
  ``(0.5 * g) * (1 + tanhf(BETA * fma(KAPPA, g*g*g, g)))``; FATReLU ``g if g > t else 0``.
* static / dynamic per-tensor quant: ``e4m3(clamp(f(x) * (1/scale)))``, NaN -> +448;
  per-token: ``scale = max(min(amax, ub)/448, 1/(448*512))``, ``e4m3(clamp(f(x) / scale))``;
  per-token-group: ``scale = max(eps, amax)/448`` (UE8M0: ``exp2(ceil(log2f(max(s, 1e-10))))``),
  ``e4m3(clamp(f(x) / scale))`` with NaN -> -448.

``expf``, ``erff`` and ``tanhf`` are float64 evaluations rounded once to float32 (correctly rounded
but for ~2^-29 of inputs). The GPU kernels call libdevice's ``__nv_expf``/``__nv_erff``/
``__nv_tanhf`` -- what vLLM's and torch's CUDA kernels call -- which are within 2 ulp of that, so
GPU results equal these bit for bit except for the rare element whose T rounding that moves
(``tests/tolerances.py``); the CUDA simulator evaluates them exactly as here. Arguments are NumPy
arrays (bf16 as ``ml_dtypes.bfloat16``); ``stream`` is accepted and ignored so the signatures
equal the ops'. The oracles compute; they do not validate.
"""

import ml_dtypes
import numpy as np

from .fp8 import FP8_MAX, clamp_fp8, clamp_fp8_nan_low, e4m3_decode, e4m3_encode, scale_from_amax, ue8m0
from .numerics import as_rows, to_dtype

__all__ = ["silu_and_mul", "mul_and_silu", "gelu_and_mul", "gelu_tanh_and_mul", "fatrelu_and_mul",
           "swigluoai_and_mul", "silu_and_mul_quant", "static_scaled_fp8_quant",
           "dynamic_scaled_fp8_quant", "dynamic_per_token_scaled_fp8_quant",
           "per_token_group_quant_fp8", "per_token_group_fp8_quant",
           "silu_and_mul_per_token_group_quant_fp8", "scaled_fp8_dequant"]

F32 = np.float32
GELU_ALPHA = F32(0.7071067811865476)           # M_SQRT1_2 as float
GELU_BETA = F32(0.7978845608028654)            # M_SQRT2 * M_2_SQRTPI * 0.5 as float
GELU_KAPPA = F32(0.044715)
PER_BLOCK_MIN_SCALE = F32(1e-10)               # vLLM's silu_and_mul_per_block_quant floor


def _errs():
    return np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore")


def _f64_then_f32(fn, v):
    with _errs():
        return fn(np.asarray(v, F32).astype(np.float64)).astype(F32)


def expf(v):
    """float32 ``exp``: float64 ``exp`` rounded once to float32."""
    return _f64_then_f32(np.exp, v)


def erff(v):
    """float32 ``erf``, as :func:`expf`."""
    from math import erf
    return _f64_then_f32(np.vectorize(erf, otypes=[np.float64]), v)


def tanhf(v):
    """float32 ``tanh``, as :func:`expf`."""
    return _f64_then_f32(np.tanh, v)


def fmaf(a, b, c):
    """``fma(a, b, c)`` in float32: the float32 product is exact in float64; the sum is rounded
    to float64 then float32 (a double rounding that differs from one rounding for ~2^-29 of
    inputs: the simulator's twin does the same)."""
    with _errs():
        return (np.asarray(a, F32).astype(np.float64) * np.asarray(b, F32).astype(np.float64)
                + np.asarray(c, F32).astype(np.float64)).astype(F32)


# ---------------------------------------------------------------- activations (float32 -> float32)
def silu(g):
    """``g / (1 + expf(-g))`` in float32 (vLLM's ``silu_kernel``, torch's ``silu``)."""
    g = np.asarray(g, F32)
    with _errs():
        return (g / (F32(1) + expf(-g))).astype(F32)


def gelu(g):
    """``(g * 0.5) * (1 + erff(g * M_SQRT1_2))`` (vLLM's ``gelu_kernel``, torch's exact GELU)."""
    g = np.asarray(g, F32)
    with _errs():
        return ((g * F32(0.5)) * (F32(1) + erff(g * GELU_ALPHA))).astype(F32)


def gelu_tanh(g):
    """``(0.5 * g) * (1 + tanhf(BETA * fma(KAPPA, g*g*g, g)))`` (nvcc contracts
    ``g + KAPPA * x_cube`` into one FMA, as the kernels do explicitly)."""
    g = np.asarray(g, F32)
    with _errs():
        cube = (g * g) * g
        inner = GELU_BETA * fmaf(GELU_KAPPA, cube, g)
        return ((F32(0.5) * g) * (F32(1) + tanhf(inner))).astype(F32)


def fatrelu(g, threshold):
    """``g if g > threshold else 0`` (NaN -> 0)."""
    g = np.asarray(g, F32)
    with _errs():
        return np.where(g > F32(threshold), g, F32(0)).astype(F32)


def _halves(x):
    x = np.asarray(x)
    d = x.shape[-1] // 2
    return x[..., :d].astype(F32), x[..., d:2 * d].astype(F32), x.dtype


def _act_and_mul(act, x, out, first=True):
    g, u, dt = _halves(x)
    if not first:
        g, u = u, g
    a = to_dtype(act(g), dt).astype(F32)
    with _errs():
        y = to_dtype(a * u, dt)
    return _put(out, y)


def _put(out, y):
    if out is None:
        return y
    np.asarray(out)[...] = y
    return out


def silu_and_mul(x, out=None, *, stream=None):
    """Reference ``silu_and_mul``: ``r(f(r(silu(g))) * f(u))``, ``[..., 2d] -> [..., d]``."""
    return _act_and_mul(silu, x, out)


def mul_and_silu(x, out=None, *, stream=None):
    """Reference ``mul_and_silu``: SiLU on the second half, ``r(f(g) * f(r(silu(u))))``."""
    return _act_and_mul(silu, x, out, first=False)


def gelu_and_mul(x, out=None, *, stream=None):
    """Reference ``gelu_and_mul`` (erf GELU)."""
    return _act_and_mul(gelu, x, out)


def gelu_tanh_and_mul(x, out=None, *, stream=None):
    """Reference ``gelu_tanh_and_mul``."""
    return _act_and_mul(gelu_tanh, x, out)


def fatrelu_and_mul(x, threshold=0.0, out=None, *, stream=None):
    """Reference ``fatrelu_and_mul``: ``r(f(r(g if g > t else 0)) * f(u))``."""
    t = F32(threshold)
    return _act_and_mul(lambda g: fatrelu(g, t), x, out)


def swigluoai_and_mul(x, alpha=1.702, limit=7.0, out=None, *, stream=None):
    """Reference ``swigluoai_and_mul`` (GPT-OSS): interleaved pairs ``g = x[..., 0::2]``,
    ``u = x[..., 1::2]``; ``g' = fminf(g, limit)``, ``u' = fmaxf(fminf(u, limit), -limit)`` (a NaN
    becomes ``limit`` in both); ``out = r(((u' + 1) * g') / (1 + expf((-g') * alpha)))``, rounded
    once."""
    x = np.asarray(x)
    g, u = x[..., 0::2].astype(F32), x[..., 1::2].astype(F32)
    lim, al = F32(limit), F32(alpha)
    with _errs():
        g = np.fmin(g, lim)
        u = np.fmax(np.fmin(u, lim), -lim)
        y = (((u + F32(1)) * g) / (F32(1) + expf((-g) * al))).astype(F32)
    return _put(out, to_dtype(y, x.dtype))


# ---------------------------------------------------------------- FP8 quantisation
def _fp8_out(out, codes):
    if out is None:
        return codes.view(ml_dtypes.float8_e4m3fn)
    np.asarray(out).view(np.uint8)[...] = codes
    return out


def _nanmax_abs(v, axis=None, keepdims=False):
    """fmaxf-fold of |v| from 0: NaN ignored, 0 for an empty or all-NaN set."""
    a = np.abs(np.asarray(v, F32))
    a = np.where(np.isnan(a), F32(0), a)
    return np.max(a, axis=axis, keepdims=keepdims, initial=F32(0)).astype(F32)


def _static(v, scale):
    with _errs():  # a zero scale gives 1/scale = inf, as vLLM
        inv = F32(1) / F32(np.asarray(scale, F32).reshape(-1)[0])
        return e4m3_encode(clamp_fp8(np.asarray(v, F32) * inv))


def static_scaled_fp8_quant(x, scale, out=None, *, stream=None):
    """Reference: ``e4m3(clamp(f(x) * (1/scale)))``, ``1/scale`` once in float32; NaN -> +448."""
    return _fp8_out(out, _static(np.asarray(x).astype(F32), scale))


def dynamic_scaled_fp8_quant(x, out=None, *, scale=None, stream=None):
    """Reference: ``scale = amax(|x|)/448`` over the whole tensor (no floor; NaN ignored; 0 for
    an empty tensor), then :func:`static_scaled_fp8_quant`. Returns ``(out, scale [1])``."""
    xf = np.asarray(x).astype(F32)
    s = np.array([_nanmax_abs(xf) / FP8_MAX], F32)
    q = _fp8_out(out, _static(xf, s))
    if scale is None:
        return q, s
    np.asarray(scale).reshape(-1)[...] = s
    return q, scale


def dynamic_per_token_scaled_fp8_quant(x, scale_ub=None, out=None, *, scales=None, stream=None):
    """Reference: per row ``scale = max(min(amax, scale_ub)/448, 1/(448*512))`` (``fminf``: a NaN
    ``scale_ub`` is ignored), ``e4m3(clamp(f(x) / scale))``. Returns ``(out, scales [rows, 1])``."""
    x = np.asarray(x)
    xf = as_rows(x.astype(F32))
    s = scale_from_amax(_nanmax_abs(xf, axis=-1, keepdims=True), scale_ub)
    with _errs():
        codes = e4m3_encode(clamp_fp8(xf / s)).reshape(x.shape)
    if scales is None:
        scales = s
    else:
        np.asarray(scales)[...] = s.reshape(np.shape(scales))
    return _fp8_out(out, codes), scales


def _group_scales(y, group_size, eps, use_ue8m0, numerics="unfused"):
    """(scales [rows, G], scale of every element [rows, d]) of float32 rows ``y [rows, d]``."""
    rows, d = y.shape
    yg = y.reshape(rows, d // group_size, group_size)
    amax = _nanmax_abs(yg, axis=-1)
    with _errs():
        if numerics == "per_block":
            s = np.maximum(amax / FP8_MAX, PER_BLOCK_MIN_SCALE).astype(F32)
        else:
            s = (np.fmax(amax, F32(eps)) / FP8_MAX).astype(F32)
            if use_ue8m0:
                s = ue8m0(s)
    return s, np.repeat(s, group_size, axis=-1)


def _scales_out(s, lead, column_major, tma_aligned):
    """Scales ``[rows, G]`` in the requested memory layout (a NumPy view with those strides)."""
    if not (column_major or tma_aligned):
        return s.reshape(tuple(lead) + (s.shape[-1],))
    m, g = s.shape
    mp = -(-m // 4) * 4 if tma_aligned else m
    full = np.zeros((g, mp), F32)
    full[:, :m] = s.T
    return full[:, :m].T


def per_token_group_quant_fp8(x, group_size, eps=1e-10, column_major_scales=False,
                              tma_aligned_scales=False, use_ue8m0=False, out_q=None, out_s=None,
                              *, stream=None):
    """Reference per-token-group FP8: groups of ``group_size`` along the last dimension,
    ``scale = max(eps, amax)/448`` (UE8M0: rounded up to a power of two through ``log2f``),
    ``q = e4m3(clamp(f(x) / scale))`` with NaN -> -448. Returns ``(q, scales)``; scales
    ``[..., d/g]`` (row-major) or ``[M, d/g]`` with strides ``(1, M)`` (column-major) or
    ``(1, round_up(M, 4))`` (TMA-aligned)."""
    x = np.asarray(x)
    lead, d = x.shape[:-1], x.shape[-1]
    y = as_rows(x.astype(F32))
    return _group_quant(y, x.shape, lead, group_size, eps, column_major_scales, tma_aligned_scales,
                        use_ue8m0, out_q, out_s)


per_token_group_fp8_quant = per_token_group_quant_fp8


def _group_quant(y, shape, lead, group_size, eps, column_major, tma_aligned, use_ue8m0, out_q,
                 out_s, numerics="unfused"):
    s, per_elem = _group_scales(y, group_size, eps, use_ue8m0, numerics)
    with _errs():
        v = y / per_elem
        codes = e4m3_encode(v if numerics == "per_block" else clamp_fp8_nan_low(v)).reshape(shape)
    scales = _scales_out(s, lead, column_major, tma_aligned)
    if out_s is not None:
        np.asarray(out_s)[...] = scales
        scales = out_s
    return _fp8_out(out_q, codes), scales


def silu_and_mul_per_token_group_quant_fp8(x, group_size, eps=1e-10, column_major_scales=False,
                                           tma_aligned_scales=False, use_ue8m0=False, out_q=None,
                                           out_s=None, *, numerics="unfused", stream=None):
    """Reference fused op. ``numerics="unfused"``: exactly ``per_token_group_quant_fp8(
    silu_and_mul(x), ...)``. ``"per_block"``: vLLM's ``silu_and_mul_per_block_quant`` --
    ``y = (g * (1 / (1 + expf(-g)))) * u`` in float32 with no rounding to T, ``scale =
    max(amax/448, 1e-10)`` (``eps`` unused), ``q = e4m3(y / scale)`` with no clamp (NaN -> NaN)."""
    x = np.asarray(x)
    d = x.shape[-1] // 2
    lead = x.shape[:-1]
    if numerics == "per_block":
        g, u, _ = _halves(x)
        with _errs():
            y = (g * (F32(1) / (F32(1) + expf(-g)))) * u
        y = y.astype(F32)
    else:
        y = silu_and_mul(x).astype(F32)
    return _group_quant(as_rows(y), tuple(lead) + (d,), lead, group_size, eps,
                        column_major_scales, tma_aligned_scales, use_ue8m0, out_q, out_s, numerics)


def silu_and_mul_quant(x, scale, out=None, *, stream=None):
    """Reference ``silu_and_mul_quant``: ``static_scaled_fp8_quant(silu_and_mul(x), scale)``."""
    return _fp8_out(out, _static(silu_and_mul(x).astype(F32), scale))


def scaled_fp8_dequant(q, scale, dtype, *, out=None, stream=None):
    """Reference dequantisation ``r(f(q) * scale)`` to ``dtype``: ``scale`` of one element (per
    tensor), ``[..., 1]`` (per token) or ``[..., G]`` (per group of ``d/G``; any strides)."""
    q = np.asarray(q)
    d = q.shape[-1]
    v = as_rows(e4m3_decode(q.view(np.uint8)))
    s = np.asarray(scale, F32)
    if s.size == 1:
        s2 = np.full((v.shape[0], 1), s.reshape(-1)[0], F32)
    else:
        s2 = as_rows(s)
    with _errs():
        y = v * np.repeat(s2, d // s2.shape[1], axis=-1)
    y = to_dtype(y.astype(F32), _np_dtype(dtype))
    return _put(out, y.reshape(q.shape))


def _np_dtype(dtype):
    """A NumPy dtype from a NumPy/ml_dtypes dtype, its name, or a torch dtype."""
    if isinstance(dtype, str) or type(dtype).__module__.startswith("torch"):
        name = str(dtype).replace("torch.", "")
        return np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)
    return np.dtype(dtype)
