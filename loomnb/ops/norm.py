"""RMSNorm family: ``rms_norm``, ``fused_add_rms_norm`` and their FP8 E4M3 quantising forms.

Numerically interchangeable with vLLM's CUDA ops (``csrc/layernorm_kernels.cu``,
``layernorm_quant_kernels.cu``, ``fused_layernorm_dynamic_per_token_quant.cu``). Two rounding
modes for the plain norms: ``rounding="twice"`` (default) rounds the normalised value to the
activation dtype before the weight multiply, as HF transformers' ``LlamaRMSNorm``, vLLM's
``forward_native`` and vLLM's later kernels do; ``rounding="once"`` rounds only the product,
``r(x * inv * w)``, as vLLM 0.24.0's compiled ``rms_norm``/``fused_add_rms_norm`` and FlashInfer
do (about a quarter of bf16 outputs differ between the two by one ulp). The static FP8 forms
take the same option with vLLM 0.24's compiled kernels as the default, and quantise the norm in
the activation dtype with ``1/scale`` (``"once"``: ``r(x * inv * w)``, i.e. the plain norm
followed by ``static_scaled_fp8_quant``); the dynamic
per-token form rounds twice, like vLLM's kernel. ``docs/numerics.md`` has the family's numerics in one place.

Bytes moved (the benchmark's model), per row of hidden_size H and element size b:
``rms_norm`` reads x and writes out (2·H·b, + H·b weight once); ``fused_add_rms_norm`` reads x
and residual and writes both (4·H·b); the FP8 forms write H bytes (+4 for the scale).

Rows: ``x`` is ``[..., hidden_size]`` with a contiguous last dimension and any leading strides
that merge into at most two strided dimensions, so per-head q/k norms (``[num_tokens,
num_heads, head_size]`` views of a fused QKV buffer) need no copy.
"""

from __future__ import annotations

import dataclasses

from .. import _adapter as ad
from .._dtypes import ACTIVATION_KINDS, storage_dtype
from ..checks import check_eps, check_kind, check_ndim, check_same_device, check_same_kind, check_shape
from . import _contract as C
from . import _launch as L
from ._norm_kernels import CACHED_VPT, ROUNDINGS, NormSpec, argtypes, norm_kernel
from ._torch_ops import torch_op

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_static_fp8_quant",
           "fused_add_rms_norm_static_fp8_quant", "rms_norm_dynamic_per_token_quant"]



def launch_config(hidden_size, cached, threads=None):
    """(threads per block, 16-byte units a thread holds) for one row of ``hidden_size``.

    Cached rows hold about 4 units of 16 bytes a thread (all loads in flight at once), fewer
    for short rows, at every batch size: at 16384 x 4096 bf16 that (128 threads) beat
    64/256/512/1024 threads by 3-40% on the H200, and at 1-256 rows 128 x 4 and 256 x 2 were
    equally fast while 512 x 1 was 0.75 us slower (a block reduction over 16 warps;
    ``benchmarks/results/probe_norm_latency_20261130-191225.json``). At least 32 and at most
    1024 threads; vpt 0 means the row is too long to cache (more than 8 units x 1024 threads)
    and goes to the scalar layout. Scalar rows take min(hidden_size, 1024) threads, rounded up
    to a warp, like vLLM. The batch size does not change the choice.
    """
    if not cached:
        return (threads or min(1024, L.whole_warps(hidden_size))), 0
    nv = hidden_size // 8
    if threads:
        vpt = -(-nv // threads)
        return threads, next((v for v in CACHED_VPT if v >= vpt), 0)
    for vpt in ((4, 8) if nv >= 256 else (2, 4, 8)):
        t = L.whole_warps(-(-nv // vpt))
        if t <= 1024:
            return t, vpt
    return 1024, 0


def _launch_norm(op, spec, out, x, residual, weight, scales, scale, eps, stream, key):
    """Row views, layout, launch configuration and the launch: one block per row."""
    named = [(n, a) for n, a in (("out", out), ("x", x), ("residual", residual)) if a is not None]
    lead, views = C.rows(op, named)
    v = dict(zip((n for n, _ in named), views))
    num_rows = 1
    for d in lead:
        num_rows *= d
    if num_rows == 0:
        return
    H = x.shape[-1]
    fp8_unit = 8  # an FP8 output row moves 8 bytes per 16-byte activation unit
    cached = (x.kind != "f32" and C.vectors_ok(v["x"], v.get("residual"), weight)
              and C.vectors_ok(v["out"], unit=16 if spec.quant == "none" else fp8_unit))
    threads, vpt = launch_config(H, cached, L.forced_threads())
    if cached and vpt == 0:
        cached, threads = False, launch_config(H, False, L.forced_threads())[0]
    spec = dataclasses.replace(spec, layout="cached" if cached else "scalar",
                               vpt=vpt if cached else 0, lead=len(lead))
    act = x.kind

    def rows_param(name):
        a = v.get(name)
        if a is None:
            return L.absent("uint32" if cached else storage_dtype(act), 1 + len(lead))
        return L.array(a, words=cached)

    params = [rows_param("out"), rows_param("x"), rows_param("residual"),
              L.array(weight, words=cached),
              L.array(scales, (num_rows,), (1,)) if scales is not None else L.absent("float32", 1),
              L.array(scale) if scale is not None else L.absent("float32", 1),
              L.f32(eps), L.i64(H)]
    # a [num_tokens, num_heads, head_size] view's leading dimensions merge into one at one
    # token (lead 1) and may not at more (lead 2): compile both (no JIT at a new num_tokens)
    other = dataclasses.replace(spec, lead=3 - spec.lead)
    warm = (lambda: [(norm_kernel, other, argtypes(other))]) if x.ndim > 2 else None
    L.launch(norm_kernel, spec, num_rows, threads, params, like=x, stream=stream, key=key,
             warm=warm)


def _inputs(op, x_obj, weight_obj, eps):
    """The checks every op of the family runs on ``x``/``weight``/``eps``."""
    x = ad.wrap(op, "x", x_obj)
    check_kind(op, "x", x, ACTIVATION_KINDS)
    if x.ndim < 1:
        C.fail_value(op, "x", "an array of shape [..., hidden_size]", "a 0-D array")
    w = ad.wrap(op, "weight", weight_obj)
    check_same_kind(op, "weight", w, "x", x)
    check_ndim(op, "weight", w, 1)
    check_shape(op, "weight", w, (x.shape[-1],), "[hidden_size]")
    if w.shape[0] > 1 and w.strides[0] != 1:
        C.fail_value(op, "weight", "contiguous (stride 1)", f"stride {w.strides[0]}")
    check_same_device(op, "weight", w, "x", x)
    return x, w, check_eps(op, eps)


def _static_inputs(op, x_obj, weight_obj, eps, scale_obj, check_scale, rounding):
    """The checks of the static FP8 forms: :func:`_inputs`, ``rounding``, then the one-element
    ``scale`` (with ``check_scale``, asserted finite and > 0 on the device)."""
    x, w, eps = _inputs(op, x_obj, weight_obj, eps)
    C.choice(op, "rounding", rounding, ROUNDINGS)
    s = C.one_element(op, "scale", scale_obj, x)
    if check_scale:
        C.assert_positive_finite(op, "scale", s)
    return x, w, eps, s


def _residual(op, x, residual_obj):
    r = ad.wrap(op, "residual", residual_obj)
    check_same_kind(op, "residual", r, "x", x)
    check_shape(op, "residual", r, x.shape, "like 'x'")
    check_same_device(op, "residual", r, "x", x)
    return r


def _fake_like(x, *_, **__):
    return x.new_empty(x.shape)


def _fake_fp8(x, *_, **__):
    return x.new_empty(x.shape, dtype=ad._torch.float8_e4m3fn)


def _fake_dynamic(x, *_, **__):
    import math
    rows = math.prod(x.shape[:-1])
    return (x.new_empty(x.shape, dtype=ad._torch.float8_e4m3fn),
            x.new_empty((rows, 1), dtype=ad._torch.float32))


# ---------------------------------------------------------------------------------------------
@torch_op("Tensor x, Tensor weight, float eps, *, str rounding='twice'", outputs=("out",),
          fake=_fake_like)
def rms_norm(x, weight, eps, *, out=None, rounding="twice", stream=None, launch_key=None):
    """RMSNorm of each row: ``y = r(f(r(f(x) * inv)) * f(weight))`` (``rounding="twice"``) or
    ``y = r(f(x) * inv * f(weight))`` (``rounding="once"``).

    ``inv = r32(1 / sqrt(sum_i f(x_i)^2 / hidden_size + eps))`` per row, accumulated and
    evaluated in float64 and rounded once to float32; ``f`` widens to float32, ``r`` rounds to the
    dtype of ``x`` (round to nearest even).

    Args:
        x: ``[..., hidden_size]`` bf16, fp16 or fp32; last dimension contiguous; leading
            dimensions may have any strides that merge into two. Not modified.
        weight: ``[hidden_size]``, same dtype as ``x``, contiguous.
        eps: absolute epsilon added to the mean square (inside the square root).
        out: optional ``[..., hidden_size]`` output of ``x``'s dtype; may be ``x`` itself
            (exactly in place), must not otherwise overlap ``x`` or ``weight``. Allocated when None.
        rounding: ``"twice"`` (default: HF, vLLM's ``forward_native``) or ``"once"`` (vLLM 0.24's
            compiled op, FlashInfer).
        stream: CUDA stream to launch on; default: the caller's current stream.

    Returns ``out``. Mutates: ``out`` only.

    Raises ``LoomnbTypeError`` (a ``TypeError``) for a wrong dtype, host array on a GPU or
    unknown array type, and ``LoomnbValueError`` (a ``ValueError``) for shape, layout, device,
    aliasing, writability, ``rounding`` or ``eps`` problems -- before any launch. Zero rows is a
    no-op.

    Matches vLLM ``torch.ops._C.rms_norm(out, input, weight, epsilon)``. NaN propagates; an
    ``inf`` element makes its row's ``inv = 0`` (that element NaN, the others 0).

    Differs from vLLM in ``inv``: vLLM takes ``rsqrtf`` of a float32 block reduction, whose last
    bits depend on the block size and summation order; loomnb's float64 evaluation is independent
    of both (batch-invariant) and bit-identical to ``loomnb.oracle.rms_norm``.
    """
    op = "loomnb.rms_norm"
    xa, wa, eps = _inputs(op, x, weight, eps)
    C.choice(op, "rounding", rounding, ROUNDINGS)
    oa = C.output(op, "out", out, like=xa, kind=xa.kind, shape=xa.shape)
    C.no_overlap(op, {"out": oa}, {"x": xa, "weight": wa}, in_place={("out", "x")})
    _launch_norm(op, NormSpec(xa.kind, rounding=rounding), oa, xa, None, wa, None, None, eps,
                 stream, launch_key)
    return oa.obj


@torch_op("Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, *, str rounding='twice'",
          returns=("x", "residual"))
def fused_add_rms_norm(x, residual, weight, eps, *, rounding="twice", stream=None,
                       launch_key=None):
    """Residual add then RMSNorm, in place: ``residual <- z = r(f(x) + f(residual))``,
    ``x <- r(f(r(f(z) * inv)) * f(weight))`` (``"once"``: ``r(f(z) * inv * f(weight))``) with
    ``inv`` computed from the rounded sum ``z``, as :func:`rms_norm`.

    Args:
        x: ``[..., hidden_size]`` bf16, fp16 or fp32; last dimension contiguous, leading strides
            as :func:`rms_norm`. Overwritten with the normalised result.
        residual: same shape and dtype, last dimension contiguous; overwritten with the sum ``z``.
        weight: ``[hidden_size]``, same dtype, contiguous.
        eps: absolute epsilon (inside the square root).
        rounding: ``"twice"`` (default) or ``"once"`` (vLLM 0.24's compiled op). Both normalise the
            rounded sum ``z``, as vLLM's CUDA op does; FlashInfer's ``fused_add_rmsnorm``
            normalises the fp32 sum instead.
        stream: CUDA stream; default the caller's current stream.

    Returns ``(x, residual)``, the mutated arrays. Mutates: ``x`` and ``residual``.

    Raises as :func:`rms_norm`; also when ``x`` and ``residual`` overlap. Matches vLLM
    ``torch.ops._C.fused_add_rms_norm(input, residual, weight, epsilon)``.
    """
    op = "loomnb.fused_add_rms_norm"
    xa, wa, eps = _inputs(op, x, weight, eps)
    C.choice(op, "rounding", rounding, ROUNDINGS)
    ra = _residual(op, xa, residual)
    C.writable(op, {"x": xa, "residual": ra})
    C.no_overlap(op, {"residual": ra, "x": xa}, {"weight": wa})
    _launch_norm(op, NormSpec(xa.kind, residual="add", rounding=rounding), xa, xa, ra, wa, None,
                 None, eps, stream, launch_key)
    return x, residual


@torch_op("Tensor x, Tensor weight, Tensor scale, float eps, *, bool check_scale=False, "
          "str rounding='once'", outputs=("out",), fake=_fake_fp8)
def rms_norm_static_fp8_quant(x, weight, scale, eps, *, out=None, check_scale=False,
                              rounding="once", stream=None, launch_key=None):
    """RMSNorm then static FP8 E4M3 quantisation: ``out = e4m3(clamp(n * (1/scale), +-448))``.

    ``n = f(rms_norm(x, rounding=rounding))``: the norm in ``x``'s dtype, then quantised.
    ``rounding="once"`` (default, vLLM 0.24's compiled kernel): ``n = f(r(f(x) * inv *
    f(weight)))``, as vLLM's ``rms_norm`` followed by ``static_scaled_fp8_quant``;
    ``rounding="twice"``: ``n = f(r(f(r(f(x) * inv)) * f(weight)))`` (HF's norm, vLLM's
    ``forward_native``, then the quantiser). ``inv`` as :func:`rms_norm`; ``1/scale`` is
    computed once in float32 and multiplied (vLLM's static kernels do not divide). Units:
    stored = real / scale. The two forms differ by one FP8 code step on about 1.5% of bf16
    outputs (0.2% of fp16); for float32 inputs they are the same.

    Args:
        x: ``[..., hidden_size]`` bf16/fp16/fp32, rows as :func:`rms_norm`; not modified.
        weight: ``[hidden_size]`` like ``x``.
        scale: float32 device array of one element (shape ``[]`` or ``[1]``).
        eps: absolute epsilon.
        out: optional ``[..., hidden_size]`` ``float8_e4m3fn`` or ``uint8`` (the E4M3 codes), last
            dimension contiguous; allocated (``float8_e4m3fn``) when None.
        check_scale: opt-in check that ``scale`` is finite and > 0 without a host sync (torch:
            a device-side assert, which ends the CUDA context when it fires; see
            ``_contract.assert_positive_finite``). Off by default, as vLLM never checks.
        rounding: ``"once"`` (default) or ``"twice"``, see above.
        stream: as :func:`rms_norm`.

    Returns ``out``. Mutates ``out``. A NaN becomes +448 (``fminf``/``fmaxf`` clamp), like vLLM.
    Unchecked scales behave as vLLM's: ``1/scale`` is +inf for 0 (so +-448, and 0*inf = NaN ->
    +448 for zeros), a negative scale flips the signs, NaN gives +448 everywhere, +inf gives
    zeros (signed). Raises as :func:`rms_norm`.
    Matches vLLM ``torch.ops._C.rms_norm_static_fp8_quant(out, input, weight, scale, epsilon)``.
    """
    op = "loomnb.rms_norm_static_fp8_quant"
    xa, wa, eps, sa = _static_inputs(op, x, weight, eps, scale, check_scale, rounding)
    oa = C.output(op, "out", out, like=xa, kind=("fp8", "u8") if out is not None else "fp8",
                  shape=xa.shape)
    C.no_overlap(op, {"out": oa}, {"x": xa, "weight": wa, "scale": sa})
    _launch_norm(op, NormSpec(xa.kind, quant="static", rounding=rounding), oa, xa, None, wa, None,
                 sa, eps, stream, launch_key)
    return oa.obj


@torch_op("Tensor x, Tensor(a!) residual, Tensor weight, Tensor scale, float eps, *, "
          "bool check_scale=False, str rounding='once'", outputs=("out",),
          returns=("out", "residual"), fake=_fake_fp8)
def fused_add_rms_norm_static_fp8_quant(x, residual, weight, scale, eps, *, out=None,
                                        check_scale=False, rounding="once", stream=None,
                                        launch_key=None):
    """Residual add, RMSNorm, static FP8: ``residual <- z = r(x + residual)``, ``out =
    e4m3(clamp(n * (1/scale)))`` with ``n`` of the rounded sum ``z`` as in
    :func:`rms_norm_static_fp8_quant`: ``n = f(rms_norm(z, rounding=rounding))`` (``"once"``,
    the default, as vLLM 0.24's compiled op). ``x`` is **not** modified.

    Shapes, dtypes, scale, ``check_scale``, ``rounding`` and errors as
    :func:`rms_norm_static_fp8_quant` and :func:`fused_add_rms_norm`. Returns ``(out, residual)``; mutates ``out`` and ``residual``.
    Matches vLLM ``torch.ops._C.fused_add_rms_norm_static_fp8_quant(out, input, residual,
    weight, scale, epsilon)``.
    """
    op = "loomnb.fused_add_rms_norm_static_fp8_quant"
    xa, wa, eps, sa = _static_inputs(op, x, weight, eps, scale, check_scale, rounding)
    ra = _residual(op, xa, residual)
    C.writable(op, {"residual": ra})
    oa = C.output(op, "out", out, like=xa, kind=("fp8", "u8") if out is not None else "fp8",
                  shape=xa.shape)
    C.no_overlap(op, {"out": oa, "residual": ra}, {"x": xa, "weight": wa, "scale": sa})
    _launch_norm(op, NormSpec(xa.kind, residual="add", quant="static", rounding=rounding), oa, xa,
                 ra, wa, None, sa, eps, stream, launch_key)
    return oa.obj, residual


@torch_op("Tensor x, Tensor weight, float eps, Tensor? scale_ub=None, Tensor(a!)? residual=None, "
          "*, bool check_scale=False", outputs=("out", "scales"), fake=_fake_dynamic)
def rms_norm_dynamic_per_token_quant(x, weight, eps, scale_ub=None, residual=None, *,
                                     out=None, scales=None, check_scale=False, stream=None,
                                     launch_key=None):
    """RMSNorm with a dynamic per-token FP8 E4M3 scale.

    Per row: ``s = f(x)`` (``+ f(residual)``, kept in float32), ``inv = r32(1 / sqrt(mean(s^2)
    + eps))`` evaluated in float64 (vLLM: ``rsqrtf`` of a float32 reduction; see
    :func:`rms_norm`), ``n = f(r(f(r(s*inv)) * f(weight)))``, ``amax = max|n|`` (NaN ignored),
    clipped by ``scale_ub`` if given (it clips the amax, despite its name), ``scale = max(amax /
    448, 1/(448*512))``, ``out = e4m3(clamp(n / scale))`` with a correctly rounded float32
    division. With ``residual``: ``residual <- r(s)`` (the norm uses the unrounded fp32 sum --
    unlike :func:`fused_add_rms_norm`).

    Args:
        x: ``[..., hidden_size]`` bf16/fp16/fp32, rows as :func:`rms_norm`; not modified.
        weight: ``[hidden_size]`` like ``x``.  eps: absolute epsilon.
        scale_ub: optional float32 one-element device array. Unchecked (as vLLM): ``scale_ub
            <= 0`` gives the floor scale 1/(448*512) for every row; a NaN ``scale_ub`` is
            ignored by the ``fminf`` (the row's amax is used); ``check_scale=True`` asserts it finite and > 0
            without a host sync (as :func:`rms_norm_static_fp8_quant`).
        residual: optional, like ``x``; overwritten with ``r(x + residual)``.
        out: optional ``float8_e4m3fn`` (or ``uint8`` codes) ``[..., hidden_size]``;
        scales: optional float32 ``[num_rows, 1]`` (``num_rows`` = the product of the leading
            dimensions), contiguous.

    Returns ``(out, scales)``; mutates ``out``, ``scales`` and ``residual``. A NaN is stored
    as +448; the sign of zero is kept (-0.0 -> 0x80). Raises as :func:`rms_norm`. Matches vLLM
    ``ops.rms_norm_dynamic_per_token_quant(input, weight, epsilon, quant_dtype=float8_e4m3fn,
    scale_ub, residual)`` (the int8 output is not supported).
    """
    op = "loomnb.rms_norm_dynamic_per_token_quant"
    xa, wa, eps = _inputs(op, x, weight, eps)
    ua = C.one_element(op, "scale_ub", scale_ub, xa) if scale_ub is not None else None
    if check_scale and ua is not None:
        C.assert_positive_finite(op, "scale_ub", ua)
    ra = _residual(op, xa, residual) if residual is not None else None
    num_rows = 1
    for n in xa.shape[:-1]:
        num_rows *= n
    oa = C.output(op, "out", out, like=xa, kind=("fp8", "u8") if out is not None else "fp8",
                  shape=xa.shape)
    sa = C.output(op, "scales", scales, like=xa, kind="f32", shape=(num_rows, 1))
    if not sa.is_c_contiguous():
        C.fail_value(op, "scales", "C-contiguous", f"strides {sa.strides}")
    C.writable(op, {"residual": ra})
    C.no_overlap(op, {"out": oa, "scales": sa, "residual": ra},
                 {"x": xa, "weight": wa, "scale_ub": ua})
    spec = NormSpec(xa.kind, residual="add_fp32" if ra is not None else "none", quant="dynamic",
                    scale_ub=ua is not None)
    _launch_norm(op, spec, oa, xa, ra, wa, sa, ua, eps, stream, launch_key)
    return oa.obj, sa.obj
