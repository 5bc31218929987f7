"""pytest entry points for the speculative-verification benchmark.

    pytest benchmarks/test_bench_spec_decode.py          # CPU checks (+ GPU cases if CUDA)

The CPU tests check the bytes model, that every peer computes what the oracles define (the
torch implementation on ragged batches with placeholder drafts; the transcription of vLLM's
kernel against its loop, on argmax targets), the case plan, the dry run end to end (JSON, CSV,
summary), the real sweep path on the CPU (torch, vLLM's rule, torch.compile timed by the
wall clock, exact against each other; loomnb's rows name why they need a GPU), and that the
former ``--loop`` names its new home (``bench_decode.py --speculative``, tested in
``test_bench_decode.py``). The GPU case runs a small real sweep and requires every provider's
outputs to equal vLLM's rule bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import bench_spec_decode as B  # noqa: E402
import summarize as S  # noqa: E402
from test_spec_decode_oracle import make_batch, ragged_counts, vllm_rule  # noqa: E402

import loomnb.oracle  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def test_bytes_model():
    R, k, V = 8, 4, 151936
    N = R * k
    assert B.op_bytes(B.OPS["rejection_greedy_sample"], R, k, 0) == 4 * N + 4 * R + 8 * N + 4 * R + 4 * R * (k + 1)
    fused = 4 * N + 4 * R + N * V * 4 + 4 * R + 4 * R * (k + 1) + 4 * R + 4 * (N + R) + 4 * (R + 1)
    assert B.op_bytes(B.OPS["greedy_verify"], R, k, V) == fused
    assert B.op_bytes(B.OPS["greedy_verify"], R, k, V, "bf16") == fused - N * V * 2
    # batch 1, 4 drafts of SmolLM2's vocabulary: 786 KB, ~0.19 µs at 4.2 TB/s: launch-bound
    assert abs(B.op_bytes(B.OPS["greedy_verify"], 1, 4, 49152) - 786_512) < 100


@pytest.mark.parametrize("num_reqs, max_spec_len, pattern", [(1, 4, "full"), (8, 8, "uniform"),
                                                             (32, 3, "zeros"), (17, 16, "skewed")])
def test_torch_implementation_computes_the_oracle(num_reqs, max_spec_len, pattern):
    """Ragged counts, placeholder and out-of-range drafts: the torch peer equals the oracle in
    all four outputs (and so the kernels, which the simulator and GPU tests tie to it)."""
    rng = np.random.default_rng(num_reqs)
    b = make_batch(rng, ragged_counts(rng, num_reqs, max_spec_len, pattern), max_spec_len, 40)
    t = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in b.items()}
    args = (t["draft_token_ids"], t["cu_num_draft_tokens"], t["target_logits"], t["bonus_token_ids"],
            max_spec_len)
    want = loomnb.oracle.greedy_verify(*(b[k] for k in ("draft_token_ids", "cu_num_draft_tokens",
                                                         "target_logits", "bonus_token_ids")),
                                       max_spec_len)
    for got, w in zip(B.t_greedy_verify(*args), want):
        assert np.array_equal(got.contiguous().numpy(), w)
    rows = B.t_rejection_greedy_sample(t["draft_token_ids"], t["cu_num_draft_tokens"],
                                       t["target_argmax"], t["bonus_token_ids"], max_spec_len)
    assert np.array_equal(rows.contiguous().numpy(), want[0])


@pytest.mark.parametrize("seed", range(6))
def test_vllm_transcription_equals_vllms_loop(seed):
    rng = np.random.default_rng(seed)
    R, L = int(rng.integers(1, 20)), int(rng.integers(1, 17))
    b = make_batch(rng, ragged_counts(rng, R, L, "uniform"), L, 30)
    args = [b[k] for k in ("draft_token_ids", "cu_num_draft_tokens", "target_argmax", "bonus_token_ids")]
    got = B.vllm_rule_torch(*(torch.from_numpy(a) for a in args), L)
    assert np.array_equal(got.numpy(), vllm_rule(*args, L))


def test_inputs_are_deterministic_and_the_drafts_a_prefix_of_the_targets():
    op = B.OPS["greedy_verify"]
    a = B.make_inputs(op, 8, 4, 1000, "fp32", "cpu", 3)
    b = B.make_inputs(op, 8, 4, 1000, "fp32", "cpu", 3)
    assert all(torch.equal(a[k], b[k]) for k in ("draft_token_ids", "target_logits", "bonus_token_ids"))
    match = (a["draft_token_ids"].long() == a["target_logits"].argmax(-1)).view(8, 4)
    assert match.any() and not match.all()
    first_miss = (~match).int().argmax(1)
    for r in range(8):  # matches up to the first miss; after it anything
        assert match[r, :first_miss[r]].all() or match[r].all()
    assert a["cu_num_draft_tokens"].tolist() == [4, 8, 12, 16, 20, 24, 28, 32]


def test_case_plan():
    a = B.parse_args(["--dry-run"])
    assert a.num_reqs == [1, 8, 32, 128, 256] and a.draft_len == [1, 4, 8, 16]
    assert a.vocab_size == [49152, 151936] and a.dtype == "fp32" and a.exact_ref == "vllm"
    assert a.repeats == 7 and a.target_ms == 1.0, "the family's lighter timing defaults"
    cases = B.FAMILY.cases(a)
    assert len(cases) == 5 * 4 + 5 * 4 * 2, "the unfused op has no vocabulary axis"
    assert {c["vocab_size"] for c in cases if c["op"] == "rejection_greedy_sample"} == {0}
    q = B.parse_args(["--dry-run", "--quick"])
    assert q.num_reqs == [1, 32, 256] and q.draft_len == [1, 4, 16] and q.vocab_size == [151936]
    assert q.repeats == 5 and q.target_ms == 0.5
    assert len(B.FAMILY.cases(q)) == 9 + 9


def test_dry_run_and_summary(tmp_path):
    path = B.main(["--dry-run", "--quick", "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    rows = d["results"]
    assert d["meta"]["dry_run"] and d["meta"]["x_axis"] == "num_reqs"
    assert len(rows) == 2 * 18 * len(B.PROVIDERS)
    by = {(r["pass"], r["op"], r["num_reqs"], r["draft_len"], r["provider"]): r for r in rows}
    assert by[("forward", "greedy_verify", 32, 4, "loomnb")]["status"] == "ok"
    assert by[("reverse", "rejection_greedy_sample", 1, 16, "loomnb_unfused")]["status"] == "n/a"
    md = S.main([str(path), "--out-dir", str(tmp_path), "--no-plots"]).read_text()
    assert "DRY RUN" in md and "greedy_verify" in md and "rejection_greedy_sample" in md


def test_cpu_smoke_run_end_to_end(tmp_path):
    """The real sweep on the CPU: torch, vLLM's rule (transcribed) and torch.compile timed by the
    wall-clock fallback, exact against the vllm reference, both orders, JSON and CSV."""
    path = B.main(["--device", "cpu", "--providers", "vllm,torch,torch_compile,loomnb,loomnb_unfused",
                   "--num-reqs", "1,5", "--draft-lens", "3", "--vocab-sizes", "700", "--repeats", "2",
                   "--copy-gib", "0.01", "--out", str(tmp_path), "--tag", "t"])
    d = json.loads(Path(path).read_text())
    rows = d["results"]
    assert d["meta"]["exact_ref"] == "vllm" and len(rows) == 2 * 4 * 5
    for r in rows:
        if r["provider"] in ("vllm", "torch", "torch_compile"):
            assert r["status"] == "ok" and r["exact_min"] == 1.0 and r["GBps"] > 0, r
        elif r["provider"] == "loomnb_unfused" and r["op"] == "rejection_greedy_sample":
            assert r["status"] == "n/a"
        else:
            assert r["status"] == "error" and "CUDA device array" in r["reason"], r
    assert any("transcription of its rule" in line for line in d["meta"]["log"])
    assert Path(path).with_suffix(".csv").exists()


def test_loop_names_its_new_home():
    with pytest.raises(SystemExit, match="bench_decode.py --speculative"):
        B.main(["--loop", "--dry-run"])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_small_sweep_is_exact(tmp_path):
    """A real sweep at 1 and 32 requests x 4 drafts, V = 49,152: every provider that ran
    produced vLLM's rule's outputs bit for bit (loomnb included)."""
    path = B.main(["--num-reqs", "1,32", "--draft-lens", "4", "--vocab-sizes", "49152",
                   "--repeats", "3", "--target-ms", "0.5", "--out", str(tmp_path)])
    rows = json.loads(Path(path).read_text())["results"]
    ran = [r for r in rows if r["status"] == "ok"]
    assert {r["provider"] for r in ran} >= {"loomnb", "vllm", "torch"}
    for r in ran:
        assert r["exact_min"] == 1.0, r
