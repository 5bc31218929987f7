"""pytest entry points for the RoPE + KV-cache benchmark.

    pytest benchmarks/test_bench_rope_cache.py            # CPU checks (+ the GPU case if CUDA)

The CPU tests check the bytes model against a hand count, the case plan (lean default, quick,
explicit flags), binding vLLM's two ops by schema names (mocked on the CPU with the torch
composite under vLLM's schemas), exactness plumbing, both provider orders, and the dry run end
to end. The GPU case (skipped without CUDA) runs the quick sweep for real.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import bench_rope_cache as B  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
SCHEMAS = {  # vLLM 0.24 (stable ABI) schemas, in two namespaces
    "rotary_embedding": "(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
    "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()",
    "reshape_and_cache_flash": "(Tensor key, Tensor value, Tensor! key_cache, Tensor! "
    "value_cache, Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()",
}
ROPE_NS, CACHE_NS = "loomnb_mock_rope", "loomnb_mock_cache_ops"


def register_mock_vllm():
    """vLLM's two ops on the CPU, implemented with the benchmark's torch composite."""

    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox,
                         rope_dim_offset=0, inverse=False):
        T, D = positions.shape[0], head_size
        cos, sin = cos_sin_cache[positions].float().chunk(2, -1)
        cos, sin = cos[:, None], sin[:, None]
        for x in (query, key):
            x3 = x.view(T, -1, D)
            x1, x2 = x3[..., :D // 2].float(), x3[..., D // 2:].float()
            x3.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1))

    def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                k_scale, v_scale):
        blk, off = slot_mapping // key_cache.shape[1], slot_mapping % key_cache.shape[1]
        n = slot_mapping.shape[0]
        if kv_cache_dtype == "auto":
            key_cache[blk, off] = key[:n]
            value_cache[blk, off] = value[:n]
        else:
            q8 = lambda x, s: (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)  # noqa: E731
            key_cache[blk, off] = q8(key[:n], k_scale).view(torch.uint8)
            value_cache[blk, off] = q8(value[:n], v_scale).view(torch.uint8)

    for ns, name, fn in ((ROPE_NS, "rotary_embedding", rotary_embedding),
                         (CACHE_NS, "reshape_and_cache_flash", reshape_and_cache_flash)):
        H.register_mock_ops(ns, {name: SCHEMAS[name]}, {name: fn})


def test_bytes_model():
    # 32/8/128 bf16, one token: q 2*32*128*2, k 2*8*128*2 + v 8*128*2, cache 2*8*128*2, cos/sin
    # row 128*2, position and slot 16
    assert B.op_bytes(1, 32, 8, 128) == 16384 + 6144 + 4096 + 256 + 16
    assert B.op_bytes(1, 32, 8, 128, "fp8") == 16384 + 6144 + 2048 + 256 + 16
    assert B.op_bytes(2048, 32, 8, 128) == 2048 * 26896  # ~55 MB: ~13 us at 4.2 TB/s


def test_case_plan():
    fam = B.FAMILY
    default = fam.cases(B.parse_args(["--dry-run"]))
    assert len(default) == 12 + 3 + 3
    assert {c["shape"] for c in default} == {"32/8/128 bf16", "32/8/128 fp8", "28/4/128 bf16",
                                             "9/3/64 bf16"}
    quick = fam.cases(B.parse_args(["--dry-run", "--quick"]))
    assert [c["num_tokens"] for c in quick] == [1, 128, 2048]
    explicit = fam.cases(B.parse_args(["--dry-run", "--geometries", "9/3/64,28/4/128",
                                       "--kv-dtypes", "fp8", "--num-tokens", "4"]))
    assert [(c["num_heads"], c["kv"], c["num_tokens"]) for c in explicit] == [(9, "fp8", 4),
                                                                              (28, "fp8", 4)]
    with pytest.raises(SystemExit):
        B.parse_args(["--dry-run", "--geometries", "32/8"])


def test_torch_composite_matches_the_oracle_layout():
    """The composite writes the cache rows at the slots and rotates q/k (values sane)."""
    case = {"num_tokens": 5, "num_heads": 4, "num_kv_heads": 2, "head_size": 64, "kv": "bf16"}
    t = B.make_inputs(case, "cpu", 0)
    q0 = t["query"].clone()
    B.t_rope_cache(*B._args(t))
    out = B.collect(t)(None)
    assert torch.equal(out["key_cache_rows"], t["key"].view(5, 2, 64))
    assert torch.equal(out["value_cache_rows"], t["value"].view(5, 2, 64))
    assert not torch.equal(q0, t["query"])
    norms = lambda x: x.float().view(5, 4, 2, 32).pow(2).sum(2)  # noqa: E731 - rotation keeps pair norms
    assert torch.allclose(norms(q0), norms(t["query"]), rtol=2e-2)


def test_cpu_smoke_run_with_mock_vllm(tmp_path, monkeypatch):
    """The real sweep path on the CPU: mock vLLM ops bound by schema names, exactness vs them,
    wall-clock timers, both provider orders, JSON/CSV."""
    register_mock_vllm()
    monkeypatch.setattr(B.Vllm, "rope_ns", ROPE_NS)
    monkeypatch.setattr(B.Vllm, "cache_ns", CACHE_NS)
    monkeypatch.delenv("LOOMNB_VLLM_LIB", raising=False)
    path = B.main(["--device", "cpu", "--providers", "vllm,torch,flashinfer",
                   "--geometries", "9/3/64", "--kv-dtypes", "bf16,fp8", "--num-tokens", "1,8",
                   "--repeats", "2", "--copy-gib", "0.01", "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    rows, meta = d["results"], d["meta"]
    assert len(rows) == 2 * 4 * 3 and meta["exact_ref"] == "vllm"
    assert set(meta["vllm"]["schemas"]) == {"rotary_embedding", "reshape_and_cache_flash"}
    assert "positions<-positions" in meta["vllm"]["bindings"]["rope_cache"]
    by = {(r["pass"], r["shape"], r["num_tokens"], r["provider"]): r for r in rows}
    for kv in ("bf16", "fp8"):
        for nt in (1, 8):
            for p in ("vllm", "torch"):
                r = by[("forward", f"9/3/64 {kv}", nt, p)]
                assert r["status"] == "ok", r
                assert r["exact_min"] == 1.0 and set(r["exact"]) == set(B.OPS["rope_cache"].writes)
            fi = by[("forward", f"9/3/64 {kv}", nt, "flashinfer")]
            assert fi["status"] in ("skip", "n/a"), fi
    assert by[("reverse", "9/3/64 bf16", 1, "vllm")]["position"] == 2


def test_dry_run(tmp_path):
    path = B.main(["--dry-run", "--quick", "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    assert d["meta"]["dry_run"] and len(d["results"]) == 2 * 3 * len(B.PROVIDERS)
    assert {r["provider"] for r in d["results"]} == set(B.PROVIDERS)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_quick_sweep(tmp_path):
    """The quick sweep on the GPU; loomnb's rows exist, are timed, and are byte-equal to the
    reference (vLLM when $LOOMNB_VLLM_LIB is set, else the torch composite: then only the
    cache rows must be equal, the composite's fp32 RoPE may differ by an ulp)."""
    path = B.main(["--quick", "--providers", "loomnb,loomnb_two,torch", "--repeats", "3",
                   "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    ok = [r for r in d["results"] if r["provider"] == "loomnb" and r["status"] == "ok"]
    assert len(ok) == 6 and all(r["graph_us"] > 0 for r in ok)
    two = {(r["pass"], r["num_tokens"]): r for r in d["results"] if r["provider"] == "loomnb_two"}
    assert all(r["status"] == "ok" for r in two.values())
    assert all(r["exact"]["key_cache_rows"] == 1.0 or r["exact"]["key"] < 1.0 for r in ok)
