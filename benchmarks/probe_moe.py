"""Probe the MoE kernels one call at a time, for Nsight Compute (``ncu``) or a quick look at
each launch's device time.

    python3 benchmarks/probe_moe.py                       # every case: CUDA-event times
    ncu --section SpeedOfLight --section WarpStateStats --section LaunchStats \\
        -k regex:moe_ python3 benchmarks/probe_moe.py --once --cases align_64,route_1

Cases (Qwen3-30B-A3B's 128 experts top-8 and DeepSeek-V3's 256 / 8 groups / top-8):
``route_<M>`` (topk_softmax E128 k8, bf16), ``sigmoid_<M>`` (topk_sigmoid E256 + bias),
``grouped_<M>`` (grouped_topk V3), ``align_<M>`` (E256 k8 block 64), ``sum_<M>`` ([M, 8,
4096] bf16), ``permute_<M>`` / ``fp8_<M>`` (H 2048) and ``combine_<M>``; ``M`` tokens.
``--once`` runs each case once after a warm-up call (what ncu profiles: the second launch);
otherwise each is timed over 200 launches with CUDA events (eager: includes launch gaps).
"""

from __future__ import annotations

import argparse

import torch

import loomnb

DEFAULT = ("route_1", "route_4096", "sigmoid_1", "grouped_1", "grouped_4096", "align_1",
           "align_64", "align_512", "align_4096", "sum_1", "sum_4096", "permute_4096", "fp8_4096",
           "combine_4096")


def make(case):
    kind, m = case.rsplit("_", 1)
    M = int(m)
    g = torch.Generator(device="cuda").manual_seed(M)
    dev = "cuda"
    if kind == "route":
        x = torch.randn((M, 128), device=dev, generator=g).to(torch.bfloat16)
        return lambda: loomnb.topk_softmax(x, 8, True)
    if kind == "sigmoid":
        x = torch.randn((M, 256), device=dev, generator=g)
        b = torch.randn(256, device=dev, generator=g) * 0.1
        return lambda: loomnb.topk_sigmoid(x, 8, True, e_score_correction_bias=b)
    if kind == "grouped":
        x = torch.randn((M, 256), device=dev, generator=g)
        b = torch.randn(256, device=dev, generator=g) * 0.1
        return lambda: loomnb.grouped_topk(x, x, 8, True, 8, 4, "sigmoid", 2.5, b)
    ids = torch.argsort(torch.rand((M, 256), device=dev, generator=g), 1)[:, :8].int()
    if kind == "align":
        return lambda: loomnb.moe_align_block_size(ids, 64, 256)
    if kind == "sum":
        x = torch.randn((M, 8, 4096), device=dev, generator=g).to(torch.bfloat16)
        out = torch.empty((M, 4096), device=dev, dtype=torch.bfloat16)
        return lambda: loomnb.moe_sum(x, out=out)
    s, _, _ = loomnb.moe_align_block_size(ids, 64, 256)
    h = torch.randn((M, 2048), device=dev, generator=g).to(torch.bfloat16)
    if kind == "permute":
        return lambda: loomnb.moe_permute(h, s, 8)
    if kind == "fp8":
        return lambda: loomnb.moe_permute(h, s, 8, "fp8")
    y = torch.randn((s.shape[0], 2048), device=dev, generator=g).to(torch.bfloat16)
    w = torch.rand((M, 8), device=dev, generator=g)
    return lambda: loomnb.moe_unpermute(y, s, w)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(DEFAULT))
    ap.add_argument("--once", action="store_true")
    args = ap.parse_args(argv)
    for case in args.cases.split(","):
        call = make(case)
        call()
        torch.cuda.synchronize()
        if args.once:
            call()
            torch.cuda.synchronize()
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            call()
        end.record()
        torch.cuda.synchronize()
        print(f"{case}: {start.elapsed_time(end) * 1000 / 200:.1f} us a call (eager)")


if __name__ == "__main__":
    main()
