"""Every kernel compiles to sm_90 PTX with the real numba-cuda compiler (no GPU needed).

The simulator hides compile errors, so CI compiles every specialisation here and checks the
instructions we rely on are there: 16-byte vector loads/stores in the vector kernels, Hopper's
packed conversions, the float64 RMS, warp shuffles, and no local-memory arrays.
"""

import pytest

from loomnb._numba_internals import compile_ptx
from loomnb.ops import norm as norm_ops
from loomnb.ops._norm_kernels import (VARIANTS, make_cached_kernel, make_scalar_kernel,
                                     make_vector_kernel)

pytestmark = pytest.mark.nosim
CASES = [(k, v, vec, 0) for k in ("bf16", "f16", "f32") for v in VARIANTS
         for vec in ((False, True) if k != "f32" else (False,))]
CASES += [(k, v, True, vpt) for k in ("bf16", "f16") for v in VARIANTS for vpt in norm_ops.CACHED_VPT
          if k == "bf16" or vpt == 4]


@pytest.mark.parametrize("kind, variant, vector, vpt", CASES)
def test_norm_kernel_compiles_for_sm90(kind, variant, vector, vpt):
    if vpt:
        pyfunc = make_cached_kernel(kind, variant, vpt)
    else:
        pyfunc = (make_vector_kernel if vector else make_scalar_kernel)(kind, variant)
    ptx = compile_ptx(pyfunc, norm_ops.kernel_argtypes(kind, variant, vector))
    assert ".target sm_90" in ptx
    assert "sqrt.rn.f64" in ptx and "div.rn.f64" in ptx, "inv_rms is computed in float64"
    assert "shfl.sync.bfly.b32" in ptx
    assert ".local" not in ptx, "local memory: a per-thread array was not promoted to registers"
    if vector:
        assert "ld.v4.u32" in ptx and ("st.v4.u32" in ptx or "st.v2.u32" in ptx)
    if kind == "bf16":
        assert "cvt.rn.bf16x2.f32" in ptx
    if kind == "f16":
        assert "cvt.rn.f16x2.f32" in ptx
    if variant not in ("rms", "add"):
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
        assert "div.rn.f32" in ptx or variant.endswith("static"), "dynamic quant divides (IEEE)"
