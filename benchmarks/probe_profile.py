"""Eager calls of one loomnb op at one shape, for a profiler to look at (Nsight Compute):

    ncu --clock-control none -k regex:paged_decode --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        python3 benchmarks/probe_profile.py attention --num-seqs 32 --context 4096

A probe, not a benchmark: it times nothing. ``attention``: ``paged_decode_attention`` over the
bench's shuffled block-16 NHD cache (``--geometry``, ``--cache``); ``silu``: ``silu_and_mul``
of ``[num_tokens, 2 * d]`` bf16; ``silu_group``: ``silu_and_mul_per_token_group_quant_fp8``
(group 128); ``greedy``: ``greedy_sample_logprob`` (V1) of ``[num_rows, vocab]`` fp32 logits;
``min_p``: ``min_p_filter_`` (V1) on them; ``rope``: ``rotary_embedding_and_cache`` of
``--num-tokens`` tokens (``--geometry``, bf16 cache) over the RoPE bench's fused QKV buffer;
``quant_tensor`` / ``quant_token`` / ``quant_group``: ``dynamic_scaled_fp8_quant``,
``dynamic_per_token_scaled_fp8_quant`` and ``per_token_group_quant_fp8`` (group 128) of
``[num_tokens, d]`` bf16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loomnb  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("op", choices=("attention", "silu", "silu_group", "greedy", "min_p", "rope",
                                   "quant_tensor", "quant_token", "quant_group"))
    p.add_argument("--num-rows", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--geometry", default="32/8/128")
    p.add_argument("--cache", default="bf16", choices=("bf16", "fp8"))
    p.add_argument("--num-tokens", type=int, default=4096)
    p.add_argument("--d", type=int, default=11008)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--sampler", default="v1", choices=("v1", "v2"), help="min_p's sampler")
    args = p.parse_args(argv)
    if args.op == "attention":
        import bench_attention as B
        hq, hk, hd = B.GEOMETRIES[args.geometry]
        case = {"num_heads": hq, "num_kv_heads": hk, "head_size": hd, "block_size": B.BLOCK_SIZE,
                "cache": args.cache, "num_seqs": args.num_seqs, "context": args.context,
                "dtype": "bf16"}
        t = B.make_inputs(case, "cuda", 0)
        fp8 = args.cache == "fp8"

        def call():
            loomnb.paged_decode_attention(
                t["query"], t["key_cache"], t["value_cache"], t["block_tables"], t["seq_lens"],
                hd ** -0.5, kv_cache_dtype="fp8" if fp8 else "auto",
                k_scale=t["k_scale"] if fp8 else None, v_scale=t["v_scale"] if fp8 else None,
                out=t["out"])
    elif args.op == "rope":
        import bench_rope_cache as B
        hq, hk, hd = B.GEOMETRIES[args.geometry]
        t = B.make_inputs({"num_tokens": args.num_tokens, "num_heads": hq, "num_kv_heads": hk,
                           "head_size": hd, "kv": "bf16"}, "cuda", 0)

        def call():
            loomnb.rotary_embedding_and_cache(
                t["positions"], t["query"], t["key"], t["value"], t["key_cache"],
                t["value_cache"], t["slot_mapping"], hd, t["cos_sin_cache"], True)
    elif args.op in ("greedy", "min_p"):
        logits = torch.randn(args.num_rows, args.vocab, device="cuda") * 3
        min_p = torch.full((args.num_rows,), 0.1, device="cuda")

        def call():
            if args.op == "greedy":
                loomnb.greedy_sample_logprob(logits)
            else:
                loomnb.min_p_filter_(logits, min_p, args.sampler)
    elif args.op.startswith("quant_"):
        y = torch.randn(args.num_tokens, args.d, dtype=torch.bfloat16, device="cuda")
        quant = {"quant_tensor": loomnb.dynamic_scaled_fp8_quant,
                 "quant_token": loomnb.dynamic_per_token_scaled_fp8_quant,
                 "quant_group": lambda a: loomnb.per_token_group_quant_fp8(a, 128)}[args.op]

        def call():
            quant(y)
    else:
        x = torch.randn(args.num_tokens, 2 * args.d, dtype=torch.bfloat16, device="cuda")
        if args.op == "silu":
            out = torch.empty(args.num_tokens, args.d, dtype=torch.bfloat16, device="cuda")

            def call():
                loomnb.silu_and_mul(x, out=out)
        else:
            def call():
                loomnb.silu_and_mul_per_token_group_quant_fp8(x, 128)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    print("done", args)


if __name__ == "__main__":
    main()
