"""Eager per-call host overhead: microseconds of Python + launch per call, GPU not the bottleneck.

Each op runs on a 1 x 4096 bf16 row (a ~2 us kernel) in a loop of N calls with no
synchronisation inside; host time per call = wall time / N (launches are asynchronous, so this
is what the Python caller pays). Peers: a plain torch op (``torch.mul``), and vLLM's
``torch.ops._C.rms_norm`` when ``--vllm-lib`` / ``$LOOMNB_VLLM_LIB`` is given.

    python3 benchmarks/bench_overhead.py --out benchmarks/results
"""

import argparse
import json
import os
import time

import torch

import loomnb


def per_call_us(fn, n=5000, repeats=5):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    best.sort()
    return best[len(best) // 2]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-lib", default=os.environ.get("LOOMNB_VLLM_LIB"))
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, device="cuda").bfloat16()
    r, out = torch.randn_like(x), torch.empty_like(x)
    q = torch.empty(1, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(1, 1, device="cuda")
    cases = {
        "loomnb.rms_norm (allocates out)": lambda: loomnb.rms_norm(x, w, 1e-6),
        "loomnb.rms_norm (out=)": lambda: loomnb.rms_norm(x, w, 1e-6, out=out),
        "loomnb.fused_add_rms_norm": lambda: loomnb.fused_add_rms_norm(x, r, w, 1e-6),
        "loomnb.rms_norm_dynamic_per_token_quant (out=, scales=)":
            lambda: loomnb.rms_norm_dynamic_per_token_quant(x, w, 1e-6, out=q, scales=s),
        "torch.mul(x, 2.0, out=)": lambda: torch.mul(x, 2.0, out=out),
        "torch.mul(x, 2.0) (allocates)": lambda: torch.mul(x, 2.0),
    }
    if args.vllm_lib:
        torch.ops.load_library(args.vllm_lib)
        cases["vllm torch.ops._C.rms_norm"] = lambda: torch.ops._C.rms_norm(out, x, w, 1e-6)
    rows = {name: per_call_us(fn) for name, fn in cases.items()}
    for name, us in rows.items():
        print(f"{name:58s} {us:7.2f} us/call")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"overhead_{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "us_per_call": rows}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
