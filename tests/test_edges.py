"""Errors at the edges of the library say what to do, and the CPU references take what a torch
user has: ``torch.ops.loomnb.*`` on CPU tensors is a ``LoomnbTypeError`` pointing to the GPU or
the oracle (not torch's ``NotImplementedError`` listing every dispatch key), and
``loomnb.oracle.<name>`` takes torch CPU tensors (bf16 and FP8 included) as NumPy views."""

import ml_dtypes
import numpy as np
import pytest
import torch

import loomnb
import loomnb.oracle as oracle
from loomnb import LoomnbTypeError

pytestmark = pytest.mark.nosim


def bf16(t):
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


@pytest.fixture
def xw():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(3, 24, generator=g).to(torch.bfloat16),
            torch.randn(24, generator=g).to(torch.bfloat16))


@pytest.mark.parametrize("form", ["functional", "out"])
def test_torch_ops_on_cpu_tensors_say_they_need_cuda(xw, form):
    x, w = xw
    op = torch.ops.loomnb.rms_norm
    with pytest.raises(LoomnbTypeError, match=r"torch.ops.loomnb.rms_norm: loomnb's torch ops "
                                              r"run on CUDA tensors, and got CPU tensors.*"
                                              r"loomnb.oracle.rms_norm"):
        op(x, w, 1e-6) if form == "functional" else op.out(x, w, 1e-6, out=torch.empty_like(x))


def test_every_torch_op_has_the_cpu_message():
    from loomnb.ops._torch_ops import REGISTERED

    assert "rms_norm" in REGISTERED and set(REGISTERED) <= set(loomnb.ops.OPS)
    for name in REGISTERED:
        packet = getattr(torch.ops.loomnb, name)
        for overload in packet.overloads():
            assert torch._C._dispatch_has_kernel_for_dispatch_key(
                getattr(packet, overload).name(), "CPU"), (name, overload)


def test_oracles_take_torch_bf16_cpu_tensors(xw):
    x, w = xw
    got = oracle.rms_norm(x, w, 1e-6)
    want = oracle.rms_norm(bf16(x), bf16(w), 1e-6)
    assert isinstance(got, np.ndarray) and got.dtype == ml_dtypes.bfloat16
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    # keyword arguments, a non-contiguous view, float32
    xt = torch.randn(24, 3).to(torch.bfloat16)
    assert np.array_equal(oracle.rms_norm(x=xt.T, weight=w, eps=1e-6).view(np.uint16),
                          oracle.rms_norm(bf16(xt.T.contiguous()), bf16(w), 1e-6).view(np.uint16))
    assert oracle.silu_and_mul(torch.randn(2, 8)).dtype == np.float32


def test_oracles_mutate_torch_inputs_in_place_and_take_fp8(xw):
    x, w = xw
    r = torch.randn(3, 24).to(torch.bfloat16)
    xn, rn = bf16(x.clone()).copy(), bf16(r.clone()).copy()
    oracle.fused_add_rms_norm(x, r, w, 1e-6)  # x <- norm(x + r), r <- x + r, in the tensors
    oracle.fused_add_rms_norm(xn, rn, bf16(w), 1e-6)
    assert np.array_equal(bf16(x).view(np.uint16), xn.view(np.uint16))
    assert np.array_equal(bf16(r).view(np.uint16), rn.view(np.uint16))
    codes = oracle.static_scaled_fp8_quant(x, torch.tensor([0.05]))
    assert codes.dtype == ml_dtypes.float8_e4m3fn
    fp8 = torch.from_numpy(codes.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    back = oracle.scaled_fp8_dequant(fp8, torch.tensor([0.05]), np.float32)
    want = oracle.scaled_fp8_dequant(codes, np.array([0.05], np.float32), np.float32)
    assert np.array_equal(np.asarray(back), np.asarray(want))


def test_oracles_reject_tensors_off_the_cpu(xw):
    x, w = xw
    with pytest.raises(LoomnbTypeError, match=r"loomnb.oracle.rms_norm: the oracles take NumPy "
                                              r"arrays or CPU tensors; got a tensor on meta"):
        oracle.rms_norm(x.to("meta"), w, 1e-6)


def test_oracle_signatures_and_names_are_the_families():
    import inspect

    from loomnb.oracle import norm

    assert inspect.signature(oracle.rms_norm) == inspect.signature(norm.rms_norm)
    assert oracle.rms_norm.__doc__ == norm.rms_norm.__doc__
    public = {n for n in dir(oracle) if not n.startswith("_")}
    assert not public & {"importlib", "pkgutil", "functools", "sys"}, public
    assert public <= set(oracle.__all__) | set(oracle.FAMILIES) | {"FAMILIES", "fp8", "numerics"}


def test_vllm_summary_without_vllm_names_no_version(monkeypatch):
    """The plug-in's summary() outside vLLM says where it is, not "in vLLM None"."""
    import importlib.metadata

    import loomnb.integrations.vllm as V

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setitem(V._STATE, "vllm_version", None)
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    first = V.summary().splitlines()[0]
    assert first == f"loomnb {loomnb.__version__} (vLLM is not installed here):" and "None" not in first
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.24.0")
    assert "beside vLLM 0.24.0 (not registered by vLLM in this process)" in V.summary()
    monkeypatch.setitem(V._STATE, "vllm_version", "0.24.0")
    assert V.summary().startswith(f"loomnb {loomnb.__version__} in vLLM 0.24.0:")


LAZY = """
import sys
import loomnb
assert "numba" not in sys.modules and "torch" not in sys.modules, "import loomnb is light"
assert loomnb.LoomnbValueError and loomnb.__version__
op = loomnb.rms_norm  # the first use loads the ops
assert "numba" in sys.modules and op is loomnb.ops.rms_norm and "rms_norm" in loomnb.__all__
del loomnb.rms_norm   # a deleted op stays deleted (the plug-in's hasattr checks rely on it)
assert not hasattr(loomnb, "rms_norm")
print("ok")
"""
EAGER = """
import torch, loomnb
print(hasattr(torch.ops.loomnb, "rms_norm"))
"""


@pytest.mark.parametrize("code, out", [(LAZY, "ok"), (EAGER, "True")], ids=["lazy", "eager"])
def test_import_loomnb_loads_the_ops_at_first_use_or_with_torch(code, out):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo,
                       env=dict(os.environ, PYTHONPATH=str(repo)), timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == out, r.stderr[-2000:]
