"""Every family's kernels compile to sm_90 PTX with the real numba-cuda compiler (no GPU needed).

The simulator hides compile errors, so CI compiles every variant each family declares
(``loomnb.ops._<family>_kernels.variants()``) and checks what every kernel must hold -- no
local-memory arrays (a per-thread array that was not promoted to registers) -- plus each
family's own instructions (``FAMILY_CHECKS``). The simulator pass checks that every kernel an
op launched is one of these declared variants (``conftest.py``).
"""

import importlib
import pkgutil

import pytest

import loomnb.ops
from loomnb._numba_internals import compile_ptx

pytestmark = pytest.mark.nosim

KERNEL_MODULES = [importlib.import_module(f"loomnb.ops.{m.name}")
                  for m in pkgutil.iter_modules(loomnb.ops.__path__) if m.name.endswith("_kernels")]
CASES = [(mod.__name__.rsplit(".", 1)[1], factory, spec, sig)
         for mod in KERNEL_MODULES for factory, spec, sig in mod.variants()]


def _norm_checks(spec, ptx):
    assert "sqrt.rn.f64" in ptx and "div.rn.f64" in ptx, "inv_rms is computed in float64"
    assert "shfl.sync.bfly.b32" in ptx
    if spec.layout == "cached":
        assert "ld.v4.u32" in ptx and ("st.v4.u32" in ptx or "st.v2.u32" in ptx)
    if spec.kind == "bf16":
        assert "cvt.rn.bf16x2.f32" in ptx
    if spec.kind == "f16":
        assert "cvt.rn.f16x2.f32" in ptx
    if spec.quant != "none":
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if spec.quant == "dynamic" and spec.layout == "scalar":
        assert "div.rn.f32" in ptx, "dynamic quant divides (IEEE)"
    if spec.lead == 2:
        assert "div.u32" in ptx or "rem.u32" in ptx, "per-head rows split the row index"


FAMILY_CHECKS = {"_norm_kernels": _norm_checks}


def test_every_family_declares_variants():
    assert {m for m, *_ in CASES} == {m.__name__.rsplit(".", 1)[1] for m in KERNEL_MODULES}


@pytest.mark.parametrize("module, factory, spec, sig", CASES,
                         ids=[f"{m}:{spec}" for m, _, spec, _ in CASES])
def test_kernel_compiles_for_sm90(module, factory, spec, sig):
    ptx = compile_ptx(factory(spec), sig)
    assert ".target sm_90" in ptx
    assert ".local" not in ptx, "local memory: a per-thread array was not promoted to registers"
    check = FAMILY_CHECKS.get(module)
    if check is not None:
        check(spec, ptx)
