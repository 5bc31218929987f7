"""pytest entry points for the KV-cache movement benchmark.

    pytest benchmarks/test_bench_kv_blocks.py            # CPU checks (+ the GPU case if CUDA)

The CPU tests check the bytes model against hand counts, the case plan (default, quick, the
explicit flags, each swap case followed by its copy floor), that the torch composites compute
what loomnb's oracle computes on the benchmark's own inputs, the target evaluation, the
eager-only timing rule, binding vLLM's cache ops by schema names (mocked on the CPU by the
oracle under vLLM 0.24's schemas, one op left out to exercise the torch stand-in) with
exactness, both provider orders and the summary, and the dry run end to end. The GPU case
(skipped without CUDA) runs the quick sweep for real.
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
import bench_kv_blocks as B  # noqa: E402
import summarize as S  # noqa: E402

from loomnb.oracle import kv_blocks as O  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
MOCK_NS = "loomnb_mock_kvb_cache_ops"
SCHEMAS = {  # vLLM 0.24 (stable ABI, _C_cache_ops); it has no copy_blocks / copy_blocks_mla
    "swap_blocks": "(Tensor src, Tensor! dst, int block_size_in_bytes, Tensor block_mapping) -> ()",
    "cp_gather_cache": "(Tensor src_cache, Tensor! dst, Tensor block_table, Tensor cu_seq_lens, "
                       "int batch_size, Tensor? seq_starts) -> ()",
    "gather_and_maybe_dequant_cache": "(Tensor src_cache, Tensor! dst, Tensor block_table, "
                                      "Tensor cu_seq_lens, Tensor token_to_seq, int num_tokens, "
                                      "str kv_cache_dtype, Tensor scale, Tensor? seq_starts) -> ()",
    "concat_and_cache_mla": "(Tensor kv_c, Tensor k_pe, Tensor! kv_cache, Tensor slot_mapping, "
                            "str kv_cache_dtype, Tensor scale) -> ()",
}


def np_view(t):
    """A NumPy view sharing ``t``'s memory (bf16 as ml_dtypes.bfloat16), for the oracle."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def register_mock_vllm():
    """vLLM's cache ops on the CPU, computed by loomnb's oracle in place on the tensors."""

    def swap_blocks(src, dst, block_size_in_bytes, block_mapping):
        O.swap_blocks(np_view(src), np_view(dst), block_size_in_bytes, block_mapping.numpy())

    def cp_gather_cache(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts=None):
        assert batch_size == cu_seq_lens.shape[0] - 1
        O.gather_cache(np_view(src_cache), np_view(dst), block_table.numpy(), cu_seq_lens.numpy())

    def gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens, token_to_seq,
                                       num_tokens, kv_cache_dtype, scale, seq_starts=None):
        assert num_tokens == token_to_seq.shape[0] == dst.shape[0]
        O.gather_cache(np_view(src_cache), np_view(dst), block_table.numpy(), cu_seq_lens.numpy(),
                       kv_cache_dtype, scale.numpy())

    def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
        O.concat_and_cache_mla(np_view(kv_c), np_view(k_pe), np_view(kv_cache),
                               slot_mapping.numpy(), kv_cache_dtype, scale.numpy())

    impls = {f.__name__: f for f in (swap_blocks, cp_gather_cache, gather_and_maybe_dequant_cache,
                                     concat_and_cache_mla)}
    H.register_mock_ops(MOCK_NS, SCHEMAS, impls)


def _case(op, **kw):
    args = B.parse_args(["--dry-run", "--ops", op, "--size", str(kw.pop("size")),
                         *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in kw.items()), [])])
    return B.FAMILY.cases(args)


# ---------------------------------------------------------------- bytes model and plan
def test_bytes_model():
    assert B.block_bytes(64) == 2 * 16 * 8 * 128 * 2 == 65536
    assert B.block_bytes(16) == 2 * 16 * 4 * 64 * 2 == 16384
    # 2,048 pairs of 64 KB blocks, one layer: 268 MB, the copy floor ~63 µs at 4.24 TB/s
    one = {"op": "copy_blocks", "pairs": 2048, "layers": 1}
    assert B.op_bytes(one) == 2 * 2048 * 65536 + 16 * 2048
    assert abs(B.op_bytes(one) / 4.24e12 * 1e6 - 63.3) < 0.5
    assert B.op_bytes({**one, "layers": 32}) == 32 * 2 * 2048 * 65536 + 16 * 2048
    swap = {"op": "swap_blocks", "blocks": 2048, "block_kb": 16, "direction": "d2h"}
    assert B.op_bytes(swap) == 2 * 2048 * 16384 + 16 * 2048
    assert B.op_bytes({**swap, "op": "pcie_copy"}) == 2 * 2048 * 16384
    # K pages of 2,048 blocks: 32,768 tokens x 8 x 128, read as bf16 and written as bf16
    k = {"op": "gather_cache", "source": "k_pages", "kv": "bf16", "num_tokens": 32768}
    assert B.op_bytes(k) == 32768 * 1024 * 4 == 134217728
    fp8 = {"op": "gather_cache", "source": "mla", "kv": "fp8", "num_tokens": 8192}
    assert B.op_bytes(fp8) == 8192 * 576 * (1 + 2)
    mla = {"op": "concat_and_cache_mla", "kv": "bf16", "num_tokens": 1}
    assert B.op_bytes(mla) == 576 * 4 + 8 and B.op_bytes({**mla, "kv": "fp8"}) == 576 * 3 + 8
    perm = B.permutation(2048)
    assert sorted(perm.tolist()) == list(range(2048))
    assert np.array_equal(perm, B.permutation(2048)), "fixed per size"
    moved = int((perm != np.arange(2048)).sum())
    assert 2040 <= moved <= 2048 and B.moved_blocks(2048) == moved
    c = {"op": "compact_blocks", "blocks": 2048, "layers": 32}
    assert B.op_bytes(c) == 2 * moved * 65536 * 32


def test_case_plan():
    fam = B.FAMILY
    default = fam.cases(B.parse_args(["--dry-run"]))
    count = {}
    for c in default:
        count[c["op"]] = count.get(c["op"], 0) + 1
        assert c["bytes"] == B.op_bytes(c) and c["x"] == c["size"] and c["dtype"] == "bf16"
    assert count == {"copy_blocks": 6, "swap_blocks": 12, "pcie_copy": 12, "gather_cache": 7,
                     "concat_and_cache_mla": 10, "compact_blocks": 3}
    for i, c in enumerate(default):  # every swap case is followed by its floor, same shape/size
        if c["op"] == "swap_blocks":
            f = default[i + 1]
            assert f["op"] == "pcie_copy" and (f["shape"], f["size"]) == (c["shape"], c["size"])
    k = [c for c in default if c["op"] == "gather_cache" and c["source"] == "k_pages"]
    assert [(c["num_tokens"], c["num_seqs"]) for c in k] == [(32768, 16)]  # 2,048 blocks
    mla_gather = {(c["kv"], c["num_tokens"], c["num_seqs"]) for c in default
                  if c["op"] == "gather_cache" and c["source"] == "mla"}
    assert ("bf16", 1024, 1) in mla_gather and ("fp8", 32768, 16) in mla_gather
    compact = [c for c in default if c["op"] == "compact_blocks"]
    assert [(c["layers"], c["blocks"]) for c in compact] == [(1, 2048), (1, 16384), (32, 1024)]
    assert all(c["torch_temporary_bytes"] == c["blocks"] * 65536 for c in compact)
    assert len(fam.cases(B.parse_args(["--dry-run", "--quick"]))) == 15

    swaps = _case("swap_blocks", size="64,512", block_kb=16)
    assert [(c["op"], c["direction"], c["block_kb"], c["blocks"]) for c in swaps] == [
        (o, d, 16, n) for d in ("d2h", "h2d") for n in (64, 512)
        for o in ("swap_blocks", "pcie_copy")]
    assert [(c["layers"], c["pairs"]) for c in _case("copy_blocks", size=8, layers=4)] == [(4, 8)]
    g = _case("gather_cache", size=4096, kv_dtypes="fp8")
    assert [(c["source"], c["kv"], c["num_tokens"], c["num_seqs"]) for c in g] == [
        ("k_pages", "bf16", 4096, 2), ("mla", "fp8", 4096, 2)]
    assert [c["op"] for c in _case("pcie_copy", size=16, directions="h2d")] == ["pcie_copy"] * 2
    with pytest.raises(SystemExit):
        B.parse_args(["--dry-run", "--block-kb", "32"])


# ---------------------------------------------------------------- the torch composites
def _small(op, monkeypatch, **kw):
    monkeypatch.setattr(B, "MIN_POOL", 8)
    size = kw.pop("size", 5)
    cases = [c for c in _case(op, size=size, **kw) if c["op"] == op]
    return cases


@pytest.mark.parametrize("layers", [1, 3])
def test_torch_copy_and_compact_match_the_oracle(layers, monkeypatch):
    for c in _small("copy_blocks", monkeypatch, layers=layers):
        t = B.make_inputs(c, "cpu", 0)
        want = [np_view(x).copy() for x in t["caches"]]
        O.copy_blocks(want, [], t["block_mapping"].numpy())
        B.torch_call("copy_blocks", t, c)()
        assert all(np.array_equal(np_view(x), w) for x, w in zip(t["caches"], want))
        got = B.collect("copy_blocks", t)(None)["dst_blocks"]
        assert got.shape == (layers, 5, 2, 16, 8, 128)
    for c in _small("compact_blocks", monkeypatch, size=37, layers=layers):
        t = B.make_inputs(c, "cpu", 0)
        want = [np_view(x).copy() for x in t["caches"]]
        O.compact_blocks(want, t["permutation"].numpy())
        B.torch_call("compact_blocks", t, c)()
        assert all(np.array_equal(np_view(x), w) for x, w in zip(t["caches"], want))


def test_torch_swap_and_floor_match_the_oracle(monkeypatch):
    for c in _small("swap_blocks", monkeypatch, size=6):
        t = B.make_inputs(c, "cpu", 1)
        want = np_view(t["dst"]).copy()
        O.swap_blocks(np_view(t["src"]), want, t["block_size_in_bytes"],
                      t["block_mapping_cpu"].numpy())
        assert not np.array_equal(np_view(t["dst"]), want)
        B.torch_call("swap_blocks", t, c)()
        assert np.array_equal(np_view(t["dst"]), want), c["shape"]
        # the host side is the consecutive blocks 0..n-1; the GPU side random distinct blocks
        host_col = 1 if c["direction"] == "d2h" else 0
        assert t["block_mapping_cpu"][:, host_col].tolist() == list(range(6))
        assert len(set(t["block_mapping_cpu"][:, 1 - host_col].tolist())) == 6
        floor = B.make_inputs({**c, "op": "pcie_copy"}, "cpu", 1)
        B.torch_call("pcie_copy", floor, c)()
        out = B.collect("pcie_copy", floor)(None)["dst"]
        assert torch.equal(floor["host"], floor["staging"]) and out.numel() == 6 * c["block_kb"] * 512


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_torch_gather_and_mla_write_match_the_oracle(kv, monkeypatch):
    for c in _small("gather_cache", monkeypatch, size=37, kv_dtypes=kv):
        t = B.make_inputs(c, "cpu", 2)
        want = np_view(t["dst"]).copy()
        O.gather_cache(np_view(t["src_cache"]), want, t["block_table"].numpy(),
                       t["cu_seq_lens"].numpy(), t["kv_cache_dtype"], t["scale"].numpy())
        B.torch_call("gather_cache", t, c)()
        assert np.array_equal(np_view(t["dst"]).view(np.uint16), want.view(np.uint16)), c["shape"]
        assert t["block_table"].dtype == t["cu_seq_lens"].dtype == torch.int32
    for c in _small("concat_and_cache_mla", monkeypatch, size=21, kv_dtypes=kv):
        t = B.make_inputs(c, "cpu", 3)
        assert t["k_pe"].stride(0) == 576, "k_pe is a slice of the projection output"
        want = np_view(t["kv_cache"]).copy()
        O.concat_and_cache_mla(np_view(t["kv_c"]), np_view(t["k_pe"]), want,
                               t["slot_mapping"].numpy(), t["kv_cache_dtype"], t["scale"].numpy())
        B.torch_call("concat_and_cache_mla", t, c)()
        assert np.array_equal(np_view(t["kv_cache"]).view(np.uint8), want.view(np.uint8))


# ---------------------------------------------------------------- timing rule and targets
def test_eager_only_rule_and_capture_fallback(monkeypatch):
    compact = {"op": "compact_blocks"}
    swap = {"op": "swap_blocks"}
    assert B.eager_only(B.Torch(), compact) and B.eager_only(B.Loomnb(), compact)
    assert B.eager_only(B.LoomnbHostMap(), swap) and not B.eager_only(B.Loomnb(), swap)
    args = B.parse_args(["--device", "cpu", "--repeats", "2"])
    args.l2_bytes = H.DEFAULT_L2_BYTES
    case = _small("concat_and_cache_mla", monkeypatch, size=4, kv_dtypes="bf16")[0]
    prov = H.make_provider(B.FAMILY, "torch")

    def broken(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(H, "time_case", broken)
    out = B._case_timing(None, B.FAMILY, args, prov, case, 0)
    assert out["graph_us"] == out["eager_us"] > 0 and out["graph_us_from"] == "eager"
    assert "capture failed" in out["timer"]
    assert "not permitted" in out["graph_error"]


def test_target_evaluation():
    def row(op, shape, size, prov, us, gbps=1.0, exact=1.0, graph=True):
        return {"op": op, "shape": shape, "size": size, "provider": prov, "status": "ok",
                "graph_us": us if graph else None, "eager_us": us, "GBps": gbps,
                "exact_min": exact}
    cb = "1 layer, 64 KB blocks"
    rows = [row("copy_blocks", cb, 2048, "loomnb", 70.0, 3800.0), row("copy_blocks", cb, 2048, "torch", 261.0),
            row("copy_blocks", cb, 16, "loomnb", 3.0), row("copy_blocks", cb, 16, "torch", 2.5),
            row("swap_blocks", "d2h 16 KB blocks", 2048, "loomnb", 1400.0),
            row("pcie_copy", "d2h 16 KB blocks", 2048, "torch", 1300.0, 103.0),
            row("swap_blocks", "d2h 16 KB blocks", 16, "loomnb", 30.0),
            row("gather_cache", "MLA 576 bf16", 8192, "loomnb", 8.0),
            row("gather_cache", "MLA 576 bf16", 8192, "vllm", 12.0),
            row("concat_and_cache_mla", "512+64, fp8 cache", 64, "loomnb", 3.0, exact=0.999),
            row("concat_and_cache_mla", "512+64, fp8 cache", 64, "vllm", 3.3),
            row("compact_blocks", cb, 2048, "loomnb", 900.0, graph=False)]
    rows += [dict(r, graph_us=r["graph_us"] and r["graph_us"] * 1.02) for r in rows]  # 2nd pass
    got = B.evaluate_targets(rows, 4240.0, "vllm")

    def find(op, size, prefix):
        hit = [t for t in got if t["op"] == op and t["size"] == size and t["target"].startswith(prefix)]
        assert len(hit) == 1, (op, size, prefix, got)
        return hit[0]
    a = find("copy_blocks", 2048, ">= 3.0x torch")
    assert a["met"] and abs(a["ratio"] - 261 / 70) < 1e-9
    assert find("copy_blocks", 2048, ">= 80%")["met"]  # 3800 / 4240 = 0.896
    assert not find("copy_blocks", 16, ">= 1.0x")["met"]
    s = find("swap_blocks", 2048, ">= 90%")
    assert s["met"] and abs(s["ratio"] - 1300 / 1400) < 1e-9 and abs(s["pcie_GBps"] - 51.5) < 1e-9
    assert not [t for t in got if t["op"] == "swap_blocks" and t["size"] == 16], "rate targets from 256"
    assert find("gather_cache", 8192, ">= 1.2x vLLM")["met"]
    assert find("concat_and_cache_mla", 64, ">= 1.0x vLLM")["met"]
    assert not find("concat_and_cache_mla", 64, "byte-identical")["met"]
    assert find("concat_and_cache_mla", 64, "byte-identical")["ratio"] == 0.999
    none = B.evaluate_targets([r for r in rows if r["provider"] != "vllm"], 4240.0, "torch")
    assert all(t["met"] is None for t in none if t["op"] in ("gather_cache", "concat_and_cache_mla"))


# ---------------------------------------------------------------- end to end
def test_cpu_smoke_run_with_mock_vllm(tmp_path, monkeypatch, capsys):
    """The real sweep on the CPU: mock vLLM ops bound by schema names (copy_blocks_mla absent:
    n/a, the torch composite its reference), exactness, wall-clock timers, both provider orders,
    the eager-only compaction, JSON/CSV and the targets."""
    register_mock_vllm()
    monkeypatch.setattr(B.Vllm, "namespaces", (MOCK_NS,))
    monkeypatch.setattr(B, "MIN_POOL", 8)
    monkeypatch.delenv("LOOMNB_VLLM_LIB", raising=False)
    path = B.main(["--device", "cpu", "--providers", "vllm,torch", "--size", "4", "--layers", "1",
                   "--block-kb", "16", "--repeats", "2", "--copy-gib", "0.001", "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    rows, meta = d["results"], d["meta"]
    n_cases = 1 + 2 * 2 + 3 + 2 + 1  # copy, swap + floor x 2 directions, gathers, MLA, compact
    assert len(rows) == 2 * n_cases * 2 and meta["exact_ref"] == "vllm"
    assert meta["vllm"]["schemas"]["copy_blocks_mla"].startswith("MISSING")
    b = meta["vllm"]["bindings"]
    assert "block_size_in_bytes<-block_size_in_bytes" in b["swap_blocks"]
    assert "batch_size<-batch_size" in b["cp_gather_cache"]
    assert "token_to_seq<-token_to_seq" in b["gather_and_maybe_dequant_cache"]
    assert "kv_cache<-kv_cache" in b["concat_and_cache_mla"]
    assert any("copy_blocks: this vLLM library has no copy_blocks_mla; the torch composite" in x
               for x in meta["log"])
    for r in rows:
        key = (r["op"], r["provider"])
        if r["provider"] == "vllm" and r["op"] in ("copy_blocks", "compact_blocks", "pcie_copy"):
            assert r["status"] == "n/a", r
            continue
        assert r["status"] == "ok", r
        assert r["exact_min"] == 1.0, (key, r.get("exact"), r.get("exact_note"))
        assert set(r["exact"]) == set(B.OPS[r["op"]].writes)
        if r["op"] == "compact_blocks":
            assert r["graph_us_from"] == "eager" and r["graph_n"] is None
            assert r["graph_us"] == r["eager_us"] > 0 and r["timer"].startswith("eager only")
        else:
            assert r["graph_us"] > 0 and r["timer"] == "cpu-wallclock"
    rev = [r for r in rows if r["pass"] == "reverse" and r["op"] == "swap_blocks"]
    assert rev and all(r["position"] == (0 if r["provider"] == "torch" else 1) for r in rev)
    assert meta["targets"] and meta["pcie"] and all(p["bus_GBps"] > 0 for p in meta["pcie"])
    assert "targets:" in capsys.readouterr().out
    assert Path(path).with_suffix(".csv").is_file()
    md = S.main([str(path), "--out-dir", str(tmp_path), "--no-plots"]).read_text()
    assert "### compact_blocks — 1 layer, 64 KB blocks" in md and "### pcie_copy" in md


def test_dry_run(tmp_path):
    path = B.main(["--dry-run", "--quick", "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    meta, rows = d["meta"], d["results"]
    assert meta["dry_run"] and meta["benchmark"] == "kv_blocks" and meta["x_axis"] == "size"
    assert len(rows) == 2 * 15 * len(B.PROVIDERS)
    assert {r["provider"] for r in rows} == set(B.PROVIDERS)
    ok = {(r["op"], r["provider"]) for r in rows if r["status"] == "ok"}
    assert ("pcie_copy", "torch") in ok and ("pcie_copy", "loomnb") not in ok
    assert ("swap_blocks", "loomnb_host_map") in ok and ("copy_blocks", "loomnb_host_map") not in ok
    assert ("compact_blocks", "vllm") not in ok and ("concat_and_cache_mla", "vllm") in ok
    targets = meta["targets"]
    assert targets and all(t["met"] is not None for t in targets)
    assert {t["op"] for t in targets} == {"copy_blocks", "swap_blocks", "gather_cache",
                                          "concat_and_cache_mla"}
    assert len(meta["pcie"]) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_quick_sweep(tmp_path):
    """The quick sweep on the GPU: loomnb's rows are timed and byte-equal to the reference (vLLM
    when $LOOMNB_VLLM_LIB is set, else the torch composites)."""
    path = B.main(["--quick", "--providers", "loomnb,loomnb_host_map,torch", "--repeats", "3",
                   "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    mine = [r for r in d["results"] if r["provider"].startswith("loomnb") and r["status"] != "n/a"]
    assert mine and all(r["status"] == "ok" for r in mine), [r["reason"] for r in mine]
    assert all(r["exact_min"] == 1.0 for r in mine)
    assert all((r["graph_us"] or r["eager_us"]) > 0 for r in mine)
