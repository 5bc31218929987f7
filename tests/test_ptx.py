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
    if spec.kind == "bf16":  # every form rounds the norm to the activation dtype (static too)
        assert "cvt.rn.bf16x2.f32" in ptx
    if spec.kind == "f16":
        assert "cvt.rn.f16x2.f32" in ptx
    if spec.quant != "none":
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if spec.quant == "dynamic" and spec.layout == "scalar":
        assert "div.rn.f32" in ptx, "dynamic quant divides (IEEE)"
    if spec.lead == 2:
        assert "div.u32" in ptx or "rem.u32" in ptx, "per-head rows split the row index"


def _sampling_checks(spec, ptx):
    assert "shfl.sync.bfly.b32" in ptx
    if spec.layout == "vec":
        assert "ld.v4.u32" in ptx or "ld.v4.f32" in ptx, "16-byte loads"
    if hasattr(spec, "phase"):  # Min-P
        if spec.phase == "mask" and spec.layout == "vec":
            assert "st.v4.u32" in ptx
        if spec.phase == "mask" and spec.sampler == "v1":
            assert "div.rn.f32" in ptx, "p = e / S is an IEEE division"
    else:
        assert "atom.inc.u32" in ptx and "membar.gl" in ptx, "last-block-done: a fence, then atomicInc"
    from test_sampling_registers import PTXAS, check_registers
    if PTXAS:  # without ptxas, test_sampling_registers.py reports the skip
        check_registers(spec, ptx)


def _activation_checks(spec, ptx):
    if type(spec).__name__ == "DequantSpec":
        return
    if spec.layout == "vector":
        assert "ld.v4.u32" in ptx or "ld.v4.f32" in ptx, "16-byte loads"
        if spec.quant != "amax":
            assert ("st.v4.u32" if spec.quant == "none" else "st.v2.u32") in ptx, "vector stores"
    if spec.act in ("silu", "mul_silu", "swigluoai"):
        assert "ex2.approx" in ptx, "libdevice expf"
        assert "div.approx" not in ptx and "div.full" not in ptx and "div.rn.f32" in ptx, "IEEE division"
    if spec.act != "none" and spec.numerics == "unfused" and spec.kind != "f32":
        assert ("cvt.rn.bf16x2.f32" if spec.kind == "bf16" else "cvt.rn.f16x2.f32") in ptx, "r()"
    if spec.quant not in ("none", "amax"):
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if spec.quant == "group":
        assert "shfl.sync.bfly.b32" in ptx, "group amax over 8 or 16 lanes"
        assert "bar.sync" not in ptx, "group quant needs no block barrier"
        assert ("cvt.rpi.f32.f32" in ptx) == spec.ue8m0, "UE8M0: ceilf of libdevice log2f"
    if spec.quant in ("token", "amax"):
        assert "bar.sync" in ptx and "shfl.sync.bfly.b32" in ptx, "block reduction"
    if spec.quant in ("static", "tensor", "none"):
        assert "bar.sync" not in ptx, "an elementwise sink needs no barrier"
    if spec.quant in ("token", "group"):
        assert "div.rn.f32" in ptx, "per-token/group quant divide (IEEE, via div_rn)"


def _rope_cache_checks(spec, ptx):
    import re
    assert "div.approx" not in ptx and "div.full" not in ptx, "FP8 KV quantisation divides (IEEE)"
    if spec.rope:
        assert "mul.rn.f32" in ptx, "RoPE products carry .rn (ptxas never re-fuses them)"
        if spec.form == "nn":
            assert "fma.rn.f32" not in ptx and "add.rn.f32" in ptx and "sub.rn.f32" in ptx
        else:
            assert "fma.rn.f32" in ptx, "fma='vllm' fuses one product of each output"
    if spec.kv == "fp8_e4m3":
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx
    if spec.kv == "fp8_e5m2":
        assert "cvt.rn.satfinite.e5m2x2.f32" in ptx and "div.rn.f32" in ptx
    if spec.layout == "vector":
        assert re.search(r"ld(\.global)?\.v4\.u32", ptx) and re.search(r"st(\.global)?\.v[24]\.u32", ptx)


def _attention_checks(spec, ptx):
    if type(spec).__name__ == "DecodeSpec":
        assert "shfl.sync.bfly.b32" in ptx and "bar.sync" in ptx, "lane-group and warp merges"
        assert "ex2.approx" in ptx, "the online softmax runs in base 2"
        assert ("ld.v4.u32" in ptx or "ld.global.v4.u32" in ptx) == (spec.path == "vec")
        if spec.cache == "fp8":
            assert "cvt.rn.f16x2.e4m3x2" in ptx, "FP8 decoded by the hardware pair conversion"
    else:
        assert "fma.rn.f32" in ptx or "ex2.approx" in ptx
    if spec.kind in ("bf16", "f16"):
        assert f"cvt.rn.{spec.kind}x2.f32" in ptx, "the output rounded by the hardware"


def _spec_decode_checks(spec, ptx):
    assert "shfl.sync.bfly.b32" in ptx, "group minimum / block argmax by shuffles"
    if type(spec).__name__ == "ArgmaxSpec":
        assert ("ld.v4.u32" in ptx) == spec.vec, "16-byte loads exactly on the vector path"
        assert "bar.sync" in ptx, "one block argmax"
    elif spec.pack:
        assert "shfl.sync.up.b32" in ptx and "bar.sync" in ptx, "prefix sums for the compaction"
    else:
        assert "bar.sync" not in ptx, "verification alone needs no barrier"


def _kv_blocks_checks(spec, ptx):
    """The block copies and chains move 16 (8) bytes an instruction at units of 16 (8); the
    vector gathers and MLA writes too, and FP8 conversions use the hardware instructions."""
    name = type(spec).__name__
    unit = getattr(spec, "unit", None)
    if unit == 16 or getattr(spec, "layout", None) == "vector":
        assert "ld.v4.u32" in ptx or "ld.v2.u32" in ptx, "vector loads"
        assert "st.v4.u32" in ptx or "st.v2.u32" in ptx, "vector stores"
    if unit == 8:
        assert "ld.v2.u32" in ptx and "st.v2.u32" in ptx
    if name == "MlaSpec" and spec.kv == "fp8_e4m3":
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if name == "MlaSpec" and spec.kv == "fp8_e5m2":
        assert "cvt.rn.satfinite.e5m2x2.f32" in ptx


def _moe_checks(spec, ptx):
    """Routing reduces over the warp by shuffles and ``redux.sync`` and needs no barrier (one
    warp a token); the align's count uses shared-memory atomics, its place ballot ranks; the row
    kernels move 16 bytes an instruction on the vector layout, and the combine and moe_sum never
    contract a product and a sum into an FMA (the oracle's order)."""
    name = type(spec).__name__
    if name == "RouteSpec":
        assert "shfl.sync.bfly.b32" in ptx and "bar.sync" not in ptx
        assert "redux.sync.max.u32" in ptx, "the k rounds' warp max of keys"
        assert "shfl.sync.idx.b32" in ptx, "the picked expert's weight from its lane"
    elif name == "AlignSpec":
        assert "bar.sync" in ptx
        if spec.part == "count":
            assert "atom.shared.add" in ptx and "atom.global.inc.u32" in ptx, "the last block's ticket"
        else:
            assert "vote.sync.ballot.b32" in ptx and "match.any" not in ptx, "ballot ranks"
            assert "atom.shared" not in ptx, "ranks from per-warp counts, not atomics"
    elif name == "RowsSpec":
        if spec.layout == "vector":
            assert "ld.v4." in ptx or "ld.global.v4." in ptx, "vector loads"
        if spec.op in ("combine", "sum"):
            assert "fma.rn.f32" not in ptx, "no contracted FMA"
        if spec.op == "permute_fp8" and spec.layout == "vector":
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


def _sampler_checks(spec, ptx):
    if type(spec).__name__ == "PenaltySpec":
        assert "div.rn.f32" in ptx, "x / penalty is an IEEE division (vLLM's op)"
        assert "fma.rn.f32" not in ptx and "mul.f32" not in ptx, \
            "products as mul.rn.f32: no FMA in x - f * count, now or by ptxas"
        return
    if type(spec).__name__ in ("RowSpec", "SplitSpec"):
        assert "atom.shared.add.u32" in ptx, "the radix histograms: 32-bit shared atomics"
        for op in ("add.u64", "min.s64", "max.s64", "cas.b64"):  # a CAS loop on sm_90
            assert f"atom.shared.{op}" not in ptx, f"no 64-bit shared atomic ({op}): wide_add"
    if spec.output == "sample":
        assert "mul.wide.u32" in ptx, "Philox's 32x32->64-bit products"


FAMILY_CHECKS = {"_sampler_kernels": _sampler_checks, "_moe_kernels": _moe_checks, "_norm_kernels": _norm_checks, "_sampling_kernels": _sampling_checks, "_activation_kernels": _activation_checks, "_rope_cache_kernels": _rope_cache_checks, "_attention_kernels": _attention_checks, "_spec_decode_kernels": _spec_decode_checks, "_kv_blocks_kernels": _kv_blocks_checks}


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
