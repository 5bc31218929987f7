"""Eager per-call host overhead: microseconds of Python + launch per call, GPU not the bottleneck.

Each op runs on a 1 x 4096 bf16 row (a ~2 us kernel) in a loop of N calls with no
synchronisation inside; host time per call = wall time / N (launches are asynchronous, so this
is what the Python caller pays). Peers in the same process: plain torch ops (``torch.mul``,
``torch.add``), and vLLM's ``torch.ops._C.rms_norm`` / ``fused_add_rms_norm`` when
``--vllm-lib`` / ``$LOOMNB_VLLM_LIB`` is given. Every case runs in the listed order and again
in reverse; the reported value is the median of both passes' medians.

The breakdown times the pieces of loomnb's fast path on their own: the key (a dozen tensor
attribute reads), the cache lookup, torch's current-stream lookup and the bare driver call
(``cuLaunchKernel`` through ``cuda.bindings``), which is the floor of any launch from Python.
Host CPUs differ between machines by 1.5x and more, so compare within one file only.

    python3 benchmarks/bench_overhead.py --out benchmarks/results
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import torch  # noqa: E402

import loomnb  # noqa: E402
from loomnb.ops import _launch as L  # noqa: E402


def per_call_us(fn, n=20000, repeats=7):
    """Median host time to issue one call (the harness's eager timer, ``host_us``)."""
    return H.time_eager(fn, n, repeats=repeats, warmup=500)["host_us"]


def host_cpu():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-lib", default=os.environ.get("LOOMNB_VLLM_LIB"))
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--n", type=int, default=20000, help="calls per timed loop")
    args = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 4096, device="cuda", generator=g).bfloat16()
    w = torch.randn(4096, device="cuda", generator=g).bfloat16()
    r, out = torch.randn_like(x), torch.empty_like(x)
    q = torch.empty(1, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(1, 1, device="cuda")
    scale = torch.tensor([0.05], device="cuda")
    cases = {
        "loomnb.rms_norm (out=)": lambda: loomnb.rms_norm(x, w, 1e-6, out=out),
        "loomnb.rms_norm (allocates out)": lambda: loomnb.rms_norm(x, w, 1e-6),
        "loomnb.fused_add_rms_norm": lambda: loomnb.fused_add_rms_norm(x, r, w, 1e-6),
        "loomnb.rms_norm_static_fp8_quant": lambda: loomnb.rms_norm_static_fp8_quant(x, w, scale, 1e-6, out=q),
        "loomnb.rms_norm_dynamic_per_token_quant (out=, scales=)":
            lambda: loomnb.rms_norm_dynamic_per_token_quant(x, w, 1e-6, out=q, scales=s),
        "torch.ops.loomnb.rms_norm.out": lambda: torch.ops.loomnb.rms_norm.out(x, w, 1e-6, out=out),
        "torch.ops.loomnb.rms_norm (allocates)": lambda: torch.ops.loomnb.rms_norm(x, w, 1e-6),
        "torch.ops.loomnb.fused_add_rms_norm": lambda: torch.ops.loomnb.fused_add_rms_norm(x, r, w, 1e-6),
        "torch.mul(x, 2.0, out=)": lambda: torch.mul(x, 2.0, out=out),
        "torch.add(x, r, out=)": lambda: torch.add(x, r, out=out),
        "torch.mul(x, 2.0) (allocates)": lambda: torch.mul(x, 2.0),
    }
    if args.vllm_lib:
        torch.ops.load_library(args.vllm_lib)
        cases["vllm torch.ops._C.rms_norm"] = lambda: torch.ops._C.rms_norm(out, x, w, 1e-6)
        cases["vllm torch.ops._C.fused_add_rms_norm"] = lambda: torch.ops._C.fused_add_rms_norm(x, r, w, 1e-6)

    # the fast path's pieces, on the remembered rms_norm(out=) launch
    loomnb.rms_norm(x, w, 1e-6, out=out)
    key = L.key3("rms_norm", 1e-6, "twice", x, w, out)
    prepared = L._cache[key].prepared
    stream = torch.cuda.current_stream().cuda_stream
    components = {
        "key (_launch.key3: 3 tensors x ptr/shape/stride/dtype)": lambda: L.key3("rms_norm", 1e-6, "twice", x, w, out),
        "cache lookup (dict.get)": lambda: L._cache.get(key),
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "torch current-stream lookup": lambda: torch._C._cuda_getCurrentRawStream(0),
        "bare driver call (cuda.bindings cuLaunchKernel)":
            lambda: prepared.driver_call(stream, prepared.params, 0),
    }

    names = list(cases)
    passes = {"forward": names, "reversed": names[::-1]}
    results = {}
    for label, order in passes.items():
        results[label] = {name: per_call_us(cases[name], args.n) for name in order}
    rows = {name: statistics.median(results[p][name] for p in passes) for name in names}
    parts = {name: per_call_us(fn, args.n) for name, fn in components.items()}
    base = rows["torch.mul(x, 2.0, out=)"]
    print(f"host CPU: {host_cpu()}")
    for name, us in rows.items():
        print(f"{name:58s} {us:7.2f} us/call  ({us / base:4.2f}x torch.mul(out=);"
              f" forward {results['forward'][name]:.2f}, reversed {results['reversed'][name]:.2f})")
    print("fast-path pieces:")
    for name, us in parts.items():
        print(f"  {name:56s} {us:7.2f} us")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"overhead_{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "host_cpu": host_cpu(), "calls_per_loop": args.n,
                   "us_per_call": rows, "passes": results, "fast_path_pieces_us": parts}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
