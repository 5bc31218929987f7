"""Activation family and FP8 quantisation: the gated activations (``silu_and_mul`` and its vLLM
siblings), the standalone FP8 E4M3 quantisers, their fused forms, and dequantisation.

Numerically interchangeable with vLLM's CUDA ops called eagerly (``csrc/activation_kernels.cu``,
``csrc/quantization/fp8/common.cu``, ``per_token_group_quant.cu``,
``csrc/quantization/activation_kernels.cu``): the gated activations round to the activation dtype
after the activation and after the multiply (``F.silu(g) * u`` in torch eager has the same two
rounding points); static and dynamic per-tensor quant multiply by ``1/scale``, per-token and
per-token-group quant divide; NaN becomes +448 (per-tensor, per-token) or -448 (group); the sign
of zero is kept. ``docs/numerics.md`` has the family's numerics in one place and
``loomnb.oracle.activation`` is the executable reference.

All kernels come from one factory (``_activation_kernels.act_quant_kernel``): an elementwise
source (the activation, or ``x`` itself) feeding a sink (store as T, or a static, per-tensor,
per-token or per-token-group FP8 quantiser), so a fused op is the same kernel with another source.

Bytes moved (the benchmark's model), per row of ``d`` outputs and element size ``b``:
``*_and_mul`` reads ``2·d·b`` and writes ``d·b``; the FP8 quantisers read ``d·b`` and write ``d``
bytes (+4 per scale); the fused group op reads ``2·d·b`` and writes ``d + 4·d/g``. The dynamic
per-tensor quant reads ``x`` twice (a global amax must be complete before any element is
quantised).

Rows: the last dimension must be contiguous; leading dimensions may have any strides that merge
into at most two strided dimensions. Rows whose start is 16-byte aligned (8 for FP8 outputs) and
whose length is a multiple of 8 move 16 bytes per load and store (decode-size gated
activations: one 4-byte word, two outputs, a thread, :func:`small_layout`); any other row
(``d = 3420`` bf16, whose second half starts 6,840 bytes in) takes the element-wise layout --
never a misaligned vector access.
"""

from __future__ import annotations

import dataclasses
import math

from .. import _adapter as ad
from . import _contract as C
from . import _launch as L
from ._activation_args import (dequant_inputs, fake_dequant, fake_dynamic_tensor, fake_fp8,
                               fake_fp8_half, fake_group, fake_group_fused, fake_half,
                               fake_per_token, fp8_output, gated_input, group_args, group_scales,
                               launch_act, r3, rows_of, vector_ok, x_input)
from ._activation_kernels import (AMAX_UPT, DEQUANT_EPT, NUMERICS, TOKEN_UPT, UNIT, ActSpec,
                                  DequantSpec, act_quant_kernel, chunk_upts, dequant_kernel,
                                  small_ok)
from ._torch_ops import torch_op

__all__ = ["silu_and_mul", "mul_and_silu", "gelu_and_mul", "gelu_tanh_and_mul", "fatrelu_and_mul",
           "swigluoai_and_mul", "silu_and_mul_quant", "static_scaled_fp8_quant",
           "dynamic_scaled_fp8_quant", "dynamic_per_token_scaled_fp8_quant",
           "per_token_group_quant_fp8", "per_token_group_fp8_quant",
           "silu_and_mul_per_token_group_quant_fp8", "scaled_fp8_dequant"]

CHUNK_THREADS = 128      # threads of a chunked block (large batches)
SMALL_CHUNK_THREADS = 64  # ... when the whole call is a few blocks' work (latency-bound)
SMALL_WORK = 132 * 256    # units of 8 outputs under which a call counts as small
SMALL_BATCH = 256         # rows under which the per-token quant prefers 2 units a thread
LARGE_WORK = 2 ** 20      # units of 8 outputs from which a chunked thread holds 4 units, not 2
LARGE_CHUNK_UPT = 4
SMALL_CHUNK_UPT = 1       # ... and up to SMALL_WORK units, 1 (a short chain of dependent work)
SMALL_LAYOUT_WORK = 1 << 16     # units up to which a gated activation takes the "small" layout
SMALL_LAYOUT_THREADS = 128      # its block size (one word, two outputs, a thread)
MAX_GRID_Y = 65535              # gridDim.y: the small layout's rows
AMAX_THREADS = 256        # threads of a block of the dynamic per-tensor amax pass
AMAX_BLOCKS = 512         # at most this many partial maxima (one block reduces them all)
AMAX_ONE_BLOCK = 4096     # units of 8 elements (of at most 8 rows) one block of the amax pass
AMAX_ONE_BLOCK_ROWS = 8   # takes whole: no partials, two launches
AMAX_MAX_THREADS = 512    # the amax pass's block size, forced or not (float32 rows: 76 registers)
MAX_BLOCKS = 2 ** 31 - 1  # gridDim.x
DEQUANT_THREADS = 128
_rows_of, _vector_ok = rows_of, vector_ok  # as notebooks/02_activation.ipynb reads them


def chunk_upt(num_rows, units, spec=None):
    """Units of 8 outputs a thread of the chunked kernels holds: ``SMALL_CHUNK_UPT`` (1) up to
    ``SMALL_WORK`` units (a latency-bound call: each thread's chain of loads, ``expf``, divisions
    and stores is as short as it gets), 2, or ``LARGE_CHUNK_UPT`` (4) from ``LARGE_WORK`` units
    on (a GPU's worth of 512-unit blocks: each thread's fixed cost -- row and chunk arithmetic,
    addresses -- spread over 32 elements, not 16) where ``spec`` compiles at that width
    (``chunk_upts``)."""
    work = num_rows * units
    if work <= SMALL_WORK:
        return SMALL_CHUNK_UPT
    if work >= LARGE_WORK and (spec is None or LARGE_CHUNK_UPT in chunk_upts(spec)):
        return LARGE_CHUNK_UPT
    return 2


def chunk_config(num_rows, units, threads=None, upt=None):
    """(threads, chunks) of the chunked kernels: a block covers ``threads * upt`` units of 8
    outputs of one row (``upt`` from :func:`chunk_upt` when not given), ``chunks`` blocks a row
    (a 1-D grid of ``num_rows * chunks`` blocks; the kernel derives ``chunks`` from ``d``, the
    block size and ``upt`` the same way)."""
    upt = upt or chunk_upt(num_rows, units)
    if threads is None:
        want = SMALL_CHUNK_THREADS if num_rows * units <= SMALL_WORK else CHUNK_THREADS
        threads = min(want, L.whole_warps(-(-units // upt)))
    return threads, max(1, -(-units // (threads * upt)))


def token_config(num_rows, units, vector, threads=None):
    """(threads, upt) of the per-token quant: one block a row, ``upt`` units of 8 a thread held
    in registers (2 for small batches, 4 for large ones), or ``upt = 0``: a loop that reads the
    row twice (rows of more than 4 x 1024 units, or the element-wise layout)."""
    if not vector:
        return threads or min(1024, L.whole_warps(units)), 0
    if threads:
        return threads, next((u for u in TOKEN_UPT if u * threads >= units), 0)
    prefs = TOKEN_UPT if num_rows <= SMALL_BATCH else TOKEN_UPT[::-1]
    for upt in prefs:
        t = L.whole_warps(-(-units // upt))
        if t <= 1024:
            return t, upt
    return 1024, 0


def amax_config(num_rows, units, threads=None):
    """(threads, grid) of the dynamic per-tensor amax pass: at most ``AMAX_BLOCKS`` blocks
    (each folds a strided share of rows x units into one partial maximum), or one block for a
    tensor of at most ``AMAX_ONE_BLOCK`` units in at most ``AMAX_ONE_BLOCK_ROWS`` rows (it
    writes the scale itself); never more than ``AMAX_MAX_THREADS`` threads a block."""
    if num_rows * units <= AMAX_ONE_BLOCK and num_rows <= AMAX_ONE_BLOCK_ROWS:
        return min(threads or L.whole_warps(units), AMAX_MAX_THREADS), (1, 1)
    threads = min(threads or AMAX_THREADS, AMAX_MAX_THREADS)
    gy = max(1, min(-(-units // threads), AMAX_BLOCKS))
    gx = max(1, min(num_rows, AMAX_BLOCKS // gy))
    return threads, (gx, gy)


def small_layout(spec, lead, units, vector):
    """Whether a call takes the ``"small"`` layout (``_activation_kernels._small``: one word,
    two outputs, a thread; no division before the first load): a gated activation without
    quantisation (``small_ok``) on the vector layout's rows, at most ``SMALL_LAYOUT_WORK``
    units of 8 outputs in all, rows that merge into one dimension of at most ``MAX_GRID_Y``.
    Measured on the H200 (``bench_activation.py --tune``, graph replay, bf16 silu_and_mul,
    small layout against 8 outputs a thread): d = 1536 at 1 / 8 / 32 / 128 rows 1.35 / 1.41 /
    1.50 / 1.69 against 1.99 / 2.04 / 2.09 / 2.26 µs; d = 14336 at 1 / 8 / 32 rows 1.41 / 1.60
    / 2.33 against 2.03 / 2.15 / 2.85, but at 128 rows (229,376 units) 5.62 against 4.64 and at
    1536 x 1024 (196,608) 4.99 against 4.29: hence the bound of 65,536 units."""
    rows = math.prod(lead)
    return (vector and small_ok(spec) and rows * units <= SMALL_LAYOUT_WORK
            and rows <= MAX_GRID_Y and (len(lead) == 1 or lead[0] == 1))


# ---------------------------------------------------------------- shared plumbing
def _chunked(op, spec, lead, ov, xv, d, stream, key, **kw):
    """One launch of a chunked sink over every row (nothing for zero rows); decode-size gated
    activations take the small layout (:func:`small_layout`)."""
    rows = math.prod(lead)
    if rows == 0 or d == 0:
        return
    vec = vector_ok(ov, xv, d, spec.quant != "none")
    units = -(-d // UNIT)
    if small_layout(spec, lead, units, vec):
        words = d // 2
        threads = L.forced_threads() or min(SMALL_LAYOUT_THREADS, L.whole_warps(words))
        spec = dataclasses.replace(spec, layout="small", upt=1)
        launch_act(op, spec, lead, ov, xv, d, grid=(-(-words // threads), rows),
                   threads=threads, stream=stream, key=key, **kw)
        return
    upt = chunk_upt(rows, units, spec)
    threads, chunks = chunk_config(rows, units, L.forced_threads(), upt)
    spec = dataclasses.replace(spec, layout="vector" if vec else "scalar", upt=upt)
    if rows * chunks > MAX_BLOCKS:
        C.fail_value(op, "x", f"at most {MAX_BLOCKS} blocks of {threads * upt * UNIT} "
                     "elements", f"{rows} rows of {d}")
    launch_act(op, spec, lead, ov, xv, d, grid=rows * chunks, threads=threads, stream=stream,
            key=key, **kw)


# ---------------------------------------------------------------- gated activations
_GATED = {"silu_and_mul": "silu", "mul_and_silu": "mul_silu", "gelu_and_mul": "gelu",
          "gelu_tanh_and_mul": "gelu_tanh", "fatrelu_and_mul": "fatrelu",
          "swigluoai_and_mul": "swigluoai"}  # op -> ActSpec.act


def _act_and_mul(name, x, out, stream, key, **reals):
    """A gated activation's whole op: its real options (``threshold``, ``alpha``...: checked
    first, in order, and passed to the kernel as float32), ``x``, ``out``, one launch."""
    op, act = f"loomnb.{name}", _GATED[name]
    p0, p1 = ([C.real(op, n, v) for n, v in reals.items()] + [0.0, 0.0])[:2]
    xa, d = gated_input(op, x)
    oa = C.output(op, "out", out, like=xa, kind=xa.kind, shape=xa.shape[:-1] + (d,))
    C.no_overlap(op, {"out": oa}, {"x": xa})
    lead, ov, xv = rows_of(op, oa, xa, d, True)
    _chunked(op, ActSpec(xa.kind, act), lead, ov, xv, d, stream, key, p0=p0, p1=p1)
    return oa.obj


_GATED_DOC = """

    Args:
        x: ``[..., 2*d]`` bf16, fp16 or fp32; last dimension contiguous, leading dimensions of any
            strides that merge into two. Not modified.
        out: optional ``[..., d]`` of ``x``'s dtype, last dimension contiguous; must not overlap
            ``x``. Allocated when None.
        stream: CUDA stream to launch on; default: the caller's current stream.

    Returns ``out``. Mutates: ``out`` only. Raises ``LoomnbTypeError`` (a ``TypeError``) for a
    wrong dtype or array type and ``LoomnbValueError`` (a ``ValueError``) for an odd last
    dimension, shape, layout, device, aliasing or writability problems -- before any launch.
    Zero rows (or ``d = 0``) is a no-op.
"""


@torch_op("Tensor x", outputs=("out",), fake=fake_half)
def silu_and_mul(x, out=None, *, stream=None, launch_key=None):
    """SwiGLU gating: ``out = r(f(r(silu(g))) * f(u))``, ``g = x[..., :d]`` (gate, first half),
    ``u = x[..., d:]``, ``silu(g) = g / (1 + expf(-g))`` in float32 (IEEE division, libdevice
    ``expf``); ``f`` widens to float32, ``r`` rounds to ``x``'s dtype (nearest even).

    Matches vLLM ``torch.ops._C.silu_and_mul(out, input)`` and torch eager
    ``F.silu(x[..., :d]) * x[..., d:]`` bit for bit (the same rounding points; NaN as the
    canonical NaN). ``g = -inf`` gives NaN; ``g`` below about -88.7 gives ``-0.0 * u``.
    """
    return _act_and_mul("silu_and_mul", x, out, stream, launch_key)


@torch_op("Tensor x", outputs=("out",), fake=fake_half)
def mul_and_silu(x, out=None, *, stream=None, launch_key=None):
    """``out = r(f(g) * f(r(silu(u))))``: SiLU on the *second* half (``g = x[..., :d]``,
    ``u = x[..., d:]``), otherwise :func:`silu_and_mul`. Matches vLLM
    ``torch.ops._C.mul_and_silu(out, input)``.
    """
    return _act_and_mul("mul_and_silu", x, out, stream, launch_key)


@torch_op("Tensor x", outputs=("out",), fake=fake_half)
def gelu_and_mul(x, out=None, *, stream=None, launch_key=None):
    """GeGLU: ``out = r(f(r(gelu(g))) * f(u))``, ``gelu(g) = (g * 0.5) * (1 + erff(g * M_SQRT1_2))``
    in float32 (libdevice ``erff``; torch's exact GELU). Matches vLLM
    ``torch.ops._C.gelu_and_mul(out, input)``.
    """
    return _act_and_mul("gelu_and_mul", x, out, stream, launch_key)


@torch_op("Tensor x", outputs=("out",), fake=fake_half)
def gelu_tanh_and_mul(x, out=None, *, stream=None, launch_key=None):
    """GeGLU with the tanh GELU: ``gelu(g) = (0.5 * g) * (1 + tanhf(BETA * fma(KAPPA, g*g*g, g)))``,
    ``BETA = sqrt(2/pi)``, ``KAPPA = 0.044715`` (the FMA is the contraction nvcc makes in vLLM's
    and torch's kernels), then as :func:`gelu_and_mul`. Matches vLLM
    ``torch.ops._C.gelu_tanh_and_mul(out, input)``.
    """
    return _act_and_mul("gelu_tanh_and_mul", x, out, stream, launch_key)


@torch_op("Tensor x, float threshold=0.0", outputs=("out",), fake=fake_half)
def fatrelu_and_mul(x, threshold=0.0, out=None, *, stream=None, launch_key=None):
    """FATReLU gating: ``out = r(f(g if g > threshold else 0) * f(u))`` (NaN gate -> 0).
    ``threshold``: a finite real number, used as float32. Matches vLLM
    ``torch.ops._C.fatrelu_and_mul(out, input, threshold)``.
    """
    return _act_and_mul("fatrelu_and_mul", x, out, stream, launch_key, threshold=threshold)


@torch_op("Tensor x, float alpha=1.702, float limit=7.0", outputs=("out",), fake=fake_half)
def swigluoai_and_mul(x, alpha=1.702, limit=7.0, out=None, *, stream=None, launch_key=None):
    """GPT-OSS's clamped SwiGLU on *interleaved* pairs ``g = x[..., 0::2]``, ``u = x[..., 1::2]``:
    ``g' = fminf(g, limit)``, ``u' = fmaxf(fminf(u, limit), -limit)`` (a NaN becomes ``limit``),
    ``out = r(((u' + 1) * g') / (1 + expf((-g') * alpha)))`` in float32, rounded once. ``alpha``
    and ``limit``: finite reals, used as float32. Matches vLLM
    ``torch.ops._C.swigluoai_and_mul(out, input, alpha, limit)`` (the formula of its vectorised
    revision; an older one computed ``g' * sigmoid`` first, which can move the last bit).
    """
    return _act_and_mul("swigluoai_and_mul", x, out, stream, launch_key, alpha=alpha, limit=limit)


for _op in (silu_and_mul, mul_and_silu, gelu_and_mul, gelu_tanh_and_mul, fatrelu_and_mul,
            swigluoai_and_mul):
    _op.__doc__ += _GATED_DOC
del _op


# ---------------------------------------------------------------- static and fused static quant
@torch_op("Tensor x, Tensor scale", outputs=("out",), fake=fake_fp8)
def static_scaled_fp8_quant(x, scale, out=None, *, stream=None, launch_key=None):
    """Static per-tensor FP8 E4M3 quantisation: ``out = e4m3(clamp(f(x) * (1/scale)))``,
    ``1/scale`` computed once in float32 (vLLM multiplies; it does not divide). Units: stored =
    real / scale. NaN -> +448 (``fminf`` clamp); the sign of zero is kept (-0.0 -> 0x80).

    Args:
        x: ``[..., d]`` bf16/fp16/fp32, last dimension contiguous, leading dimensions as
            :func:`silu_and_mul`. Not modified.
        scale: float32 device array of one element (shape ``[]`` or ``[1]``). Not checked (a
            device read): 0 gives +-448 (0/0 -> +448), a negative scale flips signs -- as vLLM.
        out: optional ``[..., d]`` ``float8_e4m3fn`` (or ``uint8`` codes); allocated when None.
        stream: as :func:`silu_and_mul`.

    Returns ``out``. Mutates ``out``. Raises as :func:`silu_and_mul`. Matches vLLM
    ``torch.ops._C.static_scaled_fp8_quant(result, input, scale)`` (per-tensor ``group_shape``).
    """
    op = "loomnb.static_scaled_fp8_quant"
    xa = x_input(op, x)
    sa = C.one_element(op, "scale", scale, xa)
    oa = fp8_output(op, "out", out, xa, xa.shape)
    C.no_overlap(op, {"out": oa}, {"x": xa, "scale": sa})
    lead, ov, xv = rows_of(op, oa, xa, xa.shape[-1], False)
    _chunked(op, ActSpec(xa.kind, "none", "static"), lead, ov, xv, xa.shape[-1], stream, launch_key,
             scale=sa)
    return oa.obj


@torch_op("Tensor x, Tensor scale", outputs=("out",), fake=fake_fp8_half)
def silu_and_mul_quant(x, scale, out=None, *, stream=None, launch_key=None):
    """:func:`silu_and_mul` then :func:`static_scaled_fp8_quant`, in one pass:
    ``out = e4m3(clamp(f(r(f(r(silu(g))) * f(u))) * (1/scale)))``. Bit-identical to the two ops.

    Args:
        x: ``[..., 2*d]`` bf16/fp16/fp32 as :func:`silu_and_mul`; not modified.
        scale: float32 one-element device array (stored = real / scale); not checked.
        out: optional ``[..., d]`` ``float8_e4m3fn`` (or ``uint8``); allocated when None.
        stream: as :func:`silu_and_mul`.

    Returns ``out``. Mutates ``out``. NaN -> +448. Raises as :func:`silu_and_mul`. Matches vLLM
    ``torch.ops._C.silu_and_mul_quant(result, input, scale)`` (vLLM takes fp16/bf16 only).
    """
    op = "loomnb.silu_and_mul_quant"
    xa, d = gated_input(op, x)
    sa = C.one_element(op, "scale", scale, xa)
    oa = fp8_output(op, "out", out, xa, xa.shape[:-1] + (d,))
    C.no_overlap(op, {"out": oa}, {"x": xa, "scale": sa})
    lead, ov, xv = rows_of(op, oa, xa, d, True)
    _chunked(op, ActSpec(xa.kind, "silu", "static"), lead, ov, xv, d, stream, launch_key, scale=sa)
    return oa.obj


# ---------------------------------------------------------------- dynamic per-tensor
@torch_op("Tensor x", outputs=("out", "scale"), fake=fake_dynamic_tensor)
def dynamic_scaled_fp8_quant(x, out=None, *, scale=None, stream=None, launch_key=None):
    """Dynamic per-tensor FP8 E4M3 quantisation: ``scale = max|x| / 448`` over the whole tensor
    (NaN ignored; no floor: an all-zero ``x`` gives ``scale = 0`` and codes +448, which
    dequantise to 0), then ``out = e4m3(clamp(f(x) * (1/scale)))`` as
    :func:`static_scaled_fp8_quant`.

    Three launches and no host round trip: the first folds ``max|x|`` into at most 512
    per-block partial maxima (every slot written: no zeroing, no atomics, deterministic), the
    second (one block) reduces them into ``scale``, the third quantises as
    :func:`static_scaled_fp8_quant`, the rows the first pass read last (still in L2) first. A
    tensor of at most 8 rows and 32,768 elements takes one block for the amax and two launches.
    Correct under CUDA-graph capture (the partials are allocated per call, from the graph's pool
    when capturing). ``x`` is read twice: the scale needs every element before any is quantised.

    Args:
        x: ``[..., d]`` bf16/fp16/fp32, rows as :func:`silu_and_mul`; not modified.
        out: optional ``[..., d]`` ``float8_e4m3fn`` (or ``uint8``); allocated when None.
        scale: optional float32 ``[1]`` output; allocated when None.
        stream: as :func:`silu_and_mul`.

    Returns ``(out, scale)``. Mutates ``out`` and ``scale``. An empty ``x`` gives ``scale = 0``.
    NaN -> +448. Raises as :func:`silu_and_mul`. Matches vLLM
    ``torch.ops._C.dynamic_scaled_fp8_quant(result, input, scale)`` (whose caller zeroes
    ``scale`` first: loomnb needs no such preparation).
    """
    op = "loomnb.dynamic_scaled_fp8_quant"
    xa = x_input(op, x)
    d = xa.shape[-1]
    oa = fp8_output(op, "out", out, xa, xa.shape)
    sa = C.output(op, "scale", scale, like=xa, kind="f32", shape=(1,))
    C.no_overlap(op, {"out": oa, "scale": sa}, {"x": xa})
    lead, ov, xv = rows_of(op, oa, xa, d, False)
    rows, units = math.prod(lead), -(-d // UNIT)
    vec = rows > 0 and vector_ok(ov, xv, d, True)
    layout = "vector" if vec else "scalar"
    forced = L.forced_threads()
    t1, grid1 = amax_config(rows, units, forced)
    blocks = grid1[0] * grid1[1]
    pa = C.output(op, "partials", None, like=xa, kind="f32", shape=(blocks,))
    quant = rows > 0 and d > 0  # an empty x: scale = 0, nothing to quantise
    parts = 1 + (blocks > 1) + quant
    spec = ActSpec(xa.kind, "none", "amax", layout=layout, upt=AMAX_UPT if vec else 1)
    launch_act(op, spec, lead, ov, xv, d, scale=sa, partials=pa, grid=grid1, threads=t1,
            stream=stream, key=launch_key, part=(0, parts))
    if blocks > 1:  # one block (of a fixed size) folds the partials, a float32 row, into the scale
        params = [L.absent("uint8", 3), L.array(pa.view((1, 1, blocks), (0, 0, 1))),
                  L.absent("float32", 2), L.array(sa), L.absent("float32", 1), L.f32(0.0),
                  L.f32(0.0), L.i64(blocks)]
        L.launch(act_quant_kernel, ActSpec("f32", "none", "amax", layout="scalar", upt=1),
                 (1, 1), AMAX_THREADS, params, like=xv, stream=stream, key=launch_key,
                 part=(1, parts))
    if quant:
        spec = ActSpec(xa.kind, "none", "tensor", layout=layout, upt=chunk_upt(rows, units))
        t2, chunks = chunk_config(rows, units, forced, spec.upt)
        launch_act(op, spec, lead, ov, xv, d, scale=sa,
                grid=rows * chunks, threads=t2, stream=stream, key=launch_key, part=(parts - 1, parts))
    return oa.obj, sa.obj


# ---------------------------------------------------------------- dynamic per-token
@torch_op("Tensor x, Tensor? scale_ub=None", outputs=("out", "scales"), fake=fake_per_token)
def dynamic_per_token_scaled_fp8_quant(x, scale_ub=None, out=None, *, scales=None, stream=None, launch_key=None):
    """Dynamic per-token FP8 E4M3 quantisation: per row ``amax = max|f(x)|`` (NaN ignored),
    ``scale = max(min(amax, scale_ub) / 448, 1/(448*512))`` (``scale_ub`` clips the amax,
    despite its name; ``fminf``: a NaN bound is ignored), ``out = e4m3(clamp(f(x) / scale))``
    with a correctly rounded division. NaN -> +448; -0.0 -> 0x80.

    Args:
        x: ``[..., d]`` bf16/fp16/fp32, rows as :func:`silu_and_mul`; not modified.
        scale_ub: optional float32 one-element device array; not checked (a device read).
        out: optional ``[..., d]`` ``float8_e4m3fn`` (or ``uint8``); allocated when None.
        scales: optional float32 ``[num_tokens, 1]`` output (``num_tokens`` = the product of the
            leading dimensions), any strides; allocated when None.
        stream: as :func:`silu_and_mul`.

    Returns ``(out, scales)``. Mutates ``out`` and ``scales``. Raises as :func:`silu_and_mul`.
    Matches vLLM ``torch.ops._C.dynamic_per_token_scaled_fp8_quant(result, input, scale,
    scale_ub)`` (its current revision, which divides; vLLM's amax is a float32 max, exact in any
    order, so the scales are bit-identical too).
    """
    op = "loomnb.dynamic_per_token_scaled_fp8_quant"
    xa = x_input(op, x)
    d = xa.shape[-1]
    ua = C.one_element(op, "scale_ub", scale_ub, xa) if scale_ub is not None else None
    rows = math.prod(xa.shape[:-1])
    oa = fp8_output(op, "out", out, xa, xa.shape)
    sa = C.output(op, "scales", scales, like=xa, kind="f32", shape=(rows, 1))
    C.no_overlap(op, {"out": oa, "scales": sa}, {"x": xa, "scale_ub": ua})
    lead, ov, xv = rows_of(op, oa, xa, d, False)
    if rows == 0:
        return oa.obj, sa.obj
    units = -(-d // UNIT) if d else 0
    vec = d > 0 and vector_ok(ov, xv, d, True)
    threads, upt = token_config(rows, max(units, 1), vec, L.forced_threads())
    spec = ActSpec(xa.kind, "none", "token", scale_ub=ua is not None,
                   layout="vector" if vec else "scalar", upt=upt)
    launch_act(op, spec, lead, ov, xv, d, scales=L.array(sa), scale=ua, grid=rows,
            threads=threads, stream=stream, key=launch_key)
    return oa.obj, sa.obj


# ---------------------------------------------------------------- per-token-group
def _group_quant(op, act, numerics, xa, d, group_size, eps, column_major, tma, ue8m0, out_q, out_s,
                 stream, key):
    eps = group_args(op, xa, group_size, eps, column_major, tma, ue8m0, d)
    spec = ActSpec(xa.kind, act, "group", numerics=numerics, group=group_size, ue8m0=ue8m0)
    qa = fp8_output(op, "out_q", out_q, xa, xa.shape[:-1] + (d,))
    s_obj, sv = group_scales(op, out_s, xa, xa.shape[:-1], d // group_size, column_major, tma)
    C.no_overlap(op, {"out_q": qa, "out_s": sv}, {"x": xa})
    lead, ov, xv = rows_of(op, qa, xa, d, act != "none")
    _chunked(op, spec, lead, ov, xv, d, stream, key, scales=L.array(sv), p0=eps)
    return qa.obj, s_obj


@torch_op("Tensor x, int group_size, float eps=1e-10, bool column_major_scales=False, "
          "bool tma_aligned_scales=False, bool use_ue8m0=False", outputs=("out_q", "out_s"),
          fake=fake_group)
def per_token_group_quant_fp8(x, group_size, eps=1e-10, column_major_scales=False,
                              tma_aligned_scales=False, use_ue8m0=False, out_q=None, out_s=None,
                              *, stream=None, launch_key=None):
    """Per-token-group FP8 E4M3 quantisation (DeepSeek-style 1 x ``group_size`` blocks).

    Per group of ``group_size`` consecutive elements of a row: ``a = fmaxf(eps, max|f(x)|)``
    (eps floors the amax; NaN ignored), ``scale = a / 448``; with ``use_ue8m0``, ``scale =
    exp2f(ceilf(log2f(fmaxf(scale, 1e-10))))`` (libdevice ``log2f``: a scale just above a power
    of two may round down to it -- never "the next power of two from the exponent bits");
    ``q = e4m3(fminf(fmaxf(f(x) / scale, -448), 448))`` -- correctly rounded division, NaN ->
    **-448**, -0.0 -> 0x80.

    Args:
        x: ``[..., d]`` bf16/fp16/fp32, rows as :func:`silu_and_mul`; ``d % group_size == 0``.
            2-D ``[num_tokens, d]`` for column-major or TMA-aligned scales. Not modified.
        group_size: 64 or 128 (an ``int``).
        eps: absolute floor of the amax (finite, >= 0).
        column_major_scales: allocate the scales as ``[d/g, num_tokens]`` memory, returned as the
            ``[num_tokens, d/g]`` view with strides ``(1, num_tokens)`` (CUTLASS/DeepGEMM).
        tma_aligned_scales: column-major with the column stride rounded up to a multiple of 4
            (strides ``(1, round_up(num_tokens, 4))``; the padding is left unwritten).
        use_ue8m0: round every scale up to a power of two (stored as float32).
        out_q: optional ``[..., d]`` ``float8_e4m3fn`` (or ``uint8``); allocated when None.
        out_s: optional float32 scales, ``[..., d/g]`` of any strides whose leading dimensions
            merge (a 2-D ``[num_tokens, d/g]`` of any strides: its own layout is used whatever
            the flags say); allocated as the flags say when None.
        stream: as :func:`silu_and_mul`.

    Returns ``(q, scales)``. Mutates ``out_q``/``out_s``. Raises as :func:`silu_and_mul`, and
    ``LoomnbValueError`` for a group size that is not 64 or 128 or does not divide ``d``.
    Matches vLLM ``per_token_group_quant_fp8`` (``torch.ops._C.per_token_group_fp8_quant``,
    its CUDA path); vLLM's Triton fallback (non-contiguous input) multiplies by ``1/448`` and
    can differ in the last bit of a scale. Also exported as ``per_token_group_fp8_quant``.
    """
    op = "loomnb.per_token_group_quant_fp8"
    xa = x_input(op, x)
    return _group_quant(op, "none", "unfused", xa, xa.shape[-1], group_size, eps,
                        column_major_scales, tma_aligned_scales, use_ue8m0, out_q, out_s, stream, launch_key)


per_token_group_fp8_quant = per_token_group_quant_fp8


@torch_op("Tensor x, int group_size, float eps=1e-10, bool column_major_scales=False, "
          "bool tma_aligned_scales=False, bool use_ue8m0=False, *, str numerics='unfused'",
          outputs=("out_q", "out_s"), fake=fake_group_fused)
def silu_and_mul_per_token_group_quant_fp8(x, group_size, eps=1e-10, column_major_scales=False,
                                           tma_aligned_scales=False, use_ue8m0=False, out_q=None,
                                           out_s=None, *, numerics="unfused", stream=None, launch_key=None):
    """:func:`silu_and_mul` then :func:`per_token_group_quant_fp8`, in one pass over ``x``
    (``[..., 2*d]`` in, ``[..., d]`` FP8 and its scales out; the activation never goes to memory).

    ``numerics="unfused"`` (default): bit-identical to the two ops (the activation rounded to
    ``x``'s dtype twice, as :func:`silu_and_mul`). ``numerics="per_block"``: the numerics of
    vLLM's fused ``silu_and_mul_per_block_quant`` -- ``y = (g * (1 / (1 + expf(-g)))) * u`` kept
    in float32 (no rounding to T), ``scale = fmaxf(max|y| / 448, 1e-10)`` (``eps`` unused),
    ``q = e4m3(y / scale)`` with no clamp (NaN -> NaN 0x7F); not with ``use_ue8m0``.

    Arguments, layouts, returns and errors as :func:`per_token_group_quant_fp8` (``d`` is half
    of ``x``'s last dimension). Matches vLLM ``silu_and_mul`` followed by
    ``per_token_group_fp8_quant`` (default) or ``torch.ops._C.silu_and_mul_per_block_quant``
    (``"per_block"``, without its ``scale_ub``).
    """
    op = "loomnb.silu_and_mul_per_token_group_quant_fp8"
    xa, d = gated_input(op, x)
    C.choice(op, "numerics", numerics, NUMERICS)
    if numerics == "per_block" and use_ue8m0 is True:
        C.fail_value(op, "use_ue8m0", "False with numerics='per_block' (vLLM's "
                     "silu_and_mul_per_block_quant has no UE8M0 scales)", "True")
    return _group_quant(op, "silu", numerics, xa, d, group_size, eps, column_major_scales,
                        tma_aligned_scales, use_ue8m0, out_q, out_s, stream, launch_key)


# ---------------------------------------------------------------- dequantisation
@torch_op("Tensor q, Tensor scale, ScalarType dtype", outputs=("out",), fake=fake_dequant)
def scaled_fp8_dequant(q, scale, dtype, *, out=None, stream=None, launch_key=None):
    """FP8 E4M3 dequantisation: ``out = r(f(q) * scale)`` rounded once to ``dtype``, for every
    scale layout the quantisers produce: one element (per tensor), ``[..., 1]`` (per token) or
    ``[..., G]`` with ``G`` dividing ``d`` (per group of ``d/G``; any strides, so row-major,
    column-major and TMA-aligned scales all work). NaN codes give NaN.

    Args:
        q: ``[..., d]`` ``float8_e4m3fn`` (or ``uint8`` codes), rows as :func:`silu_and_mul`.
        scale: float32 scales in one of the layouts above, on ``q``'s device. Not modified.
        dtype: the output dtype: bfloat16, float16 or float32 (a torch or NumPy dtype, or its
            name).
        out: optional ``[..., d]`` output of ``dtype``; allocated when None.
        stream: as :func:`silu_and_mul`.

    Returns ``out``. Raises as :func:`silu_and_mul`, and ``LoomnbValueError`` for a scale of
    another shape. For tests and users (vLLM has no such op; its GEMMs take the scales).
    """
    op = "loomnb.scaled_fp8_dequant"
    qa, kind, sa, sv, groups = dequant_inputs(op, q, scale, dtype)
    d, rows = qa.shape[-1], math.prod(qa.shape[:-1])
    oa = C.output(op, "out", out, like=qa, kind=kind, shape=qa.shape, like_name="q")
    C.no_overlap(op, {"out": oa}, {"q": qa, "scale": sa})
    lead, (ov, qv) = C.rows(op, [("out", oa), ("q", qa)])
    if rows == 0 or d == 0:
        return oa.obj
    threads = L.forced_threads() or min(DEQUANT_THREADS, L.whole_warps(d))
    chunks = -(-d // (threads * DEQUANT_EPT))
    params = [L.array(r3(ov, lead)), L.array(r3(qv, lead)), L.array(sv),
              L.i64(d // groups), L.i64(d)]
    L.launch(dequant_kernel, DequantSpec(kind), (rows, chunks), threads, params, like=qa,
             stream=stream, key=launch_key)
    return oa.obj
