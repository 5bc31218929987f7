"""pytest entry points for the sampler-family benchmark.

    pytest benchmarks/test_bench_sampler.py                     # CPU checks (+ GPU cases if CUDA)
    pytest benchmarks/test_bench_sampler.py -k gpu --benchmark-only

The CPU tests check the bytes model, that the torch composites (the peers and the exactness
reference) compute what the oracles define -- the renormalisations and the penalties bit for
bit, vLLM's penalty path through a mock of its compiled op, the samplers' tokens inside the
support that the ``in_support`` column checks -- the case list, the dry run end to end (JSON,
CSV, summary) and the real sweep path on the CPU (torch composites, the mock vLLM op bound by
its schema, both provider orders). The GPU cases (skipped without CUDA) time graph replays of
each op at 1/32/128 rows x 151,936 through pytest-benchmark.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import bench_sampler as B  # noqa: E402
import summarize as S  # noqa: E402

import loomnb.oracle  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
MOCK_NS = "loomnb_mock_sampler_C"
SCHEMAS = {  # vLLM 0.24 csrc/torch_bindings.cpp (namespace _C)
    "apply_repetition_penalties_": "(Tensor(a!) logits, Tensor prompt_mask, Tensor output_mask, "
                                   "Tensor repetition_penalties) -> ()",
}


def _mock_repetition(logits, prompt_mask, output_mask, repetition_penalties):
    """vLLM's CUDA kernel on the CPU: ``x / r`` where ``x > 0``, ``x * r`` elsewhere, seen only."""
    r = repetition_penalties.unsqueeze(1)
    y = torch.where(logits > 0, logits / r, logits * r)
    logits.copy_(torch.where(prompt_mask | output_mask, y, logits))


def register_mock_vllm():
    H.register_mock_ops(MOCK_NS, SCHEMAS, {"apply_repetition_penalties_": _mock_repetition})


def _probs(rows, vocab, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    return torch.from_numpy(x).softmax(-1).numpy()


def test_bytes_model():
    V = 151936
    sample, renorm = B.OPS["top_k_top_p_sampling_from_logits"], B.OPS["top_k_renorm_probs"]
    assert B.op_bytes(sample, 1, V) == 4 * V + 4
    assert B.op_bytes(sample, 128, V, "bf16") == 128 * (2 * V + 4)
    assert B.op_bytes(sample, 8, V, "bf16", per_row=True) == 8 * (2 * V + 4 + 8)
    assert B.op_bytes(B.OPS["min_p_sampling_from_probs"], 8, V, "bf16") == 8 * (4 * V + 4)
    assert B.op_bytes(renorm, 32, V) == 32 * 8 * V
    assert B.op_bytes(B.OPS["apply_penalties_"], 32, V) == 32 * (13 * V + 12)
    # 128 rows x 151,936 fp32 read once = 77.8 MB: about 18.5 µs at 4.2 TB/s
    assert abs(B.op_bytes(sample, 128, V) / 4.2e12 * 1e6 - 18.5) < 0.5


@pytest.mark.parametrize("k", [50, 1, 7, 0, 3000])
def test_top_k_renorm_composite_is_the_oracle_bit_for_bit(k):
    p = _probs(6, 3000, 0)
    p[3, :100] = p[3, 0]  # ties at the boundary are kept
    got = B.t_top_k_renorm(torch.from_numpy(p), k).numpy()
    want = loomnb.oracle.top_k_renorm_probs(p, k)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("top_p", [0.9, 0.5, 0.999, 0.0, 1.0])
def test_top_p_renorm_composite_is_the_oracle_bit_for_bit(top_p):
    p = _probs(6, 3000, 1)
    p[2, :40] = p[2].max()
    got = B.t_top_p_renorm(torch.from_numpy(p), top_p).numpy()
    want = loomnb.oracle.top_p_renorm_probs(p, top_p)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _penalty_inputs(rows=4, vocab=2000):
    """The benchmark's inputs, with the repetition penalties varied across the rows (1: off)."""
    op = B.OPS["apply_penalties_"]
    t = B.make_inputs(op, rows, vocab, "fp32", "cpu", 3)
    t["repetition_penalties"] = torch.tensor([1.1, 1.0, 2.0, 0.7]).repeat(rows)[:rows].contiguous()
    return op, t


def _oracle_penalties(t):
    x = t["logits"].numpy().copy()
    loomnb.oracle.apply_penalties_(
        x, t["prompt_mask"].numpy(), t["output_token_counts"].numpy(),
        t["repetition_penalties"].numpy(), t["frequency_penalties"].numpy(),
        t["presence_penalties"].numpy())
    return x


def test_penalty_inputs_are_as_described():
    op, t = _penalty_inputs(8, 20000)
    assert t["prompt_mask"].dtype == torch.bool and t["output_token_counts"].dtype == torch.int32
    assert 0.005 < t["prompt_mask"].float().mean() < 0.015
    nz = t["output_token_counts"][t["output_token_counts"] > 0]
    assert 0.005 < nz.numel() / t["output_token_counts"].numel() < 0.015
    assert nz.min() >= 1 and nz.max() <= 3
    assert torch.equal(t["output_mask"], t["output_token_counts"] > 0)


def test_penalty_composite_and_vllms_path_are_the_oracle_bit_for_bit(monkeypatch):
    op, t = _penalty_inputs()
    want = _oracle_penalties(t).view(np.uint32)
    got = B.t_penalties(t["logits"], t["prompt_mask"], t["output_token_counts"],
                        t["repetition_penalties"], t["frequency_penalties"],
                        t["presence_penalties"])
    assert np.array_equal(got.numpy().view(np.uint32), want)
    register_mock_vllm()
    monkeypatch.setattr(B.Vllm, "namespaces", (MOCK_NS,))
    monkeypatch.delenv("LOOMNB_VLLM_LIB", raising=False)
    prov = H.make_provider(B.FAMILY, "vllm")
    assert prov.setup(B.parse_args(["--device", "cpu"]), H.RunLog()) is None
    call, got = prov.bind(op, t, {"op": op.name, "dtype": "fp32"})
    out = got(call())["logits"]
    assert out is t["logits"] and np.array_equal(out.numpy().view(np.uint32), want)
    assert prov.bindings[op.name] == ("logits<-logits, prompt_mask<-prompt_mask, "
                                      "output_mask<-output_mask, "
                                      "repetition_penalties<-repetition_penalties")


@pytest.mark.parametrize("name", ["top_k_top_p_sampling_from_logits", "min_p_sampling_from_probs",
                                  "sampling_from_logits"])
def test_in_support_holds_for_the_oracles_and_the_composites_tokens(name):
    """The support the exactness column checks is the oracle's kept set where it draws: its
    tokens (many seeds) and the torch composite's all lie inside it, and a token outside it
    is flagged."""
    op = B.OPS[name]
    t = B.make_inputs(op, 4, 3000, "fp32", "cpu", 5)
    x = t[op.reads[0]]
    fn = getattr(loomnb.oracle, name)
    params = {"top_k_top_p_sampling_from_logits": (B.TOP_K, B.TOP_P),
              "min_p_sampling_from_probs": (B.MIN_P,), "sampling_from_logits": ()}[name]
    kw = {"temperature": B.TEMPERATURE} if name == "sampling_from_logits" else {}
    for seed in range(20):
        ids = fn(x.numpy(), *params, seed=seed, **kw)
        assert B.in_support(op, t, torch.from_numpy(ids)).all(), (name, seed, ids)
    torch.manual_seed(0)
    call, collect = H.make_provider(B.FAMILY, "torch").bind(op, t, {"op": name})
    for _ in range(20):
        assert collect(call())["in_support"].all()
    keep = B.support(op, t)
    assert keep.any(-1).all()
    if name != "sampling_from_logits":
        assert not B.in_support(op, t, x.argmin(-1)).any()
    assert not B.in_support(op, t, torch.full((4,), 3000)).any()  # past the vocabulary


def test_args_and_cases():
    a = B.parse_args(["--dry-run", "--quick"])
    assert a.num_rows == [1, 32, 128] and a.vocab_size == [151936] and a.dtype == "fp32"
    assert a.exact_ref == "vllm" and a.repeats == 5 and not a.per_row
    cases = B.FAMILY.cases(a)
    assert len(cases) == 6 * 3 and {c["params"] for c in cases} == {"scalar"}
    a = B.parse_args(["--dry-run", "--dtype", "bf16", "--per-row"])
    assert a.num_rows == [1, 8, 32, 128, 512] and a.vocab_size == [49152, 128256, 151936]
    assert a.repeats == 9 and a.target_ms == 1.0
    cases = B.FAMILY.cases(a)
    assert len(cases) == 6 * 3 * 5
    c = next(c for c in cases if c["op"] == "top_k_top_p_sampling_from_logits")
    assert c["shape"].endswith("per-row parameters") and c["bytes"] == B.op_bytes(
        B.OPS[c["op"]], c["num_rows"], c["vocab_size"], "bf16", True)


def test_dry_run_and_summary(tmp_path):
    path = B.main(["--dry-run", "--quick", "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    rows = d["results"]
    assert d["meta"]["dry_run"] and d["meta"]["x_axis"] == "num_rows"
    assert d["meta"]["benchmark"] == "sampler" and "dryrun" in Path(path).name
    assert len(rows) == 2 * 6 * 3 * (len(B.PROVIDERS) - len(B.TUNED)), \
        "--tune variants only when named"
    by = {(r["pass"], r["op"], r["num_rows"], r["provider"]): r for r in rows}
    for op in B.OPS:
        assert by[("forward", op, 32, "loomnb")]["status"] == "ok"
        assert by[("reverse", op, 1, "torch_compile")]["status"] == "ok"
    assert by[("forward", "apply_penalties_", 32, "vllm")]["status"] == "ok"
    assert by[("forward", "apply_penalties_", 32, "flashinfer")]["status"] == "n/a"
    assert by[("reverse", "top_k_top_p_sampling_from_logits", 1, "vllm")]["status"] == "n/a"
    assert by[("forward", "top_k_top_p_sampling_from_logits", 1, "vllm_torch")]["status"] == "ok"
    assert by[("forward", "top_p_renorm_probs", 128, "vllm_torch")]["status"] == "n/a"
    assert set(by[("forward", "min_p_sampling_from_probs", 1, "loomnb")]["exact"]) == {"in_support"}
    md = S.main([str(path), "--out-dir", str(tmp_path), "--no-plots"]).read_text()
    assert "DRY RUN" in md and "top_k_top_p_sampling_from_logits" in md and "apply_penalties_" in md


def test_dry_run_bf16_rows_of_the_fp32_ops_are_na(tmp_path):
    path = B.main(["--dry-run", "--quick", "--dtype", "bf16", "--providers", "loomnb,torch",
                   "--out", str(tmp_path)])
    for r in json.loads(Path(path).read_text())["results"]:
        fp32 = B.fp32_only(B.OPS[r["op"]])
        assert r["status"] == ("n/a" if fp32 else "ok"), r
        if not fp32:
            assert r["bytes"] == r["num_rows"] * (2 * r["vocab_size"] + 4)


def test_cpu_smoke_run_end_to_end(tmp_path, monkeypatch):
    """The real sweep on the CPU: torch composites timed by the wall-clock fallback, exactness
    against the torch reference (vLLM's library is not given: logged), both provider orders,
    JSON and CSV. loomnb needs a GPU (its CPU rows are errors that name the reason); FlashInfer
    and vllm do not import here (skips), vllm's rows other than the penalties are n/a."""
    monkeypatch.delenv("LOOMNB_VLLM_LIB", raising=False)
    path = B.main(["--device", "cpu", "--providers", "torch,loomnb,vllm,flashinfer,vllm_torch",
                   "--num-rows", "1,2", "--vocab-sizes", "1000", "--repeats", "2",
                   "--copy-gib", "0.01", "--out", str(tmp_path), "--tag", "t"])
    d = json.loads(Path(path).read_text())
    rows, meta = d["results"], d["meta"]
    assert meta["exact_ref"] == "torch" and any("comparing with torch" in x for x in meta["log"])
    assert len(rows) == 2 * 6 * 2 * 5
    for r in rows:
        if r["provider"] == "torch":
            assert r["status"] == "ok" and r["exact_min"] == 1.0 and r["GBps"] > 0, r
        elif r["provider"] == "loomnb":
            assert r["status"] == "error" and "CUDA device array" in r["reason"], r
        else:
            assert r["status"] in ("skip", "n/a"), r
    assert Path(path).with_suffix(".csv").exists()


def test_cpu_smoke_run_with_mock_vllm(tmp_path, monkeypatch):
    """vLLM's op (a CPU mock under its schema) is the exactness reference of the penalties,
    bound by argument names (stored in meta.vllm); the torch composite stands in for the ops
    vLLM lacks (logged); every composite equals the reference."""
    register_mock_vllm()
    monkeypatch.setattr(B.Vllm, "namespaces", (MOCK_NS,))
    monkeypatch.delenv("LOOMNB_VLLM_LIB", raising=False)
    path = B.main(["--device", "cpu", "--providers", "vllm,torch", "--ops",
                   "apply_penalties_,top_k_renorm_probs,top_p_renorm_probs", "--num-rows", "3",
                   "--vocab-sizes", "777", "--repeats", "2", "--copy-gib", "0.001",
                   "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    rows, meta = d["results"], d["meta"]
    assert meta["exact_ref"] == "vllm" and "already registered" in meta["vllm"]["lib"]
    binding = meta["vllm"]["bindings"]["apply_penalties_"]
    assert "repetition_penalties<-repetition_penalties" in binding
    assert any("top_k_renorm_probs: vLLM has no compiled op" in x for x in meta["log"])
    assert len(rows) == 2 * 3 * 2
    for r in rows:
        if r["provider"] == "vllm" and r["op"] != "apply_penalties_":
            assert r["status"] == "n/a", r
            continue
        assert r["status"] == "ok" and r["exact_min"] == 1.0, r


def test_failing_torch_compile_is_recorded_not_raised(tmp_path, monkeypatch):
    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("mock compile failure")
        return call
    monkeypatch.setattr(torch, "compile", broken)
    path = B.main(["--device", "cpu", "--providers", "torch_compile,torch", "--ops",
                   "sampling_from_logits", "--num-rows", "2", "--vocab-sizes", "500",
                   "--repeats", "1", "--copy-gib", "0.001", "--no-exact", "--out", str(tmp_path)])
    rows = json.loads(Path(path).read_text())["results"]
    comp = [r for r in rows if r["provider"] == "torch_compile"]
    assert len(comp) == 2 and all(r["status"] == "skip" for r in comp)
    assert all("mock compile failure" in r["reason"] for r in comp)
    assert all(r["status"] == "ok" for r in rows if r["provider"] == "torch")


@pytest.fixture(scope="module")
def gpu_env():
    return H.ready_providers(B.FAMILY, names=["loomnb", "flashinfer", "torch", "torch_compile"])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_rows", [1, 32, 128])
@pytest.mark.parametrize("provider", ["loomnb", "flashinfer", "torch", "torch_compile"])
@pytest.mark.parametrize("op", list(B.OPS))
def test_gpu(benchmark, gpu_env, op, provider, num_rows):
    args, provs = gpu_env
    prov, o, V = provs[provider], B.OPS[op], 151936
    case = {"op": op, "dtype": "fp32", "num_rows": num_rows, "vocab_size": V, "params": "scalar"}
    reason = prov.skip or prov.unsupported(case)
    if reason:
        pytest.skip(reason)
    t = B.make_inputs(o, num_rows, V, "fp32", "cuda", 0)
    call, _ = prov.bind(o, t, case)
    H.benchmark_graph(benchmark, call, B.op_bytes(o, num_rows, V), rounds=10, warmup_rounds=2)
