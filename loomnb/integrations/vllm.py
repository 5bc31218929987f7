"""loomnb inside vLLM 0.24: a general plug-in that routes vLLM's RMSNorm ops (and SiLU-and-mul and
RoPE, where this loomnb has them) to loomnb's kernels, falling back to vLLM's own implementation,
counted, wherever loomnb does not take the arguments.

Turn it on (``docs/vllm.md`` has the whole story)::

    pip install loomnb                # declares the entry point  vllm.general_plugins: loomnb
    from vllm import LLM
    from loomnb.integrations.vllm import engine_kwargs
    llm = LLM(model_path, **engine_kwargs("loomnb"))

vLLM calls :func:`register` in every process it starts (``vllm/plugins/__init__.py``,
``load_general_plugins``; ``VLLM_PLUGINS=loomnb`` restricts loading to this one). What it routes,
through vLLM 0.24.0's own mechanisms (read from its sources):

* ``vllm.ir.ops.rms_norm`` (an IR op) -> ``loomnb.rms_norm(x, weight, eps, rounding="once")``;
  selected by ``ir_op_priority`` ``rms_norm = ["loomnb", "vllm_c", "native"]``;
* ``vllm.ir.ops.fused_add_rms_norm`` -> ``loomnb.fused_add_rms_norm(x, x_residual, weight, eps,
  rounding="once")``, in place; ``ir_op_priority`` ``fused_add_rms_norm = [...]`` likewise;
* ``SiluAndMul`` (a CustomOp) -> ``loomnb.silu_and_mul(x)``; ``custom_ops`` ``"+SiluAndMul"``;
* ``RotaryEmbedding`` -> ``loomnb.apply_rope_with_cos_sin_cache(positions, query, key,
  head_size, cos_sin_cache, is_neox)``, out of place (the rotated query and key are new
  tensors, the bits of vLLM's in-place op); ``custom_ops`` ``"+RotaryEmbedding"``.

* **IR ops** (``model_executor/layers/layernorm.py`` calls ``vllm.ir.ops.rms_norm`` and
  ``fused_add_rms_norm.maybe_inplace``): the plug-in registers provider ``"loomnb"`` with
  ``register_impl(..., supported=current_platform.is_cuda(), supports_args=...)``
  (``inplace=True`` for the fused add). vLLM requires the implementation's inferred torch schema
  to equal the native one's exactly (``ir/op.py``, ``IrOpImpl.__init__``); the plug-in compares
  them against the live vLLM before registering and refuses, with a logged reason, on a
  mismatch. Under torch.compile vLLM's lowering pass traces the implementation with fake
  tensors, so it calls ``torch.ops.loomnb.<op>``: the compiled graph holds one loomnb node per
  norm (CUDA-graph capture included). ``rounding="once"`` is the rounding of vLLM 0.24.0's
  compiled ``rms_norm``/``fused_add_rms_norm`` (``docs/numerics.md``).
* **CustomOps**: ``SiluAndMul.register_oot`` / ``RotaryEmbedding.register_oot`` swap the class
  vLLM instantiates for a subclass whose ``forward_cuda`` calls loomnb. vLLM names an
  out-of-tree class by the class name, so loomnb is selected by ``"+SiluAndMul"`` /
  ``"+RotaryEmbedding"`` in ``compilation_config["custom_ops"]``. The replacement keeps vLLM's
  own names working as before: ``"+silu_and_mul"`` / ``"+rotary_embedding"`` run vLLM's own CUDA
  op through it, ``"-..."`` (either name) or neither under ``"none"`` the torch-native forward,
  and ``"all"`` loomnb (:func:`custom_op_mode`). Registered only
  when ``loomnb`` has the op (``hasattr(loomnb, name)``) with the signature called here.
  RoPE is routed to the out-of-place form: under torch.compile an in-place custom op on the
  query and key (views of the QKV GEMM's output) is functionalised, and Inductor lowers that
  to a copy of both views before the op and a scatter after it -- two kernels a layer, 62 µs a
  decode step of SmolLM2 at batch 1 (measured). vLLM turns its own in-place ops back into
  in-place calls (``FixFunctionalizationPass``, a fixed list with no hook for plug-ins); an
  out-of-place op has nothing to undo.

**Fallbacks.** Each call is checked on metadata only -- dtype, device, shape, strides -- by
:func:`rms_norm_fallback_reason`, :func:`silu_and_mul_fallback_reason` and
:func:`rotary_embedding_fallback_reason`; a reason sends the call to vLLM's implementation (the
next provider in the priority list, or the CustomOp's own ``forward_cuda``). Routed: CUDA
tensors of bfloat16 or float16 in the layouts loomnb's kernels take. Not routed: float32
activations (loomnb evaluates the norm's ``inv`` in float64, which float32 outputs show in the
last bit against vLLM's ``rsqrtf``), ``weight=None`` (``has_weight=False``), ``variance_size``
(``var_hidden_size``), a weight of another dtype (``GemmaRMSNorm`` passes ``1 + w`` in float32),
layouts whose leading dimensions do not merge into two strided dimensions, and the like.

**Counting.** Every decision is counted by op and reason (:func:`routed_counts`,
:func:`fallback_counts`): once per call in eager mode, and once per traced call site when vLLM
compiles the model (the lowering pass decides IR ops at compile time; Dynamo decides CustomOps
at trace time; the compiled graph, and its CUDA-graph replays, then run that decision with no
Python). A warm vLLM compile cache skips the lowering pass, and with it the IR ops' counts.
:func:`routes` lists what was routed and why anything was not; :func:`report` is the same as
plain data (what ``benchmarks/bench_vllm_ab.py`` collects from vLLM's worker processes).

Nothing here imports vLLM until :func:`register` runs; importing this module needs torch.
"""

import dataclasses
import importlib
import inspect
import logging
import math
import threading

import torch
import torch._dynamo  # assume_constant_result: counting at trace time
from torch import Tensor

import loomnb

from ..checks import LoomnbValueError
from ..ops import _contract as C

__all__ = ["register", "routes", "report", "summary", "routed_counts", "fallback_counts",
           "reset_counts", "custom_op_mode", "custom_op_modes", "engine_kwargs",
           "rms_norm_fallback_reason", "silu_and_mul_fallback_reason",
           "rotary_embedding_fallback_reason", "loomnb_op", "Route", "PROVIDER", "CONFIGS", "OPS"]

PROVIDER = "loomnb"  # the vLLM IR provider name and the entry point's name
log = logging.getLogger("vllm.loomnb")  # under vLLM's logger, so vLLM's handler prints it
_OP = "loomnb.integrations.vllm"
_CUDA = "cuda"  # the device type the plug-in routes (the CPU tests route "cpu" through stubs)
ROUTED_DTYPES = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class Route:
    """One vLLM op and what :func:`register` did with it in this process.

    ``routed``: loomnb implements it here (it runs where ``enable`` selects it and the call's
    arguments pass the fallback check); ``reason``: why (not); ``enable``: the vLLM engine
    setting that selects loomnb's implementation.
    """

    vllm_op: str
    loomnb_op: str
    mechanism: str
    routed: bool
    reason: str
    enable: str


_LOCK = threading.RLock()
_STATE = {"registered": False, "vllm_version": None}
_ROUTES = {}     # vllm op -> Route
_ROUTED = {}     # op -> calls (or traced call sites) given to loomnb
_FALLBACKS = {}  # op -> {reason: count}
_MODES = {}      # CustomOp class name -> {"loomnb" | "vllm" | "native": instances}


# --------------------------------------------------------------------------------------------
# Counting
@torch._dynamo.assume_constant_result
def _note(op, reason):
    """Count one routing decision. Under Dynamo this runs once, at trace time, with the constant
    (op, reason) of that call site -- so counting adds nothing to the compiled graph."""
    with _LOCK:
        if reason is None:
            _ROUTED[op] = _ROUTED.get(op, 0) + 1
        else:
            per = _FALLBACKS.setdefault(op, {})
            per[reason] = per.get(reason, 0) + 1
    return True


def routed_counts():
    """``{op: n}``: decisions that gave a call to loomnb (per call in eager mode, per traced
    call site under torch.compile)."""
    with _LOCK:
        return dict(_ROUTED)


def fallback_counts():
    """``{op: {reason: n}}``: decisions that left a call to vLLM's implementation, by reason."""
    with _LOCK:
        return {op: dict(per) for op, per in _FALLBACKS.items()}


def custom_op_modes():
    """``{class name: {forward: n}}``: which forward each replaced CustomOp instance got when
    vLLM built the model -- ``"loomnb"``, ``"vllm"`` (vLLM's own CUDA op) or ``"native"``
    (vLLM's torch-native forward) -- from :func:`custom_op_mode` and the engine's
    ``custom_ops``. Kept across :func:`reset_counts` (they are decided once, at construction)."""
    with _LOCK:
        return {k: dict(v) for k, v in _MODES.items()}


def reset_counts():
    """Zero :func:`routed_counts` and :func:`fallback_counts` (the routes stay)."""
    with _LOCK:
        _ROUTED.clear()
        _FALLBACKS.clear()


# --------------------------------------------------------------------------------------------
# Fallback checks: metadata only, so they run on the fake tensors of vLLM's lowering pass and
# inside a Dynamo trace (where their string results are constants).
def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _device_dtype_reason(x):
    if x.device.type != _CUDA:
        return "not a CUDA tensor"
    if x.dtype not in ROUTED_DTYPES:
        return f"activation dtype {_dtype_name(x.dtype)} (routed: bfloat16, float16)"
    return None


class _Meta:
    """Shape and strides only: what the scaffold's row rule (``_contract.rows``) reads."""

    __slots__ = ("shape", "strides", "ndim")

    def __init__(self, shape, strides):
        self.shape, self.strides, self.ndim = tuple(shape), tuple(strides), len(shape)

    def view(self, shape, strides):
        return _Meta(shape, strides)


def _rows_reason(*named):
    """Whether loomnb's row rule takes these ``[..., n]`` tensors together (None: it does).

    The token dimension's size is read as 2: under torch.compile it is symbolic, and it never
    decides a merge (a merge compares a dimension's stride with the next one's stride times the
    next one's size). Treating a real size of 1 as 2 can only refuse more, never accept what
    loomnb would reject.
    """
    metas = []
    for name, t in named:
        if t is None:
            continue
        if t.dim() < 1:
            return f"{name} is 0-D"
        shape, strides = tuple(t.shape), tuple(t.stride())
        if len(shape) > 1:
            shape = (2,) + shape[1:]
        if not all(isinstance(v, int) for v in shape + strides):
            return "symbolic sizes or strides beyond the token dimension"
        if shape[-1] > 1 and strides[-1] != 1:
            return "last dimension not contiguous"
        metas.append((name, _Meta(shape, strides)))
    try:
        C.rows(_OP, metas)
    except LoomnbValueError:
        return "leading dimensions do not merge into two strided dimensions"
    return None


def rms_norm_fallback_reason(x, weight, epsilon, variance_size=None, x_residual=None):
    """Why loomnb does not take this ``vllm.ir.ops.rms_norm`` call (or ``fused_add_rms_norm``,
    with ``x_residual``), or None when it does.

    Metadata only (dtype, device, shapes, strides; never data or pointers). Routed: ``x`` (and
    ``x_residual``) bf16/fp16 CUDA tensors ``[..., hidden_size]`` with a contiguous last
    dimension whose leading dimensions merge into at most two strided ones; ``weight`` of the
    same dtype and device, ``[hidden_size]``, contiguous; ``epsilon`` finite and >= 0;
    ``variance_size`` None. ``x_residual``'s token dimension is assumed equal to ``x``'s (vLLM
    passes tensors of one shape; loomnb raises otherwise).
    """
    if variance_size is not None:
        return "variance_size set (var_hidden_size)"
    if weight is None:
        return "weight is None (has_weight=False)"
    reason = _device_dtype_reason(x)
    if reason is not None:
        return reason
    if weight.dtype != x.dtype:
        return "weight dtype differs from x (GemmaRMSNorm passes 1 + w in float32)"
    if weight.device != x.device:
        return "weight on another device than x"
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return "weight is not [hidden_size]"
    if weight.shape[0] > 1 and weight.stride(0) != 1:
        return "weight not contiguous"
    if x_residual is not None and (x_residual.dtype != x.dtype or x_residual.device != x.device
                                   or x_residual.dim() != x.dim()
                                   or tuple(x_residual.shape[1:]) != tuple(x.shape[1:])):
        return "x_residual dtype, device or shape differs from x"
    if (isinstance(epsilon, bool) or not isinstance(epsilon, (int, float))
            or not 0.0 <= epsilon < math.inf):
        return "epsilon is not a finite number >= 0"
    return _rows_reason(("x", x), ("x_residual", x_residual))


def silu_and_mul_fallback_reason(x):
    """Why loomnb does not take this ``SiluAndMul`` call (None: it does): routed are contiguous
    bf16/fp16 CUDA tensors ``[..., 2 * d]`` (vLLM passes the gate/up GEMM's output)."""
    reason = _device_dtype_reason(x)
    if reason is not None:
        return reason
    if x.dim() < 1 or x.shape[-1] % 2:
        return "last dimension is not even (x is not [..., 2 * d])"
    if not x.is_contiguous():
        return "x not contiguous"
    return None


def rotary_embedding_fallback_reason(positions, query, key, head_size, cos_sin_cache):
    """Why loomnb does not take this ``RotaryEmbedding`` call (None: it does).

    Routed: bf16/fp16 CUDA ``query`` and ``key`` of shape ``[num_tokens, num_heads *
    head_size]`` (any row stride: vLLM passes views of the fused QKV buffer) or ``[num_tokens,
    num_heads, head_size]`` with contiguous heads, the key's heads dividing the query's; int64
    ``positions`` ``[num_tokens]``; a
    contiguous ``cos_sin_cache`` ``[max_position, rot_dim]`` of the query's dtype with an even
    ``rot_dim <= head_size``.
    """
    reason = _device_dtype_reason(query)
    if reason is not None:
        return reason
    if key is None:
        return "key is None (the out-of-place form rotates a query and a key)"
    if key.dtype != query.dtype or key.device != query.device:
        return "key dtype or device differs from query"
    if positions.dtype != torch.int64 or positions.device != query.device:
        return "positions is not int64 on the query's device"
    if positions.dim() != 1:
        return "positions is not [num_tokens]"
    if (cos_sin_cache.dtype != query.dtype or cos_sin_cache.device != query.device
            or cos_sin_cache.dim() != 2 or not cos_sin_cache.is_contiguous()):
        return "cos_sin_cache is not a contiguous 2-D array of the query's dtype and device"
    if cos_sin_cache.shape[1] % 2 or cos_sin_cache.shape[1] > head_size:
        return "rot_dim (cos_sin_cache.size(1)) is odd or larger than head_size"
    for name, t in (("query", query), ("key", key)):
        if t.dim() == 2:
            ok = t.shape[1] % head_size == 0 and t.stride(1) == 1
        elif t.dim() == 3:
            ok = t.shape[2] == head_size and t.stride(2) == 1 and t.stride(1) == head_size
        else:
            ok = False
        if not ok:
            return (f"{name} is not [num_tokens, num_heads * head_size] or [num_tokens, "
                    "num_heads, head_size] with contiguous heads")
    heads = [t.shape[1] // head_size if t.dim() == 2 else t.shape[1] for t in (query, key)]
    if heads[1] == 0 or heads[0] % heads[1]:
        return "the key's heads do not divide the query's"
    return None


# --------------------------------------------------------------------------------------------
# The IR implementations. Their annotated signatures are vLLM 0.24.0's native ones exactly
# (vllm/ir/ops/layernorm.py): vLLM compares the inferred schemas before registering.
try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # pragma: no cover - present in every torch loomnb supports
    def _get_current_dispatch_mode():
        return True  # unknown: always take the torch.ops path, which is right everywhere


def _direct(x):
    """Call loomnb's Python op directly (eager, real tensors: no dispatcher hop) rather than its
    ``torch.ops.loomnb`` twin, which anything tracing needs: Dynamo, and the ``make_fx`` trace
    of vLLM's lowering pass, which passes fake tensors under a dispatch mode."""
    return (type(x) is torch.Tensor and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None)


def ir_rms_norm(x: Tensor, weight: Tensor | None, epsilon: float,
                variance_size: int | None = None) -> Tensor:
    """vLLM IR provider ``loomnb`` for ``vllm.ir.ops.rms_norm``: ``loomnb.rms_norm(x, weight,
    epsilon, rounding="once")``, a new ``[..., hidden_size]`` tensor of ``x``'s dtype.

    Only called where :func:`rms_norm_fallback_reason` is None (so ``weight`` is a tensor and
    ``variance_size`` None). Differs from vLLM's ``vllm_c`` provider only in ``inv`` (float64
    evaluation, rounded once to float32, against ``rsqrtf`` of a float32 block reduction).
    """
    if _direct(x):
        return loomnb.rms_norm(x, weight, epsilon, rounding="once")
    return torch.ops.loomnb.rms_norm(x, weight, epsilon, rounding="once")


def ir_fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                          variance_size: int | None = None) -> tuple[Tensor, Tensor]:
    """vLLM IR provider ``loomnb`` (registered ``inplace=True``) for
    ``vllm.ir.ops.fused_add_rms_norm``: ``loomnb.fused_add_rms_norm(x, x_residual, weight,
    epsilon, rounding="once")``.

    Mutates ``x_residual <- r(x + x_residual)`` and ``x <- rms_norm(x_residual)`` (normalising
    the rounded sum, as vLLM's CUDA op does; vLLM's native form normalises the float32 sum) and
    returns ``(x, x_residual)``. vLLM clones both first where it needs a functional result.
    """
    if _direct(x):
        loomnb.fused_add_rms_norm(x, x_residual, weight, epsilon, rounding="once")
    else:
        torch.ops.loomnb.fused_add_rms_norm(x, x_residual, weight, epsilon, rounding="once")
    return x, x_residual


def ir_rms_norm_supported(x, weight, epsilon, variance_size=None):
    """``supports_args`` of :func:`ir_rms_norm` (vLLM requires the native parameter names and
    defaults): counts the decision and says whether loomnb takes the call."""
    reason = rms_norm_fallback_reason(x, weight, epsilon, variance_size)
    _note("rms_norm", reason)
    return reason is None


def ir_fused_add_rms_norm_supported(x, x_residual, weight, epsilon, variance_size=None):
    """``supports_args`` of :func:`ir_fused_add_rms_norm`."""
    reason = rms_norm_fallback_reason(x, weight, epsilon, variance_size, x_residual)
    _note("fused_add_rms_norm", reason)
    return reason is None


# vllm.ir op -> (implementation, supports_args, inplace, loomnb op)
IR_OPS = {
    "rms_norm": (ir_rms_norm, ir_rms_norm_supported, False, "rms_norm"),
    "fused_add_rms_norm": (ir_fused_add_rms_norm, ir_fused_add_rms_norm_supported, True,
                           "fused_add_rms_norm"),
}


# --------------------------------------------------------------------------------------------
# The CustomOp replacements (classes made when vLLM is there: each factory in CUSTOM_OPS gets
# vLLM's class wrapped by _selectable, and subclasses that).
def custom_op_mode(custom_ops, cls_name, vllm_name):
    """Which forward vLLM's CustomOp runs once the plug-in has replaced it: ``"loomnb"``,
    ``"vllm"`` (vLLM's own CUDA op) or ``None`` (disabled: vLLM's torch-native forward, which
    Inductor compiles), from ``compilation_config.custom_ops`` (a list holding ``"none"`` or
    ``"all"`` and ``"+name"`` / ``"-name"`` switches).

    vLLM enables an out-of-tree class by its class name (``cls_name``, e.g. ``"SiluAndMul"``) and
    never by the in-tree op's registered name (``vllm_name``, e.g. ``"silu_and_mul"``), so a
    replacement that only followed vLLM's rule would turn ``"+silu_and_mul"`` -- vLLM's own CUDA
    op -- into the torch-native forward. The rule here: a ``"-"`` of either name disables;
    ``"+cls_name"`` selects loomnb; ``"+vllm_name"`` vLLM's op; otherwise ``"all"`` selects
    loomnb and ``"none"`` disables."""
    if f"-{cls_name}" in custom_ops or f"-{vllm_name}" in custom_ops:
        return None
    if f"+{cls_name}" in custom_ops:
        return "loomnb"
    if f"+{vllm_name}" in custom_ops:
        return "vllm"
    return "loomnb" if "all" in custom_ops else None


def _selectable(base, cls_name, vllm_name):
    """A subclass of vLLM's CustomOp ``base`` that follows :func:`custom_op_mode`: ``enabled()``
    says whether either CUDA forward runs, and ``self._loomnb_on`` (set when vLLM picks the
    forward, at construction) whether it is loomnb's."""
    from vllm.config import get_cached_compilation_config

    class Selectable(base):
        @classmethod
        def _mode(cls):
            return custom_op_mode(get_cached_compilation_config().custom_ops, cls_name, vllm_name)

        @classmethod
        def enabled(cls):
            return cls._mode() is not None

        def dispatch_forward(self, *args, **kwargs):
            mode = type(self)._mode()
            self._loomnb_on = mode == "loomnb"
            if mode is None:  # vLLM may still force its device forward (enforce_enable)
                mode = "vllm" if getattr(self, "_enforce_enable", False) else "native"
            with _LOCK:
                per = _MODES.setdefault(cls_name, {})
                per[mode] = per.get(mode, 0) + 1
            return super().dispatch_forward(*args, **kwargs)

    return Selectable


def _silu_class(base):
    class LoomnbSiluAndMul(base):
        """vLLM's ``SiluAndMul`` whose CUDA forward is ``loomnb.silu_and_mul(x)`` (vLLM's own
        ``forward_cuda`` where :func:`silu_and_mul_fallback_reason` gives a reason)."""

        _loomnb = True

        def forward_cuda(self, x):
            if not getattr(self, "_loomnb_on", True):  # "+silu_and_mul": vLLM's own op
                return super().forward_cuda(x)
            reason = silu_and_mul_fallback_reason(x)
            _note("silu_and_mul", reason)
            if reason is None:
                return loomnb.silu_and_mul(x)
            return super().forward_cuda(x)

    return LoomnbSiluAndMul


def _rope_class(base):
    class LoomnbRotaryEmbedding(base):
        """vLLM's ``RotaryEmbedding`` whose CUDA forward is
        ``loomnb.apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache,
        is_neox)``, returning new rotated tensors (vLLM's own ``forward_cuda``, in place, where
        :func:`rotary_embedding_fallback_reason` gives a reason)."""

        _loomnb = True

        def forward_cuda(self, positions, query, key=None):
            if not getattr(self, "_loomnb_on", True):  # "+rotary_embedding": vLLM's own op
                return super().forward_cuda(positions, query, key)
            if getattr(self, "use_flashinfer", False):
                reason = "vLLM selected its FlashInfer rotary path"
            else:
                cache = self._match_cos_sin_cache_dtype(query)
                reason = rotary_embedding_fallback_reason(positions, query, key, self.head_size,
                                                          cache)
            _note("rotary_embedding", reason)
            if reason is None:
                return loomnb.apply_rope_with_cos_sin_cache(positions, query, key,
                                                            self.head_size, cache,
                                                            self.is_neox_style)
            return super().forward_cuda(positions, query, key)

    return LoomnbRotaryEmbedding


# vLLM CustomOp class -> (its module, vLLM's registered name, loomnb op, the loomnb op's leading
# parameters this plug-in passes positionally, class factory)
CUSTOM_OPS = {
    "SiluAndMul": ("vllm.model_executor.layers.activation", "silu_and_mul", "silu_and_mul",
                   ("x",), _silu_class),
    "RotaryEmbedding": ("vllm.model_executor.layers.rotary_embedding.base", "rotary_embedding",
                        "apply_rope_with_cos_sin_cache",
                        ("positions", "query", "key", "head_size", "cos_sin_cache", "is_neox"),
                        _rope_class),
}


def loomnb_op(name, params):
    """``(loomnb.<name>, None)`` when this loomnb has the op with the leading parameters the
    plug-in passes and a torch custom op for torch.compile, else ``(None, why not)``."""
    fn = getattr(loomnb, name, None)
    if fn is None:
        return None, f"loomnb has no {name} in this version"
    try:
        got = tuple(inspect.signature(fn).parameters)[:len(params)]
    except (TypeError, ValueError):
        got = ()
    if got != tuple(params):
        return None, (f"loomnb.{name}'s leading parameters {got} are not ({', '.join(params)}), "
                      "which this plug-in passes")
    if getattr(fn, "traced", None) is None:
        return None, f"loomnb.{name} has no torch custom op (torch.compile could not trace it)"
    return fn, None


# --------------------------------------------------------------------------------------------
# Registration
def _ir_enable(name):
    return f"ir_op_priority={{'{name}': ['loomnb', 'vllm_c', 'native']}}"


def _oot_enable(cls_name, vllm_name):
    return (f"compilation_config={{'custom_ops': ['none', '+{cls_name}']}} (the class name; "
            f"'+{vllm_name}' selects vLLM's own CUDA op)")


def _route(vllm_op, loomnb_name, mechanism, routed, reason, enable):
    _ROUTES[vllm_op] = Route(vllm_op, loomnb_name, mechanism, routed, reason, enable)


def _schema_mismatch(ir_op, impl, supports):
    """None when ``impl``'s inferred schema and ``supports``'s parameter names and defaults equal
    the live native implementation's (what vLLM 0.24's ``IrOpImpl`` checks), else the difference."""
    from torch.library import infer_schema
    native = ir_op.impls["native"].impl_fn
    want, got = infer_schema(native, mutates_args=[]), infer_schema(impl, mutates_args=[])
    if want != got:
        return f"schema {got} differs from this vLLM's native {want}"
    want_p = [(p.name, p.default) for p in inspect.signature(native).parameters.values()]
    got_p = [(p.name, p.default) for p in inspect.signature(supports).parameters.values()]
    if want_p != got_p:
        return f"supports_args parameters {got_p} differ from the native {want_p}"
    return None


def _platform():
    """(is CUDA, a description) of vLLM's current platform."""
    from vllm.platforms import current_platform
    is_cuda = bool(current_platform.is_cuda())
    return is_cuda, f"vLLM's platform is {type(current_platform).__name__}, not CUDA"


def _register_ir(ir, name):
    impl, supports, inplace, loomnb_name = IR_OPS[name]
    label = f"loomnb.{loomnb_name}(..., rounding='once')"
    mech = f"vLLM IR provider '{PROVIDER}'" + (" (inplace)" if inplace else "")
    vllm_op = f"vllm.ir.ops.{name}"

    def route(ok, why):
        return _route(vllm_op, label, mech, ok, why, _ir_enable(name))

    op = getattr(ir.ops, name, None)
    if op is None:
        return route(False, f"this vLLM has no vllm.ir.ops.{name}")
    existing = op.impls.get(PROVIDER)
    if existing is not None:  # a second register() in one process, or another package's provider
        if existing.impl_fn is impl:
            return route(bool(existing.supported), "registered" if existing.supported
                         else "registered unsupported on this platform")
        return route(False, f"provider '{PROVIDER}' is already registered by "
                            f"{getattr(existing.impl_fn, '__module__', '?')}")
    why = (None if hasattr(torch.ops.loomnb, loomnb_name)
           else f"torch.ops.loomnb.{loomnb_name} is not registered")
    why = why or _schema_mismatch(op, impl, supports)
    if why is not None:
        # A placeholder marked unsupported: a priority list naming 'loomnb' then falls through
        # to the next provider instead of failing vLLM's check that every listed provider exists.
        op.register_impl(PROVIDER, supported=False)(op.impls["native"].impl_fn)
        log.warning("loomnb plug-in: %s not routed: %s", vllm_op, why)
        return route(False, why + " (registered as an unsupported placeholder: priority lists "
                                  "naming 'loomnb' fall through to the next provider)")
    is_cuda, not_cuda = _platform()
    op.register_impl(PROVIDER, supported=is_cuda, supports_args=supports, inplace=inplace)(impl)
    return route(is_cuda, "registered" if is_cuda else not_cuda)


def _register_oot(cls_name):
    module, vllm_name, loomnb_name, params, factory = CUSTOM_OPS[cls_name]
    label = f"loomnb.{loomnb_name}({', '.join(params)})"

    def route(ok, why):
        return _route(cls_name, label, f"{cls_name}.register_oot", ok, why,
                      _oot_enable(cls_name, vllm_name))

    _, why = loomnb_op(loomnb_name, params)
    if why is not None:
        return route(False, why)
    try:
        base = getattr(importlib.import_module(module), cls_name)
        from vllm.model_executor.custom_op import op_registry_oot
    except Exception as e:  # noqa: BLE001 - any vLLM layout this plug-in does not know
        return route(False, f"this vLLM has no {module}.{cls_name} ({type(e).__name__}: {e})")
    current = op_registry_oot.get(cls_name)
    if current is not None:
        if getattr(current, "_loomnb", False):
            return route(True, "registered")
        return route(False, f"another plug-in already replaced {cls_name} "
                            f"({current.__module__}.{current.__qualname__})")
    base.register_oot(factory(_selectable(base, cls_name, vllm_name)))
    return route(True, "registered")


def register():
    """vLLM's general-plug-in entry point (``vllm.general_plugins: loomnb``): register loomnb's
    implementations with vLLM. Idempotent (vLLM calls it once per process; a later call in the
    same process does nothing) and never raises: whatever cannot be routed is recorded in
    :func:`routes` with the reason, logged, and left to vLLM."""
    with _LOCK:
        if _STATE["registered"]:
            return
        _STATE["registered"] = True
        try:
            import vllm
            import vllm.ir as ir
            _STATE["vllm_version"] = getattr(vllm, "__version__", "unknown")
        except Exception as e:  # noqa: BLE001
            why = f"vLLM is not importable ({type(e).__name__}: {e})"
            for name in IR_OPS:
                _route(f"vllm.ir.ops.{name}", f"loomnb.{name}(..., rounding='once')",
                       f"vLLM IR provider '{PROVIDER}'", False, why, _ir_enable(name))
            for cls_name, (_, vllm_name, loomnb_name, params, _) in CUSTOM_OPS.items():
                _route(cls_name, f"loomnb.{loomnb_name}({', '.join(params)})",
                       f"{cls_name}.register_oot", False, why, _oot_enable(cls_name, vllm_name))
            log.warning("loomnb plug-in: %s", why)
            return
        for name in IR_OPS:
            try:
                _register_ir(ir, name)
            except Exception as e:  # noqa: BLE001 - a vLLM this plug-in was not written for
                _route(f"vllm.ir.ops.{name}", f"loomnb.{name}(..., rounding='once')",
                       f"vLLM IR provider '{PROVIDER}'", False,
                       f"registration failed ({type(e).__name__}: {e})", _ir_enable(name))
        for cls_name in CUSTOM_OPS:
            try:
                _register_oot(cls_name)
            except Exception as e:  # noqa: BLE001
                _, vllm_name, loomnb_name, params, _ = CUSTOM_OPS[cls_name]
                _route(cls_name, f"loomnb.{loomnb_name}({', '.join(params)})",
                       f"{cls_name}.register_oot", False,
                       f"registration failed ({type(e).__name__}: {e})",
                       _oot_enable(cls_name, vllm_name))
        log.info("loomnb plug-in (vLLM %s): %s", _STATE["vllm_version"], "; ".join(
            f"{r.vllm_op}: " + ("routed" if r.routed else f"not routed ({r.reason})")
            for r in routes()))


def routes():
    """What this process's :func:`register` did, one :class:`Route` per vLLM op, in a fixed
    order. Before :func:`register` has run, every op is listed as not routed, saying so."""
    with _LOCK:
        if not _STATE["registered"]:
            why = "register() has not run in this process (vLLM runs it when it starts)"
            out = [Route(f"vllm.ir.ops.{n}", f"loomnb.{n}(..., rounding='once')",
                         f"vLLM IR provider '{PROVIDER}'", False, why, _ir_enable(n))
                   for n in IR_OPS]
            out += [Route(c, f"loomnb.{spec[2]}({', '.join(spec[3])})", f"{c}.register_oot", False,
                          why, _oot_enable(c, spec[1])) for c, spec in CUSTOM_OPS.items()]
            return out
        order = [f"vllm.ir.ops.{n}" for n in IR_OPS] + list(CUSTOM_OPS)
        return [_ROUTES[k] for k in order if k in _ROUTES]


def report():
    """Routes and counts as plain data (JSON-ready)."""
    return {"plugin": _OP, "loomnb_version": loomnb.__version__,
            "vllm_version": _STATE["vllm_version"], "registered": _STATE["registered"],
            "routes": [dataclasses.asdict(r) for r in routes()],
            "routed_counts": routed_counts(), "fallback_counts": fallback_counts(),
            "custom_op_modes": custom_op_modes()}


def _where() -> str:
    """Which vLLM the plug-in runs in: the one that registered it, else the installed one."""
    if _STATE["vllm_version"] is not None:
        return f"in vLLM {_STATE['vllm_version']}"
    import importlib.metadata

    try:
        installed = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "(vLLM is not installed here)"
    return f"beside vLLM {installed} (not registered by vLLM in this process)"


def summary():
    """:func:`report` as text, one line per route and per count."""
    rep = report()
    lines = [f"loomnb {rep['loomnb_version']} {_where()}:"]
    for r in rep["routes"]:
        state = "routed" if r["routed"] else "NOT routed"
        lines.append(f"  {r['vllm_op']} -> {r['loomnb_op']} via {r['mechanism']}: {state} "
                     f"({r['reason']}); enable with {r['enable']}")
    for op, n in sorted(rep["routed_counts"].items()):
        lines.append(f"  {op}: {n} decision(s) routed to loomnb")
    for op, per in sorted(rep["fallback_counts"].items()):
        for reason, n in sorted(per.items()):
            lines.append(f"  {op}: {n} decision(s) left to vLLM: {reason}")
    for cls_name, per in sorted(rep["custom_op_modes"].items()):
        lines.append(f"  {cls_name} instances by forward: " +
                     ", ".join(f"{mode} {n}" for mode, n in sorted(per.items())))
    return "\n".join(lines)


CONFIGS = ("default", "vllm_ops", "loomnb")
OPS = (*IR_OPS, *CUSTOM_OPS)  # what engine_kwargs(ops=...) can give to loomnb


def engine_kwargs(config="loomnb", *, ops=None):
    """Keyword arguments for ``vllm.LLM(...)`` (or ``EngineArgs``) selecting one configuration.

    * ``"default"``: ``{}`` -- vLLM 0.24's default: torch.compile with Inductor generating the
      norms', SiLU-and-mul's and RoPE's kernels from their torch-native forms.
    * ``"vllm_ops"``: vLLM's own CUDA ops -- IR priority ``vllm_c`` for both norms and
      ``custom_ops ["none", "+silu_and_mul", "+rotary_embedding"]``.
    * ``"loomnb"``: as ``"vllm_ops"`` with loomnb first -- IR priority ``["loomnb", "vllm_c",
      "native"]``, and ``"+SiluAndMul"`` / ``"+RotaryEmbedding"`` for the ops this loomnb has
      (:func:`loomnb_op`), vLLM's own op for the others. The plug-in must be loaded
      (the installed entry point, or ``VLLM_PLUGINS=loomnb``).

    ``ops`` (``"loomnb"`` only): the vLLM ops given to loomnb, a subset of :data:`OPS`
    (``"rms_norm"``, ``"fused_add_rms_norm"``, ``"SiluAndMul"``, ``"RotaryEmbedding"``); the
    others take vLLM's own CUDA op, as in ``"vllm_ops"``. Default: all of them. One op at a
    time is how an engine-level difference is traced to an op.

    Merge ``compilation_config`` with your own settings if you pass any.
    """
    if config not in CONFIGS:
        raise LoomnbValueError(f"{_OP}.engine_kwargs: argument 'config' must be one of "
                               f"{', '.join(map(repr, CONFIGS))}; got {config!r}")
    if ops is not None:
        ops = tuple(ops) if not isinstance(ops, str) else (ops,)
        unknown = [o for o in ops if o not in OPS]
        if unknown or config != "loomnb":
            raise LoomnbValueError(
                f"{_OP}.engine_kwargs: argument 'ops' must be a subset of {', '.join(OPS)} with "
                f"config='loomnb'; got {ops!r} with config={config!r}")
    if config == "default":
        return {}
    ours = set(OPS if ops is None else ops) if config == "loomnb" else set()
    custom = ["none"]
    for cls_name, (_, vllm_name, loomnb_name, params, _) in CUSTOM_OPS.items():
        mine = cls_name in ours and loomnb_op(loomnb_name, params)[0] is not None
        custom.append(f"+{cls_name}" if mine else f"+{vllm_name}")
    return {"ir_op_priority": {name: ([PROVIDER] if name in ours else []) + ["vllm_c", "native"]
                               for name in IR_OPS},
            "compilation_config": {"custom_ops": custom}}


def _reset():
    """Forget registration, routes and counts (tests only: vLLM's own registries are not undone)."""
    with _LOCK:
        _STATE.update(registered=False, vllm_version=None)
        _ROUTES.clear()
        _MODES.clear()
        reset_counts()
