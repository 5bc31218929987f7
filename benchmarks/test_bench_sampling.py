"""pytest entry points for the sampling-family benchmark.

    pytest benchmarks/test_bench_sampling.py                    # CPU checks (+ GPU cases if CUDA)
    pytest benchmarks/test_bench_sampling.py -k gpu --benchmark-only

The CPU tests check the bytes model, that the torch composites (the peers) compute what the
oracles define, the dry run end to end (JSON, CSV, summary) and the real sweep path on the CPU
with the torch provider. The GPU cases (skipped without CUDA) time graph replays of each op at
1/32/128 rows x 151,936 through pytest-benchmark.
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
import bench_sampling as B  # noqa: E402
import summarize as S  # noqa: E402

import loomnb.oracle  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def test_bytes_model():
    V = 151936
    assert B.op_bytes(B.OPS["greedy_logprob_rank_v1"], 1, V) == 4 * V + 20
    assert B.op_bytes(B.OPS["greedy_logprob_rank_v2"], 128, V, "bf16") == 128 * (2 * V + 20)
    assert B.op_bytes(B.OPS["min_p_v1"], 32, V) == 32 * (8 * V + 4)
    # the floor: 128 rows x 151,936 fp32 read once = 77.8 MB, ~19 µs at 4.2 TB/s
    assert abs(B.op_bytes(B.OPS["greedy_logprob_rank_v1"], 128, V) / 4.2e12 * 1e6 - 18.5) < 0.5


@pytest.mark.parametrize("sampler", ["v1", "v2"])
def test_greedy_composites_compute_the_oracles_values(sampler):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 3000)) * 3).astype(np.float32)
    x[1] = -np.inf
    x[2, 7] = np.nan
    tok, lp, rank = B.COMPOSITES[f"greedy_logprob_rank_{sampler}"](torch.from_numpy(x))
    otok, olp, orank = loomnb.oracle.greedy_sample_logprob(x, sampler)
    assert np.array_equal(tok.numpy(), otok) and np.array_equal(rank.numpy(), orank)
    np.testing.assert_allclose(lp.numpy(), olp, rtol=1e-5, atol=1e-6)  # NaN where the oracle's


@pytest.mark.parametrize("sampler", ["v1", "v2"])
def test_min_p_composites_compute_the_oracles_mask(sampler):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 2000)) * 2).astype(np.float32)
    mp = np.array([0.05, 0.0, 0.5], np.float32)
    got = B.COMPOSITES[f"min_p_{sampler}"](torch.from_numpy(x.copy()), torch.from_numpy(mp)).numpy()
    want = loomnb.oracle.min_p_filter_(x.copy(), mp, sampler)
    assert np.array_equal(got == -np.inf, want == -np.inf)


def test_args_and_cases():
    a = B.parse_args(["--dry-run", "--quick"])
    assert a.num_rows == [1, 32, 128] and a.vocab_size == [151936] and a.dtype == "fp32"
    assert a.exact_ref == "torch", "vLLM has no compiled op for these: torch is the reference"
    assert len(B.FAMILY.cases(a)) == 4 * 3
    a = B.parse_args(["--dry-run", "--dtype", "bf16", "--vocab-sizes", "49152,128256"])
    assert a.num_rows == [1, 8, 32, 128, 512] and len(B.FAMILY.cases(a)) == 4 * 2 * 5


def test_dry_run_and_summary(tmp_path):
    path = B.main(["--dry-run", "--quick", "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    rows = d["results"]
    assert d["meta"]["dry_run"] and d["meta"]["x_axis"] == "num_rows"
    assert len(rows) == 2 * 4 * 3 * (len(B.PROVIDERS) - len(B.TUNED)), "--tune variants only when named"
    by = {(r["pass"], r["op"], r["num_rows"], r["provider"]): r for r in rows}
    assert by[("forward", "min_p_v1", 32, "loomnb")]["status"] == "ok"
    assert by[("reverse", "greedy_logprob_rank_v2", 1, "vllm")]["status"] == "n/a"
    assert by[("forward", "greedy_logprob_rank_v1", 1, "vllm_triton")]["status"] == "n/a"
    md = S.main([str(path), "--out-dir", str(tmp_path), "--no-plots"]).read_text()
    assert "DRY RUN" in md and "greedy_logprob_rank_v1" in md


def test_cpu_smoke_run_end_to_end(tmp_path, monkeypatch):
    """The real sweep on the CPU: torch composites timed by the wall-clock fallback, exactness
    against the torch reference, both provider orders, JSON and CSV. (loomnb itself needs a GPU:
    its CPU rows are errors that name the reason.)"""
    monkeypatch.delenv("LOOMNB_VLLM_LIB", raising=False)
    path = B.main(["--device", "cpu", "--providers", "torch,loomnb,vllm", "--num-rows", "1,2",
                   "--vocab-sizes", "1000", "--repeats", "2", "--copy-gib", "0.01",
                   "--out", str(tmp_path), "--tag", "t"])
    d = json.loads(Path(path).read_text())
    rows = d["results"]
    assert d["meta"]["exact_ref"] == "torch"
    assert len(rows) == 2 * 4 * 2 * 3
    for r in rows:
        if r["provider"] == "torch":
            assert r["status"] == "ok" and r["exact_min"] == 1.0 and r["GBps"] > 0, r
        elif r["provider"] == "loomnb":
            assert r["status"] == "error" and "CUDA device array" in r["reason"], r
        else:
            assert r["status"] in ("skip", "n/a"), r
    assert Path(path).with_suffix(".csv").exists()


@pytest.fixture(scope="module")
def gpu_env():
    return H.ready_providers(B.FAMILY)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_rows", [1, 32, 128])
@pytest.mark.parametrize("provider", ["loomnb", "torch", "torch_compile"])
@pytest.mark.parametrize("op", list(B.OPS))
def test_gpu(benchmark, gpu_env, op, provider, num_rows):
    args, provs = gpu_env
    prov, o, V = provs[provider], B.OPS[op], 151936
    case = {"op": op, "dtype": "fp32", "num_rows": num_rows, "vocab_size": V}
    reason = prov.skip or prov.unsupported(case)
    if reason:
        pytest.skip(reason)
    t = B.make_inputs(o, num_rows, V, "fp32", "cuda", 0)
    call, _ = prov.bind(o, t, case)
    H.benchmark_graph(benchmark, call, B.op_bytes(o, num_rows, V), rounds=10, warmup_rounds=2)
