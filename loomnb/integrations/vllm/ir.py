"""The vLLM IR implementations: provider ``"loomnb"`` of ``vllm.ir.ops.rms_norm`` and
``vllm.ir.ops.fused_add_rms_norm`` (``model_executor/layers/layernorm.py`` calls them, and
``fused_add_rms_norm.maybe_inplace``).

Their annotated signatures are vLLM 0.24.0's native ones exactly (``vllm/ir/ops/layernorm.py``):
vLLM infers a torch schema from each and refuses a registration whose schema differs from the
native one (``vllm/ir/op.py``, ``IrOpImpl.__init__``); ``supports_args`` must have the native
parameter names and defaults. ``tests/test_vllm_plugin.py`` holds a copy of the native
signatures. Under torch.compile vLLM's lowering pass traces the selected implementation with
fake tensors, so it calls ``torch.ops.loomnb.<op>``: the compiled graph holds one loomnb node per
norm (CUDA-graph capture included). ``rounding="once"`` is the rounding of vLLM 0.24.0's compiled
``rms_norm``/``fused_add_rms_norm`` (``docs/numerics.md``).
"""

import torch
from torch import Tensor

import loomnb
import loomnb.ops.norm  # noqa: F401 - registers torch.ops.loomnb.rms_norm / fused_add_rms_norm

from .counts import note
from .fallbacks import rms_norm_fallback_reason

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
    note("rms_norm", reason)
    return reason is None


def ir_fused_add_rms_norm_supported(x, x_residual, weight, epsilon, variance_size=None):
    """``supports_args`` of :func:`ir_fused_add_rms_norm`."""
    reason = rms_norm_fallback_reason(x, weight, epsilon, variance_size, x_residual)
    note("fused_add_rms_norm", reason)
    return reason is None


# vllm.ir op -> (implementation, supports_args, inplace, loomnb op)
IR_OPS = {
    "rms_norm": (ir_rms_norm, ir_rms_norm_supported, False, "rms_norm"),
    "fused_add_rms_norm": (ir_fused_add_rms_norm, ir_fused_add_rms_norm_supported, True,
                           "fused_add_rms_norm"),
}
