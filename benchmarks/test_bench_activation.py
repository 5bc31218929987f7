"""pytest entry points for the activation-family benchmark.

    pytest benchmarks/test_bench_activation.py                    # CPU checks (+ GPU cases if CUDA)
    pytest benchmarks/test_bench_activation.py -k gpu --benchmark-only \\
        --benchmark-json benchmarks/results/pytest_activation.json

The CPU tests check the bytes model, the inputs, the torch composites against the oracles,
binding by schema names (vLLM's schemas mocked with the torch composites on the CPU, a missing
op reported as n/a) and the dry-run and CPU-smoke paths end to end. GPU cases (loomnb and vLLM,
graph-replayed, d = 11008) are skipped without CUDA.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import bench_activation as B  # noqa: E402
import summarize as S  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

# ---------------------------------------------------------------- mock vLLM ops (CPU)
VLLM_SCHEMAS = {  # vLLM 0.24 csrc torch bindings (stable ABI), namespace _C
    "silu_and_mul": "(Tensor! result, Tensor input) -> ()",
    "per_token_group_fp8_quant": "(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, "
    "float eps, float fp8_min, float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, "
    "bool dummy_is_tma_aligned) -> ()",
    "dynamic_per_token_scaled_fp8_quant": "(Tensor! result, Tensor input, Tensor! scale, Tensor? scale_ub) -> ()",
    "static_scaled_fp8_quant": "(Tensor! result, Tensor input, Tensor scale) -> ()",
    "dynamic_scaled_fp8_quant": "(Tensor! result, Tensor input, Tensor! scale) -> ()",
    "silu_and_mul_per_block_quant": "(Tensor! out, Tensor input, Tensor! scales, int group_size, "
    "Tensor? scale_ub, bool is_scale_transposed) -> ()",
}
MOCK_NS = "loomnb_mockvllm_act"  # not "_C": a real vLLM library may be loaded in this process


def _mock_impls() -> dict:
    def silu_and_mul(result, input):
        result.copy_(B.t_silu_and_mul(input))

    def per_token_group_fp8_quant(input, output_q, output_s, group_size, eps, fp8_min, fp8_max,
                                  scale_ue8m0, dummy_is_scale_transposed, dummy_is_tma_aligned):
        q, s = B.t_group_quant(input, group_size, eps)
        output_q.copy_(q)
        output_s.copy_(s)

    def dynamic_per_token_scaled_fp8_quant(result, input, scale, scale_ub):
        q, s = B.t_per_token(input)
        result.copy_(q)
        scale.copy_(s)

    def static_scaled_fp8_quant(result, input, scale):
        result.copy_(B.t_static(input, scale))

    def dynamic_scaled_fp8_quant(result, input, scale):
        assert float(scale) == 0.0, "vLLM's caller zeroes the scale before the atomic max"
        q, s = B.t_per_tensor(input)
        result.copy_(q)
        scale.copy_(s)

    def silu_and_mul_per_block_quant(out, input, scales, group_size, scale_ub, is_scale_transposed):
        q, s = B.t_fused(input)
        out.copy_(q)
        scales.copy_(s)

    return locals()


def register_mock_vllm(ns: str = MOCK_NS, schemas: dict = VLLM_SCHEMAS) -> None:
    """Registers the torch composites on CPU under vLLM's op names and schemas."""
    H.register_mock_ops(ns, schemas, _mock_impls())


# ---------------------------------------------------------------- CPU tests
def test_bytes_model():
    ops, d, T = B.OPS, 11008, 4096
    assert B.op_bytes(ops["silu_and_mul"], T, d) == T * 2 * d * 2 + T * d * 2  # 270.5 MB
    assert B.op_bytes(ops["silu_and_mul_per_token_group_quant_fp8"], T, d) == \
        T * 2 * d * 2 + T * d + T * (d // 128) * 4
    assert B.op_bytes(ops["per_token_group_quant_fp8"], T, d) == T * d * 2 + T * d + T * (d // 128) * 4
    assert B.op_bytes(ops["dynamic_per_token_scaled_fp8_quant"], T, d) == T * d * 3 + T * 4
    assert B.op_bytes(ops["static_scaled_fp8_quant"], T, d) == T * d * 3 + 4
    assert B.op_bytes(ops["dynamic_scaled_fp8_quant"], T, d) == T * d * 3 + 4
    assert B.op_bytes(ops["silu_and_mul"], 1, 8) == 48


def test_inputs():
    for op in B.OPS.values():
        t = B.make_inputs(op, 3, 256, "bf16", "cpu", 0)
        assert set(t) == set(op.reads + op.writes), op.name
        assert t["x"].shape == ((3, 512) if op.extra["gated"] else (3, 256))
        if "scale" in t:
            assert t["scale"].item() == (np.float32(B.STATIC_SCALE) if "scale" in op.reads else 0.0)
        if op.extra["quant"]:
            assert t["out"].dtype == torch.float8_e4m3fn and t["out"].shape == (3, 256)


def test_composites_equal_the_oracles():
    """The torch composites are the spec: on the CPU they equal loomnb's oracles (torch's CPU
    exp may move a bf16 ulp of silu; the quantisers are exact)."""
    import loomnb.oracle as O
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 512, generator=g) * 3).to(torch.bfloat16)
    xn = x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    y = B.t_silu_and_mul(x)
    diff = y.view(torch.int16).numpy() != O.silu_and_mul(xn).view(np.int16)
    assert diff.mean() < 1e-2
    yn = y.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    q, s = B.t_group_quant(y)
    qo, so = O.per_token_group_quant_fp8(yn, 128)
    assert np.array_equal(q.view(torch.uint8).numpy(), qo.view(np.uint8)) and np.array_equal(s.numpy(), so)
    q, s = B.t_per_token(y)
    qo, so = O.dynamic_per_token_scaled_fp8_quant(yn)
    assert np.array_equal(q.view(torch.uint8).numpy(), qo.view(np.uint8)) and np.array_equal(s.numpy(), so)
    sc = torch.tensor([0.01])
    assert np.array_equal(B.t_static(y, sc).view(torch.uint8).numpy(),
                          O.static_scaled_fp8_quant(yn, sc.numpy()).view(np.uint8))
    q, s = B.t_per_tensor(y)
    qo, so = O.dynamic_scaled_fp8_quant(yn)
    assert np.array_equal(q.view(torch.uint8).numpy(), qo.view(np.uint8)) and s.item() == so[0]


def test_args_and_defaults():
    a = B.parse_args(["--dry-run", "--quick", "--providers", "torch,vllm"])
    assert a.providers == ["torch", "vllm"] and a.num_tokens == [1, 128, 4096] and a.d == [11008]
    assert a.repeats == 5 and a.target_ms == 0.5
    a = B.parse_args(["--dry-run"])
    assert a.num_tokens == [1, 8, 32, 128, 1024, 4096] and a.d == [11008, 14336]
    assert a.target_ms == 1.0 and a.repeats == 9 and a.order == "both"
    assert list(a.providers) == ["loomnb", "vllm", "vllm_per_block", "flashinfer", "torch",
                                 "torch_compile", "liger"]
    with pytest.raises(SystemExit):
        B.parse_args(["--dry-run", "--providers", "torch,nope"])


def test_bind_by_schema_names_and_missing_ops_are_na():
    register_mock_vllm()
    lib = torch.library.Library("loomnb_benchtest_act", "FRAGMENT")  # noqa: F841 (kept alive)
    lib.define("silu_and_mul(Tensor input, Tensor! result) -> ()")  # another argument order
    prov = H.make_provider(B.FAMILY, "vllm")
    prov.ns, prov.bindings, prov.log = torch.ops.loomnb_benchtest_act, {}, lambda m: None
    t = B.make_inputs(B.OPS["silu_and_mul"], 2, 64, "bf16", "cpu", 0)
    def impl(input, result):
        result.copy_(B.t_silu_and_mul(input))

    lib.impl("silu_and_mul", impl, "CPU")
    call, collect = prov.bind(B.OPS["silu_and_mul"], t, {})
    call()
    assert torch.equal(collect(None)["out"], B.t_silu_and_mul(t["x"]))
    assert prov.bindings["silu_and_mul"] == "silu_and_mul(input<-x, result<-out)"
    with pytest.raises(H.NotAvailable, match="missing"):
        prov.bind(B.OPS["static_scaled_fp8_quant"], B.make_inputs(B.OPS["static_scaled_fp8_quant"], 2, 64,
                                                                  "bf16", "cpu", 0), {})


def test_cpu_smoke_run_end_to_end(tmp_path, monkeypatch):
    """The real sweep path on CPU: mock vLLM ops bound by schema, exactness against them,
    timers (wall clock), both provider orders, JSON/CSV, then the summary."""
    register_mock_vllm()
    monkeypatch.setattr(B.FAMILY, "vllm_ns", MOCK_NS)
    monkeypatch.delenv("LOOMNB_VLLM_LIB", raising=False)
    path = B.main(["--device", "cpu", "--providers", "vllm,vllm_per_block,torch,liger,loomnb",
                   "--num-tokens", "1,8", "--d", "256", "--repeats", "2", "--copy-gib", "0.01",
                   "--out", str(tmp_path), "--tag", "t"])
    d = json.loads(Path(path).read_text())
    rows, meta = d["results"], d["meta"]
    assert len(rows) == 2 * 6 * 2 * 5 and meta["exact_ref"] == "vllm"
    by = {(r["pass"], r["op"], r["num_tokens"], r["provider"]): r for r in rows}
    for op in B.OPS:
        for nt in (1, 8):
            for p in ("vllm", "torch"):
                r = by[("reverse", op, nt, p)]
                assert r["status"] == "ok", r
                assert set(r["exact"]) == set(B.OPS[op].writes) and r["exact_min"] == 1.0, r
                assert r["timer"] == "cpu-wallclock" and r["GBps"] > 0
            assert by[("forward", op, nt, "liger")]["status"] in ("skip", "n/a")
    fused = by[("forward", "silu_and_mul_per_token_group_quant_fp8", 8, "vllm_per_block")]
    assert fused["status"] == "ok" and fused["exact_min"] == 1.0  # the mock equals the unfused path
    assert by[("forward", "silu_and_mul", 8, "vllm_per_block")]["status"] == "n/a"
    assert "silu_and_mul_per_token_group_quant_fp8 [2/2]" in meta["vllm"]["bindings"]
    assert Path(path).with_suffix(".csv").exists()
    md = S.main([str(path), "--out-dir", str(tmp_path), "--no-plots"])
    assert "| 8 | vllm |" in md.read_text()


def test_dry_run_and_summary(tmp_path):
    path = B.main(["--dry-run", "--quick", "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    assert d["meta"]["dry_run"] and d["meta"]["benchmark"] == "activation"
    assert len(d["results"]) == 2 * 6 * 3 * 7
    md = S.main([str(path), "--out-dir", str(tmp_path)]).read_text()
    assert "DRY RUN" in md and "loomnb speedup" in md and "d 11008" in md


def test_tuned_variant_sets_a_real_constant(tmp_path):
    """``--tune --providers loomnb,loomnb_u2`` runs (dry) and names a constant the op module has."""
    import loomnb.ops.activation as A
    assert all(hasattr(A, k) for p in B.TUNED for k in p.config)
    path = B.main(["--dry-run", "--quick", "--tune", "--providers", "loomnb,loomnb_u2",
                   "--ops", "silu_and_mul", "--out", str(tmp_path)])
    rows = json.loads(Path(path).read_text())["results"]
    assert {r["provider"] for r in rows if r["status"] == "ok"} == {"loomnb", "loomnb_u2"}


# ---------------------------------------------------------------- GPU benchmark entry points
@pytest.fixture(scope="module")
def gpu_env():
    return H.ready_providers(B.FAMILY, names=("loomnb", "vllm", "torch_compile"))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 128, 4096])
@pytest.mark.parametrize("provider", ["loomnb", "vllm", "torch_compile"])
@pytest.mark.parametrize("op", ["silu_and_mul", "silu_and_mul_per_token_group_quant_fp8"])
def test_gpu(benchmark, gpu_env, op, provider, num_tokens):
    args, provs = gpu_env
    prov, o, d = provs[provider], B.OPS[op], 11008
    reason = prov.skip or prov.unsupported({"op": op})
    if reason:
        pytest.skip(reason)
    t = B.make_inputs(o, num_tokens, d, "bf16", "cuda", 0)
    try:
        call, _ = prov.bind(o, t, {"op": op})
    except H.NotAvailable as e:
        pytest.skip(str(e))
    H.benchmark_graph(benchmark, call, B.op_bytes(o, num_tokens, d), rounds=20, warmup_rounds=2)
