"""Test modes: loomnb's tests run in two pytest passes (see scripts/test).

* the plain pass (no GPU here; CI's CPU machine): oracles, contract checks that need no
  launch, every kernel compiled to sm_90 PTX with the real numba-cuda compiler, the model;
  on a machine with a GPU the same pass runs the ``gpu`` tests on real hardware;
* the simulator pass (``NUMBA_ENABLE_CUDASIM=1 pytest -m sim``): kernels run under numba's
  CUDA simulator on NumPy arrays and are compared with the oracles.

Tests that belong to the other pass are skipped with a reason that names it; GPU tests are
skipped only when there is no GPU, with that reason, never silently.
"""

import os

import pytest

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def _has_gpu():
    if SIM:
        return False
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "sim" in item.keywords and not SIM:
            item.add_marker(pytest.mark.skip(
                reason="simulator test: runs in the pass NUMBA_ENABLE_CUDASIM=1 pytest -m sim"))
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(pytest.mark.skip(
                reason="needs a CUDA GPU and torch.cuda (none here); run on the GPU machine"))
        if "nosim" in item.keywords and SIM:
            item.add_marker(pytest.mark.skip(
                reason="needs the real numba-cuda compiler: runs in the plain pytest pass"))


def pytest_sessionfinish(session, exitstatus):
    """Simulator pass: every kernel an op launched must be a variant its family declares (the
    variants tests/test_ptx.py compiles for sm_90), so no launched kernel escapes the PTX test."""
    if not SIM or exitstatus != 0:
        return
    import importlib
    import pkgutil

    import loomnb.ops
    from loomnb.ops import _launch

    declared = set()
    for m in pkgutil.iter_modules(loomnb.ops.__path__):
        if m.name.endswith("_kernels"):
            declared |= {(f, s, sig) for f, s, sig in importlib.import_module(f"loomnb.ops.{m.name}").variants()}
    missing = _launch.launched() - declared
    if missing:
        print("\nlaunched kernels no family declares in variants() (so the PTX test misses them):")
        for f, s, sig in sorted(missing, key=str)[:20]:
            print(f"  {f.__name__}({s}) {sig}")
        session.exitstatus = 1


@pytest.fixture(scope="session")
def vllm_c():
    """vLLM 0.24's compiled ops (``torch.ops._C``, ``_C_cache_ops``...) loaded from
    ``$LOOMNB_VLLM_LIB`` (its ``_C_stable_libtorch.abi3.so``, a measuring instrument staged on the
    GPU machine); the test is skipped, with that reason, when it is not set."""
    path = os.environ.get("LOOMNB_VLLM_LIB")
    if not path or not os.path.isfile(path):
        pytest.skip("set LOOMNB_VLLM_LIB to vLLM 0.24's _C_stable_libtorch.abi3.so to compare with vLLM")
    import torch
    torch.ops.load_library(path)
    return torch.ops
