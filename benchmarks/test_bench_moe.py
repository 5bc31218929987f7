"""pytest entry points for the MoE routing and token-movement benchmark.

    pytest benchmarks/test_bench_moe.py                  # CPU checks (+ the GPU case if CUDA)

The CPU tests check the bytes model against hand counts and vLLM's allocation sizes, the case
plan (default, quick, each flag and the ``--size`` / ``--out-dir`` / ``--vllm-moe-lib`` spellings),
where vLLM's ``_moe_C`` library is looked for, the canonical forms of the outputs vLLM orders
its own way, that the torch composites compute what loomnb's oracle computes on the
benchmark's own inputs, loomnb's binding (on a stand-in module: outputs passed where the
signature takes them, a missing op n/a), the target evaluation, binding vLLM's MoE ops by
schema names (mocked on the CPU by the oracle under vLLM 0.24's schemas, plus an older and a
newer schema variant) with exactness, both provider orders and the summary, a failing
torch.compile recorded in its rows, and the dry run end to end. The GPU case (skipped without
CUDA) runs the quick sweep for real.

The tests that compare with ``loomnb.oracle.moe`` (the composites, the mocked vLLM ops) skip
if that module does not import; none of them needs ``loomnb.topk_softmax`` & co. (the GPU case
does).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import bench_moe as B  # noqa: E402
import summarize as S  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
MOCK_NS = "loomnb_mock_moe_C"           # not "_moe_C": a real vLLM library may be loaded too
MOCK_NS_VARIANTS = "loomnb_mock_moe_C_variants"
SCHEMAS = {  # vLLM 0.24 csrc/libtorch_stable/moe/torch_bindings.cpp (namespace _moe_C)
    "topk_softmax": "(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, "
                    "Tensor gating_output, bool renormalize, Tensor? bias) -> ()",
    "topk_sigmoid": "(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, "
                    "Tensor gating_output, bool renormalize, Tensor? bias) -> ()",
    "moe_sum": "(Tensor input, Tensor! output) -> ()",
    "moe_align_block_size": "(Tensor topk_ids, int num_experts, int block_size, "
                            "Tensor! sorted_token_ids, Tensor! experts_ids, "
                            "Tensor! num_tokens_post_pad, Tensor? maybe_expert_map) -> ()",
    "grouped_topk": "(Tensor scores, int n_group, int topk_group, int topk, bool renormalize, "
                    "float routed_scaling_factor, Tensor bias, int scoring_func) -> "
                    "(Tensor, Tensor)",
}
VARIANT_SCHEMAS = {  # an older topk_sigmoid (no bias), a newer topk_softmax (is_padding)
    "topk_sigmoid": "(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, "
                    "Tensor gating_output, bool renormalize) -> ()",
    "topk_softmax": "(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, "
                    "Tensor gating_output, bool renormalize, Tensor? bias, "
                    "float routed_scaling_factor, Tensor? is_padding) -> ()",
}


def oracle():
    return pytest.importorskip("loomnb.oracle.moe", reason="loomnb.oracle.moe does not import")


def np_view(t):
    """A NumPy view of ``t`` (bf16 as ml_dtypes.bfloat16, FP8 as uint8 codes), for the oracle."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def _codes(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype == ml_dtypes.float8_e4m3fn else a


def _permute_oracle(O, x, ids, k, quant):
    """(out, scales) of the oracle's moe_permute, whichever of its return conventions."""
    r = O.moe_permute(x, ids, k, **({"quant_dtype": "fp8"} if quant == "fp8" else {}))
    return r if isinstance(r, tuple) else (r, None)


def register_mock_vllm():
    """vLLM's MoE ops on the CPU, computed by loomnb's oracle into the output tensors. The
    align's mock reverses each expert's segment (vLLM's kernel orders a segment by atomics), so
    only the canonical form makes it equal to an ascending one."""
    O = oracle()

    def _route(fn, topk_weights, topk_indices, token_expert_indices, gating_output, renormalize,
               bias):
        w, ids, tei = fn(np_view(gating_output), topk_weights.shape[1], renormalize,
                         e_score_correction_bias=None if bias is None else bias.numpy())
        for dst, src in ((topk_weights, w), (topk_indices, ids), (token_expert_indices, tei)):
            dst.copy_(torch.from_numpy(np.asarray(src)))

    def topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output,
                     renormalize, bias=None):
        _route(O.topk_softmax, topk_weights, topk_indices, token_expert_indices, gating_output,
               renormalize, bias)

    def topk_sigmoid(topk_weights, topk_indices, token_expert_indices, gating_output,
                     renormalize, bias=None):
        _route(O.topk_sigmoid, topk_weights, topk_indices, token_expert_indices, gating_output,
               renormalize, bias)

    def moe_sum(input, output):
        out = O.moe_sum(np_view(input))
        output.copy_(torch.from_numpy(out.view(np.int16)).view(torch.bfloat16))

    def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                             num_tokens_post_pad, maybe_expert_map=None):
        s, e, n = (np.asarray(a) for a in O.moe_align_block_size(topk_ids.numpy(), block_size,
                                                                  num_experts))
        s, used = s.copy(), e[:int(n[0]) // block_size]
        for x in np.unique(used):  # each expert's segment (consecutive blocks) reversed
            blocks = np.flatnonzero(used == x)
            lo, hi = blocks[0] * block_size, (blocks[-1] + 1) * block_size
            s[lo:hi] = s[lo:hi][::-1].copy()
        sorted_token_ids.copy_(torch.from_numpy(s))
        experts_ids.copy_(torch.from_numpy(e))
        num_tokens_post_pad.copy_(torch.from_numpy(n))

    def grouped_topk(scores, n_group, topk_group, topk, renormalize, routed_scaling_factor, bias,
                     scoring_func):
        assert scoring_func == 1, "the benchmark's DeepSeek-V3 routing is sigmoid"
        w, ids = O.grouped_topk(None, np_view(scores), topk, renormalize, n_group, topk_group,
                                "sigmoid", routed_scaling_factor, bias.numpy())
        return (torch.from_numpy(np.asarray(w)).flip(-1).contiguous(),   # any order: sets
                torch.from_numpy(np.asarray(ids)).flip(-1).contiguous())

    impls = {f.__name__: f for f in (topk_softmax, topk_sigmoid, moe_sum, moe_align_block_size,
                                     grouped_topk)}
    H.register_mock_ops(MOCK_NS, SCHEMAS, impls)
    H.register_mock_ops(MOCK_NS_VARIANTS, VARIANT_SCHEMAS, {
        "topk_sigmoid": lambda a, b, c, d, e: None,
        "topk_softmax": lambda a, b, c, d, e, f, g, h: topk_softmax(a, b, c, d, e, f)})


def _cases(*argv):
    return B.FAMILY.cases(B.parse_args(["--dry-run", *argv]))


# ---------------------------------------------------------------- bytes model and plan
def test_bytes_model_and_vllm_sizes():
    # vLLM's wrapper: L = N + E*(bs-1) (rounded up with pad_sorted_ids), min(L, N*bs) if N < E
    assert B.align_sizes(8, 128, 16) == (128, 8)                  # one token: 8 * 16 < 1928
    assert B.align_sizes(4096 * 8, 128, 16) == (32768 + 128 * 15, 2168)   # 34688 / 16 blocks
    assert B.align_sizes(100, 8, 16, pad_sorted_ids=True) == (224, 14)
    assert B.align_sizes(12, 4, 4) == (24, 6)                     # vLLM's docstring example
    soft = {"op": "topk_softmax", "num_tokens": 4096, "num_experts": 128, "topk": 8,
            "dtype": "bf16", "bias": False}
    assert B.op_bytes(soft) == 4096 * 128 * 2 + 12 * 4096 * 8
    assert B.op_bytes({**soft, "op": "topk_sigmoid", "bias": True, "dtype": "fp32"}) == \
        4096 * 128 * 4 + 4 * 128 + 12 * 4096 * 8
    g = {"op": "grouped_topk", "num_tokens": 64, "num_experts": 256, "topk": 8, "dtype": "fp32",
         "bias": True}
    assert B.op_bytes(g) == 64 * 256 * 4 + 4 * 256 + 8 * 64 * 8
    a = {"op": "moe_align_block_size", "num_tokens": 1, "num_experts": 256, "topk": 8,
         "block_size": 64}
    assert B.op_bytes(a) == 4 * 8 + 4 * 512 + 4 * 8 + 4
    # permute at 4096 tokens x top-8, H 2048, block 64 of E 128: 134 MB read + 167 MB written
    p = {"op": "moe_permute", "num_tokens": 4096, "quant": "none", **B.PERMUTE}
    N, L = 4096 * 8, 32768 + 128 * 63
    assert B.op_bytes(p) == N * 2048 * 2 + L * 2048 * 2 + 4 * L
    assert B.op_bytes({**p, "quant": "fp8"}) == N * 2048 * 2 + L * 2048 + 8 * L
    assert B.op_bytes({**p, "op": "moe_unpermute"}) == N * 4096 + 4096 * 4096 + 4 * L + 4 * N
    s = {"op": "moe_sum", "num_tokens": 4096, "topk": 8, "hidden_size": 4096}
    assert B.op_bytes(s) == 4096 * 9 * 4096 * 2 == 301989888


def test_case_plan():
    default = _cases()
    count = {}
    for c in default:
        count[c["op"]] = count.get(c["op"], 0) + 1
        assert c["bytes"] == B.op_bytes(c) and c["x"] == c["num_tokens"] and c["shape"]
    assert count == {"topk_softmax": 20, "topk_sigmoid": 20, "grouped_topk": 5,
                     "moe_align_block_size": 20, "moe_permute": 8, "moe_unpermute": 4,
                     "moe_sum": 8}
    assert {c["num_tokens"] for c in default if c["op"] == "topk_softmax"} == {1, 8, 64, 512, 4096}
    assert {c["num_tokens"] for c in default if c["op"] == "moe_sum"} == {1, 64, 512, 4096}
    soft = {(c["num_experts"], c["topk"], c["dtype"]) for c in default if c["op"] == "topk_softmax"}
    assert soft == {(128, 8, "fp32"), (128, 8, "bf16"), (256, 8, "fp32"), (256, 8, "bf16")}
    assert all(c["bias"] and c["renormalize"] for c in default if c["op"] == "topk_sigmoid")
    g = [c for c in default if c["op"] == "grouped_topk"]
    assert all((c["num_experts"], c["num_expert_group"], c["topk_group"], c["topk"],
                c["scoring_func"], c["routed_scaling_factor"], c["dtype"]) ==
               (256, 8, 4, 8, "sigmoid", 2.5, "fp32") for c in g)
    assert {(c["num_experts"], c["block_size"]) for c in default
            if c["op"] == "moe_align_block_size"} == {(128, 16), (128, 64), (256, 16), (256, 64)}
    assert {c["quant"] for c in default if c["op"] == "moe_permute"} == {"none", "fp8"}
    assert {(c["topk"], c["hidden_size"]) for c in default if c["op"] == "moe_sum"} == \
        {(8, 4096), (2, 4096)}
    assert len({(c["op"], c["shape"], c["x"]) for c in default}) == len(default), "keys unique"
    assert len(_cases("--quick")) == 14

    sized = _cases("--ops", "topk_softmax,moe_sum", "--size", "3,5", "--experts", "64",
                   "--gating-dtypes", "fp32", "--sum-topk", "4")
    assert [(c["op"], c.get("num_experts"), c["topk"], c["num_tokens"]) for c in sized] == [
        ("topk_softmax", 64, 8, 3), ("topk_softmax", 64, 8, 5), ("moe_sum", None, 4, 3),
        ("moe_sum", None, 4, 5)]
    assert _cases("--size", "7") == _cases("--num-tokens", "7")
    align = _cases("--ops", "moe_align_block_size", "--size", "9", "--block-sizes", "32")
    assert [(c["num_experts"], c["block_size"]) for c in align] == [(128, 32), (256, 32)]
    perm = _cases("--ops", "moe_permute", "--quant", "fp8", "--quick")
    assert [(c["quant"], c["num_tokens"]) for c in perm] == [("fp8", 4096), ("fp8", 64)]
    for bad in (["--quant", "int8"], ["--gating-dtypes", "fp64"], ["--ops", "moe_gemm"]):
        with pytest.raises(SystemExit):
            B.parse_args(["--dry-run", *bad])


def test_flag_spellings(tmp_path):
    a = B.parse_args(["--dry-run", "--out-dir", str(tmp_path), "--vllm-moe-lib", "/x/m.so"])
    assert a.out == tmp_path and a.vllm_moe_lib == "/x/m.so" and a.dry_run and a.device == "cpu"
    assert B.parse_args(["--dry-run", "--out", str(tmp_path)]).out == tmp_path
    assert B.parse_args(["--dry-run"]).out == H.DRY_RUN_DIR
    q = B.parse_args(["--dry-run", "--quick"])
    assert q.num_tokens == [1, 64, 4096] and q.repeats == 5 and q.order == "both"


def test_moe_library_lookup(tmp_path, monkeypatch):
    for v in ("LOOMNB_VLLM_MOE_LIB", "LOOMNB_VLLM_LIB"):
        monkeypatch.delenv(v, raising=False)
    ns = types.SimpleNamespace
    main, moe = tmp_path / "_C_stable_libtorch.abi3.so", tmp_path / B.MOE_LIB
    main.write_bytes(b"")
    assert B.moe_lib_path(ns(vllm_moe_lib=None, vllm_lib=None)) is None
    assert B.moe_lib_path(ns(vllm_moe_lib=None, vllm_lib=str(main))) == str(main)
    moe.write_bytes(b"")
    assert B.moe_lib_path(ns(vllm_moe_lib=None, vllm_lib=str(main))) == str(moe)  # beside it
    monkeypatch.setenv("LOOMNB_VLLM_LIB", str(main))
    assert B.moe_lib_path(ns(vllm_moe_lib=None, vllm_lib=None)) == str(moe)
    monkeypatch.setenv("LOOMNB_VLLM_MOE_LIB", "/env/moe.so")
    assert B.moe_lib_path(ns(vllm_moe_lib=None, vllm_lib=None)) == "/env/moe.so"
    assert B.moe_lib_path(ns(vllm_moe_lib="/flag/moe.so", vllm_lib=None)) == "/flag/moe.so"
    prov = H.make_provider(B.FAMILY, "vllm")
    assert "not found: /flag/moe.so" in prov.setup(ns(vllm_moe_lib="/flag/moe.so"), print)
    monkeypatch.delenv("LOOMNB_VLLM_MOE_LIB")
    monkeypatch.delenv("LOOMNB_VLLM_LIB")
    monkeypatch.setattr(B.Vllm, "namespaces", ("loomnb_no_such_namespace",))
    assert "no --vllm-moe-lib" in prov.setup(ns(vllm_moe_lib=None, vllm_lib=None), lambda m: None)


# ---------------------------------------------------------------- canonical forms, composites
def test_canonical_forms():
    ids = torch.tensor([[5, 1, 3], [0, 7, 2]], dtype=torch.int32)
    w = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])
    c = B.canonical_grouped(w, ids)
    assert c["topk_ids"].tolist() == [[1, 3, 5], [0, 2, 7]]
    assert torch.equal(c["topk_weights"], w.gather(1, torch.tensor([[1, 2, 0], [0, 2, 1]])))
    # flat ids of 3 tokens x top-2 over 3 experts, block 4: expert 0 {0, 3}, 1 {1, 4, 5}, 2 {2}
    topk = torch.tensor([[0, 1], [2, 0], [1, 1]], dtype=torch.int32)
    L, nb = B.align_sizes(6, 3, 4)
    s, e, n = B.t_moe_align_block_size(topk, 4, 3, L)
    assert (L, nb) == (15, 4) and n.tolist() == [12] and e.tolist() == [0, 1, 2, -1]
    assert s.tolist() == [0, 3, 6, 6, 1, 4, 5, 6, 2, 6, 6, 6, 6, 6, 6]
    shuffled = torch.tensor([3, 6, 0, 6, 6, 5, 1, 4, 6, 6, 2, 6, 6, 6, 6], dtype=torch.int32)
    canon = B.canonical_align(shuffled, e, n, 4)
    assert canon["sorted_token_ids"].tolist() == s.tolist()
    assert B.canonical_align(s, e, n, 4)["sorted_token_ids"].tolist() == s.tolist()
    wrong = shuffled.clone()
    wrong[[0, 4]] = wrong[[4, 0]]  # token 3 moved into expert 1's segment: still caught
    assert B.canonical_align(wrong, e, n, 4)["sorted_token_ids"].tolist() != s.tolist()


@pytest.mark.parametrize("op", list(B.OPS))
def test_torch_composites_match_the_oracle(op):
    """On the benchmark's own inputs (37 tokens, every default shape): the align, permute (bf16
    and FP8), unpermute and moe_sum composites are bit-exact; routing picks the same experts
    (bf16 logits: the same multiset of scores, torch breaks exact ties its own way) with
    weights within a few float32 ulps."""
    O = oracle()
    for c in _cases("--ops", op, "--size", "37"):
        t = B.make_inputs(c, "cpu", 3)
        got = B.collect(op, t)(B.torch_call(op, t, c, B.COMPOSITES[op])())
        if op in ("topk_softmax", "topk_sigmoid"):
            bias = t["e_score_correction_bias"].numpy() if c["bias"] else None
            w, ids, tei = getattr(O, op)(np_view(t["gating_output"]), c["topk"], c["renormalize"],
                                         e_score_correction_bias=bias)
            assert np.array_equal(got["token_expert_indices"].numpy(), tei)
            if c["dtype"] == "fp32":
                assert np.array_equal(got["topk_ids"].numpy(), ids), c["shape"]
            g = t["gating_output"].float()
            assert torch.equal(g.gather(1, got["topk_ids"].long()).sort(-1).values,
                               g.gather(1, torch.from_numpy(ids).long()).sort(-1).values)
            np.testing.assert_allclose(np.sort(got["topk_weights"].numpy()), np.sort(w),
                                       rtol=4e-7, atol=0)
        elif op == "grouped_topk":
            w, ids = O.grouped_topk(None, np_view(t["gating_output"]), c["topk"],
                                    c["renormalize"], c["num_expert_group"], c["topk_group"],
                                    c["scoring_func"], c["routed_scaling_factor"],
                                    t["e_score_correction_bias"].numpy())
            want = B.canonical_grouped(torch.from_numpy(np.asarray(w)),
                                       torch.from_numpy(np.asarray(ids)))
            assert torch.equal(got["topk_ids"], want["topk_ids"])
            torch.testing.assert_close(got["topk_weights"], want["topk_weights"], rtol=1e-6,
                                       atol=0)
        elif op == "moe_align_block_size":
            want = O.moe_align_block_size(t["topk_ids"].numpy(), c["block_size"], c["num_experts"])
            for k, v in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_pad"), want):
                assert np.array_equal(got[k].numpy(), v), (c["shape"], k)
            assert got["sorted_token_ids"].shape == t["sorted_token_ids"].shape  # vLLM's sizes
            assert got["expert_ids"].shape == t["expert_ids"].shape
        elif op == "moe_permute":
            out, scales = _permute_oracle(O, np_view(t["hidden_states"]),
                                          t["sorted_token_ids"].numpy(), c["topk"], c["quant"])
            assert np.array_equal(np_view(got["out"]).view(np.uint8), _codes(out).view(np.uint8))
            assert set(got) == ({"out", "scales"} if c["quant"] == "fp8" else {"out"})
            if c["quant"] == "fp8":
                assert np.array_equal(got["scales"].numpy(), scales)
                assert got["out"].dtype == t["out"].dtype == torch.float8_e4m3fn
        elif op == "moe_unpermute":
            out = O.moe_unpermute(np_view(t["permuted"]), t["sorted_token_ids"].numpy(),
                                  t["topk_weights"].numpy())
            assert np.array_equal(np_view(got["out"]).view(np.int16), out.view(np.int16))
        else:
            out = O.moe_sum(np_view(t["input"]))
            assert np.array_equal(np_view(got["out"]).view(np.int16), out.view(np.int16))


# ---------------------------------------------------------------- loomnb's binding (stand-in)
def test_loomnb_binding_passes_outputs_and_reports_missing_ops():
    """loomnb's calls on a stand-in module: outputs passed where the signature takes them (the
    spec's align takes none), a function loomnb lacks is n/a."""
    seen = {}

    def topk_softmax(gating_output, topk, renormalize=False, *, e_score_correction_bias=None,
                     topk_weights=None, topk_ids=None, token_expert_indices=None, stream=None):
        seen["topk_softmax"] = (topk, renormalize, e_score_correction_bias, topk_weights)
        return topk_weights, topk_ids, token_expert_indices

    def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                             pad_sorted_ids=False, *, stream=None, launch_key=None):
        seen["align"] = (block_size, num_experts)
        L, nb = B.align_sizes(topk_ids.numel(), num_experts, block_size)
        return B.t_moe_align_block_size(topk_ids, block_size, num_experts, L)

    def moe_permute(hidden_states, sorted_token_ids, topk, quant_dtype="none", scale_ub=None, *,
                    out=None, scales=None, stream=None):
        seen["permute"] = (quant_dtype, out is not None, scales is not None)
        return out, scales

    prov = B.Loomnb()
    prov.m = types.SimpleNamespace(topk_softmax=topk_softmax,
                                   moe_align_block_size=moe_align_block_size,
                                   moe_permute=moe_permute)
    (c,) = _cases("--ops", "topk_softmax", "--size", "2", "--experts", "16",
                  "--gating-dtypes", "fp32")
    t = B.make_inputs(c, "cpu", 0)
    call, got = prov.bind(B.OPS["topk_softmax"], t, c)
    out = got(call())
    assert seen["topk_softmax"] == (8, True, None, t["topk_weights"])
    assert out["topk_weights"] is t["topk_weights"]
    c = _cases("--ops", "moe_align_block_size", "--size", "3", "--experts", "16",
               "--block-sizes", "4")[0]
    t = B.make_inputs(c, "cpu", 0)
    call, got = prov.bind(B.OPS["moe_align_block_size"], t, c)
    out = got(call())
    assert seen["align"] == (4, 16) and out["sorted_token_ids"].shape == t["sorted_token_ids"].shape
    for q, want in (("none", ("none", True, False)), ("fp8", ("fp8", True, True))):
        c = _cases("--ops", "moe_permute", "--size", "2", "--quant", q)[0]
        t = B.make_inputs(c, "cpu", 0)
        call, got = prov.bind(B.OPS["moe_permute"], t, c)
        assert set(got(call())) == ({"out", "scales"} if q == "fp8" else {"out"})
        assert seen["permute"] == want
    c = _cases("--ops", "moe_sum", "--size", "1")[0]
    with pytest.raises(H.NotAvailable, match="loomnb has no moe_sum"):
        prov.bind(B.OPS["moe_sum"], B.make_inputs(c, "cpu", 0), c)


# ---------------------------------------------------------------- targets
def test_target_evaluation():
    def row(op, shape, x, prov, us, gbps=1.0):
        return {"op": op, "shape": shape, "x": x, "provider": prov, "status": "ok",
                "graph_us": us, "GBps": gbps, "exact_min": 1.0}
    soft, perm, s8 = "E128 k8 fp32 logits", B._movement_label("none"), "[M, 8, 4096] bf16"
    rows = [row("topk_softmax", soft, 1, "loomnb", 4.0), row("topk_softmax", soft, 1, "vllm", 4.1),
            row("topk_softmax", soft, 4096, "loomnb", 8.0), row("topk_softmax", soft, 4096, "vllm", 7.5),
            row("moe_align_block_size", "E256 k8 block 64", 512, "loomnb", 5.0),
            row("grouped_topk", "g", 8, "vllm", 6.0),                       # loomnb failed
            row("moe_permute", perm, 4096, "loomnb", 80.0, 4000.0),
            row("moe_permute", perm, 512, "loomnb", 12.0, 3000.0),          # no rate target
            row("moe_sum", s8, 4096, "loomnb", 75.0, 4100.0), row("moe_sum", s8, 4096, "vllm", 100.0),
            row("moe_sum", s8, 64, "loomnb", 3.0), row("moe_sum", s8, 64, "vllm", 3.0),
            row("topk_sigmoid", soft + ", bias", 64, "loomnb", 9.0),
            row("topk_sigmoid", soft + ", bias", 64, "vllm", 4.0),
            row("moe_unpermute", perm, 4096, "loomnb", 90.0, 3000.0)]
    rows += [dict(r, graph_us=r["graph_us"] * 1.02) for r in rows]   # the second pass
    got = B.evaluate_targets(rows, 4400.0)

    def find(op, size, prefix):
        hit = [t for t in got if t["op"] == op and t["size"] == size and t["target"].startswith(prefix)]
        assert len(hit) == 1, (op, size, prefix, got)
        return hit[0]
    t1 = find("topk_softmax", 1, ">= 1.0x vLLM")
    assert t1["met"] and abs(t1["ratio"] - 4.1 / 4.0) < 1e-9 and t1["peer_us"] > 4.1
    assert find("topk_softmax", 4096, ">= 1.0x vLLM")["met"] is False
    assert find("moe_align_block_size", 512, ">= 1.0x")["met"] is None      # no vLLM row
    g = find("grouped_topk", 8, ">= 1.0x")
    assert g["met"] is None and g["loomnb_us"] is None
    p = find("moe_permute", 4096, ">= 90% of the copy rate")
    assert p["met"] and abs(p["ratio"] - 4000 / 4400) < 1e-9
    assert not [t for t in got if t["op"] == "moe_permute" and t["size"] == 512]
    assert find("moe_sum", 4096, ">= 1.3x vLLM")["met"]                    # 100 / 75 = 1.33
    assert find("moe_sum", 4096, ">= 90%")["met"] is True                   # 4100 / 4400
    assert not [t for t in got if t["op"] == "moe_sum" and t["size"] == 64]
    assert not [t for t in got if t["op"] in ("topk_sigmoid", "moe_unpermute")]
    assert all(t["met"] is None for t in B.evaluate_targets(
        [r for r in rows if r["op"] == "moe_permute"], None))


# ---------------------------------------------------------------- vLLM binding, end to end
def _vllm_provider(ns, log):
    prov = H.make_provider(B.FAMILY, "vllm")
    prov.namespaces = (ns,)
    assert prov.setup(types.SimpleNamespace(vllm_moe_lib=None, vllm_lib=None), log) is None
    return prov


def test_vllm_schema_variants(monkeypatch):
    """An older topk_sigmoid without a bias: its cases n/a, the torch composite as reference;
    a newer topk_softmax (routed_scaling_factor, is_padding) still binds by name."""
    register_mock_vllm()
    for v in ("LOOMNB_VLLM_MOE_LIB", "LOOMNB_VLLM_LIB"):
        monkeypatch.delenv(v, raising=False)
    lines = []
    prov = _vllm_provider(MOCK_NS_VARIANTS, lines.append)
    assert prov.lib == "ops already registered in this process"
    assert prov.schemas["moe_sum"].startswith("MISSING")
    sig = _cases("--ops", "topk_sigmoid", "--size", "2", "--experts", "16",
                 "--gating-dtypes", "fp32")[0]
    assert "takes no e_score_correction_bias" in prov.unsupported(sig)
    call, got = prov.bind(B.OPS["topk_sigmoid"], B.make_inputs(sig, "cpu", 0), sig)
    assert set(got(call())) == set(B.OPS["topk_sigmoid"].writes)
    assert any("topk_sigmoid: this vLLM library's topk_sigmoid takes no" in x for x in lines)
    soft = dict(sig, op="topk_softmax", bias=False)
    t = B.make_inputs(soft, "cpu", 0)
    call, got = prov.bind(B.OPS["topk_softmax"], t, soft)
    out = got(call())
    assert out["topk_ids"] is t["topk_ids"] and out["token_expert_indices"].min() >= 0
    b = prov.bindings["topk_softmax"]
    assert "topk_indices<-topk_ids" in b and "routed_scaling_factor<-routed_scaling_factor" in b
    assert "bias<-None" in b and "is_padding<-None" in b
    assert "vLLM has no moe_permute" in prov.unsupported({"op": "moe_permute"})


def test_cpu_smoke_run_with_mock_vllm(tmp_path, monkeypatch, capsys):
    """The real sweep on the CPU: the mocked vLLM ops bound by schema names, exactness against
    them (canonical forms for the align and grouped_topk), wall-clock timers, both provider
    orders, n/a rows for the ops vLLM lacks (the torch composite their reference), JSON/CSV,
    the targets and the summary."""
    register_mock_vllm()
    monkeypatch.setattr(B.Vllm, "namespaces", (MOCK_NS,))
    for v in ("LOOMNB_VLLM_MOE_LIB", "LOOMNB_VLLM_LIB"):
        monkeypatch.delenv(v, raising=False)
    path = B.main(["--device", "cpu", "--providers", "vllm,torch", "--size", "4", "--repeats", "2",
                   "--copy-gib", "0.001", "--out-dir", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    rows, meta = d["results"], d["meta"]
    n_cases = 4 + 4 + 1 + 4 + 2 + 1 + 2
    assert len(rows) == 2 * n_cases * 2 and meta["exact_ref"] == "vllm"
    assert meta["benchmark"] == "moe" and meta["x_axis"] == "num_tokens"
    b = meta["vllm"]["bindings"]
    assert "topk_indices<-topk_ids" in b["topk_softmax"] and "bias<-None" in b["topk_softmax"]
    assert "bias<-e_score_correction_bias" in b["topk_sigmoid"]
    assert "scores<-gating_output" in b["grouped_topk"] and "n_group<-num_expert_group" in b[
        "grouped_topk"] and "scoring_func<-scoring_func_id" in b["grouped_topk"]
    assert "experts_ids<-expert_ids" in b["moe_align_block_size"]
    assert "maybe_expert_map<-None" in b["moe_align_block_size"]
    assert b["moe_sum"] == "input<-input, output<-out"
    assert any("moe_permute: vLLM has no moe_permute" in x for x in meta["log"])
    for r in rows:
        if r["provider"] == "vllm" and r["op"] in ("moe_permute", "moe_unpermute"):
            assert r["status"] == "n/a", r
            continue
        assert r["status"] == "ok", r
        assert r["graph_us"] > 0 and r["timer"] == "cpu-wallclock" and r["GBps"] > 0
        assert r["pct_copy"] > 0 and r["bytes"] == B.op_bytes(r)
        if r["provider"] == "vllm" or r["op"] in ("moe_align_block_size", "moe_permute",
                                                  "moe_unpermute", "moe_sum"):
            assert r["exact_min"] == 1.0, (r["op"], r["shape"], r["provider"], r["exact"])
        else:  # routing: the same experts (fp32 logits), weights within float32 ulps
            assert r["exact"].get("token_expert_indices", 1.0) == 1.0
            assert r["exact"]["topk_ids"] == 1.0 or r["dtype"] != "fp32", r["exact"]
            assert r["max_abs_diff"]["topk_weights"] < 1e-6
    rev = [r for r in rows if r["pass"] == "reverse" and r["op"] == "moe_sum"]
    assert rev and all(r["position"] == (0 if r["provider"] == "torch" else 1) for r in rev)
    assert meta["targets"] and all(t["met"] is None for t in meta["targets"])  # no loomnb rows
    assert "targets: 0 of 0 met" in capsys.readouterr().out
    assert Path(path).with_suffix(".csv").is_file()
    md = S.main([str(path), "--out-dir", str(tmp_path), "--no-plots"]).read_text()
    assert "### moe_sum" in md and "### moe_align_block_size" in md


def test_failing_torch_compile_is_recorded_not_raised(tmp_path, monkeypatch):
    """A torch.compile failure (a guard or backend error) makes its rows 'skip' with the error
    as reason; the sweep goes on."""
    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("GuardOnDataDependentSymNode: mock compile failure")
        return call
    monkeypatch.setattr(torch, "compile", broken)
    path = B.main(["--device", "cpu", "--providers", "torch_compile,torch", "--ops", "moe_sum",
                   "--size", "2", "--repeats", "1", "--copy-gib", "0.001", "--no-exact",
                   "--out", str(tmp_path)])
    rows = json.loads(Path(path).read_text())["results"]
    comp = [r for r in rows if r["provider"] == "torch_compile"]
    assert len(comp) == 2 * 2 and all(r["status"] == "skip" for r in comp)
    assert all("mock compile failure" in r["reason"] for r in comp)
    assert all(r["status"] == "ok" for r in rows if r["provider"] == "torch")


def test_dry_run(tmp_path):
    """No GPU, no loomnb MoE ops needed: fake timings through the real plan, provider order,
    n/a logic, files and targets."""
    path = B.main(["--dry-run", "--quick", "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    meta, rows = d["meta"], d["results"]
    assert meta["dry_run"] and meta["benchmark"] == "moe" and "dryrun" in Path(path).name
    assert len(rows) == 2 * 14 * len(B.PROVIDERS)
    assert {r["provider"] for r in rows} == set(B.PROVIDERS)
    ok = {(r["op"], r["provider"]) for r in rows if r["status"] == "ok"}
    assert ("moe_permute", "vllm") not in ok and ("moe_unpermute", "vllm") not in ok
    assert {("moe_permute", "loomnb"), ("moe_sum", "vllm"), ("grouped_topk", "torch_compile"),
            ("topk_sigmoid", "vllm")} <= ok
    targets = meta["targets"]
    assert targets and all(t["met"] is not None for t in targets)
    assert {t["op"] for t in targets} == {"topk_softmax", "grouped_topk", "moe_align_block_size",
                                          "moe_permute", "moe_sum"}
    md = S.main([str(path), "--out-dir", str(tmp_path), "--no-plots"]).read_text()
    assert "DRY RUN" in md or "FAKE" in md


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_quick_sweep(tmp_path):
    """The quick sweep on the GPU: loomnb's rows are timed; its movement ops and the align are
    byte-equal to the reference (vLLM when $LOOMNB_VLLM_MOE_LIB / $LOOMNB_VLLM_LIB point at its
    libraries, else the torch composites)."""
    path = B.main(["--quick", "--providers", "loomnb,vllm,torch", "--repeats", "3",
                   "--out", str(tmp_path)])
    d = json.loads(Path(path).read_text())
    mine = [r for r in d["results"] if r["provider"] == "loomnb"]
    assert mine and all(r["status"] == "ok" for r in mine), [r["reason"] for r in mine]
    assert all(r["graph_us"] > 0 for r in mine)
    exact = [r for r in mine if r["op"] in ("moe_align_block_size", "moe_permute", "moe_sum")]
    assert exact and all(r["exact_min"] == 1.0 for r in exact), [(r["op"], r["exact"])
                                                                 for r in exact]
