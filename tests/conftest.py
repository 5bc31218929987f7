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
SIM_SWITCH = 1e-4  # seconds: the thread switch interval of the simulator pass


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


@pytest.fixture(autouse=True)
def _split_counters_left_at_zero(request):
    """The split counters (``loomnb.ops._workspace``: one buffer per stream, shared by the
    sampling tail's split rows and the split-K decode attention) are 0 after every test -- the
    last block of each row leaves its counter at 0, and a nonzero one makes the next launch
    finish that row early (wrong results) or never. A failure here names the test after which
    a counter was left set: that test, or a kernel it ran writing out of its bounds into the
    workspace, is the defect."""
    yield
    import sys
    W = sys.modules.get("loomnb.ops._workspace")
    if W is None or not W.all_counters():
        return
    import numpy as np
    if HAS_GPU:
        import torch
        torch.cuda.synchronize()
    bad = []
    for key, c in W.all_counters():
        if isinstance(c, np.ndarray):  # the simulator's
            h = c
        elif hasattr(c, "copy_to_host"):  # a numba device array
            h = c.copy_to_host()
        else:  # torch
            h = c.cpu().numpy()
        nz = np.flatnonzero(h)
        if nz.size:
            bad.append(f"{key}: counters {nz[:8].tolist()} = {h[nz[:8]].tolist()}")
            if isinstance(c, np.ndarray):  # zeroed so that later tests start clean
                c[...] = 0
            elif hasattr(c, "copy_to_device"):
                c.copy_to_device(np.zeros_like(h))
            else:
                c.zero_()
    if bad:
        pytest.fail("split counters left nonzero after this test: " + "; ".join(bad))


@pytest.fixture(autouse=True, scope="session")
def _fast_thread_switch():
    """The simulator runs a block's threads as Python threads that meet at every barrier; at
    CPython's default 5 ms switch interval a barrier of 32 threads waits ~0.15 s for its turns
    (the sampler's radix select, dozens of barriers a row, took 10-20 s a call). The simulator
    pass runs at 0.1 ms: 5-15x faster (attention, MoE, speculative and reduction tests: 470 s
    -> 71 s on 2 cores). Finer interleaving once exposed a race in the simulator's own shared-
    memory allocator, which loomnb._numba_internals now locks (item 6 there)."""
    if not SIM:
        yield
        return
    import sys
    old = sys.getswitchinterval()
    sys.setswitchinterval(SIM_SWITCH)
    try:
        yield
    finally:
        sys.setswitchinterval(old)
