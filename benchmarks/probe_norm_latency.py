"""Where does a small-batch rms_norm spend its time? A probe, not a benchmark of the product.

At 1-128 rows x 4096 bf16 the kernel is latency-bound: a graph-replayed launch, one DRAM round
trip for x and the weight, a block reduction, the inverse RMS, one store. This builds variants
of the register-cached kernel that each change one thing and times them in one process with
CUDA-graph replay, beside loomnb.rms_norm itself, torch.compile of the torch composite, and
Liger-Kernel (when importable):

* ``threads``: 512 x 1, 256 x 2, 128 x 4, 64 x 8 (16-byte units a thread);
* ``acc``: the sum of squares in float64 (loomnb's contract) or float32 (what Liger and vLLM do);
* ``inv``: ``1/sqrt`` in float64 (div.rn + sqrt.rn), float64 ``rsqrt.approx`` + two Newton
  steps, or float32 ``rsqrtf``;
* floors: an empty kernel with the same parameters (the launch), and a copy (load x and w,
  store out: the memory round trip without the reduction).

    python3 benchmarks/probe_norm_latency.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from numba import cuda, float32, float64, uint32

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

from loomnb import _adapter as ad  # noqa: E402
from loomnb._numba_internals import FastKernel  # noqa: E402
from loomnb.ops import _launch as L  # noqa: E402
from loomnb.ops._reduce import REDUCE_SCRATCH, block_reduce, fadd  # noqa: E402
from loomnb.ops._vector import CODECS, load_u32x4, unit_io  # noqa: E402

block_sum32 = block_reduce(fadd, float32)
block_sum64 = block_reduce(fadd, float64)
unpack, rnd = CODECS["bf16"].unpack, CODECS["bf16"].rnd
_, store8, _ = unit_io("bf16")


def make_kernel(vpt, acc, inv, work=True):
    NW, NS = 4 * vpt, 8 * vpt

    def kernel(out, x, weight, eps, H):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        nv = H >> 3
        if not work:
            if tid == 0 and row == 0 and H < 0:
                out[0, 0] = 0
            return
        xr, orow = x[row], out[row]
        xw = cuda.local.array(NW, uint32)
        ww = cuda.local.array(NW, uint32)
        vals = cuda.local.array(NS, float32)
        wv = cuda.local.array(NS, float32)
        for j in range(vpt):
            u = tid + j * nt
            if u < nv:
                a = load_u32x4(weight, u << 2)
                b = load_u32x4(xr, u << 2)
                for k in range(4):
                    ww[4 * j + k] = a[k]
                    xw[4 * j + k] = b[k]
        for k in range(NW):
            lo, hi = unpack(xw[k])
            vals[2 * k], vals[2 * k + 1] = lo, hi
            lo, hi = unpack(ww[k])
            wv[2 * k], wv[2 * k + 1] = lo, hi
        if acc == "copy":
            invv = float32(1.0)
        elif acc == "f64":
            sm = cuda.shared.array(REDUCE_SCRATCH, float64)
            ss = float64(0)
            for k in range(NS):
                ss += float64(vals[k]) * float64(vals[k])
            ss = block_sum64(ss, sm)
            m = ss / float64(H) + float64(eps)
            if inv == "div":
                invv = float32(float64(1.0) / math.sqrt(m))
            else:  # rsqrt approx in float32 widened, then two Newton steps in float64
                y = float64(cuda.libdevice.rsqrtf(float32(m)))
                y = y * (float64(1.5) - float64(0.5) * m * y * y)
                y = y * (float64(1.5) - float64(0.5) * m * y * y)
                invv = float32(y)
        else:
            sm = cuda.shared.array(REDUCE_SCRATCH, float32)
            s32 = float32(0)
            for k in range(NS):
                s32 += vals[k] * vals[k]
            s32 = block_sum32(s32, sm)
            invv = cuda.libdevice.rsqrtf(s32 / float32(H) + eps)
        for k in range(NS):
            vals[k] = rnd(vals[k] * invv) * wv[k]
        for j in range(vpt):
            u = tid + j * nt
            if u < nv:
                store8(orow, u, vals, j)

    kernel.__name__ = f"probe_v{vpt}_{acc}_{inv}_{'work' if work else 'empty'}"
    return kernel


def launcher(pyfunc, x, w, out, threads):
    xa, wa, oa = (ad.wrap("probe", n, t) for n, t in (("x", x), ("w", w), ("out", out)))
    params = [L.array(oa, words=True), L.array(xa, words=True), L.array(wa, words=True),
              L.f32(1e-6), L.i64(x.shape[1])]
    fk = FastKernel(cuda.jit(pyfunc), L.argtypes(params), pyfunc.__name__)
    prepared = fk.prepare(0, x.shape[0], threads, [v for p in params for v in p.gpu_values()])
    return lambda: prepared.launch(torch.cuda.current_stream().cuda_stream)


def torch_rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--rows", default="1,8,32,128,256,1024,16384")
    p.add_argument("--hidden", type=int, default=4096)
    args = p.parse_args(argv)
    rows_list = [int(v) for v in args.rows.split(",")]
    Hs = args.hidden
    variants = [("empty 512x1", 1, "f64", "div", False, 512)]
    for vpt, threads in ((1, 512), (2, 256), (4, 128), (8, 64)):
        variants += [(f"copy {threads}x{vpt}", vpt, "copy", "div", True, threads),
                     (f"f64+div {threads}x{vpt}", vpt, "f64", "div", True, threads),
                     (f"f64+newton {threads}x{vpt}", vpt, "f64", "newton", True, threads),
                     (f"f32+rsqrtf {threads}x{vpt}", vpt, "f32", "rsqrtf", True, threads)]
    peers = {"loomnb.rms_norm": None, "torch.compile": torch.compile(torch_rms, dynamic=False)}
    try:
        from liger_kernel.ops.rms_norm import rms_norm_forward
        peers["liger"] = rms_norm_forward
    except Exception as e:  # noqa: BLE001
        print("liger unavailable:", repr(e)[:200])
    import loomnb
    results = []
    copy = H.copy_bandwidth(1 << 30)
    print(f"copy bandwidth {copy['GBps']:.0f} GB/s")
    for rows in rows_list:
        g = torch.Generator(device="cuda").manual_seed(rows)
        x = torch.randn(rows, Hs, generator=g, device="cuda").to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(Hs, generator=g, device="cuda")).to(torch.bfloat16)
        out = torch.empty_like(x)
        bf16 = loomnb._dtypes.numpy_dtype("bf16")
        host = lambda t: t.view(torch.int16).cpu().numpy().view(bf16)  # noqa: E731
        want = loomnb.oracle.rms_norm(host(x), host(w), 1e-6) if rows <= 1024 else None
        calls = {}
        for name, vpt, acc, inv, work, threads in variants:
            if threads * vpt * 8 < Hs:
                continue
            calls[name] = launcher(make_kernel(vpt, acc, inv, work), x, w, out, threads)
        calls["loomnb.rms_norm"] = lambda: loomnb.rms_norm(x, w, 1e-6, out=out)
        calls["torch.compile"] = lambda: peers["torch.compile"](x, w, 1e-6)
        if "liger" in peers:
            calls["liger"] = lambda: peers["liger"](x, w, 1e-6, 0.0, "llama", None)
        names = list(calls)
        for order in (names, names[::-1]):
            for name in order:
                try:
                    t = H.time_graph(calls[name], target_ms=1.0, repeats=9)
                    exact = None
                    if want is not None and name.startswith(("f64", "f32", "loomnb")):
                        calls[name]()
                        torch.cuda.synchronize()
                        got = out.view(torch.int16).cpu().numpy()
                        exact = float((got == want.view(np.int16)).mean())
                    results.append({"rows": rows, "name": name, "us": t["us"], "us_min": t["us_min"],
                                    "exact_vs_oracle": exact, "pass": "fwd" if order is names else "rev"})
                except Exception as e:  # noqa: BLE001
                    results.append({"rows": rows, "name": name, "error": repr(e)[:300]})
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"probe_norm_latency_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"meta": H.env_metadata("cuda", packages=("liger-kernel",)),
                                "copy_GBps": copy["GBps"], "results": results}, indent=1))
    by = {}
    for r in results:
        if "us" in r:
            by.setdefault((r["name"], r["rows"]), []).append(r["us"])
    names = list(dict.fromkeys(r["name"] for r in results))
    print(f"{'variant':24s}" + "".join(f"{n:>9d}" for n in rows_list))
    for n in names:
        cells = [by.get((n, rr)) for rr in rows_list]
        print(f"{n:24s}" + "".join(f"{(sum(c) / len(c)):9.2f}" if c else f"{'-':>9s}" for c in cells))
    ex = {(r["name"], r["rows"]): r["exact_vs_oracle"] for r in results if r.get("exact_vs_oracle") is not None}
    print("exact vs oracle (1 row):", {k[0]: v for k, v in ex.items() if k[1] == rows_list[0]})
    errs = [r for r in results if "error" in r]
    if errs:
        print("errors:", errs[:3])
    print("wrote", path)


if __name__ == "__main__":
    main()
