"""Whether loomnb takes a vLLM call, and if not, why: the plug-in's routing question.

Two sources answer it, in this order:

1. **The plug-in's own policy**, for what no loomnb op decides: CUDA tensors only (``_CUDA``);
   activations of :data:`ROUTED_DTYPES` (float32 is refused: the norms' ``inv`` is evaluated in
   float64, which float32 outputs show in the last bit against vLLM's ``rsqrtf``); and vLLM's
   arguments that loomnb's ops have no parameter for (``variance_size``, ``weight=None``, a
   RoPE call without a key, vLLM's FlashInfer rotary path).
2. **The op's own validation**, for everything else -- dtype agreement, shapes, strides, ``eps``,
   ``rot_dim``, ``head_size``: the checks ``loomnb.rms_norm`` / ``fused_add_rms_norm``,
   ``silu_and_mul`` and ``apply_rope_with_cos_sin_cache`` run before a launch
   (``loomnb.ops.norm._inputs`` / ``_residual`` and the row rule ``_contract.rows``,
   ``loomnb.ops.activation.gated_input`` / ``rows_of``, ``loomnb.ops.rope_cache.rope_inputs``)
   are run on stand-ins that carry the call's metadata and no data (:class:`_Probe`). The
   ``LoomnbError`` an op raises is the reason, its message word for word. So a layout an op
   learns to take is routed with no change here.

Metadata only (never data or pointers), so the checks run on the fake tensors of vLLM's lowering
pass and inside a Dynamo trace. The token dimension (dimension 0 of ``x``, ``x_residual``,
``query``, ``key`` and ``positions``) is never read: it is symbolic under torch.compile, and the
ops are asked about a call of 2 tokens. That decision holds for every number of tokens (a
dimension's size enters the row rule only as 0, 1 or more, and the first dimension's never
decides a merge; reading 1 as 2 can only refuse more), and one reason then counts every
``num_tokens`` -- an op's message that quotes a shape shows 2 there. A symbolic size or stride
beyond the token dimension is a reason of its own outside Dynamo; under Dynamo, which shows it as
an int, it is specialised (a guard, as any comparison on it would add). A decision depends on
nothing but the metadata, so each is made once per distinct call (:func:`_decide`'s cache).
"""

import functools
import operator

import torch
import torch._dynamo  # assume_constant_result: the op is asked at trace time, not traced

from ...checks import LoomnbError
from ...ops import _contract as C
from ...ops import activation, norm, rope_cache

__all__ = ["rms_norm_fallback_reason", "silu_and_mul_fallback_reason",
           "rotary_embedding_fallback_reason", "ROUTED_DTYPES"]

_CUDA = "cuda"  # the device type the plug-in routes (the CPU tests route "cpu" through stubs)
ROUTED_DTYPES = (torch.bfloat16, torch.float16)
SYMBOLIC = "symbolic sizes or strides beyond the token dimension"


class _Probe(torch.Tensor):
    """A CUDA tensor's metadata -- dtype, device, shape, strides -- and no storage: what
    ``loomnb._adapter.wrap`` reads of a torch tensor (its data pointer reads 0), so an op's
    validation runs on it unchanged. Any operation on its data raises."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, dtype, device, shape, strides):
        return torch.Tensor._make_wrapper_subclass(cls, shape, strides=strides, dtype=dtype,
                                                   device=torch.device("cuda", device))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"a metadata probe has no data ({func})")

    def data_ptr(self):
        return 0


def _contiguous(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


# ---------------------------------------------------------------------------------------------
# What each op is asked: its own checks, on probes (``meta`` tuples: dtype, device, shape,
# strides). A raised LoomnbError is the answer.
def _check_rms_norm(x, weight, eps, residual):
    op = "loomnb.rms_norm" if residual is None else "loomnb.fused_add_rms_norm"
    xa, _, _ = norm._inputs(op, _Probe(*x), _Probe(*weight), eps)
    named = [("x", xa)]
    if residual is not None:
        ra = norm._residual(op, xa, _Probe(*residual))
        C.writable(op, {"x": xa, "residual": ra})
        named.append(("residual", ra))
    C.rows(op, named)  # the row view the launch takes (the output loomnb allocates never limits it)


def _check_silu_and_mul(x):
    op = "loomnb.silu_and_mul"
    xa, d = activation.gated_input(op, _Probe(*x))
    shape = xa.shape[:-1] + (d,)  # the contiguous output loomnb allocates
    out = C.wrap(op, "out", _Probe(x[0], x[1], shape, _contiguous(shape)))
    activation.rows_of(op, out, xa, d, True)


def _check_rope(positions, query, key, head_size, cos_sin_cache, is_neox):
    rope_cache.rope_inputs("loomnb.apply_rope_with_cos_sin_cache", _Probe(*positions),
                           _Probe(*query), _Probe(*key), head_size, _Probe(*cos_sin_cache),
                           is_neox, 0, False, "vllm")


_CHECKS = {"rms_norm": _check_rms_norm, "silu_and_mul": _check_silu_and_mul,
           "rotary_embedding": _check_rope}


@functools.lru_cache(maxsize=1024, typed=True)  # typed: eps=True, is_neox=1 are calls of their own
def _decide(check, *args):
    """The op's answer for one call's metadata: None (it takes the call) or its error message."""
    try:
        _CHECKS[check](*args)
    except LoomnbError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - an op whose checks read more than metadata: counted
        return f"the op's checks did not run on metadata ({type(e).__name__}: {e})"
    return None


@torch._dynamo.assume_constant_result
def _ask(check, *args):
    """:func:`_decide`. Under Dynamo it runs once, at trace time, on the constant metadata of
    that call site, and its answer is a constant of the trace."""
    return _decide(check, *args)


# ---------------------------------------------------------------------------------------------
# Metadata, and the plug-in's own policy
def _ints(values):
    """``values`` (sizes or strides) as ints, or None where one is symbolic. Dynamo shows a
    symbolic int as an int, and ``operator.index`` specialises it (one guard)."""
    if torch.compiler.is_dynamo_compiling():
        return tuple(operator.index(v) for v in values)
    return tuple(values) if all(type(v) is int for v in values) else None


def _meta(t, tokens):
    """(dtype, device index, shape, strides) of ``t``; ``tokens``: dimension 0 is the token
    dimension, read as 2. None where a size or stride beyond it is symbolic."""
    shape = tuple(t.shape)
    if tokens and shape:
        shape = (2,) + shape[1:]
    shape, strides = _ints(shape), _ints(tuple(t.stride()))
    if shape is None or strides is None:
        return None
    return t.dtype, t.device.index or 0, shape, strides


def _metas(first, *others):
    """The metadata of the call's tensors (``(name, tensor or None, tokens)``, the activation
    first), or the reason the plug-in refuses them itself: a tensor off CUDA, an activation
    dtype it does not route, a symbolic size."""
    t = first[1]
    if t.device.type != _CUDA:
        return "not a CUDA tensor"
    if t.dtype not in ROUTED_DTYPES:
        return f"activation dtype {str(t.dtype).replace('torch.', '')} (routed: bfloat16, float16)"
    metas = []
    for name, t, tokens in (first, *others):
        if t is None:
            metas.append(None)
            continue
        if t.device.type != _CUDA:
            return f"{name} is not a CUDA tensor"
        m = _meta(t, tokens)
        if m is None:
            return SYMBOLIC
        metas.append(m)
    return tuple(metas)


def rms_norm_fallback_reason(x, weight, epsilon, variance_size=None, x_residual=None):
    """Why loomnb does not take this ``vllm.ir.ops.rms_norm`` call (or ``fused_add_rms_norm``,
    with ``x_residual``), or None when it does.

    The plug-in's own reasons: ``variance_size`` set, ``weight`` None, tensors off CUDA, ``x``
    not bf16/fp16. Everything else is ``loomnb.rms_norm``'s (``loomnb.fused_add_rms_norm``'s)
    validation, its message the reason: ``weight`` of ``x``'s dtype and device,
    ``[hidden_size]``, contiguous; ``epsilon`` finite and >= 0; ``x`` (and the residual)
    ``[..., hidden_size]`` with a contiguous last dimension whose leading dimensions merge into at
    most two strided ones. ``x_residual``'s token dimension is assumed equal to ``x``'s (vLLM
    passes tensors of one shape; loomnb raises otherwise).
    """
    if variance_size is not None:
        return "variance_size set (var_hidden_size)"
    if weight is None:
        return "weight is None (has_weight=False)"
    metas = _metas(("x", x, x.dim() > 1), ("weight", weight, False),
                   ("x_residual", x_residual, x.dim() > 1))
    if isinstance(metas, str):
        return metas
    return _ask("rms_norm", metas[0], metas[1], epsilon, metas[2])


def silu_and_mul_fallback_reason(x):
    """Why loomnb does not take this ``SiluAndMul`` call (None: it does): the plug-in's own
    reasons (off CUDA, not bf16/fp16), then ``loomnb.silu_and_mul``'s validation (``[..., 2 *
    d]``, last dimension contiguous, leading dimensions that merge into two)."""
    metas = _metas(("x", x, x.dim() > 1))
    if isinstance(metas, str):
        return metas
    return _ask("silu_and_mul", metas[0])


def rotary_embedding_fallback_reason(positions, query, key, head_size, cos_sin_cache,
                                     is_neox=True):
    """Why loomnb does not take this ``RotaryEmbedding`` call (None: it does).

    The plug-in's own reasons: tensors off CUDA, a query not bf16/fp16, no key (the out-of-place
    form rotates a query and a key; vLLM's own op takes the call). Everything else is
    ``loomnb.apply_rope_with_cos_sin_cache``'s validation, its message the reason: int64
    ``positions`` ``[num_tokens]``; ``query`` / ``key`` ``[num_tokens, num_heads * head_size]``
    or ``[num_tokens, num_heads, head_size]`` with a contiguous last dimension (any token and head
    strides: vLLM passes views of the fused QKV buffer); ``cos_sin_cache`` ``[max_position,
    rot_dim]`` with an even ``rot_dim <= head_size``, and so on.
    """
    metas = _metas(("query", query, query.dim() > 1), ("positions", positions, True),
                   ("key", key, key is not None and key.dim() > 1),
                   ("cos_sin_cache", cos_sin_cache, False))
    if isinstance(metas, str):
        return metas
    if key is None:
        return "key is None (the out-of-place form rotates a query and a key)"
    q, p, k, cs = metas
    return _ask("rotary_embedding", p, q, k, head_size, cs, is_neox)
