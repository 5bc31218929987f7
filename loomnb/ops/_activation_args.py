"""The activation family's host plumbing under its ops (``loomnb.ops.activation``): argument
checks, the row views the kernels index, the one parameter list every launch passes, the
per-token-group scale layouts, and the fake outputs torch.compile traces with. The launch rules
(``chunk_config``...) stay in ``activation``, beside the constants the benchmarks tune."""

from __future__ import annotations

import functools
import math

import numpy as np

from .. import _adapter as ad
from .._dtypes import ACTIVATION_KINDS
from ..checks import check_eps, check_kind, check_same_device
from . import _contract as C
from . import _launch as L
from ._activation_kernels import GROUP_SIZES, UNIT, act_quant_kernel, size_siblings


# ---------------------------------------------------------------- checks and row views
def x_input(op, x_obj, name="x"):
    x = ad.wrap(op, name, x_obj)
    check_kind(op, name, x, ACTIVATION_KINDS)
    if x.ndim < 1:
        C.fail_value(op, name, "an array of shape [..., d]", "a 0-D array")
    return x


def gated_input(op, x_obj):
    x = x_input(op, x_obj)
    if x.shape[-1] % 2:
        C.fail_value(op, "x", "of shape [..., 2*d] (an even last dimension)",
                     f"shape {list(x.shape)}")
    return x, x.shape[-1] // 2


def rows_of(op, out, x, d, gated):
    """(lead, out view, x view) of ``out [..., d]`` and ``x [..., 2d]`` (or ``[..., d]``),
    their leading dimensions merged alike."""
    xh = x.view(x.shape[:-1] + (d,), x.strides) if gated else x
    lead, (ov, xv) = C.rows(op, [("out", out), ("x", xh)])
    if gated:
        xv = xv.view(xv.shape[:-1] + (2 * d,), xv.strides)
    return lead, ov, xv


def vector_ok(ov, xv, d, fp8_out):
    """16-byte units for every row: d a multiple of 8, rows 16-byte aligned (FP8 rows 8)."""
    return (d % UNIT == 0 and C.vectors_ok(xv)
            and C.vectors_ok(ov, unit=8 if fp8_out else C.VECTOR_BYTES))  # 8 FP8 codes: 8 bytes


def fp8_output(op, name, obj, like, shape):
    return C.output(op, name, obj, like=like, kind=("fp8", "u8") if obj is not None else "fp8",
                    shape=shape)


def r3(a, lead):
    """A row view ``lead + (n,)`` as the kernels' 3-D ``[n0, n1, n]`` (``n0 = 1``, stride 0)."""
    if len(lead) == 2:
        return a
    return a.view((1,) + a.shape, (0,) + a.strides)

# ---------------------------------------------------------------- the launch
def launch_act(op, spec, lead, ov, xv, d, *, scales=None, scale=None, partials=None, p0=0.0,
            p1=0.0, grid, threads, stream, key, part=(0, 1)):
    vec = spec.layout != "scalar"  # "vector" and "small": uint32 words
    params = [L.array(r3(ov, lead), words=vec), L.array(r3(xv, lead), words=vec),
              scales if scales is not None else L.absent("float32", 2),
              L.array(scale) if scale is not None else L.absent("float32", 1),
              L.array(partials) if partials is not None else L.absent("float32", 1),
              L.f32(p0), L.f32(p1), L.i64(d)]
    L.launch(act_quant_kernel, spec, grid, threads, params, like=xv, stream=stream, key=key,
             part=part, warm=lambda: size_siblings(spec))

# ---------------------------------------------------------------- per-token-group scales
def group_args(op, x, group_size, eps, column_major, tma, ue8m0, d):
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        C.fail_type(op, "group_size", "an int", repr(group_size))
    if group_size not in GROUP_SIZES:
        C.fail_value(op, "group_size", "one of " + ", ".join(map(str, GROUP_SIZES)), repr(group_size))
    if d % group_size:
        C.fail_value(op, "group_size", f"a divisor of the last dimension of the output (d = {d})",
                     repr(group_size))
    eps = check_eps(op, eps)
    for name, v in (("column_major_scales", column_major), ("tma_aligned_scales", tma),
                    ("use_ue8m0", ue8m0)):
        C.flag(op, name, v)
    if (column_major or tma) and x.ndim != 2:
        C.fail_value(op, "x", "2-D [num_tokens, d] with column-major or TMA-aligned scales",
                     f"shape {list(x.shape)}")
    return eps


def flat2d(op, name, a, rows, cols):
    """``a [..., cols]`` as the 2-D ``[rows, cols]`` view the kernels index (any strides; the
    leading dimensions must merge into one)."""
    if a.ndim == 2:
        return a
    dims = [(n, s) for n, s in zip(a.shape[:-1], a.strides[:-1]) if n != 1]
    for (_, s0), (n1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * n1:
            C.fail_value(op, name, "an array whose leading dimensions merge into one",
                         f"shape {list(a.shape)} with strides {list(a.strides)}")
    return a.view((rows, cols), (dims[-1][1] if dims else 0, a.strides[-1] if a.ndim else 0))


def group_scales(op, out_s, xa, lead_shape, groups, column_major, tma):
    """(scales object to return, its 2-D ``[rows, G]`` kernel view). Allocated in the requested
    layout -- column-major and TMA-aligned as strides ``(1, rows')``, ``rows'`` = ``rows`` or
    ``rows`` rounded up to a multiple of 4 (torch: one ``empty_strided`` tensor, not a view;
    other libraries: a ``[G, rows']`` buffer seen transposed) -- or the caller's array, any
    strides, whose own layout is used whatever the flags say."""
    rows = math.prod(lead_shape)
    if out_s is None and (column_major or tma):
        mp = -(-rows // 4) * 4 if tma else rows
        if xa.lib == "torch":
            torch = ad._torch
            alloc = functools.partial(torch.empty_strided, (rows, groups), (1, mp),
                                      dtype=torch.float32, device=xa.obj.device)
            sa = ad.wrap(op, "out_s", alloc())
            sa.alloc = alloc  # the eager fast path allocates it again on a replay
            return sa.obj, sa
        full = C.output(op, "out_s", None, like=xa, kind="f32", shape=(groups, mp))
        return full.obj[:, :rows].T, full.view((rows, groups), (1, mp))
    sa = C.output(op, "out_s", out_s, like=xa, kind="f32", shape=tuple(lead_shape) + (groups,))
    return sa.obj, flat2d(op, "out_s", sa, rows, groups)

# ---------------------------------------------------------------- dequantisation
_DEQUANT_KINDS = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "bf16": "bf16",
                  "f16": "f16", "f32": "f32", "half": "f16", "float": "f32"}


def dequant_kind(op, dtype):
    if isinstance(dtype, str):
        name = dtype
    elif ad._torch is not None and isinstance(dtype, ad._torch.dtype):
        name = str(dtype).replace("torch.", "")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
    kind = _DEQUANT_KINDS.get(name)
    if kind is None:
        C.fail_type(op, "dtype", "bfloat16, float16 or float32", repr(dtype))
    return kind


def dequant_inputs(op, q, scale, dtype):
    """The checks of ``scaled_fp8_dequant``: ``(q, output kind, scale, its [rows, G] view, G)``."""
    qa = ad.wrap(op, "q", q)
    check_kind(op, "q", qa, ("fp8", "u8"))
    if qa.ndim < 1:
        C.fail_value(op, "q", "an array of shape [..., d]", "a 0-D array")
    kind = dequant_kind(op, dtype)
    sa = ad.wrap(op, "scale", scale)
    check_kind(op, "scale", sa, ("f32",))
    check_same_device(op, "scale", sa, "q", qa)
    d, lead_shape = qa.shape[-1], qa.shape[:-1]
    rows = math.prod(lead_shape)
    if sa.size == 1:
        sv, groups = sa.view((rows, 1), (0, 0)), 1
    else:
        groups = sa.shape[-1] if sa.ndim else 0
        if tuple(sa.shape[:-1]) != tuple(lead_shape) or groups == 0 or d % groups:
            C.fail_value(op, "scale", f"one element, [..., 1] or [..., G] with G dividing {d} "
                         f"(leading dimensions {list(lead_shape)})", f"shape {list(sa.shape)}")
        sv = flat2d(op, "scale", sa, rows, groups)
    return qa, kind, sa, sv, groups

# ---------------------------------------------------------------- torch.compile's fake outputs
def fake_half(x, *_, **__):
    return x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,))


def _fp8_dtype():
    return ad._torch.float8_e4m3fn


def fake_fp8(x, *_, **__):
    return x.new_empty(x.shape, dtype=_fp8_dtype())


def fake_fp8_half(x, *_, **__):
    return x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=_fp8_dtype())


def fake_dynamic_tensor(x, *_, **__):
    return fake_fp8(x), x.new_empty((1,), dtype=ad._torch.float32)


def fake_per_token(x, *_, **__):
    return fake_fp8(x), x.new_empty((math.prod(x.shape[:-1]), 1), dtype=ad._torch.float32)


def fake_group(x, group_size, eps=1e-10, column_major_scales=False, tma_aligned_scales=False,
                use_ue8m0=False, *_, half=False, **__):
    torch = ad._torch
    d = x.shape[-1] // 2 if half else x.shape[-1]
    q = x.new_empty(x.shape[:-1] + (d,), dtype=torch.float8_e4m3fn)
    g = d // group_size
    if not (column_major_scales or tma_aligned_scales):
        return q, x.new_empty(x.shape[:-1] + (g,), dtype=torch.float32)
    m = x.shape[0]
    mp = -(-m // 4) * 4 if tma_aligned_scales else m
    return q, torch.empty_strided((m, g), (1, mp), dtype=torch.float32, device=x.device)


def fake_group_fused(x, group_size, *a, **k):
    return fake_group(x, group_size, *a, half=True, **k)


def fake_dequant(q, scale, dtype, *_, **__):
    return q.new_empty(q.shape, dtype=dtype)
