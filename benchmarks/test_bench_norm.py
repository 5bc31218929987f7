"""pytest entry points for the RMSNorm-family benchmark.

    pytest benchmarks/test_bench_norm.py                       # CPU checks (+ GPU cases if CUDA)
    pytest benchmarks/test_bench_norm.py -k gpu --benchmark-only \
        --benchmark-json benchmarks/results/pytest_norm.json   # the GPU cases only

GPU cases (one per op x provider x num_tokens, hidden 4096 bf16) are skipped without CUDA: each
captures back-to-back calls in a CUDA graph and lets pytest-benchmark time replays (whole
replay + sync); extra_info carries the per-call graph time from CUDA events, GB/s, and n.
``test_gpu_eager_per_call`` times rounds of 1000 eager calls at num_tokens=1 (host cost).
The CPU tests check the bytes model, provider ordering, binding by schema names, exactness
plumbing (vLLM's schemas mocked with the torch composites) and the dry-run -> summary path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import bench_norm as B  # noqa: E402
import summarize as S  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------- mock vLLM ops (CPU)
VLLM_SCHEMAS = {  # vLLM 0.24 csrc/torch_bindings (stable ABI), namespace _C
    "rms_norm": "(Tensor! result, Tensor input, Tensor weight, float epsilon) -> ()",
    "fused_add_rms_norm": "(Tensor! input, Tensor! residual, Tensor weight, float epsilon) -> ()",
    "rms_norm_dynamic_per_token_quant": "(Tensor! result, Tensor input, Tensor weight, "
    "Tensor! scale, float epsilon, Tensor? scale_ub, Tensor!? residual) -> ()",
    "rms_norm_static_fp8_quant": "(Tensor! result, Tensor input, Tensor weight, Tensor scale, "
    "float epsilon) -> ()",
    "fused_add_rms_norm_static_fp8_quant": "(Tensor! result, Tensor input, Tensor! residual, "
    "Tensor weight, Tensor scale, float epsilon) -> ()",
}
MOCK_NS = "loomnb_mockvllm"  # not "_C": a real vLLM library may be loaded in this process too


def _mock_impls() -> dict:
    def rms_norm(result, input, weight, epsilon):
        result.copy_(B.t_rms_norm(input, weight, epsilon))

    def fused_add_rms_norm(input, residual, weight, epsilon):
        B.t_fused_add(input, residual, weight, epsilon)

    def rms_norm_dynamic_per_token_quant(result, input, weight, scale, epsilon, scale_ub,
                                         residual):
        if residual is not None:
            residual.add_(input)
            input = residual
        q, s = B.t_dynamic_quant(input, weight, epsilon)
        result.copy_(q)
        scale.copy_(s)

    def rms_norm_static_fp8_quant(result, input, weight, scale, epsilon):
        result.copy_(B.t_static_quant(input, weight, scale, epsilon))

    def fused_add_rms_norm_static_fp8_quant(result, input, residual, weight, scale, epsilon):
        result.copy_(B.t_fused_static_quant(input, residual, weight, scale, epsilon)[0])

    return locals()


def register_mock_vllm(ns: str = MOCK_NS, schemas: dict = VLLM_SCHEMAS) -> None:
    """Registers the torch composites on CPU under vLLM's op names and schemas."""
    H.register_mock_ops(ns, schemas, _mock_impls())


# ---------------------------------------------------------------- CPU tests
def test_bytes_model():
    ops, h, e = B.OPS, 4096, 4096 * 2  # e: one bf16 row
    assert B.op_bytes(ops["rms_norm"], 1, h) == 3 * e
    assert B.op_bytes(ops["fused_add_rms_norm"], 1, h) == 5 * e  # x, r, w in; x, r out
    assert B.op_bytes(ops["rms_norm_dynamic_per_token_quant"], 1, h) == 2 * e + h + 4
    assert B.op_bytes(ops["rms_norm_static_fp8_quant"], 1, h) == 2 * e + 4 + h
    assert B.op_bytes(ops["fused_add_rms_norm_static_fp8_quant"], 1, h) == 4 * e + 4 + h
    nt = 16384  # weight counted once, not per row
    assert B.op_bytes(ops["rms_norm"], nt, h) == 2 * nt * e + e
    assert B.op_bytes(ops["rms_norm_dynamic_per_token_quant"], nt, h) == nt * (e + h + 4) + e


def test_provider_passes_and_args():
    names = ["loomnb", "vllm", "torch"]
    assert H.provider_passes(names, "both") == [("forward", names),
                                                ("reverse", ["torch", "vllm", "loomnb"])]
    assert H.provider_passes(names, "reverse") == [("reverse", names[::-1])]
    a = B.parse_args(["--dry-run", "--quick", "--providers", "torch,vllm"])
    assert a.providers == ["torch", "vllm"] and a.num_tokens == [1, 128, 16384]
    assert a.repeats == 5 and a.device == "cpu"
    with pytest.raises(SystemExit):
        B.parse_args(["--dry-run", "--providers", "torch,nope"])
    with pytest.raises(SystemExit):
        B.parse_args(["--dry-run", "--providers", "torch,torch"])


def test_l2_cold_sets():
    assert H.l2_cold_sets(256 << 20, 60 << 20) == 1
    assert H.l2_cold_sets(24576, 60 << 20) == 5120
    assert H.l2_cold_sets(1, 60 << 20, max_sets=100) == 100


def test_bind_schema_uses_names_not_order():
    lib = torch.library.Library("loomnb_benchtest", "FRAGMENT")  # noqa: F841 (kept alive)
    lib.define("rms_norm(float epsilon, Tensor weight, Tensor input, Tensor! result) -> ()")
    lib.define("fused_add_rms_norm(Tensor! input, Tensor weight, float epsilon) -> ()")
    sch = torch.ops.loomnb_benchtest.rms_norm.default._schema
    vals = {"x": "X", "weight": "W", "out": "O", "eps": 1e-6}
    args, kwargs, desc = H.bind_schema(sch, vals, ("x", "weight", "out", "eps"),
                                       B.VLLM_ALIASES)
    assert args == [1e-6, "W", "X", "O"] and not kwargs
    assert "result<-out" in desc
    sch = torch.ops.loomnb_benchtest.fused_add_rms_norm.default._schema
    with pytest.raises(TypeError, match="residual"):  # a schema that drops the residual
        H.bind_schema(sch, {**vals, "residual": "R"}, ("x", "residual", "weight", "eps"),
                      B.VLLM_ALIASES)


def test_bind_schema_dynamic_quant_optionals():
    register_mock_vllm()
    sch = getattr(torch.ops, MOCK_NS).rms_norm_dynamic_per_token_quant.default._schema
    t = {"x": "X", "weight": "W", "out": "O", "scales": "S", "eps": 1e-6}
    args, _, desc = H.bind_schema(sch, t, tuple(t), B.VLLM_ALIASES)
    assert args == ["O", "X", "W", "S", 1e-6, None, None], desc


def test_compare_bits():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    b = a.clone()
    b.view(torch.int16)[0] += 1  # next bf16 up: only the low byte differs
    c = H.compare_bits(b, a)
    assert c["elems"] == 0.75 and 0.75 < c["bytes"] < 1.0
    assert H.compare_bits(a, a)["bytes"] == 1.0
    assert H.compare_bits(a.float(), a)["bytes"] == 0.0  # dtype mismatch is not exact


def test_composites_match_definitions():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    q, s = B.t_dynamic_quant(x, w, 1e-6)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 1) and s.dtype == torch.float32
    assert q.float().abs().amax() == 448.0  # each row's max maps to the fp8 max
    r0 = torch.randn(4, 64, dtype=torch.bfloat16)
    x2, r = x.clone(), r0.clone()
    B.t_fused_add(x2, r, w, 1e-6)
    assert torch.equal(r, x + r0) and torch.equal(x2, B.t_rms_norm(x + r0, w, 1e-6))


def test_cpu_smoke_run_end_to_end(tmp_path, monkeypatch):
    """The real sweep path on CPU: mock vLLM ops bound by schema, exactness vs them, timers
    (wall-clock fallback), both provider orders, JSON/CSV, then the summary."""
    register_mock_vllm()
    monkeypatch.setattr(B.FAMILY, "vllm_ns", MOCK_NS)
    monkeypatch.delenv("LOOMNB_VLLM_LIB", raising=False)
    path = B.main(["--device", "cpu", "--providers", "vllm,torch,liger,loomnb",
                   "--num-tokens", "1,8", "--hidden-sizes", "256", "--repeats", "2",
                   "--copy-gib", "0.01", "--out", str(tmp_path), "--tag", "t"])
    d = json.loads(Path(path).read_text())
    rows, meta = d["results"], d["meta"]
    assert len(rows) == 2 * 5 * 2 * 4 and meta["exact_ref"] == "vllm"
    assert set(meta["vllm"]["schemas"]) == set(B.OPS) and meta["copy_GBps"] > 0
    by = {(r["pass"], r["op"], r["num_tokens"], r["provider"]): r for r in rows}
    for op in B.OPS:
        for nt in (1, 8):
            for p in ("vllm", "torch"):
                r = by[("reverse", op, nt, p)]
                assert r["status"] == "ok", r
                assert set(r["exact"]) == set(B.OPS[op].writes) and r["exact_min"] == 1.0
                assert r["timer"] == "cpu-wallclock" and r["GBps"] > 0
    assert by[("forward", "rms_norm", 1, "vllm")]["position"] == 0
    assert by[("reverse", "rms_norm", 1, "vllm")]["position"] == 3
    assert by[("forward", "rms_norm_static_fp8_quant", 1, "liger")]["status"] == "n/a"
    assert Path(path).with_suffix(".csv").exists()
    md = S.main([str(path), "--out-dir", str(tmp_path)])
    assert "| 8 | vllm |" in md.read_text()


def test_dry_run_and_summary(tmp_path):
    path = B.main(["--dry-run", "--quick", "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    assert d["meta"]["dry_run"] and len(d["results"]) == 2 * 5 * 3 * 5
    assert S.newest(tmp_path, "norm_*.json") == path
    md = S.main(["--results-dir", str(tmp_path)]).read_text()
    assert "DRY RUN" in md and "loomnb speedup" in md
    assert len(list(tmp_path.glob("*.png"))) == 10


# ---------------------------------------------------------------- GPU benchmark entry points
@pytest.fixture(scope="module")
def gpu_env():
    return H.ready_providers(B.FAMILY)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 8, 32, 128, 1024, 16384])
@pytest.mark.parametrize("provider", list(B.PROVIDERS))
@pytest.mark.parametrize("op", list(B.OPS))
def test_gpu(benchmark, gpu_env, op, provider, num_tokens):
    args, provs = gpu_env
    prov, o, h = provs[provider], B.OPS[op], 4096
    reason = prov.skip or prov.unsupported({"op": op})
    if reason:
        pytest.skip(reason)
    t = B.make_inputs(o, num_tokens, h, "bf16", "cuda", 0)
    try:
        call, _ = prov.bind(o, t, {"eps": 1e-6})
    except H.NotAvailable as e:
        pytest.skip(str(e))
    H.benchmark_graph(benchmark, call, B.op_bytes(o, num_tokens, h), rounds=20, warmup_rounds=2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("provider", list(B.PROVIDERS))
@pytest.mark.parametrize("op", list(B.OPS))
def test_gpu_eager_per_call(benchmark, gpu_env, op, provider):
    """Eager host cost at num_tokens=1 (what bench_overhead.py measures): each round is
    ``EAGER_CALLS`` back-to-back calls with no synchronisation inside, then one sync, so a
    round's time / ``EAGER_CALLS`` is the per-call cost the Python caller pays."""
    args, provs = gpu_env
    prov, o = provs[provider], B.OPS[op]
    reason = prov.skip or prov.unsupported({"op": op})
    if reason:
        pytest.skip(reason)
    t = B.make_inputs(o, 1, 4096, "bf16", "cuda", 0)
    try:
        call, _ = prov.bind(o, t, {"eps": 1e-6})
    except H.NotAvailable as e:
        pytest.skip(str(e))

    def calls():
        for _ in range(EAGER_CALLS):
            call()
        torch.cuda.synchronize()

    benchmark.extra_info.update(calls_per_round=EAGER_CALLS)
    benchmark.pedantic(calls, rounds=10, warmup_rounds=1, iterations=1)


EAGER_CALLS = 1000


def test_dry_run_and_summary_leave_the_committed_results_alone(tmp_path, monkeypatch, capsys):
    """benchmarks/README.md's command without a GPU (``bench_norm.py --dry-run`` then
    ``summarize.py``) writes outside benchmarks/results: the dry run into DRY_RUN_DIR, the
    summary into SUMMARY_DIR (``summarize.py --dry-run``: the dry-run folder); only a named
    --out-dir or --results-dir writes elsewhere."""
    results = Path(H.__file__).resolve().parent / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    dry, summary = tmp_path / "dry", tmp_path / "summary"
    assert H.DRY_RUN_DIR == S.DRY_RUN_DIR and H.default_out(False) == S.RESULTS_DIR == results
    monkeypatch.setattr(H, "DRY_RUN_DIR", dry)
    monkeypatch.setattr(S, "DRY_RUN_DIR", dry)
    monkeypatch.setattr(S, "SUMMARY_DIR", summary)
    path = B.main(["--dry-run", "--quick", "--ops", "rms_norm", "--providers", "loomnb,torch"])
    assert Path(path).parent == dry
    md = S.main(["--dry-run", "--no-plots"])
    assert md == dry / "SUMMARY.md" and "DRY RUN" in md.read_text()
    md = S.main(["--no-plots"])  # the committed results, summarised elsewhere
    assert md == summary / "SUMMARY.md"
    assert "is unchanged: --out-dir" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == before
