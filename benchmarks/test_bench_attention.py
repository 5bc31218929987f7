"""pytest entry points for the paged decode attention benchmark.

    pytest benchmarks/test_bench_attention.py                 # CPU checks (+ GPU cases if CUDA)
    pytest benchmarks/test_bench_attention.py -k gpu --benchmark-only

The CPU tests check the bytes model, the inputs (a shuffled permutation of pages, the views of
the interleaved cache), that the torch composite and the legacy layout the vLLM provider builds
compute the oracle's values, the target evaluation, the dry run end to end (JSON, CSV, summary)
and the real sweep path on the CPU with the torch provider. The GPU cases (skipped without
CUDA) time graph replays of each provider at the anchor shapes through pytest-benchmark.
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
import bench_attention as B  # noqa: E402
import summarize as S  # noqa: E402

import loomnb.oracle  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def _case(geometry="9/3/64", S_=2, L=40, cache="bf16"):
    hq, hk, d = B.GEOMETRIES[geometry]
    return {"op": B.OP.name, "geometry": geometry, "num_heads": hq, "num_kv_heads": hk,
            "head_size": d, "block_size": 16, "cache": cache, "num_seqs": S_, "context": L,
            "dtype": "bf16", "bytes": B.kv_bytes(S_, L, hk, d, cache)}


def _np(t):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def test_bytes_model():
    # 32 x 4096 tokens of 8 x 128 bf16 KV heads: 537 MB, 127 µs at 4.24 TB/s (FA3: 134.7 µs, 94%)
    assert B.kv_bytes(32, 4096, 8, 128) == 32 * 4096 * 8 * 128 * 2 * 2 == 536870912
    assert abs(B.kv_bytes(32, 4096, 8, 128) / 4.241e12 * 1e6 - 126.6) < 0.5
    assert B.kv_bytes(8, 16384, 3, 64, "fp8") * 2 == B.kv_bytes(8, 16384, 3, 64, "bf16")
    a = B.parse_args(["--dry-run", "--quick"])
    cases = B.FAMILY.cases(a)
    assert {c["num_seqs"] for c in cases} == {1, 32}
    assert {(c["cache"], c["context"]) for c in cases} == {("bf16", 32), ("bf16", 1024),
                                                          ("bf16", 16384), ("fp8", 16384)}
    assert all(c["bytes"] == B.FAMILY.op_bytes(B.OP, c) for c in cases)
    lean = B.FAMILY.cases(B.parse_args(["--dry-run"]))
    assert len(lean) == 2 * 4 * (4 + 2)
    full = B.FAMILY.cases(B.parse_args(["--dry-run", "--full"]))
    assert len(full) == 2 * 4 * (7 + 3)


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_inputs_are_shuffled_pages_of_an_interleaved_cache(cache):
    case = _case(L=40, cache=cache)
    t = B.make_inputs(case, "cpu", 0)
    bt = t["block_tables"]
    assert bt.dtype == torch.int32 and bt.shape == (2, 3)
    assert sorted(bt.reshape(-1).tolist()) == list(range(6))
    assert bt.reshape(-1).tolist() != list(range(6)), "pages are shuffled"
    assert t["key_cache"].data_ptr() == t["kv"].data_ptr()
    assert t["key_cache"].stride() == (2 * 16 * 3 * 64, 3 * 64, 64, 1)
    assert (t["seq_lens"] == 40).all()


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_torch_composite_and_legacy_layout_compute_the_oracles_values(cache):
    """The eager composite (in float32) equals the float64 oracle, and the legacy caches the
    vLLM provider builds hold the same values (the oracle reads them as the 5-D key and the
    permuted value)."""
    case = _case(L=37, cache=cache)
    t = B.make_inputs(case, "cpu", 1)
    t["seq_lens"][1] = 20  # ragged: the mask matters
    scale = 64 ** -0.5
    q32 = t["query"].float()
    fp8 = cache == "fp8"
    kc, vc = t["key_cache"], t["value_cache"]
    got = B.t_decode(q32, kc if fp8 else kc.float(), vc if fp8 else vc.float(), t["block_tables"],
                     t["seq_lens"], scale, t["k_scale"], t["v_scale"])
    kw = dict(kv_cache_dtype="fp8" if fp8 else "auto",
              k_scale=_np(t["k_scale"]) if fp8 else None, v_scale=_np(t["v_scale"]) if fp8 else None)
    args = (_np(t["block_tables"]), _np(t["seq_lens"]), scale)
    want, _, _ = loomnb.oracle.attention.decode_exact(_np(q32), _np(kc), _np(vc), *args, **kw)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
    lk, lv = B.legacy_caches(t)
    assert lk.shape == (6, 3, 64 // (16 // kc.element_size()), 16, 16 // kc.element_size())
    again, _, _ = loomnb.oracle.attention.decode_exact(_np(q32), _np(lk), _np(lv.permute(0, 3, 1, 2)),
                                                       *args, **kw)
    assert np.array_equal(again, want)


def test_target_evaluation():
    def row(g, cache, S_, L, prov, us):
        return {"geometry": g, "cache": cache, "num_seqs": S_, "context": L, "provider": prov,
                "graph_us": us, "status": "ok"}
    rows = [row("32/8/128", "bf16", 32, 4096, "loomnb", 140.0), row("32/8/128", "bf16", 32, 4096, "fa3", 134.7),
            row("32/8/128", "bf16", 32, 4096, "vllm", 500.0),
            row("9/3/64", "bf16", 32, 4096, "loomnb", 30.0),       # vs the anchor 37.4: 1.25
            row("9/3/64", "bf16", 32, 32, "loomnb", 5.0),          # vs the anchor 5.8: 1.16 < 1.3
            row("9/3/64", "fp8", 32, 4096, "loomnb", 17.0)]
    got = B.evaluate_targets(rows)

    def find(prefix, g, L, cache="bf16"):
        hit = [x for x in got if x["target"].startswith(prefix) and x["geometry"] == g
               and x["context"] == L and x["cache"] == cache]
        assert len(hit) == 1, (prefix, g, L, got)
        return hit[0]
    a = find(">= 0.9x", "32/8/128", 4096)
    assert a["met"] and a["peer"] == "fa3" and abs(a["ratio"] - 134.7 / 140) < 1e-9
    assert find("faster than vllm", "32/8/128", 4096)["met"]
    b = find(">= 1.2x", "9/3/64", 4096)
    assert b["met"] and b["peer"].startswith("anchor")
    assert not find(">= 1.3x", "9/3/64", 32)["met"]
    assert find(">= 1.6x", "9/3/64", 4096, "fp8")["met"]  # 30 / 17 = 1.76


def test_dry_run_and_summary(tmp_path):
    path = B.main(["--dry-run", "--quick", "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    assert d["meta"]["dry_run"] and d["meta"]["x_axis"] == "context"
    n_cases = 2 * 2 * 4  # geometries x batches x (3 bf16 contexts + 1 FP8)
    assert len(d["results"]) == 2 * n_cases * (len(B.PROVIDERS) - len(B.TUNED)), "--tune variants only when named"
    assert d["meta"]["targets"] and all("ratio" in x for x in d["meta"]["targets"])
    md = S.main([str(path), "--out-dir", str(tmp_path), "--no-plots"]).read_text()
    assert "DRY RUN" in md and "9/3/64 fp8 cache, 32 seqs" in md


def test_cpu_smoke_run_end_to_end(tmp_path, monkeypatch):
    """The real sweep path on the CPU: the torch provider (wall-clock 'timings'), exactness
    against it, both provider orders, JSON/CSV; providers without their libraries are skipped
    with their reasons."""
    monkeypatch.delenv("LOOMNB_VLLM_LIB", raising=False)
    monkeypatch.delenv("LOOMNB_FA3_LIB", raising=False)
    path = B.main(["--device", "cpu", "--providers", "torch,fa3,flashinfer", "--context", "16,40",
                   "--batches", "1,2", "--geometries", "9/3/64", "--caches", "bf16",
                   "--repeats", "2", "--copy-gib", "0.01", "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    rows = d["results"]
    assert len(rows) == 2 * 4 * 3
    ok = [r for r in rows if r["provider"] == "torch"]
    assert all(r["status"] == "ok" and r["timer"] == "cpu-wallclock" and r["GBps"] > 0 for r in ok)
    assert all(r["exact_min"] == 1.0 for r in ok)
    skipped = {r["provider"]: r["reason"] for r in rows if r["status"] == "skip"}
    assert "LOOMNB_FA3_LIB" in skipped["fa3"] and "--flashinfer" in skipped["flashinfer"]
    assert Path(path).with_suffix(".csv").exists()


# ---------------------------------------------------------------- GPU benchmark entry points
SHAPES = [("32/8/128", 8, 4096), ("32/8/128", 32, 32), ("9/3/64", 32, 4096), ("9/3/64", 1, 1024)]


@pytest.fixture(scope="module")
def gpu_env():
    return H.ready_providers(B.FAMILY)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-{s[1]}x{s[2]}")
@pytest.mark.parametrize("provider", list(B.PROVIDERS))
def test_gpu(benchmark, gpu_env, provider, shape):
    args, provs = gpu_env
    prov = provs[provider]
    case = _case(*shape)
    reason = prov.skip or prov.unsupported(case)
    if reason:
        pytest.skip(reason)
    t = B.make_inputs(case, "cuda", 0)
    call, _ = prov.bind(B.OP, t, case)
    H.benchmark_graph(benchmark, call, case["bytes"], rounds=10, warmup_rounds=1)
