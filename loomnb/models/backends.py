"""Ops backends: the operators of the decode loop that loomnb can replace.

A backend has ``name``, ``loomnb_ops`` (names of the ops it runs through loomnb) and

* ``rms_norm(x, weight, eps) -> y`` (new tensor),
* ``fused_add_rms_norm(x, residual, weight, eps) -> (x, residual)``, in place:
  ``residual <- round(x + residual)`` (one rounding to the activation dtype) and
  ``x <- rms_norm(residual)``; returns the two mutated tensors.

``x``/``residual`` are contiguous ``[num_tokens, hidden_size]`` and ``weight`` is
``[hidden_size]``, all in the activation dtype (bf16 or fp32). Rounding points (vLLM's CUDA
kernels): the normalised value rounded to the activation dtype, then one rounding of
``normalised * weight``; ``inv = r32(1 / sqrt(sum(x^2) / H + eps))`` evaluated in float64, as
loomnb's kernels and oracles do (see ``loomnb.ops._norm_kernels.inv_rms``), so every backend
gives the same bits and greedy tokens can be compared exactly.
"""

from __future__ import annotations

import numpy as np
import torch

BACKENDS = ("loomnb-cuda", "loomnb-cpu", "torch-reference")
NORM_OPS = ("rms_norm", "fused_add_rms_norm")


class TorchReferenceOps:
    """Pure torch, same rounding points as the loomnb kernels (vLLM's ``forward_native``
    except that the fused add rounds the sum before normalising, like the CUDA kernel)."""

    name = "torch-reference"
    loomnb_ops: tuple[str, ...] = ()

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        ss = xf.double().pow(2).sum(-1, keepdim=True)
        eps64 = float(np.float32(eps))  # eps is a float32 in the kernels, as in vLLM
        inv = (1.0 / torch.sqrt(ss / x.shape[-1] + eps64)).float()
        n = (xf * inv).to(x.dtype)
        return n * weight

    @classmethod
    def fused_add_rms_norm(cls, x, residual, weight, eps):
        z = x + residual  # one rounding to the activation dtype
        residual.copy_(z)
        x.copy_(cls.rms_norm(z, weight, eps))
        return x, residual


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy NumPy view of a contiguous CPU tensor (bf16 as ``ml_dtypes.bfloat16``)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("loomnb-cpu backend needs contiguous CPU tensors")
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _to_torch(a: np.ndarray) -> torch.Tensor:
    """Zero-copy torch view of a NumPy array (``ml_dtypes.bfloat16`` -> ``torch.bfloat16``)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class LoomnbCpuOps:
    """The loomnb NumPy oracles (``loomnb.oracle``) on zero-copy views of CPU tensors."""

    name = "loomnb-cpu"
    loomnb_ops = NORM_OPS

    def __init__(self):
        from loomnb import oracle  # lazy: the package core may be absent at import time

        self._oracle = oracle

    def rms_norm(self, x, weight, eps):
        y = self._oracle.rms_norm(_to_numpy(x), _to_numpy(weight), eps)
        return _to_torch(np.ascontiguousarray(y))

    def fused_add_rms_norm(self, x, residual, weight, eps):
        xn, rn = _to_numpy(x), _to_numpy(residual)
        xo, ro = self._oracle.fused_add_rms_norm(xn, rn, _to_numpy(weight), eps)
        # The oracle mutates its inputs (hence x, residual); copy back only if it did not.
        if not np.shares_memory(xo, xn):
            xn[...] = xo
        if not np.shares_memory(ro, rn):
            rn[...] = ro
        return x, residual


class LoomnbCudaOps:
    """The loomnb Numba-CUDA kernels on torch CUDA tensors."""

    name = "loomnb-cuda"
    loomnb_ops = NORM_OPS

    def __init__(self):
        import loomnb  # lazy, see LoomnbCpuOps

        self._rms_norm = loomnb.rms_norm
        self._fused_add_rms_norm = loomnb.fused_add_rms_norm

    def rms_norm(self, x, weight, eps):
        return self._rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        self._fused_add_rms_norm(x, residual, weight, eps)
        return x, residual


def default_backend(device: torch.device | str) -> str:
    return "loomnb-cuda" if torch.device(device).type == "cuda" else "loomnb-cpu"


def get_backend(name: str | None = None, device: torch.device | str = "cpu"):
    """Instantiate a backend by name (``None``: loomnb-cuda on cuda, loomnb-cpu on cpu)."""
    name = name or default_backend(device)
    if name == "torch-reference":
        return TorchReferenceOps()
    if name == "loomnb-cpu":
        if torch.device(device).type != "cpu":
            raise ValueError("loomnb-cpu runs on CPU tensors; use --device cpu")
        return LoomnbCpuOps()
    if name == "loomnb-cuda":
        if torch.device(device).type != "cuda":
            raise ValueError("loomnb-cuda runs on CUDA tensors; use --device cuda")
        return LoomnbCudaOps()
    raise ValueError(f"unknown backend {name!r}; choose from {BACKENDS}")
