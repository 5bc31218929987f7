"""How long do the SmolLM2 decode step's small GEMMs take in cuBLAS? A probe, not a benchmark of
the product (GEMMs stay with torch).

At batch 1-64 the step's 120 projections (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj`` per layer) and the ``lm_head`` read a few MB of weights each, far below a launch's
worth of bandwidth, so their time is cuBLAS's latency. This times each shape with CUDA-graph
replay through the ways torch can issue it: ``F.linear`` (weight ``[N, K]``, cuBLAS), the same
with ``torch.backends.cuda.preferred_blas_library("cublaslt")``, and ``x @ W^T`` from a
pre-transposed contiguous ``[K, N]`` weight (the other operand order), and prints µs per call
and the weight-read rate.

    python3 benchmarks/probe_gemm.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
          "down_proj": (576, 1536), "lm_head": (49152, 576)}  # (N, K) of SmolLM2-135M


def graph_us(fn, calls=20, replays=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / (calls * replays))
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = []
    for M in (int(b) for b in args.batches.split(",")):
        for name, (N, K) in SHAPES.items():
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05
            wt = w.t().contiguous()
            out = {}
            torch.backends.cuda.preferred_blas_library("cublas")
            out["linear"] = graph_us(lambda: F.linear(x, w))
            out["x@wt"] = graph_us(lambda: x @ wt)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            out["linear_lt"] = graph_us(lambda: F.linear(x, w))
            out["x@wt_lt"] = graph_us(lambda: x @ wt)
            torch.backends.cuda.preferred_blas_library("cublas")
            same = torch.equal(F.linear(x, w), x @ wt)
            gbs = {k: N * K * 2 / (v * 1e-6) / 1e9 for k, v in out.items()}
            rows.append({"M": M, "op": name, "N": N, "K": K, "us": out, "GBps": gbs,
                         "linear_equals_x@wt": same})
            print(f"M={M:3d} {name:>13} " + " ".join(f"{k} {v:6.2f} µs ({gbs[k]:5.0f} GB/s)"
                                                    for k, v in out.items()) + f" same={same}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_gemm.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
            indent=1))


if __name__ == "__main__":
    main()
