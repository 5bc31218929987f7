"""The plug-in's counters: every routing decision by op and reason, and the forward each replaced
CustomOp instance got.

Decisions are counted once per call in eager mode and once per traced call site when vLLM
compiles the model (the lowering pass decides IR ops at compile time; Dynamo decides CustomOps
at trace time; the compiled graph, and its CUDA-graph replays, then run that decision with no
Python). A warm vLLM compile cache skips the lowering pass, and with it the IR ops' counts.
"""

import threading

import torch
import torch._dynamo  # assume_constant_result: counting at trace time

__all__ = ["routed_counts", "fallback_counts", "custom_op_modes", "reset_counts"]

LOCK = threading.RLock()  # also guards registration's records (registration.py)
_ROUTED = {}     # op -> calls (or traced call sites) given to loomnb
_FALLBACKS = {}  # op -> {reason: count}
_MODES = {}      # CustomOp class name -> {"loomnb" | "vllm" | "native": instances}


@torch._dynamo.assume_constant_result
def note(op, reason):
    """Count one routing decision. Under Dynamo this runs once, at trace time, with the constant
    (op, reason) of that call site -- so counting adds nothing to the compiled graph."""
    with LOCK:
        if reason is None:
            _ROUTED[op] = _ROUTED.get(op, 0) + 1
        else:
            per = _FALLBACKS.setdefault(op, {})
            per[reason] = per.get(reason, 0) + 1
    return True


def note_mode(cls_name, mode):
    """Count one instance of a replaced CustomOp built with forward ``mode``."""
    with LOCK:
        per = _MODES.setdefault(cls_name, {})
        per[mode] = per.get(mode, 0) + 1


def routed_counts():
    """``{op: n}``: decisions that gave a call to loomnb (per call in eager mode, per traced
    call site under torch.compile)."""
    with LOCK:
        return dict(_ROUTED)


def fallback_counts():
    """``{op: {reason: n}}``: decisions that left a call to vLLM's implementation, by reason."""
    with LOCK:
        return {op: dict(per) for op, per in _FALLBACKS.items()}


def custom_op_modes():
    """``{class name: {forward: n}}``: which forward each replaced CustomOp instance got when
    vLLM built the model -- ``"loomnb"``, ``"vllm"`` (vLLM's own CUDA op) or ``"native"``
    (vLLM's torch-native forward) -- from ``custom_op_mode`` and the engine's ``custom_ops``.
    Kept across :func:`reset_counts` (they are decided once, at construction)."""
    with LOCK:
        return {k: dict(v) for k, v in _MODES.items()}


def reset_counts():
    """Zero :func:`routed_counts` and :func:`fallback_counts` (the routes stay)."""
    with LOCK:
        _ROUTED.clear()
        _FALLBACKS.clear()


def _reset_modes():
    with LOCK:
        _MODES.clear()
